"""The file format of results and of the main job's stored steps: safetensors plus JSON.

Every public result (every subclass of [`Result`][cw_lens.Result]) saves to one
[safetensors](https://huggingface.co/docs/safetensors) file with `result.save(path)` and loads
back with `cw_lens.load_result(path)` into an equal object of the same class: every field equal
bit for bit, its helpers (`to_dataframe()`, `top()`, `claims()`, ...) working as before. The
main job stores each step's value in the same format.

Loading runs no code from the file. Nothing is pickled; the only classes a file can name are
the ones cw_lens registered (`cw_lens.core.registry`: the result classes and the value types
their fields hold), looked up in that table by name, never imported or reached through a
module's attributes. Every class a file names is checked before any object is made; an object
is rebuilt from its fields without calling its `__init__`, containers are builtins or
registered NamedTuples and builtin subclasses that keep the builtin's constructor, and arrays
are read from raw bytes only as numbers. Anything else — an unknown class, a damaged or
hand-made structure, a wrong dtype or shape, a missing tensor, nesting deeper than
`MAX_DEPTH` — is an [`InputError`][cw_lens.InputError].

The format (version 1):

- the file is a safetensors file: its tensors are the result's tensors and numeric arrays
  (numeric DataFrame columns included), on the CPU, one key for each place a tensor is in (a
  tensor two fields hold is stored twice: the loader reads each key into one field);
- its string metadata (the safetensors header) holds `format` (`"cw_lens.result"`, or
  `"cw_lens.job-step"` for a stored step), `format_version` (`"1"`), `cw_lens_version` (the
  version that wrote it), `class` (a result's class, `module:qualname`) and `content`: the value
  as JSON, in which a tensor is `{"$type": "tensor", "key": ...}` (the name of its safetensors
  entry), and every value JSON has no literal for — a tuple, a dict with keys that are not
  strings, a NaN, a DataFrame (its columns one by one, with their dtypes and the index), a
  cw_lens object (its class and its fields) — is an object with a `"$type"`.

Arrays are numbers and bools (strings and objects go in lists, tuples or DataFrames), and
DataFrame columns have one of the plain dtypes of `PANDAS_DTYPES`: what the loader reads,
checked against each class's schema (`cw_lens.core.schema`), is what the writer writes.

A file written by a later format version, or a file that is not a cw_lens result, raises
[`InputError`][cw_lens.InputError] saying so. Fields that are derived on first access and
cached (`functools.cached_property`, e.g. `ContributionResult.weights`) are not stored: they
are computed again from the stored fields when read.

Examples:
    >>> import tempfile, pathlib
    >>> import cw_lens
    >>> model = cw_lens.load_model("testing:tiny-llama")
    >>> cw = cw_lens.contribution_weights(model, "The cat sat.", layers=[1])
    >>> path = pathlib.Path(tempfile.mkdtemp()) / "cw.safetensors"
    >>> cw.save(path)
    >>> again = cw_lens.load_result(path)
    >>> type(again).__name__, again.layers
    ('ContributionResult', [1])
    >>> bool(again.attention.nan_to_num().equal(cw.attention.nan_to_num()))
    True
"""

from __future__ import annotations

import enum
import functools
import json
import math
import os
import pathlib
import re
from typing import Any

import numpy as np
import pandas as pd
import torch
from torch import Tensor

from cw_lens.core.errors import InputError
from cw_lens.core.registry import class_name, registered_class

FORMAT = "cw_lens.result"
STEP_FORMAT = "cw_lens.job-step"  # a stored step of the main job
FORMAT_VERSION = 1
TYPE = "$type"

# numpy unsigned integers wider than a byte travel as the signed integers of the same width
# (a bit-for-bit view): older torch and safetensors builds have no uint16/32/64
_SIGNED_VIEW = {"u2": "i2", "u4": "i4", "u8": "i8"}
NETWORKX_CLASSES = ("Graph", "DiGraph", "MultiGraph", "MultiDiGraph")
# the column (and index) dtypes a file may name, by the name it stores: numbers, bools,
# strings and objects. Only these: `pandas_dtype` of a name from a file can read files (a
# time zone such as `datetime64[ns, dateutil//etc/passwd]` is looked up on disk).
PANDAS_DTYPES: dict[str, Any] = {
    **{name: np.dtype(name) for name in ("bool", "object")},
    **{f"int{bits}": np.dtype(f"int{bits}") for bits in (8, 16, 32, 64)},
    **{f"uint{bits}": np.dtype(f"uint{bits}") for bits in (8, 16, 32, 64)},
    **{f"float{bits}": np.dtype(f"float{bits}") for bits in (16, 32, 64)},
    **{
        name: dtype
        for name in ("string", "str")  # pandas' string dtypes (the default of pandas 3: "str")
        if isinstance(dtype := pd.api.types.pandas_dtype(name), pd.StringDtype)
    },
}


