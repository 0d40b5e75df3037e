"""Every saveable class has a schema, checked before the object is built: a valid file
round-trips, and every single-field mutation of type, dtype, shape, size or name — generated
from the schema — is refused with an `InputError`.

The writer writes only what the loader reads. The rows of issue 51's "Result files" table
(hand edits of a real result that 0.4.1 loaded) are tests of tests/test_files_from_others.py.
"""

from __future__ import annotations

import json
import math
import typing
from pathlib import Path
from typing import Annotated, Any, Literal, Union

import numpy as np
import pandas as pd
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from jaxtyping import AbstractArray
from safetensors import safe_open
from safetensors.torch import save_file

# the instances of every result class, and the exact comparison, of the result protocol's tests
from test_results import _assert_same, model, results  # noqa: F401  (fixtures)

import cw_lens
from cw_lens import reproduction
from cw_lens.core.errors import InputError
from cw_lens.core.loading import read_file
from cw_lens.core.registry import class_name, registered_classes
from cw_lens.core.results import Result
from cw_lens.core.saving import FORMAT, STEP_FORMAT, TYPE, object_state, write_file
from cw_lens.core.schema import Axes, Count, MaskedRows, schema_of

MEMORY_BOUND = 64 << 20  # bytes a hostile load may allocate (tracemalloc's peak)
MUTATIONS = settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
    database=None,
)


# --------------------------------------------------------------------------- instances


def _walk(value: Any, found: dict[str, Any], depth: int = 0) -> None:
    """Every registered object inside `value` (the first of each class) into `found`."""
    if depth > 12:
        return
    cls = type(value)
    name = class_name(cls)
    if name in registered_classes() and name not in found:
        found[name] = value
    if isinstance(value, dict):
        for v in value.values():
            _walk(v, found, depth + 1)
    elif isinstance(value, (list, tuple)):
        for v in value:
            _walk(v, found, depth + 1)
    elif cls.__module__.startswith("cw_lens") and not isinstance(value, (dict, tuple)):
        state = object_state(value)
        _walk(state, found, depth + 1)


@pytest.fixture(scope="module")
def instances(results):  # noqa: F811  (the fixture imported above)
    """One instance of every registered class: the results, what they hold, and the few
    classes no result holds by default (built small, the way their analyses build them)."""
    from cw_lens.analyses.selection.prf import PRF
    from cw_lens.analyses.sinks.detection import SinkSpec
    from cw_lens.reproduction.verdicts import ClaimsTable

    found: dict[str, Any] = {}
    for result in results.values():
        _walk(result, found)
    prf = PRF(*(torch.rand(2, 3, dtype=torch.float64) for _ in range(3)))
    claims = ClaimsTable(reproduction.claims(results["SinkStatisticsResult"]))
    for extra in (SinkSpec((0,)), prf, claims):
        _walk(extra, found)
    return found


def _save(value: Any, path: Path) -> None:
    if isinstance(value, Result):
        value.save(path)
    else:
        write_file(value, path, file_format=STEP_FORMAT)


def _load(value: Any, path: Path) -> Any:
    if isinstance(value, Result):
        return cw_lens.load_result(path)
    return read_file(path, file_format=STEP_FORMAT)


def _parts(path: Path) -> tuple[dict[str, str], Any, dict[str, torch.Tensor]]:
    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata()
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    return meta, json.loads(meta["content"]), tensors


def _write(path: Path, meta: dict[str, str], content: Any, tensors: dict) -> None:
    save_file(tensors, str(path), metadata={**meta, "content": json.dumps(content)})


ALL = sorted(registered_classes())


def test_every_saveable_class_has_a_schema_and_an_instance_here(instances):
    for name in ALL:
        schema = schema_of(registered_classes()[name])  # derivable: no TypeError, no NameError
        assert not set(schema.fields) & schema.derived, name
    assert sorted(instances) == ALL


