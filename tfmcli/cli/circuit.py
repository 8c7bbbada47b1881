"""tfm circuit: which edges between the components carry the corrupted run's change (EAP,
EAP-IG), each top edge's real path patch beside its estimate, and the books that balance."""

from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Group
from rich.text import Text

from tfmcli import render
from tfmcli.cli.app import app
from tfmcli.cli.common import (
    FROM_OPTIONS,
    AnswerOption,
    Metric,
    MetricOption,
    StepsOption,
    WrongOption,
    check_metric,
    circuit_errors,
    describe,
    emit,
    execute,
    metric_ids,
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
    with_options,
)
from tfmcli.cli.patch import corrupted_labels


@app.command()
@with_options(MODEL_OPTIONS, WHOLE_RUN_OPTIONS, FROM_OPTIONS, OUTPUT_OPTIONS)
def circuit(
    metric: MetricOption = Metric.loss,
    answer: AnswerOption = None,
    wrong: WrongOption = None,
    steps: StepsOption = 0,
    top: Annotated[int, typer.Option(
        "--top", min=1, max=1000, metavar="K",
        help="Edges drawn and path-patched, the largest first.")] = 8,
    pairs: Annotated[Optional[Path], typer.Option(
        "--pairs", metavar="FILE.jsonl",
        help="Prompt pairs, a JSON line each: the scores their mean.")] = None,
    opts: Options = None,
):
    """Edge attribution patching whose books balance, each top edge beside its real patch.

    Example: tfm circuit --tokens 3,1,4,1,5 --from-tokens 3,1,2,1,5 -L 2
    """
    from tfmcli.explain.circuit import circuit as edges_of
    from tfmcli.explain.circuit import why

    given = [flag for flag, key in (("--tokens", "tokens"), ("--text", "text"),
                                    ("--from-tokens", "from_tokens"),
                                    ("--from-text", "from_text")) if opts.values.get(key)]
    if pairs is not None and given:
        raise typer.BadParameter(f"--pairs gives every clean and corrupted run; drop "
                                 f"{' and '.join(given)}", param_hint="'--pairs'")
    if pairs is None and not (opts.values.get("from_tokens") or opts.values.get("from_text")):
        raise typer.BadParameter("a circuit is what carries a change: add the corrupted run, "
                                 "--from-tokens IDS or --from-text TEXT (or --pairs FILE)",
                                 param_hint="'--from-tokens'")
    if pairs is None:
        check_metric(metric, answer, wrong)
    run, fwd, _ = execute(opts, with_grads=False)
    cfg = run.cfg
    ids = metric_ids(run, answer, wrong)
    if pairs is None:
        corrupted = patch_source(opts, run).inputs
        runs = [(run.inputs, corrupted, *ids)]
    else:
        runs = read_pairs(pairs, run, metric.value, ids)
        corrupted = runs[0][1]
    from tfmcli.engine.parallel import each

    def one(pair, tick=None):
        clean, bad, right, wrong_id = pair
        return edges_of(run.params, clean, bad, cfg, metric.value, right, wrong_id, steps,
                        progress=tick)

    with circuit_errors("'--pairs'" if pairs else "'--from-tokens'"), \
            progress_bar("prompt pairs" if pairs else "EAP-IG's runs") as tick:
        # over prompt pairs, a pair to a core (their mean is the same whatever the order)
        made = each(one, runs, tick) if pairs else [one(runs[0], tick)]
    from tfmcli.explain.circuit import averaged

    c = made[0] if pairs is None else averaged(made)
    order = c.edges()
    shown = order[:top]
    with progress_bar("path patches") as tick:   # a patch to a core
        real = [patch - c.clean for patch in each(lambda edge: c.patched([edge]), shown, tick)]
        curve = c.faithfulness()
    reasons = [why(c, edge, r) for edge, r in zip(shown, real)]
    what = {"loss": "the loss (clean targets)",
            "logit-diff": (f"logit[{ids[0]}] - logit[{ids[1]}] at each row's last position"
                           if all([right, wrong_id] == ids for _, _, right, wrong_id in runs)
                           else "each pair's logit[\"answer\"] - "
                           "logit[\"wrong\"] at its last position")}
    change = c.corrupted - c.clean
    panel = {**describe(cfg, run),
             "corrupted": render.token_line(corrupted_labels(run, corrupted)),
             "metric": f"{what[metric.value]}: clean {c.clean:.6f}, corrupted "
                       f"{c.corrupted:.6f}, change {change:+.6f}"
                       + (f" (the means over {len(runs)} pairs)" if pairs else ""),
             "method": (f"EAP-IG, {steps} steps (midpoints)" if steps else
                        "EAP: the gradient at the clean run"),
             "books": f"every sender's edges add up to its attribution (worst {c.books:.0e})"
                      + (f"; the embedding's edges miss the change by {c.integration:+.2e} "
                         f"(the integration's error)" if steps else "")}
    if pairs is not None:   # the seed's own tokens are none of the pairs'
        panel = {k: v for k, v in panel.items() if not k.startswith(("row ", "tokens"))}
        first = runs[0][0]
        panel["pairs"] = (f"{len(runs)} from {pairs}; the first: "
                          + " ".join(run.token_text(int(t)) for t in first.tokens[0]))
        panel["corrupted"] = render.token_line(corrupted_labels(run, corrupted))
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
    from tfmcli.io import run_arrays

    arrays = {**run_arrays(cfg, run.params, run.inputs, fwd),   # the clean run, the scores
              "circuit/scores": c.scores, "circuit/edges": c.mask}
    emit(opts, parts, payload, arrays)


