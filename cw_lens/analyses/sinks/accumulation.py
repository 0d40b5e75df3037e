"""The streamed sink accumulator (docs/methods.md#sinks): one block's statistics stacked into
one float64 sum per (layer, head), three histograms, a per-document record and a factor sample
(their layout in `cw_lens.analyses.sinks.statistics_layout`), finished into a
[`SinkStatisticsResult`][cw_lens.SinkStatisticsResult].
"""

from __future__ import annotations

import math
import warnings
from typing import Any

import torch
from torch import Tensor

from cw_lens.analyses.sinks.detection import (
    MIN_QUERY,
    SinkPositions,
    SinkSpec,
    queries_after_sink,
    resolve_sinks,
)
from cw_lens.analyses.sinks.statistics import SinkStatisticsResult
from cw_lens.analyses.sinks.statistics_layout import (
    DRIFT_SHARE_BINNING,
    GEOMETRY_SUMS,
    GROUPS,
    MAX_SAMPLES_PER_HEAD,
    RATE_BINS,
    RECORD_NAMES,
    SAMPLE_COLUMNS,
    SHARE_BIN_SUMS,
    SHARE_BINNING,
    SUM_NAMES,
)
from cw_lens.core import geometry as geo
from cw_lens.core.accumulators import (
    EMPTY_KEY,
    Accumulator,
    SampleReservoir,
    StackedSums,
    document_rows,
    entry_keys,
)
from cw_lens.core.errors import InputError
from cw_lens.core.histograms import Histogram, bin_indices, count_bins
from cw_lens.core.keywords import check_keywords
from cw_lens.data.documents import as_corpus
from cw_lens.models.access import Model
from cw_lens.models.capture import resolve_layers
from cw_lens.models.layer_contributions import LayerContributionsResult

_SHARE_BINS = Histogram((), **SHARE_BINNING)  # its bin_index only


