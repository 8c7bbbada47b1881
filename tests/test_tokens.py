"""--tokens: the input is exactly the ids given; the last position of each row has no target."""

import json
import re

import numpy as np
import pytest

import tfmcli
from helpers import assert_scaled_close, error_line, ok, random_params, run
from tfmcli.engine.inputs import IGNORE


@pytest.fixture(autouse=True)
def plain_env(monkeypatch):
    for name in ("NO_COLOR", "FORCE_COLOR", "COLUMNS"):
        monkeypatch.delenv(name, raising=False)


def test_inputs_from_tokens_pads_and_leaves_the_last_position_unscored():
    inputs = tfmcli.inputs_from_tokens([[3, 1, 4, 1, 5], [2, 7]])
    assert inputs.tokens.tolist() == [[3, 1, 4, 1, 5], [2, 7, 0, 0, 0]]
    assert inputs.targets.tolist() == [[1, 4, 1, 5, IGNORE], [7] + [IGNORE] * 4]
    assert inputs.lengths.tolist() == [5, 2]
    assert inputs.tokens.dtype == inputs.targets.dtype == np.int64


def test_make_inputs_draws_the_ids_as_the_conventions_say():
    """The README's rule, which lets anyone draw the same tokens without tfm:
    ``default_rng(seed).integers(0, V, (B, T + 1))``, input ``[:, :-1]``, target ``[:, 1:]``."""
    cfg = tfmcli.Config(batch=3, seq_len=5, vocab=4, seed=7, lengths=(5, 2, 4))
    ids = np.random.default_rng(7).integers(0, 4, (3, 6))
    inputs = tfmcli.make_inputs(cfg)
    assert inputs.tokens.tolist() == ids[:, :-1].tolist()
    assert inputs.targets.tolist() == ids[:, 1:].tolist()
    assert inputs.lengths.tolist() == [5, 2, 4]
    assert set(inputs.tokens.ravel()) == {0, 1, 2, 3}


def test_inputs_from_tokens_takes_one_flat_row_and_refuses_what_is_not_ids():
    assert tfmcli.inputs_from_tokens([3, 1, 4]).tokens.tolist() == [[3, 1, 4]]
    assert tfmcli.inputs_from_tokens(np.array([3, 1, 4])).targets.tolist() == [[1, 4, IGNORE]]
    assert tfmcli.inputs_from_tokens([[3.0, 1]]).tokens.tolist() == [[3, 1]]
    for rows, reason in (([], "no rows"), ([[1, 2], []], "row 1, [],"),
                         ([[3.5, 1]], "row 0, [3.5, 1],"), ([["a", 1]], "row 0, ['a', 1],")):
        with pytest.raises(tfmcli.InputsError, match=re.escape(reason)):
            tfmcli.inputs_from_tokens(rows)


# Some of these ran before without a word: an id of -1 is row V-1 to NumPy (the same loss as
# id 7), so is a target of -1, and a length past T or a batch of lengths too long was ignored
# on the plain path. The others failed deep inside NumPy.
BAD_INPUTS = [
    ([[1, -1, 3]], [[2, 3, IGNORE]], [3], "inputs.tokens: -1 is outside 0..7 (vocab 8)"),
    ([[1, 8, 3]], [[2, 3, IGNORE]], [3], "inputs.tokens: 8 is outside 0..7"),
    # the value named is the one outside, not an id at the edge of the range before it
    ([[0, 7, -1]], [[7, 0, IGNORE]], [3], "inputs.tokens: -1 is outside 0..7"),
    ([[7, 0, 8]], [[0, 1, IGNORE]], [3], "inputs.tokens: 8 is outside 0..7"),
    ([[1, 2, 3]], [[-1, 3, IGNORE]], [3],
     "inputs.targets: -1 is neither an id in 0..7 (vocab 8) nor IGNORE (-100)"),
    ([[1, 2, 3]], [[8, 3, IGNORE]], [3], "inputs.targets: 8 is neither"),
    ([[1, 2, 3]], [[2, 3, IGNORE]], [0], "inputs.lengths: 0 is outside 1..3 (T = 3)"),
    ([[1, 2, 3]], [[2, 3, IGNORE]], [4], "inputs.lengths: 4 is outside 1..3"),
    ([[1, 2, 3]], [[2, 3, IGNORE]], [3, 3],
     "inputs.lengths has shape (2,), expected (1,)"),
    ([[1, 2, 3]], [[2, 3]], [3], "inputs.targets has shape (1, 2), expected (1, 3)"),
    ([1, 2, 3], [2, 3, IGNORE], [3], "inputs.tokens has shape (3,), expected (B, T)"),
    ([[1.0, 2, 3]], [[2, 3, IGNORE]], [3], "inputs.tokens has dtype float64"),
]


