"""Training: the hand-written Adam against torch's, the warm-up schedule, the toy tasks, and
`tfm train` learning copy and reverse."""

import contextlib
import json
import re
import time

import numpy as np
import pytest

import tfmcli
from helpers import assert_scaled_close, error_line, ok, run
from tfmcli.engine.inputs import IGNORE
from tfmcli.train.loop import train
from tfmcli.train.optim import Adam, adam_step, warmup_lr
from tfmcli.train.tasks import answer, make_batch


@pytest.fixture(autouse=True)
def plain_env(monkeypatch):
    for name in ("NO_COLOR", "FORCE_COLOR", "COLUMNS"):
        monkeypatch.delenv(name, raising=False)


def test_adam_equals_torch_on_the_same_gradients():
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(0)
    params = {"a": rng.normal(size=(3, 4)), "b": rng.normal(size=5)}
    leaves = {n: torch.tensor(p.copy(), requires_grad=True) for n, p in params.items()}
    reference = torch.optim.Adam(leaves.values(), lr=1.0, betas=(0.9, 0.98), eps=1e-9)
    state = Adam.like(params)
    for step in range(1, 8):
        lr = warmup_lr(step, 16, 3)
        grads = {
            n: rng.normal(size=p.shape) * 10.0 ** rng.integers(-3, 2) for n, p in params.items()
        }
        adam_step(params, grads, state, lr)
        for group in reference.param_groups:
            group["lr"] = lr
        for n, leaf in leaves.items():
            leaf.grad = torch.tensor(grads[n])
        reference.step()
        for n in params:
            np.testing.assert_allclose(params[n], leaves[n].detach().numpy(), rtol=1e-12, atol=0)
    assert state.t == 7


@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_adam_is_its_formulas_to_the_bit_in_either_dtype(dtype):
    """adam_step's numbers are its docstring's formulas as NumPy computes them, bit for bit,
    the types included: in float32 the denominator, and the step divided by it, are float64
    (np.sqrt of the correction is a NumPy float64), and p takes the difference back in float32.
    A rewrite that computes in place (out=) must keep that."""
    rng = np.random.default_rng(1)
    params = {"a": rng.normal(size=(6, 5)).astype(dtype), "b": rng.normal(size=7).astype(dtype)}
    mine, state = {n: p.copy() for n, p in params.items()}, Adam.like(params)
    m = {n: np.zeros_like(p) for n, p in params.items()}
    v = {n: np.zeros_like(p) for n, p in params.items()}
    b1, b2, eps = state.beta1, state.beta2, state.eps
    for t in range(1, 6):
        lr = warmup_lr(t, 16, 3)
        grads = {n: (rng.normal(size=p.shape) * 10.0 ** rng.integers(-5, 3)).astype(dtype)
                 for n, p in params.items()}
        adam_step(mine, grads, state, lr)
        for n, p in params.items():
            g = grads[n]
            m[n] = b1 * m[n] + (1 - b1) * g
            v[n] = b2 * v[n] + (1 - b2) * g * g
            denom = np.sqrt(v[n]) / np.sqrt(1 - b2 ** t) + eps
            p -= (lr / (1 - b1 ** t)) * m[n] / denom
            for got, want in ((mine[n], p), (state.m[n], m[n]), (state.v[n], v[n])):
                assert got.dtype == want.dtype == np.dtype(dtype)
                np.testing.assert_array_equal(got, want)


def test_adam_moves_against_the_gradient_by_about_lr_at_first():
    params = {"w": np.array([1.0, -2.0, 0.5])}
    adam_step(params, {"w": np.array([3.0, -0.01, 0.0])}, Adam.like(params), lr=0.1)
    # step 1: m_hat = g, v_hat = g^2, so each moves by lr * sign(g) (0 stays)
    np.testing.assert_allclose(params["w"], [0.9, -1.9, 0.5], rtol=1e-7)


