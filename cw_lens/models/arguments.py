"""The model, layers and heads arguments of the analyses: checked and normalised.

`api_of` says which TransformerLens API a model is (a `TransformerBridge` or a
`HookedTransformer`); `check_model` refuses a model name, `None` or any other object where a
loaded model is needed; `resolve_layers` and `resolve_heads` turn a selection (`None` = all, one
index or several, negative indices counting from the end) into sorted, de-duplicated indices.
`cw_lens.models.access` builds its model access on them and exports them.
"""

from __future__ import annotations

import os
from typing import Any, Literal

import numpy as np
import torch

from cw_lens.core.errors import InputError, UnsupportedModelError

Api = Literal["bridge", "hooked"]


def api_of(model: Any) -> Api | None:
    """`"bridge"` for a `TransformerBridge`, `"hooked"` for a `HookedTransformer`."""
    try:
        from transformer_lens.model_bridge import TransformerBridge

        if isinstance(model, TransformerBridge):
            return "bridge"
    except ImportError:  # TransformerLens 2.x has no bridge
        pass
    try:
        from transformer_lens import HookedTransformer

        if isinstance(model, HookedTransformer):
            return "hooked"
    except ImportError:  # TransformerLens 4.x has no HookedTransformer
        pass
    return None


def check_model(model: Any) -> None:
    """Refuse a model name, `None` or another object where a loaded model is needed.

    Every analysis reaches its model through `model_access` (and `verify_model`), which call
    this first: a string such as `"gpt2"` is a name to load, not a model.

    Args:
        model: What was passed as the model.

    Raises:
        InputError: when `model` is a string, a path or `None`; the message shows the
            `cw_lens.load_model(...)` call that loads it.
        UnsupportedModelError: when `model` is neither a `TransformerBridge` nor a
            `HookedTransformer`.

    Examples:
        >>> from cw_lens.core.errors import InputError
        >>> from cw_lens.models.access import check_model
        >>> try:
        ...     check_model("gpt2")
        ... except InputError as error:
        ...     print(str(error).split(": ", 1)[1])
        load it first: `model = cw_lens.load_model('gpt2')`, then pass `model`.
    """
    if model is None:
        raise InputError(
            "The model is None: load it first: `model = cw_lens.load_model()` (the embedded "
            "SmolLM2-135M) or `model = cw_lens.load_model('gpt2')` (any name or path), then "
            "pass `model`."
        )
    if isinstance(model, (str, os.PathLike)):
        name = os.fspath(model)
        raise InputError(
            f"The model is the {'string' if isinstance(model, str) else 'path'} {name!r}, not a "
            f"loaded model: load it first: `model = cw_lens.load_model({name!r})`, then pass "
            "`model`."
        )
    if api_of(model) is None:
        raise UnsupportedModelError(
            f"cw_lens analyses TransformerLens models; got {type(model).__name__}. Load a "
            "TransformerBridge with cw_lens.load_model(...) (or "
            "TransformerBridge.boot_transformers(...)), or pass a HookedTransformer."
        )


def _resolve_indices(values: Any, n: int, what: str, unit: str) -> list[int]:
    """Normalise an index selection (`None` = all; negative counts from the end)."""
    if values is None:
        return list(range(n))
    if isinstance(values, (int, np.integer)) or (
        isinstance(values, torch.Tensor) and values.ndim == 0
    ):
        values = [values]
    try:
        values = list(values)
    except TypeError:
        raise InputError(
            f"{what.capitalize()}s must be an integer or a list of integers, got {values!r}."
        ) from None
    out = []
    for value in values:
        if isinstance(value, torch.Tensor) and value.ndim == 0:
            value = value.item()
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
            raise InputError(f"{what.capitalize()}s must be integers, got {value!r}.")
        value = int(value)
        if not -n <= value < n:
            raise InputError(
                f"{what.capitalize()} {value} is out of range: this model has {n} {unit} "
                f"(0..{n - 1})."
            )
        out.append(value % n)
    if not out:
        raise InputError(f"The {what} selection is empty; pass {what}s=None for all {what}s.")
    return sorted(set(out))


def resolve_layers(model: Any, layers: Any) -> list[int]:
    """Normalise a layer selection (`None` = all; negative indices count from the end)."""
    check_model(model)
    return _resolve_indices(layers, int(model.cfg.n_layers), "layer", "layers")


def resolve_heads(model: Any, heads: Any) -> list[int]:
    """Normalise a head selection like a layer selection.

    Args:
        model: The model (its `cfg.n_heads` query heads per layer).
        heads: `None` (all query heads), one index or a list of them; a negative index
            counts from the end, as in Python and as for `layers`: `-1` is the last head,
            `n_heads - 1`.

    Returns:
        The sorted, de-duplicated head indices, each in `0 .. n_heads - 1`.

    Raises:
        InputError: for an index outside `-n_heads .. n_heads - 1`, a non-integer or an
            empty list.

    Examples:
        >>> from cw_lens.models.access import resolve_heads
        >>> from cw_lens.models.testing import tiny_llama
        >>> model = tiny_llama()
        >>> model.cfg.n_heads, resolve_heads(model, -1), resolve_heads(model, [0, -1])
        (4, [3], [0, 3])
    """
    check_model(model)
    return _resolve_indices(heads, int(model.cfg.n_heads), "head", "query heads per layer")
