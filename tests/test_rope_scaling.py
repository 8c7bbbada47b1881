"""LLaMA 3.1's scaled RoPE (``rope_scaling``, ``--rope-scaling``, ``rope_type`` "llama3"): each
pair's frequency against hand-worked numbers and Hugging Face's own ``_compute_llama3_parameters``;
the model at random O(1) parameters against central differences, the torch reference and
Hugging Face's LlamaForCausalLM configured as LLaMA 3.2; the KV cache, the fast path, the
Config's JSON, the command line, ``tfm pe --rope`` and checkpoint folders that carry it.
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
from tfmcli.engine import positional
from tfmcli.engine.config import RopeScaling
from tfmcli.errors import ConfigError

LLAMA = dict(pe="rope", activation="swiglu", rms_norm=True, head_bias=False, bias=False)
# d_head 8 at base 100: the four pairs' wavelengths 2 pi 100^(i/4) are 6.28, 19.9, 62.8 and
# 199 positions. With C = 128, low 1, high 4: pairs 0 and 1 are under C / 4 = 32 (kept),
# pair 3 over C / 1 = 128 (slowed 4 times), pair 2 between (blended): every band is used.
SCALING = (4.0, 1.0, 4.0, 128)


def scaled_cfg(**fields):
    base = dict(d_model=32, heads=4, kv_heads=2, seq_len=6, lengths=(6, 4), d_ff=12,
                rope_theta=100.0, rope_scaling=SCALING, **LLAMA)
    return tfmcli.Config(**{**base, **fields})


# ---------------------------------------------------------------- each pair's frequency


def test_each_pairs_scale_by_hand():
    """Pair 2: lambda = 2 pi 100^(1/2) = 62.83; s = (128 / 62.83 - 1) / (4 - 1) = 0.345728;
    its frequency times (1 - s) / 4 + s = 0.25 + 0.75 s = 0.509296."""
    scale = positional.rope_scale(8, 100.0, SCALING)
    assert scale[0] == 1.0 and scale[1] == 1.0 and scale[3] == 0.25   # exactly
    assert scale[2] == pytest.approx(0.509296, abs=1e-6)
    angles = positional.rope_angles(6, 8, 100.0, SCALING)             # (T, pairs)
    np.testing.assert_array_equal(angles[:, :2], positional.rope_angles(6, 8, 100.0)[:, :2])
    assert angles[5, 3] == pytest.approx(5 / 100 ** 0.75 / 4, rel=1e-15)   # t 5, slowed 4x
    assert positional.rope_angles(6, 8, 100.0, None) is not None
    np.testing.assert_array_equal(positional.rope_angles(9, 6), positional.rope_angles(9, 6, 1e4))


@pytest.mark.parametrize("d_head, base, scaling", [
    (8, 100.0, SCALING),
    (64, 500000.0, (32.0, 1.0, 4.0, 8192)),
    (128, 500000.0, (8.0, 1.0, 4.0, 8192)),
    (6, 10000.0, (2.5, 0.5, 3.0, 300)),
], ids=["test", "llama-3.2-1b", "llama-3.1-8b", "odd-factors"])
def test_the_frequencies_equal_hugging_faces(d_head, base, scaling):
    """transformers' own llama3 frequencies (made in float32) are tfm's to float32's rounding."""
    pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = transformers.LlamaConfig(
        hidden_size=2 * d_head, num_attention_heads=2, max_position_embeddings=2 * scaling[3],
        rope_parameters={"rope_type": "llama3", "rope_theta": base,
                         **RopeScaling(*scaling)._asdict()})
    theirs, attention_factor = ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")
    ours = 1 / base ** (np.arange(0, d_head, 2) / d_head) * positional.rope_scale(d_head, base,
                                                                                   scaling)
    np.testing.assert_allclose(theirs.double().numpy(), ours, rtol=1e-6)
    assert attention_factor == 1.0   # llama3 leaves cos and sin at their size


# ---------------------------------------------------------------- the model


@pytest.mark.parametrize("fields", [dict(), dict(norm="post", layers=2, kv_heads=None),
                                    dict(causal=False, rope_scaling=(2.5, 0.5, 3.0, 300))],
                         ids=["llama", "post-L2", "bidirectional-other-factors"])
def test_gradients_match_central_differences_at_random_parameters(fields):
    assert_gradcheck_passes(scaled_cfg(**fields))


def test_matches_the_torch_reference_at_random_parameters():
    for fields in (dict(), dict(norm="post", rope_theta=10.0), dict(dtype="float32")):
        assert torch_reference_rows(scaled_cfg(**fields), seed=9)


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_matches_hugging_face_llama_as_llama_3_2_configures_it(tied):
    """LlamaForCausalLM with ``rope_type`` llama3 (its frequencies made by transformers, then
    carried to float64): loss, logits and every gradient at random parameters, padding
    included. Scaling left out, the loss moves: the test sees it."""
    pytest.importorskip("torch")
    cfg = scaled_cfg(layers=2, tied_head=tied)
    params = random_params(tfmcli.init_params(cfg), seed=12)
    inputs = tfmcli.make_inputs(cfg)
    model = llama_from(params, cfg)
    grads = tfm_grads_matching_hf(model, params, inputs, cfg)
    assert_grads_match(grads, llama_grads(model))
    unscaled = tfmcli.forward(params, inputs, cfg.replace(rope_scaling=None)).loss
    assert abs(unscaled - tfmcli.forward(params, inputs, cfg).loss) > 1e-4


