"""tfm compare: the same model as Pre-LN and as Post-LN, gradient norms block by block."""

import json

from rich.text import Text

from tfmcli import render
from tfmcli.cli.app import app
from tfmcli.cli.common import describe, emit, execute
from tfmcli.cli.options import MODEL_OPTIONS, OUTPUT_OPTIONS, RUN_OPTIONS, Options, with_options

DEFAULTS = {"batch": 4, "seq_len": 16, "d_model": 32, "heads": 4, "vocab": 32, "layers": 6}
# both positions run: no --norm, and no --sandwich-norm, --parallel-residual or --shared-norm,
# which only Pre-LN has
COMPARE_OPTIONS = [(name, annotation, DEFAULTS.get(name, default))
                   for name, annotation, default in MODEL_OPTIONS
                   if name not in ("norm", "sandwich_norm", "parallel_residual",
                                    "shared_norm", "arch")]
INPUT_OPTIONS = [spec for spec in RUN_OPTIONS if spec[0] in ("tokens", "force")]


@app.command()
@with_options(COMPARE_OPTIONS, INPUT_OPTIONS, OUTPUT_OPTIONS)
def compare(opts: Options = None):
    """Pre-LN against Post-LN: the same seed and sizes, gradient norms per block, side by side.

    Example: tfm compare --layers 6
    """
    from tfmcli.explain.compare import GROUPS, gradient_norms, reading
    from tfmcli.io import run_arrays

    results, arrays = {}, {}
    for norm in ("pre", "post"):
        opts.values["norm"] = norm
        run, fwd, grads = execute(opts, with_grads=True)
        results[norm] = (run, fwd, gradient_norms(grads, run.cfg.layers))
        # --save: both runs, each in the npz layout under its own prefix (pre/param/..., post/...)
        arrays.update({f"{norm}/{key}": value for key, value
                       in run_arrays(run.cfg, run.params, run.inputs, fwd, grads).items()})
    (run, fwd_pre, pre), (_, fwd_post, post) = results["pre"], results["post"]
    keys = (*GROUPS, "resid")
    cells = [[str(a["block"])] + [f"{a[key]:.4f}  {b[key]:.4f}" for key in keys]
             for a, b in zip(pre, post)]
    headers = ["block"] + [f"{name}\n   pre    post" for name in ("attn", "ln", "ffn", "‖dz‖")]
    table = render.record_table(headers, cells, title="L2 norm of the gradients, per block: "
                                                      "Pre-LN, Post-LN")
    table.caption = ("attn, ln, ffn: the block's parameters of that kind; ‖dz‖: d loss / d z, "
                     "the block's output (tfm block's dz)")
    text = reading(pre, post)
    panel = describe(run.cfg.replace(norm="pre"), run)
    panel["norm"] = "Pre-LN and Post-LN, the same weights"
    payload = {"config": json.loads(run.cfg.to_json()), "reading": text,
               "loss": {"pre": fwd_pre.loss, "post": fwd_post.loss},
               "pre": pre, "post": post}
    emit(opts, [render.config_panel(panel, title="tfm compare"), table, Text(text)], payload,
         arrays)
