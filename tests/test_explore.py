"""tfm explore: the app driven headless by Textual's own harness (App.run_test and its Pilot),
the numbers on screen against the API's, links followed, the headless --keys/--screenshot."""

import asyncio
import json
import re
import subprocess
import sys

import numpy as np
import pytest

pytest.importorskip("textual")

import tfmcli  # noqa: E402
from helpers import error_line, ok, run  # noqa: E402
from tfmcli.tui.app import ExploreApp  # noqa: E402
from tfmcli.tui.state import Explorer, View  # noqa: E402


def explorer(**fields):
    cfg = tfmcli.Config(**{"seq_len": 5, **fields})
    params, inputs = tfmcli.init_params(cfg), tfmcli.make_inputs(cfg)
    fwd = tfmcli.forward(params, inputs, cfg)
    grads = tfmcli.backward(params, fwd, cfg)
    from tfmcli.sources import Run
    source = Run(cfg, params, inputs, "seed", "seed")
    return Explorer(source, fwd, grads, [])


def drive(ex, keys, size=(120, 40)):
    """The app after ``keys``: (its view, the explanation's text, the screen as SVG, whether
    the screen is laid out narrow)."""
    app = ExploreApp(ex, "test")

    async def go():
        async with app.run_test(size=size) as pilot:
            for key in keys:
                await pilot.press(key)
            await pilot.pause()
            explained = str(app.query_one("#explanation").render())
            return app.view, explained, app.export_screenshot(), app.screen.has_class("narrow")

    return asyncio.run(go())


def test_arrows_move_the_cell_and_the_screen_says_the_apis_number():
    ex = explorer()
    view, explained, svg, _ = drive(ex, ["down", "down", "right"])
    assert view == View("blocks.0.attn.pattern", False, (2, 3), (0, 0, 2, 1))
    value = ex.fwd.acts["blocks.0.attn.pattern"][0, 0, 2, 1]
    assert explained.startswith(f"pattern[0, 0, q2, k1] = {value:.6g}")
    scores = ex.fwd.acts["blocks.0.attn.scores"][0, 0, 2, :3]
    exps = np.exp(scores - scores.max())
    assert f"{exps[1]:.4f} / {exps.sum():.4f}" in explained    # the softmax, written out
    assert f"{value:+.4f}" in svg.replace("&#160;", " ")


def test_enter_follows_a_number_to_where_it_came_from_and_escape_comes_back():
    ex = explorer()
    view, explained, _, app = drive(ex, ["down", "down", "right", "enter"])
    assert view == View("blocks.0.attn.scores", False, (2, 3), (0, 0, 2, 1))
    q, k = ex.fwd.acts["blocks.0.attn.q"][0, 0, 2], ex.fwd.acts["blocks.0.attn.k"][0, 0, 1]
    assert f"q . k = {q @ k:+.6f}" in explained
    view, _, _, _ = drive(ex, ["down", "down", "right", "enter", "enter"])
    assert (view.name, view.index[:3]) == ("blocks.0.attn.q", (0, 0, 2))   # the query's row
    view, _, _, _ = drive(ex, ["down", "down", "right", "enter", "enter", "escape", "escape"])
    assert view == View("blocks.0.attn.pattern", False, (2, 3), (0, 0, 2, 1))


def test_the_keys_move_along_heads_rows_blocks_axes_and_to_the_gradient():
    ex = explorer(layers=2, batch=2)
    view, explained, _, _ = drive(ex, ["]", "r", "}", "d"])
    assert view == View("blocks.1.attn.pattern", True, (2, 3), (1, 1, 0, 0))
    grad = ex.grads.acts["blocks.1.attn.pattern"][1, 1, 0, 0]
    assert explained.startswith(f"dpattern[1, 1, q0, k0] = {grad:.6g}")
    view, _, _, _ = drive(ex, ["x", "right"])
    assert view.shown == (3, 2) and view.index == (0, 0, 1, 0)


