r"""Attention sinks (P1): geometry, convex sink-rate curves, semantic drift, sink-norm ablation.

P1 (Cunningham & Muca Cirone, ICML 2026) argues that the first token — the attention sink — is
not a passive store of spare attention but an active part of the head's computation. With the
sink position(s) ``S`` (position 0, the BOS token, by default), per head ``h`` and query ``i``
(SPEC §3)::

    sink rate        s_i = sum_{j in S} alpha[i,j]          sink head: mean_{i >= 16} s_i > 0.3
    decomposition    o_i = s_i p_i + (1 - s_i) m_i          p_i: the sink's projected value
                     m_i = sum_{j not in S} alpha[i,j] pv_j / (1 - s_i)   (the tail mixture)
    convex curve     ||o(s)|| = ||s p + (1 - s) m||  is convex in s; its minimiser
                     s* = clamp(<m, m - p> / ||m - p||^2, 0, 1)   (P1: interior, s* < 1)
    semantic drift   d_i = sum_{weak j} alpha[i,j] pv_j   (tail minus its k = 4 top tokens)
                     cos(alpha_i0 pv_0, d_i) < 0 and the cancelled share
                     -<alpha_i0 pv_0, d_i> / ||d_i||^2   (P1: the sink opposes the drift)
    value geometry   ||pv_j|| / ||pv_0||  (P1/P2: 3-10x),  cos(pv_0, pv_j), cos(pv_0, m_i) < 0

All of it is computed in head space with the Gram matrices (``pv_j = v_j W_O`` is never built)
and streamed one layer at a time over a corpus, into mergeable accumulators.

Sink-norm ablation (the intervention, :func:`cw_lens.patch_sink`): ``pv_0 -> lambda pv_0`` for
queries after the sink, attention untouched; :func:`sink_ablation` measures the change in
perplexity, each head's output norm, and its alignment with the head's semantic cone (axis
``u^h`` = normalised mean of the head's non-sink projected values): ``cos(o_i^h, u^h)``.

Example::

    import cw_lens
    model = cw_lens.load_model()
    corpus = cw_lens.load_corpus(n_docs=8, max_tokens=128, tokenizer=model)
    stats = cw_lens.sink_statistics(model, corpus)
    stats.heads().query("sink_head")            # per-head sink geometry
    stats.claims()                              # P1's sink claims, measured
    with cw_lens.patch_sink(model, layers=[10]):
        patched_logits = model("The first token is a sink.")
    ablation = cw_lens.sink_ablation(model, corpus, layers=[10])
"""

from __future__ import annotations

import hashlib
import math
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
import pandas as pd
import torch
from jaxtyping import Bool, Float
from torch import Tensor

from cw_lens.core import geometry as geo
from cw_lens.core.accumulate import ExactSums, Histogram, PerDocument, SampleReservoir
from cw_lens.core.bootstrap import Bootstrap, require_record
from cw_lens.core.claims import Check, Claim, claims_dict, with_intervals
from cw_lens.core.errors import InputError
from cw_lens.core.resampled import (
    ablation_numbers,
    driver_numbers,
    per_layer_rows,
    sink_head_fields,
    sink_numbers,
    sink_numbers_per_layer,
)
from cw_lens.data.documents import as_corpus
from cw_lens.data.inputs import TokenBatch
from cw_lens.data.scoring import corpus_nll
from cw_lens.data.streaming import stream_contributions, stream_corpus
from cw_lens.models.capture import LayerActivations, resolve_layers
from cw_lens.models.interventions import patch_sink, per_layer_heads, sink_scale
from cw_lens.models.layer_contributions import LayerContributions

SINK_RATE_THRESHOLD = 0.3
MIN_QUERY = 16
RATE_BINS = 20
# convex_sink_curve judges only sink heads with at least this many counted queries (SPEC §6)
MIN_S_STAR_QUERIES = 16
# the cancelled share is a ratio without a natural range: asinh bins, ~0.2% wide near 0 and
# 1.9% relative beyond, over +-1e9 (SPEC §6 reads per-head medians from unclipped values)
DRIFT_SHARE_BINNING = dict(lo=-1e9, hi=1e9, n_bins=3000, scale="asinh", unit=1e-3)
DRIVER_FACTORS = ("attention", "relative_norm", "cosine")
# the per-document record a bootstrap over documents reads (``per_document=True``): these sums
# per (layer, head), and the s* edge counts (s* <= 0, s* >= 1, counted)
RECORDED_SUMS = (
    "rate_sum",
    "rate_count",
    "sink_attention_sum",
    "sink_contribution_sum",
    "sink_count",
    "ratio_sum",
    "geometry_count",
    "cos_mixture_sum",
    "cos_mixture_count",
    "drift_neg",
    "drift_count",
    "s_star_lo",
    "s_star_hi",
    "s_star_n",
)
# and a coarse histogram of the cancelled share per (layer, head): 24 bins equal in
# asinh(v / 1e-3) on [-10, 10] (an edge at 0; ~1e-3 wide near 0, 2.5x relative beyond) plus the
# two edge bins
SHARE_BINNING = dict(lo=-10.0, hi=10.0, n_bins=24, scale="asinh", unit=1e-3)
# the ablation's per-document record (per patched layer and head)
ABLATION_SUMS = ("cone_before", "count_before", "cone_after", "count_after", "rel_norm")
# the claims about layers and the number each reads per layer
LAYER_NUMBERS = {
    "sink_attention_vs_contribution": "contribution_over_attention",
    "sink_value_norm_ratio": "median_ratio_sink_heads",
    "sink_anti_alignment": "median_cos_sink_tail_mixture",
}
# factor samples kept per (layer, head) and group (sink / tail entries) for the per-head rank
# correlations: a seeded bottom-k reservoir each (8 documents of the default run keep every draw)
MAX_SAMPLES_PER_HEAD = 1024
FACTOR_COLUMNS = (
    "layer",
    "head",
    "query",
    "key",
    "attention",
    "relative_norm",
    "cosine",
    "contribution",
)

SinkPositions = Sequence[int] | Literal["detect"]


# --------------------------------------------------------------------------- sink positions


class SinkSpec:
    """Sink positions per document: the same tuple for all, or one tuple per document."""

    def __init__(self, positions: Sequence[int] | dict[int, Sequence[int]]) -> None:
        if isinstance(positions, str):
            raise InputError(
                f"sink_positions must be positions such as (0,) or 'detect', got {positions!r}."
            )
        if isinstance(positions, dict):
            self.per_doc = {
                int(d): tuple(sorted(int(p) for p in ps)) for d, ps in positions.items()
            }
            self.default: tuple[int, ...] | None = None
        else:
            ps = tuple(sorted({int(p) for p in positions}))
            if not ps or min(ps) < 0:
                raise InputError(f"sink_positions must be non-negative positions, got {positions}.")
            self.per_doc, self.default = {}, ps

    def positions(self, doc: int) -> tuple[int, ...]:
        return self.per_doc.get(doc, self.default or ())

    def mask(self, batch: TokenBatch, device: torch.device) -> Bool[Tensor, "batch pos"]:
        n_pos = batch.tokens.shape[1]
        mask = torch.zeros(len(batch.documents), n_pos, dtype=torch.bool)
        for row, doc in enumerate(batch.documents):
            ps = [p for p in self.positions(doc) if p < int(batch.lengths[row])]
            mask[row, ps] = True
        return mask.to(device)

    def describe(self) -> str:
        if self.default is not None:
            return ",".join(map(str, self.default))
        return "detected per document"


def _resolve_sinks(model: Any, corpus: Any, sink_positions: Any, **kw: Any) -> SinkSpec:
    if isinstance(sink_positions, SinkSpec):
        return sink_positions
    if isinstance(sink_positions, str):
        if sink_positions != "detect":
            raise InputError(
                f"sink_positions must be positions or 'detect', got {sink_positions!r}"
            )
        return SinkSpec(dict(enumerate(detect_sinks(model, corpus, **kw))))
    return SinkSpec(sink_positions)


