"""benchmarks/bench.py --where: the table of where a step's time goes names every operation
the model calls, and no operation takes longer than the step it is part of. (Timings
themselves are the benchmark's business, never a test's.)"""

import os
import subprocess
import sys

BENCH = os.path.join(os.path.dirname(__file__), os.pardir, "benchmarks", "bench.py")


def test_where_times_every_operation_of_a_step_inside_it():
    out = subprocess.run([sys.executable, BENCH, "--where", "--quick"], capture_output=True,
                         text=True, timeout=300, check=True).stdout
    rows = [[cell.strip() for cell in line.split("│")[1:-1]] for line in out.splitlines()
            if line.startswith("│")]
    for dtype in ("float32", "float64"):
        ms = {what: float(took) for what, kind, took, _ in rows if kind == dtype}
        # the block is Pre-LN with ReLU: every operation it calls, and no GELU
        assert set(ms) == {"step", "forward", "backward", "embedding_forward",
                           "layer_norm_forward_fast", "linear_forward",
                           "attention_forward_fast", "relu_forward", "cross_entropy_forward",
                           "cross_entropy_dprobs", "cross_entropy_backward", "linear_backward",
                           "relu_backward", "layer_norm_backward_fast",
                           "attention_backward_fast", "embedding_backward_fast", "rest"}
        assert max(took for what, took in ms.items() if what != "step") <= ms["step"]
