"""Command-line options shared by several commands, and how they become a Config.

Every Config field is an option on forward, backward, gradcheck, shapes and attn. Rather than
repeat seventeen parameters in five signatures, ``with_options`` appends the groups below to a
command's own parameters (Typer reads the resulting signature) and hands the command one
``Options`` object.
"""

import difflib
import functools
import inspect
import os
from enum import Enum
from pathlib import Path
from typing import Annotated, List, Optional

import typer

from tfmcli.config import Config, memory_estimate
from tfmcli.errors import ConfigError


class Norm(str, Enum):
    pre = "pre"
    post = "post"


class Activation(str, Enum):
    relu = "relu"
    gelu = "gelu"
    swiglu = "swiglu"
    geglu = "geglu"
    gelu_erf = "gelu_erf"


class PE(str, Enum):
    sinusoidal = "sinusoidal"
    learned = "learned"
    none = "none"
    rope = "rope"
    alibi = "alibi"


class Init(str, Enum):
    normal = "normal"
    uniform = "uniform"
    xavier = "xavier"
    kaiming = "kaiming"


class DType(str, Enum):
    float64 = "float64"
    float32 = "float32"


def parse_lengths(text: Optional[str]):
    """'4,2,6' -> (4, 2, 6); the Config checks count and range against batch and seq_len."""
    if text is None:
        return None
    try:
        values = tuple(int(part) for part in text.split(","))
    except ValueError:
        raise typer.BadParameter(f"{text!r} is not a comma-separated list of integers (like 4,2)",
                                 param_hint="'--lengths'") from None
    return values


def parse_sliding_layers(text: Optional[str]):
    """'0,2,4' -> (0, 2, 4); the Config checks each block against --layers and the order."""
    if text is None:
        return None
    try:
        return tuple(int(part) for part in text.split(","))
    except ValueError:
        raise typer.BadParameter(f"{text!r} is not a comma-separated list of block numbers "
                                 f"(like 0,2,4)", param_hint="'--sliding-layers'") from None


def parse_rope_scaling(text: Optional[str], flag: str = "--rope-scaling"):
    """'32,1,4,8192' -> (32.0, 1.0, 4.0, 8192.0), LLaMA 3.1's; '8' -> (8.0,), linear. The
    Config checks each number's range."""
    if text is None:
        return None
    try:
        values = tuple(float(part) for part in text.split(","))
    except ValueError:
        values = ()
    if len(values) not in (1, 4):
        raise typer.BadParameter(f"{text!r} is not one number (linear scaling's factor, Gemma 3's "
                                 f"8) or four comma-separated numbers: factor, low_freq_factor, "
                                 f"high_freq_factor, original context (LLaMA 3.2's 32,1,4,8192)",
                                 param_hint=f"'{flag}'")
    return values


MODEL = "Model (every Config field)"
RUN = "Run"
OUTPUT = "Output"


def bounded(low: int, high: Optional[int] = None):
    """An option callback allowing ``low..high``, whose error names the value given.

    (Typer's own ``min=``/``max=`` messages leave the value out.)
    """
    allowed = f"{low}..{high}" if high is not None else f"{low} or more"

    def check(value):
        if value is not None and (value < low or (high is not None and value > high)):
            raise typer.BadParameter(f"{value} is not allowed (allowed: {allowed})")
        return value

    return check


def writable(path: Optional[Path]):
    """An output option's callback: the file must be creatable, checked before any work. A
    symlink's file is the one written; a device or a pipe must itself be writable."""
    if path is None:
        return None
    if path.is_dir():
        raise typer.BadParameter(f"{path} is a folder; give a file name")
    from tfmcli.io import output_target   # here: --help and the parsing of other options skip it

    target, is_file = output_target(path)
    if not is_file:
        if not os.access(target, os.W_OK):
            raise typer.BadParameter(f"{target} is not writable")
        return path
    folder = target.parent
    if not folder.is_dir():
        raise typer.BadParameter(f"folder {folder} does not exist")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise typer.BadParameter(f"folder {folder} is not writable")
    return path


def choice(*names, choices, help, panel=None, **kwargs):
    """An option taking one of an Enum's values. When the list of values is long, its metavar
    is a word and the values go into the help text, so that --help never breaks a value
    mid-word at 80 columns."""
    values = [member.value for member in choices]
    if len("|".join(values)) > 12:
        kwargs["metavar"] = "NAME"
        listed = ", ".join(values[:-1]) + " or " + values[-1]
        help = f"{help.rstrip('.')}: {listed}."
    return typer.Option(*names, rich_help_panel=panel, case_sensitive=False, help=help, **kwargs)


