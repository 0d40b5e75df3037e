"""Tiny random models for fast, offline tests (ours and yours).

Two architectures cover what the analyses must handle:

- `tiny_llama` — Llama with grouped-query attention (4 query heads reading 2 key/value
  heads), RMSNorm, rotary positions, no biases;
- `tiny_gpt2` — GPT-2 with biases (so `b_O` is non-zero and `hook_v` carries the value
  bias) and LayerNorm.

Both are random-initialised `transformers` models, wrapped as a `TransformerBridge`
(`api="bridge"`, via `transformer_lens.model_bridge.sources.build_bridge_from_module`) or
converted to a `HookedTransformer` with raw weights (`api="hooked"`, via
`cw_lens.models.hooked.from_hf`); the same seed gives the same weights in both. They come
with a
byte-level tokenizer (256 byte tokens + BOS/EOS/PAD) built with `tokenizers`, so string inputs
work without any download. `api="auto"` picks the bridge where TransformerLens has one (3.x,
4.x) and a HookedTransformer in 2.x.

Example:

    from cw_lens.models.testing import tiny_llama
    model = tiny_llama(seed=0)                  # TransformerBridge
    hooked = tiny_llama(seed=0, api="hooked")   # HookedTransformer, same weights
    cw = cw_lens.contribution_weights(model, "hello world")
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any

import torch

from cw_lens.models.hooked import bridge_class, from_hf, resolve_api

BYTE_VOCAB = 256
BOS, EOS, PAD = "<|bos|>", "<|eos|>", "<|pad|>"
VOCAB_SIZE = BYTE_VOCAB + 3


@lru_cache(maxsize=1)
def byte_tokenizer() -> Any:
    """A byte-level `PreTrainedTokenizerFast` (ids 0-255 are bytes, then BOS, EOS, PAD)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    byte_to_unicode = sorted(alphabet, key=lambda ch: _byte_of(ch))
    vocab = {ch: i for i, ch in enumerate(byte_to_unicode)}
    vocab.update({BOS: BYTE_VOCAB, EOS: BYTE_VOCAB + 1, PAD: BYTE_VOCAB + 2})
    core = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = decoders.ByteLevel()
    # Prepend BOS like Llama tokenizers do; TransformerLens then detects tokenizer_prepends_bos.
    core.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A $B", special_tokens=[(BOS, BYTE_VOCAB)]
    )
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        padding_side="right",
        add_bos_token=True,
        name_or_path="cw_lens-byte-tokenizer",
    )
    return tok


def _byte_of(ch: str) -> int:
    """Inverse of GPT-2's bytes_to_unicode map for one character."""
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    code = ord(ch)
    if code in printable:
        return code
    others = [b for b in range(256) if b not in printable]
    return others[code - 256]


def _wrap(hf_model: Any, architecture: str, name: str, api: str = "bridge") -> Any:
    hf_model.eval()
    if resolve_api(api) == "hooked":
        return from_hf(hf_model, byte_tokenizer(), name=name)
    bridge_class()
    from transformer_lens.model_bridge.sources import build_bridge_from_module

    bridge = build_bridge_from_module(
        hf_model,
        architecture,
        hf_config=hf_model.config,
        tokenizer=byte_tokenizer(),
        model_name=name,
    )
    bridge.eval()
    return bridge


def tiny_llama(*, api: str = "auto", **kwargs: Any) -> Any:
    """A random Llama with grouped-query attention, RMSNorm and rotary positions.

    Args:
        api: `"bridge"`, `"hooked"` or `"auto"` (see the module docstring).
        **kwargs: As for `tiny_llama_hf` (`seed`, `n_layers`, `n_heads`,
            `n_kv_heads`, `d_model`, `n_ctx`, `init_std`, `dtype`).
    """
    return _wrap(tiny_llama_hf(**kwargs), "LlamaForCausalLM", "tiny-llama-gqa", api)


def tiny_gpt2(*, api: str = "auto", **kwargs: Any) -> Any:
    """A random GPT-2 with non-zero biases, LayerNorm and learned positions.

    Args:
        api: `"bridge"`, `"hooked"` or `"auto"` (see the module docstring).
        **kwargs: As for `tiny_gpt2_hf` (`seed`, `n_layers`, `n_heads`,
            `d_model`, `n_ctx`, `init_std`, `dtype`).
    """
    return _wrap(tiny_gpt2_hf(**kwargs), "GPT2LMHeadModel", "tiny-gpt2", api)


def tiny_llama_hf(
    *,
    seed: int = 0,
    n_layers: int = 2,
    n_heads: int = 4,
    n_kv_heads: int = 2,
    d_model: int = 64,
    n_ctx: int = 256,
    init_std: float = 0.2,
    dtype: torch.dtype = torch.float32,
) -> Any:
    """The `transformers` `LlamaForCausalLM` behind `tiny_llama` (4 query / 2 KV heads).

    `init_std` is larger than transformers' 0.02 so that attention is far from uniform and
    head outputs are far from zero: random tests then exercise real cancellations.
    """
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=d_model,
        intermediate_size=2 * d_model,
        num_hidden_layers=n_layers,
        num_attention_heads=n_heads,
        num_key_value_heads=n_kv_heads,
        max_position_embeddings=n_ctx,
        initializer_range=init_std,
        bos_token_id=BYTE_VOCAB,
        eos_token_id=BYTE_VOCAB + 1,
        pad_token_id=BYTE_VOCAB + 2,
        attn_implementation="eager",
        tie_word_embeddings=False,
    )
    return LlamaForCausalLM(config).to(dtype).eval()


def tiny_gpt2_hf(
    *,
    seed: int = 0,
    n_layers: int = 2,
    n_heads: int = 4,
    d_model: int = 64,
    n_ctx: int = 256,
    init_std: float = 0.2,
    dtype: torch.dtype = torch.float32,
) -> Any:
    """The `transformers` `GPT2LMHeadModel` behind `tiny_gpt2`.

    Biases are re-drawn non-zero (transformers initialises them to zero) so that `b_O` and the
    value bias really take part in the tests.
    """
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    config = GPT2Config(
        vocab_size=VOCAB_SIZE,
        n_embd=d_model,
        n_layer=n_layers,
        n_head=n_heads,
        n_positions=n_ctx,
        initializer_range=init_std,
        bos_token_id=BYTE_VOCAB,
        eos_token_id=BYTE_VOCAB + 1,
        pad_token_id=BYTE_VOCAB + 2,
        attn_implementation="eager",
    )
    model = GPT2LMHeadModel(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(".bias") and "ln" not in name:
                param.normal_(0.0, init_std)
    return model.to(dtype).eval()


def random_tokens(model: Any, batch: int, seq: int, *, seed: int = 0) -> torch.Tensor:
    """Random byte tokens with BOS at position 0, `[batch, seq]`."""
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, BYTE_VOCAB, (batch, seq), generator=gen, device="cpu")
    tokens[:, 0] = BYTE_VOCAB
    from cw_lens.models.access import model_device

    return tokens.to(model_device(model))
