"""tfm: a NumPy transformer whose every forward and backward number can be seen and checked.

>>> import tfmcli
>>> cfg = tfmcli.Config(seed=1000)
>>> params = tfmcli.init_params(cfg)
>>> inputs = tfmcli.make_inputs(cfg)
>>> fwd = tfmcli.forward(params, inputs, cfg)
>>> grads = tfmcli.backward(params, fwd, cfg)
"""

import importlib

from tfmcli.errors import ConfigError, InputsError, TfmError
# Not lazy: `gradcheck` is also a submodule's name, and importing the submodule would rebind
# tfmcli.gradcheck to the module; imported here, the function wins.
from tfmcli.gradcheck import GradcheckReport, gradcheck

__version__ = "0.1.0"

# The rest of the API is imported on first use (PEP 562), so that `tfm --help` starts without
# NumPy and `tfm mask` without the model, the sources or the gradient check.
_LAZY = {
    "Config": "tfmcli.config", "init_params": "tfmcli.init", "load": "tfmcli.sources",
    "IGNORE": "tfmcli.inputs", "Forward": "tfmcli.model", "Gradients": "tfmcli.model",
    "Inputs": "tfmcli.inputs", "backward": "tfmcli.model", "forward": "tfmcli.model",
    "inputs_from_tokens": "tfmcli.inputs", "make_inputs": "tfmcli.inputs",
}
_SUBMODULES = {   # tfmcli.io.save_npz, tfmcli.optim.adam_step, ...: every module but gradcheck
    "adam", "block", "config", "embedding", "feedforward", "init", "inputs", "io", "kv", "layernorm", "lens", "loss", "masks", "memory", "model",
    "ops", "optim", "parallel", "positional", "sources", "steps", "summary", "tasks", "train",
}


def __getattr__(name):
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
    elif name in _SUBMODULES:
        value = importlib.import_module(f"tfmcli.{name}")
    else:
        raise AttributeError(f"module 'tfmcli' has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__():
    return sorted([*globals(), *_LAZY, *_SUBMODULES])

__all__ = [
    "Config", "ConfigError", "Forward", "GradcheckReport", "Gradients", "IGNORE", "Inputs",
    "InputsError", "TfmError", "backward", "forward", "gradcheck", "init_params",
    "inputs_from_tokens", "load", "make_inputs", "__version__",
]
