"""Gemma 3's two RoPEs: the sliding blocks turn at a base of their own, unscaled
(``rope_local_theta``, ``--rope-local-theta``: Gemma 3's ``rope_local_base_freq``), the full
ones at ``rope_theta`` with ``rope_scaling``, which may now be linear (one number, ``rope_type``
"linear": every angle divided by the factor, Gemma 3 4B+'s 8). The forward against the
formulas, the backward at random O(1) parameters against central differences, the fast path,
torch and the KV cache; the flags and views. Then Gemma 3 checkpoint folders (``"model_type":
"gemma3_text"``) against Hugging Face's Gemma3ForCausalLM, in both the first configs' keys and
transformers 5's ``rope_parameters``; a LLaMA folder with linear scaling; the counts of Gemma 3
270M and 1B.
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
from tfmcli.engine import ops, positional
from tfmcli.engine.config import LinearRopeScaling, RopeScaling
from tfmcli.engine.sizes import memory_estimate, param_count
from tfmcli.sources import gemma3, llama


def local_cfg(**fields):
    """Three RoPE blocks, 0 and 2 sliding with a window of 2 and turning at base 3, block 1
    seeing every key and turning at base 50, its angles divided by 4. GELU: central differences
    across ReLU's kink would fail at random parameters."""
    base = dict(d_model=8, heads=2, seq_len=6, lengths=(6, 4), layers=3, pe="rope",
                sliding_window=2, sliding_layers=(0, 2), rope_theta=50.0, rope_scaling=4,
                rope_local_theta=3.0, activation="gelu")
    return tfmcli.Config(**{**base, **fields})


# ---------------------------------------------------------------- the angles


def test_each_block_turns_at_its_own_base_and_scaling():
    cfg = local_cfg()
    assert [cfg.rope(i) for i in range(3)] == [(3.0, None), (50.0, (4.0,)), (3.0, None)]
    assert cfg.rope_scaling == LinearRopeScaling(4.0)
    # without a base of their own every block turns alike
    alike = cfg.replace(rope_local_theta=None)
    assert {alike.rope(i) for i in range(3)} == {(50.0, (4.0,))}
    params = random_params(tfmcli.init_params(cfg), seed=1)
    fwd = tfmcli.forward(params, tfmcli.make_inputs(cfg), cfg)
    for i, (base, scaling) in enumerate(((3.0, None), (50.0, (4.0,)), (3.0, None))):
        cos, sin = positional.rope_tables(6, 4, base=base, scaling=scaling)
        q = fwd.acts[f"blocks.{i}.attn.q"]
        np.testing.assert_allclose(fwd.acts[f"blocks.{i}.attn.q_rot"],
                                   ops.rope_forward(q, cos, sin), rtol=1e-15, atol=1e-15)
    # turned alike, block 0 takes block 1's angles: the same q, another turn
    other = tfmcli.forward(params, fwd.inputs, alike)
    np.testing.assert_array_equal(other.acts["blocks.0.attn.q"], fwd.acts["blocks.0.attn.q"])
    cos, sin = positional.rope_tables(6, 4, base=50.0, scaling=(4.0,))
    np.testing.assert_allclose(other.acts["blocks.0.attn.q_rot"],
                               ops.rope_forward(other.acts["blocks.0.attn.q"], cos, sin),
                               rtol=1e-15, atol=1e-15)
    assert np.abs(other.acts["blocks.0.attn.q_rot"] - fwd.acts["blocks.0.attn.q_rot"]).max() > 0.1


def test_linear_scaling_turns_position_t_as_t_over_the_factor():
    """Pair i at position t turns by t / (factor base^(2i/d)): with a factor of 4, position 8
    turns as position 2 did unscaled, at every pair."""
    scaled = positional.rope_angles(9, 6, 50.0, LinearRopeScaling(4.0))
    plain = positional.rope_angles(9, 6, 50.0)
    assert_scaled_close(scaled[8], plain[2])
    assert_scaled_close(scaled, plain / 4)
    assert positional.rope_scale(6, 50.0, (4.0,)).tolist() == [0.25, 0.25, 0.25]


