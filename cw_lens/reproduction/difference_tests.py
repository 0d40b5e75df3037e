"""Whether several runs differ: each headline number of each run tested against the first run's.

The test of one number is a bootstrap of the difference from the replicates the two runs kept
(`cw_lens.reproduction.run_replicates.difference_test`): paired when both runs resampled the same
documents, independent otherwise. A number is `"not comparable"` when it is missing or not measured,
a run kept no replicates, its interval is not certified at a run's document count
(`cw_lens.reproduction.interval_coverage`), or it is biased and the runs' document counts differ;
the known-biased plug-ins are compared from bias-corrected replicates. The p-values of all the
comparable numbers are adjusted together by Holm's step-down method (`holm_results`).
`cw_lens.reproduction.run_comparison` explains the design; this module holds the tests.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any, Protocol

import pandas as pd

from cw_lens.reproduction.bootstrap import (
    BIAS_SE_LIMIT,
    bias_flagged,
    bias_to_se,
    is_biased_plugin,
)
from cw_lens.reproduction.interval_coverage import not_certified_because, studied
from cw_lens.reproduction.run_replicates import (
    DIFFER,
    NOT_COMPARABLE,
    SAME,
    Difference,
    RunReplicates,
    bias_corrected,
    difference_test,
    holm,
)


class RunHeader(Protocol):
    """What the tests read of a run: a `cw_lens.reproduction.run_comparison.Run`."""

    label: str
    model: str | None
    corpus: str | None
    n_documents: int | None
    replicates: RunReplicates | None
    no_replicates: str


DIFFERENCE_COLUMNS = [
    "claim",
    "number",
    "run",
    "reference",
    "value",
    "reference_value",
    "difference",
    "low",
    "high",
    "paired",
    "p_value",
    "p_holm",
    "bias_corrected",
    "result",
    "reason",
]
FAMILY_LEVEL = 0.05  # the family-wise error Holm's adjustment holds a comparison to


def run_differences(runs: list[RunHeader], rows: pd.DataFrame) -> pd.DataFrame:
    """[`RunComparisonResult.differences`][cw_lens.RunComparisonResult.differences]: each run's
    numbers against the first run's."""
    reference, out = runs[0], []
    checks = rows[rows["number"] != ""]
    mine = checks[checks["run"] == reference.label]
    ref = dict(zip(zip(mine["claim"], mine["number"], strict=True), mine["value"], strict=True))
    for run in runs[1:]:
        theirs = checks[checks["run"] == run.label]
        for claim, number, value in zip(
            theirs["claim"], theirs["number"], theirs["value"], strict=True
        ):
            in_reference = (claim, number) in ref
            ref_value = ref.get((claim, number), math.nan)
            test = _test(reference, run, claim, number, ref_value, value)
            out.append(
                {
                    "claim": claim,
                    "number": number,
                    "run": run.label,
                    "reference": reference.label,
                    "value": value,
                    "reference_value": ref_value,
                    "difference": test.value,
                    "low": test.low,
                    "high": test.high,
                    "paired": test.paired,
                    "p_value": test.p_value,
                    "bias_corrected": test.bias_corrected,
                    "result": test.result,
                    "reason": test.reason if in_reference else "not in the reference run",
                }
            )
    table = pd.DataFrame(out, columns=DIFFERENCE_COLUMNS)
    return holm_results(table)


def holm_results(table: pd.DataFrame, level: float = FAMILY_LEVEL) -> pd.DataFrame:
    """Decide each comparable number's result by Holm's adjustment over all of them.

    Args:
        table: A differences table (`p_value`, `result`, `reason` per number; `result`
            `"not comparable"` rows are left out of the family and left as they are).
        level: The family-wise error to hold (0.05).

    Returns:
        A copy with `p_holm` (`cw_lens.reproduction.run_replicates.holm` of the comparable p-values)
        and `result` `"differ"` where `p_holm < level`, else `"same within uncertainty"`;
        the reason names the adjustment (and, for a number whose own interval excludes 0
        but whose adjusted p-value does not pass, says so).

    Examples:
        >>> import pandas as pd
        >>> table = pd.DataFrame({"p_value": [0.01, 0.06], "result": ["differ"] * 2,
        ...                       "reason": [""] * 2})
        >>> holm_results(table)["result"].tolist()
        ['differ', 'same within uncertainty']
    """
    table = table.copy()
    comparable = (table["result"] != NOT_COMPARABLE).to_numpy()
    p = table["p_value"].to_numpy(dtype=float).copy()
    p[~comparable] = math.nan
    table["p_holm"] = holm(p)
    m = int(comparable.sum())
    for i in range(len(table)):
        if not comparable[i]:
            continue
        adjusted, raw = table.at[i, "p_holm"], table.at[i, "p_value"]
        family = f"Holm over {m} number{'s' if m != 1 else ''}"
        if adjusted < level:
            table.at[i, "result"] = DIFFER
            table.at[i, "reason"] = f"adjusted p = {adjusted:.3g} < {level:g} ({family})"
        else:
            interval_excludes = table.at[i, "result"] == DIFFER
            table.at[i, "result"] = SAME
            table.at[i, "reason"] = (
                f"the interval excludes 0 (p = {raw:.3g}), but the adjusted p = {adjusted:.3g}"
                f" >= {level:g} ({family})"
                if interval_excludes
                else f"adjusted p = {adjusted:.3g} >= {level:g} ({family})"
            )
    return table


