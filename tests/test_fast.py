"""The fast path (ops.*_fast, the model's default) equals the reference path (fast=False), the
plain formulas, to 1e-12 relative in float64: every activation, every activation gradient and
every parameter gradient, on random configs with causal and padding masks and at random O(1)
parameters."""

from unittest import mock

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import tfmcli
from helpers import assert_scaled_close, random_params
from tfmcli.engine import ops

TOL = 1e-12


def rel(a, b, floor: float = 0.0) -> float:
    """max |a - b| / max(max |b|, floor); infinities must match exactly."""
    a, b = np.asarray(a), np.asarray(b)
    same_inf = np.isinf(a) & (a == b)
    assert (np.isinf(a) == np.isinf(b)).all()      # -inf exactly where the mask hides
    diff = np.where(same_inf, 0.0, np.abs(np.where(same_inf, 0, a) - np.where(same_inf, 0, b)))
    scale = np.abs(np.where(np.isinf(b), 0, b)).max() if b.size else 0.0
    return float(diff.max() / max(scale, floor, 1e-300)) if b.size else 0.0


def assert_paths_agree(cfg, params, inputs):
    fast = tfmcli.forward(params, inputs, cfg)
    slow = tfmcli.forward(params, inputs, cfg, fast=False)
    assert abs(fast.loss - slow.loss) <= TOL * abs(slow.loss)
    assert list(fast.acts) == list(slow.acts)
    for name in slow.acts:
        assert rel(fast.acts[name], slow.acts[name]) <= TOL, name
    g_fast, g_slow = tfmcli.backward(params, fast, cfg), tfmcli.backward(params, slow, cfg)
    # b_K's exact gradient is 0 (softmax ignores a constant per row): both paths hold rounding
    # noise there, so each gradient is measured against the largest of all
    floor = max(float(np.abs(g).max()) for g in g_slow.values())
    for name in g_slow:
        assert rel(g_fast[name], g_slow[name], floor) <= TOL, name
    # the same for the activations' gradients: the softmax's backward subtracts each row's
    # sum(dpattern * pattern) from dpattern, and when a row's weights are near equal the
    # difference is far smaller than its terms (1e-5 of them at B 1, T 2), so the gradients of
    # the scores, q and k carry the terms' rounding; each is measured against the largest
    floor = max(float(np.abs(g).max()) for g in g_slow.acts.values() if g.size)
    for name in g_slow.acts:
        assert rel(g_fast.acts[name], g_slow.acts[name], floor) <= TOL, name


@settings(max_examples=40, deadline=None)
@given(B=st.integers(1, 3), T=st.integers(1, 7), H=st.sampled_from([1, 2, 3]),
       norm=st.sampled_from(["pre", "post"]),
       activation=st.sampled_from(["relu", "gelu", "swiglu", "geglu"]),
       causal=st.booleans(), pad=st.booleans(),
       pe=st.sampled_from(["sinusoidal", "learned", "none", "rope"]),
       tied=st.booleans(), layers=st.integers(1, 2), seed=st.integers(0, 10_000),
       block=st.sampled_from([1, 2, 3, 128]), rms=st.booleans(), grouped=st.booleans(),
       window=st.sampled_from([None, 1, 2, 3]), head_dim=st.sampled_from([None, 3]),
       qk_norm=st.booleans(), caps=st.sampled_from([(None, None), (0.5, None), (None, 1.0),
                                                    (2.0, 3.0)]),
       sandwich=st.booleans(), scale=st.sampled_from([None, 0.7]), some_slide=st.booleans(),
       local=st.sampled_from([None, 3.0]), linear=st.booleans(), partial=st.booleans(),
       parallel=st.booleans(), shared=st.booleans(),
       biases=st.sampled_from(["all", "ffn", "none"]))
