"""float16 and bfloat16 runs (engine/precision.py), held against PyTorch's own.

A rounded run stores every tensor in its dtype and computes each operation in float32, as
PyTorch eager does on the CPU. Three kinds of proof:

- every activation, gradient and parameter gradient of a rounded run is a value of its dtype,
  in every kind of block (a forgotten rounding leaves float32's digits, and fails here);
- Hugging Face's GPT-2 and LLaMA run in torch in that dtype (float32 too; eager attention, on
  the CPU) err against float64 as tfm's run errs, tensor by tensor, within a factor of 2
  (measured over 67-77 tensors in each of 12 runs: 0.60 to 1.41). They cannot agree exactly:
  the kernels' accumulation orders differ (BLAS's blocking against oneDNN's), Hugging Face's
  RMSNorm rounds twice (the normalised x, then times the gain) where torch's F.rms_norm and
  tfm round once, and GPT-2's gelu_new is eight rounded operations where tfm's GELU is one;
- float64 and float32 round nothing (tests/test_golden.py holds their numbers bit for bit).
"""

from __future__ import annotations

import itertools
import json

import numpy as np
import pytest

import tfmcli
from helpers import error_line, o1_gpt2, ok, random_params, run
from tfmcli.engine import ops, precision
from tfmcli.engine.presets import PRESETS, preset_fields

ROUNDED = ("float16", "bfloat16")
EPS = {"float32": 2.0 ** -23, "float16": 2.0 ** -10, "bfloat16": 2.0 ** -7}


def arch_cfg(arch: str, **fields) -> tfmcli.Config:
    """The --arch preset at a small size that every family takes (GQA's 2 key heads too)."""
    sizes = dict(d_model=16, heads=4, layers=2, batch=2, seq_len=6, vocab=24)
    return tfmcli.Config(**{**preset_fields(arch, sizes), **sizes, **fields})


def representable(x, dtype: str) -> bool:
    """Every entry of ``x`` is a value of ``dtype`` (infinities and NaN included)."""
    x = np.asarray(x)
    return bool(np.array_equal(precision.of(dtype).round(x), x, equal_nan=True))


def every_tensor(fwd, grads) -> dict:
    return {**fwd.acts, **{"d" + n: g for n, g in grads.acts.items()},
            **{"grad " + n: g for n, g in grads.items()}}


# ---------------------------------------------------------------- the policy


def test_float64_and_float32_round_nothing():
    x = np.linspace(-3, 3, 7)
    for dtype in ("float64", "float32"):
        policy = precision.of(dtype)
        assert policy.exact and policy.round(x) is x
        assert tfmcli.Config(dtype=dtype).np_dtype == np.dtype(dtype)


@pytest.mark.parametrize("dtype", ROUNDED)
def test_the_policy_rounds_to_nearest_even_in_float32_arrays(dtype):
    policy = precision.of(dtype)
    eps = EPS[dtype]
    assert policy.eps == eps and not policy.exact
    assert tfmcli.Config(dtype=dtype).np_dtype == np.dtype(np.float32)
    # 1 + eps/2 lies halfway between 1 and 1 + eps: to the even one, 1; 1 + 3eps/2 to 1 + 2eps
    x = np.array([1 + eps / 2, 1 + 3 * eps / 2, 1 + eps / 4, -(1 + 3 * eps / 4)])
    out = policy.round(x)
    assert out.dtype == np.float32
    np.testing.assert_array_equal(out, [1.0, 1 + 2 * eps, 1.0, -(1 + eps)])
    assert policy.round(2.0 + eps / 4) == 2.0 and isinstance(policy.round(1.5), float)


def test_float16_overflows_to_inf_and_bfloat16_does_not():
    with np.errstate(over="ignore"):
        assert np.isinf(precision.of("float16").round(np.array([70000.0])))[0]
    assert precision.of("bfloat16").round(np.array([70000.0]))[0] == 70144.0   # 8 bits kept


@pytest.mark.parametrize("dtype", ROUNDED)
def test_the_weights_are_the_float64_draw_rounded(dtype):
    cfg = tfmcli.Config(layers=2, init="xavier")
    drawn = tfmcli.init_params(cfg)
    rounded = tfmcli.init_params(cfg.replace(dtype=dtype))
    for name, value in drawn.items():
        assert rounded[name].dtype == np.float32
        np.testing.assert_array_equal(rounded[name], precision.of(dtype).round(value))
        assert representable(rounded[name], dtype)


@pytest.mark.parametrize("dtype", ROUNDED)
def test_a_cast_holds_the_dtypes_values_read_only_and_a_pass_reads_them_as_they_are(dtype):
    """precision.Cast: every value rounded once as it is put in (from float64 without going
    through float32, by item, update or |=), read-only; a pass in its dtype reads it as it is
    (no Stored), in another dtype rounds it; a copy is a plain dict."""
    import copy

    import ml_dtypes

    policy = precision.of(dtype)
    drawn = random_params(tfmcli.init_params(tfmcli.Config(layers=1)), seed=4)  # float64
    drawn["large"] = np.random.default_rng(4).standard_normal((70, 90)) * 1e-3   # chunked
    cast = precision.Cast(drawn, policy)
    dtype_itself = np.float16 if dtype == "float16" else ml_dtypes.bfloat16
    for name, value in drawn.items():
        assert cast[name].dtype == np.float32 and not cast[name].flags.writeable
        np.testing.assert_array_equal(cast[name], value.astype(dtype_itself).astype(np.float32))
    with pytest.raises(ValueError, match="rounds nothing"):
        precision.Cast(drawn, precision.of("float32"))
    with pytest.raises(ValueError, match="read-only"):
        cast["ln_f.gamma"] += 1
    cast["ln_f.gamma"] = drawn["ln_f.gamma"] + 1.0 / 3
    cast.update({"ln_f.beta": drawn["ln_f.beta"] / 3})
    cast |= {"embed.W_E": drawn["embed.W_E"] / 7}
    for name, made in (("ln_f.gamma", drawn["ln_f.gamma"] + 1.0 / 3),
                       ("ln_f.beta", drawn["ln_f.beta"] / 3),
                       ("embed.W_E", drawn["embed.W_E"] / 7)):
        np.testing.assert_array_equal(cast[name], policy.round(made))
        assert not representable(made, dtype) and representable(cast[name], dtype)
    assert precision.stored(cast, policy) is cast
    other = precision.of("float16" if dtype == "bfloat16" else "bfloat16")
    assert isinstance(precision.stored(cast, other), precision.Stored)
    for plain in (dict(cast), cast.copy(), copy.copy(cast), copy.deepcopy(cast)):
        assert type(plain) is dict and plain.keys() == cast.keys()


