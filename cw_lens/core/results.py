"""The result protocol: what every object an analysis returns answers to.

Every public result class ([`ContributionResult`][cw_lens.ContributionResult],
[`SinkStatisticsResult`][cw_lens.SinkStatisticsResult], [`RolloutResult`][cw_lens.RolloutResult],
...; each name ends in `Result`) derives from [`Result`][cw_lens.Result], so the same few calls work
on all of them:

    cw = cw_lens.contribution_weights(model, text, layers=[10, 20])
    cw                   # ContributionResult(model_name='...', layers=[10, 20], ...) one line
    cw.summary()         # a pandas DataFrame, always
    cw.to_dataframe()    # the full tidy table
    cw.plot()            # the figure (where the result has one)
    cw.layer(20)         # the same result restricted to layer 20 (by layer NUMBER)
    cw.top(5)            # the 5 largest rows (k first; every other argument by keyword)
    cw.save("cw.safetensors"); cw_lens.load_result("cw.safetensors")   # a file, no pickle

A result holds numbers and per-document tables; which of the papers' claims they support is
judged above the toolkit, by `cw_lens.reproduction.claims(result)`.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence
from typing import Any, ClassVar

import pandas as pd
from jaxtyping import Bool
from torch import Tensor

from cw_lens.core.errors import InputError
from cw_lens.core.keywords import check_keywords
from cw_lens.core.loading import read_file
from cw_lens.core.registry import class_name
from cw_lens.core.saving import write_file

_REPR_LIMIT = 380


def _short(value: Any) -> str:
    """A value for a repr: shapes, lengths and type names — never tensor or table contents."""
    shape = getattr(value, "shape", None)
    if shape is not None and not isinstance(value, (int, float, str)):
        dims = "x".join(str(int(d)) for d in shape) if len(shape) else "scalar"
        if isinstance(value, pd.DataFrame):
            return f"DataFrame[{dims}]"
        dtype = str(getattr(value, "dtype", "")).replace("torch.", "")
        return f"{type(value).__name__}[{dims}] {dtype}".rstrip()
    if isinstance(value, str):
        return repr(value if len(value) <= 40 else value[:37] + "...")
    if value is None or isinstance(value, (bool, int, float)):
        return repr(value)
    if isinstance(value, (list, tuple)):
        if len(value) <= 8 and all(isinstance(v, (int, float, str)) for v in value):
            text = repr(value)
            if len(text) <= 60:
                return text
        return f"{type(value).__name__}(len {len(value)})"
    if isinstance(value, dict):
        return f"dict(len {len(value)})"
    return type(value).__name__


class Result:
    """Base of every public result: one protocol for all analyses.

    - `repr(result)`: one short line — the class, the model, the layers, the shape of every
      tensor and the size of every table; never their contents (a notebook cell ending with a
      result prints one line). Jupyter and IPython show the same line.
    - `result.summary()`: a `pandas.DataFrame`, for every result: the headline numbers
      (one row, or one row per group such as a ranking or a layer). Results whose summary was a
      dict or a string in 0.2 keep it as `summary_dict()` / `summary_text()`.
    - `result.to_dataframe()`: the full tidy table behind the result.
    - `result.plot(...)`: the result's figure (a matplotlib `Figure`), where it has one.
    - `result.layer(n)`: for results over a subset of layers (`layers=[10, 20]`), the same
      result restricted to layer NUMBER `n` (`layers == [n]`, the layer axis kept with size
      1); `result.layer_index(n)` is that layer's position on the layer axis. A layer that is
      not in the result raises [`InputError`][cw_lens.InputError] naming the layers it has. It
      is a result for every class (the sink statistics and the sink ablation included): the
      table of one layer is `result.layer(n).to_dataframe()`.
    - `result.top(k=10, ...)`: the `k` largest rows of what the result ranks; `k` comes first
      (by position or keyword) and every other argument is keyword-only, in every result.
    - `result.save(path)`: one safetensors file (no pickle) that
      [`cw_lens.load_result`][cw_lens.load_result] reads back into an equal result.

    Subclasses that support `layer` hold the layer numbers in `layers` and list their
    layer-axis fields in `_layer_axes` (`((field name, axis), ...)`; `()` when `layers`
    alone selects, e.g. tables keyed by layer number).
    """

    _layer_axes: ClassVar[tuple[tuple[str, int], ...] | None] = None

    # ----------------------------------------------------------------- repr
    def _repr_items(self) -> list[tuple[str, Any]]:
        """The (name, value) pairs the repr describes: the dataclass fields shown by `repr`
        (or the public attributes), the model name and layers first."""
        if dataclasses.is_dataclass(self):
            items = [(f.name, getattr(self, f.name)) for f in dataclasses.fields(self) if f.repr]
        else:
            items = [(k, v) for k, v in vars(self).items() if not k.startswith("_")]
        first = {"model_name": 0, "model": 0, "architecture": 0, "layers": 1, "layer": 1}
        return sorted(items, key=lambda kv: first.get(kv[0], 2))

    def __repr__(self) -> str:
        parts = [f"{name}={_short(value)}" for name, value in self._repr_items()]
        text = f"{type(self).__name__}({', '.join(parts)})"
        if len(text) > _REPR_LIMIT:
            text = text[: _REPR_LIMIT - 4] + " ...)"
        return text

    def _repr_pretty_(self, printer: Any, cycle: bool) -> None:
        printer.text(repr(self))

    # ----------------------------------------------------------------- summary
    def summary(self) -> pd.DataFrame:
        """The headline numbers as a DataFrame.

        Returns:
            `summary_dict()` as one row, or the repr's fields when the result has no headline
            numbers.

        Examples:
            ```python
            import cw_lens

            model = cw_lens.load_model("testing:tiny-llama")
            corpus = cw_lens.load_corpus(n_docs=2, max_tokens=16, model=model)
            stats = cw_lens.sink_statistics(model, corpus, progress=False)
            stats.summary()
            ```
        """
        summary_dict = getattr(self, "summary_dict", None)
        if summary_dict is not None:
            return dict_frame(summary_dict())
        return dict_frame({name: _short(value) for name, value in self._repr_items()})

    # ----------------------------------------------------------------- layers
    def layer_index(self, layer: int) -> int:
        """The position of layer NUMBER `layer` on this result's layer axis.

        Args:
            layer: A layer number of the result (`layers`); any other raises
                [`InputError`][cw_lens.InputError].

        Returns:
            The index into the layer axis.

        Examples:
            ```python
            import cw_lens

            model = cw_lens.load_model("testing:tiny-llama")
            cw = cw_lens.contribution_weights(model, "The cat sat on the mat.", layers=[1])
            cw.layer_index(1)  # 0: layer 1 is the first (and only) layer of the result
            ```
        """
        layers = list(getattr(self, "layers", None) or [])
        if isinstance(layer, bool) or not isinstance(layer, int) or layer not in layers:
            raise InputError(
                f"Layer {layer!r} is not in this {type(self).__name__} (its layers: {layers}); "
                "pass one of those layer numbers, or compute the result with layers=[...]"
                " including it."
            )
        return layers.index(layer)

    def layer(self, layer: int) -> Result:
        """The same result restricted to layer NUMBER `layer`.

        Args:
            layer: A layer number of the result (`layers`).

        Returns:
            A result of the same class with `layers == [layer]`; every layer-axis field keeps its
            axis, with size 1.

        Examples:
            ```python
            import cw_lens

            model = cw_lens.load_model("testing:tiny-llama")
            cw = cw_lens.contribution_weights(model, "The cat sat on the mat.")
            cw.layer(1).weights.shape  # [batch, 1, head, query, key]
            ```
        """
        if self._layer_axes is None:
            raise InputError(f"{type(self).__name__} has no layer axis to select from.")
        i = self.layer_index(layer)
        fields = {name: _take(getattr(self, name), axis, i) for name, axis in self._layer_axes}
        return dataclasses.replace(self, layers=[layer], **fields)  # type: ignore[type-var]

    def _layer_rows(self, table: pd.DataFrame, layer: int) -> pd.DataFrame:
        """The rows of `table` (its `layer` column holds layer numbers) of layer NUMBER
        `layer`, numbered from 0; a layer not in `layers` raises
        [`InputError`][cw_lens.InputError]."""
        self.layer_index(layer)
        return table[table["layer"] == layer].reset_index(drop=True)

    # ----------------------------------------------------------------- saving
    def save(self, path: str | os.PathLike[str]) -> None:
        """Write this result to one file, read back by `cw_lens.load_result(path)`.

        The file is a safetensors file: the tensors (and numeric arrays and DataFrame
        columns) as its tensors, everything else as JSON in its metadata, with a format
        version (`cw_lens.core.saving` describes the format). No pickle: loading runs no code
        from the file, and builds only classes cw_lens registered. The loaded result equals
        this one field by field.

        Args:
            path: The file to write (conventionally `*.safetensors`); an existing file is
                replaced.

        Raises:
            InputError: when a field holds a value the format cannot store (the message
                names the field).

        Examples:
            >>> import tempfile, pathlib
            >>> import cw_lens
            >>> model = cw_lens.load_model("testing:tiny-llama")
            >>> rollout = cw_lens.contribution_rollout(model, "Save me, then load me.")
            >>> path = pathlib.Path(tempfile.mkdtemp()) / "rollout.safetensors"
            >>> rollout.save(path)
            >>> cw_lens.load_result(path).top(k=2).equals(rollout.top(k=2))
            True
        """
        save_result(self, path)


def save_result(result: Result, path: str | os.PathLike[str]) -> None:
    """Write `result` (a [`Result`][cw_lens.Result]) to `path` (`cw_lens.core.saving` gives the
    format).

    Args:
        result: Any public cw_lens result.
        path: The file to write (conventionally ending in `.safetensors`); its folder must
            exist, and an existing file is replaced.

    Raises:
        InputError: when a field holds a value the format cannot store (a function, an
            object of another library); the message names the field.

    Examples:
        >>> import tempfile, pathlib
        >>> import cw_lens
        >>> from cw_lens.core.results import save_result
        >>> model = cw_lens.load_model("testing:tiny-llama")
        >>> shares = cw_lens.residual_shares(model, "A short text.", layers=[0])
        >>> save_result(shares, pathlib.Path(tempfile.mkdtemp()) / "shares.safetensors")
    """
    if not isinstance(result, Result):
        raise InputError(f"save_result saves cw_lens results, got a {type(result).__name__}.")
    write_file(result, path, **{"class": class_name(type(result))})


@check_keywords
def load_result(path: str | os.PathLike[str]) -> Result:
    """Load a result written by `result.save(path)`.

    The result comes back as the class that was saved, every field equal to the saved one;
    tensors are on the CPU (move them with `.to(device)` where needed). No code is run from
    the file: it holds tensors and JSON, never pickles, and the only classes it can name are
    the ones cw_lens registered (its results and the values their fields hold), checked
    before anything is built. A result file from someone else is safe to open.

    Args:
        path: A file written by [`Result.save`][cw_lens.Result.save].

    Returns:
        The result ([`ContributionResult`][cw_lens.ContributionResult],
        [`SinkStatisticsResult`][cw_lens.SinkStatisticsResult], ...).

    Raises:
        FileNotFoundError: when `path` does not exist.
        InputError: when the file is not a cw_lens result, was written by a later format
            version (upgrade cw_lens), names a class this cw_lens does not read, or is
            damaged.

    Examples:
        >>> import tempfile, pathlib
        >>> import cw_lens
        >>> model = cw_lens.load_model("testing:tiny-llama")
        >>> stats = cw_lens.sink_statistics(model, ["A first text.", "And a second one."],
        ...                                 min_query=2, progress=False)
        >>> path = pathlib.Path(tempfile.mkdtemp()) / "stats.safetensors"
        >>> stats.save(path)
        >>> again = cw_lens.load_result(path)
        >>> again.heads().equals(stats.heads())
        True
    """
    value = read_file(path)
    if not isinstance(value, Result):
        raise InputError(f"{str(path)!r} holds a {type(value).__name__}, not a cw_lens result.")
    return value


def _take(value: Any, axis: int, index: int) -> Any:
    if hasattr(value, "narrow"):
        return value.narrow(axis, index, 1)
    if isinstance(value, Sequence):
        return [value[index]]
    raise TypeError(f"cannot select a layer from a {type(value).__name__}")


def check_batch_row(mask: Bool[Tensor, "batch pos"], batch: int) -> int:
    """Check a batch row index of a result whose real positions are `mask`."""
    n_batch = mask.shape[0]
    if isinstance(batch, bool) or not isinstance(batch, int) or not 0 <= batch < n_batch:
        raise InputError(f"batch must be a row index in 0..{n_batch - 1}, got {batch!r}.")
    return batch


def resolve_row(mask: Bool[Tensor, "batch pos"], batch: int, query: int | None) -> tuple[int, int]:
    """Check a batch row and a query position (`None`: the last real token; negative
    counts from the end of the row's real tokens)."""
    check_batch_row(mask, batch)
    n = int(mask[batch].sum())
    q = n - 1 if query is None else (query + n if query < 0 else query)
    if not 0 <= q < n:
        raise InputError(f"Query {query} is outside the {n} real positions of row {batch}.")
    return batch, q


def dict_frame(values: dict[str, Any]) -> pd.DataFrame:
    """A dict of headline numbers as a one-row DataFrame (lists and dicts kept as cells)."""
    return pd.DataFrame([{k: v for k, v in values.items()}])
