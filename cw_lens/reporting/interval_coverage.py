"""How often the claims' 95% intervals cover, as measured on the embedded model, and what a
run's report says about it.

The coverage study (`benchmarks/coverage.py`, the table in docs/coverage.md) draws `n`
documents from a pool of 256 windows of the embedded model a few hundred times and counts how
often each claim number's shipped interval (the expanded percentile bootstrap; bias-corrected
for the numbers `cw_lens.core.bootstrap.is_biased_plugin` names, the table's `biased_method`)
contains the pool's value. A run also bias-corrects a number whose bootstrap |bias| / SE
exceeds 0.25 in that run (`cw_lens.core.bootstrap.needs_bias_correction`; its check records
`interval_method`). Its results for the shipped methods are committed next to this module
(`interval_coverage.json`, written by `benchmarks/coverage.py --write-package-table`), so a
report can say, for each number, whether its interval was shown to cover at the run's
document count:

- measured coverage `>= 0.93` at the largest studied count `<= n`: nothing to say;
- measured below 0.93: the interval is too narrow at this size, so it cannot decide: the
  check's `yes` or `no` becomes `inconclusive` (`settle_by_coverage`, applied to
  every run of the studied model and corpora) and the report says why;
- a run smaller than the smallest count at which the number's coverage was *certified*
  (measured `>= 0.93`; `certified_from`): the check is `inconclusive` too, and the report
  says from how many documents the interval was certified. A run below every studied count
  (e.g. 2 documents; the smallest studied is 8) is such a run: nothing shows its interval
  covers. The Retriever share, certified only at 256 documents, is inconclusive in any
  smaller run;
- a number the study never measured: coverage not shown.

The measurement is about the embedded model and 256-token windows of `pydoc+stdlib`; a run
on `pydoc` or on other window lengths (the quick preset: 128 tokens of `pydoc`) is told that
the figures come from that related pool; for another model or corpus the report says that the
coverage was not measured for it.

Example:

    >>> from cw_lens.reporting.interval_coverage import coverage_at
    >>> coverage_at("delta_ppl", 32) >= 0.9
    True
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from functools import cache
from pathlib import Path
from typing import Any

TARGET = 0.93
TABLE = Path(__file__).with_name("interval_coverage.json")
STUDIED_MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"  # the embedded model's name in summaries
STUDIED_CORPORA = ("pydoc", "pydoc+stdlib")
STUDIED_POOL = ("pydoc+stdlib", 256)  # the study's pool: windows of this corpus and length


@cache
def measured() -> dict[str, dict[int, float]]:
    """`{number: {document count: coverage}}` of the shipped interval method."""
    rows = json.loads(TABLE.read_text())["rows"]
    out: dict[str, dict[int, float]] = {}
    for row in rows:
        out.setdefault(row["number"], {})[int(row["n"])] = float(row["coverage"])
    return out


def _studied_count(number: str, n_documents: int) -> int | None:
    """The largest studied document count `<= n_documents` for `number` (None if none)."""
    counts = [k for k in measured().get(number, {}) if k <= n_documents]
    return max(counts) if counts else None


def coverage_at(number: str, n_documents: int) -> float | None:
    """The measured coverage of `number`'s interval at the largest studied document count
    `<= n_documents` (more documents only bring the bootstrap closer to its asymptotics),
    or None when none was studied."""
    count = _studied_count(number, n_documents)
    return None if count is None else measured()[number][count]


def certified_from(number: str) -> int | None:
    """The smallest studied document count at which a number's interval was certified.

    Args:
        number: A claim number (`retriever_share`, ...).

    Returns:
        The smallest count whose measured coverage is at least `TARGET`, or None when none
        is (or the number was not studied).

    Examples:
        >>> certified_from("retriever_share")
        256
    """
    counts = [k for k, cover in measured().get(number, {}).items() if cover >= TARGET]
    return min(counts) if counts else None


def below_certified(number: str, n_documents: int) -> bool:
    """Whether a run is smaller than every count at which a number's interval was certified.

    Args:
        number: A claim number.
        n_documents: The run's (the claim's) document count.

    Returns:
        True below `certified_from(number)` (always, for a studied number certified at no
        count); False at or above it, and for a number the study did not measure.

    Examples:
        >>> below_certified("retriever_share", 2), below_certified("retriever_share", 256)
        (True, False)
    """
    if number not in measured():
        return False
    smallest = certified_from(number)
    return smallest is None or n_documents < smallest


def certified_text(number: str) -> str:
    """From how many documents a number's interval was certified, in words.

    Args:
        number: A claim number.

    Returns:
        `"certified (>= 0.93) only from N documents"`, or that it was certified at no
        studied count.

    Examples:
        >>> certified_text("retriever_share")
        'certified (>= 0.93) only from 256 documents'
    """
    smallest = certified_from(number)
    if smallest is None:
        return f"not certified (>= {TARGET}) at any studied document count"
    return f"certified (>= {TARGET}) only from {smallest} documents"


def where_measured(number: str, n_documents: int) -> str:
    """`"at N documents"` for the count `coverage_at` reads (followed by the run's count
    when that is larger)."""
    count = _studied_count(number, n_documents)
    if count is None or count == n_documents:
        return f"at {n_documents} documents"
    return f"at {count} documents, the largest count studied up to this run's {n_documents}"


def studied(summary: dict[str, Any]) -> bool:
    """Whether the coverage study speaks for this run: the embedded model on pydoc text."""
    return summary.get("model") == STUDIED_MODEL and summary.get("corpus") in STUDIED_CORPORA


def _interval_checks(
    summary: dict[str, Any], documents: dict[str, int]
) -> Iterator[tuple[str, dict[str, Any], int, float | None]]:
    """`(claim id, check, document count, measured coverage or None)` for every check with
    an interval (`documents`: each claim's document count, else the run's)."""
    for cid, claim in summary["claims"].items():
        n = documents.get(cid, summary["n_documents"])
        for check in claim.get("checks", []):
            if check.get("interval") is not None:
                yield cid, check, n, coverage_at(check["number"], n)


def settle_by_coverage(summary: dict[str, Any], documents: dict[str, int]) -> list[str]:
    """Make every decisive check (`yes` / `no`) whose interval was measured to cover less
    than `TARGET` at the claim's document count (`documents`) `inconclusive` — an
    interval that misses the truth that often cannot settle a criterion — recording
    `coverage` and `undecided_because` in the check, and recombine the claims' verdicts
    (`cw_lens.core.claims.combine`). Changes `summary["claims"]` in place; returns
    the changed claims. Runs the study does not speak for are left as they are (their report
    says that the coverage was not measured)."""
    from cw_lens.core.claims import combine

    if not studied(summary):
        return []
    for _, check, n, cover in _interval_checks(summary, documents):
        if check.get("holds") not in ("yes", "no"):
            continue
        if cover is not None and cover < TARGET:
            check["undecided_because"] = (
                f"was {check['holds']}, but its interval covers {cover:.2f} (below {TARGET}) "
                f"{where_measured(check['number'], n)} (docs/coverage.md)"
            )
            check["coverage"] = round(cover, 3)
            check["holds"] = "inconclusive"
        elif below_certified(check["number"], n):
            check["undecided_because"] = (
                f"was {check['holds']}, but its interval's coverage was "
                f"{certified_text(check['number'])}; this run has {n} (docs/coverage.md)"
            )
            check["holds"] = "inconclusive"
    changed = []
    for cid, claim in summary["claims"].items():
        checks = claim.get("checks", [])
        verdict = combine(c["holds"] for c in checks) if checks else claim["holds"]
        if verdict != claim["holds"]:
            claim["holds"] = verdict
            changed.append(cid)
    return changed


def coverage_limits(summary: dict[str, Any], documents: dict[str, int]) -> list[str]:
    """REPORT.md lines on the claim numbers whose interval was not shown to cover at the run's
    size (`documents`: each claim's document count); none when all were."""
    if not studied(summary):
        return [
            "- Every interval: the coverage study (docs/coverage.md) measured the embedded "
            "model on pydoc+stdlib only; for this model or corpus the intervals' coverage is "
            "not measured, so the verdicts are indicative."
        ]
    short: list[str] = []
    below: list[str] = []
    unmeasured: dict[str, list[str]] = {}
    for cid, check, n, cover in _interval_checks(summary, documents):
        if cover is not None and cover < TARGET:
            where = where_measured(check["number"], n)
            short.append(f"`{cid}`: {check['number']} covers {cover:.2f} {where}")
        elif below_certified(check["number"], n):
            below.append(
                f"`{cid}` at {n} documents ({check['number']}: {certified_text(check['number'])})"
            )
        elif cover is None:
            unmeasured.setdefault(f"`{cid}` at {n} documents", []).append(check["number"])
    lines = []
    if (summary.get("corpus"), summary.get("max_tokens")) != STUDIED_POOL:
        lines.append(
            f"- The coverage figures below were measured on windows of {STUDIED_POOL[1]} tokens "
            f"of {STUDIED_POOL[0]} (docs/coverage.md); this run reads windows of "
            f"{summary.get('max_tokens')} tokens of {summary.get('corpus')}, a related pool: "
            "they describe its intervals approximately."
        )
    if short:
        lines.append(
            f"- Intervals shown to cover less than {TARGET} at this size (docs/coverage.md), so "
            "too narrow to decide: their checks are inconclusive whatever the numbers: "
            + "; ".join(short)
            + "."
        )
    if below:
        lines.append(
            "- Intervals whose coverage was certified only at more documents than this run has "
            "(docs/coverage.md), so their checks are inconclusive whatever the numbers: "
            + "; ".join(below)
            + "."
        )
    if unmeasured:
        lines.append(
            "- Intervals whose coverage was not measured at this size (docs/coverage.md): "
            + "; ".join(f"{k} ({', '.join(v)})" for k, v in unmeasured.items())
            + "."
        )
    return lines
