"""LLaMA checkpoint folders (``"model_type": "llama"``: LLaMA 1-3, TinyLlama, SmolLM, ...), as
Hugging Face's ``save_pretrained`` writes them: ``config.json``, and ``model.safetensors`` or
the shards that ``model.safetensors.index.json`` names, in float32, float16 or bfloat16 (read by
``tensorfile``, since the ``safetensors`` package's NumPy API has no bfloat16).

The model is tfm's with ``--pe rope --activation swiglu --rms-norm --no-head-bias``, grouped
when ``num_key_value_heads`` is under the heads, with biases only when ``attention_bias`` and
``mlp_bias`` say so. The name mapping is a contract (the README states it):

    model.embed_tokens -> embed.W_E
    model.layers.{i}.input_layernorm / post_attention_layernorm -> blocks.{i}.ln1 / ln2.gamma
                                                  (StableLM's layer norm: .bias -> ln1 / ln2.beta)
    model.layers.{i}.self_attn.q_proj, k_proj, v_proj, o_proj -> attn.W_Q, W_K, W_V, W_O (b_*)
    model.layers.{i}.self_attn.q_norm, k_norm -> attn.q_norm.gamma, attn.k_norm.gamma (Qwen3)
    model.layers.{i}.mlp.gate_proj, up_proj, down_proj -> ffn.W_gate, W_1, W_2 (b_*)
    model.norm -> ln_f.gamma (.beta)        lm_head -> head.W_U (absent when tied)

Gemma 2's four norms a layer (a sandwich) are named for where they sit:

    model.layers.{i}.input_layernorm / post_attention_layernorm -> blocks.{i}.ln1 / ln1_post
    model.layers.{i}.pre_feedforward_layernorm / post_feedforward_layernorm -> ln2 / ln2_post

``nn.Linear`` stores its weight as ``(d_out, d_in)``, so every weight is transposed to tfm's
``(d_in, d_out)``. The pairs RoPE turns are Hugging Face's ``rotate_half`` layout, tfm's own.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np

from tfmcli.engine.config import Config, LinearRopeScaling, RopeScaling
from tfmcli.engine.sizes import param_shapes
from tfmcli.errors import ConfigError, TfmError
from tfmcli.sources import tensorfile
from tfmcli.sources.folder import model_type, need, read_json

NAME = "LLaMA"
WEIGHTS, INDEX = "model.safetensors", "model.safetensors.index.json"
IGNORED = (".rotary_emb.inv_freq",)   # a buffer older checkpoints carry: tfm makes its angles
LANGUAGE_MODEL = (("language_model.model.", "model."), ("language_model.lm_head.", "lm_head."),
                  ("model.language_model.", "model."))   # an image-and-text model's text part
BESIDE_TEXT = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.",
               "model.multi_modal_projector.")   # and the rest of it, which tfm leaves
ATTENTION = (("Q", "q_proj"), ("K", "k_proj"), ("V", "v_proj"), ("O", "o_proj"))
MLP = (("gate", "gate_proj"), ("1", "up_proj"), ("2", "down_proj"))
KINDS = ("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text",
         "phi3", "stablelm")   # read here
GEMMAS = ("gemma", "gemma2", "gemma3_text")
SANDWICHED = ("gemma2", "gemma3_text")   # a norm after each sublayer too, soft caps, a scale
NAMES = {"qwen3": "Qwen3", "gemma": "Gemma", "gemma2": "Gemma 2",
         "gemma3_text": "Gemma 3", "phi3": "Phi-3", "stablelm": "StableLM"}   # for the messages
HEAD_DIMS = {"qwen3": 128, "gemma": 256, "gemma2": 256,
             "gemma3_text": 256}   # head_dim when config.json has none
DEFAULTS = {   # what Gemma2Config, Gemma3TextConfig, Phi3Config and StableLmConfig fill in
    "gemma2": {"sliding_window": 4096, "query_pre_attn_scalar": 256,
               "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0},
    "gemma3_text": {"sliding_window": 4096, "query_pre_attn_scalar": 256,
                    "attn_logit_softcapping": None, "final_logit_softcapping": None,
                    "sliding_window_pattern": 6},
    "phi3": {"rms_norm_eps": 1e-5},
    "stablelm": {"layer_norm_eps": 1e-5, "partial_rotary_factor": 0.25}}
# num_key_value_heads when config.json has none: each family's Config default (LlamaConfig's
# and Phi3Config's None is every head its own keys)
KV_HEADS = {"mistral": 8, "qwen2": 32, "qwen3": 32, "stablelm": 32, "gemma": 16, "gemma2": 4,
            "gemma3_text": 4}
GEMMA3_THETAS = {"full_attention": 1_000_000.0, "sliding_attention": 10_000.0}   # the defaults
GELU_TANH = ("gelu", "gelu_pytorch_tanh", "gelu_new")   # Gemma's names for GELU's tanh form


def read_config(folder) -> dict:
    """Config fields from ``config.json``; TfmError naming the file and the key at fault, for a
    model tfm does not compute exactly (another activation, RoPE scaled other than LLaMA 3.1's,
    biases in only one of attention and MLP). A ``head_dim`` other than hidden_size /
    num_attention_heads is ``Config.head_dim``. Gemma's (``sources.gemma``) are GeGLU, an
    embedding times sqrt(d) and a head tied unless it says otherwise; Gemma 2's
    (``sources.gemma2``) add a norm after each sublayer, soft caps, their own score scale and a
    window in every other layer; Gemma 3's (``sources.gemma3``, an image-and-text one's
    ``text_config``) add q and k norms and a RoPE base of the sliding layers' own. Phi-3's
    (``sources.phi3``) are LLaMA's, RMSNorm's epsilon 1e-5 by default, never biased, with
    RoPE on part of each head when ``partial_rotary_factor`` says (``Config.rotary_dim``).
    StableLM's (``sources.stablelm``) are LLaMA's with layer norm (a gain and a bias) for
    RMSNorm, biases on q, k and v when ``use_qkv_bias`` says, and RoPE on a quarter of each head
    unless ``partial_rotary_factor`` says otherwise."""
    path, config = read_json(folder)
    kind = model_type(folder, config)
    if kind == "gemma3":   # Gemma 3 4B+: an image-and-text model, whose text part tfm reads
        config, kind = _text_config(path, config), "gemma3_text"
    if kind not in KINDS:
        raise TfmError(f"--load {path}: key 'model_type' is {kind!r}, not a LLaMA "
                       f"checkpoint's 'llama', a Mistral's 'mistral', a Qwen2's 'qwen2', a "
                       f"Qwen3's 'qwen3', a Gemma's 'gemma', a Gemma 2's 'gemma2', a Gemma "
                       f"3's 'gemma3_text', a Phi-3's 'phi3' or a StableLM's 'stablelm'")
    config = {**DEFAULTS.get(kind, {}), **config}   # the Config's own for a key left out
    d, H = need(path, config, "hidden_size"), need(path, config, "num_attention_heads")
    if config.get("num_key_value_heads") is not None:
        kv_heads = need(path, config, "num_key_value_heads")
    else:   # the family's default, as Hugging Face's Config fills it in
        kv_heads = KV_HEADS.get(kind)
        if kv_heads is not None and (kv_heads > H or H % kv_heads):
            raise TfmError(f"--load {path}: key 'num_key_value_heads' is missing, and Hugging "
                           f"Face's default for {kind}, {kv_heads}, does not divide the {H} "
                           f"heads; give num_key_value_heads")
    activation = _activation(path, config, kind)
    if kind in HEAD_DIMS and config.get("head_dim") is None:
        config = {**config, "head_dim": HEAD_DIMS[kind]}   # Hugging Face's Config default
    if kind in GEMMAS and config.get("use_bidirectional_attention"):
        raise TfmError(f"--load {path}: key 'use_bidirectional_attention' is "
                       f"{config['use_bidirectional_attention']!r}; tfm reads Gemma as the "
                       f"causal language model it is trained as")
    head_dim = None if config.get("head_dim") is None else need(path, config, "head_dim")
    if head_dim is not None and head_dim * H == d:
        head_dim = None   # the width tfm gives a head anyway: hidden_size / num_attention_heads
    if head_dim is not None and kind == "stablelm":
        raise TfmError(f"--load {path}: key 'head_dim' is {head_dim!r}, and Hugging Face's "
                       f"StableLM gives a head hidden_size / num_attention_heads = {d / H:g} "
                       f"dimensions in attention but head_dim in RoPE's tables; tfm will not "
                       f"guess which is meant")
    layers = need(path, config, "num_hidden_layers")
    window, sliding_layers = _sliding_window(path, config, kind, layers)
    bias, qkv_bias, ffn_bias = _biases(path, config, kind)
    rms_norm, eps = _norm(path, config, kind)
    tied = config.get("tie_word_embeddings", kind in GEMMAS)   # each Config's default
    if not isinstance(tied, bool):
        raise TfmError(f"--load {path}: key 'tie_word_embeddings' is {tied!r}, not true or false")
    theta, scaling, local_theta = (_gemma3_rope(path, config) if kind == "gemma3_text"
                                   else (*_rope(path, config), None))
    fields = {"d_model": d, "heads": H, "kv_heads": kv_heads,
              "layers": layers,
              "vocab": need(path, config, "vocab_size"),
              "d_ff": need(path, config, "intermediate_size"), "eps": float(eps),
              "rope_theta": theta, "rope_scaling": scaling, "activation": activation,
              "norm": "pre", "pe": "rope", "rms_norm": rms_norm, "bias": bias, "tied_head": tied,
              "head_bias": False, "causal": True, "qkv_bias": qkv_bias, "ffn_bias": ffn_bias,
              "sliding_window": window,
              "head_dim": head_dim, "qk_norm": kind in ("qwen3", "gemma3_text"),
              "embed_scale": kind in GEMMAS, "sliding_layers": sliding_layers,
              "rope_local_theta": None if window is None else local_theta,
              "rotary_dim": _rotary_dim(path, config, head_dim or d // H)
              if kind in ("phi3", "stablelm") else None}
    if kind == "gemma3_text" and config["sliding_window"] is None:
        raise TfmError(f"--load {path}: key 'sliding_window' is null; a Gemma 3's sliding "
                       f"layers need a window (and turn at a RoPE base of their own)")
    if kind == "gemma3_text" and config.get("attn_logit_softcapping") is not None:
        raise TfmError(f"--load {path}: key 'attn_logit_softcapping' is "
                       f"{config['attn_logit_softcapping']!r}, which Hugging Face's Gemma 3 "
                       f"does not apply (its scores are not capped); tfm will not guess which "
                       f"is meant")
    if kind in SANDWICHED:
        fields.update(_gemma2_fields(path, config))
    if kind == "stablelm":
        _refuse_stablelm_parts(path, config)
        parallel = config.get("use_parallel_residual", False)
        if not isinstance(parallel, bool):
            raise TfmError(f"--load {path}: key 'use_parallel_residual' is {parallel!r}, not "
                           f"true or false")
        if parallel:   # x + attn(LN1 x) + mlp(LN1 x), and no post_attention_layernorm
            fields.update(parallel_residual=True, shared_norm=True)
    return runnable(path, fields)


def runnable(path, fields: dict) -> dict:
    """``fields`` when they make a Config; TfmError naming ``path`` otherwise: sizes tfm cannot
    run (heads that do not divide the width) are the file's fault."""
    try:
        Config(**fields)
    except ConfigError as e:
        raise TfmError(f"--load {path}: {e}") from None
    return fields


