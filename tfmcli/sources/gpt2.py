"""GPT-2 checkpoint folders, as Hugging Face's ``save_pretrained`` writes them and the hub
serves them: ``config.json`` (``"model_type": "gpt2"``) and ``model.safetensors``, read with
the ``safetensors`` package's NumPy API (never pickle).

The name mapping is a contract (the README states it):

    wte -> embed.W_E                      wpe -> embed.W_pos
    h.{i}.ln_1 / ln_2 -> blocks.{i}.ln1 / ln2      (weight = gamma, bias = beta)
    h.{i}.attn.c_attn -> attn.W_Q, W_K, W_V and b_Q, b_K, b_V  (its columns split in three)
    h.{i}.attn.c_proj -> attn.W_O, b_O
    h.{i}.mlp.c_fc -> ffn.W_1, b_1        h.{i}.mlp.c_proj -> ffn.W_2, b_2
    ln_f -> ln_f

GPT-2's ``Conv1D`` stores its weights as ``(d_in, d_out)``, tfm's own orientation, so nothing is
transposed. The head is tied to ``wte`` and has no bias.
"""

from __future__ import annotations

import numpy as np

from tfmcli.engine.config import Config
from tfmcli.engine.sizes import param_shapes
from tfmcli.errors import ConfigError, TfmError
from tfmcli.sources.folder import CONFIG, inside, known, number, read_json, shown
from tfmcli.sources.folder import need as need_key

NAME = "GPT-2"
WEIGHTS = "model.safetensors"
# the hf extra's two packages: what the README installs with ".[hf]", from any folder
INSTALL = "python -m pip install safetensors tokenizers"
# Hugging Face's names for the tanh approximation of GELU (tfm's "gelu") and for ReLU
# activation_function -> tfm's: "gelu" is GELU itself, as Hugging Face's GPT2MLP reads it
ACTIVATIONS = {"gelu_new": "gelu", "gelu_pytorch_tanh": "gelu", "gelu": "gelu_erf",
               "relu": "relu"}
BUFFERS = (".attn.bias", ".attn.masked_bias")  # causal-mask buffers some checkpoints carry


class MissingExtra(Exception):
    """An optional package is not installed; the message says how to install it."""


def require_safetensors():
    try:
        import safetensors  # noqa: F401
    except ImportError:
        raise MissingExtra(f"reading a checkpoint folder needs safetensors: {INSTALL}") from None


def read_config(folder) -> dict:
    """Config fields from ``config.json``; TfmError naming the file and key at fault."""
    path, config = read_json(folder)
    if config.get("model_type") != "gpt2":
        raise TfmError(f"--load {path}: key 'model_type' is {shown(config.get('model_type'))}, "
                       f"not a GPT-2 checkpoint's 'gpt2'")

    def need(key, kind=int):
        return need_key(path, config, key, kind)

    activation = config.get("activation_function", "gelu_new")
    if not known(activation, ACTIVATIONS):
        raise TfmError(f"--load {path}: key 'activation_function' is {shown(activation)}; tfm "
                       f"has {', '.join(ACTIVATIONS)} (gelu_new is the tanh approximation)")
    switches = {key: default if config.get(key) is None else config[key]   # (null: left out)
                for key, default in (("scale_attn_weights", True),
                                     ("scale_attn_by_inverse_layer_idx", False),
                                     ("add_cross_attention", False), ("tie_word_embeddings", True))}
    for key, value in switches.items():
        if not isinstance(value, bool):
            raise TfmError(f"--load {path}: key {key!r} is {shown(value)}, not true or false")
    scaled = switches["scale_attn_weights"]
    if switches["scale_attn_by_inverse_layer_idx"]:
        raise TfmError(f"--load {path}: key 'scale_attn_by_inverse_layer_idx' is true; tfm "
                       f"scales every block's scores alike (--attn-scale), not block i's by "
                       f"1 / (i + 1)")
    if switches["add_cross_attention"]:
        raise TfmError(f"--load {path}: key 'add_cross_attention' is true; tfm's blocks have no "
                       f"cross-attention")
    eps = number(path, "key 'layer_norm_epsilon'", config.get("layer_norm_epsilon", 1e-5))
    fields = {"d_model": need("n_embd"), "heads": need("n_head"), "layers": need("n_layer"),
              "vocab": need("vocab_size"), "n_ctx": need("n_positions"),
              "d_ff": None if config.get("n_inner") is None else need("n_inner"),
              "eps": eps, "activation": ACTIVATIONS[activation], "norm": "pre",
              "pe": "learned", "tied_head": switches["tie_word_embeddings"],
              "head_bias": False, "causal": True,
              # unscaled scores (GPTBigCode's reader maps the same key alike)
              "attn_scale": None if scaled else 1.0}
    try:   # sizes tfm cannot run (heads that do not divide the width): the file's fault
        Config(**{**fields, "seq_len": 1})   # (the text decides the length, checked later)
    except ConfigError as e:
        raise TfmError(f"--load {path}: {e}") from None
    return fields


