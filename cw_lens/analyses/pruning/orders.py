"""Pruning orders: how many heads a retention level removes, and which ones under each order
(taxonomy regime, weight magnitude, attention entropy, random).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, Literal

import numpy as np
import pandas as pd
import torch
from jaxtyping import Float
from torch import Tensor

from cw_lens.models.access import model_access

ORDERS = ("taxonomy", "magnitude", "entropy", "random")
RETENTION = (0.9, 0.75, 0.5, 0.25)
# the moderate retention levels: every random draw is evaluated there (`draws_everywhere`), and
# P2's `pruning_signal` compares the taxonomy order with random there
MODERATE = (0.9, 0.75)
AGGRESSIVE = (0.5, 0.25)  # the aggressive levels, where P2 reports the best order


def weight_magnitude(
    W_V: Float[Tensor, "kv_head d_model d_head"], W_O: Float[Tensor, "head d_head d_model"]
) -> Float[Tensor, " head"]:
    """`||W_V^h||_F ||W_O^h||_F` per query head (head h reads kv head `h // (H / H_kv)`)."""
    group = W_O.shape[0] // W_V.shape[0]
    v_norms = torch.linalg.matrix_norm(W_V.float()).repeat_interleave(group)
    return v_norms * torch.linalg.matrix_norm(W_O.float())


# =========================================================================== head pruning

Head = tuple[int, int]
_REGIME_RANK = {"Reset": 0, "Mixer": 1, "Retriever": 2}  # taxonomy order: removed first -> last


def n_removed(retention: float, n_heads: int) -> int:
    """Heads removed at a retention level: `floor((1 - retention) * n_heads + 1/2)`."""
    return math.floor((1.0 - retention) * n_heads + 0.5)


def removed_heads(
    ranking: Sequence[Head], retention: float, scope: Literal["layer", "global"] = "layer"
) -> list[Head]:
    """The heads a ranking removes at one retention level.

    `scope="layer"`: in every layer, its first `n_removed(retention, n_layer)` heads in
    ranking order (each layer keeps the same fraction); `"global"`: the first
    `n_removed(retention, n)` heads of the whole ranking.
    """
    if scope == "global":
        return list(ranking[: n_removed(retention, len(ranking))])
    by_layer: dict[int, list[Head]] = {}
    for head in ranking:
        by_layer.setdefault(head[0], []).append(head)
    return [h for heads in by_layer.values() for h in heads[: n_removed(retention, len(heads))]]


def head_magnitudes(model: Any, layers: Sequence[int]) -> Float[Tensor, "layer head"]:
    """`||W_V^h||_F ||W_O^h||_F` for every query head of the given layers (the weights read
    through [`resident_weights`][cw_lens.models.access.resident_weights], so offloaded models
    give the resident model's order)."""
    access = model_access(model)
    magnitudes = []
    for layer in layers:
        got = access.attention_weights(layer, ("W_V", "W_O"))
        magnitudes.append(weight_magnitude(got["W_V"], got["W_O"]).cpu())
    return torch.stack(magnitudes)


def pruning_rankings(
    head_stats: pd.DataFrame, orders: Sequence[str], n_draws: int = 3, seed: int = 0
) -> dict[str, list[list[Head]]]:
    """Removal orders (first = removed first) from a head table; one ranking per order, and
    `n_draws` seeded permutations for `random`. Ties go to the smaller (layer, head).

    `head_stats` needs `layer`, `head` and, per order, `regime` and
    `mean_output_norm` (taxonomy), `magnitude`, `mean_entropy`.
    """
    table = head_stats.sort_values(["layer", "head"], kind="stable").reset_index(drop=True)
    keys = {
        "taxonomy": (["regime_rank", "mean_output_norm"], [True, True]),
        "magnitude": (["magnitude"], [True]),
        "entropy": (["mean_entropy"], [False]),
    }
    if "taxonomy" in orders:
        table = table.assign(regime_rank=table["regime"].map(_REGIME_RANK))
    heads = list(zip(table["layer"].tolist(), table["head"].tolist(), strict=True))
    out: dict[str, list[list[Head]]] = {}
    for name in orders:
        if name == "random":
            draws = [
                np.random.default_rng([seed, draw]).permutation(len(heads))
                for draw in range(n_draws)
            ]
            out[name] = [[heads[i] for i in perm] for perm in draws]
            continue
        columns, ascending = keys[name]
        ranked = table.sort_values(
            [*columns, "layer", "head"], ascending=[*ascending, True, True], kind="stable"
        )
        out[name] = [list(zip(ranked["layer"].tolist(), ranked["head"].tolist(), strict=True))]
    return out
