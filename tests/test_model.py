"""The whole model: gradcheck over the architecture grid, names and shapes, gradient identities,
stability, determinism, dtype, inputs, masks, positional encoding, init and config validation."""

from __future__ import annotations

import importlib
import itertools
import math
import warnings

import numpy as np
import pytest

import tfmcli
from helpers import assert_scaled_close, random_params
from tfmcli.engine import masks, ops, positional
from tfmcli.engine.model import first_nonfinite
from tfmcli.engine.sizes import activation_shapes, param_shapes

MASKS = {
    "causal": dict(causal=True, lengths=None),
    "padding": dict(causal=False, lengths=(4, 2)),
    "causal+padding": dict(causal=True, lengths=(3, 1)),
}

GRID = [
    pytest.param(dict(norm=norm, activation=act, layers=layers, **MASKS[mask]),
                 id=f"{norm}-{act}-{mask}-L{layers}")
    for norm, act, mask, layers in itertools.product(
        ("pre", "post"), ("relu", "gelu"), MASKS, (1, 2))
]


def run(cfg):
    params = tfmcli.init_params(cfg)
    inputs = tfmcli.make_inputs(cfg)
    fwd = tfmcli.forward(params, inputs, cfg)
    return params, inputs, fwd, tfmcli.backward(params, fwd, cfg)


# ---------------------------------------------------------------- central differences


@pytest.mark.parametrize("fields", [
    dict(pe="learned", tied_head=True, head_bias=False, activation="gelu", layers=2, n_ctx=6),
    dict(pe="learned", norm="post", lengths=(3, 1)),
    dict(tied_head=True, causal=False, lengths=(4, 2)),
])
def test_gradcheck_learned_positions_and_tied_head_at_random_parameters(fields):
    from helpers import random_params

    cfg = tfmcli.Config(**fields)
    params = random_params(tfmcli.init_params(cfg), seed=9)
    report = tfmcli.gradcheck(params, tfmcli.make_inputs(cfg), cfg)
    assert [c.name for c in report.params] == list(param_shapes(cfg))
    assert report.passed, report.failed


def test_tied_head_gradient_is_the_sum_of_embedding_and_head_parts():
    cfg = tfmcli.Config(tied_head=True, head_bias=False)
    params = tfmcli.init_params(cfg)
    assert "head.W_U" not in params and "head.b_U" not in params
    fwd = tfmcli.forward(params, tfmcli.make_inputs(cfg), cfg)
    grads = tfmcli.backward(params, fwd, cfg)
    h = fwd.acts["ln_f.out"].reshape(-1, 6)
    head_part = (h.T @ grads.acts["logits"].reshape(-1, 8)).T                # (V, d)
    embed_part = ops.embedding_backward(grads.acts["embed"], fwd.caches["embed"])
    np.testing.assert_allclose(grads["embed.W_E"], head_part + embed_part, rtol=1e-13, atol=1e-16)
    assert_scaled_close(fwd.acts["logits"], fwd.acts["ln_f.out"] @ params["embed.W_E"].T)


def test_learned_positions_need_seq_len_within_n_ctx():
    with pytest.raises(tfmcli.ConfigError,
                       match="seq_len=5 is longer than the 4 learned positions"):
        tfmcli.Config(pe="learned", seq_len=5, n_ctx=4)
    assert tfmcli.init_params(tfmcli.Config(pe="learned", n_ctx=9))["embed.W_pos"].shape == (9, 6)


@pytest.mark.parametrize("fields", GRID)
def test_gradcheck_every_parameter(fields):
    cfg = tfmcli.Config(**fields)
    params, inputs = tfmcli.init_params(cfg), tfmcli.make_inputs(cfg)
    report = tfmcli.gradcheck(params, inputs, cfg, max_entries=24)
    assert [c.name for c in report.params] == list(param_shapes(cfg))
    assert report.passed, report.failed
    assert report.worst.rel_err <= 1e-6, report.worst


@pytest.mark.parametrize("fields", GRID)
def test_gradcheck_every_parameter_at_random_parameters(fields):
    """The same grid away from initial weights: every gamma drawn in [0.5, 1.5], every beta and
    bias from N(0, 0.5), so that a missing gamma factor or a dropped bias term shows."""
    from helpers import random_params

    cfg = tfmcli.Config(**fields)
    params = random_params(tfmcli.init_params(cfg), seed=11)
    report = tfmcli.gradcheck(params, tfmcli.make_inputs(cfg), cfg, max_entries=24)
    assert report.passed, report.failed
    assert report.worst.rel_err <= 1e-6, report.worst


