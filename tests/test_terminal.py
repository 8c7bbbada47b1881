"""What a person meets in a real terminal: closed pipes, output paths, wide tables, big masks,
labels, legends and plain text (issue 10)."""

import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest

from helpers import error_line, grid_rows, ok, render, render_colour, run, skip_without_oracle
from tfmcli.cli import app
from tfmcli.cli.options import PE, Activation, DType, Init, Norm
from tfmcli.render import grad_table, shape_trace, tensor_table
from tfmcli.render.colours import Legend

# One quick run of every command (and of the help), each writing more than one line.
EVERY_COMMAND = [
    ["forward"],
    ["backward"],
    ["gradcheck", "--max-entries", "2"],
    ["shapes"],
    ["attn"],
    ["mask", "--len", "9"],
    ["pe"],
    ["train", "--steps", "5"],
    ["adam"],
    ["kv"],
    ["lens"],
    ["embed"],
    ["block"],
    ["ln"],
    ["ffn"],
    ["loss"],
    ["check"],
    ["compare"],
    ["patch", "--tokens", "3,1,4,1,5", "--from-tokens", "1,2,3,4,5"],
    ["circuit", "--tokens", "3,1,4,1,5", "--from-tokens", "1,2,3,4,5"],
    ["precision"],
    ["attribute"],
    ["forward", "--json"],
    ["attn", "--query", "2", "--backward"],
    ["--help"],
    ["forward", "--help"],
    ["explore", "--help"],   # the app itself: tests/test_explore.py
]


def test_every_command_is_covered():
    named = {args[0] for args in EVERY_COMMAND}
    assert {c.callback.__name__ for c in app.registered_commands} <= named


@pytest.mark.parametrize("args", EVERY_COMMAND, ids=" ".join)
def test_a_closed_pipe_is_a_normal_end(args):
    """`tfm ... | head -1` under `set -o pipefail`: exit 0 and nothing on stderr."""
    skip_without_oracle(args)
    read_end, write_end = os.pipe()
    os.close(read_end)   # the reader has left before the first line is written
    try:
        done = subprocess.run([sys.executable, "-m", "tfmcli", *args], stdout=write_end,
                              stderr=subprocess.PIPE, timeout=120)
    finally:
        os.close(write_end)
    assert done.returncode == 0, done.stderr.decode()
    assert done.stderr == b""


@pytest.mark.parametrize("flag", ["--svg", "--save"])
@pytest.mark.parametrize("command", ["forward", "train"])
def test_an_output_path_that_cannot_be_written_stops_before_any_work(tmp_path, flag, command):
    missing = tmp_path / "no-such-folder" / "out.file"
    result = run(command, flag, missing, "--steps" if command == "train" else "--seed", 3)
    assert "does not exist" in error_line(result, 2)
    assert result.stdout == ""
    result = run(command, flag, tmp_path, "--steps" if command == "train" else "--seed", 3)
    assert "is a folder" in error_line(result, 2)
    assert result.stdout == "" and os.listdir(tmp_path) == []


def test_a_wide_tensor_wraps_in_column_blocks_and_keeps_every_number(monkeypatch):
    """16 keys at 80 columns: two blocks of columns, each with every row label; no number cut."""
    monkeypatch.setenv("COLUMNS", "80")
    args = ["forward", "-T", "16", "--show", "blocks.0.attn.pattern"]
    text = ok(*args).stdout
    shown = text[text.index("blocks.0.attn.pattern[0, 0]"):text.index("loss =")]
    pattern = np.array(json.loads(ok(*args, "--json").stdout)["show"]["blocks.0.attn.pattern"]
                       ["values"])[0, 0]
    assert max(len(line) for line in shown.splitlines()) <= 80
    assert "…" not in shown
    assert "columns k0:1..k7:1 of 16" in shown and "columns k8:4..k15:6 of 16" in shown
    lines = shown.splitlines()
    for t in range(16):   # each query labels one line in each block
        assert sum(line.lstrip().startswith(f"q{t}:") for line in lines) == 2
    visible = np.tril(np.ones((16, 16), dtype=bool))
    cells = [c for line in lines for c in line.split()[1:] if c[0] in "+-·"]
    assert cells.count("·") == (~visible).sum()
    assert sorted(float(c) for c in cells if c != "·") == sorted(pattern[visible].round(4))


