"""Slow, obviously-right references: materialise every ``alpha[i,j] pv_j`` vector (float64).

Nothing here is shared with the fast path in ``cw_lens.geometry``: the projected values are
built explicitly as ``d_model`` vectors and every quantity is read off them.
"""

from __future__ import annotations

import torch


def dense_contributions(pattern, values, W_O, kind="intra"):
    """Every field of SPEC §2 from materialised vectors.

    Args:
        pattern: [batch, head, query, key]; values: [batch, key, kv_head, d_head];
        W_O: [head, d_head, d_model].
    Returns:
        dict of float64 tensors [batch, head, query, key] (weights, cosine, relative_norm,
        value_norm, value_norm_output, attention) plus head/layer outputs.
    """
    pattern, values, W_O = (t.double() for t in (pattern, values, W_O))
    n_heads = pattern.shape[1]
    group = n_heads // values.shape[2]
    pv = torch.stack(
        [values[:, :, h // group, :] @ W_O[h] for h in range(n_heads)], dim=1
    )  # [batch, head, key, d_model]
    y = pattern[..., None] * pv[:, :, None, :, :]  # [batch, head, query, key, d_model]
    head_out = y.sum(3)  # [batch, head, query, d_model]
    layer_out = head_out.sum(1)  # [batch, query, d_model]
    target = head_out if kind == "intra" else layer_out[:, None].expand_as(head_out)
    tnorm = target.norm(dim=-1)  # [batch, head, query]
    weights = (y * target[:, :, :, None, :]).sum(-1) / tnorm[..., None] ** 2
    pv_norm = pv.norm(dim=-1)  # [batch, head, key]
    cos = torch.nn.functional.cosine_similarity(
        pv[:, :, None, :, :], target[:, :, :, None, :], dim=-1
    )
    rel = pv_norm[:, :, None, :] / tnorm[..., None]
    vn = pattern * pv_norm[:, :, None, :]
    vno = vn / head_out.norm(dim=-1)[..., None]
    return {
        "attention": pattern,
        "weights": weights,
        "cosine": cos,
        "relative_norm": rel,
        "value_norm": vn,
        "value_norm_output": vno,
        "head_output": head_out,
        "layer_output": layer_out,
        "projected_values": pv,
    }


def model_reference(model, tokens, layer, kind="intra", attention_mask=None):
    """Dense reference for one layer of a bridge, from a plain ``run_with_cache``."""
    from cw_lens.capture import cache_names

    with torch.no_grad():
        _, cache = model.run_with_cache(
            tokens,
            attention_mask=attention_mask,
            names_filter=[*cache_names(layer), f"blocks.{layer}.hook_attn_out"],
        )
    W_O = model.blocks[layer].attn.W_O.detach()
    ref = dense_contributions(
        cache[f"blocks.{layer}.attn.hook_pattern"],
        cache[f"blocks.{layer}.attn.hook_v"],
        W_O,
        kind,
    )
    b_O = model.blocks[layer].attn.b_O
    ref["attn_out"] = cache[f"blocks.{layer}.hook_attn_out"].double()
    ref["b_O"] = None if b_O is None else b_O.detach().double()
    return ref


def causal_rows(n: int) -> torch.Tensor:
    return torch.ones(n, n, dtype=torch.bool).tril()


def assert_rows_close(
    actual, expected, rtol=1e-5, valid=None, what="", row_dims=(-1,), row_tolerance=None
):
    """``|actual - expected| <= rtol * max|expected|`` within every row.

    A relative test per row: the weights that share one normalisation share one scale, and
    entries that cancel to ~0 are judged against the row's largest entry, not themselves. A
    row is the key axis (``row_dims=(-1,)``, intra: ``sum_j c = 1`` per head) or heads and keys
    (``row_dims=(1, -1)`` for ``[batch, head, query, key]`` inter weights, ``sum_h sum_j C =
    1``). ``valid`` (broadcastable bool) selects the entries compared; NaN must match NaN.
    ``row_tolerance`` (broadcastable) multiplies ``rtol`` per row (see :func:`tolerance`).
    """
    a = torch.as_tensor(actual).double()
    e = torch.as_tensor(expected).double().to(a.device)
    if valid is not None:
        v = torch.as_tensor(valid).to(a.device).expand_as(e)
        a = torch.where(v, a, torch.zeros((), dtype=a.dtype))
        e = torch.where(v, e, torch.zeros((), dtype=e.dtype))
    nan_a, nan_e = a.isnan(), e.isnan()
    assert torch.equal(nan_a, nan_e), (
        f"{what}: NaN pattern differs ({int(nan_a.sum())} vs {int(nan_e.sum())})"
    )
    a, e = a.nan_to_num(0.0), e.nan_to_num(0.0)
    scale = e.abs().amax(dim=row_dims, keepdim=True).clamp_min(1e-30)
    rel = (a - e).abs() / scale
    if row_tolerance is not None:
        rel = rel / torch.as_tensor(row_tolerance).double()
    err = rel.max().item()
    assert err <= rtol, f"{what}: max row-relative error {err:.3e} > {rtol:.1e}"
    return err


def make_activations(pattern, values, W_O, mask=None, b_O=None):
    """LayerActivations from plain tensors (z and o computed densely, independently)."""
    from cw_lens.capture import LayerActivations, LayerWeights
    from cw_lens.geometry import head_gram
    from cw_lens.inputs import TokenBatch

    n_batch, n_heads, n_pos, _ = pattern.shape
    group = n_heads // values.shape[2]
    vrep = values.repeat_interleave(group, dim=2)
    z = torch.einsum("bhqk,bkhd->bqhd", pattern, vrep)
    out = torch.einsum("bqhd,hdm->bqm", z, W_O)
    if mask is None:
        mask = torch.ones(n_batch, n_pos, dtype=torch.bool)
    batch = TokenBatch(
        torch.zeros(n_batch, n_pos, dtype=torch.long), mask, True, None, list(range(n_batch))
    )
    return LayerActivations(
        layer=0,
        pattern=pattern,
        values=values,
        z=z,
        layer_output=out,
        weights=LayerWeights(W_O, b_O, head_gram(W_O)),
        mask=mask,
        batch=batch,
    )


def random_pattern(n_batch, n_heads, n_pos, generator, temperature=2.0, mask=None):
    """Causal softmax attention over random scores (padded keys never attended)."""
    scores = torch.randn(n_batch, n_heads, n_pos, n_pos, generator=generator) * temperature
    causal = torch.ones(n_pos, n_pos, dtype=torch.bool).tril()
    allowed = causal[None, None].expand(n_batch, n_heads, n_pos, n_pos).clone()
    if mask is not None:
        allowed &= mask[:, None, None, :]
        # a padded query row still needs one key: let it see key 0
        allowed[..., 0] = True
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.softmax(scores, dim=-1)


def condition_number(ref, kind="intra"):
    """``kappa_i = sum_j alpha ||pv_j|| / ||o_i||`` per [batch, head, query, 1] row (float64).

    A query whose output nearly cancels (kappa large) has weights that float32 can only give
    to about ``kappa * 1e-7`` relative accuracy — the model's own ``z`` carries that error.
    """
    bound = ref["value_norm"].sum(-1)  # [batch, head, query]
    if kind == "intra":
        kappa = bound / ref["head_output"].norm(dim=-1)
    else:
        kappa = bound.sum(1, keepdim=True) / ref["layer_output"].norm(dim=-1)[:, None]
        kappa = kappa.expand_as(bound)
    return kappa[..., None]


def tolerance(ref, kind="intra", well_conditioned=20.0):
    """Row tolerance multiplier: 1 for ``kappa <= 20``, growing as ``kappa / 20`` beyond."""
    return (condition_number(ref, kind) / well_conditioned).clamp_min(1.0)
