"""Speed at the sizes people open (issue 75): GPT-2 small's shape (124M parameters) from a
checkpoint folder on 8, 32 and 256 tokens, each figure a ratio measured side by side in one
run.

    python benchmarks/real.py [--folder DIR] [--tokens 8,32,256] [--rounds N]

- the engine's forward + backward (float64) against Hugging Face's GPT2LMHeadModel with torch
  autograd in float64 on the same weights (eager attention), alternately in one process,
  each the median of ``--rounds`` calls; and against the limit: the work (``sizes.flops``) at
  NumPy's own float64 matmul rate on this machine (a 2048 x 2048 product), plus the folder's
  read time;
- whole commands (``forward``, ``backward``, ``lens``, ``explore`` to its first screen), each
  a fresh process, against the engine's time and the import floor (a process that imports
  tfm's CLI and exits);
- NumPy's arrays in 2 MB pages (its default on Linux) against 4 KB
  (``NUMPY_MADVISE_HUGEPAGE=0``): the folder read by a fresh process, ``tfm forward``, and the
  engine's step on 8 and 32 tokens;
- the engine in float32, bfloat16 and float16 against float32, on 32 tokens.

Freed memory stays in the process's heap (``memory.keep_freed_memory``), as in the commands
that run the model, for tfm and torch alike.

The folder (random weights, float32 safetensors, about 500 MB) is made once with
``save_pretrained`` and never committed. The script unsets OPENBLAS_CORETYPE and
OPENBLAS_L2_SIZE for itself and prints the BLAS kernel. The targets (issue 75) are printed
beside each figure; this script measures, it does not decide.
"""

from __future__ import annotations

import os
import sys

OVERRIDES = ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE")
if __name__ == "__main__" and any(name in os.environ for name in OVERRIDES):
    env = {k: v for k, v in os.environ.items() if k not in OVERRIDES}
    os.execve(sys.executable, [sys.executable, *sys.argv], env)

import argparse  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402

SHOWN = 32   # tokens of the whole commands and of the dtypes' runs
SMALL = dict(n_embd=768, n_layer=12, n_head=12, vocab_size=50257, n_positions=1024)


def kernel() -> str:
    from threadpoolctl import threadpool_info

    return ", ".join(f"{i['internal_api']} {i.get('architecture', '')} {i['num_threads']} "
                     f"threads" for i in threadpool_info() if i["user_api"] == "blas")


def make_folder(folder: Path) -> None:
    import torch
    import transformers

    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(**SMALL))
    model.save_pretrained(folder)


def median_time(work, rounds: int) -> float:
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        work()
        times.append(time.perf_counter() - start)
        time.sleep(0.05)   # neither inherits the other's spinning BLAS threads
    return statistics.median(times)


def matmul_rate(rounds: int = 5) -> float:
    """NumPy's float64 matmul rate here, in FLOP/s (a 2048 x 2048 product)."""
    a = np.random.default_rng(0).standard_normal((2048, 2048))
    seconds = median_time(lambda: a @ a, rounds)
    return 2 * 2048 ** 3 / seconds


def engine(folder: Path, T: int, dtype: str = "float64"):
    """(the run, a function doing forward + backward once)."""
    import tfmcli

    rng = np.random.default_rng(T)
    run = tfmcli.load(folder, tokens=[list(map(int, rng.integers(0, 50257, T)))], dtype=dtype)
    params, inputs, cfg = run.params, run.inputs, run.cfg

    def step():
        fwd = tfmcli.forward(params, inputs, cfg)
        tfmcli.backward(params, fwd, cfg)
    return run, step


def torch_step(folder: Path, run):
    import torch
    import transformers

    model = transformers.GPT2LMHeadModel.from_pretrained(folder, attn_implementation="eager",
                                                         dtype=torch.float64)
    ids = torch.as_tensor(run.inputs.tokens)

    def step():
        model.zero_grad(set_to_none=True)
        out = model(input_ids=ids, labels=ids)
        out.loss.backward()
    return step


def command_time(args: list[str], rounds: int = 3, env=None) -> float:
    return median_time(lambda: subprocess.run([sys.executable, "-m", "tfmcli", *args],
                                              capture_output=True, check=True, env=env), rounds)


READ = """import sys, time
import tfmcli
start = time.perf_counter()
tfmcli.load(sys.argv[1], tokens=[[0, 1]], dtype="float64").complete()
print(time.perf_counter() - start)"""
STEP = """import sys
from pathlib import Path
sys.path.insert(0, sys.argv[2])
import real
from tfmcli.engine.memory import keep_freed_memory
keep_freed_memory()
_, step = real.engine(Path(sys.argv[1]), int(sys.argv[3]))
step()
print(real.median_time(step, 5))"""


