"""Attention sinks (P1): geometry, convex sink-rate curves, semantic drift, sink-norm ablation.

P1 (Cunningham & Muca Cirone, ICML 2026) argues that the first token — the attention sink — is
not a passive store of spare attention but an active part of the head's computation. With the
sink position(s) `S` (position 0, the BOS token, by default), per head `h` and query `i`
(docs/methods.md#sinks):

    sink rate        s_i = sum_{j in S} alpha[i,j]          sink head: mean_{i >= 16} s_i > 0.3
    decomposition    o_i = s_i p_i + (1 - s_i) m_i          p_i: the sink's projected value
                     m_i = sum_{j not in S} alpha[i,j] pv_j / (1 - s_i)   (the tail mixture)
    convex curve     ||o(s)|| = ||s p + (1 - s) m||  is convex in s; its minimiser
                     s* = clamp(<m, m - p> / ||m - p||^2, 0, 1)   (P1: interior, s* < 1)
    semantic drift   d_i = sum_{weak j} alpha[i,j] pv_j   (tail minus its k = 4 top tokens)
                     cos(alpha_i0 pv_0, d_i) < 0 and the cancelled share
                     -<alpha_i0 pv_0, d_i> / ||d_i||^2   (P1: the sink opposes the drift)
    value geometry   ||pv_j|| / ||pv_0||  (P1/P2: 3-10x),  cos(pv_0, pv_j), cos(pv_0, m_i) < 0

All of it is computed in head space with the Gram matrices (`pv_j = v_j W_O` is never built)
and streamed one layer at a time over a corpus, into mergeable accumulators.

Sink-norm ablation (the intervention, [`cw_lens.patch_sink`][cw_lens.patch_sink]): `pv_0 -> lambda
pv_0` for queries after the sink, attention untouched; [`sink_ablation`][cw_lens.sink_ablation]
measures the change in perplexity, each head's output norm, and its alignment with the head's
semantic cone (axis `u^h` = normalised mean of the head's non-sink projected values): `cos(o_i^h,
u^h)`.

The public functions' docstrings have runnable examples.
"""

from cw_lens.analyses.sinks.ablation import (
    SinkAblationAccumulator,
    SinkAblationResult,
    sink_ablation,
)
from cw_lens.analyses.sinks.accumulation import SinkStatisticsAccumulator
from cw_lens.analyses.sinks.cone import ABLATION_SUMS, cone_axis, norm_and_cone
from cw_lens.analyses.sinks.detection import (
    MIN_QUERY,
    SINK_RATE_THRESHOLD,
    SinkPositions,
    SinkSpec,
    detect_sinks,
    queries_after_sink,
)
from cw_lens.analyses.sinks.rates import sink_rates
from cw_lens.analyses.sinks.statistics import SinkStatisticsResult, head_spearman
from cw_lens.analyses.sinks.statistics_layout import (
    DRIFT_SHARE_BINNING,
    DRIVER_FACTORS,
    FACTOR_COLUMNS,
    MAX_SAMPLES_PER_HEAD,
    RATE_BINS,
    RECORDED_SUMS,
    SHARE_BINNING,
)
from cw_lens.analyses.sinks.statistics_pass import sink_statistics
from cw_lens.core.deprecation import moved_attributes

__all__ = [
    "ABLATION_SUMS",
    "DRIFT_SHARE_BINNING",
    "DRIVER_FACTORS",
    "FACTOR_COLUMNS",
    "MAX_SAMPLES_PER_HEAD",
    "MIN_QUERY",
    "RATE_BINS",
    "RECORDED_SUMS",
    "SHARE_BINNING",
    "SINK_RATE_THRESHOLD",
    "SinkAblationAccumulator",
    "SinkAblationResult",
    "SinkPositions",
    "SinkSpec",
    "SinkStatisticsAccumulator",
    "SinkStatisticsResult",
    "cone_axis",
    "detect_sinks",
    "head_spearman",
    "norm_and_cone",
    "queries_after_sink",
    "sink_ablation",
    "sink_rates",
    "sink_statistics",
]


# names of 0.4 that moved to the reproduction layer in 0.5 (until 0.6; not in __all__)
__getattr__ = moved_attributes(
    "cw_lens.analyses.sinks",
    {
        "LAYER_NUMBERS": "cw_lens.reproduction.sink_claims",
        "MIN_S_STAR_QUERIES": "cw_lens.reproduction.sink_claims",
        "sink_claims": "cw_lens.reproduction.sink_claims",
    },
)
