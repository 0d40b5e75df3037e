"""cw_lens — contribution weights and attention-sink geometry for TransformerLens models.

Public API (re-exports only; each function's module docstring states its formula and paper):

- models: :func:`load_model`
- the result protocol every result follows: :class:`Result`; claims tables: :class:`ClaimsTable`
- data: :func:`load_corpus`, :class:`Corpus`, :class:`Document`
- contributions (P1): :func:`contribution_weights`, :func:`contribution_weights_from_cache`,
  :func:`stream_contributions`, :class:`ContributionResult`, :class:`LayerContributionsResult`
- sinks (P1): :func:`sink_statistics`, :func:`sink_ablation`, :func:`sink_rates`,
  :func:`detect_sinks`
- faithfulness (P1): :func:`faithfulness`, :class:`FaithfulnessResult`
- selection (P2): :func:`geometric_prf`, :func:`selection_geometry`; taxonomy:
  :func:`head_taxonomy`; pruning: :func:`prune_heads`, :func:`lone_head_costs`
- interventions: :func:`patch_sink`, :func:`remove_heads`, :func:`mask_attention`
- live sink patching: :func:`compare_sink_patch` (clean vs patched, one text),
  :func:`sink_patcher` (the Jupyter widget; ``pip install 'cw_lens[widget]'``)
- several runs of the main job side by side: :func:`compare_runs`, :class:`RunComparisonResult`
- contribution flow (docs/methods.md#flow): :func:`residual_shares`, :func:`stream_shares`,
  :func:`contribution_rollout`, :func:`attention_rollout`, :func:`routes`,
  :func:`rollout_deletion`, :func:`ioi_route_statistics`
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

from cw_lens import _moved
from cw_lens.version import __version__

# The public names, imported on first use (PEP 562): `import cw_lens`, `cw-lens --help` and
# `cw-lens --version` load neither torch nor TransformerLens. This block is the one list of
# where each public name lives: type checkers and the API docs read it as ordinary imports, and
# `_exports()` reads the same statements to resolve `cw_lens.<name>` at run time.
if TYPE_CHECKING:
    from cw_lens.analyses.contributions import (
        ContributionResult,
        contribution_weights,
        contribution_weights_from_cache,
    )
    from cw_lens.analyses.faithfulness import FaithfulnessResult, faithfulness
    from cw_lens.analyses.pruning import PruningResult, lone_head_costs, prune_heads
    from cw_lens.analyses.selection import (
        SelectionGeometryResult,
        geometric_prf,
        geometric_prf_batched,
        selection_geometry,
    )
    from cw_lens.analyses.sinks import (
        SinkAblationResult,
        SinkStatisticsResult,
        detect_sinks,
        sink_ablation,
        sink_rates,
        sink_statistics,
    )
    from cw_lens.analyses.taxonomy import HeadTaxonomyResult, head_taxonomy
    from cw_lens.core.errors import (
        CwLensError,
        EmbeddedModelMissing,
        InputError,
        ModelLoadError,
        UnsupportedModelError,
    )
    from cw_lens.core.results import ClaimsTable, Result
    from cw_lens.data.corpora import load_corpus
    from cw_lens.data.documents import Corpus, Document
    from cw_lens.data.streaming import stream_contributions
    from cw_lens.flow.evaluation import (
        IOIRouteStatisticsResult,
        RolloutDeletionResult,
        ioi_route_statistics,
        rollout_deletion,
    )
    from cw_lens.flow.rollout import RolloutResult, attention_rollout, contribution_rollout
    from cw_lens.flow.routes import RouteGraphResult, routes
    from cw_lens.flow.shares import (
        LayerSharesResult,
        ResidualSharesResult,
        residual_shares,
        stream_shares,
    )
    from cw_lens.interactive.comparison import (
        PatchControls,
        SinkPatchComparisonResult,
        compare_sink_patch,
    )
    from cw_lens.interactive.widget import SinkPatcher as SinkPatcher  # not in __all__
    from cw_lens.interactive.widget import sink_patcher
    from cw_lens.models.access import cache_names
    from cw_lens.models.interventions import HookSet, mask_attention, patch_sink, remove_heads
    from cw_lens.models.layer_contributions import LayerContributionsResult
    from cw_lens.models.load import load_model
    from cw_lens.models.verify import ModelVerificationResult, verify_model
    from cw_lens.reporting.run_comparison import RunComparisonResult, compare_runs

_moved.install(sys.modules[__name__])

__all__ = [
    "ClaimsTable",
    "ContributionResult",
    "Corpus",
    "CwLensError",
    "Document",
    "EmbeddedModelMissing",
    "FaithfulnessResult",
    "HeadTaxonomyResult",
    "HookSet",
    "IOIRouteStatisticsResult",
    "InputError",
    "LayerContributionsResult",
    "LayerSharesResult",
    "ModelLoadError",
    "ModelVerificationResult",
    "PatchControls",
    "PruningResult",
    "ResidualSharesResult",
    "Result",
    "RolloutDeletionResult",
    "RolloutResult",
    "RouteGraphResult",
    "RunComparisonResult",
    "SelectionGeometryResult",
    "SinkAblationResult",
    "SinkPatchComparisonResult",
    "SinkStatisticsResult",
    "UnsupportedModelError",
    "__version__",
    "attention_rollout",
    "cache_names",
    "compare_runs",
    "compare_sink_patch",
    "contribution_rollout",
    "contribution_weights",
    "contribution_weights_from_cache",
    "detect_sinks",
    "faithfulness",
    "geometric_prf",
    "geometric_prf_batched",
    "head_taxonomy",
    "ioi_route_statistics",
    "load_corpus",
    "load_model",
    "lone_head_costs",
    "mask_attention",
    "patch_sink",
    "prune_heads",
    "remove_heads",
    "residual_shares",
    "rollout_deletion",
    "routes",
    "selection_geometry",
    "sink_ablation",
    "sink_patcher",
    "sink_rates",
    "sink_statistics",
    "stream_contributions",
    "stream_shares",
    "verify_model",
]


def _exports() -> dict[str, str]:
    """``{public name: module}`` from the ``if TYPE_CHECKING:`` imports of this file."""
    import ast
    from pathlib import Path

    tree = ast.parse(Path(__file__).read_text(encoding="utf-8"))
    block = next(
        n for n in tree.body if isinstance(n, ast.If) and ast.unparse(n.test) == "TYPE_CHECKING"
    )
    return {
        alias.asname or alias.name: node.module
        for node in block.body
        if isinstance(node, ast.ImportFrom) and node.module
        for alias in node.names
    }


_EXPORTS: dict[str, str] | None = None


def __getattr__(name: str):
    """A public name (``cw_lens.load_model``), imported from its module on first use; the widget
    (``cw_lens.sink_patcher``) needs the optional ``anywidget`` (``pip install
    'cw_lens[widget]'``); ``cw_lens.sinks`` and the other module paths of 0.2 are deprecated
    aliases of their new homes, and ``cw_lens.SinkStatistics`` and the other result classes
    renamed to end in ``Result`` deprecated names of the new classes (:mod:`cw_lens._moved`)."""
    global _EXPORTS
    if _EXPORTS is None:
        _EXPORTS = _exports()
    module = _EXPORTS.get(name)
    if module is not None:  # before the old module paths: `faithfulness`, `routes` are both
        import importlib

        value = getattr(importlib.import_module(module), name)
        globals()[name] = value
        return value
    renamed = _moved.RENAMED.get(name)
    if renamed is not None:  # not cached: every use of the old name warns
        from cw_lens.core.deprecation import deprecated

        deprecated(f"cw_lens.{name} is now cw_lens.{renamed}")
        return __getattr__(renamed)
    old = _moved.moved_attribute(sys.modules[__name__], name)
    if old is not None:
        return old
    raise AttributeError(f"module 'cw_lens' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
