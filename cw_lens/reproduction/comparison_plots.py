"""Figure of several runs compared (`cw_lens.reproduction.run_comparison`). Plotting only."""

from __future__ import annotations

import math
from typing import Any

from matplotlib.lines import Line2D

from cw_lens.plots.style import literal_text, plt
from cw_lens.reproduction.verdicts import threshold_text

VERDICT_COLOURS = {
    "yes": "tab:green",
    "no": "tab:red",
    "inconclusive": "tab:orange",
    "not measured": "tab:gray",
}


def plot_run_comparison(
    rows: Any, labels: list[str], *, ncols: int = 3, panel_size: tuple = (4.0, 0.45)
) -> Any:
    """Forest plot of [`RunComparisonResult.to_dataframe`][cw_lens.RunComparisonResult.to_dataframe]
    rows: one panel per headline number (claim and number in the title, the check beside it), one
        row per run (top to bottom in
    `labels` order; point = value, bar = interval where the run has one), the threshold as a
    dashed line (the two bounds of an `in` check as a shaded band), colour = the check's
    verdict. A run that did not measure the number keeps its row, empty."""
    checks = rows[rows["number"] != ""]
    panels = list(dict.fromkeys(zip(checks["claim"], checks["number"], strict=True)))
    ncols = max(1, min(ncols, len(panels)))
    nrows = max(1, math.ceil(len(panels) / ncols))
    height = 0.9 + panel_size[1] * len(labels)
    fig, axes = plt.subplots(
        nrows,
        ncols,
        squeeze=False,
        constrained_layout=True,
        figsize=(panel_size[0] * ncols, height * nrows + 0.4),
    )
    for ax in axes.flat[len(panels) :]:
        ax.set_visible(False)
    if not panels:  # the oldest summaries carry claim verdicts without checks
        fig.text(0.5, 0.5, "no headline numbers: these summaries have no checks", ha="center")
    for ax, (claim, number) in zip(axes.flat, panels, strict=False):
        part = checks[(checks["claim"] == claim) & (checks["number"] == number)]
        first = part.iloc[0]
        if first["op"] == "in":
            ax.axvspan(*first["threshold"], color="0.9", zorder=0)
            for bound in first["threshold"]:
                ax.axvline(bound, color="0.4", ls="--", lw=0.8)
        else:
            ax.axvline(first["threshold"], color="0.4", ls="--", lw=0.8)
        check = threshold_text(first["op"], first["threshold"])
        for y, label in enumerate(labels):
            mine = part[part["run"] == label]
            if mine.empty:
                continue
            row = mine.iloc[0]
            colour = VERDICT_COLOURS.get(row["check"], "black")
            if not (math.isnan(row["low"]) or math.isnan(row["high"])):
                ax.hlines(y, row["low"], row["high"], color=colour, lw=2.5)
            if not math.isnan(row["value"]):
                ax.plot([row["value"]], [y], "o", color=colour, ms=6, label=label)
        ax.set_yticks(range(len(labels)), labels, fontsize=8)
        ax.set_ylim(len(labels) - 0.5, -0.5)
        ax.set_title(f"{claim}\n{number} {check}", fontsize=8)
        ax.tick_params(axis="x", labelsize=7)
        ax.grid(axis="x", lw=0.3)
    handles = [
        Line2D([], [], marker="o", color=c, ls="-", lw=2.5, label=v)
        for v, c in VERDICT_COLOURS.items()
    ]
    fig.legend(handles=handles, loc="outside lower center", ncols=3, fontsize=8, frameon=False)
    fig.suptitle("Runs compared: value [interval] per headline number", fontsize=10)
    return literal_text(fig)
