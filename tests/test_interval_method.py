"""Which interval a claim number gets (methods § Intervals): the bias-corrected one when its
plug-in is known to be biased or its bootstrap |bias| / SE exceeds 0.25 in the run, the
expanded one otherwise; each check records its bias/SE and the method used in summary.json,
and REPORT.md marks the bias-corrected intervals."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from cw_lens.core.bootstrap import (
    BIAS_SE_LIMIT,
    Bootstrap,
    bias_to_se,
    expanded_tail,
    needs_bias_correction,
)
from cw_lens.core.claims import Check, Claim, claims_dict, with_intervals
from cw_lens.core.resampled import per_layer_rows
from cw_lens.reporting.markdown import BIAS_MARK, bias_note, claims_markdown

R, DOCS = 2000, 8
GEOMEAN = "geomean_head_ratio_n2"


def _rows(replicates: np.ndarray, point: float) -> torch.Tensor:
    """A number's values in every row of `Bootstrap.weights`: the replicates, the corpus (the
    point) and `DOCS` leave-one-out values (spread, so the interval is defined)."""
    jack = np.linspace(point - 0.1, point + 0.1, DOCS)
    return torch.tensor(np.concatenate([replicates, [point], jack]), dtype=torch.float64)


def _replicates(shift_in_se: float, seed: int = 0) -> np.ndarray:
    """`R` normal replicates (SD 0.1) whose mean sits `shift_in_se` standard errors above the
    point 1.0."""
    x = np.random.default_rng(seed).normal(0.0, 1.0, R)
    x = (x - x.mean()) / x.std(ddof=1)  # exactly mean 0, SD 1
    return 1.0 + 0.1 * (x + shift_in_se)


def _expanded(replicates: np.ndarray) -> tuple[float, float]:
    tail = expanded_tail(0.95, DOCS)
    low, high = np.quantile(replicates, [tail, 1 - tail])
    return float(low), float(high)


def _check_json(interval, number: str = "x", value: float = 1.0) -> dict:
    claim = Claim("c", "paper", "crit", [Check(number, value, ">", 0.0)])
    return claims_dict(with_intervals([claim], {number: interval}))["c"]["checks"][0]


def test_a_number_whose_replicates_sit_above_its_point_gets_the_bias_corrected_interval():
    reps = _replicates(0.6)
    interval = Bootstrap(R).pair(_rows(reps, 1.0), number="x")
    assert interval.method == "bias_corrected"
    assert interval.bias_to_se == pytest.approx(0.6)
    bias = float(reps.mean()) - 1.0
    low, high = _expanded(reps)
    assert tuple(interval) == pytest.approx((low - 2 * bias, high - 2 * bias))
    check = _check_json(interval)
    assert abs(check["bias_to_se"]) > BIAS_SE_LIMIT
    assert check["bias_to_se"] == pytest.approx(bias_to_se(1.0, reps))
    assert check["interval_method"] == "bias_corrected"
    assert check["interval"] == pytest.approx([low - 2 * bias, high - 2 * bias])
    json.dumps(check, allow_nan=False)  # JSON-ready


def test_an_unbiased_number_keeps_the_expanded_interval():
    for shift in (0.0, 0.2, -0.2):  # at most 0.25 standard errors either way
        reps = _replicates(shift)
        interval = Bootstrap(R).pair(_rows(reps, 1.0), number="x")
        assert interval.method == "expanded", shift
        assert tuple(interval) == pytest.approx(_expanded(reps)), shift
        check = _check_json(interval)
        assert check["interval_method"] == "expanded"
        assert check["bias_to_se"] == pytest.approx(abs(shift), abs=1e-9)
    # below the point counts as much as above it (|bias|)
    below = Bootstrap(R).pair(_rows(_replicates(-0.6), 1.0), number="x")
    assert below.method == "bias_corrected" and below.bias_to_se == pytest.approx(0.6)


def test_a_geometric_mean_is_always_bias_corrected():
    reps = _replicates(0.0)  # no bias in this run: still the biased plug-in's interval
    interval = Bootstrap(R).pair(_rows(reps, 1.0), number=GEOMEAN)
    assert interval.method == "bias_corrected"
    check = _check_json(interval, number=GEOMEAN)
    assert check["interval_method"] == "bias_corrected"
    assert check["bias_to_se"] == pytest.approx(0.0, abs=1e-9)
    assert needs_bias_correction(GEOMEAN, math.nan) and needs_bias_correction(GEOMEAN, 0.0)
    # the caller's `biased` says the same of an unnamed number
    assert Bootstrap(R).pair(_rows(reps, 1.0), biased=True).method == "bias_corrected"


def test_the_rule_reads_bias_over_se_against_the_limit():
    assert BIAS_SE_LIMIT == 0.25
    assert not needs_bias_correction("x", 0.25)  # strictly above the limit
    assert needs_bias_correction("x", 0.26) and needs_bias_correction("x", -0.26)
    assert not needs_bias_correction(None, 0.1) and needs_bias_correction(None, 0.3)
    assert not needs_bias_correction("x", math.nan)  # not computable: not biased


def test_nan_bias_keeps_the_expanded_method_and_nan_intervals_stay_nan():
    boot = Bootstrap(R)
    constant = boot.pair(torch.ones(R + 1 + DOCS, dtype=torch.float64), number="x")
    assert math.isnan(constant.bias_to_se) and constant.method == "expanded"
    assert tuple(constant) == (1.0, 1.0)
    check = _check_json(constant)
    assert check["bias_to_se"] is None and check["interval_method"] == "expanded"
    undefined = boot.pair(torch.full((R + 1 + DOCS,), math.nan, dtype=torch.float64), number="x")
    assert all(math.isnan(v) for v in undefined) and undefined.method == "expanded"
    assert math.isnan(undefined.bias_to_se)
    no_point = _rows(_replicates(0.6), math.nan)  # the number is not measured on the corpus
    assert boot.pair(no_point, number="x").method == "expanded"
    # too many undefined replicates for the bias-corrected interval's tail: NaN, as before
    reps = _rows(_replicates(0.6), 1.0)
    reps[: R // 10] = math.nan
    corrected = boot.pair(reps, number="x")
    assert corrected.method == "bias_corrected" and all(math.isnan(v) for v in corrected)
    assert bias_to_se(1.0, None) != bias_to_se(1.0, None)  # NaN without replicates


def test_each_number_of_a_vector_gets_its_own_method_as_each_layer_does():
    """`Bootstrap.interval` / `judged` of several numbers at once (e.g. one per layer) pick
    the method number by number; `per_layer_rows` records it."""
    biased, plain = _rows(_replicates(0.6), 1.0), _rows(_replicates(0.0, seed=1), 1.0)
    boot = Bootstrap(R)
    bounds, ratio, methods = boot.judged(torch.stack([biased, plain], 1), number="share")
    assert methods == ["bias_corrected", "expanded"]
    assert ratio.tolist() == pytest.approx([0.6, 0.0], abs=1e-9)
    assert bounds[:, 0].tolist() == pytest.approx(list(boot.pair(biased)))
    assert bounds[:, 1].tolist() == pytest.approx(list(boot.pair(plain)))
    assert torch.equal(boot.interval(torch.stack([biased, plain], 1)), bounds)
    rows = per_layer_rows([0, 1], "share", torch.tensor([1.0, 1.0]), bounds, ratio, methods)
    assert [r["interval_method"] for r in rows] == methods
    assert rows[0]["bias_to_se"] == pytest.approx(0.6)
    assert set(rows[0]) == {
        "layer", "number", "value", "low", "high", "bias_to_se", "interval_method",
    }  # fmt: skip
    assert set(per_layer_rows([0], "share", torch.tensor([1.0]), bounds[:, :1])[0]) == {
        "layer", "number", "value", "low", "high",
    }  # fmt: skip


def test_the_check_json_has_the_fields_only_with_an_interval():
    bare = Check("x", 1.0, ">", 0.0).to_dict()
    assert "bias_to_se" not in bare and "interval_method" not in bare  # no bootstrap asked
    plain = _check_json((0.5, 1.5))  # an interval that says nothing of its method
    assert plain["bias_to_se"] is None and plain["interval_method"] is None
    # a bootstrap that gave this number no interval: (nan, nan), method unknown
    claim = Claim("c", "paper", "crit", [Check("y", 1.0, ">", 0.0)])
    interval = Bootstrap(R).pair(_rows(_replicates(0.6), 1.0), number="x")
    [missing] = claims_dict(with_intervals([claim], {"x": interval}))["c"]["checks"]
    assert missing["interval_method"] is None and missing["bias_to_se"] is None
    assert missing["holds"] == "inconclusive"
    assert list(_check_json((0.5, 1.5))) == [
        "number", "value", "op", "threshold", "interval", "bias_to_se", "interval_method", "holds",
    ]  # fmt: skip


def _summary(checks: list[dict]) -> dict:
    return {"claims": {"c": {"paper": "P", "holds": "yes", "checks": checks}}}


def test_report_marks_the_bias_corrected_intervals_and_reads_older_summaries():
    corrected = _check_json(Bootstrap(R).pair(_rows(_replicates(0.6), 1.0), number="x"))
    plain = _check_json(Bootstrap(R).pair(_rows(_replicates(0.0), 1.0), number="z"), number="z")
    summary = _summary([corrected, plain])
    table = claims_markdown(summary)
    assert table.count(BIAS_MARK) == 1 and f"{BIAS_MARK} bias/SE 0.60" in table
    note = bias_note(summary)
    assert note and "0.25" in note[0] and "interval_method" in note[0]
    # a summary written before checks recorded their method: no mark, no note
    old = {k: v for k, v in plain.items() if k not in ("bias_to_se", "interval_method")}
    older = _summary([old, {**old, "number": "w"}])
    assert BIAS_MARK not in claims_markdown(older) and bias_note(older) == []