def read_pairs(path: Path, run, metric: str, ids) -> list:
    """The prompt pairs of a JSON Lines file: each line an object with "clean" and
    "corrupted" (text, with a checkpoint's tokenizer, or a list of ids; the same length), and
    for logit-diff "answer" and "wrong" (an id, or text that is one token; else --answer's and
    --wrong's). A usage error naming the line and what is wrong."""
    import json

    import tfmcli

    if not path.is_file():
        raise typer.BadParameter(f"{path}: no such file", param_hint="'--pairs'")
    made = []
    lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        where = f"{path}:{number}"
        try:
            pair = json.loads(line)
        except json.JSONDecodeError as e:
            raise typer.BadParameter(f"{where}: not JSON ({e.msg})", param_hint="'--pairs'")
        if not isinstance(pair, dict) or not {"clean", "corrupted"} <= pair.keys():
            raise typer.BadParameter(f"{where}: a pair is an object with \"clean\" and "
                                     f"\"corrupted\"", param_hint="'--pairs'")
        rows = [ids_of(pair[key], run, f"{where}: {key!r}") for key in ("clean", "corrupted")]
        if len(rows[0]) != len(rows[1]):
            raise typer.BadParameter(f"{where}: clean is {len(rows[0])} tokens, corrupted "
                                     f"{len(rows[1])}; a pair's runs have one length",
                                     param_hint="'--pairs'")
        right, wrong = (token_id(run, None if pair.get(key) is None else str(pair[key]),
                                 f"--pairs {where} {key!r}") if key in pair else default
                        for key, default in (("answer", ids[0]), ("wrong", ids[1])))
        if metric == "logit-diff" and (right is None or wrong is None):
            raise typer.BadParameter(f"{where}: a logit difference needs \"answer\" and "
                                     f"\"wrong\" (or --answer and --wrong)",
                                     param_hint="'--pairs'")
        made.append((tfmcli.inputs_from_tokens([rows[0]]),
                     tfmcli.inputs_from_tokens([rows[1]]), right, wrong))
    if not made:
        raise typer.BadParameter(f"{path}: no pairs in it", param_hint="'--pairs'")
    return made


def ids_of(value, run, where: str) -> list[int]:
    """A run's tokens from a pair: a list of ids in the vocabulary, or text."""
    if isinstance(value, str):
        if run.encode is None:
            raise typer.BadParameter(f"{where}: text needs --load DIR's tokenizer; give ids",
                                     param_hint="'--pairs'")
        ids = run.encode(value)
    elif isinstance(value, list) and all(isinstance(i, int) and not isinstance(i, bool)
                                         for i in value):
        ids = value
    else:
        raise typer.BadParameter(f"{where}: text or a list of token ids",
                                 param_hint="'--pairs'")
    if not ids or not all(0 <= i < run.cfg.vocab for i in ids):
        raise typer.BadParameter(f"{where}: ids in 0..{run.cfg.vocab - 1}, at least one",
                                 param_hint="'--pairs'")
    return list(ids)


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
    headers = ["edge", "estimate", "real", "est. - real", "why they differ"]
    table = render.record_table(headers, rows, title="the top edges: EAP's estimate and the "
                                                     "real path patch (only that edge's reader "
                                                     "sees the corrupted sender)")
    for column, header, cells in zip(table.columns, headers, zip(*rows)):
        column.min_width = max(map(len, [header, *cells]))   # the numbers never cut
    table.columns[-1].min_width = None   # the reasons fold into the width that is left
    table.columns[-1].justify, table.columns[-1].no_wrap = "left", False
    return table
