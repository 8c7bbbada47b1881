"""A GGUF file's tokenizer, from its own metadata (``tokenizer.ggml.*``), built with the
``tokenizers`` library as llama.cpp's ``llama-vocab.cpp`` reads the same keys:

- ``tokenizer.ggml.model`` "gpt2": byte-level BPE, the ``tokens`` and their ``merges``, the
  text split first by the pre-tokenizer that ``tokenizer.ggml.pre`` names. The name stands
  for a list of patterns that llama.cpp keeps in its source, not in the file; ``PRE`` holds
  llama.cpp's for the names the families tfm runs are written with (each pattern splits the
  pieces the one before made, as llama.cpp's ``unicode_regex_split`` does), and a name it does
  not hold is refused. ``llama-bpe`` (LLaMA 3) and ``tekken`` match whole words first
  (``ignore_merges``).
- "llama": SentencePiece, whose file keeps each piece's ``scores`` and no merges: two pieces
  whose joined text is a piece are merged, the best-scoring first (llama.cpp's
  ``llm_tokenizer_spm``; as a BPE, Hugging Face's merges made from the scores), a space is
  "▁" and one is put before the text (``tokenizer.ggml.add_space_prefix``, true by default),
  and a character no piece holds is its UTF-8 bytes' ``<0xNN>`` pieces.

``tokenizer.ggml.token_type`` marks the control pieces (``<s>``, ``<|endoftext|>``: special
tokens, which text may name) and the user-defined ones (added tokens);
``tokenizer.ggml.add_bos_token`` (true for SentencePiece and LLaMA 3 unless the file says
otherwise) puts ``bos_token_id`` first, as llama.cpp does.
"""

from __future__ import annotations

from tfmcli.errors import TfmError
from tfmcli.sources.folder import shown
from tfmcli.sources.gpt2 import INSTALL, MissingExtra
from tfmcli.sources.text import Tokenizer

NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6   # gguf.TokenType
CONTRACTIONS = "(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
LLAMA3 = (CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
          r"|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN2 = (CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
         r"|\s*[\r\n]+|\s+(?!\S)|\s+")
BLOOM = r" ?[^(\s|.,!?…。，、।۔،)]+"
# tokenizer.ggml.pre -> llama.cpp's patterns (llama-vocab.cpp, llm_tokenizer_bpe), in order
PRE = {
    "default": [r"[\p{P}\$\+<=>\^~\|]+", GPT2, r"\p{N}+", "[0-9][0-9][0-9]"],
    "gpt-2": [GPT2], "phi-2": [GPT2], "mpt": [GPT2], "olmo": [GPT2], "jais": [GPT2],
    "llama3": [LLAMA3], "llama-v3": [LLAMA3], "llama-bpe": [LLAMA3], "falcon3": [LLAMA3],
    "dbrx": [LLAMA3], "smaug-bpe": [LLAMA3],
    "qwen2": [QWEN2], "deepseek-r1-qwen": [QWEN2], "stablelm2": [QWEN2],
    "starcoder": [r"\p{N}", GPT2], "refact": [r"\p{N}", GPT2], "smollm": [r"\p{N}", GPT2],
    "command-r": [r"\p{N}", GPT2], "codeshell": [r"\p{N}", GPT2], "exaone": [r"\p{N}", GPT2],
    "falcon": [r"[\p{P}\$\+<=>\^~\|`]+", GPT2, "[0-9][0-9][0-9]"],
    "bloom": [BLOOM], "poro-chat": [BLOOM], "gpt3-finnish": [BLOOM],
    "tekken": [r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
               r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
               r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"],
}
IGNORE_MERGES = ("llama3", "llama-v3", "llama-bpe", "falcon3", "tekken")   # whole words first
BOS_BY_DEFAULT = IGNORE_MERGES   # (and every SentencePiece vocabulary)


class GgufTokenizer(Tokenizer):
    """``text.Tokenizer`` (encode, label) over a tokenizer built from a GGUF file's metadata."""

    def __init__(self, path, meta: dict):
        try:
            import tokenizers
        except ImportError:
            raise MissingExtra(f"--text needs the tokenizers package: {INSTALL}") from None
        self.path = path
        kind = meta["tokenizer.ggml.model"]
        tokens = _strings(path, meta, "tokenizer.ggml.tokens")
        types = meta.get("tokenizer.ggml.token_type")
        types = [NORMAL] * len(tokens) if types is None else [int(t) for t in types]
        if len(types) != len(tokens):
            raise TfmError(f"--load {path}: key 'tokenizer.ggml.token_type' has {len(types)} "
                           f"entries for {len(tokens)} tokens")
        if kind == "gpt2":
            self._tok, add_bos = _byte_level_bpe(path, meta, tokens, tokenizers)
        elif kind == "llama":
            self._tok, add_bos = _sentencepiece(path, meta, tokens, types, tokenizers), True
        else:
            raise TfmError(f"--load {path}: key 'tokenizer.ggml.model' is {shown(kind)}; tfm "
                           f"reads 'gpt2' (byte-level BPE) and 'llama' (SentencePiece) "
                           f"tokenizers")
        _special(self._tok, tokens, types, tokenizers)
        add_bos = meta.get("tokenizer.ggml.add_bos_token", add_bos)
        bos = meta.get("tokenizer.ggml.bos_token_id")
        if add_bos is True and bos is not None and 0 <= bos < len(tokens):
            from tokenizers import processors

            self._tok.post_processor = processors.TemplateProcessing(
                single=f"{tokens[bos]} $A", special_tokens=[(tokens[bos], int(bos))])

    def encode(self, text: str, add_special: bool = True) -> list[int]:
        """The ids of ``text``: with ``add_special``, as llama.cpp's ``llama_tokenize`` with
        ``add_special`` (the BOS first when the file says so)."""
        return list(self._tok.encode(text, add_special_tokens=add_special).ids)


def _strings(path, meta: dict, key: str) -> list[str]:
    value = meta.get(key)
    if not isinstance(value, list) or not all(isinstance(s, str) for s in value):
        raise TfmError(f"--load {path}: key {key!r} is {shown(value)}, not a list of strings")
    return value


def _byte_level_bpe(path, meta: dict, tokens: list, tokenizers):
    from tokenizers import Regex, decoders, models, pre_tokenizers

    pre = meta.get("tokenizer.ggml.pre", "default")
    if pre not in PRE:
        names = sorted(PRE)
        raise TfmError(f"--load {path}: key 'tokenizer.ggml.pre' is {shown(pre)}, a pre-tokenizer "
                       f"tfm does not know (it knows {', '.join(names[:-1])} and {names[-1]}, "
                       f"as llama.cpp writes them)")
    merges = []
    for merge in _strings(path, meta, "tokenizer.ggml.merges"):
        left, space, right = merge.partition(" ")
        if not space:
            raise TfmError(f"--load {path}: key 'tokenizer.ggml.merges' has {shown(merge)}, "
                           f"not two pieces separated by a space")
        merges.append((left, right))
    vocab = {}
    for i, token in enumerate(tokens):
        vocab.setdefault(token, i)
    try:
        model = models.BPE(vocab, merges, ignore_merges=pre in IGNORE_MERGES)
    except Exception as e:   # the package raises plain Exception: a merge of unknown pieces
        raise TfmError(f"--load {path}: its merges do not fit its tokens ({e})") from None
    tok = tokenizers.Tokenizer(model)
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(pattern), "isolated") for pattern in PRE[pre]]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    return tok, pre in BOS_BY_DEFAULT


