"""Shared test helpers: running the CLI, reading its one-line errors, random O(1) parameters,
and printing a view to a plain or a colour console."""

from __future__ import annotations

import io
import json
import re

import numpy as np
import pytest
from rich.console import Console
from typer.testing import CliRunner

from tfmcli.cli import app

runner = CliRunner()


def run(*args):
    return runner.invoke(app, [str(a) for a in args])


def ok(*args):
    skip_without_oracle(args)
    result = run(*args)
    assert result.exit_code == 0, result.output
    return result


def skip_without_oracle(args) -> None:
    """A run that succeeds only with an oracle installed skips without it: `tfm check` runs
    the model again in PyTorch (its only --against). CI installs the oracles and fails on
    any such skip (.ci/run); the README's test command, on a machine without them, passes."""
    words = [str(a) for a in args]
    if words[:1] == ["check"] and not {"--help", "-h"} & set(words):
        pytest.importorskip("torch", reason="tfm check runs the model in PyTorch: no torch")
    if any(word.endswith(".gguf") for word in words):   # the gguf extra, which CI installs
        pytest.importorskip("gguf", reason="a GGUF file is read with the gguf package: no gguf")


def assert_scaled_close(actual, desired, rel: float = 1e-12, floor: float = 0.0):
    """``actual`` equals ``desired`` to ``rel`` of the tensor's scale (its largest magnitude),
    or to ``floor`` where that is more (a tensor that is rounding noise about 0): a bound every
    CPU meets, whatever its BLAS kernel rounds in the last bits (a per-entry 1e-14 missed by
    1.1e-14 on an AVX-512 machine), and still far below any wrong formula's error. Shapes must
    agree; without a floor, a desired tensor of zeros must be matched exactly."""
    actual, desired = np.asarray(actual, dtype=np.float64), np.asarray(desired, dtype=np.float64)
    assert actual.shape == np.broadcast_shapes(actual.shape, desired.shape), (
        actual.shape, desired.shape)
    scale = float(np.abs(desired).max()) if desired.size else 0.0
    err = float(np.abs(actual - desired).max()) if desired.size else 0.0
    assert err <= max(rel * scale, floor), f"off by {err:.3g}, the tensor's scale {scale:.3g}"


def error_line(result, code):
    """The single stderr line of a failed run (and that it is single, with the right code)."""
    assert result.exit_code == code, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert "Traceback" not in result.output
    return lines[0]


def random_params(params: dict, seed: int = 0) -> dict:
    """Every parameter redrawn at O(1): weights, and gammas, betas and biases too.

    At initial weights every gamma is 1 and every bias 0, and a mistake in those terms of a
    gradient hides; here gammas are drawn in [0.5, 1.5] and everything else from N(0, 0.5).
    """
    rng = np.random.default_rng(seed)
    out = {}
    for name, value in params.items():
        if name.endswith("gamma"):
            new = rng.uniform(0.5, 1.5, value.shape)
        else:
            new = rng.normal(0.0, 0.5, value.shape)
        out[name] = new.astype(value.dtype)
    return out


# ---------------------------------------------------------------- views

ANSI = re.compile(r"\x1b\[[0-9;]*m")


@pytest.fixture(autouse=True)
def plain_environment(monkeypatch):
    """In a test file that imports it: no colour variable or width from the environment."""
    for name in ("NO_COLOR", "FORCE_COLOR", "COLUMNS"):
        monkeypatch.delenv(name, raising=False)


def render(renderable, width=80) -> str:
    console = Console(file=io.StringIO(), width=width, color_system=None)
    console.print(renderable)
    return console.file.getvalue()


def render_colour(renderable, width=80) -> str:
    console = Console(file=io.StringIO(), width=width, color_system="truecolor",
                      force_terminal=True)
    console.print(renderable)
    return console.file.getvalue()


def grid_rows(text: str, labels) -> list[list[str]]:
    """The cells of the body lines that start with one of ``labels``, split on whitespace.

    The body is what follows a table's header rule, or a heatmap's first (column label) line.
    """
    lines = text.splitlines()
    rules = [i for i, line in enumerate(lines) if line.strip().startswith("─")]
    rows = []
    for line in lines[rules[0] + 1 if rules else 1:]:
        parts = line.split()
        if parts and parts[0] in labels:
            rows.append(parts[1:])
    return rows


# ---------------------------------------------------------------- Hugging Face oracles


def float64_rotary(rotary, d_rot: int, base: float = 10000.0, scaling=None) -> None:
    """Have a Hugging Face rotary module make its (cos, sin) in float64: LLaMA, StableLM and
    GPT-NeoX make them in float32 whatever the model's dtype, which holds a float64 model to
    about 1e-8. The same layout (each angle twice, ``cat((freqs, freqs))``), base and scaling
    (LLaMA 3.1's, ``positional.rope_scale``): the module's own frequencies, which Hugging Face
    computed in float32 from its config, are first checked equal to these to float32's
    rounding."""
    inv_freq = float64_inv_freq(d_rot, base, scaling)
    np.testing.assert_allclose(rotary.inv_freq.double().numpy(), inv_freq.numpy(), rtol=1e-6)

    def tables(x, position_ids):
        return rope_cos_sin(position_ids, inv_freq)

    rotary.forward = tables


