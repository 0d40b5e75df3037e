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

The definition as plain tensor code, which materialises every `alpha pv` vector and is what this
fast path is tested against, is [`cw_lens.reference`][cw_lens.reference].

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

Each entry point's docstring has a runnable example. The result's memory check and the stream
consumers that fill it are in `cw_lens.analyses.contributions.filling`, the checks of a cache in
`cw_lens.analyses.contributions.cache_checks`, the result's tables in
`cw_lens.analyses.contributions.tables`.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Annotated, Any

import pandas as pd
import torch
from jaxtyping import Bool, Float, Float32, Int
from torch import Tensor

from cw_lens.analyses.contributions.cache_checks import activations_from_cache
from cw_lens.analyses.contributions.filling import (
    FillerAndOnBlock,
    ResultFiller,
    check_result_memory,
)
from cw_lens.analyses.contributions.tables import long_table, top_table
from cw_lens.core.deprecation import keyword_only
from cw_lens.core.errors import InputError
from cw_lens.core.keywords import check_keywords
from cw_lens.core.registry import saveable
from cw_lens.core.results import Result, check_batch_row, resolve_row
from cw_lens.core.schema import Axes, Count, MaskedRows
from cw_lens.data.inputs import TokenBatch, prepare_inputs
from cw_lens.data.streaming import stream_contributions
from cw_lens.models.access import Model, model_device, resolve_heads, resolve_layers
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

    equal_axes = (("pos", "query", "key"),)  # the query and key axes are the positions

    attention: Float32[Tensor, "batch layer head query key"]
    cosine: Float32[Tensor, "batch layer head query key"]
    projected_value_norm: Float32[Tensor, "batch layer head key"]
    output_norm: Float32[Tensor, "batch layer head query"]
    head_output_norm: Float32[Tensor, "batch layer head query"]
    tokens: Int[Tensor, "batch pos"]
    mask: Bool[Tensor, "batch pos"]
    str_tokens: Annotated[list[list[str]], Axes("batch"), MaskedRows("mask")]
    layers: Annotated[list[int], Axes("layer")]
    heads: Annotated[list[int], Axes("head")]
    kind: Kind
    prepend_bos: bool
    bos_token: str | None
    n_nan_rows: Annotated[int, Count()] = 0
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
        return long_table(self, b_idx, l_idx, h_idx, query)

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
        return top_table(
            self, scores, layers, heads, batch, q, k, by, absolute=absolute, sum_heads=sum_heads
        )

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


@check_keywords
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
            [`LayerContributionsResult`][cw_lens.LayerContributionsResult] (inside the pass); a
            block it keeps stays valid (it owns its fields, as with the default of
            [`stream_contributions`][cw_lens.stream_contributions]).
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
    filler = ResultFiller(
        batch.tokens.shape[0], batch.tokens.shape[1], layer_list, len(head_list), kind, device
    )
    stats = stream_contributions(
        model,
        batch.tokens,
        filler
        if on_block is None
        else FillerAndOnBlock(filler, on_block, block_layers is not None, extra),
        layers=sorted(set(layer_list) | set(extra)),
        heads=None if len(head_list) == model.cfg.n_heads else head_list,
        query_chunk=query_chunk,
        batch_size=batch_size,
        attention_mask=batch.mask.long(),  # always: a text may contain the pad token itself
        count_nan=(kind,),
        on_logits=on_logits,
        progress=False,
        reuse_buffers=True,  # views for the filler; on_block gets copies (FillerAndOnBlock)
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


@check_keywords
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
