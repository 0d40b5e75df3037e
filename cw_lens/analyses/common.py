"""What several analyses share: argument checks, the query-to-KV head map and JSON rounding.

Moved here from `selection` so that sibling analyses (selection, taxonomy, pruning) import a
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


def check_count(value: Any, name: str, *, minimum: int = 1, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
        kind = "a positive integer" if minimum == 1 else f"an integer >= {minimum}"
        raise InputError(f"{name} must be {kind}{' or None' if allow_none else ''}, got {value!r}.")


def check_sinks(
    sink_positions: Sequence[int],
    *,
    model: Any = None,
    inputs: Any = None,
    prepend_bos: bool = True,
) -> tuple[int, ...]:
    """The sorted, de-duplicated sink positions, checked.

    Args:
        sink_positions: Non-negative positions (usually `(0,)`, the BOS token).
        model: With `inputs`, also check that every position is a token of every document
            (`check_sinks_inside`).
        inputs: The texts, corpus or token ids the analysis reads.
        prepend_bos: Whether BOS is prepended to text.

    Returns:
        The positions as a sorted tuple.

    Raises:
        InputError: for an empty list, a negative or non-integer position, or (with
            `model` and `inputs`) a position beyond a document.

    Examples:
        >>> from cw_lens.analyses.common import check_sinks
        >>> check_sinks([3, 0, 3])
        (0, 3)
    """
    sinks = tuple(sorted({int(p) for p in sink_positions})) if sink_positions else ()
    bad = [p for p in sink_positions or () if isinstance(p, bool) or int(p) != p]
    if not sinks or bad or min(sinks) < 0:
        raise InputError(
            f"sink_positions must be a non-empty list of non-negative positions (usually (0,), "
            f"the BOS token), got {sink_positions!r}."
        )
    if model is not None and inputs is not None:
        check_sinks_inside(model, inputs, sinks, prepend_bos=prepend_bos)
    return sinks


def check_sinks_inside(
    model: Any, inputs: Any, sinks: Sequence[int], *, prepend_bos: bool = True
) -> None:
    """Refuse sink positions that lie beyond a document.

    A sink position counts from each document's first token (BOS, when prepended, is
    position 0). Documents of a batch are right-padded, so padding never shifts a position;
    but a position is only a sink where it is a real token, and a position at or past a
    document's length would leave that document without its sink (its sink numbers NaN). So
    every given position must be a token of every document.

    Args:
        model: The model (its tokenizer counts the tokens).
        inputs: The texts, corpus or token ids the analysis reads.
        sinks: The sink positions (non-negative, checked by `check_sinks`).
        prepend_bos: Whether BOS is prepended (it is position 0 and counts in the length).

    Raises:
        InputError: naming the first document too short for the largest position, its
            length, and how many documents are too short.

    Examples:
        >>> from cw_lens.analyses.common import check_sinks_inside
        >>> from cw_lens.core.errors import InputError
        >>> from cw_lens.models.testing import tiny_llama
        >>> model = tiny_llama()
        >>> check_sinks_inside(model, ["one two three"], [0, 1])
        >>> try:
        ...     check_sinks_inside(model, ["one two three", "one"], [100])
        ... except InputError as error:
        ...     print(str(error).split(";")[0])
        sink_positions=[100] lies beyond document 0, which has 14 tokens (positions 0..13)
    """
    from cw_lens.data.inputs import prepare_inputs

    last = max(sinks, default=0)
    if last == 0:  # position 0 is in every document
        return
    lengths = prepare_inputs(model, inputs, prepend_bos=prepend_bos).lengths.tolist()
    short = [(doc, n) for doc, n in enumerate(lengths) if n <= last]
    if not short:
        return
    doc, n = short[0]
    if len(lengths) == 1:
        where = f"the text, which has {n} tokens (positions 0..{n - 1})"
    else:
        low = min(range(len(lengths)), key=lengths.__getitem__)
        where = (
            f"document {doc}, which has {n} tokens (positions 0..{n - 1}); {len(short)} of the "
            f"{len(lengths)} documents are too short for position {last} (the shortest, "
            f"document {low}, has {lengths[low]} tokens)"
        )
    raise InputError(
        f"sink_positions={sorted(sinks)} lies beyond {where}. Sink positions count from each "
        "document's first token (BOS is 0) and padding never shifts them, so each must be a "
        f"token of every document: pass positions below {min(lengths)}, or longer documents."
    )


def kv_of_heads(n_heads: int, n_kv: int, device: Any) -> Tensor:
    return torch.arange(n_heads, device=device) // (n_heads // n_kv)


def rounded_dict(series: pd.Series) -> dict[Any, float]:
    """A series as a JSON-ready dict (plain keys, floats rounded to 4 digits)."""
    return {k.item() if hasattr(k, "item") else k: round(float(v), 4) for k, v in series.items()}
