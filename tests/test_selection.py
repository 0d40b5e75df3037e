"""P2: selection geometry (P/R/F), head taxonomy and head pruning — against hand-worked cases,
per-query references built from ``run_with_cache``, and direct recomputation."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from cw_lens.analyses import pruning as prn
from cw_lens.analyses import selection as sel
from cw_lens.analyses import taxonomy as taxo
from cw_lens.core.errors import InputError
from cw_lens.data.inputs import prepare_inputs
from cw_lens.data.scoring import corpus_nll, run_logits, token_nll
from cw_lens.models.interventions import HookSet, remove_heads
from cw_lens.models.testing import tiny_llama

TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "Attention heads select tokens; some of them mostly look at the first one.",
    "Short text here",
]


def t64(rows):
    return torch.tensor(rows, dtype=torch.float64)


def floats(prf):
    """A PRF of 0-d tensors (one query, one N) as a tuple of floats."""
    return tuple(float(t) for t in prf)


def reference_prf(values, attention, n, *, distance="euclidean", exclude=(), ranking=None):
    """P, R, F of one query and one N in Python floats, written from the definition: the keys
    ranked by a Python (stable) sort or by `ranking`, excluded keys dropped, and the counts of
    the keys on each side of rho_max and rho_min (the scalar form `geometric_prf` had)."""
    n_keys = attention.shape[0]
    if ranking is None:
        scores = attention.tolist()
        ranked = sorted((j for j in range(n_keys) if j not in exclude), key=lambda j: -scores[j])
    else:
        ranked = [j for j in ranking if j not in exclude]
    y = attention[:, None] * values
    d = sel.selection_distance(y, y[ranked].cumsum(0)[n - 1], distance)
    selected, others = d[ranked[:n]], d[ranked[n:]]
    rho_max = selected.max()
    rho_min = others.min() if len(others) else torch.tensor(math.inf, dtype=d.dtype)
    false_pos = int((others <= rho_max).sum())
    true_pos = int((selected < rho_min).sum())
    p = n / (n + false_pos)
    r = true_pos / n
    return p, r, (2 * p * r / (p + r) if p + r > 0 else 0.0)


# =========================================================================== geometric_prf by hand


def test_ties_go_to_the_smaller_index():
    # all attention equal: top-2 must be keys {0, 1}. By hand: s = 10, D = [10, 0, 9, 1],
    # rho_max = 10, rho_min = 1 -> P = 2/4, R = 1/2, F = 1/2. ({2, 3} would give P = 2/3,
    # F = 4/7; {0, 2} would give 1, 1, 1.)
    values = t64([[0.0], [10.0], [1.0], [11.0]])
    attention = t64([1.0, 1.0, 1.0, 1.0])
    assert floats(sel.geometric_prf(values, attention, 2)) == (0.5, 0.5, 0.5)
    assert floats(sel.geometric_prf(values, attention, 2, ranking=[2, 3, 0, 1])) == pytest.approx(
        (2 / 3, 0.5, 4 / 7)
    )
    grid = sel.geometric_prf(values, attention, [2])
    assert [float(t[0]) for t in grid] == [0.5, 0.5, 0.5]


def test_f1_is_one_for_any_rule_with_euclidean_distance():
    gen = torch.Generator().manual_seed(0)
    for _ in range(20):
        values = torch.randn(9, 4, generator=gen, dtype=torch.float64)
        attention = torch.softmax(torch.randn(9, generator=gen, dtype=torch.float64), 0)
        ranking = torch.randperm(9, generator=gen).tolist()
        assert floats(sel.geometric_prf(values, attention, 1)) == (1.0, 1.0, 1.0)
        assert floats(sel.geometric_prf(values, attention, 1, ranking=ranking)) == (1.0, 1.0, 1.0)


def test_ties_at_rho_max_and_rho_min_by_hand():
    # y = [4, 3, 3, -1] exactly (attention powers of two); S = {0, 1}, s = 7, D = [3, 4, 4, 8]:
    # rho_max = 4 = D_2 (an outside key at rho_max counts against P: <=), rho_min = 4 = D_1 (a
    # selected key at rho_min does not count for R: <). P = 2/3, R = 1/2, F = 4/7 — a strict P
    # would give 1, a lax R 1.
    attention = t64([0.5, 0.25, 0.125, 0.0625])
    values = t64([[8.0], [12.0], [24.0], [-16.0]])
    assert (attention[:, None] * values).flatten().tolist() == [4.0, 3.0, 3.0, -1.0]
    expected = (2 / 3, 0.5, pytest.approx(4 / 7, abs=1e-15))
    assert floats(sel.geometric_prf(values, attention, 2)) == expected
    assert reference_prf(values, attention, 2) == expected
    p, r, f = sel.geometric_prf(values, attention, [2])
    assert (float(p[0]), float(r[0]), float(f[0])) == expected
    order = torch.tensor([0, 1, 2, 3])
    p, r, f = sel.prf_of_ranking(
        attention[:, None] * values, order, torch.ones(4, dtype=torch.bool), [2]
    )
    assert (float(p[0]), float(r[0]), float(f[0])) == expected
    # the corpus path: several rankings of a row, the whole grid at once
    prf = sel.prf_of_rankings(
        (attention[:, None] * values)[None],
        order[None, None],
        torch.ones(1, 1, 4, dtype=torch.bool),
        [2],
    )
    assert tuple(prf[0, 0, 0].tolist()) == expected


def test_separable_selection_scores_one():
    values = t64([[10, 0], [10, 0.1], [0, 1], [0, -1], [1, 0], [-1, 0]])
    attention = t64([0.4, 0.4, 0.05, 0.05, 0.05, 0.05])
    assert floats(sel.geometric_prf(values, attention, 2)) == (1.0, 1.0, 1.0)


def test_contaminated_selection_by_hand():
    # y = [4, 3, 3.5, -1]; S = {0, 1}, s = 7, D = [3, 4, 3.5, 8]; rho_max = 4, rho_min = 3.5
    # P = 2 / (2 + 1) (key 2 inside), R = 1 / 2 (key 1 is not closer than key 2), F = 4/7
    attention = t64([0.4, 0.3, 0.2, 0.1])
    values = t64([[4.0], [3.0], [3.5], [-1.0]]) / attention[:, None]
    p, r, f = floats(sel.geometric_prf(values, attention, 2))
    assert (p, r) == pytest.approx((2 / 3, 1 / 2)) and f == pytest.approx(4 / 7)
    # N = 3: S = {0, 1, 2}, s = 10.5, D = [6.5, 7.5, 7, 11.5] -> P = 1, R = 1
    assert floats(sel.geometric_prf(values, attention, 3)) == (1.0, 1.0, 1.0)


def test_cosine_distance_by_hand():
    # y0 = (.4, 0), y1 = (0, .3), y2 = .2 (1, 1), y3 = .1 (10, 7.5) — y3 points along s = (.4, .3)
    attention = t64([0.4, 0.3, 0.2, 0.1])
    y = t64([[0.4, 0.0], [0.0, 0.3], [0.2, 0.2], [1.0, 0.75]])
    values = y / attention[:, None]
    # cosine: D = [0.2, 0.4, 1 - 0.7/(0.5 sqrt 2) ~ 0.0101, 0] -> P = 2/4, R = 0, F = 0
    assert floats(sel.geometric_prf(values, attention, 2, distance="cosine")) == (0.5, 0.0, 0.0)
    d = sel.selection_distance(y, y[:2].sum(0), "cosine")
    expected = t64([0.2, 0.4, 1 - 0.7 / (0.5 * math.sqrt(2)), 0.0])
    assert torch.allclose(d, expected, atol=1e-12)
    # euclidean: D = [0.3, 0.4, 0.2236, 0.75] -> P = 2/3, R = 0
    assert floats(sel.geometric_prf(values, attention, 2)) == (2 / 3, 0.0, 0.0)
    # a zero value vector gets distance 1 (the 1e-12 guard), never NaN
    values[3] = 0.0
    d = sel.selection_distance(attention[:, None] * values, y[:2].sum(0), "cosine")
    assert float(d[3]) == 1.0


def test_exclude_equals_removing_the_key():
    gen = torch.Generator().manual_seed(1)
    values = torch.randn(8, 3, generator=gen, dtype=torch.float64)
    attention = torch.softmax(torch.randn(8, generator=gen, dtype=torch.float64), 0)
    attention[0] = 0.9  # the "sink" has the most attention
    for n in (1, 2, 3, 7):
        for distance in ("euclidean", "cosine"):
            got = sel.geometric_prf(values, attention, n, exclude=[0], distance=distance)
            want = sel.geometric_prf(values[1:], attention[1:], n, distance=distance)
            assert floats(got) == floats(want)
    with pytest.raises(InputError, match="between 1 and the number of candidate keys"):
        sel.geometric_prf(values, attention, 8, exclude=[0])


# =========================================================================== invariants


@st.composite
def query_cases(draw):
    n_keys = draw(st.integers(2, 10))
    d = draw(st.integers(1, 4))
    coord = st.floats(-3, 3, allow_nan=False, width=64)
    values = t64(
        draw(st.lists(st.lists(coord, min_size=d, max_size=d), min_size=n_keys, max_size=n_keys))
    )
    levels = st.sampled_from([0.0, 0.05, 0.1, 0.25, 0.5, 1.0])  # few levels: many ties
    attention = t64(draw(st.lists(levels, min_size=n_keys, max_size=n_keys)))
    exclude = draw(st.sampled_from([[], [0], [n_keys - 1]]))
    distance = draw(st.sampled_from(sel.DISTANCES))
    return values, attention, exclude, distance


@settings(max_examples=150, deadline=None)
@given(query_cases())
def test_prf_invariants_and_grid_equals_the_per_query_reference(case):
    values, attention, exclude, distance = case
    n_cand = len(attention) - len(exclude)
    grid = list(range(1, n_cand + 1))
    batched = sel.geometric_prf(values, attention, grid, distance=distance, exclude=exclude)
    candidates = [j for j in range(len(attention)) if j not in exclude]
    ranked = sorted(candidates, key=lambda j: (-float(attention[j]), j))
    y = attention[:, None] * values
    for k, n in enumerate(grid):
        prf = reference_prf(values, attention, n, distance=distance, exclude=exclude)
        assert all(0.0 <= x <= 1.0 for x in prf)
        assert prf == tuple(float(t[k]) for t in batched)  # exactly
        one = sel.geometric_prf(values, attention, n, distance=distance, exclude=exclude)
        assert all(t.dim() == 0 for t in one) and floats(one) == prf
        d = sel.selection_distance(y, y[ranked[:n]].cumsum(0)[-1], distance)
        rho_max = float(d[ranked[:n]].max())
        rho_min = float(d[ranked[n:]].min()) if n < n_cand else math.inf
        assert (prf == (1.0, 1.0, 1.0)) == (rho_min > rho_max)


@pytest.mark.parametrize("distance", sel.DISTANCES)
def test_prf_in_row_blocks_equals_one_block_bit_for_bit(monkeypatch, distance):
    """prf_of_ranking computes its distances over blocks of rows (cache-sized); forcing blocks
    of a few rows must give exactly the numbers of one full-size block."""
    gen = torch.Generator().manual_seed(3)
    values = torch.randn(7, 3, 40, 16, generator=gen)
    attention = torch.softmax(3 * torch.randn(7, 3, 40, generator=gen), -1)
    full = sel.geometric_prf(values, attention, [1, 2, 4, 8], distance=distance)
    row_bytes = 3 * 40 * 16 * 4
    monkeypatch.setattr(sel.prf, "DISTANCE_BLOCK_BYTES", 2 * row_bytes)  # blocks of 2 rows
    blocked = sel.geometric_prf(values, attention, [1, 2, 4, 8], distance=distance)
    for a, b in zip(full, blocked, strict=True):
        assert torch.equal(a, b)


@settings(max_examples=30, deadline=None)
@given(query_cases(), st.integers(0, 2**31 - 1))
def test_random_rankings_are_nested_and_match_the_single_form(case, seed):
    values, attention, _, distance = case
    n_keys = len(attention)
    orders = sel.random_order(
        torch.ones(1, n_keys, dtype=torch.bool), 3, torch.Generator().manual_seed(seed)
    )[0]
    grid = list(range(1, n_keys + 1))
    y = (attention[:, None] * values).expand(3, -1, -1)
    batched = sel.prf_of_ranking(y, orders, torch.ones(3, n_keys, dtype=torch.bool), grid, distance)
    rows = sel.geometric_prf(  # the rankings as [rows, key], one row per ranking
        values.expand(3, -1, -1), attention.expand(3, -1), grid, distance=distance, ranking=orders
    )
    for r, order in enumerate(orders.tolist()):
        assert sorted(order) == list(range(n_keys))
        for k, n in enumerate(grid):  # each N uses the first N keys of one permutation
            single = reference_prf(values, attention, n, distance=distance, ranking=order)
            assert single == tuple(float(t[r, k]) for t in batched)
            assert single == tuple(float(t[r, k]) for t in rows)
            one = sel.geometric_prf(values, attention, n, distance=distance, ranking=order)
            assert floats(one) == single


def test_random_rankings_are_seeded():
    a = sel.random_rankings(0, 3, 1, 20, n_heads=4, n_random=16)
    assert torch.equal(a, sel.random_rankings(0, 3, 1, 20, n_heads=4, n_random=16))
    assert a.shape == (4, 16, 21)
    assert torch.equal(a.sort(-1).values, torch.arange(21).expand(4, 16, -1))
    for other in [(1, 3, 1, 20), (0, 4, 1, 20), (0, 3, 2, 20)]:
        assert not torch.equal(a, sel.random_rankings(*other, n_heads=4, n_random=16))
    # non-candidates always come last
    cand = torch.tensor([[True, False, True, True, False]])
    order = sel.random_order(cand, 5, torch.Generator().manual_seed(0))[0]
    assert (order[:, 3:].sort(-1).values == torch.tensor([1, 4])).all()


def test_power_grid():
    assert sel.power_grid(129) == [1, 2, 4, 8, 16, 32, 64]
    assert sel.power_grid(8) == [1, 2, 4]
    assert sel.power_grid(1) == []


def test_geometric_prf_one_n_drops_the_n_axis_of_the_grid():
    gen = torch.Generator().manual_seed(5)
    values = torch.randn(2, 3, 10, 4, generator=gen, dtype=torch.float64)
    attention = torch.softmax(torch.randn(2, 3, 10, generator=gen, dtype=torch.float64), -1)
    grid = sel.geometric_prf(values, attention, [4, 1, 2, 2], exclude=[0])  # sorted, no repeats
    assert grid.f.shape == (2, 3, 3) and grid.f.dtype == torch.float64
    for k, n in enumerate([1, 2, 4]):
        one = sel.geometric_prf(values, attention, n, exclude=[0])
        assert one.f.shape == (2, 3)
        for a, b in zip(one, grid, strict=True):
            assert torch.equal(a, b[..., k])
    p, r, f = sel.geometric_prf(values[0, 0], attention[0, 0], 2)  # one query: 0-d tensors
    assert p.shape == r.shape == () and 0.0 <= float(f) <= 1.0
    # a row with fewer candidates than N is NaN, as on the grid
    candidates = torch.ones(2, 3, 10, dtype=torch.bool)
    candidates[0, 0, 3:] = False
    masked = sel.geometric_prf(values, attention, 4, candidates=candidates)
    assert masked.f[0, 0].isnan() and not masked.f[1].isnan().any()
    # one ranking for every row equals that ranking given per row
    order = torch.randperm(10, generator=gen)
    shared = sel.geometric_prf(values, attention, [1, 2, 4], ranking=order.tolist())
    per_row = sel.geometric_prf(values, attention, [1, 2, 4], ranking=order.expand(2, 3, -1))
    for a, b in zip(shared, per_row, strict=True):
        assert torch.equal(a, b)


def test_geometric_prf_batched_is_a_deprecated_forward():
    gen = torch.Generator().manual_seed(6)
    values = torch.randn(4, 8, 3, generator=gen)
    attention = torch.softmax(torch.randn(4, 8, generator=gen), -1)
    with pytest.warns(DeprecationWarning, match=r"is now geometric_prf\(\.\.\.\)") as record:
        old = sel.geometric_prf_batched(values, attention, [2, 1], distance="cosine", exclude=[0])
    assert record[0].filename == __file__  # the warning points at the caller
    new = sel.geometric_prf(values, attention, [1, 2], distance="cosine", exclude=[0])
    for a, b in zip(old, new, strict=True):
        assert a.shape == (4, 2) and torch.equal(a, b)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"n": 0}, "between 1 and the number of candidate keys"),
        ({"n": 2.0}, "n must be an integer"),
        ({"n": True}, "n must be an integer"),
        ({"n": []}, "non-empty list of positive integers"),
        ({"n": [1, 0]}, "non-empty list of positive integers"),
        ({"n": 2, "ranking": [0, 1, 2]}, "permutation of the 4 key indices"),
        ({"n": 2, "ranking": [0, 1, 1, 2]}, "permutation of the 4 key indices"),
        ({"n": 2, "ranking": [0, 1, 2, 7]}, "key indices in"),
        ({"n": 2, "ranking": torch.tensor([0.0, 1.0, 2.0, 3.0])}, "integer key indices"),
        ({"n": 2, "exclude": [4]}, "exclude must hold key indices"),
        ({"n": 2, "candidates": torch.ones(3, dtype=torch.bool)}, "candidates"),
        ({"n": 2, "candidates": torch.ones(4)}, "boolean mask"),
    ],
)
def test_geometric_prf_rejects_bad_input(kwargs, match):
    values, attention = t64([[0.0], [10.0], [1.0], [11.0]]), t64([0.4, 0.3, 0.2, 0.1])
    with pytest.raises(InputError, match=match):
        sel.geometric_prf(values, attention, **kwargs)
    with pytest.raises(InputError, match="same rows and keys"):
        sel.geometric_prf(values, attention[:3], 2)


# =========================================================================== tiny-model pipeline


@pytest.fixture(scope="module")
def model():
    return tiny_llama(seed=0, n_layers=2)


def run_cached(model, texts):
    batch = prepare_inputs(model, texts)
    _, cache = model.run_with_cache(batch.tokens, attention_mask=batch.mask.long())
    return batch, cache


def reference_geometry(model, batch, cache, grid, query, n_random, seed):
    """Per-query loops over reference_prf: mean F per (layer, rule, head, n)."""
    n_layers, n_heads = model.cfg.n_layers, model.cfg.n_heads
    group = n_heads // cache["blocks.0.attn.hook_v"].shape[2]
    sums = torch.zeros(n_layers, 3, n_heads, len(grid), 2, dtype=torch.float64)
    for layer in range(n_layers):
        pattern = cache[f"blocks.{layer}.attn.hook_pattern"]
        values = cache[f"blocks.{layer}.attn.hook_v"]
        for b, length in enumerate(batch.lengths.tolist()):
            queries = [length - 1] if query == "last" else range(1, length)
            for q in queries:
                rankings = sel.random_rankings(seed, b, layer, q, n_heads, n_random)
                for h in range(n_heads):
                    v = values[b, : q + 1, h // group].double()  # the float64 definition
                    a = pattern[b, h, q, : q + 1].double()
                    for k, n in enumerate(grid):
                        if 2 * n > q + 1:
                            continue
                        rules = [
                            reference_prf(v, a, n)[2],
                            sum(reference_prf(v, a, n, ranking=r)[2] for r in rankings[h].tolist())
                            / n_random,
                            reference_prf(v, a, n, exclude=[0])[2],
                        ]
                        for r, f in enumerate(rules):
                            sums[layer, r, h, k] += torch.tensor([f, 1.0], dtype=torch.float64)
    return sums[..., 0] / sums[..., 1]


@pytest.mark.parametrize("query", ["last", "all"])
def test_selection_geometry_matches_per_query_reference(model, query):
    texts = TEXTS if query == "last" else ["Short text here", "Hello, small world!"]
    batch, cached = run_cached(model, texts)
    result = sel.selection_geometry(
        model, texts, query=query, n_random=4, seed=7, batch_size=2, progress=False
    )
    assert sel.RULES == ("top", "random", "top_no_sink")
    expected = reference_geometry(model, batch, cached, result.n_grid, query, 4, 7)
    got = result.mean("f")
    assert torch.allclose(got, expected, atol=1e-12, equal_nan=True)
    assert result.n_grid == sel.power_grid(int(batch.lengths.max()))
    assert (result.mean("f")[..., 0] == 1.0).all()  # F_1 = 1 for every rule


def test_selection_geometry_tables_and_reproducibility(model):
    a = sel.selection_geometry(model, TEXTS, n_random=4, batch_size=1, progress=False)
    b = sel.selection_geometry(model, TEXTS, n_random=4, batch_size=3, progress=False)
    assert torch.allclose(a.sums, b.sums, atol=1e-9)  # batching does not change the draws
    c = sel.selection_geometry(model, TEXTS, n_random=4, seed=1, batch_size=3, progress=False)
    assert torch.equal(b.sums[:, 0], c.sums[:, 0]) and not torch.equal(b.sums[:, 1], c.sums[:, 1])
    df = a.to_dataframe()
    assert set(df["rule"]) == {"top", "random", "top_no_sink"}
    row = df.set_index(["layer", "head", "n", "rule"]).loc[(1, 2, 2, "top")]
    assert row["f"] == pytest.approx(float(a.mean("f")[1, 0, 2, 1]))
    table = a.f_by_n()
    means = df.groupby(["rule", "n"])["f"].mean()
    assert table.loc[4, "top"] == pytest.approx(means["top", 4])
    assert table.loc[4, "top_over_random"] == pytest.approx(means["top", 4] / means["random", 4])
    effect = a.sink_effect()
    assert effect.loc[2, "ratio"] == pytest.approx(means["top_no_sink", 2] / means["top", 2])


def test_several_sink_positions_never_give_nan(model):
    # "abc" has 4 keys (with BOS): N = 2 is scored, but with sinks 0, 1, 2 removed only key 3
    # is left, so the sink-free rule is undefined there and that query is not counted
    result = sel.selection_geometry(
        model, ["abc", "abcdefgh"], sink_positions=(0, 1, 2), n_random=0, progress=False
    )
    df = result.to_dataframe().set_index(["rule", "n"])
    assert not df[["precision", "recall", "f"]].isna().any().any()
    assert (df.loc[("top", 2), "n_queries"] == 2).all()
    assert (df.loc[("top_no_sink", 2), "n_queries"] == 1).all()


def test_selection_geometry_rejects_bad_input(model):
    with pytest.raises(InputError, match="longest document"):
        sel.selection_geometry(model, ["ab"], n_grid=[4], progress=False)
    with pytest.raises(InputError, match="query must be"):
        sel.selection_geometry(model, TEXTS, query="first", progress=False)
    with pytest.raises(InputError, match="n_random"):
        sel.selection_geometry(model, TEXTS, n_random=-1, progress=False)
    with pytest.raises(InputError, match="distance"):
        sel.geometric_prf(t64([[1.0]]), t64([1.0]), 1, distance="manhattan")
    with pytest.raises(InputError, match="finite"):
        sel.geometric_prf(t64([[1.0], [math.nan]]), t64([0.5, 0.5]), 1)


# =========================================================================== taxonomy


def built_heads(model, layer):
    """Head 0 attends to itself, head 1 to position 0, head 2 uniformly (causal); the value of
    kv head 1 (read by heads 2 and 3) at position 1 is scaled up 100x, so under uniform attention
    the winner argmax_j ||v_j|| is key 1 for every query i >= 2 — neither current nor sink."""

    def pattern(p, hook):
        p = p.clone()
        n = p.shape[-1]
        causal = torch.ones(n, n).tril()
        p[:, 0] = torch.eye(n)
        p[:, 1] = 0.0
        p[:, 1, :, 0] = 1.0
        p[:, 2] = causal / causal.sum(-1, keepdim=True)
        return p

    def values(v, hook):
        v = v.clone()
        v[:, 1, 1] *= 100.0
        return v

    return HookSet(
        model,
        [(f"blocks.{layer}.attn.hook_v", values), (f"blocks.{layer}.attn.hook_pattern", pattern)],
    )


def test_taxonomy_of_built_heads(model):
    lengths = prepare_inputs(model, TEXTS).lengths
    with built_heads(model, 1) as hooks:
        tax = taxo.head_taxonomy(model, TEXTS, batch_size=2, progress=False)
        batch = prepare_inputs(model, TEXTS)
        _, cache = model.run_with_cache(batch.tokens, attention_mask=batch.mask.long())
    assert len(hooks) == 2
    row = tax.table.set_index(["layer", "head"])
    counted = int((lengths - 1).sum())  # every real query but position 0 (the sink)
    assert (row["n_queries"] == counted).all()
    assert row.loc[(1, 0), "share_current"] == 1.0 and row.loc[(1, 0), "regime"] == "Retriever"
    assert row.loc[(1, 1), "share_sink"] == 1.0 and row.loc[(1, 1), "regime"] == "Mixer"
    # uniform head: query 1 wins itself, every later query wins key 1 ("other")
    assert row.loc[(1, 2), "share_current"] == pytest.approx(len(TEXTS) / counted)
    assert row.loc[(1, 2), "share_other"] == pytest.approx(1 - len(TEXTS) / counted)
    assert row.loc[(1, 2), "regime"] == "Reset"
    # the capture saw the replaced pattern (user hooks run first); output norms follow it
    reference = reference_taxonomy(model, batch, cache, 1)
    for h in range(model.cfg.n_heads):
        for column, value in reference[h].items():
            assert row.loc[(1, h), column] == pytest.approx(value, rel=1e-5), (h, column)


def reference_taxonomy(model, batch, cache, layer):
    pattern = cache[f"blocks.{layer}.attn.hook_pattern"]
    values = cache[f"blocks.{layer}.attn.hook_v"]
    z = cache[f"blocks.{layer}.attn.hook_z"]
    W_O = model.blocks[layer].attn.W_O.detach()
    group = model.cfg.n_heads // values.shape[2]
    out = {}
    for h in range(model.cfg.n_heads):
        counts, norms, entropy = [0, 0, 0], [], []
        for b, length in enumerate(batch.lengths.tolist()):
            for i in range(1, length):
                a = pattern[b, h, i, : i + 1]
                winner = int((a * values[b, : i + 1, h // group].norm(dim=-1)).argmax())
                counts[0 if winner == i else 1 if winner == 0 else 2] += 1
                norms.append(float((z[b, i, h] @ W_O[h]).norm()))
                entropy.append(float(-(a * a.clamp_min(1e-30).log()).sum()))
        n = sum(counts)
        out[h] = {
            "share_current": counts[0] / n,
            "share_sink": counts[1] / n,
            "share_other": counts[2] / n,
            "mean_output_norm": sum(norms) / n,
            "mean_entropy": sum(entropy) / n,
        }
    return out


def test_taxonomy_summaries(model):
    tax = taxo.head_taxonomy(model, TEXTS, progress=False)
    table = tax.to_dataframe()
    assert len(table) == model.cfg.n_layers * model.cfg.n_heads
    shares = table[["share_current", "share_sink", "share_other"]]
    assert torch.allclose(
        torch.tensor(shares.sum(1).values), torch.ones(len(table), dtype=torch.float64)
    )
    first = shares.values.argmax(1)  # ties go to Retriever, then Mixer
    assert list(table["regime"]) == [taxo.REGIMES[k] for k in first]
    assert tax.regime_shares().sum() == pytest.approx(1.0)
    by_layer = tax.shares_by_layer()
    assert by_layer.loc[0, list(taxo.REGIMES)].sum() == pytest.approx(1.0)
    with pytest.raises(InputError, match="sink_positions"):
        taxo.head_taxonomy(model, TEXTS, sink_positions=(), progress=False)


# =========================================================================== pruning


@pytest.fixture(scope="module")
def pruned(model):
    return prn.prune_heads(
        model, TEXTS, retention=(1.0, 0.75, 0.5), lone_docs=2, lone_tokens=16, progress=False
    )


def test_pruning_levels_are_exact(model, pruned):
    table = pruned.to_dataframe()
    assert set(table["order"]) == set(prn.ORDERS)
    assert len(table) == (3 + 3) * 3  # three deterministic orders + three random draws
    full = table[table["retention"] == 1.0]
    assert (full["n_removed"] == 0).all() and (full["delta_ppl"] == 0.0).all()
    assert corpus_nll(model, TEXTS, hooks=remove_heads(model, []).hooks).ppl == pruned.clean_ppl
    assert set(table.loc[table["retention"] == 0.75, "n_removed"]) == {2}  # 8 heads
    for name, draws in pruned.rankings.items():
        if name in pruned.cross_fitted:  # each half ranked by the other: checked below
            continue
        for draw, ranking in enumerate(draws):
            row = table[(table.order == name) & (table.draw == draw) & (table.retention == 0.5)]
            hooks = remove_heads(model, prn.removed_heads(ranking, 0.5, "layer")).hooks
            assert float(row["ppl"].iloc[0]) == corpus_nll(model, TEXTS, hooks=hooks).ppl
            assert float(row["delta_ppl"].iloc[0]) != 0.0


def test_pruning_orders(model, pruned):
    stats = pruned.head_stats.set_index(["layer", "head"])
    # W_V is [kv_head, ...] on the bridge, repeated to [head, ...] on a HookedTransformer
    group = model.cfg.n_heads // model.blocks[0].attn.W_V.shape[0]
    magnitude = [
        (layer, h, float(attn.W_V[h // group].detach().norm() * attn.W_O[h].detach().norm()))
        for layer in range(2)
        for attn in [model.blocks[layer].attn]
        for h in range(4)
    ]
    direct = [(layer, h) for layer, h, _ in sorted(magnitude, key=lambda t: (t[2], t[0], t[1]))]
    assert pruned.rankings["magnitude"][0] == direct
    rank = {"Reset": 0, "Mixer": 1, "Retriever": 2}
    keys = [
        (rank[stats.loc[h, "regime"]], stats.loc[h, "mean_output_norm"])
        for h in pruned.rankings["taxonomy"][0]
    ]
    assert keys == sorted(keys)
    entropy = [stats.loc[h, "mean_entropy"] for h in pruned.rankings["entropy"][0]]
    assert entropy == sorted(entropy, reverse=True)
    again = prn.prune_heads(model, TEXTS, order="random", retention=0.5, lone=False, progress=False)
    assert again.rankings["random"] == pruned.rankings["random"]
    assert (
        again.table["ppl"].tolist()
        == pruned.table.query("order == 'random' and retention == 0.5")["ppl"].tolist()
    )
    other = prn.prune_heads(
        model, TEXTS, order="random", retention=0.5, seed=1, lone=False, progress=False
    )
    assert other.rankings["random"] != pruned.rankings["random"]
    assert len({tuple(r) for r in pruned.rankings["random"]}) == 3


def test_layer_scope_removes_the_same_fraction_per_layer(model, pruned):
    ranking = [(1, 2), (0, 3), (1, 0), (0, 1), (1, 1), (0, 0), (0, 2), (1, 3)]
    assert prn.removed_heads(ranking, 0.75, "global") == [(1, 2), (0, 3)]
    assert prn.removed_heads(ranking, 0.5, "global") == [(1, 2), (0, 3), (1, 0), (0, 1)]
    assert prn.removed_heads(ranking, 0.5) == [(1, 2), (1, 0), (0, 3), (0, 1)]  # per layer
    assert prn.removed_heads(ranking, 0.25) == [(1, 2), (1, 0), (1, 1), (0, 3), (0, 1), (0, 0)]
    assert prn.removed_heads(ranking, 0.75) == [(1, 2), (0, 3)]  # 1 of 4 per layer
    # methods § Token selection: the same share of heads in every layer by default
    assert pruned.scope == "layer"
    layered = prn.prune_heads(
        model, TEXTS, order="entropy", retention=0.5, lone=False, progress=False, cross_fit=False
    )
    removed = prn.removed_heads(layered.rankings["entropy"][0], 0.5, "layer")
    expected = corpus_nll(model, TEXTS, hooks=remove_heads(model, removed).hooks).ppl
    assert layered.table["ppl"].tolist() == [expected]
    assert layered.scope == "layer" and layered.table["n_removed"].tolist() == [4]


def test_cross_fitted_rankings_are_learnt_on_the_other_half(model, pruned):
    """methods § Claims: the taxonomy and entropy rankings that prune the even-indexed documents are
    learnt on the odd-indexed ones and vice versa; ΔPPL pools both halves' NLL."""
    assert pruned.cross_fitted == ("taxonomy", "entropy")
    res = prn.prune_heads(
        model,
        TEXTS,
        order=("taxonomy", "entropy", "magnitude"),
        retention=0.5,
        lone=False,
        progress=False,
        per_document=True,
    )
    for name in ("taxonomy", "entropy"):
        record = res.per_document[(name, 0, 0.5)]  # [document, (nll sum, count)]
        for fold in (0, 1):
            learnt = prn.prune_heads(
                model,
                TEXTS[1 - fold :: 2],
                order=name,
                retention=0.5,
                lone=False,
                progress=False,
                cross_fit=False,
            ).rankings[name][0]
            removed = prn.removed_heads(learnt, 0.5, "layer")
            hooks = remove_heads(model, removed).hooks
            own = corpus_nll(model, TEXTS[fold::2], hooks=hooks)
            total = record[fold::2].sum(0)
            assert float(total[0]) == pytest.approx(float(own.sums.column("nll")), rel=1e-6)
            assert float(total[1]) == float(own.sums.column("count"))
        pooled = record.sum(0)
        row = res.table[(res.table.order == name)]
        assert float(row["nll"].iloc[0]) == pytest.approx(float(pooled[0] / pooled[1]), rel=1e-6)
    assert res.table.query("order == 'magnitude'")["ppl"].iloc[0] == pytest.approx(
        pruned.table.query("order == 'magnitude' and retention == 0.5")["ppl"].iloc[0]
    )
    whole = taxo.head_taxonomy(model, TEXTS, progress=False)
    with pytest.raises(InputError, match="cross_fit=False"):
        prn.prune_heads(model, TEXTS, order="taxonomy", taxonomy=whole, progress=False)
    with pytest.raises(InputError, match="at least 2 documents"):
        prn.prune_heads(model, TEXTS[:1], order="entropy", lone=False, progress=False)


