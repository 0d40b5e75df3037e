"""P1's faithfulness claim (docs/methods.md#claims `faithfulness_order`), judged from an AOPC
table of a [`FaithfulnessResult`][cw_lens.FaithfulnessResult]: the claim from the table, the
AOPCs' bootstrap replicates, and the registered implementations of
`cw_lens.reproduction.claims`, `replicates` and `intervals` for the result.
"""

from __future__ import annotations

import itertools
from typing import Any

import pandas as pd
from torch import Tensor

from cw_lens.analyses.faithfulness.curves import FaithfulnessResult
from cw_lens.analyses.faithfulness.ranking import MODES
from cw_lens.core.errors import InputError
from cw_lens.models.layer_contributions import METRICS
from cw_lens.reproduction.bootstrap import Bootstrap, require_record
from cw_lens.reproduction.field_comparison import (
    has_field_metrics,
    pair_claim,
    pair_numbers,
)
from cw_lens.reproduction.protocol import claims, intervals, replicates
from cw_lens.reproduction.resampled import aopc_numbers, faithfulness_numbers
from cw_lens.reproduction.verdicts import Check, Claim, ClaimsDict, claims_dict, with_intervals


def faithfulness_claim(aopc: pd.DataFrame, value: str, clean: dict[str, float]) -> Claim:
    """`faithfulness_order` as methods § Claims (docs/methods.md#claims) reads it, from an AOPC
    table (rows `(granularity, mode)`, columns metrics;
    [`FaithfulnessResult.aopc`][cw_lens.FaithfulnessResult.aopc]): at
    pairs granularity the comprehensiveness AOPC strictly increases along `METRICS` (each step's
    difference > 0 is a number) and contribution has the lowest sufficiency AOPC of the four (the
    number: the smallest of the other three minus contribution's, > 0). Other granularities are
    reported.

    Args:
        aopc: The AOPC table.
        value: The damage measure the AOPCs are of (`delta_nll` or `delta_logprob`).
        clean: The clean values, reported with the claim.

    Returns:
        The claim `faithfulness_order`.
    """
    needed = [("pairs", mode) for mode in MODES]
    missing = [m for m in METRICS if m not in aopc.columns]
    if missing or any(row not in aopc.index for row in needed):
        raise InputError(
            "faithfulness_order is judged at pairs granularity on both modes with the metrics "
            f"{', '.join(METRICS)}; this result lacks some (metrics {list(aopc.columns)}, rows "
            f"{list(aopc.index)}). Run faithfulness with the defaults."
        )
    comp = aopc.loc[("pairs", "comprehensiveness"), list(METRICS)]
    suff = aopc.loc[("pairs", "sufficiency"), list(METRICS)]
    others = [m for m in METRICS if m != "contribution"]
    checks = [
        Check(f"comprehensiveness_{b}_minus_{a}", float(comp[b] - comp[a]), ">", 0.0)
        for a, b in itertools.pairwise(METRICS)
    ]
    checks.append(
        Check(
            "sufficiency_lowest_other_minus_contribution",
            float(suff[others].min() - suff["contribution"]),
            ">",
            0.0,
        )
    )
    measured: dict[str, Any] = {}
    for g in aopc.index.get_level_values("granularity").unique():
        for mode in MODES:
            if (g, mode) in aopc.index:
                measured[f"aopc_{mode}_{g}"] = aopc.loc[(g, mode)].to_dict()
    measured["most_faithful_comprehensiveness_pairs"] = str(comp.idxmax())
    measured["lowest_sufficiency_pairs"] = str(suff.idxmin())
    measured["value"] = value
    measured["clean"] = clean
    return Claim(
        "faithfulness_order",
        paper="contribution most faithful: comprehensiveness attention < value_norm < "
        "value_norm_output < contribution; contribution best on sufficiency (P1)",
        criterion="pairs granularity: strict AOPC comprehensiveness order attention < "
        "value_norm < value_norm_output < contribution, and contribution lowest on sufficiency",
        checks=checks,
        measured=measured,
    )


@claims.register(FaithfulnessResult)
def faithfulness_result_claims(
    result: FaithfulnessResult, bootstrap: Bootstrap | None = None
) -> ClaimsDict:
    """P1's faithfulness ordering (docs/methods.md#claims `faithfulness_order`), measured on
    the result's AOPCs ([`FaithfulnessResult.aopc`][cw_lens.FaithfulnessResult.aopc]).

    With several random draws (`n_random`), `measured["random_aopc_over_draws"]` holds their
    spread ([`random_spread`][cw_lens.FaithfulnessResult.random_spread]).

    Args:
        result: A [`faithfulness`][cw_lens.faithfulness] result.
        bootstrap: With a [`Bootstrap`][cw_lens.reproduction.Bootstrap], every number's interval
            over documents and, in `measured`, every AOPC's
            (`aopc_interval_<mode>_<granularity>`, the random ranking's included: its interval
            over documents, per draw). Intervals need `per_document=True`.

    Returns:
        `{claim id: claim}` (`faithfulness_order`), each claim a JSON-ready dict with its
        verdict and `measured` numbers.

    Examples:
        ```python
        import cw_lens
        from cw_lens.reproduction import Bootstrap, claims

        model = cw_lens.load_model("testing:tiny-llama")
        corpus = cw_lens.load_corpus(n_docs=2, max_tokens=16, model=model)
        faith = cw_lens.faithfulness(
            model, corpus, fractions=(0.5,), per_document=True, progress=False
        )
        claims(faith)["faithfulness_order"]["holds"]
        claims(faith, Bootstrap(resamples=100))  # with intervals over documents
        ```
    """
    point = result.aopc()
    claim = faithfulness_claim(point, result.value_column, result.clean)
    claim.measured["first_query"] = result.first_query
    if result.n_random_draws > 1:
        spread = result.random_spread()
        claim.measured["random_aopc_over_draws"] = {
            f"{mode}_{g}": {k: float(v) for k, v in row.items()}
            for (g, mode), row in spread.iterrows()
        }
    judged = [claim]
    if has_field_metrics(result):  # beyond the papers: the metrics of other tools
        judged.append(pair_claim(result))
    if bootstrap is None:
        return claims_dict(judged)
    aopc = aopc_replicates(result, bootstrap)
    for (g, mode, metric), reps in aopc.items():
        key = f"aopc_interval_{mode}_{g}"
        claim.measured.setdefault(key, {})[metric] = list(bootstrap.pair(reps, number=key))
    return claims_dict(with_intervals(judged, _number_intervals(result, aopc, bootstrap)))


