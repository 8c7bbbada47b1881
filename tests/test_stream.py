"""Streaming (issue 63, first slice): a forward pass that keeps one block at a time, weights
read from their files when used, tfm lens --stream: the same numbers bit for bit, and a peak
resident memory that does not hold every weight."""

import json
import subprocess
import sys

import numpy as np
import pytest

import tfmcli
from helpers import error_line, ok, random_params, run
from tfmcli.engine.presets import PRESETS
from tfmcli.sources import llama, tensorfile

ARCHS = [None, "llama", "gemma2", "vaswani", "gpt_neox", "bloom"]


@pytest.mark.parametrize("arch", ARCHS, ids=[a or "default" for a in ARCHS])
def test_a_streamed_forward_is_the_whole_one_bit_for_bit(arch):
    cfg = tfmcli.Config(**{"seq_len": 6, "layers": 3, **(PRESETS[arch].fields if arch else {})})
    params = random_params(tfmcli.init_params(cfg), 1)
    inputs = tfmcli.make_inputs(cfg)
    whole = tfmcli.forward(params, inputs, cfg)
    kept = tfmcli.forward(params, inputs, cfg, keep={"blocks.1.attn.pattern"})
    assert kept.loss == whole.loss
    for name, value in kept.acts.items():
        assert np.array_equal(value, whole.acts[name]), name
    assert set(kept.acts) == {"embed", "blocks.1.attn.pattern", "logits", "probs",
                              *(f"blocks.{i}.{p}" for i in range(3) for p in ("in", "out")),
                              *(n for n in ("pe", "ln_f.out", "ln_embed.out")
                                if n in whole.acts)}
    assert not any(k.startswith("blocks.") for k in kept.caches if isinstance(k, str))


@pytest.mark.parametrize("arch", ARCHS + ["mistral"], ids=[a or "default" for a in ARCHS]
                         + ["mistral"])
@pytest.mark.parametrize("changed", [False, True], ids=["plain", "intervened"])
def test_a_streamed_backward_makes_each_block_again_and_equals_the_whole_bit_for_bit(arch,
                                                                                     changed):
    from tfmcli.engine.interventions import Ablate, Scale

    cfg = tfmcli.Config(**{"seq_len": 6, "layers": 3, **(PRESETS[arch].fields if arch else {})})
    params = random_params(tfmcli.init_params(cfg), 2)
    inputs = tfmcli.make_inputs(cfg)
    change = [Scale("blocks.1.in[0, 2]", 2.0), Ablate("blocks.2.ffn.act", "mean"),
              Scale("blocks.0.attn.pattern[:, 0]", 1.5)] if changed else []
    whole = tfmcli.backward(params, tfmcli.forward(params, inputs, cfg, interventions=change),
                            cfg)
    kept = tfmcli.forward(params, inputs, cfg, interventions=change,
                          keep={"blocks.1.attn.pattern"})
    streamed = tfmcli.backward(params, kept, cfg)
    for name, grad in whole.items():
        assert np.array_equal(streamed[name], grad), name
    assert set(streamed.acts) == set(kept.acts)
    for name, grad in streamed.acts.items():
        assert np.array_equal(grad, whole.acts[name]), name


FIELDS = dict(d_model=256, heads=4, kv_heads=2, layers=8, d_ff=768, vocab=512, eps=1e-5,
              activation="swiglu", pe="rope", rms_norm=True, bias=False, tied_head=False,
              head_bias=False)


def llama_folder(folder, fields=FIELDS, seed=0):
    """A random LLaMA checkpoint folder in bfloat16, as Hugging Face writes one."""
    folder.mkdir(exist_ok=True)
    cfg = tfmcli.Config(**fields)
    params = random_params(tfmcli.init_params(cfg), seed)
    config = {"model_type": "llama", "architectures": ["LlamaForCausalLM"],
              "hidden_size": fields["d_model"], "num_attention_heads": fields["heads"],
              "num_key_value_heads": fields["kv_heads"], "num_hidden_layers": fields["layers"],
              "intermediate_size": fields["d_ff"], "vocab_size": fields["vocab"],
              "rms_norm_eps": fields["eps"], "max_position_embeddings": 64,
              "tie_word_embeddings": False, "hidden_act": "silu"}
    (folder / "config.json").write_text(json.dumps(config))
    tensorfile.write(folder / "model.safetensors", llama.from_tfm(params, fields), bfloat16=True)
    return folder


def test_lazy_weights_are_the_loaded_ones_and_checking_them_reads_none(tmp_path, monkeypatch):
    folder = llama_folder(tmp_path / "llama", dict(FIELDS, layers=2, d_model=32, d_ff=64))
    fields = llama.read_config(folder)
    loaded = llama.load_params(folder, fields, np.float64)
    lazy = llama.lazy_params(folder, fields, np.float64)
    assert list(lazy) == list(loaded)
    reads = []
    original = tensorfile.read_tensor
    monkeypatch.setattr(tensorfile, "read_tensor", lambda *a, **k: reads.append(a) or
                        original(*a, **k))
    tfmcli.engine.model.check_params(lazy, tfmcli.Config(**fields))
    assert reads == []                         # shapes and dtypes from the header alone
    for name, value in loaded.items():
        assert np.array_equal(lazy[name], value), name
    assert len(reads) == len(loaded)           # each read when asked for, never held


def test_lens_stream_prints_the_whole_runs_numbers():
    args = ["lens", "--load", "examples/tiny-llama", "--text", "The cat sat on the", "--json"]
    assert ok(*args, "--stream").stdout == ok(*args).stdout


def peak_kib(args) -> int:
    """Peak resident memory (KiB) of a fresh process running ``tfm ARGS``: its VmHWM (a new
    image's own; getrusage's ru_maxrss would carry the parent's over the exec)."""
    code = ("import sys\nfrom tfmcli.cli import main\n"
            f"sys.argv = ['tfm', *{[str(a) for a in args]!r}]\n"
            "try:\n    main()\nexcept SystemExit:\n    pass\n"
            "hwm = [l for l in open('/proc/self/status') if l.startswith('VmHWM')][0]\n"
            "print(hwm.split()[1], file=sys.stderr)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    return int(done.stderr.strip().splitlines()[-1])


def test_a_streamed_lens_holds_one_block_of_weights_not_all(tmp_path):
    folder = llama_folder(tmp_path / "llama")
    args = ["lens", "--load", folder, "--tokens", "1,5,9,13,17,21,25,29", "--json"]
    whole, streamed = peak_kib(args), peak_kib([*args, "--stream"])
    cfg = tfmcli.Config(**FIELDS)
    weights = sum(int(np.prod(s)) for s in tfmcli.engine.sizes.param_shapes(cfg).values()) * 8
    # the whole run holds every weight in float64 (57 MB); the streamed one a block's and the
    # head's: at least half the difference must show in the peaks
    block = weights / 10
    assert (whole - streamed) * 1024 > 0.5 * (weights - 3 * block), (whole, streamed, weights)


def test_stream_needs_a_folder_it_can_read_a_block_at_a_time():
    line = error_line(run("lens", "--stream"), 2)
    assert "'--stream'" in line and "--load DIR" in line