def test_one_notation_per_column():
    """A column with one entry below 1e-3 writes every entry in scientific notation (never
    `+1.000e-03` beside `+0.002`), as NumPy does for an array; the next column, which needs
    none, stays fixed (issue 58: tfm pe's values were +1.000e+00 throughout)."""
    text = render(tensor_table(np.array([[0.002, 0.5], [1e-3 * 0.999, 12.0]]), precision=3))
    assert re.findall(r"[+-]\S+", text) == ["+2.000e-03", "+0.500", "+9.990e-04", "+12.000"]
    text = render(tensor_table(np.array([0.002, 0.5, 12.0]), precision=3))
    assert re.findall(r"[+-]\S+", text) == ["+0.002", "+0.500", "+12.000"]


def test_a_table_of_quantities_has_one_notation_per_row_and_indicators_are_0_and_1():
    """Issue 58: tfm ffn's relu'(pre) printed +1.0000e+00 0.0000 +1.0000e+00."""
    rows = np.array([[1.6e-2, -5e-4, 3.9e-2], [1.0, 0.0, 1.0], [0.25, 0.5, 0.75]])
    text = render(tensor_table(rows, row_labels=["d", "slope", "p"], notation_by="row"))
    assert grid_rows(text, ["d", "slope", "p"]) == [
        ["+1.6000e-02", "-5.0000e-04", "+3.9000e-02"], ["1", "0", "1"],
        ["+0.2500", "+0.5000", "+0.7500"]]
    given = render(tensor_table(rows[2:], row_labels=["p"], notation_by="row",
                                notations={"p": "sci"}))
    assert grid_rows(given, ["p"])[0][0] == "+2.5000e-01"


def test_the_views_write_each_column_in_one_notation():
    """Issue 58's screens: tfm backward (b_K's noise made W_1's 1.4359 print 1.4359e+00),
    tfm attn --query 2 --backward step 7 (+0.0298 beside -4.5361e-04), tfm adam (steps 1-2
    scientific, step 3 fixed), tfm ffn (an indicator in scientific)."""
    backward = ok("backward").stdout.splitlines()
    w_1 = next(line for line in backward if line.startswith("blocks.0.ffn.W_1 "))
    assert w_1.split()[3:5] == ["1.4359", "0.4353"]
    b_k = next(line for line in backward if line.startswith("blocks.0.attn.b_K "))
    assert b_k.split()[2:] == ["≈0", "≈0", "≈0"]
    step7 = ok("attn", "--query", "2", "--backward").stdout.split("7. ")[1].split("8. ")[0]
    dscaled = [line.split()[4] for line in step7.splitlines() if line.startswith(" k")
               and "·" not in line and not line.startswith(" key")]
    assert dscaled == ["+2.9803e-02", "-4.5361e-04", "-2.9349e-02"]
    adam = ok("adam").stdout
    steps = [line.split()[1:] for line in adam.splitlines() if line.startswith(" step ")]
    assert len(steps) == 3 and all("e-0" in cell for row in steps for cell in row)
    gs = [line.split()[1:] for line in adam.splitlines() if line.startswith("    g ")]
    assert all("e" not in cell for row in gs for cell in row)
    ffn = ok("ffn", "-t", "2").stdout
    assert "relu'(pre)           1           0           1" in ffn


