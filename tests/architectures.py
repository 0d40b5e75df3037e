"""The architecture matrix: tiny random Hugging Face models of every decoder family we check.

Each :class:`Arch` says how to build a 2-layer, ``d_model`` 64 random model (eager attention,
``initializer_range`` 0.2, biases and norm parameters re-drawn so none is trivially 0 or 1,
byte vocabulary, seeded), where its attention lives in the HF module tree (for the independent
reference in ``hf_reference.py``), and what cw_lens must do with it: ``"exact"`` (every number
within 1e-5 of the HF reference) or ``"refused"`` (``UnsupportedModelError`` whose message
matches ``why``). ``"unbridged"`` marks models that TransformerLens itself cannot wrap; ``why``
then matches the error TransformerLens raises.

HF module paths: ``attn`` is the attention module of layer ``{}`` (its output carries the
attention probabilities), ``values`` the module (relative to ``attn``) whose output holds the
values, read with ``layout`` (see ``hf_reference.split_values``), ``out`` the output projection.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import torch

from cw_lens.models.testing import BYTE_VOCAB, VOCAB_SIZE

D_MODEL = 64
INIT_STD = 0.2
IDS = {"bos_token_id": BYTE_VOCAB, "eos_token_id": BYTE_VOCAB + 1, "pad_token_id": BYTE_VOCAB + 2}


@dataclass(frozen=True)
class Arch:
    name: str
    hf_class: str  # the transformers model class, also TransformerLens' architecture key
    config_class: str
    config: dict[str, Any]
    attn: str = "model.layers.{}.self_attn"
    values: str = "v_proj"
    out: str = "o_proj"
    layout: str = "heads"
    clip_qkv: float | None = None  # values are clamped to [-clip, clip] before attending
    status: str = "exact"  # "exact" | "refused" | "unbridged"
    why: str = ""  # regex of the expected error (refused / unbridged)
    notes: str = ""  # what the tiny config exercises, or why it is refused
    caveat: str = ""  # what a user must know when it is exact ("exact with notes")
    dtype: torch.dtype = torch.float64  # of the bridge (the reference always runs float64)


def _llama_like(**kw: Any) -> dict[str, Any]:
    base = {
        "hidden_size": D_MODEL,
        "intermediate_size": 2 * D_MODEL,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 128,
    }
    return {**base, **kw}


def _falcon(
    variant: str, layout: str, notes: str, status: str = "exact", why: str = "", **config: Any
) -> Arch:
    base = {"hidden_size": D_MODEL, "num_hidden_layers": 2, "num_attention_heads": 4, "bias": True}
    return Arch(
        f"Falcon ({variant})",
        "FalconForCausalLM",
        "FalconConfig",
        {**base, "parallel_attn": True, **config},
        attn="transformer.h.{}.self_attention",
        values="query_key_value",
        out="dense",
        layout=layout,
        status=status,
        why=why,
        notes=notes,
    )


_MPT = {"d_model": D_MODEL, "n_layers": 2, "n_heads": 4, "max_seq_len": 128, "expansion_ratio": 2}
_MPT_PATHS = {
    "attn": "transformer.blocks.{}.attn",
    "values": "Wqkv",
    "out": "out_proj",
    "layout": "qkv_concat",
}
_MOE = {"num_experts": 4, "num_experts_per_tok": 2}
_DEEPSEEK_MOE = {
    "n_routed_experts": 4,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 32,
    "first_k_dense_replace": 1,
    "n_group": 1,
    "topk_group": 1,
}
_MLA = {  # multi-head latent attention: low-rank q and kv, values of their own width
    "kv_lora_rank": 16,
    "q_lora_rank": 24,
    "qk_rope_head_dim": 8,
    "qk_nope_head_dim": 8,
    "v_head_dim": 12,
    "num_key_value_heads": 4,
}

_MLA_NOTE = (
    "multi-head latent attention: TransformerLens 4.3 reshapes hook_z with the query head size "
    "(8) although values are 12 wide, so hook_z is [batch, pos, 6, 8], not per head"
)

CLIPPED = "hook_v is the unclamped value projection; the model attends over clamped values"
_SLIDING = {"sliding_window": 6, "layer_types": ["sliding_attention", "full_attention"]}
POST_NORM = "inter weights are on the attention output before the post-attention norm"
MULTIPLIER = "inter weights are on the attention output before the residual multiplier"
PATTERN_LATE = (
    "TransformerLens fires hook_pattern after hook_z here: pattern-dependent interventions act on "
    "hook_z / the attention output"
)

ARCHS: list[Arch] = [
    Arch("Llama", "LlamaForCausalLM", "LlamaConfig", _llama_like(), notes="GQA 4/2"),
    Arch(
        "Mistral",
        "MistralForCausalLM",
        "MistralConfig",
        _llama_like(sliding_window=6),
        notes="sliding window 6 < sequence",
    ),
    Arch("Qwen2", "Qwen2ForCausalLM", "Qwen2Config", _llama_like(), notes="qkv biases"),
    Arch("Qwen3", "Qwen3ForCausalLM", "Qwen3Config", _llama_like(head_dim=16), notes="q/k norm"),
    Arch("Gemma", "GemmaForCausalLM", "GemmaConfig", _llama_like(head_dim=16)),
    Arch(
        "Gemma 2",
        "Gemma2ForCausalLM",
        "Gemma2Config",
        _llama_like(
            head_dim=16,
            sliding_window=6,
            query_pre_attn_scalar=16,
            attn_logit_softcapping=50.0,
            final_logit_softcapping=30.0,
        ),
        caveat=POST_NORM,
        notes="soft-capping; sliding window",
    ),
    Arch(
        "Gemma 3",
        "Gemma3ForCausalLM",
        "Gemma3TextConfig",
        _llama_like(
            head_dim=16,
            sliding_window=6,
            query_pre_attn_scalar=16,
            layer_types=["sliding_attention", "full_attention"],
        ),
        caveat=POST_NORM,
        notes="q/k norm; sliding window",
    ),
    Arch(
        "Mixtral",
        "MixtralForCausalLM",
        "MixtralConfig",
        _llama_like(num_local_experts=4, num_experts_per_tok=2),
        notes="MoE",
    ),
    Arch(
        "Qwen3-MoE",
        "Qwen3MoeForCausalLM",
        "Qwen3MoeConfig",
        _llama_like(head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32),
        notes="MoE",
    ),
    Arch(
        "Phi-3",
        "Phi3ForCausalLM",
        "Phi3Config",
        _llama_like(),
        values="qkv_proj",
        layout="qkv_concat",
        notes="fused qkv",
    ),
    Arch(
        "Phi",
        "PhiForCausalLM",
        "PhiConfig",
        _llama_like(num_key_value_heads=4, partial_rotary_factor=0.5),
        out="dense",
        notes="parallel attention/MLP, partial rotary",
    ),
    Arch(
        "StableLM",
        "StableLmForCausalLM",
        "StableLmConfig",
        _llama_like(use_qkv_bias=True, partial_rotary_factor=0.25),
    ),
    Arch("OLMo", "OlmoForCausalLM", "OlmoConfig", _llama_like(attention_bias=True)),
    Arch(
        "OLMo (clip_qkv)",
        "OlmoForCausalLM",
        "OlmoConfig",
        _llama_like(clip_qkv=0.3),
        clip_qkv=0.3,
        status="refused",
        why=r"(?i)olmo",
        notes=CLIPPED,
    ),
    Arch("OLMo 2", "Olmo2ForCausalLM", "Olmo2Config", _llama_like(), caveat=POST_NORM),
    Arch(
        "OLMo 3",
        "Olmo3ForCausalLM",
        "Olmo3Config",
        _llama_like(**_SLIDING),
        caveat=POST_NORM,
        notes="sliding window",
    ),
    Arch(
        "SmolLM3",
        "SmolLM3ForCausalLM",
        "SmolLM3Config",
        _llama_like(no_rope_layer_interval=2),
        notes="NoPE every other layer",
    ),
    Arch(
        "Nemotron",
        "NemotronForCausalLM",
        "NemotronConfig",
        _llama_like(head_dim=16, partial_rotary_factor=0.5),
    ),
    Arch(
        "GPT-OSS",
        "GptOssForCausalLM",
        "GptOssConfig",
        _llama_like(
            head_dim=16,
            num_local_experts=4,
            num_experts_per_tok=2,
            sliding_window=6,
            layer_types=["sliding_attention", "full_attention"],
            attention_bias=True,
        ),
        caveat="learned sink logits: attention rows sum to less than 1 (intra rows still sum to 1)",
        notes="MoE; sliding window",
    ),
    Arch(
        "GPT-NeoX",
        "GPTNeoXForCausalLM",
        "GPTNeoXConfig",
        {
            "hidden_size": D_MODEL,
            "intermediate_size": 2 * D_MODEL,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "max_position_embeddings": 128,
            "rotary_pct": 0.25,
            "attention_bias": True,
        },
        attn="gpt_neox.layers.{}.attention",
        values="query_key_value",
        out="dense",
        layout="interleave",
        notes="fused qkv interleaved per head; parallel residual",
    ),
    Arch(
        "GPT-2",
        "GPT2LMHeadModel",
        "GPT2Config",
        {"n_embd": D_MODEL, "n_layer": 2, "n_head": 4, "n_positions": 128},
        attn="transformer.h.{}.attn",
        values="c_attn",
        out="c_proj",
        layout="qkv_concat",
    ),
    _falcon("MQA", "falcon_mqa", "multi-query, rotary, parallel attention/MLP", multi_query=True),
    _falcon("MHA", "interleave", "multi-head, rotary, qkv interleaved per head", multi_query=False),
    _falcon(
        "alibi",
        "falcon_mqa",
        "multi-query, ALiBi, sequential attention/MLP",
        multi_query=True,
        alibi=True,
        parallel_attn=False,
    ),
    _falcon(
        "new decoder, 1 kv head",
        "falcon_new",
        "new decoder architecture (two layer norms), one kv group",
        new_decoder_architecture=True,
        num_kv_heads=1,
    ),
    _falcon(
        "new decoder, GQA",
        "falcon_new",
        "the Falcon-40B/180B layout; TransformerLens 4.3 cannot build the bridge",
        status="unbridged",
        why=r"split_with_sizes",
        new_decoder_architecture=True,
        num_kv_heads=2,
        multi_query=True,
    ),
    _falcon(
        "new decoder, GQA, multi_query=False",
        "falcon_new",
        "TransformerLens 4.3 builds it, but its logits differ from the HF model's",
        status="refused",
        why=r"(?i)falcon",
        new_decoder_architecture=True,
        num_kv_heads=2,
        multi_query=False,
    ),
    Arch(
        "Bloom",
        "BloomForCausalLM",
        "BloomConfig",
        {"hidden_size": D_MODEL, "n_layer": 2, "n_head": 4},
        attn="transformer.h.{}.self_attention",
        values="query_key_value",
        out="dense",
        layout="interleave",
        notes="ALiBi; fused qkv interleaved per head",
    ),
    Arch(
        "GPTBigCode",
        "GPTBigCodeForCausalLM",
        "GPTBigCodeConfig",
        {"n_embd": D_MODEL, "n_layer": 2, "n_head": 4, "n_positions": 128, "multi_query": True},
        attn="transformer.h.{}.attn",
        values="c_attn",
        out="c_proj",
        layout="qkv_concat",
        notes="multi-query",
    ),
    Arch("MPT", "MptForCausalLM", "MptConfig", _MPT, **_MPT_PATHS, notes="ALiBi; no biases"),
    Arch(
        "MPT (clip_qkv)",
        "MptForCausalLM",
        "MptConfig",
        {**_MPT, "attn_config": {"clip_qkv": 0.3}},
        **_MPT_PATHS,
        clip_qkv=0.3,
        status="refused",
        why=r"(?i)mpt",
        notes=CLIPPED,
    ),
    Arch("Cohere", "CohereForCausalLM", "CohereConfig", _llama_like(), notes="parallel block"),
    Arch(
        "Cohere2",
        "Cohere2ForCausalLM",
        "Cohere2Config",
        _llama_like(**_SLIDING),
        notes="sliding window",
    ),
    Arch(
        "Starcoder2",
        "Starcoder2ForCausalLM",
        "Starcoder2Config",
        _llama_like(sliding_window=6, use_bias=True),
        out="o_proj",
        notes="biases; sliding window",
    ),
    Arch(
        "OpenAI-GPT",
        "OpenAIGPTLMHeadModel",
        "OpenAIGPTConfig",
        {"n_embd": D_MODEL, "n_layer": 2, "n_head": 4, "n_positions": 128},
        attn="transformer.h.{}.attn",
        values="c_attn",
        out="c_proj",
        layout="qkv_concat",
        caveat="post-norm block: inter weights are on the attention output before ln_1",
    ),
    Arch(
        "GPT-J",
        "GPTJForCausalLM",
        "GPTJConfig",
        {"n_embd": D_MODEL, "n_layer": 2, "n_head": 4, "n_positions": 128, "rotary_dim": 8},
        attn="transformer.h.{}.attn",
        out="out_proj",
        caveat=PATTERN_LATE,
    ),
    Arch(
        "GPT-Neo",
        "GPTNeoForCausalLM",
        "GPTNeoConfig",
        {
            "hidden_size": D_MODEL,
            "num_layers": 2,
            "num_heads": 4,
            "max_position_embeddings": 128,
            "attention_types": [[["global", "local"], 1]],
            "window_size": 6,
        },
        attn="transformer.h.{}.attn.attention",
        out="out_proj",
        caveat=PATTERN_LATE,
        notes="local attention window 6",
    ),
    Arch(
        "OPT",
        "OPTForCausalLM",
        "OPTConfig",
        {
            "hidden_size": D_MODEL,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "ffn_dim": 2 * D_MODEL,
            "word_embed_proj_dim": D_MODEL,
            "max_position_embeddings": 128,
            "init_std": INIT_STD,
        },
        attn="model.decoder.layers.{}.self_attn",
        out="out_proj",
        caveat=PATTERN_LATE,
    ),
    Arch(
        "XGLM",
        "XGLMForCausalLM",
        "XGLMConfig",
        {
            "d_model": D_MODEL,
            "num_layers": 2,
            "attention_heads": 4,
            "ffn_dim": 2 * D_MODEL,
            "max_position_embeddings": 320,  # positions are offset by the pad id (258)
            "init_std": INIT_STD,
        },
        out="out_proj",
        dtype=torch.float32,
        caveat=PATTERN_LATE,
        notes="float32 bridge (HF XGLM cannot run in float64)",
    ),
    Arch(
        "EXAONE 4",
        "Exaone4ForCausalLM",
        "Exaone4Config",
        _llama_like(**_SLIDING),
        caveat=POST_NORM,
        notes="q/k norm",
    ),
    Arch(
        "GLM-4",
        "Glm4ForCausalLM",
        "Glm4Config",
        _llama_like(head_dim=16, attention_bias=True),
        caveat=POST_NORM,
    ),
    Arch(
        "Granite",
        "GraniteForCausalLM",
        "GraniteConfig",
        _llama_like(
            attention_multiplier=0.3,
            residual_multiplier=0.7,
            embedding_multiplier=2.0,
            logits_scaling=4.0,
        ),
        caveat=MULTIPLIER,
    ),
    Arch(
        "Qwen2-MoE",
        "Qwen2MoeForCausalLM",
        "Qwen2MoeConfig",
        _llama_like(**_MOE, moe_intermediate_size=32, shared_expert_intermediate_size=32),
        notes="MoE with a shared expert",
    ),
    Arch("OLMoE", "OlmoeForCausalLM", "OlmoeConfig", _llama_like(**_MOE), notes="MoE; q/k norm"),
    Arch(
        "GraniteMoE",
        "GraniteMoeForCausalLM",
        "GraniteMoeConfig",
        _llama_like(
            num_local_experts=4,
            num_experts_per_tok=2,
            attention_multiplier=0.3,
            residual_multiplier=0.7,
            embedding_multiplier=2.0,
        ),
        caveat=MULTIPLIER,
        notes="MoE",
    ),
    Arch("Ernie 4.5", "Ernie4_5ForCausalLM", "Ernie4_5Config", _llama_like(head_dim=16)),
    Arch(
        "Ernie 4.5 MoE",
        "Ernie4_5_MoeForCausalLM",
        "Ernie4_5_MoeConfig",
        _llama_like(head_dim=16, moe_num_experts=4, moe_k=2, moe_intermediate_size=32),
        notes="MoE",
    ),
    Arch("Apertus", "ApertusForCausalLM", "ApertusConfig", _llama_like(), notes="q/k norm"),
    Arch("Arcee", "ArceeForCausalLM", "ArceeConfig", _llama_like()),
    Arch("Seed-OSS", "SeedOssForCausalLM", "SeedOssConfig", _llama_like(head_dim=16)),
    Arch("GLM", "GlmForCausalLM", "GlmConfig", _llama_like(head_dim=16), notes="partial rotary"),
    Arch(
        "GLM-4 MoE",
        "Glm4MoeForCausalLM",
        "Glm4MoeConfig",
        _llama_like(head_dim=16, **_DEEPSEEK_MOE),
        notes="MoE after a dense first layer",
    ),
    Arch(
        "HunYuan dense",
        "HunYuanDenseV1ForCausalLM",
        "HunYuanDenseV1Config",
        _llama_like(head_dim=16),
        notes="q/k norm",
    ),
    Arch(
        "VaultGemma",
        "VaultGemmaForCausalLM",
        "VaultGemmaConfig",
        _llama_like(head_dim=16, sliding_window=6),
    ),
    Arch("Ministral 3", "Ministral3ForCausalLM", "Ministral3Config", _llama_like(head_dim=16)),
    Arch("Jais 2", "Jais2ForCausalLM", "Jais2Config", _llama_like()),
    Arch(
        "FlexOlmo",
        "FlexOlmoForCausalLM",
        "FlexOlmoConfig",
        _llama_like(**_MOE),
        caveat=POST_NORM,
        notes="MoE",
    ),
    Arch(
        "DeepSeek-V2",
        "DeepseekV2ForCausalLM",
        "DeepseekV2Config",
        _llama_like(**_MLA, **_DEEPSEEK_MOE),
        values="kv_b_proj",
        layout="mla",
        status="refused",
        why=r"(?i)deepseek",
        notes=_MLA_NOTE,
    ),
    Arch(
        "DeepSeek-V3",
        "DeepseekV3ForCausalLM",
        "DeepseekV3Config",
        _llama_like(**_MLA, **_DEEPSEEK_MOE),
        values="kv_b_proj",
        layout="mla",
        status="refused",
        why=r"(?i)deepseek",
        notes=_MLA_NOTE,
    ),
    Arch(
        "CodeGen",
        "CodeGenForCausalLM",
        "CodeGenConfig",
        {"n_embd": D_MODEL, "n_layer": 2, "n_head": 4, "n_positions": 128, "rotary_dim": 8},
        attn="transformer.h.{}.attn",
        values="qkv_proj",
        out="out_proj",
        layout="codegen",
        status="refused",
        why=r"(?i)codegen",
        notes="TransformerLens 4.3's CodeGen bridge fails in the forward pass",
    ),
]

BY_NAME = {a.name: a for a in ARCHS}


@dataclass
class Built:
    """One architecture: the bridge, its pristine float64 HF twin, or the bridging error."""

    arch: Arch
    hf: Any  # float64 copy of the HF model taken before wrapping (the reference runs it)
    bridge: Any = None  # the TransformerBridge, in arch.dtype
    error: BaseException | None = None


def hf_model(arch: Arch, seed: int = 0, dtype: torch.dtype = torch.float64) -> Any:
    """The random HF model (eval) of ``arch``."""
    import transformers

    config_cls = getattr(transformers, arch.config_class)
    kwargs = {
        "vocab_size": VOCAB_SIZE,
        "initializer_range": INIT_STD,
        "tie_word_embeddings": False,
        **IDS,
        **arch.config,
    }
    config = config_cls(**kwargs)
    config._attn_implementation = "eager"
    config._experts_implementation = "eager"  # grouped_mm has no float64 kernel
    torch.manual_seed(seed)
    model = getattr(transformers, arch.hf_class)(config)
    _redraw(model, seed)
    return model.to(dtype).eval()


def _redraw(model: Any, seed: int) -> None:
    """Non-zero biases and non-trivial norm parameters (transformers initialises them to 0/1)."""
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for module in model.modules():
            is_norm = "norm" in type(module).__name__.lower()
            for name, p in module.named_parameters(recurse=False):
                if name == "bias":
                    std = 0.1 if is_norm else INIT_STD
                    p.copy_(torch.randn(p.shape, generator=gen) * std)
                elif is_norm and name == "weight":
                    p.add_(torch.randn(p.shape, generator=gen) * 0.1)


def build(arch: Arch, seed: int = 0) -> Built:
    """Build ``arch``'s HF model, keep a float64 twin, wrap the original as a bridge.

    The bridge runs in ``arch.dtype``, float64 unless the HF model cannot: its activations then
    equal the reference's to ~1e-15 and what is measured is cw_lens itself (which computes in
    float32). A float32 bridge adds the model's own float32 drift (~1e-6).
    """
    from cw_lens.models.testing import _wrap

    model = hf_model(arch, seed, arch.dtype)
    twin = copy.deepcopy(model).double()  # before wrapping: the bridge edits the model in place
    try:
        bridge = _wrap(model, arch.hf_class, f"tiny-{arch.name}", "bridge")
    except Exception as err:
        return Built(arch, twin, error=err)
    return Built(arch, twin, bridge=bridge)
