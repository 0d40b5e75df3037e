"""Reading the files of `cw_lens.core.saving`: result files and the main job's stored steps.

Loading runs no code from the file. Every class the file's JSON names is looked up in the
registry (`cw_lens.core.registry`) and checked before any object is made (`check_classes`); an
object is rebuilt from its fields without its `__init__`, a container is a builtin, a registered
NamedTuple or a builtin subclass that keeps the builtin's constructor, `__setstate__` runs only
on registered classes, and arrays are read from raw bytes only as numbers. Anything else — an
unregistered class, a damaged or hand-made structure, a wrong dtype or shape, a missing tensor,
nesting deeper than `MAX_DEPTH` — is an [`InputError`][cw_lens.InputError], never another
exception.

Every object is checked against its class's schema (`cw_lens.core.schema`) before it is built:
its keys first (exactly its stored fields; never a method, a property or a derived value such
as a contribution's `weights`), then each field's type, tensor dtype and named axes, its list
lengths, enumerations and bounded numbers. A file's claims are bounded by its size before
anything is allocated:

- each stored tensor is read into one field: a tensor key used twice is refused, and no two
  loaded tensors share memory;
- arrays are numbers and bools only, read from a tensor of exactly their dtype (a string or
  object array, `<U60000000`, is refused before numpy allocates it);
- a range (or a `RangeIndex`) claims at most `MIN_CLAIM` items plus 8 per byte of the file, a
  stored object is referred back to at most `MAX_REFS` times and never from inside itself;
- column dtypes are the plain ones of `cw_lens.core.saving.PANDAS_DTYPES`, looked up in that
  table (pandas itself is never asked to parse a dtype from a file: it opens files for time
  zones).

Examples:
    >>> from cw_lens.core.errors import InputError
    >>> from cw_lens.core.loading import check_classes
    >>> sorted(check_classes({"$type": "object", "class": "cw_lens.core.accumulators:Histogram",
    ...                       "id": 0, "state": {}}))
    ['cw_lens.core.accumulators:Histogram']
    >>> try:
    ...     check_classes({"$type": "object", "class": "os:system", "id": 0, "state": {}})
    ... except InputError as error:
    ...     print(str(error)[:60])
    The file names the class 'os:system', which is not a class c
"""

from __future__ import annotations

import dataclasses
import enum
import json
import os
import pathlib
from typing import Any

import numpy as np
import pandas as pd
import torch
from torch import Tensor

from cw_lens.core.errors import InputError
from cw_lens.core.registry import registered_class
from cw_lens.core.saving import (
    FORMAT,
    FORMAT_VERSION,
    NETWORKX_CLASSES,
    PANDAS_DTYPES,
    TYPE,
    defines,
    stored_tensor_dtype,
)
from cw_lens.core.schema import check_keys, check_state, check_value, schema_of

MAX_DEPTH = 200  # JSON nesting a file may have (results nest a few dozen levels)
# what a range or a RangeIndex may claim: at most this many items plus 8 per byte of the file
# (a range of 10**18 in a 300-byte file is refused; the ones cw_lens writes index its tensors)
MIN_CLAIM = 1 << 20
MAX_REFS = 64  # references back to one stored object (a shared value; cw_lens writes a few)
_CONTAINERS = {"dict": dict, "list": list, "tuple": tuple, "set": set, "frozenset": frozenset}
_NAMED = ("object", "enum", *_CONTAINERS)  # the value types that may name a class
_TORCH_DTYPES = {
    str(d).removeprefix("torch."): d
    for d in (
        torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.complex64,
        torch.complex128, torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8,
        torch.bool,
    )
}  # fmt: skip
# what a file's malformed structure raises while it is decoded (a missing key, a wrong type, an
# impossible shape): turned into an InputError that says the file is damaged
_MALFORMED = (KeyError, TypeError, ValueError, IndexError, AttributeError, OverflowError,
              RuntimeError, RecursionError)  # fmt: skip


def _not_ours(name: Any) -> InputError:
    return InputError(
        f"The file names the class {str(name)[:200]!r}, which is not a class cw_lens reads: the "
        "file is not a cw_lens result, or it was written by a version of cw_lens that has a "
        "class this one lacks (use that version to load it)."
    )


