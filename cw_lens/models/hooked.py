"""HookedTransformer models built from Hugging Face modules, with raw (unprocessed) weights.

TransformerLens 2.x and 3.x ship `HookedTransformer`; 4.0 removed it (`TransformerBridge`
exists from 3.0 on). `from_hf` turns a Llama- or GPT-2-architecture `transformers`
model into a `HookedTransformer` offline, without `from_pretrained` (which needs the hub and
processes the weights by default):

- the config is written out by hand from the Hugging Face config (`hooked_config`) —
  in particular `rotary_base` is read from the config (SmolLM2: 1e5; the generic Llama branch
  of TransformerLens' own loader falls back to 1e4) and grouped-query attention keeps its KV
  heads (`n_key_value_heads`);
- the weights go through TransformerLens' own converters (`convert_llama_weights`,
  `convert_gpt2_weights`) and are loaded as they are: no LayerNorm folding, no centring of
  `W_O`, no folding of value biases into `b_O` — so contribution weights are those of the
  model the Hugging Face weights define (see `cw_lens.models.weight_processing`).

The public functions' docstrings have runnable examples.
"""

from __future__ import annotations

from importlib.metadata import version
from typing import Any

import torch

from cw_lens.core.errors import InputError, UnsupportedModelError
from cw_lens.models.offload import resident_weights

# The mask and rotary buffers of a HookedTransformer are [n_ctx, n_ctx] / [n_ctx, d_head] per
# layer, so SmolLM2's 8192 positions would cost 2 GB of masks; TransformerLens caps many of its
# own Llama configs at 2048 the same way. Pass n_ctx=... for longer inputs.
DEFAULT_HOOKED_N_CTX = 2048
HOOKED_INSTALL = "pip install 'transformer-lens>=3.9,<4'"


def tl_version() -> str:
    return version("transformer-lens")


def hooked_transformer_class() -> type:
    """`transformer_lens.HookedTransformer`, or a clear error where it does not exist."""
    try:
        from transformer_lens import HookedTransformer
    except ImportError:
        raise UnsupportedModelError(
            f"HookedTransformer does not exist in TransformerLens {tl_version()} (4.0 removed "
            "it). Use the TransformerBridge, which runs every cw_lens analysis: "
            "cw_lens.load_model(api='bridge'); or, for HookedTransformer code, install "
            f"TransformerLens 3.x or 2.x in its own environment: {HOOKED_INSTALL}"
        ) from None
    return HookedTransformer


def bridge_class() -> type:
    """`TransformerBridge`, or a clear error in TransformerLens 2.x (which has none)."""
    try:
        from transformer_lens.model_bridge import TransformerBridge
    except ImportError:
        raise UnsupportedModelError(
            f"TransformerBridge needs TransformerLens 3.0 or newer; this environment has "
            f"{tl_version()}. Use a HookedTransformer instead: cw_lens.load_model(api='hooked'), "
            "or upgrade TransformerLens (pip install 'transformer-lens>=3.9')."
        ) from None
    return TransformerBridge


API_CHOICES = ("auto", "bridge", "hooked")


def resolve_api(api: str) -> str:
    """`"bridge"` or `"hooked"` for an `api` argument; `"auto"`: the bridge if it exists."""
    if api not in API_CHOICES:
        raise InputError(f"api must be one of {', '.join(API_CHOICES)}; got {api!r}.")
    if api != "auto":
        return api
    try:
        bridge_class()
    except UnsupportedModelError:
        return "hooked"
    return "bridge"


def is_hooked(model: Any) -> bool:
    """True for a `HookedTransformer` (False, without importing anything, in TL 4.x)."""
    try:
        from transformer_lens import HookedTransformer
    except ImportError:
        return False
    return isinstance(model, HookedTransformer)


def is_bridge(model: Any) -> bool:
    """True for a `TransformerBridge` (False in TransformerLens 2.x)."""
    try:
        from transformer_lens.model_bridge import TransformerBridge
    except ImportError:
        return False
    return isinstance(model, TransformerBridge)


def rope_theta(config: Any) -> float | None:
    """The rotary base the installed transformers uses for `config`.

    transformers 4.x reads the attribute `rope_theta` (and keeps an unknown `rope_parameters`
    key as an inert attribute); 5.x moves it into `rope_parameters` and has no attribute.
    """
    theta = getattr(config, "rope_theta", None)
    if theta is not None:
        return float(theta)
    params = getattr(config, "rope_parameters", None)
    if isinstance(params, dict) and params.get("rope_theta") is not None:
        return float(params["rope_theta"])
    return None


def _architecture(hf_config: Any) -> str:
    names = list(getattr(hf_config, "architectures", None) or [])
    model_type = getattr(hf_config, "model_type", "")
    if model_type == "llama" or "LlamaForCausalLM" in names:
        return "LlamaForCausalLM"
    if model_type == "gpt2" or "GPT2LMHeadModel" in names:
        return "GPT2LMHeadModel"
    raise UnsupportedModelError(
        f"cw_lens builds HookedTransformers offline for Llama and GPT-2 architectures only; got "
        f"model_type {model_type!r}. For other models use "
        "HookedTransformer.from_pretrained_no_processing(name) (needs the hub) or "
        "cw_lens.load_model(name) for a TransformerBridge."
    )


