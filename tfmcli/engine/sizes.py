"""What can be known about a run without running it: every parameter's and activation's shape,
parameter counts, FLOPs and the memory a run needs, from the Config alone.

So ``tfm shapes`` answers instantly for a GPT-2-sized block, and the CLI refuses a run that
would not fit in memory before allocating anything.
"""

from __future__ import annotations

import functools
import math
from collections import OrderedDict
from typing import NamedTuple

from tfmcli.engine.config import ADDED_PES, Config


def param_shapes(cfg: Config) -> OrderedDict[str, tuple[int, ...]]:
    """Every parameter name and shape, in the order they are initialised."""
    d, V, F = cfg.d_model, cfg.vocab, cfg.ff
    shapes: OrderedDict[str, tuple[int, ...]] = OrderedDict()
    shapes["embed.W_E"] = (V, d)
    if cfg.pe == "learned":
        shapes["embed.W_pos"] = (cfg.ctx, d)
    if cfg.embed_norm:   # BLOOM's norm of the embedding
        _norm_shapes(shapes, "ln_embed", d, cfg)
    for i in range(cfg.layers):
        p = f"blocks.{i}."
        _norm_shapes(shapes, p + "ln1", d, cfg)
        for w in "QKVO":   # grouped: fewer heads of keys and values, so narrower W_K, W_V
            width = {"Q": cfg.d_q, "K": cfg.d_kv, "V": cfg.d_kv, "O": d}[w]
            shapes[p + f"attn.W_{w}"] = (cfg.d_q, d) if w == "O" else (d, width)
            if cfg.bias or (cfg.qkv_bias and w != "O"):
                shapes[p + f"attn.b_{w}"] = (width,)
        if cfg.qk_norm:   # one norm for every head's queries, one for its keys (Qwen3)
            for norm in ("q_norm", "k_norm"):
                _norm_shapes(shapes, p + f"attn.{norm}", cfg.d_head, cfg)
        if cfg.sandwich_norm:   # the norm of attention's output
            _norm_shapes(shapes, p + "ln1_post", d, cfg)
        if not cfg.shared_norm:   # shared: the FFN reads ln1's output too
            _norm_shapes(shapes, p + "ln2", d, cfg)
        if cfg.gated:   # the gate, which silu (GELU) turns into each unit's weight
            shapes[p + "ffn.W_gate"] = (d, F)
            if cfg.ffn_biased:
                shapes[p + "ffn.b_gate"] = (F,)
        shapes[p + "ffn.W_1"] = (d, F)
        if cfg.ffn_biased:
            shapes[p + "ffn.b_1"] = (F,)
        shapes[p + "ffn.W_2"] = (F, d)
        if cfg.ffn_biased:
            shapes[p + "ffn.b_2"] = (d,)
        if cfg.sandwich_norm:   # the norm of the FFN's output
            _norm_shapes(shapes, p + "ln2_post", d, cfg)
    if cfg.norm == "pre":
        _norm_shapes(shapes, "ln_f", d, cfg)
    if not cfg.tied_head:
        shapes["head.W_U"] = (d, V)
    if cfg.head_bias:
        shapes["head.b_U"] = (V,)
    return shapes


def _norm_shapes(shapes: dict, name: str, width: int, cfg: Config) -> None:
    """A norm's parameters: ``gamma``, and ``beta`` unless it is RMSNorm or has none
    (``norm_bias`` false)."""
    shapes[name + ".gamma"] = (width,)
    if cfg.norm_biased:
        shapes[name + ".beta"] = (width,)


class Misfit(NamedTuple):
    """The first way a set of parameters is not a Config's (``param_misfit``)."""
    kind: str     # "missing", "unknown", "shape" or "dtype"
    name: str     # the parameter
    have: object  # its shape or dtype ("shape", "dtype")
    want: object  # the Config's
    more: int     # how many more are missing or unknown besides ``name``


