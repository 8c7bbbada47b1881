"""The tfm command line, through Typer's CliRunner: values, exit codes, files."""

import json
import math
import re

import numpy as np
import pytest
from typer.testing import CliRunner

import tfmcli
from helpers import error_line, ok, random_params, run
from tfmcli.cli import app  # noqa: F401
from tfmcli.engine.sizes import activation_shapes, param_shapes

runner = CliRunner()

# Seed 004's printed trg_mask for lengths 4, 2, 6 at length 7 (True = may attend).
SEED_004_COMBINED = [
    [[1, 0, 0, 0, 0, 0, 0], [1, 1, 0, 0, 0, 0, 0], [1, 1, 1, 0, 0, 0, 0], [1, 1, 1, 1, 0, 0, 0],
     [1, 1, 1, 1, 0, 0, 0], [1, 1, 1, 1, 0, 0, 0], [1, 1, 1, 1, 0, 0, 0]],
    [[1, 0, 0, 0, 0, 0, 0], [1, 1, 0, 0, 0, 0, 0], [1, 1, 0, 0, 0, 0, 0], [1, 1, 0, 0, 0, 0, 0],
     [1, 1, 0, 0, 0, 0, 0], [1, 1, 0, 0, 0, 0, 0], [1, 1, 0, 0, 0, 0, 0]],
    [[1, 0, 0, 0, 0, 0, 0], [1, 1, 0, 0, 0, 0, 0], [1, 1, 1, 0, 0, 0, 0], [1, 1, 1, 1, 0, 0, 0],
     [1, 1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1, 0], [1, 1, 1, 1, 1, 1, 0]],
]


@pytest.fixture(autouse=True)
def plain_env(monkeypatch):
    for name in ("NO_COLOR", "FORCE_COLOR", "COLUMNS", "TERM"):
        monkeypatch.delenv(name, raising=False)


def ok_json(*args):
    return json.loads(ok(*args, "--json").stdout)


def api_run(**fields):
    cfg = tfmcli.Config(**fields)
    params, inputs = tfmcli.init_params(cfg), tfmcli.make_inputs(cfg)
    fwd = tfmcli.forward(params, inputs, cfg)
    return cfg, params, inputs, fwd, tfmcli.backward(params, fwd, cfg)


# ---------------------------------------------------------------- forward


def test_forward_prints_config_trace_maps_and_the_apis_loss():
    _, _, _, fwd, _ = api_run(seed=1000)
    out = ok("forward", "--seed", 1000).stdout
    assert f"loss = {fwd.loss:.6f}" in out
    for name in ("blocks.0.attn.pattern", "ln_f.out", "probs", "parameters"):
        assert name in out
    assert "attention patterns, batch row 0" in out and "block 0 head 1" in out
    assert "hidden by mask" in out  # the legend
    assert "\x1b" not in out        # not a terminal: plain text


def test_a_count_of_one_is_singular_and_no_figure_is_followed_by_two_spaces():
    """--tokens 3,1 scores one position (the last has no next token); one token decoded costs
    984 FLOPs, which has no K or M after it to leave a space for."""
    assert ok("forward", "--tokens", "3,1").stdout.rstrip().endswith(
        "(mean cross-entropy over 1 position)")
    assert ok("forward").stdout.rstrip().endswith("(mean cross-entropy over 8 positions)")
    kv = " ".join(ok("kv", "-T", 1).stdout.split())
    assert "for 1 token: 984 with the cache, 984 recomputing each prefix (1.0x)" in kv
    assert "K, V cache after 1 step: 2 x 1 block x (2, 1, 3) = 12 numbers (96 B)" in kv
    one = ok("gradcheck", "-d", 1, "-H", 1, "-V", 1, "-T", 1, "-B", 1, "--d-ff", 1).stdout
    assert "checked 21 of 21 entries" in one
    assert "forward 18, backward 36 (matmuls" in ok(
        "shapes", "-d", 1, "-H", 1, "-V", 1, "-T", 1, "-B", 1, "--d-ff", 1).stdout
    trained = " ".join(ok("train", "--steps", 1).stdout.split())
    assert "trained on copy, 1 step (seed 0)" in trained
    assert re.search(r"; 1 step in \d+\.\d s$", trained)


def test_forward_json_matches_the_api():
    cfg, _, _, fwd, _ = api_run(seed=7, norm="post", activation="gelu")
    data = ok_json("forward", "--seed", 7, "--norm", "post", "--activation", "gelu")
    assert math.isclose(data["loss"], fwd.loss, rel_tol=0, abs_tol=1e-15)
    assert [a["name"] for a in data["activations"]] == list(activation_shapes(cfg))
    probs = next(a for a in data["activations"] if a["name"] == "probs")
    assert probs["max"] == pytest.approx(float(fwd.acts["probs"].max()), abs=1e-15)
    assert data["parameters"] == sum(int(np.prod(s)) for s in param_shapes(cfg).values())


def test_forward_show_slices_by_row_and_head():
    _, _, _, fwd, _ = api_run()
    data = ok_json("forward", "--show", "blocks.0.attn.pattern", "--row", 1, "--head", 1)
    values = np.array(data["show"]["blocks.0.attn.pattern"]["values"], dtype=float)
    np.testing.assert_array_equal(values, fwd.acts["blocks.0.attn.pattern"])
    out = ok("forward", "--show", "blocks.0.attn.pattern", "--row", 1, "--head", 1,
             "--precision", 6).stdout
    assert "blocks.0.attn.pattern[1, 1] of (2, 2, 4, 4)" in out
    row = fwd.acts["blocks.0.attn.pattern"][1, 1, 3]
    assert f"{row[3]:+.6f}" in out


