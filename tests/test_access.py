"""The model-access layer: verification, hook-order independence, interventions under capture.

References here are independent of the code under test: dense float64 contributions from the
captured pattern and values (tests/reference.py), and interventions recomputed from a clean
run's pattern and values.
"""

from __future__ import annotations

import pytest
import torch
from apis import needs_bridge
from reference import dense_contributions

import cw_lens
from cw_lens.core.geometry import expand_kv
from cw_lens.models.access import model_access
from cw_lens.models.capture import consistency_error


def _tokens(model, n=12, batch=2, seed=3):
    from cw_lens.models.testing import random_tokens

    return random_tokens(model, batch, n, seed=seed)


def _clean_layer(model, tokens, layer):
    names = [f"blocks.{layer}.attn.hook_pattern", f"blocks.{layer}.attn.hook_v"]
    with torch.no_grad():
        _, cache = model.run_with_cache(tokens, names_filter=names)
    return cache[names[0]].double(), cache[names[1]].double()


def test_verify_model_reports_identities_routes_and_interventions(tiny):
    report = cw_lens.verify_model(tiny)
    assert report.ok, report.summary_text()
    api = "hooked" if type(tiny).__name__ == "HookedTransformer" else "bridge"
    assert report.api == api and report.route == "hook_z"
    assert len(report.layers) == tiny.cfg.n_layers
    assert (report.layers[["pattern_v_z", "output"]] < 1e-5).all().all()
    if api == "bridge":  # a HookedTransformer wraps no Hugging Face model to compare with
        assert report.logits_vs_hf is not None and report.logits_vs_hf < 1e-5
    assert all(v.startswith("exact") for v in report.interventions.values())
    assert cw_lens.verify_model(tiny) is report  # cached per model
    assert "verified" in str(report)


def _reruns_equal_passes_of_their_own(model):
    from cw_lens.models.access import probe_tokens
    from cw_lens.models.verify import _attention_under
    from cw_lens.models.verify_probe import edit_hooks, probe_pass

    access = model_access(model)
    tokens = probe_tokens(access, 2, 16)
    probe = probe_pass(access, tokens, flow=True).probe
    assert probe.interventions_read and probe.route == access.route
    clean = probe.clean[probe.layer]["attention"]
    for name, edit in probe.edits.items():
        hook_set, _ = edit_hooks(access, name, edit, access.route)
        alone = _attention_under(access, tokens, hook_set, probe.layer)
        assert torch.equal(probe.intervened[name], alone), name
        assert not torch.equal(probe.intervened[name], clean), name  # the edit changed it


def test_the_probe_pass_reruns_equal_intervened_passes_of_their_own(tiny):
    """verify_model reads each intervention's effect from the checked layer's attention module
    run again inside its one probe pass (cw_lens.models.verify_probe): its output under each
    edit is bit for bit that of a pass of its own under the edit."""
    _reruns_equal_passes_of_their_own(tiny)


@needs_bridge
def test_the_probe_pass_reruns_equal_passes_of_their_own_on_the_attention_output_route():
    from arch_checks import built

    model = built("GPT-J").bridge
    _reruns_equal_passes_of_their_own(model)
    assert model_access(model).route == "attention output"


def test_not_a_transformerlens_model_is_refused():
    with pytest.raises(cw_lens.UnsupportedModelError, match="TransformerLens models"):
        cw_lens.verify_model(torch.nn.Linear(3, 3))
    with pytest.raises(cw_lens.UnsupportedModelError, match="TransformerLens models"):
        cw_lens.contribution_weights(torch.nn.Linear(3, 3), "text")


def test_consistency_error_catches_small_edits_of_z():
    gen = torch.Generator().manual_seed(0)
    pattern = torch.softmax(torch.randn(2, 4, 9, 9, generator=gen), -1).tril()
    values = torch.randn(2, 9, 2, 8, generator=gen)
    z = torch.einsum("bhqk,bkhd->bqhd", pattern, expand_kv(values, 4))
    assert consistency_error(pattern, values, z) < 1e-5
    edited = z.clone()
    edited[1, 5, 3] *= 1.01  # one (batch, query, head) row off by 1%
    assert consistency_error(pattern, values, edited) > 1e-4


