r"""Token-selection geometry (P2): precision, recall and F_N of top-N attention selections.

Mudarisov, Burtsev, Petrova, State, "Geometric Analysis of Token Selection in Multi-Head
Attention" (arXiv 2602.01893); the formulas and the readings fixed where the paper is open are
those of SPEC §4.

**Selection geometry.** For one (layer, head, query ``i``) work in value space before ``W_O``::

    y_j   = alpha[i,j] v_j                         (v_j: the value of the kv head h reads)
    S     = top-N keys by alpha (ties: smaller index first);   s_N = sum_{j in S} y_j
    D_j   = ||y_j - s_N||      or, with distance="cosine",
    D_j   = 1 - <y_j, s_N> / max(||y_j|| ||s_N||, 1e-12)
    rho_max = max_{j in S} D_j          rho_min = min_{j not in S} D_j   (inf when no key is left)
    P_N   = N / (N + #{j not in S : D_j <= rho_max})
    R_N   = #{j in S : D_j < rho_min} / N
    F_N   = 2 P R / (P + R)   (0 when P = R = 0)

All three are 1 exactly when ``rho_min > rho_max`` (the selection is separable from the rest
around its own aggregate). With Euclidean distance ``F_1 = 1`` for any rule (``D = 0`` at the one
selected key). N runs over 1, 2, 4, ... up to ``T/2`` for a query with ``T`` keys; a (query, N)
pair is scored only when the query has at least ``2N`` keys, for every rule alike.

Rules compared (P2's claims ``topn_beats_random`` and ``sink_lowers_fn``):

- ``top`` — top-N by attention, sink allowed in S;
- ``random`` — ``n_random`` random rankings per (head, query), *nested across N* (one random
  permutation of the keys; S = its first N), each set scored around its own aggregate ``s_N``.
  The permutation of (document ``d``, layer ``l``, query ``i``) is drawn from a generator seeded
  with ``(seed, d, l, i)``, so results do not depend on batching, sharding or the other documents;
- ``top_no_sink`` — top-N with the sink positions removed from the candidates entirely.

Everything streams layer by layer (:func:`cw_lens.data.streaming.stream_corpus`) into exact sums
(:class:`cw_lens.core.accumulate.ExactSums`), so corpora and ``torchrun`` ranks merge exactly.
Results follow the weights the model runs (a raw bridge); a bridge in compatibility mode gives
results for its folded weights.

Example::

    import cw_lens
    model = cw_lens.load_model()
    corpus = cw_lens.load_corpus(n_docs=8, max_tokens=128, tokenizer=model)
    geo = cw_lens.selection_geometry(model, corpus)
    geo.f_by_n()                  # mean F_N per N: top vs random, and the sink effect
    geo.sink_effect()             # F_N without the sink over F_N with it
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal, NamedTuple

import einops
import numpy as np
import pandas as pd
import torch
from jaxtyping import Bool, Float, Int
from torch import Tensor

from cw_lens.analyses.common import check_count, check_sinks, kv_of_heads, rounded_dict
from cw_lens.core.accumulate import ExactSums, PerDocument
from cw_lens.core.bootstrap import Bootstrap, require_record
from cw_lens.core.claims import Check, Claim, claims_dict, with_intervals
from cw_lens.core.errors import InputError
from cw_lens.core.resampled import selection_numbers
from cw_lens.data.documents import as_corpus
from cw_lens.data.inputs import prepare_inputs
from cw_lens.data.streaming import stream_corpus
from cw_lens.models.capture import resolve_layers
from cw_lens.models.verify import require_verified

Distance = Literal["euclidean", "cosine"]
DISTANCES = ("euclidean", "cosine")
COSINE_EPS = 1e-12
RULES = ("top", "random", "top_no_sink")
# Memory for one chunk of selection-geometry rows (float32 temporaries).
ROW_BUDGET_BYTES = 256e6


# =========================================================================== pure math


class PRF(NamedTuple):
    """Precision, recall and F of a selection (float64; NaN where N exceeds the candidates)."""

    precision: Tensor
    recall: Tensor
    f: Tensor


def power_grid(n_keys: int) -> list[int]:
    """SPEC's N grid for a query with ``n_keys`` keys: 1, 2, 4, ... up to ``n_keys / 2``."""
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
    """``D_j = ||y_j - s||``, or the cosine distance ``1 - <y_j,s> / max(||y_j|| ||s||, 1e-12)``."""
    s = s[..., None, :]
    if distance == "euclidean":
        return torch.linalg.vector_norm(y - s, dim=-1)
    dot = (y * s).sum(-1)
    norms = torch.linalg.vector_norm(y, dim=-1) * torch.linalg.vector_norm(s, dim=-1)
    return 1.0 - dot / norms.clamp_min(COSINE_EPS)


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
    """``n_random`` uniform random rankings of the candidate keys per row (non-candidates last).

    Nested across N by construction: the N-key selection is the first N keys of the ranking.
    """
    shape = (*candidates.shape[:-1], n_random, candidates.shape[-1])
    draws = torch.rand(shape, generator=generator, dtype=torch.float64)
    draws = draws.to(candidates.device).masked_fill(~candidates[..., None, :], 2.0)
    return torch.sort(draws, dim=-1, stable=True).indices