def test_lone_head_costs_match_direct_removal(model, pruned):
    batch = prepare_inputs(model, TEXTS[:2])
    batch.tokens, batch.mask = batch.tokens[:, :17], batch.mask[:, :17]

    def ppl(hooks):
        nll = token_nll(run_logits(model, batch, hooks), batch.tokens, batch.mask)
        return math.exp(float(nll.nansum() / (~nll.isnan()).sum()))

    clean = ppl([])
    assert pruned.lone_clean_ppl == pytest.approx(clean, rel=1e-5)
    lone = pruned.lone.set_index(["layer", "head"])
    assert len(lone) == 8 and pruned.lone["delta_ppl"].is_monotonic_decreasing
    for head in [(0, 0), (1, 3)]:
        direct = ppl(remove_heads(model, [head]).hooks) - clean
        assert lone.loc[head, "delta_ppl"] == pytest.approx(direct, rel=1e-4, abs=1e-6)
    assert pruned.top(1)[["layer", "head"]].values.tolist() == [list(lone.index[0])]


def test_magnitude_on_gpt2(gpt2):
    got = prn.head_magnitudes(gpt2, [1])[0]
    attn = gpt2.blocks[1].attn
    expected = torch.stack([attn.W_V[h].norm() * attn.W_O[h].norm() for h in range(4)])
    assert torch.allclose(got, expected.detach())


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"retention": (0.9, 90)}, "fractions, not percentages"),
        ({"retention": ()}, "retention is empty"),
        ({"order": ("taxonomy", "size")}, "unknown: \\['size'\\]"),
        ({"n_random": 0}, "n_random"),
        ({"lone_heads": [(0, 9)]}, "out of range"),
        ({"lone_tokens": 0}, "lone_tokens"),
    ],
)
def test_pruning_rejects_bad_input(model, kwargs, match):
    with pytest.raises(InputError, match=match):
        prn.prune_heads(model, TEXTS, progress=False, **kwargs)


