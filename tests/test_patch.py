"""tfm patch: activation patching's real effects, attribution patching's estimates (checked
against central differences of a patch made a little at a time), the command and its errors."""

import json

import numpy as np
import pytest

import tfmcli
from helpers import error_line, ok, random_params, run
from tfmcli.engine.interventions import Patch
from tfmcli.explain.patching import components, metric_dlogits, metric_of, patching, spearman


def runs(**fields):
    cfg = tfmcli.Config(**{"seq_len": 5, "layers": 2, "batch": 2, "activation": "gelu",
                           **fields})
    params = random_params(tfmcli.init_params(cfg), 5)
    clean = tfmcli.inputs_from_tokens([[3, 1, 4, 1, 5], [2, 7, 1, 6]])
    corrupted = tfmcli.inputs_from_tokens([[1, 2, 3, 4, 5], [6, 1, 2, 3]])
    return cfg, params, clean, corrupted


@pytest.mark.parametrize("over", ["heads", "sublayers", "positions"])
@pytest.mark.parametrize("metric", ["loss", "logit-diff"])
def test_each_cell_is_its_patch_and_its_estimate_the_patchs_derivative(over, metric):
    cfg, params, clean, corrupted = runs()
    grid = patching(params, clean, corrupted, cfg, over, metric, 1, 2)
    scored = tfmcli.Inputs(corrupted.tokens, clean.targets, clean.lengths)
    base = tfmcli.forward(params, scored, cfg)
    clean_fwd = tfmcli.forward(params, clean, cfg)
    assert grid.corrupted == metric_of(base, metric, 1, 2)
    assert grid.clean == metric_of(clean_fwd, metric, 1, 2)
    rows, cols, targets = components(cfg, over)
    assert grid.real.shape == (len(rows), len(cols)) and grid.targets == targets
    h = 1e-5
    for r, c in [(0, 0), (len(rows) - 1, len(cols) - 2)]:
        target = targets[r][c]
        patched = tfmcli.forward(params, scored, cfg, interventions=[Patch(target, clean_fwd)])
        assert grid.real[r, c] == metric_of(patched, metric, 1, 2) - grid.corrupted
        # the estimate is the derivative of the metric along clean - corrupted, as the
        # component's values move from the corrupted run's toward the clean run's
        name = target.split("[")[0] if "head" not in target else \
            target.rsplit(".", 1)[0] + ".context"
        ends = []
        for step in (h, -h):
            moved = {name: base.acts[name] + step * (clean_fwd.acts[name] - base.acts[name])}
            ends.append(metric_of(tfmcli.forward(params, scored, cfg,
                                                 interventions=[Patch(target, moved)]),
                                  metric, 1, 2))
        numeric = (ends[0] - ends[1]) / (2 * h)
        assert abs(grid.estimate[r, c] - numeric) <= 1e-7 * max(1.0, abs(numeric)), target
    assert grid.rank_correlation == pytest.approx(spearman_by_counting(grid.real,
                                                                        grid.estimate), abs=1e-12)


def test_a_logit_differences_gradients_equal_central_differences():
    cfg, params, clean, _ = runs(layers=1)
    fwd = tfmcli.forward(params, clean, cfg)
    grads = tfmcli.backward(params, fwd, cfg, dlogits=metric_dlogits(fwd, "logit-diff", 3, 0))
    assert not grads.acts["probs"].any()
    h = 1e-6
    for name, index in (("blocks.0.attn.W_Q", (1, 2)), ("blocks.0.ffn.W_2", (5, 3)),
                        ("embed.W_E", (4, 1))):
        ends = []
        for sign in (1, -1):
            nudged = {k: v.copy() for k, v in params.items()}
            nudged[name][index] += sign * h
            ends.append(metric_of(tfmcli.forward(nudged, clean, cfg), "logit-diff", 3, 0))
        numeric = (ends[0] - ends[1]) / (2 * h)
        assert abs(grads[name][index] - numeric) <= 1e-7 * max(1.0, abs(numeric)), name


