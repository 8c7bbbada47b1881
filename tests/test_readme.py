"""The README's and the docs' commands work as written and print what the pages show."""

import re
import shlex
from pathlib import Path

import pytest
from typer.testing import CliRunner

from helpers import assert_scaled_close, skip_without_oracle
from tfmcli.cli import app

ROOT = Path(__file__).resolve().parent.parent
README_PATH = ROOT / "README.md"
README = README_PATH.read_text()
PAGES = [README_PATH, *sorted((ROOT / "docs").rglob("*.md"))]
# Each "$ tfm ..." line of a code block, with the output lines shown under it, on every page.
EXAMPLES = [(page.relative_to(ROOT).as_posix(), command, shown) for page in PAGES
            for command, shown in re.findall(r"^\$ (tfm [^\n]*)\n(.*?)(?=^\$ |^```)",
                                             page.read_text(), flags=re.S | re.M)]


@pytest.fixture(autouse=True)
def plain_env(monkeypatch):
    for name in ("NO_COLOR", "FORCE_COLOR", "COLUMNS"):
        monkeypatch.delenv(name, raising=False)


def test_the_readme_and_every_command_page_have_examples():
    pages = {page for page, _, _ in EXAMPLES}
    assert sum(page == "README.md" for page, _, _ in EXAMPLES) >= 6
    from tfmcli.cli.app import COMMANDS

    commands = {p.stem for p in (ROOT / "docs" / "commands").glob("*.md")} - {"index"}
    assert commands == set(COMMANDS)   # a page for every command, and no other
    for command in commands:
        assert f"docs/commands/{command}.md" in pages, command


def test_the_readme_is_a_door():
    """At most 300 lines; a picture tfm drew, shown; set-up as two one-line commands (the
    main job, and the tests CI runs); the one command that proves the gradients."""
    assert len(README.splitlines()) <= 300
    assert re.search(r"^!\[[^]]+\]\(docs/pictures/forward\.svg\)$", README, flags=re.M)
    blocks = re.findall(r"^## Set up\n(.*?)^## ", README, flags=re.S | re.M)[0]
    commands = re.findall(r"^```\n(.*?)\n```", blocks, flags=re.S | re.M)
    assert len(commands) == 2 and all("\n" not in c for c in commands)
    assert commands[0].endswith("python -m pip install . && tfm forward --seed 1000")
    assert commands[1].endswith('python -m pip install ".[test,hf]" && python -m pytest')
    ci = (ROOT / ".ci" / "run").read_text()
    assert f"\n{commands[1]}\n" in ci   # CI runs the README's test command as written, first
    assert ci.index(commands[1]) < ci.index("torch==")   # before any oracle is installed
    assert "\ntfm check --against torch\n" in README


def rounding_noise_blanked(line):
    """Numbers below 1e-12 (like the mean of a gradient that is 0 in exact arithmetic) vary
    with the order of floating-point operations; the README's copy need not match them."""
    return re.sub(r"[+-]?\d\.\d+e-(1\d|[2-9]\d)", "≈0", line.rstrip())


@pytest.mark.parametrize("page, command, shown", EXAMPLES,
                         ids=[f"{page}: {c}" for page, c, _ in EXAMPLES])
def test_each_example_prints_what_its_page_shows(page, command, shown, monkeypatch):
    if "examples/tiny-" in command:   # tiny-gpt2, tiny-llama: checkpoint folders
        pytest.importorskip("safetensors")
        pytest.importorskip("tokenizers")
    skip_without_oracle(shlex.split(command)[1:])
    monkeypatch.chdir(ROOT)   # the pages' paths are relative to the project
    result = CliRunner().invoke(app, shlex.split(command)[1:])
    assert result.exit_code == 0, result.output
    printed = {rounding_noise_blanked(line) for line in result.stdout.splitlines()}
    for line in shown.splitlines():
        if line.strip() and line.strip() != "...":
            assert rounding_noise_blanked(line) in printed, (
                f"{page} shows {line!r}; tfm printed:\n{result.stdout}")


def inline_commands() -> list:
    """Commands quoted inline (`tfm ...`) on the pages, but for synopses. docs/testing.md
    quotes the refusals the tests check (`tfm check --tol 0`): not examples."""
    commands = {c for page in PAGES if page.name != "testing.md"
                for c in re.findall(r"`(tfm [a-z]+[^`]*)`", page.read_text())}
    # (tfm explore alone is full-screen: test_explore.py checks its refusal without a terminal)
    return sorted(c for c in commands if "[" not in c and c != "tfm explore" and not any(
        part in ("FILE", "FILE.npz", "N", "NAME", "i", "h", "t", "DIR") or "|" in part
        or "a,b,c" in part for part in shlex.split(c)[1:]))


