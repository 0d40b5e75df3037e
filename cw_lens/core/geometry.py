r"""The pure math of contribution weights (P1) in head space — no TransformerLens inside.

Notation (docs/methods.md#notation): for one layer, query position `i`, key position `j`, query
head `h` reading key/value head `g(h) = h // (H / H_kv)`,

- projected value `pv_j^h = v_j^{g(h)} W_O^h` (a `d_model` vector);
- head output `o_i^h = sum_j alpha[i,j]^h pv_j^h = z_i^h W_O^h`;
- layer output `o_i = sum_h o_i^h`.

Contribution weights (P1, Cunningham & Muca Cirone, ICML 2026, arXiv 2606.07604):

    intra:  c[i,j]^h = < alpha[i,j]^h pv_j^h , o_i^h > / ||o_i^h||^2
                     = alpha[i,j]^h * (||pv_j^h|| / ||o_i^h||) * cos(pv_j^h, o_i^h)
    inter:  C[i,j]^h = < alpha[i,j]^h pv_j^h , o_i > / ||o_i||^2

Nothing here builds the `[query, key, d_model]` tensor. With the per-head Gram matrix
`G^h = W_O^h (W_O^h)^T` (`d_head x d_head`):

    ||pv_j^h||^2      = v_j G^h v_j^T
    <pv_j^h, o_i^h>   = v_j G^h (z_i^h)^T
    <pv_j^h, o_i>     = v_j (W_O^h o_i^T)          (o_i projected into each head once)

and grouped-query attention is contracted against the un-repeated values
(`grouped_scores`, `apply_gram`, `project_into_heads`). The weights and their
three factors are assembled from these pieces, with the `1/||o_i||` scales folded into the
query side and the big products written into reused buffers, by
[`cw_lens.LayerContributionsResult`][cw_lens.LayerContributionsResult]. All functions take and
return float32
tensors with a leading batch axis; they are tested against a dense reference that materialises
every `alpha pv_j` vector.
"""

from __future__ import annotations

import einops
import torch
from jaxtyping import Bool, Float
from torch import Tensor

# A query whose output norm is below this fraction of the largest projected-value norm among its
# keys (j <= i) is numerically zero: float32 cancellation leaves no significant digit of o_i, so
# its weights are undefined — returned as NaN and counted.
ZERO_OUTPUT_RTOL = 1e-6


def head_gram(W_O: Float[Tensor, "head d_head d_model"]) -> Float[Tensor, "head d_head d_head"]:
    """Per-head Gram matrix `G^h = W_O^h (W_O^h)^T`."""
    return torch.einsum("hdm,hem->hde", W_O, W_O)


def expand_kv(
    values: Float[Tensor, "batch key kv_head d_head"], n_heads: int
) -> Float[Tensor, "batch key head d_head"]:
    """Repeat key/value heads so query head `h` sees kv head `h // (H / H_kv)` (a copy)."""
    group = n_heads // values.shape[2]
    return values.repeat_interleave(group, dim=2)


