"""Saving and loading results: `result.save(path)` and `cw_lens.load_result(path)`.

Every public result (every subclass of [`Result`][cw_lens.Result]) saves to one
[safetensors](https://huggingface.co/docs/safetensors) file and loads back into an equal
object of the same class: every field equal bit for bit, its helpers (`to_dataframe()`,
`top()`, `claims()`, ...) working as before. Nothing is pickled, so loading a file runs no
code from it: the only classes it can name are cw_lens's own (and networkx's graph classes),
rebuilt from their fields without calling their `__init__`.

The format (version 1):

- the file is a safetensors file: its tensors are the result's tensors and numeric arrays
  (numeric DataFrame columns included), each stored once, on the CPU;
- its string metadata (the safetensors header) holds `format` (`"cw_lens.result"`),
  `format_version` (`"1"`), `cw_lens_version` (the version that wrote it), `class` (the
  result's class, `module:qualname`) and `content`: the result as JSON, in which a tensor is
  `{"$type": "tensor", "key": ...}` (the name of its safetensors entry), and every value JSON
  has no literal for — a tuple, a dict with keys that are not strings, a NaN, a DataFrame
  (its columns one by one, with their dtypes and the index), a cw_lens object (its class and
  its fields) — is an object with a `"$type"`.

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
import importlib
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

FORMAT = "cw_lens.result"
FORMAT_VERSION = 1
TYPE = "$type"

# numpy unsigned integers wider than a byte travel as the signed integers of the same width
# (a bit-for-bit view): older torch and safetensors builds have no uint16/32/64
_SIGNED_VIEW = {"u2": "i2", "u4": "i4", "u8": "i8"}
_NETWORKX = ("Graph", "DiGraph", "MultiGraph", "MultiDiGraph")


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


def _custom(cls: type, name: str) -> bool:
    """Whether `cls` defines `__getstate__` / `__setstate__` itself (not object's)."""
    method = getattr(cls, name, None)
    return method is not None and method is not getattr(object, name, None)


def object_state(obj: Any) -> Any:
    """What of `obj` is stored: `__getstate__()` where its class defines one, else its
    instance attributes (`__dict__` and `__slots__`), without cached derived values."""
    cls = type(obj)
    if _custom(cls, "__getstate__"):
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


def _class_name(cls: type) -> str:
    return f"{cls.__module__}:{cls.__qualname__}"


def _find_class(name: str) -> type:
    """The cw_lens class `module:qualname` (no other module is imported)."""
    module, _, qualname = name.partition(":")
    if not (module == "cw_lens" or module.startswith("cw_lens.")) or not qualname:
        raise InputError(f"The file names the class {name!r}, which is not a cw_lens class.")
    try:
        obj: Any = importlib.import_module(module)
        for part in qualname.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError):
        raise InputError(
            f"The file names the class {name!r}, which this cw_lens does not have: it was "
            "written by another version of cw_lens."
        ) from None
    if not isinstance(obj, type):
        raise InputError(f"The file names {name!r}, which is not a class.")
    return obj


def _is_cw_lens(cls: type) -> bool:
    return cls.__module__ == "cw_lens" or cls.__module__.startswith("cw_lens.")


# --------------------------------------------------------------------------- writing


