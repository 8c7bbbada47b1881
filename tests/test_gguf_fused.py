"""GGUF files of the architectures whose attention weights are fused (``gguf.fused``):
StarCoder (gpt_bigcode), GPT-NeoX, Falcon, BLOOM and MPT, written by llama.cpp's own converter
from random Hugging Face models that ``save_pretrained`` wrote in float32, run as their folders
do (Config, parameters, logits, loss and every gradient to 1e-12 of scale); the converter's
reorder of q, k and v undone (undone wrongly, the logits move); their Q8_0 and F16 files and
their F32 files re-quantized to Q4_0 and Q5_1 run as the folders of the weights they decode to
(``test_gguf.decoded_folder``), StarCoder's and Falcon's also against Hugging Face's autograd
on them, each block of 32 along the rows the file stores (a fused tensor's reorder undone
wrongly, or its blocks decoded wrongly, fails); what tfm cannot run refused in one line naming
the file and the key.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest
import test_gguf
from test_gguf import (  # noqa: F401
    CONVERT,
    EXAMPLES,
    GPT2_TOKENS,
    assert_blocks_along_the_inputs,
    assert_planted_bug_fails,
    assert_runs_as_what_it_decodes_to,
    assert_same_run,
    decoded_wrongly,
    forward_backward,
    in_numpys_shape,
    llama_cpp,
    plain_env,
    rewritten,
    typed_file,
)

import tfmcli
from helpers import assert_folder_matches_hf, error_line, ok, run

gguf = pytest.importorskip("gguf")

from tfmcli.sources.gguf import fused  # noqa: E402
from tfmcli.sources.gguf.file import GgufFile  # noqa: E402

decoded = test_gguf.decoded   # a fixture, which pytest finds by its name here

SIZES = {"GPTBigCode": dict(n_embd=32, n_layer=2, n_head=4, n_positions=64),
         "GPTNeoX": dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                         intermediate_size=48, max_position_embeddings=64),
         "Falcon": dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4),
         "Bloom": dict(hidden_size=32, n_layer=2, n_head=4),
         "Mpt": dict(d_model=32, n_layers=2, n_heads=4, max_seq_len=64)}
# name -> (Hugging Face class's prefix, config, config.json's keys changed after saving)
MODELS = {
    "starcoder": ("GPTBigCode", dict(multi_query=True), {}),
    "starcoder-mha": ("GPTBigCode", dict(multi_query=False), {}),
    "neox": ("GPTNeoX", dict(rotary_pct=0.5, use_parallel_residual=True), {}),
    "neox-seq": ("GPTNeoX", dict(rotary_pct=0.25, use_parallel_residual=False,
                                 attention_bias=False, tie_word_embeddings=True), {}),
    # 40B's: two norms, 2 key heads; Falcon 2's: one norm; 7B's: one key head (its config
    # names none, and transformers fills in num_kv_heads = heads, which the converter reads:
    # a config saying 1, which Hugging Face's old block ignores, is what it converts); a key
    # head each
    "falcon-40b": ("Falcon", dict(new_decoder_architecture=True, num_kv_heads=2,
                                  tie_word_embeddings=False), {}),
    "falcon-11b": ("Falcon", dict(new_decoder_architecture=True, num_kv_heads=2,
                                  num_ln_in_parallel_attn=1), {}),
    "falcon-7b": ("Falcon", dict(multi_query=True, parallel_attn=True), {"num_kv_heads": 1}),
    "falcon-mha": ("Falcon", dict(multi_query=False, parallel_attn=True), {}),
    "bloom": ("Bloom", {}, {}),
    # the converter knows MosaicML's own class name (their folders'), not transformers' Mpt
    "mpt": ("Mpt", {}, {"architectures": ["MPTForCausalLM"]}),
}
# llama.cpp's GPTNeoXModel reads hparams["rotary_pct"], which transformers 5's GPTNeoXConfig
# moves into rope_parameters (its to_dict has no rotary_pct): the converter is handed the key
# as transformers 4 kept it, nothing else changed
ROTARY_PCT = """
load_hparams = conversion.base.ModelBase.load_hparams
def with_rotary_pct(dir_model, *args):
    hparams = load_hparams(dir_model, *args)
    if hparams.get("model_type") == "gpt_neox" and "rotary_pct" not in hparams:
        hparams["rotary_pct"] = hparams["rope_parameters"]["partial_rotary_factor"]
    return hparams