@replicates.register(FaithfulnessResult)
def faithfulness_result_replicates(
    result: FaithfulnessResult, bootstrap: Bootstrap
) -> dict[str, Tensor]:
    """`faithfulness_order`'s numbers in every row of `bootstrap.weights`.

    Args:
        result: A [`faithfulness`][cw_lens.faithfulness] result run with `per_document=True`.
        bootstrap: The resampling of documents.

    Returns:
        `{number: tensor of one value per row}`: the differences of pairs-granularity AOPCs
        that `faithfulness_order` reads (`comprehensiveness_<b>_minus_<a>`,
        `sufficiency_lowest_other_minus_contribution`) and, when the result has the metrics
        of other tools, those of `contribution_vs_field_pairs`.

    Examples:
        ```python
        import cw_lens
        from cw_lens.reproduction import Bootstrap, replicates

        model = cw_lens.load_model("testing:tiny-llama")
        corpus = cw_lens.load_corpus(n_docs=2, max_tokens=16, model=model)
        faith = cw_lens.faithfulness(
            model, corpus, fractions=(0.5,), per_document=True, progress=False
        )
        reps = replicates(faith, Bootstrap(resamples=100))
        ```
    """
    return _numbers(result, aopc_replicates(result, bootstrap), bootstrap)


@intervals.register(FaithfulnessResult)
def faithfulness_result_intervals(
    result: FaithfulnessResult, bootstrap: Bootstrap
) -> tuple[dict[str, tuple[float, float]], dict[str, list[dict[str, Any]]]]:
    """The 95% intervals over documents of `faithfulness_order`'s numbers.

    Args:
        result: A [`faithfulness`][cw_lens.faithfulness] result run with `per_document=True`.
        bootstrap: The resampling of documents.

    Returns:
        `({number: (low, high)}, {})`: no number of this claim is per layer.

    Examples:
        ```python
        import cw_lens
        from cw_lens.reproduction import Bootstrap, intervals

        model = cw_lens.load_model("testing:tiny-llama")
        corpus = cw_lens.load_corpus(n_docs=2, max_tokens=16, model=model)
        faith = cw_lens.faithfulness(
            model, corpus, fractions=(0.5,), per_document=True, progress=False
        )
        numbers, _ = intervals(faith, Bootstrap(resamples=100))
        ```
    """
    return _number_intervals(result, aopc_replicates(result, bootstrap), bootstrap), {}


def aopc_replicates(
    result: FaithfulnessResult, bootstrap: Bootstrap
) -> dict[tuple[str, str, str], Tensor]:
    """Every AOPC of the result in every row of `bootstrap.weights`, from its per-document
    record: per (granularity, mode, metric), the mean over the fractions of the change of the
    resampled corpus's mean NLL (on tasks: the drop of its mean answer log-probability), as
    [`FaithfulnessResult.aopc`][cw_lens.FaithfulnessResult.aopc] computes it on the corpus.

    Args:
        result: A [`faithfulness`][cw_lens.faithfulness] result run with `per_document=True`.
        bootstrap: The resampling of documents.

    Returns:
        `{(granularity, mode, metric): tensor of one value per row}`.

    Examples:
        ```python
        import cw_lens
        from cw_lens.reproduction import Bootstrap
        from cw_lens.reproduction.faithfulness_claims import aopc_replicates

        model = cw_lens.load_model("testing:tiny-llama")
        corpus = cw_lens.load_corpus(n_docs=2, max_tokens=16, model=model)
        faith = cw_lens.faithfulness(
            model, corpus, fractions=(0.5,), per_document=True, progress=False
        )
        aopc = aopc_replicates(faith, Bootstrap(resamples=100))
        ```
    """
    names, table, configs = require_record(result.per_document, "faithfulness")
    return aopc_numbers(bootstrap.resample(table), names, configs, result.task)


def _numbers(
    result: FaithfulnessResult, aopc: dict[tuple[str, str, str], Tensor], bootstrap: Bootstrap
) -> dict[str, Tensor]:
    """The claims' numbers from the AOPC replicates: `faithfulness_order`'s and, with the
    metrics of other tools, `contribution_vs_field_pairs`'s."""
    numbers = faithfulness_numbers(aopc, METRICS)
    if has_field_metrics(result):
        numbers.update(pair_numbers(aopc, bootstrap.resamples))
    return numbers


def _number_intervals(
    result: FaithfulnessResult, aopc: dict[tuple[str, str, str], Tensor], bootstrap: Bootstrap
) -> dict[str, tuple[float, float]]:
    """The intervals of the claims' numbers from the AOPC replicates."""
    return {k: bootstrap.pair(v, number=k) for k, v in _numbers(result, aopc, bootstrap).items()}