@pytest.mark.parametrize("factor, expected", [(2.0, 0.5), (0.5, 0.5), (4.0, 0.75), (0.25, 0.75)])
def test_gradcheck_relative_error_either_way_round(monkeypatch, factor, expected):
    """|a - n| / max(|a|, |n|): an analytic gradient `factor` times the true one gives the same
    error whether it is too big or too small (2x and 0.5x: 0.5; 4x and 0.25x: 0.75)."""
    cfg = tfmcli.Config()
    params, inputs = tfmcli.init_params(cfg), tfmcli.make_inputs(cfg)
    right = ops.cross_entropy_backward
    monkeypatch.setattr(ops, "cross_entropy_backward", lambda cache: factor * right(cache))
    report = tfmcli.gradcheck(params, inputs, cfg, names=["head.b_U"])
    assert report.worst.rel_err == pytest.approx(expected, rel=1e-4)


def test_gradcheck_catches_a_wrong_gradient(monkeypatch):
    """The check itself can fail: a backward whose dlogits is twice too big is caught."""
    cfg = tfmcli.Config()
    params, inputs = tfmcli.init_params(cfg), tfmcli.make_inputs(cfg)
    right = ops.cross_entropy_backward
    monkeypatch.setattr(ops, "cross_entropy_backward", lambda cache: 2 * right(cache))
    report = tfmcli.gradcheck(params, inputs, cfg, max_entries=4, names=["head.b_U"])
    assert not report.passed
    assert report.worst.rel_err == pytest.approx(0.5, rel=1e-3)  # |2g - g| / |2g|
    at_the_mark = tfmcli.gradcheck(params, inputs, cfg, max_entries=4, names=["head.b_U"],
                                   tolerance=report.worst.rel_err)
    assert at_the_mark.passed   # the mark itself passes: "<= 1e-06"


@pytest.mark.parametrize("vocab", [8, 2])   # a loss of 2.59, and one under 1 (0.70)
def test_a_gradient_that_is_zero_is_measured_against_what_differences_resolve(monkeypatch, vocab):
    """b_K's gradient is exactly 0 (the softmax does not see a constant added to every score):
    its error is measured against a floor, FLOOR (1e-3) times the model's largest gradient, or
    the smallest gradient central differences resolve, eps_float64 max(1, |loss|) / h / 1e-6,
    when that is larger (shown with FLOOR set to 0)."""
    cfg = tfmcli.Config(vocab=vocab)
    params, inputs = tfmcli.init_params(cfg), tfmcli.make_inputs(cfg)
    fwd = tfmcli.forward(params, inputs, cfg)
    largest = max(float(np.abs(g).max()) for g in tfmcli.backward(params, fwd, cfg).values())
    resolution = np.finfo(np.float64).eps * max(1.0, abs(fwd.loss)) / 1e-5 / 1e-6
    for floor in (1e-3 * largest, resolution):
        if floor == resolution:
            monkeypatch.setattr(importlib.import_module("tfmcli.check.gradcheck"), "FLOOR", 0.0)
        report = tfmcli.gradcheck(params, inputs, cfg, names=["blocks.0.attn.b_K"])
        (b_K,) = report.params
        assert report.step == 1e-5 and b_K.max_abs_err > 0
        assert b_K.max_abs_err / b_K.rel_err == pytest.approx(floor, rel=1e-12)


PARTIAL_CONFIGS = [
    dict(layers=3, pe="learned", tied_head=True),
    dict(layers=3, norm="post", activation="gelu", lengths=(4, 3)),
    dict(layers=3, pe="rope", rms_norm=True, activation="swiglu", sliding_window=2,
         sliding_layers=(0, 2), kv_heads=1, seq_len=6),
    dict(layers=2, pe="alibi", embed_norm=True, parallel_residual=True, shared_norm=True),
    dict(layers=2, sandwich_norm=True, attn_softcap=5.0, logit_softcap=3.0, qk_norm=True),
]


@pytest.mark.parametrize("fields", PARTIAL_CONFIGS)
def test_a_pass_from_block_i_is_the_whole_pass_from_there_bit_for_bit(fields):
    """Given block i's input from a pass of the same parameters, the blocks from i on, the
    final norm, the head and the loss are the whole pass's, bit for bit (the gradient check
    starts each nudged pass there); past the last block, from its output."""
    from tfmcli.check.gradcheck import block_input
    from tfmcli.engine.model import unchecked_forward

    cfg = tfmcli.Config(**fields)
    params = random_params(tfmcli.init_params(cfg), seed=8)
    whole = tfmcli.forward(params, tfmcli.make_inputs(cfg), cfg)
    for start in range(cfg.layers + 1):
        x = whole.acts[block_input(start, cfg)]
        part = unchecked_forward(params, whole.inputs, cfg, start=start, x=x)
        assert part.loss == whole.loss
        first = ("embed" if start == 0 else f"blocks.{start}.in" if start < cfg.layers else
                 "ln_f.out" if cfg.norm == "pre" else "logits")
        assert next(iter(part.acts)) == first
        for name, value in part.acts.items():
            np.testing.assert_array_equal(value, whole.acts[name])


