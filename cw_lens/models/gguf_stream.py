"""Layer-streamed GGUF models: one decoder layer de-quantised in memory at a time.

A 7B GGUF file de-quantised whole to float32 takes about 30 GB; `transformers` does exactly that
before anything runs, and refuses disk offload for GGUF files. cw_lens instead keeps the file
memory-mapped and de-quantises each decoder layer's weights to float32 when that layer's forward
starts:

- the model skeleton is built on the `meta` device from the GGUF header's config;
- embeddings, the final norm and (by default) the output head are de-quantised once and stay
  resident;
- every module of a decoder layer gets an `accelerate` `AlignDevicesHook` (offloaded, as
  `device_map` disk offload installs them) whose weights map is a [GGUFWeights][] mapping: the
  first read of any weight of layer `l` de-quantises all of layer `l` and drops the layer cached
  before it, so one layer's float32 weights are in memory at a time, however many layers the
  model has, and a weight read twice in one forward (TransformerLens reads some twice) is
  de-quantised once;
- after a layer is de-quantised its pages of the mapped file are released (`madvise`), so the
  file's pages do not pile up in the process's resident memory either.

The de-quantisation is `transformers`' own (`gguf.dequantize`, then the architecture's tensor
processor, e.g. Llama's rotary un-permutation and Gemma's norm offset), so a streamed model
runs on exactly the weights that `AutoModelForCausalLM.from_pretrained(..., gguf_file=...)`
builds, and on exactly the float32 weights of the embedded model's resident cache.

Examples:
    >>> import cw_lens
    >>> from cw_lens.models.gguf_writer import tiny_config, random_hf_model, write_gguf
    >>> import tempfile, pathlib
    >>> path = write_gguf(random_hf_model(tiny_config("llama")),
    ...                   pathlib.Path(tempfile.mkdtemp()) / "tiny.gguf")
    >>> model = cw_lens.load_model(path, layer_streaming=True)
    >>> model.cfg.n_layers
    2
"""

from __future__ import annotations

import logging
import mmap
import re
import threading
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

from cw_lens.core.errors import InputError, ModelLoadError
from cw_lens.models.gguf_header import check_gguf_header, open_gguf

log = logging.getLogger(__name__)

_LAYER = re.compile(r"^model\.layers\.(\d+)\.")
LM_HEAD_CHOICES = ("resident", "streamed")