def _biases(path, config: dict, kind: str) -> tuple[bool, bool, bool]:
    """(``Config.bias``, ``Config.qkv_bias``, ``Config.ffn_bias``): Qwen2's q, k and v have
    biases and nothing else does; StableLM's q, k and v do when ``use_qkv_bias`` says; Phi-3 has
    none whatever its config says; Qwen3's and Gemma's ``attention_bias`` would be on q, k, v
    and o and not in the MLP, which tfm does not add, so it is refused; LLaMA's and Mistral's
    ``attention_bias`` and ``mlp_bias`` both (``--bias``), ``mlp_bias`` alone (``--ffn-bias``),
    or neither; ``attention_bias`` alone is refused."""
    if kind == "qwen2":
        return False, True, False
    if kind == "phi3":
        return False, False, False
    if kind == "stablelm":
        qkv_bias = config.get("use_qkv_bias", False)
        if not isinstance(qkv_bias, bool):
            raise TfmError(f"--load {path}: key 'use_qkv_bias' is {qkv_bias!r}, not true or "
                           f"false")
        return False, qkv_bias, False
    if kind in ("qwen3", *GEMMAS):
        if config.get("attention_bias", False) is not False:
            raise TfmError(f"--load {path}: key 'attention_bias' is "
                           f"{config['attention_bias']!r}; tfm adds biases to all of attention "
                           f"and the FFN (--bias) or to Q, K and V alone (--qkv-bias), and a "
                           f"{NAMES[kind]}'s would be on o_proj too and not in the MLP")
        return False, False, False
    bias, mlp_bias = config.get("attention_bias", False), config.get("mlp_bias", False)
    for key, value in (("attention_bias", bias), ("mlp_bias", mlp_bias)):
        if not isinstance(value, bool):
            raise TfmError(f"--load {path}: key {key!r} is {value!r}, not true or false")
    if bias and not mlp_bias:
        raise TfmError(f"--load {path}: key 'attention_bias' is true and 'mlp_bias' false; tfm "
                       f"adds biases to attention and the FFN (--bias), to the FFN alone "
                       f"(--ffn-bias) or to Q, K and V alone (--qkv-bias), and this model's "
                       f"would be on all of attention (o_proj too) and not in the MLP")
    return bias, False, mlp_bias and not bias


