"""Libraries against tfm's hand-made code, paired in one process (the house issue, item 6).

    python benchmarks/libraries.py

1. BLAS thread control: tfm's ``parallel.blas_threads`` through threadpoolctl against the
   ctypes lookup it replaced (kept here, the measured baseline): finding the library once, a
   hold and its release, and a forward + backward step of the benchmark's block and of the toy,
   alternating the two in rounds.
2. NumExpr for the element-wise passes (softmax, layer norm, GELU, SiLU, the mask's add), when
   it is installed: its time against NumPy's, and whether it gives NumPy's bits, which every
   number tfm prints must keep.

The script unsets OPENBLAS_CORETYPE and OPENBLAS_L2_SIZE for itself and prints the kernel.
"""

from __future__ import annotations

import os
import sys

OVERRIDES = ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE")
if any(name in os.environ for name in OVERRIDES):
    env = {k: v for k, v in os.environ.items() if k not in OVERRIDES}
    os.execve(sys.executable, [sys.executable, *sys.argv], env)

import ctypes  # noqa: E402
import functools  # noqa: E402
import glob  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402

import numpy as np  # noqa: E402

import tfmcli  # noqa: E402
from tfmcli.engine import ops, parallel  # noqa: E402


def ctypes_blas_threads():
    """The hand-made lookup tfm had before threadpoolctl: NumPy's bundled OpenBLAS by globbing,
    its thread functions by guessing their symbols."""
    root = os.path.dirname(np.__file__)
    paths = glob.glob(os.path.join(root, os.pardir, "numpy.libs", "*openblas*"))
    paths += glob.glob(os.path.join(root, ".dylibs", "*openblas*"))
    mode = getattr(os, "RTLD_NOLOAD", 0) | getattr(os, "RTLD_LAZY", 0)
    for path in paths:
        try:
            lib = ctypes.CDLL(path, mode=mode)
        except OSError:
            continue
        for prefix, suffix in (("scipy_", "64_"), ("scipy_", ""), ("", "64_"), ("", "")):
            get = getattr(lib, f"{prefix}openblas_get_num_threads{suffix}", None)
            set_ = getattr(lib, f"{prefix}openblas_set_num_threads{suffix}", None)
            if get is not None and set_ is not None:
                return get, set_
    return None


LIBRARY = parallel.blas_threads.__wrapped__   # threadpoolctl's, uncached


def timed(call, n: int) -> float:
    start = time.perf_counter()
    for _ in range(n):
        call()
    return (time.perf_counter() - start) / n


def paired_step(fields: dict, rounds: int) -> tuple[float, float, float]:
    """Median seconds of a step with each lookup, and the median of their paired ratios."""
    cfg = tfmcli.Config(**fields)
    params, inputs = tfmcli.init_params(cfg), tfmcli.make_inputs(cfg)

    def step():
        tfmcli.backward(params, tfmcli.forward(params, inputs, cfg), cfg)

    times = {"library": [], "ctypes": []}
    for _ in range(rounds):
        for name, lookup in (("library", LIBRARY), ("ctypes", ctypes_blas_threads)):
            control = lookup()
            parallel.blas_threads = lambda control=control: control
            step()   # one unmeasured: BLAS's threads settle
            times[name].append(timed(step, 3))
    parallel.blas_threads = functools.lru_cache(maxsize=1)(LIBRARY)
    ratios = [a / b for a, b in zip(times["library"], times["ctypes"])]
    return statistics.median(times["library"]), statistics.median(times["ctypes"]), \
        statistics.median(ratios)


def blas_control() -> None:
    print("1. BLAS thread control: threadpoolctl against the ctypes lookup")
    for name, lookup in (("threadpoolctl", LIBRARY), ("ctypes", ctypes_blas_threads)):
        start = time.perf_counter()
        get, set_ = lookup()
        found = time.perf_counter() - start
        before = get()
        hold = timed(lambda: (set_(1), set_(before)), 20_000)
        print(f"   {name:<13} found once in {found * 1e3:5.2f} ms; a hold and its release "
              f"{hold * 1e6:.2f} us; a look at the count {timed(get, 20_000) * 1e6:.2f} us")
    block = dict(batch=2, seq_len=512, d_model=512, heads=8, d_ff=2048, vocab=512, layers=1,
                 activation="gelu")
    for name, fields, rounds in (("the benchmark's block", block, 12), ("the toy", {}, 40)):
        library, hand, ratio = paired_step(fields, rounds)
        print(f"   step of {name}: threadpoolctl {library * 1e3:.2f} ms, ctypes "
              f"{hand * 1e3:.2f} ms, paired ratio {ratio:.3f} ({rounds} rounds)")


