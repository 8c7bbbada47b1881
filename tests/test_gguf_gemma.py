"""GGUF files of Gemma, Gemma 2, Gemma 3, Phi-3 and StableLM (``sources.gguf.gemma``): random
Hugging Face models saved by their own ``save_pretrained`` in float32, converted by llama.cpp's
own converter (``test_gguf``'s fixtures) to F32 and BF16, run as their folders do: the same
Config, parameters, logits, loss and every gradient to 1e-12 of scale. Their Q8_0 and F16 files
and their F32 files re-quantized to Q4_0 and Q5_1 run as the folders of the weights they
decode to (``test_gguf.decoded_folder``), Phi-3's also against Hugging Face's autograd on
them, each block of 32 along the rows the file stores. The traps each have a
test: Gemma's norms stored as ``1 + w`` (read otherwise, the logits move; added in float32,
they are a float32 run's gammas), the scale no key records (Gemma 2's 27B), the rows Gemma 3's
converter cuts from the embedding, StableLM's ``use_parallel_residual`` key that does not
describe the model, and what tfm refuses (LongRoPE, per-head q and k layer norms, a Gemma 3
score cap).
"""

from __future__ import annotations

import io
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import test_gguf
from test_gguf import (
    EXAMPLES,
    GPT2_TOKENS,
    assert_blocks_along_the_inputs,
    assert_runs_as_what_it_decodes_to,
    assert_same_run,
    forward_backward,
    stored_weights,
    typed_file,
)

import tfmcli
from helpers import assert_scaled_close, error_line, run
from tfmcli.sources.gguf import archs, gemma
from tfmcli.sources.gguf.file import GgufFile

gguf = pytest.importorskip("gguf")
# test_gguf's fixtures, which pytest finds by their names here: llama.cpp's source, fetched
# once, and its converter
llama_cpp, converter, plain_env = test_gguf.llama_cpp, test_gguf.converter, test_gguf.plain_env
decoded = test_gguf.decoded

SIZES = dict(vocab_size=300, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, intermediate_size=48, max_position_embeddings=64)
TEXT = ["The dog saw the cat.", "The cat sat on the mat.", "A bird flew over the house.",
        "Numbers like 12, 345 and 6789 are tokens too.", "café au lait, naïve résumé"]


@pytest.fixture(scope="session")
def sentencepiece_model() -> bytes:
    """A SentencePiece model (tokenizer.model) of at most 300 pieces with byte fallback, as
    Gemma's and Phi-3's converters read their vocabulary from one."""
    spm = pytest.importorskip("sentencepiece")
    out = io.BytesIO()
    spm.SentencePieceTrainer.train(sentence_iterator=iter(TEXT * 20), model_writer=out,
                                   vocab_size=300, model_type="bpe", byte_fallback=True,
                                   hard_vocab_limit=False, minloglevel=2)
    return out.getvalue()


