"""``--arch NAME``: the architecture of a checkpoint family at toy size.

A preset is the Config fields that the family's reader (``sources.<family>.read_config``) makes
from that family's ``config.json`` with Hugging Face's defaults, the sizes left to tfm's toy
defaults (d 6, H 2, one block). A few fields depend on the sizes and are worked out from them:
the part of each head that RoPE turns, and which blocks slide. Flags typed on the command line
override the preset; ``tests/test_presets.py`` holds each preset to its family's reader.
"""

from __future__ import annotations

from dataclasses import dataclass

from tfmcli.engine.config import Config

# RoPE families share these; LLaMA's rms_norm_eps default is 1e-6
_ROPE = dict(pe="rope", head_bias=False)
_LLAMA = dict(_ROPE, activation="swiglu", rms_norm=True, bias=False, eps=1e-6)
_GEMMA = dict(_LLAMA, activation="geglu", tied_head=True, embed_scale=True)
SLIDING_WINDOW = 3   # at toy length (T = 4) a window of 3 hides one key of the last query


@dataclass(frozen=True)
class Preset:
    family: str                    # what a person calls it: "Gemma 2"
    fields: dict                   # Config fields, the same at every size
    rotary_fraction: float = 1.0   # of each head's width that RoPE turns (partial_rotary_factor)
    sliding_every: int = 0         # one block in this many sees every key; the others slide


PRESETS = {
    "vaswani": Preset("the Transformer paper",
                      dict(norm="post", embed_scale=True, tied_head=True, head_bias=False)),
    "gpt2": Preset("GPT-2", dict(activation="gelu", pe="learned", tied_head=True,
                                 head_bias=False)),
    "llama": Preset("LLaMA", dict(_LLAMA)),
    "mistral": Preset("Mistral", dict(_LLAMA, kv_heads=1, sliding_window=SLIDING_WINDOW)),
    "qwen2": Preset("Qwen2, Qwen2.5", dict(_LLAMA, qkv_bias=True)),
    "qwen3": Preset("Qwen3", dict(_LLAMA, qk_norm=True)),
    "gemma": Preset("Gemma", dict(_GEMMA)),
    "gemma2": Preset("Gemma 2", dict(_GEMMA, kv_heads=1, sandwich_norm=True, attn_softcap=50.0,
                                     logit_softcap=30.0, sliding_window=SLIDING_WINDOW),
                     sliding_every=2),
    "gemma3": Preset("Gemma 3", dict(_GEMMA, kv_heads=1, sandwich_norm=True, qk_norm=True,
                                     rope_theta=1000000.0, rope_local_theta=10000.0,
                                     sliding_window=SLIDING_WINDOW),
                     sliding_every=6),
    "phi3": Preset("Phi-3", dict(_LLAMA, eps=1e-5)),
    "stablelm": Preset("StableLM", dict(_ROPE, activation="swiglu", bias=False),
                       rotary_fraction=0.25),
    "gpt_neox": Preset("GPT-NeoX, Pythia", dict(_ROPE, activation="gelu_erf",
                                                 parallel_residual=True),
                       rotary_fraction=0.25),
    "phi": Preset("Phi-1.5, Phi-2", dict(pe="rope", activation="gelu", parallel_residual=True,
                                         shared_norm=True),
                  rotary_fraction=0.5),
    "gptj": Preset("GPT-J", dict(pe="rope", activation="gelu", bias=False, ffn_bias=True,
                                 parallel_residual=True, shared_norm=True),
                   rotary_fraction=0.25),
    "codegen": Preset("CodeGen", dict(pe="rope", activation="gelu", bias=False, ffn_bias=True,
                                      parallel_residual=True, shared_norm=True),
                      rotary_fraction=0.25),
    "opt": Preset("OPT", dict(pe="learned", tied_head=True, head_bias=False)),
    "falcon": Preset("Falcon", dict(_ROPE, activation="gelu_erf", bias=False, tied_head=True,
                                    parallel_residual=True, shared_norm=True, kv_heads=1)),
    "gpt_bigcode": Preset("StarCoder (GPTBigCode)",
                          dict(activation="gelu", pe="learned", tied_head=True, head_bias=False,
                               kv_heads=1)),
    "bloom": Preset("BLOOM", dict(activation="gelu", pe="alibi", embed_norm=True, tied_head=True,
                                  head_bias=False)),
    "mpt": Preset("MPT", dict(activation="gelu_erf", pe="alibi", norm_bias=False, bias=False,
                              tied_head=True, head_bias=False)),
}
NAMES = tuple(PRESETS)
OFF = {"tied_head": "--untied-head", "rms_norm": "--layer-norm"}


def preset_fields(name: str, sizes: dict) -> dict:
    """The Config fields of preset ``name`` for a model of these sizes (``d_model``, ``heads``,
    ``head_dim``, ``layers``; tfm's defaults where missing). KeyError for an unknown name."""
    preset = PRESETS[name]
    fields = dict(preset.fields)
    if preset.rotary_fraction < 1:
        default = Config()
        d_head = sizes.get("head_dim") or (sizes.get("d_model", default.d_model)
                                           // sizes.get("heads", default.heads))
        turned = 2 * max(1, round(preset.rotary_fraction * d_head / 2))
        fields["rotary_dim"] = min(turned, d_head - d_head % 2)
    if preset.sliding_every:
        layers, every = sizes.get("layers", Config().layers), preset.sliding_every
        # Gemma 2 slides blocks 0, 2, 4, ...; Gemma 3 five of each six (block 5, 11, ... do not)
        sliding = tuple(i for i in range(layers) if i % every != every - 1)
        fields["sliding_layers"] = None if len(sliding) == layers else sliding
    return fields


def describe(name: str) -> str:
    """One line: the family and the flags the preset sets, as a person would type them."""
    from dataclasses import fields as config_fields

    preset = preset_fields(name, {})
    flags = []
    for key in (f.name for f in config_fields(Config) if f.name in preset):
        value = preset[key]
        flag = "--" + key.replace("_", "-")
        if value is True:
            flags.append(flag)
        elif value is False:   # (the switches whose off form is not --no-x)
            flags.append(OFF.get(key, "--no-" + key.replace("_", "-")))
        elif value is not None:
            flags.append(f"{flag} {value:g}" if isinstance(value, float) else f"{flag} {value}")
    if PRESETS[name].rotary_fraction < 1:
        flags.append(f"(RoPE on {PRESETS[name].rotary_fraction:g} of each head)")
    if PRESETS[name].sliding_every:
        flags.append(f"(one block in {PRESETS[name].sliding_every} sees every key)")
    return " ".join(flags)
