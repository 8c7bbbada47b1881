"""Primitives as forward/backward pairs.

Each ``*_forward`` returns ``(out, cache)``; the cache is a NamedTuple holding exactly what the
matching ``*_backward`` needs. No argument is ever modified in place (but an ``out=`` given
for that), and no array is changed once returned. Weights multiply on the right: ``x @ W``
with ``W`` of shape ``(d_in, d_out)``.

Each function marked ``@op`` is one operation as PyTorch runs one: in a float16 or bfloat16
pass its results are rounded to the dtype (``engine.precision``); the few that are several of
torch's operations round between their steps (``rounding()``).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np

from tfmcli.engine import erf_series, parallel
from tfmcli.engine.precision import op, rounding

# ---------------------------------------------------------------- embedding


class EmbeddingCache(NamedTuple):
    tokens: np.ndarray  # (B, T) int
    vocab: int


def embedding_forward(tokens, W_E):
    """tokens: (B, T) ints in [0, V); W_E: (V, d) -> (B, T, d)."""
    return W_E[tokens], EmbeddingCache(tokens, W_E.shape[0])


@op
def embedding_backward(dout, cache, out=None):
    """dout: (B, T, d) -> dW_E: (V, d); rows of repeated tokens accumulate. Given ``out``
    ((V, d): a tied head's gradient), the rows are added to it in place and it is returned."""
    dW_E = np.zeros((cache.vocab, dout.shape[-1]), dtype=dout.dtype) if out is None else out
    np.add.at(dW_E, cache.tokens.reshape(-1), dout.reshape(-1, dout.shape[-1]))
    return dW_E


# ---------------------------------------------------------------- linear


class LinearCache(NamedTuple):
    x: np.ndarray      # (..., d_in)
    W: np.ndarray      # (d_in, d_out)
    bias: bool = True  # the layer adds a bias (its backward makes db)


@op(results=1)
def linear_forward(x, W, b):
    """x: (..., d_in) @ W: (d_in, d_out) + b: (d_out,) -> (..., d_out); ``b`` None for a layer
    without a bias (``Config.bias``).

    The rows go to BLAS as one (rows, d_in) matrix, not one matrix per leading index (faster,
    and the same numbers), in parts on the machine's cores (``parallel.matmul``), and b is
    added in place.
    """
    d_in, d_out = W.shape
    x2d = x.reshape(-1, d_in)                                  # (rows, d_in)
    out = np.empty((x2d.shape[0], d_out), dtype=np.result_type(x2d, W))
    parallel.matmul(x2d, W, out, add=b)
    return out.reshape(*x.shape[:-1], d_out), LinearCache(x, W, b is not None)


@op
def linear_backward(dout, cache, transposed=False):
    """dout: (..., d_out) -> dx (..., d_in), dW (d_in, d_out), db (d_out,) or None when the
    layer has no bias.

    ``transposed``: dW comes as (d_out, d_in), made so rather than transposed after (a tied
    head's W is the view W_E.T, and its gradient joins W_E's). On two cores dW is made on the
    other core (``parallel.later``) while dx and db are made here: within the model's backward
    (a ``parallel.deferred`` scope) dW is waited for at the backward's end, not here.
    """
    x, W, bias = cache
    d_in, d_out = W.shape
    x2d, dout2d = x.reshape(-1, d_in), dout.reshape(-1, d_out)   # (rows, d_in), (rows, d_out)
    dtype = np.result_type(dout2d, W)
    dx = np.empty((x2d.shape[0], d_in), dtype=dtype)
    dW = np.empty((d_out, d_in) if transposed else (d_in, d_out), dtype=dtype)
    db = np.empty(d_out, dtype=dout2d.dtype) if bias else None
    work = parallel.cost(dout2d.size * d_in, dtype)            # each product's multiply-adds

    def weight_gradient():
        if transposed:
            parallel.matmul(dout2d.T, x2d, dW)
        else:
            parallel.matmul(x2d.T, dout2d, dW)

    with parallel.deferred():
        if not parallel.thin(x2d.shape, W.shape) and parallel.later(weight_gradient, work):
            parallel.matmul(dout2d, W.T, dx, busy=1)   # on two cores: dx whole, dW on the other
        else:   # thin (BLAS's own threads run those faster), small, or one core: in turn
            parallel.matmul(dout2d, W.T, dx)
            weight_gradient()
        if bias:
            parallel.run(lambda c: np.add.reduce(dout2d[:, c], axis=0, out=db[c]), d_out,
                         parallel.cost(dout2d.size * parallel.PASS, db.dtype))
    return dx.reshape(x.shape), dW, db


# ---------------------------------------------------------------- layer norm


class LayerNormCache(NamedTuple):
    xhat: np.ndarray   # (..., C) normalised input
    rstd: np.ndarray   # (..., 1) 1 / sqrt(var + eps)
    gamma: np.ndarray  # (C,)


@op(results=1)
def layer_norm_forward(x, gamma, beta, eps):
    """(x - mean) / sqrt(var + eps) * gamma + beta over the last axis, biased variance; a norm
    with no beta (``None``, MPT's) stops at the product."""
    mean = x.mean(axis=-1, keepdims=True)                      # (..., 1)
    xc = x - mean
    var = (xc * xc).mean(axis=-1, keepdims=True)               # (..., 1)
    rstd = 1.0 / np.sqrt(var + eps)
    xhat = xc * rstd
    out = xhat * gamma if beta is None else xhat * gamma + beta
    return out, LayerNormCache(xhat, rstd, gamma)


@op
def layer_norm_backward(dout, cache):
    """dout: (..., C) -> dx (..., C), dgamma (C,), dbeta (C,).

    dx = rstd * (dxhat - mean(dxhat) - xhat * mean(dxhat * xhat)), with dxhat = dout * gamma.
    The rstd here is 1 / sqrt(var + eps) of the *input*; seed 003 used the output's std and
    squared it, which is why its dg disagrees with finite differences.
    """
    xhat, rstd, gamma = cache
    C = xhat.shape[-1]
    dgamma = (dout * xhat).reshape(-1, C).sum(axis=0)
    dbeta = dout.reshape(-1, C).sum(axis=0)
    dxhat = dout * gamma
    dx = rstd * (dxhat - dxhat.mean(axis=-1, keepdims=True)
                 - xhat * (dxhat * xhat).mean(axis=-1, keepdims=True))
    return dx, dgamma, dbeta


@op(results=1)
def rms_norm_forward(x, gamma, eps):
    """RMSNorm (LLaMA's): x / sqrt(mean(x^2) + eps) * gamma over the last axis; no mean taken
    out, no beta. Its cache is layer norm's, xhat = x * rstd."""
    rstd = 1.0 / np.sqrt((x * x).mean(axis=-1, keepdims=True) + eps)   # (..., 1)
    xhat = x * rstd
    return xhat * gamma, LayerNormCache(xhat, rstd, gamma)


@op
def rms_norm_backward(dout, cache):
    """dout: (..., C) -> dx (..., C), dgamma (C,).

    dx = rstd * (dxhat - xhat * mean(dxhat * xhat)), dxhat = dout * gamma: layer norm's with
    no mean(dxhat) term, since no mean was taken out."""
    xhat, rstd, gamma = cache
    C = xhat.shape[-1]
    dgamma = (dout * xhat).reshape(-1, C).sum(axis=0)
    dxhat = dout * gamma
    dx = rstd * (dxhat - xhat * (dxhat * xhat).mean(axis=-1, keepdims=True))
    return dx, dgamma


# ---------------------------------------------------------------- activations


@op(results=1)
def relu_forward(x):
    return np.maximum(x, 0), x


@op
def relu_backward(dout, x):
    """The derivative at exactly 0 is taken as 0, as PyTorch does."""
    return dout * (x > 0)


_GELU_C = math.sqrt(2.0 / math.pi)


@op(results=1)
def gelu_forward(x):
    """Tanh approximation: 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))).

    x^3 as x * x * x, as PyTorch makes it: NumPy's ``x**3`` calls pow for every entry, about 100
    times slower (6.4 against 0.06 ms on GPT-2's (32, 3072) in float64), and differs by 1 ulp at
    most."""
    t = np.tanh(_GELU_C * (x + 0.044715 * (x * x * x)))
    return 0.5 * x * (1.0 + t), (x, t)


@op
def gelu_backward(dout, cache):
    x, t = cache
    dt = _GELU_C * (1.0 + 3 * 0.044715 * x * x)
    return dout * (0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * dt)


_ERF = np.frompyfunc(math.erf, 1, 1)   # NumPy has no erf: the C library's, entry by entry
ERF_CHUNK = 1 << 16   # entries a call: its transient array of Python floats stays small


def erf(x):
    """erf of every entry, in x's dtype: Python's ``math.erf`` (the C library's, within an ulp
    or two), since NumPy has none. About 0.1 us an entry, fifty times tanh's, so it goes
    ``ERF_CHUNK`` entries at a time, each a transient object array of that many floats."""
    out = np.empty_like(x)
    flat, into = x.reshape(-1), out.reshape(-1)
    for start in range(0, flat.size, ERF_CHUNK):
        into[start:start + ERF_CHUNK] = _ERF(flat[start:start + ERF_CHUNK])
    return out


_SQRT_HALF, _INV_SQRT_2PI = math.sqrt(0.5), 1.0 / math.sqrt(2.0 * math.pi)


@op(results=1)
def gelu_erf_forward(x):
    """GELU itself, not its tanh form: x Phi(x) = 0.5 x (1 + erf(x / sqrt 2)), Phi the normal
    distribution's CDF (torch's ``F.gelu``; Hugging Face's and Pythia's ``"gelu"``). Caches
    (x, Phi(x))."""
    return _gelu_erf(x, erf)


@op(results=1)
def gelu_erf_forward_fast(x):
    """The same on the fast path, its erf ``erf_series.erf`` (whole arrays, a third of
    ``math.erf``'s time, within 2 ulp of it)."""
    return _gelu_erf(x, erf_series.erf)


def _gelu_erf(x, erf_of):
    cdf = erf_of(x * _SQRT_HALF)
    cdf += 1.0
    cdf *= 0.5
    return x * cdf, (x, cdf)


@op
def gelu_erf_backward(dout, cache):
    """d x Phi(x) / dx = Phi(x) + x phi(x), phi(x) = exp(-x^2 / 2) / sqrt(2 pi) the density."""
    x, cdf = cache
    return dout * (cdf + x * np.exp(-0.5 * x * x) * _INV_SQRT_2PI)


ACTIVATIONS = {"relu": (relu_forward, relu_backward), "gelu": (gelu_forward, gelu_backward),
               "gelu_erf": (gelu_erf_forward, gelu_erf_backward)}
FAST_FORWARDS = {"gelu_erf": gelu_erf_forward_fast}   # the fast path's, where it has its own


def sigmoid(x):
    """1 / (1 + exp(-x)), as PyTorch makes it. Below x = -709 exp(-x) is inf and the result
    exactly 0, as it should be. (The form 0.5 (1 + tanh(x / 2)) needs no exp, but loses the
    digits of a small result: 1.7e-4 relative at x = -30.)"""
    with np.errstate(over="ignore"):
        s = np.exp(-x)
    s += 1.0
    return np.divide(1.0, s, out=s)


@op(results=1)
def swiglu_forward(gate, pre):
    """SwiGLU's hidden units: silu(gate) * pre, silu(g) = g sigmoid(g) (PaLM's and LLaMA's
    FFN; ``gate = x W_gate + b_gate`` and ``pre = x W_1 + b_1``, both (..., d_ff))."""
    sig = sigmoid(gate)
    hidden = rounding()(gate * sig)   # silu(gate), then the product: two operations in torch
    hidden *= pre
    return hidden, (gate, pre, sig)


@op
def swiglu_backward(dhidden, cache):
    """dhidden: (..., d_ff) -> (dgate, dpre).

    dpre = dhidden silu(gate); dgate = dhidden pre silu'(gate), where
    silu'(g) = sigmoid(g) (1 + g (1 - sigmoid(g))): the product rule on g sigmoid(g), with
    sigmoid' = sigmoid (1 - sigmoid)."""
    gate, pre, sig = cache
    dpre = dhidden * gate
    dpre *= sig
    slope = 1.0 - sig
    slope *= gate
    slope += 1.0
    slope *= sig
    dgate = dhidden * pre
    dgate *= slope
    return dgate, dpre


@op(results=1)
def geglu_forward(gate, pre):
    """GeGLU's hidden units: gelu(gate) * pre, GELU in its tanh form (Gemma's FFN, where
    Hugging Face calls it ``gelu_pytorch_tanh``); ``gate`` and ``pre`` as SwiGLU's."""
    hidden, (_, t) = gelu_forward(gate)
    hidden *= pre
    return hidden, (gate, pre, t)


@op
def geglu_backward(dhidden, cache):
    """dhidden: (..., d_ff) -> (dgate, dpre).

    dpre = dhidden gelu(gate); dgate = dhidden pre gelu'(gate), where with
    t = tanh(sqrt(2/pi) (g + 0.044715 g^3)) gelu(g) = 0.5 g (1 + t) and
    gelu'(g) = 0.5 (1 + t + g (1 - t^2) sqrt(2/pi) (1 + 3 x 0.044715 g^2)): the product rule
    on 0.5 g (1 + t), with tanh' = 1 - tanh^2. Two (..., d_ff) arrays besides the results."""
    gate, pre, t = cache
    dpre = 1.0 + t
    dpre *= gate
    dpre *= 0.5
    dpre *= dhidden
    inner = gate * gate                 # d/dg of sqrt(2/pi) (g + 0.044715 g^3)
    inner *= 3 * 0.044715
    inner += 1.0
    inner *= _GELU_C
    slope = t * t
    np.subtract(1.0, slope, out=slope)
    slope *= gate
    slope *= inner
    del inner
    slope += t
    slope += 1.0
    slope *= 0.5
    dgate = dhidden * pre
    dgate *= slope
    return dgate, dpre


@op(results=1)
def geglu_erf_forward(gate, pre):
    """The gate through GELU itself: gelu_erf(gate) * pre = gate Phi(gate) * pre (a LLaMA-family
    ``hidden_act`` "gelu": Hugging Face's ACT2FN["gelu"] is torch's exact F.gelu)."""
    hidden, (_, cdf) = gelu_erf_forward(gate)
    hidden *= pre
    return hidden, (gate, pre, cdf)


@op
def geglu_erf_backward(dhidden, cache):
    """dhidden: (..., d_ff) -> (dgate, dpre): dpre = dhidden gate Phi(gate), dgate = dhidden pre
    (Phi(gate) + gate phi(gate)), phi the normal density (``gelu_erf_backward``'s slope)."""
    gate, pre, cdf = cache
    dpre = gate * cdf
    dpre *= dhidden
    dgate = gelu_erf_backward(dhidden * pre, (gate, cdf))
    return dgate, dpre


GATES = {"swiglu": (swiglu_forward, swiglu_backward), "geglu": (geglu_forward, geglu_backward),
         "geglu_erf": (geglu_erf_forward, geglu_erf_backward)}


# ---------------------------------------------------------------- softmax


@op(results=1)
def softmax_forward(x):
    """Softmax over the last axis with each row's own max subtracted (seed 000): -inf -> 0."""
    p = np.exp(x - x.max(axis=-1, keepdims=True))
    p /= p.sum(axis=-1, keepdims=True)  # in place on our own array: one (B, H, T, T) less
    return p, p


@op
def softmax_backward(dout, p):
    """dx = p * (dout - sum(dout * p)); zero wherever p is zero (masked entries)."""
    dx = dout - (dout * p).sum(axis=-1, keepdims=True)
    dx *= p
    return dx


# ---------------------------------------------------------------- heads and attention


def split_heads(x, H):
    """(B, T, d) -> (B, H, T, d_head)."""
    B, T, d = x.shape
    return x.reshape(B, T, H, d // H).swapaxes(1, 2)          # (B, H, T, d_head)


def merge_heads(x):
    """(B, H, T, d_head) -> (B, T, d)."""
    B, H, T, dh = x.shape
    return x.swapaxes(1, 2).reshape(B, T, H * dh)             # (B, T, d)


def repeat_kv(x, group):
    """(B, H_kv, T, d_head) -> (B, H_kv * group, T, d_head): each key (or value) head once for
    each of the ``group`` query heads it serves, in turn (Hugging Face's ``repeat_kv``)."""
    return np.repeat(x, group, axis=1)


@op
def repeat_kv_backward(dout, group):
    """(B, H_kv * group, T, d_head) -> (B, H_kv, T, d_head): a head that served ``group`` query
    heads gets the sum of their gradients."""
    B, H, T, dh = dout.shape
    return dout.reshape(B, H // group, group, T, dh).sum(axis=2)


def rotate_half(x):
    """(..., d_head): RoPE's quarter turn of each pair (i, i + d_head // 2), ``(a, b) -> (-b,
    a)``; an odd d_head's last dimension, which RoPE leaves unrotated, gives 0."""
    m = x.shape[-1] // 2
    out = np.zeros_like(x)
    # times -1 rather than np.negative(..., out=): NumPy 2.4.6's negative writes wrong values
    # into a strided float64 out of width 1 whose strides differ from its input's (a turned
    # pair, m = 1, of a slice with gaps: rotary_dim 2)
    np.multiply(x[..., m:2 * m], -1.0, out=out[..., :m])
    out[..., m:2 * m] = x[..., :m]
    return out


@op
def rope_forward(x, cos, sin):
    """RoPE: every pair (i, i + d_head // 2) of x (B, H, T, d_head) turned by its angle at its
    position, ``x cos + rotate_half(x) sin`` (cos, sin: (T, d_head), ``positional.rope_tables``).
    Tables n < d_head wide turn the first n dimensions, pairs (i, i + n / 2), and pass the
    rest (a partial rotation, ``Config.rotary_dim``). Returns the rotated array; the backward
    needs only the tables."""
    n = cos.shape[-1]
    if n < x.shape[-1]:
        out = x.copy()
        out[..., :n] = rope_forward(x[..., :n], cos, sin)
        return out
    rnd = rounding()   # torch's three operations: two products, their sum
    out = rnd(x * cos)
    out += rnd(rotate_half(x) * sin)
    return out


@op
def rope_backward(dout, cos, sin):
    """The rotation's transpose, which is its inverse (a turn back by the same angle):
    ``dout cos - rotate_half(dout) sin``. (A pair's sines are equal, so rotate_half(dout) sin
    is rotate_half(dout sin).) Narrow tables: the dimensions past them pass unturned."""
    n = cos.shape[-1]
    if n < dout.shape[-1]:
        dx = dout.copy()
        dx[..., :n] = rope_backward(dout[..., :n], cos, sin)
        return dx
    rnd = rounding()
    dx = rnd(dout * cos)
    dx -= rnd(rotate_half(dout) * sin)
    return dx


@op
def softcap_forward(x, cap):
    """``cap * tanh(x / cap)``: x squashed smoothly into (-cap, cap), close to x where
    ``|x|`` is small against cap (Gemma 2's soft caps of its scores and logits)."""
    rnd = rounding()   # torch's three operations: divide, tanh, multiply
    return rnd(np.tanh(rnd(x / cap))) * cap


def softcap_slope(capped, cap):
    """d capped / d x from the capped values themselves: ``1 - tanh^2 = 1 - (capped / cap)^2``;
    0 where ``capped`` is -inf (a hidden key's score, after the mask)."""
    slope = capped / cap                                       # tanh, then its slope in place
    np.multiply(slope, slope, out=slope)
    np.subtract(1.0, slope, out=slope)
    slope[np.isneginf(capped)] = 0.0
    return slope


class AttentionCache(NamedTuple):
    q: np.ndarray        # (B, H, T, d_head)
    k: np.ndarray
    v: np.ndarray
    pattern: np.ndarray  # (B, H, T, T)
    scale: float
    blocks: tuple = ()   # the fast path's query blocks (see key_blocks); the reference: none
    starts: tuple = ()   # per block, the first key it may see (key_starts); the reference: none
    cap: float | None = None   # the scores' soft cap (Config.attn_softcap), or None
    scores: np.ndarray | None = None   # (B, H, T, T) the capped, masked scores, when capped


def attention_forward(q, k, v, mask, scale, cap=None, bias=None):
    """softmax(q k^T * scale, hidden where mask is False) @ v; with ``bias`` (ALiBi's, (H, T,
    T)) added to the scaled scores; with ``cap``, each score then soft-capped
    (``softcap_forward``) before the mask.

    q, k, v: (B, H, T, d_head); mask: bool, broadcastable to (B, H, T, T), True = may attend.
    Returns context (B, H, T, d_head), the masked scores (-inf where hidden), and the cache.
    The bias is a constant: the backward passes through it unchanged.
    """
    rnd = rounding()   # each step one operation of torch's, its result rounded
    scores = rnd(q @ k.swapaxes(-1, -2))                      # (B, H, T, T)
    scores *= scale
    scores = rnd(scores)
    if bias is not None:
        scores += bias
        scores = rnd(scores)
    if cap is not None:
        scores = softcap_forward(scores, cap)
    scores = np.where(mask, scores, -np.inf)
    pattern, _ = softmax_forward(scores)
    context = rnd(pattern @ v)                                 # (B, H, T, d_head)
    capped = scores if cap is not None else None
    return context, scores, AttentionCache(q, k, v, pattern, scale, cap=cap, scores=capped)


def attention_backward(dcontext, cache):
    """dcontext: (B, H, T, d_head) -> dq, dk, dv, and dpattern, dscores (B, H, T, T).
    dscores is the gradient of the scores the softmax took (capped, when capped)."""
    q, k, v, pattern, scale = cache[:5]
    rnd = rounding()
    dpattern = rnd(dcontext @ v.swapaxes(-1, -2))             # (B, H, T, T)
    dv = rnd(pattern.swapaxes(-1, -2) @ dcontext)             # (B, H, T, d_head)
    dscores = softmax_backward(dpattern, pattern)             # 0 on hidden keys
    draw = dscores                                            # before the cap, if any
    if cache.cap is not None:
        draw = rnd(dscores * softcap_slope(cache.scores, cache.cap))
    dq = rnd(rnd(draw @ k) * scale)
    dk = rnd(rnd(draw.swapaxes(-1, -2) @ q) * scale)
    return dq, dk, dv, dpattern, dscores


# The fast path: the same attention with fewer passes over the (B, H, T, T) arrays, fewer fresh
# ones, and no work on keys a whole block of queries cannot see (the causal upper triangle, keys
# past every row's length, keys before a sliding window). Equal to the functions above to
# rounding (tests/test_fast.py holds it to 1e-12 relative); those stay the reference a reader
# checks the formulas against.

QUERY_BLOCK = 128   # query rows per block: big enough for BLAS, small enough to skip ~40% at T 512
CACHE_BYTES = 1 << 20   # a block of scores this size stays in a core's cache (L2) over its passes


def _sequences(B, heads, T, itemsize):
    """Slices of the batch whose block of scores (``heads`` heads, a query block's rows, T keys)
    fits in CACHE_BYTES: one sequence at a time at T 512, the whole batch when sequences are
    short (then each slice costs its own dozen NumPy calls: ``tfm train`` took 1.3x as long
    one sequence at a time)."""
    per = max(1, CACHE_BYTES // (heads * min(QUERY_BLOCK, T) * T * itemsize))
    return [slice(b, b + per) for b in range(0, B, per)]


class Alibi(NamedTuple):
    """ALiBi's bias as the fast path takes it: head h adds ``-slopes[h] * distances`` to its
    scaled scores, a block at a time (no (H, T, T) array)."""
    slopes: np.ndarray     # (H,): positional.alibi_slopes
    distances: np.ndarray  # (T, T): i - j, positional.alibi_distances


class AttentionMask(NamedTuple):
    """The mask as the fast path takes it."""
    bias: np.ndarray  # (B, 1, T, T): 0 where a query may attend, -inf where the key is hidden
    blocks: tuple     # ((first row, end row, key end), ...): see key_blocks
    hidden_from: tuple   # per block, the first key it hides from some query: see hidden_from
    starts: tuple        # per block, the first key any of its queries may see: see key_starts


def additive_mask(mask, dtype):
    """The bool mask (True = may attend) as the 0 / -inf added to the scores."""
    bias = np.zeros(mask.shape, dtype=dtype)
    bias[~mask] = -np.inf
    return bias


def key_blocks(mask, block):
    """Split the queries of ``mask`` (bool, (B, T, T)) into blocks of ``block`` rows, each with
    the number of leading keys any of its queries may see in any batch row: every key past it is
    hidden from the whole block, so its score is -inf, its weight 0, and no product need touch it.
    """
    seen = mask.any(axis=0)                                   # (T, T): visible in some row
    T = seen.shape[-1]
    ends = np.where(seen.any(axis=-1), T - seen[:, ::-1].argmax(axis=-1), 0)  # per query
    return tuple((r, min(r + block, T), int(ends[r:r + block].max()))
                 for r in range(0, T, block))


def key_starts(mask, blocks):
    """Per block of ``key_blocks``, the first key any of its queries may see in any batch row:
    a sliding window hides every key before it from the whole block, so no product need touch
    those either (0 without a window, where key 0 is always seen)."""
    seen = mask.any(axis=0)                                   # (T, T): visible in some row
    starts = []
    for r0, r1, end in blocks:
        columns = np.flatnonzero(seen[r0:r1, :end].any(axis=0))
        starts.append(int(columns[0]) if columns.size else 0)
    return tuple(starts)


def hidden_from(mask, blocks):
    """Per block of ``key_blocks``, the first of its keys (up to its end) hidden from some query
    of the block in some batch row: the mask adds 0 to every score before it, so only the keys
    from there on need the add (causal: the block's diagonal square)."""
    hides = ~mask.all(axis=0)                                 # (T, T): hidden in some row
    firsts = []
    for r0, r1, end in blocks:
        columns = np.flatnonzero(hides[r0:r1, :end].any(axis=0))
        firsts.append(int(columns[0]) if columns.size else end)
    return tuple(firsts)


def row_dot(a, b):
    """sum(a * b, axis=-1, keepdims=True) in one pass with no product array (einsum). einsum
    does not report overflow to np.errstate, so a result that is not finite is made again the
    plain way, which does (and gives the same inf or nan)."""
    out = np.einsum("...i,...i->...", a, b)[..., None]
    if not np.isfinite(out).all():
        out = (a * b).sum(axis=-1, keepdims=True)
    return out


def attention_forward_fast(q, k, v, mask, scale, cap=None, alibi=None):
    """attention_forward block by block over the queries (``mask``: an AttentionMask;
    ``alibi``: an Alibi, added a block at a time, or None), each block only over the keys it
    may see; the scale folded into q, the mask added only where it hides something, the
    softmax computed in place. Two (B, H, T, T) arrays (the masked scores
    and the pattern) instead of five, each written once. The heads go in parts on the
    machine's cores (``parallel``), and each part takes as many sequences at a time as keep a
    block in cache over its passes (``_sequences``), its passes over the blocks' rows without
    NumPy's buffer (``parallel.unbuffered``)."""
    B, H, T, dh = q.shape
    scores = np.empty((B, H, T, T), dtype=q.dtype)
    pattern = np.empty((B, H, T, T), dtype=q.dtype)
    context = np.empty_like(q)                                # (B, H, T, d_head)
    q_scaled = q * scale
    starts = mask.starts

    @parallel.unbuffered(T * q.itemsize)   # rows of the scores
    def part(h):                                              # h: a slice of the heads
        for b in _sequences(B, len(range(H)[h]), T, q.itemsize):   # blocks that stay in cache
            for (r0, r1, end), first, start in zip(mask.blocks, mask.hidden_from, starts):
                s = scores[b, h, r0:r1, start:end]            # this block's visible part
                np.matmul(q_scaled[b, h, r0:r1], k[b, h, start:end].swapaxes(-1, -2), out=s)
                if alibi is not None:   # - m_h (i - j), head by head
                    s -= alibi.slopes[h, None, None] * alibi.distances[r0:r1, start:end]
                if cap is not None:   # cap * tanh(s / cap), in place
                    s /= cap
                    np.tanh(s, out=s)
                    s *= cap
                first = max(first, start)
                s[..., first - start:] += mask.bias[b, :, r0:r1, first:end]   # -inf where hidden
                scores[b, h, r0:r1, end:] = -np.inf
                pattern[b, h, r0:r1, end:] = 0.0
                if start:   # a sliding window: the keys before it too
                    scores[b, h, r0:r1, :start] = -np.inf
                    pattern[b, h, r0:r1, :start] = 0.0
                p = pattern[b, h, r0:r1, start:end]
                np.subtract(s, s.max(axis=-1, keepdims=True), out=p)
                np.exp(p, out=p)
                p /= p.sum(axis=-1, keepdims=True)
                np.matmul(p, v[b, h, start:end], out=context[b, h, r0:r1])

    parallel.run(part, H, parallel.cost(B * H * T * T * dh, q.dtype))
    return context, scores, AttentionCache(q, k, v, pattern, scale, mask.blocks, starts, cap,
                                           scores if cap is not None else None)


def attention_backward_fast(dcontext, cache):
    """attention_backward over the same blocks, the softmax backward in place, each row's
    sum(dpattern * pattern) as a row dot product (no product array), and the scale folded
    into k and q. dv and dk go by blocks of keys, each from the queries that may see it, so
    each is written once rather than summed over query blocks. dpattern is computed whole: it
    is not 0 where the weight is. The heads go in parts on the machine's cores
    (``parallel``), a few sequences at a time (``_sequences``), unbuffered as in the forward."""
    q, k, v, pattern, scale, blocks, starts, cap, capped = cache
    B, H, T, dh = q.shape
    dpattern, dscores = np.empty_like(pattern), np.empty_like(pattern)   # (B, H, T, T)
    # capped: the gradient before the cap, which dq and dk take, is an array of its own
    draw = dscores if cap is None else np.empty_like(pattern)
    zeroed = (dscores,) if cap is None else (dscores, draw)   # 0 at the keys a block cannot see
    dq, dk, dv = np.empty_like(q), np.empty_like(k), np.empty_like(v)
    k_scaled, q_scaled = k * scale, q * scale
    # keys c0..c1 are seen by the query blocks from the first whose keys reach them to the last
    # whose window starts before them; the rows outside give them weight 0
    seen_by = [slice(next((r0 for r0, _, end in blocks if end > c0), T),
                     max((r1 for (_, r1, end), start in zip(blocks, starts)
                          if end > c0 and start < c1), default=0))
               for c0, c1, _ in blocks]

    @parallel.unbuffered(T * q.itemsize)   # rows of the scores
    def part(h):                                              # h: a slice of the heads
        for b in _sequences(B, len(range(H)[h]), T, q.itemsize):   # blocks that stay in cache
            np.matmul(dcontext[b, h], v[b, h].swapaxes(-1, -2), out=dpattern[b, h])
            for (r0, r1, end), start in zip(blocks, starts):
                p, dp = pattern[b, h, r0:r1, start:end], dpattern[b, h, r0:r1, start:end]
                ds = dscores[b, h, r0:r1, start:end]
                for grad in zeroed:
                    grad[b, h, r0:r1, end:] = 0.0
                    if start:   # a sliding window: the keys before it too
                        grad[b, h, r0:r1, :start] = 0.0
                rows = row_dot(dp, p)                         # sum(dpattern * p) per row
                np.subtract(dp, rows, out=ds)
                ds *= p                                       # p * (dpattern - rows)
                if cap is not None:   # times the cap's slope, 1 - (capped / cap)^2
                    ds = np.multiply(ds, softcap_slope(capped[b, h, r0:r1, start:end], cap),
                                     out=draw[b, h, r0:r1, start:end])
                np.matmul(ds, k_scaled[b, h, start:end], out=dq[b, h, r0:r1])
            for (c0, c1, _), rows in zip(blocks, seen_by):    # keys c0..c1
                np.matmul(pattern[b, h, rows, c0:c1].swapaxes(-1, -2),
                          dcontext[b, h, rows], out=dv[b, h, c0:c1])
                np.matmul(draw[b, h, rows, c0:c1].swapaxes(-1, -2),
                          q_scaled[b, h, rows], out=dk[b, h, c0:c1])

    parallel.run(part, H, parallel.cost(B * H * T * T * dh, q.dtype))
    return dq, dk, dv, dpattern, dscores


@op(results=1)
def layer_norm_forward_fast(x, gamma, beta, eps):
    """layer_norm_forward with fewer passes: the variance as a row dot product (no squares
    array), xhat made in place from x - mean, beta (if any) added in place; in parts of rows on the
    machine's cores (``parallel``), the broadcasts of a row's mean and of gamma and beta
    without NumPy's buffer (``parallel.unbuffered``)."""
    C = x.shape[-1]
    x2d = x.reshape(-1, C)
    xhat, out = np.empty_like(x2d), np.empty_like(x2d)        # (rows, C)
    rstd = np.empty((x2d.shape[0], 1), dtype=x.dtype)

    @parallel.unbuffered(C * x.itemsize)
    def part(r):
        xc = xhat[r]                                          # x - mean, made xhat below
        np.subtract(x2d[r], x2d[r].sum(axis=-1, keepdims=True) / C, out=xc)   # the mean
        var = row_dot(xc, xc) / C
        np.divide(1.0, np.sqrt(var + eps), out=rstd[r])
        xc *= rstd[r]
        np.multiply(xc, gamma, out=out[r])
        if beta is not None:
            out[r] += beta

    work = parallel.cost(x2d.size * 6 * parallel.PASS, x.dtype)   # six passes
    parallel.run(part, x2d.shape[0], work)
    shape = x.shape[:-1]
    return out.reshape(x.shape), LayerNormCache(xhat.reshape(x.shape), rstd.reshape(*shape, 1),
                                                gamma)


@op
def layer_norm_backward_fast(dout, cache):
    """layer_norm_backward with the row mean of dxhat * xhat as a dot product and
    dx = rstd * (dxhat - (mean(dxhat) + xhat * mean(dxhat * xhat))) built in one array; dx in
    parts of rows on the machine's cores (``parallel``), unbuffered as in the forward. dgamma
    and dbeta stay whole (and buffered: sums down the columns): two quick passes, which took
    three times as long cut in parts as a hand-off costs."""
    xhat, rstd, gamma = cache
    C = xhat.shape[-1]
    xhat2d, dout2d, rstd2d = xhat.reshape(-1, C), dout.reshape(-1, C), rstd.reshape(-1, 1)
    dgamma = (dout2d * xhat2d).sum(axis=0)
    dbeta = dout2d.sum(axis=0)
    dx = np.empty_like(dout2d)

    @parallel.unbuffered(C * dout.itemsize)
    def rows(r):
        dxhat = dout2d[r] * gamma
        mean_dxhat = dxhat.sum(axis=-1, keepdims=True) / C
        mean_dxhat_xhat = row_dot(dxhat, xhat2d[r]) / C
        d = dx[r]
        np.multiply(xhat2d[r], mean_dxhat_xhat, out=d)
        d += mean_dxhat
        np.subtract(dxhat, d, out=d)
        d *= rstd2d[r]

    work = parallel.cost(dout2d.size * 7 * parallel.PASS, dx.dtype)   # seven passes
    parallel.run(rows, dout2d.shape[0], work)
    return dx.reshape(dout.shape), dgamma, dbeta


@op
def embedding_backward_fast(dout, cache, out=None):
    """embedding_backward in rounds instead of np.add.at's element-by-element scatter: round j
    adds the j-th occurrence of every token that occurs more than j times, all at once (no
    token twice in a round, so a plain indexed add is right). Each token's rows are added in
    the order they come, as np.add.at adds them: the same numbers, bit for bit. A few tokens
    repeated many times would take many small rounds: those go to np.add.at itself."""
    tokens = cache.tokens.reshape(-1)
    rows = dout.reshape(-1, dout.shape[-1])
    order = np.argsort(tokens, kind="stable")                 # positions, token by token
    ranked = tokens[order]
    starts = np.flatnonzero(np.concatenate(([True], ranked[1:] != ranked[:-1])))
    occurrence = np.arange(ranked.size) - np.repeat(starts, np.diff(starts, append=ranked.size))
    dW_E = np.zeros((cache.vocab, rows.shape[1]), dtype=dout.dtype) if out is None else out
    rounds = int(occurrence.max(initial=-1)) + 1
    if rounds * 1000 > rows.size:   # few tokens, many times each: np.add.at is quicker (measured)
        np.add.at(dW_E, tokens, rows)
        return dW_E
    for j in range(rounds):
        this_round = occurrence == j
        dW_E[ranked[this_round]] += rows[order[this_round]]
    return dW_E


# ---------------------------------------------------------------- loss


class CrossEntropyCache(NamedTuple):
    probs: np.ndarray    # (B, T, V)
    targets: np.ndarray  # (B, T)
    valid: np.ndarray    # (B, T) bool: positions counted in the loss
    n: int               # number of valid positions


def cross_entropy_forward(logits, targets, valid):
    """Mean of -log softmax(logits)[target] over the valid positions.

    logits: (B, T, V); targets: (B, T); valid: (B, T) bool. Uses log-sum-exp with the row max
    subtracted, so logits of any finite size give a finite loss. A target at an invalid
    position is never read (it may be an ignore marker such as -100). At least one position
    must be valid. Unmarked (not ``@op``): in float16 and bfloat16 the loss stays float32's,
    as Hugging Face's causal-LM loss takes the logits to float32 first; the pass stores the
    probabilities rounded, and their gradient (``cross_entropy_backward``) is rounded.
    """
    n = int(valid.sum())
    if n == 0:
        raise ValueError("no position has a target: the loss is a mean over zero positions")
    targets = np.where(valid, targets, 0)                      # (B, T): any in-range id
    shifted = logits - logits.max(axis=-1, keepdims=True)     # (B, T, V)
    probs = np.exp(shifted)
    total = probs.sum(axis=-1, keepdims=True)                  # (B, T, 1)
    probs /= total
    picked = np.take_along_axis(shifted, targets[..., None], axis=-1) - np.log(total)
    loss = float(-(picked[..., 0] * valid).sum() / n)          # picked: log P[target]
    return loss, probs, CrossEntropyCache(probs, targets, valid, n)


def cross_entropy_terms(logits, targets, valid):
    """(B, T): each valid position's -log softmax(logits)[target], 0 elsewhere: the terms whose
    sum over N is ``cross_entropy_forward``'s loss, made by the same operations (log-sum-exp,
    so a probability that underflows to 0 still has a finite term), and so the same bits:
    ``terms.sum() / n`` is the loss."""
    targets = np.where(valid, targets, 0)
    shifted = logits - logits.max(axis=-1, keepdims=True)
    log_total = np.log(np.exp(shifted).sum(axis=-1))
    picked = np.take_along_axis(shifted, targets[..., None], axis=-1)[..., 0] - log_total
    return np.where(valid, -picked, 0.0)


@op
def cross_entropy_backward(cache):
    """dlogits = (P - Y) / N on valid positions, 0 elsewhere (seed 001).

    Y is one-hot, so subtracting it touches one entry per position; no (B, T, V) one-hot array
    is built.
    """
    probs, targets, valid, n = cache
    weight = (valid / n).astype(probs.dtype)[..., None]        # (B, T, 1): 1/N or 0
    dlogits = probs * weight                                   # P / N
    index = targets[..., None]
    np.put_along_axis(dlogits, index, np.take_along_axis(dlogits, index, -1) - weight, -1)
    return dlogits


@op
def cross_entropy_dprobs(cache):
    """Gradient of the loss with respect to the probabilities themselves: -Y / (N P).

    Shown for completeness; the model back-propagates through dlogits, which is better
    conditioned than going through this.
    """
    probs, targets, valid, n = cache
    dprobs = np.zeros_like(probs)
    index = targets[..., None]
    with np.errstate(divide="ignore", over="ignore"):  # P = 0 or denormal: -inf is the answer
        picked = np.where(valid[..., None], -1.0 / (n * np.take_along_axis(probs, index, -1)), 0.0)
    np.put_along_axis(dprobs, index, picked.astype(probs.dtype), -1)
    return dprobs