def hooked_config(
    hf_config: Any,
    *,
    name: str,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device | None = None,
    n_ctx: int | None = None,
) -> Any:
    """A `HookedTransformerConfig` equivalent to a Llama or GPT-2 Hugging Face config."""
    from transformer_lens import HookedTransformerConfig

    arch = _architecture(hf_config)
    common: dict[str, Any] = {
        "model_name": name,
        "original_architecture": arch,
        "dtype": dtype,
        "device": None if device is None else str(device),
        "init_weights": False,
        "default_prepend_bos": True,
    }
    if arch == "LlamaForCausalLM":
        n_heads = hf_config.num_attention_heads
        n_kv = getattr(hf_config, "num_key_value_heads", None) or n_heads
        d_head = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // n_heads
        theta = rope_theta(hf_config)
        if theta is None:
            raise UnsupportedModelError(f"The config of {name!r} has no rotary base (rope_theta).")
        scaling = (
            getattr(hf_config, "rope_parameters", None)
            or getattr(hf_config, "rope_scaling", None)
            or {}
        )
        if isinstance(scaling, dict) and scaling.get("rope_type", "default") != "default":
            raise UnsupportedModelError(
                f"{name!r} uses rope scaling {scaling.get('rope_type')!r}, which this offline "
                "HookedTransformer builder does not reproduce; use cw_lens.load_model(name) "
                "(TransformerBridge) instead."
            )
        return HookedTransformerConfig(
            **common,
            n_layers=hf_config.num_hidden_layers,
            d_model=hf_config.hidden_size,
            d_head=d_head,
            n_heads=n_heads,
            n_key_value_heads=n_kv if n_kv != n_heads else None,
            d_mlp=hf_config.intermediate_size,
            d_vocab=hf_config.vocab_size,
            n_ctx=n_ctx or min(hf_config.max_position_embeddings, DEFAULT_HOOKED_N_CTX),
            eps=hf_config.rms_norm_eps,
            act_fn=hf_config.hidden_act,
            normalization_type="RMS",
            final_rms=True,
            gated_mlp=True,
            positional_embedding_type="rotary",
            rotary_dim=d_head,
            rotary_base=theta,
            rotary_adjacent_pairs=False,
        )
    d_model = hf_config.n_embd
    return HookedTransformerConfig(
        **common,
        n_layers=hf_config.n_layer,
        d_model=d_model,
        d_head=d_model // hf_config.n_head,
        n_heads=hf_config.n_head,
        d_mlp=getattr(hf_config, "n_inner", None) or 4 * d_model,
        d_vocab=hf_config.vocab_size,
        n_ctx=n_ctx or hf_config.n_positions,
        eps=hf_config.layer_norm_epsilon,
        act_fn=hf_config.activation_function,
        normalization_type="LN",
        positional_embedding_type="standard",
        scale_attn_by_inverse_layer_idx=hf_config.scale_attn_by_inverse_layer_idx,
    )


def _state_dict(hf_model: Any, cfg: Any) -> dict[str, torch.Tensor]:
    from transformer_lens.pretrained.weight_conversions import (
        convert_gpt2_weights,
        convert_llama_weights,
    )

    if cfg.original_architecture == "LlamaForCausalLM":
        state = convert_llama_weights(hf_model, cfg)
    else:
        state = convert_gpt2_weights(hf_model, cfg)
        head = hf_model.get_output_embeddings()
        bias = getattr(head, "bias", None)
        state["unembed.b_U"] = (
            torch.zeros(cfg.d_vocab, dtype=cfg.dtype, device="cpu")
            if bias is None
            else bias.detach()
        )
    return state


def from_hf(
    hf_model: Any,
    tokenizer: Any,
    *,
    name: str,
    dtype: torch.dtype | None = None,
    device: str | torch.device | None = None,
    n_ctx: int | None = None,
) -> Any:
    """A `HookedTransformer` computing exactly what `hf_model` computes (raw weights).

    Args:
        hf_model: A `LlamaForCausalLM` or `GPT2LMHeadModel`.
        tokenizer: Its tokenizer (TransformerLens re-creates it with `add_bos_token=True`).
        name: `cfg.model_name`.
        dtype: Parameter dtype (default: the Hugging Face model's).
        device: Device of the weights (default: where TransformerLens puts them).
        n_ctx: Context length for the mask and rotary buffers (Llama default 2048).

    Returns:
        A `HookedTransformer` in eval mode. Every parameter comes from `hf_model`; a
        parameter the converter did not provide raises instead of staying uninitialised.
    """
    HookedTransformer = hooked_transformer_class()
    dtype = dtype or next(hf_model.parameters()).dtype
    cfg = hooked_config(hf_model.config, name=name, dtype=dtype, device=device, n_ctx=n_ctx)
    model = HookedTransformer(cfg, tokenizer=tokenizer, default_padding_side="right")
    # every weight at once (a HookedTransformer holds them all), brought in when offloaded
    with resident_weights(hf_model) as keep:
        state = {k: keep(v).to(dtype) for k, v in _state_dict(hf_model, cfg).items()}
    missing, unexpected = model.load_state_dict(state, strict=False)
    params = {n for n, _ in model.named_parameters()}
    missing_params = sorted(set(missing) & params)
    if missing_params or unexpected:
        raise UnsupportedModelError(
            f"Converting {name!r} to a HookedTransformer left parameters unset "
            f"{missing_params[:5]} or unused {sorted(unexpected)[:5]}; this TransformerLens "
            f"version ({tl_version()}) names them differently. Use cw_lens.load_model(name) "
            "(TransformerBridge) instead."
        )
    model.eval()
    return model
