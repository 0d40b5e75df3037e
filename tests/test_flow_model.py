"""Contribution flow on the embedded SmolLM2-135M against the dense float64 reference."""

from __future__ import annotations

import networkx as nx
import pytest
import torch
from flow_reference import dense_flow_reference, dense_route_edges, dense_token_matrix

import cw_lens
from cw_lens.flow.evaluation import word_positions

pytestmark = pytest.mark.model

IOI = "When Mary and John went to the store, John gave a drink to"


@pytest.fixture(scope="module")
def ioi_tokens(smollm):
    return cw_lens.data.inputs.prepare_inputs(smollm, IOI).tokens


@pytest.fixture(scope="module")
def reference(smollm, ioi_tokens):
    return dense_flow_reference(smollm, ioi_tokens)


def test_shares_and_rollout_match_the_dense_reference(smollm, ioi_tokens, reference):
    result = cw_lens.residual_shares(smollm, ioi_tokens, query_chunk=6)
    rollout = cw_lens.contribution_rollout(smollm, ioi_tokens)
    n = ioi_tokens.shape[1]
    want = torch.eye(n, dtype=torch.float64)[None]
    for layer, ref in enumerate(reference):
        assert max(ref["errors"].values()) < 1e-3 * ref["y"].abs().max().item(), layer
        pairs = result.pairs[:, layer].double()
        scale = ref["pairs"].abs().amax((1, 3), keepdim=True)
        assert ((pairs - ref["pairs"]).abs() / scale).max() < 1e-4, layer
        for piece in ("residual", "attention", "bias", "mlp"):
            got = getattr(result, piece)[:, layer].double()
            assert torch.allclose(got, ref[piece], atol=1e-5), (layer, piece)
        want = dense_token_matrix(ref) @ want
    assert torch.allclose(result.total(), torch.ones(()), atol=1e-5)
    assert torch.allclose(rollout.contribution.double(), want, atol=1e-4)
    assert torch.allclose(rollout.contribution.sum(-1), torch.ones(()), atol=1e-4)
    assert torch.allclose(rollout.attention.sum(-1), torch.ones(()), atol=1e-4)


def test_routes_hold_exactly_the_reachable_edges(smollm, ioi_tokens, reference):
    g = cw_lens.routes(smollm, ioi_tokens, threshold=0.02)
    n = ioi_tokens.shape[1]
    want_edges, want_nodes = dense_route_edges(reference, n - 1, 0.02)
    assert set(g.graph.edges(keys=True)) == want_edges
    assert set(g.graph.nodes) == want_nodes
    assert g.reaches(2)  # ' Mary', the indirect object
    # through the sub-layer steps a route reaches the IO token's embedding (it cannot without
    # the MLP edges: the layer-0 residual share is about 0) and leads to the answer position
    assert (0, 2) in g.graph and nx.has_path(g.graph, (0, 2), (g.n_layers, n - 1))
    assert not g.routes_from((0, 2)).mlps().empty


def test_word_positions_find_the_names(smollm):
    tok = smollm.tokenizer
    ids = cw_lens.data.inputs.prepare_inputs(smollm, IOI).tokens[0]
    assert [tok.decode(ids[p]).strip() for p in word_positions(smollm, IOI, "John")] == [
        "John",
        "John",
    ]
    assert word_positions(smollm, IOI, "Mary") == [2]
    first = "Mary and John were at the park. John handed the book to"
    assert word_positions(smollm, first, "Mary") == [1]  # sentence-initial, no space


def test_ioi_statistics_agree_with_single_routes(smollm):
    items = cw_lens.load_corpus("ioi", n_docs=3, seed=3)
    stats = cw_lens.ioi_route_statistics(smollm, items, threshold=0.03, batch_size=2)
    assert len(stats.items) == 3
    for row in stats.items.itertuples():
        g = cw_lens.routes(smollm, row.text, threshold=0.03)
        assert g.target == row.target
        assert g.reaches(row.io) == row.reaches_io
        assert g.reaches(row.s1) == row.reaches_s1
        assert row.io_heads == sorted(
            {(d["layer"], d["head"]) for (_, j), (_, i), d in g.graph.edges(data=True)
             if d["kind"] == "attention" and j == row.io and i != row.io}
        )  # fmt: skip
        assert row.reaches_io_embedding == ((0, row.io) in g.graph)
        from_io = g.routes_from((0, row.io))
        assert row.io_embedding_mlps == sorted(
            (d["layer"], i) for _, (_, i), d in from_io.graph.edges(data=True) if d["kind"] == "mlp"
        )
    total = stats.heads["io_items"].sum()
    assert total == sum(len(h) for h in stats.items["io_heads"])


def test_alti_matches_the_dense_reference(smollm, ioi_tokens, reference):
    """ALTI pair scores (the faithfulness metric `alti`) on every layer of SmolLM2."""
    from test_alti import RTOL, alti_errors

    for layer, err in enumerate(alti_errors(smollm, ioi_tokens, reference)):
        assert err < RTOL, f"L{layer}: ALTI row-relative error {err:.2e}"