@pytest.mark.parametrize("fields", PARTIAL_CONFIGS[:3])
def test_gradcheck_from_each_parameters_block_is_gradcheck_from_the_embedding(fields,
                                                                               monkeypatch):
    """Every parameter's numeric gradient, its error and its verdict are the same, to the
    bit, whether each nudged pass starts at the parameter's block or at the embedding."""
    module = importlib.import_module("tfmcli.check.gradcheck")

    cfg = tfmcli.Config(**fields)
    params = random_params(tfmcli.init_params(cfg), seed=9)
    inputs = tfmcli.make_inputs(cfg)
    started = tfmcli.gradcheck(params, inputs, cfg, max_entries=3)
    assert {module.first_block(c.name, cfg) for c in started.params} == set(range(4))
    monkeypatch.setattr(module, "first_block", lambda name, cfg: 0)
    whole = tfmcli.gradcheck(params, inputs, cfg, max_entries=3)
    assert [(c.name, c.max_abs_err, c.rel_err, c.passed) for c in started.params] == [
        (c.name, c.max_abs_err, c.rel_err, c.passed) for c in whole.params]
    assert started.passed


def test_batched_central_differences_are_the_gradient_batch_by_batch():
    """150 entries in batches of 64 (the last one short): every entry's derivative of a curved
    function, with moved(js, hs) told which entries move and how far, equals the formula and
    the one-at-a-time central differences; an entry of size 5 takes a step 5 times as long."""
    from tfmcli.check.gradcheck import batched_central_differences, central_differences

    rng = np.random.default_rng(3)
    x, w = rng.normal(size=150), rng.normal(size=150)
    x[7] = 5.0

    def f(point):
        return float(np.sin(point) @ w + (point @ point) / 300)

    calls = []

    def moved(js, hs):
        calls.append((js.copy(), hs.copy()))
        points = np.repeat(x[None], len(js), axis=0)
        points[np.arange(len(js)), js] += hs
        return np.array([f(point) for point in points])

    numeric = batched_central_differences(moved, x)
    exact = np.cos(x) * w + x / 150
    np.testing.assert_allclose(numeric, exact, atol=1e-8)
    np.testing.assert_allclose(numeric, central_differences(f, x), atol=1e-8)
    assert [len(js) for js, _ in calls] == [64, 64, 64, 64, 22, 22]   # up, down per batch
    np.testing.assert_array_equal(np.concatenate([js for js, _ in calls[::2]]), np.arange(150))
    assert calls[0][1][7] == pytest.approx(5e-6) and calls[1][1][7] == pytest.approx(-5e-6)
    assert calls[0][1][0] == 1e-6 * max(1.0, abs(x[0]))


def test_gradcheck_reports_its_progress_entry_by_entry():
    cfg = tfmcli.Config()
    params, inputs = tfmcli.init_params(cfg), tfmcli.make_inputs(cfg)
    calls = []
    tfmcli.gradcheck(params, inputs, cfg, names=["head.b_U", "ln_f.beta"], max_entries=3,
                     progress=lambda done, total: calls.append((done, total)))
    assert calls == [(1, 6), (2, 6), (3, 6), (4, 6), (5, 6), (6, 6)]


# ---------------------------------------------------------------- names and shapes


@pytest.mark.parametrize("norm", ["pre", "post"])
@pytest.mark.parametrize("pe", ["sinusoidal", "none"])
def test_activation_and_gradient_names_and_shapes(norm, pe):
    cfg = tfmcli.Config(norm=norm, pe=pe, layers=2, d_ff=10, batch=3, seq_len=5, vocab=7)
    params, _, fwd, grads = run(cfg)
    expected = activation_shapes(cfg)
    assert list(fwd.acts) == list(expected)
    assert {n: a.shape for n, a in fwd.acts.items()} == dict(expected)
    assert list(grads) == list(param_shapes(cfg))
    assert {n: g.shape for n, g in grads.items()} == dict(param_shapes(cfg))
    assert list(grads.acts) == list(fwd.acts)
    assert {n: g.shape for n, g in grads.acts.items()} == dict(expected)
    assert ("ln_f.out" in fwd.acts) == (norm == "pre")
    assert ("pe" in fwd.acts) == (pe == "sinusoidal")