@pytest.mark.parametrize("dtype", ROUNDED)
def test_a_rounded_run_holds_its_weights_cast_and_runs_as_the_plain_dict_does(dtype):
    """A Run in a rounded dtype (tfmcli.load, a command) holds its weights as a Cast, read
    once: its forward and backward are those of the same weights in a plain dict, rounded at
    every read, bit for bit."""
    run = tfmcli.load(None, layers=2, d_model=32, heads=4, dtype=dtype, seed=5,
                      pe="rope", rms_norm=True, activation="swiglu")
    assert isinstance(run.params, precision.Cast) and run.params.rounded == dtype
    plain = {name: np.array(value) for name, value in run.params.items()}
    cast = tfmcli.backward(run.params, tfmcli.forward(run.params, run.inputs, run.cfg), run.cfg)
    each = tfmcli.backward(plain, tfmcli.forward(plain, run.inputs, run.cfg), run.cfg)
    assert cast.keys() == each.keys()
    for name in cast:
        np.testing.assert_array_equal(cast[name], each[name])
    exact = tfmcli.load(None, layers=2, d_model=32, heads=4, seed=5)
    assert type(exact.params) is dict


# ---------------------------------------------------------------- every tensor in the dtype


@pytest.mark.parametrize("dtype", ROUNDED)
@pytest.mark.parametrize("arch", ["vaswani", "gpt2", "llama", "qwen3", "gemma2", "gpt_neox",
                                  "phi", "bloom", "mpt", "gemma3"])
def test_every_tensor_of_a_rounded_run_is_a_value_of_its_dtype(arch, dtype):
    """The block's sums, attention's steps, the norms, the loss and every gradient, in the
    families' kinds of block (Post-LN, sandwich, parallel, shared norm, GQA, ALiBi, soft caps,
    q/k norms, an embedding norm), from float32 weights that are not the dtype's (read as
    rounded)."""
    assert arch in PRESETS
    cfg = arch_cfg(arch, dtype=dtype, lengths=(6, 4))

    params = random_params(tfmcli.init_params(cfg.replace(dtype="float32")), seed=2)
    with np.errstate(over="ignore"):   # O(1) weights: float16 overflows here and there
        fwd = tfmcli.forward(params, tfmcli.make_inputs(cfg), cfg)
        grads = tfmcli.backward(params, fwd, cfg)
    tensors = every_tensor(fwd, grads)
    assert len(tensors) > 40
    bad = [name for name, x in tensors.items() if not representable(x, dtype)]
    assert not bad, bad
    assert fwd.loss == float(np.float32(fwd.loss))   # the loss in float32, as Hugging Face's


def test_a_forgotten_rounding_is_caught(monkeypatch):
    """Planted: the linear layers' backward unmarked (no ``@op``): the weight gradients keep
    float32's digits, which the test above finds."""
    cfg = arch_cfg("gpt2", dtype="bfloat16")
    monkeypatch.setattr(ops, "linear_backward", ops.linear_backward.__wrapped__)
    params = tfmcli.init_params(cfg)
    fwd = tfmcli.forward(params, tfmcli.make_inputs(cfg), cfg)
    grads = tfmcli.backward(params, fwd, cfg)
    bad = [n for n, x in every_tensor(fwd, grads).items() if not representable(x, "bfloat16")]
    assert "grad blocks.0.ffn.W_1" in bad and "grad blocks.0.ln1.gamma" not in bad


@pytest.mark.parametrize("dtype", ROUNDED)
def test_a_rounded_run_is_the_reference_path_in_one_piece(dtype):
    """fast=True asks for the fast path; a rounded run takes the reference path whatever it is
    asked (the fast path folds the scale into q, a rounding torch does not make)."""
    cfg = arch_cfg("llama", dtype=dtype)
    params, inputs = tfmcli.init_params(cfg), tfmcli.make_inputs(cfg)
    fast, slow = tfmcli.forward(params, inputs, cfg), tfmcli.forward(params, inputs, cfg,
                                                                     fast=False)
    assert fast.caches["fast"] is False
    for name in fast.acts:
        np.testing.assert_array_equal(fast.acts[name], slow.acts[name], err_msg=name)


@pytest.mark.parametrize("dtype", ROUNDED)
def test_decoding_with_the_cache_equals_the_rounded_forward(dtype):
    cfg = arch_cfg("llama", dtype=dtype, batch=1, seq_len=5)
    tokens = [3, 1, 4, 1, 5]
    params = tfmcli.init_params(cfg)
    steps = tfmcli.engine.kv.decode(params, tokens, cfg)
    fwd = tfmcli.forward(params, tfmcli.inputs_from_tokens([tokens]), cfg)
    np.testing.assert_array_equal(np.array([s.logits for s in steps]), fwd.acts["logits"][0])


# ---------------------------------------------------------------- against PyTorch


def rel_rms(low, truth) -> float:
    """RMS of low - truth over the tensor's finite entries, relative to truth's RMS."""
    low, truth = np.asarray(low, dtype=np.float64), np.asarray(truth, dtype=np.float64)
    finite = np.isfinite(truth)
    scale = float(np.sqrt(np.mean(truth[finite] ** 2)))
    return float(np.sqrt(np.mean((low[finite] - truth[finite]) ** 2))) / scale if scale else 0.0


def captured(model, spots):
    """Forward hooks at ``spots`` ((module, "in" or "out", names: tensor -> {tfm name: tensor}))
    keeping each tensor and, through a tensor hook, its gradient."""
    acts, grads, handles = {}, {}, []

    def keeper(kind, names):
        def keep(tensor):
            for name, value in names(tensor).items():
                acts[name] = value
                value.register_hook(lambda g, name=name: grads.__setitem__(name, g))
        if kind == "out":
            return lambda module, args, out: keep(out[0] if isinstance(out, tuple) else out)
        return lambda module, args: keep(args[0])

    for module, kind, names in spots:
        hook = keeper(kind, names)
        handles.append(module.register_forward_hook(hook) if kind == "out"
                       else module.register_forward_pre_hook(hook))
    return acts, grads, handles


def gpt2_spots(model, d):
    tr, spots = model.transformer, []
    for i, blk in enumerate(tr.h):
        p = f"blocks.{i}."
        spots += [
            (blk, "in", lambda t, p=p: {p + "in": t}),
            (blk.ln_1, "out", lambda t, p=p: {p + "ln1.out": t}),
            (blk.attn.c_attn, "out", lambda t, p=p: {p + "attn.q": t[..., :d],
                                                     p + "attn.k": t[..., d:2 * d],
                                                     p + "attn.v": t[..., 2 * d:]}),
            (blk.attn.c_proj, "in", lambda t, p=p: {p + "attn.context": t}),
            (blk.attn.c_proj, "out", lambda t, p=p: {p + "attn.out": t}),
            (blk.ln_2, "in", lambda t, p=p: {p + "resid1": t}),
            (blk.ln_2, "out", lambda t, p=p: {p + "ln2.out": t}),
            (blk.mlp.c_fc, "out", lambda t, p=p: {p + "ffn.pre": t}),
            (blk.mlp.c_proj, "in", lambda t, p=p: {p + "ffn.act": t}),
            (blk.mlp.c_proj, "out", lambda t, p=p: {p + "ffn.out": t}),
            (blk, "out", lambda t, p=p: {p + "resid2": t})]
    return spots + [(tr.ln_f, "out", lambda t: {"ln_f.out": t}),
                    (model.lm_head, "out", lambda t: {"logits": t})]


