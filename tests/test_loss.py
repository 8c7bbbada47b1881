"""tfm loss: the LM head and the loss at one position, recomputed number by number, against the
model, the backward pass, central differences and torch."""

import json
import re

import numpy as np
import pytest

import tfmcli
from helpers import error_line, ok, random_params, run
from tfmcli.engine import ops
from tfmcli.explain import loss
from tfmcli.explain.loss import shown_ids


@pytest.fixture(autouse=True)
def plain_env(monkeypatch):
    for name in ("NO_COLOR", "FORCE_COLOR", "COLUMNS"):
        monkeypatch.delenv(name, raising=False)


def model_run(norm="pre", tied=False, bias=True, dtype="float64"):
    """Two blocks, row 1 padded (and each row's last token without a target), at random
    parameters (the head's bias drawn too)."""
    cfg = tfmcli.Config(norm=norm, layers=2, d_model=8, heads=2, vocab=11, seq_len=5,
                        tied_head=tied, head_bias=bias, dtype=dtype)
    inputs = tfmcli.inputs_from_tokens([[3, 1, 4, 1, 5], [9, 2, 6]])
    cfg = cfg.replace(lengths=(5, 3))
    params = random_params(tfmcli.init_params(cfg), seed=6)
    fwd = tfmcli.forward(params, inputs, cfg)
    return cfg, params, fwd, tfmcli.backward(params, fwd, cfg)


@pytest.mark.parametrize("norm, tied, bias", [("pre", False, True), ("post", False, True),
                                              ("pre", True, False), ("post", True, True)])
def test_each_position_recomputed_equals_the_model_and_its_backward(norm, tied, bias):
    """logits and p are the model's; dlogits and dh the backward's, dh central differences';
    the terms' shares sum to the loss; each position's h^T dlogits and dlogits, summed, are
    the backward's dW_U and db_U; a position without a target adds nothing."""
    cfg, params, fwd, grads = model_run(norm, tied, bias)
    name = "ln_f.out" if norm == "pre" else "blocks.1.out"
    assert loss.input_name(cfg) == name
    terms = ops.cross_entropy_terms(fwd.acts["logits"], fwd.caches["loss"].targets,
                                    fwd.caches["loss"].valid)
    dW_U, db_U, total = np.zeros((8, 11)), np.zeros(11), 0.0
    for b in range(2):
        for t in range(5):
            x = loss.explain(params, fwd, cfg, b, t)
            np.testing.assert_allclose(x.logits, fwd.acts["logits"][b, t], atol=1e-14)
            np.testing.assert_allclose(x.probs, fwd.acts["probs"][b, t], atol=1e-15)
            np.testing.assert_allclose(x.dlogits, grads.acts["logits"][b, t], atol=1e-15)
            np.testing.assert_allclose(x.dh, grads.acts[name][b, t], atol=1e-15)
            np.testing.assert_allclose(x.numeric_dh, x.dh, atol=1e-9)
            assert x.term == pytest.approx(terms[b, t], abs=1e-14)
            assert x.n == 6 and x.total == pytest.approx(x.exps.sum(), rel=1e-15)
            scored = (b, t) in {(0, 0), (0, 1), (0, 2), (0, 3), (1, 0), (1, 1)}
            assert (x.target is not None) == scored
            if scored:
                assert x.target == [[3, 1, 4, 1, 5], [9, 2, 6]][b][t + 1]
                assert x.p_minus_y[x.target] == pytest.approx(x.probs[x.target] - 1, abs=1e-15)
            else:
                assert not x.dlogits.any() and not x.dh.any() and x.term == 0
            total += x.term_share
            dW_U += np.outer(x.h, x.dlogits)
            db_U += x.dlogits
    assert total == pytest.approx(fwd.loss, abs=1e-14)
    if not tied:
        np.testing.assert_allclose(dW_U, grads["head.W_U"], atol=1e-14)
    if bias:
        np.testing.assert_allclose(db_U, grads["head.b_U"], atol=1e-14)
    np.testing.assert_allclose(db_U.sum(), 0, atol=1e-15)   # each p - y sums to 0