def test_one_number_or_hugging_faces_dict_make_a_linear_scaling():
    by_number = local_cfg(rope_scaling=8)
    by_name = local_cfg(rope_scaling={"rope_type": "linear", "factor": 8.0})
    assert by_number == by_name == local_cfg(rope_scaling=[8.0])
    assert by_number.rope_scaling == LinearRopeScaling(8.0)
    written = json.loads(by_name.to_json())
    assert written["rope_scaling"] == {"rope_type": "linear", "factor": 8.0}
    assert written["rope_local_theta"] == 3.0
    assert tfmcli.Config.from_json(by_name.to_json()) == by_name
    # LLaMA 3.1's four numbers are still its own
    assert isinstance(local_cfg(rope_scaling=(4, 1, 4, 128)).rope_scaling, RopeScaling)


@pytest.mark.parametrize("fields, field, reason", [
    (dict(rope_scaling=0), "rope_scaling", "linear rope_scaling's factor must be a positive"),
    (dict(rope_scaling={"rope_type": "linear"}), "rope_scaling", "names factor"),
    (dict(rope_scaling={"rope_type": "linear", "factor": 2, "low_freq_factor": 1}),
     "rope_scaling", "names factor (rope_type linear), got 'linear' and ['factor', 'low_freq"),
    (dict(rope_local_theta=0), "rope_local_theta", "positive finite number, got 0"),
    (dict(rope_local_theta=float("inf")), "rope_local_theta", "positive finite number"),
    (dict(rope_local_theta=True), "rope_local_theta", "positive finite number, got True"),
    (dict(sliding_window=None, sliding_layers=None), "rope_local_theta",
     "there is no sliding_window"),
    (dict(pe="sinusoidal"), "rope_local_theta", "pe is 'sinusoidal', not 'rope'"),
])
def test_the_config_refuses_what_it_cannot_run(fields, field, reason):
    with pytest.raises(tfmcli.ConfigError) as raised:
        local_cfg(**fields)
    assert raised.value.field == field and reason in str(raised.value)


# ---------------------------------------------------------------- the backward and its checks


@pytest.mark.parametrize("fields", [
    dict(),
    dict(rope_scaling=(2.5, 0.5, 3.0, 300), rms_norm=True),
    dict(sliding_layers=None, layers=2, rope_scaling=None),
    dict(sliding_window=None, sliding_layers=None, rope_local_theta=None, layers=1),
    dict(rms_norm=True, activation="geglu", bias=False, head_bias=False, kv_heads=1,
         embed_scale=True, tied_head=True, head_dim=3, qk_norm=True, sandwich_norm=True,
         attn_scale=0.4),
], ids=["local-linear", "local-llama3", "every-block-local", "linear-alone", "gemma3-like"])
def test_gradients_match_central_differences_at_random_parameters(fields):
    assert_gradcheck_passes(local_cfg(**fields))


@pytest.mark.parametrize("fields", [dict(), dict(dtype="float32"),
                                    dict(rms_norm=True, kv_heads=1, qk_norm=True,
                                         sandwich_norm=True)],
                         ids=["float64", "float32", "gemma3-like"])
def test_fast_path_equals_the_reference(fields):
    """T 300: blocks 0 and 2 skip the keys before their window of 100, and turn at base 3."""
    cfg = local_cfg(batch=3, seq_len=300, lengths=(300, 140, 290), sliding_window=100,
                    **fields)
    params = random_params(tfmcli.init_params(cfg), seed=6)
    assert_fast_equals_reference(cfg, params, tfmcli.make_inputs(cfg))


def test_matches_the_torch_reference_at_random_parameters():
    for fields in (dict(), dict(rms_norm=True, kv_heads=1, qk_norm=True, sandwich_norm=True,
                                rope_scaling=(2.5, 0.5, 3.0, 300))):
        rows = torch_reference_rows(local_cfg(**fields), seed=8)
        assert max(r.rel for r in rows if not r.name.endswith("b_K")) < 1e-12