_cached_shapes = functools.lru_cache(maxsize=16)(param_shapes)   # read only: shared


def param_misfit(params: dict, cfg: Config) -> Misfit | None:
    """None when ``params`` are exactly ``cfg``'s parameters (``param_shapes``, in
    ``cfg.dtype``); else the first misfit: a name missing, then, in ``params``' order, a name
    unknown, a shape or a dtype that differs."""
    shapes = _cached_shapes(cfg)
    missing = [name for name in shapes if name not in params]
    if missing:
        return Misfit("missing", missing[0], None, None, len(missing) - 1)
    lazy = hasattr(params, "meta")   # read when asked for (sources: streamed): not read here
    for name in params:
        if name not in shapes:
            unknown = sum(other not in shapes for other in params)
            return Misfit("unknown", name, None, None, unknown - 1)
        shape, dtype = params.meta(name) if lazy else (params[name].shape, params[name].dtype)
        if shape != shapes[name]:
            return Misfit("shape", name, shape, shapes[name], 0)
        if dtype != cfg.np_dtype:
            want = cfg.dtype if cfg.np_dtype == cfg.dtype else f"{cfg.dtype} (in float32 arrays)"
            return Misfit("dtype", name, dtype, want, 0)
    return None


def activation_shapes(cfg: Config) -> OrderedDict[str, tuple[int, ...]]:
    """Every named activation and its shape, in forward order (the model produces exactly these)."""
    B, T, d, H, F, V = cfg.batch, cfg.seq_len, cfg.d_model, cfg.heads, cfg.ff, cfg.vocab
    btd = (B, T, d)
    heads = (B, H, T, cfg.d_head)
    kv_heads = (B, cfg.h_kv, T, cfg.d_head)   # H of them unless grouped
    shapes: OrderedDict[str, tuple[int, ...]] = OrderedDict()
    shapes["embed"] = btd
    if cfg.pe in ADDED_PES:
        shapes["pe"] = (T, d)
    if cfg.embed_norm:   # the first block's input
        shapes["ln_embed.out"] = btd
    for i in range(cfg.layers):
        p = f"blocks.{i}."
        attn = [(p + "attn.q", heads), (p + "attn.k", kv_heads), (p + "attn.v", kv_heads)]
        if cfg.qk_norm:   # each head's q and k normalised
            attn += [(p + "attn.q_norm.out", heads), (p + "attn.k_norm.out", kv_heads)]
        if cfg.pe == "rope":   # q and k turned by their positions' angles
            attn += [(p + "attn.q_rot", heads), (p + "attn.k_rot", kv_heads)]
        attn += [(p + "attn.scores", (B, H, T, T)), (p + "attn.pattern", (B, H, T, T)),
                 (p + "attn.context", (B, T, cfg.d_q)), (p + "attn.out", btd)]
        ffn = [(p + "ffn.pre", (B, T, F)), (p + "ffn.act", (B, T, F)), (p + "ffn.out", btd)]
        if cfg.gated:   # act = silu(gate) * pre, or gelu(gate) * pre
            ffn.insert(0, (p + "ffn.gate", (B, T, F)))
        shapes[p + "in"] = btd
        if cfg.sandwich_norm:   # each sublayer's output normalised
            attn.append((p + "ln1_post.out", btd))
            ffn.append((p + "ln2_post.out", btd))
        if cfg.norm == "pre":
            ln2 = [] if cfg.shared_norm else [(p + "ln2.out", btd)]
            order = [(p + "ln1.out", btd), *attn, (p + "resid1", btd),
                     *ln2, *ffn, (p + "resid2", btd)]
        else:
            order = [*attn, (p + "resid1", btd), (p + "ln1.out", btd),
                     *ffn, (p + "resid2", btd), (p + "ln2.out", btd)]
        shapes.update(order)
        shapes[p + "out"] = btd
    if cfg.norm == "pre":
        shapes["ln_f.out"] = btd
    shapes["logits"] = (B, T, V)
    shapes["probs"] = (B, T, V)
    return shapes


