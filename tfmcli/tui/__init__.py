"""The explorer (``tfm explore``): ``state`` is what is shown, as plain data and NumPy (which
tensor, which slice, the cell explained, where it came from, the ``tfm`` command that prints
it); ``app`` draws it with Textual and maps keys to moves. Textual is imported here only, so no
other command pays for it. It may import ``tfmcli.engine``, ``tfmcli.explain`` and
``tfmcli.render``.
"""
