"""The streamed accumulator of [`selection_geometry`][cw_lens.selection_geometry]: P, R and F of
the top, random and sink-free selections of every scored query, per (layer, rule, head, N),
summed exactly over the corpus (docs/methods.md#selection).

A layer is scored with its first block of query rows (the selection reads every key of a
query). The sums stay on the model's device during the pass (`ExactSums` and `PerDocument` buffer
there) and reach the host once, after it (`to_host`); only the random rankings, seeded per
(document, layer, query) on the CPU, travel the other way.
"""

from __future__ import annotations

from typing import Any

import einops
import torch
from torch import Tensor

from cw_lens.analyses.common import SumsAndRecords, kv_of_heads
from cw_lens.analyses.selection.prf import (
    PRF,
    Distance,
    prf_of_ranking,
    random_rankings,
    top_order,
)
from cw_lens.core.accumulate import ExactSums, PerDocument

RULES = ("top", "random", "top_no_sink")
# Memory for one chunk of selection-geometry rows (float32 temporaries).
ROW_BUDGET_BYTES = 256e6


class _SelectionAccumulator(SumsAndRecords):
    """Exact sums of P, R, F and counts, `[rule, head, n, 4]` per layer.

    Args:
        n_grid: The selection sizes N.
        query: `"last"` or `"all"` (the queries scored).
        n_random: Random rankings per (head, query); 0: no random rule.
        seed: Seed of the random rankings.
        sinks: The positions the `top_no_sink` rule removes.
        distance: `"euclidean"` or `"cosine"`.
        record: `(layers, n_heads, n_documents)` to keep each document's F sums and counts.
    """

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

    def update(self, lc: Any) -> None:
        if lc.queries.start != 0:  # the whole layer is handled with its first query block
            return
        acts = lc.acts
        pairs = _query_pairs(acts.batch.lengths.tolist(), self.query, self.sinks)
        n_batch, n_heads, _, n_keys = acts.pattern.shape
        # one query per row (`last`): each row's totals are its one pair's, summed where they
        # are; several (`all`): summed row by row on the host, in pair order, as they always were
        one_each = len(set(pairs[:, 0].tolist())) == len(pairs)
        device = acts.pattern.device if one_each else torch.device("cpu")
        shape = (n_batch, len(RULES), n_heads, len(self.n_grid), 4)
        totals = torch.zeros(shape, dtype=torch.float64, device=device)
        per_pair = n_heads * n_keys * acts.values.shape[-1] * 4 * (4 + 3 * self.n_random)
        chunk = max(1, int(ROW_BUDGET_BYTES // per_pair))
        for start in range(0, len(pairs), chunk):
            rows, queries = pairs[start : start + chunk].T
            sums = self._score(acts, rows, queries)
            totals.index_add_(0, rows.to(device), sums.to(device))
        self.sums.add_rows(acts.batch.documents, f"layer{acts.layer}", totals)
        if self.per_doc is not None:  # F sums and scored queries, per document
            at = self.pos[acts.layer]
            self.per_doc.add_rows(acts.batch.documents, "f_and_count", totals[..., 2:], at=at)

    def _score(self, acts: Any, pair_rows: Tensor, pair_queries: Tensor) -> Tensor:
        """`[pair, rule, head, n, (P, R, F, count)]` sums for (batch row, query) pairs (given
        on the host), on the activations' device."""
        device = acts.pattern.device
        rows, queries = pair_rows.to(device), pair_queries.to(device)
        n_heads, n_keys = acts.pattern.shape[1], acts.pattern.shape[-1]
        attention = acts.pattern[rows, :, queries, :]  # [pair, head, key]
        kv = kv_of_heads(n_heads, acts.values.shape[2], device)
        values = einops.rearrange(acts.values[rows][:, :, kv], "p k h d -> p h k d")
        keys = torch.arange(n_keys, device=device)
        causal = (keys[None, :] <= queries[:, None])[:, None, :].expand_as(attention)
        sinks = torch.tensor(self.sinks, device=device)
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
            docs = [acts.batch.documents[b] for b in pair_rows.tolist()]
            per_rule["random"] = self._random(y, causal, docs, acts.layer, pair_queries.tolist())
        grid = torch.tensor(self.n_grid, device=device)
        scored = (2 * grid[None, :] <= queries[:, None] + 1)[:, None, :].expand(-1, n_heads, -1)
        zero = torch.zeros(len(rows), n_heads, len(self.n_grid), dtype=torch.float64, device=device)
        by_rule = []
        for rule in RULES:
            if rule not in per_rule:
                by_rule.append(torch.stack([zero] * 4, dim=-1))
                continue
            # N beyond the candidates (several sink positions, short queries) is undefined
            counted = scored & ~per_rule[rule].f.isnan()
            metrics = [torch.where(counted, metric, 0.0) for metric in per_rule[rule]]
            by_rule.append(torch.stack([*metrics, counted.double()], dim=-1))
        return torch.stack(by_rule, dim=1)

    def _random(
        self, y: Tensor, candidates: Tensor, docs: list[int], layer: int, queries: list[int]
    ) -> PRF:
        """Mean P, R, F over the `n_random` nested random rankings of each (pair, head)."""
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
        """`[head, n_random, key]`: `random_rankings` of keys `0..query`, then the
        later keys (never candidates)."""
        ranked = random_rankings(self.seed, doc, layer, query, n_heads, self.n_random)
        later = torch.arange(query + 1, n_keys, device="cpu").expand(n_heads, self.n_random, -1)
        return torch.cat([ranked, later], dim=-1)


def _query_pairs(lengths: list[int], query: str, sinks: tuple[int, ...]) -> Tensor:
    """`[pair, 2]` (batch row, query position) of the queries to score (on the host)."""
    pairs = []
    for row, n in enumerate(lengths):
        positions = [n - 1] if query == "last" else range(1, n)
        pairs += [(row, q) for q in positions if q not in sinks and q >= 1]
    return torch.tensor(pairs, dtype=torch.long, device="cpu").reshape(-1, 2)
