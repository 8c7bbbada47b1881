"""--arch presets: each family's architecture is what its own reader makes of that family's
config.json (Hugging Face's defaults, toy sizes), flags typed override it, and every preset
runs forward and backward and passes gradcheck."""

import dataclasses
import json
import math
import re

import pytest
from typer.testing import CliRunner

from tfmcli.cli import app
from tfmcli.engine.config import Config
from tfmcli.engine.presets import NAMES, PRESETS, SLIDING_WINDOW, preset_fields
from tfmcli.sources.families import checkpoint_module

# what the sizes decide, not the architecture
SIZES = {"batch", "seq_len", "d_model", "heads", "d_ff", "vocab", "layers", "lengths", "n_ctx",
         "head_dim", "seed", "init", "dtype"}
ARCH_FIELDS = [f.name for f in dataclasses.fields(Config) if f.name not in SIZES]
D_MODEL, HEADS, LAYERS = 16, 2, 7   # heads 8 wide; 7 blocks show Gemma 2's and 3's patterns


def hf_config(family: str):
    """A transformers config of the family at toy sizes, every other key Hugging Face's default
    (save_pretrained leaves the defaults out of config.json)."""
    tr = pytest.importorskip("transformers")
    size = dict(hidden_size=D_MODEL, num_attention_heads=HEADS, num_hidden_layers=LAYERS,
                vocab_size=32, intermediate_size=32)
    gpt = dict(n_embd=D_MODEL, n_head=HEADS, n_layer=LAYERS, vocab_size=32)
    classes = {
        "gpt2": (tr.GPT2Config, dict(gpt, n_positions=16)),
        "llama": (tr.LlamaConfig, size), "mistral": (tr.MistralConfig, size),
        "qwen2": (tr.Qwen2Config, size), "qwen3": (tr.Qwen3Config, size),
        "gemma": (tr.GemmaConfig, size), "gemma2": (tr.Gemma2Config, size),
        "gemma3": (tr.Gemma3TextConfig, size), "phi3": (tr.Phi3Config, size),
        "stablelm": (tr.StableLmConfig, size), "gpt_neox": (tr.GPTNeoXConfig, size),
        "phi": (tr.PhiConfig, size), "gptj": (tr.GPTJConfig, gpt),
        # CodeGen's qkv_proj holds its heads in 4 pieces: tfm needs a multiple of 4 heads
        "codegen": (tr.CodeGenConfig, dict(gpt, n_embd=32, n_head=4)),
        "opt": (tr.OPTConfig, dict(size, ffn_dim=32, word_embed_proj_dim=D_MODEL)),
        "falcon": (tr.FalconConfig, dict(size)),
        "gpt_bigcode": (tr.GPTBigCodeConfig, gpt),
        "bloom": (tr.BloomConfig, dict(hidden_size=D_MODEL, n_head=HEADS, n_layer=LAYERS,
                                       vocab_size=32)),
        "mpt": (tr.MptConfig, dict(d_model=D_MODEL, n_heads=HEADS, n_layers=LAYERS,
                                   vocab_size=32)),
    }
    cls, sizes = classes[family]
    default = cls()
    config = cls(**{k: v for k, v in sizes.items() if k != "intermediate_size"
                    or hasattr(default, "intermediate_size")})
    d_head = config.hidden_size // config.num_attention_heads
    if "head_dim" in default.to_dict():   # Gemma, Qwen3: a head's width of its own
        config.head_dim = d_head
    kv = getattr(default, "num_key_value_heads", None)
    if kv:   # the family's default shares keys, or not
        config.num_key_value_heads = 1 if kv < default.num_attention_heads else HEADS
    if getattr(default, "sliding_window", None):
        config.sliding_window = SLIDING_WINDOW
    if hasattr(default, "query_pre_attn_scalar"):   # 256 by default, = head_dim 256
        config.query_pre_attn_scalar = d_head
    if getattr(default, "layer_types", None):   # drawn again for the toy's block count
        config.layer_types = None
    if getattr(default, "rotary_dim", None):   # GPT-J, CodeGen: 64 of 256 by default
        config.rotary_dim = d_head * default.rotary_dim // (default.n_embd // default.n_head)
    return config


def architecture(fields: dict, d_head: int) -> dict:
    """The architecture fields, Config's defaults filled in; keys shared by every head and the
    usual 1/sqrt(d_head) written as the default (None)."""
    arch = {name: fields.get(name, getattr(Config(), name)) for name in ARCH_FIELDS}
    if arch["kv_heads"] == fields.get("heads"):
        arch["kv_heads"] = None
    if arch["attn_scale"] is not None and math.isclose(arch["attn_scale"], d_head ** -0.5):
        arch["attn_scale"] = None
    return arch


@pytest.mark.parametrize("family", [name for name in NAMES if name != "vaswani"])
def test_each_preset_is_what_its_family_reader_makes(family, tmp_path):
    config = hf_config(family)
    config.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["model_type"].startswith(
        family.split("3")[0])
    fields = checkpoint_module(tmp_path).read_config(tmp_path)
    d_head = fields["d_model"] // fields["heads"]
    preset = preset_fields(family, fields)
    read = architecture(fields, d_head)
    made = architecture({**preset, "heads": fields["heads"]}, d_head)
    assert made == read, {k: (made[k], read[k]) for k in made if made[k] != read[k]}


def test_the_papers_block():
    fields = preset_fields("vaswani", {})
    assert fields == dict(norm="post", embed_scale=True, tied_head=True, head_bias=False)
    cfg = Config(**fields)
    assert (cfg.pe, cfg.activation, cfg.rms_norm) == ("sinusoidal", "relu", False)


