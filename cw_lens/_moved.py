"""The flat module paths of cw_lens 0.2 (`cw_lens.sinks`, `cw_lens.report`, ...), kept for
one minor version: each is a module whose attributes come from the new module, with a
`DeprecationWarning` naming the new path. Likewise the result classes renamed to end in
`Result` (`RENAMED`): `cw_lens.SinkStatistics` is `cw_lens.SinkStatisticsResult`, with
a warning. `cw_lens/__init__.py` registers them when it is
imported, so `from cw_lens.sinks import sink_statistics` and `python -m cw_lens.cli` keep
working; nothing is a file at the old path (git follows the moved files).
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import types
import warnings
from typing import Any

REMOVED_IN = "0.4"

# old module (under cw_lens) -> its new home (or homes, searched in order, where a module was
# split); `data` and `models` are packages now that export what the old modules did, so they
# need no entry
MOVED: dict[str, str | tuple[str, ...]] = {
    "access": "cw_lens.models.access",
    "accumulate": "cw_lens.core.accumulate",
    "bootstrap": "cw_lens.core.bootstrap",
    "capture": "cw_lens.models.capture",
    "claims": "cw_lens.core.claims",
    "cli": "cw_lens.reporting.cli",
    "compare": "cw_lens.reporting.run_comparison",
    "contributions": "cw_lens.analyses.contributions",
    "corpora": "cw_lens.data.corpora",
    "distributed": "cw_lens.data.distributed",
    "edits": "cw_lens.models.edits",
    "errors": "cw_lens.core.errors",
    "exact": "cw_lens.core.exact",
    "faithfulness": "cw_lens.analyses.faithfulness",
    "flow_capture": "cw_lens.models.blocks",
    "flow_evaluation": "cw_lens.flow.evaluation",
    "flow_geometry": "cw_lens.core.flow_geometry",
    "geometry": "cw_lens.core.geometry",
    "gguf_cache": "cw_lens.models.gguf_cache",
    "hooked": "cw_lens.models.hooked",
    "inputs": "cw_lens.data.inputs",
    "interventions": "cw_lens.models.interventions",
    "layer_contributions": "cw_lens.models.layer_contributions",
    "patch_view": "cw_lens.interactive.view_state",
    "pruning": "cw_lens.analyses.pruning",
    "report": ("cw_lens.reporting.job", "cw_lens.reporting.markdown"),
    "resampled": "cw_lens.core.resampled",
    "rollout": "cw_lens.flow.rollout",
    "routes": "cw_lens.flow.routes",
    "scoring": "cw_lens.data.scoring",
    "selection": "cw_lens.analyses.selection",
    "shares": "cw_lens.flow.shares",
    "sink_patching": "cw_lens.interactive.comparison",
    "sinks": "cw_lens.analyses.sinks",
    "streaming": "cw_lens.data.streaming",
    "taxonomy": "cw_lens.analyses.taxonomy",
    "testing": "cw_lens.models.testing",
    "verify": "cw_lens.models.verify",
    "weight_processing": "cw_lens.models.weight_processing",
    "widget": "cw_lens.interactive.widget",
}

# public result classes renamed so that every result class ends in `Result`: old -> new (each
# defining module keeps the old name too, for imports and pickles that name it)
RENAMED: dict[str, str] = {
    "IOIRouteStatistics": "IOIRouteStatisticsResult",
    "LayerContributions": "LayerContributionsResult",
    "LayerShares": "LayerSharesResult",
    "ModelVerification": "ModelVerificationResult",
    "ResidualShares": "ResidualSharesResult",
    "RolloutDeletion": "RolloutDeletionResult",
    "RouteGraph": "RouteGraphResult",
    "RunComparison": "RunComparisonResult",
    "SinkAblation": "SinkAblationResult",
    "SinkPatchComparison": "SinkPatchComparisonResult",
    "SinkStatistics": "SinkStatisticsResult",
}


def _warn(old: str, new: str, stacklevel: int) -> None:
    warnings.warn(
        f"{old} is deprecated and goes in cw_lens {REMOVED_IN}; import from {new} instead.",
        DeprecationWarning,
        stacklevel=stacklevel,
    )


def homes(old: str) -> tuple[str, ...]:
    """The new module(s) of an old module name (`"sinks"`), the main one first."""
    new = MOVED[old]
    return (new,) if isinstance(new, str) else new


class MovedModule(types.ModuleType):
    """An old module path: every attribute is looked up in the new module(s), with a warning."""

    def __init__(self, old: str, new: tuple[str, ...]) -> None:
        super().__init__(old, f"Deprecated: moved to {' and '.join(new)}.")
        self.__dict__["__moved_to__"] = new
        self.__dict__["__spec__"] = importlib.util.spec_from_loader(old, _MovedLoader(old, new[0]))

    def __getattr__(self, name: str) -> Any:
        new = self.__dict__["__moved_to__"]
        if name.startswith("__") and name != "__all__":
            raise AttributeError(name)
        modules = [importlib.import_module(m) for m in new]
        home = next((m for m in modules if hasattr(m, name)), modules[0])
        _warn(self.__name__, home.__name__, stacklevel=3)
        return getattr(home, name)

    def __dir__(self) -> list[str]:
        return sorted(
            {n for m in self.__dict__["__moved_to__"] for n in dir(importlib.import_module(m))}
        )


class _MovedLoader(importlib.abc.Loader):
    """Lets `python -m cw_lens.<old>` (runpy, torchrun) run the new module as `__main__`."""

    def __init__(self, old: str, new: str) -> None:
        self.old, self.new = old, new

    def create_module(self, spec: Any) -> types.ModuleType:
        return sys.modules[self.old]

    def exec_module(self, module: types.ModuleType) -> None:
        pass

    def is_package(self, fullname: str) -> bool:
        return False

    def get_code(self, fullname: str) -> types.CodeType:
        source = (
            "import runpy, warnings\n"
            f"warnings.warn({self.old + ' is deprecated; run ' + self.new + ' instead.'!r}, "
            "DeprecationWarning, stacklevel=1)\n"
            f"runpy.run_module({self.new!r}, run_name='__main__', alter_sys=True)\n"
        )
        return compile(source, f"<{self.old}: moved to {self.new}>", "exec")


def install(package: types.ModuleType) -> None:
    """Register every old path under `package` (`cw_lens`) in `sys.modules`.

    Registered up front rather than found on import: importing a submodule sets it as an
    attribute of the package, which would hide the functions `cw_lens.routes` and
    `cw_lens.faithfulness` behind the old modules of the same name.
    """
    for old in MOVED:
        name = f"{package.__name__}.{old}"
        if name not in sys.modules:
            sys.modules[name] = MovedModule(name, homes(old))


def moved_attribute(package: types.ModuleType, name: str) -> types.ModuleType | None:
    """`cw_lens.sinks` (the attribute) as the old module, or `None` for other names."""
    if name in MOVED:
        return sys.modules[f"{package.__name__}.{name}"]
    return None
