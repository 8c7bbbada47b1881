"""Command-line options shared by several commands, and how they become a Config.

Every Config field is an option of every model command. Rather than repeat some fifty
parameters in each signature, ``with_options`` appends the groups below to a command's own
parameters (Typer reads the resulting signature), sorted into --help's panels in the order a
learner uses them (input, output, sizes, then the architecture), and hands the command one
``Options`` object. ``--arch`` fills the fields the user did not type from a preset
(``tfmcli.engine.presets``).
"""

import functools
import inspect
import os
from enum import Enum
from pathlib import Path
from typing import Annotated, List, Optional

import typer

from tfmcli.cli.helpfit import ARCH, INPUT, INTERVENE, OUTPUT, PANELS, SIZES, SWITCHES
from tfmcli.engine.config import NON_NEGATIVE_INT, POSITIVE_INT, RULES, Config
from tfmcli.engine.sizes import memory_estimate
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
    geglu_erf = "geglu_erf"


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
    float16 = "float16"     # as PyTorch eager on the CPU: each operation in float32, rounded
    bfloat16 = "bfloat16"   # to the dtype (engine/precision.py)


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




LARGEST = 2**31 - 1   # every whole-number option's ceiling: past it, sizes no machine holds


def bounded(low: int, high: Optional[int] = None):
    """An option callback allowing ``low..high`` (``high`` at most ``LARGEST``), whose error
    names the value given.

    (Typer's own ``min=``/``max=`` messages leave the value out.)
    """
    allowed = f"{low}..{high}" if high is not None else f"{low} or more"
    ceiling = LARGEST if high is None else high

    def check(value):
        if value is not None and value > LARGEST and high is None:
            raise typer.BadParameter(f"{value} is not allowed (allowed: up to {LARGEST:,})")
        if value is not None and (value < low or value > ceiling):
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
    from tfmcli.io import output_target  # here: --help and the parsing of other options skip it

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
    if len("|".join(values)) > 12 and "metavar" not in kwargs:
        kwargs["metavar"] = "NAME"
        listed = ", ".join(values[:-1]) + " or " + values[-1]
        help = f"{help.rstrip('.')}: {listed}."
    return typer.Option(*names, rich_help_panel=panel, case_sensitive=False, help=help, **kwargs)


def _opt(*names, panel, **kwargs):
    if panel in (ARCH, SWITCHES):   # one line each: the defaults are said where they matter
        kwargs.setdefault("show_default", False)
    return typer.Option(*names, rich_help_panel=panel, **kwargs)


def _arch(*names, **kwargs):
    return _opt(*names, panel=ARCH, **kwargs)


def _switch(*names, **kwargs):
    """An on/off architecture flag: --help lists the switches by name, side by side
    (cli.helpfit), their help being docs/architectures.md's."""
    return _opt(*names, panel=SWITCHES, **kwargs)


def within_rule(flag: str):
    """The callback of a whole-number option: the least value its Config field's rule allows
    (``engine.config.RULES``: 1 for a size, 0 for the seed), said once, there."""
    field = flag.removeprefix("--").replace("-", "_")
    return bounded({POSITIVE_INT: 1, NON_NEGATIVE_INT: 0}[RULES[field]])


def _size(*names, **kwargs):
    return _opt(*names, panel=SIZES, callback=within_rule(names[0]), **kwargs)


def _named(*names, choices, help, **kwargs):
    """An architecture choice whose values are listed in its one-line help."""
    return choice(*names, choices=choices, panel=ARCH, help=help, metavar="NAME",
                  show_default=False, **kwargs)


def arch_list() -> list[str]:
    """--arch list's lines: each preset and its flags, broken between flags under a hanging
    indent, never inside one (--attn-softcap 50), at the terminal's width or COLUMNS; piped
    with no COLUMNS, a line each (for grep)."""
    import re
    import shutil
    import sys

    from tfmcli.engine.presets import NAMES, describe

    name_width = max(map(len, NAMES))
    columns = os.environ.get("COLUMNS", "")
    width = (int(columns) if columns.isdigit() and int(columns) > 0 else
             shutil.get_terminal_size().columns if sys.stdout.isatty() else None)
    lines = []
    for name in NAMES:
        units = re.findall(r"--\S+(?: [^-(\s]\S*)?|\([^)]*\)", describe(name))
        line = f"{name:<{name_width}} "
        for unit in units:
            if width and len(line) + 1 + len(unit) > width and line.strip() != name:
                lines.append(line)
                line = " " * name_width + " "
            line += " " + unit
        lines.append(line)
    return lines


