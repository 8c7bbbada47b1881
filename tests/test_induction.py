"""`tfm train --task induction`: batches that only induction can answer, and a model trained
on them whose circuit (`tfm circuit`) is the known one, a previous-token head feeding an
induction head's keys (docs/commands/circuit.md, "A worked example: induction")."""

import json
import re
import shlex
from pathlib import Path

import numpy as np
import pytest

import tfmcli
from helpers import error_line, ok, run
from tfmcli.engine.inputs import IGNORE
from tfmcli.train.loop import evaluate
from tfmcli.train.tasks import every_target, induction_targets, make_batch

ROOT = Path(__file__).resolve().parent.parent
N, SYMBOLS = 8, 10


@pytest.fixture(autouse=True)
def plain_env(monkeypatch):
    for name in ("NO_COLOR", "FORCE_COLOR", "COLUMNS"):
        monkeypatch.delenv(name, raising=False)


def induction_answers(tokens: np.ndarray, n: int):
    """Each row's offset and the targets induction decides, found from the tokens alone:
    (offsets (B,), targets (B, 2n) with IGNORE where the current token is not a prompt symbol
    followed by another)."""
    B = len(tokens)
    offsets = np.array([list(row[:n]).index(row[n + 1]) for row in tokens])
    expected = np.full_like(tokens, IGNORE)
    for b, row in enumerate(tokens):
        for t in range(n + 1, 2 * n):
            k = list(row[:n]).index(row[t])       # where the current token was in the prompt
            if k + 1 < n:                         # ... followed by a symbol, not the separator
                expected[b, t] = row[k + 1]
    assert offsets.shape == (B,)
    return offsets, expected


def test_the_answer_is_the_prompt_continued_from_an_offset():
    batch = make_batch("induction", np.random.default_rng(0), 64, N, SYMBOLS)
    tokens = batch.tokens
    assert tokens.shape == batch.targets.shape == (64, 2 * N)
    assert (batch.lengths == 2 * N).all() and (tokens[:, N] == SYMBOLS).all()
    assert all(len(set(row[:N])) == N for row in tokens)               # distinct symbols
    assert tokens[:, :N].max() < SYMBOLS and tokens[:, N + 1:].max() < SYMBOLS
    offsets, expected = induction_answers(tokens, N)
    for row, r in zip(tokens, offsets):                               # x_r, x_r+1, ... wrapped
        np.testing.assert_array_equal(row[N + 1:], np.roll(row[:N], -r)[:N - 1])
    # the offsets vary: every one of 0..n-1 is drawn, so no answer position holds the same
    # prompt position's symbol from one example to the next
    assert set(offsets) == set(range(N))
    np.testing.assert_array_equal(batch.targets, expected)            # scored: induction's only
    scored = (batch.targets != IGNORE).sum(axis=1)
    np.testing.assert_array_equal(scored, np.where(offsets == 0, N - 1, N - 2))


def test_no_position_answers_the_task():
    """The best answer by position alone (each answer position's most frequent prompt
    position) gets a small share of the scored targets right: the offsets vary."""
    batch = make_batch("induction", np.random.default_rng(1), 512, N, SYMBOLS)
    right = total = 0
    for t in range(N + 1, 2 * N):                     # (the separator's target is never scored)
        scored = batch.targets[:, t] != IGNORE
        where = [list(row[:N]).index(target) for row, target in
                 zip(batch.tokens[scored], batch.targets[scored, t])]
        right += np.bincount(where).max()
        total += scored.sum()
    assert right / total < 0.25


def test_the_scoring_of_a_loaded_model_is_trainings():
    """`--load` of an induction model scores the positions make_batch scores (all but the
    last, whose target, the answer's last symbol, no token holds) and, for any tokens, those
    after the separator whose token the prompt had before its last symbol."""
    batch = make_batch("induction", np.random.default_rng(3), 16, 5, 7)
    np.testing.assert_array_equal(induction_targets(every_target(batch), 7).targets[:, :-1],
                                  batch.targets[:, :-1])
    rows = tfmcli.inputs_from_tokens([[1, 2, 3, 7, 2, 3, 1, 5], [4, 4, 4], [1, 2, 7]])
    scored = induction_targets(rows, 7).targets.tolist()
    assert scored[0] == [IGNORE] * 4 + [3, IGNORE, 5, IGNORE]   # 3 was last; 5 never seen
    assert scored[1] == [4, 4] + [IGNORE] * 6                   # no separator: every position
    assert scored[2] == [IGNORE] * 8                            # nothing after it