def test_a_forward_its_gradients_and_an_adam_state_show_as_one_line():
    """In a notebook, ``fwd``, ``grads`` and an Adam state show the counts and the end shapes
    (and the loss and N: 5 + 2 + 4 valid positions), not every array (the toy forward's
    dataclass repr was 50,895 characters)."""
    cfg = tfmcli.Config(layers=2, batch=3, seq_len=5, lengths=(5, 2, 4))
    _, _, fwd, grads = run(cfg)
    n_acts, n_params = len(activation_shapes(cfg)), len(param_shapes(cfg))
    assert repr(fwd) == (f"Forward(loss={fwd.loss!r}, scored=11, acts={{{n_acts} arrays: "
                         "'embed' (3, 5, 6) … 'probs' (3, 5, 8)})")
    assert repr(grads) == (f"Gradients({{{n_params} arrays: 'embed.W_E' (8, 6) … "
                           f"'head.b_U' (8,)}}, acts={{{n_acts} arrays: 'embed' (3, 5, 6) … "
                           "'probs' (3, 5, 8)})")
    assert float(repr(fwd).split("=")[1].split(",")[0]) == fwd.loss   # every digit of the loss
    state = tfmcli.train.optim.Adam.like(grads)
    ends = f"{{{n_params} arrays: 'embed.W_E' (8, 6) … 'head.b_U' (8,)}}"
    assert repr(state) == f"Adam(m={ends}, v={ends}, t=0, beta1=0.9, beta2=0.98, eps=1e-09)"


def test_a_few_arrays_show_as_one_line_too():
    """An Adam state of one parameter, a dict of two: the count in the singular when it is
    one, and the first and the last only when they are two."""
    from tfmcli.engine.model import arrays_repr
    a, b, c = np.zeros(2), np.zeros((3, 1)), np.zeros(())
    assert arrays_repr({}) == "{}"
    assert arrays_repr({"a": a}) == "{1 array: 'a' (2,)}"
    assert arrays_repr({"a": a, "b": b}) == "{2 arrays: 'a' (2,) … 'b' (3, 1)}"
    assert arrays_repr({"a": a, "b": b, "c": c}) == "{3 arrays: 'a' (2,) … 'c' ()}"


# ---------------------------------------------------------------- activation-gradient identities


@pytest.mark.parametrize("norm", ["pre", "post"])
def test_dlogits_is_probs_minus_onehot_over_n(norm):
    cfg = tfmcli.Config(norm=norm, lengths=(3, 1))
    _, inputs, fwd, grads = run(cfg)
    V = cfg.vocab
    valid = np.arange(cfg.seq_len)[None, :] < np.array(cfg.lengths)[:, None]   # (B, T)
    n = valid.sum()
    assert n == 4
    onehot = np.eye(V)[inputs.targets]                                          # (B, T, V)
    expected = np.where(valid[..., None], (fwd.acts["probs"] - onehot) / n, 0.0)
    assert_scaled_close(grads.acts["logits"], expected, floor=1e-16)
    assert np.abs(grads.acts["logits"][valid]).max() > 0.01


def test_dscores_is_zero_where_scores_are_minus_inf():
    cfg = tfmcli.Config(layers=2, lengths=(3, 2))
    _, _, fwd, grads = run(cfg)
    for i in range(2):
        scores = fwd.acts[f"blocks.{i}.attn.scores"]
        dscores = grads.acts[f"blocks.{i}.attn.scores"]
        hidden = np.isneginf(scores)
        # Per head: the causal triangle hides 6 of 16; length 3 hides (3, 3) too, length 2 hides
        # (2, 2), (3, 2), (3, 3) too. Two heads: 2 * (7 + 9).
        assert hidden.sum() == 32
        np.testing.assert_array_equal(dscores[hidden], 0.0)
        assert np.abs(dscores[~hidden]).max() > 1e-6
        # Each visible row of dscores sums to zero: softmax is shift-invariant.
        np.testing.assert_allclose(dscores.sum(-1), 0.0, atol=1e-16)


def test_head_gradients_are_sums_of_dlogits():
    cfg = tfmcli.Config(norm="pre", lengths=(4, 3))
    _, _, fwd, grads = run(cfg)
    dlogits = grads.acts["logits"]
    np.testing.assert_allclose(grads["head.b_U"], dlogits.sum((0, 1)), rtol=1e-13, atol=1e-17)
    h = fwd.acts["ln_f.out"]
    np.testing.assert_allclose(grads["head.W_U"], np.einsum("btd,btv->dv", h, dlogits),
                               rtol=1e-12, atol=1e-16)


def test_embedding_and_pe_gradients_come_from_dembed():
    cfg = tfmcli.Config(batch=3, seq_len=5, vocab=4)      # small vocab: tokens repeat
    _, inputs, _, grads = run(cfg)
    dembed = grads.acts["embed"]
    assert_scaled_close(grads.acts["pe"], dembed.sum(0))
    for token in range(cfg.vocab):
        np.testing.assert_allclose(grads["embed.W_E"][token],
                                   dembed[inputs.tokens == token].sum(0), rtol=1e-12, atol=1e-17)


