"""The semantic cone of the sink ablation ([`sink_ablation`][cw_lens.sink_ablation]): each head's
cone axis, its output norms and cone alignment, and the per-block statistics the ablation's
accumulators sum per (layer, head) before and after the sink's projected value is scaled
(docs/methods.md#sinks).

Per head `h` and counted query `i` (real, not a sink, after the row's first sink), in head space
(`o = z W_O`, `u = axis W_O`, computed with the Gram matrix `G^h = W_O^h W_O^h^T`):
`norm = ||o_i^h||`, `cone = cos(o_i^h, u^h)`, `count = 1` where both norms are positive, and
`rel_norm = ||o_i^h|| / mean_j ||pv_j^h||` (the mean over the row's real non-sink keys). The
"after" output is `o_i^h - (1 - lambda) sum_{j in sinks} alpha[i,j] pv_j^h` (the direct effect,
from the clean pass) or the patched run's own `o_i^h` (the total effect).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from jaxtyping import Bool, Float
from torch import Tensor

from cw_lens.analyses.sinks.detection import SinkSpec
from cw_lens.core import geometry as geo
from cw_lens.core.accumulators import Accumulator, StackedSums, document_rows
from cw_lens.core.errors import InputError
from cw_lens.data.scoring import nll_rows, nll_sums
from cw_lens.models.capture import LayerActivations
from cw_lens.models.interventions import sink_scale
from cw_lens.models.layer_contributions import LayerContributionsResult

# the ablation's per-document record (per patched layer and head), in this order
ABLATION_SUMS = ("cone_before", "count_before", "cone_after", "count_after", "rel_norm")
# the statistics summed per (layer, head) of one pass, per output measured: the norm, the cone
# alignment, the count and the relative norm (the last one is read for the clean output only)
BEFORE = ("norm_before", "cone_before", "count_before", "rel_norm")
AFTER = ("norm_after", "cone_after", "count_after", "rel_norm_after")


def cone_axis(
    acts: LayerActivations, sink_full: Bool[Tensor, "batch pos"]
) -> Float[Tensor, "batch head d_head"]:
    """The axis of each head's semantic cone in value space: the mean of the values the head
    reads at real non-sink positions over the whole sequence (`u^h` up to `W_O^h` and
    normalisation, methods § Attention sinks (docs/methods.md#sinks)).

    Args:
        acts: A layer's activations.
        sink_full: True at the sink positions of each row.

    Returns:
        The axis of each row and head.
    """
    tail = (acts.mask & ~sink_full).to(acts.values.dtype)
    weight = tail / tail.sum(1, keepdim=True).clamp_min(1)  # [b, pos]: the mean's weights
    return _mean_value(acts.values, weight, acts.n_heads)


def _mean_value(
    values: Float[Tensor, "batch key kv_head d_head"],
    weight: Float[Tensor, "batch key"],
    n_heads: int,
) -> Float[Tensor, "batch head d_head"]:
    """`sum_j weight[j] v_j` of the values each query head reads (taken per kv head, then
    repeated for the query heads of its group)."""
    per_kv = (values * weight[:, :, None, None]).sum(1)  # [b, kv, d]
    group = n_heads // values.shape[2]
    return per_kv if group == 1 else per_kv.repeat_interleave(group, dim=1)


def norm_and_cone(
    z: Float[Tensor, "batch query head d_head"],
    axis: Float[Tensor, "batch query head d_head"],
    gram: Float[Tensor, "head d_head d_head"],
) -> tuple[Float[Tensor, "batch head query"], Float[Tensor, "batch head query"], Tensor]:
    """`||o_i^h||`, the cone alignment `cos(o_i^h, u^h)` and where it is defined (both
    norms positive), in head space (`o = z W_O`, `u = axis W_O`).

    Args:
        z: The head outputs in value space.
        axis: The cone axis of each query's row and head (`cone_axis`, expanded).
        gram: The per-head Gram matrices `W_O^h W_O^h^T`.

    Returns:
        `(norm, cos, defined)`, each `[batch, head, query]`.
    """
    zz = geo.gram_inner(z, z, gram)
    aa = geo.gram_inner(axis, axis, gram)
    za = geo.gram_inner(z, axis, gram)
    cos = za / (zz * aa).clamp_min(1e-30).sqrt()
    return zz.clamp_min(0).sqrt(), cos, (zz > 0) & (aa > 0)


def _sink_mask(sinks: SinkSpec, batch: Any) -> Bool[Tensor, "batch pos"]:
    """True at each row's sink positions inside the row, on the host (a few operations per
    batch for positions shared by every document, `SinkSpec.mask` otherwise)."""
    if sinks.default is None:
        return sinks.mask(batch, torch.device("cpu"))
    n_pos = batch.tokens.shape[1]
    inside = [p for p in sinks.default if p < n_pos]
    lengths = batch.mask.sum(-1).cpu()
    positions = torch.zeros(n_pos, dtype=torch.bool, device="cpu")
    positions[inside] = True
    return positions[None, :] & (torch.arange(n_pos, device="cpu")[None, :] < lengths[:, None])


def _counted_queries(
    real: Bool[Tensor, "batch pos"], sink_full: Bool[Tensor, "batch pos"]
) -> Bool[Tensor, "batch pos"]:
    """The query rows the ablation counts: real, not a sink, and after the row's first sink
    (`queries_after_sink` for every position of the batch at once)."""
    n_pos = sink_full.shape[1]
    position = torch.arange(n_pos, device=sink_full.device)
    first = torch.where(sink_full.any(1), sink_full.to(torch.uint8).argmax(1), n_pos + 10**6)
    return real & ~sink_full & (position[None, :] > first[:, None])


class ConeStatistics(Accumulator):
    """The per-(layer, head) sums of one streamed pass of the ablation: for each output measured
    (`"before"`: the pass's own `o_i^h`; `"after"`: the same minus the patch's share of the sink
    term, the direct effect; or the patched pass's own output), `sum_i ||o_i^h||`,
    `sum_i cos(o_i^h, u^h)`, the number of counted queries and `sum_i ||o_i^h|| / mean_j
    ||pv_j^h||`; with `need_logits`, the pass's next-token NLL sums
    (`cw_lens.data.scoring.NLL_SUMS`).

    The sums are one float64 `StackedSums` `[layer, head, statistic]` (statistics in `names`
    order: `BEFORE` and/or `AFTER`), added once per layer and batch (the blocks of query rows
    are summed in float32 first); `nll` is a `StackedSums` of shape `()`. Both keep each
    document's own sums with `n_documents`. The sink ablation's clean pass is one
    (`SinkAblationAccumulator`); the patched pass of `effect="total"` another.

    Args:
        plan: The patched heads of each patched layer (`{layer: [heads]}`); every head of those
            layers is summed.
        n_heads: Query heads per layer.
        sinks: The sink positions.
        outputs: The outputs measured, `("before",)`, `("before", "after")` (the direct
            effect) or `("after",)` (this pass's own output counted as "after": a patched run).
        need_logits: Also sum the pass's next-token NLL.
        scale: The patch's `lambda` (for the direct "after").
        mode: `"scale"` or `"norm_matched"` (for the direct "after").
        n_documents: Keep each document's sums (`None`: no record).
        device: Where the sums live.

    Examples:
        >>> import cw_lens
        >>> from cw_lens.analyses.sinks.detection import SinkSpec
        >>> from cw_lens.data.streaming import stream_corpus
        >>> model = cw_lens.load_model("testing:tiny-llama")
        >>> acc = ConeStatistics({1: [0, 1]}, model.cfg.n_heads, SinkSpec((0,)), ("before",))
        >>> _ = stream_corpus(model, ["One text here.", "Another one."], [acc])
        >>> acc.sums.total.shape  # [patched layer, head, (norm, cone, count, rel_norm)]
        torch.Size([1, 4, 4])
    """

    name = "ablation_cone"

    def __init__(
        self,
        plan: dict[int, list[int]],
        n_heads: int,
        sinks: SinkSpec,
        outputs: Sequence[str],
        *,
        need_logits: bool = False,
        scale: float = 0.0,
        mode: str = "scale",
        n_documents: int | None = None,
        device: torch.device | str = "cpu",
    ) -> None:
        self.plan, self.sinks, self.outputs = plan, sinks, tuple(outputs)
        if self.outputs not in (("before",), ("before", "after"), ("after",)):
            raise InputError(f"outputs must be before, before and after, or after: {outputs}.")
        self.layers = sorted(plan)
        self.need_logits = need_logits
        self.scale, self.mode = scale, mode
        self.direct = self.outputs == ("before", "after")
        self.position = {layer: i for i, layer in enumerate(self.layers)}
        self.names = [n for out in self.outputs for n in (BEFORE if out == "before" else AFTER)]
        shape = (len(self.layers), n_heads)
        self.sums = StackedSums(self.names, shape, n_documents=n_documents, device=device)
        self.nll = nll_sums(n_documents, device) if need_logits else None
        with torch.inference_mode(False):
            patched = torch.zeros(shape, dtype=torch.float32, device="cpu")
            for i, layer in enumerate(self.layers):
                patched[i, plan[layer]] = 1.0
            self.patched = patched.to(device)  # [layer, head]: 1 at the patched heads
        self._batch: dict[str, Any] = {}
        self._layer: dict[str, Any] = {}

    def _per_batch(self, block: LayerContributionsResult) -> dict[str, Any]:
        """What every layer of a document batch shares: the sink mask and columns (built on
        the host: no device sync), the weights of the means over real non-sink keys and the
        counted queries of each row."""
        if self._batch.get("batch") is not block.batch:
            batch, real = block.batch, block.acts.mask
            mask = _sink_mask(self.sinks, batch)
            cols = mask.any(0).nonzero().flatten().tolist()
            sink_full = mask.to(real.device)
            tail = (real & ~sink_full).to(block.acts.values.dtype)
            c0 = cols[0] if cols else 0
            self._batch = {
                "batch": batch,
                "sink_full": sink_full,
                "n_pos": batch.tokens.shape[1],
                # the sink columns: a range (narrowed) or an index
                "cols": (c0, len(cols))
                if cols == list(range(c0, c0 + len(cols)))
                else torch.tensor(cols, dtype=torch.long, device="cpu").to(real.device),
                "sink_weight": sink_full[:, cols].to(tail.dtype)[:, None, :, None],
                "tail_weight": tail / tail.sum(1, keepdim=True).clamp_min(1),  # [b, pos]
                "counted": _counted_queries(real, sink_full)[:, :, None, None],  # [b, pos, 1, 1]
                "documents": document_rows(batch.documents, real.device),
            }
        return self._batch

    def _per_layer(self, block: LayerContributionsResult) -> dict[str, Any]:
        """What every block of a layer shares: the cone axis (as `G u` and `u G u`), the mean
        projected value norm, and for the direct effect the patch's share of each sink value."""
        if self._layer.get("batch") is block.batch and self._layer.get("layer") == block.layer:
            return self._layer
        acts, batch = block.acts, self._per_batch(block)
        n_batch, n_heads = acts.values.shape[0], acts.n_heads
        axis = _mean_value(acts.values, batch["tail_weight"], n_heads)  # [b, h, d]: u^h
        axis_gram = torch.einsum("bhd,hde->bhe", axis, acts.weights.gram)
        axis_sq = (axis_gram * axis).sum(-1)  # [b, h]
        norms = block.layer_projected_value_norm  # [b, h, pos], once per layer
        mean_pv = (norms * batch["tail_weight"][:, None]).sum(-1)  # [b, h]
        shape = (n_batch, 1, n_heads, 1)  # broadcast against [b, q, h, t]
        shared: dict[str, Any] = {
            "batch": block.batch,
            "layer": block.layer,
            "axis_gram": axis_gram.view(*shape, -1),
            "axis_sq": axis_sq.view(shape),
            "inv_mean_pv": mean_pv.clamp_min(1e-30).reciprocal().view(shape),
            "counted": batch["counted"] & (axis_sq > 0).view(shape),  # [b, pos, h, 1]
        }
        if self.direct:
            factor = sink_scale(self.mode, self.scale, norms, batch["sink_full"], acts.mask)
            factor = factor * self.patched[self.position[block.layer]]  # [b, h]
            cols = batch["cols"]
            sinks = (
                acts.values.narrow(1, *cols)
                if isinstance(cols, tuple)
                else acts.values.index_select(1, cols)
            )
            per_head = geo.values_per_head(sinks, n_heads).double()  # [b, h, s, d]
            share = per_head * (batch["sink_weight"] * factor[:, :, None, None]).double()
            # float64: in a head that reads almost only the sink, o - share cancels nearly all
            # of o, and float32 rounding of o's size would swamp what is left
            shared["removed"] = share.unsqueeze(2)  # [b, h, 1, s, d]
        self._layer = shared
        return shared

    def update(self, block: LayerContributionsResult) -> None:
        """Sum one block's statistics over its queries; one `add` per layer and batch.

        Args:
            block: One layer's block of query rows.
        """
        shared, batch = self._per_layer(block), self._batch
        first, rows = block.queries.start, block.queries.stop - block.queries.start
        z = block.acts.z.narrow(1, first, rows)  # [b, q, h, d]
        if self.direct:
            pattern = block.acts.pattern.narrow(2, first, rows)  # [b, h, q, key]
            cols = batch["cols"]
            alpha = (
                pattern.narrow(3, *cols)
                if isinstance(cols, tuple)
                else pattern.index_select(3, cols)
            )  # [b, h, q, s]: 0 beyond the block's keys (causal)
            removed = (alpha.double().unsqueeze(-1) * shared["removed"]).sum(3).transpose(1, 2)
            after = (z.double() - removed).to(z.dtype)  # exact to z's precision of the rest
            outputs = torch.stack([z, after], 3)  # [b, q, h, 2, d]
        else:
            outputs = z.unsqueeze(3)  # [b, q, h, 1, d]
        gram_out = torch.einsum("bqhtd,hde->bqhte", outputs, block.acts.weights.gram)
        sq = (gram_out * outputs).sum(-1)  # [b, q, h, t]: ||o||^2
        along = (outputs * shared["axis_gram"]).sum(-1)  # <o, u>
        counted = (shared["counted"].narrow(1, first, rows) & (sq > 0)).to(sq.dtype)
        norm = sq.clamp_min(0).sqrt() * counted
        cos = along * (sq * shared["axis_sq"]).clamp_min(1e-30).rsqrt() * counted
        rel = norm * shared["inv_mean_pv"]
        stats = torch.stack([norm, cos, counted, rel], -1).sum(1)  # [b, h, t, 4]
        if first == 0:
            self._layer["stats"] = stats
        else:
            self._layer["stats"] += stats
        if block.queries.stop == batch["n_pos"]:  # the layer's last block
            values = self._layer.pop("stats").flatten(2)  # [b, h, 4 t]
            self.sums.add(values, batch["documents"], at=self.position[block.layer])

    def update_logits(self, batch: Any, logits: Tensor) -> None:
        """Sum one document batch's next-token NLL (one `add`).

        Args:
            batch: The document batch.
            logits: Its logits `[batch, pos, vocab]`.
        """
        self.nll.add(nll_rows(batch, logits), document_rows(batch.documents, logits.device))

    def finish(self, stats: Any) -> ConeStatistics:
        """Move the sums to the host (once).

        Args:
            stats: The pass's `StreamStats` (unused).

        Returns:
            This accumulator, its sums on the host.
        """
        self.sums.to_host()
        if self.nll is not None:
            self.nll.to_host()
        self._batch, self._layer = {}, {}
        return self
