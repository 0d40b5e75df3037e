r"""The definition of contribution weights, in plain tensor code: one layer, in float64.

For query `i`, key `j` and head `h` of one layer (Cunningham & Muca Cirone, "Contribution
Weights: A Geometrical Analysis of Self-Attention Transformers", ICML 2026; docs/methods.md):

    pv_j^h  = v_j^h W_O^h                       the projected value of key j
    y_ij^h  = alpha_ij^h pv_j^h                 what key j adds to the head's output
    o_i^h   = sum_j y_ij^h = z_i^h W_O^h        the head output (b_O excluded)
    o_i     = sum_h o_i^h                       the layer output
    intra  c_ij^h = < y_ij^h, o_i^h > / ||o_i^h||^2
                  = alpha_ij^h * (||pv_j^h|| / ||o_i^h||) * cos(pv_j^h, o_i^h)
    inter  C_ij^h = < y_ij^h, o_i > / ||o_i||^2

This module computes exactly that, the slow and obvious way: it materialises every `y_ij^h`
vector (`batch × head × query × key × d_model` numbers) and reads each quantity off it. It is
what cw_lens's fast path (`cw_lens.contribution_weights`, which never builds those vectors) is
tested against, and it is the code to read to know what a contribution weight is. Use it on
small inputs: its memory is `d_model` times that of the result.

It knows nothing of models: give it the four tensors TransformerLens hooks hold (`hook_pattern`,
`hook_v`, `hook_z`, and the layer's `W_O`). A query whose output is zero gets NaN or infinite
weights here (the fast path marks such rows NaN and counts them); keys the query does not
attend to (`alpha = 0`) get weight 0.

Examples:
    >>> import torch
    >>> from cw_lens.reference import layer_contributions
    >>> g = torch.Generator().manual_seed(0)
    >>> pattern = torch.rand(1, 2, 3, 3, generator=g).tril().softmax(-1)  # [batch head q k]
    >>> v = torch.randn(1, 3, 2, 4, generator=g)                          # [batch key head d]
    >>> z = torch.einsum("bhqk,bkhd->bqhd", pattern, v)                   # [batch q head d]
    >>> W_O = torch.randn(2, 4, 8, generator=g)                           # [head d d_model]
    >>> ref = layer_contributions(pattern, v, z, W_O)
    >>> bool(torch.allclose(ref["weights"].sum(-1), torch.ones(1, 2, 3, dtype=torch.float64)))
    True
    >>> factors = ref["attention"] * ref["relative_norm"] * ref["cosine"]
    >>> bool(torch.allclose(factors, ref["weights"]))
    True
"""

from __future__ import annotations

from typing import Literal

import torch
from jaxtyping import Float
from torch import Tensor

__all__ = ["layer_contributions"]


def layer_contributions(
    pattern: Float[Tensor, "batch head query key"],
    v: Float[Tensor, "batch key kv_head d_head"],
    z: Float[Tensor, "batch query head d_head"] | None,
    W_O: Float[Tensor, "head d_head d_model"],
    *,
    kind: Literal["intra", "inter"] = "intra",
) -> dict[str, Tensor]:
    """Contribution weights and their three factors for one layer, from materialised vectors.

    Args:
        pattern: The attention pattern (`hook_pattern`).
        v: The values (`hook_v`); with grouped-query attention, `head` is a multiple of
            `kv_head` and query head `h` reads key/value head `h // (head / kv_head)`.
        z: The heads' mixed values (`hook_z`), checked against `pattern @ v`; None: not checked.
        W_O: The layer's output projection.
        kind: `"intra"` (each head's weights over its own output) or `"inter"` (over the
            layer's output).

    Returns:
        float64 tensors by name: `weights`, `attention`, `relative_norm` and `cosine` (their
        product is `weights`), `value_norm` (`alpha ||pv||`), `value_norm_output`
        (`alpha ||pv|| / ||o^h||`), each `[batch, head, query, key]`; `projected_values`
        `[batch, head, key, d_model]`; `head_output` `[batch, head, query, d_model]`;
        `layer_output` `[batch, query, d_model]`.

    Raises:
        ValueError: when the shapes do not fit together, `kind` is neither, or `z` is not
            `pattern @ v` (the hooks are not wired as this definition reads them).
    """
    if kind not in ("intra", "inter"):
        raise ValueError(f"kind is 'intra' or 'inter', not {kind!r}.")
    pattern, v, W_O = (t.detach().double() for t in (pattern, v, W_O))
    z = None if z is None else z.detach().double()
    n_heads, n_kv = pattern.shape[1], v.shape[2]
    if n_heads % n_kv or W_O.shape[0] != n_heads or v.shape[1] != pattern.shape[-1]:
        raise ValueError(
            f"pattern {tuple(pattern.shape)}, v {tuple(v.shape)} and W_O {tuple(W_O.shape)} do "
            "not fit: pattern is [batch, head, query, key], v [batch, key, kv_head, d_head] "
            "with head a multiple of kv_head, W_O [head, d_head, d_model]."
        )
    group = n_heads // n_kv
    v_of_head = torch.stack([v[:, :, h // group] for h in range(n_heads)], dim=1)  # b h k d
    if z is not None:
        mixed = torch.einsum("bhqk,bhkd->bqhd", pattern, v_of_head)
        if not torch.allclose(z, mixed, rtol=1e-4, atol=1e-5):
            raise ValueError(
                "z is not pattern @ v (largest difference "
                f"{(z - mixed).abs().max().item():.3g}): the hooks do not hold what this "
                "definition reads."
            )
    pv = torch.stack([v_of_head[:, h] @ W_O[h] for h in range(n_heads)], dim=1)  # b h k m
    y = pattern[..., None] * pv[:, :, None, :, :]  # [batch, head, query, key, d_model]
    head_output = y.sum(3)  # [batch, head, query, d_model]
    layer_output = head_output.sum(1)  # [batch, query, d_model]
    target = head_output if kind == "intra" else layer_output[:, None].expand_as(head_output)
    target_norm = target.norm(dim=-1)  # [batch, head, query]
    weights = (y * target[:, :, :, None, :]).sum(-1) / target_norm[..., None] ** 2
    pv_norm = pv.norm(dim=-1)  # [batch, head, key]
    cosine = torch.nn.functional.cosine_similarity(
        pv[:, :, None, :, :], target[:, :, :, None, :], dim=-1
    )
    value_norm = pattern * pv_norm[:, :, None, :]
    return {
        "weights": weights,
        "attention": pattern,
        "relative_norm": pv_norm[:, :, None, :] / target_norm[..., None],
        "cosine": cosine,
        "value_norm": value_norm,
        "value_norm_output": value_norm / head_output.norm(dim=-1)[..., None],
        "projected_values": pv,
        "head_output": head_output,
        "layer_output": layer_output,
    }
