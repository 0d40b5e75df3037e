"""Which interval a claim number gets (methods § Intervals): the bias-corrected one when its
plug-in is known to be biased (the geometric means), the expanded one otherwise, whatever the
run's bootstrap bias; each check records its bias/SE and the method used in summary.json, and
REPORT.md marks the bias-corrected intervals and flags a bias/SE above 0.25."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from cw_lens.reproduction.bootstrap import (
    BIAS_SE_LIMIT,
    Bootstrap,
    bias_flagged,
    bias_to_se,
    expanded_tail,
    interval,
    needs_bias_correction,
)
from cw_lens.reproduction.markdown import BIAS_MARK, FLAG_MARK, bias_note, claims_markdown
from cw_lens.reproduction.resampled import per_layer_rows
from cw_lens.reproduction.verdicts import Check, Claim, claims_dict, with_intervals

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


def test_a_number_whose_replicates_sit_above_its_point_keeps_the_expanded_interval():
    """A run's bias/SE is recorded and flagged but does not switch the method (the
    population study measured the switch lowering the coverage of medians and shares)."""
    for shift in (0.6, -0.6, 0.2, 0.0):
        reps = _replicates(shift)
        interval_ = Bootstrap(R).pair(_rows(reps, 1.0), number="x")
        assert interval_.method == "expanded", shift
        assert interval_.bias_to_se == pytest.approx(abs(shift), abs=1e-9), shift
        assert tuple(interval_) == pytest.approx(_expanded(reps)), shift
        check = _check_json(interval_)
        assert check["interval_method"] == "expanded"
        assert check["bias_to_se"] == pytest.approx(bias_to_se(1.0, reps))
        assert bias_flagged(check["bias_to_se"]) == (abs(shift) > BIAS_SE_LIMIT)
        json.dumps(check, allow_nan=False)  # JSON-ready
    # the bias-corrected interval it does not get: twice the bias away from the expanded one
    reps = _replicates(0.6)
    bias = float(reps.mean()) - 1.0
    corrected = interval(torch.as_tensor(_rows(reps, 1.0)), R, 0.95, "bias_corrected").tolist()
    low, high = _expanded(reps)
    assert corrected == pytest.approx([low - 2 * bias, high - 2 * bias])


def test_a_geometric_mean_is_always_bias_corrected():
    reps = _replicates(0.0)  # no bias in this run: still the biased plug-in's interval
    interval = Bootstrap(R).pair(_rows(reps, 1.0), number=GEOMEAN)
    assert interval.method == "bias_corrected"
    check = _check_json(interval, number=GEOMEAN)
    assert check["interval_method"] == "bias_corrected"
    assert check["bias_to_se"] == pytest.approx(0.0, abs=1e-9)
    assert needs_bias_correction(GEOMEAN)
    # the caller's `biased` says the same of an unnamed number
    assert Bootstrap(R).pair(_rows(reps, 1.0), biased=True).method == "bias_corrected"


def test_the_rule_reads_the_name_and_the_flag_reads_bias_over_se_against_the_limit():
    assert BIAS_SE_LIMIT == 0.25
    assert needs_bias_correction("geomean_head_ratio_n4") and not needs_bias_correction("x")
    assert not needs_bias_correction(None) and needs_bias_correction(None, biased=True)
    assert not bias_flagged(0.25)  # strictly above the limit
    assert bias_flagged(0.26) and bias_flagged(-0.26)
    assert not bias_flagged(math.nan) and not bias_flagged(None)  # not computable: no flag


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
    corrected = boot.pair(reps, number=GEOMEAN)
    assert corrected.method == "bias_corrected" and all(math.isnan(v) for v in corrected)
    assert bias_to_se(1.0, None) != bias_to_se(1.0, None)  # NaN without replicates


def test_each_number_of_a_vector_gets_its_own_method_as_each_layer_does():
    """`Bootstrap.interval` / `judged` of several numbers at once (e.g. one per layer) pick
    the method number by number; `per_layer_rows` records it."""
    biased, plain = _rows(_replicates(0.6), 1.0), _rows(_replicates(0.0, seed=1), 1.0)
    boot = Bootstrap(R)
    bounds, ratio, methods = boot.judged(torch.stack([biased, plain], 1), number="share")
    assert methods == ["expanded", "expanded"]  # one rule for one name, whatever the bias
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
    corrected = _check_json(
        Bootstrap(R).pair(_rows(_replicates(0.4), 1.0), number=GEOMEAN), number=GEOMEAN
    )
    flagged = _check_json(Bootstrap(R).pair(_rows(_replicates(0.6), 1.0), number="x"))
    plain = _check_json(Bootstrap(R).pair(_rows(_replicates(0.0), 1.0), number="z"), number="z")
    summary = _summary([corrected, flagged, plain])
    table = claims_markdown(summary)
    assert table.count(BIAS_MARK) == 1 and f"{BIAS_MARK} bias/SE 0.40" in table
    assert table.count(FLAG_MARK) == 1 and f"{FLAG_MARK} bias/SE 0.60" in table
    [note, _] = bias_note(summary)
    assert BIAS_MARK in note and FLAG_MARK in note and "0.25" in note
    assert "interval_method" in note
    assert bias_note(_summary([plain])) == []
    only_flag = bias_note(_summary([flagged, plain]))[0]
    assert FLAG_MARK in only_flag and BIAS_MARK not in only_flag
    # a summary written before checks recorded their method: no mark, no note
    old = {k: v for k, v in plain.items() if k not in ("bias_to_se", "interval_method")}
    older = _summary([old, {**old, "number": "w"}])
    assert BIAS_MARK not in claims_markdown(older) and bias_note(older) == []