conversion.base.ModelBase.load_hparams = staticmethod(with_rotary_pct)
"""


def hf_model(folder: Path, name: str, bf16: bool = False) -> Path:
    """MODELS[name], random, saved by its own ``save_pretrained`` in float32, weights O(1)
    (norm gains and biases about 1), 300 tokens, with tiny-gpt2's tokenizer (as
    ``test_gguf.hf_folder``); ``bf16``: every weight a bfloat16 number, so that a BF16 file
    holds it exactly."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    kind, config, edits = MODELS[name]
    torch.manual_seed(0)
    model = getattr(transformers, f"{kind}ForCausalLM")(
        getattr(transformers, f"{kind}Config")(vocab_size=300, **SIZES[kind], **config))
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.3)
            if p.dim() == 1:
                p.add_(1.0)
            if bf16:
                p.copy_(p.bfloat16().float())
    model.save_pretrained(folder)
    saved = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**saved, **edits}, indent=2))
    shutil.copy(EXAMPLES / "tiny-gpt2" / "tokenizer.json", folder)
    (folder / "tokenizer_config.json").write_text('{"tokenizer_class": '
                                                  '"PreTrainedTokenizerFast"}')
    return folder


@pytest.fixture(scope="session")
def fused_converter(llama_cpp, tmp_path_factory):  # noqa: F811 (the fixture imported above)
    """convert(folder, outtype) -> the GGUF file the converter writes of ``folder``, each
    made once: the converter run as ``test_gguf.converter`` runs it (GPT-2's pre-tokenizer
    named for tiny-gpt2's tokenizer), GPT-NeoX's handed its rotary_pct."""
    for name in ("torch", "transformers", "sentencepiece"):
        pytest.importorskip(name, reason=f"llama.cpp's convert_hf_to_gguf.py needs {name}")
    script = CONVERT.replace("sys.argv = [", ROTARY_PCT + "sys.argv = [", 1)
    assert script != CONVERT
    out = Path(tempfile.mkdtemp(prefix="tfm-gguf-fused-"))
    made = {}

    def convert(folder: Path, outtype: str) -> Path:
        if (folder, outtype) not in made:
            path = out / f"{len(made)}-{folder.name}-{outtype}.gguf"   # (names may repeat)
            done = subprocess.run([sys.executable, "-c", script, str(llama_cpp), str(folder),
                                   str(path), outtype, "gpt-2"], capture_output=True, text=True)
            assert done.returncode == 0, done.stderr[-3000:]
            made[folder, outtype] = path
        return made[folder, outtype]

    yield convert
    shutil.rmtree(out, ignore_errors=True)


@pytest.fixture(scope="session")
def fused_files(fused_converter, tmp_path_factory):
    """file(name, outtype="f32") -> (the GGUF file the converter writes, the folder), each
    made once (the BF16 file's folder of bfloat16 numbers, the others' one folder)."""
    folders = {}

    def file(name: str, outtype: str = "f32") -> tuple[Path, Path]:
        bf16 = outtype == "bf16"
        if (name, bf16) not in folders:
            folders[name, bf16] = hf_model(tmp_path_factory.mktemp("models") / name, name,
                                           bf16)
        return fused_converter(folders[name, bf16], outtype), folders[name, bf16]

    return file


# ------------------------------------------------------------------ files run as their folders

