"""Reading a GGUF file into tfm's Config and parameters (``tfmcli.sources.gguf`` says how)."""

from __future__ import annotations

import functools
from pathlib import Path

import numpy as np

from tfmcli.engine.config import Config
from tfmcli.engine.sizes import param_shapes
from tfmcli.errors import ConfigError, TfmError
from tfmcli.sources.folder import shown
from tfmcli.sources.gguf.archs import Arch, every_arch
from tfmcli.sources.gguf.file import GgufFile
from tfmcli.sources.gguf.meta import Meta
from tfmcli.sources.llama import LazyParams

IGNORED = ("rope_freqs.weight",)   # read into the Config (archs.rope_scaling), not a parameter


def open_file(path) -> GgufFile:
    """The file at ``path``, its header read once however often it is asked for."""
    path = Path(path)
    try:
        stat = path.stat()
    except OSError as e:
        raise TfmError(f"--load {path}: cannot read it ({e.strerror or e})") from None
    if not path.is_file():
        raise TfmError(f"--load {path}: not a file (allowed: a .gguf file, an .npz file or a "
                       f"checkpoint folder)")
    return _open(str(path), stat.st_mtime_ns, stat.st_size)


@functools.lru_cache(maxsize=2)
def _open(path: str, mtime: int, size: int) -> GgufFile:
    return GgufFile(path)


def architecture(file: GgufFile) -> tuple[str, Arch]:
    """``general.architecture``, one tfm runs, and how it is read."""
    arch = file.meta.get("general.architecture")
    if arch is None:
        raise TfmError(f"--load {file.path}: missing key 'general.architecture'")
    archs = every_arch()
    if not isinstance(arch, str) or arch not in archs:
        names = sorted(archs)
        raise TfmError(f"--load {file.path}: key 'general.architecture' is {shown(arch)}; tfm "
                       f"runs {', '.join(names[:-1])} and {names[-1]} GGUF files")
    return arch, archs[arch]


def read_config(path) -> dict:
    """Config fields from a GGUF file's metadata and tensors' shapes; TfmError naming the file
    and the key (or tensor) at fault."""
    file = open_file(path)
    arch, spec = architecture(file)
    fields = spec.fields(Meta(file, arch))
    try:
        Config(**fields)
    except ConfigError as e:
        raise TfmError(f"--load {path}: {e}") from None
    _names(file, arch, spec, fields)   # every tensor there, with its shape, before any is read
    return fields


def describe(path) -> str:
    """What the panel says of the weights: 'GGUF file tiny.gguf (llama, 'Tiny Llama'; Q8_0
    x16, F32 x5)'."""
    file = open_file(path)
    name = file.meta.get("general.name")
    kinds = ", ".join(f"{kind} x{n}" for kind, n in file.kinds().most_common())
    named = f"{name!r}; " if isinstance(name, str) and name else ""
    return f"GGUF file {path} ({file.meta.get('general.architecture')}, {named}{kinds})"


def _names(file: GgufFile, arch: str, spec: Arch, fields: dict) -> dict[str, str]:
    """Hugging Face key -> the file's tensor, for every key of the family's name map, each
    there with the shape the fields give it (as the converter wrote it); TfmError naming the
    tensor otherwise, or one the model does not have."""
    import gguf

    from tfmcli.sources import llama

    expected = spec.shapes(fields) if spec.shapes else \
        llama.stored_shapes(spec.rows(fields), param_shapes(Config(**fields)))
    tensor_map = gguf.get_tensor_name_map(
        {name: kind for kind, name in gguf.MODEL_ARCH_NAMES.items()}[arch], fields["layers"])
    names = {}
    for key, shape in expected.items():
        name = tensor_map.get_name(key, try_suffixes=(".weight", ".bias"))
        if name is None:   # (a key of tfm's name map gguf does not know: a bug, said plainly)
            raise TfmError(f"--load {file.path}: gguf's {arch} names have no tensor for "
                           f"{key!r}")
        if name not in file.tensors:
            raise TfmError(f"--load {file.path}: missing tensor {name!r} (its metadata "
                           f"describes a {arch} model that has it)")
        stored = shape[::-1] if key.endswith(spec.transposed) else shape
        if file.tensors[name].shape != stored:
            raise TfmError(f"--load {file.path}: tensor {name!r} has shape "
                           f"{_ne(file.tensors[name].shape)}, but its metadata says "
                           f"{_ne(stored)}")
        names[key] = name
    used = set(names.values())
    extra = next((name for name in file.tensors if name not in used and name not in IGNORED),
                 None)
    if extra is not None:
        raise TfmError(f"--load {file.path}: tensor {extra!r} is not a weight of the {arch} "
                       f"model its metadata describes")
    return names


def _ne(shape: tuple) -> str:
    """A shape as llama.cpp prints it, fastest dimension first: {32, 316}."""
    return "{" + ", ".join(map(str, shape[::-1])) + "}"


def lazy_params(path, fields: dict, dtype):
    """The file's weights under tfm's names, each dequantized (and its converter's change
    undone, transposed, widened) when the pass asks for it, never held
    (``llama.LazyParams``)."""
    file = open_file(path)
    arch, spec = architecture(file)
    names = _names(file, arch, spec, fields)
    rows, shapes = spec.rows(fields), param_shapes(Config(**fields))
    pick = spec.pick(rows, shapes, fields) if spec.pick else None
    return GgufParams(file, spec, fields, names, rows, shapes, dtype, pick)


def load_params(path, fields: dict, dtype) -> dict[str, np.ndarray]:
    """Every weight of the file under tfm's names, in ``dtype`` (``lazy_params``, read
    whole)."""
    return dict(lazy_params(path, fields, dtype).items())


class GgufParams(LazyParams):
    """``llama.LazyParams`` over a GGUF file: each Hugging Face key's tensor is the file's
    tensor dequantized, with what the converter did to it undone."""

    def __init__(self, file, spec, fields, names, rows, shapes, dtype, pick):
        super().__init__(None, {key: key for key in names}, rows, shapes, dtype, pick=pick)
        self.file, self.spec, self.fields, self.tensor = file, spec, fields, names

    def kind(self, name: str) -> str:
        """The type the file stores parameter ``name``'s tensor in ("Q8_0", "F32")."""
        return self.file.tensors[self.tensor[self.rows[name][0]]].kind.name

    def _read(self, key: str, transposed: bool) -> np.ndarray:
        value = self.file.array(self.tensor[key])   # float32 (exactly the stored values)
        if self.spec.undo is not None:
            value = self.spec.undo(key, value, self.fields)
        return np.array(value.T if transposed else value, dtype=self.dtype, order="C")


def find_tokenizer(path, needed: bool = True):
    """The tokenizer the file's metadata describes (``tokenizer.ggml.*``: ``vocab``), or None
    when it has none, or when it is not ``needed`` (no --text: it only labels the tokens) and
    the tokenizers package is not installed."""
    from tfmcli.sources.gguf.vocab import GgufTokenizer

    file = open_file(path)
    if "tokenizer.ggml.model" not in file.meta:
        return None
    if not needed:
        try:
            import tokenizers  # noqa: F401
        except ImportError:
            return None
    return GgufTokenizer(file.path, file.meta)
