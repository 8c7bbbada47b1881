"""tfm adam: a few entries of one parameter through a few Adam updates, every term written out,
against the engine's update and torch.optim.Adam."""

import json

import numpy as np
import pytest

import tfmcli
from helpers import assert_scaled_close, error_line, ok, random_params, run
from tfmcli.explain import adam
from tfmcli.train.optim import Adam, adam_step, warmup_lr


def setup(dtype="float64"):
    cfg = tfmcli.Config(layers=2, d_model=8, heads=2, vocab=11, seq_len=5, dtype=dtype)
    params = random_params(tfmcli.init_params(cfg), seed=5)
    return cfg, params, tfmcli.make_inputs(cfg)


@pytest.mark.parametrize("lr", [None, 0.03])
def test_each_term_is_adams_and_the_engine_leaves_the_same_entries(lr):
    cfg, params, inputs = setup()
    before = {n: p.copy() for n, p in params.items()}
    x = adam.explain(params, inputs, cfg, "blocks.1.attn.W_V", steps=4, k=3, warmup=10, lr=lr)
    for name, value in params.items():   # the caller's parameters are left as they were
        np.testing.assert_array_equal(value, before[name])
    g1 = tfmcli.backward(params, tfmcli.forward(params, inputs, cfg), cfg)["blocks.1.attn.W_V"]
    largest = np.sort(np.argsort(-np.abs(g1).reshape(-1))[:3])
    assert x.entries == [tuple(int(i) for i in np.unravel_index(f, (8, 8))) for f in largest]
    np.testing.assert_array_equal(x.p0, params["blocks.1.attn.W_V"].reshape(-1)[largest])
    first = x.steps[0]
    assert_scaled_close(first.m_hat, first.g)        # t = 1: m_hat = g
    assert_scaled_close(first.v_hat, first.g ** 2)   # v_hat = g^2
    # every entry moves by lr g / (|g| + eps): lr to 1e-8 here, whatever |g| is
    assert_scaled_close(first.update, first.lr * first.g / (np.abs(first.g) + 1e-9))
    np.testing.assert_allclose(np.abs(first.update), first.lr, rtol=1e-7)
    p, m, v = x.p0, 0.0, 0.0
    work = {n: value.copy() for n, value in params.items()}   # the training, again
    state = Adam.like(work)
    for s in x.steps:
        assert s.lr == (lr if lr is not None else warmup_lr(s.t, 8, 10))
        m, v = 0.9 * m + 0.1 * s.g, 0.98 * v + 0.02 * s.g ** 2
        assert_scaled_close(s.m, m)
        assert_scaled_close(s.v, v)   # 1 - 0.98 is not 0.02 exactly
        assert_scaled_close(s.m_hat * (1 - 0.9 ** s.t), s.m)
        assert_scaled_close(s.v_hat * (1 - 0.98 ** s.t), s.v)
        assert_scaled_close(s.update, s.lr * s.m_hat / (np.sqrt(s.v_hat) + 1e-9))
        p = p - s.update
        np.testing.assert_array_equal(s.p, p)
        np.testing.assert_allclose(s.engine_p, s.p, atol=1e-15)
        fwd = tfmcli.forward(work, inputs, cfg)
        assert s.loss == fwd.loss                               # the loss before this update
        grads = tfmcli.backward(work, fwd, cfg)
        np.testing.assert_array_equal(grads["blocks.1.attn.W_V"].reshape(-1)[largest], s.g)
        adam_step(work, grads, state, s.lr)
        np.testing.assert_array_equal(work["blocks.1.attn.W_V"].reshape(-1)[largest],
                                      s.engine_p)
    assert x.final.loss == tfmcli.forward(x.params, inputs, cfg).loss
    assert x.final.loss < x.steps[0].loss   # four small steps downhill


