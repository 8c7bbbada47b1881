"""RoPE (``pe="rope"``): the rotation, its backward, and the model with it, against central
differences, the torch reference, and Hugging Face's own GPT-NeoX (rotary attention, Pre-LN,
tanh GELU), at random O(1) parameters; the fast path against the reference, the KV cache
against the full forward, and the property RoPE exists for: a score depends on the offset
between query and key, not on where the pair sits.
"""

from __future__ import annotations

import numpy as np
import pytest

import tfmcli
from helpers import (
    assert_gradcheck_passes,
    assert_scaled_close,
    decoded_like_the_forward,
    error_line,
    neox_from,
    ok,
    random_params,
    run,
    tfm_grads_matching_hf,
    torch_reference_rows,
)
from tfmcli.engine import ops
from tfmcli.engine.positional import rope_angles, rope_tables
from tfmcli.engine.sizes import activation_shapes, memory_estimate


def rope_cfg(**fields):
    base = dict(d_model=8, heads=2, pe="rope", seq_len=5, lengths=(5, 3))
    return tfmcli.Config(**{**base, **fields})


# ---------------------------------------------------------------- the rotation alone


def test_tables_hold_the_angles_of_each_pair():
    """Pair i is the dimensions (i, i + d_head/2), at angle t / 10000^(2i/d_head)."""
    cos, sin = rope_tables(6, 8)
    angle = np.arange(6)[:, None] / 10000.0 ** (np.arange(4) / 4)   # 2i/8 = i/4
    assert_scaled_close(cos[:, :4], np.cos(angle), floor=1e-15)
    assert_scaled_close(cos[:, 4:], np.cos(angle), floor=1e-15)
    assert_scaled_close(sin[:, 4:], np.sin(angle), floor=1e-15)
    assert rope_angles(6, 8)[5, 1] == pytest.approx(5 / 10000 ** 0.25, rel=1e-15)


def test_an_odd_head_leaves_its_last_dimension_unrotated():
    """d_head 3: one pair (0, 1) at angle t (2i/n with n = 2 rotated dimensions), dimension
    2 passed as it is."""
    cos, sin = rope_tables(4, 3)
    np.testing.assert_array_equal(cos[:, 2], 1.0)
    np.testing.assert_array_equal(sin[:, 2], 0.0)
    assert_scaled_close(sin[:, 0], np.sin(np.arange(4.0)), floor=1e-15)
    x = np.random.default_rng(0).normal(size=(1, 1, 4, 3))
    out = ops.rope_forward(x, cos, sin)
    np.testing.assert_array_equal(out[..., 2], x[..., 2])


def test_the_rotation_keeps_lengths_and_turns_each_pair_by_its_angle():
    rng = np.random.default_rng(1)
    x = rng.normal(size=(2, 3, 7, 8))
    cos, sin = rope_tables(7, 8)
    out = ops.rope_forward(x, cos, sin)
    assert_scaled_close(np.linalg.norm(out, axis=-1), np.linalg.norm(x, axis=-1))
    # pair 1 of position 3, as a complex number, turned by exp(i * angle)
    angle = rope_angles(7, 8)[3, 1]
    z = (x[0, 0, 3, 1] + 1j * x[0, 0, 3, 5]) * np.exp(1j * angle)
    assert out[0, 0, 3, 1] == pytest.approx(z.real, abs=1e-14)
    assert out[0, 0, 3, 5] == pytest.approx(z.imag, abs=1e-14)


@pytest.mark.parametrize("d_head", [8, 5])
def test_the_backward_is_the_transpose_against_central_differences(d_head):
    """d <dout, rope(x)> / dx, entry by entry, against rope_backward(dout) (a random upstream
    gradient)."""
    rng = np.random.default_rng(2)
    x, dout = rng.normal(size=(2, 4, d_head)), rng.normal(size=(2, 4, d_head))
    cos, sin = rope_tables(4, d_head)
    analytic = ops.rope_backward(dout, cos, sin)
    numeric = np.zeros_like(x)
    h = 1e-6
    for idx in np.ndindex(x.shape):
        up, down = x.copy(), x.copy()
        up[idx] += h
        down[idx] -= h
        numeric[idx] = ((dout * ops.rope_forward(up, cos, sin)).sum()
                        - (dout * ops.rope_forward(down, cos, sin)).sum()) / (2 * h)
    np.testing.assert_allclose(analytic, numeric, rtol=0, atol=1e-8)
    assert np.abs(analytic - dout).max() > 0.1   # the turn back is not the identity


