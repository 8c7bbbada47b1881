"""The kinds of failure tfm reports: bad settings or inputs, and runs or files that go wrong."""


class TfmError(Exception):
    """A domain failure (a file that cannot be read, a NaN in a run). The CLI exits 1."""


class ConfigError(TfmError, ValueError):
    """A setting outside what tfm allows. The CLI reports it as a usage error (exit 2).

    ``field`` is the Config field at fault, so the CLI can name the matching option.
    """

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field


class InputsError(TfmError, ValueError):
    """Inputs the model cannot run (an id outside the vocabulary, a length outside 1..T,
    arrays whose shapes disagree) or parameters that do not fit the Config, from the Python
    API: the CLI checks what it is given first."""
