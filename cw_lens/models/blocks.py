"""Model access for contribution flow (docs/methods.md#flow): the residual-stream hooks, checked.

`run_blocks` runs one forward pass and, as each requested block finishes, hands a
`BlockActivations` — the attention layer's activations from
`cw_lens.models.capture.run_layers` plus the residual stream before and after the block, the
attention and MLP pieces as they enter the residual, and the post-attention norm linearised at
its actual input — to a callback inside the pass, then drops it.

Every block is checked against the model before a number leaves it (a silent wrong number is
the worst defect); a failure raises [`UnsupportedModelError`][cw_lens.UnsupportedModelError] naming
the architecture, the layer, the identity and the size of the error:

1. `resid_post == resid_pre + attn_out + mlp_out` (the block has no hidden pieces: no
   residual multiplier, no un-hooked branch), and on sequential blocks `resid_mid ==
   resid_pre + attn_out` (`hook_resid_mid` is the stream the MLP reads: the half node
   `m_l` of the route graph);
2. `attn_out == A(o + b_O)` with `o = sum_h z^h W_O^h` from `hook_z` and `A` the
   identity (pre-norm) or the post-attention norm recomputed from its parameters at its
   actual input (post-norm: Gemma 2/3, OLMo 2/3).

(The third identity, `sum_{h,j} share(h, j) == <o, u>` — the attention pattern and values
are what `z` is made of — is checked by [`cw_lens.LayerSharesResult`][cw_lens.LayerSharesResult].)

After the pass, every requested block must have been handed over: a hook point that the
model lists but never runs (OpenAI-GPT's `hook_resid_post`) raises
[`UnsupportedModelError`][cw_lens.UnsupportedModelError] naming the layer and the hook, never an
empty result.

All hook names and module look-ups of the flow analyses live in `block_wiring`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import torch
from jaxtyping import Float, Float32
from torch import Tensor

from cw_lens.core import flow_geometry as fg
from cw_lens.core.errors import UnsupportedModelError
from cw_lens.core.registry import saveable
from cw_lens.models.access import model_access, read_weights
from cw_lens.models.batch import TokenBatch
from cw_lens.models.capture import (
    LayerActivations,
    LayerWeights,
    StreamDone,
    check_delivered,
    run_layers,
)

# Relative tolerance of the block checks, by the model's activation dtype: float32 rounding
# leaves ~1e-6, half precision ~1e-2; a wrong wiring (a missing multiplier, a wrong hook) is O(1).
CHECK_RTOL = {torch.float64: 1e-6, torch.float32: 1e-3, torch.bfloat16: 6e-2, torch.float16: 3e-2}
# the residual-stream hooks of every block (sequential blocks add `resid_mid`)
BLOCK_HOOKS = ("resid_pre", "attn_out", "mlp_out", "resid_post")


@dataclass
class NormSpec:
    """A normalisation module as `out = r(a) g ⊙ C(a) + beta` (float32 parameters)."""

    name: str
    gain: Float[Tensor, " d_model"]
    bias: Float[Tensor, " d_model"] | None
    eps: float
    centred: bool


@dataclass
class BlockWiring:
    """Where block `layer`'s residual-stream pieces are read.

    `hooks` maps `resid_pre`, `attn_out` (the attention piece as it enters the
    residual), `mlp_out` (likewise, after any post-MLP norm), `resid_post` and, on
    sequential blocks, `resid_mid` (the stream the MLP reads) to hook names; `post_norm` is
    the post-attention norm (`None` on pre-norm blocks). `sequential` is False on parallel
    blocks (GPT-J, NeoX, Falcon, Phi, Cohere: the MLP reads `x_l`, there is no
    `resid_mid`). `norm` is the post-attention norm module while its parameters are still
    to be read (`block_wiring(..., read_norm=False)`: `run_blocks` reads them inside its pass).
    """

    layer: int
    hooks: dict[str, str]
    post_norm: NormSpec | None
    sequential: bool = True
    norm: Any = None


def block_wiring(model: Any, layer: int, *, read_norm: bool = True) -> BlockWiring:
    """The hook names and the post-attention norm of one block (the only model look-ups here).

    Hook names come from the access layer (`cw_lens.models.access.model_access`); the
    post-attention norm is `blocks[layer].ln1_post` on `TransformerBridge` and
    `HookedTransformer` alike, and both route `hook_attn_out`/`hook_mlp_out` through the
    post-norms (verified on every pass by `check_block`).

    Args:
        model: A TransformerLens model.
        layer: The block.
        read_norm: Read the post-attention norm's parameters now. Without it they are left
            to read later (`norm` holds the module, `post_norm` is `None`): on a
            layer-streamed model a read before the pass would de-quantise every layer once more.

    Returns:
        The block's wiring.
    """
    access = model_access(model)
    sequential = not bool(getattr(model.cfg, "parallel_attn_mlp", False))
    kinds = BLOCK_HOOKS + (("resid_mid",) if sequential else ())
    hooks = {kind: access.hook_name(kind, layer) for kind in kinds}
    block = model.blocks[layer]
    norm = getattr(block, "ln1_post", None)
    if norm is None or not read_norm:
        return BlockWiring(layer, hooks, None, sequential, norm)
    return BlockWiring(layer, hooks, norm_spec(model, norm, layer), sequential)


def norm_spec(model: Any, module: Any, layer: int) -> NormSpec:
    """Read a norm's gain, bias and eps; refuse kinds whose formula is not known here."""
    inner = getattr(module, "original_component", None) or module
    name = type(inner).__name__
    # read through resident_weights: an offloaded norm's parameters are on `meta` between passes
    got = read_weights(inner, ("weight", "w", "bias", "b"), root=model)
    weight = got["weight"] if got["weight"] is not None else got["w"]
    bias = got["bias"] if got["bias"] is not None else got["b"]
    eps = next(
        (getattr(inner, a) for a in ("variance_epsilon", "eps", "epsilon") if hasattr(inner, a)),
        None,
    )
    is_rms = "RMS" in name.upper()
    is_layer = isinstance(inner, torch.nn.LayerNorm) or (not is_rms and "LayerNorm" in name)
    if weight is None or eps is None or not (is_rms or is_layer):
        raise UnsupportedModelError(
            f"{arch_name(model)}: the post-attention norm of layer {layer} ({name}) is not an "
            "RMSNorm or LayerNorm with readable weight and eps, so it cannot be linearised "
            "exactly (docs/methods.md#flow). Contribution flow supports pre-norm blocks and "
            "post-norm blocks with RMSNorm/LayerNorm (Gemma 2/3, OLMo 2/3)."
        )
    gain = weight.detach().float()
    if is_rms and "Gemma" in name:
        gain = gain + 1.0  # Gemma's RMSNorm scales by (1 + weight)
    bias = None if bias is None or is_rms else bias.detach().float()
    return NormSpec(name, gain, bias, float(eps), centred=is_layer)


