"""Interventions: patch the sink, remove heads, mask attention pairs (public entry points).

Each function checks that the intervention is exact on the model
([`cw_lens.verify_model`][cw_lens.verify_model] tests every intervention against an independent edit
of `hook_z`) and returns a [`HookSet`][cw_lens.HookSet] — a context manager and, on most models, a
list of `(hook_name, fn)` pairs. `cw_lens.models.edits` has the formulas and how each edit is
realised.

The public functions' docstrings have runnable examples.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Literal

import torch
from torch import Tensor

from cw_lens.core.devices import to_tensor
from cw_lens.core.errors import InputError, UnsupportedModelError
from cw_lens.core.keywords import check_keywords
from cw_lens.models.access import Model, model_access, resolve_heads, resolve_layers
from cw_lens.models.edits import (
    MAX_SINK_SCALE,
    HeadRemoval,
    HookSet,
    PairMask,
    SinkPatch,
    head_removal_hooks,
    realise,
    sink_scale,
)
from cw_lens.models.verify import require_verified

__all__ = [
    "HookSet",
    "mask_attention",
    "patch_sink",
    "per_layer_heads",
    "remove_heads",
    "sink_scale",
]


def per_layer_heads(
    model: Any, layers: int | Sequence[int] | None, heads: Any
) -> dict[int, list[int]]:
    """`{layer: [heads]}` from `heads`: None (all), a list (the same heads in every layer
    of `layers`) or a dict `{layer: heads}` (then `layers` must be None)."""
    if isinstance(heads, dict):
        if layers is not None:
            raise InputError(
                "Give the layers either as layers=... or as the keys of heads={layer: [heads]}, "
                "not both."
            )
        return {
            layer: resolve_heads(model, hs)
            for layer in resolve_layers(model, list(heads))
            for hs in [heads.get(layer, heads.get(layer - model.cfg.n_layers))]
        }
    return {layer: resolve_heads(model, heads) for layer in resolve_layers(model, layers)}


def _require(model: Any, intervention: str) -> None:
    """Refuse an intervention that [`cw_lens.verify_model`][cw_lens.verify_model] did not find
    exact."""
    verdict = require_verified(model).interventions.get(intervention, "")
    if not verdict.startswith("exact"):
        raise UnsupportedModelError(
            f"{intervention} is not exact on {model_access(model).architecture}: {verdict}"
        )


@check_keywords
def patch_sink(
    model: Model,
    *,
    layers: int | Sequence[int] | None = None,
    heads: Any = None,
    scale: float = 0.0,
    mode: Literal["scale", "norm_matched"] = "scale",
    sink_positions: Sequence[int] = (0,),
    attention_mask: Tensor | None = None,
) -> HookSet:
    """Scale the sink's projected value in chosen layers and heads (P1's sink-norm ablation).

    Args:
        model: A `TransformerBridge` or `HookedTransformer`.
        layers: Layers to patch (`None` = all).
        heads: Query heads (`None` = all; a list, or `{layer: [heads]}`); negative indices
            count from the end, as for `layers` (`-1` is the last head).
        scale: `lambda` in [0, 2]: 0 removes the sink's value, 1 is the identity, above 1
            amplifies it.
        mode: `"scale"` multiplies `pv_0` by `scale`; `"norm_matched"` rescales it to
            the mean norm of the head's non-sink projected values (`scale` is ignored; with
            several sinks, relative to their mean norm).
        sink_positions: Positions treated as sinks (each is patched; its own query row is not).
        attention_mask: `[batch, pos]`, 1 at real tokens, for padded batches in
            `norm_matched` mode (otherwise padding counts in the tail mean).

    Returns:
        A [`HookSet`][cw_lens.HookSet] (context manager / hook list).

    Examples:
        ```python
        import cw_lens

        model = cw_lens.load_model("testing:tiny-llama")
        tokens = model.to_tokens("The cat sat on the mat.")
        with cw_lens.patch_sink(model, layers=[1], heads=[0, 3]):
            patched = model(tokens)  # the sink's value removed in those heads
        ```
    """
    if mode not in ("scale", "norm_matched"):
        raise InputError(f"mode must be 'scale' or 'norm_matched', got {mode!r}.")
    if mode == "scale" and not 0.0 <= float(scale) <= MAX_SINK_SCALE:
        raise InputError(f"scale must lie in [0, {MAX_SINK_SCALE:g}], got {scale}.")
    sinks = sorted({int(p) for p in sink_positions})
    if not sinks or min(sinks) < 0:
        raise InputError(f"sink_positions must be non-negative positions, got {sink_positions}.")
    plan = per_layer_heads(model, layers, heads)
    _require(model, "patch_sink")
    access = model_access(model)
    real = None if attention_mask is None else to_tensor(attention_mask).bool()
    edits = [
        SinkPatch(
            layer,
            head_list,
            access.n_heads,
            float(scale),
            mode,
            sinks,
            real,
            access.output_weights(layer).gram if mode == "norm_matched" else None,
        )
        for layer, head_list in plan.items()
    ]
    return realise(model, edits, f"patch_sink({mode}, scale={scale}, layers={list(plan)})")


@check_keywords
def remove_heads(model: Model, heads: Any) -> HookSet:
    """Zero the output (`hook_z`) of the given heads: `[(layer, head), ...]` or
    `{layer: [heads]}`.

    Args:
        model: A TransformerLens model.
        heads: `[(layer, head), ...]` or `{layer: [heads]}`.

    Returns:
        A [`HookSet`][cw_lens.HookSet] (context manager / hook list).

    Examples:
        ```python
        import cw_lens

        model = cw_lens.load_model("testing:tiny-llama")
        tokens = model.to_tokens("The cat sat on the mat.")
        with cw_lens.remove_heads(model, [(0, 3), (1, 1)]):
            loss = model(tokens, return_type="loss")
        ```
    """
    if isinstance(heads, dict):
        pairs = [(layer, h) for layer, hs in heads.items() for h in hs]
    else:
        try:
            pairs = [tuple(p) for p in heads]
            well_formed = all(len(p) == 2 for p in pairs)
        except TypeError:
            well_formed = False
        if not well_formed:
            raise InputError(
                "remove_heads needs (layer, head) pairs, e.g. [(0, 3), (5, 1)], or "
                "{layer: [heads]}."
            )
    by_layer: dict[int, list[int]] = {}
    for layer, head in pairs:
        (layer,) = resolve_layers(model, [layer])
        by_layer.setdefault(layer, []).extend(resolve_heads(model, [head]))
    if pairs:
        _require(model, "remove_heads")
    edits = [HeadRemoval(layer, sorted(set(hs))) for layer, hs in sorted(by_layer.items())]
    return head_removal_hooks(model, edits, f"remove_heads({len(pairs)} heads)")


@check_keywords
def mask_attention(model: Model, masks: dict[int, Tensor | Callable[[Tensor], Tensor]]) -> HookSet:
    """Set chosen attention probabilities to 0 (no renormalisation) in several layers at once.

    Args:
        model: A TransformerLens model.
        masks: `{layer: mask}` where `mask` is a bool tensor broadcastable to the pattern
            `[batch, head, query, key]` (True = remove), or a function of the pattern that
            returns one.

    Returns:
        A [`HookSet`][cw_lens.HookSet] (context manager / hook list).

    Examples:
        ```python
        import cw_lens

        model = cw_lens.load_model("testing:tiny-llama")
        import torch

        tokens = model.to_tokens("The cat sat on the mat.")
        n = tokens.shape[1]
        remove = torch.zeros(1, model.cfg.n_heads, n, n, dtype=torch.bool)
        remove[..., 0] = True  # no query reads position 0
        with cw_lens.mask_attention(model, {0: remove, 1: remove}):
            logits = model(tokens)
        ```
    """
    if not isinstance(masks, dict):
        raise InputError("mask_attention needs {layer: bool mask or function of the pattern}.")
    edits = []
    for layer, mask in masks.items():
        (layer,) = resolve_layers(model, [layer])
        if not callable(mask):
            mask = to_tensor(mask)
            if mask.dtype != torch.bool:
                raise InputError(
                    f"The mask of layer {layer} has dtype {mask.dtype}; pass a bool tensor "
                    "(True = remove that attention probability)."
                )
        edits.append(PairMask(layer, mask))
    if edits:
        _require(model, "mask_attention")
    return realise(model, edits, f"mask_attention({len(masks)} layers)")
