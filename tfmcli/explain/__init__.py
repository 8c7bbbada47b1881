"""The per-part views' math, as data: one position of one part with every intermediate (an
attention head's steps, a layer norm, an FFN, a block's residual stream, the loss, the embedding,
Adam's updates, the logit lens, Pre-LN against Post-LN) and the statistics the tables show
(``summary``). Each ``explain`` returns a dataclass of arrays and numbers; the views draw it. It may
import ``tfmcli.engine``, ``tfmcli.check`` (central differences of single entries) and
``tfmcli.train.optim``; never ``render`` or ``cli``.
"""

from tfmcli import submodules

__getattr__ = submodules(__name__)   # tfmcli.explain.NAME imported when first named
