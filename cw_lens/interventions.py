r"""Interventions as hook sets: patch the sink, remove heads, mask attention pairs.

Every function returns a :class:`HookSet`, which is at once

- a context manager — ``with cw_lens.patch_sink(model, layers=[3]): model(tokens)``;
- a list of ``(hook_name, fn)`` pairs — ``model.run_with_hooks(x, fwd_hooks=patch.hooks)`` or
  ``with model.hooks(fwd_hooks=[*patch, *my_hooks]): ...``.

Hooks only act during a forward pass inside the context (or the ``hooks(...)`` call) and are
removed on exit, so the model is restored exactly. Sets compose: ``a + b`` or nested ``with``.

Sink-norm ablation (P1, SPEC §3): ``pv_0^h -> lambda pv_0^h`` for every query ``i > 0`` (queries
at sink positions are left alone), attention probabilities untouched. Because
``z_i^h = sum_j alpha[i,j]^h v_j^{g(h)}`` is linear in the values, the exact per-query-head edit
under grouped-query attention is on ``hook_z``::

    z_i^h  <-  z_i^h - (1 - lambda) * alpha[i,0]^h * v_0^{g(h)}

which changes only head ``h`` — not the other query heads that share ``v_0^{g(h)}``.
``lambda`` lies in [0, 2]: 0 removes the sink's value, 1 is the identity, above 1 amplifies the
sink (``lambda = 2`` doubles its projected value). ``mode="norm_matched"`` picks ``lambda`` per
(sequence, head) so that ``||lambda pv_0^h||`` equals the mean norm of the head's non-sink
projected values.

Head removal (P2 pruning) zeroes a head's ``hook_z``. Pair masking (P1 faithfulness) sets chosen
``alpha[i,j]^h`` to 0 on ``hook_pattern`` without renormalising, which subtracts exactly
``alpha[i,j]^h pv_j^h`` from ``o_i``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, Literal

import torch
from torch import Tensor

from cw_lens.capture import LayerWeights, hook_name, resolve_heads, resolve_layers
from cw_lens.errors import InputError
from cw_lens.geometry import projected_value_norms

Hook = tuple[str, Callable]
#: The largest sink scale ``lambda`` :func:`patch_sink` accepts (amplifying the sink up to 2x).
MAX_SINK_SCALE = 2.0


class HookSet:
    """Forward hooks that act together; a context manager and an iterable of hook pairs."""

    def __init__(self, model: Any, hooks: Iterable[Hook], description: str = "") -> None:
        self.model = model
        self.hooks: list[Hook] = list(hooks)
        self.description = description
        self._contexts: list[Any] = []

    def __iter__(self) -> Iterator[Hook]:
        return iter(self.hooks)

    def __len__(self) -> int:
        return len(self.hooks)

    def __add__(self, other: HookSet | Sequence[Hook]) -> HookSet:
        """Combine with another hook set (of the same model) or a list of hook pairs."""
        if not isinstance(other, HookSet):
            return HookSet(self.model, [*self.hooks, *list(other)], self.description)
        if other.model is not self.model:
            raise InputError("Cannot combine hook sets of two different models.")
        desc = " + ".join(d for d in (self.description, other.description) if d)
        return HookSet(self.model, [*self.hooks, *other.hooks], desc)

    def __enter__(self) -> HookSet:
        ctx = self.model.hooks(fwd_hooks=self.hooks)
        ctx.__enter__()
        self._contexts.append(ctx)
        return self

    def __exit__(self, *exc: Any) -> None:
        self._contexts.pop().__exit__(*exc)

    def __repr__(self) -> str:
        return f"HookSet({self.description or 'hooks'}, {len(self.hooks)} hooks)"


def per_layer_heads(
    model: Any, layers: int | Sequence[int] | None, heads: Any
) -> dict[int, list[int]]:
    """``{layer: [heads]}`` from ``heads``: None (all), a list (the same heads in every layer
    of ``layers``) or a dict ``{layer: heads}`` (then ``layers`` must be None)."""
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


def patch_sink(
    model: Any,
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
        model: The bridge.
        layers: Layers to patch (``None`` = all).
        heads: Query heads (``None`` = all; a list, or ``{layer: [heads]}``).
        scale: ``lambda`` in [0, 2]: 0 removes the sink's value, 1 is the identity, values
            above 1 amplify it (2 doubles the sink's projected value).
        mode: ``"scale"`` multiplies ``pv_0`` by ``scale``; ``"norm_matched"`` rescales it to
            the mean norm of the head's non-sink projected values (``scale`` is ignored; with
            several sinks, relative to their mean norm).
        sink_positions: Positions treated as sinks (each is patched; its own query row is not).
        attention_mask: ``[batch, pos]``, 1 at real tokens, for padded batches in
            ``norm_matched`` mode (otherwise padding counts in the tail mean).

    Returns:
        A :class:`HookSet` (context manager / hook list).

    Example::

        with cw_lens.patch_sink(model, layers=[5], heads=[0, 3]):
            patched = model(tokens)
    """
    if mode not in ("scale", "norm_matched"):
        raise InputError(f"mode must be 'scale' or 'norm_matched', got {mode!r}.")
    try:
        scale = float(scale)
    except (TypeError, ValueError):
        raise InputError(
            f"scale must be a number in [0, {MAX_SINK_SCALE:g}], got {scale!r}."
        ) from None
    if mode == "scale" and not 0.0 <= scale <= MAX_SINK_SCALE:
        raise InputError(
            f"scale must lie in [0, {MAX_SINK_SCALE:g}] (0 removes the sink's value, 1 keeps it, "
            f"2 doubles it), got {scale}."
        )
    sinks = sorted({int(p) for p in sink_positions})
    if not sinks or min(sinks) < 0:
        raise InputError(f"sink_positions must be non-negative positions, got {sink_positions}.")
    plan = per_layer_heads(model, layers, heads)
    real = None if attention_mask is None else torch.as_tensor(attention_mask).bool()
    hooks: list[Hook] = []
    for layer, head_list in plan.items():
        hooks += _sink_hooks(model, layer, head_list, scale, mode, sinks, real)
    desc = f"patch_sink({mode}, scale={scale}, layers={list(plan)})"
    return HookSet(model, hooks, desc)


