"""Every explanation true (issue 71): each cell's formula, worked out from the tensors the pass
kept, gives the value the run recorded, to 1e-12 of the tensor's scale, or the explanation
names the intervention that changed it; never a wrong sum shown as if it held."""

import itertools
import re

import numpy as np
import pytest

import tfmcli
from tfmcli.engine.interventions import Ablate, Patch, Scale, Set
from tfmcli.explain.cells import Explanation, agreement, explain_value
from tfmcli.explain.gradients import explain_gradient
from tfmcli.sources import Run

ARCHS = {
    "gpt2": {},
    "llama-gqa-rope": dict(rms_norm=True, pe="rope", activation="swiglu", heads=4, kv_heads=2,
                           bias=False),
    "parallel": dict(parallel_residual=True, pe="rope", activation="gelu"),
    "post-ln": dict(norm="post"),
    "sandwich": dict(sandwich_norm=True, rms_norm=True, activation="geglu", qk_norm=True),
    "softcaps-alibi": dict(attn_softcap=2.0, logit_softcap=3.0, pe="alibi", heads=2),
    # a rounded run holds to its dtype's rounding (explain.cells.holds_to), not to 1e-12
    "gpt2-float32": dict(dtype="float32"),
    "llama-bfloat16": dict(rms_norm=True, pe="rope", activation="swiglu", heads=4, kv_heads=2,
                           bias=False, dtype="bfloat16"),
}
SIZES = dict(batch=2, seq_len=4, d_model=8, heads=2, vocab=11, layers=2, d_ff=16)


def changes(source):
    """Each kind of intervention, on a tensor whose cells have a formula and on one such a
    formula reads."""
    return {
        "none": [],
        "zero": [Ablate("blocks.0.attn.pattern[0, 0, 2, 1]")],
        "mean": [Ablate("blocks.1.ffn.act", using="mean")],
        "set": [Set("blocks.0.resid1[0, 2]", 0.5)],
        "set-read": [Set("blocks.0.attn.scores[0, 1, 3, 0]", 0.25)],
        "scale": [Scale("blocks.0.attn.head1", 3.0), Scale("blocks.1.ffn.pre[1, 0]", -2.0)],
        "patch": [Patch("blocks.1.in", source)],
    }


def runs():
    for arch, fields in ARCHS.items():
        cfg = tfmcli.Config(**{**SIZES, **fields})
        rng = np.random.default_rng(7)
        params = {name: (rng.normal(0.0, 0.5, value.shape) + (1.0 if name.endswith("gamma")
                                                              else 0.0)).astype(value.dtype)
                  for name, value in tfmcli.init_params(cfg).items()}
        inputs = tfmcli.make_inputs(cfg)
        other = tfmcli.make_inputs(cfg.replace(seed=cfg.seed + 1))
        source = tfmcli.forward(params, other, cfg)
        for kind, change in changes(source).items():
            yield arch, kind, cfg, params, inputs, change


CASES = list(runs())


def where_changed(fwd, name):
    """The cells an intervention wrote (its value differs from the formula by design)."""
    plan = fwd.caches.get("plan")
    return bool(plan) and name in plan.steps


@pytest.mark.parametrize("arch, kind, cfg, params, inputs, change", CASES,
                         ids=[f"{a}-{k}" for a, k, *_ in CASES])
def test_every_cell_holds_or_names_the_intervention(arch, kind, cfg, params, inputs, change):
    fwd = tfmcli.forward(params, inputs, cfg, interventions=change)
    run = Run(cfg, params, inputs, "seed", "seed")
    explained = named = 0
    for name, array in fwd.acts.items():
        for index in itertools.product(*map(range, array.shape)):
            x = explain_value(run, fwd, name, index, name)
            assert not x.bug, (name, index, x.text())
            if x.claimed is not None:
                explained += 1
            if not x.holds:   # only where an intervention wrote: on this tensor, or derived
                named += 1
                assert x.changed and all(c in fwd.caches["plan"].described for c in x.changed)
                assert f"changed by {x.changed[0]}" in "\n".join(x.text())
    assert explained > 300
    # every activation's cells have a rule (the walk above checked each against the record)
    ruled = {name for name in fwd.acts if explain_value(
        run, fwd, name, (0,) * fwd.acts[name].ndim, name).claimed is not None}
    assert set(fwd.acts) - ruled == set(), set(fwd.acts) - ruled
    if kind in ("zero", "set", "scale") and cfg.norm == "pre" or kind == "set-read":
        assert named >= 1, "the intervened cells are explained as changed"


