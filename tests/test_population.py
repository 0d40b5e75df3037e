"""`benchmarks/population.py` (and the parts of `benchmarks/coverage.py` it reuses): the shard
plan, the stored records, and the coverage and compare studies' pure functions on synthetic
populations whose truth is known."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from scipy import stats

from cw_lens import reproduction

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(
        f"cw_lens_benchmarks_{name}", BENCHMARKS / f"{name}.py"
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


pop = _load("population")
cov = _load("coverage")


class MeanOf:
    """A stand-in analysis result: one claim number, the mean of a per-document value, from
    the same `replicates(Bootstrap(documents=...))` the analyses have; it remembers the
    documents each bootstrap drew from."""

    def __init__(self, values: np.ndarray) -> None:
        self.per_document = torch.as_tensor(values, dtype=torch.float64)[:, None]
        self.asked: list[list[int]] = []

    def replicates(self, bootstrap, drivers: bool = True) -> dict[str, torch.Tensor]:
        if bootstrap.documents is not None:
            self.asked.append(list(bootstrap.documents))
        sums = bootstrap.resample(
            torch.cat([self.per_document, torch.ones_like(self.per_document)], 1)
        )
        return {"mean": sums[:, 0] / sums[:, 1]}


# a result of one's own joins the reproduction's questions by registering its answer (the
# subclasses below override the method, so the registered answer calls it)
@reproduction.replicates.register(MeanOf)
def _mean_of_replicates(result: MeanOf, bootstrap, **options) -> dict[str, torch.Tensor]:
    return result.replicates(bootstrap, **options)


def population(n: int = 200, mean: float = 5.0, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).normal(mean, 1.0, n)


# --------------------------------------------------------------------------- the shard plan


@pytest.mark.parametrize(("n_docs", "expected_world"), [(1324, 42), (256, 8), (33, 2), (8, 1)])
def test_shards_are_the_batches_torchrun_ranks_would_hold(n_docs, expected_world):
    """Shard k holds batches k, k + world, ... of the single-run batch plan (`iter_batches`
    of equal-length windows): every document in exactly one shard."""
    from cw_lens.data.inputs import TokenBatch, iter_batches

    world = pop.shard_plan(n_docs)
    assert world == expected_world
    tokens = torch.zeros(n_docs, 5, dtype=torch.long)
    plan = list(
        iter_batches(
            TokenBatch(
                tokens, torch.ones_like(tokens, dtype=torch.bool), True, None, list(range(n_docs))
            ),
            pop.BATCH_SIZE,
        )
    )
    seen = []
    for k in range(world):
        ranks = [d for batch in plan[k::world] for d in batch.documents]
        assert pop.shard_documents(n_docs, k, world) == ranks
        assert len(plan[k::world]) <= pop.BATCHES_PER_SHARD
        seen += ranks
    assert sorted(seen) == list(range(n_docs))


def test_a_shard_file_round_trips_losslessly_and_counts_are_stored_as_integers(tmp_path):
    rng = np.random.default_rng(0)
    arrays = {
        "documents": np.arange(5, dtype=np.int32),
        "taxonomy.winners": rng.integers(0, 256, (5, 3, 2, 3)).astype(np.float32),
        "sinks.sums": rng.normal(size=(5, 14, 3, 2)).astype(np.float32),
        "sinks.share_hist": rng.integers(0, 300, (5, 3, 2, 26)).astype(np.float32),
        "ablation.planned": np.ones((3, 2), bool),
    }
    assert pop.compact(arrays["taxonomy.winners"]).dtype == np.uint8
    assert pop.compact(arrays["sinks.share_hist"]).dtype == np.uint16
    assert pop.compact(arrays["sinks.sums"]).dtype == np.float32
    assert pop.compact(np.array([1.5, 2.0], np.float32)).dtype == np.float32
    assert pop.compact(np.array([-1.0, 2.0], np.float32)).dtype == np.float32
    path = tmp_path / "shard_000_of_001.npz"
    pop.save_shard(path, arrays, {"shard": 0, "note": "x"})
    back, meta = pop.load_shard(path)
    assert meta == {"shard": 0, "note": "x"}
    for key, value in arrays.items():
        assert np.array_equal(back[key], value), key
        if key not in ("documents", "ablation.planned"):
            assert back[key].dtype == np.float32
    assert [p.name for p in tmp_path.iterdir()] == [path.name]  # no temporary file left


def test_a_folder_refuses_shards_of_another_manifest(tmp_path):
    record = {"cw_lens": "0.3.3", "weights": {"sha256": "ab"}, "threads": 2, "code": {"a": 1}}
    pop.check_manifest(tmp_path, record)
    pop.check_manifest(tmp_path, {**record, "threads": 1, "code": {"a": 2}})  # not results
    with pytest.raises(SystemExit, match=r"another manifest \(differs in \['cw_lens'\]\)"):
        pop.check_manifest(tmp_path, {**record, "cw_lens": "0.3.4"})
    with pytest.raises(SystemExit, match="weights"):
        pop.check_manifest(tmp_path, {**record, "weights": {"sha256": "cd"}})


# --------------------------------------------------------------------------- drawing


def test_draws_without_replacement_are_distinct_seeded_and_reach_the_whole_pool():
    gen = torch.Generator().manual_seed(3)
    docs = cov.draw_documents(50, 20, gen, replace=False)
    assert len(set(docs)) == 20 and all(0 <= d < 50 for d in docs)
    again = cov.draw_documents(50, 20, torch.Generator().manual_seed(3), replace=False)
    assert docs == again
    whole = cov.draw_documents(50, 50, torch.Generator().manual_seed(4), replace=False)
    assert sorted(whole) == list(range(50))
    with pytest.raises(ValueError, match="without replacement"):
        cov.draw_documents(5, 6, gen, replace=False)
    # with replacement: the draw coverage.py has always made (its committed table reproduces)
    old = torch.randint(50, (20,), generator=torch.Generator().manual_seed(5)).tolist()
    assert cov.draw_documents(50, 20, torch.Generator().manual_seed(5)) == old


def test_sub_pools_are_disjoint_consecutive_and_cover_the_population():
    parts = pop.sub_pools(1324, 4)
    assert [len(p) for p in parts] == [331, 331, 331, 331]
    assert [d for part in parts for d in part] == list(range(1324))
    small = pop.sub_pools(10, 4)
    assert [d for part in small for d in part] == list(range(10))
    assert sorted(len(p) for p in small) == [2, 2, 3, 3]


def test_two_runs_come_from_disjoint_halves():
    a, b = pop.draw_halves(100, 20, 40, torch.Generator().manual_seed(0))
    assert len(a) == 20 and len(b) == 40 and not set(a) & set(b)
    assert len(set(a)) == 20 and len(set(b)) == 40
    with pytest.raises(ValueError, match="halves"):
        pop.draw_halves(100, 60, 8, torch.Generator().manual_seed(0))


# --------------------------------------------------------------------------- bounds and the rule


@pytest.mark.parametrize(("covered", "draws"), [(380, 400), (372, 400), (400, 400), (1, 10)])
def test_the_lower_bound_is_the_one_sided_clopper_pearson_bound(covered, draws):
    """The one-sided 95% lower bound is the lower end of the exact two-sided 90% interval."""
    expected = (
        stats.binomtest(covered, draws).proportion_ci(confidence_level=0.90, method="exact").low
    )
    assert pop.lower_bound(covered, draws) == pytest.approx(expected, rel=1e-9)
    assert pop.lower_bound(0, draws) == 0.0
    assert pop.lower_bound(draws, draws) == pytest.approx(0.05 ** (1 / draws))


def test_certification_needs_coverage_0_93_and_a_lower_bound_of_0_91():
    assert pop.certified(0.93, 0.91) and pop.certified(0.97, 0.95)
    assert not pop.certified(0.9299, 0.95)
    assert not pop.certified(0.95, 0.9099)
    # at 400 draws, 0.93 observed is not enough (its bound is 0.906); 0.935 is
    assert not pop.certified(372 / 400, pop.lower_bound(372, 400))
    assert pop.certified(374 / 400, pop.lower_bound(374, 400))


def test_certified_from_is_the_smallest_count_certified_with_every_larger_one():
    def row(number, n, certified, method=None, pool="all"):
        method = method or pop.shipped_method(number)
        return {"number": number, "n": n, "certified": certified, "method": method, "pool": pool}

    rows = [
        row("x", 8, False),
        row("x", 32, True),
        row("x", 256, True),
        row("x", 8, True, method="percentile"),  # not the shipped method
        row("x", 8, True, method="per_run_bias_rule"),  # a stored rule that is not shipped
        row("x", 8, True, pool="part 1 of 4"),  # a sub-pool
        row("y", 8, False),
        row("y", 256, False),
        row("geomean_head_ratio_n2", 8, True),
        row("geomean_head_ratio_n2", 8, False, method="expanded"),  # not its method
        row("z", 8, True),  # certified at 8 but not at 32: certified only from 256
        row("z", 32, False),
        row("z", 256, True),
    ]
    assert pop.certified_from(rows) == {
        "x": 32, "y": None, "geomean_head_ratio_n2": 8, "z": 256,
    }  # fmt: skip


def test_the_shipped_method_is_bias_corrected_for_the_geometric_means_only():
    assert pop.shipped_method("geomean_head_ratio_n2") == "bias_corrected"
    assert pop.shipped_method("retriever_share") == "expanded"
    assert pop.shipped_method("median_cancelled_share") == "expanded"


def test_the_package_table_takes_population_rows_and_keeps_the_others_with_bounds():
    def row(number, n, coverage, method="expanded", pool="all", draws=400):
        covered = round(coverage * draws)
        return {
            "analysis": "a", "number": number, "n": n, "coverage": coverage, "covered": covered,
            "se": 0.01, "missing": 0, "draws": draws, "method": method, "pool": pool,
            "lower": pop.lower_bound(covered, draws),
        }  # fmt: skip

    study = {
        "meta": {"documents": 1324},
        "rows": [
            row("x", 8, 0.95),
            row("x", 8, 0.99, method="percentile"),  # not shipped
            row("x", 8, 0.5, pool="part 1 of 4"),  # a sub-pool
            row("geomean_head_ratio_n2", 8, 0.96, method="bias_corrected"),
        ],
    }
    old = [
        {k: v for k, v in row("x", 8, 0.80, draws=300).items() if k not in ("covered", "lower")},
        {k: v for k, v in row("causal", 32, 0.93, draws=300).items() if k != "covered"},
    ]
    current = {"method": "expanded", "biased_method": "bias_corrected", "resamples": 2000}
    table = pop.package_table(study, {**current, "rows": old})
    by = {(r["number"], r["n"]): r for r in table["rows"]}
    assert set(by) == {("x", 8), ("geomean_head_ratio_n2", 8), ("causal", 32)}
    assert by["x", 8]["coverage"] == 0.95 and by["x", 8]["source"] == "population"
    assert by["geomean_head_ratio_n2", 8]["method"] == "bias_corrected"
    causal = by["causal", 32]
    assert causal["source"] == "single_pool" and causal["covered"] == 279
    assert causal["lower"] == pytest.approx(pop.lower_bound(279, 300))
    assert not causal["certified"]  # 0.93 of 300 draws: its lower bound is below 0.91
    assert by["x", 8]["certified"]
    assert table["method"] == "expanded" and "population" in table["sources"]
    # a new single-pool study replaces the old rows of the numbers it measures, only those
    new = [row("causal", 16, 0.96, draws=400), row("x", 8, 0.5, draws=400)]
    renewed = pop.package_table(study, {**current, "rows": old}, new)
    by = {(r["number"], r["n"]): r for r in renewed["rows"]}
    assert set(by) == {("x", 8), ("geomean_head_ratio_n2", 8), ("causal", 16)}
    assert by["x", 8]["coverage"] == 0.95  # the population's row stays
    assert by["causal", 16]["certified"] and by["causal", 16]["source"] == "single_pool"


def test_rows_within_two_standard_errors_of_0_93_get_a_second_study_read_on_pooled_draws():
    """2 SEs at 0.93 with 400 draws are 0.0255: 0.955 and 0.905 are near, 0.96 and 0.9 not. The
    pooled row sums both studies' draws (a lucky first study of 0.940 and a second of 0.905
    certify together only if 0.9225 of 800 does: it does not)."""
    se2 = 2 * math.sqrt(0.93 * 0.07 / 400)
    assert se2 == pytest.approx(0.02551, abs=1e-5)

    def row(number, n, covered, method="expanded", pool="all", draws=400):
        return {
            "analysis": "a", "number": number, "n": n, "coverage": covered / draws,
            "covered": covered, "se": 0.01, "missing": 0, "draws": draws, "method": method,
            "pool": pool, "lower": pop.lower_bound(covered, draws),
        }  # fmt: skip

    rows = [
        row("x", 8, 382),  # 0.955: near
        row("x", 32, 384),  # 0.960: not
        row("y", 8, 362),  # 0.905: near
        row("y", 32, 360),  # 0.900: not
        row("x", 8, 372, method="percentile"),  # not the shipped method
        row("x", 8, 372, pool="part 1 of 4"),  # a sub-pool
        row("geomean_head_ratio_n2", 256, 376, method="bias_corrected"),  # 0.94: near
    ]
    assert [pop.near_target(r) for r in rows[:4]] == [True, False, True, False]
    plan = pop.second_study_plan({"rows": rows})
    assert plan == {
        "a": {
            "numbers": ["x", "y", "geomean_head_ratio_n2"],
            "sizes": [8, 256],
            "rows": [["x", 8], ["y", 8], ["geomean_head_ratio_n2", 256]],
        }
    }
    first = row("z", 32, 376)  # 0.940 [0.917]: certified alone
    assert first["coverage"] >= 0.93 and pop.certified(first["coverage"], first["lower"])
    both = pop.pooled(first, row("z", 32, 362))
    assert (both["covered"], both["draws"]) == (738, 800)
    assert both["coverage"] == pytest.approx(0.9225)
    assert both["lower"] == pytest.approx(pop.lower_bound(738, 800))
    assert not both["certified"]
    assert [s["covered"] for s in both["studies"]] == [376, 362]
    # with_second replaces exactly the repeated rows
    merged = pop.with_second([first, row("z", 8, 390)], [row("z", 32, 362)])
    assert merged[0]["draws"] == 800 and merged[1]["draws"] == 400
    # the package table reads the pooled rows, population and single-pool alike
    current = {"method": "expanded", "biased_method": "bias_corrected", "resamples": 2000}
    single = [{k: v for k, v in row("causal", 8, 366).items() if k != "pool"}]
    table = pop.package_table(
        {"meta": {"documents": 1324}, "rows": [first]},
        {**current, "rows": single},
        second=[row("z", 32, 362)],
        second_single_pool=[row("causal", 8, 380, pool="single")],
    )
    by = {(r["number"], r["n"]): r for r in table["rows"]}
    assert (by["z", 32]["draws"], by["z", 32]["certified"]) == (800, False)
    assert (by["causal", 8]["covered"], by["causal", 8]["draws"]) == (746, 800)
    assert by["causal", 8]["certified"] and by["causal", 8]["source"] == "single_pool"


def test_a_draw_of_adjacent_pairs_holds_neighbouring_windows_only():
    gen = torch.Generator().manual_seed(1)
    docs = pop.adjacent_pairs(101, 40, gen)
    assert len(docs) == 40 and len(set(docs)) == 40 and all(0 <= d < 101 for d in docs)
    pairs = list(zip(docs[::2], docs[1::2], strict=True))
    assert all(b == a + 1 for a, b in pairs)
    assert pop.adjacent_in(docs) >= 20  # every pair is adjacent (pairs may also touch)
    assert pop.adjacent_pairs(101, 40, torch.Generator().manual_seed(1)) == docs
    for seed in range(4):  # either phase fits 5 pairs in 11 windows
        assert len(set(pop.adjacent_pairs(11, 10, torch.Generator().manual_seed(seed)))) == 10
    with pytest.raises(ValueError, match="even"):
        pop.adjacent_pairs(100, 7, gen)
    with pytest.raises(ValueError, match="do not fit"):
        pop.adjacent_pairs(10, 12, gen)
    assert pop.adjacent_in([3, 9, 4, 10, 20]) == 2
    assert pop.adjacent_in([1, 3, 5]) == 0


# --------------------------------------------------------------------------- the studies


@pytest.mark.slow
def test_the_coverage_study_draws_without_replacement_and_takes_the_population_as_truth():
    """A population of 60 documents (values ~ N(5, 1)): at n = 60 every draw is the whole
    population, so its point is the truth and every interval covers; at n = 8 the expanded
    interval covers about 0.95 (it would cover nothing if the truth were not the population's
    mean, 5 standard errors away from 0); no draw repeats a document."""
    result = MeanOf(population(60))
    rows = cov.study({"toy": result}, [8, 60], 200, 300, replace=False)
    shipped = {(r["n"], r["method"]): r for r in rows}
    assert shipped[(60, "expanded")]["coverage"] == 1.0
    assert shipped[(60, "percentile")]["coverage"] == 1.0
    assert 0.88 <= shipped[(8, "expanded")]["coverage"] <= 0.995
    assert shipped[(8, "expanded")]["truth"] == pytest.approx(float(result.per_document.mean()))
    drawn = [docs for docs in result.asked if len(docs) in (8, 60)]
    assert len(drawn) == 400 and all(len(set(docs)) == len(docs) for docs in drawn)
    assert shipped[(8, "expanded")]["covered"] == round(shipped[(8, "expanded")]["coverage"] * 200)
    assert shipped[(8, "expanded")]["mean_bias_to_se"] < 0.25  # a mean is unbiased


@pytest.mark.slow
def test_the_coverage_study_measures_each_sub_pool_against_its_own_truth():
    """Four quarters with different means (1, 2, 3, 4): each quarter's draws cover its own
    mean, which they could not if the whole population's (2.5) were taken as their truth."""
    values = np.concatenate([population(40, mean=m, seed=int(m)) for m in (1.0, 2.0, 3.0, 4.0)])
    rows = pop.coverage_study({"toy": MeanOf(values)}, [8], 100, 300, parts=4)
    parts = [r for r in rows if r["pool"] != "all" and r["method"] == "expanded"]
    assert len(parts) == 4
    for row, mean in zip(parts, (1.0, 2.0, 3.0, 4.0), strict=True):
        assert abs(row["truth"] - mean) < 0.5 and row["coverage"] >= 0.85
        assert row["lower"] == pytest.approx(pop.lower_bound(row["covered"], row["draws"]))
        assert row["certified"] == pop.certified(row["coverage"], row["lower"])
    whole = [r for r in rows if r["pool"] == "all" and r["method"] == "expanded"]
    assert whole[0]["truth"] == pytest.approx(float(values.mean()))
    assert "| toy | `mean` | 8 | 100 |" in pop.study_table(rows)


