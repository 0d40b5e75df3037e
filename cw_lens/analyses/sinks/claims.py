"""P1's sink claims (value geometry, convex curve, drift, drivers) read from the sink tables."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pandas as pd

from cw_lens.analyses.sinks.accumulation import DRIVER_FACTORS
from cw_lens.core.claims import Check, Claim

# convex_sink_curve judges only sink heads with at least this many counted queries
# (docs/methods.md#claims)
MIN_S_STAR_QUERIES = 16


# the claims about layers and the number each reads per layer
LAYER_NUMBERS = {
    "sink_attention_vs_contribution": "contribution_over_attention",
    "sink_value_norm_ratio": "median_ratio_sink_heads",
    "sink_anti_alignment": "median_cos_sink_tail_mixture",
}


def sink_claims(
    heads: pd.DataFrame,
    drivers: pd.DataFrame,
    *,
    min_s_star_queries: int = MIN_S_STAR_QUERIES,
) -> list[Claim]:
    """The six sink claims of methods § Claims (docs/methods.md#claims), exactly as its criterion
    column reads them.

    Args:
        heads: Per-head table ([`SinkStatisticsResult.heads`][cw_lens.SinkStatisticsResult.heads]):
            `sink_head`, `sink_attention`, `sink_contribution`, `norm_ratio`, `cos_sink_mixture`,
            `s_star_interior`, `s_star_count`, `drift_cos_median`, `drift_cancelled_median`,
            ...
        drivers: Per-head Spearman table
            ([`SinkStatisticsResult.drivers`][cw_lens.SinkStatisticsResult.drivers]): `layer`,
            `head`, `group`, `rho_attention`, `rho_relative_norm`, `rho_cosine`.
        min_s_star_queries: `convex_sink_curve` judges sink heads with at least this many
            counted queries (methods page: 16).

    With no sink head every number is NaN and no claim holds.
    """
    sink = heads[heads["sink_head"].astype(bool)]
    return [
        _attention_vs_contribution(sink),
        _value_norm_ratio(heads, sink),
        _anti_alignment(sink),
        _contribution_drivers(sink, drivers),
        _convex_curve(sink, min_s_star_queries),
        _cancels_drift(sink),
    ]


def median(frame: pd.DataFrame, col: str) -> float:
    """The median of a column; NaN for an empty table."""
    return float(frame[col].median()) if len(frame) else math.nan


def mean(values: Any) -> float:
    """The mean; NaN for no values."""
    return float(np.mean(values)) if len(values) else math.nan


def _attention_vs_contribution(sink: pd.DataFrame) -> Claim:
    """`sink_attention_vs_contribution`: the sink's contribution against its attention."""
    n_sink = len(sink)
    att, contrib = mean(sink["sink_attention"]), mean(sink["sink_contribution"])
    return Claim(
        "sink_attention_vs_contribution",
        paper="the first token takes much attention but little contribution (P1 Fig. 1)",
        criterion="over sink heads, mean intra contribution of the sink < ½ × its mean "
        "attention (the ratio is the number)",
        checks=[Check("contribution_over_attention", contrib / att if att else math.nan, "<", 0.5)],
        measured={
            "n_sink_heads": n_sink,
            "mean_sink_attention": att,
            "mean_sink_contribution_intra": contrib,
        },
    )


def _value_norm_ratio(heads: pd.DataFrame, sink: pd.DataFrame) -> Claim:
    """`sink_value_norm_ratio`: ‖pv_j‖/‖pv_0‖ over the sink heads."""
    n_sink = len(sink)
    return Claim(
        "sink_value_norm_ratio",
        paper="sink value norm 3-10x smaller than non-sink (P2)",
        criterion="median over sink heads of mean ‖pv_j‖/‖pv_0‖ lies in [3, 10]",
        checks=[Check("median_ratio_sink_heads", median(sink, "norm_ratio"), "in", (3.0, 10.0))],
        measured={
            "median_ratio_all_heads": median(heads, "norm_ratio"),
            "median_geomean_ratio_sink_heads": median(sink, "norm_ratio_geomean"),
            "n_sink_heads": n_sink,
        },
    )


def _anti_alignment(sink: pd.DataFrame) -> Claim:
    """`sink_anti_alignment`: cos(pv_0, m_i) over the sink heads."""
    n_sink = len(sink)
    return Claim(
        "sink_anti_alignment",
        paper="sink projected value anti-aligned with the rest (P1, P2)",
        criterion="median over sink heads of cos(pv_0, m_i) < 0",
        checks=[Check("median_cos_sink_tail_mixture", median(sink, "cos_sink_mixture"), "<", 0.0)],
        measured={
            "median_cos_sink_token": median(sink, "cos_sink_token"),
            "share_sink_heads_negative_mixture": mean(sink["cos_sink_mixture"] < 0),
            "n_sink_heads": n_sink,
        },
    )


def _contribution_drivers(sink: pd.DataFrame, drivers: pd.DataFrame) -> Claim:
    """`sink_contribution_drivers`: per sink head, |ρ| of each factor with the contribution."""
    keys = set(zip(sink["layer"], sink["head"], strict=True))
    is_sink = [k in keys for k in zip(drivers["layer"], drivers["head"], strict=True)]
    rho = drivers[np.asarray(is_sink, dtype=bool)]
    abs_rho = {
        group: {
            f: float(rho.loc[rho["group"] == group, f"rho_{f}"].abs().median())
            for f in DRIVER_FACTORS
        }
        for group in ("sink", "tail")
    }
    return Claim(
        "sink_contribution_drivers",
        paper="sink contribution driven by norm and cosine, not attention (P1)",
        criterion="per sink head, Spearman ρ of each factor with the sink's contribution; "
        "the median over heads of |ρ(attention)| is the smallest of the three",
        checks=[
            Check(
                f"median_abs_rho_{f}_minus_attention",
                abs_rho["sink"][f] - abs_rho["sink"]["attention"],
                ">",
                0.0,
            )
            for f in ("relative_norm", "cosine")
        ],
        measured={
            "median_abs_rho_sink": abs_rho["sink"],
            "median_abs_rho_tail": abs_rho["tail"],
            "n_sink_heads_with_rho": int(
                rho[rho["group"] == "sink"]["rho_attention"].notna().sum()
            ),
            "mean_sink_factors": {f: mean(sink[f"sink_{f}"]) for f in DRIVER_FACTORS},
            "mean_tail_factors": {f: mean(sink[f"tail_{f}"]) for f in DRIVER_FACTORS},
        },
    )


def _convex_curve(sink: pd.DataFrame, min_s_star_queries: int) -> Claim:
    """`convex_sink_curve`: the share of judged sink heads whose median s* is interior."""
    n_sink = len(sink)
    judged = sink[sink["s_star_count"] >= min_s_star_queries]
    counted = judged["s_star_count"].sum()
    return Claim(
        "convex_sink_curve",
        paper="output norm convex in sink rate, minimum at s* < 1 (P1)",
        criterion=f"more than half of the sink heads with at least {min_s_star_queries} "
        "counted queries have a median s* in (0, 1)",
        checks=[
            Check(
                "share_judged_sink_heads_interior_median_s_star",
                mean(judged["s_star_interior"]),
                ">",
                0.5,
            )
        ],
        measured={
            "n_sink_heads_judged": len(judged),
            "n_sink_heads": n_sink,
            "median_of_median_s_star": median(judged, "s_star_median"),
            "pooled_share_s_star_at_1": float(
                (judged["s_star_at_1"] * judged["s_star_count"]).sum() / counted
            )
            if counted
            else math.nan,
        },
    )


def _cancels_drift(sink: pd.DataFrame) -> Claim:
    """`sink_cancels_drift`: the sink against the drift of weakly attended tokens."""
    n_sink = len(sink)
    cancelled = sink["drift_cancelled_median"]
    return Claim(
        "sink_cancels_drift",
        paper="the sink opposes the drift of weakly attended tokens (P1)",
        criterion="median cos(α₀pv₀, d_i) < 0 in more than half of the sink heads, "
        "and the median cancelled share > 0 (per-head medians from unclipped values)",
        checks=[
            Check(
                "share_sink_heads_negative_cosine",
                mean(sink["drift_cos_median"] < 0),
                ">",
                0.5,
            ),
            Check("median_cancelled_share", median(sink, "drift_cancelled_median"), ">", 0.0),
        ],
        measured={
            "n_sink_heads": n_sink,
            "n_sink_heads_median_share_beyond_2": int((cancelled.abs() > 2).sum()),
            "share_sink_heads_positive_cancelled_share": mean(cancelled > 0),
        },
    )
