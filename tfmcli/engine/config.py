"""The run configuration and its validation: every field, its default and what it may be.

Shapes, parameter counts, FLOPs and memory, which follow from a Config, are ``sizes``'.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Callable, NamedTuple

import numpy as np

from tfmcli.errors import ConfigError

NORMS = ("pre", "post")
ACTIVATIONS = ("relu", "gelu", "swiglu", "geglu", "gelu_erf", "geglu_erf")
GATED = (
    "swiglu",
    "geglu",
    "geglu_erf",
)  # act = f(x W_gate + b_gate) * (x W_1 + b_1): silu or GELU as f
PES = ("sinusoidal", "learned", "none", "rope", "alibi")
ADDED_PES = ("sinusoidal", "learned")   # the encodings added to the embedding (rope turns q, k)
INITS = ("normal", "uniform", "xavier", "kaiming")
DTYPES = ("float64", "float32", "float16", "bfloat16")   # the last two rounded: engine.precision
MAX_LAYERS = 1000  # GPT-3 has 96; a bound keeps every listing and estimate quick
MAX_CONTEXT = 2**31 - 1   # a RoPE scaling's original context: the CLI's largest whole number


class RopeScaling(NamedTuple):
    """LLaMA 3.1's RoPE scaling (``Config.rope_scaling``), in Hugging Face's names. LLaMA 3.1
    has (8, 1, 4, 8192), LLaMA 3.2 (32, 1, 4, 8192)."""
    factor: float                           # how many times slower the slowest pairs turn
    low_freq_factor: float                  # pairs slower than context / this: slowed x factor
    high_freq_factor: float                 # pairs faster than context / this: left alone
    original_max_position_embeddings: int   # the context the model was first trained at

    @classmethod
    def parse(cls, value) -> "RopeScaling | LinearRopeScaling":
        """From four numbers, or a dict with these names (and ``rope_type`` "llama3", which
        ``config.json`` carries); a ``LinearRopeScaling`` from one number, or from a dict of
        ``rope_type`` "linear" and a ``factor``. ConfigError naming what is wrong."""
        if isinstance(value, (LinearRopeScaling, int, float, np.number)) or (
                isinstance(value, (tuple, list)) and len(value) == 1):
            return LinearRopeScaling.parse(value)
        if isinstance(value, dict) and value.get("rope_type") == "linear":
            return LinearRopeScaling.parse(value)
        if isinstance(value, dict):
            value = dict(value)
            kind = value.pop("rope_type", "llama3")
            if kind != "llama3" or set(value) != set(cls._fields):
                raise ConfigError("rope_scaling", f"rope_scaling must name "
                                                  f"{', '.join(cls._fields)} (rope_type llama3), "
                                                  f"got {kind!r} and {sorted(value)}")
            value = [value[name] for name in cls._fields]
        if not isinstance(value, (tuple, list)) or len(value) != 4:
            raise ConfigError("rope_scaling", f"rope_scaling must be four numbers "
                                              f"({', '.join(cls._fields)}), got {value!r}")
        factor, low, high, context = value
        for name, number in zip(cls._fields[:3], (factor, low, high)):
            if not _finite(number) or number <= 0:
                raise ConfigError("rope_scaling", f"rope_scaling's {name} must be a positive "
                                                  f"finite number, got {number!r}")
        if high <= low:
            raise ConfigError("rope_scaling", f"rope_scaling's high_freq_factor ({high:g}) must be "
                                              f"above its low_freq_factor ({low:g})")
        if not _finite(context) or context != int(context) or not 1 <= context <= MAX_CONTEXT:
            raise ConfigError("rope_scaling", f"rope_scaling's original_max_position_embeddings "
                                              f"must be a positive integer, got {context!r} "
                                              f"(allowed: 1..{MAX_CONTEXT})")
        return cls(float(factor), float(low), float(high), int(context))

    def to_dict(self) -> dict:
        """By name, as ``config.json`` writes it (no ``rope_type``: llama3 is the default)."""
        return self._asdict()


class LinearRopeScaling(NamedTuple):
    """Linear RoPE scaling (Hugging Face's ``rope_scaling`` of ``rope_type`` ``"linear"``,
    "position interpolation"): every pair's angle divided by ``factor``, so that position t
    turns as t / factor did. Gemma 3 4B, 12B and 27B have 8 in their full-attention layers."""
    factor: float   # how many times slower every pair turns

    @classmethod
    def parse(cls, value) -> "LinearRopeScaling":
        """From one number (or a one-number tuple), or a dict of ``rope_type`` "linear" and a
        ``factor``; ConfigError naming what is wrong."""
        if isinstance(value, dict):
            value = dict(value)
            kind = value.pop("rope_type", "linear")
            if kind != "linear" or set(value) != {"factor"}:
                raise ConfigError("rope_scaling", f"a linear rope_scaling names factor "
                                                  f"(rope_type linear), got {kind!r} and "
                                                  f"{sorted(value)}")
            value = value["factor"]
        if isinstance(value, (tuple, list)):
            value = value[0]
        if not _finite(value) or value <= 0:
            raise ConfigError("rope_scaling", f"a linear rope_scaling's factor must be a "
                                              f"positive finite number, got {value!r}")
        return cls(float(value))

    def to_dict(self) -> dict:
        """As ``config.json`` writes it: ``{"rope_type": "linear", "factor": ...}``."""
        return {"rope_type": "linear", "factor": self.factor}


# ------------------------------------------------------------------ what each field may be

def _whole(value) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def _finite(value) -> bool:
    """A number (never a bool) that a float holds finitely: an integer past float's range
    (10**400, from a JSON file) is not one, and NumPy's isfinite cannot take it."""
    if isinstance(value, bool) or not isinstance(value, (int, float, np.number)):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:
        return False


