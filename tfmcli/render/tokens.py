"""Tokens as a person reads them: a row of ids or strings, elided when long."""

from __future__ import annotations

ELLIPSIS = "…"


def token_line(labels, limit: int = 24) -> str:
    """'3 1 4 1 5'; beyond ``limit`` tokens, the first and last ones around '… (N more) …'."""
    labels = list(labels)
    if len(labels) <= limit:
        return " ".join(labels)
    head, tail = labels[:limit - 6], labels[-4:]
    return " ".join(head) + f" {ELLIPSIS} ({len(labels) - len(head) - len(tail)} more) " \
        f"{ELLIPSIS} " + " ".join(tail)