def check_arch(value: Optional[str]):
    """--arch: a preset's name; 'list' prints them all and stops."""
    if value is None:
        return None
    from tfmcli.engine.presets import NAMES

    if value == "list":
        for line in arch_list():
            typer.echo(line)
        raise typer.Exit(0)
    if value not in NAMES:
        raise typer.BadParameter(f"{value!r} is not a preset; allowed: {', '.join(NAMES)} "
                                 f"(tfm shapes --arch list says what each sets)")
    return value


D = Config()  # the defaults live in one place: the Config
I, F, B = int, float, bool
OptI, OptF, OptS = Optional[int], Optional[float], Optional[str]

# (name, annotation, default). --help shows them panel by panel (PANELS), in this order within.
MODEL_OPTIONS = [
    ("arch", Annotated[OptS, _opt(
        "--arch", panel=INPUT, metavar="NAME", callback=check_arch,
        help="A family's block at toy size (--arch list).")], None),
    ("seed", Annotated[I, _opt(
        "--seed", panel=INPUT, callback=within_rule("--seed"),
        help="Seed of the weights and tokens.")], D.seed),
    ("batch", Annotated[I, _size("--batch", "-B", help="Batch rows B")], D.batch),
    ("seq_len", Annotated[I, _size("--seq-len", "-T", help="Sequence length T")], D.seq_len),
    ("d_model", Annotated[I, _size("--d-model", "-d", help="Model width d")], D.d_model),
    ("heads", Annotated[I, _size("--heads", "-H", help="Heads H")], D.heads),
    ("kv_heads", Annotated[OptI, _size(
        "--kv-heads", help="K/V heads (H; fewer: GQA)")], D.kv_heads),
    ("head_dim", Annotated[OptI, _size(
        "--head-dim", help="Head width (d / H)")], D.head_dim),
    ("d_ff", Annotated[OptI, _size("--d-ff", help="FFN width (4 d)")], D.d_ff),
    ("vocab", Annotated[I, _size("--vocab", "-V", help="Vocabulary V")], D.vocab),
    ("layers", Annotated[I, _size("--layers", "-L", help="Blocks L")], D.layers),
    ("lengths", Annotated[OptS, _opt(
        "--lengths", panel=SIZES, metavar="4,2",
        help="Row lengths (T)")], None),
    ("n_ctx", Annotated[OptI, _size(
        "--n-ctx", help="Learned PE rows (T)")], D.n_ctx),
    ("norm", Annotated[Norm, _named(
        "--norm", choices=Norm, help="pre: norm before each sublayer; post.")],
     Norm(D.norm)),
    ("activation", Annotated[Activation, _named(
        "--activation", choices=Activation,
        help="relu gelu gelu_erf swiglu geglu geglu_erf")], Activation(D.activation)),
    ("causal", Annotated[B, _switch("--causal/--no-causal", help="Hide future keys (on).")],
     D.causal),
    ("sliding_window", Annotated[OptI, _arch(
        "--sliding-window", metavar="W", callback=within_rule("--sliding-window"),
        help="Each query sees the last W keys.")], D.sliding_window),
    ("sliding_layers", Annotated[OptS, _arch(
        "--sliding-layers", metavar="0,2", help="Only these blocks slide.")], None),
    ("pe", Annotated[PE, _named(
        "--pe", choices=PE, help="sinusoidal, learned, rope, alibi or none.")],
     PE(D.pe)),
    ("rope_theta", Annotated[F, _arch(
        "--rope-theta", metavar="X", help="RoPE's base (10000).")], D.rope_theta),
    ("rope_scaling", Annotated[OptS, _arch(
        "--rope-scaling", metavar="F,…", help="RoPE's scaling: a factor, or four.")], None),
    ("rope_local_theta", Annotated[OptF, _arch(
        "--rope-local-theta", metavar="X", help="RoPE's base in sliding blocks.")],
     D.rope_local_theta),
    ("rotary_dim", Annotated[OptI, _arch(
        "--rotary-dim", metavar="N", callback=within_rule("--rotary-dim"),
        help="RoPE turns a head's first N dims.")], D.rotary_dim),
    ("init", Annotated[Init, _named(
        "--init", choices=Init, help="xavier, normal, uniform, kaiming.")], Init(D.init)),
    ("dtype", Annotated[DType, _named(
        "--dtype", choices=DType, help="float64, float32, float16, bfloat16 (as torch).")],
     DType(D.dtype)),
    ("eps", Annotated[F, _arch(
        "--eps", metavar="X", help="Norms' epsilon (1e-5).")], D.eps),
    ("tied_head", Annotated[B, _switch(
        "--tied-head/--untied-head", help="The head is W_E^T (GPT-2).")], D.tied_head),
    ("head_bias", Annotated[B, _switch(
        "--head-bias/--no-head-bias", help="The head adds b_U (on).")], D.head_bias),
    ("bias", Annotated[B, _switch(
        "--bias/--no-bias", help="Linear layers add biases (on).")], D.bias),
    ("qkv_bias", Annotated[B, _switch(
        "--qkv-bias/--no-qkv-bias", help="With --no-bias, Q, K, V keep theirs.")],
     D.qkv_bias),
    ("ffn_bias", Annotated[B, _switch(
        "--ffn-bias/--no-ffn-bias", help="With --no-bias, the FFN keeps its.")], D.ffn_bias),
    ("embed_norm", Annotated[B, _switch(
        "--embed-norm/--no-embed-norm", help="Norm the embedding (BLOOM).")], D.embed_norm),
    ("norm_bias", Annotated[B, _switch(
        "--norm-bias/--no-norm-bias", help="Norms add beta (on).")], D.norm_bias),
    ("qk_norm", Annotated[B, _switch(
        "--qk-norm/--no-qk-norm", help="Norm each head's q and k (Qwen3).")], D.qk_norm),
    ("embed_scale", Annotated[B, _switch(
        "--embed-scale/--no-embed-scale", help="Embedding times sqrt(d) (Gemma).")],
     D.embed_scale),
    ("attn_softcap", Annotated[OptF, _arch(
        "--attn-softcap", metavar="C", help="Cap each score: C tanh(s / C).")],
     D.attn_softcap),
    ("logit_softcap", Annotated[OptF, _arch(
        "--logit-softcap", metavar="C", help="Cap each logit: C tanh(z / C).")],
     D.logit_softcap),
    ("attn_scale", Annotated[OptF, _arch(
        "--attn-scale", metavar="X", help="Scores q.k times X, not 1/sqrt(d_head).")],
     D.attn_scale),
    ("sandwich_norm", Annotated[B, _switch(
        "--sandwich-norm/--no-sandwich-norm", help="Norm each sublayer's output too.")],
     D.sandwich_norm),
    ("parallel_residual", Annotated[B, _switch(
        "--parallel-residual/--no-parallel-residual", help="Attention and FFN side by side.")],
     D.parallel_residual),
    ("shared_norm", Annotated[B, _switch(
        "--shared-norm/--no-shared-norm", help="Side by side, reading one norm.")],
     D.shared_norm),
    ("rms_norm", Annotated[B, _switch(
        "--rms-norm/--layer-norm", help="RMSNorm for every norm (LLaMA).")], D.rms_norm),
]
RUN_OPTIONS = [
    ("load", Annotated[Optional[Path], _opt(
        "--load", panel=INPUT, metavar="FILE|DIR",
        help="A saved run (.npz), a GGUF file or a checkpoint folder.")], None),
    ("tokens", Annotated[Optional[List[str]], _opt(
        "--tokens", panel=INPUT, metavar="3,1,4,1,5",
        help="A batch row's token ids (repeatable).")], None),
    ("text", Annotated[Optional[List[str]], _opt(
        "--text", panel=INPUT, metavar="TEXT",
        help="Text for --load DIR's tokenizer (repeatable).")], None),
    ("score_all", Annotated[bool, _opt(
        "--score-all", panel=INPUT,
        help="Score every position, not only the answers.")], False),
    ("force", Annotated[bool, _opt(
        "--force", panel=INPUT,
        help="Run even past the memory estimate.")], False),
    ("stream", Annotated[Optional[bool], _opt(
        "--stream/--no-stream", panel=INPUT,
        help="A block at a time (default: when too big).")], None),
]
# A command that reads the whole run (tfm patch, explore, kv, ...) refuses --stream and says
# why (streaming.choose_stream): its --help does not list it.
WHOLE_RUN_OPTIONS = [spec if spec[0] != "stream" else ("stream", Annotated[Optional[bool], _opt(
    "--stream/--no-stream", panel=INPUT, hidden=True)], None) for spec in RUN_OPTIONS]
