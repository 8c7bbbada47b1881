"""Files: atomic --save, and --load of runs saved here or made elsewhere, with every way to fail."""

import json
import os

import numpy as np
import pytest
from typer.testing import CliRunner

import tfmcli
from helpers import error_line, ok, random_params, run
from tfmcli import io
from tfmcli.cli import app  # noqa: F401

runner = CliRunner()


@pytest.fixture(autouse=True)
def plain_env(monkeypatch):
    for name in ("NO_COLOR", "FORCE_COLOR", "COLUMNS"):
        monkeypatch.delenv(name, raising=False)


def saved(tmp_path, *flags, name="run.npz"):
    path = tmp_path / name
    result = run("backward", *flags, "--save", path)
    assert result.exit_code == 0, result.output
    return path


def rewrite(path, out, change):
    """Copy an npz with ``change(arrays)`` applied."""
    with np.load(path, allow_pickle=False) as npz:
        arrays = {key: npz[key] for key in npz.files}
    change(arrays)
    np.savez(out, **arrays)
    return out


def loss_of(*args):
    result = run(*args, "--json")
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)["loss"]


# ---------------------------------------------------------------- save


def test_save_layout_has_every_section(tmp_path):
    path = saved(tmp_path, "--norm", "post")
    cfg = tfmcli.Config(norm="post")
    fwd = tfmcli.forward(tfmcli.init_params(cfg), tfmcli.make_inputs(cfg), cfg)
    with np.load(path, allow_pickle=False) as npz:
        keys = set(npz.files)
        assert {f"act/{n}" for n in fwd.acts} <= keys
        assert {f"actgrad/{n}" for n in fwd.acts} <= keys
        assert {f"grad/{n}" for n in tfmcli.engine.sizes.param_shapes(cfg)} <= keys
        assert json.loads(str(npz["config"]))["norm"] == "post"
        assert npz["config"].shape == () and npz["loss"].shape == ()


def test_save_replaces_an_existing_file_only_on_success(tmp_path, monkeypatch):
    path = tmp_path / "run.npz"
    path.write_bytes(b"previous contents")

    def broken_savez(file, **arrays):
        file.write(b"PK partial")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(io.np, "savez", broken_savez)
    line = error_line(run("forward", "--save", path), 1)
    assert "cannot write" in line and "No space left" in line
    assert path.read_bytes() == b"previous contents"
    assert sorted(os.listdir(tmp_path)) == ["run.npz"]  # no temporary file left behind


def test_an_interrupted_save_leaves_nothing(tmp_path, monkeypatch):
    path = tmp_path / "run.npz"

    def interrupted(file, **arrays):
        file.write(b"PK partial")
        raise KeyboardInterrupt

    monkeypatch.setattr(io.np, "savez", interrupted)
    result = run("forward", "--save", path)
    assert result.exit_code == 130
    assert os.listdir(tmp_path) == []


def test_save_into_a_missing_folder_is_one_line(tmp_path):
    line = error_line(run("forward", "--save", tmp_path / "nope" / "run.npz"), 2)
    assert "does not exist" in line and "nope" in line


def test_failed_runs_write_nothing(tmp_path):
    path = tmp_path / "run.npz"
    error_line(run("forward", "-d", 7, "--save", path), 2)
    error_line(run("forward", "--show", "nonsense", "--save", path), 2)
    assert os.listdir(tmp_path) == []


def test_save_through_a_symlink_replaces_the_file_it_names_and_keeps_the_link(tmp_path):
    (tmp_path / "runs").mkdir()
    link = tmp_path / "latest.npz"
    link.symlink_to(tmp_path / "runs" / "run.npz")            # dangling: nothing there yet
    for seed in (1, 2):
        assert run("forward", "--seed", seed, "--save", link).exit_code == 0
        assert link.is_symlink()
        with np.load(tmp_path / "runs" / "run.npz", allow_pickle=False) as npz:
            assert json.loads(str(npz["config"]))["seed"] == seed
    assert sorted(os.listdir(tmp_path)) == ["latest.npz", "runs"]
    assert os.listdir(tmp_path / "runs") == ["run.npz"]


