"""A transformer block, forward and backward: one function per kind of block, each body reading
like its formula, and the sublayers they are made of (norm, attention, FFN).

    pre_ln_block     y = x + MHA(LN1(x))          z = y + FFN(LN2(y))      GPT-2, LLaMA
                     (sandwich: each sublayer's output normed too)         Gemma 2 and 3
    parallel_block   y = x + MHA(LN1(x))          z = y + FFN(LN2(x))      GPT-NeoX, Falcon
                     (shared norm: z = x + MHA(LN1(x)) + FFN(LN1(x)))      GPT-J, Phi-2
    post_ln_block    y = LN1(x + MHA(x))          z = LN2(y + FFN(y))      Vaswani et al.

A pass's ``Tape`` carries what every sublayer reads (the parameters, the Config, each block's
mask) and keeps what it makes: the named activations, the caches the backward reads, and in the
backward each parameter's and activation's gradient. The math is ``ops``' forward/backward pairs.
"""

from __future__ import annotations

import functools
from collections import OrderedDict
from typing import NamedTuple

import numpy as np

from tfmcli.engine import ops, positional, precision
from tfmcli.engine.config import Config
from tfmcli.engine.masks import combined_mask


class Tape:
    """One pass: what its sublayers read (``P``, ``cfg``, ``masks`` by block, ``fast``) and what
    they keep (``acts`` in forward order, ``caches`` by sublayer; ``grads`` and ``dacts`` in the
    backward, which reads the forward's ``caches``). In float16 or bfloat16 the parameters are
    read, and each activation and gradient kept, as the dtype stores them: rounded
    (``engine.precision``; ``round`` is the identity in float64 and float32)."""

    def __init__(self, P: dict, cfg: Config, caches: dict, masks: dict | None = None):
        policy = precision.of(cfg.dtype)
        self.round, self.kept = policy.round, policy.kept
        self.P = precision.stored(P, policy)
        self.cfg, self.caches, self.masks = cfg, caches, masks
        self.fast = caches["fast"]
        self.plan = caches.get("plan")   # the pass's interventions (engine.interventions)
        self.acts: OrderedDict[str, np.ndarray] = OrderedDict()
        self.grads: dict[str, np.ndarray] = {}
        self.dacts: dict[str, np.ndarray] = {}
        self.held = self.seen = None   # a streamed backward's: the parameter gradients it
        #                                holds, and who sees the others as they go (model.backward)
        self.progress = None   # the backward's progress(done, layers), after each block

    def keep(self, name: str, x: np.ndarray) -> np.ndarray:
        """Record activation ``name``; returns it, changed by the pass's interventions on it:
        what comes after reads the returned array."""
        x = self.kept(x)
        if self.plan:
            x = self.kept(self.plan.apply(name, x))
        self.acts[name] = x
        return x

    def keep_grad(self, name: str, dx: np.ndarray) -> np.ndarray:
        """Record the gradient of activation ``name``; returns the gradient of what made it
        (the same, unless an intervention changed the activation: ``through``)."""
        dx = self.dacts[name] = self.kept(dx)
        return self.kept(self.through(name, dx))

    def through(self, name: str, dx: np.ndarray) -> np.ndarray:
        """From the gradient of kept activation ``name`` to the gradient of what made it."""
        return self.plan.through(name, dx) if self.plan else dx


# ---------------------------------------------------------------- the kinds of block


def block(t: Tape, x: np.ndarray, i: int) -> np.ndarray:
    """Block i on x (B, T, d): its output, its input and output kept as ``blocks.{i}.in/out``."""
    p = f"blocks.{i}."
    x = t.keep(p + "in", x)
    return t.keep(p + "out", KINDS[kind(t.cfg)][0](t, x, i))


def block_backward(t: Tape, dz: np.ndarray, i: int) -> np.ndarray:
    """From block i's output gradient dz to its input's, every gradient in between kept."""
    p = f"blocks.{i}."
    dz = t.keep_grad(p + "out", dz)
    return t.keep_grad(p + "in", KINDS[kind(t.cfg)][1](t, dz, i))