def _opt(*names, panel, **kwargs):
    return typer.Option(*names, rich_help_panel=panel, **kwargs)


D = Config()  # the defaults live in one place: the Config

# (name, annotation, default), in the order --help lists them.
MODEL_OPTIONS = [
    ("seed", Annotated[int, _opt("--seed", panel=MODEL, callback=bounded(0), help="Seed of default_rng for weights and tokens (>= 0).")], D.seed),
    ("batch", Annotated[int, _opt("--batch", "-B", panel=MODEL, callback=bounded(1), help="Batch size B (>= 1).")], D.batch),
    ("seq_len", Annotated[int, _opt("--seq-len", "-T", panel=MODEL, callback=bounded(1), help="Sequence length T (>= 1).")], D.seq_len),
    ("d_model", Annotated[int, _opt("--d-model", "-d", panel=MODEL, callback=bounded(1), help="Model width d (>= 1).")], D.d_model),
    ("heads", Annotated[int, _opt("--heads", "-H", panel=MODEL, callback=bounded(1), help="Attention heads H (must divide d, unless --head-dim) (>= 1).")], D.heads),
    ("kv_heads", Annotated[Optional[int], _opt("--kv-heads", panel=MODEL, callback=bounded(1), help="Key/value heads (grouped-query attention, LLaMA 2/3; 1: multi-query); each serves H / kv-heads query heads (must divide H; default H).")], D.kv_heads),
    ("head_dim", Annotated[Optional[int], _opt("--head-dim", panel=MODEL, callback=bounded(1), help="Width of each head's queries, keys and values, when not d / H (Qwen3, Mistral Nemo); W_Q is then (d, H x head-dim), W_O (H x head-dim, d) (>= 1).")], D.head_dim),
    ("d_ff", Annotated[Optional[int], _opt("--d-ff", panel=MODEL, callback=bounded(1), help="FFN hidden width (default 4 x d) (>= 1).")], D.d_ff),
    ("vocab", Annotated[int, _opt("--vocab", "-V", panel=MODEL, callback=bounded(1), help="Vocabulary size V (>= 1).")], D.vocab),
    ("layers", Annotated[int, _opt("--layers", "-L", panel=MODEL, callback=bounded(1), help="Number of blocks L (>= 1).")], D.layers),
    ("norm", Annotated[Norm, choice("--norm", choices=Norm, panel=MODEL, help="Layer-norm position.")], Norm(D.norm)),
    ("activation", Annotated[Activation, choice("--activation", choices=Activation, panel=MODEL, help="FFN activation (gelu: tanh approximation; gelu_erf: GELU itself, 0.5 x (1 + erf(x / sqrt 2)); swiglu: silu(x W_gate + b_gate) * (x W_1 + b_1), a third weight; geglu: the same with gelu for silu).")], Activation(D.activation)),
    ("causal", Annotated[bool, _opt("--causal/--no-causal", panel=MODEL, help="Hide future keys.")], D.causal),
    ("sliding_window", Annotated[Optional[int], _opt("--sliding-window", panel=MODEL, metavar="W", callback=bounded(1), help="Each query sees only the last W keys, itself included (Mistral's sliding window; needs --causal) (>= 1).")], D.sliding_window),
    ("sliding_layers", Annotated[Optional[str], _opt("--sliding-layers", panel=MODEL, metavar="0,2", help="Only these blocks slide with --sliding-window; the others see every earlier key (Gemma 2: every other block, 0,2,4,...).")], None),
    ("lengths", Annotated[Optional[str], _opt("--lengths", panel=MODEL, metavar="4,2", help="Valid length of each batch row (one per row, 1..T).")], None),
    ("pe", Annotated[PE, choice("--pe", choices=PE, panel=MODEL, help="Positional encoding: added to the embedding (sinusoidal, learned), none, RoPE's turn of q and k (rope), or ALiBi's -m_h (i - j) added to head h's scores (alibi: BLOOM, MPT).")], PE(D.pe)),
    ("rope_theta", Annotated[float, _opt("--rope-theta", panel=MODEL, help="RoPE's base, with --pe rope: pair i turns by t / theta^(2i/d_head) (LLaMA 3: 500000) (> 0).")], D.rope_theta),
    ("rope_scaling", Annotated[Optional[str], _opt("--rope-scaling", panel=MODEL, metavar="32,1,4,8192", help="Scaled RoPE, with --pe rope: the four numbers of LLaMA 3.1's llama3 rope_scaling, factor, low and high freq factors, original context (LLaMA 3.2: 32,1,4,8192); or one number, linear scaling's factor, every angle divided by it (Gemma 3 4B+: 8).")], None),
    ("rope_local_theta", Annotated[Optional[float], _opt("--rope-local-theta", panel=MODEL, metavar="X", help="RoPE's base in the blocks that slide (--sliding-window, --sliding-layers), unscaled; the others turn at --rope-theta with --rope-scaling (Gemma 3: 10000, the others 1000000) (> 0).")], D.rope_local_theta),
    ("rotary_dim", Annotated[Optional[int], _opt("--rotary-dim", panel=MODEL, metavar="N", callback=bounded(1), help="RoPE turns only each head's first N dimensions, pairs (i, i + N/2), and passes the rest (partial_rotary_factor x d_head: StableLM's 0.25) (even, at most d_head; default all).")], D.rotary_dim),
    ("init", Annotated[Init, choice("--init", choices=Init, panel=MODEL, help="Weight initialisation.")], Init(D.init)),
    ("dtype", Annotated[DType, choice("--dtype", choices=DType, panel=MODEL, help="Floating-point type of every array.")], DType(D.dtype)),
    ("eps", Annotated[float, _opt("--eps", panel=MODEL, help="Layer-norm (or RMSNorm) epsilon, inside the square root (> 0).")], D.eps),
    ("n_ctx", Annotated[Optional[int], _opt("--n-ctx", panel=MODEL, callback=bounded(1), help="Learned positions (rows of embed.W_pos; default T) (>= 1).")], D.n_ctx),
    ("tied_head", Annotated[bool, _opt("--tied-head/--untied-head", panel=MODEL, help="Head reuses the embedding: logits = h W_E^T (GPT-2).")], D.tied_head),
    ("head_bias", Annotated[bool, _opt("--head-bias/--no-head-bias", panel=MODEL, help="Head adds the bias head.b_U.")], D.head_bias),
    ("bias", Annotated[bool, _opt("--bias/--no-bias", panel=MODEL, help="Attention and FFN linear layers add biases (b_Q ... b_2); LLaMA's have none.")], D.bias),
    ("qkv_bias", Annotated[bool, _opt("--qkv-bias/--no-qkv-bias", panel=MODEL, help="With --no-bias, Q, K and V still add biases (b_Q, b_K, b_V), nothing else (Qwen2).")], D.qkv_bias),
    ("ffn_bias", Annotated[bool, _opt("--ffn-bias/--no-ffn-bias", panel=MODEL, help="With --no-bias, the FFN still adds biases (b_1, b_2, b_gate) and attention none (GPT-J).")], D.ffn_bias),
    ("embed_norm", Annotated[bool, _opt("--embed-norm/--no-embed-norm", panel=MODEL, help="Normalise the embedding before the first block, x0 = LN(W_E[id]) (BLOOM's word_embeddings_layernorm; needs --pe none, rope or alibi).")], D.embed_norm),
    ("norm_bias", Annotated[bool, _opt("--norm-bias/--no-norm-bias", panel=MODEL, help="Each layer norm adds its beta; --no-norm-bias: y = gamma * xhat, no .beta parameters (MPT's norms; needs --layer-norm).")], D.norm_bias),
    ("qk_norm", Annotated[bool, _opt("--qk-norm/--no-qk-norm", panel=MODEL, help="Normalise each head's queries and keys over their d_head entries before RoPE and the scores (Qwen3): attn.q_norm, attn.k_norm, RMSNorm with --rms-norm.")], D.qk_norm),
    ("embed_scale", Annotated[bool, _opt("--embed-scale/--no-embed-scale", panel=MODEL, help="Multiply the embedding's rows by sqrt(d_model) before the positions are added (the Transformer paper's and Gemma's).")], D.embed_scale),
    ("attn_softcap", Annotated[Optional[float], _opt("--attn-softcap", panel=MODEL, metavar="C", help="Soft-cap each attention score s (scaled, before the mask): C tanh(s / C), never past C (Gemma 2: 50) (> 0).")], D.attn_softcap),
    ("logit_softcap", Annotated[Optional[float], _opt("--logit-softcap", panel=MODEL, metavar="C", help="Soft-cap each logit z of the head: C tanh(z / C) (Gemma 2: 30) (> 0).")], D.logit_softcap),
    ("attn_scale", Annotated[Optional[float], _opt("--attn-scale", panel=MODEL, metavar="X", help="Multiply each score q . k by X instead of 1 / sqrt(d_head) (Gemma 2 27B: 1 / sqrt(144)) (> 0).")], D.attn_scale),
    ("sandwich_norm", Annotated[bool, _opt("--sandwich-norm/--no-sandwich-norm", panel=MODEL, help="Normalise each sublayer's output too, before the residual sum (Gemma 2 and 3): ln1_post after attention, ln2_post after the FFN; needs --norm pre.")], D.sandwich_norm),
    ("parallel_residual", Annotated[bool, _opt("--parallel-residual/--no-parallel-residual", panel=MODEL, help="Attention and the FFN both read the block's input, each through its own norm, and both outputs join the stream (GPT-NeoX, Pythia): z = x + MHA(LN1(x)) + FFN(LN2(x)); needs --norm pre.")], D.parallel_residual),
    ("shared_norm", Annotated[bool, _opt("--shared-norm/--no-shared-norm", panel=MODEL, help="A parallel block with one norm: attention and the FFN both read LN1(x), and there is no ln2 (Phi-2, GPT-J): z = x + MHA(LN1(x)) + FFN(LN1(x)); needs --parallel-residual.")], D.shared_norm),
    ("rms_norm", Annotated[bool, _opt("--rms-norm/--layer-norm", panel=MODEL, help="RMSNorm (LLaMA's) for every norm: x / sqrt(mean(x^2) + eps) * gamma, no beta.")], D.rms_norm),
]
RUN_OPTIONS = [
    ("load", Annotated[Optional[Path], _opt("--load", panel=RUN, metavar="FILE.npz|DIR", help="Run with parameters (and inputs, when present) from a file in tfm's npz layout, or a GPT-2, LLaMA, Mistral, Qwen2, Qwen3, Gemma, Gemma 2, Gemma 3, Phi-3, StableLM, GPT-NeoX (Pythia), Phi (Phi-1.5, Phi-2), GPT-J, CodeGen, OPT, Falcon, GPTBigCode (StarCoder), BLOOM or MPT checkpoint folder (config.json + model.safetensors).")], None),
    ("tokens", Annotated[Optional[List[str]], _opt("--tokens", panel=RUN, metavar="3,1,4,1,5", help="The input token ids of one batch row, exactly (repeat for more rows; shorter rows are padded). Each position's target is the next id; the last has none.")], None),
    ("text", Annotated[Optional[List[str]], _opt("--text", panel=RUN, metavar="TEXT", help="Input text, tokenized by the --load DIR checkpoint's tokenizer (repeat for more rows).")], None),
    ("force", Annotated[bool, _opt("--force", panel=RUN, help="Run even when the memory estimate exceeds the memory available.")], False),
]
OUTPUT_OPTIONS = [
    ("json", Annotated[bool, _opt("--json", panel=OUTPUT, help="Machine-readable JSON on stdout, no colour.")], False),
    ("save", Annotated[Optional[Path], _opt("--save", panel=OUTPUT, metavar="FILE.npz", callback=writable, help="Save the run (npz layout in the README), atomically.")], None),
    ("svg", Annotated[Optional[Path], _opt("--svg", panel=OUTPUT, metavar="FILE", callback=writable, help="Save exactly what was printed as an SVG.")], None),
]
MODEL_FIELDS = {name for name, _, _ in MODEL_OPTIONS}
# Config field -> the option a user types, for error messages.
FLAGS = {"seed": "--seed", "batch": "--batch", "seq_len": "--seq-len", "d_model": "--d-model",
         "heads": "--heads", "d_ff": "--d-ff", "vocab": "--vocab", "layers": "--layers",
         "norm": "--norm", "activation": "--activation", "causal": "--causal",
         "lengths": "--lengths", "pe": "--pe", "init": "--init", "dtype": "--dtype", "eps": "--eps",
         "n_ctx": "--n-ctx", "tied_head": "--tied-head", "head_bias": "--head-bias",
         "rms_norm": "--rms-norm", "kv_heads": "--kv-heads", "rope_theta": "--rope-theta",
         "bias": "--bias", "rope_scaling": "--rope-scaling", "qkv_bias": "--qkv-bias",
         "sliding_window": "--sliding-window", "head_dim": "--head-dim", "qk_norm": "--qk-norm",
         "embed_scale": "--embed-scale", "attn_softcap": "--attn-softcap",
         "logit_softcap": "--logit-softcap", "attn_scale": "--attn-scale",
         "sandwich_norm": "--sandwich-norm", "sliding_layers": "--sliding-layers",
         "rope_local_theta": "--rope-local-theta", "rotary_dim": "--rotary-dim",
         "parallel_residual": "--parallel-residual",
         "shared_norm": "--shared-norm", "ffn_bias": "--ffn-bias", "embed_norm": "--embed-norm",
         "norm_bias": "--no-norm-bias",
         "tokens": "--tokens", "text": "--text"}


