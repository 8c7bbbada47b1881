"""Files that are not what they claim: a config.json whose values are of the wrong kind or
nested past Python's parser, safetensors headers with odd fields, .npz archives tfm did not
write, --rope-scaling past float's range, and a checkpoint folder whose index or links point
outside it. Each is one line on stderr naming the file (and the key), never a traceback."""

from __future__ import annotations

import io
import json
import os
import shutil
import struct
import zipfile
from pathlib import Path

import numpy as np
import pytest

import tfmcli
from helpers import error_line, ok, run
from tfmcli.errors import ConfigError

pytest.importorskip("safetensors")   # a folder needs the hf extra
EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
TOKENS = ("--tokens", "1,2,3")
# a list, an object, an integer past float's range and a string: no key tfm reads takes all four
ODD = [[1], {"a": 1}, 10**400, "x"]
DEEP = "[" * 100_000 + "]" * 100_000   # past Python's JSON parser (RecursionError)


def folder_of(tmp_path, name="tiny-llama") -> Path:
    """A copy of one of the examples' checkpoint folders, to corrupt."""
    return Path(shutil.copytree(EXAMPLES / name, tmp_path / name))


def bad_line(*args, code=1) -> str:
    """The one line of a run that fails (``error_line``: one line, the code, no traceback)."""
    return error_line(run(*args), code)


# ---------------------------------------------------------------- config.json