class GGUFWeights(Mapping):
    """A lazy map from Hugging Face parameter names to float32 tensors of a GGUF file.

    Decoder-layer weights (`model.layers.{l}.…`) are de-quantised a whole layer at a time and
    one layer is cached; every other weight is resident, except the output head with
    `lm_head="streamed"`, which takes the cache's slot when the forward reaches it.

    Attributes:
        layer_loads: How many times a decoder layer was de-quantised (the weight traffic).
        head_loads: How many times the output head was de-quantised (`lm_head="streamed"`).
    """

    def __init__(self, path: Path, model: Any, *, lm_head: str = "resident") -> None:
        """Map the GGUF file at `path` onto the parameter names of `model` (a meta skeleton).

        Args:
            path: The `.gguf` file.
            model: The `transformers` model built on the meta device from the file's config.
            lm_head: `"resident"` (de-quantised once) or `"streamed"` (on every read).

        Raises:
            ModelLoadError: A parameter of the model has no tensor in the file.
        """
        from transformers.modeling_gguf_pytorch_utils import (
            TENSOR_PROCESSORS,
            TensorProcessor,
            get_gguf_hf_weights_map,
        )

        self.path = Path(path)
        self._model = model
        self.reader = open_gguf(self.path)
        arch = str(self.reader.fields["general.architecture"].contents())
        config = model.config.to_dict()
        self._processor = TENSOR_PROCESSORS.get(arch, TensorProcessor)(config=config)
        self._key_map = get_gguf_hf_weights_map(model, self._processor)
        self._tensors = {t.name: t for t in self.reader.tensors}
        self._hf_to_gguf: dict[str, str] = {}
        for gguf_name, hf_name in self._key_map.items():
            if gguf_name in self._tensors:
                self._hf_to_gguf[hf_name] = gguf_name
        tied = bool(getattr(model.config, "tie_word_embeddings", False))
        names = [n for n, _ in model.named_parameters(remove_duplicate=False)]
        if tied and "lm_head.weight" in names and "lm_head.weight" not in self._hf_to_gguf:
            self._hf_to_gguf["lm_head.weight"] = self._hf_to_gguf.get(
                "model.embed_tokens.weight", ""
            )
        missing = [n for n in names if not self._hf_to_gguf.get(n)]
        if missing:
            raise ModelLoadError(
                f"The GGUF file {self.path.name} has no tensor for {missing[:4]} "
                f"({len(missing)} parameters of the {type(model).__name__} in all). The file is "
                "incomplete or of an architecture variant transformers maps differently."
            )
        self._names = names
        self._layers: dict[int, list[str]] = {}
        for name in names:
            match = _LAYER.match(name)
            if match:
                self._layers.setdefault(int(match.group(1)), []).append(name)
        if lm_head not in LM_HEAD_CHOICES:
            raise InputError(f"lm_head must be one of {LM_HEAD_CHOICES}; got {lm_head!r}.")
        self.lm_head = lm_head
        self._resident: dict[str, torch.Tensor] = {}
        for name in names:
            if not _LAYER.match(name) and not (name == "lm_head.weight" and lm_head == "streamed"):
                if self._hf_to_gguf[name] in {self._hf_to_gguf[k] for k in self._resident}:
                    twin = next(
                        k for k in self._resident if self._hf_to_gguf[k] == self._hf_to_gguf[name]
                    )
                    self._resident[name] = self._resident[twin]
                else:
                    self._resident[name] = self._dequantise(name)
        self._cached_layer: int | str | None = None
        self._cache: dict[str, torch.Tensor] = {}
        self._lock = threading.Lock()
        self.layer_loads = 0
        self.head_loads = 0

    def _dequantise(self, hf_name: str) -> torch.Tensor:
        # exactly transformers' load_gguf_checkpoint: dequantize, the architecture's processor,
        # then a float32 copy (contiguous, so every kernel sees the layout of the resident path)
        import gguf

        tensor = self._tensors[self._hf_to_gguf[hf_name]]
        weights = gguf.dequantize(tensor.data, tensor.tensor_type)
        result = self._processor.process(
            weights=weights,
            name=tensor.name,
            tensor_key_mapping=self._key_map,
            parsed_parameters={"tensors": {}, "config": {}},
        )
        # a normal tensor even when the first read is inside torch.inference_mode: accelerate
        # wraps the weights in Parameters, which inference tensors cannot become outside it
        with torch.inference_mode(False):
            out = torch.from_numpy(np.copy(result.weights)).to(torch.float32).contiguous()
        self._release_pages(tensor)
        return out

    def _release_pages(self, tensor: Any) -> None:
        # the de-quantised copy is ours now: tell the kernel the mapped file pages are not needed
        raw = getattr(self.reader.data, "_mmap", None)
        if raw is None or not hasattr(raw, "madvise"):
            return
        start = int(tensor.data_offset) // mmap.PAGESIZE * mmap.PAGESIZE
        end = int(tensor.data_offset) + int(tensor.n_bytes)
        try:
            raw.madvise(mmap.MADV_DONTNEED, start, end - start)
        except (OSError, ValueError):  # not every platform honours the advice
            pass

    def layer_weights(self, layer: int | str) -> dict[str, torch.Tensor]:
        """All float32 weights of decoder layer `layer`, de-quantised on first use and cached.

        The cache has one slot, shared by the decoder layers and a streamed output head
        (`layer="lm_head"`): TransformerLens reads some weights twice in a forward pass, and
        each is de-quantised once.

        Args:
            layer: The decoder layer index, or `"lm_head"`.

        Returns:
            The layer's weights by full parameter name.
        """
        with self._lock:
            if self._cached_layer != layer:
                self._cache = {}  # release the previous layer before de-quantising the next
                self._cached_layer = None
                names = ["lm_head.weight"] if layer == "lm_head" else self._layers[layer]
                self._cache = {name: self._dequantise(name) for name in names}
                self._cached_layer = layer
                if layer == "lm_head":
                    self.head_loads += 1
                else:
                    self.layer_loads += 1
            return self._cache

    def release(self) -> None:
        """Drop the cached decoder layer (the next read de-quantises again)."""
        with self._lock:
            self._cache, self._cached_layer = {}, None

    def __getitem__(self, name: str) -> torch.Tensor:
        match = _LAYER.match(name)
        if match:
            return self.layer_weights(int(match.group(1)))[name]
        if name in self._resident:
            return self._resident[name]
        if name == "lm_head.weight":
            return self.layer_weights("lm_head")[name]
        raise KeyError(name)

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)

    def resident_bytes(self) -> int:
        """Bytes of the weights that stay in memory (embeddings, final norm, head if resident)."""
        seen = {t.data_ptr(): t.numel() * t.element_size() for t in self._resident.values()}
        return sum(seen.values())

    def layer_bytes(self, layer: int = 0) -> int:
        """Bytes of one decoder layer's float32 weights.

        Args:
            layer: The decoder layer index.

        Returns:
            The size in bytes.
        """
        return sum(
            4 * int(np.prod(self._tensors[self._hf_to_gguf[n]].shape)) for n in self._layers[layer]
        )


