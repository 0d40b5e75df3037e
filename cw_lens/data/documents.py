"""Documents and corpora, and the one reading of every input an analysis takes.

[`cw_lens.load_corpus`][cw_lens.load_corpus] returns a [`Corpus`][cw_lens.Corpus] (a sequence of
[`Document`][cw_lens.Document]). Every analysis reads the same kinds of input, turned into a
corpus by `as_corpus` (below): a string, a list of strings, token ids
(an integer tensor `[pos]` or `[batch, pos]`, a list of token ids, or a list of token-id lists),
a `Corpus`, or a list of `Document`; anything else gets one message naming what was given and
listing these.

The sources [`load_corpus`][cw_lens.load_corpus] reads (built-in prose, task generators, files)
are in `cw_lens.data.sources`.

The public functions' docstrings have runnable examples.
"""

from __future__ import annotations

import numbers
import operator
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd

from cw_lens.core.errors import InputError

TASKS = ("ioi", "arithmetic")


@dataclass(frozen=True)
class Document:
    """One text to analyse.

    Attributes:
        text: The text the model reads (a task prompt ends right before its answer).
        tokens: Token ids of `text` without BOS, for the tokenizer the corpus was loaded
            with; `None` when the corpus was loaded without one (analyses then tokenise).
        answer: The expected continuation for task items (`" Mary"`, `" 8"`), else `None`.
        meta: Provenance (topic, template, offset, ...).
        verbatim: `True` for token ids handed in (a tensor or lists of ids, see
            `cw_lens.data.documents.as_corpus`): `tokens` are then the model's whole
            input, read as given by any model (BOS only where they hold it; `prepend_bos` does not
            apply), and `text` is empty.
    """

    text: str
    tokens: tuple[int, ...] | None = None
    answer: str | None = None
    meta: dict[str, Any] = field(default_factory=dict, compare=False)
    verbatim: bool = False


@dataclass
class Corpus(Sequence):
    """A named, ordered collection of documents (what `load_corpus` returns)."""

    name: str
    documents: list[Document]
    max_tokens: int | None = None
    seed: int = 0
    tokenizer_fingerprint: str | None = None

    def __len__(self) -> int:
        return len(self.documents)

    def __getitem__(self, index: Any) -> Any:
        if isinstance(index, slice):
            return Corpus(
                self.name,
                self.documents[index],
                self.max_tokens,
                self.seed,
                self.tokenizer_fingerprint,
            )
        return self.documents[index]

    def subset(self, indices: Sequence[int]) -> Corpus:
        """The documents at `indices`, in that order, as a corpus with this one's name,
        window size, seed and tokenizer.

        Args:
            indices: Positions in this corpus (a position may repeat; negative ones count
                from the end, as in a list).

        Returns:
            A new [`Corpus`][cw_lens.Corpus]; the documents are shared, not copied.

        Examples:
            >>> from cw_lens.data.documents import Corpus, Document
            >>> corpus = Corpus("texts", [Document(t) for t in ("a", "b", "c", "d")])
            >>> corpus.subset([3, 1]).texts
            ['d', 'b']
        """
        if isinstance(indices, (str, bytes)) or not isinstance(indices, Sequence):
            raise InputError(
                "Corpus.subset takes a sequence of document positions; got "
                f"{type(indices).__name__}."
            )
        n = len(self.documents)
        positions = [_position(i, n) for i in indices]
        bad = [i for i, p in zip(indices, positions, strict=True) if p is None]
        if bad:
            raise InputError(
                f"Corpus.subset: position(s) {bad[:5]} are not integers in [-{n}, {n}) for a "
                f"corpus of {n} documents."
            )
        return Corpus(
            self.name,
            [self.documents[p] for p in positions],
            self.max_tokens,
            self.seed,
            self.tokenizer_fingerprint,
        )

    def __iter__(self) -> Iterator[Document]:
        return iter(self.documents)

    def __repr__(self) -> str:
        """One short line: the name, the size, the source and the seed — never the texts.

        Examples:
            >>> from cw_lens.data.documents import Corpus, Document
            >>> Corpus("pydoc", [Document("a b", (1, 2), meta={"source": "pydoc_data.topics"})])
            Corpus('pydoc', 1 document x 2 tokens, source='pydoc_data.topics', seed=0)
        """
        n = len(self.documents)
        lengths = [len(d.tokens) for d in self.documents if d.tokens is not None]
        if lengths and len(lengths) == n:
            low, high = min(lengths), max(lengths)
            size = f" x {high} tokens" if low == high else f" x {low}-{high} tokens"
        elif self.max_tokens is not None:
            size = f" x at most {self.max_tokens} tokens"
        else:
            size = ", not tokenised"
        parts = [repr(self.name), f"{n} document{'' if n == 1 else 's'}{size}"]
        sources = {
            str(d.meta.get("source") or d.meta.get("task"))
            for d in self.documents
            if d.meta.get("source") or d.meta.get("task")
        }
        if len(sources) == 1:
            parts.append(f"source={sources.pop()!r}")
        elif sources:
            parts.append(f"{len(sources)} sources")
        parts.append(f"seed={self.seed}")
        return f"Corpus({', '.join(parts)})"

    def _repr_pretty_(self, printer: Any, cycle: bool) -> None:
        printer.text(repr(self))

    @property
    def texts(self) -> list[str]:
        return [d.text for d in self.documents]

    @property
    def is_task(self) -> bool:
        """True when every document carries an answer (a task set)."""
        return bool(self.documents) and all(d.answer is not None for d in self.documents)

    def to_dataframe(self) -> pd.DataFrame:
        """One row per document: its index, text, answer and source.

        Returns:
            A DataFrame, one row per document.

        Examples:
            ```python
            import cw_lens

            model = cw_lens.load_model("testing:tiny-llama")
            corpus = cw_lens.load_corpus(n_docs=2, max_tokens=16, model=model)
            corpus.to_dataframe()
            ```
        """
        rows = []
        for i, d in enumerate(self.documents):
            rows.append(
                {
                    "doc": i,
                    "text": d.text,
                    "answer": d.answer,
                    "n_tokens": None if d.tokens is None else len(d.tokens),
                    **d.meta,
                }
            )
        return pd.DataFrame(rows)


