"""tfm compare: Pre-LN against Post-LN, its numbers equal to separate backward runs."""

import json

import numpy as np
import pytest

import tfmcli
from helpers import ok
from tfmcli.explain.compare import gradient_norms


@pytest.fixture(autouse=True)
def plain_env(monkeypatch):
    for name in ("NO_COLOR", "FORCE_COLOR", "COLUMNS"):
        monkeypatch.delenv(name, raising=False)


def test_compare_equals_separate_backward_runs():
    data = json.loads(ok("compare", "-L", 4, "--json").stdout)
    for norm in ("pre", "post"):
        cfg = tfmcli.Config(batch=4, seq_len=16, d_model=32, heads=4, vocab=32, layers=4, norm=norm)
        params = tfmcli.init_params(cfg)
        fwd = tfmcli.forward(params, tfmcli.make_inputs(cfg), cfg)
        grads = tfmcli.backward(params, fwd, cfg)
        assert data["loss"][norm] == fwd.loss
        for i, row in enumerate(data[norm]):
            p = f"blocks.{i}."
            ffn = np.sqrt(
                sum((grads[p + f"ffn.{w}"] ** 2).sum() for w in ("W_1", "b_1", "W_2", "b_2"))
            )
            attn = np.sqrt(
                sum((grads[p + f"attn.{w}_{x}"] ** 2).sum() for w in "Wb" for x in "QKVO")
            )
            ln = np.sqrt(
                sum((grads[p + f"ln{j}.{w}"] ** 2).sum() for j in "12" for w in ("gamma", "beta"))
            )
            assert row["ffn"] == pytest.approx(ffn, rel=1e-12)
            assert row["attn"] == pytest.approx(attn, rel=1e-12)
            assert row["ln"] == pytest.approx(ln, rel=1e-12)
            assert row["resid"] == pytest.approx(np.linalg.norm(grads.acts[p + "out"]), rel=1e-12)


def test_post_ln_gradients_grow_toward_the_output_at_initialisation():
    """Xiong et al. 2020 at the default sizes: Post-LN's last block has the largest FFN
    gradient, Pre-LN's does not grow; the reading says so."""
    data = json.loads(ok("compare", "--json").stdout)
    pre, post = data["pre"], data["post"]
    assert post[-1]["ffn"] > 1.5 * post[0]["ffn"]
    assert pre[-1]["ffn"] < pre[0]["ffn"]
    assert "Post-LN's gradients are largest near the output" in data["reading"]
    assert ("largest at block 0 in Pre-LN and at block 5 in Post-LN; from block 0 to block 5 "
            "it changes by x0.62 in Pre-LN and by x1.85 in Post-LN") in data["reading"]


def rows(ffn):
    return [{"block": i, "attn": 1.0, "ln": 1.0, "ffn": f, "resid": 1.0}
            for i, f in enumerate(ffn)]


def test_the_reading_claims_only_what_its_numbers_show():
    """Issue 58: with Post-LN's FFN norms peaking in the middle (-L 3: 0.5026, 1.1335, 0.7610)
    the reading said they were largest near the output; with one block it compared block 0
    with itself."""
    from tfmcli.explain.compare import reading

    middle = reading(rows([0.9, 0.8, 0.7]), rows([0.5026, 1.1335, 0.7610]))
    assert "largest at block 0 in Pre-LN and at block 1 in Post-LN" in middle
    assert "largest near the output" not in middle
    assert "do not show what Xiong et al. (2020) describe" in middle
    one = reading(rows([0.9]), rows([0.8]))
    assert one.startswith("One block: nothing to compare") and "x1.00" not in one
    growing = reading(rows([0.9, 1.2]), rows([0.5, 2.0]))   # Pre-LN grows too: no claim on it
    assert "largest near the output" in growing and "Pre-LN's do not grow" not in growing


def test_the_block_outputs_gradient_is_dz_as_in_tfm_block():
    text = ok("compare", "-L", "2").stdout
    assert "‖dz‖" in text and "‖dx‖" not in text
    assert "‖dz‖: d loss / d z, the block's output (tfm block's dz)" in " ".join(text.split())


def test_gradient_norms_groups_every_parameter_of_a_block():
    cfg = tfmcli.Config(layers=2)
    params = tfmcli.init_params(cfg)
    grads = tfmcli.backward(params, tfmcli.forward(params, tfmcli.make_inputs(cfg), cfg), cfg)
    rows = gradient_norms(grads, 2)
    block = [n for n in grads if n.startswith("blocks.1.")]
    total = np.sqrt(sum((grads[n] ** 2).sum() for n in block))
    assert np.sqrt(
        rows[1]["attn"] ** 2 + rows[1]["ln"] ** 2 + rows[1]["ffn"] ** 2
    ) == pytest.approx(total, rel=1e-12)