def _documents(reference: RunHeader, run: RunHeader, claim: str) -> int | None:
    """The smaller of the two runs' document counts behind `claim` (None when unknown)."""
    counts = [r.replicates.documents_per_claim.get(claim) for r in (reference, run)]
    return None if None in counts else min(counts)


def _bias(
    runs: tuple[RunHeader, RunHeader], claim: str, number: str, values: list[float], reps: list[Any]
) -> str | None:
    """Why `number` counts as biased (None when it does not): the code knows its plug-in to
    be biased (`is_biased_plugin`), or in either run its bootstrap bias exceeds
    `BIAS_SE_LIMIT` standard errors (`bias_flagged`)."""
    if is_biased_plugin(number):
        return "its plug-in is biased on few documents (a geometric mean over heads)"
    ratios = [bias_to_se(v, r) for v, r in zip(values, reps, strict=True)]
    over = [f"{r.label} {x:.2f}" for r, x in zip(runs, ratios, strict=True) if bias_flagged(x)]
    if over:
        return f"its bootstrap |bias| / SE exceeds {BIAS_SE_LIMIT} ({', '.join(over)})"
    return None


def _uncertified(runs: tuple[RunHeader, RunHeader], claim: str, number: str) -> str | None:
    """Why `number` is refused because its interval is not certified at a run's document
    count (`not_certified_because`; for another model or corpus only below the smallest
    studied count), naming the runs; None when it is certified in both."""
    reasons = []
    for r in runs:
        n = r.replicates.documents_per_claim.get(claim, r.n_documents) if r.replicates else None
        if n is None:
            continue
        speaks = studied({"model": r.model, "corpus": r.corpus})
        why = not_certified_because(number, int(n), studied_run=speaks)
        if why is not None:
            reasons.append(f"{r.label}: {why}")
    return "; ".join(reasons) or None


def _test(
    reference: RunHeader, run: RunHeader, claim: str, number: str, ref_value: float, value: float
):
    """The difference test of one number (paired only when exact; biased numbers only between
    runs of equal document counts, the known-biased plug-ins from bias-corrected
    replicates)."""
    reps = []
    for r in (reference, run):
        found = None if r.replicates is None else r.replicates.numbers.get((claim, number))
        reps.append(found)
    missing = [r for r, rep in zip((reference, run), reps, strict=True) if rep is None]
    values, corrected = [ref_value, value], False
    if not missing and not any(math.isnan(v) for v in values):
        uncertified = _uncertified((reference, run), claim, number)
        if uncertified is not None:
            return Difference(
                value - ref_value,
                math.nan,
                math.nan,
                False,
                NOT_COMPARABLE,
                f"an interval not certified at the run's document count ({uncertified}): "
                "a test from its replicates would not hold its error rate",
            )
        why = _bias((reference, run), claim, number, values, reps)
        if why is not None:
            counts = [r.replicates.documents_per_claim.get(claim) for r in (reference, run)]
            if None in counts or counts[0] != counts[1]:
                delta = value - ref_value
                return Difference(
                    delta,
                    math.nan,
                    math.nan,
                    False,
                    NOT_COMPARABLE,
                    f"a biased number ({why}) across different document counts "
                    f"({' vs '.join(map(str, counts))}): its bias depends on the count",
                )
            # equal counts: the bias of both runs is the same and cancels in the difference;
            # only the plug-ins known to be biased are compared from corrected replicates
            # (the compare study: correcting the Retriever share too gave 9 of 12 false
            # "differ"s at 32 against 32 documents)
            if is_biased_plugin(number):
                (ref_value, reps[0]), (value, reps[1]) = (
                    bias_corrected(ref_value, reps[0]),
                    bias_corrected(value, reps[1]),
                )
                corrected = True
    result = difference_test(
        ref_value,
        reps[0],
        value,
        reps[1],
        paired=not missing and reference.replicates.pairs_with(run.replicates, claim),
        n_documents=None if missing else _documents(reference, run, claim),
    )
    if corrected:
        result = replace(result, bias_corrected=True)
    unmeasured = [r.label for r, v in ((reference, ref_value), (run, value)) if math.isnan(v)]
    if unmeasured:
        return replace(result, reason=f"not measured in {' and '.join(unmeasured)}")
    if missing and result.reason.startswith("a run kept no"):
        why = missing[0].no_replicates if missing[0].replicates is None else "no replicates"
        result = replace(result, reason=f"{missing[0].label}: {why}")
    return result