def _damaged(detail: str) -> InputError:
    return InputError(f"The file's content is damaged or was not written by cw_lens: {detail}.")


def _check_use(kind: str, cls: type, name: str) -> None:
    """A registered class may be built only the way it was written: an object from its
    fields, an enum member by value, a container as a NamedTuple or a builtin subclass that
    keeps the builtin's constructor (`ClaimsTable`)."""
    if kind == "enum":
        ok = issubclass(cls, enum.Enum)
    elif kind == "object":
        ok = not issubclass(cls, (enum.Enum, *_CONTAINERS.values()))
    elif kind == "tuple" and hasattr(cls, "_fields"):
        ok = issubclass(cls, tuple)
    else:
        builtin = _CONTAINERS[kind]
        ok = (
            issubclass(cls, builtin)
            and cls.__new__ is builtin.__new__
            and cls.__init__ is builtin.__init__
        )
    if not ok:
        raise _damaged(f"it builds the class {name!r} as a {kind!r}, which cw_lens never writes")


def check_classes(content: Any) -> dict[str, type]:
    """Every class `content` (a file's decoded JSON) names, each registered and used as it
    was written; checked before any object is made.

    Args:
        content: The JSON of a file's `content`.

    Returns:
        `{stored name: class}`.

    Raises:
        InputError: at the first class that is not registered or is used otherwise, or at
            nesting deeper than `MAX_DEPTH`.
    """
    classes: dict[str, type] = {}
    stack: list[tuple[Any, int]] = [(content, 1)]
    while stack:
        value, depth = stack.pop()
        if depth > MAX_DEPTH:
            raise _damaged(f"it nests deeper than {MAX_DEPTH} levels")
        if isinstance(value, list):
            stack.extend((v, depth + 1) for v in value)
            continue
        if not isinstance(value, dict):
            continue
        kind = value.get(TYPE)
        if kind in _NAMED and (kind in ("object", "enum") or "class" in value):
            name = value.get("class")
            cls = registered_class(name) if isinstance(name, str) else None
            if cls is None:
                raise _not_ours(name)
            _check_use(kind, cls, name)
            classes[name] = cls
        stack.extend((v, depth + 1) for v in value.values())
    return classes


def _text(value: Any, what: str) -> str:
    if not isinstance(value, str):
        raise _damaged(f"{what} is not a string")
    return value


def _numpy_dtype(spec: Any) -> np.dtype:
    """A numeric or bool numpy dtype the file names, in the machine's byte order.

    Only these are read: a string, object or structured dtype in a file (`<U60000000`)
    would claim memory out of proportion to the file, and cw_lens never writes one."""
    text = _text(spec, "a dtype")
    dtype = np.dtype(text) if len(text) <= 8 else None
    if (
        dtype is None
        or dtype.kind not in "biuf"
        or dtype.itemsize > 8
        or not dtype.isnative
        or dtype.fields is not None
        or dtype.subdtype is not None
    ):
        raise _damaged(
            f"an array has the dtype {text[:40]!r}; cw_lens stores arrays of numbers and bools "
            "only, in the machine's byte order"
        )
    return dtype


