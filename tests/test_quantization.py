"""explain.quantization: each weight tensor's quantization error (relative RMS and max against
the original), by hand on small tensors, and on the shipped Q8_0 file against its folder."""

import json
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


# ---------------------------------------------------------------- the lens: tfm precision --against

Q8 = EXAMPLES / "tiny-llama.Q8_0.gguf"
TEXT = "The cat sat on the mat"


def lens_json(*args):
    from helpers import ok

    pytest.importorskip("gguf")
    return json.loads(ok("precision", "--load", Q8, "--against", EXAMPLES / "tiny-llama",
                         "--text", TEXT, "--json", *args).output)


def both_runs(dtype="float64"):
    """The original folder's run and the Q8_0 file's (its weights dequantized) on TEXT."""
    import tfmcli

    pytest.importorskip("gguf")
    quantized = tfmcli.load(Q8, text=TEXT, dtype="float64")
    rows = [list(map(int, quantized.inputs.tokens[0]))]
    original = tfmcli.load(EXAMPLES / "tiny-llama", tokens=rows, dtype="float64")
    return original, quantized


def test_the_lens_runs_the_original_and_the_quantized_model_as_they_are():
    """float64 math, weights only: the truth is the folder's run, the other the file's, bit
    for bit; the embedding's error is the looked-up rows' quantization error, all its own;
    the unit is the weights' size-weighted RMS relative error."""
    import tfmcli
    from tfmcli.explain.quantization import weights_error

    report = lens_json()
    original, quantized = both_runs()
    truth = tfmcli.forward(original.params, original.inputs, original.cfg)
    low = tfmcli.forward(quantized.params, quantized.inputs, quantized.cfg)
    assert report["loss"] == {"original": truth.loss, "quantized": low.loss}
    assert len(report["weights"]) == len(original.params)
    assert {w["stored"] for w in report["weights"]} == {"Q8_0", "F32"}
    errors = weight_errors(quantized.params, original.params)
    assert report["eps"] == pytest.approx(weights_error(errors), rel=1e-12)
    embed = report["activations"][0]
    assert embed["name"] == "embed" and embed["inherited"] == 0 and embed["own"] == embed["rms"]
    d = low.acts["embed"] - truth.acts["embed"]
    rms = np.sqrt(np.mean(d ** 2)) / np.sqrt(np.mean(truth.acts["embed"] ** 2))
    assert embed["rms"] == pytest.approx(rms, rel=1e-12)
    assert report["unit"] == "weights' relative RMS error"


def test_the_lens_in_bfloat16_rounds_the_quantized_model():
    import tfmcli

    report = lens_json("--dtype", "bfloat16")
    _, quantized = both_runs()
    low = quantized.cfg.replace(dtype="bfloat16")
    from tfmcli.engine import precision

    rounded = {n: precision.of("bfloat16").round(v).astype(np.float32)
               for n, v in quantized.params.items()}
    fwd = tfmcli.forward(rounded, quantized.inputs, low)
    assert report["loss"]["quantized"] == fwd.loss
    assert report["unit"] == "eps" and report["eps"] == 2.0 ** -7


def test_a_streamed_lens_is_the_whole_one():
    whole, streamed = lens_json(), lens_json("--stream")
    assert streamed == whole


def test_the_lens_against_a_less_quantized_file(tmp_path):
    """--against a GGUF file: the Q8_0 file against itself dequantized to F32 (what Q8_0
    holds, exactly) has no quantization to see; against a Q4_0 requantization it has."""
    from helpers import error_line, run

    gguf = pytest.importorskip("gguf")
    from test_gguf import requantized

    f32 = dequantized_copy(Q8, tmp_path / "f32.gguf")
    line = error_line(run("precision", "--load", Q8, "--against", f32, "--text", TEXT), 1)
    assert "no quantization to see" in line
    q4 = requantized(f32, tmp_path / "q4.gguf", gguf.GGMLQuantizationType.Q4_0)
    from helpers import ok

    report = json.loads(ok("precision", "--load", q4, "--against", f32, "--text", TEXT,
                           "--json").output)
    stored = {w["name"]: w["stored"] for w in report["weights"]}
    assert stored["blocks.0.attn.W_Q"] == "Q4_0" and stored["blocks.0.ln1.gamma"] == "F32"
    q4_rms = [w["rel_rms"] for w in report["weights"] if w["stored"] == "Q4_0"]
    assert min(q4_rms) > 0.02   # Q4_0's 16 levels: several percent, against Q8_0's 0.5%


def dequantized_copy(source: Path, out: Path) -> Path:
    """``source`` with every tensor stored as the float32 values its type decodes to (F32),
    the metadata as it is."""
    import gguf
    from test_gguf import rewritten

    return rewritten(source, out, lambda t: gguf.quants.dequantize(t.data, t.tensor_type)
                     .astype(np.float32).reshape(tuple(int(n) for n in t.shape[::-1])))


@pytest.mark.parametrize("args, option, said", [
    (["--against", "examples/tiny-llama"], "'--against'", "give --load FILE.gguf too"),
    (["--load", "examples/tiny-llama.Q8_0.gguf", "--against", "examples/tiny-gpt2"],
     "'--against'", "is not the original of --load's model"),
    (["--load", "examples/tiny-llama.Q8_0.gguf", "--against", "no/such/dir"], "'--against'",
     "no/such/dir"),
    (["--dtype", "float64"], "'--dtype'", "--against"),
])
def test_the_lens_refuses_in_one_line(args, option, said):
    from helpers import error_line, run

    pytest.importorskip("gguf")
    line = error_line(run("precision", "--tokens", "1,2,3", *args), 2)
    assert option in line and said in line, line