def stored_tensor_dtype(dtype: np.dtype) -> torch.dtype:
    """The dtype of the tensor that stores a numpy array of `dtype` (numbers and bools).

    Args:
        dtype: A numpy dtype of kind `b`, `i`, `u` or `f` in the machine's byte order.

    Returns:
        The torch dtype of the same item size (unsigned integers wider than a byte as the
        signed integers of their width, as the writer views them).
    """
    dtype = np.dtype(_SIGNED_VIEW.get(f"{dtype.kind}{dtype.itemsize}", dtype))
    return torch.from_numpy(np.zeros(0, dtype)).dtype


class _Unsupported(InputError):
    """A value the format has no encoding for."""


def _cached_names(cls: type) -> set[str]:
    """The `functools.cached_property` names of `cls` (derived values, never stored)."""
    return {
        name
        for klass in cls.__mro__
        for name, value in vars(klass).items()
        if isinstance(value, functools.cached_property)
    }


def defines(cls: type, name: str) -> bool:
    """Whether a class defines `__getstate__` / `__setstate__` itself (not object's).

    Args:
        cls: The class.
        name: `"__getstate__"` or `"__setstate__"`.

    Returns:
        True when `cls` (or a base other than `object`) defines it.
    """
    method = getattr(cls, name, None)
    return method is not None and method is not getattr(object, name, None)


def object_state(obj: Any) -> Any:
    """What of `obj` is stored: `__getstate__()` where its class defines one, else its
    instance attributes (`__dict__` and `__slots__`), without cached derived values."""
    cls = type(obj)
    if defines(cls, "__getstate__"):
        state = obj.__getstate__()
    else:
        state = dict(getattr(obj, "__dict__", {}))
        for klass in cls.__mro__:
            for slot in getattr(klass, "__slots__", ()):
                if slot not in ("__dict__", "__weakref__") and hasattr(obj, slot):
                    state[slot] = getattr(obj, slot)
    if isinstance(state, dict):
        cached = _cached_names(cls)
        state = {k: v for k, v in state.items() if k not in cached}
    return state


def _is_cw_lens(cls: type) -> bool:
    return cls.__module__ == "cw_lens" or cls.__module__.startswith("cw_lens.")


def _registered_name(cls: type, path: str) -> str:
    """The stored name of `cls`, which must be registered (else the file could not be read)."""
    name = class_name(cls)
    if registered_class(name) is not cls:
        raise _Unsupported(
            f"{path}: a {cls.__module__}.{cls.__qualname__} cannot be saved (it is not a "
            "registered class: cw_lens.core.registry.saveable)."
        )
    return name


# --------------------------------------------------------------------------- writing


