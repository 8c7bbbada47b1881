"""Training a small model: Adam written by hand (``optim``), the toy tasks and how their answers
are scored (``tasks``), and the loop that runs them with the hand-written backward (``loop``).
It may import ``tfmcli.engine`` only.
"""

from tfmcli import submodules

__getattr__ = submodules(__name__)   # tfmcli.train.NAME imported when first named
