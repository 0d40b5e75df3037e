"""Files from someone else run no code: hostile result files, run folders and GGUF files end in an
`InputError` / `ModelLoadError` or a clean result — never another exception, a hang, memory
beyond a small bound, or a file touched outside the test's folder.

The inputs are generated (hypothesis): random JSON in a result's content, mutations of a real
result's content at random places (wrong `$type`s, dtypes, shapes, tensor keys, ids), deep
nesting, class names that reach other libraries' classes through a cw_lens module's attributes;
GGUF files cut at every section or with absurd counts, lengths, dimensions, alignment and
offsets; `summary.json` and `replicates.npz` damaged the same ways.
"""

from __future__ import annotations

import copy
import hashlib
import importlib
import io
import json
import pkgutil
import struct
import sys
import tracemalloc
import types
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import save_file

import cw_lens
from cw_lens.core.errors import InputError, ModelLoadError
from cw_lens.core.loading import MAX_DEPTH
from cw_lens.core.registry import SAVEABLE_MODULES, registered_classes
from cw_lens.core.saving import FORMAT, TYPE
from cw_lens.models.testing import tiny_llama

SETTINGS = settings(
    max_examples=120,
    deadline=5000,  # ms per example: a hang fails
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
    database=None,
)
MEMORY_BOUND = 64 << 20  # bytes any one hostile load may allocate (tracemalloc's peak)
TEXTS = ["The quick brown fox jumps over the lazy dog.", "Some heads look at the first token."]
TYPES = ["float", "NA", "tensor", "ndarray", "numpy.scalar", "DataFrame", "Series",
         "RangeIndex", "MultiIndex", "Index", "torch.dtype", "torch.device", "slice", "range",
         "path", "enum", "networkx", "dict", "list", "tuple", "set", "frozenset", "object",
         "ref", "bogus"]  # fmt: skip
KEYS = ["key", "class", "items", "id", "state", "value", "dtype", "shape", "name", "start",
        "stop", "step", "index", "columns", "data", "levels", "codes", "names", "array",
        "graph", "nodes", "edges", "attrs"]  # fmt: skip
DTYPES = ["<f4", "<f8", "<i8", "|b1", "|O", "<U10", "|V8", "i4,O", "<M8[ns]", "(2,)f4", "int64",
          "object", "string", "category", "float32", "bfloat16", "", "nonsense"]  # fmt: skip


# --------------------------------------------------------------------------- the generators

scalars = (
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=12)
    | st.sampled_from(TYPES + KEYS + DTYPES)
)
json_values = st.recursive(
    scalars,
    lambda inner: (
        st.lists(inner, max_size=4)
        | st.dictionaries(st.sampled_from([TYPE, *KEYS]) | st.text(max_size=6), inner, max_size=5)
    ),
    max_leaves=25,
)
typed_values = st.recursive(
    st.builds(lambda kind: {TYPE: kind}, st.sampled_from(TYPES)),
    lambda inner: st.builds(
        lambda kind, extra: {TYPE: kind, **extra},
        st.sampled_from(TYPES),
        st.dictionaries(st.sampled_from(KEYS), inner | json_values, max_size=5),
    ),
    max_leaves=15,
)


def _paths(value: Any, here: tuple = ()) -> list[tuple]:
    """Every place in a JSON value (a path of keys and indices)."""
    out = [here]
    if isinstance(value, dict):
        for k, v in value.items():
            out += _paths(v, (*here, k))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            out += _paths(v, (*here, i))
    return out


def _mutated(value: Any, path: tuple, how: str, new: Any) -> Any:
    """`value` with the place `path` replaced by `new`, deleted, or its `$type`/`class`/`dtype`/
    `shape`/`key`/`id` (where it has one) set to `new`."""
    out = copy.deepcopy(value)
    if not path:
        return new
    *parent_path, last = path
    parent = out
    for step in parent_path:
        parent = parent[step]
    if how == "delete" and isinstance(parent, dict):
        del parent[last]
    elif how == "field" and isinstance(parent[last], dict):
        target = parent[last]
        field = next(
            (k for k in (TYPE, "class", "dtype", "shape", "key", "id") if k in target), TYPE
        )
        target[field] = new
    else:
        parent[last] = new
    return out


