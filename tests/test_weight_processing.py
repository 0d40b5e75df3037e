"""processing_warnings: TransformerLens weight processing that changes contribution weights is
reported (with the fix), processing that changes none is not — each case measured against the
dense float64 reference of the raw model."""

from __future__ import annotations

import copy

import pytest
import torch
from apis import needs_bridge, needs_hooked
from reference import model_reference

from cw_lens.models import testing
from cw_lens.models.testing import random_tokens
from cw_lens.models.weight_processing import processing_warnings

OFF = {
    "fold_ln": False,
    "center_writing_weights": False,
    "center_unembed": False,
    "fold_value_biases": False,
}
CENTRED, FOLDED = "W_O is centred", "value biases are zero"


def _raw(build):
    """A tiny HookedTransformer with non-trivial norm weights (and LayerNorm biases), so that
    folding the norms is a real rewrite."""
    model = build(seed=0, api="hooked")
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith((".w", ".b")) and ("ln" in name):
                base = 1.0 if name.endswith(".w") else 0.0
                param.copy_(base + 0.3 * torch.randn(param.shape, generator=gen))
    return model


def _processed(build, **flags):
    """What HookedTransformer.from_pretrained does, with the given flags, to the same weights:
    a model built with LNPre/RMSPre norms when folding, then load_and_process_state_dict."""
    from transformer_lens import HookedTransformer

    raw = _raw(build)
    cfg = copy.deepcopy(raw.cfg)
    if flags.get("fold_ln"):
        cfg.normalization_type += "Pre"
    model = HookedTransformer(cfg, tokenizer=raw.tokenizer)
    model.load_and_process_state_dict(
        {k: v.clone() for k, v in raw.state_dict().items()}, **{**OFF, **flags}
    )
    return model.eval()


def _max_weight_change(a, b, tokens):
    """max |C_a - C_b| over layers, heads, queries and keys, for intra and inter weights."""
    out = {}
    for kind in ("intra", "inter"):
        out[kind] = max(
            (
                model_reference(a, tokens, layer, kind)["weights"]
                - model_reference(b, tokens, layer, kind)["weights"]
            )
            .nan_to_num()
            .abs()
            .max()
            .item()
            for layer in range(a.cfg.n_layers)
        )
    return out


@needs_hooked
@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        ({}, []),
        ({"fold_ln": True}, []),
        ({"center_unembed": True}, []),
        ({"center_writing_weights": True}, [CENTRED]),
        ({"fold_value_biases": True}, [FOLDED]),
        ({k: True for k in OFF}, [CENTRED, FOLDED]),  # from_pretrained's defaults
    ],
    ids=["raw", "fold_ln", "center_unembed", "center_writing", "fold_value_biases", "default"],
)
def test_layernorm_model_warnings_match_what_changes(flags, expected):
    raw, model = _raw(testing.tiny_gpt2), _processed(testing.tiny_gpt2, **flags)
    tokens = random_tokens(raw, 2, 14, seed=3)
    with torch.inference_mode():  # every rewrite keeps the model's log-probs
        assert torch.allclose(raw(tokens).log_softmax(-1), model(tokens).log_softmax(-1), atol=1e-4)
    messages = processing_warnings(model)
    assert [next(k for k in (CENTRED, FOLDED) if k in m) for m in messages] == expected
    assert all("from_pretrained_no_processing" in m for m in messages)
    change = _max_weight_change(raw, model, tokens)
    if expected:  # a warning is about a real change of the weights cw_lens reports ...
        assert max(change.values()) > 0.01, change
    else:  # ... and no warning means none
        assert max(change.values()) <= 1e-5, change


@needs_hooked
def test_rmsnorm_model_without_biases_is_unaffected_and_not_warned():
    raw, model = (
        _raw(testing.tiny_llama),
        _processed(testing.tiny_llama, **dict.fromkeys(OFF, True)),
    )
    assert model.cfg.normalization_type == "RMSPre"
    assert processing_warnings(model) == []
    change = _max_weight_change(raw, model, random_tokens(raw, 2, 14, seed=3))
    assert max(change.values()) <= 1e-5, change


@needs_hooked
def test_the_centring_signature_needs_every_layer():
    """One centred layer is not processing (TL centres all): no false alarm."""
    model = _raw(testing.tiny_gpt2)
    with torch.no_grad():
        W_O = model.blocks[0].attn.W_O
        W_O -= W_O.mean(-1, keepdim=True)
    assert processing_warnings(model) == []
    with torch.no_grad():
        for block in model.blocks:
            block.attn.W_O -= block.attn.W_O.mean(-1, keepdim=True)
    assert [CENTRED in m for m in processing_warnings(model)] == [True]


@needs_hooked
def test_bfloat16_centring_is_still_recognised():
    model = _processed(testing.tiny_gpt2, center_writing_weights=True).to(torch.bfloat16)
    assert any(CENTRED in m for m in processing_warnings(model))
    assert processing_warnings(_raw(testing.tiny_gpt2).to(torch.bfloat16)) == []


@needs_bridge
def test_processed_bridge_is_warned_with_the_bridge_fix():
    bridge = testing.tiny_gpt2(seed=0, api="bridge")
    assert processing_warnings(bridge) == []
    bridge.process_weights()
    messages = processing_warnings(bridge)
    assert len(messages) == 2
    assert all("no_processing=True" in m and "records process_weights" in m for m in messages)
