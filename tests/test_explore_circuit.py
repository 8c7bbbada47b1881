"""tfm explore with a corrupted run (issue 74): the circuit's edge scores as a tensor of the
explorer, an edge explained as its two factors with the run's numbers (the sum read from the
screen against ``Circuit.scores``), Enter to either end of an edge, a planted wrong factor
caught as a bug, and nothing changed without the corrupted run."""

import re

import numpy as np
import pytest

pytest.importorskip("textual")

from test_explore import SIZES, explorer, press  # noqa: E402

import tfmcli  # noqa: E402
from helpers import error_line, ok, run  # noqa: E402
from tfmcli.explain import edges  # noqa: E402
from tfmcli.explain.circuit import circuit, read_gradient, written  # noqa: E402
from tfmcli.tui.state import CIRCUIT, Explorer, View  # noqa: E402

CLEAN, CORRUPTED = [3, 1, 4, 1, 5], [3, 1, 2, 1, 5]


def circuit_explorer(metric="loss", answer=None, wrong=None, steps=0, **fields):
    """An explorer opened as ``tfm explore --tokens 3,1,4,1,5 --from-tokens 3,1,2,1,5``."""
    from tfmcli.sources import Run

    cfg = tfmcli.Config(**{"seq_len": 5, "layers": 2, "batch": 1, **fields})
    params, inputs = tfmcli.init_params(cfg), tfmcli.inputs_from_tokens([CLEAN])
    fwd = tfmcli.forward(params, inputs, cfg)
    made = circuit(params, inputs, tfmcli.inputs_from_tokens([CORRUPTED]), cfg, metric,
                   answer, wrong, steps)
    return Explorer(Run(cfg, params, inputs, "seed", "seed"), fwd,
                    tfmcli.backward(params, fwd, cfg), ["--layers", "2", "--tokens", "3,1,4,1,5"],
                    circuit=made, circuit_argv=["--from-tokens", "3,1,2,1,5"])


def at(ex, sender: str, reader: str) -> View:
    c = ex.circuit
    u = [s.name for s in c.senders].index(sender)
    v = [r.name for r in c.readers].index(reader)
    return View(CIRCUIT, False, (0, 1), (u, v))


def explained(app) -> list[str]:
    """The explanation the pane shows of the cell the app is on (before it is folded)."""
    return app.explorer.explain(app.view)


def number(lines, label) -> float:
    """The number on the line that starts with ``label`` (the sum, the score)."""
    [line] = [line for line in lines if line.startswith(label)]
    return float(line.split()[-1])