def sink_scale(
    mode: str,
    scale: float,
    norms: Tensor,
    sink_mask: Tensor,
    real_mask: Tensor | None = None,
) -> Tensor:
    """``1 - lambda`` per (batch, head): the share of the sink term that the patch removes.

    Args:
        mode: ``"scale"`` (``lambda = scale``) or ``"norm_matched"`` (``lambda`` = mean norm of
            the head's non-sink projected values / mean norm of its sink projected values).
        norms: ``||pv_j^h||`` ``[batch, head, pos]``.
        sink_mask: ``[batch, pos]`` True at sinks; ``real_mask``: True at real tokens.
    """
    n_batch, n_heads, _ = norms.shape
    if mode == "scale":
        return torch.full((n_batch, n_heads), 1.0 - scale, device=norms.device)
    real = torch.ones_like(sink_mask) if real_mask is None else real_mask
    tail = (real & ~sink_mask).to(norms.dtype)[:, None, :]
    sinks = sink_mask.to(norms.dtype)[:, None, :]
    tail_mean = (norms * tail).sum(-1) / tail.sum(-1).clamp_min(1)
    sink_mean = (norms * sinks).sum(-1) / sinks.sum(-1).clamp_min(1)
    return 1.0 - tail_mean / sink_mean.clamp_min(1e-30)


def _sink_hooks(
    model: Any,
    layer: int,
    heads: list[int],
    scale: float,
    mode: str,
    sinks: list[int],
    real_mask: Tensor | None,
) -> list[Hook]:
    from cw_lens.geometry import sink_term

    store: dict[str, Tensor] = {}
    weights: dict[str, LayerWeights] = {}

    def keep(name: str) -> Callable:
        def fn(t: Tensor, hook: Any) -> None:
            store[name] = t

        return fn

    def patch_z(z: Tensor, hook: Any) -> Tensor:
        pattern, values = store.pop("pattern"), store.pop("values")
        n_batch, n_pos = z.shape[0], z.shape[1]
        sink_mask = torch.zeros(n_batch, n_pos, dtype=torch.bool, device=z.device)
        sink_mask[:, [s for s in sinks if s < n_pos]] = True
        if not bool(sink_mask.any()):
            return z
        norms = None
        if mode == "norm_matched":
            if "w" not in weights:
                weights["w"] = LayerWeights.of(model, layer)
            norms = projected_value_norms(values.float(), weights["w"].gram.to(z.device))
        else:
            norms = torch.zeros(n_batch, z.shape[2], 1, device=z.device)
        real = None if real_mask is None else real_mask[:, :n_pos].to(z.device)
        factor = sink_scale(mode, scale, norms, sink_mask, real)  # [batch, head]
        keep_heads = torch.zeros(z.shape[2], dtype=torch.bool, device=z.device)
        keep_heads[heads] = True
        factor = torch.where(keep_heads[None], factor, torch.zeros_like(factor))
        term = sink_term(pattern.float(), values.float(), sink_mask)  # [batch, query, head, d]
        term = term.masked_fill(sink_mask[:, :, None, None], 0.0)  # sink queries keep theirs
        return z - (factor[:, None, :, None] * term).to(z.dtype)

    return [
        (hook_name("pattern", layer), keep("pattern")),
        (hook_name("values", layer), keep("values")),
        (hook_name("z", layer), patch_z),
    ]


def remove_heads(model: Any, heads: Any) -> HookSet:
    """Zero the output (``hook_z``) of the given heads: ``[(layer, head), ...]`` or
    ``{layer: [heads]}``.

    Example::

        with cw_lens.remove_heads(model, [(0, 3), (5, 1)]):
            loss = model(tokens, return_type="loss")
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
    hooks: list[Hook] = []
    for layer, hs in sorted(by_layer.items()):
        idx = sorted(set(hs))

        def zero(z: Tensor, hook: Any, idx: list[int] = idx) -> Tensor:
            z = z.clone()
            z[:, :, idx, :] = 0.0
            return z

        hooks.append((hook_name("z", layer), zero))
    return HookSet(model, hooks, f"remove_heads({len(pairs)} heads)")


def mask_attention(model: Any, masks: dict[int, Tensor | Callable[[Tensor], Tensor]]) -> HookSet:
    """Set chosen attention probabilities to 0 (no renormalisation) in several layers at once.

    Args:
        masks: ``{layer: mask}`` where ``mask`` is a bool tensor broadcastable to the pattern
            ``[batch, head, query, key]`` (True = remove), or a function of the pattern that
            returns one.
    """
    hooks: list[Hook] = []
    for layer, mask in masks.items():
        (layer,) = resolve_layers(model, [layer])

        def apply(pattern: Tensor, hook: Any, mask: Any = mask) -> Tensor:
            m = mask(pattern) if callable(mask) else mask
            return pattern.masked_fill(m.to(pattern.device), 0.0)

        hooks.append((hook_name("pattern", layer), apply))
    return HookSet(model, hooks, f"mask_attention({len(masks)} layers)")