@pytest.mark.parametrize("option", ["--save", "--svg"])
def test_a_pipe_is_written_through_not_replaced_by_a_file(tmp_path, option):
    """/dev/null, /dev/stdout or a shell's >(...) are not files to rename over (as root, a
    rename would put a plain file where /dev/null was). A named pipe stands in for them: it must
    still be a pipe afterwards, and its reader gets the whole npz (which seeks as it is written)
    or the whole SVG."""
    import stat
    import threading

    pipe = tmp_path / "pipe"
    os.mkfifo(pipe)
    received = []
    reader = threading.Thread(target=lambda: received.append(pipe.read_bytes()), daemon=True)
    reader.start()
    result = run("forward", "--seed", 7, option, pipe)
    reader.join(timeout=30)
    assert result.exit_code == 0, result.output
    assert stat.S_ISFIFO(os.lstat(pipe).st_mode)
    assert os.listdir(tmp_path) == ["pipe"]
    if option == "--save":
        import io as bytes_io
        with np.load(bytes_io.BytesIO(received[0]), allow_pickle=False) as npz:
            assert json.loads(str(npz["config"]))["seed"] == 7
            assert npz["act/logits"].shape == (2, 4, 8)
    else:
        assert received[0].startswith(b"<svg") and received[0].rstrip().endswith(b"</svg>")


def test_a_pipe_that_cannot_be_written_is_refused_before_any_work(tmp_path, monkeypatch):
    pipe = tmp_path / "pipe"
    os.mkfifo(pipe)
    monkeypatch.setattr(os, "access", lambda path, mode: not mode & os.W_OK)   # (root writes all)
    line = error_line(run("forward", "--save", pipe), 2)
    assert "--save" in line and f"{pipe} is not writable" in line


# ---------------------------------------------------------------- load


def test_load_reproduces_the_saved_run(tmp_path):
    path = saved(tmp_path, "--seed", 11, "--lengths", "3,4", "-L", 2)
    expected = loss_of("forward", "--seed", 11, "--lengths", "3,4", "-L", 2)
    assert loss_of("forward", "--load", path) == expected
    data = json.loads(run("backward", "--load", path, "--json").stdout)
    assert data["config"]["layers"] == 2 and data["config"]["lengths"] == [3, 4]


def test_load_runs_edited_weights(tmp_path):
    path = saved(tmp_path)
    edited = rewrite(path, tmp_path / "edited.npz",
                     lambda a: a.update({"param/head.b_U": a["param/head.b_U"] + np.arange(8.0)}))
    cfg = tfmcli.Config()
    params, inputs = tfmcli.init_params(cfg), tfmcli.make_inputs(cfg)
    params["head.b_U"] = params["head.b_U"] + np.arange(8.0)
    assert loss_of("forward", "--load", edited) == pytest.approx(
        tfmcli.forward(params, inputs, cfg).loss, abs=1e-14)


def test_load_weights_made_elsewhere_without_config_or_inputs(tmp_path):
    cfg = tfmcli.Config(d_model=8, heads=4, vocab=5, layers=2, norm="post", d_ff=12)
    params = tfmcli.init_params(cfg.replace(seed=5))
    path = tmp_path / "mine.npz"
    np.savez(path, **{f"param/{k}": v for k, v in params.items()})
    # sizes come from the shapes; heads from the flag; tokens from --seed
    inputs = tfmcli.make_inputs(cfg)
    expected = tfmcli.forward(params, inputs, cfg).loss
    assert loss_of("forward", "--load", path, "-H", 4) == pytest.approx(expected, abs=1e-14)


def test_load_a_learned_table_and_padded_inputs_made_elsewhere_without_config(tmp_path):
    """The shapes decide the rest: a learned table of n_ctx rows (here more than T), a tied head
    without bias, and B, T and the lengths from the inputs."""
    cfg = tfmcli.Config(batch=2, seq_len=3, d_model=4, heads=2, vocab=7, pe="learned", n_ctx=5,
                        tied_head=True, head_bias=False, lengths=(3, 2))
    params = random_params(tfmcli.init_params(cfg))
    inputs = tfmcli.inputs_from_tokens([[3, 1, 4], [6, 2]])
    path = tmp_path / "mine.npz"
    np.savez(path, **{f"param/{k}": v for k, v in params.items()},
             **{f"input/{k}": v for k, v in inputs._asdict().items()})
    data = json.loads(run("forward", "--load", path, "-H", 2, "--json").stdout)
    assert data["loss"] == pytest.approx(tfmcli.forward(params, inputs, cfg).loss, abs=1e-14)
    found = data["config"]
    assert (found["pe"], found["n_ctx"], found["tied_head"], found["head_bias"]) == \
        ("learned", 5, True, False)
    assert (found["batch"], found["seq_len"], found["lengths"]) == (2, 3, [3, 2])