# model_type -> (a config.json of sizes alone, which each family's reader takes; the keys it reads
# besides them, each of which refuses every ODD value by name)
FAMILIES = {
    "gpt2": ({"n_embd": 16, "n_head": 4, "n_layer": 2, "vocab_size": 32, "n_positions": 16},
             ["activation_function", "add_cross_attention", "layer_norm_epsilon", "n_inner",
              "scale_attn_by_inverse_layer_idx", "scale_attn_weights", "tie_word_embeddings"]),
    "llama": ({"hidden_size": 16, "num_attention_heads": 4, "num_hidden_layers": 2,
               "vocab_size": 32, "intermediate_size": 24},
              ["attention_bias", "head_dim", "hidden_act", "mlp_bias", "num_key_value_heads",
               "rms_norm_eps", "rope_theta", "tie_word_embeddings"]),
    "mistral": ({"hidden_size": 16, "num_attention_heads": 4, "num_hidden_layers": 2,
                 "vocab_size": 32, "intermediate_size": 24, "num_key_value_heads": 2},
                ["attention_bias", "head_dim", "hidden_act", "mlp_bias", "rms_norm_eps",
                 "rope_theta", "tie_word_embeddings", "sliding_window"]),
    "qwen2": ({"hidden_size": 16, "num_attention_heads": 4, "num_hidden_layers": 2,
               "vocab_size": 32, "intermediate_size": 24, "num_key_value_heads": 2},
              ["head_dim", "hidden_act", "rms_norm_eps", "rope_theta", "tie_word_embeddings",
               "use_sliding_window"]),
    "qwen3": ({"hidden_size": 16, "num_attention_heads": 4, "num_hidden_layers": 2,
               "vocab_size": 32, "intermediate_size": 24, "num_key_value_heads": 2},
              ["attention_bias", "head_dim", "hidden_act", "rms_norm_eps", "rope_theta",
               "tie_word_embeddings", "use_sliding_window"]),
    "gemma": ({"hidden_size": 16, "num_attention_heads": 4, "num_hidden_layers": 2,
               "vocab_size": 32, "intermediate_size": 24, "num_key_value_heads": 2},
              ["attention_bias", "hidden_act", "hidden_activation", "rms_norm_eps", "rope_theta",
               "tie_word_embeddings", "use_bidirectional_attention"]),
    "gemma2": ({"hidden_size": 16, "num_attention_heads": 4, "num_hidden_layers": 2,
                "vocab_size": 32, "intermediate_size": 24},
               ["attention_bias", "attn_logit_softcapping", "final_logit_softcapping",
                "head_dim", "hidden_act", "hidden_activation", "layer_types",
                "num_key_value_heads", "query_pre_attn_scalar", "rms_norm_eps", "rope_theta",
                "tie_word_embeddings", "use_bidirectional_attention", "sliding_window"]),
    "gemma3_text": ({"hidden_size": 16, "num_attention_heads": 4, "num_hidden_layers": 2,
                     "vocab_size": 32, "intermediate_size": 24},
                    ["attention_bias", "attn_logit_softcapping", "final_logit_softcapping",
                     "head_dim", "hidden_act", "hidden_activation", "layer_types",
                     "num_key_value_heads", "query_pre_attn_scalar", "rms_norm_eps",
                     "rope_local_base_freq", "rope_theta", "tie_word_embeddings",
                     "use_bidirectional_attention"]),
    "phi3": ({"hidden_size": 16, "num_attention_heads": 4, "num_hidden_layers": 2,
              "vocab_size": 32, "intermediate_size": 24},
             ["head_dim", "hidden_act", "num_key_value_heads", "partial_rotary_factor",
              "rms_norm_eps", "rope_theta", "tie_word_embeddings"]),
    "stablelm": ({"hidden_size": 16, "num_attention_heads": 4, "num_hidden_layers": 2,
                  "vocab_size": 32, "intermediate_size": 24, "num_key_value_heads": 2,
                  "partial_rotary_factor": 0.5},
                 ["head_dim", "hidden_act", "layer_norm_eps", "qk_layernorm", "rope_theta",
                  "tie_word_embeddings", "use_parallel_residual", "use_qkv_bias"]),
    "gpt_neox": ({"hidden_size": 16, "num_attention_heads": 4, "num_hidden_layers": 2,
                  "vocab_size": 32, "intermediate_size": 24, "rotary_pct": 0.5},
                 ["attention_bias", "hidden_act", "layer_norm_eps", "rotary_emb_base",
                  "tie_word_embeddings", "use_parallel_residual", "rotary_pct"]),
    "phi": ({"hidden_size": 16, "num_attention_heads": 4, "num_hidden_layers": 2,
             "vocab_size": 32, "intermediate_size": 24},
            ["head_dim", "hidden_act", "layer_norm_eps", "num_key_value_heads",
             "partial_rotary_factor", "qk_layernorm", "rope_theta", "tie_word_embeddings"]),
    "gptj": ({"n_embd": 16, "n_head": 4, "n_layer": 2, "vocab_size": 32, "rotary_dim": 2},
             ["activation_function", "layer_norm_epsilon", "n_inner", "tie_word_embeddings"]),
    "codegen": ({"n_embd": 16, "n_head": 4, "n_layer": 2, "vocab_size": 32, "rotary_dim": 2},
                ["activation_function", "layer_norm_epsilon", "n_inner", "tie_word_embeddings"]),
    "opt": ({"hidden_size": 16, "num_attention_heads": 4, "num_hidden_layers": 2,
             "vocab_size": 32, "ffn_dim": 24, "max_position_embeddings": 16},
            ["_remove_final_layer_norm", "activation_function", "do_layer_norm_before",
             "enable_bias", "layer_norm_elementwise_affine", "layer_norm_eps",
             "tie_word_embeddings", "word_embed_proj_dim"]),
    "falcon": ({"hidden_size": 16, "num_attention_heads": 4, "num_hidden_layers": 2,
                "vocab_size": 32},
               ["alibi", "bias", "ffn_hidden_size", "layer_norm_epsilon", "multi_query",
                "new_decoder_architecture", "parallel_attn", "rope_theta",
                "tie_word_embeddings"]),
    "gpt_bigcode": ({"n_embd": 16, "n_head": 4, "n_layer": 2, "vocab_size": 32,
                     "n_positions": 16},
                    ["activation_function", "add_cross_attention", "layer_norm_epsilon",
                     "multi_query", "n_inner", "scale_attn_weights", "tie_word_embeddings"]),
    "bloom": ({"hidden_size": 16, "n_head": 4, "n_layer": 2, "vocab_size": 32},
              ["apply_residual_connection_post_layernorm", "hidden_act", "layer_norm_epsilon",
               "n_embed", "slow_but_exact", "tie_word_embeddings"]),
    "mpt": ({"d_model": 16, "n_heads": 4, "n_layers": 2, "vocab_size": 32},
            ["ffn_config", "hidden_act", "layer_norm_epsilon", "logit_scale",
             "no_bias", "norm_type", "tie_word_embeddings"]),
}