def gpt2_weights(model, layers):
    """tfm's parameter name -> Hugging Face's GPT-2 leaf (Conv1D: (d_in, d_out), as tfm's)."""
    tr = model.transformer
    leaves = {"embed.W_E": tr.wte.weight, "embed.W_pos": tr.wpe.weight,
              "ln_f.gamma": tr.ln_f.weight}
    for i in range(layers):
        blk, p = tr.h[i], f"blocks.{i}."
        leaves.update({p + "ln1.gamma": blk.ln_1.weight, p + "ln2.beta": blk.ln_2.bias,
                       p + "attn.W_O": blk.attn.c_proj.weight,
                       p + "ffn.W_1": blk.mlp.c_fc.weight, p + "ffn.b_2": blk.mlp.c_proj.bias})
    return {name: (leaf, False) for name, leaf in leaves.items()}


def llama_spots(model):
    m, spots = model.model, []
    for i, blk in enumerate(m.layers):
        p, a = f"blocks.{i}.", blk.self_attn
        spots += [
            (blk, "in", lambda t, p=p: {p + "in": t}),
            (blk.input_layernorm, "out", lambda t, p=p: {p + "ln1.out": t}),
            (a.q_proj, "out", lambda t, p=p: {p + "attn.q": t}),
            (a.k_proj, "out", lambda t, p=p: {p + "attn.k": t}),
            (a.v_proj, "out", lambda t, p=p: {p + "attn.v": t}),
            (a.o_proj, "in", lambda t, p=p: {p + "attn.context": t}),
            (a.o_proj, "out", lambda t, p=p: {p + "attn.out": t}),
            (blk.post_attention_layernorm, "in", lambda t, p=p: {p + "resid1": t}),
            (blk.post_attention_layernorm, "out", lambda t, p=p: {p + "ln2.out": t}),
            (blk.mlp.gate_proj, "out", lambda t, p=p: {p + "ffn.gate": t}),
            (blk.mlp.up_proj, "out", lambda t, p=p: {p + "ffn.pre": t}),
            (blk.mlp.down_proj, "in", lambda t, p=p: {p + "ffn.act": t}),
            (blk.mlp.down_proj, "out", lambda t, p=p: {p + "ffn.out": t}),
            (blk, "out", lambda t, p=p: {p + "resid2": t})]
    return spots + [(m.norm, "out", lambda t: {"ln_f.out": t}),
                    (model.lm_head, "out", lambda t: {"logits": t})]


def llama_weights(model, layers):
    """tfm's parameter name -> (Hugging Face's LLaMA leaf, transposed: nn.Linear's (out, in))."""
    m = model.model
    leaves = {"embed.W_E": (m.embed_tokens.weight, False), "ln_f.gamma": (m.norm.weight, False),
              "head.W_U": (model.lm_head.weight, True)}
    for i in range(layers):
        blk, p = m.layers[i], f"blocks.{i}."
        leaves.update({p + "ln1.gamma": (blk.input_layernorm.weight, False),
                       p + "attn.W_Q": (blk.self_attn.q_proj.weight, True),
                       p + "attn.W_K": (blk.self_attn.k_proj.weight, True),
                       p + "ffn.W_gate": (blk.mlp.gate_proj.weight, True),
                       p + "ffn.W_2": (blk.mlp.down_proj.weight, True)})
    return leaves


def torch_errors(model, spots, weights, inputs, truth, truth_grads, merged):
    """Hugging Face's run in its dtype: each captured tensor's, gradient's and weight
    gradient's relative RMS error against tfm's float64 run (``truth``; ``merged``: tfm's
    (B, H, T, d_head) heads as (B, T, H d_head), the projections' layout), and the loss."""
    import torch

    acts, grads, handles = captured(model, spots)
    keys = torch.as_tensor(np.arange(inputs.tokens.shape[1])[None] < inputs.lengths[:, None])
    out = model(input_ids=torch.as_tensor(inputs.tokens), attention_mask=keys.long(),
                output_attentions=True)
    for i, pattern in enumerate(out.attentions):
        acts[f"blocks.{i}.attn.pattern"] = pattern
        pattern.register_hook(lambda g, i=i: grads.__setitem__(f"blocks.{i}.attn.pattern", g))
    valid = torch.as_tensor((inputs.targets != tfmcli.IGNORE))
    # as Hugging Face's causal-LM loss makes it: the logits to float32 first
    loss = torch.nn.functional.cross_entropy(out.logits.float()[valid],
                                             torch.as_tensor(inputs.targets)[valid])
    loss.backward()
    for handle in handles:
        handle.remove()
    acts["logits"] = out.logits   # (for the next tokens: the model's own logits, unhooked)

    def numpy(t):
        return t.detach().double().numpy()

    errors = {name: rel_rms(numpy(t), merged(name, truth.acts[name]))
              for name, t in acts.items()}
    errors.update({"d" + name: rel_rms(numpy(g), merged(name, truth_grads.acts[name]))
                   for name, g in grads.items()})
    errors.update({"grad " + name: rel_rms(numpy(leaf.grad.T if turned else leaf.grad),
                                           truth_grads[name])
                   for name, (leaf, turned) in weights.items()})
    return errors, float(loss.detach()), numpy(out.logits)


def tfm_errors(params, inputs, cfg, dtype, truth, truth_grads, merged, names):
    low = cfg.replace(dtype=dtype)
    carried = {name: value.astype(np.float32) for name, value in params.items()}
    fwd = tfmcli.forward(carried, inputs, low)
    grads = tfmcli.backward(carried, fwd, low)
    ours = every_tensor(fwd, grads)
    theirs = every_tensor(truth, truth_grads)
    return {name: rel_rms(merged(name.removeprefix("d"), ours[name]),
                          merged(name.removeprefix("d"), theirs[name]))
            for name in names}, fwd.loss, fwd.acts["logits"]


def merged_heads(name, x):
    x = np.asarray(x, dtype=np.float64)
    return ops.merge_heads(x) if name.endswith(("attn.q", "attn.k", "attn.v")) else x


def assert_errs_as_torch(ours: dict, theirs: dict, dtype: str) -> list:
    """Each tensor's error within a factor of 2 of torch's where torch's is above rounding
    noise (a twentieth of eps); where it is not, tfm's too. Returns the ratios."""
    ratios = []
    for name, error in theirs.items():
        if error < EPS[dtype] / 20:
            assert ours[name] < EPS[dtype] / 10, (name, ours[name], error)
            continue
        ratios.append(ours[name] / error)
        if not 0.8 <= ratios[-1] <= 1.25:
            print(f"  {name} {ratios[-1]:.2f}")
        assert 0.5 <= ours[name] / error <= 2.0, (name, ours[name], error)
    print(f"\n{dtype}: {len(ratios)} tensors, tfm's error / torch's {min(ratios):.2f} to "
          f"{max(ratios):.2f}")
    return ratios


