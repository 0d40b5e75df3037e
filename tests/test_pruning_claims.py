"""The reproduction's questions about a pruning result (`cw_lens.reproduction.pruning_claims`):
the variant of the other scope by keyword and in the deprecated method's order, and the
intervals the claim reports."""

from __future__ import annotations

import json
import math

import pandas as pd
import pytest
import torch

import cw_lens
from cw_lens import reproduction
from cw_lens.analyses import pruning
from cw_lens.core.errors import InputError
from cw_lens.reproduction import Bootstrap


def record_result(draw_deltas: list[float], scope: str = "layer") -> pruning.PruningResult:
    """A pruning result with a per-document record: 10 documents alike (NLL 1 per token, 100
    tokens; taxonomy at 90% and 75%: NLL 1.01 on the per-layer ranking, 1.03 on the global
    one), random draws at NLL 1 + delta."""
    n_docs = 10
    doc = lambda nll: torch.tensor([[100.0 * nll, 100.0]] * n_docs)  # noqa: E731
    taxonomy = 1.01 if scope == "layer" else 1.03
    record = {"clean": doc(1.0)}
    for level in pruning.MODERATE:
        record[("taxonomy", 0, level)] = doc(taxonomy)
        for k, d in enumerate(draw_deltas):
            record[("random", k, level)] = doc(1.0 + d)
    rows = [
        {"order": o, "draw": k, "retention": r, "delta_ppl": math.exp(v[0, 0] / 100) - math.e}
        for key, v in record.items()
        if key != "clean"
        for o, k, r in [key]
    ]
    return pruning.PruningResult(
        table=pd.DataFrame(rows),
        head_stats=pd.DataFrame(),
        rankings={"taxonomy": [[]], "random": [[] for _ in draw_deltas]},
        clean_ppl=math.e,
        clean_nll=1.0,
        retention=pruning.MODERATE,
        orders=("taxonomy", "random"),
        seed=0,
        n_documents=n_docs,
        scope=scope,
        per_document=record,
    )


DRAWS = [0.005 + 0.02 * (k % 2) for k in range(pruning.MIN_RANDOM_DRAWS)]


def same(a: dict, b: dict) -> bool:
    """Equal claim tables (NaN equal to NaN)."""
    return json.dumps(a, sort_keys=True, default=str) == json.dumps(b, sort_keys=True, default=str)


def test_the_variant_is_taken_by_keyword_and_in_the_deprecated_order():
    per_layer, global_ = record_result(DRAWS), record_result(DRAWS, scope="global")
    boot = Bootstrap(200, seed=0)
    point = reproduction.claims(per_layer, other_scope=global_)
    assert point["pruning_signal"]["measured"]["global_ranking"]["random_minus_taxonomy"]
    assert same(reproduction.claims(global_, other_scope=per_layer), point)  # either way round
    with_boot = reproduction.claims(per_layer, boot, other_scope=global_)
    # the deprecated method: result.claims(other_scope=None, bootstrap=None), by position too
    with pytest.warns(DeprecationWarning, match=r"cw_lens\.reproduction\.claims"):
        assert same(per_layer.claims(global_), point)
    with pytest.warns(DeprecationWarning):
        assert same(per_layer.claims(global_, boot), with_boot)
    with pytest.warns(DeprecationWarning):
        assert same(per_layer.claims(other_scope=global_, bootstrap=boot), with_boot)
    with pytest.warns(DeprecationWarning):
        assert same(per_layer.claims(None, boot), reproduction.claims(per_layer, boot))
    with pytest.warns(DeprecationWarning):  # one by position, one by keyword, as 0.4 took them
        assert same(per_layer.claims(global_, bootstrap=boot), with_boot)
    with pytest.raises(InputError, match="other_scope="):  # the new order refuses a result
        reproduction.claims(per_layer, global_)


def test_intervals_are_those_the_claim_reports_and_need_enough_draws():
    boot = Bootstrap(500, seed=0)
    result = record_result(DRAWS)
    numbers, per_layer = reproduction.intervals(result, boot)
    reps = reproduction.replicates(result, boot)
    assert per_layer == {} and set(numbers) == set(reps)
    checks = reproduction.claims(result, boot)["pruning_signal"]["checks"]
    assert {c["number"] for c in checks} == set(numbers)
    for check in checks:
        low, high = numbers[check["number"]]
        assert check["interval"] == pytest.approx([low, high])
        assert low < high  # the draws' spread
    few, _ = reproduction.intervals(record_result([0.5, 0.6, 0.7]), boot)
    assert few and all(math.isnan(v) for pair in few.values() for v in pair)
    without_record = record_result(DRAWS)
    without_record.per_document = None
    with pytest.raises(cw_lens.InputError, match="per_document=True"):
        reproduction.intervals(without_record, boot)
