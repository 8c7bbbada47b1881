"""A head width of its own (``head_dim``, ``--head-dim``: each head's queries, keys and values
``head_dim`` wide, not ``d_model / heads``; Qwen3's, Mistral Nemo's). Shapes and counts by hand;
the model at random O(1) parameters against central differences, its own reference path, the
torch reference and Hugging Face's LlamaForCausalLM and MistralForCausalLM; the KV cache; a
``save_pretrained`` folder; the command line.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

import tfmcli
from helpers import (
    assert_fast_equals_reference,
    assert_gradcheck_passes,
    assert_grads_match,
    assert_scaled_close,
    decoded_like_the_forward,
    error_line,
    llama_from,
    llama_grads,
    ok,
    random_params,
    run,
    tfm_grads_matching_hf,
    torch_reference_rows,
)
from tfmcli.engine.sizes import activation_shapes, flops, param_count, param_shapes
from tfmcli.errors import ConfigError
from tfmcli.sources import llama

LLAMA = dict(pe="rope", activation="swiglu", rms_norm=True, head_bias=False, bias=False)


def wide_cfg(**fields):
    """Heads 6 wide on a width of 16 with 4 heads (16 / 4 would be 4), keys grouped, a row
    padded."""
    base = dict(d_model=16, heads=4, kv_heads=2, head_dim=6, seq_len=6, lengths=(6, 4),
                d_ff=12, **LLAMA)
    return tfmcli.Config(**{**base, **fields})


# ---------------------------------------------------------------- shapes and counts


def test_the_shapes_follow_the_head_width():
    """d 8, H 3 (which does not divide 8), head_dim 4, one key head: W_Q (8, 12), W_K and W_V
    (8, 4), W_O (12, 8); q (B, 3, T, 4), the context (B, T, 12)."""
    cfg = tfmcli.Config(d_model=8, heads=3, head_dim=4, kv_heads=1, batch=2, seq_len=5)
    assert (cfg.d_head, cfg.d_q, cfg.d_kv) == (4, 12, 4)
    shapes = param_shapes(cfg)
    assert [shapes[f"blocks.0.attn.{n}"] for n in ("W_Q", "b_Q", "W_K", "b_K", "W_O", "b_O")] == [
        (8, 12), (12,), (8, 4), (4,), (12, 8), (8,)]
    acts = activation_shapes(cfg)
    assert acts["blocks.0.attn.q"] == (2, 3, 5, 4) and acts["blocks.0.attn.k"] == (2, 1, 5, 4)
    assert acts["blocks.0.attn.context"] == (2, 5, 12) and acts["blocks.0.attn.out"] == (2, 5, 8)
    fwd = tfmcli.forward(tfmcli.init_params(cfg), tfmcli.make_inputs(cfg), cfg)
    assert {name: a.shape for name, a in fwd.acts.items()} == dict(acts)
    # the products: Q and O 2 B T d d_q each, K and V 2 B T d d_kv, attention 4 B T^2 d_q,
    # the FFN 4 B T d d_ff, the head 2 B T d V
    B, T, d, F, V = 2, 5, 8, 32, 8
    assert flops(cfg)[0] == (2 * B * T * d * (2 * 12 + 2 * 4) + 4 * B * T * T * 12
                             + 4 * B * T * d * F + 2 * B * T * d * V)


def test_a_head_dim_of_d_over_h_is_the_model_without_one():
    cfg = wide_cfg(head_dim=None)
    same = cfg.replace(head_dim=4)
    params = random_params(tfmcli.init_params(cfg), seed=3)
    assert param_shapes(same) == param_shapes(cfg)
    inputs = tfmcli.make_inputs(cfg)
    assert tfmcli.forward(params, inputs, same).loss == tfmcli.forward(params, inputs, cfg).loss


@pytest.mark.parametrize("value, reason", [
    (0, "head_dim must be a positive integer, got 0"),
    (True, "head_dim must be a positive integer, got True"),
    (4.0, "head_dim must be a positive integer, got 4.0")])
def test_a_head_dim_must_be_a_positive_integer(value, reason):
    with pytest.raises(ConfigError, match=reason):
        tfmcli.Config(head_dim=value)


def test_heads_need_not_divide_the_width_only_with_a_head_dim():
    with pytest.raises(ConfigError, match="d_model=8 is not divisible by heads=3"):
        tfmcli.Config(d_model=8, heads=3)
    assert tfmcli.Config(d_model=8, heads=3, head_dim=2).d_q == 6


def test_mistral_nemo_and_qwen3_have_their_parameter_counts():
    """mistralai/Mistral-Nemo-Base-2407 (d 5120, 32 heads of 128) has 12,247,782,400
    parameters, the count Hugging Face's MistralForCausalLM gives its config; Qwen3-0.6B's
    sizes without its q and k norms, 596,049,920 less 28 x 2 x 128."""
    nemo = tfmcli.Config(d_model=5120, heads=32, kv_heads=8, head_dim=128, layers=40,
                         d_ff=14336, vocab=131072, **LLAMA)
    assert param_count(nemo) == 12_247_782_400
    qwen3 = tfmcli.Config(d_model=1024, heads=16, kv_heads=8, head_dim=128, layers=28,
                          d_ff=3072, vocab=151936, tied_head=True, **LLAMA)
    assert param_count(qwen3) == 596_049_920 - 28 * 2 * 128


# ---------------------------------------------------------------- the model


@pytest.mark.parametrize("fields", [
    dict(),
    dict(head_dim=2, norm="post", layers=2, kv_heads=None, tied_head=True),
    dict(d_model=10, heads=3, kv_heads=1, head_dim=5, pe="sinusoidal", activation="gelu",
         rms_norm=False, bias=True, head_bias=True),
], ids=["llama-wider", "post-narrower-L2", "layernorm-biases-odd"])
def test_gradients_match_central_differences_at_random_parameters(fields):
    assert_gradcheck_passes(wide_cfg(**fields))


@pytest.mark.parametrize("fields", [
    dict(batch=2, seq_len=300, lengths=(300, 150), d_model=32, head_dim=12),
    dict(batch=2, seq_len=256, lengths=None, d_model=64, heads=4, kv_heads=4, head_dim=24,
         dtype="float64", rms_norm=False, bias=True, pe="sinusoidal", activation="relu"),
], ids=["T300-padded", "threaded-512-rows"])
def test_the_fast_path_equals_the_reference(fields):
    cfg = wide_cfg(**fields)
    assert_fast_equals_reference(cfg, random_params(tfmcli.init_params(cfg), seed=2),
                                 tfmcli.make_inputs(cfg))


def test_matches_the_torch_reference_at_random_parameters():
    for fields in (dict(), dict(norm="post", head_dim=3, kv_heads=1), dict(dtype="float32"),
                   dict(d_model=10, heads=3, kv_heads=None, head_dim=4, pe="learned",
                        bias=True, rms_norm=False)):
        torch_reference_rows(wide_cfg(**fields), seed=11)


@pytest.mark.parametrize("mistral", [False, True], ids=["llama", "mistral"])
def test_matches_hugging_face(mistral):
    """LlamaForCausalLM and MistralForCausalLM with ``head_dim`` 6 on a width of 16 (4 heads),
    holding tfm's random parameters: loss, logits and every gradient, a padded row included."""
    pytest.importorskip("torch")
    cfg = wide_cfg(layers=2)
    params = random_params(tfmcli.init_params(cfg), seed=12)
    model = llama_from(params, cfg, mistral=mistral)
    assert model.model.layers[0].self_attn.q_proj.weight.shape == (24, 16)
    grads = tfm_grads_matching_hf(model, params, tfmcli.make_inputs(cfg), cfg)
    theirs = llama_grads(model)
    assert set(theirs) == set(params)
    assert_grads_match(grads, theirs)