def test_forward_show_labels_an_activations_rows_with_their_tokens():
    """(B, T, d) and (B, H, T, d_head) activations: "position:token" down the side; the (T, d)
    positional table is the same for every row and has no tokens."""
    out = ok("forward", "--show", "embed", "--row", 1).stdout
    labels = [line.split()[0] for line in out.split("embed[1] of (2, 4, 6)")[1].splitlines()[3:7]]
    assert labels == [f"{t}:{token}" for t, token in enumerate(api_run()[2].tokens[1])]
    out = ok("forward", "--show", "pe").stdout
    assert [line.split()[0] for line in out.split("pe (4, 6)")[1].splitlines()[3:7]] == \
        ["0", "1", "2", "3"]


def test_forward_show_a_parameter():
    _, params, _, _, _ = api_run()
    out = ok("forward", "--show", "head.b_U").stdout
    assert "head.b_U (8,)" in out


def test_forward_scores_json_writes_masked_entries_as_null():
    data = ok_json("forward", "--show", "blocks.0.attn.scores")
    values = data["show"]["blocks.0.attn.scores"]["values"]
    assert values[0][0][0][1] is None          # query 0 cannot see key 1 (causal)
    assert isinstance(values[0][0][1][0], float)


def test_forward_save_round_trips_through_numpy(tmp_path):
    path = tmp_path / "run.npz"
    ok("forward", "--seed", 3, "-L", 2, "--lengths", "4,2", "--save", path)
    cfg, params, inputs, fwd, _ = api_run(seed=3, layers=2, lengths=(4, 2))
    with np.load(path, allow_pickle=False) as npz:
        keys = set(npz.files)
        assert {f"param/{n}" for n in params} <= keys
        assert {f"act/{n}" for n in fwd.acts} <= keys
        for name, value in params.items():
            np.testing.assert_array_equal(npz[f"param/{name}"], value)
        np.testing.assert_array_equal(npz["input/tokens"], inputs.tokens)
        np.testing.assert_array_equal(npz["input/lengths"], [4, 2])
        assert npz["loss"].shape == () and float(npz["loss"]) == pytest.approx(fwd.loss, abs=1e-15)
        assert tfmcli.Config.from_json(str(npz["config"])) == cfg


SAVE_RUNS = {   # every command that takes --save, with what its file holds
    "forward": ([], {"param", "input", "config", "act", "loss"}),
    "backward": ([], {"param", "input", "config", "act", "loss", "grad", "actgrad"}),
    "gradcheck": ([], {"param", "input", "config", "act", "loss", "grad", "actgrad"}),
    "attn": (["--query", 2], {"param", "input", "config", "act", "loss"}),
    "kv": (["--generate", 2], {"param", "input", "config", "act", "loss"}),
    "embed": (["-t", 1], {"param", "input", "config", "act", "loss", "grad", "actgrad"}),
    "block": (["-t", 1], {"param", "input", "config", "act", "loss", "grad", "actgrad"}),
    "ln": (["-t", 1], {"param", "input", "config", "act", "loss", "grad", "actgrad"}),
    "ffn": (["-t", 1], {"param", "input", "config", "act", "loss", "grad", "actgrad"}),
    "loss": (["-t", 1], {"param", "input", "config", "act", "loss", "grad", "actgrad"}),
    "lens": ([], {"param", "input", "config", "act", "loss"}),
    "check": (["--against", "torch"], {"param", "input", "config", "act", "loss", "grad",
                                       "actgrad"}),
    "compare": (["-L", 2], {"pre", "post"}),
    "adam": (["--steps", 1], {"param", "input", "config", "act", "loss"}),
    "train": (["--steps", 20], {"param", "input", "config", "act", "loss", "task"}),
    "patch": (["--from-tokens", "1,2,3,4", "--from-tokens", "4,3,2,1"],
              {"param", "input", "config", "act", "loss", "patch"}),
    "circuit": (["--from-tokens", "1,2,3,4", "--from-tokens", "4,3,2,1", "--top", 1],
                {"param", "input", "config", "act", "loss", "circuit"}),
    "attribute": (["-t", 1], {"param", "input", "config", "act", "loss", "attribution"}),
    "precision": ([], {"param", "input", "config", "act", "loss", "grad", "actgrad"}),
    "mask": ([], {"causal", "padding", "combined"}),
    "pe": ([], {"pe"}),   # the last: the test reads its --json
}


def test_every_command_that_takes_save_writes_its_file(tmp_path):
    """--save was once accepted and silently ignored by kv, check, compare and attn --query."""
    import typer.main

    commands = typer.main.get_command(app).commands
    takes_save = {name for name, command in commands.items()
                  if any("--save" in param.opts for param in command.params)}
    assert takes_save == set(SAVE_RUNS)
    for name, (args, groups) in SAVE_RUNS.items():
        if name == "check":
            pytest.importorskip("torch")
        path = tmp_path / f"{name}.npz"
        result = ok(name, *args, "--save", path, "--json")
        with np.load(path, allow_pickle=False) as npz:
            assert {key.split("/")[0] for key in npz.files} == groups, name
            if "loss" in groups:   # the run the command showed
                cfg = tfmcli.Config.from_json(str(npz["config"]))
                assert cfg.seq_len == npz["input/tokens"].shape[1]
    data = json.loads(result.stdout)   # pe's
    np.testing.assert_array_equal(np.load(tmp_path / "pe.npz")["pe"], data["pe"])
    with np.load(tmp_path / "compare.npz") as npz:
        loss = json.loads(ok("compare", "-L", 2, "--json").stdout)["loss"]
        assert float(npz["pre/loss"]) == loss["pre"] and float(npz["post/loss"]) == loss["post"]
        assert "pre/param/ln_f.gamma" in npz.files and "post/param/ln_f.gamma" not in npz.files
    with np.load(tmp_path / "kv.npz") as npz:   # the run kv decoded (the given tokens)
        tokens = json.loads(ok("kv", "--generate", 2, "--json").stdout)["tokens"]
        np.testing.assert_array_equal(npz["input/tokens"][0], tokens[:-2])