class _Writer:
    """Encodes a value as JSON, collecting its tensors (each object once)."""

    def __init__(self) -> None:
        self.tensors: dict[str, Tensor] = {}
        self._storages: set[tuple[int, int]] = set()
        self._objects: dict[int, int] = {}
        self._keep: list[Any] = []  # what the id()s above refer to, alive until the end
        self._active: set[int] = set()

    # ------------------------------------------------------------ tensors
    def _key(self, path: str) -> str:
        key = re.sub(r"[^A-Za-z0-9_.\-]+", "_", path).strip("._") or "value"
        unique, n = key, 1
        while unique in self.tensors:
            n += 1
            unique = f"{key}.{n}"
        return unique

    def tensor(self, value: Tensor, path: str) -> str:
        """The safetensors key of `value`, a key of its own for every place it is in (a
        tensor in two fields is stored twice: the loader reads each key into one field)."""
        if value.layout != torch.strided or value.is_quantized or value.is_complex():
            raise _Unsupported(f"{path}: a {value.layout} {value.dtype} tensor cannot be saved.")
        t = value.detach().to("cpu")
        storage = (t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())
        whole = t.is_contiguous() and t.storage_offset() == 0 and storage[1] == t.nbytes
        if not whole or storage in self._storages or t.nbytes == 0:
            t = t.contiguous().clone()  # a view, or a second tensor over the same memory
        else:
            self._storages.add(storage)
        key = self._key(path)
        self.tensors[key] = t
        self._keep.append(value)  # alive until the end: the storages above refer to it
        return key

    def array(self, value: np.ndarray, path: str) -> dict[str, Any]:
        kind = value.dtype.kind
        if kind in "biuf" and value.dtype.itemsize <= 8:
            native = value.dtype.newbyteorder("=")
            stored = np.ascontiguousarray(value, dtype=native)
            signed = _SIGNED_VIEW.get(f"{stored.dtype.kind}{stored.dtype.itemsize}")
            if signed is not None:
                stored = stored.view(np.dtype(signed))
            key = self.tensor(torch.from_numpy(stored.copy()), path)
            return {TYPE: "ndarray", "key": key, "dtype": native.str}
        # strings and objects are not stored as arrays (a file claiming `<U60000000` items
        # would hold memory out of proportion to it): a list, a tuple or a DataFrame holds them
        raise _Unsupported(
            f"{path}: a numpy array of dtype {value.dtype} cannot be saved (arrays of numbers "
            "and bools can; store strings or objects in a list)."
        )

    # ------------------------------------------------------------ pandas
    def _dtype(self, dtype: Any, path: str) -> str:
        name = str(dtype)
        if name not in PANDAS_DTYPES or PANDAS_DTYPES[name] != dtype:
            raise _Unsupported(
                f"{path}: a column of dtype {dtype!r} cannot be saved (columns of the dtypes "
                f"{sorted(PANDAS_DTYPES)} can)."
            )
        return name

    def values(self, series: pd.Series | pd.Index, path: str) -> dict[str, Any]:
        """A column (or index) by value: numeric numpy dtypes as a tensor, others as JSON."""
        dtype = series.dtype
        out: dict[str, Any] = {"dtype": self._dtype(dtype, path)}
        if isinstance(dtype, np.dtype) and dtype.kind in "biuf":
            out["array"] = self.array(np.asarray(series.to_numpy()), path)
        else:
            out["items"] = [self.encode(v, f"{path}[{i}]") for i, v in enumerate(series.tolist())]
        return out

    def index(self, index: pd.Index, path: str) -> dict[str, Any]:
        name = self.encode(index.name, f"{path}.name")
        if isinstance(index, pd.RangeIndex):
            return {
                TYPE: "RangeIndex",
                "start": index.start,
                "stop": index.stop,
                "step": index.step,
                "name": name,
            }
        if isinstance(index, pd.MultiIndex):
            levels = [
                self.index(level, f"{path}.levels[{i}]") for i, level in enumerate(index.levels)
            ]
            codes = [
                self.array(np.asarray(c), f"{path}.codes[{i}]") for i, c in enumerate(index.codes)
            ]
            names = [self.encode(n, f"{path}.names") for n in index.names]
            return {TYPE: "MultiIndex", "levels": levels, "codes": codes, "names": names}
        return {TYPE: "Index", "name": name, **self.values(index, path)}

    def frame(self, df: pd.DataFrame, path: str) -> dict[str, Any]:
        columns = [
            self.values(df.iloc[:, i], f"{path}.{df.columns[i]}") for i in range(df.shape[1])
        ]
        out = {
            TYPE: "DataFrame",
            "index": self.index(df.index, f"{path}.index"),
            "columns": self.index(df.columns, f"{path}.columns"),
            "data": columns,
        }
        if df.attrs:
            out["attrs"] = self.encode(dict(df.attrs), f"{path}.attrs")
        return out

    # ------------------------------------------------------------ any value
    def encode(self, value: Any, path: str) -> Any:
        if value is None or isinstance(value, (bool, str)):
            return value
        if isinstance(value, (int, float)) and type(value) in (int, float):
            if isinstance(value, float) and not math.isfinite(value):
                return {TYPE: "float", "value": repr(value)}
            return value
        if isinstance(value, Tensor):
            return {TYPE: "tensor", "key": self.tensor(value, path)}
        if isinstance(value, np.ndarray):
            return self.array(value, path)
        if isinstance(value, np.generic):
            if value.dtype.kind not in "biuf":
                raise _Unsupported(f"{path}: a numpy {value.dtype} cannot be saved.")
            return {
                TYPE: "numpy.scalar",
                "dtype": value.dtype.str,
                "value": self.encode(value.item(), path),
            }
        if isinstance(value, pd.DataFrame):
            return self.frame(value, path)
        if isinstance(value, pd.Series):
            return {
                TYPE: "Series",
                "index": self.index(value.index, f"{path}.index"),
                "name": self.encode(value.name, f"{path}.name"),
                **self.values(value, path),
            }
        if isinstance(value, pd.Index):
            return self.index(value, path)
        if isinstance(value, torch.dtype):
            return {TYPE: "torch.dtype", "name": str(value).removeprefix("torch.")}
        if isinstance(value, torch.device):
            return {TYPE: "torch.device", "name": str(value)}
        if isinstance(value, slice):
            return {
                TYPE: "slice",
                "items": self.encode([value.start, value.stop, value.step], path),
            }
        if isinstance(value, range):
            return {TYPE: "range", "items": [value.start, value.stop, value.step]}
        if isinstance(value, pathlib.PurePath):
            return {TYPE: "path", "value": str(value)}
        if isinstance(value, enum.Enum) and _is_cw_lens(type(value)):
            return {
                TYPE: "enum",
                "class": _registered_name(type(value), path),
                "value": self.encode(value.value, path),
            }
        if (
            type(value).__module__.startswith("networkx.")
            and type(value).__name__ in NETWORKX_CLASSES
        ):
            return self._within(value, path, self.graph)
        if isinstance(value, (list, tuple, dict, set, frozenset)):
            return self._within(value, path, self.container)
        if value is pd.NA:
            return {TYPE: "NA"}
        if _is_cw_lens(type(value)):
            return self.object(value, path)
        raise _Unsupported(
            f"{path}: a {type(value).__module__}.{type(value).__qualname__} cannot be saved."
        )

    def _within(self, value: Any, path: str, encode: Any) -> Any:
        if id(value) in self._active:
            raise _Unsupported(f"{path}: the value contains itself; it cannot be saved.")
        self._active.add(id(value))
        try:
            return encode(value, path)
        finally:
            self._active.discard(id(value))

    def container(self, value: Any, path: str) -> Any:
        cls = type(value)
        if isinstance(value, dict):
            items = list(value.items())
            plain = all(isinstance(k, str) for k, _ in items) and TYPE not in value
            if cls is dict and plain:
                return {k: self.encode(v, f"{path}.{k}") for k, v in items}
            out: dict[str, Any] = {
                TYPE: "dict",
                "items": [[self.encode(k, path), self.encode(v, f"{path}.{k}")] for k, v in items],
            }
        elif isinstance(value, (set, frozenset)):
            kind = "frozenset" if isinstance(value, frozenset) else "set"
            out = {TYPE: kind, "items": [self.encode(v, path) for v in value]}
        else:
            items = [self.encode(v, f"{path}[{i}]") for i, v in enumerate(value)]
            if cls is list:
                return items
            out = {TYPE: "list" if isinstance(value, list) else "tuple", "items": items}
        if cls not in (dict, list, tuple, set, frozenset):
            if not _is_cw_lens(cls):
                raise _Unsupported(
                    f"{path}: a {cls.__module__}.{cls.__qualname__} cannot be saved."
                )
            out["class"] = _registered_name(cls, path)  # ClaimsTable, a NamedTuple
        return out

    def graph(self, g: Any, path: str) -> dict[str, Any]:
        multi = g.is_multigraph()
        edges = g.edges(keys=True, data=True) if multi else g.edges(data=True)
        return {
            TYPE: "networkx",
            "class": type(g).__name__,
            "graph": self.encode(dict(g.graph), f"{path}.graph"),
            "nodes": [
                [self.encode(n, path), self.encode(dict(d), f"{path}.nodes")]
                for n, d in g.nodes(data=True)
            ],
            "edges": [
                [self.encode(x, f"{path}.edges") for x in (*e[:-1], dict(e[-1]))] for e in edges
            ],
        }

    def object(self, obj: Any, path: str) -> dict[str, Any]:
        """A cw_lens object: its class and state, once (later references point to it)."""
        known = self._objects.get(id(obj))
        if known is not None:
            return {TYPE: "ref", "id": known}
        name = _registered_name(type(obj), path)
        ident = len(self._objects)
        self._objects[id(obj)] = ident
        self._keep.append(obj)
        state = object_state(obj)
        return {
            TYPE: "object",
            "class": name,
            "id": ident,
            "state": self.encode(state, path),
        }


