"""Sliding-window attention (``sliding_window``, ``--sliding-window W``: each query sees only the
last W keys, itself included; Mistral's, and Qwen2's with ``use_sliding_window``). The mask by
hand; the model at random O(1) parameters against central differences, the torch reference,
its own reference path and Hugging Face's MistralForCausalLM and Qwen2ForCausalLM; the KV
cache as a rolling buffer; Mistral and Qwen2 folders written by ``save_pretrained``; the views.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

import tfmcli
from helpers import (
    assert_fast_equals_reference,
    assert_folder_matches_hf,
    assert_gradcheck_passes,
    assert_grads_match,
    assert_scaled_close,
    decoded_like_the_forward,
    error_line,
    grid_rows,
    hf_saved,
    llama_from,
    llama_grads,
    ok,
    random_params,
    run,
    tfm_grads_matching_hf,
    torch_reference_rows,
)
from tfmcli.engine.masks import combined_mask, sliding_window_mask
from tfmcli.errors import ConfigError
from tfmcli.sources import llama, mistral, qwen2

MISTRAL = dict(pe="rope", activation="swiglu", rms_norm=True, head_bias=False, bias=False)


def window_cfg(**fields):
    base = dict(d_model=16, heads=4, kv_heads=2, seq_len=6, lengths=(6, 4), d_ff=12,
                sliding_window=2, **MISTRAL)
    return tfmcli.Config(**{**base, **fields})


# ---------------------------------------------------------------- the mask


def test_the_window_mask_by_hand():
    """Query t sees keys t - W + 1 .. t: W = 2 on 4 positions is the diagonal and the one
    below it; W = 1 the diagonal; W at least T the causal mask."""
    assert sliding_window_mask(4, 2).astype(int).tolist() == [
        [1, 0, 0, 0],
        [1, 1, 0, 0],
        [0, 1, 1, 0],
        [0, 0, 1, 1]]
    np.testing.assert_array_equal(sliding_window_mask(5, 1), np.eye(5, dtype=bool))
    np.testing.assert_array_equal(sliding_window_mask(5, 5), np.tril(np.ones((5, 5), bool)))
    np.testing.assert_array_equal(combined_mask([5, 3], 5, window=9), combined_mask([5, 3], 5))


def test_a_padded_query_sees_what_the_rows_last_real_query_sees():
    """Row of length 3 on 6 positions, W = 2: queries 0-2 as the window says; the padded
    queries 3-5 see keys 1 and 2, as query 2 does, never an empty row."""
    mask = combined_mask([6, 3], 6, window=2)
    assert mask[1].astype(int).tolist() == [
        [1, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0],
        [0, 1, 1, 0, 0, 0],
        [0, 1, 1, 0, 0, 0],
        [0, 1, 1, 0, 0, 0],
        [0, 1, 1, 0, 0, 0]]
    np.testing.assert_array_equal(mask[0], sliding_window_mask(6, 2))
    with pytest.raises(ValueError, match="causal"):
        combined_mask([6], 6, causal=False, window=2)


@pytest.mark.parametrize("value, reason", [
    (0, "sliding_window must be a positive integer, got 0"),
    (True, "sliding_window must be a positive integer, got True"),
    (2.5, "sliding_window must be a positive integer, got 2.5")])
def test_a_window_must_be_a_positive_integer(value, reason):
    with pytest.raises(ConfigError, match=reason):
        tfmcli.Config(sliding_window=value)


def test_a_window_needs_a_causal_model():
    with pytest.raises(ConfigError) as e:
        tfmcli.Config(sliding_window=2, causal=False)
    assert e.value.field == "sliding_window" and "must be causal" in str(e.value)


# ---------------------------------------------------------------- the model


def test_mistral_7b_has_its_parameter_count():
    """mistralai/Mistral-7B-v0.1's sizes (its config.json): 7,241,732,096 parameters."""
    cfg = tfmcli.Config(d_model=4096, heads=32, kv_heads=8, layers=32, d_ff=14336, vocab=32000,
                        sliding_window=4096, **MISTRAL)
    assert tfmcli.engine.sizes.param_count(cfg) == 7_241_732_096


@pytest.mark.parametrize("fields", [
    dict(),
    dict(sliding_window=1, norm="post", layers=2, kv_heads=None),
    dict(sliding_window=3, pe="sinusoidal", activation="relu", rms_norm=False, bias=True,
         head_bias=True, lengths=(6, 2)),
], ids=["mistral-W2", "post-L2-W1", "layernorm-biases-W3"])
def test_gradients_match_central_differences_at_random_parameters(fields):
    assert_gradcheck_passes(window_cfg(**fields))