def test_forward_loss_shows_each_term_and_their_mean():
    # a padded row and a --tokens row's last position (no target) are left out
    data = ok_json("forward", "--tokens", "3,1,4,1,5", "--tokens", "2,7,1", "--loss")
    terms = data["loss_terms"]
    assert [(x["row"], x["position"]) for x in terms] == [(0, 0), (0, 1), (0, 2), (0, 3),
                                                          (1, 0), (1, 1)]
    assert [(x["token"], x["target"]) for x in terms] == [(3, 1), (1, 4), (4, 1), (1, 5),
                                                          (2, 7), (7, 1)]
    assert math.fsum(x["nll"] for x in terms) / 6 == pytest.approx(data["loss"], rel=1e-14)
    assert all(x["nll"] == pytest.approx(-math.log(x["p"]), rel=1e-12) for x in terms)
    cfg = tfmcli.Config(batch=2, seq_len=5, lengths=(5, 3))
    inputs = tfmcli.inputs_from_tokens([[3, 1, 4, 1, 5], [2, 7, 1]])
    fwd = tfmcli.forward(tfmcli.init_params(cfg), inputs, cfg)
    assert terms[4]["p"] == fwd.acts["probs"][1, 0, 7]
    out = ok("forward", "--loss").stdout
    assert "the 8 terms sum to 20.694560; / 8 = 2.586820, the loss" in out
    table = out.split("the loss term by term")[1].splitlines()
    assert next(line.split() for line in table if line.split()[:2] == ["0", "0"]) == \
        ["0", "0", "1", "4", "0.1502", "1.8958"]
    assert "loss_terms" not in ok_json("forward") and "term by term" not in ok("forward").stdout


def test_svg_is_what_was_printed(tmp_path):
    path = tmp_path / "out.svg"
    result = ok("mask", "--len", 3, "--svg", path)
    svg = path.read_text()
    assert svg.startswith("<svg") and "may" in svg and "attend" in svg
    assert "may attend" in result.stdout


def test_json_and_svg_together_is_a_usage_error(tmp_path):
    result = run("mask", "--json", "--svg", tmp_path / "x.svg")
    assert result.exit_code == 2
    assert "--svg" in result.stderr
    assert not (tmp_path / "x.svg").exists()


def test_forward_heatmaps_are_capped_to_a_screen_without_full(monkeypatch):
    monkeypatch.setenv("LINES", "20")     # 2 rows of 2 maps (6 lines each) at 80 columns
    maps = re.compile(r"block \d head \d")
    out = ok("forward", "-L", 3, "-H", 3).stdout
    assert len(maps.findall(out)) == 4
    assert "showing 4 of 9 attention maps" in out
    assert len(maps.findall(ok("forward", "-L", 3, "-H", 3, "--full").stdout)) == 9
    assert len(maps.findall(ok("forward", "-L", 3, "-H", 3, "--block", 2, "--head", 0).stdout)) == 1
    assert maps.findall(ok("forward", "-L", 3, "-H", 3, "--block", 0, "--head", 2).stdout) == \
        ["block 0 head 2"]


# ---------------------------------------------------------------- backward


def test_backward_layer_ffn_shows_exactly_the_ffn_rows_of_each_block():
    data = ok_json("backward", "--layer", "ffn", "-L", 2)
    names = [g["name"] for g in data["gradients"]]
    assert names == [f"blocks.{i}.ffn.{p}" for i in range(2) for p in ("W_1", "b_1", "W_2", "b_2")]
    out = ok("backward", "--layer", "ffn").stdout
    assert "blocks.0.ffn.W_1" in out and "attn.W_Q" not in out and "embed.W_E" not in out


def test_backward_gradient_numbers_match_the_api():
    _, _, _, _, grads = api_run()
    data = ok_json("backward", "--layer", "head")
    row = {g["name"]: g for g in data["gradients"]}["head.W_U"]
    assert row["l2"] == pytest.approx(float(np.linalg.norm(grads["head.W_U"])), rel=1e-12)
    assert row["max_abs"] == pytest.approx(float(np.abs(grads["head.W_U"]).max()), rel=1e-12)


@pytest.mark.parametrize("block", [0, 1])
def test_backward_block_filter(block):
    data = ok_json("backward", "-L", 2, "--block", block, "--layer", "attn")
    assert {g["name"].split(".")[1] for g in data["gradients"]} == {str(block)}
    assert len(data["gradients"]) == 8


def test_backward_check_adds_errors_and_passes():
    data = ok_json("backward", "--check", "--layer", "ln1")
    assert all(g["passed"] and g["rel_err"] < 1e-6 for g in data["gradients"])
    assert "gradcheck passed" in ok("backward", "--check").stdout


