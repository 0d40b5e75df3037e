"""The tables of a [`SinkStatisticsResult`][cw_lens.SinkStatisticsResult], read from the
tensors `SinkStatisticsAccumulator.finish` built: the per-layer totals and means of its sums, the
per-head table, the sink-rate curve, the histogram of `s*`, the factor samples and their
decomposition.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import numpy as np
import pandas as pd
import torch
from torch import Tensor

from cw_lens.analyses.sinks.accumulation import (
    DRIVER_FACTORS,
    FACTOR_COLUMNS,
    GROUPS,
    RATE_BINS,
    SAMPLE_COLUMNS,
)
from cw_lens.core.errors import InputError

if TYPE_CHECKING:
    from cw_lens.analyses.sinks.statistics import SinkStatisticsResult


def layer_total(stats: SinkStatisticsResult, name: str) -> Tensor:
    """The corpus total of the sum `name` per (layer, head) of the result.

    Args:
        stats: The result.
        name: The sum, one of `stats.sum_names` (`"rate_sum"`).

    Returns:
        A float64 tensor `[layer, head]`.
    """
    if name not in stats.sum_names:
        raise InputError(f"Unknown sum {name!r}; the result keeps {stats.sum_names}.")
    return stats.sums[..., stats.sum_names.index(name)]


def layer_mean(stats: SinkStatisticsResult, name: str, count: str) -> Tensor:
    """Sum / count; NaN where nothing was counted (e.g. no query reached min_query).

    Args:
        stats: The result.
        name: The sum.
        count: The sum that counts its entries.

    Returns:
        A tensor `[layer, head, ...]`.
    """
    total, n = layer_total(stats, name), layer_total(stats, count)
    return torch.where(n > 0, total / n.clamp_min(1), torch.full_like(total, math.nan))


def head_table(stats: SinkStatisticsResult) -> pd.DataFrame:
    """One row per (layer, head): rates, value geometry, factors, s*, drift.

    Args:
        stats: The result.

    Returns:
        The table of [`heads`][cw_lens.SinkStatisticsResult.heads].
    """
    rate = stats.sink_rate
    data = {
        "layer": np.repeat(stats.layers, stats.n_heads),
        "head": np.tile(np.arange(stats.n_heads), len(stats.layers)),
        "sink_rate": rate.flatten(),
        "sink_head": stats.sink_heads.flatten(),
        "sink_rate_all_queries": layer_mean(stats, "rate_all_sum", "rate_all_count").flatten(),
        "output_norm": layer_mean(stats, "norm_sum", "rate_all_count").flatten(),
        "norm_ratio": layer_mean(stats, "ratio_sum", "geometry_count").flatten(),
        "norm_ratio_geomean": layer_mean(stats, "log_ratio_sum", "geometry_count").exp().flatten(),
        "cos_sink_token": layer_mean(stats, "cos_token_sum", "geometry_count").flatten(),
        "cos_sink_mixture": layer_mean(stats, "cos_mixture_sum", "cos_mixture_count").flatten(),
    }
    for group in ("sink", "tail"):
        for name in FACTOR_COLUMNS[4:]:
            data[f"{group}_{name}"] = layer_mean(
                stats, f"{group}_{name}_sum", f"{group}_count"
            ).flatten()
    data["s_star_median"] = stats.s_star.quantile(0.5).flatten()
    data["s_star_at_0"] = stats.s_star.share_at_or_below_lo().flatten()
    data["s_star_at_1"] = stats.s_star.share_at_or_above_hi().flatten()
    data["s_star_count"] = stats.s_star.total.flatten()
    data["drift_cos_median"] = stats.drift_cos.quantile(0.5).flatten()
    data["drift_negative_share"] = layer_mean(stats, "drift_neg", "drift_count").flatten()
    data["drift_cancelled_median"] = stats.drift_share.quantile(0.5).flatten()
    data["drift_count"] = layer_total(stats, "drift_count").flatten()
    df = pd.DataFrame({k: np.asarray(v) for k, v in data.items()})
    df["s_star_interior"] = (
        (df["s_star_count"] > 0) & (df["s_star_at_0"] < 0.5) & (df["s_star_at_1"] < 0.5)
    )
    return df


def curve_table(stats: SinkStatisticsResult, *, sink_heads_only: bool) -> pd.DataFrame:
    """Mean `||o_i^h||` per sink-rate bin and head.

    Args:
        stats: The result.
        sink_heads_only: Keep the sink heads only (else every head).

    Returns:
        The table of [`curve`][cw_lens.SinkStatisticsResult.curve].
    """
    norm, count = stats.curve_sums[..., 0], stats.curve_sums[..., 1]
    rows = []
    heads = stats.sink_heads
    for li, layer in enumerate(stats.layers):
        for h in range(stats.n_heads):
            if sink_heads_only and not heads[li, h]:
                continue
            for b in range(RATE_BINS):
                n = int(count[li, h, b])
                if n:
                    rows.append((layer, h, (b + 0.5) / RATE_BINS, float(norm[li, h, b]) / n, n))
    return pd.DataFrame(rows, columns=["layer", "head", "sink_rate", "output_norm", "count"])


def s_star_table(stats: SinkStatisticsResult, *, sink_heads_only: bool) -> pd.DataFrame:
    """The histogram of `s*` pooled over (sink) heads.

    Args:
        stats: The result.
        sink_heads_only: Pool the sink heads only (else every head).

    Returns:
        The table of [`s_star_distribution`][cw_lens.SinkStatisticsResult.s_star_distribution].
    """
    hist = stats.s_star
    sel = stats.sink_heads if sink_heads_only else torch.ones_like(stats.sink_heads)
    counts = hist.counts[sel].sum(0).double()
    edges = hist.edges.numpy()
    centres = np.concatenate([[0.0], (edges[:-1] + edges[1:]) / 2, [1.0]])
    return pd.DataFrame(
        {
            "s_star": centres,
            "count": counts.numpy(),
            "edge": ["=0"] + ["interior"] * hist.n_bins + ["=1"],
        }
    )


def sample_table(stats: SinkStatisticsResult, group: str) -> pd.DataFrame:
    """The sampled factor entries of one group, one row per entry.

    Args:
        stats: The result.
        group: `"sink"` or `"tail"`.

    Returns:
        The table of [`samples`][cw_lens.SinkStatisticsResult.samples].
    """
    if group not in GROUPS:
        raise InputError(f"group must be 'sink' or 'tail', got {group!r}.")
    table = stats.samples_table
    rows = table[table[:, 0] == GROUPS.index(group), 1:]
    df = pd.DataFrame(rows.double().numpy(), columns=list(SAMPLE_COLUMNS))
    df = df.sort_values(["layer", "head", "query", "key"], kind="stable", ignore_index=True)
    return df.astype({c: "int64" for c in ("layer", "head", "query", "key", "document")})


def driver_samples(stats: SinkStatisticsResult) -> list[tuple[int, int, Tensor, Tensor]]:
    """Per head, the sink group's factor samples and their documents, as
    `cw_lens.core.resampled.driver_numbers` reads them.

    Args:
        stats: The result.

    Returns:
        `(layer index, head, samples [n, factors + contribution] float64, documents)` per head
        with samples.
    """
    index = {layer: i for i, layer in enumerate(stats.layers)}
    table = stats.samples_table
    table = table[table[:, 0] == GROUPS.index("sink"), 1:].double()
    columns = [SAMPLE_COLUMNS.index(c) for c in (*DRIVER_FACTORS, "contribution")]
    out = []
    for layer, head in sorted({(int(a), int(h)) for a, h in table[:, :2].tolist()}):
        mine = table[(table[:, 0] == layer) & (table[:, 1] == head)]
        out.append((index[layer], head, mine[:, columns], mine[:, -1].long()))
    return out


def decomposition_table(stats: SinkStatisticsResult) -> pd.DataFrame:
    """How each factor drives the weight, per group (sink / tail entries of sink heads).

    Args:
        stats: The result.

    Returns:
        The table of [`decomposition`][cw_lens.SinkStatisticsResult.decomposition].
    """
    drivers = stats.drivers()
    drivers = drivers[drivers["sink_head"].eq(True)]
    heads = set(map(tuple, stats.sink_heads.nonzero().tolist()))
    rows = []
    for group in ("sink", "tail"):
        table = stats.samples(group)
        layer_index = table["layer"].map({layer: i for i, layer in enumerate(stats.layers)})
        keep = [(a, h) in heads for a, h in zip(layer_index, table["head"], strict=True)]
        table = table[np.asarray(keep, dtype=bool)]
        rho = drivers[drivers["group"] == group]
        for name in (*DRIVER_FACTORS, "contribution"):
            values = table[name].to_numpy()
            col = f"rho_{name}"
            rows.append(
                {
                    "group": group,
                    "factor": name,
                    "mean": float(np.nanmean(values)) if len(values) else math.nan,
                    "median": float(np.nanmedian(values)) if len(values) else math.nan,
                    "median_head_rho": float(rho[col].median()) if col in rho else 1.0,
                    "median_head_abs_rho": float(rho[col].abs().median()) if col in rho else 1.0,
                    "n_samples": len(values),
                }
            )
    return pd.DataFrame(rows)
