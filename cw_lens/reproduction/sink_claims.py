"""P1's sink claims (value geometry, convex curve, drift, drivers, the sink-norm ablation)
judged from the sink results: the claims from the sink tables (`sink_claims`), and the
registered implementations of `cw_lens.reproduction.claims`, `replicates` and `intervals` for
[`SinkStatisticsResult`][cw_lens.SinkStatisticsResult] and
[`SinkAblationResult`][cw_lens.SinkAblationResult].

The layout of the sums they read (`RECORDED_SUMS`, the cancelled-share bins) is the toolkit's
(`cw_lens.analyses.sinks.statistics_layout`); what only the claims use lives here
(`MIN_S_STAR_QUERIES`, `LAYER_NUMBERS`).
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

import numpy as np
import pandas as pd
import torch
from torch import Tensor

from cw_lens.analyses.sinks.ablation import SinkAblationResult
from cw_lens.analyses.sinks.statistics import SinkStatisticsResult, layer_total
from cw_lens.analyses.sinks.statistics_layout import (
    DRIVER_FACTORS,
    GROUPS,
    RECORDED_FIELD_SUMS,
    RECORDED_SUMS,
    SAMPLE_COLUMNS,
    SHARE_BIN_SUMS,
    SHARE_BINNING,
)
from cw_lens.reproduction.bootstrap import Bootstrap, require_record
from cw_lens.reproduction.protocol import claims, intervals, replicates
from cw_lens.reproduction.resampled import (
    ablation_numbers,
    driver_numbers,
    per_layer_rows,
    sink_head_fields,
    sink_numbers,
    sink_numbers_per_layer,
)
from cw_lens.reproduction.verdicts import Check, Claim, ClaimsDict, claims_dict, with_intervals

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

    Returns:
        The claims, in the methods page's order. With no sink head every number is NaN and no
        claim holds.
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
    """The median of a column; NaN for an empty table.

    Args:
        frame: The table.
        col: The column.

    Returns:
        The median.
    """
    return float(frame[col].median()) if len(frame) else math.nan


def mean(values: Any) -> float:
    """The mean; NaN for no values.

    Args:
        values: The values (an array or a column).

    Returns:
        The mean.
    """
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


# --------------------------------------------------------------------------- sink statistics


def point_fields(result: SinkStatisticsResult) -> dict[str, Tensor]:
    """`cw_lens.reproduction.resampled.sink_head_fields` of the corpus totals (one row): what
    the replicates' formula gives on the whole corpus.

    The sums `RECORDED_FIELD_SUMS` are the result's corpus totals, the s* edge counts are read
    from its s* histogram, and the cancelled share from the coarse per-document histograms
    summed (their corpus totals).

    Args:
        result: A [`sink_statistics`][cw_lens.sink_statistics] result.

    Returns:
        The per-head fields, each `[1, layer, head]`.
    """
    exact = {name: layer_total(result, name)[None] for name in RECORDED_FIELD_SUMS}
    counts = result.s_star.counts[None].double()
    exact.update(s_star_lo=counts[..., 0], s_star_hi=counts[..., -1], s_star_n=counts.sum(-1))
    share = torch.stack([layer_total(result, n) for n in SHARE_BIN_SUMS], -1)[None]
    return sink_head_fields(exact, share, SHARE_BINNING, result.threshold)


def driver_samples(result: SinkStatisticsResult) -> list[tuple[int, int, Tensor, Tensor]]:
    """Per head, the sink group's factor samples and their documents, as
    `cw_lens.reproduction.resampled.driver_numbers` reads them.

    Args:
        result: A [`sink_statistics`][cw_lens.sink_statistics] result.

    Returns:
        `(layer index, head, samples [n, factors + contribution] float64, documents)` per head
        with samples.
    """
    index = {layer: i for i, layer in enumerate(result.layers)}
    table = result.samples_table
    table = table[table[:, 0] == GROUPS.index("sink"), 1:].double()
    columns = [SAMPLE_COLUMNS.index(c) for c in (*DRIVER_FACTORS, "contribution")]
    out = []
    for layer, head in sorted({(int(a), int(h)) for a, h in table[:, :2].tolist()}):
        mine = table[(table[:, 0] == layer) & (table[:, 1] == head)]
        out.append((index[layer], head, mine[:, columns], mine[:, -1].long()))
    return out


@claims.register(SinkStatisticsResult)
def sink_statistics_claims(
    result: SinkStatisticsResult, bootstrap: Bootstrap | None = None
) -> ClaimsDict:
    """P1/P2's sink claims (docs/methods.md#claims) with the numbers measured in `result`.

    With `per_document=True`, `median_cancelled_share` is read as its interval is: from the
    coarse per-document histograms, summed (`point_fields`); without, from the fine histogram
    of [`heads`][cw_lens.SinkStatisticsResult.heads].

    Args:
        result: A [`sink_statistics`][cw_lens.sink_statistics] result.
        bootstrap: With a [`Bootstrap`][cw_lens.reproduction.Bootstrap], every number's
            interval over documents and the per-layer detail (`sink_statistics_intervals`;
            needs `per_document=True`).

    Returns:
        `{claim id: claim}`, each claim a JSON-ready dict with whether it holds and its
        `measured` numbers.

    Examples:
        ```python
        import cw_lens
        from cw_lens.reproduction import Bootstrap, claims

        model = cw_lens.load_model("testing:tiny-llama")
        corpus = cw_lens.load_corpus(n_docs=2, max_tokens=16, model=model)
        stats = cw_lens.sink_statistics(model, corpus, per_document=True, progress=False)
        sorted(claims(stats))
        claims(stats, Bootstrap(resamples=50))
        ```
    """
    judged = sink_claims(result.heads(), result.drivers())
    if result.record is not None:  # the cancelled share read as its interval reads it
        name = "median_cancelled_share"  # from the coarse histograms (reproduction.resampled)
        share = float(sink_numbers(point_fields(result), MIN_S_STAR_QUERIES)[name][0])
        for claim in judged:
            claim.checks = [
                replace(c, value=share) if c.number == name else c for c in claim.checks
            ]
    if bootstrap is not None:
        judged = with_intervals(judged, *sink_statistics_intervals(result, bootstrap))
    return claims_dict(judged)


@replicates.register(SinkStatisticsResult)
def sink_statistics_replicates(
    result: SinkStatisticsResult, bootstrap: Bootstrap, *, drivers: bool = True
) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
    """The sink claims' numbers in every row of `bootstrap.weights`.

    Rows are the resamples, the corpus and the leave-one-out corpora
    (`cw_lens.reproduction.resampled` says what each number is of).

    Args:
        result: A [`sink_statistics`][cw_lens.sink_statistics] result run with
            `per_document=True`.
        bootstrap: The resampling of documents.
        drivers: `False` leaves out `sink_contribution_drivers`' numbers, most of the cost at
            hundreds of documents.

    Returns:
        `({number: [rows]}, {per-head field: [rows, ...]})`: the numbers and the per-head
        fields they come from.

    Examples:
        ```python
        import cw_lens
        from cw_lens.reproduction import Bootstrap, replicates

        model = cw_lens.load_model("testing:tiny-llama")
        corpus = cw_lens.load_corpus(n_docs=2, max_tokens=16, model=model)
        stats = cw_lens.sink_statistics(model, corpus, per_document=True, progress=False)
        numbers, fields = replicates(stats, Bootstrap(resamples=50), drivers=False)
        ```
    """
    record = require_record(result.record, "sink_statistics")
    reps = bootstrap.resample(record)  # [rows, layer, head, recorded]
    names = list(result.record_names)
    share = [names.index(n) for n in SHARE_BIN_SUMS]
    fields = sink_head_fields(
        {name: reps[..., names.index(name)] for name in RECORDED_SUMS},
        reps[..., share],
        SHARE_BINNING,
        result.threshold,
    )
    numbers = sink_numbers(fields, MIN_S_STAR_QUERIES)
    samples = driver_samples(result) if drivers else None
    if samples is not None:  # None: samples stored without their documents (before 0.2.1)
        weights = bootstrap.weights(record.shape[0])
        numbers.update(driver_numbers(samples, DRIVER_FACTORS, weights, fields["sink"]))
    return numbers, fields


@intervals.register(SinkStatisticsResult)
def sink_statistics_intervals(
    result: SinkStatisticsResult, bootstrap: Bootstrap
) -> tuple[dict[str, tuple[float, float]], dict[str, list[dict[str, Any]]]]:
    """Bootstrap intervals over documents of the sink claims' numbers.

    `median_abs_rho_*`: the factor samples are weighted by how often their document is drawn
    (`cw_lens.reproduction.resampled.driver_numbers`).

    Args:
        result: A [`sink_statistics`][cw_lens.sink_statistics] result run with
            `per_document=True`.
        bootstrap: The resampling of documents.

    Returns:
        `({number: (low, high)}, {claim id: per-layer rows})` for the claims about layers
        (`LAYER_NUMBERS`).

    Examples:
        ```python
        import cw_lens
        from cw_lens.reproduction import Bootstrap, intervals

        model = cw_lens.load_model("testing:tiny-llama")
        corpus = cw_lens.load_corpus(n_docs=2, max_tokens=16, model=model)
        stats = cw_lens.sink_statistics(model, corpus, per_document=True, progress=False)
        found, per_layer = intervals(stats, Bootstrap(resamples=50))
        ```
    """
    numbers, fields = sink_statistics_replicates(result, bootstrap)
    found = {k: bootstrap.pair(v, number=k) for k, v in numbers.items()}
    point_layers = sink_numbers_per_layer(point_fields(result), MIN_S_STAR_QUERIES)
    rep_layers = sink_numbers_per_layer(fields, MIN_S_STAR_QUERIES)
    per_layer = {
        cid: per_layer_rows(
            result.layers,
            number,
            point_layers[number][0],
            *bootstrap.judged(rep_layers[number], number=number),
        )
        for cid, number in LAYER_NUMBERS.items()
    }
    return found, per_layer


# --------------------------------------------------------------------------- sink ablation


def sink_ablation_cone_claim(result: SinkAblationResult) -> Claim:
    """`sink_ablation_cone` (docs/methods.md#claims) as measured in `result`: cone alignment
    rises more in the low-norm heads than in the others, and PPL rises.

    Args:
        result: A [`sink_ablation`][cw_lens.sink_ablation] result.

    Returns:
        The claim.
    """
    summary = result.summary()

    def group_mean(group: str, column: str) -> float:
        return float(summary.loc[group, column]) if group in summary.index else math.nan

    cone = {
        f"{prefix}_cone_{when}": group_mean(group, f"cone_{when}")
        for prefix, group in (("low_norm", "low-norm heads"), ("other", "other heads"))
        for when in ("before", "after")
    }
    rise_low = cone["low_norm_cone_after"] - cone["low_norm_cone_before"]
    rise_other = cone["other_cone_after"] - cone["other_cone_before"]
    return Claim(
        "sink_ablation_cone",
        paper="removing the sink norm collapses low-norm heads into the semantic cone, PPL up (P1)",
        criterion="cone alignment rises more in low-norm heads than in the others, and PPL rises",
        checks=[
            Check("cone_rise_low_norm_minus_other", rise_low - rise_other, ">", 0.0),
            Check("delta_ppl", result.delta_ppl, ">", 0.0),
        ],
        measured={
            **cone,
            "clean_ppl": result.clean_ppl,
            "patched_ppl": result.patched_ppl,
            "delta_nll": result.delta_nll,
            "effect": result.effect,
            "layers": result.layers,
            "scale": result.scale,
            "mode": result.mode,
        },
    )


@claims.register(SinkAblationResult)
def sink_ablation_claims(
    result: SinkAblationResult, bootstrap: Bootstrap | None = None
) -> ClaimsDict:
    """P1's ablation claim (docs/methods.md#claims `sink_ablation_cone`), measured.

    Args:
        result: A [`sink_ablation`][cw_lens.sink_ablation] result.
        bootstrap: With a [`Bootstrap`][cw_lens.reproduction.Bootstrap], each number's interval
            over documents (each resample re-picks the low-norm quarter; needs
            `per_document=True`).

    Returns:
        `{claim id: claim}`, each claim a JSON-ready dict with whether it holds and its
        `measured` numbers.

    Examples:
        ```python
        import cw_lens
        from cw_lens.reproduction import Bootstrap, claims

        model = cw_lens.load_model("testing:tiny-llama")
        corpus = cw_lens.load_corpus(n_docs=2, max_tokens=16, model=model)
        ablation = cw_lens.sink_ablation(model, corpus, per_document=True, progress=False)
        claims(ablation)["sink_ablation_cone"]["holds"]
        claims(ablation, Bootstrap(resamples=100))
        ```
    """
    judged = [sink_ablation_cone_claim(result)]
    if bootstrap is not None:
        judged = with_intervals(judged, *sink_ablation_intervals(result, bootstrap))
    return claims_dict(judged)


@replicates.register(SinkAblationResult)
def sink_ablation_replicates(result: SinkAblationResult, bootstrap: Bootstrap) -> dict[str, Tensor]:
    """`sink_ablation_cone`'s numbers in every row of `bootstrap.weights`.

    Args:
        result: A [`sink_ablation`][cw_lens.sink_ablation] result run with
            `per_document=True`.
        bootstrap: The resampling of documents.

    Returns:
        `{number: tensor of one value per row}`.

    Examples:
        ```python
        import cw_lens
        from cw_lens.reproduction import Bootstrap, replicates

        model = cw_lens.load_model("testing:tiny-llama")
        corpus = cw_lens.load_corpus(n_docs=2, max_tokens=16, model=model)
        ablation = cw_lens.sink_ablation(model, corpus, per_document=True, progress=False)
        reps = replicates(ablation, Bootstrap(resamples=100))
        ```
    """
    heads, nll, planned = require_record(result.per_document, "sink_ablation")
    return ablation_numbers(
        bootstrap.resample(heads), bootstrap.resample(nll), planned, result.low_norm_quantile
    )


@intervals.register(SinkAblationResult)
def sink_ablation_intervals(
    result: SinkAblationResult, bootstrap: Bootstrap
) -> tuple[dict[str, tuple[float, float]], dict[str, list[dict[str, Any]]]]:
    """The 95% intervals over documents of `sink_ablation_cone`'s numbers (no claim of it is
    about layers: the per-layer detail is empty).

    Args:
        result: A [`sink_ablation`][cw_lens.sink_ablation] result run with
            `per_document=True`.
        bootstrap: The resampling of documents.

    Returns:
        `({number: (low, high)}, {})`.

    Examples:
        ```python
        import cw_lens
        from cw_lens.reproduction import Bootstrap, intervals

        model = cw_lens.load_model("testing:tiny-llama")
        corpus = cw_lens.load_corpus(n_docs=2, max_tokens=16, model=model)
        ablation = cw_lens.sink_ablation(model, corpus, per_document=True, progress=False)
        found, _ = intervals(ablation, Bootstrap(resamples=100))
        ```
    """
    reps = sink_ablation_replicates(result, bootstrap)
    return {k: bootstrap.pair(v, number=k) for k, v in reps.items()}, {}