def test_backward_show_dlogits_is_p_minus_y_over_n():
    cfg, _, inputs, fwd, _ = api_run(lengths=(3, 2))
    data = ok_json("backward", "--lengths", "3,2", "--show", "dlogits")
    dlogits = np.array(data["show"]["dlogits"]["values"])
    Y = np.eye(cfg.vocab)[inputs.targets]
    valid = (np.arange(cfg.seq_len)[None, :] < inputs.lengths[:, None])[..., None]
    np.testing.assert_allclose(dlogits, (fwd.acts["probs"] - Y) * valid / 5, atol=1e-15)


def test_backward_show_a_parameter_gradient():
    _, _, _, _, grads = api_run()
    data = ok_json("backward", "--show", "blocks.0.ffn.b_2")
    np.testing.assert_array_equal(
        data["show"]["dblocks.0.ffn.b_2"]["values"], grads["blocks.0.ffn.b_2"]
    )


@pytest.mark.parametrize("head", [None, 0, 1])
def test_backward_show_cuts_a_gradient_at_head_0_unless_told(head):
    _, _, _, _, grads = api_run()
    chosen = [] if head is None else ["--head", head]
    out = ok("backward", "--show", "dblocks.0.attn.pattern", *chosen, "--precision", 6).stdout
    h = head or 0
    assert f"dblocks.0.attn.pattern[0, {h}] of (2, 2, 4, 4)" in out
    last = grads.acts["blocks.0.attn.pattern"][0, h, 3]
    assert " ".join(f"{v:+.6f}" for v in last) in " ".join(out.split())


def test_backward_unknown_layer_lists_the_choices():
    result = run("backward", "--layer", "mlp")
    assert result.exit_code == 2
    assert "'--layer'" in result.stderr
    assert ("'embed', 'ln_embed', 'attn', 'ln1', 'ln1_post', 'ln2', 'ffn', 'ln2_post', 'ln_f', "
            "'head', 'all'") in result.stderr


# ---------------------------------------------------------------- gradcheck


def test_gradcheck_passes_and_reports_every_parameter():
    cfg = tfmcli.Config(norm="post", activation="gelu", lengths=(4, 2))
    data = ok_json("gradcheck", "--norm", "post", "--activation", "gelu", "--lengths", "4,2")
    assert data["passed"] is True and data["failed"] == []
    assert [p["name"] for p in data["params"]] == list(param_shapes(cfg))
    assert max(p["rel_err"] for p in data["params"]) < 1e-6


def test_gradcheck_exit_1_lists_what_failed():
    result = run("gradcheck", "--tol", "1e-30")
    assert result.exit_code == 1
    assert "gradcheck FAILED for" in result.stdout and "head.W_U" in result.stdout


def test_gradcheck_samples_with_max_entries():
    data = ok_json("gradcheck", "--max-entries", 3)
    assert {p["checked"] for p in data["params"]} <= {3, 2, 1} | {3}
    assert max(p["checked"] for p in data["params"]) == 3


# ---------------------------------------------------------------- mask


def test_mask_json_is_seed_004s_combined_mask():
    data = ok_json("mask", "--len", 7, "--lengths", "4,2,6")
    assert np.array_equal(np.array(data["combined"], dtype=int), SEED_004_COMBINED)
    assert data["padding"][1] == [True, True, False, False, False, False, False]
    assert np.array_equal(np.array(data["causal"]), np.tril(np.ones((7, 7), dtype=bool)))


def test_mask_alone_is_seven_long():
    assert np.array(ok_json("mask")["combined"]).shape == (1, 7, 7)


@pytest.mark.parametrize("columns, length, grid", [(80, 21, True), (80, 22, False),
                                                   (77, 21, True), (76, 21, False),
                                                   (200, 40, True), (200, 41, False)])
def test_mask_draws_a_grid_when_it_fits_the_screen_and_40_keys_then_an_overview(
        monkeypatch, columns, length, grid):
    """A grid takes the labels, then a space and a column per key: 3 + 10 x 3 + 11 x 4 = 77
    columns for 21 keys, 81 for 22 (k10 on are 3 wide). At 80 columns 26 keys wrapped every
    line. The overview draws a character a key and, past 40, a line per two queries."""
    monkeypatch.setenv("COLUMNS", str(columns))
    out = ok("mask", "--len", length).stdout
    header = [line for line in out.splitlines() if line.lstrip().startswith("k0")][0]
    assert header.split()[:3] == (["k0", "k1", "k2"] if grid else ["k0", "k4", "k8"])
    assert max(map(len, out.splitlines())) <= columns
    assert ("q1 " in out) is (grid or length <= 40)


def test_a_masks_note_names_only_the_groups_there_are(monkeypatch):
    """40 keys at 30 columns: two keys to a character, but each query on its own line."""
    monkeypatch.setenv("COLUMNS", "30")
    notes = [line for line in ok("mask", "--len", 40).stdout.splitlines() if "per" in line]
    assert notes and all(line.startswith("2 keys per character:") for line in notes)


def test_mask_without_lengths_has_one_all_true_padding_row():
    data = ok_json("mask", "--len", 5)
    assert data["padding"] == [[True] * 5]
    assert np.array(data["combined"]).shape == (1, 5, 5)


def test_mask_no_causal_is_padding_only():
    data = ok_json("mask", "--len", 3, "--lengths", "2", "--no-causal")
    assert data["combined"] == [[[True, True, False]] * 3]