def test_parts_of_a_study_run_with_consecutive_seed_offsets_merge_into_the_whole_study():
    """A study of 30 draws equals its parts of 10 and 20 draws run with offsets base and base +
    10 (the same draws, the same bootstraps): same covered and missing counts per row; a part
    that leaves a gap in the draws is refused."""
    result = MeanOf(population(40))
    base = 50_000_000

    def part(offset, draws):
        rows = cov.study({"toy": result}, [8], draws, 200, seed_offset=offset,
                         boot_seed_offset=offset)  # fmt: skip
        meta = {"pool": 40, "resamples": 200, "source": "toy", "seed_offset": offset,
                "draws": draws, "wall_s": 1.0, "cpu_s": 1.0}  # fmt: skip
        return {"meta": meta, "rows": rows}

    whole = {(r["number"], r["method"]): r for r in part(base, 30)["rows"]}
    merged = pop.merge_draw_parts([part(base + 10, 20), part(base, 10)])
    assert merged["meta"]["seed_offset"] == base and len(merged["meta"]["parts"]) == 2
    assert len(merged["rows"]) == len(whole)
    for r in merged["rows"]:
        w = whole[r["number"], r["method"]]
        assert (r["covered"], r["missing"], r["draws"]) == (w["covered"], w["missing"], 30)
        assert r["coverage"] == pytest.approx(w["coverage"])
    with pytest.raises(SystemExit, match="starts at draw 12"):
        pop.merge_draw_parts([part(base, 10), part(base + 12, 5)])
    # unmerged parts given as second studies are refused, not read one of them
    parts = [r for offset in (base, base + 10) for r in part(offset, 10)["rows"]]
    for r in parts:
        r["pool"] = "single"
    with pytest.raises(SystemExit, match="merge-draws"):
        pop.with_second([{**parts[0], "coverage": 0.95, "draws": 400}], parts)