def _position(index: Any, n: int) -> int | None:
    """`index` as a list position in a sequence of `n` (numpy integers included), or None when it
    is not an integer (a bool is not) or out of range."""
    if isinstance(index, bool):
        return None
    try:
        position = operator.index(index)
    except TypeError:
        return None
    return position if -n <= position < n else None


# what every analysis reads: the one list in every message about an input it cannot read
ACCEPTED_INPUTS = (
    "a string, a list of strings, token ids (an integer tensor [pos] or [batch, pos], a list of "
    "token ids, or a list of token-id lists), or a Corpus from cw_lens.load_corpus() (or a list "
    "of Documents)"
)
TOKENS_CORPUS = "token ids"  # the name of a corpus made of token ids handed in


def unreadable_input(inputs: Any) -> InputError:
    """The one error for an input no analysis reads: what was given, and what is read.

    Args:
        inputs: What was handed in.

    Returns:
        The [`InputError`][cw_lens.InputError] to raise.

    Examples:
        >>> print(unreadable_input([1.5, 2.0]))  # doctest: +ELLIPSIS
        Expected a string, a list of strings, token ids (...; got a list containing float.
    """
    return InputError(f"Expected {ACCEPTED_INPUTS}; got {_describe(inputs)}.")


def _article(noun: str) -> str:
    return f"{'an' if noun[:1] in 'aeiou' else 'a'} {noun}"


def _describe(value: Any) -> str:
    """`value` in words, for the error: "None", "a dict", "a list containing float", "a tensor
    of dtype torch.float32", "a list containing list of float"."""
    if value is None:
        return "None"
    if _is_array(value):
        kind = "tensor" if _is_tensor(value) else "array"
        return f"{_article(kind)} of dtype {value.dtype} (token ids are integers)"
    if isinstance(value, (bytes, bytearray)):
        return f"{_article(type(value).__name__)} object (decode it to a str)"
    if isinstance(value, Sequence) and not isinstance(value, str):
        bad = [v for v in value if _row(v) is None and not isinstance(v, (str, Document))]
        kinds = sorted({_element(v) for v in bad or value})
        return f"{_article(type(value).__name__)} containing {' and '.join(kinds)}"
    return _article(type(value).__name__)


