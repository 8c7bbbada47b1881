"""Make examples/tiny-llama/: a LLaMA checkpoint folder small enough to commit, trained by tfm.

A SentencePiece-style BPE tokenizer (spaces as '▁', unknown characters as their UTF-8 bytes
'<0x..>', '<s>' before every text, as LLaMA 2's) is trained on a few sentences with the
`tokenizers` library; a LLaMA-shaped model (RMSNorm, rotary attention with 2 key and value
heads for 4 query heads, a SwiGLU FFN, no biases, an untied head) is trained on the same
sentences with tfm's own hand-written backward and Adam; both are written as Hugging Face
writes them: config.json, model.safetensors in bfloat16 (as LLaMA checkpoints are), and
tokenizer.json. The README's "Look inside LLaMA" runs on it. Needs the hf extra:
python -m pip install '.[hf]'

    python examples/tiny_llama.py [OUT_DIR]
"""

import json
import sys
from pathlib import Path

from tiny_gpt2 import TEXT, fit  # the same six sentences, trained the same way
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

import tfmcli
from tfmcli.sources import llama, tensorfile

SPECIAL = ["<unk>", "<s>", "</s>"]   # ids 0, 1, 2, then the 256 bytes, as LLaMA 2 lays them out
SIZES = dict(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2,
             intermediate_size=64, max_position_embeddings=64)


def make_tokenizer(pieces=64):
    """BPE over '▁'-marked words with byte fallback; '<s>' is put before every text."""
    metaspace = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    trainer_tok = Tokenizer(models.BPE())
    trainer_tok.pre_tokenizer = metaspace
    trainer = trainers.BpeTrainer(vocab_size=pieces, special_tokens=[])
    trainer_tok.train_from_iterator(TEXT * 10, trainer)
    learned = json.loads(trainer_tok.to_str())["model"]
    vocab = {name: i for i, name in enumerate(SPECIAL + [f"<0x{b:02X}>" for b in range(256)])}
    for piece in sorted(learned["vocab"], key=learned["vocab"].get):
        vocab.setdefault(piece, len(vocab))
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in learned["merges"]]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True,
                               fuse_unk=True))
    tok.add_special_tokens(SPECIAL)
    tok.pre_tokenizer = metaspace
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                     decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    return tok


def fields(vocab: int) -> dict:
    """The tfm Config fields of this LLaMA."""
    return {"d_model": SIZES["hidden_size"], "heads": SIZES["num_attention_heads"],
            "kv_heads": SIZES["num_key_value_heads"], "layers": SIZES["num_hidden_layers"],
            "d_ff": SIZES["intermediate_size"], "vocab": vocab, "eps": 1e-5,
            "activation": "swiglu", "pe": "rope", "rms_norm": True, "bias": False,
            "tied_head": False, "head_bias": False}


def train(tok, steps=400, fields=fields):
    """(parameters, loss) of the model ``fields(vocab)`` describes, trained on the sentences
    (examples/tiny_gemma.py trains its own model so)."""
    rows = [tok.encode(line).ids for line in TEXT]
    inputs = tfmcli.inputs_from_tokens(rows)
    B, T = inputs.tokens.shape
    cfg = tfmcli.Config(batch=B, seq_len=T, lengths=tuple(inputs.lengths.tolist()),
                        init="normal", seed=0, **fields(tok.get_vocab_size()))
    return fit(cfg, inputs, steps)


def main(out):
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tok = make_tokenizer()
    params, loss = train(tok)
    tok.save(str(out / "tokenizer.json"))
    tensors = llama.from_tfm(params, fields(tok.get_vocab_size()))
    tensorfile.write(out / "model.safetensors", tensors, bfloat16=True, metadata={"format": "pt"})
    config = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_act": "silu",
              "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "attention_bias": False,
              "mlp_bias": False, "tie_word_embeddings": False, "bos_token_id": 1,
              "eos_token_id": 2, "torch_dtype": "bfloat16", "vocab_size": tok.get_vocab_size(),
              **SIZES}
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    print(f"wrote {out}: {sum(v.size for v in tensors.values()):,} parameters, "
          f"training loss {loss:.4f} (before bfloat16)")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else Path(__file__).parent / "tiny-llama")
