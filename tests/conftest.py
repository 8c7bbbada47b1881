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