def float64_inv_freq(d_rot: int, base: float, scaling=None):
    """RoPE's inverse frequencies in float64 as Hugging Face lays them out, ``1 / base^(arange(0,
    d_rot, 2) / d_rot)``, times each pair's scale (``positional.rope_scale``: LLaMA 3.1's, or
    linear's 1 / factor)."""
    import torch

    from tfmcli.engine import positional

    inv_freq = 1.0 / float(base) ** (torch.arange(0, d_rot, 2, dtype=torch.float64) / d_rot)
    if scaling is not None:
        inv_freq = inv_freq * torch.from_numpy(positional.rope_scale(d_rot, base, scaling))
    return inv_freq


def rope_cos_sin(position_ids, inv_freq):
    """(cos, sin) of each position's angles, each angle twice (``cat((freqs, freqs))``)."""
    import torch

    freqs = position_ids[..., None].double() * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


def float64_rotary_by_layer_type(rotary, cfg) -> None:
    """``float64_rotary`` for Gemma 3's rotary module, which keeps one set of frequencies a
    layer type (``full_attention_inv_freq``, ``sliding_attention_inv_freq``): each at the base
    and scaling tfm gives a block of that type (``Config.rope``)."""
    blocks = {"full_attention": [i for i in range(cfg.layers) if cfg.window(i) is None],
              "sliding_attention": [i for i in range(cfg.layers) if cfg.window(i) is not None]}
    inv_freqs = {}
    for kind, chosen in blocks.items():
        if chosen:
            inv_freqs[kind] = float64_inv_freq(cfg.d_head, *cfg.rope(chosen[0]))
            np.testing.assert_allclose(getattr(rotary, kind + "_inv_freq").double().numpy(),
                                       inv_freqs[kind].numpy(), rtol=1e-6)

    def tables(x, position_ids, layer_type):
        return rope_cos_sin(position_ids, inv_freqs[layer_type])

    rotary.forward = tables


def o1_gpt2(config, folder):
    """Hugging Face's GPT2LMHeadModel of ``config`` in float64 at O(1) parameters (gammas near
    1, every bias drawn), saved to ``folder``, eager attention, in eval mode."""
    import torch
    import transformers

    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config).to(torch.float64)
    with torch.no_grad():
        generator = torch.Generator().manual_seed(1)
        for name, p in model.named_parameters():
            centre = 1.0 if name.endswith(("ln_1.weight", "ln_2.weight", "ln_f.weight")) else 0.0
            p.copy_(centre + 0.3 * torch.randn(p.shape, generator=generator, dtype=torch.float64))
    model.save_pretrained(folder)
    model.config._attn_implementation = "eager"
    return model.eval()


def tfm_grads_matching_hf(model, params, inputs, cfg) -> dict:
    """tfm's forward and backward against a Hugging Face causal LM that holds the same
    parameters, on tfm's inputs (padding as its attention mask, the mean cross-entropy over
    tfm's scored positions): the loss to 1e-12 relative, every scored position's logits to
    1e-12. Returns tfm's gradients; the model's are left in its parameters' ``.grad``."""
    import torch

    import tfmcli

    fwd = tfmcli.forward(params, inputs, cfg)
    grads = tfmcli.backward(params, fwd, cfg)
    keys = np.arange(cfg.seq_len)[None] < inputs.lengths[:, None]
    logits = model(input_ids=torch.as_tensor(inputs.tokens),
                   attention_mask=torch.as_tensor(keys).long()).logits
    valid = (inputs.targets != tfmcli.IGNORE) & keys
    scored = torch.as_tensor(valid)
    loss = torch.nn.functional.cross_entropy(logits[scored],
                                             torch.as_tensor(inputs.targets)[scored])
    loss.backward()
    assert fwd.loss == pytest.approx(loss.item(), rel=1e-12)
    np.testing.assert_allclose(fwd.acts["logits"][valid], logits[scored].detach().numpy(),
                               rtol=0, atol=1e-12)
    return grads


def hf_logits(model, inputs, cfg) -> tuple:
    """(logits (B, T, V) as float64 NumPy, keys (B, T) bool): a Hugging Face causal LM's logits
    on tfm's inputs, their padding as its attention mask, and which positions are real."""
    import torch

    keys = np.arange(cfg.seq_len)[None] < inputs.lengths[:, None]
    logits = model(input_ids=torch.as_tensor(inputs.tokens),
                   attention_mask=torch.as_tensor(keys).long()).logits
    return logits.detach().numpy(), keys


