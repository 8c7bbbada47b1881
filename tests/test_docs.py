"""docs/derivations.md: every linked function exists, the numbers of its "common mistakes"
table are what the engine (and each mistake) computes, and its lists of gradients that sum to
zero are the engine's, so the page cannot drift; and every link of the README and the docs to
a heading finds it."""

import math
import re
import runpy
from pathlib import Path

import numpy as np
import pytest

import tfmcli
from helpers import ok, random_params
from tfmcli.engine import ops
from tfmcli.engine.positional import sinusoidal

ROOT = Path(__file__).resolve().parent.parent
DOC = (ROOT / "docs" / "derivations.md").read_text()


def test_every_linked_function_exists():
    """Each section's functions link to the code's map (code.md: a link to the .py file would
    404 on the site), which names the module; the module defines the function."""
    links = re.findall(r"\[`(\w+)\.(\w+)`\]\(([^)]*)\)", DOC)
    assert len(links) >= 12
    code = (ROOT / "docs" / "code.md").read_text()
    for module, function, target in links:
        assert target == "code.md", (module, function, target)
        [path] = (ROOT / "tfmcli").glob(f"*/{module}.py")
        assert f"{module}.py" in code, module
        assert f"def {function}(" in path.read_text(), function


def heading_anchors(text: str) -> set[str]:
    """The anchors GitHub gives a page's headings: lower case, punctuation dropped, spaces as
    hyphens ("### Rotary positions: `--pe rope`" is #rotary-positions---pe-rope)."""
    text = re.sub(r"```.*?```", "", text, flags=re.S)
    return {re.sub(r"[^\w\- ]", "", title.strip().lower()).replace(" ", "-")
            for title in re.findall(r"^#{1,6} (.+)$", text, flags=re.M)}


PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def test_every_link_to_a_heading_finds_it():
    """The README's and the docs' links name files and headings that exist (a renamed heading
    or a moved page would leave a link going nowhere), as GitHub reads them."""
    anchors = {page.resolve(): heading_anchors(page.read_text()) for page in PAGES}
    links = 0
    for page in PAGES:
        text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
        for target, anchor in re.findall(r"\]\(([^)\s#]*)(?:#([^)\s]+))?\)", text):
            if target.startswith(("http://", "https://")):
                continue
            where = (page.parent / target).resolve() if target else page.resolve()
            assert where.exists(), f"{page.relative_to(ROOT)} links to {target}"
            if anchor:
                assert anchor in anchors[where], (
                    f"{page.relative_to(ROOT)} links to {target}#{anchor}"
                )
            links += 1
    assert links >= 200
    assert {"rotary-positions---pe-rope", "sliding-window-attention---sliding-window"} <= \
        anchors[(ROOT / "docs" / "architectures.md").resolve()]
    assert "starcoder-and-santacoder-gptbigcode" in anchors[(ROOT / "docs" / "models.md").resolve()]


def row(mistake_prefix):
    """(tfm's number, the mistake's number) of the table row starting with this text."""
    line = next(l for l in DOC.splitlines() if l.startswith(f"| {mistake_prefix}"))
    cells = [c.strip() for c in line.strip("|").split("|")]
    return float(cells[2]), float(cells[3])


def close(row_values, right, wrong):
    assert abs(row_values[0] - right) < 5e-9, (row_values, right)
    assert abs(row_values[1] - wrong) < 5e-9, (row_values, wrong)


def test_seed_003_mistakes(monkeypatch, capsys):
    monkeypatch.syspath_prepend(str(ROOT / "examples"))
    ns = runpy.run_path(str(ROOT / "examples" / "seed_003.py"))
    close(row("layer-norm backward"), ns["right_dg"][0, 1, 0], ns["note_dg"][0, 1, 0])
    close(row("ReLU mask"), ns["grads"]["b_expand"][9], ns["note_dpre"].sum((0, 1))[9])


def test_seed_004_positional_mistakes():
    d, pe = 512, sinusoidal(2, 512)[1]
    i = 2   # the note's loop: the second pair has i = 2, and 2 * i in the exponent
    close(row("positional encoding: `i` stepped"), pe[2], math.sin(1 / 10000 ** (2 * i / d)))
    i = 0   # the first pair's cosine gets 2 * (i + 1)
    close(row("positional encoding: the cosine"), pe[1], math.cos(1 / 10000 ** (2 * (i + 1) / d)))


def test_seed_002_softmax_scale():
    from tfmcli.explain.steps import ILLUSTRATED

    X = ILLUSTRATED["X"]
    Q, K = X @ ILLUSTRATED["W_Q"], X @ ILLUSTRATED["W_K"]
    scaled, _ = ops.softmax_forward(Q @ K.T / math.sqrt(3))
    unscaled, _ = ops.softmax_forward(Q @ K.T)
    close(row("softmax of"), scaled[0, 0], unscaled[0, 0])


