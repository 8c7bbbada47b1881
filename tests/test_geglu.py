"""GeGLU (``activation="geglu"``, Gemma's FFN): ``(gelu(x W_gate + b_gate) * (x W_1 + b_1)) W_2 +
b_2`` with GELU's tanh form. Its backward against central differences; one sublayer against
Hugging Face's GemmaMLP; the views. The model with it (central differences at random O(1)
parameters, its reference path, the torch reference, the KV cache) is tested with SwiGLU's in
tests/test_swiglu.py, and Hugging Face's whole Gemma in tests/test_gemma.py.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

import tfmcli
from helpers import assert_scaled_close, error_line, ok, random_params, run
from tfmcli.engine import ops
from tfmcli.engine.sizes import activation_shapes, flops, memory_estimate, param_shapes


def geglu_cfg(**fields):
    base = dict(d_model=8, heads=2, activation="geglu", seq_len=5, lengths=(5, 3))
    return tfmcli.Config(**{**base, **fields})


def gelu_tanh(x):
    """GELU's tanh form, written out: 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))."""
    return 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x ** 3)))


# ---------------------------------------------------------------- the gate alone


def test_geglu_is_gelu_of_the_gate_times_pre():
    gate, pre = np.array([-2.0, 0.0, 1.5, 4.0]), np.array([3.0, -4.0, 0.5, -1.0])
    hidden, _ = ops.geglu_forward(gate, pre)
    assert_scaled_close(hidden, gelu_tanh(gate) * pre)
    assert hidden[1] == 0.0   # gelu(0) = 0: a closed gate passes nothing
    # far above 0 the gate is nearly the identity: gelu(4) * pre is about 4 * pre
    assert hidden[3] == pytest.approx(-4.0, rel=1e-4)


def test_geglus_dpre_is_the_forwards_gelu_of_the_gate():
    """dpre = dhidden gelu(gate), gelu made again from the cached tanh: the forward's own
    numbers. (Both gradients against central differences: test_swiglu.py, for both gates.)"""
    rng = np.random.default_rng(0)
    gate, pre, dhidden = (rng.normal(0.0, 2.0, (3, 7)) for _ in range(3))
    dgate, dpre = ops.geglu_backward(dhidden, ops.geglu_forward(gate, pre)[1])
    np.testing.assert_array_equal(dpre, dhidden * ops.gelu_forward(gate)[0])
    assert (dgate * dhidden * pre < 0).any()   # gelu' < 0 was reached: a gate under -0.75


def test_the_backward_holds_its_cache_as_it_found_it():
    """The backward works in arrays of its own: the cached gate, pre and tanh, which the
    model also shows (ffn.gate, ffn.pre), are not written over."""
    rng = np.random.default_rng(1)
    gate, pre, dhidden = (rng.normal(size=(4, 5)) for _ in range(3))
    cache = ops.geglu_forward(gate, pre)[1]
    kept = [a.copy() for a in (*cache, dhidden)]
    ops.geglu_backward(dhidden, cache)
    for before, after in zip(kept, (*cache, dhidden)):
        np.testing.assert_array_equal(before, after)


# ---------------------------------------------------------------- the model


def test_parameters_activations_and_counts_are_swiglus():
    """The same three weights and four activations as SwiGLU; only the gate's unit differs."""
    cfg = geglu_cfg(d_ff=12)
    swiglu = cfg.replace(activation="swiglu")
    assert param_shapes(cfg) == param_shapes(swiglu)
    assert activation_shapes(cfg) == activation_shapes(swiglu)
    assert flops(cfg) == flops(swiglu)
    assert cfg.gated and swiglu.gated and not cfg.replace(activation="gelu").gated
    fwd = tfmcli.forward(random_params(tfmcli.init_params(cfg), seed=1),
                         tfmcli.make_inputs(cfg), cfg)
    a = fwd.acts
    assert_scaled_close(a["blocks.0.ffn.act"],
                        gelu_tanh(a["blocks.0.ffn.gate"]) * a["blocks.0.ffn.pre"])


