"""Mergeable accumulators: exact order-independent sums, sample reservoirs, per-document records,
bootstrap replicates, histogram quantiles."""

from __future__ import annotations

import math
import pickle
from fractions import Fraction

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from cw_lens.core import exact
from cw_lens.core.accumulate import (
    BootstrapSums,
    ExactSums,
    Histogram,
    PerDocument,
    SampleReservoir,
    row_keys,
    state_bytes,
)
from cw_lens.core.errors import InputError

finite = st.floats(allow_nan=False, allow_infinity=False, width=64)


def _exact_float(values: list[float]) -> float:
    """The correctly rounded float of the exact (rational) sum — an independent reference."""
    return float(sum((Fraction(v) for v in values), Fraction(0)))


@settings(max_examples=60, deadline=None)
@given(st.lists(st.floats(-1e300, 1e300, allow_nan=False), min_size=1, max_size=60))
def test_exact_add_is_the_correctly_rounded_rational_sum(values):
    limbs, special = exact.zeros(1)
    t = torch.tensor(values, dtype=torch.float64)
    exact.add(limbs, special, t, torch.zeros(len(values), dtype=torch.long))
    assert exact.to_int(limbs)[0] == sum(Fraction(v) for v in values) * 2**exact.OFFSET
    assert exact.to_float(limbs, special).item() == _exact_float(values)


def test_exact_handles_cancellation_subnormals_and_ieee_specials():
    limbs, special = exact.zeros(4)
    values = [1e16, 1.0, -1e16, 5e-324, -1.5e-323, 2.2250738585072014e-308 / 3, 1e308, 1e308]
    values += [math.inf, 1.0, math.inf, -math.inf, math.nan]
    index = [0, 0, 0, 1, 1, 1, 2, 2, 3, 3, 3, 3, 3]
    exact.add(limbs, special, torch.tensor(values, dtype=torch.float64), torch.tensor(index))
    out = exact.to_float(limbs, special)
    assert out[0] == 1.0  # a float64 running sum gives 0.0
    assert out[1] == _exact_float(values[3:6])
    assert out[2] == math.inf  # the exact sum lies beyond float64
    assert math.isnan(out[3])  # +inf + -inf + NaN
    limbs2, special2 = exact.zeros(1)
    exact.add(limbs2, special2, torch.tensor([math.inf, 3.0]), torch.tensor([0, 0]))
    assert exact.to_float(limbs2, special2).item() == math.inf


def test_carry_keeps_the_value_and_normalises_the_limbs():
    limbs, special = exact.zeros(3)
    rng = np.random.default_rng(0)
    values = torch.tensor(rng.standard_normal(3000) * 2.0 ** rng.integers(-60, 60, 3000))
    exact.add(limbs, special, values, torch.tensor(rng.integers(0, 3, 3000)))
    before = exact.to_int(limbs)
    limbs[:, 5] += 3 * 2**40  # an un-normalised limb, as many additions leave it
    limbs[:, 6] -= 3 * 2**8
    exact.carry(limbs)
    assert exact.to_int(limbs) == before
    assert bool(((limbs[:, :-1] >= 0) & (limbs[:, :-1] < 2**32)).all())


@settings(max_examples=30, deadline=None)
@given(
    st.lists(finite.filter(lambda v: abs(v) < 1e300), min_size=2, max_size=40), st.integers(2, 5)
)
def test_exact_sums_any_sharding_and_merge_order_gives_the_same_bits(values, world):
    single = ExactSums(buffer=7)  # small buffer: folds happen mid-stream
    for doc, v in enumerate(values):
        single.add(doc, "x", torch.tensor([v, 2 * v, -v], dtype=torch.float64))
    rng = np.random.default_rng(len(values))
    owner = rng.integers(0, world, len(values))
    shards = [ExactSums() for _ in range(world)]
    for doc in rng.permutation(len(values)):  # any order of addition
        v = values[doc]
        shards[owner[doc]].add(int(doc), "x", torch.tensor([v, 2 * v, -v], dtype=torch.float64))
    merged = shards[-1]
    for other in shards[:-1][::-1]:
        merged.merge(pickle.loads(pickle.dumps(other)))  # as all_gather_object moves it
    assert torch.equal(merged.total("x"), single.total("x"))  # bit-identical
    assert single.total("x")[0].item() == _exact_float(values)
    assert single.total("x")[2].item() == -_exact_float(values)


