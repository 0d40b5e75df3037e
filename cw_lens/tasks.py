"""Scoring task items (a prompt with a known answer): answer log-probability and accuracy.

The answer ``a_1 .. a_m`` (its tokens after the prompt) is scored teacher-forced: its
log-probability is ``sum_t log p(a_t | prompt, a_<t)`` and the item counts as correct when every
``a_t`` is the model's greedy choice. Used to keep only correctly answered items
(``load_corpus(..., only_correct=True)``) and by the faithfulness protocol on task corpora.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from jaxtyping import Bool, Float
from torch import Tensor

from cw_lens.data import Document
from cw_lens.inputs import TokenBatch, answer_spans, iter_batches


@dataclass
class AnswerScores:
    """Per item: ``logprob`` of the whole answer and ``correct`` (greedy on every token)."""

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
    return AnswerScores(torch.stack(lp).cpu(), torch.tensor(ok))


def answer_scores(
    model: Any,
    documents: Sequence[Document],
    *,
    prepend_bos: bool = True,
    batch_size: int = 16,
    run: Callable[[TokenBatch], Tensor] | None = None,
) -> AnswerScores:
    """Score every task item with the model (``run`` may replace the plain forward pass)."""
    batch, spans = answer_spans(model, documents, prepend_bos)
    logprob = torch.empty(len(documents))
    correct = torch.zeros(len(documents), dtype=torch.bool)
    device = torch.device(model.cfg.device or "cpu")
    for sub in iter_batches(batch, batch_size):
        if run is None:
            with torch.inference_mode():
                logits = model(sub.tokens.to(device), attention_mask=sub.attention_mask())
        else:
            logits = run(sub)
        scores = score_answers(logits, sub.tokens, [spans[i] for i in sub.documents])
        logprob[sub.documents] = scores.logprob
        correct[sub.documents] = scores.correct
    return AnswerScores(logprob, correct)


def keep_correct(model: Any, documents: Sequence[Document], limit: int) -> list[Document]:
    """The first ``limit`` items the model answers correctly (in order)."""
    scores = answer_scores(model, documents)
    return [d for d, ok in zip(documents, scores.correct.tolist(), strict=False) if ok][:limit]