def test_the_one_product_bound_never_passes_what_the_exact_check_refuses(llama):
    """check_consistent decides passes on an upper bound of the exact error (alpha for |alpha|,
    one product over the pattern): equal for a softmax pattern, larger for a signed one — where
    the exact error is recomputed, so a signed pattern that does make z still passes."""
    from cw_lens.models.capture import check_consistent

    gen = torch.Generator().manual_seed(1)
    values = torch.randn(2, 9, 2, 8, generator=gen, dtype=torch.float64)
    for signed in (False, True):
        scores = torch.randn(2, 4, 9, 9, generator=gen, dtype=torch.float64)
        pattern = scores if signed else torch.softmax(scores, -1).tril()
        z = torch.einsum("bhqk,bkhd->bqhd", pattern, expand_kv(values, 4))
        args = (pattern.float(), values.float(), z.float())
        exact = consistency_error(*args)
        bound = consistency_error(*args, upper_bound=True)
        assert exact < 1e-5
        if signed:  # the bound alone would refuse it (cancelling alpha |v| terms)
            assert bound > 1e-4
        else:  # the same up to the float rounding of the products
            assert bound < 1e-5
        check_consistent(model_access(llama), 0, *args)  # passes: the exact error decides
        edited = args[2].clone()
        edited[1, 5, 3] *= 1.01
        with pytest.raises(cw_lens.UnsupportedModelError, match="z differs from pattern @ v"):
            check_consistent(model_access(llama), 0, *args[:2], edited)


def test_capture_refuses_a_foreign_edit_of_z(llama):
    """A plain hook list that edits z (here patch_sink's own pairs) inside a capture: cw_lens
    cannot know the edit, so the captured pattern and values would not explain z — refuse."""
    tokens = _tokens(llama)
    pairs = list(cw_lens.patch_sink(llama, layers=[1]))
    with llama.hooks(fwd_hooks=pairs):
        with pytest.raises(cw_lens.UnsupportedModelError, match="z differs from pattern @ v"):
            cw_lens.contribution_weights(llama, tokens, layers=[1])
    # entered as a hook set, the same intervention is accounted for
    with cw_lens.patch_sink(llama, layers=[1]):
        cw_lens.contribution_weights(llama, tokens, layers=[1])


@pytest.mark.parametrize("scale", [0.0, 0.5, 1.5])
def test_weights_inside_patch_sink_describe_the_patched_layer(tiny, scale):
    """Inside ``with patch_sink``: the patched layer's weights equal a dense reference in which
    the sink's projected value is scaled by lambda (queries after the sink), and rows sum to 1."""
    layer, heads = 1, [0, 2]
    tokens = _tokens(tiny)
    pattern, values = _clean_layer(tiny, tokens, layer)  # layer 1's inputs are unpatched
    effective = pattern.clone()
    effective[:, heads, 1:, 0] *= scale  # alpha pv_0 -> alpha (lambda pv_0) == (lambda alpha) pv_0
    ref = dense_contributions(effective, values, tiny.blocks[layer].attn.W_O.detach(), "intra")
    with cw_lens.patch_sink(tiny, layers=[layer], heads=heads, scale=scale):
        cw = cw_lens.contribution_weights(tiny, tokens, layers=[layer], kind="intra")
    got = cw.weights[:, 0].double()
    assert torch.allclose(got.nan_to_num(), ref["weights"].nan_to_num(), atol=2e-4)
    sums = got.nansum(-1)
    assert torch.allclose(sums, torch.ones_like(sums), atol=1e-4)


def test_weights_inside_remove_heads_and_mask_attention(llama):
    layer = 1
    tokens = _tokens(llama)
    pattern, values = _clean_layer(llama, tokens, layer)
    remove = torch.zeros(pattern.shape, dtype=torch.bool)
    remove[:, :, 4:, 1:3] = True
    remove &= torch.ones(12, 12, dtype=torch.bool).tril()
    effective = pattern.masked_fill(remove, 0.0)
    ref = dense_contributions(effective, values, llama.blocks[layer].attn.W_O.detach(), "inter")
    with cw_lens.mask_attention(llama, {layer: remove}):
        cw = cw_lens.contribution_weights(llama, tokens, layers=[layer], kind="inter")
    assert torch.allclose(cw.weights[:, 0].double(), ref["weights"], atol=2e-4)
    assert torch.allclose(cw.attention[:, 0].double(), effective, atol=1e-6)
    with cw_lens.remove_heads(llama, [(layer, 3)]):
        cw = cw_lens.contribution_weights(llama, tokens, layers=[layer], kind="inter")
    assert float(cw.attention[:, 0, 3].nan_to_num().abs().max()) == 0.0
    sums = cw.weights[:, 0].nansum((1, 3))
    assert torch.allclose(sums, torch.ones_like(sums), atol=1e-4)


def test_access_dimensions_and_names(llama):
    access = model_access(llama)
    assert (access.n_layers, access.n_heads, access.n_kv_heads) == (2, 4, 2)
    assert access.hook_name("z", 1) == "blocks.1.attn.hook_z"
    assert access.hook_order[0][-1] == "z"
    with pytest.raises(cw_lens.InputError, match="Unknown hook kind"):
        access.hook_name("nope", 0)
    w = access.output_weights(0)
    assert w.W_O.shape == (4, 16, 64) and w.W_O.dtype == torch.float32