def expected_shapes(fields: dict) -> dict:
    """Every GPT-2 key and its shape under these config fields."""
    d, V, n_ctx = fields["d_model"], fields["vocab"], fields["n_ctx"]
    F = fields["d_ff"] or 4 * d
    shapes = {"wte.weight": (V, d), "wpe.weight": (n_ctx, d)}
    for i in range(fields["layers"]):
        h = f"h.{i}."
        shapes.update({h + "ln_1.weight": (d,), h + "ln_1.bias": (d,),
                       h + "attn.c_attn.weight": (d, 3 * d), h + "attn.c_attn.bias": (3 * d,),
                       h + "attn.c_proj.weight": (d, d), h + "attn.c_proj.bias": (d,),
                       h + "ln_2.weight": (d,), h + "ln_2.bias": (d,),
                       h + "mlp.c_fc.weight": (d, F), h + "mlp.c_fc.bias": (F,),
                       h + "mlp.c_proj.weight": (F, d), h + "mlp.c_proj.bias": (d,)})
    shapes.update({"ln_f.weight": (d,), "ln_f.bias": (d,)})
    if not fields["tied_head"]:
        shapes["lm_head.weight"] = (V, d)
    return shapes


def read_weights(folder, fields: dict, dtype=None) -> dict[str, np.ndarray]:
    """GPT-2's tensors by their names (a ``transformer.`` prefix dropped), shapes checked; read
    by ``tensorfile`` as the LLaMA-family readers are, so float64, float32, float16 and
    bfloat16 (widened exactly) all read; in ``dtype`` if given, each widened as it is read.
    Every key and shape is checked before any is read; then two threads read them, as
    ``llama.load_params`` does (GPT-2 small in float64: the widening 0.15 s on two threads
    against 0.35-0.39 s on one, here)."""
    from concurrent.futures import ThreadPoolExecutor

    from tfmcli.sources import tensorfile

    path = inside(folder, WEIGHTS)
    if not path.is_file():
        raise TfmError(f"--load {folder}: no {WEIGHTS} there (a GPT-2 checkpoint folder holds "
                       f"{CONFIG} and {WEIGHTS})")
    expected = expected_shapes(fields)
    wanted = {}
    try:
        header, start = tensorfile.read_header(path)
    except OSError as e:
        raise TfmError(f"--load {path}: cannot read it ({e.strerror or e})") from None
    for key, entry in header.items():
        name = key.removeprefix("transformer.")
        if name.endswith(BUFFERS) or (name == "lm_head.weight" and fields["tied_head"]):
            continue  # a mask buffer, or the tied head's copy of wte
        if name not in expected:
            raise TfmError(f"--load {path}: unknown key {key!r} (not a GPT-2 weight)")
        if tuple(entry["shape"]) != expected[name]:
            raise TfmError(f"--load {path}: key {key!r} has shape {tuple(entry['shape'])}, but "
                           f"{CONFIG} says {expected[name]}")
        wanted[name] = key
    for name in expected:
        if name not in wanted:
            raise TfmError(f"--load {path}: missing key {name!r}")

    def read(name):
        return name, tensorfile.read_tensor(path, header, start, wanted[name], dtype)
    with ThreadPoolExecutor(2) as pool:
        return dict(pool.map(read, wanted))


def to_tfm(tensors: dict, fields: dict, dtype) -> dict[str, np.ndarray]:
    """GPT-2's tensors under tfm's parameter names (``name_map``: ``c_attn``'s columns cut in
    three), in ``dtype`` (float32 -> float64 is exact)."""
    from tfmcli.sources import llama

    rows, shapes = name_map(fields), param_shapes(Config(**fields))
    columns = llama.side_by_side(rows, shapes)
    params = {}
    for key, row, transposed in rows:
        value = tensors[key].T if transposed else tensors[key]
        for name in llama.weight_names(row):
            cut = columns(name)
            if cut is not None:   # side by side: each parameter's columns one run of them
                assert np.array_equal(cut, np.arange(cut[0], cut[-1] + 1)), name
            params[name] = value if cut is None else value[..., cut[0]:cut[-1] + 1]   # a view
    return {name: np.ascontiguousarray(params[name], dtype=dtype) for name in shapes}