def test_the_kv_cache_equals_the_forward():
    """Decoding with heads 6 wide: every step's logits are the full forward's, the cache is
    (H_kv, step + 1, 6) and a step's attention costs 4 d_q FLOPs a cached key per block."""
    cfg = wide_cfg(seq_len=7, lengths=None, batch=1, vocab=10, layers=2)
    _, steps, _ = decoded_like_the_forward(cfg, 6, [3, 1, 4, 1, 5, 9, 2])
    assert [s.cache_shape for s in steps] == [(2, t + 1, 6) for t in range(7)]
    step_flops = tfmcli.engine.kv.step_flops
    assert step_flops(cfg, 5) - step_flops(cfg, 4) == 2 * 4 * 24


def test_the_explained_head_is_head_dim_wide():
    from tfmcli.explain import steps

    cfg = wide_cfg(batch=1, lengths=None)
    params = random_params(tfmcli.init_params(cfg), seed=1)
    fwd = tfmcli.forward(params, tfmcli.make_inputs(cfg), cfg)
    shown = {s.name: s.value for s in steps.model_head_steps(params, fwd, cfg, 0, 3, 0)}
    assert shown["Q"].shape == (6, 6) and shown["context"].shape == (6, 6)
    assert_scaled_close(shown["Q_rot"], fwd.acts["blocks.0.attn.q_rot"][0, 3], floor=1e-13)
    assert_scaled_close(shown["context"], fwd.acts["blocks.0.attn.context"][0, :, 18:], floor=1e-13)


