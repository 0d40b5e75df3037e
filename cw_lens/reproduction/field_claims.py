"""`contribution_vs_field_inputs` (docs/methods.md#claims `contribution_vs_field`): the
contribution rollout against every other method of the input-level deletion test, judged on
an [`InputDeletionResult`][cw_lens.InputDeletionResult] (criterion: `field_comparison`). The
items are the resampling unit. The pairs protocol is judged with P1's faithfulness claim
(`faithfulness_claims`).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from cw_lens.flow.input_deletion import InputDeletionResult
from cw_lens.reproduction.bootstrap import Bootstrap
from cw_lens.reproduction.field_comparison import INPUT_SUBJECT, field_claim, field_numbers
from cw_lens.reproduction.protocol import claims, intervals, replicates
from cw_lens.reproduction.verdicts import ClaimsDict, claims_dict, with_intervals


def _input_table(result: InputDeletionResult) -> tuple[Tensor, list[tuple[str, str]]]:
    """Per item, its AOPC of every (mode, method) and a count of 1: `[item, columns + 1]`."""
    per_item = result.item_aopc().dropna()
    columns = list(per_item.columns)
    table = torch.tensor(per_item.to_numpy(), dtype=torch.float64, device="cpu")
    ones = torch.ones(table.shape[0], 1, dtype=torch.float64, device="cpu")
    return torch.cat([table, ones], dim=1), columns


def input_replicates(result: InputDeletionResult, bootstrap: Bootstrap) -> dict[str, Tensor]:
    """The claim's numbers in every row of `bootstrap.weights`, resampling items.

    Args:
        result: An [`input_deletion`][cw_lens.input_deletion] result.
        bootstrap: The resampling of items.

    Returns:
        `{number: tensor of one value per row}`.
    """
    table, columns = _input_table(result)
    sums = bootstrap.resample(table)
    means = sums[:, :-1] / sums[:, -1:]
    aopc = {(mode, method): means[:, i] for i, (mode, method) in enumerate(columns)}
    return field_numbers("inputs", aopc, INPUT_SUBJECT, bootstrap.resamples)


@claims.register(InputDeletionResult)
def input_deletion_claims(
    result: InputDeletionResult, bootstrap: Bootstrap | None = None
) -> ClaimsDict:
    """`contribution_vs_field_inputs`: the contribution rollout against the field on the
    input-level deletion test.

    Args:
        result: An [`input_deletion`][cw_lens.input_deletion] result (both modes, the
            contribution rollout and at least one other method).
        bootstrap: With a [`Bootstrap`][cw_lens.reproduction.Bootstrap], each number's interval
            over items.

    Returns:
        `{claim id: claim}`.

    Examples:
        ```python
        import cw_lens
        from cw_lens.reproduction import Bootstrap, claims

        model = cw_lens.load_model("testing:tiny-llama")
        items = cw_lens.load_corpus("ioi", n_docs=4, model=model)
        result = cw_lens.input_deletion(
            model, items, methods=("contribution_rollout", "attention_rollout"), n_random=1,
            progress=False,
        )
        claims(result, Bootstrap(resamples=200))["contribution_vs_field_inputs"]["holds"]
        ```
    """
    naopc = None
    if not result.items[["lower", "upper"]].isna().all().all():
        naopc = result.naopc()
    claim = field_claim("inputs", result.aopc(), INPUT_SUBJECT, naopc)
    claim.measured["n_items"] = len(result.item_aopc().dropna())
    if bootstrap is None:
        return claims_dict([claim])
    reps = input_replicates(result, bootstrap)
    found = {k: bootstrap.pair(v, number=k) for k, v in reps.items()}
    return claims_dict(with_intervals([claim], found))


@replicates.register(InputDeletionResult)
def input_deletion_replicates(
    result: InputDeletionResult, bootstrap: Bootstrap
) -> dict[str, Tensor]:
    """`contribution_vs_field_inputs`'s numbers in every row of `bootstrap.weights`.

    Args:
        result: An [`input_deletion`][cw_lens.input_deletion] result.
        bootstrap: The resampling of items.

    Returns:
        `{number: tensor of one value per row}`.

    Examples:
        ```python
        import cw_lens
        from cw_lens.reproduction import Bootstrap, replicates

        model = cw_lens.load_model("testing:tiny-llama")
        items = cw_lens.load_corpus("ioi", n_docs=4, model=model)
        result = cw_lens.input_deletion(
            model, items, methods=("contribution_rollout", "attention_rollout"), n_random=1,
            progress=False,
        )
        reps = replicates(result, Bootstrap(resamples=200))
        ```
    """
    return input_replicates(result, bootstrap)


@intervals.register(InputDeletionResult)
def input_deletion_intervals(
    result: InputDeletionResult, bootstrap: Bootstrap
) -> tuple[dict[str, tuple[float, float]], dict[str, list[dict[str, Any]]]]:
    """The 95% intervals over items of `contribution_vs_field_inputs`'s numbers.

    Args:
        result: An [`input_deletion`][cw_lens.input_deletion] result.
        bootstrap: The resampling of items.

    Returns:
        `({number: (low, high)}, {})`.

    Examples:
        ```python
        import cw_lens
        from cw_lens.reproduction import Bootstrap, intervals

        model = cw_lens.load_model("testing:tiny-llama")
        items = cw_lens.load_corpus("ioi", n_docs=4, model=model)
        result = cw_lens.input_deletion(
            model, items, methods=("contribution_rollout", "attention_rollout"), n_random=1,
            progress=False,
        )
        numbers, _ = intervals(result, Bootstrap(resamples=200))
        ```
    """
    reps = input_replicates(result, bootstrap)
    return {k: bootstrap.pair(v, number=k) for k, v in reps.items()}, {}
