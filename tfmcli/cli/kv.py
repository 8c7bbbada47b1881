"""tfm kv: decode one token at a time with a KV cache, checked against the full forward."""

from typing import Annotated

import numpy as np
import typer
from rich.text import Text

from tfmcli import render
from tfmcli.cli.app import app
from tfmcli.cli.common import (
    Full,
    Precision,
    Row,
    check_indices,
    describe,
    emit,
    execute,
    interventions,
    rows_limit,
    width,
)
from tfmcli.cli.options import (
    INTERVENE_OPTIONS,
    MODEL_OPTIONS,
    OUTPUT_OPTIONS,
    WHOLE_RUN_OPTIONS,
    Options,
    binary_size,
    bounded,
    with_options,
)
from tfmcli.cli.shapes import human


@app.command()
@with_options(MODEL_OPTIONS, WHOLE_RUN_OPTIONS, INTERVENE_OPTIONS, OUTPUT_OPTIONS)
def kv(
    row: Row = 0,
    block: Annotated[int, typer.Option(
        "--block", callback=bounded(0), help="Block whose attention rows are drawn.")] = 0,
    head: Annotated[int, typer.Option(
        "--head", callback=bounded(0), help="Head whose attention rows are drawn.")] = 0,
    generate: Annotated[int, typer.Option(
        "--generate", callback=bounded(0, 1000),
        help="Then generate N tokens more, each the most likely next one (greedy), with the same "
             "cache.")] = 0,
    precision: Precision = 2,
    full: Full = False,
    opts: Options = None,
):
    """Decode batch row --row one token at a time with a KV cache; each step against the full pass.

    Example: tfm kv --tokens 3,1,4,1,5,9,2,6 -L 2
    """
    import tfmcli
    from tfmcli.engine.kv import cache_slots, chosen_probabilities, decode
    from tfmcli.engine.masks import causal_mask, sliding_window_mask
    from tfmcli.io import run_arrays

    def validate(cfg):
        check_indices(cfg, row, head, block)
        if not cfg.causal:
            raise typer.BadParameter("a KV cache decodes left to right, so the model must be "
                                     "causal; drop --no-causal", param_hint="'--causal'")
        given = cfg.lengths[row] if cfg.lengths else cfg.seq_len
        if cfg.pe == "learned" and given + generate > cfg.ctx:
            raise typer.BadParameter(
                f"row {row} has {given} tokens and the model {cfg.ctx} learned positions "
                f"(n_ctx); allowed: 0..{cfg.ctx - given}", param_hint="'--generate'")

    run, fwd, _ = execute(opts, with_grads=False, validate=validate, intervene=False,
                          whole="keeps every block's keys and values (its cache) and checks each "
                                "step against the whole pass")
    cfg = run.cfg
    given = int(run.inputs.lengths[row])
    prompt = run.inputs.tokens[row, :given]
    pairs = interventions(opts, run)   # (the run's own: execute made none)
    changes = [change for _, change in pairs]
    plan = row_plan(pairs, run, prompt, generate)
    steps = decode(run.params, prompt, cfg, generate=generate, plan=plan)
    length = len(steps)
    ids = [s.token for s in steps]
    if generate or changes:   # the full forward of the row (and the generated tokens)
        whole = tfmcli.forward(run.params, tfmcli.inputs_from_tokens(ids),
                               cfg.replace(batch=1, seq_len=length, lengths=None),
                               interventions=changes)
        full_logits = whole.acts["logits"][0]
    else:
        full_logits = fwd.acts["logits"][row]
    diffs = [float(np.abs(s.logits - full_logits[s.step]).max()) for s in steps]
    cached, uncached = sum(s.flops_cached for s in steps), sum(s.flops_full for s in steps)
    texts = [run.token_text(i) for i in ids]
    marked = texts[:given] + [f"→ {text}" for text in texts[given:]]

    headers = ["step", "token", "K, V cache", "max |Δ logits|", "FLOPs cached", "no cache"]
    cells = [[str(s.step), marked[s.step], str(s.cache_shape), f"{d:.1e}", f"{s.flops_cached:,}",
              f"{s.flops_full:,}"] for s, d in zip(steps, diffs)]
    if generate:   # (without it the table is as it always was)
        # each token's probability after the step before (its softmax); none for the first
        chance = chosen_probabilities(steps)
        headers.insert(2, "p")
        for t, row_cells in enumerate(cells):
            row_cells.insert(2, "—" if chance[t] is None else f"{chance[t]:.2f}")
    table = render.record_table(headers, cells, title=f"decoding batch row {row}, one token "
                                f"per step", max_rows=rows_limit(full), left=2)
    window = cfg.window(block)   # the drawn block's; None where it sees every earlier key
    some = cfg.sliding_layers is not None   # only some blocks slide: the others keep every key
    kept = ("step + 1" if cfg.sliding_window is None or some
            else f"min(step + 1, {cfg.sliding_window})")
    table.caption = (f"K, V cache: {'the widest' if some else 'each'} block's cached keys and "
                     f"values, ({'H_kv' if cfg.group > 1 else 'H'}, {kept}, d_head)")
    if generate:
        table.caption = (f"p: the token's probability after the step before\n{table.caption}\n"
                         f"→: generated, the most likely token after the step before "
                         f"(greedy), then decoded as the next step")
    rows = np.zeros((length, length))
    for s in steps:
        rows[s.step, :s.step + 1] = s.attention[(block, head)]
    attention = render.heatmap(
        rows, title=f"block {block} head {head}: the new query's attention, one row per step",
        row_labels=[f"q{t}:{text}" for t, text in enumerate(texts)],
        col_labels=[f"k{t}:{text}" for t, text in enumerate(texts)],
        mask=causal_mask(length) if window is None else sliding_window_mask(length, window),
        width=width(), vmin=0.0, vmax=1.0, precision=precision)
    worst = max(diffs)
    forward = "the full causal forward" + (f" of the {given} given and {generate} generated "
                                           f"tokens" if generate else "")
    summary = Text(f"every step equals {forward}: max |Δ logits| {worst:.1e}; "
                   f"matmul FLOPs for {render.counted(length, 'token')}: {human(cached)} with "
                   f"the cache, {human(uncached)} recomputing each prefix "
                   f"({uncached / cached:.1f}x)",
                   style="bold")
    slots = [cache_slots(cfg, length, i) for i in range(cfg.layers)]   # each block's, at the end
    numbers = 2 * sum(slots) * cfg.h_kv * cfg.d_head   # K and V of every block
    sizes = {C: slots.count(C) for C in slots}
    blocks = " + ".join(f"{render.counted(n, 'block')} x {(cfg.h_kv, C, cfg.d_head)}"
                        for C, n in sizes.items())
    memory = (f"K, V cache after {render.counted(length, 'step')}: 2 x "
              f"{blocks if len(sizes) == 1 else f'({blocks})'} = {numbers:,} numbers "
              f"({binary_size(numbers * cfg.np_dtype.itemsize)})")
    if some:
        sliding = ", ".join(map(str, cfg.sliding_layers)) or "none"
        memory += (f"\nsliding window {cfg.sliding_window} in blocks {sliding} only: each of "
                   f"those keeps the last {cfg.sliding_window} positions (a rolling buffer), "
                   f"the others every one")
    elif window is not None and window < length:
        memory += (f"\nsliding window {window}: the cache keeps the last {window} positions in "
                   f"{window} slots, position t in slot t mod {window} (a rolling buffer)")
    elif window is not None:
        memory += (f"\nsliding window {window}: as long as the {length} positions or longer, "
                   f"so the cache keeps every one")
    if cfg.group > 1:
        memory += (f"\ngrouped: {render.counted(cfg.h_kv, 'key and value head')} for "
                   f"{cfg.heads} query heads, {cfg.group}x smaller than ungrouped")
    if cfg.pe == "rope":
        memory += "\nRoPE: each key is cached turned at its own position, and never turned again"
    payload = {"row": row, "tokens": [s.token for s in steps],
               "steps": [{"step": s.step, "token": s.token, "cache_len": s.cache_shape[1],
                          "cache_shape": list(s.cache_shape), "max_abs_diff": d,
                          "flops_cached": s.flops_cached, "flops_full": s.flops_full,
                          "attention": s.attention[(block, head)].tolist()}
                         for s, d in zip(steps, diffs)],
               "flops": {"with_cache": cached, "without_cache": uncached},
               "max_abs_diff": worst, "cache_numbers": numbers}
    parts = [render.config_panel(describe(cfg, run, row), title="tfm kv"), table, attention,
             summary, Text(memory)]
    if generate:
        payload["generated"] = ids[given:]
        payload["generated_probability"] = chance[given:]
        parts.insert(2, Text(f"generated (greedy): {' '.join(texts[given:])}", style="bold"))
    if changes:   # the changed row's whole forward: what the steps equal
        saved = run_arrays(whole.caches["cfg"], run.params, whole.inputs, whole)
    else:
        saved = run_arrays(cfg, run.params, run.inputs, fwd)
    emit(opts, parts, payload, saved)


