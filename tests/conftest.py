"""Fixtures shared by the test modules (their helper functions are in ``helpers``)."""

import pytest


@pytest.fixture
def float64_softmax(monkeypatch):
    """Gemma 2's and 3's eager attention takes its softmax in float32 whatever the model's
    dtype; here a float64 input keeps float64, and nothing else of Hugging Face's code
    changes."""
    torch = pytest.importorskip("torch")
    softmax = torch.nn.functional.softmax

    def keeping_float64(x, dim=None, dtype=None, **kwargs):
        return softmax(x, dim=dim, dtype=torch.float64 if x.dtype == torch.float64 else dtype,
                       **kwargs)

    monkeypatch.setattr(torch.nn.functional, "softmax", keeping_float64)


@pytest.fixture(autouse=True)
def fresh_colour_styles():
    """A rich Style keeps the escape codes of the first colour system it is printed with, and
    tfm makes each colour's Style once (render.colours): a test that prints in 16 colours would
    hand its codes to the next test's truecolor console (so would rich's own cache of
    combined styles). Each test starts with none made."""
    from rich.style import Style

    from tfmcli.render import colours

    colours._on_background.cache_clear()
    colours._solid.cache_clear()
    Style._add.cache_clear()


# .ci/run: the README's test command first, with no oracle installed, then only what it
# skipped, with every oracle: TFM_SKIPPED names the file where the first run lists them.
def _log_skipped(report) -> None:
    import os

    path = os.environ.get("TFM_SKIPPED")
    if path and report.skipped:
        with open(path, "a") as f:
            f.write(report.nodeid + "\n")


def pytest_runtest_logreport(report):
    _log_skipped(report)


def pytest_collectreport(report):   # a module skipped whole (importorskip at its top)
    _log_skipped(report)