def test_residual_gradients_add_up_in_a_pre_ln_block():
    cfg = tfmcli.Config(norm="pre")
    _, _, _, grads = run(cfg)
    a = grads.acts
    # z = y + FFN(LN2(y)): dz passes straight to resid2, and to y plus the FFN branch.
    np.testing.assert_array_equal(a["blocks.0.resid2"], a["blocks.0.out"])
    np.testing.assert_array_equal(a["blocks.0.ffn.out"], a["blocks.0.out"])
    np.testing.assert_array_equal(a["blocks.0.attn.out"], a["blocks.0.resid1"])
    assert not np.allclose(a["blocks.0.resid1"], a["blocks.0.out"])


# ---------------------------------------------------------------- stability


def _scaled(params, names, factor):
    out = dict(params)
    for name in names:
        out[name] = params[name] * factor
    return out


@pytest.mark.parametrize("norm", ["pre", "post"])
def test_logits_of_size_1e4_give_finite_loss_and_gradients(norm):
    cfg = tfmcli.Config(norm=norm, lengths=(4, 2))
    params, inputs, fwd, _ = run(cfg)
    big = _scaled(params, ["head.W_U"], 1e4 / np.abs(fwd.acts["logits"]).max())
    fwd = tfmcli.forward(big, inputs, cfg)
    grads = tfmcli.backward(big, fwd, cfg)
    assert np.abs(fwd.acts["logits"]).max() == pytest.approx(1e4, rel=1e-6)
    assert math.isfinite(fwd.loss) and fwd.loss > 100
    assert first_nonfinite(fwd.acts) is None
    assert first_nonfinite(grads) is None
    # d loss / d probs is -1 / (N p): see the xfail test below for where it overflows.
    assert first_nonfinite({n: g for n, g in grads.acts.items() if n != "probs"}) is None


def test_dprobs_is_minus_inf_exactly_where_a_target_probability_underflows():
    # d loss / d P = -1 / (N P): where P underflowed to 0 the true value is beyond float range,
    # so -inf is its honest representation; first_nonfinite allows it, nothing upstream uses it.
    cfg = tfmcli.Config(lengths=(4, 2))
    params, inputs, fwd, _ = run(cfg)
    big = _scaled(params, ["head.W_U"], 1e4 / np.abs(fwd.acts["logits"]).max())
    fwd = tfmcli.forward(big, inputs, cfg)
    grads = tfmcli.backward(big, fwd, cfg)
    assert math.isfinite(fwd.loss)
    dprobs = grads.acts["probs"]
    picked = np.take_along_axis(fwd.acts["probs"], inputs.targets[..., None], -1)[..., 0]
    valid = np.arange(cfg.seq_len)[None, :] < np.array(cfg.lengths)[:, None]
    underflow = (picked == 0) & valid
    assert underflow.any()
    assert np.all(
        np.isneginf(np.take_along_axis(dprobs, inputs.targets[..., None], -1)[..., 0][underflow])
    )
    assert np.isfinite(dprobs[~underflow]).all()
    assert first_nonfinite(grads.acts) is None
    assert first_nonfinite(grads) is None


@pytest.mark.parametrize("norm", ["pre", "post"])
def test_scores_of_size_1e4_give_finite_loss_and_gradients(norm):
    cfg = tfmcli.Config(norm=norm, lengths=(3, 4))
    params, inputs, fwd, _ = run(cfg)
    scores = fwd.acts["blocks.0.attn.scores"]
    c = math.sqrt(1e4 / np.abs(scores[np.isfinite(scores)]).max())   # scores scale as c^2
    big = _scaled(params, ["blocks.0.attn.W_Q", "blocks.0.attn.W_K"], c)
    fwd = tfmcli.forward(big, inputs, cfg)
    grads = tfmcli.backward(big, fwd, cfg)
    scores = fwd.acts["blocks.0.attn.scores"]
    assert np.abs(scores[np.isfinite(scores)]).max() > 0.5e4
    mask = masks.combined_mask(np.array(cfg.lengths), cfg.seq_len, causal=True)[:, None]
    np.testing.assert_array_equal(np.isneginf(scores), ~np.broadcast_to(mask, scores.shape))
    assert math.isfinite(fwd.loss)
    assert first_nonfinite(fwd.acts) is None
    assert first_nonfinite(grads) is None
    assert first_nonfinite(grads.acts) is None


def test_first_nonfinite_names_the_first_bad_array():
    arrays = {"a.attn.scores": np.array([-np.inf, 1.0]), "b": np.array([1.0, np.nan]),
              "c": np.array([np.inf])}
    assert first_nonfinite(arrays) == "b"
    assert first_nonfinite({"x.attn.scores": np.array([np.inf])}) == "x.attn.scores"


@pytest.mark.parametrize("scores, bad", [
    ([-np.inf, 1.0, np.inf], True),       # +inf among allowed -infs: the sum is NaN
    ([-np.inf, np.nan], True),
    ([-np.inf, -np.inf, 2.0], False),     # only the allowed -inf: the sum is -inf
    ([1e308, 1e308, -np.inf], False),     # finite values whose sum overflows: looked at closely
])
def test_first_nonfinite_tells_a_hidden_score_from_a_bad_one(scores, bad):
    arrays = {"blocks.0.attn.scores": np.array(scores), "huge": np.array([1e308, 1e308])}
    assert first_nonfinite(arrays) == ("blocks.0.attn.scores" if bad else None)


