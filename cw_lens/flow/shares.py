r"""Residual contribution shares (docs/methods.md#flow): what each piece adds to the residual
stream.

For block `l` and position `i` the stream after the block is a sum of pieces, `x_{l+1,i} =
x_{l,i} + sum_{h,j} A_i(alpha[i,j]^h pv_j^h) + (A_i(b_O) + beta) + f_i` (`A` the identity on
pre-norm blocks, the post-attention norm linearised at its actual input on post-norm blocks;
`f_i` the MLP output, which on parallel blocks — GPT-J, GPT-NeoX — reads `x_{l,i}`: the sum
is the same). Each piece's **projection share**

    share(p) = < p , x_{l+1,i} > / ||x_{l+1,i}||^2

says how much of the stream lies along it; the shares of the residual, every (head, key) pair,
the bias and the MLP sum to 1 exactly and can be negative or exceed 1 (the projection form of
P1's contribution weights — Cunningham & Muca Cirone, ICML 2026 — applied to the residual
stream). The pair shares are computed in head space (`cw_lens.core.flow_geometry`): one
`query x key` product per head and layer, the cost of `QK^T`; no `[query, key, d_model]`
tensor is ever built.

Entry points:

- [`residual_shares`][cw_lens.residual_shares] — a
  [`ResidualSharesResult`][cw_lens.ResidualSharesResult] `[batch, layer, head, query, key]` for a
  few texts (`.to_dataframe()`, `.top()`, `.plot()`, `.token_matrix(layer)`);
- [`stream_shares`][cw_lens.stream_shares] — the streaming form: a callback gets one
  [`LayerSharesResult`][cw_lens.LayerSharesResult] (one block, one block of query rows) at a time,
  inside the forward pass (both in `cw_lens.flow.layer_shares`).

The public functions' docstrings have runnable examples.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Annotated, Any

import numpy as np
import pandas as pd
import torch
from jaxtyping import Bool, Float, Float32, Int
from torch import Tensor

from cw_lens.core import flow_geometry as fg
from cw_lens.core.errors import InputError
from cw_lens.core.keywords import check_keywords
from cw_lens.core.memory import check_memory, pair_field_bytes
from cw_lens.core.registry import saveable
from cw_lens.core.results import Result, resolve_row
from cw_lens.core.schema import Axes, MaskedRows
from cw_lens.data.inputs import prepare_inputs
from cw_lens.flow.layer_shares import LayerSharesResult, stream_shares
from cw_lens.models.access import Model, model_device
from cw_lens.models.capture import resolve_layers
from cw_lens.models.verify import require_flow

PIECES = ("residual", "attention", "bias", "mlp")


# ---------------------------------------------------------------------------- the result


@saveable
@dataclass(repr=False)
class ResidualSharesResult(Result):
    """Residual contribution shares of a few texts.

    `pairs` `[batch, layer, head, query, key]` (0 for `j > i`), and per position
    `residual`, `attention` (the sum of the pairs), `bias`, `mlp` `[batch, layer,
    query]`. `residual + attention + bias + mlp == 1` at every real (layer, position); rows
    at padding are NaN. `layers` names the layer axis; `shares.layer(20)` is this result
    for layer NUMBER 20 only.
    """

    _layer_axes = tuple((name, 1) for name in ("pairs", "residual", "attention", "bias", "mlp"))

    equal_axes = (("pos", "query", "key"),)  # the query and key axes are the positions

    pairs: Float32[Tensor, "batch layer head query key"]
    residual: Float32[Tensor, "batch layer query"]
    attention: Float32[Tensor, "batch layer query"]
    bias: Float32[Tensor, "batch layer query"]
    mlp: Float32[Tensor, "batch layer query"]
    tokens: Int[Tensor, "batch pos"]
    mask: Bool[Tensor, "batch pos"]
    str_tokens: Annotated[list[list[str]], Axes("batch"), MaskedRows("mask")]
    layers: Annotated[list[int], Axes("layer")]
    model_name: str = ""

    def total(self) -> Float[Tensor, "batch layer query"]:
        """The sum of all shares (1 up to float rounding).

        Returns:
            A tensor `[batch, layer, query]`.

        Examples:
            ```python
            import cw_lens

            model = cw_lens.load_model("testing:tiny-llama")
            shares = cw_lens.residual_shares(model, "The cat sat on the mat.")
            shares.total()
            ```
        """
        return self.residual + self.attention + self.bias + self.mlp

    def _layer_index(self, layer: int) -> int:
        if layer not in self.layers:
            raise InputError(f"Layer {layer} is not in this result (layers {self.layers}).")
        return self.layers.index(layer)

    def _row(self, batch: int, query: int | None) -> tuple[int, int]:
        return resolve_row(self.mask, batch, query)

    def token_matrix(self, layer: int) -> Float[Tensor, "batch query key"]:
        """The token-level matrix `T_l` of methods § Contribution flow (docs/methods.md#flow).

        Args:
            layer: The layer NUMBER.

        Returns:
            A tensor `[batch, query, key]` whose rows sum to 1.

        Examples:
            ```python
            import cw_lens

            model = cw_lens.load_model("testing:tiny-llama")
            shares = cw_lens.residual_shares(model, "The cat sat on the mat.")
            shares.token_matrix(1).shape
            ```
        """
        li = self._layer_index(layer)
        rows = self.pairs[:, li].sum(1)
        self_share = self.residual[:, li] + self.bias[:, li] + self.mlp[:, li]
        return fg.token_matrix(rows, self_share)

    def to_dataframe(
        self, *, batch: int = 0, layer: int | None = None, query: int | None = None
    ) -> pd.DataFrame:
        """Long format, one row per piece of the residual stream.

        Args:
            batch: The row of the batch.
            layer: Keep this layer NUMBER only (`None` = all).
            query: Keep this query only (`None` = all).

        Returns:
            A DataFrame with `batch, layer, query, piece, head, key, share` (`head`/`key` are -1
            for the per-position pieces; pairs with `key <= query`).

        Examples:
            ```python
            import cw_lens

            model = cw_lens.load_model("testing:tiny-llama")
            shares = cw_lens.residual_shares(model, "The cat sat on the mat.")
            shares.to_dataframe(layer=1, query=-1).head()
            ```
        """
        n = int(self.mask[self._row(batch, 0)[0]].sum())
        queries = range(n) if query is None else [self._row(batch, query)[1]]
        layer_idx = range(len(self.layers)) if layer is None else [self._layer_index(layer)]
        toks = np.array(self.str_tokens[batch], dtype=object)
        frames = []
        for li in layer_idx:
            pairs = self.pairs[batch, li].detach().cpu().numpy()
            for q in queries:
                heads, keys = np.meshgrid(
                    np.arange(pairs.shape[0]), np.arange(q + 1), indexing="ij"
                )
                heads, keys = heads.ravel(), keys.ravel()
                pieces = [
                    getattr(self, p)[batch, li, q].item() for p in ("residual", "bias", "mlp")
                ]
                frames.append(
                    pd.DataFrame(
                        {
                            "piece": ["residual", "bias", "mlp"] + ["pair"] * heads.size,
                            "head": np.r_[[-1, -1, -1], heads],
                            "key": np.r_[[-1, -1, -1], keys],
                            "share": np.r_[pieces, pairs[heads, q, keys]],
                        }
                    ).assign(layer=self.layers[li], query=q)
                )
        df = pd.concat(frames, ignore_index=True)
        df["batch"] = batch
        df["query_token"] = toks[df["query"].to_numpy()]
        df["key_token"] = [toks[k] if k >= 0 else "" for k in df["key"]]
        cols = ["batch", "layer", "query", "query_token", "piece", "head", "key", "key_token"]
        return df[[*cols, "share"]]

    def top(
        self, k: int = 10, *, query: int | None = None, batch: int = 0, absolute: bool = False
    ) -> pd.DataFrame:
        """The `k` largest (head, key) pair shares of one query.

        Args:
            k: How many pairs.
            query: The query position (default: the last real token).
            batch: The row of the batch.
            absolute: Rank by magnitude (negative shares count too).

        Returns:
            A DataFrame of `k` rows, largest first.

        Examples:
            ```python
            import cw_lens

            model = cw_lens.load_model("testing:tiny-llama")
            shares = cw_lens.residual_shares(model, "The cat sat on the mat.")
            shares.top(k=5)
            ```
        """
        df = self.to_dataframe(batch=batch, query=self._row(batch, query)[1])
        df = df[df["piece"] == "pair"]
        order = df["share"].abs() if absolute else df["share"]
        return df.loc[order.sort_values(ascending=False).index].head(k).reset_index(drop=True)

    def plot(self, *, query: int | None = None, batch: int = 0, **kwargs: Any) -> Any:
        """Residual / attention / MLP / bias share per layer for one query.

        Args:
            query: The query position (default: the last real token).
            batch: The row of the batch.
            **kwargs: Passed to `cw_lens.plots.flow.plot_residual_shares` (`figsize`).

        Returns:
            A matplotlib Figure.

        Examples:
            ```python
            import cw_lens

            model = cw_lens.load_model("testing:tiny-llama")
            shares = cw_lens.residual_shares(model, "The cat sat on the mat.")
            fig = shares.plot()
            ```
        """
        from cw_lens.plots import plot_residual_shares

        _, q = self._row(batch, query)
        return plot_residual_shares(self, query=q, batch=batch, **kwargs)


class _SharesFiller:
    """Consumer writing each streamed block into preallocated result tensors."""

    def __init__(self, n_docs: int, n_pos: int, n_heads: int, layers: list[int], device) -> None:
        self.layer_pos = {layer: i for i, layer in enumerate(layers)}
        self.pairs = torch.zeros(n_docs, len(layers), n_heads, n_pos, n_pos, device=device)
        self.pieces = {
            p: torch.full((n_docs, len(layers), n_pos), math.nan, device=device) for p in PIECES
        }

    def __call__(self, ls: LayerSharesResult) -> None:
        li = self.layer_pos[ls.layer]
        docs = torch.tensor(ls.batch.documents, device=self.pairs.device)
        q, k = ls.queries, ls.keys
        self.pairs[docs, li, :, q, k] = ls.pairs()
        for p in PIECES:
            self.pieces[p][docs, li, q] = getattr(ls, p)


@check_keywords
def residual_shares(
    model: Model,
    inputs: Any,
    *,
    layers: int | Sequence[int] | None = None,
    query_chunk: int | None = None,
    prepend_bos: bool = True,
    attention_mask: Tensor | None = None,
    batch_size: int | None = 8,
    memory_budget: float | str | None = None,
) -> ResidualSharesResult:
    """Residual contribution shares of every (layer, head, query, key) for a few texts.

    Args:
        model: A `TransformerBridge` (`cw_lens.load_model()`).
        inputs: A string, a list of strings (right-padded; padding rows are NaN), or token ids.
        layers: Blocks (`None` = all; negative indices allowed).
        query_chunk: Query rows per streamed block (`None`: automatic).
        prepend_bos: Prepend BOS to text.
        attention_mask: For token tensors with padding.
        batch_size: Texts per forward pass.
        memory_budget: Bytes the result may take (`8e9`, `"8GB"`, `"none"`; default
            `$CW_LENS_MEMORY_BUDGET`, else half the memory available on the model's device:
            `cw_lens.core.memory`). Over it, [`MemoryBudgetError`][cw_lens.MemoryBudgetError]
            is raised before any forward pass.

    Returns:
        A [`ResidualSharesResult`][cw_lens.ResidualSharesResult] (`batch x layers x heads x pos^2`
        floats; for corpora use [`stream_shares`][cw_lens.stream_shares]).

    Raises:
        UnsupportedModelError: when a block's hooks do not add up (see
            `cw_lens.models.blocks`).

    Examples:
        ```python
        import cw_lens

        model = cw_lens.load_model("testing:tiny-llama")
        shares = cw_lens.residual_shares(model, "The cat sat on the mat.")
        shares.top(k=5)     # the (head, key) pairs that write most of the last position
        fig = shares.plot()
        ```
    """
    batch = prepare_inputs(model, inputs, prepend_bos=prepend_bos, attention_mask=attention_mask)
    layer_list = resolve_layers(model, layers)
    n_docs, n_pos = batch.tokens.shape
    n_heads = model.cfg.n_heads
    check_memory(
        pair_field_bytes(n_docs, len(layer_list), n_heads, n_pos, pair_fields=1)
        + 4 * n_docs * len(layer_list) * n_pos * len(PIECES),
        device=model_device(model),
        budget=memory_budget,
        what=f"residual shares of {n_docs} texts x {len(layer_list)} layers x {n_heads} heads x "
        f"{n_pos}² positions",
        ways_out=[
            "fewer layers= (the size is linear in them)",
            "fewer or shorter texts (it grows with texts x positions²)",
            "stream_shares(model, inputs, consumer), which hands each layer's shares to your "
            "function and keeps nothing",
        ],
    )
    require_flow(model)
    filler = _SharesFiller(n_docs, n_pos, model.cfg.n_heads, layer_list, model_device(model))
    stream_shares(
        model,
        batch.tokens,
        filler,
        layers=layer_list,
        query_chunk=query_chunk,
        batch_size=batch_size,
        attention_mask=batch.mask.long(),
        progress=False,
        reuse_buffers=True,  # reduced inside the call
    )
    n_nan = int((filler.pieces["residual"].isnan() & batch.mask[:, None, :]).sum())
    if n_nan:
        warnings.warn(
            f"{n_nan} (layer, position) rows have a zero residual stream; their shares are NaN.",
            RuntimeWarning,
            stacklevel=2,
        )
    return ResidualSharesResult(
        pairs=filler.pairs,
        **filler.pieces,
        tokens=batch.tokens,
        mask=batch.mask,
        str_tokens=batch.str_tokens(model),
        layers=layer_list,
        model_name=str(getattr(model.cfg, "model_name", "")),
    )