def test_infinite_and_nan_floats_round_trip(instances, tmp_path):
    """A float field may hold what a computation gives: an infinity (a perplexity that
    overflowed) or a NaN ("not measured") loads as written."""
    import dataclasses

    value = instances["cw_lens.analyses.pruning.prune:PruningResult"]
    for number in (math.inf, -math.inf, math.nan):
        changed = dataclasses.replace(value, clean_ppl=number)
        path = tmp_path / "value.safetensors"
        _save(changed, path)
        loaded = _load(changed, path).clean_ppl
        assert loaded == number or (math.isnan(number) and math.isnan(loaded))


@pytest.mark.parametrize("name", ALL)
def test_a_valid_file_round_trips_equal(instances, name, tmp_path):
    value = instances[name]
    path = tmp_path / "value.safetensors"
    _save(value, path)
    loaded = _load(value, path)
    assert type(loaded) is type(value)
    state = object_state(value) if not isinstance(value, (dict, tuple)) else value
    again = object_state(loaded) if not isinstance(loaded, (dict, tuple)) else loaded
    if name.endswith("LayerSharesResult"):  # a stream of its block, set again when read
        state = {k: v for k, v in object_state(value).items() if k != "_stream"}
    _assert_same(state, again, name)


def test_no_two_loaded_tensors_share_memory(instances, tmp_path):
    """A tensor held by two fields (a streamed block's mask, its stream) is stored under a key
    of its own for each, and loads into tensors that share no storage."""
    for name in ("cw_lens.models.layer_contributions:LayerContributionsResult",
                 "cw_lens.flow.layer_shares:LayerSharesResult"):  # fmt: skip
        path = tmp_path / "block.safetensors"
        _save(instances[name], path)
        loaded = _load(instances[name], path)
        tensors: list[torch.Tensor] = []
        _tensors_in(loaded, tensors, set())
        pointers = [t.untyped_storage().data_ptr() for t in tensors if t.nbytes]
        assert len(pointers) == len(set(pointers)) > 3, name


def _tensors_in(value: Any, out: list, seen: set) -> None:
    if id(value) in seen:
        return
    seen.add(id(value))
    if isinstance(value, torch.Tensor):
        out.append(value)
    elif isinstance(value, dict):
        for v in value.values():
            _tensors_in(v, out, seen)
    elif isinstance(value, (list, tuple)):
        for v in value:
            _tensors_in(v, out, seen)
    elif type(value).__module__.startswith("cw_lens"):
        _tensors_in(object_state(value), out, seen)


# --------------------------------------------------------------------------- mutations


# a value of each kind, to put where the schema allows another kind
WRONG = {
    "int": 7,
    "float": 0.5,
    "str": "x",
    "bool": True,
    "none": None,
    "list": [1],
    "tuple": (1,),
    "dict": {"k": 1},
    "tensor": torch.zeros(2),
}


def _kinds(hint: Any) -> set[str]:
    """The kinds of `WRONG` a hint admits (everything for `Any`)."""
    if hint is Any or hint is object:
        return set(WRONG)
    if hint is None or hint is type(None):
        return {"none"}
    if isinstance(hint, type) and issubclass(hint, AbstractArray):
        return {"tensor"}
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is Annotated:
        return _kinds(args[0])
    if origin in (Union, __import__("types").UnionType):
        return set().union(*(_kinds(a) for a in args))
    if origin is Literal:
        return {type(a).__name__ for a in args}
    simple = {int: "int", float: "float", bool: "bool", str: "str", list: "list",
              tuple: "tuple", dict: "dict", torch.Tensor: "tensor"}  # fmt: skip
    kind = simple.get(origin or hint)
    if kind == "float":
        return {"float", "int"}
    return {kind} if kind else {"object"}


def _axis_fields(schema: Any) -> dict[str, list[str]]:
    """Which fields each named axis of a schema appears in."""
    fields: dict[str, list[str]] = {}
    for name, hint in schema.fields.items():
        for axis in _named_axes(hint):
            axis = schema.equal_axes.get(axis, axis)
            fields.setdefault(axis, []).append(name)
    return fields