def test_every_step_matches_torch_adam():
    """torch.optim.Adam (0.9, 0.98, 1e-9), fed the hand-written backward's gradients at its own
    parameters, with the warm-up rate set each step: its entries, exp_avg and exp_avg_sq are
    the view's after every step, and every parameter equals the engine's at the end."""
    torch = pytest.importorskip("torch")
    cfg, params, inputs = setup()
    name = "blocks.0.ffn.W_1"
    x = adam.explain(params, inputs, cfg, name, steps=5, k=4, warmup=3)
    theirs = {n: torch.tensor(p.copy(), requires_grad=True) for n, p in params.items()}
    opt = torch.optim.Adam(theirs.values(), lr=1.0, betas=(0.9, 0.98), eps=1e-9)
    rows, cols = np.array(x.entries).T
    for s in x.steps:
        now = {n: t.detach().numpy().copy() for n, t in theirs.items()}
        grads = tfmcli.backward(now, tfmcli.forward(now, inputs, cfg), cfg)
        for n, t in theirs.items():
            t.grad = torch.tensor(grads[n])
        opt.param_groups[0]["lr"] = warmup_lr(s.t, cfg.d_model, 3)
        opt.step()
        state = opt.state[theirs[name]]
        np.testing.assert_allclose(theirs[name].detach().numpy()[rows, cols], s.p, atol=1e-15)
        assert_scaled_close(state["exp_avg"].numpy()[rows, cols], s.m)
        assert_scaled_close(state["exp_avg_sq"].numpy()[rows, cols], s.v)
    for n, t in theirs.items():
        np.testing.assert_allclose(t.detach().numpy(), x.params[n], atol=1e-14)


def test_a_float32_run_is_written_out_in_float64():
    cfg, params, inputs = setup("float32")
    x = adam.explain(params, inputs, cfg, "embed.W_E", steps=2, k=2, lr=0.01)
    assert x.steps[0].g.dtype == np.float64 and x.params["embed.W_E"].dtype == np.float32
    np.testing.assert_allclose(x.steps[-1].engine_p, x.steps[-1].p, atol=1e-6)


def test_explain_by_default_takes_3_steps_of_4_entries_on_the_schedule():
    cfg, params, inputs = setup()
    x = adam.explain(params, inputs, cfg, "blocks.0.ffn.b_1")
    assert len(x.steps) == 3 and len(x.entries) == 4
    assert [s.lr for s in x.steps] == [warmup_lr(t, 8, 100) for t in (1, 2, 3)]
    one = adam.explain(params, inputs, cfg, "ln_f.gamma", steps=1, k=1)   # the least
    assert len(one.steps) == 1 and one.entries == [(int(np.argmax(np.abs(
        tfmcli.backward(params, tfmcli.forward(params, inputs, cfg), cfg)["ln_f.gamma"]))),)]


def test_explain_refuses_a_parameter_or_a_count_it_cannot_follow():
    cfg, params, inputs = setup()
    with pytest.raises(ValueError, match="no parameter 'W_Q'"):
        adam.explain(params, inputs, cfg, "W_Q")
    for steps, k in ((0, 1), (1, 0)):
        with pytest.raises(ValueError, match=f"steps={steps}, k={k}; each must be at least 1"):
            adam.explain(params, inputs, cfg, "embed.W_E", steps, k)


def test_cli_adam_json_follows_the_entries(tmp_path):
    data = json.loads(ok("adam", "--param", "blocks.0.attn.W_Q", "--lr", 0.01, "--steps", 2,
                         "-k", 3, "--json", "--save", tmp_path / "after.npz").stdout)
    cfg = tfmcli.Config()
    x = adam.explain(tfmcli.init_params(cfg), tfmcli.make_inputs(cfg), cfg,
                     "blocks.0.attn.W_Q", steps=2, k=3, lr=0.01)
    assert data["entries"] == [list(e) for e in x.entries] and len(data["steps"]) == 2
    assert data["lr"] == 0.01 and data["warmup"] is None and data["param"] == "blocks.0.attn.W_Q"
    for mine, s in zip(data["steps"], x.steps):
        assert mine["t"] == s.t and mine["lr"] == 0.01 and mine["loss"] == s.loss
        for key, value in (("g", s.g), ("m", s.m), ("v", s.v), ("m_hat", s.m_hat),
                           ("v_hat", s.v_hat), ("step", s.update), ("p", s.p),
                           ("engine_p", s.engine_p)):
            assert mine[key] == value.tolist(), key
    assert data["final_loss"] == x.final.loss and data["engine_diff"] < 1e-15
    with np.load(tmp_path / "after.npz") as npz:   # the parameters after the steps
        np.testing.assert_array_equal(npz["param/blocks.0.attn.W_Q"],
                                      x.params["blocks.0.attn.W_Q"])
        assert float(npz["loss"]) == x.final.loss
    default = json.loads(ok("adam", "--json").stdout)
    assert default["param"] == "blocks.0.ffn.W_1" and default["warmup"] == 100
    assert len(default["steps"]) == 3 and len(default["entries"]) == 4


