"""Gemma 2's block: a norm on each sublayer's output as well as its input (``sandwich_norm``,
``--sandwich-norm``), a score scale of its own (``attn_scale``, ``--attn-scale``: Gemma 2's
``query_pre_attn_scalar``), and a sliding window in some blocks only (``sliding_layers``,
``--sliding-layers``). The forward against the formulas, the backward at random O(1) parameters
against central differences, the fast path against the reference, torch and the KV cache; the
views and flags. Then Gemma 2 checkpoint folders (``"model_type": "gemma2"``): the model at
random O(1) parameters against Hugging Face's Gemma2ForCausalLM, folders that
``save_pretrained`` writes read to the bit and run against ``from_pretrained``, the defaults,
the refusals, the counts of Gemma 2 2B, 9B and 27B.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

import tfmcli
from helpers import (
    assert_fast_equals_reference,
    assert_folder_matches_hf,
    assert_gemma_weights_read_to_the_bit,
    assert_gradcheck_passes,
    assert_grads_match,
    assert_scaled_close,
    decoded_like_the_forward,
    error_line,
    float64_gemma,
    gemma_holding,
    hf_logits,
    hf_saved,
    ok,
    random_params,
    run,
    sandwich_config_kwargs,
    sandwich_grads,
    tfm_grads_matching_hf,
    torch_reference_rows,
)
from tfmcli.engine.sizes import activation_shapes, memory_estimate, param_count, param_shapes
from tfmcli.sources import gemma2, llama


def gemma2_cfg(**fields):
    """Three blocks, the middle one seeing every earlier key and the others a window of 2, each
    sublayer's output normalised, the scores scaled by 0.3 (1 / sqrt(4) would be 0.5). GELU:
    central differences across ReLU's kink would fail at random parameters."""
    base = dict(d_model=8, heads=2, seq_len=6, lengths=(6, 4), layers=3, sliding_window=2,
                sliding_layers=(0, 2), sandwich_norm=True, attn_scale=0.3, activation="gelu")
    return tfmcli.Config(**{**base, **fields})


# ---------------------------------------------------------------- the forward


def test_the_scores_are_q_dot_k_times_attn_scale():
    cfg = gemma2_cfg(sandwich_norm=False, sliding_window=None, sliding_layers=None, layers=1)
    params = random_params(tfmcli.init_params(cfg), seed=1)
    fwd = tfmcli.forward(params, tfmcli.make_inputs(cfg), cfg, fast=False)
    q, k = fwd.acts["blocks.0.attn.q"], fwd.acts["blocks.0.attn.k"]
    scores = fwd.acts["blocks.0.attn.scores"]
    seen = np.isfinite(scores)
    assert_scaled_close(scores[seen], (q @ k.swapaxes(-1, -2) * 0.3)[seen])
    # 1 / sqrt(d_head) given as attn_scale is the default's very number: the same bits
    plain = cfg.replace(attn_scale=None)
    assert plain.score_scale == 0.5
    same = tfmcli.forward(params, fwd.inputs, cfg.replace(attn_scale=0.5))
    assert same.loss == tfmcli.forward(params, fwd.inputs, plain).loss != fwd.loss


def test_each_residual_sum_takes_the_normalised_sublayer_output():
    cfg = gemma2_cfg(rms_norm=True)
    params = random_params(tfmcli.init_params(cfg), seed=2)
    fwd = tfmcli.forward(params, tfmcli.make_inputs(cfg), cfg)
    p = "blocks.1."

    def rms(x, gamma):
        return x / np.sqrt((x ** 2).mean(-1, keepdims=True) + cfg.eps) * gamma

    attn_normed = rms(fwd.acts[p + "attn.out"], params[p + "ln1_post.gamma"])
    assert_scaled_close(fwd.acts[p + "ln1_post.out"], attn_normed)
    assert_scaled_close(fwd.acts[p + "resid1"], fwd.acts[p + "in"] + attn_normed)
    ffn_normed = rms(fwd.acts[p + "ffn.out"], params[p + "ln2_post.gamma"])
    assert_scaled_close(fwd.acts[p + "out"], fwd.acts[p + "resid1"] + ffn_normed)
    names = list(fwd.acts)
    assert names.index(p + "ln1_post.out") == names.index(p + "attn.out") + 1
    assert names.index(p + "ln2_post.out") == names.index(p + "resid2") - 1
    assert list(fwd.acts) == list(activation_shapes(cfg))