def mutations(content: Any):
    """A strategy of `content` damaged at one random place."""
    places = _paths(content)
    return st.builds(
        lambda i, how, new: _mutated(content, places[i % len(places)], how, new),
        st.integers(0, len(places) - 1),
        st.sampled_from(["replace", "delete", "field"]),
        json_values | typed_values,
    )


def _reachable_classes() -> list[str]:
    """`module:qualname` names of classes that are not registered but that a walk of
    attributes from a cw_lens module reaches (numpy's, tempfile's, pathlib's, torch's...)."""
    registered = set(registered_classes())
    names = set()
    for info in pkgutil.walk_packages(cw_lens.__path__, "cw_lens."):
        if info.name.endswith("__main__"):
            continue
        module = importlib.import_module(info.name)
        for attr, value in vars(module).items():
            reach = [(attr, value)]
            if isinstance(value, types.ModuleType):
                reach += [(f"{attr}.{a}", v) for a, v in list(vars(value).items())]
            for qualname, obj in reach:
                name = f"{info.name}:{qualname}"
                if isinstance(obj, type) and name not in registered:
                    names.add(name)
    return sorted(names)


# --------------------------------------------------------------------------- the checks


class Outside:
    """A file outside the test's folder, which no hostile input may touch."""

    def __init__(self, folder: Path) -> None:
        self.path = folder / "precious.txt"
        self.path.write_text("keep me")

    def intact(self) -> bool:
        return self.path.is_file() and self.path.read_text() == "keep me"


def _bounded(call) -> Any:
    """`call()`, asserting its allocations (Python and numpy, traced) stay under the bound."""
    tracemalloc.start()
    try:
        return call()
    finally:
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        assert peak < MEMORY_BOUND, f"a hostile input allocated {peak / 2**20:.0f} MiB"


def _write_result(path: Path, content: Any, tensors: dict[str, torch.Tensor], cls: str) -> None:
    metadata = {"format": FORMAT, "format_version": "1", "cw_lens_version": "0", "class": cls}
    metadata["content"] = json.dumps(content)
    save_file(tensors, str(path), metadata=metadata)


def _loads_cleanly_or_refuses(path: Path) -> None:
    try:
        loaded = _bounded(lambda: cw_lens.load_result(path))
    except InputError:
        return
    assert isinstance(loaded, cw_lens.Result)