def kind(cfg: Config) -> str:
    """Which of KINDS the Config's blocks are."""
    if cfg.norm == "post":
        return "post-ln"
    return "parallel" if cfg.parallel_residual else "pre-ln"


def pre_ln_block(t: Tape, x, i):
    """y = x + MHA(LN1(x)); z = y + FFN(LN2(y)). With ``sandwich_norm`` each sublayer's output
    is normed before it joins: y = x + LN1_post(MHA(LN1(x))), z = y + LN2_post(FFN(LN2(y)))."""
    p = f"blocks.{i}."
    y = t.keep(
        p + "resid1", x + sandwich(t, attention(t, norm(t, x, p + "ln1"), i), p + "ln1_post")
    )
    return t.keep(p + "resid2", y + sandwich(t, ffn(t, norm(t, y, p + "ln2"), p), p + "ln2_post"))


def pre_ln_block_backward(t: Tape, dz, i):
    """dy = dz + LN2'(FFN'(dz)); dx = dy + LN1'(MHA'(dy)) (and the sandwich norms' own ')."""
    p = f"blocks.{i}."
    dz = t.keep_grad(p + "resid2", dz)
    dffn = ffn_backward(t, sandwich_backward(t, dz, p + "ln2_post"), p)
    dy = t.keep_grad(p + "resid1", dz + norm_backward(t, dffn, p + "ln2"))
    dh = attention_backward(t, sandwich_backward(t, dy, p + "ln1_post"), i)
    return dy + norm_backward(t, dh, p + "ln1")


def parallel_block(t: Tape, x, i):
    """y = x + MHA(LN1(x)); z = y + FFN(LN2(x)): both sublayers read the block's input. With
    ``shared_norm`` one norm feeds both: z = x + MHA(LN1(x)) + FFN(LN1(x)), and there is no LN2."""
    p = f"blocks.{i}."
    h = norm(t, x, p + "ln1")
    y = t.keep(p + "resid1", x + attention(t, h, i))
    if not t.cfg.shared_norm:
        h = norm(t, x, p + "ln2")
    return t.keep(p + "resid2", y + ffn(t, h, p))


def parallel_block_backward(t: Tape, dz, i):
    """dx = dz + LN1'(MHA'(dz)) + LN2'(FFN'(dz)); shared: dx = dz + LN1'(MHA'(dz) + FFN'(dz))."""
    p = f"blocks.{i}."
    dz = t.keep_grad(p + "resid2", dz)
    dy = t.keep_grad(p + "resid1", dz)   # z = y + FFN(LN2(x)): y's gradient is z's
    dffn = ffn_backward(t, dz, p)
    if t.cfg.shared_norm:   # both sublayers read ln1's output: their gradients join there
        dh = attention_backward(t, dy, i)
        dh += dffn
        return dy + norm_backward(t, dh, p + "ln1")
    dffn = norm_backward(t, dffn, p + "ln2")
    return t.round(dy + norm_backward(t, attention_backward(t, dy, i), p + "ln1")) + dffn


def post_ln_block(t: Tape, x, i):
    """y = LN1(x + MHA(x)); z = LN2(y + FFN(y))."""
    p = f"blocks.{i}."
    y = norm(t, t.keep(p + "resid1", x + attention(t, x, i)), p + "ln1")
    return norm(t, t.keep(p + "resid2", y + ffn(t, y, p)), p + "ln2")


def post_ln_block_backward(t: Tape, dz, i):
    """dr2 = LN2'(dz); dy = dr2 + FFN'(dr2); dr1 = LN1'(dy); dx = dr1 + MHA'(dr1)."""
    p = f"blocks.{i}."
    dr = t.keep_grad(p + "resid2", norm_backward(t, dz, p + "ln2"))
    dy = dr + ffn_backward(t, dr, p)
    dr = t.keep_grad(p + "resid1", norm_backward(t, dy, p + "ln1"))
    return dr + attention_backward(t, dr, i)