def test_rounding_noise_in_a_mean_shows_as_zero_and_norms_have_no_sign():
    x = np.array([1.0, -1.0, 0.1, -0.1 + 1e-17])          # mean 2.5e-18: noise next to 1
    y = np.array([1e-17, -3e-17])                          # everything tiny: a real mean
    text = render(shape_trace({"x": x}))
    assert grid_rows(text, ["x"])[0] == ["(4,)", "-1.0000", "≈0", "0.7106", "+1.0000"]
    assert "≈0: zero to working precision" in text
    text = render(shape_trace({"y": y}))
    assert grid_rows(text, ["y"])[0][2] == "-1.0000e-17"  # not noise: the scale is 1e-17
    assert "≈0" not in text
    grads = render(grad_table({"W": np.array([[3.0, -4.0]])}))
    assert grid_rows(grads, ["W"])[0][2:4] == ["5.0000", "4.0000"]   # a norm has no sign


@pytest.mark.parametrize("command, name", [
    ("forward", "blocks.0.attn.pattern"), ("forward", "blocks.0.attn.scores"),
    ("backward", "dblocks.0.attn.pattern"), ("backward", "dblocks.0.attn.scores"),
    ("backward", "blocks.0.attn.pattern"),
])
def test_every_attention_tensor_marks_its_hidden_cells_the_same_way(command, name):
    """Row 1 has length 2: keys 2 and 3 are padding (8 cells) and the causal mask hides key 1
    from query 0; those 9 cells, and only those, show `·`."""
    text = ok(command, "-T", "4", "--lengths", "4,2", "--row", "1", "--show", name).stdout
    table = text[text.rindex("attn."):]
    cells = [c for line in table.splitlines()[3:7] for c in line.split()[1:]]   # title, keys, rule
    assert len(cells) == 16
    assert [i for i, c in enumerate(cells) if c == "·"] == [1, 2, 3, 6, 7, 10, 11, 14, 15]


def test_gradcheck_says_how_many_entries_of_how_many_it_checked():
    from math import prod

    from tfmcli.engine.config import Config
    from tfmcli.engine.sizes import param_shapes
    shapes = param_shapes(Config(d_model=32))
    entries = sum(prod(s) for s in shapes.values())
    checked = sum(min(32, prod(s)) for s in shapes.values())   # 32 sampled per tensor
    assert f"checked {checked:,} of {entries:,} entries" in ok("gradcheck", "-d", 32).stdout
    data = json.loads(ok("gradcheck", "-d", 32, "--json").stdout)
    assert (data["checked"], data["entries"]) == (checked, entries)
    assert [p["entries"] for p in data["params"]] == [prod(s) for s in shapes.values()]
    assert "checked 626 of 626 entries" in ok("gradcheck").stdout   # small: every entry


@pytest.mark.parametrize("args", [a for a in EVERY_COMMAND if "--json" not in a], ids=" ".join)
def test_piped_output_has_no_trailing_spaces(args):
    text = ok(*args).stdout
    assert text.strip()
    assert [line for line in text.splitlines() if line != line.rstrip()] == []


def test_counts_carry_thousands_separators():
    text = ok("forward", "-T", "200", "-B", "1").stdout
    assert "masked: 39,800 (-inf)" in text            # 2 heads x 200 x 199 / 2 future keys
    assert "over 200 positions" in text


@pytest.mark.parametrize("args", [[], ["--help"]])
def test_the_top_help_shows_the_examples(args):
    result = run(*args)
    assert result.exit_code == 0
    assert "Try: tfm forward --seed 1000;" in result.stdout


@pytest.mark.parametrize("command", sorted(c.callback.__name__ for c in app.registered_commands))
def test_help_at_80_columns_keeps_every_choice_whole_and_shows_no_bool(command, monkeypatch):
    monkeypatch.setenv("COLUMNS", "80")
    text = ok(command, "--help").stdout
    assert "<bool>" not in text and "BOOLEAN" not in text   # flags take no value
    words = set(re.findall(r"\w+", text))
    for enum in (Norm, Activation, PE, Init, DType):
        if re.search(rf"--{enum.__name__.lower()}(?![\w-])", text):   # --norm, not --norm-bias
            assert {member.value for member in enum} <= words, enum