# --------------------------------------------------------------------------- the file


def write_file(
    value: Any, path: str | os.PathLike[str], *, file_format: str = FORMAT, **metadata: str
) -> None:
    """Write `value` to `path` as a safetensors file of `file_format` (see the module
    docstring).

    Args:
        value: What to store: tensors, arrays, frames, builtins and registered cw_lens
            objects, nested.
        path: The file; its folder must exist, and an existing file is replaced.
        file_format: The `format` entry of its metadata.
        **metadata: Further metadata entries (strings).

    Raises:
        InputError: when `value` holds something the format cannot store; the message names
            where.
    """
    from safetensors.torch import save_file

    from cw_lens.version import __version__

    writer = _Writer()
    try:
        content = writer.encode(value, "")  # paths of fields: ".acc.sums", keys "acc.sums"
    except _Unsupported as exc:
        where = str(exc).lstrip(".")
        raise InputError(f"This {type(value).__name__} cannot be saved: field {where}") from None
    entries = {
        "format": file_format,
        "format_version": str(FORMAT_VERSION),
        "cw_lens_version": __version__,
        **metadata,
        "content": json.dumps(content, allow_nan=False, separators=(",", ":")),
    }
    save_file(writer.tensors, str(pathlib.Path(path)), metadata=entries)