@pytest.mark.parametrize("size", SIZES)
def test_the_circuit_opens_first_at_its_largest_edge_and_from_the_list(size):
    ex = circuit_explorer()
    c = ex.circuit
    app, text, _ = press(ex, [], size)
    u, v = c.edges()[0]
    assert app.view == View(CIRCUIT, False, (0, 1), (u, v))
    assert "circuit (sender, reader) 7x15" in text and "edge scores" in text
    assert f"EAP of the loss: clean {c.clean:.4f}, corrupted {c.corrupted:.4f}" in " ".join(
        text.split())
    assert "· no edge" in text and "$ tfm circuit --layers 2 --tokens 3,1,4,1,5 " \
        "--from-tokens 3,1,2,1,5" in text
    # the list's entry opens it, from another tensor (and / finds it)
    start = View("blocks.0.attn.pattern", False, (2, 3), (0, 0, 0, 0))
    app, _, _ = press(ex, ["/", *"edge", "enter"], size, start)
    assert app.view.name == CIRCUIT
    ids = [line[3] for line in ex.tree() if line[3]]
    assert ids[0] == f"v:{CIRCUIT}"
    app, _, _ = press(ex, ["tab"] + ["up"] * ids.index("v:blocks.0.attn.pattern"), size, start)
    assert app.view.name == CIRCUIT
    # the arrows move along senders and readers; the cell named as the edge
    app, _, _ = press(ex, ["down", "right"], size)
    assert app.view.index == ((u + 1) % 7, (v + 1) % 15)
    assert explained(app)[0].startswith(c.name(app.view.index))


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("edge", [None, ("a0.1", "a1.0.k"), ("m0", "a1.1.q")])
def test_an_edge_is_its_two_factors_and_their_sum_is_the_score(edge, size):
    """The sum on screen is Circuit.scores' number; each term listed is Δ . g at its row and
    position with |Δ| and |g|, worked out here from the runs (Δ from what the sender wrote in
    each, g from the clean run's backward of the loss, through the reader's path)."""
    ex = circuit_explorer()
    c = ex.circuit
    view = None if edge is None else at(ex, *edge)
    app, _, _ = press(ex, [], size, view)
    u, v = app.view.index
    lines = explained(app)
    score = float(c.scores[u, v])
    assert score != 0
    for label in ("sum", "score (EAP)"):
        assert abs(number(lines, label) - score) <= 5e-4 * abs(score), (label, lines)
    text = " ".join(" ".join(lines).split())
    sender, reader = c.senders[u], c.readers[v]
    if edge == ("a0.1", "a1.0.k"):
        assert "head 0.1's output, as read by head 1.0's keys" in text
    assert f"Δ: what {sender.name} wrote, corrupted - clean" in text
    assert f"g: d loss / d the stream where {reader.name} reads it" in text
    # the terms, from the runs themselves
    ctx, cfg = c.context, c.context["cfg"]
    delta = written(cfg, ctx["params"], ctx["corrupt_acts"], sender) - written(
        cfg, ctx["params"], ctx["clean_acts"], sender)
    fwd = tfmcli.forward(ctx["params"], tfmcli.inputs_from_tokens([CLEAN]), cfg, fast=False)
    g = read_gradient(cfg, ctx["params"], fwd.acts, tfmcli.backward(ctx["params"], fwd, cfg).acts,
                      reader)
    products = (delta * g).sum(axis=-1)[0]
    t = int(np.argmax(np.abs(products)))
    first = lines.index("largest terms Δ . g:") + 1
    words = lines[first].split()
    assert words[:2] == ["r0", f"t{t}:{ex.run.token_labels(0)[t]}"], lines[first]
    assert abs(float(words[2]) - products[t]) <= 5e-4 * abs(products[t])
    sizes = lines[first + 1].split()
    assert sizes[0] == "|Δ|" and sizes[2] == "|g|"
    for written_size, exact in ((sizes[1], np.linalg.norm(delta[0, t])),
                                (sizes[3], np.linalg.norm(g[0, t]))):
        assert abs(float(written_size) - exact) <= 5e-4 * exact


def test_the_number_lines_fit_36_columns_and_the_words_fold_at_spaces():
    """Every cell of every preset's grid (GQA, sandwich norms, parallel blocks): the
    explanation holds, its lines of numbers fit the wide pane's 36 columns as written, its
    words fold to them at spaces (tui.app.fold), and the two ends are tensors of the run."""
    from tfmcli.engine.presets import PRESETS
    from tfmcli.tui.app import fold

    for arch in (None, "llama", "mistral", "gemma2", "gptj"):
        ex = circuit_explorer(**(PRESETS[arch].fields if arch else {}))
        c = ex.circuit
        for u in range(len(c.senders)):
            for v in range(len(c.readers)):
                made = edges.explain_edge(ex.run, c, u, v)
                assert made.holds and not made.bug, (arch, c.name((u, v)))
                lines = made.text()
                assert all(len(folded) <= 36 for line in lines for folded in fold(line, 36)), (
                    arch, lines)
                numbers = [line for line in lines[1:]   # a term, |Δ| and |g|, the sum
                           if re.search(r"  (\S+ +)?[+-]?[\d.]+(e[+-]\d+)?$", line)]
                assert all(len(line) <= 36 for line in numbers), numbers
                if c.mask[u, v]:
                    for end, view in ex.ends(View(CIRCUIT, False, (0, 1), (u, v))):
                        assert view.name in ex.values and len(view.index) == ex.values[
                            view.name].ndim, (arch, end)
                        ex.values[view.name][view.index]   # a cell of the run


