"""tfm explore: the app driven headless by Textual's own harness (App.run_test and its Pilot),
the numbers on screen against the API's, links followed, the headless --keys/--screenshot."""

import asyncio
import json
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
            explained = str(app.query_one("#explain").render())
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


@pytest.mark.parametrize("arch, uncovered", [
    (None, set()), ("gpt2", set()),
    ("llama", {"attn.q", "attn.k"}),                  # RoPE's backward sits between
    ("vaswani", {"in", "resid1", "resid2", "ln1.out", "ln2.out"}),   # Post-LN's streams
])
def test_a_gradient_entry_is_the_sum_of_its_paths(arch, uncovered):
    from tfmcli.engine.presets import PRESETS
    from tfmcli.tui.paths import gradient_paths

    ex = explorer(layers=2, seed=7, **(PRESETS[arch].fields if arch else {}))
    rng = np.random.default_rng(0)
    missed = set()
    for name in ex.names():
        shape = ex.gradients[name].shape
        for _ in range(3):
            index = tuple(int(rng.integers(0, n)) for n in shape)
            lines = gradient_paths(ex, View(name, True, (0, 0), index))
            if lines is None:
                missed.add(name.split(".", 2)[-1] if name.startswith("blocks.") else name)
                continue
            value = ex.gradients[name][index]
            assert max(map(len, lines)) <= 40, lines   # the pane is 40 columns wide
            assert lines[-1].endswith(f"(backward {value:+.6f})")
            total = float(lines[-1].split()[1])
            assert abs(total - value) <= 1e-6 + 1e-6 * abs(value)
    assert missed == uncovered


def test_a_weights_paths_are_its_input_times_its_outputs_gradient_at_each_position():
    from tfmcli.tui.paths import gradient_paths

    ex = explorer(batch=1)
    lines = gradient_paths(ex, View("blocks.0.attn.W_O", True, (0, 1), (4, 1)))
    x, dy = ex.fwd.acts["blocks.0.attn.context"][0], ex.grads.acts["blocks.0.attn.out"][0]
    terms = x[:, 4] * dy[:, 1]
    t = int(np.argmax(np.abs(terms)))
    assert lines[:3] == ["= sum over rows r, positions t of", "  attn.context[r, t, 4]",
                         "  x dattn.out[r, t, 1]"]
    assert lines[4].split() == ["r0", f"t{t}:{ex.run.token_labels(0)[t]}", f"{terms[t]:+.6f}"]


def test_a_gradient_with_no_rule_says_so_rather_than_a_wrong_sum():
    from tfmcli.engine.presets import PRESETS

    ex = explorer(**PRESETS["llama"].fields)
    lines = ex.explain(View("blocks.0.attn.q", True, (2, 3), (0, 1, 2, 0)))
    assert "no breakdown" in " ".join(lines)


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
                         f"  the formula gives {value / 2:+.6f}, the run recorded {value:+.6f}"]


def test_a_cell_too_small_for_its_digits_is_about_zero_never_a_signed_zero(monkeypatch):
    """A gradient of 1.6e-06 was drawn -0.0000 (issue 69): it is ≈0, as in the CLI's maps,
    and an exact zero 0.0000."""
    ex = explorer()   # it opens on the attention pattern (T x T), its last row all visible
    tiny = np.zeros((5, 5))
    tiny[4] = [-1.6e-06, 2e-17, 0.25, 0.0, 0.1]
    monkeypatch.setattr(Explorer, "matrix", lambda self, view: tiny)
    _, _, svg, _ = drive(ex, [])
    cells = svg.replace("&#160;", " ")
    assert "-0.0000" not in cells and "+0.0000" not in cells
    assert cells.count("≈0") >= 2 and "+0.2500" in cells and " 0.0000" in cells