@pytest.mark.parametrize("arch, kind, cfg, params, inputs, change", CASES,
                         ids=[f"{a}-{k}" for a, k, *_ in CASES])
def test_every_gradient_is_its_paths_sum_or_names_the_intervention(arch, kind, cfg, params,
                                                                  inputs, change):
    """Every entry of every gradient, activation and parameter, explained as the sum of its
    paths: the sum is the backward's number, or an intervention on what it reads says why."""
    fwd = tfmcli.forward(params, inputs, cfg, interventions=change)
    grads = tfmcli.backward(params, fwd, cfg)
    run = Run(cfg, params, inputs, "seed", "seed")
    named = 0
    for name, array in [*grads.acts.items(), *grads.items()]:
        for index in itertools.product(*map(range, array.shape)):
            x = explain_gradient(run, fwd, grads, name, index, name)
            assert x.claimed is not None, f"no rule for the gradient of {name}"
            assert not x.bug, (name, index, x.text())
            if not x.holds:
                named += 1
                assert x.changed and all(c in fwd.caches["plan"].described for c in x.changed)
    if kind != "none" and cfg.dtype == "float64":
        assert named >= 1, "what an intervention stopped or scaled is named"


def test_a_planted_mistake_in_a_gradients_paths_is_a_bug_the_walk_finds(monkeypatch):
    """Forgetting one reader of the residual stream (ln2's, into resid1) or the cap's slope
    in the head's gradient: the walk's check fails."""
    from tfmcli.explain import gradients

    arch, kind, cfg, params, inputs, change = next(c for c in CASES if c[:2] == ("gpt2",
                                                                                "none"))
    fwd = tfmcli.forward(params, inputs, cfg)
    grads = tfmcli.backward(params, fwd, cfg)
    run = Run(cfg, params, inputs, "seed", "seed")
    assert not explain_gradient(run, fwd, grads, "blocks.0.resid1", (0, 1, 2), "").bug
    readers = gradients.readers
    monkeypatch.setattr(gradients, "readers", lambda cfg, name: [
        w for w in readers(cfg, name) if w[0] != "norm" or not name.endswith("resid1")])
    x = explain_gradient(run, fwd, grads, "blocks.0.resid1", (0, 1, 2), "dresid1")
    assert x.bug and "a bug in tfm" in x.text()[1]
    monkeypatch.undo()
    capped = next(c for c in CASES if c[:2] == ("softcaps-alibi", "none"))[2:5]
    fwd = tfmcli.forward(capped[1], capped[2], capped[0])
    grads = tfmcli.backward(capped[1], fwd, capped[0])
    run = Run(capped[0], capped[1], capped[2], "seed", "seed")
    assert not explain_gradient(run, fwd, grads, "head.W_U", (1, 2), "").bug
    monkeypatch.setattr(gradients, "_dz", lambda ex: ex.gradients["logits"])
    assert explain_gradient(run, fwd, grads, "head.W_U", (1, 2), "").bug


def test_the_explorers_quoted_mistakes_are_named():
    """Issue 71: pattern[0, 0, q1, k0] ablated was explained as 0.0000 = 1.0000 / 1.5687, and
    resid1[0, t2, 0] set to 0.5 as +0.277574 + -0.051462 = +0.226112."""
    cfg = tfmcli.Config(seq_len=5, batch=1)
    params, inputs = tfmcli.init_params(cfg), tfmcli.make_inputs(cfg)
    run = Run(cfg, params, inputs, "seed", "seed")
    fwd = tfmcli.forward(params, inputs, cfg,
                         interventions=[Ablate("blocks.0.attn.pattern[0, 0, 1, 0]")])
    x = explain_value(run, fwd, "blocks.0.attn.pattern", (0, 0, 1, 0), "pattern[0, 0, q1, k0]")
    assert x.recorded == 0.0 and x.claimed > 0.1 and not x.holds
    text = x.text()
    assert text[:3] == ["pattern[0, 0, q1, k0] = 0",
                        "changed by ablate blocks.0.attn.pattern[0, 0, 1, 0]:",
                        f"  the formula gives {x.claimed:+.4f}, the run recorded 0.0000"]
    fwd = tfmcli.forward(params, inputs, cfg, interventions=[Set("blocks.0.resid1[0, 2]", 0.5)])
    x = explain_value(run, fwd, "blocks.0.resid1", (0, 2, 0), "resid1[0, t2, 0]")
    assert x.recorded == 0.5 and x.changed == ("set blocks.0.resid1[0, 2] = 0.5",) or \
        x.changed and x.changed[0].startswith("set blocks.0.resid1[0, 2]")
    # the cell beside it was not written: its sum holds
    assert explain_value(run, fwd, "blocks.0.resid1", (0, 1, 0), "resid1[0, t1, 0]").holds