def test_the_post_norms_parameters():
    shapes = param_shapes(gemma2_cfg())
    assert shapes["blocks.0.ln1_post.gamma"] == shapes["blocks.0.ln1_post.beta"] == (8,)
    assert "blocks.2.ln2_post.beta" in shapes
    rms = param_shapes(gemma2_cfg(rms_norm=True))
    assert "blocks.0.ln1_post.beta" not in rms and rms["blocks.0.ln2_post.gamma"] == (8,)
    names = list(shapes)
    assert names.index("blocks.0.ln1_post.gamma") > names.index("blocks.0.attn.W_O")
    assert names.index("blocks.0.ln2_post.gamma") > names.index("blocks.0.ffn.W_2")
    # four norms a block of two vectors each (gamma, beta) of d 8, where there were two
    assert param_count(gemma2_cfg()) - param_count(gemma2_cfg(sandwich_norm=False)) == 3 * 2 * 16


def test_only_the_sliding_blocks_hide_the_keys_far_behind():
    cfg = gemma2_cfg()
    assert [cfg.window(i) for i in range(3)] == [2, None, 2]
    params = random_params(tfmcli.init_params(cfg), seed=3)
    fwd = tfmcli.forward(params, tfmcli.make_inputs(cfg), cfg)
    query = 5   # of row 0 (length 6): the window sees keys 4 and 5, the full block 0..5
    for i, seen in ((0, 2), (1, 6), (2, 2)):
        weights = fwd.acts[f"blocks.{i}.attn.pattern"][0, :, query]
        assert (weights > 0).sum(axis=-1).tolist() == [seen, seen], i
    every = tfmcli.forward(params, fwd.inputs, cfg.replace(sliding_layers=None))
    assert (every.acts["blocks.1.attn.pattern"][0, :, query] > 0).sum() == 2 * 2
    np.testing.assert_array_equal(every.acts["blocks.0.attn.pattern"],
                                  fwd.acts["blocks.0.attn.pattern"])


# ---------------------------------------------------------------- the backward


@pytest.mark.parametrize("fields", [
    dict(),
    dict(rms_norm=True),
    dict(sliding_layers=(1,), attn_scale=None, sandwich_norm=False),
    dict(attn_scale=2.5, sliding_window=None, sliding_layers=None, sandwich_norm=False,
         layers=1),
    dict(pe="rope", rms_norm=True, activation="geglu", bias=False, head_bias=False, kv_heads=1,
         embed_scale=True, tied_head=True, attn_softcap=1.5, logit_softcap=2.0, head_dim=3),
], ids=["sandwich-ln", "sandwich-rms", "some-slide", "scale", "gemma2-like"])
def test_gradients_match_central_differences_at_random_parameters(fields):
    assert_gradcheck_passes(gemma2_cfg(**fields))


@pytest.mark.parametrize("fields", [dict(), dict(dtype="float32"), dict(rms_norm=True,
                                                                        kv_heads=1, pe="rope")],
                         ids=["float64", "float32", "rms-grouped-rope"])
def test_fast_path_equals_the_reference(fields):
    """T 300: three query blocks; blocks 0 and 2 skip the keys before their window of 100."""
    cfg = gemma2_cfg(batch=3, seq_len=300, lengths=(300, 140, 290), sliding_window=100,
                     **fields)
    params = random_params(tfmcli.init_params(cfg), seed=6)
    assert_fast_equals_reference(cfg, params, tfmcli.make_inputs(cfg))


def test_matches_the_torch_reference_at_random_parameters():
    for fields in (dict(), dict(rms_norm=True, pe="rope", kv_heads=1, sliding_layers=(1,))):
        rows = torch_reference_rows(gemma2_cfg(**fields), seed=8)
        assert any(r.name == "grad blocks.2.ln2_post.gamma" for r in rows)
        assert max(r.rel for r in rows if not r.name.endswith("b_K")) < 1e-12