def ne(expression: str, **names):
    """NumExpr's evaluation of ``expression`` on these arrays."""
    import numexpr
    return numexpr.evaluate(expression, local_dict=names)


def numexpr_passes() -> None:
    try:
        import numexpr
    except ImportError:
        print("2. NumExpr: not installed (python -m pip install numexpr)")
        return
    print(f"2. NumExpr {numexpr.__version__} ({numexpr.detect_number_of_cores()} cores) against "
          f"NumPy, on (2, 8, 512, 512) scores and (1024, 2048) activations, float64")
    rng = np.random.default_rng(0)
    s = rng.normal(size=(2, 8, 512, 512))
    x = rng.normal(size=(1024, 2048))
    m = s.max(-1, keepdims=True)
    mean, rstd = x.mean(-1, keepdims=True), 1 / x.std(-1, keepdims=True)
    c = np.sqrt(2 / np.pi)
    cases = {
        "softmax's exp(s - max)": (lambda: np.exp(s - m), lambda: ne("exp(s - m)", s=s, m=m)),
        "layer norm's (x - mean) rstd": (lambda: (x - mean) * rstd, lambda: ne(
            "(x - mean) * rstd", x=x, mean=mean, rstd=rstd)),
        "GELU (tanh form)": (lambda: ops.gelu_forward(x)[0], lambda: numexpr.evaluate(
            "0.5 * x * (1 + tanh(c * (x + 0.044715 * x ** 3)))", local_dict={"x": x, "c": c})),
        "SiLU": (lambda: x / (1 + np.exp(-x)),
                 lambda: numexpr.evaluate("x / (1 + exp(-x))", local_dict={"x": x})),
    }
    for name, (ours, theirs) in cases.items():
        a, b = ours(), theirs()
        same = np.array_equal(a, b)
        worst = float(np.max(np.abs(a - b)))
        ratio = statistics.median(timed(theirs, 3) / timed(ours, 3) for _ in range(7))
        print(f"   {name:<30} NumExpr takes {ratio:.2f} of NumPy's time; "
              f"{'the same bits' if same else f'not the same bits (up to {worst:.1e} apart)'}")


def numexpr_layer_norm() -> None:
    """tfm's fast layer norm against the same passes through NumExpr (x - mean, times rstd,
    times gamma plus beta, each one fused pass on every core), on the benchmark's rows."""
    try:
        import numexpr  # noqa: F401
    except ImportError:
        return
    rng = np.random.default_rng(1)
    x = rng.normal(size=(2, 512, 512))
    gamma, beta = rng.normal(size=512), rng.normal(size=512)

    def with_numexpr():
        x2d = x.reshape(-1, 512)
        xc = ne("x2d - mean", x2d=x2d, mean=x2d.sum(axis=-1, keepdims=True) / 512)
        rstd = 1.0 / np.sqrt(ops.row_dot(xc, xc) / 512 + 1e-5)
        xhat = ne("xc * rstd", xc=xc, rstd=rstd)
        return ne("xhat * gamma + beta", xhat=xhat, gamma=gamma, beta=beta).reshape(x.shape)

    ours = ops.layer_norm_forward_fast(x, gamma, beta, 1e-5)[0]
    same = np.array_equal(ours, with_numexpr())
    worst = float(np.max(np.abs(ours - with_numexpr())))
    ratio = statistics.median(
        timed(with_numexpr, 5) / timed(lambda: ops.layer_norm_forward_fast(x, gamma, beta, 1e-5), 5)
        for _ in range(9))
    print(f"   tfm's layer norm forward (2, 512, 512): NumExpr's passes take {ratio:.2f} of its "
          f"time; {'the same bits' if same else f'not the same bits (up to {worst:.1e} apart)'}")


def main() -> None:
    try:
        from threadpoolctl import threadpool_info
        kernel = [(i["internal_api"], i.get("architecture"), i["num_threads"])
                  for i in threadpool_info() if i["user_api"] == "blas"]
    except ImportError:
        kernel = "unknown"
    print(f"BLAS: {kernel}; NumPy {np.__version__}; {os.cpu_count()} cores")
    blas_control()
    numexpr_passes()
    numexpr_layer_norm()


if __name__ == "__main__":
    main()
