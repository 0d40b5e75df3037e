"""The schema of each class a cw_lens file may hold: its fields, their types, tensor dtypes and
named axes, checked before the object is built.

A file from someone else can put any value in any field; the loader (`cw_lens.core.loading`)
checks every stored object against its class's schema before it builds it, so a loaded result
holds what its class declares or nothing is built. The schema is derived from what the class
already declares:

- a dataclass: its fields and their type hints; a NamedTuple: its annotations;
- a class with its own state (`__getstate__` / `__setstate__`, private attributes): the
  class attribute `stored_fields`, `{state key: type hint}` (and `optional_fields`, the keys
  that files of older versions may lack);
- a registered `dict` subclass (`ClaimsTable`): the class attribute `stored_items`, the hint
  of the whole dict.

A hint says what a field may hold:

- a jaxtyping annotation (`Float32[Tensor, "batch layer head query key"]`) gives the dtypes
  (jaxtyping's own `dtypes`) and the named axes (its `dims`): a tensor of another dtype or
  rank is refused, and an axis with one name has one size across all the fields of the
  object;
- `Annotated[list[int], Axes("layer")]` names the axes of a list (one name per nesting
  level): `layers` is as long as the `layer` axis of the tensors;
  `Annotated[list[list[str]], Axes("batch"), MaskedRows("mask")]`: the list is as long as
  `batch`, and each of its rows as long as the True entries of that row of `mask` (the
  tokens of a row, its padding left out);
- the class attribute `equal_axes` (`(("query", "key", "pos"),)`) says that differently named
  axes are one axis (the query and key axes of a contribution are the token positions);
- `Annotated[int, Count()]`: a number of items the object allocates when used (a capacity, a
  number of bins), from 0 to what a file of its size may claim;
- `Literal[...]` and enums give the values allowed; `int` is a whole number in the int64
  range (never a bool, a float or a NaN); `float` is a float64 (NaN, which cw_lens stores for
  "not measured", and infinities included) or a whole number within its range;
- `list[X]`, `tuple[X, ...]`, `tuple[X, Y]`, `dict[K, V]`, unions and `None` as in Python;
  a class (a DataFrame, a graph, a registered cw_lens class) by `isinstance`; `Any` accepts
  any value the file format can hold (the format itself bounds those); `NoValue` none (a
  cache, `dict[str, NoValue]`, is stored empty).

Every field the schema lists must be present (those with a default may be absent in files of
older versions); a key the schema does not list is refused, and so is a key that names a
method, a property or a cached derived value of the class (`weights` of a contribution is
computed from the stored fields, never read from a file).

Examples:
    >>> from cw_lens.core.schema import schema_of
    >>> from cw_lens.analyses.contributions import ContributionResult
    >>> schema = schema_of(ContributionResult)
    >>> schema.fields["attention"].dtypes
    ('float32',)
    >>> "weights" in schema.fields
    False
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import types
import typing
from collections.abc import Mapping, Sequence
from typing import Annotated, Any, Literal, Union

import numpy as np
import torch
from jaxtyping import AbstractArray

from cw_lens.core.errors import InputError

INT_BOUND = 2**63  # ints are in [-INT_BOUND, INT_BOUND): the int64 range
FLOAT_BOUND = float(np.finfo(np.float64).max)  # the largest whole number a float field holds


@dataclasses.dataclass(frozen=True)
class Axes:
    """The named axes of a list field, one name per nesting level (`Axes("batch pos")`).

    Used as `Annotated[list[list[str]], Axes("batch pos")]`: the list is as long as the
    object's `batch` axis and each of its items as long as `pos`.
    """

    spec: str

    @property
    def names(self) -> tuple[str, ...]:
        """The axis names, outermost first."""
        return tuple(self.spec.split())


class NoValue:
    """The type of no value: a `dict[str, NoValue]` field (a cache) is stored empty, and a file
    that fills it is refused (the cache would be read instead of computed)."""

    def __new__(cls) -> NoValue:
        raise TypeError("NoValue has no instances.")


@dataclasses.dataclass(frozen=True)
class Count:
    """A number of items the object allocates when it is used (`Annotated[int, Count()]`): a
    whole number from 0 to what the file may claim (`cw_lens.core.loading.MIN_CLAIM` plus 8
    items per byte of the file), so that a few bytes cannot ask for terabytes."""


@dataclasses.dataclass(frozen=True)
class MaskedRows:
    """Each item of a list field is as long as the True entries of the same row of a mask
    field (`Annotated[list[list[str]], Axes("batch"), MaskedRows("mask")]`: the tokens of each
    row, its padding left out)."""

    mask: str


@dataclasses.dataclass(frozen=True)
class Schema:
    """What a stored object of a class holds.

    Attributes:
        cls: The class.
        fields: `{field name: type hint}`, every field a file stores.
        optional: The fields that may be absent (they have a default).
        equal_axes: `{axis name: the name it is one axis with}`.
        derived: Names of the class's methods, properties and cached derived values.
    """

    cls: type
    fields: dict[str, Any]
    optional: frozenset[str]
    equal_axes: dict[str, str]
    derived: frozenset[str]

    @property
    def name(self) -> str:
        """The class's name in messages."""
        return self.cls.__qualname__