def _norm(path, config: dict, kind: str) -> tuple[bool, float]:
    """(``Config.rms_norm``, ``Config.eps``): StableLM's layer norm and its ``layer_norm_eps``,
    everyone else's RMSNorm and ``rms_norm_eps`` (1e-6 when left out, LLaMA's default)."""
    key = "layer_norm_eps" if kind == "stablelm" else "rms_norm_eps"
    eps = config.get(key, 1e-6)
    if isinstance(eps, bool) or not isinstance(eps, (int, float)):
        raise TfmError(f"--load {path}: key {key!r} is {eps!r}, not a number")
    return kind != "stablelm", float(eps)


def _refuse_stablelm_parts(path, config: dict) -> None:
    """StableLM's part tfm does not compute: a layer norm of each head's queries and keys with
    a gain of each head's own (``qk_layernorm``, StableLM 2 12B's). (``use_parallel_residual``
    is tfm's --parallel-residual --shared-norm.)"""
    for key, what in (("qk_layernorm", "a layer norm of each head's q and k with a gain per "
                                       "head, where tfm's --qk-norm shares one across heads"),):
        value = config.get(key, False)
        if value is not False:
            raise TfmError(f"--load {path}: key {key!r} is {value!r}; that is {what}")


def _text_config(path, config: dict) -> dict:
    """The ``text_config`` of an image-and-text Gemma 3 (``"model_type": "gemma3"``), with its
    head's tying: the outer config's ``tie_word_embeddings`` (Gemma3Config's default true), which
    the inner one, when it says, must agree with."""
    text = config.get("text_config")
    if not isinstance(text, dict):
        raise TfmError(f"--load {path}: key 'text_config' is {text!r}, not the object an "
                       f"image-and-text Gemma 3's config.json holds its language model's "
                       f"config in")
    tied = config.get("tie_word_embeddings", text.get("tie_word_embeddings", True))
    if text.get("tie_word_embeddings", tied) != tied:
        raise TfmError(f"--load {path}: key 'tie_word_embeddings' is {tied!r} and "
                       f"text_config's {text['tie_word_embeddings']!r}; tfm will not guess "
                       f"which is meant")
    return {**text, "model_type": "gemma3_text", "tie_word_embeddings": tied}