def test_the_window_changes_the_numbers():
    """Drop the window and the loss moves, while a window as long as the text changes nothing:
    the mask really is applied, and only where it hides something."""
    cfg = window_cfg()
    params = random_params(tfmcli.init_params(cfg), seed=5)
    inputs = tfmcli.make_inputs(cfg)
    loss = tfmcli.forward(params, inputs, cfg).loss
    assert abs(loss - tfmcli.forward(params, inputs, cfg.replace(sliding_window=None)).loss) > 1e-3
    assert tfmcli.forward(params, inputs, cfg.replace(sliding_window=6)).loss == \
        tfmcli.forward(params, inputs, cfg.replace(sliding_window=None)).loss
    pattern = tfmcli.forward(params, inputs, cfg).acts["blocks.0.attn.pattern"]   # (B, H, T, T)
    assert (pattern[0, :, 4, :3] == 0).all() and (pattern[0, :, 4, 3:5] > 0).all()


@pytest.mark.parametrize("fields", [
    dict(batch=2, seq_len=300, lengths=(300, 150), sliding_window=37, d_model=32),
    dict(batch=2, seq_len=260, lengths=(260, 7), sliding_window=200, d_model=32),
    dict(batch=1, seq_len=130, lengths=None, sliding_window=1, dtype="float64"),
], ids=["W37-T300-padded", "W200-T260-short-row", "W1"])
def test_the_fast_path_equals_the_reference(fields):
    """Query blocks of 128 whose early keys the window hides: the fast path adds the mask over
    them and equals the reference path to 1e-12."""
    cfg = window_cfg(**fields)
    assert_fast_equals_reference(cfg, random_params(tfmcli.init_params(cfg), seed=2),
                                 tfmcli.make_inputs(cfg))


def test_matches_the_torch_reference_at_random_parameters():
    for fields in (dict(), dict(norm="post", sliding_window=3), dict(dtype="float32"),
                   dict(pe="learned", lengths=(2, 6))):
        torch_reference_rows(window_cfg(**fields), seed=11)


@pytest.mark.parametrize("qwen2", [False, True], ids=["mistral", "qwen2"])
def test_matches_hugging_face(qwen2):
    """MistralForCausalLM (``sliding_window``) and Qwen2ForCausalLM (``use_sliding_window``,
    every layer from 0) holding tfm's random parameters: loss, logits and every gradient, with
    a window of 2 over 6 tokens and a padded row."""
    pytest.importorskip("torch")
    fields = dict(qkv_bias=True) if qwen2 else {}
    cfg = window_cfg(layers=2, **fields)
    params = random_params(tfmcli.init_params(cfg), seed=12)
    model = llama_from(params, cfg, qwen2=qwen2, mistral=not qwen2)
    assert type(model).__name__ == ("Qwen2ForCausalLM" if qwen2 else "MistralForCausalLM")
    grads = tfm_grads_matching_hf(model, params, tfmcli.make_inputs(cfg), cfg)
    theirs = llama_grads(model)
    assert set(theirs) == set(params)
    assert_grads_match(grads, theirs)


# ---------------------------------------------------------------- the KV cache


@pytest.mark.parametrize("window", [1, 3, 20])
def test_the_cache_is_a_rolling_buffer_and_equals_the_forward(window):
    """Decoding 9 tokens with a window of W: every step equals the full forward's logits, the
    cache holds min(t + 1, W) positions, and each step's attention is 0 before its window."""
    cfg = window_cfg(sliding_window=window, seq_len=9, lengths=None, batch=1, vocab=10)
    tokens = [3, 1, 4, 1, 5, 9, 2, 6, 5]
    _, steps, fwd = decoded_like_the_forward(cfg, 6, tokens)
    assert [s.cache_shape[1] for s in steps] == [min(t + 1, window) for t in range(9)]
    pattern = fwd.acts["blocks.0.attn.pattern"][0]                        # (H, T, T)
    for s in steps:
        start = max(0, s.step - window + 1)
        weights = s.attention[(0, 1)]
        assert weights.shape == (s.step + 1,) and (weights[:start] == 0).all()
        np.testing.assert_allclose(weights, pattern[1, s.step, :s.step + 1], rtol=0, atol=1e-12)
    # the last step attends to min(9, W) keys, not 9
    assert steps[-1].flops_cached == tfmcli.engine.kv.step_flops(cfg, min(9, window))


