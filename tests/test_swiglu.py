"""SwiGLU (``activation="swiglu"``): the gated feed-forward, its backward, and the model with
it, against central differences, the torch reference, Hugging Face's own LlamaMLP (with its
biases) and its whole StableLM (Pre-LN, rotary attention, SwiGLU), at random O(1) parameters;
the fast path against the reference and the KV cache against the full forward. The model's
tests run for GeGLU too (``GATED``), whose own are in tests/test_geglu.py.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest

import tfmcli
from helpers import (
    assert_fast_equals_reference,
    assert_gradcheck_passes,
    assert_grads_match,
    assert_scaled_close,
    decoded_like_the_forward,
    float64_rotary,
    ok,
    random_params,
    tfm_grads_matching_hf,
    torch_reference_rows,
)
from tfmcli.check.gradcheck import central_differences
from tfmcli.engine import ops
from tfmcli.engine.sizes import activation_shapes, flops, memory_estimate, param_shapes

GATED = ["swiglu", "geglu", "geglu_erf"]   # the gated FFNs: the tests below run for each


def swiglu_cfg(**fields):
    base = dict(d_model=8, heads=2, activation="swiglu", seq_len=5, lengths=(5, 3))
    return tfmcli.Config(**{**base, **fields})


# ---------------------------------------------------------------- the gate alone


def test_sigmoid_is_the_logistic_and_never_overflows():
    """To the last digits where it is small (exp(x) / (1 + exp(x)) below 0, which has no
    cancellation there), and exp's overflow at -1000 is a quiet, exact 0."""
    x = np.array([-1000.0, -30.0, -1.0, 0.0, 2.5, 1000.0])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        s = ops.sigmoid(x)
    assert_scaled_close(s[1:4], np.exp(x[1:4]) / (1.0 + np.exp(x[1:4])))
    assert s[4] == pytest.approx(1.0 / (1.0 + np.exp(-2.5)), rel=1e-15)
    assert s[0] == 0.0 and s[-1] == 1.0 and s[3] == 0.5


def test_swiglu_is_silu_of_the_gate_times_pre():
    gate, pre = np.array([-2.0, 0.0, 1.5]), np.array([3.0, -4.0, 0.5])
    hidden, _ = ops.swiglu_forward(gate, pre)
    assert_scaled_close(hidden, gate / (1 + np.exp(-gate)) * pre)
    assert hidden[1] == 0.0   # silu(0) = 0: a closed gate passes nothing


@pytest.mark.parametrize("activation", GATED)
def test_the_gates_backward_against_central_differences(activation):
    """Both inputs' gradients, from a random upstream gradient, at O(1) values of both
    signs: the slope is below 0 for gates under about -1.28 (silu') and -0.75 (gelu')."""
    forward, backward = ops.GATES[activation]
    rng = np.random.default_rng(0)
    gate, pre, dhidden = (rng.normal(0.0, 2.0, (3, 7)) for _ in range(3))
    dgate, dpre = backward(dhidden, forward(gate, pre)[1])

    def contracted_gate(g):
        return float((dhidden * forward(g.reshape(3, 7), pre)[0]).sum())

    def contracted_pre(p):
        return float((dhidden * forward(gate, p.reshape(3, 7))[0]).sum())

    np.testing.assert_allclose(dgate.ravel(), central_differences(contracted_gate, gate.ravel()),
                               rtol=0, atol=1e-8)
    np.testing.assert_allclose(dpre.ravel(), central_differences(contracted_pre, pre.ravel()),
                               rtol=0, atol=1e-8)
    assert (dgate * dhidden * pre < 0).any()   # the negative slope was reached


# ---------------------------------------------------------------- the model


def test_parameters_and_trace_gain_the_gate():
    cfg = swiglu_cfg(d_ff=12)
    names = list(param_shapes(cfg))
    i = names.index("blocks.0.ffn.W_gate")
    assert names[i:i + 6] == ["blocks.0.ffn.W_gate", "blocks.0.ffn.b_gate", "blocks.0.ffn.W_1",
                              "blocks.0.ffn.b_1", "blocks.0.ffn.W_2", "blocks.0.ffn.b_2"]
    assert param_shapes(cfg)["blocks.0.ffn.W_gate"] == (8, 12)
    assert "blocks.0.ffn.W_gate" not in param_shapes(cfg.replace(activation="gelu"))
    acts = list(activation_shapes(cfg))
    i = acts.index("blocks.0.ffn.gate")
    assert acts[i:i + 4] == ["blocks.0.ffn.gate", "blocks.0.ffn.pre", "blocks.0.ffn.act",
                             "blocks.0.ffn.out"]
    params = tfmcli.init_params(cfg)
    assert np.abs(params["blocks.0.ffn.W_gate"]).max() > 0
    assert not params["blocks.0.ffn.b_gate"].any()   # a bias starts at 0
    fwd = tfmcli.forward(random_params(params, seed=1), tfmcli.make_inputs(cfg), cfg)
    assert list(fwd.acts) == acts
    a = fwd.acts
    gate = a["blocks.0.ffn.gate"]
    assert_scaled_close(a["blocks.0.ffn.act"], gate / (1 + np.exp(-gate)) * a["blocks.0.ffn.pre"])