def spearman_by_counting(a, b) -> float:
    """Spearman's rho another road than ``spearman``'s: each value's rank counted, the values
    below it plus half the others equal to it (ties share their mean rank), and Pearson's r of
    the ranks written out as sums."""
    def ranks(x):
        x = np.ravel(x)
        return (x[:, None] > x[None, :]).sum(1) + ((x[:, None] == x[None, :]).sum(1) - 1) / 2

    ra, rb = ranks(a), ranks(b)
    da, db = ra - ra.mean(), rb - rb.mean()
    return float((da * db).sum() / np.sqrt((da ** 2).sum() * (db ** 2).sum()))


def test_spearman_ranks():
    assert spearman(np.array([1.0, 2, 3]), np.array([10.0, 20, 30])) == pytest.approx(1)
    assert spearman(np.array([1.0, 2, 3]), np.array([3.0, 2, 1])) == pytest.approx(-1)
    assert spearman(np.array([1.0, 2, 3, 4]), np.array([1.0, 1, 2, 2])) == pytest.approx(
        0.894427191)
    assert np.isnan(spearman(np.array([1.0, 2]), np.array([5.0, 5])))


def test_spearman_is_the_correlation_of_ranks_not_of_values():
    """Cases where the plausible wrong formulas give other numbers: the same order with one
    value far off (Pearson's r of the values 0.72; Spearman's 1), an order half changed
    (1 - 6 sum d^2 / (n (n^2 - 1)), d the ranks' differences), and ties sharing their mean
    rank (a's ranks 0, 1.5, 1.5, 3 against b's 0, 2, 1, 3: 4.5 / sqrt(4.5 x 5) = 3 / sqrt(10);
    ranks by first appearance, 0 1 2 3, give 0.8; the values' Pearson r, 0.78)."""
    a, b = np.array([1.0, 2, 3, 4, 5]), np.array([1.0, 2, 3, 4, 100])
    assert np.corrcoef(a, b)[0, 1] == pytest.approx(0.7250, abs=1e-4)
    assert spearman(a, b) == pytest.approx(1, abs=1e-12)
    assert spearman(b, a) == pytest.approx(1, abs=1e-12)
    c = np.array([0.3, -2.0, 7.5, 0.1, 11.0, -0.5])
    e = np.array([5.0, 1.0, 0.2, 0.0, 9.0, -3.0])
    assert spearman(c, e) == pytest.approx(spearman_by_counting(c, e), abs=1e-12)
    assert spearman_by_counting(c, e) == pytest.approx(1 - 6 * 16 / 210)   # d -1 -3 2 1 0 1
    tied, other = np.array([10.0, 20, 20, 1000]), np.array([1.0, 3, 2, 4])
    assert spearman(tied, other) == pytest.approx(3 / np.sqrt(10), abs=1e-12)
    assert spearman(other, tied) == pytest.approx(3 / np.sqrt(10), abs=1e-12)
    assert np.corrcoef(tied, other)[0, 1] == pytest.approx(0.7798, abs=1e-4)


def test_a_grids_rank_correlation_ranks_its_cells():
    """``PatchingGrid.rank_correlation`` over every cell, real against estimate: an estimate in
    the real effects' order but of other sizes ranks them perfectly; ``difference`` is the
    estimate less the real effect."""
    from tfmcli.explain.patching import PatchingGrid

    real = np.array([[0.1, -2.0], [0.5, 3.0]])
    grid = PatchingGrid("heads", "loss", ["block 0", "block 1"], ["head 0", "head 1"], [],
                        1.0, 2.0, real, np.sign(real) * real ** 2)
    assert grid.rank_correlation == pytest.approx(1, abs=1e-12)
    assert np.corrcoef(grid.real.ravel(), grid.estimate.ravel())[0, 1] < 0.99
    # what the estimate misses, estimate - real (tfm patch's third grid): 9 - 3 at head 1 of
    # block 1, -4 - (-2) at head 1 of block 0
    assert grid.difference.ravel().tolist() == pytest.approx([0.01 - 0.1, -2, 0.25 - 0.5, 6])
    flipped = PatchingGrid("heads", "loss", grid.rows, grid.cols, [], 1.0, 2.0, real,
                           np.array([[0.5, 3.0], [0.1, -2.0]]))
    assert flipped.rank_correlation == pytest.approx(spearman_by_counting(
        real, flipped.estimate), abs=1e-12) == pytest.approx(-1)   # d -1 -3 1 3


