"""tfm block: one block's residual stream at one position, each sum and each path of its
backward recomputed, against the model, the backward pass, central differences and torch."""

import json
import re

import numpy as np
import pytest

import tfmcli
from helpers import assert_scaled_close, error_line, ok, random_params, run
from tfmcli.explain import block

TOKENS = [[3, 1, 4, 1, 5], [9, 2, 6]]   # row 1 padded


def model_run(norm="pre", activation="gelu", dtype="float64"):
    """Two blocks, row 1 padded, at random parameters (gammas, betas and biases drawn too)."""
    cfg = tfmcli.Config(norm=norm, activation=activation, layers=2, d_model=8, heads=2,
                        vocab=11, seq_len=5, lengths=(5, 3), dtype=dtype)
    params = random_params(tfmcli.init_params(cfg), seed=4)
    fwd = tfmcli.forward(params, tfmcli.inputs_from_tokens(TOKENS), cfg)
    return cfg, params, fwd, tfmcli.backward(params, fwd, cfg)


def rows(explained):
    return ({r.name: r.value for r in explained.forward},
            {r.name: r.value for r in explained.backward})


@pytest.mark.parametrize("norm, activation", [("pre", "gelu"), ("post", "relu"),
                                              ("pre", "relu"), ("post", "gelu")])
def test_each_sum_and_path_equals_the_run(norm, activation):
    """Every row that names a tensor of the run equals it; the sums add up; each path (which
    the run has no name for) is the difference of the run's gradients on either side of its
    residual; dx equals central differences of the block."""
    cfg, params, fwd, grads = model_run(norm, activation)
    g = grads.acts
    for i in range(2):
        p = f"blocks.{i}."
        for b in range(2):
            for t in range(5):
                x = block.explain(params, fwd, grads, cfg, i, b, t)
                for r in x.forward:
                    if r.model is not None:
                        np.testing.assert_allclose(r.value, fwd.acts[p + r.model][b, t],
                                                   atol=1e-14)
                for r in x.backward:
                    if r.model is not None:
                        np.testing.assert_allclose(r.value, g[p + r.model][b, t], atol=1e-14)
                f, d = rows(x)
                np.testing.assert_array_equal(d["via q"] + d["via k"] + d["via v"],
                                              d["dattn in" if norm == "pre" else "attn path"])
                if norm == "pre":
                    assert [r.model for r in x.backward if r.model] == [
                        "ln2.out", "resid1", "ln1.out", "in"]
                    np.testing.assert_array_equal(f["y"], f["x"] + f["attn"])
                    np.testing.assert_array_equal(f["z"], f["y"] + f["ffn"])
                    np.testing.assert_allclose(d["ffn path"], g[p + "resid1"][b, t]
                                               - g[p + "out"][b, t], atol=1e-14)
                    np.testing.assert_allclose(d["attn path"], g[p + "in"][b, t]
                                               - g[p + "resid1"][b, t], atol=1e-14)
                else:
                    assert [r.model for r in x.backward if r.model] == [
                        "resid2", "ln1.out", "resid1", "in"]
                    np.testing.assert_array_equal(f["r1"], f["x"] + f["attn"])
                    np.testing.assert_array_equal(f["r2"], f["y"] + f["ffn"])
                    np.testing.assert_allclose(d["ffn path"], g[p + "ln1.out"][b, t]
                                               - g[p + "resid2"][b, t], atol=1e-14)
                    np.testing.assert_allclose(d["attn path"], g[p + "in"][b, t]
                                               - g[p + "resid1"][b, t], atol=1e-14)
                np.testing.assert_allclose(d["dz"], g[p + "out"][b, t], atol=0)
                assert x.checked.tolist() == list(range(8))
                np.testing.assert_allclose(x.numeric_dx, d["dx"], atol=1e-8)


def test_dz_names_where_it_comes_from():
    cfg, params, fwd, grads = model_run("pre")
    first = block.explain(params, fwd, grads, cfg, 0, 0, 1).backward[0].formula
    last = block.explain(params, fwd, grads, cfg, 1, 0, 1).backward[0].formula
    assert first.startswith("from block 1:") and last.startswith("from ln_f:")
    cfg, params, fwd, grads = model_run("post")
    assert block.explain(params, fwd, grads, cfg, 1, 0, 1).backward[0].formula.startswith(
        "from the head:")