def test_help_at_80_columns_gives_each_option_its_names_in_one_cell(monkeypatch):
    """An option's names share one cell, a switch's two forms are written --[no-]x, the sizes
    go two to a line and the switches three, by name (tfmcli.cli.helpfit)."""
    monkeypatch.setenv("COLUMNS", "80")
    lines = ok("forward", "--help").stdout.splitlines()
    assert max(len(line) for line in lines) <= 80
    seed = next(line for line in lines if line.startswith("│ --seed "))
    assert seed.index("Seed of") <= 40          # 60 with a cell per name
    batch = next(line for line in lines if "--batch" in line)
    assert re.match(r"│ --batch, -B +Batch rows B \(2\) +--d-ff +FFN width \(4 d\) +│", batch)
    switches = next(i for i, line in enumerate(lines) if "─ Architecture switches" in line)
    assert "(on by default: causal, head-bias, bias, norm-bias)" in lines[switches]
    assert lines[switches + 1].split() == ["│", "--[no-]causal", "--[no-]ffn-bias",
                                           "--[no-]sandwich-norm", "│"]
    assert lines[switches + 2].split()[1] == "--[un]tied-head"
    assert lines[switches + 4].split()[3] == "--rms-norm/--layer-norm"   # click's way
    assert lines[switches + 6].startswith("╰")   # fourteen switches in five lines
    top = ok("--help").stdout.splitlines()      # the group's own options, the same way
    assert any(line.startswith("│ --help, -h ") for line in top)


def test_narrow_help_lists_the_sizes_one_to_a_line_with_every_name_whole(monkeypatch):
    monkeypatch.setenv("COLUMNS", "40")
    lines = ok("forward", "--help").stdout.splitlines()
    start = next(i for i, line in enumerate(lines) if "─ Sizes" in line)
    assert [line.split()[1] for line in lines[start + 1:start + 5]] == [
        "--batch,", "--seq-len,", "--d-model,", "--heads,"]
    assert "│ --n-ctx        Learned PE rows (T)   │" in lines


# what a command needs besides --stream to reach its refusal
NEEDS = {"explore": ["--keys", "q"],
         "patch": ["--tokens", "3,1,4,1,5", "--from-tokens", "1,2,3,4,5"],
         "circuit": ["--tokens", "3,1,4,1,5", "--from-tokens", "1,2,3,4,5"]}


def listed(text: str) -> set:
    """The options a --help lists: ``--[no-]x`` is --x and --no-x."""
    names = set()
    for name in re.findall(r"(?<![\w-])--[\w\[\]-]+", text):
        switch = re.fullmatch(r"--\[(no-|un)\]([\w-]+)", name)
        names |= {f"--{switch[2]}", f"--{switch[1]}{switch[2]}"} if switch else {name}
    return names


@pytest.mark.parametrize("command", sorted(c.callback.__name__ for c in app.registered_commands))
def test_help_lists_every_option_a_command_takes_and_none_it_refuses(command, monkeypatch):
    """Each option the command parses is in its --help at 80 columns (the interventions
    among them); one it always refuses (--stream where the command holds the whole run) is
    not, and typing it says why."""
    import typer

    monkeypatch.setenv("COLUMNS", "80")
    text = ok(command, "--help").stdout
    params = typer.main.get_command(app).commands[command].params
    shown = {name for p in params if not p.hidden for name in (*p.opts, *p.secondary_opts)
             if name.startswith("--")}
    assert shown <= listed(text), shown - listed(text)
    for param in params:
        if param.hidden:
            assert param.name == "stream" and not listed(text) & {"--stream", "--no-stream"}
            skip_without_oracle([command])
            line = error_line(run(command, "--stream", *NEEDS.get(command, [])), 2)
            assert "'--stream'" in line and "without --stream" in line
    takes_interventions = "--ablate" in {n for p in params for n in p.opts}
    if takes_interventions:
        assert {"--ablate", "--ablate-with", "--set", "--scale", "--patch", "--from-tokens",
                "--from-text"} <= listed(text)
        assert "╭─ Interventions (docs/interventions.md)" in text


