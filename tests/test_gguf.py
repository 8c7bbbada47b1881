"""GGUF files (``--load FILE.gguf``): written by llama.cpp's own converter
(``convert_hf_to_gguf.py``, from the llama-cpp-python source distribution, fetched at test time
and kept in a cache outside the project) from tfm's example checkpoints in F32, F16, BF16 and
Q8_0, and re-quantized with ``gguf.quants`` (Q4_0, Q5_1) and a Q6_K encoder of the tests' own;
the F32 file runs as the folder does (logits and every gradient to 1e-12 of scale), a quantized
one within its rounding, and as the folder of the weights it decodes to (``decoded_folder``,
made with gguf's reader, not tfm's), GPT-2's and LLaMA's also against Hugging Face's autograd
on those weights; each block of 32 along the rows the file stores, and a planted bug in the
decoding fails; the header reader agrees with ``gguf.GGUFReader``; the tokenizer built
from ``tokenizer.ggml.*`` gives llama.cpp's own ids on its ``models/ggml-vocab-*.gguf`` files;
every bad file is one line naming it, exit 1.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

import numpy as np
import pytest

import tfmcli
from helpers import assert_folder_matches_hf, assert_scaled_close, error_line, ok, run

gguf = pytest.importorskip("gguf", reason="GGUF files are read with the gguf package "
                                          "(llama.cpp's): python -m pip install gguf")
pytest.importorskip("safetensors")
pytest.importorskip("tokenizers")

from tfmcli.sources.gguf import archs, reader  # noqa: E402
from tfmcli.sources.gguf.file import GgufFile  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"
SDIST = "llama-cpp-python==0.3.36"   # its vendor/llama.cpp: the converter and the vocab files
KEEP = ("convert_hf_to_gguf.py", "conversion/", "gguf-py/", "models/ggml-vocab-")
TOKENS = [[1, 284, 291, 297, 285, 298, 5], [1, 284, 288, 293, 292, 285, 296, 7]]
GPT2_TOKENS = [[52, 17, 9, 80, 33, 4], [7, 12, 99, 3, 150, 61]]
# A converter run: its own script, with GPT-2's pre-tokenizer named for tiny-gpt2's tokenizer
# (whose pre-tokenizer is GPT-2's own, ByteLevel with its pattern: the converter recognizes a
# pre-tokenizer by hashing what it makes of a text, and tiny's small vocabulary hashes apart)
CONVERT = """
import runpy, sys
root = sys.argv[1]
sys.path[:0] = [root, root + "/gguf-py"]
import conversion.base
if sys.argv[5] == "gpt-2":
    conversion.base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "gpt-2"
sys.argv = ["convert_hf_to_gguf.py", sys.argv[2], "--outfile", sys.argv[3], "--outtype",
            sys.argv[4]]
runpy.run_path(root + "/convert_hf_to_gguf.py", run_name="__main__")
"""


@pytest.fixture(autouse=True)
def plain_env(monkeypatch):
    for name in ("NO_COLOR", "FORCE_COLOR", "COLUMNS"):
        monkeypatch.delenv(name, raising=False)


# ------------------------------------------------------------------ llama.cpp, fetched

@pytest.fixture(scope="session")
def llama_cpp() -> Path:
    """llama.cpp's source (the converter, gguf-py, the vocab test files): $TFM_LLAMA_CPP, or
    the llama-cpp-python source distribution's vendor/llama.cpp, fetched with pip once into
    ~/.cache/tfm-tests (about 70 s; 77 MB downloaded, 3 MB kept)."""
    if os.environ.get("TFM_LLAMA_CPP"):
        return Path(os.environ["TFM_LLAMA_CPP"])
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "tfm-tests"
    root = cache / SDIST.replace("==", "-") / "llama.cpp"
    if (root / "convert_hf_to_gguf.py").is_file():
        return root
    with tempfile.TemporaryDirectory() as tmp:
        fetched = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps",
                                  "--no-binary", ":all:", SDIST, "-d", tmp],
                                 capture_output=True, text=True)
        sdists = list(Path(tmp).glob("*.tar.gz"))
        if fetched.returncode or not sdists:
            why = (fetched.stderr.strip().splitlines() or ["no sdist"])[-1]
            pytest.skip(f"llama.cpp's converter: pip cannot fetch {SDIST} ({why})")
        staging = Path(tmp) / "llama.cpp"
        with tarfile.open(sdists[0]) as archive:
            for member in archive.getmembers():
                inside = member.name.split("/vendor/llama.cpp/", 1)
                if len(inside) == 2 and inside[1].startswith(KEEP) and member.isfile():
                    target = staging / inside[1]
                    target.parent.mkdir(parents=True, exist_ok=True)
                    target.write_bytes(archive.extractfile(member).read())
        root.parent.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(root, ignore_errors=True)
        shutil.move(str(staging), root)
    return root


@pytest.fixture(scope="session")
def converter(llama_cpp):
    """convert(folder, outtype) -> the GGUF file llama.cpp's converter writes."""
    for name in ("torch", "transformers", "sentencepiece"):
        pytest.importorskip(name, reason=f"llama.cpp's convert_hf_to_gguf.py needs {name}")
    out = Path(tempfile.mkdtemp(prefix="tfm-gguf-"))
    made = {}

    def convert(folder: Path, outtype: str, pre: str = "") -> Path:
        key = (str(folder), outtype)
        if key not in made:
            path = out / f"{Path(folder).name}-{outtype}.gguf"
            done = subprocess.run([sys.executable, "-c", CONVERT, str(llama_cpp), str(folder),
                                   str(path), outtype, pre], capture_output=True, text=True)
            assert done.returncode == 0, done.stderr[-3000:]
            made[key] = path
        return made[key]

    yield convert
    shutil.rmtree(out, ignore_errors=True)