def test_seed_000_std_plus_eps():
    rng = np.random.default_rng(1000)
    X = rng.random((4, 6))
    gamma, beta = rng.random(6), rng.random(6)
    right, _ = ops.layer_norm_forward(X, gamma, beta, 1e-5)
    wrong = gamma * (X - X.mean(-1, keepdims=True)) / (X.std(-1, keepdims=True) + 1e-5) + beta
    close(row("`(x - μ) / (std + ε)`"), right[0, 4], wrong[0, 4])


def test_the_mutation_script_names_files_that_exist_and_tests_that_cover_them():
    """docs/testing.md's runs of scripts/mutate.py: each file it may mutate, and each test file
    it runs against that file, is there (a renamed module would make `--target` fail late)."""
    script = runpy.run_path(str(ROOT / "scripts" / "mutate.py"), run_name="mutate")
    tests = script["TESTS"]
    assert set(script["ENGINE"]) <= set(tests) and len(tests) == 56
    for path, covering in tests.items():
        assert (ROOT / path).is_file(), path
        assert covering and all((ROOT / test).is_file() for test in covering), path
    documented = re.findall(r"`([\w/]+(?:\.py)?)`", (ROOT / "docs" / "testing.md").read_text())
    for path in tests:
        name = path.removeprefix("tfmcli/")
        assert {name, name.removesuffix(".py"), Path(path).stem} & set(documented), path


# "Gradients whose entries sum to zero": the lists of that section, per position and weights
ALWAYS = {"attn.W_O", "attn.b_O", "ffn.W_2", "ffn.b_2"}   # each block's
READS_A_LAYER_NORM = {"attn.W_Q", "attn.W_K", "attn.W_V", "ffn.W_1"}   # at initial weights


def summing_to_zero(norm: str, initial: bool, tied: bool) -> set:
    cfg = tfmcli.Config(norm=norm, layers=2, pe="learned" if tied else "sinusoidal",
                        tied_head=tied, n_ctx=8, lengths=(4, 3))
    params = tfmcli.init_params(cfg)
    if not initial:
        params = random_params(params, seed=3)
    grads = tfmcli.backward(params, tfmcli.forward(params, tfmcli.make_inputs(cfg), cfg), cfg)
    sums = {name: abs(g.sum()) / np.abs(g).sum() for name, g in grads.items()}
    assert all(s < 1e-12 or s > 1e-6 for s in sums.values()), sums   # zero, or plainly not
    return {name for name, s in sums.items() if s < 1e-12}


def expected_zero_sums(norm: str, initial: bool, tied: bool) -> set:
    names = {f"blocks.{i}.{part}" for i in (0, 1) for part in ALWAYS}
    names |= {"head.b_U"} | (set() if tied else {"head.W_U"})
    if norm == "pre":
        names |= {"embed.W_E"} | ({"embed.W_pos"} if tied else set())
    if initial:
        names |= {f"blocks.{i}.{part}" for i in (0, 1) for part in READS_A_LAYER_NORM
                  if not (norm == "post" and i == 0 and part.startswith("attn"))}
    return names


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied+learned"])
@pytest.mark.parametrize("initial", [True, False], ids=["initial", "random"])
@pytest.mark.parametrize("norm", ["pre", "post"])
def test_the_gradients_whose_entries_sum_to_zero_are_those_the_page_lists(norm, initial, tied):
    assert summing_to_zero(norm, initial, tied) == expected_zero_sums(norm, initial, tied)


def test_tfm_backward_shows_eleven_means_as_zero_at_the_default_seed():
    assert "eleven of them are `≈0`" in DOC
    rows = [line.split() for line in ok("backward").stdout.splitlines() if "(" in line]
    zeros = {row[0] for row in rows if row[-1] in ("≈0", "0.0000")}
    # b_K's gradient is 0 altogether (derivations: b_K), its norm ≈0 as well as its mean
    assert next(row for row in rows if row[0] == "blocks.0.attn.b_K")[-3:] == ["≈0"] * 3
    assert zeros - {"blocks.0.attn.b_K"} == expected_zero_sums("pre", initial=True, tied=False) - {
        f"blocks.1.{part}" for part in ALWAYS | READS_A_LAYER_NORM}


def test_the_json_keys_table_is_what_each_command_prints(monkeypatch):
    """docs/formats.md's table of each command's --json keys, run: the page cannot drift."""
    import json
    import shlex

    pytest.importorskip("safetensors")
    monkeypatch.chdir(ROOT)
    page = (ROOT / "docs" / "formats.md").read_text()
    rows = re.findall(r"^\| `(tfm [^`]+)` \| (.+) \|$", page, flags=re.M)
    assert len(rows) >= 18
    extra = {"tfm train": ["--steps", "2"],
             "tfm lens": ["--load", "examples/tiny-gpt2", "--text", "The cat"],
             "tfm patch": ["--from-tokens", "1,2,3,4", "--from-tokens", "4,3,2,1"]}
    for command, keys in rows:
        args = shlex.split(command)[1:] + extra.get(command, []) + ["--json"]
        assert list(json.loads(ok(*args).stdout)) == re.findall(r"`(\w+)`", keys), command