KINDS = {   # kind -> (forward, backward)
    "pre-ln": (pre_ln_block, pre_ln_block_backward),
    "parallel": (parallel_block, parallel_block_backward),
    "post-ln": (post_ln_block, post_ln_block_backward),
}


# ---------------------------------------------------------------- norms


def norm(t: Tape, x, name):
    """Norm ``name`` ('blocks.0.ln1', ..., 'ln_f') on x: RMSNorm with ``rms_norm``, else layer
    norm (the fast path's on the fast path); its output kept as ``name.out``."""
    P, cfg = t.P, t.cfg
    if cfg.rms_norm:   # one implementation on both paths
        out, t.caches[name] = ops.rms_norm_forward(x, P[name + ".gamma"], cfg.eps)
    else:
        layer_norm = ops.layer_norm_forward_fast if t.fast else ops.layer_norm_forward
        out, t.caches[name] = layer_norm(x, P[name + ".gamma"], P.get(name + ".beta"), cfg.eps)
    return t.keep(name + ".out", out)


def norm_backward(t: Tape, dout, name):
    cfg = t.cfg
    dout = t.keep_grad(name + ".out", dout)
    if cfg.rms_norm:
        dx, t.grads[name + ".gamma"] = ops.rms_norm_backward(dout, t.caches[name])
    else:
        layer_norm = ops.layer_norm_backward_fast if t.fast else ops.layer_norm_backward
        dx, t.grads[name + ".gamma"], dbeta = layer_norm(dout, t.caches[name])
        if cfg.norm_biased:
            t.grads[name + ".beta"] = dbeta
    return dx


def sandwich(t: Tape, out, name):
    """A sublayer's output, normed by ``name`` with ``sandwich_norm``; else as it is."""
    return norm(t, out, name) if t.cfg.sandwich_norm else out


def sandwich_backward(t: Tape, dout, name):
    return norm_backward(t, dout, name) if t.cfg.sandwich_norm else dout


def normalise(x, P, name, cfg):
    """The output of norm ``name`` ('blocks.0.ln1', ..., 'ln_f') on x, by the reference
    functions, no cache kept: layer norm (without beta when ``cfg.norm_bias`` is false), or
    RMSNorm with ``cfg.rms_norm``."""
    if cfg.rms_norm:
        return ops.rms_norm_forward(x, P[name + ".gamma"], cfg.eps)[0]
    return ops.layer_norm_forward(x, P[name + ".gamma"], P.get(name + ".beta"), cfg.eps)[0]


# ---------------------------------------------------------------- attention