def unpatched_logits_off(Model, folder, tokens) -> float:
    """How far Hugging Face's float64 ``Model.from_pretrained(folder)``, as it is, puts its
    logits from tfm's run of the folder on ``tokens``: the largest difference over the real
    positions, relative to tfm's largest logit there."""
    import torch

    import tfmcli

    loaded = tfmcli.load(folder, tokens=tokens)
    model = Model.from_pretrained(folder).double().eval()
    with torch.no_grad():
        theirs, keys = hf_logits(model, loaded.inputs, loaded.cfg)
    ours = tfmcli.forward(loaded.params, loaded.inputs, loaded.cfg).acts["logits"]
    return float(np.abs(theirs - ours)[keys].max() / np.abs(ours[keys]).max())


def assert_grads_match(grads, theirs: dict) -> None:
    """Each of ``theirs`` (name -> array) within 1e-12 of its largest entry of tfm's; b_K's,
    whose exact value is 0 (a shift of every key leaves each softmax as it was), within 1e-12 of
    the largest gradient of all, both sides holding only rounding."""
    largest = max(np.abs(grad).max() for grad in theirs.values())
    for name, grad in theirs.items():
        scale = largest if name.endswith("attn.b_K") else np.abs(grad).max()
        np.testing.assert_allclose(grads[name], grad, rtol=0, atol=1e-12 * scale, err_msg=name)


def assert_folder_matches_hf(Model, folder, run_, to_float64=None, grads_of=None,
                             attention: str | None = "sdpa"):
    """Hugging Face's ``Model.from_pretrained(folder)`` (``attention``: its kernel; None, its
    default) made float64 by ``to_float64`` (``in_float64``, or ``float64_gemma``), against
    tfm's ``run_`` of the same folder: loss, logits (``tfm_grads_matching_hf``) and every
    gradient ``grads_of(model)`` gives (``llama_grads``, or ``sandwich_grads``) to 1e-12.
    Returns the model."""
    kwargs = {} if attention is None else {"attn_implementation": attention}
    model = Model.from_pretrained(folder, **kwargs).double().eval()
    model = (to_float64 or in_float64)(model, run_.cfg)
    grads = tfm_grads_matching_hf(model, run_.params, run_.inputs, run_.cfg)
    assert_grads_match(grads, (grads_of or llama_grads)(model))
    return model


def assert_gradcheck_passes(cfg, seed: int = 4):
    """Central differences on every entry of every parameter at random O(1) parameters
    (``seed``) agree with the backward (``tfmcli.gradcheck``); returns the report."""
    import tfmcli

    report = tfmcli.gradcheck(random_params(tfmcli.init_params(cfg), seed=seed),
                              tfmcli.make_inputs(cfg), cfg)
    assert report.passed, [(c.name, c.rel_err) for c in report.params if not c.passed]
    assert report.worst.rel_err < 1e-6 and report.checked == report.entries
    return report


def decoded_like_the_forward(cfg, seed: int, tokens) -> tuple:
    """``tfmcli.engine.kv.decode`` of ``tokens`` at random parameters (``seed``): every step's
    logits
    equal the full causal forward's at its position, to 1e-12. Returns (params, steps, fwd)."""
    import tfmcli

    params = random_params(tfmcli.init_params(cfg), seed=seed)
    steps = tfmcli.engine.kv.decode(params, tokens, cfg)
    fwd = tfmcli.forward(params, tfmcli.inputs_from_tokens([tokens]), cfg)
    np.testing.assert_allclose(np.array([s.logits for s in steps]), fwd.acts["logits"][0],
                               rtol=0, atol=1e-12)
    return params, steps, fwd


def assert_fast_equals_reference(cfg, params, inputs) -> tuple | None:
    """The fast path's loss and parameter gradients against the reference's, to 1e-12 (b_K's
    and k_norm.beta's, 0 but for rounding, against the largest gradient); returns both runs'
    gradients. In float32 the two losses alone, to 1e-5 (None returned)."""
    import tfmcli

    fast = tfmcli.forward(params, inputs, cfg)
    slow = tfmcli.forward(params, inputs, cfg, fast=False)
    if cfg.dtype == "float32":
        assert fast.loss == pytest.approx(slow.loss, rel=1e-5)
        return None
    assert fast.loss == pytest.approx(slow.loss, rel=1e-12)
    g_fast, g_slow = tfmcli.backward(params, fast, cfg), tfmcli.backward(params, slow, cfg)
    largest = max(np.abs(g).max() for g in g_slow.values())
    for name in params:
        zero = name.endswith(("attn.b_K", "attn.k_norm.beta"))   # a shift of every key
        scale = largest if zero else np.abs(g_slow[name]).max()
        assert np.abs(g_fast[name] - g_slow[name]).max() <= 1e-12 * scale, name
    return g_fast, g_slow