def _gemma2_fields(path, config: dict) -> dict:
    """Gemma 2's (and 3's) soft caps (``attn_logit_softcapping``, ``final_logit_softcapping``;
    null: no cap), its score scale ``query_pre_attn_scalar ** -0.5`` as Hugging Face computes it
    (None when that is tfm's own 1 / sqrt(d_head)), and its sandwich norms."""
    d_head = need(path, config, "head_dim")
    fields = {"sandwich_norm": True}
    for key, field in (("attn_logit_softcapping", "attn_softcap"),
                       ("final_logit_softcapping", "logit_softcap")):
        cap = config.get(key)
        fields[field] = None if cap is None else need(path, config, key, (int, float))
    scalar = need(path, config, "query_pre_attn_scalar", (int, float))
    if scalar <= 0:
        raise TfmError(f"--load {path}: key 'query_pre_attn_scalar' is {scalar!r}, not a "
                       f"positive number")
    scale = scalar ** -0.5
    fields["attn_scale"] = None if scale == 1.0 / math.sqrt(d_head) else scale
    return fields


def _sliding_window(path, config: dict, kind: str, layers: int):
    """(the window, the layers that slide): ``Config.sliding_window`` and
    ``Config.sliding_layers``, (None, None) for every earlier key everywhere, and None for the
    layers when every one slides. ``sliding_window`` is the window: Mistral's and Gemma 2's
    and 3's whenever set, Qwen2's only with ``use_sliding_window`` (Hugging Face's Qwen2Config
    drops it otherwise); LLaMA and Gemma have none. Which layers slide: ``layer_types`` when
    the config has it, else Gemma 2's even ones (0, 2, 4, ...), Gemma 3's all but every
    ``sliding_window_pattern``-th (5 of each 6), Qwen2's from layer ``max_window_layers`` on,
    else every one. Mistral's model slides in every layer whatever
    ``layer_types`` says, so a Mistral whose ``layer_types`` has a full layer is refused.
    """
    window = config.get("sliding_window")
    if kind in ("qwen2", "qwen3"):
        sliding = config.get("use_sliding_window", False)
        if not isinstance(sliding, bool):
            raise TfmError(f"--load {path}: key 'use_sliding_window' is {sliding!r}, not true "
                           f"or false")
        window = window if sliding else None
    if kind in ("llama", "gemma", "stablelm") or window is None:   # none has a window
        return None, None
    layer_types = config.get("layer_types")
    if layer_types is not None:
        kinds = set(layer_types) if isinstance(layer_types, list) else {repr(layer_types)}
        if not kinds <= {"full_attention", "sliding_attention"}:
            odd = sorted(kinds - {"full_attention", "sliding_attention"})[0]
            raise TfmError(f"--load {path}: key 'layer_types' has {odd!r}; tfm's layers are "
                           f"'full_attention' or 'sliding_attention'")
        if len(layer_types) != layers:
            raise TfmError(f"--load {path}: key 'layer_types' names {len(layer_types)} layers, "
                           f"and 'num_hidden_layers' is {layers}")
        sliding_layers = [i for i, t in enumerate(layer_types) if t == "sliding_attention"]
        if kind in ("mistral", "phi3") and len(sliding_layers) < layers:
            raise TfmError(f"--load {path}: key 'layer_types' has 'full_attention' layers, "
                           f"which Hugging Face's {NAMES.get(kind, 'Mistral')} does not read "
                           f"(its window is in every layer); tfm will not guess which is meant")
    elif kind == "gemma2":   # Gemma2Config's own: the even layers slide
        sliding_layers = list(range(0, layers, 2))
    elif kind == "gemma3_text":   # Gemma3TextConfig's: every layer but each pattern-th
        pattern = config["sliding_window_pattern"]
        if isinstance(pattern, bool) or not isinstance(pattern, int) or pattern < 1:
            raise TfmError(f"--load {path}: key 'sliding_window_pattern' is {pattern!r}, not a "
                           f"positive whole number")
        sliding_layers = [i for i in range(layers) if (i + 1) % pattern]
    elif kind in ("qwen2", "qwen3"):
        first = config.get("max_window_layers", 28)   # Hugging Face's default
        if isinstance(first, bool) or not isinstance(first, int):
            raise TfmError(f"--load {path}: key 'max_window_layers' is {first!r}, not a number")
        sliding_layers = list(range(max(first, 0), layers))
    else:
        sliding_layers = list(range(layers))
    if not sliding_layers:
        return None, None
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise TfmError(f"--load {path}: key 'sliding_window' is {window!r}, not a positive "
                       f"whole number")
    return window, None if len(sliding_layers) == layers else tuple(sliding_layers)