def numel(shape: tuple[int, ...]) -> int:
    """The entries of ``shape``, counted in Python integers (int64 wraps negative for sizes
    that no machine holds, and a negative count would pass the memory guard)."""
    return math.prod(int(n) for n in shape)


def per_layers(total, cfg: Config):
    """``total(cfg)`` for any number of layers, from the 1- and 2-layer values.

    Every count here is affine in the number of blocks, so a deep config costs no more to
    describe than a shallow one. ``total`` returns a number or a dict of numbers. Which blocks
    slide (``sliding_layers``) changes no count: the one- and two-block models leave it out.
    """
    one, two = (total(cfg.replace(layers=n, sliding_layers=None)) for n in (1, 2))
    extra = cfg.layers - 1
    if isinstance(one, dict):
        return type(one)((key, one[key] + extra * (two[key] - one[key])) for key in one)
    return one + extra * (two - one)


def param_count(cfg: Config) -> int:
    return per_layers(lambda c: sum(numel(s) for s in param_shapes(c).values()), cfg)


def param_groups(cfg: Config) -> OrderedDict[str, int]:
    """Parameter counts per group (embed, attn, ln, ffn, head), summed over blocks."""
    def groups_of(c):
        groups: OrderedDict[str, int] = OrderedDict()
        for name, shape in param_shapes(c).items():
            group = name.split(".")[2] if name.startswith("blocks.") else name.split(".")[0]
            group = "ln" if group in ("ln1", "ln2", "ln_f", "ln1_post", "ln2_post",
                                      "ln_embed") else group
            groups[group] = groups.get(group, 0) + numel(shape)
        return groups
    return per_layers(groups_of, cfg)


def ffn_products(cfg: Config) -> int:
    """The FFN's matrix products of d x d_ff multiply-adds per row: W_1 and W_2, and a gated
    FFN's W_gate."""
    return 3 if cfg.gated else 2


def flops(cfg: Config) -> tuple[int, int]:
    """(forward, backward) floating-point operations of the matrix products, 2 per multiply-add.

    Attention's two batched products (Q K^T and pattern @ V) are included. Backward does two
    products for every forward one (the input gradient and the weight gradient; attention's
    dQ, dK and dpattern, dV), so it is twice the forward. Element-wise work is left out.
    """
    B, T, d, F, V = cfg.batch, cfg.seq_len, cfg.d_model, cfg.ff, cfg.vocab
    per_block = 2 * B * T * d * (2 * cfg.d_q + 2 * cfg.d_kv)   # Q, K, V, O projections
    per_block += 2 * 2 * B * T * T * cfg.d_q   # Q K^T and pattern @ V over all heads
    per_block += 2 * ffn_products(cfg) * B * T * d * F   # W_1, W_2 (and W_gate)
    forward = cfg.layers * per_block + 2 * B * T * d * V
    return forward, 2 * forward


