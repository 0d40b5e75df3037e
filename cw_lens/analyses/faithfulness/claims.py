"""P1's faithfulness claim (docs/methods.md#claims `faithfulness_order`), judged from an AOPC
table of a [`FaithfulnessResult`][cw_lens.FaithfulnessResult].
"""

from __future__ import annotations

import itertools
from typing import Any

import pandas as pd

from cw_lens.analyses.faithfulness.ranking import MODES
from cw_lens.core.claims import Check, Claim
from cw_lens.core.errors import InputError
from cw_lens.models.layer_contributions import METRICS


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