def test_c_checks_a_parameters_gradient_entry_by_central_differences():
    ex = explorer()
    view = View("blocks.0.ffn.W_1", True, (0, 1), (2, 3))
    ours, numeric = ex.central_difference(view)
    assert ours == ex.grads["blocks.0.ffn.W_1"][2, 3]
    assert abs(ours - numeric) <= 1e-8 * max(1.0, abs(ours))


def test_the_overview_opens_the_map_chosen():
    ex = explorer(layers=2)
    view, _, svg, _ = drive(ex, ["g", "down", "right", "enter"])
    assert (view.name, view.index[1]) == ("blocks.1.attn.pattern", 1)
    _, _, svg, _ = drive(ex, ["g"])
    assert "across" in svg and "h1" in svg


def test_at_80_by_24_the_explanation_goes_under_the_tensor():
    assert drive(explorer(), [], size=(80, 24))[3]
    assert not drive(explorer(), [], size=(120, 40))[3]


def test_each_views_command_runs_outside_the_explorer():
    ex = explorer()
    ex.argv = ["--seq-len", "5"]
    for view in (View("blocks.0.attn.pattern", False, (2, 3), (0, 1, 3, 2)),
                 View("blocks.0.ln1.out", False, (1, 2), (1, 2, 0)),
                 View("blocks.0.ffn.act", False, (1, 2), (0, 4, 0)),
                 View("blocks.0.attn.W_Q", True, (0, 1), (0, 0))):
        words = ex.command(view).split()
        assert words[0] == "tfm"
        ok(*words[1:])


def test_headless_keys_write_the_last_screen_as_svg(tmp_path):
    out = tmp_path / "view.svg"
    result = ok("explore", "--tokens", "3,1,4,1,5", "--keys", "down,enter,g", "--screenshot", out)
    assert result.stdout == ""
    svg = out.read_text()
    assert svg.startswith("<svg") and "tfm explore" in svg.replace("&#160;", " ")


@pytest.mark.parametrize("args, words", [
    ([], ["'explore'", "needs a terminal", "--keys"]),   # no terminal here: a pipe
    (["--keys", "down,hop"], ["'--keys'", "'hop' is not a key"]),
    (["--screenshot", "x.svg"], ["'--screenshot'", "add --keys"]),
])
def test_bad_keys_are_usage_errors(args, words, tmp_path):
    line = error_line(run("explore", *args), 2)
    assert all(word in line for word in words), line


def test_no_other_command_imports_textual():
    code = ("import sys; from tfmcli.cli import main; sys.argv = ['tfm', 'forward', '--json']\n"
            "try:\n    main()\nexcept SystemExit:\n    pass\n"
            "print(json.dumps('textual' in sys.modules), file=sys.stderr)")
    done = subprocess.run([sys.executable, "-c", "import json\n" + code], capture_output=True,
                          text=True)
    assert json.loads(done.stderr.splitlines()[-1]) is False


@pytest.mark.parametrize("arch", [None, "gpt2", "llama", "vaswani", "qwen3", "gemma2", "bloom",
                                  "mistral"])
def test_a_gradient_entry_is_the_sum_of_its_paths(arch):
    """Every gradient tensor of these presets (RoPE's q and k, Post-LN's streams, qk-norm,
    sandwich norms and caps, the embedding's norm, GQA) has its paths, each line within the
    40-column pane's 36 (its border, padding and scrollbar), the sum to four digits of the
    backward's, right under it and in the column of the terms."""
    from tfmcli.engine.presets import PRESETS
    from tfmcli.explain.gradients import WIDTH, explain_gradient
    from tfmcli.render.numbers import column

    ex = explorer(layers=2, seed=7, **(PRESETS[arch].fields if arch else {}))
    rng = np.random.default_rng(0)
    for name in ex.names():
        shape = ex.gradients[name].shape
        for _ in range(3):
            index = tuple(int(rng.integers(0, n)) for n in shape)
            explained = explain_gradient(ex.run, ex.fwd, ex.grads, name, index, name)
            assert explained.claimed is not None and explained.holds, (name, index)
            lines = list(explained.lines)
            value = ex.gradients[name][index]
            assert WIDTH == 36 and max(map(len, lines)) <= WIDTH, lines
            total, backward = (re.fullmatch(rf"  {word} +(\S+)", line)[1]
                               for word, line in zip(("sum", "backward"), lines[-2:]))
            assert len(lines[-1]) == len(lines[-2]), lines   # one column, right-aligned
            if backward == "≈0":   # rounding noise next to its terms: so must the sum be
                assert (total == "≈0" or float(total) == 0) and abs(value) < 1e-15, lines
            else:   # four significant digits
                assert backward == column([value])(value).strip(), lines
                assert abs(float(total) - value) <= 5e-4 * abs(value), lines


