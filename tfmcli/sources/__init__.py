"""Where a run comes from: the weights from a seed, an ``.npz`` or a checkpoint folder (any of
the 19 families ``sources.families.MODEL_TYPES`` names, each read by its own module), the tokens
from a seed, a file, ``--tokens`` or ``--text``. Every source becomes the same
:class:`Run`, so each command asks here once.

``resolve`` decides the Config without drawing or reading any weights; the caller can then
refuse a run too big for memory before ``Run.complete`` allocates them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np

from tfmcli.engine import precision
from tfmcli.engine.config import Config
from tfmcli.engine.init import init_params
from tfmcli.engine.inputs import IGNORE, Inputs, inputs_from_tokens, make_inputs
from tfmcli.engine.model import arrays_repr
from tfmcli.errors import ConfigError, TfmError
from tfmcli.sources import gpt2
from tfmcli.sources.families import checkpoint_module
from tfmcli.sources.gguf import gguf_reader, is_gguf
from tfmcli.sources.gpt2 import MissingExtra
from tfmcli.sources.npz import (
    check_inputs,
    check_params,
    infer_activation,
    infer_heads,
    infer_norm,
    load_npz,
)
from tfmcli.sources.text import find_tokenizer

INPUT_FIELDS = ("batch", "seq_len", "lengths")  # Config fields the tokens decide
PAD_LABEL = "pad"

__all__ = ["MissingExtra", "Run", "load", "parse_tokens", "resolve"]


@dataclass
class Run:
    """A run's Config, parameters and inputs, where each came from, and how to show a token.

    ``params`` and ``inputs`` are None until :meth:`complete` reads or draws them.
    """

    cfg: Config
    params: dict | None
    inputs: Inputs | None
    weights_from: str   # "seed 1000 (xavier init)", "file run.npz", "GPT-2 checkpoint gpt2/"
    #                     "LLaMA checkpoint smollm/", "Qwen2 checkpoint qwen/", ...
    tokens_from: str    # "seed 1000", "--tokens", "--text", "file run.npz"
    token_text: Callable[[int], str] = str               # id -> what a person reads
    read_params: Callable[[], dict] | None = field(default=None, repr=False)
    arch: str | None = None   # the --arch preset the Config's architecture came from
    task: dict | None = None  # what a model tfm train saved was trained on (its npz "task")
    scored: str = "every position"   # which positions the loss scores, said in the panel
    encode: Callable[[str], list] | None = field(default=None, repr=False)   # text -> ids
    interventions: list = field(default_factory=list)   # what the CLI changed, described
    # a checkpoint's weights read when used (a streamed pass), or None where it cannot
    lazy_params: Callable[[], Mapping] | None = field(default=None, repr=False)
    streamed: str | None = None   # held a block at a time: how, said in the panel (tfm CLI)

    def __repr__(self) -> str:
        params = None if self.params is None else arrays_repr(self.params)
        return (f"Run(cfg={self.cfg!r}, params={params}, inputs={self.inputs!r}, "
                f"weights_from={self.weights_from!r}, tokens_from={self.tokens_from!r})")

    def complete(self) -> "Run":
        """The run with its parameters and inputs: read, or drawn from the seed. In float16
        or bfloat16 the parameters are held as the dtype holds them (``precision.Cast``),
        those read each let go as it is cast; an overflow is reported under the caller's
        ``np.errstate``."""
        made = self.params is None
        params = self.params if not made else (
            self.read_params() if self.read_params else init_params(self.cfg))
        policy = precision.of(self.cfg.dtype)
        if (not policy.exact and isinstance(params, dict)
                and getattr(params, "rounded", None) != policy.name):
            cast = precision.Cast({}, policy)
            for name in list(params):   # an .npz's or the caller's dict is left as it is
                cast[name] = params.pop(name) if made else params[name]
            params = cast
        self.params = params
        if self.inputs is None:
            self.inputs = make_inputs(self.cfg)
        return self

    def token_labels(self, row: int) -> list[str]:
        """One label per position of batch row ``row``: the token, or 'pad' past its length."""
        tokens, length = self.inputs.tokens[row], int(self.inputs.lengths[row])
        return [self.token_text(int(t)) if i < length else PAD_LABEL for i, t in enumerate(tokens)]

    def target_labels(self, row: int) -> list[str]:
        """The target of each position of row ``row``; '—' where there is none."""
        targets, length = self.inputs.targets[row], int(self.inputs.lengths[row])
        return [self.token_text(int(t)) if i < length and t != IGNORE else "—"
                for i, t in enumerate(targets)]


def resolve(flags: dict, explicit: set[str], load=None, tokens=None, text=None,
            score_all: bool = False) -> Run:
    """The run that command-line style settings describe.

    Parameters
    ----------
    flags : dict
        Every Config field as the command line sets it (typed or default).
    explicit : set of str
        The fields the user typed; a typed value that a file or the tokens contradict is an
        error, never silently overridden.
    load : path, optional
        An ``.npz`` in tfm's layout (its parameters, and its inputs unless tokens are given),
        or a checkpoint folder of any family ``sources.families.MODEL_TYPES`` names
        (its parameters; its tokenizer for ``text``).
    tokens : list of list of int, optional
        The input ids, one list per batch row (see ``model.inputs_from_tokens``).
    text : list of str, optional
        Texts to tokenize with the checkpoint folder's tokenizer, one per batch row.
    score_all : bool
        Score every position even for a model ``tfm train`` saved, whose loss by default scores
        the answer positions alone, as its training did.

    Raises
    ------
    ConfigError
        A setting is out of range or contradicts the file or the tokens (``field`` names it).
    MissingExtra
        A checkpoint folder or text needs a package that is not installed.
    TfmError
        The file cannot be read or does not describe a run.
    """
    fields, params, inputs, read_params, task = {}, None, None, None, None
    weights_from = tokens_from = tokenizer = None
    from_file = None   # where an .npz's own fields come from, for an error in one of them
    token_text = str
    folder = load is not None and Path(load).is_dir()
    gguf_file = load is not None and not folder and is_gguf(load)
    if folder:
        gpt2.require_safetensors()   # a folder needs the hf extra (its tokenizer, GPT-2's weights)
        checkpoint = checkpoint_module(load)   # gpt2, llama, ... qwen3, as config.json says
        fields = checkpoint.read_config(load)
        weights_from = f"{checkpoint.NAME} checkpoint {load}"
        tokenizer = find_tokenizer(load)
        if tokenizer is not None:
            token_text = tokenizer.label
    elif gguf_file:   # the gguf package reads it: the model's, and its tokenizer's, metadata
        checkpoint = gguf_reader()
        fields = checkpoint.read_config(load)
        weights_from = checkpoint.describe(load)
        tokenizer = checkpoint.find_tokenizer(load, needed=text is not None)
        if tokenizer is not None:
            token_text = tokenizer.label
    elif load is not None:
        loaded = load_npz(load)
        fields, params, inputs, task = (
            dict(loaded.fields),
            loaded.params,
            loaded.inputs,
            loaded.task,
        )
        if not loaded.has_config:   # heads of their own width, grouped keys: for the heads given
            fields.update(infer_heads(params, {**flags, **fields}))
            fields.update(infer_activation(params, {**flags, **fields}))   # a gate: which one
            fields.update(infer_norm({**flags, **fields}))   # gamma alone: which norm
        weights_from = f"file {load}" + (
            f" (saved with {'; '.join(loaded.interventions)}: the weights, not the change)"
            if loaded.interventions else "")
        tokens_from = f"file {load}" if inputs is not None else None
        from_file = (set(fields), "key 'config'" if loaded.has_config else "its arrays' shapes")
    if text is not None:
        if tokens is not None:
            raise ConfigError("text", "give the input as --text or as --tokens, not both")
        if tokenizer is None:
            where = f"{load} has no tokenizer.json (or vocab.json + merges.txt)" if folder else \
                f"{load} has no tokenizer (no key 'tokenizer.ggml.model')" if gguf_file else \
                "it needs --load DIR, a checkpoint folder with tokenizer.json, or a GGUF file"
            raise ConfigError("text", f"tfm cannot tokenize text here: {where}; --tokens "
                                      f"takes ids")
        for t in text:   # a byte that is not UTF-8 reaches Python as a lone surrogate
            bad = next((i for i, char in enumerate(t) if "\udc80" <= char <= "\udcff"), None)
            if bad is not None:
                raise ConfigError("text", f"{t.encode('utf-8', 'surrogateescape')!r} is not "
                                          f"UTF-8 (byte 0x{ord(t[bad]) - 0xdc00:02x} at "
                                          f"{bad}); give the text in UTF-8")
        tokens = [tokenizer.encode(t) for t in text]
        empty = [t for t, ids in zip(text, tokens) if not ids]
        if empty:
            raise ConfigError("text", f"{empty[0]!r} has no tokens")
        _check_rows(tokens, "text")
    for name in explicit:
        if name in fields and fields[name] != flags[name] and not (tokens and name in INPUT_FIELDS):
            raise ConfigError(name, f"{name}={flags[name]!r} contradicts {load}, which has "
                                    f"{name}={fields[name]!r}; drop the flag or change the file")
    if folder or gguf_file:   # a typed option the checkpoint leaves nothing to do is refused
        unused = {"init": "its weights are read, not drawn"}
        if tokens is not None:
            unused["seed"] = "its weights are read, and the tokens are given"
        name = min(explicit & set(unused), default=None)
        if name is not None:
            raise ConfigError(name, f"{name}={flags[name]!r} changes nothing with --load "
                                    f"{load}: {unused[name]}")
    if tokens is not None:
        inputs = inputs_from_tokens(tokens)
        _check_against_tokens(flags, explicit, inputs, "--text" if text else "--tokens")
        B, T = inputs.tokens.shape
        full = bool(np.all(inputs.lengths == T))
        # the tokens replace a file's inputs, and with them its batch, seq_len and lengths
        fields.update(batch=B, seq_len=T,
                      lengths=None if full else tuple(int(n) for n in inputs.lengths))
        tokens_from = "--text" if text else "--tokens"
    try:
        cfg = Config(**{**flags, **fields})
    except TypeError as e:
        raise TfmError(f"--load {load}: key 'config' does not describe a run ({e})") from None
    except ConfigError as e:   # too many tokens for the learned positions: name what was typed
        by_tokens = tokens is not None and e.field in INPUT_FIELDS
        if from_file and e.field in from_file[0] and e.field not in explicit and not by_tokens:
            raise TfmError(f"--load {load}: {from_file[1]}: {e}") from None   # the file's fault
        if not by_tokens or e.field in explicit:
            raise
        option = "text" if text else "tokens"
        raise ConfigError(option, f"the longest row has {T} tokens, and {e}") from None
    if tokens is not None:
        _check_ids(inputs, cfg, "text" if text else "tokens")
    lazy = None
    if folder or gguf_file:
        read_params = lambda: checkpoint.load_params(load, fields, cfg.np_dtype)  # noqa: E731
        if hasattr(checkpoint, "lazy_params"):
            lazy = lambda: checkpoint.lazy_params(load, fields, cfg.np_dtype)  # noqa: E731
    elif load is not None:
        params = check_params(load, params, cfg)
        if tokens is None:
            inputs = check_inputs(load, inputs, cfg)
    seed = f"seed {cfg.seed}"
    scored = "every position"
    if task is not None and inputs is not None:   # as the model was trained, or every position
        from tfmcli.train.tasks import scored_as_trained

        inputs, scored = scored_as_trained(inputs, task, score_all)
    return Run(cfg, params, inputs, weights_from or f"{seed} ({cfg.init} init)",
               tokens_from or seed, token_text, read_params, task=task, scored=scored,
               encode=None if tokenizer is None else tokenizer.encode, lazy_params=lazy)


def load(path, *, tokens=None, text=None, score_all=False, **fields) -> Run:
    """A run from a checkpoint folder (any family tfm reads: docs/models.md) or an ``.npz``,
    ready for ``forward``.

    >>> run = tfmcli.load("gpt2", text="The cat sat on the mat")      # doctest: +SKIP
    >>> fwd = tfmcli.forward(run.params, run.inputs, run.cfg)          # doctest: +SKIP

    ``tokens`` (a list of ids, or a list of such lists) or ``text`` (a string or a list of
    strings) give the input; ``fields`` set Config fields the file does not decide (``dtype``).
    A model ``tfm train`` saved scores its answer positions, as it was trained, unless
    ``score_all``.
    """
    if tokens is not None and tokens and not isinstance(tokens[0], (list, tuple, np.ndarray)):
        tokens = [tokens]
    if isinstance(text, str):
        text = [text]
    flags = {**Config().__dict__, **fields}
    return resolve(flags, set(fields), path, tokens, text, score_all).complete()


def parse_tokens(texts, option: str = "tokens") -> list[list[int]] | None:
    """['3,1,4', '1,5'] -> [[3, 1, 4], [1, 5]]; ConfigError naming the text that is not ids."""
    if not texts:
        return None
    rows = []
    for text in texts:
        try:
            rows.append([int(part) for part in text.split(",")])
        except ValueError:
            raise ConfigError(option, f"{text!r} is not a comma-separated list of token ids "
                                      f"(like 3,1,4,1,5)") from None
        huge = next((i for i in rows[-1] if abs(i) >= 2**62), None)
        if huge is not None:   # (a vocabulary never holds so many ids; int64 would overflow)
            raise ConfigError(option, f"id {huge} is too large for a token id")
    _check_rows(rows, option)
    return rows


def _check_rows(rows, option):
    if all(len(row) <= 1 for row in rows):
        what = "text of two or more tokens" if option == "text" else "row of two or more ids"
        raise ConfigError(option, f"no position has a next token to predict: give at least "
                                  f"one {what}")


def _check_against_tokens(flags, explicit, inputs, option):
    B, T = inputs.tokens.shape
    lengths = [int(n) for n in inputs.lengths]
    given = {"batch": (B, f"which gives {B} row{'s' * (B > 1)}"),
             "seq_len": (T, f"whose longest row has {T} tokens"),
             "lengths": (tuple(lengths), f"whose rows have lengths {','.join(map(str, lengths))}")}
    for name, (value, why) in given.items():
        if name in explicit and flags[name] != value:
            typed = flags[name]
            typed = ",".join(map(str, typed)) if isinstance(typed, tuple) else typed
            raise ConfigError(name, f"{name}={typed} contradicts {option}, {why}")


def _check_ids(inputs, cfg, option):
    real = inputs.tokens[np.arange(inputs.tokens.shape[1])[None, :] < inputs.lengths[:, None]]
    bad = real[(real < 0) | (real >= cfg.vocab)]
    if bad.size:
        raise ConfigError(option, f"id {int(bad[0])} is outside 0..{cfg.vocab - 1} "
                                    f"(--vocab {cfg.vocab})")