def llama_from(params, cfg, qwen2: bool = False, mistral: bool = False, qwen3: bool = False):
    """Hugging Face's LlamaForCausalLM (RMSNorm, rotary attention, a SwiGLU MLP;
    ``attention_bias`` and ``mlp_bias`` tfm's ``bias``, ``num_key_value_heads`` its ``h_kv``,
    ``head_dim`` its ``d_head``, ``rope_theta``, ``rope_scaling`` and ``tie_word_embeddings``
    its own) holding tfm's
    parameters, in float64, or with ``qwen2`` Qwen2ForCausalLM (biases on q, k, v only: tfm's
    ``qkv_bias``; every layer sliding when tfm's ``sliding_window`` is set), or with ``mistral``
    MistralForCausalLM (no biases, tfm's ``sliding_window`` its own), or with ``qwen3``
    Qwen3ForCausalLM (no biases, tfm's ``qk_norm``: ``q_norm`` and ``k_norm`` in every layer),
    its RMSNorm and RoPE angles too (``in_float64``)."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")

    d = cfg.d_model
    assert cfg.qk_norm == qwen3   # only Qwen3 normalises its queries and keys
    if qwen2 or qwen3:
        Config, Model = ((transformers.Qwen3Config, transformers.Qwen3ForCausalLM) if qwen3 else
                         (transformers.Qwen2Config, transformers.Qwen2ForCausalLM))
        extra = ({} if cfg.sliding_window is None else   # from layer 0 on: every layer slides
                 dict(use_sliding_window=True, sliding_window=cfg.sliding_window,
                      max_window_layers=0))
        assert not (qwen3 and (cfg.bias or cfg.qkv_bias))
    elif mistral:
        Config, Model = transformers.MistralConfig, transformers.MistralForCausalLM
        extra = dict(sliding_window=cfg.sliding_window)
        assert not cfg.bias
    else:
        Config, Model = transformers.LlamaConfig, transformers.LlamaForCausalLM
        extra = dict(attention_bias=cfg.bias, mlp_bias=cfg.bias)
        assert cfg.sliding_window is None   # LLaMA has none
    config = Config(
        vocab_size=cfg.vocab, hidden_size=d, num_hidden_layers=cfg.layers,
        num_attention_heads=cfg.heads, num_key_value_heads=cfg.h_kv,
        intermediate_size=cfg.ff, hidden_act="silu", max_position_embeddings=64,
        rms_norm_eps=cfg.eps, tie_word_embeddings=cfg.tied_head, head_dim=cfg.d_head, **extra,
        rope_parameters=({"rope_type": "default", "rope_theta": cfg.rope_theta}
                         if cfg.rope_scaling is None else
                         {"rope_type": "llama3", "rope_theta": cfg.rope_theta,
                          **cfg.rope_scaling.to_dict()}))   # linear's names its own type
    assert not cfg.head_bias   # LLaMA's head has none
    config._attn_implementation = "sdpa"   # torch's own kernel: the softmax stays in float64
    model = Model(config).double().eval()
    t = {name: torch.tensor(np.asarray(v, dtype=np.float64)) for name, v in params.items()}
    state = {"model.embed_tokens.weight": t["embed.W_E"], "model.norm.weight": t["ln_f.gamma"],
             "lm_head.weight": t["embed.W_E"] if cfg.tied_head else t["head.W_U"].T}
    for i in range(cfg.layers):
        p, n = f"blocks.{i}.", f"model.layers.{i}."
        state.update({n + "input_layernorm.weight": t[p + "ln1.gamma"],
                      n + "post_attention_layernorm.weight": t[p + "ln2.gamma"]})
        for w, name in zip("QKVO", ("q_proj", "k_proj", "v_proj", "o_proj")):
            state[n + f"self_attn.{name}.weight"] = t[p + f"attn.W_{w}"].T
            if p + f"attn.b_{w}" in t:
                state[n + f"self_attn.{name}.bias"] = t[p + f"attn.b_{w}"]
        if qwen3:
            state.update({n + f"self_attn.{norm}.weight": t[p + f"attn.{norm}.gamma"]
                          for norm in ("q_norm", "k_norm")})
        for w, name in (("gate", "gate_proj"), ("1", "up_proj"), ("2", "down_proj")):
            state[n + f"mlp.{name}.weight"] = t[p + f"ffn.W_{w}"].T
            if cfg.bias:
                state[n + f"mlp.{name}.bias"] = t[p + f"ffn.b_{w}"]
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and all("rotary" in m for m in missing), missing
    return in_float64(model, cfg)


def rewrite_config(folder, **change) -> dict:
    """The folder's config.json with ``change`` applied (a value of None: the key removed)."""
    config = json.loads((folder / "config.json").read_text())
    config.update(change)
    config = {key: value for key, value in config.items() if value is not None}
    (folder / "config.json").write_text(json.dumps(config))
    return config