def test_kv_cache_equals_the_full_forward():
    """Eight tokens past a window of 2: blocks 0 and 2 keep two slots, block 1 all eight."""
    cfg = gemma2_cfg(batch=1, seq_len=8, lengths=None, pe="rope")
    _, steps, _ = decoded_like_the_forward(cfg, 7, [3, 1, 4, 1, 5, 2, 6, 5])
    assert steps[-1].cache_shape == (2, 8, 4)   # the widest block's
    assert (steps[-1].attention[(0, 0)] > 0).sum() == 2
    assert (steps[-1].attention[(1, 0)] > 0).sum() == 8
    # each step's query reads 2, 8 and 2 keys at most: 4 d_q multiply-adds a key
    assert (steps[-1].flops_cached - tfmcli.engine.kv.step_flops(cfg, [0, 0, 0])
            == 4 * (2 + 8 + 2) * cfg.d_q)


def test_the_memory_estimate_counts_the_post_norms():
    """Two more outputs, input gradients and caches (xhat, rstd) a block: tests/test_memory.py
    holds the estimate to the measured peak."""
    cfg = gemma2_cfg(batch=2, seq_len=16, lengths=None)
    more, plain = memory_estimate(cfg), memory_estimate(cfg.replace(sandwich_norm=False))
    btd = 2 * 16 * 8
    assert more["activations"] - plain["activations"] == 3 * 2 * btd * 8
    assert more["activation grads"] - plain["activation grads"] == 3 * 2 * btd * 8
    assert more["caches"] - plain["caches"] == 3 * 2 * (btd + 2 * 16) * 8


def test_the_config_refuses_what_it_cannot_run():
    cases = [
        (dict(sandwich_norm=True, norm="post"), "sandwich_norm", "must be Pre-LN"),
        (dict(sliding_window=None, sliding_layers=(0,)), "sliding_layers", "no sliding_window"),
        (dict(sliding_layers=(0, 3)), "sliding_layers", "block 3 is outside 0..2"),
        (dict(sliding_layers=(2, 0)), "sliding_layers", "ascending, each block once"),
        (dict(sliding_layers=(1, 1)), "sliding_layers", "ascending, each block once"),
        (dict(sliding_layers=(True,)), "sliding_layers", "must be block numbers"),
        (dict(attn_scale=0), "attn_scale", "positive finite number"),
        (dict(attn_scale=float("nan")), "attn_scale", "positive finite number"),
    ]
    for fields, field, needle in cases:
        with pytest.raises(tfmcli.ConfigError, match=needle) as raised:
            gemma2_cfg(**fields)
        assert raised.value.field == field
    assert gemma2_cfg(sliding_layers=[2]).sliding_layers == (2,)
    assert gemma2_cfg(attn_scale=1).attn_scale == 1.0


# ---------------------------------------------------------------- the command line

GEMMA2_FLAGS = ["-L", 3, "-T", 6, "-d", 8, "--activation", "gelu", "--sliding-window", 2,
                "--sliding-layers", "0,2", "--sandwich-norm", "--attn-scale", 0.3]


def test_the_flags_reach_the_run_and_the_panel():
    data = json.loads(ok("forward", *GEMMA2_FLAGS, "--json").stdout)
    config = data["config"]
    assert config["sliding_layers"] == [0, 2] and config["sandwich_norm"] is True
    assert config["attn_scale"] == 0.3
    names = [a["name"] for a in data["activations"]]
    assert "blocks.2.ln2_post.out" in names
    text = ok("forward", *GEMMA2_FLAGS).stdout
    assert "sliding window 2 in blocks 0, 2" in text and "q . k x 0.3" in text
    assert "sandwich (ln1_post, ln2_post" in text
    data = json.loads(ok("train", "--steps", 2, "-L", 2, "--sandwich-norm", "--attn-scale", 0.5,
                         "--sliding-window", 2, "--sliding-layers", "1", "--json").stdout)
    assert data["config"]["sliding_layers"] == [1] and data["config"]["sandwich_norm"] is True


