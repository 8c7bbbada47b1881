"""Grouped-query attention (``kv_heads``): fewer heads of keys and values, each serving a group
of query heads. The sharing and its backward (a shared head's gradient sums its query heads'),
the model at random O(1) parameters against central differences, the torch reference and
Hugging Face's LLaMA with ``num_key_value_heads``; the fast path, the KV cache (which shrinks
by H / H_kv), FLOPs and memory; ``tfm attn`` and ``tfm kv`` with it.
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
from tfmcli.engine import ops
from tfmcli.engine.kv import step_flops
from tfmcli.engine.sizes import activation_shapes, flops, memory_estimate, param_shapes
from tfmcli.errors import ConfigError


def gqa_cfg(**fields):
    base = dict(d_model=8, heads=4, kv_heads=2, seq_len=5, lengths=(5, 3))
    return tfmcli.Config(**{**base, **fields})


# ---------------------------------------------------------------- the config


def test_keys_and_values_are_narrower_and_the_queries_are_not():
    cfg = gqa_cfg(pe="rope")
    assert (cfg.h_kv, cfg.group, cfg.d_kv) == (2, 2, 4)
    shapes = param_shapes(cfg)
    assert shapes["blocks.0.attn.W_Q"] == shapes["blocks.0.attn.W_O"] == (8, 8)
    assert shapes["blocks.0.attn.W_K"] == shapes["blocks.0.attn.W_V"] == (8, 4)
    assert shapes["blocks.0.attn.b_K"] == shapes["blocks.0.attn.b_V"] == (4,)
    acts = activation_shapes(cfg)
    assert acts["blocks.0.attn.q"] == acts["blocks.0.attn.q_rot"] == (2, 4, 5, 2)
    assert acts["blocks.0.attn.k"] == acts["blocks.0.attn.k_rot"] == (2, 2, 5, 2)
    assert acts["blocks.0.attn.v"] == (2, 2, 5, 2)
    assert acts["blocks.0.attn.pattern"] == (2, 4, 5, 5)   # every query head its own map
    # multi-query: one head of keys for all
    assert param_shapes(gqa_cfg(kv_heads=1))["blocks.0.attn.W_K"] == (8, 2)


def test_kv_heads_must_divide_heads():
    with pytest.raises(ConfigError, match=r"kv_heads=3 does not divide heads=4; allowed "
                                          r"kv_heads: 1, 2, 4"):
        gqa_cfg(kv_heads=3)
    with pytest.raises(ConfigError, match="kv_heads must be a positive integer"):
        gqa_cfg(kv_heads=0)
    result = run("forward", "-d", 8, "-H", 4, "--kv-heads", 3)
    assert "'--kv-heads': kv_heads=3 does not divide heads=4" in error_line(result, 2)


def test_as_many_kv_heads_as_heads_is_the_ungrouped_model_bit_for_bit():
    cfg = gqa_cfg(kv_heads=None, pe="rope")
    same = cfg.replace(kv_heads=4)
    params, inputs = tfmcli.init_params(cfg), tfmcli.make_inputs(cfg)
    assert all(np.array_equal(a, b) for a, b in zip(params.values(),
                                                     tfmcli.init_params(same).values()))
    one, two = tfmcli.forward(params, inputs, cfg), tfmcli.forward(params, inputs, same)
    assert one.loss == two.loss
    g1, g2 = tfmcli.backward(params, one, cfg), tfmcli.backward(params, two, same)
    assert all(np.array_equal(g1[name], g2[name]) for name in params)


# ---------------------------------------------------------------- the sharing


def test_each_key_head_serves_its_group_of_query_heads_in_turn():
    k = np.arange(2 * 3 * 1 * 2, dtype=float).reshape(2, 3, 1, 2)   # (B, H_kv 3, T, d_head)
    out = ops.repeat_kv(k, 2)                                       # (B, 6, T, d_head)
    assert out.shape == (2, 6, 1, 2)
    for h in range(6):   # query head h reads key head h // 2 (Hugging Face's repeat_kv)
        np.testing.assert_array_equal(out[:, h], k[:, h // 2])


def test_a_shared_heads_gradient_is_the_sum_of_its_query_heads():
    """repeat_kv_backward is repeat_kv's adjoint: <repeat(x), g> = <x, repeat_backward(g)>."""
    rng = np.random.default_rng(0)
    x, g = rng.normal(size=(2, 3, 4, 5)), rng.normal(size=(2, 6, 4, 5))
    back = ops.repeat_kv_backward(g, 2)
    assert back.shape == x.shape
    assert float((ops.repeat_kv(x, 2) * g).sum()) == pytest.approx(float((x * back).sum()),
                                                                   rel=1e-13)
    assert_scaled_close(back[:, 1], g[:, 2] + g[:, 3])