def load_checkpoint(folder, dtype) -> tuple[dict, dict]:
    """(Config fields, parameters in ``dtype``) of a GPT-2 checkpoint folder."""
    fields = read_config(folder)
    return fields, load_params(folder, fields, dtype)


def load_params(folder, fields: dict, dtype) -> dict[str, np.ndarray]:
    """The folder's parameters under tfm's names, in ``dtype``."""
    return to_tfm(read_weights(folder, fields, dtype), fields, dtype)


def name_map(fields: dict) -> list[tuple[str, str | tuple, bool]]:
    """(GPT-2 key, tfm parameter, transposed) for every weight, in tfm's order; ``c_attn``'s
    parameters the tuple (W_Q, W_K, W_V) (or their biases), side by side in its columns."""
    rows = [("wte.weight", "embed.W_E", False), ("wpe.weight", "embed.W_pos", False)]
    for i in range(fields["layers"]):
        h, p = f"h.{i}.", f"blocks.{i}."
        rows += [(h + "ln_1.weight", p + "ln1.gamma", False),
                 (h + "ln_1.bias", p + "ln1.beta", False),
                 (h + "attn.c_attn.weight", tuple(p + f"attn.W_{w}" for w in "QKV"), False),
                 (h + "attn.c_attn.bias", tuple(p + f"attn.b_{w}" for w in "QKV"), False),
                 (h + "attn.c_proj.weight", p + "attn.W_O", False),
                 (h + "attn.c_proj.bias", p + "attn.b_O", False),
                 (h + "ln_2.weight", p + "ln2.gamma", False),
                 (h + "ln_2.bias", p + "ln2.beta", False),
                 (h + "mlp.c_fc.weight", p + "ffn.W_1", False),
                 (h + "mlp.c_fc.bias", p + "ffn.b_1", False),
                 (h + "mlp.c_proj.weight", p + "ffn.W_2", False),
                 (h + "mlp.c_proj.bias", p + "ffn.b_2", False)]
    rows += [("ln_f.weight", "ln_f.gamma", False), ("ln_f.bias", "ln_f.beta", False)]
    if not fields["tied_head"]:
        rows.append(("lm_head.weight", "head.W_U", True))                # nn.Linear: (V, d)
    return rows


def lazy_params(folder, fields: dict, dtype):
    """``load_params``' weights, read when used (``llama.LazyParams``): ``c_attn`` cut into
    W_Q, W_K and W_V as it is read. Every key and shape is checked before any is read."""
    from tfmcli.sources import llama

    stored = llama.stored_tensors(folder)
    names = {key.removeprefix("transformer."): key for key in stored}
    llama.check_stored(folder, stored, names, expected_shapes(fields), NAME,
                       "lm_head.weight" if fields["tied_head"] else None, BUFFERS)
    rows, shapes = name_map(fields), param_shapes(Config(**fields))
    return llama.LazyParams(stored, names, rows, shapes, dtype,
                            pick=llama.side_by_side(rows, shapes))


def from_tfm(params: dict, layers: int) -> dict[str, np.ndarray]:
    """tfm's parameters under GPT-2's names (the inverse of ``to_tfm``), for writing a folder."""
    tensors = {"wte.weight": params["embed.W_E"], "wpe.weight": params["embed.W_pos"],
               "ln_f.weight": params["ln_f.gamma"], "ln_f.bias": params["ln_f.beta"]}
    for i in range(layers):
        h, p = f"h.{i}.", f"blocks.{i}."
        tensors.update(
            {
                h + "ln_1.weight": params[p + "ln1.gamma"],
                h + "ln_1.bias": params[p + "ln1.beta"],
                h + "attn.c_attn.weight": np.concatenate(
                    [params[p + f"attn.W_{w}"] for w in "QKV"], 1
                ),
                h + "attn.c_attn.bias": np.concatenate([params[p + f"attn.b_{w}"] for w in "QKV"]),
                h + "attn.c_proj.weight": params[p + "attn.W_O"],
                h + "attn.c_proj.bias": params[p + "attn.b_O"],
                h + "ln_2.weight": params[p + "ln2.gamma"],
                h + "ln_2.bias": params[p + "ln2.beta"],
                h + "mlp.c_fc.weight": params[p + "ffn.W_1"],
                h + "mlp.c_fc.bias": params[p + "ffn.b_1"],
                h + "mlp.c_proj.weight": params[p + "ffn.W_2"],
                h + "mlp.c_proj.bias": params[p + "ffn.b_2"],
            }
        )
    if "head.W_U" in params:
        tensors["lm_head.weight"] = params["head.W_U"].T
    return {name: np.ascontiguousarray(value) for name, value in tensors.items()}

