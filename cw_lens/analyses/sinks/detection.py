"""Sink positions (given, or detected from the attention) and the queries after a sink."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar, Literal

import torch
from jaxtyping import Bool
from torch import Tensor

from cw_lens.analyses.common import check_sinks_inside
from cw_lens.core.accumulators import Accumulator, document_rows
from cw_lens.core.errors import InputError
from cw_lens.core.keywords import check_keywords
from cw_lens.core.registry import saveable
from cw_lens.data.documents import as_corpus
from cw_lens.data.inputs import TokenBatch
from cw_lens.data.streaming import stream_corpus
from cw_lens.models.access import Model
from cw_lens.models.capture import resolve_layers
from cw_lens.models.layer_contributions import LayerContributionsResult

SINK_RATE_THRESHOLD = 0.3
MIN_QUERY = 16


SinkPositions = Sequence[int] | Literal["detect"]


# --------------------------------------------------------------------------- sink positions


@saveable
class SinkSpec:
    """Sink positions per document: the same tuple for all, or one tuple per document."""

    stored_fields: ClassVar[dict[str, Any]] = {
        "per_doc": dict[int, tuple[int, ...]],
        "default": tuple[int, ...] | None,
    }

    def __init__(self, positions: Sequence[int] | dict[int, Sequence[int]]) -> None:
        if isinstance(positions, str):
            raise InputError(
                f"sink_positions must be positions such as (0,) or 'detect', got {positions!r}."
            )
        if isinstance(positions, dict):
            self.per_doc = {
                int(d): tuple(sorted(int(p) for p in ps)) for d, ps in positions.items()
            }
            self.default: tuple[int, ...] | None = None
        else:
            ps = tuple(sorted({int(p) for p in positions}))
            if not ps or min(ps) < 0:
                raise InputError(f"sink_positions must be non-negative positions, got {positions}.")
            self.per_doc, self.default = {}, ps

    def positions(self, doc: int) -> tuple[int, ...]:
        return self.per_doc.get(doc, self.default or ())

    def mask(self, batch: TokenBatch, device: torch.device) -> Bool[Tensor, "batch pos"]:
        n_pos = batch.tokens.shape[1]
        mask = torch.zeros(len(batch.documents), n_pos, dtype=torch.bool, device="cpu")
        for row, doc in enumerate(batch.documents):
            ps = [p for p in self.positions(doc) if p < int(batch.lengths[row])]
            mask[row, ps] = True
        return mask.to(device)

    def describe(self) -> str:
        if self.default is not None:
            return ",".join(map(str, self.default))
        return "detected per document"


def resolve_sinks(model: Any, corpus: Any, sink_positions: Any, **kw: Any) -> SinkSpec:
    if isinstance(sink_positions, SinkSpec):
        return sink_positions
    if isinstance(sink_positions, str):
        if sink_positions != "detect":
            raise InputError(
                f"sink_positions must be positions or 'detect', got {sink_positions!r}"
            )
        return SinkSpec(dict(enumerate(detect_sinks(model, corpus, **kw))))
    spec = SinkSpec(sink_positions)
    check_sinks_inside(model, corpus, spec.default or (), prepend_bos=kw.get("prepend_bos", True))
    return spec


def queries_after_sink(
    lc: LayerContributionsResult, sink_full: Bool[Tensor, "batch pos"]
) -> Tensor:
    """Queries of this block that count: real, not a sink, after the row's first sink."""
    qpos = lc.query_positions
    none = lc.keys.stop + 10**6
    first_sink = torch.where(sink_full.any(1), sink_full.float().argmax(1), none)
    return lc.query_mask & ~sink_full[:, lc.queries] & (qpos[None, :] > first_sink[:, None])


