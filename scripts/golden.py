"""Golden ``--json`` outputs of the main commands on a few configs, kept in ``tests/golden/``.

    python scripts/golden.py            # write every golden file
    python scripts/golden.py --check    # compare today's outputs with them, exactly

A change that should not move a number (a module moved, a function split) is checked with
``--check``: on the machine that wrote the files, every number must be equal bit for bit.
``tests/test_golden.py`` compares the same outputs on any machine, to a tolerance that holds
across BLAS kernels (1e-12 of each array's scale; the ``*_diff`` columns, which are rounding
noise, to 1e-9).
"""

from __future__ import annotations

import json
import os
import shlex
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
GOLDEN = ROOT / "tests" / "golden"

# the configs: the default toy, a LLaMA block, a GPT-2 pair of blocks, Falcon's parallel block,
# a Post-LN block, and a checkpoint folder read with its tokenizer
CONFIGS = {
    "toy": "",
    "llama": "--arch llama",
    "gpt2": "--arch gpt2 -L 2",
    "falcon": "--arch falcon",
    "postln": "--norm post --activation gelu",
    "folder": '--load examples/tiny-gpt2 --text "The cat sat on"',
}
# the commands: each runs on every config
COMMANDS = {
    "forward": "forward",
    "backward": "backward",
    "gradcheck": "gradcheck --max-entries 3",
    "embed": "embed -t 1",
    "attn": "attn",
    "query": "attn --query 1",
    "ln": "ln -t 1",
    "ffn": "ffn -t 1",
    "block": "block -t 1",
    "loss": "loss -t 1",
    "kv": "kv",
    "lens": "lens",
    "adam": "adam",
}
# what a config cannot run (a Post-LN block has no pre-norm to compare; lens needs a final norm)
SKIP = {("postln", "compare"), ("postln", "lens"), ("postln", "ln")}
NEEDS = {"folder": ("safetensors", "tokenizers")}


def cases():
    for config, flags in CONFIGS.items():
        for command, args in COMMANDS.items():
            if (config, command) not in SKIP:
                yield f"{config}-{command}", f"{args} {flags} --json"
    yield "toy-shapes", "shapes --json"
    yield "gpt2-shapes", "shapes --arch gpt2 -d 768 -H 12 -T 1024 -V 50257 -L 12 --json"
    yield "toy-mask", "mask --len 5 --lengths 5,3 --json"
    yield "toy-pe", "pe --json"
    yield "toy-compare", "compare --json"
    yield "toy-train", "train --task reverse --steps 20 --json"


def run(args: str) -> dict:
    """The command's JSON, run in this process from the project's folder."""
    from typer.testing import CliRunner

    from tfmcli.cli import app

    cwd = os.getcwd()
    os.chdir(ROOT)
    try:
        result = CliRunner().invoke(app, shlex.split(args), env={"COLUMNS": "80"})
    finally:
        os.chdir(cwd)
    if result.exit_code != 0:
        raise SystemExit(f"tfm {args}: exit {result.exit_code}\n{result.output}")
    out = json.loads(result.stdout)
    out.pop("seconds", None)   # tfm train's time
    return out


def main(argv: list[str]) -> int:
    if argv not in ([], ["--check"]):   # anything else (--help) must not rewrite the files
        print(__doc__.split("\n\n")[1], file=sys.stderr)
        return 2
    check = argv == ["--check"]
    GOLDEN.mkdir(exist_ok=True)
    differ = []
    for name, args in cases():
        path = GOLDEN / f"{name}.json"
        out = run(args)
        if check:
            if json.loads(path.read_text())["out"] != out:
                differ.append(name)
        else:
            path.write_text(json.dumps({"args": args, "out": out}, indent=None) + "\n")
    if check:
        print("\n".join(differ) or "every golden output equal, bit for bit")
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