# ---------------------------------------------------------------- the model


@pytest.mark.parametrize("fields", [dict(), dict(kv_heads=1, norm="post", layers=2),
                                    dict(pe="rope", rms_norm=True, activation="swiglu"),
                                    dict(heads=6, kv_heads=3, d_model=12, causal=False)],
                         ids=["gqa-pre", "mqa-post-L2", "llama-like", "H6-kv3-bidirectional"])
def test_gradients_match_central_differences_at_random_parameters(fields):
    assert_gradcheck_passes(gqa_cfg(**fields))


def test_fast_path_equals_the_reference():
    cfg = gqa_cfg(batch=3, seq_len=9, lengths=(9, 4, 7), d_model=12, heads=6, kv_heads=2,
                  layers=2, pe="rope")
    params = random_params(tfmcli.init_params(cfg), seed=6)
    assert_fast_equals_reference(cfg, params, tfmcli.make_inputs(cfg))


def test_matches_the_torch_reference_at_random_parameters():
    for fields in (dict(), dict(kv_heads=1, norm="post", layers=2, pe="rope"),
                   dict(dtype="float32", rms_norm=True)):
        rows = torch_reference_rows(gqa_cfg(**fields), seed=9)
        assert any(r.name == "grad blocks.0.attn.W_K" for r in rows)
        if fields.get("dtype") != "float32":   # b_K's gradient, 0 but for rounding, aside
            assert max(r.rel for r in rows if not r.name.endswith("b_K")) < 1e-12


def test_matches_hugging_face_llama_with_fewer_key_value_heads():
    """LLaMA 2/3's block: LlamaForCausalLM with num_key_value_heads 2 of 4 heads (RMSNorm,
    rotary attention, SwiGLU, every bias on): loss, logits and every parameter's gradient, W_K's
    and W_V's summed over the query heads they serve, at random parameters, padding included."""
    pytest.importorskip("torch")
    cfg = gqa_cfg(layers=2, pe="rope", activation="swiglu", rms_norm=True, head_bias=False,
                  d_ff=12)
    params = random_params(tfmcli.init_params(cfg), seed=11)
    model = llama_from(params, cfg)
    assert model.model.layers[0].self_attn.k_proj.weight.shape == (4, 8)   # theirs is grouped
    grads = tfm_grads_matching_hf(model, params, tfmcli.make_inputs(cfg), cfg)
    theirs = llama_grads(model)
    assert set(theirs) == set(params)
    assert_grads_match(grads, theirs)


def test_kv_cache_holds_the_fewer_heads_and_equals_the_full_forward():
    cfg = gqa_cfg(batch=1, seq_len=6, lengths=None, layers=2, pe="rope")
    _, steps, fwd = decoded_like_the_forward(cfg, 7, [3, 1, 4, 1, 5, 2])
    assert steps[-1].cache_shape == (2, 6, 2)   # H_kv heads, not H
    for (block, head), weights in steps[-1].attention.items():
        np.testing.assert_allclose(weights, fwd.acts[f"blocks.{block}.attn.pattern"][0, head, -1],
                                   rtol=0, atol=1e-12)


def test_flops_and_memory_count_the_narrower_keys_and_values():
    grouped = gqa_cfg(kv_heads=1, batch=2, seq_len=16, lengths=None, layers=3)
    full = grouped.replace(kv_heads=None)
    B, T, d, L = 2, 16, 8, 3
    # W_K and W_V are d x 2 instead of d x 8: 2 B T d (8 - 2) multiply-adds fewer each, a block
    assert flops(full)[0] - flops(grouped)[0] == L * 2 * 2 * B * T * d * (8 - 2)
    assert step_flops(full, 5) - step_flops(grouped, 5) == L * 2 * 2 * d * (8 - 2)
    saved = memory_estimate(full)["params"] - memory_estimate(grouped)["params"]
    assert saved == L * 2 * (d * 6 + 6) * 8   # W_K, W_V and their biases, in float64


