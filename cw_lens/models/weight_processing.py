r"""Detect TransformerLens weight processing that changes contribution weights.

`HookedTransformer.from_pretrained` (and a bridge's `enable_compatibility_mode()` /
`process_weights()`) rewrite the weights by default. Three of the rewrites leave the model's
outputs unchanged but not every quantity cw_lens reads:

- `fold_ln` folds the norm scale (and LayerNorm bias) into `W_Q/W_K/W_V` (and `b_V`).
  Values `v_j = norm(x_j) (diag(w) W_V) + (b W_V + b_V)` are unchanged, so contribution
  weights are too (to rounding). Not reported on its own.
- `center_writing_weights` (LayerNorm models only) subtracts from every head's `W_O^h` its
  mean over `d_model`. Each projected value `pv_j^h = v_j W_O^h` loses its mean component:
  norms, cosines and hence contribution weights change (the next LayerNorm removes that
  component, so logits do not show it).
- `fold_value_biases` moves `b_V^h W_O^h` — part of every projected value of head `h` —
  into `b_O` (which `o_i` excludes) and sets `b_V = 0`: contribution weights, sink value
  geometry and the effect of head removal or pair masking change on any model with value
  biases (GPT-2, Qwen2, ...). Llama-style models have no biases: nothing changes.

Only the bridge records that it processed its weights (`_weights_processed`, TransformerLens
3.x/4.x); a HookedTransformer records `normalization_type` `LNPre`/`RMSPre` after
`fold_ln`. The two rewrites that matter are therefore detected by their signatures, which
unprocessed weights do not show:

- centred `W_O`: in every layer every row of `W_O^h` has a mean over `d_model` below
  `0.1 ×` its random-walk scale `rms(row) / sqrt(d_model)` (about 1e-5 after centring in
  float32, ~1e-2 in bfloat16; an uncentred row passes by chance with probability ~0.08, and a
  layer has `n_heads × d_head` rows);
- folded value biases: `b_V` exactly zero in every layer while some `b_O` is not (a model
  trained with an output bias but no value bias looks the same; then ignore the message).

`processing_warnings` returns one message per detected rewrite, each naming the fix.

Example:

    from transformer_lens import HookedTransformer
    model = HookedTransformer.from_pretrained("gpt2")          # processed by default
    cw_lens.models.weight_processing.processing_warnings(model)       # two messages
    model = HookedTransformer.from_pretrained_no_processing("gpt2")
    cw_lens.models.weight_processing.processing_warnings(model)       # []
"""

from __future__ import annotations

from typing import Any

import torch

from cw_lens.models.access import ModelAccess, model_access
from cw_lens.models.hooked import is_hooked

CENTRED_SCALE = 0.1  # max |row mean| in units of rms(row) / sqrt(d_model)


def _layer_facts(model: Any) -> list[dict[str, bool]]:
    """Per layer: is `W_O` centred, is `b_V` absent / zero, is `b_O` absent / non-zero.

    Each layer's `W_O`, `b_V` and `b_O` are read together, once, through
    [`resident_weights`][cw_lens.models.offload.resident_weights] (offloaded and
    layer-streamed models too: one read of each layer, not one per weight), and dropped
    before the next layer is read.
    """
    access = model_access(model)
    return [layer_facts(access, layer) for layer in range(access.n_layers)]


def layer_facts(access: ModelAccess, layer: int) -> dict[str, bool]:
    """One layer's facts for `processing_warnings` (verification reads them inside its probe
    pass, while a streamed layer is loaded).

    Args:
        access: The model's access layer.
        layer: The layer.

    Returns:
        `centred`, `b_V_missing`, `b_V_zero`, `b_O_missing`, `b_O_nonzero`.
    """
    got = access.attention_weights(layer, ("W_O", "b_V", "b_O"))
    b_V, b_O = got["b_V"], got["b_O"]
    return {
        "centred": _centred(got["W_O"]),
        "b_V_missing": b_V is None,
        "b_V_zero": b_V is not None and not bool(b_V.any()),
        "b_O_missing": b_O is None,
        "b_O_nonzero": b_O is not None and bool(b_O.any()),
    }


def _centred(W_O: torch.Tensor) -> bool:
    W_O = W_O.float().flatten(0, 1)  # [head * d_head, d_model]
    rms = W_O.pow(2).mean(-1).sqrt()
    live = rms > 0
    if not bool(live.any()):
        return True
    t = W_O.mean(-1)[live].abs() * W_O.shape[-1] ** 0.5 / rms[live]
    return float(t.max()) <= CENTRED_SCALE


def w_o_is_centred(model: Any, facts: list[dict[str, bool]] | None = None) -> bool:
    """True when every row of every head's `W_O^h` has (numerically) zero mean over d_model.

    Args:
        model: A `HookedTransformer` or `TransformerBridge`.
        facts: The per-layer facts, when already read.

    Returns:
        Whether `W_O` is centred in every layer.
    """
    facts = _layer_facts(model) if facts is None else facts
    return all(f["centred"] for f in facts)


def value_biases_look_folded(model: Any, facts: list[dict[str, bool]] | None = None) -> bool:
    """True when `b_V` is exactly zero in every layer and `b_O` is non-zero in some layer.

    Args:
        model: A `HookedTransformer` or `TransformerBridge`.
        facts: The per-layer facts, when already read.

    Returns:
        Whether the value biases look folded into `b_O`.
    """
    facts = _layer_facts(model) if facts is None else facts
    if any(f["b_V_missing"] for f in facts) or all(f["b_O_missing"] for f in facts):
        return False
    return all(f["b_V_zero"] for f in facts) and any(f["b_O_nonzero"] for f in facts)


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


def processing_warnings(model: Any, facts: list[dict[str, bool]] | None = None) -> list[str]:
    """Messages for each detected weight rewrite that changes cw_lens results ([] if none).

    Args:
        model: A `HookedTransformer` or `TransformerBridge`.
        facts: The per-layer facts ([`layer_facts`][cw_lens.models.weight_processing.layer_facts]),
            when already read.

    Returns:
        One message per rewrite (centred `W_O`, folded value biases), each saying what
        changes and how to load raw weights. Processing that changes no cw_lens result
        (`fold_ln`, `center_unembed`, or any of them on a bias-free RMSNorm model) gives [].
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
    facts = _layer_facts(model) if facts is None else facts
    if w_o_is_centred(model, facts):
        messages.append(
            f"{name}: W_O is centred over d_model in every layer (center_writing_weights"
            f"{context}). Each head's projected values lost their mean component, so "
            "contribution weights, relative norms, cosines and value norms differ from those "
            "of the raw weights (the logits do not show it). To analyse the raw weights, "
            f"{_fix(model)}."
        )
    if value_biases_look_folded(model, facts):
        messages.append(
            f"{name}: the value biases are zero and b_O is not, as after fold_value_biases"
            f"{context}. Each head's b_V W_O, part of every projected value, now sits in b_O, "
            "which cw_lens excludes from o_i: contribution weights, sink value geometry and the "
            "effects of head removal and pair masking differ from those of the raw weights. To "
            f"analyse the raw weights, {_fix(model)}. (A model trained with an output bias but "
            "no value bias looks the same; then ignore this.)"
        )
    return messages
