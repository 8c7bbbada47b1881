"""How a command runs a block at a time (docs/streaming.md): whether it does
(``choose_stream``, the memory guard's other answer), what it keeps whole (``needs``,
``block_tensors``), what becomes of what it drops (``streamed_sink``: summarised, and written
to --save as it goes). ``common.execute`` puts them together."""

from __future__ import annotations

import typer

from tfmcli.cli.options import Options
from tfmcli.engine import sizes


def block_tensors(cfg, block: int | None) -> set:
    """Every activation and parameter of block ``block`` (none for None): what a view of one
    block reads whole when it streams (the rest it leaves to summaries)."""
    if block is None:
        return set()
    p = f"blocks.{block}."
    return {n for n in [*sizes.activation_shapes(cfg), *sizes.param_shapes(cfg)]
            if n.startswith(p)}


def needs(names) -> set:
    """The activations a streamed run must keep to show ``names``: a pattern's statistics
    leave out what its scores hide, so its scores too."""
    names = set(names)
    return names | {n.removesuffix("pattern") + "scores" for n in names
                    if n.endswith("attn.pattern")}


def choose_stream(opts: Options, run, keep=None, held=None, also: str = "", why: str = ""):
    """Whether the run goes a block at a time: --stream, --no-stream, or (neither given) when
    the whole run does not fit in the memory available and the streamed one does. A command
    that can stream says what it keeps whole: the activations ``keep(run)`` and the gradients
    of the parameters ``held(run)``; one that reads every activation (``keep`` None) cannot,
    and ``why`` says why. A run that fits neither way is refused before anything is
    allocated (what it keeps is asked only once a bare streamed run fits), unless --force.

    Streamed, the run's panel says so (``run.streamed``) and this returns (its estimate in
    bytes, the activations it keeps, the parameters whose gradients it keeps); else None."""
    from tfmcli.cli.options import available_memory, binary_size, check_memory
    from tfmcli.engine.sizes import memory_estimate, streamed_estimate

    cfg, wanted, force = run.cfg, opts.values.get("stream"), opts.values.get("force", False)
    can, lazy = keep is not None, run.lazy_params is not None
    command = opts.ctx.command.name if opts.ctx is not None else "this command"
    if wanted and not can:
        raise typer.BadParameter(f"tfm {command} {why}; run it without --stream",
                                 param_hint="'--stream'")
    whole, have = memory_estimate(cfg)["total"], available_memory()
    bare = streamed_estimate(cfg, lazy)["total"]   # (what a view keeps comes on top)
    if wanted is None:
        wanted = can and not force and whole > have and bare <= have
    if not wanted:
        if not force:
            way = (f", or stream it a block at a time (--stream: about {binary_size(bare)})"
                   if can and bare < whole else "")
            check_memory(cfg, also=also + way, opts=opts)
        return None

    def refuse_past(need: int) -> None:
        if need > have and not force:
            raise typer.BadParameter(
                f"even a block at a time this run needs about {binary_size(need)} (see tfm "
                f"shapes), more than the {binary_size(have)} available; shrink --batch, "
                f"--seq-len or --vocab, or pass --force", param_hint="'--stream'")

    refuse_past(bare)   # before the tokens are made and the view asked what it keeps
    if run.inputs is None:   # (a view labels the maps it keeps with them)
        import tfmcli

        run.inputs = tfmcli.make_inputs(cfg)
    kept, holding = needs(keep(run)), set(held(run)) if held else set()
    light = streamed_estimate(cfg, lazy, kept, holding)["total"]
    refuse_past(light)
    weights = "weights read as used" if lazy else "weights in memory"
    run.streamed = (f"a block at a time (--stream): about {binary_size(light)}, {weights}; the "
                    f"whole run: {binary_size(whole)}" if opts.values.get("stream") else
                    f"a block at a time, as the whole run ({binary_size(whole)}) exceeds the "
                    f"{binary_size(have)} available: about {binary_size(light)}, {weights}")
    return light, kept, holding


def streamed_sink(opts: Options, run):
    """What a streamed run does with each array it drops (``model.forward``'s ``seen``):
    writes it to --save's file as it goes (``io.NpzStream``, abandoned if the command fails),
    and keeps its summary in its place."""
    from tfmcli.explain.summary import Summary
    from tfmcli.io import NpzStream

    path = opts.values.get("save")
    if path is not None:
        opts.saving = NpzStream(path)
        opts.ctx.call_on_close(opts.saving.abandon)   # a run that fails leaves no file

    def seen(kind, name, arrays):
        if opts.saving is not None:
            opts.saving.add(f"{kind}/{name}", arrays[name])
        return Summary.of(kind, name, arrays)
    return seen