def test_a_weights_paths_are_its_input_times_its_outputs_gradient_at_each_position():
    from tfmcli.explain.gradients import explain_gradient

    ex = explorer(batch=1)
    lines = explain_gradient(ex.run, ex.fwd, ex.grads, "blocks.0.attn.W_O", (4, 1),
                           "").text()[1:]
    x, dy = ex.fwd.acts["blocks.0.attn.context"][0], ex.grads.acts["blocks.0.attn.out"][0]
    terms = x[:, 4] * dy[:, 1]
    t = int(np.argmax(np.abs(terms)))
    assert lines[:3] == ["= sum over rows r, positions t of", "  attn.context[r, t, 4]",
                         "  x dattn.out[r, t, 1]"]
    row, position, written = lines[4].split()
    assert (row, position) == ("r0", f"t{t}:{ex.run.token_labels(0)[t]}")
    # four significant digits of the column's largest term: this one
    assert written == f"{terms[t]:+.{3 - int(np.floor(np.log10(abs(terms[t]))))}f}"


def test_a_gradient_with_no_rule_says_so_rather_than_a_wrong_sum(monkeypatch):
    from tfmcli.engine.presets import PRESETS
    from tfmcli.explain import gradients

    ex = explorer(**PRESETS["llama"].fields)
    view = View("blocks.0.attn.q", True, (2, 3), (0, 1, 2, 0))
    assert "RoPE's turn back at position 2:" in ex.explain(view)
    monkeypatch.setattr(gradients, "readers", lambda cfg, name: [])
    lines = ex.explain(View("blocks.0.resid1", True, (1, 2), (0, 2, 0)))
    assert "no breakdown" in " ".join(lines) and not any("backward" in line for line in lines)


def test_a_gradient_changed_by_an_intervention_names_it():
    """d(ln1.out) sums W_Q dq: with q scaled by 3, what reached ln1.out was 3 dq, not dq."""
    from tfmcli.engine.interventions import Scale
    from tfmcli.sources import Run

    cfg = tfmcli.Config(seq_len=5)
    params, inputs = tfmcli.init_params(cfg), tfmcli.make_inputs(cfg)
    fwd = tfmcli.forward(params, inputs, cfg, interventions=[Scale("blocks.0.attn.q", 3.0)])
    grads = tfmcli.backward(params, fwd, cfg)
    ex = Explorer(Run(cfg, params, inputs, "seed", "seed"), fwd, grads, [])
    lines = ex.explain(View("blocks.0.ln1.out", True, (1, 2), (0, 2, 3)))
    assert lines[1] == "changed by scale blocks.0.attn.q x 3:"
    assert lines[2].startswith("  the formula gives ") and "the run recorded" in lines[2]
    # W_V's gradient reads dv, which no intervention touched: it holds
    assert "changed" not in " ".join(ex.explain(View("blocks.0.attn.W_V", True, (0, 1),
                                                     (0, 0))))


