"""The examples run as written and print what they promise."""

import runpy
from pathlib import Path

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