def test_a_position_with_no_target_changes_no_loss():
    cfg, params, clean, corrupted = runs(batch=1)
    clean = tfmcli.inputs_from_tokens([[3, 1, 4, 1, 5]])
    corrupted = tfmcli.inputs_from_tokens([[1, 2, 3, 4, 5]])
    grid = patching(params, clean, corrupted, cfg, "positions")
    assert not grid.real[:, -1].any() and not grid.estimate[:, -1].any()
    assert grid.real[:, 0].all()


ARGS = ["--tokens", "3,1,4,1,5", "--from-tokens", "1,2,3,4,5", "-L", "2"]


def test_the_json_gives_both_grids_as_the_api():
    payload = json.loads(ok("patch", *ARGS, "--over", "sublayers", "--json").stdout)
    assert payload["rows"] == ["block 0", "block 1"] and payload["cols"] == ["attn", "ffn"]
    cfg = tfmcli.Config(seq_len=5, layers=2, batch=1)
    params = tfmcli.init_params(cfg)
    grid = patching(params, tfmcli.inputs_from_tokens([[3, 1, 4, 1, 5]]),
                    tfmcli.inputs_from_tokens([[1, 2, 3, 4, 5]]), cfg, "sublayers")
    assert payload["real"] == grid.real.tolist()
    assert payload["estimate"] == grid.estimate.tolist()
    assert payload["clean"] == grid.clean and payload["corrupted"] == grid.corrupted


def test_the_view_shows_both_grids_and_the_ranking():
    text = ok("patch", *ARGS, "--metric", "logit-diff", "--answer", "1", "--wrong", "2").stdout
    assert "real effect" in text and "estimate - real" in text
    assert "logit[1] - logit[2]" in text and "Spearman" in text
    assert max(map(len, text.splitlines())) <= 80


@pytest.mark.parametrize("args, words", [
    (["--tokens", "3,1,4"], ["'--from-tokens'", "corrupted run"]),
    ([*ARGS, "--act", "blocks.0.resid1"], ["'--act'", "--over positions"]),
    ([*ARGS, "--over", "positions", "--act", "blocks.0.attn.q"], ["'--act'", "(B, T, ...)"]),
    ([*ARGS, "--over", "positions", "--act", "blocks.9.resid1"], ["'--act'", "no activation"]),
    ([*ARGS, "--metric", "logit-diff"], ["'--metric'", "--answer and --wrong"]),
    ([*ARGS, "--metric", "logit-diff", "--answer", "1", "--wrong", "99"], ["'--wrong'",
                                                                          "outside 0..7"]),
    ([*ARGS, "--metric", "logit-diff", "--answer", "cat", "--wrong", "1"], ["'--answer'",
                                                                           "tokenizer"]),
    (["--tokens", "3,1,4,1,5", "--from-tokens", "1,2,3"], ["'--from-tokens'", "lengths"]),
])
def test_bad_options_are_usage_errors(args, words):
    line = error_line(run("patch", *args), 2)
    assert all(word in line for word in words), line


def test_the_pages_reverse_example_holds(tmp_path):
    """docs/commands/patch.md's worked example: a model trained to reverse, the last symbol
    corrupted; head 0 carries the answer, and the estimate ranks the heads right."""
    model = tmp_path / "reverse.npz"
    ok("train", "--task", "reverse", "--save", model)
    payload = json.loads(ok("patch", "--load", model, "--tokens",
                            "9,0,2,4,2,6,8,1,10,1,8,6,2,4,2,0", "--from-tokens",
                            "9,0,2,4,2,6,8,5,10,1,8,6,2,4,2,0", "--over", "heads",
                            "--json").stdout)
    real, estimate = np.array(payload["real"]), np.array(payload["estimate"])
    assert payload["clean"] < 0.01 and payload["corrupted"] > 1.5
    assert real[0, 0] < -0.95 * payload["corrupted"]        # head 0 restores nearly all
    assert abs(real[0, 1]) < abs(real[0, 0]) / 2
    assert payload["rank_correlation"] == pytest.approx(1.0)
    assert estimate[0, 0] - real[0, 0] > 0.5                # and the estimate falls short