@pytest.mark.parametrize("fast", [True, False])
@pytest.mark.parametrize("tokens, targets, lengths, reason", BAD_INPUTS)
def test_forward_refuses_inputs_it_cannot_run(tokens, targets, lengths, reason, fast):
    cfg = tfmcli.Config(batch=1, seq_len=3)
    inputs = tfmcli.Inputs(*(np.array(value) for value in (tokens, targets, lengths)))
    with pytest.raises(tfmcli.InputsError, match=re.escape(reason)):
        tfmcli.forward(tfmcli.init_params(cfg), inputs, cfg, fast=fast)


# A Config changed after the weights were drawn. vocab, d_ff, dtype, tied_head and norm ran on
# the old weights before, on sizes or a dtype the Config does not say (float32 asked, float64
# computed); a missing name was a KeyError.
MISFITS = [
    ({"vocab": 6}, "params['embed.W_E'] has shape (8, 6); this Config gives (6, 6)"),
    ({"d_ff": 10}, "params['blocks.0.ffn.W_1'] has shape (6, 24); this Config gives (6, 10)"),
    ({"dtype": "float32"}, "params['embed.W_E'] has dtype float64; this Config's dtype is float32"),
    ({"layers": 2},
     "params is missing blocks.1.ln1.gamma and 15 more, which this Config's model has"),
    ({"pe": "learned"}, "params is missing embed.W_pos, which"),
    ({"tied_head": True}, "params has head.W_U, which this Config's model does not have"),
    ({"norm": "post"}, "params has ln_f.gamma and 1 more, which this Config's model does not have"),
]


@pytest.mark.parametrize("changed, reason", MISFITS)
def test_forward_refuses_params_that_do_not_fit_the_config(changed, reason):
    cfg = tfmcli.Config()
    params = tfmcli.init_params(cfg)
    with pytest.raises(tfmcli.InputsError, match=re.escape(reason)):
        tfmcli.forward(params, tfmcli.make_inputs(cfg), cfg.replace(**changed))


def test_param_misfit_is_the_first_misfit_with_a_count_of_the_others_of_its_kind():
    from tfmcli.engine.sizes import param_misfit

    cfg = tfmcli.Config()
    params = tfmcli.init_params(cfg)
    assert param_misfit(params, cfg) is None
    assert param_misfit(params, cfg.replace(vocab=6)) == ("shape", "embed.W_E", (8, 6), (6, 6), 0)
    assert param_misfit(params, cfg.replace(dtype="float32")) == (
        "dtype", "embed.W_E", np.dtype("float64"), "float32", 0)
    assert param_misfit(params, cfg.replace(layers=2)) == (
        "missing",
        "blocks.1.ln1.gamma",
        None,
        None,
        15,
    )
    assert param_misfit(params, cfg.replace(norm="post")) == (
        "unknown",
        "ln_f.gamma",
        None,
        None,
        1,
    )


