r"""The streaming unit of contribution weights: one layer, one block of query rows (P1, methods §
Contribution weights (docs/methods.md#contribution-weights)).

[`LayerContributionsResult`][cw_lens.LayerContributionsResult] turns one layer's captured
activations (`LayerActivations`) into the fields of methods § Contribution
weights (docs/methods.md#contribution-weights) for a block of query rows, lazily and in head space
(with the Gram matrices of `cw_lens.core.geometry`; the
`[query, key, d_model]` tensor of `alpha pv_j` vectors is never built):

    intra  c[i,j]^h = alpha[i,j]^h * ( ||pv_j^h|| / ||o_i^h|| ) * cos(pv_j^h, o_i^h)
    inter  C[i,j]^h = alpha[i,j]^h * ( ||pv_j^h|| / ||o_i||   ) * cos(pv_j^h, o_i)

and the baselines `attention`, `value_norm` and `value_norm_output`
(docs/methods.md#contribution-weights). Every corpus analysis receives these blocks from
[`cw_lens.stream_contributions`][cw_lens.stream_contributions].

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

from cw_lens.core import geometry as geo
from cw_lens.core.errors import InputError
from cw_lens.core.registry import saveable
from cw_lens.core.results import Result
from cw_lens.core.schema import NoValue
from cw_lens.models.batch import TokenBatch
from cw_lens.models.capture import LayerActivations

# One concept: one streamed block of contributions and its lifetime (the buffers it may reuse,
# the check that a view is still current, the copy that owns its fields) are one object, as the
# consumer of `stream_contributions` receives it.

Kind = Literal["intra", "inter"]
KINDS = ("intra", "inter")
# Metric names of the faithfulness protocol (docs/methods.md#faithfulness), in P1's order.
METRICS = ("attention", "value_norm", "value_norm_output", "contribution")


def check_kind(kind: str) -> None:
    if kind not in KINDS:
        raise InputError(f"kind must be 'intra' or 'inter', got {kind!r}.")


@saveable
class Workspace:
    """Reusable float32 buffers for the streamed `[batch, head, query, key]` tensors.

    Fresh multi-megabyte tensors cost page faults on every allocation; reusing one buffer per
    role makes the streamed arithmetic cheaper. With `reuse=False` every request gets a fresh
    tensor. A reusing workspace counts the blocks built on it (`generation`): only the newest
    one may read its buffers, since every block writes its fields into the same ones.

    Args:
        reuse: Hand out one buffer per role, reused by every block (else fresh tensors).
    """

    stored_fields: ClassVar[dict[str, Any]] = {
        "reuse": bool,
        "generation": int,
        "_buffers": dict[str, Tensor],
    }
    optional_fields: ClassVar[tuple[str, ...]] = ("generation",)  # files of 0.4 lack it
    generation: int = 0

    def __init__(self, reuse: bool = False) -> None:
        self.reuse = reuse
        self.generation = 0
        self._buffers: dict[str, Tensor] = {}

    def begin_block(self) -> int:
        """Register a new block whose fields go into these buffers.

        Returns:
            The block's generation: the buffers are its own while no later block has begun.
        """
        self.generation += 1
        return self.generation

    def get(self, name: str, shape: Sequence[int], device: torch.device) -> Tensor:
        """A float32 tensor of `shape` for the role `name`.

        Args:
            name: The role (one buffer per role when reusing).
            shape: The tensor's shape.
            device: Where it lives.

        Returns:
            A view of the role's buffer (reusing), or a fresh tensor; its values are garbage.
        """
        numel = math.prod(shape)
        if not self.reuse:
            return torch.empty(tuple(shape), device=device)
        buf = self._buffers.get(name)
        if buf is None or buf.numel() < numel or buf.device != device:
            buf = torch.empty(numel, device=device)
            self._buffers[name] = buf
        return buf[:numel].view(tuple(shape))

    def holds(self, t: Tensor) -> bool:
        """Whether `t` lives in one of this workspace's reused buffers.

        Args:
            t: A tensor.

        Returns:
            True when `t` shares storage with a buffer (it is overwritten by a later block).
        """
        ptr = t.untyped_storage().data_ptr()
        return any(ptr == b.untyped_storage().data_ptr() for b in self._buffers.values())


@saveable
class LayerContributionsResult(Result):
    """Contribution geometry of one layer for one block of query rows (the streaming unit).

    Tensors are `[batch, head, query, key]` over the selected heads, the query rows
    `queries` and the keys `0 .. queries.stop - 1` (later keys are never attended by these
    rows, so they are left out: every field would be 0 there). Quantities are computed lazily
    in head space and cached for the life of the block.

    Lifetime: by default ([`stream_contributions`][cw_lens.stream_contributions] with
    `reuse_buffers=False`) a block owns what it computes, so a block or a tensor kept from the
    consumer stays valid after the stream has moved on. A block built on a reusing `Workspace`
    (`reuse_buffers=True`, what the corpus analyses use) is a view (`is_view`): its
    `[batch, head, query, key]` fields live in buffers that the next block overwrites, so it is
    valid only during the consumer call. Reduce it there, or keep
    [`detach_copy()`][cw_lens.LayerContributionsResult.detach_copy]; a view read after a later
    block has begun raises [`InputError`][cw_lens.InputError] (a tensor taken from it and
    kept is overwritten, not guarded: `.clone()` it).

    Conventions: entries with `j > i` are 0; rows of padded queries and of queries with a
    numerically zero output norm are NaN at `j <= i`.
    """

    # what a file stores: the activations and the block; never its caches (`__getstate__`),
    # whose values are derived from those and computed again when read
    stored_fields: ClassVar[dict[str, Any]] = {
        "acts": LayerActivations,
        "layer": int,
        "heads": list[int],
        "_all_heads": bool,
        "queries": slice,
        "keys": slice,
        "_shared": dict[str, NoValue],
        "_ws": Workspace,
        "_generation": int,
        "_cache": dict[str, NoValue],
    }
    optional_fields: ClassVar[tuple[str, ...]] = ("_generation",)  # files of 0.4 lack it
    _generation: int = 0

    def __init__(
        self,
        acts: LayerActivations,
        heads: list[int] | None = None,
        queries: slice | None = None,
        shared: dict[str, Any] | None = None,
        workspace: Workspace | None = None,
    ) -> None:
        """A block; [`stream_contributions`][cw_lens.stream_contributions] builds them.

        Args:
            acts: The captured activations of the layer (`LayerActivations`).
            heads: The query heads (`None` = all).
            queries: The query rows of the block (`None` = all positions).
            shared: Per-pass values shared by the blocks of one layer (cached norms).
            workspace: The buffers the block writes its fields into (`None`: fresh tensors).
        """
        self.acts = acts
        self.layer = acts.layer
        self.heads = sorted(set(heads)) if heads is not None else list(range(acts.n_heads))
        self._all_heads = len(self.heads) == acts.n_heads
        n_pos = acts.pattern.shape[-1]
        self.queries = queries if queries is not None else slice(0, n_pos)
        self.keys = slice(0, self.queries.stop)
        self._shared = {} if shared is None else shared
        self._ws = workspace if workspace is not None else Workspace(reuse=False)
        self._generation = self._ws.begin_block()
        self._cache: dict[Any, Any] = {}

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_shared": {}, "_cache": {}}

    # ------------------------------------------------------------------ head-space reads
    # What a block reads from its layer's captured activations before any field is formed:
    # the selected heads, `z_i^h` and `z_i^h G^h` for the block's rows, the projected value
    # norms `||pv_j^h||` of every key and their running maximum (once per layer, shared by its
    # blocks through `_shared`), the values with the key/value heads first, and their grouped
    # `query x key` product.
    def _memo(self, key: Any, fn: Callable[[], Any]) -> Any:
        self._check_current()
        if key not in self._cache:
            self._cache[key] = fn()
        return self._cache[key]

    def _layer_memo(self, key: str, fn: Callable[[], Tensor]) -> Tensor:
        if key not in self._shared:
            self._shared[key] = fn()
        return self._shared[key]

    @cached_property
    def _head_index(self) -> Tensor:
        return torch.tensor(self.heads, device=self.acts.pattern.device)

    def _sel(self, t: Tensor, axis: int = 1) -> Tensor:
        return t if self._all_heads else t.index_select(axis, self._head_index)

    @cached_property
    def _full_key_norms(self) -> Float[Tensor, "batch head key"]:
        return self._layer_memo(
            "pv_norm", lambda: geo.projected_value_norms(self.acts.values, self.acts.weights.gram)
        )

    @cached_property
    def _key_scale(self) -> Float[Tensor, "batch head query"]:
        """`max_{j<=i} ||pv_j^h||` over all heads (for zero-norm detection)."""
        full = self._layer_memo("pv_scale", lambda: geo.key_norm_scale(self._full_key_norms))
        return full[..., self.queries]

    @cached_property
    def _z(self) -> Tensor:
        return self.acts.z[:, self.queries]

    @cached_property
    def _z_gram(self) -> Float[Tensor, "batch head query d_head"]:
        """`z_i^h G^h` for this block's rows, heads first (the layout of the grouped
        products): the intra query side and `||o_i^h||^2`."""
        return torch.matmul(self._z.transpose(1, 2), self.acts.weights.gram)

    @cached_property
    def _values_kv(self) -> Float[Tensor, "batch kv_head key d_head"]:
        """The values with the key/value heads first, contiguous (once per layer): every
        block's products read their keys as a transposed view, without a copy."""
        return self._layer_memo("values_kv", lambda: self.acts.values.transpose(1, 2).contiguous())

    def _grouped(self, query_side: Tensor, out: Tensor) -> Tensor:
        """`<query_side[b,h,i], v_j^{g(h)}>` for the selected heads and this block's keys
        (`query_side` is `[batch, head, query, d_head]` over the selected heads)."""
        values = self._values_kv[:, :, : self.keys.stop]
        if self._all_heads:
            return geo.grouped_scores_heads_first(query_side, values, out=out)
        group = self.acts.n_heads // values.shape[1]
        kv = torch.tensor([h // group for h in self.heads], device=values.device)
        return torch.matmul(query_side, values.index_select(1, kv).transpose(-1, -2))

    # ------------------------------------------------------------------ lifetime
    @property
    def is_view(self) -> bool:
        """True when the fields live in buffers that later blocks reuse (`reuse_buffers=True`):
        the block is then valid only during the consumer call."""
        return self._ws.reuse

    def _check_current(self) -> None:
        """Raise when this is a view whose buffers a later block may have overwritten."""
        if self._ws.reuse and self._ws.generation != self._generation:
            raise InputError(
                f"This LayerContributionsResult (layer {self.layer}, queries "
                f"{self.queries.start}..{self.queries.stop - 1}) is a view into buffers that the "
                "stream reuses (reuse_buffers=True), valid only during the consumer call, and a "
                "later block has overwritten them. Keep block.detach_copy() from inside the "
                "call, or stream with reuse_buffers=False (the default)."
            )

    def detach_copy(self) -> LayerContributionsResult:
        """This block as one that owns its fields, valid after the consumer call returns.

        The copy reads the same activations (which the stream never reuses) and computes its
        `[batch, head, query, key]` fields in tensors of its own when they are read (the same
        numbers as this block's); nothing is cloned, so a copy that is not read costs nothing.
        Call it inside the consumer.

        Returns:
            A [`LayerContributionsResult`][cw_lens.LayerContributionsResult] with
            `is_view == False`, equal to this block.

        Examples:
            ```python
            import cw_lens

            model = cw_lens.load_model("testing:tiny-llama")
            kept = []

            def consumer(block):  # a view: valid only inside this call
                kept.append(block.detach_copy())

            cw_lens.stream_contributions(model, "The cat sat.", consumer, reuse_buffers=True)
            kept[0].weights("inter").shape
            ```
        """
        self._check_current()
        copy = LayerContributionsResult(
            self.acts, self.heads, self.queries, dict(self._shared), Workspace(reuse=False)
        )
        for key, value in self._cache.items():  # the small per-row values; not the buffers
            if not (isinstance(value, Tensor) and self._ws.reuse and self._ws.holds(value)):
                copy._cache[key] = value
        return copy

    # ------------------------------------------------------------------ raw pieces
    @property
    def batch(self) -> TokenBatch:
        return self.acts.batch

    @property
    def shape(self) -> tuple[int, int, int, int]:
        """`(batch, head, query, key)` of every pairwise field of this block."""
        return (
            self.acts.pattern.shape[0],
            len(self.heads),
            self.queries.stop - self.queries.start,
            self.keys.stop,
        )

    @property
    def query_positions(self) -> Int[Tensor, " query"]:
        return torch.arange(self.queries.start, self.queries.stop, device=self.acts.mask.device)

    @cached_property
    def attention(self) -> Float[Tensor, "batch head query key"]:
        """`alpha[i,j]^h` (a view of `hook_pattern`; padded rows are not NaN here)."""
        return self._sel(self.acts.pattern[:, :, self.queries, self.keys])

    @cached_property
    def query_mask(self) -> Bool[Tensor, "batch query"]:
        """True at real (non-padding) query positions."""
        return self.acts.mask[:, self.queries]

    @cached_property
    def _padded(self) -> bool:
        return not bool(self.query_mask.all())

    @property
    def layer_projected_value_norm(self) -> Float[Tensor, "batch head key"]:
        """`||pv_j^h||` for every head and key of the layer, computed once per layer and
        shared by its blocks (and by any consumer that needs all keys)."""
        return self._full_key_norms

    @cached_property
    def projected_value_norm(self) -> Float[Tensor, "batch head key"]:
        """`||pv_j^h||` for the keys of this block."""
        return self._sel(self._full_key_norms[..., self.keys])

    @cached_property
    def _inv_key_norm(self) -> Tensor:
        kn = self.projected_value_norm
        return torch.where(kn > 0, kn.reciprocal(), torch.zeros((), device=kn.device))

    @cached_property
    def head_output_norm(self) -> Float[Tensor, "batch head query"]:
        """`||o_i^h||`."""
        sq = (self._z_gram * self._z.transpose(1, 2)).sum(-1)
        return self._sel(sq.clamp_min(0).sqrt())

    @cached_property
    def layer_output_norm(self) -> Float[Tensor, "batch query"]:
        """`||o_i||` (`b_O` excluded)."""
        return self.acts.layer_output[:, self.queries].norm(dim=-1)

    def output_norm(self, kind: Kind = "intra") -> Float[Tensor, "batch head query"]:
        """The norm a weight is relative to: `||o_i^h||` (intra) or `||o_i||` (inter).

        Args:
            kind: `"intra"` (the head output `o_i^h`) or `"inter"` (the layer output `o_i`).

        Returns:
            A tensor `[batch, head, query]`.

        Examples:
            ```python
            import cw_lens

            model = cw_lens.load_model("testing:tiny-llama")

            def consumer(block):  # called inside the forward pass, once per block
                print(block.layer, block.output_norm("inter").shape)

            cw_lens.stream_contributions(model, "The cat sat on the mat.", consumer)
            ```
        """
        check_kind(kind)
        if kind == "intra":
            return self.head_output_norm
        return self.layer_output_norm[:, None, :].expand_as(self.head_output_norm)

    def zero_rows(self, kind: Kind = "intra") -> Bool[Tensor, "batch head query"]:
        """Real queries whose output norm is numerically zero (their weights are NaN).

        Args:
            kind: `"intra"` (the head output `o_i^h`) or `"inter"` (the layer output `o_i`).

        Returns:
            A bool tensor `[batch, head, query]`.

        Examples:
            ```python
            import cw_lens

            model = cw_lens.load_model("testing:tiny-llama")

            def consumer(block):  # called inside the forward pass, once per block
                print(block.layer, block.zero_rows().any())

            cw_lens.stream_contributions(model, "The cat sat on the mat.", consumer)
            ```
        """
        check_kind(kind)

        def compute() -> Tensor:
            if kind == "intra":
                zero = geo.zero_output_rows(self.head_output_norm, self._sel(self._key_scale))
            else:
                z = geo.zero_output_rows(self.layer_output_norm, self._key_scale.sum(1))
                zero = z[:, None, :].expand(-1, len(self.heads), -1)
            return zero & self.query_mask[:, None, :]

        return self._memo(("zero", kind), compute)

    def n_zero_rows(self, kind: Kind = "intra") -> int:
        """How many real queries have a numerically zero output norm.

        Args:
            kind: `"intra"` (the head output `o_i^h`) or `"inter"` (the layer output `o_i`).

        Returns:
            The count of [`zero_rows`][cw_lens.LayerContributionsResult.zero_rows].

        Examples:
            ```python
            import cw_lens

            model = cw_lens.load_model("testing:tiny-llama")

            def consumer(block):  # called inside the forward pass, once per block
                print(block.layer, block.n_zero_rows())

            cw_lens.stream_contributions(model, "The cat sat on the mat.", consumer)
            ```
        """
        return int(self.zero_rows(kind).sum())

    def _inv_output_norm(self, kind: Kind) -> Float[Tensor, "batch head query"]:
        """`1 / ||o_i||`, NaN at padded and zero-norm rows (so they come out NaN)."""

        def compute() -> Tensor:
            bad = self.zero_rows(kind) | ~self.query_mask[:, None, :]
            return self.output_norm(kind).reciprocal().masked_fill(bad, math.nan)

        return self._memo(("inv_norm", kind), compute)

    def _row_scale(self, kind: Kind) -> Float[Tensor, "batch head query"]:
        """`1 / ||o_i||` with 0 at undefined rows (for products whose NaN comes from
        `scaled_dots`)."""
        return self._memo(("row_scale", kind), lambda: self._inv_output_norm(kind).nan_to_num(0.0))

    def _row_nan(self, t: Tensor) -> Tensor:
        """Set padded query rows of `t` (in place) to NaN at `j <= i`."""
        if self._padded:
            t.masked_fill_(~self.query_mask[:, None, :, None], math.nan)
            t.tril_(diagonal=self.queries.start)
        return t

    def scaled_dots(self, kind: Kind = "intra") -> Float[Tensor, "batch head query key"]:
        """`<pv_j^h, o_i> / ||o_i||` = `||pv_j|| cos(pv_j, o_i)` with `o` per `kind`.

        The `1/||o_i||` scale is folded into the (small) query side before the product, so
        undefined rows come out NaN without a pass over the `query x key` tensor. Keys after the
        query are 0 (undefined rows too): `weights` and `cosine` inherit both.

        Args:
            kind: `"intra"` (the head output `o_i^h`) or `"inter"` (the layer output `o_i`).

        Returns:
            A tensor `[batch, head, query, key]`.

        Examples:
            ```python
            import cw_lens

            model = cw_lens.load_model("testing:tiny-llama")

            def consumer(block):  # called inside the forward pass, once per block
                print(block.layer, block.scaled_dots().shape)

            cw_lens.stream_contributions(model, "The cat sat on the mat.", consumer)
            ```
        """
        check_kind(kind)

        def compute() -> Tensor:
            w = self.acts.weights
            inv = self._inv_output_norm(kind)  # [batch, head(sel), query]
            if kind == "intra":
                side = self._sel(self._z_gram) * inv[..., None]
            else:
                out = self.acts.layer_output[:, self.queries] * inv[:, 0, :, None]
                side = self._sel(geo.project_into_heads(out, w.W_O).transpose(1, 2).contiguous())
            buf = self._ws.get(f"dots_{kind}", self.shape, side.device)
            return self._grouped(side, buf).tril_(diagonal=self.queries.start)

        return self._memo(("scaled_dots", kind), compute)

    def dots(self, kind: Kind = "intra") -> Float[Tensor, "batch head query key"]:
        """`<pv_j^h, o_i^h>` (intra) or `<pv_j^h, o_i>` (inter).

        Args:
            kind: `"intra"` (the head output `o_i^h`) or `"inter"` (the layer output `o_i`).

        Returns:
            A fresh tensor `[batch, head, query, key]`.

        Examples:
            ```python
            import cw_lens

            model = cw_lens.load_model("testing:tiny-llama")

            def consumer(block):  # called inside the forward pass, once per block
                print(block.layer, block.dots("inter").shape)

            cw_lens.stream_contributions(model, "The cat sat on the mat.", consumer)
            ```
        """
        return self.scaled_dots(kind) * self.output_norm(kind)[..., None]

    # ------------------------------------------------------------------ fields
    def weights(self, kind: Kind = "intra") -> Float[Tensor, "batch head query key"]:
        """Contribution weights `c` (intra) or `C` (inter).

        Args:
            kind: `"intra"` (the head output `o_i^h`) or `"inter"` (the layer output `o_i`).

        Returns:
            A tensor `[batch, head, query, key]` (a buffer the next block may reuse).

        Examples:
            ```python
            import cw_lens

            model = cw_lens.load_model("testing:tiny-llama")

            def consumer(block):  # called inside the forward pass, once per block
                print(block.layer, block.weights("inter").sum((1, 3)))  # 1 per real query

            cw_lens.stream_contributions(model, "The cat sat on the mat.", consumer)
            ```
        """

        def compute() -> Tensor:
            # alpha * (<pv, o> / ||o||) * (1 / ||o||): the scaled dots are NaN at j <= i of
            # undefined rows and 0 at j > i, so the row scale's NaN is not needed (0 keeps the
            # zeros after the query) and no triangle has to be cleared here
            buf = self._ws.get(f"weights_{kind}", self.shape, self.acts.pattern.device)
            torch.mul(self.attention, self.scaled_dots(kind), out=buf)
            return buf.mul_(self._row_scale(kind)[..., None])

        return self._memo(("weights", kind), compute)

    def cosine(self, kind: Kind = "intra") -> Float[Tensor, "batch head query key"]:
        """`cos(pv_j^h, o_i^h)` (intra) or `cos(pv_j^h, o_i)` (inter); 0 for a zero `pv_j`.

        Args:
            kind: `"intra"` (the head output `o_i^h`) or `"inter"` (the layer output `o_i`).

        Returns:
            A tensor `[batch, head, query, key]`.

        Examples:
            ```python
            import cw_lens

            model = cw_lens.load_model("testing:tiny-llama")

            def consumer(block):  # called inside the forward pass, once per block
                print(block.layer, block.cosine().shape)

            cw_lens.stream_contributions(model, "The cat sat on the mat.", consumer)
            ```
        """

        def compute() -> Tensor:
            buf = self._ws.get(f"cosine_{kind}", self.shape, self.acts.pattern.device)
            return torch.mul(self.scaled_dots(kind), self._inv_key_norm[:, :, None, :], out=buf)

        return self._memo(("cosine", kind), compute)

    def relative_norm(self, kind: Kind = "intra") -> Float[Tensor, "batch head query key"]:
        """`||pv_j^h|| / ||o_i^h||` (intra) or `||pv_j^h|| / ||o_i||` (inter).

        Args:
            kind: `"intra"` (the head output `o_i^h`) or `"inter"` (the layer output `o_i`).

        Returns:
            A tensor `[batch, head, query, key]`.

        Examples:
            ```python
            import cw_lens

            model = cw_lens.load_model("testing:tiny-llama")

            def consumer(block):  # called inside the forward pass, once per block
                print(block.layer, block.relative_norm().shape)

            cw_lens.stream_contributions(model, "The cat sat on the mat.", consumer)
            ```
        """

        def compute() -> Tensor:
            buf = self._ws.get(f"relative_norm_{kind}", self.shape, self.acts.pattern.device)
            torch.mul(
                self._inv_output_norm(kind)[..., None],
                self.projected_value_norm[:, :, None, :],
                out=buf,
            )
            return buf.tril_(diagonal=self.queries.start)

        return self._memo(("relative_norm", kind), compute)

    def value_norm(self) -> Float[Tensor, "batch head query key"]:
        """Baseline `alpha ||pv_j||`.

        Returns:
            A tensor `[batch, head, query, key]`.

        Examples:
            ```python
            import cw_lens

            model = cw_lens.load_model("testing:tiny-llama")

            def consumer(block):  # called inside the forward pass, once per block
                print(block.layer, block.value_norm().shape)

            cw_lens.stream_contributions(model, "The cat sat on the mat.", consumer)
            ```
        """

        def compute() -> Tensor:
            buf = self._ws.get("value_norm", self.shape, self.acts.pattern.device)
            torch.mul(self.attention, self.projected_value_norm[:, :, None, :], out=buf)
            return self._row_nan(buf)

        return self._memo("value_norm", compute)

    def value_norm_output(self) -> Float[Tensor, "batch head query key"]:
        """Baseline `alpha ||pv_j|| / ||o_i^h||` (the per-head output norm).

        Returns:
            A tensor `[batch, head, query, key]`.

        Examples:
            ```python
            import cw_lens

            model = cw_lens.load_model("testing:tiny-llama")

            def consumer(block):  # called inside the forward pass, once per block
                print(block.layer, block.value_norm_output().shape)

            cw_lens.stream_contributions(model, "The cat sat on the mat.", consumer)
            ```
        """

        def compute() -> Tensor:
            buf = self._ws.get("value_norm_output", self.shape, self.acts.pattern.device)
            torch.mul(self.attention, self.projected_value_norm[:, :, None, :], out=buf)
            buf.mul_(self._inv_output_norm("intra")[..., None])
            return buf.tril_(diagonal=self.queries.start)

        return self._memo("value_norm_output", compute)

    def masked_attention(self) -> Float[Tensor, "batch head query key"]:
        """`alpha` with padded query rows NaN (a copy only when the batch is padded).

        Returns:
            A tensor `[batch, head, query, key]`.

        Examples:
            ```python
            import cw_lens

            model = cw_lens.load_model("testing:tiny-llama")

            def consumer(block):  # called inside the forward pass, once per block
                print(block.layer, block.masked_attention().shape)

            cw_lens.stream_contributions(model, "The cat sat on the mat.", consumer)
            ```
        """
        self._check_current()
        if not self._padded:
            return self.attention
        buf = self._ws.get("attention", self.shape, self.acts.pattern.device)
        buf.copy_(self.attention)
        return self._row_nan(buf)

    def metric(self, name: str, kind: Kind = "inter") -> Float[Tensor, "batch head query key"]:
        """A score by name.

        Args:
            name: `"attention"`, `"value_norm"`, `"value_norm_output"` or `"contribution"`.
            kind: The contribution's normalisation (`"intra"` or `"inter"`); only for
                `"contribution"`.

        Returns:
            A tensor `[batch, head, query, key]`.

        Examples:
            ```python
            import cw_lens

            model = cw_lens.load_model("testing:tiny-llama")

            def consumer(block):  # called inside the forward pass, once per block
                print(block.layer, block.metric("contribution").shape)

            cw_lens.stream_contributions(model, "The cat sat on the mat.", consumer)
            ```
        """
        if name == "attention":
            return self.masked_attention()
        if name == "value_norm":
            return self.value_norm()
        if name == "value_norm_output":
            return self.value_norm_output()
        if name == "contribution":
            return self.weights(kind)
        raise InputError(f"Unknown metric {name!r}; choose one of {', '.join(METRICS)}.")
