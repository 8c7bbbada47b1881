"""Mutation testing: plant one small bug at a time in the engine, run the fast tests, count
how many bugs they catch.

    python scripts/mutate.py              # 40 mutants drawn with seed 0 (about 10 minutes)
    python scripts/mutate.py --sample 0   # every mutant (hours on two cores)
    python scripts/mutate.py --sample 0 --target tfmcli/engine/parallel.py   # one file's mutants
    python scripts/mutate.py --sample 0 --target tfmcli/engine/kv.py         # beyond the engine
    python scripts/mutate.py --sample 60 --target tfmcli/render/heatmap.py   # a view
    python scripts/mutate.py --sample 0 --target tfmcli/cli/options.py       # a command's options

By default it mutates the engine (the forward and backward passes and what they stand on)
and runs the engine's tests. ``--target`` also takes the modules that compute the other
numbers a user reads (the inputs, the KV cache, the logit lens, the toy tasks and training,
the shapes, FLOPs and memory, the statistics, the Pre-LN / Post-LN comparison, the attention
steps, the file loaders), the views that draw them (``tfmcli/render``) and the commands
(``tfmcli/cli``: their options, their checks of bad input, their JSON); each runs the test
files that cover it.

A mutant swaps one operator (+ and -, * and /, < and <=, > and >=), changes one number (n to
n + 1, 0.5 to 0.25...) or drops one unary minus, inside a function of an engine module. It is
"killed" when the tests fail (or hang past the timeout) and "survives" when they pass: each
survivor is a bug the suite would not notice, or an equivalent program. The engine files are
restored after each mutant, whatever happens.
"""

from __future__ import annotations

import argparse
import ast
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ENGINE = [
    "tfmcli/engine/ops.py",
    "tfmcli/engine/model.py",
    "tfmcli/train/optim.py",
    "tfmcli/check/gradcheck.py",
    "tfmcli/engine/masks.py",
    "tfmcli/engine/positional.py",
    "tfmcli/engine/init.py",
    "tfmcli/engine/parallel.py",
]
ENGINE_TESTS = ["tests/test_ops.py", "tests/test_model.py", "tests/test_torch.py",
                "tests/test_train.py", "tests/test_kv.py", "tests/test_seeds.py",
                "tests/test_fast.py", "tests/test_parallel.py"]
TESTS = {path: ENGINE_TESTS for path in ENGINE} | {  # each file, and the tests that cover it
    "tfmcli/engine/inputs.py": ["tests/test_tokens.py", "tests/test_model.py", "tests/test_io.py"],
    "tfmcli/engine/kv.py": ["tests/test_kv.py"],
    "tfmcli/explain/layernorm.py": ["tests/test_layernorm.py"],
    "tfmcli/explain/feedforward.py": ["tests/test_feedforward.py"],
    "tfmcli/explain/loss.py": ["tests/test_loss.py"],
    "tfmcli/explain/embedding.py": ["tests/test_embed.py"],
    "tfmcli/explain/block.py": ["tests/test_block.py"],
    "tfmcli/explain/adam.py": ["tests/test_adam.py"],
    "tfmcli/explain/lens.py": ["tests/test_gpt2.py", "tests/test_properties.py"],
    "tfmcli/train/tasks.py": ["tests/test_train.py"],
    "tfmcli/train/loop.py": ["tests/test_train.py"],
    "tfmcli/engine/config.py": [
        "tests/test_errors.py",
        "tests/test_kv.py",
        "tests/test_memory.py",
        "tests/test_io.py",
        "tests/test_cli.py",
        "tests/test_tokens.py",
        "tests/test_model.py",
        "tests/test_gpt2.py",
    ],
    "tfmcli/explain/summary.py": ["tests/test_render.py", "tests/test_terminal.py"],
    "tfmcli/explain/compare.py": ["tests/test_compare.py"],
    "tfmcli/explain/steps.py": [
        "tests/test_attn_backward.py",
        "tests/test_cli.py",
        "tests/test_tokens.py",
        "tests/test_seeds.py",
    ],
    "tfmcli/sources/npz.py": ["tests/test_io.py", "tests/test_tokens.py"],
    "tfmcli/sources/gpt2.py": ["tests/test_gpt2.py"],
}
RENDER = ["tfmcli/render/numbers.py", "tfmcli/render/colours.py", "tfmcli/render/heatmap.py",
          "tfmcli/render/maps.py", "tfmcli/render/masks.py", "tfmcli/render/tables.py",
          "tfmcli/render/plot.py", "tfmcli/render/lens.py", "tfmcli/render/tokens.py"]
RENDER_TESTS = [
    "tests/test_render.py",
    "tests/test_heatmap.py",
    "tests/test_seeds.py",  # quick first
    "tests/test_compare.py",
    "tests/test_kv.py",
    "tests/test_examples.py",
    "tests/test_tokens.py",
    "tests/test_cli.py",
    "tests/test_terminal.py",
    "tests/test_train.py",
    "tests/test_gpt2.py",
]
TESTS |= {path: RENDER_TESTS for path in RENDER}   # the views: what a user reads, drawn
CLI = [
    f"tfmcli/cli/{name}.py"
    for name in (
        "adam",
        "app",
        "attn",
        "backward",
        "block",
        "check",
        "checks",
        "common",
        "compare",
        "embed",
        "forward",
        "gradcheck",
        "ffn",
        "kv",
        "lens",
        "ln",
        "loss",
        "mask",
        "options",
        "pe",
        "shapes",
        "train",
    )
]
CLI_TESTS = ["tests/test_errors.py", "tests/test_compare.py", "tests/test_kv.py",   # quick first
             "tests/test_layernorm.py", "tests/test_feedforward.py", "tests/test_loss.py",
             "tests/test_embed.py", "tests/test_block.py", "tests/test_adam.py",
             "tests/test_attn_backward.py",
             "tests/test_seeds.py", "tests/test_startup.py", "tests/test_check.py",
             "tests/test_examples.py", "tests/test_io.py", "tests/test_tokens.py",
             "tests/test_cli.py", "tests/test_memory.py", "tests/test_gpt2.py",
             "tests/test_train.py", "tests/test_terminal.py", "tests/test_readme.py"]