def _activation(path, config: dict, kind: str) -> str:
    """``swiglu`` for ``hidden_act`` 'silu', ``geglu`` for GELU's tanh form and ``geglu_erf``
    for GELU itself ('gelu'); Gemma's ``geglu`` for GELU's tanh form, which its
    first configs call 'gelu' (Hugging Face's GemmaConfig reads that as the tanh form too) and
    some also name in ``hidden_activation``. Anything else is refused."""
    if kind not in GEMMAS:
        activation = config.get("hidden_act", "silu")
        gates = {"silu": "swiglu", "gelu_pytorch_tanh": "geglu", "gelu_new": "geglu",
                 "gelu": "geglu_erf"}   # as Hugging Face's ACT2FN reads each name
        if activation not in gates:
            raise TfmError(f"--load {path}: key 'hidden_act' is {activation!r}; tfm gates the "
                           f"FFN with 'silu' (swiglu), GELU's tanh form (geglu) or GELU itself, "
                           f"'gelu' (geglu_erf)")
        return gates[activation]
    for key in ("hidden_act", "hidden_activation"):
        value = config.get(key)
        if value is not None and value not in GELU_TANH:
            raise TfmError(f"--load {path}: key {key!r} is {value!r}; tfm's Gemma FFN is GeGLU "
                           f"with GELU's tanh form ('gelu_pytorch_tanh')")
    return "geglu"


def _rope(path, config: dict) -> tuple[float, RopeScaling | LinearRopeScaling | None]:
    """RoPE's base and scaling: ``rope_parameters`` (transformers 5) or ``rope_theta`` and
    ``rope_scaling`` (``_scaling``)."""
    scaling = None
    for key in ("rope_parameters", "rope_scaling"):
        rope = config.get(key)
        if rope is None:
            continue
        scaling = _scaling(path, key, rope)
        if key == "rope_parameters" and "rope_theta" in rope:
            config = {**config, "rope_theta": rope["rope_theta"]}
    theta = 10000.0 if config.get("rope_theta") is None else need(path, config, "rope_theta",
                                                                  (int, float))
    return float(theta), scaling