class MeanAndMax(MeanOf):
    """Two numbers: the mean (unbiased) and the largest document value (its bootstrap
    replicates sit well below it: |bias| / SE far above 0.25 in every draw)."""

    def replicates(self, bootstrap, drivers: bool = True) -> dict[str, torch.Tensor]:
        out = super().replicates(bootstrap)
        values = self.per_document[:, 0]
        weights = bootstrap.weights(len(values))  # every row: resamples, corpus, leave-one-out
        drawn = torch.where(weights > 0, values[None, :], torch.full_like(weights, -math.inf))
        out["largest"] = drawn.max(1).values
        return out


@pytest.mark.slow
def test_the_study_measures_every_interval_method_on_the_same_draws():
    """Every method of `METHODS` is measured on the same draws (the shipped one is read from
    them), and the bias-corrected interval differs from the expanded one where the plug-in
    is biased (the largest value)."""
    from cw_lens.reproduction.bootstrap import METHODS

    result = MeanAndMax(population(60))
    rows = cov.study({"toy": result}, [8], 60, 300, replace=False, subset=pop.subset)
    cover = {(r["number"], r["method"]): r["coverage"] for r in rows}
    assert set(cover) == {(k, m) for k in ("mean", "largest") for m in METHODS}
    assert cover["largest", "bias_corrected"] != cover["largest", "expanded"]


