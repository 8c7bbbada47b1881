"""Heatmaps and attention maps: cells, shades and colours, the legend, downsampling, and
how many maps fit a screen (printed as in test_render.py)."""

import io
import math
import re

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from rich.cells import cell_len
from rich.console import Console, Group

from helpers import ANSI, grid_rows, plain_environment, render, render_colour  # noqa: F401 (a fixture)
from tfmcli.engine.masks import causal_mask
from tfmcli.render import colour_legend, heatmap
from tfmcli.render.heatmap import _block_mean

# ---------------------------------------------------------------- heatmap


def causal_pattern():
    """A 4x4 attention pattern with a computed 0.00 at (3, 1), visible under the causal mask."""
    pattern = np.tril(np.full((4, 4), 0.25))
    pattern[1, :2] = [0.5, 0.5]
    pattern[2, :3] = [0.125, 0.375, 0.5]
    pattern[3] = [0.5, 0.0, 0.25, 0.25]
    pattern[0, 0] = 1.0
    return pattern


def test_heatmap_hidden_cells_are_dots_and_a_computed_zero_is_a_number():
    text = render(heatmap(causal_pattern(), mask=causal_mask(4),
                          row_labels=[f"q{i}" for i in range(4)],
                          col_labels=[f"k{j}" for j in range(4)]))
    rows = grid_rows(text, ["q0", "q1", "q2", "q3"])
    assert rows == [
        ["1.00", "·", "·", "·"],         # no negative value: no "+" either
        ["0.50", "0.50", "·", "·"],
        ["0.12", "0.38", "0.50", "·"],
        ["0.50", "0.00", "0.25", "0.25"],
    ]
    assert sum(row.count("·") for row in rows) == 6
    assert text.splitlines()[0].split() == ["k0", "k1", "k2", "k3"]


def coloured_text(renderable) -> str:
    """What a colour terminal shows, escape codes removed."""
    return ANSI.sub("", render_colour(renderable))


def test_heatmap_legend_has_the_scale_ends_and_the_mask_symbol():
    text = coloured_text(heatmap(causal_pattern(), mask=causal_mask(4)))
    legend = text.splitlines()[-1]
    assert legend.startswith("scale [  ] 0.00  [░░] 0.25")  # vmin: lowest visible value
    assert "[██] 1.00" in legend and "0.50" in legend
    assert legend.endswith("· hidden by mask")
    # without colour the cells print their values: the legend only explains the dots
    assert render(heatmap(causal_pattern(), mask=causal_mask(4))).splitlines()[-1] == \
        "· hidden by mask"


@pytest.mark.parametrize("width, lines", [
    (84, ["scale [  ] 0.000  [░░] 0.060  [▒▒] 0.120  [▓▓] 0.180  [██] ≥0.240   · hidden by mask"]),
    (83, ["scale [  ] 0.000  [░░] 0.060  [▒▒] 0.120  [▓▓] 0.180  [██] ≥0.240",
          "      · hidden by mask"]),
    (65, ["scale [  ] 0.000  [░░] 0.060  [▒▒] 0.120  [▓▓] 0.180  [██] ≥0.240",
          "      · hidden by mask"]),
    (64, ["scale [  ] 0.000  [░░] 0.060  [▒▒] 0.120  [▓▓] 0.180",
          "      [██] ≥0.240   · hidden by mask"]),
    (40, ["scale [  ] 0.000  [░░] 0.060  [▒▒] 0.120",
          "      [▓▓] 0.180  [██] ≥0.240",
          "      · hidden by mask"]),
    (39, ["scale [  ] 0.000  [░░] 0.060",
          "      [▒▒] 0.120  [▓▓] 0.180",
          "      [██] ≥0.240   · hidden by mask"])])
def test_a_legend_breaks_between_its_pieces_never_inside_one(width, lines):
    """At 80 columns "· hidden by" ended one line and "mask" began the next: rich wrapped the
    one line of the key at a space. It breaks now only between a swatch with its value and
    the next, the next line under the first swatch."""
    from tfmcli.render.colours import Legend
    legend = Legend(0.0, 0.24, precision=3, clipped=True, hidden=True)
    assert ANSI.sub("", render_colour(legend, width=width)).splitlines() == lines
    alone = render(Legend(0.0, 0.24, precision=3, hidden=True, values_shown=True), width=10)
    assert [line.rstrip() for line in alone.splitlines()] == ["· hidden", "by mask"]   # wraps


