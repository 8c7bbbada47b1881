"""Text in: a checkpoint folder's tokenizer (``tokenizer.json``, or ``vocab.json`` +
``merges.txt``), run offline with the ``tokenizers`` package, and token strings a person reads.
"""

from __future__ import annotations

from pathlib import Path

from tfmcli.errors import TfmError
from tfmcli.sources.gpt2 import INSTALL, MissingExtra

# GPT-2's byte-level BPE writes a space as "Ġ" and a newline as "Ċ"; tfm shows these instead
VISIBLE = {" ": "␣", "\n": "↵", "\t": "⇥", "\r": "␍"}


class Tokenizer:
    """Encode text to ids and show ids as readable strings."""

    def __init__(self, folder):
        try:
            import tokenizers
        except ImportError:
            raise MissingExtra(f"--text needs the tokenizers package: {INSTALL}") from None
        folder = Path(folder)
        if (folder / "tokenizer.json").is_file():
            self.path = folder / "tokenizer.json"
            try:
                self._tok = tokenizers.Tokenizer.from_file(str(self.path))
            except Exception as e:  # the package raises plain Exception for a bad file
                raise TfmError(f"--load {self.path}: not a tokenizer ({e})") from None
        elif (folder / "vocab.json").is_file() and (folder / "merges.txt").is_file():
            self.path = folder / "vocab.json"
            try:
                from tokenizers.implementations import ByteLevelBPETokenizer
                self._tok = ByteLevelBPETokenizer(
                    str(folder / "vocab.json"), str(folder / "merges.txt"))
            except Exception as e:
                raise TfmError(f"--load {folder}: vocab.json + merges.txt are not a byte-level "
                               f"BPE tokenizer ({e})") from None
        else:
            raise FileNotFoundError(folder)

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text).ids)

    def label(self, token_id: int) -> str:
        """The text of one token, spaces and newlines made visible ('␣cat')."""
        text = self._tok.decode([int(token_id)])
        if not text or "\ufffd" in text:   # a piece of a multi-byte character: show the raw token
            text = self._tok.id_to_token(int(token_id)) or f"<{token_id}>"
        return "".join(VISIBLE.get(c, c) for c in text)


def find_tokenizer(folder) -> Tokenizer | None:
    """The folder's tokenizer, or None when it has none."""
    try:
        return Tokenizer(folder)
    except FileNotFoundError:
        return None