def test_the_three_ways_into_attention_match_torch():
    """Attention given three copies of its input, one each for q, k and v: torch's gradient
    of each copy, at every position, is the view's via q, via k and via v."""
    torch = pytest.importorskip("torch")
    cfg, params, fwd, grads = model_run("pre")
    p = "blocks.1."
    h = fwd.acts[p + "ln1.out"]
    copies = [torch.tensor(h, requires_grad=True) for _ in range(3)]
    W = {n: torch.tensor(params[p + f"attn.W_{n}"]) for n in "QKVO"}
    bias = {n: torch.tensor(params[p + f"attn.b_{n}"]) for n in "QKVO"}

    def heads(a):
        return a.reshape(2, 5, 2, 4).transpose(1, 2)

    q, k, v = (heads(c @ W[n] + bias[n]) for c, n in zip(copies, "QKV"))
    visible = torch.tensor(np.arange(5)[None, :] < np.array([5, 3])[:, None])
    mask = torch.tril(torch.ones(5, 5, dtype=torch.bool)) & visible[:, None, None, :]
    scores = (q @ k.transpose(-1, -2) / 2.0).masked_fill(~mask, float("-inf"))
    context = (torch.softmax(scores, -1) @ v).transpose(1, 2).reshape(2, 5, 8)
    out = context @ W["O"] + bias["O"]
    out.backward(torch.tensor(grads.acts[p + "attn.out"]))
    for b in range(2):
        for t in range(3 if b else 5):   # past row 1's length torch's softmax is all -inf
            _, d = rows(block.explain(params, fwd, grads, cfg, 1, b, t))
            for c, name in zip(copies, ("via q", "via k", "via v")):
                np.testing.assert_allclose(d[name], c.grad.numpy()[b, t], atol=1e-14)


def test_a_float32_run_is_explained_in_float64():
    cfg, params, fwd, grads = model_run("pre", dtype="float32")
    x = block.explain(params, fwd, grads, cfg, 0, 0, 2)
    _, d = rows(x)
    assert d["dx"].dtype == np.float64
    np.testing.assert_allclose(d["dx"], grads.acts["blocks.0.in"][0, 2], atol=1e-5)
    np.testing.assert_allclose(x.numeric_dx, d["dx"], atol=1e-5)


def test_a_wide_block_checks_the_largest_entries():
    cfg = tfmcli.Config(d_model=40, heads=2)
    params = random_params(tfmcli.init_params(cfg), seed=1)
    fwd = tfmcli.forward(params, tfmcli.make_inputs(cfg), cfg)
    x = block.explain(params, fwd, tfmcli.backward(params, fwd, cfg), cfg, 0, 1, 2)
    dx = x.backward[-1].value
    assert x.checked.tolist() == sorted(np.argsort(-np.abs(dx))[:32].tolist())
    np.testing.assert_allclose(x.numeric_dx, dx[x.checked], atol=1e-8)
    fewer = block.explain(params, fwd, tfmcli.backward(params, fwd, cfg), cfg, 0, 1, 2,
                          entries=3)
    assert fewer.checked.size == 3


def test_explain_refuses_what_the_run_does_not_have():
    cfg, params, fwd, grads = model_run()
    for args, reason in (((2, 0, 0), "block 2 is outside 0..1"), ((0, -1, 0), "row -1 is "
                         "outside 0..1"), ((0, 0, 5), "position 5 is outside 0..4")):
        with pytest.raises(ValueError, match=re.escape(reason)):
            block.explain(params, fwd, grads, cfg, *args)


def test_cli_block_json_is_the_block_at_that_position():
    data = json.loads(ok("block", "-L", 2, "--block", 1, "--row", 1, "-t", 2, "--json").stdout)
    cfg = tfmcli.Config(layers=2)
    params = tfmcli.init_params(cfg)
    fwd = tfmcli.forward(params, tfmcli.make_inputs(cfg), cfg)
    grads = tfmcli.backward(params, fwd, cfg)
    assert [r["name"] for r in data["forward"]] == ["x", "attn", "y", "ffn", "z"]
    assert [r["name"] for r in data["backward"]] == [
        "dz", "dffn in", "ffn path", "dy", "via q", "via k", "via v", "dattn in", "attn path",
        "dx"]
    np.testing.assert_array_equal(data["forward"][0]["value"], fwd.acts["blocks.1.in"][1, 2])
    assert data["backward"][-1]["model"] == "blocks.1.in"
    np.testing.assert_allclose(data["backward"][-1]["value"], grads.acts["blocks.1.in"][1, 2],
                               atol=1e-15)
    assert data["forward_model_diff"] == 0 and data["backward_model_diff"] < 1e-15
    assert data["dx_numeric_diff"] < 1e-8 and data["checked"] == list(range(6))
    assert data["norm"] == "pre" and data["token"] == str(tfmcli.make_inputs(cfg).tokens[1, 2])
    post = json.loads(ok("block", "--norm", "post", "--json").stdout)
    assert [r["name"] for r in post["forward"]] == ["x", "attn", "r1", "y", "ffn", "r2", "z"]
    assert post["position"] == 0 and post["block"] == 0 and post["row"] == 0


