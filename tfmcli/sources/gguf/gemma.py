"""GGUF architectures of LLaMA's layout with their own conventions: Gemma, Gemma 2, Gemma 3 (norms
stored as ``1 + w``), Phi-3 and StableLM. Each an ``archs.Arch``, registered in ``ARCHS``.

None of the five is permuted or transposed by llama.cpp's converter (``convert_hf_to_gguf.py``:
their llama.cpp graphs turn Hugging Face's RoPE pairs), and Phi-3's ``qkv_proj`` and
``gate_up_proj`` stay fused (``attn_qkv``, ``ffn_up``): each family's own name map reads them
(Phi-3's fused one, cut into its parameters' columns). What the converter changes or leaves out:

- Gemma's norms: Hugging Face's ``GemmaRMSNorm`` multiplies by ``1 + weight`` and llama.cpp's
  by its weight, so the converter stores every ``*norm.weight`` as ``weight + 1`` (Gemma 3's q
  and k norms too). That is tfm's gamma (``sources.gemma`` adds the 1 to a folder's weight), so
  the file's norm is read as it stands, nothing taken off. The converter adds in float32: the
  gamma is the sum a float32 run of the folder makes, bit for bit; a float64 run of the folder
  adds exactly, which differs by float32's rounding of ``1 + weight`` unless the weight is a
  bfloat16 number (as Gemma ships), whose sum float32 holds exactly.
- Gemma's and Gemma 2's ``lm_head.weight`` is dropped: a file has no ``output.weight``, and its
  head is tied, whatever ``tie_word_embeddings`` said.
- Gemma 3's embedding keeps only the tokenizer's rows when the converter reads a
  ``tokenizer.json`` (a ``tokenizer.model`` keeps them all): the vocabulary is ``token_embd``'s
  rows, so such a file's logits are the folder's first columns.

What no key records, and tfm assumes as llama.cpp does (each as its loader hard-codes it):

- the activation: GELU's tanh form for the Gemmas (GeGLU), silu for Phi-3 and StableLM;
- Gemma's and Gemma 2's RoPE base, 10000 (``rope.freq_base`` read when there is one);
- Gemma 2's and 3's ``query_pre_attn_scalar``: the scores are scaled by 1 / sqrt(width /
  heads) in the 27B models (46 blocks of Gemma 2, 62 of Gemma 3), by 1 / sqrt(head width)
  in every other, as Google's configs give them;
- which layers slide: Gemma 2's even ones, five of each six of Gemma 3's (layer 5, 11, ...
  see every key), both within ``attention.sliding_window``; Gemma 2's soft caps are 50 and 30
  when the file has no ``attn_logit_softcapping`` or ``final_logit_softcapping``;
- Phi-3's ``attention.sliding_window`` is its window in every layer (0: none), as Hugging Face
  reads ``sliding_window``; llama.cpp itself turns Phi-3's window off.

StableLM's ``use_parallel_residual`` key need not describe the model: the converter writes
true when the config it reads has no such key (a ``stablelm_epoch`` config.json, StableLM 3B
4E1T's first, which transformers does not know and the converter reads as it is), whose block
is sequential. tfm reads the block as llama.cpp does, from its tensors: no ``ffn_norm`` is
attention and the MLP side by side on one norm (``--parallel-residual --shared-norm``).

Refused, naming the file and the key or tensor: Phi-3's long-context RoPE
(``rope_factors_long``), StableLM 2 12B's per-head q and k layer norms (``attn_q_norm``, which
this converter cannot write either: it fails on them), and Gemma 3's scores capped
(``attn_logit_softcapping``, which Hugging Face's Gemma 3 does not apply).
"""

from __future__ import annotations

import math

from tfmcli.errors import TfmError
from tfmcli.sources.folder import shown
from tfmcli.sources.gguf.archs import (
    Arch,
    family_fields,
    llama_biases,
    llama_rows,
    rope_sizes,
    side_by_side,
)
from tfmcli.sources.gguf.meta import MISSING, Meta