@pytest.mark.parametrize("args, flag, needle", [
    (["--sliding-layers", "0"], "--sliding-layers", "there is no sliding_window"),
    (["--sliding-window", 2, "--sliding-layers", "1"], "--sliding-layers",
     "block 1 is outside 0..0"),
    (["--sliding-window", 2, "--sliding-layers", "0,x"], "--sliding-layers",
     "not a comma-separated list of block numbers"),
    (["--sandwich-norm", "--norm", "post"], "--sandwich-norm", "must be Pre-LN"),
    (["--attn-scale", 0], "--attn-scale", "must be a positive finite number, got 0.0"),
])
def test_bad_values_are_usage_errors(args, flag, needle):
    line = error_line(run("forward", *args), 2)
    assert f"'{flag}'" in line and needle in line


# ---------------------------------------------------------------- the views


def test_tfm_ln_shows_a_post_norm_and_refuses_one_the_model_lacks():
    data = json.loads(ok("ln", *GEMMA2_FLAGS, "--layer", "ln2_post", "--block", 1,
                         "--position", 3, "--json").stdout)
    cfg = gemma2_cfg(lengths=None)
    fwd = tfmcli.forward(tfmcli.init_params(cfg), tfmcli.make_inputs(cfg), cfg)
    x = fwd.acts["blocks.1.ffn.out"][0, 3]   # the norm's input: the FFN's output
    assert_scaled_close(data["x"], x)
    assert_scaled_close(data["y"], fwd.acts["blocks.1.ln2_post.out"][0, 3])
    assert data["dx_numeric_diff"] < 1e-8
    line = error_line(run("ln", "--layer", "ln1_post"), 2)
    assert "'--layer'" in line and "add --sandwich-norm" in line


def test_tfm_block_lays_out_the_sandwich_and_checks_dx():
    data = json.loads(ok("block", *GEMMA2_FLAGS, "--block", 1, "--position", 4,
                         "--json").stdout)
    forward = {r["name"]: np.array(r["value"]) for r in data["forward"]}
    backward = {r["name"]: np.array(r["value"]) for r in data["backward"]}
    assert_scaled_close(forward["y"], forward["x"] + forward["attn normed"])
    assert_scaled_close(forward["z"], forward["y"] + forward["ffn normed"])
    assert_scaled_close(backward["dy"], backward["dz"] + backward["ffn path"])
    assert "dffn" in backward and "dattn" in backward
    assert data["forward_model_diff"] < 1e-14 and data["backward_model_diff"] < 1e-14
    assert data["dx_numeric_diff"] < 1e-8
    text = ok("block", *GEMMA2_FLAGS).stdout
    assert "y = x + LN1_post(MHA(LN1(x)))" in text


def test_tfm_attn_names_the_scale_it_multiplies_by():
    data = json.loads(ok("attn", "--attn-scale", 0.25, "--backward", "--json").stdout)
    steps = {s["name"]: s for s in data["steps"]}
    assert_scaled_close(np.array(steps["scaled scores"]["value"]),
                        np.array(steps["scores"]["value"]) * 0.25)
    assert steps["scaled scores"]["formula"] == "Q K^T x attn_scale = Q K^T x 0.25"
    back = {s["name"]: s for s in data["backward_steps"]}
    assert back["dQ"]["formula"] == "dscaled scores @ K x 0.25 (attn_scale)"
    assert data["backward_model_diff"] < 1e-15
    query = json.loads(ok("attn", "--attn-scale", 0.25, "--query", 3, "--backward",
                          "--json").stdout)
    assert query["scale"] == 0.25
    assert query["backward"]["dq_numeric_diff"] < 1e-9
    text = ok("attn", "--attn-scale", 0.25, "--query", 3, "--backward").stdout
    assert "scaled by attn_scale = 0.25" in text and "dscore = dscaled x attn_scale" in text
    assert "scaled by 1/sqrt(d_head) = 0.57735" in ok("attn", "--query", 3).stdout


