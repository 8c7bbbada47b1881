"""Rich renderables for tfm: numbers, tensor tables, heatmaps, traces, gradient tables, masks.

Everything here receives arrays and returns a renderable (Table, Panel, Group, Text); nothing
computes model math or prints. Every number goes through :func:`fmt` (heatmap cells through its
fixed-point twin) so that columns align, and every colour has a text stand-in so the output
still reads when the console strips colours (NO_COLOR, or stdout not a terminal).
"""

import importlib

# Not lazy: `heatmap` is also a submodule's name, and importing the submodule would rebind
# render.heatmap to the module; imported here, the function wins.
from tfmcli.render.heatmap import heatmap  # noqa: E402

_WHERE = {  # name -> the module that defines it; each is imported on first use (PEP 562)
    "colour_legend": "colours",
    "lens_table": "lens",
    "attention_maps": "maps",
    "maps_layout": "maps",
    "maps_that_fit": "maps",
    "grids_side_by_side": "masks",
    "mask_grid": "masks",
    "mask_grid_width": "masks",
    "mask_legend": "masks",
    "mask_overview": "masks",
    "fmt": "numbers",
    "counted": "numbers",
    "curve": "plot",
    "token_line": "tokens",
    "config_panel": "tables",
    "grad_table": "tables",
    "l2_norm": "tables",
    "record_table": "tables",
    "row_notations": "tables",
    "shape_list": "tables",
    "shape_trace": "tables",
    "side_by_side": "tables",
    "tensor_table": "tables",
}


def __getattr__(name):
    if name not in _WHERE:
        raise AttributeError(f"module 'tfmcli.render' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"tfmcli.render.{_WHERE[name]}"), name)
    globals()[name] = value
    return value


__all__ = [
    "attention_maps",
    "colour_legend",
    "config_panel",
    "counted",
    "curve",
    "fmt",
    "grad_table",
    "grids_side_by_side",
    "heatmap",
    "l2_norm",
    "lens_table",
    "maps_layout",
    "maps_that_fit",
    "mask_grid",
    "mask_grid_width",
    "mask_legend",
    "mask_overview",
    "record_table",
    "row_notations",
    "shape_list",
    "shape_trace",
    "side_by_side",
    "tensor_table",
    "token_line",
]
