"""Contribution weights from a cache you already have: the checks of an `ActivationCache`'s
hooks against the model and each other, and the `LayerActivations` built from them (for
[`contribution_weights_from_cache`][cw_lens.contribution_weights_from_cache]).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from cw_lens.core.errors import InputError
from cw_lens.data.inputs import TokenBatch
from cw_lens.models.access import hook_name, model_access
from cw_lens.models.capture import LayerActivations, check_consistent


def activations_from_cache(
    cache: Any,
    model: Any,
    layer: int,
    *,
    tokens: Tensor | None = None,
    attention_mask: Tensor | None = None,
) -> LayerActivations:
    """Build checked `LayerActivations` for one layer from a cache.

    Args:
        cache: An `ActivationCache` (or a dict) with the classic hook names.
        model: The model the cache came from.
        layer: The layer.
        tokens: The token ids the cache was computed on; optional.
        attention_mask: 1 at real tokens when the cached batch was padded.

    Returns:
        The layer's activations, checked against the model and each other.
    """
    # Long: one look-up and one shape check per cached tensor, in the order LayerActivations holds
    # them.
    names = {kind: hook_name(kind, layer) for kind in ("pattern", "values", "z")}
    got = {}
    for kind, name in names.items():
        try:
            got[kind] = cache[name]
        except (KeyError, IndexError):
            got[kind] = None
        if got[kind] is None:
            raise InputError(
                f"The cache has no {name!r}. Cache layer {layer} with "
                f"model.run_with_cache(tokens, names_filter=cw_lens.cache_names({layer}))."
            )
    pattern, values, z = (got[k].detach() for k in names)
    access = model_access(model)
    n_heads, n_kv, d_head = access.n_heads, access.n_kv_heads, access.d_head
    if pattern.ndim == 3:  # run_with_cache(remove_batch_dim=True)
        pattern, values, z = (t[None] for t in (pattern, values, z))
    expected = {
        "pattern": (n_heads, None, None),
        "values": (None, n_kv, d_head),
        "z": (None, n_heads, d_head),
    }
    for kind, t in (("pattern", pattern), ("values", values), ("z", z)):
        if tuple(t.shape[1:]) != tuple(
            s if s is not None else t.shape[1 + i] for i, s in enumerate(expected[kind])
        ):
            raise InputError(
                f"The cache's {names[kind]} has shape {tuple(t.shape)}, which does not fit this "
                f"model ({n_heads} heads, {n_kv} kv heads, d_head {d_head}): the cache "
                "comes from another model."
            )
    n_pos = pattern.shape[-1]
    for kind, t in (("values", values), ("z", z)):
        if t.shape[1] != n_pos:
            raise InputError(
                f"The cache's {names[kind]} has {t.shape[1]} positions, the "
                f"pattern {n_pos}: the hooks come from different runs."
            )
    for kind, t in (("pattern", pattern), ("values", values), ("z", z)):
        if not bool(torch.isfinite(t).all()):
            raise InputError(
                f"The cache's {names[kind]} contains NaN or inf; contribution weights of "
                "non-finite activations are meaningless. Check the model run (dtype overflow?)."
            )
    device = pattern.device
    w = access.output_weights(layer).to(device)
    n_batch = pattern.shape[0]
    if attention_mask is None:
        mask = torch.ones(n_batch, n_pos, dtype=torch.bool, device=device)
    else:
        mask = torch.as_tensor(attention_mask, device=device).bool().reshape(n_batch, n_pos)
    check_consistent(access, layer, pattern, values, z, mask)
    if tokens is None:
        token_ids = torch.zeros(n_batch, n_pos, dtype=torch.long, device="cpu")
    else:
        token_ids = torch.as_tensor(tokens, device="cpu").reshape(n_batch, n_pos).cpu()
    bos_id = getattr(model.tokenizer, "bos_token_id", None) if model.tokenizer else None
    batch = TokenBatch(
        token_ids,
        mask.cpu(),
        bool(tokens is not None and bos_id is not None and (token_ids[:, 0] == bos_id).all()),
        getattr(model.tokenizer, "bos_token", None) if model.tokenizer else None,
        list(range(n_batch)),
    )
    return LayerActivations(
        layer=layer,
        pattern=pattern.float(),
        values=values.float(),
        z=z.float(),
        layer_output=w.layer_output(z),
        weights=w,
        mask=mask,
        batch=batch,
    )
