"""The sink statistics of a corpus: their result class
([`SinkStatisticsResult`][cw_lens.SinkStatisticsResult]) and the tables it reads from the
tensors `SinkStatisticsAccumulator.finish` built (laid out as
`cw_lens.analyses.sinks.statistics_layout` says): the per-layer totals and means of its sums,
the per-head table, the sink-rate curve, the histogram of `s*`, the factor samples, their
per-head rank correlations and their decomposition. The entry point,
[`sink_statistics`][cw_lens.sink_statistics], is in `cw_lens.analyses.sinks.statistics_pass`.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import pandas as pd
import torch
from jaxtyping import Bool, Float
from torch import Tensor

from cw_lens.analyses.sinks.detection import MIN_QUERY, SINK_RATE_THRESHOLD
from cw_lens.analyses.sinks.statistics_layout import (
    DRIVER_FACTORS,
    FACTOR_COLUMNS,
    GROUPS,
    RATE_BINS,
    SAMPLE_COLUMNS,
)
from cw_lens.core.deprecation import keyword_only, moved_to_reproduction
from cw_lens.core.errors import InputError
from cw_lens.core.histograms import Histogram
from cw_lens.core.registry import saveable
from cw_lens.core.results import Result

# One concept: the result and the tables it reads from its own tensors (one module, so that
# neither imports the other; until 0.5 the tables were `statistics_tables`).


@saveable
@dataclass(repr=False)
class SinkStatisticsResult(Result):
    """Sink geometry of a corpus, per (layer, head); see the module docstring for formulas.

    Use `heads` for the per-head table, `curve` for the empirical sink-rate curves,
    `decomposition` for the factor analysis and the `plot_*` methods for figures; P1's claims
    as measured here are `cw_lens.reproduction.claims(stats)`.

    What `SinkStatisticsAccumulator.finish` built, as plain tensors: `sums` (`[layer, head,
    statistic]` float64, the statistics `sum_names`), `curve_sums` (`[layer, head, bin, (norm,
    count)]`), the histograms `s_star`, `drift_cos`, `drift_share`, `samples_table` (the factor
    sample, `[row, ("group", *SAMPLE_COLUMNS)]`, group 0 the sink entries, 1 the tail entries)
    and, with `per_document=True`, `record` (`[document, layer, head, recorded]`, the
    statistics `record_names`).
    """

    layers: list[int]
    n_heads: int
    sinks: str
    n_documents: int
    n_tokens: int
    sum_names: list[str]
    sums: Float[Tensor, "layer head statistic"]
    curve_sums: Float[Tensor, "layer head bin part"]
    s_star: Histogram
    drift_cos: Histogram
    drift_share: Histogram
    samples_table: Float[Tensor, "sample column"]
    record_names: list[str] | None = None
    record: Float[Tensor, "document layer head recorded"] | None = None
    min_query: int = MIN_QUERY
    threshold: float = SINK_RATE_THRESHOLD

    @property
    def sink_rate(self) -> Float[Tensor, "layer head"]:
        """Mean sink rate over queries `i >= min_query`."""
        return layer_mean(self, "rate_sum", "rate_count")

    @property
    def sink_heads(self) -> Bool[Tensor, "layer head"]:
        return self.sink_rate > self.threshold  # NaN (no query counted) is not a sink head

    def heads(self) -> pd.DataFrame:
        """One row per (layer, head): rates, value geometry, factors, s*, drift.

        Returns:
            A DataFrame; the columns are described in the module docstring and on the methods page
            (docs/methods.md#sinks).

        Examples:
            ```python
            import cw_lens

            model = cw_lens.load_model("testing:tiny-llama")
            corpus = cw_lens.load_corpus(n_docs=2, max_tokens=16, model=model)
            stats = cw_lens.sink_statistics(model, corpus, progress=False)
            stats.heads().head()
            ```
        """
        return head_table(self)

    def layer(self, layer: int) -> SinkStatisticsResult:
        """This result for layer NUMBER `layer` alone.

        A `SinkStatisticsResult` with `layers == [layer]`: every table, claim and plot of it
        reads that layer's heads (with `layers=[10, 20]`, `stats.layer(20)` is layer 20, not
        the 21st layer nor the second position). Its per-head table,
        `stats.layer(20).to_dataframe()`, is layer 20's rows of
        [`heads`][cw_lens.SinkStatisticsResult.heads]. (Until 0.3.3 `layer(n)` returned
        that table.)

        Args:
            layer: The layer number; a layer that was not analysed raises
                [`InputError`][cw_lens.InputError] naming the analysed ones.

        Returns:
            A `SinkStatisticsResult` of one layer.

        Examples:
            ```python
            import cw_lens

            model = cw_lens.load_model("testing:tiny-llama")
            corpus = cw_lens.load_corpus(n_docs=2, max_tokens=16, model=model)
            stats = cw_lens.sink_statistics(model, corpus, progress=False)
            stats.layer(1).to_dataframe()  # one row per head of layer 1
            ```
        """
        i = self.layer_index(layer)

        def one(hist: Histogram) -> Histogram:
            out = copy.copy(hist)
            out.counts = hist.counts[i : i + 1].clone()
            return out

        samples = self.samples_table
        return replace(
            self,
            layers=[layer],
            sums=self.sums[i : i + 1].clone(),
            curve_sums=self.curve_sums[i : i + 1].clone(),
            s_star=one(self.s_star),
            drift_cos=one(self.drift_cos),
            drift_share=one(self.drift_share),
            samples_table=samples[samples[:, 1] == layer].clone(),
            record=None if self.record is None else self.record[:, i : i + 1].clone(),
        )

    def to_dataframe(self) -> pd.DataFrame:
        """The per-head table ([`heads`][cw_lens.SinkStatisticsResult.heads]).

        Returns:
            A DataFrame, one row per (layer, head).

        Examples:
            ```python
            import cw_lens

            model = cw_lens.load_model("testing:tiny-llama")
            corpus = cw_lens.load_corpus(n_docs=2, max_tokens=16, model=model)
            stats = cw_lens.sink_statistics(model, corpus, progress=False)
            stats.to_dataframe().shape
            ```
        """
        return self.heads()

    @keyword_only("by")
    def top(self, k: int = 10, *, by: str = "sink_rate") -> pd.DataFrame:
        """The `k` heads with the largest `by`.

        Args:
            k: How many heads.
            by: A column of [`heads`][cw_lens.SinkStatisticsResult.heads].

        Returns:
            `k` rows of the per-head table, largest first.

        Examples:
            ```python
            import cw_lens

            model = cw_lens.load_model("testing:tiny-llama")
            corpus = cw_lens.load_corpus(n_docs=2, max_tokens=16, model=model)
            stats = cw_lens.sink_statistics(model, corpus, progress=False)
            stats.top(5, by="sink_rate")
            ```
        """
        if by not in self.heads().columns:
            raise InputError(f"by must be a column of heads(), got {by!r}.")
        return self.heads().nlargest(k, by).reset_index(drop=True)

    def curve(self, *, sink_heads_only: bool = True) -> pd.DataFrame:
        """Empirical curve: mean `||o_i^h||` per sink-rate bin (queries `i >= min_query`).

        Args:
            sink_heads_only: Pool the sink heads only (else every head).

        Returns:
            A DataFrame with `layer, head, sink_rate, output_norm, count`.

        Examples:
            ```python
            import cw_lens

            model = cw_lens.load_model("testing:tiny-llama")
            corpus = cw_lens.load_corpus(n_docs=2, max_tokens=16, model=model)
            stats = cw_lens.sink_statistics(model, corpus, progress=False)
            stats.curve().head()
            ```
        """
        return curve_table(self, sink_heads_only=sink_heads_only)

    def s_star_distribution(self, *, sink_heads_only: bool = True) -> pd.DataFrame:
        """Histogram of the counterfactual minimiser `s*` pooled over (sink) heads.

        Args:
            sink_heads_only: Pool the sink heads only (else every head).

        Returns:
            A DataFrame with `s_star, count, edge`.

        Examples:
            ```python
            import cw_lens

            model = cw_lens.load_model("testing:tiny-llama")
            corpus = cw_lens.load_corpus(n_docs=2, max_tokens=16, model=model)
            stats = cw_lens.sink_statistics(model, corpus, progress=False)
            stats.s_star_distribution()
            ```
        """
        return s_star_table(self, sink_heads_only=sink_heads_only)

    def samples(self, group: str = "sink") -> pd.DataFrame:
        """The sampled factor entries of one group, one row per entry.

        Args:
            group: `"sink"` (the sink column) or `"tail"` (non-sink keys).

        Returns:
            A DataFrame with `FACTOR_COLUMNS` and `document` (its index in the corpus).

        Examples:
            ```python
            import cw_lens

            model = cw_lens.load_model("testing:tiny-llama")
            corpus = cw_lens.load_corpus(n_docs=2, max_tokens=16, model=model)
            stats = cw_lens.sink_statistics(model, corpus, progress=False)
            stats.samples("sink").head()
            ```
        """
        return sample_table(self, group)

    def drivers(self) -> pd.DataFrame:
        """Each factor's Spearman rank correlation with the contribution weight.

        Returns:
            A DataFrame per (layer, head) and group (sink / tail entries): `rho_attention`,
            `rho_relative_norm`, `rho_cosine`, with `n_samples` and `sink_head` (claim
            `sink_contribution_drivers` reads the sink group of sink heads).

        Examples:
            ```python
            import cw_lens

            model = cw_lens.load_model("testing:tiny-llama")
            corpus = cw_lens.load_corpus(n_docs=2, max_tokens=16, model=model)
            stats = cw_lens.sink_statistics(model, corpus, progress=False)
            stats.drivers().head()
            ```
        """
        heads = self.heads()[["layer", "head", "sink_head"]]
        frames = [head_spearman(self.samples(g)).assign(group=g) for g in ("sink", "tail")]
        table = pd.concat(frames, ignore_index=True)
        return table.merge(heads, on=["layer", "head"], how="left")

    def decomposition(self) -> pd.DataFrame:
        """How each factor drives the weight, per group (sink / tail entries of sink heads).

        Returns:
            A DataFrame: the mean and median over the sampled entries, and the median over sink
            heads of the per-head Spearman rho with the contribution, signed and absolute
            ([`drivers`][cw_lens.SinkStatisticsResult.drivers]).

        Examples:
            ```python
            import cw_lens

            model = cw_lens.load_model("testing:tiny-llama")
            corpus = cw_lens.load_corpus(n_docs=2, max_tokens=16, model=model)
            stats = cw_lens.sink_statistics(model, corpus, progress=False)
            stats.decomposition()
            ```
        """
        return decomposition_table(self)

    claims = moved_to_reproduction("claims")  # deprecated: cw_lens.reproduction.claims(result)
    replicates = moved_to_reproduction("replicates")
    intervals = moved_to_reproduction("intervals")

    # plots
    def plot_value_geometry(self, **kw: Any) -> Any:
        """The sink's value geometry per head: norms, cosines and the cone.

        Args:
            **kw: Passed to `cw_lens.plots.sinks.plot_sink_value_geometry` (`figsize`).

        Returns:
            A matplotlib Figure.

        Examples:
            ```python
            import cw_lens

            model = cw_lens.load_model("testing:tiny-llama")
            corpus = cw_lens.load_corpus(n_docs=2, max_tokens=16, model=model)
            stats = cw_lens.sink_statistics(model, corpus, progress=False)
            fig = stats.plot_value_geometry()
            ```
        """
        from cw_lens.plots.sinks import plot_sink_value_geometry

        return plot_sink_value_geometry(self.heads(), **kw)

    def plot_drivers(self, **kw: Any) -> Any:
        """Which factor drives the sink's contribution (claim `sink_contribution_drivers`).

        Args:
            **kw: Passed to `cw_lens.plots.sinks.plot_sink_contribution_drivers` (`figsize`).

        Returns:
            A matplotlib Figure.

        Examples:
            ```python
            import cw_lens

            model = cw_lens.load_model("testing:tiny-llama")
            corpus = cw_lens.load_corpus(n_docs=2, max_tokens=16, model=model)
            stats = cw_lens.sink_statistics(model, corpus, progress=False)
            fig = stats.plot_drivers()
            ```
        """
        from cw_lens.plots.sinks import plot_sink_contribution_drivers

        return plot_sink_contribution_drivers(self.heads(), self.decomposition(), **kw)

    def plot_curve(self, **kw: Any) -> Any:
        """The output norm against the sink rate, with the distribution of `s*`.

        Args:
            **kw: Passed to `cw_lens.plots.sinks.plot_convex_sink_curve` (`figsize`).

        Returns:
            A matplotlib Figure.

        Examples:
            ```python
            import cw_lens

            model = cw_lens.load_model("testing:tiny-llama")
            corpus = cw_lens.load_corpus(n_docs=2, max_tokens=16, model=model)
            stats = cw_lens.sink_statistics(model, corpus, progress=False)
            fig = stats.plot_curve()
            ```
        """
        from cw_lens.plots.sinks import plot_convex_sink_curve

        return plot_convex_sink_curve(self.curve(), self.s_star_distribution(), self.heads(), **kw)

    def plot_drift(self, **kw: Any) -> Any:
        """How the sink cancels the drift of the tail (claim `sink_cancels_drift`).

        Args:
            **kw: Passed to `cw_lens.plots.sinks.plot_sink_cancels_drift` (`figsize`).

        Returns:
            A matplotlib Figure.

        Examples:
            ```python
            import cw_lens

            model = cw_lens.load_model("testing:tiny-llama")
            corpus = cw_lens.load_corpus(n_docs=2, max_tokens=16, model=model)
            stats = cw_lens.sink_statistics(model, corpus, progress=False)
            fig = stats.plot_drift()
            ```
        """
        from cw_lens.plots.sinks import plot_sink_cancels_drift

        return plot_sink_cancels_drift(self.heads(), **kw)

    def plot(self, **kw: Any) -> Any:
        """The attention-versus-contribution overview per layer (sink heads highlighted).

        Args:
            **kw: Passed to `cw_lens.plots.sinks.plot_sink_attention_vs_contribution` (`figsize`).

        Returns:
            A matplotlib Figure.

        Examples:
            ```python
            import cw_lens

            model = cw_lens.load_model("testing:tiny-llama")
            corpus = cw_lens.load_corpus(n_docs=2, max_tokens=16, model=model)
            stats = cw_lens.sink_statistics(model, corpus, progress=False)
            fig = stats.plot()
            ```
        """
        from cw_lens.plots.sinks import plot_sink_attention_vs_contribution

        return plot_sink_attention_vs_contribution(self.heads(), **kw)


# --------------------------------------------------------------------------- tables


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


def head_spearman(samples: pd.DataFrame, factors: Sequence[str] = DRIVER_FACTORS) -> pd.DataFrame:
    """Per (layer, head): Spearman's rank correlation `rho_<factor>` of each factor with the
    `contribution` over the head's sampled entries (average ranks for ties; NaN with fewer
    than 3 samples or a constant column), and `n_samples`.

    Args:
        samples: Sampled entries with `layer`, `head`, the factors and `contribution` (as
            [`SinkStatisticsResult.samples`][cw_lens.SinkStatisticsResult.samples] gives them).
        factors: The factor columns.

    Returns:
        One row per (layer, head): `layer, head, n_samples, rho_<factor>...`.
    """
    columns = ["layer", "head", "n_samples", *(f"rho_{f}" for f in factors)]
    rows = []
    for (layer, head), g in samples.groupby(["layer", "head"], sort=True):
        corr = g[[*factors, "contribution"]].corr(method="spearman", min_periods=3)
        rho = corr["contribution"]
        rows.append([int(layer), int(head), len(g), *(float(rho[f]) for f in factors)])
    return pd.DataFrame(rows, columns=columns)