def test_forward_refuses_more_positions_than_the_learned_table():
    cfg = tfmcli.Config(batch=1, pe="learned", n_ctx=4)
    with pytest.raises(tfmcli.InputsError, match=re.escape(
            "inputs.tokens has 5 positions, more than the 4 learned positions (n_ctx)")):
        tfmcli.forward(tfmcli.init_params(cfg), tfmcli.inputs_from_tokens([1, 2, 3, 4, 5]), cfg)


def test_forward_refuses_a_config_whose_lengths_the_inputs_contradict():
    # the mask follows the inputs' lengths: cfg.replace(lengths=(4, 2)) on full rows ran unpadded
    cfg = tfmcli.Config()
    params, full = tfmcli.init_params(cfg), tfmcli.make_inputs(cfg)
    with pytest.raises(tfmcli.InputsError, match=re.escape(
            "inputs.lengths are [4, 4], and cfg.lengths [4, 2]: tfmcli.make_inputs(cfg)")):
        tfmcli.forward(params, full, cfg.replace(lengths=(4, 2)))
    padded = cfg.replace(lengths=(4, 2))
    loss = tfmcli.forward(params, tfmcli.make_inputs(padded), padded).loss
    assert loss != tfmcli.forward(params, full, cfg).loss
    # lengths=None takes the inputs' own, padded or not (the README's API example)
    inputs = tfmcli.inputs_from_tokens([[3, 1, 4, 1, 5], [2, 7]])
    unset = cfg.replace(seq_len=5)
    assert tfmcli.forward(params, inputs, unset).loss == \
        tfmcli.forward(params, inputs, unset.replace(lengths=(5, 2))).loss


def test_forward_takes_inputs_given_as_lists():
    cfg = tfmcli.Config(batch=1, seq_len=3)
    params = tfmcli.init_params(cfg)
    listed = tfmcli.forward(params, tfmcli.Inputs([[1, 2, 3]], [[2, 3, IGNORE]], [3]), cfg)
    arrays = tfmcli.forward(params, tfmcli.inputs_from_tokens([[1, 2, 3]]), cfg)
    assert listed.loss == arrays.loss and listed.scored == 2


def test_the_loss_is_the_mean_over_positions_with_a_target():
    """N counts 4 + 1 positions; the loss equals the hand-computed mean of -log P[target]."""
    cfg = tfmcli.Config(batch=2, seq_len=5, lengths=(5, 2))
    params = random_params(tfmcli.init_params(cfg), seed=3)
    inputs = tfmcli.inputs_from_tokens([[3, 1, 4, 1, 5], [2, 7]])
    fwd = tfmcli.forward(params, inputs, cfg)
    assert fwd.scored == 5
    probs = fwd.acts["probs"]
    picked = [probs[0, t, target] for t, target in enumerate([1, 4, 1, 5])] + [probs[1, 0, 7]]
    assert fwd.loss == pytest.approx(-np.mean(np.log(picked)), rel=1e-14)
    grads = tfmcli.backward(params, fwd, cfg)
    dlogits = grads.acts["logits"]
    assert np.all(dlogits[0, 4] == 0) and np.all(dlogits[1, 1:] == 0)   # unscored rows
    assert dlogits[0, 0].sum() == pytest.approx(0, abs=1e-15)


@pytest.mark.parametrize("norm", ["pre", "post"])
def test_central_differences_on_a_tokens_run_at_random_parameters(norm):
    cfg = tfmcli.Config(batch=3, seq_len=5, lengths=(5, 2, 4), norm=norm, activation="gelu",
                        layers=2)
    params = random_params(tfmcli.init_params(cfg), seed=11)
    inputs = tfmcli.inputs_from_tokens([[3, 1, 4, 1, 5], [2, 7], [6, 6, 0, 1]])
    report = tfmcli.gradcheck(params, inputs, cfg)
    assert report.passed, report.failed
    assert report.worst.rel_err < 1e-6


