"""Toy tasks a small model learns in seconds: copy, reverse or sort a random sequence, or
continue one by induction.

An example is ``x (n symbols), SEP, answer (n symbols)``; the model reads it shifted by one, as
everywhere in tfm (the target of position t is token t + 1), and only the answer positions
are in the loss: the prompt's targets are ``IGNORE``.

``induction`` is the task with a known circuit (a previous-token head feeding an induction
head's keys): x is n distinct symbols, and the answer is x again from a random offset r,
wrapping around (``x_r, x_r+1, ..., x_n-1, x_0, ..., x_r-1``). Only the positions whose next
token induction decides are scored: the current token appeared in the prompt followed by
x_k+1, and that is the answer. The first answer symbol (x_r, a random pick) and the one after
the wrap (x_n-1 was followed by the separator, not by x_0) are ``IGNORE``. Because r is drawn
per example, no position of the answer holds the same prompt position's symbol from one
example to the next: the answer cannot be read off by position, only by finding the current
token earlier and copying what followed it.
"""

from __future__ import annotations

import numpy as np

from tfmcli.engine.inputs import IGNORE, Inputs

TASKS = ("copy", "reverse", "sort", "induction")
SHORTEST_INDUCTION = 3   # with n = 2, half the examples would have no position to score


def answer(task: str, x: np.ndarray) -> np.ndarray:
    """(B, n) -> (B, n): what the model should write after the separator."""
    if task == "copy":
        return x.copy()
    if task == "reverse":
        return x[:, ::-1].copy()
    if task == "sort":
        return np.sort(x, axis=1)
    if task == "induction":
        raise ValueError("the induction task's answer depends on an offset drawn per example: "
                         "make_batch draws it")
    raise ValueError(f"unknown task {task!r}; tasks: {', '.join(TASKS)}")


def refusal(task: str, n: int, symbols: int) -> tuple[str, str] | None:
    """(the option to blame, why) when a task cannot be drawn at these sizes, else None:
    induction's n symbols are distinct, so it needs ``symbols >= n``, and ``n >= 3`` so that
    every example has a position to score."""
    if task != "induction":
        return None
    if n < SHORTEST_INDUCTION:
        return "--len", (f"induction needs --len at least {SHORTEST_INDUCTION} (it is {n}): "
                         f"with fewer, an example can have no position to score")
    if symbols < n:
        return "--symbols", (f"induction draws --len {n} distinct symbols, so --symbols must "
                             f"be at least {n} (it is {symbols})")
    return None


def make_batch(task: str, rng, batch: int, n: int, symbols: int) -> Inputs:
    """``batch`` examples of ``n`` symbols in ``[0, symbols)``; the separator is ``symbols``.

    Returns Inputs of T = 2n: tokens ``x, SEP, answer[:-1]``, targets IGNORE on the prompt and
    ``answer`` from the separator on. Vocabulary size is ``symbols + 1``.
    """
    for name, value in (("batch", batch), ("n", n), ("symbols", symbols)):
        if value < 1:
            raise ValueError(f"make_batch: {name}={value}; it must be at least 1")
    problem = refusal(task, n, symbols)
    if problem is not None:
        raise ValueError(f"make_batch: {problem[1]}")
    if task == "induction":
        return induction_batch(rng, batch, n, symbols)
    x = rng.integers(0, symbols, size=(batch, n))
    sep = np.full((batch, 1), symbols)
    sequence = np.concatenate([x, sep, answer(task, x)], axis=1)         # (B, 2n + 1)
    tokens, targets = sequence[:, :-1].copy(), sequence[:, 1:].copy()    # (B, 2n)
    targets[:, :n - 1] = IGNORE          # predicting the prompt is not the task ...
    targets[:, n - 1] = IGNORE           # ... nor predicting the separator
    return Inputs(tokens.astype(np.int64), targets.astype(np.int64),
                  np.full(batch, 2 * n, dtype=np.int64))