def _rotary_dim(path, config: dict, d_head: int,
                top: str = "partial_rotary_factor") -> int | None:
    """How many of each head's dimensions a Phi-3's or StableLM's RoPE turns
    (``Config.rotary_dim``): ``partial_rotary_factor`` times ``d_head`` (Phi-4-mini: 0.75;
    StableLM: 0.25 when left out, ``DEFAULTS``), from ``rope_scaling``, ``rope_parameters`` or
    the top level (``top``: GPT-NeoX's first configs call it ``rotary_pct``), where
    Phi3Config looks for it in that order; None for the whole head. A factor that leaves an odd
    number (RoPE turns pairs) is refused."""
    for where in ("rope_scaling", "rope_parameters"):
        holder = config.get(where)
        if isinstance(holder, dict) and "partial_rotary_factor" in holder:
            key, factor = f"{where!r} 'partial_rotary_factor'", holder["partial_rotary_factor"]
            break
    else:
        key, factor = repr(top), config.get(top, 1.0)
    if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not 0 < factor <= 1:
        raise TfmError(f"--load {path}: key {key} is {factor!r}, not a number in (0, 1]")
    n = int(d_head * factor)
    if n == d_head:
        return None
    if n % 2 or n < 2:
        raise TfmError(f"--load {path}: key {key} is {factor!r}, which turns {n} of a head's "
                       f"{d_head} dimensions; RoPE turns pairs, so tfm needs an even number, "
                       f"at least 2")
    return n


def _scaling(path, key: str, rope) -> RopeScaling | LinearRopeScaling | None:
    """The scaling of one ``rope_scaling`` (or ``rope_parameters``) dict: LLaMA 3.1's
    (``"llama3"``) and linear scaling (``"linear"``, a ``factor``) are read, and ``"default"``
    is none; the other kinds (``"yarn"``, ``"dynamic"``, ...) turn by angles tfm does not make:
    refused."""
    kind = rope.get("rope_type", rope.get("type", "default")) if isinstance(rope, dict) else rope
    if kind == "default":
        return None
    if kind not in ("llama3", "linear"):
        raise TfmError(f"--load {path}: key {key!r} has rope_type {kind!r}; tfm turns by "
                       f"RoPE's own angles ('default'), LLaMA 3.1's ('llama3') or linearly "
                       f"scaled ones ('linear')")
    names = RopeScaling._fields if kind == "llama3" else LinearRopeScaling._fields
    missing = [name for name in names if name not in rope]
    if missing:
        raise TfmError(f"--load {path}: key {key!r} has rope_type {kind!r} but no "
                       f"{missing[0]!r}")
    try:
        return RopeScaling.parse([rope[name] for name in names])
    except ConfigError as e:
        raise TfmError(f"--load {path}: key {key!r}: {e}") from None


def _gemma3_rope(path, config: dict):
    """(rope_theta, rope_scaling, rope_local_theta): Gemma 3's full-attention layers turn at
    ``rope_theta`` (1e6) with ``rope_scaling`` (4B and up: linear, 8), its sliding ones at
    ``rope_local_base_freq`` (10000), unscaled. transformers 5 writes both in
    ``rope_parameters``, one dict a layer type."""
    rope = config.get("rope_parameters")
    if isinstance(rope, dict) and set(rope) & set(GEMMA3_THETAS):
        key = "rope_parameters"
        full, sliding = (rope.get(kind) or {} for kind in GEMMA3_THETAS)
        names = [f"'rope_parameters' {kind}'s 'rope_theta'" for kind in GEMMA3_THETAS]
    else:   # the first configs' keys
        key = "rope_scaling"
        full = {**(config.get(key) or {}), "rope_theta": config.get("rope_theta")}
        sliding = {"rope_theta": config.get("rope_local_base_freq")}
        names = ["'rope_theta'", "'rope_local_base_freq'"]
    if _scaling(path, key, sliding) is not None:
        raise TfmError(f"--load {path}: key {key!r} scales the sliding layers' angles "
                       f"({sliding.get('rope_type')!r}); tfm turns them by RoPE's own")
    thetas = []
    for kind, given, name in zip(GEMMA3_THETAS, (full, sliding), names):
        theta = GEMMA3_THETAS[kind] if given.get("rope_theta") is None else given["rope_theta"]
        if isinstance(theta, bool) or not isinstance(theta, (int, float)) or theta <= 0:
            raise TfmError(f"--load {path}: key {name} is {theta!r}, not a positive number")
        thetas.append(float(theta))
    return thetas[0], _scaling(path, key, full), thetas[1]


