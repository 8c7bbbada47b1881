"""tfm shapes: every tensor's shape, parameter counts, FLOPs and memory, from the config alone."""

import json

from tfmcli import render
from tfmcli.cli.app import app
from tfmcli.cli.common import Full, describe, emit, rows_limit
from tfmcli.cli.options import MODEL_OPTIONS, OUTPUT_OPTIONS, Options, binary_size, with_options
from tfmcli.engine import sizes


def human(n: float, unit: str = "") -> str:
    for suffix in ("", "K", "M", "G", "T", "P"):
        if round(abs(n), 1) < 1000:   # 999,999 is 1 M, not 1,000 K
            return f"{n:,.1f} {suffix}{unit}".replace(".0 ", " ").rstrip()
        n /= 1000
    return f"{n:,.1f} E{unit}"


@app.command()
@with_options(MODEL_OPTIONS, [spec for spec in OUTPUT_OPTIONS if spec[0] != "save"])
def shapes(full: Full = False, opts: Options = None):
    """Every tensor's shape, parameter counts, FLOPs and memory, without allocating anything.

    Example: tfm shapes -d 768 -H 12 -T 1024 -V 50257
    """
    cfg = opts.config()
    pshapes, ashapes = sizes.param_shapes(cfg), sizes.activation_shapes(cfg)
    fwd_flops, bwd_flops = sizes.flops(cfg)
    memory = sizes.memory_estimate(cfg)
    streamed, lazily = sizes.streamed_estimate(cfg), sizes.streamed_estimate(cfg, lazy=True)
    groups = sizes.param_groups(cfg)
    rows = {"parameters": f"{sizes.param_count(cfg):,}  (" + ", ".join(
                f"{g} {n:,}" for g, n in groups.items()) + ")",
            "FLOPs": f"forward {human(fwd_flops)}, backward {human(bwd_flops)} (matmuls, "
                     f"attention included)",
            "memory": f"{binary_size(memory['total'])} peak forward + backward (activations "
                      f"{binary_size(memory['activations'])})",
            "streamed": f"{binary_size(streamed['total'])} a block at a time (--stream), "
                        f"{binary_size(lazily['total'])} with a checkpoint's weights read as "
                        f"used"}
    parts = [
        render.config_panel({**describe(cfg, arch=opts.arch), **rows}, title="tfm shapes"),
        render.shape_list(pshapes, title="parameters", max_rows=rows_limit(full)),
        render.shape_list(ashapes, title="activations (forward order)", max_rows=rows_limit(full)),
    ]
    payload = {"config": json.loads(cfg.to_json()),
               "params": {n: list(s) for n, s in pshapes.items()},
               "activations": {n: list(s) for n, s in ashapes.items()},
               "param_groups": dict(groups), "param_count": sizes.param_count(cfg),
               "flops": {"forward": fwd_flops, "backward": bwd_flops}, "memory": memory,
               "memory_streamed": {"weights_in_memory": streamed,
                                   "weights_read_as_used": lazily}}
    emit(opts, parts, payload)
