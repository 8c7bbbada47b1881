"""Rendering: every renderable printed to a plain 80-column console, and to a colour one.
Heatmaps and attention maps are in test_heatmap.py."""

import io
import math
import re
from collections import OrderedDict

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from rich.cells import cell_len
from rich.console import Console

import tfmcli
from helpers import grid_rows, plain_environment, random_params, render, render_colour  # noqa: F401 (a fixture)
from tfmcli.check.gradcheck import ParamCheck
from tfmcli.engine.masks import additive, causal_mask
from tfmcli.render import (
    config_panel,
    fmt,
    grad_table,
    mask_grid,
    mask_legend,
    mask_overview,
    shape_trace,
    tensor_table,
)

# ---------------------------------------------------------------- fmt


@pytest.mark.parametrize("value, precision, expected", [
    (-0.5, 3, "-0.500"),
    (0.5, 4, "+0.5000"),
    (0.0, 4, " 0.0000"),
    (-0.0, 2, " 0.00"),
    (12345678.0, 2, "+1.23e+07"),
    (-12345678.0, 2, "-1.23e+07"),
    (1e-4, 4, "+1.0000e-04"),
    (0.001, 4, "+0.0010"),
    (99999.0, 1, "+99999.0"),
    (1e5, 1, "+1.0e+05"),
    (-math.inf, 4, "-inf"),
    (math.inf, 4, "+inf"),
    (math.nan, 4, "nan"),
    (np.float32(0.25), 2, "+0.25"),
])
def test_fmt(value, precision, expected):
    assert fmt(value, precision) == expected


@given(st.floats(allow_nan=False, allow_infinity=False, min_value=-1e300, max_value=1e300))
def test_fmt_round_trips_to_the_last_digit(value):
    text = fmt(value, 4)
    if "e" in text:
        assert float(text) == pytest.approx(value, rel=1e-4)
    else:
        assert abs(float(text) - value) <= 0.5e-4 + 1e-12 * abs(value)


@given(st.floats(min_value=1e-3, max_value=9.99994), st.booleans())
def test_fmt_numbers_below_ten_all_have_the_same_width(magnitude, negative):
    assert len(fmt(-magnitude if negative else magnitude, 4)) == len(" 0.0000") == 7


@pytest.mark.parametrize("value", [1e-3, -1e-3, 0.00099999, 99999.0, 99999.99, 1e5, -1e5])
def test_a_columns_notation_at_the_range_edges_is_the_one_fmt_picks_for_the_value(value):
    """A column of one value is written as fmt writes that value alone: 1e-3 and 99999.99 in
    fixed point, 1e5 and 0.00099999 in scientific."""
    from tfmcli.render.numbers import notation
    assert notation([value, 0.5]) == ("sci" if "e" in fmt(value) else "fixed")
    assert notation([1e-3, 99999.99]) == "fixed" and notation([1e-3, 1e5]) == "sci"


def test_rounding_noise_is_up_to_noise_units_of_eps_times_the_scale():
    from tfmcli.render.numbers import NOISE, negligible
    eps = float(np.finfo(np.float64).eps)
    assert negligible(NOISE * eps * 4.0, 4.0, eps)            # at the bound: noise
    assert not negligible(NOISE * eps * 4.0 * (1 + eps), 4.0, eps)
    assert negligible(-NOISE * eps, 1.0, eps) and not negligible(0.0, 1.0, eps)


@pytest.mark.parametrize("value, expected", [
    (0.5, "+0.50"), (0.0, " 0.00"), (-0.0, " 0.00"), (1.0, "+1.00"), (1e-6, "≈0"),
    (-1e-6, "≈0"), (-0.004, "≈0"), (-0.006, "-0.01"), (12345.678, "+12345.68"),
    (math.inf, "+inf"), (math.nan, "nan"),
])
def test_a_heatmap_cell_writes_two_digits_and_an_exact_zero_without_a_sign(value, expected):
    """A non-zero value too small for the digits is ≈0, never -0.00 (tfm patch's grid)."""
    from tfmcli.render.numbers import fmt_fixed
    assert fmt_fixed(value) == expected
    unsigned = {0.5: "0.50", 0.0: "0.00", 1.0: "1.00", 1e-6: "0.00", 12345.678: "12345.68"}
    if value in unsigned:   # probabilities: no sign, and no space where it would go
        assert fmt_fixed(value, sign=False) == unsigned[value]


@pytest.mark.parametrize("n, expected", [
    (24, " ".join(str(i) for i in range(24))),
    (25, " ".join(str(i) for i in range(18)) + " … (3 more) … 21 22 23 24"),
    (100, " ".join(str(i) for i in range(18)) + " … (78 more) … 96 97 98 99"),
])
def test_a_token_line_shows_24_tokens_then_the_first_18_and_the_last_4(n, expected):
    from tfmcli.render import token_line
    assert token_line(str(i) for i in range(n)) == expected
    assert token_line([str(i) for i in range(n)], limit=n) == " ".join(str(i) for i in range(n))


