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

from collections.abc import Mapping
from pathlib import Path

import numpy as np

from tfmcli.engine.config import MAX_LAYERS, Config, LinearRopeScaling, RopeScaling
from tfmcli.engine.sizes import param_shapes
from tfmcli.errors import ConfigError, TfmError
from tfmcli.sources import tensorfile
from tfmcli.sources.folder import LARGEST, inside, known, load_json, need, number, read_json, shown

NAME = "LLaMA"
WEIGHTS, INDEX = "model.safetensors", "model.safetensors.index.json"
IGNORED = (".rotary_emb.inv_freq",)   # a buffer older checkpoints carry: tfm makes its angles
LANGUAGE_MODEL = (("language_model.model.", "model."), ("language_model.lm_head.", "lm_head."),
                  ("model.language_model.", "model."))   # an image-and-text model's text part
BESIDE_TEXT = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.",
               "model.multi_modal_projector.")   # and the rest of it, which tfm leaves
ATTENTION = (("Q", "q_proj"), ("K", "k_proj"), ("V", "v_proj"), ("O", "o_proj"))
MLP = (("gate", "gate_proj"), ("1", "up_proj"), ("2", "down_proj"))
GELU_NAMES = {"silu": "swiglu", "gelu_pytorch_tanh": "geglu", "gelu_new": "geglu",
              "gelu": "geglu_erf"}   # hidden_act -> tfm's gate, as Hugging Face's ACT2FN reads it


def read_config(folder) -> dict:
    """Config fields from a LLaMA folder's ``config.json``; TfmError naming the file and the key
    at fault, for a model tfm does not compute exactly (another activation, RoPE scaled other
    than LLaMA 3.1's or linearly, biases in attention alone). A ``head_dim`` other than
    hidden_size / num_attention_heads is ``Config.head_dim``. The other families of LLaMA's
    names (Mistral, Qwen2, Qwen3, Gemma, Gemma 2, Gemma 3, Phi-3, StableLM) read their own keys
    in their modules, each starting from ``read_fields``."""
    path, config = config_of(folder, "llama", "LLaMA")
    return runnable(path, read_fields(path, config, biases=biases(path, config)))


def config_of(folder, kind: str, name: str, defaults: dict | None = None) -> tuple[Path, dict]:
    """(its path, the object) of a folder's ``config.json``, whose ``model_type`` must be
    ``kind`` (the family's ``name`` says whose in the error), with the family's Config's own
    value for each key in ``defaults`` that it leaves out."""
    path, config = read_json(folder)
    if config.get("model_type") != kind:
        raise TfmError(f"--load {path}: key 'model_type' is {shown(config.get('model_type'))}, "
                       f"not a {name} checkpoint's {kind!r}")
    return path, {**(defaults or {}), **config}


