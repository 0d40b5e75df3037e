"""The semantic cone of the sink ablation ([`sink_ablation`][cw_lens.sink_ablation]): each head's
cone axis, its output norms and cone alignment, and the streamed accumulator that sums them per
head before and after the sink's projected value is scaled (docs/methods.md#sinks).

The accumulator also scores the clean pass's next-token NLL from its logits, so the clean
activations and the clean perplexity come from one forward pass. What it sums stays on the
model's device during the pass and reaches the host once, after it (`to_host`).
"""

from __future__ import annotations

from typing import Any

import torch
from jaxtyping import Bool, Float
from torch import Tensor

from cw_lens.analyses.sinks.detection import SinkSpec, queries_after_sink
from cw_lens.core import geometry as geo
from cw_lens.core.accumulate import ExactSums, PerDocument
from cw_lens.data.inputs import TokenBatch
from cw_lens.data.scoring import NLLResult
from cw_lens.models.capture import LayerActivations
from cw_lens.models.interventions import sink_scale
from cw_lens.models.layer_contributions import LayerContributionsResult

# the ablation's per-document record (per patched layer and head)
ABLATION_SUMS = ("cone_before", "count_before", "cone_after", "count_after", "rel_norm")


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
    per_head = geo.values_per_head(acts.values, acts.n_heads)  # [b, h, pos, d]
    return (per_head * tail[:, None, :, None]).sum(2) / tail.sum(1)[:, None, None].clamp_min(1)


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


class _AblationAccumulator:
    """Per head: output norm and semantic-cone alignment before and after removing the sink
    (and, given `nll`, the pass's next-token NLL)."""

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
        nll: NLLResult | None = None,
    ) -> None:
        """The accumulator of one streamed run of the ablation.

        Args:
            plan: The patched heads of each patched layer.
            n_heads: Query heads per layer.
            sinks: The sink positions.
            scale: The patch's `lambda`.
            mode: `"scale"` or `"norm_matched"`.
            run_tag: What the streamed run measures ("before" = clean, "after" = patched).
            direct_after: Also record the exact direct effect of the patch on the clean run.
            n_documents: Also keep each document's sums (for bootstrap intervals).
            nll: The NLL sums the pass's logits go into (`update_logits`).
        """
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
        self.nll = nll

    def merge(self, other: _AblationAccumulator) -> None:
        self.sums.merge(other.sums)
        if self.per_doc is not None:
            self.per_doc.merge(other.per_doc)
        if self.nll is not None:
            self.nll.merge(other.nll)

    def to_host(self) -> None:
        """After a pass: what was accumulated on the model's device, to the host (once)."""
        for part in (self.sums, self.per_doc, self.nll):
            if part is not None:
                part.to_host()
        self.__dict__.pop("_per_layer", None)

    def update_logits(self, batch: TokenBatch, logits: Tensor) -> None:
        if self.nll is not None:
            self.nll.add_batch(batch, logits)

    def _layer(self, lc: LayerContributionsResult) -> dict[str, Any]:
        """What every block of a layer shares (the sink mask and columns, the cone axis, the
        mean projected value norm, the patch's factor), once per layer and batch."""
        cached = self.__dict__.get("_per_layer")
        if cached is not None and cached["batch"] is lc.batch and cached["layer"] == lc.layer:
            return cached
        acts, device = lc.acts, lc.acts.pattern.device
        sink_full = self.sinks.mask(lc.batch, device)
        tail = (acts.mask & ~sink_full).to(acts.values.dtype)
        norms = lc.layer_projected_value_norm  # [b, h, pos], once per layer
        cached = {
            "batch": lc.batch,
            "layer": lc.layer,
            "sink_full": sink_full,
            "cols": sink_full.any(0).nonzero().flatten(),  # ascending
            "axis": cone_axis(acts, sink_full),  # [b, h, d]
            "mean_pv": (norms * tail[:, None]).sum(-1) / tail.sum(1)[:, None].clamp_min(1),
        }
        if self.direct_after:
            factor = sink_scale(self.mode, self.scale, norms, sink_full, acts.mask)  # [b, h]
            heads = torch.zeros(self.n_heads, dtype=torch.bool, device=device)
            heads[self.plan[lc.layer]] = True
            cached["factor"] = torch.where(heads[None], factor, torch.zeros_like(factor))
        cached["host_cols"] = cached["cols"].tolist()
        self._per_layer = cached
        return cached

    def update(self, lc: LayerContributionsResult) -> None:
        if lc.layer not in self.plan:
            return
        acts, docs, layer = lc.acts, lc.batch.documents, lc.layer
        shared = self._layer(lc)
        sink_full, gram, mean_pv = shared["sink_full"], acts.weights.gram, shared["mean_pv"]
        q, n_keys = lc.queries, lc.keys.stop
        valid = queries_after_sink(lc, sink_full)
        z = acts.z[:, q]
        axis = shared["axis"][:, None].expand(-1, z.shape[1], -1, -1)  # [b, q, h, d]
        sums = self._record(self.run_tag, z, axis, gram, valid, mean_pv)
        if self.direct_after:
            cols = shared["cols"][: sum(c < n_keys for c in shared["host_cols"])]
            st = geo.sink_term(lc.attention, acts.values[:, :n_keys], sink_full[:, :n_keys], cols)
            st = st.masked_fill(sink_full[:, q][:, :, None, None], 0.0)
            after = z - shared["factor"][:, None, :, None] * st
            sums += self._record("after", after, axis, gram, valid, mean_pv)
        self.sums.add_many(docs, [(f"{name}@{layer}", rows) for name, rows in sums])
        if self.per_doc is not None:
            kept = [(name, rows) for name, rows in sums if name in ABLATION_SUMS]
            self.per_doc.add_many(docs, kept, at=self.pos[layer])

    def _record(
        self, tag: str, z: Tensor, axis: Tensor, gram: Tensor, valid: Tensor, mean_pv: Tensor
    ) -> list[tuple[str, Tensor]]:
        """Per document and head: the sums of `||o_i^h||` and its cone alignment over the valid
        queries, their count and (before) the relative output norm."""
        norm, cos, defined = norm_and_cone(z, axis, gram)
        ok = valid[:, None, :] & defined
        sums = [
            (f"norm_{tag}", torch.where(ok, norm, 0.0).sum(-1)),
            (f"cone_{tag}", torch.where(ok, cos, 0.0).sum(-1)),
            (f"count_{tag}", ok.sum(-1)),
        ]
        if tag == "before":
            relative = norm / mean_pv[..., None].clamp_min(1e-30)
            sums.append(("rel_norm", torch.where(ok, relative, 0.0).sum(-1)))
        return sums
