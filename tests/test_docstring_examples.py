"""Every public entry point has an `Examples:` section, and every example runs.

The entry points are the callables of `cw_lens.__all__` and the public methods of its classes
(what the API reference shows). Each example is the code of the fenced blocks of its
`Examples:` section, run in a fresh namespace, as a user would paste it. The examples load
`cw_lens.load_model("testing:tiny-llama")` and run the same analyses over and over, so here
(and only here) `load_model` and every analysis that returns a result are memoised: a call with
the same arguments returns the object of the first call. Examples that load the embedded
SmolLM2 (`load_model()`) are marked `model`.
"""

from __future__ import annotations

import functools
import importlib.util
import inspect
import re
import textwrap
import warnings

import matplotlib
import pytest

import cw_lens
from cw_lens.core.results import Result

matplotlib.use("Agg")

EMBEDDED = re.compile(r"load_model\((\)|api=|\"smollm2)")
FENCE = re.compile(r"```(?:python|py)?\n(.*?)```", re.S)


def _public() -> dict[str, object]:
    """`cw_lens`'s public names, then the reproduction layer's (`reproduction.<name>`)."""
    from cw_lens import reproduction

    found = {}
    for name in sorted(cw_lens.__all__):
        if name == "sink_patcher" and importlib.util.find_spec("anywidget") is None:
            continue  # the optional widget extra
        found[name] = getattr(cw_lens, name)
    for name in sorted(reproduction.__all__):
        if getattr(reproduction, name) not in found.values():
            found[f"reproduction.{name}"] = getattr(reproduction, name)
    return found


def _entry_points() -> dict[str, object]:
    """Every public function, and every public method of a public class, but the deprecated
    forwards of methods that moved (`__moved_to__`: their replacement has the example)."""
    found = {}
    for name, obj in _public().items():
        if inspect.isfunction(obj):
            found[name] = obj
        elif inspect.isclass(obj) and obj.__module__.startswith("cw_lens."):
            for attr, value in vars(obj).items():
                func = value.__func__ if isinstance(value, classmethod | staticmethod) else value
                if (
                    not attr.startswith("_")
                    and inspect.isfunction(func)
                    and not hasattr(func, "__moved_to__")
                ):
                    found[f"{name}.{attr}"] = func
    return found


def _example(func: object) -> str | None:
    """The code of the `Examples:` section of `func`'s docstring (its fenced blocks, or its
    `>>>` lines), or None without one."""
    doc = inspect.getdoc(func) or ""
    match = re.search(r"^Examples:\n((?:[ \t]+.*\n?|\n)+)", doc, re.M)
    if match is None:
        return None
    section = textwrap.dedent(match.group(1))
    blocks = FENCE.findall(section)
    if not blocks:  # doctest style: the `>>>` and `...` lines
        lines = re.findall(r"^(?:>>>|\.\.\.) ?(.*)$", section, re.M)
        blocks = ["\n".join(lines)] if lines else []
    return "\n".join(textwrap.dedent(block) for block in blocks) or None


ENTRY_POINTS = _entry_points()
EXAMPLES = {name: _example(func) for name, func in ENTRY_POINTS.items()}


def test_every_entry_point_has_an_example():
    assert len(ENTRY_POINTS) > 100
    missing = sorted(name for name, code in EXAMPLES.items() if code is None)
    assert not missing, f"no Examples: section with a fenced code block: {missing}"


# ------------------------------------------------------------------------------- memoisation
_CACHE: dict[tuple, object] = {}


def _key(value: object) -> object:
    if isinstance(value, list | tuple):
        return (type(value).__name__, *map(_key, value))
    if isinstance(value, dict):
        return tuple(sorted((k, _key(v)) for k, v in value.items()))
    if isinstance(value, cw_lens.Corpus):
        return ("corpus", *(d.text for d in value))
    if isinstance(value, str | int | float | bool | type(None)):
        return value
    return ("id", id(value))


def _memoised(func):
    @functools.wraps(func)
    def wrapper(*args, **kwargs):
        key = (func.__name__, _key(args), _key(kwargs))
        if key not in _CACHE:
            value = func(*args, **kwargs)
            if func.__name__ != "load_model" and not isinstance(value, Result):
                return value  # hook sets, tuples, widgets: never shared
            _CACHE[key] = value
        return _CACHE[key]

    return wrapper


@pytest.fixture
def shared_results(monkeypatch, tmp_path):
    """`load_model`, `load_corpus` and the analyses memoised; files written go to tmp_path."""
    monkeypatch.chdir(tmp_path)
    for name in ("load_model", "load_corpus", *cw_lens.__all__):
        obj = getattr(cw_lens, name, None)
        if inspect.isfunction(obj):
            monkeypatch.setattr(cw_lens, name, _memoised(obj))
    yield
    import matplotlib.pyplot as plt

    plt.close("all")


def _params():
    for name, code in EXAMPLES.items():
        if code is None:
            continue
        marks = [pytest.mark.model] if EMBEDDED.search(code) else []
        yield pytest.param(name, code, marks=marks, id=name)


@pytest.mark.parametrize(("name", "code"), list(_params()))
def test_example_runs(name, code, shared_results):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        exec(compile(code, f"<example of {name}>", "exec"), {"__name__": "__example__"})