def test_dh_matches_torch_cross_entropy():
    """torch's cross_entropy over the whole batch (mean over the scored positions, the
    unscored ignored), back to the head's input: every position's dh."""
    torch = pytest.importorskip("torch")
    cfg, params, fwd, grads = model_run("pre")
    h = torch.tensor(fwd.acts["ln_f.out"], requires_grad=True)
    logits = h @ torch.tensor(params["head.W_U"]) + torch.tensor(params["head.b_U"])
    cache = fwd.caches["loss"]
    targets = torch.tensor(np.where(cache.valid, cache.targets, -100))
    torch.nn.functional.cross_entropy(logits.reshape(-1, 11), targets.reshape(-1),
                                      ignore_index=-100).backward()
    for b in range(2):
        for t in range(5):
            x = loss.explain(params, fwd, cfg, b, t)
            np.testing.assert_allclose(x.dh, h.grad.numpy()[b, t], atol=1e-15)


def test_a_float32_position_is_explained_in_float64():
    cfg, params, fwd, grads = model_run(dtype="float32")
    x = loss.explain(params, fwd, cfg, 0, 2)
    assert x.dh.dtype == np.float64 and x.probs.dtype == np.float64
    np.testing.assert_allclose(x.probs, fwd.acts["probs"][0, 2], atol=1e-6)
    np.testing.assert_allclose(x.numeric_dh, x.dh, atol=1e-9)


def test_explain_refuses_what_the_run_does_not_have():
    cfg, params, fwd, grads = model_run()
    for row, t, reason in ((-1, 0, "row -1 is outside 0..1"), (2, 0, "row 2 is outside 0..1"),
                           (0, 5, "position 5 is outside 0..4")):
        with pytest.raises(ValueError, match=re.escape(reason)):
            loss.explain(params, fwd, cfg, row, t)
    assert tfmcli.explain.loss is loss


def test_the_columns_shown_are_the_whole_vocabulary_or_the_target_and_the_likeliest():
    probs = np.array([0.1, 0.3, 0.05, 0.3, 0.25])
    assert shown_ids(probs, 2, 1) == [0, 1, 2, 3, 4]                 # V <= 32: all, in order
    probs = np.linspace(0, 1, 40)
    probs[[7, 8]] = 2.0                                              # a tie: the lower id first
    assert shown_ids(probs, 5, 4) == [5, 7, 8, 39, 38]
    assert shown_ids(probs, 39, 2) == [39, 7, 8]                     # the target not twice
    assert shown_ids(probs, None, 3) == [7, 8, 39]                   # no target
    assert shown_ids(np.full(32, 1 / 32), 0, 2) == list(range(32))  # 32: still whole
    assert shown_ids(np.full(33, 1 / 33), 5, 2) == [5, 0, 1]         # 33: the target and k


def test_cli_loss_json_is_the_head_at_that_position():
    data = json.loads(ok("loss", "--row", 1, "-t", 2, "--json").stdout)
    cfg = tfmcli.Config()
    params = tfmcli.init_params(cfg)
    fwd = tfmcli.forward(params, tfmcli.make_inputs(cfg), cfg)
    grads = tfmcli.backward(params, fwd, cfg)
    np.testing.assert_array_equal(data["h"], fwd.acts["ln_f.out"][1, 2])
    np.testing.assert_allclose(data["probs"], fwd.acts["probs"][1, 2], atol=1e-15)
    np.testing.assert_allclose(data["dlogits"], grads.acts["logits"][1, 2], atol=1e-15)
    assert data["target"] == int(tfmcli.make_inputs(cfg).targets[1, 2]) and data["n"] == 8
    assert data["shown"] == list(range(8)) and data["input"] == "ln_f.out"
    assert data["dh_numeric_diff"] < 1e-9 and data["dh_model_diff"] < 1e-15
    assert data["forward_model_diff"] < 1e-14 and data["dlogits_model_diff"] < 1e-15
    assert json.loads(ok("loss", "--json").stdout)["position"] == 0   # the first, by default
    assert data["term"] == pytest.approx(-np.log(data["probs"][data["target"]]), rel=1e-14)