# --------------------------------------------------------------------------- load_result


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Real result files (accumulators and frames; a graph; contribution tensors; tables) and
    their content and tensors."""
    from safetensors import safe_open

    model = tiny_llama(seed=0, n_layers=2)
    folder = tmp_path_factory.mktemp("saved")
    out = {}
    for name, result in {
        "stats": cw_lens.sink_statistics(model, TEXTS, min_query=2, progress=False),
        "routes": cw_lens.routes(model, TEXTS[0]),
        "cw": cw_lens.contribution_weights(model, TEXTS, layers=[1]),
        "ioi": cw_lens.IOIRouteStatisticsResult(
            items=pd.DataFrame({"reaches_io": [1.0, 0.0], "n_edges": [3, 4]}),
            heads=pd.DataFrame({"layer": [1, 0], "head": [0, 2], "io_items": [3, 5]}),
            threshold=0.02,
        ),
    }.items():
        path = folder / f"{name}.safetensors"
        result.save(path)
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata()
            tensors = {k: f.get_tensor(k) for k in f.keys()}
        out[name] = (json.loads(meta["content"]), tensors, meta["class"])
    return out


@pytest.mark.parametrize("name", ["stats", "routes"])
def test_a_result_damaged_anywhere_loads_cleanly_or_is_refused(saved, name, tmp_path_factory):
    content, tensors, cls = saved[name]
    folder = tmp_path_factory.mktemp("damaged")
    outside = Outside(tmp_path_factory.mktemp("outside"))

    @SETTINGS
    @given(damaged=mutations(content))
    def check(damaged):
        path = folder / "damaged.safetensors"
        _write_result(path, damaged, tensors, cls)
        _loads_cleanly_or_refuses(path)

    check()
    assert outside.intact()


@SETTINGS
@given(content=json_values | typed_values, tensor_keys=st.lists(st.text(max_size=4), max_size=3))
def test_random_content_loads_cleanly_or_is_refused(tmp_path_factory, content, tensor_keys):
    path = tmp_path_factory.mktemp("random") / "random.safetensors"
    tensors = {k or "t": torch.zeros(2, dtype=torch.float32) for k in tensor_keys}
    _write_result(path, content, tensors, "cw_lens.core.results:Result")
    _loads_cleanly_or_refuses(path)


@settings(max_examples=30, deadline=5000, database=None)
@given(depth=st.integers(1, 3 * MAX_DEPTH), kind=st.sampled_from(["list", "object", "dict"]))
def test_deep_nesting_is_refused_not_a_recursion_error(tmp_path_factory, depth, kind):
    value: Any = 0
    for _ in range(depth):
        if kind == "list":
            value = [value]
        elif kind == "dict":
            value = {TYPE: "dict", "items": [["k", value]]}
        else:
            value = {TYPE: "object", "class": "cw_lens.core.histograms:Histogram", "id": 0,
                     "state": {"x": value}}  # fmt: skip
    path = tmp_path_factory.mktemp("deep") / "deep.safetensors"
    _write_result(path, value, {}, "cw_lens.core.results:Result")
    with pytest.raises(InputError):  # too deep, or not a result
        cw_lens.load_result(path)


REACHABLE = _reachable_classes()


def test_the_reachable_classes_include_the_dangerous_ones():
    """The generator below offers what an attacker would: other libraries' classes reached
    through a cw_lens module's imports."""
    assert len(REACHABLE) > 1000
    assert any(name.endswith(":tempfile.TemporaryDirectory") for name in REACHABLE)
    assert any(name.endswith(":np.ndarray") for name in REACHABLE)
    assert "cw_lens.core.saving:pathlib.Path" in REACHABLE


@SETTINGS
@given(
    name=st.sampled_from(REACHABLE) | st.text(max_size=40),
    kind=st.sampled_from(["object", "enum", "list", "tuple", "dict", "set", "frozenset"]),
    items=json_values,
)
def test_a_class_that_is_not_registered_is_refused_before_anything_is_built(
    tmp_path_factory, name, kind, items
):
    spec = {TYPE: kind, "class": name, "id": 0, "state": {"name": items}, "value": items}
    spec["items"] = [] if kind == "dict" else [items]
    path = tmp_path_factory.mktemp("class") / "class.safetensors"
    _write_result(path, {"field": spec}, {}, "cw_lens.core.results:Result")
    with pytest.raises(InputError, match=r"not a cw_lens result|not a class cw_lens reads"):
        cw_lens.load_result(path)


class Planted:
    """A class an attacker reaches through a cw_lens module's attributes; it counts the
    instances made."""

    made = 0

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        Planted.made += 1
        return super().__new__(cls)

    def __init__(self, *args: Any) -> None:
        pass


@pytest.mark.parametrize("kind", ["object", "list", "tuple", "set"])
def test_a_class_reached_through_a_module_attribute_is_never_built(tmp_path, monkeypatch, kind):
    """The defect 0.4.0 had: a name walked from `cw_lens.core.saving` to any attribute (here a
    planted class; in the wild `tempfile.TemporaryDirectory`, `np.*`) was built — called with
    the items, or created and given the file's attributes."""
    monkeypatch.setattr("cw_lens.core.saving.Planted", Planted, raising=False)
    Planted.made = 0
    spec = {TYPE: kind, "class": "cw_lens.core.saving:Planted", "id": 0, "state": {"a": 1},
            "items": [1, 2]}  # fmt: skip
    path = tmp_path / "planted.safetensors"
    _write_result(path, spec, {}, "cw_lens.core.saving:Planted")
    with pytest.raises(InputError, match="not a class cw_lens reads"):
        cw_lens.load_result(path)
    assert Planted.made == 0