def test_kv_cache_turns_each_block_by_its_own_angles():
    cfg = local_cfg(batch=1, seq_len=8, lengths=None)
    params, steps, _ = decoded_like_the_forward(cfg, 7, [3, 1, 4, 1, 5, 2, 6, 5])
    # and turned alike, the cache would not give the forward's logits
    alike = tfmcli.engine.kv.decode(
        params, [3, 1, 4, 1, 5, 2, 6, 5], cfg.replace(rope_local_theta=1e4)
    )
    assert np.abs(alike[-1].logits - steps[-1].logits).max() > 1e-3


def test_the_memory_estimate_counts_both_tables():
    """Two (cos, sin) pairs of T x d_head are cached where one was."""
    cfg = local_cfg(batch=2, seq_len=16, lengths=None)
    two, one = memory_estimate(cfg), memory_estimate(cfg.replace(rope_local_theta=None))
    assert two["caches"] - one["caches"] == 2 * 16 * 4 * 8


def test_tfm_attn_recomputes_a_block_at_its_own_base():
    """The steps of block 1 turn by block 1's angles (base 50, a quarter), block 0's by base 3:
    each step's Q_rot is its block's own."""
    from tfmcli.explain.steps import explain_query_backward, model_head_steps

    cfg = local_cfg()
    params = random_params(tfmcli.init_params(cfg), seed=11)
    fwd = tfmcli.forward(params, tfmcli.make_inputs(cfg), cfg)
    grads = tfmcli.backward(params, fwd, cfg)
    for block in (0, 1):
        steps = {s.name: s.value for s in model_head_steps(params, fwd, cfg, block, 1, 0)}
        assert_scaled_close(steps["Q_rot"],
                            fwd.acts[f"blocks.{block}.attn.q_rot"][0, 1], floor=1e-14)
        back = explain_query_backward(fwd, grads.acts[f"blocks.{block}.attn.context"], cfg,
                                      block, 1, 0, 5)
        assert_scaled_close(back.dq_turned_back,
                            grads.acts[f"blocks.{block}.attn.q"][0, 1, 5], floor=1e-15)


# ---------------------------------------------------------------- the command line

def panel_text(out: str) -> str:
    """The output's words in one line, the config panel's borders and wrapping taken out."""
    return " ".join(out.replace("│", " ").split())


LOCAL_FLAGS = ["-L", 3, "-T", 6, "-d", 8, "--activation", "gelu", "--pe", "rope",
               "--sliding-window", 2, "--sliding-layers", "0,2", "--rope-theta", 1e6,
               "--rope-scaling", 8, "--rope-local-theta", 10000]


def test_the_flags_reach_the_run_and_the_panel():
    data = json.loads(ok("forward", *LOCAL_FLAGS, "--json").stdout)
    assert data["config"]["rope_local_theta"] == 10000.0
    assert data["config"]["rope_scaling"] == {"rope_type": "linear", "factor": 8.0}
    text = panel_text(ok("forward", *LOCAL_FLAGS).stdout)
    assert "rope (full blocks: theta 1e+06, linear scaling 8; sliding blocks: theta 10000)" in text
    assert "rope (linear scaling 2)" in ok("forward", "--pe", "rope", "--rope-scaling",
                                           2).stdout
    data = json.loads(ok("train", "--steps", 2, "-L", 2, "--pe", "rope", "--sliding-window", 2,
                         "--sliding-layers", "1", "--rope-local-theta", 100, "--json").stdout)
    assert data["config"]["rope_local_theta"] == 100.0