def test_tfm_attn_takes_the_blocks_own_mask():
    """Block 1 sees every earlier key, block 0 a window of 2: query 5's visible keys."""
    for block, visible in ((0, [4, 5]), (1, [0, 1, 2, 3, 4, 5])):
        data = json.loads(ok("attn", *GEMMA2_FLAGS, "--block", block, "--query", 5,
                             "--json").stdout)
        assert [k["position"] for k in data["keys"] if k["visible"]] == visible


def test_tfm_kv_counts_each_blocks_cache():
    data = json.loads(ok("kv", *GEMMA2_FLAGS, "-B", 1, "-T", 8, "--json").stdout)
    # blocks 0 and 2 keep 2 positions, block 1 all 8: K and V of 2 heads of 4
    assert data["cache_numbers"] == 2 * (2 + 8 + 2) * 2 * 4
    assert data["max_abs_diff"] < 1e-12
    text = ok("kv", *GEMMA2_FLAGS, "-B", 1, "-T", 8).stdout
    assert "2 x (2 blocks x (2, 2, 4) + 1 block x (2, 8, 4))" in text
    assert "sliding window 2 in blocks 0, 2 only" in text


def test_tfm_forward_draws_each_block_over_its_own_mask():
    """Query 5's row of block 0 hides four keys, block 1's none."""
    text = ok("forward", *GEMMA2_FLAGS, "--head", 0).stdout
    maps = text.split("block 0 head 0")[1]
    row0 = next(line for line in maps.split("\n") if line.startswith("q5"))
    row1 = next(line for line in maps.split("block 1 head 0")[1].split("\n")
                if line.startswith("q5"))
    assert row0.count("·") == 4 and row1.count("·") == 0



# ---------------------------------------------------------------- Gemma 2 checkpoints

GEMMA2 = dict(pe="rope", activation="geglu", rms_norm=True, head_bias=False, bias=False,
              embed_scale=True, tied_head=True, sandwich_norm=True)


def test_gemma2_2b_9b_and_27b_have_their_parameter_counts():
    """google/gemma-2-2b's, 9b's and 27b's sizes (their config.json): the counts Hugging Face's
    Gemma2ForCausalLM gives the same configs on the meta device (the tied embedding once)."""
    sizes = {2_614_341_888: (2304, 8, 4, 256, 26, 9216),
             9_241_705_984: (3584, 16, 8, 256, 42, 14336),
             27_227_128_320: (4608, 32, 16, 128, 46, 36864)}
    for count, (d, H, kv, head_dim, L, F) in sizes.items():
        cfg = tfmcli.Config(d_model=d, heads=H, kv_heads=kv, head_dim=head_dim, layers=L,
                            d_ff=F, vocab=256000, **GEMMA2)
        assert param_count(cfg) == count


def gemma2_model_cfg(**fields):
    """Gemma 2's shape, small: 4 heads 6 wide on a width of 16 (sqrt(16) = 4 exactly, as
    Hugging Face's float32 embedding scale is), two key heads, three layers, the first and last
    sliding with a window of 2, query_pre_attn_scalar 10, both caps, a padded row."""
    base = dict(d_model=16, heads=4, kv_heads=2, head_dim=6, seq_len=6, lengths=(6, 4),
                d_ff=12, eps=1e-6, layers=3, sliding_window=2, sliding_layers=(0, 2),
                attn_scale=10 ** -0.5, attn_softcap=1.5, logit_softcap=2.0, **GEMMA2)
    return tfmcli.Config(**{**base, **fields})


def hf_gemma2_config(cfg):
    """The Gemma2Config of tfm's ``cfg``: its caps, its scale as query_pre_attn_scalar, the
    layers its window slides in (``sandwich_config_kwargs``), one RoPE."""
    transformers = pytest.importorskip("transformers")
    return transformers.Gemma2Config(
        **sandwich_config_kwargs(cfg),
        rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_theta})


def gemma2_from(params, cfg):
    """Hugging Face's Gemma2ForCausalLM holding tfm's parameters in float64 (``gemma_holding``)."""
    transformers = pytest.importorskip("transformers")
    return gemma_holding(transformers.Gemma2ForCausalLM, hf_gemma2_config(cfg), params, cfg)