def random_rankings(
    seed: int, document: int, layer: int, query: int, n_heads: int, n_random: int
) -> Int[Tensor, "head n_random key"]:
    """The random baseline's rankings of keys ``0..query`` for one (document, layer, query):
    :func:`random_order` with a generator seeded by ``(seed, document, layer, query)``
    (``document`` = the document's index in the corpus), so a run is reproducible whatever the
    batching or sharding."""
    generator = _seeded_generator(seed, document, layer, query)
    keys = torch.ones(n_heads, query + 1, dtype=torch.bool)
    return random_order(keys, n_random, generator)


def prf_of_ranking(
    y: Float[Tensor, "*rows key d_head"],
    order: Int[Tensor, "*rows key"],
    candidates: Bool[Tensor, "*rows key"],
    n_grid: Sequence[int],
    distance: Distance = "euclidean",
) -> PRF:
    """P_N, R_N, F_N of the selections ``S = order[:N]`` for every N of ``n_grid``.

    Args:
        y: Attention-weighted values ``alpha[i,j] v_j``.
        order: A ranking of the keys with the candidates first (:func:`top_order`,
            :func:`random_order`).
        candidates: Keys that may be selected; the others take no part at all.
        n_grid: Selection sizes.
        distance: ``"euclidean"`` or ``"cosine"``.

    Returns:
        :class:`PRF`, each ``[*rows, len(n_grid)]`` float64, NaN where ``N`` exceeds the number
        of candidates of the row.
    """
    y_ranked = y.gather(-2, order[..., None].expand(*order.shape, y.shape[-1]))
    aggregates = y_ranked.cumsum(-2)  # s_N = aggregates[..., N-1, :]
    rank = torch.empty_like(order).scatter_(
        -1, order, torch.arange(order.shape[-1], device=order.device).expand_as(order)
    )
    n_candidates = candidates.sum(-1)
    out = []
    for n in n_grid:
        d = selection_distance(y, aggregates[..., min(n, order.shape[-1]) - 1, :], distance)
        selected = rank < n
        outside = candidates & ~selected
        rho_max = d.masked_fill(~selected, -math.inf).amax(-1, keepdim=True)
        rho_min = d.masked_fill(~outside, math.inf).amin(-1, keepdim=True)
        false_pos = (outside & (d <= rho_max)).sum(-1).double()
        true_pos = (selected & (d < rho_min)).sum(-1).double()
        size = torch.full_like(false_pos, n)  # tensor / tensor: the same rounding as Python
        p = size / (size + false_pos)
        r = true_pos / size
        f = torch.where(p + r > 0, 2 * p * r / (p + r), torch.zeros((), dtype=torch.float64))
        undefined = n_candidates < n
        out.append([t.masked_fill(undefined, math.nan) for t in (p, r, f)])
    return PRF(*(torch.stack(ts, dim=-1) for ts in zip(*out, strict=True)))


def geometric_prf_batched(
    values: Float[Tensor, "*rows key d_head"],
    attention: Float[Tensor, "*rows key"],
    n_grid: Sequence[int],
    *,
    distance: Distance = "euclidean",
    candidates: Bool[Tensor, "*rows key"] | None = None,
    exclude: Sequence[int] | None = None,
) -> PRF:
    """:func:`geometric_prf` for many queries (and heads, layers, documents) and a grid of N.

    Vectorised over every leading axis and the keys; agrees exactly with :func:`geometric_prf`
    row by row.

    Args:
        values: ``v_j`` per row ``[*rows, key, d_head]``.
        attention: ``alpha[i, j]`` per row ``[*rows, key]``.
        n_grid: Selection sizes N.
        distance: ``"euclidean"`` or ``"cosine"``.
        candidates: Keys each row may select (default all; e.g. ``key <= query`` and real).
        exclude: Key indices removed from every row's candidates (e.g. the sink, ``[0]``).

    Returns:
        :class:`PRF`, each ``[*rows, len(n_grid)]``; NaN where N exceeds a row's candidates.
    """
    _check_distance(distance)
    grid = _check_grid(n_grid)
    if candidates is None:
        candidates = torch.ones(attention.shape, dtype=torch.bool, device=attention.device)
    candidates = candidates & ~_index_mask(exclude, attention.shape[-1], attention.device)
    y = attention[..., None] * values
    return prf_of_ranking(y, top_order(attention, candidates), candidates, grid, distance)


