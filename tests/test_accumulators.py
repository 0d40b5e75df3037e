"""The accumulators' building blocks against independent references: float64 stacked sums and
their per-document record (a correctly rounded rational sum), the hash keys, the bottom-k sample
(a brute-force sort), histogram quantiles, and every block reduced across two gloo ranks equal to
one process."""

from __future__ import annotations

import datetime
import math
import os
import sys
from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from hypothesis import given, settings
from hypothesis import strategies as st

from cw_lens.core.accumulators import (
    EMPTY_KEY,
    Accumulator,
    SampleReservoir,
    StackedSums,
    document_rows,
    entry_keys,
)
from cw_lens.core.errors import InputError
from cw_lens.core.histograms import Histogram, bin_indices, fill_histograms

# float64 sums of n terms: |error| <= n * eps * sum |x| (eps = 2^-53); the tests' bound
SUM_TOLERANCE = 64 * 2.0**-53


def _rational_sum(values) -> float:
    return float(sum((Fraction(float(v)) for v in values), Fraction(0)))


@settings(max_examples=40, deadline=None)
@given(
    st.lists(st.floats(-1e6, 1e6, allow_nan=False, width=32), min_size=1, max_size=40),
    st.integers(1, 5),
)
def test_stacked_sums_equal_the_rational_sum_within_the_float64_bound(values, n_shards):
    """Any sharding, merged: each total within n eps sum|x| of the exact rational sum, and each
    document's record its own rows' sum."""
    x = torch.tensor(values, dtype=torch.float32)
    rows = torch.stack([x, 2 * x, torch.ones_like(x)], -1)  # [row, statistic]
    docs = torch.arange(len(values)) % 7
    shards = [StackedSums(["x", "2x", "n"], n_documents=7) for _ in range(n_shards)]
    for i in range(len(values)):
        shards[i % n_shards].add(rows[i : i + 1], docs[i : i + 1])
    merged = shards[0]
    for other in shards[1:]:
        merged.merge(other)
    bound = SUM_TOLERANCE * float(x.double().abs().sum()) + 1e-300
    assert abs(float(merged.column("x")) - _rational_sum(values)) <= bound
    assert abs(float(merged.column("2x")) - 2 * _rational_sum(values)) <= 2 * bound
    assert float(merged.column("n")) == len(values)
    table = merged.document_table("x")
    seen = sorted(set(docs.tolist()))
    assert table.shape == (len(seen),)
    for row, doc in enumerate(seen):
        mine = [v for v, d in zip(values, docs.tolist(), strict=True) if d == doc]
        assert abs(float(table[row]) - _rational_sum(mine)) <= bound


def test_stacked_sums_fill_a_part_and_name_their_errors():
    sums = StackedSums(["a", "b"], (3, 2), n_documents=4)
    block = torch.arange(8, dtype=torch.float32).reshape(2, 2, 2)  # [batch, head, statistic]
    sums.add(block, document_rows([1, 3], "cpu"), at=2)
    assert sums.total[:2].abs().sum() == 0
    assert torch.equal(sums.total[2], block.double().sum(0))
    assert torch.equal(sums.document_table()[:, 2], block.double())
    assert sums.document_table("b").shape == (2, 3, 2)
    with pytest.raises(InputError, match=r"values must be \[batch, 2, 2\]"):
        sums.add(torch.zeros(2, 3, 2), document_rows([0, 1], "cpu"), at=0)
    with pytest.raises(InputError, match="pass the documents"):
        sums.add(block, None, at=0)
    with pytest.raises(InputError, match="Unknown statistic 'c'"):
        sums.column("c")
    with pytest.raises(InputError, match="distinct"):
        StackedSums(["a", "a"])
    with pytest.raises(InputError, match="no per-document record"):
        StackedSums(["a"]).document_table()
    with pytest.raises(InputError, match="different statistics"):
        sums.merge(StackedSums(["a", "b"], (2, 2), n_documents=4))


def test_entry_keys_depend_on_the_entry_alone():
    """The key of an entry is the same computed in any block (any slice of the coordinates),
    differs between seeds and between coordinates in every position, and is never EMPTY_KEY."""
    doc, head, query, key = (torch.arange(n).reshape(s) for n, s in _AXES)
    whole = entry_keys(3, 5, doc, head, query, key)  # seed 3, layer 5
    part = entry_keys(3, 5, doc[1:3], head, query[:, :, 4:9], key)
    assert torch.equal(part, whole[1:3, :, 4:9])
    assert whole.unique().numel() == whole.numel()
    assert int(whole.min()) >= 0 and int(whole.max()) < EMPTY_KEY
    assert not torch.equal(entry_keys(4, 5, doc, head, query, key), whole)
    assert not torch.equal(entry_keys(3, 6, doc, head, query, key), whole)
    # swapping two coordinates' roles changes the keys (the hash is ordered)
    assert not torch.equal(
        entry_keys(3, 5, head, doc, query, key), entry_keys(3, 5, doc, head, query, key)
    )
    # about uniform: each of the top bits is set for about half of the 4,800 keys
    bits = torch.stack([((whole >> b) & 1).flatten() for b in (0, 31, 62)]).double().mean(1)
    assert ((bits - 0.5).abs() < 0.05).all(), bits
    with pytest.raises(InputError, match="at least one tensor"):
        entry_keys(0, 1, 2)