def test_exact_sums_rows_names_and_errors():
    sums = ExactSums()
    sums.add_rows([0, 1], "a", torch.tensor([[1.0, 2.0], [3.0, 4.0]]))
    sums.add(2, "b", 0.1)  # a Python float is added as float64, not rounded to float32
    assert sums.total("a").tolist() == [4.0, 6.0] and sums.total("b").item() == 0.1
    assert "a" in sums and "c" not in sums and sums.names == ["a", "b"]
    with pytest.raises(InputError, match="shape"):
        sums.add(0, "a", torch.zeros(3))
    with pytest.raises(InputError, match="one row per document"):
        sums.add_rows([0], "a", torch.zeros(2, 2))
    with pytest.raises(KeyError):
        sums.total("c")


def test_add_many_is_add_rows_item_by_item_in_one_copy():
    """Several sums (or per-document statistics) of one batch at once: the same slots, in the
    same order, the same totals and records as one `add_rows` each; a batch larger than the
    buffer is folded directly, also the same."""
    gen = torch.Generator().manual_seed(0)
    rows = [
        ("x", torch.randn(3, 4, generator=gen)),
        ("count", torch.arange(3)),  # integers, cast to float64 on the copy
        ("y", torch.randn(3, 2, 2, generator=gen).double()),
    ]
    for buffer in (1 << 16, 8):
        many, one = ExactSums(buffer=buffer), ExactSums(buffer=buffer)
        for _ in range(3):
            many.add_many([0, 1, 2], rows)
            for name, values in rows:
                one.add_rows([0, 1, 2], name, values)
        assert many.names == one.names == ["x", "count", "y"]
        for name in many.names:
            assert torch.equal(many.total(name), one.total(name))
    many, one = PerDocument(["x", "z"], 5, (4,)), PerDocument(["x", "z"], 5, (4,))
    record = [("z", torch.randn(2, 4, generator=gen)), ("x", torch.randn(2, 4, generator=gen))]
    for _ in range(2):
        many.add_many([3, 1], record)
        for name, values in record:
            one.add_rows([3, 1], name, values)
    assert torch.equal(many.values, one.values) and torch.equal(many.seen, one.seen)
    with pytest.raises(InputError, match="Unknown statistic"):
        many.add_many([0], [("x", torch.zeros(1, 4)), ("w", torch.zeros(1, 4))])


def test_exact_sums_state_does_not_grow_with_additions():
    small, large = ExactSums(), ExactSums()
    for sums, n_docs in ((small, 8), (large, 512)):
        for doc in range(0, n_docs, 8):
            sums.add_rows(range(doc, doc + 8), "x", torch.randn(8, 3, 5))
            sums.add_rows(range(doc, doc + 8), "n", torch.ones(8))
        sums.total("x")  # folds the buffer
    assert state_bytes(small) == state_bytes(large)


def _offer(reservoir, rows_by_doc, docs):
    for doc in docs:
        reservoir.add(doc, "g", rows_by_doc[doc])


def test_reservoir_keeps_the_smallest_keys_whatever_the_sharding():
    gen = torch.Generator().manual_seed(0)
    rows_by_doc = {
        d: torch.randn(int(torch.randint(0, 40, (1,), generator=gen)), 3, generator=gen)
        for d in range(30)
    }
    single = SampleReservoir(["a", "b", "c"], capacity=50, seed=3)
    _offer(single, rows_by_doc, range(30))
    shards = [SampleReservoir(["a", "b", "c"], capacity=50, seed=3) for _ in range(3)]
    for doc in range(30)[::-1]:
        _offer(shards[doc % 3], rows_by_doc, [doc])
    shards[2].merge(pickle.loads(pickle.dumps(shards[0])))  # as all_gather_object moves it
    shards[2].merge(shards[1])
    assert torch.equal(shards[2].table("g"), single.table("g"))
    assert torch.equal(shards[2].documents("g"), single.documents("g"))
    # each kept row remembers the document that offered it
    for row, doc in zip(single.table("g"), single.documents("g").tolist(), strict=True):
        assert (rows_by_doc[doc] == row).all(1).any()
    # reference: every row's key computed directly, the 50 smallest kept
    keyed = [
        (int(k), tuple(r))
        for d, rows in rows_by_doc.items()
        for k, r in zip(row_keys(3, d, "g", rows.numpy()), rows.numpy().tolist(), strict=True)
    ]
    expected = torch.tensor([r for _, r in sorted(keyed)[:50]], dtype=torch.float32)
    assert torch.equal(single.table("g"), expected)
    assert single.table("other").shape == (0, 3)


