"""The Markdown of a run comparison: the cells of the checks table and the differences table.

`cw_lens.reproduction.run_comparison.RunComparisonResult.to_markdown` writes the table of every
check of every run with these cells, then (for two runs or more) `differences_markdown`.
"""

from __future__ import annotations

import math
from typing import Any

import pandas as pd

from cw_lens.reproduction.difference_tests import FAMILY_LEVEL
from cw_lens.reproduction.run_replicates import DIFFER, NOT_COMPARABLE


def table_cell(value: Any) -> str:
    """A Markdown table cell: `—` for None, pipes escaped.

    Args:
        value: What the cell shows.

    Returns:
        The cell's text.
    """
    return "—" if value is None else str(value).replace("|", "\\|")


def verdict_cell(verdict: Any) -> str:
    """A verdict as a cell: `yes` plain, any other verdict bold, `—` for none.

    Args:
        verdict: The verdict (a string), or anything else for none.

    Returns:
        The cell's text.
    """
    if not isinstance(verdict, str):
        return "—"
    return verdict if verdict == "yes" else f"**{verdict}**"


def value_cell(row: pd.Series) -> str:
    """A number as a cell: its value, its interval where it has one, and its check's verdict.

    Args:
        row: A row with `value`, `low`, `high` and `check`.

    Returns:
        The cell's text.
    """
    value = "n/a" if math.isnan(row["value"]) else f"{row['value']:.3g}"
    if not (math.isnan(row["low"]) and math.isnan(row["high"])):
        value += f" [{row['low']:.3g}, {row['high']:.3g}]"
    return f"{value} {row['check']}"


def differences_markdown(table: pd.DataFrame, reference: str) -> list[str]:
    """The differences table: each number of each run minus the reference run's, with the
    95% interval of the difference, its raw and Holm-adjusted p-values and the result."""
    comparable = int((table["result"] != NOT_COMPARABLE).sum())
    lines = [
        f"Differences from `{reference}` (run - {reference}; unadjusted 95% bootstrap interval "
        "of the difference, paired when both runs resampled the same documents; `differ` when "
        f"the p-value adjusted by Holm's method over the {comparable} comparable numbers is "
        f"below {FAMILY_LEVEL:g}, which holds the chance of any false `differ` to "
        f"{FAMILY_LEVEL:g}; † bias-corrected replicates):",
        "",
        "| claim / number | run | difference [interval] | resamples | p | p (Holm) | result |",
        "|---|---|---|---|---|---|---|",
    ]
    for _, row in table.iterrows():
        diff = "n/a" if math.isnan(row["difference"]) else f"{row['difference']:+.3g}"
        if not math.isnan(row["low"]):
            diff += f" [{row['low']:+.3g}, {row['high']:+.3g}]"
        if row.get("bias_corrected"):
            diff += " †"
        result = row["result"] if row["result"] != DIFFER else f"**{DIFFER}**"
        if row["result"] == NOT_COMPARABLE:
            result += f" ({row['reason']})"
        kind = "paired" if row["paired"] else "independent"
        if row["result"] == NOT_COMPARABLE:
            kind = "—"
        p, p_holm = (_p_cell(row.get(k, math.nan)) for k in ("p_value", "p_holm"))
        lines.append(
            f"| `{row['claim']}` ↳ {row['number']} | {row['run']} | {diff} | {kind} | {p} | "
            f"{p_holm} | {result} |"
        )
    return lines


def _p_cell(p: Any) -> str:
    return "—" if p is None or math.isnan(p) else f"{p:.3g}"
