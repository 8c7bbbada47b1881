"""tfm attn --backward: one head's backward step by step, and one query's number by number,
recomputed from the model's own q, k, v and softmax, against central differences and the
model's backward."""

import json
import math

import numpy as np
import pytest

import tfmcli
from helpers import assert_scaled_close, error_line, ok, random_params, run
from tfmcli.engine import ops
from tfmcli.engine.masks import combined_mask
from tfmcli.explain.steps import explain_query_backward, model_head_backward_steps


@pytest.fixture(autouse=True)
def plain_env(monkeypatch):
    for name in ("NO_COLOR", "FORCE_COLOR", "COLUMNS"):
        monkeypatch.delenv(name, raising=False)


def model_run(norm="pre", dtype="float64", seed=3):
    """Two blocks, three heads (head 1 a middle one), row 1 padded, at random parameters
    (biases, gammas and betas drawn: at initial weights the bias terms hide)."""
    cfg = tfmcli.Config(layers=2, heads=3, d_model=9, norm=norm, lengths=(5, 3), seq_len=5,
                        dtype=dtype)
    params = random_params(tfmcli.init_params(cfg), seed=seed)
    fwd = tfmcli.forward(params, tfmcli.make_inputs(cfg), cfg)
    return cfg, params, fwd


def numeric_gradients(q, k, v, mask, scale, dcontext, step=1e-6):
    """Central differences of sum(dcontext * attention(q, k, v)) in every entry of q, k, v."""
    def f(q, k, v):
        scores = np.where(mask, q @ k.T * scale, -np.inf)
        pattern, _ = ops.softmax_forward(scores)
        return float((dcontext * (pattern @ v)).sum())

    grads = []
    for which in range(3):
        args = [q.copy(), k.copy(), v.copy()]
        g = np.zeros_like(args[which])
        for index in np.ndindex(g.shape):
            up = [a.copy() for a in args]
            down = [a.copy() for a in args]
            up[which][index] += step
            down[which][index] -= step
            g[index] = (f(*up) - f(*down)) / (2 * step)
        grads.append(g)
    return grads


@pytest.mark.parametrize("norm", ["pre", "post"])
def test_each_head_backward_step_is_central_differences_and_the_models(norm):
    """From a random upstream gradient of the context, dQ, dK and dV are central differences
    of sum(dcontext * context); from the loss's own, every step is the backward pass's."""
    cfg, params, fwd = model_run(norm)
    grads = tfmcli.backward(params, fwd, cfg)
    rng = np.random.default_rng(7)
    upstream = rng.standard_normal(grads.acts["blocks.1.attn.context"].shape)
    p = "blocks.1.attn."
    for row in (0, 1):
        mask = combined_mask(fwd.inputs.lengths, 5, cfg.causal)[row]
        q, k, v = (fwd.acts[p + n][row, 1] for n in "qkv")
        steps = {s.name: s.value for s in model_head_backward_steps(fwd, upstream, cfg, 1, 1, row)}
        np.testing.assert_array_equal(steps["dcontext"], upstream[row, :, 3:6])
        dq, dk, dv = numeric_gradients(q, k, v, mask, 1 / math.sqrt(3), upstream[row, :, 3:6])
        for name, numeric in (("dQ", dq), ("dK", dk), ("dV", dv)):
            np.testing.assert_allclose(steps[name], numeric, atol=1e-8)
        assert np.abs(dq).max() > 0.01 and np.abs(dk).max() > 0.01
        np.testing.assert_allclose(steps["dscaled scores"].sum(axis=-1), 0, atol=1e-15)
        assert (steps["dscaled scores"][~mask] == 0).all()

        own = {s.name: s.value for s in model_head_backward_steps(
            fwd, grads.acts[p + "context"], cfg, 1, 1, row)}
        for name, act in (("dsoftmax", "pattern"), ("dV", "v"), ("dscaled scores", "scores"),
                          ("dQ", "q"), ("dK", "k")):
            np.testing.assert_allclose(own[name], grads.acts[p + act][row, 1], atol=1e-15)


