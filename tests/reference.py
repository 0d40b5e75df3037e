"""Slow, obviously-right references: materialise every ``alpha[i,j] pv_j`` vector (float64).

Nothing here is shared with the fast path in ``cw_lens.core.geometry``: the projected values are
built explicitly as ``d_model`` vectors and every quantity is read off them. The definition of a
contribution weight itself is public, ``cw_lens.reference``; the rest builds on it.
"""

from __future__ import annotations

import torch

from cw_lens.reference import layer_contributions


def dense_contributions(pattern, values, W_O, kind="intra"):
    """Every field of methods § Contribution weights from materialised vectors: the public
    definition, `cw_lens.reference.layer_contributions` (float64 tensors by name)."""
    return layer_contributions(pattern, values, None, W_O, kind=kind)


def model_reference(model, tokens, layer, kind="intra", attention_mask=None):
    """Dense reference for one layer of a bridge, from a plain ``run_with_cache``."""
    from cw_lens.models.capture import cache_names

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
    from cw_lens.core.geometry import head_gram
    from cw_lens.data.inputs import TokenBatch
    from cw_lens.models.capture import LayerActivations, LayerWeights

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


# ---------------------------------------------------------------------------- planted sinks


def planted_sink_tensors(
    n_docs,
    n_pos,
    n_heads,
    n_kv,
    d_head,
    *,
    seed=0,
    common=1.0,
    sink=-0.3,
    kv_scale=None,
    focus=None,
    rates=None,
    near_one=True,
):
    """Attention patterns and values with a non-degenerate sink at position 0 (float64).

    Values ``v_j = (common * c + 1.5 * noise_j) * e^{0.6 g_j}``: a shared direction ``c`` plus
    noise in every direction and uneven norms; the sink's value is ``sink * c`` (or ``sink``
    itself, a ``[n_kv, d_head]`` tensor) plus a little noise. ``kv_scale`` multiplies each kv
    head's values. Sink rates ``s ~ U(rates[h])`` (default ``(0.2, 0.9)``); with ``near_one``
    head 1 has ``s = 0.9995`` at every 4th query (a tiny tail, which s* skips) and head 2
    ``s = 1`` at every 6th. Tail weights ``exp(focus[h] * normal)`` (default 2: heavy-tailed,
    so the top-4 tokens differ from the weak ones; 0: uniform). Returns ``pattern [doc, head,
    q, k]`` and ``values [doc, k, kv, d]``.
    """
    gen = torch.Generator().manual_seed(seed)
    f64 = dict(generator=gen, dtype=torch.float64)
    c = torch.randn(n_kv, d_head, **f64)
    noise = torch.randn(n_docs, n_pos, n_kv, d_head, **f64)
    scale = torch.exp(0.6 * torch.randn(n_docs, n_pos, n_kv, 1, **f64))
    values = (common * c + 1.5 * noise) * scale
    sink_value = sink.double() if torch.is_tensor(sink) else sink * c
    values[:, 0] = sink_value + 0.1 * noise[:, 0]
    if kv_scale is not None:
        values = values * torch.as_tensor(kv_scale, dtype=torch.float64)[None, None, :, None]
    rates = torch.as_tensor(rates or [(0.2, 0.9)] * n_heads, dtype=torch.float64)
    lo, width = rates[:, 0], rates[:, 1] - rates[:, 0]
    s = lo[None, :, None] + width[None, :, None] * torch.rand(n_docs, n_heads, n_pos, **f64)
    if near_one:
        s[:, 1, 3::4] = 0.9995
        s[:, 2, 5::6] = 1.0
    focus = torch.full((n_heads,), 2.0) if focus is None else torch.as_tensor(focus)
    scores = focus.double()[None, :, None, None] * torch.randn(n_docs, n_heads, n_pos, n_pos, **f64)
    w = torch.exp(scores).masked_fill(~causal_rows(n_pos), 0.0)
    w[..., 0] = 0.0
    w = w / w.sum(-1, keepdim=True).clamp_min(1e-300)
    pattern = w * (1 - s[..., None])
    pattern[..., 0] = s
    pattern[..., 0, :] = 0.0
    pattern[..., 0, 0] = 1.0
    return pattern, values