# ---------------------------------------------------------------- tensor_table


def test_tensor_table_elides_the_middle_like_numpy():
    array = np.arange(10000).reshape(100, 100) / 100  # entry (i, j) is i + j / 100
    text = render(tensor_table(array, title="x"))
    rows = grid_rows(text, [str(i) for i in range(100)] + ["…"])
    assert [r[0] for r in grid_rows(text, [str(i) for i in range(100)])] == [
        "0.0000", "+1.0000", "+2.0000", "+3.0000", "+4.0000", "+5.0000",
        "+94.0000", "+95.0000", "+96.0000", "+97.0000", "+98.0000", "+99.0000"]
    assert len(rows) == 13  # 6 first, the … row, 6 last
    assert rows[6] == ["…"] * 9  # 4 columns, the … column, 4 columns
    assert rows[-1] == ["+99.0000", "+99.0100", "+99.0200", "+99.0300", "…",
                        "+99.9600", "+99.9700", "+99.9800", "+99.9900"]
    assert "+50.5000" not in text  # the middle is not there
    assert " +99.0300 … +99.9600 " in text   # the … column one character wide
    assert "showing 12 of 100 rows, 8 of 100 columns" in text
    assert max(len(line) for line in text.splitlines()) <= 80


def test_tensor_table_full_shows_every_entry():
    array = np.arange(400).reshape(20, 20) + 1.0
    text = render(tensor_table(array, full=True), width=300)
    assert "…" not in text
    assert all(fmt(v) in text for v in array.ravel())
    assert len(grid_rows(text, [str(i) for i in range(20)])) == 20


@pytest.mark.parametrize("width, first_block", [(80, "columns 0..6 of 20"),
                                                (81, "columns 0..9 of 20")])
def test_a_full_table_wraps_in_even_blocks_that_fit_the_width(width, first_block):
    """A row label and ten columns of " +1.0000" take exactly 81 columns: at 81 two blocks of
    ten; at 80 three blocks, 7 + 7 + 6 (not 9 + 9 + 2)."""
    array = np.full((3, 20), 1.0) + np.arange(20) / 10
    text = render(tensor_table(array, full=True, width=width), width=width)
    assert text.splitlines()[0].strip() == first_block
    assert max(len(line) for line in text.splitlines()) == {80: 57, 81: 81}[width]


@pytest.mark.parametrize("full, width", [(True, 80), (False, 64)])
def test_a_tables_row_labels_are_measured_in_columns_of_the_screen(full, width):
    """Rows labelled by GPT-2 tokens: "0:猫が好き" is 10 columns wide, not 6. Measured by its
    characters, the columns were chosen for a narrower label, and rich cut the label to
    "0:猫が …" to make the table fit (wrapped in blocks at 80, or elided at 64)."""
    array = np.full((2, 20), 1.0)
    labels = ["0:猫が好き", "1:␣😀"]
    lines = render(tensor_table(array, full=full, width=width, row_labels=labels),
                   width=width).splitlines()
    rows = [line for line in lines if line.lstrip().startswith(("0:", "1:"))]
    assert [line.split()[0] for line in rows][:2] == labels
    assert max(map(cell_len, lines)) <= width
    assert cell_len(rows[0].split()[0]) == 10 and rows[1].startswith("     1:␣😀")


def test_a_full_table_in_blocks_puts_its_caption_once_under_the_last_block():
    array = np.full((3, 20), 1.0)
    lines = render(
        tensor_table(array, full=True, width=80, caption="a note"), width=80
    ).splitlines()
    assert [line.strip() for line in lines if "a note" in line or "columns" in line] == [
        "columns 0..6 of 20", "columns 7..13 of 20", "columns 14..19 of 20", "a note"]
    assert lines[-1].strip() == "a note"


@pytest.mark.parametrize("width, shown", [(58, 6), (59, 7), (66, 7), (67, 8)])
def test_an_elided_table_keeps_the_columns_that_fit_the_width(width, shown):
    """A row label, k columns of " +1.0000" and the " …" column: 1 + 8 k + 2 columns. The
    caption under it wraps at the width, not at the table's."""
    text = render(tensor_table(np.ones((3, 100)), width=width), width=width)
    table, caption = text.split("\nshowing")
    assert max(len(line) for line in table.splitlines()) == 1 + 8 * shown + 2
    assert caption.strip() == f"{shown} of 100 columns"