def pages(folder: Path, tokens: str, rounds: int) -> None:
    """NumPy's arrays in 2 MB pages (its default on Linux) against 4 KB
    (NUMPY_MADVISE_HUGEPAGE=0): the folder read in float64 by a fresh process, tfm forward,
    and the engine's step (a process of its own, the median of 5 steps), alternately, each
    the median of ``rounds``."""
    print("\nNumPy's pages (NUMPY_MADVISE_HUGEPAGE), a fresh process each, alternately")
    for what, run in (("reading the folder in float64",
                       lambda env: float(subprocess.run(
                           [sys.executable, "-c", READ, str(folder)], capture_output=True,
                           check=True, text=True, env=env).stdout)),
                      ("tfm forward, the whole command", lambda env: command_time(
                          ["forward", "--load", str(folder), "--tokens", tokens, "--json"], 1,
                          env)),
                      *((f"the engine's step, {T} tokens", lambda env, T=T: float(
                          subprocess.run([sys.executable, "-c", STEP, str(folder),
                                          str(Path(__file__).parent), str(T)],
                                         capture_output=True, check=True, text=True,
                                         env=env).stdout)) for T in (8, 32))):
        times = {"1": [], "0": []}
        for _ in range(rounds):
            for flag in times:
                times[flag].append(run({**os.environ, "NUMPY_MADVISE_HUGEPAGE": flag}))
        huge, small = (statistics.median(times[flag]) for flag in ("1", "0"))
        print(f"  {what:<31} 2 MB pages {huge * 1e3:6.0f} ms   4 KB pages {small * 1e3:6.0f} "
              f"ms   {huge / small:5.2f}x", flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--folder", default="/tmp/tfm-gpt2-small")
    parser.add_argument("--tokens", default="8,32,256")
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    folder = Path(args.folder)
    if not (folder / "config.json").is_file():
        print(f"making {folder} (GPT-2 small's shape, random)...", flush=True)
        make_folder(folder)
    import tfmcli
    from tfmcli.engine.memory import keep_freed_memory
    from tfmcli.engine.sizes import flops

    # as the commands that run the model do: a step's arrays reuse the last step's memory
    # (without it the engine's step on 8 tokens took 260-700 ms here, with 30-77 thousand
    # page faults each, and 157-176 ms with none; torch's steps faulted 150-320 thousand)
    keep_freed_memory()

    T = SHOWN   # the whole commands first, a fresh process each, while this one holds nothing
    tokens = ",".join(map(str, np.random.default_rng(T).integers(0, 50257, T)))
    floor = median_time(lambda: subprocess.run([sys.executable, "-c",
                                                "import tfmcli.cli"], check=True), 3)
    commands = {}
    for command in (["forward"], ["backward"], ["lens"], ["explore", "--keys", "q"]):
        commands[command[0]] = command_time(
            [*command, "--load", str(folder), "--tokens", tokens, "--json"]
            if command[0] != "explore" else [*command, "--load", str(folder), "--tokens", tokens])
    print(f"BLAS: {kernel()}")
    rate = matmul_rate()
    print(f"NumPy float64 matmul: {rate / 1e9:.1f} GFLOP/s")
    start = time.perf_counter()
    tfmcli.load(folder, tokens=[[0, 1]], dtype="float64").complete()
    read = time.perf_counter() - start
    print(f"reading the folder in float64: {read * 1e3:.0f} ms\n")
    print("T     tfm ms  torch ms  tfm/torch  limit ms  tfm at % of limit   "
          "(targets: <= 0.7x torch; >= 60% at 256, 45% at 32)")
    for T in map(int, args.tokens.split(",")):
        run, ours = engine(folder, T)
        theirs = torch_step(folder, run)
        ours(), theirs()   # warm
        ratios, tfm_times, torch_times = [], [], []
        for _ in range(args.rounds):
            a, b = median_time(ours, 1), median_time(theirs, 1)
            tfm_times.append(a)
            torch_times.append(b)
            ratios.append(a / b)
        forward, backward = flops(run.cfg)
        limit = (forward + backward) / rate
        tfm_ms = statistics.median(tfm_times)
        print(f"{T:<5} {tfm_ms * 1e3:7.0f} {statistics.median(torch_times) * 1e3:9.0f} "
              f"{statistics.median(ratios):10.2f} {limit * 1e3:9.0f} "
              f"{limit / tfm_ms:18.0%}", flush=True)
    T = SHOWN
    run, ours = engine(folder, T)
    ours()
    engine_s = median_time(ours, args.rounds)
    print(f"\nwhole commands on {T} tokens (a fresh process each, timed first; the engine's "
          f"forward + backward {engine_s * 1e3:.0f} ms; importing tfm's CLI {floor * 1e3:.0f} "
          f"ms) (target: <= 1.5x the engine's time)")
    for name, seconds in commands.items():
        print(f"  tfm {name:<9} {seconds * 1e3:7.0f} ms  {seconds / engine_s:5.2f}x the "
              f"engine's", flush=True)
    pages(folder, tokens, 3)
    print(f"\nthe engine in each dtype on {T} tokens, against float32 (target: <= 2x)")
    base = None
    for dtype in ("float32", "bfloat16", "float16"):
        _, step = engine(folder, T, dtype)
        step()
        seconds = median_time(step, args.rounds)
        base = base or seconds
        print(f"  {dtype:<9} {seconds * 1e3:7.0f} ms  {seconds / base:5.2f}x", flush=True)


if __name__ == "__main__":
    main()
