"""tfm embed: the embedding and the positions at one position, recomputed number by number,
against the model, the backward pass, central differences of the whole model, and torch."""

import json
import re

import numpy as np
import pytest

import tfmcli
from helpers import error_line, ok, random_params, run
from tfmcli.explain import embedding

TOKENS = [[3, 1, 4, 1, 5], [1, 2, 6, 3]]   # 1 three times over both rows, 3 twice, 7..10 never


def model_run(pe="sinusoidal", tied=False, norm="pre", dtype="float64"):
    """Two blocks, row 1 padded, at random parameters (gammas, betas and biases drawn too)."""
    cfg = tfmcli.Config(norm=norm, layers=2, d_model=8, heads=2, vocab=11, seq_len=5, pe=pe,
                        tied_head=tied, head_bias=not tied, dtype=dtype, lengths=(5, 4))
    inputs = tfmcli.inputs_from_tokens(TOKENS)
    params = random_params(tfmcli.init_params(cfg), seed=8)
    fwd = tfmcli.forward(params, inputs, cfg)
    return cfg, params, fwd, tfmcli.backward(params, fwd, cfg)


def positions_of(token):
    padded = [row + [0] * (5 - len(row)) for row in TOKENS]   # inputs_from_tokens pads with 0
    return [(b, t) for b, row in enumerate(padded) for t, held in enumerate(row) if held == token]


@pytest.mark.parametrize("pe, tied, norm", [("sinusoidal", False, "pre"),
                                            ("learned", True, "pre"),
                                            ("none", True, "post"),
                                            ("learned", False, "post")])
def test_each_position_recomputed_equals_the_model_and_its_backward(pe, tied, norm):
    """x0 is the model's first block input; dW_E[id] (and dW_pos[t]) the backward's, and central
    differences' of the loss; the lookup's part sums dx0 over exactly the token's positions;
    tied, the head's part is dlogits^T h's row."""
    cfg, params, fwd, grads = model_run(pe, tied, norm)
    h = fwd.acts["ln_f.out" if norm == "pre" else "blocks.1.out"]
    head = np.einsum("btv,btd->vd", grads.acts["logits"], h)   # tied: W_E's gradient as the head
    for b, row in enumerate(TOKENS):
        for t, token in enumerate(row):
            x = embedding.explain(params, fwd, grads, cfg, b, t)
            assert x.token == token and x.occurrences == positions_of(token)
            np.testing.assert_array_equal(x.w_e, params["embed.W_E"][token])
            np.testing.assert_allclose(x.x0, fwd.acts["blocks.0.in"][b, t], atol=1e-15)
            assert (x.pe is None) == (pe == "none") and (x.angle is None) == (pe != "sinusoidal")
            if pe == "learned":
                np.testing.assert_array_equal(x.pe, params["embed.W_pos"][t])
                np.testing.assert_allclose(x.dw_pos, grads["embed.W_pos"][t], atol=1e-15)
                np.testing.assert_allclose(x.numeric_dw_pos, x.dw_pos[x.checked], atol=1e-8)
                np.testing.assert_array_equal(x.dx0_at_t, grads.acts["embed"][:, t])
            else:
                assert x.dw_pos is None and x.numeric_dw_pos is None
            lookup = sum(grads.acts["embed"][p] for p in positions_of(token))
            np.testing.assert_allclose(x.embedding_part, lookup, atol=1e-15)
            if tied:
                np.testing.assert_allclose(x.head_part, head[token], atol=1e-15)
            else:
                assert x.head_part is None
            np.testing.assert_allclose(x.dw_e, grads["embed.W_E"][token], atol=1e-14)
            assert x.checked.tolist() == list(range(8))    # d 8: every entry
            np.testing.assert_allclose(x.numeric_dw_e, x.dw_e, atol=1e-8)


