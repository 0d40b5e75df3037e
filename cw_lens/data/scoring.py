"""Scoring what the model predicts: next-token NLL on text, answer log-probability on tasks.

Language-model text: the mean next-token negative log-likelihood over the scored positions
(every real position that has a real successor), and `PPL = exp(mean NLL)`; the sums are
float64 `StackedSums` on the model's device (one `add` per batch, each document's own with
`index_add_`), summed across torchrun ranks with `all_reduce`.

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

from cw_lens.core.accumulators import StackedSums, document_rows
from cw_lens.data.distributed import current_shard
from cw_lens.data.documents import Document
from cw_lens.data.inputs import TokenBatch, answer_spans, iter_batches, prepare_inputs
from cw_lens.models.capture import run_layers

HookSource = Sequence | Callable[[TokenBatch], Sequence]


@dataclass
class AnswerScores:
    """Per item: `logprob` of the whole answer and `correct` (greedy on every token)."""

    logprob: Float[Tensor, " item"]
    correct: Bool[Tensor, " item"]


def answer_positions(
    spans: Sequence[tuple[int, int]], device: torch.device | str
) -> tuple[Tensor, Tensor, Tensor]:
    """Every answer token of a batch, flat: `(row, predicting position, token position)`.

    Args:
        spans: Per row, the answer's token span `[start, end)`.
        device: Where the index tensors are made.

    Returns:
        Three int64 tensors of one entry per answer token.
    """
    rows = [r for r, (start, end) in enumerate(spans) for _ in range(start, end)]
    token_at = [t for start, end in spans for t in range(start, end)]
    row = torch.tensor(rows, dtype=torch.long, device=device)
    at = torch.tensor(token_at, dtype=torch.long, device=device)
    return row, at - 1, at


def answer_logprobs(
    logits: Float[Tensor, "batch pos vocab"], tokens: Tensor, spans: Sequence[tuple[int, int]]
) -> Float[Tensor, " batch"]:
    """Teacher-forced log-probability of each row's answer, on the logits' device.

    Differentiable, and one gather for the whole batch: `sum_t log p(a_t | prompt, a_<t)` over
    the answer tokens `tokens[row, start:end]`, each predicted from the position before it.

    Args:
        logits: One forward pass's logits.
        tokens: The batch's tokens `[batch, pos]`.
        spans: Per row, the answer's token span `[start, end)` (`start >= 1`).

    Returns:
        The answers' log-probabilities (float32).

    Examples:
        ```python
        import torch
        from cw_lens.data.scoring import answer_logprobs

        logits = torch.randn(2, 5, 11)
        tokens = torch.randint(0, 11, (2, 5))
        answer_logprobs(logits, tokens, [(3, 4), (2, 5)])  # one and three answer tokens
        ```
    """
    row, pos, at = answer_positions(spans, logits.device)
    picked = logits[row, pos].float()  # [answer tokens, vocab]
    targets = tokens.to(logits.device)[row, at]
    step = picked.gather(-1, targets[:, None])[:, 0] - torch.logsumexp(picked, dim=-1)
    out = torch.zeros(len(spans), device=logits.device, dtype=step.dtype)
    return out.index_add(0, row, step)


def score_answers(
    logits: Float[Tensor, "batch pos vocab"], tokens: Tensor, spans: Sequence[tuple[int, int]]
) -> AnswerScores:
    """Teacher-forced answer log-probability and greedy correctness from a forward's logits
    (one gather and one transfer per batch)."""
    row, pos, at = answer_positions(spans, logits.device)
    targets = tokens.to(logits.device)[row, at]
    wrong = (logits[row, pos].argmax(-1) != targets).long()
    n_wrong = torch.zeros(len(spans), dtype=torch.long, device=logits.device).index_add(
        0, row, wrong
    )
    logprob = answer_logprobs(logits, tokens, spans)
    return AnswerScores(logprob.cpu(), (n_wrong == 0).cpu())


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


# The statistics of the NLL sums (and of `corpus_nll`'s per-document record, `per_document=True`):
# the NLL summed over the scored positions and the number of positions scored.
NLL_SUMS = ("nll", "count")
# Rows (positions, over the whole batch) whose logsumexp is taken at a time: at least this many,
# and as many as fit `NLL_BLOCK_ELEMENTS` logits (a block of about 4 MB stays in cache).
NLL_ROWS = 32
NLL_BLOCK_ELEMENTS = 1 << 20


def log_normalisers(logits: Float[Tensor, "batch pos vocab"]) -> Float[Tensor, "batch pos"]:
    """`logsumexp` over the vocabulary of every position (float32), a block of rows at a time
    (`max(NLL_ROWS, NLL_BLOCK_ELEMENTS // vocab)` positions of the flattened batch; one block
    for a small vocabulary)."""
    n_batch, n_pos, n_vocab = logits.shape
    flat = logits.reshape(n_batch * n_pos, n_vocab)
    rows = max(NLL_ROWS, NLL_BLOCK_ELEMENTS // max(n_vocab, 1))
    if rows >= flat.shape[0]:
        return torch.logsumexp(flat.float(), dim=-1).view(n_batch, n_pos)
    out = torch.empty(flat.shape[0], device=logits.device)
    for start in range(0, flat.shape[0], rows):
        out[start : start + rows] = torch.logsumexp(flat[start : start + rows].float(), dim=-1)
    return out.view(n_batch, n_pos)


def _scored_positions(mask: Tensor, device: torch.device | str) -> Bool[Tensor, "batch pos"]:
    """Where token `t+1` is scored given `..t`: both are real tokens."""
    return (mask[:, 1:] & mask[:, :-1]).to(device)


def token_nll(
    logits: Float[Tensor, "batch pos vocab"], tokens: Tensor, mask: Tensor
) -> Float[Tensor, "batch pos_minus_1"]:
    """NLL of token `t+1` given `..t` at every position; NaN where either is padding."""
    targets = tokens[:, 1:].to(logits.device)
    # -log softmax(x)[t] = logsumexp(x) - x[t], the logsumexp over a block of rows at a time: the
    # [batch, pos, vocab] log-probabilities are never written (a block of rows stays in cache;
    # several times faster than log_softmax on a large vocabulary). The last position's
    # normaliser is taken too (one row per document) so that the logits need no copy.
    picked = logits[:, :-1].gather(-1, targets[..., None])[..., 0].float()
    nll = log_normalisers(logits)[:, :-1] - picked
    return nll.masked_fill(~_scored_positions(mask, logits.device), float("nan"))


def nll_rows(batch: TokenBatch, logits: Float[Tensor, "batch pos vocab"]) -> Tensor:
    """Each row's `NLL_SUMS`, `[batch, 2]`: its next-token NLL summed over the scored positions
    and their number (a NaN at a scored position stays in the sum: it is not dropped).

    Args:
        batch: The document batch.
        logits: Its logits.

    Returns:
        `[batch, 2]` float64 on the logits' device.
    """
    nll = token_nll(logits, batch.tokens, batch.mask)
    scored = _scored_positions(batch.mask, logits.device)
    return torch.stack([torch.where(scored, nll, 0.0).sum(-1), scored.sum(-1)], -1).double()


def nll_sums(n_documents: int | None = None, device: torch.device | str = "cpu") -> StackedSums:
    """Empty NLL sums (`NLL_SUMS`), with each document's own when `n_documents` is given.

    Args:
        n_documents: Documents of the corpus, for the per-document record (`None`: none).
        device: Where the sums live (the model's device).

    Returns:
        A `StackedSums` of shape `()` to add `nll_rows` to.
    """
    return StackedSums(NLL_SUMS, (), n_documents=n_documents, device=device)


@dataclass
class NLLResult:
    """Next-token NLL sums (float64 `StackedSums` of `NLL_SUMS`); `mean_nll` and `ppl` over all
    scored positions: `mean_nll = sum of NLL / number of scored positions`, `ppl = exp(mean_nll)`.

    With a per-document record (`corpus_nll(..., per_document=True)`), `document_table()` is
    each document's `(NLL sum, count)`.
    """

    sums: StackedSums

    @property
    def mean_nll(self) -> float:
        total = self.sums.total.cpu()
        return float(total[0] / total[1])

    @property
    def ppl(self) -> float:
        return float(torch.exp(torch.tensor(self.mean_nll, dtype=torch.float64, device="cpu")))

    def document_table(self) -> Float[Tensor, "document 2"] | None:
        """Each document's `(NLL sum, count)` in document order.

        Returns:
            `[document, 2]` float64, or None without a per-document record.
        """
        if self.sums.per_document is None:
            return None
        return self.sums.document_table()

    def merge(self, other: NLLResult) -> None:
        """Add another shard's sums.

        Args:
            other: The NLL sums of another shard.
        """
        self.sums.merge(other.sums)

    def add_batch(self, batch: TokenBatch, logits: Tensor) -> None:
        """Add one document batch's next-token NLL sums and counts, from its logits (one `add`).

        Args:
            batch: The document batch.
            logits: Its logits `[batch, pos, vocab]`.
        """
        self.sums.add(nll_rows(batch, logits), document_rows(batch.documents, logits.device))

    def all_reduce(self) -> None:
        """Sum every torchrun rank's sums in place (collectives; a no-op outside a group)."""
        self.sums.all_reduce()

    def to_host(self) -> NLLResult:
        """Bring what was accumulated on the model's device to the host.

        Returns:
            This result.
        """
        self.sums.to_host()
        return self


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
    """Mean next-token NLL of a corpus, optionally under interventions (sharded under torchrun,
    the ranks' sums then summed with `all_reduce`); `per_document=True` also keeps each
    document's NLL sum and count (16 bytes per document)."""
    prepared = prepare_inputs(model, corpus, prepend_bos=prepend_bos)
    batches = list(iter_batches(prepared, batch_size))
    shard = current_shard()
    if shard is not None:
        batches = batches[shard[0] :: shard[1]]
    n_documents = prepared.tokens.shape[0] if per_document else None
    result = NLLResult(nll_sums(n_documents, model.cfg.device))
    with torch.inference_mode():
        for batch in batches:
            result.add_batch(batch, run_logits(model, batch, hooks))
    result.all_reduce()
    return result.to_host()
