"""Make examples/tiny-gpt2/: a GPT-2 checkpoint folder small enough to commit, trained by tfm.

A byte-level BPE tokenizer is trained on a few sentences with the `tokenizers` library, a
GPT-2-shaped model (learned positions, tied head without bias, gelu_new) is trained on the same
sentences with tfm's own hand-written backward and Adam, and both are written as Hugging Face
writes them: config.json, model.safetensors (float32), tokenizer.json. The README's "Look
inside GPT-2" runs on it. Needs the hf extra: python -m pip install '.[hf]'

    python examples/tiny_gpt2.py [OUT_DIR]
"""

import json
import sys
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

import tfmcli
from tfmcli.sources.gpt2 import from_tfm
from tfmcli.train.optim import Adam, adam_step, warmup_lr

TEXT = ["The cat sat on the mat.", "The dog sat on the log.", "The cat saw the dog.",
        "The dog saw the cat.", "A bird sat on the cat.", "The mat was red."]
SIZES = dict(n_embd=32, n_head=4, n_layer=2, n_positions=16)


def make_tokenizer(vocab_size=320):
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(TEXT * 10, trainer)
    return tok


def train(tok, steps=400):
    rows = [tok.encode(line).ids for line in TEXT]
    inputs = tfmcli.inputs_from_tokens(rows)
    B, T = inputs.tokens.shape
    cfg = tfmcli.Config(batch=B, seq_len=T, d_model=SIZES["n_embd"], heads=SIZES["n_head"],
                        layers=SIZES["n_layer"], vocab=tok.get_vocab_size(),
                        lengths=tuple(inputs.lengths.tolist()), activation="gelu",
                        pe="learned", n_ctx=SIZES["n_positions"], tied_head=True,
                        head_bias=False, init="normal", seed=0)
    return fit(cfg, inputs, steps)


def fit(cfg, inputs, steps):
    """(parameters, loss): a model of ``cfg`` drawn and trained ``steps`` steps on ``inputs``
    with tfm's hand-written backward and Adam (``examples/tiny_llama.py`` trains its own so)."""
    params = tfmcli.init_params(cfg)
    state = Adam.like(params)
    for step in range(1, steps + 1):
        fwd = tfmcli.forward(params, inputs, cfg)
        adam_step(params, tfmcli.backward(params, fwd, cfg), state, 3 * warmup_lr(step, 32, 50))
    return params, tfmcli.forward(params, inputs, cfg).loss


def main(out):
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tok = make_tokenizer()
    params, loss = train(tok)
    tok.save(str(out / "tokenizer.json"))
    tensors = {name: value.astype(np.float32)
               for name, value in from_tfm(params, SIZES["n_layer"]).items()}
    save_file(tensors, str(out / "model.safetensors"))
    config = {"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"],
              "activation_function": "gelu_new", "layer_norm_epsilon": 1e-5,
              "vocab_size": tok.get_vocab_size(), "tie_word_embeddings": True, **SIZES}
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    print(f"wrote {out}: {sum(v.size for v in tensors.values()):,} parameters, "
          f"training loss {loss:.4f}")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else Path(__file__).parent / "tiny-gpt2")