class _Writer:
    """Encodes a value as JSON, collecting its tensors (each object once)."""

    def __init__(self) -> None:
        self.tensors: dict[str, Tensor] = {}
        self._tensor_keys: dict[int, str] = {}
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
        """The safetensors key of `value` (stored once per tensor object)."""
        known = self._tensor_keys.get(id(value))
        if known is not None:
            return known
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
        self._tensor_keys[id(value)] = key
        self._keep.append(value)
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
        if kind in "OUS":
            items = [self.encode(v, f"{path}[{i}]") for i, v in enumerate(value.ravel().tolist())]
            return {
                TYPE: "ndarray",
                "dtype": value.dtype.str,
                "shape": list(value.shape),
                "items": items,
            }
        raise _Unsupported(f"{path}: a numpy array of dtype {value.dtype} cannot be saved.")

    # ------------------------------------------------------------ pandas
    def _dtype(self, dtype: Any, path: str) -> str:
        name = str(dtype)
        try:
            same = pd.api.types.pandas_dtype(name) == dtype
        except TypeError:
            same = False
        if not same:
            raise _Unsupported(f"{path}: a column of dtype {dtype!r} cannot be saved.")
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
                "class": _class_name(type(value)),
                "value": self.encode(value.value, path),
            }
        if type(value).__module__.startswith("networkx.") and type(value).__name__ in _NETWORKX:
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
            out["class"] = _class_name(cls)  # a cw_lens subclass: ClaimsTable, a NamedTuple
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
        ident = len(self._objects)
        self._objects[id(obj)] = ident
        self._keep.append(obj)
        state = object_state(obj)
        return {
            TYPE: "object",
            "class": _class_name(type(obj)),
            "id": ident,
            "state": self.encode(state, path),
        }


# --------------------------------------------------------------------------- reading