def test_claims_read_the_registered_intervals(model):
    """`cw_lens.reproduction.claims` of a selection or taxonomy result with a bootstrap sets
    on each check the interval that `intervals` gives (and on retriever_share its per-layer
    rows); the toolkit summary carries no verdict."""
    from cw_lens.reproduction import Bootstrap, claims, intervals, replicates

    bootstrap = Bootstrap(resamples=40)
    geo = sel.selection_geometry(model, TEXTS, n_random=2, per_document=True, progress=False)
    tax = taxo.head_taxonomy(model, TEXTS, per_document=True, progress=False)
    assert "claims_hold" not in geo.summary_dict()
    for result in (geo, tax):
        numbers, per_layer = intervals(result, bootstrap)
        assert set(numbers) <= set(replicates(result, bootstrap))
        judged = claims(result, bootstrap)
        checks = [c for claim in judged.values() for c in claim["checks"]]
        assert checks and all(c["interval"] == list(numbers[c["number"]]) for c in checks)
        for cid, rows in per_layer.items():
            assert judged[cid]["per_layer"] == rows
    assert [row["layer"] for row in intervals(tax, bootstrap)[1]["retriever_share"]] == tax.layers
    assert all(c["interval"] is None for c in claims(geo)["sink_lowers_fn"]["checks"])
    with pytest.raises(InputError, match="per_document=True"):
        intervals(sel.selection_geometry(model, TEXTS, progress=False), bootstrap)