@pytest.fixture
def built_once(monkeypatch):
    """The CLI's command built once, for a test that runs it hundreds of times (Typer builds
    it anew on every invoke, 75 ms)."""
    import typer.main
    import typer.testing

    from tfmcli.cli import app

    command = typer.main.get_command(app)
    monkeypatch.setattr(typer.testing, "_get_command", lambda _: command)


def write_config(folder: Path, config) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    return folder


@pytest.mark.parametrize("model_type", FAMILIES)
def test_every_key_a_reader_reads_refuses_a_value_of_the_wrong_kind_by_name(tmp_path, built_once,
                                                                            model_type):
    """Every size, switch, name and number each family's reader takes, given a list, an object,
    an integer no float holds or a string: one line naming config.json and the key (a list
    as model_type or hidden_act was a TypeError, 10**400 as an epsilon an OverflowError)."""
    sizes, read = FAMILIES[model_type]
    folder = tmp_path / model_type
    for key in ["model_type", *sizes, *read]:
        for value in ODD:
            if key == "model_type" and value == "x":
                continue   # (a string is a model_type: an unknown one, refused as such below)
            write_config(folder, {"model_type": model_type, **sizes, key: value})
            line = bad_line("forward", "--load", folder, *TOKENS)
            assert f"{folder / 'config.json'}: " in line and f"'{key}'" in line, (key, line)
            assert "0" * 100 not in line   # a value of 401 digits is shown cut short


@pytest.mark.parametrize("value, says", [
    ([1], "key 'model_type' is [1]; tfm reads 'gpt2', 'llama'"),
    ({"gpt2": 1}, "key 'model_type' is {'gpt2': 1}; tfm reads"),
    ("bert", "key 'model_type' is 'bert'; tfm reads"),
])
def test_a_model_type_that_is_not_a_name_is_refused_as_an_unknown_one(tmp_path, value, says):
    folder = write_config(tmp_path / "ckpt", {"model_type": value})
    assert says in bad_line("forward", "--load", folder, *TOKENS)


@pytest.mark.parametrize("text, says", [
    (DEEP, "not JSON tfm reads (nested too deeply)"),
    ('{"model_type": "llama", "hidden_size": ' + DEEP + "}", "nested too deeply"),
    ("[1, 2]", "not a JSON object"),
    ("\xff", "not JSON"),
])
def test_a_config_json_that_python_cannot_parse_is_one_line(tmp_path, text, says):
    folder = folder_of(tmp_path)
    (folder / "config.json").write_bytes(text.encode("latin-1"))
    line = bad_line("forward", "--load", folder, *TOKENS)
    assert f"--load {folder / 'config.json'}: " in line and says in line


@pytest.mark.parametrize("config, says", [
    (dict(layer_types=[["sliding_attention"], "full_attention"], model_type="gemma2"),
     "key 'layer_types' has ['sliding_attention']; tfm's layers are"),
    (dict(layer_types="sliding_attention", model_type="gemma2"),
     "key 'layer_types' is 'sliding_attention', not a list"),
    (dict(rope_scaling=["llama3", 8]), "key 'rope_scaling' is ['llama3', 8], not an object"),
    (dict(rope_scaling={"rope_type": ["llama3"]}), "key 'rope_scaling' has rope_type ['llama3']"),
    (dict(rope_scaling={"rope_type": "llama3", "factor": 10**400, "low_freq_factor": 1,
                        "high_freq_factor": 4, "original_max_position_embeddings": 8192}),
     "rope_scaling's factor must be a positive finite number"),
    (dict(rope_scaling={"rope_type": "llama3", "factor": 8, "low_freq_factor": 1,
                        "high_freq_factor": 4, "original_max_position_embeddings": 10**400}),
     "rope_scaling's original_max_position_embeddings must be a positive integer"),
    (dict(rope_scaling={"rope_type": "linear", "factor": -10**400}),
     "a linear rope_scaling's factor must be a positive finite number"),
    (dict(rope_parameters={"rope_type": "default", "rope_theta": 10**400}),
     "key 'rope_parameters' 'rope_theta' is 1000"),
    (dict(rms_norm_eps=float("nan")), "key 'rms_norm_eps' is nan, not a finite number"),
    (dict(num_hidden_layers=10**6, sliding_window=4, model_type="mistral"),
     "key 'num_hidden_layers' is 1000000; tfm shows 1..1000 layers"),
    (dict(sliding_window=2**63, model_type="mistral"), "key 'sliding_window' is "
                                                       "9223372036854775808, not a positive"),
    (dict(num_attention_heads=0, model_type="phi3"),
     "key 'num_attention_heads' is 0, not a whole number in 1..2147483647"),
])
def test_nested_and_overflowing_values_are_named(tmp_path, config, says):
    """LLaMA's keys that hold lists and objects, and numbers past float's range, inside them
    too (an OverflowError or a TypeError from NumPy's isfinite before)."""
    folder = folder_of(tmp_path)
    base = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**base, **config}))
    line = bad_line("forward", "--load", folder, *TOKENS)
    assert f"--load {folder / 'config.json'}: " in line and says in line, line