def test_cli_loss_prints_the_steps_and_the_target():
    out = ok("loss", "-t", 2).stdout
    assert "position 2 (token 6): the target y is the next token, 4" in out
    lines = out.splitlines()   # whole lines: each number to exactly its digits
    assert "p = exp(logits - max) / sum:  max = 1.4032457,  sum = 4.3837183" in lines
    assert "-log p[target] = log(sum) - (logits[target] - max) = 2.6035674" in lines
    assert "the loss is the mean of N = 8 such terms: this one adds 0.32544592" in lines
    header = next(line for line in out.splitlines() if "y=4" in line)
    assert header.split() == ["0", "1", "2", "3", "y=4", "5", "6", "7"]
    rows = {line.split()[0]: line.split()[1:] for line in out.splitlines()
            if line.split()[:1] in (["p"], ["dlogits"], ["dh"]) and line.split()[1][0] in "+-0"
            and line.split()[1] != "-"}   # not the row "p - y"
    assert rows["p"][4] == "+0.0740" and rows["dlogits"][4] == "-0.1157"   # (0.0740 - 1) / 8
    assert rows["dh"][:2] == ["+0.0473", "-0.0088"]
    assert "of db_U dlogits" in out and "no target" not in out
    last = ok("loss", "--tokens", "3,1,4", "-t", 2).stdout
    assert "has no target (padding, or the row's last token)" in " ".join(last.split())
    assert "no target, so dlogits and dh are 0 here" in last and "dlogits =" not in last
    tied = ok("loss", "--tied-head", "--no-head-bias").stdout
    assert "dh = dlogits W_U^T (tied: W_U = W_E^T, so dh = dlogits W_E)" in tied
    assert "W_E's gradient is dlogits^T h (V x d)" in tied and "db_U" not in tied


def test_cli_loss_shows_the_target_and_the_likeliest_of_a_large_vocabulary():
    data = json.loads(ok("loss", "-V", 40, "-t", 1, "-k", 3, "--json").stdout)
    probs = np.array(data["probs"])
    others = [i for i in np.argsort(-probs, kind="stable") if i != data["target"]]
    assert data["shown"] == [data["target"], *others[:3]]
    out = ok("loss", "-V", 40, "-t", 1).stdout
    assert "columns: the target and the 8 likeliest of 40 tokens (-k)" in out
    assert len(json.loads(ok("loss", "-V", 32, "--json").stdout)["shown"]) == 32
    assert len(json.loads(ok("loss", "-V", 33, "--json").stdout)["shown"]) == 9
    assert "a vocabulary of 32 is shown whole" in error_line(run("loss", "-V", 32, "-k", 2), 2)
    ok("loss", "-V", 33, "-k", 32)


@pytest.mark.parametrize("args, option, needle", [
    (["-t", "4"], "'--position'", "0..3"),
    (["--row", "2"], "'--row'", "0..1"),
    (["-k", "3"], "'-k'", "a vocabulary of 8 is shown whole"),
    (["-V", "40", "-k", "33"], "'-k'", "1"),
])
def test_bad_loss_options(args, option, needle):
    line = error_line(run("loss", *args), 2)
    assert option in line and needle in line


def test_cli_loss_shows_h_and_dh_whole_up_to_d_32(monkeypatch):
    monkeypatch.setenv("COLUMNS", "80")
    assert "showing" not in ok("loss", "-d", 32, "-H", 1).stdout       # wrapped in blocks
    wide = ok("loss", "-d", 34, "-H", 1).stdout
    assert len(re.findall(r"showing \d+ of 34 columns", wide)) == 2     # h and dh


@pytest.mark.parametrize("cap", [None, 3.0])
def test_central_differences_span_several_batches_of_a_wide_tied_head(cap):
    """d 80 is two batches of the differences (64 and 16 entries), each moving the logits by
    rows of the tied head W_E^T (a transposed view); with a soft cap on the logits too."""
    cfg = tfmcli.Config(d_model=80, heads=4, vocab=37, seq_len=5, tied_head=True,
                        head_bias=False, logit_softcap=cap)
    params = random_params(tfmcli.init_params(cfg), seed=2)
    fwd = tfmcli.forward(params, tfmcli.make_inputs(cfg), cfg)
    grads = tfmcli.backward(params, fwd, cfg)
    x = loss.explain(params, fwd, cfg, 1, 3)
    np.testing.assert_allclose(x.dh, grads.acts["ln_f.out"][1, 3], atol=1e-15)
    np.testing.assert_allclose(x.numeric_dh, x.dh, atol=1e-9)
    assert np.abs(x.dh).min() > 0 and np.abs(x.dh).max() > 1e-3   # every entry checked, none 0
