"""What several analyses share: argument checks, the query-to-KV head map, JSON rounding, and
the streaming of a corpus into per-layer exact sums.

Moved here from ``selection`` so that sibling analyses (selection, taxonomy, pruning) import a
lower module rather than each other.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import pandas as pd
import torch
from torch import Tensor

from cw_lens.core.errors import InputError
from cw_lens.data.streaming import stream_corpus


def check_count(value: Any, name: str, *, minimum: int = 1, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
        kind = "a positive integer" if minimum == 1 else f"an integer >= {minimum}"
        raise InputError(f"{name} must be {kind}{' or None' if allow_none else ''}, got {value!r}.")


def check_sinks(sink_positions: Sequence[int]) -> tuple[int, ...]:
    sinks = tuple(sorted({int(p) for p in sink_positions})) if sink_positions else ()
    bad = [p for p in sink_positions or () if isinstance(p, bool) or int(p) != p]
    if not sinks or bad or min(sinks) < 0:
        raise InputError(
            f"sink_positions must be a non-empty list of non-negative positions (usually (0,), "
            f"the BOS token), got {sink_positions!r}."
        )
    return sinks


def kv_of_heads(n_heads: int, n_kv: int, device: Any) -> Tensor:
    return torch.arange(n_heads, device=device) // (n_heads // n_kv)


def rounded_dict(series: pd.Series) -> dict[Any, float]:
    """A series as a JSON-ready dict (plain keys, floats rounded to 4 digits)."""
    return {k.item() if hasattr(k, "item") else k: round(float(v), 4) for k, v in series.items()}


def stream_layer_sums(
    model: Any,
    docs: Any,
    accumulator: Any,
    layers: list[int],
    *,
    record: str,
    batch_size: int | None,
    prepend_bos: bool,
    progress: bool | str,
) -> tuple[Tensor, Any, int]:
    """Stream ``docs`` into ``accumulator`` (:func:`~cw_lens.data.streaming.stream_corpus`,
    sharded and merged under torchrun); its ``sums`` (exact sums keyed ``layer{n}``) and
    ``per_doc`` (an opt-in per-document record, or ``None``).

    Returns the sums stacked over ``layers`` ``[layer, ...]``, the per-document table of field
    ``record`` (``None`` when not recorded) and the number of documents streamed.
    """
    accumulator, stats = stream_corpus(
        model,
        docs,
        accumulator,
        layers=layers,
        batch_size=batch_size,
        prepend_bos=prepend_bos,
        progress=progress,
    )
    sums = torch.stack([accumulator.sums.total(f"layer{layer}") for layer in layers])
    per_document = None if accumulator.per_doc is None else accumulator.per_doc.table(record)
    return sums, per_document, stats.n_documents
