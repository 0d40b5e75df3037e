"""The streamed accumulator of [`selection_geometry`][cw_lens.selection_geometry]: P, R and F of
the top, random and sink-free selections of every scored query, per (layer, rule, head, N),
summed in float64 over the corpus (docs/methods.md#selection).

A layer is scored with its first block of query rows (the selection reads every key of a
query), all its scored queries at once: the top and sink-free rankings (`top_order`), the
random ones (`ranking_keys`, sorted) and P, R, F of every ranking and N (`prf_of_rankings`)
are a fixed number of tensor operations per layer and batch, on the model's device.
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Sequence
from typing import Any, Literal

import torch
from jaxtyping import Bool, Float, Int
from torch import Tensor

from cw_lens.analyses.common import check_count, check_sinks, kv_of_heads
from cw_lens.analyses.selection.prf import (
    Distance,
    check_distance,
    check_grid,
    power_grid,
    prf_of_rankings,
    ranking_entries,
    ranking_keys,
    top_order,
)
from cw_lens.core.accumulators import (
    EMPTY_KEY,
    Accumulator,
    StackedSums,
    document_rows,
)
from cw_lens.core.errors import InputError
from cw_lens.core.keywords import check_keywords
from cw_lens.data.documents import as_corpus
from cw_lens.data.inputs import prepare_inputs
from cw_lens.models.access import Model
from cw_lens.models.capture import resolve_layers
from cw_lens.models.verify import require_verified

RULES = ("top", "random", "top_no_sink")
# Memory for one chunk of scored (row, query) pairs (the float64 temporaries of the scoring).
# A fixed number: the chunks follow the batch's shape alone, never its data; with
# `query="last"` a batch of 32 documents of 512 tokens of a 32-head model is one chunk.
ROW_BUDGET_BYTES = 256e6
STATISTICS = ("precision", "recall", "f", "count")


class SelectionSums(Accumulator):
    """Sums of P_N, R_N, F_N and scored queries per (layer, rule, head, N), float64.

    For every scored query `i` of a document (the last real position, or every position
    `i >= 1`, that is not a sink position) and every N with `2N <= i + 1`:
    `sums[layer, rule, head, n] += (P_N, R_N, F_N, 1)` of that rule's selection (the
    `random` rule adds each query's mean over its `n_random` rankings; a rule with fewer than
    N candidates adds nothing). With `per_document=True` each document's sums as well (a
    `StackedSums` record). The checks and the streamed sums of
    `cw_lens.analyses.selection.SelectionGeometryAccumulator`, which adds `finish`.

    Args:
        model: The model.
        corpus: The documents (what [`selection_geometry`][cw_lens.selection_geometry] takes).
        n_grid: Selection sizes N (`None`: 1, 2, 4, ... up to half the longest document).
        query: `"last"` or `"all"`.
        n_random: Random rankings per (head, query) (0: no random rule).
        seed: Seed of the random rankings.
        sink_positions: Positions the `top_no_sink` rule removes.
        distance: `"euclidean"` or `"cosine"`.
        layers: Layers to analyse (`None` = all).
        batch_size: Documents per forward pass (the pass's; not read here).
        prepend_bos: Whether BOS is prepended (to check the sink positions and N).
        per_document: Keep each document's sums (for bootstrap intervals).

    Examples:
        ```python
        import cw_lens
        from cw_lens.analyses.selection.accumulation import SelectionSums
        from cw_lens.data.streaming import stream_corpus

        model = cw_lens.load_model("testing:tiny-llama")
        corpus = cw_lens.load_corpus(n_docs=2, max_tokens=16, model=model)
        acc = SelectionSums(model, corpus, n_random=4)
        stream_corpus(model, corpus, [acc])
        acc.sums.column("f").shape  # [layer, rule, head, n]
        ```
    """

    name = "selection"

    @check_keywords
    def __init__(
        self,
        model: Model,
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
        per_document: bool = False,
    ) -> None:
        require_verified(model)
        if query not in ("last", "all"):
            raise InputError(f"query must be 'last' or 'all', got {query!r}.")
        check_count(n_random, "n_random (16 in P2)", minimum=0)
        check_distance(distance)
        docs = as_corpus(corpus)
        sinks = check_sinks(sink_positions, model=model, inputs=docs, prepend_bos=prepend_bos)
        longest = int(prepare_inputs(model, docs, prepend_bos=prepend_bos).lengths.max())
        grid = power_grid(longest) if n_grid is None else check_grid(n_grid)
        if not grid or 2 * grid[-1] > longest:
            raise InputError(
                f"N={grid[-1] if grid else 1} needs queries with at least {2 * (grid or [1])[-1]} "
                f"keys, but the longest document has {longest} tokens; lower n_grid or use longer "
                "documents (load_corpus(max_tokens=...))."
            )
        self.layers = resolve_layers(model, layers)
        self.n_grid, self.query, self.n_random, self.seed = grid, query, int(n_random), int(seed)
        self.sink_positions, self.distance = sinks, distance
        self.per_document = per_document
        self.model_name = str(getattr(model.cfg, "model_name", ""))
        self.n_heads = model.cfg.n_heads
        self._position = {layer: i for i, layer in enumerate(self.layers)}
        device = model.cfg.device
        shape = (len(self.layers), len(RULES), self.n_heads, len(grid))
        record = len(docs) if per_document else None
        self.sums = StackedSums(STATISTICS, shape, n_documents=record, device=device)
        with torch.inference_mode(False):  # uploaded once
            self._sinks = torch.tensor(sinks, dtype=torch.long, device=device)
            self._grid = torch.tensor(grid, dtype=torch.long, device=device)
        self._cache: dict[str, Any] = {}

    def update(self, block: Any) -> None:
        """Score every query of the block's layer (with its first block of query rows).

        Args:
            block: One layer's `LayerContributionsResult`.
        """
        if block.queries.start != 0:  # the whole layer is handled with its first query block
            return
        acts = block.acts
        n_batch, n_heads, _, n_keys = acts.pattern.shape
        device = acts.pattern.device
        tables = self._tables(n_heads, acts.values.shape[2], n_keys, device)
        documents = document_rows(acts.batch.documents, device)
        lengths = acts.mask.sum(-1)  # right-padded: real tokens are 0 .. length - 1
        if self.query == "last":
            queries = (lengths - 1)[:, None]
        else:
            queries = tables["positions"].expand(n_batch, -1)
        valid = (queries < lengths[:, None]) & tables["scorable"][queries]
        rows_step, queries_step = self._chunks(n_batch, queries.shape[1], n_keys, acts)
        values = acts.values[:, :, tables["kv"]].transpose(1, 2)  # [batch, head, key, d_head]
        per_rows = []
        for r in range(0, n_batch, rows_step):
            rows = slice(r, r + rows_step)
            sums = [
                self._score(
                    acts.pattern[rows],
                    values[rows],
                    documents[rows],
                    queries[rows, q : q + queries_step],
                    valid[rows, q : q + queries_step],
                    acts.layer,
                    tables,
                )
                for q in range(0, queries.shape[1], queries_step)
            ]
            per_rows.append(functools.reduce(operator.add, sums))
        totals = per_rows[0] if len(per_rows) == 1 else torch.cat(per_rows)
        self.sums.add(totals, documents, at=self._position[acts.layer])

    def _tables(self, n_heads: int, n_kv: int, n_keys: int, device: Any) -> dict[str, Tensor]:
        """What depends on the shapes alone, made once per shape (no data, no device wait)."""
        key = (n_heads, n_kv, n_keys, str(device))
        if self._cache.get("key") != key:
            positions = torch.arange(n_keys, device=device)
            sink = torch.isin(positions, self._sinks.to(device))
            rankings = 2 + self.n_random
            # candidates per ranking (top, top_no_sink, random...): the sink-free one has no sink
            allowed = torch.ones(rankings, n_keys, dtype=torch.bool, device=device)
            allowed[1] = ~sink
            weights = torch.zeros(len(RULES), rankings, dtype=torch.float64, device=device)
            weights[0, 0], weights[2, 1] = 1.0, 1.0
            weights[1, 2:] = 1.0 / max(self.n_random, 1)  # the random rule: the rankings' mean
            self._cache = {
                "key": key,
                "positions": positions,
                "scorable": (positions >= 1) & ~sink,
                "allowed": allowed,
                "entries": ranking_entries(n_heads, self.n_random, n_keys, device),
                "kv": kv_of_heads(n_heads, n_kv, device),
                "grid": self._grid.to(device),
                "weights": weights,
            }
        return self._cache

    def _chunks(self, n_batch: int, n_queries: int, n_keys: int, acts: Any) -> tuple[int, int]:
        """Rows and queries per chunk: what keeps the scoring's temporaries of one chunk
        within `ROW_BUDGET_BYTES` (a function of the shapes alone)."""
        rankings = 2 + self.n_random
        d_head, aggregates = acts.values.shape[-1], rankings * len(self.n_grid)
        per_pair = 8 * self.n_heads * n_keys * (d_head + 2 * aggregates + 3 * rankings)
        if self.distance == "cosine":  # the [key, aggregate, d_head] products
            per_pair += 8 * self.n_heads * n_keys * aggregates * d_head
        pairs = max(1, int(ROW_BUDGET_BYTES // per_pair))
        if n_batch * n_queries <= pairs:
            return n_batch, n_queries
        if n_queries == 1:
            return pairs, 1
        return 1, min(n_queries, pairs)

    def _score(
        self,
        pattern: Float[Tensor, "batch head pos key"],
        values: Float[Tensor, "batch head key d_head"],
        documents: Int[Tensor, " batch"],
        queries: Int[Tensor, "batch query"],
        valid: Bool[Tensor, "batch query"],
        layer: int,
        tables: dict[str, Tensor],
    ) -> Tensor:
        """`[batch, rule, head, n, (P, R, F, count)]` sums over the given queries of each row."""
        n_batch, n_heads, _, n_keys = pattern.shape
        n_queries = queries.shape[1]
        index = queries[:, None, :, None].expand(n_batch, n_heads, n_queries, n_keys)
        attention = pattern.gather(2, index)  # [batch, head, query, key]
        y = attention.double()[..., None] * values[:, :, None].double()  # [.., key, d_head]
        causal = tables["positions"] <= queries[:, None, :, None]  # [batch, 1, query, key]
        # candidates of each ranking: top, top_no_sink, then the random ones
        candidates = causal[..., None, :] & tables["allowed"]  # [batch, 1, query, ranking, key]
        candidates = candidates.expand(n_batch, n_heads, *candidates.shape[2:])
        orders = [
            top_order(
                attention[..., None, :].expand_as(candidates[..., :2, :]), candidates[..., :2, :]
            )
        ]
        if self.n_random:
            keys = ranking_keys(
                self.seed,
                layer,
                documents,
                queries,
                n_heads,
                self.n_random,
                n_keys,
                entries=tables["entries"],
            ).masked_fill(~candidates[..., 2:, :], EMPTY_KEY)
            orders.append(keys.sort(dim=-1, stable=True).indices)
        prf = prf_of_rankings(
            y,
            torch.cat(orders, -2),
            candidates,
            self.n_grid,
            self.distance,
            grid=tables["grid"],
        )  # [batch, head, query, ranking, n, (P, R, F)]
        scored = valid[..., None] & (2 * tables["grid"] <= queries[..., None] + 1)
        counted = (
            scored[:, None, :, None] & ~prf[..., 2].isnan()
        )  # [batch, head, query, ranking, n]
        stacked = torch.cat([prf, counted[..., None].double()], -1)
        stacked = torch.where(counted[..., None], stacked, 0.0)
        # one contraction: sum over queries, and each rule's weights over its rankings
        return torch.einsum("bhqkns,rk->brhns", stacked, tables["weights"])
