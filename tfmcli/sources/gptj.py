"""GPT-J checkpoint folders (``"model_type": "gptj"``: GPT-J-6B and its fine-tunes), as Hugging
Face's ``save_pretrained`` writes them. The model is tfm's with ``--pe rope --parallel-residual
--shared-norm --no-bias --ffn-bias --activation gelu``: one layer norm a block, read by attention
and the MLP side by side (``z = x + MHA(LN1(x)) + FFN(LN1(x))``), no biases in attention, biases
in the MLP and the head, RoPE on the first ``rotary_dim`` of each head at base 10000. The names
(a contract, in the README):

    transformer.wte -> embed.W_E                         lm_head -> head.W_U, head.b_U
    transformer.h.{i}.ln_1 -> ln1 (.gamma, .beta)
    transformer.h.{i}.attn.q_proj, k_proj, v_proj, out_proj -> attn.W_Q, W_K, W_V, W_O
    transformer.h.{i}.mlp.fc_in, fc_out -> ffn.W_1, W_2 (b_1, b_2)
    transformer.ln_f -> ln_f (.gamma, .beta)

GPT-J turns neighbours, each head's dimensions (2i, 2i + 1) by ``t / 10000^(2i/rotary_dim)``;
tfm turns dimension i with i + rotary_dim / 2 at the same angle. So the reader moves each head's
first ``rotary_dim`` columns of ``W_Q`` and ``W_K`` to tfm's order (the even ones, then the odd
ones; ``interleaved_order``) and writing a folder moves them back. A score ``q . k`` sums over a
head's dimensions in any order, so every score, pattern, loss and gradient is GPT-J's own; only
``attn.q`` and ``attn.k`` list a head's turned dimensions in tfm's order.
"""

from __future__ import annotations

import numpy as np

from tfmcli.engine.config import Config
from tfmcli.engine.sizes import param_shapes
from tfmcli.errors import TfmError
from tfmcli.sources import fused as fused_reader
from tfmcli.sources import gpt_neox, llama
from tfmcli.sources.folder import need, read_json

NAME = "GPT-J"
IGNORED = (".attn.bias", ".attn.masked_bias")   # causal-mask buffers older folders hold
KEYS = ("activation_function", "layer_norm_epsilon")   # GPT-J's names for them (GPT-2's)


