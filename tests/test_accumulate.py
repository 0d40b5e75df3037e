"""Mergeable accumulators: exact merges, histogram quantiles."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from cw_lens.accumulate import DocSamples, DocSums, Histogram
from cw_lens.errors import InputError


@settings(max_examples=30, deadline=None)
@given(
    st.lists(st.floats(-1e6, 1e6, allow_nan=False), min_size=2, max_size=40),
    st.integers(2, 5),
    st.integers(0, 99),
)
def test_doc_sums_merge_in_any_sharding_equals_single(values, world, seed):
    single = DocSums()
    for doc, v in enumerate(values):
        single.add(doc, "x", torch.tensor([v, 2 * v]))
    rng = np.random.default_rng(seed)
    owner = rng.integers(0, world, len(values))
    shards = [DocSums() for _ in range(world)]
    for doc, v in enumerate(values):
        shards[owner[doc]].add(doc, "x", torch.tensor([v, 2 * v]))
    merged = shards[-1]
    for other in shards[:-1]:
        merged.merge(other)
    assert torch.equal(merged.total("x"), single.total("x"))  # bit-identical


def test_doc_sums_refuse_double_counting():
    a, b = DocSums(), DocSums()
    a.add(0, "x", 1.0)
    b.add(0, "x", 1.0)
    with pytest.raises(InputError, match="counted twice"):
        a.merge(b)


@settings(max_examples=30, deadline=None)
@given(st.lists(st.floats(0, 1), min_size=5, max_size=300), st.sampled_from([0.25, 0.5, 0.9]))
def test_histogram_quantile_within_one_bin(values, q):
    hist = Histogram((), 0.0, 1.0, 100)
    hist.add(torch.tensor(values))
    exact = np.quantile(np.array(values), q, method="inverted_cdf")
    assert abs(float(hist.quantile(q)) - exact) <= 0.01 + 1e-9
    assert int(hist.total) == len(values)


def test_histogram_edge_bins_count_clamped_values_and_groups():
    hist = Histogram((2,), 0.0, 1.0, 10)
    hist.add(torch.tensor([[0.0, 0.0, 0.5, 1.0], [0.3, float("nan"), 1.0, 1.0]]))
    assert hist.counts[0, 0] == 2 and hist.counts[0, -1] == 1
    assert hist.counts[1].sum() == 3 and hist.counts[1, -1] == 2
    assert torch.allclose(hist.share_at_or_below_lo(), torch.tensor([0.5, 0.0]))
    other = Histogram((2,), 0.0, 1.0, 10)
    other.add(torch.tensor([[0.5], [0.5]]))
    hist.merge(other)
    assert hist.total.tolist() == [5, 4]


def test_doc_samples_concatenate_in_document_order():
    a, b = DocSamples(["x"]), DocSamples(["x"])
    b.add(1, "g", torch.tensor([[2.0]]))
    a.add(0, "g", torch.tensor([[1.0]]))
    b.merge(a)
    assert b.table("g").flatten().tolist() == [1.0, 2.0]


@settings(max_examples=40, deadline=None)
@given(
    st.lists(
        st.one_of(st.floats(-1e6, 1e6), st.floats(-1e-2, 1e-2)),
        min_size=5,
        max_size=200,
    ),
    st.sampled_from([0.25, 0.5, 0.9]),
)
def test_asinh_histogram_quantile_within_one_relative_bin(values, q):
    """asinh bins on +-1e9 (unit 1e-3, 3000 bins): a bin is 1.9% wide relative to the value
    (plus 1.9e-5 near 0), so no value in range is clipped and quantiles keep their sign."""
    hist = Histogram((), -1e9, 1e9, 3000, scale="asinh", unit=1e-3)
    hist.add(torch.tensor(values, dtype=torch.float64))
    exact = float(np.quantile(np.array(values), q, method="inverted_cdf"))
    got = float(hist.quantile(q))
    assert abs(got - exact) <= 0.0191 * abs(exact) + 2e-5
    assert (got < 0) == (exact < 0) or abs(exact) < 2e-5
    edges = hist.edges
    assert edges[0] == pytest.approx(-1e9) and edges[-1] == pytest.approx(1e9)
    assert abs(float(edges[1500])) < 1e-15  # the middle edge: a median keeps its sign


def test_asinh_histogram_edges_merge_and_clipping():
    hist = Histogram((2,), -100.0, 100.0, 40, scale="asinh", unit=0.1)
    hist.add(torch.tensor([[-250.0, -3.0, 0.5, 7.0], [150.0, 150.0, float("nan"), 5.0]]))
    assert hist.counts[0, 0] == 1 and hist.counts[1, -1] == 2
    top = hist.quantile(1.0)  # the right edge of 7's bin (bins are 1.46x wide here)
    assert 7.0 < float(top[0]) <= 7.0 * 1.47 and float(top[1]) == 100.0
    with pytest.raises(InputError, match="different bins"):
        hist.merge(Histogram((2,), -100.0, 100.0, 40))  # same range, linear bins
    with pytest.raises(InputError, match="scale"):
        Histogram((), -1.0, 1.0, 10, scale="log")
