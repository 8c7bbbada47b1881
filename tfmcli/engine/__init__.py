"""The model itself: the Config (``config``) and what follows from it without running
(``sizes``), the forward/backward pairs of every part (``ops``), positions and masks, the
weights' initialisation and the inputs, each kind of block (``blocks``), the whole pass
(``model``: embed -> blocks -> head -> loss, forward and backward by hand), decoding with a KV
cache (``kv``), the memory estimate and how BLAS threads are used. It imports NumPy and
``tfmcli.errors`` only: nothing here explains, renders, reads a file or trains.
"""

from tfmcli import submodules

__getattr__ = submodules(__name__)   # tfmcli.engine.NAME imported when first named
