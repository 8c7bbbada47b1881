"""Interventions (issue 62): ablate, set, scale and patch by name, forward and backward.

The oracle is PyTorch autograd on the independent torch model (``check/reference.py``), whose
hooks change the same activations as clones: autograd goes through the changed graph on its
own, so the hand-written backward's masks and scales are checked, not repeated.
"""

from __future__ import annotations

import numpy as np
import pytest

import tfmcli
from helpers import assert_scaled_close, o1_gpt2, random_params
from tfmcli.engine.interventions import Ablate, InterventionError, Patch, Scale, Set
from tfmcli.engine.presets import PRESETS


def model(seed=3, **fields):
    cfg = tfmcli.Config(**{"seq_len": 5, "layers": 2, "batch": 2, **fields})
    params = random_params(tfmcli.init_params(cfg), seed)
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, cfg.vocab, size=(cfg.batch, cfg.seq_len))
    inputs = tfmcli.inputs_from_tokens(tokens)
    if cfg.batch > 1:   # the second row shorter: padding the mean must leave out
        inputs = tfmcli.inputs_from_tokens([tokens[0], tokens[1][:3]])
    return cfg, params, inputs


def other_run(cfg, params, inputs):
    """The same model on other tokens (the same shapes): a run to patch from."""
    tokens = (inputs.tokens + 1) % cfg.vocab
    rows = [tokens[b][:inputs.lengths[b]] for b in range(len(tokens))]
    return tfmcli.forward(params, tfmcli.inputs_from_tokens(rows), cfg)


def every_kind(cfg, source):
    """One of each, on the places every architecture has."""
    return [Ablate("blocks.0.attn.head1"), Ablate("blocks.1.ffn.act[:, 2:4]", "mean"),
            Set("blocks.0.resid1[0, 1]", 0.5), Scale("blocks.1.ffn.pre[..., 3:7]", -1.5),
            Patch("blocks.1.attn[:, 2]", source), Scale("blocks.0.attn.v[:, :, 1:3]", 2.0),
            Ablate("embed[1, 0, 2]"), Scale("logits[:, :, 0]", 0.5), Ablate("blocks.0.in[0, 3]",
                                                                            "mean")]


ARCHS = [None, "gpt2", "llama", "mistral", "vaswani", "gpt_neox", "phi", "gemma2", "qwen3",
         "bloom"]


@pytest.mark.parametrize("arch", ARCHS, ids=[a or "default" for a in ARCHS])
def test_loss_logits_and_every_gradient_equal_torch_through_the_changed_graph(arch):
    pytest.importorskip("torch")
    from tfmcli.check.reference import torch_run

    cfg, params, inputs = model(**(PRESETS[arch].fields if arch else {}))
    interventions = every_kind(cfg, other_run(cfg, params, inputs))
    if cfg.pe == "rope":
        interventions.append(Scale("blocks.1.attn.k_rot[:, 0]", 0.25))
    # the scores and the pattern: attention then runs a kept step at a time in that block
    interventions += [Scale("blocks.1.attn.scores[:, 0]", 1.5),
                      Set("blocks.1.attn.pattern[0, 1, 3]", 0.25),
                      Ablate("blocks.0.attn.pattern[:, :, 2:4, 1]")]
    fwd = tfmcli.forward(params, inputs, cfg, interventions=interventions)
    grads = tfmcli.backward(params, fwd, cfg)
    theirs = torch_run(params, inputs, cfg, interventions)
    plain = tfmcli.forward(params, inputs, cfg)
    assert abs(fwd.loss - plain.loss) > 1e-6          # the changes changed the run
    assert abs(fwd.loss - theirs.loss.item()) <= 1e-12 * abs(fwd.loss)
    assert_scaled_close(fwd.acts["logits"], theirs.logits.detach().numpy())
    for name, leaf in theirs.leaves.items():
        assert_scaled_close(grads[name], leaf.grad.numpy(), floor=1e-15)