def test_kv_cache_and_fast_path_turn_by_the_scaled_angles():
    decoded_like_the_forward(scaled_cfg(batch=1, lengths=None, layers=2), 7, [3, 1, 4, 1, 5, 2])
    cfg = scaled_cfg(batch=3, seq_len=9, lengths=(9, 4, 7), layers=2)
    params = random_params(tfmcli.init_params(cfg), seed=6)
    assert_fast_equals_reference(cfg, params, tfmcli.make_inputs(cfg))


# ---------------------------------------------------------------- the Config


def test_four_numbers_or_hugging_faces_dict_make_the_same_config():
    by_numbers = scaled_cfg(rope_scaling=[4, 1, 4, 128.0])
    by_name = scaled_cfg(rope_scaling={"rope_type": "llama3", "factor": 4, "low_freq_factor": 1,
                                       "high_freq_factor": 4,
                                       "original_max_position_embeddings": 128})
    assert by_numbers == by_name == scaled_cfg()
    assert by_name.rope_scaling.original_max_position_embeddings == 128
    written = json.loads(by_name.to_json())["rope_scaling"]
    assert written == {"factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                       "original_max_position_embeddings": 128}
    assert tfmcli.Config.from_json(by_name.to_json()) == by_name
    assert json.loads(tfmcli.Config().to_json())["rope_scaling"] is None


@pytest.mark.parametrize("value, reason", [
    ((4, 1, 4), "rope_scaling must be four numbers"),
    ((0, 1, 4, 128), "rope_scaling's factor must be a positive finite number, got 0"),
    ((4, 2, 2, 128), "high_freq_factor (2) must be above its low_freq_factor (2)"),
    ((4, 1, 4, 12.5), "original_max_position_embeddings must be a positive integer, got 12.5"),
    ((4, float("nan"), 4, 128), "low_freq_factor must be a positive finite number, got nan"),
    ({"rope_type": "yarn", "factor": 4}, "(rope_type llama3), got 'yarn'"),
])
def test_a_bad_scaling_names_what_is_wrong(value, reason):
    with pytest.raises(ConfigError, match=None) as e:
        scaled_cfg(rope_scaling=value)
    assert e.value.field == "rope_scaling" and reason in str(e.value)


def test_saved_and_loaded_with_its_scaling(tmp_path):
    cfg = scaled_cfg(lengths=None)
    path = tmp_path / "run.npz"
    ok("forward", "-d", 32, "-H", 4, "--kv-heads", 2, "-T", 6, "--d-ff", 12, "--pe", "rope",
       "--rope-theta", 100, "--rope-scaling", "4,1,4,128", "--activation", "swiglu",
       "--rms-norm", "--no-bias", "--no-head-bias", "--save", path)
    out = json.loads(ok("forward", "--load", path, "--json").stdout)
    assert out["config"]["rope_scaling"]["factor"] == 4.0
    params = {k[6:]: v for k, v in np.load(path).items() if k.startswith("param/")}
    assert out["loss"] == pytest.approx(
        tfmcli.forward(params, tfmcli.make_inputs(cfg), cfg).loss, rel=1e-12)


# ---------------------------------------------------------------- the command line


def test_rope_scaling_on_the_command_line():
    assert error_line(run("forward", "--rope-scaling", "8,1,4,8192"), 2) == (
        "tfm forward: error: Invalid value for '--rope-scaling': it sets RoPE's scaling, and "
        "this model's --pe is sinusoidal; add --pe rope")
    assert "is not one number (linear scaling's factor, Gemma 3's 8) or four comma-separated " \
           "numbers" in error_line(run("forward", "--pe", "rope", "--rope-scaling", "8,1,4"), 2)
    assert "high_freq_factor (1) must be above its low_freq_factor (4)" in error_line(
        run("forward", "--pe", "rope", "--rope-scaling", "8,4,1,8192"), 2)
    panel = ok("forward", "--pe", "rope", "--rope-theta", 500000, "--rope-scaling",
               "32,1,4,8192").stdout
    assert "rope (theta 500000, llama3 scaling 32,1,4,8192)" in panel
    assert error_line(run("pe", "--rope-scaling", "8,1,4,8192"), 2).endswith(
        "it sets RoPE's scaling; add --rope")


def test_tfm_pe_rope_scaling_slows_the_slow_pairs():
    flags = ["pe", "--rope", "-d", 8, "--len", 6, "--rope-theta", 100]
    plain = json.loads(ok(*flags, "--json").stdout)
    scaled = json.loads(ok(*flags, "--rope-scaling", "4,1,4,128", "--json").stdout)
    assert "scale" not in plain
    np.testing.assert_allclose(scaled["scale"], positional.rope_scale(8, 100.0, SCALING))
    angles, before = np.array(scaled["angles"]), np.array(plain["angles"])
    np.testing.assert_array_equal(angles[:, :2], before[:, :2])
    assert_scaled_close(angles[:, 3], before[:, 3] / 4)
    text = ok(*flags, "--rope-scaling", "4,1,4,128").stdout
    text = " ".join(text.split())
    assert "kept (s_i = 1) for pairs 0-1, wavelength under C / 4 = 32 positions" in text
    assert "slowed 4 times (s_i = 1/4) for pair 3, over C / 1 = 128" in text
    assert "blended for pair 2, between (s_i 0.509)" in text


def test_train_takes_the_scaling():
    out = json.loads(ok("train", "--steps", 3, "--pe", "rope", "--rope-scaling", "4,1,4,128",
                        "--json").stdout)
    assert out["config"]["rope_scaling"]["original_max_position_embeddings"] == 128
