"""Attribution patching's pair scores, `-alpha_ij^h dL/dalpha_ij^h`, against the Hugging Face
model itself, on the float64 twin of tiny models of six architectures.

The scores under test come from the float64 bridge through `cw_lens.models.gradients` (a zero
tensor added at the output projection, one backward pass, then `<pv_j^h, dL/do_i>`). Two
independent references, with the summed next-token NLL taken from the HF logits in float64:

- autograd through the HF model, with the gradient read at the input `z` of each HF output
  projection (``hf_reference.z_gradients``): `-alpha_ij^h <v_j^h, dL/dz_i^h>`; within
  `RTOL_AUTOGRAD` of the layer's largest score (the bridge's activations pass through norms
  that compute in float32, ~1e-7);
- central finite differences of the HF model's NLL with one pair's `alpha_ij^h` scaled by
  `1 -+ EPS` through an exact edit of `z` (``hf_reference.run_with_z_edit``), on GPT-2, whose
  forward pass is float64 throughout (the RMSNorms of the other architectures compute in
  float32, which leaves their finite differences noisy at 1e-4); within `RTOL_FD`.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from architectures import BY_NAME, build
from hf_reference import capture, run_with_z_edit, z_gradients

import cw_lens
from cw_lens.data.inputs import prepare_inputs
from cw_lens.models.gradients import attention_output_gradients

ARCHS = ["Llama", "GPT-2", "Qwen2", "Gemma 2", "Bloom", "GPT-J"]
RTOL_AUTOGRAD = 1e-5
EPS = 1e-4
RTOL_FD = 1e-6
N_PAIRS = 6


def hf_nll(logits, tokens):
    """The summed next-token NLL, float64."""
    logp = torch.log_softmax(logits.double(), -1)[:, :-1]
    return -logp.gather(-1, tokens[:, 1:, None]).sum()


@pytest.fixture(scope="module", params=ARCHS)
def case(request):
    got = build(replace(BY_NAME[request.param], dtype=torch.float64), seed=1)
    if got.error is not None:
        pytest.skip(f"{request.param}: this TransformerLens cannot bridge it ({got.error})")
    tokens = cw_lens.models.testing.random_tokens(got.bridge, 2, 8, seed=5)
    batch = prepare_inputs(got.bridge, tokens, prepend_bos=False)
    grads = attention_output_gradients(
        got.bridge,
        batch,
        lambda logits: hf_nll(logits, batch.tokens),
        layers=range(got.bridge.cfg.n_layers),
    )
    refs, _ = capture(got.arch, got.hf, tokens)
    return got, tokens, grads, refs


def test_attribution_matches_autograd_through_the_hf_model(case):
    got, tokens, grads, refs = case
    dz = z_gradients(got.arch, got.hf, tokens, lambda logits: hf_nll(logits, tokens))
    for layer, ref in enumerate(refs):
        v = ref.v.repeat_interleave(ref.group, dim=2)  # [batch, key, head, d_head]
        want = -ref.alpha * torch.einsum("bkhd,bqhd->bhqk", v, dz[layer])
        have = grads[layer].attribution().double()
        err = ((have - want).abs().max() / want.abs().max()).item()
        assert err < RTOL_AUTOGRAD, f"{got.arch.name} L{layer}: {err:.2e}"


def test_attribution_matches_finite_differences(case):
    got, tokens, grads, refs = case
    if got.arch.name != "GPT-2":
        pytest.skip("finite differences need a forward pass in float64 throughout (GPT-2's)")
    gen = torch.Generator().manual_seed(0)
    for layer, ref in enumerate(refs):
        have = grads[layer].attribution().double()
        scale = have.abs().max().item()
        b, h, n, _ = ref.alpha.shape
        v = ref.v.repeat_interleave(ref.group, dim=2)
        for _ in range(N_PAIRS):
            row, head = (int(torch.randint(k, (1,), generator=gen)) for k in (b, h))
            i = int(torch.randint(1, n, (1,), generator=gen))
            j = int(torch.randint(i + 1, (1,), generator=gen))
            term = torch.zeros_like(ref.z)
            term[row, i, head] = ref.alpha[row, head, i, j] * v[row, j, head]

            def nll(t, term=term, layer=layer):
                edit = {layer: lambda z: z - t * term}
                return hf_nll(run_with_z_edit(got.arch, got.hf, tokens, edit), tokens).item()

            want = (nll(EPS) - nll(-EPS)) / (2 * EPS)  # d/dt of the NLL at alpha (1 - t)
            err = abs(have[row, head, i, j].item() - want) / scale
            assert err < RTOL_FD, f"L{layer} ({row},{head},{i},{j}): {err:.2e}"


def test_a_loss_that_ignores_the_logits_is_refused():
    model = cw_lens.load_model("testing:tiny-llama")
    batch = prepare_inputs(model, ["the cat sat"])
    with pytest.raises(cw_lens.InputError, match="scalar"):
        attention_output_gradients(model, batch, lambda logits: torch.tensor(1.0), layers=[0])


def test_a_hooked_transformer_gives_the_bridges_scores():
    """The same weights as a `HookedTransformer` and a `TransformerBridge` (TL 3.x has both):
    the output projection differs (the attention module, the bridge's `o`), the scores agree."""
    from apis import HAS_BRIDGE, HAS_HOOKED

    if not (HAS_BRIDGE and HAS_HOOKED):
        pytest.skip("needs both model classes (TransformerLens 3.x)")
    scores = []
    for api in ("hooked", "bridge"):
        model = cw_lens.models.testing.tiny_llama(api=api, seed=3)
        batch = prepare_inputs(model, ["the cat sat on the mat", "attention is all"])
        grads = attention_output_gradients(
            model, batch, lambda logits, b=batch: hf_nll(logits, b.tokens), layers=[0, 1]
        )
        scores.append(torch.stack([grads[layer].attribution() for layer in (0, 1)]))
    err = ((scores[0] - scores[1]).abs().max() / scores[1].abs().max()).item()
    assert err < 1e-4, err