def test_the_sinusoidal_row_is_the_formula_at_its_angles():
    cfg, params, fwd, grads = model_run()
    x = embedding.explain(params, fwd, grads, cfg, 1, 3)
    assert x.angle.tolist() == pytest.approx([3, 3, 0.3, 0.3, 0.03, 0.03, 0.003, 0.003],
                                             rel=1e-14)   # 3 / 10000^(2i/8), i = 0..3
    assert x.pe[0] == pytest.approx(np.sin(3)) and x.pe[1] == pytest.approx(np.cos(3))
    np.testing.assert_allclose(x.pe, fwd.acts["pe"][3], atol=1e-15)


def test_a_token_only_at_padding_gets_nothing_back():
    """Row 1 is padded with id 0 at position 4, and 0 is nowhere else: the padding mask hides
    that position from every query and from the loss, so dW_E[0] is exactly 0, and the loss
    does not move when the row is nudged. 6 sits only at (1, 2), a scored position: not 0."""
    cfg, params, fwd, grads = model_run()
    x = embedding.explain(params, fwd, grads, cfg, 1, 4)
    assert x.token == 0 and x.occurrences == [(1, 4)]
    assert not x.dw_e.any() and not x.numeric_dw_e.any()
    assert embedding.explain(params, fwd, grads, cfg, 1, 2).dw_e.any()


def test_the_rows_match_torch_embedding_and_a_tied_head():
    """torch's embedding lookup and tied head (logits = h W_E^T), given the backward's upstream
    gradients: W_E's gradient, row by row, is explain's."""
    torch = pytest.importorskip("torch")
    cfg, params, fwd, grads = model_run("learned", tied=True)
    W_E = torch.tensor(params["embed.W_E"], requires_grad=True)
    x0 = torch.nn.functional.embedding(torch.tensor(fwd.inputs.tokens), W_E)
    logits = torch.tensor(fwd.acts["ln_f.out"]) @ W_E.T
    torch.autograd.backward([x0, logits], [torch.tensor(grads.acts["embed"]),
                                           torch.tensor(grads.acts["logits"])])
    for b, row in enumerate(TOKENS):
        for t in range(len(row)):
            x = embedding.explain(params, fwd, grads, cfg, b, t)
            np.testing.assert_allclose(x.dw_e, W_E.grad.numpy()[x.token], atol=1e-15)


def test_a_float32_run_is_explained_in_float64():
    cfg, params, fwd, grads = model_run("learned", tied=True, dtype="float32")
    x = embedding.explain(params, fwd, grads, cfg, 0, 3)
    assert x.dw_e.dtype == np.float64 and x.x0.dtype == np.float64
    np.testing.assert_allclose(x.dw_e, grads["embed.W_E"][1], atol=1e-6)
    np.testing.assert_allclose(x.numeric_dw_e, x.dw_e, atol=1e-5)   # float32's gradient
    assert params["embed.W_E"].dtype == np.float32   # the run's own weights untouched


def test_explain_leaves_the_weights_as_they_were_and_checks_the_largest():
    cfg, params, fwd, grads = model_run("learned", tied=True)
    before = {name: value.copy() for name, value in params.items()}
    x = embedding.explain(params, fwd, grads, cfg, 0, 1, entries=3)
    for name, value in params.items():
        np.testing.assert_array_equal(value, before[name])
    largest = np.argsort(-np.abs(x.dw_e))[:3]
    assert x.checked.tolist() == sorted(largest.tolist()) and x.numeric_dw_e.shape == (3,)
    np.testing.assert_allclose(x.numeric_dw_e, x.dw_e[x.checked], atol=1e-8)


def test_explain_checks_8_entries_of_a_wider_row_by_default():
    cfg = tfmcli.Config(d_model=12, heads=2, pe="learned")
    params = random_params(tfmcli.init_params(cfg), seed=2)
    fwd = tfmcli.forward(params, tfmcli.make_inputs(cfg), cfg)
    x = embedding.explain(params, fwd, tfmcli.backward(params, fwd, cfg), cfg, 0, 0)
    assert x.checked.size == 8 and x.numeric_dw_pos.shape == (8,)