class AblateWith(str, Enum):
    zero = "zero"
    mean = "mean"


def from_options(panel: str = INTERVENE) -> list:
    """--from-tokens and --from-text: the other run a patch copies from (tfm patch: its
    corrupted run, shown in its --help)."""
    return [
        ("from_tokens", Annotated[Optional[List[str]], _opt(
            "--from-tokens", panel=panel, metavar="3,1,4,1,5",
            help="The other run's ids, a row each.")], None),
        ("from_text", Annotated[Optional[List[str]], _opt(
            "--from-text", panel=panel, metavar="TEXT",
            help="The other run's text (--load DIR).")], None)]


# change a number and run again (engine.interventions); made into interventions by
# common.interventions, in this order: patches, ablations, sets, scales
INTERVENE_OPTIONS = [
    ("ablate", Annotated[Optional[List[str]], _opt(
        "--ablate", panel=INTERVENE, metavar="TARGET",
        help="Zero an activation, e.g. blocks.0.attn.head1.")], None),
    ("ablate_with", Annotated[AblateWith, _opt(
        "--ablate-with", panel=INTERVENE, case_sensitive=False, show_default=False,
        help="zero (default), or the mean over positions.")], AblateWith.zero),
    ("set", Annotated[Optional[List[str]], _opt(
        "--set", panel=INTERVENE, metavar="TARGET=VALUE",
        help="Set an activation's entries to a number.")], None),
    ("scale", Annotated[Optional[List[str]], _opt(
        "--scale", panel=INTERVENE, metavar="TARGET=FACTOR",
        help="Multiply an activation's entries.")], None),
    ("patch", Annotated[Optional[List[str]], _opt(
        "--patch", panel=INTERVENE, metavar="TARGET",
        help="Copy an activation from the --from-* run.")], None),
    *from_options(),
]
OUTPUT_OPTIONS = [
    ("json", Annotated[bool, _opt(
        "--json", panel=OUTPUT, help="Machine-readable JSON on stdout, no colour.")], False),
    ("svg", Annotated[Optional[Path], _opt(
        "--svg", panel=OUTPUT, metavar="FILE", callback=writable,
        help="Save exactly what was printed as an SVG.")], None),
    ("save", Annotated[Optional[Path], _opt(
        "--save", panel=OUTPUT, metavar="FILE.npz", callback=writable,
        help="Save the run's arrays (docs/formats.md).")], None),
]
# the order --help lists an option in, within its panel
HELP_ORDER = ("tokens", "text", "load", "arch", "seed", "score_all", "force", "stream")
MODEL_FIELDS = {name for name, _, _ in MODEL_OPTIONS} - {"arch"}
# what makes a run big: the sizes, or what they were read from (Options.sizing)
SIZING = ("batch", "seq_len", "d_model", "heads", "kv_heads", "head_dim", "d_ff", "vocab",
          "layers", "tokens", "text", "load", "arch")