def test_registered_classes_are_the_decorated_ones_and_run_no_finaliser():
    """`SAVEABLE_MODULES` lists exactly the modules with registered classes, and no registered
    class has a `__del__` that a half-built object from a damaged file would run."""
    classes = registered_classes()
    assert {name.partition(":")[0] for name in classes} == set(SAVEABLE_MODULES)
    assert not [name for name, cls in classes.items() if hasattr(cls, "__del__")]
    for info in pkgutil.walk_packages(cw_lens.__path__, "cw_lens."):
        if not info.name.endswith("__main__"):
            importlib.import_module(info.name)
    assert registered_classes() == classes  # importing everything registers nothing more


# --------------------------------------------------------------------------- issue 51's edits
# Each row of the "Result files" table: a real result's JSON edited by hand, which 0.4.1 loaded
# (a silent wrong number, a shadowed method, a shared buffer, wrong shapes, dtypes and numbers,
# memory out of proportion to the file, a file opened). Each is refused with an InputError
# that names the class and the field.


def _edited(saved: dict, name: str, folder: Path, edit) -> Path:
    content, tensors, cls = saved[name]
    content, tensors = copy.deepcopy(content), dict(tensors)
    edit(content["state"], tensors)
    path = folder / "edited.safetensors"
    _write_result(path, content, tensors, cls)
    return path


def _refused(path: Path, match: str) -> None:
    with pytest.raises(InputError, match=match):
        cw_lens.load_result(path)


def test_a_stored_derived_field_is_refused(saved, tmp_path):
    """A stored `weights` of 0.999 (a cached property) was read from the file: a silent wrong
    number, not `attention * relative_norm * cosine`."""

    def edit(state, tensors):
        tensors["weights"] = torch.full_like(tensors["attention"], 0.999)
        state["weights"] = {TYPE: "tensor", "key": "weights"}

    _refused(_edited(saved, "cw", tmp_path, edit), r"'weights'.*never read from a file")


@pytest.mark.parametrize("method", ["save", "to_html", "top"])
def test_a_field_named_after_a_method_is_refused(saved, tmp_path, method):
    def edit(state, tensors):
        state[method] = 1

    _refused(_edited(saved, "cw", tmp_path, edit), rf"ContributionResult.*'{method}'.*method")


def test_a_tensor_used_by_two_fields_is_refused(saved, tmp_path):
    def edit(state, tensors):
        state["cosine"] = {TYPE: "tensor", "key": state["attention"]["key"]}

    _refused(_edited(saved, "cw", tmp_path, edit), r"ContributionResult.cosine.*twice")


@pytest.mark.parametrize(
    ("field", "change", "match"),
    [
        ("attention", lambda t: torch.zeros(3), r"wrong attention: expected a float32 tensor"),
        ("mask", lambda t: t.float(), r"wrong mask: expected a bool tensor"),
        (
            "tokens",
            lambda t: torch.cat([t, t[:, :1]], 1),
            r"wrong tokens: its axis 'pos' has size \d+, but",
        ),
        ("attention", lambda t: t.double() * 50, r"wrong attention: .*a float64 tensor"),
    ],
    ids=["zeros(3)", "float mask", "tokens one longer", "float64 x50"],
)
def test_a_tensor_of_a_wrong_shape_or_dtype_is_refused(saved, tmp_path, field, change, match):
    def edit(state, tensors):
        key = state[field]["key"]
        tensors[key] = change(tensors[key])

    _refused(_edited(saved, "cw", tmp_path, edit), match)


def test_token_strings_that_do_not_match_the_tokens_are_refused(saved, tmp_path):
    def edit(state, tensors):
        state["str_tokens"][0].pop()

    _refused(_edited(saved, "cw", tmp_path, edit), r"wrong str_tokens: its rows must be as long")


def test_float_bits_read_as_integers_are_refused(saved, tmp_path):
    """A float column's array relabelled as integers (the same bytes read as int64)."""

    def edit(state, tensors):
        def retype(v):
            if isinstance(v, dict):
                if v.get(TYPE) == "ndarray" and v.get("dtype") == "<f8":
                    v["dtype"] = "<i8"
                for x in v.values():
                    retype(x)
            elif isinstance(v, list):
                for x in v:
                    retype(x)

        retype(state)

    _refused(_edited(saved, "ioi", tmp_path, edit), r"<i8 is stored as a float64 tensor")


