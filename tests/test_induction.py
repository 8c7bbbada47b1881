"""`tfm train --task induction`: batches that only induction can answer, and a model trained
on them whose circuit (`tfm circuit`) is the known one, a previous-token head feeding an
induction head's keys (docs/commands/circuit.md, "A worked example: induction")."""

import numpy as np
import pytest

import tfmcli
from helpers import error_line, ok, run
from tfmcli.engine.inputs import IGNORE
from tfmcli.train.tasks import every_target, induction_targets, make_batch

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
