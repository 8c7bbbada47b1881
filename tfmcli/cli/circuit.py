"""tfm circuit: which edges between the components carry the corrupted run's change (EAP,
EAP-IG), each top edge's real path patch beside its estimate, and the books that balance."""

from typing import Annotated, Optional

import typer
from rich.console import Group
from rich.text import Text

from tfmcli import render
from tfmcli.cli.app import app
from tfmcli.cli.common import (
    describe,
    emit,
    execute,
    patch_source,
    progress_bar,
    token_id,
    width,
)
from tfmcli.cli.options import (
    MODEL_OPTIONS,
    OUTPUT_OPTIONS,
    WHOLE_RUN_OPTIONS,
    Options,
    from_options,
    with_options,
)
from tfmcli.cli.patch import Metric, corrupted_labels

FROM_OPTIONS = from_options(panel=None)   # the corrupted run: this command's own options


@app.command()
@with_options(MODEL_OPTIONS, WHOLE_RUN_OPTIONS, FROM_OPTIONS, OUTPUT_OPTIONS)
def circuit(
    metric: Annotated[Metric, typer.Option(
        "--metric", case_sensitive=False, metavar="METRIC", show_default=False,
        help="loss (the default), or logit-diff: --answer's minus --wrong's.")
    ] = Metric.loss,
    answer: Annotated[Optional[str], typer.Option(
        "--answer", metavar="ID|TEXT", help="logit-diff's right next token.")] = None,
    wrong: Annotated[Optional[str], typer.Option(
        "--wrong", metavar="ID|TEXT", help="logit-diff's wrong next token.")] = None,
    steps: Annotated[int, typer.Option(
        "--steps", min=0, max=1000, metavar="N",
        help="EAP-IG over N points from clean to corrupted (0: EAP).")] = 0,
    top: Annotated[int, typer.Option(
        "--top", min=1, max=1000, metavar="K",
        help="Edges drawn and path-patched, the largest first.")] = 8,
    opts: Options = None,
):
    """Edge attribution patching whose books balance, each top edge beside its real patch.

    Example: tfm circuit --tokens 3,1,4,1,5 --from-tokens 3,1,2,1,5 -L 2
    """
    from tfmcli.engine.interventions import InterventionError
    from tfmcli.errors import TfmError
    from tfmcli.explain.circuit import circuit as edges_of
    from tfmcli.explain.circuit import why

    if not (opts.values.get("from_tokens") or opts.values.get("from_text")):
        raise typer.BadParameter("a circuit is what carries a change: add the corrupted run, "
                                 "--from-tokens IDS or --from-text TEXT",
                                 param_hint="'--from-tokens'")
    if metric == Metric.logit_diff and (answer is None or wrong is None):
        raise typer.BadParameter("a logit difference needs --answer and --wrong (ids, or text "
                                 "with --load DIR)", param_hint="'--metric'")
    run, fwd, _ = execute(opts, with_grads=False)
    cfg = run.cfg
    corrupted = patch_source(opts, run).inputs
    ids = [token_id(run, value, flag) for value, flag in ((answer, "--answer"),
                                                          (wrong, "--wrong"))]
    try:
        with progress_bar("EAP-IG's runs") as tick:
            c = edges_of(run.params, run.inputs, corrupted, cfg, metric.value, *ids, steps,
                         progress=tick)
    except InterventionError as e:
        raise typer.BadParameter(str(e), param_hint="'--from-tokens'") from None
    except TfmError as e:
        if "Post-LN" in str(e):
            raise typer.BadParameter(str(e), param_hint="'--norm'") from None
        raise
    order = c.edges()
    shown = order[:top]
    with progress_bar("path patches") as tick:
        real = []
        for k, edge in enumerate(shown):
            real.append(c.patched([edge]) - c.clean)
            if tick is not None:
                tick(k + 1, len(shown))
        curve = c.faithfulness()
    reasons = [why(c, edge, r) for edge, r in zip(shown, real)]
    what = {"loss": "the loss (clean targets)",
            "logit-diff": f"logit[{ids[0]}] - logit[{ids[1]}] at each row's last position"}
    change = c.corrupted - c.clean
    panel = {**describe(cfg, run),
             "corrupted": render.token_line(corrupted_labels(run, corrupted)),
             "metric": f"{what[metric.value]}: clean {c.clean:.6f}, corrupted "
                       f"{c.corrupted:.6f}, change {change:+.6f}",
             "method": (f"EAP-IG, {steps} steps (midpoints)" if steps else
                        "EAP: the gradient at the clean run"),
             "books": f"every sender's edges add up to its attribution (worst {c.books:.0e})"
                      + (f"; the embedding's edges miss the change by {c.integration:+.2e} "
                         f"(the integration's error)" if steps else "")}
    parts = [render.config_panel(panel, title="tfm circuit"),
             drawing(c, shown), edge_table(c, shown, real, reasons),
             render.curve([str(k) for k, _ in curve], [share for _, share in curve],
                          title="faithfulness: the share of the change the top k edges carry "
                                "(k = 1, 2, 4, ... every edge)", width=width(), height=5)]
    payload = {"metric": metric.value, "method": c.method, "steps": steps,
               "clean": c.clean, "corrupted": c.corrupted, "books": c.books,
               "integration_error": c.integration,
               "senders": [s.name for s in c.senders], "readers": [r.name for r in c.readers],
               "edges": [{"from": c.senders[u].name, "to": c.readers[v].name,
                          "score": float(c.scores[u, v])} for u, v in order],
               "top": [{"from": c.senders[u].name, "to": c.readers[v].name,
                        "estimate": float(c.scores[u, v]), "real": r, "why": reason}
                       for (u, v), r, reason in zip(shown, real, reasons)],
               "node_scores": dict(zip([s.name for s in c.senders],
                                       map(float, c.node_scores))),
               "faithfulness": [{"k": k, "share": share} for k, share in curve]}
    emit(opts, parts, payload)


def drawing(c, shown) -> Group:
    """The top edges block by block, under the block whose component reads them: the
    sender, the path (q, k or v into a head), the reader, the score (blue +, red -)."""
    lines = []
    by_block: dict[int, list] = {}
    for u, v in shown:
        by_block.setdefault(c.readers[v].block, []).append((u, v))
    L = c.context["cfg"].layers
    for block in sorted(by_block):
        label = "logits" if block == L else f"block {block}"
        for k, (u, v) in enumerate(by_block[block]):
            reader = c.readers[v]
            path = reader.kind if reader.kind in ("q", "k", "v") else "─"
            into = reader.name.rsplit(".", 1)[0] if reader.kind in ("q", "k", "v") else \
                reader.name
            score = float(c.scores[u, v])
            line = Text(f"{label if k == 0 else '':<9}{c.senders[u].name:>7} ─{path}─▶ "
                        f"{into:<8}")
            line.append(f"{score:+.4g}", style="blue" if score > 0 else "red")
            lines.append(line)
    return Group(Text(f"the top {len(shown)} of {int(c.mask.sum())} edges, under the block "
                      f"that reads them (q, k, v: into a head's queries, keys, values)",
                      style="bold"), *lines)


def edge_table(c, shown, real, reasons):
    rows = [[c.name(edge), f"{c.scores[edge]:+.4f}", f"{r:+.4f}",
             f"{c.scores[edge] - r:+.4f}", reason]
            for edge, r, reason in zip(shown, real, reasons)]
    table = render.record_table(["edge", "estimate", "real", "est. - real", "why they differ"],
                                rows, title="the top edges: EAP's estimate and the real path "
                                            "patch (only that edge's reader sees the "
                                            "corrupted sender)")
    return table