def test_a_score_depends_only_on_the_offset():
    """RoPE's point: q at t against k at s scores the same as at t + n against s + n."""
    rng = np.random.default_rng(3)
    q, k = rng.normal(size=8), rng.normal(size=8)
    cos, sin = rope_tables(12, 8)

    def score(t, s):
        return ops.rope_forward(q, cos[t], sin[t]) @ ops.rope_forward(k, cos[s], sin[s])

    for t, s in [(3, 1), (5, 5), (2, 7)]:
        assert score(t + 4, s + 4) == pytest.approx(score(t, s), rel=1e-12)
    assert abs(score(3, 1) - score(3, 2)) > 1e-3   # and it does depend on the offset


# ---------------------------------------------------------------- the model with RoPE


def test_the_trace_names_the_turned_queries_and_keys():
    cfg = rope_cfg()
    shapes = activation_shapes(cfg)
    names = list(shapes)
    assert "pe" not in names   # nothing is added to the embedding
    i = names.index("blocks.0.attn.v")
    assert names[i + 1:i + 3] == ["blocks.0.attn.q_rot", "blocks.0.attn.k_rot"]
    fwd = tfmcli.forward(tfmcli.init_params(cfg), tfmcli.make_inputs(cfg), cfg)
    assert list(fwd.acts) == names
    assert fwd.acts["blocks.0.attn.q_rot"].shape == (2, 2, 5, 4)
    cos, sin = rope_tables(5, 4)
    assert_scaled_close(fwd.acts["blocks.0.attn.k_rot"],
                        ops.rope_forward(fwd.acts["blocks.0.attn.k"], cos, sin))
    # position 0 is not turned at all
    np.testing.assert_array_equal(fwd.acts["blocks.0.attn.q_rot"][:, :, 0],
                                  fwd.acts["blocks.0.attn.q"][:, :, 0])


@pytest.mark.parametrize("fields", [dict(), dict(norm="post", activation="gelu", layers=2),
                                    dict(d_model=6, heads=2), dict(tied_head=True, causal=False)],
                         ids=["pre", "post-gelu-L2", "odd-d_head", "tied-noncausal"])
def test_gradients_match_central_differences_at_random_parameters(fields):
    assert_gradcheck_passes(rope_cfg(**fields))


def test_b_K_has_a_gradient_under_rope():
    """Without RoPE d loss / d b_K is 0 (q·b_K shifts a row of scores); key s's bias turned by
    s's angles is a different number for each key, so under RoPE it is not."""
    cfg = rope_cfg()
    params = random_params(tfmcli.init_params(cfg), seed=5)
    inputs = tfmcli.make_inputs(cfg)
    rope = tfmcli.backward(params, tfmcli.forward(params, inputs, cfg), cfg)
    plain_cfg = cfg.replace(pe="none")
    plain = tfmcli.backward(params, tfmcli.forward(params, inputs, plain_cfg), plain_cfg)
    assert np.abs(rope["blocks.0.attn.b_K"]).max() > 1e-3
    assert np.abs(plain["blocks.0.attn.b_K"]).max() < 1e-15