def read_fields(path, config: dict, biases: tuple[bool, bool, bool], kv_heads: int | None = None,
                head_dim: int | None = None, activation: str | None = None,
                tied: bool = False, rms_norm: bool = True, eps_key: str = "rms_norm_eps",
                window: tuple = (None, None)) -> dict:
    """The fields every model of LLaMA's names reads alike: its sizes, RoPE, and the family's
    choices given: ``biases`` (``Config.bias``, ``qkv_bias``, ``ffn_bias``), ``kv_heads`` when
    ``num_key_value_heads`` is left out (the family's Config default; None: every head its own
    keys), ``head_dim`` when ``head_dim`` is left out, the gate (``activation``, else
    ``hidden_act``'s), the head's tying when ``tie_word_embeddings`` is left out, the norm
    (``rms_norm`` and the key of its epsilon, 1e-6 when left out) and the sliding ``window``
    (``sliding``)."""
    d, H = need(path, config, "hidden_size"), need(path, config, "num_attention_heads")
    if config.get("num_key_value_heads") is not None:
        kv_heads = need(path, config, "num_key_value_heads")
    elif kv_heads is not None and (kv_heads > H or H % kv_heads):
        raise TfmError(f"--load {path}: key 'num_key_value_heads' is missing, and Hugging "
                       f"Face's default for {config['model_type']}, {kv_heads}, does not divide "
                       f"the {H} heads; give num_key_value_heads")
    if config.get("head_dim") is not None:
        head_dim = need(path, config, "head_dim")
    if head_dim is not None and head_dim * H == d:
        head_dim = None   # the width tfm gives a head anyway: hidden_size / num_attention_heads
    eps = number(path, f"key {eps_key!r}", config.get(eps_key, 1e-6))
    tied = config.get("tie_word_embeddings", tied)
    if not isinstance(tied, bool):
        raise TfmError(f"--load {path}: key 'tie_word_embeddings' is {shown(tied)}, not true or "
                       f"false")
    theta, scaling = read_rope(path, config)
    bias, qkv_bias, ffn_bias = biases
    sliding_window, sliding_layers = window
    return {"d_model": d, "heads": H, "kv_heads": kv_heads,
            "layers": need(path, config, "num_hidden_layers"),
            "vocab": need(path, config, "vocab_size"),
            "d_ff": need(path, config, "intermediate_size"), "eps": eps,
            "rope_theta": theta, "rope_scaling": scaling,
            "activation": activation or gate(path, config),
            "norm": "pre", "pe": "rope", "rms_norm": rms_norm, "bias": bias, "tied_head": tied,
            "head_bias": False, "causal": True, "qkv_bias": qkv_bias, "ffn_bias": ffn_bias,
            "sliding_window": sliding_window, "head_dim": head_dim, "qk_norm": False,
            "embed_scale": False, "sliding_layers": sliding_layers, "rope_local_theta": None,
            "rotary_dim": None}


def d_head(fields: dict) -> int:
    """A head's width in ``read_fields``' fields: ``head_dim``, else d / H."""
    return fields["head_dim"] or fields["d_model"] // fields["heads"]


def runnable(path, fields: dict) -> dict:
    """``fields`` when they make a Config; TfmError naming ``path`` otherwise: sizes tfm cannot
    run (heads that do not divide the width) are the file's fault."""
    try:
        Config(**fields)
    except ConfigError as e:
        raise TfmError(f"--load {path}: {e}") from None
    return fields


def switch(path, config: dict, key: str, default: bool = False) -> bool:
    """``config[key]``, true or false (``default`` when it is left out); TfmError otherwise."""
    value = config.get(key, default)
    if not isinstance(value, bool):
        raise TfmError(f"--load {path}: key {key!r} is {shown(value)}, not true or false")
    return value


def biases(path, config: dict) -> tuple[bool, bool, bool]:
    """LLaMA's (and Mistral's) (``Config.bias``, ``qkv_bias``, ``ffn_bias``): ``attention_bias``
    and ``mlp_bias`` both (``--bias``), ``mlp_bias`` alone (``--ffn-bias``), or neither;
    ``attention_bias`` alone, which would be on all of attention and not in the MLP, is
    refused."""
    bias, mlp_bias = switch(path, config, "attention_bias"), switch(path, config, "mlp_bias")
    if bias and not mlp_bias:
        raise TfmError(f"--load {path}: key 'attention_bias' is true and 'mlp_bias' false; tfm "
                       f"adds biases to attention and the FFN (--bias), to the FFN alone "
                       f"(--ffn-bias) or to Q, K and V alone (--qkv-bias), and this model's "
                       f"would be on all of attention (o_proj too) and not in the MLP")
    return bias, False, mlp_bias and not bias