@pytest.mark.parametrize("args, flag, needle", [
    (["--pe", "rope", "--rope-local-theta", 100], "--rope-local-theta",
     "there is no sliding_window"),
    (["--sliding-window", 2, "--rope-local-theta", 100], "--rope-local-theta",
     "pe is 'sinusoidal', not 'rope'"),
    (["--pe", "rope", "--sliding-window", 2, "--rope-local-theta", 0], "--rope-local-theta",
     "positive finite number, got 0.0"),
    (["--pe", "rope", "--rope-scaling", 0], "--rope-scaling",
     "linear rope_scaling's factor must be a positive finite number, got 0.0"),
])
def test_bad_values_are_usage_errors(args, flag, needle):
    line = error_line(run("forward", *args), 2)
    assert f"'{flag}'" in line and needle in line


def test_tfm_pe_shows_linear_scaling():
    flags = ["pe", "--rope", "-d", 8, "--len", 6, "--rope-theta", 100]
    plain = json.loads(ok(*flags, "--json").stdout)
    scaled = json.loads(ok(*flags, "--rope-scaling", 4, "--json").stdout)
    assert_scaled_close(np.array(scaled["angles"]), np.array(plain["angles"]) / 4)
    assert scaled["scale"] == [0.25] * 4
    text = " ".join(ok(*flags, "--rope-scaling", 4).stdout.split())
    assert "s_i = 1/4 for every pair: linear scaling" in text


# ---------------------------------------------------------------- Gemma 3 checkpoints

GEMMA3 = dict(pe="rope", activation="geglu", rms_norm=True, head_bias=False, bias=False,
              embed_scale=True, tied_head=True, sandwich_norm=True, qk_norm=True)


def test_gemma3s_have_their_parameter_counts():
    """google/gemma-3-270m's and gemma-3-1b-pt's sizes, and the text_config of gemma-3-4b-pt,
    12b and 27b (their config.json): the counts Hugging Face's Gemma3ForCausalLM gives the same
    configs on the meta device (the tied embedding once; q_norm and k_norm d_head each a
    layer). The larger ones' vision towers (about 0.4 billion) are not counted."""
    sizes = {268_098_176: (640, 4, 1, 256, 18, 2048, 262144),
             999_885_952: (1152, 4, 1, 256, 26, 6912, 262144),
             3_880_263_168: (2560, 8, 4, 256, 34, 10240, 262208),
             11_766_034_176: (3840, 16, 8, 256, 48, 15360, 262208),
             27_009_346_304: (5376, 32, 16, 128, 62, 21504, 262208)}
    for count, (d, H, kv, head_dim, L, F, V) in sizes.items():
        cfg = tfmcli.Config(d_model=d, heads=H, kv_heads=kv, head_dim=head_dim, layers=L,
                            d_ff=F, vocab=V, **GEMMA3)
        assert param_count(cfg) == count


def gemma3_model_cfg(**fields):
    """Gemma 3's shape, small: 4 heads 6 wide on a width of 16 (sqrt(16) = 4 exactly, as
    Hugging Face's float32 embedding scale is), two key heads, three layers, the first and last
    sliding with a window of 2 and turning at base 20, the middle one at base 1000 with linear
    scaling 8, query_pre_attn_scalar 10, a padded row."""
    base = dict(d_model=16, heads=4, kv_heads=2, head_dim=6, seq_len=6, lengths=(6, 4),
                d_ff=12, eps=1e-6, layers=3, sliding_window=2, sliding_layers=(0, 2),
                attn_scale=10 ** -0.5, rope_theta=1000.0, rope_scaling=8,
                rope_local_theta=20.0, **GEMMA3)
    return tfmcli.Config(**{**base, **fields})


def hf_gemma3_config(cfg):
    """The Gemma3TextConfig of tfm's ``cfg``: its scale as query_pre_attn_scalar, the layers
    its window slides in, its caps (``sandwich_config_kwargs``), a RoPE a layer type."""
    transformers = pytest.importorskip("transformers")
    full = {"rope_type": "default", "rope_theta": cfg.rope_theta}
    if cfg.rope_scaling is not None:
        full.update({"rope_type": "llama3", **cfg.rope_scaling.to_dict()})   # or linear's
    return transformers.Gemma3TextConfig(
        **sandwich_config_kwargs(cfg),
        rope_parameters={"full_attention": full, "sliding_attention": {
            "rope_type": "default", "rope_theta": cfg.rope_local_theta or cfg.rope_theta}})


