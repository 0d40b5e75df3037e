"""The faithfulness run's outcomes: float64 sums of the next-token NLL (or, on task corpora, the
answer's log-probability and correctness) of the clean pass and of every removal configuration,
and opt-in each document's own for bootstrap intervals.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from cw_lens.core.accumulators import StackedSums, document_rows
from cw_lens.data.inputs import TokenBatch
from cw_lens.data.scoring import score_answers, token_nll

TEXT_SUMS = ("nll", "count")
TASK_SUMS = ("logprob", "correct", "count")


class Outcomes:
    """Per pass tag (`"clean"` and one per configuration), float64 sums over documents of what
    its logits score: on text the next-token NLL summed over the scored positions and their
    count (`nll`, `count`), on tasks the answer log-probability, its greedy correctness and the
    items (`logprob`, `correct`, `count`).

    The sums are one `cw_lens.core.accumulators.StackedSums` `[tag, statistic]` on the model's
    device: a pass adds its batch with one `add` (one row per document), with no transfer to
    the host; with `n_documents` each document's own as well (`[document, tag, statistic]`,
    one `index_add_`). Shards combine with `all_reduce` (collectives under torchrun).

    Args:
        tags: The passes (`"clean"`, then the configurations' tags).
        statistics: `TEXT_SUMS` or `TASK_SUMS`.
        n_documents: Documents in the corpus, to keep each one's sums (`None`: no record).
        device: Where the sums live (the model's device).

    Examples:
        >>> import torch
        >>> from cw_lens.data.inputs import TokenBatch
        >>> out = Outcomes(["clean"], TEXT_SUMS, n_documents=1)
        >>> tokens = torch.tensor([[0, 1, 2]])
        >>> batch = TokenBatch(tokens, torch.ones(1, 3, dtype=torch.bool), True, 0, [0])
        >>> out.record("clean", batch, torch.zeros(1, 3, 4), None)  # uniform over 4 tokens
        >>> round(out.mean("nll", "clean"), 4)  # log 4
        1.3863
    """

    def __init__(
        self,
        tags: Sequence[str],
        statistics: Sequence[str] = TEXT_SUMS,
        n_documents: int | None = None,
        *,
        device: torch.device | str = "cpu",
    ) -> None:
        self.tags = list(tags)
        self.statistics = tuple(statistics)
        self._tag = {tag: i for i, tag in enumerate(self.tags)}
        self.sums = StackedSums(
            self.statistics, (len(self.tags),), n_documents=n_documents, device=device
        )

    def record(self, tag: str, batch: TokenBatch, logits: Tensor, spans: list | None) -> None:
        """Add one pass's outcomes: each document of `batch` scored from `logits`.

        Args:
            tag: The pass (`"clean"` or a configuration's tag).
            batch: The documents (`batch.documents`: their corpus indices).
            logits: The pass's logits `[batch, pos, vocab]`.
            spans: Each item's answer span on task corpora; `None` on text.
        """
        if spans is None:
            nll = token_nll(logits, batch.tokens, batch.mask)
            rows = torch.stack([nll.nansum(-1), (~nll.isnan()).sum(-1).to(nll.dtype)], -1)
        else:
            scores = score_answers(logits, batch.tokens, spans)
            logprob = scores.logprob.to(logits.device, torch.float64)
            correct = scores.correct.to(logits.device, torch.float64)
            rows = torch.stack([logprob, correct, torch.ones_like(logprob)], -1)
        self.sums.add(rows, document_rows(batch.documents, rows.device), at=self._tag[tag])

    def all_reduce(self) -> None:
        """Sum every rank's outcomes (a no-op outside a process group of 2+ ranks)."""
        self.sums.all_reduce()

    def to_host(self) -> Outcomes:
        """Move the sums to the CPU (the one transfer of a run).

        Returns:
            This object.
        """
        self.sums.to_host()
        return self

    def mean(self, statistic: str, tag: str) -> float:
        """The mean of `statistic` per counted position (or item) of pass `tag`.

        Args:
            statistic: `nll`, `logprob` or `correct`.
            tag: The pass.

        Returns:
            `sum(statistic) / sum(count)` over the documents recorded.
        """
        row = self.sums.total[self._tag[tag]]
        return float(row[self.statistics.index(statistic)] / row[self.statistics.index("count")])

    def document_record(self, statistics: Sequence[str]) -> tuple[list[str], Tensor]:
        """Each document's sums of `statistics`, tag by tag, as the result keeps them.

        Args:
            statistics: The statistics kept per document, in order (e.g. `("nll", "count")`).

        Returns:
            The column names (`"<statistic>|<tag>"`, tags in order, statistics within each)
            and the `[document, column]` float64 table (the documents recorded, in order).
        """
        table = self.sums.document_table()  # [document, tag, statistic]
        columns = [self.statistics.index(s) for s in statistics]
        names = [f"{s}|{tag}" for tag in self.tags for s in statistics]
        return names, table[..., columns].reshape(table.shape[0], -1)