def test_a_caption_wraps_at_the_screens_width_not_the_tables():
    """A footnote under a 9-column table took eight lines, the last two "statistic" and "s";
    it takes one, or wraps at the screen's width."""
    note = "* x: masked: 780 (-inf), left out of the statistics"
    lines = render(tensor_table(np.ones((2, 1)), caption=note)).splitlines()
    assert max(map(len, lines[:-1])) == 9 and lines[-1] == note
    lines = render(tensor_table(np.ones((2, 1)), caption=note, width=30), width=30).splitlines()
    assert [line.rstrip() for line in lines[-2:]] == ["* x: masked: 780 (-inf), left",
                                                      "out of the statistics"]


def test_a_table_elided_to_a_few_rows_is_as_wide_as_they_are():
    """The "… N more" row fills the table's columns and adds none."""
    from tfmcli.render.tables import record_table
    rows = [[f"parameter {i}", f"{i * 1.5:.1f}"] for i in range(40)]
    lines = render(record_table(["name", "value"], rows, max_rows=4)).splitlines()
    shown = render(record_table(["name", "value"], rows[:2] + rows[-2:])).splitlines()
    assert lines[4].strip() == "… 36 more" and lines[:4] + lines[5:7] == shown
    assert lines[2] == " parameter 0      0.0 "   # names to the left, values to the right


def test_side_by_side_leaves_three_columns_between_renderables():
    from rich.text import Text

    from tfmcli.render import side_by_side
    assert render(side_by_side(Text("left"), Text("right"))).rstrip() == "left   right"


def test_tensor_table_odd_limits_show_one_more_at_the_start():
    text = render(tensor_table(np.arange(10.0)[:, None] * np.ones((1, 2)), max_rows=5))
    assert [r[0] for r in grid_rows(text, [str(i) for i in range(10)] + ["…"])] == [
        "0.0000", "+1.0000", "+2.0000", "…", "+8.0000", "+9.0000"]


def test_tensor_table_1d_is_one_row_and_0d_one_cell():
    text = render(tensor_table(np.array([-1.5, 0.0, 2.25])))
    lines = [line for line in text.splitlines() if line.strip()]
    assert lines[0].split() == ["0", "1", "2"]
    assert lines[-1].split() == ["-1.5000", "0.0000", "+2.2500"]
    assert render(tensor_table(np.float64(3.0), precision=2)).split() == ["+3.00"]


def test_tensor_table_labels_and_caption():
    text = render(tensor_table(np.eye(2), row_labels=["q0", "q1"], col_labels=["k0", "k1"],
                               caption="batch 0, head 1"))
    assert grid_rows(text, ["q0", "q1"]) == [["+1.0000", "0.0000"], ["0.0000", "+1.0000"]]
    assert text.splitlines()[0].split() == ["k0", "k1"]
    assert "batch 0, head 1" in text


def test_tensor_table_width_drops_columns_instead_of_cutting_numbers():
    array = np.full((3, 16), 0.5)
    array[:, -1] = 1e-4  # a scientific column is wide
    labels = [f"sin λ{j}.28" for j in range(16)]  # wraps at the space
    text = render(tensor_table(array, col_labels=labels, width=50), width=50)
    rows = grid_rows(text, ["0", "1", "2"])
    # one notation per column: 1e-4 needs scientific, its column is; the others stay fixed,
    # and 5 of 16 columns fit in 50
    assert rows[0] == ["+0.5000", "+0.5000", "+0.5000", "…", "+0.5000", "+1.0000e-04"]
    assert "showing 5 of 16 columns" in text
    assert max(len(line) for line in text.splitlines()) <= 50
    assert "sin λ15.28" in text  # the label whole, not cut
    text = render(tensor_table(array[:, :15], col_labels=labels[:15], width=50), width=50)
    assert "λ14.28" in text and "sin λ0.28" not in text  # fixed point: narrow, labels wrap


def test_a_long_title_stays_on_one_line_above_a_narrow_table():
    title = "blocks.0.attn.pattern[1, 1] of (2, 2, 4, 4)"
    text = render(tensor_table(np.eye(2), title=title))
    assert text.splitlines()[0] == title
    assert grid_rows(text, ["0", "1"]) == [["+1.0000", "0.0000"], ["0.0000", "+1.0000"]]
    assert render(mask_grid(causal_mask(2), title="padding, lengths [2, 1]")).splitlines()[0] \
        == "padding, lengths [2, 1]"


def test_tensor_table_refuses_3d():
    with pytest.raises(ValueError, match="slice"):
        tensor_table(np.zeros((2, 2, 2)))


def test_tensor_table_colour_dims_minus_inf_and_reddens_negatives():
    text = render_colour(tensor_table(np.array([[-np.inf, -0.5, 0.5]])))
    assert "\x1b[2m-inf" in text
    assert "\x1b[31m-0.5000" in text
    assert "\x1b" not in render(tensor_table(np.array([[-np.inf, -0.5, 0.5]])))


