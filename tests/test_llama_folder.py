"""LLaMA checkpoint folders (``--load DIR`` with ``"model_type": "llama"``): Hugging Face's own
``save_pretrained`` folders in bfloat16, float16 and float32, one file or shards, the head tied
or not, read to the bit; Hugging Face's LlamaForCausalLM reading the same folder as the oracle
for loss, logits and every gradient; the safetensors reader; every bad folder; SentencePiece
tokens on the axes; the shipped ``examples/tiny-llama`` through every view.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

import tfmcli
from helpers import (
    assert_grads_match,
    error_line,
    in_float64,
    llama_grads,
    ok,
    run,
    tfm_grads_matching_hf,
)
from tfmcli.sources import llama, tensorfile

EXAMPLE = Path(__file__).parent.parent / "examples" / "tiny-llama"
SMALL = dict(vocab_size=40, hidden_size=16, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, intermediate_size=24, max_position_embeddings=32,
             rms_norm_eps=1e-5)


@pytest.fixture(autouse=True)
def plain_env(monkeypatch):
    for name in ("NO_COLOR", "FORCE_COLOR", "COLUMNS"):
        monkeypatch.delenv(name, raising=False)


def hf_folder(folder, dtype="bfloat16", shard=None, seed=0, **config):
    """A random LlamaForCausalLM saved by Hugging Face's own ``save_pretrained`` (weights drawn
    O(1), so that every number matters), in ``dtype``, sharded below ``shard`` bytes; returns
    its state in float64 under Hugging Face's names."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**{**SMALL, **config}))
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.5)
            if p.dim() == 1 and p.shape[0] == SMALL["hidden_size"]:   # norm gains about 1
                p.add_(1.0)
    model = model.to(getattr(torch, dtype))
    kwargs = {"max_shard_size": shard} if shard else {}
    model.save_pretrained(folder, **kwargs)
    return {k: v.double().numpy() for k, v in model.state_dict().items()}


def hf_model_of(folder, cfg):
    """Hugging Face's LlamaForCausalLM reading ``folder`` itself, in float64 throughout."""
    transformers = pytest.importorskip("transformers")
    model = transformers.LlamaForCausalLM.from_pretrained(folder, attn_implementation="sdpa")
    return in_float64(model.double().eval(), cfg)


# ---------------------------------------------------------------- reading to the bit


@pytest.mark.parametrize("dtype, shard, extra", [
    ("bfloat16", None, dict()),
    ("float32", "6KB", dict(tie_word_embeddings=True, rope_theta=500000.0)),
    ("float16", "4KB", dict(attention_bias=True, mlp_bias=True, num_key_value_heads=4)),
], ids=["bf16-one-file", "f32-shards-tied-theta", "f16-shards-biases"])
def test_hugging_face_folders_are_read_to_the_bit(tmp_path, dtype, shard, extra):
    state = hf_folder(tmp_path, dtype, shard, **extra)
    if shard:
        assert (tmp_path / "model.safetensors.index.json").is_file()
        assert len(list(tmp_path.glob("model-*.safetensors"))) > 1
    fields, params = llama.load_checkpoint(tmp_path, np.float64)
    cfg = tfmcli.Config(**fields)
    assert list(params) == list(tfmcli.engine.sizes.param_shapes(cfg))   # tfm's names, in its order
    assert cfg.rope_theta == extra.get("rope_theta", 10000.0)
    assert cfg.bias == extra.get("attention_bias", False)
    for key, name, transposed in llama.name_map(fields):
        want = state[key].T if transposed else state[key]
        np.testing.assert_array_equal(params[name], want, err_msg=key)
    if extra.get("tie_word_embeddings"):
        assert "head.W_U" not in params and cfg.tied_head


LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 100.0, "factor": 4.0,
               "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 128}   # pair 0 kept, pair 1 blended


@pytest.mark.parametrize("extra", [dict(), dict(tie_word_embeddings=True, rope_theta=500000.0,
                                                attention_bias=True, mlp_bias=True),
                                   dict(tie_word_embeddings=True, rope_parameters=LLAMA3_ROPE),
                                   dict(mlp_bias=True)],
                         ids=["untied", "tied-theta-biases", "tied-llama3-scaling",
                              "mlp-biases-alone"])