def assert_same_verdicts(ours, theirs, our_logits, their_logits, truth, inputs, dtype):
    """What tfm precision concludes, as torch's run would have it, at thresholds of 2 to 64
    eps: the first activation and the first gradient past the threshold (forward order; the
    backward's), and the positions where the most likely next token flips, near ties aside.

    Two runs whose errors agree within a factor of 2 (``assert_errs_as_torch``) can still
    name different first tensors when a tensor's error lies near the threshold: one run's
    3.3 eps, the other's 4.1 (another accumulation order in a kernel). So where the two name
    different tensors, the earlier one must be past half the threshold in the other run too:
    near the threshold, as a near tie is near a flip. Returns how many verdicts agreed
    exactly, and the flips."""
    eps, exact = EPS[dtype], 0
    orders = ([n for n in truth.acts if n in theirs],
              ["d" + n for n in reversed(truth.acts) if "d" + n in theirs])
    for threshold, order in itertools.product((2.0, 4.0, 8.0, 16.0, 64.0), orders):
        first = [next((n for n in order if errors[n] > threshold * eps), None)
                 for errors in (ours, theirs)]
        if first[0] == first[1]:
            exact += 1
            continue
        earlier = min((order.index(n), n) for n in first if n)[1]
        assert min(ours[earlier], theirs[earlier]) > threshold * eps / 2, (
            threshold, first, ours[earlier] / eps, theirs[earlier] / eps)
    return exact, assert_same_flips(our_logits, their_logits, truth, inputs, dtype)


def assert_same_flips(our_logits, their_logits, truth, inputs, dtype):
    """Every position where one run's most likely next token flips, past its near-tie
    margin (the top two further apart than NEAR_TIE times its own error in a difference of
    two logits there), flips in the other run too. Returns each run's flips."""
    from tfmcli.explain.precision import next_tokens

    flips = [{(p.row, p.position): p for p in next_tokens(truth.acts["logits"], logits, inputs,
                                                          EPS[dtype]) if p.flipped}
             for logits in (our_logits, their_logits)]
    for one, other in (flips, flips[::-1]):
        for spot, p in one.items():
            assert p.near_tie or spot in other, (spot, p)
    return flips


@pytest.mark.parametrize("dtype", ["float32", *ROUNDED])
@pytest.mark.parametrize("activation", ["gelu_pytorch_tanh", "gelu_new"])
def test_gpt2_errs_as_hugging_faces_gpt2_in_torch(tmp_path, dtype, activation):
    """GPT2LMHeadModel (eager attention) in float16 and bfloat16, padding included, at O(1)
    weights: every activation the blocks make, its gradient, and weight gradients. gelu_new is
    eight operations in Hugging Face (each rounded), tfm's GELU torch's one: within 0.88-1.08
    of torch's even so."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_embd=32, n_head=4, n_layer=2, vocab_size=300,
                                     n_positions=32, activation_function=activation)
    o1_gpt2(config, tmp_path)
    rng = np.random.default_rng(0)
    loaded = tfmcli.load(tmp_path, tokens=[list(map(int, rng.integers(0, 300, 12))),
                                           list(map(int, rng.integers(0, 300, 9)))])
    cfg, params, inputs = loaded.cfg, loaded.params, loaded.inputs
    truth = tfmcli.forward(params, inputs, cfg)
    truth_grads = tfmcli.backward(params, truth, cfg)
    model = transformers.GPT2LMHeadModel.from_pretrained(
        tmp_path, attn_implementation="eager", dtype=getattr(torch, dtype)).eval()
    theirs, their_loss, their_logits = torch_errors(
        model, gpt2_spots(model, cfg.d_model), gpt2_weights(model, cfg.layers), inputs, truth,
        truth_grads, merged_heads)
    ours, our_loss, our_logits = tfm_errors(params, inputs, cfg, dtype, truth, truth_grads,
                                            merged_heads, theirs)
    assert len(theirs) > 60
    assert len(assert_errs_as_torch(ours, theirs, dtype)) > 60
    exact, flips = assert_same_verdicts(ours, theirs, our_logits, their_logits, truth, inputs,
                                        dtype)
    print(f"\n{dtype}: {exact} of 10 first tensors the same, flips at {[sorted(f) for f in flips]}")
    assert exact >= 5, exact   # of the 10: the rest near the threshold
    assert abs(our_loss - their_loss) <= 4 * EPS[dtype] * abs(truth.loss)


@pytest.mark.parametrize("dtype", ["float32", *ROUNDED])
@pytest.mark.parametrize("family, std", [("Llama", 0.18), ("Llama", 0.3), ("Qwen2", 0.18)])
def test_llama_errs_as_hugging_faces_llama_in_torch(tmp_path, dtype, family, std):
    """LlamaForCausalLM (RMSNorm, RoPE, SwiGLU, 2 key heads of 4, eager attention) loaded in
    float16 and bfloat16 as from_pretrained(dtype=...) loads it (RoPE's frequencies kept in
    float32), weights of std ``std``; Qwen2ForCausalLM too (the same layers, and biases on
    the queries, keys and values)."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    config = getattr(transformers, f"{family}Config")(
        vocab_size=300, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, intermediate_size=48, max_position_embeddings=64,
        tie_word_embeddings=False)
    causal_lm = getattr(transformers, f"{family}ForCausalLM")
    model = causal_lm(config)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for key, p in model.named_parameters():
            centre, spread = (1.0, 0.1) if key.endswith("norm.weight") else (0.0, std)
            p.copy_(centre + spread * torch.randn(p.shape, generator=generator))
    model.save_pretrained(tmp_path)
    rng = np.random.default_rng(1)
    loaded = tfmcli.load(tmp_path, tokens=[list(map(int, rng.integers(0, 300, 16)))])
    cfg, params, inputs = loaded.cfg, loaded.params, loaded.inputs
    truth = tfmcli.forward(params, inputs, cfg)
    truth_grads = tfmcli.backward(params, truth, cfg)
    model = causal_lm.from_pretrained(
        tmp_path, attn_implementation="eager", dtype=getattr(torch, dtype)).eval()
    assert model.model.rotary_emb.inv_freq.dtype == torch.float32
    theirs, their_loss, their_logits = torch_errors(
        model, llama_spots(model), llama_weights(model, cfg.layers), inputs, truth, truth_grads,
        merged_heads)
    ours, our_loss, our_logits = tfm_errors(params, inputs, cfg, dtype, truth, truth_grads,
                                            merged_heads, theirs)
    assert len(theirs) > 60
    assert len(assert_errs_as_torch(ours, theirs, dtype)) > 60
    exact, flips = assert_same_verdicts(ours, theirs, our_logits, their_logits, truth, inputs,
                                        dtype)
    print(f"\n{dtype}: {exact} of 10 first tensors the same, flips at {[sorted(f) for f in flips]}")
    assert exact >= 5, exact   # of the 10: the rest near the threshold
    assert abs(our_loss - their_loss) <= 4 * EPS[dtype] * abs(truth.loss)


