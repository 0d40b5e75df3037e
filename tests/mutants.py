"""Mutation check (``make mutants``): curated wrong formulas that the fast tests must catch.

Each mutant replaces one snippet of the source (which must occur exactly once) in a fresh copy
of ``cw_lens/``, ``tests/`` and ``pyproject.toml``, then runs the fast tests that cover it
(``-m "not slow and not model and not browser"``, only the listed tests, stopping at the first
failure). A mutant is *killed* when a test fails, *survived* when they all pass; anything else
(a snippet that no longer matches, no test collected, a timeout) is an *error*. The unmutated
copy must pass every listed test first. Exit status 0 only when every mutant is killed.

Usage::

    python tests/mutants.py              # all mutants (about 20 minutes on two cores)
    python tests/mutants.py -k drift     # mutants whose name contains "drift"
    python tests/mutants.py --list       # names and targets only
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FAST = "not slow and not model and not browser"
TIMEOUT_S = 900

SINK_REF = "tests/test_sinks.py::test_sink_statistics_equal_a_float64_reference_on_planted_sinks"
DRIVERS = "tests/test_sinks.py::test_drivers_are_per_head_spearman_of_the_sampled_entries"
ABLATION = "tests/test_sinks.py::test_ablation_per_head_numbers_equal_a_float64_reference"
CLAIMS = "tests/test_claims.py"
TIES = "tests/test_selection.py::test_ties_at_rho_max_and_rho_min_by_hand"
TOKENS = (
    "tests/test_faithfulness.py::test_token_scores_sum_heads_before_ranking",
    "tests/test_faithfulness.py::test_token_ranks_equal_a_reference_from_contribution_weights",
)
QUERY0 = "tests/test_faithfulness.py::test_query_zero_is_never_intervened_on_by_default"
SCOPE = "tests/test_selection.py::test_layer_scope_removes_the_same_fraction_per_layer"
HISTOGRAM = "tests/test_accumulators.py"
BOOT = "tests/test_bootstrap.py"
BOOT_FAST = "tests/test_bootstrap.py::test_vectorised_bootstrap_equals_a_direct_resampling_loop"
BOOT_SINKS = (
    "tests/test_bootstrap.py::test_sink_intervals_are_the_statistics_of_the_resampled_corpora"
)
VERDICTS = "tests/test_bootstrap.py::test_three_valued_verdict_reads_the_whole_interval"


@dataclass(frozen=True)
class Mutant:
    name: str
    path: str
    old: str
    new: str
    tests: tuple[str, ...]


def m(name: str, path: str, old: str, new: str, *tests: str) -> Mutant:
    return Mutant(name, path, old, new, tests)


def flip(name: str, path: str, old: str, *tests: str) -> Mutant:
    """A criterion reversed: ``">"`` <-> ``"<"`` in the snippet."""
    new = old.replace('">"', '"@"').replace('"<"', '">"').replace('"@"', '"<"')
    assert new != old, name
    return Mutant(name, path, old, new, tests or (CLAIMS,))


MUTANTS = [
    # ---------------------------------------------------------------- sink statistics (methods §
    # Attention sinks)
    m(
        "sinks: drift over the whole tail instead of the weak tokens",
        "cw_lens/core/geometry.py",
        "    return tail - strong, n_tail > k_eff",
        "    return tail, n_tail > k_eff",
        SINK_REF,
    ),
    m(
        "sinks: drift over the top-4 tokens only",
        "cw_lens/core/geometry.py",
        "    return tail - strong, n_tail > k_eff",
        "    return strong, n_tail > k_eff",
        SINK_REF,
    ),
    m(
        "sinks: top-3 instead of top-4 kept out of the drift",
        "cw_lens/core/geometry.py",
        "    k_eff = min(k, attention.shape[-1])",
        "    k_eff = min(k - 1, attention.shape[-1])",
        SINK_REF,
    ),
    m(
        "sinks: the s > 0.999 skip removed",
        "cw_lens/analyses/sinks/accumulation.py",
        "        has_tail = has_sink & (s <= 0.999)",
        "        has_tail = has_sink",
        SINK_REF,
    ),
    m(
        "sinks: cos(pv_0, o) instead of cos(pv_0, m)",
        "cw_lens/analyses/sinks/accumulation.py",
        "        cos_mix = torch.where(ok_mix, cross / (nt2 * ns2).clamp_min(1e-30).sqrt(), 0.0)",
        "        z = acts.z[:, q]; cos_mix = torch.where(ok_mix, geo.gram_inner(st, z, gram) / "
        "(geo.gram_inner(z, z, gram) * ns2).clamp_min(1e-30).sqrt(), 0.0)",
        SINK_REF,
    ),
    m(
        "sinks: geometric-mean norm ratio in the head table",
        "cw_lens/analyses/sinks/statistics.py",
        '        "norm_ratio": layer_mean(stats, "ratio_sum", "geometry_count").flatten(),',
        '        "norm_ratio": layer_mean(stats, "log_ratio_sum", "geometry_count")'
        ".exp().flatten(),",
        SINK_REF,
    ),
    m(
        "sinks: geometric-mean norm ratio in the claim",
        "cw_lens/reproduction/sink_claims.py",
        'Check("median_ratio_sink_heads", median(sink, "norm_ratio"), "in", (3.0, 10.0))',
        'Check("median_ratio_sink_heads", median(sink, "norm_ratio_geomean"), "in", (3.0, 10.0))',
        CLAIMS,
    ),
    m(
        "sinks: cancelled share clipped by a +-2 histogram",
        "cw_lens/analyses/sinks/accumulation.py",
        "        self.drift_share = Histogram((n, h), **DRIFT_SHARE_BINNING, device=device)",
        "        self.drift_share = Histogram((n, h), -2.0, 2.0, 200, device=device)",
        SINK_REF,
    ),
    m(
        "histogram: asinh bins found without the unit",
        "cw_lens/core/histograms.py",
        "        t = torch.where(is_asinh, torch.asinh(v / unit), v)",
        "        t = torch.where(is_asinh, torch.asinh(v), v)",
        HISTOGRAM,
    ),
    m(
        "sinks: inner products with the Gram matrix applied twice",
        "cw_lens/core/geometry.py",
        "    return (applied @ vectors.transpose(-1, -2)).transpose(1, 2)",
        "    return (applied @ applied.transpose(-1, -2)).transpose(1, 2)",
        SINK_REF,
    ),
    m(
        "histogram: asinh bins mapped back without the unit",
        "cw_lens/core/histograms.py",
        '        return torch.sinh(t) * self.unit if self.scale == "asinh" else t',
        '        return torch.sinh(t) if self.scale == "asinh" else t',
        HISTOGRAM,
    ),
    # ---------------------------------------------------------------- drivers (Spearman)
    m(
        "drivers: Pearson instead of Spearman",
        "cw_lens/analyses/sinks/statistics.py",
        'corr(method="spearman", min_periods=3)',
        'corr(method="pearson", min_periods=3)',
        DRIVERS,
    ),
    m(
        "drivers: pooled over heads instead of per head",
        "cw_lens/analyses/sinks/statistics.py",
        '    for (layer, head), g in samples.groupby(["layer", "head"], sort=True):',
        '    for (layer, head), g in samples.assign(head=0).groupby(["layer", "head"], sort=True):',
        DRIVERS,
    ),
    m(
        "drivers: mean instead of median over heads",
        "cw_lens/reproduction/sink_claims.py",
        '            f: float(rho.loc[rho["group"] == group, f"rho_{f}"].abs().median())',
        '            f: float(rho.loc[rho["group"] == group, f"rho_{f}"].abs().mean())',
        CLAIMS,
    ),
    m(
        "drivers: signed rho instead of |rho|",
        "cw_lens/reproduction/sink_claims.py",
        '            f: float(rho.loc[rho["group"] == group, f"rho_{f}"].abs().median())',
        '            f: float(rho.loc[rho["group"] == group, f"rho_{f}"].median())',
        CLAIMS,
    ),
    m(
        "drivers: the tail entries judged instead of the sink's",
        "cw_lens/reproduction/sink_claims.py",
        '                abs_rho["sink"][f] - abs_rho["sink"]["attention"],',
        '                abs_rho["tail"][f] - abs_rho["tail"]["attention"],',
        CLAIMS,
    ),
    m(
        "drivers: every head instead of the sink heads",
        "cw_lens/reproduction/sink_claims.py",
        "    rho = drivers[np.asarray(is_sink, dtype=bool)]",
        "    rho = drivers",
        CLAIMS,
    ),
    # ---------------------------------------------------------------- sink claims
    m(
        "convex curve: heads with fewer than 16 queries judged",
        "cw_lens/reproduction/sink_claims.py",
        '    judged = sink[sink["s_star_count"] >= min_s_star_queries]',
        "    judged = sink",
        CLAIMS,
    ),
    m(
        "convex curve: more than 16 queries instead of at least 16",
        "cw_lens/reproduction/sink_claims.py",
        '    judged = sink[sink["s_star_count"] >= min_s_star_queries]',
        '    judged = sink[sink["s_star_count"] > min_s_star_queries]',
        CLAIMS,
    ),
    m(
        "sink claims: every head instead of the sink heads",
        "cw_lens/reproduction/sink_claims.py",
        '    sink = heads[heads["sink_head"].astype(bool)]',
        "    sink = heads",
        CLAIMS,
    ),
    flip(
        "reversed: sink_attention_vs_contribution",
        "cw_lens/reproduction/sink_claims.py",
        'Check("contribution_over_attention", contrib / att if att else math.nan, "<", 0.5)',
    ),
    m(
        "reversed: sink_value_norm_ratio read as >= 3 only",
        "cw_lens/reproduction/sink_claims.py",
        'Check("median_ratio_sink_heads", median(sink, "norm_ratio"), "in", (3.0, 10.0))',
        'Check("median_ratio_sink_heads", median(sink, "norm_ratio"), ">", 3.0)',
        CLAIMS,
    ),
    m(
        "reversed: sink_value_norm_ratio (outside [3, 10])",
        "cw_lens/reproduction/sink_claims.py",
        'Check("median_ratio_sink_heads", median(sink, "norm_ratio"), "in", (3.0, 10.0))',
        'Check("median_ratio_sink_heads", median(sink, "norm_ratio"), "in", (10.0, 1e9))',
        CLAIMS,
    ),
    flip(
        "reversed: sink_anti_alignment",
        "cw_lens/reproduction/sink_claims.py",
        'Check("median_cos_sink_tail_mixture", median(sink, "cos_sink_mixture"), "<", 0.0)',
    ),
    flip(
        "reversed: sink_contribution_drivers",
        "cw_lens/reproduction/sink_claims.py",
        """                abs_rho["sink"][f] - abs_rho["sink"]["attention"],
                ">",""",
    ),
    flip(
        "reversed: convex_sink_curve",
        "cw_lens/reproduction/sink_claims.py",
        """                mean(judged["s_star_interior"]),
                ">",""",
    ),
    flip(
        "reversed: sink_cancels_drift (cosine share)",
        "cw_lens/reproduction/sink_claims.py",
        """                mean(sink["drift_cos_median"] < 0),
                ">",""",
    ),
    flip(
        "reversed: sink_cancels_drift (cancelled share)",
        "cw_lens/reproduction/sink_claims.py",
        'Check("median_cancelled_share", median(sink, "drift_cancelled_median"), ">", 0.0)',
    ),
    # ---------------------------------------------------------------- sink ablation
    m(
        # the accumulator `sink_ablation` runs (`ConeStatistics`)
        "ablation: cone axis including the sink",
        "cw_lens/analyses/sinks/cone.py",
        "            tail = (real & ~sink_full).to(block.acts.values.dtype)",
        "            tail = real.to(block.acts.values.dtype)",
        ABLATION,
    ),
    m(
        "ablation: cone cosine normalised before W_O",
        "cw_lens/analyses/sinks/cone.py",
        '        cos = along * (sq * shared["axis_sq"]).clamp_min(1e-30).rsqrt() * counted',
        '        cos = along * ((outputs * outputs).sum(-1) * shared["axis_sq"])'
        ".clamp_min(1e-30).rsqrt() * counted",
        ABLATION,
    ),
    m(
        "ablation: low-norm heads by raw output norm",
        "cw_lens/analyses/sinks/ablation.py",
        """    cut = df["relative_output_norm"].quantile(low_norm_quantile)
    df["low_norm"] = df["relative_output_norm"] <= cut""",
        """    cut = df["norm_before"].quantile(low_norm_quantile)
    df["low_norm"] = df["norm_before"] <= cut""",
        ABLATION,
    ),
    flip(
        "reversed: sink_ablation_cone (cone rise)",
        "cw_lens/reproduction/sink_claims.py",
        'Check("cone_rise_low_norm_minus_other", rise_low - rise_other, ">", 0.0)',
    ),
    flip(
        "reversed: sink_ablation_cone (PPL)",
        "cw_lens/reproduction/sink_claims.py",
        'Check("delta_ppl", result.delta_ppl, ">", 0.0)',
    ),
    # ---------------------------------------------------------------- faithfulness
    m(
        "faithfulness: token scores by the max over heads",
        "cw_lens/analyses/faithfulness/ranking.py",
        "    return scores.nansum(1)",
        "    return scores.nan_to_num(0.0).amax(1)",
        *TOKENS,
    ),
    m(
        "faithfulness: token scores by summed |score|",
        "cw_lens/analyses/faithfulness/ranking.py",
        "    return scores.nansum(1)",
        "    return scores.abs().nansum(1)",
        *TOKENS,
    ),
    m(
        "faithfulness: query 0 intervened on by default",
        "cw_lens/analyses/faithfulness/curves.py",
        """    first_query: int = 1,
    prepend_bos: bool = True,""",
        """    first_query: int = 0,
    prepend_bos: bool = True,""",
        QUERY0,
    ),
    m(
        "faithfulness: Ranks intervenes on query 0 by default",
        "cw_lens/analyses/faithfulness/ranking.py",
        """        seed: int,
        first_query: int = 1,""",
        """        seed: int,
        first_query: int = 0,""",
        QUERY0,
    ),
    flip(
        "reversed: faithfulness_order (comprehensiveness order)",
        "cw_lens/reproduction/faithfulness_claims.py",
        'Check(f"comprehensiveness_{b}_minus_{a}", float(comp[b] - comp[a]), ">", 0.0)',
    ),
    flip(
        "reversed: faithfulness_order (sufficiency)",
        "cw_lens/reproduction/faithfulness_claims.py",
        """            float(suff[others].min() - suff["contribution"]),
            ">",""",
    ),
    m(
        "faithfulness_order: contribution highest instead of lowest on sufficiency",
        "cw_lens/reproduction/faithfulness_claims.py",
        '            float(suff[others].min() - suff["contribution"]),',
        '            float(suff["contribution"] - suff[others].max()),',
        CLAIMS,
    ),
    # ---------------------------------------------------------------- selection geometry
    m(
        "selection: P strict (rankings)",
        "cw_lens/analyses/selection/prf.py",
        "    false_pos = (outside & (d <= rho_max)).sum(-1)\n",
        "    false_pos = (outside & (d < rho_max)).sum(-1)\n",
        TIES,
    ),
    m(
        "selection: R non-strict (rankings)",
        "cw_lens/analyses/selection/prf.py",
        "    true_pos = (selected & (d < rho_min)).sum(-1)\n",
        "    true_pos = (selected & (d <= rho_min)).sum(-1)\n",
        TIES,
    ),
    m(
        "selection: P strict (batched)",
        "cw_lens/analyses/selection/prf.py",
        "        false_pos = (outside & (d <= rho_max)).sum(-1).double()",
        "        false_pos = (outside & (d < rho_max)).sum(-1).double()",
        TIES,
    ),
    m(
        "selection: R non-strict (batched)",
        "cw_lens/analyses/selection/prf.py",
        "        true_pos = (selected & (d < rho_min)).sum(-1).double()",
        "        true_pos = (selected & (d <= rho_min)).sum(-1).double()",
        TIES,
    ),
    m(
        "sink_lowers_fn: arithmetic instead of geometric mean of per-head ratios",
        "cw_lens/reproduction/resampled.py",
        "    return torch.exp(masked_mean(log_ratio, ~log_ratio.isnan()))",
        "    return masked_mean(log_ratio.exp(), ~log_ratio.isnan())",
        CLAIMS,
    ),
    flip(
        "reversed: sink_lowers_fn",
        "cw_lens/reproduction/selection_claims.py",
        'Check(f"geomean_head_ratio_n{n}", geomean.get(n, math.nan), ">", 1.0)',
    ),
    flip(
        "reversed: topn_beats_random (beats random)",
        "cw_lens/reproduction/selection_claims.py",
        'Check("min_over_n_f_top_minus_random", gap.min() if grid else math.nan, ">", 0.0)',
    ),
    flip(
        "reversed: topn_beats_random (largest difference at small N)",
        "cw_lens/reproduction/selection_claims.py",
        '"largest_gap_n2_n4_minus_larger_n", peak_small - gap.loc[large].max(), ">", 0.0',
    ),
    m(
        "topn_beats_random: largest ratio instead of largest difference",
        "cw_lens/reproduction/selection_claims.py",
        '        gap = (means["top"] - means["random"]).loc[grid]',
        '        gap = (means["top"] / means["random"]).loc[grid] - 1',
        CLAIMS,
    ),
    # ---------------------------------------------------------------- taxonomy, pruning
    m(
        "reversed: retriever_share (outside P2's range)",
        "cw_lens/reproduction/taxonomy_claims.py",
        "RETRIEVER_RANGE = (0.058, 0.172)",
        "RETRIEVER_RANGE = (0.172, 1.0)",
        CLAIMS,
    ),
    m(
        "retriever_share: open interval",
        "cw_lens/reproduction/verdicts.py",
        "        return low <= v <= high",
        "        return low < v < high",
        CLAIMS,
    ),
    # ---------------------------------------------------------------- intervals and verdicts
    m(
        "verdict: a straddling interval read as yes",
        "cw_lens/reproduction/verdicts.py",
        "            yes, no = low > self.threshold, high <= self.threshold",
        "            yes, no = high > self.threshold, high <= self.threshold",
        VERDICTS,
    ),
    m(
        "verdict: the interval ignored",
        "cw_lens/reproduction/verdicts.py",
        "        if self.interval is None:\n            return point",
        "        if True:\n            return point",
        VERDICTS,
    ),
    m(
        "bootstrap: weights drawn without replacement (every document once)",
        "cw_lens/reproduction/bootstrap.py",
        "        gen = torch.Generator().manual_seed(int(self.seed))\n        return drawn[\n"
        "            torch.randint(len(drawn), (self.resamples, len(drawn)), generator=gen, "
        'device="cpu")',
        "        gen = torch.Generator().manual_seed(int(self.seed))\n        return drawn[\n"
        "            torch.stack([torch.randperm(len(drawn), generator=gen) "
        "for _ in range(self.resamples)])",
        BOOT_FAST,
    ),
    m(
        "bootstrap: sink heads fixed at the point estimate's",
        "cw_lens/reproduction/resampled.py",
        '        "sink": rate > threshold,',
        '        "sink": (rate > threshold).any(0, keepdim=True).expand_as(rate),',
        BOOT_SINKS,
    ),
    m(
        "bootstrap: mean instead of median over sink heads",
        "cw_lens/reproduction/resampled.py",
        '        "median_ratio_sink_heads": masked_median(f["norm_ratio"], sink),',
        '        "median_ratio_sink_heads": masked_mean(f["norm_ratio"], sink),',
        BOOT_SINKS,
    ),
    flip(
        "reversed: pruning_signal",
        "cw_lens/reproduction/pruning_claims.py",
        """                _random_minus_taxonomy(table, r),
                ">",""",
    ),
    m(
        "pruning_signal: judged on the global ranking",
        "cw_lens/reproduction/pruning_claims.py",
        "    main = per_layer[0]",
        "    main = results[0]",
        CLAIMS,
    ),
    m(
        "pruning: global ranking by default",
        "cw_lens/analyses/pruning/prune.py",
        '    scope: Literal["layer", "global"] = "layer",',
        '    scope: Literal["layer", "global"] = "global",',
        SCOPE,
    ),
    # ---------------------------------------------------------------- Check itself
    m(
        "check: '<' not strict",
        "cw_lens/reproduction/verdicts.py",
        "            return v < self.threshold",
        "            return v <= self.threshold",
        CLAIMS,
    ),
    m(
        "check: '>' not strict",
        "cw_lens/reproduction/verdicts.py",
        "            return v > self.threshold",
        "            return v >= self.threshold",
        CLAIMS,
    ),
    m(
        "verdict: an `in` check judged on the hull of point and interval",
        "cw_lens/reproduction/verdicts.py",
        "        return self._verdict(point, low, high)",
        "        return self._interval_verdict(min(low, v), max(high, v))",
        CLAIMS,
    ),
    # ---------------------------------------------------------------- coverage and compare
    m(
        "coverage: runs below the smallest certified count keep their verdict",
        "cw_lens/reproduction/interval_coverage.py",
        "    return smallest is None or n_documents < smallest",
        "    return False",
        "tests/test_claims.py::test_a_run_below_the_smallest_certified_count_is_inconclusive",
    ),
    m(
        "compare: p-values not adjusted (Holm's factors dropped)",
        "cw_lens/reproduction/run_replicates.py",
        "    steps = (m - np.arange(m)) * p[order]",
        "    steps = p[order]",
        "tests/test_compare.py",
    ),
]


def make_copy(dest: Path) -> None:
    for name in ("cw_lens", "tests"):
        shutil.copytree(
            ROOT / name,
            dest / name,
            ignore=shutil.ignore_patterns("__pycache__", ".hypothesis", "*.pyc"),
        )
    shutil.copy2(ROOT / "pyproject.toml", dest / "pyproject.toml")
    # the benchmark scripts some tests load by path (their records stay out: 49 MB)
    (dest / "benchmarks").mkdir()
    for script in (ROOT / "benchmarks").glob("*.py"):
        shutil.copy2(script, dest / "benchmarks" / script.name)


def run_tests(copy: Path, tests: tuple[str, ...]) -> tuple[int, str]:
    env = {**os.environ, "PYTHONPATH": str(copy), "HF_HUB_OFFLINE": "1"}
    cmd = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", "-m", FAST]
    try:
        done = subprocess.run(
            [*cmd, *tests], cwd=copy, env=env, capture_output=True, text=True, timeout=TIMEOUT_S
        )
    except subprocess.TimeoutExpired:
        return -1, "timeout"
    lines = (done.stdout + done.stderr).strip().splitlines()
    return done.returncode, lines[-1] if lines else ""


def check_import(copy: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(copy)}
    where = subprocess.run(
        [sys.executable, "-c", "import cw_lens; print(cw_lens.__file__)"],
        cwd=copy,
        env=env,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    if not Path(where).resolve().is_relative_to(copy.resolve()):
        raise SystemExit(f"the copy is not what gets imported ({where}); check PYTHONPATH")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-k", default="", help="only mutants whose name contains this")
    parser.add_argument("--list", action="store_true", help="list the mutants and exit")
    args = parser.parse_args()
    mutants = [mu for mu in MUTANTS if args.k.lower() in mu.name.lower()]
    if args.list:
        for mu in mutants:
            print(f"{mu.name}  [{mu.path}] -> {' '.join(mu.tests)}")
        return 0
    for mu in mutants:  # stale snippets are an error before anything runs
        count = (ROOT / mu.path).read_text().count(mu.old)
        if count != 1:
            raise SystemExit(f"{mu.name}: snippet found {count} times in {mu.path}")
    with tempfile.TemporaryDirectory(prefix="cw_lens-mutants-") as tmp:
        base = Path(tmp) / "base"
        make_copy(base)
        check_import(base)
        targets = tuple(dict.fromkeys(t for mu in mutants for t in mu.tests))
        rc, tail = run_tests(base, targets)
        if rc != 0:
            raise SystemExit(f"the unmutated tests fail ({tail}); fix them first")
        print(f"baseline: {len(targets)} targets pass ({tail})", flush=True)
        results = []
        for i, mu in enumerate(mutants, 1):
            copy = Path(tmp) / f"m{i}"
            make_copy(copy)
            target = copy / mu.path
            target.write_text(target.read_text().replace(mu.old, mu.new))
            start = time.perf_counter()
            rc, tail = run_tests(copy, mu.tests)
            status = {0: "SURVIVED", 1: "killed"}.get(rc, "ERROR")
            results.append((mu, status))
            took = time.perf_counter() - start
            print(
                f"[{i:2d}/{len(mutants)}] {status:8s} {took:5.0f}s  {mu.name}  ({tail})", flush=True
            )
            shutil.rmtree(copy)
    killed = sum(status == "killed" for _, status in results)
    print(f"\n{killed} killed / {len(results) - killed} not killed of {len(results)} mutants")
    for mu, status in results:
        if status != "killed":
            print(f"  {status}: {mu.name}")
    return 0 if killed == len(results) else 1


if __name__ == "__main__":
    sys.exit(main())
