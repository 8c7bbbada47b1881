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

from tfmcli.sources import llama

NAME = "StableLM"
read_config = llama.read_config
load_params = functools.partial(llama.load_params, checkpoint=NAME)
name_map = llama.name_map
from_tfm = llama.from_tfm