def queries_after_sink(lc: LayerContributions, sink_full: Bool[Tensor, "batch pos"]) -> Tensor:
    """Queries of this block that count: real, not a sink, after the row's first sink."""
    qpos = lc.query_positions
    none = lc.keys.stop + 10**6
    first_sink = torch.where(sink_full.any(1), sink_full.float().argmax(1), none)
    return lc.query_mask & ~sink_full[:, lc.queries] & (qpos[None, :] > first_sink[:, None])


class _MaxAttention:
    """Per document: the keys whose max over (layer, head) of the mean attention from later
    queries exceeds ``threshold``.

    Only keys read by at least ``min_later`` later (real) queries are candidates: near the end
    of a document a previous-token head alone would put a key over any threshold. The running
    max lives for one batch (its layers stream in order); after ``last_layer`` the batch's
    documents keep only their sink positions.
    """

    def __init__(self, min_later: int, threshold: float, last_layer: int) -> None:
        self.min_later, self.threshold, self.last_layer = min_later, threshold, last_layer
        self.positions: dict[int, tuple[int, ...]] = {}
        self._best: Tensor | None = None  # [batch, key] of the batch in flight

    def update(self, lc: LayerContributions) -> None:
        if lc.queries.start != 0:
            return
        acts = lc.acts
        n_pos = acts.pattern.shape[-1]
        later = torch.ones(n_pos, n_pos, dtype=torch.bool, device=acts.mask.device).tril(-1)
        real = acts.mask[:, :, None] & acts.mask[:, None, :]
        weight = (later[None] & real).to(acts.pattern.dtype)  # [batch, query, key]
        n_later = weight.sum(1)  # [batch, key]
        mean = (acts.pattern * weight[:, None]).sum(2) / n_later[:, None].clamp_min(1)
        best = mean.amax(1).masked_fill(n_later < self.min_later, 0.0)  # [batch, key]
        self._best = best if self._best is None else torch.maximum(self._best, best)
        if lc.layer == self.last_layer:
            above = (self._best > self.threshold).cpu()
            for row, doc in enumerate(lc.batch.documents):
                n = int(lc.batch.lengths[row])
                self.positions[doc] = tuple(int(p) for p in above[row, :n].nonzero().flatten())
            self._best = None

    def merge(self, other: _MaxAttention) -> None:
        self.positions.update(other.positions)


def detect_sinks(
    model: Any,
    corpus: Any,
    *,
    threshold: float = SINK_RATE_THRESHOLD,
    min_later: int = MIN_QUERY,
    layers: Any = None,
    batch_size: int | None = 8,
    prepend_bos: bool = True,
) -> list[tuple[int, ...]]:
    """Sink positions per document: keys whose mean attention from later queries exceeds
    ``threshold`` (0.3) in at least one head (of the given layers). Only keys that at least
    ``min_later`` (16) later queries read are candidates, so the last positions of a document
    are never sinks."""
    if min_later < 1:
        raise InputError(f"min_later must be at least 1, got {min_later}.")
    layer_list = resolve_layers(model, layers)
    acc, _ = stream_corpus(
        model,
        corpus,
        _MaxAttention(min_later, threshold, max(layer_list)),
        layers=layer_list,
        batch_size=batch_size,
        prepend_bos=prepend_bos,
    )
    return [acc.positions[doc] for doc in range(len(as_corpus(corpus)))]


# --------------------------------------------------------------------------- accumulation


