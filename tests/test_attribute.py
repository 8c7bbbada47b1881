"""tfm attribute: direct logit attribution, whose terms add up to the logit on every
architecture whose logits are a sum, and which says so where they are not."""

import json

import numpy as np
import pytest

import tfmcli
from helpers import error_line, ok, random_params, run
from tfmcli.engine.presets import PRESETS
from tfmcli.explain.attribution import attribute

ARCHS = [None, "gpt2", "llama", "mistral", "gemma", "gemma2", "gpt_neox", "phi", "falcon",
         "bloom", "mpt", "qwen3"]


@pytest.mark.parametrize("arch", ARCHS, ids=[a or "default" for a in ARCHS])
def test_the_terms_add_up_to_the_logit(arch):
    cfg = tfmcli.Config(**{"seq_len": 5, "layers": 2, **(PRESETS[arch].fields if arch else {})})
    params = random_params(tfmcli.init_params(cfg), 2)
    fwd = tfmcli.forward(params, tfmcli.make_inputs(cfg), cfg)
    for row, position, token in ((0, 0, 1), (1, 4, 7), (1, 2, 3)):
        result = attribute(params, fwd, cfg, row, position, token)
        assert abs(result.total - result.logit) <= 1e-12 * max(1.0, np.abs(result.values).sum())
        assert list(np.abs(result.values)) == sorted(np.abs(result.values), reverse=True)
        logit = fwd.acts["logits"][row, position, token]
        if cfg.logit_softcap is None:
            assert abs(result.logit - logit) <= 1e-12 * max(1.0, abs(logit))
        else:   # the terms are of the logit before the cap
            c = cfg.logit_softcap
            assert abs(c * np.tanh(result.logit / c) - logit) <= 1e-12
            assert "not linear" in result.note
    if cfg.parallel_residual:   # said: every term is there
        assert "parallel blocks" in result.note
    heads = [n for n in result.names if ".head" in n]
    assert len(heads) == (0 if cfg.sandwich_norm else cfg.layers * cfg.heads)


def test_a_heads_term_is_its_context_through_w_o_the_norm_and_the_tokens_column():
    cfg = tfmcli.Config(seq_len=5, layers=1)
    params = random_params(tfmcli.init_params(cfg), 3)
    fwd = tfmcli.forward(params, tfmcli.make_inputs(cfg), cfg)
    result = attribute(params, fwd, cfg, 0, 3, 2)
    x = fwd.acts["blocks.0.out"][0, 3]
    head = fwd.acts["blocks.0.attn.context"][0, 3, 3:6] @ params["blocks.0.attn.W_O"][3:6]
    # the logit is linear in the stream once the norm's scale is frozen: remove the head and
    # the logit drops by exactly its term
    sigma = np.sqrt(x.var() + cfg.eps)

    def logit(stream):
        normed = params["ln_f.gamma"] * (stream - stream.mean()) / sigma + params["ln_f.beta"]
        return normed @ params["head.W_U"][:, 2] + params["head.b_U"][2]

    # the head's term leaves its share of the centring (-mean) to the centring's own term
    term = result.values[result.names.index("blocks.0.attn.head1")]
    share = -head.mean() * (params["ln_f.gamma"] * params["head.W_U"][:, 2]).sum() / sigma
    assert abs(term + share - (logit(x) - logit(x - head))) <= 1e-12


def test_post_ln_says_its_logits_are_not_a_sum():
    cfg = tfmcli.Config(seq_len=4, norm="post")
    params = tfmcli.init_params(cfg)
    with pytest.raises(ValueError, match="Post-LN"):
        attribute(params, tfmcli.forward(params, tfmcli.make_inputs(cfg), cfg), cfg, 0, 0, 0)
    line = error_line(run("attribute", "--arch", "vaswani"), 1)
    assert "Post-LN" in line and "not a sum" in line


def test_the_json_terms_and_the_default_token():
    payload = json.loads(ok("attribute", "--tokens", "3,1,4,1,5", "-t", "2", "-L", "2",
                            "--json").stdout)
    assert payload["token"] == 1     # the position's target: the token after 4
    total = sum(term["value"] for term in payload["terms"])
    assert abs(total - payload["logit"]) <= 1e-12 * max(1.0, abs(payload["logit"]))
    assert len(payload["terms"]) == 2 + 2 * (2 + 1 + 2) + 3   # embed, pe; heads, b_O, ffn,
    #                                                         # b_2 per block; centring, beta, b_U


def test_the_view_lists_the_largest_terms_and_the_sum_beside_the_logit():
    text = ok("attribute", "--tokens", "3,1,4,1,5", "-t", "2", "-k", "3").stdout
    assert "more" in text and "sum of the terms" in text and "the logit" in text
    sums = [line.split()[-1] for line in text.splitlines()
            if line.strip().startswith(("sum of the terms", "the logit"))]
    assert sums[0] == sums[1]


def test_a_text_target_on_a_checkpoint():
    pytest.importorskip("tokenizers")
    pytest.importorskip("safetensors")
    payload = json.loads(ok("attribute", "--load", "examples/tiny-gpt2", "--text",
                            "The cat sat on the", "-t", "4", "--target", " mat",
                            "--json").stdout)
    assert payload["token_text"] == "␣mat" or payload["token_text"].strip() == "mat"


@pytest.mark.parametrize("args, code, words", [
    (["--tokens", "3,1,4", "-t", "5"], 2, ["'--position'"]),
    (["--tokens", "3,1,4", "--tokens", "1,2", "--row", "1", "-t", "2"], 2, ["padding"]),
    (["--tokens", "3,1,4", "--target", "99"], 2, ["'--target'", "outside 0..7"]),
    (["--tokens", "3,1,4", "--target", "cat"], 2, ["'--target'", "tokenizer"]),
])
def test_bad_options(args, code, words):
    line = error_line(run("attribute", *args), code)
    assert all(word in line for word in words), line