def geometric_prf(
    values: Float[Tensor, "key d_head"],
    attention: Float[Tensor, " key"],
    n: int,
    *,
    distance: Distance = "euclidean",
    exclude: Sequence[int] | None = None,
    ranking: Sequence[int] | None = None,
) -> tuple[float, float, float]:
    """Precision, recall and F of the top-N selection of one (layer, head, query) — SPEC §4.

    Args:
        values: The head's value vectors ``v_j`` of the query's keys ``[key, d_head]``.
        attention: The query's attention ``alpha[i, j]`` over those keys ``[key]``.
        n: Selection size N (1 <= N <= number of candidates).
        distance: ``"euclidean"`` (``||y_j - s_N||``) or ``"cosine"``.
        exclude: Key indices removed from the candidates entirely (e.g. ``[0]``, the sink).
        ranking: Rank the candidates in this order instead of by attention (e.g. a random
            permutation; excluded keys are dropped from it).

    Returns:
        ``(precision, recall, f)`` as floats.

    Example::

        v = torch.tensor([[1.0, 0.0], [0.0, 1.0], [0.1, 0.1]])
        geometric_prf(v, torch.tensor([0.5, 0.4, 0.1]), 2)   # (1.0, 1.0, 1.0)
    """
    values, attention = _check_query(values, attention)
    _check_distance(distance)
    n_keys = attention.shape[0]
    excluded = set(_check_indices(exclude, n_keys, "exclude"))
    if ranking is None:  # Python's sort is stable: ties keep the smaller index first
        scores = attention.tolist()
        ranked = sorted((j for j in range(n_keys) if j not in excluded), key=lambda j: -scores[j])
    else:
        ranked = [j for j in _check_ranking(ranking, n_keys) if j not in excluded]
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= len(ranked):
        raise InputError(
            f"n must be an integer between 1 and the number of candidate keys ({len(ranked)} of "
            f"{n_keys} after exclusions), got {n!r}; lower n."
        )
    y = attention[:, None] * values
    aggregate = y[ranked].cumsum(0)[n - 1]
    d = selection_distance(y, aggregate, distance)
    selected, others = d[ranked[:n]], d[ranked[n:]]
    rho_max = selected.max()
    rho_min = others.min() if len(others) else torch.tensor(math.inf, dtype=d.dtype)
    false_pos = int((others <= rho_max).sum())
    true_pos = int((selected < rho_min).sum())
    p = n / (n + false_pos)
    r = true_pos / n
    f = 2 * p * r / (p + r) if p + r > 0 else 0.0
    return p, r, f


# ---------------------------------------------------------------------- input checks


def _check_distance(distance: str) -> None:
    if distance not in DISTANCES:
        raise InputError(f"distance must be 'euclidean' or 'cosine', got {distance!r}.")


def _check_grid(n_grid: Sequence[int]) -> list[int]:
    grid = list(n_grid)
    if not grid or any(isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in grid):
        raise InputError(f"n_grid must be a non-empty list of positive integers, got {n_grid!r}.")
    return sorted(set(grid))


def _check_query(values: Any, attention: Any) -> tuple[Tensor, Tensor]:
    values = torch.as_tensor(values)
    attention = torch.as_tensor(attention)
    if not values.is_floating_point():
        values = values.double()
    if not attention.is_floating_point():
        attention = attention.to(values.dtype)
    if values.ndim != 2 or attention.ndim != 1 or values.shape[0] != attention.shape[0]:
        raise InputError(
            f"geometric_prf takes one query: values [key, d_head] and attention [key] with the "
            f"same number of keys; got {tuple(values.shape)} and {tuple(attention.shape)}. Use "
            "geometric_prf_batched for many queries."
        )
    if values.shape[0] == 0:
        raise InputError("There are no keys to select from.")
    if not (torch.isfinite(values).all() and torch.isfinite(attention).all()):
        raise InputError("values and attention must be finite (no NaN or inf).")
    dtype = torch.promote_types(values.dtype, attention.dtype)
    return values.to(dtype), attention.to(dtype)