def test_tfm_kv_shows_the_rolling_buffer():
    out = json.loads(ok("kv", "--tokens", "3,1,4,1,5,9", "-V", 10, "--sliding-window", 2,
                        "--json").stdout)
    assert [s["cache_len"] for s in out["steps"]] == [1, 2, 2, 2, 2, 2]
    assert out["cache_numbers"] == 2 * 1 * 2 * 2 * 3   # K and V, 1 block, H 2, 2 slots, d_head 3
    assert out["steps"][4]["attention"][:3] == [0, 0, 0]
    text = ok("kv", "--tokens", "3,1,4,1,5,9", "-V", 10, "--sliding-window", 2).stdout
    assert "(H, min(step + 1, 2), d_head)" in text
    assert "position t in slot t mod 2 (a rolling buffer)" in " ".join(text.split())
    text = ok("kv", "--tokens", "3,1,4", "-V", 10, "--sliding-window", 3).stdout
    assert "sliding window 3: as long as the 3 positions or longer, so the cache keeps every " \
        "one" in " ".join(text.split())


# ---------------------------------------------------------------- the command line


def test_tfm_mask_draws_the_window():
    text = ok("mask", "--len", 5, "--sliding-window", 2).stdout
    assert "causal, sliding window 2" in text
    assert grid_rows(text, ["q0", "q1", "q2", "q3", "q4"])[3][:5] == ["·", "·", "●", "●", "·"]
    out = json.loads(ok("mask", "--len", 5, "--lengths", "5,2", "--sliding-window", 2,
                        "--json").stdout)
    assert out["sliding_window"] == sliding_window_mask(5, 2).tolist()
    assert out["causal"] == np.tril(np.ones((5, 5), bool)).tolist()       # still the look-ahead
    assert out["combined"][1][4] == [True, True, False, False, False]     # padded: as query 1
    assert "sliding_window" not in json.loads(ok("mask", "--len", 5, "--json").stdout)


@pytest.mark.parametrize("args, line", [
    (("mask", "--no-causal", "--sliding-window", 2),
     "tfm mask: error: Invalid value for '--sliding-window': a sliding window hides the keys "
     "far behind each query, so the mask must be causal; drop --no-causal"),
    (("forward", "--no-causal", "--sliding-window", 2),
     "tfm forward: error: Invalid value for '--sliding-window': a sliding window hides the keys "
     "far behind each query, so the model must be causal"),
    (("forward", "--sliding-window", 0),
     "tfm forward: error: Invalid value for '--sliding-window': 0 is not allowed (allowed: 1 or "
     "more)"),
])
def test_bad_windows_are_usage_errors(args, line):
    assert error_line(run(*args), 2) == line


def test_the_panel_the_attention_map_and_train():
    text = ok("forward", "-T", 6, "--sliding-window", 2, "--show", "blocks.0.attn.pattern").stdout
    assert "causal, sliding window 2" in text
    table = text[text.index("blocks.0.attn.pattern[0, 0]"):]
    rows = [line.split()[1:] for line in table.splitlines() if line.startswith("q")]
    assert [cell == "·" for cell in rows[4]] == [True, True, True, False, False, True]
    out = json.loads(ok("train", "--steps", 3, "--sliding-window", 1, "--json").stdout)
    assert out["config"]["sliding_window"] == 1


def test_the_explained_query_sees_only_its_window():
    from tfmcli.explain import steps

    cfg = window_cfg(sliding_window=3, batch=1, lengths=None)
    params = random_params(tfmcli.init_params(cfg), seed=1)
    fwd = tfmcli.forward(params, tfmcli.make_inputs(cfg), cfg)
    q = steps.explain_query(fwd, cfg, block=0, head=2, row=0, t=5)
    assert q.visible.tolist() == [False, False, False, True, True, True]
    assert_scaled_close(q.weights, fwd.acts["blocks.0.attn.pattern"][0, 2, 5], floor=1e-15)


# ---------------------------------------------------------------- checkpoint folders


SMALL = dict(vocab_size=40, hidden_size=16, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, intermediate_size=24, max_position_embeddings=32,
             rms_norm_eps=1e-6)


@pytest.mark.parametrize("kind, config, window, layers", [
    ("mistral", dict(sliding_window=3), 3, None),
    ("mistral", dict(sliding_window=None, tie_word_embeddings=True), None, None),
    ("qwen2", dict(use_sliding_window=True, sliding_window=2, max_window_layers=0), 2, None),
    ("qwen2", dict(use_sliding_window=True, sliding_window=2, max_window_layers=1), 2, (1,)),
    ("qwen2", dict(use_sliding_window=True, sliding_window=2,
                   layer_types=["sliding_attention", "full_attention"]), 2, (0,)),
], ids=["mistral-W3", "mistral-no-window-tied", "qwen2-every-layer-W2",
        "qwen2-from-layer-1-W2", "qwen2-layer-types-W2"])