def test_fast_path_equals_the_reference():
    cfg = rope_cfg(batch=3, seq_len=9, lengths=(9, 4, 7), d_model=12, heads=2, layers=2)
    params = random_params(tfmcli.init_params(cfg), seed=6)
    inputs = tfmcli.make_inputs(cfg)
    fast = tfmcli.forward(params, inputs, cfg)
    slow = tfmcli.forward(params, inputs, cfg, fast=False)
    assert fast.loss == pytest.approx(slow.loss, rel=1e-12)
    g_fast, g_slow = tfmcli.backward(params, fast, cfg), tfmcli.backward(params, slow, cfg)
    for name in params:
        scale = np.abs(g_slow[name]).max()
        assert np.abs(g_fast[name] - g_slow[name]).max() <= 1e-12 * scale, name
    for name in ("blocks.1.attn.q_rot", "blocks.1.attn.k"):
        np.testing.assert_allclose(g_fast.acts[name], g_slow.acts[name], rtol=0,
                                   atol=1e-12 * np.abs(g_slow.acts[name]).max())


def test_kv_cache_equals_the_full_forward():
    """A cached key keeps the turn of its own position; each step's logits equal the full
    causal forward's at that position."""
    cfg = rope_cfg(batch=1, seq_len=6, lengths=None, layers=2)
    _, steps, _ = decoded_like_the_forward(cfg, 7, [3, 1, 4, 1, 5, 2])
    logits = np.array([s.logits for s in steps])
    # the same ids at other positions give other logits: the positions count
    assert np.abs(logits[1] - logits[3]).max() > 1e-3


def test_memory_estimate_counts_the_turned_arrays():
    """q_rot and k_rot a block and their gradients; the tables with the caches (the measured
    peak: tests/test_memory.py's rope configs)."""
    cfg = rope_cfg(batch=2, seq_len=64, lengths=None, d_model=64, heads=4)
    rope, plain = memory_estimate(cfg), memory_estimate(cfg.replace(pe="none"))
    btd = 2 * 64 * 64 * 8
    assert rope["activations"] - plain["activations"] == 2 * btd
    assert rope["activation grads"] - plain["activation grads"] == 2 * btd
    assert rope["caches"] - plain["caches"] == 2 * 64 * 16 * 8


# ---------------------------------------------------------------- the oracles


def test_matches_the_torch_reference_at_random_parameters():
    for fields in (dict(), dict(norm="post", layers=2, activation="gelu"), dict(d_model=6)):
        rows = torch_reference_rows(rope_cfg(**fields), seed=8)
        assert max(r.rel for r in rows) < 1e-12


@pytest.mark.parametrize("d_model, heads", [(8, 2), (12, 2)], ids=["d_head-4", "d_head-6"])
def test_matches_hugging_face_gpt_neox_at_random_parameters(d_model, heads):
    """Loss, logits and the gradients of the rotated projections (and every other weight)
    against GPT-NeoX's autograd, padding included."""
    pytest.importorskip("torch")
    cfg = rope_cfg(d_model=d_model, heads=heads, layers=2, activation="gelu", head_bias=False)
    params = random_params(tfmcli.init_params(cfg), seed=9)
    neox = neox_from(params, cfg, cfg.d_head)
    grads = tfm_grads_matching_hf(neox, params, tfmcli.make_inputs(cfg), cfg)
    layer = neox.gpt_neox.layers[1].attention.query_key_value
    H, dh, d = cfg.heads, cfg.d_head, cfg.d_model
    dW = layer.weight.grad.reshape(H, 3, dh, d).numpy()
    db = layer.bias.grad.reshape(H, 3, dh).numpy()
    for j, w in enumerate("QKV"):
        theirs = dW[:, j].reshape(d, d).T
        np.testing.assert_allclose(grads[f"blocks.1.attn.W_{w}"], theirs, rtol=0,
                                   atol=1e-12 * np.abs(theirs).max())
        np.testing.assert_allclose(grads[f"blocks.1.attn.b_{w}"], db[:, j].reshape(d), rtol=0,
                                   atol=1e-12 * np.abs(db).max())
    emb = neox.gpt_neox.embed_in.weight.grad.numpy()
    np.testing.assert_allclose(grads["embed.W_E"], emb, rtol=0, atol=1e-12 * np.abs(emb).max())


