"""Loading corpora to analyse: `load_corpus`.

Sources (see `cw_lens.data.documents` for each): `None`/`"pydoc"`, `"stdlib"` and
`"pydoc+stdlib"` (English prose that ships with every CPython, windowed), `"ioi"` and
`"arithmetic"` (generated task items with known answers), a `.txt` or `.jsonl` path, or
`"hf:NAME[:CONFIG[:SPLIT]]"` (needs internet).
Task items carry `answer`; with `model=` and `only_correct=True` only the items the model
completes correctly (greedy, teacher-forced over every answer token) are kept.

The public functions' docstrings have runnable examples.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from cw_lens.core.deprecation import renamed_kwargs
from cw_lens.core.errors import InputError
from cw_lens.core.keywords import check_keywords
from cw_lens.data import documents, sources
from cw_lens.data.scoring import keep_correct
from cw_lens.models.access import Model
from cw_lens.models.load import embedded_tokenizer

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


def resolve_tokenizer(tokenizer: Any) -> Any:
    if tokenizer is None:
        return embedded_tokenizer()
    return getattr(tokenizer, "tokenizer", None) or tokenizer


@check_keywords
@renamed_kwargs(tokenizer="model")
def load_corpus(
    name: str | os.PathLike | None = None,
    *,
    n_docs: int = 8,
    max_tokens: int = 128,
    model: Model | PreTrainedTokenizerBase | None = None,
    seed: int = 0,
    only_correct: bool = False,
    progress: bool = True,
) -> documents.Corpus:
    """Load a corpus of documents to analyse.

    Args:
        name: `None`/`"pydoc"`, `"stdlib"`, `"pydoc+stdlib"`, `"ioi"`,
            `"arithmetic"`, a `.txt` or `.jsonl` path, or `"hf:NAME[:CONFIG[:SPLIT]]"`
            (see the module docstring).
        n_docs: Number of documents.
        max_tokens: Window length in text tokens for prose sources (BOS is added on top by the
            analyses). Task items are single short prompts and ignore it.
        model: The model the corpus is for (or a bare tokenizer): windows are cut in its
            tokenizer's tokens, and with `only_correct` it answers the task items. `None`
            uses the embedded SmolLM2 tokenizer. (`tokenizer=`: its deprecated name.)
        seed: Seed for window sampling and task generation.
        only_correct: Keep only items `model` answers correctly (requires `model`). The
            generator draws `20 * n_docs` candidates and the model scores them 16 at a time
            (one forward pass of 16 short prompts each) until `n_docs` are found: about
            `n_docs / 16` passes when it answers most items, at most `20 * n_docs / 16`.
        progress: With `only_correct`, show a progress bar of the items found.

    Returns:
        A [`Corpus`][cw_lens.Corpus].

    Examples:
        ```python
        import cw_lens

        model = cw_lens.load_model("testing:tiny-llama")
        corpus = cw_lens.load_corpus(n_docs=2, max_tokens=16, model=model)
        ioi = cw_lens.load_corpus("ioi", n_docs=4, model=model)   # task items with answers
        corpus.to_dataframe()
        ```
    """
    # Long: one short branch per source (built-in texts, tasks, JSONL, Hugging Face).
    if n_docs < 1:
        raise InputError(f"n_docs must be at least 1, got {n_docs}.")
    if max_tokens < 1:
        raise InputError(f"max_tokens must be at least 1, got {max_tokens}.")
    tokenizer = model
    key = None if name is None else str(name)
    if key in documents.TASKS:
        generate = sources.ioi_items if key == "ioi" else sources.arithmetic_items
        if only_correct:
            if model is None or not hasattr(model, "cfg"):
                raise InputError(
                    "only_correct=True needs model= to be the model (not a tokenizer) to check "
                    "the answers."
                )
            pool = generate(20 * n_docs, seed)
            docs = keep_correct(model, pool, limit=n_docs, progress=progress, label=key)
            if not docs:
                raise InputError(f"The model answered none of {len(pool)} {key} items correctly.")
        else:
            docs = generate(n_docs, seed)
        tok = resolve_tokenizer(tokenizer) if tokenizer is not None else None
        fingerprint = None if tok is None else documents.tokenizer_fingerprint(tok)
        return documents.Corpus(key, sources.tokenised(docs, tok), None, seed, fingerprint)

    tok = resolve_tokenizer(tokenizer)
    if key is None or key in sources.PROSE:
        read, source = sources.PROSE[key or "pydoc"]
        text = read()
    elif key.startswith("hf:"):
        text, source = sources.hf_text(key[3:], n_chars=8 * n_docs * max_tokens), key
    else:
        path = Path(key).expanduser()
        if not path.is_file():
            names = ", ".join([*sources.PROSE, *documents.TASKS])
            raise InputError(
                f"Unknown corpus {key!r}: not a built-in name ({names}), "
                "not an 'hf:' dataset and not an existing .txt/.jsonl file."
            )
        if path.suffix == ".jsonl":
            docs = sources.read_jsonl(path)[:n_docs]
            if not docs:
                raise InputError(f"{path} contains no documents.")
            return documents.Corpus(
                path.name,
                sources.tokenised(docs, tok),
                max_tokens,
                seed,
                documents.tokenizer_fingerprint(tok),
            )
        text, source = path.read_text(encoding="utf-8"), path.name
    if not text.strip():
        raise InputError(f"The corpus source {source} is empty.")
    docs = sources.windows(text, tok, n_docs, max_tokens, seed, source)
    return documents.Corpus(
        "pydoc" if key is None else key,
        docs,
        max_tokens,
        seed,
        documents.tokenizer_fingerprint(tok),
    )