def _named_axes(hint: Any) -> list[str]:
    if isinstance(hint, type) and issubclass(hint, AbstractArray):
        return [d.name for d in hint.dims if getattr(d, "name", None) and
                "Variadic" not in type(d).__name__]  # fmt: skip
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is Annotated:
        return [n for meta in args[1:] if isinstance(meta, Axes) for n in meta.names]
    if origin in (Union, __import__("types").UnionType):
        return [n for a in args for n in _named_axes(a)]
    return []


def _tensor_hint(hint: Any) -> Any:
    if isinstance(hint, type) and issubclass(hint, AbstractArray):
        return hint
    for arm in typing.get_args(hint):
        if isinstance(arm, type) and issubclass(arm, AbstractArray):
            return arm
    return None


DTYPES = [torch.float64, torch.float32, torch.float16, torch.int64, torch.int32, torch.bool]


def mutations_of(value: Any) -> list[tuple[str, str, Any]]:
    """Every single-field mutation the schema of `value`'s class refuses, as
    `(field, kind, what)`: `what` is the new value (`type`, `dtype`, `shape`, `size`), the new
    name (`name`), or `None` (`missing`)."""
    schema = schema_of(type(value))
    state = value._asdict() if hasattr(value, "_fields") else object_state(value)
    if isinstance(value, dict):  # ClaimsTable: its items
        claim = next(iter(value))
        return [(claim, "type", w) for k, w in WRONG.items() if k != "dict"]
    axes = _axis_fields(schema)
    out: list[tuple[str, str, Any]] = []
    for field, hint in schema.fields.items():
        if field not in state:
            continue
        current = state[field]
        allowed = _kinds(hint)
        out += [(field, "type", w) for k, w in WRONG.items() if k not in allowed]
        if "int" in allowed and "float" not in allowed and hint is not Any:
            out.append((field, "type", 10**400))
        if "float" in allowed and len(allowed) < len(WRONG):
            out.append((field, "type", 10**400))  # a whole number beyond float64's range
        if typing.get_origin(hint) is Literal:
            out.append((field, "type", "not one of them"))
        tensor_hint = _tensor_hint(hint)
        if tensor_hint is not None and isinstance(current, torch.Tensor):
            out += [
                (field, "dtype", current.to(d))
                for d in DTYPES
                if str(d).removeprefix("torch.") not in tensor_hint.dtypes
            ][:2]
            if not any("Variadic" in type(d).__name__ for d in tensor_hint.dims):
                out.append((field, "shape", current[None]))
            for i, axis in enumerate(_named_axes(tensor_hint)):
                if len(axes.get(schema.equal_axes.get(axis, axis), [])) > 1:
                    grown = torch.cat([current, current.narrow(i, 0, 1)], i)
                    out.append((field, "size", grown if current.shape[i] else current))
                    break
        if isinstance(current, list) and _named_axes(hint):
            axis = _named_axes(hint)[0]
            if len(axes.get(schema.equal_axes.get(axis, axis), [])) > 1:
                out.append((field, "size", [*current, *current[:1]] or [[]]))
        if any(isinstance(m, Count) for m in typing.get_args(hint)[1:]):
            out += [(field, "size", -1), (field, "size", 2**40)]  # more than a file may claim
        masked = [m for m in typing.get_args(hint)[1:] if isinstance(m, MaskedRows)]
        if masked and current and current[0]:
            out.append((field, "size", [current[0][:-1], *current[1:]]))
        out.append((field, "name", "not_a_field"))
        out += [(field, "name", n) for n in sorted(schema.derived)[:2]]
        if field not in schema.optional:
            out.append((field, "missing", None))
    return out