def test_adam_refuses_a_nan_or_negative_rate_before_changing_anything():
    """torch.optim.Adam refuses them too. Before, lr=NaN made every parameter NaN and counted
    the step. A rate of 0 is allowed (the moments still update)."""
    params = {"w": np.array([1.0, -2.0])}
    state = Adam.like(params)
    for lr in (float("nan"), -1e-3):
        with pytest.raises(ValueError, match="adam_step: lr=.*; it must be a number at least 0"):
            adam_step(params, {"w": np.array([3.0, 1.0])}, state, lr)
    assert state.t == 0 and params["w"].tolist() == [1.0, -2.0]
    assert state.m["w"].tolist() == [0.0, 0.0]
    adam_step(params, {"w": np.array([3.0, 1.0])}, state, 0.0)
    assert state.t == 1 and params["w"].tolist() == [1.0, -2.0]
    assert_scaled_close(state.m["w"], [0.3, 0.1])


def test_warmup_schedule_of_seed_004():
    """d_model = 512, warmup = 200: it rises linearly, peaks at step 200 at (512*200)^-0.5."""
    lrs = [warmup_lr(step, 512, 200) for step in range(1, 1001)]
    assert int(np.argmax(lrs)) + 1 == 200
    assert max(lrs) == pytest.approx(0.003125, rel=1e-12)
    assert lrs[99] == pytest.approx(lrs[199] / 2, rel=1e-12)      # linear before the peak
    assert lrs[799] == pytest.approx(lrs[199] / 2, rel=1e-12)     # 1/sqrt(step) after it


def test_the_schedule_and_the_batches_refuse_counts_below_one():
    """Before, a step or warm-up of 0 was a ZeroDivisionError, n = 0 an IndexError, and a batch
    of 0 an empty batch whose loss is a mean over nothing."""
    for args, name in (((0, 32, 10), "step=0"), ((1, 32, 0), "warmup=0"),
                       ((1, 0, 10), "d_model=0")):
        with pytest.raises(ValueError, match=f"warmup_lr: {name}; it must be at least 1"):
            warmup_lr(*args)
    rng = np.random.default_rng(0)
    for args, name in (((0, 4, 10), "batch=0"), ((2, 0, 10), "n=0"), ((2, 4, 0), "symbols=0")):
        with pytest.raises(ValueError, match=f"make_batch: {name}; it must be at least 1"):
            make_batch("copy", rng, *args)


def test_make_batch_draws_every_symbol_and_takes_counts_of_one():
    inputs = make_batch("copy", np.random.default_rng(0), 64, 8, 10)
    assert set(inputs.tokens[:, :8].ravel()) == set(range(10))      # 0..9; 10 is the separator
    one = make_batch("sort", np.random.default_rng(0), 1, 1, 1)       # the smallest batch there is
    assert one.tokens.tolist() == [[0, 1]] and one.targets.tolist() == [[IGNORE, 0]]
    assert one.lengths.tolist() == [2]


def test_train_refuses_weights_that_do_not_fit_before_its_first_step():
    """Only the first step checks (the later ones skip it); a refusal there leaves every weight
    as it was and reports no step."""
    cfg = tfmcli.Config(batch=2, seq_len=8, vocab=11, d_model=8, heads=2)
    params = tfmcli.init_params(cfg)
    before = {name: array.copy() for name, array in params.items()}
    steps = []
    with pytest.raises(tfmcli.InputsError, match="this Config's dtype is float32"):
        train(params, cfg.replace(dtype="float32"), "copy", np.random.default_rng(0), steps=3,
              n=4, symbols=10, warmup=10, on_step=lambda *step: steps.append(step))
    assert steps == []
    for name, array in params.items():
        np.testing.assert_array_equal(array, before[name])


@pytest.mark.parametrize("task", ["copy", "reverse", "sort"])
def test_make_batch_scores_only_the_answer(task):
    inputs = make_batch(task, np.random.default_rng(1), 5, 4, 10)
    assert inputs.tokens.shape == inputs.targets.shape == (5, 8)
    assert np.all(inputs.targets[:, :4] == IGNORE)
    assert np.all(inputs.tokens[:, 4] == 10)                         # the separator
    expected = answer(task, inputs.tokens[:, :4])
    np.testing.assert_array_equal(inputs.targets[:, 4:], expected)
    np.testing.assert_array_equal(inputs.tokens[:, 5:], expected[:, :-1])
    if task == "reverse":
        np.testing.assert_array_equal(expected, inputs.tokens[:, 3::-1])


