"""GGUF architectures whose attention weights the converter keeps fused: StarCoder
(``starcoder``: Hugging Face's gpt_bigcode), GPT-NeoX (``gptneox``), Falcon (``falcon``), BLOOM
(``bloom``) and MPT (``mpt``). Each an ``archs.Arch``, registered in ``ARCHS``; each reads as its
family's folder does (``sources.<family>``'s name map, ``fused.grouped_rows`` or
``stacked_rows`` cutting the fused matrix), once what llama.cpp's converter did is undone.

What the converter (``convert_hf_to_gguf.py``) does, and what is undone here:

- GPT-NeoX's and BLOOM's ``query_key_value`` holds each head's q, k and v rows in turn
  (``(H, 3, d_head)``); the converter reorders them into every head's q, then every k, then
  every v (``qkv.reshape(H, 3, d_head, d)``, the three slices concatenated), weight and bias.
- Falcon's holds one piece per key head, its queries, then its key, then its value; the
  converter reorders it the same way, by ``head_count_kv`` groups (``tensor_data_layout``
  "jploski"; with one key head, 7B's, the two orders are one). The three are put back
  (``regroup``): the file's row i is Hugging Face's row ``order[i]``, ``order`` the rows
  ``fused.grouped_rows`` gives Q, K and V, in turn.
- StarCoder's ``c_attn`` (``nn.Linear``'s, not GPT-2's ``Conv1D``) and MPT's ``Wqkv`` are
  written as they were.

Metadata that does not describe the model, and is not read:

- StarCoder's ``head_count_kv`` is 1 whatever ``multi_query`` was, and its
  ``feed_forward_length`` 4 x width whatever ``n_inner`` was: the key heads are read from
  ``attn_qkv``'s rows (one key head, or one a head), the FFN's width from ``ffn_up``'s.
  (llama.cpp itself cannot load a StarCoder file without ``multi_query``.)
- Falcon's and BLOOM's ``feed_forward_length`` is 4 x width, whatever ``ffn_hidden_size`` was:
  Falcon's width is read from ``ffn_up``. BLOOM's ``context_length`` is its width when the
  config has no ``seq_length`` (ALiBi reads neither).
- MPT's ``layer_norm_epsilon`` is 1e-5 whatever the config said (the converter writes the
  number); read as written, as llama.cpp runs it.

What no key records, and tfm assumes as the family's Hugging Face default (its ``--arch``
preset): the activation, GELU itself (``gelu_erf``) for GPT-NeoX, Falcon and MPT, its tanh form
(``gelu``) for StarCoder and BLOOM (llama.cpp computes every one with the tanh form); RoPE's
base for GPT-NeoX and Falcon, 10000 unless ``rope.freq_base`` says (the converter writes none,
so a model of another ``rope_theta`` runs at 10000, as in llama.cpp); StarCoder's scores scaled
by 1 / sqrt(d_head) (``scale_attn_weights``) and MPT's too (``softmax_scale`` unset). A Falcon
file is always parallel (llama.cpp's graph is; the converter cannot map a sequential block's
``post_attention_layernorm``): on one norm, or on two (``attn_norm_2`` feeds attention,
``attn_norm`` the FFN: Hugging Face's ``ln_attn`` and ``ln_mlp``).
"""

from __future__ import annotations

import numpy as np

from tfmcli.errors import TfmError
from tfmcli.sources import fused
from tfmcli.sources.folder import shown
from tfmcli.sources.gguf.archs import Arch, family_fields
from tfmcli.sources.gguf.meta import Meta

QKV = (".query_key_value.weight", ".query_key_value.bias")   # the keys the converter reorders
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


def rope_base(m: Meta) -> dict:
    """RoPE's base (10000 when the file says none, as the converter never does here), after
    refusing a scaling, which these converters never write either."""
    kind = m.get("rope.scaling.type", "none")
    if kind != "none":
        raise TfmError(f"--load {m.path}: key {m.key('rope.scaling.type')!r} is {shown(kind)}; "
                       f"tfm turns {m.arch}'s RoPE by its own angles")
    return {"rope_theta": m.number("rope.freq_base", 10000.0)}


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


def regroup(w: np.ndarray, fields: dict) -> np.ndarray:
    """The inverse of the converter's reorder: rows (or a bias's entries) stored as every q,
    every k, every v, put back one piece per key head, as Hugging Face stores them."""
    order = np.concatenate(fused.grouped_rows(fields))   # the file's row i is HF's order[i]
    out = np.empty_like(w)
    out[order] = w
    return out