def test_a_file_without_its_config_is_read_with_its_head_width(tmp_path):
    """An npz of parameters alone: W_Q 24 wide on a width of 16 is 4 heads of 6 for -H 4, and
    W_K 12 wide then 2 key heads; with -H 3 the same W_Q is 3 heads of 8 (another model), whose
    keys, 12 wide, are not a whole number of heads."""
    cfg = wide_cfg(lengths=None, pe="sinusoidal", rms_norm=False)
    params = random_params(tfmcli.init_params(cfg), seed=8)
    path = tmp_path / "bare.npz"
    np.savez(path, **{"param/" + name: value for name, value in params.items()})
    data = json.loads(ok("forward", "--load", path, "-H", 4, "-T", 6, "--json").stdout)
    assert (data["config"]["head_dim"], data["config"]["kv_heads"]) == (6, 2)
    fwd = tfmcli.forward(params, tfmcli.make_inputs(cfg), cfg)
    assert data["loss"] == pytest.approx(fwd.loss, rel=1e-12)
    assert "param/blocks.0.attn.W_K has shape (16, 12), expected (16, 24)" in error_line(
        run("forward", "--load", path, "-H", 3, "-T", 6), 1)


# ---------------------------------------------------------------- a checkpoint folder


def test_a_llama_folder_with_a_head_dim_is_read(tmp_path):
    """A LlamaForCausalLM with ``head_dim`` 6 on a width of 16, saved by ``save_pretrained``:
    read to the bit, with the Config's head_dim 6; one of head_dim 4 (16 / 4) reads as none."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    config = dict(vocab_size=40, hidden_size=16, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, intermediate_size=24, max_position_embeddings=32)
    for head_dim, folder in ((6, tmp_path / "wide"), (4, tmp_path / "plain")):
        torch.manual_seed(0)
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**config,
                                                                       head_dim=head_dim))
        with torch.no_grad():
            for p in model.parameters():
                p.normal_(0.0, 0.5)
        model.save_pretrained(folder)
        fields, params = llama.load_checkpoint(folder, np.float64)
        assert fields["head_dim"] == (6 if head_dim == 6 else None)
        assert params["blocks.1.attn.W_O"].shape == (4 * head_dim, 16)
        state = model.state_dict()
        for key, name, transposed in llama.name_map(fields):
            want = state[key].double().numpy()
            np.testing.assert_array_equal(params[name], want.T if transposed else want,
                                          err_msg=key)
    out = json.loads(ok("forward", "--load", tmp_path / "wide", "--tokens", "1,2,3",
                        "--json").stdout)
    assert out["config"]["head_dim"] == 6


# ---------------------------------------------------------------- the command line


def test_the_command_line_takes_a_head_dim():
    text = ok("shapes", "-d", 8, "-H", 3, "--head-dim", 4).stdout
    assert "d_head=4" in text
    assert [line.split()[1:] for line in text.splitlines()
            if line.startswith("blocks.0.attn.W_")] == [["(8,", "12)", "96"], ["(8,", "12)", "96"],
                                                        ["(8,", "12)", "96"], ["(12,", "8)", "96"]]
    out = json.loads(ok("forward", "-d", 8, "-H", 3, "--head-dim", 4, "--json").stdout)
    assert out["config"]["head_dim"] == 4 and np.isfinite(out["loss"])
    out = json.loads(ok("train", "--steps", 3, "--head-dim", 8, "--json").stdout)
    assert out["config"]["head_dim"] == 8
    assert error_line(run("forward", "-d", 8, "-H", 3), 2).startswith(
        "tfm forward: error: Invalid value for '--heads': d_model=8 is not divisible by heads=3")
    assert error_line(run("forward", "--head-dim", 0), 2) == (
        "tfm forward: error: Invalid value for '--head-dim': 0 is not allowed (allowed: 1 or "
        "more)")