def no_attention_bias(path, config: dict, name: str) -> tuple[bool, bool, bool]:
    """No biases, for a family (Qwen3's, Gemma's) whose ``attention_bias`` would be on q, k, v
    and o and not in the MLP, which tfm does not add: refused when true."""
    if config.get("attention_bias", False) is not False:
        raise TfmError(f"--load {path}: key 'attention_bias' is {shown(config['attention_bias'])}; "
                       f"tfm adds biases to all of attention and the FFN (--bias) or to Q, K "
                       f"and V alone (--qkv-bias), and a {name}'s would be on o_proj too and "
                       f"not in the MLP")
    return False, False, False


def gate(path, config: dict) -> str:
    """``swiglu`` for ``hidden_act`` 'silu' (LLaMA's default), ``geglu`` for GELU's tanh form
    and ``geglu_erf`` for GELU itself ('gelu'); anything else is refused."""
    activation = config.get("hidden_act", "silu")
    if not known(activation, GELU_NAMES):
        raise TfmError(f"--load {path}: key 'hidden_act' is {shown(activation)}; tfm gates the "
                       f"FFN with 'silu' (swiglu), GELU's tanh form (geglu) or GELU itself, "
                       f"'gelu' (geglu_erf)")
    return GELU_NAMES[activation]


def sliding(path, config: dict, window, default_layers, every_layer: str | None = None):
    """(the window, the layers that slide): ``Config.sliding_window`` and
    ``Config.sliding_layers``; (None, None) for every earlier key everywhere, and None for the
    layers when every one slides. ``window`` is the family's (its ``sliding_window`` when it
    reads one); the layers are ``layer_types``' sliding ones when the config has it, else
    ``default_layers(layers)``, the family's own. A family whose model slides in every layer
    whatever ``layer_types`` says (``every_layer`` names it: Mistral, Phi-3) refuses one that
    has a full layer."""
    layers = need(path, config, "num_hidden_layers")
    if layers > MAX_LAYERS:   # (before a list of them is made)
        raise TfmError(f"--load {path}: key 'num_hidden_layers' is {layers}; tfm shows "
                       f"1..{MAX_LAYERS} layers")
    if window is None:
        return None, None
    layer_types = config.get("layer_types")
    if layer_types is not None:
        if not isinstance(layer_types, list):
            raise TfmError(f"--load {path}: key 'layer_types' is {shown(layer_types)}, not a "
                           f"list of 'full_attention' and 'sliding_attention'")
        odd = next((t for t in layer_types
                    if not known(t, ("full_attention", "sliding_attention"))), None)
        if odd is not None:
            raise TfmError(f"--load {path}: key 'layer_types' has {shown(odd)}; tfm's layers are "
                           f"'full_attention' or 'sliding_attention'")
        if len(layer_types) != layers:
            raise TfmError(f"--load {path}: key 'layer_types' names {len(layer_types)} layers, "
                           f"and 'num_hidden_layers' is {layers}")
        sliding_layers = [i for i, t in enumerate(layer_types) if t == "sliding_attention"]
        if every_layer and len(sliding_layers) < layers:
            raise TfmError(f"--load {path}: key 'layer_types' has 'full_attention' layers, "
                           f"which Hugging Face's {every_layer} does not read (its window is "
                           f"in every layer); tfm will not guess which is meant")
    else:
        sliding_layers = default_layers(layers)
    if not sliding_layers:
        return None, None
    if isinstance(window, bool) or not isinstance(window, int) or not 1 <= window <= LARGEST:
        raise TfmError(f"--load {path}: key 'sliding_window' is {shown(window)}, not a positive "
                       f"whole number (at most {LARGEST})")
    return window, None if len(sliding_layers) == layers else tuple(sliding_layers)


def every(layers: int) -> list[int]:
    """Every layer slides: Mistral's, Phi-3's and the default of ``sliding``."""
    return list(range(layers))