_AXES = [(4, (4, 1, 1, 1)), (3, (1, 3, 1, 1)), (20, (1, 1, 20, 1)), (20, (1, 1, 1, 20))]


@settings(max_examples=30, deadline=None)
@given(st.integers(0, 2**31), st.integers(1, 6), st.integers(1, 40), st.integers(1, 4))
def test_reservoir_keeps_the_smallest_keys_in_any_order_and_sharding(seed, capacity, n, shards):
    """The rows kept per group are those of the `capacity` smallest keys among the valid rows
    (a brute-force sort), whatever the order of the blocks and their split into shards."""
    gen = torch.Generator().manual_seed(seed)
    keys = entry_keys(seed, torch.arange(2)[:, None], torch.arange(n)[None])  # [group, row]
    valid = torch.rand(2, n, generator=gen) < 0.7
    keys = torch.where(valid, keys, EMPTY_KEY)
    values = torch.randn(2, n, generator=gen)
    reservoirs = [SampleReservoir(2, capacity, ["v"]) for _ in range(shards)]
    order = torch.randperm(n, generator=gen)
    for i, block in enumerate(order.split(3)):
        part_keys, part_values = keys[:, block], values[:, block]
        reservoirs[i % shards].offer(
            part_keys, lambda idx, v=part_values: v.gather(1, idx)[..., None]
        )
    for other in reservoirs[1:]:
        reservoirs[0].merge(other)
    for group in range(2):
        ranked = sorted(
            (int(k), float(v))
            for k, v, ok in zip(keys[group], values[group], valid[group], strict=True)
            if ok
        )
        expected = [v for _, v in ranked[:capacity]]
        assert reservoirs[0].table(group)[:, 0].tolist() == pytest.approx(expected, abs=0)


@settings(max_examples=30, deadline=None)
@given(st.lists(st.floats(0, 1), min_size=5, max_size=300), st.sampled_from([0.25, 0.5, 0.9]))
def test_histogram_quantile_within_one_bin(values, q):
    hist = Histogram((), 0.0, 1.0, 100)
    hist.add(torch.tensor(values))
    exact_q = np.quantile(np.array(values), q, method="inverted_cdf")
    assert abs(float(hist.quantile(q)) - exact_q) <= 0.01 + 1e-9
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


@settings(max_examples=40, deadline=None)
@given(
    st.lists(st.one_of(st.floats(-1e6, 1e6), st.floats(-1e-2, 1e-2)), min_size=5, max_size=200),
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
    assert abs(float(hist.edges[1500])) < 1e-15  # the middle edge: a median keeps its sign


def test_asinh_histogram_edges_merge_and_errors():
    hist = Histogram((2,), -100.0, 100.0, 40, scale="asinh", unit=0.1)
    hist.add(torch.tensor([[-250.0, -3.0, 0.5, 7.0], [150.0, 150.0, float("nan"), 5.0]]))
    assert hist.counts[0, 0] == 1 and hist.counts[1, -1] == 2
    top = hist.quantile(1.0)  # the right edge of 7's bin (bins are 1.46x wide here)
    assert 7.0 < float(top[0]) <= 7.0 * 1.47 and float(top[1]) == 100.0
    with pytest.raises(InputError, match="different bins"):
        hist.merge(Histogram((2,), -100.0, 100.0, 40))  # same range, linear bins
    with pytest.raises(InputError, match="scale"):
        Histogram((), -1.0, 1.0, 10, scale="log")


def _reference_bin(value: float, hist: Histogram) -> int:
    """One value's bin, by the definition: edge bins at or beyond lo / hi, else which of the
    equal bins on the (linear or asinh) axis holds it."""
    if value <= hist.lo:
        return 0
    if value >= hist.hi:
        return hist.n_bins + 1
    axis = (lambda x: math.asinh(x / hist.unit)) if hist.scale == "asinh" else (lambda x: x)
    lo, hi = axis(hist.lo), axis(hist.hi)
    return min(max(math.floor((axis(value) - lo) * (hist.n_bins / (hi - lo))) + 1, 1), hist.n_bins)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.floats(-3e9, 3e9, allow_nan=False), min_size=3, max_size=3 * 40))