def test_the_optimism_study_draws_with_replacement_from_pools_of_the_population():
    result = MeanOf(population(120))
    rows = pop.optimism_study({"toy": result}, 16, 16, 3, 20, 200)
    assert [r["pool"] for r in rows] == [0, 1, 2]
    assert all(r["method"] == "expanded" and r["pool_size"] == 16 for r in rows)
    asked = [docs for docs in result.asked if len(docs) == 16]
    assert any(len(set(docs)) < 16 for docs in asked)  # with replacement
    first_pool = asked[:21]  # the pool's truth (its 16 windows), then its 20 draws
    assert len(set(first_pool[0])) == 16
    assert set().union(*map(set, first_pool)) == set(first_pool[0])  # draws stay in the pool
    assert len({r["truth"] for r in rows}) == 3  # each pool's own value is its truth


def test_the_compare_study_counts_false_differences_between_halves_of_one_population():
    """Two runs from disjoint halves of one population differ in no number: compare's
    family-wise error over the draws stays near 0.05 or below."""
    result = MeanOf(population(200))
    [row] = pop.compare_study({"toy": result}, [(8, 16)], 40, 400)
    assert row["draws"] == 40 and row["numbers"] == 1
    assert row["family_wise_error"] <= 0.05 + 3 * math.sqrt(0.05 * 0.95 / 40)
    assert row["upper_95"] >= row["family_wise_error"]
    assert row["not_comparable_per_draw"] == 0  # an unbiased mean is compared across counts
    json.dumps(row)


