"""The KV cache: decoding one token at a time equals the full causal forward, step by step."""

import json
import re

import numpy as np
import pytest

import tfmcli
from helpers import error_line, ok, random_params, run
from tfmcli.engine.kv import decode, step_flops
from tfmcli.engine.sizes import flops


@pytest.fixture(autouse=True)
def plain_env(monkeypatch):
    for name in ("NO_COLOR", "FORCE_COLOR", "COLUMNS"):
        monkeypatch.delenv(name, raising=False)


@pytest.mark.parametrize("norm, activation, pe", [("pre", "relu", "sinusoidal"),
                                                  ("post", "gelu", "sinusoidal"),
                                                  ("pre", "gelu", "none")])
def test_every_step_equals_the_full_forward_at_random_parameters(norm, activation, pe):
    cfg = tfmcli.Config(batch=1, seq_len=9, layers=3, heads=3, norm=norm,
                        activation=activation, pe=pe)
    params = random_params(tfmcli.init_params(cfg), seed=4)
    inputs = tfmcli.make_inputs(cfg)
    fwd = tfmcli.forward(params, inputs, cfg)
    steps = decode(params, inputs.tokens[0], cfg)
    assert [s.step for s in steps] == list(range(9))
    assert [s.cache_shape for s in steps] == [(3, t + 1, 2) for t in range(9)]
    for s in steps:
        np.testing.assert_allclose(s.logits, fwd.acts["logits"][0, s.step], rtol=0, atol=1e-12)
        for (b, h), weights in s.attention.items():
            expected = fwd.acts[f"blocks.{b}.attn.pattern"][0, h, s.step, :s.step + 1]
            np.testing.assert_allclose(weights, expected, rtol=0, atol=1e-12)
    assert float(np.abs(fwd.acts["logits"]).max()) > 0.1   # a comparison of something


def test_each_step_counts_its_own_flops_and_those_of_the_prefix_recomputed():
    """Step t attends to t + 1 keys; recomputing instead runs the forward of all t + 1 tokens,
    whose attention is (t + 1) x (t + 1). The README's `tfm kv -L 2` shows the first three."""
    cfg = tfmcli.Config(batch=1, seq_len=5, layers=2)
    d, F, V, L = 6, 24, 8, 2
    steps = decode(tfmcli.init_params(cfg), [3, 1, 4, 1, 5], cfg)
    per_token = L * (8 * d * d + 4 * d * F) + 2 * d * V         # projections, FFN and head
    for s in steps:
        keys = s.step + 1
        assert s.flops_cached == step_flops(cfg, keys) == per_token + L * 4 * keys * d
        assert s.flops_full == keys * per_token + L * 4 * keys * keys * d
    assert [s.flops_cached for s in steps[:3]] == [1872, 1920, 1968]
    assert [s.flops_full for s in steps[:3]] == [1872, 3840, 5904]
    # the first step has nothing cached: it is the full forward of one token
    assert step_flops(cfg, 1) == flops(cfg.replace(batch=1, seq_len=1))[0]


def test_cli_kv_json_checks_each_step():
    data = json.loads(ok("kv", "--tokens", "3,1,4,1,5,7", "-L", 2, "--norm", "post",
                         "--json").stdout)
    steps = data["steps"]
    assert [s["cache_len"] for s in steps] == [1, 2, 3, 4, 5, 6]
    assert [s["token"] for s in steps] == [3, 1, 4, 1, 5, 7]
    assert max(s["max_abs_diff"] for s in steps) <= 1e-12
    assert data["flops"]["with_cache"] == sum(s["flops_cached"] for s in steps)
    assert data["flops"]["without_cache"] > 3 * data["flops"]["with_cache"]
    assert all(abs(sum(s["attention"]) - 1) < 1e-12 for s in steps)