class _SinkAccumulator:
    """Folds streamed layers into exact sums, histograms and a factor-sample reservoir."""

    def __init__(
        self,
        layers: list[int],
        n_heads: int,
        sinks: SinkSpec,
        *,
        min_query: int,
        drift_k: int,
        samples_per_head: int,
        max_samples: int,
        seed: int,
        n_documents: int | None = None,
    ) -> None:
        self.layers, self.n_heads, self.sinks = layers, n_heads, sinks
        self.pos = {layer: i for i, layer in enumerate(layers)}
        self.min_query, self.drift_k = min_query, drift_k
        self.samples_per_head, self.seed = samples_per_head, seed
        n = len(layers)
        self.sums = ExactSums()
        self.samples = SampleReservoir(FACTOR_COLUMNS, capacity=max_samples, seed=seed)
        self.s_star = Histogram((n, n_heads), 0.0, 1.0, 50)
        self.drift_cos = Histogram((n, n_heads), -1.0, 1.0, 100)
        self.drift_share = Histogram((n, n_heads), **DRIFT_SHARE_BINNING)
        self.per_doc: PerDocument | None = None  # opt-in: the bootstrap's per-document record
        self.share_hist: PerDocument | None = None
        if n_documents is not None:
            self.per_doc = PerDocument(RECORDED_SUMS, n_documents, (n, n_heads))
            bins = SHARE_BINNING["n_bins"] + 2
            self.share_hist = PerDocument(["drift_share"], n_documents, (n, n_heads, bins))
            self._share_bins = Histogram((), **SHARE_BINNING)

    def merge(self, other: _SinkAccumulator) -> None:
        self.sums.merge(other.sums)
        self.samples.merge(other.samples)
        for name in ("s_star", "drift_cos", "drift_share"):
            getattr(self, name).merge(getattr(other, name))
        if self.per_doc is not None:
            self.per_doc.merge(other.per_doc)
            self.share_hist.merge(other.share_hist)

    def _add(self, docs: list[int], name: str, layer: int, per_row: Tensor) -> None:
        self.sums.add_rows(docs, f"{name}@{layer}", per_row)
        self._record(docs, name, layer, per_row)

    def _record(self, docs: list[int], name: str, layer: int, per_row: Tensor) -> None:
        if self.per_doc is not None and name in RECORDED_SUMS:
            self.per_doc.add_rows(docs, name, per_row, at=self.pos[layer])

    def _record_edges(self, docs: list[int], layer: int, s_star: Tensor, share: Tensor) -> None:
        """Per document and head: s* edge counts, and the coarse cancelled-share histogram."""
        if self.per_doc is None:
            return
        counted = ~s_star.isnan()  # [b, h, q]
        self._record(docs, "s_star_lo", layer, ((s_star <= 0) & counted).sum(-1))
        self._record(docs, "s_star_hi", layer, ((s_star >= 1) & counted).sum(-1))
        self._record(docs, "s_star_n", layer, counted.sum(-1))
        ok = ~share.isnan()  # [b, h, q]
        bins = self._share_bins.bin_index(share.nan_to_num(0.0))
        onehot = torch.nn.functional.one_hot(bins, SHARE_BINNING["n_bins"] + 2) * ok[..., None]
        self.share_hist.add_rows(docs, "drift_share", onehot.sum(2), at=self.pos[layer])

    def update(self, lc: LayerContributions) -> None:
        acts, docs, layer = lc.acts, lc.batch.documents, lc.layer
        device = acts.pattern.device
        sink_full = self.sinks.mask(lc.batch, device)  # [batch, pos]
        q, n_keys = lc.queries, lc.keys.stop
        qpos = lc.query_positions
        valid_q = queries_after_sink(lc, sink_full)
        sink_mask = sink_full[:, :n_keys]
        att = lc.attention
        gram = acts.weights.gram
        values = acts.values[:, :n_keys]
        s = geo.sink_rate(att, sink_mask)  # [b, h, q]
        st = geo.sink_term(att, values, sink_mask)  # [b, q, h, d]
        z = acts.z[:, q]
        tail = z - st
        o_norm = lc.head_output_norm
        vq = valid_q[:, None, :].expand_as(s)

        if q.start == 0:
            self._value_geometry(lc, sink_full, docs, layer)

        # sink rate (sink-head criterion) and the empirical curve, queries i >= min_query
        late = vq & (qpos[None, None, :] >= self.min_query)
        self._add(docs, "rate_sum", layer, (s * late).sum(-1))
        self._add(docs, "rate_count", layer, late.sum(-1))
        self._add(docs, "rate_all_sum", layer, (s * vq).sum(-1))
        self._add(docs, "rate_all_count", layer, vq.sum(-1))
        self._add(docs, "norm_sum", layer, (o_norm * vq).sum(-1))
        bins = (s * RATE_BINS).floor().clamp(0, RATE_BINS - 1).long()
        onehot = torch.nn.functional.one_hot(bins, RATE_BINS).to(s.dtype) * late[..., None]
        self._add(docs, "curve_norm", layer, (onehot * o_norm[..., None]).sum(2))
        self._add(docs, "curve_count", layer, onehot.sum(2))

        # tail mixture and sink direction
        has_sink = vq & (s > 1e-6)
        has_tail = has_sink & (s <= 0.999)
        nt2 = geo.gram_inner(tail, tail, gram)
        ns2 = geo.gram_inner(st, st, gram)
        cross = geo.gram_inner(st, tail, gram)
        ok_mix = has_tail & (nt2 > 0) & (ns2 > 0)
        cos_mix = cross / (nt2 * ns2).clamp_min(1e-30).sqrt()
        self._add(docs, "cos_mixture_sum", layer, torch.where(ok_mix, cos_mix, 0.0).sum(-1))
        self._add(docs, "cos_mixture_count", layer, ok_mix.sum(-1))

        # counterfactual minimiser s* of the convex curve
        s_t = s.transpose(1, 2)[..., None]  # [b, q, h, 1]
        m = tail / (1 - s_t).clamp_min(1e-12)
        p = st / s_t.clamp_min(1e-12)
        s_star = geo.counterfactual_sink_rate(m, p, gram).masked_fill(~has_tail, math.nan)
        self.s_star.add(s_star.permute(1, 0, 2).reshape(self.n_heads, -1), index=self.pos[layer])

        # semantic drift of the weak tokens
        keys = torch.arange(n_keys, device=device)
        causal = keys[None, :] <= qpos[:, None]
        tail_keys = acts.mask[:, None, :n_keys] & ~sink_mask[:, None, :] & causal[None]
        tail_mask = (tail_keys & valid_q[:, :, None])[:, None].expand_as(att)
        drift, has_weak = geo.weak_tail(att, values, tail_mask, self.drift_k)
        nd2 = geo.gram_inner(drift, drift, gram)
        sd = geo.gram_inner(st, drift, gram)
        ok_drift = has_sink & has_weak & (nd2 > 0) & (ns2 > 0)
        cos_drift = (sd / (nd2 * ns2).clamp_min(1e-30).sqrt()).masked_fill(~ok_drift, math.nan)
        share = (-sd / nd2.clamp_min(1e-30)).masked_fill(~ok_drift, math.nan)
        li = self.pos[layer]
        self.drift_cos.add(cos_drift.permute(1, 0, 2).reshape(self.n_heads, -1), index=li)
        self.drift_share.add(share.permute(1, 0, 2).reshape(self.n_heads, -1), index=li)
        self._record_edges(docs, layer, s_star, share)
        self._add(docs, "drift_neg", layer, ((cos_drift < 0) & ok_drift).sum(-1))
        self._add(docs, "drift_count", layer, ok_drift.sum(-1))

        self._factors(lc, sink_mask, tail_keys, valid_q, docs, layer)

    def _value_geometry(
        self, lc: LayerContributions, sink_full: Tensor, docs: list[int], layer: int
    ) -> None:
        acts = lc.acts
        gram = acts.weights.gram
        norms = geo.projected_value_norms(acts.values, gram)  # [b, h, pos]
        per_head = geo.values_per_head(acts.values, self.n_heads)  # [b, h, pos, d]
        tail = acts.mask & ~sink_full
        cols = sink_full.any(0).nonzero().flatten()
        sink_v = per_head[:, :, cols]  # [b, h, s, d]
        dots = torch.einsum("bhsd,hde,bhte->bhst", sink_v, gram, per_head)
        sink_norm = norms[:, :, cols]  # [b, h, s]
        use = sink_full[:, cols][:, None, :, None] & tail[:, None, None, :]  # [b, 1, s, t]
        use = use & (sink_norm[..., None] > 0)
        ratio = norms[:, :, None, :] / sink_norm[..., None].clamp_min(1e-30)
        cos = dots / (sink_norm[..., None] * norms[:, :, None, :]).clamp_min(1e-30)
        use = use.expand_as(ratio)
        self._add(docs, "ratio_sum", layer, torch.where(use, ratio, 0.0).sum((2, 3)))
        self._add(
            docs,
            "log_ratio_sum",
            layer,
            torch.where(use, ratio.clamp_min(1e-30).log(), 0.0).sum((2, 3)),
        )
        self._add(docs, "cos_token_sum", layer, torch.where(use, cos, 0.0).sum((2, 3)))
        self._add(docs, "geometry_count", layer, use.sum((2, 3)))

    def _factors(
        self,
        lc: LayerContributions,
        sink_mask: Tensor,
        tail_keys: Tensor,
        valid_q: Tensor,
        docs: list[int],
        layer: int,
    ) -> None:
        """The three factors of the intra weight, for sink entries and tail entries."""
        fields = {
            "attention": lc.attention,
            "relative_norm": lc.relative_norm("intra"),
            "cosine": lc.cosine("intra"),
            "contribution": lc.weights("intra"),
        }
        sink_entries = (sink_mask[:, None, :] & valid_q[:, :, None])[:, None].expand_as(
            lc.attention
        )
        tail_entries = (tail_keys & valid_q[:, :, None])[:, None].expand_as(lc.attention)
        for group, entries in (("sink", sink_entries), ("tail", tail_entries)):
            # every field is finite where the contribution (their product) is not NaN
            entries = entries & ~fields["contribution"].isnan()
            for name, t in fields.items():
                self._add(
                    docs, f"{group}_{name}_sum", layer, torch.where(entries, t, 0.0).sum((2, 3))
                )
            self._add(docs, f"{group}_count", layer, entries.sum((2, 3)))
            self._sample(lc, entries, fields, docs, layer, group)

    def _sample(
        self,
        lc: LayerContributions,
        entries: Tensor,
        fields: dict[str, Tensor],
        docs: list[int],
        layer: int,
        group: str,
    ) -> None:
        """Keep up to ``samples_per_head`` seeded random valid entries per head of each row
        (seeded per document, layer and query block, so any sharding samples the same)."""
        if self.samples_per_head <= 0:
            return
        keys = []
        for doc in docs:
            key = f"{self.seed}/{doc}/{layer}/{lc.queries.start}/{group}".encode()
            gen = torch.Generator().manual_seed(int(hashlib.sha1(key).hexdigest()[:12], 16))
            keys.append(torch.rand(entries.shape[1:], generator=gen))
        idx = _draw_per_head(entries, torch.stack(keys).to(entries.device), self.samples_per_head)
        row, h, qi, k = idx.unbind(1)
        cols = [torch.full_like(h, layer), h, qi + lc.queries.start, k]
        cols += [fields[n][row, h, qi, k] for n in FACTOR_COLUMNS[4:]]
        table = torch.stack([c.float() for c in cols], 1)
        heads = [f"{group}/{layer}/{head}" for head in range(entries.shape[1])]
        self.samples.add_many(docs, heads, table, row_doc=row, row_group=h)