@pytest.mark.parametrize("fields", [
    dict(),
    dict(tied_head=False, kv_heads=4, layers=2, sliding_layers=(1,)),
    dict(attn_softcap=None, logit_softcap=None, attn_scale=None, sliding_layers=None),
], ids=["tied-gqa-alternate", "untied-mha-last-slides", "no-caps-every-layer"])
def test_matches_hugging_face(fields, float64_softmax):
    """Gemma2ForCausalLM holding tfm's random parameters (every gamma drawn): loss, logits and
    every gradient to 1e-12, a padded row included; the rows of 6 and 4 tokens run past the
    window of 2."""
    cfg = gemma2_model_cfg(**fields)
    params = random_params(tfmcli.init_params(cfg), seed=12)
    model = gemma2_from(params, cfg)
    grads = tfm_grads_matching_hf(model, params, tfmcli.make_inputs(cfg), cfg)
    theirs = sandwich_grads(model)
    assert set(theirs) == set(params)
    assert_grads_match(grads, theirs)


def test_each_of_gemma2s_differences_moves_the_loss(float64_softmax):
    """Without the post norms, either cap, the scale or the window's layers, Hugging Face's
    loss is missed: each is needed."""
    cfg = gemma2_model_cfg()
    params = random_params(tfmcli.init_params(cfg), seed=3)
    inputs = tfmcli.make_inputs(cfg)
    logits, keys = hf_logits(gemma2_from(params, cfg), inputs, cfg)
    assert np.abs(tfmcli.forward(params, inputs, cfg).acts["logits"] - logits)[keys].max() < 1e-12
    plain = {name: value for name, value in params.items() if "_post" not in name}
    for changed, p in ((dict(sandwich_norm=False), plain), (dict(attn_softcap=None), params),
                       (dict(logit_softcap=None), params), (dict(attn_scale=None), params),
                       (dict(sliding_layers=None), params)):
        ours = tfmcli.forward(p, inputs, cfg.replace(**changed)).acts["logits"]
        assert np.abs(ours - logits)[keys].max() > 1e-3, changed


SMALL = dict(vocab_size=40, hidden_size=16, num_hidden_layers=3, num_attention_heads=4,
             num_key_value_heads=2, head_dim=6, intermediate_size=24, max_position_embeddings=32,
             rms_norm_eps=1e-6, pad_token_id=None, sliding_window=2, query_pre_attn_scalar=10,
             attn_logit_softcapping=1.5, final_logit_softcapping=2.0)


@pytest.mark.parametrize("config", [dict(), dict(tie_word_embeddings=False)],
                         ids=["tied", "untied"])
def test_a_gemma2_folder_is_read_to_the_bit_and_matches_from_pretrained(tmp_path, config,
                                                                          float64_softmax):
    state = hf_saved(tmp_path, "Gemma2", {**SMALL, **config})
    assert json.loads((tmp_path / "config.json").read_text())["model_type"] == "gemma2"
    fields = gemma2.read_config(tmp_path)
    cfg = tfmcli.Config(**fields)
    assert (cfg.sandwich_norm, cfg.sliding_window, cfg.sliding_layers, cfg.attn_softcap,
            cfg.logit_softcap, cfg.attn_scale) == (True, 2, (0, 2), 1.5, 2.0, 10 ** -0.5)
    assert (cfg.activation, cfg.embed_scale, cfg.tied_head, cfg.h_kv, cfg.d_head) == (
        "geglu", True, config.get("tie_word_embeddings", True), 2, 6)
    params = gemma2.load_params(tmp_path, fields, np.float64)
    assert list(params) == list(param_shapes(cfg))
    assert_gemma_weights_read_to_the_bit(params, state, fields)
    assert [name for _, name, _ in llama.name_map(fields)][1:6] == [
        "blocks.0.ln1.gamma", "blocks.0.attn.W_Q", "blocks.0.attn.W_K", "blocks.0.attn.W_V",
        "blocks.0.attn.W_O"]
    transformers = pytest.importorskip("transformers")
    run_ = tfmcli.load(tmp_path, tokens=[[1, 5, 9, 2, 7, 30], [3, 3, 8]])
    assert run_.weights_from.startswith("Gemma 2 checkpoint")
    assert_folder_matches_hf(transformers.Gemma2ForCausalLM, tmp_path, run_, float64_gemma,
                             sandwich_grads, attention="eager")
    back = gemma2.from_tfm(gemma2.load_params(tmp_path, fields, np.float64), fields)
    assert set(back) | ({"lm_head.weight"} if cfg.tied_head else set()) >= set(state) - {
        "lm_head.weight"}