def test_heatmap_legend_ends_ignore_hidden_and_infinite_cells():
    matrix = np.array([[-0.25, 9.0], [0.75, -np.inf]])
    text = coloured_text(heatmap(matrix, mask=[[True, False], [True, True]]))
    legend = text[text.index("scale"):]    # (it wraps: the grid is narrow)
    assert legend.startswith("scale [  ] -0.25") and "[██] +0.75" in legend and "9.00" not in legend
    assert grid_rows(text, ["0", "1"]) == [["-0.25", "·"], ["+0.75", "-inf"]]


def test_heatmap_explicit_scale_and_no_legend():
    legend = coloured_text(heatmap(np.eye(2), vmin=-2.0, vmax=3.0)).splitlines()[-1]
    assert legend.startswith("scale [  ] -2.00") and legend.endswith("[██] +3.00")
    assert "scale" not in coloured_text(heatmap(np.eye(2), legend=False))


def test_heatmap_diverging_legend_is_centred_on_zero():
    text = coloured_text(heatmap(np.array([[-0.5, 2.0]]), diverging=True))
    legend = text[text.index("scale"):].split()
    assert " ".join(legend) == ("scale, red < 0 < blue [-█] -2.00 [-▓] -1.50 [-▒] -1.00 [-░] "
                                "-0.50 [ ] 0.00 [+░] +0.50 [+▒] +1.00 [+▓] +1.50 [+█] +2.00")


def test_heatmap_shades_step_through_the_scale_without_values():
    text = render(heatmap(np.linspace(0, 1, 5)[None, :], show_values=False, legend=False))
    assert text.splitlines()[-1] == "0   ░░▒▒▓▓██"


def test_heatmap_too_wide_for_values_falls_back_to_shades():
    matrix = np.tile([0.0, 1.0], (3, 15))  # 30 columns of values need 212 characters
    text = render(heatmap(matrix, legend=False))
    assert "+1.00" not in text and "downsampled" not in text
    assert text.splitlines()[1] == "0 " + "  ██" * 15
    assert text.splitlines()[0] == "  0   2   4   6   8   10  12  14  16  18  20  22  24  26  28"


def test_a_tick_label_that_ends_at_the_grids_right_edge_is_drawn():
    """21 shaded columns labelled 10..30: every other one has room, and the last, 30, ends
    exactly where the grid does."""
    text = render(heatmap(np.ones((1, 21)), col_labels=[str(10 + j) for j in range(21)],
                          legend=False, show_values=False))
    header, row = text.splitlines()[:2]
    assert header == "  " + "".join(f"{10 + j:<4}" for j in range(0, 21, 2)).rstrip()
    assert len(header) == len(row) and header.endswith("30")


@pytest.mark.parametrize("width, values", [(20, True), (19, False)])
def test_shows_values_at_its_defaults_says_what_heatmap_draws_at_its_own(width, values):
    """Three probabilities a row, at two digits: "0.50" in a cell of six, 20 columns in all."""
    from tfmcli.render.heatmap import shows_values
    matrix = np.full((3, 3), 0.5)
    assert shows_values(matrix, "012", "012", width) is values
    assert ("0.50" in render(heatmap(matrix, width=width, legend=False))) is values


def test_values_line_up_under_their_labels():
    text = render(heatmap(np.array([[0.25, 0.75], [1.0, 0.0]]), col_labels=["k0", "key1"],
                          legend=False))
    assert text.splitlines() == ["     k0  key1", "0  0.25  0.75 ", "1  1.00  0.00 "]