def gemma3_from(params, cfg):
    """Hugging Face's Gemma3ForCausalLM holding tfm's parameters in float64 (``gemma_holding``)."""
    transformers = pytest.importorskip("transformers")
    return gemma_holding(transformers.Gemma3ForCausalLM, hf_gemma3_config(cfg), params, cfg)


@pytest.mark.parametrize("fields", [
    dict(),
    dict(tied_head=False, kv_heads=4, layers=2, sliding_layers=(1,), rope_scaling=None),
    dict(logit_softcap=2.0, attn_scale=None, rope_scaling=(2.5, 0.5, 3.0, 30)),
], ids=["tied-gqa-linear", "untied-mha-unscaled", "logit-cap-llama3"])
def test_matches_hugging_face(fields, float64_softmax):
    """Gemma3ForCausalLM holding tfm's random parameters (every gamma drawn, q_norm's and
    k_norm's too): loss, logits and every gradient to 1e-12, a padded row included."""
    cfg = gemma3_model_cfg(**fields)
    params = random_params(tfmcli.init_params(cfg), seed=12)
    model = gemma3_from(params, cfg)
    grads = tfm_grads_matching_hf(model, params, tfmcli.make_inputs(cfg), cfg)
    theirs = sandwich_grads(model)
    assert set(theirs) == set(params)
    assert_grads_match(grads, theirs)


def test_each_of_gemma3s_differences_moves_the_loss(float64_softmax):
    """Without the sliding blocks' own base, the full blocks' scaling or the q and k norms,
    Hugging Face's logits are missed: each is needed."""
    cfg = gemma3_model_cfg()
    params = random_params(tfmcli.init_params(cfg), seed=3)
    inputs = tfmcli.make_inputs(cfg)
    logits, keys = hf_logits(gemma3_from(params, cfg), inputs, cfg)
    assert np.abs(tfmcli.forward(params, inputs, cfg).acts["logits"] - logits)[keys].max() < 1e-12
    plain = {name: value for name, value in params.items() if "_norm." not in name}
    for changed, p in ((dict(rope_local_theta=None), params), (dict(rope_scaling=None), params),
                       (dict(qk_norm=False), plain)):
        ours = tfmcli.forward(p, inputs, cfg.replace(**changed)).acts["logits"]
        assert np.abs(ours - logits)[keys].max() > 1e-3, changed


SMALL = dict(vocab_size=40, hidden_size=16, num_hidden_layers=3, num_attention_heads=4,
             num_key_value_heads=2, head_dim=6, intermediate_size=24, max_position_embeddings=32,
             rms_norm_eps=1e-6, pad_token_id=None, sliding_window=2, query_pre_attn_scalar=10,
             sliding_window_pattern=2, rope_theta=1000.0, rope_local_base_freq=20.0,
             rope_scaling={"rope_type": "linear", "factor": 8.0})


def saved(tmp_path, config=None, dtype="bfloat16"):
    return hf_saved(tmp_path, "Gemma3", {**SMALL, **(config or {})}, dtype,
                    config_class="Gemma3TextConfig")


def first_configs_keys(tmp_path, **change):
    """The folder's config.json rewritten in the keys Gemma 3's own (transformers 4.50) carry:
    rope_theta, rope_local_base_freq, rope_scaling, sliding_window_pattern, no layer_types."""
    config = json.loads((tmp_path / "config.json").read_text())
    for key in ("rope_parameters", "layer_types", "_sliding_window_pattern"):
        config.pop(key, None)
    config.update({"rope_theta": SMALL["rope_theta"],
                   "rope_local_base_freq": SMALL["rope_local_base_freq"],
                   "rope_scaling": SMALL["rope_scaling"], "sliding_window_pattern": 2}, **change)
    (tmp_path / "config.json").write_text(json.dumps(config))
    return config


