"""Streaming at 7B (issue 63): a random-weight LLaMA-7B-shaped bfloat16 folder on disk (made
once, never committed), then ``tfm lens``, ``tfm backward --block 15`` and ``tfm precision
--dtype bfloat16`` (issue 72) on 16 tokens, each timed with its peak resident memory (VmHWM),
the lens and the backward against a fresh process reading the folder once just before
(issue 75: every tensor widened to float64 as the streamed pass reads it, nothing else).
The whole runs do not fit (about 101 GiB), so they stream by themselves (the script passes
--stream, so that a shallower model streams too).

    python benchmarks/stream.py [--folder DIR] [--layers L] [--only lens|backward|precision]
                                [--gguf]

``--gguf`` makes and runs a GGUF file of the same shape instead, in llama.cpp's Q4_K_M mix of
types (issue 73), its weights dequantized as the pass reads them.

The folder is written a block a shard (model-000NN-of-000MM.safetensors and its index), so
making it holds one block's weights. ``--layers`` makes a shallower model of the same width
for a quick run. The script unsets OPENBLAS_CORETYPE and OPENBLAS_L2_SIZE for itself and
prints the kernel.
"""

from __future__ import annotations

import os
import sys

OVERRIDES = ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE")
if any(name in os.environ for name in OVERRIDES):
    env = {k: v for k, v in os.environ.items() if k not in OVERRIDES}
    os.execve(sys.executable, [sys.executable, *sys.argv], env)

import argparse  # noqa: E402
import json  # noqa: E402
import subprocess  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402

from tfmcli.sources import tensorfile  # noqa: E402

# LLaMA-7B's config.json (meta-llama/Llama-2-7b-hf)
SEVEN_B = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 4096,
           "intermediate_size": 11008, "num_attention_heads": 32, "num_key_value_heads": 32,
           "num_hidden_layers": 32, "vocab_size": 32000, "rms_norm_eps": 1e-5,
           "max_position_embeddings": 4096, "tie_word_embeddings": False,
           "hidden_act": "silu", "torch_dtype": "bfloat16"}
TOKENS = "1,450,4996,3290,373,670,278,17366,29889,450,11203,471,1754,4274,278,1029"


def kernel() -> str:
    from threadpoolctl import threadpool_info

    return ", ".join(f"{i['internal_api']} {i.get('architecture', '')} {i['num_threads']} "
                     f"threads" for i in threadpool_info() if i["user_api"] == "blas")


def make_folder(folder: Path, config: dict) -> None:
    """Random weights (N(0, 0.02), norms' gains 1) in bfloat16, a block a shard."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    d, F, V, L = (config["hidden_size"], config["intermediate_size"], config["vocab_size"],
                  config["num_hidden_layers"])
    rng = np.random.default_rng(0)

    def weights(*shape):
        return (rng.standard_normal(shape, dtype=np.float32) * 0.02)

    count, index = L + 2, {}

    def write(n, shard):   # each shard written as soon as it is made, then let go
        name = f"model-{n + 1:05d}-of-{count:05d}.safetensors"
        tensorfile.write(folder / name, shard, bfloat16=True)
        index.update({key: name for key in shard})

    write(0, {"model.embed_tokens.weight": weights(V, d)})
    for i in range(L):
        m = f"model.layers.{i}."
        write(i + 1, {m + "input_layernorm.weight": np.ones(d, np.float32),
                      m + "self_attn.q_proj.weight": weights(d, d),
                      m + "self_attn.k_proj.weight": weights(d, d),
                      m + "self_attn.v_proj.weight": weights(d, d),
                      m + "self_attn.o_proj.weight": weights(d, d),
                      m + "post_attention_layernorm.weight": np.ones(d, np.float32),
                      m + "mlp.gate_proj.weight": weights(F, d),
                      m + "mlp.up_proj.weight": weights(F, d),
                      m + "mlp.down_proj.weight": weights(d, F)})
        if i % 4 == 3:
            print(f"  wrote block {i + 1} of {L}", flush=True)
    write(L + 1, {"model.norm.weight": np.ones(d, np.float32), "lm_head.weight": weights(V, d)})
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": index}))


# a Q4_K_M file's types (llama.cpp's mix): most matrices Q4_K, V and the FFN's down
# projection and the head Q6_K, the norms F32; each block's bytes and values per block
Q4_K, Q6_K = (144, 256), (210, 256)


def k_blocks(rows: int, cols: int, kind: tuple, rng) -> np.ndarray:
    """Random bytes laid out as ``kind``'s blocks (Q4_K or Q6_K), with each block's scale
    (its float16 ``d``, and Q4_K's ``dmin``) set small enough that every weight decodes to a
    few hundredths: valid blocks whose values look like a model's, made at the speed of
    random bytes. (gguf.quants dequantizes K-quants but does not make them.)"""
    size, per = kind
    raw = rng.integers(0, 256, (rows, cols // per, size), dtype=np.uint8)
    if kind == Q4_K:   # d, dmin first; w = d * scale * q - dmin * min
        raw[..., 0:2] = np.frombuffer(np.float16(4e-5).tobytes(), np.uint8)
        raw[..., 2:4] = np.frombuffer(np.float16(4e-4).tobytes(), np.uint8)
    else:              # d last; w = d * scale * (q - 32), scale an int8
        raw[..., 208:210] = np.frombuffer(np.float16(5e-6).tobytes(), np.uint8)
    return raw.reshape(rows, -1)


def make_gguf(path: Path, config: dict) -> None:
    """A LLaMA-7B-shaped GGUF file in llama.cpp's Q4_K_M mix of types (random blocks: see
    ``k_blocks``), its metadata as llama.cpp's converter writes it for LLaMA (no tokenizer:
    the runs give --tokens)."""
    import gguf

    d, F, V, L = (config["hidden_size"], config["intermediate_size"], config["vocab_size"],
                  config["num_hidden_layers"])
    rng = np.random.default_rng(0)
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_name("random LLaMA-7B shape, Q4_K_M mix")
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(d)
    writer.add_block_count(L)
    writer.add_feed_forward_length(F)
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_rope_freq_base(10000.0)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_K_M)

    def matrix(name, rows, cols, kind):
        qtype = gguf.GGMLQuantizationType.Q4_K if kind == Q4_K else gguf.GGMLQuantizationType.Q6_K
        writer.add_tensor(name, k_blocks(rows, cols, kind, rng), raw_dtype=qtype)

    matrix("token_embd.weight", V, d, Q4_K)
    for i in range(L):
        b = f"blk.{i}."
        writer.add_tensor(b + "attn_norm.weight", np.ones(d, np.float32))
        for part, rows, cols, kind in (("attn_q", d, d, Q4_K), ("attn_k", d, d, Q4_K),
                                       ("attn_v", d, d, Q6_K), ("attn_output", d, d, Q4_K),
                                       ("ffn_gate", F, d, Q4_K), ("ffn_up", F, d, Q4_K),
                                       ("ffn_down", d, F, Q6_K)):
            matrix(b + part + ".weight", rows, cols, kind)
        writer.add_tensor(b + "ffn_norm.weight", np.ones(d, np.float32))
    writer.add_tensor("output_norm.weight", np.ones(d, np.float32))
    matrix("output.weight", V, d, Q6_K)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def peak_run(args: list[str]) -> tuple[float, int, str]:
    """(seconds, peak resident KiB, stdout) of ``tfm ARGS`` in a fresh process."""
    code = ("import sys\nfrom tfmcli.cli import main\n"
            f"sys.argv = ['tfm', *{args!r}]\n"
            "try:\n    main()\nexcept SystemExit:\n    pass\n"
            "hwm = [l for l in open('/proc/self/status') if l.startswith('VmHWM')][0]\n"
            "print(hwm.split()[1], file=sys.stderr)")
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    seconds = time.perf_counter() - start
    return seconds, int(done.stderr.strip().splitlines()[-1]), done.stdout


READ = """import sys, time
from tfmcli.engine.config import Config
from tfmcli.sources import resolve
start = time.perf_counter()
run = resolve({**Config().__dict__, "dtype": "float64"}, {"dtype"}, sys.argv[1], [[1]])
weights = run.lazy_params()
for name in weights:
    weights[name]   # read and widened to float64 as the streamed pass reads it, then let go