def test_explain_refuses_what_the_run_does_not_have():
    cfg, params, fwd, grads = model_run()
    for row, t, reason in ((-1, 0, "row -1 is outside 0..1"), (2, 0, "row 2 is outside 0..1"),
                           (0, 5, "position 5 is outside 0..4")):
        with pytest.raises(ValueError, match=re.escape(reason)):
            embedding.explain(params, fwd, grads, cfg, row, t)


def test_cli_embed_json_is_the_embedding_at_that_position():
    data = json.loads(ok("embed", "--row", 1, "-t", 2, "--pe", "learned", "--tied-head",
                         "--json").stdout)
    cfg = tfmcli.Config(pe="learned", tied_head=True)
    params = tfmcli.init_params(cfg)
    inputs = tfmcli.make_inputs(cfg)
    fwd = tfmcli.forward(params, inputs, cfg)
    grads = tfmcli.backward(params, fwd, cfg)
    token = int(inputs.tokens[1, 2])
    assert data["id"] == token and data["token"] == str(token)
    np.testing.assert_array_equal(data["w_e"], params["embed.W_E"][token])
    np.testing.assert_array_equal(data["pe"], params["embed.W_pos"][2])
    np.testing.assert_allclose(data["dW_E"], grads["embed.W_E"][token], atol=1e-15)
    np.testing.assert_allclose(data["dW_pos"], grads["embed.W_pos"][2], atol=1e-15)
    assert np.abs(data["dW_pos"]).max() > 1e-3   # position 2 is scored: not 0
    where = np.argwhere(inputs.tokens == token).tolist()
    assert data["occurrences"] == where and len(data["dx0"]) == len(where)
    np.testing.assert_allclose(np.sum(data["dx0"], axis=0), data["embedding_part"], atol=1e-15)
    np.testing.assert_allclose(np.add(data["embedding_part"], data["head_part"]), data["dW_E"],
                               atol=1e-15)
    assert data["checked"] == list(range(6)) and data["dW_E_numeric_diff"] < 1e-8
    assert data["dW_pos_numeric_diff"] < 1e-8 and data["forward_model_diff"] == 0
    assert data["dW_E_model_diff"] < 1e-15 and data["dW_pos_model_diff"] < 1e-15
    plain = json.loads(ok("embed", "--json").stdout)
    assert plain["position"] == 0 and plain["head_part"] is None and plain["dW_pos"] is None


def test_cli_embed_prints_the_sum_over_the_token_positions():
    out = ok("embed", "-t", 1).stdout
    lines = out.splitlines()
    assert "position 1 of batch row 0 holds the token 4" in lines
    text = " ".join(out.split())
    assert ("the lookup copied row 4 to 3 positions of the batch, (row,position) (0,1), (0,3), "
            "(1,3): each one's dx0 flows back into it (the rows below)") in text
    rows = {}   # each label's first line: the columns from 0 (wide numbers wrap the rest)
    for line in lines:
        if len(line.split()) > 1 and line.split()[1][:1] in "+-":
            rows.setdefault(line.split()[0], line.split()[1:])
    assert rows["PE[1]"][:2] == ["+0.8415", "+0.5403"]          # sin 1, cos 1
    assert rows["(0,3)"][1] == "-3.6198e-05"                     # one small entry: all in e
    assert rows["sum"][:2] == ["-0.0946", "-4.2716e-03"]   # dx0 at (0,1) + (0,3) + (1,3);
    #                                          one notation per column: column 1 needs e
    assert "the sinusoidal table is fixed, not learned: nothing to update there" in text
    once = " ".join(ok("embed", "-t", 2).stdout.split())   # 6 is at (0, 2) only
    assert "copied row 6 to 1 position of the batch, (row,position) (0,2): each" in once
    twice = " ".join(ok("embed", "--tokens", "5,5", "-d", 4, "-H", 1).stdout.split())
    assert "copied row 5 to 2 positions of the batch, (row,position) (0,0), (0,1):" in twice
    assert "tied:" not in text and "dW_pos" not in text
    tied = " ".join(ok("embed", "-t", 1, "--pe", "learned", "--tied-head").stdout.split())
    assert "row 4 is also the head's column 4" in tied and "dW_pos[1] sums dx0 at position 1 " \
        "over the batch (2 rows)" in tied and "(8 positions; h = ln_f.out)" in tied
    one = " ".join(ok("embed", "-B", 1, "-T", 3, "-t", 1, "--pe", "learned").stdout.split())
    assert "dW_pos[1] sums dx0 at position 1 over the batch (1 row)" in one
    assert "the 2 entries with the largest gradient" not in tied and "every entry" in tied


