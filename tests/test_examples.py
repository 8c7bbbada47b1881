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


def test_import_tfmcli_alone_gives_the_submodules_the_readme_uses():
    import subprocess
    import sys
    code = "import tfmcli; tfmcli.io.save_npz; tfmcli.ops.layer_norm_forward; tfmcli.config.flops"
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
