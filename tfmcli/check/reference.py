"""tfm's model written again in plain PyTorch, for ``tfm check --against torch`` and the tests.

It shares nothing with tfm's engine but the parameter dict and the inputs: the embedding is
indexing, the positional encoding is computed in torch (the PyTorch-tutorial form; RoPE in
Hugging Face's LLaMA form, ``q cos + rotate_half(q) sin``; ALiBi in BLOOM's, ``m_h j`` added to
the scores), layer norm
is ``F.layer_norm``, attention is written out with ``masked_fill(-inf)`` and ``torch.softmax``,
the loss is ``F.cross_entropy`` with ``ignore_index=-100``, and every gradient comes from
autograd. PyTorch is imported only when this runs (installed as the README says: ``INSTALL``).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np

# the README's line: the CPU build these machines hold (any other spec downloads gigabytes)
INSTALL = "python -m pip install torch==2.13.0"


class MissingTorch(Exception):
    """PyTorch is not installed; the message says how to install it."""


def import_torch():
    try:
        import torch
    except ImportError:
        raise MissingTorch(f"--against torch needs PyTorch: {INSTALL}") from None
    return torch


class TorchRun(NamedTuple):
    loss: object       # 0-d tensor
    logits: object     # (B, T, V), with .grad
    patterns: dict     # "blocks.{i}." -> (B, H, T, T), with .grad
    leaves: dict       # parameter name -> leaf tensor, with .grad


def torch_sinusoidal(T, d):
    """The PyTorch-tutorial form: exp(-2i log(10000) / d) frequencies, sines and cosines."""
    torch = import_torch()
    position = torch.arange(T, dtype=torch.float64)[:, None]                   # (T, 1)
    div_term = torch.exp(torch.arange(0, d, 2, dtype=torch.float64) * (-math.log(10000.0) / d))
    pe = torch.zeros(T, d, dtype=torch.float64)
    pe[:, 0::2] = torch.sin(position * div_term)
    pe[:, 1::2] = torch.cos(position * div_term[: d // 2])
    return pe


def torch_rope(x, base=10000.0, scaling=None, rotary_dim=None):
    """RoPE as Hugging Face's LLaMA writes it: inverse frequencies ``1 / base^(arange(0, n, 2)
    / n)`` (``base``: ``rope_theta``) over the n = 2 (d_head // 2) rotated dimensions, each
    angle repeated for the two halves, ``x cos + rotate_half(x) sin``; an odd d_head's last
    dimension passes as it is. With ``rotary_dim`` n is that: the first n dimensions turn and
    the rest pass, as Hugging Face's StableLM and Phi-3 apply ``partial_rotary_factor``.
    ``scaling`` (factor, low_freq_factor, high_freq_factor, original context) rescales the
    frequencies as LLaMA 3.1's ``_compute_llama3_parameters`` does; a linear one (factor)
    divides them by the factor, as ``_compute_linear_scaling_rope_parameters`` does."""
    torch = import_torch()
    T, dh = x.shape[-2], x.shape[-1]
    n = 2 * (dh // 2) if rotary_dim is None else rotary_dim
    inv_freq = 1.0 / (float(base) ** (torch.arange(0, n, 2, dtype=torch.float64) / n))
    if scaling is not None and len(scaling) == 1:
        inv_freq = inv_freq / scaling[0]
    elif scaling is not None:
        factor, low, high, context = scaling
        wavelen = 2 * math.pi / inv_freq
        slowed = torch.where(wavelen > context / low, inv_freq / factor, inv_freq)
        smooth = (context / wavelen - low) / (high - low)
        blended = (1 - smooth) * slowed / factor + smooth * slowed
        medium = ~(wavelen < context / high) * ~(wavelen > context / low)
        inv_freq = torch.where(medium, blended, slowed)
    angle = torch.arange(T, dtype=torch.float64)[:, None] * inv_freq[None, :]  # (T, n / 2)
    emb = torch.cat([angle, angle], dim=-1)                                   # (T, n)
    turned, rest = x[..., :n], x[..., n:]
    x1, x2 = turned[..., : n // 2], turned[..., n // 2:]
    rotate_half = torch.cat([-x2, x1], dim=-1)
    return torch.cat([turned * emb.cos() + rotate_half * emb.sin(), rest], dim=-1)


def torch_alibi_slopes(heads):
    """ALiBi's slopes as the paper's code gets them: the geometric sequence from 2^(-8/n) for
    the closest power of two n, then every other slope of 2n's for the heads past n."""
    torch = import_torch()

    def power_of_2(n):
        start = 2.0 ** (-(2.0 ** -(math.log2(n) - 3)))
        return [start * start ** i for i in range(n)]

    n = 2 ** math.floor(math.log2(heads))
    slopes = power_of_2(n) + power_of_2(2 * n)[0::2][:heads - n]
    return torch.tensor(slopes, dtype=torch.float64)


def torch_run(params, inputs, cfg, interventions=()) -> TorchRun:
    """Forward and backward in float64 torch on tfm's parameters and inputs; ``interventions``
    (``tfmcli.engine.interventions``) made as hooks at the named activations, autograd going
    through the changed graph on its own."""
    torch = import_torch()
    F = torch.nn.functional
    P = {name: torch.tensor(np.asarray(value, dtype=np.float64), requires_grad=True)
         for name, value in params.items()}
    tokens = torch.as_tensor(inputs.tokens)
    targets = torch.as_tensor(inputs.targets)
    lengths = torch.as_tensor(inputs.lengths)
    B, T = tokens.shape
    d, H = cfg.d_model, cfg.heads
    dh = cfg.d_head   # d / H, or the Config's head_dim

    keys = torch.arange(T)[None, :] < lengths[:, None]                        # (B, T)
    valid = keys & (targets != -100)                                          # scored positions
    full = keys[:, None, None, :].expand(B, 1, T, T)                          # (B, 1, T, T)
    if cfg.causal:
        full = full & torch.tril(torch.ones(T, T, dtype=torch.bool))
    sliding = full
    # hides keys W or more behind (a padded query: its row's last)
    if cfg.sliding_window is not None:
        query = torch.minimum(torch.arange(T)[None, :], lengths[:, None] - 1)   # (B, T)
        near = torch.arange(T)[None, None, :] > query[:, :, None] - cfg.sliding_window
        sliding = full & near[:, None]                                        # (B, 1, T, T)
    patterns = {}
    hook = torch_hooks(torch, interventions, cfg, inputs)

    def bias(name):   # 0 for a layer without one (cfg.bias false)
        return P.get(name, 0.0)

    def norm(x, name, width=d):
        if cfg.rms_norm:
            return hook(name + ".out", F.rms_norm(x, (width,), P[name + ".gamma"], cfg.eps))
        return hook(name + ".out", F.layer_norm(x, (width,), P[name + ".gamma"],
                                                P.get(name + ".beta"), cfg.eps))

    def attention(x, i, mask):
        p = f"blocks.{i}."

        def project(w, heads):
            y = x @ P[p + f"attn.W_{w}"] + bias(p + f"attn.b_{w}")
            return hook(p + f"attn.{w.lower()}",
                        y.view(B, T, heads, dh).transpose(1, 2))             # (B, heads, T, dh)

        q, k, v = project("Q", H), project("K", cfg.h_kv), project("V", cfg.h_kv)
        if cfg.qk_norm:   # over each head's dh entries, one gamma (and beta) for every head
            q, k = norm(q, p + "attn.q_norm", dh), norm(k, p + "attn.k_norm", dh)
        if cfg.pe == "rope":   # at the block's own base (Gemma 3's sliding blocks: their own)
            q = hook(p + "attn.q_rot", torch_rope(q, *cfg.rope(i), cfg.rotary_dim))
            k = hook(p + "attn.k_rot", torch_rope(k, *cfg.rope(i), cfg.rotary_dim))
        k = k.repeat_interleave(cfg.group, dim=1)   # grouped: key head j serves query heads
        v = v.repeat_interleave(cfg.group, dim=1)   # j * group .. (j + 1) * group - 1
        scores = (q @ k.transpose(-1, -2)) * cfg.score_scale   # 1 / sqrt(dh) unless attn_scale
        # BLOOM's form, m_h j: tfm's -m_h (i - j) plus m_h i, a row's constant
        if cfg.pe == "alibi":
            scores = scores + torch_alibi_slopes(H)[:, None, None] * torch.arange(
                T, dtype=torch.float64
            )
        if cfg.attn_softcap is not None:   # Gemma 2's: cap * tanh(scores / cap), before the mask
            scores = torch.tanh(scores / cfg.attn_softcap) * cfg.attn_softcap
        scores = hook(p + "attn.scores", scores.masked_fill(~mask, float("-inf")))
        pattern = hook(p + "attn.pattern", torch.softmax(scores, dim=-1))
        pattern.retain_grad()
        patterns[p] = pattern
        context = hook(p + "attn.context", (pattern @ v).transpose(1, 2).reshape(B, T, H * dh))
        return hook(p + "attn.out", context @ P[p + "attn.W_O"] + bias(p + "attn.b_O"))

    def ffn(x, p):
        if cfg.gated:
            gate = hook(p + "ffn.gate", x @ P[p + "ffn.W_gate"] + bias(p + "ffn.b_gate"))
        h = hook(p + "ffn.pre", x @ P[p + "ffn.W_1"] + bias(p + "ffn.b_1"))
        if cfg.activation == "swiglu":   # as Hugging Face's LlamaMLP: silu(gate) * up
            h = F.silu(gate) * h
        elif cfg.activation == "geglu":   # as Hugging Face's GemmaMLP: gelu_tanh(gate) * up
            h = F.gelu(gate, approximate="tanh") * h
        elif cfg.activation == "geglu_erf":   # LlamaMLP with hidden_act "gelu": GELU itself
            h = F.gelu(gate) * h
        elif cfg.activation == "gelu_erf":   # GELU itself, torch's default
            h = F.gelu(h)
        else:
            h = torch.relu(h) if cfg.activation == "relu" else F.gelu(h, approximate="tanh")
        h = hook(p + "ffn.act", h)
        return hook(p + "ffn.out", h @ P[p + "ffn.W_2"] + bias(p + "ffn.b_2"))

    x = P["embed.W_E"][tokens]
    if cfg.embed_scale:   # Vaswani's and Gemma's sqrt(d_model)
        x = x * math.sqrt(d)
    x = hook("embed", x)
    if cfg.pe == "sinusoidal":
        x = x + hook("pe", torch_sinusoidal(T, d))
    elif cfg.pe == "learned":
        x = x + hook("pe", P["embed.W_pos"][:T])
    if cfg.embed_norm:   # BLOOM's word_embeddings_layernorm
        x = norm(x, "ln_embed")
    for i in range(cfg.layers):
        p = f"blocks.{i}."
        x = hook(p + "in", x)
        mask = full if cfg.window(i) is None else sliding   # only some blocks may slide
        if cfg.sandwich_norm:   # Gemma 2's: each sublayer's output normalised too
            x = hook(p + "resid1",
                     x + norm(attention(norm(x, p + "ln1"), i, mask), p + "ln1_post"))
            x = hook(p + "resid2", x + norm(ffn(norm(x, p + "ln2"), p), p + "ln2_post"))
        elif cfg.shared_norm:   # Phi-2's: both sublayers read one norm of x
            h = norm(x, p + "ln1")
            x = hook(p + "resid2", hook(p + "resid1", x + attention(h, i, mask)) + ffn(h, p))
        elif cfg.parallel_residual:   # GPT-NeoX's: both sublayers read x
            y = hook(p + "resid1", x + attention(norm(x, p + "ln1"), i, mask))
            x = hook(p + "resid2", y + ffn(norm(x, p + "ln2"), p))
        elif cfg.norm == "pre":
            x = hook(p + "resid1", x + attention(norm(x, p + "ln1"), i, mask))
            x = hook(p + "resid2", x + ffn(norm(x, p + "ln2"), p))
        else:
            x = norm(hook(p + "resid1", x + attention(x, i, mask)), p + "ln1")
            x = norm(hook(p + "resid2", x + ffn(x, p)), p + "ln2")
        x = hook(p + "out", x)
    if cfg.norm == "pre":
        x = norm(x, "ln_f")
    W_U = P["embed.W_E"].T if cfg.tied_head else P["head.W_U"]
    logits = x @ W_U + (P["head.b_U"] if cfg.head_bias else 0.0)
    if cfg.logit_softcap is not None:
        logits = torch.tanh(logits / cfg.logit_softcap) * cfg.logit_softcap
    logits = hook("logits", logits)
    logits.retain_grad()
    loss = F.cross_entropy(logits[valid], targets[valid], reduction="mean")
    loss.backward()
    return TorchRun(loss, logits, patterns, P)


def torch_hooks(torch, interventions, cfg, inputs):
    """``hook(name, x)``: activation ``name`` changed by the interventions on it, in order, the
    way a forward hook does it (a changed clone; autograd sees the change): a set, ablated or
    patched entry a constant, a scaled one scaled."""
    if not interventions:
        return lambda name, x: x
    from tfmcli.engine.model import plan_for

    plan = plan_for(interventions, cfg, inputs)   # the targets resolved: names and indices
    lengths = torch.as_tensor(inputs.lengths)

    def mean(x):   # each entry's mean over the real positions of every row, a constant
        x = x.detach()
        if x.dim() == 2:
            return x[: int(lengths.max())].mean(0).expand_as(x)
        axis = 2 if x.dim() == 4 else 1
        real = torch.arange(x.shape[axis])[None, :] < lengths[:, None]
        return x.movedim(axis, 1)[real].mean(0).unsqueeze(0).unsqueeze(axis).expand_as(x)

    def hook(name, x):
        steps = plan.steps.get(name)
        if not steps:
            return x
        x = x.clone()
        for intervention, base, index in steps:
            region = x[base] if base else x
            kind = type(intervention).__name__
            if kind == "Scale":
                region[index] = region[index] * intervention.factor
            elif kind == "Set":
                region[index] = intervention.value
            elif kind == "Ablate":
                region[index] = ((mean(x)[base] if base else mean(x))[index]
                                 if intervention.using == "mean" else 0.0)
            else:
                source = getattr(intervention.source, "acts", intervention.source)[name]
                values = torch.as_tensor(np.asarray(source, dtype=np.float64))
                region[index] = (values[base] if base else values)[index]
        return x

    return hook


class Difference(NamedTuple):
    name: str
    rel: float       # max |tfm - torch| / max(max |torch|, floor)
    passed: bool
    diff: float = 0.0    # max |tfm - torch|
    scale: float = 0.0   # the size of what rounding acts on: max |torch|, for a parameter's
                         # gradient at least the largest one's (its rounding is of that size)


TOLERANCE = {"float64": 1e-9, "float32": 1e-4}
# Differences are measured against at least this fraction of the largest gradient: a gradient
# that is 0 in exact arithmetic (b_K) holds only rounding noise, of about float32's or
# float64's precision times the size of the others.
FLOOR = {"float64": 1e-6, "float32": 1e-3}


def compare(fwd, grads, reference: TorchRun, cfg, tolerance=None) -> list[Difference]:
    """Loss, logits, every pattern and every parameter gradient of tfm against torch's."""
    tolerance = TOLERANCE[cfg.dtype] if tolerance is None else tolerance
    largest = max(float(leaf.grad.abs().max()) for leaf in reference.leaves.values())
    floor = FLOOR[cfg.dtype] * largest
    rows = []

    def add(name, ours, theirs, size_floor=0.0, rounding=0.0):
        theirs = theirs.detach().numpy() if hasattr(theirs, "detach") else np.asarray(theirs)
        ours = np.asarray(ours, dtype=np.float64)
        own = float(np.abs(theirs).max(initial=0.0))
        size = max(own, size_floor, 1e-300)
        diff = float(np.abs(ours - theirs).max(initial=0.0))
        rows.append(Difference(name, diff / size, diff / size <= tolerance, diff,
                               max(own, rounding)))

    add("loss", fwd.loss, reference.loss.item())
    add("logits", fwd.acts["logits"], reference.logits)
    for i in range(cfg.layers):
        p = f"blocks.{i}."
        add(p + "attn.pattern", fwd.acts[p + "attn.pattern"], reference.patterns[p])
    for name, leaf in reference.leaves.items():
        add("grad " + name, grads[name], leaf.grad, floor, largest)
    add("grad logits", grads.acts["logits"], reference.logits.grad)   # (P - Y) / N: its own
    return rows
