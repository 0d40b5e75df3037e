"""Token-selection geometry (P2): precision, recall and F_N of top-N attention selections.

Mudarisov, Burtsev, Petrova, State, "Geometric Analysis of Token Selection in Multi-Head
Attention" (arXiv 2602.01893); the formulas and the readings fixed where the paper is open are
those of methods § Token selection (docs/methods.md#selection).

**Selection geometry.** For one (layer, head, query `i`) work in value space before `W_O`:

    y_j   = alpha[i,j] v_j                         (v_j: the value of the kv head h reads)
    S     = top-N keys by alpha (ties: smaller index first);   s_N = sum_{j in S} y_j
    D_j   = ||y_j - s_N||      or, with distance="cosine",
    D_j   = 1 - <y_j, s_N> / max(||y_j|| ||s_N||, 1e-12)
    rho_max = max_{j in S} D_j          rho_min = min_{j not in S} D_j   (inf when no key is left)
    P_N   = N / (N + #{j not in S : D_j <= rho_max})
    R_N   = #{j in S : D_j < rho_min} / N
    F_N   = 2 P R / (P + R)   (0 when P = R = 0)

All three are 1 exactly when `rho_min > rho_max` (the selection is separable from the rest
around its own aggregate). With Euclidean distance `F_1 = 1` for any rule (`D = 0` at the one
selected key). N runs over 1, 2, 4, ... up to `T/2` for a query with `T` keys; a (query, N)
pair is scored only when the query has at least `2N` keys, for every rule alike.

Rules compared (P2's claims `topn_beats_random` and `sink_lowers_fn`):

- `top` — top-N by attention, sink allowed in S;
- `random` — `n_random` random rankings per (head, query), *nested across N* (one random
  permutation of the keys; S = its first N), each set scored around its own aggregate `s_N`.
  Ranking `r` of (document `d`, layer `l`, query `i`, head `h`) sorts the keys `j <= i` by
  `entry_keys(seed, l, d * 2^32 + i, h * 2^40 + r * 2^24 + j)` (a counter-based hash, see
  `ranking_keys`), so results do not depend on batching, sharding or the other documents;
- `top_no_sink` — top-N with the sink positions removed from the candidates entirely.

Everything streams layer by layer (`cw_lens.data.streaming.stream_corpus`) into float64 sums
on the model's device (`SelectionGeometryAccumulator`, `cw_lens.core.accumulators.StackedSums`);
`torchrun` ranks merge them with collectives.
Results follow the weights the model runs (a raw bridge); a bridge in compatibility mode gives
results for its folded weights.

The public functions' docstrings have runnable examples.
"""

from cw_lens.analyses.selection.accumulation import ROW_BUDGET_BYTES, RULES, SelectionSums
from cw_lens.analyses.selection.geometry import (
    SelectionGeometryAccumulator,
    SelectionGeometryResult,
    head_f_ratio,
    selection_geometry,
)
from cw_lens.analyses.selection.prf import (
    COSINE_EPS,
    DISTANCES,
    PRF,
    Distance,
    geometric_prf,
    geometric_prf_batched,
    power_grid,
    prf_of_ranking,
    prf_of_rankings,
    random_order,
    random_rankings,
    ranking_entries,
    ranking_keys,
    selection_distance,
    selection_distances,
    top_order,
)
from cw_lens.core.deprecation import moved_attributes

__all__ = [
    "COSINE_EPS",
    "DISTANCES",
    "PRF",
    "ROW_BUDGET_BYTES",
    "RULES",
    "Distance",
    "SelectionGeometryAccumulator",
    "SelectionGeometryResult",
    "SelectionSums",
    "geometric_prf",
    "geometric_prf_batched",
    "head_f_ratio",
    "power_grid",
    "prf_of_ranking",
    "prf_of_rankings",
    "random_order",
    "random_rankings",
    "ranking_entries",
    "ranking_keys",
    "selection_distance",
    "selection_distances",
    "selection_geometry",
    "top_order",
]


# names of 0.4 that moved to the reproduction layer in 0.5 (until 0.6; not in __all__)
__getattr__ = moved_attributes(
    "cw_lens.analyses.selection",
    {
        "selection_claims": "cw_lens.reproduction.selection_claims",
        "SINK_N": "cw_lens.reproduction.selection_claims",
        "SMALL_N": "cw_lens.reproduction.selection_claims",
    },
)