def test_the_sliding_blocks_follow_the_block_count():
    assert preset_fields("gemma2", {"layers": 5})["sliding_layers"] == (0, 2, 4)
    assert preset_fields("gemma3", {"layers": 8})["sliding_layers"] == (0, 1, 2, 3, 4, 6, 7)
    assert preset_fields("gemma3", {"layers": 3})["sliding_layers"] is None   # every block
    assert preset_fields("gpt_neox", {"d_model": 32, "heads": 2})["rotary_dim"] == 4
    assert preset_fields("phi", {"d_model": 6, "heads": 2})["rotary_dim"] == 2   # d_head 3


def invoke(*args):
    return CliRunner().invoke(app, list(args))


@pytest.mark.parametrize("name", NAMES)
def test_each_preset_runs_and_its_gradients_pass(name):
    result = invoke("gradcheck", "--arch", name, "-L", "2", "--max-entries", "4")
    assert result.exit_code == 0, result.output
    assert f"arch           {name} (the architecture of {PRESETS[name].family})" in result.stdout


def test_typed_flags_override_the_preset():
    result = invoke("shapes", "--arch", "llama", "--layer-norm", "--kv-heads", "2", "--json")
    config = json.loads(result.stdout)["config"]
    assert (config["rms_norm"], config["kv_heads"], config["activation"]) == (False, 2, "swiglu")
    plain = json.loads(invoke("shapes", "--json").stdout)["config"]
    assert (plain["rms_norm"], plain["activation"], plain["pe"]) == (False, "relu", "sinusoidal")


def test_the_list_and_the_refusals(monkeypatch):
    monkeypatch.delenv("COLUMNS", raising=False)   # piped, with no width given: a line each
    listed = invoke("shapes", "--arch", "list")
    assert listed.exit_code == 0
    lines = listed.stdout.splitlines()
    assert [line.split()[0] for line in lines] == list(NAMES)
    assert "llama        --activation swiglu --pe rope --eps 1e-06" in listed.stdout
    unknown = invoke("forward", "--arch", "llama2")
    assert unknown.exit_code == 2 and "'llama2' is not a preset; allowed: vaswani" in unknown.output
    loaded = invoke("forward", "--arch", "llama", "--load", "examples/tiny-llama")
    assert loaded.exit_code == 2 and "brings its own architecture; drop --arch" in loaded.output


def docs_rows(heading: str) -> list[list[str]]:
    """The cells of the table under ``heading`` in docs/architectures.md."""
    from pathlib import Path

    page = (Path(__file__).resolve().parent.parent / "docs" / "architectures.md").read_text()
    section = page.split(f"## {heading}\n", 1)[1].split("\n## ", 1)[0]
    return [[cell.strip() for cell in line.strip("|").split("|")]
            for line in section.splitlines() if line.startswith("| ")][1:]


def test_the_docs_list_each_flags_presets_as_the_presets_set_them():
    """docs/architectures.md, 'The flags': the presets of each row are those that set it."""
    rows = docs_rows("The flags")
    assert len(rows) >= 30
    for flag_cell, _, _, named in rows:
        flag = flag_cell.split("`")[1]            # [`--pe rope`](#...) -> --pe rope
        name, *value = flag[2:].split()
        field = (name[3:] if name.startswith("no-") else name).replace("-", "_")
        default = getattr(Config(), field)
        setting = [n for n in NAMES if (
            str(preset_fields(n, {"layers": 6}).get(field, default)) == value[0] if value
            else preset_fields(n, {"layers": 6}).get(field, default) != default)]
        assert named == (", ".join(f"`{n}`" for n in setting) or "—"), flag


def test_the_docs_presets_table_is_arch_list():
    from tfmcli.engine.presets import describe

    rows = docs_rows("Presets")
    assert [row[0].strip("`") for row in rows] == list(NAMES)
    for name, family, flags in rows:
        assert family == PRESETS[name.strip("`")].family
        assert flags == f"`{describe(name.strip('`'))}`"


def test_the_list_breaks_between_flags_on_a_terminal(monkeypatch):
    """On an 80-column terminal the list broke '--attn-softcap' mid-word; it breaks between
    flags under a hanging indent. (Piped, each preset is one line, as above.)"""
    import os
    import shutil
    import sys

    from tfmcli.cli.options import arch_list

    monkeypatch.delenv("COLUMNS", raising=False)
    monkeypatch.setattr(sys.stdout, "isatty", lambda: True, raising=False)
    monkeypatch.setattr(shutil, "get_terminal_size", lambda *a: os.terminal_size((80, 24)))
    lines = arch_list()
    assert max(map(len, lines)) <= 80 and len(lines) > len(NAMES)
    assert any(line.strip().startswith("--attn-softcap 50 ") for line in lines)
    assert all(line.startswith(" " * 13 + "--") or line.startswith(" " * 13 + "(")
               or line.split()[0] in NAMES for line in lines)


@pytest.mark.parametrize("columns", [60, 100, 1])
def test_the_list_piped_keeps_to_columns(monkeypatch, columns):
    """COLUMNS holds piped too (a line each was 249 columns wide), breaking only between
    flags: at 1 column, a flag a line."""
    monkeypatch.setenv("COLUMNS", str(columns))
    lines = invoke("shapes", "--arch", "list").stdout.splitlines()
    assert [line.split()[0] for line in lines if not line.startswith(" ")] == list(NAMES)
    if columns > 1:
        assert max(map(len, lines)) <= columns, max(map(len, lines))
        assert (len(lines) > 2 * len(NAMES)) == (columns == 60)
    else:   # each flag (and its value) on a line of its own
        units = [line.split(None, 1)[1] if line.split()[0] in NAMES else line.strip()
                 for line in lines]
        assert all(re.fullmatch(r"--[\w-]+( [^-\s]\S*)?|\(.*\)", unit) for unit in units)