def test_mask_grids_and_legend():
    out = ok("mask", "--len", 3).stdout
    assert "● may attend" in out
    # legend, causal, padding row; the combined mask of a full row is the causal grid itself,
    # said in a line, not drawn twice (issue 58)
    assert out.count("●") == 1 + 6 + 3
    assert "combined, row 0 (length 3, no padding): the causal grid itself" in out
    padded = ok("mask", "--len", 3, "--lengths", "3,2").stdout
    assert padded.count("●") == 1 + 6 + 5 + 5 and "combined, row 1 (length 2)" in padded
    assert "combined, row 0 (length 3, no padding)" in padded
    additive = ok("mask", "--len", 3, "--additive").stdout
    assert additive.count("-inf") == 1 + 3   # the legend, the causal grid


@pytest.mark.parametrize("command, extra", [("mask", ["--lengths", "2,3"]), ("pe", ["-d", "4"])])
def test_len_is_also_T_as_in_the_model_commands(command, extra):
    # -T is the sequence length everywhere else (tfm forward -T 5); here it is --len.
    data = ok_json(command, "-T", 3, *extra)
    assert data == ok_json(command, "--len", 3, *extra)
    shape = np.array(data["combined"] if command == "mask" else data["pe"]).shape
    assert shape == ((2, 3, 3) if command == "mask" else (3, 4))
    assert "'--len' / '-T'" in run(command, "-T", 0).stderr


# ---------------------------------------------------------------- pe