def test_reservoir_add_many_is_add_per_document_and_group():
    gen = torch.Generator().manual_seed(1)
    rows = torch.randn(300, 3, generator=gen)
    row_doc = torch.randint(0, 4, (300,), generator=gen)
    row_group = torch.randint(0, 3, (300,), generator=gen)
    row_group[row_group == 1] = 2  # group "b" gets no rows, so is never offered
    docs, groups = [7, 3, 11, 5], ["a", "b", "c"]
    one_by_one = SampleReservoir(["x", "y", "z"], capacity=40, seed=2)
    for d in range(4):
        for g in range(3):
            mine = (row_doc == d) & (row_group == g)
            if mine.any():
                one_by_one.add(docs[d], groups[g], rows[mine])
    at_once = SampleReservoir(["x", "y", "z"], capacity=40, seed=2)
    at_once.add_many(docs, groups, rows, row_doc=row_doc, row_group=row_group)
    assert at_once.groups() == one_by_one.groups() == ["a", "c"]
    for g in ("a", "c"):
        assert torch.equal(at_once.table(g), one_by_one.table(g))
        assert torch.equal(at_once.documents(g), one_by_one.documents(g))
    with pytest.raises(InputError, match="same length"):
        at_once.add_many(docs, groups, rows, row_doc=row_doc[:5], row_group=row_group)


def test_reservoir_stored_without_documents_reports_them_unknown():
    res = SampleReservoir(["x"], capacity=4)
    res.add(3, "g", torch.arange(6.0)[:, None])
    state = res.__getstate__()
    del state["_docs"]  # as pickled before rows remembered their document
    old = SampleReservoir.__new__(SampleReservoir)
    old.__setstate__(state)
    assert torch.equal(old.table("g"), res.table("g"))
    assert old.documents("g").tolist() == [-1] * 4


def test_reservoir_state_is_bounded_by_capacity():
    sizes = []
    for n_docs in (20, 200):
        res = SampleReservoir(["x", "y"], capacity=64)
        for doc in range(n_docs):
            res.add(doc, "g", torch.randn(10, 2))
        res.table("g")
        sizes.append(state_bytes(res))
    assert sizes[0] == sizes[1]
    with pytest.raises(InputError, match="rows must be"):
        res.add(0, "g", torch.zeros(3))


def test_per_document_merges_shards_into_the_single_process_table():
    single = PerDocument(["a", "b"], n_documents=6)
    shards = [PerDocument(["a", "b"], n_documents=6) for _ in range(2)]
    for doc in range(6):
        for target in (single, shards[doc % 2]):
            target.add_rows([doc], "a", torch.tensor([doc + 0.5]))
            target.add_rows([doc], "a", torch.tensor([1.0]))
            target.add_rows([doc], "b", torch.tensor([-doc]))
    shards[1].merge(shards[0])
    assert torch.equal(shards[1].table(), single.table())
    assert single.table()[:, 0].tolist() == [d + 1.5 for d in range(6)]
    assert state_bytes(single.values) == 6 * 2 * 4  # 4 bytes per statistic per document
    with pytest.raises(InputError, match="recorded twice"):
        single.merge(shards[1])
    with pytest.raises(InputError, match="Unknown statistic"):
        single.add_rows([0], "c", torch.zeros(1))