class _Reader:
    def __init__(self, tensors: dict[str, Tensor]) -> None:
        self.tensors = tensors
        self._objects: dict[int, Any] = {}

    def tensor(self, key: str) -> Tensor:
        try:
            return self.tensors[key]
        except KeyError:
            raise InputError(f"The file has no tensor {key!r}: it is damaged.") from None

    def array(self, spec: dict[str, Any]) -> np.ndarray:
        dtype = np.dtype(spec["dtype"])
        if "key" in spec:
            stored = self.tensor(spec["key"]).numpy()
            return stored.view(dtype) if stored.dtype != dtype else stored.copy()
        out = np.empty(len(spec["items"]), dtype=object)
        for i, item in enumerate(spec["items"]):
            out[i] = self.decode(item)
        return out.astype(dtype).reshape(spec["shape"])

    def values(self, spec: dict[str, Any]) -> Any:
        dtype = pd.api.types.pandas_dtype(spec["dtype"])
        if "array" in spec:
            return self.array(spec["array"])
        items = [self.decode(v) for v in spec["items"]]
        if dtype == np.dtype(object):
            out = np.empty(len(items), dtype=object)
            for i, item in enumerate(items):
                out[i] = item
            return out
        return pd.array(items, dtype=dtype)

    def index(self, spec: dict[str, Any]) -> pd.Index:
        kind = spec[TYPE]
        if kind == "RangeIndex":
            return pd.RangeIndex(
                spec["start"], spec["stop"], spec["step"], name=self.decode(spec["name"])
            )
        if kind == "MultiIndex":
            return pd.MultiIndex(
                levels=[self.index(level) for level in spec["levels"]],
                codes=[self.array(c) for c in spec["codes"]],
                names=[self.decode(n) for n in spec["names"]],
            )
        values = self.values(spec)
        return pd.Index(values, dtype=values.dtype, name=self.decode(spec["name"]))

    def frame(self, spec: dict[str, Any]) -> pd.DataFrame:
        index = self.index(spec["index"])
        columns = self.index(spec["columns"])
        data = {i: self.values(column) for i, column in enumerate(spec["data"])}
        df = pd.DataFrame(data) if data else pd.DataFrame(index=range(len(index)))
        df.index = index
        df.columns = columns
        if "attrs" in spec:
            df.attrs.update(self.decode(spec["attrs"]))
        return df

    def decode(self, value: Any) -> Any:
        if isinstance(value, list):
            return [self.decode(v) for v in value]
        if not isinstance(value, dict):
            return value
        kind = value.get(TYPE)
        if kind is None:
            return {k: self.decode(v) for k, v in value.items()}
        if kind == "float":
            return float(value["value"])
        if kind == "NA":
            return pd.NA
        if kind == "tensor":
            return self.tensor(value["key"])
        if kind == "ndarray":
            return self.array(value)
        if kind == "numpy.scalar":
            return np.dtype(value["dtype"]).type(self.decode(value["value"]))
        if kind == "DataFrame":
            return self.frame(value)
        if kind == "Series":
            index = self.index(value["index"])
            return pd.Series(self.values(value), index=index, name=self.decode(value["name"]))
        if kind in ("RangeIndex", "MultiIndex", "Index"):
            return self.index(value)
        if kind == "torch.dtype":
            dtype = getattr(torch, value["name"], None)
            if not isinstance(dtype, torch.dtype):
                raise InputError(f"Unknown torch dtype {value['name']!r} in the file.")
            return dtype
        if kind == "torch.device":
            return torch.device(value["name"])
        if kind == "slice":
            return slice(*self.decode(value["items"]))
        if kind == "range":
            return range(*value["items"])
        if kind == "path":
            return pathlib.Path(value["value"])
        if kind == "enum":
            return _find_class(value["class"])(self.decode(value["value"]))
        if kind == "networkx":
            return self.graph(value)
        if kind in ("dict", "list", "tuple", "set", "frozenset"):
            return self.container(kind, value)
        if kind == "object":
            return self.object(value)
        if kind == "ref":
            try:
                return self._objects[value["id"]]
            except KeyError:
                raise InputError(
                    "The file refers to an object it does not hold: it is damaged."
                ) from None
        raise InputError(f"Unknown value type {kind!r} in the file.")

    def container(self, kind: str, spec: dict[str, Any]) -> Any:
        if kind == "dict":
            items: Any = {self.decode(k): self.decode(v) for k, v in spec["items"]}
        else:
            items = [self.decode(v) for v in spec["items"]]
        builtin = {"dict": dict, "list": list, "tuple": tuple, "set": set, "frozenset": frozenset}
        if "class" not in spec:
            return builtin[kind](items)
        cls = _find_class(spec["class"])
        if kind == "tuple" and hasattr(cls, "_fields"):  # a NamedTuple
            return cls(*items)
        return cls(items)

    def graph(self, spec: dict[str, Any]) -> Any:
        import networkx as nx

        if spec["class"] not in _NETWORKX:
            raise InputError(f"Unknown graph class {spec['class']!r} in the file.")
        g = getattr(nx, spec["class"])()
        g.graph.update(self.decode(spec["graph"]))
        for node, data in spec["nodes"]:
            g.add_node(self.decode(node), **self.decode(data))
        for edge in spec["edges"]:
            *ends, data = (self.decode(x) for x in edge)
            if g.is_multigraph():
                g.add_edge(ends[0], ends[1], key=ends[2], **data)
            else:
                g.add_edge(ends[0], ends[1], **data)
        return g

    def object(self, spec: dict[str, Any]) -> Any:
        cls = _find_class(spec["class"])
        obj = cls.__new__(cls)
        self._objects[spec["id"]] = obj  # before its state: the state may refer back to it
        state = self.decode(spec["state"])
        if _custom(cls, "__setstate__"):
            obj.__setstate__(state)
            return obj
        if not isinstance(state, dict):
            raise InputError(f"The state of a {cls.__qualname__} in the file is not a dict.")
        for name, value in state.items():
            if hasattr(obj, "__dict__") and not _is_slot(cls, name):
                obj.__dict__[name] = value
            else:
                object.__setattr__(obj, name, value)
        return obj


def _is_slot(cls: type, name: str) -> bool:
    return any(name in getattr(klass, "__slots__", ()) for klass in cls.__mro__)


# --------------------------------------------------------------------------- the file