def test_cli_tokens_run_equals_the_api(tmp_path):
    path = tmp_path / "run.npz"
    data = json.loads(ok("backward", "--tokens", "3,1,4,1,5", "--tokens", "2,7", "--json",
                         "--save", path).stdout)
    cfg = tfmcli.Config(batch=2, seq_len=5, lengths=(5, 2))
    params = tfmcli.init_params(cfg)
    inputs = tfmcli.inputs_from_tokens([[3, 1, 4, 1, 5], [2, 7]])
    fwd = tfmcli.forward(params, inputs, cfg)
    grads = tfmcli.backward(params, fwd, cfg)
    assert data["loss"] == fwd.loss
    assert data["config"]["seq_len"] == 5 and data["config"]["lengths"] == [5, 2]
    with np.load(path) as saved:
        assert saved["input/targets"].tolist() == inputs.targets.tolist()
        for name, g in grads.items():
            np.testing.assert_array_equal(saved[f"grad/{name}"], g)
    # the saved run, with its -100 targets, reloads to the same loss
    again = json.loads(ok("forward", "--load", path, "--json").stdout)
    assert again["loss"] == fwd.loss


def test_tokens_with_load_use_the_files_weights_and_the_new_tokens(tmp_path):
    path = tmp_path / "run.npz"
    ok("forward", "--seed", 5, "-L", 2, "--save", path)
    data = json.loads(ok("forward", "--load", path, "--tokens", "1,2,3,4,5,6,7", "--json").stdout)
    cfg = tfmcli.Config(seed=5, layers=2, batch=1, seq_len=7)
    fwd = tfmcli.forward(tfmcli.init_params(tfmcli.Config(seed=5, layers=2)),
                         tfmcli.inputs_from_tokens([[1, 2, 3, 4, 5, 6, 7]]), cfg)
    assert data["loss"] == fwd.loss
    assert data["config"]["batch"] == 1 and data["config"]["seq_len"] == 7


def test_views_label_tokens_and_targets():
    out = ok("forward", "--tokens", "3,1,4,1,5", "--tokens", "2,7", "--head", "0").stdout
    assert "      k0:3  k1:1  k2:4  k3:1  k4:5" in out
    assert "row 0 tokens   3 1 4 1 5" in out
    assert "row 0 targets  1 4 1 5 —" in out
    assert "tokens from    --tokens" in out
    assert "mean cross-entropy over 5 positions" in out
    out = ok("forward", "--tokens", "3,1,4,1,5", "--tokens", "2,7", "--row", "1",
             "--show", "blocks.0.attn.pattern").stdout
    assert "row 1 tokens   2 7 pad pad pad" in out
    assert "q1:7" in out and "k4:pad" in out
    out = ok("attn", "--tokens", "3,1,4,1,5").stdout
    assert "q4:5" in out and "k2:4" in out


