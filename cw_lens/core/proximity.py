r"""L1-proximity contributions (ALTI), pure tensor math.

ALTI (Ferrando et al., "Measuring the Mixing of Contextual Information in the Transformer",
EMNLP 2022), as the LLM Transparency Tool computes it for attention, scores each part `p_k` of a
vector `w = sum_k p_k` by how much nearer to `w` it is than the origin, in the L1 norm, clipped
at a small `eps` and normalised over the parts:

    c_k = max(||w||_1 - ||w - p_k||_1, eps) / sum_m max(||w||_1 - ||w - p_m||_1, eps)

For one attention layer and query `i` the parts are the residual stream `x_i` and, for every
head `h` and key `j <= i`, the piece `A_i(alpha_ij^h pv_j^h)` that the pair adds to the stream
(`pv_j^h = v_j^h W_O^h`; `A_i` the identity, or the post-attention norm linearised at row `i`);
the whole is the stream after the attention sub-layer, `x_i + attn_out_i` (`resid_mid` on a
sequential block; the output bias is part of the whole, not a part). The L1 norm rules out the
Gram-matrix shortcuts of the contribution weights: each `(head, query, key)` part is formed in
`d_model`, so the query rows are taken in chunks that keep memory flat. The norms are taken in
float64: `||w||_1 - ||w - p||_1` cancels, and in float32 a residual stream with large entries
left errors of 2e-4 of a query's largest score on SmolLM2.

Example:

    import torch
    from cw_lens.core.proximity import attention_proximity

    b, h, n, d = 1, 2, 4, 8
    pattern = torch.softmax(torch.randn(b, h, n, n), -1).tril()
    head_vectors = torch.randn(b, h, n, d)
    resid = torch.randn(b, n, d)
    whole = resid + torch.einsum("bhqk,bhkd->bqd", pattern, head_vectors)
    valid = torch.ones(n, n, dtype=torch.bool).tril()[None]
    pairs, residual = attention_proximity(pattern, head_vectors, None, resid, whole, valid)
    pairs.sum((1, 3)) + residual  # 1 at every query
"""

from __future__ import annotations

import torch
from jaxtyping import Bool, Float
from torch import Tensor

# the clip of LLM-TT's `get_contributions`: a part farther from the whole than the origin scores
# this, not 0, so every query's normaliser is positive
PROXIMITY_EPS = 1e-5
# elements of one `[batch, head, query, key, d_model]` chunk (64 MiB of float64)
CHUNK_ELEMENTS = 2**23


def proximity(
    whole: Float[Tensor, "... d_model"], part: Float[Tensor, "... d_model"], eps: float
) -> Float[Tensor, "..."]:
    """The unnormalised ALTI score `max(||w||_1 - ||w - p||_1, eps)` (broadcast over `...`).

    Args:
        whole: The whole vector `w`.
        part: One part `p` per leading index.
        eps: The clip.

    Returns:
        The clipped L1 proximity per leading index.
    """
    return (whole.abs().sum(-1) - (whole - part).abs().sum(-1)).clamp_min(eps)


def attention_proximity(
    pattern: Float[Tensor, "batch head query key"],
    head_vectors: Float[Tensor, "batch head key d_model"],
    row_scale: Float[Tensor, "batch query"] | None,
    resid_pre: Float[Tensor, "batch query d_model"],
    whole: Float[Tensor, "batch query d_model"],
    valid: Bool[Tensor, "batch query key"],
    *,
    eps: float = PROXIMITY_EPS,
    chunk_elements: int = CHUNK_ELEMENTS,
) -> tuple[Float[Tensor, "batch head query key"], Float[Tensor, "batch query"]]:
    """ALTI contributions of every (head, key) pair and of the residual stream, per query.

    The pair part is `pattern[b,h,i,j] * row_scale[b,i] * head_vectors[b,h,j]`; the parts of a
    query are its valid pairs and `resid_pre`, normalised to sum to 1.

    Args:
        pattern: The attention `alpha`.
        head_vectors: `pv_j^h` as it enters the stream, before the row scale (`gain ⊙ C(pv)`
            under a post-attention norm, else `pv`).
        row_scale: The post-attention norm's scale per row (`None`: 1).
        resid_pre: The stream before the layer, `x_i`.
        whole: The stream after the attention sub-layer.
        valid: The pairs that are parts (`j <= i`, real keys and queries).
        eps: The clip (LLM-TT's 1e-5).
        chunk_elements: Elements of one chunk of parts (memory), at least one query row.

    Returns:
        `(pairs, residual)`: the pairs' contributions (0 at invalid pairs) and the residual's,
        float32 (computed in float64); rows with no valid pair hold 0 pairs and a residual of 1.
    """
    n_batch, n_heads, n_query, n_key = pattern.shape
    d_model = head_vectors.shape[-1]
    per_row = n_batch * n_heads * n_key * d_model
    step = max(1, chunk_elements // max(per_row, 1))
    f64 = torch.float64
    whole, head_vectors = whole.to(f64), head_vectors.to(f64)
    pairs = torch.empty(n_batch, n_heads, n_query, n_key, device=pattern.device, dtype=f64)
    for start in range(0, n_query, step):
        rows = slice(start, min(start + step, n_query))
        alpha = pattern[:, :, rows, :, None].to(f64)
        if row_scale is not None:
            alpha = alpha * row_scale[:, None, rows, None, None]
        parts = alpha * head_vectors[:, :, None]  # [batch, head, rows, key, d_model]
        pairs[:, :, rows] = proximity(whole[:, None, rows, None, :], parts, eps)
    pairs.masked_fill_(~valid[:, None], 0.0)
    residual = proximity(whole, resid_pre.to(f64), eps)
    total = pairs.sum((1, 3)) + residual
    return (pairs / total[:, None, :, None]).float(), (residual / total).float()