def _sentencepiece(path, meta: dict, tokens: list, types: list, tokenizers):
    from tokenizers import decoders, models, normalizers

    scores = meta.get("tokenizer.ggml.scores")
    if scores is None or len(scores) != len(tokens):
        raise TfmError(f"--load {path}: key 'tokenizer.ggml.scores' has "
                       f"{'no' if scores is None else len(scores)} entries for {len(tokens)} "
                       f"tokens (a SentencePiece vocabulary scores each piece)")
    vocab = {}
    for i, token in enumerate(tokens):
        vocab.setdefault(token, i)
    unk = meta.get("tokenizer.ggml.unknown_token_id", 0)
    model = models.BPE(vocab, merges_from_scores(tokens, scores, types, vocab),
                       unk_token=tokens[unk] if 0 <= unk < len(tokens) else None,
                       byte_fallback=True, fuse_unk=True)
    tok = tokenizers.Tokenizer(model)
    space = [normalizers.Replace(" ", "\u2581")]
    if meta.get("tokenizer.ggml.add_space_prefix", True):
        space.insert(0, normalizers.Prepend("\u2581"))
    tok.normalizer = normalizers.Sequence(space)
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(),
                                     decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    return tok


def merges_from_scores(tokens: list, scores, types: list, vocab: dict) -> list:
    """SentencePiece's merges, which its file does not keep: every split of a piece into two
    pieces, the best-scoring piece's first (Hugging Face's ``SentencePieceExtractor``; within a
    piece, by the two parts' ids). A control, unused or byte piece is made by no merge."""
    merges = []
    for i, piece in enumerate(tokens):
        if types[i] not in (NORMAL, USER_DEFINED) or len(piece) < 2:
            continue
        local = [(vocab[piece[:k]], vocab[piece[k:]]) for k in range(1, len(piece))
                 if piece[:k] in vocab and piece[k:] in vocab]
        merges.extend((-float(scores[i]), left, right) for left, right in sorted(local))
    merges.sort(key=lambda merge: merge[0])   # (stable: equal scores keep the pieces' order)
    return [(tokens[left], tokens[right]) for _, left, right in merges]


def _special(tok, tokens: list, types: list, tokenizers) -> None:
    """Control pieces as special tokens and user-defined ones as added tokens: text that
    names one is that one token, as in Hugging Face's tokenizer of the same model."""
    control = [tokens[i] for i, kind in enumerate(types) if kind == CONTROL]
    user = [tokens[i] for i, kind in enumerate(types) if kind == USER_DEFINED]
    if control:
        tok.add_special_tokens([tokenizers.AddedToken(t, special=True, normalized=False)
                                for t in control])
    if user:
        tok.add_tokens([tokenizers.AddedToken(t, normalized=False) for t in user])
