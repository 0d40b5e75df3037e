r"""Contribution rollout and attention rollout: each position's final stream, by input token.

Per block `l` the token-level share matrix (docs/methods.md#flow, `cw_lens.flow.shares`)

    T_l[i, j] = sum_h share(h, j)                                        (j != i)
    T_l[i, i] = sum_h share(h, i) + share(residual) + share(MLP) + share(bias)

has rows that sum to 1 (the pieces that live on the token itself stay on its diagonal). The
**contribution rollout** `R = T_{L-1} ... T_1 T_0` gives `R[i, j]`, the share of position
`i`'s final residual stream (before the final norm) attributed to input token `j`; rows sum
to 1. The **attention rollout** baseline (Abnar & Zuidema 2020, "Quantifying Attention Flow in
Transformers") composes `S_l = 0.5 * mean_h alpha_l + 0.5 I`, each row re-normalised to sum
to 1 (on models whose attention rows sum to less than 1, such as GPT-OSS with its learned sink
logits, `S_l` alone would not), the same way; its rows sum to 1 too. Both treat the per-layer
matrices as linear mixing of token streams — a heuristic (shares of a non-linear network do not
compose exactly), documented as such; [`cw_lens.rollout_deletion`][cw_lens.rollout_deletion] tests
which ranking is more faithful to the model.

Cost: the shares of every block (about the cost of `QK^T` per layer, see
`benchmarks/bench_flow.py`) plus one `pos x pos` matrix product per layer and document
(`O(L pos^3)`; at 512 tokens about a tenth of the forward pass).

The public functions' docstrings have runnable examples.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Annotated, Any

import numpy as np
import pandas as pd
import torch
from jaxtyping import Bool, Float, Float32, Int
from torch import Tensor

from cw_lens.core import flow_geometry as fg
from cw_lens.core.deprecation import deprecated
from cw_lens.core.errors import InputError
from cw_lens.core.keywords import check_keywords
from cw_lens.core.registry import saveable
from cw_lens.core.results import Result, resolve_row
from cw_lens.core.schema import Axes, MaskedRows
from cw_lens.data.inputs import TokenBatch, iter_batches, prepare_inputs
from cw_lens.flow.shares import LayerSharesResult, stream_shares
from cw_lens.models.access import Model
from cw_lens.models.capture import LayerActivations, run_layers
from cw_lens.models.verify import require_flow, require_verified

METHODS = ("contribution", "attention")


@saveable
@dataclass(repr=False)
class RolloutResult(Result):
    """Contribution and attention rollout of a few texts, `[batch, query, key]`.

    `contribution[b, i, j]`: share of position `i`'s final stream from input token `j`
    (`None` in the result of [`attention_rollout`][cw_lens.attention_rollout]); `attention`: the
    attention-rollout baseline. Rows sum to 1; 0 for `j > i`; NaN rows at padding. `matrix`: the
    rollout the result was computed for (`contribution`, or `attention` for
    [`attention_rollout`][cw_lens.attention_rollout]).
    """

    equal_axes = (("pos", "query", "key"),)  # the query and key axes are the positions

    contribution: Float32[Tensor, "batch query key"] | None
    attention: Float32[Tensor, "batch query key"]
    tokens: Int[Tensor, "batch pos"]
    mask: Bool[Tensor, "batch pos"]
    str_tokens: Annotated[list[list[str]], Axes("batch"), MaskedRows("mask")]
    model_name: str = ""

    @property
    def methods(self) -> tuple[str, ...]:
        """The rollouts this result holds: `("contribution", "attention")` or
        `("attention",)`."""
        return METHODS if self.contribution is not None else ("attention",)

    @property
    def matrix(self) -> Float[Tensor, "batch query key"]:
        """The rollout this result was computed for (`contribution`, else `attention`)."""
        return getattr(self, self.methods[0])

    # attention_rollout returned a bare tensor in 0.2: indexing, .shape and torch functions
    # still act on `matrix`, with a DeprecationWarning
    def __getitem__(self, index: Any) -> Tensor:
        deprecated("indexing a RolloutResult like a tensor; use result.matrix[...]")
        return self.matrix[index]

    @property
    def shape(self) -> torch.Size:
        deprecated("RolloutResult.shape; use result.matrix.shape")
        return self.matrix.shape

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        deprecated(f"torch.{func.__name__} on a RolloutResult; pass result.matrix")
        swap = lambda a: a.matrix if isinstance(a, RolloutResult) else a  # noqa: E731
        return func(*map(swap, args), **{k: swap(v) for k, v in (kwargs or {}).items()})

    def _row(self, batch: int, query: int | None) -> tuple[int, int]:
        return resolve_row(self.mask, batch, query)

    def to_dataframe(self, *, batch: int = 0, query: int | None = None) -> pd.DataFrame:
        """One row per (query, key `<= query`): `contribution` and `attention` rollout.

        Args:
            batch: The row of the batch.
            query: Keep this query only (`None` = all).

        Returns:
            A DataFrame with `query, key, key_token` and one column per method.

        Examples:
            ```python
            import cw_lens

            model = cw_lens.load_model("testing:tiny-llama")
            rollout = cw_lens.contribution_rollout(model, "The cat sat on the mat.")
            rollout.to_dataframe(query=-1)
            ```
        """
        self._row(batch, 0)
        n = int(self.mask[batch].sum())
        queries = np.arange(n) if query is None else np.array([self._row(batch, query)[1]])
        qq, kk = np.meshgrid(queries, np.arange(n), indexing="ij")
        keep = kk <= qq
        qq, kk = qq[keep], kk[keep]
        toks = np.array(self.str_tokens[batch], dtype=object)
        data = {
            "batch": batch,
            "query": qq,
            "key": kk,
            "query_token": toks[qq],
            "key_token": toks[kk],
        }
        for m in self.methods:
            data[m] = getattr(self, m)[batch].detach().cpu().numpy()[qq, kk]
        return pd.DataFrame(data)

    def top(
        self, k: int = 10, *, query: int | None = None, batch: int = 0, by: str | None = None
    ) -> pd.DataFrame:
        """The `k` input tokens with the largest rollout for one query.

        Args:
            k: How many tokens.
            query: The query position (default: the last real token).
            batch: The row of the batch.
            by: One of `methods` (default: the first).

        Returns:
            A DataFrame of `k` rows, largest first.

        Examples:
            ```python
            import cw_lens

            model = cw_lens.load_model("testing:tiny-llama")
            rollout = cw_lens.contribution_rollout(model, "The cat sat on the mat.")
            rollout.top(k=3)
            rollout.top(k=3, by="attention")
            ```
        """
        by = self.methods[0] if by is None else by
        if by not in self.methods:
            raise InputError(f"by must be one of {self.methods}, got {by!r}.")
        df = self.to_dataframe(batch=batch, query=self._row(batch, query)[1])
        return df.sort_values(by, ascending=False).head(k).reset_index(drop=True)

    def plot(self, *, batch: int = 0, query: int | None = None, **kwargs: Any) -> Any:
        """Contribution rollout next to attention rollout (matrices and one query's row).

        Args:
            batch: The row of the batch.
            query: The query whose row is drawn (default: the last real token).
            **kwargs: Passed to `cw_lens.plots.flow.plot_rollout` (`figsize`).

        Returns:
            A matplotlib Figure.

        Examples:
            ```python
            import cw_lens

            model = cw_lens.load_model("testing:tiny-llama")
            rollout = cw_lens.contribution_rollout(model, "The cat sat on the mat.")
            fig = rollout.plot()
            ```
        """
        from cw_lens.plots import plot_rollout

        if self.contribution is None:
            raise InputError(
                "This result holds the attention rollout alone; the figure compares it with the "
                "contribution rollout: use cw_lens.contribution_rollout(model, text).plot()."
            )
        batch, q = self._row(batch, query)
        return plot_rollout(self, batch=batch, query=q, **kwargs)


class RolloutAccumulator:
    """Consumer of [`stream_shares`][cw_lens.stream_shares] that composes both rollouts.

    Fill the blocks of every layer in order; after a document batch, `finish` returns
    `(contribution, attention)` `[batch, pos, pos]` and resets.
    """

    def __init__(self, n_layers: int) -> None:
        self.n_layers = n_layers
        self._reset()

    def _reset(self) -> None:
        self.contribution: Tensor | None = None
        self.attention: Tensor | None = None
        self._rows: Tensor | None = None
        self._seen: list[int] = []

    def __call__(self, ls: LayerSharesResult) -> None:
        if ls.queries.start == 0:
            n_batch, n_pos = ls.block.resid_post.shape[:2]
            self._rows = torch.zeros(n_batch, n_pos, n_pos, device=ls.block.resid_post.device)
        self._rows[:, ls.queries, ls.keys] = ls.token_rows()
        if ls.is_last_block:
            self._compose(ls.layer, self._rows, ls.block.acts.pattern.float())

    def _compose(self, layer: int, step: Tensor, pattern: Tensor) -> None:
        expected = len(self._seen)
        if layer != expected:
            raise InputError(
                f"Rollout needs every layer from 0 in order; got layer {layer} after {self._seen}."
            )
        self._seen.append(layer)
        # padded rows (never read by real rows: padding is at the end) stay finite
        self.contribution = fg.compose(self.contribution, step.nan_to_num(0.0))
        self.attention = fg.compose(self.attention, fg.attention_rollout_step(pattern))

    def finish(self, mask: Tensor) -> tuple[Tensor, Tensor]:
        if len(self._seen) != self.n_layers:
            raise InputError(f"Rollout saw layers {self._seen} of {self.n_layers}.")
        out = [_mark_padding(r, mask) for r in (self.contribution, self.attention)]
        self._reset()
        return out[0], out[1]


def rollout_batches(
    model: Any,
    batch: TokenBatch,
    batch_size: int | None,
    *,
    need_logits: bool = False,
    query_chunk: int | None = None,
):
    """Yield `(sub_batch, contribution, attention, logits)` per document batch (`logits`
    is `None` unless `need_logits`)."""
    acc = RolloutAccumulator(model.cfg.n_layers)
    got: dict[str, Tensor] = {}
    for sub in iter_batches(batch, batch_size):

        def keep(b: TokenBatch, logits: Tensor) -> None:
            got["logits"] = logits

        stream_shares(
            model,
            sub.tokens,
            acc,
            attention_mask=sub.mask.long(),
            batch_size=None,
            on_logits=keep if need_logits else None,
            query_chunk=query_chunk,
            progress=False,
            reuse_buffers=True,  # reduced inside the call
        )
        contribution, attention = acc.finish(sub.mask)
        yield sub, contribution, attention, got.pop("logits", None)


@check_keywords
def contribution_rollout(
    model: Model,
    inputs: Any,
    *,
    prepend_bos: bool = True,
    attention_mask: Tensor | None = None,
    batch_size: int | None = 8,
    query_chunk: int | None = None,
) -> RolloutResult:
    """Contribution rollout (and the attention-rollout baseline) of a few texts.

    Args:
        model: A `TransformerBridge`.
        inputs: A string, a list of strings, token ids (a tensor `[pos]` or `[batch, pos]`, or a
            list of token-id lists, read as given) or a [`Corpus`][cw_lens.Corpus].
        prepend_bos: Prepend BOS to text.
        attention_mask: For token tensors with padding.
        batch_size: Texts per forward pass.
        query_chunk: Query rows per streamed block (`None`: automatic).

    Returns:
        A [`RolloutResult`][cw_lens.RolloutResult] with `contribution` and `attention` `[batch, pos,
        pos]`.

    Examples:
        ```python
        import cw_lens

        model = cw_lens.load_model("testing:tiny-llama")
        rollout = cw_lens.contribution_rollout(model, "The cat sat on the mat.")
        rollout.top(k=3)   # the input tokens the last position draws on most
        ```
    """
    require_flow(model)
    batch = prepare_inputs(model, inputs, prepend_bos=prepend_bos, attention_mask=attention_mask)
    n_docs, n_pos = batch.tokens.shape
    out = {m: torch.full((n_docs, n_pos, n_pos), math.nan, device="cpu") for m in METHODS}
    for sub, contribution, attention, _ in rollout_batches(
        model, batch, batch_size, query_chunk=query_chunk
    ):
        width = sub.tokens.shape[1]
        docs = torch.tensor(sub.documents, device="cpu")
        out["contribution"][docs, :width, :width] = contribution.cpu()
        out["attention"][docs, :width, :width] = attention.cpu()
    for m in METHODS:
        out[m] = _mark_padding(out[m], batch.mask)
    return RolloutResult(
        contribution=out["contribution"],
        attention=out["attention"],
        tokens=batch.tokens,
        mask=batch.mask,
        str_tokens=batch.str_tokens(model),
        model_name=str(getattr(model.cfg, "model_name", "")),
    )


@check_keywords
def attention_rollout(
    model: Model,
    inputs: Any,
    *,
    prepend_bos: bool = True,
    attention_mask: Tensor | None = None,
    batch_size: int | None = 8,
) -> RolloutResult:
    """Attention rollout alone (Abnar & Zuidema 2020): `S_{L-1} ... S_0` with `S_l = 0.5
    mean_h alpha_l + 0.5 I`, each row divided by its sum.

    Returns a [`RolloutResult`][cw_lens.RolloutResult] whose `attention` (= `matrix`) is `[batch,
    pos, pos]` (rows sum to 1, also where attention rows do not; NaN rows at padding) and
    `contribution` is None. Reads only the attention
    patterns, so it costs a forward pass; [`contribution_rollout`][cw_lens.contribution_rollout]
    returns it too.

    Args:
        model: A TransformerLens model.
        inputs: A string, a list of strings, token ids (a tensor `[pos]` or `[batch, pos]`, or a
            list of token-id lists, read as given) or a [`Corpus`][cw_lens.Corpus].
        prepend_bos: Prepend BOS to text.
        attention_mask: For token tensors with padding.
        batch_size: Texts per forward pass.

    Returns:
        A [`RolloutResult`][cw_lens.RolloutResult] whose `attention` (= `matrix`) is
        `[batch, pos, pos]` and `contribution` is None.

    Examples:
        ```python
        import cw_lens

        model = cw_lens.load_model("testing:tiny-llama")
        rollout = cw_lens.attention_rollout(model, "The cat sat on the mat.")
        rollout.top(k=3)
        ```
    """
    require_verified(model)
    batch = prepare_inputs(model, inputs, prepend_bos=prepend_bos, attention_mask=attention_mask)
    n_docs, n_pos = batch.tokens.shape
    out = torch.full((n_docs, n_pos, n_pos), math.nan, device="cpu")
    layers = list(range(model.cfg.n_layers))
    for sub in iter_batches(batch, batch_size):
        state: dict[str, Tensor] = {}

        def step(acts: LayerActivations, state: dict = state) -> None:
            state["r"] = fg.compose(state.get("r"), fg.attention_rollout_step(acts.pattern))

        run_layers(model, sub, step, layers=layers)
        width = sub.tokens.shape[1]
        out[torch.tensor(sub.documents, device="cpu"), :width, :width] = state["r"].cpu()
    return RolloutResult(
        contribution=None,
        attention=_mark_padding(out, batch.mask),
        tokens=batch.tokens,
        mask=batch.mask,
        str_tokens=batch.str_tokens(model),
        model_name=str(getattr(model.cfg, "model_name", "")),
    )


def _mark_padding(r: Tensor, mask: Tensor) -> Tensor:
    """Result convention: 0 at padded keys, NaN rows at padded queries."""
    mask = mask.to(r.device)
    return r.masked_fill(~mask[:, None, :], 0.0).masked_fill(~mask[:, :, None], math.nan)