def save_result(result: Any, path: str | os.PathLike[str]) -> None:
    """Write `result` (a [`Result`][cw_lens.Result]) to `path` (see the module docstring).

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
        >>> from cw_lens.core.saving import save_result
        >>> model = cw_lens.load_model("testing:tiny-llama")
        >>> shares = cw_lens.residual_shares(model, "A short text.", layers=[0])
        >>> save_result(shares, pathlib.Path(tempfile.mkdtemp()) / "shares.safetensors")
    """
    from safetensors.torch import save_file

    from cw_lens.core.results import Result
    from cw_lens.version import __version__

    if not isinstance(result, Result):
        raise InputError(f"save_result saves cw_lens results, got a {type(result).__name__}.")
    writer = _Writer()
    try:
        content = writer.object(result, "")  # paths of fields: ".acc.sums", keys "acc.sums"
    except _Unsupported as exc:
        where = str(exc).lstrip(".")
        raise InputError(f"This {type(result).__name__} cannot be saved: field {where}") from None
    metadata = {
        "format": FORMAT,
        "format_version": str(FORMAT_VERSION),
        "cw_lens_version": __version__,
        "class": _class_name(type(result)),
        "content": json.dumps(content, allow_nan=False, separators=(",", ":")),
    }
    save_file(writer.tensors, str(pathlib.Path(path)), metadata=metadata)


def read_metadata(path: str | os.PathLike[str]) -> dict[str, str]:
    """The safetensors metadata of a result file, checked: `format` and `format_version`.

    Raises:
        FileNotFoundError: when `path` does not exist.
        InputError: when the file is not a cw_lens result, or was written by a later format
            version than this cw_lens reads.
    """
    from safetensors import SafetensorError, safe_open

    path = pathlib.Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"No result file at {str(path)!r}.")
    try:
        with safe_open(str(path), framework="pt") as f:
            metadata = f.metadata() or {}
    except (SafetensorError, OSError, ValueError) as exc:
        raise InputError(
            f"{str(path)!r} is not a cw_lens result file (not a safetensors file: {exc}). "
            "Results are written by result.save(path)."
        ) from None
    if metadata.get("format") != FORMAT:
        raise InputError(
            f"{str(path)!r} is a safetensors file but not a cw_lens result (its metadata has no "
            f"'format': {FORMAT!r}). Results are written by result.save(path)."
        )
    version = metadata.get("format_version", "")
    if not version.isdigit() or int(version) < 1:
        raise InputError(f"{str(path)!r} has an unknown result format version {version!r}.")
    if int(version) > FORMAT_VERSION:
        raise InputError(
            f"{str(path)!r} was written in result format version {version} (by cw_lens "
            f"{metadata.get('cw_lens_version', '?')}); this cw_lens reads versions up to "
            f"{FORMAT_VERSION}: upgrade cw_lens to load it."
        )
    return metadata


def load_result(path: str | os.PathLike[str]) -> Any:
    """Load a result written by `result.save(path)`.

    The result comes back as the class that was saved, every field equal to the saved one;
    tensors are on the CPU (move them with `.to(device)` where needed). No code is run from
    the file: it holds tensors and JSON, never pickles.

    Args:
        path: A file written by [`Result.save`][cw_lens.Result.save].

    Returns:
        The result ([`ContributionResult`][cw_lens.ContributionResult],
        [`SinkStatisticsResult`][cw_lens.SinkStatisticsResult], ...).

    Raises:
        FileNotFoundError: when `path` does not exist.
        InputError: when the file is not a cw_lens result, was written by a later format
            version (upgrade cw_lens), or names a class this cw_lens does not have.

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
    from safetensors import safe_open

    from cw_lens.core.results import Result

    metadata = read_metadata(path)
    with safe_open(str(path), framework="pt") as f:
        tensors = {key: f.get_tensor(key) for key in f.keys()}
    try:
        content = json.loads(metadata["content"])
    except (KeyError, ValueError):
        raise InputError(f"{str(path)!r} has no readable result content: it is damaged.") from None
    result = _Reader(tensors).decode(content)
    if not isinstance(result, Result):
        raise InputError(f"{str(path)!r} holds a {type(result).__name__}, not a cw_lens result.")
    return result