def test_a_gemma2_config_takes_gemma2configs_defaults(tmp_path):
    """A config.json without the window, the scalar, the caps, head_dim or layer_types: 4096,
    256 (1 / sqrt(256), tfm's own scale), 50 and 30, 256, the even layers sliding."""
    hf_saved(tmp_path, "Gemma2", {**SMALL, "head_dim": 256}, "float32")
    config = json.loads((tmp_path / "config.json").read_text())
    for key in ("sliding_window", "query_pre_attn_scalar", "attn_logit_softcapping",
                "final_logit_softcapping", "head_dim", "layer_types"):
        config.pop(key, None)
    (tmp_path / "config.json").write_text(json.dumps(config))
    fields = gemma2.read_config(tmp_path)
    assert (fields["sliding_window"], fields["sliding_layers"], fields["attn_scale"],
            fields["attn_softcap"], fields["logit_softcap"], fields["head_dim"]) == (
        4096, (0, 2), None, 50.0, 30.0, 256)
    # null caps: none (Gemma2Config keeps a null as no cap)
    (tmp_path / "config.json").write_text(json.dumps(
        {**config, "attn_logit_softcapping": None, "final_logit_softcapping": None}))
    fields = gemma2.read_config(tmp_path)
    assert fields["attn_softcap"] is None and fields["logit_softcap"] is None


@pytest.mark.parametrize("change, reason", [
    (dict(query_pre_attn_scalar=0), "key 'query_pre_attn_scalar' is 0, not a positive number"),
    (dict(query_pre_attn_scalar="144"), "key 'query_pre_attn_scalar' is '144', not a number"),
    (dict(attn_logit_softcapping=-50.0), "attn_softcap must be a positive finite number"),
    (dict(hidden_activation="silu"), "key 'hidden_activation' is 'silu'; tfm's Gemma FFN is "
                                     "GeGLU"),
    (dict(layer_types=["sliding_attention"] * 2), "key 'layer_types' names 2 layers, and "
                                                  "'num_hidden_layers' is 3"),
])
def test_a_gemma2_tfm_would_not_compute_exactly_is_refused(tmp_path, change, reason):
    hf_saved(tmp_path, "Gemma2", SMALL, "float32")
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, **change}))
    line = error_line(run("forward", "--load", tmp_path, "--tokens", "1,2,3"), 1)
    assert reason in line and line.split(": ")[2].endswith("config.json")


def test_the_views_read_a_gemma2_folder(tmp_path):
    hf_saved(tmp_path, "Gemma2", SMALL, "bfloat16")
    text = ok("forward", "--load", tmp_path, "--tokens", "1,5,9,2,7,30").stdout
    assert "Gemma 2 checkpoint" in text and "sliding window 2 in blocks 0, 2" in text
    assert "sandwich (ln1_post, ln2_post" in text and "1.5 tanh(s / 1.5)" in text
    data = json.loads(ok("ln", "--load", tmp_path, "--tokens", "1,5,9,2,7,30", "--layer",
                         "ln2_post", "--block", 2, "--position", 5, "--json").stdout)
    assert data["y_model_diff"] < 1e-12 and data["dx_numeric_diff"] < 1e-8
    data = json.loads(ok("kv", "--load", tmp_path, "--tokens", "1,5,9,2,7,30", "--json").stdout)
    assert data["max_abs_diff"] < 1e-12
    assert data["cache_numbers"] == 2 * (2 + 6 + 2) * 2 * 6
