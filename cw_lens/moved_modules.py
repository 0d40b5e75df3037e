"""The module paths of 0.4 that moved in 0.5, kept importable until 0.6 with a warning.

The papers' reproduction became a layer of its own (`cw_lens.reproduction`), so the modules
that judged claims left the toolkit: `from cw_lens.core.bootstrap import Bootstrap` still
works, with a `DeprecationWarning` that names `cw_lens.reproduction.bootstrap`, and so does
`python -m cw_lens.reporting.cli`. The old name is the new module itself (one module object, so
`isinstance` and the class registry see one class). The finder answers only the old paths, none
of which is a file any more (a test checks), so it hides no module; it goes first on
`sys.meta_path`, so that a submodule of an old package path (`cw_lens.reporting.job`) is the new
module rather than a second copy of its file, and it is installed when `cw_lens` is imported.

Example:

    from cw_lens.core.bootstrap import Bootstrap      # DeprecationWarning: now in reproduction
    from cw_lens.reproduction import Bootstrap as New
    assert Bootstrap is New
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import warnings
from types import ModuleType
from typing import Any

REMOVED_IN = "0.6"

# old module path -> new module path (0.4 -> 0.5)
MOVED_MODULES = {
    "cw_lens.core.bootstrap": "cw_lens.reproduction.bootstrap",
    "cw_lens.core.claims": "cw_lens.reproduction.verdicts",
    "cw_lens.core.replicates": "cw_lens.reproduction.run_replicates",
    "cw_lens.core.resampled": "cw_lens.reproduction.resampled",
    "cw_lens.analyses.sinks.claims": "cw_lens.reproduction.sink_claims",
    "cw_lens.analyses.selection.claims": "cw_lens.reproduction.selection_claims",
    "cw_lens.analyses.faithfulness.claims": "cw_lens.reproduction.faithfulness_claims",
    "cw_lens.analyses.pruning.claims": "cw_lens.reproduction.pruning_claims",
    "cw_lens.plots.claims": "cw_lens.reproduction.claim_plots",
    "cw_lens.plots.compare": "cw_lens.reproduction.comparison_plots",
    "cw_lens.reporting": "cw_lens.reproduction",
    **{
        f"cw_lens.reporting.{name}": f"cw_lens.reproduction.{name}"
        for name in (
            "cli",
            "comparison_markdown",
            "difference_tests",
            "figure_text",
            "interval_coverage",
            "job",
            "markdown",
            "provenance",
            "run_comparison",
            "state",
            "steps",
            "stored_steps",
        )
    },
}


class _Alias(importlib.abc.Loader):
    """Loads an old path as the module at its new path.

    Args:
        new: The new path.
    """

    def __init__(self, new: str) -> None:
        self.new = new

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        warnings.warn(
            f"{spec.name} is now {self.new} (deprecated; removed in cw_lens {REMOVED_IN})",
            DeprecationWarning,
            stacklevel=2,
        )
        return importlib.import_module(self.new)

    def exec_module(self, module: ModuleType) -> None:
        pass  # the new module ran when it was imported

    def get_code(self, fullname: str) -> Any:
        # `python -m <old path>` runs the new module's code
        spec = importlib.util.find_spec(self.new)
        return spec.loader.get_code(self.new)  # type: ignore[union-attr]


class MovedModuleFinder(importlib.abc.MetaPathFinder):
    """Finds an old module path of `MOVED_MODULES`."""

    def find_spec(
        self, fullname: str, path: Any = None, target: Any = None
    ) -> importlib.machinery.ModuleSpec | None:
        """The spec of an old path, or None for any other name.

        Args:
            fullname: The module's name.
            path: The parent package's path (unused).
            target: The module being reloaded (unused).

        Returns:
            A spec whose loader gives the new module, or None.
        """
        new = MOVED_MODULES.get(fullname)
        if new is None:
            return None
        found = importlib.util.find_spec(new)
        spec = importlib.machinery.ModuleSpec(
            fullname,
            _Alias(new),
            origin=found.origin,
            is_package=found.submodule_search_locations is not None,
        )
        spec.has_location = True  # `python -m <old path>` gets the new file as `__file__`
        return spec


def install() -> None:
    """Put the finder first on `sys.meta_path` (once)."""
    if not any(isinstance(f, MovedModuleFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, MovedModuleFinder())