@pytest.mark.parametrize("claimed, recorded, changed, shown", [
    (1.0, 1.0 + 1e-13, (), "holds"),
    (1.0, 1.0 + 1e-9, (), "a bug in tfm"),
    (1.0, 0.0, ("ablate x",), "changed by ablate x:"),
    (None, 3.0, (), "holds"),
])
def test_a_claim_is_checked_against_the_record(claimed, recorded, changed, shown):
    x = Explanation("v[0]", recorded, claimed, ("formula",), (), 1.0, changed)
    text = "\n".join(x.text())
    if shown == "holds":
        assert x.holds and "bug" not in text and "changed" not in text
    else:
        assert not x.holds and shown in text
    assert x.bug == (shown == "a bug in tfm")


def test_a_planted_mistake_in_a_formula_is_a_bug_the_walk_finds(monkeypatch):
    """A formula off by a slip (the residual sum dropping its sublayer) fails the walk."""
    from tfmcli.explain import cells

    rule = cells._rule

    def slipped(run, fwd, values, name, index, recorded):
        out = rule(run, fwd, values, name, index, recorded)
        if out is not None and name.endswith("resid2"):
            return (out[0] * 1.001, *out[1:])
        return out

    monkeypatch.setattr(cells, "_rule", slipped)
    arch, kind, cfg, params, inputs, change = CASES[0]
    with pytest.raises(AssertionError, match="a bug in tfm"):
        test_every_cell_holds_or_names_the_intervention(arch, kind, cfg, params, inputs, change)


def test_a_views_working_against_the_record_names_the_intervention():
    cfg = tfmcli.Config(seq_len=5, batch=1)
    params, inputs = tfmcli.init_params(cfg), tfmcli.make_inputs(cfg)
    fwd = tfmcli.forward(params, inputs, cfg, interventions=[Ablate("blocks.0.attn.head1")])
    recorded = fwd.acts["blocks.0.attn.context"][0, 2, 0:3]   # head 0's: not ablated
    same = agreement(fwd, "the row", recorded * (1 + 1e-13), recorded, ["blocks.0.attn.context"])
    assert same.holds and re.fullmatch(r"the row differs from this by \d\.\de-1[34]",
                                       same.sentence())
    off = agreement(fwd, "the row", recorded + 0.29, recorded, ["blocks.0.attn.context"])
    assert not off.holds and "ablate blocks.0.attn.head1 changed the run" in off.sentence()
    bug = agreement(fwd, "the row", recorded + 0.29, recorded, ["blocks.0.attn.q"])
    assert "a bug in tfm" in bug.sentence()


@pytest.mark.parametrize("args, said", [
    (["attn", "--head", "1", "--query", "2", "--ablate", "blocks.0.attn.head1"],
     "differs from this sum by 2.9e-01: ablate blocks.0.attn.head1 changed the run"),
    (["block", "-t", "2", "--set", "blocks.0.resid1[0, 2]=0.5"],
     "differ from the model's own by 5.3e-01: set blocks.0.resid1[0, 2] = 0.5 changed the run"),
    (["block", "-t", "2"], None),
    (["attn", "--head", "1", "--query", "2"], None),
])
def test_the_views_by_hand_name_what_changed_the_run(args, said):
    """Issue 71: tfm attn and tfm block redid the unchanged run by hand and ended with 'the
    model's own context row differs from this sum by 2.9e-01', no word of the change."""
    from helpers import ok

    text = " ".join(ok(*args, "--tokens", "3,1,4,1,5").stdout.split())
    if said is None:   # unchanged: the working holds, and nothing is said of a change
        assert "changed the run" not in text and "a bug in tfm" not in text
        assert re.search(r"(differs from this sum|differ from the model's own) by "
                         r"\d\.\de[-+]\d\d", text)
    else:
        assert said in text