def test_fourteen_commands_take_the_interventions():
    import typer

    commands = typer.main.get_command(app).commands
    taking = sorted(name for name, command in commands.items()
                    if "--ablate" in {n for p in command.params for n in p.opts})
    assert len(taking) == 14, taking


MODEL_COMMANDS = ("forward", "backward", "gradcheck", "shapes", "embed", "attn", "ln", "ffn",
                  "block", "loss", "adam", "kv", "lens", "check", "compare", "train")


@pytest.mark.parametrize("command", MODEL_COMMANDS)
def test_help_starts_with_what_you_use(command, monkeypatch):
    """At 80 columns every model command's --help fits in 80 lines, its own options first,
    then input, output, the interventions, sizes and the architecture (which names the docs
    page), its switches last."""
    monkeypatch.setenv("COLUMNS", "80")
    lines = ok(command, "--help").stdout.splitlines()
    assert len(lines) <= 80, len(lines)
    panels = [line.split("─")[1].split(" (")[0].strip() for line in lines
              if line.startswith("╭─ ")]
    assert panels[0] == "Options"
    order = [p for p in ("Input", "Output", "Interventions", "Sizes", "Architecture",
                         "Architecture switches") if p in panels]
    assert panels[1:] == order, panels
    if "Architecture" in panels:
        assert "docs/architectures.md" in next(l for l in lines if "╭─ Architecture" in l)
    start = next(i for i, l in enumerate(lines) if l.startswith("╭─ Input"))
    end = next(i for i in range(start, len(lines)) if lines[i].startswith("╰"))
    names = [l.split()[1] for l in lines[start + 1:end] if l.startswith("│ --")]
    usual = ["--tokens", "--text", "--load", "--arch", "--seed", "--score-all", "--force",
             "--[no-]stream"]
    assert names == [name for name in usual if name in names], names
    assert "--seed" in names and ("--arch" in names) == (command != "compare")


@pytest.mark.parametrize("no_color, escapes", [("1", False), ("", True)])
def test_no_color_help_has_no_escape_codes_even_on_a_terminal(no_color, escapes):
    env = {**os.environ, "NO_COLOR": no_color, "FORCE_COLOR": "1", "COLUMNS": "100"}
    if not no_color:
        del env["NO_COLOR"]
    done = subprocess.run([sys.executable, "-m", "tfmcli", "forward", "--help"], env=env,
                          capture_output=True, timeout=60)
    assert done.returncode == 0
    assert (b"\x1b[" in done.stdout) == escapes


def test_a_big_padding_mask_keeps_one_line_per_row_and_never_averages(monkeypatch):
    monkeypatch.setenv("COLUMNS", "100")
    text = ok("mask", "--len", "60", "--lengths", "60,45").stdout
    assert "mean" not in text
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("padding"))
    row0, row1 = lines[start + 2], lines[start + 3]
    assert row0.startswith("row 0 ") and row1.startswith("row 1 ")
    assert row0[6:] == "●" * 60
    assert row1[6:] == "●" * 45 + "·" * 15          # one character per key: 60 fit in 100
    text = ok("mask", "--len", "1000", "--lengths", "1000,450").stdout   # 11 keys a character
    row1 = next(line for line in text.splitlines() if line.startswith("row 1 "))[6:]
    assert row1 == "●" * 40 + "◐" + "·" * (len(row1) - 41)   # keys 440..450 hold the end
    assert "11 keys per character: ● all may attend, ◐ some, · none" in text


def test_attention_maps_share_a_grid_and_one_legend(monkeypatch):
    monkeypatch.setenv("COLUMNS", "140")
    text = ok("forward", "-d", 8, "-H", 8).stdout
    assert len(text.splitlines()) < 70                  # 95 when each map was stacked
    titles = [line for line in text.splitlines() if "block 0 head" in line]
    assert [line.split()[3::4] for line in titles] == [["0", "1", "2", "3"], ["4", "5", "6", "7"]]
    assert text.count("hidden by mask") == 1
    # cells print their values and there is no colour: the legend has no shades to explain
    assert "scale" not in text


