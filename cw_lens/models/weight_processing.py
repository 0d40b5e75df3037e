r"""Detect TransformerLens weight processing that changes contribution weights.

``HookedTransformer.from_pretrained`` (and a bridge's ``enable_compatibility_mode()`` /
``process_weights()``) rewrite the weights by default. Three of the rewrites leave the model's
outputs unchanged but not every quantity cw_lens reads:

- ``fold_ln`` folds the norm scale (and LayerNorm bias) into ``W_Q/W_K/W_V`` (and ``b_V``).
  Values ``v_j = norm(x_j) (diag(w) W_V) + (b W_V + b_V)`` are unchanged, so contribution
  weights are too (to rounding). Not reported on its own.
- ``center_writing_weights`` (LayerNorm models only) subtracts from every head's ``W_O^h`` its
  mean over ``d_model``. Each projected value ``pv_j^h = v_j W_O^h`` loses its mean component:
  norms, cosines and hence contribution weights change (the next LayerNorm removes that
  component, so logits do not show it).
- ``fold_value_biases`` moves ``b_V^h W_O^h`` — part of every projected value of head ``h`` —
  into ``b_O`` (which ``o_i`` excludes) and sets ``b_V = 0``: contribution weights, sink value
  geometry and the effect of head removal or pair masking change on any model with value
  biases (GPT-2, Qwen2, ...). Llama-style models have no biases: nothing changes.

Only the bridge records that it processed its weights (``_weights_processed``, TransformerLens
3.x/4.x); a HookedTransformer records ``normalization_type`` ``LNPre``/``RMSPre`` after
``fold_ln``. The two rewrites that matter are therefore detected by their signatures, which
unprocessed weights do not show:

- centred ``W_O``: in every layer every row of ``W_O^h`` has a mean over ``d_model`` below
  ``0.1 ×`` its random-walk scale ``rms(row) / sqrt(d_model)`` (about 1e-5 after centring in
  float32, ~1e-2 in bfloat16; an uncentred row passes by chance with probability ~0.08, and a
  layer has ``n_heads × d_head`` rows);
- folded value biases: ``b_V`` exactly zero in every layer while some ``b_O`` is not (a model
  trained with an output bias but no value bias looks the same; then ignore the message).

:func:`processing_warnings` returns one message per detected rewrite, each naming the fix.

Example::

    from transformer_lens import HookedTransformer
    model = HookedTransformer.from_pretrained("gpt2")          # processed by default
    cw_lens.models.weight_processing.processing_warnings(model)       # two messages
    model = HookedTransformer.from_pretrained_no_processing("gpt2")
    cw_lens.models.weight_processing.processing_warnings(model)       # []
"""

from __future__ import annotations

from typing import Any

import torch

from cw_lens.models.hooked import is_hooked

CENTRED_SCALE = 0.1  # max |row mean| in units of rms(row) / sqrt(d_model)


def _attention(model: Any) -> list[Any]:
    return [block.attn for block in model.blocks]


def w_o_is_centred(model: Any) -> bool:
    """True when every row of every head's ``W_O^h`` has (numerically) zero mean over d_model."""
    for attn in _attention(model):
        W_O = attn.W_O.detach().float().flatten(0, 1)  # [head * d_head, d_model]
        rms = W_O.pow(2).mean(-1).sqrt()
        live = rms > 0
        if not bool(live.any()):
            continue
        t = W_O.mean(-1)[live].abs() * W_O.shape[-1] ** 0.5 / rms[live]
        if float(t.max()) > CENTRED_SCALE:
            return False
    return True


def _bias(attn: Any, name: str) -> torch.Tensor | None:
    bias = getattr(attn, name, None)
    return None if bias is None else bias.detach()


def value_biases_look_folded(model: Any) -> bool:
    """True when ``b_V`` is exactly zero in every layer and ``b_O`` is non-zero in some layer."""
    b_V = [_bias(attn, "b_V") for attn in _attention(model)]
    b_O = [_bias(attn, "b_O") for attn in _attention(model)]
    if any(b is None for b in b_V) or all(b is None for b in b_O):
        return False
    return all(not bool(b.any()) for b in b_V) and any(b is not None and bool(b.any()) for b in b_O)


def _fix(model: Any) -> str:
    if is_hooked(model):
        return (
            "load it with HookedTransformer.from_pretrained_no_processing(name) (or "
            "cw_lens.load_model(name, api='hooked'))"
        )
    return (
        "boot a fresh bridge and do not call enable_compatibility_mode()/process_weights() "
        "(or call enable_compatibility_mode(no_processing=True))"
    )


def processing_warnings(model: Any) -> list[str]:
    """Messages for each detected weight rewrite that changes cw_lens results ([] if none).

    Args:
        model: A ``HookedTransformer`` or ``TransformerBridge``.

    Returns:
        One message per rewrite (centred ``W_O``, folded value biases), each saying what
        changes and how to load raw weights. Processing that changes no cw_lens result
        (``fold_ln``, ``center_unembed``, or any of them on a bias-free RMSNorm model) gives [].
    """
    norm = str(getattr(model.cfg, "normalization_type", None))
    recorded = []
    if norm in ("LNPre", "RMSPre"):
        recorded.append(f"normalization_type is {norm}, so fold_ln ran")
    if getattr(model, "_weights_processed", False):
        recorded.append("the bridge records process_weights()")
    context = f" ({'; '.join(recorded)})" if recorded else ""
    name = getattr(model.cfg, "model_name", type(model).__name__)
    messages = []
    if w_o_is_centred(model):
        messages.append(
            f"{name}: W_O is centred over d_model in every layer (center_writing_weights"
            f"{context}). Each head's projected values lost their mean component, so "
            "contribution weights, relative norms, cosines and value norms differ from those "
            "of the raw weights (the logits do not show it). To analyse the raw weights, "
            f"{_fix(model)}."
        )
    if value_biases_look_folded(model):
        messages.append(
            f"{name}: the value biases are zero and b_O is not, as after fold_value_biases"
            f"{context}. Each head's b_V W_O, part of every projected value, now sits in b_O, "
            "which cw_lens excludes from o_i: contribution weights, sink value geometry and the "
            "effects of head removal and pair masking differ from those of the raw weights. To "
            f"analyse the raw weights, {_fix(model)}. (A model trained with an output bias but "
            "no value bias looks the same; then ignore this.)"
        )
    return messages