def test_flops_count_three_products_in_the_ffn():
    cfg = swiglu_cfg(batch=2, seq_len=4, lengths=None, d_ff=10, layers=1)
    gelu = cfg.replace(activation="gelu")
    assert flops(cfg)[0] - flops(gelu)[0] == 2 * 2 * 4 * 8 * 10


def test_memory_estimate_counts_the_gate():
    """The gate and its gradient a block, its sigmoid cached (the measured peak:
    tests/test_memory.py's swiglu configs)."""
    cfg = swiglu_cfg(batch=2, seq_len=16, lengths=None, d_ff=32, layers=3)
    swiglu, relu = memory_estimate(cfg), memory_estimate(cfg.replace(activation="relu"))
    btf = 2 * 16 * 32 * 8
    assert swiglu["activations"] - relu["activations"] == 3 * btf
    assert swiglu["activation grads"] - relu["activation grads"] == 3 * btf
    assert swiglu["caches"] - relu["caches"] == 3 * btf


@pytest.mark.parametrize("activation", GATED)
@pytest.mark.parametrize("fields", [dict(), dict(norm="post", layers=2, pe="rope"),
                                    dict(tied_head=True, causal=False, d_ff=5, rms_norm=True)],
                         ids=["pre", "post-rope-L2", "tied-noncausal-rms-dff5"])
def test_gradients_match_central_differences_at_random_parameters(fields, activation):
    report = assert_gradcheck_passes(swiglu_cfg(activation=activation, **fields))
    assert "blocks.0.ffn.b_gate" in [c.name for c in report.params]


@pytest.mark.parametrize("activation", GATED)
def test_fast_path_equals_the_reference(activation):
    cfg = swiglu_cfg(batch=3, seq_len=9, lengths=(9, 4, 7), d_model=12, heads=2, layers=2,
                     activation=activation)
    params = random_params(tfmcli.init_params(cfg), seed=6)
    inputs = tfmcli.make_inputs(cfg)
    g_fast, g_slow = assert_fast_equals_reference(cfg, params, inputs)
    np.testing.assert_allclose(g_fast.acts["blocks.0.ffn.gate"], g_slow.acts["blocks.0.ffn.gate"],
                               rtol=0, atol=1e-12 * np.abs(g_slow.acts["blocks.0.ffn.gate"]).max())


@pytest.mark.parametrize("activation", GATED)
def test_kv_cache_equals_the_full_forward(activation):
    decoded_like_the_forward(swiglu_cfg(batch=1, seq_len=6, lengths=None, layers=2,
                                        activation=activation), 7, [3, 1, 4, 1, 5, 2])


# ---------------------------------------------------------------- the oracles


@pytest.mark.parametrize("activation", GATED)
def test_matches_the_torch_reference_at_random_parameters(activation):
    for fields in (dict(), dict(norm="post", layers=2, pe="rope"), dict(d_ff=5, dtype="float32")):
        rows = torch_reference_rows(swiglu_cfg(activation=activation, **fields), seed=8)
        assert any(r.name == "grad blocks.0.ffn.W_gate" for r in rows)
        if fields.get("dtype") != "float32":   # b_K's gradient, 0 but for rounding, aside
            assert max(r.rel for r in rows if not r.name.endswith("b_K")) < 1e-12