def read_rope(path, config: dict) -> tuple[float, RopeScaling | LinearRopeScaling | None]:
    """RoPE's base and scaling: ``rope_parameters`` (transformers 5) or ``rope_theta`` and
    ``rope_scaling`` (``read_scaling``)."""
    scaling, theta, where = None, config.get("rope_theta"), "key 'rope_theta'"
    for key in ("rope_parameters", "rope_scaling"):
        rope = config.get(key)
        if rope is None:
            continue
        scaling = read_scaling(path, key, rope)
        if key == "rope_parameters" and "rope_theta" in rope:
            theta, where = rope["rope_theta"], "key 'rope_parameters' 'rope_theta'"
    return 10000.0 if theta is None else number(path, where, theta), scaling


def read_rotary_dim(path, config: dict, d_head: int,
                    top: str = "partial_rotary_factor") -> int | None:
    """How many of each head's dimensions a partial RoPE turns (``Config.rotary_dim``: Phi-3's,
    StableLM's, GPT-NeoX's, Phi's): ``partial_rotary_factor`` times ``d_head``, from
    ``rope_scaling``, ``rope_parameters`` or the top level (``top``: GPT-NeoX's first configs
    call it ``rotary_pct``), where Phi3Config looks for it in that order; None for the whole
    head. A factor that leaves an odd number (RoPE turns pairs) is refused."""
    for where in ("rope_scaling", "rope_parameters"):
        holder = config.get(where)
        if isinstance(holder, dict) and "partial_rotary_factor" in holder:
            key, factor = f"{where!r} 'partial_rotary_factor'", holder["partial_rotary_factor"]
            break
    else:
        key, factor = repr(top), config.get(top, 1.0)
    if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not 0 < factor <= 1:
        raise TfmError(f"--load {path}: key {key} is {shown(factor)}, not a number in (0, 1]")
    n = int(d_head * factor)
    if n == d_head:
        return None
    if n % 2 or n < 2:
        raise TfmError(f"--load {path}: key {key} is {factor!r}, which turns {n} of a head's "
                       f"{d_head} dimensions; RoPE turns pairs, so tfm needs an even number, "
                       f"at least 2")
    return n