def test_fast_path_equals_the_reference(B, T, H, norm, activation, causal, pad, pe, tied, layers,
                                        seed, block, rms, grouped, window, head_dim, qk_norm,
                                        caps, sandwich, scale, some_slide, local, linear,
                                        partial, parallel, shared, biases):
    """Small query blocks, so that keys are skipped at these small sizes too (after each
    block's keys, and before its sliding window)."""
    rng = np.random.default_rng(seed)
    lengths = tuple(int(n) for n in rng.integers(1, T + 1, B)) if pad else None
    cfg = tfmcli.Config(batch=B, seq_len=T, d_model=2 * H * 2, heads=H, vocab=9, norm=norm,
                        activation=activation, causal=causal, lengths=lengths, pe=pe,
                        tied_head=tied, head_bias=not tied, layers=layers, seed=seed,
                        rms_norm=rms, kv_heads=1 if grouped else None,
                        sliding_window=window if causal else None, head_dim=head_dim,
                        qk_norm=qk_norm, attn_softcap=caps[0], logit_softcap=caps[1],
                        sandwich_norm=sandwich and norm == "pre", attn_scale=scale,
                        sliding_layers=(layers - 1,) if some_slide and causal and window else None,
                        rope_scaling=2.0 if linear and pe == "rope" else None,
                        rope_local_theta=local if pe == "rope" and causal and window else None,
                        rotary_dim=2 if partial and pe == "rope" else None,
                        parallel_residual=parallel and norm == "pre" and not sandwich,
                        shared_norm=shared and parallel and norm == "pre" and not sandwich,
                        bias=biases == "all", ffn_bias=biases == "ffn")
    params = random_params(tfmcli.init_params(cfg), seed=seed)
    with mock.patch.object(ops, "QUERY_BLOCK", block):
        assert_paths_agree(cfg, params, tfmcli.make_inputs(cfg))


def test_fast_path_at_a_bigger_size_with_repeated_tokens():
    cfg = tfmcli.Config(batch=2, seq_len=64, d_model=32, heads=4, vocab=5, lengths=(64, 37))
    params = random_params(tfmcli.init_params(cfg), seed=1)
    assert_paths_agree(cfg, params, tfmcli.make_inputs(cfg))


def test_fast_embedding_backward_sums_repeated_tokens():
    tokens = np.array([[3, 1, 3], [0, 3, 1]])
    dout = np.random.default_rng(0).normal(size=(2, 3, 4))
    cache = ops.EmbeddingCache(tokens, 6)
    np.testing.assert_array_equal(ops.embedding_backward_fast(dout, cache),
                                  ops.embedding_backward(dout, cache))
    assert not ops.embedding_backward_fast(dout, cache)[[2, 4, 5]].any()   # unused rows: 0


@pytest.mark.parametrize("vocab, rows, width", [(50, 400, 64),   # rounds: tokens repeat ~8 times
                                                (3, 400, 4)])    # many repeats: np.add.at
