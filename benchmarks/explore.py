"""tfm explore's two targets (issue 61): the toy opens in under a second, and on GPT-2 small's
shape with 32 tokens every key is answered in under 100 ms.

    python benchmarks/explore.py [--repeats N]

1. Opening the toy: the wall time of ``tfm explore --keys down`` (a new process: Python,
   Textual, the run, the first screen, one key, the SVG), the median of N.
2. Keys on GPT-2 small's shape (d 768, 12 heads, 12 blocks, vocabulary 50,257, 32 tokens, one
   row; the weights drawn from the seed: a checkpoint folder of that shape does the same work
   per key, and its reading is done once, before the first key): the run computed once, then
   each key pressed in Textual's headless harness and timed until the screen is drawn again.

The script unsets OPENBLAS_CORETYPE and OPENBLAS_L2_SIZE for itself and prints the kernel.
"""

from __future__ import annotations

import os
import sys

OVERRIDES = ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE")
if any(name in os.environ for name in OVERRIDES):
    env = {k: v for k, v in os.environ.items() if k not in OVERRIDES}
    os.execve(sys.executable, [sys.executable, *sys.argv], env)

import argparse  # noqa: E402
import asyncio  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import time  # noqa: E402

import numpy as np  # noqa: E402

# the keys pressed on GPT-2 small, each timed: moves, a head, a block, a gradient, a link
KEYS = ["down", "right", "right_square_bracket", "right_curly_bracket", "d", "d", "enter",
        "escape", "x", "x", "tab", "down", "down", "tab", "g", "down", "right", "enter",
        "escape"]


def kernel() -> str:
    from threadpoolctl import threadpool_info

    blas = [f"{i['internal_api']} {i.get('architecture', '')} {i['num_threads']} threads"
            for i in threadpool_info() if i["user_api"] == "blas"]
    return ", ".join(blas) or "no BLAS found"


def open_toy(repeats: int) -> list[float]:
    times = []
    env = {**os.environ, "COLUMNS": "80", "LINES": "24"}
    for _ in range(repeats):
        start = time.perf_counter()
        subprocess.run(["tfm", "explore", "--keys", "down"], check=True, env=env,
                       capture_output=True)
        times.append(time.perf_counter() - start)
    return times


def gpt2_keys() -> tuple[float, list[tuple[str, float]]]:
    import tfmcli
    from tfmcli.engine.presets import PRESETS
    from tfmcli.sources import Run
    from tfmcli.tui.app import ExploreApp
    from tfmcli.tui.state import Explorer

    cfg = tfmcli.Config(**{**PRESETS["gpt2"].fields, "d_model": 768, "heads": 12, "layers": 12,
                           "vocab": 50257, "seq_len": 32, "batch": 1, "n_ctx": 1024,
                           "init": "normal"})
    start = time.perf_counter()
    params, inputs = tfmcli.init_params(cfg), tfmcli.make_inputs(cfg)
    fwd = tfmcli.forward(params, inputs, cfg)
    grads = tfmcli.backward(params, fwd, cfg)
    computed = time.perf_counter() - start
    app = ExploreApp(Explorer(Run(cfg, params, inputs, "seed", "seed"), fwd, grads, []), "bench")

    drawing = []
    draw = app.draw

    def timed_draw():   # tfm's own part of a key: the slice, its labels, the table, the text
        start = time.perf_counter()
        draw()
        drawing.append(time.perf_counter() - start)

    app.draw = timed_draw

    async def press(pilot, key):
        start = time.perf_counter()
        await pilot.press(key)
        await pilot.pause()
        return time.perf_counter() - start

    async def go():
        spent, floor = [], []
        async with app.run_test(size=(120, 40)) as pilot:
            await pilot.pause()
            for key in KEYS:
                floor.append(await press(pilot, "z"))   # a key nothing is bound to
                drawing.clear()
                spent.append((key, await press(pilot, key), sum(drawing)))
        return spent, floor

    spent, floor = asyncio.run(go())
    return computed, spent, floor


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    print(f"BLAS: {kernel()}")
    toy = open_toy(args.repeats)
    print(f"open the toy (tfm explore --keys down, 80 x 24): median {statistics.median(toy):.2f} s"
          f" of {len(toy)} (min {min(toy):.2f}, max {max(toy):.2f}); target < 1 s")
    computed, spent, floor = gpt2_keys()
    base = statistics.median(floor)
    answer = np.array([t - base for _, t, _ in spent]) * 1000
    print(f"GPT-2 small's shape, 32 tokens: forward + backward once {computed:.1f} s")
    print(f"  the harness's own time for a key nothing is bound to: median {base * 1000:.0f} ms")
    slowest = max(zip(answer, spent), key=lambda pair: pair[0])
    print(f"  {len(answer)} keys, beyond that: median {np.median(answer):.0f} ms, max "
          f"{answer.max():.0f} ms ({slowest[1][0]}); target < 100 ms a key")
    print(f"    {'key':<22} {'round trip':>10} {'beyond':>7} {'drawing':>8}")
    for (key, t, drawn), beyond in zip(spent, answer):
        print(f"    {key:<22} {t * 1000:7.0f} ms {beyond:4.0f} ms {drawn * 1000:5.0f} ms")


if __name__ == "__main__":
    main()
