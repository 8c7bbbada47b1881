"""explain.quantization: each weight tensor's quantization error (relative RMS and max against
the original), by hand on small tensors, and on the shipped Q8_0 file against its folder."""

from pathlib import Path

import numpy as np
import pytest

from tfmcli.errors import TfmError
from tfmcli.explain.quantization import weight_error, weight_errors

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def test_the_errors_by_hand():
    w = np.array([[1.0, -2.0], [0.5, 4.0]])
    q = w + np.array([[0.1, 0.0], [0.0, -0.2]])
    e = weight_error("W", q, w, "Q8_0")
    assert e.rel_rms == pytest.approx(np.sqrt((0.01 + 0.04) / 4) / np.sqrt((1 + 4 + 0.25 + 16) / 4))
    assert (e.rel_max, e.max_abs, e.shape, e.kind) == (pytest.approx(0.05), pytest.approx(0.2),
                                                       (2, 2), "Q8_0")
    exact = weight_error("b", np.zeros(3), np.zeros(3))
    assert (exact.rel_rms, exact.rel_max) == (0.0, 0.0)
    assert weight_error("b", np.ones(3), np.zeros(3)).rel_max == float("inf")


def test_tensors_of_another_model_are_refused():
    with pytest.raises(TfmError, match="W: the quantized tensor has shape"):
        weight_error("W", np.zeros((2, 3)), np.zeros((3, 2)))
    with pytest.raises(TfmError, match="b: the quantized model has no such tensor"):
        weight_errors({"W": np.zeros(2)}, {"W": np.zeros(2), "b": np.zeros(2)})


def test_the_shipped_q8_0_file_against_its_folder():
    """Every matrix of examples/tiny-llama.Q8_0.gguf within Q8_0's rounding of the folder's:
    half a step of its block of 32 (max|w| / 127) plus the float16 scale's rounding, at most
    max|w| / 226 of the tensor; the norms, stored in F32, exact. Read a tensor at a time."""
    pytest.importorskip("gguf", reason="a GGUF file is read with the gguf package: no gguf")
    pytest.importorskip("safetensors")
    from tfmcli.sources import llama
    from tfmcli.sources.gguf import reader

    path = EXAMPLES / "tiny-llama.Q8_0.gguf"
    fields = reader.read_config(path)
    quantized = reader.lazy_params(path, fields, np.float64)
    original = llama.lazy_params(EXAMPLES / "tiny-llama", llama.read_config(EXAMPLES /
                                                                             "tiny-llama"),
                                 np.float64)
    errors = weight_errors(quantized, original, {n: quantized.kind(n) for n in quantized})
    assert [e.name for e in errors] == list(original)
    for e in errors:
        if e.kind == "Q8_0":
            assert len(e.shape) == 2 and 0 < e.rel_max <= 1 / 226 and 1e-3 < e.rel_rms < 1e-2, e
        else:
            assert e.kind == "F32" and len(e.shape) == 1 and e.max_abs == 0, e
    assert sum(e.kind == "Q8_0" for e in errors) == 16