@pytest.fixture(scope="session")
def tiny_gpt2(tmp_path_factory) -> Path:
    """examples/tiny-gpt2 as the converter takes it: its config with GPT-2's ``n_ctx`` (which
    transformers 5 no longer writes) and a tokenizer_config.json naming the fast tokenizer
    (GPT2Tokenizer's defaults would add an <|endoftext|> the vocabulary does not hold)."""
    folder = tmp_path_factory.mktemp("models") / "tiny-gpt2"
    shutil.copytree(EXAMPLES / "tiny-gpt2", folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "n_ctx": config["n_positions"]}))
    (folder / "tokenizer_config.json").write_text('{"tokenizer_class": '
                                                  '"PreTrainedTokenizerFast"}')
    return folder


@pytest.fixture(scope="session")
def wide_llama(tmp_path_factory) -> Path:
    """A LLaMA folder 256 wide (K-quants' blocks are 256 long: tiny-llama's 32 wide rows take
    none), float32, O(1) random weights (norm gains about 1), tiny-llama's tokenizer."""
    from tfmcli.sources import llama, tensorfile

    folder = tmp_path_factory.mktemp("models") / "wide-llama"
    folder.mkdir()
    config = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 256,
              "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 2,
              "intermediate_size": 512, "vocab_size": 316, "max_position_embeddings": 64,
              "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": False,
              "hidden_act": "silu", "bos_token_id": 1, "eos_token_id": 2}
    (folder / "config.json").write_text(json.dumps(config))
    shutil.copy(EXAMPLES / "tiny-llama" / "tokenizer.json", folder)
    fields = llama.read_config(folder)
    rng = np.random.default_rng(7)
    params = tfmcli.init_params(tfmcli.Config(**fields))
    params = {name: (1 + 0.2 * rng.standard_normal(p.shape) if name.endswith("gamma")
                     else rng.standard_normal(p.shape) / np.sqrt(p.shape[0]))
              for name, p in params.items()}
    tensors = {k: v.astype(np.float32) for k, v in llama.from_tfm(params, fields).items()}
    tensorfile.write(folder / "model.safetensors", tensors)
    return folder


# ------------------------------------------------------------------ runs compared

def forward_backward(path, tokens):
    run_ = tfmcli.load(path, tokens=tokens)
    fwd = tfmcli.forward(run_.params, run_.inputs, run_.cfg)
    return run_, fwd, tfmcli.backward(run_.params, fwd, run_.cfg)


def assert_same_run(path, folder, tokens):
    """The file's run is the folder's: Config, parameters, logits and every gradient."""
    ours, fwd, grads = forward_backward(path, tokens)
    theirs, fwd_f, grads_f = forward_backward(folder, tokens)
    assert ours.cfg == theirs.cfg
    for name in theirs.params:
        assert_scaled_close(ours.params[name], theirs.params[name])
    assert_scaled_close(fwd.acts["logits"], fwd_f.acts["logits"])
    assert abs(fwd.loss - fwd_f.loss) <= 1e-12 * abs(fwd_f.loss)
    assert set(grads) == set(grads_f)
    for name in grads_f:
        assert_scaled_close(grads[name], grads_f[name])


@pytest.mark.parametrize("outtype", ["f32", "bf16"])
def test_a_llama_file_runs_as_its_folder(converter, outtype):
    """tiny-llama is stored in bfloat16: F32 and BF16 files hold its weights exactly, so the
    run is the folder's, Q and K's rows put back in Hugging Face's order (the converter's
    permute undone)."""
    folder = EXAMPLES / "tiny-llama"
    assert_same_run(converter(folder, outtype), folder, TOKENS)


def test_a_gpt2_file_runs_as_its_folder(converter, tiny_gpt2):
    """GPT-2's Conv1D weights, transposed by the converter, turned back; c_attn cut in three;
    the head tied (no output.weight); n_ctx from position_embd."""
    path = converter(tiny_gpt2, "f32", pre="gpt-2")
    assert_same_run(path, EXAMPLES / "tiny-gpt2", GPT2_TOKENS)


def test_the_permutation_undone_wrongly_fails(converter, monkeypatch):
    """Reading Q and K's rows as the file stores them (no permute undone), or undone with the
    query heads for K, gives another model: the comparison above would fail."""
    path = converter(EXAMPLES / "tiny-llama", "f32")
    _, good, _ = forward_backward(path, TOKENS)
    right = archs.unpermute
    for wrong in (lambda w, heads: w, lambda w, heads: right(w, 4)):
        monkeypatch.setattr(archs, "unpermute", wrong)
        _, bad, _ = forward_backward(path, TOKENS)
        off = np.abs(bad.acts["logits"] - good.acts["logits"]).max()
        assert off > 1e-3 * np.abs(good.acts["logits"]).max(), off


def relative(a, b) -> tuple[float, float]:
    """(relative RMS, relative max) of a against b."""
    d = np.asarray(a, np.float64) - b
    return float(np.sqrt((d ** 2).mean() / (b ** 2).mean())), float(np.abs(d).max()
                                                                    / np.abs(b).max())


@pytest.mark.parametrize("outtype, weight_rms, logits_max", [("f16", 1e-3, 1e-2),
                                                             ("q8_0", 1e-2, 5e-2)])
def test_a_quantized_file_is_within_its_rounding(converter, outtype, weight_rms, logits_max):
    """Every parameter of the F16 and Q8_0 files within its type's rounding of the folder's
    (Q8_0: each block of 32 a multiple of max|w| / 127, so no entry off by more than half of
    that, plus the float16 scale's rounding); the logits close. (tiny-llama's bfloat16 weights
    are all float16 numbers too: its F16 file holds them exactly.)"""
    folder = EXAMPLES / "tiny-llama"
    ours, fwd, _ = forward_backward(converter(folder, outtype), TOKENS)
    theirs, fwd_f, _ = forward_backward(folder, TOKENS)
    for name, value in theirs.params.items():
        rms, most = relative(ours.params[name], value)
        assert rms < weight_rms, (name, rms)
        if outtype == "q8_0":
            assert np.abs(ours.params[name] - value).max() <= np.abs(value).max() / 127 * 0.51
    rms, most = relative(fwd.acts["logits"], fwd_f.acts["logits"])
    assert most < logits_max and (most > 0) == (outtype == "q8_0"), most


# ------------------------------------------------------------------ re-quantized files