# ---------------------------------------------------------------- shape_trace


def test_shape_trace_in_order_with_shapes_stats_and_masked_note():
    scores = np.broadcast_to(additive(causal_mask(4)), (2, 2, 4, 4)) + np.arange(4.0)
    acts = OrderedDict([
        ("x", np.array([1.0, 2.0, 3.0, 4.0])),
        ("attn.scores", scores),
        ("a", -np.ones((3, 5))),
    ])
    text = render(shape_trace(acts))
    rows = grid_rows(text, ["x", "attn.scores*", "a"])
    assert [r[0] for r in rows] == ["(4,)", "(2,", "(3,"]
    assert rows[0] == ["(4,)", "+1.0000", "+2.5000", "1.1180", "+4.0000"]  # std: no sign
    # -inf left out: the finite entries are 0; 0 1; 0 1 2; 0 1 2 3 (mean 1, std 1)
    assert rows[1] == ["(2,", "2,", "4,", "4)", "0.0000", "+1.0000", "1.0000", "+3.0000"]
    assert rows[2][-4:] == ["-1.0000", "-1.0000", "0.0000", "-1.0000"]
    assert "* attn.scores: masked: 24 (-inf)" in text  # 6 per 4x4 map, 4 maps
    assert "*" not in render(shape_trace({"x": np.zeros(2)}))


# ---------------------------------------------------------------- grad_table


def test_grad_table_norms_and_checks():
    grads = {"W": np.array([[3.0, -4.0]]), "b": np.array([0.5]), "c": np.zeros(2)}
    checks = {"W": ParamCheck("W", (1, 2), 2, 1e-12, 1.234e-9, True),
              "b": ParamCheck("b", (1,), 1, 1e-3, 0.5, False)}
    text = render(grad_table(grads, checks))
    rows = grid_rows(text, ["W", "b", "c"])
    assert rows[0] == ["(1,", "2)", "5.0000", "4.0000", "-0.5000", "1.23e-09", "✓", "pass"]
    assert rows[1] == ["(1,)", "0.5000", "0.5000", "+0.5000", "5.00e-01", "✗", "FAIL"]
    assert rows[2] == ["(2,)", "0.0000", "0.0000", "0.0000", "—", "—"]
    assert "rel err" not in render(grad_table(grads))


def test_grad_table_says_why_b_K_is_noise_only_where_b_K_is_shown():
    cfg = tfmcli.Config(lengths=(4, 2))
    params = random_params(tfmcli.init_params(cfg))
    grads = tfmcli.backward(params, tfmcli.forward(params, tfmcli.make_inputs(cfg), cfg), cfg)
    attn = {n: g for n, g in grads.items() if ".attn." in n}
    noted = " ".join(render(grad_table(attn)).split())
    assert "b_K: 0 in exact arithmetic" in noted and noted.endswith("rounding noise")
    others = {n: g for n, g in grads.items() if not n.endswith("b_K")}
    assert "b_K:" not in render(grad_table(others))


# ---------------------------------------------------------------- config_panel


def test_config_panel_is_a_key_value_grid():
    text = render(config_panel({"sizes": "B=2 T=4 d=6 H=2 d_ff=24 V=8 L=1", "norm": "pre-LN"}))
    lines = text.splitlines()
    assert len(lines) == 4 and "config" in lines[0]
    assert lines[1].split() == ["│", "sizes", "B=2", "T=4", "d=6", "H=2", "d_ff=24", "V=8",
                                "L=1", "│"]
    assert lines[2].split() == ["│", "norm", "pre-LN", "│"]


# ---------------------------------------------------------------- masks


def test_mask_grid_causal_symbols():
    text = render(mask_grid(causal_mask(3)))
    assert text.count("●") == 6 and text.count("·") == 3
    assert grid_rows(text, ["0", "1", "2"]) == [["●", "·", "·"], ["●", "●", "·"],
                                                ["●", "●", "●"]]


@pytest.mark.parametrize("additive", [False, True])
@pytest.mark.parametrize("shape, labels", [((3, 3), False), ((1, 12), False), ((12, 12), True)])
def test_mask_grid_width_is_the_width_it_is_drawn_at(shape, labels, additive):
    """What `tfm mask` asks before drawing a grid: does it fit the screen."""
    from tfmcli.render import mask_grid_width
    rows = [f"q{i}:{i * 7}" for i in range(shape[0])] if labels else None
    cols = [f"k{j}" for j in range(shape[1])] if labels else None
    mask = np.ones(shape, dtype=bool)
    drawn = render(mask_grid(mask, additive=additive, row_labels=rows, col_labels=cols), width=200)
    assert mask_grid_width(shape, additive=additive, row_labels=rows, col_labels=cols) == \
        max(map(len, drawn.splitlines()))


