"""P2's pruning claim (docs/methods.md#claims `pruning_signal`) judged from a
[`PruningResult`][cw_lens.PruningResult]: the claim from its table, and the registered
implementations of `cw_lens.reproduction.claims`, `replicates` and `intervals` for it.

The retention levels it reads (`MODERATE`, `AGGRESSIVE`) and the number of random draws a
verdict needs (`MIN_RANDOM_DRAWS`) are the toolkit's (`cw_lens.analyses.pruning`).
"""

from __future__ import annotations

import math
from typing import Any

import pandas as pd
from torch import Tensor

from cw_lens.analyses.pruning import prune
from cw_lens.analyses.pruning.orders import AGGRESSIVE, MODERATE
from cw_lens.analyses.pruning.prune import PruningResult
from cw_lens.core.errors import InputError
from cw_lens.reproduction.bootstrap import Bootstrap, require_record
from cw_lens.reproduction.protocol import claims, intervals, replicates
from cw_lens.reproduction.resampled import pruning_numbers
from cw_lens.reproduction.verdicts import Check, Claim, ClaimsDict, claims_dict, with_intervals


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


@claims.register(PruningResult)
def pruning_result_claims(
    result: PruningResult,
    bootstrap: Bootstrap | None = None,
    *,
    other_scope: PruningResult | None = None,
) -> ClaimsDict:
    """P2's pruning claim (docs/methods.md#claims `pruning_signal`), measured.

    The criterion reads the per-layer ranking (`scope="layer"`): of `result` and `other_scope`,
    the per-layer one is judged and the other reported as the variant. With fewer than
    `MIN_RANDOM_DRAWS` random draws the control's spread is not known well enough for a
    verdict: no interval (the verdict is `inconclusive`), and `measured["random_draws"]` says
    how many there were.

    Args:
        result: A [`prune_heads`][cw_lens.prune_heads] result.
        bootstrap: With a [`Bootstrap`][cw_lens.reproduction.Bootstrap], each number's interval
            over documents and random draws resampled together
            (`pruning_result_replicates`; the per-layer result needs `per_document=True`).
        other_scope: A result of the other scope (either way round), reported as the variant.

    Returns:
        `{claim id: claim}` (`pruning_signal`), each claim a JSON-ready dict with its verdict
        and `measured` numbers.

    Raises:
        InputError: Neither result ranks per layer, or `bootstrap` is not a `Bootstrap`.

    Examples:
        ```python
        import cw_lens
        from cw_lens.reproduction import Bootstrap, claims

        model = cw_lens.load_model("testing:tiny-llama")
        corpus = cw_lens.load_corpus(n_docs=2, max_tokens=16, model=model)
        pruned = cw_lens.prune_heads(
            model, corpus, retention=(0.5,), n_random=2, per_document=True, progress=False
        )
        claims(pruned)["pruning_signal"]["holds"]
        claims(pruned, Bootstrap(resamples=100))
        ```
    """
    if bootstrap is not None and not isinstance(bootstrap, Bootstrap):
        raise InputError(
            f"bootstrap must be a cw_lens.reproduction.Bootstrap or None, got "
            f"{type(bootstrap).__name__}; pass a result of the other scope as other_scope=."
        )
    results = [r for r in (result, other_scope) if r is not None]
    per_layer = [r for r in results if r.scope == "layer"]
    if not per_layer:
        raise InputError(
            "pruning_signal is judged on the per-layer ranking: pass a prune_heads(..., "
            "scope='layer') result (the default), optionally with the global one as "
            "other_scope."
        )
    main = per_layer[0]
    variants = [r for r in results if r is not main]
    judged = [pruning_claim(main, variants[0] if variants else None)]
    if bootstrap is not None:
        judged = with_intervals(judged, pruning_result_intervals(main, bootstrap)[0])
    return claims_dict(judged)


@replicates.register(PruningResult)
def pruning_result_replicates(result: PruningResult, bootstrap: Bootstrap) -> dict[str, Tensor]:
    """`pruning_signal`'s numbers in every row of `bootstrap.weights`.

    Documents are resampled, and the random draws with them
    (`cw_lens.reproduction.bootstrap.Bootstrap.draw_weights`): each row's mean over the random
    draws counts draw `k` as often as that row drew it.

    Args:
        result: A [`prune_heads`][cw_lens.prune_heads] result run with `per_document=True`.
        bootstrap: The resampling of documents.

    Returns:
        `{number: tensor of one value per row}`
        (`random_minus_taxonomy_delta_ppl_at_<level>` at each `MODERATE` level).

    Examples:
        ```python
        import cw_lens
        from cw_lens.reproduction import Bootstrap, replicates

        model = cw_lens.load_model("testing:tiny-llama")
        corpus = cw_lens.load_corpus(n_docs=2, max_tokens=16, model=model)
        pruned = cw_lens.prune_heads(
            model, corpus, retention=(0.9, 0.75), n_random=2, per_document=True, progress=False
        )
        reps = replicates(pruned, Bootstrap(resamples=100))
        ```
    """
    record = require_record(result.per_document, "prune_heads")
    n_docs = record["clean"].shape[0]
    n_draws = result.n_random_draws
    draws = bootstrap.draw_weights(n_docs, n_draws) if n_draws else None
    resampled = bootstrap.resample_each(record)
    return pruning_numbers(resampled, MODERATE, draws)


@intervals.register(PruningResult)
def pruning_result_intervals(
    result: PruningResult, bootstrap: Bootstrap
) -> tuple[dict[str, tuple[float, float]], dict[str, list[dict[str, Any]]]]:
    """The 95% intervals of `pruning_signal`'s numbers, documents and random draws resampled
    together; NaN with fewer than `MIN_RANDOM_DRAWS` random draws (no verdict then).

    Args:
        result: A [`prune_heads`][cw_lens.prune_heads] result run with `per_document=True`.
        bootstrap: The resampling of documents.

    Returns:
        `({number: (low, high)}, {})`: no number of this claim is per layer.

    Examples:
        ```python
        import cw_lens
        from cw_lens.reproduction import Bootstrap, intervals

        model = cw_lens.load_model("testing:tiny-llama")
        corpus = cw_lens.load_corpus(n_docs=2, max_tokens=16, model=model)
        pruned = cw_lens.prune_heads(
            model, corpus, retention=(0.9, 0.75), n_random=2, per_document=True, progress=False
        )
        numbers, _ = intervals(pruned, Bootstrap(resamples=100))  # NaN: 2 draws < 20
        ```
    """
    reps = pruning_result_replicates(result, bootstrap)
    # read at call time: the toolkit's constant, as the analysis module holds it
    enough = result.n_random_draws >= prune.MIN_RANDOM_DRAWS
    nan = (math.nan, math.nan)
    return {k: bootstrap.pair(v, number=k) if enough else nan for k, v in reps.items()}, {}