def attention(t: Tape, x, i):
    """Block i's multi-head attention on x (B, T, d): q, k, v (each head's q and k normed with
    ``qk_norm``, turned with RoPE), the scores and pattern over block i's mask, the context and
    its projection ``attn.out`` (B, T, d)."""
    P, cfg, H, p = t.P, t.cfg, t.cfg.heads, f"blocks.{i}."
    q, cq = ops.linear_forward(x, P[p + "attn.W_Q"], P.get(p + "attn.b_Q"))   # (B, T, d)
    k, ck = ops.linear_forward(x, P[p + "attn.W_K"], P.get(p + "attn.b_K"))
    v, cv = ops.linear_forward(x, P[p + "attn.W_V"], P.get(p + "attn.b_V"))
    q = t.keep(p + "attn.q", ops.split_heads(q, H))                     # (B, H, T, d_head)
    k = t.keep(p + "attn.k", ops.split_heads(k, cfg.h_kv))              # (B, H_kv, T, d_head)
    v = t.keep(p + "attn.v", ops.split_heads(v, cfg.h_kv))
    if cfg.qk_norm:   # each head's queries and keys normalised over their d_head entries
        q, k = norm(t, q, p + "attn.q_norm"), norm(t, k, p + "attn.k_norm")
    if cfg.pe == "rope":   # each query and key turned by its position's angles
        cos, sin = rope_for(cfg, q.shape[2], i)                           # (T, rope_width)
        q = t.keep(p + "attn.q_rot", ops.rope_forward(q, cos, sin))
        k = t.keep(p + "attn.k_rot", ops.rope_forward(k, cos, sin))
    if cfg.group > 1:   # grouped: each key and value head serves `group` query heads
        k, v = ops.repeat_kv(k, cfg.group), ops.repeat_kv(v, cfg.group)
    scale, T, mask = cfg.score_scale, q.shape[2], t.masks[i]   # 1 / sqrt(d_head) unless attn_scale
    if t.plan and {p + "attn.scores", p + "attn.pattern"} & t.plan.steps.keys():
        context, ca = attention_by_parts(t, q, k, v, i)
    elif t.fast:   # mask: an ops.AttentionMask; ALiBi's slopes and distances, or None
        context, scores, ca = ops.attention_forward_fast(q, k, v, mask, scale, cfg.attn_softcap,
                                                         alibi_for(cfg, T))
    else:   # ALiBi's (H, T, T) bias, or None
        bias = alibi_bias(T, H, cfg.dtype) if cfg.pe == "alibi" else None
        context, scores, ca = ops.attention_forward(q, k, v, mask[:, None], scale,
                                                    cfg.attn_softcap, bias)
    if not isinstance(ca, PartsCache):
        t.keep(p + "attn.scores", scores)
        t.keep(p + "attn.pattern", ca.pattern)
    context = t.keep(p + "attn.context", ops.merge_heads(context))        # (B, T, d)
    out, co = ops.linear_forward(context, P[p + "attn.W_O"], P.get(p + "attn.b_O"))
    t.caches[p + "attn"] = (cq, ck, cv, ca, co)
    return t.keep(p + "attn.out", out)


def attention_backward(t: Tape, dout, i):
    cfg, p = t.cfg, f"blocks.{i}."
    cq, ck, cv, ca, co = t.caches[p + "attn"]
    dout = t.keep_grad(p + "attn.out", dout)
    dcontext = t.keep_grad(p + "attn.context", linear_backward(t, dout, co, p + "attn.", "O"))
    if isinstance(ca, PartsCache):   # an intervention on the scores or the pattern
        dq, dk, dv = attention_by_parts_backward(t, ops.split_heads(dcontext, cfg.heads), ca, i)
    else:
        backward_of = ops.attention_backward_fast if t.fast else ops.attention_backward
        dq, dk, dv, dpattern, dscores = backward_of(ops.split_heads(dcontext, cfg.heads), ca)
        t.keep_grad(p + "attn.pattern", dpattern)
        t.keep_grad(p + "attn.scores", dscores)
    if cfg.group > 1:   # a shared head's gradient: the sum over the query heads it served
        dk, dv = ops.repeat_kv_backward(dk, cfg.group), ops.repeat_kv_backward(dv, cfg.group)
    if cfg.pe == "rope":   # back through the turn: the turn back by the same angles
        cos, sin = rope_for(cfg, dq.shape[2], i)
        dq = ops.rope_backward(t.keep_grad(p + "attn.q_rot", dq), cos, sin)
        dk = ops.rope_backward(t.keep_grad(p + "attn.k_rot", dk), cos, sin)
    if cfg.qk_norm:   # back through each head's norms
        dq = norm_backward(t, dq, p + "attn.q_norm")
        dk = norm_backward(t, dk, p + "attn.k_norm")
    # x feeds q, k and v: its gradient is the sum of the three
    dx_parts = [linear_backward(t, ops.merge_heads(t.keep_grad(p + f"attn.{name.lower()}", dh)),
                                cache, p + "attn.", name)
                for name, dh, cache in (("Q", dq, cq), ("K", dk, ck), ("V", dv, cv))]
    dx = t.round(dx_parts[0] + dx_parts[1])   # as autograd adds them: each sum stored
    dx += dx_parts[2]
    return dx