def test_enter_follows_each_kind_of_tensor_to_its_input():
    ex = explorer(layers=2)
    at = ex.follow
    token = int(ex.run.inputs.tokens[1, 3])
    assert at(View("embed", False, (1, 2), (1, 3, 4))) == View("embed.W_E", False, (0, 1),
                                                              (token, 4))
    assert at(View("blocks.1.in", False, (1, 2), (0, 2, 1))).name == "blocks.0.out"
    assert at(View("blocks.0.in", True, (1, 2), (0, 2, 1))) == View("embed", True, (1, 2),
                                                                    (0, 2, 1))
    # column 4 of the context is head 1's (d_head 3) dimension 1: its pattern row
    assert at(View("blocks.0.attn.context", False, (1, 2), (0, 2, 4))) == View(
        "blocks.0.attn.pattern", False, (2, 3), (0, 1, 2, 0))
    assert at(View("blocks.0.attn.v", False, (2, 3), (1, 1, 3, 2))) == View(
        "blocks.0.attn.v".replace("attn.v", "ln1.out"), False, (1, 2), (1, 3, 5))
    assert at(View("blocks.0.ln2.out", False, (1, 2), (0, 1, 1))).name == "blocks.0.resid1"
    assert at(View("blocks.0.ffn.pre", False, (1, 2), (0, 1, 9))) == View(
        "blocks.0.ln2.out", False, (1, 2), (0, 1, 0))
    assert at(View("blocks.0.attn.W_Q", False, (0, 1), (0, 0))) is None


def test_the_explorer_takes_the_interventions_and_its_commands_carry_them(tmp_path):
    out = tmp_path / "view.svg"
    ok("explore", "--tokens", "3,1,4,1,5", "--ablate", "blocks.0.attn.head1", "--keys",
       "down", "--screenshot", out)
    screen = out.read_text().replace("&#160;", " ")
    assert "$ tfm attn --tokens 3,1,4,1,5 --ablate blocks.0.attn.head1" in screen


@pytest.mark.parametrize("arch", [None, "llama", "gpt2"])
def test_a_projection_activation_embedding_or_logit_cell_shows_its_formula(arch):
    from tfmcli.engine.presets import PRESETS

    ex = explorer(**(PRESETS[arch].fields if arch else {}))
    for name, index in [("blocks.0.ffn.pre", (0, 1, 3)), ("blocks.0.ffn.act", (1, 1, 3)),
                        ("embed", (1, 2, 4)), ("logits", (0, 3, 2)),
                        ("blocks.0.attn.out", (0, 2, 1)), ("blocks.0.ffn.out", (1, 1, 1))]:
        lines = ex.explain(View(name, False, (1, 2), index))
        assert lines[1].startswith("= "), (name, lines)
    x = ex.fwd.acts["blocks.0.ln2.out"][0, 1]
    W = ex.run.params["blocks.0.ffn.W_1"]
    lines = ex.explain(View("blocks.0.ffn.pre", False, (1, 2), (0, 1, 3)))
    assert lines[2].startswith(f"  = {x @ W[:, 3]:+.6f}")


def test_a_cell_an_intervention_changed_says_so():
    from tfmcli.engine.interventions import Scale
    from tfmcli.render.numbers import column
    from tfmcli.sources import Run

    cfg = tfmcli.Config(seq_len=5)
    params, inputs = tfmcli.init_params(cfg), tfmcli.make_inputs(cfg)
    fwd = tfmcli.forward(params, inputs, cfg, interventions=[Scale("blocks.0.ffn.pre[0, 1]", 2)])
    ex = Explorer(Run(cfg, params, inputs, "seed", "seed"), fwd,
                  tfmcli.backward(params, fwd, cfg), [])
    lines = ex.explain(View("blocks.0.ffn.pre", False, (1, 2), (0, 1, 3)))
    value = fwd.acts["blocks.0.ffn.pre"][0, 1, 3]
    assert lines[:3] == [f"pre[0, t1, 3] = {value:.6g}",
                         "changed by scale blocks.0.ffn.pre[0, 1] x 2:",
                         f"  the formula gives {column([value])(value / 2).strip()}, the run "
                         f"recorded {column([value])(value).strip()}"]


# ------------------------------------------------------------------ every size (issue 71)

SIZES = [(80, 24), (120, 40)]


