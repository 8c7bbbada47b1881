"""tfm: a NumPy transformer whose every forward and backward number can be seen and checked.

>>> import tfmcli
>>> cfg = tfmcli.Config(seed=1000)
>>> params = tfmcli.init_params(cfg)
>>> inputs = tfmcli.make_inputs(cfg)
>>> fwd = tfmcli.forward(params, inputs, cfg)
>>> grads = tfmcli.backward(params, fwd, cfg)
"""

import importlib
import warnings

from tfmcli.errors import ConfigError, InputsError, TfmError

__version__ = "0.1.0"

# The layout (each folder's __init__ says what it holds and may import):
#   engine/   the model: config, sizes, ops, positional, masks, init, inputs, model, kv
#   check/    central differences and the PyTorch reference
#   train/    Adam, the toy tasks, the loop
#   explain/  the per-part views' math (one position of one part, every intermediate)
#   sources/  where a run comes from (seed, .npz, checkpoint folder, tokens, text)
#   render/   Rich renderables          cli/   the Typer app, one module per command
#   io.py     the .npz layout and saving; errors.py   the exceptions

# The API is imported on first use (PEP 562), so that `tfm --help` starts without NumPy and
# `tfm mask` without the model, the sources or the gradient check.
_LAZY = {
    "Config": "tfmcli.engine.config", "init_params": "tfmcli.engine.init",
    "load": "tfmcli.sources", "IGNORE": "tfmcli.engine.inputs", "Inputs": "tfmcli.engine.inputs",
    "inputs_from_tokens": "tfmcli.engine.inputs", "make_inputs": "tfmcli.engine.inputs",
    "Forward": "tfmcli.engine.model", "Gradients": "tfmcli.engine.model",
    "backward": "tfmcli.engine.model", "forward": "tfmcli.engine.model",
    "gradcheck": "tfmcli.check.gradcheck", "GradcheckReport": "tfmcli.check.gradcheck",
    **{name: "tfmcli.engine.interventions"
       for name in ("Ablate", "Set", "Scale", "Patch", "InterventionError")},
}
_SUBMODULES = {"engine", "explain", "check", "train", "sources", "render", "io", "errors"}
# Modules that lived at the top before the layout of 2026-11-28 (CHANGELOG.md): `tfmcli.ops` and
# the like still resolve, with a DeprecationWarning naming the new path. `import tfmcli.ops` does
# not.
_MOVED = {
    **{m: f"engine.{m}" for m in ("config", "presets", "ops", "model", "positional", "masks",
                                  "init", "inputs", "kv", "memory", "erf_series", "parallel")},
    **{m: f"explain.{m}" for m in ("adam", "block", "embedding", "feedforward", "layernorm",
                                   "loss", "lens", "compare", "steps", "summary")},
    "reference": "check.reference", "optim": "train.optim", "tasks": "train.tasks",
}


def __getattr__(name):
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
    elif name in _SUBMODULES:
        value = importlib.import_module(f"tfmcli.{name}")
    elif name in _MOVED:
        warnings.warn(f"tfmcli.{name} moved to tfmcli.{_MOVED[name]}", DeprecationWarning,
                      stacklevel=2)
        return importlib.import_module(f"tfmcli.{_MOVED[name]}")
    else:
        raise AttributeError(f"module 'tfmcli' has no attribute {name!r}")
    globals()[name] = value
    return value


def submodules(package: str):
    """A package's ``__getattr__`` that imports its module NAME when ``package.NAME`` is first
    read, so that ``import tfmcli`` then ``tfmcli.engine.ops`` works without importing it all."""
    def getattr_(name):
        try:
            return importlib.import_module(f"{package}.{name}")
        except ModuleNotFoundError as error:
            if error.name != f"{package}.{name}":
                raise
            raise AttributeError(f"module {package!r} has no attribute {name!r}") from None
    return getattr_


def __dir__():
    return sorted([*globals(), *_LAZY, *_SUBMODULES])


__all__ = [
    "Config", "ConfigError", "Forward", "GradcheckReport", "Gradients", "IGNORE", "Inputs",
    "InputsError", "TfmError", "backward", "forward", "gradcheck", "init_params",
    "inputs_from_tokens", "load", "make_inputs", "__version__",
]
