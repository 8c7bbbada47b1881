"""tfm: a NumPy transformer whose every forward and backward number can be seen and checked.

>>> import tfmcli
>>> cfg = tfmcli.Config(seed=1000)
>>> params = tfmcli.init_params(cfg)
>>> inputs = tfmcli.make_inputs(cfg)
>>> fwd = tfmcli.forward(params, inputs, cfg)
>>> grads = tfmcli.backward(params, fwd, cfg)
"""

from tfmcli import config, io, masks, ops, positional  # noqa: F401  (tfmcli.io.save_npz, ...)
from tfmcli.config import Config
from tfmcli.errors import ConfigError, TfmError
from tfmcli.gradcheck import GradcheckReport, gradcheck
from tfmcli.init import init_params
from tfmcli.sources import load
from tfmcli.model import (IGNORE, Forward, Gradients, Inputs, backward, forward, inputs_from_tokens,
                          make_inputs)

__version__ = "0.1.0"

__all__ = [
    "Config", "ConfigError", "Forward", "GradcheckReport", "Gradients", "IGNORE", "Inputs",
    "TfmError", "backward", "forward", "gradcheck", "init_params", "inputs_from_tokens",
    "load", "make_inputs", "__version__",
]
