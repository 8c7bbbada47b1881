"""Q, K and V in one stored matrix, one piece per key head: GPT-NeoX's and Falcon's
``query_key_value``. Which stored rows hold each of W_Q, W_K and W_V (``grouped_rows``), and
reading and writing a folder whose ``name_map`` has such a row, its tfm parameter the tuple
(W_Q, W_K, W_V) or their biases (``load_params``, ``from_tfm``)."""

from __future__ import annotations

import numpy as np

from tfmcli.config import Config, param_shapes
from tfmcli.sources import llama, tensorfile


def grouped_rows(fields: dict) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The stored rows that hold W_Q's, W_K's and W_V's columns, in tfm's order: one piece per
    key head j, ``(group + 2) d_head`` rows, the ``group`` query heads it serves (j group ..
    (j + 1) group - 1), then its key, then its value. A key head each (GPT-NeoX's): each head's
    q, k and v in turn; one key head (Falcon-7B's): every query head, then the key, the value."""
    cfg = Config(**fields)
    dh, group = cfg.d_head, cfg.group
    piece = (group + 2) * dh
    head = np.arange(cfg.heads)
    q = ((head // group * piece + head % group * dh)[:, None] + np.arange(dh)).ravel()
    start = np.arange(cfg.h_kv) * piece
    k = ((start + group * dh)[:, None] + np.arange(dh)).ravel()
    v = ((start + (group + 1) * dh)[:, None] + np.arange(dh)).ravel()
    return q, k, v


def load_params(folder, fields: dict, dtype, rows: list, checkpoint: str, tied_copy,
                ignored: tuple) -> dict[str, np.ndarray]:
    """The folder's weights under tfm's names (``rows``: a ``name_map``), transposed to ``(d_in,
    d_out)``, in ``dtype``, a fused row cut by ``grouped_rows``; in tfm's order. Every key and
    shape is checked before any is read (``llama.check_stored``; ``tied_copy``, ``ignored``)."""
    shapes = param_shapes(Config(**fields))
    stored = llama.stored_tensors(folder)
    llama.check_stored(folder, stored, {key: key for key in stored},
                       llama.stored_shapes(rows, shapes), checkpoint, tied_copy, ignored)
    picks = grouped_rows(fields)
    params = {}
    for key, name, transposed in rows:
        if not isinstance(name, tuple):
            params[name] = tensorfile.read_tensor(*stored[key], key, dtype, transposed)
            continue
        value = tensorfile.read_tensor(*stored[key], key, dtype)   # (d_out, ...) rows
        for n, picked in zip(name, picks):
            params[n] = np.ascontiguousarray(value[picked].T if transposed else value[picked])
    return {name: params[name] for name in shapes}


def from_tfm(params: dict, fields: dict, rows: list) -> dict[str, np.ndarray]:
    """tfm's parameters under the stored names of ``rows`` (the inverse of ``load_params``: W_Q,
    W_K and W_V, or their biases, put back in their rows of the fused matrix)."""
    picks = grouped_rows(fields)
    tensors = {}
    for key, name, transposed in rows:
        if not isinstance(name, tuple):
            tensors[key] = np.ascontiguousarray(params[name].T if transposed else params[name])
            continue
        parts = [params[n].T if transposed else params[n] for n in name]
        value = np.empty((sum(len(p) for p in parts), *parts[0].shape[1:]), parts[0].dtype)
        for part, picked in zip(parts, picks):
            value[picked] = part
        tensors[key] = value
    return tensors