print(time.perf_counter() - start)"""


def read_once(folder: Path) -> float:
    """Seconds a fresh process takes to read every tensor of the folder once, widened to
    float64 a tensor at a time (the streamed pass's reader, nothing else): the floor of a
    streamed command, which reads each block's weights once (the lens) or twice (the
    backward: the forward, then each block again for its gradients)."""
    done = subprocess.run([sys.executable, "-c", READ, str(folder)], capture_output=True,
                          text=True, check=True)
    return float(done.stdout.strip().splitlines()[-1])


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--folder", default="/tmp/tfm-llama-7b")
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--only", choices=["lens", "backward", "precision"])
    parser.add_argument("--gguf", action="store_true",
                        help="a Q4_K_M GGUF file of the same shape (FOLDER.Q4_K_M.gguf)")
    args = parser.parse_args()
    folder = Path(args.folder)
    config = {**SEVEN_B, "num_hidden_layers": args.layers}
    if args.gguf:
        folder = folder.with_name(folder.name + ".Q4_K_M.gguf")
        if not folder.is_file():
            print(f"making {folder} ({args.layers} blocks, Q4_K_M)...", flush=True)
            start = time.perf_counter()
            make_gguf(folder, config)
            print(f"  made in {time.perf_counter() - start:.0f} s, "
                  f"{folder.stat().st_size / 2**30:.2f} GiB", flush=True)
    elif not (folder / "model.safetensors.index.json").is_file():
        print(f"making {folder} ({args.layers} blocks, bfloat16)...", flush=True)
        start = time.perf_counter()
        make_folder(folder, config)
        print(f"  made in {time.perf_counter() - start:.0f} s", flush=True)
    print(f"BLAS: {kernel()}")
    runs = {"lens": ["lens"], "backward": ["backward", "--block", str(min(15, args.layers - 1))],
            "precision": ["precision", "--dtype", "bfloat16"]}
    for name, command in runs.items():
        if args.only not in (None, name):
            continue
        read = None if args.gguf or name == "precision" else read_once(folder)
        seconds, peak, out = peak_run([*command, "--load", str(folder), "--tokens", TOKENS,
                                       "--stream", "--json"])
        streamed = "streamed" if out.strip().startswith("{") else f"failed: {out[-300:]!r}"
        against = "" if read is None else (f"; reading the folder once just before: "
                                           f"{read:.1f} s, so {seconds / read:.2f}x")
        print(f"tfm {' '.join(command)}{' (Q4_K_M GGUF)' if args.gguf else ''}, {args.layers} "
              f"blocks of LLaMA-7B's width, 16 tokens: "
              f"{seconds:.1f} s, peak resident {peak / 2**20:.2f} GiB ({streamed}){against}",
              flush=True)


if __name__ == "__main__":
    main()
