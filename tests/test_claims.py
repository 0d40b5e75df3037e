"""methods § Claims's criteria, claim by claim, on both sides: tables built by hand where each
claim must
hold and where it must not, with traps where a wrong reading (mean for median, pooled for per
head, ratio for difference, no filter, wrong group, lax comparison) flips the verdict."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cw_lens import reproduction
from cw_lens.analyses.faithfulness import FaithfulnessResult
from cw_lens.analyses.pruning import ORDERS, PruningResult
from cw_lens.analyses.selection import head_f_ratio
from cw_lens.analyses.sinks import SinkAblationResult
from cw_lens.analyses.taxonomy import HeadTaxonomyResult
from cw_lens.core.errors import InputError
from cw_lens.reproduction.selection_claims import selection_claims
from cw_lens.reproduction.sink_claims import sink_claims
from cw_lens.reproduction.verdicts import (
    VERDICTS,
    Check,
    Claim,
    claims_dict,
    combine,
    with_intervals,
)

# methods § Claims's criterion column, verbatim
CRITERIA = {
    "sink_attention_vs_contribution": "over sink heads, mean intra contribution of the sink < ½ × "
    "its mean attention (the ratio is the number)",
    "faithfulness_order": "pairs granularity: strict AOPC comprehensiveness order attention < "
    "value_norm < value_norm_output < contribution, and contribution lowest on sufficiency",
    "sink_value_norm_ratio": "median over sink heads of mean ‖pv_j‖/‖pv_0‖ lies in [3, 10]",
    "sink_anti_alignment": "median over sink heads of cos(pv_0, m_i) < 0",
    "sink_contribution_drivers": "per sink head, Spearman ρ of each factor with the sink's "
    "contribution; the median over heads of |ρ(attention)| is the smallest of the three",
    "convex_sink_curve": "more than half of the sink heads with at least 16 counted queries have a "
    "median s* in (0, 1)",
    "sink_cancels_drift": "median cos(α₀pv₀, d_i) < 0 in more than half of the sink heads, and the "
    "median cancelled share > 0 (per-head medians from unclipped values)",
    "sink_ablation_cone": "cone alignment rises more in low-norm heads than in the others, and PPL "
    "rises",
    "topn_beats_random": "mean F_N(top) > F_N(random) at every N > 1, and the largest difference "
    "at N ∈ {2, 4}",
    "sink_lowers_fn": "at N = 2 and N = 4 the geometric mean over heads of F_N(sink "
    "excluded)/F_N(sink allowed) > 1 (a smooth statistic: the median sits on a point mass of "
    "heads at exactly 1 and its bootstrap is off-centre); the median and the share of heads at "
    "≥ 2× are reported beside it",
    "retriever_share": "Retriever share in [5.8%, 17.2%]",
    "pruning_signal": "per-layer ranking, learnt on held-out documents (cross-fitting): "
    "ΔPPL(taxonomy) < mean ΔPPL over ≥ 20 random draws at 90% and 75% retention, the interval "
    "resampling documents and draws together; the best order at 50% and 25% is reported",
}


# =========================================================================== Check and Claim


@pytest.mark.parametrize(
    ("value", "op", "threshold", "holds"),
    [
        (0.49, "<", 0.5, True),
        (0.5, "<", 0.5, False),  # strict
        (0.51, ">", 0.5, True),
        (0.5, ">", 0.5, False),  # strict
        (3.0, "in", (3.0, 10.0), True),  # closed
        (10.0, "in", (3.0, 10.0), True),
        (2.999, "in", (3.0, 10.0), False),
        (10.001, "in", (3.0, 10.0), False),
        (math.inf, ">", 1.0, True),
        (-math.inf, "<", 0.0, True),
    ],
)
def test_check_comparisons(value, op, threshold, holds):
    check = Check("x", value, op, threshold)
    assert check.holds == ("yes" if holds else "no")
    assert check.to_dict()["holds"] == check.holds


def test_check_rejects_bad_ops_and_claims_need_every_check():
    with pytest.raises(ValueError, match="op must be"):
        Check("x", 1.0, ">=", 0.0)
    with pytest.raises(ValueError, match="low, high"):
        Check("x", 1.0, "in", 0.0)
    with pytest.raises(ValueError, match="low, high"):
        Check("x", 1.0, "<", (0.0, 1.0))
    yes, no = Check("a", 1.0, ">", 0.0), Check("b", -1.0, ">", 0.0)
    assert Claim("c", "p", "k", [yes, yes]).holds == "yes"
    assert Claim("c", "p", "k", [yes, no]).holds == "no"
    assert Claim("c", "p", "k", []).holds == "not measured"
    d = claims_dict([Claim("c", "p", "k", [yes, no], {"extra": 2})])["c"]
    assert list(d["measured"]) == ["a", "b", "extra"]  # headline numbers first
    assert d["checks"][1] == {
        "number": "b",
        "value": -1.0,
        "op": ">",
        "threshold": 0.0,
        "interval": None,
        "holds": "no",
    }
    assert d["holds"] == "no" and d["criterion"] == "k" and d["paper"] == "p"


@pytest.mark.parametrize("op", ["<", ">", "in"])
@pytest.mark.parametrize("interval", [None, (0.0, 1.0), (math.nan, math.nan)])
def test_a_number_that_was_not_measured_is_not_measured_never_no(op, interval):
    threshold = (0.0, 1.0) if op == "in" else 0.5
    check = Check("x", math.nan, op, threshold, interval=interval)
    assert check.holds == "not measured"
    assert Claim("c", "p", "k", [check]).holds == "not measured"


def test_a_check_the_bootstrap_gave_no_interval_is_inconclusive_not_its_point_verdict():
    decisive = Check("a", 2.0, ">", 0.0)
    assert decisive.holds == "yes"  # no bootstrap asked for: the point comparison
    claim = Claim("c", "p", "k", [decisive, Check("b", -3.0, ">", 0.0)])
    boot = with_intervals([claim], {"b": (-4.0, -2.0)})[0]  # "a" has a bootstrap, no interval
    assert [c.holds for c in boot.checks] == ["inconclusive", "no"]
    assert with_intervals([claim], {"b": (-4.0, 1.0)})[0].holds == "inconclusive"
    assert boot.to_dict()["checks"][0]["interval"][0] != boot.to_dict()["checks"][0]["interval"][0]
    half = Check("a", 2.0, ">", 0.0, interval=(1.0, math.nan))
    assert half.holds == "inconclusive"


@pytest.mark.parametrize(
    ("verdicts", "combined"),
    [
        (["yes", "yes"], "yes"),
        (["yes", "inconclusive"], "inconclusive"),
        (["inconclusive", "not measured"], "not measured"),
        (["yes", "not measured"], "not measured"),
        (["not measured", "no"], "no"),  # a decisive failure refutes the conjunction
        (["inconclusive", "no", "yes"], "no"),
        ([], "not measured"),
    ],
)
def test_combine_orders_no_then_not_measured_then_inconclusive(verdicts, combined):
    assert combine(verdicts) == combined


def test_combine_refuses_an_unknown_verdict():
    with pytest.raises(ValueError, match="verdicts are"):
        combine(["yes", "refuted"])


# --------------------------------------------------------------------------- properties

finite = st.floats(-1e6, 1e6, allow_nan=False)


@st.composite
def checks(draw):
    """A check with a random op and threshold, a value (sometimes NaN) and an interval (none,
    undefined, or around the value)."""
    op = draw(st.sampled_from(["<", ">", "in"]))
    a, b = sorted((draw(finite), draw(finite)))
    threshold = (a, b) if op == "in" else a
    value = draw(st.one_of(finite, st.just(math.nan)))
    kind = draw(st.sampled_from(["none", "nan", "interval"]))
    interval = None
    if kind == "nan":
        interval = (math.nan, math.nan)
    elif kind == "interval":
        low, high = sorted((draw(finite), draw(finite)))
        interval = (low, high)
    return Check("x", value, op, threshold, interval=interval)


def _satisfies(check, v):
    if check.op == "<":
        return v < check.threshold
    if check.op == ">":
        return v > check.threshold
    return check.threshold[0] <= v <= check.threshold[1]


@settings(max_examples=400, deadline=None)
@given(checks())
def test_verdict_properties(check):
    """yes: point and every interval value satisfy; no: point and every interval value fail;
    inconclusive otherwise; NaN: not measured. Checked against the point, the interval's ends
    and a grid of the interval (the comparisons are monotone, so the ends and the grid
    decide); the values between a point and an interval it lies outside do not count."""
    verdict = check.holds
    assert verdict in VERDICTS
    if math.isnan(check.value):
        assert verdict == "not measured"
        return
    if check.interval is None:
        assert verdict == ("yes" if _satisfies(check, check.value) else "no")
        return
    low, high = check.interval
    if math.isnan(low):
        assert verdict == "inconclusive"  # a bootstrap without an interval is never decisive
        return
    grid = [*np.clip(np.linspace(low, high, 41), low, high), check.value, low, high]
    sat = [_satisfies(check, v) for v in grid]
    if verdict == "yes":
        assert all(sat)
    elif verdict == "no":
        assert not any(sat)
    else:
        # inconclusive: the point or some value of [low, high] satisfies and some fails
        # (continuum: the grid may miss a one-point band, so check the threshold ends too)
        ends = [t for t in np.atleast_1d(check.threshold) if low <= t <= high]
        sat += [_satisfies(check, t) for t in ends]
        assert any(sat) and not all(sat)


@pytest.mark.parametrize(
    ("value", "interval", "holds"),
    [
        (0.05, (0.18, 0.20), "no"),  # point below the band, interval wholly above: both fail
        (0.20, (0.01, 0.05), "no"),  # point above, interval wholly below
        (0.05, (0.01, 0.05), "no"),  # both below
        (0.10, (0.18, 0.20), "inconclusive"),  # the point in the band, the interval above
        (0.05, (0.10, 0.12), "inconclusive"),  # the interval in the band, the point below
        (0.10, (0.05, 0.12), "inconclusive"),  # the interval straddles the band's edge
        (0.10, (0.07, 0.12), "yes"),
    ],
)
def test_in_check_judges_the_point_and_the_interval_each(value, interval, holds):
    """docs/methods.md#verdicts: no = the point and the whole interval fail the check. For an
    `in` band the failing values lie on two sides, so a point below the band and an interval
    wholly above it both fail: "no" (their hull, which reaches across the band, would say
    inconclusive)."""
    assert Check("retriever_share", value, "in", (0.058, 0.172), interval=interval).holds == holds


@settings(max_examples=300, deadline=None)
@given(checks())
def test_one_sided_checks_judge_the_hull_of_point_and_interval(check):
    """For `<` and `>` (one failing side) judging the point and the interval each is judging
    their hull, the rule before `in` checks were judged on both sides."""
    if check.op == "in" or check.interval is None or math.isnan(check.value):
        return
    low, high = check.interval
    if math.isnan(low):
        return
    hull = check._interval_verdict(min(low, check.value), max(high, check.value))
    assert check.holds == hull


@settings(max_examples=200, deadline=None)
@given(st.lists(checks(), max_size=5))
def test_claim_verdict_properties(items):
    """The claim is yes only if every check is yes, no iff a check is no, not measured only if
    a check is not measured (or none exists); the order of the checks does not matter."""
    verdicts = [c.holds for c in items]
    claim = Claim("c", "p", "k", items)
    assert (claim.holds == "yes") == (bool(items) and all(v == "yes" for v in verdicts))
    assert (claim.holds == "no") == ("no" in verdicts)
    if claim.holds == "not measured":
        assert "not measured" in verdicts or not items
    assert Claim("c", "p", "k", items[::-1]).holds == claim.holds


# =========================================================================== sink claims


def sink_tables(**sink_columns):
    """Five sink heads (layer 0, heads 0-4) and six others (heads 5-10) where every sink claim
    holds; non-sink heads carry values that flip each verdict if they were counted.
    ``sink_columns`` overrides columns of the sink heads (lists of 5)."""
    sink = {
        "sink_attention": [0.6] * 5,
        "sink_contribution": [0.2] * 5,
        "norm_ratio": [4.0, 5.0, 6.0, 7.0, 8.0],
        "norm_ratio_geomean": [2.0, 2.5, 2.8, 2.9, 2.95],  # would fail [3, 10]
        "cos_sink_mixture": [-0.3, -0.2, -0.1, 0.05, 0.1],
        "cos_sink_token": [-0.1] * 5,
        "s_star_interior": [True, True, False, False, False],
        "s_star_count": [100, 100, 100, 4, 4],  # judged: the first three
        "s_star_median": [0.8, 0.7, 1.0, 1.0, 1.0],
        "s_star_at_1": [0.1, 0.1, 0.9, 0.9, 0.9],
        "drift_cos_median": [-0.5, -0.4, -0.3, 0.1, 0.2],
        "drift_cancelled_median": [-0.5, 0.1, 0.3, 3.0, -4.0],
    }
    other = {
        "sink_attention": 0.1,
        "sink_contribution": 0.3,
        "norm_ratio": 1.0,
        "norm_ratio_geomean": 1.0,
        "cos_sink_mixture": 0.5,
        "cos_sink_token": 0.5,
        "s_star_interior": False,
        "s_star_count": 100,
        "s_star_median": 1.0,
        "s_star_at_1": 0.9,
        "drift_cos_median": 0.5,
        "drift_cancelled_median": -1.0,
    }
    sink.update(sink_columns)
    heads = pd.DataFrame(
        {
            "layer": 0,
            "head": range(11),
            "sink_head": [True] * 5 + [False] * 6,
            **{k: list(v) + [other[k]] * 6 for k, v in sink.items()},
        }
    )
    for column in ("sink_relative_norm", "sink_cosine", "tail_attention", "tail_relative_norm"):
        heads[column] = 0.5
    heads["tail_cosine"] = 0.5
    return heads


def driver_table(sink_rho=None, tail_rho=None, other_rho=None):
    """Per-head Spearman rows: sink group of sink heads (``sink_rho``: factor -> 5 values),
    the tail group of sink heads and the sink group of the other heads."""
    sink_rho = sink_rho or {
        # median |rho|: attention 0.2 (mean 0.45), relative norm 0.3, cosine 0.8 (signed -0.8)
        "attention": [0.1, 0.1, 0.2, 0.9, 0.95],
        "relative_norm": [0.3] * 5,
        "cosine": [-0.9, -0.8, -0.7, -0.9, -0.8],
    }
    tail_rho = tail_rho or {
        "attention": [0.99] * 5,
        "relative_norm": [0.1] * 5,
        "cosine": [0.1] * 5,
    }
    other_rho = other_rho or {
        "attention": [0.0] * 6,
        "relative_norm": [0.0] * 6,
        "cosine": [0.0] * 6,
    }
    frames = [
        pd.DataFrame({"layer": 0, "head": range(5), "group": "sink", **_rho(sink_rho)}),
        pd.DataFrame({"layer": 0, "head": range(5), "group": "tail", **_rho(tail_rho)}),
        pd.DataFrame({"layer": 0, "head": range(5, 11), "group": "sink", **_rho(other_rho)}),
    ]
    return pd.concat(frames, ignore_index=True)


def _rho(values):
    return {f"rho_{k}": v for k, v in values.items()}


def sink_verdicts(heads, drivers=None):
    claims = claims_dict(sink_claims(heads, driver_table() if drivers is None else drivers))
    return {cid: c["holds"] == "yes" for cid, c in claims.items()}, claims


def test_every_sink_claim_holds_on_its_fixture_and_reads_the_spec_numbers():
    verdicts, claims = sink_verdicts(sink_tables())
    assert all(verdicts.values()), verdicts
    m = {cid: c["measured"] for cid, c in claims.items()}
    assert m["sink_attention_vs_contribution"]["contribution_over_attention"] == pytest.approx(
        1 / 3
    )
    assert m["sink_value_norm_ratio"]["median_ratio_sink_heads"] == 6.0
    assert m["sink_anti_alignment"]["median_cos_sink_tail_mixture"] == -0.1
    assert m["sink_contribution_drivers"]["median_abs_rho_sink"] == pytest.approx(
        {"attention": 0.2, "relative_norm": 0.3, "cosine": 0.8}
    )
    assert m["convex_sink_curve"]["share_judged_sink_heads_interior_median_s_star"] == 2 / 3
    assert m["convex_sink_curve"]["n_sink_heads_judged"] == 3
    assert m["sink_cancels_drift"]["share_sink_heads_negative_cosine"] == 0.6
    assert m["sink_cancels_drift"]["median_cancelled_share"] == 0.1
    assert m["sink_cancels_drift"]["n_sink_heads_median_share_beyond_2"] == 2
    for cid, claim in claims.items():
        assert claim["criterion"] == CRITERIA[cid]


@pytest.mark.parametrize(
    ("claim", "columns"),
    [
        ("sink_attention_vs_contribution", {"sink_contribution": [0.4] * 5}),
        (
            "sink_attention_vs_contribution",
            {"sink_attention": [0.5] * 5, "sink_contribution": [0.25] * 5},
        ),
        ("sink_value_norm_ratio", {"norm_ratio": [11.0, 12.0, 13.0, 14.0, 15.0]}),
        ("sink_value_norm_ratio", {"norm_ratio": [2.0, 2.5, 2.9, 9.0, 9.0]}),
        ("sink_anti_alignment", {"cos_sink_mixture": [-0.3, -0.2, 0.1, 0.2, 0.3]}),
        ("sink_anti_alignment", {"cos_sink_mixture": [-0.3, -0.2, 0.0, 0.2, 0.3]}),  # strict
        ("convex_sink_curve", {"s_star_interior": [True, False, False, True, True]}),
        ("convex_sink_curve", {"s_star_count": [100, 100, 100, 100, 4]}),  # 2 of 4: not > half
        ("sink_cancels_drift", {"drift_cos_median": [-0.5, -0.4, 0.3, 0.1, 0.2]}),
        ("sink_cancels_drift", {"drift_cancelled_median": [-0.5, -0.1, 0.3, 3.0, -4.0]}),
    ],
)
def test_each_sink_claim_fails_on_its_counter_fixture(claim, columns):
    verdicts, _ = sink_verdicts(sink_tables(**columns))
    assert not verdicts[claim]
    assert all(v for cid, v in verdicts.items() if cid != claim), verdicts


def test_sink_value_norm_ratio_bounds_are_closed_and_read_the_mean_ratio():
    for ratios in ([1.0, 2.0, 3.0, 11.0, 12.0], [1.0, 2.0, 10.0, 11.0, 12.0]):
        assert sink_verdicts(sink_tables(norm_ratio=ratios))[0]["sink_value_norm_ratio"]
    # the geometric mean (a different number) must not decide: 11 fails although geomean is 9
    heads = sink_tables(norm_ratio=[11.0] * 5, norm_ratio_geomean=[9.0] * 5)
    assert not sink_verdicts(heads)[0]["sink_value_norm_ratio"]


def test_convex_sink_curve_judges_heads_with_at_least_16_queries():
    # counts 16 are judged, 15 are not: judged interior [T, T, F] -> 2/3
    heads = sink_tables(s_star_count=[100, 16, 100, 15, 15])
    assert sink_verdicts(heads)[0]["convex_sink_curve"]
    heads = sink_tables(s_star_count=[100, 15, 100, 16, 16])  # judged [T, F, F, F]
    assert not sink_verdicts(heads)[0]["convex_sink_curve"]


@pytest.mark.parametrize(
    "drivers",
    [
        # attention's median |rho| above relative norm's
        {"attention": [0.5] * 5, "relative_norm": [0.4] * 5, "cosine": [0.9] * 5},
        # above cosine's |rho|
        {"attention": [0.5] * 5, "relative_norm": [0.9] * 5, "cosine": [-0.4] * 5},
        # a tie is not "smallest"
        {"attention": [0.3] * 5, "relative_norm": [0.3] * 5, "cosine": [0.9] * 5},
    ],
)
def test_sink_contribution_drivers_fails_when_attention_is_not_the_weakest(drivers):
    verdicts, _ = sink_verdicts(sink_tables(), driver_table(sink_rho=drivers))
    assert not verdicts["sink_contribution_drivers"]


def test_sink_contribution_drivers_uses_the_median_of_absolute_per_head_rho():
    # the fixture holds only with median (mean |rho(attention)| 0.45 > 0.3), absolute values
    # (signed cosine median -0.8 < 0.2), the sink group (tail: attention 0.99), sink heads only
    verdicts, claims = sink_verdicts(sink_tables())
    assert verdicts["sink_contribution_drivers"]
    checks = claims["sink_contribution_drivers"]["checks"]
    assert [c["value"] for c in checks] == pytest.approx([0.1, 0.6])
    # NaN rho (a constant factor) is left out of the median, not counted as 0
    nan_head = {
        "attention": [0.1, 0.1, 0.2, 0.9, math.nan],
        "relative_norm": [0.3] * 5,
        "cosine": [0.8] * 5,
    }
    _, claims = sink_verdicts(sink_tables(), driver_table(sink_rho=nan_head))
    assert claims["sink_contribution_drivers"]["measured"]["median_abs_rho_sink"][
        "attention"
    ] == pytest.approx(0.15)


def test_no_sink_head_means_the_sink_claims_are_not_measured():
    heads = sink_tables()
    heads["sink_head"] = False
    _, claims = sink_verdicts(heads)
    sink_only = [
        "sink_attention_vs_contribution",
        "sink_value_norm_ratio",
        "sink_anti_alignment",
        "sink_contribution_drivers",
        "convex_sink_curve",
        "sink_cancels_drift",
    ]
    assert {cid: claims[cid]["holds"] for cid in sink_only} == dict.fromkeys(
        sink_only, "not measured"
    )
    assert math.isnan(claims["sink_value_norm_ratio"]["measured"]["median_ratio_sink_heads"])


# =========================================================================== ablation


def ablation(low=(0.2, 0.5), other=(0.5, 0.6), clean=3.0, patched=3.5):
    """Two low-norm heads with cone alignment ``low`` (before, after), six others ``other``."""
    rows = [
        {
            "layer": 0,
            "head": h,
            "relative_output_norm": 0.1 * (h + 1),
            "norm_before": 1.0,
            "norm_after": 0.5,
            "cone_before": (low if h < 2 else other)[0],
            "cone_after": (low if h < 2 else other)[1],
            "low_norm": h < 2,
        }
        for h in range(8)
    ]
    return SinkAblationResult(clean, patched, pd.DataFrame(rows), 0.0, "scale", "direct", [0])


def test_sink_ablation_cone_on_both_sides():
    # low-norm heads rise 0.3, others 0.1, PPL up: holds (although low-norm heads end lower)
    claim = reproduction.claims(ablation())["sink_ablation_cone"]
    assert claim["holds"] == "yes" and claim["criterion"] == CRITERIA["sink_ablation_cone"]
    assert claim["measured"]["cone_rise_low_norm_minus_other"] == pytest.approx(0.2)
    assert claim["measured"]["delta_ppl"] == pytest.approx(math.exp(3.5) - math.exp(3.0))
    assert (
        reproduction.claims(ablation(patched=2.9))["sink_ablation_cone"]["holds"] == "no"
    )  # PPL down
    assert (
        reproduction.claims(ablation(patched=3.0))["sink_ablation_cone"]["holds"] == "no"
    )  # unchanged
    assert (
        reproduction.claims(ablation(low=(0.2, 0.3), other=(0.4, 0.6)))["sink_ablation_cone"][
            "holds"
        ]
        == "no"
    )


# =========================================================================== selection


def selection_table(top, random, top_no_sink=None, grid=(1, 2, 4, 8, 16), n_heads=4):
    """Per-head F: ``top`` and ``random`` per N (the same for every head) or per (head, N);
    ``top_no_sink`` per (head, N) (default: equal to top)."""

    def per_head(values):
        values = np.asarray(values, dtype=float)
        return np.broadcast_to(values, (n_heads, len(grid)))

    rules = {"top": per_head(top), "random": per_head(random)}
    rules["top_no_sink"] = rules["top"] if top_no_sink is None else per_head(top_no_sink)
    rows = [
        {"layer": 0, "head": h, "n": n, "rule": rule, "f": float(f[h, k]), "n_queries": 3}
        for rule, f in rules.items()
        for h in range(n_heads)
        for k, n in enumerate(grid)
    ]
    return pd.DataFrame(rows)


def selection_verdicts(table):
    claims = claims_dict(selection_claims(table))
    return {cid: c["holds"] == "yes" for cid, c in claims.items()}, claims


def test_topn_beats_random_on_both_sides():
    holds, claims = selection_verdicts(
        selection_table([1, 0.8, 0.7, 0.5, 0.4], [1, 0.3, 0.3, 0.3, 0.1])
    )
    # the largest ratio is at N = 16 (4x) but the largest difference at N = 2: holds
    assert holds["topn_beats_random"]
    claim = claims["topn_beats_random"]
    assert claim["criterion"] == CRITERIA["topn_beats_random"]
    assert claim["measured"]["min_over_n_f_top_minus_random"] == pytest.approx(0.2)
    assert claim["measured"]["largest_gap_n2_n4_minus_larger_n"] == pytest.approx(0.2)
    # the largest difference at N = 8
    assert not selection_verdicts(
        selection_table([1, 0.5, 0.6, 0.9, 0.4], [1, 0.3, 0.3, 0.3, 0.3])
    )[0]["topn_beats_random"]
    # random better at N = 16
    assert not selection_verdicts(
        selection_table([1, 0.8, 0.7, 0.5, 0.2], [1, 0.3, 0.3, 0.3, 0.3])
    )[0]["topn_beats_random"]
    # equal at N = 16 (strict)
    assert not selection_verdicts(
        selection_table([1, 0.8, 0.7, 0.5, 0.3], [1, 0.3, 0.3, 0.3, 0.3])
    )[0]["topn_beats_random"]


def test_sink_lowers_fn_reads_the_geometric_mean_of_per_head_ratios_at_n2_and_n4():
    # per-head (F + 0.01) ratios at N = 2 and 4: [0.5, 1.2, 1.3, 1.1] -> geometric mean
    # (0.5 * 1.2 * 1.3 * 1.1)^(1/4) = 0.9265 < 1 (fails), although the median is 1.15
    f_top = [[1.0, 1.0, 1.0, 1.0, 1.0], [1.0, 0.1, 0.1, 0.1, 0.1]] + [[1.0, 0.1, 0.1, 0.1, 0.1]] * 2
    ratios = np.array([0.5, 1.2, 1.3, 1.1])
    f_no_sink = np.array(f_top, dtype=float)
    f_no_sink[:, 1:] = (f_no_sink[:, 1:] + 0.01) * ratios[:, None] - 0.01
    holds, claims = selection_verdicts(selection_table(f_top, 0.05, f_no_sink))
    assert not holds["sink_lowers_fn"]
    claim = claims["sink_lowers_fn"]
    assert claim["criterion"] == CRITERIA["sink_lowers_fn"]
    geomean = float(np.prod(ratios) ** 0.25)
    assert claim["measured"]["geomean_head_ratio_n2"] == pytest.approx(geomean)
    assert claim["measured"]["geomean_head_ratio_n4"] == pytest.approx(geomean)
    assert claim["measured"]["median_head_ratio"][2] > 1  # the median alone would say yes
    assert claim["measured"]["share_heads_at_least_2x"] == {2: 0.0, 4: 0.0}
    # ratios [0.9, 0.95, 0.98, 5]: geometric mean 1.41 holds (the median 0.965 would not)
    ratios = np.array([0.9, 0.95, 0.98, 5.0])
    f_no_sink[:, 1:] = (np.array(f_top)[:, 1:] + 0.01) * ratios[:, None] - 0.01
    holds, claims = selection_verdicts(selection_table(f_top, 0.05, f_no_sink))
    assert holds["sink_lowers_fn"]
    assert claims["sink_lowers_fn"]["measured"]["share_heads_at_least_2x"] == {2: 0.25, 4: 0.25}
    # a head whose F is 0 with the sink allowed counts (finite ratio 0.11 / 0.01), not as inf
    zero = np.array(f_top, dtype=float)
    zero[0, 1:] = 0.0
    claim = selection_verdicts(selection_table(zero, 0.05, np.array(f_top)))[1]["sink_lowers_fn"]
    assert claim["measured"]["geomean_head_ratio_n2"] == pytest.approx((101 / 1) ** 0.25)
    assert claim["measured"]["share_heads_with_zero_f"][2] == 0.25


def test_sink_lowers_fn_needs_both_n2_and_n4():
    f_top = [1.0, 0.5, 0.5, 0.5, 0.5]
    assert selection_verdicts(selection_table(f_top, 0.1, [1.0, 0.6, 0.6, 0.6, 0.6]))[0][
        "sink_lowers_fn"
    ]
    assert not selection_verdicts(selection_table(f_top, 0.1, [1.0, 0.6, 0.4, 0.6, 0.6]))[0][
        "sink_lowers_fn"
    ]
    assert not selection_verdicts(selection_table(f_top, 0.1, [1.0, 0.5, 0.6, 0.6, 0.6]))[0][
        "sink_lowers_fn"
    ]  # a ratio of exactly 1 at N = 2


def test_head_f_ratio_counts_a_head_with_no_sink_free_gain_as_infinite():
    ratio = head_f_ratio(pd.Series([0.5, 0.3, 0.0, 0.2]), pd.Series([0.25, 0.0, 0.0, 0.4]))
    assert ratio.iloc[0] == 2.0 and ratio.iloc[1] == math.inf and ratio.iloc[3] == 0.5
    assert math.isnan(ratio.iloc[2])


# =========================================================================== taxonomy


@pytest.mark.parametrize(
    ("n_retrievers", "holds"), [(58, True), (57, False), (100, True), (172, True), (173, False)]
)
def test_retriever_share_range_is_closed(n_retrievers, holds):
    regimes = ["Retriever"] * n_retrievers + ["Mixer"] * (1000 - n_retrievers)
    table = pd.DataFrame({"layer": 0, "head": range(1000), "regime": regimes})
    claim = reproduction.claims(HeadTaxonomyResult(table, (0,), 1))["retriever_share"]
    assert claim["holds"] == ("yes" if holds else "no")
    assert claim["measured"]["retriever_share"] == n_retrievers / 1000
    assert claim["criterion"] == CRITERIA["retriever_share"]


# =========================================================================== pruning


def pruning(taxonomy, random_draws, scope="layer", magnitude=(0.5, 5.0, 8.0, 20.0)):
    """ΔPPL per retention (0.9, 0.75, 0.5, 0.25) for each order; random: 3 draws per level."""
    levels = (0.9, 0.75, 0.5, 0.25)
    rows = []
    orders = {"taxonomy": taxonomy, "magnitude": magnitude, "entropy": (3.0, 4.0, 9.0, 25.0)}
    for name, values in orders.items():
        rows += [
            {"order": name, "draw": 0, "retention": r, "delta_ppl": v}
            for r, v in zip(levels, values, strict=True)
        ]
    for level, draws in zip(levels, random_draws, strict=True):
        rows += [
            {"order": "random", "draw": d, "retention": level, "delta_ppl": v}
            for d, v in enumerate(draws)
        ]
    return PruningResult(
        table=pd.DataFrame(rows),
        head_stats=pd.DataFrame(),
        rankings={},
        clean_ppl=10.0,
        clean_nll=math.log(10.0),
        retention=levels,
        orders=ORDERS,
        seed=0,
        n_documents=1,
        scope=scope,
    )


RANDOM = ((0.5, 4.0, 4.5), (5.0, 5.0, 8.0), (20.0, 20.0, 20.0), (40.0, 40.0, 40.0))


def test_pruning_signal_on_both_sides():
    result = pruning((1.0, 2.0, 10.0, 30.0), RANDOM)  # beats the mean draw (3, 6), not the min
    claim = reproduction.claims(result)["pruning_signal"]
    assert claim["holds"] == "yes" and claim["criterion"] == CRITERIA["pruning_signal"]
    assert claim["measured"]["random_minus_taxonomy_delta_ppl_at_0.9"] == pytest.approx(2.0)
    assert claim["measured"]["random_minus_taxonomy_delta_ppl_at_0.75"] == pytest.approx(4.0)
    assert claim["measured"]["best_order"] == {"0.5": "magnitude", "0.25": "magnitude"}
    assert (
        reproduction.claims(pruning((1.0, 7.0, 10.0, 30.0), RANDOM))["pruning_signal"]["holds"]
        == "no"
    )
    assert (
        reproduction.claims(pruning((3.5, 2.0, 10.0, 30.0), RANDOM))["pruning_signal"]["holds"]
        == "no"
    )
    assert (
        reproduction.claims(pruning((3.0, 2.0, 10.0, 30.0), RANDOM))["pruning_signal"]["holds"]
        == "no"
    )  # tie


def test_pruning_signal_is_judged_on_the_per_layer_ranking():
    per_layer = pruning((1.0, 2.0, 10.0, 30.0), RANDOM)
    global_ = pruning((240.0, 300.0, 400.0, 500.0), RANDOM, scope="global")
    for claim in (
        reproduction.claims(per_layer, other_scope=global_)["pruning_signal"],
        reproduction.claims(global_, other_scope=per_layer)["pruning_signal"],
    ):
        assert claim["holds"] == "yes"
        variant = claim["measured"]["global_ranking"]
        assert variant["random_minus_taxonomy"]["0.9"] == pytest.approx(3.0 - 240.0)
    with pytest.raises(InputError, match="per-layer ranking"):
        reproduction.claims(global_)
    failing = pruning((9.0, 2.0, 10.0, 30.0), RANDOM)
    assert reproduction.claims(global_, other_scope=failing)["pruning_signal"]["holds"] == "no"


# =========================================================================== faithfulness


METRIC_NAMES = ("attention", "value_norm", "value_norm_output", "contribution", "random")


def faithfulness_result(comp, suff, tokens_comp=(4.0, 3.0, 2.0, 1.0, 0.0)):
    """AOPCs per metric (METRIC_NAMES order) at pairs granularity (two fractions each whose
    mean is the given value); the tokens granularity reversed."""
    rows = []
    for granularity, c, s in (("pairs", comp, suff), ("tokens", tokens_comp, suff[::-1])):
        for mode, values in (("comprehensiveness", c), ("sufficiency", s)):
            for metric, v in zip(METRIC_NAMES, values, strict=True):
                for fraction, offset in ((0.1, -0.05), (0.5, 0.05)):
                    rows.append(
                        {
                            "granularity": granularity,
                            "metric": metric,
                            "mode": mode,
                            "fraction": fraction,
                            "delta_nll": v + offset,
                        }
                    )
    return FaithfulnessResult(
        pd.DataFrame(rows), {"nll": 3.0, "ppl": math.exp(3.0)}, False, 1, 10, "abs", 0
    )


HOLDS_COMP = (1.0, 2.0, 3.0, 4.0, 0.1)
HOLDS_SUFF = (0.5, 0.4, 0.3, 0.2, 0.05)  # random (a control) lower still: not compared


def test_faithfulness_order_on_both_sides():
    claim = reproduction.claims(faithfulness_result(HOLDS_COMP, HOLDS_SUFF))["faithfulness_order"]
    assert claim["holds"] == "yes" and claim["criterion"] == CRITERIA["faithfulness_order"]
    values = {c["number"]: c["value"] for c in claim["checks"]}
    assert values == pytest.approx(
        {
            "comprehensiveness_value_norm_minus_attention": 1.0,
            "comprehensiveness_value_norm_output_minus_value_norm": 1.0,
            "comprehensiveness_contribution_minus_value_norm_output": 1.0,
            "sufficiency_lowest_other_minus_contribution": 0.1,
        }
    )
    assert claim["measured"]["aopc_comprehensiveness_tokens"]["attention"] == pytest.approx(4.0)


@pytest.mark.parametrize(
    ("comp", "suff"),
    [
        ((2.0, 2.0, 3.0, 4.0, 0.1), HOLDS_SUFF),  # a tie is not a strict order
        ((1.0, 3.0, 2.0, 4.0, 0.1), HOLDS_SUFF),  # value_norm_output below value_norm
        ((1.0, 2.0, 4.0, 3.0, 0.1), HOLDS_SUFF),  # contribution not the most faithful
        ((2.0, 1.0, 3.0, 4.0, 0.1), HOLDS_SUFF),  # attention above value_norm
        (HOLDS_COMP, (0.5, 0.4, 0.3, 0.35, 0.05)),  # contribution not lowest on sufficiency
        (HOLDS_COMP, (0.5, 0.4, 0.2, 0.2, 0.05)),  # tied lowest
        (HOLDS_COMP, (0.1, 0.4, 0.3, 0.6, 0.05)),  # contribution highest
    ],
)
def test_faithfulness_order_fails_on_counter_fixtures(comp, suff):
    assert (
        reproduction.claims(faithfulness_result(comp, suff))["faithfulness_order"]["holds"] == "no"
    )


def test_faithfulness_order_needs_pairs_granularity_and_every_metric():
    result = faithfulness_result(HOLDS_COMP, HOLDS_SUFF)
    tokens_only = FaithfulnessResult(
        result.curves[result.curves["granularity"] == "tokens"],
        result.clean,
        False,
        1,
        10,
        "abs",
        0,
    )
    with pytest.raises(InputError, match="pairs granularity"):
        reproduction.claims(tokens_only)
    no_vno = FaithfulnessResult(
        result.curves[result.curves["metric"] != "value_norm_output"],
        result.clean,
        False,
        1,
        10,
        "abs",
        0,
    )
    with pytest.raises(InputError, match="value_norm_output"):
        reproduction.claims(no_vno)


# =========================================================================== coverage rules
def test_a_run_below_the_smallest_certified_count_is_inconclusive():
    """docs/methods.md#verdicts: a check run at fewer documents than the smallest count at
    which its interval's coverage was certified (>= 0.93) is inconclusive, and says why; at or
    above that count (and for a number the study never measured) the verdict stands."""
    from cw_lens.reproduction.interval_coverage import (
        LOWER_TARGET,
        STUDIED_MODEL,
        TARGET,
        below_certified,
        certified_from,
        coverage_at,
        settle_by_coverage,
    )
    from cw_lens.reproduction.job import JobConfig
    from cw_lens.reproduction.markdown import size_limits

    share = "retriever_share"
    # the committed table: the population study certifies it from 8 documents; the sink-tail
    # cosine only at 256 (0.905 at 8 and 0.855 at 32)
    assert certified_from(share) == 8 and coverage_at(share, 2) is None
    assert below_certified(share, 2) and below_certified(share, 7)
    assert not below_certified(share, 8) and not below_certified("not_a_number", 2)
    cosine = "median_cos_sink_tail_mixture"
    assert certified_from(cosine) == 256 and below_certified(cosine, 255)
    assert certified_from("delta_ppl") == 8 and below_certified("delta_ppl", 4)

    def run(n: int, value: float = 0.07, interval=(0.06, 0.08), number: str = share) -> dict:
        check = {"number": number, "value": value, "interval": list(interval), "holds": "yes"}
        check.update(op="in", threshold=[0.058, 0.172])
        return {
            "model": STUDIED_MODEL,
            "corpus": "pydoc+stdlib",
            "max_tokens": 256,
            "n_documents": n,
            "claims": {"retriever_share": {"holds": "yes", "paper": "P2", "checks": [check]}},
        }

    two = run(2)  # `cw-lens figures --steps taxonomy --n-docs 2`: no studied count <= 2
    assert settle_by_coverage(two, {}) == ["retriever_share"]
    [check] = two["claims"]["retriever_share"]["checks"]
    assert two["claims"]["retriever_share"]["holds"] == check["holds"] == "inconclusive"
    assert check["undecided_because"] == (
        f"was yes, but its interval's coverage was certified (coverage >= {TARGET}, lower "
        f"bound >= {LOWER_TARGET}) only from 8 documents; this run has 2 (docs/coverage.md)"
    )
    lines = "\n".join(size_limits(JobConfig(), two, {"retriever_share": 2}))
    assert "certified only at more documents than this run has" in lines
    assert "`retriever_share` at 2 documents (share of Retriever heads: certified" in lines
    # a "no" is undecided the same way; "inconclusive" and "not measured" are left alone
    no = run(2, value=0.3, interval=(0.25, 0.35))
    no["claims"]["retriever_share"]["checks"][0]["holds"] = "no"
    no["claims"]["retriever_share"]["holds"] = "no"
    assert settle_by_coverage(no, {}) == ["retriever_share"]
    assert no["claims"]["retriever_share"]["checks"][0]["undecided_because"].startswith("was no")
    at_paper_size = run(256)
    assert settle_by_coverage(at_paper_size, {}) == []
    assert at_paper_size["claims"]["retriever_share"]["holds"] == "yes"
    at_quick_size = run(8)
    assert settle_by_coverage(at_quick_size, {}) == []
    # a number no study measured: nothing shows its interval covers, at any size
    unstudied = run(256, number="a_number_never_studied")
    assert settle_by_coverage(unstudied, {}) == ["retriever_share"]
    reason = unstudied["claims"]["retriever_share"]["checks"][0]["undecided_because"]
    assert "coverage was never studied" in reason, reason
    # between certified counts: the cosine at 32 documents has coverage 0.855, not certified
    between = run(32, number=cosine)
    assert settle_by_coverage(between, {}) == ["retriever_share"]
    reason = between["claims"]["retriever_share"]["checks"][0]["undecided_because"]
    assert "coverage 0.855 at this size (32 documents; lower 95% bound 0.823)" in reason, reason


def test_a_coverage_above_the_target_with_a_low_lower_bound_does_not_certify(monkeypatch):
    """docs/coverage.md#the-population: the certificate needs the coverage's lower 95% bound
    >= 0.91 too. A number covering 0.933 in 300 draws (bound 0.905) at 32 documents is not
    certified there: a 32-document run's decisive check on it is inconclusive; at 16, where it
    covers 0.95 (bound 0.924), it would be certified were it not for 32 above it."""
    from scipy.stats import beta

    from cw_lens.reproduction import interval_coverage as ic

    def row(n, covered, draws=300):  # the one-sided Clopper-Pearson bound, as the study's
        lower = float(beta.ppf(0.05, covered, draws - covered + 1))
        return {"n": n, "coverage": covered / draws, "lower": lower, "draws": draws}

    number = "a_causal_number"
    table = {number: {16: row(16, 285), 32: row(32, 280)}}
    monkeypatch.setattr(ic, "_rows", lambda: table)
    assert ic.coverage_at(number, 32) >= 0.93 and ic.certified_at(number, 32) is False
    assert ic.certified_at(number, 16) is True and ic.certified_from(number) is None
    check = {"number": number, "value": 0.2, "interval": [0.1, 0.3], "holds": "yes"}
    check.update(op=">", threshold=0.0)
    summary = {
        "model": ic.STUDIED_MODEL,
        "corpus": "pydoc+stdlib",
        "max_tokens": 256,
        "n_documents": 256,
        "claims": {"faithfulness_order": {"holds": "yes", "paper": "P1", "checks": [check]}},
    }
    assert ic.settle_by_coverage(summary, {"faithfulness_order": 32}) == ["faithfulness_order"]
    assert (
        "coverage 0.933 at this size (32 documents; lower 95% bound 0.905)"
        in check["undecided_because"]
    )


def test_a_run_on_another_model_below_every_studied_count_is_inconclusive():
    """No study shows an interval covers at fewer than 8 documents on any model: a 2-document
    run of another model is inconclusive and its report says why; at 8 documents its
    verdict stands (indicative: the report says its coverage was not measured)."""
    from cw_lens.reproduction.interval_coverage import (
        coverage_limits,
        settle_by_coverage,
        smallest_studied,
    )

    assert smallest_studied() == 8

    def run(n: int) -> dict:
        check = {"number": "retriever_share", "value": 0.07, "interval": [0.06, 0.08]}
        check.update(op="in", threshold=[0.058, 0.172], holds="yes")
        return {
            "model": "gpt2",
            "corpus": "pydoc",
            "max_tokens": 128,
            "n_documents": n,
            "claims": {"retriever_share": {"holds": "yes", "paper": "P2", "checks": [check]}},
        }

    two = run(2)
    assert settle_by_coverage(two, {}) == ["retriever_share"]
    [check] = two["claims"]["retriever_share"]["checks"]
    assert check["holds"] == two["claims"]["retriever_share"]["holds"] == "inconclusive"
    assert "fewer than 8 documents, on any model; this run has 2" in check["undecided_because"]
    lines = "\n".join(coverage_limits(run(2), {}))
    assert "indicative" in lines and "`retriever_share` at 2" in lines
    eight = run(8)
    assert settle_by_coverage(eight, {}) == []
    assert eight["claims"]["retriever_share"]["holds"] == "yes"
    assert "fewer than 8" not in "\n".join(coverage_limits(eight, {}))


def test_the_cancelled_share_value_is_the_number_its_interval_is_of(llama):
    """The median cancelled share's interval reads the coarse per-document histograms
    (`cw_lens.reproduction.resampled`): its value must be the same formula on the whole corpus (the
    replicates' corpus row), not the fine histogram's median (the gallery once showed 0.1799
    against an interval of the coarse 0.1788), in `claims()` with and without a bootstrap."""
    import cw_lens
    from cw_lens.reproduction.bootstrap import Bootstrap

    words = "the a sink head token drift value norm cosine share query key".split()
    texts = [" ".join(words[(i * 5 + k) % len(words)] for k in range(20 + 3 * i)) for i in range(6)]
    stats = cw_lens.sink_statistics(llama, texts, min_query=4, per_document=True, progress=False)
    stats.threshold = 0.025  # the tiny model has no sink head at 0.3: make some
    boot = Bootstrap(200, seed=1)
    numbers, _ = reproduction.replicates(stats, boot, drivers=False)
    corpus_row = float(numbers["median_cancelled_share"][boot.resamples])
    assert not math.isnan(corpus_row)
    [check] = [
        c
        for c in reproduction.claims(stats, boot)["sink_cancels_drift"]["checks"]
        if c["number"] == "median_cancelled_share"
    ]
    assert check["value"] == pytest.approx(corpus_row, rel=1e-9, abs=1e-12)
    assert check["interval"] == pytest.approx(list(boot.pair(numbers["median_cancelled_share"])))
    plain = reproduction.claims(stats)["sink_cancels_drift"]["measured"]["median_cancelled_share"]
    assert plain == check["value"]
