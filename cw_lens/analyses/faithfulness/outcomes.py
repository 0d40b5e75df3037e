"""The faithfulness run's outcomes: exact sums of the next-token NLL (or, on task corpora, the
answer's log-probability and correctness) of the clean pass and of every removal configuration,
and opt-in each document's own for bootstrap intervals.
"""

from __future__ import annotations

import torch
from torch import Tensor

from cw_lens.core.accumulate import ExactSums, PerDocument
from cw_lens.data.inputs import TokenBatch
from cw_lens.data.scoring import score_answers, token_nll


class _Outcomes:
    """Exact NLL / answer sums for the clean run and every configuration (and, opt-in, each
    document's own, for bootstrap intervals).

    Args:
        names: The sums kept per document (`None`: none).
        n_documents: Documents in the corpus (rows of the per-document record).
    """

    def __init__(self, names: list[str] | None = None, n_documents: int = 0) -> None:
        self.sums = ExactSums()
        self.tokens = 0
        self.per_doc = None if names is None else PerDocument(names, n_documents)

    def merge(self, other: _Outcomes) -> None:
        self.sums.merge(other.sums)
        self.tokens += other.tokens
        if self.per_doc is not None:
            self.per_doc.merge(other.per_doc)

    def _add(self, docs: list[int], name: str, values: Tensor) -> None:
        self.sums.add_rows(docs, name, values)
        if self.per_doc is not None and name in self.per_doc.names:
            self.per_doc.add_rows(docs, name, values)

    def record(
        self, tag: str, batch: TokenBatch, logits: Tensor, docs: list[int], spans: list | None
    ) -> None:
        if spans is None:
            nll = token_nll(logits, batch.tokens, batch.mask)
            self._add(docs, f"nll|{tag}", nll.nansum(-1))
            self._add(docs, f"count|{tag}", (~nll.isnan()).sum(-1))
        else:
            scores = score_answers(logits, batch.tokens, spans)
            self._add(docs, f"logprob|{tag}", scores.logprob)
            self._add(docs, f"correct|{tag}", scores.correct.double())
            self._add(docs, f"count|{tag}", torch.ones(len(docs), device="cpu"))
