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
