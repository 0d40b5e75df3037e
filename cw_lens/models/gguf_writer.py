"""Write a Hugging Face decoder model to a GGUF file, quantised per tensor (tests, benchmarks).

cw_lens reads GGUF files that others wrote; this module writes small and 7B-width random ones so
that the layer-streamed loader ([cw_lens.models.gguf_stream][]) can be tested and measured
without downloading weights. It uses the `gguf` package's `GGUFWriter` and quantisers, and the
same tensor-name map that `transformers` reads GGUF files with (inverted), so a file written here
loads in `transformers` and in llama.cpp's naming.

Supported architectures: `llama` (also Mistral-style configs), `qwen2` and `gemma2`. Each
tensor's type is chosen by `tensor_types`, a function of the GGUF tensor name and shape; `gguf`
can quantise to `F32`, `F16`, `BF16`, `Q8_0`, `Q4_0`, `Q4_1`, `Q5_0` and `Q5_1`. It cannot
quantise to the K-quants, so `Q4_K` and `Q6_K` tensors are written from random but valid blocks
(`random_k_quant`): their values are whatever those blocks de-quantise to, which is what a
reader must reproduce.

Examples:
    >>> from cw_lens.models.gguf_writer import tiny_config, random_hf_model, write_gguf
    >>> import tempfile, pathlib
    >>> hf = random_hf_model(tiny_config("qwen2"), seed=0)
    >>> path = write_gguf(hf, pathlib.Path(tempfile.mkdtemp()) / "tiny.gguf")
    >>> path.suffix
    '.gguf'
"""

from __future__ import annotations

from collections.abc import Callable
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np
import torch

# vocabulary of the test files: 256 byte tokens (GPT-2 byte-to-unicode), a few merges, 3 specials
SPECIALS = ("<|bos|>", "<|eos|>", "<|pad|>")
MERGES = ("Ġ t", "h e", "i n", "Ġt he", "e r", "a n")


@lru_cache(maxsize=4)
def byte_bpe_vocabulary(size: int | None = None) -> tuple[list[str], list[int], list[str]]:
    """Tokens, token types and merges of a tiny GPT-2-style BPE vocabulary.

    Args:
        size: Pad the vocabulary with unused tokens to this many (a 7B model's 152,064), the
            specials staying last.

    Returns:
        The token strings (256 bytes, the merged tokens, then BOS, EOS and PAD), their GGUF token
        types (normal, or control for the three specials) and the merges.
    """
    from gguf import TokenType
    from tokenizers import pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    merged = ["".join(m.split(" ")) for m in MERGES]
    unused = max(0, (size or 0) - len(alphabet) - len(merged) - len(SPECIALS))
    tokens = [*alphabet, *merged, *(f"<unused{i}>" for i in range(unused)), *SPECIALS]
    types = (
        [int(TokenType.NORMAL)] * (len(alphabet) + len(merged))
        + [int(TokenType.UNUSED)] * unused
        + [int(TokenType.CONTROL)] * len(SPECIALS)
    )
    return tokens, types, list(MERGES)


def tiny_config(architecture: str, **overrides: Any) -> Any:
    """A small random-init config of `architecture` whose vocabulary is the test files' one.

    Args:
        architecture: `"llama"`, `"mistral"`, `"qwen2"` or `"gemma2"`.
        **overrides: Config fields to change (`hidden_size=256`, `num_hidden_layers=4`, ...).

    Returns:
        A `transformers` config with eager attention, `initializer_range` 0.2 (attention that
        is far from uniform) and biases where the architecture has them (Qwen2's q/k/v).
    """
    from transformers import AutoConfig

    tokens, _, _ = byte_bpe_vocabulary(overrides.get("vocab_size"))
    base = {
        "vocab_size": len(tokens),
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 256,
        "initializer_range": 0.2,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "bos_token_id": len(tokens) - 3,
        "eos_token_id": len(tokens) - 2,
        "pad_token_id": len(tokens) - 1,
        "tie_word_embeddings": False,
        "attn_implementation": "eager",
    }
    if architecture == "gemma2":
        # a Gemma 2 GGUF carries neither the query scale (transformers assumes 256) nor an
        # untied head (Gemma ties it)
        base.update(
            head_dim=16, sliding_window=64, query_pre_attn_scalar=256, tie_word_embeddings=True
        )
    model_type = "llama" if architecture == "mistral" else architecture
    base.update(overrides)
    config = AutoConfig.for_model(model_type, **base)
    config._attn_implementation = "eager"
    return config