@saveable
@dataclass
class AttentionMap:
    """The map `A` from the attention output to its residual piece, for one batch.

    `A_i(p) = row_scale_i * gain ⊙ C(p)` (all `None`: the identity) and `norm_bias` the
    norm's bias (it belongs to the bias piece).
    """

    row_scale: Float[Tensor, "batch pos"] | None = None
    gain: Float[Tensor, " d_model"] | None = None
    centred: bool = False
    norm_bias: Float[Tensor, " d_model"] | None = None

    def __call__(self, p: Tensor) -> Tensor:
        return fg.apply_linear_map(p, self.row_scale, self.gain, self.centred)


@saveable
@dataclass
class BlockActivations:
    """One block's residual-stream pieces for one batch (float32, on the model's device).

    Attributes:
        acts: The attention layer's `LayerActivations`.
        resid_pre: `x_l` [batch, pos, d_model].
        resid_post: `x_{l+1}`.
        resid_mid: `m_l = x_l + A(o + b_O) (+ beta)`, the stream the MLP reads (`None` on
            parallel blocks, whose MLP reads `x_l`).
        attn_out: The attention piece as it enters the residual (`A(o + b_O)`).
        mlp_out: The MLP piece as it enters the residual (after any post-MLP norm).
        layer_output: `o = sum_h z^h W_O^h` (`b_O` excluded, before `A`).
        attn_map: The (linearised) map `A`.
    """

    acts: LayerActivations
    resid_pre: Float32[Tensor, "batch pos d_model"]
    resid_post: Float32[Tensor, "batch pos d_model"]
    attn_out: Float32[Tensor, "batch pos d_model"]
    mlp_out: Float32[Tensor, "batch pos d_model"]
    layer_output: Float32[Tensor, "batch pos d_model"]
    attn_map: AttentionMap
    dtype: torch.dtype
    resid_mid: Float32[Tensor, "batch pos d_model"] | None = None

    @property
    def layer(self) -> int:
        return self.acts.layer

    @cached_property
    def bias_piece(self) -> Float[Tensor, "batch pos d_model"] | None:
        """`A_i(b_O) + beta`, or `None` when the block has neither."""
        b_O, beta = self.acts.weights.b_O, self.attn_map.norm_bias
        if b_O is None and beta is None:
            return None
        piece = torch.zeros(self.resid_post.shape, device=self.resid_post.device)
        if b_O is not None:
            piece = self.attn_map(piece + b_O)
        return piece if beta is None else piece + beta