class PartsCache(NamedTuple):
    """What ``attention_by_parts`` keeps for its backward."""

    q: np.ndarray
    k: np.ndarray
    v: np.ndarray
    made: np.ndarray      # the softmax of the kept scores
    pattern: np.ndarray   # the pattern as kept (changed by an intervention)
    capped: np.ndarray | None   # the capped scores before any change, when capped


def attention_by_parts(t: Tape, q, k, v, i):
    """Attention written out one kept step at a time, when an intervention changes block i's
    scores or pattern: scores = q k^T * scale (+ ALiBi, then the cap, then the mask), kept;
    pattern = softmax(scores), kept; context = pattern v. The reference path's numbers."""
    cfg, p, rnd = t.cfg, f"blocks.{i}.", t.round
    T = q.shape[2]
    scores = rnd(rnd(q @ k.swapaxes(-1, -2)) * cfg.score_scale)         # (B, H, T, T)
    if cfg.pe == "alibi":
        scores = rnd(scores + alibi_bias(T, cfg.heads, cfg.dtype))
    capped = None
    if cfg.attn_softcap is not None:
        scores = capped = ops.softcap_forward(scores, cfg.attn_softcap)
    mask = combined_mask(t.plan.lengths, T, cfg.causal, cfg.window(i))
    scores = t.keep(p + "attn.scores", np.where(mask[:, None], scores, -np.inf))
    made, _ = ops.softmax_forward(scores)
    pattern = t.keep(p + "attn.pattern", made)
    return rnd(pattern @ v), PartsCache(q, k, v, made, pattern, capped)


def attention_by_parts_backward(t: Tape, dcontext, cache: PartsCache, i):
    """``attention_by_parts`` backward: each kept step's gradient recorded, and passed back
    through its intervention."""
    cfg, p, rnd = t.cfg, f"blocks.{i}.", t.round
    q, k, v, made, pattern, capped = cache
    dv = rnd(pattern.swapaxes(-1, -2) @ dcontext)
    dmade = t.keep_grad(p + "attn.pattern", dcontext @ v.swapaxes(-1, -2))
    draw = t.keep_grad(p + "attn.scores", ops.softmax_backward(dmade, made))
    if capped is not None:
        draw = rnd(draw * ops.softcap_slope(capped, cfg.attn_softcap))
    draw = np.where(np.isfinite(draw), draw, 0.0)
    return (rnd(rnd(draw @ k) * cfg.score_scale),
            rnd(rnd(draw.swapaxes(-1, -2) @ q) * cfg.score_scale), dv)


def linear_backward(t: Tape, dout, cache, layer, w):
    """dx of the linear layer ``layer`` (``"blocks.0.ffn."``) whose weight is ``W_{w}``; its
    weight's gradient, and its bias's when it has one (``Config.bias``), kept in ``t.grads``."""
    dx, t.grads[layer + f"W_{w}"], db = ops.linear_backward(dout, cache)
    if db is not None:
        t.grads[layer + f"b_{w}"] = db
    return dx


# ---------------------------------------------------------------- feed-forward