def test_an_odd_head_matches_gpt_neox_partial_rotation():
    """d_head 5: tfm turns 4 dimensions and leaves the fifth, as GPT-NeoX with rotary_pct 4/5
    (its angles over the 4 rotated dimensions, as tfm's)."""
    torch = pytest.importorskip("torch")
    cfg = rope_cfg(d_model=10, heads=2, lengths=None, activation="gelu", head_bias=False)
    params = random_params(tfmcli.init_params(cfg), seed=10)
    inputs = tfmcli.make_inputs(cfg)
    fwd = tfmcli.forward(params, inputs, cfg)
    neox = neox_from(params, cfg, 4)
    logits = neox(input_ids=torch.as_tensor(inputs.tokens)).logits.detach().numpy()
    np.testing.assert_allclose(fwd.acts["logits"], logits, rtol=0, atol=1e-12)


# ---------------------------------------------------------------- the command line


def test_pe_rope_runs_from_the_command_line_and_says_so():
    result = ok("forward", "--pe", "rope", "-d", "8")
    assert "rope" in result.stdout
    assert "blocks.0.attn.q_rot" in result.stdout and "\npe " not in result.stdout
    result = ok("backward", "--pe", "rope", "-d", "8")
    assert "not 0 under RoPE" in result.stdout
    assert "rounding noise" not in result.stdout.split("b_K:")[1]


def test_block_under_rope_says_its_dq_and_dk_are_turned_back():
    """tfm block's via q and via k take the gradients of q and k before the turn (the property
    tests check the paths on RoPE configs); the view says so, and only under RoPE."""
    assert "gradients of q and k before their turn" in ok("block", "--pe", "rope").stdout
    assert "RoPE" not in ok("block").stdout


def test_n_ctx_is_still_only_for_learned_positions():
    line = error_line(run("forward", "--pe", "rope", "--n-ctx", "8"), 2)
    assert "--n-ctx" in line and "learned" in line


# ---------------------------------------------------------------- the views


def rope_run(**fields):
    cfg = rope_cfg(**fields)
    params = random_params(tfmcli.init_params(cfg), seed=11)
    inputs = tfmcli.make_inputs(cfg)
    fwd = tfmcli.forward(params, inputs, cfg)
    return cfg, params, fwd, tfmcli.backward(params, fwd, cfg)


def test_attn_steps_turn_q_and_k_and_match_the_model():
    """tfm attn's steps recompute the head from its input: Q_rot and K_rot between V and the
    scores, the softmax the model's pattern; backward, dQ_rot and dK_rot, then the turn back
    to the gradients of Q and K."""
    from tfmcli.explain.steps import model_head_backward_steps, model_head_steps

    cfg, params, fwd, grads = rope_run()
    steps = {s.name: s.value for s in model_head_steps(params, fwd, cfg, 0, 1, 1)}
    assert list(steps)[3:6] == ["V", "Q_rot", "K_rot"]
    np.testing.assert_allclose(steps["Q_rot"], fwd.acts["blocks.0.attn.q_rot"][1, 1], atol=1e-14)
    np.testing.assert_allclose(
        steps["softmax"], fwd.acts["blocks.0.attn.pattern"][1, 1], atol=1e-14
    )
    back = {s.name: s.value for s in model_head_backward_steps(
        fwd, grads.acts["blocks.0.attn.context"], cfg, 0, 1, 1)}
    assert list(back)[-4:] == ["dQ_rot", "dK_rot", "dQ", "dK"]
    for step, act in (("dQ_rot", "q_rot"), ("dK_rot", "k_rot"), ("dQ", "q"), ("dK", "k")):
        own = grads.acts[f"blocks.0.attn.{act}"][1, 1]
        assert_scaled_close(back[step], own, floor=1e-15)
        assert np.abs(own).max() > 1e-4, act
    assert np.abs(back["dQ"] - back["dQ_rot"]).max() > 1e-4   # the turn back did something