def arch_name(model: Any) -> str:
    """The model's name and architecture, as the flow checks' error messages name them."""
    access = model_access(model)
    return f"{access.name!r} ({access.architecture})"


def _row_error(actual: Tensor, expected: Tensor, scale: Tensor, mask: Tensor) -> float:
    """Largest `||actual - expected|| / scale` over real positions."""
    err = (actual - expected).norm(dim=-1) / scale.clamp_min(1e-30)
    err = err.masked_fill(~mask, 0.0)
    return float(err.max()) if err.numel() else 0.0


def check_block(model: Any, block: BlockActivations) -> None:
    """Identities 1 and 2 of the module docstring; raise UnsupportedModelError if one fails."""
    rtol = CHECK_RTOL.get(block.dtype, 6e-2)
    mask = block.acts.mask
    pieces = (block.resid_pre, block.attn_out, block.mlp_out)
    scale = sum(p.norm(dim=-1) for p in pieces)
    err = _row_error(sum(pieces), block.resid_post, scale, mask)
    if not err <= rtol:
        raise UnsupportedModelError(
            f"{arch_name(model)}, layer {block.layer}: "
            f"resid_post != resid_pre + attn_out + mlp_out "
            f"(relative error {err:.2e} > {rtol:.0e}). The block adds something the hooks do "
            "not show (a residual multiplier such as Granite's, or another branch), so the "
            "residual shares would not add up; this architecture is not supported by the "
            "flow analyses."
        )
    if block.resid_mid is not None:
        pieces = (block.resid_pre, block.attn_out)
        scale = sum(p.norm(dim=-1) for p in pieces)
        err = _row_error(sum(pieces), block.resid_mid, scale, mask)
        if not err <= rtol:
            raise UnsupportedModelError(
                f"{arch_name(model)}, layer {block.layer}: resid_mid != resid_pre + attn_out "
                f"(relative error {err:.2e} > {rtol:.0e}). The stream the MLP reads is not the "
                "block input plus the attention piece (a parallel block not flagged as one, or "
                "hooks that do not reflect the computation); the sub-layer route graph would "
                "be wrong, so this architecture is not supported by the flow analyses."
            )
    a = block.layer_output
    b_O = block.acts.weights.b_O
    if b_O is not None:
        a = a + b_O
    expected = block.attn_map(a)
    if block.attn_map.norm_bias is not None:
        expected = expected + block.attn_map.norm_bias
    err = _row_error(expected, block.attn_out, block.attn_out.norm(dim=-1) + 1e-6, mask)
    if not err <= rtol:
        what = "the post-attention norm recomputed at" if block.attn_map.gain is not None else ""
        raise UnsupportedModelError(
            f"{arch_name(model)}, layer {block.layer}: attn_out != {what} sum_h z W_O + b_O "
            f"(relative error {err:.2e} > {rtol:.0e}). The attention piece of the residual is "
            "not the head outputs (a multiplier, an unknown post-attention transform, or "
            "hooks that do not reflect the computation), so pair shares would be wrong; "
            "this architecture is not supported by the flow analyses."
        )


