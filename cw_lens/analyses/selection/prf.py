"""Geometric precision, recall and F of one query's key selection (docs/methods.md#selection, P2):
distances, top and random orders, P/R/F of a ranking over the grid of N, and the checks of their
inputs.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, Literal, NamedTuple

import numpy as np
import torch
from jaxtyping import Bool, Float, Int
from torch import Tensor

from cw_lens.core.accumulators import entry_keys
from cw_lens.core.deprecation import deprecated
from cw_lens.core.devices import to_tensor
from cw_lens.core.errors import InputError
from cw_lens.core.keywords import check_keywords
from cw_lens.core.registry import saveable

Distance = Literal["euclidean", "cosine"]
DISTANCES = ("euclidean", "cosine")
COSINE_EPS = 1e-12


@saveable
class PRF(NamedTuple):
    """Precision, recall and F of a selection (float64; NaN where N exceeds the candidates)."""

    precision: Tensor
    recall: Tensor
    f: Tensor


def power_grid(n_keys: int) -> list[int]:
    """The grid of N (docs/methods.md#selection) for `n_keys` keys: 1, 2, 4, ... up to half."""
    grid, n = [], 1
    while 2 * n <= n_keys:
        grid.append(n)
        n *= 2
    return grid


def selection_distance(
    y: Float[Tensor, "*rows key d_head"],
    s: Float[Tensor, "*rows d_head"],
    distance: Distance = "euclidean",
) -> Float[Tensor, "*rows key"]:
    """`D_j = ||y_j - s||`, or the cosine distance `1 - <y_j,s> / max(||y_j|| ||s||, 1e-12)`."""
    s = s[..., None, :]
    if distance == "euclidean":
        return torch.linalg.vector_norm(y - s, dim=-1)
    dot = (y * s).sum(-1)
    norms = torch.linalg.vector_norm(y, dim=-1) * torch.linalg.vector_norm(s, dim=-1)
    return 1.0 - dot / norms.clamp_min(COSINE_EPS)


# Bytes of `y` that `_distances_in_blocks` reads per block of leading rows: `y - s` of
# a block stays in cache (the same numbers as one full-size subtraction, several times faster).
DISTANCE_BLOCK_BYTES = 2**21


def _distances_in_blocks(y: Tensor, s: Tensor, distance: Distance) -> Tensor:
    """`selection_distance` computed over blocks of the first axis (row-wise, so exactly
    the same values)."""
    if y.dim() < 3:
        return selection_distance(y, s, distance)
    step = max(1, DISTANCE_BLOCK_BYTES // max(1, y[0].numel() * y.element_size()))
    if step >= y.shape[0]:
        return selection_distance(y, s, distance)
    blocks = [
        selection_distance(y[i : i + step], s[i : i + step], distance)
        for i in range(0, y.shape[0], step)
    ]
    return torch.cat(blocks)


def top_order(
    attention: Float[Tensor, "*rows key"], candidates: Bool[Tensor, "*rows key"]
) -> Int[Tensor, "*rows key"]:
    """Keys ranked by attention, highest first, ties to the smaller index; non-candidates last."""
    by_attention = torch.sort(attention, dim=-1, descending=True, stable=True).indices
    flags = candidates.gather(-1, by_attention)
    first = torch.sort((~flags).to(torch.uint8), dim=-1, stable=True).indices
    return by_attention.gather(-1, first)


def random_order(
    candidates: Bool[Tensor, "*rows key"], n_random: int, generator: torch.Generator
) -> Int[Tensor, "*rows n_random key"]:
    """`n_random` uniform random rankings of the candidate keys per row (non-candidates last).

    Nested across N by construction: the N-key selection is the first N keys of the ranking.
    """
    shape = (*candidates.shape[:-1], n_random, candidates.shape[-1])
    draws = torch.rand(shape, generator=generator, dtype=torch.float64, device="cpu")
    draws = draws.to(candidates.device).masked_fill(~candidates[..., None, :], 2.0)
    return torch.sort(draws, dim=-1, stable=True).indices


def ranking_entries(
    n_heads: int, n_random: int, n_keys: int, device: torch.device | str = "cpu"
) -> Int[Tensor, "1 head 1 n_random key"]:
    """The (head, ranking, key) coordinate of `ranking_keys`: `head * 2^40 + r * 2^24 + key`.

    Args:
        n_heads: Query heads.
        n_random: Rankings per (head, query).
        n_keys: Keys per ranking.
        device: Where to make it.

    Returns:
        int64 `[1, head, 1, n_random, key]`.
    """
    head = torch.arange(n_heads, device=device)[:, None, None] << 40
    rank = torch.arange(n_random, device=device)[:, None] << 24
    return (head | rank | torch.arange(n_keys, device=device))[None, :, None]


def ranking_keys(
    seed: int,
    layer: int,
    documents: Int[Tensor, " batch"],
    queries: Int[Tensor, "batch query"],
    n_heads: int,
    n_random: int,
    n_keys: int,
    *,
    entries: Int[Tensor, "1 head 1 n_random key"] | None = None,
) -> Int[Tensor, "batch head query n_random key"]:
    """The random baseline's key of every (document, query, head, ranking, key) of one layer.

    `entry_keys(seed, layer, document * 2^32 + query, head * 2^40 + r * 2^24 + key)`: a hash
    of what the entry is, so a ranking depends neither on the batching, the sharding nor the
    other documents, and ranking `r` is the same whatever `n_random`. Sorting a row's keys
    ascending is a uniform random permutation of its keys (`random_rankings`).

    Args:
        seed: The seed.
        layer: The layer.
        documents: Each batch row's document (its index in the corpus).
        queries: The query positions of each row.
        n_heads: Query heads.
        n_random: Rankings per (head, query).
        n_keys: Keys per ranking (positions `0 .. n_keys - 1`).
        entries: `ranking_entries(n_heads, n_random, n_keys)`, if the caller keeps it.

    Returns:
        int64 keys `[batch, head, query, n_random, key]`.

    Examples:
        >>> import torch
        >>> ranking_keys(0, 1, torch.tensor([3]), torch.tensor([[5]]), 2, 4, 6).shape
        torch.Size([1, 2, 1, 4, 6])
    """
    if entries is None:
        entries = ranking_entries(n_heads, n_random, n_keys, queries.device)
    row = (documents[:, None] << 32) | queries  # [batch, query]
    return entry_keys(seed, layer, row[:, None, :, None, None], entries)


def random_rankings(
    seed: int, document: int, layer: int, query: int, n_heads: int, n_random: int
) -> Int[Tensor, "head n_random key"]:
    """The random baseline's rankings of keys `0..query` for one (document, layer, query):
    the keys sorted by `ranking_keys` (`document` = the document's index in the corpus), so
    a run is reproducible whatever the batching or sharding. Nested across N: the N-key
    selection is the first N keys of one ranking.

    Args:
        seed: The seed.
        document: The document's index in the corpus.
        layer: The layer.
        query: The query position (the ranking covers keys `0..query`).
        n_heads: Query heads.
        n_random: Rankings per head.

    Returns:
        `[head, n_random, query + 1]` permutations of the keys.

    Examples:
        >>> random_rankings(0, 3, 1, 5, n_heads=2, n_random=4).shape
        torch.Size([2, 4, 6])
    """
    keys = ranking_keys(
        seed,
        layer,
        torch.tensor([document], device="cpu"),
        torch.tensor([[query]], device="cpu"),
        n_heads,
        n_random,
        query + 1,
    )
    return keys[0, :, 0].sort(dim=-1, stable=True).indices


def prf_of_ranking(
    y: Float[Tensor, "*rows key d_head"],
    order: Int[Tensor, "*rows key"],
    candidates: Bool[Tensor, "*rows key"],
    n_grid: Sequence[int],
    distance: Distance = "euclidean",
) -> PRF:
    """P_N, R_N, F_N of the selections `S = order[:N]` for every N of `n_grid`.

    Args:
        y: Attention-weighted values `alpha[i,j] v_j`.
        order: A ranking of the keys with the candidates first (`top_order`,
            `random_order`).
        candidates: Keys that may be selected; the others take no part at all.
        n_grid: Selection sizes.
        distance: `"euclidean"` or `"cosine"`.

    Returns:
        `PRF`, each `[*rows, len(n_grid)]` float64, NaN where `N` exceeds the number
        of candidates of the row.
    """
    # s_N = aggregates[..., N-1, :]: only the first max(N) ranked keys are ever summed (a
    # cumulative sum along keys is sequential, so its first entries do not depend on the rest)
    first = order[..., : min(max(n_grid, default=1), order.shape[-1])]
    y_ranked = y.gather(-2, first[..., None].expand(*first.shape, y.shape[-1]))
    aggregates = y_ranked.cumsum(-2)
    rank = torch.empty_like(order).scatter_(
        -1, order, torch.arange(order.shape[-1], device=order.device).expand_as(order)
    )
    n_candidates = candidates.sum(-1)
    out = []
    for n in n_grid:
        d = _distances_in_blocks(y, aggregates[..., min(n, order.shape[-1]) - 1, :], distance)
        selected = rank < n
        outside = candidates & ~selected
        rho_max = d.masked_fill(~selected, -math.inf).amax(-1, keepdim=True)
        rho_min = d.masked_fill(~outside, math.inf).amin(-1, keepdim=True)
        false_pos = (outside & (d <= rho_max)).sum(-1).double()
        true_pos = (selected & (d < rho_min)).sum(-1).double()
        size = torch.full_like(false_pos, n)  # tensor / tensor: the same rounding as Python
        p = size / (size + false_pos)
        r = true_pos / size
        f = torch.where(
            p + r > 0, 2 * p * r / (p + r), torch.zeros((), dtype=torch.float64, device=p.device)
        )
        undefined = n_candidates < n
        out.append([t.masked_fill(undefined, math.nan) for t in (p, r, f)])
    return PRF(*(torch.stack(ts, dim=-1) for ts in zip(*out, strict=True)))


def selection_distances(
    y: Float[Tensor, "*rows key d_head"],
    s: Float[Tensor, "*rows aggregate d_head"],
    distance: Distance = "euclidean",
) -> Float[Tensor, "*rows key aggregate"]:
    """`selection_distance` of every key to each of several aggregates, in one operation.

    Euclidean: `torch.cdist` without the matrix-product shortcut (it computes `||y_j - s||`
    itself, so a distance of 0 stays 0 and no `[key, aggregate, d_head]` tensor is formed);
    cosine: the products `y_j * s` summed over `d_head` (a `[key, aggregate, d_head]`
    temporary), rounded as `selection_distance` rounds them.

    Args:
        y: The attention-weighted values of each row's keys.
        s: The aggregates `s_N` of each row.
        distance: `"euclidean"` or `"cosine"`.

    Returns:
        `D[..., j, m]`, the distance of key `j` to aggregate `m`.

    Examples:
        >>> import torch
        >>> y = torch.tensor([[[3.0, 4.0], [0.0, 0.0]]])
        >>> selection_distances(y, torch.zeros(1, 1, 2))[..., 0].tolist()
        [[5.0, 0.0]]
    """
    if distance == "euclidean":
        return torch.cdist(y, s, compute_mode="donot_use_mm_for_euclid_dist")
    # the products summed over d_head as `selection_distance` sums them (not a matrix product,
    # which rounds differently): the value vectors of a repeated token are parallel, so their
    # cosine distances tie at 0 up to rounding, and the tie must break as the definition's does
    dot = (y[..., :, None, :] * s[..., None, :, :]).sum(-1)
    norms = (
        torch.linalg.vector_norm(y, dim=-1)[..., None]
        * torch.linalg.vector_norm(s, dim=-1)[..., None, :]
    )
    return 1.0 - dot / norms.clamp_min(COSINE_EPS)


def prf_of_rankings(
    y: Float[Tensor, "*rows key d_head"],
    orders: Int[Tensor, "*rows ranking key"],
    candidates: Bool[Tensor, "*rows ranking key"],
    n_grid: Sequence[int],
    distance: Distance = "euclidean",
    *,
    grid: Int[Tensor, " n"] | None = None,
) -> Float[Tensor, "*rows ranking n 3"]:
    """`prf_of_ranking` of several rankings of the same keys per row, for the whole grid of N
    at once (a fixed number of tensor operations, whatever the rows, rankings and N).

    The same definition as `prf_of_ranking` (S = `order[:N]`, each set scored around its own
    aggregate `s_N`; `F = 2PR / (P + R)`, written as `2 TP N / (N^2 + TP (N + FP))`); the
    Euclidean distances come from `selection_distances`, so they may differ from
    `prf_of_ranking`'s in the last bits.

    Args:
        y: Attention-weighted values `alpha[i,j] v_j` (float64 for the reference's rounding).
        orders: Rankings of the keys, candidates first (`top_order`, sorted `ranking_keys`).
        candidates: Keys each ranking may select; the others take no part at all.
        n_grid: Selection sizes (sorted).
        distance: `"euclidean"` or `"cosine"`.
        grid: `n_grid` as an int64 tensor on the values' device, if the caller keeps one.

    Returns:
        `(P, R, F)` stacked on the last axis, `[*rows, ranking, len(grid), 3]` float64, NaN
        where `N` exceeds the candidates.

    Examples:
        >>> import torch
        >>> y = torch.tensor([[[0.0], [10.0], [1.0], [11.0]]], dtype=torch.float64)
        >>> orders = torch.tensor([[[0, 1, 2, 3]]])
        >>> candidates = torch.ones(1, 1, 4, dtype=torch.bool)
        >>> prf_of_rankings(y, orders, candidates, [2]).tolist()
        [[[[0.5, 0.5, 0.5]]]]
    """
    n_keys, d_head = y.shape[-2], y.shape[-1]
    if grid is None:
        grid = torch.tensor(list(n_grid), dtype=torch.long, device=y.device)
    longest = min(max(n_grid), n_keys)
    first = orders[..., :longest]
    ranked = y[..., None, :, :].expand(*orders.shape, d_head)
    ranked = ranked.gather(-2, first[..., None].expand(*first.shape, d_head))
    aggregates = ranked.cumsum(-2).index_select(-2, grid.clamp_max(longest) - 1)
    d = selection_distances(y, aggregates.flatten(-3, -2), distance)  # [*rows, key, M * N]
    d = d.unflatten(-1, aggregates.shape[-3:-1]).movedim(-3, -1)  # [*rows, ranking, n, key]
    positions = torch.arange(n_keys, device=y.device).expand_as(orders)
    rank = torch.empty_like(orders).scatter_(-1, orders, positions)
    selected = rank[..., None, :] < grid[:, None]
    outside = candidates[..., None, :] > selected  # a candidate, not selected
    rho_max = torch.where(selected, d, -math.inf).amax(-1, keepdim=True)
    rho_min = torch.where(outside, d, math.inf).amin(-1, keepdim=True)
    false_pos = (outside & (d <= rho_max)).sum(-1)
    true_pos = (selected & (d < rho_min)).sum(-1)
    size = grid.double()
    scored = size + false_pos
    prf = torch.stack(
        [size / scored, true_pos / size, 2 * size * true_pos / (size * size + true_pos * scored)],
        -1,
    )
    undefined = candidates.sum(-1, keepdim=True) < grid
    return prf.masked_fill(undefined[..., None], math.nan)


@check_keywords
def geometric_prf(
    values: Float[Tensor, "*rows key d_head"],
    attention: Float[Tensor, "*rows key"],
    n: int | Sequence[int],
    *,
    distance: Distance = "euclidean",
    candidates: Bool[Tensor, "*rows key"] | None = None,
    exclude: Sequence[int] | None = None,
    ranking: Int[Tensor, "*rows key"] | Sequence[int] | None = None,
) -> PRF:
    """Precision, recall and F of the top-N selection of each query row (a (layer, head, query),
    or any leading axes of them) — methods § Token selection (docs/methods.md#selection).

    For one row: `y_j = alpha_j v_j`, `S` = the first N candidates by attention (ties: the
    smaller index) or by `ranking`, `s_N = sum_{j in S} y_j`, `D_j` = the distance of `y_j` to
    `s_N`; `P = N / (N + #{j not in S : D_j <= max_S D})`,
    `R = #{j in S : D_j < min_{not S} D} / N`, `F = 2PR / (P + R)` (0 when both are 0).
    Vectorised over every leading axis, the keys and the grid of N.

    Args:
        values: The head's value vectors `v_j` of each row's keys `[*rows, key, d_head]`.
        attention: Each row's attention `alpha[i, j]` over those keys `[*rows, key]`.
        n: Selection size N (an int: the N axis is dropped), or a grid of N (a sequence:
            sorted, repeats dropped, one entry per N on the last axis).
        distance: `"euclidean"` (`||y_j - s_N||`) or `"cosine"`.
        candidates: Keys each row may select `[*rows, key]` (default all; e.g. `key <= query`
            and real); the others take no part at all.
        exclude: Key indices removed from every row's candidates (e.g. `[0]`, the sink).
        ranking: Rank the candidates in this order instead of by attention (e.g. a random
            permutation): a permutation of the key indices per row `[*rows, key]`, or one
            sequence for every row; non-candidates are dropped from it.

    Returns:
        A `PRF` (`precision`, `recall`, `f`) of float64 tensors `[*rows]` for an int `n`
        (0-d for one query: `p, r, f = geometric_prf(values, attention, 2)`, `float(p)`),
        `[*rows, len(n)]` for a grid; NaN where N exceeds a row's candidates.

    Raises:
        InputError: Shapes that do not match, non-finite values, a bad `n`, `distance`,
            `exclude`, `ranking` or `candidates`, or an int `n` larger than every row's
            number of candidates.

    Examples:
        ```python
        import torch
        import cw_lens

        values = torch.tensor([[1.0, 0.0], [0.0, 1.0], [0.1, 0.1]])
        attention = torch.tensor([0.5, 0.4, 0.1])
        p, r, f = cw_lens.geometric_prf(values, attention, 2)  # the top-2 keys of one query

        values = torch.randn(4, 8, 16)                      # 4 queries, 8 keys, d_head 16
        attention = torch.softmax(torch.randn(4, 8), -1)
        prf = cw_lens.geometric_prf(values, attention, [1, 2, 4], exclude=[0])
        prf.f.shape                                         # [4, 3]: one F per query and N
        ```
    """
    values, attention = _check_query(values, attention)
    check_distance(distance)
    single = isinstance(n, int) and not isinstance(n, bool)
    if not single and (not isinstance(n, Sequence) or isinstance(n, str)):
        raise InputError(
            f"n must be an integer (one N) or a sequence of integers (a grid of N), got {n!r}."
        )
    n_keys = attention.shape[-1]
    allowed = _check_candidates(candidates, attention)
    allowed = allowed & ~_index_mask(exclude, n_keys, attention.device)
    if single:
        most = int(allowed.sum(-1).max())
        if not 1 <= n <= most:
            raise InputError(
                f"n must be an integer between 1 and the number of candidate keys ({most} of "
                f"{n_keys} after exclusions), got {n!r}; lower n."
            )
        grid = [n]
    else:
        grid = check_grid(n, "n (a grid of N)")
    if ranking is None:
        order = top_order(attention, allowed)
    else:  # the ranking with the candidates first, in its order
        order = _check_ranking(ranking, attention)
        flags = allowed.gather(-1, order)
        order = order.gather(-1, torch.sort((~flags).to(torch.uint8), dim=-1, stable=True).indices)
    y = attention[..., None] * values
    prf = prf_of_ranking(y, order, allowed, grid, distance)
    return PRF(*(t[..., 0] for t in prf)) if single else prf


@check_keywords
def geometric_prf_batched(
    values: Float[Tensor, "*rows key d_head"],
    attention: Float[Tensor, "*rows key"],
    n_grid: Sequence[int],
    *,
    distance: Distance = "euclidean",
    candidates: Bool[Tensor, "*rows key"] | None = None,
    exclude: Sequence[int] | None = None,
) -> PRF:
    """Deprecated: [`geometric_prf`][cw_lens.geometric_prf] with a grid of N (removed in
    cw_lens 0.6).

    Args:
        values: `v_j` per row `[*rows, key, d_head]`.
        attention: `alpha[i, j]` per row `[*rows, key]`.
        n_grid: Selection sizes N.
        distance: `"euclidean"` or `"cosine"`.
        candidates: Keys each row may select (default all).
        exclude: Key indices removed from every row's candidates.

    Returns:
        `geometric_prf(values, attention, list(n_grid), ...)`: each `[*rows, len(n_grid)]`.

    Examples:
        ```python
        import torch
        import cw_lens

        values = torch.randn(4, 8, 16)
        attention = torch.softmax(torch.randn(4, 8), -1)
        cw_lens.geometric_prf(values, attention, [1, 2, 4], exclude=[0])  # not _batched
        ```
    """
    # stacklevel 4: past this function and its keyword check, the caller's line
    deprecated(
        "geometric_prf_batched(...) is now geometric_prf(...)", stacklevel=4, removed_in="0.6"
    )
    return geometric_prf(
        values,
        attention,
        check_grid(n_grid),
        distance=distance,
        candidates=candidates,
        exclude=exclude,
    )


# ---------------------------------------------------------------------- input checks


def check_distance(distance: str) -> None:
    if distance not in DISTANCES:
        raise InputError(f"distance must be 'euclidean' or 'cosine', got {distance!r}.")


def check_grid(n_grid: Sequence[int], what: str = "n_grid") -> list[int]:
    grid = list(n_grid)
    if not grid or any(isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in grid):
        raise InputError(f"{what} must be a non-empty list of positive integers, got {n_grid!r}.")
    return sorted(set(grid))


def _check_query(values: Any, attention: Any) -> tuple[Tensor, Tensor]:
    values = to_tensor(values)
    attention = torch.as_tensor(attention, device=values.device)
    if not values.is_floating_point():
        values = values.double()
    if not attention.is_floating_point():
        attention = attention.to(values.dtype)
    if values.ndim < 2 or tuple(values.shape[:-1]) != tuple(attention.shape):
        raise InputError(
            f"geometric_prf takes values [*rows, key, d_head] and attention [*rows, key] with "
            f"the same rows and keys; got {tuple(values.shape)} and {tuple(attention.shape)}."
        )
    if values.shape[-2] == 0:
        raise InputError("There are no keys to select from.")
    if not (torch.isfinite(values).all() and torch.isfinite(attention).all()):
        raise InputError("values and attention must be finite (no NaN or inf).")
    dtype = torch.promote_types(values.dtype, attention.dtype)
    return values.to(dtype), attention.to(dtype)


def _check_candidates(candidates: Any, attention: Tensor) -> Tensor:
    if candidates is None:
        return torch.ones(attention.shape, dtype=torch.bool, device=attention.device)
    candidates = torch.as_tensor(candidates, device=attention.device)
    if candidates.dtype != torch.bool:
        raise InputError(f"candidates must be a boolean mask, got dtype {candidates.dtype}.")
    try:
        return candidates.expand(attention.shape)
    except RuntimeError:
        raise InputError(
            f"candidates {tuple(candidates.shape)} must match attention "
            f"{tuple(attention.shape)} ([*rows, key])."
        ) from None


def _check_indices(indices: Sequence[int] | None, n: int, what: str) -> list[int]:
    out = []
    for j in indices or ():
        if isinstance(j, bool) or not isinstance(j, (int, np.integer)) or not 0 <= j < n:
            raise InputError(f"{what} must hold key indices in [0, {n}), got {j!r}.")
        out.append(int(j))
    return out


def _check_ranking(ranking: Any, attention: Tensor) -> Tensor:
    """`ranking` as int64 `[*rows, key]` on the attention's device; each row a permutation."""
    n = attention.shape[-1]
    if not isinstance(ranking, Tensor):
        ranking = _check_indices(list(ranking), n, "ranking")
    ranking = torch.as_tensor(ranking, device=attention.device)
    if ranking.dtype == torch.bool or ranking.is_floating_point() or ranking.is_complex():
        raise InputError(f"ranking must hold integer key indices, got dtype {ranking.dtype}.")
    ranking = ranking.long()
    if ranking.ndim == 0 or ranking.shape[-1] != n or ranking.ndim > attention.ndim:
        raise InputError(f"ranking must be a permutation of the {n} key indices.")
    try:
        ranking = ranking.expand(attention.shape)
    except RuntimeError:
        raise InputError(
            f"ranking {tuple(ranking.shape)} must match attention {tuple(attention.shape)} "
            "([*rows, key]), or be one permutation for every row."
        ) from None
    keys = torch.arange(n, device=ranking.device)
    if not bool((ranking.sort(-1).values == keys).all()):
        raise InputError(f"ranking must be a permutation of the {n} key indices.")
    return ranking


def _index_mask(indices: Sequence[int] | None, n: int, device: Any) -> Tensor:
    mask = torch.zeros(n, dtype=torch.bool, device=device)
    mask[_check_indices(indices, n, "exclude")] = True
    return mask
