"""The run configuration, its validation, and what can be known about a run without running it.

Shapes, parameter counts, FLOPs and memory are computed here from the Config alone, so that
``tfm shapes`` answers instantly for a GPT-2-sized block and the CLI can refuse a run that would
not fit in memory before allocating anything.
"""

from __future__ import annotations

import dataclasses
import json
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

from tfmcli.errors import ConfigError

NORMS = ("pre", "post")
ACTIVATIONS = ("relu", "gelu")
PES = ("sinusoidal", "none")
INITS = ("normal", "uniform", "xavier", "kaiming")
DTYPES = ("float64", "float32")


@dataclass(frozen=True)
class Config:
    """Everything that decides a run: sizes, architecture choices, mask, init and seed.

    Parameters
    ----------
    batch, seq_len, d_model, heads, vocab, layers : int
        B, T, d, H, V and the number of blocks L. ``d_model`` must be divisible by ``heads``.
    d_ff : int or None
        Hidden width of the feed-forward network; ``None`` means ``4 * d_model``.
    norm : {"pre", "post"}
        Where layer norm sits (see the README's Conventions).
    activation : {"relu", "gelu"}
        FFN non-linearity; gelu is the tanh approximation.
    causal : bool
        Query t sees only keys <= t.
    lengths : tuple of int or None
        Valid length of each batch row, ``1 <= len <= T``; keys at ``>= len`` are hidden and those
        positions are left out of the loss. ``None`` means every row is full.
    pe : {"sinusoidal", "none"}
    init : {"normal", "uniform", "xavier", "kaiming"}
    dtype : {"float64", "float32"}
    eps : float
        Layer-norm epsilon, inside the square root.
    seed : int
        Seed of ``np.random.default_rng`` for parameters and inputs.
    """

    batch: int = 2
    seq_len: int = 4
    d_model: int = 6
    heads: int = 2
    d_ff: int | None = None
    vocab: int = 8
    layers: int = 1
    norm: str = "pre"
    activation: str = "relu"
    causal: bool = True
    lengths: tuple[int, ...] | None = None
    pe: str = "sinusoidal"
    init: str = "xavier"
    dtype: str = "float64"
    eps: float = 1e-5
    seed: int = 1000

    def __post_init__(self):
        if self.lengths is not None:
            object.__setattr__(self, "lengths", tuple(int(n) for n in self.lengths))
        for name in ("batch", "seq_len", "d_model", "heads", "vocab", "layers"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
                raise ConfigError(name, f"{name} must be a positive integer, got {value!r}")
        if self.d_ff is not None and (not isinstance(self.d_ff, (int, np.integer)) or self.d_ff < 1):
            raise ConfigError("d_ff", f"d_ff must be a positive integer, got {self.d_ff!r}")
        if self.d_model % self.heads:
            raise ConfigError(
                "heads",
                f"d_model={self.d_model} is not divisible by heads={self.heads}; "
                f"allowed heads: {', '.join(str(h) for h in divisors(self.d_model))}",
            )
        for name, choices in (("norm", NORMS), ("activation", ACTIVATIONS), ("pe", PES),
                              ("init", INITS), ("dtype", DTYPES)):
            if getattr(self, name) not in choices:
                raise ConfigError(
                    name, f"{name}={getattr(self, name)!r} is not one of {', '.join(choices)}")
        if self.lengths is not None:
            if len(self.lengths) != self.batch:
                raise ConfigError(
                    "lengths",
                    f"lengths has {len(self.lengths)} values but batch={self.batch}; give one per row")
            bad = [n for n in self.lengths if not 1 <= n <= self.seq_len]
            if bad:
                raise ConfigError(
                    "lengths", f"lengths {bad[0]} is outside 1..{self.seq_len} (seq_len)")
        if not (isinstance(self.eps, (int, float)) and np.isfinite(self.eps) and self.eps > 0):
            raise ConfigError("eps", f"eps must be a positive finite number, got {self.eps!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, (int, np.integer)) or self.seed < 0:
            raise ConfigError("seed", f"seed must be a non-negative integer, got {self.seed!r}")

    @property
    def d_head(self) -> int:
        return self.d_model // self.heads

    @property
    def ff(self) -> int:
        """The FFN hidden width actually used."""
        return self.d_ff if self.d_ff is not None else 4 * self.d_model

    @property
    def np_dtype(self) -> np.dtype:
        return np.dtype(self.dtype)

    def lengths_array(self) -> np.ndarray:
        """(B,) int64: the valid length of each row."""
        if self.lengths is None:
            return np.full(self.batch, self.seq_len, dtype=np.int64)
        return np.array(self.lengths, dtype=np.int64)

    def replace(self, **changes) -> "Config":
        return dataclasses.replace(self, **changes)

    def to_json(self) -> str:
        fields = dataclasses.asdict(self)
        if fields["lengths"] is not None:
            fields["lengths"] = list(fields["lengths"])
        return json.dumps(fields)

    @classmethod
    def from_json(cls, text: str) -> "Config":
        fields = json.loads(text)
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(fields) - known)
        if unknown:
            raise ConfigError(unknown[0], f"unknown config field {unknown[0]!r}")
        if fields.get("lengths") is not None:
            fields["lengths"] = tuple(fields["lengths"])
        return cls(**fields)


def divisors(n: int) -> list[int]:
    return [h for h in range(1, n + 1) if n % h == 0]


# ---------------------------------------------------------------- shapes, without allocating

def param_shapes(cfg: Config) -> OrderedDict[str, tuple[int, ...]]:
    """Every parameter name and shape, in the order they are initialised."""
    d, V, F = cfg.d_model, cfg.vocab, cfg.ff
    shapes: OrderedDict[str, tuple[int, ...]] = OrderedDict()
    shapes["embed.W_E"] = (V, d)
    for i in range(cfg.layers):
        p = f"blocks.{i}."
        shapes[p + "ln1.gamma"] = (d,)
        shapes[p + "ln1.beta"] = (d,)
        for w in "QKVO":
            shapes[p + f"attn.W_{w}"] = (d, d)
            shapes[p + f"attn.b_{w}"] = (d,)
        shapes[p + "ln2.gamma"] = (d,)
        shapes[p + "ln2.beta"] = (d,)
        shapes[p + "ffn.W_1"] = (d, F)
        shapes[p + "ffn.b_1"] = (F,)
        shapes[p + "ffn.W_2"] = (F, d)
        shapes[p + "ffn.b_2"] = (d,)
    if cfg.norm == "pre":
        shapes["ln_f.gamma"] = (d,)
        shapes["ln_f.beta"] = (d,)
    shapes["head.W_U"] = (d, V)
    shapes["head.b_U"] = (V,)
    return shapes


def activation_shapes(cfg: Config) -> OrderedDict[str, tuple[int, ...]]:
    """Every named activation and its shape, in forward order (the model produces exactly these)."""
    B, T, d, H, F, V = cfg.batch, cfg.seq_len, cfg.d_model, cfg.heads, cfg.ff, cfg.vocab
    btd = (B, T, d)
    heads = (B, H, T, cfg.d_head)
    shapes: OrderedDict[str, tuple[int, ...]] = OrderedDict()
    shapes["embed"] = btd
    if cfg.pe == "sinusoidal":
        shapes["pe"] = (T, d)
    for i in range(cfg.layers):
        p = f"blocks.{i}."
        attn = [(p + "attn.q", heads), (p + "attn.k", heads), (p + "attn.v", heads),
                (p + "attn.scores", (B, H, T, T)), (p + "attn.pattern", (B, H, T, T)),
                (p + "attn.context", btd), (p + "attn.out", btd)]
        ffn = [(p + "ffn.pre", (B, T, F)), (p + "ffn.act", (B, T, F)), (p + "ffn.out", btd)]
        shapes[p + "in"] = btd
        if cfg.norm == "pre":
            order = [(p + "ln1.out", btd), *attn, (p + "resid1", btd),
                     (p + "ln2.out", btd), *ffn, (p + "resid2", btd)]
        else:
            order = [*attn, (p + "resid1", btd), (p + "ln1.out", btd),
                     *ffn, (p + "resid2", btd), (p + "ln2.out", btd)]
        shapes.update(order)
        shapes[p + "out"] = btd
    if cfg.norm == "pre":
        shapes["ln_f.out"] = btd
    shapes["logits"] = (B, T, V)
    shapes["probs"] = (B, T, V)
    return shapes


def numel(shape: tuple[int, ...]) -> int:
    return int(np.prod(shape, dtype=np.int64))


def param_count(cfg: Config) -> int:
    return sum(numel(s) for s in param_shapes(cfg).values())


def param_groups(cfg: Config) -> OrderedDict[str, int]:
    """Parameter counts per group (embed, attn, ln, ffn, head), summed over blocks."""
    groups: OrderedDict[str, int] = OrderedDict()
    for name, shape in param_shapes(cfg).items():
        group = name.split(".")[-2] if name.startswith("blocks.") else name.split(".")[0]
        group = "ln" if group in ("ln1", "ln2", "ln_f") else group
        groups[group] = groups.get(group, 0) + numel(shape)
    return groups


def flops(cfg: Config) -> tuple[int, int]:
    """(forward, backward) floating-point operations of the matrix products, 2 per multiply-add.

    Attention's two batched products (Q K^T and pattern @ V) are included. Backward does two
    products for every forward one (the input gradient and the weight gradient; attention's
    dQ, dK and dpattern, dV), so it is twice the forward. Element-wise work is left out.
    """
    B, T, d, F, V = cfg.batch, cfg.seq_len, cfg.d_model, cfg.ff, cfg.vocab
    per_block = 2 * B * T * d * d * 4          # Q, K, V, O projections
    per_block += 2 * 2 * B * T * T * d         # Q K^T and pattern @ V over all heads
    per_block += 2 * 2 * B * T * d * F         # W_1 and W_2
    forward = cfg.layers * per_block + 2 * B * T * d * V
    return forward, 2 * forward


def memory_estimate(cfg: Config) -> dict[str, int]:
    """Bytes a forward + backward holds at its peak, by part.

    A run keeps every parameter and its gradient, every named activation and its gradient, and
    the few extra arrays the backward caches (layer-norm statistics, the attention mask). On top
    of that the largest transient is a couple of (B, H, T, T) or (B, T, V) temporaries.
    """
    item = np.dtype(cfg.dtype).itemsize
    B, T, H, V = cfg.batch, cfg.seq_len, cfg.heads, cfg.vocab
    params = param_count(cfg) * item
    acts = sum(numel(s) for s in activation_shapes(cfg).values()) * item
    lns = 2 * cfg.layers + (cfg.norm == "pre")
    caches = lns * B * T * (cfg.d_model + 1) * item + cfg.layers * B * H * T * T  # xhat+rstd, mask
    transient = 3 * max(B * H * T * T, B * T * V, B * T * cfg.ff) * item
    parts = {"params": params, "grads": params, "activations": acts, "activation grads": acts,
             "caches": caches, "transient": transient}
    parts["total"] = sum(parts.values())
    return parts