def memory_estimate(cfg: Config, cast: bool = True) -> dict[str, int]:
    """Bytes of the peak of init + forward + backward, by part, from the config alone.

    A run keeps every parameter and its gradient, every activation and the gradient of each
    (counted once per array: a block's ``out`` is the next block's ``in``, and in Pre-LN also
    its ``resid2``), and what the backward caches besides (layer-norm ``xhat`` and ``rstd``,
    GELU's and GeGLU's tanh, exact GELU's Phi(x), SwiGLU's sigmoid, the boolean mask, RoPE's two
    tables, ALiBi's distances, grouped
    attention's keys and values repeated to every head, the q and k norms' ``xhat`` and
    ``rstd``). On top of that comes one transient: the forward's largest temporary (a
    (B, H, T, T) or (B, T, V) array, at the end of the forward), or GELU's backward, which
    briefly holds about three (B, T, d_ff) arrays (exact GELU's and a gated FFN's one: the
    slope, made before dgate; grouped attention's dk and dv at every head, two (B, T, H d_head);
    capped scores'
    gradient before the cap, one (B, H, T, T); capped logits', one (B, T, V)).
    ``tests/test_memory.py`` holds this within 8% of what tracemalloc measures (0.956-1.071 of it).

    float16 and bfloat16 (``engine.precision``) hold more, their ``"rounding"``: the rounding
    of the largest tensor (its rounded copy beside it, made a chunk at a time) and, unless the
    weights are ``cast`` (``precision.Cast``, as a run's are), the weights as the pass read
    them, rounded (the caches keep them): a plain dict of weights, or a streamed run's read
    from their files. ``tests/test_precision.py`` holds both within 10% of tracemalloc's peak.
    """
    item = cfg.np_dtype.itemsize   # float16 and bfloat16: held in float32 (engine.precision)
    B, T, d, H, F, V, L = (cfg.batch, cfg.seq_len, cfg.d_model, cfg.heads, cfg.ff, cfg.vocab,
                           cfg.layers)
    btd, bhtt, btf, btv = B * T * d, B * H * T * T, B * T * F, B * T * V
    pre, gelu = cfg.norm == "pre", cfg.activation in ("gelu", "gelu_erf")   # t, or Phi(x)
    gated = cfg.gated   # the gate a block, its gradient; SwiGLU's sigmoid or GeGLU's tanh cached
    sinusoidal, positions = cfg.pe == "sinusoidal", cfg.pe in ADDED_PES  # learned: a view of W_pos
    rope = cfg.pe == "rope"   # q_rot and k_rot a block, their gradients; the two tables cached
    tables = len({cfg.rope(i) for i in range(L)}) if rope else 0   # (cos, sin) a RoPE: Gemma 3, 2
    alibi = cfg.pe == "alibi"   # ALiBi's cached distances (T, T) and slopes (H,)
    btk = B * T * cfg.d_kv    # k, v (and k_rot): BTd unless grouped
    btq = B * T * cfg.d_q     # q, context (and q_rot): BTd unless head_dim says otherwise
    grouped = cfg.group > 1   # then attention keeps k and v repeated to H heads, and its
    #                           backward makes dk, dv at H heads before their sums
    qk = cfg.qk_norm          # q and k normalised a block, their gradients; each norm's cache
    sandwich = cfg.sandwich_norm   # two more norms a block: outputs, input gradients, caches
    parallel = cfg.parallel_residual   # dy is dz: one input gradient fewer a block
    embed_norm = cfg.embed_norm   # one more norm: its output, its input's gradient, its cache
    shared = cfg.shared_norm       # one norm fewer a block: no ln2
    params = param_count(cfg)
    # per block: ln/resid/out arrays (6 x BTd), q and context, k and v, scores and pattern,
    # FFN hidden x 2
    acts = (L * ((6 + 2 * sandwich - shared) * btd + (2 + rope + qk) * btq + (2 + rope + qk) * btk
                 + 2 * bhtt + (2 + gated) * btf)
            + (1 + embed_norm) * btd + sinusoidal * T * d + positions * btd + pre * btd + 2 * btv)
    # their gradients: 4 x BTd, dq and dcontext, dk and dv a block (a sum shares its terms'
    # gradient), and the embedding's
    dacts = (
        L
        * (
            (4 + 2 * sandwich - parallel - shared) * btd
            + (2 + rope + qk) * btq
            + (2 + rope + qk) * btk
            + 2 * bhtt
            + (2 + gated) * btf
        )
        + (1 + embed_norm) * btd
        + pre * btd
        + positions * T * d
        + 2 * btv
    )
    caches = (
        (2 * L + 2 * sandwich * L - shared * L + pre + embed_norm) * (btd + B * T)
        + (gelu + gated) * L * btf
        + tables * 2 * T * cfg.rope_width
        + alibi * (T * T + H)
        + grouped * L * 2 * btq
        + qk * L * (btq + btk + B * T * (H + cfg.h_kv))
    )
    forward_transient = max(bhtt, btv)
    activation_transient = {"gelu": 3, "gelu_erf": 1, "geglu": 1, "swiglu": 1,
                            "geglu_erf": 1}.get(
        cfg.activation, 0) * btf
    # capped scores: the fast backward's gradient before the cap is an array of its own
    backward_transient = max(activation_transient, grouped * 2 * btq,
                             (cfg.attn_softcap is not None) * bhtt)
    # capped logits: so is the logits' gradient before the cap, made and let go in the head's
    # backward, before any block's gradients exist (the head's dW_U and the loss's two (B, T,
    # V) gradients do)
    head_transient = (cfg.logit_softcap is not None) * (
        btv - (params - V * d) - (dacts - 2 * btv - pre * btd))
    transient = max(forward_transient - params - dacts, backward_transient, head_transient, 0)
    parts = {"params": params * item, "grads": params * item, "activations": acts * item,
             "activation grads": dacts * item, "caches": caches * item + B * T * T,
             "transient": transient * item}
    if cfg.np_dtype != cfg.dtype:   # rounded: a tensor's rounding (and the weights read)
        from tfmcli.engine.precision import CHUNK  # here, not at import (tfm mask needs none)

        largest = max(bhtt, btv, btf, V * d, d * F)   # an activation, or a weight's gradient
        # a tensor's rounding is made beside it a chunk at a time (precision._chunked): its
        # result, and a chunk's scratch on each thread (float16's: its bits, 4 bytes, and a
        # mask, 1; inside a pass, one thread)
        parts["rounding"] = (not cast) * params * item + largest * item + 5 * CHUNK
    parts["total"] = sum(parts.values())
    return parts