@pytest.mark.parametrize("dtype", ROUNDED)
def test_the_next_token_flips_where_torchs_does_but_for_near_ties(tmp_path, dtype):
    """288 positions of a LLaMA at weights of std 0.3: bfloat16 flips the most likely next
    token at 9 of them in tfm and 14 in torch, 7 of them the same. Every flip either run makes
    is a near tie by its own measure (the top two within 3 times its error in a difference
    of two logits there: gaps of 0.0 to 2.4 of it), and there the two runs' rounding orders
    decide: the issue's "within a few eps" is not margin enough (flips at 4.3 to 5.6 eps
    differ), the run's own error is."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=300, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, intermediate_size=48, max_position_embeddings=64,
        tie_word_embeddings=False)
    model = transformers.LlamaForCausalLM(config)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for key, p in model.named_parameters():
            centre, spread = (1.0, 0.1) if key.endswith("norm.weight") else (0.0, 0.3)
            p.copy_(centre + spread * torch.randn(p.shape, generator=generator))
    model.save_pretrained(tmp_path)
    rng = np.random.default_rng(1)
    loaded = tfmcli.load(tmp_path, tokens=[list(map(int, rng.integers(0, 300, 48)))
                                           for _ in range(6)])
    cfg, params, inputs = loaded.cfg, loaded.params, loaded.inputs
    truth = tfmcli.forward(params, inputs, cfg)
    model = transformers.LlamaForCausalLM.from_pretrained(
        tmp_path, attn_implementation="eager", dtype=getattr(torch, dtype)).eval()
    keys = torch.as_tensor(np.arange(48)[None] < inputs.lengths[:, None]).long()
    with torch.no_grad():
        theirs = model(input_ids=torch.as_tensor(inputs.tokens), attention_mask=keys).logits
    low = cfg.replace(dtype=dtype)
    ours = tfmcli.forward({n: v.astype(np.float32) for n, v in params.items()}, inputs, low)
    flips = assert_same_flips(ours.acts["logits"], theirs.double().numpy(), truth, inputs,
                              dtype)
    if dtype == "bfloat16":   # flips to compare: both runs make some, some the same
        assert len(flips[0]) >= 3 and len(flips[1]) >= 3 and flips[0].keys() & flips[1].keys()


# ---------------------------------------------------------------- the command line


@pytest.mark.parametrize("dtype", ROUNDED)
@pytest.mark.parametrize("command", [["forward"], ["backward"], ["attn"], ["kv"], ["lens"],
                                     ["train", "--steps", "3"], ["shapes"]])
def test_model_commands_run_rounded(command, dtype):
    result = ok(*command, "--dtype", dtype, "--arch", "llama")
    assert dtype in result.output or command[0] in ("kv", "lens", "train", "attn")


@pytest.mark.parametrize("command", ["gradcheck", "check"])
def test_the_checks_of_float64_refuse_a_rounded_run(command):
    line = error_line(run(command, "--dtype", "bfloat16"), 2)
    assert "'--dtype'" in line and "tfm precision --dtype bfloat16" in line


@pytest.mark.parametrize("dtype", ROUNDED)
def test_central_differences_of_a_rounded_run_are_refused_by_the_api(dtype):
    from tfmcli.check.gradcheck import gradcheck
    from tfmcli.errors import ConfigError

    cfg = tfmcli.Config(dtype=dtype)
    with pytest.raises(ConfigError, match=f"float64 or float32, not {dtype}"):
        gradcheck(tfmcli.init_params(cfg), tfmcli.make_inputs(cfg), cfg)


def test_a_float16_overflow_says_what_float16_holds_and_where_to_look():
    line = error_line(run("forward", "--dtype", "float16", "--scale",
                          "blocks.0.ln1.out=3000"), 1)
    assert "overflowed float16" in line and "--dtype float32" in line and "65504" in line
    assert "tfm precision --dtype float16 counts each tensor's overflows" in line


# ---------------------------------------------------------------- tfm precision: own and inherited


def report_of(cfg, params, inputs, dtype, threshold=4.0):
    from tfmcli.explain.precision import held_against_float64

    return held_against_float64(params, inputs, cfg, dtype, threshold)


def by_name(report) -> dict:
    return {e.name: e for e in report.activations + report.gradients + report.parameters}


def overflowing(seed=0):
    """Queries and keys of about 100 per entry (W_Q, W_K 100 times the identity): each score
    q . k about 8e4 before the 1/sqrt(d_head) scale, past float16's 65504."""
    cfg = tfmcli.Config(d_model=16, heads=2, layers=1, seq_len=5, batch=1, vocab=12,
                        seed=seed, activation="gelu")
    params = tfmcli.init_params(cfg)
    params["blocks.0.attn.W_Q"] = 100.0 * np.eye(16)
    params["blocks.0.attn.W_K"] = 100.0 * np.eye(16)
    return cfg, params, tfmcli.make_inputs(cfg)


def test_float16_overflows_in_the_scores_own_product():
    """q and k are fine in float16; their product is not: the scores' own operation makes inf
    from float64's own q and k rounded (not an error it inherits), the softmax of a row with
    inf makes NaN, and the scores are the first tensor named. bfloat16, float32's range, does
    not overflow."""
    cfg, params, inputs = overflowing()
    report = report_of(cfg, params, inputs, "float16")
    errors = by_name(report)
    q, k = errors["blocks.0.attn.q"], errors["blocks.0.attn.k"]
    scores = errors["blocks.0.attn.scores"]
    assert q.inf == k.inf == 0 and q.in_eps < 1 and k.in_eps < 1
    assert scores.inf > 0 and scores.rms == np.inf and scores.own == np.inf
    assert report.first(report.activations).name == "blocks.0.attn.scores"
    assert errors["blocks.0.attn.pattern"].nan > 0
    assert not report.first(report.activations[:report.activations.index(scores)])
    assert report.consistent
    bf16 = by_name(report_of(cfg, params, inputs, "bfloat16"))["blocks.0.attn.scores"]
    assert bf16.inf == 0 and bf16.in_eps < 4


def test_torch_overflows_where_tfm_does():
    """The same q and k as float16 tensors: torch's product overflows too, before any
    scale (tfm's scores round the product, then scale it, as Hugging Face's attention)."""
    torch = pytest.importorskip("torch")
    cfg, params, inputs = overflowing()
    fwd = tfmcli.forward(params, inputs, cfg)
    q, k = (torch.tensor(fwd.acts[f"blocks.0.attn.{n}"]).half() for n in "qk")
    theirs = torch.isinf(q @ k.transpose(-1, -2))
    with np.errstate(over="ignore"):
        carried = {name: value.astype(np.float32) for name, value in params.items()}
        ours = np.isinf(tfmcli.forward(carried, inputs, cfg.replace(dtype="float16"))
                        .acts["blocks.0.attn.scores"]) & np.tril(np.ones((5, 5), bool))
    np.testing.assert_array_equal(ours, theirs.numpy() & np.tril(np.ones((5, 5), bool)))
    assert theirs.any()


def test_a_product_scaled_before_its_rounding_is_caught(monkeypatch):
    """Planted: attention's steps not rounded between (the product scaled in float32 before
    float16 sees it, 2.8e4): no score overflows, and the test above fails."""
    monkeypatch.setattr(ops, "rounding", lambda: (lambda x: x))
    cfg, params, inputs = overflowing()
    scores = by_name(report_of(cfg, params, inputs, "float16"))["blocks.0.attn.scores"]
    assert scores.inf == 0