def screen_text(app) -> str:
    """The screen as plain text, a line per row: what export_screenshot draws, without SVG."""
    import io

    from rich.console import Console

    console = Console(width=app.size.width, height=app.size.height, file=io.StringIO(),
                      record=True, color_system=None, legacy_windows=False)
    console.print(app.screen._compositor.render_update(
        full=True, screen_stack=app._background_screens))
    return console.export_text()


def press(ex, keys, size, start=None, check=None):
    """The app opened on view ``start`` (else its first), after ``keys`` on a ``size``
    screen: (app, the screen's text, its SVG); ``check(app, text)`` runs after every key."""
    app = ExploreApp(ex, "test")
    if start is not None:
        app.view = start

    async def go():
        async with app.run_test(size=size) as pilot:
            await pilot.pause()
            for key in keys:
                await pilot.press(key)
                if check is not None:
                    await pilot.pause()
                    check(app, screen_text(app))
            await pilot.pause()
            return app, screen_text(app), app.export_screenshot()

    return asyncio.run(go())


@pytest.mark.parametrize("size", SIZES)
def test_every_tensor_of_the_list_opens_and_is_drawn(size):
    """Down the whole list, each tensor opens: its title on screen, no key raising (a layer
    norm's gamma raised IndexError: its command read a position it has not)."""
    ex = explorer()
    ids = [line[3] for line in ex.tree() if line[3]]
    seen = []

    def check(app, text):
        name = ("d" if app.view.grad else "") + app.view.name + " ("
        assert name in text, (name, text)
        seen.append(ex.tree_id(app.view))

    start = ids.index("v:blocks.0.attn.pattern")
    press(ex, ["tab"] + ["up"] * start + ["down"] * (len(ids) - 1), size, check=check)
    assert set(seen) == set(ids)


KINDS = {   # a view of each kind, and the (row, block, head) its overview opens at
    "activation": (View("blocks.1.ln1.out", False, (1, 2), (1, 3, 2)), (1, 1, 0)),
    "4-D activation": (View("blocks.1.attn.q", False, (2, 3), (1, 1, 3, 2)), (1, 1, 1)),
    "gradient": (View("blocks.1.attn.pattern", True, (2, 3), (1, 1, 4, 2)), (1, 1, 1)),
    "parameter": (View("blocks.1.attn.W_Q", False, (0, 1), (3, 2)), (0, 1, 0)),
    "parameter gradient": (View("blocks.1.ffn.W_1", True, (0, 1), (5, 7)), (0, 1, 0)),
    "1-D": (View("blocks.1.ln1.gamma", False, (0, 0), (4,)), (0, 1, 0)),
    "2-D, no batch": (View("pe", False, (0, 1), (3, 1)), (0, 0, 0)),
    "1-D gradient": (View("head.b_U", True, (0, 0), (3,)), (0, 0, 0)),
}


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("kind", KINDS)
def test_the_overview_opens_at_the_row_block_and_head_shown_from_every_kind_of_view(kind,
                                                                                     size):
    """g from any view: the overview of the row it shows, at its block and head; Enter opens
    that pattern, of that row (from a parameter it raised IndexError, or opened the row of
    the parameter's own first index)."""
    ex = explorer(layers=2, batch=2)
    start, (row, block, head) = KINDS[kind]
    screens = []
    app, text, _ = press(ex, ["g", "enter"], size, start,
                         check=lambda app, text: screens.append(text))
    overview = screens[0]
    assert f"attention, row {row}:" in overview
    assert f">b{block}" in overview and f">h{head}" in overview
    assert f"blocks.{block}.attn.pattern, row {row}, head {head}" in overview
    assert app.view == View(f"blocks.{block}.attn.pattern", False, (2, 3), (row, head, 0, 0))
    assert f"blocks.{block}.attn.pattern (B, H, Tq, Tk)" in text
    assert f"B {row} · H {head}" in text