@pytest.mark.parametrize("keys", ["rope_parameters", "first"])
@pytest.mark.parametrize("config", [dict(), dict(tie_word_embeddings=False)],
                         ids=["tied", "untied"])
def test_a_gemma3_folder_is_read_to_the_bit_and_matches_from_pretrained(tmp_path, config, keys,
                                                                          float64_softmax):
    state = saved(tmp_path, config)
    written = json.loads((tmp_path / "config.json").read_text())
    assert written["model_type"] == "gemma3_text" and "full_attention" in written[
        "rope_parameters"]
    if keys == "first":
        first_configs_keys(tmp_path)
    fields = gemma3.read_config(tmp_path)
    cfg = tfmcli.Config(**fields)
    assert (cfg.sandwich_norm, cfg.qk_norm, cfg.sliding_window, cfg.sliding_layers,
            cfg.attn_softcap, cfg.logit_softcap, cfg.attn_scale) == (
        True, True, 2, (0, 2), None, None, 10 ** -0.5)
    assert (cfg.rope_theta, cfg.rope_scaling, cfg.rope_local_theta) == (1000.0, (8.0,), 20.0)
    params = gemma3.load_params(tmp_path, fields, np.float64)
    assert_gemma_weights_read_to_the_bit(params, state, fields)
    assert params["blocks.0.attn.q_norm.gamma"].shape == (6,)
    transformers = pytest.importorskip("transformers")
    run_ = tfmcli.load(tmp_path, tokens=[[1, 5, 9, 2, 7, 30], [3, 3, 8]])
    assert run_.weights_from.startswith("Gemma 3 checkpoint")
    assert_folder_matches_hf(transformers.Gemma3ForCausalLM, tmp_path, run_, float64_gemma,
                             sandwich_grads, attention="eager")


def test_a_gemma3_config_takes_gemma3textconfigs_defaults(tmp_path):
    """Without the window, the scalar, the caps, head_dim, the RoPE keys or layer_types: 4096,
    256 (1 / sqrt(256), tfm's own scale), no caps, 256, bases 1e6 and 10000 unscaled, five
    layers of six sliding."""
    saved(tmp_path, {"head_dim": 256, "num_hidden_layers": 7}, "float32")
    config = json.loads((tmp_path / "config.json").read_text())
    for key in ("sliding_window", "query_pre_attn_scalar", "attn_logit_softcapping",
                "final_logit_softcapping", "head_dim", "layer_types", "rope_parameters",
                "sliding_window_pattern", "_sliding_window_pattern"):
        config.pop(key, None)
    (tmp_path / "config.json").write_text(json.dumps(config))
    fields = gemma3.read_config(tmp_path)
    assert (fields["sliding_window"], fields["sliding_layers"], fields["attn_scale"],
            fields["attn_softcap"], fields["logit_softcap"], fields["head_dim"]) == (
        4096, (0, 1, 2, 3, 4, 6), None, None, None, 256)
    assert (fields["rope_theta"], fields["rope_scaling"], fields["rope_local_theta"]) == (
        1e6, None, 1e4)


@pytest.mark.parametrize("change, reason", [
    (dict(rope_parameters={"sliding_attention": {"rope_type": "linear", "factor": 2.0},
                           "full_attention": {"rope_type": "default"}}),
     "key 'rope_parameters' scales the sliding layers' angles ('linear')"),
    (dict(rope_parameters={"sliding_attention": {"rope_type": "default"},
                           "full_attention": {"rope_type": "yarn", "factor": 2.0}}),
     "key 'rope_parameters' has rope_type 'yarn'; tfm turns by RoPE's own angles"),
    (dict(rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": -1},
                           "full_attention": {"rope_type": "default"}}),
     "key 'rope_parameters' sliding_attention's 'rope_theta' is -1, not a positive number"),
    (dict(use_bidirectional_attention=True), "key 'use_bidirectional_attention' is True"),
    (dict(sliding_window=None), "key 'sliding_window' is null; a Gemma 3's sliding layers need "
                                "a window"),
    (dict(attn_logit_softcapping=50.0), "key 'attn_logit_softcapping' is 50.0, which Hugging "
                                        "Face's Gemma 3 does not apply"),
    (dict(layer_types=None, sliding_window_pattern=0),
     "key 'sliding_window_pattern' is 0, not a positive whole number"),
])
def test_a_gemma3_tfm_would_not_compute_exactly_is_refused(tmp_path, change, reason):
    saved(tmp_path, dtype="float32")
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, **change}))
    line = error_line(run("forward", "--load", tmp_path, "--tokens", "1,2,3"), 1)
    assert reason in line and line.split(": ")[2].endswith("config.json")


