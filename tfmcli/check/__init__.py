"""The proofs: central differences against the hand-written backward (``gradcheck``: entry by
entry, or along random directions for big tensors) and the same model written in PyTorch
(``reference``, for ``tfm check --against torch``; torch is imported only there). It may import
``tfmcli.engine`` only.
"""

from tfmcli import submodules

__getattr__ = submodules(__name__)   # tfmcli.check.NAME imported when first named