# ---------------------------------------------------------------- determinism and dtype


def test_same_seed_is_bit_identical_and_another_seed_differs():
    cfg = tfmcli.Config(layers=2, activation="gelu", lengths=(4, 3), seed=7)
    p1, i1, f1, g1 = run(cfg)
    p2, i2, f2, g2 = run(cfg)
    for a, b in [(p1, p2), (f1.acts, f2.acts), (g1, g2), (g1.acts, g2.acts)]:
        assert list(a) == list(b)
        assert all(np.array_equal(a[n], b[n]) for n in a)
    assert all(np.array_equal(x, y) for x, y in zip(i1, i2))
    assert f1.loss == f2.loss

    p3, i3, f3, _ = run(cfg.replace(seed=8))
    assert not np.array_equal(p1["embed.W_E"], p3["embed.W_E"])
    assert not np.array_equal(p1["blocks.1.ffn.W_2"], p3["blocks.1.ffn.W_2"])
    assert not np.array_equal(i1.tokens, i3.tokens)
    assert f1.loss != f3.loss


def test_float32_runs_in_float32_and_passes_gradcheck():
    cfg = tfmcli.Config(dtype="float32", lengths=(4, 2), activation="gelu")
    params, inputs, fwd, grads = run(cfg)
    for group in (params, fwd.acts, grads, grads.acts):
        assert {n: a.dtype for n, a in group.items()} == {n: np.dtype(np.float32) for n in group}
    report = tfmcli.gradcheck(params, inputs, cfg)
    assert report.tolerance == 1e-3
    assert report.passed, report.failed
    assert report.worst.rel_err <= 1e-3


# ---------------------------------------------------------------- b_K


@pytest.mark.parametrize("norm", ["pre", "post"])
def test_b_K_gradient_is_zero_up_to_rounding(norm):
    # b_K adds the same vector b to every key: score[t, s] gains q_t . b, a constant along the row
    # t. Softmax is invariant to adding a constant to a whole row, so the loss does not depend on
    # b_K at all; its exact gradient is 0 and what the backward returns is rounding.
    cfg = tfmcli.Config(norm=norm, layers=2, lengths=(4, 3))
    _, _, _, grads = run(cfg)
    largest = max(np.abs(g).max() for g in grads.values())
    assert largest > 0.1
    for i in range(cfg.layers):
        assert np.abs(grads[f"blocks.{i}.attn.b_K"]).max() <= 1e-12 * largest
        assert np.abs(grads[f"blocks.{i}.attn.b_Q"]).max() > 1e-6 * largest   # not also b_Q


# ---------------------------------------------------------------- inputs


def test_inputs_shapes_ranges_and_shift():
    cfg = tfmcli.Config(batch=3, seq_len=6, vocab=5, seed=3)
    tokens, targets, lengths = tfmcli.make_inputs(cfg)
    assert tokens.shape == targets.shape == (3, 6)
    assert np.issubdtype(tokens.dtype, np.integer)
    assert tokens.min() >= 0 and tokens.max() < 5 and targets.min() >= 0 and targets.max() < 5
    np.testing.assert_array_equal(targets[:, :-1], tokens[:, 1:])
    np.testing.assert_array_equal(lengths, [6, 6, 6])
    assert len(np.unique(tokens)) > 1
    np.testing.assert_array_equal(
        tfmcli.make_inputs(cfg.replace(lengths=(1, 6, 2))).lengths, [1, 6, 2])


# ---------------------------------------------------------------- masks


def test_causal_mask():
    np.testing.assert_array_equal(masks.causal_mask(3), [[1, 0, 0], [1, 1, 0], [1, 1, 1]])
    assert masks.causal_mask(3).dtype == bool


def test_padding_mask():
    np.testing.assert_array_equal(masks.padding_mask([3, 1], 4),
                                  [[1, 1, 1, 0], [1, 0, 0, 0]])


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "no-causal"])
def test_combined_mask(causal):
    lengths, T = [4, 2, 1], 4
    mask = masks.combined_mask(lengths, T, causal=causal)
    assert mask.shape == (3, 4, 4) and mask.dtype == bool
    for b, n in enumerate(lengths):
        for t in range(T):
            for s in range(T):
                assert mask[b, t, s] == (s < n and (s <= t or not causal)), (b, t, s)
    assert mask.any(-1).all()               # no query row is entirely hidden
    np.testing.assert_array_equal(masks.additive(mask)[~mask], -np.inf)
    np.testing.assert_array_equal(masks.additive(mask)[mask], 0.0)


# ---------------------------------------------------------------- positional encoding