def test_memory_estimate_counts_the_gate_and_its_tanh():
    """The gate and its gradient a block, its tanh cached (the measured peak:
    tests/test_memory.py's geglu configs)."""
    cfg = geglu_cfg(batch=2, seq_len=16, lengths=None, d_ff=32, layers=3)
    geglu, relu = memory_estimate(cfg), memory_estimate(cfg.replace(activation="relu"))
    btf = 2 * 16 * 32 * 8
    assert geglu["activations"] - relu["activations"] == 3 * btf
    assert geglu["activation grads"] - relu["activation grads"] == 3 * btf
    assert geglu["caches"] - relu["caches"] == 3 * btf


# The model's gradients against central differences, its fast path against its reference,
# its KV cache against the full forward, the torch reference, tfm block, gradcheck and check
# --against torch run for GeGLU in tests/test_swiglu.py (GATED).


def test_ffn_matches_hugging_face_gemma_mlp():
    """One FFN sublayer against GemmaMLP (gate_proj, up_proj, down_proj, no biases,
    ``gelu_pytorch_tanh``): its output and every weight's gradient, from a random upstream
    gradient, at gates of both signs."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from transformers.models.gemma.modeling_gemma import GemmaMLP

    cfg = geglu_cfg(d_ff=12, bias=False)
    params = random_params(tfmcli.init_params(cfg), seed=9)
    rng = np.random.default_rng(10)
    x, dout = rng.normal(size=(2, 5, 8)), rng.normal(size=(2, 5, 8))
    mlp = GemmaMLP(transformers.GemmaConfig(hidden_size=8, intermediate_size=12,
                                            num_attention_heads=2, head_dim=4)).double()
    p = "blocks.0.ffn."
    pairs = {"gate_proj": "W_gate", "up_proj": "W_1", "down_proj": "W_2"}
    with torch.no_grad():
        for layer, w in pairs.items():
            getattr(mlp, layer).weight.copy_(torch.tensor(params[p + w].T))   # nn.Linear: (out, in)
    tx = torch.tensor(x, requires_grad=True)
    theirs = mlp(tx)
    theirs.backward(torch.tensor(dout))

    from tfmcli.engine.blocks import Tape, ffn, ffn_backward
    tape = Tape(params, cfg, {"fast": False})
    out = ffn(tape, x, "blocks.0.")
    dx = ffn_backward(tape, dout, "blocks.0.")
    grads, acts = tape.grads, tape.acts
    assert (acts[p + "gate"] < -0.75).any() and (acts[p + "gate"] > 0).any()
    assert_scaled_close(out, theirs.detach().numpy(), floor=1e-13)
    assert_scaled_close(dx, tx.grad.numpy(), floor=1e-13)
    for layer, w in pairs.items():
        np.testing.assert_allclose(grads[p + w], getattr(mlp, layer).weight.grad.numpy().T,
                                   rtol=0, atol=1e-12)


# ---------------------------------------------------------------- the views


def test_ffn_view_lays_out_the_gelu_gate_and_checks_it():
    """tfm ffn --json under GeGLU: the gate and dgate at that position are the run's own,
    hidden is gelu(gate) * pre, gelu'(gate) agrees with central differences, and dx with
    central differences of the sublayer."""
    args = ("ffn", "--activation", "geglu", "-d", 8, "--d-ff", 12, "-t", 2, "--row", 1)
    data = json.loads(ok(*args, "--json").stdout)
    cfg = geglu_cfg(d_ff=12, seq_len=4, lengths=None)
    params, inputs = tfmcli.init_params(cfg), tfmcli.make_inputs(cfg)
    fwd = tfmcli.forward(params, inputs, cfg)
    grads = tfmcli.backward(params, fwd, cfg)
    assert_scaled_close(data["gate"], fwd.acts["blocks.0.ffn.gate"][1, 2], floor=1e-15)
    assert_scaled_close(data["dgate"], grads.acts["blocks.0.ffn.gate"][1, 2], floor=1e-17)
    gate, pre = np.array(data["gate"]), np.array(data["pre"])
    assert_scaled_close(data["hidden"], gelu_tanh(gate) * pre)
    assert data["forward_model_diff"] < 1e-14 and data["backward_model_diff"] < 1e-16
    assert data["slope_numeric_diff"] < 1e-8 and data["dx_numeric_diff"] < 1e-9
    text = ok(*args).stdout
    assert "dgate = dhidden * pre * gelu'(gate)" in text
    assert "gelu(gate)" in text.split("dhidden = dout")[0]   # the forward's row of the gate
    assert "activation     geglu (gelu(gate) * pre, tanh approx.)" in text
    assert "silu" not in text


def test_the_explained_ffn_names_the_gate_by_its_unit():
    """``gate_act`` is gelu(gate) under GeGLU, silu(gate) under SwiGLU; ``silu_gate`` is
    SwiGLU's alone."""
    from tfmcli.explain.feedforward import explain

    for activation in ("geglu", "swiglu"):
        cfg = geglu_cfg(activation=activation)
        params = random_params(tfmcli.init_params(cfg), seed=2)
        fwd = tfmcli.forward(params, tfmcli.make_inputs(cfg), cfg)
        grads = tfmcli.backward(params, fwd, cfg)
        x = explain(params, fwd, grads.acts["blocks.0.ffn.out"], cfg, 0, 0, 3)
        gate = fwd.acts["blocks.0.ffn.gate"][0, 3]
        unit = gelu_tanh(gate) if activation == "geglu" else gate / (1 + np.exp(-gate))
        assert_scaled_close(x.gate_act, unit)
        assert (x.silu_gate is None) == (activation == "geglu")


