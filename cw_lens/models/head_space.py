"""The head-space reads behind `LayerContributionsResult` (one layer, one block of query rows).

What a block reads from its layer's captured activations before any field is formed: the
selected heads, `z_i^h` and `z_i^h G^h` for the block's rows, the projected value norms
`||pv_j^h||` of every key and their running maximum (computed once per layer and shared by its
blocks), the values with the key/value heads first, and their grouped `query x key` product.
`cw_lens.models.layer_contributions.LayerContributionsResult` sets the attributes named below
and builds its fields on these reads.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import cached_property
from typing import Any

import torch
from jaxtyping import Float
from torch import Tensor

from cw_lens.core import geometry as geo
from cw_lens.models.capture import LayerActivations


class HeadSpaceReads:
    """Cached reads of one block in head space; a base of `LayerContributionsResult`.

    The block sets `acts` (the layer's activations), `heads` (the selected query heads),
    `queries` (its rows), `keys` (`0 .. queries.stop - 1`), `_all_heads`, `_shared` (per-layer
    values shared by the blocks of one layer) and `_cache` (its own).
    """

    acts: LayerActivations
    heads: list[int]
    queries: slice
    keys: slice
    _all_heads: bool
    _shared: dict[str, Any]
    _cache: dict[Any, Any]

    def _memo(self, key: Any, fn: Callable[[], Any]) -> Any:
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