class Rule(NamedTuple):
    """What one field's value must be: ``holds(value)``, said as ``must`` in the error (or, for
    a choice, the values allowed), and the type the Config keeps it as (``convert``)."""
    holds: Callable[[object], bool]
    must: str
    convert: Callable | None = None

    def message(self, name: str, value) -> str:
        if self.must.startswith("one of"):
            return f"{name}={value!r} is not {self.must}"
        return f"{name} must be {self.must}, got {value!r}"


POSITIVE_INT = Rule(lambda v: _whole(v) and v >= 1, "a positive integer", int)
NON_NEGATIVE_INT = Rule(lambda v: _whole(v) and v >= 0, "a non-negative integer")
POSITIVE = Rule(lambda v: _finite(v) and v > 0, "a positive finite number")
POSITIVE_FLOAT = Rule(POSITIVE.holds, POSITIVE.must, float)   # kept as a Python float
SWITCH = Rule(lambda v: isinstance(v, (bool, np.bool_)), "true or false")


def one_of(choices: tuple[str, ...]) -> Rule:
    return Rule(lambda v: v in choices, "one of " + ", ".join(choices))


def block_numbers(value) -> bool:
    return isinstance(value, tuple) and all(map(_whole, value))


# Each field's rule, in the Config's order; the rules between fields are Config._check_relations.
RULES = {
    "batch": POSITIVE_INT, "seq_len": POSITIVE_INT, "d_model": POSITIVE_INT,
    "heads": POSITIVE_INT, "d_ff": POSITIVE_INT, "vocab": POSITIVE_INT, "layers": POSITIVE_INT,
    "norm": one_of(NORMS), "activation": one_of(ACTIVATIONS), "causal": SWITCH,
    "pe": one_of(PES), "init": one_of(INITS), "dtype": one_of(DTYPES), "eps": POSITIVE,
    "seed": NON_NEGATIVE_INT, "n_ctx": POSITIVE_INT, "tied_head": SWITCH, "head_bias": SWITCH,
    "rms_norm": SWITCH, "kv_heads": POSITIVE_INT, "rope_theta": POSITIVE, "bias": SWITCH,
    "qkv_bias": SWITCH, "sliding_window": POSITIVE_INT, "head_dim": POSITIVE_INT,
    "qk_norm": SWITCH, "embed_scale": SWITCH, "attn_softcap": POSITIVE_FLOAT,
    "logit_softcap": POSITIVE_FLOAT, "attn_scale": POSITIVE_FLOAT,
    "sandwich_norm": SWITCH,
    "sliding_layers": Rule(block_numbers, "block numbers", lambda v: tuple(map(int, v))),
    "rope_local_theta": POSITIVE_FLOAT, "rotary_dim": POSITIVE_INT,
    "parallel_residual": SWITCH, "shared_norm": SWITCH, "ffn_bias": SWITCH,
    "embed_norm": SWITCH, "norm_bias": SWITCH,
}
# the fields that may be None (the Config's defaults say what None means)
OPTIONAL = {"d_ff", "n_ctx", "kv_heads", "sliding_window", "head_dim", "attn_softcap",
            "logit_softcap", "attn_scale", "sliding_layers", "rope_local_theta", "rotary_dim"}



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
    activation : {"relu", "gelu", "swiglu", "geglu", "gelu_erf", "geglu_erf"}
        FFN non-linearity; gelu is the tanh approximation, ``gelu_erf`` GELU itself,
        ``0.5 x (1 + erf(x / sqrt 2))`` (BERT's, Pythia's). ``swiglu`` gates instead (LLaMA's
        FFN): ``(silu(x W_gate + b_gate) * (x W_1 + b_1)) W_2 + b_2``, with the parameters
        ``ffn.W_gate (d, d_ff)`` and ``ffn.b_gate (d_ff,)`` besides the other two layers'.
        ``geglu`` is the same gate through GELU's tanh form instead of silu (Gemma's FFN),
        ``geglu_erf`` through GELU itself (a LLaMA-family ``hidden_act`` "gelu").
    causal : bool
        Query t sees only keys <= t.
    lengths : tuple of int or None
        Valid length of each batch row, ``1 <= len <= T``; keys at ``>= len`` are hidden and those
        positions are left out of the loss. ``None`` means every row is full.
    pe : {"sinusoidal", "learned", "none", "rope", "alibi"}
        ``learned`` adds the rows of the parameter ``embed.W_pos (n_ctx, d)`` (GPT-2's ``wpe``);
        ``rope`` adds nothing to the embedding and turns each head's queries and keys by
        their position's angles instead (``positional.rope_angles``; no parameters);
        ``alibi`` adds nothing to the embedding either, and adds ``-m_h (i - j)`` to head h's
        scaled score of query i at key j, before the soft cap and the mask
        (``positional.alibi_slopes``; BLOOM's and MPT's; no parameters).
    init : {"normal", "uniform", "xavier", "kaiming"}
    dtype : {"float64", "float32", "float16", "bfloat16"}
        float16 and bfloat16 as PyTorch eager runs them on the CPU: each operation in
        float32, its result rounded to the dtype (``engine.precision``); their arrays are
        float32 (``np_dtype``), each value one of the dtype's.
    eps : float
        Layer-norm epsilon, inside the square root.
    seed : int
        Seed of ``np.random.default_rng`` for parameters and inputs.
    n_ctx : int or None
        Rows of ``embed.W_pos`` (the longest sequence learned positions cover); ``None`` means
        ``seq_len``. Only used with ``pe="learned"``, which needs ``seq_len <= n_ctx``.
    tied_head : bool
        The head reuses the embedding, ``logits = h @ W_E.T`` (GPT-2); there is no
        ``head.W_U``.
    head_bias : bool
        The head adds ``head.b_U`` (GPT-2's head has none).
    rms_norm : bool
        Every norm is RMSNorm (LLaMA's): ``x / sqrt(mean(x^2) + eps) * gamma``, no mean taken
        out and no ``beta``; the parameters ``ln1.gamma``, ``ln2.gamma``, ``ln_f.gamma`` only.
    kv_heads : int or None
        Heads of keys and values (grouped-query attention, LLaMA 2's and 3's; 1 is multi-query
        attention). Each serves ``heads // kv_heads`` query heads in turn: key head j those
        numbered ``j * group .. (j + 1) * group - 1``. ``attn.W_K`` and ``attn.W_V`` are then
        ``(d, kv_heads * d_head)``. ``None`` means ``heads`` (every head its own keys).
    rope_theta : float
        RoPE's base (Hugging Face's ``rope_theta``): rotation pair i of a head turns by
        ``t / rope_theta^(2i/d_head)`` at position t. 10000 in RoFormer and LLaMA 1 and 2,
        500000 in LLaMA 3, whose slowest pairs turn less than a full circle over its context.
        Only ``pe="rope"`` reads it.
    bias : bool
        The attention's and the FFN's linear layers add biases (``attn.b_Q``, ``b_K``, ``b_V``,
        ``b_O``, ``ffn.b_1``, ``b_2`` and with SwiGLU ``b_gate``). LLaMA's have none.
        ``head_bias`` decides the head's.
    rope_scaling : RopeScaling, LinearRopeScaling or None
        LLaMA 3.1's scaled RoPE (Hugging Face's ``rope_scaling`` of ``rope_type`` ``"llama3"``):
        the pairs that turn slower than ``original_max_position_embeddings / low_freq_factor``
        positions a turn are slowed ``factor`` times more, those faster than ``... /
        high_freq_factor`` are left alone, and the pairs between are slowed by a blend
        (``positional.rope_scale``). A tuple of four numbers or a dict with those names is
        taken too. Or linear scaling (``LinearRopeScaling``, ``rope_type`` ``"linear"``, from
        one number or ``{"rope_type": "linear", "factor": 8}``): every angle divided by
        ``factor`` (Gemma 3 4B+'s 8). ``None``: RoPE's own angles. Only ``pe="rope"`` reads it.
    qkv_bias : bool
        With ``bias`` false, attention's Q, K and V still add biases (``attn.b_Q``, ``b_K``,
        ``b_V``) and nothing else does: Qwen2's model. With ``bias`` true it adds nothing.
    sliding_window : int or None
        Each query sees only the last ``sliding_window`` keys, itself included: query t those at
        ``t - sliding_window + 1 .. t`` (Mistral's attention, Hugging Face's ``sliding_window``),
        in every block. Needs ``causal``. ``None``: every earlier key.
    head_dim : int or None
        Width of each head's queries, keys and values, when it is not ``d_model / heads``
        (Hugging Face's ``head_dim``: Qwen3's, Mistral Nemo's, Gemma's). ``attn.W_Q`` is then
        ``(d, heads * head_dim)``, ``attn.W_O`` ``(heads * head_dim, d)``, ``W_K`` and ``W_V``
        ``(d, kv_heads * head_dim)``, and ``heads`` need not divide ``d_model``. ``None``:
        ``d_model / heads``.
    qk_norm : bool
        Each head's queries and keys are normalised over their ``d_head`` entries before RoPE
        and the scores (Qwen3's ``q_norm`` and ``k_norm``): by RMSNorm with ``rms_norm``, else
        by layer norm, with the parameters ``attn.q_norm.gamma`` and ``attn.k_norm.gamma``
        ``(d_head,)`` (and their ``.beta`` with layer norm), shared by every head.
    embed_scale : bool
        The embedding's rows are multiplied by ``sqrt(d_model)`` before the positions are added
        (Vaswani et al.'s Transformer, section 3.4, and Gemma's): ``embed`` is
        ``sqrt(d_model) W_E[tokens]``, and ``dW_E``'s lookup part ``sqrt(d_model)`` times the
        sum of ``dembed``. A tied head uses ``W_E`` unscaled.
    attn_softcap : float or None
        Each attention score ``s`` (scaled, before the mask) becomes ``c tanh(s / c)`` for
        ``c = attn_softcap``, so that no score reaches ``c`` (Gemma 2's
        ``attn_logit_softcapping``, 50). ``attn.scores`` holds the capped scores, and
        ``d score / d s = 1 - (capped / c)^2``. ``None``: no cap.
    logit_softcap : float or None
        The head's logits ``z`` become ``c tanh(z / c)`` for ``c = logit_softcap`` (Gemma 2's
        ``final_logit_softcapping``, 30). ``logits`` holds the capped logits, whose softmax the
        loss takes. ``None``: no cap.
    attn_scale : float or None
        What each score ``q . k`` is multiplied by, when it is not ``1 / sqrt(d_head)`` (Gemma 2's
        ``query_pre_attn_scalar`` s gives ``1 / sqrt(s)``: 27B's 144 with heads of 128).
        ``None``: ``1 / sqrt(d_head)`` (``Config.score_scale`` is the one used).
    sandwich_norm : bool
        Each sublayer's output is normalised too, before it joins the residual stream (Gemma 2's
        and 3's): ``y = x + LN1_post(MHA(LN1(x)))``, ``z = y + LN2_post(FFN(LN2(y)))``, with
        the parameters ``ln1_post.gamma`` and ``ln2_post.gamma`` (and ``.beta`` with layer
        norm). Needs ``norm="pre"``.
    sliding_layers : tuple of int or None
        The blocks whose attention slides (``sliding_window`` wide); the others see every
        earlier key (Gemma 2's alternate: 0, 2, 4, ...). ``None``: every block slides when
        ``sliding_window`` is set. Needs ``sliding_window``; ascending, each in
        ``0..layers - 1``.
    rope_local_theta : float or None
        RoPE's base in the blocks whose attention slides (Gemma 3's ``rope_local_base_freq``,
        10000, where its full blocks turn at ``rope_theta`` 1e6): those blocks turn by their own
        angles at this base, without ``rope_scaling``, which only the full blocks take
        (``Config.rope(block)``). ``None``: every block turns alike. Needs ``pe="rope"`` and
        ``sliding_window``.
    rotary_dim : int or None
        How many of each head's dimensions RoPE turns: the first ``rotary_dim``, paired
        ``(i, i + rotary_dim / 2)`` and turning by ``t / rope_theta^(2i/rotary_dim)``; the
        rest pass unturned (a partial rotation: Hugging Face's ``partial_rotary_factor`` times
        ``d_head``, GPT-NeoX's ``rotary_pct``, StableLM's 0.25). Even, at most ``d_head``.
        ``None``: every pair of the head turns. Needs ``pe="rope"``.
    parallel_residual : bool
        Attention and the FFN read the block's input side by side, each through its own norm,
        and both outputs join the residual stream (GPT-NeoX's and Pythia's
        ``use_parallel_residual``, GPT-J's): ``y = x + MHA(LN1(x))``, ``z = y + FFN(LN2(x))``.
        ``resid1`` is still ``y``, and ``LN2`` reads ``x`` where the sequential block's reads
        ``y``. Needs ``norm="pre"`` and no ``sandwich_norm``.
    shared_norm : bool
        A parallel block with one norm, ln1, whose output both sublayers read (Phi-2's and
        GPT-J's): ``z = x + MHA(LN1(x)) + FFN(LN1(x))``. The block has no ln2: no ``ln2.*``
        parameters and no ``ln2.out``; ln1's gradient gathers both sublayers'. Needs
        ``parallel_residual``.
    ffn_bias : bool
        With ``bias`` false, the FFN still adds biases (``ffn.b_1``, ``b_2``, and ``b_gate`` when
        gated) and attention adds none: GPT-J's model, GPT-NeoX's with ``attention_bias`` false,
        LLaMA's with ``mlp_bias`` alone. With ``bias`` true it adds nothing.
    embed_norm : bool
        The embedding is normalised before the first block, ``x0 = LN_embed(W_E[id])`` (RMSNorm
        with ``rms_norm``): BLOOM's ``word_embeddings_layernorm``. The parameters
        ``ln_embed.gamma`` (and ``ln_embed.beta``), the activation ``ln_embed.out`` (which is
        ``blocks.0.in``). It normalises the token's row alone, so ``pe`` must add nothing to it
        (``none``, ``rope`` or ``alibi``).
    norm_bias : bool
        Each layer norm adds its ``beta`` (``ln1.beta``, ...). False: ``y = xhat * gamma`` and no
        norm has a ``.beta`` (MPT's norms, PyTorch's ``LayerNorm(bias=False)``). RMSNorm has no
        ``beta`` either way, so false needs ``rms_norm`` false.
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
    n_ctx: int | None = None
    tied_head: bool = False
    head_bias: bool = True
    rms_norm: bool = False
    kv_heads: int | None = None
    rope_theta: float = 10000.0
    bias: bool = True
    rope_scaling: RopeScaling | None = None
    qkv_bias: bool = False
    sliding_window: int | None = None
    head_dim: int | None = None
    qk_norm: bool = False
    embed_scale: bool = False
    attn_softcap: float | None = None
    logit_softcap: float | None = None
    attn_scale: float | None = None
    sandwich_norm: bool = False
    sliding_layers: tuple[int, ...] | None = None
    rope_local_theta: float | None = None
    rotary_dim: int | None = None
    parallel_residual: bool = False
    shared_norm: bool = False
    ffn_bias: bool = False
    embed_norm: bool = False
    norm_bias: bool = True

    def __repr__(self) -> str:
        """The fields that differ from the defaults, on one line: ``Config(d_model=32,
        vocab=286, pe='learned')``, ``Config()`` for the defaults; ``eval`` gives it back."""
        from dataclasses import fields

        changed = [f"{f.name}={getattr(self, f.name)!r}" for f in fields(self)
                   if getattr(self, f.name) != f.default]
        return f"Config({', '.join(changed)})"

    def __post_init__(self):
        if self.lengths is not None:
            if (not isinstance(self.lengths, (tuple, list, np.ndarray))
                    or not all(map(_whole, self.lengths))):
                raise ConfigError("lengths", f"lengths must be whole numbers, one per row, got "
                                             f"{self.lengths!r}")
            object.__setattr__(self, "lengths", tuple(int(n) for n in self.lengths))
        if self.rope_scaling is not None:
            object.__setattr__(self, "rope_scaling", RopeScaling.parse(self.rope_scaling))
        if isinstance(self.sliding_layers, (list, np.ndarray)):
            object.__setattr__(self, "sliding_layers", tuple(self.sliding_layers))
        for name, rule in RULES.items():   # each field alone
            value = getattr(self, name)
            if value is None and name in OPTIONAL:
                continue
            if not rule.holds(value):
                raise ConfigError(name, rule.message(name, value))
            if rule.convert is not None:
                object.__setattr__(self, name, rule.convert(value))
        self._check_relations()
        self._check_sliding_layers()
        self._check_rope_local_theta()
        self._check_rotary_dim()

    def _check_relations(self):
        """The rules between fields: what one field's value asks of another's."""
        if self.layers > MAX_LAYERS:
            raise ConfigError("layers", f"layers={self.layers} is more than tfm shows; "
                                        f"allowed: 1..{MAX_LAYERS}")
        if self.head_dim is None and self.d_model % self.heads:
            raise ConfigError("heads", f"d_model={self.d_model} is not divisible by "
                                       f"heads={self.heads}; allowed heads: "
                                       f"{listed(divisors(self.d_model))}")
        if self.kv_heads is not None and self.heads % self.kv_heads:
            raise ConfigError("kv_heads", f"kv_heads={self.kv_heads} does not divide "
                                          f"heads={self.heads}; allowed kv_heads: "
                                          f"{listed(divisors(self.heads))}")
        if self.lengths is not None:
            if len(self.lengths) != self.batch:
                raise ConfigError("lengths", f"lengths has {len(self.lengths)} values but "
                                             f"batch={self.batch}; give one per row")
            bad = [n for n in self.lengths if not 1 <= n <= self.seq_len]
            if bad:
                raise ConfigError(
                    "lengths", f"lengths {bad[0]} is outside 1..{self.seq_len} (seq_len)")
        if self.sliding_window is not None and not self.causal:
            raise ConfigError("sliding_window", "a sliding window hides the keys far behind each "
                                                "query, so the model must be causal")
        if self.pe == "learned" and self.seq_len > self.ctx:
            raise ConfigError("seq_len", f"seq_len={self.seq_len} is longer than the {self.ctx} "
                                         f"learned positions (n_ctx); allowed: 1..{self.ctx}")
        if self.eps > float(np.finfo(self.np_dtype).max):   # as a float: no overflowing cast
            raise ConfigError("eps", f"eps={self.eps!r} is beyond {self.np_dtype}'s range "
                                     f"(at most {np.finfo(self.np_dtype).max:.3g})")
        if self.sandwich_norm and self.norm != "pre":
            raise ConfigError("sandwich_norm", "a sandwich norm normalises each sublayer's "
                                               "input and output, so the norms must be Pre-LN "
                                               "(norm 'pre')")
        if self.parallel_residual and (self.norm != "pre" or self.sandwich_norm):
            raise ConfigError("parallel_residual", "a parallel block normalises x once for each "
                                                   "sublayer and adds both outputs to it, so the "
                                                   "norms must be Pre-LN (norm 'pre') without "
                                                   "sandwich_norm")
        if self.embed_norm and self.pe in ADDED_PES:
            raise ConfigError("embed_norm", f"embed_norm normalises the token's embedding "
                                            f"alone (BLOOM's), and pe {self.pe!r} adds to it; "
                                            f"allowed pe: none, rope, alibi")
        if not self.norm_bias and self.rms_norm:
            raise ConfigError("norm_bias", "norm_bias false takes beta out of layer norm, and "
                                           "RMSNorm (rms_norm) has none to take; drop one")
        if self.shared_norm and not self.parallel_residual:
            raise ConfigError("shared_norm", "a shared norm feeds attention and the FFN side by "
                                             "side, so the block must be parallel "
                                             "(parallel_residual)")

    def _check_sliding_layers(self):
        layers = self.sliding_layers
        if layers is None:
            return
        if self.sliding_window is None:
            raise ConfigError("sliding_layers", "sliding_layers names the blocks whose "
                                                "attention slides, and there is no "
                                                "sliding_window")
        outside = [i for i in layers if not 0 <= i < self.layers]
        if outside:
            raise ConfigError("sliding_layers", f"block {outside[0]} is outside "
                                                f"0..{self.layers - 1} (layers)")
        if any(b <= a for a, b in zip(layers, layers[1:])):
            raise ConfigError("sliding_layers", f"sliding_layers must be ascending, each block "
                                                f"once, got {','.join(map(str, layers))}")

    def _check_rope_local_theta(self):
        theta = self.rope_local_theta
        if theta is None:
            return
        if self.pe != "rope":
            raise ConfigError("rope_local_theta", f"rope_local_theta is RoPE's base in the "
                                                  f"sliding blocks, and pe is {self.pe!r}, not "
                                                  f"'rope'")
        if self.sliding_window is None:
            raise ConfigError("rope_local_theta", "rope_local_theta is RoPE's base in the "
                                                  "blocks whose attention slides, and there is "
                                                  "no sliding_window")

    def _check_rotary_dim(self):
        n = self.rotary_dim
        if n is None:
            return
        if self.pe != "rope":
            raise ConfigError("rotary_dim", f"rotary_dim is how many of a head's dimensions "
                                            f"RoPE turns, and pe is {self.pe!r}, not 'rope'")
        if n % 2 or n > self.d_head:
            top = self.d_head - self.d_head % 2   # the widest even width
            if top < 2:
                allowed = "none"
            elif top <= 8:
                allowed = ", ".join(map(str, range(2, top + 1, 2)))
            else:
                allowed = f"2, 4, ..., {top}"
            raise ConfigError("rotary_dim", f"rotary_dim={n} is not an even width within a "
                                            f"head of {self.d_head} (RoPE turns pairs of its "
                                            f"dimensions); allowed: {allowed}")

    @property
    def rope_width(self) -> int:
        """The width of RoPE's tables: the dimensions of a head it turns (``rotary_dim``), or
        the whole head (an odd one's last dimension unturned, cos 1 and sin 0)."""
        return self.rotary_dim if self.rotary_dim is not None else self.d_head

    def rope(self, block: int) -> tuple[float, "RopeScaling | LinearRopeScaling | None"]:
        """(base, scaling) of block ``block``'s RoPE: ``rope_local_theta`` unscaled in a
        sliding block when it is set, else ``rope_theta`` and ``rope_scaling``."""
        if self.rope_local_theta is not None and self.window(block) is not None:
            return self.rope_local_theta, None
        return self.rope_theta, self.rope_scaling

    def window(self, block: int) -> int | None:
        """How many keys block ``block``'s queries see (``sliding_window``), or None for every
        earlier key: None in a block ``sliding_layers`` leaves out."""
        if self.sliding_layers is not None and block not in self.sliding_layers:
            return None
        return self.sliding_window

    @property
    def score_scale(self) -> float:
        """What each score ``q . k`` is multiplied by: ``attn_scale``, or ``1 / sqrt(d_head)``."""
        return self.attn_scale if self.attn_scale is not None else 1.0 / math.sqrt(self.d_head)

    @property
    def d_head(self) -> int:
        """Width of one head: ``head_dim``, or ``d_model / heads`` when not given."""
        return self.head_dim if self.head_dim is not None else self.d_model // self.heads

    @property
    def d_q(self) -> int:
        """Width of the queries (and of the context) over all heads: ``heads * d_head``, which
        is ``d_model`` unless ``head_dim`` says otherwise."""
        return self.heads * self.d_head

    @property
    def h_kv(self) -> int:
        """Heads of keys and values actually used: ``kv_heads``, or ``heads`` when not given."""
        return self.kv_heads if self.kv_heads is not None else self.heads

    @property
    def group(self) -> int:
        """Query heads per key/value head: 1 unless grouped (``kv_heads`` < ``heads``)."""
        return self.heads // self.h_kv

    @property
    def d_kv(self) -> int:
        """Width of the keys (and of the values) over all their heads: ``h_kv * d_head``."""
        return self.h_kv * self.d_head

    @property
    def gated(self) -> bool:
        """The FFN gates its hidden units (``swiglu``, ``geglu``): a third weight, ``W_gate``."""
        return self.activation in GATED

    @property
    def ffn_biased(self) -> bool:
        """The FFN's linear layers add biases: every layer's (``bias``), or the FFN's alone
        (``ffn_bias``, GPT-J's)."""
        return self.bias or self.ffn_bias

    @property
    def norm_biased(self) -> bool:
        """Each norm adds a ``beta``: layer norm (not ``rms_norm``) with ``norm_bias``."""
        return self.norm_bias and not self.rms_norm

    @property
    def embed_factor(self) -> float:
        """What the embedding's rows are multiplied by: ``sqrt(d_model)`` with ``embed_scale``,
        else 1."""
        return math.sqrt(self.d_model) if self.embed_scale else 1.0

    @property
    def ff(self) -> int:
        """The FFN hidden width actually used."""
        return self.d_ff if self.d_ff is not None else 4 * self.d_model

    @property
    def ctx(self) -> int:
        """Rows of the learned position table: ``n_ctx``, or ``seq_len`` when not given."""
        return self.n_ctx if self.n_ctx is not None else self.seq_len

    @property
    def np_dtype(self) -> np.dtype:
        """The arrays' dtype: ``dtype``, or float32 for float16 and bfloat16, whose values a
        float32 array holds (``engine.precision``: each operation adds its eps in float32)."""
        return np.dtype("float32" if self.dtype in DTYPES[2:] else self.dtype)

    def lengths_array(self) -> np.ndarray:
        """(B,) int64: the valid length of each row."""
        if self.lengths is None:
            return np.full(self.batch, self.seq_len, dtype=np.int64)
        return np.array(self.lengths, dtype=np.int64)

    def replace(self, **changes) -> "Config":
        return dataclasses.replace(self, **changes)

    def to_json(self) -> str:
        import json  # here, not at the top: a command that writes no JSON starts sooner

        fields = dataclasses.asdict(self)
        if fields["lengths"] is not None:
            fields["lengths"] = list(fields["lengths"])
        if fields["sliding_layers"] is not None:
            fields["sliding_layers"] = list(fields["sliding_layers"])
        if self.rope_scaling is not None:   # by name, as config.json writes it
            fields["rope_scaling"] = self.rope_scaling.to_dict()
        return json.dumps(fields)

    @classmethod
    def fields_from_json(cls, text: str) -> dict:
        """The fields ``to_json`` wrote, unvalidated; ValueError if they are not such fields."""
        import json

        fields = json.loads(text)
        if not isinstance(fields, dict):
            raise ValueError("not a JSON object")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(fields) - known)
        if unknown:
            raise ConfigError(unknown[0], f"unknown field {unknown[0]!r}")
        if isinstance(fields.get("lengths"), list):   # (anything else: the Config names it)
            fields["lengths"] = tuple(fields["lengths"])
        return fields

    @classmethod
    def from_json(cls, text: str) -> "Config":
        return cls(**cls.fields_from_json(text))


def listed(values: list[int], most: int = 12) -> str:
    """'1, 2, 4' or, past ``most``, the first ones, '...' and the last: an error stays a line."""
    if len(values) <= most:
        return ", ".join(map(str, values))
    return f"{', '.join(map(str, values[:most - 1]))}, ..., {values[-1]}"


def divisors(n: int) -> list[int]:
    """Every divisor of n, ascending, in O(sqrt n)."""
    small = [h for h in range(1, math.isqrt(n) + 1) if n % h == 0]
    return small + [n // h for h in reversed(small) if h * h != n]