@pytest.mark.parametrize("size", SIZES)
def test_a_cell_that_is_no_edge_says_why(size):
    ex = circuit_explorer()
    app, text, _ = press(ex, [], size, at(ex, "m1", "a0.0.q"))
    lines = " ".join(" ".join(explained(app)).split())
    assert lines.startswith("m1 → a0.0.q: no edge")
    assert "the reader reads the stream before the sender writes into it" in lines
    assert "a0.0.q, head 0.0's queries, reads it at block 0's input" in lines
    assert "m1, block 1's MLP's output, writes at block 1's output" in lines
    app, text, _ = press(ex, ["enter"], size, at(ex, "m1", "a0.0.q"))
    assert app.view.name == CIRCUIT and "no edge here" in " ".join(text.split())


@pytest.mark.parametrize("size", SIZES)
def test_enter_follows_an_edge_to_either_end_and_escape_comes_back(size):
    ex = circuit_explorer()
    edge = at(ex, "a0.1", "a1.0.k")
    c = ex.circuit
    screens = []
    app, _, _ = press(ex, ["enter"], size, edge, check=lambda app, text: screens.append(text))
    assert "follow a0.1 → a1.0.k to" in screens[0]
    assert "blocks.0.attn.context[" in screens[0] and "blocks.1.attn.k[" in screens[0]
    (sender_end, sender_view), (reader_end, reader_view) = ex.ends(edge)
    # the row and position of the largest term
    products = c.context["terms"](edge.index)
    r, t = np.unravel_index(int(np.argmax(np.abs(products))), products.shape)
    app, text, _ = press(ex, ["enter", "enter"], size, edge)   # the first: the sender's
    assert app.view == sender_view and app.view.name == "blocks.0.attn.context"
    assert app.view.index[:2] == (r, t) and 3 <= app.view.index[2] < 6   # head 1's columns
    assert "blocks.0.attn.context (B, T, d_q)" in text
    for keys in (["enter", "down", "enter"], ["enter", "2"]):   # the reader's
        app, text, _ = press(ex, keys, size, edge)
        assert app.view == reader_view == View("blocks.1.attn.k", False, (2, 3), (r, 0, t, 0))
        assert "blocks.1.attn.k (B, H, T, d_head)" in text
    app, text, _ = press(ex, ["enter", "2", "escape"], size, edge)   # back on the edge
    assert app.view == edge and "a0.1 → a1.0.k =" in text
    app, text, _ = press(ex, ["enter", "escape"], size, edge)   # Esc in the choice: stays
    assert app.view == edge and not app.stack and "follow a0.1" not in text
    # an MLP's and the embedding's ends; the logits' at the target token
    (_, m), (_, logits) = ex.ends(at(ex, "m0", "logits"))
    assert m.name == "blocks.0.ffn.out" and logits.name == "logits"
    target = int(ex.run.inputs.targets[m.index[0], m.index[1]])
    assert logits.index == (*m.index[:2], target)
    (_, emb), (_, mlp) = ex.ends(at(ex, "emb", "m1"))
    assert (emb.name, mlp.name) == ("blocks.0.in", "blocks.1.ffn.pre")


@pytest.mark.parametrize("size", SIZES)
def test_a_planted_wrong_factor_is_a_bug_on_screen(monkeypatch, size):
    """Δ or g made wrong (a sign flipped, a factor of 2): the sum no longer gives the
    score, and the pane says it is a bug rather than show the wrong sum as the score's."""
    ex = circuit_explorer()
    edge = at(ex, "a0.1", "a1.0.k")
    assert not edges.explain_edge(ex.run, ex.circuit, *edge.index).bug
    gradient = edges.gradient
    monkeypatch.setattr(edges, "gradient", lambda c, v: 2 * gradient(c, v))
    assert edges.explain_edge(ex.run, ex.circuit, *edge.index).bug
    _, text, _ = press(ex, [], size, edge)
    assert "a bug in tfm:" in text and "please report it" in " ".join(text.split())
    monkeypatch.setattr(edges, "gradient", gradient)
    difference = edges.difference
    monkeypatch.setattr(edges, "difference", lambda c, u: -difference(c, u))
    assert edges.explain_edge(ex.run, ex.circuit, *edge.index).bug