GEMMA_27B = {"gemma2": 46, "gemma3": 62}   # blocks: llama.cpp's LLM_TYPE_27B, scaled by d / H


# ---------------------------------------------------------------------------- Gemma

def gemma_fields(m: Meta) -> dict:
    """Gemma's: LLaMA's sizes (heads ``attention.key_length`` wide), GeGLU, the embedding times
    sqrt(d), the head tied (the converter drops ``lm_head``), RoPE on the whole head."""
    sizes = rope_sizes(m)
    whole_heads(m, sizes)
    return family_fields("gemma", **sizes)


def gemma2_fields(m: Meta) -> dict:
    """Gemma 2's: Gemma's, a norm after each sublayer too, the scores and logits soft-capped,
    the scores scaled as llama.cpp scales them, the even layers sliding."""
    sizes = rope_sizes(m)
    whole_heads(m, sizes)
    caps = {"attn_softcap": m.number("attn_logit_softcapping", 50.0),
            "logit_softcap": m.number("final_logit_softcapping", 30.0)}
    return family_fields("gemma2", **sizes, **caps, sandwich_norm=True,
                         attn_scale=query_scale(m, sizes),
                         **sliding(m, sizes["layers"], every=2))


def gemma3_fields(m: Meta) -> dict:
    """Gemma 3's: Gemma 2's block with q and k normed per head, no score cap, the logits capped
    only when ``final_logit_softcapping`` says, five layers of each six sliding (when the file
    has a window) at their own RoPE base ``rope.freq_base_swa``, unscaled."""
    sizes = rope_sizes(m)
    whole_heads(m, sizes)
    if m.get("attn_logit_softcapping") is not None:
        raise TfmError(f"--load {m.path}: key {m.key('attn_logit_softcapping')!r} is "
                       f"{shown(m.get('attn_logit_softcapping'))}, which Gemma 3 does not "
                       f"apply (its scores are not capped); tfm will not guess which is meant")
    window = sliding(m, sizes["layers"], every=6, needed=False)
    local = m.number("rope.freq_base_swa", 10000.0) if window["sliding_window"] else None
    return family_fields("gemma3", **sizes, sandwich_norm=True, qk_norm=True,
                         attn_softcap=None, logit_softcap=m.number("final_logit_softcapping",
                                                                   None),
                         attn_scale=query_scale(m, sizes), rope_local_theta=local, **window)


def whole_heads(m: Meta, sizes: dict) -> None:
    """A Gemma turns all of each head: ``rope.dimension_count``, when there, must say so."""
    width = sizes["head_dim"] or sizes["d_model"] // sizes["heads"]
    turned = m.size("rope.dimension_count", width)
    if turned != width:
        raise TfmError(f"--load {m.path}: key {m.key('rope.dimension_count')!r} is {turned}, "
                       f"not the head's width {width}; a {m.arch} turns all of each head")


def query_scale(m: Meta, sizes: dict) -> float | None:
    """``Config.attn_scale`` of a Gemma 2 or 3, which no key records (``query_pre_attn_scalar``):
    llama.cpp's, 1 / sqrt(width / heads) in the 27B (its block count), else 1 / sqrt(head
    width), tfm's own (None), as Hugging Face computes ``query_pre_attn_scalar ** -0.5``."""
    head = sizes["head_dim"] or sizes["d_model"] // sizes["heads"]
    scalar = sizes["d_model"] // sizes["heads"] if sizes["layers"] == GEMMA_27B[m.arch] else head
    scale = scalar ** -0.5
    return None if scale == 1.0 / math.sqrt(head) else scale


def sliding(m: Meta, layers: int, every: int, needed: bool = True) -> dict:
    """``sliding_window`` and ``sliding_layers``: the window ``attention.sliding_window`` in the
    layers llama.cpp slides, all but each ``every``-th (layer i when i % every < every - 1;
    None when that is every layer). ``needed``: a file without the key is refused (Gemma 2's
    loader needs it); else it slides nowhere (Gemma 3's)."""
    if not needed and m.get("attention.sliding_window") is None:
        return {"sliding_window": None, "sliding_layers": None}
    window = m.size("attention.sliding_window")
    slides = [i for i in range(layers) if i % every < every - 1]
    if not slides:
        return {"sliding_window": None, "sliding_layers": None}
    return {"sliding_window": window,
            "sliding_layers": None if len(slides) == layers else tuple(slides)}


