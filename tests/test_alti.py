"""ALTI pair scores (L1 proximity, as the LLM Transparency Tool computes them) against a dense
float64 reference whose parts are read from the Hugging Face modules themselves
(``flow_reference``: every ``A_i(alpha_ij^h pv_j^h)`` materialised in ``d_model``, the
post-attention norm applied by the HF norm module), on tiny models of six architectures.

Tolerance: ``RTOL`` of each query's largest contribution (float32 L1 norms of ``d_model``
vectors against float64).
"""

from __future__ import annotations

import importlib.metadata

import pytest
import torch
from apis import needs_bridge
from flow_reference import dense_flow_reference, tiny_model

import cw_lens
from cw_lens.analyses.faithfulness.ranking import Ranks, alti_scores
from cw_lens.core.proximity import PROXIMITY_EPS, attention_proximity
from cw_lens.data.inputs import prepare_inputs
from cw_lens.models.blocks import run_blocks
from cw_lens.models.testing import random_tokens

ARCHS = ["llama", "gpt2", "neox", "gptj", "gemma2", "olmo2"]
TL_MAJOR = int(importlib.metadata.version("transformer-lens").split(".")[0])
RTOL = 1e-5


def reference_alti(entry):
    """Dense float64 ALTI of one layer: every part against the whole, then normalised."""
    pieces, x_in = entry["pieces"], entry["x_in"]  # [b, h, q, k, d], [b, q, d]
    whole = x_in + entry["attn_piece"]
    n = whole.shape[1]
    causal = torch.ones(n, n, dtype=torch.bool).tril()
    w_norm = whole.abs().sum(-1)
    pairs = w_norm[:, None, :, None] - (whole[:, None, :, None] - pieces).abs().sum(-1)
    pairs = pairs.clamp_min(PROXIMITY_EPS).masked_fill(~causal, 0.0)
    residual = (w_norm - (whole - x_in).abs().sum(-1)).clamp_min(PROXIMITY_EPS)
    total = pairs.sum((1, 3)) + residual
    return pairs / total[:, None, :, None]


@pytest.fixture(scope="module", params=ARCHS)
def arch_model(request):
    if TL_MAJOR < 3:
        pytest.skip("the dense reference reads a bridge's HF modules; TransformerLens 2.x has none")
    if request.param == "olmo2" and TL_MAJOR < 4:
        pytest.skip("OLMo 2 bridge of TransformerLens 3.x: the flow checks refuse it")
    return request.param, tiny_model(request.param, n_layers=3)


def alti_errors(model, tokens, ref):
    """Per layer, the row-relative error of `alti_scores` on `tokens` against `ref`."""
    batch = prepare_inputs(model, tokens, prepend_bos=False)
    n = tokens.shape[1]
    valid = torch.ones(tokens.shape[0], n, n, dtype=torch.bool).tril()
    got = {}
    run_blocks(
        model,
        batch,
        lambda block: got.__setitem__(block.layer, alti_scores(block, valid)),
        layers=list(range(model.cfg.n_layers)),
    )
    errors = []
    for layer, entry in enumerate(ref):
        want = reference_alti(entry)
        scale = want.amax((1, 3), keepdim=True)
        errors.append(((got[layer].double() - want).abs() / scale).max().item())
    return errors


def test_alti_matches_the_dense_reference(arch_model):
    arch, model = arch_model
    tokens = random_tokens(model, 2, 9, seed=3)
    ref = dense_flow_reference(model, tokens)
    for layer, entry in enumerate(ref):
        assert max(entry["errors"].values()) < 1e-4, (arch, layer, entry["errors"])
    for layer, err in enumerate(alti_errors(model, tokens, ref)):
        assert err < RTOL, f"{arch} L{layer}: ALTI row-relative error {err:.2e}"


def test_chunking_does_not_change_the_scores():
    g = torch.Generator().manual_seed(0)
    b, h, n, d = 2, 3, 7, 16
    pattern = torch.softmax(torch.randn(b, h, n, n, generator=g), -1).tril()
    vectors = torch.randn(b, h, n, d, generator=g)
    resid = torch.randn(b, n, d, generator=g)
    scale = torch.rand(b, n, generator=g) + 0.5
    whole = resid + scale[..., None] * torch.einsum("bhqk,bhkd->bqd", pattern, vectors)
    valid = torch.ones(b, n, n, dtype=torch.bool).tril()
    one = attention_proximity(pattern, vectors, scale, resid, whole, valid, chunk_elements=1)
    big = attention_proximity(pattern, vectors, scale, resid, whole, valid)
    for x, y in zip(one, big, strict=True):
        assert torch.equal(x, y)
    pairs, residual = big
    assert torch.allclose(pairs.sum((1, 3)) + residual, torch.ones(b, n), atol=1e-6)


@needs_bridge  # the reference reads the bridge's HF modules
def test_alti_ranks_the_faithfulness_removals():
    """`faithfulness(metrics=("alti",))` removes exactly the pairs the reference ranks first."""
    model = tiny_model("llama", n_layers=2)
    text = "contribution weights project values onto the output"
    batch = prepare_inputs(model, [text])
    layers = list(range(model.cfg.n_layers))
    ranks = Ranks(batch, layers, model.cfg.n_heads, ["alti"], ["pairs"], False, 0)
    run_blocks(model, batch, ranks.update_block, layers=layers)
    ref = dense_flow_reference(model, batch.tokens)
    n = batch.tokens.shape[1]
    for layer, entry in enumerate(ref):
        want = reference_alti(entry)[0]  # [head, query, key]
        for i in range(1, n):
            cands = [(h, j) for h in range(model.cfg.n_heads) for j in range(i + 1)]
            order = sorted(cands, key=lambda c: (-float(want[c[0], i, c[1]]), c[0], c[1]))
            top = order[: max(1, round(0.1 * len(cands)))]
            rank = ranks.pairs["alti", layer][0, :, i]
            assert all(int(rank[h, j]) < len(top) for h, j in top), (layer, i)


def test_alti_faithfulness_runs_and_reports_its_column():
    model = cw_lens.models.testing.tiny_gpt2(n_layers=2)  # a HookedTransformer on TL 2.x
    corpus = ["the cat sat on the mat", "attention is not explanation"]
    result = cw_lens.faithfulness(
        model, corpus, metrics=("contribution", "alti"), fractions=(0.5,), progress=False
    )
    assert list(result.aopc().columns) == ["contribution", "alti"]
    assert result.curves["delta_nll"].notna().all()


def test_attribution_patching_ranks_from_the_loss_the_curves_measure():
    """`attribution_patching` differentiates the batch's summed next-token NLL: the loss it
    builds equals the clean NLL the curves are measured against, and the run reports it."""
    from cw_lens.analyses.faithfulness.curves import _clean_loss
    from cw_lens.data.scoring import run_logits

    model = cw_lens.models.testing.tiny_llama(n_layers=2)  # a HookedTransformer on TL 2.x
    corpus = ["the cat sat on the mat", "attention is not explanation, says one paper"]
    result = cw_lens.faithfulness(
        model, corpus, metrics=("attribution_patching", "random"), fractions=(0.5,),
        progress=False,
    )  # fmt: skip
    assert list(result.aopc().columns) == ["attribution_patching", "random"]
    batch = prepare_inputs(model, corpus)
    loss = _clean_loss(batch, None)(run_logits(model, batch))
    scored = result.n_tokens - result.n_documents  # a document's first token is not scored
    assert abs(float(loss) / scored - result.clean["nll"]) < 1e-5