# Config field -> the option a user types, for error messages.
FLAGS = {name: "--" + name.replace("_", "-") for name in MODEL_FIELDS | {"tokens", "text"}}
FLAGS["norm_bias"] = "--no-norm-bias"


class Options:
    """The shared option values of one invocation, and what can be built from them."""

    def __init__(self, ctx: typer.Context, values: dict):
        self.ctx = ctx
        self.values = values
        self.made = None   # the Run that run() made, once it has
        self.saving = None   # a streamed run's --save, written as it goes (io.NpzStream)
        # the command reads --from-tokens/--from-text as its own corrupted run (tfm explore's
        # circuit), not as --patch's source
        self.own_corrupted = False

    def __getattr__(self, name):
        try:
            return self.values[name]
        except KeyError:
            raise AttributeError(name) from None

    def sizing(self) -> list[str]:
        """The options typed that set the run's size (-T as --seq-len), or where its sizes
        came from (--load, --arch, --tokens, --text): what a refusal for memory names."""
        return [FLAGS.get(name, "--" + name.replace("_", "-")) for name in SIZING
                if self.values.get(name) is not None and self.explicit(name)]

    def explicit(self, name: str) -> bool:
        """Did the user type this option (rather than take its default)?"""
        source = self.ctx.get_parameter_source(name)
        return source is not None and source.name in ("COMMANDLINE", "ENVIRONMENT")

    def model_fields(self) -> dict:
        """The Config fields: typed, else the --arch preset's, else the defaults."""
        fields = {}
        for name, _, _ in MODEL_OPTIONS:
            if name not in self.values or name == "arch":   # (some commands take only some)
                continue
            value = self.values[name]
            fields[name] = value.value if isinstance(value, Enum) else value
        if "lengths" in fields:
            fields["lengths"] = parse_lengths(fields["lengths"])
        if "rope_scaling" in fields:
            fields["rope_scaling"] = parse_rope_scaling(fields["rope_scaling"])
        if "sliding_layers" in fields:
            fields["sliding_layers"] = parse_sliding_layers(fields["sliding_layers"])
        if self.values.get("arch"):
            from tfmcli.engine.presets import preset_fields

            preset = preset_fields(self.values["arch"], fields)
            fields.update({name: value for name, value in preset.items()
                           if name in fields and not self.explicit(name)})
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

    def run(self, untyped=()):
        """The run these options describe (sources.resolve), parameters not yet drawn.

        Whether it fits in memory, whole or a block at a time, ``streaming.choose_stream``
        decides, before anything is allocated. ``untyped``: options taken as defaults even if
        typed, so that a file's own value wins (tfm precision's --dtype, which names the
        dtype to measure, not the one to read the file in).
        """
        from tfmcli.sources import (  # (at run time: --help skips it)
            MissingExtra,
            parse_tokens,
            resolve,
        )

        explicit = {name for name in MODEL_FIELDS if self.explicit(name)} - set(untyped)
        if self.values.get("arch") and self.values.get("load") is not None:
            raise typer.BadParameter(f"{self.values['load']} brings its own architecture; "
                                     f"drop --arch", param_hint="'--arch'")
        try:
            tokens = parse_tokens(self.values.get("tokens"))
            run = resolve(self.model_fields(), explicit, self.values.get("load"), tokens,
                          self.values.get("text") or None, self.values.get("score_all", False))
        except ConfigError as e:
            raise bad(e.field, str(e)) from None
        except MissingExtra as e:
            raise typer.BadParameter(str(e), param_hint="'--load'") from None
        self.refuse_unused(run.cfg)
        run.arch = self.values.get("arch")
        self.made = run   # what the run ran on goes into --json (common.emit)
        return run

    def json_or_svg_conflict(self):
        """--svg records what is printed for people; --json prints none of that."""
        if self.values.get("json") and self.values.get("svg") is not None:
            raise typer.BadParameter("--svg saves what is printed for people; it cannot be "
                                     "combined with --json", param_hint="'--svg'")


