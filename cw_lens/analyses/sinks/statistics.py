"""The sink statistics of a corpus: their result class
([`SinkStatisticsResult`][cw_lens.SinkStatisticsResult]) and the entry point
([`sink_statistics`][cw_lens.sink_statistics], whose pass is in
`cw_lens.analyses.sinks.statistics_pass`; the result's tables are read in
`cw_lens.analyses.sinks.statistics_tables`).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, replace
from typing import Any

import pandas as pd
import torch
from jaxtyping import Bool, Float
from torch import Tensor

from cw_lens.analyses.sinks.accumulation import (
    DRIVER_FACTORS,
    RECORDED_SUMS,
    SHARE_BIN_SUMS,
    SHARE_BINNING,
    head_spearman,
)
from cw_lens.analyses.sinks.claims import LAYER_NUMBERS, MIN_S_STAR_QUERIES, sink_claims
from cw_lens.analyses.sinks.detection import MIN_QUERY, SINK_RATE_THRESHOLD
from cw_lens.analyses.sinks.statistics_pass import sink_statistics as sink_statistics
from cw_lens.analyses.sinks.statistics_tables import (
    curve_table,
    decomposition_table,
    driver_samples,
    head_table,
    layer_mean,
    layer_total,
    s_star_table,
    sample_table,
)
from cw_lens.core.accumulators import Histogram
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


@saveable
@dataclass(repr=False)
class SinkStatisticsResult(Result):
    """Sink geometry of a corpus, per (layer, head); see the module docstring for formulas.

    Use `heads` for the per-head table, `curve` for the empirical sink-rate curves,
    `decomposition` for the factor analysis, `claims` for P1's claims as measured,
    and the `plot_*` methods for figures.

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
        if self.record is not None:  # the cancelled share read as its interval reads it
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
        record = require_record(self.record, "sink_statistics")
        reps = bootstrap.resample(record)  # [rows, layer, head, recorded]
        names = list(self.record_names)
        share = [names.index(n) for n in SHARE_BIN_SUMS]
        fields = sink_head_fields(
            {name: reps[..., names.index(name)] for name in RECORDED_SUMS},
            reps[..., share],
            SHARE_BINNING,
            self.threshold,
        )
        numbers = sink_numbers(fields, MIN_S_STAR_QUERIES)
        samples = driver_samples(self) if drivers else None
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
        per-document histograms summed (their corpus totals)."""
        exact = {name: layer_total(self, name)[None] for name in RECORDED_SUMS[:11]}
        counts = self.s_star.counts[None].double()
        exact.update(s_star_lo=counts[..., 0], s_star_hi=counts[..., -1], s_star_n=counts.sum(-1))
        share = torch.stack([layer_total(self, n) for n in SHARE_BIN_SUMS], -1)[None]
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