class Options:
    """The shared option values of one invocation, and what can be built from them."""

    def __init__(self, ctx: typer.Context, values: dict):
        self.ctx = ctx
        self.values = values

    def __getattr__(self, name):
        try:
            return self.values[name]
        except KeyError:
            raise AttributeError(name) from None

    def explicit(self, name: str) -> bool:
        """Did the user type this option (rather than take its default)?"""
        source = self.ctx.get_parameter_source(name)
        return source is not None and source.name in ("COMMANDLINE", "ENVIRONMENT")

    def model_fields(self) -> dict:
        fields = {}
        for name, _, _ in MODEL_OPTIONS:
            if name not in self.values:   # a command that takes only some model options
                continue
            value = self.values[name]
            fields[name] = value.value if isinstance(value, Enum) else value
        if "lengths" in fields:
            fields["lengths"] = parse_lengths(fields["lengths"])
        if "rope_scaling" in fields:
            fields["rope_scaling"] = parse_rope_scaling(fields["rope_scaling"])
        if "sliding_layers" in fields:
            fields["sliding_layers"] = parse_sliding_layers(fields["sliding_layers"])
        return fields

    def config(self, **fixed) -> Config:
        """The Config these options describe (without --load), with ``fixed`` fields on top."""
        try:
            cfg = Config(**{**self.model_fields(), **fixed})
        except ConfigError as e:
            raise bad(e.field, str(e)) from None
        self.refuse_unused(cfg)
        return cfg

    def refuse_unused(self, cfg: Config) -> None:
        """A typed option that this Config does not use would be silently ignored: an error."""
        if self.explicit("n_ctx") and cfg.pe != "learned":
            raise typer.BadParameter(f"it sets the rows of the learned positions (embed.W_pos), "
                                     f"and this model's --pe is {cfg.pe}; add --pe learned",
                                     param_hint="'--n-ctx'")
        for name, which in (("qkv_bias", "Q, K and V"), ("ffn_bias", "the FFN's layers")):
            if self.explicit(name) and getattr(cfg, name) and cfg.bias:
                raise typer.BadParameter(f"it gives {which} biases in a model whose --bias "
                                         f"gives every layer one; add --no-bias",
                                         param_hint=f"'{FLAGS[name]}'")
        for name, what in (("rope_theta", "RoPE's base"), ("rope_scaling", "RoPE's scaling")):
            if self.explicit(name) and cfg.pe != "rope":
                raise typer.BadParameter(f"it sets {what}, and this model's --pe is {cfg.pe}; "
                                         f"add --pe rope", param_hint=f"'{FLAGS[name]}'")

    def run(self):
        """The run these options describe (sources.resolve), parameters not yet drawn.

        Refuses, before allocating anything, a run whose memory estimate exceeds what the machine
        has available, unless --force.
        """
        from tfmcli.sources import MissingExtra, parse_tokens, resolve   # (at run time: --help skips it)

        explicit = {name for name in MODEL_FIELDS if self.explicit(name)}
        try:
            tokens = parse_tokens(self.values.get("tokens"))
            run = resolve(self.model_fields(), explicit, self.values.get("load"), tokens,
                          self.values.get("text") or None)
        except ConfigError as e:
            raise bad(e.field, str(e)) from None
        except MissingExtra as e:
            raise typer.BadParameter(str(e), param_hint="'--load'") from None
        self.refuse_unused(run.cfg)
        if not self.values.get("force", False):
            check_memory(run.cfg)
        return run

    def json_or_svg_conflict(self):
        """--svg records what is printed for people; --json prints none of that."""
        if self.values.get("json") and self.values.get("svg") is not None:
            raise typer.BadParameter("--svg saves what is printed for people; it cannot be "
                                     "combined with --json", param_hint="'--svg'")