def bad(field: str, message: str) -> typer.BadParameter:
    return typer.BadParameter(message, param_hint=f"'{FLAGS.get(field, '--' + field)}'")


def exact_dtype(command: str, what: str):
    """``validate(cfg)`` for a command that holds the run to ``what``, a tolerance of float64
    and float32: a float16 or bfloat16 run's numbers are rounded far past it (no tolerance
    would tell that rounding from a mistake); ``tfm precision`` measures it."""
    def validate(cfg):
        if cfg.dtype in ("float16", "bfloat16"):
            raise typer.BadParameter(f"tfm {command} holds {what}; a {cfg.dtype} run's are "
                                     f"rounded far past that: tfm precision --dtype {cfg.dtype} "
                                     f"measures its rounding against float64",
                                     param_hint="'--dtype'")
    return validate


def check_range(value: int, upper: int, flag: str, what: str):
    """A --row/--head/--block index must lie in 0..upper-1; ``what`` says whose, e.g. 'batch
    rows'."""
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
    from tfmcli.engine.names import close_names, tails_beginning

    close = close_names(name, known)
    if gradient and name.startswith("d"):
        close = list(dict.fromkeys([*tails_beginning(name[1:], known), *close]))[:4]
    hint = (
        f"; did you mean {', '.join(close)}?"
        if close
        else f"; names are like {known[0]}, {known[-1]}"
    )
    raise typer.BadParameter(f"no tensor named {name!r}{hint}", param_hint=f"'{flag}'")


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


def check_memory(cfg: Config, extra: int = 0, what: str = "forward + backward", also: str = "",
                 opts: Optional["Options"] = None):
    """A usage error when the run's estimate (and ``extra`` bytes that a command adds, for
    ``what``) exceeds the memory available; ``also``: another way out the command has. The
    error names the options that made the run this big (``Options.sizing``)."""
    need, have = memory_estimate(cfg)["total"] + extra, available_memory()
    if need > have:
        raise typer.BadParameter(
            f"this run needs about {binary_size(need)} for {what} (see tfm shapes), more than "
            f"the {binary_size(have)} available; shrink --batch, --seq-len, --d-model, --vocab or "
            f"--layers{also}, or pass --force",
            param_hint=" / ".join(f"'{flag}'" for flag in (opts.sizing() if opts else ())
                                  ) or "'--batch' / '--seq-len' / '--d-model'")


def _help_place(spec) -> tuple:
    """Where --help lists an option: its panel (PANELS), then HELP_ORDER, then as declared."""
    name, annotation, _ = spec
    panel = annotation.__metadata__[0].rich_help_panel
    first = PANELS.index(panel) if panel in PANELS else -1   # a command's own: first
    return (first, HELP_ORDER.index(name) if name in HELP_ORDER else 99)


def with_options(*groups):
    """Append option groups to a command and pass it their values as ``opts: Options``."""
    extra = sorted((spec for group in groups for spec in group), key=_help_place)

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