def _encoded(value: Any, folder: Path, prefix: str) -> tuple[Any, dict[str, torch.Tensor]]:
    """`value` as a file's JSON and tensors (keys renamed with `prefix`)."""
    path = folder / "piece.safetensors"
    write_file(value, path, file_format=STEP_FORMAT)
    _, content, tensors = _parts(path)

    def rename(v: Any) -> Any:
        if isinstance(v, list):
            return [rename(x) for x in v]
        if isinstance(v, dict):
            out = {k: rename(x) for k, x in v.items()}
            if "key" in out and isinstance(out["key"], str):
                out["key"] = prefix + out["key"]
            return out
        return v

    return rename(content), {prefix + k: t for k, t in tensors.items()}


def _mutated_file(value: Any, mutation: tuple, folder: Path) -> Path:
    field, kind, what = mutation
    path = folder / "value.safetensors"
    _save(value, path)
    meta, content, tensors = _parts(path)
    if hasattr(value, "_fields"):  # a NamedTuple: its items by position
        index = list(value._fields).index(field)
        piece, extra = _encoded(what, folder, "mutated.")
        content["items"][index] = piece
        tensors.update(extra)
    elif isinstance(value, dict):
        piece, extra = _encoded(what, folder, "mutated.")
        for item in content["items"]:
            if item[0] == field:
                item[1] = piece
        tensors.update(extra)
    else:
        state = content["state"]
        if kind == "name":
            state[what] = state.pop(field)
        elif kind == "missing":
            del state[field]
        else:
            state[field], extra = _encoded(what, folder, "mutated.")
            tensors.update(extra)
    out = folder / "mutated.safetensors"
    _write(out, meta, content, tensors)
    return out


@pytest.mark.parametrize("name", ALL)
def test_every_single_field_mutation_is_refused(instances, name, tmp_path):
    value = instances[name]
    options = mutations_of(value)
    kinds = {kind for _, kind, _ in options}
    assert {"type"} | (set() if isinstance(value, dict) else {"name"}) <= kinds, kinds

    @MUTATIONS
    @given(mutation=st.sampled_from(options))
    def check(mutation):
        path = _mutated_file(value, mutation, tmp_path)
        with pytest.raises(InputError, match=schema_of(type(value)).name):
            _load(value, path)

    check()


def test_the_mutations_cover_dtype_shape_and_size(instances):
    kinds = {kind for value in instances.values() for _, kind, _ in mutations_of(value)}
    assert kinds == {"type", "dtype", "shape", "size", "name", "missing"}


# --------------------------------------------------------------------------- the writer


def test_every_file_cw_lens_writes_names_only_plain_dtypes(results, tmp_path):  # noqa: F811
    """What the loader refuses, the writer never writes: no string or object arrays, no
    tensor key used twice, column dtypes from the list the loader reads."""
    from cw_lens.core.saving import PANDAS_DTYPES

    for name, result in results.items():
        path = tmp_path / f"{name}.safetensors"
        result.save(path)
        _, content, tensors = _parts(path)
        keys: list[str] = []
        _collect(content, keys)
        assert len(keys) == len(set(keys)) == len(tensors), name
    with pytest.raises(InputError, match="cannot be saved"):
        write_file({"a": np.array(["x"])}, tmp_path / "s.safetensors", file_format=FORMAT)
    frame = pd.DataFrame({"t": pd.to_datetime(["2020-01-01"]).tz_localize("UTC")})
    with pytest.raises(InputError, match="cannot be saved"):
        write_file(frame, tmp_path / "t.safetensors", file_format=FORMAT)
    assert "object" in PANDAS_DTYPES and "float64" in PANDAS_DTYPES


def _collect(value: Any, keys: list[str]) -> None:
    if isinstance(value, dict):
        if value.get(TYPE) in ("tensor", "ndarray"):
            assert "key" in value, value
            keys.append(value["key"])
        for v in value.values():
            _collect(v, keys)
    elif isinstance(value, list):
        for v in value:
            _collect(v, keys)