def drifting(layers=8):
    """Every block adds 0.001 to every entry twice (W_O and W_2 zero, b_O and b_2 0.001) to a
    stream of entries in [1, 2), where bfloat16's values are 2^-7 apart: each update is under
    half a gap, and rounds away."""
    cfg = tfmcli.Config(d_model=16, heads=2, layers=layers, seq_len=6, batch=1, vocab=12,
                        pe="none", activation="gelu")
    params = tfmcli.init_params(cfg)
    params["embed.W_E"] = np.random.default_rng(0).uniform(1.0, 2.0, (12, 16))
    for i in range(layers):
        p = f"blocks.{i}."
        params[p + "attn.W_O"] = np.zeros((16, 16))
        params[p + "ffn.W_2"] = np.zeros(params[p + "ffn.W_2"].shape)
        params[p + "attn.b_O"] = np.full(16, 1e-3)
        params[p + "ffn.b_2"] = np.full(16, 1e-3)
    return cfg, params, tfmcli.make_inputs(cfg)


def test_bfloat16_loses_a_small_residual_update_and_the_loss_is_inherited():
    """In bfloat16 the stream never moves: each block's output is its input, bit for bit,
    while float64's grows by 0.002 a block. Each sum's own error stays one rounding's; what
    it inherits grows block by block: the stream passes 1 eps in the seventh block. float16's
    gap there, 2^-10, keeps the updates."""
    cfg, params, inputs = drifting()
    from tfmcli.explain.precision import held_against_float64

    report = held_against_float64(params, inputs, cfg, "bfloat16", threshold=1.0)
    low = tfmcli.forward({n: precision.of("bfloat16").round(v) for n, v in params.items()},
                         inputs, cfg.replace(dtype="bfloat16"))
    for i in range(cfg.layers):
        np.testing.assert_array_equal(low.acts[f"blocks.{i}.out"], low.acts["blocks.0.in"])
    errors = by_name(report)
    streams = [errors[f"blocks.{i}.resid2"] for i in range(cfg.layers)]
    inherited = [e.inherited / e.eps for e in streams]
    assert all(b > a for a, b in zip(inherited, inherited[1:])), inherited
    assert all(e.own / e.eps < 0.5 for e in streams)
    assert inherited[-1] > 1.0 > streams[0].in_eps and inherited[-1] > 4 * streams[-1].own / \
        streams[-1].eps
    first = report.first([e for e in report.activations if "resid" in e.name])
    assert first.name == "blocks.6.resid1" and first.inherited > 2 * first.own
    assert report.consistent
    half = by_name(held_against_float64(params, inputs, cfg, "float16"))
    assert half[f"blocks.{cfg.layers - 1}.resid2"].in_eps < 1.0


@pytest.mark.parametrize("dtype", ["float32", *ROUNDED])
def test_the_split_adds_up_and_the_own_run_reads_float64_rounded(dtype):
    """At random O(1) weights in a LLaMA-like model: every tensor's error within its own plus
    its inherited; the first tensor's (the embedding's rows) all its own; float32's errors a
    few of its eps, not float64's noise."""

    cfg = arch_cfg("llama", layers=2)
    params = random_params(tfmcli.init_params(cfg), seed=5)
    report = report_of(cfg, params, tfmcli.make_inputs(cfg), dtype)
    assert report.consistent
    embed = report.activations[0]
    assert embed.name == "embed" and embed.inherited == 0 and embed.own == embed.rms > 0
    assert 0.05 < embed.in_eps < 0.5   # one rounding of each weight
    assert all(e.own / e.eps < 2 for e in report.activations)
    assert len(report.gradients) == len(report.activations)
    assert [e.name for e in report.parameters] == [f"grad {n}" for n in params]


def test_next_tokens_flip_where_the_dtype_moves_the_top_two_past_each_other():
    from tfmcli.engine.inputs import inputs_from_tokens
    from tfmcli.explain.precision import next_tokens

    truth = np.array([[[2.0, 1.0, 0.0], [1.0, 1.001, 0.0]]])
    low = np.array([[[2.0, 1.0, 0.0], [1.01, 1.0, 0.0]]])
    positions = next_tokens(truth, low, inputs_from_tokens([[0, 1]]), 2.0 ** -7)
    assert [p.flipped for p in positions] == [False, True]
    assert positions[1].truth == 1 and positions[1].low == 0 and positions[1].near_tie
    assert positions[0].kl == 0 and positions[1].kl > 0
    assert positions[0].gap == pytest.approx(1.0 / (2.0 * 2.0 ** -7))


# ---------------------------------------------------------------- tfm precision, the command


def test_precision_defaults_to_bfloat16_and_names_what_it_measured():
    result = ok("precision", "--arch", "llama", "-L", "2")
    out = result.output
    for words in ("activations, forward", "their gradients, backward",
                  "the parameters' gradients", "bfloat16, held against float64",
                  "first past 4 eps", "loss  float64", "KL(p_float64 ‖ p_bfloat16)",
                  "blocks.1.attn.scores", "dblocks.0.attn.k_rot", "ffn.W_gate"):
        assert words in out, words


def test_precision_json_carries_every_tensor():
    import json

    cfg = arch_cfg("gpt2")
    args = ["precision", "--arch", "gpt2", "--dtype", "float16", "-d", "16", "-H", "4", "-L",
            "2", "-T", "6", "-B", "2", "-V", "24", "--json"]
    data = json.loads(ok(*args).output)
    from tfmcli.engine.sizes import activation_shapes, param_shapes

    assert data["dtype"] == "float16" and data["eps"] == 2.0 ** -10
    assert [a["name"] for a in data["activations"]] == list(activation_shapes(cfg))
    assert [g["name"] for g in data["gradients"]] == ["d" + n for n in
                                                      reversed(activation_shapes(cfg))]
    assert [g["name"] for g in data["parameter_gradients"]] == ["grad " + n for n in
                                                                param_shapes(cfg)]
    row = data["activations"][0]
    assert {"rms", "max", "in_eps", "own", "inherited", "inf", "nan", "flushed"} <= set(row)
    assert len(data["positions"]) == 12 and data["config"]["dtype"] == "float16"
    assert set(data["loss"]) == {"float64", "float16"}


@pytest.mark.parametrize("dtype", ROUNDED)
def test_a_saved_run_is_cast_and_a_weight_past_float16_stops_the_command(tmp_path, dtype):
    """An .npz saved in a rounded dtype is held as a precision.Cast too (its float32 arrays
    of values not the dtype's: each rounded once); a weight past float16's 65504 stops the
    command in one line naming it, as an overflow of the run does; bfloat16 holds it."""
    from tfmcli.io import run_arrays, save_npz

    cfg = tfmcli.Config(layers=1, d_model=16, heads=2, vocab=24, seq_len=5, batch=1,
                        dtype=dtype)
    params = {name: value.astype(np.float32) for name, value in random_params(
        tfmcli.init_params(cfg.replace(dtype="float64")), seed=6).items()}
    save_npz(tmp_path / "run.npz", run_arrays(cfg, params, tfmcli.make_inputs(cfg)))
    loaded = tfmcli.load(tmp_path / "run.npz")
    assert isinstance(loaded.params, precision.Cast) and loaded.cfg.dtype == dtype
    np.testing.assert_array_equal(loaded.params["head.W_U"],
                                  precision.of(dtype).round(params["head.W_U"]))
    params["ln_f.beta"][3] = 1e5
    save_npz(tmp_path / "big.npz", run_arrays(cfg, params, tfmcli.make_inputs(cfg)))
    if dtype == "float16":
        line = error_line(run("forward", "--load", tmp_path / "big.npz"), 1)
        assert "overflowed float16" in line and "of ln_f.beta" in line and "65504" in line
    else:
        assert "loss = " in ok("forward", "--load", tmp_path / "big.npz").output


