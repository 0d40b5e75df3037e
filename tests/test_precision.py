"""Half-precision models: float32 accumulation, and weights within a documented tolerance.

Documented tolerance (docs/scaling.md, Precision): the difference to the float32 run comes from the
half-precision forward pass itself (attention probabilities already differ by up to 0.1 in
bfloat16 on SmolLM2); cw_lens adds no half-precision arithmetic of its own.
"""

from __future__ import annotations

import pytest
import torch

import cw_lens
from cw_lens.models.testing import random_tokens, tiny_llama

TOLERANCE = {  # row-relative error of the weights versus the float32 model: (mean, p99)
    torch.bfloat16: (0.01, 0.08),
    torch.float16: (0.002, 0.02),
}


def row_relative_error(a, b, kind):
    dims = (-1,) if kind == "intra" else (2, -1)
    scale = b.abs().amax(dim=dims, keepdim=True).clamp_min(1e-12)
    err = ((a - b).abs() / scale)[~b.isnan()]
    return float(err.mean()), float(err.quantile(0.99))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_activations_are_accumulated_in_float32(dtype):
    """Given the half-precision activations, our weights equal a float64 computation."""
    model = tiny_llama(seed=1, dtype=dtype)
    tokens = random_tokens(model, 1, 12, seed=1)
    result = cw_lens.contribution_weights(model, tokens, kind="intra")
    assert result.weights.dtype == torch.float32
    with torch.no_grad():
        _, cache = model.run_with_cache(tokens)
    for layer in range(model.cfg.n_layers):
        pattern = cache[f"blocks.{layer}.attn.hook_pattern"].double()
        values = cache[f"blocks.{layer}.attn.hook_v"].double().repeat_interleave(2, dim=2)
        z = cache[f"blocks.{layer}.attn.hook_z"].double()
        W_O = model.blocks[layer].attn.W_O.detach().double()
        pv = torch.einsum("bkhd,hdm->bhkm", values, W_O)
        out = torch.einsum("bqhd,hdm->bhqm", z, W_O)
        dots = torch.einsum("bhkm,bhqm->bhqk", pv, out)
        expected = pattern * dots / out.norm(dim=-1)[..., None] ** 2
        got = result.weights[:, layer].double()
        causal = torch.ones(12, 12, dtype=torch.bool).tril()
        scale = expected.abs().amax(-1, keepdim=True)
        assert (((got - expected).abs() / scale)[..., causal]).max() < 1e-5


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_tiny_half_model_within_tolerance_of_float32(dtype):
    full = tiny_llama(seed=2)
    half = tiny_llama(seed=2, dtype=dtype)
    tokens = random_tokens(full, 2, 16, seed=2)
    for kind in ("intra", "inter"):
        a = cw_lens.contribution_weights(half, tokens, kind=kind).weights
        b = cw_lens.contribution_weights(full, tokens, kind=kind).weights
        mean, p99 = row_relative_error(a, b, kind)
        assert mean < TOLERANCE[dtype][0] and p99 < TOLERANCE[dtype][1], (kind, mean, p99)


@pytest.mark.model
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_embedded_half_model_within_tolerance_of_float32(smollm, dtype):
    text = "Contribution weights measure how much each token moves the output of a head."
    half = cw_lens.load_model(device="cpu", dtype=dtype)
    for kind in ("intra", "inter"):
        a = cw_lens.contribution_weights(half, text, kind=kind).weights
        b = cw_lens.contribution_weights(smollm, text, kind=kind).weights
        mean, p99 = row_relative_error(a, b, kind)
        assert mean < TOLERANCE[dtype][0] and p99 < TOLERANCE[dtype][1], (kind, mean, p99)


# --------------------------------------------------------------------- planted edits, every dtype
# The per-layer check (z == pattern @ v, cw_lens.models.capture.check_consistent) runs in
# float32 with a rounding bound, so it must stay sharp enough to catch a real edit in every
# precision a model may run in: an edit of z behind cw_lens's back, and a hook_pattern edit that
# the model ignores (GPT-J fires hook_pattern after its attention has run: the edit never
# reaches z).
PLANTED_DTYPES = [torch.float32, torch.bfloat16, torch.float16]
PLANTED_REFUSAL = "z differs from pattern @ v"


def _halve_z(z, hook):
    z = z.clone()
    z[:, 6:, 1] *= 0.5  # one head's output, from query 6 on
    return z


def _halve_sink(pattern, hook):
    pattern = pattern.clone()
    pattern[:, :, 1:, 0] *= 0.5  # every head's attention to position 0, after it
    return pattern


@pytest.mark.parametrize("dtype", PLANTED_DTYPES, ids=str)
def test_a_planted_edit_of_z_is_refused_in_every_precision(dtype):
    model = tiny_llama(seed=3, dtype=dtype)
    tokens = random_tokens(model, 2, 16, seed=3)
    cw_lens.contribution_weights(model, tokens, kind="inter")  # the clean model passes
    with model.hooks(fwd_hooks=[("blocks.1.attn.hook_z", _halve_z)]):
        with pytest.raises(cw_lens.UnsupportedModelError, match=PLANTED_REFUSAL):
            cw_lens.contribution_weights(model, tokens, kind="inter")


@pytest.mark.parametrize("dtype", PLANTED_DTYPES, ids=str)
def test_an_ignored_pattern_edit_is_refused_in_every_precision(dtype):
    from dataclasses import replace

    from architectures import BY_NAME, build

    model = build(replace(BY_NAME["GPT-J"], dtype=dtype), seed=3).bridge
    if model is None:  # this TransformerLens has no bridge for GPT-J (3.9's compat venv)
        pytest.skip("no TransformerBridge for GPT-J in this TransformerLens")
    tokens = random_tokens(model, 2, 16, seed=3)
    cw_lens.contribution_weights(model, tokens, kind="inter")  # the clean model passes
    with model.hooks(fwd_hooks=[("blocks.1.attn.hook_pattern", _halve_sink)]):
        with torch.no_grad():
            plain = model(tokens)
        with pytest.raises(cw_lens.UnsupportedModelError, match=PLANTED_REFUSAL):
            cw_lens.contribution_weights(model, tokens, kind="inter")
    with torch.no_grad():
        assert torch.equal(plain, model(tokens))  # the model did ignore the edit
