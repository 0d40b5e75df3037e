"""Data: corpora, documents, inputs (text -> checked token batches), scoring, the corpus stream.

Layer 3 of 5 (see `docs/architecture.md`): may import `cw_lens.models` and `cw_lens.core`.
The names below are the old module `cw_lens.data` (now `cw_lens.data.documents`), so
`from cw_lens.data import Corpus` keeps working.
"""

from typing import Any

from cw_lens.data import documents
from cw_lens.data.documents import (
    TASKS,
    Corpus,
    Document,
    as_corpus,
    tokenizer_fingerprint,
)
from cw_lens.data.sources import (
    DEFINITIONS,
    IOI_TEMPLATES,
    ITEMS,
    NAMES,
    OBJECTS,
    PLACES,
    PROSE,
    STDLIB_SKIP,
    arithmetic_items,
    hf_text,
    ioi_items,
    pydoc_and_stdlib_text,
    pydoc_text,
    read_jsonl,
    stdlib_text,
    tokenised,
    windows,
)

__all__ = [
    "DEFINITIONS",
    "IOI_TEMPLATES",
    "ITEMS",
    "NAMES",
    "OBJECTS",
    "PLACES",
    "PROSE",
    "STDLIB_SKIP",
    "TASKS",
    "Corpus",
    "Document",
    "arithmetic_items",
    "as_corpus",
    "hf_text",
    "ioi_items",
    "pydoc_and_stdlib_text",
    "pydoc_text",
    "read_jsonl",
    "stdlib_text",
    "tokenised",
    "tokenizer_fingerprint",
    "windows",
]


def __getattr__(name: str) -> Any:
    """Anything else the old module `cw_lens.data` held comes from its new home."""
    try:
        return getattr(documents, name)
    except AttributeError:
        raise AttributeError(f"module 'cw_lens.data' has no attribute {name!r}") from None