def test_the_legend_puts_each_swatch_before_its_value():
    text = render(Legend(0.0, 1.0))
    assert text.strip() == "scale [  ] 0.00  [░░] 0.25  [▒▒] 0.50  [▓▓] 0.75  [██] 1.00"
    text = render(Legend(0.0, 0.58, clipped=True, hidden=True))
    assert text.strip().endswith("[██] ≥0.58   · hidden by mask")
    assert render(Legend(0.0, 1.0, values_shown=True, hidden=True)).strip() == "· hidden by mask"
    coloured = render_colour(Legend(0.0, 1.0, values_shown=True))   # colour: swatches shown
    assert "[██] 1.00" in re.sub(r"\x1b\[[0-9;]*m", "", coloured)


def test_pe_labels_its_columns_readably_and_red_means_negative_everywhere(monkeypatch):
    monkeypatch.setenv("COLUMNS", "100")
    text = ok("pe").stdout
    header = text.splitlines()[3].split()
    assert header == [str(j) for j in range(0, 16, 2)]     # 8 of 16 columns, by index
    assert "column j: sin for even j, cos for odd j" in text
    from tfmcli.render.colours import colour_at
    red, blue = colour_at(0.0, diverging=True), colour_at(1.0, diverging=True)
    assert red[0] > red[2] and blue[2] > blue[0]            # -1 red, +1 blue, as in the tables


def test_statistics_are_computed_once_and_only_for_what_is_shown(monkeypatch):
    """A deep model's trace shows 40 of its rows: 40 statistics, none for the JSON payload
    that is not printed; --json computes each activation's once and draws nothing."""
    import tfmcli.explain.summary as summary
    import tfmcli.render.tables as tables
    from tfmcli.explain.summary import activation_stats
    calls = {"table": 0, "json": 0}

    def counting(where):
        def count(name, acts):
            calls[where] += 1
            return activation_stats(name, acts)
        return count

    monkeypatch.setattr(tables, "activation_stats", counting("table"))
    monkeypatch.setattr(summary, "activation_stats", counting("json"))   # forward's JSON's
    ok("forward", "-L", 4)                    # 4 + 14 x 4 + 3 = 63 activations
    assert calls == {"table": 40, "json": 0}
    calls.update(table=0)
    data = json.loads(ok("forward", "-L", 4, "--json").stdout)
    assert calls == {"table": 0, "json": len(data["activations"])} and calls["json"] > 40


