"""`compare` tests differences between runs from their bootstrap replicates: constructed runs
whose true difference is known (zero and planted), paired and independent, written through the
real path (Bootstrap.pair -> with_intervals -> claims_dict -> replicates.npz -> compare_runs)."""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from cw_lens.core.errors import InputError
from cw_lens.reproduction.bootstrap import Bootstrap
from cw_lens.reproduction.run_comparison import compare_runs
from cw_lens.reproduction.run_replicates import (
    DIFFER,
    FILE,
    NOT_COMPARABLE,
    SAME,
    difference_test,
    pack,
)
from cw_lens.reproduction.verdicts import Check, Claim, claims_dict, with_intervals

FIGURES = Path(__file__).resolve().parents[1] / "figures"


def docs(prefix: str, n: int) -> list[str]:
    return [f"{prefix}{i:015d}" for i in range(n)]


def with_mean_and_sd(mean: float, sd: float, n: int, seed: int) -> np.ndarray:
    """``n`` per-document values with exactly this mean and standard deviation."""
    z = np.random.default_rng(seed).standard_normal(n)
    return mean + sd * (z - z.mean()) / z.std()


def run_of(per_doc: dict[str, np.ndarray], documents: list[str], *, seed=0, check=(">", 0.0)):
    """A run's claim ``c`` — one check ``number op threshold`` per entry, the number being the
    mean over documents — its replicates file and summary, as the job builds them."""
    boot = Bootstrap(resamples=2000, seed=seed)
    checks, intervals = [], {}
    for number, values in per_doc.items():
        x = torch.as_tensor(values, dtype=torch.float64)
        reps = boot.resample(x[:, None])[:, 0] / len(x)
        checks.append(Check(number, float(x.mean()), *check))
        intervals[number] = boot.pair(reps)
    claims = claims_dict(with_intervals([Claim("c", "paper", "crit", checks)], intervals))
    npz = pack(claims.replicates, documents, {"c": len(documents)}, boot.to_dict())
    summary = {
        "schema": 3,
        "model": "m",
        "claims": dict(claims),
        "replicates": {"file": FILE, "sha256": hashlib.sha256(npz).hexdigest()},
    }
    return summary, npz


def write(folder: Path, summary: dict, npz: bytes | None) -> Path:
    folder.mkdir(parents=True)
    (folder / "summary.json").write_text(json.dumps(summary).replace("NaN", "null"))
    if npz is not None:
        (folder / FILE).write_bytes(npz)
    return folder


def compared(tmp_path, a, b, labels=("a", "b")):
    paths = [write(tmp_path / lab, *run) for lab, run in zip(labels, (a, b), strict=True)]
    return compare_runs(paths)


# --------------------------------------------------------------------------- known differences


def test_two_seeds_of_the_same_population_are_not_flagged(tmp_path):
    """Two runs on different documents drawn from one population (true difference 0)."""
    a = run_of({"x": with_mean_and_sd(1.0, 1.0, 48, seed=1)}, docs("a", 48))
    b = run_of({"x": with_mean_and_sd(1.05, 1.0, 48, seed=2)}, docs("b", 48))
    table = compared(tmp_path, a, b).differences()
    row = table.iloc[0]
    assert (row["result"], bool(row["paired"])) == (SAME, False)
    assert row["difference"] == pytest.approx(0.05) and row["low"] < 0 < row["high"]
    assert compared(tmp_path / "again", a, b).disagreements().empty


def test_a_planted_difference_is_flagged(tmp_path):
    a = run_of({"x": with_mean_and_sd(1.0, 1.0, 48, seed=1)}, docs("a", 48))
    b = run_of({"x": with_mean_and_sd(2.0, 1.0, 48, seed=2)}, docs("b", 48))
    comparison = compared(tmp_path, a, b)
    row = comparison.differences().iloc[0]
    assert row["result"] == DIFFER and 0 < row["low"] < 1.0 < row["high"]
    assert comparison.disagreements()["number"].tolist() == ["x"]
    assert "**differ**" in comparison.to_markdown()


def test_pairing_on_shared_documents_finds_what_independent_resamples_cannot(tmp_path):
    """Same documents, run b = run a + 0.05 per document + noise sd 0.02: the per-document
    spread (sd 1) cancels in the paired difference, not in independent resamples."""
    x = with_mean_and_sd(1.0, 1.0, 32, seed=3)
    noise = with_mean_and_sd(0.0, 0.02, 32, seed=4)
    shared = docs("s", 32)
    a = run_of({"x": x}, shared)
    paired = compared(tmp_path / "p", a, run_of({"x": x + 0.05 + noise}, shared))
    row = paired.differences().iloc[0]
    assert bool(row["paired"]) and row["result"] == DIFFER
    assert row["high"] - row["low"] < 0.05
    # the same values resampled with another bootstrap seed: not paired, the spread swamps it
    other_seed = compared(tmp_path / "u", a, run_of({"x": x + 0.05 + noise}, shared, seed=9))
    row = other_seed.differences().iloc[0]
    assert (bool(row["paired"]), row["result"]) == (False, SAME)
    # paired, true difference zero: not flagged
    zero = compared(tmp_path / "z", a, run_of({"x": x + noise}, shared))
    row = zero.differences().iloc[0]
    assert bool(row["paired"]) and row["result"] == SAME