def test_cli_kv_decodes_a_padded_row_to_its_length_and_loads_files(tmp_path):
    data = json.loads(ok("kv", "--tokens", "3,1,4,1,5", "--tokens", "2,7", "--row", 1,
                         "--json").stdout)
    assert [s["token"] for s in data["steps"]] == [2, 7]
    path = tmp_path / "run.npz"
    ok("forward", "--seed", 3, "-L", 2, "-T", 6, "-B", 1, "--save", path)
    data = json.loads(ok("kv", "--load", path, "--json").stdout)
    cfg = tfmcli.Config(seed=3, layers=2, seq_len=6, batch=1)
    assert data["tokens"] == tfmcli.make_inputs(cfg).tokens[0].tolist()
    assert data["max_abs_diff"] <= 1e-12


def test_cli_kv_prints_the_steps_and_the_attention_rows():
    out = ok("kv", "--tokens", "3,1,4,1,5,7,2,6").stdout
    assert "K, V cache" in out and "(2, 8, 3)" in out
    assert "q7:6" in out and "k5:7" in out
    assert "every step equals the full causal forward" in out


def test_cli_kv_draws_the_attention_rows_on_a_fixed_scale_from_0_to_1():
    """Each row is one query's weights, which sum to 1: the scale does not follow the data.
    At 40 steps the map is drawn in shades, with its legend."""
    out = ok("kv", "-T", 40).stdout
    assert "scale [  ] 0.00  [░░] 0.25  [▒▒] 0.50  [▓▓] 0.75  [██] 1.00" in out


def test_kv_needs_a_causal_model():
    line = error_line(run("kv", "--no-causal"), 2)
    assert "'--causal'" in line and "must be causal" in line


def test_decode_refuses_a_model_that_is_not_causal_and_ids_outside_the_vocabulary():
    cfg = tfmcli.Config(batch=1, seq_len=3)
    params = tfmcli.init_params(cfg)
    with pytest.raises(tfmcli.ConfigError, match="needs a causal model") as caught:
        decode(params, [1, 2], cfg.replace(causal=False))
    assert caught.value.field == "causal"
    for tokens, reason in (([1, -1], "token -1 is outside 0..7 (vocab 8)"),
                           ([9], "token 9 is outside 0..7"), ([8], "token 8 is outside"),
                           ([[1, 2]], "shape (1, 2)"), ([], "shape (0,)")):
        with pytest.raises(tfmcli.InputsError, match=re.escape(reason)):
            decode(params, tokens, cfg)


# ---------------------------------------------------------------- generating


def greedy_by_full_forwards(params, tokens, cfg, n):
    """The oracle without a cache: the whole forward of the sequence so far, n times, each
    time appending the argmax of its last position's logits."""
    def logits(ids):
        run_cfg = cfg.replace(batch=1, seq_len=len(ids), lengths=None)
        fwd = tfmcli.forward(params, tfmcli.inputs_from_tokens(ids), run_cfg, fast=False)
        return fwd.acts["logits"][0]

    ids = list(tokens)
    for _ in range(n):
        ids.append(int(np.argmax(logits(ids)[-1])))
    return ids, logits(ids)


@pytest.mark.parametrize("norm, pe", [("pre", "sinusoidal"), ("post", "learned"),
                                      ("pre", "none")])
def test_generated_tokens_are_the_full_forwards_greedy_choices(norm, pe):
    cfg = tfmcli.Config(batch=1, seq_len=4, layers=2, heads=3, norm=norm, pe=pe, vocab=7,
                        n_ctx=12 if pe == "learned" else None)
    params = random_params(tfmcli.init_params(cfg), seed=10)   # a seed whose choices vary
    prompt = [3, 1, 4, 1]
    steps = decode(params, prompt, cfg, generate=6)
    ids, logits = greedy_by_full_forwards(params, prompt, cfg, 6)
    assert [s.token for s in steps] == ids[:10]
    assert [s.step for s in steps] == list(range(10))
    assert steps[-1].cache_shape == (3, 10, 2)
    assert len(set(ids[4:])) > 1   # the model does not just repeat one token
    for s in steps:
        np.testing.assert_allclose(s.logits, logits[s.step], rtol=0, atol=1e-12)


