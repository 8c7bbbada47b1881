"""tfm ln: one layer norm at one position, recomputed number by number, against the model."""

import json
import re

import numpy as np
import pytest

import tfmcli
from helpers import error_line, ok, random_params, run
from tfmcli.engine import ops
from tfmcli.explain import layernorm


@pytest.fixture(autouse=True)
def plain_env(monkeypatch):
    for name in ("NO_COLOR", "FORCE_COLOR", "COLUMNS"):
        monkeypatch.delenv(name, raising=False)


@pytest.mark.parametrize("norm", ["pre", "post"])
def test_each_layer_norm_recomputed_equals_the_model_and_its_backward(norm):
    """At random gammas and betas: y is the model's own output, dx the engine's backward and
    central differences, and each position's dy * xhat and dy sum over the batch to the
    backward's dgamma and dbeta."""
    cfg = tfmcli.Config(norm=norm, layers=2, lengths=(4, 3), d_model=8, heads=2)
    params = random_params(tfmcli.init_params(cfg), seed=2)
    fwd = tfmcli.forward(params, tfmcli.make_inputs(cfg), cfg)
    grads = tfmcli.backward(params, fwd, cfg)
    expected = ["blocks.0.ln1", "blocks.0.ln2", "blocks.1.ln1", "blocks.1.ln2"]
    assert layernorm.names(cfg) == expected + (["ln_f"] if norm == "pre" else [])
    for name in layernorm.names(cfg):
        dy = grads.acts[name + ".out"]
        dgamma, dbeta = np.zeros(8), np.zeros(8)
        for b in range(2):
            for t in range(4):
                x = layernorm.explain(params, fwd, dy, cfg, name, b, t)
                np.testing.assert_allclose(x.y, fwd.acts[name + ".out"][b, t], atol=1e-14)
                cache = ops.LayerNormCache(x.xhat, 1 / x.std, x.gamma)
                np.testing.assert_allclose(x.dx, ops.layer_norm_backward(dy[b, t], cache)[0],
                                           atol=1e-15)
                np.testing.assert_allclose(x.numeric_dx, x.dx, atol=1e-9 * abs(x.dx).max())
                assert x.mean == pytest.approx(x.x.mean(), abs=1e-15)
                assert x.var == pytest.approx(x.x.var(), rel=1e-14)
                dgamma += x.dy * x.xhat
                dbeta += x.dy
        np.testing.assert_allclose(dgamma, grads[name + ".gamma"], atol=1e-14)
        np.testing.assert_allclose(dbeta, grads[name + ".beta"], atol=1e-14)
        assert abs(grads[name + ".gamma"]).max() > 1e-3   # a comparison of something


def test_explain_refuses_what_the_run_does_not_have():
    cfg = tfmcli.Config(norm="post")
    params = tfmcli.init_params(cfg)
    fwd = tfmcli.forward(params, tfmcli.make_inputs(cfg), cfg)
    dy = tfmcli.backward(params, fwd, cfg).acts["blocks.0.ln1.out"]
    for name, row, t, reason in (("ln_f", 0, 0, "no layer norm 'ln_f'; this model has "
                                                "blocks.0.ln1, blocks.0.ln2"),
                                 ("blocks.0.ln1", -1, 0, "row -1 is outside 0..1"),
                                 ("blocks.0.ln1", 2, 0, "row 2 is outside 0..1"),
                                 ("blocks.0.ln1", 0, 4, "position 4 is outside 0..3")):
        with pytest.raises(ValueError, match=re.escape(reason)):
            layernorm.explain(params, fwd, dy, cfg, name, row, t)
    assert layernorm.explain(params, fwd, dy, cfg, "blocks.0.ln1", 1, 3).x.shape == (6,)


def test_the_input_of_each_layer_norm():
    pre, post = tfmcli.Config(layers=3), tfmcli.Config(layers=3, norm="post")
    assert [layernorm.input_name(pre, n) for n in ("blocks.1.ln1", "blocks.1.ln2", "ln_f")] == \
        ["blocks.1.in", "blocks.1.resid1", "blocks.2.out"]
    assert [layernorm.input_name(post, n) for n in ("blocks.1.ln1", "blocks.1.ln2")] == \
        ["blocks.1.resid1", "blocks.1.resid2"]


