"""The per-layer activation stream: one forward pass, each attention layer handed over in turn.

`run_layers` runs one forward pass and, as each requested attention layer has produced its
three classic hooks — whatever order the model fires them in — hands a
`LayerActivations` (pattern, values, `z`, the layer output, `W_O`, `b_O`, padding
mask, all float32) to a callback *inside* the pass, then drops it. Memory holds one layer at a
time whatever the depth, and the pass stops after the last requested layer unless logits are
needed:

    blocks.{l}.attn.hook_pattern   [batch, head, query, key]
    blocks.{l}.attn.hook_v         [batch, key, kv_head, d_head]   (un-repeated under GQA)
    blocks.{l}.attn.hook_z         [batch, query, head, d_head]

The layer output `o_i = sum_h z_i^h W_O^h` (`b_O` excluded) is computed from `z` and
`W_O` (docs/methods.md#notation), never read from `hook_attn_out`.

Interventions (hook sets of `cw_lens.models.edits`, or plain hook pairs) act in the same pass;
the
activations handed over describe the intervened layer exactly (its edits are applied to the
pattern they report). Every captured layer is checked: `z == pattern @ v` on two random
projections of the value space (a cheap, complete check, `O(batch·head·query·key)`). A hook
that edits `z` behind cw_lens's back, or a `hook_pattern` edit the model ignores, would make
every number describe something the model did not compute — it raises instead.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import ExitStack
from dataclasses import dataclass, field
from typing import Any

import torch
from jaxtyping import Bool, Float32
from torch import Tensor

from cw_lens.core.errors import InputError, UnsupportedModelError
from cw_lens.core.geometry import grouped_scores_values
from cw_lens.core.registry import saveable
from cw_lens.models.access import (
    ATTENTION_HOOKS,
    LayerWeights,
    ModelAccess,
    StreamDone,
    cache_names,
    hook_name,
    model_access,
    model_device,
    resolve_heads,
    resolve_layers,
)
from cw_lens.models.batch import TokenBatch

__all__ = [
    "LayerActivations",
    "LayerWeights",
    "cache_names",
    "check_consistent",
    "hook_name",
    "model_device",
    "resolve_heads",
    "resolve_layers",
    "run_layers",
]

# relative tolerance of z == pattern @ v by the parameter dtype (half precision rounds z)
# (the check runs in float32: float64 models get the float32 tolerance)
CONSISTENCY_RTOL = {torch.float32: 1e-4, torch.float64: 1e-4}
HALF_PRECISION_RTOL = 3e-2


@saveable
@dataclass
class LayerActivations:
    """One attention layer's activations for one batch (float32, on the model's device).

    Attributes:
        layer: Layer index.
        pattern: `alpha` [batch, head, query, key] — the effective attention when an entered
            intervention edits this layer.
        values: `v` [batch, key, kv_head, d_head] (value bias included).
        z: `z_i^h = sum_j alpha v_j` [batch, query, head, d_head].
        layer_output: `o_i = sum_h z_i^h W_O^h` [batch, query, d_model], `b_O` excluded.
        weights: `W_O`, `b_O` and the per-head Gram matrices.
        mask: True at real tokens [batch, pos].
        batch: The token batch this pass ran on.
    """

    layer: int
    equal_axes = (("pos", "query", "key"),)  # the query and key axes are the positions

    pattern: Float32[Tensor, "batch head query key"]
    values: Float32[Tensor, "batch key kv_head d_head"]
    z: Float32[Tensor, "batch query head d_head"]
    layer_output: Float32[Tensor, "batch query d_model"]
    weights: LayerWeights
    mask: Bool[Tensor, "batch pos"]
    batch: TokenBatch
    extras: dict[str, Tensor] = field(default_factory=dict)

    @property
    def n_heads(self) -> int:
        return self.pattern.shape[1]


def check_finite(layer: int, *tensors: Tensor) -> None:
    """Fail loudly on NaN/inf activations (a NaN pattern shows up in z, which is small).

    One reduction per tensor decides: a NaN or inf element makes the sum NaN or inf; only a
    non-finite sum (or one that overflowed) is tested element by element."""
    for t in tensors:
        if not bool(torch.isfinite(t.sum())) and not bool(torch.isfinite(t).all()):
            raise InputError(
                f"Layer {layer} produced NaN or inf activations (dtype {t.dtype}); contribution "
                "weights would be meaningless. A float16 model often overflows: load it in "
                "bfloat16 or float32 (cw_lens.load_model(..., dtype=torch.float32))."
            )


def consistency_error(
    pattern: Tensor,
    values: Tensor,
    z: Tensor,
    mask: Tensor | None = None,
    seed: int = 0,
    raw_pattern: Tensor | None = None,
    *,
    upper_bound: bool = False,
) -> float:
    """Largest relative violation of `z == pattern @ v` over (batch, query, head), read on two
    seeded random projections `r` of the value space: `|z r - pattern (v r)|` relative to
    `sum_j |alpha_j| |v_j| |r| + |z| |r|` (element-wise absolute values: the bound of float
    rounding), so half-precision models pass with a few ulps and any real edit stands out.

    With `upper_bound` the pattern is read once, in one product `pattern @ [v r, |v| |r|]`
    that takes `alpha_j` for `|alpha_j|`: the same value for a non-negative pattern (every
    softmax pattern; up to the float rounding of the products), and a larger one otherwise (a
    negative `alpha_j` only shrinks the rounding bound), so an error within a tolerance here is
    within it exactly; `check_consistent` recomputes the exact value when this one is
    above the tolerance."""
    gen = torch.Generator().manual_seed(seed)
    r = torch.randn(values.shape[-1], 2, generator=gen, device="cpu").to(values.device)
    values, z, pattern = values.float(), z.float(), pattern.float()
    # [batch, key, kv_head, 4]: the two projections, then what rounding can reach on them
    columns = torch.cat([values @ r, values.abs() @ r.abs()], dim=-1)
    if upper_bound:
        both = grouped_scores_values(pattern, columns)  # [batch, query, head, 4]
        mixed, reach = both[..., :2], both[..., 2:]
        if raw_pattern is not None:
            reach = reach + grouped_scores_values(raw_pattern.float(), columns[..., 2:])
    else:
        mixed = grouped_scores_values(pattern, columns[..., :2])  # [batch, query, head, 2]
        # an entered edit computed z from the raw pattern and then removed terms: those terms'
        # rounding counts too (a removed sink term can be most of z: cancellation)
        bound = pattern.abs() if raw_pattern is None else pattern.abs() + raw_pattern.abs()
        reach = grouped_scores_values(bound, columns[..., 2:])
    scale = reach + z.abs() @ r.abs()
    err = (z @ r - mixed).abs() / scale.clamp_min(1e-30)
    if mask is not None:
        err = err * mask[:, : err.shape[1], None, None].to(err.dtype)
    return float(err.max()) if err.numel() else 0.0


def check_consistent(
    access: ModelAccess,
    layer: int,
    pattern: Tensor,
    values: Tensor,
    z: Tensor,
    mask: Tensor | None = None,
    raw_pattern: Tensor | None = None,
    *,
    dtype: torch.dtype | None = None,
) -> None:
    """Raise unless `z == pattern @ v` (see `consistency_error`).

    Args:
        access: The model's access (its parameter dtype sets the tolerance).
        layer: The layer (for the message).
        pattern: `alpha` [batch, head, query, key] (after any entered edit).
        values: `v` [batch, key, kv_head, d_head].
        z: [batch, query, head, d_head].
        mask: True at real tokens [batch, pos] (padding is not checked).
        raw_pattern: The pattern before an entered edit, whose removed terms bound the
            rounding too.
        dtype: The model's parameter dtype, when the caller has read it (once a pass).

    One product over the pattern decides every pass (its error is an upper bound of the exact
    one); only an error above the tolerance is recomputed exactly, so the verdict is the exact
    error's."""
    dtype = access.parameter_dtype() if dtype is None else dtype
    rtol = CONSISTENCY_RTOL.get(dtype, HALF_PRECISION_RTOL)
    args = (pattern, values, z, mask)
    err = consistency_error(*args, raw_pattern=raw_pattern, upper_bound=True)
    if not err <= rtol:
        err = consistency_error(*args, raw_pattern=raw_pattern)
    if err > rtol:
        raise UnsupportedModelError(
            f"{access.architecture}, layer {layer}: z differs from pattern @ v (relative error "
            f"{err:.2g} > {rtol:g}), so contribution weights would not describe what the model "
            "computed. Either a hook edits hook_z (or a hook_pattern edit that this model "
            "ignores) behind cw_lens's back — enter cw_lens interventions with `with` instead "
            "of passing them as plain hook lists, and edit hook_v or hook_pattern rather than "
            "hook_z —, or this model's hooks do not show what its attention computes "
            "(run cw_lens.verify_model(model))."
        )