def test_gemma3s_nested_rope_parameters_are_checked_to_the_bottom(tmp_path):
    folder = tmp_path / "g3"
    sizes = FAMILIES["gemma3_text"][0]
    for rope, says in [
        ({"full_attention": [1], "sliding_attention": {}}, "has full_attention [1], not an object"),
        ({"full_attention": {}, "sliding_attention": {"rope_theta": 10**400}},
         "key 'rope_parameters' sliding_attention's 'rope_theta' is 1000"),
    ]:
        write_config(folder, {"model_type": "gemma3_text", **sizes, "rope_parameters": rope})
        assert says in bad_line("forward", "--load", folder, *TOKENS)
    write_config(folder, {"model_type": "gemma3_text", **sizes, "rope_scaling": [8]})
    assert "key 'rope_scaling' is [8], not an object" in bad_line("forward", "--load", folder,
                                                                  *TOKENS)


# ---------------------------------------------------------------- safetensors headers


def rewrite_header(path: Path, change) -> None:
    """The safetensors file at ``path`` with ``change(header)`` applied to its JSON header, its
    data as it was."""
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    change(header)
    text = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(text)) + text + raw[8 + n:])


NAME = "model.embed_tokens.weight"   # tiny-llama's first tensor


def entry(**fields):
    return lambda header: header[NAME].update(fields)


@pytest.mark.parametrize("change, says", [
    (lambda h: h[NAME].update(data_offsets=[float(x) for x in h[NAME]["data_offsets"]]),
     "has data_offsets [0.0, 20224.0], not two whole numbers"),
    (lambda h: h[NAME].update(data_offsets=[str(x) for x in h[NAME]["data_offsets"]]),
     "has data_offsets ['0', '20224'], not two whole numbers"),
    (lambda h: h[NAME].update(data_offsets=[0]), "has data_offsets [0], not two whole numbers"),
    (lambda h: h[NAME].update(data_offsets=[False, 20224]), "not two whole numbers"),
    (lambda h: h[NAME].update(data_offsets={"begin": 0}), "not two whole numbers"),
    (entry(dtype=["BF16"]), f"key '{NAME}' has dtype ['BF16'] (tfm reads F64, F32, F16, BF16)"),
    (entry(dtype={"BF16": 1}), "has dtype {'BF16': 1}"),
    (entry(dtype=None), "has dtype None"),
    (entry(shape=["316", 32]), "has shape ['316', 32], not a list of whole numbers >= 0"),
    (entry(shape=[316.0, 32]), "has shape [316.0, 32]"),
    (entry(shape=[-316, -32]), "has shape [-316, -32]"),
    (entry(shape=[True, 32]), "has shape [True, 32]"),
    (entry(shape="316x32"), "has shape '316x32'"),
    (entry(shape=[316, 32, 10**400]), "needs"),   # whole numbers: too many bytes for the file
    (lambda h: h.update({NAME: [1, 2]}), f"key '{NAME}' is [1, 2], not an object"),
])
def test_every_field_of_a_safetensors_header_is_checked(tmp_path, change, says):
    folder = folder_of(tmp_path)
    rewrite_header(folder / "model.safetensors", change)
    line = bad_line("forward", "--load", folder, *TOKENS)
    assert f"--load {folder / 'model.safetensors'}: " in line and says in line, line


def test_a_safetensors_header_nested_too_deeply_is_one_line(tmp_path):
    folder = folder_of(tmp_path)
    text = DEEP.encode()
    (folder / "model.safetensors").write_bytes(struct.pack("<Q", len(text)) + text)
    assert "its header is JSON nested too deeply" in bad_line("forward", "--load", folder,
                                                              *TOKENS)