@pytest.mark.parametrize("number", [10**400, {TYPE: "float", "value": "nan"}, 1.5, True])
def test_a_count_that_is_not_a_bounded_whole_number_is_refused(saved, tmp_path, number):
    def edit(state, tensors):
        state["n_nan_rows"] = number

    _refused(_edited(saved, "cw", tmp_path, edit), r"ContributionResult has a wrong n_nan_rows")


def test_unknown_keys_are_refused(saved, tmp_path):
    def edit(state, tensors):
        state["payload"] = "extra"

    _refused(_edited(saved, "cw", tmp_path, edit), r"field 'payload'.*does not have")


def test_a_range_out_of_proportion_to_the_file_is_refused(saved, tmp_path):
    """`layers` as `range(0, 10**18)`: a raw MemoryError in `to_html()` in 0.4.1."""

    def edit(state, tensors):
        state["layers"] = {TYPE: "range", "items": [0, 10**18, 1]}

    _refused(_edited(saved, "cw", tmp_path, edit), r"range of 10+ items, out of proportion")


def test_string_items_claiming_gigabytes_are_refused_without_allocating(saved, tmp_path):
    """Four arrays of `<U60000000` in a few hundred bytes of JSON held 915 MB in 0.4.1."""

    def edit(state, tensors):
        item = {TYPE: "ndarray", "dtype": "<U60000000", "shape": [1], "items": ["a"]}
        state["meta"] = {f"m{i}": dict(item) for i in range(4)}

    path = _edited(saved, "routes", tmp_path, edit)
    with pytest.raises(InputError, match=r"RouteGraphResult.meta: .*numbers and bools only"):
        _bounded(lambda: cw_lens.load_result(path))


class _Opens:
    """An audit hook recording the files opened while it listens (an audit hook stays for the
    life of the process: one, switched on and off)."""

    listening = False
    opened: list[str] = []  # noqa: RUF012

    @classmethod
    def hook(cls, event: str, args: tuple) -> None:
        if cls.listening and event in ("open", "os.open") and args:
            cls.opened.append(str(args[0]))


sys.addaudithook(_Opens.hook)


def test_a_pandas_dtype_that_names_a_file_is_refused_without_opening_it(saved, tmp_path):
    """A column dtype `datetime64[ns, dateutil//etc/passwd]` made pandas open /etc/passwd."""

    def edit(state, tensors):
        column = state["items"]["data"][0]
        column.clear()
        column.update(dtype="datetime64[ns, dateutil//etc/passwd]", items=[0])

    path = _edited(saved, "ioi", tmp_path, edit)
    _Opens.opened.clear()
    _Opens.listening = True
    try:
        (tmp_path / "probe.txt").write_text("the hook listens")
        with pytest.raises(InputError) as refused:
            cw_lens.load_result(path)
    finally:
        _Opens.listening = False
    assert [p for p in _Opens.opened if p.endswith("probe.txt")]  # the hook heard opens
    assert not [p for p in _Opens.opened if "passwd" in p], _Opens.opened
    assert "the dtype 'datetime64[ns, dateutil//etc/passwd]'" in str(refused.value)


# --------------------------------------------------------------------------- the job's state


def test_a_stored_step_from_someone_else_is_recomputed_never_trusted(tmp_path, capsys):
    from cw_lens.reproduction.state import Job, JobConfig

    job = Job(JobConfig(model="testing:tiny-llama"), tmp_path / "out")
    job.state_dir.mkdir(parents=True)
    (job.state_dir / "a.pkl").write_bytes(b"cos\nsystem\n(S'touch pwned'\ntR.")
    _write_result(job.state_dir / "b.safetensors", {TYPE: "object", "class": "os:system"}, {},
                  "x")  # fmt: skip
    (job.state_dir / "c.safetensors").write_bytes(b"not a safetensors file")
    for name in "abc":
        assert job.step(name, lambda job, name=name: f"computed {name}") == f"computed {name}"
    err = capsys.readouterr().err
    assert "[a] a pickled result from an older cw_lens is never loaded" in err
    assert "[b] stored result not used" in err and "[c] stored result not used" in err
    assert not Path("pwned").exists()
    again = Job(JobConfig(model="testing:tiny-llama"), tmp_path / "out")
    assert [again.step(n, lambda job: "recomputed") for n in "abc"] == [
        f"computed {n}" for n in "abc"
    ]


