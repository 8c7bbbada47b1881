"""Toy tasks a small model learns in seconds: copy, reverse or sort a random sequence.

An example is ``x (n symbols), SEP, answer (n symbols)``; the model reads it shifted by one, as
everywhere in tfm (the target of position t is token t + 1), and only the answer positions
are in the loss: the prompt's targets are ``IGNORE``.
"""

from __future__ import annotations

import numpy as np

from tfmcli.engine.inputs import IGNORE, Inputs

TASKS = ("copy", "reverse", "sort")


def answer(task: str, x: np.ndarray) -> np.ndarray:
    """(B, n) -> (B, n): what the model should write after the separator."""
    if task == "copy":
        return x.copy()
    if task == "reverse":
        return x[:, ::-1].copy()
    if task == "sort":
        return np.sort(x, axis=1)
    raise ValueError(f"unknown task {task!r}; tasks: {', '.join(TASKS)}")


def make_batch(task: str, rng, batch: int, n: int, symbols: int) -> Inputs:
    """``batch`` examples of ``n`` symbols in ``[0, symbols)``; the separator is ``symbols``.

    Returns Inputs of T = 2n: tokens ``x, SEP, answer[:-1]``, targets IGNORE on the prompt and
    ``answer`` from the separator on. Vocabulary size is ``symbols + 1``.
    """
    for name, value in (("batch", batch), ("n", n), ("symbols", symbols)):
        if value < 1:
            raise ValueError(f"make_batch: {name}={value}; it must be at least 1")
    x = rng.integers(0, symbols, size=(batch, n))
    sep = np.full((batch, 1), symbols)
    sequence = np.concatenate([x, sep, answer(task, x)], axis=1)         # (B, 2n + 1)
    tokens, targets = sequence[:, :-1].copy(), sequence[:, 1:].copy()    # (B, 2n)
    targets[:, :n - 1] = IGNORE          # predicting the prompt is not the task ...
    targets[:, n - 1] = IGNORE           # ... nor predicting the separator
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
    return (answer_targets(inputs, task["symbols"]),
            f"answers (from separator {task['symbols']} on), as trained; --score-all: all")