def _hints(cls: type, names: Any) -> dict[str, Any]:
    hints = typing.get_type_hints(cls, include_extras=True)
    return {name: hints[name] for name in names}


def _derived(cls: type) -> frozenset[str]:
    """The names a file may never store: the class's methods, properties and cached values."""
    out = set()
    for klass in cls.__mro__:
        if klass is object:
            continue
        for name, value in vars(klass).items():
            if callable(value) or isinstance(
                value, (property, functools.cached_property, staticmethod, classmethod)
            ):
                out.add(name)
    return frozenset(out)


@functools.cache
def schema_of(cls: type) -> Schema:
    """The schema of a registered class (see the module docstring).

    Args:
        cls: A class registered with `cw_lens.core.registry.saveable`.

    Returns:
        Its schema.

    Raises:
        TypeError: when the class declares no schema (a defect of cw_lens, caught by its
            tests).
    """
    optional: set[str] = set()
    if "stored_fields" in vars(cls):
        fields = dict(cls.stored_fields)  # type: ignore[attr-defined]
        optional = set(getattr(cls, "optional_fields", ()))
    elif "stored_items" in vars(cls):
        fields = {}
    elif dataclasses.is_dataclass(cls):
        declared = dataclasses.fields(cls)
        fields = _hints(cls, [f.name for f in declared])
        optional = {
            f.name
            for f in declared
            if f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING
        }
    elif issubclass(cls, tuple) and hasattr(cls, "_fields"):
        fields = _hints(cls, cls._fields)
    elif issubclass(cls, enum.Enum):
        fields = {}
    else:
        raise TypeError(f"{cls.__qualname__} is saveable but declares no stored fields.")
    equal: dict[str, str] = {}
    for group in getattr(cls, "equal_axes", ()):
        for axis in group:
            equal[axis] = group[0]
    return Schema(cls, fields, frozenset(optional), equal, _derived(cls) - set(fields))


# --------------------------------------------------------------------------- checking values


class Mismatch(Exception):
    """A value that does not fit its hint (turned into an InputError naming the field)."""


def describe(hint: Any) -> str:
    """A type hint in words, for messages.

    Args:
        hint: A type hint.

    Returns:
        Its short description.
    """
    if isinstance(hint, type) and issubclass(hint, AbstractArray):
        skip = ("float4", "float8", "int2", "int4", "uint2", "uint4", "bool_")
        dtypes = "/".join(d for d in hint.dtypes if not d.startswith(skip))
        return f"a {dtypes} tensor [{hint.dim_str}]"
    if hint is type(None) or hint is None:
        return "None"
    if isinstance(hint, type):
        return hint.__qualname__
    return str(hint).replace("typing.", "")


def found(value: Any) -> str:
    """What a value is, for messages (its type, dtype and shape; never its contents).

    Args:
        value: Any value.

    Returns:
        A short description.
    """
    if isinstance(value, torch.Tensor):
        return f"a {str(value.dtype).removeprefix('torch.')} tensor of shape {list(value.shape)}"
    if isinstance(value, (list, tuple, dict)):
        return f"a {type(value).__name__} of length {len(value)}"
    if isinstance(value, (bool, int, float)) or value is None:
        text = repr(value)
        return text if len(text) <= 40 else f"a {len(text)}-digit {type(value).__name__}"
    if isinstance(value, str):
        return repr(value[:40])
    return f"a {type(value).__module__}.{type(value).__qualname__}"


