"""The sink statistics of a corpus ([`sink_statistics`][cw_lens.sink_statistics],
[`SinkStatisticsResult`][cw_lens.SinkStatisticsResult]) and the sink rates alone
([`sink_rates`][cw_lens.sink_rates]).
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import pandas as pd
import torch
from jaxtyping import Bool, Float
from torch import Tensor

from cw_lens.analyses.common import CorpusPlan, run_plan
from cw_lens.analyses.sinks.accumulation import (
    DRIVER_FACTORS,
    FACTOR_COLUMNS,
    MAX_SAMPLES_PER_HEAD,
    RATE_BINS,
    RECORDED_SUMS,
    SHARE_BINNING,
    SinkAccumulator,
    head_spearman,
)
from cw_lens.analyses.sinks.claims import LAYER_NUMBERS, MIN_S_STAR_QUERIES, sink_claims
from cw_lens.analyses.sinks.detection import (
    MIN_QUERY,
    SINK_RATE_THRESHOLD,
    SinkPositions,
    resolve_sinks,
)
from cw_lens.core.bootstrap import Bootstrap, require_record
from cw_lens.core.claims import claims_dict, with_intervals
from cw_lens.core.deprecation import keyword_only
from cw_lens.core.errors import InputError
from cw_lens.core.registry import saveable
from cw_lens.core.resampled import (
    driver_numbers,
    per_layer_rows,
    sink_head_fields,
    sink_numbers,
    sink_numbers_per_layer,
)
from cw_lens.core.results import Result
from cw_lens.data.documents import as_corpus
from cw_lens.models.access import Model
from cw_lens.models.capture import resolve_layers


@saveable
@dataclass(repr=False)
class SinkStatisticsResult(Result):
    """Sink geometry of a corpus, per (layer, head); see the module docstring for formulas.

    Use `heads` for the per-head table, `curve` for the empirical sink-rate curves,
    `decomposition` for the factor analysis, `claims` for P1's claims as measured,
    and the `plot_*` methods for figures.
    """

    layers: list[int]
    n_heads: int
    sinks: str
    n_documents: int
    n_tokens: int
    acc: Any = field(repr=False)
    min_query: int = MIN_QUERY
    threshold: float = SINK_RATE_THRESHOLD

    def _total(self, name: str) -> Tensor:
        rows = []
        for layer in self.layers:
            key = f"{name}@{layer}"
            rows.append(
                self.acc.sums.total(key)
                if key in self.acc.sums
                else torch.zeros(self.n_heads, dtype=torch.float64, device="cpu")
            )
        return torch.stack(rows)  # [layer, head, ...]

    def _mean(self, name: str, count: str) -> Tensor:
        """Sum / count; NaN where nothing was counted (e.g. no query reached min_query)."""
        total, n = self._total(name), self._total(count)
        return torch.where(n > 0, total / n.clamp_min(1), torch.full_like(total, math.nan))

    @property
    def sink_rate(self) -> Float[Tensor, "layer head"]:
        """Mean sink rate over queries `i >= min_query`."""
        return self._mean("rate_sum", "rate_count")

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
        rate = self.sink_rate
        data = {
            "layer": np.repeat(self.layers, self.n_heads),
            "head": np.tile(np.arange(self.n_heads), len(self.layers)),
            "sink_rate": rate.flatten(),
            "sink_head": self.sink_heads.flatten(),
            "sink_rate_all_queries": self._mean("rate_all_sum", "rate_all_count").flatten(),
            "output_norm": self._mean("norm_sum", "rate_all_count").flatten(),
            "norm_ratio": self._mean("ratio_sum", "geometry_count").flatten(),
            "norm_ratio_geomean": self._mean("log_ratio_sum", "geometry_count").exp().flatten(),
            "cos_sink_token": self._mean("cos_token_sum", "geometry_count").flatten(),
            "cos_sink_mixture": self._mean("cos_mixture_sum", "cos_mixture_count").flatten(),
        }
        for group in ("sink", "tail"):
            for name in FACTOR_COLUMNS[4:]:
                data[f"{group}_{name}"] = self._mean(
                    f"{group}_{name}_sum", f"{group}_count"
                ).flatten()
        data["s_star_median"] = self.acc.s_star.quantile(0.5).flatten()
        data["s_star_at_0"] = self.acc.s_star.share_at_or_below_lo().flatten()
        data["s_star_at_1"] = self.acc.s_star.share_at_or_above_hi().flatten()
        data["s_star_count"] = self.acc.s_star.total.flatten()
        data["drift_cos_median"] = self.acc.drift_cos.quantile(0.5).flatten()
        data["drift_negative_share"] = self._mean("drift_neg", "drift_count").flatten()
        data["drift_cancelled_median"] = self.acc.drift_share.quantile(0.5).flatten()
        data["drift_count"] = self._total("drift_count").flatten()
        df = pd.DataFrame({k: np.asarray(v) for k, v in data.items()})
        df["s_star_interior"] = (
            (df["s_star_count"] > 0) & (df["s_star_at_0"] < 0.5) & (df["s_star_at_1"] < 0.5)
        )
        return df

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
        self.layer_index(layer)
        return replace(self, layers=[layer], acc=self.acc.select_layer(layer))

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
        norm, count = self._total("curve_norm"), self._total("curve_count")
        rows = []
        heads = self.sink_heads
        for li, layer in enumerate(self.layers):
            for h in range(self.n_heads):
                if sink_heads_only and not heads[li, h]:
                    continue
                for b in range(RATE_BINS):
                    n = int(count[li, h, b])
                    if n:
                        rows.append((layer, h, (b + 0.5) / RATE_BINS, float(norm[li, h, b]) / n, n))
        return pd.DataFrame(rows, columns=["layer", "head", "sink_rate", "output_norm", "count"])

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
        hist = self.acc.s_star
        sel = self.sink_heads if sink_heads_only else torch.ones_like(self.sink_heads)
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
        if group not in ("sink", "tail"):
            raise InputError(f"group must be 'sink' or 'tail', got {group!r}.")
        reservoir = self.acc.samples
        groups = [g for g in reservoir.groups() if g.split("/")[0] == group]
        rows = torch.cat(
            [reservoir.table(g) for g in groups]
            or [torch.zeros(0, len(FACTOR_COLUMNS), device="cpu")]
        )
        docs = torch.cat([reservoir.documents(g) for g in groups] or [torch.zeros(0, device="cpu")])
        df = pd.DataFrame(rows.numpy(), columns=list(FACTOR_COLUMNS))
        df["document"] = docs.numpy().astype("int64")
        df = df.sort_values(["layer", "head", "query", "key"], kind="stable", ignore_index=True)
        return df.astype({c: "int64" for c in ("layer", "head", "query", "key")})

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

    def _driver_samples(self) -> list[tuple[int, int, Tensor, Tensor]] | None:
        """Per head, the sink group's factor samples and their documents, as
        `cw_lens.core.resampled.driver_numbers` reads them (None if any document is
        unknown)."""
        reservoir, index = self.acc.samples, {layer: i for i, layer in enumerate(self.layers)}
        columns = [FACTOR_COLUMNS.index(c) for c in (*DRIVER_FACTORS, "contribution")]
        out = []
        for group in reservoir.groups():
            kind, layer, head = group.split("/")
            if kind != "sink":
                continue
            docs = reservoir.documents(group)
            if (docs < 0).any():
                return None
            table = reservoir.table(group)[:, columns]
            out.append((index[int(layer)], int(head), table.double(), docs))
        return out

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
        drivers = self.drivers()
        drivers = drivers[drivers["sink_head"].eq(True)]
        heads = set(map(tuple, self.sink_heads.nonzero().tolist()))
        rows = []
        for group in ("sink", "tail"):
            table = self.samples(group)
            layer_index = table["layer"].map({layer: i for i, layer in enumerate(self.layers)})
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
                        "median_head_abs_rho": float(rho[col].abs().median())
                        if col in rho
                        else 1.0,
                        "n_samples": len(values),
                    }
                )
        return pd.DataFrame(rows)

    def claims(self, bootstrap: Bootstrap | None = None) -> dict[str, dict[str, Any]]:
        """P1/P2's sink claims (docs/methods.md#claims) with the numbers measured here.

        With `per_document=True`, `median_cancelled_share` is read as its interval is: from the
        coarse per-document histograms, summed (`cw_lens.core.resampled`); without, from the
        fine histogram of [`heads`][cw_lens.SinkStatisticsResult.heads].

        Args:
            bootstrap: With a `cw_lens.core.bootstrap.Bootstrap`, every number's interval over
                documents and the per-layer detail
                ([`intervals`][cw_lens.SinkStatisticsResult.intervals]; needs `per_document=True`).

        Returns:
            `{claim id: claim}`, each claim a JSON-ready dict with whether it holds and its
            `measured` numbers.

        Examples:
            ```python
            import cw_lens

            model = cw_lens.load_model("testing:tiny-llama")
            corpus = cw_lens.load_corpus(n_docs=2, max_tokens=16, model=model)
            stats = cw_lens.sink_statistics(model, corpus, per_document=True, progress=False)
            from cw_lens.core.bootstrap import Bootstrap

            sorted(stats.claims())
            stats.claims(Bootstrap(resamples=50))
            ```
        """
        claims = sink_claims(self.heads(), self.drivers())
        if self.acc.share_hist is not None:  # the cancelled share read as its interval reads it
            name = "median_cancelled_share"  # from the coarse histograms (core.resampled)
            share = float(sink_numbers(self._point_fields(), MIN_S_STAR_QUERIES)[name][0])
            for claim in claims:
                claim.checks = [
                    replace(c, value=share) if c.number == name else c for c in claim.checks
                ]
        if bootstrap is not None:
            claims = with_intervals(claims, *self.intervals(bootstrap))
        return claims_dict(claims)

    def replicates(
        self, bootstrap: Bootstrap, *, drivers: bool = True
    ) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
        """The sink claims' numbers in every row of `bootstrap.weights`.

        Rows are the resamples, the corpus and the leave-one-out corpora (`cw_lens.core.resampled`
        says what each number is of).

        Args:
            bootstrap: The resampling of documents (`cw_lens.core.bootstrap.Bootstrap`); the result
                needs `per_document=True`.
            drivers: `False` leaves out `sink_contribution_drivers`' numbers, most of the cost at
                hundreds of documents.

        Returns:
            `({number: [rows]}, {per-head field: [rows, ...]})`: the numbers and the per-head
            fields they come from.

        Examples:
            ```python
            import cw_lens

            model = cw_lens.load_model("testing:tiny-llama")
            corpus = cw_lens.load_corpus(n_docs=2, max_tokens=16, model=model)
            stats = cw_lens.sink_statistics(model, corpus, per_document=True, progress=False)
            from cw_lens.core.bootstrap import Bootstrap

            numbers, fields = stats.replicates(Bootstrap(resamples=50), drivers=False)
            ```
        """
        per_doc = require_record(self.acc.per_doc, "sink_statistics")
        record = per_doc.table()
        reps = bootstrap.resample(record)  # [rows, statistic, layer, head]
        fields = sink_head_fields(
            {name: reps[:, i] for i, name in enumerate(per_doc.names)},
            bootstrap.resample(self.acc.share_hist.table("drift_share")),
            SHARE_BINNING,
            self.threshold,
        )
        numbers = sink_numbers(fields, MIN_S_STAR_QUERIES)
        samples = self._driver_samples() if drivers else None
        if samples is not None:  # None: samples stored without their documents (before 0.2.1)
            weights = bootstrap.weights(record.shape[0])
            numbers.update(driver_numbers(samples, DRIVER_FACTORS, weights, fields["sink"]))
        return numbers, fields

    def intervals(
        self, bootstrap: Bootstrap
    ) -> tuple[dict[str, tuple[float, float]], dict[str, list[dict[str, Any]]]]:
        """Bootstrap intervals over documents of the sink claims' numbers.

        `median_abs_rho_*`: the factor samples are weighted by how often their document is drawn
        (`cw_lens.core.resampled.driver_numbers`).

        Args:
            bootstrap: The resampling of documents (`cw_lens.core.bootstrap.Bootstrap`); the result
                needs `per_document=True`.

        Returns:
            `({number: (low, high)}, {claim id: per-layer rows})` for the claims about layers.

        Examples:
            ```python
            import cw_lens

            model = cw_lens.load_model("testing:tiny-llama")
            corpus = cw_lens.load_corpus(n_docs=2, max_tokens=16, model=model)
            stats = cw_lens.sink_statistics(model, corpus, per_document=True, progress=False)
            from cw_lens.core.bootstrap import Bootstrap

            intervals, per_layer = stats.intervals(Bootstrap(resamples=50))
            ```
        """
        numbers, fields = self.replicates(bootstrap)
        intervals = {k: bootstrap.pair(v, number=k) for k, v in numbers.items()}
        point_layers = sink_numbers_per_layer(self._point_fields(), MIN_S_STAR_QUERIES)
        rep_layers = sink_numbers_per_layer(fields, MIN_S_STAR_QUERIES)
        per_layer = {
            cid: per_layer_rows(
                self.layers,
                number,
                point_layers[number][0],
                *bootstrap.judged(rep_layers[number], number=number),
            )
            for cid, number in LAYER_NUMBERS.items()
        }
        return intervals, per_layer

    def _point_fields(self) -> dict[str, Tensor]:
        """`cw_lens.core.resampled.sink_head_fields` of the corpus totals (one row): what the
        replicates' formula gives on the whole corpus, the cancelled share read from the coarse
        per-document histograms summed (needs `per_document=True`)."""
        exact = {name: self._total(name)[None] for name in RECORDED_SUMS[:11]}
        counts = self.acc.s_star.counts[None].double()
        exact.update(s_star_lo=counts[..., 0], s_star_hi=counts[..., -1], s_star_n=counts.sum(-1))
        share = self.acc.share_hist.table("drift_share").double().sum(0)[None]
        return sink_head_fields(exact, share, SHARE_BINNING, self.threshold)

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


def sink_statistics(
    model: Model,
    corpus: Any,
    *,
    sink_positions: SinkPositions = (0,),
    layers: Any = None,
    batch_size: int | None = 8,
    min_query: int = MIN_QUERY,
    drift_k: int = 4,
    samples_per_head: int = 128,
    max_samples: int = MAX_SAMPLES_PER_HEAD,
    seed: int = 0,
    prepend_bos: bool = True,
    progress: bool = True,
    per_document: bool = False,
) -> SinkStatisticsResult:
    """Sink geometry over a corpus in one streamed pass (docs/methods.md#sinks).

    Args:
        model: A `TransformerBridge`.
        corpus: `load_corpus(...)` output or a list of strings.
        sink_positions: Sink positions (default BOS, position 0) or `"detect"` (per document,
            keys whose mean attention exceeds 0.3 in some head). Positions count from each
            document's first token (BOS is 0; right padding never shifts them) and must be
            tokens of every document: one beyond a document raises
            [`InputError`][cw_lens.InputError] naming the document and its length.
        layers: Layers (`None` = all).
        batch_size: Documents per forward pass.
        min_query: Queries `i >= min_query` define sink rates and curves (methods page: 16).
        drift_k: Top-attended tail tokens kept out of the drift (methods page: 4).
        samples_per_head: Factor samples per (document, layer, head) and group (sink /
            tail entries) for the per-head rank correlations
            ([`SinkStatisticsResult.drivers`][cw_lens.SinkStatisticsResult.drivers]).
        max_samples: Factor samples kept per (layer, head) and group over the whole corpus (a
            seeded bottom-k reservoir: the same sample whatever the sharding; memory fixed at
            about 80 bytes per sample, 44 MB for SmolLM2's 270 heads at the default); small
            corpora keep every sample drawn.
        seed: Seed of the factor sampling (per document, so sharded runs sample the same).
        prepend_bos: Prepend BOS to text.
        progress: Show a progress bar.
        per_document: Also keep each document's sums per head (`RECORDED_SUMS` and a coarse
            cancelled-share histogram: `4 * (14 + 26) * n_layers * n_heads + 2` bytes per
            document, 43.2 KB for SmolLM2-135M's 270 heads) so that
            [`SinkStatisticsResult.claims`][cw_lens.SinkStatisticsResult.claims] can give bootstrap
            intervals.

    Returns:
        A [`SinkStatisticsResult`][cw_lens.SinkStatisticsResult].

    Examples:
        ```python
        import cw_lens

        model = cw_lens.load_model("testing:tiny-llama")
        corpus = cw_lens.load_corpus(n_docs=2, max_tokens=16, model=model)
        stats = cw_lens.sink_statistics(model, corpus, progress=False)
        stats.heads()        # per head: sink rate, value norms, cosines, s*, drift
        stats.top(5)
        ```
    """
    plan = _plan_sink_statistics(
        model,
        corpus,
        sink_positions=sink_positions,
        layers=layers,
        batch_size=batch_size,
        min_query=min_query,
        drift_k=drift_k,
        samples_per_head=samples_per_head,
        max_samples=max_samples,
        seed=seed,
        prepend_bos=prepend_bos,
        per_document=per_document,
    )
    label = progress and "sink statistics"
    return run_plan(
        model, corpus, plan, batch_size=batch_size, prepend_bos=prepend_bos, progress=label
    )


def _plan_sink_statistics(
    model: Model,
    corpus: Any,
    *,
    sink_positions: SinkPositions,
    layers: Any,
    batch_size: int | None,
    min_query: int,
    drift_k: int,
    samples_per_head: int,
    max_samples: int,
    seed: int,
    prepend_bos: bool,
    per_document: bool,
    **_: Any,
) -> CorpusPlan:
    """[`sink_statistics`][cw_lens.sink_statistics]'s checks, sink positions (detected by a
    pass of their own with `"detect"`) and accumulator, as a `CorpusPlan`."""
    if drift_k < 1:
        raise InputError(f"drift_k must be at least 1, got {drift_k}.")
    if min_query < 1:
        raise InputError(f"min_query must be at least 1, got {min_query}.")
    if samples_per_head < 0:
        raise InputError(f"samples_per_head must be >= 0, got {samples_per_head}.")
    layer_list = resolve_layers(model, layers)
    sinks = resolve_sinks(
        model, corpus, sink_positions, batch_size=batch_size, prepend_bos=prepend_bos
    )
    accumulator = SinkAccumulator(
        layer_list,
        model.cfg.n_heads,
        sinks,
        min_query=min_query,
        drift_k=drift_k,
        samples_per_head=samples_per_head,
        max_samples=max_samples,
        seed=seed,
        n_documents=len(as_corpus(corpus)) if per_document else None,
    )

    def finish(acc: SinkAccumulator, stats: Any) -> SinkStatisticsResult:
        result = SinkStatisticsResult(
            layer_list,
            model.cfg.n_heads,
            sinks.describe(),
            stats.n_documents,
            stats.n_tokens,
            acc,
            min_query,
        )
        if bool(result.sink_rate.isnan().all()):
            warnings.warn(
                f"No query at position >= min_query={min_query} after a sink: the documents are "
                "too short (or no sink position lies inside them), so sink rates are NaN and no "
                "head is a sink head. Use longer texts or a smaller min_query.",
                RuntimeWarning,
                stacklevel=4,
            )
        return result

    return CorpusPlan("sinks", accumulator, layer_list, finish)