def test_no_intervention_is_the_plain_run_bit_for_bit():
    cfg, params, inputs = model()
    plain, empty = tfmcli.forward(params, inputs, cfg), tfmcli.forward(params, inputs, cfg,
                                                                       interventions=[])
    assert plain.loss == empty.loss
    for name, g in tfmcli.backward(params, plain, cfg).items():
        assert np.array_equal(g, tfmcli.backward(params, empty, cfg)[name])


def test_an_ablated_head_is_zero_and_no_gradient_reaches_its_values():
    cfg, params, inputs = model(layers=1)
    fwd = tfmcli.forward(params, inputs, cfg, interventions=[Ablate("blocks.0.attn.head1")])
    grads = tfmcli.backward(params, fwd, cfg)
    dh = cfg.d_head
    assert not fwd.acts["blocks.0.attn.context"][:, :, dh:2 * dh].any()
    assert fwd.acts["blocks.0.attn.context"][:, :, :dh].any()
    # head 1's values feed only its context: their weights learn nothing; head 0's do
    assert not grads["blocks.0.attn.W_V"][:, dh:2 * dh].any()
    assert grads["blocks.0.attn.W_V"][:, :dh].any()
    # the context's own gradient is still the loss's with respect to it
    assert grads.acts["blocks.0.attn.context"][:, :, dh:2 * dh].any()


def test_mean_ablation_takes_the_mean_over_the_real_positions_of_every_row():
    cfg, params, inputs = model(layers=1)
    plain = tfmcli.forward(params, inputs, cfg).acts["blocks.0.ffn.act"]
    fwd = tfmcli.forward(params, inputs, cfg,
                         interventions=[Ablate("blocks.0.ffn.act[1, 0]", "mean")])
    real = np.concatenate([plain[0, :inputs.lengths[0]], plain[1, :inputs.lengths[1]]])
    assert inputs.lengths[1] < cfg.seq_len                       # a padded row
    assert np.array_equal(fwd.acts["blocks.0.ffn.act"][1, 0], real.mean(axis=0))
    assert np.array_equal(fwd.acts["blocks.0.ffn.act"][0], plain[0])


def test_a_scaled_entrys_gradient_matches_central_differences():
    cfg, params, inputs = model(layers=1, activation="gelu")
    change = [Scale("blocks.0.ffn.pre[:, 1:3, 4]", 3.0), Set("blocks.0.resid1[0, 2, 1]", 0.2)]
    grads = tfmcli.backward(params, tfmcli.forward(params, inputs, cfg, interventions=change),
                            cfg)
    h = 1e-6
    for name, index in (("blocks.0.ffn.W_1", (2, 4)), ("blocks.0.attn.W_Q", (1, 0)),
                        ("embed.W_E", (int(inputs.tokens[0, 1]), 3))):
        losses = []
        for sign in (1, -1):
            nudged = {k: v.copy() for k, v in params.items()}
            nudged[name][index] += sign * h
            losses.append(tfmcli.forward(nudged, inputs, cfg, interventions=change).loss)
        numeric = (losses[0] - losses[1]) / (2 * h)
        assert abs(grads[name][index] - numeric) <= 1e-7 * max(1.0, abs(numeric)), name


