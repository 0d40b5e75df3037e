r"""Gradients of a loss with respect to each attention layer's output, through the model itself.

`attention_output_gradients` runs one forward pass with autograd on. On the module whose output
is exactly `o_i + b_O = sum_h z_i^h W_O^h + b_O` of each requested layer (the output
projection; `cw_lens.models.access.ModelAccess.output_projection`) it adds a zero tensor that
requires a gradient, so that after `loss(logits)` is differentiated that tensor's gradient is
`g_i = dL/do_i` — with every later layer, its attention pattern included, responding to `o_i`
as the model computes it. The layer's pattern, values and `z` are captured in the same pass and
checked as in every capture (`z == pattern @ v`), and the output the gradient is taken at is
checked to be `z W_O + b_O` (else the gradient would belong to another tensor:
[`UnsupportedModelError`][cw_lens.UnsupportedModelError]).

Because `z_i^h = sum_j alpha_ij^h v_j^h`, the gradient of the loss with respect to one attention
probability follows without a hook on the pattern (whose edits some models ignore):

    dL/dalpha_ij^h = <pv_j^h, g_i>,   pv_j^h = v_j^h W_O^h

so attribution patching's first-order prediction of removing the pair, `-alpha_ij^h
dL/dalpha_ij^h` (Nanda, "Attribution Patching", 2023; Syed et al., 2023), costs one forward and
one backward pass for every pair of every layer (`LayerGradient.attribution`).

Example:

    import cw_lens
    from cw_lens.data.inputs import prepare_inputs
    from cw_lens.data.scoring import token_nll
    from cw_lens.models.gradients import attention_output_gradients

    model = cw_lens.load_model("testing:tiny-llama")
    batch = prepare_inputs(model, ["The cat sat on the mat."])

    def loss(logits):
        return token_nll(logits, batch.tokens, batch.mask).nansum()

    layers = attention_output_gradients(model, batch, loss, layers=[0, 1])
    layers[1].attribution().shape  # [batch, head, query, key]
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from jaxtyping import Float
from torch import Tensor

from cw_lens.core.errors import InputError, UnsupportedModelError
from cw_lens.core.geometry import grouped_scores, project_into_heads
from cw_lens.models.access import model_access
from cw_lens.models.batch import TokenBatch
from cw_lens.models.capture import (
    CONSISTENCY_RTOL,
    HALF_PRECISION_RTOL,
    LayerActivations,
    run_layers,
)


@dataclass
class LayerGradient:
    """One layer's activations and the loss's gradient with respect to its output.

    Attributes:
        acts: The layer's checked activations.
        output_grad: `g_i = dL/do_i` `[batch, query, d_model]` (float32).
    """

    acts: LayerActivations
    output_grad: Float[Tensor, "batch query d_model"]

    @property
    def layer(self) -> int:
        return self.acts.layer

    def pattern_grad(self) -> Float[Tensor, "batch head query key"]:
        """`dL/dalpha_ij^h = <pv_j^h, g_i>`, from `W_O^h g_i` and the (grouped) values.

        Returns:
            The gradient of the loss with respect to every attention probability.
        """
        W_O = self.acts.weights.W_O.to(self.output_grad.device)
        return grouped_scores(project_into_heads(self.output_grad, W_O), self.acts.values)

    def attribution(self) -> Float[Tensor, "batch head query key"]:
        """Attribution patching's prediction of how much removing each pair raises the loss:
        `-alpha_ij^h dL/dalpha_ij^h` (0 where `alpha` is 0).

        Returns:
            The first-order loss increase per (head, query, key).
        """
        return -self.acts.pattern * self.pattern_grad()


def attention_output_gradients(
    model: Any,
    batch: TokenBatch,
    loss: Callable[[Tensor], Tensor],
    *,
    layers: Sequence[int],
) -> dict[int, LayerGradient]:
    """One forward and one backward pass: per layer, `dL/do` and the checked activations.

    Args:
        model: A TransformerLens model (verified by the caller).
        batch: The documents, right-padded.
        loss: A scalar function of the logits `[batch, pos, vocab]` (float32), e.g. the
            summed next-token NLL.
        layers: The layers whose output gradient is taken.

    Returns:
        `{layer: LayerGradient}`.

    Raises:
        UnsupportedModelError: When the output projection's output is not `z W_O + b_O`.
        InputError: When `loss` does not give a finite scalar that depends on the logits.
    """
    access = model_access(model)
    layers = sorted(set(layers))
    leaves: dict[int, Tensor] = {}
    outputs: dict[int, Tensor] = {}
    acts: dict[int, LayerActivations] = {}

    def add_leaf(layer: int) -> Callable:
        def fn(_module: Any, _args: Any, output: Any) -> Any:
            first = output[0] if isinstance(output, (tuple, list)) else output
            leaf = torch.zeros_like(first, requires_grad=True)
            leaves[layer], outputs[layer] = leaf, first.detach()
            moved = first + leaf
            if isinstance(output, (tuple, list)):
                return type(output)([moved, *output[1:]])
            return moved

        return fn

    hooks = [(access.output_projection(layer), add_leaf(layer)) for layer in layers]
    with access.module_hooks(hooks):
        logits = run_layers(
            model,
            batch,
            lambda a: acts.__setitem__(a.layer, a),
            layers=layers,
            need_logits=True,
            gradients=True,
        )
    value = loss(logits)
    if not (isinstance(value, Tensor) and value.numel() == 1 and value.requires_grad):
        raise InputError("The loss must be a scalar tensor computed from the logits.")
    if not bool(torch.isfinite(value)):
        raise InputError(f"The loss is {float(value)}: its gradient would be meaningless.")
    missing = [layer for layer in layers if layer not in leaves]
    if missing:
        raise UnsupportedModelError(
            f"{access.architecture}: the output projection of layers {missing} never ran, so "
            "the loss's gradient with respect to their output cannot be read."
        )
    grads = torch.autograd.grad(value, [leaves[layer] for layer in layers], allow_unused=True)
    out = {}
    for layer, grad in zip(layers, grads, strict=True):
        a = acts[layer]
        _check_output(access, a, outputs[layer])
        g = torch.zeros_like(outputs[layer]) if grad is None else grad
        out[layer] = LayerGradient(a, g.float().reshape(a.layer_output.shape))
    return out


def _check_output(access: Any, acts: LayerActivations, output: Tensor) -> None:
    """Raise unless the tensor the gradient was taken at is `z W_O + b_O` (real positions)."""
    expected = acts.layer_output
    if acts.weights.b_O is not None:
        expected = expected + acts.weights.b_O.to(expected.device)
    got = output.float().reshape(expected.shape)
    mask = acts.mask[:, : expected.shape[1], None].to(expected.device)
    err = ((got - expected).abs() * mask).amax() / expected.abs().amax().clamp_min(1e-30)
    dtype = access.parameter_dtype()
    rtol = CONSISTENCY_RTOL.get(dtype, HALF_PRECISION_RTOL)
    if not float(err) <= rtol:
        raise UnsupportedModelError(
            f"{access.architecture}, layer {acts.layer}: the output projection's output is not "
            f"sum_h z W_O + b_O (relative error {float(err):.2e} > {rtol:.0e}), so the gradient "
            "taken there would not be the gradient with respect to the attention output; "
            "attribution patching cannot run on this model."
        )