def hf_saved(folder, name: str, config: dict, dtype: str = "bfloat16", seed: int = 0,
             config_class: str | None = None) -> dict:
    """A random Hugging Face ``{name}ForCausalLM`` (``name``: "Mistral", "Qwen2", "Qwen3", ...)
    of ``config`` (a ``{name}Config``, or ``config_class``: Gemma 3's is "Gemma3TextConfig"),
    its weights drawn O(1) and its norms' gains about 1, saved in ``dtype`` by its own
    ``save_pretrained``; returns its state in float64 under Hugging Face's names."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(seed)
    Model = getattr(transformers, name + "ForCausalLM")
    Config = getattr(transformers, config_class or name + "Config")
    model = Model(Config(**config))
    with torch.no_grad():
        for key, p in model.named_parameters():
            p.normal_(0.0, 0.5)
            if key.endswith("norm.weight"):
                p.add_(1.0)
    model = model.to(getattr(torch, dtype))
    model.save_pretrained(folder)
    return {k: v.double().numpy() for k, v in model.state_dict().items()}


def assert_written_back(module, folder) -> dict:
    """A checkpoint module's ``from_tfm`` of what its ``load_params`` read from ``folder`` (a
    float32 folder, whose values float64 holds exactly) is the stored file's keys and tensors,
    bit for bit. Returns the folder's config fields."""
    from safetensors.numpy import load_file

    fields = module.read_config(folder)
    back = module.from_tfm(module.load_params(folder, fields, np.float64), fields)
    stored = load_file(folder / "model.safetensors")
    assert sorted(back) == sorted(stored)
    for key, value in back.items():
        np.testing.assert_array_equal(value, stored[key], err_msg=key)
    return fields


def assert_bad_weight_named(module, folder, key: str, shape, reason: str,
                            extra: dict | None = None) -> None:
    """A checkpoint module's float32 ``folder`` written back (``from_tfm``) with ``key`` left out
    (``shape`` None) or cut to its first ``shape[0]`` rows, and ``extra`` tensors added (a
    buffer the reader skips): ``tfm forward --load`` fails with one line, exit 1, ending in
    ``reason``."""
    from tfmcli.sources import tensorfile

    fields = module.read_config(folder)
    tensors = module.from_tfm(module.load_params(folder, fields, np.float32), fields)
    if shape is None:
        del tensors[key]
    else:
        tensors[key] = tensors[key][:shape[0]]
    tensors.update(extra or {})
    tensorfile.write(folder / "model.safetensors", tensors)
    assert error_line(run("forward", "--load", folder, "--tokens", "1,2,3"), 1).endswith(reason)


def in_float64(model, cfg):
    """A LLaMA, Qwen2, Mistral, Qwen3, Phi3 or StableLm ForCausalLM (float64 weights) with its
    RMSNorm (Qwen3's q_norm and k_norm too) and RoPE angles made in float64: both make them in
    float32 whatever the model's dtype. Its norm is first checked against tfm's to float32's
    rounding. StableLM's ``nn.LayerNorm`` is float64's already."""
    import torch

    from tfmcli.engine import ops

    float64_rotary(model.model.rotary_emb, cfg.rope_width, cfg.rope_theta, cfg.rope_scaling)
    if not cfg.rms_norm:
        assert type(model.model.norm) is torch.nn.LayerNorm
        return model
    norm = model.model.norm
    x = torch.tensor(np.random.default_rng(0).normal(size=(3, cfg.d_model)))
    gamma = norm.weight.detach().numpy()
    ours = ops.rms_norm_forward(x.numpy(), gamma, cfg.eps)[0]
    assert np.abs(norm(x).detach().numpy() - ours).max() < 1e-6 * max(1, np.abs(gamma).max())

    def float64_norm(module):
        def forward(h):
            return module.weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True)
                                                    + module.variance_epsilon))
        return forward

    norms = [m for m in model.modules() if type(m).__name__ in (
        "LlamaRMSNorm", "Qwen2RMSNorm", "MistralRMSNorm", "Qwen3RMSNorm", "Phi3RMSNorm")]
    assert len(norms) == (4 if cfg.qk_norm else 2) * cfg.layers + 1
    for module in norms:
        module.forward = float64_norm(module)
    return model


def float64_gemma(model, cfg):
    """A Gemma, Gemma2 or Gemma3ForCausalLM (float64 weights) whose RMSNorms, RoPE angles
    and embedding scale are float64's (Hugging Face makes the first two in float32 whatever the
    model's dtype, and keeps the scale in the dtype it was loaded in), each first checked
    against tfm's: the norm with gamma = 1 + weight to float32's rounding, the scale to
    bfloat16's."""
    import torch

    from tfmcli.engine import ops

    norm = model.model.norm
    x = torch.tensor(np.random.default_rng(0).normal(size=(3, cfg.d_model)))
    gamma = 1.0 + norm.weight.detach().numpy()
    ours = ops.rms_norm_forward(x.numpy(), gamma, cfg.eps)[0]
    assert np.abs(norm(x).detach().numpy() - ours).max() < 1e-6 * max(1, np.abs(gamma).max())

    def float64_norm(module):
        def forward(h):
            return (1.0 + module.weight) * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True)
                                                            + module.eps))
        return forward

    norms = [m for m in model.modules()
             if type(m).__name__ in ("GemmaRMSNorm", "Gemma2RMSNorm", "Gemma3RMSNorm")]
    # Gemma 2's and 3's four a layer, Gemma 3's q_norm and k_norm
    assert (
        len(norms)
        == (4 if cfg.sandwich_norm else 2) * cfg.layers + 1 + 2 * cfg.qk_norm * cfg.layers
    )
    for module in norms:
        module.forward = float64_norm(module)
    if hasattr(model.model.rotary_emb, "layer_types"):   # Gemma 3's: a RoPE a layer type
        float64_rotary_by_layer_type(model.model.rotary_emb, cfg)
    else:
        float64_rotary(model.model.rotary_emb, cfg.d_head, cfg.rope_theta)
    # Hugging Face keeps the scale as a buffer in the model's dtype: loaded from a bfloat16
    # folder, sqrt(32) is 5.65625. It is checked to that rounding and made sqrt(d) in float64.
    scale = model.model.embed_tokens.embed_scale
    assert float(scale) == pytest.approx(cfg.d_model ** 0.5, rel=2 ** -8)
    with torch.no_grad():
        scale.fill_(cfg.d_model ** 0.5)
    return model