def random_hf_model(config: Any, *, seed: int = 0) -> Any:
    """A `transformers` causal LM of `config` with random weights, norms and biases included.

    Args:
        config: The model's config (see `tiny_config`).
        seed: Seed of the weights.

    Returns:
        The model in eval mode, float32; norm weights are drawn around 1 and biases around 0
        so that no weight is a constant a wrong reader could get right by accident.
    """
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("bias"):
                param.copy_(0.1 * torch.randn(param.shape, generator=generator))
            elif "norm" in name:
                centre = 0.0 if config.model_type.startswith("gemma") else 1.0
                param.copy_(centre + 0.2 * torch.randn(param.shape, generator=generator))
    return model.eval()


def default_tensor_types(name: str, shape: tuple[int, ...]) -> str:
    """llama.cpp's habit: 1-D tensors in F32, the embedding in Q8_0, the rest in Q4_1.

    Args:
        name: The GGUF tensor name (`blk.0.attn_q.weight`).
        shape: Its shape, rows first.

    Returns:
        The GGUF type name for the tensor.
    """
    if len(shape) == 1:
        return "F32"
    return "Q8_0" if name.startswith("token_embd") else "Q4_1"


def write_gguf(
    hf_model: Any,
    path: Path | str,
    *,
    tensor_types: Callable[[str, tuple[int, ...]], str] = default_tensor_types,
    name: str = "cw-lens-test",
    seed: int = 0,
    values: Callable[[str, tuple[int, ...]], np.ndarray] | None = None,
) -> Path:
    """Write `hf_model` and the test vocabulary to a GGUF file at `path`.

    Args:
        hf_model: A `transformers` causal LM of a supported architecture.
        path: Where to write the `.gguf` file.
        tensor_types: Maps (GGUF tensor name, shape) to a GGUF type name (`"Q8_0"`, `"Q4_K"`...).
        name: The file's `general.name`.
        seed: Seed of the random K-quant blocks.
        values: Gives each tensor's float32 values from its Hugging Face name and shape, in
            place of the model's own (so a 7B-width model can stay on the meta device and be
            written one tensor at a time).

    Returns:
        The path written.
    """
    # Long: the file's metadata, tokenizer and tensors in the order GGUFWriter requires (header,
    # key-values, tensor infos, data), each tensor inverted from transformers' GGUF name map.
    import gguf
    from transformers.modeling_gguf_pytorch_utils import (
        TENSOR_PROCESSORS,
        TensorProcessor,
        get_gguf_hf_weights_map,
    )

    config = hf_model.config
    arch = "gemma2" if config.model_type == "gemma2" else config.model_type
    if arch not in ("llama", "qwen2", "gemma2"):
        raise ValueError(f"write_gguf writes llama, qwen2 and gemma2 models, not {arch!r}.")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name(name)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    theta = getattr(config, "rope_theta", None)
    if theta is None:
        theta = (getattr(config, "rope_parameters", None) or {}).get("rope_theta", 10000.0)
    writer.add_rope_freq_base(float(theta))
    if arch == "gemma2":
        writer.add_key_length(config.head_dim)
        writer.add_value_length(config.head_dim)
        writer.add_sliding_window(config.sliding_window)
        writer.add_attn_logit_softcapping(float(config.attn_logit_softcapping))
        writer.add_final_logit_softcapping(float(config.final_logit_softcapping))
    tokens, types, merges = byte_bpe_vocabulary(config.vocab_size)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    writer.add_bos_token_id(config.bos_token_id)
    writer.add_eos_token_id(config.eos_token_id)
    writer.add_pad_token_id(config.pad_token_id)

    processor = TENSOR_PROCESSORS.get(arch, TensorProcessor)(config=config.to_dict())
    to_gguf = {hf: g for g, hf in get_gguf_hf_weights_map(hf_model, processor).items()}
    rng = np.random.default_rng(seed)
    # the tensor infos first, then each tensor's data made, quantised and written in turn, so
    # that at most one tensor is in memory (a 7B-width file holds GBs of quantised data)
    planned: list[tuple[str, str, Any, str]] = []
    written = set()
    file_type = gguf.LlamaFileType.ALL_F32
    for hf_name, tensor in hf_model.state_dict().items():
        if hf_name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        gguf_name = to_gguf.get(hf_name)
        if gguf_name is None or gguf_name in written:
            continue
        written.add(gguf_name)
        shape = tuple(tensor.shape)
        kind = tensor_types(gguf_name, shape)
        qtype = gguf.GGMLQuantizationType[kind]
        if len(shape) > 1:  # the header's file type: the type of the matrices
            file_type = getattr(gguf.LlamaFileType, f"MOSTLY_{kind}", file_type)
        if kind in ("F32", "F16"):
            dtype = np.float32 if kind == "F32" else np.float16
            n_bytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
            writer.add_tensor_info(gguf_name, shape, np.dtype(dtype), n_bytes)
        else:
            byte_shape = gguf.quant_shape_to_byte_shape(shape, qtype)
            n_bytes = int(np.prod(byte_shape))
            writer.add_tensor_info(gguf_name, byte_shape, np.dtype(np.uint8), n_bytes, qtype)
        planned.append((hf_name, gguf_name, tensor, kind))
    writer.add_file_type(file_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for hf_name, gguf_name, tensor, kind in planned:
        if values is not None:
            data = np.ascontiguousarray(values(hf_name, tuple(tensor.shape)), dtype=np.float32)
        else:
            data = tensor.detach().float().numpy().copy()
        if arch == "llama" and (".attn_q." in gguf_name or ".attn_k." in gguf_name):
            heads = (
                config.num_attention_heads
                if ".attn_q." in gguf_name
                else config.num_key_value_heads
            )
            data = _permute_rotary(data, heads)
        if arch == "gemma2" and gguf_name.endswith("norm.weight"):
            data = data + 1  # the file stores the RMSNorm scale; transformers subtracts 1
        qtype = gguf.GGMLQuantizationType[kind]
        if kind == "F32":
            writer.write_tensor_data(data.astype(np.float32))
        elif kind == "F16":
            writer.write_tensor_data(data.astype(np.float16))
        elif kind.endswith("_K"):
            writer.write_tensor_data(random_k_quant(data.shape, qtype, rng))
        else:
            writer.write_tensor_data(_quantised(data, qtype))
        del data
    writer.close()
    return path


def _quantised(data: np.ndarray, qtype: Any) -> np.ndarray:
    """`gguf.quants.quantize(data, qtype)`, a block of rows at a time: the blocks run along each
    row, so the bytes are the same, and the temporaries of `gguf`'s numpy kernels stay at the
    size of one block of rows (64 MB of float32) whatever the tensor's."""
    import gguf

    rows = max(1, (16 << 20) // max(1, int(np.prod(data.shape[1:]))))
    if data.ndim < 2 or data.shape[0] <= rows:
        return gguf.quants.quantize(data, qtype)
    out = np.empty(gguf.quant_shape_to_byte_shape(data.shape, qtype), dtype=np.uint8)
    for start in range(0, data.shape[0], rows):
        out[start : start + rows] = gguf.quants.quantize(data[start : start + rows], qtype)
    return out


def _permute_rotary(weights: np.ndarray, n_head: int) -> np.ndarray:
    # llama.cpp's convert_hf_to_gguf permute, which transformers' LlamaTensorProcessor reverses
    rows = weights.shape[0]
    return (
        weights.reshape(n_head, 2, rows // n_head // 2, *weights.shape[1:])
        .swapaxes(1, 2)
        .reshape(weights.shape)
    )


def random_k_quant(shape: tuple[int, ...], qtype: Any, rng: np.random.Generator) -> np.ndarray:
    """Random valid blocks of a K-quant type for a tensor of `shape` (rows first).

    The super-block scales are set to small finite half floats; the quantised values and the
    sub-block scales are random bytes.

    Args:
        shape: The logical tensor shape; its last dimension must be a multiple of 256.
        qtype: `gguf.GGMLQuantizationType.Q4_K` or `Q6_K`.
        rng: Random generator.

    Returns:
        The raw `uint8` blocks, shaped as `gguf` expects for `add_tensor(..., raw_dtype=qtype)`.
    """
    import gguf

    block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
    if shape[-1] % block_size:
        raise ValueError(f"{qtype.name} needs rows of a multiple of {block_size}; got {shape}.")
    n_blocks = int(np.prod(shape)) // block_size
    blocks = rng.integers(0, 256, size=(n_blocks, type_size), dtype=np.uint8)
    scale = np.full(n_blocks, 2e-3, dtype=np.float16).view(np.uint8).reshape(n_blocks, 2)
    if qtype == gguf.GGMLQuantizationType.Q4_K:  # d, dmin, scales[12], qs[128]
        blocks[:, 0:2] = scale
        blocks[:, 2:4] = scale
    elif qtype == gguf.GGMLQuantizationType.Q6_K:  # ql[128], qh[64], scales[16] (int8), d
        blocks[:, -2:] = scale
    else:
        raise ValueError(f"random_k_quant writes Q4_K and Q6_K, not {qtype.name}.")
    return blocks.reshape(*shape[:-1], shape[-1] // block_size * type_size)