@pytest.mark.parametrize("args, said", [
    (["ln", "--ablate", "blocks.0.ln1.out[0, 0]"],
     "differs from this by 1.4e+00: ablate blocks.0.ln1.out[0, 0] changed the run"),
    (["ffn", "--set", "blocks.0.ffn.act[0, 0]=1"],
     "differ from these by 1.1e+00: set blocks.0.ffn.act[0, 0] = 1 changed the run"),
    (["loss", "-t", "1", "--scale", "logits[0, 1]=2"],
     "dlogits differs from the backward pass's own by 4.0e-02: scale logits[0, 1] x 2 changed"),
    (["embed", "--ablate", "embed[0, 0]"],
     "dW_E[1] differs from the backward pass's by 1.5e-01: ablate embed[0, 0] changed the run"),
])
def test_every_part_by_hand_names_what_changed_the_run(args, said):
    from helpers import ok

    assert said in " ".join(ok(*args).stdout.split())


def test_embeds_central_differences_run_the_changed_model():
    """The check of dW_E ran the model without the run's interventions, 3.0e-01 off the
    backward, which goes through the changed graph: now both are of the changed model, so
    they are the same distance from the by-hand sum (which counts the ablated position)."""
    import json

    from helpers import ok

    data = json.loads(ok("embed", "--ablate", "embed[0, 0]", "--json").stdout)
    assert data["dW_E_model_diff"] > 0.1   # the ablated position passes no gradient
    assert data["dW_E_numeric_diff"] == pytest.approx(data["dW_E_model_diff"], abs=1e-8)


VIEWS = [["attn", "--query", "2", "--backward"], ["attn", "--backward", "--head", "1"],
         ["ln"], ["ln", "--layer", "ln2", "-t", "2"], ["ffn", "-t", "2"], ["loss", "-t", "2"],
         ["embed", "-t", "2"], ["block", "-t", "2"]]
CHANGES = [[], ["--dtype", "float32"], ["--dtype", "bfloat16"], ["--dtype", "float16"],
           ["--ablate", "blocks.0.attn.pattern[0, 1, 2, 1]"],
           ["--ablate", "blocks.0.ffn.act", "--ablate-with", "mean"],
           ["--set", "blocks.0.resid1[0, 2]=0.5"], ["--scale", "blocks.0.attn.head1=3"],
           ["--scale", "logits[0, 2]=2"], ["--ablate", "embed[0, 2]"],
           ["--patch", "blocks.0.ln1.out", "--from-tokens", "2,7,1,6,2"]]


@pytest.mark.parametrize("change", CHANGES, ids=lambda c: " ".join(c) or "none")
@pytest.mark.parametrize("view", VIEWS, ids=" ".join)
def test_no_view_by_hand_shows_a_difference_it_cannot_explain(view, change):
    """Every line that holds a view's working against the run's own either holds, or names
    the intervention that changed the run; none says 'a bug in tfm'."""
    from helpers import ok

    text = " ".join(ok(*view, "--tokens", "3,1,4,1,5", "-L", "2", *change).stdout.split())
    assert "a bug in tfm" not in text
    if not change or change[0] == "--dtype":
        assert "changed the run" not in text


def test_a_formulas_numbers_are_never_a_row_of_zeros():
    """An exact zero is 0 (a fresh layer norm's beta), a small number scientific, never
    +0.000000; a term added is written with its sign once."""
    from tfmcli.explain.cells import _plus, _v

    cfg = tfmcli.Config(seq_len=5, batch=1)
    params, inputs = tfmcli.init_params(cfg), tfmcli.make_inputs(cfg)
    fwd = tfmcli.forward(params, inputs, cfg)
    text = "\n".join(explain_value(Run(cfg, params, inputs, "seed", "seed"), fwd,
                                   "blocks.0.ln1.out", (0, 1, 2), "ln1.out").text())
    assert "beta = 0\n" in text and "0.000000" not in text, text
    assert (_v(1.6e-06), _v(-0.2860), _v(0.0), _plus(-0.7376)) == (
        "+1.60000e-06", "-0.286000", "0", " - 0.737600")