def gguf_float32_bytes(path: Path) -> int:
    """Bytes the file's tensors take de-quantised to float32.

    Args:
        path: The `.gguf` file.

    Returns:
        Four bytes per element of every tensor.
    """
    return sum(4 * int(t.n_elements) for t in open_gguf(path).tensors)


def gguf_special_token_ids(path: Path) -> dict[str, int]:
    """The BOS, EOS, padding and unknown token ids a GGUF file's metadata declares.

    Args:
        path: The `.gguf` file.

    Returns:
        `{"bos_token_id": ..., ...}` for the ids the file has.
    """

    fields = open_gguf(path).fields
    ids = {}
    for role, key in (("bos", "bos"), ("eos", "eos"), ("pad", "padding"), ("unk", "unknown")):
        field = fields.get(f"tokenizer.ggml.{key}_token_id")
        if field is not None:
            ids[f"{role}_token_id"] = int(field.contents())
    return ids


def gguf_tokenizer(path: Path) -> Any:
    """The tokenizer of a GGUF file, with the special-token ids its metadata declares.

    GPT-2-style BPE vocabularies are rebuilt by cw_lens from the file
    ([cw_lens.models.gguf_cache.gguf_bpe_tokenizer][]); SentencePiece ones go through
    `transformers`' converter. Either way the BOS, EOS and padding ids are checked against the
    metadata.

    Args:
        path: The `.gguf` file.

    Returns:
        A `transformers` tokenizer.

    Raises:
        ModelLoadError: The tokenizer's special ids differ from the file's metadata.
    """
    import hashlib
    import os
    import shutil
    import tempfile

    from transformers import AutoTokenizer

    from cw_lens.models.gguf_cache import cache_root, gguf_bpe_tokenizer, write_tokenizer

    # TransformerLens re-reads a tokenizer from its folder (to turn BOS on), so the GGUF's
    # tokenizer is written once into a small cache folder named by the file's path, size and
    # modification time, and read from there
    stat = path.stat()
    key = hashlib.sha256(f"{path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()
    folder = cache_root() / "tokenizers" / f"{path.stem}-{key[:16]}"
    if not (folder / "tokenizer_config.json").is_file():
        built = gguf_bpe_tokenizer(path) or AutoTokenizer.from_pretrained(
            str(path.parent), gguf_file=path.name
        )
        folder.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=folder.name + ".tmp-", dir=folder.parent))
        write_tokenizer(tmp, built)
        try:
            os.replace(tmp, folder)
        except OSError:  # another process wrote it first
            pass
    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    wrong = {
        key: (getattr(tokenizer, key, None), value)
        for key, value in gguf_special_token_ids(path).items()
        if getattr(tokenizer, key, None) != value
    }
    if wrong:
        shutil.rmtree(folder, ignore_errors=True)  # a failed load leaves no cache behind
        detail = "; ".join(f"{k} {got} instead of {want}" for k, (got, want) in wrong.items())
        raise ModelLoadError(
            f"The tokenizer built from {path.name} disagrees with the file's metadata ({detail}). "
            "cw_lens refuses it rather than run with a wrong BOS; pass a tokenizer that matches."
        )
    return tokenizer