def _element(value: Any) -> str:
    if _is_array(value):
        integer = _integer_dtype(value)
        return f"{value.ndim}-D tensor" if integer else f"tensor of dtype {value.dtype}"
    if isinstance(value, Sequence) and not isinstance(value, (str, bytes, bytearray)) and value:
        inner = sorted({_element(v) for v in value if not _is_id(v)} or {"int"})
        return f"{type(value).__name__} of {' and '.join(inner)}"
    return type(value).__name__


def _is_tensor(value: Any) -> bool:
    torch = sys.modules.get("torch")  # a tensor exists only once torch is imported
    return torch is not None and isinstance(value, torch.Tensor)


def _is_array(value: Any) -> bool:
    return _is_tensor(value) or isinstance(value, np.ndarray)


def _integer_dtype(value: Any) -> bool:
    """Whether a tensor or array holds integers (not floats, complex numbers or bools)."""
    if _is_tensor(value):
        return not (
            value.is_floating_point()
            or value.is_complex()
            or value.dtype == sys.modules["torch"].bool
        )
    return value.dtype.kind in "iu"


def _is_id(value: Any) -> bool:
    """A token id: a Python or NumPy integer (a bool is not one)."""
    return isinstance(value, numbers.Integral) and not isinstance(value, (bool, np.bool_))


def _int_rows(value: Any) -> tuple[list[list[int]], tuple[int, int]] | None:
    """The rows of an integer tensor or array (`[pos]`: one row) and its `[batch, pos]` shape,
    or None for another dtype."""
    if not _integer_dtype(value):
        return None
    shape = tuple(value.shape)
    if len(shape) == 1:
        shape = (1, shape[0])
    elif len(shape) != 2:
        raise InputError(f"Token ids must be [batch, pos] or [pos], got shape {shape}.")
    if 0 in shape:
        raise InputError("The token tensor is empty: there is no token to analyse.")
    rows = (value.detach().cpu() if _is_tensor(value) else value).reshape(shape).tolist()
    return rows, shape


def _row(value: Any) -> list[int] | None:
    """One document's token ids (a sequence of integers, or a 1-D integer tensor), else None."""
    if _is_array(value):
        if value.ndim != 1 or not _integer_dtype(value):
            return None
        return [int(v) for v in value.tolist()]
    if isinstance(value, (str, bytes, bytearray)) or not isinstance(value, Sequence):
        return None
    if not all(_is_id(v) for v in value):
        return None
    return [int(v) for v in value]


def _masked_rows(
    rows: list[list[int]], shape: tuple[int, int], attention_mask: Any
) -> list[list[int]]:
    """Each row cut to its real tokens (left or right padding taken off)."""
    import torch  # only with a mask, that is with a token tensor

    mask = torch.as_tensor(attention_mask, device="cpu").detach().cpu()
    if mask.ndim == 1:
        mask = mask[None]
    if tuple(mask.shape) != shape:
        raise InputError(f"attention_mask has shape {tuple(mask.shape)} but tokens have {shape}.")
    mask = mask.bool()
    out = []
    for i, row in enumerate(rows):
        real = mask[i].nonzero().flatten()
        if real.numel() == 0:
            raise InputError(f"Row {i} of the batch is only padding (its mask is all zero).")
        first, last = int(real[0]), int(real[-1])
        if int(mask[i, first : last + 1].sum()) != last - first + 1:
            raise InputError(
                f"Row {i}'s attention_mask has a gap; only left or right padding is supported."
            )
        out.append(row[first : last + 1])
    return out


def _tokens_corpus(rows: list[list[int]], masked: bool) -> Corpus:
    meta = {"source": TOKENS_CORPUS}
    if masked:
        meta["attention_mask"] = True
    docs = [
        Document("", tuple(r), meta={**meta, "row": i}, verbatim=True) for i, r in enumerate(rows)
    ]
    return Corpus(TOKENS_CORPUS, docs)


