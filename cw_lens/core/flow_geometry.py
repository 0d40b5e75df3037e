r"""The pure math of contribution flow (docs/methods.md#flow) in head space — no TransformerLens
inside.

The residual stream of position `i` after block `l` is a sum of pieces:

    x_{l+1,i} = x_{l,i} + sum_h sum_{j<=i} A_i(alpha[i,j]^h pv_j^h) + (A_i(b_O) + beta) + f_i

with `pv_j^h = v_j^{g(h)} W_O^h` the projected value, `f_i` the MLP output (after any post-MLP
norm) and `A_i` the identity on pre-norm blocks. On post-norm blocks (Gemma 2/3, OLMo 2/3)
`A_i` is the post-attention norm **linearised at its actual input** `a_i = o_i + b_O`: with
the centring `C` (`p - mean(p)` for LayerNorm, the identity for RMSNorm), the gain `g` and
the row scale `r_i = 1 / sqrt(mean(C(a_i)^2) + eps)` computed on `a_i` and then held fixed,
`A_i(p) = r_i g ⊙ C(p)` is linear in each piece and `beta` (the norm's bias) goes with the
bias piece. Then `sum_pieces A_i(piece) + beta` is exactly the norm's real output.

**Projection shares** (the same form as P1's inter-head contribution weights, on the residual
stream): `share(p) = <p, x_{l+1,i}> / ||x_{l+1,i}||^2`; they sum to 1 over the pieces.

Head-space arithmetic, never a `[query, key, d_model]` tensor. `A_i` is self-adjoint up to
the fixed scale, so `<A_i(p), y> = <p, u_i>` with the **read vector**

    u_i = r_i C(g ⊙ y_i) / ||y_i||^2          (y_i = x_{l+1,i})

and the share of the pair `(h, j)` is `alpha[i,j]^h v_j^{g(h)} (W_O^h u_i^T)` — `u_i`
projected into each head once, then one `query x key` product per head, the cost of `QK^T`
(`pair_shares`).

**Token-level matrix** of a block: `T[i, j] = sum_h share(h, j)` for `j != i` and
`T[i, i] = sum_h share(h, i) + share(residual) + share(MLP) + share(bias)`; rows sum to 1.
**Contribution rollout** `R = T_{L-1} ... T_0` (`compose`); **attention rollout**
(Abnar & Zuidema 2020, "Quantifying Attention Flow in Transformers") composes
`0.5 * mean_h alpha + 0.5 I` with rows re-normalised to sum to 1
(`attention_rollout_step`). Both treat shares as linear
mixing of the token streams — a heuristic, like ALTI's aggregation (Ferrando et al. 2022).

**Route graphs** (Ferrando & Voita 2024, "Information Flow Routes"; `trace_routes`), with
their two sub-layer steps per sequential block, `x_l -> m_l` (pairs and the residual) and
`m_l -> x_{l+1}` (the residual and the MLP), one step per parallel block: from the top node
`(L, target)` keep every edge whose share exceeds the threshold; continue from every node
reached.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from jaxtyping import Bool, Float, Int
from torch import Tensor

from cw_lens.core.geometry import grouped_scores, head_gram, project_into_heads

# A residual stream whose norm is below this (absolute, float32) has undefined shares.
ZERO_STREAM_NORM = 1e-12


def center(x: Float[Tensor, "... d_model"], centred: bool) -> Float[Tensor, "... d_model"]:
    """`C(x) = x - mean(x)` (LayerNorm) or `x` (RMSNorm, identity maps)."""
    return x - x.mean(-1, keepdim=True) if centred else x


def norm_row_scale(
    a: Float[Tensor, "batch pos d_model"], eps: float, centred: bool
) -> Float[Tensor, "batch pos"]:
    """`r_i = 1 / sqrt(mean(C(a_i)^2) + eps)`: the norm's scale at its actual input."""
    c = center(a, centred)
    return torch.rsqrt(c.pow(2).mean(-1) + eps)


def apply_linear_map(
    p: Float[Tensor, "batch pos d_model"],
    row_scale: Float[Tensor, "batch pos"] | None,
    gain: Float[Tensor, " d_model"] | None,
    centred: bool,
) -> Float[Tensor, "batch pos d_model"]:
    """`A_i(p) = r_i g ⊙ C(p)` (the identity when `row_scale` and `gain` are None)."""
    out = center(p, centred)
    if gain is not None:
        out = out * gain
    if row_scale is not None:
        out = out * row_scale[..., None]
    return out


def read_vectors(
    y: Float[Tensor, "batch pos d_model"],
    row_scale: Float[Tensor, "batch pos"] | None,
    gain: Float[Tensor, " d_model"] | None,
    centred: bool,
) -> tuple[Float[Tensor, "batch pos d_model"], Float[Tensor, "batch pos"]]:
    """`u_i = r_i C(g ⊙ y_i) / ||y_i||^2` and `||y_i||^2`, so `<A_i(p), y_i> /
    ||y_i||^2 = <p, u_i>`. Rows with `||y_i|| <= 1e-12` get NaN (undefined shares)."""
    sq = y.pow(2).sum(-1)
    inv = sq.reciprocal().masked_fill(sq <= ZERO_STREAM_NORM**2, float("nan"))
    u = y * gain if gain is not None else y
    u = center(u, centred)
    scale = inv if row_scale is None else inv * row_scale
    return u * scale[..., None], sq