def assert_gemma_weights_read_to_the_bit(params, state, fields) -> None:
    """Each weight a Gemma (or Gemma 2) folder stored (``state``, Hugging Face's names) under
    tfm's name (``llama.name_map``), transposed where ``nn.Linear`` stores ``(out, in)``, and
    each norm's gamma ``1 +`` its stored weight."""
    from tfmcli.sources import llama

    for key, name, transposed in llama.name_map(fields):
        stored = state[key].T if transposed else state[key]
        np.testing.assert_array_equal(params[name], stored + 1.0 if name.endswith(".gamma")
                                      else stored, err_msg=key)


def sandwich_grads(model) -> dict:
    """``llama_grads`` (q_norm's and k_norm's included) under the names of Gemma 2's and 3's
    four norms a layer: post_attention_layernorm is ln1_post, and the feed-forward's two norms
    ln2 and ln2_post."""
    theirs = llama_grads(model)
    for i, layer in enumerate(model.model.layers):
        p = f"blocks.{i}."
        theirs.update({p + "ln1_post.gamma": layer.post_attention_layernorm.weight.grad.numpy(),
                       p + "ln2.gamma": layer.pre_feedforward_layernorm.weight.grad.numpy(),
                       p + "ln2_post.gamma": layer.post_feedforward_layernorm.weight.grad.numpy()})
    return theirs


def sandwich_config_kwargs(cfg) -> dict:
    """The keyword arguments a Gemma2Config and a Gemma3TextConfig share for tfm's ``cfg`` (all
    but the RoPE, which each lays out its own way): the sizes, GELU's tanh form, the score scale
    as ``query_pre_attn_scalar`` (10 with ``attn_scale``, else d_head), the layers the window
    slides in, the caps."""
    scalar = 10 if cfg.attn_scale is not None else cfg.d_head
    # (6 ** -0.5 and tfm's 1 / sqrt(6) may differ in the last bit)
    assert cfg.score_scale == pytest.approx(scalar ** -0.5, rel=1e-15)
    layer_types = ["sliding_attention" if cfg.window(i) is not None else "full_attention"
                   for i in range(cfg.layers)]
    return dict(vocab_size=cfg.vocab, hidden_size=cfg.d_model, num_hidden_layers=cfg.layers,
                num_attention_heads=cfg.heads, num_key_value_heads=cfg.h_kv,
                head_dim=cfg.d_head, intermediate_size=cfg.ff,
                hidden_activation="gelu_pytorch_tanh", max_position_embeddings=64,
                rms_norm_eps=cfg.eps, tie_word_embeddings=cfg.tied_head, pad_token_id=None,
                query_pre_attn_scalar=scalar, sliding_window=cfg.sliding_window or 4096,
                layer_types=layer_types, attn_logit_softcapping=cfg.attn_softcap,
                final_logit_softcapping=cfg.logit_softcap)


def gemma_holding(Model, config, params, cfg, attention: str = "eager"):
    """Hugging Face's ``Model`` (Gemma, Gemma2 or Gemma3ForCausalLM) of ``config`` holding
    tfm's parameters in float64 (``attention``: eager, the kernel that soft-caps; Gemma's
    ``"sdpa"``, torch's own, keeps its softmax in float64): each norm's weight its gamma - 1,
    every linear weight transposed (``gemma.from_tfm``), then ``float64_gemma``."""
    import torch

    from tfmcli.sources import gemma

    config._attn_implementation = attention
    model = Model(config).double().eval()
    fields = {f: getattr(cfg, f) for f in ("d_model", "heads", "kv_heads", "layers", "vocab",
                                           "d_ff", "activation", "pe", "rms_norm", "bias",
                                           "tied_head", "head_bias", "head_dim", "embed_scale",
                                           "sandwich_norm", "qk_norm")}
    state = {key: torch.tensor(value) for key, value in gemma.from_tfm(params, fields).items()}
    if cfg.tied_head:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and all("rotary" in m for m in missing), missing
    return float64_gemma(model, cfg)


