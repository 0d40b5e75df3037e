"""The streamed sink accumulator: per-layer sums, histograms and factor samples of one pass
(docs/methods.md#sinks), and the per-head rank correlations of the sampled factors.
"""

from __future__ import annotations

import copy
import hashlib
import math
from collections.abc import Sequence
from typing import Any, ClassVar

import pandas as pd
import torch
from jaxtyping import Bool, Float
from torch import Tensor

from cw_lens.analyses.sinks.detection import SinkSpec, queries_after_sink
from cw_lens.core import geometry as geo
from cw_lens.core.accumulate import ExactSums, Histogram, PerDocument, SampleReservoir
from cw_lens.core.registry import saveable
from cw_lens.models.batch import TokenBatch
from cw_lens.models.layer_contributions import LayerContributionsResult

RATE_BINS = 20


# the cancelled share is a ratio without a natural range: asinh bins, ~0.2% wide near 0 and
# 1.9% relative beyond, over +-1e9 (docs/methods.md#claims reads per-head medians from unclipped
# values)
DRIFT_SHARE_BINNING = dict(lo=-1e9, hi=1e9, n_bins=3000, scale="asinh", unit=1e-3)
DRIVER_FACTORS = ("attention", "relative_norm", "cosine")
# the per-document record a bootstrap over documents reads (`per_document=True`): these sums
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