def test_a_folder_matches_from_pretrained(tmp_path, kind, config, window, layers):
    """tfm --load and Hugging Face's from_pretrained on one bfloat16 folder: the window and the
    layers it slides in (``max_window_layers``, ``layer_types``) read from config.json, loss,
    logits and every gradient to 1e-12, a padded row included: its rows of 6 and 4 tokens run
    past the window of 2."""
    transformers = pytest.importorskip("transformers")
    name = {"mistral": "Mistral", "qwen2": "Qwen2"}[kind]
    hf_saved(tmp_path, name, {**SMALL, **config})
    Model = getattr(transformers, name + "ForCausalLM")
    assert json.loads((tmp_path / "config.json").read_text())["model_type"] == kind
    run_ = tfmcli.load(tmp_path, tokens=[[1, 5, 9, 2, 7, 30], [3, 3, 8, 4]])
    assert run_.cfg.sliding_window == window and run_.cfg.sliding_layers == layers
    assert run_.weights_from.startswith("Mistral checkpoint" if kind == "mistral" else "Qwen2")
    assert_folder_matches_hf(Model, tmp_path, run_)


def test_a_mistral_folder_is_read_to_the_bit(tmp_path):
    transformers = pytest.importorskip("transformers")
    import torch

    hf_saved(tmp_path, "Mistral", {**SMALL, "sliding_window": 4}, "float32")
    fields = mistral.read_config(tmp_path)
    params = mistral.load_params(tmp_path, fields, np.float64)
    state = transformers.MistralForCausalLM.from_pretrained(tmp_path).state_dict()
    for key, name, transposed in llama.name_map(fields):
        want = state[key].to(torch.float64).numpy()
        np.testing.assert_array_equal(params[name], want.T if transposed else want, err_msg=key)
    assert fields["sliding_window"] == 4 and not fields["bias"] and not fields["qkv_bias"]


@pytest.mark.parametrize("kind, change, reason", [
    ("qwen2", dict(layer_types=["sliding_attention"] * 3, sliding_window=2,
                   use_sliding_window=True),
     "key 'layer_types' names 3 layers, and 'num_hidden_layers' is 2"),
    ("mistral", dict(layer_types=["full_attention", "sliding_attention"], sliding_window=2),
     "key 'layer_types' has 'full_attention' layers, which Hugging Face's Mistral does not "
     "read (its window is in every layer)"),
    ("mistral", dict(layer_types=["full_attention"] * 2, sliding_window=2),
     "key 'layer_types' has 'full_attention' layers, which Hugging Face's Mistral does not "
     "read"),
    ("mistral", dict(layer_types=["chunked_attention"] * 2),
     "key 'layer_types' has 'chunked_attention'; tfm's layers are 'full_attention' or "
     "'sliding_attention'"),
    ("mistral", dict(sliding_window=0), "key 'sliding_window' is 0, not a positive whole number"),
    ("qwen2", dict(use_sliding_window="yes", layer_types=None),
     "key 'use_sliding_window' is 'yes', not true or false"),
])
def test_a_window_tfm_cannot_place_is_refused(tmp_path, kind, change, reason):
    hf_saved(tmp_path, {"mistral": "Mistral", "qwen2": "Qwen2"}[kind], SMALL, "float32")
    config = json.loads((tmp_path / "config.json").read_text())
    config = {k: v for k, v in {**config, **change}.items() if v is not None}
    (tmp_path / "config.json").write_text(json.dumps(config))
    line = error_line(run("forward", "--load", tmp_path, "--tokens", "1,2,3"), 1)
    assert reason in line and line.split(": ")[2].endswith("config.json")


def test_qwen2_without_use_sliding_window_has_none(tmp_path):
    """Qwen2.5's own configs carry a ``sliding_window`` (32768) with ``use_sliding_window``
    false: no layer slides."""
    hf_saved(tmp_path, "Qwen2", SMALL, "float32")
    config = json.loads((tmp_path / "config.json").read_text())
    config = {k: v for k, v in config.items() if k != "layer_types"}
    (tmp_path / "config.json").write_text(json.dumps(
        {**config, "sliding_window": 32768, "use_sliding_window": False, "max_window_layers": 21}))
    assert qwen2.read_config(tmp_path)["sliding_window"] is None
    # Qwen2Config drops the window without use_sliding_window, whatever layer_types says
    (tmp_path / "config.json").write_text(json.dumps(
        {**config, "sliding_window": 2, "layer_types": ["sliding_attention"] * 2}))
    assert qwen2.read_config(tmp_path)["sliding_window"] is None