def as_corpus(inputs: Any, *, attention_mask: Any = None) -> Corpus:
    """What an analysis reads, as a [`Corpus`][cw_lens.Corpus]: the one place every input is
    accepted or refused.

    Read are: a string; a list of strings; token ids — an integer tensor (or NumPy array)
    `[pos]` or `[batch, pos]`, a list of token ids (one document) or a list of token-id lists
    (one document each; rows may differ in length); a `Corpus`; a list of
    [`Document`][cw_lens.Document] (a list may mix strings, documents and token-id lists). Token
    ids become documents with `verbatim=True`: the model reads them as given (with their BOS, if
    any; `prepend_bos` does not apply), and `prepare_inputs` checks them against the model's
    vocabulary. Anything else raises one [`InputError`][cw_lens.InputError] naming what was
    given ("a list containing float") and listing what is read.

    Args:
        inputs: What the user handed in.
        attention_mask: With a token tensor only: 1 at real tokens, 0 at padding (left or right);
            each row is cut to its real tokens.

    Returns:
        The corpus (a `Corpus` handed in is returned as is).

    Raises:
        InputError: For an input of another kind, an empty one, a float tensor, or a mask that
            does not fit the tokens.

    Examples:
        >>> from cw_lens.data.documents import as_corpus
        >>> as_corpus(["one text", "another"]).texts
        ['one text', 'another']
        >>> [d.tokens for d in as_corpus([[5, 6, 7], [8, 9]])]
        [(5, 6, 7), (8, 9)]
        >>> as_corpus([5, 6, 7])[0].verbatim
        True
    """
    if attention_mask is not None and not _is_array(inputs):
        raise InputError(
            "attention_mask is only accepted with a token-id tensor, not with text, lists or a "
            "corpus (lists of token ids may differ in length: they need no padding)."
        )
    if isinstance(inputs, Corpus):
        docs = inputs
    elif isinstance(inputs, str):
        if not inputs.strip():
            raise InputError("The input text is empty: there is no token to analyse.")
        docs = Corpus("text", [Document(inputs)])
    elif _is_array(inputs):
        found = _int_rows(inputs)
        if found is None:
            raise unreadable_input(inputs)
        rows, shape = found
        if attention_mask is not None:
            rows = _masked_rows(rows, shape, attention_mask)
        docs = _tokens_corpus(rows, attention_mask is not None)
    elif isinstance(inputs, Sequence) and not isinstance(inputs, (bytes, bytearray)):
        docs = _sequence_corpus(inputs)
    else:
        raise unreadable_input(inputs)
    if len(docs) == 0:
        raise InputError("The corpus is empty: pass at least one document.")
    for i, d in enumerate(docs):
        if not d.text.strip() and not d.tokens:
            what = "token ids" if d.verbatim else "text"
            raise InputError(f"Document {i} of the corpus is empty (no {what}).")
    return docs


def _sequence_corpus(inputs: Sequence) -> Corpus:
    """A list (or tuple) of strings, documents and token-id lists, or one list of token ids."""
    if inputs and all(_is_id(v) for v in inputs):  # one document of token ids
        return _tokens_corpus([[int(v) for v in inputs]], False)
    docs: list[Document] = []
    for item in inputs:
        if isinstance(item, Document):
            docs.append(item)
        elif isinstance(item, str):
            docs.append(Document(item))
        elif (row := _row(item)) is not None:
            meta = {"source": TOKENS_CORPUS, "row": len(docs)}
            docs.append(Document("", tuple(row), meta=meta, verbatim=True))
        else:
            raise unreadable_input(inputs)
    if docs and all(d.verbatim for d in docs):
        return Corpus(TOKENS_CORPUS, docs)
    return Corpus("texts", docs)


# --------------------------------------------------------------------------- prose windows


def tokenizer_fingerprint(tokenizer: Any) -> str:
    """A short identity for a tokenizer: vocabulary size and the ids of a probe string."""
    if tokenizer is None:
        return "none"
    probe = tokenizer("The quick brown fox, 1234!", add_special_tokens=False)["input_ids"]
    return f"{len(tokenizer)}:{','.join(map(str, probe))}"