def test_precision_of_an_overflow_is_reported_not_refused(tmp_path):
    """A run that overflows is what tfm precision is for (the other commands refuse it): a
    saved .npz of float64 weights, read in its own float64 whatever --dtype names."""
    import json

    from tfmcli.io import run_arrays, save_npz

    cfg, params, inputs = overflowing()
    save_npz(tmp_path / "big.npz", run_arrays(cfg, params, inputs))
    args = ["--load", tmp_path / "big.npz", "--dtype", "float16"]
    data = json.loads(ok("precision", *args, "--json").output)
    scores = next(a for a in data["activations"] if a["name"] == "blocks.0.attn.scores")
    assert scores["inf"] > 0 and scores["rms"] == scores["own"] == "inf"
    assert data["first_activation_past_threshold"] == "blocks.0.attn.scores"
    text = ok("precision", *args).output
    assert "first past 4 eps: blocks.0.attn.scores (inf eps: own inf" in text


def test_precision_refuses_float64_as_the_dtype_under_test():
    line = error_line(run("precision", "--dtype", "float64"), 2)
    assert "'--dtype'" in line and "float32, float16 or bfloat16" in line


@pytest.mark.parametrize("cast", [True, False], ids=["cast", "plain"])
@pytest.mark.parametrize("dtype", ROUNDED)
@pytest.mark.parametrize("fields", [dict(), dict(pe="rope", rms_norm=True, activation="swiglu",
                                               bias=False, seq_len=128, vocab=500),
                                    dict(d_model=128, layers=4, seq_len=16, vocab=2000)],
                         ids=["gpt", "llama", "weights"])
def test_the_memory_estimate_counts_what_rounding_holds(dtype, fields, cast):
    """A rounded run's peak (tracemalloc) within 10% of its estimate: a tensor's rounding
    beside it and, with the weights in a plain dict (not a precision.Cast, as a run holds
    them), the weights as read, rounded, kept by the caches (sizes' "rounding"). On the
    weights' shape that copy is most of the peak beyond the weights: counted wrongly either
    way, the estimate is off by half or more."""
    import tracemalloc

    from tfmcli.engine.sizes import memory_estimate

    cfg = tfmcli.Config(**{**dict(d_model=64, heads=4, layers=2, seq_len=64, batch=2,
                                  vocab=200, dtype=dtype), **fields})
    params, inputs = tfmcli.init_params(cfg), tfmcli.make_inputs(cfg)
    if cast:
        params = precision.Cast(params, precision.of(dtype))
    tfmcli.backward(params, tfmcli.forward(params, inputs, cfg), cfg)   # imports made
    tracemalloc.start()
    try:
        fwd = tfmcli.forward(params, inputs, cfg)
        tfmcli.backward(params, fwd, cfg)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    estimate = memory_estimate(cfg, cast=cast)
    assert (estimate["rounding"] > estimate["params"]) == (not cast)
    assert 0.9 <= (estimate["total"] - estimate["params"]) / peak <= 1.1


@pytest.mark.parametrize("dtype", ["float32", *ROUNDED])
@pytest.mark.parametrize("arch", ["llama", "gpt2", "vaswani", "gpt_neox", "gemma2", "bloom",
                                  "qwen3"])
def test_a_streamed_comparison_is_the_whole_one_bit_for_bit(arch, dtype):
    """The three runs a block at a time, each block's tensors and weights let go once
    measured (the last block's kept for the backward, the others made again from their
    inputs): every number of the report the whole comparison's, exactly."""
    from tfmcli.explain.precision import held_against_float64

    cfg = arch_cfg(arch, layers=3)
    params = random_params(tfmcli.init_params(cfg), seed=3)
    inputs = tfmcli.make_inputs(cfg)
    whole = held_against_float64(params, inputs, cfg, dtype)
    seen = []
    streamed = held_against_float64(params, inputs, cfg, dtype, stream=True,
                                    progress=lambda done, total: seen.append((done, total)))
    assert streamed.to_dict() == whole.to_dict()
    assert seen == [(k, 6) for k in range(1, 7)]
    assert whole.truth is not None and streamed.truth is None
    # the float64 run kept whole is forward's and backward's, bit for bit
    truth = tfmcli.forward(params, inputs, cfg)
    grads = tfmcli.backward(params, truth, cfg)
    assert truth.loss == whole.truth.loss and list(truth.acts) == list(whole.truth.acts)
    assert all(np.array_equal(grads[n], whole.truth_grads[n]) for n in grads)


def test_a_streamed_comparison_holds_one_block_at_a_time(monkeypatch):
    """Streamed, no more than one block's weights are held at once, each read once a pass
    by the three runs between them (twice: the forward, then the backward)."""
    from tfmcli.explain import precision as module

    cfg = arch_cfg("llama", layers=4)
    params = random_params(tfmcli.init_params(cfg), seed=3)
    reads, most = [], []

    class Counting(dict):
        def __getitem__(self, name):
            reads.append(name)
            return dict.__getitem__(self, name)

    let_go = module.HeldBlock.let_go

    def watched(self, prefix):
        most.append(len({n.split(".")[1] for n in self.held if n.startswith("blocks.")}))
        let_go(self, prefix)

    monkeypatch.setattr(module.HeldBlock, "let_go", watched)
    module.held_against_float64(Counting(params), tfmcli.make_inputs(cfg), cfg, "bfloat16",
                                stream=True)
    assert max(most) == 1
    block = [n for n in params if n.startswith("blocks.1.")]
    assert all(reads.count(n) == 2 for n in block), {n: reads.count(n) for n in block}


def test_precision_streams_when_asked_and_says_so():
    whole = ok("precision", "--arch", "llama", "-L", "3", "--json")
    streamed = ok("precision", "--arch", "llama", "-L", "3", "--json", "--stream")
    assert json.loads(streamed.output) == json.loads(whole.output)
    line = error_line(run("precision", "--stream", "--save", "x.npz"), 2)
    assert "'--save'" in line and "no run to save" in line