def test_a_starcoder_file_runs_as_its_folder(fused_files):
    """One key head (multi_query): c_attn as Hugging Face stored it, every query head's rows,
    then the key's, the value's; the file's head_count_kv is 1 and its feed_forward_length
    4 x width, whatever the model: neither is what tfm reads."""
    path, folder = fused_files("starcoder")
    assert GgufFile(path).meta["starcoder.attention.head_count_kv"] == 1
    assert_same_run(path, folder, GPT2_TOKENS)


def test_a_starcoder_file_of_a_key_head_each_runs_as_its_folder(fused_files):
    """multi_query false: the file still says head_count_kv 1 (llama.cpp cannot load it);
    attn_qkv's 96 rows say a key head each, interleaved head by head as Hugging Face keeps
    them (the converter leaves c_attn alone)."""
    path, folder = fused_files("starcoder-mha")
    file = GgufFile(path)
    assert file.meta["starcoder.attention.head_count_kv"] == 1
    assert file.tensors["blk.0.attn_qkv.weight"].shape == (96, 32)
    assert_same_run(path, folder, GPT2_TOKENS)


@pytest.mark.parametrize("name, outtype", [("neox", "f32"), ("neox", "bf16"),
                                           ("neox-seq", "f32")])
def test_a_gpt_neox_file_runs_as_its_folder(fused_files, name, outtype):
    """RoPE on half of each head (rope.dimension_count 4 of 8) and the parallel block; a
    sequential one with a quarter turned, no attention biases and a tied head. The BF16 file
    (every weight a bfloat16 number) holds the weights exactly: the same run."""
    path, folder = fused_files(name, outtype)
    file = GgufFile(path)
    assert file.meta["gptneox.rope.dimension_count"] == {"neox": 4, "neox-seq": 2}[name]
    # 4 matrices a block, the embedding and the head in BF16; the norms and biases in F32
    assert file.kinds()["BF16"] == (10 if outtype == "bf16" else 0)
    assert_same_run(path, folder, GPT2_TOKENS)


@pytest.mark.parametrize("name", ["falcon-40b", "falcon-11b", "falcon-7b", "falcon-mha"])
def test_a_falcon_file_runs_as_its_folder(fused_files, name):
    """The new architecture with two norms (ln_attn, ln_mlp: attn_norm_2 and attn_norm) and
    2 key heads, and with one norm (num_ln_in_parallel_attn 1); the old with one key head
    (multi_query), and with a key head each: each query_key_value reordered by the converter
    into every q, every k, every v, by its head_count_kv groups, and put back."""
    path, folder = fused_files(name)
    file = GgufFile(path)
    assert file.meta["falcon.attention.head_count_kv"] == {"falcon-40b": 2, "falcon-11b": 2,
                                                            "falcon-7b": 1, "falcon-mha": 4}[name]
    assert ("blk.0.attn_norm_2.weight" in file.tensors) == (name == "falcon-40b")
    assert_same_run(path, folder, GPT2_TOKENS)


def test_a_bloom_file_runs_as_its_folder(fused_files):
    """ALiBi, the embedding's norm (token_embd_norm), query_key_value put back head by head."""
    path, folder = fused_files("bloom")
    assert_same_run(path, folder, GPT2_TOKENS)


def test_an_mpt_file_runs_as_its_folder(fused_files):
    """Wqkv stored as it was (q, then k, then v), ALiBi of max_alibi_bias 8, no biases, layer
    norms without beta."""
    path, folder = fused_files("mpt")
    assert GgufFile(path).meta["mpt.attention.max_alibi_bias"] == 8
    assert_same_run(path, folder, GPT2_TOKENS)


@pytest.mark.parametrize("name", ["neox", "falcon-40b"])
def test_a_streamed_run_is_the_whole_ones(fused_files, name):
    """A block at a time (each fused tensor read once for W_Q, W_K and W_V, its reorder undone
    as it is read), the same loss to the last digit shown."""
    path, _ = fused_files(name)
    whole = ok("forward", "--load", path, "--tokens", "5,17,9,80", "--no-stream").stdout
    streamed = ok("forward", "--load", path, "--tokens", "5,17,9,80", "--stream").stdout
    assert "a block at a time" in streamed
    loss = [line for line in whole.splitlines() if line.startswith("loss = ")]
    assert loss and loss == [line for line in streamed.splitlines() if line.startswith("loss = ")]