def test_bootstrap_replicates_equal_a_direct_weighted_sum_and_any_sharding():
    values = {d: torch.tensor([float(d) - 2.5, 0.1 * d]) for d in range(7)}
    single, shards = BootstrapSums(50, seed=1), [BootstrapSums(50, seed=1) for _ in range(3)]
    for doc, v in values.items():
        single.add_rows([doc], "x", v[None])
        shards[doc % 3].add_rows([doc], "x", v[None])
    shards[0].merge(shards[2])
    shards[0].merge(shards[1])
    total = single.total("x")
    assert total.shape == (50, 2) and torch.equal(shards[0].total("x"), total)
    weights = torch.stack([single.weights(d) for d in values])  # [doc, replicate]
    assert float(weights.mean()) == pytest.approx(1.0, abs=0.15)  # Poisson(1)
    for r in (0, 17, 49):
        direct = math.fsum(float(weights[d, r]) * float(values[d][0]) for d in values)
        assert total[r, 0].item() == direct


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


# --------------------------------------------------------------------------- stored form


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.one_of(
            st.floats(allow_nan=True, allow_infinity=True, width=64),
            st.sampled_from([1e-300, -1e-300, 5e-324, 1e300, -1e300, -1.0, 0.0]),
        ),
        min_size=0,
        max_size=40,
    ),
    st.integers(1, 5),
)
def test_packed_sums_come_back_exactly_and_keep_only_the_columns_in_use(values, n):
    """`pack` keeps the limb columns some sum uses, in the narrowest dtype; `unpack` gives the
    same limbs and special counts back (negative sums, subnormals, NaN and inf included)."""
    limbs, special = exact.zeros(n)
    index = torch.arange(len(values)) % n
    exact.add(limbs, special, torch.tensor(values, dtype=torch.float64), index)
    packed = exact.pack(limbs, special)
    used = (limbs != 0).any(0).nonzero().flatten()
    width = int(used[-1] - used[0] + 1) if used.numel() else 0
    assert packed["limbs"].shape == (n, width)
    back, counts = exact.unpack(packed, n)
    assert torch.equal(back, limbs) and torch.equal(counts, special)
    assert back.dtype == counts.dtype == torch.int64


def test_a_saved_exact_sum_stores_its_columns_in_use_not_all_sixty_eight():
    sums = ExactSums()
    sums.add_rows([0, 1], "a", torch.tensor([[0.5, -2.0], [1.25, 3.0]], dtype=torch.float64))
    state = sums.__getstate__()
    assert "_limbs" not in state and state["_packed"]["limbs"].shape[0] == 2
    assert state["_packed"]["limbs"].shape[1] <= 3  # of exact.N_LIMBS = 68
    again = pickle.loads(pickle.dumps(sums))
    assert torch.equal(again.total("a"), sums.total("a"))
    assert again.total("a").tolist() == [1.75, 1.0]
    again.add_rows([2], "a", torch.tensor([[1.0, 1.0]], dtype=torch.float64))  # still grows
    assert again.total("a").tolist() == [2.75, 2.0]


@pytest.mark.parametrize(
    "damage",
    [
        lambda p: {**p, "first": exact.N_LIMBS},  # columns past the last limb
        lambda p: {**p, "first": -1},
        lambda p: {**p, "first": True},
        lambda p: {**p, "limbs": p["limbs"].double()},  # not whole numbers
        lambda p: {**p, "limbs": p["limbs"][:1]},  # fewer sums than names
        lambda p: {**p, "special": p["special"][:, :2]},
        lambda p: {k: v for k, v in p.items() if k != "special"},
        lambda p: [p],
    ],
)
def test_damaged_packed_sums_are_an_input_error(damage):
    limbs, special = exact.zeros(2)
    exact.add(limbs, special, torch.tensor([1.0, -3.5], dtype=torch.float64), torch.arange(2))
    with pytest.raises(InputError, match="exact sums are damaged"):
        exact.unpack(damage(exact.pack(limbs, special)), 2)


def test_histogram_counts_are_stored_narrow_and_read_back_as_int64():
    hist = Histogram((2,), 0.0, 1.0, 10)
    hist.add(torch.tensor([[0.1, 0.2, 0.2], [0.9, 0.95, 0.5]]))
    state = hist.__getstate__()
    assert state["counts"].dtype == torch.int8
    again = pickle.loads(pickle.dumps(hist))
    assert again.counts.dtype == torch.int64 and torch.equal(again.counts, hist.counts)
    with pytest.raises(InputError, match="whole numbers"):
        Histogram.__new__(Histogram).__setstate__({**state, "counts": state["counts"].float()})