@saveable
class SinkAccumulator:
    """Folds streamed layers into exact sums, histograms and a factor-sample reservoir."""

    stored_fields: ClassVar[dict[str, Any]] = {
        "layers": list[int],
        "n_heads": int,
        "sinks": SinkSpec,
        "pos": dict[int, int],
        "min_query": int,
        "drift_k": int,
        "samples_per_head": int,
        "seed": int,
        "sums": ExactSums,
        "samples": SampleReservoir,
        "s_star": Histogram,
        "drift_cos": Histogram,
        "drift_share": Histogram,
        "per_doc": PerDocument | None,
        "share_hist": PerDocument | None,
        "_share_bins": Histogram,
    }
    optional_fields = ("_share_bins",)  # with the per-document record only

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

    def select_layer(self, layer: int) -> SinkAccumulator:
        """The same accumulated numbers for layer NUMBER `layer` alone (the layer axis of
        every histogram and per-document record kept with size 1).

        The exact sums are shared (they are keyed by layer number); the histograms, samples
        and per-document records are new objects, so this accumulator is unchanged.

        Args:
            layer: A layer number in `layers`.

        Returns:
            An accumulator whose `layers` is `[layer]`.
        """
        i = self.pos[layer]
        out = copy.copy(self)
        out.layers, out.pos = [layer], {layer: 0}
        for name in ("s_star", "drift_cos", "drift_share"):
            hist = copy.copy(getattr(self, name))
            hist.counts = hist.counts[i : i + 1].clone()
            setattr(out, name, hist)
        mine = [g for g in self.samples.groups() if g.split("/")[1] == str(layer)]
        out.samples = self.samples.subset(mine)
        for name in ("per_doc", "share_hist"):
            record = getattr(self, name)
            if record is not None:
                record = copy.copy(record)
                record.values = record.values[:, :, i : i + 1].clone()
                record.shape = (1, *record.shape[1:])
                setattr(out, name, record)
        return out

    def merge(self, other: SinkAccumulator) -> None:
        self.sums.merge(other.sums)
        self.samples.merge(other.samples)
        for name in ("s_star", "drift_cos", "drift_share"):
            getattr(self, name).merge(getattr(other, name))
        if self.per_doc is not None:
            self.per_doc.merge(other.per_doc)
            self.share_hist.merge(other.share_hist)

    def to_host(self) -> None:
        """After a pass: bring what was accumulated on the model's device to the host (once)
        and drop the batch the pass left cached."""
        self.sums.to_host()
        for part in (self.s_star, self.drift_cos, self.drift_share, self.per_doc, self.share_hist):
            if part is not None:
                part.to_host()
        self.__dict__.pop("_batch_sinks", None)

    def _sink_columns(
        self, batch: TokenBatch, device: torch.device
    ) -> tuple[Tensor, Tensor, list[int], int]:
        """The batch's sink mask `[batch, pos]`, the positions that are a sink in some row
        (ascending, on `device` and as a list: read from the token lengths on the host) and
        the most sinks a row has: once per batch."""
        cached = self.__dict__.get("_batch_sinks")
        if cached is None or cached[0] is not batch or cached[1].device != device:
            rows = [
                [p for p in self.sinks.positions(doc) if p < int(batch.lengths[row])]
                for row, doc in enumerate(batch.documents)
            ]
            cols = sorted({p for r in rows for p in r})
            on_device = torch.tensor(cols, dtype=torch.long, device=device)
            mask = self.sinks.mask(batch, device)
            cached = (batch, mask, on_device, cols, max(map(len, rows), default=0))
            self._batch_sinks = cached
        return cached[1:]

    def _commit(
        self,
        docs: list[int],
        layer: int,
        sums: list[tuple[str, Tensor]],
        recorded: list[tuple[str, Tensor]],
    ) -> None:
        """A block's per-row sums (`name`, `[batch, ...]`) into the exact sums (keyed
        `name@layer`, in the order of `sums`) and, with the per-document record, those of
        `RECORDED_SUMS` and `recorded` (per-document only) into it: one call each."""
        self.sums.add_many(docs, [(f"{name}@{layer}", rows) for name, rows in sums])
        if self.per_doc is not None:
            kept = [(n, rows) for n, rows in sums if n in RECORDED_SUMS] + recorded
            self.per_doc.add_many(docs, kept, at=self.pos[layer])

    def _edges(self, s_star: Tensor, share: Tensor) -> list[tuple[str, Tensor]]:
        """Per document and head: the s* edge counts (and the coarse cancelled-share
        histogram, into `share_hist` directly)."""
        counted = ~s_star.isnan()  # [b, h, q]
        ok = ~share.isnan()  # [b, h, q]
        bins = self._share_bins.bin_index(share.nan_to_num(0.0))
        onehot = torch.nn.functional.one_hot(bins, SHARE_BINNING["n_bins"] + 2) * ok[..., None]
        return [
            ("s_star_lo", ((s_star <= 0) & counted).sum(-1)),
            ("s_star_hi", ((s_star >= 1) & counted).sum(-1)),
            ("s_star_n", counted.sum(-1)),
            ("drift_share", onehot.sum(2)),
        ]

    def update(self, lc: LayerContributionsResult) -> None:
        # Long: one block's statistics in the order of the methods page; each reads the last.
        acts, docs, layer = lc.acts, lc.batch.documents, lc.layer
        device = acts.pattern.device
        sink_full, sink_cols, cols, most_sinks = self._sink_columns(lc.batch, device)
        q, n_keys = lc.queries, lc.keys.stop
        qpos = lc.query_positions
        valid_q = queries_after_sink(lc, sink_full)
        sink_mask = sink_full[:, :n_keys]
        att = lc.attention
        gram = acts.weights.gram
        values = acts.values[:, :n_keys]
        s = geo.sink_rate(att, sink_mask)  # [b, h, q]
        in_block = sink_cols[: sum(c < n_keys for c in cols)]
        st = geo.sink_term(att, values, sink_mask, cols=in_block)  # [b, q, h, d]
        z = acts.z[:, q]
        tail = z - st
        o_norm = lc.head_output_norm
        vq = valid_q[:, None, :].expand_as(s)
        sums = self._value_geometry(lc, sink_full, sink_cols) if q.start == 0 else []

        # sink rate (sink-head criterion) and the empirical curve, queries i >= min_query
        late = vq & (qpos[None, None, :] >= self.min_query)
        bins = (s * RATE_BINS).floor().clamp(0, RATE_BINS - 1).long()
        onehot = torch.nn.functional.one_hot(bins, RATE_BINS).to(s.dtype) * late[..., None]
        sums += [
            ("rate_sum", (s * late).sum(-1)),
            ("rate_count", late.sum(-1)),
            ("rate_all_sum", (s * vq).sum(-1)),
            ("rate_all_count", vq.sum(-1)),
            ("norm_sum", (o_norm * vq).sum(-1)),
            ("curve_norm", (onehot * o_norm[..., None]).sum(2)),
            ("curve_count", onehot.sum(2)),
        ]

        # tail mixture and sink direction
        has_sink = vq & (s > 1e-6)
        has_tail = has_sink & (s <= 0.999)
        nt2 = geo.gram_inner(tail, tail, gram)
        ns2 = geo.gram_inner(st, st, gram)
        cross = geo.gram_inner(st, tail, gram)
        ok_mix = has_tail & (nt2 > 0) & (ns2 > 0)
        cos_mix = cross / (nt2 * ns2).clamp_min(1e-30).sqrt()
        sums += [
            ("cos_mixture_sum", torch.where(ok_mix, cos_mix, 0.0).sum(-1)),
            ("cos_mixture_count", ok_mix.sum(-1)),
        ]

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
        recorded = [] if self.per_doc is None else self._edges(s_star, share)
        if recorded:
            self.share_hist.add_rows(docs, *recorded.pop(), at=li)
        sums += [
            ("drift_neg", ((cos_drift < 0) & ok_drift).sum(-1)),
            ("drift_count", ok_drift.sum(-1)),
        ]
        sums += self._factors(lc, sink_mask, tail_keys, valid_q, docs, most_sinks)
        self._commit(docs, layer, sums, recorded)

    def _value_geometry(
        self, lc: LayerContributionsResult, sink_full: Tensor, cols: Tensor
    ) -> list[tuple[str, Tensor]]:
        acts = lc.acts
        gram = acts.weights.gram
        norms = lc.layer_projected_value_norm  # [b, h, pos], once per layer
        per_head = geo.values_per_head(acts.values, self.n_heads)  # [b, h, pos, d]
        tail = acts.mask & ~sink_full
        sink_v = per_head[:, :, cols]  # [b, h, s, d]
        dots = torch.einsum("bhsd,hde,bhte->bhst", sink_v, gram, per_head)
        sink_norm = norms[:, :, cols]  # [b, h, s]
        use = sink_full[:, cols][:, None, :, None] & tail[:, None, None, :]  # [b, 1, s, t]
        use = use & (sink_norm[..., None] > 0)
        ratio = norms[:, :, None, :] / sink_norm[..., None].clamp_min(1e-30)
        cos = dots / (sink_norm[..., None] * norms[:, :, None, :]).clamp_min(1e-30)
        use = use.expand_as(ratio)
        return [
            ("ratio_sum", torch.where(use, ratio, 0.0).sum((2, 3))),
            ("log_ratio_sum", torch.where(use, ratio.clamp_min(1e-30).log(), 0.0).sum((2, 3))),
            ("cos_token_sum", torch.where(use, cos, 0.0).sum((2, 3))),
            ("geometry_count", use.sum((2, 3))),
        ]

    def _factors(
        self,
        lc: LayerContributionsResult,
        sink_mask: Tensor,
        tail_keys: Tensor,
        valid_q: Tensor,
        docs: list[int],
        most_sinks: int,
    ) -> list[tuple[str, Tensor]]:
        """The three factors of the intra weight, for sink entries and tail entries: their
        sums, and their samples (into the reservoir)."""
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
        # a (row, head) of a group has at most this many entries in the block
        rows = lc.queries.stop - lc.queries.start
        most = {"sink": most_sinks * rows, "tail": lc.keys.stop * rows}
        sums, drawn = [], []
        defined = ~fields["contribution"].isnan()
        for group, entries in (("sink", sink_entries), ("tail", tail_entries)):
            # every field is finite where the contribution (their product) is not NaN
            entries = entries & defined
            for name, t in fields.items():
                sums.append((f"{group}_{name}_sum", torch.where(entries, t, 0.0).sum((2, 3))))
            sums.append((f"{group}_count", entries.sum((2, 3))))
            drawn.append(self._draw(lc, entries, docs, group, most[group]))
        self._sample(lc, fields, docs, drawn)
        return sums

    def _draw(
        self, lc: LayerContributionsResult, entries: Tensor, docs: list[int], group: str, most: int
    ) -> Tensor | None:
        """Up to `samples_per_head` seeded random valid entries per head of each row
        (seeded per document, layer and query block, so any sharding samples the same), as
        indices `[m, 4]`; every valid entry, and no draw, when no (row, head) can have more."""
        if self.samples_per_head <= 0:
            return None
        if most <= self.samples_per_head:  # the seeded draw would keep every entry
            return entries.nonzero()
        keys = []
        for doc in docs:
            key = f"{self.seed}/{doc}/{lc.layer}/{lc.queries.start}/{group}".encode()
            gen = torch.Generator().manual_seed(int(hashlib.sha1(key).hexdigest()[:12], 16))
            keys.append(torch.rand(entries.shape[1:], generator=gen, device="cpu"))
        return _draw_per_head(entries, torch.stack(keys).to(entries.device), self.samples_per_head)

    def _sample(
        self,
        lc: LayerContributionsResult,
        fields: dict[str, Tensor],
        docs: list[int],
        drawn: list[Tensor | None],
    ) -> None:
        """The drawn entries of both groups (sink, then tail) into the reservoir, in one
        call (the reservoir keeps the same rows in any order)."""
        if drawn[0] is None:
            return
        n_heads, layer = lc.shape[1], lc.layer
        idx = torch.cat(drawn)
        row, h, qi, k = idx.unbind(1)
        cols = [torch.full_like(h, layer), h, qi + lc.queries.start, k]
        cols += [fields[n][row, h, qi, k] for n in FACTOR_COLUMNS[4:]]
        table = torch.stack([c.float() for c in cols], 1)
        group = torch.cat([torch.full_like(d[:, 1], g * n_heads) for g, d in enumerate(drawn)])
        heads = [f"{g}/{layer}/{head}" for g in ("sink", "tail") for head in range(n_heads)]
        self.samples.add_many(docs, heads, table, row_doc=row, row_group=h + group)