@pytest.mark.parametrize("size", SIZES)
def test_question_mark_shows_every_key_read_from_the_bindings(size):
    from tfmcli.tui import app as module

    screens = []
    press(explorer(), ["?", "x"], size, check=lambda app, text: screens.append(text))
    lines = screens[0].splitlines()
    explain = getattr(module, "ExplainPane", None)   # the scrolling explanation's keys
    bindings = [*module.TensorPane.BINDINGS, *ExploreApp.BINDINGS,
                *getattr(explain, "BINDINGS", [])]
    for binding in bindings:
        assert binding.description, binding   # every key says what it does
        key = getattr(module, "key_name", str)(binding.key)
        assert any(binding.description in line and key in line.split(binding.description)[0]
                   for line in lines), (binding, screens[0])
    assert {b.key for b in bindings} >= {"pagedown", "pageup", "question_mark", "slash", "c"}
    # any key closes it, and does nothing else
    assert "tfm explore's keys" not in screens[1] and "(B, H, Tq, Tk)" in screens[1]


@pytest.mark.parametrize("size", SIZES)
def test_c_shows_its_check_on_screen_and_the_explanation_scrolls(size):
    """At 80x24 the explanation pane holds 9 lines: c's check was written under a
    gradient's paths, out of sight, and nothing scrolled to it."""
    ex = explorer()
    view = View("blocks.0.ffn.W_1", True, (0, 1), (1, 1))
    ours, numeric = ex.central_difference(view)
    _, text, _ = press(ex, ["c"], size, view)
    assert f"backward           {ours:+.9e}" in text
    assert f"central difference {numeric:+.9e}" in text
    last = ex.explain(view)[-1]
    screens = []
    press(ex, ["pagedown", "tab", "tab", "home", *["down"] * 10], size, view,
          check=lambda app, text: screens.append(text))
    if size == (80, 24):
        assert last not in screens[3]   # below the pane (Tab, Tab: focused; Home: its top)
    assert last in screens[0] and last in screens[-1]   # PgDn, or the arrows, bring it up


@pytest.mark.parametrize("size", SIZES)
def test_a_filter_typed_after_slash_opens_its_match_with_enter(size):
    ex = explorer()
    app, text, _ = press(ex, ["/", *"logits", "enter", "right"], size)
    assert app.view == View("logits", False, (1, 2), (0, 0, 1))   # opened, arrows move it
    assert "logits (B, T, V)" in text
    lists = []
    app, text, _ = press(ex, ["/", *"W_1", "enter", "escape"], size,
                         check=lambda app, text: lists.append(
                             app.query_one("#tree").option_count))
    assert app.view.name == "blocks.0.ffn.W_1"
    assert lists[-2] < lists[-1] == len(ex.tree())   # Esc clears it


@pytest.mark.parametrize("size", SIZES)
def test_the_rows_and_columns_not_shown_are_said(size):
    ex = explorer(vocab=300, seq_len=60)
    _, text, _ = press(ex, [], size, View("logits", False, (1, 2), (0, 20, 0)))
    rows = re.search(r"rows (\d+)-(\d+) of 60", text)
    columns = re.search(r"columns (\d+)-(\d+) of 300", text)
    assert rows and columns, text
    first, last = int(rows[1]), int(rows[2])
    assert first <= 20 <= last < 59
    tokens = ex.run.token_labels(0)
    assert f"t{last}:{tokens[last]} " in text and f"t{last + 1}:" not in text
    assert f"t{first}:{tokens[first]} " in text and f"t{first - 1}:" not in text
    assert columns[1] == "0" and f" {int(columns[2])} " in text
    _, text, _ = press(explorer(), [], size)   # the pattern: all of it shown, nothing said
    assert "rows " not in text and "columns " not in text


@pytest.mark.parametrize("size", SIZES)
def test_pos_token_labels_only_on_token_axes(size):
    """t2:4 on a row's positions; pe's positions and a vocabulary's ids are plain numbers
    (pe read the tokens of row 0, and the vocabulary was 4:4, both as if positions)."""
    ex = explorer()
    _, text, _ = press(ex, [], size, View("pe", False, (0, 1), (0, 0)))
    assert not re.search(r"\bt\d+:", text), text
    _, text, _ = press(ex, [], size, View("logits", False, (1, 2), (0, 0, 0)))
    tokens = ex.run.token_labels(0)
    assert f"t1:{tokens[1]}" in text   # the positions of row 0, with their tokens
    assert not re.search(r"(?<![tqk\d])\d+:\d+", text), text   # but no id:text column