def bad(field: str, message: str) -> typer.BadParameter:
    return typer.BadParameter(message, param_hint=f"'{FLAGS.get(field, '--' + field)}'")


def check_range(value: int, upper: int, flag: str, what: str):
    """A --row/--head/--block index must lie in 0..upper-1; ``what`` says whose, e.g. 'batch rows'."""
    if not 0 <= value < upper:
        raise typer.BadParameter(f"{value} is out of range: there are {upper} {what}, so "
                                 f"0..{upper - 1}", param_hint=f"'{flag}'")


def check_name(name: str, known, flag: str = "--show", gradient: bool = False) -> str:
    """``name`` if known, else a usage error listing close names.

    With ``gradient``, a leading 'd' (as in 'dlogits': the gradient of 'logits') is accepted
    and dropped.
    """
    known = list(known)
    if name in known:
        return name
    if gradient and name.startswith("d") and name[1:] in known:
        return name[1:]
    close = [*tails_beginning(name, known), *difflib.get_close_matches(name, known, n=4, cutoff=0.5)]
    if gradient and name.startswith("d"):
        close = [*tails_beginning(name[1:], known), *close]
    close = list(dict.fromkeys(close))[:4]
    hint = f"; did you mean {', '.join(close)}?" if close else f"; names are like {known[0]}, {known[-1]}"
    raise typer.BadParameter(f"no tensor named {name!r}{hint}", param_hint=f"'{flag}'")


