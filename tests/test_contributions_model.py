"""Contribution weights on the embedded SmolLM2-135M against the dense reference."""

from __future__ import annotations

import pytest
import torch
from reference import assert_rows_close, causal_rows, model_reference, tolerance

import cw_lens

pytestmark = pytest.mark.model

FIELDS = ("attention", "weights", "cosine", "relative_norm", "value_norm", "value_norm_output")


@pytest.mark.parametrize("kind", ["intra", "inter"])
def test_every_layer_matches_dense_reference(smollm, kind):
    text = "The first token takes much attention but little contribution, says the paper."
    result = cw_lens.contribution_weights(smollm, text, kind=kind, query_chunk=7)
    tokens = result.tokens
    n = tokens.shape[1]
    valid = causal_rows(n)[None, None]
    worst = 0.0
    for layer in range(smollm.cfg.n_layers):
        ref = model_reference(smollm, tokens, layer, kind)
        tol = tolerance(ref, kind)
        for field in FIELDS:
            rows = (1, -1) if kind == "inter" and field in ("weights", "cosine") else (-1,)
            t = tol.amax(1, keepdim=True) if rows == (1, -1) else tol
            err = assert_rows_close(
                getattr(result, field)[:, layer],
                ref[field],
                1e-5,
                valid,
                what=f"L{layer} {field}",
                row_dims=rows,
                row_tolerance=t,
            )
            worst = max(worst, err)
    assert worst < 1e-5
    # methods § Contribution weights properties on the real model
    if kind == "intra":
        assert torch.allclose(result.weights.sum(-1), torch.ones(()), atol=1e-4)
    else:
        assert torch.allclose(result.weights.sum((-1, 2)), torch.ones(()), atol=1e-4)
    # factors and weights come from different products; their product must reproduce the
    # weights the reference computes (checked above) — and the factors themselves were checked


def test_padded_batch_equals_single_texts(smollm):
    texts = ["Hello there.", "A noticeably longer second text for the batch."]
    batch = cw_lens.contribution_weights(smollm, texts, layers=[3, 17], kind="inter")
    for i, text in enumerate(texts):
        one = cw_lens.contribution_weights(smollm, text, layers=[3, 17], kind="inter")
        n = one.tokens.shape[1]
        assert torch.allclose(batch.weights[i, :, :, :n, :n], one.weights[0], atol=1e-4, rtol=1e-4)
