"""Central-difference checks as the CLI runs them: how many entries, a progress bar, the verdict."""

from typing import Optional

from rich.text import Text

import tfmcli
from tfmcli import render
from tfmcli.engine import sizes


def default_max_entries(cfg) -> Optional[int]:
    """Check every entry of a small model; sample 32 per tensor of a big one."""
    return None if sizes.param_count(cfg) <= 5000 else 32


def coverage(report, directions=None) -> str:
    """E.g. "checked 352 of 13,000 entries (at most 32 sampled per tensor)", or with
    ``directions``, "checked 21 tensors along 4 random directions each, every entry"."""
    if directions is not None:
        return (f"checked {render.counted(len(report.params), 'tensor')} along "
                f"{render.counted(directions, 'random direction')} each, every entry taking "
                f"part")
    text = f"checked {report.checked:,} of {render.counted(report.entries, 'entry', 'entries')}"
    if report.checked < report.entries:
        most = max(c.checked for c in report.params)
        text += f" (at most {most:,} sampled per tensor; --max-entries changes it)"
    return text


def verdict(report, directions=None) -> Text:
    if report.passed:
        return Text(f"gradcheck passed: worst relative error {report.worst.rel_err:.2e} "
                    f"({report.worst.name}) <= {report.tolerance:g}\n"
                    f"{coverage(report, directions)}", style="bold green")
    return Text(f"gradcheck FAILED for {', '.join(report.failed)} (tolerance "
                f"{report.tolerance:g})\n{coverage(report, directions)}", style="bold red")


def run_gradcheck(params, inputs, cfg, names, max_entries, step, tolerance, directions=None,
                  interventions=(), stream=False):
    """tfmcli.gradcheck (or, with ``directions``, ``gradcheck.directional_check``; ``stream``:
    a block at a time) with a progress bar on a terminal when there is much to do."""
    from tfmcli.check.gradcheck import directional_check

    check = tfmcli.gradcheck
    kwargs = {"names": names, "max_entries": max_entries}
    if directions is not None:
        check, kwargs = directional_check, {"names": names, "directions": directions,
                                            "stream": stream}
    if step is not None:
        kwargs["step"] = step
    if tolerance is not None:
        kwargs["tolerance"] = tolerance
    if interventions:
        kwargs["interventions"] = interventions
    from tfmcli.cli.common import progress_bar

    with progress_bar("central differences") as tick:
        if tick is not None:
            kwargs["progress"] = tick
        return check(params, inputs, cfg, **kwargs)
