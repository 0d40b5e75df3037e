"""How often the claims' 95% intervals cover, as measured on the embedded model, and what a
run's report says about it.

The table next to this module (`interval_coverage.json`, written by
`python benchmarks/population.py package-table`; docs/coverage.md) gives, per claim number and
studied document count, how often the number's shipped interval (the expanded percentile
bootstrap; bias-corrected for the numbers `cw_lens.reproduction.bootstrap.is_biased_plugin` names,
the table's `biased_method`) contained the true value, and the coverage's one-sided
Clopper-Pearson lower 95% bound (`lower`). Each row's `source` says which study measured it
(`population`: runs drawn from a population of windows; `single_pool`: draws with replacement
from one pool, for the numbers the population cannot give); docs/coverage.md describes both
studies, their sizes and their results.

The interval method never depends on the run: a run's bootstrap |bias| / SE is recorded (each
check's `bias_to_se`) and flagged above 0.25 (`cw_lens.reproduction.bootstrap.bias_flagged`), not
acted on (`cw_lens.reproduction.bootstrap.needs_bias_correction` reads only the number's name).

A row *certifies* (`certifies`) when its coverage is at least `TARGET` (0.93) and its lower bound
at least `LOWER_TARGET` (0.91). A number is certified from the smallest studied count from which
it and every larger studied count certify (`smallest_certified`, `certified_from`): a count that
certifies below one that does not counts for nothing. In a run the study speaks for (`studied`:
the embedded model on pydoc text), a check with an interval on `n` documents is:

- judged on its interval when `n` is at least the number's `certified_from`: nothing to say;
- otherwise `inconclusive` (`settle_by_coverage`, its `yes` or `no` kept as
  `undecided_because`), and the report says why: the coverage and bound of the row at the
  largest studied count `<= n` when that row does not certify (`certified_at` is False), else
  from how many documents the number was certified (`below_certified`: a run smaller than every
  studied count, e.g. 2 documents, the smallest studied being 8). The sink-tail cosine,
  certified only from 256 documents, is inconclusive in any smaller run, and so is the median
  cancelled share;
- for a number no study measured: `inconclusive` in the main job (`never_studied_because`),
  while `cw-lens compare` judges it on its interval, its coverage not shown.

The numbers of the comparison with other tools (`contribution_vs_field_*`) were studied on the
field preset's own sample (`OWN_SAMPLE_POOLS`, `study_pool`): its windows and its task items.

For another model or corpus only the floor applies: a check on fewer than `smallest_studied`
(8) documents is inconclusive, and the report says the coverage was not measured for that run.
The measurement is about 256-token windows of `pydoc+stdlib`; a run on `pydoc` or on other
window lengths (the quick preset: 128 tokens of `pydoc`) is told that the figures come from
that related pool.

Example:

    >>> from cw_lens.reproduction.interval_coverage import certified_from, coverage_at
    >>> coverage_at("delta_ppl", 32) >= 0.9
    True
    >>> [certified_from(k) for k in ("retriever_share", "median_cos_sink_tail_mixture")]
    [8, 256]
    >>> certified_from("median_cancelled_share")
    256
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from functools import cache
from pathlib import Path
from typing import Any

TARGET = 0.93
TABLE = Path(__file__).with_name("interval_coverage.json")
STUDIED_MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"  # the embedded model's name in summaries
STUDIED_CORPORA = ("pydoc", "pydoc+stdlib")
STUDIED_POOL = ("pydoc+stdlib", 256)  # the study's pool: windows of this corpus and length
# the comparison with other tools was studied on the field preset's own sample (its `analysis`
# in the table): 16 windows of 128 tokens of pydoc, and task items, which no window describes
OWN_SAMPLE_POOLS: dict[str, tuple[str, int] | None] = {
    "field_pairs": ("pydoc", 128),
    "field_inputs_ioi": None,
    "field_inputs_arithmetic": None,
}


LOWER_TARGET = 0.91  # the coverage's lower 95% bound a certificate needs besides TARGET


@cache
def _rows() -> dict[str, dict[int, dict[str, Any]]]:
    """`{number: {document count: row of the table}}` of the shipped interval method."""
    out: dict[str, dict[int, dict[str, Any]]] = {}
    for row in json.loads(TABLE.read_text())["rows"]:
        out.setdefault(row["number"], {})[int(row["n"])] = row
    return out


def measured() -> dict[str, dict[int, float]]:
    """`{number: {document count: coverage}}` of the shipped interval method."""
    return {k: {n: float(r["coverage"]) for n, r in v.items()} for k, v in _rows().items()}


def _studied_count(number: str, n_documents: int) -> int | None:
    """The largest studied document count `<= n_documents` for `number` (None if none)."""
    counts = [k for k in _rows().get(number, {}) if k <= n_documents]
    return max(counts) if counts else None


def study_pool(number: str) -> tuple[str, int] | None:
    """The windows a studied number's coverage was measured on.

    Args:
        number: A claim number the table has.

    Returns:
        `(corpus, window length)`, or None for a number that resamples task items.

    Examples:
        >>> study_pool("delta_ppl")
        ('pydoc+stdlib', 256)
    """
    analysis = next(iter(_rows()[number].values()))["analysis"]
    return OWN_SAMPLE_POOLS.get(analysis, STUDIED_POOL)


def coverage_at(number: str, n_documents: int) -> float | None:
    """The measured coverage of `number`'s interval at the largest studied document count
    `<= n_documents` (more documents only bring the bootstrap closer to its asymptotics),
    or None when none was studied."""
    count = _studied_count(number, n_documents)
    return None if count is None else float(_rows()[number][count]["coverage"])


def certifies(coverage: float, lower: float) -> bool:
    """The certificate of one document count (docs/coverage.md#the-population): the coverage
    and its lower bound.

    Args:
        coverage: The interval's measured coverage at that count.
        lower: The coverage's one-sided lower 95% bound.

    Returns:
        True when the coverage is at least `TARGET` and the bound at least `LOWER_TARGET`.

    Examples:
        >>> certifies(0.94, 0.915), certifies(0.932, 0.908)
        (True, False)
    """
    return coverage >= TARGET and lower >= LOWER_TARGET


def smallest_certified(certified_by_count: dict[int, bool]) -> int | None:
    """The smallest document count from which every larger studied count certifies too.

    A count that certifies below one that does not certifies nothing: a run of 8 documents
    would otherwise be trusted more than one of 32.

    Args:
        certified_by_count: Whether each studied document count certifies.

    Returns:
        That count, or None when even the largest does not certify (or none was studied).

    Examples:
        >>> smallest_certified({8: True, 32: False, 256: True})
        256
        >>> smallest_certified({8: True, 32: True}), smallest_certified({8: True, 32: False})
        (8, None)
    """
    out = None
    for n in sorted(certified_by_count, reverse=True):
        if not certified_by_count[n]:
            break
        out = n
    return out


def _certified(row: dict[str, Any]) -> bool:
    """A row of the table's certificate (`certifies`)."""
    return certifies(float(row["coverage"]), float(row["lower"]))


def certified_at(number: str, n_documents: int) -> bool | None:
    """Whether a number's interval was certified at the largest studied count up to a run's.

    Args:
        number: A claim number.
        n_documents: The run's (the claim's) document count.

    Returns:
        Whether the row at the largest studied count `<= n_documents` certifies (coverage
        `>= TARGET`, lower bound `>= LOWER_TARGET`); None when no count was studied.

    Examples:
        >>> certified_at("median_cos_sink_tail_mixture", 100), certified_at("delta_ppl", 2)
        (False, None)
    """
    count = _studied_count(number, n_documents)
    return None if count is None else _certified(_rows()[number][count])


def certified_from(number: str) -> int | None:
    """The smallest studied document count from which a number's interval was certified.

    Args:
        number: A claim number (`retriever_share`, ...).

    Returns:
        The smallest count `n` such that the coverage at `n` and at every larger studied
        count is at least `TARGET` with a lower 95% bound of at least `LOWER_TARGET`, or None
        when even the largest is not certified (or the number was not studied).

    Examples:
        >>> certified_from("retriever_share"), certified_from("geomean_head_ratio_n2")
        (8, 256)
        >>> certified_from("no_such_number") is None
        True
    """
    rows = _rows().get(number, {})
    return smallest_certified({n: _certified(row) for n, row in rows.items()})


def below_certified(number: str, n_documents: int) -> bool:
    """Whether a run is smaller than every count at which a number's interval was certified.

    Args:
        number: A claim number.
        n_documents: The run's (the claim's) document count.

    Returns:
        True below `certified_from(number)` (always, for a studied number certified at no
        count); False at or above it, and for a number the study did not measure.

    Examples:
        >>> below_certified("retriever_share", 2), below_certified("retriever_share", 8)
        (True, False)
    """
    if number not in _rows():
        return False
    smallest = certified_from(number)
    return smallest is None or n_documents < smallest


def not_certified_because(number: str, n_documents: int, *, studied_run: bool = True) -> str | None:
    """Why a number's interval is not certified at a run's document count, in words.

    For a run the study speaks for (`studied`), the two ways an interval stays uncertified
    (docs/methods.md#verdicts): the studied row at the largest count up to the run's falls short
    (`certified_at` is False), or the run is smaller than the smallest count from which the
    number was certified (`below_certified`). For any other run, only a run smaller than
    every studied count (`smallest_studied`): no study shows an interval covers there.

    Args:
        number: A claim number.
        n_documents: The run's (the claim's) document count.
        studied_run: Whether the coverage study speaks for the run (`studied`).

    Returns:
        The reason, or None when the interval is certified at that count, the study did not
        measure the number (`never_studied_because` says why the main job still leaves it
        undecided), or (for another model or corpus) the run is large enough.

    Examples:
        >>> not_certified_because("median_cos_sink_tail_mixture", 32)[:57]
        'its interval has coverage 0.855 at this size (32 document'
        >>> not_certified_because("retriever_share", 8) is None
        True
    """
    if not studied_run:
        fewest = smallest_studied()
        if n_documents >= fewest:
            return None
        return (
            f"no interval's coverage was studied at fewer than {fewest} documents, on any "
            f"model; this run has {n_documents}"
        )
    if number not in _rows():
        return None
    if certified_at(number, n_documents) is False:
        return (
            f"its interval has {coverage_text(number, n_documents)}, short of a certificate "
            f"(coverage >= {TARGET}, lower bound >= {LOWER_TARGET})"
        )
    if below_certified(number, n_documents):
        return f"its interval's coverage was {certified_text(number)}; this run has {n_documents}"
    return None


def never_studied_because(number: str) -> str | None:
    """Why the main job leaves a check undecided whose number no coverage study measured.

    Args:
        number: A claim number.

    Returns:
        The reason, or None when the number was studied (`not_certified_because` decides).

    Examples:
        >>> never_studied_because("retriever_share") is None
        True
    """
    if number in _rows():
        return None
    return "its interval's coverage was never studied, on any model or size"


def certified_text(number: str) -> str:
    """From how many documents a number's interval was certified, in words.

    Args:
        number: A claim number.

    Returns:
        `"certified (coverage >= 0.93, lower bound >= 0.91) only from N documents"`, or that
        it was certified at no studied count.

    Examples:
        >>> certified_text("median_cos_sink_tail_mixture")
        'certified (coverage >= 0.93, lower bound >= 0.91) only from 256 documents'
    """
    smallest = certified_from(number)
    rule = f"coverage >= {TARGET}, lower bound >= {LOWER_TARGET}"
    if smallest is None:
        return f"not certified ({rule}) at any studied document count"
    return f"certified ({rule}) only from {smallest} documents"


def coverage_text(number: str, n_documents: int) -> str:
    """What the studied row `coverage_at` reads says, in words: the interval's coverage (how
    often it contained the true value), never "covers 0.905", which reads as if the interval
    contained 0.905.

    Args:
        number: A claim number the study measured.
        n_documents: The run's (the claim's) document count (at least the smallest studied).

    Returns:
        `"coverage 0.905 at this size (8 documents; lower 95% bound 0.886)"`, or, for a count
        between two studied ones, the studied count it was measured at.

    Examples:
        >>> coverage_text("median_cos_sink_tail_mixture", 8)
        'coverage 0.905 at this size (8 documents; lower 95% bound 0.886)'
        >>> coverage_text("median_cos_sink_tail_mixture", 100)[:60]
        'coverage 0.855 at 32 documents, the largest count studied up'
    """
    count = _studied_count(number, n_documents)
    row = _rows()[number][count]
    coverage, bound = f"coverage {float(row['coverage']):.3f}", f"{float(row['lower']):.3f}"
    if count == n_documents:
        return f"{coverage} at this size ({n_documents} documents; lower 95% bound {bound})"
    return f"{coverage} {where_measured(number, n_documents)} (lower 95% bound {bound})"


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


def smallest_studied() -> int:
    """The fewest documents at which any interval's coverage was studied.

    Below it no study shows that an interval covers, on any model.

    Returns:
        The smallest document count of the coverage table (8).

    Examples:
        >>> smallest_studied()
        8
    """
    return min(n for counts in _rows().values() for n in counts)


def settle_by_coverage(summary: dict[str, Any], documents: dict[str, int]) -> list[str]:
    """Make every decisive check (`yes` / `no`) whose interval is not certified at the
    claim's document count (`documents`) `inconclusive` — an interval not shown to cover
    cannot settle a criterion — recording `undecided_because` (and `coverage`, where
    measured) in the check, and recombine the claims' verdicts
    (`cw_lens.reproduction.verdicts.combine`). Changes `summary["claims"]` in place; returns the
    changed claims. For a run the study does not speak for (another model or corpus), only
    the checks run on fewer documents than `smallest_studied` are made inconclusive; its
    report says that the coverage was not measured for it."""
    from cw_lens.reproduction.verdicts import combine

    speaks = studied(summary)
    for _, check, n, cover in _interval_checks(summary, documents):
        if check.get("holds") not in ("yes", "no"):
            continue
        why = never_studied_because(check["number"]) or not_certified_because(
            check["number"], n, studied_run=speaks
        )
        if why is None:
            continue
        check["undecided_because"] = f"was {check['holds']}, but {why} (docs/coverage.md)"
        if speaks and certified_at(check["number"], n) is False:  # the studied row's figure
            check["coverage"] = round(cover, 3)
        check["holds"] = "inconclusive"
    changed = []
    for cid, claim in summary["claims"].items():
        checks = claim.get("checks", [])
        verdict = combine(c["holds"] for c in checks) if checks else claim["holds"]
        if verdict != claim["holds"]:
            claim["holds"] = verdict
            changed.append(cid)
    return changed


def never_studied_line(summary: dict[str, Any]) -> list[str]:
    """REPORT.md's line on the claims whose numbers' coverage no study measured (none: no line).

    Args:
        summary: A run's `summary.json` content.

    Returns:
        One Markdown list item naming those claims, or nothing.
    """
    claims = [
        f"`{cid}`"
        for cid, claim in summary["claims"].items()
        if any(
            c.get("interval") is not None and never_studied_because(c["number"])
            for c in claim.get("checks", [])
        )
    ]
    if not claims:
        return []
    return [
        "- Intervals whose coverage no study has measured (docs/coverage.md), so their checks "
        "are inconclusive whatever the numbers: " + ", ".join(claims) + "."
    ]


def coverage_limits(
    summary: dict[str, Any],
    documents: dict[str, int],
    name: Callable[[str], str] = str,
) -> list[str]:
    """REPORT.md lines on the claim numbers whose interval was not shown to cover at the run's
    size.

    Args:
        summary: A run's `summary.json` content.
        documents: Each claim's document count.
        name: A number's name in the lines (default: its key).

    Returns:
        One Markdown list item per kind of limit; none when every interval was certified.
    """
    if not studied(summary):
        few = sorted(
            {
                f"`{cid}` at {n}"
                for cid, _, n, _ in _interval_checks(summary, documents)
                if n < smallest_studied()
            }
        )
        return (
            never_studied_line(summary)
            + [
                "- Every interval: the coverage study (docs/coverage.md) measured the embedded "
                "model on pydoc+stdlib only; for this model or corpus the intervals' coverage is "
                "not measured, so the verdicts are indicative."
            ]
            + (
                [
                    f"- Checks run on fewer than {smallest_studied()} documents, where no study "
                    "shows an interval covers, are inconclusive: " + "; ".join(few) + "."
                ]
                if few
                else []
            )
        )
    short: list[str] = []
    below: list[str] = []
    unmeasured: dict[str, list[str]] = {}
    for cid, check, n, cover in _interval_checks(summary, documents):
        if never_studied_because(check["number"]):
            continue  # `never_studied_line` names it
        if cover is not None and not certified_at(check["number"], n):
            number = check["number"]
            short.append(f"`{cid}`: {name(number)}, {coverage_text(number, n)}")
        elif below_certified(check["number"], n):
            below.append(
                f"`{cid}` at {n} documents "
                f"({name(check['number'])}: {certified_text(check['number'])})"
            )
        elif cover is None:
            unmeasured.setdefault(f"`{cid}` at {n} documents", []).append(name(check["number"]))
    lines = never_studied_line(summary)
    pools = {
        study_pool(check["number"])
        for _, check, _, _ in _interval_checks(summary, documents)
        if not never_studied_because(check["number"])
    }
    run_pool = (summary.get("corpus"), summary.get("max_tokens"))
    for corpus, length in sorted(p for p in pools if p is not None and p != run_pool):
        lines.append(
            f"- The coverage figures below were measured on windows of {length} tokens "
            f"of {corpus} (docs/coverage.md); this run reads windows of "
            f"{summary.get('max_tokens')} tokens of {summary.get('corpus')}, a related pool: "
            "they describe its intervals approximately."
        )
    if short:
        lines.append(
            f"- Intervals not certified at this size (coverage >= {TARGET} with a lower 95% "
            f"bound >= {LOWER_TARGET}; docs/coverage.md), so they cannot decide: their checks "
            "are inconclusive whatever the numbers: " + "; ".join(short) + "."
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