def projected_values(values, W_O):
    """``pv_j^h = v_j^{g(h)} W_O^h`` as ``[doc, head, key, d_model]`` float64."""
    n_heads = W_O.shape[0]
    group = n_heads // values.shape[2]
    W_O = W_O.double()
    return torch.stack([values[:, :, h // group].double() @ W_O[h] for h in range(n_heads)], 1)


def _cos(x, y):
    return float(x @ y / (x.norm() * y.norm()))


def _queries(pattern, h):
    """``(document, query i >= 1, attention row alpha[i, :i + 1])`` of head ``h``."""
    for b in range(pattern.shape[0]):
        for i in range(1, pattern.shape[2]):
            yield b, i, pattern[b, h, i, : i + 1].double()


def reference_sink_heads(pattern, values, W_O, *, drift_k=4):
    """methods § Attention sinks per head by loops over (document, query), from ``d_model`` vectors
    (sink = 0):
    lists of ``norm_ratio`` (||pv_j|| / ||pv_0||, non-sink j), ``cos_mixture`` cos(pv_0, m_i)
    and ``s_star`` (queries with 1e-6 < s <= 0.999), ``drift_cos`` cos(alpha_0 pv_0, d_i) and
    ``drift_share`` -<alpha_0 pv_0, d_i> / ||d_i||^2 (d_i = the weak tokens: the tail without
    its ``drift_k`` most attended)."""
    pv = projected_values(values, W_O)
    out = []
    for h in range(pattern.shape[1]):
        r = {k: [] for k in ("cos_mixture", "s_star", "drift_cos", "drift_share")}
        norms = pv[:, h].norm(dim=-1)  # [doc, key]
        r["norm_ratio"] = (norms[:, 1:] / norms[:, :1]).flatten().tolist()
        for b, i, a in _queries(pattern, h):
            s = float(a[0])
            if s <= 1e-6:
                continue
            st = s * pv[b, h, 0]
            tail = (a[1:, None] * pv[b, h, 1 : i + 1]).sum(0)
            if s <= 0.999 and tail.norm() > 0:
                r["cos_mixture"].append(_cos(st, tail))
                m = tail / (1 - s)
                u = m - pv[b, h, 0]
                r["s_star"].append(min(max(float(m @ u / (u @ u)), 0.0), 1.0))
            if i > drift_k:
                top = set((torch.topk(a[1:], drift_k).indices + 1).tolist())
                weak = [j for j in range(1, i + 1) if j not in top]
                d = (a[weak, None] * pv[b, h, weak]).sum(0)
                if d.norm() > 0:
                    r["drift_cos"].append(_cos(st, d))
                    r["drift_share"].append(float(-(st @ d) / (d @ d)))
        out.append(r)
    return out


def reference_ablation_heads(pattern, values, W_O):
    """Per head, over queries i >= 1: mean ``||o_i||``, mean ``cos(o_i, u)`` before and after
    removing the sink's term (u = the normalised mean of the non-sink projected values of the
    document), and the relative output norm mean_i ||o_i|| / mean_j ||pv_j|| (per query, per
    document's mean), all from ``d_model`` vectors."""
    pv = projected_values(values, W_O)
    rows = []
    for h in range(pattern.shape[1]):
        acc = {k: [] for k in ("norm_before", "norm_after", "cone_before", "cone_after", "rel")}
        for b, i, a in _queries(pattern, h):
            u = pv[b, h, 1:].mean(0)
            o = (a[:, None] * pv[b, h, : i + 1]).sum(0)
            after = o - a[0] * pv[b, h, 0]
            acc["norm_before"].append(float(o.norm()))
            acc["norm_after"].append(float(after.norm()))
            acc["cone_before"].append(_cos(o, u))
            acc["cone_after"].append(_cos(after, u))
            acc["rel"].append(float(o.norm() / pv[b, h, 1:].norm(dim=-1).mean()))
        rows.append({k: sum(v) / len(v) for k, v in acc.items()})
    return rows
