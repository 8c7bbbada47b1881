"""GGUF files, as llama.cpp, Ollama and LM Studio keep models (``--load FILE.gguf``): read like
a checkpoint folder, into the same Config and parameters, every tensor dequantized from
whatever type it is stored in (F32, F16, BF16, Q8_0, the K-quants, the I-quants: whatever
``gguf.quants`` dequantizes) into the run's dtype.

``file`` reads the header and maps the tensors; ``archs`` says, per ``general.architecture``,
which Hugging Face family the model is, its Config from the metadata, and what the converter
did to its tensors (undone); the family's own name map (``sources.<family>``), turned into the
file's tensor names by ``gguf``'s ``TensorNameMap``, then puts each under tfm's names, as it
does for a folder. ``vocab`` builds the tokenizer from ``tokenizer.ggml.*``.

``reader`` and the modules it imports import the ``gguf`` package (about 28 ms after NumPy);
this one does not, so telling a GGUF file from an ``.npz`` (``is_gguf``) costs nothing.
"""

from __future__ import annotations

from pathlib import Path

MAGIC = b"GGUF"
INSTALL = "python -m pip install gguf"


def is_gguf(path) -> bool:
    """A file whose name ends in ``.gguf``, or whose first bytes are ``GGUF``."""
    path = Path(path)
    if path.suffix.lower() == ".gguf":
        return True
    if not path.is_file():   # a pipe or a device: opening it may wait for a writer forever
        return False
    try:
        with open(path, "rb") as f:
            return f.read(4) == MAGIC
    except OSError:
        return False


def gguf_reader():
    """``sources.gguf.reader`` (``read_config``, ``describe``, ``load_params``,
    ``lazy_params``, ``find_tokenizer``), or MissingExtra saying how to install gguf."""
    from tfmcli.sources.gpt2 import MissingExtra

    try:
        import gguf  # noqa: F401
    except ImportError:
        raise MissingExtra(f"reading a GGUF file needs the gguf package (llama.cpp's): "
                           f"{INSTALL}") from None
    from tfmcli.sources.gguf import reader

    return reader