# ---------------------------------------------------------------- .npz


@pytest.fixture
def saved(tmp_path) -> dict:
    """The arrays of a run tfm saved."""
    ok("forward", "-d", 8, "-H", 2, "--save", tmp_path / "run.npz")
    with np.load(tmp_path / "run.npz") as npz:
        return {key: npz[key] for key in npz.files}


def npy(array) -> bytes:
    f = io.BytesIO()
    np.lib.format.write_array(f, np.asanyarray(array), allow_pickle=True)
    return f.getvalue()


def zipped(path: Path, members: dict, method=zipfile.ZIP_STORED) -> Path:
    with zipfile.ZipFile(path, "w", method) as archive:
        for name, data in members.items():
            archive.writestr(name, data)
    return path


def members(arrays: dict) -> dict:
    return {key + ".npy": npy(value) for key, value in arrays.items()}


def patched(path: Path, offsets: dict, value: int) -> None:
    """Every local and central header of the zip at ``path`` with the 2-byte field at
    ``offsets[signature]`` set to ``value`` (or, for the flag bits, or-ed with it)."""
    data = bytearray(path.read_bytes())
    for signature, offset in offsets.items():
        at = data.find(signature)
        while at >= 0:
            (old,) = struct.unpack_from("<H", data, at + offset)
            new = old | value if offset in (6, 8) else value
            struct.pack_into("<H", data, at + offset, new)
            at = data.find(signature, at + 4)
    path.write_bytes(bytes(data))


LOCAL, CENTRAL = b"PK\x03\x04", b"PK\x01\x02"


def test_npz_members_tfm_did_not_write_are_each_one_line(tmp_path, saved):
    bad = tmp_path / "bad.npz"
    for build, says in [
        (lambda: zipped(bad, {**members(saved), "notes": b"hello"}),
         "member 'notes' is not an .npy array"),
        (lambda: zipped(bad, {**members(saved), "config.npy": b"raw bytes, no header"}),
         "member 'config.npy' is not an .npy array tfm reads (the magic string"),
        (lambda: zipped(bad, {**members(saved), "config.npy": b"\x80\x04\x95pickled"}),
         "member 'config.npy' is not an .npy array tfm reads (the magic string"),
        (lambda: zipped(bad, {**members(saved),
                              "config.npy": npy(np.array([{"a": 1}], dtype=object))}),
         "an array needs pickle, which tfm never loads (member 'config.npy'"),
        (lambda: zipped(bad, members(saved), zipfile.ZIP_BZIP2),
         "is compressed with bzip2; tfm reads members stored or deflated"),
        (lambda: zipped(bad, members(saved), zipfile.ZIP_LZMA),
         "is compressed with lzma; tfm reads members stored or deflated"),
        (lambda: patched(zipped(bad, members(saved)), {LOCAL: 8, CENTRAL: 10}, 9),
         "is compressed with deflate64"),
        (lambda: patched(zipped(bad, members(saved)), {LOCAL: 8, CENTRAL: 10}, 99),
         "is compressed with method 99"),
        (lambda: patched(zipped(bad, members(saved)), {LOCAL: 6, CENTRAL: 8}, 0x1),
         "is encrypted; tfm reads archives without a password"),
        (lambda: bad.write_bytes((tmp_path / "run.npz").read_bytes()[:-100]),
         "not an .npz file (not a zip archive, or one cut short)"),
        (lambda: zipped(bad, {**members(saved), "input/tokens.npy":
                              npy(saved["input/tokens"]).replace(b"(2, 4)", b"(99999999999, 4)")}),
         "member 'input/tokens.npy' is cut short: its header says (99999999999, 4) of int64"),
    ]:
        build()
        line = bad_line("forward", "--load", bad, "--save", tmp_path / "out.npz")
        assert line.startswith(f"tfm forward: error: --load {bad}: ") and says in line, line
        assert not (tmp_path / "out.npz").exists()   # nothing half-written