def test_a_file_without_its_config_is_swiglu_unless_told_geglu(tmp_path):
    """An npz of parameters alone holds the same weights for either gate: read as SwiGLU, or
    as GeGLU with --activation geglu (the loss the GeGLU model gives); a gate-less activation
    typed for it contradicts its W_gate."""
    cfg = geglu_cfg(lengths=None, seq_len=4)
    params = random_params(tfmcli.init_params(cfg), seed=8)
    path = tmp_path / "bare.npz"
    np.savez(path, **{"param/" + name: value for name, value in params.items()})
    fwd = tfmcli.forward(params, tfmcli.make_inputs(cfg), cfg)
    told = json.loads(ok("forward", "--load", path, "--activation", "geglu", "--json").stdout)
    assert told["config"]["activation"] == "geglu"
    assert told["loss"] == pytest.approx(fwd.loss, rel=1e-12)
    untold = json.loads(ok("forward", "--load", path, "--json").stdout)
    assert untold["config"]["activation"] == "swiglu" and untold["loss"] != told["loss"]
    line = error_line(run("forward", "--load", path, "--activation", "relu"), 2)
    assert "activation='relu' contradicts" in line and "activation='swiglu'" in line


def test_geglu_erf_gates_with_gelu_itself():
    """geglu_erf: the gate through GELU itself, gate Phi(gate) * pre; its backward against
    central differences of sum(dhidden * hidden) in each input."""
    rng = np.random.default_rng(2)
    gate, pre, dhidden = rng.normal(size=(3, 7)) * 2
    hidden, cache = ops.geglu_erf_forward(gate, pre)
    phi = np.array([0.5 * (1 + math.erf(g / math.sqrt(2))) for g in gate])
    assert_scaled_close(hidden, gate * phi * pre)
    dgate, dpre = ops.geglu_erf_backward(dhidden, cache)
    h = 1e-6
    for x, d, which in ((gate, dgate, 0), (pre, dpre, 1)):
        numeric = np.empty_like(x)
        for i in range(x.size):
            up, down = x.copy(), x.copy()
            up[i] += h
            down[i] -= h
            args = [(up, pre), (gate, up)][which], [(down, pre), (gate, down)][which]
            numeric[i] = ((ops.geglu_erf_forward(*args[0])[0] * dhidden).sum()
                          - (ops.geglu_erf_forward(*args[1])[0] * dhidden).sum()) / (2 * h)
        assert_scaled_close(d, numeric, rel=1e-8)