def test_cli_adam_prints_each_step():
    out = ok("adam").stdout
    lines = out.splitlines()
    assert "lr = d^-0.5 min(t^-0.5, t warmup^-1.5), d 6, warmup 100" in lines
    assert "step 1: lr 4.0825e-04, loss before it 2.586820" in lines
    assert "loss: 2.586820 → 2.552663 → 2.486563 → 2.394393" in lines
    assert "the 4 entries of blocks.0.ffn.W_1 with the largest gradient at step 1" in lines
    header = next(line for line in lines if "[0,4]" in line)
    assert header.split() == ["[0,4]", "[2,4]", "[3,18]", "[4,4]"]
    step = next(line for line in lines if line.split()[:1] == ["step"] and len(line.split()) == 5)
    assert step.split()[1:] == ["-4.0825e-04", "-4.0825e-04", "+4.0825e-04", "+4.0825e-04"]
    assert "about lr whatever the size of its gradient" in " ".join(out.split())
    note = next(i for i, line in enumerate(lines) if line.startswith("at t = 1 the"))
    after = next(i for i in range(note, len(lines)) if lines[i].startswith("step 2:"))
    assert lines[note - 10].startswith("step 1:") and after - note <= 3   # the note, wrapped
    constant = ok("adam", "--lr", "0.5", "--steps", 1).stdout
    assert "constant lr 0.5" in constant and "tfm adam: blocks.0.ffn.W_1, 1 step " in constant
    assert "tfm adam: blocks.0.ffn.W_1, 2 steps " in ok("adam", "--steps", 2).stdout
    ok("adam", "--warmup", 1, "--steps", 1)                              # the least warm-up
    ok("adam", "--param", "blocks.0.ln1.gamma", "-k", 6, "--steps", 1)    # every entry


@pytest.mark.parametrize("args, option, needle", [
    (["--param", "W_Q"], "'--param'", "did you mean blocks.0.attn.W_Q"),
    (["--param", "blocks.0.ln1.gamma", "-k", "7"], "'-k'", "has 6 entries"),
    (["--steps", "11"], "'--steps'", "1..10"),
    (["-k", "9"], "'-k'", "1..8"),
    (["--lr", "-1"], "'--lr'", "a positive number"),
    (["--lr", "0"], "'--lr'", "a positive number"),
    (["--warmup", "0"], "'--warmup'", "0"),
    (["--lr", "0.1", "--warmup", "5"], "'--warmup'", "give one of --lr and --warmup"),
])
def test_bad_adam_options(args, option, needle):
    line = error_line(run("adam", *args), 2)
    assert option in line and needle in line


def test_a_rate_that_overflows_is_one_line():
    line = error_line(run("adam", "--lr", "1e300", "--steps", 2), 1)
    assert "use a smaller --lr" in line


def test_read_only_weights_are_refused_before_anything_changes():
    """A bfloat16 run's weights are read-only (precision.Cast): adam_step says so and leaves
    its state as it was (not half a step taken); a copy of them steps."""
    loaded = tfmcli.load(None, layers=1, d_model=16, heads=2, vocab=24, seq_len=5,
                         dtype="bfloat16")
    params, cfg = loaded.params, loaded.cfg
    grads = tfmcli.backward(params, tfmcli.forward(params, loaded.inputs, cfg), cfg)
    state = Adam.like(loaded.params)
    with pytest.raises(ValueError, match="read-only.*give a copy"):
        adam_step(loaded.params, grads, state, 1e-3)
    assert state.t == 0 and all(not m.any() for m in state.m.values())
    copy = {name: value.copy() for name, value in loaded.params.items()}
    adam_step(copy, grads, state, 1e-3)
    assert state.t == 1 and not np.array_equal(copy["ln_f.gamma"], loaded.params["ln_f.gamma"])