def test_cli_ln_json_is_the_layer_norm_of_that_position():
    data = json.loads(ok("ln", "--layer", "ln2", "-L", 2, "--block", 1, "--row", 1, "-t", 2,
                         "--json").stdout)
    cfg = tfmcli.Config(layers=2)
    params = tfmcli.init_params(cfg)
    fwd = tfmcli.forward(params, tfmcli.make_inputs(cfg), cfg)
    grads = tfmcli.backward(params, fwd, cfg)
    x = np.array(data["x"])
    np.testing.assert_array_equal(x, fwd.acts["blocks.1.resid1"][1, 2])
    assert data["mean"] == pytest.approx(x.mean(), abs=1e-15)
    np.testing.assert_allclose(data["y"], fwd.acts["blocks.1.ln2.out"][1, 2], atol=1e-14)
    np.testing.assert_array_equal(data["dy"], grads.acts["blocks.1.ln2.out"][1, 2])
    assert data["layer"] == "blocks.1.ln2" and data["token"] == "1"
    assert data["y_model_diff"] < 1e-14 and data["dx_numeric_diff"] < 1e-8


def test_cli_ln_prints_the_steps_and_says_when_no_gradient_reaches_the_position():
    out = ok("ln", "-t", 2).stdout
    assert "mean = sum(x) / 6 = 0.2680395;  var = sum((x - mean)^2) / 6 = 0.25374304" in out
    assert "m1 = mean(dxhat) = 0.035179004;  m2 = mean(dxhat * xhat) = -0.042894512" in out
    rows = {line.split()[0]: line.split()[1:] for line in out.splitlines()
            if line.split()[:1] in (["x"], ["dx"]) and line.split()[1][0] in "+-0"
            and line.split()[1] != "-"}   # the table rows: not "x - mean", not "dx = ..."
    assert rows["x"][:2] == ["+0.8048", "-0.0129"] and rows["dx"][:2] == ["-0.1818", "-0.0927"]
    terms = {label: line.split()[len(label.split()):] for line in out.splitlines()
             for label in ("dxhat - m1", "xhat * m2") if line.split()[:3] == label.split()}
    assert terms["dxhat - m1"][:2] == ["-0.1373", "-0.0228"]   # -0.1021 - 0.0352
    assert terms["xhat * m2"][:2] == ["-0.0457", "+0.0239"]    # 1.0655 x -0.0429
    assert json.loads(ok("ln", "--json").stdout)["position"] == 0   # the first, by default
    assert "dy is 0 here" not in out
    padded = ok("ln", "--lengths", "4,2", "--row", 1, "-t", 3).stdout
    assert "dy is 0 here: position 3 of row 1 adds nothing to the loss" in " ".join(padded.split())


def test_cli_ln_shows_every_column_up_to_d_32_and_wider_rows_with_full(monkeypatch):
    monkeypatch.setenv("COLUMNS", "80")
    assert "showing" not in ok("ln", "-d", 32, "-H", 1).stdout        # wrapped in blocks
    wide = ok("ln", "-d", 33, "-H", 1).stdout
    assert "showing 5 of 33 columns" in wide
    assert "showing" not in ok("ln", "-d", 33, "-H", 1, "--full").stdout


@pytest.mark.parametrize("args, option, needle", [
    (["--norm", "post", "--layer", "ln_f"], "'--layer'", "Post-LN has no ln_f"),
    (["--layer", "ln_f", "--block", "0"], "'--block'", "takes no --block"),
    (["-t", "4"], "'--position'", "0..3"),
    (["--block", "1"], "'--block'", "0..0"),
    (["--layer", "ln3"], "'--layer'", "'ln1', 'ln1_post', 'ln2', 'ln2_post', 'ln_f'"),
])
def test_bad_ln_options(args, option, needle):
    line = error_line(run("ln", *args), 2)
    assert option in line and needle in line