def test_cli_block_prints_each_sum_with_its_length():
    out = ok("block", "-t", 2).stdout
    lines = out.splitlines()
    assert "Pre-LN: y = x + MHA(LN1(x)),  z = y + FFN(LN2(y))" in lines
    assert "   y  |2.3819|  x + attn" in lines
    assert "       dy  |0.1032|  dz + ffn path (dz carried straight through)" \
        in lines
    assert "       dz  |0.0889|  from ln_f: the gradient at the block's output" in lines
    table = {line.split()[0]: line.split()[1:] for line in lines
             if len(line.split()) == 7 and line.split()[1][:1] in "+-"}
    assert table["y"][:2] == ["+0.1344", "+2.0633"]      # x + attn: 0.8048 - 0.6704, ...
    assert table["dx"][:2] == ["-0.1215", "-0.1330"]
    text = " ".join(out.split())
    assert "dy (resid1), dattn in (ln1.out), dx (in) differ" in text
    assert "dx is 0 here" not in text
    padded = " ".join(ok("block", "--lengths", "4,3", "--row", 1, "-t", 3).stdout.split())
    assert "dx is 0 here: position 3 of row 1 reaches nothing the loss counts" in padded


def test_cli_block_shows_rows_whole_up_to_d_32(monkeypatch):
    monkeypatch.setenv("COLUMNS", "80")
    assert "showing" not in ok("block", "-d", 32, "-H", 1).stdout       # wrapped in blocks
    wide = ok("block", "-d", 34, "-H", 1).stdout
    assert len(re.findall(r"showing \d+ of 34 columns", wide)) == 2     # forward and backward
    assert "showing" not in ok("block", "-d", 34, "-H", 1, "--full").stdout


def test_the_views_chain_from_the_loss_to_the_embedding():
    """The README's "view by view": tfm loss's dh is tfm ln --layer ln_f's dy, its dx is tfm
    block's dz, and block's dx is tfm embed's dx0 row at the same position."""
    def view(*args):
        return json.loads(ok(*args, "-t", 2, "--json").stdout)

    dh = view("loss")["dh"]
    ln_f = view("ln", "--layer", "ln_f")
    blk = view("block")
    embed = view("embed")
    assert_scaled_close(ln_f["dy"], dh, floor=1e-15)
    assert_scaled_close(blk["backward"][0]["value"], ln_f["dx"], floor=1e-15)
    row = embed["occurrences"].index([0, 2])
    assert_scaled_close(embed["dx0"][row], blk["backward"][-1]["value"], floor=1e-15)


def test_cli_block_checks_fewer_entries_of_a_costly_block(monkeypatch):
    from tfmcli.cli import block as command  # here, not at the top: commands register lazily
    monkeypatch.setattr(command, "CHEAP", 4 * 6 * 6)   # the toy's T d^2: not more, so all 6
    assert len(json.loads(ok("block", "--json").stdout)["checked"]) == 6
    monkeypatch.setattr(command, "CHEAP", 4 * 6 * 6 - 1)
    data = json.loads(ok("block", "--json").stdout)
    dx = np.abs(data["backward"][-1]["value"])
    assert data["checked"] == sorted(np.argsort(-dx, kind="stable")[:4].tolist())


def test_block_forward_fast_equals_the_reference_path():
    """The public block_forward, on a padded batch longer than one query block, both ways."""
    from tfmcli.engine.model import block_forward

    for causal in (True, False):
        cfg = tfmcli.Config(batch=2, seq_len=300, d_model=16, heads=2, causal=causal,
                            lengths=(300, 170), norm="post")
        params = random_params(tfmcli.init_params(cfg), seed=1)
        x = np.random.default_rng(0).normal(size=(2, 300, 16))
        fast = block_forward(params, x, cfg, 0, [300, 170])
        reference = block_forward(params, x, cfg, 0, [300, 170], fast=False)
        np.testing.assert_allclose(fast, reference, rtol=0, atol=1e-12)
        cut = block_forward(params, x[:, :100], cfg.replace(seq_len=100, lengths=None), 0,
                            [100, 100])
        if causal:   # a causal block's first 100 positions do not see the rest
            np.testing.assert_allclose(cut[0], fast[0, :100], rtol=0, atol=1e-12)


@pytest.mark.parametrize("args, option, needle", [
    (["-t", "4"], "'--position'", "0..3"),
    (["--row", "2"], "'--row'", "0..1"),
    (["--block", "1"], "'--block'", "0..0"),
])
def test_bad_block_options(args, option, needle):
    line = error_line(run("block", *args), 2)
    assert option in line and needle in line