def test_eap_ig_and_a_logit_difference_say_so_and_still_add_up():
    ex = circuit_explorer("logit-diff", 2, 3, steps=3)
    c = ex.circuit
    for u, v in c.edges()[:5]:
        made = edges.explain_edge(ex.run, c, u, v)
        assert made.holds and made.claimed == pytest.approx(c.scores[u, v], rel=1e-12)
        text = " ".join(made.text())
        assert "d logit-diff / d the stream" in text and "averaged over 3 runs" in text
        assert "score (EAP-IG)" in text
    (_, _), (_, logits) = ex.ends(View(CIRCUIT, False, (0, 1), (0, len(c.readers) - 1)))
    assert logits.index[2] == 2   # the answer's logit


@pytest.mark.parametrize("size", SIZES)
def test_without_a_corrupted_run_the_list_and_first_screen_are_as_before(size):
    ex = explorer(layers=2)
    assert ex.circuit is None and CIRCUIT not in ex.values
    assert ex.tree()[0] == (0, "activations", "", None)
    assert not any("circuit" in line[1] for line in ex.tree())
    app, text, _ = press(ex, [], size)
    assert app.view.name == "blocks.0.attn.pattern" and "circuit" not in text


def test_the_command_line_opens_the_circuit_and_each_views_command_runs(tmp_path):
    out = tmp_path / "view.svg"
    args = ["--tokens", "3,1,4,1,5", "--from-tokens", "3,1,2,1,5", "-L", "2"]
    ok("explore", *args, "--keys", "enter,enter", "--screenshot", out)
    screen = out.read_text().replace("&#160;", " ")
    assert "(B, T, " in screen and "$ tfm " in screen
    command = re.search(r"\$ (tfm [^<]*)", screen)[1].split()
    assert "--from-tokens" not in command   # the explored run is the clean one
    ok(*command[1:])
    ok("explore", *args, "--keys", "q", "--screenshot", out)
    screen = out.read_text().replace("&#160;", " ")
    command = re.search(r"\$ (tfm circuit [^<]*)", screen)[1].split()
    assert command[-2:] == ["--from-tokens", "3,1,2,1,5"]
    ok(*command[1:])


@pytest.mark.parametrize("args, flag, words", [
    (["--metric", "logit-diff"], "'--metric'", "add --from-tokens"),
    (["--steps", "2", "--patch", "blocks.0.in", "--from-tokens", "3,1,2,1,5"], "'--steps'",
     "without --patch"),
    (["--ablate", "blocks.0.attn.head1", "--from-tokens", "3,1,2,1,5"], "'--from-tokens'",
     "drop --ablate"),
    (["--from-tokens", "3,1,2,1,5", "--metric", "logit-diff"], "'--metric'", "--answer"),
    (["--from-tokens", "3,1"], "'--from-tokens'", "lengths"),
    (["--from-tokens", "3,1,2,1,5", "--norm", "post"], "'--norm'", "Pre-LN"),
])
def test_the_circuits_options_refuse_what_cannot_be(args, flag, words):
    line = error_line(run("explore", "--tokens", "3,1,4,1,5", *args, "--keys", "q"), 2)
    assert flag in line and words in line, line


def test_the_pages_example_block_is_what_the_explorer_shows():
    """docs/commands/explore.md's edge, as the 40-column pane folds it."""
    from pathlib import Path

    from tfmcli.tui.app import fold

    page = (Path(__file__).parent.parent / "docs" / "commands" / "explore.md").read_text()
    block = re.search(r"```\n(a0\.1 → a1\.0\.k = .*?)```", page, flags=re.S)[1]
    ex = circuit_explorer()
    shown = [folded for line in ex.explain(at(ex, "a0.1", "a1.0.k")) for folded in fold(line, 36)]
    assert block.splitlines() == shown


def test_p_on_the_circuit_does_not_title_its_scores_a_difference(tmp_path):
    """A float32 run: p shows each tensor's difference from float64, but the circuit's grid
    stays its scores (float64's circuit is not made), and its title does not say otherwise."""
    out = tmp_path / "p.svg"
    ok("explore", "--dtype", "float32", "-L", "2", "--tokens", "3,1,4,1,5", "--from-tokens",
       "3,1,2,1,5", "--keys", "p", "--screenshot", out)
    text = out.read_text().replace("&#160;", " ")
    assert "circuit (sender, reader)" in text and "float32 - float64: circuit" not in text
