"""Pure math of contribution flow (methods § Contribution flow) against materialised float64
computations."""

from __future__ import annotations

import networkx as nx
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from reference import random_pattern

from cw_lens.core import flow_geometry as fg


@st.composite
def flow_case(draw):
    n_kv = draw(st.integers(1, 3))
    group = draw(st.integers(1, 3))
    return {
        "n_kv": n_kv,
        "n_heads": n_kv * group,
        "n_batch": draw(st.integers(1, 2)),
        "n_pos": draw(st.integers(1, 8)),
        "d_head": draw(st.integers(1, 5)),
        "d_model": draw(st.integers(6, 12)),
        "norm": draw(st.sampled_from(["none", "rms", "layer"])),
        "seed": draw(st.integers(0, 2**16)),
    }


def dense_shares(pattern, values, W_O, y, lin):
    """``<lin(alpha pv_j^h), y> / ||y||^2`` with every piece a d_model vector (float64)."""
    pattern, values, W_O, y = (t.double() for t in (pattern, values, W_O, y))
    group = pattern.shape[1] // values.shape[2]
    pv = torch.stack([values[:, :, h // group] @ W_O[h] for h in range(W_O.shape[0])], 1)
    pieces = lin(pattern[..., None] * pv[:, :, None])  # [batch, head, query, key, d_model]
    return (pieces * y[:, None, :, None]).sum(-1) / y.pow(2).sum(-1)[:, None, :, None], pieces


@settings(max_examples=60, deadline=None)
@given(flow_case())
def test_pair_shares_match_materialised_pieces(case):
    gen = torch.Generator().manual_seed(case["seed"])
    b, h, n, d = case["n_batch"], case["n_heads"], case["n_pos"], case["d_model"]
    pattern = random_pattern(b, h, n, gen)
    values = torch.randn(b, n, case["n_kv"], case["d_head"], generator=gen)
    W_O = torch.randn(h, case["d_head"], d, generator=gen)
    y = torch.randn(b, n, d, generator=gen)
    a = torch.randn(b, n, d, generator=gen) * 3
    centred = case["norm"] == "layer"
    gain = None if case["norm"] == "none" else torch.randn(d, generator=gen)
    rows = None if case["norm"] == "none" else fg.norm_row_scale(a, 1e-5, centred)

    def lin(p):  # the linearised norm, written out independently on d_model vectors
        if case["norm"] == "none":
            return p
        a64 = a.double()
        c = a64 - a64.mean(-1, keepdim=True) if centred else a64
        r = 1.0 / (c.pow(2).mean(-1) + 1e-5).sqrt()  # [batch, query]
        pc = p - p.mean(-1, keepdim=True) if centred else p
        return pc * gain.double() * r[:, None, :, None, None]

    want, pieces = dense_shares(pattern, values, W_O, y, lin)
    u, _ = fg.read_vectors(y, rows, gain, centred)
    got = fg.pair_shares(pattern, values, fg.head_read_vectors(u, W_O))
    scale = want.abs().amax((1, 3), keepdim=True).clamp_min(1e-3)
    assert ((got.double() - want).abs() / scale).max() < 1e-4
    # the factors: ||A(pv)|| through the effective Gram matrix, times the row scale
    gram = fg.effective_gram(W_O, gain, centred)
    group = h // case["n_kv"]
    for head in range(h):
        v = values[:, :, head // group].double()
        norm = (v @ gram[head].double() * v).sum(-1).clamp_min(0).sqrt()  # [batch, key]
        full = norm[:, None, :] * (1.0 if rows is None else rows.double()[:, :, None])
        alpha = pattern[:, head].double()
        dense = pieces[:, head].norm(dim=-1)  # alpha * ||A(pv)||
        assert torch.allclose(alpha * full, dense, rtol=1e-4, atol=1e-6)


@settings(max_examples=30, deadline=None)
@given(st.integers(0, 2**16), st.booleans())
def test_linearised_norm_reproduces_the_norm_at_its_input(seed, centred):
    """sum of A_i(pieces) + beta == the real norm of the sum (LayerNorm / RMSNorm)."""
    gen = torch.Generator().manual_seed(seed)
    pieces = torch.randn(5, 2, 3, 10, generator=gen)  # 5 pieces of a [2, 3, 10] output
    a = pieces.sum(0)
    gain, beta = torch.randn(10, generator=gen), torch.randn(10, generator=gen)
    if centred:
        real = torch.nn.functional.layer_norm(a, (10,), gain, beta, eps=1e-5)
    else:
        real = a * torch.rsqrt(a.pow(2).mean(-1, keepdim=True) + 1e-5) * gain
        beta = torch.zeros(10)
    rows = fg.norm_row_scale(a, 1e-5, centred)
    rebuilt = sum(fg.apply_linear_map(p, rows, gain, centred) for p in pieces) + beta
    assert torch.allclose(rebuilt, real, atol=1e-5)


def test_read_vectors_mark_zero_streams_nan():
    y = torch.zeros(1, 2, 4)
    y[0, 1] = 1.0
    u, _ = fg.read_vectors(y, None, None, False)
    assert u[0, 0].isnan().all() and torch.equal(u[0, 1], y[0, 1] / 4)  # y / ||y||^2


def test_token_matrix_puts_the_token_wise_pieces_on_the_diagonal():
    pairs = torch.arange(12.0).reshape(1, 3, 4)  # rows are queries 1..3 of 4 keys
    got = fg.token_matrix(pairs.clone(), torch.tensor([[10.0, 20.0, 30.0]]), first_query=1)
    want = pairs.clone()
    want[0, 0, 1] += 10
    want[0, 1, 2] += 20
    want[0, 2, 3] += 30
    assert torch.equal(got, want)


@settings(max_examples=25, deadline=None)
@given(st.integers(0, 2**16), st.integers(1, 6), st.integers(1, 4))
def test_rollouts_compose_like_an_explicit_product(seed, n_pos, n_layers):
    gen = torch.Generator().manual_seed(seed)
    patterns = [random_pattern(2, 3, n_pos, gen) for _ in range(n_layers)]
    r = None
    for p in patterns:
        r = fg.compose(r, fg.attention_rollout_step(p))
    want = torch.eye(n_pos, dtype=torch.float64).expand(2, n_pos, n_pos)
    for p in patterns:
        a = 0.5 * p.double().mean(1) + 0.5 * torch.eye(n_pos, dtype=torch.float64)
        want = a @ want
    assert torch.allclose(r.double(), want, atol=1e-6)
    assert torch.allclose(r.sum(-1), torch.ones(2, n_pos), atol=1e-5)


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 2**16), st.integers(1, 7), st.integers(1, 6), st.floats(0.0, 0.3))
def test_trace_routes_keeps_exactly_the_reachable_edges(seed, n_pos, n_steps, threshold):
    """Against networkx: all edges above the threshold, then the ancestors of the target. Steps
    alternate like sub-layer steps: pair edges with one same-position edge (x_l -> m_l), then
    no pairs and two same-position edges (m_l -> x_{l+1}: residual and MLP)."""
    gen = torch.Generator().manual_seed(seed)
    target = int(torch.randint(n_pos, (1,), generator=gen))
    steps = []
    full = nx.MultiDiGraph()
    full.add_node((n_steps, target))
    for s in range(n_steps):
        pairs = torch.rand(2, n_pos, n_pos, generator=gen).tril() * 0.5
        if s % 2:
            pairs.zero_()
        h, q, k = (pairs > threshold).nonzero().unbind(-1)
        same = [torch.rand(n_pos, generator=gen) > 0.4 for _ in range(1 + s % 2)]
        steps.append(((q, k), same))
        for hh, qq, kk in zip(h.tolist(), q.tolist(), k.tolist(), strict=True):
            full.add_edge((s, kk), (s + 1, qq), key=hh)
        for n, mask in enumerate(same):
            for i in mask.nonzero().flatten().tolist():
                full.add_edge((s, i), (s + 1, i), key=f"same{n}")
    kept, reached = fg.trace_routes(steps, n_pos, target)
    ancestors = nx.ancestors(full, (n_steps, target)) | {(n_steps, target)}
    assert {tuple(x) for x in reached.nonzero().tolist()} == ancestors
    for s, ((q, _), _) in enumerate(steps):
        want = torch.tensor([(s + 1, qq) in ancestors for qq in q.tolist()], dtype=torch.bool)
        assert torch.equal(kept[s], want)
