"""Independent float64 reference read off the Hugging Face modules themselves.

Nothing here touches cw_lens or TransformerLens hooks. For one layer of the float64 twin of a
tiny model (``architectures.Built.hf``), plain torch hooks on the HF modules give:

- ``alpha`` ``[batch, head, query, key]``: the attention probabilities the HF attention module
  returns (eager attention);
- ``v`` ``[batch, key, kv_head, d_head]``: the output of the HF value projection (or the fused
  qkv projection, split by hand per layout), after any clamp the architecture applies;
- ``W_O`` ``[head, d_head, d_model]`` and ``b_O``: the HF output projection's weight and bias;
- ``z``: the input of the output projection (what the model really mixed), used only to check
  ``alpha @ v == z`` — that check is what makes the reference trustworthy.

From these, ``tests/reference.dense_contributions`` materialises every ``alpha pv_j`` vector.
Interventions are applied as forward pre-hooks on the HF output projection that edit ``z``
exactly (methods § Attention sinks), with ``alpha`` and ``v`` from a clean run.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from architectures import Arch
from reference import dense_contributions
from torch import Tensor


@dataclass
class LayerRef:
    alpha: Tensor  # [batch, head, query, key]
    v: Tensor  # [batch, key, kv_head, d_head]
    z: Tensor  # [batch, query, head, d_head] (the output projection's input)
    W_O: Tensor  # [head, d_head, d_model]
    b_O: Tensor | None
    out: Tensor  # the output projection's output [batch, query, d_model]

    @property
    def group(self) -> int:
        return self.alpha.shape[1] // self.v.shape[2]

    def mixed(self) -> Tensor:
        """``sum_j alpha[i,j]^h v_j^{g(h)}`` ``[batch, query, head, d_head]``."""
        v = self.v.repeat_interleave(self.group, dim=2)
        return torch.einsum("bhqk,bkhd->bqhd", self.alpha, v)


def n_heads(hf: Any) -> int:
    return int(hf.config.num_attention_heads)


def split_values(arch: Arch, hf: Any, out: Tensor, d_head: int) -> Tensor:
    """The values ``[batch, pos, kv_head, d_head]`` in the output of ``arch.values``."""
    out = out.reshape(out.shape[0], -1, out.shape[-1])  # DeepSeek's kv_b_proj sees [b, 1, t, r]
    b, t, width = out.shape
    heads = n_heads(hf)
    if arch.layout == "heads":  # a value projection of its own
        v = out.reshape(b, t, -1, d_head)
    elif arch.layout == "qkv_concat":  # [q (heads), k (kv heads), v (kv heads)]
        kv_heads = (width - heads * d_head) // (2 * d_head)
        v = out[..., width - kv_heads * d_head :].reshape(b, t, kv_heads, d_head)
    elif arch.layout == "interleave":  # per head [q, k, v]
        v = out.reshape(b, t, heads, 3, d_head)[:, :, :, 2]
    elif arch.layout == "falcon_mqa":  # [q (heads), k, v]: one kv head
        v = out.reshape(b, t, heads + 2, d_head)[:, :, -1:]
    elif arch.layout == "falcon_new":  # per kv group [q (heads / kv heads), k, v]
        kv_heads = int(hf.config.num_kv_heads)
        v = out.reshape(b, t, kv_heads, heads // kv_heads + 2, d_head)[:, :, :, -1]
    elif arch.layout == "mla":  # multi-head latent attention: kv_b_proj gives per head [k_nope, v]
        v = out.reshape(b, t, heads, -1)[..., -d_head:]
    elif arch.layout == "codegen":  # 4 model-parallel shards, each [q, v, k]
        v = out.reshape(b, t, 4, 3, width // 12)[:, :, :, 1].reshape(b, t, heads, d_head)
    else:
        raise ValueError(f"unknown layout {arch.layout!r}")
    if arch.clip_qkv is not None:
        v = v.clamp(-arch.clip_qkv, arch.clip_qkv)
    return v


def output_weight(module: Any, heads: int) -> tuple[Tensor, Tensor | None]:
    """``W_O`` ``[head, d_head, d_model]`` and ``b_O`` of an HF output projection."""
    w = module.weight.detach()
    if type(module).__name__ != "Conv1D":  # nn.Linear-like: weight [out, in]
        w = w.T
    b = getattr(module, "bias", None)
    return w.reshape(heads, -1, w.shape[-1]), None if b is None else b.detach()


def _get(hf: Any, path: str) -> Any:
    return hf.get_submodule(path)


def _forward(hf: Any, tokens: Tensor, grad: bool = False) -> Tensor:
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)  # XGLM builds torch.full((), finfo(float64).min)
    try:
        with torch.enable_grad() if grad else torch.no_grad():
            return hf(tokens, output_attentions=True, use_cache=False).logits
    finally:
        torch.set_default_dtype(default)


def n_layers(arch: Arch, hf: Any) -> int:
    n = 0
    while True:
        try:
            _get(hf, arch.attn.format(n))
        except AttributeError:
            return n
        n += 1


def capture(arch: Arch, hf: Any, tokens: Tensor) -> tuple[list[LayerRef], Tensor]:
    """One clean float64 run: every layer's reference tensors, and the logits.

    Fails unless the reference explains the model: ``alpha @ v == z`` and
    ``z W_O + b_O ==`` the output projection's output, to 1e-12.
    """
    heads = n_heads(hf)
    seen: list[dict[str, Tensor]] = []
    handles = []

    def keep(store: dict[str, Tensor], what: str) -> Callable:
        def on_output(_m: Any, args: Any, output: Any) -> None:
            if what == "alpha":  # the (last) [batch, head, query, key] tensor returned
                outs = output if isinstance(output, tuple | list) else (output,)
                probs = [o for o in outs if isinstance(o, Tensor) and o.dim() == 4]
                store["alpha"] = probs[-1].detach().clone()
            elif what == "values":
                store["values"] = output.detach().clone()
            else:
                store["z"], store["out"] = args[0].detach().clone(), output.detach().clone()

        return on_output

    for layer in range(n_layers(arch, hf)):
        attn = _get(hf, arch.attn.format(layer))
        store: dict[str, Tensor] = {}
        seen.append(store)
        handles += [
            attn.register_forward_hook(keep(store, "alpha")),
            attn.get_submodule(arch.values).register_forward_hook(keep(store, "values")),
            attn.get_submodule(arch.out).register_forward_hook(keep(store, "out")),
        ]
    try:
        logits = _forward(hf, tokens)
    finally:
        for h in handles:
            h.remove()
    refs = []
    b, t = tokens.shape
    for layer, store in enumerate(seen):
        W_O, b_O = output_weight(_get(hf, arch.attn.format(layer)).get_submodule(arch.out), heads)
        d_head = W_O.shape[1]
        ref = LayerRef(
            alpha=store["alpha"],
            v=split_values(arch, hf, store["values"], d_head),
            z=store["z"].reshape(b, t, heads, d_head),
            W_O=W_O,
            b_O=b_O,
            out=store["out"],
        )
        errors = check(ref)
        assert max(errors.values()) < 1e-12, f"{arch.name} L{layer}: reference broken {errors}"
        refs.append(ref)
    return refs, logits


def check(ref: LayerRef) -> dict[str, float]:
    """Self-checks of the reference: ``alpha @ v == z`` and ``z W_O + b_O == out`` (relative)."""
    z_err = (ref.mixed() - ref.z).norm() / ref.z.norm()
    out = torch.einsum("bqhd,hdm->bqm", ref.z, ref.W_O)
    if ref.b_O is not None:
        out = out + ref.b_O
    out_err = (out - ref.out).norm() / ref.out.norm()
    return {"z": float(z_err), "out": float(out_err)}


def contributions(ref: LayerRef, kind: str) -> dict[str, Tensor]:
    """Dense float64 contribution weights (``tests/reference.dense_contributions``)."""
    return dense_contributions(ref.alpha, ref.v, ref.W_O, kind)


# ----------------------------------------------------------------------------- interventions
def run_with_z_edit(
    arch: Arch, hf: Any, tokens: Tensor, edits: dict[int, Callable[[Tensor], Tensor]]
) -> Tensor:
    """Logits with ``z`` (``[batch, query, head, d_head]``) of each layer ``l`` in ``edits``
    replaced by ``edits[l](z)`` through a forward pre-hook on the HF output projection."""
    heads = n_heads(hf)

    def pre_hook(edit: Callable[[Tensor], Tensor]) -> Callable:
        def pre(_m: Any, args: Any) -> tuple:
            z = args[0]
            new = edit(z.reshape(*z.shape[:-1], heads, -1)).reshape(z.shape)
            return (new, *args[1:])

        return pre

    handles = [
        _get(hf, arch.attn.format(layer))
        .get_submodule(arch.out)
        .register_forward_pre_hook(pre_hook(edit))
        for layer, edit in edits.items()
    ]
    try:
        return _forward(hf, tokens)
    finally:
        for h in handles:
            h.remove()


def patch_sink_logits(
    arch: Arch, hf: Any, tokens: Tensor, ref: LayerRef, layer: int, heads: list[int], scale: float
) -> Tensor:
    """``z_i^h -= (1 - lambda) alpha[i,0]^h v_0^{g(h)}`` for ``i > 0`` and the chosen heads.

    ``ref`` is ``layer``'s clean capture: exact, as the edit acts on that layer alone.
    """
    v0 = ref.v[:, 0].repeat_interleave(ref.group, dim=1)  # [batch, head, d_head]
    term = ref.alpha[:, :, :, 0, None] * v0[:, :, None, :]  # [batch, head, query, d_head]
    term = term.transpose(1, 2)  # [batch, query, head, d_head]
    keep = torch.zeros(ref.alpha.shape[1], dtype=torch.bool)
    keep[heads] = True
    term = term * keep[None, None, :, None]
    term[:, 0] = 0.0  # the sink's own query row is left alone
    return run_with_z_edit(arch, hf, tokens, {layer: lambda z: z - (1.0 - scale) * term})


def mask_attention_logits(
    arch: Arch, hf: Any, tokens: Tensor, ref: LayerRef, layer: int, mask: Tensor
) -> Tensor:
    """``z_i^h -= sum_j mask[h,i,j] alpha[i,j]^h v_j^{g(h)}`` (pairs removed, no renormalising).

    ``mask`` broadcasts to ``[batch, head, query, key]``; ``ref`` is ``layer``'s clean capture.
    """
    removed = ref.alpha * mask.to(ref.alpha.dtype)
    v = ref.v.repeat_interleave(ref.group, dim=2)
    term = torch.einsum("bhqk,bkhd->bqhd", removed, v)
    return run_with_z_edit(arch, hf, tokens, {layer: lambda z: z - term})


def remove_heads_logits(arch: Arch, hf: Any, tokens: Tensor, heads: dict[int, list[int]]) -> Tensor:
    """``z^h = 0`` for the heads ``{layer: [heads]}``."""

    def zeroer(hs: list[int]) -> Callable[[Tensor], Tensor]:
        def zero(z: Tensor) -> Tensor:
            z = z.clone()
            z[:, :, hs] = 0.0
            return z

        return zero

    return run_with_z_edit(arch, hf, tokens, {layer: zeroer(hs) for layer, hs in heads.items()})


def z_gradients(
    arch: Arch, hf: Any, tokens: Tensor, loss: Callable[[Tensor], Tensor]
) -> list[Tensor]:
    """Per layer, ``dL/dz`` ``[batch, query, head, d_head]`` by autograd through the HF model: a
    zero tensor that requires a gradient is added to the input of each HF output projection."""
    heads = n_heads(hf)
    leaves: list[Tensor] = []

    def pre(_m: Any, args: Any) -> tuple:
        leaf = torch.zeros_like(args[0], requires_grad=True)
        leaves.append(leaf)
        return (args[0] + leaf, *args[1:])

    handles = [
        _get(hf, arch.attn.format(layer)).get_submodule(arch.out).register_forward_pre_hook(pre)
        for layer in range(n_layers(arch, hf))
    ]
    try:
        grads = torch.autograd.grad(loss(_forward(hf, tokens, grad=True)), leaves)
    finally:
        for h in handles:
            h.remove()
    return [g.reshape(*g.shape[:-1], heads, -1) for g in grads]