class _Checker:
    """Checks the values of one object's fields, binding its named axes.

    Args:
        schema: The schema of the object's class.
        claim: The most items a count may claim (`Count`).
    """

    def __init__(self, schema: Schema, claim: int) -> None:
        self.schema = schema
        self.claim = claim
        self.dims: dict[str, Any] = {}
        self.where: dict[str, str] = {}  # axis -> the field that fixed it
        self.rows: list[tuple[str, Any, str]] = []  # (field, its value, its mask's field)

    def masked_rows(self, state: Mapping[str, Any]) -> None:
        # the `MaskedRows` fields against their masks, once every field is checked
        for field, value, mask_field in self.rows:
            mask = state.get(mask_field)
            if not isinstance(mask, torch.Tensor) or mask.dim() != 2:
                raise TypeError(f"{self.schema.name}.{field}: {mask_field} is not a 2-d mask")
            real = mask.sum(-1).tolist()
            if [len(row) for row in value] != real:
                raise Mismatch(
                    f"{field}: its rows must be as long as the real tokens of {mask_field} "
                    f"({real[:8]}), the file holds rows of {[len(r) for r in value][:8]}"
                )

    def _axis(self, name: str) -> str:
        return self.schema.equal_axes.get(name, name)

    def bind(self, axis: str, size: Any, field: str) -> None:
        axis = self._axis(axis)
        known = self.dims.get(axis)
        if known is None:
            self.dims[axis], self.where[axis] = size, field
        elif known != size:
            raise Mismatch(
                f"its axis {axis!r} has size {size}, but {known} in {self.where[axis]}"
                " (one axis has one size across the fields)"
            )

    def tensor(self, value: Any, hint: Any, field: str) -> None:
        if not isinstance(value, hint.array_type):
            raise Mismatch(f"expected {describe(hint)}, the file holds {found(value)}")
        dtype = str(value.dtype).removeprefix("torch.")
        if dtype not in hint.dtypes or not isinstance(value, hint):
            raise Mismatch(f"expected {describe(hint)}, the file holds {found(value)}")
        shape = tuple(value.shape)
        dims = list(hint.dims)
        variadic = [i for i, d in enumerate(dims) if "Variadic" in type(d).__name__]
        n_fixed = len(dims) - len(variadic)
        at = 0
        for i, dim in enumerate(dims):
            if i in variadic:
                width = len(shape) - n_fixed
                if getattr(dim, "name", None):
                    self.bind("*" + dim.name, shape[at : at + width], field)
                at += width
                continue
            name = getattr(dim, "name", None)
            if name and not getattr(dim, "broadcastable", False):
                self.bind(name, shape[at], field)
            at += 1

    def lengths(self, value: Any, axes: tuple[str, ...], field: str) -> None:
        if not axes:
            return
        if not isinstance(value, (list, tuple)):
            raise Mismatch(f"expected a list over the axes {list(axes)}, got {found(value)}")
        self.bind(axes[0], len(value), field)
        for item in value:
            self.lengths(item, axes[1:], field)

    def check(self, value: Any, hint: Any, field: str) -> None:
        if hint is Any or hint is object:
            return
        if isinstance(hint, str):  # an unresolved forward reference: a defect of cw_lens
            raise TypeError(f"{self.schema.name}.{field} has the unresolved hint {hint!r}")
        if hint is NoValue:  # a cache, which a file never fills
            raise Mismatch(
                f"expected nothing (cw_lens stores it empty), the file holds {found(value)}"
            )
        if hint is None or hint is type(None):
            if value is not None:
                raise Mismatch(f"expected None, the file holds {found(value)}")
            return
        if isinstance(hint, type) and issubclass(hint, AbstractArray):
            self.tensor(value, hint, field)
            return
        origin = typing.get_origin(hint)
        args = typing.get_args(hint)
        if origin is Annotated:
            self.check(value, args[0], field)
            for meta in args[1:]:
                if isinstance(meta, Axes):
                    self.lengths(value, meta.names, field)
                elif isinstance(meta, MaskedRows):
                    self.rows.append((field, value, meta.mask))
                elif isinstance(meta, Count) and not 0 <= value <= self.claim:
                    raise Mismatch(
                        f"expected a count from 0 to {self.claim} (what a file of this size "
                        f"may claim), the file holds {found(value)}"
                    )
            return
        if origin in (Union, types.UnionType):
            self.union(value, args, field)
            return
        if origin is Literal:
            if not any(type(value) is type(a) and value == a for a in args):
                raise Mismatch(f"expected one of {list(args)}, the file holds {found(value)}")
            return
        if origin is typing.ClassVar:
            raise TypeError(f"{self.schema.name}.{field} is a ClassVar, not a field")
        if origin is not None:
            self.container(value, hint, origin, args, field)
            return
        self.plain(value, hint)

    def union(self, value: Any, args: tuple, field: str) -> None:
        problems = []
        for arm in args:
            saved = dict(self.dims), dict(self.where)
            try:
                self.check(value, arm, field)
                return
            except Mismatch as exc:
                problems.append(str(exc))
                self.dims, self.where = saved
        expected = " or ".join(describe(a) for a in args)
        if value is not None and len(args) == 2 and type(None) in args:
            raise Mismatch(problems[0] if args[1] is type(None) else problems[1])
        raise Mismatch(f"expected {expected}, the file holds {found(value)}")

    def container(self, value: Any, hint: Any, origin: Any, args: tuple, field: str) -> None:
        if origin in (list, Sequence) or origin is typing.Sequence:
            kinds: tuple[type, ...] = (list,) if origin is list else (list, tuple)
            if not isinstance(value, kinds):
                raise Mismatch(f"expected {describe(hint)}, the file holds {found(value)}")
            for item in value:
                self.check(item, args[0] if args else Any, field)
        elif origin is tuple:
            if not isinstance(value, tuple):
                raise Mismatch(f"expected {describe(hint)}, the file holds {found(value)}")
            if len(args) == 2 and args[1] is Ellipsis:
                for item in value:
                    self.check(item, args[0], field)
            elif args and args != ((),):
                if len(value) != len(args):
                    raise Mismatch(f"expected {describe(hint)}, the file holds {found(value)}")
                for item, arm in zip(value, args, strict=True):
                    self.check(item, arm, field)
        elif origin in (dict, Mapping):
            if not isinstance(value, dict):
                raise Mismatch(f"expected {describe(hint)}, the file holds {found(value)}")
            key_hint, value_hint = args if args else (Any, Any)
            for k, v in value.items():
                self.check(k, key_hint, field)
                self.check(v, value_hint, field)
        elif origin in (set, frozenset):
            if not isinstance(value, origin):
                raise Mismatch(f"expected {describe(hint)}, the file holds {found(value)}")
            for item in value:
                self.check(item, args[0] if args else Any, field)
        elif isinstance(origin, type):
            self.plain(value, origin)
        else:
            raise TypeError(f"{self.schema.name}.{field}: cw_lens cannot check the hint {hint}")

    def plain(self, value: Any, hint: Any) -> None:
        if hint is bool:
            ok = isinstance(value, (bool, np.bool_))
        elif hint is int:
            ok = isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))
            if ok and not -INT_BOUND <= int(value) < INT_BOUND:
                raise Mismatch(f"expected a whole number in the int64 range, got {found(value)}")
        elif hint is float:
            ok = isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(
                value, (bool, np.bool_)
            )
            # NaN ("not measured") and infinities are floats cw_lens writes; a whole number
            # beyond float64's range is not
            if ok and isinstance(value, (int, np.integer)) and not abs(int(value)) <= FLOAT_BOUND:
                raise Mismatch(f"expected a number within float64's range, got {found(value)}")
        elif isinstance(hint, type):
            ok = isinstance(value, hint)
        else:
            raise TypeError(f"{self.schema.name}: cw_lens cannot check the hint {hint!r}")
        if not ok:
            raise Mismatch(f"expected {describe(hint)}, the file holds {found(value)}")


