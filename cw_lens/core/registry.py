"""The classes a cw_lens file may name: the registry that `load_result` and the main job's
stored steps build objects from.

A result file (and a stored step of the main job) is tensors plus JSON; the JSON names the
class of each object in it as `module:qualname`. Loading looks that name up here, in a table
of classes that cw_lens registered with [`saveable`][cw_lens.core.registry.saveable] where
it defines them, and nowhere else: it imports no module but those of a fixed list and never
walks attributes from one, so a file can build nothing but a cw_lens result and the values its
fields hold. A name that is not here is an [`InputError`][cw_lens.InputError] raised before
any object is made.

The modules that define registered classes are listed in `SAVEABLE_MODULES` (a test checks
the list against the decorators). The package imports its modules lazily, so a class is
registered only once its module has been imported: looking a name up imports its module when
that module is on the list (and only then), so that reading a toolkit result imports no module
of the reproduction layer. A class that moved is found under the name older files give it
(`MOVED_CLASSES`).

Examples:
    >>> from cw_lens.core.registry import registered_class
    >>> registered_class("cw_lens.core.histograms:Histogram").__name__
    'Histogram'
    >>> registered_class("os:system") is None
    True
    >>> registered_class("cw_lens.core.results:ClaimsTable").__module__  # written before 0.5
    'cw_lens.reproduction.verdicts'
"""

from __future__ import annotations

import importlib
from typing import TypeVar

T = TypeVar("T", bound=type)

# Every module that defines a class decorated with `saveable` (kept equal to the decorators by
# tests/test_saving_security.py). Importing them registers their classes.
SAVEABLE_MODULES = (
    "cw_lens.core.histograms",
    "cw_lens.models.access",
    "cw_lens.models.batch",
    "cw_lens.models.blocks",
    "cw_lens.models.capture",
    "cw_lens.models.layer_contributions",
    "cw_lens.models.verify",
    "cw_lens.analyses.contributions",
    "cw_lens.analyses.faithfulness.curves",
    "cw_lens.analyses.pruning.prune",
    "cw_lens.analyses.selection.geometry",
    "cw_lens.analyses.selection.prf",
    "cw_lens.analyses.sinks.ablation",
    "cw_lens.analyses.sinks.detection",
    "cw_lens.analyses.sinks.statistics",
    "cw_lens.analyses.taxonomy",
    "cw_lens.flow.evaluation",
    "cw_lens.flow.input_deletion",
    "cw_lens.flow.layer_shares",
    "cw_lens.flow.rollout",
    "cw_lens.flow.routes",
    "cw_lens.flow.shares",
    "cw_lens.interactive.comparison",
    "cw_lens.reproduction.verdicts",
    "cw_lens.reproduction.run_comparison",
)

# classes that moved, by the name files written before the move give them (0.4 -> 0.5)
MOVED_CLASSES = {
    "cw_lens.core.accumulators:Histogram": "cw_lens.core.histograms:Histogram",
    "cw_lens.core.results:ClaimsTable": "cw_lens.reproduction.verdicts:ClaimsTable",
    "cw_lens.reporting.run_comparison:Run": "cw_lens.reproduction.run_comparison:Run",
    "cw_lens.reporting.run_comparison:RunComparisonResult": (
        "cw_lens.reproduction.run_comparison:RunComparisonResult"
    ),
}

_CLASSES: dict[str, type] = {}
_loaded = False


def class_name(cls: type) -> str:
    """The name a file stores for a class.

    Args:
        cls: The class.

    Returns:
        `module:qualname`.
    """
    return f"{cls.__module__}:{cls.__qualname__}"


def saveable(cls: T) -> T:
    """Register `cls` as a class that result files and stored job steps may hold.

    Use it as a class decorator where the class is defined, and add the module to
    `SAVEABLE_MODULES`. Only cw_lens's own classes can be registered. What a file may store
    of the class is its schema (`cw_lens.core.schema`): its dataclass fields and their type
    hints, or its `stored_fields`; the loader checks every stored object against it.

    Args:
        cls: A class defined in a cw_lens module.

    Returns:
        `cls` itself.

    Raises:
        TypeError: when `cls` is not a cw_lens class, or another class is registered
            under its name.
    """
    name = class_name(cls)
    if not (cls.__module__ == "cw_lens" or cls.__module__.startswith("cw_lens.")):
        raise TypeError(f"Only cw_lens classes can be registered, not {name}.")
    known = _CLASSES.get(name)
    if known is not None and known is not cls:
        raise TypeError(f"Two classes are registered as {name}.")
    _CLASSES[name] = cls
    return cls


def load_registry() -> None:
    """Import the modules of `SAVEABLE_MODULES` (once), registering their classes."""
    global _loaded
    if not _loaded:
        for module in SAVEABLE_MODULES:
            importlib.import_module(module)
        _loaded = True


def registered_class(name: str) -> type | None:
    """The registered class stored as `name` (`module:qualname`), or `None`.

    Args:
        name: The name a file gives.

    Returns:
        The class, or `None` where no cw_lens class is registered under that name.
    """
    if not isinstance(name, str):
        return None
    name = MOVED_CLASSES.get(name, name)
    module = name.partition(":")[0]
    if module in SAVEABLE_MODULES:  # only its own module, from the fixed list: reading a
        importlib.import_module(module)  # toolkit result imports no reproduction module
    return _CLASSES.get(name)


def registered_classes() -> dict[str, type]:
    """Every registered class by its stored name (the modules of `SAVEABLE_MODULES` imported).

    Returns:
        `{module:qualname: class}`.
    """
    load_registry()
    return dict(_CLASSES)