def test_summaries_are_json_ready(model, pruned):
    import json

    geo = sel.selection_geometry(model, TEXTS, n_random=2, progress=False)
    tax = taxo.head_taxonomy(model, TEXTS, progress=False)
    out = json.loads(json.dumps([geo.summary_dict(), tax.summary_dict(), pruned.summary_dict()]))
    assert out[0]["top_over_random"]["2"] == pytest.approx(
        geo.f_by_n().loc[2, "top_over_random"], abs=1e-4
    )
    assert out[1]["retriever_share"] == tax.regime_shares()["Retriever"]
    assert out[2]["delta_ppl"]["0.5"]["taxonomy"] == pytest.approx(
        pruned.by_retention().loc[0.5, "taxonomy"], abs=1e-4
    )
    assert out[2]["top_lone_heads"][0]["layer"] == int(pruned.lone["layer"].iloc[0])


# =========================================================================== plots


def test_plots_draw_the_result_tables(model, pruned):
    import matplotlib

    matplotlib.use("Agg")
    geo = sel.selection_geometry(model, TEXTS, n_random=2, progress=False)
    fig = geo.plot()
    top = fig.axes[0].lines[0]
    assert list(top.get_ydata()) == pytest.approx(list(geo.f_by_n()["top"]))
    fig = geo.plot_sink_effect()
    effect = geo.sink_effect()
    assert list(fig.axes[1].lines[0].get_ydata()) == pytest.approx(
        list(effect["median_head_ratio"])
    )
    assert list(fig.axes[1].lines[1].get_ydata()) == pytest.approx(list(effect["ratio"]))
    tax = taxo.head_taxonomy(model, TEXTS, progress=False)
    fig = tax.plot()
    heights = [p.get_height() for p in fig.axes[0].patches[: model.cfg.n_layers]]
    assert heights == pytest.approx(list(tax.shares_by_layer()["Retriever"]))
    fig = pruned.plot()
    assert list(fig.axes[0].lines[0].get_ydata()) == pytest.approx(
        list(pruned.by_retention()["taxonomy"])
    )
    import matplotlib.pyplot as plt

    plt.close("all")


# =========================================================================== embedded model


@pytest.mark.model
def test_embedded_model_selection_and_taxonomy(smollm, prose):
    layers = [0, 9]
    geo = sel.selection_geometry(smollm, prose, layers=layers, n_random=4, progress=False)
    assert (geo.mean("f")[..., 0] == 1.0).all()
    table = geo.f_by_n()
    assert (table.loc[[2, 4], "top_over_random"] > 1).all()
    tax = taxo.head_taxonomy(smollm, prose, layers=[9], progress=False)
    batch = prepare_inputs(smollm, prose)
    _, cache = smollm.run_with_cache(
        batch.tokens,
        attention_mask=batch.mask.long(),
        names_filter=lambda name: (
            name in {f"blocks.9.attn.hook_{k}" for k in ("pattern", "v", "z")}
        ),
        stop_at_layer=10,
    )
    reference = reference_taxonomy(smollm, batch, cache, 9)
    row = tax.table.set_index("head")
    for h in range(smollm.cfg.n_heads):
        for column in ("share_current", "share_sink", "share_other"):
            assert row.loc[h, column] == pytest.approx(reference[h][column], abs=1e-12)