def test_mask_grid_additive_and_labels():
    text = render(mask_grid(causal_mask(3), additive=True, row_labels=["q0", "q1", "q2"],
                            col_labels=["k0", "k1", "k2"]))
    assert text.count("-inf") == 3
    assert grid_rows(text, ["q0", "q1", "q2"]) == [["0", "-inf", "-inf"], ["0", "0", "-inf"],
                                                   ["0", "0", "0"]]
    with pytest.raises(ValueError, match="2-D"):
        mask_grid(np.ones(3, dtype=bool))


def test_a_mask_grids_rule_and_title_span_its_columns():
    lines = render(mask_grid(causal_mask(3), title="causal 3", row_labels=["q0", "q1", "q2"],
                             col_labels=["k0", "k1", "key2"])).splitlines()
    assert lines == ["   causal 3", "   k0 k1 key2", "─" * 13, "q0  ●  ·    ·", "q1  ●  ●    ·",
                     "q2  ●  ●    ●"]


@pytest.mark.parametrize("row_group, caption", [(1, None), (2, "2 rows per line")])
def test_a_mask_overview_explains_its_symbols_only_when_a_line_or_character_groups_several(
        row_group, caption):
    """A causal 8 at 80 columns: a character per key; one line per row, or per two rows."""
    lines = render(mask_overview(causal_mask(8), title="causal 8", width=80,
                                 row_group=row_group)).splitlines()
    assert len(lines) == 2 + 8 // row_group + (caption is not None)
    assert lines[1] == "  0 2 4 6"   # a key label every other character, over its key
    assert lines[2] == ("0 ●·······" if row_group == 1 else "0 ●◐······")
    if caption:
        assert lines[-1] == f"{caption}: ● all may attend, ◐ some, · none"


def test_mask_symbols_are_green_or_dim_and_only_the_labels_dim():
    """The row label is dim; a visible key's symbol is green and not dimmed with it."""
    console = Console(file=io.StringIO(), width=80, color_system="truecolor", force_terminal=True)
    for view in (mask_grid(causal_mask(3), row_labels=["q0", "q1", "q2"]),
                 mask_overview(causal_mask(50), title="causal", width=30)):
        segments = [seg for seg in console.render(view) if seg.text.strip()]
        attend = [seg for seg in segments if set(seg.text.strip()) <= {"●", "◐"}]
        hidden = [seg for seg in segments if set(seg.text.strip()) == {"·"}]
        labels = [seg for seg in segments if seg.text.strip() in ("q0", "q1", "q2", "0", "2")]
        assert attend and hidden and labels
        assert all(seg.style.color.name == "green" and not seg.style.dim for seg in attend)
        assert all(seg.style.dim for seg in hidden + labels)


def test_mask_legend_says_which_symbol_is_which():
    assert render(mask_legend()).strip() == "● may attend   · hidden"
    text = render(mask_legend(additive=True))
    assert "0 may attend" in text and "-inf hidden" in text


@pytest.mark.parametrize("values, counts", [
    ([-np.inf, 1.0, 3.0, -np.inf], {"masked": 2}),                     # masked scores
    ([-np.inf, 1.0, np.inf, 3.0], {"masked": 1, "inf": 1}),
    ([np.nan, 1.0, -np.inf, np.inf, 3.0, np.nan], {"masked": 1, "inf": 1, "nan": 2}),
    ([np.inf, 1.0, 3.0], {"inf": 1}),
    ([1.0, 3.0], {}),
])
def test_stats_count_what_is_not_finite_and_summarise_the_rest(values, counts):
    from tfmcli.explain.summary import stats
    out = stats(np.array(values).reshape(1, -1))
    assert {k: out[k] for k in ("masked", "inf", "nan") if k in out} == counts
    assert (out["min"], out["mean"], out["std"], out["max"]) == (1.0, 2.0, 1.0, 3.0)


def test_stats_of_a_masked_array_over_many_chunks_are_the_finite_entries_exactly(monkeypatch):
    """Masked scores (and +inf and NaN) spread over several chunks, a chunk wholly -inf among
    them: the finite entries' min and max, their mean and std to the last digit or two of
    the exact sums, and the counts of what is left out."""
    import tfmcli.explain.summary as summary
    monkeypatch.setattr(summary, "CHUNK", 1000)
    rng = np.random.default_rng(8)
    values = rng.standard_normal(7500) * 3 + 1
    values[rng.random(7500) < 0.45] = -np.inf
    values[2000:3000] = -np.inf
    values[[17, 4500]] = np.inf
    values[6001] = np.nan
    finite = values[np.isfinite(values)]
    mean = math.fsum(finite) / finite.size
    std = math.sqrt(math.fsum((x - mean) ** 2 for x in finite) / finite.size)
    for dtype in (np.float64, np.float32):
        out = summary.stats(values.astype(dtype).reshape(3, -1))
        assert (out["min"], out["max"]) == (float(finite.astype(dtype).min()),
                                            float(finite.astype(dtype).max()))
        assert out["masked"] == int(np.isneginf(values).sum()) and (out["inf"], out["nan"]) == (
            2,
            1,
        )
        if dtype is np.float64:
            assert out["mean"] == pytest.approx(mean, rel=1e-15)
            assert out["std"] == pytest.approx(std, rel=1e-14)