def _draw_per_head(
    valid: Bool[Tensor, "batch head query key"], keys: Float[Tensor, "batch head query key"], n: int
) -> Tensor:
    """Up to ``n`` distinct True entries of ``valid`` per (row, head): those with the ``n``
    smallest ``keys`` (uniform random: a uniform sample without replacement). Returns indices
    ``[m, 4]`` (row, head, query, key), grouped by row."""
    b, h, q, k = valid.shape
    flat = torch.where(valid, keys, 2.0).reshape(b * h, q * k)
    drawn, picks = flat.topk(min(n, q * k), dim=1, largest=False)
    keep = drawn < 2.0
    rows = torch.arange(b * h, device=valid.device)[:, None].expand_as(picks)[keep]
    flat_index = picks[keep]  # (torch.unravel_index is ~100x slower here)
    return torch.stack([rows // h, rows % h, flat_index // k, flat_index % k], 1)


def head_spearman(samples: pd.DataFrame, factors: Sequence[str] = DRIVER_FACTORS) -> pd.DataFrame:
    """Per (layer, head): Spearman's rank correlation ``rho_<factor>`` of each factor with the
    ``contribution`` over the head's sampled entries (average ranks for ties; NaN with fewer
    than 3 samples or a constant column), and ``n_samples``."""
    columns = ["layer", "head", "n_samples", *(f"rho_{f}" for f in factors)]
    rows = []
    for (layer, head), g in samples.groupby(["layer", "head"], sort=True):
        corr = g[[*factors, "contribution"]].corr(method="spearman", min_periods=3)
        rho = corr["contribution"]
        rows.append([int(layer), int(head), len(g), *(float(rho[f]) for f in factors)])
    return pd.DataFrame(rows, columns=columns)


def sink_claims(
    heads: pd.DataFrame,
    drivers: pd.DataFrame,
    *,
    min_s_star_queries: int = MIN_S_STAR_QUERIES,
) -> list[Claim]:
    """The six sink claims of SPEC §6, exactly as its criterion column reads them.

    Args:
        heads: Per-head table (:meth:`SinkStatistics.heads`): ``sink_head``, ``sink_attention``,
            ``sink_contribution``, ``norm_ratio``, ``cos_sink_mixture``, ``s_star_interior``,
            ``s_star_count``, ``drift_cos_median``, ``drift_cancelled_median``, ...
        drivers: Per-head Spearman table (:meth:`SinkStatistics.drivers`): ``layer``, ``head``,
            ``group``, ``rho_attention``, ``rho_relative_norm``, ``rho_cosine``.
        min_s_star_queries: ``convex_sink_curve`` judges sink heads with at least this many
            counted queries (SPEC: 16).

    With no sink head every number is NaN and no claim holds.
    """
    sink = heads[heads["sink_head"].astype(bool)]
    n_sink = len(sink)

    def median(frame: pd.DataFrame, col: str) -> float:
        return float(frame[col].median()) if len(frame) else math.nan

    def mean(values: Any) -> float:
        return float(np.mean(values)) if len(values) else math.nan

    att, contrib = mean(sink["sink_attention"]), mean(sink["sink_contribution"])
    keys = set(zip(sink["layer"], sink["head"], strict=True))
    is_sink = [k in keys for k in zip(drivers["layer"], drivers["head"], strict=True)]
    rho = drivers[np.asarray(is_sink, dtype=bool)]
    abs_rho = {
        group: {
            f: float(rho.loc[rho["group"] == group, f"rho_{f}"].abs().median())
            for f in DRIVER_FACTORS
        }
        for group in ("sink", "tail")
    }
    judged = sink[sink["s_star_count"] >= min_s_star_queries]
    counted = judged["s_star_count"].sum()
    cancelled = sink["drift_cancelled_median"]
    return [
        Claim(
            "sink_attention_vs_contribution",
            paper="the first token takes much attention but little contribution (P1 Fig. 1)",
            criterion="over sink heads, mean intra contribution of the sink < ½ × its mean "
            "attention (the ratio is the number)",
            checks=[
                Check("contribution_over_attention", contrib / att if att else math.nan, "<", 0.5)
            ],
            measured={
                "n_sink_heads": n_sink,
                "mean_sink_attention": att,
                "mean_sink_contribution_intra": contrib,
            },
        ),
        Claim(
            "sink_value_norm_ratio",
            paper="sink value norm 3-10x smaller than non-sink (P2)",
            criterion="median over sink heads of mean ‖pv_j‖/‖pv_0‖ lies in [3, 10]",
            checks=[
                Check("median_ratio_sink_heads", median(sink, "norm_ratio"), "in", (3.0, 10.0))
            ],
            measured={
                "median_ratio_all_heads": median(heads, "norm_ratio"),
                "median_geomean_ratio_sink_heads": median(sink, "norm_ratio_geomean"),
                "n_sink_heads": n_sink,
            },
        ),
        Claim(
            "sink_anti_alignment",
            paper="sink projected value anti-aligned with the rest (P1, P2)",
            criterion="median over sink heads of cos(pv_0, m_i) < 0",
            checks=[
                Check("median_cos_sink_tail_mixture", median(sink, "cos_sink_mixture"), "<", 0.0)
            ],
            measured={
                "median_cos_sink_token": median(sink, "cos_sink_token"),
                "share_sink_heads_negative_mixture": mean(sink["cos_sink_mixture"] < 0),
                "n_sink_heads": n_sink,
            },
        ),
        Claim(
            "sink_contribution_drivers",
            paper="sink contribution driven by norm and cosine, not attention (P1)",
            criterion="per sink head, Spearman ρ of each factor with the sink's contribution; "
            "the median over heads of |ρ(attention)| is the smallest of the three",
            checks=[
                Check(
                    f"median_abs_rho_{f}_minus_attention",
                    abs_rho["sink"][f] - abs_rho["sink"]["attention"],
                    ">",
                    0.0,
                )
                for f in ("relative_norm", "cosine")
            ],
            measured={
                "median_abs_rho_sink": abs_rho["sink"],
                "median_abs_rho_tail": abs_rho["tail"],
                "n_sink_heads_with_rho": int(
                    rho[rho["group"] == "sink"]["rho_attention"].notna().sum()
                ),
                "mean_sink_factors": {f: mean(sink[f"sink_{f}"]) for f in DRIVER_FACTORS},
                "mean_tail_factors": {f: mean(sink[f"tail_{f}"]) for f in DRIVER_FACTORS},
            },
        ),
        Claim(
            "convex_sink_curve",
            paper="output norm convex in sink rate, minimum at s* < 1 (P1)",
            criterion=f"more than half of the sink heads with at least {min_s_star_queries} "
            "counted queries have a median s* in (0, 1)",
            checks=[
                Check(
                    "share_judged_sink_heads_interior_median_s_star",
                    mean(judged["s_star_interior"]),
                    ">",
                    0.5,
                )
            ],
            measured={
                "n_sink_heads_judged": len(judged),
                "n_sink_heads": n_sink,
                "median_of_median_s_star": median(judged, "s_star_median"),
                "pooled_share_s_star_at_1": float(
                    (judged["s_star_at_1"] * judged["s_star_count"]).sum() / counted
                )
                if counted
                else math.nan,
            },
        ),
        Claim(
            "sink_cancels_drift",
            paper="the sink opposes the drift of weakly attended tokens (P1)",
            criterion="median cos(α₀pv₀, d_i) < 0 in more than half of the sink heads, "
            "and the median cancelled share > 0 (per-head medians from unclipped values)",
            checks=[
                Check(
                    "share_sink_heads_negative_cosine",
                    mean(sink["drift_cos_median"] < 0),
                    ">",
                    0.5,
                ),
                Check("median_cancelled_share", median(sink, "drift_cancelled_median"), ">", 0.0),
            ],
            measured={
                "n_sink_heads": n_sink,
                "n_sink_heads_median_share_beyond_2": int((cancelled.abs() > 2).sum()),
                "share_sink_heads_positive_cancelled_share": mean(cancelled > 0),
            },
        ),
    ]


@dataclass
class SinkStatistics:
    """Sink geometry of a corpus, per (layer, head); see the module docstring for formulas.

    Use :meth:`heads` for the per-head table, :meth:`curve` for the empirical sink-rate curves,
    :meth:`decomposition` for the factor analysis, :meth:`claims` for P1's claims as measured,
    and the ``plot_*`` methods for figures.
    """

    layers: list[int]
    n_heads: int
    sinks: str
    n_documents: int
    n_tokens: int
    acc: Any = field(repr=False)
    min_query: int = MIN_QUERY
    threshold: float = SINK_RATE_THRESHOLD

    def _total(self, name: str) -> Tensor:
        rows = []
        for layer in self.layers:
            key = f"{name}@{layer}"
            rows.append(
                self.acc.sums.total(key)
                if key in self.acc.sums
                else torch.zeros(self.n_heads, dtype=torch.float64)
            )
        return torch.stack(rows)  # [layer, head, ...]

    def _mean(self, name: str, count: str) -> Tensor:
        """Sum / count; NaN where nothing was counted (e.g. no query reached min_query)."""
        total, n = self._total(name), self._total(count)
        return torch.where(n > 0, total / n.clamp_min(1), torch.full_like(total, math.nan))

    @property
    def sink_rate(self) -> Float[Tensor, "layer head"]:
        """Mean sink rate over queries ``i >= min_query``."""
        return self._mean("rate_sum", "rate_count")

    @property
    def sink_heads(self) -> Bool[Tensor, "layer head"]:
        return self.sink_rate > self.threshold  # NaN (no query counted) is not a sink head

    def heads(self) -> pd.DataFrame:
        """One row per (layer, head): rates, value geometry, factors, s*, drift."""
        rate = self.sink_rate
        data = {
            "layer": np.repeat(self.layers, self.n_heads),
            "head": np.tile(np.arange(self.n_heads), len(self.layers)),
            "sink_rate": rate.flatten(),
            "sink_head": self.sink_heads.flatten(),
            "sink_rate_all_queries": self._mean("rate_all_sum", "rate_all_count").flatten(),
            "output_norm": self._mean("norm_sum", "rate_all_count").flatten(),
            "norm_ratio": self._mean("ratio_sum", "geometry_count").flatten(),
            "norm_ratio_geomean": self._mean("log_ratio_sum", "geometry_count").exp().flatten(),
            "cos_sink_token": self._mean("cos_token_sum", "geometry_count").flatten(),
            "cos_sink_mixture": self._mean("cos_mixture_sum", "cos_mixture_count").flatten(),
        }
        for group in ("sink", "tail"):
            for name in FACTOR_COLUMNS[4:]:
                data[f"{group}_{name}"] = self._mean(
                    f"{group}_{name}_sum", f"{group}_count"
                ).flatten()
        data["s_star_median"] = self.acc.s_star.quantile(0.5).flatten()
        data["s_star_at_0"] = self.acc.s_star.share_at_or_below_lo().flatten()
        data["s_star_at_1"] = self.acc.s_star.share_at_or_above_hi().flatten()
        data["s_star_count"] = self.acc.s_star.total.flatten()
        data["drift_cos_median"] = self.acc.drift_cos.quantile(0.5).flatten()
        data["drift_negative_share"] = self._mean("drift_neg", "drift_count").flatten()
        data["drift_cancelled_median"] = self.acc.drift_share.quantile(0.5).flatten()
        data["drift_count"] = self._total("drift_count").flatten()
        df = pd.DataFrame({k: np.asarray(v) for k, v in data.items()})
        df["s_star_interior"] = (
            (df["s_star_count"] > 0) & (df["s_star_at_0"] < 0.5) & (df["s_star_at_1"] < 0.5)
        )
        return df

    def to_dataframe(self) -> pd.DataFrame:
        return self.heads()

    def top(self, k: int = 10, by: str = "sink_rate") -> pd.DataFrame:
        """The ``k`` heads with the largest ``by``."""
        return self.heads().nlargest(k, by).reset_index(drop=True)

    def curve(self, *, sink_heads_only: bool = True) -> pd.DataFrame:
        """Empirical curve: mean ``||o_i^h||`` per sink-rate bin (queries ``i >= min_query``)."""
        norm, count = self._total("curve_norm"), self._total("curve_count")
        rows = []
        heads = self.sink_heads
        for li, layer in enumerate(self.layers):
            for h in range(self.n_heads):
                if sink_heads_only and not heads[li, h]:
                    continue
                for b in range(RATE_BINS):
                    n = int(count[li, h, b])
                    if n:
                        rows.append((layer, h, (b + 0.5) / RATE_BINS, float(norm[li, h, b]) / n, n))
        return pd.DataFrame(rows, columns=["layer", "head", "sink_rate", "output_norm", "count"])

    def s_star_distribution(self, *, sink_heads_only: bool = True) -> pd.DataFrame:
        """Histogram of the counterfactual minimiser ``s*`` pooled over (sink) heads."""
        hist = self.acc.s_star
        sel = self.sink_heads if sink_heads_only else torch.ones_like(self.sink_heads)
        counts = hist.counts[sel].sum(0).double()
        edges = hist.edges.numpy()
        centres = np.concatenate([[0.0], (edges[:-1] + edges[1:]) / 2, [1.0]])
        return pd.DataFrame(
            {
                "s_star": centres,
                "count": counts.numpy(),
                "edge": ["=0"] + ["interior"] * hist.n_bins + ["=1"],
            }
        )

    def samples(self, group: str = "sink") -> pd.DataFrame:
        """The sampled factor entries of one group (``"sink"``: the sink column; ``"tail"``:
        non-sink keys), one row per entry: ``FACTOR_COLUMNS`` and ``document`` (its index in
        the corpus)."""
        if group not in ("sink", "tail"):
            raise InputError(f"group must be 'sink' or 'tail', got {group!r}.")
        reservoir = self.acc.samples
        groups = [g for g in reservoir.groups() if g.split("/")[0] == group]
        rows = torch.cat(
            [reservoir.table(g) for g in groups] or [torch.zeros(0, len(FACTOR_COLUMNS))]
        )
        docs = torch.cat([reservoir.documents(g) for g in groups] or [torch.zeros(0)])
        df = pd.DataFrame(rows.numpy(), columns=list(FACTOR_COLUMNS))
        df["document"] = docs.numpy().astype("int64")
        df = df.sort_values(["layer", "head", "query", "key"], kind="stable", ignore_index=True)
        return df.astype({c: "int64" for c in ("layer", "head", "query", "key")})

    def drivers(self) -> pd.DataFrame:
        """Per (layer, head) and group (sink / tail entries): each factor's Spearman rank
        correlation with the contribution weight (``rho_attention``, ``rho_relative_norm``,
        ``rho_cosine``), with ``n_samples`` and ``sink_head`` (claim
        ``sink_contribution_drivers`` reads the sink group of sink heads)."""
        heads = self.heads()[["layer", "head", "sink_head"]]
        frames = [head_spearman(self.samples(g)).assign(group=g) for g in ("sink", "tail")]
        table = pd.concat(frames, ignore_index=True)
        return table.merge(heads, on=["layer", "head"], how="left")

    def _driver_samples(self) -> list[tuple[int, int, Tensor, Tensor]] | None:
        """Per head, the sink group's factor samples and their documents, as
        :func:`cw_lens.core.resampled.driver_numbers` reads them (None if any document is
        unknown)."""
        reservoir, index = self.acc.samples, {layer: i for i, layer in enumerate(self.layers)}
        columns = [FACTOR_COLUMNS.index(c) for c in (*DRIVER_FACTORS, "contribution")]
        out = []
        for group in reservoir.groups():
            kind, layer, head = group.split("/")
            if kind != "sink":
                continue
            docs = reservoir.documents(group)
            if (docs < 0).any():
                return None
            table = reservoir.table(group)[:, columns]
            out.append((index[int(layer)], int(head), table.double(), docs))
        return out

    def decomposition(self) -> pd.DataFrame:
        """Per group (sink / tail entries of sink heads) and factor: the mean and median over
        the sampled entries, and the median over sink heads of the per-head Spearman rho with
        the contribution, signed and absolute (:meth:`drivers`)."""
        drivers = self.drivers()
        drivers = drivers[drivers["sink_head"].eq(True)]
        heads = set(map(tuple, self.sink_heads.nonzero().tolist()))
        rows = []
        for group in ("sink", "tail"):
            table = self.samples(group)
            layer_index = table["layer"].map({layer: i for i, layer in enumerate(self.layers)})
            keep = [(a, h) in heads for a, h in zip(layer_index, table["head"], strict=True)]
            table = table[np.asarray(keep, dtype=bool)]
            rho = drivers[drivers["group"] == group]
            for name in (*DRIVER_FACTORS, "contribution"):
                values = table[name].to_numpy()
                col = f"rho_{name}"
                rows.append(
                    {
                        "group": group,
                        "factor": name,
                        "mean": float(np.nanmean(values)) if len(values) else math.nan,
                        "median": float(np.nanmedian(values)) if len(values) else math.nan,
                        "median_head_rho": float(rho[col].median()) if col in rho else 1.0,
                        "median_head_abs_rho": float(rho[col].abs().median())
                        if col in rho
                        else 1.0,
                        "n_samples": len(values),
                    }
                )
        return pd.DataFrame(rows)

    def claims(self, bootstrap: Bootstrap | None = None) -> dict[str, dict[str, Any]]:
        """P1/P2's sink claims (SPEC §6) with the numbers measured here and whether they hold
        (:func:`sink_claims`); with ``bootstrap``, every number's interval over documents and
        the per-layer detail (:meth:`intervals`; needs ``per_document=True``)."""
        claims = sink_claims(self.heads(), self.drivers())
        if bootstrap is not None:
            claims = with_intervals(claims, *self.intervals(bootstrap))
        return claims_dict(claims)

    def intervals(
        self, bootstrap: Bootstrap
    ) -> tuple[dict[str, tuple[float, float]], dict[str, list[dict[str, Any]]]]:
        """Bootstrap intervals over documents of the sink claims' numbers
        (:mod:`cw_lens.core.resampled` says what each is of) and per-layer rows for the claims
        about layers. ``median_abs_rho_*``: the factor samples are weighted by how often their
        document is drawn (:func:`cw_lens.core.resampled.driver_numbers`)."""
        per_doc = require_record(self.acc.per_doc, "sink_statistics")
        hist = self.acc.share_hist
        record = per_doc.table()
        reps = bootstrap.resample(record)  # [R, statistic, layer, head]
        fields = sink_head_fields(
            {name: reps[:, i] for i, name in enumerate(per_doc.names)},
            bootstrap.resample(hist.table("drift_share")),
            SHARE_BINNING,
            self.threshold,
        )
        numbers = sink_numbers(fields, MIN_S_STAR_QUERIES)
        samples = self._driver_samples()
        if samples is not None:  # None: samples stored without their documents (before 0.2.1)
            weights = bootstrap.weights(record.shape[0])
            numbers.update(driver_numbers(samples, DRIVER_FACTORS, weights, fields["sink"]))
        intervals = {k: bootstrap.pair(v) for k, v in numbers.items()}
        exact = {name: self._total(name)[None] for name in RECORDED_SUMS[:11]}
        counts = self.acc.s_star.counts[None].double()
        exact.update(s_star_lo=counts[..., 0], s_star_hi=counts[..., -1], s_star_n=counts.sum(-1))
        point = sink_head_fields(
            exact, hist.table("drift_share").double().sum(0)[None], SHARE_BINNING, self.threshold
        )
        point_layers = sink_numbers_per_layer(point, MIN_S_STAR_QUERIES)
        rep_layers = sink_numbers_per_layer(fields, MIN_S_STAR_QUERIES)
        per_layer = {
            cid: per_layer_rows(
                self.layers, number, point_layers[number][0], bootstrap.interval(rep_layers[number])
            )
            for cid, number in LAYER_NUMBERS.items()
        }
        return intervals, per_layer

    # plots
    def plot_value_geometry(self, **kw: Any) -> Any:
        from cw_lens.plots.sinks import plot_sink_value_geometry

        return plot_sink_value_geometry(self.heads(), **kw)

    def plot_drivers(self, **kw: Any) -> Any:
        from cw_lens.plots.sinks import plot_sink_contribution_drivers

        return plot_sink_contribution_drivers(self.heads(), self.decomposition(), **kw)

    def plot_curve(self, **kw: Any) -> Any:
        from cw_lens.plots.sinks import plot_convex_sink_curve

        return plot_convex_sink_curve(self.curve(), self.s_star_distribution(), self.heads(), **kw)

    def plot_drift(self, **kw: Any) -> Any:
        from cw_lens.plots.sinks import plot_sink_cancels_drift

        return plot_sink_cancels_drift(self.heads(), **kw)

    def plot(self, **kw: Any) -> Any:
        """The attention-versus-contribution overview per layer (sink heads highlighted)."""
        from cw_lens.plots.sinks import plot_sink_attention_vs_contribution

        return plot_sink_attention_vs_contribution(self.heads(), **kw)


def sink_statistics(
    model: Any,
    corpus: Any,
    *,
    sink_positions: SinkPositions = (0,),
    layers: Any = None,
    batch_size: int | None = 8,
    min_query: int = MIN_QUERY,
    drift_k: int = 4,
    samples_per_head: int = 128,
    max_samples: int = MAX_SAMPLES_PER_HEAD,
    seed: int = 0,
    prepend_bos: bool = True,
    progress: bool | str = False,
    per_document: bool = False,
) -> SinkStatistics:
    """Sink geometry over a corpus in one streamed pass (SPEC §3).

    Args:
        model: A ``TransformerBridge``.
        corpus: ``load_corpus(...)`` output or a list of strings.
        sink_positions: Sink positions (default BOS, position 0) or ``"detect"`` (per document,
            keys whose mean attention exceeds 0.3 in some head).
        layers: Layers (``None`` = all).
        batch_size: Documents per forward pass.
        min_query: Queries ``i >= min_query`` define sink rates and curves (SPEC: 16).
        drift_k: Top-attended tail tokens kept out of the drift (SPEC: 4).
        samples_per_head: Factor samples per (document, layer, head) and group (sink /
            tail entries) for the per-head rank correlations (:meth:`SinkStatistics.drivers`).
        max_samples: Factor samples kept per (layer, head) and group over the whole corpus (a
            seeded bottom-k reservoir: the same sample whatever the sharding; memory fixed at
            about 80 bytes per sample, 44 MB for SmolLM2's 270 heads at the default); small
            corpora keep every sample drawn.
        seed: Seed of the factor sampling (per document, so sharded runs sample the same).
        prepend_bos: Prepend BOS to text.
        progress: Show a progress bar.
        per_document: Also keep each document's sums per head (``RECORDED_SUMS`` and a coarse
            cancelled-share histogram: ``4 * (14 + 26) * n_layers * n_heads + 2`` bytes per
            document, 43.2 KB for SmolLM2-135M's 270 heads) so that
            :meth:`SinkStatistics.claims` can give bootstrap intervals.
    """
    if drift_k < 1:
        raise InputError(f"drift_k must be at least 1, got {drift_k}.")
    if min_query < 1:
        raise InputError(f"min_query must be at least 1, got {min_query}.")
    if samples_per_head < 0:
        raise InputError(f"samples_per_head must be >= 0, got {samples_per_head}.")
    layer_list = resolve_layers(model, layers)
    sinks = _resolve_sinks(
        model, corpus, sink_positions, batch_size=batch_size, prepend_bos=prepend_bos
    )
    acc = _SinkAccumulator(
        layer_list,
        model.cfg.n_heads,
        sinks,
        min_query=min_query,
        drift_k=drift_k,
        samples_per_head=samples_per_head,
        max_samples=max_samples,
        seed=seed,
        n_documents=len(as_corpus(corpus)) if per_document else None,
    )
    acc, stats = stream_corpus(
        model,
        corpus,
        acc,
        layers=layer_list,
        batch_size=batch_size,
        prepend_bos=prepend_bos,
        progress=progress and "sink statistics",
    )
    result = SinkStatistics(
        layer_list,
        model.cfg.n_heads,
        sinks.describe(),
        stats.n_documents,
        stats.n_tokens,
        acc,
        min_query,
    )
    if bool(result.sink_rate.isnan().all()):
        warnings.warn(
            f"No query at position >= min_query={min_query} after a sink: the documents are too "
            "short (or no sink position lies inside them), so sink rates are NaN and no head is "
            "a sink head. Use longer texts or a smaller min_query.",
            RuntimeWarning,
            stacklevel=2,
        )
    return result


def sink_rates(
    model: Any,
    inputs: Any,
    *,
    sink_positions: SinkPositions = (0,),
    layers: Any = None,
    prepend_bos: bool = True,
) -> Float[Tensor, "batch layer head query"]:
    """Per-query sink rate ``s_i^h`` for a few texts (NaN at padding and at sink queries);
    ``sink_positions`` as in :func:`sink_statistics` (positions or ``"detect"``)."""
    from cw_lens.data.inputs import prepare_inputs

    layer_list = resolve_layers(model, layers)
    batch = prepare_inputs(model, inputs, prepend_bos=prepend_bos)
    sinks = _resolve_sinks(model, inputs, sink_positions, prepend_bos=prepend_bos)
    n_pos = batch.tokens.shape[1]
    out = torch.full((batch.tokens.shape[0], len(layer_list), model.cfg.n_heads, n_pos), math.nan)

    def fill(lc: LayerContributions) -> None:
        mask = sinks.mask(lc.batch, lc.attention.device)
        s = geo.sink_rate(lc.attention, mask[:, : lc.keys.stop])
        ok = lc.query_mask & ~mask[:, lc.queries]
        rows = torch.tensor(lc.batch.documents)
        out[rows, layer_list.index(lc.layer), :, lc.queries] = s.masked_fill(
            ~ok[:, None, :], math.nan
        ).cpu()

    stream_contributions(
        model,
        batch.tokens,
        fill,
        layers=layer_list,
        attention_mask=batch.mask.long(),
    )
    return out


# --------------------------------------------------------------------------- ablation


def cone_axis(
    acts: LayerActivations, sink_full: Bool[Tensor, "batch pos"]
) -> Float[Tensor, "batch head d_head"]:
    """The axis of each head's semantic cone in value space: the mean of the values the head
    reads at real non-sink positions over the whole sequence (``u^h`` up to ``W_O^h`` and
    normalisation, SPEC §3)."""
    tail = (acts.mask & ~sink_full).to(acts.values.dtype)
    per_head = geo.values_per_head(acts.values, acts.n_heads)  # [b, h, pos, d]
    return (per_head * tail[:, None, :, None]).sum(2) / tail.sum(1)[:, None, None].clamp_min(1)


def norm_and_cone(
    z: Float[Tensor, "batch query head d_head"],
    axis: Float[Tensor, "batch query head d_head"],
    gram: Float[Tensor, "head d_head d_head"],
) -> tuple[Float[Tensor, "batch head query"], Float[Tensor, "batch head query"], Tensor]:
    """``||o_i^h||``, the cone alignment ``cos(o_i^h, u^h)`` and where it is defined (both
    norms positive), in head space (``o = z W_O``, ``u = axis W_O``)."""
    zz = geo.gram_inner(z, z, gram)
    aa = geo.gram_inner(axis, axis, gram)
    za = geo.gram_inner(z, axis, gram)
    cos = za / (zz * aa).clamp_min(1e-30).sqrt()
    return zz.clamp_min(0).sqrt(), cos, (zz > 0) & (aa > 0)


class _AblationAccumulator:
    """Per head: output norm and semantic-cone alignment before and after removing the sink."""

    def __init__(
        self,
        plan: dict[int, list[int]],
        n_heads: int,
        sinks: SinkSpec,
        scale: float,
        mode: str,
        run_tag: str,
        direct_after: bool,
        n_documents: int | None = None,
    ) -> None:
        """``run_tag``: what the streamed run measures ("before" = clean, "after" = patched);
        ``direct_after``: also record the exact direct effect of the patch on the clean run;
        ``n_documents``: also keep each document's sums (for bootstrap intervals)."""
        self.plan, self.n_heads, self.sinks = plan, n_heads, sinks
        self.scale, self.mode = scale, mode
        self.run_tag, self.direct_after = run_tag, direct_after
        self.sums = ExactSums()
        self.pos = {layer: i for i, layer in enumerate(sorted(plan))}
        self.per_doc = (
            None
            if n_documents is None
            else PerDocument(ABLATION_SUMS, n_documents, (len(plan), n_heads))
        )

    def merge(self, other: _AblationAccumulator) -> None:
        self.sums.merge(other.sums)
        if self.per_doc is not None:
            self.per_doc.merge(other.per_doc)

    def update(self, lc: LayerContributions) -> None:
        if lc.layer not in self.plan:
            return
        acts, docs = lc.acts, lc.batch.documents
        gram = acts.weights.gram
        device = acts.pattern.device
        sink_full = self.sinks.mask(lc.batch, device)
        q, n_keys = lc.queries, lc.keys.stop
        valid = queries_after_sink(lc, sink_full)
        z = acts.z[:, q]
        axis = cone_axis(acts, sink_full)[:, None].expand(-1, z.shape[1], -1, -1)  # [b, q, h, d]
        tail = (acts.mask & ~sink_full).to(acts.values.dtype)
        norms = geo.projected_value_norms(acts.values, gram)  # [b, h, pos]
        mean_pv = (norms * tail[:, None]).sum(-1) / tail.sum(1)[:, None].clamp_min(1)  # [b, h]
        layer = lc.layer
        self._record(docs, layer, self.run_tag, z, axis, gram, valid, mean_pv)
        if self.direct_after:
            st = geo.sink_term(lc.attention, acts.values[:, :n_keys], sink_full[:, :n_keys])
            factor = sink_scale(self.mode, self.scale, norms, sink_full, acts.mask)  # [b, h]
            heads = torch.zeros(self.n_heads, dtype=torch.bool, device=device)
            heads[self.plan[layer]] = True
            factor = torch.where(heads[None], factor, torch.zeros_like(factor))
            st = st.masked_fill(sink_full[:, q][:, :, None, None], 0.0)
            after = z - factor[:, None, :, None] * st
            self._record(docs, layer, "after", after, axis, gram, valid, mean_pv)

    def _record(
        self,
        docs: list[int],
        layer: int,
        tag: str,
        z: Tensor,
        axis: Tensor,
        gram: Tensor,
        valid: Tensor,
        mean_pv: Tensor,
    ) -> None:
        norm, cos, defined = norm_and_cone(z, axis, gram)
        ok = valid[:, None, :] & defined

        def add(docs: list[int], key: str, values: Tensor) -> None:
            self.sums.add_rows(docs, key, values)
            name = key.split("@")[0]
            if self.per_doc is not None and name in ABLATION_SUMS:
                self.per_doc.add_rows(docs, name, values, at=self.pos[layer])

        add(docs, f"norm_{tag}@{layer}", torch.where(ok, norm, 0.0).sum(-1))
        add(docs, f"cone_{tag}@{layer}", torch.where(ok, cos, 0.0).sum(-1))
        add(docs, f"count_{tag}@{layer}", ok.sum(-1))
        if tag == "before":
            add(
                docs,
                f"rel_norm@{layer}",
                torch.where(ok, norm / mean_pv[..., None].clamp_min(1e-30), 0.0).sum(-1),
            )


@dataclass
class SinkAblation:
    """Result of :func:`sink_ablation`.

    Attributes:
        clean_nll, patched_nll: Mean next-token NLL without / with the sink patched.
        per_head: One row per patched (layer, head): output norm and cone alignment before and
            after, the head's relative output norm, and ``low_norm`` (the quarter of heads with
            the smallest ``mean ||o_i^h|| / mean_j ||pv_j^h||``).
        effect: ``"direct"`` (after = the same layer's output with the sink removed, same input)
            or ``"total"`` (after = measured in the patched run, upstream patches included).
    """

    clean_nll: float
    patched_nll: float
    per_head: pd.DataFrame
    scale: float
    mode: str
    effect: str
    layers: list[int]
    # opt-in: ([document, ABLATION_SUMS, layer, head] sums, [document, (clean nll, count,
    # patched nll, count)], the patched heads' mask [layer, head]) for bootstrap intervals
    per_document: tuple[Tensor, Tensor, Tensor] | None = None
    low_norm_quantile: float = 0.25

    @property
    def delta_nll(self) -> float:
        return self.patched_nll - self.clean_nll

    @property
    def clean_ppl(self) -> float:
        return math.exp(self.clean_nll)

    @property
    def patched_ppl(self) -> float:
        return math.exp(self.patched_nll)

    @property
    def delta_ppl(self) -> float:
        return self.patched_ppl - self.clean_ppl

    def to_dataframe(self) -> pd.DataFrame:
        return self.per_head

    def summary(self) -> pd.DataFrame:
        """Mean cone alignment and norm before/after for low-norm heads versus the rest."""
        df = self.per_head.copy()
        df["group"] = np.where(df["low_norm"], "low-norm heads", "other heads")
        cols = ["cone_before", "cone_after", "norm_before", "norm_after"]
        return df.groupby("group")[cols].mean()

    def claims(self, bootstrap: Bootstrap | None = None) -> dict[str, dict[str, Any]]:
        """P1's ablation claim (SPEC §6 ``sink_ablation_cone``), measured; with ``bootstrap``
        each number's interval over documents (each resample re-picks the low-norm quarter;
        needs ``per_document=True``)."""
        claims = [self._claim()]
        if bootstrap is not None:
            require_record(self.per_document, "sink_ablation")
            heads, nll, planned = self.per_document
            reps = ablation_numbers(
                bootstrap.resample(heads), bootstrap.resample(nll), planned, self.low_norm_quantile
            )
            claims = with_intervals(claims, {k: bootstrap.pair(v) for k, v in reps.items()})
        return claims_dict(claims)

    def _claim(self) -> Claim:
        summary = self.summary()

        def mean(group: str, column: str) -> float:
            return float(summary.loc[group, column]) if group in summary.index else math.nan

        cone = {
            f"{prefix}_cone_{when}": mean(group, f"cone_{when}")
            for prefix, group in (("low_norm", "low-norm heads"), ("other", "other heads"))
            for when in ("before", "after")
        }
        rise_low = cone["low_norm_cone_after"] - cone["low_norm_cone_before"]
        rise_other = cone["other_cone_after"] - cone["other_cone_before"]
        claim = Claim(
            "sink_ablation_cone",
            paper="removing the sink norm collapses low-norm heads into the semantic cone, PPL "
            "up (P1)",
            criterion="cone alignment rises more in low-norm heads than in the others, and PPL "
            "rises",
            checks=[
                Check("cone_rise_low_norm_minus_other", rise_low - rise_other, ">", 0.0),
                Check("delta_ppl", self.delta_ppl, ">", 0.0),
            ],
            measured={
                **cone,
                "clean_ppl": self.clean_ppl,
                "patched_ppl": self.patched_ppl,
                "delta_nll": self.delta_nll,
                "effect": self.effect,
                "layers": self.layers,
                "scale": self.scale,
                "mode": self.mode,
            },
        )
        return claim

    def plot(self, **kw: Any) -> Any:
        from cw_lens.plots.sinks import plot_sink_ablation_cone

        return plot_sink_ablation_cone(self, **kw)


def sink_ablation(
    model: Any,
    corpus: Any,
    *,
    layers: Any = None,
    heads: Any = None,
    scale: float = 0.0,
    mode: Literal["scale", "norm_matched"] = "scale",
    sink_positions: Sequence[int] = (0,),
    effect: Literal["direct", "total"] = "direct",
    low_norm_quantile: float = 0.25,
    batch_size: int | None = 8,
    prepend_bos: bool = True,
    progress: bool | str = False,
    per_document: bool = False,
) -> SinkAblation:
    """Remove (or rescale) the sink's projected value and measure what changes (SPEC §3).

    ΔPPL comes from the real intervention (:func:`cw_lens.patch_sink` on all chosen layers and
    heads at once). Per head, ``||o_i^h||`` and ``cos(o_i^h, u^h)`` are measured before and
    after over queries after the sink: with ``effect="direct"`` the "after" output is the same
    layer's output with the sink's term removed (same input — exact, from the clean pass); with
    ``effect="total"`` it is measured in the patched run.

    Args:
        layers, heads: What to patch (``None`` = all); heads as a list or ``{layer: [heads]}``.
        scale: ``lambda`` in [0, 2]: the sink's projected value becomes ``lambda pv_0`` (0 removes
            it, 1 keeps it, 2 doubles it).
        mode: ``"scale"`` or ``"norm_matched"`` (sink norm set to the mean tail norm).
        sink_positions: Sink positions (default BOS).
        effect: ``"direct"`` or ``"total"`` (see above).
        low_norm_quantile: Share of heads called "low-norm" (SPEC: a quarter).
        per_document: Also keep each document's per-head sums and NLL sums (``20 *
            n_layers * n_heads + 19`` bytes per document, 5.4 KB for SmolLM2-135M) for
            bootstrap intervals (:meth:`SinkAblation.claims`).
    """
    if effect not in ("direct", "total"):
        raise InputError(f"effect must be 'direct' or 'total', got {effect!r}.")
    if not 0 < low_norm_quantile < 1:
        raise InputError(f"low_norm_quantile must lie in (0, 1), got {low_norm_quantile}.")
    plan = per_layer_heads(model, layers, heads)

    def patch(batch: TokenBatch) -> list:
        """The intervention for one document batch (its mask matters in norm_matched mode)."""
        hook_set = patch_sink(
            model,
            heads=plan,
            scale=scale,
            mode=mode,
            sink_positions=sink_positions,
            attention_mask=batch.mask,
        )
        return [hook_set]

    sinks = SinkSpec(sink_positions)
    n_heads = model.cfg.n_heads
    kw = dict(layers=sorted(plan), batch_size=batch_size, prepend_bos=prepend_bos)
    direct = effect == "direct"
    n_docs = len(as_corpus(corpus)) if per_document else None
    before = _AblationAccumulator(plan, n_heads, sinks, scale, mode, "before", direct, n_docs)
    before, _ = stream_corpus(model, corpus, before, progress=progress and "sink ablation", **kw)
    after_sums, record = before.sums, before.per_doc
    if not direct:
        after = _AblationAccumulator(plan, n_heads, sinks, scale, mode, "after", False, n_docs)
        after, _ = stream_corpus(model, corpus, after, fwd_hooks=patch, **kw)
        after_sums = after.sums
        if record is not None:  # the two records keep disjoint statistics
            record.values += after.per_doc.values
    kw_nll = dict(batch_size=batch_size, prepend_bos=prepend_bos, per_document=per_document)
    clean = corpus_nll(model, corpus, **kw_nll)
    patched = corpus_nll(model, corpus, hooks=patch, **kw_nll)
    rows = []
    for layer, hs in sorted(plan.items()):
        total = {
            n: (after_sums if n.endswith("_after") else before.sums).total(f"{n}@{layer}")
            for n in (
                "norm_before",
                "cone_before",
                "count_before",
                "norm_after",
                "cone_after",
                "count_after",
                "rel_norm",
            )
        }
        for h in hs:
            nb = max(float(total["count_before"][h]), 1.0)
            na = max(float(total["count_after"][h]), 1.0)
            rows.append(
                {
                    "layer": layer,
                    "head": h,
                    "relative_output_norm": float(total["rel_norm"][h]) / nb,
                    "norm_before": float(total["norm_before"][h]) / nb,
                    "norm_after": float(total["norm_after"][h]) / na,
                    "cone_before": float(total["cone_before"][h]) / nb,
                    "cone_after": float(total["cone_after"][h]) / na,
                }
            )
    df = pd.DataFrame(rows)
    cut = df["relative_output_norm"].quantile(low_norm_quantile)
    df["low_norm"] = df["relative_output_norm"] <= cut
    per_doc = None
    if record is not None:
        planned = torch.zeros(len(plan), n_heads, dtype=torch.bool)
        for i, layer in enumerate(sorted(plan)):
            planned[i, plan[layer]] = True
        nll = torch.cat([clean.per_doc.table(), patched.per_doc.table()], 1)
        per_doc = (record.table(), nll, planned)
    return SinkAblation(
        clean.mean_nll,
        patched.mean_nll,
        df,
        scale,
        mode,
        effect,
        sorted(plan),
        per_doc,
        low_norm_quantile,
    )
