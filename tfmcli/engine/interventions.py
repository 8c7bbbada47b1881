"""Change a number and run again: ablate, set, scale or patch activations by name.

    forward(params, inputs, cfg, interventions=[Ablate("blocks.0.attn.head1"),
                                                Scale("blocks.0.ffn.act[:, 3]", 2.0)])

A target is an activation's name (``blocks.0.ffn.act``), optionally indexed with NumPy's basic
indexing (``blocks.0.ffn.act[:, 3, 5:9]``), or a shorthand: ``blocks.{i}.attn.head{h}`` (head
h's slice of the attention context, before ``W_O``), ``blocks.{i}.attn`` (``attn.out``),
``blocks.{i}.ffn`` (``ffn.out``). Each is applied where the forward pass keeps the activation,
in the order given, before anything reads it.

The backward goes through the changed graph: an entry set, ablated or patched is a constant, so
no gradient reaches what computed it; a scaled entry passes its gradient on scaled. The
activation's own gradient (``grads.acts``) is the loss's with respect to the changed value.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Mapping

import numpy as np

from tfmcli.engine.names import close_names
from tfmcli.errors import TfmError

HEAD = re.compile(r"blocks\.(\d+)\.attn\.head(\d+)$")
# the loss's own output: not a place to change a number
FIXED = {"probs": "probs is the loss's softmax of the logits"}


class InterventionError(TfmError, ValueError):
    """A target that names no activation, an index outside it, or a value that does not fit
    it. ``target`` is the target as given; the CLI reports a usage error naming it."""

    def __init__(self, target: str, message: str):
        super().__init__(message)
        self.target = target


@dataclass(frozen=True)
class Ablate:
    """Zero the target (``using="zero"``), or set each entry to its mean over the real,
    unpadded positions of every batch row of the same run (``using="mean"``)."""

    target: str
    using: str = "zero"

    def describe(self) -> str:
        return f"ablate {self.target}" + (" (mean)" if self.using == "mean" else "")


@dataclass(frozen=True)
class Set:
    """Set the target's entries to ``value``."""

    target: str
    value: float

    def describe(self) -> str:
        return f"set {self.target} = {self.value:g}"


@dataclass(frozen=True)
class Scale:
    """Multiply the target's entries by ``factor`` (steering)."""

    target: str
    factor: float

    def describe(self) -> str:
        return f"scale {self.target} x {self.factor:g}"


@dataclass(frozen=True)
class Patch:
    """Replace the target's entries with their values in another run of the same model:
    ``source`` is that run's ``Forward`` (or a mapping of activation name to array)."""

    target: str
    source: object

    def describe(self) -> str:
        return f"patch {self.target}"


KINDS = (Ablate, Set, Scale, Patch)


# ------------------------------------------------------------------ targets


def split_target(target: str) -> tuple[str, str | None]:
    """'blocks.0.ffn.act[:, 3]' -> ('blocks.0.ffn.act', ':, 3'); no brackets: (target, None)."""
    target = target.strip()
    m = re.fullmatch(r"([^\[\]]+?)\s*(?:\[(.*)\])?", target)
    if m is None:
        raise InterventionError(target, f"{target!r}: a target is a name with an optional "
                                        "[index], such as blocks.0.ffn.act[:, 3, 5:9]")
    return m[1], m[2]


def parse_index(target: str, text: str | None) -> tuple:
    """NumPy's basic indexing, written as in Python: integers, slices (a:b:c), '...'."""
    if text is None:
        return ()
    parts = []
    for part in text.split(","):
        part = part.strip()
        try:
            if part == "...":
                parts.append(Ellipsis)
            elif ":" in part:
                bounds = [int(b) if b.strip() else None for b in part.split(":")]
                if len(bounds) > 3 or bounds[2:3] == [0]:
                    raise ValueError
                parts.append(slice(*bounds))
            else:
                parts.append(int(part))
        except ValueError:
            raise InterventionError(target, f"{target!r}: {part!r} is not an index; an index "
                                            "is integers, slices (a:b) and ... between commas"
                                    ) from None
    return tuple(parts)


def resolve(target: str, shapes: Mapping[str, tuple]) -> tuple[str, tuple, tuple]:
    """(activation name, the shorthand's own slice, the index given) of ``target``, checked
    against ``shapes`` (name -> shape of this run's activations)."""
    name, text = split_target(target)
    index = parse_index(target, text)
    base: tuple = ()
    m = HEAD.match(name)
    if m:
        block, head = int(m[1]), int(m[2])
        context = f"blocks.{block}.attn.context"
        if context not in shapes:
            raise InterventionError(target, f"{target!r}: there is no block {block} "
                                            f"(blocks 0..{_blocks(shapes) - 1})")
        heads = _heads(shapes, block)
        if head >= heads:
            raise InterventionError(target, f"{target!r}: block {block} has heads 0.."
                                            f"{heads - 1}")
        width = shapes[context][-1] // heads
        name, base = context, (Ellipsis, slice(head * width, (head + 1) * width))
    elif re.fullmatch(r"blocks\.\d+\.(attn|ffn)", name):
        name += ".out"
    part = name.split(".", 2)[-1] if name.startswith("blocks.") else name
    if part in FIXED:
        raise InterventionError(target, f"{target!r}: {FIXED[part]}; change the logits "
                                        "instead")
    if name not in shapes:
        near = [n for n in shapes if n.endswith("." + part) or n == part][:3]
        close = near or close_names(name, shapes)
        hint = f"; did you mean {', '.join(close)}?" if close else ""
        raise InterventionError(target, f"{target!r}: no activation {name!r}{hint} (the names "
                                        f"are the run's activations, as tfm forward --json "
                                        f"lists them, and a head's output is "
                                        f"blocks.{{i}}.attn.head{{h}})")
    shape = shapes[name]
    region = np.empty(shape, dtype=np.int8)[base] if base else np.empty(shape, dtype=np.int8)
    try:
        region[index]
    except IndexError as e:
        raise InterventionError(target, f"{target!r}: {e} (its shape is "
                                        f"{'x'.join(map(str, region.shape))})") from None
    return name, base, index