class SinkStatisticsAccumulator(Accumulator):
    """The sink statistics of a corpus (docs/methods.md#sinks), folded one block at a time.

    Per (layer, head), with `s_i` the sink rate of query `i`, `o_i` the head output, `m_i` the
    tail mixture, `pv_j` the projected values, `d_i` the drift of the weak tail tokens:

    - `sums` (`StackedSums`, `[layer, head, statistic]`, the names `SUM_NAMES`): over queries
      after a sink, `sum s_i` and counts (`i >= min_query`, and all), `sum ||o_i||`,
      `sum cos(pv_0, m_i)`, the drift counts, the s* edge counts, the coarse cancelled-share
      histogram; over the (query, key) entries of each group (sink keys / tail keys) with a
      defined weight, the sums of attention, relative norm, cosine and contribution weight
      and their count; over (sink, tail token) pairs, `sum ||pv_j|| / ||pv_0||`, its log,
      `sum cos(pv_0, pv_j)`, and the count. One `add` per block.
    - `curve` (`StackedSums`, `[layer, head, bin, (norm, count)]`): `sum ||o_i||` and counts
      per sink-rate bin (queries `i >= min_query`).
    - `s_star`, `drift_cos`, `drift_share` (`Histogram`s): the counterfactual minimiser `s*`,
      `cos(alpha_0 pv_0, d_i)` and the cancelled share `-<alpha_0 pv_0, d_i> / ||d_i||^2`.
    - `record` (with `per_document=True`): each document's `RECORDED_SUMS` and coarse
      cancelled-share histogram (`RECORD_NAMES`), for the bootstrap over documents.
    - `samples` (`SampleReservoir`, unless `samples_per_head=0`): per (layer, head, group) the
      `max_samples` valid entries with the smallest keys
      `entry_keys(seed, layer, document, head, query, key)` over the whole corpus — a uniform
      sample without replacement of the group's entries, the same for any batch size, query
      block plan and sharding — with their factors and document (`SAMPLE_COLUMNS`).

    Args:
        model: A `TransformerBridge`.
        corpus: The corpus (as `sink_statistics` takes it).
        sink_positions: Sink positions, or `"detect"` (a pass of its own, here).
        layers: Layers (`None` = all).
        min_query: Queries `i >= min_query` define sink rates and curves.
        drift_k: Top-attended tail tokens kept out of the drift.
        samples_per_head: `0` keeps no factor sample; `None` (default) the rule above. Any
            other value is deprecated (a `FutureWarning`): the sample is `max_samples` per head,
            uniform over entries.
        max_samples: Factor samples kept per (layer, head) and group.
        seed: Seed of the sample's keys.
        batch_size: Documents per forward pass (of the detection pass).
        prepend_bos: Prepend BOS to text.
        per_document: Keep the per-document record.

    Examples:
        ```python
        import cw_lens
        from cw_lens.analyses.sinks import SinkStatisticsAccumulator
        from cw_lens.data.streaming import stream_corpus

        model = cw_lens.load_model("testing:tiny-llama")
        corpus = cw_lens.load_corpus(n_docs=2, max_tokens=16, model=model)
        acc = SinkStatisticsAccumulator(model, corpus, min_query=4)
        stats, _ = stream_corpus(model, corpus, [acc])
        acc.finish(stats).heads()
        ```
    """

    name = "sinks"

    @check_keywords
    def __init__(
        self,
        model: Model,
        corpus: Any,
        *,
        sink_positions: SinkPositions = (0,),
        layers: Any = None,
        min_query: int = MIN_QUERY,
        drift_k: int = 4,
        samples_per_head: int | None = None,
        max_samples: int = MAX_SAMPLES_PER_HEAD,
        seed: int = 0,
        batch_size: int | None = 8,
        prepend_bos: bool = True,
        per_document: bool = False,
    ) -> None:
        if drift_k < 1:
            raise InputError(f"drift_k must be at least 1, got {drift_k}.")
        if min_query < 1:
            raise InputError(f"min_query must be at least 1, got {min_query}.")
        if samples_per_head is not None and samples_per_head < 0:
            raise InputError(f"samples_per_head must be >= 0, got {samples_per_head}.")
        if max_samples < 1:
            raise InputError(f"max_samples must be at least 1, got {max_samples}.")
        if samples_per_head not in (None, 0):
            warnings.warn(
                "samples_per_head is deprecated and ignored except 0 (no sample): the factor "
                f"sample is now max_samples={max_samples} entries per (layer, head) and group, "
                "uniform over the corpus's entries. Pass samples_per_head=None (or leave it out).",
                FutureWarning,
                stacklevel=3,
            )
        self.layers = resolve_layers(model, layers)
        self.sinks: SinkSpec = resolve_sinks(
            model, corpus, sink_positions, batch_size=batch_size, prepend_bos=prepend_bos
        )
        self.n_heads = int(model.cfg.n_heads)
        self.min_query, self.drift_k, self.seed = int(min_query), int(drift_k), int(seed)
        self.pos = {layer: i for i, layer in enumerate(self.layers)}
        n, h, device = len(self.layers), self.n_heads, model.cfg.device
        self.sums = StackedSums(SUM_NAMES, (n, h), device=device)
        self.curve = StackedSums(["norm", "count"], (n, h, RATE_BINS), device=device)
        self.s_star = Histogram((n, h), 0.0, 1.0, 50, device=device)
        self.drift_cos = Histogram((n, h), -1.0, 1.0, 100, device=device)
        self.drift_share = Histogram((n, h), **DRIFT_SHARE_BINNING, device=device)
        self.record = (
            StackedSums(RECORD_NAMES, (n, h), n_documents=len(as_corpus(corpus)), device=device)
            if per_document
            else None
        )
        self.samples = (
            None
            if samples_per_head == 0
            else SampleReservoir(n * len(GROUPS) * h, max_samples, SAMPLE_COLUMNS, device=device)
        )
        with torch.inference_mode(False):
            self._record_index = torch.tensor(
                [SUM_NAMES.index(name) for name in RECORD_NAMES], device=device
            )
        self._batch: tuple | None = None

    # ------------------------------------------------------------------- per batch (host)

    def _sink_columns(self, lc: LayerContributionsResult) -> tuple[Tensor, Tensor]:
        """The batch's sink mask `[batch, pos]`, the positions that are a sink in some row
        (ascending, on the device) and how many of them lie in each block: read from the
        token lengths on the host, once per batch (one upload)."""
        batch, device = lc.batch, lc.acts.pattern.device
        if self._batch is None or self._batch[0] is not batch:
            n_pos = batch.tokens.shape[1]
            lengths = batch.lengths.tolist()
            rows = [
                [p for p in self.sinks.positions(doc) if p < n]
                for doc, n in zip(batch.documents, lengths, strict=True)
            ]
            cols = sorted({p for r in rows for p in r})
            mask = [[False] * n_pos for _ in rows]
            for r, ps in zip(mask, rows, strict=True):
                for p in ps:
                    r[p] = True
            with torch.inference_mode(False):
                on_device = (
                    torch.tensor(mask, dtype=torch.bool, device=device),
                    torch.tensor(cols, dtype=torch.long, device=device),
                )
            self._batch = (batch, *on_device, cols)
        _, mask, cols_t, cols = self._batch
        return mask, cols_t[: sum(c < lc.keys.stop for c in cols)]

    # ------------------------------------------------------------------- per block

    def update(self, block: LayerContributionsResult) -> None:
        """Fold one block of query rows into the stacked sums, histograms, record and sample.

        Args:
            block: One layer's `LayerContributionsResult`.

        Examples:
            ```python
            import cw_lens
            from cw_lens.data.streaming import stream_corpus

            model = cw_lens.load_model("testing:tiny-llama")
            texts = ["The cat sat on the mat.", "Heads look at BOS, mostly."]
            accumulator = cw_lens.SinkStatisticsAccumulator(model, texts, min_query=2)
            stats, _ = stream_corpus(model, texts, [accumulator])  # update(block) per block
            accumulator.finish(stats).heads()
            ```
        """
        # Long: one block's statistics in the order of the methods page; each reads the last.
        lc, acts, layer = block, block.acts, block.layer
        li = self.pos[layer]
        sink_full, in_block = self._sink_columns(lc)
        q, n_keys = lc.queries, lc.keys.stop
        qpos = lc.query_positions
        valid_q = queries_after_sink(lc, sink_full)  # [b, q]
        sink_mask = sink_full[:, :n_keys]
        att, gram = lc.attention, acts.weights.gram
        values = acts.values[:, :n_keys]
        s = geo.sink_rate(att, sink_mask)  # [b, h, q]
        st = geo.sink_term(att, values, sink_mask, cols=in_block)  # [b, q, h, d]
        tail = acts.z[:, q] - st
        vq = valid_q[:, None, :].expand_as(s)
        late = vq & (qpos >= self.min_query)

        # semantic drift of the weak tokens
        keys = torch.arange(n_keys, device=att.device)
        causal = keys <= qpos[:, None]  # [q, k]
        tail_keys = acts.mask[:, None, :n_keys] & ~sink_mask[:, None, :] & causal  # [b, q, k]
        tail_entries = tail_keys & valid_q[:, :, None]
        drift, has_weak = geo.weak_tail(
            att, values, tail_entries[:, None].expand_as(att), self.drift_k
        )

        # every inner product the statistics read, from one product with the Gram matrices:
        # the sink term, the tail, the drift, the tail mixture m and m - pv_0 (the sink value)
        s_t = s.transpose(1, 2)[..., None]  # [b, q, h, 1]
        m = tail / (1 - s_t).clamp_min(1e-12)
        p = st / s_t.clamp_min(1e-12)
        g = geo.gram_products(torch.stack([st, tail, drift, m, m - p], -2), gram)
        ns2, nt2, nd2 = g[..., 0, 0], g[..., 1, 1], g[..., 2, 2]  # [b, h, q]
        cross, sd = g[..., 0, 1], g[..., 0, 2]

        # tail mixture and sink direction
        has_sink = vq & (s > 1e-6)
        has_tail = has_sink & (s <= 0.999)
        ok_mix = has_tail & (nt2 > 0) & (ns2 > 0)
        cos_mix = torch.where(ok_mix, cross / (nt2 * ns2).clamp_min(1e-30).sqrt(), 0.0)

        # counterfactual minimiser s* of the convex curve: <m, m - p> / ||m - p||^2
        s_star = geo.curve_minimiser(g[..., 3, 4], g[..., 4, 4]).masked_fill(~has_tail, math.nan)
        counted = ~s_star.isnan()

        ok_drift = has_sink & has_weak & (nd2 > 0) & (ns2 > 0)
        cos_drift = (sd / (nd2 * ns2).clamp_min(1e-30).sqrt()).masked_fill(~ok_drift, math.nan)
        share = (-sd / nd2.clamp_min(1e-30)).masked_fill(~ok_drift, math.nan)
        # the three histograms and the record's share bins, binned in one chain
        binned = torch.stack([s_star, cos_drift, share, share])  # [histogram, b, h, q]
        bins = bin_indices(
            [self.s_star, self.drift_cos, self.drift_share, _SHARE_BINS], binned.nan_to_num(0.0)
        )
        count_bins(  # (grouped by head: [histogram, h, b * q])
            [self.s_star, self.drift_cos, self.drift_share],
            bins[:3].transpose(1, 2),
            ~binned[:3].isnan().transpose(1, 2),
            index=li,
        )

        # per-query statistics, summed over the block's queries in one reduction
        o_norm = lc.head_output_norm
        per_query = torch.stack(
            [
                s * late,
                late,
                cos_mix,
                ok_mix,
                (cos_drift < 0) & ok_drift,
                ok_drift,
                (s_star <= 0) & counted,
                (s_star >= 1) & counted,
                counted,
                s * vq,
                vq,
                o_norm * vq,
            ],
            -1,
        ).sum(2, dtype=torch.float32)  # [b, h, statistic]
        share_bins = bins[3]  # [b, h, q]
        share_counts = torch.zeros((*s.shape[:2], len(SHARE_BIN_SUMS)), device=s.device)
        share_counts.scatter_add_(2, share_bins, ok_drift.float())

        # the empirical curve: mean ||o_i|| per sink-rate bin, queries i >= min_query
        rate_bins = (s * RATE_BINS).floor().clamp(0, RATE_BINS - 1).long()
        curve = torch.zeros((*s.shape[:2], RATE_BINS, 2), dtype=torch.float32, device=s.device)
        curve.scatter_add_(
            2, rate_bins[..., None].expand(-1, -1, -1, 2), torch.stack([o_norm * late, late], -1)
        )

        factors = self._factors(lc, sink_mask, tail_entries, valid_q)
        geometry = (
            self._value_geometry(lc, sink_full, self._batch[2])
            if q.start == 0
            else s.new_zeros((*s.shape[:2], len(GEOMETRY_SUMS)))
        )
        rows = torch.cat([per_query, share_counts, factors, geometry], -1)
        docs = document_rows(lc.batch.documents, rows.device)
        self.sums.add(rows, docs, at=li)
        self.curve.add(curve, docs, at=li)
        if self.record is not None:
            self.record.add(rows.index_select(-1, self._record_index), docs, at=li)

    def _value_geometry(
        self, lc: LayerContributionsResult, sink_full: Tensor, cols: Tensor
    ) -> Tensor:
        """Per (row, head), over pairs (sink s, real non-sink token t) of the row with
        `||pv_s|| > 0`: `sum ||pv_t|| / ||pv_s||`, its log, `sum cos(pv_s, pv_t)`, the count."""
        acts = lc.acts
        norms = lc.layer_projected_value_norm  # [b, h, pos], once per layer
        per_head = geo.values_per_head(acts.values, self.n_heads)  # [b, h, pos, d]
        tail = acts.mask & ~sink_full
        sink_v = per_head[:, :, cols]  # [b, h, s, d]
        dots = torch.einsum("bhsd,hde,bhte->bhst", sink_v, acts.weights.gram, per_head)
        sink_norm = norms[:, :, cols, None]  # [b, h, s, 1]
        use = sink_full[:, cols][:, None, :, None] & tail[:, None, None, :]  # [b, 1, s, t]
        use = (use & (sink_norm > 0)).expand_as(dots)
        ratio = norms[:, :, None, :] / sink_norm.clamp_min(1e-30)
        cos = dots / (sink_norm * norms[:, :, None, :]).clamp_min(1e-30)
        stacked = torch.stack([ratio, ratio.clamp_min(1e-30).log(), cos, use], -1)
        return torch.where(use[..., None], stacked, 0.0).sum((2, 3), dtype=torch.float32)

    def _factors(
        self,
        lc: LayerContributionsResult,
        sink_mask: Tensor,
        tail_entries: Tensor,
        valid_q: Tensor,
    ) -> Tensor:
        """The intra weight's three factors and the weight over the sink entries and the tail
        entries: their sums and counts `[b, h, group * (4 + 1)]` (one batched product), and
        the sample (into the reservoir)."""
        fields = torch.stack(
            [
                lc.attention,
                lc.relative_norm("intra"),
                lc.cosine("intra"),
                lc.weights("intra"),
            ],
            -1,
        ).float()  # [b, h, q, k, 4]; float32 sums whatever the model's dtype
        # every factor is finite where the contribution (their product) is not NaN
        defined = ~fields[..., 3].isnan()
        sink_entries = sink_mask[:, None, :] & valid_q[:, :, None]  # [b, q, k]
        groups = torch.stack(
            [sink_entries[:, None] & defined, tail_entries[:, None] & defined], -1
        )  # [b, h, q, k, group]
        fields = fields.nan_to_num(0.0, posinf=0.0, neginf=0.0)
        b, h, nq, nk, _ = fields.shape
        ones = fields.new_ones(()).expand(b, h, nq, nk, 1)
        with_count = torch.cat([fields, ones], -1).reshape(b * h, nq * nk, 5)
        sums = groups.reshape(b * h, nq * nk, 2).to(fields.dtype).transpose(1, 2).bmm(with_count)
        if self.samples is not None:
            self._sample(lc, fields, groups)
        return sums.reshape(b, h, 2 * 5)

    def _sample(self, lc: LayerContributionsResult, fields: Tensor, groups: Tensor) -> None:
        """Offer the block's valid entries of both groups to the reservoir: their keys
        `entry_keys(seed, layer, document, head, query, key)` (`EMPTY_KEY` where not an entry
        of the group); the reservoir gathers only the rows its `topk` picks."""
        b, h, nq, nk, _ = fields.shape
        device = fields.device
        docs = document_rows(lc.batch.documents, device)
        keys = entry_keys(
            self.seed,
            lc.layer,
            docs[:, None, None, None],
            torch.arange(h, device=device)[:, None, None],
            lc.query_positions[:, None],
            torch.arange(nk, device=device),
        )  # [b, h, q, k]
        keys = torch.where(groups, keys[..., None], EMPTY_KEY)  # [b, h, q, k, group]
        keys = keys.permute(4, 1, 0, 2, 3).reshape(len(GROUPS) * h, b * nq * nk)
        head = torch.arange(len(GROUPS) * h, device=device)[:, None] % h
        start, li = lc.queries.start, self.pos[lc.layer]

        def rows(chosen: Tensor) -> Tensor:
            row, rest = chosen // (nq * nk), chosen % (nq * nk)
            query, key = rest // nk, rest % nk
            picked = fields[row, head, query, key]  # [group * head, k, 4]
            coords = torch.stack(
                [torch.full_like(chosen, lc.layer), head.expand_as(chosen), query + start, key], -1
            )
            return torch.cat([coords.float(), picked.float(), docs[row][..., None].float()], -1)

        width = len(GROUPS) * h
        self.samples.offer(keys, rows, groups=slice(li * width, (li + 1) * width))

    # ------------------------------------------------------------------- result

    def finish(self, stats: Any) -> Any:
        """The `SinkStatisticsResult`: every part moved to the host once, as plain tensors.

        Args:
            stats: The pass's `StreamStats`.

        Returns:
            A `SinkStatisticsResult`.

        Examples:
            ```python
            import cw_lens
            from cw_lens.data.streaming import stream_corpus

            model = cw_lens.load_model("testing:tiny-llama")
            texts = ["The cat sat on the mat.", "Heads look at BOS, mostly."]
            accumulator = cw_lens.SinkStatisticsAccumulator(model, texts)
            stats, _ = stream_corpus(model, texts, [accumulator])  # update(block) per block
            accumulator.finish(stats).heads()
            ```
        """
        for _, part in self.parts():
            part.to_host()
        self._batch = None  # the last batch's sink mask (and the batch) go
        result = SinkStatisticsResult(
            layers=list(self.layers),
            n_heads=self.n_heads,
            sinks=self.sinks.describe(),
            n_documents=stats.n_documents,
            n_tokens=stats.n_tokens,
            min_query=self.min_query,
            sum_names=list(SUM_NAMES),
            sums=self.sums.total,
            curve_sums=self.curve.total,
            s_star=self.s_star,
            drift_cos=self.drift_cos,
            drift_share=self.drift_share,
            samples_table=self._sample_table(),
            record_names=None if self.record is None else list(RECORD_NAMES),
            record=None if self.record is None else self.record.document_table().float(),
        )
        if bool(result.sink_rate.isnan().all()):
            warnings.warn(
                f"No query at position >= min_query={self.min_query} after a sink: the documents "
                "are too short (or no sink position lies inside them), so sink rates are NaN and "
                "no head is a sink head. Use longer texts or a smaller min_query.",
                RuntimeWarning,
                stacklevel=4,
            )
        return result

    def _sample_table(self) -> Tensor:
        """The kept sample rows, `[row, "group" + SAMPLE_COLUMNS]` (group 0: sink, 1: tail)."""
        if self.samples is None:
            return torch.zeros(0, 1 + len(SAMPLE_COLUMNS), device="cpu")
        held = self.samples.held()
        group = torch.arange(held.shape[0], device="cpu") // self.n_heads % len(GROUPS)
        group = group[:, None].expand_as(held)[held].float()
        return torch.cat([group[:, None], self.samples.rows[held]], 1)
