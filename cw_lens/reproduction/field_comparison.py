"""The criterion of a claim beyond the papers (docs/methods.md#claims `contribution_vs_field`):
do contribution weights rank tokens more faithfully than the attribution methods researchers
use today? The claims are registered by `field_claims` (inputs) and `faithfulness_claims`
(pairs).

Two protocols, each judged on its own result:

- **inputs** ([`InputDeletionResult`][cw_lens.InputDeletionResult]): cw_lens's input attribution,
  the contribution rollout, against every other method of the input-level test (the attention
  rollout, the contribution weights and the two pair metrics summed to tokens, input x gradient,
  integrated gradients, value zeroing);
- **pairs** ([`FaithfulnessResult`][cw_lens.FaithfulnessResult] with `alti` and
  `attribution_patching` among its metrics): the contribution weights against every other
  metric at pairs granularity.

Per mode the number is the AOPC difference between the subject and the best other method (the
best on the run's own AOPCs, then held fixed): comprehensiveness `AOPC_subject - max_other`,
sufficiency `min_other - AOPC_subject`; both must be > 0. The controls (the random draws and,
on inputs, the recency ranking: nearest token first) are not rivals, but the subject must beat
the best of them the same way: a ranking no better than position says nothing about
faithfulness. The intervals resample items (inputs) or documents (pairs) with the run's
bootstrap.
The subject is fixed in advance (the rollout on inputs, the contribution weight on pairs):
choosing whichever of cw_lens's methods did best would flatter it.
"""

from __future__ import annotations

from typing import Any

import pandas as pd
from torch import Tensor

from cw_lens.analyses.faithfulness.curves import FaithfulnessResult
from cw_lens.analyses.faithfulness.ranking import FIELD_METRICS, METRICS, MODES
from cw_lens.core.errors import InputError
from cw_lens.reproduction.verdicts import Check, Claim

INPUT_SUBJECT = "contribution_rollout"
PAIR_SUBJECT = "contribution"
# the rankings that are no method's: random draws (`random`, `random#2`, ... on pairs) and, on
# inputs, the nearest token first
CONTROLS = ("random", "recency")

# the pair-level comparison's metrics (P1's, the two of other tools, the random control) and
# its random draws, in the main job (`field` preset) and the benchmark
FIELD_PAIR_METRICS = (*METRICS, *FIELD_METRICS, "random")
FIELD_RANDOM_DRAWS = 3


def is_control(method: str) -> bool:
    """Whether a method name is a control ranking rather than an attribution method.

    Args:
        method: A method (inputs) or metric (pairs) name.

    Returns:
        True for the random draws and the recency ranking.
    """
    return method.split("#")[0] in CONTROLS


def _best(aopc: pd.DataFrame, methods: list[str]) -> dict[str, str]:
    table = aopc.loc[methods]
    return {
        "comprehensiveness": str(table["comprehensiveness"].idxmax()),
        "sufficiency": str(table["sufficiency"].idxmin()),
    }


def best_others(aopc: pd.DataFrame, subject: str) -> dict[str, str]:
    """Per mode, the other method with the best AOPC (comprehensiveness: the largest;
    sufficiency: the smallest), the controls left out.

    Args:
        aopc: AOPC per method (rows) and mode (columns).
        subject: The method judged.

    Returns:
        `{mode: method}`.
    """
    return _best(aopc, [m for m in aopc.index if m != subject and not is_control(m)])


def best_controls(aopc: pd.DataFrame) -> dict[str, str]:
    """Per mode, the control ranking with the best AOPC (empty when none ran).

    Args:
        aopc: AOPC per method (rows) and mode (columns).

    Returns:
        `{mode: control}`.
    """
    controls = [m for m in aopc.index if is_control(m)]
    return _best(aopc, controls) if controls else {}


def comparisons(protocol: str, aopc: pd.DataFrame, subject: str) -> dict[str, tuple[str, str, str]]:
    """The claim's numbers, each an AOPC difference `AOPC[mode, a] - AOPC[mode, b]` that is
    positive when the subject ranks better: against the best other method, and against the
    best control when one ran.

    Args:
        protocol: `inputs` or `pairs`.
        aopc: AOPC per method (rows) and mode (columns), both modes.
        subject: cw_lens's method on this protocol.

    Returns:
        `{number name: (mode, a, b)}`.
    """
    out: dict[str, tuple[str, str, str]] = {}
    for against, best in (("best_other", best_others(aopc, subject)),
                          ("best_control", best_controls(aopc))):  # fmt: skip
        if not best:
            continue
        comp, suff = best["comprehensiveness"], best["sufficiency"]
        out[f"{protocol}_comprehensiveness_{subject}_minus_{against}"] = (
            "comprehensiveness", subject, comp,
        )  # fmt: skip
        out[f"{protocol}_sufficiency_{against}_minus_{subject}"] = ("sufficiency", suff, subject)
    return out


