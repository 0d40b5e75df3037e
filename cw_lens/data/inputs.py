"""Turning what users hand in (text, lists, token tensors, corpora) into checked token batches.

Every analysis goes through `prepare_inputs`, so every one gives the same clear errors for
empty text, over-long input and padding without an attention mask, and the same layout:

- strings are tokenised with the model's tokenizer, BOS prepended when `prepend_bos=True`
  (the TransformerLens default), and **right-padded**, so position 0 is the first token (the
  sink) in every row and padded positions sit at the end;
- token ids (a tensor, a list of ids or of id lists: `as_corpus` makes them documents with
  `verbatim=True`) are used as given, BOS included only where they hold it; with an
  `attention_mask` a tensor's rows are re-aligned to the same right-padded layout (left padding
  is moved to the end; positions then count from each row's first real token, and the model
  sees identical position ids);
- token ids outside the model's vocabulary are rejected, and so are rows that begin or end
  with the pad token without a mask: we cannot tell padding from text.

Every kind of input goes through `cw_lens.data.documents.as_corpus` first, so an input of
another kind gets one message from every analysis.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import torch

from cw_lens.core.errors import InputError
from cw_lens.data.documents import Corpus, Document, as_corpus, tokenizer_fingerprint
from cw_lens.models.access import check_model
from cw_lens.models.batch import TokenBatch


def _n_ctx(model: Any) -> int:
    return int(getattr(model.cfg, "n_ctx", 0) or 0)


def _bos(model: Any) -> tuple[int | None, str | None]:
    tok = model.tokenizer
    if tok is None or tok.bos_token_id is None:
        return None, None
    return int(tok.bos_token_id), tok.bos_token


def _pad_id(model: Any) -> int:
    tok = model.tokenizer
    if tok is not None and tok.pad_token_id is not None:
        return int(tok.pad_token_id)
    return 0


def _text_ids(model: Any, text: str, prepend_bos: bool) -> list[int]:
    if model.tokenizer is None:
        raise InputError(
            "This model has no tokenizer, so it cannot read text; pass token ids "
            "(a LongTensor [batch, pos]) instead."
        )
    ids = model.tokenizer(text, add_special_tokens=False)["input_ids"]
    bos_id, _ = _bos(model)
    if prepend_bos and bos_id is not None:
        ids = [bos_id, *ids]
    return ids


def _doc_ids(model: Any, doc: Document, prepend_bos: bool, corpus: Corpus | None) -> list[int]:
    if doc.tokens is not None and corpus is not None and corpus_matches(corpus, model):
        bos_id, _ = _bos(model)
        ids = list(doc.tokens)
        return [bos_id, *ids] if prepend_bos and bos_id is not None else ids
    return _text_ids(model, doc.text, prepend_bos)


def corpus_matches(corpus: Corpus, model: Any) -> bool:
    fp = getattr(corpus, "tokenizer_fingerprint", None)
    return fp is not None and fp == tokenizer_fingerprint(model.tokenizer)


def check_windows_match(corpus: Corpus, model: Any) -> None:
    """Refuse a corpus cut into windows of another tokenizer's tokens.

    `load_corpus` cuts prose into windows of `max_tokens` tokens of the tokenizer it was
    given (the embedded SmolLM2's when none). Re-tokenising such a window for another model gives
    another number of tokens per document — an analysis would silently measure other windows than
    the ones asked for — so the corpus has to be loaded for the model instead. Task items and
    whole documents (`.jsonl`) are not windows: they are re-tokenised for the model as texts.
    """
    windowed = any("offset" in d.meta for d in corpus)
    fp = getattr(corpus, "tokenizer_fingerprint", None)
    if not windowed or fp is None or corpus_matches(corpus, model):
        return
    raise InputError(
        f"The corpus {corpus.name!r} was cut into windows of {corpus.max_tokens} tokens of "
        "another tokenizer than this model's (load_corpus without model= uses the embedded "
        "SmolLM2's), so this model would read windows of other lengths. Load it for this model: "
        f"cw_lens.load_corpus({corpus.name!r}, n_docs={len(corpus)}, "
        f"max_tokens={corpus.max_tokens}, model=model)."
    )


def _pad_rows(rows: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    # padded on the host as Python lists: two tensors whatever the number of rows
    width = max(len(r) for r in rows)
    padded = [[*r, *[pad_id] * (width - len(r))] for r in rows]
    filled = [[True] * len(r) + [False] * (width - len(r)) for r in rows]
    tokens = torch.tensor(padded, dtype=torch.long, device="cpu").reshape(len(rows), width)
    mask = torch.tensor(filled, dtype=torch.bool, device="cpu").reshape(len(rows), width)
    return tokens, mask


def _check_length(model: Any, rows: list[list[int]]) -> None:
    n_ctx = _n_ctx(model)
    for i, r in enumerate(rows):
        if len(r) == 0:
            raise InputError(f"Input {i} is empty: there is no token to analyse.")
        if n_ctx and len(r) > n_ctx:
            raise InputError(
                f"Input {i} has {len(r)} tokens but the model's context is {n_ctx} tokens. "
                f"Shorten the text (e.g. load_corpus(max_tokens={n_ctx - 1})) or split it."
            )


def _check_token_ids(model: Any, corpus: Corpus, rows: list[list[int]], masked: bool) -> None:
    """Token ids handed in (`Document.verbatim`) lie in the model's vocabulary, and without an
    attention mask no row begins or ends with the pad token (padding cannot be told from text)."""
    given = [r for d, r in zip(corpus, rows, strict=True) if d.verbatim and r]
    if not given:
        return
    vocab = int(getattr(model.cfg, "d_vocab", 0) or 0)
    low, high = min(min(r) for r in given), max(max(r) for r in given)
    if vocab and (low < 0 or high >= vocab):
        raise InputError(
            f"Token ids must lie in [0, {vocab}) for this model; got ids from {low} to {high}. "
            "Were they made with another tokenizer?"
        )
    tok = model.tokenizer
    pad = None if tok is None else tok.pad_token_id
    bos_id, _ = _bos(model)
    if masked or pad is None or pad == bos_id:
        return
    for d, r in zip(corpus, rows, strict=True):
        if d.verbatim and r and not d.meta.get("attention_mask") and pad in (r[0], r[-1]):
            raise InputError(
                f"The token ids have pad tokens (id {pad}) at the start or end of a row but no "
                "attention_mask was given, so padding cannot be told from text. Pass "
                "attention_mask=(1 for real tokens, 0 for padding), or the rows without their "
                "padding as a list of token-id lists, or the texts as a list of strings and "
                "cw_lens pads them for you."
            )


def prepare_inputs(
    model: Any,
    inputs: Any,
    *,
    prepend_bos: bool = True,
    attention_mask: torch.Tensor | None = None,
) -> TokenBatch:
    """Check and tokenise `inputs` into a right-padded `TokenBatch`.

    Args:
        model: The `TransformerBridge`.
        inputs: Anything `cw_lens.data.documents.as_corpus` reads: a string, a list
            of strings, token ids (an integer tensor `[pos]` or `[batch, pos]`, a list of token
            ids or of token-id lists), a [`Corpus`][cw_lens.Corpus] or a list of
            [`Document`][cw_lens.Document].
        prepend_bos: Prepend the tokenizer's BOS token to text (token ids are read as given).
        attention_mask: For a token tensor only: 1 at real tokens, 0 at padding.

    Returns:
        The batch: right-padded token ids, their mask, and whether every row starts with BOS.
    """
    check_model(model)  # a name such as "gpt2" is not a model: say how to load it
    bos_id, bos_token = _bos(model)
    corpus = as_corpus(inputs, attention_mask=attention_mask)
    check_windows_match(corpus, model)
    rows = [
        list(d.tokens) if d.verbatim else _doc_ids(model, d, prepend_bos, corpus) for d in corpus
    ]
    _check_token_ids(model, corpus, rows, attention_mask is not None)
    text_bos = bool(prepend_bos and bos_token is not None)
    for i, (d, r) in enumerate(zip(corpus, rows, strict=False)):
        if not d.verbatim and (not d.text.strip() or len(r) <= int(text_bos)):
            raise InputError(f"Input {i} is empty text: there is no token to analyse.")
    _check_length(model, rows)
    tokens, mask = _pad_rows(rows, _pad_id(model))
    # position 0 is BOS: in text rows when BOS was prepended, in token-id rows where they hold it
    starts_with_bos = all(
        (bos_id is not None and r[0] == bos_id) if d.verbatim else text_bos
        for d, r in zip(corpus, rows, strict=True)
    )
    return TokenBatch(tokens, mask, starts_with_bos, bos_token, list(range(len(rows))))


def one_text(name: str, n_documents: int, hint: str = "") -> None:
    """Refuse more than one document where an analysis reads one text; one message for all.

    Args:
        name: The analysis (`"routes"`).
        n_documents: How many documents its input holds.
        hint: Said after the fix (`" (for IOI items: ioi_route_statistics)"`).

    Raises:
        InputError: with more than one document.

    Examples:
        >>> from cw_lens.core.errors import InputError
        >>> from cw_lens.data.inputs import one_text
        >>> one_text("routes", 1)
        >>> try:
        ...     one_text("routes", 2)
        ... except InputError as error:
        ...     print(str(error).split(". ")[0])
        routes reads one text; got 2 documents
    """
    if n_documents != 1:
        raise InputError(
            f"{name} reads one text; got {n_documents} documents. Pass one string or one row of "
            f"token ids, or loop over the documents{hint}."
        )


def iter_batches(batch: TokenBatch, batch_size: int | None) -> Iterator[TokenBatch]:
    """Split a prepared batch into sub-batches of at most `batch_size` rows, trimming padding.

    Rows are grouped in order of length so sub-batches waste little padding.
    """
    n = batch.tokens.shape[0]
    if batch_size is None or batch_size >= n:
        yield batch
        return
    if batch_size < 1:
        raise InputError(f"batch_size must be at least 1, got {batch_size}.")
    order = sorted(range(n), key=lambda i: int(batch.lengths[i]))
    for start in range(0, n, batch_size):
        idx = order[start : start + batch_size]
        width = int(batch.lengths[idx].max())
        yield TokenBatch(
            batch.tokens[idx, :width],
            batch.mask[idx, :width],
            batch.prepend_bos,
            batch.bos_token,
            [batch.documents[i] for i in idx],
        )


def answer_spans(
    model: Any, documents: Sequence[Document], prepend_bos: bool = True
) -> tuple[TokenBatch, list[tuple[int, int]]]:
    """Tokenise `prompt + answer` per task item and locate the answer tokens.

    Returns the batch and, per row, the half-open position range `[start, end)` of the answer
    tokens (the model predicts token `t` from position `t - 1`).
    """
    rows, spans = [], []
    for i, d in enumerate(documents):
        if d.answer is None:
            raise InputError(f"Document {i} has no answer; task metrics need task items.")
        prompt = _text_ids(model, d.text, prepend_bos)
        full = _text_ids(model, d.text + d.answer, prepend_bos)
        if full[: len(prompt)] != prompt or len(full) == len(prompt):
            raise InputError(
                f"Item {i}: the answer {d.answer!r} does not tokenise as a continuation of the "
                "prompt; start the answer with a space or end the prompt at a token boundary."
            )
        rows.append(full)
        spans.append((len(prompt), len(full)))
    _check_length(model, rows)
    tokens, mask = _pad_rows(rows, _pad_id(model))
    _, bos_token = _bos(model)
    return TokenBatch(tokens, mask, prepend_bos, bos_token, list(range(len(rows)))), spans