@pytest.mark.parametrize("size", SIZES)
def test_a_column_is_written_at_its_scale_with_four_significant_digits(monkeypatch, size):
    """One notation, as the CLI's: a column of 1e-06s is -1.600e-06 (was ≈0, -0.0000
    before that), one of 0.5s +0.5000 with -1.6e-06 in it ≈0, one of 12.5s +12.50; an exact
    zero 0.0000 in grey, not the negatives' red."""
    ex = explorer()   # it opens on the attention pattern (T x T), its last row all visible
    grid = np.zeros((5, 5))
    grid[3, :4] = [0.0, 0.5, 0.0, 12.5]
    grid[4] = [-1.6e-06, -1.6e-06, 0.0, -0.25, 3e-07]
    monkeypatch.setattr(Explorer, "matrix", lambda self, view: grid)
    _, text, svg = press(ex, [], size)
    for written in ("-1.600e-06", "+0.5000", "≈0", " 0.0000", "+12.50", "-0.25"):
        assert written in text, (written, text)
    assert "+3.000e-07" in text or "columns 0-3 of 5" in text   # 120x40: no room for it
    assert "-0.0000" not in text and "+0.0000" not in text and "-0.000002" not in text
    assert 'fill="#303030"' in svg   # an exact zero's cell is grey


def test_a_gradients_paths_are_written_at_their_scale():
    """A tiny gradient's terms were -0.000001, its sum -0.000002: four significant digits."""
    from tfmcli.explain.gradients import Paths

    paths = Paths(["= a sum"])
    paths.add("", ["a", "b", "c"], [-1.2e-06, -4e-07, 1e-07])
    lines = paths.lines(-1.5e-06)
    assert lines[-5:] == ["    a                 -1.200e-06", "    b                 -4.000e-07",
                          "    c                 +1.000e-07", "  sum                 -1.500e-06",
                          "  backward            -1.500e-06"]


def test_the_explore_page_lists_every_key():
    """docs/commands/explore.md's table of keys, against the bindings ? reads."""
    from pathlib import Path

    from tfmcli.tui import app as module

    page = (Path(__file__).parent.parent / "docs" / "commands" / "explore.md").read_text()
    keys = " ".join(line.split("|")[1] for line in page.splitlines()
                    if line.startswith("| ") and line.count("|") >= 3)
    for binding in [*module.TensorPane.BINDINGS, *ExploreApp.BINDINGS]:
        name = module.key_name(binding.key)
        assert ("arrows" if name in "↑↓←→" else name) in keys, binding


def test_a_line_wider_than_the_pane_folds_at_a_space_never_inside_a_number_or_bracket():
    """An intervention's line (55 columns) and a head norm's value line (38) in the 36 of the
    wide pane: folded after the comma, before the =, the rest indented under the first."""
    from tfmcli.tui.app import fold

    assert fold("  the formula gives -1.066e-04, the run recorded -3.197e-04", 36) == [
        "  the formula gives -1.066e-04,", "    the run recorded -3.197e-04"]
    assert fold("dk_norm.out[1, 1, t2, 2] = -0.00430547", 36) == [
        "dk_norm.out[1, 1, t2, 2]", "  = -0.00430547"]
    assert fold("changed by set blocks.0.resid1[0, 2] = 0.5:", 36) == [
        "changed by set", "  blocks.0.resid1[0, 2] = 0.5:"]
    assert fold("  sum                   +0.06556", 36) == ["  sum                   +0.06556"]


