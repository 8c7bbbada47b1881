"""tfm ffn: one feed-forward sublayer at one position, recomputed number by number, against the
model, the backward pass, central differences and torch."""

import json
import re

import numpy as np
import pytest

import tfmcli
from helpers import error_line, ok, random_params, run
from tfmcli.explain import feedforward


@pytest.fixture(autouse=True)
def plain_env(monkeypatch):
    for name in ("NO_COLOR", "FORCE_COLOR", "COLUMNS"):
        monkeypatch.delenv(name, raising=False)


def model_run(norm, activation, dtype="float64"):
    """Two blocks, row 1 padded, at random parameters (biases, gammas and betas drawn)."""
    cfg = tfmcli.Config(norm=norm, activation=activation, layers=2, lengths=(4, 3), d_model=8,
                        heads=2, d_ff=10, dtype=dtype)
    params = random_params(tfmcli.init_params(cfg), seed=4)
    fwd = tfmcli.forward(params, tfmcli.make_inputs(cfg), cfg)
    return cfg, params, fwd, tfmcli.backward(params, fwd, cfg)


@pytest.mark.parametrize("norm", ["pre", "post"])
@pytest.mark.parametrize("activation", ["relu", "gelu", "gelu_erf"])
def test_each_ffn_recomputed_equals_the_model_and_its_backward(norm, activation):
    """pre, act and out are the model's; dhidden and dpre the backward's; the slope and dx
    central differences'; and each position's outer products and rows, summed over the batch,
    are the backward's dW_1, db_1, dW_2 and db_2."""
    cfg, params, fwd, grads = model_run(norm, activation)
    for block in (0, 1):
        p = f"blocks.{block}.ffn."
        dW_1, db_1, dW_2, db_2 = np.zeros((8, 10)), np.zeros(10), np.zeros((10, 8)), np.zeros(8)
        for b in range(2):
            for t in range(4):
                x = feedforward.explain(params, fwd, grads.acts[p + "out"], cfg, block, b, t)
                np.testing.assert_array_equal(
                    x.x, fwd.acts[f"blocks.{block}.{'ln2' if norm == 'pre' else 'ln1'}.out"][b, t])
                for mine, act in ((x.pre, "pre"), (x.hidden, "act"), (x.out, "out")):
                    np.testing.assert_allclose(mine, fwd.acts[p + act][b, t], atol=1e-14)
                for mine, act in ((x.dhidden, "act"), (x.dpre, "pre")):
                    np.testing.assert_allclose(mine, grads.acts[p + act][b, t], atol=1e-15)
                np.testing.assert_allclose(x.numeric_slope, x.slope, atol=1e-8)
                np.testing.assert_allclose(x.numeric_dx, x.dx, atol=1e-9)
                if norm == "pre":   # the FFN's dx is all of LN2's output gradient
                    np.testing.assert_allclose(x.dx, grads.acts[f"blocks.{block}.ln2.out"][b, t],
                                               atol=1e-15)
                dW_1 += np.outer(x.x, x.dpre)
                db_1 += x.dpre
                dW_2 += np.outer(x.hidden, x.dout)
                db_2 += x.dout
        for mine, name in ((dW_1, "W_1"), (db_1, "b_1"), (dW_2, "W_2"), (db_2, "b_2")):
            np.testing.assert_allclose(mine, grads[p + name], atol=1e-14)
        assert np.abs(grads[p + "W_1"]).max() > 1e-3   # a comparison of something
    if activation == "relu":
        assert set(np.unique(x.slope)) == {0.0, 1.0}


def test_gelu_and_its_slope_match_torch():
    """torch's tanh GELU and its autograd: the activation, the slope, dpre and dx."""
    torch = pytest.importorskip("torch")
    cfg, params, fwd, grads = model_run("pre", "gelu")
    x = feedforward.explain(params, fwd, grads.acts["blocks.1.ffn.out"], cfg, 1, 0, 2)
    xt = torch.tensor(x.x, requires_grad=True)
    W_1, b_1, W_2, b_2 = (torch.tensor(params[f"blocks.1.ffn.{n}"])
                          for n in ("W_1", "b_1", "W_2", "b_2"))
    pre = xt @ W_1 + b_1
    pre.retain_grad()
    hidden = torch.nn.functional.gelu(pre, approximate="tanh")
    (hidden @ W_2 + b_2).backward(torch.tensor(x.dout))
    np.testing.assert_allclose(x.hidden, hidden.detach().numpy(), atol=1e-15)
    np.testing.assert_allclose(x.dpre, pre.grad.numpy(), atol=1e-15)
    np.testing.assert_allclose(x.dx, xt.grad.numpy(), atol=1e-15)
    p = torch.tensor(x.pre, requires_grad=True)
    torch.nn.functional.gelu(p, approximate="tanh").sum().backward()
    np.testing.assert_allclose(x.slope, p.grad.numpy(), atol=1e-15)


def test_a_float32_ffn_is_explained_in_float64():
    cfg, params, fwd, grads = model_run("pre", "gelu", dtype="float32")
    x = feedforward.explain(params, fwd, grads.acts["blocks.0.ffn.out"], cfg, 0, 1, 1)
    assert x.dx.dtype == np.float64 and x.slope.dtype == np.float64
    np.testing.assert_allclose(x.out, fwd.acts["blocks.0.ffn.out"][1, 1], atol=1e-5)
    np.testing.assert_allclose(x.numeric_dx, x.dx, atol=1e-8)