def test_a_file_without_its_config_is_read_as_grouped(tmp_path):
    """An npz of parameters alone: W_K narrower than d means kv_heads, for the heads given."""
    cfg = gqa_cfg(lengths=None)
    params = random_params(tfmcli.init_params(cfg), seed=8)
    path = tmp_path / "bare.npz"
    np.savez(path, **{"param/" + name: value for name, value in params.items()})
    data = json.loads(ok("forward", "--load", path, "-H", 4, "-T", 5, "--json").stdout)
    assert data["config"]["kv_heads"] == 2
    fwd = tfmcli.forward(params, tfmcli.make_inputs(cfg.replace(batch=2)), cfg)
    assert data["loss"] == pytest.approx(fwd.loss, rel=1e-12)
    # heads are not in the shapes: with 2 the same keys are one head of width 4 (another model)
    data = json.loads(ok("forward", "--load", path, "-H", 2, "-T", 5, "--json").stdout)
    assert data["config"]["kv_heads"] == 1 and data["loss"] != pytest.approx(fwd.loss)
    # one head of width 8 cannot be read from keys 4 wide
    assert "param/blocks.0.attn.W_K has shape (8, 4), expected (8, 8)" in error_line(
        run("forward", "--load", path, "-H", 1, "-T", 5), 1)


# ---------------------------------------------------------------- the views


def test_attn_view_reads_the_shared_key_head_and_sums_its_gradient():
    args = ["-d", 8, "-H", 4, "--kv-heads", 2, "--pe", "rope", "-T", 5]
    data = json.loads(ok("attn", *args, "--head", 3, "--backward", "--json").stdout)
    steps = {s["name"]: np.array(s["value"]) for s in data["steps"]}
    model = json.loads(ok("forward", *args, "--json", "--show", "blocks.0.attn.k").stdout)
    k = np.array(model["show"]["blocks.0.attn.k"]["values"])[0, 1]   # serves heads 2 and 3
    np.testing.assert_allclose(steps["K"], k, rtol=1e-12)
    # dK of one query head is its share; summed over heads 2 and 3 it is the model's own
    assert data["backward_model_diff"] < 1e-12
    text = " ".join(ok("attn", *args, "--head", 3, "--backward").stdout.split())
    assert "K = X W_K + b_K (key head 1, shared by query heads 2..3)" in text
    assert ("dV, dK_rot and dK are head 3's share: key head 1's gradients are the sums over "
            "query heads 2..3") in text
    one = " ".join(ok("attn", *args, "--head", 3, "--query", 2).stdout.split())
    assert "2. each visible key k = a row of K of key head 1, shared by query heads 2..3" in one


def test_kv_view_shows_the_smaller_cache():
    args = ["--tokens", "3,1,4,1,5", "-d", 8, "-H", 4, "-L", 2]
    grouped = json.loads(ok("kv", *args, "--kv-heads", 1, "--json").stdout)
    full = json.loads(ok("kv", *args, "--json").stdout)
    assert grouped["steps"][-1]["cache_shape"] == [1, 5, 2]
    assert full["steps"][-1]["cache_shape"] == [4, 5, 2]
    assert grouped["max_abs_diff"] < 1e-12
    assert grouped["flops"]["with_cache"] < full["flops"]["with_cache"]
    # K and V of 2 blocks, H_kv heads, 5 positions of d_head 2: 4 times fewer numbers
    assert (grouped["cache_numbers"], full["cache_numbers"]) == (2 * 2 * 1 * 5 * 2,
                                                                 2 * 2 * 4 * 5 * 2)
    text = ok("kv", *args, "--kv-heads", 1, "--pe", "rope").stdout
    assert "K, V cache after 5 steps: 2 x 2 blocks x (1, 5, 2) = 40 numbers (320 B)" in text
    assert ("grouped: 1 key and value head for 4 query heads, 4x smaller than ungrouped"
            in text)
    assert "RoPE: each key is cached turned at its own position, and never turned again" in text

def test_train_learns_with_one_key_head_and_saves_it(tmp_path):
    path = tmp_path / "mqa.npz"
    ok("train", "--kv-heads", 1, "--steps", 2, "--save", path)
    with np.load(path) as saved:
        assert saved["param/blocks.0.attn.W_K"].shape == (32, 16)   # d 32, one head of 16
        assert json.loads(str(saved["config"]))["kv_heads"] == 1