@pytest.mark.parametrize("source", ["float32", "float64"])
def test_float16_rounding_from_the_bits_is_numpys_cast(source):
    """round_float16 against NumPy's own cast, bit for bit: random bit patterns (every
    exponent: subnormals, inf, NaN), values about float16's subnormal range and its largest;
    an overflow reported as the cast reports it, under the caller's errstate."""
    from tfmcli.engine.precision import round_float16

    rng = np.random.default_rng(0)
    unsigned = np.uint32 if source == "float32" else np.uint64
    bits = rng.integers(0, np.iinfo(np.int64).max, 2 ** 20, dtype=np.int64).astype(np.uint64)
    if source == "float64":
        bits = bits * np.uint64(2) + (bits & np.uint64(1))   # the sign bit too
    x = np.concatenate([bits.astype(unsigned).view(source), np.concatenate([
        rng.standard_normal(2 ** 16) * s for s in (1e-9, 6e-8, 3e-5, 1.0, 6.5e4)]).astype(source),
        np.array([65504, 65519.99, 65520, -65520, 2.0 ** -25, 3 * 2.0 ** -26, 0.0, -0.0,
                  np.inf, -np.inf, np.nan], source)])
    with np.errstate(all="ignore"):
        expected = x.astype(np.float16).astype(np.float32)
        got = round_float16(x)
    assert got.dtype == np.float32
    same = (expected.view(np.uint32) == got.view(np.uint32)) | (np.isnan(expected) &
                                                                np.isnan(got))
    assert same.all(), x[~same][:5]
    with np.errstate(over="raise"), pytest.raises(FloatingPointError, match="overflow"):
        round_float16(np.array([1.0, 7e4], source))
    with np.errstate(over="raise"):
        round_float16(np.array([1.0, np.inf, np.nan], source))   # not an overflow


@pytest.mark.parametrize("source", ["float32", "float64"])
def test_float16_rounding_of_large_tensors_is_numpys_cast_at_every_exponent(source):
    """A tensor of precision.SHORT entries or more is rounded a chunk at a time by float
    arithmetic (precision._float16_chunk): at every exponent from zero to float16's overflow,
    random mantissas, exact ties between two float16 values (the kept part's last bit even and
    odd), one below and one above each tie, both signs: NumPy's cast, bit for bit; a chunk
    with a value that may overflow, inf or NaN beside ordinary values too."""
    from tfmcli.engine.precision import CHUNK, LAYOUTS, SHORT, round_float16

    layout = LAYOUTS[np.dtype(source)]
    unsigned, drop = layout.unsigned, layout.mantissa - 10
    rng = np.random.default_rng(1)
    exponents = np.arange(0, layout.bias + 15, dtype=np.uint64)   # every field below 2^15
    high = rng.integers(0, 1 << 10, (exponents.size, 64), dtype=np.uint64)   # the kept bits
    tie = np.uint64(1 << (drop - 1))
    low = np.stack([rng.integers(0, 1 << drop, high.shape, dtype=np.uint64),  # anything
                    np.broadcast_to(tie, high.shape),                       # a tie
                    np.broadcast_to(tie - np.uint64(1), high.shape),       # just below
                    np.broadcast_to(tie + np.uint64(1), high.shape)])      # just above
    bits = ((exponents[:, None] << np.uint64(layout.mantissa)) | (high << np.uint64(drop)) | low)
    sign = np.uint64(1 << (8 * np.dtype(source).itemsize - 1))
    signs = rng.integers(0, 2, bits.shape, dtype=np.uint64) * sign
    x = (bits | signs).astype(unsigned).view(source).reshape(-1)
    wide = np.concatenate([x[:CHUNK - 3], np.array([6.55e4, np.inf, np.nan], source), x[:CHUNK]])
    past = np.repeat(np.array([65519.0, 65520.0, -65520.0, 2.0 ** 15], source), SHORT)
    for values in (x, wide, past):
        assert values.size >= SHORT
        with np.errstate(all="ignore"):
            expected = values.astype(np.float16).astype(np.float32)
            got = round_float16(values)
        same = (expected.view(np.uint32) == got.view(np.uint32)) | (np.isnan(expected)
                                                                    & np.isnan(got))
        assert same.all(), values[~same][:5]
    # ties to even, in the normal range and among the subnormals (multiples of 2^-24)
    for value, rounded in ((1 + 2.0 ** -11, 1.0), (1 + 3 * 2.0 ** -11, 1 + 2.0 ** -9),
                           (-(2.0 ** -25), -0.0), (3 * 2.0 ** -25, 2.0 ** -23)):
        got = round_float16(np.full(SHORT, value, source))
        assert got[0] == rounded and np.signbit(got[0]) == np.signbit(rounded)
    with np.errstate(over="raise"), pytest.raises(FloatingPointError, match="overflow"):
        round_float16(np.full(SHORT, 7e4, source))
    with np.errstate(over="raise"):
        round_float16(np.repeat(np.array([1.0, np.inf, np.nan], source), SHORT))


@pytest.mark.parametrize("source", ["float32", "float64"])
def test_bfloat16_rounding_of_large_tensors_is_ml_dtypes_cast(source):
    """A tensor of precision.SHORT entries or more is rounded to bfloat16 a chunk at a time
    (precision.round_bfloat16), any shape or layout: ml_dtypes's cast of the whole, bit for
    bit, over random bit patterns (inf and NaN among them)."""
    import ml_dtypes

    from tfmcli.engine.precision import SHORT

    rng = np.random.default_rng(2)
    unsigned = np.uint32 if source == "float32" else np.uint64
    bits = rng.integers(0, np.iinfo(np.int64).max, 3 * SHORT, dtype=np.int64).astype(np.uint64)
    x = (bits * np.uint64(2)).astype(unsigned).view(source)
    x[:SHORT] = rng.standard_normal(SHORT)
    x = x.reshape(-1, 64).T   # not contiguous
    with np.errstate(all="ignore"):
        expected = x.astype(ml_dtypes.bfloat16).astype(np.float32)
        got = precision.of("bfloat16").round(x)
    assert got.shape == x.shape and got.dtype == np.float32
    same = (expected.view(np.uint32) == got.view(np.uint32)) | (np.isnan(expected)
                                                                & np.isnan(got))
    assert same.all()


def test_rounding_shared_among_threads_is_the_same_bits(monkeypatch):
    """Outside a pass a large tensor's rounding is shared among tfm's threads: in parts cut on
    chunks, each rounded as in one piece, an overflow in the last part reported in the
    caller (float16's), NaN and inf where they were."""
    import ml_dtypes

    from tfmcli.engine import parallel
    from tfmcli.engine.precision import CHUNK, round_bfloat16, round_float16

    if parallel.blas_threads() is None:
        pytest.skip("no BLAS whose threads tfm can hold")
    pieces = []
    cut = parallel._run_parts
    monkeypatch.setattr(parallel, "SMALL", 1 << 10)
    monkeypatch.setattr(parallel, "_threads", lambda worth_sharing: 2)
    monkeypatch.setattr(parallel, "_run_parts", lambda part, parts, threads: (
        pieces.append(parts), cut(part, parts, threads)))
    rng = np.random.default_rng(3)
    x = (rng.standard_normal(4 * CHUNK + 5) * 1e-3).astype(np.float32)
    x[[7, 9]] = np.inf, np.nan
    x[-1] = 7e4
    with np.errstate(over="ignore"):
        for rounded, expected in ((round_float16(x), x.astype(np.float16)),
                                  (round_bfloat16(x), x.astype(ml_dtypes.bfloat16))):
            expected = expected.astype(np.float32)
            same = (rounded.view(np.uint32) == expected.view(np.uint32)) | (
                np.isnan(rounded) & np.isnan(expected))
            assert same.all()
    assert len(pieces) == 2 and all(len(parts) == 2 for parts in pieces)
    assert pieces[0][0].stop % CHUNK == 0
    with np.errstate(over="raise"), pytest.raises(FloatingPointError, match="overflow"):
        round_float16(x)
