"""How a command runs a block at a time (docs/streaming.md): whether it does
(``choose_stream``, the memory guard's other answer), what it keeps whole (``needs``,
``block_tensors``), what becomes of what it drops (``streamed_sink``: summarised, and written
to --save as it goes) and its progress (``blocks_bar``). ``common.execute`` puts them
together."""

from __future__ import annotations

from contextlib import contextmanager

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


def choose_stream(opts: Options, run, kept, held=(), also: str = "", why: str = ""):
    """Whether the run goes a block at a time: --stream, --no-stream, or (neither given) when
    the whole run does not fit in the memory available and the streamed one does, keeping
    the activations ``kept`` and the gradients of the parameters ``held``. The run's panel
    then says so (``run.streamed``), and this returns the streamed estimate in bytes (None:
    the whole run). A command that reads every activation (``kept`` None:
    ``why`` says why) cannot; a run that fits neither way is refused before anything is
    allocated, unless --force."""
    from tfmcli.cli.options import available_memory, binary_size, check_memory
    from tfmcli.engine.sizes import memory_estimate, streamed_estimate

    cfg, wanted, force = run.cfg, opts.values.get("stream"), opts.values.get("force", False)
    can = kept is not None
    command = opts.ctx.command.name if opts.ctx is not None else "this command"
    if wanted and not can:
        raise typer.BadParameter(f"tfm {command} {why}; run it without --stream",
                                 param_hint="'--stream'")
    whole, have = memory_estimate(cfg)["total"], available_memory()
    light = streamed_estimate(cfg, run.lazy_params is not None, kept or (), held)["total"]
    if wanted is None:
        wanted = can and not force and whole > have and light <= have
    if not wanted:
        if not force:
            way = (f", or stream it a block at a time (--stream: about {binary_size(light)})"
                   if can and light < whole else "")
            check_memory(cfg, also=also + way)
        return None
    if light > have and not force:
        raise typer.BadParameter(
            f"even a block at a time this run needs about {binary_size(light)} (see tfm "
            f"shapes), more than the {binary_size(have)} available; shrink --batch, --seq-len "
            f"or --vocab, or pass --force", param_hint="'--stream'")
    weights = "weights read as used" if run.lazy_params is not None else "weights in memory"
    run.streamed = (f"a block at a time (--stream): about {binary_size(light)}, {weights}; the "
                    f"whole run: {binary_size(whole)}" if opts.values.get("stream") else
                    f"a block at a time, as the whole run ({binary_size(whole)}) exceeds the "
                    f"{binary_size(have)} available: about {binary_size(light)}, {weights}")
    return light


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


@contextmanager
def blocks_bar(cfg, estimate: int | None, with_grads: bool, seen):
    """A streamed run's progress, a block at a time, forward then backward (on a terminal),
    told by what it drops: ``seen`` wrapped to tick it. Its label gives the run's ``estimate``
    (bytes), before any work."""
    from tfmcli.cli.options import binary_size

    if estimate is None:
        yield seen
        return
    total = cfg.layers * (2 if with_grads else 1)
    from tfmcli.cli.common import progress_bar

    label = f"a block at a time, about {binary_size(estimate)}" + (
        ": forward then backward" if with_grads else "")
    with progress_bar(label) as tick:
        if tick is None:
            yield seen
            return
        done = [0]

        def ticking(kind, name, arrays):
            if name.startswith("blocks."):
                i = int(name.split(".")[1])
                now = i + 1 if kind == "act" else cfg.layers + cfg.layers - i
                if now > done[0]:
                    done[0] = now
                    tick(now, total)
            return seen(kind, name, arrays)
        yield ticking