def _draw_per_head(
    valid: Bool[Tensor, "batch head query key"], keys: Float[Tensor, "batch head query key"], n: int
) -> Tensor:
    """Up to `n` distinct True entries of `valid` per (row, head): those with the `n`
    smallest `keys` (uniform random: a uniform sample without replacement). Returns indices
    `[m, 4]` (row, head, query, key), grouped by row."""
    b, h, q, k = valid.shape
    flat = torch.where(valid, keys, 2.0).reshape(b * h, q * k)
    drawn, picks = flat.topk(min(n, q * k), dim=1, largest=False)
    keep = drawn < 2.0
    rows = torch.arange(b * h, device=valid.device)[:, None].expand_as(picks)[keep]
    flat_index = picks[keep]  # (torch.unravel_index is ~100x slower here)
    return torch.stack([rows // h, rows % h, flat_index // k, flat_index % k], 1)


def head_spearman(samples: pd.DataFrame, factors: Sequence[str] = DRIVER_FACTORS) -> pd.DataFrame:
    """Per (layer, head): Spearman's rank correlation `rho_<factor>` of each factor with the
    `contribution` over the head's sampled entries (average ranks for ties; NaN with fewer
    than 3 samples or a constant column), and `n_samples`."""
    columns = ["layer", "head", "n_samples", *(f"rho_{f}" for f in factors)]
    rows = []
    for (layer, head), g in samples.groupby(["layer", "head"], sort=True):
        corr = g[[*factors, "contribution"]].corr(method="spearman", min_periods=3)
        rho = corr["contribution"]
        rows.append([int(layer), int(head), len(g), *(float(rho[f]) for f in factors)])
    return pd.DataFrame(rows, columns=columns)
