"""Q, K and V picked from stored rows: one fused matrix with a piece per key head (GPT-NeoX's and
Falcon's ``query_key_value``, GPTBigCode's ``c_attn``: ``grouped_rows``), or with W_Q, W_K and
W_V whole one after another (MPT's ``Wqkv``: ``stacked_rows``), CodeGen's four pieces,
or GPT-J's W_Q and W_K with their columns reordered. Reading and writing a folder whose
``name_map`` has such rows, a fused one's tfm parameter the tuple (W_Q, W_K, W_V) or their
biases (``load_params``, ``from_tfm``)."""

from __future__ import annotations

import numpy as np

from tfmcli.engine.config import Config
from tfmcli.engine.sizes import param_shapes
from tfmcli.sources import llama


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


def stacked_rows(fields: dict) -> dict[str, np.ndarray]:
    """``picks`` for a fused matrix that holds W_Q's rows, then W_K's, then W_V's, each whole
    (MPT's ``Wqkv``, whose output is cut in three equal parts)."""
    cfg = Config(**fields)
    q, kv = cfg.d_q, cfg.d_kv
    return {"Q": np.arange(q), "K": np.arange(q, q + kv), "V": np.arange(q + kv, q + 2 * kv)}


def _pick(name: str, picks: dict):
    """The stored rows ``picks`` gives this parameter (by its letter: ``attn.W_Q`` and
    ``attn.b_Q`` are "Q"), or None for one read as it is stored."""
    last = name.rsplit(".", 1)[-1]
    return picks.get(last[-1]) if last in ("W_Q", "W_K", "W_V", "b_Q", "b_K", "b_V") else None


def load_params(folder, fields: dict, dtype, rows: list, checkpoint: str, tied_copy,
                ignored: tuple, picks: dict | None = None) -> dict[str, np.ndarray]:
    """The folder's weights under tfm's names (``rows``: a ``name_map``), transposed to ``(d_in,
    d_out)``, in ``dtype``, in tfm's order. ``picks`` ("Q", "K", "V" -> stored rows, in tfm's
    column order; ``grouped_rows`` by default) cuts a fused row into its parts, or reorders one
    weight's columns (GPT-J's W_Q and W_K). Every key and shape is checked before any is read
    (``llama.check_stored``; ``tied_copy``, ``ignored``); then each is read in turn
    (``lazy_params``: a fused tensor once for its parts)."""
    return dict(lazy_params(folder, fields, dtype, rows, checkpoint, tied_copy, ignored,
                            picks).items())


def lazy_params(folder, fields: dict, dtype, rows: list, checkpoint: str, tied_copy,
                ignored: tuple, picks: dict | None = None, then=None) -> llama.LazyParams:
    """``load_params``' weights, checked the same way, each read when the pass uses it
    (``llama.LazyParams``): a fused tensor cut by ``picks`` as it is read."""
    shapes = param_shapes(Config(**fields))
    stored = llama.stored_tensors(folder)
    llama.check_stored(folder, stored, {key: key for key in stored},
                       llama.stored_shapes(rows, shapes), checkpoint, tied_copy, ignored)
    picks = dict(zip("QKV", grouped_rows(fields))) if picks is None else picks
    return llama.LazyParams(stored, {key: key for key in stored}, rows, shapes, dtype, then,
                            pick=lambda name: _pick(name, picks))


def from_tfm(params: dict, fields: dict, rows: list,
             picks: dict | None = None) -> dict[str, np.ndarray]:
    """tfm's parameters under the stored names of ``rows`` (the inverse of ``load_params``: each
    picked parameter put back in its stored rows)."""
    picks = dict(zip("QKV", grouped_rows(fields))) if picks is None else picks
    tensors = {}
    for key, name, transposed in rows:
        names = llama.weight_names(name)
        parts = [params[n].T if transposed else params[n] for n in names]
        chosen = [_pick(n, picks) for n in names]
        if chosen[0] is None:   # one parameter, stored as it is
            tensors[key] = np.ascontiguousarray(parts[0])
            continue
        value = np.empty((sum(len(p) for p in parts), *parts[0].shape[1:]), parts[0].dtype)
        for part, rows_of_part in zip(parts, chosen):
            value[rows_of_part] = part
        tensors[key] = value
    return tensors