def test_ffn_matches_hugging_face_llama_mlp_with_its_biases():
    """One FFN sublayer against LlamaMLP (gate_proj, up_proj, down_proj; ``mlp_bias``): its
    output and every weight's and bias's gradient, from a random upstream gradient."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from transformers.models.llama.modeling_llama import LlamaMLP

    cfg = swiglu_cfg(d_ff=12)
    params = random_params(tfmcli.init_params(cfg), seed=9)
    rng = np.random.default_rng(10)
    x, dout = rng.normal(size=(2, 5, 8)), rng.normal(size=(2, 5, 8))
    mlp = LlamaMLP(transformers.LlamaConfig(hidden_size=8, intermediate_size=12,
                                            num_attention_heads=2, hidden_act="silu",
                                            mlp_bias=True)).double()
    p = "blocks.0.ffn."
    pairs = {"gate_proj": ("W_gate", "b_gate"), "up_proj": ("W_1", "b_1"),
             "down_proj": ("W_2", "b_2")}
    with torch.no_grad():
        for layer, (w, b) in pairs.items():
            getattr(mlp, layer).weight.copy_(torch.tensor(params[p + w].T))   # nn.Linear: (out, in)
            getattr(mlp, layer).bias.copy_(torch.tensor(params[p + b]))
    tx = torch.tensor(x, requires_grad=True)
    theirs = mlp(tx)
    theirs.backward(torch.tensor(dout))

    from tfmcli.engine.blocks import Tape, ffn, ffn_backward
    tape = Tape(params, cfg, {"fast": False})
    out = ffn(tape, x, "blocks.0.")
    dx = ffn_backward(tape, dout, "blocks.0.")
    grads = tape.grads
    assert_scaled_close(out, theirs.detach().numpy(), floor=1e-13)
    assert_scaled_close(dx, tx.grad.numpy(), floor=1e-13)
    for layer, (w, b) in pairs.items():
        np.testing.assert_allclose(grads[p + w], getattr(mlp, layer).weight.grad.numpy().T,
                                   rtol=0, atol=1e-12)
        np.testing.assert_allclose(grads[p + b], getattr(mlp, layer).bias.grad.numpy(),
                                   rtol=0, atol=1e-12)


def stablelm_from(params, cfg):
    """Hugging Face's StableLmForCausalLM (Pre-LN with LayerNorm, rotary attention with
    biased q, k, v, a SwiGLU MLP without biases, no head bias) holding tfm's parameters, in
    float64, its RoPE tables made in float64 (it makes them in float32, as GPT-NeoX does:
    tests/test_rope.py)."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    d, dh = cfg.d_model, cfg.d_head
    config = transformers.StableLmConfig(
        vocab_size=cfg.vocab, hidden_size=d, num_hidden_layers=cfg.layers,
        num_attention_heads=cfg.heads, num_key_value_heads=cfg.heads,
        intermediate_size=cfg.ff, hidden_act="silu", max_position_embeddings=64,
        layer_norm_eps=cfg.eps, use_qkv_bias=True, tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                         "partial_rotary_factor": 1.0})
    config._attn_implementation = "sdpa"   # torch's own kernel: the softmax stays in float64
    model = transformers.StableLmForCausalLM(config).double().eval()
    t = {name: torch.tensor(np.asarray(v, dtype=np.float64)) for name, v in params.items()}
    state = {"model.embed_tokens.weight": t["embed.W_E"], "lm_head.weight": t["head.W_U"].T,
             "model.norm.weight": t["ln_f.gamma"], "model.norm.bias": t["ln_f.beta"]}
    for i in range(cfg.layers):
        p, n = f"blocks.{i}.", f"model.layers.{i}."
        state.update(
            {
                n + "input_layernorm.weight": t[p + "ln1.gamma"],
                n + "input_layernorm.bias": t[p + "ln1.beta"],
                n + "post_attention_layernorm.weight": t[p + "ln2.gamma"],
                n + "post_attention_layernorm.bias": t[p + "ln2.beta"],
                n + "self_attn.o_proj.weight": t[p + "attn.W_O"].T,
                n + "mlp.gate_proj.weight": t[p + "ffn.W_gate"].T,
                n + "mlp.up_proj.weight": t[p + "ffn.W_1"].T,
                n + "mlp.down_proj.weight": t[p + "ffn.W_2"].T,
            }
        )
        for w, name in zip("QKV", ("q_proj", "k_proj", "v_proj")):
            state[n + f"self_attn.{name}.weight"] = t[p + f"attn.W_{w}"].T
            state[n + f"self_attn.{name}.bias"] = t[p + f"attn.b_{w}"]
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and all("rotary" in m for m in missing), missing
    float64_rotary(model.model.rotary_emb, dh)
    return model


