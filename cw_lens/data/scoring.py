"""Scoring what the model predicts: next-token NLL on text, answer log-probability on tasks.

Language-model text: the mean next-token negative log-likelihood over the scored positions
(every real position that has a real successor), and `PPL = exp(mean NLL)`; the sums
are kept in a `ExactSums` so sharded runs merge exactly.

Task items (a prompt with a known answer): the answer `a_1 .. a_m` (its tokens after the
prompt) is scored teacher-forced: its log-probability is `sum_t log p(a_t | prompt, a_<t)`
and the item counts as correct when every `a_t` is the model's greedy choice. Used to keep
only correctly answered items
(`load_corpus(..., only_correct=True)`) and by the faithfulness protocol on task corpora.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from jaxtyping import Bool, Float
from torch import Tensor

from cw_lens.core.accumulate import ExactSums, PerDocument
from cw_lens.data.distributed import current_shard, merge_across_ranks
from cw_lens.data.documents import Document
from cw_lens.data.inputs import TokenBatch, answer_spans, iter_batches, prepare_inputs
from cw_lens.models.capture import run_layers

HookSource = Sequence | Callable[[TokenBatch], Sequence]


@dataclass
class AnswerScores:
    """Per item: `logprob` of the whole answer and `correct` (greedy on every token)."""

    logprob: Float[Tensor, " item"]
    correct: Bool[Tensor, " item"]


def score_answers(
    logits: Float[Tensor, "batch pos vocab"], tokens: Tensor, spans: Sequence[tuple[int, int]]
) -> AnswerScores:
    """Teacher-forced answer log-probability and greedy correctness from a forward's logits."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    lp, ok = [], []
    for row, (start, end) in enumerate(spans):
        positions = torch.arange(start - 1, end - 1, device=logits.device)
        targets = tokens[row, start:end].to(logits.device)
        step = logprobs[row, positions, targets]
        lp.append(step.sum())
        ok.append(bool((logits[row, positions].argmax(-1) == targets).all()))
    return AnswerScores(torch.stack(lp).cpu(), torch.tensor(ok, device="cpu"))


def answer_scores(
    model: Any,
    documents: Sequence[Document],
    *,
    prepend_bos: bool = True,
    batch_size: int = 16,
    run: Callable[[TokenBatch], Tensor] | None = None,
) -> AnswerScores:
    """Score every task item with the model (`run` may replace the plain forward pass)."""
    batch, spans = answer_spans(model, documents, prepend_bos)
    logprob = torch.empty(len(documents), device="cpu")
    correct = torch.zeros(len(documents), dtype=torch.bool, device="cpu")
    for sub in iter_batches(batch, batch_size):
        logits = run_logits(model, sub) if run is None else run(sub)
        scores = score_answers(logits, sub.tokens, [spans[i] for i in sub.documents])
        logprob[sub.documents] = scores.logprob
        correct[sub.documents] = scores.correct
    return AnswerScores(logprob, correct)


# Items scored per forward pass while looking for correctly answered ones: each chunk of
# consecutive items is its own batch, so whether an item is kept never depends on how many
# items were drawn or when the search stopped.
CORRECT_CHUNK = 16


def keep_correct(
    model: Any,
    documents: Sequence[Document],
    limit: int,
    *,
    progress: bool = True,
    label: str = "items",
) -> list[Document]:
    """The first `limit` items the model answers correctly (in order).

    Items are scored `CORRECT_CHUNK` at a time (one forward pass each), and scoring stops as
    soon as `limit` are found: at best `limit / CORRECT_CHUNK` passes when the model answers
    most items, at worst one pass per chunk of `documents`.

    Args:
        model: The model that answers.
        documents: Candidate task items, in the order they are preferred.
        limit: How many correctly answered items to keep.
        progress: Show a progress bar of the items found (with the items scored so far).
        label: What the items are, for the progress bar.

    Returns:
        At most `limit` items, in their order in `documents`.
    """
    from tqdm.auto import tqdm

    kept: list[Document] = []
    with tqdm(
        total=limit, desc=f"{label} answered correctly", disable=not progress, leave=False
    ) as bar:
        for start in range(0, len(documents), CORRECT_CHUNK):
            chunk = documents[start : start + CORRECT_CHUNK]
            scores = answer_scores(model, chunk, batch_size=CORRECT_CHUNK)
            found = [d for d, ok in zip(chunk, scores.correct.tolist(), strict=True) if ok]
            found = found[: limit - len(kept)]
            kept += found
            bar.update(len(found))
            bar.set_postfix_str(f"{start + len(chunk)} of {len(documents)} scored")
            if len(kept) >= limit:
                break
    return kept