def name_map(fields: dict, fused: bool = False) -> list[tuple[str, str | tuple, bool]]:
    """(Hugging Face key, tfm parameter, transposed) for every weight, in tfm's order: each
    key that maps to a parameter these fields' Config has (``sizes.param_shapes`` decides
    which biases there are, and whether the head is its own). ``fused``: Phi-3's layout, one
    ``qkv_proj`` and one ``gate_up_proj`` a layer, whose tfm parameter is a tuple of names,
    stacked along the output axis in that order (the rows of the stored ``(d_out, d_in)``)."""
    shapes = param_shapes(Config(**fields))
    rows = [("model.embed_tokens.weight", "embed.W_E", False)]
    for i in range(fields["layers"]):
        m, p = f"model.layers.{i}.", f"blocks.{i}."
        rows += [(m + "input_layernorm.weight", p + "ln1.gamma", False),
                 (m + "input_layernorm.bias", p + "ln1.beta", False)]   # StableLM's
        if fused:
            rows.append((m + "self_attn.qkv_proj.weight",
                         tuple(p + f"attn.W_{w}" for w in "QKV"), True))
        for w, proj in ATTENTION[3 if fused else 0:]:
            rows += [(m + f"self_attn.{proj}.weight", p + f"attn.W_{w}", True),
                     (m + f"self_attn.{proj}.bias", p + f"attn.b_{w}", False)]
        rows += [(m + f"self_attn.{norm}.weight", p + f"attn.{norm}.gamma", False)
                 for norm in ("q_norm", "k_norm")]   # Qwen3's
        if fields.get("sandwich_norm"):   # Gemma 2's: a norm after attention, two at the MLP
            rows += [(m + "post_attention_layernorm.weight", p + "ln1_post.gamma", False),
                     (m + "pre_feedforward_layernorm.weight", p + "ln2.gamma", False)]
        else:
            rows += [(m + "post_attention_layernorm.weight", p + "ln2.gamma", False),
                     (m + "post_attention_layernorm.bias", p + "ln2.beta", False)]
        if fused:
            rows.append((m + "mlp.gate_up_proj.weight", (p + "ffn.W_gate", p + "ffn.W_1"), True))
        for w, proj in MLP[2 if fused else 0:]:
            rows += [(m + f"mlp.{proj}.weight", p + f"ffn.W_{w}", True),
                     (m + f"mlp.{proj}.bias", p + f"ffn.b_{w}", False)]
        rows.append((m + "post_feedforward_layernorm.weight", p + "ln2_post.gamma", False))
    rows += [("model.norm.weight", "ln_f.gamma", False), ("model.norm.bias", "ln_f.beta", False),
             ("lm_head.weight", "head.W_U", True)]
    return [row for row in rows if all(name in shapes for name in _names(row[1]))]


def _names(name: str | tuple) -> tuple:
    """A ``name_map`` row's tfm parameters: one name, or a fused key's several."""
    return name if isinstance(name, tuple) else (name,)


def expected_shapes(fields: dict, fused: bool = False) -> dict[str, tuple[int, ...]]:
    """Every Hugging Face key and its shape under these config fields (``read_config``'s,
    which it has checked make a Config); a fused key's rows are its parameters' outputs."""
    return stored_shapes(name_map(fields, fused), param_shapes(Config(**fields)))


def stored_shapes(rows, shapes: dict) -> dict[str, tuple[int, ...]]:
    """Each ``name_map`` row's stored shape, given tfm's ``shapes``: a parameter's, reversed
    when stored transposed; a fused key's parameters stacked along the stored first axis (their
    outputs, or their biases' entries)."""
    expected = {}
    for key, name, transposed in rows:
        each = [shapes[n][::-1] if transposed else shapes[n] for n in _names(name)]
        expected[key] = (sum(shape[0] for shape in each), *each[0][1:])
    return expected


def check_stored(folder, stored: dict, names: dict, expected: dict, checkpoint: str,
                 tied_copy: str, ignored: tuple = IGNORED, part: str = "") -> None:
    """Before any tensor is read: every stored key (``names``: name -> stored key) one of the
    ``expected`` (name -> shape), an ``ignored`` buffer or, tied, the head's copy ``tied_copy``
    (None when untied); and every expected name stored, with its shape. TfmError naming the
    file and the key otherwise (``part``: what the missing key belongs to, said after it)."""
    for name, key in names.items():
        if name not in expected and name != tied_copy and not name.endswith(ignored):
            raise TfmError(f"--load {stored[key][0]}: unknown key {key!r} (not a weight of the "
                           f"{checkpoint} that config.json describes)")
    for name, shape in expected.items():
        if name not in names:   # named in the one file, or in the index of the shards
            whole = Path(folder) / WEIGHTS
            raise TfmError(f"--load {whole if whole.is_file() else Path(folder) / INDEX}: "
                           f"missing key {name!r}{part}")
        key = names[name]
        path, header, _ = stored[key]
        if tuple(header[key]["shape"]) != shape:
            raise TfmError(f"--load {path}: key {key!r} has shape {tuple(header[key]['shape'])}"
                           f", but config.json says {shape}")