def check_keys(schema: Schema, keys: Sequence[Any]) -> None:
    """Refuse, before anything is decoded, a stored object whose keys are not its fields.

    Args:
        schema: The class's schema.
        keys: The keys the file stores for the object.

    Raises:
        InputError: naming the class and the first key that is not a field (a method, a
            property, a derived value, or a name the class does not have), or a field that is
            missing.
    """
    fields = schema.fields
    for key in keys:
        if key in fields:
            continue
        if key in schema.derived:
            raise InputError(
                f"A stored {schema.name} has a value for {str(key)[:100]!r}, which is a method, "
                f"property or derived value of {schema.name}, never read from a file (its "
                f"stored fields: {sorted(fields)})."
            )
        raise InputError(
            f"A stored {schema.name} has the field {str(key)[:100]!r}, which {schema.name} "
            f"does not have (its stored fields: {sorted(fields)})."
        )
    missing = sorted(set(fields) - set(keys) - schema.optional)
    if missing:
        raise InputError(f"A stored {schema.name} lacks the fields {missing}.")


def check_state(schema: Schema, state: Mapping[str, Any], *, claim: int = 1 << 20) -> None:
    """Check an object's decoded fields against its class's schema, before it is built.

    Args:
        schema: The class's schema.
        state: `{field name: value}` as decoded from the file.
        claim: The most items a `Count` field may claim (set by the file's size).

    Raises:
        InputError: naming the class, the field and what was expected.
    """
    check_keys(schema, list(state))
    checker = _Checker(schema, claim)
    for name, value in state.items():
        try:
            checker.check(value, schema.fields[name], name)
        except Mismatch as exc:
            raise InputError(f"A stored {schema.name} has a wrong {name}: {exc}.") from None
    try:
        checker.masked_rows(state)
    except Mismatch as exc:
        raise InputError(f"A stored {schema.name} has a wrong {exc}.") from None


def check_value(schema: Schema, value: Any, hint: Any, what: str, *, claim: int = 1 << 20) -> None:
    """Check one value (the items of a container class) against a hint.

    Args:
        schema: The schema of the class that holds it.
        value: The decoded value.
        hint: The hint it must fit.
        what: What the value is, for the message.
        claim: The most items a `Count` may claim (set by the file's size).

    Raises:
        InputError: naming the class and what was expected.
    """
    try:
        _Checker(schema, claim).check(value, hint, what)
    except Mismatch as exc:
        raise InputError(f"A stored {schema.name} has wrong {what}: {exc}.") from None