def _bounded_int(value: Any, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not -(2**63) <= value < 2**63:
        raise _damaged(f"{what} is not a whole number in the int64 range")
    return value


class _Building:
    """The place of an object whose fields are still being read (a reference to it is a
    cycle, which cw_lens never writes)."""


class _Reader:
    def __init__(self, tensors: dict[str, Tensor], classes: dict[str, type], claim: int) -> None:
        self.tensors = tensors
        self.classes = classes  # the names check_classes found, registered
        self.claim = claim  # what ranges and counts may claim, in items (see MIN_CLAIM)
        self._objects: dict[int, Any] = {}
        self._used: set[str] = set()  # the tensor keys read (each is read once)
        self._refs: dict[int, int] = {}  # references to each object
        self._storages: set[int] = set()

    def tensor(self, key: Any) -> Tensor:
        if not isinstance(key, str) or key not in self.tensors:
            raise InputError(f"The file has no tensor {str(key)[:200]!r}: it is damaged.")
        if key in self._used:
            raise InputError(
                f"The file uses its tensor {key[:200]!r} twice; cw_lens stores the tensor of "
                "each field for that field alone: the file is damaged (or is a streamed block "
                "saved by cw_lens 0.4.1 or earlier, which stored a tensor two fields shared "
                "once: save it again with this version)."
            )
        self._used.add(key)
        t = self.tensors[key]
        storage = t.untyped_storage()
        whole = t.storage_offset() == 0 and storage.nbytes() == t.nbytes
        if t.nbytes and (not whole or storage.data_ptr() in self._storages):
            t = t.clone()  # no two loaded tensors share memory
        elif t.nbytes:
            self._storages.add(storage.data_ptr())
        return t

    def array(self, spec: dict[str, Any]) -> np.ndarray:
        if "key" not in spec:
            raise _damaged(
                "an array is spelt out item by item; cw_lens stores arrays of numbers and "
                "bools only, as tensors"
            )
        dtype = _numpy_dtype(spec["dtype"])
        t = self.tensor(spec["key"])
        if t.dtype != stored_tensor_dtype(dtype):
            raise _damaged(
                f"an array of {dtype.str} is stored as a {str(t.dtype).removeprefix('torch.')} "
                "tensor, which cw_lens never writes for it"
            )
        stored = t.numpy()
        return stored.view(dtype) if stored.dtype != dtype else stored.copy()

    def _pandas_dtype(self, spec: Any) -> Any:
        name = _text(spec, "a column's dtype")
        dtype = PANDAS_DTYPES.get(name)
        if dtype is None:
            raise InputError(
                f"A column of the file has the dtype {name[:100]!r}; cw_lens reads columns of "
                f"the dtypes {sorted(PANDAS_DTYPES)} only."
            )
        return dtype

    def values(self, spec: dict[str, Any]) -> Any:
        dtype = self._pandas_dtype(spec["dtype"])
        if "array" in spec:
            values = self.array(spec["array"])
            if values.dtype != dtype:
                raise _damaged(f"a column of dtype {dtype} holds an array of {values.dtype}")
            return values
        items = [self.decode(v) for v in spec["items"]]
        if dtype == np.dtype(object):
            out = np.empty(len(items), dtype=object)
            for i, item in enumerate(items):
                out[i] = item
            return out
        if isinstance(dtype, np.dtype):
            raise _damaged(f"a column of dtype {dtype} is spelt out item by item")
        return pd.array(items, dtype=dtype)

    def _range(self, start: Any, stop: Any, step: Any) -> range:
        out = range(
            _bounded_int(start, "a range's start"),
            _bounded_int(stop, "a range's stop"),
            _bounded_int(step, "a range's step"),
        )
        if len(out) > self.claim:
            raise InputError(
                f"The file holds a range of {len(out)} items, out of proportion to its size "
                f"(at most {self.claim}): it is damaged."
            )
        return out

    def index(self, spec: dict[str, Any]) -> pd.Index:
        kind = spec[TYPE]
        if kind == "RangeIndex":
            r = self._range(spec["start"], spec["stop"], spec["step"])
            return pd.RangeIndex(r.start, r.stop, r.step, name=self.decode(spec["name"]))
        if kind == "MultiIndex":
            return pd.MultiIndex(
                levels=[self.index(level) for level in spec["levels"]],
                codes=[self.array(c) for c in spec["codes"]],
                names=[self.decode(n) for n in spec["names"]],
            )
        if kind != "Index":
            raise _damaged(f"an index has the type {str(kind)[:100]!r}")
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
            return float(_text(value["value"], "a float"))
        if kind == "NA":
            return pd.NA
        if kind == "tensor":
            return self.tensor(value["key"])
        if kind == "ndarray":
            return self.array(value)
        if kind == "numpy.scalar":
            dtype = _numpy_dtype(value["dtype"])
            number = value["value"]
            if isinstance(number, dict):
                number = self.decode(number)  # a NaN or an infinity
            if not isinstance(number, (bool, int, float)):
                raise _damaged("a numpy number is not a number")
            return dtype.type(number)
        if kind == "DataFrame":
            return self.frame(value)
        if kind == "Series":
            index = self.index(value["index"])
            return pd.Series(self.values(value), index=index, name=self.decode(value["name"]))
        if kind in ("RangeIndex", "MultiIndex", "Index"):
            return self.index(value)
        if kind == "torch.dtype":
            dtype = _TORCH_DTYPES.get(value["name"]) if isinstance(value["name"], str) else None
            if dtype is None:
                raise InputError(f"Unknown torch dtype {str(value['name'])[:100]!r} in the file.")
            return dtype
        if kind == "torch.device":
            return torch.device(_text(value["name"], "a device"))
        if kind == "slice":
            items = value["items"]
            if not isinstance(items, list) or len(items) != 3:
                raise _damaged("a slice is not (start, stop, step)")
            return slice(*(None if i is None else _bounded_int(i, "a slice bound") for i in items))
        if kind == "range":
            items = value["items"]
            if not isinstance(items, list) or len(items) != 3:
                raise _damaged("a range is not (start, stop, step)")
            return self._range(*items)
        if kind == "path":
            return pathlib.Path(_text(value["value"], "a path"))
        if kind == "enum":
            return self.classes[value["class"]](self.decode(value["value"]))
        if kind == "networkx":
            return self.graph(value)
        if kind in _CONTAINERS:
            return self.container(kind, value)
        if kind == "object":
            return self.object(value)
        if kind == "ref":
            ident = value["id"]
            known = self._objects.get(ident) if isinstance(ident, int) else None
            if known is None or isinstance(known, _Building):
                raise InputError(
                    "The file refers to an object it does not hold, or to an object from "
                    "inside that object: it is damaged."
                )
            self._refs[ident] = self._refs.get(ident, 0) + 1
            if self._refs[ident] > MAX_REFS:
                raise InputError(
                    f"The file refers to one object more than {MAX_REFS} times (cw_lens stores "
                    "an object once and refers back to it a few times at most): it is damaged."
                )
            return known
        raise InputError(f"Unknown value type {str(kind)[:100]!r} in the file.")

    def container(self, kind: str, spec: dict[str, Any]) -> Any:
        if kind == "dict":
            items: Any = {self.decode(k): self.decode(v) for k, v in spec["items"]}
        else:
            items = [self.decode(v) for v in spec["items"]]
        if "class" not in spec:
            return _CONTAINERS[kind](items)
        cls = self.classes[spec["class"]]  # checked: a NamedTuple or a builtin's subclass
        schema = schema_of(cls)
        if kind == "tuple" and hasattr(cls, "_fields"):
            if len(items) != len(cls._fields):
                raise InputError(f"A stored {cls.__qualname__} has {len(items)} items, "
                                 f"not its fields {list(cls._fields)}.")  # fmt: skip
            check_state(schema, dict(zip(cls._fields, items, strict=True)), claim=self.claim)
            return cls(*items)
        check_value(schema, items, cls.stored_items, "items", claim=self.claim)
        return cls(items)

    def graph(self, spec: dict[str, Any]) -> Any:
        import networkx as nx

        if spec["class"] not in NETWORKX_CLASSES:
            raise InputError(f"Unknown graph class {str(spec['class'])[:100]!r} in the file.")
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
        cls = self.classes[spec["class"]]  # checked: registered, and not a container or enum
        ident = spec["id"]
        if not isinstance(ident, int) or ident in self._objects:
            raise _damaged("two objects share an id")
        schema = schema_of(cls)
        raw = spec["state"]
        if not isinstance(raw, dict) or TYPE in raw:
            raise InputError(f"The state of a {cls.__qualname__} in the file is not its fields.")
        check_keys(schema, list(raw))  # before anything of it is read
        self._objects[ident] = _Building()
        state = {}
        for name, value in raw.items():
            try:
                state[name] = self.decode(value)
            except InputError as exc:
                raise InputError(f"{cls.__qualname__}.{name}: {exc}") from None
        check_state(schema, state, claim=self.claim)  # every field, before it is built
        obj = cls.__new__(cls)
        if defines(cls, "__setstate__"):
            obj.__setstate__(state)
        else:
            if dataclasses.is_dataclass(cls):
                for f in dataclasses.fields(cls):
                    if f.name not in state and f.default is not dataclasses.MISSING:
                        state[f.name] = f.default
                    elif f.name not in state and f.default_factory is not dataclasses.MISSING:
                        state[f.name] = f.default_factory()
            for name, value in state.items():
                if hasattr(obj, "__dict__") and not _is_slot(cls, name):
                    obj.__dict__[name] = value
                else:
                    object.__setattr__(obj, name, value)
        self._objects[ident] = obj
        return obj


def _is_slot(cls: type, name: str) -> bool:
    return any(name in getattr(klass, "__slots__", ()) for klass in cls.__mro__)


def decode_content(content: Any, tensors: dict[str, Tensor], *, size: int = 0) -> Any:
    """The value a file's JSON `content` and its `tensors` hold.

    Every class the content names is checked first (`check_classes`): an unregistered one is
    an `InputError` before any object is made. A structure cw_lens never writes is an
    `InputError` too, never another exception.

    Args:
        content: The decoded JSON.
        tensors: The file's tensors by key.
        size: The file's size in bytes, which bounds what its ranges may claim
            (`MIN_CLAIM` plus 8 items per byte).

    Returns:
        The value.

    Raises:
        InputError: when the content names a class cw_lens does not read, or is damaged.
    """
    classes = check_classes(content)
    try:
        return _Reader(tensors, classes, MIN_CLAIM + 8 * size).decode(content)
    except InputError:
        raise
    except _MALFORMED as exc:
        raise _damaged(f"{type(exc).__name__}: {str(exc)[:200]}") from None


# --------------------------------------------------------------------------- the file


def read_metadata(path: str | os.PathLike[str], *, file_format: str = FORMAT) -> dict[str, str]:
    """The safetensors metadata of a cw_lens file, checked: `format` and `format_version`.

    Args:
        path: The file.
        file_format: The `format` it must have.

    Returns:
        The metadata entries.

    Raises:
        FileNotFoundError: when `path` does not exist.
        InputError: when the file is not a cw_lens file of that format, or was written by a
            later format version than this cw_lens reads.
    """
    from safetensors import SafetensorError, safe_open

    path = pathlib.Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"No result file at {str(path)!r}.")
    try:
        with safe_open(str(path), framework="pt") as f:
            metadata = f.metadata() or {}
    except (SafetensorError, OSError, ValueError, RuntimeError) as exc:
        raise InputError(
            f"{str(path)!r} is not a cw_lens result file (not a safetensors file: {exc}). "
            "Results are written by result.save(path)."
        ) from None
    if metadata.get("format") != file_format:
        what = "cw_lens result" if file_format == FORMAT else f"cw_lens file ({file_format})"
        raise InputError(
            f"{str(path)!r} is a safetensors file but not a {what} (its metadata has no "
            f"'format': {file_format!r}). Results are written by result.save(path)."
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


def read_file(path: str | os.PathLike[str], *, file_format: str = FORMAT) -> Any:
    """The value stored in `path` by `write_file` with the same `file_format`.

    Args:
        path: The file.
        file_format: The `format` it must have.

    Returns:
        The value, its tensors on the CPU.

    Raises:
        FileNotFoundError: when `path` does not exist.
        InputError: when the file is not such a file, was written by a later format version,
            names a class cw_lens does not read, or is damaged.
    """
    from safetensors import SafetensorError, safe_open

    metadata = read_metadata(path, file_format=file_format)
    try:
        with safe_open(str(path), framework="pt") as f:
            tensors = {key: f.get_tensor(key) for key in f.keys()}
    except (SafetensorError, OSError, ValueError, RuntimeError) as exc:
        raise InputError(f"{str(path)!r} has unreadable tensors ({exc}): it is damaged.") from None
    try:
        content = json.loads(metadata["content"])
    except (KeyError, ValueError, RecursionError):
        raise InputError(f"{str(path)!r} has no readable content: it is damaged.") from None
    try:
        return decode_content(content, tensors, size=pathlib.Path(path).stat().st_size)
    except InputError as exc:
        raise InputError(f"{str(path)!r}: {exc}") from None