def test_attn_query_under_rope_scores_the_turned_vectors():
    from tfmcli.explain.steps import explain_query, explain_query_backward

    cfg, params, fwd, grads = rope_run()
    x = explain_query(fwd, cfg, 0, 0, 0, 3)
    np.testing.assert_array_equal(x.q, fwd.acts["blocks.0.attn.q_rot"][0, 0, 3])
    context = fwd.acts["blocks.0.attn.context"][0, 3, :cfg.d_head]
    assert_scaled_close(x.context, context, floor=1e-15)
    xb = explain_query_backward(fwd, grads.acts["blocks.0.attn.context"], cfg, 0, 0, 0, 3)
    np.testing.assert_allclose(xb.dq, grads.acts["blocks.0.attn.q_rot"][0, 0, 3], atol=1e-16)
    assert_scaled_close(xb.dq_turned_back, grads.acts["blocks.0.attn.q"][0, 0, 3], floor=1e-16)
    assert np.abs(xb.dq_turned_back - xb.dq).max() > 1e-5
    plain_cfg = cfg.replace(pe="none")
    plain = tfmcli.forward(params, fwd.inputs, plain_cfg)
    plain_grads = tfmcli.backward(params, plain, plain_cfg)
    assert explain_query_backward(plain, plain_grads.acts["blocks.0.attn.context"], plain_cfg,
                                  0, 0, 0, 3).dq_turned_back is None


def test_attn_query_json_checks_the_turn_back_against_the_model():
    import json

    out = json.loads(ok("attn", "--pe", "rope", "-d", "8", "--query", "3", "--backward",
                        "--json").stdout)["backward"]
    assert len(out["dq_turned_back"]) == 4
    assert out["dq_turned_back_model_diff"] < 1e-15 and out["dq_model_diff"] < 1e-15
    assert out["dq_turned_back"] != out["dq"]
    text = ok("attn", "--pe", "rope", "-d", "8", "--query", "3", "--backward").stdout
    assert "(attn.q_rot) by" in text and "8b. RoPE's turn back at position 3" in text


def test_embed_under_rope_adds_nothing_at_the_embedding():
    import json

    out = json.loads(ok("embed", "--pe", "rope", "--position", "2", "--json").stdout)
    assert out["pe"] is None and out["x0"] == out["w_e"]
    text = ok("embed", "--pe", "rope").stdout
    assert "x0 = W_E[id], the first block's input" in text and "+ PE[t]" not in text


def test_pe_rope_shows_the_angles_and_a_score_that_depends_on_the_offset():
    import json

    out = json.loads(ok("pe", "--rope", "--len", "9", "-d", "6", "--json").stdout)
    angles, score = np.array(out["angles"]), np.array(out["score"])
    assert angles.shape == (9, 3) and score.shape == (9, 9)
    cos, sin = rope_tables(9, 6)
    np.testing.assert_array_equal(np.array(out["cos"]), cos)
    np.testing.assert_array_equal(np.array(out["sin"]), sin)
    assert angles[4, 1] == pytest.approx(4 / 10000 ** (2 / 6), rel=1e-15)
    # the score of u with itself: sum over pairs of 2 cos(offset * theta_i) / d, on every diagonal
    theta = 1 / 10000.0 ** (np.arange(3) / 3)
    for offset in range(9):
        expected = 2 * np.cos(offset * theta).sum() / 6
        assert_scaled_close(np.diagonal(score, offset), expected, floor=1e-15)
        assert_scaled_close(np.diagonal(score, -offset), expected, floor=1e-15)
    text = ok("pe", "--rope", "--len", "9", "-d", "7").stdout
    assert "dimension 6 is not turned" in text and "+ 1/7 (the unturned dimension)" in text
    assert "cos of each pair's angle (9 positions x 3 pairs)" in text


@pytest.mark.parametrize("args, option, allowed", [
    (["-d", "1"], "'--d-model'", "at least 2"),
    (["--len", "4001"], "'--len'", "at most 4,000"),
])
def test_pe_rope_refuses_what_it_cannot_draw(args, option, allowed):
    line = error_line(run("pe", "--rope", *args), 2)
    assert option in line and allowed in line
