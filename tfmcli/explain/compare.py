"""Pre-LN against Post-LN at initialisation: the gradient norm of each part of each block.

The question of seed 000 and of Xiong et al. 2020, "On Layer Normalization in the Transformer
Architecture": with Post-LN, the gradients of the parameters near the output are large at
initialisation (hence its need for a learning-rate warm-up); with Pre-LN they are not.
"""

from __future__ import annotations

import numpy as np

from tfmcli.engine.model import Gradients

GROUPS = ("attn", "ln", "ffn")


def _norm(arrays) -> float:
    return float(np.sqrt(sum(float((np.asarray(a, dtype=np.float64) ** 2).sum()) for a in arrays)))


def gradient_norms(grads: Gradients, layers: int) -> list[dict]:
    """Per block: the L2 norm of the gradients of its attention, layer-norm and FFN parameters,
    and of the residual stream leaving it (d loss / d ``blocks.{i}.out``)."""
    rows = []
    for i in range(layers):
        p = f"blocks.{i}."
        row = {"block": i}
        for group in GROUPS:
            names = [n for n in grads if n.startswith(p) and n.split(".")[2].rstrip("12") == group]
            row[group] = _norm(grads[n] for n in names)
        row["resid"] = _norm([grads.acts[p + "out"]])
        rows.append(row)
    return rows


def reading(pre: list[dict], post: list[dict]) -> str:
    """A plain-language reading of the two columns that says only what their numbers show."""
    last = len(pre) - 1
    if last == 0:
        return ("One block: nothing to compare from block to block; with -L 2 or more, the "
                "table shows how each norm's gradients change with depth.")

    def growth(rows):   # the last block's FFN gradient over the first block's
        return rows[-1]["ffn"] / rows[0]["ffn"] if rows[0]["ffn"] else float("inf")

    def peak(rows):   # the block whose FFN gradient is largest
        return max(range(len(rows)), key=lambda i: rows[i]["ffn"])

    g_pre, g_post = growth(pre), growth(post)
    text = (f"The FFN weights' gradient norm is largest at block {peak(pre)} in Pre-LN and at "
            f"block {peak(post)} in Post-LN; from block 0 to block {last} it changes by "
            f"x{g_pre:.2f} in Pre-LN and by x{g_post:.2f} in Post-LN. ")
    if peak(post) == last and g_post > max(g_pre, 1):
        text += ("As Xiong et al. (2020) show, Post-LN's gradients are largest near the output "
                 "at initialisation, which is why Post-LN needs a learning-rate warm-up"
                 + ("; Pre-LN's do not grow with depth, so it trains without one."
                    if g_pre <= 1 else "."))
    else:
        text += ("These numbers do not show what Xiong et al. (2020) describe, Post-LN's "
                 "gradients largest at the output block; it shows with more blocks at "
                 "initialisations of unit-scale activations (try -L 12 --init xavier).")
    return text