def test_a_corrupt_member_is_one_line(tmp_path):
    ok("forward", "-d", 8, "-H", 2, "--save", tmp_path / "run.npz")
    data = bytearray((tmp_path / "run.npz").read_bytes())
    data[len(data) // 3] ^= 0xFF   # inside a member's data: its CRC no longer holds
    (tmp_path / "bad.npz").write_bytes(bytes(data))
    line = bad_line("forward", "--load", tmp_path / "bad.npz")
    assert "cannot read the archive (Bad CRC-32 for file" in line


@pytest.mark.parametrize("field, value, says", [
    ("lengths", "x", "key 'config': lengths must be whole numbers, one per row, got 'x'"),
    ("lengths", 5, "key 'config': lengths must be whole numbers, one per row, got 5"),
    ("lengths", [1.5, 4], "lengths must be whole numbers, one per row, got (1.5, 4)"),
    ("d_model", "8", "key 'config': d_model must be a positive integer, got '8'"),
    ("eps", 10**400, "key 'config': eps must be a positive finite number"),
    ("norm", ["pre"], "key 'config': norm=['pre'] is not one of pre, post"),
])
def test_a_stored_config_of_the_wrong_kind_is_the_files_fault(tmp_path, saved, field, value,
                                                              says):
    """Exit 1 naming the file and its key 'config' (it was a ValueError from int(), or a usage
    error blaming an option nobody typed)."""
    config = json.loads(str(saved["config"][()]))
    np.savez(tmp_path / "bad.npz", **{**saved, "config": np.array(json.dumps({**config,
                                                                                field: value}))})
    line = bad_line("forward", "--load", tmp_path / "bad.npz")
    assert line.startswith(f"tfm forward: error: --load {tmp_path / 'bad.npz'}: ") and says in line


@pytest.mark.parametrize("key, says", [
    ("config", "key 'config' is not a JSON object tfm reads (nested too deeply)"),
    ("task", "key 'task' is not a task tfm train saved"),
])
def test_stored_json_nested_too_deeply_is_one_line(tmp_path, saved, key, says):
    np.savez(tmp_path / "bad.npz", **{**saved, key: np.array(DEEP)})
    assert says in bad_line("forward", "--load", tmp_path / "bad.npz")


# ---------------------------------------------------------------- --rope-scaling


@pytest.mark.parametrize("value, says", [
    ("32,1,4,1e308", "original_max_position_embeddings must be a positive integer, got 1e+308"),
    ("32,1,4," + "9" * 40, "original_max_position_embeddings must be a positive integer"),
    ("32,1,4,1e400", "got inf"),
    ("32,1,4,nan", "got nan"),
    ("32,inf,4,8192", "low_freq_factor must be a positive finite number, got inf"),
    ("1e400", "a linear rope_scaling's factor must be a positive finite number, got inf"),
    ("inf", "got inf"),
    ("-inf", "got -inf"),
    ("nan", "got nan"),
    ("9" * 400, "got inf"),
])
def test_rope_scaling_past_floats_range_is_a_usage_error(value, says):
    line = bad_line("forward", "--pe", "rope", "--rope-scaling", value, code=2)
    assert "'--rope-scaling'" in line and says in line, line


def test_a_scalings_numbers_past_floats_range_are_config_errors():
    """An integer no float holds (from a config.json) was a TypeError in NumPy's isfinite."""
    for value in [(32, 1, 4, 10**400), (10**400, 1, 4, 8192), (32, 1, -10**400, 8192),
                  10**400, {"rope_type": "linear", "factor": 10**400}]:
        with pytest.raises(ConfigError) as raised:
            tfmcli.Config(pe="rope", rope_scaling=value)
        assert raised.value.field == "rope_scaling"
    # the largest context it holds is the CLI's largest whole number, kept through a replace
    cfg = tfmcli.Config(pe="rope", rope_scaling=(32, 1, 4, 2**31 - 1))
    assert cfg.replace(layers=1).rope_scaling.original_max_position_embeddings == 2**31 - 1


# ---------------------------------------------------------------- files outside the folder


def sharded(folder: Path, shard: str) -> None:
    """The folder's weights named by an index instead, every key in file ``shard``."""
    from tfmcli.sources import tensorfile

    header, _ = tensorfile.read_header(folder / "model.safetensors")
    index = {"metadata": {}, "weight_map": {key: shard for key in header}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))