TESTS |= {path: CLI_TESTS for path in CLI}   # the commands: options, their checks, the payloads
SWAP = {ast.Add: ast.Sub, ast.Sub: ast.Add, ast.Mult: ast.Div, ast.Div: ast.Mult,
        ast.Lt: ast.LtE, ast.LtE: ast.Lt, ast.Gt: ast.GtE, ast.GtE: ast.Gt}


def sites(tree: ast.AST) -> list[tuple[ast.AST, str]]:
    """Every mutable node inside a function, in walk order, with what the mutation does."""
    found = []
    for func in ast.walk(tree):
        if not isinstance(func, (ast.FunctionDef, ast.Lambda)):
            continue
        for node in ast.walk(func):
            if isinstance(node, ast.BinOp) and type(node.op) in SWAP:
                found.append((node, "op"))
            elif isinstance(node, ast.Compare) and type(node.ops[0]) in SWAP:
                found.append((node, "compare"))
            elif (isinstance(node, ast.Constant) and type(node.value) in (int, float)
                  and not isinstance(node.value, bool)):
                found.append((node, "number"))
            elif isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
                found.append((node, "negation"))
    unique, seen = [], set()
    for node, kind in found:   # nested functions are walked twice
        if id(node) not in seen:
            seen.add(id(node))
            unique.append((node, kind))
    return unique


def mutate(source: str, index: int) -> tuple[str, str]:
    """The source with site ``index`` mutated, and a one-line description of the change."""
    tree = ast.parse(source)
    node, kind = sites(tree)[index]
    line = node.lineno
    if kind == "op":
        old = type(node.op).__name__
        node.op = SWAP[type(node.op)]()
        what = f"{old} -> {type(node.op).__name__}"
    elif kind == "compare":
        old = type(node.ops[0]).__name__
        node.ops[0] = SWAP[type(node.ops[0])]()
        what = f"{old} -> {type(node.ops[0]).__name__}"
    elif kind == "number":
        old = node.value
        node.value = old / 2 if isinstance(old, float) and old not in (0.0, 1.0) else old + 1
        what = f"{old!r} -> {node.value!r}"
    else:
        parent = next(p for p in ast.walk(tree) for child in ast.iter_child_nodes(p)
                      if child is node)
        for field, value in ast.iter_fields(parent):
            if value is node:
                setattr(parent, field, node.operand)
            elif isinstance(value, list):
                setattr(parent, field, [node.operand if v is node else v for v in value])
        what = "unary minus dropped"
    return ast.unparse(tree), f"line {line}: {what}"


def run_tests(tests: list[str], timeout: float) -> bool:
    """True when the tests pass (the mutant survives)."""
    try:
        done = subprocess.run([sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider",
                               *tests], cwd=ROOT, capture_output=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return False
    return done.returncode == 0


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sample", type=int, default=40, help="mutants to draw (0: all)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per test run")
    parser.add_argument("--target", action="append", choices=list(TESTS),
                        help="mutate only this file (repeatable; default: the engine's)")
    args = parser.parse_args()
    # A kill (not only Ctrl-C) unwinds through the finally blocks below, so that no file is
    # left mutated; subprocess.run kills the test run it was waiting on.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit("killed; the files are restored"))

    originals = {path: (ROOT / path).read_text() for path in args.target or ENGINE}
    mutants = [(path, i) for path, source in originals.items()
               for i in range(len(sites(ast.parse(source))))]
    if args.sample:
        mutants = sorted(random.Random(args.seed).sample(mutants, min(args.sample, len(mutants))))
    if not run_tests(sorted({t for path in originals for t in TESTS[path]}), args.timeout):
        sys.exit("the tests fail before any mutation; fix them first")
    survivors, start = [], time.time()
    try:
        for k, (path, index) in enumerate(mutants, 1):
            source, what = mutate(originals[path], index)
            (ROOT / path).write_text(source)
            try:
                survived = run_tests(TESTS[path], args.timeout)
            finally:
                (ROOT / path).write_text(originals[path])
            print(f"[{k}/{len(mutants)}] {'SURVIVED' if survived else 'killed  '} "
                  f"{path} {what}", flush=True)
            if survived:
                survivors.append(f"{path} {what}")
    finally:
        for path, source in originals.items():
            (ROOT / path).write_text(source)
    killed = len(mutants) - len(survivors)
    print(f"\nkilled {killed} of {len(mutants)} mutants ({killed / len(mutants):.0%}) "
          f"in {time.time() - start:.0f} s; survivors:")
    for line in survivors:
        print("  " + line)


if __name__ == "__main__":
    main()