def test_a_subset_bootstrapped_whole_gives_the_replicates_of_its_documents():
    """`subset(result, docs)` with a plain bootstrap = the whole result with
    `Bootstrap(documents=docs)` (what makes a draw cost its own size, not the pool's): bit
    for bit on float32 records, whose weighted sums are exact in float64 in any order."""
    from cw_lens.reproduction.bootstrap import Bootstrap

    result = MeanOf(population(100).astype(np.float32))  # float32 records, as the analyses'
    docs = [5, 70, 3, 41, 99, 0, 12, 64]
    whole = reproduction.replicates(result, Bootstrap(resamples=300, seed=4, documents=docs))[
        "mean"
    ]
    part = pop.subset(result, docs)
    assert part.per_document.shape[0] == 8 and result.per_document.shape[0] == 100
    assert torch.equal(
        reproduction.replicates(part, Bootstrap(resamples=300, seed=4))["mean"], whole
    )
    with pytest.raises(ValueError, match="distinct"):
        pop.subset(result, [1, 1, 2])


def test_a_shard_is_claimed_by_one_process_and_a_dead_owners_claim_is_taken_over(tmp_path):
    shard = tmp_path / "shard_003_of_042.npz"
    with pop.claimed(shard) as mine:
        assert mine and (tmp_path / "shard_003_of_042.npz.claim").read_text() == str(os.getpid())
        with pop.claimed(shard) as again:  # a live owner holds it
            assert not again
    assert not (tmp_path / "shard_003_of_042.npz.claim").exists()
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    (tmp_path / "shard_003_of_042.npz.claim").write_text(dead)
    with pop.claimed(shard) as mine:
        assert mine
    shard.write_bytes(b"written")
    with pop.claimed(shard) as mine:
        assert not mine