def test_l2_norm_of_float32_adds_in_float64():
    """BLAS's sdot adds float32 in float32: on these 2^21 entries its norm is 1.5e-6 off, on
    GPT-2's 38 million-entry embedding gradient 1e-4 (the fourth digit shown). tfm's is the
    float64 sum."""
    from tfmcli.render import l2_norm
    g = (np.random.default_rng(0).standard_normal(1 << 21) * 1e-3).astype(np.float32)
    exact = math.sqrt(math.fsum(float(x) * float(x) for x in g.astype(np.float64)))
    assert l2_norm(g.reshape(1024, -1)) == pytest.approx(exact, rel=1e-12)
    assert l2_norm(g.astype(np.float64)) == pytest.approx(exact, rel=1e-12)
    assert l2_norm(np.zeros((0, 3), np.float32)) == 0.0


def test_l2_norm_of_float32_over_chunks_the_last_one_short(monkeypatch):
    """The float64 sum of squares goes a chunk at a time; 2,500 entries in chunks of 1,000
    end with half a chunk."""
    import tfmcli.explain.summary as summary
    monkeypatch.setattr(summary, "CHUNK", 1000)
    g = np.random.default_rng(1).standard_normal(2500).astype(np.float32)
    exact = math.sqrt(math.fsum(float(x) * float(x) for x in g))
    assert summary.l2_norm(g.reshape(50, 50)) == pytest.approx(exact, rel=1e-14)


def test_gradient_mean_of_float32_adds_in_float64():
    """NumPy's own mean of these 2^21 float32 entries (summed in float32) is off in the
    seventh digit, which `backward --json` writes; tfm's is the float64 sum's."""
    from tfmcli.explain.summary import mean
    g = (np.random.default_rng(0).standard_normal(1 << 21) + 1.0).astype(np.float32)
    exact = math.fsum(g.astype(np.float64)) / g.size
    assert mean(g.reshape(1024, -1)) == pytest.approx(exact, rel=1e-12)
    assert abs(float(g.mean()) - exact) > 1e-9 * abs(exact)   # float32's own mean is not it
    assert mean(np.zeros((0, 3), np.float32)) == 0.0


@pytest.mark.parametrize("values", [
    [3.0, -7.5, 2.0], [-1.0, 6.0], [-0.0], [-0.0, 0.0], [1.0, np.nan, -2.0], [2.0, -np.inf],
])
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_max_abs_is_the_largest_absolute_value_with_no_abs_array(values, dtype):
    from tfmcli.explain.summary import max_abs
    a = np.array(values, dtype=dtype)
    expected = float(np.abs(a).max())
    got = max_abs(a.reshape(1, -1))
    assert (math.isnan(got) and math.isnan(expected)) or (got == expected
                                                           and str(got) == str(expected))
    assert max_abs(np.zeros((2, 0))) == 0.0


@pytest.mark.parametrize("width", [20, 40, 60, 63, 64, 80, 81, 82, 90, 140])   # 64, 82: just fit
@pytest.mark.parametrize("colour", [False, True])
def test_grids_side_by_side_lay_out_as_rich_columns_do(width, colour):
    """The same bytes as Columns(blocks, padding=(0, 3)): as many to a row as fit, columns as
    wide as their widest block, short blocks padded; a block wider than the width wraps."""
    from rich.columns import Columns
    from rich.text import Text

    blocks = [mask_grid(np.tril(np.ones((n, n), dtype=bool)), title=f"causal {n}")
              for n in (3, 7, 2, 12)] + [Text("a note under the grids", style="dim")]

    def out(renderable):
        console = Console(file=io.StringIO(), width=width, force_terminal=colour,
                          color_system="truecolor" if colour else None)
        console.print(renderable)
        return console.file.getvalue()

    from tfmcli.render import grids_side_by_side
    laid_out = out(grids_side_by_side(*blocks))
    assert laid_out == out(Columns(blocks, padding=(0, 3)))
    titles_in_first_line = sum(f"causal {n}" in laid_out.splitlines()[0] for n in (3, 7, 2, 12))
    assert titles_in_first_line == {20: 1, 40: 1, 60: 2, 63: 2, 64: 3, 80: 3, 81: 3, 82: 4, 90: 4,
                                    140: 4}[width]