def attention_map(wiring: BlockWiring, a: Tensor) -> AttentionMap:
    """`A` for one batch: the identity, or the post-norm linearised at `a = o + b_O`."""
    spec = wiring.post_norm
    if spec is None:
        return AttentionMap()
    device = a.device
    return AttentionMap(
        row_scale=fg.norm_row_scale(a, spec.eps, spec.centred),
        gain=spec.gain.to(device),
        centred=spec.centred,
        norm_bias=None if spec.bias is None else spec.bias.to(device),
    )


def run_blocks(
    model: Any,
    batch: TokenBatch,
    on_block: Callable[[BlockActivations], None],
    *,
    layers: Sequence[int],
    fwd_hooks: Sequence[tuple[str, Callable]] = (),
    need_logits: bool = False,
    weights: dict[int, LayerWeights] | None = None,
) -> Tensor | None:
    """One forward pass; `on_block` gets each requested block's checked activations.

    Without `need_logits` the pass ends after the last requested block. Returns the logits
    (float32) when `need_logits`, else `None`. Raises
    [`UnsupportedModelError`][cw_lens.UnsupportedModelError] when a requested block was not
    delivered (a hook the model lists never fired).
    """
    access = model_access(model)
    # the post-attention norms are read in the pass, while their layer is in (`finish`)
    wirings = {layer: block_wiring(model, layer, read_norm=False) for layer in layers}
    last = max(layers)
    attention: dict[int, LayerActivations] = {}
    store: dict[int, dict[str, Tensor]] = {}
    delivered: set[int] = set()
    hooks: list[tuple[str, Callable]] = []

    def stash(acts: LayerActivations) -> None:
        attention[acts.layer] = acts

    def finish(t: Tensor, hook: Any, layer: int) -> None:
        got = store.pop(layer, {})
        got["resid_post"] = t
        wiring = wirings[layer]
        if layer not in attention:  # run_layers names the attention hook that did not fire
            return
        if set(wiring.hooks) - set(got):  # a piece of the block never fired
            check_delivered(access, [layer], set(), {layer: set(got)}, wiring.hooks)
        acts = attention.pop(layer)
        if wiring.norm is not None and wiring.post_norm is None:
            wiring.post_norm = norm_spec(model, wiring.norm, layer)
        o, b_O = acts.layer_output, acts.weights.b_O
        block = BlockActivations(
            acts=acts,
            resid_pre=got["resid_pre"].float(),
            resid_post=t.float(),
            attn_out=got["attn_out"].float(),
            mlp_out=got["mlp_out"].float(),
            layer_output=o,
            attn_map=attention_map(wiring, o if b_O is None else o + b_O),
            dtype=t.dtype,
            resid_mid=got["resid_mid"].float() if "resid_mid" in got else None,
        )
        check_block(model, block)
        delivered.add(layer)
        on_block(block)
        if not need_logits and layer == last:
            raise StreamDone

    for layer, wiring in wirings.items():
        for kind, name in wiring.hooks.items():
            if kind == "resid_post":
                hooks.append((name, lambda t, hook, layer=layer: finish(t, hook, layer)))
                continue

            def keep(t: Tensor, hook: Any, layer: int = layer, kind: str = kind) -> None:
                store.setdefault(layer, {})[kind] = t

            hooks.append((name, keep))
    # run_layers must not stop at the last attention layer (its MLP is needed): it runs to
    # the end, unless `finish` ends the pass (run_layers turns StreamDone into `None`)
    logits = run_layers(
        model,
        batch,
        stash,
        layers=list(layers),
        fwd_hooks=[*fwd_hooks, *hooks],
        need_logits=True,
        weights=weights,
    )
    fired = {layer: set(got) for layer, got in store.items()}
    check_delivered(access, layers, delivered, fired, BLOCK_HOOKS)
    return logits
