"""The docs' pictures, drawn by tfm itself from real runs: each is what its command prints at
80 columns, in colour, saved with ``--svg``.

    python scripts/gallery.py           # draw every picture into docs/pictures/
    python scripts/gallery.py forward   # only these

``tests/test_gallery.py`` draws each again and fails when a picture no longer matches what its
command prints (after ``comparable``, which blanks what changes from run to run: ``tfm
train``'s time, and rounding's digits, which change with the CPU).
"""

from __future__ import annotations

import re
import shlex
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PICTURES = ROOT / "docs" / "pictures"
WIDTH = 80

# picture -> the command that draws it (run from the project's folder)
GALLERY = {
    "forward": "tfm forward --tokens 3,1,4,1,5 --head 0",
    "backward": "tfm backward --layer ffn",
    "gradcheck": "tfm gradcheck",
    "shapes": "tfm shapes -d 768 -H 12 -T 1024 -V 50257",
    "embed": "tfm embed -t 1",
    "attn": "tfm attn --query 2 --tokens 3,1,4,1,5",
    "ln": "tfm ln -t 2",
    "ffn": "tfm ffn -t 2",
    "block": "tfm block -t 2",
    "loss": "tfm loss -t 2",
    "mask": "tfm mask --len 7 --lengths 7,4",
    "pe": "tfm pe",
    "train": "tfm train --task reverse",
    "adam": "tfm adam",
    "kv": "tfm kv",
    "lens": 'tfm lens --load examples/tiny-gpt2 --text "The cat sat on the" -k 2',
    "circuit": "tfm circuit --tokens 3,1,4,1,5,7,2,6 --from-tokens 3,1,2,1,5,7,2,6 -L 2 --top 6",
    "check": "tfm check --against torch",
    "compare": "tfm compare",
    "explore": 'tfm explore --tokens 3,1,4,1,5 --keys "down,down,right"',
    "patch": ('tfm patch --load examples/tiny-gpt2 --text "The cat sat on the mat." '
              '--from-text "The dog sat on the mat." --over heads'),
    "attribute": ('tfm attribute --load examples/tiny-gpt2 --text "The cat sat on the" -t 4 '
                  '--target " mat"'),
    "precision": 'tfm precision --load examples/tiny-gpt2 --text "The cat sat on the"',
}
NEEDS = {"lens": ("safetensors", "tokenizers"), "check": ("torch",),
         "patch": ("safetensors", "tokenizers"), "attribute": ("safetensors", "tokenizers"),
         "precision": ("safetensors", "tokenizers")}


def draw(name: str, path: Path) -> None:
    """Run the picture's command with ``--svg path`` at WIDTH columns, in this process."""
    import os

    from typer.testing import CliRunner

    from tfmcli.cli import app

    args = shlex.split(GALLERY[name])[1:]
    # tfm explore's picture is its screen after the keys, 120 x 32; the others print at WIDTH
    args += ["--screenshot" if name == "explore" else "--svg", str(path)]
    env = {"COLUMNS": "120" if name == "explore" else str(WIDTH),
           "LINES": "32" if name == "explore" else "50", "NO_COLOR": None, "FORCE_COLOR": None}
    cwd = os.getcwd()
    os.chdir(ROOT)   # the commands' paths are the project's
    try:
        result = CliRunner().invoke(app, args, env=env)
    finally:
        os.chdir(cwd)
    if result.exit_code != 0:
        raise RuntimeError(f"{GALLERY[name]} exited {result.exit_code}: {result.output}")


# A number that is rounding, written out: below 1e-7 in scientific notation (a check's residual:
# float64 computed twice, 1e-16, or central differences' error, 1e-11 to 1e-8), an exact zero
# (0.0e+00: the same rounding on another CPU), or ≈0; with the spaces that right-justify it.
NOISE = re.compile(r"(?:&#160;)*(?<![\d.])[+-]?(?:\d\.\d+e-(?:0[89]|[1-9]\d)|0\.0+(?:e[+-]00)?|≈0)"
                   r"(?![\d])")


def comparable(svg: str) -> str:
    """The picture with what changes from run to run blanked: tfm train's time, the class
    names Rich derives from the whole content (so from that time too), and the digits of
    rounding, which change with the CPU and its BLAS (NOISE: a check's residual of 1.1e-16 on
    one is 2.2e-16 or exactly 0 on another; a mean of 0 in exact arithmetic is 0.0000 or ≈0),
    and with them which residual gradcheck names the worst."""
    svg = re.sub(r"terminal-\d+", "terminal-N", svg)
    svg = re.sub(r"in&#160;[\d.]+&#160;s", "in&#160;T&#160;s", svg)
    svg = NOISE.sub("&#160;≈0", svg)
    return re.sub(r"(worst&#160;relative&#160;error&#160;≈0&#160;)\([\w.]+\)", r"\1(NAME)", svg)


def main(names: list[str]) -> None:
    PICTURES.mkdir(exist_ok=True)
    for name in names or GALLERY:
        draw(name, PICTURES / f"{name}.svg")
        print(f"docs/pictures/{name}.svg  {GALLERY[name]}")


if __name__ == "__main__":
    unknown = [name for name in sys.argv[1:] if name not in GALLERY]
    if unknown:
        sys.exit(f"gallery.py: no picture named {unknown[0]!r}; pictures: {', '.join(GALLERY)}")
    main(sys.argv[1:])