def test_a_curve_fills_eighths_of_a_cell_from_zero_to_its_top():
    """16 steps of 0..15 on two rows: 16 levels, one a step, the axis labelled at its ends."""
    from tfmcli.render import curve
    text = render(curve(list(range(1, 17)), list(range(16)), title="loss", width=80, height=2))
    assert text.splitlines() == ["loss",
                                 "15.000 ┤        ▁▂▃▄▅▆▇█",
                                 " 0.000 ┤▁▂▃▄▅▆▇█████████",
                                 "        1             16"]


def test_a_curve_column_is_the_mean_of_its_run_of_steps():
    """100 steps at 20 columns: 13 columns of 8 or 7 steps; the seventh holds two 1s and six
    3s, a mean of 2.5: 7 of 8 eighths (1 is 3 of them, 3 all 8)."""
    from tfmcli.render import curve
    text = render(curve(list(range(100)), [1.0] * 50 + [3.0] * 50, title="t", width=20,
                        height=1))
    assert text.splitlines()[1:] == ["3.000 ┤▃▃▃▃▃▃▇██████", "       0          99"]


def test_a_curve_of_small_values_reaches_the_top_at_its_largest():
    """A learning rate's warm-up: the scale runs from 0 to 0.008, not to 1."""
    from tfmcli.render import curve
    text = render(curve([1, 2, 3, 4], [0.002, 0.004, 0.006, 0.008], title="lr", width=80,
                        height=2))
    assert text.splitlines()[1:3] == ["0.008 ┤ ▁▄█", "0.000 ┤▅███"]


def test_a_log_curve_spans_the_orders_of_magnitude_and_its_ends_stay_apart():
    from tfmcli.render import curve
    text = render(curve([10, 20, 30, 40], [1.0, 0.1, 0.01, 0.001], title="t", width=80,
                        height=3, log=True))
    assert text.splitlines()[1:] == ["1.000 ┤█", "      │██▁", "0.001 ┤███▁",
                                     "       10 40", "       (log scale)"]


def test_a_curves_two_labels_share_one_notation():
    """As a table's column: a loss falling from 4.2 to 3e-4 was labelled 4.200 over 3.000e-04;
    a curve up to 2e5 with a dip to -3 was 2.00e+05 over -3.000. A zero stays 0.000."""
    from tfmcli.render import curve

    def labels(ys, log):
        lines = render(curve(list(range(len(ys))), ys, title="t", width=80, height=2,
                             log=log)).splitlines()
        return lines[1].split(" ┤")[0].strip(), lines[2].split(" ┤")[0].strip()
    assert labels([4.2, 0.1, 3e-4], log=True) == ("4.200e+00", "3.000e-04")
    assert labels([2e5, -3.0], log=False) == ("2.00e+05", "-3.00e+00")
    assert labels([7.071e-4, 3e-4], log=False) == ("7.071e-04", "0.000")
    assert labels([4.2, 0.1, 0.002], log=True) == ("4.200", "0.002")


def lens_grid(seq_len):
    """A logit lens of two layers ("embed", "block 1": 7 columns of labels) whose columns are
    8 wide ("u03 0.50"), 10 with the space before and the divider."""
    tokens, targets = [f"t{t:02d}" for t in range(seq_len)], [f"u{t:02d}" for t in range(seq_len)]
    grid = [[[(f"u{t:02d}", 0.5), ("zz", 0.25)] for t in range(seq_len)] for _ in range(2)]
    return ["embed", "block 1"], tokens, targets, grid


@pytest.mark.parametrize("width, shown", [(30, 2), (80, 6), (81, 7), (90, 7), (211, 20)])
def test_the_logit_lens_keeps_the_positions_that_fit_the_width(width, shown):
    """1 + 7 columns of layer names, 10 a position and 3 for the "…" column: k positions of
    20 take 11 + 10 k columns (k = 7 at 81, where 6 were kept, the labels counted a column
    too wide); never fewer than the first and the last; all 20 in 1 + 7 + 200 = 208."""
    from tfmcli.render.lens import lens_table
    text = render(lens_table(*lens_grid(20), width=width), width=300)
    lines = text.split("\nshowing")[0].splitlines()   # the table above its caption
    if shown < 20:
        assert re.findall(r"showing (\d+) of 20 positions", text) == [str(shown)]
        assert max(map(len, lines)) == 11 + 10 * shown <= max(width, 31)
    else:
        assert "showing" not in text and max(map(len, lines)) == 208
    assert re.findall(r"\d+:t\d\d", lines[0])[-1] == "19:t19"
    assert len(lines) == 2 + 1 + 2 * 2   # header and target, rule, two lines a layer