def induction_batch(rng, batch: int, n: int, symbols: int) -> Inputs:
    """make_batch's induction examples: n distinct symbols, SEP, the same from a random offset.

    Targets are IGNORE but where induction decides the next token: the current token is a
    prompt symbol other than the last (which the separator followed), so the target is what
    followed it in the prompt. Each row scores n - 2 positions, or n - 1 when its offset is 0
    (the answer then never wraps).
    """
    every = np.tile(np.arange(symbols), (batch, 1))                      # (B, symbols)
    x = rng.permuted(every, axis=1)[:, :n]                               # (B, n) distinct
    offsets = rng.integers(0, n, size=batch)                             # (B,)
    wrapped = (offsets[:, None] + np.arange(n)) % n                      # (B, n)
    continued = np.take_along_axis(x, wrapped, axis=1)                   # (B, n)
    sep = np.full((batch, 1), symbols)
    sequence = np.concatenate([x, sep, continued], axis=1)               # (B, 2n + 1)
    tokens, targets = sequence[:, :-1].copy(), sequence[:, 1:].copy()    # (B, 2n)
    targets[:, :n + 1] = IGNORE          # the prompt, and the first answer symbol (random)
    targets[tokens == x[:, -1:]] = IGNORE   # after x_n-1 came the separator: x_0 is no induction
    return Inputs(tokens.astype(np.int64), targets.astype(np.int64),
                  np.full(batch, 2 * n, dtype=np.int64))


def answer_targets(inputs: Inputs, separator: int) -> Inputs:
    """The inputs scored as training scores a task: each row's targets from its first
    ``separator`` on (the separator's position predicts the first answer symbol), IGNORE
    before it. A row without the separator, or with nothing after it, keeps its targets."""
    targets = inputs.targets.copy()
    for b, (row, length) in enumerate(zip(inputs.tokens, inputs.lengths)):
        where = np.flatnonzero(row[:length] == separator)
        if where.size and where[0] < length - 1:
            targets[b, :where[0]] = IGNORE
    return Inputs(inputs.tokens, targets, inputs.lengths)


def induction_targets(inputs: Inputs, separator: int) -> Inputs:
    """The inputs scored as training scores induction: after each row's first ``separator``,
    the positions whose token is in the prompt before its last symbol (so a symbol followed
    it there); IGNORE elsewhere. A row without the separator keeps its targets."""
    targets = inputs.targets.copy()
    for b, (row, length) in enumerate(zip(inputs.tokens, inputs.lengths)):
        where = np.flatnonzero(row[:length] == separator)
        if not where.size:
            continue
        seen = row[:max(where[0] - 1, 0)]      # the prompt but its last symbol
        scored = np.isin(row, seen) & (np.arange(len(row)) > where[0])
        targets[b, ~scored] = IGNORE
    return Inputs(inputs.tokens, targets, inputs.lengths)


def every_target(inputs: Inputs) -> Inputs:
    """The inputs with every position scored: the target of t is the token at t + 1, the last
    real position of each row has none (as ``inputs_from_tokens``)."""
    targets = np.full_like(inputs.tokens, IGNORE)
    targets[:, :-1] = inputs.tokens[:, 1:]
    past = np.arange(inputs.tokens.shape[1])[None, :] >= inputs.lengths[:, None] - 1
    targets[past] = IGNORE
    return Inputs(inputs.tokens, targets, inputs.lengths)


def scored_as_trained(inputs: Inputs, task: dict, score_all: bool = False):
    """(inputs, which positions they score, in words) for a model ``tfm train`` saved on
    ``task`` (its npz ``task``): the answers from the separator on, as it was trained, or with
    ``score_all`` every position."""
    if score_all:
        return every_target(inputs), "every position (--score-all)"
    if task["task"] == "induction":
        return (induction_targets(inputs, task["symbols"]),
                f"the induction positions (after separator {task['symbols']}, a token the "
                f"prompt had before its last), as trained; --score-all: all")
    return (answer_targets(inputs, task["symbols"]),
            f"answers (from separator {task['symbols']} on), as trained; --score-all: all")