def test_no_pickle_is_read_anywhere_in_cw_lens():
    root = Path(cw_lens.__file__).parent
    readers = ("pickle.load", "pickle.Unpickler", "allow_pickle=True", "torch.load(")
    found = [
        f"{p.relative_to(root)}: {needle}"
        for p in root.rglob("*.py")
        for needle in readers
        if needle in p.read_text(encoding="utf-8")
    ]
    assert not found


# --------------------------------------------------------------------------- GGUF files


@pytest.fixture(scope="module")
def gguf_file(tmp_path_factory):
    # as tests/test_gguf_stream.py: cw_lens writes GGUF files with transformers 5's name maps,
    # which the TransformerBridge environments have (TransformerLens 2.x pins transformers 4)
    pytest.importorskip("transformer_lens.model_bridge", reason="writing GGUF needs transformers 5")
    from cw_lens.models.gguf_writer import random_hf_model, tiny_config, write_gguf

    return write_gguf(
        random_hf_model(tiny_config("llama")), tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    )


@pytest.fixture(scope="module")
def aligned_gguf_file(tmp_path_factory):
    """A small GGUF file with an explicit `general.alignment` field."""
    import gguf

    path = tmp_path_factory.mktemp("aligned") / "aligned.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_custom_alignment(64)
    writer.add_tensor("t", np.arange(48, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _sections(path: Path) -> dict[str, list[int]]:
    """Where a GGUF file's parts start: the counts, each key-value field (its key's length),
    each tensor's info (its name's length, dimensions, offset), and the data."""
    from cw_lens.models.gguf_cache import open_gguf

    reader = open_gguf(path)
    fields = [f for name, f in reader.fields.items() if not name.startswith("GGUF.")]
    infos = [t.field for t in reader.tensors]
    return {
        "counts": [8, 16],
        "string lengths": [f.offset for f in fields] + [f.offset for f in infos],
        "dimensions": [f.offset + 8 + len(f.name.encode()) + 4 for f in infos],
        "offsets": [f.offset + sum(p.nbytes for p in f.parts[:-1]) for f in infos],
        "alignment": [
            f.offset + sum(p.nbytes for p in f.parts[:-1])
            for name, f in reader.fields.items()
            if name == "general.alignment"
        ],
        "cuts": sorted(
            {0, 4, 8, 16, 24, reader.data_offset, path.stat().st_size - 1}
            | {f.offset for f in fields + infos}
        ),
    }


def _gguf_loads_cleanly_or_refuses(path: Path) -> None:
    from cw_lens.models.gguf_cache import open_gguf

    try:
        reader = _bounded(lambda: open_gguf(path))
    except ModelLoadError:
        return
    size = path.stat().st_size
    assert all(t.data_offset + t.n_bytes <= size for t in reader.tensors)


def _patched(data: bytes, at: int, value: int, width: int) -> bytes:
    return data[:at] + value.to_bytes(width, "little") + data[at + width :]


def test_a_gguf_file_cut_anywhere_keeps_only_whole_tensors_or_is_refused(gguf_file, tmp_path):
    data = gguf_file.read_bytes()
    sections = _sections(gguf_file)

    @SETTINGS
    @given(cut=st.sampled_from(sections["cuts"]) | st.integers(0, len(data) - 1))
    def check(cut):
        path = tmp_path / "cut.gguf"
        path.write_bytes(data[:cut])
        _gguf_loads_cleanly_or_refuses(path)  # a cut in the padding after the data is harmless

    check()
    assert sections["cuts"][-1] == len(data) - 1


@pytest.mark.parametrize(
    ("section", "width"),
    [("counts", 8), ("string lengths", 8), ("dimensions", 8), ("offsets", 8), ("alignment", 4)],
)
def test_absurd_gguf_counts_lengths_dimensions_offsets_and_alignment_are_refused(
    gguf_file, aligned_gguf_file, tmp_path, section, width
):
    source = aligned_gguf_file if section == "alignment" else gguf_file
    data = source.read_bytes()
    places = _sections(source)[section]
    assert places, section

    @SETTINGS
    @given(
        at=st.sampled_from(places),
        value=st.integers(0, 2 ** (8 * width) - 1)
        | st.sampled_from([2 ** (8 * width) - 1, 2 ** (8 * width - 1), len(data), 3, 0]),
    )
    def check(at, value):
        path = tmp_path / "absurd.gguf"
        path.write_bytes(_patched(data, at, value, width))
        _gguf_loads_cleanly_or_refuses(path)

    check()


@settings(max_examples=40, deadline=5000, database=None)
@given(magic=st.binary(min_size=4, max_size=4).filter(lambda b: b != b"GGUF"))
def test_a_wrong_gguf_magic_is_refused(tmp_path_factory, gguf_file, magic):
    path = tmp_path_factory.mktemp("magic") / "magic.gguf"
    path.write_bytes(magic + gguf_file.read_bytes()[4:])
    with pytest.raises(ModelLoadError, match="not a GGUF file"):
        cw_lens.models.gguf_cache.open_gguf(path)


@pytest.mark.parametrize("layer_streaming", [False, True])
def test_a_truncated_gguf_file_is_refused_before_any_cache_is_built(
    gguf_file, tmp_path, monkeypatch, layer_streaming
):
    """Refused by its header check before de-quantising anything; nothing a later load could
    trust is left in the cache, and the whole file still loads afterwards."""
    monkeypatch.setenv("CW_LENS_CACHE", str(tmp_path / "cache"))
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(gguf_file.read_bytes()[: gguf_file.stat().st_size - 100])
    with pytest.raises(ModelLoadError, match="corrupt, truncated or not a GGUF file"):
        cw_lens.load_model(cut, layer_streaming=layer_streaming)
    models = tmp_path / "cache" / "models"
    left = sorted(p.name for p in models.iterdir()) if models.exists() else []
    assert not [name for name in left if name.startswith("cut-") and not name.endswith(".lock")]


def test_a_cache_build_that_fails_midway_leaves_no_cache_folder(gguf_file, tmp_path, monkeypatch):
    from cw_lens.models import gguf_cache

    monkeypatch.setenv("CW_LENS_CACHE", str(tmp_path / "cache"))

    def half_written(folder: Path, hf_model: Any, tokenizer: Any) -> dict:
        (folder / "config.json").write_text("{}")
        raise OSError("disk full")

    monkeypatch.setattr(gguf_cache, "_write_neutral_files", half_written)
    with pytest.raises(OSError, match="disk full"):
        cw_lens.load_model(gguf_file)
    folder = gguf_cache._cache_folder(gguf_file, gguf_cache.gguf_digest(gguf_file))
    assert not folder.exists()
    assert not [p for p in folder.parent.iterdir() if ".tmp-" in p.name]
    monkeypatch.undo()
    monkeypatch.setenv("CW_LENS_CACHE", str(tmp_path / "cache"))
    assert cw_lens.load_model(gguf_file).cfg.n_layers == 2


# --------------------------------------------------------------------------- cw-lens compare


# `run_folder`: a run folder of `cw-lens compare` (tests/conftest.py)


def _compares_cleanly_or_refuses(reference: Path, run: Path) -> None:
    try:
        comparison = _bounded(lambda: cw_lens.compare_runs([reference, run]))
    except InputError:
        return
    comparison.differences()
    comparison.to_markdown()


def _copy_run(source: Path, target: Path, summary: Any = None, npz: bytes | None = None) -> Path:
    target.mkdir(parents=True, exist_ok=True)
    text = (source / "summary.json").read_text() if summary is None else json.dumps(summary)
    data = (source / "replicates.npz").read_bytes() if npz is None else npz
    if summary is None and npz is not None:  # the summary records the new file's digest
        parsed = json.loads(text)
        parsed["replicates"]["sha256"] = hashlib.sha256(data).hexdigest()
        text = json.dumps(parsed)
    (target / "summary.json").write_text(text)
    (target / "replicates.npz").write_bytes(data)
    return target


def test_a_damaged_summary_compares_cleanly_or_is_refused(run_folder, tmp_path):
    summary = json.loads((run_folder / "summary.json").read_text())

    @SETTINGS
    @given(damaged=mutations(summary))
    def check(damaged):
        _compares_cleanly_or_refuses(run_folder, _copy_run(run_folder, tmp_path / "b", damaged))

    check()


def test_damaged_replicates_compare_cleanly_or_are_refused(run_folder, tmp_path):
    data = (run_folder / "replicates.npz").read_bytes()
    with np.load(io.BytesIO(data), allow_pickle=False) as npz:
        arrays = {k: npz[k] for k in npz.files}
    meta = json.loads(str(arrays["meta"]))

    def rebuilt(new_meta: Any, extra: dict | None = None) -> bytes:
        buffer = io.BytesIO()
        np.savez(buffer, **{**arrays, "meta": np.array(json.dumps(new_meta)), **(extra or {})})
        return buffer.getvalue()

    @SETTINGS
    @given(
        damage=st.one_of(
            st.builds(lambda m: rebuilt(m), mutations(meta)),
            st.builds(lambda cut: data[:cut], st.integers(0, len(data) - 1)),
            st.builds(
                lambda at, byte: data[:at] + bytes([byte]) + data[at + 1 :],
                st.integers(0, len(data) - 1),
                st.integers(0, 255),
            ),
        )
    )
    def check(damage):
        _compares_cleanly_or_refuses(run_folder, _copy_run(run_folder, tmp_path / "b", npz=damage))

    check()


def test_pickle_inside_replicates_is_refused(run_folder, tmp_path):
    buffer = io.BytesIO()
    with np.load(io.BytesIO((run_folder / "replicates.npz").read_bytes())) as npz:
        arrays = {k: npz[k] for k in npz.files}
    np.savez(buffer, **{**arrays, "documents": np.array([object()], dtype=object)})
    run = _copy_run(run_folder, tmp_path / "b", npz=buffer.getvalue())
    with pytest.raises(InputError, match="not a cw_lens replicates file"):
        cw_lens.compare_runs([run_folder, run])


def test_struct_helpers_agree_with_the_gguf_layout(gguf_file):
    """The places the GGUF tests damage are where the format keeps those numbers."""
    data = gguf_file.read_bytes()
    sections = _sections(gguf_file)
    tensor_count, kv_count = struct.unpack_from("<QQ", data, 8)
    from cw_lens.models.gguf_cache import open_gguf

    reader = open_gguf(gguf_file)
    assert tensor_count == len(reader.tensors) and kv_count == len(reader.fields) - 3
    for at, t in zip(sections["dimensions"], reader.tensors, strict=True):
        assert struct.unpack_from("<Q", data, at)[0] == t.shape[0]


def test_a_class_that_moved_loads_under_the_name_older_files_give_it():
    from cw_lens.core.registry import MOVED_CLASSES, registered_class
    from cw_lens.reproduction.run_comparison import Run, RunComparisonResult
    from cw_lens.reproduction.verdicts import ClaimsTable

    assert registered_class("cw_lens.core.results:ClaimsTable") is ClaimsTable
    assert registered_class("cw_lens.reporting.run_comparison:Run") is Run
    assert registered_class("cw_lens.reporting.run_comparison:RunComparisonResult") is (
        RunComparisonResult
    )
    assert all(registered_class(new) is not None for new in MOVED_CLASSES.values())
    assert not any(registered_class(old) is None for old in MOVED_CLASSES)


def test_reading_a_toolkit_result_imports_no_reproduction_module(tmp_path):
    """The registry imports the module of each class a file names, from its fixed list: a
    toolkit result's file imports nothing of the reproduction layer (a fresh process)."""
    import subprocess
    import sys

    code = (
        "import sys, torch, cw_lens\n"
        "from cw_lens.models.testing import tiny_llama\n"
        "model = tiny_llama(seed=0, n_layers=1)\n"
        f"path = {str(tmp_path / 'cw.safetensors')!r}\n"
        "cw_lens.contribution_weights(model, 'The cat sat.').save(path)\n"
        "loaded = cw_lens.load_result(path)\n"
        "print(sorted(m for m in sys.modules if m.startswith('cw_lens.reproduction')))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip().splitlines()[-1] == "[]", out.stdout + out.stderr