def test_train_learns_copy_with_the_defaults():
    data = json.loads(ok("train", "--task", "copy", "--json").stdout)
    assert set(data) >= {"task", "steps", "loss", "final_accuracy"}
    assert data["task"] == "copy" and data["steps"] == 600 and len(data["loss"]) == 600
    assert data["loss"][0][0] == 1 and data["loss"][-1][0] == 600
    assert data["final_accuracy"] >= 0.95
    assert data["loss"][-1][1] < data["loss"][0][1] / 100


def test_trained_reverse_attends_to_the_mirror_position(tmp_path):
    """Query n + i (reading the answer's token i - 1) looks at prompt position n - 1 - i."""
    path = tmp_path / "reverse.npz"
    data = json.loads(ok("train", "--task", "reverse", "--json", "--save", path).stdout)
    assert data["final_accuracy"] >= 0.95
    tokens = "3,1,4,1,5,9,2,6,10,6,2,9,5,1,4,1"
    result = json.loads(ok("forward", "--load", path, "--tokens", tokens, "--save",
                           tmp_path / "look.npz", "--json").stdout)
    assert result["config"]["seq_len"] == 16
    with np.load(tmp_path / "look.npz") as run_file:
        pattern = run_file["act/blocks.0.attn.pattern"][0]            # (H, T, T)
    n = 8
    mirrored = [max(pattern[h, q, 2 * n - 1 - q] for h in range(pattern.shape[0]))
                for q in range(n, 2 * n)]
    assert min(mirrored) > 0.5, mirrored
    # and it writes a prompt backwards, one token at a time with the KV cache (the README's)
    data = json.loads(ok("kv", "--load", path, "--tokens", "5,7,7,1,0,3,9,2,10", "--generate", 8,
                         "--json").stdout)
    assert data["generated"] == [2, 9, 3, 0, 1, 7, 7, 5]
    assert data["max_abs_diff"] <= 1e-12
    # Issue 58: the README's next command scored the prompt, which training never scored, and
    # showed a loss of 7.35 for a model that answers right: it scores the answers by default
    answers = ok("forward", "--load", path, "--tokens", "1,2,3,4,5,6,7,8,10,8,7,6,5,4,3,2")
    assert "│ scored         answers (from separator 10 on), as trained; --score-all: all" \
        in answers.stdout
    assert "│ row 0 targets  — — — — — — — — 8 7 6 5 4 3 2 —" in answers.stdout
    loss = float(re.search(r"loss = ([\d.]+)  \(mean cross-entropy over 7 positions\)",
                           answers.stdout)[1])
    assert loss < 0.01
    every = json.loads(ok("forward", "--load", path, "--tokens",
                          "1,2,3,4,5,6,7,8,10,8,7,6,5,4,3,2", "--score-all", "--json").stdout)
    assert every["loss"] > 1 and every["inputs"]["targets"][0][:8] == [2, 3, 4, 5, 6, 7, 8, 10]
    with np.load(path) as saved:
        assert json.loads(str(saved["task"][()])) == {"task": "reverse", "n": 8, "symbols": 10}


def test_a_small_model_trains_on_one_blas_thread_to_the_same_numbers(monkeypatch):
    """Every product of the default model is small, so its steps run on one BLAS thread (much
    faster when another program has a core), and give the same bits as on BLAS's threads."""
    import tfmcli.train.loop as training
    from tfmcli.engine import parallel

    cfg = tfmcli.Config(batch=32, seq_len=16, d_model=32, heads=2, vocab=11)   # the defaults'
    assert training.small(cfg)
    assert not training.small(cfg.replace(d_model=512, batch=8, seq_len=256))

    def trained(**kwargs):
        params = tfmcli.init_params(cfg)
        training.train(params, cfg, "copy", np.random.default_rng(0), steps=5, n=8,
                       symbols=10, warmup=100, **kwargs)
        return params

    control = parallel.blas_threads()
    if control is None:
        pytest.skip("NumPy's BLAS here is not an OpenBLAS tfm can hold")
    before, threads = control[0](), []
    held = trained(on_step=lambda *_: threads.append(control[0]()))
    assert threads == [1] * 5 and control[0]() == before          # held, then given back
    monkeypatch.setattr(parallel, "one_blas_thread", contextlib.nullcontext)
    loose = trained()
    for name in held:
        np.testing.assert_array_equal(held[name], loose[name])