def run_layers(
    model: Any,
    batch: TokenBatch,
    on_layer: Callable[[LayerActivations], None] | None,
    *,
    layers: Sequence[int],
    fwd_hooks: Sequence[Any] = (),
    need_logits: bool = False,
    weights: dict[int, LayerWeights] | None = None,
    gradients: bool = False,
) -> Tensor | None:
    """One forward pass; `on_layer` is called with each requested layer's activations.

    Args:
        model: A `TransformerBridge` or `HookedTransformer`.
        batch: A prepared `TokenBatch`.
        on_layer: Callback; `None` runs the pass for `fwd_hooks` alone.
        layers: Layers to stream (sorted).
        fwd_hooks: Interventions active during this pass: hook sets (entered as context
            managers) and/or `(hook_name, fn)` pairs.
        need_logits: Run to the end and return the logits; otherwise the pass ends right
            after the last requested layer's attention and `None` is returned.
        weights: A dict reused across calls to cache each layer's `W_O` and Gram matrices
            (not an offloaded layer's: its copy is read again in each pass).
        gradients: Run with autograd on (the logits keep their graph); the activations handed
            to `on_layer` are detached either way.

    Returns:
        The logits `[batch, pos, vocab]` (float32) when `need_logits`, else `None`.
    """
    # Long: the hook wiring of one pass (pattern, v, z, the layer weights, the early stop) kept in
    # one place.
    access = model_access(model)
    weights = {} if weights is None else weights
    device = access.device
    tokens = batch.tokens.to(device)
    mask = batch.mask.to(device)
    store: dict[int, dict[str, Tensor]] = {}
    delivered: set[int] = set()
    hooks: list[tuple[str, Callable]] = []
    last = max(layers) if layers else -1
    dtype: list[torch.dtype] = []  # the parameter dtype, read once a pass (for the check)

    def finish(layer: int) -> None:
        got = store.pop(layer)
        delivered.add(layer)
        w = weights[layer] if layer in weights else access.output_weights(layer)
        if not w.offloaded:  # an offloaded layer's copy is read again in the next pass, so
            weights[layer] = w  # that what is kept does not grow with the depth
        pattern, values, z = (
            (got[k].detach() if gradients else got[k]).float() for k in ("pattern", "values", "z")
        )
        check_finite(layer, values, z)
        for edit in access.edits_at(layer):
            if edit.on_output:  # realised after hook_z: z still shows the unedited value
                z = z - edit.delta(pattern, values)
        raw = pattern
        for edit in access.edits_at(layer):
            pattern = edit.effective_pattern(pattern, values)
        raw = None if raw is pattern else raw
        dtype[:] = dtype or [access.parameter_dtype()]
        check_consistent(access, layer, pattern, values, z, mask, raw, dtype=dtype[0])
        on_layer(
            LayerActivations(
                layer=layer,
                pattern=pattern,
                values=values,
                z=z,
                layer_output=w.to(z.device).layer_output(z),
                weights=w,
                mask=mask.to(pattern.device),
                batch=batch,
            )
        )
        if not need_logits and layer == last:
            raise StreamDone

    if on_layer is not None:
        for layer in layers:
            for kind in ATTENTION_HOOKS:

                def keep(t: Tensor, hook: Any, layer: int = layer, kind: str = kind) -> None:
                    got = store.setdefault(layer, {})
                    got[kind] = t
                    if len(got) == len(ATTENTION_HOOKS):
                        finish(layer)

                hooks.append((access.hook_name(kind, layer), keep))
    with ExitStack() as stack:
        stack.enter_context(torch.enable_grad() if gradients else torch.inference_mode())
        # interventions first, so captured activations are the intervened ones
        # (hook sets are entered as themselves, plain pairs through model.hooks)
        hook_sets = [h for h in fwd_hooks if hasattr(h, "__enter__")]
        plain = [h for h in fwd_hooks if not hasattr(h, "__enter__")]
        if plain:  # a bridge's hook context costs a walk of its hook points, empty or not
            stack.enter_context(access.hooks(plain))
        for hook_set in hook_sets:
            stack.enter_context(hook_set)
        stack.enter_context(access.hooks(hooks))
        try:
            out = access.forward(tokens)
        except StreamDone:
            out = None
    if on_layer is not None:
        fired = {layer: set(got) for layer, got in store.items()}
        check_delivered(access, layers, delivered, fired, ATTENTION_HOOKS)
    return None if out is None or not need_logits else out.float()


def check_delivered(
    access: ModelAccess,
    layers: Sequence[int],
    delivered: set[int],
    fired: dict[int, set[str]],
    kinds: Sequence[str],
) -> None:
    """Raise unless every requested layer was handed over in the pass (no silent zeros).

    `fired` holds, per layer not yet handed over, the hook kinds that did fire; `kinds` are
    the hook kinds (of `ModelAccess.hook_name`) a layer needs.
    A hook point that exists but never runs would otherwise leave a consumer uncalled and a
    result of zeros.
    """
    missing = [layer for layer in layers if layer not in delivered]
    if not missing:
        return
    layer = missing[0]
    silent = [access.hook_name(k, layer) for k in kinds if k not in fired.get(layer, set())]
    raise UnsupportedModelError(
        f"{access.architecture}, layer {layer}: the hook {' / '.join(silent) or '(none)'} never "
        f"fired in the forward pass (layers {missing} were not delivered), although the model "
        "lists it. This model does not run the hook points cw_lens reads, so every number for "
        "the missing layers would be zero; it is not supported by this analysis "
        "(cw_lens.verify_model(model) shows which analyses are)."
    )