def read_config(folder) -> dict:
    """Config fields from ``config.json``; TfmError naming the key at fault for a model tfm does
    not compute exactly."""
    path, config = read_json(folder)
    d, H = need(path, config, "n_embd"), need(path, config, "n_head")
    activation, eps = gpt_neox.common_keys(path, config, "gelu_new", (), KEYS)
    n_inner = config.get("n_inner")
    if n_inner is not None:
        n_inner = need(path, config, "n_inner")
    fields = {"d_model": d, "heads": H, "layers": need(path, config, "n_layer"),
              "vocab": need(path, config, "vocab_size"), "d_ff": n_inner, "eps": eps,
              "activation": activation, "norm": "pre", "pe": "rope", "rope_theta": 10000.0,
              "rms_norm": False, "bias": False, "ffn_bias": True, "head_bias": True,
              "tied_head": config.get("tie_word_embeddings", False), "causal": True,
              "parallel_residual": True, "shared_norm": True}
    if d % H == 0:
        fields["rotary_dim"] = _rotary_dim(path, config, d // H)
    return llama.runnable(path, fields)


ROTARY_DIM = 64   # GPTJConfig's and CodeGenConfig's default, for a config.json without the key


def _rotary_dim(path, config: dict, d_head: int) -> int | None:
    """``Config.rotary_dim`` from GPT-J's ``rotary_dim``: Hugging Face's default, 64, when the
    key is left out (a config.json of sizes only); None (the whole head) when it is null or the
    head's width; refused when odd or wider than the head."""
    if "rotary_dim" not in config:
        if ROTARY_DIM > d_head:
            raise TfmError(f"--load {path}: key 'rotary_dim' is missing, and Hugging Face's "
                           f"default, {ROTARY_DIM}, is wider than a head's {d_head} dimensions "
                           f"(its own model cannot run it); give rotary_dim")
        return None if ROTARY_DIM == d_head else ROTARY_DIM
    if config["rotary_dim"] is None:
        return None
    n = need(path, config, "rotary_dim")
    if n % 2 or n > d_head:
        raise TfmError(f"--load {path}: key 'rotary_dim' is {n}; RoPE turns pairs of a head's "
                       f"{d_head} dimensions, so tfm needs an even number up to {d_head}")
    return None if n == d_head else n


def interleaved_order(fields: dict) -> np.ndarray:
    """For each of tfm's columns of ``W_Q`` (and of ``W_K``), the GPT-J column it holds: in each
    head, GPT-J's even turned dimensions, then its odd ones, then the unturned ones as they are
    (so GPT-J's pair (2i, 2i + 1) is tfm's (i, i + rotary_dim / 2))."""
    cfg = Config(**fields)
    d_head, turned = cfg.d_head, cfg.rope_width
    within = np.r_[0:turned:2, 1:turned:2, turned:d_head]
    return (np.arange(cfg.heads)[:, None] * d_head + within).ravel()


def name_map(fields: dict, fused: bool = False) -> list[tuple[str, str | tuple, bool]]:
    """(Hugging Face key, tfm parameter, transposed) for every weight, in tfm's order.
    ``fused``: CodeGen's one ``qkv_proj`` a block, whose parameter is the tuple (W_Q, W_K, W_V)
    (its rows laid out as ``fused_rows`` says)."""
    shapes = param_shapes(Config(**fields))
    rows = [("transformer.wte.weight", "embed.W_E", False)]
    for i in range(fields["layers"]):
        m, p = f"transformer.h.{i}.", f"blocks.{i}."
        rows += [(m + "ln_1.weight", p + "ln1.gamma", False),
                 (m + "ln_1.bias", p + "ln1.beta", False)]
        if fused:
            rows.append((m + "attn.qkv_proj.weight", tuple(p + f"attn.W_{w}" for w in "QKV"),
                         True))
        rows += [(m + f"attn.{proj}.weight", p + f"attn.W_{w}", True)
                 for w, proj in zip("QKVO", ("q_proj", "k_proj", "v_proj", "out_proj"))
                 if not fused or w == "O"]
        for w, fc in (("1", "fc_in"), ("2", "fc_out")):
            rows += [(m + f"mlp.{fc}.weight", p + f"ffn.W_{w}", True),
                     (m + f"mlp.{fc}.bias", p + f"ffn.b_{w}", False)]
    rows += [("transformer.ln_f.weight", "ln_f.gamma", False),
             ("transformer.ln_f.bias", "ln_f.beta", False),
             ("lm_head.weight", "head.W_U", True), ("lm_head.bias", "head.b_U", False)]
    return [row for row in rows if all(n in shapes for n in llama.weight_names(row[1]))]


def fused_rows(fields: dict, parts: int = 4) -> dict[str, np.ndarray]:
    """CodeGen's ``qkv_proj``: for each of W_Q, W_K and W_V, the stored rows that hold its
    columns, in tfm's column order. The stored output is ``parts`` (4) pieces, each the queries,
    then the values, then the keys of ``heads / parts`` heads; W_Q's and W_K's columns are then
    put in ``interleaved_order``."""
    d = fields["d_model"]
    local = d // parts   # each piece's width of queries (of values, of keys)
    column = np.arange(d)
    piece, within = column // local, column % local
    rows = {w: piece * 3 * local + offset * local + within
            for w, offset in (("Q", 0), ("V", 1), ("K", 2))}
    order = interleaved_order(fields)
    return {"Q": rows["Q"][order], "K": rows["K"][order], "V": rows["V"]}


def _picks(fields: dict, fused: bool) -> dict[str, np.ndarray]:
    """The stored rows of each of Q, K and V (``fused.load_params``): CodeGen's pieces
    (``fused_rows``), or GPT-J's W_Q and W_K reordered (``interleaved_order``)."""
    if fused:
        return fused_rows(fields)
    order = interleaved_order(fields)
    return {"Q": order, "K": order}


def load_params(folder, fields: dict, dtype, fused: bool = False, checkpoint: str = NAME,
                ignored: tuple = IGNORED) -> dict[str, np.ndarray]:
    """The folder's weights under tfm's names, transposed to ``(d_in, d_out)``, in ``dtype``,
    ``W_Q``'s and ``W_K``'s columns in tfm's order (``interleaved_order``); ``fused``,
    CodeGen's ``qkv_proj`` cut into the three (``fused_rows``). Every key and shape is checked
    before any is read."""
    return fused_reader.load_params(folder, fields, dtype, name_map(fields, fused), checkpoint,
                                    "lm_head.weight" if fields["tied_head"] else None, ignored,
                                    _picks(fields, fused))


def lazy_params(folder, fields: dict, dtype, fused: bool = False, checkpoint: str = NAME,
                ignored: tuple = IGNORED):
    """``load_params``' weights, read when used (``fused.lazy_params``)."""
    return fused_reader.lazy_params(folder, fields, dtype, name_map(fields, fused), checkpoint,
                                    "lm_head.weight" if fields["tied_head"] else None, ignored,
                                    _picks(fields, fused))


def from_tfm(params: dict, fields: dict, fused: bool = False) -> dict[str, np.ndarray]:
    """tfm's parameters under GPT-J's (``fused``: CodeGen's) names, the inverse of
    ``load_params``: ``W_Q``'s and ``W_K``'s columns back in GPT-J's order, and CodeGen's
    three put back in their rows of ``qkv_proj``; for writing a folder."""
    return fused_reader.from_tfm(params, fields, name_map(fields, fused), _picks(fields, fused))
