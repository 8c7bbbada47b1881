"""The GGUF architectures tfm runs, each a few lines: the Hugging Face family whose model it
is (tfm's ``--arch`` preset, and ``sources.<family>``'s name map: its keys are turned into the
file's tensor names by ``gguf``'s own ``TensorNameMap``), the Config read from the file's
metadata and tensors, and what llama.cpp's converter (``convert_hf_to_gguf.py``) did to each
tensor, undone, so that every tensor reaches the family's reader as Hugging Face stored it.

What the converter does that is undone here:

- LLaMA (``llama``: LLaMA, Mistral): the rows of ``q_proj`` and ``k_proj`` (and their
  biases) reordered for llama.cpp's RoPE, which turns neighbouring pairs (2i, 2i + 1) where
  Hugging Face turns (i, i + d_head / 2): its ``permute(w, n_head, n_head_kv)``, each head's
  rows ``reshape(n, 2, d_head / 2).swapaxes(1, 2)``, with K's heads the key heads. Its
  inverse swaps them back. Qwen2, Qwen3, Gemma, Phi-3 and StableLM are not permuted (their
  llama.cpp graphs turn Hugging Face's pairs).
- GPT-2: ``Conv1D``'s ``(d_in, d_out)`` weights transposed to ``nn.Linear``'s order; turned
  back.

What no key records, and tfm assumes: the activation is the family's Hugging Face default
(GPT-2's GELU is its tanh form, ``gelu_new``), as the preset says.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, NamedTuple

import numpy as np

from tfmcli.engine.config import Config, LinearRopeScaling, RopeScaling
from tfmcli.engine.presets import PRESETS
from tfmcli.errors import TfmError
from tfmcli.sources.folder import shown
from tfmcli.sources.gguf.meta import Meta

RUN_FIELDS = ("batch", "seq_len", "lengths", "init", "dtype", "seed")   # the file decides none


class Arch(NamedTuple):
    """How one ``general.architecture`` is read."""
    family: str                          # tfm's preset, and whose name map (sources.<family>)
    fields: Callable[[Meta], dict]       # Config fields from the metadata and the tensors
    rows: Callable[[dict], list]         # (Hugging Face key, tfm parameter(s), transposed)
    pick: Callable | None = None         # (rows, shapes, fields) -> a fused key's parameters
    undo: Callable | None = None         # (key, tensor, fields) -> the tensor Hugging Face held
    transposed: tuple[str, ...] = ()     # keys (their ends) the converter stored transposed
    shapes: Callable | None = None       # (fields) -> key -> shape; else the rows' own


def family_fields(family: str, **read) -> dict:
    """Every architecture field of a Config (tfm's defaults), then the family's preset, then
    what the file says (``read``): a flag typed against any of them is refused, as it is for a
    checkpoint folder."""
    default = Config()
    fields = {f.name: getattr(default, f.name) for f in dataclasses.fields(Config)
              if f.name not in RUN_FIELDS and f.name != "n_ctx"}
    fields.update(PRESETS[family].fields)
    fields.update(read)
    return fields


# ---------------------------------------------------------------------------- LLaMA's names

def rope_sizes(m: Meta) -> dict:
    """The sizes every model of LLaMA's names has: width, heads, key heads (each
    ``attention.key_length`` wide when that is not width / heads), blocks, vocabulary (the rows
    of ``token_embd``), FFN width, RMSNorm's epsilon and RoPE's base and scaling."""
    d, H = m.size("embedding_length"), m.size("attention.head_count")
    if d % H and m.get("attention.key_length") is None:
        raise TfmError(f"--load {m.path}: key {m.key('attention.head_count')!r} ({H}) does not "
                       f"divide {m.key('embedding_length')!r} ({d}), and there is no "
                       f"{m.key('attention.key_length')!r}")
    head_dim = m.size("attention.key_length", d // H)
    if m.size("attention.value_length", head_dim) != head_dim:
        raise TfmError(f"--load {m.path}: key {m.key('attention.value_length')!r} is "
                       f"{m.get('attention.value_length')}, not the keys' {head_dim}; tfm's "
                       f"values are as wide as its keys")
    V, width = m.shape("token_embd.weight")
    if width != d:
        raise TfmError(f"--load {m.path}: tensor 'token_embd.weight' is {width} wide, and key "
                       f"{m.key('embedding_length')!r} is {d}")
    return {"d_model": d, "heads": H, "kv_heads": m.size("attention.head_count_kv", H),
            "head_dim": None if head_dim * H == d else head_dim,
            "layers": m.size("block_count"), "vocab": V,
            "d_ff": m.size("feed_forward_length"),
            "eps": m.number("attention.layer_norm_rms_epsilon"),
            "rope_theta": m.number("rope.freq_base", 10000.0),
            "rope_scaling": rope_scaling(m, head_dim), "tied_head": not m.has("output.weight")}


def rope_scaling(m: Meta, head_dim: int):
    """``Config.rope_scaling`` from ``rope.scaling.type`` (none, or linear with its factor),
    or from a ``rope_freqs.weight`` tensor: LLaMA 3.1's scaling, which the converter writes as
    one factor per pair and no parameters; tfm finds the (factor, 1, 4, 8192) of LLaMA 3.1 and
    3.2 that gives exactly those factors, or refuses the file."""
    kind = m.get("rope.scaling.type", "none")
    if kind == "linear":
        return LinearRopeScaling(m.number("rope.scaling.factor"))
    if kind != "none":
        raise TfmError(f"--load {m.path}: key {m.key('rope.scaling.type')!r} is {shown(kind)}; "
                       f"tfm turns RoPE by its own angles, linearly scaled ones or LLaMA 3.1's")
    if not m.has("rope_freqs.weight"):
        return None
    from tfmcli.engine.positional import rope_scale

    factors = m.file.array("rope_freqs.weight").astype(np.float64)   # divide each frequency
    if factors.shape != (head_dim // 2,):
        raise TfmError(f"--load {m.path}: tensor 'rope_freqs.weight' has shape "
                       f"{factors.shape}, not one factor per pair ({head_dim // 2},)")
    if np.all(factors == 1):
        return None
    guess = RopeScaling(float(factors.max()), 1.0, 4.0, 8192)
    theta = m.number("rope.freq_base", 10000.0)
    if np.allclose(1 / rope_scale(head_dim, theta, guess), factors, rtol=1e-6, atol=0):
        return guess
    raise TfmError(f"--load {m.path}: tensor 'rope_freqs.weight' holds RoPE factors that "
                   f"LLaMA 3.1's scaling with low_freq_factor 1, high_freq_factor 4 and an "
                   f"original context of 8192 does not give; tfm will not guess its parameters")


def llama_biases(m: Meta) -> dict:
    """Which biases a file of LLaMA's names has, from its tensors: on attention and the FFN
    (``--bias``), on Q, K and V alone (``--qkv-bias``, Qwen2's), on the FFN alone
    (``--ffn-bias``), or none."""
    qkv, out = m.has("blk.0.attn_q.bias"), m.has("blk.0.attn_output.bias")
    ffn = m.has("blk.0.ffn_up.bias") or m.has("blk.0.ffn_down.bias")
    choices = {(True, True, True): (True, False, False), (True, False, False): (False, True, False),
               (False, False, True): (False, False, True), (False, False, False): (False,) * 3}
    if (qkv, out, ffn) not in choices:
        raise TfmError(f"--load {m.path}: block 0 has biases on {'Q, K, V' if qkv else ''}"
                       f"{', ' * (qkv and out)}{'the output' if out else ''}"
                       f"{' and ' * ((qkv or out) and ffn)}{'the FFN' if ffn else ''}; tfm adds "
                       f"them to attention and the FFN (--bias), to Q, K and V alone "
                       f"(--qkv-bias) or to the FFN alone (--ffn-bias)")
    bias, qkv_bias, ffn_bias = choices[qkv, out, ffn]
    return {"bias": bias, "qkv_bias": qkv_bias, "ffn_bias": ffn_bias}


def llama_fields(m: Meta) -> dict:
    sizes = rope_sizes(m)
    turned = m.size("rope.dimension_count", sizes["head_dim"] or sizes["d_model"] // sizes["heads"])
    if turned != (sizes["head_dim"] or sizes["d_model"] // sizes["heads"]):
        raise TfmError(f"--load {m.path}: key {m.key('rope.dimension_count')!r} is {turned}, "
                       f"not the head's width; tfm's LLaMA turns all of each head")
    return family_fields("llama", **sizes, **llama_biases(m))


def qwen2_fields(m: Meta) -> dict:
    """Qwen2's, Qwen2.5's: LLaMA's sizes, biases on Q, K and V (the file's tensors say), no
    permutation. A window the converter does not write is not read."""
    return family_fields("qwen2", **rope_sizes(m), **llama_biases(m))


def qwen3_fields(m: Meta) -> dict:
    """Qwen3's: LLaMA's sizes (heads ``attention.key_length`` wide, 128 where width / heads is
    64), q and k normed per head, no biases, no permutation."""
    return family_fields("qwen3", **rope_sizes(m), **llama_biases(m))


def llama_rows(fields: dict) -> list:
    from tfmcli.sources import llama

    return llama.name_map(fields)


def unpermute(w: np.ndarray, heads: int) -> np.ndarray:
    """The inverse of the converter's ``LlamaModel.permute(w, n_head, n_head_kv)``: each of
    ``heads`` heads' rows from llama.cpp's pairs (2i, 2i + 1) back to Hugging Face's
    (i, i + d_head / 2)."""
    return (w.reshape(heads, w.shape[0] // heads // 2, 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def llama_undo(key: str, w: np.ndarray, fields: dict) -> np.ndarray:
    if ".self_attn.q_proj." in key:
        return unpermute(w, fields["heads"])
    if ".self_attn.k_proj." in key:
        return unpermute(w, fields["kv_heads"] or fields["heads"])
    return w


# ---------------------------------------------------------------------------- GPT-2

def gpt2_fields(m: Meta) -> dict:
    """GPT-2's sizes; the FFN's width from its tensor (the converter writes 4 x width as
    ``feed_forward_length``, whatever ``n_inner`` was), the learned positions' count from
    ``position_embd``."""
    d = m.size("embedding_length")
    V, width = m.shape("token_embd.weight")
    n_ctx, pos_width = m.shape("position_embd.weight")
    if width != d or pos_width != d:
        raise TfmError(f"--load {m.path}: tensors 'token_embd.weight' and "
                       f"'position_embd.weight' are {width} and {pos_width} wide, and key "
                       f"{m.key('embedding_length')!r} is {d}")
    d_ff = m.shape("blk.0.ffn_up.weight")[0]
    return family_fields("gpt2", d_model=d, heads=m.size("attention.head_count"),
                         layers=m.size("block_count"), vocab=V, n_ctx=n_ctx,
                         d_ff=None if d_ff == 4 * d else d_ff,   # (as n_inner null reads)
                         eps=m.number("attention.layer_norm_epsilon"),
                         tied_head=not m.has("output.weight"))


def gpt2_rows(fields: dict) -> list:
    from tfmcli.sources import gpt2

    return gpt2.name_map(fields)


def gpt2_shapes(fields: dict) -> dict:
    from tfmcli.sources import gpt2

    return gpt2.expected_shapes(fields)   # (c_attn's parts side by side: Conv1D's columns)


def side_by_side(rows, shapes, fields):
    from tfmcli.sources import llama

    return llama.side_by_side(rows, shapes)


def transpose_back(key: str, w: np.ndarray, fields: dict) -> np.ndarray:
    return w.T if key.endswith(GPT2_TRANSPOSED) else w


GPT2_TRANSPOSED = (".c_attn.weight", ".c_proj.weight", ".c_fc.weight")

ARCHS = {
    "llama": Arch("llama", llama_fields, llama_rows, undo=llama_undo),
    "qwen2": Arch("qwen2", qwen2_fields, llama_rows),
    "qwen3": Arch("qwen3", qwen3_fields, llama_rows),
    "gpt2": Arch("gpt2", gpt2_fields, gpt2_rows, pick=side_by_side, undo=transpose_back,
                 transposed=GPT2_TRANSPOSED, shapes=gpt2_shapes),
}


def every_arch() -> dict[str, Arch]:
    """Every architecture tfm reads: these, Gemma's and Phi-3's and StableLM's
    (``gguf.gemma``), and those whose attention's weights are fused (``gguf.fused``)."""
    from tfmcli.sources.gguf import fused, gemma

    return {**ARCHS, **gemma.ARCHS, **fused.ARCHS}