def ffn(t: Tape, x, p):
    """The FFN of block ``p`` ('blocks.0.') on x: act(x W_1 + b_1) W_2 + b_2, or gated,
    (f(x W_gate + b_gate) * (x W_1 + b_1)) W_2 + b_2 with f silu (SwiGLU) or GELU (GeGLU)."""
    P, cfg, cgate = t.P, t.cfg, None
    if cfg.gated:   # act = silu(x W_gate + b_gate) * pre, or gelu(...) * pre
        gate, cgate = ops.linear_forward(x, P[p + "ffn.W_gate"], P.get(p + "ffn.b_gate"))
        gate = t.keep(p + "ffn.gate", gate)
    pre, c1 = ops.linear_forward(x, P[p + "ffn.W_1"], P.get(p + "ffn.b_1"))  # (B, T, d_ff)
    pre = t.keep(p + "ffn.pre", pre)
    if cgate is None:
        activation = ops.ACTIVATIONS[cfg.activation][0]
        if t.fast:
            activation = ops.FAST_FORWARDS.get(cfg.activation, activation)
        hidden, cact = activation(pre)
    else:
        hidden, cact = ops.GATES[cfg.activation][0](gate, pre)
    hidden = t.keep(p + "ffn.act", hidden)
    out, c2 = ops.linear_forward(hidden, P[p + "ffn.W_2"], P.get(p + "ffn.b_2"))  # (B, T, d)
    t.caches[p + "ffn"] = (cgate, c1, cact, c2)
    return t.keep(p + "ffn.out", out)


def ffn_backward(t: Tape, dout, p):
    cgate, c1, cact, c2 = t.caches[p + "ffn"]
    dout = t.keep_grad(p + "ffn.out", dout)
    dhidden = t.keep_grad(p + "ffn.act", linear_backward(t, dout, c2, p + "ffn.", "2"))
    if cgate is None:
        dpre = ops.ACTIVATIONS[t.cfg.activation][1](dhidden, cact)
    else:
        dgate, dpre = ops.GATES[t.cfg.activation][1](dhidden, cact)
    dx = linear_backward(t, t.keep_grad(p + "ffn.pre", dpre), c1, p + "ffn.", "1")
    if cgate is not None:   # x feeds the gate too: its gradient is the sum of the two
        dx += linear_backward(t, t.keep_grad(p + "ffn.gate", dgate), cgate, p + "ffn.", "gate")
    return dx


# ---------------------------------------------------------------- positions inside attention


def rope_for(cfg: Config, T: int, block: int = 0):
    """RoPE's (cos, sin) tables, (T, ``Config.rope_width``), for T positions at block
    ``block``'s base and scaling (``Config.rope``), or None when the model does not turn its
    queries and keys. Narrower than a head (``rotary_dim``), they turn its first dimensions."""
    if cfg.pe != "rope":
        return None
    return rope_tables(T, cfg.rope_width, cfg.dtype, *cfg.rope(block))


@functools.lru_cache(maxsize=8)
def rope_tables(T: int, d_head: int, dtype: str, base: float = 10000.0, scaling=None):
    """RoPE's (cos, sin), each (T, d_head) (``positional.rope_tables``), made once per size,
    base and scaling for every forward and backward after it (read-only: shared); in float16
    or bfloat16 rounded to it, as Hugging Face casts its tables to the queries' dtype."""
    policy = precision.of(dtype)
    tables = tuple(map(policy.round, positional.rope_tables(T, d_head, policy.array, base,
                                                            scaling)))
    for table in tables:
        table.flags.writeable = False
    return tables


def alibi_for(cfg: Config, T: int):
    """ALiBi's slopes (H,) and distances (T, T) in the model's dtype (an ``ops.Alibi``): head
    h adds ``-slopes[h] * distances`` to its scaled scores. None when the model does not add
    ALiBi (``pe`` other than "alibi")."""
    if cfg.pe != "alibi":
        return None
    return _alibi(T, cfg.heads, cfg.dtype)


def alibi_bias(T: int, heads: int, dtype: str):
    """ALiBi's (H, T, T) bias in the model's dtype (``positional.alibi_bias``), rounded to it
    in float16 or bfloat16: the reference path's."""
    policy = precision.of(dtype)
    return policy.round(positional.alibi_bias(T, heads, policy.array))


@functools.lru_cache(maxsize=8)
def _alibi(T: int, heads: int, dtype: str):
    """Made once per size for every forward after it (read-only: shared)."""
    array = precision.of(dtype).array
    alibi = ops.Alibi(positional.alibi_slopes(heads).astype(array),
                      positional.alibi_distances(T, array))
    for table in alibi:
        table.flags.writeable = False
    return alibi
