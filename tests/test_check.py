"""tfm check --against torch: proof on demand, and that it fails when tfm is wrong."""

import json

import pytest

from helpers import error_line, ok, run
from tfmcli.engine import ops

pytest.importorskip("torch")


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
    assert "pip install 'tfmcli[torch]'" in line and "'--against'" in line
