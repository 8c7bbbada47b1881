"""StableLM checkpoint folders (``"model_type": "stablelm"``: StableLM 2 1.6B, StableLM 3B 4E1T,
StableLM Zephyr): LLaMA's model and names (``sources.llama`` reads them) with three
differences:

    layer norm for RMSNorm, with a bias:  model.layers.{i}.input_layernorm.bias -> ln1.beta,
        post_attention_layernorm.bias -> ln2.beta, model.norm.bias -> ln_f.beta
    biases on q, k and v when ``use_qkv_bias`` says (StableLM 2's), none elsewhere
    RoPE on the first quarter of each head (``partial_rotary_factor``, 0.25 when left out)

``layer_norm_eps`` is the norms' epsilon (1e-5 when left out). ``use_parallel_residual``
(attention and the MLP side by side, both reading the input norm, and no
``post_attention_layernorm``) is ``--parallel-residual --shared-norm``. Refused:
``qk_layernorm`` (a layer norm of each head's q and k with a gain of each head's own, StableLM
2 12B's), which tfm's block does not compute.
"""

from __future__ import annotations

import functools

from tfmcli.errors import TfmError
from tfmcli.sources import llama
from tfmcli.sources.folder import shown

NAME = "StableLM"
DEFAULTS = {"layer_norm_eps": 1e-5, "partial_rotary_factor": 0.25}   # StableLmConfig's


def read_config(folder) -> dict:
    """LLaMA's keys with layer norm (a gain and a bias, ``layer_norm_eps``) for RMSNorm, biases
    on q, k and v when ``use_qkv_bias`` says, 32 key/value heads when ``num_key_value_heads``
    is left out, RoPE on a quarter of each head unless ``partial_rotary_factor`` says otherwise,
    and one norm feeding attention and the MLP side by side with ``use_parallel_residual``.
    Refused: ``head_dim`` other than hidden_size / num_attention_heads, and ``qk_layernorm``."""
    path, config = llama.config_of(folder, "stablelm", NAME, defaults=DEFAULTS)
    value = config.get("qk_layernorm", False)
    if value is not False:
        raise TfmError(f"--load {path}: key 'qk_layernorm' is {shown(value)}; that is a layer norm "
                       f"of each head's q and k with a gain per head, where tfm's --qk-norm "
                       f"shares one across heads")
    qkv_bias = llama.switch(path, config, "use_qkv_bias")
    fields = llama.read_fields(path, config, (False, qkv_bias, False), kv_heads=32,
                               rms_norm=False, eps_key="layer_norm_eps")
    d, H = fields["d_model"], fields["heads"]
    if fields["head_dim"] is not None:
        raise TfmError(f"--load {path}: key 'head_dim' is {shown(config['head_dim'])}, and Hugging "
                       f"Face's StableLM gives a head hidden_size / num_attention_heads = "
                       f"{d / H:g} dimensions in attention but head_dim in RoPE's tables; tfm "
                       f"will not guess which is meant")
    fields["rotary_dim"] = llama.read_rotary_dim(path, config, d // H)
    if llama.switch(path, config, "use_parallel_residual"):
        fields.update(parallel_residual=True, shared_norm=True)   # x + attn(LN1 x) + mlp(LN1 x)
    return llama.runnable(path, fields)

load_params = functools.partial(llama.load_params, checkpoint=NAME)
lazy_params = functools.partial(llama.lazy_params, checkpoint=NAME)
name_map = llama.name_map
from_tfm = llama.from_tfm
