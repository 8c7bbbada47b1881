"""CodeGen checkpoint folders (``"model_type": "codegen"``: Salesforce's CodeGen 350M to 16B,
mono, multi and nl), as Hugging Face's ``save_pretrained`` writes them. CodeGen's block is
GPT-J's (``sources.gptj``: one layer norm read by attention and the MLP side by side, no
attention biases, RoPE turning neighbouring pairs of each head's first ``rotary_dim``
dimensions), with q, k and v in one matrix. The names (a contract, in the README) are GPT-J's
but for that matrix:

    transformer.h.{i}.attn.qkv_proj -> attn.W_Q, W_K, W_V

``qkv_proj``'s output is four pieces (the TPU cores CodeGen was trained on), each the queries,
then the values, then the keys of a quarter of the heads (``gptj.fused_rows``); so the heads
must be a multiple of 4.
"""

from __future__ import annotations

from tfmcli.errors import TfmError
from tfmcli.sources import gptj
from tfmcli.sources.folder import need, read_json

NAME = "CodeGen"
PARTS = 4   # qkv_proj's pieces, Hugging Face's mp_num
IGNORED = (".attn.causal_mask", ".attn.masked_bias")   # buffers older folders hold


def read_config(folder) -> dict:
    """GPT-J's fields (``gptj.read_config``), the heads a multiple of ``PARTS``."""
    fields = gptj.read_config(folder)
    path, config = read_json(folder)
    if fields["heads"] % PARTS:
        raise TfmError(f"--load {path}: key 'n_head' is {need(path, config, 'n_head')}; "
                       f"CodeGen's qkv_proj holds its heads in {PARTS} pieces, so tfm needs a "
                       f"multiple of {PARTS} (Hugging Face's CodeGenAttention cannot split "
                       f"others into heads either)")
    return fields


def load_params(folder, fields: dict, dtype):
    """GPT-J's reading (``gptj.load_params``), ``qkv_proj`` cut into W_Q, W_K and W_V."""
    return gptj.load_params(folder, fields, dtype, fused=True, checkpoint=NAME,
                            ignored=IGNORED)


def lazy_params(folder, fields: dict, dtype):
    """``load_params``' weights, read when used (``gptj.lazy_params``)."""
    return gptj.lazy_params(folder, fields, dtype, fused=True, checkpoint=NAME, ignored=IGNORED)


def from_tfm(params: dict, fields: dict):
    """tfm's parameters under CodeGen's names (the inverse of ``load_params``)."""
    return gptj.from_tfm(params, fields, fused=True)