def test_generate_0_is_the_given_tokens_alone_and_bad_counts_are_refused():
    cfg = tfmcli.Config(batch=1, seq_len=3)
    params = random_params(tfmcli.init_params(cfg))
    plain = decode(params, [1, 2, 3], cfg)
    assert [s.token for s in decode(params, [1, 2, 3], cfg, generate=0)] == [1, 2, 3]
    assert len(plain) == 3
    for bad in (-1, 1.5, True, "2"):
        with pytest.raises(ValueError, match="whole number at least 0"):
            decode(params, [1, 2], cfg, generate=bad)
    learned = cfg.replace(pe="learned", n_ctx=5)
    params = tfmcli.init_params(learned)
    assert len(decode(params, [1, 2], learned, generate=3)) == 5
    for tokens, n in (([1, 2], 4), ([1] * 6, 0)):
        with pytest.raises(tfmcli.InputsError, match=f"need {len(tokens) + n} positions; the "
                                                     f"model has 5 learned positions"):
            decode(params, tokens, learned, generate=n)


def test_cli_kv_generates_with_the_cache_and_checks_each_step_against_the_full_forward():
    data = json.loads(ok("kv", "--tokens", "3,1,4", "-L", 2, "--generate", 5, "--json").stdout)
    cfg = tfmcli.Config(layers=2, batch=1, seq_len=3)
    ids, logits = greedy_by_full_forwards(tfmcli.init_params(cfg), [3, 1, 4], cfg, 5)
    assert data["tokens"] == ids and data["generated"] == ids[3:]
    # each generated token's probability after the step before: the largest of that softmax
    probs = np.exp(logits - logits.max(axis=1, keepdims=True))
    probs /= probs.sum(axis=1, keepdims=True)
    expected = [probs[t - 1, ids[t]] for t in range(3, 8)]
    np.testing.assert_allclose(data["generated_probability"], expected, rtol=1e-12)
    assert all(p == probs[t - 1].max() for p, t in zip(expected, range(3, 8)))
    assert [s["cache_len"] for s in data["steps"]] == list(range(1, 9))
    assert data["max_abs_diff"] <= 1e-12
    assert "generated" not in json.loads(ok("kv", "--tokens", "3,1,4", "--json").stdout)
    out = ok("kv", "--tokens", "3,1,4", "-L", 2, "--generate", 5).stdout
    assert f"generated (greedy): {' '.join(map(str, ids[3:]))}" in out
    # under the table it lists, above the attention map
    assert out.index("→: generated") < out.index("generated (greedy)") < out.index("one row per")
    assert f"→ {ids[3]}" in out and f"q7:{ids[7]}" in out
    rows = {line.split()[0]: line.split()[1:] for line in out.splitlines()
            if re.match(r" \d +(→ )?\d ", line)}
    assert rows["0"][1] == "—" and rows["1"][1] == f"{probs[0, 1]:.2f}"   # the given 1 after 3
    assert rows["3"][:3] == ["→", str(ids[3]), f"{expected[0]:.2f}"]
    header = next(line for line in out.splitlines() if line.startswith(" step"))
    assert header.split()[:3] == ["step", "token", "p"]
    plain = ok("kv", "--tokens", "3,1,4").stdout   # without --generate, as it always was
    assert next(line for line in plain.splitlines() if line.startswith(" step")).split()[:4] == \
        ["step", "token", "K,", "V"]
    assert "full causal forward of the 3 given and 5 generated tokens" in " ".join(out.split())


def test_cli_kv_generate_stops_at_the_learned_positions():
    line = error_line(run("kv", "--pe", "learned", "--n-ctx", 6, "-T", 4, "--generate", 3), 2)
    assert "'--generate'" in line and "allowed: 0..2" in line and "4 tokens" in line
    assert json.loads(ok("kv", "--pe", "learned", "--n-ctx", 6, "-T", 4, "--generate", 2,
                         "--json").stdout)["steps"][-1]["cache_len"] == 6