# ------------------------------------------------------------------ the reorder undone wrongly

def moved(path, monkeypatch, wrong) -> float:
    """How far the logits move, as a share of their scale, with ``fused.regroup`` ``wrong``."""
    _, good, _ = forward_backward(path, GPT2_TOKENS)
    monkeypatch.setattr(fused, "regroup", wrong)
    _, bad, _ = forward_backward(path, GPT2_TOKENS)
    monkeypatch.undo()
    scale = np.abs(good.acts["logits"]).max()
    return float(np.abs(bad.acts["logits"] - good.acts["logits"]).max() / scale)


@pytest.mark.parametrize("name", ["neox", "falcon-40b", "falcon-mha", "bloom"])
def test_the_reorder_left_alone_fails(fused_files, monkeypatch, name):
    """Reading query_key_value as the file stores it (every q, every k, every v) as if it were
    Hugging Face's layout gives another model: the comparisons above would fail. (With one key
    head, Falcon-7B's, the two layouts are one: the converter's reorder changes nothing.)"""
    path, _ = fused_files(name)
    assert moved(path, monkeypatch, lambda w, fields: w) > 1e-3


@pytest.mark.parametrize("name", ["neox", "falcon-40b", "bloom"])
def test_the_reorder_done_again_fails(fused_files, monkeypatch, name):
    """The converter's permutation applied once more instead of undone (rows ``w[order]``,
    not put at ``order``): another model."""
    from tfmcli.sources import fused as folders

    path, _ = fused_files(name)
    assert moved(path, monkeypatch,
                 lambda w, fields: w[np.concatenate(folders.grouped_rows(fields))]) > 1e-3