def undo_qkv(key: str, w: np.ndarray, fields: dict) -> np.ndarray:
    return regroup(w, fields) if key.endswith(QKV) else w


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


# ---------------------------------------------------------------------------- GPT-NeoX

def gptneox_fields(m: Meta) -> dict:
    """GPT-NeoX's, Pythia's: RoPE on the first ``rope.dimension_count`` of each head, the
    block parallel when ``use_parallel_residual`` says, biases on attention when the file holds
    them (``attention_bias``; the MLP's always)."""
    s = sizes(m)
    d_head = s["d_model"] // s["heads"]
    turned = m.size("rope.dimension_count", d_head)
    if turned > d_head or turned % 2:
        raise TfmError(f"--load {m.path}: key {m.key('rope.dimension_count')!r} is {turned}; "
                       f"RoPE turns pairs of a head's {d_head} dimensions")
    attention_bias = m.has("blk.0.attn_qkv.bias")
    return family_fields("gpt_neox", **s, d_ff=m.size("feed_forward_length"),
                         rotary_dim=None if turned == d_head else turned, **rope_base(m),
                         parallel_residual=m.switch("use_parallel_residual", True),
                         bias=attention_bias, ffn_bias=not attention_bias)


def gptneox_rows(fields: dict) -> list:
    from tfmcli.sources import gpt_neox

    return gpt_neox.name_map(fields)


# ---------------------------------------------------------------------------- Falcon

def falcon_fields(m: Meta) -> dict:
    """Falcon's: attention and the MLP side by side, on one norm (7B's, Falcon 2's) or two
    (``attn_norm_2``: 40B's, 180B's); ``head_count_kv`` key heads; biases as the file holds
    them; the FFN's width from ``ffn_up``."""
    s = sizes(m)
    d_head, H = s["d_model"] // s["heads"], s["heads"]
    layout = m.get("tensor_data_layout", "jploski")
    if layout != "jploski":
        raise TfmError(f"--load {m.path}: key {m.key('tensor_data_layout')!r} is "
                       f"{shown(layout)}; tfm reads the converter's 'jploski' layout of "
                       f"query_key_value (every q, every k, every v)")
    kv = m.size("attention.head_count_kv", H)
    if H % kv:
        raise TfmError(f"--load {m.path}: key {m.key('attention.head_count_kv')!r} ({kv}) does "
                       f"not divide {m.key('attention.head_count')!r} ({H})")
    turned = m.size("rope.dimension_count", d_head)
    if turned != d_head:
        raise TfmError(f"--load {m.path}: key {m.key('rope.dimension_count')!r} is {turned}, "
                       f"not the head's width; Falcon turns all of each head")
    return family_fields("falcon", **s, kv_heads=None if kv == H else kv, d_ff=ffn_width(m),
                         bias=m.has("blk.0.attn_qkv.bias"), parallel_residual=True,
                         shared_norm=not m.has("blk.0.attn_norm_2.weight"),
                         **rope_base(m))


def falcon_rows(fields: dict) -> list:
    from tfmcli.sources import falcon

    return falcon.name_map(fields)


# ---------------------------------------------------------------------------- BLOOM

def bloom_fields(m: Meta) -> dict:
    """BLOOM's: ALiBi, the embedding normed (``token_embd_norm``), every head its own keys."""
    s = sizes(m)
    kv = m.size("attention.head_count_kv", s["heads"])
    if kv != s["heads"]:
        raise TfmError(f"--load {m.path}: key {m.key('attention.head_count_kv')!r} is {kv}, "
                       f"not {m.key('attention.head_count')!r} ({s['heads']}); BLOOM's every "
                       f"head has its own keys")
    return family_fields("bloom", **s)


def bloom_rows(fields: dict) -> list:
    from tfmcli.sources import bloom

    return bloom.name_map(fields, prefix="")   # (the converter strips "transformer.")


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
    "gptneox": Arch("gpt_neox", gptneox_fields, gptneox_rows, pick=picking(grouped),
                    undo=undo_qkv),
    "falcon": Arch("falcon", falcon_fields, falcon_rows, pick=picking(grouped), undo=undo_qkv),
    "bloom": Arch("bloom", bloom_fields, bloom_rows, pick=picking(grouped), undo=undo_qkv),
    "mpt": Arch("mpt", mpt_fields, mpt_rows, pick=picking(fused.stacked_rows)),
}