def _blocks(shapes) -> int:
    return sum(1 for n in shapes if n.endswith(".attn.context"))


def _heads(shapes, block: int) -> int:
    return shapes[f"blocks.{block}.attn.q"][1]


# ------------------------------------------------------------------ a forward pass's plan


class Plan:
    """The interventions of one forward pass by activation name: ``apply`` changes an
    activation as the pass keeps it, ``through`` passes its gradient back to what made it."""

    def __init__(self, interventions, shapes: Mapping[str, tuple], lengths: np.ndarray):
        self.lengths = np.asarray(lengths)
        self.interventions = list(interventions)
        self.steps: dict[str, list] = {}
        self.described = []
        for intervention in interventions:
            if not isinstance(intervention, KINDS):
                raise TypeError(f"interventions: {intervention!r} is not an Ablate, Set, Scale "
                                "or Patch")
            if isinstance(intervention, Ablate) and intervention.using not in ("zero", "mean"):
                raise InterventionError(intervention.target, f"ablate {intervention.target!r}:"
                                        f" using={intervention.using!r}; zero or mean")
            name, base, index = resolve(intervention.target, shapes)
            self.steps.setdefault(name, []).append((intervention, base, index))
            self.described.append(intervention.describe())
        self.passes: dict[str, np.ndarray] = {}   # name -> d(kept) / d(made), entry by entry
        self.means: dict[str, np.ndarray] = {}    # a mean ablation's means, from the first pass

    def __bool__(self) -> bool:
        return bool(self.steps)

    def apply(self, name: str, x: np.ndarray) -> np.ndarray:
        """Activation ``name`` as the pass keeps it: ``x`` changed by each intervention on it,
        in order (a copy; ``x`` is not written)."""
        steps = self.steps.get(name)
        if not steps:
            return x
        x, slope = x.copy(), np.ones(x.shape, dtype=x.dtype)
        for intervention, base, index in steps:
            region, passes = (x[base], slope[base]) if base else (x, slope)
            if isinstance(intervention, Scale):
                region[index] *= intervention.factor
                passes[index] *= intervention.factor
                continue
            if isinstance(intervention, Set):
                region[index] = intervention.value
            elif isinstance(intervention, Ablate):
                if intervention.using == "mean" and name not in self.means:
                    self.means[name] = self._mean(name, x)
                region[index] = self.means[name][base][index] if intervention.using == \
                    "mean" else 0.0
            else:
                region[index] = self._patched(intervention, name, x)[base][index]
            passes[index] = 0.0   # a constant: nothing flows back to what made it
        self.passes[name] = slope
        return x

    def through(self, name: str, dx: np.ndarray) -> np.ndarray:
        """The gradient of what made activation ``name``, from the gradient of its kept value."""
        slope = self.passes.get(name)
        return dx if slope is None else dx * slope

    def _mean(self, name: str, x: np.ndarray) -> np.ndarray:
        """Each entry's mean over the real (unpadded) positions of every row, broadcast back
        to ``x``'s shape: the positions are axis 1 of (B, T, ...), axis 2 of (B, H, T, ...),
        axis 0 of the positions' own (T, d)."""
        if x.ndim == 2:   # pe: (T, d), shared by the rows
            real = np.arange(x.shape[0]) < self.lengths.max()
            return np.broadcast_to(x[real].mean(axis=0), x.shape)
        axis = 2 if x.ndim == 4 else 1
        T = x.shape[axis]
        real = np.arange(T)[None, :] < self.lengths[:, None]                  # (B, T)
        moved = np.moveaxis(x, axis, 1)                                      # (B, T, ...)
        mean = moved[real].mean(axis=0)                                      # (...)
        return np.broadcast_to(np.expand_dims(mean, (0, axis)), x.shape)

    def _patched(self, intervention: Patch, name: str, x: np.ndarray) -> np.ndarray:
        source = intervention.source
        acts = getattr(source, "acts", source)
        if name not in acts:
            raise InterventionError(intervention.target, f"patch {intervention.target!r}: the "
                                    f"source run has no {name!r}")
        values = np.asarray(acts[name])
        if values.shape != x.shape:
            raise InterventionError(intervention.target, f"patch {intervention.target!r}: "
                                    f"{name} is {'x'.join(map(str, x.shape))} in this run and "
                                    f"{'x'.join(map(str, values.shape))} in the source run")
        return values
