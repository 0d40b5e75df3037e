"""The public definition, `cw_lens.reference.layer_contributions`, against the model itself and
against its own statement: the dense vectors it builds are the model's, and it refuses hooks
that do not hold what it reads. (The fast path is tested against it everywhere else, through
`tests/reference.py`.)"""

from __future__ import annotations

import pytest
import torch

from cw_lens.reference import layer_contributions


def _layer(model, text, layer):
    from cw_lens.models.capture import cache_names

    with torch.no_grad():
        _, cache = model.run_with_cache(
            text, names_filter=[*cache_names(layer), f"blocks.{layer}.hook_attn_out"]
        )
    attn = model.blocks[layer].attn
    tensors = [cache[f"blocks.{layer}.attn.hook_{n}"] for n in ("pattern", "v", "z")]
    return tensors, attn.W_O, attn.b_O, cache[f"blocks.{layer}.hook_attn_out"]


@pytest.mark.parametrize("layer", [0, 1])
def test_the_layer_output_is_the_models_attention_output(tiny, layer):
    """The sum of the dense vectors plus `b_O` is what the model's attention wrote, and the
    head outputs are `z W_O`: the definition reads the hooks as the model wires them."""
    (pattern, v, z), W_O, b_O, attn_out = _layer(tiny, "The cat sat on the mat.", layer)
    ref = layer_contributions(pattern, v, z, W_O)
    bias = 0 if b_O is None else b_O.detach().double()
    torch.testing.assert_close(ref["layer_output"] + bias, attn_out.double(), rtol=1e-4, atol=1e-5)
    heads = torch.einsum("bqhd,hdm->bhqm", z.double(), W_O.detach().double())
    torch.testing.assert_close(ref["head_output"], heads, rtol=1e-4, atol=1e-5)  # z is float32


@pytest.mark.parametrize("kind", ["intra", "inter"])
def test_rows_sum_to_one_and_the_factors_multiply_to_the_weight(tiny, kind):
    (pattern, v, z), W_O, _, _ = _layer(tiny, "The cat sat on the mat.", 0)
    ref = layer_contributions(pattern, v, z, W_O, kind=kind)
    rows = ref["weights"].sum(-1)
    total = rows if kind == "intra" else rows.sum(1)
    torch.testing.assert_close(total, torch.ones_like(total))
    product = ref["attention"] * ref["relative_norm"] * ref["cosine"]
    torch.testing.assert_close(product, ref["weights"])


def test_a_z_that_is_not_pattern_times_v_is_refused(tiny):
    (pattern, v, z), W_O, _, _ = _layer(tiny, "The cat sat on the mat.", 0)
    with pytest.raises(ValueError, match="z is not pattern @ v"):
        layer_contributions(pattern, v, z.flip(1), W_O)


def test_shapes_that_do_not_fit_and_an_unknown_kind_are_refused(tiny):
    (pattern, v, z), W_O, _, _ = _layer(tiny, "The cat sat on the mat.", 0)
    with pytest.raises(ValueError, match="do not fit"):
        layer_contributions(pattern, v, z, W_O[:-1])
    with pytest.raises(ValueError, match="kind is 'intra' or 'inter'"):
        layer_contributions(pattern, v, z, W_O, kind="layer")
