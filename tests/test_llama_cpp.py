"""tfm's float64 logits beside llama.cpp's own on the same GGUF file (llama.cpp through the
``llama-cpp-python`` package, built from its source distribution: about 3 minutes on two
cores). llama.cpp computes in float32, so on an F32 or F16 file the two agree to float32's
rounding. On a quantized file they do not, and the tests say by how much and why: ggml's CPU
product rounds the *activations* too, to the weight type's partner (Q8_0 blocks of 32 for
Q8_0 and Q4_0 weights, Q8_K blocks of 256 for the K-quants), before it multiplies. The same
weights decoded to float32 (an F32 file of the values the quantized blocks hold) agree with
tfm to float32's rounding again: the difference is llama.cpp's arithmetic, not the weights tfm
reads.
"""

from __future__ import annotations

import numpy as np
import pytest
import test_gguf
from test_gguf import EXAMPLES, requantized

import tfmcli

pytest.importorskip("gguf")
llama_cpp_package = pytest.importorskip(
    "llama_cpp", reason="llama.cpp's own logits need llama-cpp-python (llama.cpp built from "
                        "its source): python -m pip install llama-cpp-python==0.3.36")
# test_gguf's fixtures, which pytest finds by their names here
llama_cpp, converter, tiny_gpt2, wide_llama = (test_gguf.llama_cpp, test_gguf.converter,
                                               test_gguf.tiny_gpt2, test_gguf.wide_llama)

TOKENS = [1, 40, 200, 7, 99, 215, 3, 12, 64, 5]
FLOAT32 = 1e-5     # of the logits' largest: float32's rounding (2e-7 to 5e-7 measured), and room


def theirs(path, tokens) -> np.ndarray:
    """llama.cpp's logits at every position of ``tokens`` (T, V), on one thread, its keys and
    values cached in float32 (by default in float16: 1e-3 of the logits' largest away)."""
    f32 = llama_cpp_package.GGML_TYPE_F32
    llm = llama_cpp_package.Llama(model_path=str(path), logits_all=True, n_ctx=len(tokens),
                                  n_threads=1, n_batch=len(tokens), type_k=f32, type_v=f32,
                                  verbose=False)
    try:
        llm.eval(tokens)
        return np.array(llm.scores[:len(tokens)], dtype=np.float64)
    finally:
        llm.close()


def ours(path, tokens) -> np.ndarray:
    run = tfmcli.load(path, tokens=[tokens])
    return tfmcli.forward(run.params, run.inputs, run.cfg).acts["logits"][0]


def apart(a, b) -> float:
    """The largest difference, over the larger tensor's largest entry."""
    return float(np.abs(a - b).max() / np.abs(b).max())


@pytest.mark.parametrize("folder", ["tiny-llama", "wide-llama"])
def test_llama_cpps_logits_are_tfms_to_float32s_rounding(converter, wide_llama, folder):
    """An F32 file of a LLaMA (the Q/K rows llama.cpp reorders for its RoPE, undone by tfm),
    the same tokens: llama.cpp's float32 logits are tfm's float64 ones to 1e-5 of their
    largest, and pick the same next token."""
    source = {"tiny-llama": EXAMPLES / "tiny-llama", "wide-llama": wide_llama}[folder]
    path = converter(source, "f32")
    mine, llamas = ours(path, TOKENS), theirs(path, TOKENS)
    assert mine.shape == llamas.shape == (len(TOKENS), 316)
    assert apart(mine, llamas) < FLOAT32, apart(mine, llamas)
    assert (mine.argmax(-1) == llamas.argmax(-1)).all()


def test_llama_cpps_gelu_is_a_float16_table(converter, tiny_gpt2, monkeypatch):
    """GPT-2's F32 file (its fused, transposed layout): llama.cpp's logits are 3.1e-4 of their
    largest from tfm's, past float32's rounding, because ggml's GELU looks its value up in a
    table of float16s, indexed by the input rounded to float16 (and is x past 10, 0 below
    -10). tfm's GELU made so is llama.cpp's to float32's rounding."""
    from tfmcli.engine import ops

    path = converter(tiny_gpt2, "f32", "gpt-2")
    tokens = [t % 100 for t in TOKENS]
    llamas = theirs(path, tokens)
    assert apart(ours(path, tokens), llamas) > 5 * FLOAT32
    exact, backward = ops.ACTIVATIONS["gelu"]

    def tabled(x):
        y, cache = exact(x.astype(np.float16).astype(np.float64))
        y = y.astype(np.float16).astype(np.float64)
        return np.where(x > 10, x, np.where(x < -10, 0.0, y)), cache

    monkeypatch.setitem(ops.ACTIVATIONS, "gelu", (tabled, backward))
    run = tfmcli.load(path, tokens=[tokens])
    mine = tfmcli.forward(run.params, run.inputs, run.cfg, fast=False).acts["logits"][0]
    assert apart(mine, llamas) < FLOAT32, apart(mine, llamas)


@pytest.mark.parametrize("name", ["F16", "Q8_0", "Q4_0"])
def test_on_a_quantized_file_llama_cpp_rounds_the_activations_too(converter, wide_llama,
                                                                  tmp_path, name):
    """An F16, Q8_0 or Q4_0 file: llama.cpp's logits are further from tfm's than float32's
    rounding (ggml rounds each product's activations to float16 or to Q8_0 blocks first), but
    on an F32 file of the values the file's blocks decode to they are tfm's again, to
    float32's rounding; and tfm's logits of the file and of its decoded values are the same
    to 1e-12."""
    import gguf

    kind = getattr(gguf.GGMLQuantizationType, name)
    f32 = converter(wide_llama, "f32")
    quantized = requantized(f32, tmp_path / f"{name}.gguf", kind)
    decoded = requantized(f32, tmp_path / f"{name}-decoded.gguf", kind, dequantized=True)
    mine = ours(quantized, TOKENS)
    assert apart(ours(decoded, TOKENS), mine) < 1e-12
    assert apart(theirs(decoded, TOKENS), mine) < FLOAT32
    assert apart(theirs(quantized, TOKENS), mine) > 5 * FLOAT32