def row_plan(pairs, run, prompt, generate):
    """The interventions of one row of all the decoded positions, as ``decode`` takes them;
    a mean ablation's means are the whole row's (its forward first), so not with --generate,
    whose tokens are not known before the decoding."""
    if not pairs:
        return None
    import tfmcli
    from tfmcli.cli.common import target_error
    from tfmcli.engine.interventions import Ablate, InterventionError
    from tfmcli.engine.model import plan_for, unchecked_forward

    changes = [change for _, change in pairs]
    if generate and any(isinstance(c, Ablate) and c.using == "mean" for c in changes):
        raise typer.BadParameter("a mean is over the whole run, and with --generate its tokens "
                                 "are not known before decoding; ablate with zero, or drop "
                                 "--generate", param_hint="'--ablate-with'")
    T = len(prompt) + generate
    cfg = run.cfg.replace(batch=1, seq_len=T, lengths=None)
    inputs = tfmcli.inputs_from_tokens([list(prompt) + [0] * generate])
    try:
        plan = plan_for(changes, cfg, inputs)
        if not generate:   # the means (and every check of the patches) from the whole row
            unchecked_forward(run.params, inputs, cfg, plan=plan)
    except InterventionError as e:
        raise target_error(e, pairs, " (tfm kv decodes one row: its targets are a one-row "
                                     "run's)") from None
    return plan