def compared_explorer(dtype="bfloat16", **fields):
    """An explorer opened as ``tfm explore --dtype DTYPE``: its run in the dtype, and the
    same weights and tokens compared with float64 (cli.explore.against)."""
    from tfmcli.explain.precision import compared
    from tfmcli.sources import Run

    cfg = tfmcli.Config(**{"seq_len": 5, "layers": 2, **fields})
    params, inputs = tfmcli.init_params(cfg), tfmcli.make_inputs(cfg)
    low = cfg.replace(dtype=dtype)
    rounded = tfmcli.init_params(low)   # the float64 draw, rounded
    fwd = tfmcli.forward(rounded, inputs, low)
    grads = tfmcli.backward(rounded, fwd, low)
    return Explorer(Run(low, rounded, inputs, "seed", "seed"), fwd, grads, [],
                    against=compared(params, inputs, cfg, dtype))


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_the_comparison_is_of_the_run_the_explorer_shows(dtype):
    """The dtype's run beside float64 is the explorer's own, bit for bit: its difference is
    the difference of what the screen shows."""
    ex = compared_explorer(dtype)
    runs = ex.against
    for name in ex.fwd.acts:
        assert np.array_equal(runs.arrays(name, False)[1], ex.fwd.acts[name],
                              equal_nan=True), name
        assert np.array_equal(runs.arrays(name, True)[1], ex.grads.acts[name]), name
    for name in ex.run.params:
        assert np.array_equal(runs.arrays(name, False)[1], ex.run.params[name]), name
        assert np.array_equal(runs.arrays(name, True)[1], ex.grads[name]), name


@pytest.mark.parametrize("size", SIZES)
def test_p_shows_each_cells_difference_from_float64_and_its_split(size):
    ex = compared_explorer()
    view, explained, svg, _ = drive(ex, ["down", "down", "p"], size=size)
    truth, low, made = ex.against.arrays(view.name, False)
    index = view.index
    error = float(low[index]) - float(truth[index])
    own, inherited = float(made[index]) - float(truth[index]), float(low[index] - made[index])
    assert abs(own + inherited - error) <= 1e-12 * max(abs(error), 1e-30)
    text = " ".join(explained.split())
    from tfmcli.render.numbers import one

    for number in (low[index], truth[index], error, own, inherited):
        assert one(float(number)).strip() in text, (number, text)
    assert "bfloat16 - float64" in svg.replace("&#160;", " ")
    assert np.allclose(ex.array(view), np.asarray(low, float) - np.asarray(truth, float))
    assert ex.command(view) == "tfm precision"
    view, explained, _, _ = drive(ex, ["p"], size=size)   # again: the values
    assert not ex.diff and "this cell" not in explained


def test_p_on_a_float64_run_says_how_to_compare():
    view, explained, _, _ = drive(explorer(), ["p"])
    assert "--dtype bfloat16" in " ".join(explained.split())


def test_p_on_a_masked_score_and_a_zero_gradient_reads_as_tfm_precision_does():
    """A hidden key's score is -inf in both runs: no difference, never NaN. b_K's gradient is
    0 but for rounding: read against the largest gradient's scale, as the table's * rows."""
    ex = compared_explorer()
    view = View("blocks.0.attn.scores", False, (2, 3), (0, 0, 1, 3))   # key 3 after query 1
    assert ex.toggle_diff() is None
    assert ex.array(view)[0, 0, 1, 3] == 0.0 and not np.isnan(ex.array(view)).any()
    lines = ex.explain(view)
    assert "nan" not in " ".join(lines).lower()
    b_k = View("blocks.0.attn.b_K", True, (0, 0), (1,))
    text = " ".join(ex.explain(b_k))
    eps = [float(w) for w in text.replace("eps", " ").split() if w[:1] in "+-" and
           w[1:2].isdigit() and "e" not in w]
    assert eps and max(abs(e) for e in eps) < 1e6, text


def test_p_after_an_intervention_says_why_there_is_no_comparison():
    from tfmcli.cli.explore import against

    class Forward:
        caches = {"plan": object()}

    class Run:
        class cfg:
            dtype = "bfloat16"

    why = against(None, Run, Forward)
    assert "--ablate" in why and "without them" in why
    ex = compared_explorer()
    ex.against, ex.diff = why, False
    assert ex.toggle_diff() == why and not ex.diff