@pytest.mark.parametrize("target, words", [
    ("blocks.0.ffn.actt", ["no activation 'blocks.0.ffn.actt'", "blocks.0.ffn.act"]),
    ("blocks.7.ffn", ["no activation 'blocks.7.ffn.out'"]),
    ("blocks.0.attn.pattrn", ["did you mean blocks.0.attn.pattern", "blocks.{i}.attn.head{h}"]),
    ("resid1", ["did you mean blocks.0.resid1?", "tfm forward --json"]),
    ("blocks.0.head1", ["did you mean blocks.0.resid1", "blocks.{i}.attn.head{h}"]),
    ("blocks.0.ffn.act[0, 9]", ["index 9 is out of bounds", "its shape is 2x5x24"]),
    ("blocks.0.ffn.act[0, 1, 2, 3]", ["too many indices", "2x5x24"]),
    ("blocks.0.ffn.act[0, x]", ["'x' is not an index"]),
    ("blocks.0.attn.head2", ["block 0 has heads 0..1"]),
    ("blocks.0.attn.head1[:, :, 3]", ["out of bounds", "its shape is 2x5x3"]),
    ("probs", ["change the logits"]),
])
def test_a_bad_target_says_what_is_wrong_with_it(target, words):
    cfg, params, inputs = model(layers=1)
    with pytest.raises(InterventionError) as caught:
        tfmcli.forward(params, inputs, cfg, interventions=[Ablate(target)])
    assert caught.value.target == target
    assert all(word in str(caught.value) for word in words), str(caught.value)


def test_a_patch_from_a_run_of_another_shape_names_both_shapes():
    cfg, params, inputs = model(layers=1)
    short = tfmcli.forward(params, tfmcli.inputs_from_tokens([[1, 2, 3], [3, 2]]), cfg)
    with pytest.raises(InterventionError, match=r"2x5x6 in this run and 2x3x6 in the source"):
        tfmcli.forward(params, inputs, cfg, interventions=[Patch("blocks.0.attn.out", short)])


# ------------------------------------------------------------------ the command line

from helpers import error_line, ok, run  # noqa: E402

TOKENS = ["--tokens", "3,1,4,1,5", "--tokens", "2,7,1"]


def test_a_commands_json_and_npz_carry_the_interventions_and_the_changed_numbers(tmp_path):
    import json

    args = [*TOKENS, "--ablate", "blocks.0.attn.head1", "--scale", "blocks.0.ffn.act[:, 2]=2",
            "--ablate", "blocks.0.ffn.pre[1]", "--ablate-with", "mean"]
    out = tmp_path / "run.npz"
    payload = json.loads(ok("backward", *args, "--json", "--save", out).stdout)
    # --ablate-with is every --ablate's; the patches, ablations, sets and scales in that order
    assert payload["interventions"] == ["ablate blocks.0.attn.head1 (mean)",
                                        "ablate blocks.0.ffn.pre[1] (mean)",
                                        "scale blocks.0.ffn.act[:, 2] x 2"]
    from tfmcli.sources import parse_tokens, resolve  # the command's model, on these tokens

    made = resolve({**tfmcli.Config().__dict__}, set(), None,
                   parse_tokens(["3,1,4,1,5", "2,7,1"])).complete()
    change = [Ablate("blocks.0.attn.head1", "mean"), Ablate("blocks.0.ffn.pre[1]", "mean"),
              Scale("blocks.0.ffn.act[:, 2]", 2.0)]
    fwd = tfmcli.forward(made.params, made.inputs, made.cfg, interventions=change)
    grads = tfmcli.backward(made.params, fwd, made.cfg)
    saved = np.load(out)
    assert json.loads(str(saved["interventions"])) == payload["interventions"]
    assert float(saved["loss"]) == fwd.loss
    for name, g in grads.items():
        assert np.array_equal(saved[f"grad/{name}"], g), name
    assert np.array_equal(saved["act/blocks.0.attn.context"], fwd.acts["blocks.0.attn.context"])


def test_the_panel_lists_the_interventions_in_the_order_applied():
    text = ok("forward", *TOKENS, "--scale", "blocks.0.resid1=0.5", "--ablate",
              "blocks.0.ffn").stdout
    assert "interventions  ablate blocks.0.ffn; scale blocks.0.resid1 x 0.5" in text