def test_labels_are_measured_in_columns_of_the_screen_where_a_cjk_character_takes_two():
    """GPT-2 tokens such as 猫 or 😀: "猫猫" is 4 columns wide, as wide as "0.25"."""
    text = render(heatmap(np.array([[0.25, 0.75], [1.0, 0.0]]), row_labels=["猫猫", "a"],
                          col_labels=["猫", "k😀"], legend=False))
    assert text.splitlines() == ["        猫   k😀", "猫猫  0.25  0.75 ", "   a  1.00  0.00 "]
    # shades: a tick label takes the columns it covers; 猫0 is 3 wide, so every other key has one
    text = render(heatmap(np.ones((1, 6)), col_labels=[f"猫{j}" for j in range(6)], legend=False,
                          show_values=False))
    assert text.splitlines()[0] == "  猫0 猫2 猫4"
    assert cell_len(text.splitlines()[0]) == 2 + 4 * 2 + 3   # key 4's label starts at column 10


@pytest.mark.parametrize("shape, width, caption", [
    ((100, 3), 60, "downsampled 100x3 -> 50x3"),    # rows in pairs: more than the width
    ((3, 40), 80, "downsampled 3x40 -> 2x20"),      # columns in pairs, and rows with them
])
def test_heatmap_downsamples_in_blocks_of_two(shape, width, caption):
    text = render(heatmap(np.ones(shape), width=width, legend=False), width=width)
    assert caption in " ".join(text.split())
    assert max(len(line) for line in text.splitlines()) <= width


def test_a_diverging_legend_reaches_zero_from_either_side():
    from tfmcli.render.colours import legend_stops
    assert legend_stops(0.5, 2.0, True) == [0.0] * 5 + [0.5, 1.0, 1.5, 2.0]
    assert legend_stops(-2.0, -0.5, True) == [-2.0, -1.5, -1.0, -0.5] + [0.0] * 5
    assert legend_stops(-1.0, 3.0, True) == [-1.0, -0.75, -0.5, -0.25, 0.0, 0.75, 1.5, 2.25, 3.0]


def test_heatmap_downsamples_1024_to_the_width():
    mask = causal_mask(1024)
    matrix = np.where(mask, 1.0, 0.0)
    text = render(heatmap(matrix, mask=mask, width=80), width=200)
    lines = text.splitlines()
    assert max(len(line) for line in lines) <= 80
    assert "downsampled 1024x1024 -> 37x37, block mean" in text
    grid = [line for line in lines[1:] if re.match(r"^\s*\d+ ", line)]  # [0]: column ticks
    assert len(grid) == 37
    # a block is hidden only if all its cells are: row 0 has one visible (diagonal) block
    assert grid[0].count("·") == 36 and grid[-1].count("·") == 0


def test_heatmap_caps_a_tall_matrix_at_width_rows():
    text = render(heatmap(np.ones((300, 3)), width=80))
    assert "downsampled 300x3 -> 75x3, block mean of up to 4x1 visible cells" in text
    assert len(grid_rows(text, [str(i) for i in range(0, 300, 4)])) == 75


def test_block_mean_averages_visible_cells_only():
    matrix = np.array([[1.0, 3.0, 100.0], [5.0, 7.0, 100.0]])
    visible = np.array([[True, True, False], [True, False, False]])
    means, shown = _block_mean(matrix, visible, 2, 2)
    assert means[0, 0] == 3.0  # (1 + 3 + 5) / 3; the hidden 7 is left out
    assert shown.tolist() == [[True, False]]


def test_block_mean_at_once_is_each_blocks_mean_ragged_edges_included():
    """Every block's mean of its visible cells, as averaging one block at a time gives it (to
    rounding: the sums are taken in another order), edge blocks smaller; a block with no
    visible cell hidden; a visible infinity or NaN passed on, a hidden one left out."""
    rng = np.random.default_rng(5)
    matrix = rng.standard_normal((37, 23))
    visible = rng.random((37, 23)) > 0.4
    visible[:5, :4] = False                      # one whole block hidden
    matrix[10, 10], matrix[0, 0] = np.inf, np.nan   # visible inf; NaN in the hidden block
    means, shown = _block_mean(matrix, visible, 5, 4)
    assert means.shape == shown.shape == (8, 6)
    for i in range(8):
        for j in range(6):
            block = (slice(5 * i, 5 * i + 5), slice(4 * j, 4 * j + 4))
            cells = matrix[block][visible[block]]
            assert shown[i, j] == bool(cells.size)
            if cells.size:
                expected = cells.mean()
                assert means[i, j] == expected or means[i, j] == pytest.approx(expected,
                                                                               rel=1e-14)
    assert not shown[0, 0] and means[2, 2] == np.inf