class _MaxAttention(Accumulator):
    """Per document: the keys whose max over (layer, head) of the mean attention from later
    queries exceeds `threshold`.

    Only keys read by at least `min_later` later (real) queries are candidates: near the end
    of a document a previous-token head alone would put a key over any threshold. Per
    document and key, the running max over the layers lives in `best` (`[document, key]` on
    the device, updated with one `index_copy_` per layer: a document lies in one batch);
    `finish` reads the positions from it on the host, once.

    Args:
        model: The model (its device).
        corpus: The corpus (its number of documents).
        layers: The layers whose heads count.
        min_later: Only keys that at least this many later queries read are candidates.
        threshold: The mean attention from later queries a sink exceeds.
    """

    name = "detect_sinks"

    def __init__(
        self, model: Model, corpus: Any, layers: list[int], min_later: int, threshold: float
    ) -> None:
        self.layers, self.min_later, self.threshold = layers, min_later, threshold
        with torch.inference_mode(False):
            self.best = torch.zeros(len(as_corpus(corpus)), 1, device=model.cfg.device)

    def update(self, block: LayerContributionsResult) -> None:
        if block.queries.start != 0:
            return
        acts = block.acts
        n_pos = acts.pattern.shape[-1]
        if self.best.shape[1] < n_pos:  # the widest batch so far (once per width)
            grown = self.best.new_zeros(self.best.shape[0], n_pos)
            grown[:, : self.best.shape[1]] = self.best
            self.best = grown
        later = torch.ones(n_pos, n_pos, dtype=torch.bool, device=acts.mask.device).tril(-1)
        real = acts.mask[:, :, None] & acts.mask[:, None, :]
        weight = (later & real).to(acts.pattern.dtype)  # [batch, query, key]
        n_later = weight.sum(1)  # [batch, key]
        mean = (acts.pattern * weight[:, None]).sum(2) / n_later[:, None].clamp_min(1)
        best = mean.amax(1).masked_fill(n_later < self.min_later, 0.0)  # [batch, key]
        docs = document_rows(block.batch.documents, best.device)
        seen = self.best[:, :n_pos]  # each document lies in one batch: no duplicate rows
        seen.index_copy_(0, docs, torch.maximum(seen.index_select(0, docs), best.float()))

    def merge(self, other: _MaxAttention) -> None:
        width = max(self.best.shape[1], other.best.shape[1])
        theirs = _padded(other, width).to(self.best.device)
        self.best = torch.maximum(_padded(self, width), theirs)

    def all_reduce(self) -> None:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            width = torch.tensor([self.best.shape[1]], device=self.best.device)
            dist.all_reduce(width, op=dist.ReduceOp.MAX)
            self.best = _padded(self, int(width))
            dist.all_reduce(self.best, op=dist.ReduceOp.MAX)

    def finish(self, stats: Any) -> list[tuple[int, ...]]:
        """The sink positions of every document (its BOS included, as the pass saw it).

        Args:
            stats: The pass's `StreamStats` (unused).

        Returns:
            One tuple of positions per document.
        """
        above = (self.best > self.threshold).cpu()
        return [tuple(above[d].nonzero().flatten().tolist()) for d in range(above.shape[0])]


def _padded(acc: _MaxAttention, width: int) -> Tensor:
    """`acc.best` padded with zeros to `width` keys."""
    out = acc.best.new_zeros(acc.best.shape[0], width)
    out[:, : acc.best.shape[1]] = acc.best
    return out


@check_keywords
def detect_sinks(
    model: Model,
    corpus: Any,
    *,
    threshold: float = SINK_RATE_THRESHOLD,
    min_later: int = MIN_QUERY,
    layers: Any = None,
    batch_size: int | None = 8,
    prepend_bos: bool = True,
) -> list[tuple[int, ...]]:
    """Sink positions per document: keys whose mean attention from later queries exceeds
    `threshold` (0.3) in at least one head (of the given layers). Only keys that at least
    `min_later` (16) later queries read are candidates, so the last positions of a document
    are never sinks. [`sink_statistics`][cw_lens.sink_statistics] and
    [`sink_rates`][cw_lens.sink_rates] run it (with these defaults) for
    `sink_positions="detect"`.

    Args:
        model: A TransformerLens model.
        corpus: What [`cw_lens.load_corpus`][cw_lens.load_corpus] returns, a string, a list of
            strings, or token ids (a tensor `[pos]` or `[batch, pos]`, or a list of token-id
            lists, read as given).
        threshold: The mean attention from later queries a sink exceeds.
        min_later: Only keys that at least `min_later` later queries read are candidates.
        layers: Layers whose heads count (`None` = all).
        batch_size: Documents per forward pass.
        prepend_bos: Prepend BOS to text.

    Returns:
        One tuple of sink positions per document.

    Examples:
        ```python
        import cw_lens

        model = cw_lens.load_model("testing:tiny-llama")
        corpus = cw_lens.load_corpus(n_docs=2, max_tokens=16, model=model)
        cw_lens.detect_sinks(model, corpus, min_later=4)  # e.g. [(0,), (0,)]
        ```
    """
    if min_later < 1:
        raise InputError(f"min_later must be at least 1, got {min_later}.")
    layer_list = resolve_layers(model, layers)
    acc = _MaxAttention(model, corpus, layer_list, min_later, threshold)
    stats, _ = stream_corpus(model, corpus, [acc], batch_size=batch_size, prepend_bos=prepend_bos)
    return acc.finish(stats)
