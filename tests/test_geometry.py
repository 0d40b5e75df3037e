"""Pure math on random tensors: the head-space fast path against materialised vectors."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from reference import (
    assert_rows_close,
    causal_rows,
    dense_contributions,
    make_activations,
    random_pattern,
    tolerance,
)

from cw_lens.core import geometry as geo
from cw_lens.models.layer_contributions import LayerContributionsResult, Workspace

FIELDS = ("weights", "cosine", "relative_norm")


@st.composite
def layer_case(draw):
    """Random shapes (GQA groups included), right-padding masks, head subsets and chunking."""
    n_kv = draw(st.integers(1, 3))
    group = draw(st.integers(1, 3))
    n_batch = draw(st.integers(1, 3))
    n_pos = draw(st.integers(1, 9))
    d_head = draw(st.integers(1, 6))
    # real models have d_model > d_head (W_O^h has full row rank); with d_model < d_head a
    # value can sit near W_O's null space and float32 keeps no digit of its projection
    d_model = draw(st.integers(d_head + 1, 12))
    seed = draw(st.integers(0, 2**16))
    lengths = [draw(st.integers(1, n_pos)) for _ in range(n_batch)]
    chunk = draw(st.integers(1, n_pos))
    n_heads = n_kv * group
    heads = draw(
        st.one_of(st.none(), st.lists(st.integers(0, n_heads - 1), min_size=1, unique=True))
    )
    return n_kv, group, n_batch, n_pos, d_head, d_model, seed, lengths, chunk, heads


def build(case):
    n_kv, group, n_batch, n_pos, d_head, d_model, seed, lengths, _chunk, _heads = case
    gen = torch.Generator().manual_seed(seed)
    mask = torch.arange(n_pos)[None, :] < torch.tensor(lengths)[:, None]
    pattern = random_pattern(n_batch, n_kv * group, n_pos, gen, mask=mask)
    values = torch.randn(n_batch, n_pos, n_kv, d_head, generator=gen)
    W_O = torch.randn(n_kv * group, d_head, d_model, generator=gen)
    return make_activations(pattern, values, W_O, mask=mask), mask


def gather_blocks(acts, heads, chunk, field, kind):
    """Run the streaming unit block by block and stitch the blocks back together."""
    n_pos = acts.pattern.shape[-1]
    ws = Workspace(reuse=True)
    shared = {}
    rows = []
    for start in range(0, n_pos, chunk):
        lc = LayerContributionsResult(
            acts, heads, slice(start, min(n_pos, start + chunk)), shared, ws
        )
        block = getattr(lc, field)(kind) if kind else getattr(lc, field)()
        full = torch.zeros((*block.shape[:3], n_pos))
        full[..., : block.shape[-1]] = block
        rows.append(full)
    return torch.cat(rows, dim=2)


@settings(max_examples=60, deadline=None)
@given(layer_case(), st.sampled_from(["intra", "inter"]))
def test_fields_match_dense_reference(case, kind):
    acts, mask = build(case)
    heads = case[-1]
    head_idx = sorted(heads) if heads else list(range(acts.n_heads))
    ref = dense_contributions(acts.pattern, acts.values, acts.weights.W_O, kind)
    n_pos = acts.pattern.shape[-1]
    valid = causal_rows(n_pos)[None, None] & mask[:, None, :, None]
    for field in FIELDS:
        got = gather_blocks(acts, heads, case[-2], field, kind)
        exp = ref[field][:, head_idx]
        # undefined rows (numerically zero output) are NaN in ours; exclude them consistently
        defined = ~got.isnan().any(-1, keepdim=True)
        rows = (1, -1) if kind == "inter" else (-1,)
        tol = tolerance(ref, kind)[:, head_idx]
        if kind == "inter":
            tol = tol.amax(1, keepdim=True)
        assert_rows_close(
            got,
            exp,
            1e-5,
            valid & defined,
            what=f"{field}/{kind}",
            row_dims=rows,
            row_tolerance=tol,
        )
    for field in ("value_norm", "value_norm_output"):
        got = gather_blocks(acts, heads, case[-2], field, None)
        assert_rows_close(
            got,
            ref[field][:, head_idx],
            1e-5,
            valid,
            what=field,
            row_tolerance=tolerance(ref, "intra")[:, head_idx],
        )


@settings(max_examples=40, deadline=None)
@given(layer_case())
def test_conventions_sums_and_factor_product(case):
    acts, mask = build(case)
    heads = case[-1]
    n_pos = acts.pattern.shape[-1]
    future = ~causal_rows(n_pos)
    for kind in ("intra", "inter"):
        w = gather_blocks(acts, heads, case[-2], "weights", kind)
        cos = gather_blocks(acts, heads, case[-2], "cosine", kind)
        rel = gather_blocks(acts, heads, case[-2], "relative_norm", kind)
        att = acts.pattern[:, sorted(heads) if heads else slice(None)]
        # j > i is 0 in every field; padded query rows are NaN at j <= i
        for t in (w, cos, rel):
            assert (t[..., future] == 0).all()
            pad_rows = ~mask[:, None, :, None] & ~future[None, None]
            assert t[pad_rows.expand_as(t)].isnan().all()
        real = mask[:, None, :, None] & ~future[None, None]
        prod = (att * rel * cos)[real.expand_as(w)]
        ok = ~w[real.expand_as(w)].isnan()
        assert torch.allclose(prod[ok], w[real.expand_as(w)][ok], rtol=1e-5, atol=1e-6)
        assert ((cos[~cos.isnan()]).abs() <= 1 + 1e-5).all()
    # sums: intra rows sum to 1; inter sums to 1 over (head, key) — all heads needed
    if heads is None:
        w_intra = gather_blocks(acts, None, case[-2], "weights", "intra")
        w_inter = gather_blocks(acts, None, case[-2], "weights", "inter")
        rows = mask[:, None, :].expand(w_intra.shape[:3])
        s = w_intra.sum(-1)[rows]
        assert torch.allclose(s[~s.isnan()], torch.ones(()), atol=1e-4)
        s2 = w_inter.sum((-1, 1))[mask]
        assert torch.allclose(s2[~s2.isnan()], torch.ones(()), atol=1e-4)


@settings(max_examples=40, deadline=None)
@given(
    st.integers(1, 2), st.integers(1, 4), st.integers(1, 3), st.integers(1, 7), st.integers(0, 999)
)
def test_grouped_scores_equals_repeated_values(n_batch, n_kv, group, n_pos, seed):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(n_batch, n_pos, n_kv * group, 5, generator=gen)
    v = torch.randn(n_batch, n_pos + 2, n_kv, 5, generator=gen)
    expected = torch.einsum("bqhd,bkhd->bhqk", q, geo.expand_kv(v, n_kv * group))
    assert torch.allclose(geo.grouped_scores(q, v), expected, atol=1e-5)
    out = torch.empty(expected.shape)
    assert torch.allclose(geo.grouped_scores(q, v, out=out), expected, atol=1e-5)
    # heads first: the values are a slice of the keys of a [batch, kv_head, key, d] tensor
    q_first, v_first = q.transpose(1, 2).contiguous(), v.transpose(1, 2).contiguous()
    scores = geo.grouped_scores_heads_first(q_first, v_first[:, :, :n_pos])
    assert torch.allclose(scores, expected[..., :n_pos], atol=1e-5)
    out = torch.empty(expected.shape)
    assert torch.allclose(
        geo.grouped_scores_heads_first(q_first, v_first, out=out), expected, atol=1e-5
    )


def test_zero_output_row_is_nan_and_counted():
    # two keys with opposite values and equal attention cancel exactly at query 1
    pattern = torch.tensor([[[[1.0, 0.0], [0.5, 0.5]]]])
    values = torch.tensor([[[[1.0, 2.0]], [[-1.0, -2.0]]]])
    W_O = torch.randn(1, 2, 3, generator=torch.Generator().manual_seed(0))
    acts = make_activations(pattern, values, W_O)
    lc = LayerContributionsResult(acts)
    for kind in ("intra", "inter"):
        w = lc.weights(kind)
        assert lc.n_zero_rows(kind) == 1
        assert w[0, 0, 1].isnan().all()
        assert torch.allclose(w[0, 0, 0], torch.tensor([1.0, 0.0]))


def test_weights_can_be_negative_and_exceed_one():
    # query 1 attends to a big vector and a smaller opposite one: net output points along
    # the big one; the big one contributes > 1, the opposite one < 0
    pattern = torch.tensor([[[[1.0, 0.0], [0.5, 0.5]]]])
    values = torch.tensor([[[[3.0, 0.0]], [[-1.0, 0.0]]]])
    W_O = torch.eye(2)[None]
    lc = LayerContributionsResult(make_activations(pattern, values, W_O))
    w = lc.weights("intra")[0, 0, 1]
    assert w[0] == pytest.approx(1.5) and w[1] == pytest.approx(-0.5)
    assert w.sum() == pytest.approx(1.0)
    assert lc.cosine("intra")[0, 0, 1, 1] == pytest.approx(-1.0)
    assert lc.relative_norm("intra")[0, 0, 1, 0] == pytest.approx(3.0)


def test_zero_key_vector_has_zero_cosine():
    pattern = torch.tensor([[[[1.0, 0.0], [0.5, 0.5]]]])
    values = torch.tensor([[[[0.0, 0.0]], [[1.0, 0.0]]]])
    lc = LayerContributionsResult(make_activations(pattern, values, torch.eye(2)[None]))
    cos = lc.cosine("intra")
    assert cos[0, 0, 1, 0] == 0.0 and cos[0, 0, 1, 1] == pytest.approx(1.0)
    assert lc.n_zero_rows("intra") == 1  # query 0 reads only the zero vector
    assert math.isnan(float(lc.weights("intra")[0, 0, 0, 0]))