@pytest.mark.parametrize("norm", ["pre", "post"])
def test_one_querys_backward_sums_to_the_heads(norm):
    """Each query's dq is central differences' and the model's row; its dscaled the model's
    row of dscores; and every query's shares of dk and dv sum to the backward's dk and dv."""
    cfg, params, fwd = model_run(norm)
    grads = tfmcli.backward(params, fwd, cfg)
    p = "blocks.0.attn."
    dcontext = grads.acts[p + "context"]
    for row in (0, 1):
        dk, dv = np.zeros((5, 3)), np.zeros((5, 3))
        for t in range(5):
            x = explain_query_backward(fwd, dcontext, cfg, 0, 2, row, t)
            np.testing.assert_allclose(x.dq, grads.acts[p + "q"][row, 2, t], atol=1e-15)
            np.testing.assert_allclose(x.numeric_dq, x.dq, atol=1e-9)
            np.testing.assert_allclose(x.dscaled, grads.acts[p + "scores"][row, 2, t],
                                       atol=1e-15)
            assert_scaled_close(x.dproducts.sum(axis=-1), x.dweights)
            assert_scaled_close(x.dq_parts.sum(axis=0), x.dq)
            assert_scaled_close(x.dscores, x.dscaled / math.sqrt(3))
            assert abs(x.dscaled.sum()) < 1e-15
            dk += x.dk_share
            dv += x.dv_share
        np.testing.assert_allclose(dk, grads.acts[p + "k"][row, 2], atol=1e-15)
        np.testing.assert_allclose(dv, grads.acts[p + "v"][row, 2], atol=1e-15)
        assert np.abs(dk).max() > 0.005


def test_a_float32_query_is_explained_in_float64():
    cfg, params, fwd = model_run(dtype="float32")
    grads = tfmcli.backward(params, fwd, cfg)
    x = explain_query_backward(fwd, grads.acts["blocks.1.attn.context"], cfg, 1, 0, 0, 3)
    assert x.dq.dtype == np.float64 and x.dk_share.dtype == np.float64
    np.testing.assert_allclose(x.dq, grads.acts["blocks.1.attn.q"][0, 0, 3], atol=1e-6)
    np.testing.assert_allclose(x.numeric_dq, x.dq, atol=1e-8)


def test_attn_backward_shows_the_steps_after_the_forward_and_checks_them():
    out = ok("attn", "--backward", "--lengths", "4,3", "--row", 1).stdout
    for i, name in enumerate(["dcontext", "dsoftmax", "dV", "dscaled scores", "dQ", "dK"], 10):
        assert f"{i}. {name} (4, " in out
    assert "differ from the backward pass's own" in out
    dv = out.split("12. dV")[1].split("13.")[0]
    assert "k0:" in dv and "q0:" not in dv       # dV's rows are the keys
    k = out.split("3. K")[1].split("4. V")[0]
    assert "k3:pad" in k and "q3" not in k
    data = json.loads(ok("attn", "--backward", "--json").stdout)
    assert [s["name"] for s in data["backward_steps"]] == [
        "dcontext", "dsoftmax", "dV", "dscaled scores", "dQ", "dK"]
    assert data["backward_model_diff"] < 1e-15
    assert "backward_steps" not in json.loads(ok("attn", "--json").stdout)


def test_attn_query_backward_lays_out_the_softmax_backward():
    cfg, params, fwd = model_run()
    data = json.loads(ok("attn", "--json", "--query", 3, "--backward", "--head", 1, "--block", 1,
                         "--row", 0, "-L", 2, "-H", 3, "-d", 9, "-T", 5,
                         "--lengths", "5,3").stdout)["backward"]
    assert data["dq_model_diff"] < 1e-15 and data["dq_numeric_diff"] < 1e-9
    assert data["dscaled_model_diff"] < 1e-15
    keys = data["keys"]
    assert [k["dscaled"] for k in keys[4:]] == [0.0]           # causal: key 4 is hidden
    assert sum(k["dscaled"] for k in keys) == pytest.approx(0, abs=1e-16)
    weights = json.loads(ok("attn", "--json", "--query", 3, "--head", 1, "--block", 1,
                            "-L", 2, "-H", 3, "-d", 9, "-T", 5, "--lengths", "5,3").stdout)
    for key, forward in zip(keys, weights["keys"]):
        assert key["dscaled"] == pytest.approx(
            forward["weight"] * (key["dweight"] - data["weighted_sum"]), abs=1e-17)
    out = ok("attn", "--query", 2, "--backward").stdout
    lines = [line.split() for line in out.splitlines()]
    # step 4: key, score, scaled = score x 0.57735, mask, weight
    assert ["k0:1", "-0.9921", "-0.5728", "visible", "+0.2622"] in lines
    assert ["k1:4", "-1.0342", "-0.5971", "visible", "+0.2559"] in lines
    # step 7: key, weight, dweight, dweight - S (S = -0.0852), dscaled, dscore
    # one notation per column: dscaled and dscore need scientific for k1's (issue 58)
    assert ["k0:1", "+0.2622", "+0.0285", "+0.1137", "+2.9803e-02", "+1.7207e-02"] in lines
    assert "S = Σ weight x dweight = -0.08518393" in out
    assert "dq differs from the backward pass's own (attn.q) by" in out
    assert "dcontext is 0 here" not in out
    padded = ok("attn", "--query", 3, "--backward", "--lengths", "4,3", "--row", 1).stdout
    assert ("dcontext is 0 here: nothing the loss counts depends on position 3 of row 1"
            in " ".join(padded.split()))