def test_a_gemma3_in_the_first_keys_is_refused_a_scaled_linear_factor_of_zero(tmp_path):
    saved(tmp_path, dtype="float32")
    first_configs_keys(tmp_path, rope_scaling={"rope_type": "linear", "factor": 0})
    line = error_line(run("forward", "--load", tmp_path, "--tokens", "1,2,3"), 1)
    assert "key 'rope_scaling': a linear rope_scaling's factor must be a positive" in line


def test_the_views_read_a_gemma3_folder(tmp_path):
    saved(tmp_path)
    tokens = ["--tokens", "1,5,9,2,7,30"]
    text = panel_text(ok("forward", "--load", tmp_path, *tokens).stdout)
    assert "Gemma 3 checkpoint" in text and "sliding window 2 in blocks 0, 2" in text
    assert ("rope (full blocks: theta 1000, linear scaling 8; sliding blocks: theta 20)"
            in text)
    data = json.loads(ok("kv", "--load", tmp_path, *tokens, "--json").stdout)
    assert data["max_abs_diff"] < 1e-12
    data = json.loads(ok("attn", "--load", tmp_path, *tokens, "--block", 1, "--query", 5,
                         "--backward", "--json").stdout)
    assert data["backward"]["dq_turned_back_model_diff"] < 1e-15


# ---------------------------------------------------------------- linear scaling in LLaMA


def test_a_llama_folder_with_linear_scaling_matches_from_pretrained(tmp_path):
    """LlamaForCausalLM with ``rope_type`` linear (factor 4), as LongChat and other long-context
    LLaMA 2s configure it: read, then held to from_pretrained to 1e-12."""
    transformers = pytest.importorskip("transformers")
    hf_saved(tmp_path, "Llama", dict(
        vocab_size=40, hidden_size=16, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, intermediate_size=24, max_position_embeddings=32,
        rms_norm_eps=1e-6, pad_token_id=None, rope_theta=100.0,
        rope_scaling={"rope_type": "linear", "factor": 4.0}), "float32")
    fields = llama.read_config(tmp_path)
    assert fields["rope_scaling"] == LinearRopeScaling(4.0)
    run_ = tfmcli.load(tmp_path, tokens=[[1, 5, 9, 2, 7, 30], [3, 3, 8]])
    assert_folder_matches_hf(transformers.LlamaForCausalLM, tmp_path, run_, attention=None)
    unscaled = tfmcli.forward(run_.params, run_.inputs, run_.cfg.replace(rope_scaling=None))
    assert abs(unscaled.loss - tfmcli.forward(run_.params, run_.inputs, run_.cfg).loss) > 1e-4


# ---------------------------------------------------------------- Gemma 3 4B+: image and text


