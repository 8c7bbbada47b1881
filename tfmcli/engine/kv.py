"""Incremental decoding with a KV cache (seed 002): one token at a time, each block keeping the
keys and values of every earlier position, so a step computes one new query, key and value
instead of the whole prefix again.

The result of every step must equal the same row of the full causal forward; ``decode``
returns what each step did so that the CLI (and the tests) can check and show it.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from tfmcli.engine import ops, precision
from tfmcli.engine.blocks import alibi_for, normalise, rope_for
from tfmcli.engine.config import Config
from tfmcli.engine.model import head_logits, positions
from tfmcli.engine.sizes import activation_shapes, ffn_products, flops
from tfmcli.errors import ConfigError, InputsError


class KVStep(NamedTuple):
    step: int             # the position decoded (0-based); the cache then holds step + 1 keys
    token: int
    cache_shape: tuple    # (H_kv, cache_len, d_head): each block's K and V after this step
    #                       (with sliding_layers, the widest block's: every earlier key's)
    attention: dict       # (block, head) -> (step + 1,) the new query's attention weights on
    #                       every position so far (0 on those a sliding window has dropped)
    logits: np.ndarray    # (V,)
    flops_cached: int     # matmul FLOPs of this step with the cache
    flops_full: int       # matmul FLOPs of recomputing the prefix from scratch


def step_flops(cfg: Config, cache_len) -> int:
    """Matmul FLOPs (2 per multiply-add) of decoding one token against ``cache_len`` keys in
    every block, or against ``cache_len[i]`` in block i (a sequence: each block's own, when only
    some slide).

    Per block: the four projections of one row (8 d^2; 4 d d_q + 4 d d_kv when grouped or with
    a head_dim of its own), the new query against every cached key and the weighted sum of the
    cached values (4 cache_len d_q),
    the FFN (4 d d_ff, 6 d d_ff with SwiGLU's gate); then the head of one position (2 d V).
    """
    d, F, V = cfg.d_model, cfg.ff, cfg.vocab
    lens = [cache_len] * cfg.layers if np.ndim(cache_len) == 0 else list(cache_len)
    per_block = 4 * d * cfg.d_q + 4 * d * cfg.d_kv + 2 * ffn_products(cfg) * d * F
    return sum(per_block + 4 * c * cfg.d_q for c in lens) + 2 * d * V


def chosen_probabilities(steps: list[KVStep]) -> list[float | None]:
    """Each step's token's probability after the step before (the softmax of that step's
    logits at it); None for the first, which nothing came before."""
    return [None] + [float(ops.softmax_forward(before.logits)[0][step.token])
                     for before, step in zip(steps, steps[1:])]


def _attend(q, K, V, scale, cap=None, bias=None, hook=None):
    """q: (H, d_head) against K, V: (H, c, d_head) -> context (H, d_head), weights (H, c);
    ``bias`` (H, c) added to each scaled score (ALiBi's) unless it is None, and each score
    soft-capped at ``cap`` (``Config.attn_softcap``) unless it is None. ``hook(part, x)``
    changes the scores and the weights ("scores", "pattern") as an intervention would."""
    rnd = precision.rounding()   # float16, bfloat16: each step rounded, as the forward's
    scores = rnd(rnd((K @ q[:, :, None])[..., 0]) * scale)       # (H, c)
    if bias is not None:
        scores += bias
        scores = rnd(scores)
    if cap is not None:
        scores = ops.softcap_forward(scores, cap)
    if hook is not None:
        scores = hook("scores", scores)
    weights, _ = ops.softmax_forward(scores)
    if hook is not None:
        weights = hook("pattern", weights)
    return rnd((weights[:, None, :] @ V)[:, 0, :]), weights       # (H, d_head), (H, c)


class StepHooks:
    """An intervention plan (``engine.interventions.Plan``, made for one row of all the
    decoded positions) applied to one step's activations: each is put at its place in a
    full-size array (row 0, position t; a score's row t, keys ``start..t``), changed there as
    the whole forward changes it, and taken back. A mean ablation's means must be the whole
    run's, made before (``Plan.means``)."""

    def __init__(self, plan, shapes, round=None):
        self.plan, self.shapes = plan, shapes
        self.round = round or (lambda x: x)   # float16, bfloat16: as the dtype stores x
        self.t, self.start = 0, 0

    def __call__(self, name: str, x):
        x = self.round(x)
        if not self.plan or name not in self.plan.steps:
            return x
        shape = self.shapes[name]
        full = np.zeros(shape, dtype=np.asarray(x).dtype)
        if name.endswith(("attn.scores", "attn.pattern")):
            place = (0, slice(None), self.t, slice(self.start, self.t + 1))
        elif len(shape) == 4:                                     # a head's (B, H, T, d_head)
            place = (0, slice(None), self.t)
        elif len(shape) == 2:                                     # the positions' (T, d)
            place = (self.t,)
        else:
            place = (0, self.t)
        full[place] = x
        return self.round(self.plan.apply(name, full)[place])

    def block(self, p: str):
        """hook(part, x) for attention's scores and pattern of block ``p``."""
        return lambda part, x: self(p + "attn." + part, x)


def window_start(cfg: Config, t: int, block: int = 0) -> int:
    """The first position query t sees in block ``block``: 0, or where that block slides
    (``Config.window``) with a window of W the last W's first."""
    window = cfg.window(block)
    return 0 if window is None else max(0, t - window + 1)


def cache_slots(cfg: Config, T: int, block: int = 0) -> int:
    """Slots of block ``block``'s K and V caches for T positions: T, or a sliding block's
    min(T, W), a rolling buffer."""
    window = cfg.window(block)
    return T if window is None else min(T, window)


def _mha_step(x, P, p, cfg, K, V, t, rope, start, alibi=None, hook=None):
    """Attention of position t's row x (d,): its k, v join the cache; returns (out, weights
    (H, t + 1)). With RoPE (``rope``: the (cos, sin) tables) q and k are turned by position t's
    angles first: a cached key keeps the turn of its own position, and no step turns it again.
    Grouped (``kv_heads``), the cache holds H_kv heads, each read by the ``group`` query heads it
    serves. The cache has C slots (``K.shape[1]``) and position t goes in slot t mod C: with a
    sliding window of W, C is W (a rolling buffer), and position t overwrites t - W, which no
    query from t on sees. ``start`` is the first position the query sees (``window_start``).
    ``alibi``: ALiBi's slopes and distances (``blocks.alibi_for``), or None."""
    H, dh = cfg.heads, cfg.d_head
    hook = hook or (lambda name, value: value)
    q = ops.linear_forward(x, P[p + "attn.W_Q"], P.get(p + "attn.b_Q"))[0].reshape(H, dh)
    k = ops.linear_forward(x, P[p + "attn.W_K"], P.get(p + "attn.b_K"))[0].reshape(cfg.h_kv, dh)
    v = ops.linear_forward(x, P[p + "attn.W_V"], P.get(p + "attn.b_V"))[0]
    q, k = hook(p + "attn.q", q), hook(p + "attn.k", k)
    v = hook(p + "attn.v", v.reshape(cfg.h_kv, dh))
    if cfg.qk_norm:   # each head's q and k normalised before the turn (Qwen3)
        q, k = normalise(q, P, p + "attn.q_norm", cfg), normalise(k, P, p + "attn.k_norm", cfg)
        q, k = hook(p + "attn.q_norm.out", q), hook(p + "attn.k_norm.out", k)
    if rope is not None:
        cos, sin = rope[0][t], rope[1][t]                        # (d_head,)
        q, k = ops.rope_forward(q, cos, sin), ops.rope_forward(k, cos, sin)
        q, k = hook(p + "attn.q_rot", q), hook(p + "attn.k_rot", k)
    C = K.shape[1]
    K[:, t % C] = k
    V[:, t % C] = v
    if t < C:                                                     # no slot overwritten yet
        keys, values = K[:, start:t + 1], V[:, start:t + 1]       # (H_kv, c, d_head)
    else:                                                         # positions start..t, in order
        slots = np.arange(start, t + 1) % C
        keys, values = K[:, slots], V[:, slots]
    if cfg.group > 1:
        keys, values = np.repeat(keys, cfg.group, axis=0), np.repeat(values, cfg.group, axis=0)
    # ALiBi: - m_h (t - j) for the keys j = start..t it sees
    bias = None if alibi is None else -alibi.slopes[:, None] * alibi.distances[t, start:t + 1]
    steps = hook.block(p) if isinstance(hook, StepHooks) else None
    context, seen = _attend(q, keys, values, cfg.score_scale, cfg.attn_softcap, bias, steps)
    context = hook(p + "attn.context", context.reshape(-1))
    out = hook(p + "attn.out",
               ops.linear_forward(context, P[p + "attn.W_O"], P.get(p + "attn.b_O"))[0])
    if start == 0:
        return out, seen                                          # (d,), (H, t + 1)
    weights = np.zeros((H, t + 1), dtype=seen.dtype)              # 0 on the dropped positions
    weights[:, start:] = seen
    return out, weights


def _ffn_step(x, P, p, cfg, hook=None):
    hook = hook or (lambda name, value: value)
    if cfg.gated:
        gate = ops.linear_forward(x, P[p + "ffn.W_gate"], P.get(p + "ffn.b_gate"))[0]
        gate = hook(p + "ffn.gate", gate)
    pre = hook(p + "ffn.pre", ops.linear_forward(x, P[p + "ffn.W_1"], P.get(p + "ffn.b_1"))[0])
    if cfg.gated:
        hidden = ops.GATES[cfg.activation][0](gate, pre)[0]
    else:
        hidden = ops.ACTIVATIONS[cfg.activation][0](pre)[0]
    hidden = hook(p + "ffn.act", hidden)
    return hook(p + "ffn.out",
                ops.linear_forward(hidden, P[p + "ffn.W_2"], P.get(p + "ffn.b_2"))[0])


def decode(params: dict, tokens, cfg: Config, generate: int = 0, plan=None) -> list[KVStep]:
    """Run the causal model on ``tokens`` (a 1-D sequence of ids) one token at a time, then
    ``generate`` tokens more, each the most likely next token after the step before (greedy:
    the argmax of its logits, the lowest id on a tie), decoded with the same cache.

    Each block's cache is allocated once, (H_kv, T, d_head) for K and for V, and filled one
    position per step; the step's attention reads the filled part ``[:, :t + 1]``. With a
    sliding window of W (``sliding_window``) it is a rolling buffer of min(T, W) slots, and the
    step reads the last W positions (in the blocks ``sliding_layers`` names, if it names any).
    The block arithmetic is the model's (Pre-LN or Post-LN, with or without the sandwich's
    output norms), on one row instead of (B, T).
    One step per position: ``len(tokens) + generate`` in all, the generated ones last.
    ``plan``: interventions (``engine.interventions.Plan``) made for one row of all those
    positions, applied to each step's activations as the whole forward applies them.
    """
    policy = precision.of(cfg.dtype)   # float16, bfloat16: the weights rounded once, up front
    P = params if policy.exact else dict(precision.stored(params, policy).items())
    if not cfg.causal:
        raise ConfigError("causal", "decoding with a KV cache needs a causal model (causal=True): "
                                    "a step cannot see the tokens after it")
    tokens = np.asarray(tokens)
    if tokens.ndim != 1 or tokens.size == 0 or tokens.dtype.kind not in "iu":
        raise InputsError(f"decode: tokens has shape {tokens.shape} and dtype {tokens.dtype}; "
                          f"give one sequence of one or more ids (integers)")
    bad = tokens[(tokens < 0) | (tokens >= cfg.vocab)]
    if bad.size:
        raise InputsError(f"decode: token {int(bad[0])} is outside 0..{cfg.vocab - 1} "
                          f"(vocab {cfg.vocab})")
    whole = isinstance(generate, (int, np.integer)) and not isinstance(generate, bool)
    if not (whole and generate >= 0):
        raise ValueError(f"decode: generate={generate!r}; it must be a whole number at least 0")
    T, dh = len(tokens) + int(generate), cfg.d_head
    if cfg.pe == "learned" and T > cfg.ctx:
        raise InputsError(f"decode: {len(tokens)} tokens and {generate} to generate need {T} "
                          f"positions; the model has {cfg.ctx} learned positions (n_ctx)")
    tokens = list(tokens.astype(np.int64))
    pe = positions(P, cfg, T)                                     # (T, d) or None
    rope = [rope_for(cfg, T, i) for i in range(cfg.layers)]       # each block's (cos, sin) or None
    alibi = alibi_for(cfg, T)  # ALiBi's slopes, distances or None
    slots = [cache_slots(cfg, T, i) for i in range(cfg.layers)]   # each block's cache
    K = [np.zeros((cfg.h_kv, C, dh), dtype=cfg.np_dtype) for C in slots]
    V = [np.zeros((cfg.h_kv, C, dh), dtype=cfg.np_dtype) for C in slots]
    hook = StepHooks(plan, activation_shapes(cfg.replace(batch=1, seq_len=T, lengths=None))
                     if plan else None, policy.round)
    with precision.using(policy):
        return _decode(P, tokens, cfg, T, pe, rope, alibi, K, V, hook)


def _decode(P, tokens, cfg, T, pe, rope, alibi, K, V, hook) -> list[KVStep]:
    """``decode``'s steps, in the dtype's rounding."""
    H, dh, slots = cfg.heads, cfg.d_head, [cache.shape[1] for cache in K]

    def norm(x, name):   # a norm's output, as kept
        return hook(name + ".out", normalise(x, P, name, cfg))

    steps = []
    for t in range(T):
        if t == len(tokens):   # past the given tokens: the last step's most likely next token
            tokens.append(int(np.argmax(steps[-1].logits)))
        token = tokens[t]
        hook.t = t
        x = hook("embed", P["embed.W_E"][token] * cfg.embed_factor)   # (d,); factor 1 unscaled
        x = x if pe is None else x + hook("pe", pe[t])
        if cfg.embed_norm:
            x = norm(x, "ln_embed")
        attention = {}
        for i in range(cfg.layers):
            p, start = f"blocks.{i}.", window_start(cfg, t, i)
            hook.start = start
            x = hook(p + "in", x)
            if cfg.norm == "pre":     # y = x + MHA(LN1(x)); z = y + FFN(LN2(y))
                h = norm(x, p + "ln1")
                out, weights = _mha_step(h, P, p, cfg, K[i], V[i], t, rope[i], start, alibi,
                                         hook)
                if cfg.sandwich_norm:   # y = x + LN1_post(MHA(LN1(x)))
                    out = norm(out, p + "ln1_post")
                y = hook(p + "resid1", x + out)
                if not cfg.shared_norm:   # shared: z = y + FFN(LN1(x)), h as it is
                    # parallel: z = y + FFN(LN2(x))
                    h = norm(x if cfg.parallel_residual else y, p + "ln2")
                out = _ffn_step(h, P, p, cfg, hook)
                if cfg.sandwich_norm:
                    out = norm(out, p + "ln2_post")
                x = hook(p + "resid2", y + out)
            else:                     # y = LN1(x + MHA(x)); z = LN2(y + FFN(y))
                out, weights = _mha_step(x, P, p, cfg, K[i], V[i], t, rope[i], start, alibi,
                                         hook)
                y = norm(hook(p + "resid1", x + out), p + "ln1")
                x = norm(hook(p + "resid2", y + _ffn_step(y, P, p, cfg, hook)), p + "ln2")
            x = hook(p + "out", x)
            attention.update({(i, h): weights[h] for h in range(H)})
        if cfg.norm == "pre":
            x = norm(x, "ln_f")
        logits = hook("logits", head_logits(x, P, cfg))                        # (V,)
        full = flops(cfg.replace(batch=1, seq_len=t + 1, lengths=None))[0]
        seen = [t + 1 - window_start(cfg, t, i) for i in range(cfg.layers)]   # keys attended
        steps.append(KVStep(t, int(token), (cfg.h_kv, min(t + 1, max(slots)), dh), attention,
                            logits, step_flops(cfg, seen), full))
    return steps