def grouped_scores(
    queries: Float[Tensor, "batch query head d_head"],
    values: Float[Tensor, "batch key kv_head d_head"],
    out: Float[Tensor, "batch head query key"] | None = None,
) -> Float[Tensor, "batch head query key"]:
    """`out[b,h,i,j] = <queries[b,i,h], values[b,j,g(h)]>` without repeating the values.

    The query heads of one group are stacked along the query axis, so each kv head takes part
    in a single matrix product (the same trick attention kernels use for GQA). `out` (a
    contiguous buffer) receives the result when given.
    """
    n_batch, n_query, n_heads, _ = queries.shape
    n_kv = values.shape[2]
    stacked = einops.rearrange(queries, "b q (kv g) d -> b kv (g q) d", kv=n_kv)
    keys = einops.rearrange(values, "b k kv d -> b kv d k")
    if out is not None:
        flat = out.view(n_batch, n_kv, (n_heads // n_kv) * n_query, values.shape[1])
        torch.matmul(stacked, keys, out=flat)
        return out
    scores = torch.matmul(stacked, keys)
    return einops.rearrange(scores, "b kv (g q) k -> b (kv g) q k", q=n_query)


def grouped_scores_heads_first(
    queries: Float[Tensor, "batch head query d_head"],
    values: Float[Tensor, "batch kv_head key d_head"],
    out: Float[Tensor, "batch head query key"] | None = None,
) -> Float[Tensor, "batch head query key"]:
    """`grouped_scores` with both operands heads first: the query heads of one group are
    consecutive in a contiguous `queries`, so stacking them along the query axis is a view,
    and `values` (contiguous `[batch, kv_head, key, d_head]`, or a slice of its keys) is
    read as a transposed view. No operand is copied."""
    n_batch, n_heads, n_query, d_head = queries.shape
    n_kv, n_keys = values.shape[1], values.shape[2]
    stacked = queries.reshape(n_batch, n_kv, (n_heads // n_kv) * n_query, d_head)
    keys = values.transpose(-1, -2)
    if out is None:
        return torch.matmul(stacked, keys).view(n_batch, n_heads, n_query, n_keys)
    torch.matmul(stacked, keys, out=out.view(n_batch, n_kv, -1, n_keys))
    return out


def apply_gram(
    vectors: Float[Tensor, "batch pos head d_head"],
    gram: Float[Tensor, "head d_head d_head"],
) -> Float[Tensor, "batch pos head d_head"]:
    """`vectors[b,p,h] @ G^h` for every head."""
    return torch.einsum("bphd,hde->bphe", vectors, gram)


def projected_value_norms(
    values: Float[Tensor, "batch key kv_head d_head"],
    gram: Float[Tensor, "head d_head d_head"],
) -> Float[Tensor, "batch head key"]:
    """`||pv_j^h|| = sqrt(v_j G^h v_j^T)` for every query head `h`."""
    n_heads = gram.shape[0]
    n_kv = values.shape[2]
    grouped = einops.rearrange(gram, "(kv g) d e -> kv g d e", kv=n_kv)
    sq = torch.einsum("bjkd,kgde,bjke->bkgj", values, grouped, values)
    sq = einops.rearrange(sq, "b kv g j -> b (kv g) j")
    assert sq.shape[1] == n_heads
    return sq.clamp_min(0).sqrt()


def head_output_norms(
    z: Float[Tensor, "batch query head d_head"],
    gram: Float[Tensor, "head d_head d_head"],
    z_gram: Float[Tensor, "batch query head d_head"] | None = None,
) -> Float[Tensor, "batch head query"]:
    """`||o_i^h|| = sqrt(z_i^h G^h (z_i^h)^T)` (`z_gram`: `apply_gram(z, gram)` when the
    caller has it already)."""
    z_gram = apply_gram(z, gram) if z_gram is None else z_gram
    sq = (z_gram * z).sum(-1).transpose(1, 2)
    return sq.clamp_min(0).sqrt()


def project_into_heads(
    vectors: Float[Tensor, "batch pos d_model"], W_O: Float[Tensor, "head d_head d_model"]
) -> Float[Tensor, "batch pos head d_head"]:
    """`W_O^h x^T` for every head: a `d_model` vector read in each head's value space."""
    flat = einops.rearrange(W_O, "h d m -> m (h d)")
    out = torch.matmul(vectors, flat)
    return einops.rearrange(out, "b p (h d) -> b p h d", h=W_O.shape[0])


def key_norm_scale(
    key_norms: Float[Tensor, "batch head key"],
) -> Float[Tensor, "batch head query"]:
    """`max_{j <= i} ||pv_j^h||` for every query position `i` (the scale of `o_i^h`)."""
    return key_norms.cummax(dim=-1).values


def zero_output_rows(
    output_norm: Float[Tensor, "*rows"], scale: Float[Tensor, "*rows"]
) -> Bool[Tensor, "*rows"]:
    """Queries whose output norm is numerically zero: `||o_i|| <= 1e-6 * scale_i`.

    `scale` is `key_norm_scale` (intra) or its sum over heads (inter); NaN/inf norms
    count as zero rows too.
    """
    return ~(output_norm > ZERO_OUTPUT_RTOL * scale) | ~torch.isfinite(output_norm)


# -------------------------------------------------------- sinks (P1, docs/methods.md#sinks)
# Head-space forms: a value-space vector a (d_head) of head h stands for the d_model vector
# a W_O^h, so <a W_O^h, b W_O^h> = a G^h b^T.


def gram_inner(
    a: Float[Tensor, "batch pos head d_head"],
    b: Float[Tensor, "batch pos head d_head"],
    gram: Float[Tensor, "head d_head d_head"],
) -> Float[Tensor, "batch head pos"]:
    """`<a W_O^h, b W_O^h> = a G^h b^T` per (batch, head, position)."""
    return (apply_gram(a, gram) * b).sum(-1).transpose(1, 2)


def gram_products(
    vectors: Float[Tensor, "batch pos head vector d_head"],
    gram: Float[Tensor, "head d_head d_head"],
) -> Float[Tensor, "batch head pos vector vector"]:
    """Every pair's `<a W_O^h, b W_O^h> = a G^h b^T` among several vectors per (batch,
    position, head): one product with the Gram matrices and one batched product, whatever the
    number of vectors (`gram_inner` of each pair would repeat both per pair).

    Args:
        vectors: `n` value-space vectors per (batch, position, head).
        gram: `G^h = W_O^h W_O^h^T` per head.

    Returns:
        `[batch, head, pos, n, n]`: entry `(a, b)` is `<vectors[a] W_O^h, vectors[b] W_O^h>`.

    Examples:
        >>> import torch
        >>> vectors, gram = torch.randn(2, 3, 4, 2, 5), torch.eye(5).expand(4, 5, 5)
        >>> products = gram_products(vectors, gram)
        >>> a, b = vectors[..., 0, :], vectors[..., 1, :]
        >>> bool(torch.allclose(products[..., 0, 1], gram_inner(a, b, gram), atol=1e-5))
        True
    """
    applied = torch.einsum("bphnd,hde->bphne", vectors, gram)
    return (applied @ vectors.transpose(-1, -2)).transpose(1, 2)


def values_per_head(
    values: Float[Tensor, "batch key kv_head d_head"], n_heads: int
) -> Float[Tensor, "batch head key d_head"]:
    """The value each query head reads (a small gather; the `[query, key]` products never
    repeat values)."""
    return einops.rearrange(expand_kv(values, n_heads), "b k h d -> b h k d")


def sink_rate(
    attention: Float[Tensor, "batch head query key"], sink_mask: Bool[Tensor, "batch key"]
) -> Float[Tensor, "batch head query"]:
    """`s_i^h = sum_{j in sinks} alpha[i,j]^h`."""
    return (attention * sink_mask[:, None, None, :].to(attention.dtype)).sum(-1)


def sink_term(
    attention: Float[Tensor, "batch head query key"],
    values: Float[Tensor, "batch key kv_head d_head"],
    sink_mask: Bool[Tensor, "batch key"],
    cols: Tensor | None = None,
) -> Float[Tensor, "batch query head d_head"]:
    """`sum_{j in sinks} alpha[i,j] v_j` — the sink's share of `z_i` (value space).

    Only the (few) sink columns are read: the positions that are a sink in any row.

    Args:
        attention: The attention of a block of query rows.
        values: The values of its keys.
        sink_mask: True at the sink positions of each row.
        cols: The positions that are a sink in some row, ascending, when the caller knows
            them (found here from the mask, they cost a device synchronisation).

    Returns:
        The sink term `[batch, query, head, d_head]`.
    """
    if cols is None:
        cols = sink_mask.any(0).nonzero().flatten()
        cols = cols[cols < attention.shape[-1]]
    if cols.numel() == 0:
        b, h, q, _ = attention.shape
        return attention.new_zeros(b, q, h, values.shape[-1])
    alpha = attention[..., cols] * sink_mask[:, None, None, cols].to(attention.dtype)
    per_head = values_per_head(values[:, cols], attention.shape[1])  # [b, h, s, d]
    return torch.einsum("bhqs,bhsd->bqhd", alpha, per_head)


def counterfactual_sink_rate(
    tail_mixture: Float[Tensor, "batch query head d_head"],
    sink_value: Float[Tensor, "batch query head d_head"],
    gram: Float[Tensor, "head d_head d_head"],
) -> Float[Tensor, "batch head query"]:
    """`s* = clamp(<m, m - pv_0> / ||m - pv_0||^2, 0, 1)`: the sink rate minimising
    `||s pv_0 + (1 - s) m||` along the convex curve `o(s) = s pv_0 + (1 - s) m`
    (docs/methods.md#sinks).

    `tail_mixture` is `m_i = sum_{j not sink} alpha[i,j] v_j / (1 - s_i)` and `sink_value`
    the (attention-weighted) sink value, both in value space. NaN where `m = pv_0`.
    """
    u = tail_mixture - sink_value
    return curve_minimiser(gram_inner(tail_mixture, u, gram), gram_inner(u, u, gram))


def curve_minimiser(
    mixture_dot_difference: Float[Tensor, "*rows"], difference_norm2: Float[Tensor, "*rows"]
) -> Float[Tensor, "*rows"]:
    """`s* = clamp(<m, m - pv_0> / ||m - pv_0||^2, 0, 1)` from its two inner products
    (`counterfactual_sink_rate` computes them; a caller with every inner product at hand
    passes them).

    Args:
        mixture_dot_difference: `<m, m - pv_0>` (in the model's output space).
        difference_norm2: `||m - pv_0||^2`.

    Returns:
        `s*`, NaN where `||m - pv_0|| = 0`.
    """
    s_star = mixture_dot_difference / difference_norm2
    return torch.where(
        difference_norm2 > 0, s_star.clamp(0.0, 1.0), torch.full_like(s_star, float("nan"))
    )


def weak_tail(
    attention: Float[Tensor, "batch head query key"],
    values: Float[Tensor, "batch key kv_head d_head"],
    tail_mask: Bool[Tensor, "batch head query key"],
    k: int = 4,
) -> tuple[Float[Tensor, "batch query head d_head"], Bool[Tensor, "batch head query"]]:
    """Semantic drift of the weakly attended tokens: `d_i = sum_{weak} alpha[i,j] v_j`.

    The tail (`tail_mask`: real, non-sink keys `j <= i`) is split into its `k` most
    attended tokens and the rest (the weak tokens). Returns `d_i` in value space and whether
    query `i` has any weak token (a tail longer than `k`).
    """
    alpha = attention.masked_fill(~tail_mask, 0.0)
    n_tail = tail_mask.sum(-1)
    k_eff = min(k, attention.shape[-1])
    top_alpha, top_idx = alpha.topk(k_eff, dim=-1)  # [b, h, q, k]
    per_head = values_per_head(values, attention.shape[1])  # [b, h, key, d]
    top_values = torch.gather(
        per_head[:, :, None].expand(-1, -1, top_idx.shape[2], -1, -1),
        3,
        top_idx[..., None].expand(-1, -1, -1, -1, per_head.shape[-1]),
    )  # [b, h, q, k, d]
    strong = torch.einsum("bhqk,bhqkd->bqhd", top_alpha, top_values)
    tail = grouped_scores_values(alpha, values)
    return tail - strong, n_tail > k_eff


def grouped_scores_values(
    weights: Float[Tensor, "batch head query key"],
    values: Float[Tensor, "batch key kv_head d_head"],
) -> Float[Tensor, "batch query head d_head"]:
    """`sum_j weights[b,h,i,j] v_j^{g(h)}` (an attention-weighted value sum, GQA-grouped)."""
    n_kv = values.shape[2]
    stacked = einops.rearrange(weights, "b (kv g) q k -> b kv (g q) k", kv=n_kv)
    out = torch.matmul(stacked, einops.rearrange(values, "b k kv d -> b kv k d"))
    return einops.rearrange(out, "b kv (g q) d -> b q (kv g) d", q=weights.shape[2])