def reference_sinusoidal(T, d):
    pe = np.zeros((T, d))
    for p in range(T):
        for i in range((d + 1) // 2):
            angle = p / 10000 ** (2 * i / d)
            pe[p, 2 * i] = math.sin(angle)
            if 2 * i + 1 < d:
                pe[p, 2 * i + 1] = math.cos(angle)
    return pe


@pytest.mark.parametrize("T,d", [(7, 6), (50, 16), (5, 7), (3, 1)])
def test_sinusoidal_matches_the_formula(T, d):
    pe = positional.sinusoidal(T, d)
    assert pe.shape == (T, d)
    np.testing.assert_allclose(pe, reference_sinusoidal(T, d), rtol=0, atol=1e-12)
    if d % 2:   # odd d: the last column is a sine, of pair (d - 1) / 2
        np.testing.assert_allclose(pe[:, -1], np.sin(np.arange(T) / 10000 ** ((d - 1) / d)),
                                   atol=1e-12)


def test_sinusoidal_is_not_seed_004s_loop():
    T, d = 10, 8
    note = np.zeros((T, d))
    for pos in range(T):
        for i in range(0, d, 2):        # i is already the even column index
            note[pos, i] = np.sin(pos / (10000 ** ((2 * i) / d)))
            note[pos, i + 1] = np.cos(pos / (10000 ** ((2 * (i + 1)) / d)))
    ours = positional.sinusoidal(T, d)
    np.testing.assert_allclose(note[:, 0], ours[:, 0], atol=1e-15)     # only column 0 agrees
    # Its column 1 is cos(pos / 10000^(2/d)); the formula's is cos(pos), pair 0's frequency.
    np.testing.assert_allclose(note[:, 1], np.cos(np.arange(T) / 10000 ** (2 / d)), atol=1e-15)
    np.testing.assert_allclose(ours[:, 1], np.cos(np.arange(T)), atol=1e-15)
    assert np.abs(note - ours).max() > 0.1


def test_model_adds_pe_to_the_embedding():
    cfg = tfmcli.Config(pe="sinusoidal")
    params, inputs, fwd, _ = run(cfg)
    np.testing.assert_array_equal(fwd.acts["pe"], positional.sinusoidal(cfg.seq_len, cfg.d_model))
    assert_scaled_close(fwd.acts["blocks.0.in"], fwd.acts["embed"] + fwd.acts["pe"], floor=0)
    np.testing.assert_array_equal(fwd.acts["embed"], params["embed.W_E"][inputs.tokens])


# ---------------------------------------------------------------- init schemes


BIG = dict(d_model=64, heads=4, vocab=50, d_ff=256, layers=1)


@pytest.mark.parametrize("scheme", ["normal", "uniform", "xavier", "kaiming"])
def test_init_scheme_statistics(scheme):
    cfg = tfmcli.Config(init=scheme, **BIG)
    params = tfmcli.init_params(cfg)
    for name, shape in param_shapes(cfg).items():
        value = params[name]
        assert value.shape == shape and value.dtype == np.float64
        if len(shape) == 1:
            continue
        fan_in, fan_out = shape
        if scheme == "normal":
            assert abs(value.mean()) < 0.003 and 0.018 < value.std() < 0.022, name
        elif scheme == "uniform":
            assert value.min() >= 0.0 and value.max() < 1.0, name
            assert 0.47 < value.mean() < 0.53 and 0.27 < value.std() < 0.31, name  # 1/sqrt(12)
        elif scheme == "xavier":
            limit = math.sqrt(6 / (fan_in + fan_out))
            assert np.abs(value).max() <= limit and np.abs(value).max() > 0.95 * limit, name
            assert 0.9 < value.std() / (limit / math.sqrt(3)) < 1.1, name
        else:
            std = math.sqrt(2 / fan_in)
            assert 0.9 < value.std() / std < 1.1 and abs(value.mean()) < 0.15 * std, name


def test_init_biases_zero_gammas_one_betas_zero():
    cfg = tfmcli.Config(layers=2, init="uniform")
    params = tfmcli.init_params(cfg)
    for name, value in params.items():
        leaf = name.rsplit(".", 1)[1]
        if leaf == "gamma":
            np.testing.assert_array_equal(value, 1.0)
        elif leaf == "beta" or leaf.startswith("b_"):
            np.testing.assert_array_equal(value, 0.0)
        else:
            assert value.ndim == 2 and np.all(value != 0), name


def test_init_draws_weights_in_param_shapes_order_from_the_seed():
    cfg = tfmcli.Config(init="uniform", seed=123)
    params = tfmcli.init_params(cfg)
    rng = np.random.default_rng(123)
    for name, shape in param_shapes(cfg).items():
        if len(shape) == 2:
            np.testing.assert_array_equal(params[name], rng.random(shape))


# ---------------------------------------------------------------- config validation


@pytest.mark.parametrize("fields,field", [
    (dict(d_model=6, heads=4), "heads"),
    (dict(batch=2, lengths=(4,)), "lengths"),
    (dict(batch=2, lengths=(4, 4, 4)), "lengths"),
    (dict(seq_len=4, lengths=(5, 4)), "lengths"),
    (dict(seq_len=4, lengths=(0, 4)), "lengths"),
    (dict(norm="middle"), "norm"),
    (dict(activation="tanh"), "activation"),
    (dict(init="zeros"), "init"),
    (dict(dtype="float8"), "dtype"),
    (dict(batch=0), "batch"),
    (dict(seq_len=-1), "seq_len"),
    (dict(d_model=0), "d_model"),
    (dict(heads=0), "heads"),
    (dict(vocab=0), "vocab"),
    (dict(layers=0), "layers"),
    (dict(d_ff=0), "d_ff"),
    (dict(eps=0.0), "eps"),
], ids=lambda v: v if isinstance(v, str) else ",".join(f"{k}={v[k]}" for k in v))
def test_config_validation(fields, field):
    with pytest.raises(tfmcli.ConfigError) as info:
        tfmcli.Config(**fields)
    assert info.value.field == field
    assert isinstance(info.value, ValueError)


def test_config_errors_name_the_values():
    with pytest.raises(tfmcli.ConfigError, match=r"d_model=6 .* heads=4.*1, 2, 3, 6"):
        tfmcli.Config(d_model=6, heads=4)
    with pytest.raises(tfmcli.ConfigError, match=r"outside 1\.\.4"):
        tfmcli.Config(lengths=(5, 1))


def test_config_bounds_allow_their_edge_and_refuse_past_it():
    from tfmcli.engine.config import MAX_LAYERS

    assert tfmcli.Config(layers=MAX_LAYERS).layers == 1000
    with pytest.raises(tfmcli.ConfigError,
                       match="layers=1001 is more than tfm shows; allowed: 1..1000"):
        tfmcli.Config(layers=MAX_LAYERS + 1)
    largest = float(np.finfo(np.float32).max)
    assert tfmcli.Config(dtype="float32", eps=largest).eps == largest
    with warnings.catch_warnings():
        warnings.simplefilter("error")   # and no RuntimeWarning of an overflowing cast first
        with pytest.raises(tfmcli.ConfigError, match="beyond float32's range"):
            tfmcli.Config(dtype="float32", eps=largest * 2)


def test_valid_config_derived_sizes():
    cfg = tfmcli.Config(d_model=12, heads=3, lengths=[2, 4])
    assert cfg.d_head == 4 and cfg.ff == 48 and cfg.lengths == (2, 4)
    assert tfmcli.Config(d_ff=10).ff == 10


def test_pe_wavelengths_are_the_periods_of_the_columns():
    """Column j of the sinusoidal table is sin (even j) or cos (odd j) of 2 pi p / lambda_j."""
    from tfmcli.engine.positional import sinusoidal, wavelengths
    T, d = 50, 10
    p = np.arange(T)[:, None]
    angle = 2 * np.pi * p / wavelengths(d)[None, :]
    expected = np.where(np.arange(d) % 2 == 0, np.sin(angle), np.cos(angle))
    np.testing.assert_allclose(sinusoidal(T, d), expected, atol=1e-12)


def test_gradcheck_passes_where_every_exact_gradient_below_the_norm_is_zero():
    """d_model = 1: a layer norm's output is its beta whatever its input, so every gradient
    before it is exactly 0 and central differences return rounding noise; the check's floor
    (a fraction of the largest gradient, or the smallest one differences resolve) absorbs it."""
    cfg = tfmcli.Config(d_model=1, heads=1)
    params = tfmcli.init_params(cfg)
    report = tfmcli.gradcheck(params, tfmcli.make_inputs(cfg), cfg)
    assert not np.abs(tfmcli.backward(params, tfmcli.forward(params, tfmcli.make_inputs(cfg), cfg),
                                      cfg)["embed.W_E"]).any()
    assert report.passed, report.failed



def test_scaled_closeness_is_tight_and_cpu_proof():
    """The suite's float comparison (helpers.assert_scaled_close): 1e-12 of the tensor's scale
    passes a last-bit difference on a small entry, fails a wrong formula's error, and a zero
    tensor must be matched exactly."""
    from helpers import assert_scaled_close

    assert_scaled_close([1.0, 1e-3 + 1e-15], [1.0, 1e-3])   # 1e-12 per entry: fine here
    with pytest.raises(AssertionError):
        assert_scaled_close([1.0, 2.0], [1.0, 2.0 + 1e-9])
    with pytest.raises(AssertionError):
        assert_scaled_close([0.0, 1e-300], [0.0, 0.0])
    with pytest.raises(AssertionError):
        assert_scaled_close([1.0], [1.0, 1.0])
