"""Rich renderables for tfm: numbers, tensor tables, heatmaps, traces, gradient tables, masks.

Everything here receives arrays and returns a renderable (Table, Panel, Group, Text); nothing
computes model math or prints. Every number goes through :func:`fmt` (heatmap cells through its
fixed-point twin) so that columns align, and every colour has a text stand-in so the output
still reads when the console strips colours (NO_COLOR, or stdout not a terminal).
"""

from tfmcli.render.colours import colour_legend
from tfmcli.render.heatmap import heatmap
from tfmcli.render.lens import lens_table
from tfmcli.render.maps import attention_maps, maps_that_fit
from tfmcli.render.masks import mask_grid, mask_legend, mask_overview
from tfmcli.render.numbers import fmt
from tfmcli.render.plot import curve
from tfmcli.render.tokens import token_line
from tfmcli.render.tables import (config_panel, grad_table, l2_norm, record_table, shape_list,
                                  shape_trace, side_by_side, tensor_table)

__all__ = [
    "attention_maps", "colour_legend", "config_panel", "curve", "fmt", "grad_table", "heatmap", "l2_norm", "lens_table",
    "maps_that_fit", "mask_grid", "mask_legend", "mask_overview", "record_table", "shape_list", "shape_trace", "side_by_side",
    "tensor_table", "token_line",
]