def q6_k(x: np.ndarray) -> np.ndarray:
    """Q6_K's bytes for rows ``x`` (rows a multiple of 256 long), the tests' own encoder
    (gguf.quants decodes Q6_K but does not encode it): per block of 256, a float16 ``d``; per
    16, an int8 scale; each value q - 32, q in 0..63, its low 4 bits in ``ql``, its high 2 in
    ``qh``, laid out as gguf.quants.Q6_K.dequantize_blocks reads them."""
    rows = x.shape[0]
    blocks = np.asarray(x, np.float32).reshape(-1, 16, 16)   # (blocks, 16 scales, 16)
    n = blocks.shape[0]
    sub = np.abs(blocks).max(-1) / 31                         # (n, 16)
    d = (sub.max(-1) / 127).astype(np.float16)
    dq = d.astype(np.float32)[:, None]
    scales = np.where(dq > 0, np.round(sub / np.where(dq > 0, dq, 1)), 0).clip(-128, 127)
    step = (dq * scales.astype(np.int8).astype(np.float32))[..., None]
    q = (np.where(step > 0, np.round(blocks / np.where(step > 0, step, 1)), 0)
         .clip(-32, 31).astype(np.int16) + 32).reshape(n, 256).astype(np.uint8)
    ql, qh = np.zeros((n, 128), np.uint8), np.zeros((n, 64), np.uint8)
    for p in range(256):
        h, r = divmod(p, 128)
        ql[:, h * 64 + r % 64] |= (q[:, p] & 0xF) << (4 * (r // 64))
        qh[:, h * 32 + r % 32] |= (q[:, p] >> 4) << (2 * (r // 32))
    raw = np.concatenate([ql, qh, scales.astype(np.int8).view(np.uint8),
                          d.view(np.uint8).reshape(n, 2)], axis=1)
    return raw.reshape(rows, -1)


def test_the_q6_k_encoder_round_trips():
    x = np.random.default_rng(0).standard_normal((3, 512)).astype(np.float32)
    back = gguf.quants.dequantize(q6_k(x), gguf.GGMLQuantizationType.Q6_K)
    assert back.shape == x.shape
    assert np.abs(back - x).max() <= np.abs(x).max() / 31 / 2 * 1.05   # half a step, at most


def rewritten(source: Path, out: Path, tensor=None, keys: dict = (), more: dict = ()) -> Path:
    """``source`` written again to ``out``: its metadata, with ``keys`` set (name -> (value,
    GGUFValueType)) or dropped (-> None); each tensor as ``tensor(reader_tensor)`` makes it
    (an array, or (raw bytes, their type), or None: left out; by default as stored), then the
    ``more`` tensors (name -> array)."""
    keys = dict(keys)
    old = gguf.GGUFReader(source)
    writer = gguf.GGUFWriter(out, old.fields["general.architecture"].contents())
    for name, field in old.fields.items():
        if not name.startswith("GGUF.") and name != "general.architecture" and name not in keys:
            sub = field.types[1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
            writer.add_key_value(name, field.contents(), field.types[0], sub_type=sub)
    for name, change in keys.items():
        if change is not None:
            writer.add_key_value(name, *change)
    for item in old.tensors:
        made = np.asarray(item.data) if tensor is None else tensor(item)
        if isinstance(made, tuple):
            writer.add_tensor(item.name, made[0], raw_dtype=made[1])
        elif made is not None:
            writer.add_tensor(item.name, made)
    for name, value in dict(more).items():
        writer.add_tensor(name, value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def in_numpys_shape(tensor) -> np.ndarray:
    """A reader's tensor, stored unquantized, in NumPy's order (GGUF lists the fastest
    dimension first)."""
    return np.asarray(tensor.data).reshape(tuple(int(n) for n in tensor.shape[::-1]))


def requantized(source: Path, out: Path, kind, dequantized: bool = False) -> Path:
    """``source`` (an F32 file) with every 2-D tensor whose rows hold whole blocks stored as
    ``kind`` (``gguf.quants`` or ``q6_k``), or, ``dequantized``, as the float32 values that
    ``kind`` holds; a tensor of rows no whole block fits (48 long, for blocks of 32) kept in
    F32, as the converter keeps what Q8_0 cannot hold in F16; the metadata copied as it is."""
    qtype = gguf.GGMLQuantizationType.Q6_K if kind == "q6_k" else kind
    block = gguf.GGML_QUANT_SIZES[qtype][0]

    def stored(tensor):
        value = in_numpys_shape(tensor).astype(np.float32)
        if value.ndim != 2 or value.shape[1] % block:
            return value
        raw = q6_k(value) if kind == "q6_k" else gguf.quants.quantize(value, kind)
        return gguf.quants.dequantize(raw, qtype) if dequantized else (raw, qtype)
    return rewritten(source, out, stored)


QUANTS = {"Q4_0": gguf.GGMLQuantizationType.Q4_0, "Q5_1": gguf.GGMLQuantizationType.Q5_1,
          "Q6_K": "q6_k"}


@pytest.mark.parametrize("name", QUANTS)
def test_a_requantized_file_holds_what_its_type_decodes(converter, wide_llama, tmp_path, name):
    """Q4_0 and Q5_1 (gguf.quants' encoders) and Q6_K (the tests'): the file's run is the run
    of the float32 values its blocks decode to (exactly: the same parameters, logits and
    gradients), and within the type's rounding of the original's."""
    f32 = converter(wide_llama, "f32")
    quantized = requantized(f32, tmp_path / f"{name}.gguf", QUANTS[name])
    decoded = requantized(f32, tmp_path / f"{name}-decoded.gguf", QUANTS[name], True)
    tokens = [[1, 40, 200, 7, 99, 315, 3, 12]]
    assert GgufFile(quantized).kinds()[name] == 16   # 7 a block, 2 blocks, embedding, head
    assert_same_run(quantized, decoded, tokens)
    ours, fwd, _ = forward_backward(quantized, tokens)
    original, fwd_f, _ = forward_backward(wide_llama, tokens)
    bound = {"Q4_0": 0.15, "Q5_1": 0.05, "Q6_K": 0.03}[name]
    for param, value in original.params.items():
        assert relative(ours.params[param], value)[0] < bound, param
    assert relative(fwd.acts["logits"], fwd_f.acts["logits"])[1] < 4 * bound


# ------------------------------------------------------------------ what a file decodes to

def stored_weights(folder: Path) -> dict[str, np.ndarray]:
    """A folder's ``model.safetensors``, each tensor as float64 (bfloat16 ones too), in the
    file's order."""
    from safetensors import safe_open

    assert [p.name for p in Path(folder).glob("*.safetensors")] == ["model.safetensors"]
    with safe_open(Path(folder) / "model.safetensors", framework="pt") as f:
        return {key: f.get_tensor(key).double().numpy() for key in f.keys()}


def save_weights(tensors: dict, path: Path) -> None:
    """``tensors`` (name -> float32 array) as ``save_pretrained`` writes a safetensors file."""
    import torch
    from safetensors.torch import save_file

    save_file({key: torch.from_numpy(np.ascontiguousarray(value, np.float32))
               for key, value in tensors.items()}, path, metadata={"format": "pt"})


def numbered(folder: Path, out: Path) -> Path:
    """A copy of ``folder`` whose weights are their own addresses: entry k of its tensors (each
    flattened, in turn) holds 2 (k + 1), which float32 holds exactly. The converter's F32 file
    of it says where it put each entry (rows permuted, regrouped, transposed, cut) and what it
    added to it (Gemma's norms are stored as 1 + w: an odd number)."""
    shutil.copytree(folder, out, ignore=shutil.ignore_patterns("*.safetensors"))
    start, tensors = 0, {}
    for key, value in stored_weights(folder).items():
        tensors[key] = 2 * (start + 1 + np.arange(value.size)).reshape(value.shape)
        start += value.size
    assert 2 * start < 2 ** 24   # (every address a float32 integer)
    save_weights(tensors, out / "model.safetensors")
    return out


def decoded_folder(folder: Path, path: Path, addresses: Path, out: Path) -> Path:
    """A copy of ``folder`` (its config and tokenizer as they are) whose weights are what the
    GGUF file ``path`` decodes to: each tensor read by gguf's own ``GGUFReader`` and
    ``gguf.quants.dequantize``, each entry put back where ``addresses`` (the converter's F32
    file of ``numbered(folder)``) says it came from, less the 1 the converter added to Gemma's
    norms; in float32, which holds each exactly. tfm's GGUF reader plays no part in it (the
    folder is read by tfm's folder readers, which each family's tests hold to Hugging Face's
    ``from_pretrained``). A tensor the converter left out keeps the folder's values."""
    weights = stored_weights(folder)
    flat = np.concatenate([w.ravel() for w in weights.values()])
    found = np.zeros(flat.size, bool)
    where = {t.name: in_numpys_shape(t) for t in gguf.GGUFReader(addresses).tensors}
    for tensor in gguf.GGUFReader(path).tensors:
        codes = where.pop(tensor.name).ravel()
        value = gguf.quants.dequantize(tensor.data, tensor.tensor_type).astype(np.float64)
        assert value.size == codes.size, tensor.name
        entry, added = np.divmod(codes.astype(np.int64), 2)
        assert np.array_equal(2 * entry + added, codes), tensor.name
        entry, value = entry - 1, value.ravel() - added
        again = found[entry]   # (an entry the converter wrote twice: the same value)
        assert np.array_equal(flat[entry[again]], value[again]), tensor.name
        flat[entry], found[entry] = value, True
    assert not where, sorted(where)   # the same tensors
    tensors, start = {}, 0
    for key, value in weights.items():
        part = slice(start, start + value.size)
        start += value.size
        assert found[part].all() or not found[part].any(), (key, found[part].sum())
        assert np.array_equal(flat[part].astype(np.float32), flat[part]), key
        tensors[key] = flat[part].reshape(value.shape)
    shutil.copytree(folder, out, ignore=shutil.ignore_patterns("*.safetensors"))
    save_weights(tensors, out / "model.safetensors")
    return out


@pytest.fixture(scope="session")
def decoded(tmp_path_factory):
    """decoded(folder, path, convert) -> the folder of what ``path``, a GGUF file of
    ``folder``, decodes to (``decoded_folder``); ``convert(folder)``: the F32 file the
    converter writes of a folder (the addresses' file, made once a folder)."""
    addresses, made = {}, {}

    def folder_of(folder, path, convert) -> Path:
        folder, path = Path(folder), Path(path)
        if folder not in addresses:
            base = tmp_path_factory.mktemp("numbered")
            addresses[folder] = convert(numbered(folder, base / f"{folder.name}-numbered"))
        if path not in made:
            made[path] = decoded_folder(folder, path, addresses[folder],
                                        tmp_path_factory.mktemp("decoded") / folder.name)
        return made[path]
    return folder_of


def typed_file(convert, folder: Path, kind: str, out: Path) -> Path:
    """``folder``'s GGUF file of type ``kind``: the converter's own (``convert(folder,
    outtype)``: "f16", "q8_0"), or its F32 file re-quantized by ``gguf.quants`` ("Q4_0",
    "Q5_1": ``requantized``), written to ``out``."""
    if kind not in QUANTS:
        return convert(folder, kind)
    return requantized(convert(folder, "f32"), out / f"{Path(folder).name}-{kind}.gguf",
                       QUANTS[kind])


def moved(folder: Path, decoded_: Path) -> list[str]:
    """The folder's weights whose decoded values differ from its own."""
    ours, theirs = stored_weights(folder), stored_weights(decoded_)
    return [key for key in ours if not np.array_equal(ours[key], theirs[key])]


def assert_runs_as_what_it_decodes_to(path: Path, folder: Path, decoded_: Path, tokens,
                                      summed: int = 0) -> None:
    """The file's run is the run of ``decoded_``, the folder of what it decodes to
    (``assert_same_run``: the Config, parameters, logits, loss and every gradient to 1e-12 of
    scale), and that is not the folder's own: the weights of every tensor the file stores in
    a type other than F32 moved, and ``summed`` more (Gemma's norms, stored in F32 as
    float32's sum 1 + w); those it stores in F32 (the norms, GPT-2's and StarCoder's position
    table in the converter's files) did not."""
    assert_same_run(path, decoded_, tokens)
    stored = [name for name, t in GgufFile(path).tensors.items() if t.kind.name != "F32"]
    assert len(moved(folder, decoded_)) == len(stored) + summed > 0


# the models of LLaMA's names and GPT-2's: name -> (kind, config) of a Hugging Face folder
# (``hf_folder``), or the fixture that makes it
LLAMA_FAMILY = {"tiny-llama": None, "wide-llama": None, "gpt2": None,
                "qwen2": ("Qwen2", {}), "qwen3": ("Qwen3", {"head_dim": 16})}


@pytest.fixture(scope="session")
def llama_family(tiny_gpt2, wide_llama, tmp_path_factory):
    """model(name) -> (folder, the pre-tokenizer the converter is told, tokens) of
    LLAMA_FAMILY's models, each made once."""
    made = {"tiny-llama": (EXAMPLES / "tiny-llama", "", TOKENS),
            "wide-llama": (wide_llama, "", [[1, 40, 200, 7, 99, 315, 3, 12]]),
            "gpt2": (tiny_gpt2, "gpt-2", GPT2_TOKENS)}

    def model(name: str):
        if name not in made:
            kind, config = LLAMA_FAMILY[name]
            folder = hf_folder(tmp_path_factory.mktemp("models") / f"decoded-{name}", kind,
                               **config)
            made[name] = folder, "gpt-2", GPT2_TOKENS
        return made[name]
    return model


DECODED = [("wide-llama", "f16"), ("wide-llama", "q8_0"), ("wide-llama", "Q4_0"),
           ("wide-llama", "Q5_1"), ("tiny-llama", "q8_0"), ("gpt2", "f16"), ("gpt2", "q8_0"),
           ("gpt2", "Q4_0"), ("gpt2", "Q5_1"), ("qwen2", "f16"), ("qwen2", "q8_0"),
           ("qwen2", "Q4_0"), ("qwen3", "q8_0"), ("qwen3", "Q5_1")]


@pytest.mark.parametrize("name, kind", DECODED)
def test_a_file_runs_as_the_folder_of_what_it_decodes_to(converter, llama_family, decoded,
                                                         tmp_path, name, kind):
    """The converter's F16 and Q8_0 files and its F32 file re-quantized to Q4_0 and Q5_1:
    each runs as the folder of the weights it decodes to (``decoded_folder``, made without
    tfm's reader, with the original folder's config): LLaMA's rows permuted back, GPT-2's
    Conv1D weights transposed back, their blocks of 32 along the rows the file stores (Qwen's
    FFN, 48 wide, keeps F16 in the Q8_0 file and F32 in the re-quantized ones)."""
    folder, pre, tokens = llama_family(name)
    path = typed_file(lambda f, outtype: converter(f, outtype, pre), folder, kind, tmp_path)
    assert GgufFile(path).kinds()[kind.upper()] > 0
    assert_runs_as_what_it_decodes_to(path, folder, decoded(
        folder, path, lambda f: converter(f, "f32", pre)), tokens)


def gpt2_grads(model) -> dict:
    """A GPT2LMHeadModel's gradients under tfm's names: Conv1D's weights are tfm's ``(in,
    out)`` already, ``c_attn``'s columns q's, k's and v's in turn."""
    tr, d = model.transformer, model.config.n_embd
    theirs = {"embed.W_E": tr.wte.weight.grad, "embed.W_pos": tr.wpe.weight.grad,
              "ln_f.gamma": tr.ln_f.weight.grad, "ln_f.beta": tr.ln_f.bias.grad}
    if model.lm_head.weight is not tr.wte.weight:
        theirs["head.W_U"] = model.lm_head.weight.grad.T
    for i, block in enumerate(tr.h):
        p, attn = f"blocks.{i}.", block.attn
        for j, x in enumerate("QKV"):
            theirs[p + f"attn.W_{x}"] = attn.c_attn.weight.grad[:, j * d:(j + 1) * d]
            theirs[p + f"attn.b_{x}"] = attn.c_attn.bias.grad[j * d:(j + 1) * d]
        for ours, module in (("attn.W_O", attn.c_proj), ("ffn.W_1", block.mlp.c_fc),
                             ("ffn.W_2", block.mlp.c_proj)):
            theirs[p + ours] = module.weight.grad
            theirs[p + ours.replace("W_", "b_")] = module.bias.grad
        for ours, norm in (("ln1", block.ln_1), ("ln2", block.ln_2)):
            theirs[p + ours + ".gamma"], theirs[p + ours + ".beta"] = (norm.weight.grad,
                                                                       norm.bias.grad)
    return {name: grad.numpy() for name, grad in theirs.items()}


@pytest.mark.parametrize("name, kind", [("gpt2", "q8_0"), ("gpt2", "Q4_0"),
                                        ("wide-llama", "q8_0"), ("wide-llama", "Q5_1")])
def test_a_quantized_file_is_hugging_faces_autograd_on_what_it_decodes_to(
        converter, llama_family, decoded, tmp_path, name, kind):
    """The file's run against Hugging Face's own model (``from_pretrained`` of the folder of
    what the file decodes to, float64, ``loss.backward()``): the loss, the logits and every
    gradient to 1e-12 (``helpers.assert_folder_matches_hf``, as the folders' own tests hold
    each family's reader)."""
    transformers = pytest.importorskip("transformers")
    folder, pre, tokens = llama_family(name)
    path = typed_file(lambda f, outtype: converter(f, outtype, pre), folder, kind, tmp_path)
    theirs = decoded(folder, path, lambda f: converter(f, "f32", pre))
    run_ = tfmcli.load(path, tokens=tokens)
    if name == "gpt2":
        assert_folder_matches_hf(transformers.GPT2LMHeadModel, theirs, run_,
                                 to_float64=lambda model, cfg: model, grads_of=gpt2_grads)
    else:
        assert_folder_matches_hf(transformers.LlamaForCausalLM, theirs, run_)


STEPS = {"Q8_0": 127, "Q4_0": 8}   # a block's largest magnitude, in steps of its scale


def on_one_scale(w: np.ndarray, axis: int, steps: int) -> np.ndarray:
    """Whether each block of 32 of ``w`` along ``axis`` is whole multiples of one scale, its
    largest magnitude / ``steps``: a Q8_0 block's values are d q, q at most 127 and the
    largest 127 (Q4_0's: d (q - 8), the largest 8 steps)."""
    blocks = np.moveaxis(w, axis, -1).reshape(-1, 32)
    scale = np.abs(blocks).max(-1, keepdims=True) / steps
    q = blocks / np.where(scale > 0, scale, 1)
    return np.all(np.abs(q - np.round(q)) < 1e-6, axis=-1)


def assert_blocks_along_the_inputs(path: Path) -> list[str]:
    """Every parameter tfm reads from a Q8_0 or Q4_0 tensor of the file lies in blocks of one
    scale along its inputs, the rows the file stores (tfm's ``(in, out)`` matrices: down each
    column; the embedding: along each row), and not across them; returns those parameters."""
    fields = reader.read_config(path)
    params = reader.lazy_params(path, fields, np.float64)
    checked = []
    for name in params:
        kind = params.kind(name)
        if kind not in STEPS:
            continue
        w = params[name]
        along = 1 if name.startswith("embed.") else 0
        assert on_one_scale(w, along, STEPS[kind]).all(), name
        if w.shape[1 - along] % 32 == 0:
            assert on_one_scale(w, 1 - along, STEPS[kind]).mean() < 0.1, name
        checked.append(name)
    return checked


@pytest.mark.parametrize("name, kind, count", [("gpt2", "q8_0", 13), ("gpt2", "Q4_0", 14),
                                               ("wide-llama", "q8_0", 16),
                                               ("qwen2", "Q4_0", 14)])
def test_each_block_lies_along_the_rows_the_file_stores(converter, llama_family, tmp_path,
                                                        name, kind, count):
    """Blocks of 32 run along each row the file stores: GPT-2's Conv1D weights are stored
    transposed (a row of c_attn's 96 is one output's 32 inputs), so tfm's ``(in, out)`` W_Q
    holds them down its columns, as LLaMA's permuted rows and Qwen's do. (The converter keeps
    GPT-2's position table in F32, ``requantized`` does not; Qwen's FFN, 48 wide, stays F32.)"""
    folder, pre, _ = llama_family(name)
    path = typed_file(lambda f, outtype: converter(f, outtype, pre), folder, kind, tmp_path)
    checked = assert_blocks_along_the_inputs(path)
    assert len(checked) == count, checked


def decoded_wrongly(how: str):
    """``GgufFile.array`` with a planted bug in the reading of every Q8_0 and Q4_0 tensor:
    "blocks reversed", each row's blocks decoded in the reverse order; "rows as columns", the
    decoded values laid out in GGUF's order taken for NumPy's (the other shape, transposed);
    "scales shifted", each row decoded with the next row's scales."""
    right = GgufFile.array

    def array(self, name):
        tensor = self.tensors[name]
        if tensor.kind.name not in STEPS:
            return right(self, name)
        raw = np.frombuffer(self.map, np.uint8, tensor.nbytes, tensor.start)
        rows = raw.reshape(tensor.shape[0], -1)
        size = gguf.GGML_QUANT_SIZES[tensor.kind][1]
        if how == "blocks reversed":
            rows = rows.reshape(len(rows), -1, size)[:, ::-1].reshape(rows.shape)
        elif how == "scales shifted":   # (each block's scale, a float16, is its first 2 bytes)
            blocks = rows.reshape(len(rows), -1, size).copy()
            blocks[..., :2] = np.roll(blocks[..., :2], 1, axis=0)
            rows = blocks.reshape(rows.shape)
        value = gguf.quants.dequantize(np.ascontiguousarray(rows), tensor.kind)
        if how == "rows as columns":
            return value.reshape(tensor.shape[::-1]).T
        return value
    return array


@pytest.mark.parametrize("how", ["blocks reversed", "rows as columns", "scales shifted"])
def test_a_quantized_file_decoded_wrongly_fails(converter, llama_family, decoded, tmp_path,
                                                monkeypatch, how):
    """Planted bugs in the decoding of GPT-2's Q8_0 file (its Conv1D weights stored
    transposed): the comparison with the folder of what it decodes to fails, the logits moved
    by more than 1e-3 of their scale."""
    folder, pre, tokens = llama_family("gpt2")
    path = typed_file(lambda f, outtype: converter(f, outtype, pre), folder, "q8_0", tmp_path)
    theirs = decoded(folder, path, lambda f: converter(f, "f32", pre))
    assert_planted_bug_fails(path, theirs, tokens, lambda: monkeypatch.setattr(
        GgufFile, "array", decoded_wrongly(how)))


def assert_planted_bug_fails(path, theirs, tokens, plant) -> None:
    """The file's run with ``plant()`` done (a monkeypatch): its logits move by more than 1e-3
    of their scale, and it is no longer the run of ``theirs``, the folder of what the file
    decodes to."""
    _, good, _ = forward_backward(path, tokens)
    plant()
    _, bad, _ = forward_backward(path, tokens)
    scale = np.abs(good.acts["logits"]).max()
    assert np.abs(bad.acts["logits"] - good.acts["logits"]).max() > 1e-3 * scale
    with pytest.raises(AssertionError):
        assert_same_run(path, theirs, tokens)


def test_a_tensor_dequantized_a_row_at_a_time_is_the_same(converter, llama_family, decoded,
                                                          tmp_path, monkeypatch):
    """``GgufFile.array`` dequantizes a few rows at a time (``file.CHUNK`` values: 4 Mi, more
    than a tiny model's tensors hold): with a row at a time, the run is still the folder's of
    what the file decodes to."""
    from tfmcli.sources.gguf import file

    folder, pre, tokens = llama_family("wide-llama")
    path = typed_file(lambda f, outtype: converter(f, outtype, pre), folder, "Q4_0", tmp_path)
    theirs = decoded(folder, path, lambda f: converter(f, "f32", pre))
    monkeypatch.setattr(file, "CHUNK", 1)
    assert_same_run(path, theirs, tokens)


# ------------------------------------------------------------------ the file itself

def test_the_header_reader_agrees_with_gguf_reader(converter, tiny_gpt2, llama_cpp):
    """Every key's value and every tensor's shape, type and bytes, as gguf.GGUFReader reads
    them (which builds an array per string: 11.6 s for LLaMA 3's vocabulary here)."""
    files = [converter(EXAMPLES / "tiny-llama", "q8_0"), converter(tiny_gpt2, "f32", "gpt-2"),
             llama_cpp / "models" / "ggml-vocab-phi-3.gguf"]
    for path in files:
        ours, theirs = GgufFile(path), gguf.GGUFReader(path)
        keys = [k for k in theirs.fields if not k.startswith("GGUF.")]
        assert list(ours.meta) == keys
        for key in keys:
            value = theirs.fields[key].contents()
            if isinstance(value, list) and value and not isinstance(value[0], str):
                assert np.array_equal(ours.meta[key], value), key
            else:
                assert ours.meta[key] == value, key
        assert list(ours.tensors) == [t.name for t in theirs.tensors]
        for t in theirs.tensors:
            mine = ours.tensors[t.name]
            assert (mine.shape, mine.kind, mine.nbytes) == (tuple(int(n) for n in t.shape[::-1]),
                                                            t.tensor_type, t.n_bytes)
            assert np.array_equal(ours.array(t.name),
                                  gguf.quants.dequantize(t.data, t.tensor_type)
                                  .reshape(mine.shape))


def test_the_panel_names_the_file_its_architecture_and_types(converter):
    path = converter(EXAMPLES / "tiny-llama", "q8_0")
    out = ok("forward", "--load", path, "--tokens", "1,284,291,297").stdout
    words = " ".join(out.replace("│", " ").split())
    assert f"weights GGUF file {path} (llama, 'Tiny Llama'; Q8_0 x16, F32 x5)" in words


def test_a_streamed_run_reads_what_the_whole_one_does(converter):
    path = converter(EXAMPLES / "tiny-llama", "q8_0")
    fields = reader.read_config(path)
    whole = reader.load_params(path, fields, np.float64)
    lazy = reader.lazy_params(path, fields, np.float64)
    assert list(lazy) == list(whole)
    for name in whole:
        assert np.array_equal(lazy[name], whole[name]) and lazy.meta(name)[0] == whole[name].shape
    streamed = ok("forward", "--load", path, "--tokens", "1,284,291,297", "--stream").stdout
    assert "a block at a time" in streamed


# ------------------------------------------------------------------ the tokenizer

VOCABS = ["llama-spm", "phi-3", "gpt-2", "llama-bpe", "qwen2", "starcoder", "falcon", "mpt",
          "refact", "command-r"]


@pytest.mark.parametrize("name", VOCABS)
def test_the_tokenizer_gives_llama_cpps_ids(llama_cpp, name):
    """llama.cpp's own vocab files and the ids its test-tokenizer-0 expects (add_special
    false): SentencePiece from scores, byte-level BPE from merges, each named pre-tokenizer."""
    path = llama_cpp / "models" / f"ggml-vocab-{name}.gguf"
    tokenizer = reader.find_tokenizer(path)
    texts = Path(f"{path}.inp").read_text(encoding="utf-8").split("\n__ggml_vocab_test__\n")
    expected = Path(f"{path}.out").read_text(encoding="utf-8").split("\n")
    assert len(texts) >= 40
    for text, ids in zip(texts, expected):
        assert tokenizer.encode(text, add_special=False) == [int(i) for i in ids.split()], text


def test_a_wrong_pre_tokenizer_gives_other_ids(llama_cpp, monkeypatch):
    """The pre-tokenizer matters: Qwen2's file read with GPT-2's patterns tokenizes some of
    llama.cpp's test texts otherwise, and the test above would fail."""
    from tfmcli.sources.gguf import vocab

    path = llama_cpp / "models" / "ggml-vocab-qwen2.gguf"
    texts = Path(f"{path}.inp").read_text(encoding="utf-8").split("\n__ggml_vocab_test__\n")
    right = [reader.find_tokenizer(path).encode(t, add_special=False) for t in texts]
    monkeypatch.setitem(vocab.PRE, "qwen2", vocab.PRE["gpt-2"])
    wrong = [reader.find_tokenizer(path).encode(t, add_special=False) for t in texts]
    assert sum(a != b for a, b in zip(right, wrong)) >= 3


@pytest.mark.parametrize("example, pre", [("tiny-llama", ""), ("tiny-gpt2", "gpt-2")])
def test_text_on_a_file_is_tokenized_as_the_folder_does(converter, tiny_gpt2, example, pre):
    folder = EXAMPLES / example
    path = converter(tiny_gpt2 if example == "tiny-gpt2" else folder, "f32", pre)
    texts = ["The dog saw the cat.", "The cat sat on the mat", "café 🦙"]
    for text in texts:
        from_file = tfmcli.load(path, text=text)
        from_folder = tfmcli.load(folder, text=text)
        assert np.array_equal(from_file.inputs.tokens, from_folder.inputs.tokens), text
        assert from_file.token_labels(0) == from_folder.token_labels(0)


# ------------------------------------------------------------------ bad files

def test_bad_files_are_one_line_naming_the_file(converter, tmp_path):
    good = converter(EXAMPLES / "tiny-llama", "q8_0").read_bytes()
    cases = {
        "empty.gguf": (b"", "not a GGUF file (0 bytes"),
        "magic.gguf": (b"GGML" + good[4:], "not a GGUF file (it starts b'GGML'"),
        "header.gguf": (good[:2000], "its header runs past the end of the file"),
        "data.gguf": (good[:len(good) - 100], "needs bytes"),
        "version.gguf": (good[:4] + (7).to_bytes(4, "little") + good[8:], "GGUF version 7"),
    }
    for name, (data, said) in cases.items():
        path = tmp_path / name
        path.write_bytes(data)
        line = error_line(run("forward", "--load", path, "--tokens", "1,2,3"), 1)
        assert str(path) in line and said in line, line


def write_gguf(path, arch="llama", tensors=None, **meta):
    writer = gguf.GGUFWriter(path, arch)
    for key, value in meta.items():
        writer.add_uint32(f"{arch}.{key}", value)
    for name, value in (tensors or {}).items():
        writer.add_tensor(name, value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_an_architecture_tfm_does_not_run_is_named(tmp_path):
    path = write_gguf(tmp_path / "mamba.gguf", "mamba", {"x": np.zeros(4, np.float32)})
    line = error_line(run("forward", "--load", path, "--tokens", "1,2"), 1)
    assert f"--load {path}: key 'general.architecture' is 'mamba'; tfm runs " in line, line
    assert "llama" in line and "gpt2" in line


def test_a_missing_key_or_tensor_is_named(converter, tmp_path):
    path = write_gguf(tmp_path / "keys.gguf", "llama", {"token_embd.weight":
                                                        np.zeros((8, 4), np.float32)},
                      embedding_length=4, block_count=1)
    line = error_line(run("forward", "--load", path, "--tokens", "1,2"), 1)
    assert f"{path}: missing key 'llama.attention.head_count'" in line, line
    source = converter(EXAMPLES / "tiny-llama", "f32")
    cut = rewritten(source, tmp_path / "cut.gguf", lambda t: None if t.name ==
                    "blk.1.ffn_gate.weight" else np.asarray(t.data))
    line = error_line(run("forward", "--load", cut, "--tokens", "1,2"), 1)
    assert f"{cut}: missing tensor 'blk.1.ffn_gate.weight'" in line, line


def test_without_gguf_the_line_says_how_to_install_it(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "gguf", None)
    path = tmp_path / "m.gguf"
    path.write_bytes(b"GGUF")
    result = run("forward", "--load", path, "--tokens", "1,2")   # (as a folder without hf)
    assert result.exit_code == 2 and "python -m pip install gguf" in result.output, result.output


def test_the_shipped_file_is_what_its_script_makes(converter, llama_cpp, tmp_path):
    """examples/tiny-llama.Q8_0.gguf, which docs/gguf.md runs on, is what examples/tiny_gguf.py
    makes with llama.cpp's converter today: the same metadata and tensors."""
    out = tmp_path / "tiny.gguf"
    done = subprocess.run([sys.executable, str(EXAMPLES / "tiny_gguf.py"), str(llama_cpp),
                           str(out)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    shipped, made = GgufFile(EXAMPLES / "tiny-llama.Q8_0.gguf"), GgufFile(out)
    assert shipped.meta.keys() == made.meta.keys()
    for key, value in made.meta.items():
        assert np.array_equal(shipped.meta[key], value) if isinstance(value, np.ndarray) \
            else shipped.meta[key] == value, key
    assert shipped.tensors == made.tensors
    for name in made.tensors:
        assert np.array_equal(shipped.array(name), made.array(name)), name


def hf_folder(folder: Path, kind: str, **config) -> Path:
    """A random Hugging Face model of ``kind`` ("Qwen2", "Qwen3") saved by its own
    ``save_pretrained`` in float32, weights O(1), 300 tokens, with tiny-gpt2's tokenizer (286:
    the converter adds the rest, and Qwen's tokenizer class an <|endoftext|>) for
    the converter to write."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    sizes = dict(vocab_size=300, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, intermediate_size=48, max_position_embeddings=64,
                 rms_norm_eps=1e-6, tie_word_embeddings=False)
    model = getattr(transformers, f"{kind}ForCausalLM")(
        getattr(transformers, f"{kind}Config")(**{**sizes, **config}))
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.3)
            if p.dim() == 1:   # norm gains (and biases) about 1
                p.add_(1.0)
    model.save_pretrained(folder)
    shutil.copy(EXAMPLES / "tiny-gpt2" / "tokenizer.json", folder)
    (folder / "tokenizer_config.json").write_text('{"tokenizer_class": '
                                                  '"PreTrainedTokenizerFast"}')
    return folder


@pytest.mark.parametrize("kind, config", [("Qwen2", {}), ("Qwen3", {"head_dim": 16})])
def test_a_qwen_file_runs_as_its_folder(converter, tmp_path, kind, config):
    """Qwen2 (biases on Q, K and V) and Qwen3 (q and k norms, heads 16 wide where width / heads
    is 8): not permuted by the converter, and read so."""
    folder = hf_folder(tmp_path / kind, kind, **config)
    assert_same_run(converter(folder, "f32", pre="gpt-2"), folder, GPT2_TOKENS)


def test_a_llama_3_1_file_carries_its_rope_scaling_as_factors(converter, tmp_path):
    """LLaMA 3.1's RoPE scaling: the converter writes no parameters, only one factor per pair
    (``rope_freqs.weight``); tfm finds the (factor, 1, 4, 8192) that gives them, and the run
    is the folder's. Factors no such scaling gives are refused."""
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    folder = hf_folder(tmp_path / "llama31", "Llama", rope_theta=500000.0,
                       rope_scaling=scaling, head_dim=16)
    path = converter(folder, "f32", pre="gpt-2")
    factors = tfmcli.sources.gguf.reader.open_file(path).array("rope_freqs.weight")
    assert factors.min() == 1.0 and factors.max() == 8.0   # some pairs scaled, some not
    assert_same_run(path, folder, GPT2_TOKENS)
    fields = tfmcli.sources.gguf.reader.read_config(path)
    assert tuple(fields["rope_scaling"]) == (8.0, 1.0, 4.0, 8192)
    bent = rewritten(path, tmp_path / "bent.gguf", lambda t: np.asarray(t.data) ** (
        1.1 if t.name == "rope_freqs.weight" else 1))
    line = error_line(run("forward", "--load", bent, "--tokens", "1,2"), 1)
    assert "'rope_freqs.weight' holds RoPE factors" in line and "will not guess" in line