def field_claim(protocol: str, aopc: pd.DataFrame, subject: str, naopc: Any = None) -> Claim:
    """`contribution_vs_field` on one protocol, from its AOPC table.

    Args:
        protocol: `inputs` or `pairs`.
        aopc: AOPC per method (rows) and mode (columns), both modes.
        subject: cw_lens's method on this protocol.
        naopc: The normalised AOPCs (inputs), reported beside the numbers.

    Returns:
        The claim `contribution_vs_field_<protocol>`.

    Raises:
        InputError: When the subject, a mode or every rival is missing.
    """
    missing = [m for m in MODES if m not in aopc.columns]
    rivals = [m for m in aopc.index if m != subject and not is_control(m)]
    if missing or subject not in aopc.index or not rivals:
        raise InputError(
            f"contribution_vs_field ({protocol}) needs both modes, {subject!r} and at least one "
            f"other method; this result has modes {list(aopc.columns)} and methods "
            f"{list(aopc.index)}."
        )
    checks = [
        Check(name, float(aopc.loc[a, mode] - aopc.loc[b, mode]), ">", 0.0)
        for name, (mode, a, b) in comparisons(protocol, aopc, subject).items()
    ]
    methods = [m for m in aopc.index if not is_control(m)]
    ranked = {
        "comprehensiveness": aopc.loc[methods, "comprehensiveness"]
        .sort_values(ascending=False)
        .index.tolist(),
        "sufficiency": aopc.loc[methods, "sufficiency"].sort_values().index.tolist(),
    }
    measured: dict[str, Any] = {
        "subject": subject,
        "best_other": best_others(aopc, subject),
        "best_control": best_controls(aopc),
        "rank_of_subject": {mode: order.index(subject) + 1 for mode, order in ranked.items()},
        "order": ranked,
        "aopc": {mode: aopc[mode].to_dict() for mode in MODES},
    }
    if naopc is not None:
        measured["naopc"] = {mode: naopc[mode].to_dict() for mode in MODES}
    return Claim(
        f"contribution_vs_field_{protocol}",
        paper="beyond the papers: contribution weights rank tokens more faithfully than the "
        "field's attribution methods",
        criterion=f"{protocol}: {subject}'s AOPC beats the best other method's and the best "
        "control's, on comprehensiveness (higher) and on sufficiency (lower)",
        checks=checks,
        measured=measured,
    )


# --------------------------------------------------------------------------- pairs


def has_field_metrics(result: FaithfulnessResult) -> bool:
    """Whether a faithfulness result ranked by both metrics of other tools at pairs granularity.

    Args:
        result: A [`faithfulness`][cw_lens.faithfulness] result.

    Returns:
        True when `contribution_vs_field_pairs` can be judged on it.
    """
    aopc = result.aopc()
    rows = [("pairs", mode) for mode in MODES]
    return all(r in aopc.index for r in rows) and all(m in aopc.columns for m in FIELD_METRICS)


def pair_aopc(result: FaithfulnessResult) -> pd.DataFrame:
    """The pairs-granularity AOPCs as methods (rows) by modes (columns).

    Args:
        result: A [`faithfulness`][cw_lens.faithfulness] result.

    Returns:
        The table `field_claim` reads.
    """
    aopc = result.aopc()
    return pd.DataFrame({mode: aopc.loc[("pairs", mode)] for mode in MODES})


def pair_claim(result: FaithfulnessResult) -> Claim:
    """`contribution_vs_field_pairs` on a faithfulness result with the field metrics.

    Args:
        result: A [`faithfulness`][cw_lens.faithfulness] result with `alti` and
            `attribution_patching`.

    Returns:
        The claim.
    """
    return field_claim("pairs", pair_aopc(result), PAIR_SUBJECT)


def point_table(aopc: dict[tuple[str, str], Tensor], row: int) -> pd.DataFrame:
    """One row of AOPC replicates as methods (rows) by modes (columns).

    Args:
        aopc: `{(mode, method): replicates}`.
        row: The row to read (a bootstrap's corpus row, `Bootstrap.resamples`).

    Returns:
        The table `comparisons` reads.
    """
    methods = list(dict.fromkeys(method for _, method in aopc))
    return pd.DataFrame(
        {mode: [float(aopc[mode, m][row]) for m in methods] for mode in MODES}, index=methods
    )


def field_numbers(
    protocol: str, aopc: dict[tuple[str, str], Tensor], subject: str, corpus_row: int
) -> dict[str, Tensor]:
    """The claim's numbers from AOPC replicates, against the rivals that are best in the
    replicates' corpus row: a run's own AOPCs in a run, a drawn sub-corpus's in the coverage
    study (so the study measures the interval with its rivals chosen as a run chooses them).

    Args:
        protocol: `inputs` or `pairs`.
        aopc: `{(mode, method): replicates}`.
        subject: cw_lens's method on this protocol.
        corpus_row: The replicates' corpus row (`Bootstrap.resamples`).

    Returns:
        `{number: replicates}`.
    """
    point = point_table(aopc, corpus_row)
    return {
        name: aopc[mode, a] - aopc[mode, b]
        for name, (mode, a, b) in comparisons(protocol, point, subject).items()
    }


def pair_numbers(aopc: dict[tuple[str, str, str], Tensor], corpus_row: int) -> dict[str, Tensor]:
    """The pair claim's numbers from AOPC replicates (`aopc_replicates`).

    Args:
        aopc: `{(granularity, mode, metric): replicates}`.
        corpus_row: The replicates' corpus row (`Bootstrap.resamples`).

    Returns:
        `{number: replicates}`.
    """
    pairs = {(mode, metric): v for (g, mode, metric), v in aopc.items() if g == "pairs"}
    return field_numbers("pairs", pairs, PAIR_SUBJECT, corpus_row)
