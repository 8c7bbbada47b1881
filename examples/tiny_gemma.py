"""Make examples/tiny-gemma/: a Gemma checkpoint folder small enough to commit, trained by tfm.

The tokenizer is examples/tiny_llama.py's (a SentencePiece-style BPE with byte fallback, '<s>'
before every text, as Gemma's is of the same kind); the model is Gemma-shaped: RMSNorm whose
stored weights are offsets from 1, rotary attention with one key and value head for 4 query
heads 16 wide on a width of 32, a GeGLU FFN, the embedding times sqrt(32) and the head tied to
it, no biases. It is trained on the same sentences with tfm's own hand-written backward and
Adam, and written as Hugging Face writes a Gemma: config.json, model.safetensors in bfloat16,
and tokenizer.json. The README's "Gemma" runs on it. Needs the hf extra:
python -m pip install '.[hf]'

    python examples/tiny_gemma.py [OUT_DIR]
"""

import json
import sys
from pathlib import Path

from tiny_llama import make_tokenizer, train  # the same six sentences, trained the same way

from tfmcli.sources import gemma, tensorfile

SIZES = dict(hidden_size=32, num_attention_heads=4, num_key_value_heads=1, head_dim=16,
             num_hidden_layers=2, intermediate_size=64, max_position_embeddings=64)


def fields(vocab: int) -> dict:
    """The tfm Config fields of this Gemma."""
    return {"d_model": SIZES["hidden_size"], "heads": SIZES["num_attention_heads"],
            "kv_heads": SIZES["num_key_value_heads"], "head_dim": SIZES["head_dim"],
            "layers": SIZES["num_hidden_layers"], "d_ff": SIZES["intermediate_size"],
            "vocab": vocab, "eps": 1e-6, "activation": "geglu", "pe": "rope", "rms_norm": True,
            "bias": False, "tied_head": True, "head_bias": False, "embed_scale": True}


def main(out):
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tok = make_tokenizer()
    params, loss = train(tok, fields=fields)
    tok.save(str(out / "tokenizer.json"))
    tensors = gemma.from_tfm(params, fields(tok.get_vocab_size()))
    tensorfile.write(out / "model.safetensors", tensors, bfloat16=True, metadata={"format": "pt"})
    config = {"model_type": "gemma", "architectures": ["GemmaForCausalLM"],
              "hidden_act": "gelu_pytorch_tanh", "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
              "attention_bias": False, "tie_word_embeddings": True, "bos_token_id": 1,
              "eos_token_id": 2, "pad_token_id": None, "torch_dtype": "bfloat16",
              "vocab_size": tok.get_vocab_size(), **SIZES}
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    print(f"wrote {out}: {sum(v.size for v in tensors.values()):,} parameters, "
          f"training loss {loss:.4f} (before bfloat16)")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else Path(__file__).parent / "tiny-gemma")
