"""tfm check --against torch: proof on demand, and that it fails when tfm is wrong."""

import json
from pathlib import Path

import pytest

from helpers import error_line, ok, run
from tfmcli.engine import ops

pytest.importorskip("torch")

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(autouse=True)
def plain_env(monkeypatch):
    for name in ("NO_COLOR", "FORCE_COLOR", "COLUMNS"):
        monkeypatch.delenv(name, raising=False)


@pytest.mark.parametrize("args", [
    [],
    ["--norm", "post", "--activation", "gelu", "-L", 2, "--tokens", "3,1,4,1,5", "--tokens", "2,7"],
    ["--pe", "learned", "--tied-head", "--no-head-bias", "--lengths", "4,2"],
    ["--dtype", "float32", "--no-causal"],
])
def test_check_passes_on_any_model(args):
    data = json.loads(ok("check", "--against", "torch", *args, "--json").stdout)
    assert data["passed"] is True
    names = [r["name"] for r in data["rows"]]
    assert names[:2] == ["loss", "logits"] and "grad embed.W_E" in names
    assert max(r["rel"] for r in data["rows"]) <= data["tolerance"]
    assert data["tolerance"] == (1e-4 if "float32" in args else 1e-9)


def test_check_catches_a_wrong_gamma_gradient(monkeypatch):
    """At initial weights gamma is 1; a doubled dgamma still shows, since check compares it.
    (The model runs the fast path by default, so that is where the mistake is planted.)"""
    right = ops.layer_norm_backward_fast

    def wrong(dout, cache):
        dx, dgamma, dbeta = right(dout, cache)
        return dx, 2 * dgamma, dbeta

    monkeypatch.setattr(ops, "layer_norm_backward_fast", wrong)
    result = run("check", "--against", "torch")
    line = error_line(result, 1)
    assert "differ beyond 1e-09" in line and "grad blocks.0.ln1.gamma" in line
    assert "✗ FAIL" in result.stdout


def test_a_difference_within_rounding_is_noise_and_one_beyond_it_its_number(monkeypatch):
    """tfm and torch round differently: the loss's difference is exactly 0 on one CPU, 1.7e-16
    on another. Within 32 ulps of the size rounding acts on (a gradient's: at least the largest
    gradient's, so b_K's noise too) a difference is ≈0, as the convention writes noise, and the
    picture is the same on every CPU; a dgamma off by 1e-11 of itself, beyond rounding and
    within the tolerance, is written as its number and is the worst."""
    out = ok("check", "--against", "torch").stdout
    rows = [line.split() for line in out.splitlines() if "✓ pass" in line]
    assert len(rows) == 25 and {row[-3] for row in rows} == {"≈0"}
    assert "≈0: zero to working precision" in out
    assert "all 25 agree to working precision (every difference ≈0)" in out
    from tfmcli.check import reference

    compare = reference.compare   # where two CPUs' roundings agree, exactly: ≈0 all the same
    monkeypatch.setattr(reference, "compare", lambda *args: [
        r._replace(rel=0.0, diff=0.0) for r in compare(*args)])
    exact = ok("check", "--against", "torch").stdout
    assert exact == out
    monkeypatch.setattr(reference, "compare", compare)
    right = ops.layer_norm_backward_fast

    def off(dout, cache):
        dx, dgamma, dbeta = right(dout, cache)
        return dx, dgamma * (1 + 1e-11), dbeta

    monkeypatch.setattr(ops, "layer_norm_backward_fast", off)
    out = ok("check", "--against", "torch").stdout
    rows = {" ".join(line.split()[:-3]): line.split()[-3]
            for line in out.splitlines() if "✓ pass" in line}
    assert rows["grad blocks.0.ln1.gamma"] == rows["grad ln_f.gamma"] == "1.00e-11"
    assert rows["grad blocks.0.ln1.beta"] == rows["loss"] == "≈0"
    assert "all 25 agree: worst 1.00e-11 (grad " in out and "gamma) <= 1e-09" in out


def test_each_row_says_what_rounding_acts_on():
    """``compare``'s rows: a forward number's rounding is of its own size, a gradient's of at
    least the largest gradient's (b_K's own entries are rounding, about 1e-17)."""
    import tfmcli
    from tfmcli.check import reference

    cfg = tfmcli.Config()
    params, inputs = tfmcli.init_params(cfg), tfmcli.make_inputs(cfg)
    fwd = tfmcli.forward(params, inputs, cfg)
    grads = tfmcli.backward(params, fwd, cfg)
    torch_run = reference.torch_run(params, inputs, cfg)
    rows = {r.name: r for r in reference.compare(fwd, grads, torch_run, cfg)}
    largest = max(abs(g).max() for name, g in grads.items() if name in torch_run.leaves)
    assert rows["loss"].scale == pytest.approx(fwd.loss, rel=1e-12)
    assert rows["logits"].scale == pytest.approx(abs(fwd.acts["logits"]).max(), rel=1e-12)
    assert rows["grad blocks.0.attn.b_K"].scale == pytest.approx(largest, rel=1e-12)
    assert rows["grad logits"].scale == pytest.approx(abs(grads.acts["logits"]).max(), rel=1e-12)
    assert rows["grad logits"].scale < largest / 2   # made first, from P and Y: its own size
    assert abs(grads["blocks.0.attn.b_K"]).max() < 1e-12 * largest
    b_K = rows["grad blocks.0.attn.b_K"]
    assert b_K.rel == pytest.approx(b_K.diff / (1e-6 * largest), rel=1e-12)   # over the floor
    assert rows["loss"].rel == pytest.approx(rows["loss"].diff / fwd.loss, rel=1e-12)
    assert all(row.diff <= 32 * 2.3e-16 * row.scale for row in rows.values())


@pytest.mark.parametrize("tol", ["0", "-1e-9"])
def test_check_refuses_a_tolerance_that_is_not_positive(tol):
    """No difference is ever <= 0 but an exact one: a tolerance of 0 would fail rounding."""
    line = error_line(run("check", "--against", "torch", "--tol", tol), 2)
    assert "'--tol'" in line and "allowed: a positive number" in line


def test_check_without_torch_says_how_to_install(monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_torch(name, *args, **kwargs):
        if name == "torch" or name.startswith("torch."):
            raise ImportError(name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_torch)
    line = error_line(run("check", "--against", "torch"), 2)
    assert "python -m pip install torch==2.13.0" in line and "'--against'" in line
    # the same install line as the README's and the check page's
    from tfmcli.check.reference import INSTALL

    for page in ("README.md", "docs/commands/check.md"):
        assert f"`{INSTALL}`" in (ROOT / page).read_text(), page
