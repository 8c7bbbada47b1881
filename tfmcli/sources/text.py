"""Text in: a checkpoint folder's tokenizer (``tokenizer.json``, or ``vocab.json`` +
``merges.txt``), run offline with the ``tokenizers`` package, and token strings a person reads.
"""

from __future__ import annotations

from pathlib import Path

from tfmcli.errors import TfmError
from tfmcli.sources.folder import inside, one_line
from tfmcli.sources.gpt2 import INSTALL, MissingExtra

# GPT-2's byte-level BPE writes a space as "Ġ" and a newline as "Ċ"; tfm shows these instead
VISIBLE = {" ": "␣", "\n": "↵", "\t": "⇥", "\r": "␍"}
METASPACE = "\u2581"   # "▁": SentencePiece's space (LLaMA 1 and 2, TinyLlama, Mistral)


def visible(text: str) -> str:
    """A token's text as it may be printed: spaces and newlines as ``VISIBLE`` symbols, and
    any other character that prints as nothing or moves the cursor (a control character such
    as ESC, a no-break space, a right-to-left override) as Python escapes it (``\\x1b``)."""
    return "".join(VISIBLE.get(c) or (c if c.isprintable() else repr(c)[1:-1]) for c in text)


class Tokenizer:
    """Encode text to ids and show ids as readable strings."""

    def __init__(self, folder):
        try:
            import tokenizers
        except ImportError:
            raise MissingExtra(f"--text needs the tokenizers package: {INSTALL}") from None
        folder = Path(folder)
        whole = inside(folder, "tokenizer.json")   # (each file inside the folder, or refused)
        if whole.is_file():
            self.path = whole
            try:
                self._tok = tokenizers.Tokenizer.from_file(str(self.path))
            except Exception as e:  # the package raises plain Exception for a bad file
                raise TfmError(f"--load {self.path}: not a tokenizer ({one_line(e)})") from None
        elif all(inside(folder, name).is_file() for name in ("vocab.json", "merges.txt")):
            vocab, merges = folder / "vocab.json", folder / "merges.txt"
            self.path = vocab
            try:
                from tokenizers.implementations import ByteLevelBPETokenizer
                self._tok = ByteLevelBPETokenizer(str(vocab), str(merges))
            except Exception as e:
                raise TfmError(f"--load {folder}: vocab.json + merges.txt are not a byte-level "
                               f"BPE tokenizer ({one_line(e)})") from None
        else:
            raise FileNotFoundError(folder)

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text).ids)

    def label(self, token_id: int) -> str:
        """The text of one token, spaces and newlines made visible ('␣cat').

        A token that holds only part of a character's UTF-8 bytes (GPT-2 splits 'é' into
        two tokens in a small vocabulary) shows those bytes as Python writes them, '\\xc3',
        never as the byte-level alphabet's letters ('Ã'), which read as mojibake. A
        SentencePiece token's '▁' is its space, which decoding alone drops at a text's start.
        """
        raw = self._tok.id_to_token(int(token_id))
        if raw is not None and METASPACE in raw:
            return visible(raw.replace(METASPACE, " "))
        text = self._tok.decode([int(token_id)])
        if not text or "\ufffd" in text:
            raw = raw or f"<{token_id}>"
            data = byte_fallback(raw) or byte_level_bytes(raw)
            text = raw if data is None else data.decode("utf-8", errors="backslashreplace")
        return visible(text)


def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-level BPE: the character that stands for each byte, inverted.

    The printable bytes stand for themselves; the other 68 (controls, space, 0x7f-0xa0, 0xad)
    are written as chr(256 + n), in byte order.
    """
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]
    return {chr(b): b for b in printable} | {chr(256 + n): b for n, b in enumerate(others)}


BYTE_OF = _byte_level_alphabet()


def byte_fallback(token: str) -> bytes | None:
    """The byte a SentencePiece byte-fallback token stands for ('<0xC3>' -> b'\\xc3'); None if
    it is not one."""
    if len(token) == 6 and token.startswith("<0x") and token.endswith(">"):
        try:
            return bytes([int(token[3:5], 16)])
        except ValueError:
            return None
    return None


def byte_level_bytes(token: str) -> bytes | None:
    """The bytes a byte-level BPE token stands for ('Ġcat' -> b' cat'); None if it is not one."""
    if not all(c in BYTE_OF for c in token):
        return None
    return bytes(BYTE_OF[c] for c in token)


def find_tokenizer(folder) -> Tokenizer | None:
    """The folder's tokenizer, or None when it has none."""
    try:
        return Tokenizer(folder)
    except FileNotFoundError:
        return None
