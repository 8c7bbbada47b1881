"""tfm circuit against PyTorch (issue 74's proof): EAP, EAP-IG and path patching computed again
by a model written here in plain float64 torch, which shares nothing with tfm's engine but the
parameter dict and the inputs (and ``check.reference``'s RoPE and sinusoidal tables).

The torch model makes the residual stream block by block as the sum of what the senders write
(the embedding, each head's context slice times its rows of W_O, each MLP's output, the output
biases), and every reader reads its own ``clone()`` of the stream where it reads it: each head's
queries, each key head's keys and values, each MLP, the logits, each through its own norm and
its own columns of the weights. So:

- **EAP**: one backward of the metric on the clean run, and each reader's gradient, through its
  path alone, is autograd's ``.grad`` of its own clone; an edge's score is the senders' corrupted
  minus clean output dotted with it. The graph (which reader reads after which sender) is
  written here again from the block's formula.
- **EAP-IG**: the same gradients averaged over ``steps`` runs whose first block's input is
  clean + (k - 1/2)/steps (corrupted - clean).
- **Path patching**: a real forward of the clean run in which each chosen edge's reader reads
  its clone plus the sender's corrupted output minus this run's; the single edges, the top k
  edges (k = 1, 2, 4, ..., every edge), every edge (the corrupted run).

Every score and every patched metric equals ``tfmcli.explain.circuit``'s to 1e-12 of its scale,
on GPT-2 (learned positions, tied head; sinusoidal with padded rows), LLaMA with grouped keys
(RMSNorm, RoPE, SwiGLU, 4 heads and 2 key heads), a parallel block (GPT-NeoX's) and a parallel
block with one norm (Phi-2's), for the loss and a logit difference. Inside torch, each EAP score
is also autograd's derivative of its edge's path patch (``eps`` times the corrupted difference),
so the reference's two halves agree with each other before they are compared with tfm.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import pytest

import tfmcli

torch = pytest.importorskip("torch")

from helpers import random_params  # noqa: E402
from tfmcli.check.reference import torch_rope, torch_sinusoidal  # noqa: E402
from tfmcli.engine.inputs import Inputs  # noqa: E402
from tfmcli.explain.circuit import circuit  # noqa: E402

F = torch.nn.functional
TOL = 1e-12
SIZES = dict(layers=3, d_model=8, heads=2, seq_len=5, batch=2, vocab=13, d_ff=16)
ARCHS = {
    "gpt2": dict(pe="learned", activation="gelu", tied_head=True, head_bias=False),
    "gpt2-sinusoidal-padded": dict(activation="gelu", lengths=(5, 3)),
    "llama-gqa": dict(rms_norm=True, pe="rope", activation="swiglu", heads=4, kv_heads=2,
                      bias=False, head_bias=False),
    "parallel": dict(parallel_residual=True, pe="rope", activation="gelu"),
    "shared-norm": dict(parallel_residual=True, shared_norm=True, activation="gelu"),
}
METRICS = {"loss": (None, None), "logit-diff": (3, 7)}


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tensors of a few hundred numbers: torch's thread pool only waits for its threads (up to
    80 times slower on a busy two-core machine), so one thread, and the count put back."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def model(arch):
    cfg = tfmcli.Config(**{**SIZES, **ARCHS[arch]})
    params = random_params(tfmcli.init_params(cfg), seed=3)
    clean = tfmcli.make_inputs(cfg)
    corrupted = tfmcli.make_inputs(cfg.replace(seed=cfg.seed + 5))
    return cfg, params, clean, corrupted


# ---------------------------------------------------------------- the torch model


def graph(cfg):
    """(senders, readers, edges) by name, from the block's formula: a reader reads every sender
    that wrote before it. Stages within block i: 0 attention (and a parallel block's MLP) reads,
    1 the heads write, 2 a sequential MLP reads, 3 the MLP writes."""
    writes, reads = {"emb": (-1, 3)}, {}
    for i in range(cfg.layers):
        reads.update({f"a{i}.{h}.q": (i, 0) for h in range(cfg.heads)})
        for g in range(cfg.h_kv):
            reads[f"a{i}.{g}.k"] = reads[f"a{i}.{g}.v"] = (i, 0)
        writes.update({f"a{i}.{h}": (i, 1) for h in range(cfg.heads)})
        reads[f"m{i}"] = (i, 0) if cfg.parallel_residual else (i, 2)
        writes[f"m{i}"] = (i, 3)
    reads["logits"] = (cfg.layers, 0)
    edges = [(u, v) for u, wu in writes.items() for v, rv in reads.items() if wu < rv]
    return list(writes), list(reads), edges


class Run(NamedTuple):
    """A torch run: ``metric`` (0-d), ``written`` (sender -> (B, T, d)), ``read`` (reader -> its
    own clone of the stream it read, with ``.grad`` after a backward)."""

    metric: object
    written: dict
    read: dict


def run(cfg, P, inputs, metric, ids, x0=None, patch=None, grad=False) -> Run:
    """The model on ``inputs`` (the first block's input ``x0`` when given). ``patch``: reader ->
    [(sender, value)]: that reader reads the stream plus value minus what the sender wrote in
    this run. With ``grad``, x0 is a leaf, so every clone is in the graph."""
    tokens = torch.as_tensor(inputs.tokens)
    targets = torch.as_tensor(inputs.targets)
    lengths = torch.as_tensor(inputs.lengths)
    B, T = tokens.shape
    H, Hkv, dh = cfg.heads, cfg.h_kv, cfg.d_head
    keys = torch.arange(T)[None, :] < lengths[:, None]                            # (B, T)
    seen = keys[:, None, None, :] & torch.tril(torch.ones(T, T, dtype=torch.bool))  # (B, 1, T, T)
    patch = patch or {}
    if x0 is None:
        x0 = P["embed.W_E"][tokens]                                               # (B, T, d)
        if cfg.pe == "learned":
            x0 = x0 + P["embed.W_pos"][:T]
        elif cfg.pe == "sinusoidal":
            x0 = x0 + torch_sinusoidal(T, cfg.d_model)
    if grad:
        x0 = x0.detach().clone().requires_grad_(True)
    written, read = {"emb": x0}, {}

    def reads(name, stream):   # the reader's own copy: autograd keeps its gradient apart
        for u, value in patch.get(name, ()):
            stream = stream + (value - written[u])
        copy = stream.clone()
        if copy.requires_grad:
            copy.retain_grad()
        read[name] = copy
        return copy

    def norm(x, name):
        if cfg.rms_norm:
            return F.rms_norm(x, (x.shape[-1],), P[name + ".gamma"], cfg.eps)
        return F.layer_norm(x, (x.shape[-1],), P[name + ".gamma"], P.get(name + ".beta"),
                            cfg.eps)

    def linear(x, w, b, cols=slice(None)):
        return x @ P[w][:, cols] + (P[b][cols] if b in P else 0.0)

    stream = x0
    for i in range(cfg.layers):
        p, x = f"blocks.{i}.", stream

        def project(kind, heads):   # each head's own read of x: (B, heads, T, dh)
            return torch.stack([
                linear(norm(reads(f"a{i}.{h}.{kind}", x), p + "ln1"),
                       p + f"attn.W_{kind.upper()}", p + f"attn.b_{kind.upper()}",
                       slice(h * dh, (h + 1) * dh))
                for h in range(heads)], dim=1)

        q, k, v = project("q", H), project("k", Hkv), project("v", Hkv)
        if cfg.pe == "rope":
            q, k = (torch_rope(t, *cfg.rope(i), cfg.rotary_dim) for t in (q, k))
        k, v = k.repeat_interleave(cfg.group, dim=1), v.repeat_interleave(cfg.group, dim=1)
        scores = (q @ k.transpose(-1, -2)) * cfg.score_scale                      # (B, H, T, T)
        pattern = torch.softmax(scores.masked_fill(~seen, float("-inf")), dim=-1)
        context = pattern @ v                                                     # (B, H, T, dh)
        for h in range(H):
            written[f"a{i}.{h}"] = context[:, h] @ P[p + "attn.W_O"][h * dh:(h + 1) * dh]
        y = x + sum(written[f"a{i}.{h}"] for h in range(H)) + P.get(p + "attn.b_O", 0.0)
        a = norm(reads(f"m{i}", x if cfg.parallel_residual else y),
                 p + ("ln1" if cfg.shared_norm else "ln2"))
        pre = linear(a, p + "ffn.W_1", p + "ffn.b_1")                             # (B, T, d_ff)
        if cfg.activation == "swiglu":
            hidden = F.silu(linear(a, p + "ffn.W_gate", p + "ffn.b_gate")) * pre
        else:
            assert cfg.activation == "gelu"
            hidden = F.gelu(pre, approximate="tanh")
        written[f"m{i}"] = linear(hidden, p + "ffn.W_2", p + "ffn.b_2")
        stream = y + written[f"m{i}"]
    W_U = P["embed.W_E"].T if cfg.tied_head else P["head.W_U"]
    logits = norm(reads("logits", stream), "ln_f") @ W_U + P.get("head.b_U", 0.0)  # (B, T, V)
    if metric == "loss":
        valid = keys & (targets != -100)
        value = F.cross_entropy(logits[valid], targets[valid])
    else:
        rows, last, (answer, wrong) = torch.arange(B), lengths - 1, ids
        value = (logits[rows, last, answer] - logits[rows, last, wrong]).mean()
    return Run(value, written, read)


def gradients(cfg, P, inputs, metric, ids, x0=None) -> dict:
    """Each reader's gradient at a run: autograd's, at its own clone of the stream."""
    r = run(cfg, P, inputs, metric, ids, x0=x0, grad=True)
    r.metric.backward()
    return {v: copy.grad for v, copy in r.read.items()}


class Reference:
    """Both runs of the torch model, each edge's EAP score and EAP-IG's, path patching."""

    def __init__(self, cfg, params, clean, corrupted, metric, ids):
        self.cfg, self.metric, self.ids = cfg, metric, ids
        self.P = {n: torch.tensor(np.asarray(v, dtype=np.float64)) for n, v in params.items()}
        self.clean_inputs = clean
        self.corrupt_inputs = Inputs(corrupted.tokens, clean.targets, clean.lengths)
        self.senders, self.readers, self.edges = graph(cfg)
        with torch.no_grad():
            self.clean = run(cfg, self.P, clean, metric, ids)
            self.corrupt = run(cfg, self.P, self.corrupt_inputs, metric, ids)
        self.delta = {u: self.corrupt.written[u] - self.clean.written[u] for u in self.senders}

    def scores(self, g) -> dict:
        return {(u, v): float((self.delta[u] * g[v]).sum()) for u, v in self.edges}

    def eap(self) -> dict:
        return self.scores(gradients(self.cfg, self.P, self.clean_inputs, self.metric,
                                     self.ids))

    def eap_ig(self, steps) -> dict:
        start, end = self.clean.written["emb"], self.corrupt.written["emb"]
        total = dict.fromkeys(self.readers, 0.0)
        for k in range(1, steps + 1):
            x0 = start + ((k - 0.5) / steps) * (end - start)
            g = gradients(self.cfg, self.P, self.clean_inputs, self.metric, self.ids, x0)
            total = {v: total[v] + g[v] for v in self.readers}
        return self.scores({v: total[v] / steps for v in self.readers})

    def patched(self, edges, values=None) -> torch.Tensor:
        """The clean run with ``edges`` patched (``values``: sender -> what the edges carry,
        the corrupted run's outputs unless given)."""
        values = self.corrupt.written if values is None else values
        patch = {}
        for u, v in edges:
            patch.setdefault(v, []).append((u, values[u]))
        return run(self.cfg, self.P, self.clean_inputs, self.metric, self.ids,
                   patch=patch).metric


def both(arch, metric, steps=0):
    cfg, params, clean, corrupted = model(arch)
    ids = METRICS[metric]
    c = circuit(params, clean, corrupted, cfg, metric, *ids, steps=steps)
    return c, Reference(cfg, params, clean, corrupted, metric, ids)


def tfm_scores(c) -> dict:
    """tfm's scores by (sender, reader) name, over its mask's edges."""
    return {(c.senders[u].name, c.readers[v].name): float(c.scores[u, v])
            for u, v in zip(*np.nonzero(c.mask))}


def assert_scores_equal(c, mine) -> float:
    ours = tfm_scores(c)
    assert sorted(ours) == sorted(mine)   # the same graph
    assert not c.scores[~c.mask].any()
    scale = max(abs(s) for s in mine.values())
    worst = max(mine, key=lambda e: abs(ours[e] - mine[e]))
    rel = abs(ours[worst] - mine[worst]) / scale
    assert rel <= TOL, (worst, ours[worst], mine[worst], scale)
    return rel


# ---------------------------------------------------------------- the tests


@pytest.mark.parametrize("metric", METRICS)
@pytest.mark.parametrize("arch", ARCHS)
def test_every_edges_eap_score_is_torch_autograds(arch, metric):
    c, ref = both(arch, metric)
    assert c.clean == pytest.approx(ref.clean.metric.item(), rel=TOL, abs=TOL)
    assert c.corrupted == pytest.approx(ref.corrupt.metric.item(), rel=TOL, abs=TOL)
    mine = ref.eap()
    assert len(mine) == int(c.mask.sum()) > 0
    print(f"{arch} {metric} EAP: {assert_scores_equal(c, mine):.1e} of the scale")


@pytest.mark.parametrize("metric", METRICS)
@pytest.mark.parametrize("arch", ["gpt2", "llama-gqa", "parallel"])
def test_each_eap_score_is_the_derivative_of_its_path_patch_in_torch(arch, metric):
    """The reference checks itself: d/d eps of the edge's path patch, the sender's clean output
    plus eps times its corrupted difference, at eps = 0, by autograd, is its EAP score."""
    _, ref = both(arch, metric)
    mine = ref.eap()
    scale = max(abs(s) for s in mine.values())
    for u, v in ref.edges:
        eps = torch.zeros((), dtype=torch.float64, requires_grad=True)
        value = {u: ref.clean.written[u] + eps * ref.delta[u]}
        ref.patched([(u, v)], value).backward()
        assert abs(eps.grad.item() - mine[u, v]) <= TOL * scale, (u, v)


@pytest.mark.parametrize("metric", METRICS)
@pytest.mark.parametrize("arch", ARCHS)
def test_every_edges_eap_ig_score_is_torch_autograds(arch, metric):
    steps = 5
    c, ref = both(arch, metric, steps=steps)
    assert c.method == "EAP-IG" and c.steps == steps
    mine = ref.eap_ig(steps)
    rel = assert_scores_equal(c, mine)
    change = ref.corrupt.metric.item() - ref.clean.metric.item()
    integration = sum(s for (u, _), s in mine.items() if u == "emb") - change
    assert c.integration == pytest.approx(integration, abs=TOL * max(1.0, abs(change)))
    print(f"{arch} {metric} EAP-IG: {rel:.1e} of the scale")


@pytest.mark.parametrize("metric", METRICS)
@pytest.mark.parametrize("arch", ARCHS)
def test_path_patches_are_torch_forwards_with_those_edges_changed(arch, metric):
    """Single edges (each reader's largest and each sender's largest, and the smallest), the
    top k edges by the reference's own ranking for k = 1, 2, 4, ..., every edge."""
    c, ref = both(arch, metric)
    mine = ref.eap()
    index = {(s.name, r.name): (u, v) for u, s in enumerate(c.senders)
             for v, r in enumerate(c.readers)}
    order = sorted(ref.edges, key=lambda e: -abs(mine[e]))
    assert [index[e] for e in order[:8]] == [tuple(map(int, e)) for e in c.edges()[:8]]
    single = {min(ref.edges, key=lambda e: abs(mine[e]))}
    for ends, side in ((ref.readers, 1), (ref.senders, 0)):
        for x in ends:
            single.add(max((e for e in ref.edges if e[side] == x), key=lambda e: abs(mine[e])))
    n = len(order)
    circuits = [order[:k] for k in sorted({*(2 ** i for i in range(n.bit_length())), n})]
    cases = [[e] for e in sorted(single)] + circuits
    with torch.no_grad():
        real = [ref.patched(edges).item() for edges in cases]
    ours = [c.patched([index[e] for e in edges]) for edges in cases]
    scale = max(map(abs, [c.clean, c.corrupted, *real]))
    diffs = [abs(a - b) / scale for a, b in zip(ours, real)]
    worst = int(np.argmax(diffs))
    assert diffs[worst] <= TOL, (cases[worst], ours[worst], real[worst])
    assert real[-1] == pytest.approx(ref.corrupt.metric.item(), rel=TOL)   # every edge
    # an edge's real effect is not its estimate: the patches test more than the scores do
    assert max(abs(r - c.clean - mine[e[0]]) for r, e in zip(real, cases[:3])) > 1e-6
    print(f"{arch} {metric} path patching: {diffs[worst]:.1e} of the scale "
          f"({len(single)} edges, {len(circuits)} circuits)")