def test_matches_hugging_face_reading_the_same_folder(tmp_path, extra):
    """tfm --load and Hugging Face's from_pretrained on one bfloat16 folder: loss, logits and
    every parameter's gradient to 1e-12 (float64 on both sides), padding included. Scaled as
    LLaMA 3.2 is, Hugging Face's own frequencies are first checked equal to tfm's."""
    hf_folder(tmp_path, "bfloat16", **extra)
    run_ = tfmcli.load(tmp_path, tokens=[[1, 5, 9, 2, 7, 30], [3, 3, 8]])
    if "rope_parameters" in extra:
        assert run_.cfg.rope_scaling == (4.0, 1.0, 4.0, 128) and run_.cfg.rope_theta == 100.0
    else:
        assert run_.cfg.rope_scaling is None
    model = hf_model_of(tmp_path, run_.cfg)
    grads = tfm_grads_matching_hf(model, run_.params, run_.inputs, run_.cfg)
    theirs = llama_grads(model)
    assert set(theirs) == set(run_.params)
    assert_grads_match(grads, theirs)


def test_the_example_matches_hugging_face_and_its_tokenizer(tmp_path):
    """examples/tiny-llama read by Hugging Face: the same loss, logits and gradients on a text
    that LLaMA's tokenizer starts with '<s>' (id 1), as transformers' tokenizer does."""
    transformers = pytest.importorskip("transformers")
    text = "The cat sat on the mat."
    run_ = tfmcli.load(EXAMPLE, text=text)
    theirs = transformers.PreTrainedTokenizerFast(tokenizer_file=str(EXAMPLE / "tokenizer.json"))
    assert run_.inputs.tokens[0].tolist() == theirs(text)["input_ids"]
    assert run_.inputs.tokens[0, 0] == 1 and run_.token_labels(0)[:3] == ["<s>", "␣The", "␣cat"]
    model = hf_model_of(EXAMPLE, run_.cfg)
    grads = tfm_grads_matching_hf(model, run_.params, run_.inputs, run_.cfg)
    assert_grads_match(grads, llama_grads(model))


def test_bfloat16_widens_exactly_and_float32_keeps_the_numbers():
    _, as64 = llama.load_checkpoint(EXAMPLE, np.float64)
    _, as32 = llama.load_checkpoint(EXAMPLE, np.float32)
    for name, value in as64.items():
        assert as32[name].dtype == np.float32
        np.testing.assert_array_equal(as32[name].astype(np.float64), value, err_msg=name)
        # a bfloat16's float32 has its low 16 bits 0
        assert not (as32[name].view(np.uint32) & 0xFFFF).any(), name


# ---------------------------------------------------------------- the safetensors reader


def test_the_reader_agrees_with_safetensors_and_the_writer_rounds_as_torch(tmp_path):
    torch = pytest.importorskip("torch")
    from safetensors.torch import load_file, save_file

    x = torch.randn(5, 7, dtype=torch.float64) * 100
    x[0, :4] = torch.tensor([1.00390625, 1.01171875, float("inf"), -0.0])   # ties, inf, -0
    save_file({"b": x.to(torch.bfloat16), "f": x.float(), "h": x.half(), "d": x}, tmp_path / "t")
    header, start = tensorfile.read_header(tmp_path / "t")
    for key, dtype in (("b", torch.bfloat16), ("f", torch.float32), ("h", torch.float16),
                       ("d", torch.float64)):
        ours = tensorfile.read_tensor(tmp_path / "t", header, start, key)
        np.testing.assert_array_equal(ours, x.to(dtype).double().numpy(), err_msg=key)
    tensorfile.write(tmp_path / "w", {"x": x.float().numpy()}, bfloat16=True)
    assert torch.equal(load_file(tmp_path / "w")["x"], x.float().to(torch.bfloat16))