# ---------------------------------------------------------------------------- Phi-3

def phi3_fields(m: Meta) -> dict:
    """Phi-3's: LLaMA's sizes, no biases, RoPE on the first ``rope.dimension_count`` of each
    head, the window ``attention.sliding_window`` in every layer (0: none). Refused: the
    long-context models' RoPE (``rope_factors_long``, LongRoPE's per-pair factors)."""
    for name in ("rope_factors_long.weight", "rope_factors_short.weight"):
        if m.has(name):
            raise TfmError(f"--load {m.path}: tensor {name!r} holds LongRoPE's factors "
                           f"(Phi-3 128k, Phi-3.5), whose angles change with the length; tfm "
                           f"turns RoPE by its own angles")
    sizes = rope_sizes(m)
    window = m.get("attention.sliding_window", 0)
    if window != 0:
        window = m.size("attention.sliding_window")
    return family_fields("phi3", **sizes, rotary_dim=rotary_dim(m, sizes),
                         sliding_window=window or None, sliding_layers=None)


def phi3_rows(fields: dict) -> list:
    from tfmcli.sources import phi3

    return phi3.name_map(fields)   # qkv_proj and gate_up_proj fused, as the file keeps them


def rotary_dim(m: Meta, sizes: dict) -> int | None:
    """``Config.rotary_dim``: ``rope.dimension_count`` of each head's dimensions turned (None:
    all of them)."""
    width = sizes["head_dim"] or sizes["d_model"] // sizes["heads"]
    turned = m.size("rope.dimension_count", width)
    if turned > width or turned % 2:
        raise TfmError(f"--load {m.path}: key {m.key('rope.dimension_count')!r} is {turned}; "
                       f"RoPE turns pairs of a head's {width} dimensions, so tfm needs an even "
                       f"number of them")
    return None if turned == width else turned


# ---------------------------------------------------------------------------- StableLM

class LayerNormMeta(Meta):
    """A file whose norms are layer norms: RMSNorm's epsilon, as ``archs.rope_sizes`` asks for
    it, is ``attention.layer_norm_epsilon``."""

    def number(self, name: str, default=MISSING) -> float:
        if name == "attention.layer_norm_rms_epsilon":
            name = "attention.layer_norm_epsilon"
        return super().number(name, default)


def stablelm_fields(m: Meta) -> dict:
    """StableLM's: LLaMA's sizes with layer norm (a gain and a bias) for RMSNorm, biases on q,
    k and v when the file has them, RoPE on the first ``rope.dimension_count`` of each head, and
    attention and the MLP side by side on one norm when there is no ``ffn_norm``."""
    if m.has("blk.0.attn_q_norm.weight"):
        raise TfmError(f"--load {m.path}: tensor 'blk.0.attn_q_norm.weight' is a layer norm of "
                       f"each head's q with a gain per head (StableLM 2 12B's qk_layernorm), "
                       f"where tfm's --qk-norm shares one across heads")
    sizes = rope_sizes(LayerNormMeta(m.file, m.arch))
    parallel = not m.has("blk.0.ffn_norm.weight")   # (the use_parallel_residual key aside)
    return family_fields("stablelm", **sizes, **llama_biases(m), rms_norm=False,
                         rotary_dim=rotary_dim(m, sizes), parallel_residual=parallel,
                         shared_norm=parallel)


ARCHS = {
    "gemma": Arch("gemma", gemma_fields, llama_rows),
    "gemma2": Arch("gemma2", gemma2_fields, llama_rows),
    "gemma3": Arch("gemma3", gemma3_fields, llama_rows),
    "phi3": Arch("phi3", phi3_fields, phi3_rows, pick=side_by_side),
    "stablelm": Arch("stablelm", stablelm_fields, llama_rows),
}
