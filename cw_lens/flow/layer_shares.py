r"""The streaming unit of residual shares (docs/methods.md#flow): one block, one block of rows.

[`LayerSharesResult`][cw_lens.LayerSharesResult] holds the projection shares of every piece of
the residual stream after one block (or in `m_l`, the stream between its two sub-layers) for a
block of query rows, computed lazily in head space (`cw_lens.core.flow_geometry`) from the
captured `BlockActivations`; [`stream_shares`][cw_lens.stream_shares] hands one to a callback per
(document batch, layer, query block), inside the forward pass. `cw_lens.flow.shares` explains
the shares and builds the in-memory result of a few texts on this unit.

The public functions' docstrings have runnable examples.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from functools import cached_property
from typing import Any, ClassVar, Literal

import torch
from jaxtyping import Bool, Float, Int
from torch import Tensor

from cw_lens.core import flow_geometry as fg
from cw_lens.core.errors import InputError, UnsupportedModelError
from cw_lens.core.geometry import projected_value_norms
from cw_lens.core.keywords import check_keywords
from cw_lens.core.registry import saveable
from cw_lens.core.results import Result
from cw_lens.core.schema import NoValue
from cw_lens.data.inputs import TokenBatch, prepare_inputs
from cw_lens.data.streaming import StreamStats, check_query_chunk, run_batches
from cw_lens.models.access import Model
from cw_lens.models.blocks import CHECK_RTOL, BlockActivations, arch_name, run_blocks
from cw_lens.models.capture import resolve_layers
from cw_lens.models.layer_contributions import Workspace
from cw_lens.models.verify import require_flow


@saveable
class LayerSharesResult(Result):
    """Residual shares of one block for one block of query rows (the streaming unit).

    Pair tensors are `[batch, head, query, key]` over the rows `queries` and the keys
    `0 .. queries.stop - 1`; per-position pieces are `[batch, query]`. Rows at padding and
    rows whose stream norm is zero are NaN.

    Lifetime: by default ([`stream_shares`][cw_lens.stream_shares] with `reuse_buffers=False`) a
    block owns what it computes, so a block kept from the consumer stays valid after the stream
    has moved on. With `reuse_buffers=True` (what cw_lens's own flow analyses use) the block is a
    view (`is_view`): `pairs()` lives in a buffer that the next block overwrites, so the block is
    valid only during the consumer call. Reduce it there, or keep
    [`detach_copy()`][cw_lens.LayerSharesResult.detach_copy]; a view read after a later block has
    begun raises [`InputError`][cw_lens.InputError].

    `into` names the stream the shares are of: `"post"`, `x_{l+1}` (residual, pairs,
    bias and MLP sum to 1), or `"mid"`, `m_l = x_l + A(o + b_O) (+ beta)`, the stream the
    MLP of a sequential block reads (residual, pairs and bias sum to 1; the MLP share is 0) —
    the first sub-layer step of the route graph (`into_mid`).
    """

    # what a file stores: the block and its rows; never its caches, nor `_stream` (one of the
    # block's streams, set again from `into` when read)
    stored_fields: ClassVar[dict[str, Any]] = {
        "block": BlockActivations,
        "layer": int,
        "queries": slice,
        "keys": slice,
        "into": Literal["post", "mid"],
        "_shared": dict[str, NoValue],
        "_ws": Workspace,
        "_model_name": str,
        "_pairs": None,
        "_generation": int,
    }
    optional_fields: ClassVar[tuple[str, ...]] = ("_generation",)  # files of 0.4 lack it
    _generation: int = 0

    def __init__(
        self,
        block: BlockActivations,
        queries: slice,
        shared: dict[str, Any],
        workspace: Workspace,
        model_name: str = "",
        into: str = "post",
    ) -> None:
        """A block; [`stream_shares`][cw_lens.stream_shares] builds them.

        Args:
            block: The captured residual-stream activations of the block.
            queries: The query rows of the block.
            shared: Per-pass values shared by the blocks of one layer.
            workspace: The buffers the block writes its fields into.
            model_name: The model's name, for the repr.
            into: `"post"` (shares of `x_{l+1}`) or `"mid"` (shares of `m_l`).
        """
        if into not in ("post", "mid") or (into == "mid" and block.resid_mid is None):
            raise InputError(
                f"into must be 'post', or 'mid' on a sequential block; got {into!r} on a "
                f"{'sequential' if block.resid_mid is not None else 'parallel'} block."
            )
        self.block = block
        self.layer = block.layer
        self.queries = queries
        self.keys = slice(0, queries.stop)
        self.into = into
        self._stream = block.resid_post if into == "post" else block.resid_mid
        self._shared = shared
        self._ws = workspace
        self._generation = workspace.generation  # the stream begins a block before building it
        self._model_name = model_name
        self._pairs: Tensor | None = None

    def __getstate__(self) -> dict[str, Any]:
        state = {**self.__dict__, "_shared": {}, "_pairs": None}
        del state["_stream"]
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        if self.into == "mid" and self.block.resid_mid is None:
            raise InputError("A stored LayerSharesResult of into='mid' has a parallel block.")
        self._stream = self.block.resid_post if self.into == "post" else self.block.resid_mid

    @property
    def sequential(self) -> bool:
        """Whether the block's MLP reads `m_l` (False on parallel blocks: it reads `x_l`)."""
        return self.block.resid_mid is not None

    @cached_property
    def _mid(self) -> LayerSharesResult:
        mid = LayerSharesResult(
            self.block, self.queries, self._shared, self._ws, self._model_name, into="mid"
        )
        mid._generation = self._generation  # the same block's view
        return mid

    @property
    def is_view(self) -> bool:
        """True when `pairs()` lives in a buffer that later blocks reuse (`reuse_buffers=True`):
        the block is then valid only during the consumer call."""
        return self._ws.reuse

    def detach_copy(self) -> LayerSharesResult:
        """This block as one that owns its fields, valid after the consumer call returns.

        The copy reads the same activations (which the stream never reuses) and computes its
        pair shares in a tensor of its own when they are read (the same numbers); nothing is
        cloned, so a copy that is not read costs nothing. Call it inside the consumer.

        Returns:
            A [`LayerSharesResult`][cw_lens.LayerSharesResult] that is not a view.

        Examples:
            ```python
            import cw_lens

            model = cw_lens.load_model("testing:tiny-llama")
            kept = []
            cw_lens.stream_shares(
                model, "The cat sat on the mat.", lambda b: kept.append(b.detach_copy()),
                reuse_buffers=True,
            )
            kept[0].pairs().shape  # still valid after the stream
            ```
        """
        self._check_current()
        return LayerSharesResult(
            self.block,
            self.queries,
            dict(self._shared),
            Workspace(reuse=False),
            self._model_name,
            into=self.into,
        )

    def _check_current(self) -> None:
        """Raise when this is a view whose buffer a later block may have overwritten."""
        if self._ws.reuse and self._ws.generation != self._generation:
            raise InputError(
                f"This LayerSharesResult (layer {self.layer}, queries {self.queries.start}.."
                f"{self.queries.stop - 1}) is a view into a buffer that the stream reuses "
                "(reuse_buffers=True), valid only during the consumer call, and a later block "
                "has overwritten it. Keep block.detach_copy() from inside the call, or stream "
                "with reuse_buffers=False (the default)."
            )

    def into_mid(self) -> LayerSharesResult:
        """The shares of the same rows in `m_l` (sequential blocks only).

        Returns:
            A [`LayerSharesResult`][cw_lens.LayerSharesResult] whose stream is `m_l`.

        Examples:
            ```python
            import cw_lens

            model = cw_lens.load_model("testing:tiny-llama")

            def consumer(block):  # called inside the forward pass, once per block
                print(block.layer, block.into_mid().pairs().shape)

            cw_lens.stream_shares(model, "The cat sat on the mat.", consumer)
            ```
        """
        return self if self.into == "mid" else self._mid

    @property
    def batch(self) -> TokenBatch:
        return self.block.acts.batch

    @property
    def n_positions(self) -> int:
        return self.block.resid_post.shape[1]

    @property
    def is_last_block(self) -> bool:
        return self.queries.stop == self.n_positions

    @cached_property
    def query_mask(self) -> Bool[Tensor, "batch query"]:
        return self.block.acts.mask[:, self.queries]

    @cached_property
    def _map(self) -> tuple[Tensor | None, Tensor | None, bool]:
        m = self.block.attn_map
        rows = None if m.row_scale is None else m.row_scale[:, self.queries]
        return rows, m.gain, m.centred

    @cached_property
    def _read(self) -> tuple[Tensor, Tensor]:
        """`u_i` (NaN at padded and zero-norm rows) and `||y_i||^2`."""
        y = self._stream[:, self.queries]
        u, sq = fg.read_vectors(y, *self._map)
        u = u.masked_fill(~self.query_mask[..., None], math.nan)
        return u, sq

    @cached_property
    def _inv_sq(self) -> Float[Tensor, "batch query"]:
        _, sq = self._read
        inv = sq.reciprocal().masked_fill(sq <= fg.ZERO_STREAM_NORM**2, math.nan)
        return inv.masked_fill(~self.query_mask, math.nan)

    def _plain_share(self, piece: Tensor) -> Float[Tensor, "batch query"]:
        y = self._stream[:, self.queries]
        return (piece[:, self.queries] * y).sum(-1) * self._inv_sq

    @cached_property
    def _head_side(self) -> Float[Tensor, "batch query head d_head"]:
        return fg.head_read_vectors(self._read[0], self.block.acts.weights.W_O)

    # ------------------------------------------------------------------ per-position pieces
    @cached_property
    def residual(self) -> Float[Tensor, "batch query"]:
        """`share(x_{l,i})`: the stream entering the block."""
        return self._plain_share(self.block.resid_pre)

    @cached_property
    def mlp(self) -> Float[Tensor, "batch query"]:
        """`share(f_i)`: the MLP output (after any post-MLP norm); 0 in `m_l`."""
        if self.into == "mid":
            return self.residual * 0.0  # 0, NaN where the row is undefined
        return self._plain_share(self.block.mlp_out)

    @cached_property
    def mid(self) -> Float[Tensor, "batch query"]:
        """`share(m_{l,i})` in `x_{l+1,i}` (`= 1 - share(MLP)`): the residual edge of the
        second sub-layer step; NaN on parallel blocks (no `m`) and in `m` itself."""
        if self.into == "mid" or self.block.resid_mid is None:
            return self.residual * math.nan
        return self._plain_share(self.block.resid_mid)

    @cached_property
    def bias(self) -> Float[Tensor, "batch query"]:
        """`share(A_i(b_O) + beta)`: the output bias and the post-norm's bias."""
        piece = self.block.bias_piece
        if piece is None:
            return self.residual * 0.0  # 0, NaN where the row is undefined
        return self._plain_share(piece)

    @cached_property
    def attention(self) -> Float[Tensor, "batch query"]:
        """`share(A_i(o_i))` from `hook_z` (= the sum of the pair shares, checked)."""
        z = self.block.acts.z[:, self.queries]
        return (z * self._head_side).sum((-1, -2))

    @property
    def self_share(self) -> Float[Tensor, "batch query"]:
        """Residual + MLP + bias: the pieces that stay on the token (the diagonal of `T`)."""
        return self.residual + self.mlp + self.bias

    # ------------------------------------------------------------------ pairs
    @property
    def shape(self) -> tuple[int, int, int, int]:
        p = self.block.acts.pattern
        return (p.shape[0], p.shape[1], self.queries.stop - self.queries.start, self.keys.stop)

    def pairs(self) -> Float[Tensor, "batch head query key"]:
        """`share(h, j)` of every (head, key) pair; 0 for `j > i`.

        Returns:
            A tensor `[batch, head, query, key]`.

        Examples:
            ```python
            import cw_lens

            model = cw_lens.load_model("testing:tiny-llama")

            def consumer(block):  # called inside the forward pass, once per block
                print(block.layer, block.pairs().shape)

            cw_lens.stream_shares(model, "The cat sat on the mat.", consumer)
            ```
        """
        self._check_current()
        if self._pairs is None:
            acts = self.block.acts
            buf = self._ws.get(f"pairs_{self.into}", self.shape, acts.pattern.device)
            pattern = acts.pattern[:, :, self.queries, self.keys]
            self._pairs = fg.pair_shares(
                pattern, acts.values[:, self.keys], self._head_side, out=buf
            )
            self._check_pairs()
        return self._pairs

    @cached_property
    def pairs_over_heads(self) -> Float[Tensor, "batch query key"]:
        """`sum_h share(h, j)` (a fresh tensor)."""
        return self.pairs().sum(1)

    def _check_pairs(self) -> None:
        """Identity 3: the pair shares add up to the attention piece read from `hook_z`."""
        over = self.pairs_over_heads
        total = over.sum(-1)
        scale = over.abs().sum(-1) + self.attention.abs()
        err = ((total - self.attention).abs() / scale.clamp_min(1e-30)).nan_to_num(0.0)
        rtol = CHECK_RTOL.get(self.block.dtype, 6e-2)
        worst = float(err.max()) if err.numel() else 0.0
        if not worst <= rtol:
            raise UnsupportedModelError(
                f"{self._model_name or 'this model'}, layer {self.layer}: the pair shares "
                f"(from hook_pattern and hook_v) do not add up to the attention share read from "
                f"hook_z (relative error {worst:.2e} > {rtol:.0e}): pattern @ v != z, so the "
                "hooks do not show what the attention computes."
            )

    def token_rows(self) -> Float[Tensor, "batch query key"]:
        """Rows of the token-level matrix `T` (rows sum to 1).

        Returns:
            A fresh tensor `[batch, query, key]`.

        Examples:
            ```python
            import cw_lens

            model = cw_lens.load_model("testing:tiny-llama")

            def consumer(block):  # called inside the forward pass, once per block
                print(block.layer, block.token_rows().sum(-1))

            cw_lens.stream_shares(model, "The cat sat on the mat.", consumer)
            ```
        """
        rows = self.pairs_over_heads.clone()
        return fg.token_matrix(rows, self.self_share, self.queries.start)

    # ------------------------------------------------------------------ factors
    @cached_property
    def _key_norms(self) -> Float[Tensor, "batch head key"]:
        """`||pv_j^h||` through the map: `sqrt(v G_eff v)` (without the row scale)."""

        def compute() -> Tensor:
            acts, m = self.block.acts, self.block.attn_map
            if m.gain is None and not m.centred:
                gram = acts.weights.gram
            else:
                gram = fg.effective_gram(acts.weights.W_O, m.gain, m.centred)
            return projected_value_norms(acts.values, gram)

        if "key_norms" not in self._shared:
            self._shared["key_norms"] = compute()
        return self._shared["key_norms"]

    def factors(
        self, index: Int[Tensor, "n 4"]
    ) -> tuple[Float[Tensor, " n"], Float[Tensor, " n"], Float[Tensor, " n"]]:
        """The factors of chosen pairs: `share = attention * relative_norm * cosine`.

        `relative_norm = ||A_i(pv_j^h)|| / ||y_i||` and `cosine = cos(A_i(pv_j^h), y_i)` (0 for a
        zero projected value), `y` the stream of `into` (`x_{l+1}` or `m_l`).

        Args:
            index: Rows `(batch, head, query_row, key)` into
                [`pairs`][cw_lens.LayerSharesResult.pairs], `[n, 4]`.

        Returns:
            Three tensors `[n]`: attention, relative norm and cosine.

        Examples:
            ```python
            import cw_lens

            model = cw_lens.load_model("testing:tiny-llama")
            import torch

            def consumer(block):  # called inside the forward pass, once per block
                print(block.layer, block.factors(torch.tensor([[0, 0, 1, 0]])))

            cw_lens.stream_shares(model, "The cat sat on the mat.", consumer)
            ```
        """
        b, h, q, k = index.unbind(-1)
        acts = self.block.acts
        alpha = acts.pattern[b, h, q + self.queries.start, k]
        norm = self._key_norms[b, h, k]
        rows, _, _ = self._map
        if rows is not None:
            norm = norm * rows[b, q]
        rel = norm * self._inv_sq[b, q].sqrt()
        share = self.pairs()[b, h, q, k]
        denom = alpha * rel
        cos = torch.where(denom > 0, share / denom, torch.zeros((), device=share.device))
        return alpha, rel, cos


@check_keywords
def stream_shares(
    model: Model,
    inputs: Any,
    consumer: Callable[[LayerSharesResult], None],
    *,
    layers: int | Sequence[int] | None = None,
    query_chunk: int | None = None,
    batch_size: int | None = 8,
    prepend_bos: bool = True,
    attention_mask: Tensor | None = None,
    fwd_hooks: Sequence | Callable[[TokenBatch], Sequence] = (),
    on_logits: Callable[[TokenBatch, Tensor], None] | None = None,
    progress: bool = True,
    reuse_buffers: bool = False,
) -> StreamStats:
    """Stream one block (and one block of query rows) at a time to `consumer`.

    Args:
        model: A `TransformerBridge`.
        inputs: Text, a list of texts, a corpus, or token ids `[batch, pos]`.
        consumer: Called with a [`LayerSharesResult`][cw_lens.LayerSharesResult] per (document
            batch, layer, query block), layers in increasing order, query blocks in increasing
            order.
        layers: Blocks to analyse (`None` = all).
        query_chunk: Query rows per block (`None`: from the free memory).
        batch_size: Documents per forward pass (`None` = all at once).
        prepend_bos: Prepend BOS to text inputs.
        attention_mask: Mask for token-tensor inputs with padding.
        fwd_hooks: Interventions active during the passes (hook pairs, or a function of the
            document batch that returns them).
        on_logits: If given, the passes run to the end and this gets `(batch, logits)`.
        progress: Show a tqdm bar over document batches.
        reuse_buffers: Reuse one buffer for the pair shares across blocks: each block is then a
            view, valid only during its consumer call (`LayerSharesResult.detach_copy` keeps
            one); `False` (the default): every block owns its pair shares.

    Returns:
        A `StreamStats` (documents and tokens seen).

    Examples:
        ```python
        import cw_lens

        model = cw_lens.load_model("testing:tiny-llama")

        def consumer(block):  # called inside the forward pass, once per block
            print(block.layer, block.pairs().shape)

        cw_lens.stream_shares(model, "The cat sat on the mat.", consumer)
        ```
    """
    require_flow(model)
    if not callable(consumer):
        raise InputError(
            f"consumer must be a function of one LayerSharesResult, got {type(consumer).__name__}."
        )
    check_query_chunk(query_chunk)
    layer_list = resolve_layers(model, layers)
    prepared = prepare_inputs(model, inputs, prepend_bos=prepend_bos, attention_mask=attention_mask)
    stats = StreamStats()
    workspace = Workspace(reuse=reuse_buffers)
    name = arch_name(model)
    # cw_lens's own callers may pass the bar's label as `progress` (not a public option)
    label = progress if isinstance(progress, str) else "shares"

    def on_rows(block: BlockActivations, rows: slice, shared: dict[str, Any]) -> None:
        workspace.begin_block()
        consumer(LayerSharesResult(block, rows, shared, workspace, name))

    run_batches(
        model,
        prepared,
        run_blocks,
        on_rows,
        stats,
        layers=layer_list,
        n_heads=model.cfg.n_heads,
        batch_size=batch_size,
        query_chunk=query_chunk,
        fwd_hooks=fwd_hooks,
        on_logits=on_logits,
        progress=progress and label,
    )
    return stats