def test_a_tensor_read_transposed_into_a_dtype_in_blocks_is_the_plain_read(tmp_path):
    """read_tensor(..., dtype, transpose) makes its matrix a block of rows at a time: on 150
    rows (blocks of 64, the last cut short), a vector, a 3-d tensor and a float16 matrix, stored
    as they are or in bfloat16, it gives the plain read, transposed and cast, to the bit."""
    rng = np.random.default_rng(3)
    tensors = {"m": rng.normal(size=(150, 7)), "v": rng.normal(size=9),
               "c": rng.normal(size=(70, 3, 2)), "h": rng.normal(size=(80, 5)).astype(np.float16)}
    for bfloat16 in (True, False):
        tensorfile.write(tmp_path / "t", tensors, bfloat16=bfloat16)
        header, start = tensorfile.read_header(tmp_path / "t")
        for key in tensors:
            plain = tensorfile.read_tensor(tmp_path / "t", header, start, key)
            assert plain.dtype == (np.float32 if bfloat16 else tensors[key].dtype)
            for dtype in (np.float32, np.float64):
                for transpose in (False, True):
                    got = tensorfile.read_tensor(tmp_path / "t", header, start, key, dtype,
                                                 transpose)
                    want = plain.T if transpose else plain
                    assert got.dtype == dtype and got.flags.c_contiguous
                    np.testing.assert_array_equal(got, want.astype(dtype), err_msg=key)


# ---------------------------------------------------------------- bad folders


def good_folder(tmp_path) -> Path:
    folder = tmp_path / "ll"
    shutil.copytree(EXAMPLE, folder)
    return folder


def edit_config(folder, **changes):
    config = json.loads((folder / "config.json").read_text())
    config.update(changes)
    (folder / "config.json").write_text(json.dumps(config))


def rewrite_weights(folder, change):
    fields = llama.read_config(folder)
    tensors = llama.from_tfm(llama.load_params(folder, fields, np.float32), fields)
    change(tensors)
    tensorfile.write(folder / "model.safetensors", tensors)


@pytest.mark.parametrize("what, file, reason", [
    (lambda f: edit_config(f, rope_scaling={"rope_type": "yarn", "factor": 8.0}),
     "config.json", "key 'rope_scaling' has rope_type 'yarn'; tfm turns by RoPE's own angles "
                    "('default'), LLaMA 3.1's ('llama3') or linearly scaled ones ('linear')"),
    (lambda f: edit_config(f, rope_scaling={"rope_type": "llama3", "factor": 8.0}),
     "config.json", "key 'rope_scaling' has rope_type 'llama3' but no 'low_freq_factor'"),
    (lambda f: edit_config(f, rope_scaling={**LLAMA3_ROPE, "high_freq_factor": 0.5}),
     "config.json", "key 'rope_scaling': rope_scaling's high_freq_factor (0.5) must be above "
                    "its low_freq_factor (1)"),
    (lambda f: edit_config(f, hidden_act="relu"), "config.json",
     "key 'hidden_act' is 'relu'; tfm gates the FFN with 'silu' (swiglu), GELU's tanh "
     "form (geglu) or GELU itself, 'gelu' (geglu_erf)"),
    (lambda f: edit_config(f, attention_bias=True), "config.json",
     "key 'attention_bias' is true and 'mlp_bias' false; tfm adds biases to attention and the "
     "FFN (--bias), to the FFN alone (--ffn-bias) or to Q, K and V alone (--qkv-bias), and this "
     "model's would be on all of attention (o_proj too) and not in the MLP"),
    (lambda f: edit_config(f, mlp_bias="yes"), "config.json",
     "key 'mlp_bias' is 'yes', not true or false"),
    (lambda f: edit_config(f, head_dim=0), "config.json",
     "key 'head_dim' is 0, not a whole number in 1..2147483647"),
    (lambda f: edit_config(f, num_key_value_heads=3), "config.json",
     "kv_heads=3 does not divide heads=4; allowed kv_heads: 1, 2, 4"),
    (lambda f: edit_config(f, num_hidden_layers="2"), "config.json",
     "key 'num_hidden_layers' is '2', not a whole number"),
    (lambda f: edit_config(f, intermediate_size=None), "config.json",
     "missing key 'intermediate_size'"),
    (lambda f: rewrite_weights(f, lambda t: t.pop("model.layers.1.mlp.up_proj.weight")),
     "model.safetensors", "missing key 'model.layers.1.mlp.up_proj.weight'"),
    (lambda f: rewrite_weights(f, lambda t: t.update({"model.layers.0.mlp.gate_proj.weight":
                                                      np.zeros((64, 31), np.float32)})),
     "model.safetensors",
     "key 'model.layers.0.mlp.gate_proj.weight' has shape (64, 31), but config.json says (64, 32)"),
    (lambda f: rewrite_weights(f, lambda t: t.update({"model.layers.0.self_attn.q_proj.bias":
                                                      np.zeros(32, np.float32)})),
     "model.safetensors", "unknown key 'model.layers.0.self_attn.q_proj.bias'"),
    (lambda f: (f / "model.safetensors").write_bytes((f / "model.safetensors").read_bytes()[:-9]),
     "model.safetensors", "needs 20,224 and the file holds 77,623 after its header (truncated?)"),
    (lambda f: (f / "model.safetensors").write_bytes(b"\x10" + b"\0" * 7 + b"not json!" * 2),
     "model.safetensors", "not a safetensors file (its header is not JSON"),
    (lambda f: (f / "model.safetensors").unlink(), "ll",
     "no model.safetensors (or model.safetensors.index.json) there"),
], ids=["yarn-scaling", "llama3-incomplete", "llama3-bands-crossed", "gelu",
        "attention-biases-alone", "mlp-bias-text", "head-dim", "kv-heads", "a-string",
        "missing-key", "missing-weight",
        "wrong-shape", "unknown-key", "truncated", "not-json", "no-weights"])