@pytest.mark.parametrize("where", ["../elsewhere/model.safetensors", "absolute"])
def test_an_index_that_names_a_file_outside_the_folder_is_refused(tmp_path, where):
    folder = folder_of(tmp_path)
    (tmp_path / "elsewhere").mkdir()
    outside = (tmp_path / "elsewhere" / "model.safetensors")
    name = str(outside) if where == "absolute" else where
    sharded(folder, name)
    (folder / "model.safetensors").rename(outside)
    line = bad_line("forward", "--load", folder, *TOKENS, "--save", tmp_path / "out.npz")
    assert line == (f"tfm forward: error: --load {folder / 'model.safetensors.index.json'}: "
                    f"names {name!r}, which is outside {folder}; a checkpoint folder reads only "
                    f"the files inside it")
    assert not (tmp_path / "out.npz").exists()


def test_an_index_naming_shards_inside_the_folder_reads(tmp_path):
    folder = folder_of(tmp_path)
    (folder / "shards").mkdir()
    sharded(folder, "shards/../shards/one.safetensors")   # a way round that stays inside
    (folder / "model.safetensors").rename(folder / "shards" / "one.safetensors")
    want = json.loads(ok("forward", "--load", EXAMPLES / "tiny-llama", *TOKENS,
                         "--json").stdout)["loss"]
    assert json.loads(ok("forward", "--load", folder, *TOKENS, "--json").stdout)["loss"] == want


@pytest.mark.parametrize("name", ["config.json", "model.safetensors", "tokenizer.json"])
def test_a_link_that_leaves_the_folder_is_refused(tmp_path, name):
    """A symlinked config.json, weights or tokenizer that resolves outside the folder: refused
    by name, whatever the file holds (here the right one), --tokens given or not."""
    folder = folder_of(tmp_path)
    outside = tmp_path / "elsewhere" / name
    outside.parent.mkdir()
    (folder / name).rename(outside)
    (folder / name).symlink_to(outside)
    line = bad_line("forward", "--load", folder, *TOKENS)
    assert line == (f"tfm forward: error: --load {folder / name}: a link to {outside}, which "
                    f"is outside {folder}; a checkpoint folder reads only the files inside it "
                    f"(copy the file in)")


def test_vocab_and_merges_that_leave_the_folder_are_refused(tmp_path):
    folder = folder_of(tmp_path, "tiny-gpt2")
    (folder / "tokenizer.json").unlink()
    for name in ("vocab.json", "merges.txt"):
        (tmp_path / name).write_text("{}" if name.endswith("json") else "#version: 0.2\n")
        (folder / name).symlink_to(tmp_path / name)
        line = bad_line("forward", "--load", folder, "--text", "The cat")
        assert f"--load {folder / 'vocab.json'}: a link to {tmp_path / 'vocab.json'}" in line


def test_a_shard_linked_outside_the_folder_is_refused(tmp_path):
    folder = folder_of(tmp_path)
    outside = tmp_path / "shard.safetensors"
    sharded(folder, "shard.safetensors")
    (folder / "model.safetensors").rename(outside)
    (folder / "shard.safetensors").symlink_to(outside)
    line = bad_line("forward", "--load", folder, *TOKENS)
    assert f"--load {folder / 'shard.safetensors'}: a link to {outside}, which is outside" in line


def test_links_inside_the_folder_and_a_linked_folder_read(tmp_path):
    """A link to a file inside the folder is read; so is a folder given as a link (the files
    are checked against where the folder itself resolves)."""
    folder = folder_of(tmp_path)
    (folder / "real").mkdir()
    for name in ("config.json", "model.safetensors", "tokenizer.json"):
        (folder / name).rename(folder / "real" / name)
        (folder / name).symlink_to(Path("real") / name)   # relative, inside
    (tmp_path / "link").symlink_to(folder)
    want = json.loads(ok("forward", "--load", EXAMPLES / "tiny-llama", "--text", "The cat sat",
                         "--json").stdout)["loss"]
    for where in (folder, tmp_path / "link"):
        got = json.loads(ok("forward", "--load", where, "--text", "The cat sat",
                            "--json").stdout)["loss"]
        assert got == want


def test_a_loop_of_links_is_one_line(tmp_path):
    folder = folder_of(tmp_path)
    (folder / "config.json").unlink()
    os.symlink("config.json", folder / "config.json")   # to itself
    line = bad_line("forward", "--load", folder, *TOKENS)
    assert f"--load {folder / 'config.json'}: " in line