def stored_tensors(folder) -> dict[str, tuple[Path, dict, int]]:
    """Each stored key's (file, that file's header, where its data starts), over
    ``model.safetensors`` or the shards ``model.safetensors.index.json`` names."""
    folder = Path(folder)
    if (folder / WEIGHTS).is_file():
        paths = [folder / WEIGHTS]
    elif (folder / INDEX).is_file():
        try:
            names = json.loads((folder / INDEX).read_text())["weight_map"].values()
            paths = sorted({folder / name for name in names})
        except (ValueError, UnicodeDecodeError, KeyError, TypeError, AttributeError) as e:
            raise TfmError(f"--load {folder / INDEX}: not a safetensors index (it needs a "
                           f"'weight_map' of key -> file; {e!r})") from None
    else:
        raise TfmError(f"--load {folder}: no {WEIGHTS} (or {INDEX}) there (a checkpoint "
                       f"folder holds config.json and its weights)")
    stored = {}
    for path in paths:
        if not path.is_file():
            raise TfmError(f"--load {folder}: {INDEX} names {path.name}, which is not there")
        header, start = tensorfile.read_header(path)
        stored.update({key: (path, header, start) for key in header})
    return stored


def load_params(folder, fields: dict, dtype, checkpoint: str = NAME,
                text_part: bool = False, fused: bool = False) -> dict[str, np.ndarray]:
    """The folder's weights under tfm's names, transposed to ``(d_in, d_out)``, in ``dtype``
    (float32 and bfloat16 to float64 are exact). Every key and shape is checked before any is
    read; then two threads read them, each tensor whole, since a fresh array's first touch and
    the file's pages leave one core waiting (LLaMA 3.2 1B's 2.5 GB in float32: 3.4-4.6 s
    instead of 7-14). With ``text_part`` the folder holds an image-and-text model (Gemma 3
    4B+): its language model's weights are read (``text_keys``), the rest left. With
    ``fused`` (Phi-3), q, k and v are one stored matrix, and the gate and up projections
    another (``name_map``): each is read once and split."""
    from concurrent.futures import ThreadPoolExecutor

    expected = expected_shapes(fields, fused)
    stored = stored_tensors(folder)
    names = text_keys(stored) if text_part else {key: key for key in stored}   # name -> stored
    check_stored(folder, stored, names, expected, checkpoint,
                 "lm_head.weight" if fields["tied_head"] else None,
                 part=" (of its language model)" if text_part else "")
    rows = name_map(fields, fused)

    def read(row):
        name, ours, transposed = row
        key = names[name]
        path, header, start = stored[key]
        value = tensorfile.read_tensor(path, header, start, key, dtype, transposed)
        if not isinstance(ours, tuple):
            return [(ours, value)]
        ends = np.cumsum([shapes[n][1] for n in ours])[:-1]   # (d_in, d_out summed): split
        return [(n, np.ascontiguousarray(part))
                for n, part in zip(ours, np.split(value, ends, axis=1))]

    shapes = param_shapes(Config(**fields))
    with ThreadPoolExecutor(2) as pool:
        return dict(pair for pairs in pool.map(read, rows) for pair in pairs)


def text_keys(stored: dict) -> dict[str, str]:
    """Name in a text model (``model.layers.0...``) -> stored key, for the language model's
    weights of an image-and-text folder: ``language_model.model.*`` and
    ``language_model.lm_head.*`` as Hugging Face saves Gemma 3 4B+ (and the hub serves it), or
    ``model.language_model.*``; the vision tower's and projector's keys are left out."""
    names = {}
    for key in stored:
        for prefix, name in LANGUAGE_MODEL:
            if key.startswith(prefix):
                names[name + key[len(prefix):]] = key
                break
        else:
            if not key.startswith(BESIDE_TEXT):
                names[key] = key   # unknown: load_params names it
    return names


def load_checkpoint(folder, dtype) -> tuple[dict, dict]:
    """(Config fields, parameters in ``dtype``) of a LLaMA checkpoint folder."""
    fields = read_config(folder)
    return fields, load_params(folder, fields, dtype)


def from_tfm(params: dict, fields: dict, fused: bool = False) -> dict[str, np.ndarray]:
    """tfm's parameters under LLaMA's names (the inverse of ``load_params``), for writing a
    folder; ``fused``: Phi-3's (``name_map``)."""
    return {key: np.ascontiguousarray(np.concatenate([params[n] for n in _names(name)], axis=1).T
                                      if transposed else params[name])
            for key, name, transposed in name_map(fields, fused)}