def _check_indices(indices: Sequence[int] | None, n: int, what: str) -> list[int]:
    out = []
    for j in indices or ():
        if isinstance(j, bool) or not isinstance(j, (int, np.integer)) or not 0 <= j < n:
            raise InputError(f"{what} must hold key indices in [0, {n}), got {j!r}.")
        out.append(int(j))
    return out


def _check_ranking(ranking: Sequence[int], n: int) -> list[int]:
    ranked = _check_indices(list(ranking), n, "ranking")
    if sorted(ranked) != list(range(n)):
        raise InputError(f"ranking must be a permutation of the {n} key indices.")
    return ranked


def _index_mask(indices: Sequence[int] | None, n: int, device: Any) -> Tensor:
    mask = torch.zeros(n, dtype=torch.bool, device=device)
    mask[_check_indices(indices, n, "exclude")] = True
    return mask


def _seeded_generator(*key: int) -> torch.Generator:
    state = np.random.SeedSequence([int(k) for k in key]).generate_state(2, dtype=np.uint32)
    return torch.Generator().manual_seed(int(state[0]) << 32 | int(state[1]))


# =========================================================================== selection geometry


class _SelectionAccumulator:
    """Exact sums of P, R, F and counts, ``[rule, head, n, 4]`` per layer."""

    def __init__(
        self,
        n_grid: list[int],
        query: str,
        n_random: int,
        seed: int,
        sinks: tuple[int, ...],
        distance: Distance,
        record: tuple[list[int], int, int] | None = None,
    ) -> None:
        self.n_grid, self.query, self.n_random = n_grid, query, n_random
        self.seed, self.sinks, self.distance = seed, sinks, distance
        self.sums = ExactSums()
        self.per_doc: PerDocument | None = None  # opt-in (layers, heads, documents) record
        if record is not None:
            layers, n_heads, n_documents = record
            self.pos = {layer: i for i, layer in enumerate(layers)}
            shape = (len(layers), len(RULES), n_heads, len(n_grid), 2)
            self.per_doc = PerDocument(["f_and_count"], n_documents, shape)

    def merge(self, other: _SelectionAccumulator) -> None:
        self.sums.merge(other.sums)
        if self.per_doc is not None:
            self.per_doc.merge(other.per_doc)

    def update(self, lc: Any) -> None:
        if lc.queries.start != 0:  # the whole layer is handled with its first query block
            return
        acts = lc.acts
        pairs = _query_pairs(acts.batch.lengths.tolist(), self.query, self.sinks)
        n_batch, n_heads, _, n_keys = acts.pattern.shape
        totals = torch.zeros(n_batch, len(RULES), n_heads, len(self.n_grid), 4, dtype=torch.float64)
        per_pair = n_heads * n_keys * acts.values.shape[-1] * 4 * (4 + 3 * self.n_random)
        chunk = max(1, int(ROW_BUDGET_BYTES // per_pair))
        for start in range(0, len(pairs), chunk):
            rows, queries = (t.to(acts.pattern.device) for t in pairs[start : start + chunk].T)
            sums = self._score(acts, rows, queries)
            totals.index_add_(0, rows.cpu(), sums)
        self.sums.add_rows(acts.batch.documents, f"layer{acts.layer}", totals)
        if self.per_doc is not None:  # F sums and scored queries, per document
            at = self.pos[acts.layer]
            self.per_doc.add_rows(acts.batch.documents, "f_and_count", totals[..., 2:], at=at)

    def _score(self, acts: Any, rows: Tensor, queries: Tensor) -> Tensor:
        """``[pair, rule, head, n, (P, R, F, count)]`` sums for (batch row, query) pairs."""
        n_heads, n_keys = acts.pattern.shape[1], acts.pattern.shape[-1]
        attention = acts.pattern[rows, :, queries, :]  # [pair, head, key]
        kv = kv_of_heads(n_heads, acts.values.shape[2], attention.device)
        values = einops.rearrange(acts.values[rows][:, :, kv], "p k h d -> p h k d")
        keys = torch.arange(n_keys, device=attention.device)
        causal = (keys[None, :] <= queries[:, None])[:, None, :].expand_as(attention)
        sinks = torch.tensor(self.sinks, device=keys.device)
        no_sink = causal & ~torch.isin(keys, sinks)
        y = attention[..., None] * values
        per_rule = {
            "top": prf_of_ranking(
                y, top_order(attention, causal), causal, self.n_grid, self.distance
            ),
            "top_no_sink": prf_of_ranking(
                y, top_order(attention, no_sink), no_sink, self.n_grid, self.distance
            ),
        }
        if self.n_random:
            docs = [acts.batch.documents[b] for b in rows.tolist()]
            per_rule["random"] = self._random(y, causal, docs, acts.layer, queries.tolist())
        grid = torch.tensor(self.n_grid, device=keys.device)
        scored = (2 * grid[None, :] <= queries[:, None] + 1)[:, None, :].expand(-1, n_heads, -1)
        out = torch.zeros(len(rows), len(RULES), n_heads, len(self.n_grid), 4, dtype=torch.float64)
        for r, rule in enumerate(RULES):
            if rule not in per_rule:
                continue
            # N beyond the candidates (several sink positions, short queries) is undefined
            counted = scored & ~per_rule[rule].f.isnan()
            for k, metric in enumerate(per_rule[rule]):
                out[:, r, ..., k] = torch.where(counted, metric, 0.0).cpu()
            out[:, r, ..., 3] = counted.cpu().double()
        return out

    def _random(
        self, y: Tensor, candidates: Tensor, docs: list[int], layer: int, queries: list[int]
    ) -> PRF:
        """Mean P, R, F over the ``n_random`` nested random rankings of each (pair, head)."""
        orders = torch.stack(
            [
                self._random_orders(doc, layer, q, y.shape[1], y.shape[2])
                for doc, q in zip(docs, queries, strict=True)
            ]
        ).to(y.device)
        n = self.n_random
        prf = prf_of_ranking(
            y[:, :, None].expand(-1, -1, n, -1, -1),
            orders,
            candidates[:, :, None].expand(-1, -1, n, -1),
            self.n_grid,
            self.distance,
        )
        return PRF(*(t.mean(2) for t in prf))

    def _random_orders(self, doc: int, layer: int, query: int, n_heads: int, n_keys: int) -> Tensor:
        """``[head, n_random, key]``: :func:`random_rankings` of keys ``0..query``, then the
        later keys (never candidates)."""
        ranked = random_rankings(self.seed, doc, layer, query, n_heads, self.n_random)
        later = torch.arange(query + 1, n_keys).expand(n_heads, self.n_random, -1)
        return torch.cat([ranked, later], dim=-1)


def _query_pairs(lengths: list[int], query: str, sinks: tuple[int, ...]) -> Tensor:
    """``[pair, 2]`` (batch row, query position) of the queries to score."""
    pairs = []
    for row, n in enumerate(lengths):
        positions = [n - 1] if query == "last" else range(1, n)
        pairs += [(row, q) for q in positions if q not in sinks and q >= 1]
    return torch.tensor(pairs, dtype=torch.long).reshape(-1, 2)


def head_f_ratio(f_without: pd.Series, f_with: pd.Series) -> pd.Series:
    """Per head: F(sink excluded) / F(sink allowed); ``inf`` where only the sink-free F is
    positive, NaN where both are 0."""
    ratio = f_without / f_with.where(f_with > 0)
    return ratio.mask((f_with == 0) & (f_without > 0), math.inf)


SMALL_N = (2, 4)
SINK_N = (2, 4)


def selection_claims(table: pd.DataFrame) -> list[Claim]:
    """``topn_beats_random`` (when the random rule was run) and ``sink_lowers_fn``, as SPEC §6's
    criterion column reads them, from the per-head table of
    :meth:`SelectionGeometryResult.to_dataframe` (``layer, head, n, rule, f``).

    - ``topn_beats_random``: the mean over heads of F_N(top) - F_N(random) is > 0 at every
      N > 1 (its minimum is the number), and the largest difference is at N in {2, 4} (the
      number: the largest difference there minus the largest at N > 4; omitted when no N > 4
      was measured).
    - ``sink_lowers_fn``: at N = 2 and N = 4 the median over heads of
      F_N(sink excluded) / F_N(sink allowed) (:func:`head_f_ratio`) is > 1; the share of heads
      at >= 2x is reported beside it.
    """
    f = table.pivot_table(index=["layer", "head", "n"], columns="rule", values="f")
    means = f.groupby("n").mean()
    grid = [int(n) for n in means.index if n > 1]
    out = []
    if "random" in f:
        gap = (means["top"] - means["random"]).loc[grid]
        small = [n for n in grid if n in SMALL_N]
        large = [n for n in grid if n > max(SMALL_N)]
        checks = [Check("min_over_n_f_top_minus_random", gap.min() if grid else math.nan, ">", 0.0)]
        if large:
            peak_small = gap.loc[small].max() if small else math.nan
            checks.append(
                Check(
                    "largest_gap_n2_n4_minus_larger_n", peak_small - gap.loc[large].max(), ">", 0.0
                )
            )
        out.append(
            Claim(
                "topn_beats_random",
                paper="top-N selections more separable than random, most at small N (P2)",
                criterion="mean F_N(top) > F_N(random) at every N > 1, and the largest "
                "difference at N ∈ {2, 4}",
                checks=checks,
                measured={
                    "f_top_minus_random": rounded_dict(gap),
                    "f_top": rounded_dict(means.loc[grid, "top"]),
                    "f_random": rounded_dict(means.loc[grid, "random"]),
                    "top_over_random": rounded_dict(
                        means.loc[grid, "top"] / means.loc[grid, "random"]
                    ),
                    "n_with_largest_gap": int(gap.idxmax()) if grid else None,
                },
            )
        )
    ratio = head_f_ratio(f["top_no_sink"], f["top"])
    median = ratio.groupby("n").median()
    at_least_2x = (ratio.dropna() >= 2).groupby("n").mean()
    out.append(
        Claim(
            "sink_lowers_fn",
            paper="including the sink in top-N lowers F_N (often about 2x) (P2)",
            criterion="at N = 2 and N = 4 the median over heads of F_N(sink excluded)/"
            "F_N(sink allowed) > 1; the share of heads at ≥ 2× is reported beside it",
            checks=[
                Check(f"median_head_ratio_n{n}", median.get(n, math.nan), ">", 1.0) for n in SINK_N
            ],
            measured={
                "share_heads_at_least_2x": {
                    n: round(float(at_least_2x.get(n, math.nan)), 4) for n in SINK_N
                },
                "median_head_ratio": rounded_dict(median.loc[grid]),
                "ratio_of_mean_f": rounded_dict(
                    means.loc[grid, "top_no_sink"] / means.loc[grid, "top"]
                ),
            },
        )
    )
    return out


@dataclass
class SelectionGeometryResult:
    """F_N, P_N, R_N of the three selection rules per (layer, head, N), summed over a corpus.

    Attributes:
        sums: float64 totals ``[layer, rule, head, n, 4]``: the sums of P, R, F over the scored
            queries (the random rule contributes each query's mean over its ``n_random``
            rankings) and the number of scored queries.
        layers: Layer index of each entry of the layer axis.
        n_grid: The N of each entry of the n axis.
        query: ``"last"`` (the last real position of each document) or ``"all"``.
        n_random, seed: The random baseline's size and seed.
        sink_positions: Positions excluded by the ``top_no_sink`` rule.
        distance: ``"euclidean"`` or ``"cosine"``.
        n_documents: Documents in the corpus.

    Means are NaN where no query was scored (a query needs at least ``2N`` keys); tables drop
    those entries.
    """

    sums: Float[Tensor, "layer rule head n 4"]
    layers: list[int]
    n_grid: list[int]
    query: str
    n_random: int
    seed: int
    sink_positions: tuple[int, ...]
    distance: str
    n_documents: int
    model_name: str = ""
    per_document: Tensor | None = None  # [document, layer, rule, head, n, (F sum, queries)]

    @property
    def rules(self) -> tuple[str, ...]:
        return RULES if self.n_random else tuple(r for r in RULES if r != "random")

    @property
    def n_queries(self) -> Int[Tensor, "layer rule head n"]:
        """Scored queries per (layer, rule, head, N) (equal across rules unless several sink
        positions leave the sink-free rule fewer than N candidates)."""
        return self.sums[..., 3].long()

    def mean(self, metric: str = "f") -> Float[Tensor, "layer rule head n"]:
        """Mean ``precision``, ``recall`` or ``f`` over the scored queries (NaN where none)."""
        index = {"precision": 0, "recall": 1, "f": 2}
        if metric not in index:
            raise InputError(f"metric must be 'precision', 'recall' or 'f', got {metric!r}.")
        count = self.sums[..., 3]
        return torch.where(count > 0, self.sums[..., index[metric]] / count, math.nan)

    def to_dataframe(self) -> pd.DataFrame:
        """One row per (layer, head, n, rule): precision, recall, f, n_queries."""
        n_heads = self.sums.shape[2]
        layer, head, n = np.meshgrid(self.layers, range(n_heads), self.n_grid, indexing="ij")
        frames = []
        for r, rule in enumerate(RULES):
            if rule not in self.rules:
                continue
            frame = {"layer": layer.ravel(), "head": head.ravel(), "n": n.ravel(), "rule": rule}
            for metric in ("precision", "recall", "f"):
                frame[metric] = self.mean(metric)[:, r].numpy().ravel()
            frame["n_queries"] = self.n_queries[:, r].numpy().ravel()
            frames.append(pd.DataFrame(frame))
        df = pd.concat(frames, ignore_index=True)
        return df[df["n_queries"] > 0].reset_index(drop=True)

    def f_by_n(self, metric: str = "f") -> pd.DataFrame:
        """Mean over heads of each head's mean ``metric`` per N and rule (index ``n``), with
        ``top_over_random`` (claim ``topn_beats_random``) and ``no_sink_over_sink`` =
        F(top_no_sink) / F(top) (claim ``sink_lowers_fn``: > 1 when the sink lowers F_N)."""
        df = self.to_dataframe()
        table = df.pivot_table(index="n", columns="rule", values=metric, aggfunc="mean")
        table = table[list(self.rules)]
        if "random" in table:
            table["top_over_random"] = table["top"] / table["random"]
        table["no_sink_over_sink"] = table["top_no_sink"] / table["top"]
        table["n_heads"] = df[df["rule"] == "top"].groupby("n").size()
        table.columns.name = None
        return table

    def head_quantiles(self, q: Sequence[float] = (0.25, 0.75), metric: str = "f") -> pd.DataFrame:
        """Quantiles over heads of the per-head mean ``metric``, per rule and N (long format)."""
        df = self.to_dataframe()
        out = df.groupby(["rule", "n"])[metric].quantile(list(q)).unstack()
        out.columns = [f"q{round(100 * x)}" for x in q]
        return out.reset_index()

    def sink_effect(self) -> pd.DataFrame:
        """Per N: mean F with and without the sink, their ratio, the share of heads whose F
        rises when the sink is excluded, the median per-head ratio (claim ``sink_lowers_fn``)
        and the share of heads whose ratio is at least 2 (:func:`head_f_ratio`)."""
        df = self.to_dataframe().pivot_table(
            index=["layer", "head", "n"], columns="rule", values="f"
        )
        ratio = head_f_ratio(df["top_no_sink"], df["top"])
        per_n = pd.DataFrame(
            {
                "f_with_sink": df["top"].groupby("n").mean(),
                "f_without_sink": df["top_no_sink"].groupby("n").mean(),
                "share_heads_higher_without": (df["top_no_sink"] > df["top"]).groupby("n").mean(),
                "median_head_ratio": ratio.groupby("n").median(),
                "share_heads_at_least_2x": (ratio.dropna() >= 2).groupby("n").mean(),
            }
        )
        per_n.insert(2, "ratio", per_n["f_without_sink"] / per_n["f_with_sink"])
        return per_n

    def top(self, k: int = 10, *, n: int | None = None, rule: str = "top") -> pd.DataFrame:
        """The ``k`` heads with the highest mean F at ``n`` (default: the second N of the grid)."""
        if rule not in self.rules:
            raise InputError(f"rule must be one of {self.rules}, got {rule!r}.")
        n = self.n_grid[min(1, len(self.n_grid) - 1)] if n is None else n
        if n not in self.n_grid:
            raise InputError(f"n={n} is not in this result's grid {self.n_grid}.")
        df = self.to_dataframe()
        df = df[(df["rule"] == rule) & (df["n"] == n)]
        return df.sort_values("f", ascending=False, kind="stable").head(k).reset_index(drop=True)

    def summary(self) -> dict[str, Any]:
        """Headline numbers of the claims ``topn_beats_random`` and ``sink_lowers_fn``."""
        table = self.f_by_n()
        out: dict[str, Any] = {
            "query": self.query,
            "n_documents": self.n_documents,
            "n_grid": self.n_grid,
            "f_top": rounded_dict(table["top"]),
            "f_top_no_sink": rounded_dict(table["top_no_sink"]),
            "no_sink_over_sink": rounded_dict(table["no_sink_over_sink"]),
            "median_head_no_sink_over_sink": rounded_dict(self.sink_effect()["median_head_ratio"]),
        }
        if "random" in table:
            out["f_random"] = rounded_dict(table["random"])
            out["top_over_random"] = rounded_dict(table["top_over_random"])
        out["claims_hold"] = {cid: claim["holds"] for cid, claim in self.claims().items()}
        return out

    def claims(self, bootstrap: Bootstrap | None = None) -> dict[str, dict[str, Any]]:
        """P2's selection claims (SPEC §6) with the numbers measured here
        (:func:`selection_claims`); with ``bootstrap``, each number's interval over documents
        (:func:`cw_lens.core.resampled.selection_numbers`; needs ``per_document=True``)."""
        claims = selection_claims(self.to_dataframe())
        if bootstrap is not None:
            require_record(self.per_document, "selection_geometry")
            reps = selection_numbers(
                bootstrap.resample(self.per_document), self.n_grid, RULES, SMALL_N, SINK_N
            )
            claims = with_intervals(claims, {k: bootstrap.pair(v) for k, v in reps.items()})
        return claims_dict(claims)

    def plot(self, **kwargs: Any) -> Any:
        """F_N against N for top-N and the random baseline (claim ``topn_beats_random``)."""
        from cw_lens.plots.selection import plot_topn_beats_random

        return plot_topn_beats_random(self, **kwargs)

    def plot_sink_effect(self, **kwargs: Any) -> Any:
        """F_N with and without the sink (claim ``sink_lowers_fn``)."""
        from cw_lens.plots.selection import plot_sink_lowers_fn

        return plot_sink_lowers_fn(self, **kwargs)


def selection_geometry(
    model: Any,
    corpus: Any,
    *,
    n_grid: Sequence[int] | None = None,
    query: Literal["last", "all"] = "last",
    n_random: int = 16,
    seed: int = 0,
    sink_positions: Sequence[int] = (0,),
    distance: Distance = "euclidean",
    layers: int | Sequence[int] | None = None,
    batch_size: int | None = 8,
    prepend_bos: bool = True,
    progress: bool = True,
    per_document: bool = False,
) -> SelectionGeometryResult:
    """P2's token-selection geometry: F_N of top-N, random and sink-free selections per head.

    Args:
        model: A ``TransformerBridge`` (``cw_lens.load_model()``).
        corpus: What :func:`cw_lens.load_corpus` returns, or a list of strings.
        n_grid: Selection sizes N; ``None`` = 1, 2, 4, ... up to half the longest document.
            An N larger than half the longest document's length is an error.
        query: ``"last"`` scores the last real position of every document (P2's default);
            ``"all"`` every position ``i >= 1`` — about ``T`` times the work (use few
            documents or ``layers=``).
        n_random: Random rankings per (head, query) for the baseline (0 = no baseline).
        seed: Seed of the random rankings (per document, layer and query; see module doc).
        sink_positions: Positions the ``top_no_sink`` rule removes from the candidates.
        distance: ``"euclidean"`` (SPEC default) or ``"cosine"``.
        layers: Layers to analyse (``None`` = all).
        batch_size: Documents per forward pass.
        prepend_bos: Prepend BOS (position 0 is then the usual sink).
        progress: Show a progress bar over document batches.
        per_document: Also keep each document's F sums and scored queries per (layer, rule,
            head, N) (``24 * n_layers * n_heads * len(n_grid) + 1`` bytes per document, 45 KB
            for SmolLM2-135M at 128 tokens) for bootstrap intervals
            (:meth:`SelectionGeometryResult.claims`).

    Returns:
        A :class:`SelectionGeometryResult`.

    Example::

        geo = cw_lens.selection_geometry(model, cw_lens.load_corpus(tokenizer=model))
        geo.f_by_n()          # columns top, random, top_no_sink, top_over_random, ...
        geo.plot()
    """
    require_verified(model)
    if query not in ("last", "all"):
        raise InputError(f"query must be 'last' or 'all', got {query!r}.")
    check_count(n_random, "n_random (16 in P2)", minimum=0)
    _check_distance(distance)
    sinks = check_sinks(sink_positions)
    docs = as_corpus(corpus)
    longest = int(prepare_inputs(model, docs, prepend_bos=prepend_bos).lengths.max())
    grid = power_grid(longest) if n_grid is None else _check_grid(n_grid)
    if not grid or 2 * grid[-1] > longest:
        raise InputError(
            f"N={grid[-1] if grid else 1} needs queries with at least {2 * (grid or [1])[-1]} "
            f"keys, but the longest document has {longest} tokens; lower n_grid or use longer "
            "documents (load_corpus(max_tokens=...))."
        )
    layer_list = resolve_layers(model, layers)
    record = (layer_list, model.cfg.n_heads, len(docs)) if per_document else None
    accumulator = _SelectionAccumulator(grid, query, n_random, seed, sinks, distance, record)
    accumulator, stats = stream_corpus(
        model,
        docs,
        accumulator,
        layers=layer_list,
        batch_size=batch_size,
        prepend_bos=prepend_bos,
        progress="selection geometry" if progress else False,
    )
    sums = torch.stack([accumulator.sums.total(f"layer{layer}") for layer in layer_list])
    return SelectionGeometryResult(
        sums=sums,
        layers=layer_list,
        n_grid=grid,
        query=query,
        n_random=n_random,
        seed=seed,
        sink_positions=sinks,
        distance=distance,
        n_documents=stats.n_documents,
        model_name=str(getattr(model.cfg, "model_name", "")),
        per_document=None
        if accumulator.per_doc is None
        else accumulator.per_doc.table("f_and_count"),
    )