# The per-document record of `corpus_nll` (`per_document=True`): each document's NLL sum and
# the number of positions scored.
NLL_SUMS = ("nll", "count")
# Rows of the vocabulary-sized logits reduced at a time by `log_normalisers`.
NLL_ROWS = 32


def log_normalisers(logits: Float[Tensor, "batch pos vocab"]) -> Float[Tensor, "batch pos"]:
    """`logsumexp` over the vocabulary of every position (float32), `NLL_ROWS` rows at a
    time."""
    out = torch.empty(logits.shape[:2], device=logits.device)
    for row in range(logits.shape[0]):
        for start in range(0, logits.shape[1], NLL_ROWS):
            rows = slice(start, start + NLL_ROWS)
            out[row, rows] = torch.logsumexp(logits[row, rows].float(), dim=-1)
    return out


def token_nll(
    logits: Float[Tensor, "batch pos vocab"], tokens: Tensor, mask: Tensor
) -> Float[Tensor, "batch pos_minus_1"]:
    """NLL of token `t+1` given `..t` at every position; NaN where either is padding."""
    scored = logits[:, :-1]
    targets = tokens[:, 1:].to(logits.device)
    # -log softmax(x)[t] = logsumexp(x) - x[t], the logsumexp over a few rows at a time: the
    # [batch, pos, vocab] log-probabilities are never written (a vocabulary-sized row block stays
    # in cache; several times faster than log_softmax on a large vocabulary)
    nll = log_normalisers(scored) - scored.gather(-1, targets[..., None])[..., 0].float()
    valid = (mask[:, 1:] & mask[:, :-1]).to(logits.device)
    return nll.masked_fill(~valid, float("nan"))


@dataclass
class NLLResult:
    """Exact NLL sums and counts; `mean_nll` and `ppl` over all scored positions."""

    sums: ExactSums
    per_doc: PerDocument | None = None  # opt-in: each document's "nll" sum and "count"

    @property
    def mean_nll(self) -> float:
        return float(self.sums.total("nll") / self.sums.total("count"))

    @property
    def ppl(self) -> float:
        return float(torch.exp(torch.tensor(self.mean_nll, device="cpu")))

    def merge(self, other: NLLResult) -> None:
        self.sums.merge(other.sums)
        if self.per_doc is not None:
            self.per_doc.merge(other.per_doc)

    def add_batch(self, batch: TokenBatch, logits: Tensor) -> None:
        """Add one document batch's next-token NLL sums and counts, from its logits.

        Args:
            batch: The document batch.
            logits: Its logits `[batch, pos, vocab]`.
        """
        nll = token_nll(logits, batch.tokens, batch.mask)
        rows = [("nll", nll.nansum(-1)), ("count", (~nll.isnan()).sum(-1))]
        self.sums.add_many(batch.documents, rows)
        if self.per_doc is not None:
            self.per_doc.add_many(batch.documents, rows)

    def to_host(self) -> None:
        """Bring what was accumulated on the model's device to the host."""
        self.sums.to_host()
        if self.per_doc is not None:
            self.per_doc.to_host()


def run_logits(model: Any, batch: TokenBatch, hooks: HookSource = ()) -> Tensor:
    """Logits of one batch with interventions (a hook list, or a function of the batch)."""
    fwd_hooks = hooks(batch) if callable(hooks) else hooks
    return run_layers(model, batch, None, layers=[], fwd_hooks=fwd_hooks, need_logits=True)


def corpus_nll(
    model: Any,
    corpus: Any,
    *,
    hooks: HookSource = (),
    batch_size: int | None = 8,
    prepend_bos: bool = True,
    per_document: bool = False,
) -> NLLResult:
    """Mean next-token NLL of a corpus, optionally under interventions (sharded under torchrun);
    `per_document=True` also keeps each document's NLL sum and count (9 bytes per document)."""
    prepared = prepare_inputs(model, corpus, prepend_bos=prepend_bos)
    batches = list(iter_batches(prepared, batch_size))
    shard = current_shard()
    if shard is not None:
        batches = batches[shard[0] :: shard[1]]
    result = NLLResult(
        ExactSums(),
        PerDocument(NLL_SUMS, prepared.tokens.shape[0]) if per_document else None,
    )
    for batch in batches:
        result.add_batch(batch, run_logits(model, batch, hooks))
    result.to_host()
    return merge_across_ranks(result)
