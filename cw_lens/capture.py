"""Model access in one place: the per-layer activation stream and the model checks.

:func:`run_layers` runs one forward pass and, as each requested attention layer finishes, hands
a :class:`LayerActivations` (pattern, values, ``z``, layer output, ``W_O``, ``b_O``, padding
mask — all float32) to a callback *inside* the pass, then drops it. Memory therefore holds one
layer at a time whatever the depth, and the pass stops after the last requested layer unless
logits are needed. Only the four classic hooks are captured::

    blocks.{l}.attn.hook_pattern   [batch, head, query, key]
    blocks.{l}.attn.hook_v         [batch, key, kv_head, d_head]   (un-repeated under GQA)
    blocks.{l}.attn.hook_z         [batch, query, head, d_head]
    blocks.{l}.hook_attn_out       [batch, query, d_model]         (= o_i + b_O)

Interventions (hook lists) can be passed alongside and act in the same pass.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from jaxtyping import Bool, Float
from torch import Tensor

from cw_lens.errors import InputError, UnsupportedModelError
from cw_lens.geometry import head_gram
from cw_lens.inputs import TokenBatch

HOOK_TEMPLATES = {
    "pattern": "blocks.{layer}.attn.hook_pattern",
    "values": "blocks.{layer}.attn.hook_v",
    "z": "blocks.{layer}.attn.hook_z",
    "attn_out": "blocks.{layer}.hook_attn_out",
}


def hook_name(kind: str, layer: int) -> str:
    return HOOK_TEMPLATES[kind].format(layer=layer)


def cache_names(layers: int | list[int]) -> list[str]:
    """The hook names contribution weights read, for ``run_with_cache(names_filter=...)``.

    Example::

        _, cache = model.run_with_cache(tokens, names_filter=cw_lens.cache_names([3, 4]))
        cw = cw_lens.contribution_weights_from_cache(cache, model, 3)
    """
    layers = [layers] if isinstance(layers, int) else list(layers)
    return [hook_name(kind, layer) for layer in layers for kind in HOOK_TEMPLATES]


@dataclass
class LayerWeights:
    """The output projection of one layer, float32: ``W_O`` [head, d_head, d_model], ``b_O``."""

    W_O: Float[Tensor, "head d_head d_model"]
    b_O: Float[Tensor, " d_model"] | None
    gram: Float[Tensor, "head d_head d_head"]

    @classmethod
    def of(cls, model: Any, layer: int) -> LayerWeights:
        attn = model.blocks[layer].attn
        with torch.no_grad():
            W_O = attn.W_O.detach().float()
            b_O = getattr(attn, "b_O", None)
            b_O = None if b_O is None else b_O.detach().float()
        return cls(W_O, b_O, head_gram(W_O))


@dataclass
class LayerActivations:
    """One attention layer's activations for one batch (float32, on the model's device).

    Attributes:
        layer: Layer index.
        pattern: ``alpha`` [batch, head, query, key].
        values: ``v`` [batch, key, kv_head, d_head] (value bias included).
        z: ``z_i^h = sum_j alpha v_j`` [batch, query, head, d_head].
        layer_output: ``o_i = sum_h z_i^h W_O^h`` [batch, query, d_model], ``b_O`` excluded.
        weights: ``W_O``, ``b_O`` and the per-head Gram matrices.
        mask: True at real tokens [batch, pos].
        batch: The token batch this pass ran on.
    """

    layer: int
    pattern: Float[Tensor, "batch head query key"]
    values: Float[Tensor, "batch key kv_head d_head"]
    z: Float[Tensor, "batch query head d_head"]
    layer_output: Float[Tensor, "batch query d_model"]
    weights: LayerWeights
    mask: Bool[Tensor, "batch pos"]
    batch: TokenBatch
    extras: dict[str, Tensor] = field(default_factory=dict)

    @property
    def n_heads(self) -> int:
        return self.pattern.shape[1]


def check_model(model: Any) -> None:
    """Raise :class:`UnsupportedModelError` unless ``model`` is a bridge with classic hooks."""
    from transformer_lens.model_bridge import TransformerBridge

    if not isinstance(model, TransformerBridge):
        raise UnsupportedModelError(
            f"cw_lens analyses a TransformerLens TransformerBridge; got {type(model).__name__}. "
            "Load one with cw_lens.load_model(...) or TransformerBridge.boot_transformers(...)."
        )
    direction = getattr(model.cfg, "attention_dir", "causal")
    if direction != "causal":
        raise UnsupportedModelError(
            f"{model.cfg.model_name!r} has {direction} attention. cw_lens implements the causal "
            "(decoder-only) case of P1/P2, where query i reads keys j <= i; use a decoder such as "
            "Llama, Mistral, Qwen or GPT-2."
        )
    hook_dict = model.hook_dict
    needed = [hook_name(k, 0) for k in HOOK_TEMPLATES]
    missing = [n for n in needed if n not in hook_dict and not _has_alias(model, n)]
    if missing or not hasattr(model, "blocks"):
        raise UnsupportedModelError(
            f"{model.cfg.model_name!r} does not expose the attention hooks cw_lens needs "
            f"({', '.join(missing)}). Contribution weights need a decoder with standard "
            "multi-head / grouped-query attention (Llama, Mistral, Qwen, GPT-2, ...)."
        )


def _has_alias(model: Any, name: str) -> bool:
    try:
        from transformer_lens.model_bridge.bridge_core import build_alias_to_canonical_map

        return name in build_alias_to_canonical_map(model.hook_dict)
    except Exception:
        return False


def _resolve_indices(values: Any, n: int, what: str, unit: str) -> list[int]:
    """Normalise an index selection (``None`` = all; negative counts from the end)."""
    if values is None:
        return list(range(n))
    if isinstance(values, (int, np.integer)) or (
        isinstance(values, torch.Tensor) and values.ndim == 0
    ):
        values = [values]
    try:
        values = list(values)
    except TypeError:
        raise InputError(
            f"{what.capitalize()}s must be an integer or a list of integers, got {values!r}."
        ) from None
    out = []
    for value in values:
        if isinstance(value, torch.Tensor) and value.ndim == 0:
            value = value.item()
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
            raise InputError(f"{what.capitalize()}s must be integers, got {value!r}.")
        value = int(value)
        if not -n <= value < n:
            raise InputError(
                f"{what.capitalize()} {value} is out of range: this model has {n} {unit} "
                f"(0..{n - 1})."
            )
        out.append(value % n)
    if not out:
        raise InputError(f"The {what} selection is empty; pass {what}s=None for all {what}s.")
    return sorted(set(out))


def resolve_layers(model: Any, layers: Any) -> list[int]:
    """Normalise a layer selection (``None`` = all; negative indices count from the end)."""
    return _resolve_indices(layers, model.cfg.n_layers, "layer", "layers")


def resolve_heads(model: Any, heads: Any) -> list[int]:
    """Normalise a head selection (``None`` = all query heads)."""
    return _resolve_indices(heads, model.cfg.n_heads, "head", "query heads per layer")


def model_device(model: Any) -> torch.device:
    return torch.device(model.cfg.device or "cpu")


def _check_finite(layer: int, *tensors: Tensor) -> None:
    """Fail loudly on NaN/inf activations (a NaN pattern shows up in z, which is small)."""
    for t in tensors:
        if not bool(torch.isfinite(t).all()):
            raise InputError(
                f"Layer {layer} produced NaN or inf activations (dtype {t.dtype}); contribution "
                "weights would be meaningless. A float16 model often overflows: load it in "
                "bfloat16 or float32 (cw_lens.load_model(..., dtype=torch.float32))."
            )


class _StreamDone(Exception):
    """Raised from the last requested layer's hook to end a pass whose logits are not needed."""


