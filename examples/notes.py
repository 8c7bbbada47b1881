"""Printing tfm's numbers beside a seed note's: a mark where they agree, a sentence where the
note is wrong. Shared by the seed_00N.py examples."""

import textwrap

import numpy as np

AGREE, DIFFER = "✓", "≠"


def _short(values, digits=8) -> str:
    values = np.atleast_1d(np.asarray(values, dtype=float)).ravel()
    return "[" + " ".join(f"{v: .{digits}f}" for v in values) + " ]"


def agree(label, ours, note, atol=1e-8, digits=8, theirs="note"):
    """tfm's numbers, the note's (or ``theirs``: a formula, central differences), and ✓ when
    they agree within ``atol``; an AssertionError when they do not."""
    ours, note = np.asarray(ours, dtype=float), np.asarray(note, dtype=float)
    gap = float(np.abs(ours - note).max())
    if gap > atol:
        raise AssertionError(f"{label}: tfm {_short(ours, digits)} but {theirs} "
                             f"{_short(note, digits)} (off by {gap:.2e})")
    print(f"  {AGREE} {label}\n      {'tfm':<{len(theirs)}} {_short(ours, digits)}\n"
          f"      {theirs} {_short(note, digits)}")


def differ(label, ours, note, why, digits=8):
    """The note is wrong here: both numbers, ≠, and why; an AssertionError when the numbers
    shown are the same (a ≠ over equal numbers would show nothing wrong)."""
    if _short(ours, digits) == _short(note, digits):
        raise AssertionError(f"{label}: marked {DIFFER}, but tfm and the note both show "
                             f"{_short(ours, digits)}")
    print(
        f"  {DIFFER} {label}\n      tfm  {_short(ours, digits)}\n      note {_short(note, digits)}"
    )
    print(textwrap.fill(why, width=88, initial_indent="      ", subsequent_indent="      "))


def heading(text):
    print(f"\n{text}")