def llama_grads(model) -> dict:
    """The gradients of a ``llama_from`` model after its backward, under tfm's names, as
    float64 arrays (weights transposed to tfm's ``(in, out)``). Tied, the one matrix's
    gradient is ``embed.W_E``'s, its embedding's part and its head's summed. A Phi-3's fused
    matrices are split by Hugging Face's own slicing (``_phi3_split``). A StableLM's layer
    norms have biases: their gradients are the ``beta``s'."""
    theirs = {"embed.W_E": model.model.embed_tokens.weight.grad}
    norms = {"ln_f": model.model.norm}
    if model.lm_head.weight is not model.model.embed_tokens.weight:
        theirs["head.W_U"] = model.lm_head.weight.grad.T
    for i, layer in enumerate(model.model.layers):
        p = f"blocks.{i}."
        norms[p + "ln1"] = layer.input_layernorm
        if layer.post_attention_layernorm is not None:   # (StableLM's parallel block has none)
            norms[p + "ln2"] = layer.post_attention_layernorm
        if hasattr(layer.self_attn, "qkv_proj"):   # Phi-3's
            theirs.update(_phi3_split(model.config, layer, p))
        for w, name in zip("QKVO", ("q_proj", "k_proj", "v_proj", "o_proj")):
            module = getattr(layer.self_attn, name, None)
            if module is None:
                continue
            theirs[p + f"attn.W_{w}"] = module.weight.grad.T
            if module.bias is not None:
                theirs[p + f"attn.b_{w}"] = module.bias.grad
        for norm in ("q_norm", "k_norm"):   # Qwen3's
            if hasattr(layer.self_attn, norm):
                theirs[p + f"attn.{norm}.gamma"] = getattr(layer.self_attn, norm).weight.grad
        for w, name in (("gate", "gate_proj"), ("1", "up_proj"), ("2", "down_proj")):
            module = getattr(layer.mlp, name, None)
            if module is None:
                continue
            theirs[p + f"ffn.W_{w}"] = module.weight.grad.T
            if module.bias is not None:
                theirs[p + f"ffn.b_{w}"] = module.bias.grad
    for name, norm in norms.items():
        theirs[name + ".gamma"] = norm.weight.grad
        if getattr(norm, "bias", None) is not None:
            theirs[name + ".beta"] = norm.bias.grad
    return {name: grad.numpy() for name, grad in theirs.items()}


def _phi3_split(config, layer, p: str) -> dict:
    """A Phi-3 layer's fused gradients under tfm's names: ``qkv_proj``'s rows the query heads',
    then the key heads', then the value heads' (``Phi3Attention.forward``), ``gate_up_proj``'s
    the gate's, then the up projection's (``Phi3MLP``'s ``chunk(2)``)."""
    q_rows = config.num_attention_heads * layer.self_attn.head_dim
    kv_rows = config.num_key_value_heads * layer.self_attn.head_dim
    qkv = layer.self_attn.qkv_proj.weight.grad
    gate, up = layer.mlp.gate_up_proj.weight.grad.chunk(2, dim=0)
    return {p + "attn.W_Q": qkv[:q_rows].T, p + "attn.W_K": qkv[q_rows:q_rows + kv_rows].T,
            p + "attn.W_V": qkv[q_rows + kv_rows:].T, p + "ffn.W_gate": gate.T,
            p + "ffn.W_1": up.T}


def torch_reference_rows(cfg, seed: int) -> list:
    """tfm's forward and backward at random O(1) parameters (``seed``) against the torch
    reference (``tfm check --against torch``): every row of ``reference.compare`` passes; the
    rows are returned for the caller's own checks."""
    pytest.importorskip("torch")
    import tfmcli
    from tfmcli.check import reference

    params = random_params(tfmcli.init_params(cfg), seed=seed)
    inputs = tfmcli.make_inputs(cfg)
    fwd = tfmcli.forward(params, inputs, cfg)
    grads = tfmcli.backward(params, fwd, cfg)
    rows = reference.compare(fwd, grads, reference.torch_run(params, inputs, cfg), cfg)
    assert all(r.passed for r in rows), [r for r in rows if not r.passed]
    return rows