def test_studies_of_one_population_merge_and_others_are_refused():
    def study(analysis, certified, wall):
        meta = {"documents": 1324, "draws": 400, "design": "random", "wall_s": wall}
        row = {"analysis": analysis, "number": f"{analysis}_x", "n": 8, "pool": "all"}
        return {"meta": meta, "rows": [{**row, "method": "expanded", "certified": certified}]}

    merged = pop.merge_studies([study("sinks", True, 10.0), study("selection", False, 20.0)])
    assert [r["analysis"] for r in merged["rows"]] == ["sinks", "selection"]
    assert merged["certified_from"] == {"sinks_x": 8, "selection_x": None}
    assert merged["meta"]["wall_s"] == [10.0, 20.0]
    other = study("taxonomy", True, 1.0)
    other["meta"]["draws"] = 100
    with pytest.raises(SystemExit, match="different settings"):
        pop.merge_studies([study("sinks", True, 10.0), other])


def test_the_sink_statistics_of_a_pool_go_through_shards_and_subsets_as_the_whole_pool(
    tmp_path, monkeypatch
):
    """The ported sink path end to end on a tiny pool (6 windows of 16 tokens, 3 shards of one
    batch of 2): each shard's record and sink samples are stored (`records`) and stacked back
    (`load_population`) into the single run's record and sink sample; the samples' keys
    recompute (`sample_keys`: what a smaller reservoir keeps); and a subset of 3 documents,
    bootstrapped whole, gives the population's replicates with `Bootstrap(documents=...)` for
    every sink number, the drivers' `median_abs_rho_*` included, bit for bit."""
    import dataclasses

    import cw_lens
    from cw_lens.core.accumulators import EMPTY_KEY
    from cw_lens.reproduction.bootstrap import Bootstrap

    model = cw_lens.load_model("testing:tiny-llama")
    corpus = cw_lens.load_corpus(n_docs=6, max_tokens=16, model=model)
    monkeypatch.setattr(pop, "BATCH_SIZE", 2)
    monkeypatch.setattr(pop, "RESERVOIR_CUT", EMPTY_KEY)  # a tiny pool: keep every entry
    whole = pop.run_analyses(model, corpus, ("sinks",))["sinks"]
    world = 3
    stored = {"format": pop.FORMAT, "world": world, "n_windows": 6}
    (tmp_path / "manifest.json").write_text(json.dumps(stored))
    for k in range(world):
        docs = pop.shard_documents(6, k, world, batch_size=2)
        with pop.one_shard(k, world):
            results = pop.run_analyses(model, corpus, ("sinks",))
        arrays = pop.records(results, docs)
        assert arrays["sinks.sums"].shape == (2, 14, 2, 4)
        meta = {
            "manifest": pop.manifest_digest(stored),
            "n_tokens": int(results["sinks"].n_tokens),
            "settings": pop.settings(results),
        }
        pop.save_shard(pop.shard_path(tmp_path, k, world), arrays, meta)
    results, info = pop.load_population(tmp_path, ("sinks",))
    population = results["sinks"]
    assert info["documents"] == list(range(6)) and info["reservoir_exact"]
    assert cov.n_records(population) == 6
    assert torch.equal(population.record, whole.record)

    def sink_rows(table: torch.Tensor) -> list[tuple]:
        return sorted(map(tuple, table[table[:, 0] == 0].tolist()))

    assert len(sink_rows(whole.samples_table)) > 0
    assert sink_rows(population.samples_table) == sink_rows(whole.samples_table)

    # the keys: a reservoir of 8 per head keeps the entries with the 8 smallest of them
    small = cw_lens.sink_statistics(
        model, corpus, batch_size=2, progress=False, seed=pop.ANALYSIS_SEED, max_samples=8
    )

    def per_head(table: torch.Tensor) -> dict[tuple, list[tuple]]:
        index = table[table[:, 0] == 0][:, [9, 1, 2, 3, 4]].long()  # document, layer, head, ...
        keys = pop.sample_keys(index)
        out: dict[tuple, list[tuple]] = {}
        for row, _ in sorted(zip(index.tolist(), keys.tolist(), strict=True), key=lambda x: x[1]):
            out.setdefault((row[1], row[2]), []).append(tuple(row))
        return out

    kept, every = per_head(small.samples_table), per_head(whole.samples_table)
    assert kept.keys() == every.keys()
    assert all(sorted(kept[h]) == sorted(every[h][:8]) for h in every)

    # no head of the tiny model reaches the 0.3 sink rate: judge at the median head's rate
    rate = population.sink_rate.flatten().sort().values
    population = dataclasses.replace(population, threshold=float(rate[len(rate) // 2]))
    docs = [4, 1, 3]
    numbers, _ = reproduction.replicates(
        population, Bootstrap(resamples=200, seed=3, documents=docs)
    )
    part = pop.subset(population, docs)
    assert part.record.shape[0] == 3 and part.threshold == population.threshold
    assert set(part.samples_table[:, 9].long().tolist()) == {0, 1, 2}
    assert len(part.samples_table) == sum(
        int((population.samples_table[:, 9] == d).sum()) for d in docs
    )
    again, _ = reproduction.replicates(part, Bootstrap(resamples=200, seed=3))
    assert set(again) == set(numbers)
    assert {"median_abs_rho_cosine_minus_attention", "median_cancelled_share"} <= set(numbers)
    for number, reps in numbers.items():
        if reps.dim() != 1:
            continue
        assert reps[:200].isfinite().any(), number
        torch.testing.assert_close(again[number], reps, rtol=0, atol=0, equal_nan=True)

    # and the coverage study's draws run on it (without replacement, through subset)
    rows = cov.study({"sinks": population}, [3], 2, 50, replace=False, subset=pop.subset)
    assert {r["number"] for r in rows} >= {"median_abs_rho_relative_norm_minus_attention"}


@pytest.mark.slow
def test_the_coverage_study_measures_every_analysis_under_the_main_jobs_names():
    """Two analyses in one study each get their rows (the first's numbers do not filter the
    second's), an input-level test's numbers are named after its task as the main job names
    them, and of the pair-level test's numbers only the comparison's are kept."""

    class Inputs(MeanOf):
        def replicates(self, bootstrap, drivers: bool = True) -> dict[str, torch.Tensor]:
            return {f"inputs_{k}": v for k, v in super().replicates(bootstrap).items()}

    class Pairs(MeanOf):
        def replicates(self, bootstrap, drivers: bool = True) -> dict[str, torch.Tensor]:
            mean = super().replicates(bootstrap)["mean"]
            return {"pairs_mean": mean, "comprehensiveness_value_norm_minus_attention": mean}

    results = {
        "field_pairs": Pairs(population(16, seed=1)),
        "field_inputs_ioi": Inputs(population(32, seed=2)),
        "field_inputs_arithmetic": Inputs(population(32, seed=3)),
    }
    rows = cov.study(results, [8], 20, 100)
    names = {(r["analysis"], r["number"]) for r in rows}
    assert names == {
        ("field_pairs", "pairs_mean"),
        ("field_inputs_ioi", "inputs_ioi_mean"),
        ("field_inputs_arithmetic", "inputs_arithmetic_mean"),
    }