@pytest.mark.parametrize("paired", [False, True])
def test_false_alarms_and_power_over_many_constructed_pairs(paired):
    """40 pairs with true difference 0 and 40 with a planted one (4 standard errors): the test
    flags at most 6 of the first (nominal 2) and at least 38 of the second."""
    n = 24
    w_a = Bootstrap(resamples=2000, seed=0).weights(n).numpy() / n
    w_b = w_a if paired else Bootstrap(resamples=2000, seed=1).weights(n).numpy() / n
    flagged = {0.0: 0, 1.0: 0}
    for i in range(40):
        x = with_mean_and_sd(0.0, 1.0, n, seed=100 + i)
        for delta in flagged:
            if paired:  # the same documents: y differs from x by delta + small noise
                y = x + delta * 0.2 + np.random.default_rng(i).normal(0, 0.25, n)
            else:
                y = np.random.default_rng(500 + i).standard_normal(n) + delta * 1.2
            test = difference_test(x.mean(), w_a @ x, y.mean(), w_b @ y, paired=paired, seed=i)
            flagged[delta] += test.result == DIFFER
    assert flagged[0.0] <= 6, flagged
    assert flagged[1.0] >= 38, flagged


# --------------------------------------------------------------------------- the cases


def test_a_number_without_replicates_is_not_comparable_whatever_the_verdicts(tmp_path):
    """0.06 [0.04, 0.09] against 0.10 with no interval: the verdicts differ (< 0.1: yes / no),
    but there is nothing to test the difference with."""
    a = run_of({"x": with_mean_and_sd(0.06, 0.036, 8, seed=5)}, docs("a", 8), check=("<", 0.1))
    low, high = a[0]["claims"]["c"]["checks"][0]["interval"]
    assert 0.03 < low < 0.05 and 0.08 < high < 0.095
    old = {
        "schema": 2,
        "claims": {
            "c": {
                "holds": "no",
                "paper": "p",
                "checks": [
                    {"number": "x", "value": 0.1, "op": "<", "threshold": 0.1, "interval": None}
                    | {"holds": "no"}
                ],
            }
        },
    }
    comparison = compared(tmp_path, a, (old, None))
    row = comparison.differences().iloc[0]
    assert row["result"] == NOT_COMPARABLE and "schema 1 or 2" in row["reason"]
    assert comparison.disagreements().empty
    assert comparison.claim_verdicts().loc["c"].tolist() == ["yes", "no"]


def test_a_real_difference_with_equal_verdicts_is_flagged(tmp_path):
    """4.84 (its 95% interval about [3.8, 5.9] at 8 documents, expanded percentile) against 3.5:
    both inside [3, 10] (verdicts equal), yet different when 3.5's own interval is narrow — and
    not when it is wide."""
    a = run_of({"x": with_mean_and_sd(4.84, 1.07, 8, seed=6)}, docs("a", 8))
    low, high = a[0]["claims"]["c"]["checks"][0]["interval"]
    assert 3.6 < low < 4.4 and 5.3 < high < 6.1
    narrow = run_of({"x": with_mean_and_sd(3.5, 0.42, 8, seed=7)}, docs("b", 8))
    row = compared(tmp_path / "n", a, narrow).differences().iloc[0]
    assert row["result"] == DIFFER and row["difference"] == pytest.approx(-1.34)
    wide = run_of({"x": with_mean_and_sd(3.5, 4.0, 8, seed=7)}, docs("b", 8))
    assert compared(tmp_path / "w", a, wide).differences().iloc[0]["result"] == SAME


def test_not_measured_is_not_comparable(tmp_path):
    a = run_of({"x": with_mean_and_sd(1.0, 1.0, 8, seed=1)}, docs("a", 8))
    b = run_of({"x": np.full(8, math.nan)}, docs("b", 8))
    row = compared(tmp_path, a, b).differences().iloc[0]
    assert row["result"] == NOT_COMPARABLE and row["reason"] == "not measured in b"


# --------------------------------------------------------------------------- the files


def test_replicates_of_another_run_are_refused_and_a_missing_file_is_said(tmp_path):
    a = run_of({"x": with_mean_and_sd(1.0, 1.0, 8, seed=1)}, docs("a", 8))
    b = run_of({"x": with_mean_and_sd(1.0, 1.0, 8, seed=2)}, docs("b", 8))
    swapped = (b[0], a[1])  # b's summary beside a's replicates
    with pytest.raises(InputError, match="does not belong to the summary"):
        compared(tmp_path / "s", a, swapped)
    row = compared(tmp_path / "m", a, (b[0], None)).differences().iloc[0]
    assert row["result"] == NOT_COMPARABLE and "replicates.npz is missing" in row["reason"]


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.floats(-5, 5), min_size=50, max_size=50),
    st.lists(st.floats(-5, 5), min_size=50, max_size=50),
)
def test_swapping_the_runs_flips_the_difference_and_keeps_the_result(a, b):
    a, b = np.array(a), np.array(b)
    forward = difference_test(a.mean(), a, b.mean(), b, paired=True)
    backward = difference_test(b.mean(), b, a.mean(), a, paired=True)
    assert backward.value == pytest.approx(-forward.value, abs=1e-9)
    assert (backward.low, backward.high) == pytest.approx((-forward.high, -forward.low), abs=1e-9)
    assert backward.result == forward.result
    hull = (min(forward.low, forward.value), max(forward.high, forward.value))
    assert (forward.result == DIFFER) == (hull[0] > 0 or hull[1] < 0)