def tails_beginning(name: str, known) -> list:
    """Names one of whose dotted tails begins with ``name``, in any case: 'scores' and 'attn.sc'
    find blocks.0.attn.scores, 'w_q' finds blocks.0.attn.W_Q. Under three letters, none."""
    if len(name) < 3:
        return []
    name = name.lower()
    return [k for k in known if any(tail.startswith(name) for tail in _tails(k.lower()))]


def _tails(name: str) -> list:
    """'blocks.0.attn.q' -> itself, '0.attn.q', 'attn.q', 'q'."""
    parts = name.split(".")
    return [".".join(parts[i:]) for i in range(len(parts))]


def available_memory() -> int:
    """Bytes the system can still hand out (MemAvailable), or a large number when unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return 1 << 62


def binary_size(n: int) -> str:
    """Bytes in binary units: '712 B', '18.4 KiB', '2.2 GiB'."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if round(n, 1) < 1024 or unit == "GiB":   # 1023.96 KiB is 1.0 MiB, not 1,024.0 KiB
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:,.1f} {unit}"
        n /= 1024


def check_memory(cfg: Config, extra: int = 0, what: str = "forward + backward"):
    """A usage error when the run's estimate (and ``extra`` bytes that a command adds, for
    ``what``) exceeds the memory available."""
    need, have = memory_estimate(cfg)["total"] + extra, available_memory()
    if need > have:
        raise typer.BadParameter(
            f"this run needs about {binary_size(need)} for {what} (see tfm shapes), more than "
            f"the {binary_size(have)} available; shrink --batch, --seq-len, --d-model, --vocab or "
            f"--layers, or pass --force", param_hint="'--batch' / '--seq-len' / '--d-model'")


def with_options(*groups):
    """Append option groups to a command and pass it their values as ``opts: Options``."""
    extra = [spec for group in groups for spec in group]

    def decorate(func):
        sig = inspect.signature(func)
        own = [p for p in sig.parameters.values() if p.name != "opts"]
        added = [inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=default,
                                   annotation=annotation) for name, annotation, default in extra]
        ctx = inspect.Parameter("ctx", inspect.Parameter.POSITIONAL_OR_KEYWORD,
                                annotation=typer.Context)
        names = [name for name, _, _ in extra]

        @functools.wraps(func)
        def wrapper(ctx, **kwargs):
            opts = Options(ctx, {name: kwargs.pop(name) for name in names})
            opts.json_or_svg_conflict()  # before any work
            return func(opts=opts, **kwargs)

        parameters = [ctx] + [p.replace(kind=inspect.Parameter.KEYWORD_ONLY) for p in own] + added
        wrapper.__signature__ = sig.replace(parameters=parameters, return_annotation=None)
        wrapper.__annotations__ = {p.name: p.annotation for p in parameters}
        del wrapper.__wrapped__
        return wrapper

    return decorate