def test_heatmap_positions_and_lines_are_those_cell_by_cell():
    """The scale positions made for a whole map are scale_position's, entry by entry, on both
    scales and at degenerate ends; a line made at once is the Text that appending its pieces
    one by one makes (the same characters and spans)."""
    from rich.text import Text

    from tfmcli.render.colours import scale_position, scale_positions
    from tfmcli.render.heatmap import _line
    values = np.random.default_rng(6).standard_normal((6, 7)) * 3
    values[0, :3] = [0.0, -0.0, 1e-300]
    for vmin, vmax, diverging in ((-1.0, 2.0, False), (-2.5, 1.5, True), (0.5, 2.0, True),
                                  (-3.0, -1.0, True), (1.0, 1.0, False), (-1.0, 4.0, False),
                                  (0.0, 2.0, True), (-2.0, 0.0, True),   # a side of no length
                                  (-0.5, 0.5, True)):
        made = scale_positions(values, vmin, vmax, diverging)
        assert made == [[scale_position(v, vmin, vmax, diverging) for v in row]
                        for row in values]
    pieces = [("q12 ", "dim"), ("░░", "red on red"), (" · ", "dim"), ("  ", ""), ("▓▓", "blue")]
    appended = Text()
    for characters, style in pieces:
        appended.append(characters, style=style)
    at_once = _line(pieces)
    assert at_once.plain == appended.plain and at_once.spans == appended.spans