def streamed_estimate(cfg: Config, lazy: bool = False, kept=(), held=()) -> dict[str, int]:
    """Bytes of the peak of a streamed forward + backward (``model.forward(keep=...)``), by
    ``memory_estimate``'s parts, with nothing kept beyond what the pass must hold.

    A streamed pass holds every block's input and output (and, in the backward, their
    gradients) but one block's activations, caches and gradients at a time: a one-block
    model's, plus the streams of the other ``layers - 1`` blocks. Its parameters' gradients
    are summarised and dropped a block at a time, so it holds one block's and the
    embedding's and head's. ``lazy``: the weights are read from their files when used
    (``sources.llama.LazyParams``), so one block's are held, not every block's; else every
    parameter is in memory. ``kept``: activations a view keeps whole (each with its gradient),
    ``held``: parameters whose gradients it keeps: they count besides (``"kept"``).
    """
    one = memory_estimate(cfg.replace(layers=1, sliding_layers=None), cast=not lazy)
    whole = memory_estimate(cfg)
    item = cfg.np_dtype.itemsize   # float16 and bfloat16: held in float32 (engine.precision)
    streams = (cfg.layers - 1) * cfg.batch * cfg.seq_len * cfg.d_model * item
    parts = {"params": one["params"] if lazy else whole["params"], "grads": one["grads"],
             "activations": one["activations"] + streams,
             "activation grads": one["activation grads"] + streams,
             "caches": one["caches"], "transient": one["transient"]}
    if "rounding" in one:   # float16, bfloat16: a tensor's rounding and, read from their
        parts["rounding"] = one["rounding"]   # files, a block's weights, its caches holding
        #                                       them until its backward
    parts["kept"] = 0
    if kept or held:   # (each name's shape: a model of a thousand blocks is not listed for none)
        acts, params = activation_shapes(cfg), param_shapes(cfg)
        parts["kept"] = item * (2 * sum(numel(acts[n]) for n in kept if n in acts)
                                + sum(numel(params[n]) for n in held if n in params))
    parts["total"] = sum(parts.values())
    return parts
