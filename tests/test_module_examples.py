"""Every example in a cw_lens module's docstrings runs as written (the `>>>` lines, by doctest).

The entry points' own `Examples:` sections are run by `tests/test_docstring_examples.py`; this
file runs the rest: the module docstrings (each states its formula and gives an example) and the
helpers' examples, which a reader meets in the API reference and in the source.
"""

from __future__ import annotations

import doctest
import importlib
import pkgutil

import pytest

import cw_lens

MODULES = sorted(
    info.name
    for info in pkgutil.walk_packages(cw_lens.__path__, "cw_lens.")
    if not info.name.endswith("__main__")  # an entry point: importing it runs it
)


def test_the_modules_with_examples_include_the_definition():
    assert "cw_lens.reference" in MODULES and len(MODULES) > 100


@pytest.mark.parametrize("name", MODULES)
def test_every_docstring_example_of_a_module_runs(name):
    module = importlib.import_module(name)
    flags = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE
    failed, _ = doctest.testmod(module, optionflags=flags, report=True, verbose=False)
    assert failed == 0, f"{failed} example(s) of {name} failed (printed above)"