def test_the_reorder_undone_is_the_converters_inverse():
    """regroup undoes the converter's own reshaping (its lines, in NumPy), for GPT-NeoX's and
    BLOOM's (H, 3, d_head) rows and Falcon's groups of queries, key and value."""
    rng = np.random.default_rng(0)
    H, dh, d = 4, 8, 32
    w = rng.standard_normal((3 * H * dh, d))
    neox = w.reshape(H, 3, dh, d)
    stored = np.concatenate([neox[:, i].reshape(-1, d) for i in range(3)])
    assert np.array_equal(fused.regroup(stored, dict(d_model=d, heads=H, kv_heads=None)), w)
    kv = 2
    w = rng.standard_normal(((H + 2 * kv) * dh, d))
    qkv = w.reshape(kv, H // kv + 2, dh, d)
    stored = np.concatenate([qkv[:, :-2].reshape(-1, d), qkv[:, [-2]].reshape(-1, d),
                             qkv[:, [-1]].reshape(-1, d)])
    assert np.array_equal(fused.regroup(stored, dict(d_model=d, heads=H, kv_heads=kv)), w)


# ------------------------------------------------------------------ what tfm does not run

F32, STRING, U32 = gguf.GGUFValueType.FLOAT32, gguf.GGUFValueType.STRING, \
    gguf.GGUFValueType.UINT32
REFUSED = [
    ("mpt", {"mpt.attention.max_alibi_bias": (0.0, F32)},
     "key 'mpt.attention.max_alibi_bias' is 0.0; tfm runs MPT with ALiBi's slopes of "
     "alibi_bias_max 8"),
    ("mpt", {"mpt.attention.clamp_kqv": (6.0, F32)},
     "key 'mpt.attention.clamp_kqv' is 6.0 (q, k and v clamped), which tfm does not compute"),
    ("mpt", {"mpt.attention.head_count_kv": (2, U32)},
     "key 'mpt.attention.head_count_kv' is 2, not 'mpt.attention.head_count' (4)"),
    ("falcon-7b", {"falcon.tensor_data_layout": ("Meta AI original pth", STRING)},
     "key 'falcon.tensor_data_layout' is 'Meta AI original pth'; tfm reads the converter's "
     "'jploski' layout"),
    ("falcon-7b", {"falcon.attention.head_count_kv": (3, U32)},
     "key 'falcon.attention.head_count_kv' (3) does not divide 'falcon.attention.head_count' "
     "(4)"),
    ("neox", {"gptneox.rope.scaling.type": ("yarn", STRING)},
     "key 'gptneox.rope.scaling.type' is 'yarn'; tfm turns gptneox's RoPE by its own angles"),
    ("neox", {"gptneox.rope.dimension_count": (3, U32)},
     "key 'gptneox.rope.dimension_count' is 3; RoPE turns pairs"),
    ("bloom", {"bloom.attention.head_count_kv": (1, U32)},
     "key 'bloom.attention.head_count_kv' is 1, not 'bloom.attention.head_count' (4)"),
    ("neox", {"gptneox.attention.layer_norm_epsilon": None},
     "missing key 'gptneox.attention.layer_norm_epsilon'"),
]


@pytest.mark.parametrize("name, changes, said", REFUSED)
def test_what_tfm_cannot_run_is_one_line_naming_the_file_and_key(fused_files, tmp_path, name,
                                                                  changes, said):
    path = rewritten(fused_files(name)[0], tmp_path / f"{name}.gguf", keys=changes)
    line = error_line(run("forward", "--load", path, "--tokens", "1,2,3"), 1)
    assert f"--load {path}: {said}" in line, line


def test_a_starcoder_file_of_other_key_heads_is_refused(fused_files, tmp_path):
    """GPTBigCode has one key head or one a head; attn_qkv's rows saying another count are
    refused, naming the tensor (head_count_kv, 1 whatever the model, says nothing)."""
    source, _ = fused_files("starcoder")
    def two_key_heads(tensor):
        value = in_numpys_shape(tensor)
        if tensor.name.endswith(("attn_qkv.weight", "attn_qkv.bias")):
            value = np.concatenate([value, value[-16:]])   # 2 key heads' rows
        return np.ascontiguousarray(value)
    out = rewritten(source, tmp_path / "kv2.gguf", two_key_heads)
    line = error_line(run("forward", "--load", out, "--tokens", "1,2,3"), 1)
    assert f"--load {out}: tensor 'blk.0.attn_qkv.weight' has 64 rows, neither one key " \
           f"head's (48, multi_query) nor one a head's (96)" in line, line


# ------------------------------------------------------------------ quantized files

# every model in Q8_0 (the converter's) and re-quantized to Q4_0 and Q5_1 (gguf.quants'); an
# F16 file of each architecture
QUANTIZED = [(name, kind) for name in MODELS for kind in ("q8_0", "Q4_0", "Q5_1")] + [
    (name, "f16") for name in ("starcoder", "neox", "falcon-40b", "bloom", "mpt")]


def quantized_file(fused_converter, fused_files, tmp_path, name, kind) -> tuple[Path, Path]:
    """(MODELS[name]'s GGUF file of type ``kind``, its folder)."""
    _, folder = fused_files(name)
    return typed_file(fused_converter, folder, kind, tmp_path), folder


def decoded_of(decoded, fused_converter, folder, path) -> Path:
    return decoded(folder, path, lambda f: fused_converter(f, "f32"))


@pytest.mark.parametrize("name, kind", QUANTIZED)
def test_a_quantized_file_runs_as_the_folder_of_what_it_decodes_to(
        fused_converter, fused_files, decoded, tmp_path, name, kind):
    """Each file runs as the folder of the weights it decodes to (``test_gguf.decoded_folder``,
    made with gguf's reader, not tfm's, and the folder's own config): the fused q, k and v
    decoded, then put back in Hugging Face's order (GPT-NeoX's 48 wide FFN output stays F16
    in the Q8_0 file, F32 in the re-quantized ones: no block of 32 fits its rows)."""
    path, folder = quantized_file(fused_converter, fused_files, tmp_path, name, kind)
    assert GgufFile(path).kinds()[kind.upper()] > 0
    assert_runs_as_what_it_decodes_to(path, folder, decoded_of(decoded, fused_converter,
                                                               folder, path), GPT2_TOKENS)


@pytest.mark.parametrize("name, kind", [("starcoder", "q8_0"), ("falcon-40b", "q8_0"),
                                        ("falcon-40b", "Q5_1")])
def test_a_quantized_file_is_hugging_faces_autograd_on_what_it_decodes_to(
        fused_converter, fused_files, decoded, tmp_path, name, kind):
    """The file's run against Hugging Face's own model of the weights it decodes to
    (``from_pretrained``, float64, ``loss.backward()``): the loss, the logits and every
    gradient to 1e-12, cut from the fused gradients as each family's folder test cuts them."""
    transformers = pytest.importorskip("transformers")
    from test_falcon import falcon_grads, falcon_in_float64
    from test_gpt_bigcode import as_is, bigcode_grads

    path, folder = quantized_file(fused_converter, fused_files, tmp_path, name, kind)
    theirs = decoded_of(decoded, fused_converter, folder, path)
    run_ = tfmcli.load(path, tokens=GPT2_TOKENS)
    if name == "starcoder":
        assert_folder_matches_hf(transformers.GPTBigCodeForCausalLM, theirs, run_,
                                 to_float64=as_is, grads_of=bigcode_grads)
    else:
        assert_folder_matches_hf(transformers.FalconForCausalLM, theirs, run_,
                                 to_float64=falcon_in_float64,
                                 grads_of=lambda model: falcon_grads(model, run_.cfg))


@pytest.mark.parametrize("name", MODELS)
def test_each_block_lies_along_the_rows_the_file_stores(fused_converter, fused_files, tmp_path,
                                                        name):
    """Every parameter read from a Q8_0 tensor (W_Q, W_K and W_V each cut from the fused one)
    lies in blocks of one scale down its columns, the rows the file stores put back, not
    across them: the embedding, the head when untied (GPT-NeoX's, Falcon-40B's) and six
    matrices a block (five where GPT-NeoX's FFN output, 48 wide, stays F16)."""
    path, _ = quantized_file(fused_converter, fused_files, tmp_path, name, "q8_0")
    checked = assert_blocks_along_the_inputs(path)
    assert len(checked) == {"neox": 12, "neox-seq": 11, "falcon-40b": 14}.get(name, 13), checked


@pytest.mark.parametrize("how", ["left alone", "done again", "blocks reversed",
                                 "scales shifted"])
def test_a_quantized_fused_tensor_read_wrongly_fails(fused_converter, fused_files, decoded,
                                                     tmp_path, monkeypatch, how):
    """Falcon-40B's Q8_0 file (q, k and v of 2 key heads reordered by the converter, then
    quantized row by row) read with the reorder left alone or done again, or its blocks
    decoded wrongly (``test_gguf.decoded_wrongly``): the logits move by more than 1e-3 of
    their scale, and the comparison with the folder of what the file decodes to fails."""
    from tfmcli.sources import fused as folders

    path, folder = quantized_file(fused_converter, fused_files, tmp_path, "falcon-40b", "q8_0")
    theirs = decoded_of(decoded, fused_converter, folder, path)
    def plant():
        if how == "left alone":
            monkeypatch.setattr(fused, "regroup", lambda w, fields: w)
        elif how == "done again":
            monkeypatch.setattr(fused, "regroup", lambda w, fields: w[np.concatenate(
                folders.grouped_rows(fields))])
        else:
            monkeypatch.setattr(GgufFile, "array", decoded_wrongly(how))
    assert_planted_bug_fails(path, theirs, GPT2_TOKENS, plant)