def test_saved_training_run_reloads_to_the_same_numbers(tmp_path):
    path = tmp_path / "copy.npz"
    ok("train", "--steps", 30, "--save", path)
    with np.load(path) as saved:
        cfg = tfmcli.Config.from_json(str(saved["config"][()]))
        params = {k[6:]: saved[k] for k in saved.files if k.startswith("param/")}
        inputs = tfmcli.Inputs(
            saved["input/tokens"], saved["input/targets"], saved["input/lengths"]
        )
        assert float(saved["loss"]) == tfmcli.forward(params, inputs, cfg).loss
    assert cfg.batch == 4 and cfg.seq_len == 16 and cfg.vocab == 11 and cfg.d_model == 32
    again = json.loads(ok("forward", "--load", path, "--json").stdout)
    assert again["loss"] == tfmcli.forward(params, inputs, cfg).loss


def test_train_prints_the_curve_predictions_and_maps():
    out = ok("train", "--steps", 40, "--task", "sort").stdout
    for needle in ("training loss", "learning rate", "held-out predictions",
                   "block 0 head 1", "attention patterns, batch row 0", "held-out token accuracy",
                   "peak 0.01768 at step 100"):
        assert needle in out
    assert "q8:10" in out   # the separator's row, labelled with its token
    lines = out.splitlines()

    def rows(title):   # the curve's rows: from its title to its x axis
        start = next(i for i, line in enumerate(lines) if line.startswith(title))
        return [line for line in lines[start + 1:start + 12] if "┤" in line or "│" in line]
    assert len(rows("training loss")) == 8 and len(rows("learning rate")) == 5
    # the held-out examples: a header, then four rows of 8 + 8 + 8 symbols and a count, no gaps
    start = next(i for i, line in enumerate(lines) if "held-out predictions" in line)
    assert lines[start + 1].split() == ["prompt", "answer", "predicted", "right"]
    assert [len(line.split()) for line in lines[start + 2:start + 6]] == [25] * 4
    assert re.fullmatch(r"[0-8]/8", lines[start + 5].split()[-1])


def test_train_notes_the_maps_a_narrow_screen_leaves_out(monkeypatch):
    """One block of two heads: at 40 x 30 the second map fits neither beside the first nor
    under it."""
    monkeypatch.setenv("COLUMNS", "40")
    monkeypatch.setenv("LINES", "30")
    out = ok("train", "--steps", 1).stdout
    assert "block 0 head 0" in out and "block 0 head 1" not in out
    assert "showing 1 of 2 attention maps" in " ".join(out.split())


def test_train_takes_two_symbols():
    data = json.loads(ok("train", "--steps", 1, "--symbols", 2, "--json").stdout)
    assert data["config"]["vocab"] == 3   # the two and the separator


def test_train_describes_its_task_in_the_panel():
    out = " ".join(ok("train", "--steps", 1, "--symbols", 5, "-n", 4).stdout.split())
    assert "copy: 4 symbols of 0..4, separator 5, then the answer" in out


def test_train_takes_a_learning_rate_under_one():
    data = json.loads(ok("train", "--steps", 1, "--lr", "0.5", "--json").stdout)
    assert data["lr"] == [[1, 0.5]]   # a constant rate, not the warm-up schedule


def test_train_warms_up_over_a_single_step():
    """d^-0.5 min(t^-0.5, t warmup^-1.5) with warmup 1: 32^-0.5, then 32^-0.5 2^-0.5."""
    data = json.loads(ok("train", "--steps", 2, "--warmup", 1, "--json").stdout)
    assert data["config"]["d_model"] == 32
    assert data["lr"] == [[1, pytest.approx(32**-0.5)], [2, pytest.approx(32**-0.5 * 2**-0.5)]]


def test_train_reports_the_seconds_its_steps_took():
    """The steps alone: more than nothing, less than the whole command."""
    started = time.perf_counter()
    data = json.loads(ok("train", "--steps", 3, "--json").stdout)
    assert 0 < data["seconds"] < time.perf_counter() - started


def test_train_shows_the_given_tokens():
    out = ok("train", "--steps", 5, "--tokens", "1,2,3,10,1,2").stdout
    assert "row 0 tokens   1 2 3 10 1 2" in out and "k3:10" in out