def test_histograms_filled_together_equal_each_by_the_definition(values):
    """Three binnings (linear, asinh and a narrow linear one) binned in one chain and filled in
    one call count exactly what the definition counts, value by value, group by group."""
    n = len(values) // 3 * 3
    if n == 0:
        return
    binnings = [
        dict(lo=0.0, hi=1.0, n_bins=50),
        dict(lo=-1e9, hi=1e9, n_bins=3000, scale="asinh", unit=1e-3),
        dict(lo=-10.0, hi=10.0, n_bins=24, scale="asinh", unit=1e-3),
    ]
    hists = [Histogram((1,), **b) for b in binnings]
    data = torch.tensor(values[:n], dtype=torch.float64).reshape(3, 1, -1)
    data[0, 0, 0] = float("nan")  # not counted
    fill_histograms(hists, data)
    for i, hist in enumerate(hists):
        expected = torch.zeros(hist.n_bins + 2, dtype=torch.int64)
        for v in data[i, 0].tolist():
            if not math.isnan(v):
                expected[_reference_bin(v, hist)] += 1
        assert hist.counts[0].tolist() == expected.tolist(), hist.binning
    bins = bin_indices(hists, data.nan_to_num(0.5))
    assert bins[1, 0].tolist() == [_reference_bin(v, hists[1]) for v in data[1, 0].tolist()]


def test_fill_histograms_names_its_errors():
    a, b = Histogram((2,), 0.0, 1.0, 4), Histogram((3,), 0.0, 1.0, 4)
    with pytest.raises(InputError, match="same group axes"):
        fill_histograms([a, b], torch.zeros(2, 2, 1))
    with pytest.raises(InputError, match="one slice of values per histogram"):
        bin_indices([a, b], torch.zeros(3, 1))


class _Blocks(Accumulator):
    """An accumulator of one of each block, fed rank `rank`'s share of a fixed data set."""

    name = "blocks"

    def __init__(self) -> None:
        self.layers = [0]
        self.sums = StackedSums(["x", "n"], (2,), n_documents=6)
        self.hist = {"x": Histogram((2,), -3.0, 3.0, 12)}
        self.samples = [SampleReservoir(2, 4, ["x"])]

    def feed(self, documents: list[int]) -> None:
        for doc in documents:
            gen = torch.Generator().manual_seed(doc)
            x = torch.randn(2, 5, generator=gen)  # [head, entry]
            rows = torch.stack([x.sum(-1), torch.full((2,), 5.0)], -1)[None]
            self.sums.add(rows, document_rows([doc], "cpu"))
            self.hist["x"].add(x)
            keys = entry_keys(0, doc, torch.arange(2)[:, None], torch.arange(5)[None])
            self.samples[0].offer(keys, lambda idx, x=x: x.gather(1, idx)[..., None])


def _state(acc: _Blocks) -> dict:
    return {
        "total": acc.sums.total,
        "table": acc.sums.document_table(),
        "counts": acc.hist["x"].counts,
        "samples": torch.stack([acc.samples[0].table(g) for g in range(2)]),
    }


def _reduce_on_two_ranks(rank: int, store: str, out: str) -> None:
    try:
        dist.init_process_group(
            "gloo",
            init_method=f"file://{store}",
            rank=rank,
            world_size=2,
            timeout=datetime.timedelta(seconds=30),
        )
        acc = _Blocks()
        acc.feed([0, 2, 4] if rank == 0 else [1, 3, 5])
        acc.all_reduce()
        torch.save(_state(acc), Path(out, f"rank{rank}.pt"))
        dist.barrier()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def test_two_gloo_ranks_reduce_every_block_to_the_single_process_state(tmp_path):
    """Sums, records, counts and samples of two ranks, reduced with collectives, equal one
    process fed every document (sums within the float64 bound; counts and samples exactly)."""
    single = _Blocks()
    single.feed(list(range(6)))
    split = [_Blocks(), _Blocks()]
    split[0].feed([0, 2, 4])
    split[1].feed([1, 3, 5])
    split[0].merge(split[1])  # merge in one process: the same as the collectives
    mp.start_processes(
        _reduce_on_two_ranks,
        args=(str(tmp_path / "store"), str(tmp_path)),
        nprocs=2,
        start_method="spawn",
    )
    want = _state(single)
    for got in [_state(split[0])] + [
        torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in (0, 1)
    ]:
        torch.testing.assert_close(got["total"], want["total"], rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(got["table"], want["table"], rtol=1e-12, atol=1e-12)
        assert torch.equal(got["counts"], want["counts"])
        assert torch.equal(got["samples"], want["samples"])


def test_an_accumulator_must_say_how_it_updates_and_finishes():
    class Empty(Accumulator):
        pass

    with pytest.raises(NotImplementedError, match="update"):
        Empty().update(None)
    with pytest.raises(NotImplementedError, match="finish"):
        Empty().finish(None)
    with pytest.raises(NotImplementedError, match="reads no logits"):
        Empty().update_logits(None, None)