def test_a_file_whose_targets_lie_past_the_lengths_has_nothing_to_score(tmp_path):
    path = saved(tmp_path, "--lengths", "1,1")
    targets = np.full((2, 4), -100)
    targets[:, 1] = 3                  # at position 1, where a length of 1 ends the row
    bad = rewrite(path, tmp_path / "bad.npz", lambda a: a.update({"input/targets": targets}))
    line = error_line(run("forward", "--load", bad), 1)
    assert "input/targets has no target inside the lengths (every one is -100)" in line


def test_load_gradcheck(tmp_path):
    path = saved(tmp_path, "--activation", "gelu")
    result = run("gradcheck", "--load", path, "--json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["passed"] is True


def test_flag_that_contradicts_the_file_is_a_usage_error(tmp_path):
    path = saved(tmp_path)
    line = error_line(run("forward", "--load", path, "-d", 8), 2)
    assert "'--d-model'" in line and "d_model=8 contradicts" in line and "d_model=6" in line
    line = error_line(run("forward", "--load", path, "--norm", "post"), 2)
    assert "'--norm'" in line
    # the same value as the file is fine
    assert run("forward", "--load", path, "-d", 6).exit_code == 0


@pytest.mark.parametrize("change, needle", [
    (lambda a: a.pop("param/blocks.0.attn.W_Q"), "missing key 'param/blocks.0.attn.W_Q'"),
    (
        lambda a: a.update({"param/blocks.0.attn.W_X": np.zeros((6, 6))}),
        "unknown key 'param/blocks.0.attn.W_X'",
    ),
    (lambda a: a.update({"extra": np.zeros(3)}), "unknown key 'extra'"),
    (
        lambda a: a.update({"param/head.W_U": np.zeros((6, 9))}),
        "param/head.W_U has shape (6, 9), expected (6, 8)",
    ),
    (
        lambda a: a.update({"param/head.b_U": np.zeros(8, dtype=np.int64)}),
        "param/head.b_U has dtype int64, expected float64",
    ),
    (
        lambda a: a.update({"param/head.b_U": np.full(8, np.nan)}),
        "param/head.b_U contains NaN or Inf",
    ),
    (
        lambda a: a.update({"param/embed.W_E": np.full((8, 6), np.inf)}),
        "param/embed.W_E contains NaN or Inf",
    ),
    (
        lambda a: a.update({"input/tokens": a["input/tokens"] + 100}),
        "input/tokens has values outside 0..7",
    ),
    (
        lambda a: a.update({"input/tokens": np.zeros((2, 5), dtype=np.int64)}),
        "input/tokens has shape (2, 5), expected (2, 4)",
    ),
    (
        lambda a: a.update({"input/lengths": np.array([0, 4])}),
        "input/lengths has values outside 1..4",
    ),
    (lambda a: a.pop("input/targets"), "has 'input/tokens' but is missing key 'input/targets'"),
    (lambda a: a.update({"act/": np.zeros(3)}), "unknown key 'act/'"),
    (lambda a: a.update({"config": np.array("{not json")}), "key 'config' is not a JSON object"),
    (lambda a: a.update({"config": np.array('{"colour": 1}')}), "unknown field 'colour'"),
])
def test_each_bad_file_gets_its_own_message(tmp_path, change, needle):
    bad = rewrite(saved(tmp_path), tmp_path / "bad.npz", change)
    line = error_line(run("forward", "--load", bad), 1)
    assert needle in line
    assert str(bad) in line


def test_a_file_that_is_not_an_npz(tmp_path):
    path = tmp_path / "notes.npz"
    path.write_text("hello")
    assert "not an .npz file" in error_line(run("forward", "--load", path), 1)
    assert "no such file" in error_line(run("forward", "--load", tmp_path / "missing.npz"), 1)
    os.mkfifo(tmp_path / "pipe")   # exists, but no archive can be read from it (nor /dev/null)
    assert error_line(run("forward", "--load", tmp_path / "pipe"), 1).endswith(
        "not a file (allowed: an .npz file or a checkpoint folder)")


def test_a_pickled_array_is_refused(tmp_path):
    path = tmp_path / "weights.npz"   # a neutral name: the reason must come from the loader
    np.savez(path, **{"param/embed.W_E": np.array([{"a": 1}], dtype=object)})
    line = error_line(run("forward", "--load", path), 1)
    assert "an array needs pickle, which tfm never loads" in line


def test_a_run_that_overflows_is_a_domain_error(tmp_path):
    bad = rewrite(saved(tmp_path), tmp_path / "huge.npz",
                  lambda a: a.update({"param/blocks.0.ffn.W_1": np.full((6, 24), 1e300)}))
    line = error_line(run("forward", "--load", bad), 1)
    assert "the run overflowed float64" in line


def test_the_readme_api_for_saving(tmp_path):
    """README: tfmcli.io.save_npz(path, tfmcli.io.run_arrays(cfg, params, inputs, fwd, grads))."""
    cfg = tfmcli.Config(norm="post")
    params, inputs = tfmcli.init_params(cfg), tfmcli.make_inputs(cfg)
    fwd = tfmcli.forward(params, inputs, cfg)
    grads = tfmcli.backward(params, fwd, cfg)
    tfmcli.io.save_npz(tmp_path / "api.npz", tfmcli.io.run_arrays(cfg, params, inputs, fwd, grads))
    assert loss_of("forward", "--load", tmp_path / "api.npz") == pytest.approx(fwd.loss, abs=1e-15)


def test_written_files_follow_the_umask(tmp_path):
    """--save and --svg files are 0644 under umask 022, like any other program's (not 0600)."""
    old = os.umask(0o022)
    try:
        assert (
            run("forward", "--save", tmp_path / "run.npz", "--svg", tmp_path / "run.svg").exit_code
            == 0
        )
    finally:
        os.umask(old)
    assert (tmp_path / "run.npz").stat().st_mode & 0o777 == 0o644
    assert (tmp_path / "run.svg").stat().st_mode & 0o777 == 0o644
    assert "<svg" in (tmp_path / "run.svg").read_text()


def test_every_config_field_survives_json_and_a_save_load_round_trip(tmp_path):
    """Each field set away from its default is kept by to_json/from_json, and by --save then
    --load: a run saved with --eps 0.1 reloads to the same loss (a dropped eps would not)."""
    import dataclasses
    import json

    from tfmcli.engine.config import Config

    changed = dict(seed=7, batch=3, seq_len=5, d_model=8, heads=4, d_ff=12, vocab=11, layers=2,
                   norm="post", activation="gelu", causal=False, lengths=(5, 2, 3), pe="learned",
                   init="normal", dtype="float32", eps=0.1, n_ctx=7, tied_head=True,
                   head_bias=False, rms_norm=True, kv_heads=2, bias=False, qkv_bias=True,
                   ffn_bias=True, head_dim=3, qk_norm=True, embed_scale=True, attn_softcap=1.5,
                   logit_softcap=2.5, attn_scale=0.3)
    # every field; rope_theta, rope_scaling, rope_local_theta and rotary_dim need --pe rope, which
    # --n-ctx's --pe learned rules out, sliding_window and sliding_layers a causal model, and
    # sandwich_norm and parallel_residual Pre-LN: their own round trip is the next test
    # (shared_norm's, a parallel block's, is in test_shared_norm.py; embed_norm needs a pe that
    # adds nothing, so its own is there too; norm_bias false needs layer norms, in
    # test_norm_bias.py)
    assert set(changed) | {"rope_theta", "rope_scaling", "sliding_window", "sliding_layers",
                           "sandwich_norm", "rope_local_theta", "rotary_dim",
                           "parallel_residual", "shared_norm", "embed_norm", "norm_bias"} == {
        f.name for f in dataclasses.fields(Config)}
    cfg = Config(**changed)
    assert all(getattr(cfg, k) != getattr(Config(), k) for k in changed)
    assert Config.from_json(cfg.to_json()) == cfg
    flags = ["--seed", 7, "-B", 3, "-T", 5, "-d", 8, "-H", 4, "--d-ff", 12, "-V", 11, "-L", 2,
             "--norm", "post", "--activation", "gelu", "--no-causal", "--lengths", "5,2,3",
             "--pe", "learned", "--init", "normal", "--dtype", "float32", "--eps", 0.1,
             "--n-ctx", 7, "--tied-head", "--no-head-bias", "--rms-norm", "--kv-heads", 2,
             "--no-bias", "--qkv-bias", "--ffn-bias", "--head-dim", 3, "--qk-norm", "--embed-scale",
             "--attn-softcap", 1.5, "--logit-softcap", 2.5, "--attn-scale", 0.3]
    path = tmp_path / "run.npz"
    saved = json.loads(run("forward", *flags, "--save", path, "--json").stdout)
    loaded = json.loads(run("forward", "--load", path, "--json").stdout)
    assert saved["config"] == loaded["config"] == json.loads(cfg.to_json())
    assert loaded["loss"] == saved["loss"]
    at = flags.index("--eps")
    default_eps = json.loads(run("forward", *flags[:at], *flags[at + 2:], "--json").stdout)
    assert default_eps["config"]["eps"] == 1e-5 and default_eps["loss"] != saved["loss"]


@pytest.mark.parametrize("flag, value, default", [
    ("--rope-theta", 3.5, 10000.0),
    ("--rope-scaling", "4,1,4,12", None),
    ("--rope-scaling", "4", None),
    ("--rope-local-theta", 3.5, None),
    ("--rotary-dim", 2, None),
    ("--sliding-window", 2, None),
    ("--sliding-layers", "1", None),
    ("--sandwich-norm", None, False),
    ("--parallel-residual", None, False),
    ("--embed-norm", None, False)])
def test_rope_and_window_fields_survive_a_save_load_round_trip(tmp_path, flag, value, default):
    """--rope-theta, --rope-scaling (LLaMA 3.1's and linear), --rope-local-theta, --rotary-dim,
    --sliding-window, --sliding-layers, --sandwich-norm and --parallel-residual are kept by
    --save and --load (the loss they give comes back), and each changes the loss: a dropped one
    would reload at its default."""
    import json

    flags = ["-T", 6, "-d", 8, "-H", 2, "-L", 2, "--pe", "rope", flag, value]
    if flag == "--sliding-layers":   # block 1 alone slides: block 0 sees every earlier key
        flags = ["--sliding-window", 2, *flags]
    if flag == "--rope-local-theta":   # block 1 alone slides, and turns at its own base
        flags = ["--sliding-window", 2, "--sliding-layers", 1, *flags]
    typed = 2
    if value is None:   # a switch: the flag alone
        flags, typed = flags[:-1], 1
    path = tmp_path / "run.npz"
    saved = json.loads(run("forward", *flags, "--save", path, "--json").stdout)
    loaded = json.loads(run("forward", "--load", path, "--json").stdout)
    field = flag[2:].replace("-", "_")
    assert saved["config"][field] == loaded["config"][field] != default
    assert loaded["loss"] == saved["loss"]
    dropped = json.loads(run("forward", *flags[:-typed], "--json").stdout)
    assert dropped["config"][field] == default and dropped["loss"] != saved["loss"]


@pytest.mark.parametrize("member", ["model.safetensors", "config.json", "tokenizer.json"])
def test_a_file_of_a_checkpoint_folder_names_the_folder_to_pass(member, monkeypatch):
    """--load examples/tiny-gpt2/model.safetensors said only 'not an .npz'."""
    from pathlib import Path

    monkeypatch.chdir(Path(__file__).resolve().parent.parent)
    line = error_line(run("forward", "--load", f"examples/tiny-gpt2/{member}"), 1)
    assert line.endswith(f"--load examples/tiny-gpt2/{member}: a file of the checkpoint folder "
                         "examples/tiny-gpt2; pass the folder (--load examples/tiny-gpt2)"), line


def test_a_run_saved_with_interventions_loads_its_weights_and_says_what_it_changed(
        tmp_path, monkeypatch):
    """It was refused: unknown key 'interventions'."""
    saved = tmp_path / "changed.npz"
    ok("forward", "--ablate", "blocks.0.attn.head1", "--save", saved)
    monkeypatch.setenv("COLUMNS", "300")   # the panel's line whole, however long the path
    assert (f"│ weights        file {saved} (saved with ablate blocks.0.attn.head1: the weights, "
            "not the change)") in ok("forward", "--load", saved).stdout
    plain = json.loads(ok("forward", "--json").stdout)
    loaded = json.loads(ok("forward", "--load", saved, "--json").stdout)
    assert loaded["loss"] == plain["loss"]   # the weights as they were: the unchanged run
    np.savez(tmp_path / "bad.npz", **{k: v for k, v in np.load(saved).items()
                                      if k != "interventions"}, interventions=np.array("[1]"))
    assert "key 'interventions' is not a list" in error_line(
        run("forward", "--load", tmp_path / "bad.npz"), 1)
