"""Make examples/tiny-llama.Q8_0.gguf: examples/tiny-llama as llama.cpp keeps a model, written by
llama.cpp's own converter (``convert_hf_to_gguf.py --outtype q8_0``): every matrix in Q8_0
(blocks of 32 weights, each a multiple of a float16 scale), the norms in F32, the tokenizer in
the file's metadata. docs/gguf.md runs on it. Needs the gguf extra and the converter's own
requirements (torch, transformers, sentencepiece); LLAMA_CPP is a llama.cpp source tree (the
llama-cpp-python source distribution's vendor/llama.cpp has one):

    python examples/tiny_gguf.py LLAMA_CPP [OUT_FILE]
"""

import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def main(llama_cpp: str, out: str = str(HERE / "tiny-llama.Q8_0.gguf")) -> None:
    subprocess.run([sys.executable, str(Path(llama_cpp) / "convert_hf_to_gguf.py"),
                    str(HERE / "tiny-llama"), "--outfile", out, "--outtype", "q8_0"], check=True)


if __name__ == "__main__":
    main(*sys.argv[1:])