def test_attention_maps_scale_is_numpys_99th_percentile_without_numpy_ma():
    """The maps' scale top is np.quantile(..., 0.99) to the bit, found without np.quantile's
    np.unique, whose first call imports numpy.ma (12-24 ms of a command)."""
    import subprocess
    import sys

    from tfmcli.render.maps import quantile
    rng = np.random.default_rng(7)
    for n in (1, 2, 3, 100, 101, 4097):
        values = rng.random(n) ** 3
        for q in (0.0, 0.25, 0.5, 0.99, 0.999, 1.0, *rng.random(40)):   # every interpolation
            assert quantile(values, q) == float(np.quantile(values, q))
    values[3] = np.nan
    assert math.isnan(quantile(values, 0.99))
    code = ("import sys, numpy as np\n"
            "from tfmcli.render.maps import attention_maps\n"
            "mask = np.tril(np.ones((64, 64), bool))\n"
            "attention_maps({(0, 0): mask / mask.sum(1, keepdims=True)}, mask, 0, 80, 1)\n"
            "print('numpy.ma' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout
    assert out.strip() == "False"


def test_small_weights_get_the_digits_that_tell_the_legends_stops_apart():
    """Uniform attention over 64 keys: every weight 1/64, stops 0.0039 apart, four digits."""
    from tfmcli.render.maps import attention_maps
    mask = np.ones((64, 64), dtype=bool)
    legend = attention_maps({(0, 0): np.full((64, 64), 1 / 64)}, mask, 0, 120, total=1)[2]
    assert re.findall(r"\d\.\d+", render(legend, width=120)) == ["0.0000", "0.0039", "0.0078",
                                                                 "0.0117", "0.0156"]


def test_attention_maps_in_shades_run_from_blank_at_0_to_full_at_the_top_and_note_the_rest():
    """30 positions at 80 columns are drawn in shades, on one scale from 0 to the 99th
    percentile: a weight of 0 blank, the top full. The note says how many of how many."""
    from tfmcli.render.maps import attention_maps
    mask = causal_mask(30)
    pattern = np.zeros(mask.shape)
    pattern[:, 0] = 1.0            # every query on its first key
    parts = attention_maps({(0, 0): pattern}, mask, 0, 80, total=2)
    rows = render(parts[1], width=80).splitlines()[2:]
    assert rows[0].split()[1].startswith("██") and "░" not in "".join(rows)
    assert rows[-1].split()[1] == "██" and len(rows[-1].split()) == 2   # the rest blank
    assert render(parts[3]).startswith("showing 1 of 2 attention maps")
    assert len(attention_maps({(0, 0): pattern}, mask, 0, 80, total=1)) == 3   # all shown


def with_tokens(seq_len):
    """Position labels with a token each, as the CLI writes them: "0:0", "1:7", ... "10:20"."""
    return [f"{t}:{t * 7 % 50}" for t in range(seq_len)]


def drawn_size(renderable, width):
    """Columns and lines of a renderable as rich's Columns measures and lays it out."""
    from rich.measure import Measurement
    console = Console(file=io.StringIO(), width=width)
    columns = Measurement.get(console, console.options, renderable).maximum
    return columns, len(console.render_lines(renderable, console.options.update_width(columns),
                                             pad=False))


@pytest.mark.parametrize("seq_len", [2, 4, 9, 12, 13, 40, 100, 300])
@pytest.mark.parametrize("width", [40, 80, 200])
def test_a_maps_size_is_the_size_it_is_drawn_at(seq_len, width):
    """Values or shades, downsampled or not (its caption wrapped at the width and as wide as
    the map is then), with key labels wider than the weights (``k10:14``) or narrower."""
    from tfmcli.render.maps import _map_size, attention_maps
    rng = np.random.default_rng(seq_len)
    mask = causal_mask(seq_len)
    pattern = np.where(mask, rng.random(mask.shape), 0.0)
    pattern /= pattern.sum(axis=1, keepdims=True)
    wide = [f"{t}:{'猫' * (t % 3)}" for t in range(seq_len)]   # GPT-2 tokens of CJK characters
    for labels in ([f"{t}" for t in range(seq_len)], with_tokens(seq_len), wide):
        maps = attention_maps({(0, 0): pattern}, mask, 0, width, total=1,
                              row_labels=["q" + label for label in labels],
                              col_labels=["k" + label for label in labels])[1]
        label_width = 1 + max(map(cell_len, labels))
        assert _map_size(seq_len, width, label_width) == drawn_size(maps.renderables[0], width)


@pytest.mark.parametrize("seq_len, width, height", [
    (4, 80, 24), (8, 120, 40), (12, 80, 40), (12, 200, 40), (12, 200, 60), (20, 200, 60),
    (40, 200, 60), (64, 200, 40),
])
def test_the_maps_picked_for_a_screen_fill_it_without_passing_its_height(seq_len, width, height):
    """Twelve positions labelled with their tokens at 200 columns: each map is 103 wide, so
    one to a row, and two fill 40 lines (four were picked, 62 lines, when a map was taken to
    be 91 wide). Only one row of maps may pass the height: at least one map is drawn."""
    from tfmcli.render.maps import attention_maps, maps_that_fit
    rng = np.random.default_rng(0)
    mask = causal_mask(seq_len)
    labels = with_tokens(seq_len)
    pairs = [(b, h) for b in range(4) for h in range(4)]
    patterns = {pair: np.where(mask, rng.random(mask.shape), 0.0) for pair in pairs}

    def lines(picked):
        parts = attention_maps({pair: patterns[pair] for pair in picked}, mask, 0, width,
                               total=16, row_labels=["q" + label for label in labels],
                               col_labels=["k" + label for label in labels])
        return len(render(Group(*parts), width=width).splitlines())

    picked = maps_that_fit(pairs, seq_len, width, False, height, 1 + max(map(len, labels)))
    assert lines(picked) <= height or lines(picked) == lines(picked[:1])
    if (seq_len, width) == (12, 200):   # the heading, maps 14 lines and one apart, legend, note
        assert len(picked) == {40: 2, 60: 3}[height]
        assert lines(picked) == 1 + len(picked) * 15 - 1 + 2


@pytest.mark.parametrize("width, height, count", [(208, 34, 2), (209, 34, 4), (209, 33, 2)])
def test_maps_fit_side_by_side_three_columns_apart_and_a_blank_line_between_rows(width, height,
                                                                                  count):
    """Maps of twelve positions labelled ``q10:14``: 103 columns and 14 lines each. Two to a
    row need 103 + 3 + 103 = 209 columns. Two rows are counted 15 lines each (a row and the
    blank line under it), with 4 more for the heading, a legend of up to two lines and the
    note: 34."""
    from tfmcli.render.maps import _map_size, maps_that_fit
    assert _map_size(12, 209, 6) == (103, 14)
    assert len(maps_that_fit(list(range(16)), 12, width, False, height, 6)) == count
    assert maps_that_fit(list(range(16)), 12, width, True, height, 6) == list(range(16))


def test_heatmap_colour_uses_backgrounds_and_hidden_cells_have_none():
    coloured = render_colour(heatmap(causal_pattern(), mask=causal_mask(4)))
    plain = render(heatmap(causal_pattern(), mask=causal_mask(4)))
    assert "48;2;" in coloured
    assert "\x1b" not in plain
    before_dots = re.findall(r"\x1b\[([0-9;]*)m\s*·", coloured)
    assert len(before_dots) == 7  # 6 cells and the legend
    assert not any("48;2" in codes for codes in before_dots)
    # the same grid; only the colour scale's line is left out without colour
    assert ANSI.sub("", coloured).replace(
        "scale [  ] 0.00  [░░] 0.25  [▒▒] 0.50  [▓▓] 0.75  [██] 1.00   ", "") == plain


def test_heatmap_refuses_bad_shapes():
    with pytest.raises(ValueError, match="2-D"):
        heatmap(np.zeros((2, 2, 2)))
    with pytest.raises(ValueError, match="mask"):
        heatmap(np.zeros((2, 3)), mask=np.ones((3, 2), dtype=bool))


@settings(max_examples=30, deadline=None)
@given(rows=st.integers(1, 150), cols=st.integers(1, 150), width=st.integers(24, 160))
def test_heatmap_never_wider_than_width(rows, cols, width):
    matrix = np.random.default_rng(rows * cols).normal(size=(rows, cols))
    text = render(heatmap(matrix, width=width, mask=np.ones((rows, cols), bool)), width=400)
    assert max(len(line) for line in text.splitlines()) <= width


# ---------------------------------------------------------------- colour_legend


def test_a_screen_too_narrow_for_one_shaded_column_still_gets_one_and_no_more():
    """Width 3 beside a label of 1 leaves a column of the screen, not the two a shade takes:
    every key is averaged into one drawn column (the least there is), never two."""
    lines = render(heatmap(np.eye(3), width=3, legend=False), width=40).splitlines()
    assert lines[:2] == ["  0", "0 ░░"]   # the mean of the identity: 1/3
    assert "3x3->1x1" in "".join(lines[2:]).replace(" ", "")


def test_colour_legend_sequential_stops_and_shades():
    text = render(colour_legend(0.0, 1.0)).rstrip("\n")
    assert text == "scale [  ] 0.00  [░░] 0.25  [▒▒] 0.50  [▓▓] 0.75  [██] 1.00"
    assert render(colour_legend(2.0, 2.0)).strip() == "scale [  ] 2.00"


@pytest.mark.parametrize("background, text", [
    ((255, 150, 0), "black"),    # light by its red: 0.299 * 255 + 0.587 * 150 = 164.3
    ((0, 255, 0), "black"),      # by its green alone: 149.7
    ((0, 220, 255), "black"),    # by its blue: 129.1 of green + 29.1 of blue
    ((0, 220, 0), "white"),      # the same green without the blue: 129.1
    ((255, 0, 255), "white"),    # 76.2 + 29.1
    ((0, 0, 0), "white"),
])
def test_a_value_is_written_black_on_a_light_cell_and_white_on_a_dark_one(background, text):
    """Luminance by ITU-R 601's weights (0.299 R + 0.587 G + 0.114 B): black text over 140."""
    from tfmcli.render.colours import _on_background
    style = _on_background(background)
    assert tuple(style.bgcolor.triplet) == background
    assert tuple(style.color.triplet) == {"black": (0, 0, 0), "white": (255, 255, 255)}[text]