def test_explain_refuses_what_the_run_does_not_have():
    cfg, params, fwd, grads = model_run("post", "relu")
    dout = grads.acts["blocks.0.ffn.out"]
    for block, row, t, reason in ((2, 0, 0, "block 2 is outside 0..1"),
                                  (0, -1, 0, "row -1 is outside 0..1"),
                                  (0, 0, 4, "position 4 is outside 0..3")):
        with pytest.raises(ValueError, match=re.escape(reason)):
            feedforward.explain(params, fwd, dout, cfg, block, row, t)
    assert feedforward.explain(params, fwd, dout, cfg, 1, 1, 3).x.shape == (8,)
    assert feedforward.input_name(cfg, 1) == "blocks.1.ln1.out"
    assert tfmcli.explain.feedforward is feedforward


def test_cli_ffn_json_is_the_ffn_of_that_position():
    data = json.loads(ok("ffn", "-L", 2, "--block", 1, "--row", 1, "-t", 2, "--activation",
                         "gelu", "--json").stdout)
    cfg = tfmcli.Config(layers=2, activation="gelu")
    params = tfmcli.init_params(cfg)
    fwd = tfmcli.forward(params, tfmcli.make_inputs(cfg), cfg)
    grads = tfmcli.backward(params, fwd, cfg)
    np.testing.assert_array_equal(data["x"], fwd.acts["blocks.1.ln2.out"][1, 2])
    np.testing.assert_allclose(data["out"], fwd.acts["blocks.1.ffn.out"][1, 2], atol=1e-14)
    np.testing.assert_array_equal(data["dout"], grads.acts["blocks.1.ffn.out"][1, 2])
    np.testing.assert_allclose(data["dpre"], grads.acts["blocks.1.ffn.pre"][1, 2], atol=1e-15)
    assert (data["block"], data["activation"], data["input"]) == (1, "gelu", "blocks.1.ln2.out")
    assert len(data["pre"]) == len(data["slope"]) == 24 and len(data["dx"]) == 6
    assert data["forward_model_diff"] < 1e-14 and data["backward_model_diff"] < 1e-15
    assert data["dx_numeric_diff"] < 1e-8 and data["slope_numeric_diff"] < 1e-8
    assert json.loads(ok("ffn", "--json").stdout)["position"] == 0   # the first, by default


def test_cli_ffn_prints_the_steps_and_says_when_no_gradient_reaches_the_position():
    out = ok("ffn", "-t", 2).stdout
    assert "out = relu(x W_1 + b_1) W_2 + b_2" in out
    assert "relu'(pre) = 1 where pre > 0, else 0 (pre: the ReLU's own input)" in out
    assert "dpre = dhidden * relu'(pre), after the product with W_2^T" in out
    rows = {line.split()[0]: line.split()[1:] for line in out.splitlines()
            if line.split()[:1] in (["x"], ["dx"], ["out"]) and line.split()[1][0] in "+-"}
    assert rows["x"][:2] == ["-0.0879", "+1.9474"] and rows["dx"][:2] == ["+0.0117", "+0.0319"]
    assert rows["out"][:2] == ["+1.0703", "-0.6368"]
    assert "dout is 0 here" not in out
    gelu = ok("ffn", "--activation", "gelu").stdout
    assert "gelu'(pre) = 0.5 (1 + t) + 0.5 pre (1 - t^2) sqrt(2/pi)" in gelu
    padded = ok("ffn", "--lengths", "4,2", "--row", 1, "-t", 3).stdout
    assert "dout is 0 here: position 3 of row 1 adds nothing to the loss" in " ".join(
        padded.split())


def test_cli_ffn_shows_every_column_up_to_32_and_wider_rows_with_full(monkeypatch):
    monkeypatch.setenv("COLUMNS", "80")
    assert "showing" not in ok("ffn", "--d-ff", 32).stdout        # wrapped in blocks
    wide = ok("ffn", "--d-ff", 33).stdout
    assert "showing 5 of 33 columns" in wide
    assert "showing" not in ok("ffn", "--d-ff", 33, "--full").stdout


@pytest.mark.parametrize("args, option, needle", [
    (["-t", "4"], "'--position'", "0..3"),
    (["--block", "1"], "'--block'", "0..0"),
    (["--row", "2"], "'--row'", "0..1"),
])
def test_bad_ffn_options(args, option, needle):
    line = error_line(run("ffn", *args), 2)
    assert option in line and needle in line


def test_the_relu_slope_at_exactly_zero_is_zero_as_in_torch():
    """The one point where ReLU has no derivative: PyTorch takes 0, and so does the model's
    backward (ops.relu_backward); tfm ffn must show the same."""
    pre = np.array([-1.0, 0.0, 2.0])
    np.testing.assert_array_equal(feedforward.slope(pre, "relu"), [0.0, 0.0, 1.0])
    np.testing.assert_array_equal(feedforward.activation(pre, "relu"), [0.0, 0.0, 2.0])


@pytest.mark.parametrize("activation", ["gelu", "swiglu"])
def test_central_differences_span_several_batches_of_a_wide_ffn(activation):
    """d 80 is two batches of the differences (64 and 16 entries), each moving pre (and the
    gate) by rows of W_1 (and W_gate)."""
    cfg = tfmcli.Config(activation=activation, d_model=80, heads=4, d_ff=96, seq_len=4)
    params = random_params(tfmcli.init_params(cfg), seed=5)
    fwd = tfmcli.forward(params, tfmcli.make_inputs(cfg), cfg)
    grads = tfmcli.backward(params, fwd, cfg)
    x = feedforward.explain(params, fwd, grads.acts["blocks.0.ffn.out"], cfg, 0, 1, 2)
    np.testing.assert_allclose(x.dx, grads.acts["blocks.0.ln2.out"][1, 2], atol=1e-14)
    np.testing.assert_allclose(x.numeric_dx, x.dx, atol=1e-9)
    assert np.abs(x.dx).max() > 1e-2