def saved_model(folder: Path, kind: str, spm: bytes, vocab: str = "sentencepiece",
                bfloat16: bool = True, **config) -> Path:
    """A random Hugging Face model of ``kind`` ("Gemma2", "Phi3", ...) saved to ``folder`` by
    ``save_pretrained`` in float32, its weights O(1) (norm gains and biases about 1) and,
    ``bfloat16``, each a bfloat16 number (as Gemma ships: then ``1 + w`` is exact in float32,
    and a BF16 file holds the weights exactly), with a ``tokenizer.model`` (``spm``) or
    tiny-gpt2's ``tokenizer.json``."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    settings = getattr(transformers, f"{kind}TextConfig" if kind == "Gemma3" else
                       f"{kind}Config")(**{**SIZES, **config})
    model = getattr(transformers, f"{kind}ForCausalLM")(settings)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.3)
            if p.dim() == 1:
                p.add_(1.0)
            if bfloat16:
                p.copy_(p.to(torch.bfloat16).to(torch.float32))
    model.save_pretrained(folder)
    if vocab == "sentencepiece":
        (folder / "tokenizer.model").write_bytes(spm)
    else:
        shutil.copy(EXAMPLES / "tiny-gpt2" / "tokenizer.json", folder)
        (folder / "tokenizer_config.json").write_text('{"tokenizer_class": '
                                                      '"PreTrainedTokenizerFast"}')
    return folder


@pytest.fixture
def hf_model(tmp_path, sentencepiece_model):
    """make(kind, vocab="sentencepiece" | "gpt-2", bfloat16=True, **config) -> a random Hugging
    Face model of ``kind`` (``saved_model``) in a folder of its own."""
    made = []

    def make(kind: str, vocab: str = "sentencepiece", bfloat16: bool = True, **config) -> Path:
        folder = tmp_path / f"{kind}-{len(made)}"   # (the converter keeps a file per folder)
        made.append(folder)
        return saved_model(folder, kind, sentencepiece_model, vocab, bfloat16, **config)

    return make


# ------------------------------------------------------------------ each file runs as its folder

GEMMA3_ROPE = {"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
               "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}
CASES = {   # name: (kind, config, what the file's Config must show)
    "gemma": ("Gemma", {"head_dim": 16},
              {"head_dim": 16, "embed_scale": True, "tied_head": True, "activation": "geglu"}),
    "gemma2": ("Gemma2", {"head_dim": 16, "query_pre_attn_scalar": 16, "sliding_window": 3},
               {"attn_softcap": 50.0, "logit_softcap": 30.0, "sliding_window": 3,
                "sliding_layers": (0,), "sandwich_norm": True, "attn_scale": None}),
    "gemma3": ("Gemma3", {"head_dim": 8, "query_pre_attn_scalar": 8, "sliding_window": 3,
                          "num_hidden_layers": 7, "rope_parameters": GEMMA3_ROPE},
               {"qk_norm": True, "sliding_layers": (0, 1, 2, 3, 4, 6), "rope_theta": 1e6,
                "rope_local_theta": 10000.0, "attn_softcap": None, "logit_softcap": None}),
    "phi3": ("Phi3", {"partial_rotary_factor": 0.5, "sliding_window": 3, "pad_token_id": 0},
             {"rotary_dim": 4, "sliding_window": 3, "sliding_layers": None,
              "tied_head": False, "eps": 1e-5}),
    "stablelm": ("StableLm", {"use_qkv_bias": True},
                 {"rotary_dim": 2, "rms_norm": False, "qkv_bias": True,
                  "parallel_residual": False}),
    "stablelm-parallel": ("StableLm", {"use_parallel_residual": True, "partial_rotary_factor": 0.5},
                          {"rotary_dim": 4, "parallel_residual": True, "shared_norm": True,
                           "qkv_bias": False}),
}


@pytest.mark.parametrize("name", CASES)
def test_a_file_runs_as_its_folder(converter, hf_model, name):
    """Each architecture's F32 file: the Config read from its metadata is the folder's (with
    the variant each case sets: Gemma 2's caps and sliding even layer, Gemma 3's local and
    global layers at their two RoPE bases, Phi-3's partial RoPE and fused weights, StableLM's
    layer norms, Q, K, V biases and parallel block), and so are the parameters, the logits and
    every gradient."""
    kind, config, shown = CASES[name]
    folder = hf_model(kind, "gpt-2" if kind == "StableLm" else "sentencepiece", **config)
    path = converter(folder, "f32", pre="gpt-2")
    assert GgufFile(path).meta["general.architecture"] == name.split("-")[0]
    assert_same_run(path, folder, GPT2_TOKENS)
    cfg = tfmcli.load(path, tokens=GPT2_TOKENS).cfg
    assert {field: getattr(cfg, field) for field in shown} == shown


@pytest.mark.parametrize("name", ["gemma3", "phi3"])
def test_a_bf16_file_of_bfloat16_weights_runs_as_its_folder(converter, hf_model, name):
    """BF16 files hold bfloat16 weights exactly (the norms stay F32: Gemma 3's ``1 + w``, q and
    k norms too; Phi-3's fused matrices in BF16)."""
    kind, config, _ = CASES[name]
    folder = hf_model(kind, **config)
    path = converter(folder, "bf16")
    assert GgufFile(path).kinds()["BF16"] > 0
    assert_same_run(path, folder, GPT2_TOKENS)


# ------------------------------------------------------------------ the traps

def test_gemmas_norms_read_as_hugging_faces_weights_fail(converter, hf_model, monkeypatch):
    """The file's norm is ``1 + w``, tfm's gamma as it stands: taking the converter's 1 off (the
    weight Hugging Face holds, as if tfm's norm multiplied by it) or adding Gemma's 1 once more
    gives another model, whose logits move by more than 1e-3 of their scale."""
    kind, config, _ = CASES["gemma2"]
    path = converter(hf_model(kind, **config), "f32")
    _, good, _ = forward_backward(path, GPT2_TOKENS)
    right = gemma.ARCHS["gemma2"]
    for shift in (-1.0, 1.0):
        def shifted(key, w, fields, shift=shift):
            return w + shift if key.endswith("norm.weight") else w
        monkeypatch.setitem(gemma.ARCHS, "gemma2", right._replace(undo=shifted))
        _, bad, _ = forward_backward(path, GPT2_TOKENS)
        off = np.abs(bad.acts["logits"] - good.acts["logits"]).max()
        assert off > 1e-3 * np.abs(good.acts["logits"]).max(), (shift, off)


def test_gemmas_norms_are_added_in_float32(converter, hf_model):
    """Norm weights that are not bfloat16 numbers: the converter's ``w + 1`` rounds to float32.
    The file's gammas are then exactly a float32 run's of the folder (which adds in float32 as
    Hugging Face does), and off the folder's float64 sums by at most half a float32 step of
    ``1 + w``; the matrices are exact."""
    folder = hf_model("Gemma", bfloat16=False, head_dim=16)
    path = converter(folder, "f32")
    ours = tfmcli.load(path, tokens=GPT2_TOKENS).params
    exact = tfmcli.load(folder, tokens=GPT2_TOKENS).params
    single = tfmcli.load(folder, tokens=GPT2_TOKENS, dtype="float32").params
    gammas = [name for name in exact if name.endswith(".gamma")]
    assert len(gammas) == 5
    rounded = 0
    for name, value in exact.items():
        if name in gammas:
            assert np.array_equal(ours[name], single[name].astype(np.float64)), name
            step = np.spacing(np.abs(value).astype(np.float32)).astype(np.float64)
            assert np.all(np.abs(ours[name] - value) <= step / 2), name
            rounded += int(np.count_nonzero(ours[name] != value))
        else:
            assert np.array_equal(ours[name], value), name
    assert rounded > 32   # (58 of the 160 here: a sum in [2, 4) loses a weight's last bits)


def test_gemma2s_27b_scales_its_scores_by_width_over_heads(converter, hf_model):
    """No key records ``query_pre_attn_scalar``: llama.cpp scales the scores of a 46-block Gemma
    2 (the 27B) by 1 / sqrt(width / heads), of any other by 1 / sqrt(head width), as Google's
    configs do (27B: 4608 / 32 = 144 with heads of 128). A 46-block folder so made runs as its
    file; the same scalar in 2 blocks is a scale the file cannot say, and the runs differ."""
    folder = hf_model("Gemma2", head_dim=16, query_pre_attn_scalar=8, sliding_window=3,
                      num_hidden_layers=46)
    path = converter(folder, "f32")
    assert tfmcli.load(path, tokens=GPT2_TOKENS).cfg.attn_scale == 8 ** -0.5
    assert_same_run(path, folder, GPT2_TOKENS)
    small = converter(hf_model("Gemma2", head_dim=16, query_pre_attn_scalar=8,
                               sliding_window=3, num_hidden_layers=3), "f32")
    assert tfmcli.load(small, tokens=GPT2_TOKENS).cfg.attn_scale is None   # 1 / sqrt(16)


def test_gemma3s_embedding_keeps_the_tokenizers_rows(converter, hf_model):
    """From a ``tokenizer.json`` Gemma 3's converter keeps only the tokenizer's rows of the
    embedding (of 300, tiny-gpt2's 286 and its added tokens): the file's vocabulary is
    those, and its logits are the folder's first columns (the head is tied)."""
    kind, config, _ = CASES["gemma3"]
    folder = hf_model(kind, "gpt-2", **config)
    path = converter(folder, "f32", pre="gpt-2")
    tokenizer = json.loads((folder / "tokenizer.json").read_text())
    kept = len(tokenizer["model"]["vocab"]) + len(tokenizer["added_tokens"])
    assert kept < SIZES["vocab_size"]
    ours, fwd, _ = forward_backward(path, GPT2_TOKENS)
    theirs, fwd_f, _ = forward_backward(folder, GPT2_TOKENS)
    assert ours.cfg.vocab == kept
    assert np.array_equal(ours.params["embed.W_E"], theirs.params["embed.W_E"][:kept])
    assert_scaled_close(fwd.acts["logits"], fwd_f.acts["logits"][..., :kept])


def test_stablelms_parallel_residual_key_is_not_read(converter, hf_model):
    """The converter writes ``use_parallel_residual`` true when the config it reads leaves the
    key out: a ``stablelm_epoch`` config.json (StableLM 3B 4E1T's first, read as it is since
    transformers does not know it) of the sequential block. tfm reads the block from the
    tensors (an ``ffn_norm``: sequential), as llama.cpp does, and runs as the folder."""
    folder = hf_model("StableLm", "gpt-2")
    epoch = folder.with_name("stablelm-epoch")
    shutil.copytree(folder, epoch)
    config = json.loads((folder / "config.json").read_text())
    del config["use_parallel_residual"]
    config.update(model_type="stablelm_epoch", architectures=["StableLMEpochForCausalLM"])
    (epoch / "config.json").write_text(json.dumps(config))
    path = converter(epoch, "f32", pre="gpt-2")
    assert GgufFile(path).meta["stablelm.use_parallel_residual"] is True
    assert tfmcli.load(path, tokens=GPT2_TOKENS).cfg.parallel_residual is False
    assert_same_run(path, folder, GPT2_TOKENS)


def with_changes(source: Path, out: Path, keys: dict = (), tensors: dict = ()) -> Path:
    """``source`` with ``keys`` (name -> float) and ``tensors`` (name -> array) added."""
    return test_gguf.rewritten(source, out, keys={name: (value, gguf.GGUFValueType.FLOAT32)
                                                  for name, value in dict(keys).items()},
                               more=tensors)


@pytest.mark.parametrize("name, keys, tensors, said", [
    ("phi3", {}, {"rope_factors_long.weight": np.ones(2, np.float32)},
     "tensor 'rope_factors_long.weight' holds LongRoPE's factors"),
    ("stablelm", {}, {"blk.0.attn_q_norm.weight": np.ones((4, 8), np.float32)},
     "tensor 'blk.0.attn_q_norm.weight' is a layer norm of each head's q"),
    ("gemma3", {"gemma3.attn_logit_softcapping": 50.0}, {},
     "key 'gemma3.attn_logit_softcapping' is 50.0, which Gemma 3 does not apply"),
])
def test_what_tfm_cannot_run_is_one_line(converter, hf_model, tmp_path, name, keys, tensors,
                                         said):
    """Phi-3's LongRoPE (its per-pair factors as tensors), StableLM 2 12B's per-head q and k
    layer norms (which this converter cannot write: it fails on them) and a Gemma 3 whose
    scores would be capped: one line naming the file and the key or tensor, exit 1."""
    kind, config, _ = CASES[name]
    source = converter(hf_model(kind, "gpt-2" if kind == "StableLm" else "sentencepiece",
                                **config), "f32", pre="gpt-2")
    path = with_changes(source, tmp_path / f"{name}.gguf", keys, tensors)
    line = error_line(run("forward", "--load", path, "--tokens", "1,2,3"), 1)
    assert f"--load {path}: {said}" in line, line


def test_each_is_registered():
    """Every architecture of this module is one ``archs.every_arch`` reads, of its family."""
    every = archs.every_arch()
    for name in ("gemma", "gemma2", "gemma3", "phi3", "stablelm"):
        assert every[name] is gemma.ARCHS[name] and every[name].family == name


# ------------------------------------------------------------------ quantized files

@pytest.fixture(scope="session")
def case_folders(tmp_path_factory, sentencepiece_model):
    """folder(name) -> CASES[name]'s model, made once (each of its files is converted several
    times), of float32 weights that are not bfloat16 numbers: an F16 file rounds them, and the
    norms' ``1 + w`` is float32's sum."""
    made = {}

    def folder(name: str) -> Path:
        if name not in made:
            kind, config, _ = CASES[name]
            made[name] = saved_model(tmp_path_factory.mktemp("models") / f"quantized-{name}",
                                     kind, sentencepiece_model,
                                     "gpt-2" if kind == "StableLm" else "sentencepiece",
                                     bfloat16=False, **config)
        return made[name]
    return folder


def quantized_file(converter, case_folders, tmp_path, name, kind) -> tuple[Path, Path]:
    """(CASES[name]'s GGUF file of type ``kind``, its folder)."""
    folder = case_folders(name)
    return typed_file(lambda f, outtype: converter(f, outtype, "gpt-2"), folder, kind,
                      tmp_path), folder


def decoded_of(decoded, converter, folder, path) -> Path:
    return decoded(folder, path, lambda f: converter(f, "f32", "gpt-2"))


# every case in Q8_0 (the converter's) and re-quantized to Q4_0 and Q5_1 (gguf.quants'); an
# F16 file of each architecture
QUANTIZED = [(name, kind) for name in CASES for kind in ("q8_0", "Q4_0", "Q5_1")] + [
    (name, "f16") for name in ("gemma", "gemma2", "gemma3", "phi3", "stablelm")]


@pytest.mark.parametrize("name, kind", QUANTIZED)
def test_a_quantized_file_runs_as_the_folder_of_what_it_decodes_to(converter, case_folders,
                                                                   decoded, tmp_path, name,
                                                                   kind):
    """Each file runs as the folder of the weights it decodes to (``test_gguf.decoded_folder``,
    made with gguf's reader, not tfm's, and the folder's own config; the converter's 1 taken
    off Gemma's norms, which stay F32): Phi-3's fused matrices cut after decoding, the FFN's
    output, 48 wide, F16 in the Q8_0 file and F32 in the re-quantized ones (no block of 32
    fits its rows)."""
    path, folder = quantized_file(converter, case_folders, tmp_path, name, kind)
    assert GgufFile(path).kinds()[kind.upper()] > 0
    norms = [key for key in stored_weights(folder) if key.endswith("norm.weight")]
    assert_runs_as_what_it_decodes_to(path, folder, decoded_of(decoded, converter, folder, path),
                                      GPT2_TOKENS, len(norms) if name.startswith("gemma") else 0)


@pytest.mark.parametrize("name, count", [("gemma", 13), ("gemma2", 13), ("gemma3", 43),
                                         ("phi3", 14), ("stablelm", 14),
                                         ("stablelm-parallel", 14)])
def test_each_block_lies_along_the_rows_the_file_stores(converter, case_folders, tmp_path, name,
                                                        count):
    """Every parameter read from a Q8_0 tensor lies in blocks of one scale down its columns
    (the rows the file stores), not across them: Phi-3's W_Q, W_K and W_V cut from one fused
    tensor's rows, W_gate and W_1 from another's; the embedding, the head when untied and six
    matrices a block (the FFN's output, 48 wide, stays F16)."""
    path, _ = quantized_file(converter, case_folders, tmp_path, name, "q8_0")
    checked = assert_blocks_along_the_inputs(path)
    assert len(checked) == count, checked


@pytest.mark.parametrize("kind", ["q8_0", "Q4_0"])
def test_a_quantized_phi3_file_is_hugging_faces_autograd_on_what_it_decodes_to(
        converter, case_folders, decoded, tmp_path, kind):
    """Phi-3's file (q, k and v fused in one tensor, the gate and up projections in another)
    against Hugging Face's own model of the weights it decodes to (``from_pretrained``,
    float64, ``loss.backward()``): the loss, the logits and every gradient to 1e-12, the fused
    ones cut as its attention and MLP cut them."""
    transformers = pytest.importorskip("transformers")
    from helpers import assert_folder_matches_hf

    path, folder = quantized_file(converter, case_folders, tmp_path, "phi3", kind)
    theirs = decoded_of(decoded, converter, folder, path)
    assert_folder_matches_hf(transformers.Phi3ForCausalLM, theirs,
                             tfmcli.load(path, tokens=GPT2_TOKENS))
