"""GGUF architectures whose attention weights the converter keeps fused: StarCoder
(``starcoder``: Hugging Face's gpt_bigcode) and MPT (``mpt``). Each an ``archs.Arch``,
registered in ``ARCHS``; each reads as its family's folder does (``sources.<family>``'s name
map, ``fused.grouped_rows`` or ``stacked_rows`` cutting the fused matrix).

What the converter (``convert_hf_to_gguf.py``) does: StarCoder's ``c_attn`` (``nn.Linear``'s,
not GPT-2's ``Conv1D``) and MPT's ``Wqkv`` are written as they were; nothing is undone.

Metadata that does not describe the model, and is not read:

- StarCoder's ``head_count_kv`` is 1 whatever ``multi_query`` was, and its
  ``feed_forward_length`` 4 x width whatever ``n_inner`` was: the key heads are read from
  ``attn_qkv``'s rows (one key head, or one a head), the FFN's width from ``ffn_up``'s.
  (llama.cpp itself cannot load a StarCoder file without ``multi_query``.)
- MPT's ``layer_norm_epsilon`` is 1e-5 whatever the config said (the converter writes the
  number); read as written, as llama.cpp runs it.

What no key records, and tfm assumes as the family's Hugging Face default (its ``--arch``
preset): the activation, GELU itself (``gelu_erf``) for MPT, its tanh form (``gelu``) for
StarCoder (llama.cpp computes both with the tanh form); StarCoder's scores scaled by
1 / sqrt(d_head) (``scale_attn_weights``) and MPT's too (``softmax_scale`` unset).
"""

from __future__ import annotations

import numpy as np

from tfmcli.errors import TfmError
from tfmcli.sources import fused
from tfmcli.sources.folder import shown
from tfmcli.sources.gguf.archs import Arch, family_fields
from tfmcli.sources.gguf.meta import Meta

PICKED = ("W_Q", "W_K", "W_V", "b_Q", "b_K", "b_V")


def sizes(m: Meta) -> dict:
    """What every one of these files says alike: width, heads, blocks, vocabulary (the rows of
    ``token_embd``), the layer norms' epsilon, and a tied head when there is no
    ``output.weight``."""
    d, H = m.size("embedding_length"), m.size("attention.head_count")
    if d % H:
        raise TfmError(f"--load {m.path}: key {m.key('attention.head_count')!r} ({H}) does not "
                       f"divide {m.key('embedding_length')!r} ({d})")
    V, width = m.shape("token_embd.weight")
    if width != d:
        raise TfmError(f"--load {m.path}: tensor 'token_embd.weight' is {width} wide, and key "
                       f"{m.key('embedding_length')!r} is {d}")
    return {"d_model": d, "heads": H, "layers": m.size("block_count"), "vocab": V,
            "eps": m.number("attention.layer_norm_epsilon"),
            "tied_head": not m.has("output.weight")}


def ffn_width(m: Meta) -> int:
    return m.shape("blk.0.ffn_up.weight")[0]   # (d_ff, d), as nn.Linear keeps it


# ---------------------------------------------------------------------------- the fused matrix

def grouped(fields: dict) -> dict[str, np.ndarray]:
    """Q's, K's and V's rows in Hugging Face's fused matrix: one piece per key head."""
    return dict(zip("QKV", fused.grouped_rows(fields)))


def picking(rows_of):
    """An ``Arch.pick`` cutting each fused key into the rows ``rows_of(fields)`` gives Q, K and
    V (``grouped`` or ``fused.stacked_rows``), as the family's folder reader does."""
    def pick(rows, shapes, fields):
        picks = rows_of(fields)

        def rows_for(name: str):
            last = name.rsplit(".", 1)[-1]
            return picks[last[-1]] if last in PICKED else None
        return rows_for
    return pick


# ---------------------------------------------------------------------------- StarCoder

def starcoder_fields(m: Meta) -> dict:
    """GPTBigCode's: GPT-2's block with ``nn.Linear`` weights and one key head
    (``multi_query``), or a key head each; the key heads from ``attn_qkv``'s rows, not from
    ``head_count_kv`` (1 whatever the model)."""
    s = sizes(m)
    d, H = s["d_model"], s["heads"]
    n_ctx, pos_width = m.shape("position_embd.weight")
    if pos_width != d:
        raise TfmError(f"--load {m.path}: tensor 'position_embd.weight' is {pos_width} wide, "
                       f"and key {m.key('embedding_length')!r} is {d}")
    rows = m.shape("blk.0.attn_qkv.weight")[0]
    kv = {d + 2 * (d // H): 1, 3 * d: H}.get(rows)
    if kv is None:
        raise TfmError(f"--load {m.path}: tensor 'blk.0.attn_qkv.weight' has {rows} rows, "
                       f"neither one key head's ({d + 2 * (d // H)}, multi_query) nor one a "
                       f"head's ({3 * d}); GPTBigCode has one or the other")
    F = ffn_width(m)
    return family_fields("gpt_bigcode", **s, n_ctx=n_ctx, kv_heads=1 if kv == 1 else None,
                         d_ff=None if F == 4 * d else F)   # (as n_inner null reads)


def starcoder_rows(fields: dict) -> list:
    from tfmcli.sources import gpt_bigcode

    return gpt_bigcode.name_map(fields)


# ---------------------------------------------------------------------------- MPT

def mpt_fields(m: Meta) -> dict:
    """MPT's: ALiBi of the paper's slopes (``max_alibi_bias`` 8), no biases, layer norms
    without beta, every head its own keys; q, k and v unclamped."""
    s = sizes(m)
    if m.get("attention.clamp_kqv") is not None:
        raise TfmError(f"--load {m.path}: key {m.key('attention.clamp_kqv')!r} is "
                       f"{shown(m.get('attention.clamp_kqv'))} (q, k and v clamped), which tfm "
                       f"does not compute")
    alibi = m.get("attention.max_alibi_bias")
    if alibi != 8:
        raise TfmError(f"--load {m.path}: key {m.key('attention.max_alibi_bias')!r} is "
                       f"{shown(alibi)}; tfm runs MPT with ALiBi's slopes of alibi_bias_max 8")
    kv = m.size("attention.head_count_kv", s["heads"])
    if kv != s["heads"]:
        raise TfmError(f"--load {m.path}: key {m.key('attention.head_count_kv')!r} is {kv}, "
                       f"not {m.key('attention.head_count')!r} ({s['heads']}); tfm reads MPT's "
                       f"multihead_attention, each head its own keys")
    return family_fields("mpt", **s, d_ff=ffn_width(m))


def mpt_rows(fields: dict) -> list:
    from tfmcli.sources import mpt

    return mpt.name_map(fields)


ARCHS: dict = {   # general.architecture -> archs.Arch
    "starcoder": Arch("gpt_bigcode", starcoder_fields, starcoder_rows, pick=picking(grouped)),
    "mpt": Arch("mpt", mpt_fields, mpt_rows, pick=picking(fused.stacked_rows)),
}