@pytest.mark.parametrize("args, option, needle", [
    (["--symbols", "5"], "'--symbols'", "--symbols must be at least 8 (it is 5)"),
    (["--len", "12", "--symbols", "11"], "'--symbols'", "at least 12 (it is 11)"),
    (["--len", "2"], "'--len'", "induction needs --len at least 3 (it is 2)"),
])
def test_sizes_induction_cannot_draw_are_refused(args, option, needle):
    line = error_line(run("train", "--task", "induction", *args), 2)
    assert option in line and needle in line, line
    with pytest.raises(ValueError, match="make_batch: induction"):
        make_batch("induction", np.random.default_rng(0), 2, *(
            (2, 10) if option == "'--len'" else (8, 5)))
    # the other tasks draw repeated symbols: the same sizes are theirs to take
    ok("train", "--task", "copy", "--steps", 1, *args)


def test_tfm_train_shows_what_it_scores():
    text = ok("train", "--task", "induction", "--steps", 2).stdout
    assert "│ task           induction: 8 distinct symbols of 0..9, separator 10, then the" in text
    held_out = make_batch("induction", np.random.default_rng([0, 2]), 256, N, SYMBOLS)
    assert (held_out.targets != IGNORE).sum() == 1565          # 6 a row, 7 where nothing wraps
    assert "over 1,565 answer tokens of 256 examples" in text
    rows = text.split("held-out predictions")[1].splitlines()[2:6]
    # the first answer symbol is never scored; the row's right count is out of its scored
    assert all(row.split()[8] == "·" and row.rstrip()[-2:] in ("/6", "/7") for row in rows), rows
    given = ok("train", "--task", "induction", "--steps", 2, "--tokens",
               "3,1,4,0,5,9,2,6,10,4,0,5,9,2,6,3").stdout
    assert "│ row 0 targets  — — — — — — — — — 0 5 9 2 6 — —" in given


# ------------------------------------------------------------ the worked example: its circuit

SECTION = (ROOT / "docs" / "commands" / "circuit.md").read_text().split(
    "## A worked example: induction\n")[1].split("\n## ")[0]


def page_commands() -> list[str]:
    """The section's `tfm` command lines, each joined over its `\\` continuations."""
    joined = re.sub(r" *\\\n *", " ", SECTION)
    return [line for line in joined.splitlines() if line.startswith("tfm ")]


def page_run(command: str, folder: Path) -> dict:
    """A command of the page, its files in ``folder``, with --json: what it printed."""
    args = [str(folder / word) if word.endswith((".npz", ".jsonl")) else word
            for word in shlex.split(command)[1:]]
    return json.loads(ok(*args, "--json").stdout)


@pytest.fixture(scope="module")
def worked(tmp_path_factory):
    """The page's commands run as written (one training, ~10 s): (folder, what each printed,
    in the page's order)."""
    folder = tmp_path_factory.mktemp("induction")
    pairs = [line for line in SECTION.splitlines() if line.startswith('{"clean"')]
    (folder / "induction-pairs.jsonl").write_text("\n".join(pairs) + "\n")
    return folder, [page_run(command, folder) for command in page_commands()]


def heads(path: Path) -> tuple[int, int, list, list]:
    """(the previous-token head of block 0, the induction head of block 1, each head's score)
    from the attention patterns on fresh examples: a block 0 head's mean attention from each
    prompt position to the one before it; a block 1 head's, from each scored position to the
    one after the current token's place in the prompt."""
    run_ = tfmcli.load(path)
    batch = make_batch("induction", np.random.default_rng(7), 64, N, SYMBOLS)
    _, fwd = evaluate(run_.params, run_.cfg, batch)
    first, second = fwd.acts["blocks.0.attn.pattern"], fwd.acts["blocks.1.attn.pattern"]
    previous = [float(first[:, h, np.arange(1, N), np.arange(N - 1)].mean())
                for h in range(run_.cfg.heads)]
    b, t = np.nonzero(batch.targets != IGNORE)
    after = np.array([list(batch.tokens[i, :N]).index(batch.tokens[i, j]) + 1
                      for i, j in zip(b, t)])
    induction = [float(second[b, h, t, after].mean()) for h in range(run_.cfg.heads)]
    return int(np.argmax(previous)), int(np.argmax(induction)), previous, induction


