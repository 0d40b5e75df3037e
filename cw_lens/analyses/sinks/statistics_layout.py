"""The layout of the sink statistics (docs/methods.md#sinks): the names, in order, of the sums
`SinkStatisticsAccumulator` stacks per (layer, head) and of the per-document record it keeps,
the binnings of its histograms, and the columns of its factor sample. The accumulator writes
them and [`SinkStatisticsResult`][cw_lens.SinkStatisticsResult] reads its tables by them.
"""

from __future__ import annotations

RATE_BINS = 20


# the cancelled share is a ratio without a natural range: asinh bins, ~0.2% wide near 0 and
# 1.9% relative beyond, over +-1e9 (docs/methods.md#claims reads per-head medians from unclipped
# values)
DRIFT_SHARE_BINNING = dict(lo=-1e9, hi=1e9, n_bins=3000, scale="asinh", unit=1e-3)
DRIVER_FACTORS = ("attention", "relative_norm", "cosine")
# the per-document record a bootstrap over documents reads (`per_document=True`): the sums of
# the per-head fields (sink rate, the sink's attention and contribution, value norm ratio,
# cos(pv_0, m_i), drift sign) per (layer, head) ...
RECORDED_FIELD_SUMS = (
    "rate_sum",
    "rate_count",
    "sink_attention_sum",
    "sink_contribution_sum",
    "sink_count",
    "ratio_sum",
    "geometry_count",
    "cos_mixture_sum",
    "cos_mixture_count",
    "drift_neg",
    "drift_count",
)
# ... and the s* edge counts (s* <= 0, s* >= 1, counted), which the s* histogram also holds
S_STAR_EDGE_SUMS = ("s_star_lo", "s_star_hi", "s_star_n")
RECORDED_SUMS = (*RECORDED_FIELD_SUMS, *S_STAR_EDGE_SUMS)
# and a coarse histogram of the cancelled share per (layer, head): 24 bins equal in
# asinh(v / 1e-3) on [-10, 10] (an edge at 0; ~1e-3 wide near 0, 2.5x relative beyond) plus the
# two edge bins
SHARE_BINNING = dict(lo=-10.0, hi=10.0, n_bins=24, scale="asinh", unit=1e-3)
SHARE_BIN_SUMS = tuple(f"drift_share_{i}" for i in range(SHARE_BINNING["n_bins"] + 2))


# factor samples kept per (layer, head) and group (sink / tail entries) over the whole corpus
# for the per-head rank correlations: the entries with the smallest keys (`entry_keys`)
MAX_SAMPLES_PER_HEAD = 1024
FACTOR_COLUMNS = (
    "layer",
    "head",
    "query",
    "key",
    "attention",
    "relative_norm",
    "cosine",
    "contribution",
)
SAMPLE_COLUMNS = (*FACTOR_COLUMNS, "document")
GROUPS = ("sink", "tail")
FACTOR_FIELDS = ("attention", "relative_norm", "cosine", "contribution")

# The per-(layer, head) sums, in the order one block stacks them (the last axis of
# `SinkStatisticsResult.sums`): per-query statistics summed over queries, the coarse
# cancelled-share histogram, the factor sums over (query, key) entries of each group, and the
# value geometry over (sink, tail token) pairs (first block of a layer only).
QUERY_SUMS = (
    "rate_sum",
    "rate_count",
    "cos_mixture_sum",
    "cos_mixture_count",
    "drift_neg",
    "drift_count",
    "s_star_lo",
    "s_star_hi",
    "s_star_n",
    "rate_all_sum",
    "rate_all_count",
    "norm_sum",
)
FACTOR_SUMS = tuple(
    f"{g}_{n}" for g in GROUPS for n in (*(f"{f}_sum" for f in FACTOR_FIELDS), "count")
)
GEOMETRY_SUMS = ("ratio_sum", "log_ratio_sum", "cos_token_sum", "geometry_count")
SUM_NAMES = (*QUERY_SUMS, *SHARE_BIN_SUMS, *FACTOR_SUMS, *GEOMETRY_SUMS)
RECORD_NAMES = (*RECORDED_SUMS, *SHARE_BIN_SUMS)
