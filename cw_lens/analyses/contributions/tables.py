"""The tables of a [`ContributionResult`][cw_lens.ContributionResult]: its long format
([`to_dataframe`][cw_lens.ContributionResult.to_dataframe]) and the ranked entries of one query
([`top`][cw_lens.ContributionResult.top]).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import numpy as np
import pandas as pd
from torch import Tensor


class ContributionFields(Protocol):
    """What the tables read of a [`ContributionResult`][cw_lens.ContributionResult]: its
    `FIELDS` (each an attribute `[batch, layer, head, query, key]`), `mask`, `layers`, `heads`
    and `str_tokens` (a protocol, so that this module does not import the result's)."""

    FIELDS: tuple[str, ...]
    mask: Tensor
    layers: list[int]
    heads: list[int]
    str_tokens: list[list[str]]


def long_table(
    result: ContributionFields,
    b_idx: Sequence[int],
    l_idx: Sequence[int],
    h_idx: Sequence[int],
    query: int | None,
) -> pd.DataFrame:
    """One row per (batch, layer, head, query, key) with `key <= query`, of the rows, layers and
    heads given by their index.

    Args:
        result: The [`ContributionResult`][cw_lens.ContributionResult].
        b_idx: Rows of the batch.
        l_idx: Entries of the layer axis.
        h_idx: Entries of the head axis.
        query: Keep this query position only (`None` = all).

    Returns:
        The table of [`to_dataframe`][cw_lens.ContributionResult.to_dataframe].
    """
    frames = []
    fields = {name: getattr(result, name) for name in result.FIELDS}
    for b in b_idx:
        n = int(result.mask[b].sum())
        q_idx = np.arange(n) if query is None else np.array([query])
        qq, kk = np.meshgrid(q_idx, np.arange(n), indexing="ij")
        keep = kk <= qq
        qq, kk = qq[keep], kk[keep]
        for li in l_idx:
            for hi in h_idx:
                data = {
                    "batch": b,
                    "layer": result.layers[li],
                    "head": result.heads[hi],
                    "query": qq,
                    "key": kk,
                    "query_token": np.array(result.str_tokens[b], dtype=object)[qq],
                    "key_token": np.array(result.str_tokens[b], dtype=object)[kk],
                }
                for name, t in fields.items():
                    data[name] = t[b, li, hi].detach().cpu().numpy()[qq, kk]
                frames.append(pd.DataFrame(data))
    return pd.concat(frames, ignore_index=True)


def top_table(
    result: ContributionFields,
    scores: Tensor,
    layers: list[int],
    heads: list[int],
    batch: int,
    q: int,
    k: int,
    by: str,
    *,
    absolute: bool,
    sum_heads: bool,
) -> pd.DataFrame:
    """The `k` largest of one query's `scores`, as [`top`][cw_lens.ContributionResult.top] returns
    them.

    Args:
        result: The [`ContributionResult`][cw_lens.ContributionResult].
        scores: The field `by` of the query, `[layer, head, key]` over `layers` and `heads`.
        layers: Entries of the layer axis.
        heads: Entries of the head axis.
        batch: The row of the batch.
        q: The query position.
        k: How many entries.
        by: The field's name.
        absolute: Rank by magnitude.
        sum_heads: Sum over heads first.

    Returns:
        A DataFrame with `layer, head, key, <by>, key_token, query`, largest first.
    """
    rows = []
    if sum_heads:
        summed = scores.nansum(1)
        for li, lay in enumerate(layers):
            for key in range(q + 1):
                rows.append((result.layers[lay], None, key, float(summed[li, key])))
    else:
        for li, lay in enumerate(layers):
            for hi, hd in enumerate(heads):
                for key in range(q + 1):
                    rows.append(
                        (result.layers[lay], result.heads[hd], key, float(scores[li, hi, key]))
                    )
    df = pd.DataFrame(rows, columns=["layer", "head", "key", by])
    df["key_token"] = [result.str_tokens[batch][key] for key in df["key"]]
    df["query"] = q
    order = df[by].abs() if absolute else df[by]
    df = df.loc[order.sort_values(ascending=False, na_position="last").index].head(k)
    if sum_heads:
        df = df.drop(columns="head")
    return df.reset_index(drop=True)
