"""Ranking what to remove (pure): candidates ranked by a metric, the removal masks of a fraction,
token scores summed over heads, seeded random draws; and the ranks of one clean pass.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from typing import Any

import torch
from jaxtyping import Bool, Float, Int
from torch import Tensor

from cw_lens.core import flow_geometry as fg
from cw_lens.core.errors import InputError
from cw_lens.core.geometry import values_per_head
from cw_lens.core.proximity import attention_proximity
from cw_lens.data.inputs import TokenBatch
from cw_lens.models.blocks import BlockActivations
from cw_lens.models.gradients import LayerGradient
from cw_lens.models.interventions import mask_attention
from cw_lens.models.layer_contributions import METRICS, LayerContributionsResult

# P1's metrics and its random control: the default set
ALL_METRICS = (*METRICS, "random")
# metrics from other tools, opt-in, each scored on a clean pass of its own: `alti` (L1
# proximity, as the LLM Transparency Tool computes it) and `attribution_patching` (attention x
# gradient, the first-order prediction of the removal itself; one backward pass)
FIELD_METRICS = ("alti", "attribution_patching")
KNOWN_METRICS = (*METRICS, *FIELD_METRICS, "random")
MODES = ("comprehensiveness", "sufficiency")
GRANULARITIES = ("pairs", "tokens")
FRACTIONS = (0.01, 0.02, 0.05, 0.1, 0.2, 0.5)


# --------------------------------------------------------------------------- ranking (pure)


def rank_candidates(
    scores: Tensor, valid: Bool[Tensor, "..."], *, signed: bool = False
) -> Int[Tensor, "..."]:
    """Rank of every candidate along the last axis (0 = most important), vectorised.

    Invalid candidates rank after every valid one. Importance is `|score|` (`signed`: the
    score). Ties keep the candidate order (a stable sort), so the lower index ranks first.
    """
    key = scores if signed else scores.abs()
    key = torch.nan_to_num(key.float(), nan=0.0)
    key = key.masked_fill(~valid, float("-inf"))
    order = torch.argsort(key, dim=-1, descending=True, stable=True)
    ranks = torch.empty_like(order)
    ranks.scatter_(-1, order, torch.arange(order.shape[-1], device=order.device).expand_as(order))
    return ranks


def n_removed(n_valid: Tensor, fraction: float) -> Tensor:
    """How many candidates a fraction removes: `round(fraction * n)`, at least 1 when
    `fraction > 0` and there is a candidate, never more than `n`."""
    if fraction <= 0:
        return torch.zeros_like(n_valid)
    n = torch.floor(fraction * n_valid.double() + 0.5).long()
    return torch.minimum(torch.maximum(n, (n_valid > 0).long()), n_valid)


def removal_mask(ranks: Tensor, n_valid: Tensor, fraction: float, mode: str) -> Bool[Tensor, "..."]:
    """Which candidates to remove: the top (comprehensiveness) or bottom (sufficiency) share.

    `ranks` `[..., candidates]`; `n_valid` `[...]` candidates per row.
    """
    low, high = removal_bounds(n_valid, fraction, mode, ranks.dtype)
    return ranks < high if low is None else (ranks >= low) & (ranks < high)


def removal_bounds(
    n_valid: Tensor, fraction: float, mode: str, dtype: torch.dtype
) -> tuple[Tensor | None, Tensor]:
    """The ranks a fraction removes, `low <= rank < high` per row (`low` `None`: from 0).

    Comprehensiveness removes ranks `0 .. n-1`, sufficiency `n_valid-n .. n_valid-1`, with `n`
    from `n_removed`. One pass computes them once for all its layers.

    Args:
        n_valid: Candidates per row `[...]`.
        fraction: The share removed.
        mode: `comprehensiveness` or `sufficiency`.
        dtype: The ranks' dtype (int16 ranks are compared without a widened copy per layer).

    Returns:
        `(low, high)`, each `[..., 1]` in `dtype`; `low` is `None` for comprehensiveness.
    """
    n = n_removed(n_valid, fraction)[..., None].to(dtype)
    if mode == "comprehensiveness":
        return None, n
    if mode == "sufficiency":
        total = n_valid[..., None].to(dtype)
        return total - n, total
    raise InputError(f"mode must be one of {MODES}, got {mode!r}.")


def token_scores(scores: Float[Tensor, "batch head query key"]) -> Float[Tensor, "batch query key"]:
    """Token granularity: one score per (query, key token), the sum over heads (signed; NaN
    entries count as 0). For the inter contribution it is the token's share of the layer
    output."""
    return scores.nansum(1)


def random_draw_names(n_draws: int) -> list[str]:
    """The metric names of `n_draws` independent random rankings: `random` (the first draw),
    then `random#2` ... `random#n`."""
    return ["random", *(f"random#{d}" for d in range(2, n_draws + 1))]


def _draw_of(metric: str) -> int:
    return int(metric.split("#")[1]) if "#" in metric else 1


def _random_scores(
    seed: int, doc: int, layer: int, shape: tuple[int, ...], draw: int = 1
) -> Tensor:
    key = f"{seed}/{doc}/{layer}".encode() if draw == 1 else f"{seed}/{doc}/{layer}#{draw}".encode()
    gen = torch.Generator().manual_seed(int(hashlib.sha1(key).hexdigest()[:12], 16))
    return torch.rand(shape, generator=gen, device="cpu")


# --------------------------------------------------------------------------- clean-pass scores


def alti_scores(
    block: BlockActivations, valid: Bool[Tensor, "batch query key"]
) -> Float[Tensor, "batch head query key"]:
    """ALTI contribution of every (head, key) pair of one checked block (`cw_lens.core.proximity`).

    The parts are `A_i(alpha_ij^h pv_j^h)` and `x_i`; the whole is `x_i + attn_out_i`, the
    stream after the attention sub-layer as the model's hooks show it (`resid_mid` on a
    sequential block), which `cw_lens.models.blocks.check_block` has checked against the parts.

    Args:
        block: The block's activations (`cw_lens.models.blocks.run_blocks`).
        valid: The candidate pairs (`j <= i`, real tokens).

    Returns:
        The pairs' contributions, each query's valid pairs and residual summing to 1.
    """
    acts = block.acts
    values = values_per_head(acts.values, acts.n_heads)  # [batch, head, key, d_head]
    pv = torch.einsum("bhkd,hdm->bhkm", values, acts.weights.W_O.to(values.device))
    amap = block.attn_map
    head_vectors = fg.apply_linear_map(pv, None, amap.gain, amap.centred)
    whole = block.resid_pre + block.attn_out
    pairs, _ = attention_proximity(
        acts.pattern, head_vectors, amap.row_scale, block.resid_pre, whole, valid
    )
    return pairs


class Ranks:
    """Per layer and metric, the ranks of one document batch (filled block by block).

    Pair ranks are stored heads first, `[batch, head, query, key]` (the pattern's layout), so
    a removal mask is built in the layout the intervention applies it in, without a permuted
    copy; token ranks are `[batch, query, key]`.
    """

    def __init__(
        self,
        batch: TokenBatch,
        layers: list[int],
        n_heads: int,
        metrics: Sequence[str],
        granularities: Sequence[str],
        signed: bool,
        seed: int,
        first_query: int = 1,
    ) -> None:
        self.batch, self.n_heads, self.metrics = batch, n_heads, list(metrics)
        self.granularities, self.signed, self.seed = list(granularities), signed, seed
        n_batch, n_pos = batch.tokens.shape
        self.pairs: dict[tuple[str, int], Tensor] = {}
        self.tokens: dict[tuple[str, int], Tensor] = {}
        dtype = torch.int16 if n_heads * n_pos < 2**15 else torch.int32
        for metric in self.metrics:
            for layer in layers:
                if "pairs" in self.granularities:
                    self.pairs[metric, layer] = torch.empty(
                        n_batch, n_heads, n_pos, n_pos, dtype=dtype, device="cpu"
                    )
                if "tokens" in self.granularities:
                    self.tokens[metric, layer] = torch.empty(
                        n_batch, n_pos, n_pos, dtype=dtype, device="cpu"
                    )
        positions = torch.arange(n_pos, device=batch.mask.device)
        real = batch.mask
        self.valid_keys = (positions[None, :, None] >= positions[None, None, :]) & real[:, None, :]
        self.valid_keys &= real[:, :, None]  # [batch, query, key]
        self.valid_keys[:, :first_query] = False  # queries left intact
        self.n_valid_tokens = self.valid_keys.sum(-1)  # [batch, query]
        self.n_valid_pairs = self.n_valid_tokens * n_heads

    def _scores(self, lc: LayerContributionsResult, metric: str) -> Tensor:
        if metric.startswith("random"):
            b, h, q, k = lc.shape
            n_pos = self.batch.tokens.shape[1]
            out = torch.empty(b, h, q, k, device="cpu")
            for row, doc in enumerate(self.batch.documents):
                full = _random_scores(self.seed, doc, lc.layer, (h, n_pos, n_pos), _draw_of(metric))
                out[row] = full[:, lc.queries, lc.keys]
            return out
        return lc.metric(metric, kind="inter").float().cpu()

    def update(self, lc: LayerContributionsResult) -> None:
        """Rank one block of the streamed clean pass by every metric it scores.

        Args:
            lc: The block (`stream_contributions`).
        """
        for metric in self.metrics:
            if metric not in FIELD_METRICS:
                self.store(lc.layer, metric, lc.queries, self._scores(lc, metric))

    def update_block(self, block: BlockActivations) -> None:
        """Rank one checked block (`run_blocks`) by the field metrics.

        Args:
            block: The block's residual-stream activations.
        """
        valid = self.valid_keys.to(block.resid_pre.device)
        if "alti" in self.metrics:
            scores = alti_scores(block, valid).cpu()
            self.store(block.layer, "alti", slice(0, scores.shape[2]), scores)

    def update_gradients(self, grads: dict[int, LayerGradient]) -> None:
        """Rank every layer by attribution patching.

        Args:
            grads: Per layer, the activations and the loss's output gradient
                (`cw_lens.models.gradients.attention_output_gradients`).
        """
        for layer, grad in grads.items():
            scores = grad.attribution().cpu()
            self.store(layer, "attribution_patching", slice(0, scores.shape[2]), scores)

    def store(self, layer: int, metric: str, queries: slice, scores: Tensor) -> None:
        """Rank the scores of the rows `queries` and keep the ranks.

        Args:
            layer: The layer.
            metric: The metric's name.
            queries: The query rows the scores cover.
            scores: `[batch, head, query, key]` on the host, keys from 0.
        """
        n_pos = self.batch.tokens.shape[1]
        b, h, q_len, k_len = scores.shape
        valid = self.valid_keys[:, queries]  # [batch, query, key(all)]
        full = torch.zeros(b, h, q_len, n_pos, device="cpu")
        full[..., :k_len] = scores
        if "pairs" in self.granularities:
            flat = full.permute(0, 2, 1, 3).reshape(b, q_len, -1)
            pair_valid = valid[:, :, None, :].expand(-1, -1, self.n_heads, -1)
            ranks = rank_candidates(flat, pair_valid.reshape(flat.shape), signed=self.signed)
            heads_first = ranks.view(b, q_len, self.n_heads, n_pos).permute(0, 2, 1, 3)
            self.pairs[metric, layer][:, :, queries] = heads_first  # cast to the stored dtype
        if "tokens" in self.granularities:
            ranks = rank_candidates(token_scores(full), valid, signed=self.signed)
            self.tokens[metric, layer][:, queries] = ranks.to(self.tokens[metric, layer].dtype)

    def hooks(
        self,
        model: Any,
        granularity: str,
        metric: str,
        mode: str,
        fraction: float,
        layers: list[int],
    ) -> list:
        """The pair-masking intervention of one configuration, all layers at once. Each
        layer's mask is built when its pattern is, so a pass holds one layer's mask at a time."""
        if granularity == "pairs":
            ranks, n_valid = self.pairs, self.n_valid_pairs[:, None]  # [batch, 1, query]
        else:
            ranks, n_valid = self.tokens, self.n_valid_tokens

        dtype = next(iter(ranks.values())).dtype
        low, high = removal_bounds(n_valid, fraction, mode, dtype)  # once for every layer

        def mask_of(layer: int) -> Callable[[Tensor], Tensor]:
            def build(_pattern: Tensor) -> Tensor:
                rank = ranks[metric, layer]
                remove = rank < high if low is None else (rank >= low) & (rank < high)
                return remove if granularity == "pairs" else remove[:, None]

            return build

        masks = {layer: mask_of(layer) for layer in layers}
        return [mask_attention(model, masks)]