def test_attn_backward_is_refused_with_the_worked_example():
    line = error_line(run("attn", "--example", "illustrated", "--backward"), 2)
    assert "'--example'" in line and "takes no --backward" in line


def test_the_head_backward_steps_match_torch_autograd():
    """torch's autograd, from the same q, k, v and a random upstream gradient: dQ, dK, dV, the
    gradient of the scaled masked scores and of the softmax, and each query's dq row."""
    torch = pytest.importorskip("torch")
    cfg, params, fwd = model_run("pre")
    upstream = np.random.default_rng(11).standard_normal((2, 5, 9))
    p = "blocks.1.attn."
    for row in (0, 1):
        mask = combined_mask(fwd.inputs.lengths, 5, cfg.causal)[row]
        q, k, v = (torch.tensor(fwd.acts[p + n][row, 2], requires_grad=True) for n in "qkv")
        scaled = (q @ k.T / math.sqrt(3)).masked_fill(~torch.tensor(mask), float("-inf"))
        scaled.retain_grad()
        pattern = torch.softmax(scaled, dim=-1)
        pattern.retain_grad()
        (pattern @ v).backward(torch.tensor(upstream[row, :, 6:9]))
        steps = {s.name: s.value for s in model_head_backward_steps(fwd, upstream, cfg, 1, 2, row)}
        for name, tensor in (("dQ", q), ("dK", k), ("dV", v), ("dscaled scores", scaled),
                             ("dsoftmax", pattern)):
            np.testing.assert_allclose(steps[name], tensor.grad.numpy(), atol=1e-14)
        for t in range(5):
            x = explain_query_backward(fwd, upstream, cfg, 1, 2, row, t)
            np.testing.assert_allclose(x.dq, q.grad.numpy()[t], atol=1e-14)
            np.testing.assert_allclose(x.dscaled, scaled.grad.numpy()[t], atol=1e-14)


def test_attn_backward_saves_the_gradients_it_shows(tmp_path):
    path = tmp_path / "run.npz"
    ok("attn", "--backward", "--save", path)
    with np.load(path) as npz:
        groups = {key.split("/")[0] for key in npz.files}
        data = json.loads(ok("attn", "--backward", "--json").stdout)
        dq = np.array(data["backward_steps"][4]["value"])
        np.testing.assert_allclose(dq, npz["actgrad/blocks.0.attn.q"][0, 0], atol=1e-15)
    assert {"grad", "actgrad"} <= groups


def test_the_api_refuses_a_head_or_query_the_run_does_not_have():
    """NumPy would read row -1 as the last, and head 3 of three as an empty slice."""
    from tfmcli.explain import steps
    cfg, params, fwd = model_run()
    dcontext = np.zeros((2, 5, 9))
    for call, args, what in (
            (steps.model_head_steps, (params, fwd, cfg, 0, 0, -1), "row -1 is outside 0..1"),
            (steps.model_head_steps, (params, fwd, cfg, 0, 3, 0), "head 3 is outside 0..2"),
            (steps.model_head_backward_steps, (fwd, dcontext, cfg, 2, 0, 0),
             "block 2 is outside 0..1"),
            (steps.explain_query, (fwd, cfg, 0, 0, 0, 5), "query 5 is outside 0..4"),
            (steps.explain_query_backward, (fwd, dcontext, cfg, 0, 0, 2, 0),
             "row 2 is outside 0..1")):
        with pytest.raises(ValueError, match=what):
            call(*args)
    assert len(steps.model_head_steps(params, fwd, cfg, 1, 2, 1)) == 9   # the last of each
    assert tfmcli.explain.steps is steps