def head_read_vectors(
    u: Float[Tensor, "batch pos d_model"], W_O: Float[Tensor, "head d_head d_model"]
) -> Float[Tensor, "batch pos head d_head"]:
    """`W_O^h u_i^T` for every head: the read vector in each head's value space."""
    return project_into_heads(u, W_O)


def pair_shares(
    pattern: Float[Tensor, "batch head query key"],
    values: Float[Tensor, "batch key kv_head d_head"],
    head_side: Float[Tensor, "batch query head d_head"],
    out: Float[Tensor, "batch head query key"] | None = None,
) -> Float[Tensor, "batch head query key"]:
    """`share(h, j)[i] = alpha[i,j]^h <v_j^{g(h)}, W_O^h u_i>` (GQA grouped, no repeat).

    `pattern` holds the query rows of `head_side` and the keys of `values`; `out` (a
    contiguous buffer of the result's shape) receives the result when given.
    """
    scores = grouped_scores(head_side, values, out=out)
    return scores.mul_(pattern)


def token_matrix(
    pairs_over_heads: Float[Tensor, "batch query key"],
    self_share: Float[Tensor, "batch query"],
    first_query: int = 0,
) -> Float[Tensor, "batch query key"]:
    """`T[i, j] = sum_h share(h, j)`, plus `self_share[i]` (residual + MLP + bias) on the
    diagonal `j = i`. Rows are the query positions `first_query, first_query + 1, ...`;
    the input is modified in place and returned."""
    n_rows = pairs_over_heads.shape[1]
    rows = torch.arange(n_rows, device=pairs_over_heads.device)
    pairs_over_heads[:, rows, rows + first_query] += self_share
    return pairs_over_heads


def attention_rollout_step(
    pattern: Float[Tensor, "batch head query key"],
) -> Float[Tensor, "batch query key"]:
    """Abnar & Zuidema's per-layer matrix: `S = 0.5 * mean_h alpha + 0.5 I` with each row
    re-normalised, `S[i, :] / sum_j S[i, j]`, so rows sum to 1 even where the attention rows
    do not (GPT-OSS's learned sink logits take part of the softmax mass). Square pattern; the
    row sum is at least 0.5, so the division is always defined."""
    step = pattern.mean(1) * 0.5
    n = step.shape[-1]
    idx = torch.arange(n, device=step.device)
    step[:, idx, idx] += 0.5
    return step.div_(step.sum(-1, keepdim=True))


def compose(
    rollout: Float[Tensor, "batch query key"] | None, step: Float[Tensor, "batch query key"]
) -> Float[Tensor, "batch query key"]:
    """`step @ rollout` (the rollout so far is `T_l ... T_0`; `None` means the identity)."""
    return step.clone() if rollout is None else torch.bmm(step, rollout)


def effective_gram(
    W_O: Float[Tensor, "head d_head d_model"],
    gain: Float[Tensor, " d_model"] | None,
    centred: bool,
) -> Float[Tensor, "head d_head d_head"]:
    """Gram matrix of `W_O^h C diag(g)`: `||A_i(pv_j^h)||^2 = r_i^2 v_j G_eff^h v_j^T`."""
    W = center(W_O, centred)
    if gain is not None:
        W = W * gain
    return head_gram(W)


def trace_routes(
    steps: Sequence[
        tuple[tuple[Int[Tensor, " n"], Int[Tensor, " n"]], Sequence[Bool[Tensor, " pos"]]]
    ],
    n_pos: int,
    target: int,
) -> tuple[list[Bool[Tensor, " n"]], Bool[Tensor, "level pos"]]:
    """Trace the route graph back from the top node `(top level, target)` (docs/methods.md#flow).

    The graph is a stack of steps; step `s` leads from level `s` to level `s + 1`
    (a block, or a sub-layer step of one: `x_l -> m_l -> x_{l+1}`).

    Args:
        steps: Per step, the candidate pair edges above the threshold as `(query, key)`
            index tensors (edge `(s, key) -> (s+1, query)`), and the same-position edges
            (residual, MLP) as masks `[pos]`, True where the edge `(s, i) -> (s+1, i)`
            exceeds the threshold.
        n_pos: Positions.
        target: The position whose top node the routes explain.

    Returns:
        Per step, which candidate pair edges lie on a route (reachable back from the target),
        and the nodes reached `[n_steps + 1, pos]` (row `s` = level `s`).
    """
    n_steps = len(steps)
    reached = torch.zeros(n_steps + 1, n_pos, dtype=torch.bool, device="cpu")
    reached[n_steps, target] = True
    kept: list[Tensor] = [torch.zeros(0, dtype=torch.bool, device="cpu")] * n_steps
    for s in range(n_steps - 1, -1, -1):
        (query, key), same = steps[s]
        on_route = reached[s + 1][query.cpu()]
        kept[s] = on_route
        reached[s, key.cpu()[on_route]] = True
        for mask in same:
            reached[s] |= reached[s + 1] & mask.cpu()
    return kept, reached