def test_the_logit_lens_greens_a_top_token_that_is_the_target_and_no_other():
    """Position 0 of the first layer has the target second: not green, the other five are."""
    from tfmcli.render.lens import lens_table
    layers, tokens, targets, grid = lens_grid(3)
    grid[0][0] = [("zz", 0.5), ("u00", 0.25)]
    text = render_colour(lens_table(layers, tokens, targets, grid))
    assert re.findall(r"\x1b\[1;32m(u\d\d) 0.50", text) == ["u01", "u02", "u00", "u01", "u02"]
    assert re.findall(r"\x1b\[2m(\w+) 0.25", text) == ["u00", "zz", "zz", "zz", "zz", "zz"]
    assert "  zz 0.50" in text   # a top token that misses: plain, neither green nor dim


def test_the_logit_lens_at_its_defaults_fits_80_columns_and_full_shows_every_position():
    from tfmcli.render.lens import lens_table
    assert render(lens_table(*lens_grid(20)), width=300) == \
        render(lens_table(*lens_grid(20), width=80), width=300)
    full = render(lens_table(*lens_grid(20), width=80, full=True), width=300)
    assert "showing" not in full and len(re.findall(r"\d+:t\d\d", full)) == 20


def test_a_count_takes_its_plural_unless_it_is_one():
    from tfmcli.render import counted

    assert [counted(n, "position") for n in (0, 1, 2, 1024)] == [
        "0 positions", "1 position", "2 positions", "1,024 positions"]
    assert counted(1, "entry", "entries") == "1 entry"
    assert counted(3, "entry", "entries") == "3 entries"


def test_a_notebook_prints_views_reports_and_runs_in_a_line_or_as_text():
    """Issue 58: GradcheckReport's repr was about 25 wrapped lines, a loaded run's dumped
    every Config field, print(tfmcli.render.heatmap(...)) printed <rich.constrain.Constrain
    object ...>, and heatmap(pattern) without a mask showed hidden cells as 0.00."""
    import tfmcli
    from tfmcli import render

    cfg = tfmcli.Config()
    params, inputs = tfmcli.init_params(cfg), tfmcli.make_inputs(cfg)
    report = repr(tfmcli.gradcheck(params, inputs, cfg))
    assert "\n" not in report and len(report) < 160
    # which tensor is the worst is rounding's choice (b_K's 3.1e-8 here, W_Q's 4.2e-9 under
    # another BLAS kernel: central differences' noise over F)
    assert re.match(r"GradcheckReport\(passed=True, worst='blocks\.0\.attn\.\w+' "
                    r"rel_err=\d\.\d\de-\d\d, ", report), report
    assert report.endswith("tolerance=1e-06, checked 626 of 626 entries in 21 tensors)")
    assert repr(cfg) == "Config()"
    changed = cfg.replace(d_model=8, pe="rope", lengths=(4, 2))
    assert repr(changed) == "Config(d_model=8, lengths=(4, 2), pe='rope')"
    assert eval("tfmcli." + repr(changed)) == changed
    pattern = np.tril(np.ones((3, 3)))
    pattern /= pattern.sum(axis=1, keepdims=True)
    drawn = str(render.heatmap(pattern))
    assert drawn.splitlines()[1:3] == ["0  1.00   ·     ·", "1  0.50  0.50   ·"]
    assert "<rich" not in drawn and "· hidden by mask" in drawn
    assert str(render.heatmap(np.eye(2) * 0.5)).splitlines()[1] == "0  0.50  0.00"  # not a pattern
    assert str(render.tensor_table(np.eye(2))).splitlines()[2] == "0 +1.0000  0.0000"


def test_a_wrapped_table_is_cut_in_even_blocks():
    """Issue 58: tfm block --norm post -t 2 split a 6-column table into 0..4 and a lone 5..5."""
    from tfmcli.render.tables import _column_blocks

    widths = {j: 11 for j in range(6)}   # scientific numbers
    assert _column_blocks(list(range(6)), widths, 9, 80) == [[0, 1, 2], [3, 4, 5]]
    assert _column_blocks(list(range(7)), widths, 9, 80) == [[0, 1, 2, 3], [4, 5, 6]]
    assert _column_blocks(list(range(5)), widths, 9, 80) == [list(range(5))]
    text = render(tensor_table(np.full((2, 6), 1e-4), full=True, width=70), width=70)
    assert "columns 0..2 of 6" in text and "columns 3..5 of 6" in text


def test_no_heatmap_writes_a_negative_zero():
    from tfmcli.render import heatmap

    grid = np.array([[-1e-5, 0.0, 0.25], [-0.0004, 1e-12, -0.3]])
    text = render(heatmap(grid, row_labels=["a", "b"], col_labels=["x", "y", "z"],
                                       width=80, precision=3, vmin=-0.3, vmax=0.3,
                                       diverging=True))
    assert "-0.000" not in text and "+0.000" not in text
    assert text.count("≈0") == 3 and " 0.000" in text and "-0.300" in text
