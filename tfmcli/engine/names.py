"""Tensor names a mistyped one is close to: what `--show` and `--ablate` suggest."""

import difflib


def close_names(name: str, known, n: int = 4) -> list:
    """Up to ``n`` of ``known`` that ``name`` may have meant: those with a dotted tail that
    begins with it ('scores' finds blocks.0.attn.scores, 'w_q' blocks.0.attn.W_Q), then those
    spelt alike ('pattrn' finds pattern)."""
    known = list(known)
    close = [*tails_beginning(name, known), *difflib.get_close_matches(name, known, n=n,
                                                                        cutoff=0.5)]
    return list(dict.fromkeys(close))[:n]


def tails_beginning(name: str, known) -> list:
    """Names one of whose dotted tails begins with ``name``, in any case: 'scores' and 'attn.sc'
    find blocks.0.attn.scores, 'w_q' finds blocks.0.attn.W_Q. Under three letters, none."""
    if len(name) < 3:
        return []
    name = name.lower()
    return [k for k in known if any(tail.startswith(name) for tail in _tails(k.lower()))]


def _tails(name: str) -> list:
    """'blocks.0.attn.q' -> itself, '0.attn.q', 'attn.q', 'q'."""
    parts = name.split(".")
    return [".".join(parts[i:]) for i in range(len(parts))]