def test_cli_embed_lists_up_to_8_positions_in_its_sentence():
    eight = " ".join(ok("embed", "--tokens", "5,5,5,5,5,5,5,5", "-d", 4, "-H", 1).stdout.split())
    assert "to 8 positions of the batch, (row,position) (0,0), (0,1), (0,2), (0,3), (0,4), " \
        "(0,5), (0,6), (0,7): each one's" in eight
    nine = " ".join(ok("embed", "--tokens", "5,5,5,5,5,5,5,5,5", "-d", 4, "-H", 1).stdout.split())
    assert "to 9 positions of the batch, (row,position) (0,0), (0,1), (0,2), (0,3), (0,4), " \
        "(0,5), (0,6), (0,7), …: each one's" in nine


def test_cli_embed_leaves_out_positions_past_40_unless_full():
    tokens = ",".join(["5"] * 45)
    out = ok("embed", "--tokens", tokens, "-T", 45, "-d", 4, "-H", 1).stdout
    assert "… 5 more" in out and "5 positions left out of the table (--full shows them)" in out
    assert "(0,39)" in out and "(0,40)" not in out
    dots = next(line for line in out.splitlines() if "… 5 more" in line)
    assert dots.split()[3:] == ["·"] * 4   # a row of dots, not numbers
    forty = ok("embed", "--tokens", ",".join(["5"] * 40), "-d", 4, "-H", 1).stdout
    assert "(0,39)" in forty and "more" not in forty.split("backward:")[1]
    full = ok("embed", "--tokens", tokens, "-T", 45, "-d", 4, "-H", 1, "--full").stdout
    assert "(0,44)" in full and "… 5 more" not in full and "left out" not in full


def test_cli_embed_shows_rows_whole_up_to_d_32(monkeypatch):
    monkeypatch.setenv("COLUMNS", "80")
    assert "showing" not in ok("embed", "-d", 32, "-H", 1).stdout       # wrapped in blocks
    assert "showing" in ok("embed", "-d", 34, "-H", 1).stdout


def test_cli_embed_checks_fewer_entries_on_a_large_model(monkeypatch):
    from tfmcli.cli import embed  # here, not at the top: the commands register lazily
    monkeypatch.setattr(embed, "LARGE", 8448)   # the toy's forward FLOPs: not more, so all 6
    assert len(json.loads(ok("embed", "--json").stdout)["checked"]) == 6
    monkeypatch.setattr(embed, "LARGE", 8447)
    data = json.loads(ok("embed", "--json").stdout)
    assert data["checked"] == [int(np.argmax(np.abs(data["dW_E"])))]
    assert tfmcli.engine.sizes.flops(tfmcli.Config())[0] == 8448


@pytest.mark.parametrize("args, option, needle", [
    (["-t", "4"], "'--position'", "0..3"),
    (["--row", "2"], "'--row'", "0..1"),
])
def test_bad_embed_options(args, option, needle):
    line = error_line(run("embed", *args), 2)
    assert option in line and needle in line