def test_fast_embedding_backward_is_np_add_at_bit_for_bit(vocab, rows, width):
    """Each token's rows are added in their order, onto a tied head's gradient too."""
    rng = np.random.default_rng(vocab)
    tokens, dout = rng.integers(0, vocab, (2, rows // 2)), rng.normal(size=(2, rows // 2, width))
    cache = ops.EmbeddingCache(tokens, vocab)
    head = rng.normal(size=(vocab, width))
    np.testing.assert_array_equal(ops.embedding_backward_fast(dout, cache),
                                  ops.embedding_backward(dout, cache))
    np.testing.assert_array_equal(ops.embedding_backward_fast(dout, cache, out=head.copy()),
                                  ops.embedding_backward(dout, cache, out=head.copy()))


class CountingAddAt:
    """NumPy as ops sees it, but counting the calls of np.add.at."""

    def __init__(self):
        self.calls = 0
        self.add = self   # np.add.at is self.at; the rest of np as it is

    def at(self, *args):
        self.calls += 1
        np.add.at(*args)

    def __getattr__(self, name):
        return getattr(np, name)


@pytest.mark.parametrize("tokens, width, calls", [
    (np.arange(4096) % 1000, 8, 0),     # 5 rounds, 32,768 entries: the rounds
    (np.arange(250) % 125, 8, 0),       # 2 rounds, 2,000 entries: the rounds, at their edge
    (np.arange(250) % 125, 7, 1),       # 1,750 entries: np.add.at
    (np.arange(125), 8, 0),             # each token once: 1 round, 1,000 entries: the round
    (np.zeros(64, dtype=int), 8, 1),    # one token 64 times: np.add.at
])
def test_the_embedding_gradient_goes_in_rounds_unless_a_token_repeats_past_a_thousandth(
        monkeypatch, tokens, width, calls):
    """Rounds while rounds x 1000 are at most the entries of dout (measured: np.add.at is the
    quicker only beyond); the numbers are np.add.at's either way."""
    counting = CountingAddAt()
    monkeypatch.setattr(ops, "np", counting)
    dout = np.random.default_rng(1).normal(size=(1, tokens.size, width))
    cache = ops.EmbeddingCache(tokens[None, :], int(tokens.max()) + 1)
    got = ops.embedding_backward_fast(dout, cache)
    assert counting.calls == calls
    monkeypatch.undo()
    np.testing.assert_array_equal(got, ops.embedding_backward(dout, cache))


def test_fast_attention_keeps_every_hidden_weight_exactly_zero():
    cfg = tfmcli.Config(lengths=(4, 2))
    fwd = tfmcli.forward(tfmcli.init_params(cfg), tfmcli.make_inputs(cfg), cfg)
    pattern = fwd.acts["blocks.0.attn.pattern"]
    assert (pattern[1][..., 2:] == 0).all() and (np.triu(pattern[0, 0], 1) == 0).all()
    with pytest.raises(AssertionError):   # the comparison itself can fail
        assert rel(pattern * 1.001, pattern) <= TOL


def test_key_blocks_end_at_the_last_key_any_query_of_the_block_may_see():
    causal = tfmcli.engine.masks.combined_mask([8], 8)
    assert ops.key_blocks(causal, 3) == ((0, 3, 3), (3, 6, 6), (6, 8, 8))
    padded = tfmcli.engine.masks.combined_mask([3, 5], 8, causal=False)
    assert ops.key_blocks(padded, 4) == ((0, 4, 5), (4, 8, 5))      # keys 5..7: no row sees them
    both = tfmcli.engine.masks.combined_mask([2, 6], 8)
    assert ops.key_blocks(both, 2) == ((0, 2, 2), (2, 4, 4), (4, 6, 6), (6, 8, 6))


def test_key_starts_are_the_first_key_any_query_of_the_block_may_see():
    """A window of 3 on 8 positions, blocks of 3 queries: query 3 sees keys 1..3 and query 6
    keys 4..6; a row of length 5 has its padded queries 6 and 7 see what query 4 sees, 2..4."""
    window = tfmcli.engine.masks.combined_mask([8], 8, window=3)
    assert ops.key_starts(window, ops.key_blocks(window, 3)) == (0, 1, 4)
    padded = tfmcli.engine.masks.combined_mask([8, 5], 8, window=3)
    assert ops.key_starts(padded, ops.key_blocks(padded, 3)) == (0, 1, 2)
    causal = tfmcli.engine.masks.combined_mask([8, 5], 8)
    assert ops.key_starts(causal, ops.key_blocks(causal, 3)) == (0, 0, 0)   # no window


def test_keys_before_a_window_are_skipped_and_hold_the_references_numbers():
    """Blocks of 3 queries under a window of 3: each block multiplies only its keys from its
    start, and the keys before it hold -inf, 0 and 0, as the reference's do."""
    cfg = tfmcli.Config(seq_len=8, lengths=(8, 5), d_model=8, heads=2, sliding_window=3)
    params = random_params(tfmcli.init_params(cfg), seed=3)
    with mock.patch.object(ops, "QUERY_BLOCK", 3):
        assert_paths_agree(cfg, params, tfmcli.make_inputs(cfg))
        fwd = tfmcli.forward(params, tfmcli.make_inputs(cfg), cfg)
        grads = tfmcli.backward(params, fwd, cfg)
    assert fwd.caches["blocks.0.attn"][3].starts == (0, 1, 2)
    scores, pattern = fwd.acts["blocks.0.attn.scores"], fwd.acts["blocks.0.attn.pattern"]
    assert np.isneginf(scores[0, :, 6, :4]).all() and (pattern[0, :, 6, :4] == 0).all()
    assert (grads.acts["blocks.0.attn.scores"][0, :, 6, :4] == 0).all()


def test_the_mask_is_added_only_from_the_first_key_a_block_hides():
    causal = tfmcli.engine.masks.combined_mask([8], 8)
    blocks = ops.key_blocks(causal, 3)
    assert ops.hidden_from(causal, blocks) == (1, 4, 7)         # each block's diagonal square
    padded = tfmcli.engine.masks.combined_mask([3, 5], 8, causal=False)
    assert ops.hidden_from(padded, ops.key_blocks(padded, 4)) == (3, 3)   # row 0's padding
    full = tfmcli.engine.masks.combined_mask([8, 8], 8, causal=False)
    assert ops.hidden_from(full, ops.key_blocks(full, 4)) == (8, 8)       # nothing to add


def test_a_query_that_sees_one_key_has_a_score_gradient_of_exactly_zero():
    """Its weight is 1 whatever its score: dscores = p (dpattern - sum(dpattern p)) is 0, and
    the fast path gets exactly 0, not rounding noise (causal: query 0 sees key 0 alone)."""
    cfg = tfmcli.Config(seq_len=6, d_model=8, heads=2)
    params = random_params(tfmcli.init_params(cfg), seed=4)
    fwd = tfmcli.forward(params, tfmcli.make_inputs(cfg), cfg)
    dscores = tfmcli.backward(params, fwd, cfg).acts["blocks.0.attn.scores"]
    assert (dscores[:, :, 0, :] == 0).all() and (dscores[:, :, 1, :2] != 0).all()


def test_skipped_keys_hold_the_same_scores_weights_and_gradients_as_the_reference():
    """Causal, T 8, blocks of 3 queries: the upper triangle past each block is skipped."""
    cfg = tfmcli.Config(seq_len=8, lengths=(8, 5), d_model=8, heads=2)
    params = random_params(tfmcli.init_params(cfg), seed=3)
    with mock.patch.object(ops, "QUERY_BLOCK", 3):
        assert_paths_agree(cfg, params, tfmcli.make_inputs(cfg))
        fwd = tfmcli.forward(params, tfmcli.make_inputs(cfg), cfg)
    assert fwd.caches["blocks.0.attn"][3].blocks == ((0, 3, 3), (3, 6, 6), (6, 8, 8))
    scores = fwd.acts["blocks.0.attn.scores"]
    assert np.isneginf(scores[0, :, 0, 3:]).all() and np.isfinite(scores[0, :, 2, :3]).all()


def test_a_row_dot_product_that_overflows_is_made_the_plain_way():
    """einsum does not tell np.errstate of an overflow; the plain sum does: a float32 row of
    products past its range is inf in its own place, and raises under ``over="raise"``."""
    a = np.ones((2, 3, 4), dtype=np.float32)                  # (..., rows, entries)
    a[1, 1] = 1e20                                              # 1e40 is past float32's range
    with np.errstate(over="ignore"):
        out = ops.row_dot(a, a)
    assert out.shape == (2, 3, 1) and out.dtype == np.float32
    np.testing.assert_array_equal(out[..., 0], [[4.0, 4.0, 4.0], [4.0, np.inf, 4.0]])
    with np.errstate(over="raise"), pytest.raises(FloatingPointError):
        ops.row_dot(a, a)


def test_the_positional_table_and_the_mask_are_made_once_and_cannot_be_changed():
    cfg = tfmcli.Config(lengths=(4, 2))
    params, inputs = tfmcli.init_params(cfg), tfmcli.make_inputs(cfg)
    first, second = (tfmcli.forward(params, inputs, cfg) for _ in range(2))
    assert first.acts["pe"] is second.acts["pe"]
    table = tfmcli.engine.positional.sinusoidal(cfg.seq_len, cfg.d_model)
    np.testing.assert_array_equal(first.acts["pe"], table)
    with pytest.raises(ValueError):   # shared by every forward: read-only
        first.acts["pe"][0, 0] = 1.0
    masks = {id(f.caches["blocks.0.attn"][3].blocks) for f in (first, second)}
    assert len(masks) == 1


@pytest.mark.parametrize("backward", [ops.embedding_backward, ops.embedding_backward_fast])
def test_the_embedding_gradient_adds_into_a_tied_heads_gradient_in_place(backward):
    rng = np.random.default_rng(2)
    tokens, dout = np.array([[3, 1, 3], [0, 3, 1]]), rng.normal(size=(2, 3, 4))
    cache = ops.EmbeddingCache(tokens, 6)
    head = rng.normal(size=(6, 4))
    into = head.copy()
    assert backward(dout, cache, out=into) is into
    assert_scaled_close(into, head + ops.embedding_backward(dout, cache))


def test_a_transposed_weight_gradient_is_the_transpose():
    rng = np.random.default_rng(3)
    x, W, dout = rng.normal(size=(2, 3, 4)), rng.normal(size=(4, 5)), rng.normal(size=(2, 3, 5))
    _, cache = ops.linear_forward(x, W, np.zeros(5))
    dx, dW, db = ops.linear_backward(dout, cache)
    dx_t, dW_t, db_t = ops.linear_backward(dout, cache, transposed=True)
    assert dW_t.shape == (5, 4) and dW_t.flags.c_contiguous
    assert_scaled_close(dW_t, dW.T)
    np.testing.assert_array_equal(dx_t, dx)
    np.testing.assert_array_equal(db_t, db)