def test_each_bad_folder_is_one_line_naming_file_and_key(tmp_path, what, file, reason):
    folder = good_folder(tmp_path)
    what(folder)
    line = error_line(run("forward", "--load", folder, "--tokens", "1,2,3"), 1)
    assert reason in line
    assert line.split(": ")[2].endswith(file)   # "tfm forward: error: --load <path>/<file>: ..."


def test_a_shard_the_index_names_must_be_there(tmp_path):
    hf_folder(tmp_path, "float32", "6KB")
    shard = sorted(tmp_path.glob("model-*.safetensors"))[-1]
    shard.unlink()
    line = error_line(run("forward", "--load", tmp_path, "--tokens", "1,2,3"), 1)
    assert f"model.safetensors.index.json names {shard.name}, which is not there" in line


def test_a_dtype_the_reader_does_not_know_names_it(tmp_path):
    path = tmp_path / "i8.safetensors"
    header = json.dumps({"x": {"dtype": "I8", "shape": [2], "data_offsets": [0, 2]}}).encode()
    path.write_bytes(len(header).to_bytes(8, "little") + header + b"\0\0")
    with pytest.raises(tfmcli.TfmError, match="key 'x' has dtype 'I8' \\(tfm reads F64, F32, "
                                              "F16, BF16\\)"):
        tensorfile.read_header(path)


# ---------------------------------------------------------------- tokens and views


def test_sentencepiece_tokens_show_their_spaces_and_bytes():
    """'▁' is a space, shown '␣' even where decoding drops it (a text's first word); a
    character the vocabulary lacks falls back to its UTF-8 bytes, shown as Python writes them."""
    run_ = tfmcli.load(EXAMPLE, text="The café")
    assert run_.token_labels(0) == ["<s>", "␣The", "␣", "c", "a", "f", "\\xc3", "\\xa9"]


@pytest.mark.parametrize("command", [
    ["forward"], ["backward", "--layer", "attn", "--block", "1"], ["lens", "-k", "2"],
    ["kv", "--generate", "3"], ["attn", "--block", "1", "--head", "3", "--query", "4",
                                "--backward"],
    ["ffn", "-t", "2"], ["ln", "-t", "1"], ["embed", "-t", "2"], ["block", "-t", "3"],
    ["gradcheck"], ["loss"]])
