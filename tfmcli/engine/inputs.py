"""What the model reads: token ids, their targets and each sequence's length (``Inputs``),
drawn from a seed, given as lists of ids, and checked before a forward pass runs on them."""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from tfmcli.engine.config import Config
from tfmcli.errors import InputsError

IGNORE = -100  # a target left out of the loss and of N (PyTorch's and Hugging Face's ignore_index)


class Inputs(NamedTuple):
    tokens: np.ndarray   # (B, T) int64 in [0, V)
    targets: np.ndarray  # (B, T) int64 in [0, V): the next token, or IGNORE (no target)
    lengths: np.ndarray  # (B,) int64 in 1..T


def make_inputs(cfg: Config) -> Inputs:
    """Draw ``T + 1`` ids per row from ``default_rng(seed)``; input is ``[:, :-1]``, target ``[:,
    1:]``."""
    rng = np.random.default_rng(cfg.seed)
    ids = rng.integers(0, cfg.vocab, size=(cfg.batch, cfg.seq_len + 1))
    return Inputs(ids[:, :-1].copy(), ids[:, 1:].copy(), cfg.lengths_array())


def inputs_from_tokens(rows, pad: int = 0) -> Inputs:
    """Inputs that are exactly these token ids, one sequence per row.

    The target of position t is the id at t + 1; the last token of a row has no next token, so
    its target is ``IGNORE`` (left out of the loss and of N), as with Hugging Face's
    ``labels=input_ids``. Shorter rows are padded at the end with ``pad`` and get their length,
    so the padding mask hides the padding.

    Parameters
    ----------
    rows : sequence of sequences of int, or one sequence of int (one row)
        B rows of 1..T ids each; T is the longest.
    """
    rows = list(rows)
    if rows and all(np.ndim(row) == 0 for row in rows):   # [3, 1, 4]: one row
        rows = [rows]
    rows = [_ids(row, b) for b, row in enumerate(rows)]
    if not rows:
        raise InputsError("inputs_from_tokens: no rows; give at least one row of ids")
    B, T = len(rows), max(len(row) for row in rows)
    tokens = np.full((B, T), pad, dtype=np.int64)
    targets = np.full((B, T), IGNORE, dtype=np.int64)
    for b, row in enumerate(rows):
        tokens[b, :len(row)] = row
        targets[b, :len(row) - 1] = row[1:]
    lengths = np.array([len(row) for row in rows], dtype=np.int64)
    return Inputs(tokens, targets, lengths)


def _ids(row, b: int) -> list[int]:
    """Row ``b``'s ids as ints: not empty, and every one a whole number (3.0 is 3, 3.5 is not)."""
    try:
        row = list(row)
        ids = [int(value) for value in row]
        whole = bool(ids) and all(i == value for i, value in zip(ids, row))
    except (TypeError, ValueError):
        whole = False
    if not whole:
        raise InputsError(f"inputs_from_tokens: row {b}, {row!r}, is not a list of one or more "
                          f"token ids (integers)")
    return ids


def first_outside(inputs: Inputs, vocab: int) -> tuple[str, int, int, int] | None:
    """The first array of ``inputs`` (of integers, shapes agreeing) holding a value it may not
    hold, as (name, that value, low, high), or None: tokens in 0..V-1, targets in 0..V-1 or
    ``IGNORE``, lengths in 1..T."""
    T = inputs.tokens.shape[1]
    targets = inputs.targets[inputs.targets != IGNORE]
    for name, values, low, high in (("tokens", inputs.tokens, 0, vocab - 1),
                                    ("targets", targets, 0, vocab - 1),
                                    ("lengths", inputs.lengths, 1, T)):
        if values.size and (values.min() < low or values.max() > high):
            return name, int(values[(values < low) | (values > high)][0]), low, high
    return None


OUTSIDE = {"tokens": "is outside 0..{top} (vocab {vocab})",
           "targets": "is neither an id in 0..{top} (vocab {vocab}) nor IGNORE ({ignore})",
           "lengths": "is outside 1..{T} (T = {T})"}


def checked_inputs(inputs: Inputs, cfg: Config) -> Inputs:
    """``inputs`` as arrays, or ``InputsError`` unless they can run on ``cfg``'s model: integer
    tokens (B, T) in 0..V-1, targets of the same shape in 0..V-1 or ``IGNORE``, lengths (B,)
    in 1..T, and T within the learned positions. (NumPy would take an id of -1 as V-1 and run
    on, every number wrong.)"""
    vocab = cfg.vocab
    if not all(isinstance(value, np.ndarray) for value in inputs):
        inputs = Inputs(*(np.asarray(value) for value in inputs))
    tokens, targets, lengths = inputs
    for name, value in inputs._asdict().items():
        if value.dtype.kind not in "iu":
            raise InputsError(f"inputs.{name} has dtype {value.dtype}, expected integers")
    if tokens.ndim != 2:
        raise InputsError(f"inputs.tokens has shape {tokens.shape}, expected (B, T)")
    B, T = tokens.shape
    for name, value, shape in (("targets", targets, (B, T)), ("lengths", lengths, (B,))):
        if value.shape != shape:
            raise InputsError(f"inputs.{name} has shape {value.shape}, expected {shape} "
                              f"(B, T = {B}, {T}: the tokens' shape)")
    if cfg.lengths is not None and lengths.tolist() != list(cfg.lengths):
        # the forward pass masks by the inputs' lengths: the Config's would be silently ignored
        raise InputsError(f"inputs.lengths are {lengths.tolist()}, and cfg.lengths "
                          f"{list(cfg.lengths)}: tfmcli.make_inputs(cfg) makes inputs for a "
                          f"Config, and cfg.replace(lengths=None) takes the inputs' lengths")
    outside = first_outside(inputs, vocab)
    if outside is not None:
        name, value = outside[:2]
        raise InputsError(f"inputs.{name}: {value} " + OUTSIDE[name].format(
            top=vocab - 1, vocab=vocab, ignore=IGNORE, T=T))
    if cfg.pe == "learned" and T > cfg.ctx:
        raise InputsError(f"inputs.tokens has {T} positions, more than the {cfg.ctx} learned "
                          f"positions (n_ctx)")
    return inputs
