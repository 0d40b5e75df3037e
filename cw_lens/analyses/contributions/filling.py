"""How [`contribution_weights`][cw_lens.contribution_weights] builds its
[`ContributionResult`][cw_lens.ContributionResult]: the memory check of the result's dense fields
before any pass, and the stream consumers that write each block into them.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from cw_lens.core.memory import check_memory, pair_field_bytes
from cw_lens.data.inputs import TokenBatch
from cw_lens.models.access import Model, model_device
from cw_lens.models.layer_contributions import Kind, LayerContributionsResult


class ResultFiller:
    """Consumer that writes each streamed block into preallocated result tensors.

    Args:
        n_docs: Rows of the batch.
        n_pos: Positions of the batch (its padded width).
        layers: The layers kept, in the order of the layer axis.
        heads: Heads kept per layer.
        kind: `"intra"` or `"inter"` (the output the cosines and norms refer to).
        device: Where the tensors are allocated.
    """

    def __init__(
        self,
        n_docs: int,
        n_pos: int,
        layers: list[int],
        heads: int,
        kind: Kind,
        device: torch.device,
    ) -> None:
        shape = (n_docs, len(layers), heads, n_pos, n_pos)
        self.kind = kind
        self.layer_pos = {layer: i for i, layer in enumerate(layers)}
        # written block by block (keys past each block's last row are zeroed then), so the
        # big tensors are touched once instead of being zero-filled first
        self.attention = torch.empty(shape, device=device)
        self.cosine = torch.empty(shape, device=device)
        self.pv_norm = torch.full((*shape[:3], n_pos), math.nan, device=device)
        self.out_norm = torch.full(shape[:4], math.nan, device=device)
        self.head_norm = torch.full(shape[:4], math.nan, device=device)

    def __call__(self, lc: LayerContributionsResult) -> None:
        """Write one block into the result tensors (it may be a view: nothing is kept).

        Args:
            lc: A block of one of `layers`.
        """
        li = self.layer_pos[lc.layer]
        q, k = lc.queries, lc.keys
        docs = lc.batch.documents
        if docs == list(range(self.attention.shape[0])):
            docs = slice(None)  # the common case: plain slicing, no gather
        else:
            docs = torch.tensor(docs, device=self.attention.device)
        self.attention[docs, li, :, q, k] = lc.masked_attention()
        self.cosine[docs, li, :, q, k] = lc.cosine(self.kind)
        self.attention[docs, li, :, q, k.stop :] = 0.0
        self.cosine[docs, li, :, q, k.stop :] = 0.0
        self.pv_norm[docs, li, :, k] = lc.projected_value_norm
        out = lc.output_norm(self.kind).masked_fill(lc.zero_rows(self.kind), math.nan)
        self.out_norm[docs, li, :, q] = out
        self.head_norm[docs, li, :, q] = lc.head_output_norm.masked_fill(
            lc.zero_rows("intra"), math.nan
        )

    def mark_padding(self, lengths: list[int]) -> None:
        """NaN for query rows at padding (also beyond each sub-batch's trimmed width).

        Args:
            lengths: The real (not padding) tokens of each row.
        """
        for b, n in enumerate(lengths):
            for stored in (self.attention, self.cosine):
                rows = stored[b, :, :, n:, :]  # queries n.. : NaN at keys j <= i, 0 after
                rows.fill_(math.nan)
                rows.tril_(diagonal=n)
            self.pv_norm[b, :, :, n:] = math.nan


class FillerAndOnBlock:
    """The result filler (its layers) and a user's `on_block` (its own layers, or all).

    The stream hands this consumer views (no allocation per block for the filler); `on_block`
    gets each block's [`detach_copy`][cw_lens.LayerContributionsResult.detach_copy] (nothing
    cloned: it computes what it is asked for in tensors of its own), which stays valid after the
    call, as a block handed to a user's function must.

    Args:
        filler: The result filler.
        on_block: The user's function.
        restrict: Give `on_block` only the blocks of `layers` (else every block).
        layers: The layers whose blocks `on_block` gets when `restrict`.
    """

    def __init__(
        self, filler: ResultFiller, on_block: Callable, restrict: bool, layers: list[int]
    ) -> None:
        self.filler, self.on_block, self.restrict, self.layers = filler, on_block, restrict, layers

    def __call__(self, lc: LayerContributionsResult) -> None:
        """Fill the result with the block, then hand `on_block` a copy it may keep.

        Args:
            lc: A streamed block (a view, valid during this call).
        """
        if lc.layer in self.filler.layer_pos:
            self.filler(lc)
        if not self.restrict or lc.layer in self.layers:
            self.on_block(lc.detach_copy())


# the result's [batch, layer, head, query, key] fields: attention and cosine stored, then
# relative_norm, weights, value_norm and value_norm_output derived on access; three norms per row
RESULT_PAIR_FIELDS, RESULT_ROW_FIELDS = 6, 3


def check_result_memory(
    model: Model,
    batch: TokenBatch,
    n_layers: int,
    n_heads: int,
    budget: float | str | None,
    *,
    copies: int = 1,
) -> None:
    """Raise [`MemoryBudgetError`][cw_lens.MemoryBudgetError] before any pass when `copies`
    [`ContributionResult`][cw_lens.ContributionResult]s of this size exceed the budget.

    Args:
        model: The model (its device decides which memory is available).
        batch: The tokens the result will cover.
        n_layers: Layers kept in the result.
        n_heads: Heads kept per layer.
        budget: Bytes, a string such as `"8GB"` or `"50%"`, or None for the default (see
            [`memory_budget`][cw_lens.core.memory.memory_budget]).
        copies: How many results of this size the caller holds at once.
    """
    n_batch, n_pos = batch.tokens.shape
    size = pair_field_bytes(
        n_batch,
        n_layers,
        n_heads,
        n_pos,
        pair_fields=RESULT_PAIR_FIELDS,
        row_fields=RESULT_ROW_FIELDS,
    )
    runs = f" x {copies} runs" if copies > 1 else ""
    check_memory(
        copies * size,
        device=model_device(model),
        budget=budget,
        what=f"contribution weights of {n_batch} texts x {n_layers} layers x {n_heads} heads x "
        f"{n_pos}² positions{runs} (with the fields derived on access)",
        ways_out=[
            "fewer layers= or heads= (the size is linear in each)",
            "fewer or shorter texts (it grows with texts x positions²)",
            "stream_contributions(model, inputs, consumer), which hands each layer's block to "
            "your function and keeps nothing",
            "the corpus analyses (sink_statistics, selection_geometry, head_taxonomy, "
            "faithfulness), whose memory is flat in the number of documents",
        ],
    )  # fmt: skip