def test_pe_json_matches_the_formula():
    data = ok_json("pe", "--len", 9, "--d-model", 6)
    pe = np.array(data["pe"])
    assert pe.shape == (9, 6)
    for p in range(9):
        for j in range(6):
            angle = p / 10000 ** (2 * (j // 2) / 6)
            expected = math.sin(angle) if j % 2 == 0 else math.cos(angle)
            assert pe[p, j] == pytest.approx(expected, abs=1e-15)


def test_pe_labels_columns_with_sin_cos_and_wavelength():
    out = ok("pe", "--len", 4, "--d-model", 16).stdout
    header = " ".join(out[out.index("values"):].split()[1:18])   # the table's wrapped labels
    assert header == ("sin cos sin cos sin cos sin cos λ6.28 λ6.28 λ19.9 λ19.9 … λ6.28e+03 "
                      "λ6.28e+03 λ1.99e+04 λ1.99e+04")
    # one notation per column: the slow sine needs scientific, its cosine does not
    assert "p1 +0.841 +0.540 +0.311 +0.950 … +1.000e-03    +1.000 +3.162e-04    +1.000" in out
    assert ("column j: sin for even j, cos for odd j; wavelength λ = 6.28 (j = 0, 1) up to "
            "1.99e+04 (j = 15)" in " ".join(out.split()))


def test_pe_prints_the_values_once():
    """Issue 58: tfm pe printed the matrix twice, as a map and as a table; where the map
    writes each value, the table is left out."""
    small = ok("pe", "--len", 4, "--d-model", 4).stdout
    assert "p1  +0.841  +0.540  +0.010  +1.000" in small and "values" not in small


@pytest.mark.parametrize("length, d_model, table", [(16, 16, True), (257, 1, False),
                                                    (17, 16, False), (4, 4, False)])
def test_pe_prints_its_values_up_to_256_of_them(length, d_model, table):
    out = ok("pe", "--len", length, "--d-model", d_model).stdout
    assert bool(re.search(r"^ *values$", out, re.M)) is table


def test_counts_are_written_in_thousands_millions_and_billions():
    """A count just under a unit rounds up into it: 999,999 was "1,000 K"."""
    from tfmcli.cli.shapes import human
    assert [human(n) for n in (999, 1000, 1500, 999_999, 2.5e9)] == \
        ["999", "1 K", "1.5 K", "1 M", "2.5 G"]
    assert human(2.5e9, "FLOP") == "2.5 GFLOP" and human(-1500) == "-1.5 K"


@pytest.mark.parametrize("columns", [80, 300])
def test_pe_is_drawn_on_a_scale_from_minus_1_to_1(monkeypatch, columns):
    """Whole when its columns fit, else its sines and cosines apart: each on the fixed scale
    of a sine."""
    monkeypatch.setenv("COLUMNS", str(columns))
    out = ok("pe", "--d-model", 64, "--len", 8).stdout
    legends = [line for line in out.splitlines() if line.startswith("scale")]
    assert [line.split("[+")[0].split()[:8] for line in legends] == [
        ["scale,", "red", "<", "0", "<", "blue", "[-█]", "-1.000"]] * (2 if columns == 80 else 1)


# ---------------------------------------------------------------- attn


def test_attn_illustrated_prints_seed_002s_numbers():
    out = ok("attn", "--example", "illustrated").stdout
    for number in ("+1.9366", "+6.6831", "+1.5951", "+7.9640", "+0.0540", "+1.9997", "+7.7599",
                   "+0.3584", "+6.3379e-02", "+0.4683", "+0.9820"):
        assert number in out
    assert "unscaled (the note's code)" in out and "scaled by 1/sqrt(3)" in out
    data = ok_json("attn", "--example", "illustrated")
    np.testing.assert_allclose(data["unscaled"]["context"],
                               [[1.9366, 6.6831, 1.5951], [2.0, 7.9640, 0.0540],
                                [1.9997, 7.7599, 0.3584]], atol=1e-4)
    # the options its refusal of model options names are allowed with it
    assert "+1.94" in ok("attn", "--example", "illustrated", "--precision", 2).stdout


def test_attn_numbers_its_steps_and_the_example_shows_the_first_five_then_both_softmaxes():
    """The example's scaled and masked scores are left out: it has no mask, and the scale is
    what the two columns after step 5 compare."""
    def headings(out):
        return re.findall(r"^(\d+)\. (\S+(?: scores)?) \(", out, re.M)
    out = ok("attn", "--example", "illustrated").stdout
    assert headings(out) == [("1", "X"), ("2", "Q"), ("3", "K"), ("4", "V"), ("5", "scores")]
    # numbered on (issue 58: only the first five were)
    assert re.findall(r"^(\d+)\. (\w+), unscaled", out, re.M) == [("6", "softmax"),
                                                                 ("7", "context")]
    assert headings(ok("attn").stdout) == [
        ("1", "X"), ("2", "Q"), ("3", "K"), ("4", "V"), ("5", "scores"), ("6", "scaled scores"),
        ("7", "masked scores"), ("8", "softmax"), ("9", "context")]


def test_attn_model_steps_agree_with_the_models_own_tensors():
    _, _, _, fwd, _ = api_run(lengths=(4, 3))
    data = ok_json("attn", "--head", 1, "--row", 1, "--lengths", "4,3")
    steps = {s["name"]: s["value"] for s in data["steps"]}
    np.testing.assert_allclose(steps["Q"], fwd.acts["blocks.0.attn.q"][1, 1], atol=1e-14)
    np.testing.assert_allclose(
        steps["softmax"], fwd.acts["blocks.0.attn.pattern"][1, 1], atol=1e-14
    )
    assert steps["masked scores"][0][3] is None
    out = ok("attn", "--head", 1, "--row", 1, "--lengths", "4,3").stdout
    # causal 6 + the padded key 3 seen by query 3, and once in the step's formula
    assert out.count("-inf") == 7 + 1
    assert out.count("·") == 7 + 1      # the same cells in the softmax, and its formula


@pytest.mark.parametrize("norm", ["pre", "post"])
def test_attn_steps_are_the_models_own_at_random_parameters(norm):
    """At initial weights every bias is 0, and a wrong bias term in Q, K or V hides; here the
    biases (and gammas) are drawn, and every step equals the model's own tensor of that head."""
    from tfmcli.explain.steps import model_head_steps
    cfg = tfmcli.Config(layers=2, heads=3, norm=norm, lengths=(4, 3))   # head 1: a middle one
    params = random_params(tfmcli.init_params(cfg), seed=5)
    fwd = tfmcli.forward(params, tfmcli.make_inputs(cfg), cfg)
    explained = model_head_steps(params, fwd, cfg, block=1, head=1, row=1)
    source = "LN1 output" if norm == "pre" else "block input"
    assert (explained[0].name, explained[0].formula) == ("X", f"{source} of block 1, batch row 1")
    x = fwd.acts["blocks.1.ln1.out" if norm == "pre" else "blocks.1.in"][1]
    np.testing.assert_array_equal(explained[0].value, x)
    steps = {s.name: s.value for s in explained}
    p = "blocks.1.attn."
    for name, act in (("Q", "q"), ("K", "k"), ("V", "v"), ("masked scores", "scores"),
                      ("softmax", "pattern")):
        np.testing.assert_allclose(steps[name], fwd.acts[p + act][1, 1], rtol=1e-12, atol=1e-14)
    context = fwd.acts[p + "context"][1, :, cfg.d_head:2 * cfg.d_head]       # head 1's columns
    np.testing.assert_allclose(steps["context"], context, rtol=1e-12, atol=1e-14)
    assert np.abs(params[p + "b_Q"]).max() > 0.1 and np.abs(params[p + "b_V"]).max() > 0.1


# ---------------------------------------------------------------- shapes


def test_shapes_answers_for_a_gpt2_small_block_without_allocating():
    data = ok_json("shapes", "-d", 768, "-H", 12, "-T", 1024)
    assert data["activations"]["blocks.0.attn.pattern"] == [2, 12, 1024, 1024]
    assert data["params"]["blocks.0.ffn.W_1"] == [768, 3072]
    assert data["param_count"] == sum(data["param_groups"].values())
    B, T, d, V = 2, 1024, 768, 8
    expected = 2 * B * T * d * d * 4 + 4 * B * T * T * d + 4 * B * T * d * 3072 + 2 * B * T * d * V
    assert data["flops"] == {"forward": expected, "backward": 2 * expected}
    out = ok("shapes", "-d", 768, "-H", 12, "-T", 1024).stdout
    assert "blocks.0.attn.pattern" in out and "FLOPs" in out


def test_shapes_counts_each_group_of_parameters_over_every_block():
    """Counted by hand for three blocks of the defaults (d 6, d_ff 24, V 8): a group's count
    grows with each block, and a parameter counts in its own group (embed.W_E in embed)."""
    d, F, V, L = 6, 24, 8, 3
    data = ok_json("shapes", "-L", L)
    assert list(data["param_groups"].items()) == [
        ("embed", V * d), ("ln", L * 2 * 2 * d + 2 * d), ("attn", L * 4 * (d * d + d)),
        ("ffn", L * (d * F + F + F * d + d)), ("head", d * V + V)]
    assert "parameters  1,646  (embed 48, ln 84, attn 504, ffn 954, head 56)" in \
        ok("shapes", "-L", L).stdout


# ---------------------------------------------------------------- everywhere


def test_version():
    assert ok("--version").stdout.strip() == f"tfm {tfmcli.__version__}"


@pytest.mark.parametrize(
    "command", ["forward", "backward", "gradcheck", "shapes", "attn", "mask", "pe"])
def test_every_command_has_help_with_an_example(command):
    assert "Example: tfm " in ok(command, "--help").stdout


def test_no_color_and_a_pipe_give_plain_text(monkeypatch):
    monkeypatch.setenv("NO_COLOR", "1")
    monkeypatch.setenv("FORCE_COLOR", "1")
    out = ok("forward").stdout
    assert "\x1b[" not in out and "loss =" in out


def test_colour_when_forced():
    monkeypatch = pytest.MonkeyPatch()
    monkeypatch.setenv("FORCE_COLOR", "1")
    try:
        out = ok("forward").stdout
    finally:
        monkeypatch.undo()
    assert "\x1b[" in out


@pytest.mark.parametrize("command", ["forward", "backward", "gradcheck", "shapes"])
def test_long_tables_are_elided_unless_full(command):
    args = (
        [command, "-L", "6", "-d", "4", "--max-entries", "1"]
        if command == "gradcheck"
        else [command, "-L", "6", "-d", "4"]
    )
    middle = "blocks.3.ffn.pre" if command == "forward" else "blocks.3.ffn.b_1"
    out = ok(*args).stdout
    assert "--full shows all" in out and "… " in out
    assert middle not in out
    full = ok(*args, "--full").stdout
    assert "--full shows all" not in full and middle in full


def test_tfm_alone_prints_help_and_no_error():
    result = run()
    assert "Usage" in result.stdout and "forward" in result.stdout
    assert result.stderr == "" and result.exit_code == 0


def test_pe_too_wide_for_the_terminal_splits_sines_from_cosines():
    out = ok("pe", "--len", 8, "--d-model", 64).stdout   # 64 columns x 2 > 80
    assert "sin columns 0, 2, ..." in out and "cos columns 1, 3, ..." in out
    assert "downsampled" not in out
    assert "sin columns" not in ok("pe", "--len", 8, "--d-model", 8).stdout


@pytest.mark.parametrize("columns, split", [(80, False), (79, True)])
def test_pe_draws_one_map_when_two_columns_a_dimension_and_its_labels_fit(
        monkeypatch, columns, split):
    """36 dimensions take 2 x 36 + 8 = 80 columns: whole at 80, sines apart from cosines at 79."""
    monkeypatch.setenv("COLUMNS", str(columns))
    out = ok("pe", "--len", 8, "--d-model", 36).stdout
    assert ("sin columns 0, 2, ..." in out) is split
    assert max(map(len, out.splitlines())) <= columns


def test_long_sequences_show_fewer_maps_and_a_finer_legend():
    out = ok("forward", "-B", 1, "-T", 128, "-d", 8, "-H", 4).stdout
    assert len(re.findall(r"block \d head \d", out)) == 1
    assert "showing 1 of 4 attention maps" in out
    assert "downsampled 128x128" in out
    legend = next(line for line in out.splitlines() if line.startswith("scale"))
    assert len(set(re.findall(r"\d\.\d+", legend))) == 5  # five distinct stops
    assert "] ≥" in legend    # the 99th percentile tops the scale; larger weights share it


def test_backward_json_rows_have_exactly_their_keys_and_values():
    data = json.loads(ok("backward", "--json", "--layer", "head").stdout)
    rows = {row["name"]: row for row in data["gradients"]}
    assert list(rows) == ["head.W_U", "head.b_U"]
    _, _, _, _, grads = api_run(seed=1000)
    for name, row in rows.items():
        assert set(row) == {"name", "shape", "l2", "max_abs", "mean"}
        g = grads[name]
        assert row["shape"] == list(g.shape)
        assert row["l2"] == pytest.approx(np.linalg.norm(g), rel=1e-12)
        assert row["max_abs"] == np.abs(g).max() and row["mean"] == pytest.approx(
            g.mean(), abs=1e-17
        )
    checked = json.loads(ok("backward", "--json", "--layer", "head", "--check").stdout)
    assert set(checked["gradients"][0]) == {"name", "shape", "l2", "max_abs", "mean", "rel_err",
                                            "passed"}


def test_gradcheck_uses_its_step():
    """Central differences err by O(h^2): h = 1e-2 is far worse than h = 1e-4, and the JSON
    says which h was used."""
    coarse = json.loads(ok("gradcheck", "--step", "1e-2", "--tol", "1", "--json").stdout)
    fine = json.loads(ok("gradcheck", "--step", "1e-4", "--json").stdout)
    assert (coarse["step"], fine["step"]) == (1e-2, 1e-4)
    worst = lambda data: max(p["max_abs_err"] for p in data["params"])  # noqa: E731
    assert worst(coarse) > 100 * worst(fine)


def test_gradchecks_footer_gives_the_rule_its_errors_follow():
    """b_K's gradient is 0 in exact arithmetic: its error is its noise over the floor F the
    footer prints, not over its own largest gradient (issue 58: the footer left F out)."""
    text = ok("gradcheck").stdout
    floor = float(re.search(r"^F = ([\d.e-]+): 0.001 x the model's largest \|gradient\|$", text,
                            flags=re.M)[1])
    assert "max(largest |gradient| of the tensor, F)" in text
    report = ok_json("gradcheck")
    assert floor == pytest.approx(report["floor"], rel=1e-5)
    b_K = next(p for p in report["params"] if p["name"] == "blocks.0.attn.b_K")
    assert b_K["rel_err"] == pytest.approx(b_K["max_abs_err"] / floor, rel=1e-5)
    grads = tfmcli.backward(*_run_for_floor())
    assert report["floor"] == pytest.approx(1e-3 * max(abs(g).max() for g in grads.values()))


def _run_for_floor():
    cfg = tfmcli.Config()
    params, inputs = tfmcli.init_params(cfg), tfmcli.make_inputs(cfg)
    return params, tfmcli.forward(params, inputs, cfg), cfg


@pytest.mark.parametrize("command", ["forward", "backward", "gradcheck", "embed", "attn", "ln",
                                     "ffn", "block", "loss", "adam", "kv", "lens", "compare"])
def test_every_json_carries_what_its_run_ran_on(command):
    """Issue 58: tfm forward --tokens 3,1,4,1,5 --json had no tokens, targets or lengths, and
    nothing said where the weights came from."""
    data = ok_json(command, "--tokens", "3,1,4,1,5", "--tokens", "2,7")
    assert data["inputs"] == {"tokens": [[3, 1, 4, 1, 5], [2, 7, 0, 0, 0]],
                              "targets": [[1, 4, 1, 5, -100], [7, -100, -100, -100, -100]],
                              "lengths": [5, 2], "tokens_from": "--tokens",
                              "weights_from": "seed 1000 (xavier init)", "arch": None}


def test_json_of_a_seeded_preset_run_and_of_training():
    data = ok_json("forward", "--arch", "llama")
    assert (data["inputs"]["tokens_from"], data["inputs"]["arch"]) == ("seed 1000", "llama")
    assert data["inputs"]["tokens"][0] == [1, 4, 6, 4]
    trained = ok_json("train", "--steps", "3", "--tokens", "1,2,10,2,1")
    assert trained["inputs"]["tokens"] == [[1, 2, 10, 2, 1]]


def test_seeded_tokens_show_the_t_plus_one_ids_drawn():
    """Issue 58: tokens 1 4 6 4 and targets 4 6 4 6: the last 6 came from a fifth id drawn,
    which no line showed."""
    text = ok("forward", "--seed", "1000").stdout
    assert "│ row 0 drawn    1 4 6 4 6  (T + 1 ids: the tokens, then the last target) " in text
    assert "drawn" not in ok("forward", "--tokens", "3,1,4,1,5").stdout


def test_attn_query_shows_no_number_of_a_hidden_key():
    """Issue 58: step 4 listed a hidden key's score, whose row of K no step shows."""
    lines = ok("attn", "--query", "2", "--tokens", "3,1,4,1,5").stdout.splitlines()
    hidden = [line for line in lines if "hidden" in line and line.startswith(" k")]
    assert [line.split() for line in hidden] == [["k3:1", "·", "·", "hidden", "·"],
                                                 ["k4:5", "·", "·", "hidden", "·"]]
    step4 = next(i for i, line in enumerate(lines) if line.startswith("4. "))
    assert not any("k3:1" in line or "k4:5" in line for line in lines[:step4])


def test_the_patterns_statistics_leave_hidden_cells_out_as_the_scores_do():
    """Issue 58: 'blocks.0.attn.pattern ... 0.0000 +0.2500': the min and the mean came from the
    hidden zeros, while the hidden scores were left out. Each query row sums to 1 over its
    visible keys, so the mean over them is rows / visible cells."""
    data = ok_json("forward")
    pattern = next(a for a in data["activations"] if a["name"] == "blocks.0.attn.pattern")
    scores = next(a for a in data["activations"] if a["name"] == "blocks.0.attn.scores")
    assert pattern["hidden"] == scores["masked"] == 24 and pattern["shape"] == [2, 2, 4, 4]
    assert pattern["mean"] == pytest.approx(16 / (64 - 24)) and pattern["min"] > 0
    text = ok("forward").stdout
    assert "* blocks.0.attn.pattern: hidden: 24 (0), left out of the statistics" in text
    full = ok_json("forward", "--no-causal")   # nothing hidden: every cell counted
    assert "hidden" not in next(a for a in full["activations"]
                                if a["name"] == "blocks.0.attn.pattern")


def test_gradcheck_along_random_directions_checks_every_entry_at_once(monkeypatch):
    """Issue 63's check that scales: each tensor along N random unit directions v, (L(p + h v)
    - L(p - h v)) / 2h against g . v; a gradient 0.1% off in one tensor fails there alone."""
    import tfmcli.engine.model
    from tfmcli.check.gradcheck import directional_check

    cfg = tfmcli.Config(layers=2, activation="gelu")
    params = random_params(tfmcli.init_params(cfg), seed=3)
    inputs = tfmcli.make_inputs(cfg)
    report = directional_check(params, inputs, cfg, directions=3)
    assert report.passed and report.worst.rel_err < 1e-7
    assert report.checked == report.entries == sum(p.size for p in params.values())
    backward = tfmcli.engine.model.backward

    def off(params_, fwd, cfg_):
        grads = backward(params_, fwd, cfg_)
        grads["blocks.1.ffn.W_1"] = grads["blocks.1.ffn.W_1"] * 1.001
        return grads

    monkeypatch.setattr(tfmcli.engine.model, "backward", off)
    wrong = directional_check(params, inputs, cfg, directions=3)
    assert wrong.failed == ["blocks.1.ffn.W_1"]
    # off by 1e-3 of the gradient: an error of about 1e-3 of g . v's size, as entry by entry
    assert 1e-4 < next(c for c in wrong.params if c.name == "blocks.1.ffn.W_1").rel_err < 1e-2


def test_gradcheck_directions_on_the_command_line():
    text = ok("gradcheck", "--directions", 4).stdout
    assert "v: 4 random unit directions a tensor" in text
    assert "checked 21 tensors along 4 random directions each, every entry taking part" in text
    data = ok_json("gradcheck", "--directions", 2)
    assert data["directions"] == 2 and data["passed"] and data["checked"] == 626
    line = error_line(run("gradcheck", "--directions", 2, "--max-entries", 3), 2)
    assert "--directions checks every entry of a tensor at once" in line