def saved_image_and_text(folder, dtype="bfloat16") -> dict:
    """A random Hugging Face Gemma3ForConditionalGeneration (SMALL's language model, a one-layer
    vision tower), drawn as ``hf_saved`` draws, saved in ``dtype`` by its own
    ``save_pretrained``; returns its language model's state in float64 under a text model's
    names (``model.layers...``)."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    vision = dict(model_type="siglip_vision_model", hidden_size=8, intermediate_size=16,
                  num_hidden_layers=1, num_attention_heads=2, image_size=16, patch_size=4)
    config = transformers.Gemma3Config(text_config=SMALL, vision_config=vision,
                                       mm_tokens_per_image=4, boi_token_index=37,
                                       eoi_token_index=38, image_token_index=39)
    model = transformers.Gemma3ForConditionalGeneration(config)
    with torch.no_grad():
        for key, p in model.named_parameters():
            p.normal_(0.0, 0.5)
            if key.endswith("norm.weight"):
                p.add_(1.0)
    model.to(getattr(torch, dtype)).save_pretrained(folder)
    state = model.model.language_model.state_dict()
    return {"model." + k: v.double().numpy() for k, v in state.items()}


def test_an_image_and_text_gemma3_folder_is_read_as_its_language_model(tmp_path,
                                                                        float64_softmax):
    """Gemma 3 4B's layout (``"model_type": "gemma3"``, the weights under
    ``language_model.model.``, a vision tower beside them): the language model's weights to the
    bit, and the model against the language model of ``from_pretrained``'s own
    Gemma3ForConditionalGeneration, to 1e-12."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    state = saved_image_and_text(tmp_path)
    written = json.loads((tmp_path / "config.json").read_text())
    assert written["model_type"] == "gemma3" and "text_config" in written
    fields = gemma3.read_config(tmp_path)
    assert (fields["rope_scaling"], fields["rope_local_theta"], fields["qk_norm"],
            fields["tied_head"], fields["vocab"]) == ((8.0,), 20.0, True, True, 40)
    params = gemma3.load_params(tmp_path, fields, np.float64)
    assert_gemma_weights_read_to_the_bit(params, state, fields)
    run_ = tfmcli.load(tmp_path, tokens=[[1, 5, 9, 2, 7, 30], [3, 3, 8]])
    assert run_.weights_from.startswith("Gemma 3 checkpoint")
    whole = transformers.Gemma3ForConditionalGeneration.from_pretrained(tmp_path)
    model = transformers.Gemma3ForCausalLM(whole.config.text_config)
    model.model.load_state_dict(whole.model.language_model.state_dict())
    model.config._attn_implementation = "eager"
    model = float64_gemma(model.double().eval(), run_.cfg)
    grads = tfm_grads_matching_hf(model, run_.params, run_.inputs, run_.cfg)
    assert_grads_match(grads, sandwich_grads(model))
    assert torch.equal(model.lm_head.weight, model.model.embed_tokens.weight)


@pytest.mark.parametrize("change, reason", [
    (dict(text_config=None), "key 'text_config' is None, not the object"),
    (dict(tie_word_embeddings=False), "key 'tie_word_embeddings' is False and text_config's "
                                      "True; tfm will not guess"),
])
def test_an_image_and_text_gemma3_tfm_cannot_read_is_refused(tmp_path, change, reason):
    saved_image_and_text(tmp_path, "float32")
    config = json.loads((tmp_path / "config.json").read_text())
    config["text_config"]["tie_word_embeddings"] = True
    (tmp_path / "config.json").write_text(json.dumps({**config, **change}))
    line = error_line(run("forward", "--load", tmp_path, "--tokens", "1,2,3"), 1)
    assert reason in line and line.split(": ")[2].endswith("config.json")


def test_an_image_and_text_folder_missing_a_language_weight_names_it(tmp_path):
    """Every vision key is left, but a language model's key still must be there."""
    pytest.importorskip("safetensors")
    from safetensors.numpy import load_file, save_file

    saved_image_and_text(tmp_path, "float32")
    tensors = load_file(tmp_path / "model.safetensors")
    assert any(key.startswith("vision_tower.") for key in tensors)
    del tensors["language_model.model.layers.1.self_attn.k_norm.weight"]
    save_file(tensors, tmp_path / "model.safetensors")
    line = error_line(run("forward", "--load", tmp_path, "--tokens", "1,2,3"), 1)
    assert line.endswith("missing key 'model.layers.1.self_attn.k_norm.weight' (of its "
                         "language model)")
