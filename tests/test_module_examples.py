"""Every example in a cw_lens module's docstrings runs as written (the `>>>` lines, by doctest).

The entry points' own `Examples:` sections are run by `tests/test_docstring_examples.py`; this
file runs the rest: the module docstrings (each states its formula and gives an example) and the
helpers' examples, which a reader meets in the API reference and in the source.
"""

from __future__ import annotations

import doctest
import importlib
import importlib.util
import pkgutil

import pytest

import cw_lens

MODULES = sorted(
    info.name
    for info in pkgutil.walk_packages(cw_lens.__path__, "cw_lens.")
    if not info.name.endswith("__main__")  # an entry point: importing it runs it
)

# examples that stream or offload a model's layers: they need a TransformerBridge (TransformerLens
# 3.x and 4.x), as the tests of those modules do
NEED_A_BRIDGE = {
    "cw_lens.models.gguf_stream",
    "cw_lens.models.gguf_writer",
    "cw_lens.models.offload",
}


def test_the_modules_with_examples_include_the_definition():
    assert "cw_lens.reference" in MODULES and len(MODULES) > 100
    assert NEED_A_BRIDGE <= set(MODULES)


@pytest.mark.parametrize("name", MODULES)
def test_every_docstring_example_of_a_module_runs(name):
    if name in NEED_A_BRIDGE and importlib.util.find_spec("transformer_lens.model_bridge") is None:
        pytest.skip("layer streaming and offloading need a TransformerBridge")
    module = importlib.import_module(name)
    flags = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE
    failed, _ = doctest.testmod(module, optionflags=flags, report=True, verbose=False)
    assert failed == 0, f"{failed} example(s) of {name} failed (printed above)"