def edges(payload) -> list[str]:
    return [f"{e['from']} → {e['to']}" for e in payload["edges"]]


def assert_known_circuit(payload, prev: int, ind: int):
    """The top key edge is the previous-token head into the induction head's keys, and the
    top three edges are the circuit: the embedding into the previous-token head's values, that
    edge, the induction head into the logits. The books hold."""
    order = edges(payload)
    keys = [edge for edge in order if edge.endswith(".k")]
    assert keys[0] == f"a0.{prev} → a1.{ind}.k", order[:6]
    assert set(order[:3]) == {f"emb → a0.{prev}.v", f"a0.{prev} → a1.{ind}.k",
                              f"a1.{ind} → logits"}, order[:6]
    assert payload["books"] < 1e-10


def test_the_worked_example_learns_and_finds_the_known_circuit(worked):
    folder, (trained, ig, eap, over_pairs) = worked
    assert trained["task"] == "induction" and trained["final_accuracy"] > 0.95
    prev, ind, previous, induction = heads(folder / "induction.npz")
    assert previous[prev] > 0.5 and induction[ind] > 0.9, (previous, induction)
    assert (prev, ind) == (1, 0)                              # as the page names them
    for payload in (ig, over_pairs):
        assert payload["method"] == "EAP-IG" and payload["steps"] == 16
        assert_known_circuit(payload, prev, ind)
        top = {f"{e['from']} → {e['to']}": e for e in payload["top"]}
        change = payload["corrupted"] - payload["clean"]
        assert change < -10                                   # the answer's logit lost
        # the key edge alone, patched, carries most of the change
        assert top[f"a0.{prev} → a1.{ind}.k"]["real"] / change > 0.5
    # plain EAP, at the clean run whose induction softmax is saturated, misses the key edge
    assert eap["method"] == "EAP" and eap["clean"] == pytest.approx(ig["clean"], rel=1e-12)
    score = {edge: e["score"] for edge, e in zip(edges(eap), eap["edges"])}
    key = f"a0.{prev} → a1.{ind}.k"
    assert abs(score[key]) < 0.1 * abs(dict(zip(edges(ig), [e["score"] for e in
                                                           ig["edges"]]))[key])
    assert key not in edges(eap)[:3]
    # and its row says why: the induction head's softmax at the last query (the metric's)
    rows = {f"{e['from']} → {e['to']}": e for e in eap["top"]}
    assert "a1's softmax saturated" in rows[key]["why"], rows[key]


def test_with_the_default_mlp_the_keys_read_the_head_through_it(tmp_path):
    """The page's "Why --d-ff 8": trained without it, the same two kinds of head, but the
    previous-token head reaches the induction head's keys through the first MLP."""
    train, ig = page_commands()[:2]
    assert " --d-ff 8 " in train
    page_run(train.replace(" --d-ff 8 ", " "), tmp_path)
    prev, ind, previous, induction = heads(tmp_path / "induction.npz")
    assert previous[prev] > 0.5 and induction[ind] > 0.9, (previous, induction)
    assert (prev, ind) == (0, 1)                              # as the page names them
    payload = page_run(ig, tmp_path)
    order = edges(payload)
    assert [edge for edge in order if edge.endswith(".k")][0] == f"m0 → a1.{ind}.k"
    assert f"emb → a0.{prev}.v" == order[0] and f"a0.{prev} → m0" in order[:5], order[:10]
    assert f"a0.{prev} → a1.{ind}.k" not in order[:10]
    assert payload["books"] < 1e-10


def test_a_model_trained_to_copy_has_neither_head_nor_the_circuit(tmp_path):
    """The checks above can fail: the page's model trained on `copy` instead (600 steps) has
    no previous-token or induction head, and its circuit is not the known one."""
    train, ig = page_commands()[:2]
    page_run(train.replace("--task induction", "--task copy").replace("--steps 3000",
                                                                      "--steps 600"), tmp_path)
    prev, ind, previous, induction = heads(tmp_path / "induction.npz")
    assert previous[prev] < 0.5 and induction[ind] < 0.5, (previous, induction)
    payload = page_run(ig, tmp_path)   # runs (a failing command is not the point here)
    with pytest.raises(AssertionError):
        assert_known_circuit(payload, prev, ind)