def test_a_patch_copies_from_the_run_on_the_other_tokens():
    import json

    plain = json.loads(ok("forward", "--tokens", "3,1,4,1,5", "--json", "--show",
                          "blocks.0.attn.out").stdout)
    other = json.loads(ok("forward", "--tokens", "1,2,3,4,5", "--json", "--show",
                          "blocks.0.attn.out").stdout)
    patched = json.loads(ok("forward", "--tokens", "3,1,4,1,5", "--json", "--show",
                            "blocks.0.attn.out", "--patch", "blocks.0.attn.out[:, 1:3]",
                            "--from-tokens", "1,2,3,4,5").stdout)
    assert patched["loss"] != plain["loss"]
    shown = {k: v for k, v in patched.items() if k not in ("loss", "interventions")}
    assert shown != {k: v for k, v in plain.items() if k != "loss"}
    assert other != plain


def test_check_against_torch_and_gradcheck_take_the_interventions():
    pytest.importorskip("torch")
    change = ["--patch", "blocks.0.attn.head0", "--from-tokens", "1,2,3,4,5", "--from-tokens",
              "6,1,2", "--ablate", "blocks.0.ffn.act[:, :, 3:9]", "--ablate-with", "mean",
              "--scale", "blocks.0.resid1[0]=-1"]
    assert "all 25 agree" in ok("check", "--against", "torch", *TOKENS, *change).stdout
    assert "gradcheck passed" in ok("gradcheck", *TOKENS, *change).stdout


@pytest.mark.parametrize("args, words", [
    (["--ablate", "blocks.0.ffn.actt"], ["'--ablate'", "no activation 'blocks.0.ffn.actt'"]),
    (["--ablate", "blocks.0.ffn.act[0, 9]"], ["'--ablate'", "out of bounds", "2x5x24"]),
    (["--set", "blocks.0.ffn.act"], ["'--set'", "TARGET=VALUE"]),
    (["--scale", "blocks.0.ffn.act=inf"], ["'--scale'", "finite"]),
    (["--scale", "blocks.0.ffn.acts=2"], ["'--scale'", "no activation"]),
    (["--patch", "blocks.0.attn.out"], ["'--patch'", "--from-tokens"]),
    (["--from-tokens", "1,2"], ["'--from-tokens'", "add --patch"]),
    (["--patch", "blocks.0.ffn", "--from-tokens", "1,2,3"], ["'--patch'", "2x5x6 in this run",
                                                              "1x3x6 in the source run"]),
    (["--patch", "blocks.0.ffn", "--from-tokens", "1,x"], ["'--from-tokens'", "'1,x'"]),
    (["--patch", "blocks.0.ffn", "--from-text", "hi"], ["'--from-text'", "--load DIR"]),
    (["--ablate-with", "median", "--ablate", "embed"], ["'--ablate-with'", "median"]),
])
def test_a_bad_intervention_is_a_usage_error_naming_the_option(args, words):
    line = error_line(run("forward", *TOKENS, *args), 2)
    assert all(word in line for word in words), line


def test_the_pages_python_block_runs_and_its_comments_hold():
    import re
    from pathlib import Path

    page = (Path(__file__).resolve().parent.parent / "docs" / "interventions.md").read_text()
    block = re.search(r"^```python\n(.*?)^```", page, flags=re.S | re.M)[1]
    names = {}
    exec(compile(block, "docs/interventions.md", "exec"), names)
    fwd, grads, cfg = names["fwd"], names["grads"], names["cfg"]
    dh = cfg.d_head
    assert not fwd.acts["blocks.0.attn.context"][:, :, dh:].any()      # head 1 zeroed
    assert fwd.acts["blocks.0.resid1"][0, 2].tolist() == [0.5] * cfg.d_model
    assert not grads["blocks.0.attn.W_V"][:, dh:].any()
    other = names["other"].acts["blocks.0.attn.out"]
    assert np.array_equal(fwd.acts["blocks.0.attn.out"][:, 1], other[:, 1])