def test_the_panel_says_the_weights_came_from_the_file_not_the_seed(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    ok("forward", "--save", "w.npz")
    out = ok("forward", "--load", "w.npz").stdout
    assert "weights        file w.npz" in out and "tokens from    file w.npz" in out
    assert "seed 1000" not in out
    out = ok("forward", "--load", "w.npz", "--tokens", "1,2").stdout
    assert "weights        file w.npz" in out and "tokens from    --tokens" in out


@pytest.mark.parametrize("args, option, needle", [
    (["--tokens", "3,1,9"], "'--tokens'", "id 9 is outside 0..7 (--vocab 8)"),
    (["--tokens", "3,-1,2"], "'--tokens'", "id -1 is outside 0..7"),
    (["--tokens", "3,x"], "'--tokens'", "is not a comma-separated list of token ids"),
    (["--tokens", "3", "--tokens", "4"], "'--tokens'", "no position has a next token"),
    (
        ["--tokens", "1,2,3", "-T", "4"],
        "'--seq-len'",
        "seq_len=4 contradicts --tokens, whose longest row has 3 tokens",
    ),
    (
        ["--tokens", "1,2,3", "-B", "2"],
        "'--batch'",
        "batch=2 contradicts --tokens, which gives 1 row",
    ),
    (["--tokens", "1,2,3", "--tokens", "1,2", "--lengths", "3,3"], "'--lengths'",
     "lengths=3,3 contradicts --tokens, whose rows have lengths 3,2"),
])
def test_bad_tokens_are_usage_errors_naming_both(args, option, needle):
    line = error_line(run("forward", *args), 2)
    assert option in line and needle in line


def test_agreeing_flags_are_fine():
    ok("forward", "--tokens", "1,2,3", "-T", "3", "-B", "1")
    ok("forward", "--tokens", "1,2,3", "--tokens", "1,2", "--lengths", "3,2")


def test_attn_query_explains_one_row_number_by_number():
    data = json.loads(ok("attn", "--tokens", "3,1,4,1,5", "--query", 3, "--head", 1,
                         "--json").stdout)
    cfg = tfmcli.Config(batch=1, seq_len=5)
    params = tfmcli.init_params(cfg)
    fwd = tfmcli.forward(params, tfmcli.inputs_from_tokens([[3, 1, 4, 1, 5]]), cfg)
    q = fwd.acts["blocks.0.attn.q"][0, 1, 3]
    keys = data["keys"]
    assert [k["visible"] for k in keys] == [True, True, True, True, False]
    for s, key in enumerate(keys):
        k = fwd.acts["blocks.0.attn.k"][0, 1, s]
        assert_scaled_close(key["products"], q * k)
        assert key["score"] == pytest.approx(float(q @ k), rel=1e-13)
        assert key["scaled"] == pytest.approx(float(q @ k) / np.sqrt(3), rel=1e-13)
        assert key["weight"] == pytest.approx(float(fwd.acts["blocks.0.attn.pattern"][0, 1, 3, s]),
                                              abs=1e-15)
    assert keys[4]["weight"] == 0.0
    assert_scaled_close(data["context"], fwd.acts["blocks.0.attn.context"][0, 3, 3:6])
    out = ok("attn", "--tokens", "3,1,4,1,5", "--query", 3).stdout
    assert "Σ score" in out and "Σ context" in out and "k4:5   " in out and "hidden" in out


def test_attn_query_0_sees_only_itself_and_the_model_agrees_to_rounding():
    """Query 0 is allowed (0..T-1); under the causal mask its one key takes all the weight. The
    last line compares the sum of weighted values with the model's own context row."""
    data = json.loads(ok("attn", "--tokens", "3,1,4,1,5", "--query", 0, "--json").stdout)
    assert [k["weight"] for k in data["keys"]] == [1.0, 0.0, 0.0, 0.0, 0.0]
    assert_scaled_close(data["context"], data["keys"][0]["weighted_v"], floor=0)
    for query in (0, 3):
        out = ok("attn", "--tokens", "3,1,4,1,5", "--query", query).stdout
        difference = float(re.search(r"differs from this sum by (\S+)", out).group(1))
        assert difference < 1e-14


def test_attn_query_out_of_range():
    line = error_line(run("attn", "--query", 4), 2)
    assert "'--query'" in line and "0..3" in line


def test_backward_refuses_a_config_that_is_not_the_forward_passs():
    """A GELU backward through a ReLU forward ran before, its gradients off by up to 0.8."""
    cfg = tfmcli.Config(layers=2)
    params = tfmcli.init_params(cfg)
    fwd = tfmcli.forward(params, tfmcli.make_inputs(cfg), cfg)
    tfmcli.backward(params, fwd, tfmcli.Config(layers=2))   # equal, if not the same object
    with pytest.raises(tfmcli.InputsError, match=re.escape(
            "backward: cfg is not the forward pass's Config (activation='gelu' here, 'relu' in "
            "the forward pass)")):
        tfmcli.backward(params, fwd, cfg.replace(activation="gelu"))