def test_matches_hugging_face_stablelm_at_random_parameters():
    """The whole model: loss, logits and the gradients of the gate, the other FFN weights,
    the layer norms and the embedding, against StableLM's autograd, padding included. StableLM
    has no FFN, output-projection or head biases: those are set to 0 here (LlamaMLP's test
    above draws the FFN's)."""
    pytest.importorskip("torch")
    cfg = swiglu_cfg(layers=2, pe="rope", head_bias=False, d_ff=12)
    params = random_params(tfmcli.init_params(cfg), seed=11)
    for name in params:
        if name.endswith(("ffn.b_gate", "ffn.b_1", "ffn.b_2", "attn.b_O")):
            params[name] = np.zeros_like(params[name])
    model = stablelm_from(params, cfg)
    grads = tfm_grads_matching_hf(model, params, tfmcli.make_inputs(cfg), cfg)
    theirs = {"embed.W_E": model.model.embed_tokens.weight.grad}
    for i in range(cfg.layers):
        n, p = model.model.layers[i], f"blocks.{i}."
        theirs.update({p + "ffn.W_gate": n.mlp.gate_proj.weight.grad.T,
                       p + "ffn.W_1": n.mlp.up_proj.weight.grad.T,
                       p + "ffn.W_2": n.mlp.down_proj.weight.grad.T,
                       p + "attn.W_K": n.self_attn.k_proj.weight.grad.T,
                       p + "attn.b_K": n.self_attn.k_proj.bias.grad,
                       p + "ln2.gamma": n.post_attention_layernorm.weight.grad,
                       p + "ln2.beta": n.post_attention_layernorm.bias.grad})
    assert_grads_match(grads, {name: grad.numpy() for name, grad in theirs.items()})


# ---------------------------------------------------------------- the views


def test_ffn_view_lays_out_the_gate_and_checks_it():
    """tfm ffn --json under SwiGLU: the gate and dgate at that position are the run's own
    (ffn.gate and its gradient), silu'(gate) agrees with central differences, and dx, which
    takes the gate's path too, with central differences of the sublayer."""
    import json

    args = ("ffn", "--activation", "swiglu", "-d", 8, "--d-ff", 12, "-t", 2, "--row", 1)
    data = json.loads(ok(*args, "--json").stdout)
    cfg = swiglu_cfg(d_ff=12, seq_len=4, lengths=None)
    params, inputs = tfmcli.init_params(cfg), tfmcli.make_inputs(cfg)
    fwd = tfmcli.forward(params, inputs, cfg)
    grads = tfmcli.backward(params, fwd, cfg)
    assert_scaled_close(data["gate"], fwd.acts["blocks.0.ffn.gate"][1, 2], floor=1e-15)
    assert_scaled_close(data["dgate"], grads.acts["blocks.0.ffn.gate"][1, 2], floor=1e-17)
    gate, pre = np.array(data["gate"]), np.array(data["pre"])
    assert_scaled_close(data["hidden"], gate / (1 + np.exp(-gate)) * pre)
    assert data["forward_model_diff"] < 1e-14 and data["backward_model_diff"] < 1e-16
    assert data["slope_numeric_diff"] < 1e-8 and data["dx_numeric_diff"] < 1e-9
    text = ok(*args).stdout
    assert "dgate = dhidden * pre * silu'(gate)" in text
    assert "dx = dpre W_1^T + dgate W_gate^T" in text
    assert "activation     swiglu (silu(gate) * pre)" in text


@pytest.mark.parametrize("activation", GATED)
def test_block_view_adds_the_gate_path_to_the_ffn_input_gradient(activation):
    text = ok("block", "--activation", activation, "-t", 1).stdout
    assert "dpre W_1^T + dgate W_gate^T" in text
    assert "dpre W_1^T + dgate W_gate^T" not in ok("block", "-t", 1).stdout


@pytest.mark.parametrize("activation", GATED)
def test_torch_check_and_gradcheck_take_gated_ffns_from_the_command_line(activation):
    assert "W_gate" in ok("gradcheck", "--activation", activation).stdout
    pytest.importorskip("torch")
    assert "grad blocks.0.ffn.W_gate" in ok("check", "--against", "torch", "--activation",
                                            activation).stdout


def test_kv_step_flops_count_the_gate():
    """One token's step with a cache of one key is the full forward of one token."""
    from tfmcli.engine.kv import step_flops

    cfg = swiglu_cfg(batch=1, seq_len=1, lengths=None, layers=2, d_ff=10)
    assert step_flops(cfg, 1) == flops(cfg)[0]
    assert step_flops(cfg, 1) - step_flops(cfg.replace(activation="gelu"), 1) == 2 * 2 * 8 * 10