def read_scaling(path, key: str, rope) -> RopeScaling | LinearRopeScaling | None:
    """The scaling of one ``rope_scaling`` (or ``rope_parameters``) dict: LLaMA 3.1's
    (``"llama3"``) and linear scaling (``"linear"``, a ``factor``) are read, and ``"default"``
    is none; the other kinds (``"yarn"``, ``"dynamic"``, ...) turn by angles tfm does not make:
    refused."""
    if not isinstance(rope, dict):
        raise TfmError(f"--load {path}: key {key!r} is {shown(rope)}, not an object (its "
                       f"rope_type and numbers)")
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind == "default":
        return None
    if not known(kind, ("llama3", "linear")):
        raise TfmError(f"--load {path}: key {key!r} has rope_type {shown(kind)}; tfm turns by "
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
    return [row for row in rows if all(name in shapes for name in weight_names(row[1]))]


def weight_names(name: str | tuple) -> tuple:
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
        each = [shapes[n][::-1] if transposed else shapes[n] for n in weight_names(name)]
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
    folder, whole, index = Path(folder), inside(folder, WEIGHTS), inside(folder, INDEX)
    if whole.is_file():
        paths = [whole]
    elif index.is_file():
        whole_index = load_json(index)
        weight_map = whole_index.get("weight_map") if isinstance(whole_index, dict) else None
        if not isinstance(weight_map, dict) or not all(
                isinstance(name, str) for name in weight_map.values()):
            what = (f"key 'weight_map' is {shown(weight_map)}" if isinstance(whole_index, dict)
                    else "it is not a JSON object")
            raise TfmError(f"--load {index}: not a safetensors index (it needs a 'weight_map' "
                           f"of key -> file name; {what})")
        paths = sorted({inside(folder, name, named_by=index) for name in weight_map.values()})
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


class LazyParams(Mapping):
    """A checkpoint's weights under tfm's names, each read from its file (and widened,
    transposed) when it is asked for and never held: a streamed pass holds one block's at a
    time. ``meta(name)``: its shape and dtype, without reading it.

    ``rows``: the family's ``name_map``. A key that holds several parameters (a fused
    ``query_key_value``) gives each its stored rows, ``pick(name)`` (``fused.load_params``'
    picks), and is read once for the parameters asked for one after another (W_Q, W_K, W_V).
    ``then(name, value)``: what the family does to a parameter once read (Gemma's gammas)."""

    def __init__(self, stored: dict, names: dict, rows: list, shapes: dict, dtype, then=None,
                 pick=None):
        self.stored, self.names, self.shapes = stored, names, shapes
        self.dtype, self.then, self.pick = np.dtype(dtype), then, pick
        self.rows = {ours: (name, transposed) for name, row, transposed in rows
                     for ours in weight_names(row)}
        self.order = [name for name in shapes if name in self.rows]
        self.fused = {}   # stored key -> the fused tensor last read (its weight and its bias)

    def __getitem__(self, name: str) -> np.ndarray:
        stored_name, transposed = self.rows[name]
        key = self.names[stored_name]
        rows = None if self.pick is None else self.pick(name)
        if rows is None:
            self.fused.clear()
            value = self._read(key, transposed)
        else:   # one piece of a fused tensor: read once for W_Q, W_K and W_V (b_Q, b_K, b_V)
            if key not in self.fused:
                if len(self.fused) > 1:   # (a block's weight and bias at most)
                    self.fused.clear()
                self.fused[key] = self._read(key, transposed)
            value = np.ascontiguousarray(self.fused[key][..., rows])
        return value if self.then is None else self.then(name, value)

    def _read(self, key: str, transposed: bool) -> np.ndarray:
        path, header, start = self.stored[key]
        return tensorfile.read_tensor(path, header, start, key, self.dtype, transposed)

    def __contains__(self, name) -> bool:
        return name in self.rows

    def __iter__(self):
        return iter(self.order)

    def __len__(self) -> int:
        return len(self.order)

    def meta(self, name: str) -> tuple[tuple[int, ...], np.dtype]:
        return self.shapes[name], self.dtype


def lazy_params(folder, fields: dict, dtype, checkpoint: str = NAME, text_part: bool = False,
                then=None, fused: bool = False) -> LazyParams:
    """``load_params``' weights, checked the same way, read only when asked for
    (``LazyParams``; ``then(name, value)``: what a family does to each after reading it, as
    its ``load_params`` does; ``fused``: Phi-3's keys, each cut into its parameters'
    columns as it is read)."""
    expected = expected_shapes(fields, fused)
    stored = stored_tensors(folder)
    names = text_keys(stored) if text_part else {key: key for key in stored}
    check_stored(folder, stored, names, expected, checkpoint,
                 "lm_head.weight" if fields["tied_head"] else None,
                 part=" (of its language model)" if text_part else "")
    rows, shapes = name_map(fields, fused), param_shapes(Config(**fields))
    return LazyParams(stored, names, rows, shapes, dtype, then,
                      pick=side_by_side(rows, shapes) if fused else None)


def side_by_side(rows: list, shapes: dict):
    """The ``pick`` of keys whose parameters lie side by side along the last axis (Phi-3's
    ``qkv_proj`` and ``gate_up_proj`` transposed, GPT-2's ``c_attn``), in the row's order:
    each parameter its columns (a bias its entries), as ``load_params`` splits them."""
    columns = {}
    for _, row, _ in rows:
        if isinstance(row, tuple):
            ends = np.cumsum([shapes[n][-1] for n in row])
            columns.update((n, np.arange(end - shapes[n][-1], end)) for n, end in zip(row, ends))
    return columns.get


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
    def stored(name, transposed):
        if not transposed:
            return np.ascontiguousarray(params[name])
        joined = np.concatenate([params[n] for n in weight_names(name)], axis=1)
        return np.ascontiguousarray(joined.T)
    return {key: stored(name, transposed) for key, name, transposed in name_map(fields, fused)}