def test_the_api_names_are_what_they_were_whatever_was_imported_first():
    """Names imported on first use must not be shadowed by a submodule of the same name."""
    code = ("import pkgutil, importlib, inspect, tfmcli, tfmcli.render as r; "
            "[importlib.import_module(m.name) for p in (tfmcli, r) "
            " for m in pkgutil.iter_modules(p.__path__, p.__name__ + '.') "
            " if not m.name.endswith('__main__')]; "
            "print(all(inspect.isfunction(getattr(tfmcli, n)) for n in "
            "('gradcheck', 'forward', 'backward', 'init_params', 'load', 'make_inputs')) and "
            "all(inspect.isfunction(getattr(r, n)) for n in r.__all__))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.stdout.strip() == "True", done.stderr


@pytest.mark.parametrize("width, command, kept", [
    (80, ["ln", "-t", "2"], "y = gamma * (x - mean) / sqrt(var + eps) + beta"),
    (
        80,
        ["embed", "-t", "1"],
        "PE[t, 2i] = sin(t / 10000^(2i/d)), PE[t, 2i+1] = cos(t / 10000^(2i/d))",
    ),
    (120, ["adam"], "step = lr m_hat / (sqrt(v_hat) + eps),  p = p - step"),
    (80, ["attn"], "· = hidden (exactly 0)"),
    (80, ["kv"], "4.1 K with the cache, 10.3 K recomputing each prefix (2.5x)"),
])
def test_formulas_wrap_between_clauses_never_inside_one(width, command, kept, monkeypatch):
    """Issue 58: at 80 columns `... / sqrt(var + eps) +` then `beta`, `PE[t,` then `2i+1]`, at
    120 `step = lr m_hat /` then `(sqrt(v_hat) + eps)`, `(exactly` then `0)`, `4.1` then `M`."""
    monkeypatch.setenv("COLUMNS", str(width))
    lines = ok(*command).stdout.splitlines()
    assert any(kept in line for line in lines), kept
    assert max(len(line) for line in lines) <= width


def test_break_points_keep_clauses_brackets_and_units():
    from tfmcli.render.wrap import break_points

    def pieces(line, width):
        ends = [0, *break_points(line, width), len(line)]
        return [line[a:b].strip() for a, b in zip(ends, ends[1:])]

    assert pieces("a = b + c;  d = (e + f) * g", 12) == ["a = b + c;", "d = (e + f)", "* g"]
    assert pieces("cost 4.1 K with 10 M more", 10) == ["cost 4.1 K", "with 10 M", "more"]
    assert pieces("fits", 80) == ["fits"]
    assert pieces("x (allowed: 0 or more) y", 14) == ["x", "(allowed: 0 or more)", "y"]


def test_an_error_on_a_terminal_breaks_between_words():
    """Issue 58: the terminal cut '--seed' after '--' and 'safetensors' after 'saf'; on a
    terminal tfm breaks the line itself; to a file or a pipe it stays one line."""
    import pty

    command = [sys.executable, "-m", "tfmcli", "forward", "--seed", "-1", "--tokens", "1,2",
               "--d-model", "6"]
    env = {**os.environ, "COLUMNS": "40", "LINES": "24"}
    main, child = pty.openpty()
    os.set_blocking(main, False)
    done = subprocess.run(command, env=env, stdin=child, stdout=child, stderr=child, timeout=60)
    os.close(child)
    text = b""
    try:
        while chunk := os.read(main, 4096):
            text += chunk
    except (BlockingIOError, OSError):
        pass
    os.close(main)
    lines = [line for line in text.decode().replace("\r", "").splitlines() if line]
    assert done.returncode == 2 and len(lines) > 1 and max(map(len, lines)) <= 40
    assert all(not line.endswith("--") for line in lines)
    piped = subprocess.run(command, env=env, capture_output=True, text=True, timeout=60)
    assert len(piped.stderr.splitlines()) == 1


def test_a_diverging_map_uses_the_legends_nine_colours_and_says_red_is_negative():
    """Issue 58: in a 256-colour terminal neighbouring values near -1 got two palette entries;
    each cell is now one of the legend's swatches."""
    from tfmcli.render.colours import level

    assert [level(p, True) for p in (0.0, 0.06, 0.07, 0.5, 0.9)] == [0.0, 0.0, 0.125, 0.5, 0.875]
    assert [level(p, False) for p in (0.1, 0.13, 0.99)] == [0.0, 0.25, 1.0]
    text = ok("pe", "--len", "4", "--d-model", "32").stdout
    assert "scale, red < 0 < blue [-█] -1.000  [-▓] -0.750" in text


@pytest.mark.parametrize("columns", [80, 120, 200])
def test_a_wider_terminal_never_shows_fewer_maps(columns, monkeypatch):
    """Issue 58: tfm train showed both heads at 80 columns and one at 120 and 200, whose maps
    wrote their values and so stood one under the other; shades keep both on the screen."""
    monkeypatch.setenv("COLUMNS", str(columns))
    monkeypatch.setenv("LINES", "24")
    text = ok("train", "--steps", "5").stdout
    assert "block 0 head 0" in text and "block 0 head 1" in text
    assert "showing 1 of 2 attention maps" not in text