def load_streamed_gguf(
    path: Path, *, device: Any = None, lm_head: str = "resident"
) -> tuple[Any, Any, GGUFWeights]:
    """A `transformers` model whose decoder layers stream from the GGUF file, and its tokenizer.

    Args:
        path: The `.gguf` file.
        device: Where the arithmetic runs (`"cpu"`, `"cuda"`); weights are de-quantised on the
            CPU and moved there layer by layer.
        lm_head: `"resident"` keeps the output head in memory (2.2 GB in float32 for a
            152k-token vocabulary at width 3584); `"streamed"` de-quantises it on every forward.

    Returns:
        The model (eval mode, float32, eager attention), its tokenizer and the weights map
        (whose `layer_loads` counts the weight traffic).

    Raises:
        ModelLoadError: The file cannot be read or is of an architecture transformers cannot map.
    """
    from accelerate import init_empty_weights
    from accelerate.hooks import attach_align_device_hook
    from accelerate.utils import set_module_tensor_to_device
    from transformers import AutoConfig, AutoModelForCausalLM

    if not path.is_file():
        raise ModelLoadError(f"GGUF file not found: {path}")
    # a damaged header, a tensor past the end, or counts and widths the tensors do not have are
    # refused here, clearly, before the skeleton's layer loop or any allocation
    check_gguf_header(path)
    try:
        config = AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name)
    except Exception as exc:  # gguf / transformers raise many types on a bad header
        raise ModelLoadError(
            f"Could not read the GGUF header of {path}: {type(exc).__name__}: {exc}. The file is "
            "corrupt, truncated or of an architecture transformers cannot map."
        ) from exc
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    with init_empty_weights():
        model = AutoModelForCausalLM.from_config(
            config, dtype=torch.float32, attn_implementation="eager"
        )
    model.eval()
    weights = GGUFWeights(path, model, lm_head=lm_head)
    execution = torch.device(device) if device is not None else torch.device("cpu")
    layers = model.get_decoder().layers
    for name, _ in list(model.named_parameters(remove_duplicate=False)):
        if not _LAYER.match(name) and not (name == "lm_head.weight" and lm_head == "streamed"):
            set_module_tensor_to_device(model, name, execution, value=weights[name])
    for index, layer in enumerate(layers):
        attach_align_device_hook(
            layer,
            execution_device=execution,
            offload=True,
            weights_map=weights,
            module_name=f"model.layers.{index}",
        )
    if lm_head == "streamed":
        attach_align_device_hook(
            model.lm_head,
            execution_device=execution,
            offload=True,
            weights_map=weights,
            module_name="lm_head",
        )
    # buffers (rotary frequencies) were built on the CPU by init_empty_weights
    if execution.type != "cpu":
        for name, buffer in list(model.named_buffers()):
            set_module_tensor_to_device(model, name, execution, value=buffer)
    tokenizer = gguf_tokenizer(path)
    return model, tokenizer, weights


def streamed_weights(model: Any) -> GGUFWeights | None:
    """The [GGUFWeights][cw_lens.models.gguf_stream.GGUFWeights] map of a layer-streamed model.

    Args:
        model: A model from `load_model(path, layer_streaming=True)` (bridge or HF model).

    Returns:
        The weights map, or None when the model is not layer-streamed.
    """
    return getattr(model, "_cw_lens_gguf_weights", None)