def run_layers(
    model: Any,
    batch: TokenBatch,
    on_layer: Callable[[LayerActivations], None] | None,
    *,
    layers: Sequence[int],
    fwd_hooks: Sequence[tuple[str, Callable]] = (),
    need_logits: bool = False,
    weights: dict[int, LayerWeights] | None = None,
) -> Tensor | None:
    """One forward pass; ``on_layer`` is called with each requested layer's activations.

    Args:
        model: The bridge.
        batch: A prepared :class:`TokenBatch`.
        on_layer: Callback; ``None`` runs the pass for ``fwd_hooks`` alone.
        layers: Layers to stream (sorted).
        fwd_hooks: Extra ``(hook_name, fn)`` pairs (interventions) active during this pass.
        need_logits: Run to the end and return the logits; otherwise the pass ends right
            after the last requested layer's attention and ``None`` is returned.
        weights: A dict reused across calls to cache each layer's ``W_O`` and Gram matrices.

    Returns:
        The logits ``[batch, pos, vocab]`` (float32) when ``need_logits``, else ``None``.
    """
    weights = {} if weights is None else weights
    device = model_device(model)
    tokens = batch.tokens.to(device)
    mask = batch.mask.to(device)
    store: dict[int, dict[str, Tensor]] = {}
    hooks: list[tuple[str, Callable]] = []

    if on_layer is not None:
        for layer in layers:
            for kind in ("pattern", "values", "z"):

                def keep(t: Tensor, hook: Any, layer: int = layer, kind: str = kind) -> None:
                    store.setdefault(layer, {})[kind] = t

                hooks.append((hook_name(kind, layer), keep))

            def finish(t: Tensor, hook: Any, layer: int = layer) -> None:
                got = store.pop(layer)
                if layer not in weights:
                    weights[layer] = LayerWeights.of(model, layer)
                w = weights[layer]
                _check_finite(layer, got["values"], got["z"])
                out = t.float()
                if w.b_O is not None:
                    out = out - w.b_O
                on_layer(
                    LayerActivations(
                        layer=layer,
                        pattern=got["pattern"].float(),
                        values=got["values"].float(),
                        z=got["z"].float(),
                        layer_output=out,
                        weights=w,
                        mask=mask.to(got["pattern"].device),
                        batch=batch,
                    )
                )

                if not need_logits and layer == last:
                    raise _StreamDone

            hooks.append((hook_name("attn_out", layer), finish))
    last = max(layers) if layers else -1
    # interventions first, so captured activations are the intervened ones
    all_hooks = [*fwd_hooks, *hooks]
    mask_arg = batch.attention_mask().to(device) if batch.padded else None
    with torch.inference_mode(), model.hooks(fwd_hooks=all_hooks):
        try:
            out = model(tokens, attention_mask=mask_arg)
        except _StreamDone:
            return None
    return out.float() if need_logits else None