@pytest.mark.parametrize("padding", [False, True])
def test_a_gpt2_checkpoint_with_hugging_faces_hooks_agrees(tmp_path, padding):
    """The same changes made by forward hooks on Hugging Face's GPT2LMHeadModel (float64, O(1)
    parameters), on a checkpoint folder tfm reads: loss, logits and every gradient to 1e-12."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from tfmcli.sources import gpt2

    config = transformers.GPT2Config(n_embd=12, n_head=3, n_layer=2, vocab_size=50,
                                     n_positions=16, resid_pdrop=0.0, embd_pdrop=0.0,
                                     attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    model = o1_gpt2(config, tmp_path / "hf")
    rows = [[5, 9, 2, 7, 1, 3], [4, 8, 15, 16, 23, 42]]
    lengths = [6, 3] if padding else [6, 6]
    inputs = tfmcli.inputs_from_tokens([row[:n] for row, n in zip(rows, lengths)])
    cfg = tfmcli.Config(**{**gpt2.read_config(tmp_path / "hf"), "batch": 2, "seq_len": 6,
                           "lengths": (6, 3) if padding else None})
    _, params = gpt2.load_checkpoint(tmp_path / "hf", np.float64)
    other = tfmcli.forward(params, tfmcli.inputs_from_tokens(
        [[1, 2, 3, 4, 5, 6], [7, 8, 9][:lengths[1]] + [10, 11, 12][:lengths[1] - 3]]), cfg)
    change = [Patch("blocks.0.attn[:, 1]", other), Ablate("blocks.0.attn.head1"),
              Ablate("blocks.0.ffn", "mean"), Set("blocks.1.in[0, 2]", 0.5),
              Scale("blocks.1.ffn.act[:, 2]", 2.0)]
    fwd = tfmcli.forward(params, inputs, cfg, interventions=change)
    grads = tfmcli.backward(params, fwd, cfg)

    dh, real = 4, torch.as_tensor(np.arange(6)[None, :] < np.array(lengths)[:, None])
    h0, h1 = model.transformer.h
    # hooks, in the order tfm applies them where two meet (the patch before the ablation)
    def attn_out(module, args, out):            # blocks.0.attn.out: position 1 from the other
        patched = out[0].clone()
        patched[:, 1] = torch.as_tensor(other.acts["blocks.0.attn.out"])[:, 1]
        return (patched, *out[1:])

    def head1(module, args):                    # c_proj's input is the merged context
        context = args[0].clone()
        context[..., dh:2 * dh] = 0.0
        return (context,)

    def ffn_mean(module, args, out):            # the mean over the real positions, a constant
        mean = out.detach()[real].mean(0)
        return mean.expand_as(out).clone()

    def block1_in(module, args, kwargs):
        x = args[0].clone()
        x[0, 2] = 0.5
        return (x, *args[1:]), kwargs

    def act2(module, args):                     # W_2's input is the FFN's activation
        act = args[0].clone()
        act[:, 2] = act[:, 2] * 2.0
        return (act,)

    handles = [h0.attn.c_proj.register_forward_pre_hook(head1),
               h0.attn.register_forward_hook(attn_out),
               h0.mlp.register_forward_hook(ffn_mean),
               h1.register_forward_pre_hook(block1_in, with_kwargs=True),
               h1.mlp.c_proj.register_forward_pre_hook(act2)]
    ids = torch.as_tensor(inputs.tokens)
    logits = model(input_ids=ids, attention_mask=real.long()).logits
    for handle in handles:
        handle.remove()
    labels = ids.masked_fill(~real, -100)
    loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, 50),
                                             labels[:, 1:].reshape(-1), ignore_index=-100)
    loss.backward()
    assert abs(fwd.loss - loss.item()) <= 1e-12 * loss.item()
    valid = real.numpy()
    assert_scaled_close(fwd.acts["logits"][valid], logits[real].detach().numpy())
    hf = dict(model.named_parameters())

    def theirs(name):   # no path from the loss (a constant in between): no .grad at all
        p = hf[name]
        return np.zeros(tuple(p.shape)) if p.grad is None else p.grad.numpy()

    for i in range(2):
        h, p = f"transformer.h.{i}.", f"blocks.{i}."
        assert_scaled_close(grads[p + "attn.W_O"], theirs(h + "attn.c_proj.weight"))
        assert_scaled_close(grads[p + "ffn.W_1"], theirs(h + "mlp.c_fc.weight"))
        assert_scaled_close(grads[p + "ffn.W_2"], theirs(h + "mlp.c_proj.weight"))
        for w in "QV":
            k = "QKV".index(w)
            assert_scaled_close(grads[p + f"attn.W_{w}"],
                                theirs(h + "attn.c_attn.weight")[:, k * 12:(k + 1) * 12])
    assert_scaled_close(grads["embed.W_E"], theirs("transformer.wte.weight"))
    assert_scaled_close(grads["embed.W_pos"], theirs("transformer.wpe.weight"))
    # block 0's FFN is a constant: nothing reaches its weights
    assert not grads["blocks.0.ffn.W_1"].any()


KV_ARCHS = [None, "mistral", "gemma2", "gpt_neox", "vaswani", "bloom", "qwen3", "gemma3"]


@pytest.mark.parametrize("arch", KV_ARCHS, ids=[a or "default" for a in KV_ARCHS])
def test_decoding_with_a_kv_cache_makes_the_same_changes_as_the_whole_forward(arch):
    from tfmcli.engine.kv import decode
    from tfmcli.engine.model import plan_for, unchecked_forward

    cfg = tfmcli.Config(**{"seq_len": 6, "layers": 2, "batch": 1,
                           **(PRESETS[arch].fields if arch else {})})
    params = random_params(tfmcli.init_params(cfg), 4)
    inputs = tfmcli.inputs_from_tokens([[3, 1, 4, 1, 5, 2]])
    other = tfmcli.forward(params, tfmcli.inputs_from_tokens([[1, 2, 3, 4, 5, 6]]), cfg)
    change = [Patch("blocks.0.attn[:, 2]", other), Ablate("blocks.0.attn.head1"),
              Ablate("blocks.1.ffn.act[:, 1:4]", "mean"), Set("blocks.0.resid1[0, 3]", 0.5),
              Scale("blocks.1.ffn.pre[..., 2:5]", -1.5), Scale("blocks.1.attn.scores[0, 0]", 2),
              Set("blocks.1.attn.pattern[0, 1, 4, 2]", 0.3), Scale("logits[0, 5]", 0.5),
              Ablate("blocks.1.in[0, 1]")]
    if cfg.pe == "rope":
        change.append(Scale("blocks.0.attn.k_rot[0, 0, 2]", 3.0))
    plan = plan_for(change, cfg, inputs)
    whole = unchecked_forward(params, inputs, cfg, plan=plan)    # the means, made once
    plain = tfmcli.forward(params, inputs, cfg)
    steps = decode(params, inputs.tokens[0], cfg, plan=plan)
    logits = np.array([s.logits for s in steps])
    assert_scaled_close(logits, whole.acts["logits"][0])
    assert np.abs(logits - plain.acts["logits"][0]).max() > 1e-3   # the changes changed it


def test_tfm_kv_takes_the_interventions_on_its_row():
    text = ok("kv", "--tokens", "3,1,4,1,5", "--ablate", "blocks.0.attn.head1", "--ablate",
              "blocks.0.ffn.act[:, 1:3]", "--ablate-with", "mean").stdout
    assert "interventions  ablate blocks.0.attn.head1 (mean)" in text
    import re

    worst = float(re.search(r"max \|Δ logits\| ([0-9.e+-]+);", text)[1])
    assert worst < 1e-12
    line = error_line(run("kv", "--tokens", "3,1,4,1,5", "--generate", "2", "--ablate",
                          "blocks.0.ffn", "--ablate-with", "mean"), 2)
    assert "'--ablate-with'" in line and "--generate" in line
    line = error_line(run("kv", "--tokens", "3,1,4", "--tokens", "2,2", "--ablate",
                          "blocks.0.ffn.act[1]"), 2)
    assert "'--ablate'" in line and "one row" in line
