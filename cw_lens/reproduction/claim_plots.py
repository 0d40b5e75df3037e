"""Per-layer detail of the claims about layers: each layer's number with its bootstrap interval
(`per_layer` rows of `summary.json`), beside the criterion's threshold. Plotting only."""

from __future__ import annotations

from typing import Any

import matplotlib.pyplot as plt
import numpy as np

from cw_lens.plots.style import literal_text


def plot_per_layer_intervals(claims: dict[str, dict[str, Any]]) -> Any:
    """One panel per claim with `per_layer` rows: the number per layer (dots) with its
    interval (bars) and the threshold(s) of the claim's check on that number (dashed)."""
    layered = {cid: c for cid, c in claims.items() if c.get("per_layer")}
    n = max(1, len(layered))
    fig, axes = plt.subplots(1, n, figsize=(4.2 * n, 3.4), squeeze=False)
    for ax, (cid, claim) in zip(axes[0], layered.items(), strict=False):
        rows = claim["per_layer"]
        layer = np.array([r["layer"] for r in rows])
        value = np.array([np.nan if r["value"] is None else r["value"] for r in rows], float)
        low = np.array([np.nan if r["low"] is None else r["low"] for r in rows], float)
        high = np.array([np.nan if r["high"] is None else r["high"] for r in rows], float)
        ok = np.isfinite(low) & np.isfinite(high) & np.isfinite(value)
        ax.errorbar(
            layer[ok],
            value[ok],
            yerr=[np.maximum(value[ok] - low[ok], 0), np.maximum(high[ok] - value[ok], 0)],
            fmt="o",
            ms=3,
            capsize=2,
            color="tab:blue",
        )
        ax.plot(layer[~ok], value[~ok], "o", ms=3, color="tab:gray")
        number = rows[0]["number"]
        for check in claim.get("checks", []):
            if check["number"] != number:
                continue
            limits = check["threshold"] if check["op"] == "in" else [check["threshold"]]
            for t in limits:
                ax.axhline(t, ls="--", color="tab:red", lw=1)
        ax.set_title(f"{cid}\n(verdict over all layers: {claim['holds']})", fontsize=9)
        ax.set_xlabel("layer")
        ax.set_ylabel(number, fontsize=8)
    if not layered:
        axes[0, 0].set_axis_off()
    literal_text(fig)  # before tight_layout, which measures (so parses) every text
    fig.tight_layout()
    return fig
