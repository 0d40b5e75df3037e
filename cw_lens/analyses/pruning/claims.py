"""P2's pruning claim (docs/methods.md#claims `pruning_signal`) judged from a
[`PruningResult`][cw_lens.PruningResult], and the retention levels and number of random draws it
reads.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import pandas as pd

from cw_lens.core.claims import Check, Claim

if TYPE_CHECKING:
    from cw_lens.analyses.pruning.prune import PruningResult

MODERATE = (0.9, 0.75)  # retention levels where the taxonomy order must beat random
MIN_RANDOM_DRAWS = 20  # random orders a verdict on pruning_signal needs (methods § Claims)
AGGRESSIVE = (0.5, 0.25)  # levels where the best order is reported


def _random_minus_taxonomy(table: pd.DataFrame, level: float) -> float:
    """ΔPPL(random, mean of draws) - ΔPPL(taxonomy) at one retention level (NaN if absent)."""
    if not {"taxonomy", "random"} <= set(table.columns) or level not in table.index:
        return math.nan
    return float(table.loc[level, "random"] - table.loc[level, "taxonomy"])


def pruning_claim(result: PruningResult, variant: PruningResult | None = None) -> Claim:
    """`pruning_signal` as methods § Claims (docs/methods.md#claims) reads it: with the per-layer
    ranking, ΔPPL(taxonomy) < ΔPPL(random, mean of draws) at 90% and 75% retention (the numbers: the
    differences random - taxonomy, > 0); the best order at 50% and 25% is reported, and `variant`
    (the global ranking) beside it.

    Args:
        result: The result judged (`scope="layer"`).
        variant: A result of the other scope, reported beside it.

    Returns:
        The claim `pruning_signal`.
    """
    table = result.by_retention()
    orders = list(result.orders)
    measured: dict[str, Any] = {
        "best_order": {
            str(r): str(table.loc[r, orders].idxmin()) for r in AGGRESSIVE if r in table.index
        },
        "delta_ppl": result.summary_dict()["delta_ppl"],
        "random_draws": result.n_random_draws,
        "cross_fitted": sorted(result.cross_fitted),
    }
    if variant is not None:
        other = variant.by_retention()
        measured[f"{variant.scope}_ranking"] = {
            "random_minus_taxonomy": {
                str(r): _random_minus_taxonomy(other, r) for r in MODERATE if r in other.index
            },
            "best_order": {
                str(r): str(other.loc[r, list(variant.orders)].idxmin())
                for r in AGGRESSIVE
                if r in other.index
            },
            "delta_ppl": variant.summary_dict()["delta_ppl"],
        }
    if result.lone is not None:
        measured["top_lone_heads"] = result.summary_dict()["top_lone_heads"]
    elif variant is not None and variant.lone is not None:
        measured["top_lone_heads"] = variant.summary_dict()["top_lone_heads"]
    return Claim(
        "pruning_signal",
        paper="taxonomy order is a useful pruning signal at moderate retention, not always best "
        "when aggressive (P2)",
        criterion="per-layer ranking, learnt on held-out documents (cross-fitting): "
        "ΔPPL(taxonomy) < mean ΔPPL over ≥ 20 random draws at 90% and 75% retention, the "
        "interval resampling documents and draws together; the best order at 50% and 25% is "
        "reported",
        checks=[
            Check(
                f"random_minus_taxonomy_delta_ppl_at_{r}",
                _random_minus_taxonomy(table, r),
                ">",
                0.0,
            )
            for r in MODERATE
        ],
        measured=measured,
    )
