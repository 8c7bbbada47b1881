"""The examples run as written and print what they promise."""

import runpy
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def test_walkthrough_runs_and_its_checks_hold(capsys):
    runpy.run_path(str(EXAMPLES / "walkthrough.py"), run_name="__main__")
    out = capsys.readouterr().out
    assert "gradcheck passed=True" in out
    line = next(l for l in out.splitlines() if l.startswith("dx[1, 2]"))
    analytic, numeric = float(line.split()[3]), float(line.split()[5])
    assert abs(analytic - numeric) < 1e-8
    assert "84,334,417 parameters" in out
    checks = [l for l in out.splitlines() if "against central differences:" in l]
    assert [l.split()[0] for l in checks] == ["embed", "ln1", "ffn", "block", "loss", "attn"]
    assert all(float(l.split()[-1]) < 1e-8 for l in checks)
    assert "-log p(target) at (0, 2) = 2.603567, 0.325446 of the loss" in out


def test_import_tfmcli_alone_gives_the_submodules_the_api_page_uses():
    import subprocess
    import sys
    code = ("import tfmcli; tfmcli.io.save_npz; tfmcli.engine.ops.layer_norm_forward; "
            "tfmcli.engine.sizes.flops")
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


def test_tiny_gpt2_example_trains_and_writes_a_loadable_folder(tmp_path):
    pytest.importorskip("safetensors")
    pytest.importorskip("tokenizers")
    import subprocess
    import sys

    import tfmcli

    result = subprocess.run([sys.executable, str(EXAMPLES / "tiny_gpt2.py"), str(tmp_path)],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    loss = float(result.stdout.split("training loss ")[1])
    assert loss < 0.5                      # it learned the six sentences
    run = tfmcli.load(tmp_path, text="The cat sat on the mat.")
    assert run.cfg.layers == 2 and run.cfg.tied_head and run.cfg.pe == "learned"
    assert run.token_labels(0)[:3] == ["The", "␣cat", "␣sat"]
    shipped = tfmcli.load(EXAMPLES / "tiny-gpt2", text="The cat sat on the mat.")
    assert sum(p.size for p in shipped.params.values()) == 35_136
    assert tfmcli.forward(shipped.params, shipped.inputs, shipped.cfg).loss < 0.5



def test_tiny_llama_example_trains_and_writes_the_shipped_folder(tmp_path):
    """The script writes the folder that is committed: its config and tokenizer byte for byte
    (the weights, seeded, may round differently under another BLAS kernel), and what it
    trained predicts its sentences after bfloat16's rounding too."""
    pytest.importorskip("tokenizers")
    import subprocess
    import sys

    import tfmcli

    result = subprocess.run([sys.executable, str(EXAMPLES / "tiny_llama.py"), str(tmp_path)],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert float(result.stdout.split("training loss ")[1].split()[0]) < 0.5
    for name in ("config.json", "tokenizer.json"):
        assert (tmp_path / name).read_bytes() == (EXAMPLES / "tiny-llama" / name).read_bytes(), name
    made = tfmcli.load(tmp_path, text="The cat sat on the mat.")
    assert tfmcli.forward(made.params, made.inputs, made.cfg).loss < 0.6
    shipped = tfmcli.load(EXAMPLES / "tiny-llama", text="The cat sat on the mat.")
    assert (shipped.cfg.rms_norm, shipped.cfg.pe, shipped.cfg.activation, shipped.cfg.h_kv,
            shipped.cfg.bias, shipped.cfg.tied_head) == (True, "rope", "swiglu", 2, False, False)
    assert sum(p.size for p in shipped.params.values()) == 38_816
    assert tfmcli.forward(shipped.params, shipped.inputs, shipped.cfg).loss < 0.6


def test_tiny_gemma_example_trains_and_writes_the_shipped_folder(tmp_path):
    """As tiny-llama's: the config and tokenizer byte for byte, a trained model after
    bfloat16's rounding, and the shipped folder read as a Gemma (GeGLU, the embedding times
    sqrt(32), a tied head, one key head of four query heads 16 wide)."""
    pytest.importorskip("tokenizers")
    import subprocess
    import sys

    import tfmcli

    result = subprocess.run([sys.executable, str(EXAMPLES / "tiny_gemma.py"), str(tmp_path)],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert float(result.stdout.split("training loss ")[1].split()[0]) < 0.5
    for name in ("config.json", "tokenizer.json"):
        assert (tmp_path / name).read_bytes() == (EXAMPLES / "tiny-gemma" / name).read_bytes(), name
    made = tfmcli.load(tmp_path, text="The cat sat on the mat.")
    assert tfmcli.forward(made.params, made.inputs, made.cfg).loss < 0.6
    shipped = tfmcli.load(EXAMPLES / "tiny-gemma", text="The cat sat on the mat.")
    assert (shipped.cfg.activation, shipped.cfg.embed_scale, shipped.cfg.tied_head,
            shipped.cfg.h_kv, shipped.cfg.d_head, shipped.cfg.bias) == (
        "geglu", True, True, 1, 16, False)
    assert sum(p.size for p in shipped.params.values()) == 32_800
    assert tfmcli.forward(shipped.params, shipped.inputs, shipped.cfg).loss < 0.6


SEED_EXAMPLES = {   # script: (lines marked ✓, lines marked ≠, a number the note is wrong about)
    "seed_000.py": (12, 1, "0.69194171"),
    "seed_001.py": (11, 1, "0.23502814"),
    "seed_002.py": (7, 3, "0.0000  0.5000  0.5000"),
    "seed_003.py": (19, 5, "-4.18273278"),
    "seed_004.py": (10, 2, "0.80196180"),
}


@pytest.mark.parametrize("script", sorted(SEED_EXAMPLES))
def test_seed_examples_agree_where_the_notes_are_right(script):
    """Each agree() raises when tfm and the note disagree, so a clean run is the check; the
    counts catch a check that silently went missing, the number a note's mistake."""
    import subprocess
    import sys

    result = subprocess.run([sys.executable, str(EXAMPLES / script)], capture_output=True,
                            text=True)
    assert result.returncode == 0, result.stderr
    agreed, differed, wrong = SEED_EXAMPLES[script]
    lines = result.stdout.splitlines()
    assert sum(line.lstrip().startswith("✓") for line in lines) == agreed
    assert sum(line.lstrip().startswith("≠") for line in lines) == differed
    assert wrong in result.stdout


def test_agree_raises_when_the_numbers_differ():
    import sys

    sys.path.insert(0, str(EXAMPLES))
    from notes import agree

    with pytest.raises(AssertionError, match="off by 1.00e-03"):
        agree("x", [1.0, 2.0], [1.0, 2.001], atol=1e-8)


def test_differ_raises_when_the_numbers_it_shows_are_the_same(capsys):
    # seed 003's ReLU mask once showed db_expand[:4], where the note happens to be right
    import sys

    sys.path.insert(0, str(EXAMPLES))
    from notes import differ

    with pytest.raises(AssertionError, match=r"marked ≠, but tfm and the note both show"):
        differ("x", [0.52807845, 0.1], [0.52807845, 0.1], "why")
    differ("y", [0.52807845], [0.52807846], "why")   # the last digit shown differs
    assert "≠ y" in capsys.readouterr().out