@pytest.mark.parametrize("args, option, needle", [
    (["--lr", "0"], "'--lr'", "allowed: a positive number"),
    (["--tokens", "1,2,11"], "'--tokens'", "id 11 is outside 0..10"),
    (["--task", "add"], "'--task'", "copy"),
    (["--len", "0"], "'--len'", "allowed: 1..256"),
    # (a bad --len after it: were 1000001 allowed, the test fails at once instead of training)
    (["--steps", "1000001", "--len", "0"], "'--steps'", "allowed: 1..1000000"),
    (["--symbols", "1"], "'--symbols'", "allowed: 2..10000"),
])
def test_bad_train_options(args, option, needle):
    line = error_line(run("train", *args), 2)
    assert option in line and needle in line


def test_answer_targets_score_from_the_separator_as_training_does():
    """The rule `tfm train`'s models are scored by, against make_batch's own targets."""
    from tfmcli.train.tasks import answer_targets, every_target

    batch = make_batch("reverse", np.random.default_rng(3), 5, 4, 7)
    everything = every_target(batch)
    assert (everything.targets[:, :-1] == batch.tokens[:, 1:]).all()
    assert (everything.targets[:, -1] == IGNORE).all()
    # the same but for the last position, whose target (the answer's last symbol) no token holds
    np.testing.assert_array_equal(answer_targets(everything, 7).targets[:, :-1],
                                  batch.targets[:, :-1])
    rows = tfmcli.inputs_from_tokens([[1, 2, 7, 2, 1], [3, 3, 3], [4, 4, 7]])
    scored = answer_targets(rows, 7).targets.tolist()
    assert scored[0] == [IGNORE, IGNORE, 2, 1, IGNORE]      # from the separator on
    assert scored[1] == [3, 3, IGNORE, IGNORE, IGNORE]      # no separator: every position
    assert scored[2] == [4, 7, IGNORE, IGNORE, IGNORE]      # nothing after it: every position


def test_a_bad_task_key_is_one_line(tmp_path):
    path = tmp_path / "copy.npz"
    ok("train", "--steps", 3, "--save", path)
    with np.load(path) as saved:
        arrays = dict(saved)
    arrays["task"] = np.array('{"task": "juggle", "n": 8, "symbols": 10}')
    np.savez(tmp_path / "bad.npz", **arrays)
    assert "key 'task' is not a task tfm train saved" in error_line(
        run("forward", "--load", tmp_path / "bad.npz"), 1)


def test_train_scores_given_tokens_as_it_trained():
    text = ok("train", "--steps", 3, "--tokens", "1,2,10,2,1").stdout
    assert "│ row 0 targets  — — 2 1 —" in text
    assert "scored         answers (from separator 10 on), as trained" in text
    every = ok("train", "--steps", 3, "--tokens", "1,2,10,2,1", "--score-all").stdout
    assert "│ row 0 targets  2 10 2 1 —" in every


def test_the_panel_says_the_batch_shown_is_not_the_training_batch():
    """Issue 58: the panel said B=4 while the model trained on batches of 32."""
    text = ok("train", "--steps", 3).stdout
    assert "│ sizes          B=4 shown (trained in batches of 32) T=16 d=32" in text
    assert "B=1 shown (trained in batches of 8)" in ok("train", "--steps", 3, "-B", 8,
                                                      "--tokens", "1,2,10,2,1").stdout


def test_training_that_would_not_fit_is_refused_before_it_starts():
    """Issue 59: tfm train had no memory guard: a huge batch, width or vocabulary ran until the
    machine was out of memory."""
    line = error_line(run("train", "-d", 4096, "-B", 64, "--symbols", 9999, "--len", 256), 2)
    assert "this run needs about" in line and "for a training step, the held-out pass and " \
        "Adam's state" in line and line.endswith("or pass --force")


def test_a_diverging_run_says_at_which_step_the_loss_stopped_being_finite():
    """Issue 59: a run that diverged to NaN crashed the drawing."""
    assert error_line(run("train", "--lr", "1e300", "--steps", 5), 1) == (
        "tfm train: error: the loss stopped being finite at step 2 (it was 2.82343 at step 1); "
        "try a smaller --lr or a longer --warmup")
