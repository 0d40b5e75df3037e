"""Figures of the faithfulness protocol (P1). Plotting only."""

from __future__ import annotations

from typing import Any

from cw_lens.plots.style import literal_text, plt

METRIC_COLOURS = {
    "attention": "tab:gray",
    "value_norm": "tab:blue",
    "value_norm_output": "tab:green",
    "contribution": "tab:red",
    "alti": "tab:purple",
    "attribution_patching": "tab:orange",
    "random": "black",
}
CROWDED = 6  # lines in a panel above which its legend goes under it


def plot_faithfulness_curves(
    result: Any, *, column: str | None = None, figsize_per_panel: tuple = (4.2, 3.2)
) -> Any:
    """`faithfulness_order`: damage versus the share of removed pairs/tokens, one line per
    metric; columns = comprehensiveness / sufficiency, rows = granularity. AOPC in the legend:
    with more than `CROWDED` lines (the comparison with other tools' metrics) the legend goes
    under its panel, off the curves, and the AOPCs get three significant digits, since the
    sufficiency AOPCs of most metrics differ only in the third decimal."""
    column = column or result.value_column
    curves = result.curves
    grans = list(dict.fromkeys(curves["granularity"]))
    modes = list(dict.fromkeys(curves["mode"]))
    aopc = result.aopc(column)
    crowded = curves["metric"].nunique() > CROWDED
    digits = ".3g" if crowded else ".2f"
    # crowded: each legend under its panel, in two columns
    placement = dict(loc="upper center", bbox_to_anchor=(0.5, -0.22), ncol=2) if crowded else {}
    fig, axes = plt.subplots(
        len(grans),
        len(modes),
        squeeze=False,
        constrained_layout=True,
        # a legend under each panel: room for its rows
        figsize=(
            figsize_per_panel[0] * len(modes),
            (figsize_per_panel[1] + (1.4 if crowded else 0.0)) * len(grans),
        ),
    )
    for r, g in enumerate(grans):
        for c, mode in enumerate(modes):
            ax = axes[r][c]
            part = curves[(curves["granularity"] == g) & (curves["mode"] == mode)]
            for metric, rows in part.groupby("metric", sort=False):
                rows = rows.sort_values("fraction")
                area = aopc.loc[(g, mode), metric]
                ax.plot(
                    rows["fraction"] * 100,
                    rows[column],
                    marker="o",
                    ms=3,
                    color=METRIC_COLOURS.get(metric.split("#")[0]),  # random#2...: black too
                    ls="--" if metric.startswith("random") else "-",
                    alpha=0.5 if "#" in metric else 1.0,
                    label=f"{metric} ({area:{digits}})",
                )
            ax.set_xscale("log")
            ax.set_xlabel(f"% of {g} removed")
            ax.set_ylabel(column)
            ax.set_title(f"{mode} — {g}", fontsize=10)
            ax.axhline(0, color="k", lw=0.5)
            ax.legend(fontsize=7, title="metric (AOPC)", title_fontsize=7, **placement)
    clean = ", ".join(f"{k} {v:.3g}" for k, v in result.clean.items())
    fig.suptitle(f"Faithfulness ({result.n_documents} documents; clean {clean})", fontsize=10)
    return literal_text(fig)