@pytest.mark.parametrize("command", inline_commands())
def test_inline_commands_on_every_page_run(command, monkeypatch):
    """Each parses and runs, or fails only as the pages say."""
    pytest.importorskip("safetensors")
    args = shlex.split(command)[1:]
    skip_without_oracle(args)
    monkeypatch.chdir(ROOT)
    result = CliRunner().invoke(app, args)
    # the refusals the pages quote, and tfm patch and circuit named (they need a corrupted run)
    expected = 2 if command in ("tfm forward -d 7 -H 2", "tfm forward -T 100000",
                                "tfm patch", "tfm circuit") else 0
    assert result.exit_code == expected, (command, result.output)


API = (ROOT / "docs" / "api.md").read_text()


def test_the_python_api_block_runs_and_its_comments_hold(monkeypatch):
    """docs/api.md's code, run as written, gives what its comments say."""
    pytest.importorskip("safetensors")
    pytest.importorskip("tokenizers")
    import numpy as np

    block = re.search(r"^```python\n(.*?)^```", API, flags=re.S | re.M)[1]
    monkeypatch.chdir(ROOT)
    names = {}
    exec(compile(block, "docs/api.md", "exec"), names)
    inputs, cfg, report, run = names["inputs"], names["cfg"], names["report"], names["run"]
    assert inputs.tokens.shape == (2, 5) and inputs.lengths.tolist() == [5, 2]
    assert inputs.targets.tolist() == [[1, 4, 1, 5, -100], [7, -100, -100, -100, -100]]
    assert names["tfmcli"].IGNORE == -100
    assert (cfg.seq_len, cfg.lengths) == (5, (5, 2))
    assert report.passed and report.worst.rel_err <= 1e-6
    assert run.token_labels(0) == ["The", "␣cat", "␣sat"]
    assert ("params={36 arrays: 'embed.W_E' (286, 32) … 'ln_f.beta' (32,)}, inputs=Inputs("
            "tokens=array([[258, 264, 269]])") in repr(run)   # a line, not every parameter
    fwd = names["fwd"]   # the GPT-2 folder's
    assert isinstance(fwd.loss, float) and fwd.scored == 2   # "The cat sat": two next tokens
    # fwd as the page shows it; the loss's last digits may be another BLAS kernel's
    shown = re.search(r"^Forward\(loss=([\d.]+)(.*)$", API, flags=re.M)
    assert f"Forward(loss={fwd.loss!r}{shown[2]}" == repr(fwd)
    assert float(shown[1]) == pytest.approx(fwd.loss, rel=1e-12)
    grads, toy = names["grads"], names["tfmcli"].forward(names["params"], inputs, cfg)
    assert list(grads) == list(names["params"])
    onehot = np.zeros_like(toy.acts["probs"])   # dlogits = (P - Y) / N over the scored positions
    for b, t in zip(*np.nonzero(inputs.targets != -100)):
        onehot[b, t, inputs.targets[b, t]] = 1
    scored = (inputs.targets != -100)[..., None]
    assert_scaled_close(grads.acts["logits"],
                        (toy.acts["probs"] - onehot) * scored / 5, floor=1e-15)


def github_anchor(heading: str) -> str:
    """The id GitHub gives a heading: lower case, punctuation dropped, spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_the_readmes_links_lead_to_files_and_headings_that_exist():
    links = re.findall(r"\]\(((?:docs|examples)/[^)#\s]+)(?:#([^)\s]+))?\)", README)
    assert len(links) >= 6
    for path, anchor in links:
        target = README_PATH.parent / path
        assert target.exists(), path
        if anchor:
            headings = re.findall(r"^#+ (.+)$", target.read_text(), flags=re.M)
            assert anchor in {github_anchor(h) for h in headings}, (path, anchor)


def test_github_anchors_drop_punctuation_and_keep_doubled_hyphens():
    assert github_anchor("The runs") == "the-runs"
    assert github_anchor("Sums to zero — what `tfm backward`'s mean shows") == \
        "sums-to-zero--what-tfm-backwards-mean-shows"


def test_the_notebook_drawing_block_runs_and_prints_text(capsys):
    """docs/api.md's render block: print() of a view is the view as text."""
    block = re.findall(r"^```python\n(.*?)^```", API, flags=re.S | re.M)[1]
    exec(compile(block, "docs/api.md, render", "exec"), {})
    printed = capsys.readouterr().out
    assert "0  1.00   ·     ·     ·" in printed and "blocks.0.attn.pattern*" in printed
    assert "<rich" not in printed


def test_the_tour_says_what_a_checkpoint_folder_needs_before_it_loads_one():
    """After the README's main install `tfm lens --load examples/tiny-gpt2` fails for want of
    safetensors: the tour says to install the hf extra before its first --load DIR or --text."""
    from tfmcli.sources.gpt2 import INSTALL  # the line tfm itself says when they are missing

    first = min(README.index(word) for word in ("--load examples/", "--text "))
    assert INSTALL in " ".join(README[:first].split())
