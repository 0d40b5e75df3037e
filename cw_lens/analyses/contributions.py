r"""Contribution weights (P1): how much each token really moves a head's or a layer's output.

For query `i`, key `j` and head `h` of one layer (docs/methods.md#contribution-weights;
Cunningham & Muca Cirone,
"Contribution Weights: A Geometrical Analysis of Self-Attention Transformers", ICML 2026):

    intra  c[i,j]^h = < alpha[i,j]^h pv_j^h , o_i^h > / ||o_i^h||^2
                    = alpha[i,j]^h * ( ||pv_j^h|| / ||o_i^h|| ) * cos(pv_j^h, o_i^h)
    inter  C[i,j]^h = < alpha[i,j]^h pv_j^h , o_i > / ||o_i||^2

with `pv_j^h = v_j W_O^h` the projected value, `o_i^h` the head output and `o_i = sum_h o_i^h`
the layer output (`b_O` excluded). `sum_j c[i,j]^h = 1` and `sum_h sum_j C[i,j]^h = 1`;
weights can be negative (destructive interference) and exceed 1. Baselines
(docs/methods.md#contribution-weights): `attention` = alpha, `value_norm` = alpha ||pv_j||
(Kobayashi et al. 2020), `value_norm_output` = alpha ||pv_j|| / ||o_i^h||.

Conventions: keys after the query (`j > i`) are 0 in every field; query rows at padding are
NaN (at `j <= i`); a query whose output norm is numerically zero (below `1e-6` of the largest
projected-value norm among its keys) has undefined weights — NaN — and is counted in
`n_nan_rows` with one warning per call. A key whose
projected value is zero has cosine 0. Weights are those the model runs (raw bridge); a bridge in
compatibility mode (folded/centred weights) gives results for those weights.

Three entry points:

- [`contribution_weights`][cw_lens.contribution_weights] — a
  [`ContributionResult`][cw_lens.ContributionResult] `[batch, layer, head, query, key]` for a few
  texts;
- [`contribution_weights_from_cache`][cw_lens.contribution_weights_from_cache] — from an
  `ActivationCache` you already have;
- [`stream_contributions`][cw_lens.stream_contributions] — the streaming form every corpus analysis
  uses: a callback gets one [`LayerContributionsResult`][cw_lens.LayerContributionsResult] (one
  layer, one block of query rows) at a time, inside the forward pass, so memory stays flat in
  depth and corpus size.

Each entry point's docstring has a runnable example.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import numpy as np
import pandas as pd
import torch
from jaxtyping import Bool, Float, Int
from torch import Tensor

from cw_lens.core.deprecation import keyword_only
from cw_lens.core.errors import InputError
from cw_lens.core.memory import check_memory, pair_field_bytes
from cw_lens.core.registry import saveable
from cw_lens.core.results import Result, check_batch_row, resolve_row
from cw_lens.data.inputs import TokenBatch, prepare_inputs
from cw_lens.data.streaming import stream_contributions
from cw_lens.models.access import (
    Model,
    hook_name,
    model_access,
    model_device,
    resolve_heads,
    resolve_layers,
)
from cw_lens.models.capture import LayerActivations, check_consistent
from cw_lens.models.layer_contributions import Kind, LayerContributionsResult, check_kind
from cw_lens.models.verify import require_verified


@saveable
@dataclass(repr=False)
class ContributionResult(Result):
    """Contribution weights and their decomposition, `[batch, layer, head, query, key]`.

    Stored: `attention`, `cosine`, `projected_value_norm` `[batch, layer, head, key]`,
    `output_norm` and `head_output_norm` `[batch, layer, head, query]`. Derived on first
    access (and cached): `weights = attention * relative_norm * cosine`, `relative_norm`,
    `value_norm`, `value_norm_output`. Positions index `tokens`; `mask` is False at
    padding (whose rows are NaN). `layers`/`heads` name the layer and head axes;
    `cw.layer(20)` is this result for layer NUMBER 20 only (the result protocol,
    [`Result`][cw_lens.Result]).
    """

    _layer_axes = tuple(
        (name, 1)
        for name in (
            "attention",
            "cosine",
            "projected_value_norm",
            "output_norm",
            "head_output_norm",
        )
    )

    attention: Float[Tensor, "batch layer head query key"]
    cosine: Float[Tensor, "batch layer head query key"]
    projected_value_norm: Float[Tensor, "batch layer head key"]
    output_norm: Float[Tensor, "batch layer head query"]
    head_output_norm: Float[Tensor, "batch layer head query"]
    tokens: Int[Tensor, "batch pos"]
    mask: Bool[Tensor, "batch pos"]
    str_tokens: list[list[str]]
    layers: list[int]
    heads: list[int]
    kind: str
    prepend_bos: bool
    bos_token: str | None
    n_nan_rows: int = 0
    model_name: str = ""

    # ----------------------------------------------------------------- derived fields
    def _per_pair(self, key_norm: Tensor, query_norm: Tensor) -> Tensor:
        """`key_norm[j] / query_norm[i]` with the result conventions: 0 for `j > i`; NaN at
        `j <= i` for padded query rows and rows whose norm is NaN (zero-norm rows)."""
        n = self.tokens.shape[1]
        causal = torch.ones(n, n, dtype=torch.bool, device=key_norm.device).tril()
        padded = ~self.mask[:, None, None, :].to(key_norm.device)
        query_norm = query_norm.masked_fill(padded, math.nan)
        ratio = key_norm.nan_to_num(0.0)[..., None, :] / query_norm[..., :, None]
        return torch.where(causal, ratio, torch.zeros((), device=ratio.device))

    @cached_property
    def relative_norm(self) -> Float[Tensor, "batch layer head query key"]:
        """`||pv_j|| / ||o_i||` (the norm `kind` refers to)."""
        return self._per_pair(self.projected_value_norm, self.output_norm)

    @cached_property
    def weights(self) -> Float[Tensor, "batch layer head query key"]:
        """Contribution weights: `attention * relative_norm * cosine`."""
        return self.attention * self.relative_norm * self.cosine

    @cached_property
    def value_norm(self) -> Float[Tensor, "batch layer head query key"]:
        """Baseline `alpha ||pv_j||`."""
        return self.attention * self.projected_value_norm.nan_to_num(0.0)[..., None, :]

    @cached_property
    def value_norm_output(self) -> Float[Tensor, "batch layer head query key"]:
        """Baseline `alpha ||pv_j|| / ||o_i^h||` (NaN rows where `||o_i^h||` is zero)."""
        return self.attention * self._per_pair(self.projected_value_norm, self.head_output_norm)

    # ----------------------------------------------------------------- helpers
    FIELDS = ("attention", "relative_norm", "cosine", "weights", "value_norm", "value_norm_output")

    def _layer_index(self, layer: int) -> int:
        if layer not in self.layers:
            raise InputError(f"Layer {layer} is not in this result (layers {self.layers}).")
        return self.layers.index(layer)

    def _head_index(self, head: int) -> int:
        if head not in self.heads:
            raise InputError(f"Head {head} is not in this result (heads {self.heads}).")
        return self.heads.index(head)

    def _batch_index(self, batch: int) -> int:
        return check_batch_row(self.mask, batch)

    def last_position(self, batch: int = 0) -> int:
        """The position of the last real (not padding) token of row `batch`.

        Args:
            batch: The row of the batch.

        Returns:
            The position, counted from 0 (BOS included when it was prepended).

        Examples:
            ```python
            import cw_lens

            model = cw_lens.load_model("testing:tiny-llama")
            cw = cw_lens.contribution_weights(model, "The cat sat on the mat.")
            cw.last_position()  # the query that top() reads by default
            ```
        """
        return int(self.mask[batch].sum()) - 1

    def to_dataframe(
        self,
        *,
        batch: int | None = None,
        layer: int | None = None,
        head: int | None = None,
        query: int | None = None,
    ) -> pd.DataFrame:
        """Long format: one row per (batch, layer, head, query, key) with `key <= query`.

        Filter with the keyword arguments to keep the frame small.

        Args:
            batch: Keep this row of the batch only (`None` = all).
            layer: Keep this layer NUMBER only (`None` = all).
            head: Keep this head only (`None` = all).
            query: Keep this query position only (`None` = all).

        Returns:
            A DataFrame with the columns `batch, layer, head, query, key, query_token,
            key_token` and every field (`attention, relative_norm, cosine, weights, value_norm,
            value_norm_output`).

        Examples:
            ```python
            import cw_lens

            model = cw_lens.load_model("testing:tiny-llama")
            cw = cw_lens.contribution_weights(model, "The cat sat on the mat.")
            cw.to_dataframe(layer=0, head=0).head()
            ```
        """
        b_idx = range(self.tokens.shape[0]) if batch is None else [self._batch_index(batch)]
        l_idx = range(len(self.layers)) if layer is None else [self._layer_index(layer)]
        h_idx = range(len(self.heads)) if head is None else [self._head_index(head)]
        frames = []
        fields = {name: getattr(self, name) for name in self.FIELDS}
        for b in b_idx:
            n = int(self.mask[b].sum())
            q_idx = np.arange(n) if query is None else np.array([query])
            qq, kk = np.meshgrid(q_idx, np.arange(n), indexing="ij")
            keep = kk <= qq
            qq, kk = qq[keep], kk[keep]
            for li in l_idx:
                for hi in h_idx:
                    data = {
                        "batch": b,
                        "layer": self.layers[li],
                        "head": self.heads[hi],
                        "query": qq,
                        "key": kk,
                        "query_token": np.array(self.str_tokens[b], dtype=object)[qq],
                        "key_token": np.array(self.str_tokens[b], dtype=object)[kk],
                    }
                    for name, t in fields.items():
                        data[name] = t[b, li, hi].detach().cpu().numpy()[qq, kk]
                    frames.append(pd.DataFrame(data))
        return pd.concat(frames, ignore_index=True)

    def top(
        self,
        k: int = 10,
        *,
        query: int | None = None,
        batch: int = 0,
        layer: int | None = None,
        head: int | None = None,
        by: str = "weights",
        absolute: bool = False,
        sum_heads: bool = False,
    ) -> pd.DataFrame:
        """The `k` largest entries for one query.

        Args:
            k: How many entries.
            query: The query position (default: the last real token; negative counts from the end
                of the row's real tokens).
            batch: The row of the batch.
            layer: Keep this layer NUMBER only (`None` = all).
            head: Keep this head only (`None` = all).
            by: Field to rank by (any of `FIELDS`).
            absolute: Rank by magnitude (negative weights count too).
            sum_heads: Sum over heads first — one score per (layer, key); with `kind="inter"`
                this is the token's share of the layer output.

        Returns:
            A DataFrame with `layer, head, key, <by>, key_token, query`, largest first (no `head`
            column with `sum_heads`).

        Examples:
            ```python
            import cw_lens

            model = cw_lens.load_model("testing:tiny-llama")
            cw = cw_lens.contribution_weights(model, "The cat sat on the mat.")
            cw.top(k=5)  # the (layer, head, key) triples that move the last token most
            cw.top(k=3, by="attention", layer=1)
            ```
        """
        if by not in self.FIELDS:
            raise InputError(f"by must be one of {self.FIELDS}, got {by!r}.")
        batch, q = resolve_row(self.mask, batch, query)
        if sum_heads and self.kind == "intra" and by == "weights":
            warnings.warn(
                "sum_heads=True adds intra-head weights, each relative to its own head's output; "
                "the sum is not a share of anything. Use kind='inter' for a token's share of "
                "the layer output.",
                UserWarning,
                stacklevel=2,
            )
        scores = getattr(self, by)[batch, :, :, q, : q + 1]  # [layer, head, key]
        layers = list(range(len(self.layers))) if layer is None else [self._layer_index(layer)]
        heads = list(range(len(self.heads))) if head is None else [self._head_index(head)]
        scores = scores[layers][:, heads]
        rows = []
        if sum_heads:
            summed = scores.nansum(1)
            for li, lay in enumerate(layers):
                for key in range(q + 1):
                    rows.append((self.layers[lay], None, key, float(summed[li, key])))
        else:
            for li, lay in enumerate(layers):
                for hi, hd in enumerate(heads):
                    for key in range(q + 1):
                        rows.append(
                            (self.layers[lay], self.heads[hd], key, float(scores[li, hi, key]))
                        )
        df = pd.DataFrame(rows, columns=["layer", "head", "key", by])
        df["key_token"] = [self.str_tokens[batch][key] for key in df["key"]]
        df["query"] = q
        order = df[by].abs() if absolute else df[by]
        df = df.loc[order.sort_values(ascending=False, na_position="last").index].head(k)
        if sum_heads:
            df = df.drop(columns="head")
        return df.reset_index(drop=True)

    def plot(
        self, layer: int | None = None, head: int = 0, *, batch: int = 0, **kwargs: Any
    ) -> Any:
        """Attention next to contribution weights for one head (P1, Fig. 1).

        Args:
            layer: The layer NUMBER (default: the first layer of the result).
            head: The head.
            batch: The row of the batch.
            **kwargs: Passed to `cw_lens.plots.plot_attention_vs_contribution` (`figsize`).

        Returns:
            A matplotlib Figure.

        Examples:
            ```python
            import cw_lens

            model = cw_lens.load_model("testing:tiny-llama")
            cw = cw_lens.contribution_weights(model, "The cat sat on the mat.")
            fig = cw.plot(layer=1, head=0)
            ```
        """
        from cw_lens.plots import plot_attention_vs_contribution

        layer = self.layers[0] if layer is None else layer
        self._layer_index(layer)
        self._head_index(head)
        self._batch_index(batch)
        return plot_attention_vs_contribution(self, layer=layer, head=head, batch=batch, **kwargs)

    def show(self, **kwargs: Any) -> Any:
        """The interactive token view in Jupyter (tokens coloured by contribution).

        Args:
            **kwargs: `height` (pixels) and the options of
                [`to_html`][cw_lens.ContributionResult.to_html] (`batch`, `layer`, `head`, `query`,
                `title`, ...).

        Returns:
            An IPython display object (the page in an iframe); Jupyter shows it when it is the
            cell's value.

        Examples:
            ```python
            import cw_lens

            model = cw_lens.load_model("testing:tiny-llama")
            cw = cw_lens.contribution_weights(model, "The cat sat on the mat.")
            view = cw.show()  # the last expression of a notebook cell displays it
            ```
        """
        from cw_lens.viz import show_contributions

        return show_contributions(self, **kwargs)

    def to_html(self, path: Any = None, **kwargs: Any) -> str:
        """A self-contained HTML view of this result (it opens from disk, no server).

        Args:
            path: Write the page to this file when given.
            **kwargs: `batch`, `layer`, `head`, `query`, `title`, `layers`, `heads` and `max_mb`
                (the size limit of the page) of `cw_lens.viz.contributions_html`.

        Returns:
            The page, as a string.

        Examples:
            ```python
            import cw_lens

            model = cw_lens.load_model("testing:tiny-llama")
            cw = cw_lens.contribution_weights(model, "The cat sat on the mat.")
            html = cw.to_html("contributions.html")
            ```
        """
        from cw_lens.viz import contributions_html

        html = contributions_html(self, **kwargs)
        if path is not None:
            from pathlib import Path

            Path(path).write_text(html, encoding="utf-8")
        return html


class _ResultFiller:
    """Consumer that writes each streamed block into preallocated result tensors."""

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
        """NaN for query rows at padding (also beyond each sub-batch's trimmed width)."""
        for b, n in enumerate(lengths):
            for stored in (self.attention, self.cosine):
                rows = stored[b, :, :, n:, :]  # queries n.. : NaN at keys j <= i, 0 after
                rows.fill_(math.nan)
                rows.tril_(diagonal=n)
            self.pv_norm[b, :, :, n:] = math.nan


class _Both:
    """The result filler (its layers) and a user's `on_block` (its own layers, or all)."""

    def __init__(
        self, filler: _ResultFiller, on_block: Callable, restrict: bool, layers: list[int]
    ) -> None:
        self.filler, self.on_block, self.restrict, self.layers = filler, on_block, restrict, layers

    def __call__(self, lc: LayerContributionsResult) -> None:
        if lc.layer in self.filler.layer_pos:
            self.filler(lc)
        if not self.restrict or lc.layer in self.layers:
            self.on_block(lc)


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


def contribution_weights(
    model: Model,
    inputs: Any,
    *,
    layers: int | Sequence[int] | None = None,
    heads: int | Sequence[int] | None = None,
    kind: Kind = "intra",
    query_chunk: int | None = None,
    prepend_bos: bool = True,
    attention_mask: Tensor | None = None,
    batch_size: int | None = 8,
    on_logits: Callable[[TokenBatch, Tensor], None] | None = None,
    on_block: Callable[[LayerContributionsResult], None] | None = None,
    block_layers: int | Sequence[int] | None = None,
    memory_budget: float | str | None = None,
) -> ContributionResult:
    """Contribution weights of every (layer, head, query, key) for a few texts.

    Args:
        model: A TransformerLens model ([`cw_lens.load_model`][cw_lens.load_model]).
        inputs: A string, a list of strings (right-padded batch; padding is excluded and marked
            NaN), or token ids `[batch, pos]` (with `attention_mask` when padded).
        layers: Layers (`None` = all; negative indices allowed).
        heads: Query heads (`None` = all; negative indices count from the end, as for
            `layers`: `-1` is the last head).
        kind: `"intra"` projects on the head output `o_i^h`; `"inter"` on the layer
            output `o_i`.
        query_chunk: Query rows per block (`None` = automatic from a memory budget).
        prepend_bos: Prepend BOS to text (position 0 is then BOS, the usual sink).
        attention_mask: For token tensors with padding.
        batch_size: Texts per forward pass.
        on_logits: If given, the pass runs to the end and this gets `(batch, logits)` of
            the same pass (one forward pass for weights and predictions).
        on_block: If given, also called with every streamed
            [`LayerContributionsResult`][cw_lens.LayerContributionsResult] (inside the pass; see
            [`stream_contributions`][cw_lens.stream_contributions] for the lifetime rules).
        block_layers: The layers whose blocks go to `on_block` (default: `layers`); those
            not in `layers` are streamed for `on_block` only, not stored in the result.
        memory_budget: Bytes the result may take, fields derived on access included (`8e9`,
            `"8GB"`, `"none"`; default `$CW_LENS_MEMORY_BUDGET`, else half the memory available
            on the model's device: `cw_lens.core.memory`). Over it,
            [`MemoryBudgetError`][cw_lens.MemoryBudgetError] is raised before any forward pass.

    Returns:
        A [`ContributionResult`][cw_lens.ContributionResult]. It holds `2 x batch x layers x heads
        x pos^2` floats; for corpora use [`stream_contributions`][cw_lens.stream_contributions] or
        the corpus analyses.

    Examples:
        ```python
        import cw_lens

        model = cw_lens.load_model("testing:tiny-llama")  # or cw_lens.load_model(): SmolLM2-135M
        cw = cw_lens.contribution_weights(model, "The cat sat on the mat.", kind="inter")
        cw.weights.shape                 # [batch, layer, head, query, key]
        cw.top(k=5, sum_heads=True)      # the tokens with the largest share of each layer's output
        fig = cw.plot(layer=1, head=0)   # attention next to contribution (P1, Fig. 1)
        ```
    """
    # Long: argument checks and the per-layer loop that fills the result; the math is in
    # LayerContributionsResult.
    check_kind(kind)
    batch = prepare_inputs(model, inputs, prepend_bos=prepend_bos, attention_mask=attention_mask)
    layer_list = resolve_layers(model, layers)
    head_list = resolve_heads(model, heads)
    check_result_memory(model, batch, len(layer_list), len(head_list), memory_budget)
    require_verified(model)
    extra = (
        [] if block_layers is None or not len(block_layers) else resolve_layers(model, block_layers)
    )
    if extra and on_block is None:
        raise InputError("block_layers needs on_block (the function that gets those blocks).")
    device = model_device(model)
    filler = _ResultFiller(
        batch.tokens.shape[0], batch.tokens.shape[1], layer_list, len(head_list), kind, device
    )
    stats = stream_contributions(
        model,
        batch.tokens,
        filler if on_block is None else _Both(filler, on_block, block_layers is not None, extra),
        layers=sorted(set(layer_list) | set(extra)),
        heads=None if len(head_list) == model.cfg.n_heads else head_list,
        query_chunk=query_chunk,
        batch_size=batch_size,
        attention_mask=batch.mask.long(),  # always: a text may contain the pad token itself
        count_nan=(kind,),
        on_logits=on_logits,
        progress=False,
    )
    filler.mark_padding(batch.lengths.tolist())
    return ContributionResult(
        attention=filler.attention,
        cosine=filler.cosine,
        projected_value_norm=filler.pv_norm,
        output_norm=filler.out_norm,
        head_output_norm=filler.head_norm,
        tokens=batch.tokens,
        mask=batch.mask,
        str_tokens=batch.str_tokens(model),
        layers=layer_list,
        heads=head_list,
        kind=kind,
        prepend_bos=batch.prepend_bos,
        bos_token=batch.bos_token,
        n_nan_rows=stats.n_nan_rows[kind],
        model_name=str(getattr(model.cfg, "model_name", "")),
    )


@keyword_only("layer")
def contribution_weights_from_cache(
    cache: Any,
    model: Model,
    *,
    layer: int,
    kind: Kind = "intra",
    heads: int | Sequence[int] | None = None,
    tokens: Tensor | None = None,
    attention_mask: Tensor | None = None,
) -> ContributionResult:
    """Contribution weights of one layer from an `ActivationCache` you already have.

    The cache needs `blocks.{layer}.attn.hook_pattern`, `hook_v` and `hook_z` (a plain
    `model.run_with_cache(tokens)` has them; to keep it small use
    `names_filter=cw_lens.cache_names(layer)`). The layer output is `sum_h z^h W_O^h`; the
    cache is checked (`z == pattern @ v`) before any number is computed.

    Args:
        cache: An `ActivationCache` (or a dict) with the classic hook names.
        model: The model the cache came from (for `W_O` and `b_O`).
        layer: The layer to analyse.
        kind: `"intra"` or `"inter"`.
        heads: Query heads (`None` = all; negative indices count from the end, as for
            `layers`: `-1` is the last head).
        tokens: The token ids the cache was computed on (for token strings); optional.
        attention_mask: 1 at real tokens when the cached batch was padded (right padding).

    Returns:
        A [`ContributionResult`][cw_lens.ContributionResult] of the one layer.

    Examples:
        ```python
        import cw_lens

        model = cw_lens.load_model("testing:tiny-llama")
        tokens = model.to_tokens("The cat sat on the mat.")
        _, cache = model.run_with_cache(tokens, names_filter=cw_lens.cache_names(1))
        cw = cw_lens.contribution_weights_from_cache(cache, model, layer=1, tokens=tokens)
        cw.top(k=3)
        ```
    """
    check_kind(kind)
    require_verified(model)
    (layer,) = resolve_layers(model, layer)
    head_list = resolve_heads(model, heads)
    acts = activations_from_cache(cache, model, layer, tokens=tokens, attention_mask=attention_mask)
    lc = LayerContributionsResult(acts, None if len(head_list) == model.cfg.n_heads else head_list)
    n_nan = lc.n_zero_rows(kind)
    if n_nan:
        warnings.warn(
            f"{n_nan} (head, query) rows have a numerically zero output norm; their weights "
            "are NaN.",
            RuntimeWarning,
            stacklevel=2,
        )
    out_norm = lc.output_norm(kind).masked_fill(lc.zero_rows(kind), math.nan)
    batch = acts.batch
    return ContributionResult(
        attention=lc.masked_attention()[:, None],
        cosine=lc.cosine(kind)[:, None],
        projected_value_norm=lc.projected_value_norm[:, None],
        output_norm=out_norm[:, None],
        head_output_norm=lc.head_output_norm[:, None],
        tokens=batch.tokens,
        mask=batch.mask,
        str_tokens=batch.str_tokens(model)
        if tokens is not None
        else [[str(i) for i in range(int(n))] for n in batch.lengths],
        layers=[layer],
        heads=head_list,
        kind=kind,
        prepend_bos=batch.prepend_bos,
        bos_token=batch.bos_token,
        n_nan_rows=n_nan,
        model_name=str(getattr(model.cfg, "model_name", "")),
    )


def activations_from_cache(
    cache: Any,
    model: Any,
    layer: int,
    *,
    tokens: Tensor | None = None,
    attention_mask: Tensor | None = None,
) -> LayerActivations:
    """Build checked `LayerActivations` for one layer from a cache."""
    # Long: one look-up and one shape check per cached tensor, in the order LayerActivations holds
    # them.
    names = {kind: hook_name(kind, layer) for kind in ("pattern", "values", "z")}
    got = {}
    for kind, name in names.items():
        try:
            got[kind] = cache[name]
        except (KeyError, IndexError):
            got[kind] = None
        if got[kind] is None:
            raise InputError(
                f"The cache has no {name!r}. Cache layer {layer} with "
                f"model.run_with_cache(tokens, names_filter=cw_lens.cache_names({layer}))."
            )
    pattern, values, z = (got[k].detach() for k in names)
    access = model_access(model)
    n_heads, n_kv, d_head = access.n_heads, access.n_kv_heads, access.d_head
    if pattern.ndim == 3:  # run_with_cache(remove_batch_dim=True)
        pattern, values, z = (t[None] for t in (pattern, values, z))
    expected = {
        "pattern": (n_heads, None, None),
        "values": (None, n_kv, d_head),
        "z": (None, n_heads, d_head),
    }
    for kind, t in (("pattern", pattern), ("values", values), ("z", z)):
        if tuple(t.shape[1:]) != tuple(
            s if s is not None else t.shape[1 + i] for i, s in enumerate(expected[kind])
        ):
            raise InputError(
                f"The cache's {names[kind]} has shape {tuple(t.shape)}, which does not fit this "
                f"model ({n_heads} heads, {n_kv} kv heads, d_head {d_head}): the cache "
                "comes from another model."
            )
    n_pos = pattern.shape[-1]
    for kind, t in (("values", values), ("z", z)):
        if t.shape[1] != n_pos:
            raise InputError(
                f"The cache's {names[kind]} has {t.shape[1]} positions, the "
                f"pattern {n_pos}: the hooks come from different runs."
            )
    for kind, t in (("pattern", pattern), ("values", values), ("z", z)):
        if not bool(torch.isfinite(t).all()):
            raise InputError(
                f"The cache's {names[kind]} contains NaN or inf; contribution weights of "
                "non-finite activations are meaningless. Check the model run (dtype overflow?)."
            )
    device = pattern.device
    w = access.output_weights(layer).to(device)
    n_batch = pattern.shape[0]
    if attention_mask is None:
        mask = torch.ones(n_batch, n_pos, dtype=torch.bool, device=device)
    else:
        mask = torch.as_tensor(attention_mask, device=device).bool().reshape(n_batch, n_pos)
    check_consistent(access, layer, pattern, values, z, mask)
    if tokens is None:
        token_ids = torch.zeros(n_batch, n_pos, dtype=torch.long, device="cpu")
    else:
        token_ids = torch.as_tensor(tokens, device="cpu").reshape(n_batch, n_pos).cpu()
    bos_id = getattr(model.tokenizer, "bos_token_id", None) if model.tokenizer else None
    batch = TokenBatch(
        token_ids,
        mask.cpu(),
        bool(tokens is not None and bos_id is not None and (token_ids[:, 0] == bos_id).all()),
        getattr(model.tokenizer, "bos_token", None) if model.tokenizer else None,
        list(range(n_batch)),
    )
    return LayerActivations(
        layer=layer,
        pattern=pattern.float(),
        values=values.float(),
        z=z.float(),
        layer_output=w.layer_output(z),
        weights=w,
        mask=mask,
        batch=batch,
    )