def test_every_view_runs_on_the_example(command):
    out = ok(*command, "--load", EXAMPLE, "--text", "The dog saw the cat.").stdout
    assert "LLaMA checkpoint" in out or command[0] in ("lens", "gradcheck", "loss")
    if command[0] == "gradcheck":
        assert "passed" in out


def test_the_example_predicts_its_sentences_and_saves_as_a_run(tmp_path):
    data = json.loads(ok("lens", "--load", EXAMPLE, "--text", "The cat sat on the", "-k", "1",
                         "--json").stdout)
    top = [position[0]["text"] for position in data["layers"][-1]["top"]]
    assert data["token_text"] == ["<s>", "␣The", "␣cat", "␣sat", "␣on", "␣the"]
    assert [top[0], top[3], top[4]] == ["␣The", "␣on", "␣the"]   # after <s>, sat, on
    saved = json.loads(ok("forward", "--load", EXAMPLE, "--text", "The cat sat.", "--save",
                          tmp_path / "r.npz", "--json").stdout)
    again = json.loads(ok("forward", "--load", tmp_path / "r.npz", "--json").stdout)
    assert again["loss"] == saved["loss"]
    assert again["config"]["rope_theta"] == 10000.0 and again["config"]["bias"] is False


@pytest.mark.parametrize("kind, heads, expect", [
    ("mistral", 16, 8), ("gemma2", 8, 4), ("qwen2", 64, 32), ("llama", 8, None),
    ("mistral", 4, "does not divide")])
def test_a_config_without_num_key_value_heads_takes_the_familys_default(tmp_path, kind,
                                                                         heads, expect):
    """Issue 59: a config.json without num_key_value_heads was read as every head its own keys,
    then refused with a shape message naming no key. Each family's Config default differs
    (MistralConfig 8, Gemma2Config 4, Qwen2Config 32, LlamaConfig: the heads)."""
    import json

    from tfmcli.sources.families import checkpoint_module

    config = {"model_type": kind, "hidden_size": 8 * heads, "num_attention_heads": heads,
              "num_hidden_layers": 1, "vocab_size": 16, "intermediate_size": 16}
    (tmp_path / "config.json").write_text(json.dumps(config))
    if expect == "does not divide":
        with pytest.raises(tfmcli.TfmError, match="key 'num_key_value_heads' is missing, and "
                                                  "Hugging Face's default for mistral, 8, does "
                                                  "not divide the 4 heads"):
            checkpoint_module(tmp_path).read_config(tmp_path)
        return
    assert checkpoint_module(tmp_path).read_config(tmp_path)["kv_heads"] == expect
    transformers = pytest.importorskip("transformers")
    Config = {"mistral": transformers.MistralConfig, "gemma2": transformers.Gemma2Config,
              "qwen2": transformers.Qwen2Config, "llama": transformers.LlamaConfig}[kind]
    hf = Config.from_pretrained(tmp_path).num_key_value_heads
    assert hf == (expect or heads)


@pytest.mark.parametrize("act, activation", [("gelu_pytorch_tanh", "geglu"),
                                              ("gelu", "geglu_erf")])
def test_llama_gated_by_gelu_reads_as_hugging_face_runs_it(tmp_path, act, activation):
    """Issue 59: a LLaMA folder with hidden_act 'gelu' (GELU itself, Hugging Face's ACT2FN) or
    its tanh form was refused; read as geglu_erf and geglu, it matches
    LlamaForCausalLM.from_pretrained: loss, logits and every gradient, to 1e-12."""
    transformers = pytest.importorskip("transformers")
    from helpers import assert_folder_matches_hf, hf_saved

    hf_saved(tmp_path, "Llama", dict(vocab_size=40, hidden_size=16, intermediate_size=24,
                                     num_hidden_layers=2, num_attention_heads=2,
                                     hidden_act=act), "float32")
    loaded = tfmcli.load(tmp_path, tokens=[[1, 5, 9, 2, 7], [3, 8]])
    assert loaded.cfg.activation == activation
    assert_folder_matches_hf(transformers.LlamaForCausalLM, tmp_path, loaded)