def neox_from(params, cfg, rotary_ndims, parallel: bool = False):
    """Hugging Face's GPTNeoXForCausalLM (a sequential residual, or with ``parallel`` its
    ``use_parallel_residual``; rotary on ``rotary_ndims`` of each head; GELU's tanh form, or
    GELU itself, Pythia's ``"gelu"``, for tfm's ``gelu_erf``) holding tfm's parameters, in
    float64."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")

    from tfmcli.engine import positional

    d, H, dh = cfg.d_model, cfg.heads, cfg.d_head
    config = transformers.GPTNeoXConfig(
        vocab_size=cfg.vocab, hidden_size=d, num_hidden_layers=cfg.layers,
        num_attention_heads=H, intermediate_size=cfg.ff,
        hidden_act="gelu" if cfg.activation == "gelu_erf" else "gelu_new",
        max_position_embeddings=64, rotary_pct=rotary_ndims / dh, rotary_emb_base=10000,
        layer_norm_eps=cfg.eps, use_parallel_residual=parallel, attention_bias=True,
        tie_word_embeddings=False, hidden_dropout=0.0, attention_dropout=0.0)
    # its "eager" attention takes the softmax in float32; torch's own kernel stays in float64
    config._attn_implementation = "sdpa"
    neox = transformers.GPTNeoXForCausalLM(config).double().eval()
    assert neox.gpt_neox.layers[0].attention.rotary_ndims == rotary_ndims
    t = {name: torch.tensor(np.asarray(v, dtype=np.float64)) for name, v in params.items()}
    state = {"gpt_neox.embed_in.weight": t["embed.W_E"], "lm_head.weight": t["head.W_U"].T,
             "gpt_neox.final_layer_norm.weight": t["ln_f.gamma"],
             "gpt_neox.final_layer_norm.bias": t["ln_f.beta"]}
    for i in range(cfg.layers):
        p, n = f"blocks.{i}.", f"gpt_neox.layers.{i}."
        # query_key_value: per head its q, k and v rows, one after another
        W = torch.stack([t[p + f"attn.W_{w}"].T.reshape(H, dh, d) for w in "QKV"], 1)
        b = torch.stack([t[p + f"attn.b_{w}"].reshape(H, dh) for w in "QKV"], 1)
        state.update({
            n + "input_layernorm.weight": t[p + "ln1.gamma"],
            n + "input_layernorm.bias": t[p + "ln1.beta"],
            n + "post_attention_layernorm.weight": t[p + "ln2.gamma"],
            n + "post_attention_layernorm.bias": t[p + "ln2.beta"],
            n + "attention.query_key_value.weight": W.reshape(3 * d, d),
            n + "attention.query_key_value.bias": b.reshape(3 * d),
            n + "attention.dense.weight": t[p + "attn.W_O"].T,
            n + "attention.dense.bias": t[p + "attn.b_O"],
            n + "mlp.dense_h_to_4h.weight": t[p + "ffn.W_1"].T,
            n + "mlp.dense_h_to_4h.bias": t[p + "ffn.b_1"],
            n + "mlp.dense_4h_to_h.weight": t[p + "ffn.W_2"].T,
            n + "mlp.dense_4h_to_h.bias": t[p + "ffn.b_2"]})
    missing, unexpected = neox.load_state_dict(state, strict=False)
    assert not unexpected and all("rotary" in m or "masked_bias" in m for m in missing), missing
    # GPT-NeoX makes its angles in float32 (``position_ids.float() * inv_freq``), so its model
    # agrees with any float64 one to about 1e-8. Its tables must be tfm's to float32's
    # rounding; then its rotary module makes them in float64 (the same layout: each angle
    # twice, ``cat((freqs, freqs))``), and the rest of the model is held to 1e-12.
    rotary = neox.gpt_neox.rotary_emb
    positions = torch.arange(cfg.seq_len)[None]
    cos32, sin32 = rotary(torch.zeros(1, dtype=torch.float64), positions)
    cos, sin = positional.rope_tables(cfg.seq_len, rotary_ndims)
    assert np.abs(cos32[0].numpy() - cos).max() < 1e-6
    assert np.abs(sin32[0].numpy() - sin).max() < 1e-6
    float64_rotary(rotary, rotary_ndims)
    return neox


def float64_table(rotary_dim: int, positions: int):
    """GPT-J's sin and cos of each position and pair, computed in float64 (Hugging Face's
    ``create_sinusoidal_positions`` computes them in float32 whatever the model's dtype)."""
    import torch

    inv_freq = 1.0 / 10000.0 ** (torch.arange(0, rotary_dim, 2, dtype=torch.float64)
                                 / rotary_dim)
    angles = torch.arange(positions, dtype=torch.float64)[:, None] * inv_freq
    return torch.cat((torch.sin(angles), torch.cos(angles)), dim=1)


def gptj_scores_in_float64(self, query, key, value, attention_mask=None):
    """GPTJAttention._attn (and CodeGen's) without its casts of q and k to float32: the same
    softmax of q . k / sqrt(d_head), the mask added, in the model's own dtype. (CodeGen adds
    the mask before it divides: a hidden key's score is then the mask's large negative number
    over sqrt(d_head) rather than that number, and its weight 0 all the same.)"""
    import torch

    weights = torch.matmul(query, key.transpose(-1, -2)) / self.scale_attn
    if attention_mask is not None:
        weights = weights + attention_mask
    weights = torch.nn.functional.softmax(weights, dim=-1)
    return torch.matmul(weights, value), weights


def gptj_in_float64(model, cfg):
    """GPT-J's (or CodeGen's) RoPE table made in float64 in every block."""
    for layer in model.transformer.h:
        attn = layer.attn
        attn.embed_positions = float64_table(attn.pos_embd_dim, attn.embed_positions.shape[0])
    return model
