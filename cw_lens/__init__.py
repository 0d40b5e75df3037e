"""cw_lens — contribution weights and attention-sink geometry for TransformerLens models.

Public API (re-exports only; each function's module docstring states its formula and paper):

- models: [`load_model`][cw_lens.load_model]
- the result protocol every result follows: [`Result`][cw_lens.Result]; results saved by
  `result.save(path)` load with [`load_result`][cw_lens.load_result]
- data: [`load_corpus`][cw_lens.load_corpus], [`Corpus`][cw_lens.Corpus],
  [`Document`][cw_lens.Document]
- contributions (P1): [`contribution_weights`][cw_lens.contribution_weights],
  [`contribution_weights_from_cache`][cw_lens.contribution_weights_from_cache],
  [`stream_contributions`][cw_lens.stream_contributions],
  [`ContributionResult`][cw_lens.ContributionResult],
  [`LayerContributionsResult`][cw_lens.LayerContributionsResult]
- sinks (P1): [`sink_statistics`][cw_lens.sink_statistics],
  [`sink_ablation`][cw_lens.sink_ablation], [`sink_rates`][cw_lens.sink_rates],
  [`detect_sinks`][cw_lens.detect_sinks]
- several corpus analyses (sinks, selection, taxonomy, the sink ablation) from one pass:
  [`corpus_analyses`][cw_lens.corpus_analyses]
- faithfulness (P1): [`faithfulness`][cw_lens.faithfulness],
  [`FaithfulnessResult`][cw_lens.FaithfulnessResult]
- selection (P2): [`geometric_prf`][cw_lens.geometric_prf],
  [`selection_geometry`][cw_lens.selection_geometry]; taxonomy:
  [`head_taxonomy`][cw_lens.head_taxonomy]; pruning: [`prune_heads`][cw_lens.prune_heads],
  [`lone_head_costs`][cw_lens.lone_head_costs]
- interventions: [`patch_sink`][cw_lens.patch_sink], [`remove_heads`][cw_lens.remove_heads],
  [`mask_attention`][cw_lens.mask_attention]
- live sink patching: [`compare_sink_patch`][cw_lens.compare_sink_patch] (clean vs patched, one
  text), [`sink_patcher`][cw_lens.sink_patcher] (the Jupyter widget; `pip install
  'cw_lens[widget]'`)
- the papers' reproduction, above the toolkit (`cw_lens.reproduction`): a result's claims,
  their intervals and verdicts (`cw_lens.reproduction.claims(result, bootstrap)`, a
  [`ClaimsTable`][cw_lens.ClaimsTable]); several runs of the main job side by side:
  [`compare_runs`][cw_lens.compare_runs], [`RunComparisonResult`][cw_lens.RunComparisonResult]
- contribution flow (docs/methods.md#flow): [`residual_shares`][cw_lens.residual_shares],
  [`stream_shares`][cw_lens.stream_shares], [`contribution_rollout`][cw_lens.contribution_rollout],
  [`attention_rollout`][cw_lens.attention_rollout], [`routes`][cw_lens.routes],
  [`rollout_deletion`][cw_lens.rollout_deletion],
  [`input_deletion`][cw_lens.input_deletion] (every attribution method on one input-level
  ERASER test),
  [`ioi_route_statistics`][cw_lens.ioi_route_statistics]
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from cw_lens.moved_modules import install as _install_moved_modules
from cw_lens.version import __version__

_install_moved_modules()  # the module paths of 0.4 that moved in 0.5 (until 0.6)

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
    from cw_lens.analyses.corpus import corpus_analyses
    from cw_lens.analyses.faithfulness import FaithfulnessResult, faithfulness
    from cw_lens.analyses.pruning import PruningResult, lone_head_costs, prune_heads
    from cw_lens.analyses.selection import (
        SelectionGeometryAccumulator,
        SelectionGeometryResult,
        geometric_prf,
        selection_geometry,
    )
    from cw_lens.analyses.selection import (
        geometric_prf_batched as geometric_prf_batched,  # deprecated (0.5): not in __all__
    )
    from cw_lens.analyses.sinks import (
        SinkAblationAccumulator,
        SinkAblationResult,
        SinkStatisticsAccumulator,
        SinkStatisticsResult,
        detect_sinks,
        sink_ablation,
        sink_rates,
        sink_statistics,
    )
    from cw_lens.analyses.taxonomy import (
        HeadTaxonomyAccumulator,
        HeadTaxonomyResult,
        head_taxonomy,
    )
    from cw_lens.core.accumulators import Accumulator
    from cw_lens.core.errors import (
        CwLensError,
        EmbeddedModelMissing,
        InputError,
        MemoryBudgetError,
        ModelLoadError,
        UnsupportedModelError,
    )
    from cw_lens.core.results import Result, load_result
    from cw_lens.data.corpora import load_corpus
    from cw_lens.data.documents import Corpus, Document
    from cw_lens.data.streaming import stream_contributions
    from cw_lens.flow.evaluation import (
        IOIRouteStatisticsResult,
        RolloutDeletionResult,
        ioi_route_statistics,
        rollout_deletion,
    )
    from cw_lens.flow.input_deletion import InputDeletionResult, input_deletion
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
    from cw_lens.models.access import Model, cache_names
    from cw_lens.models.interventions import HookSet, mask_attention, patch_sink, remove_heads
    from cw_lens.models.layer_contributions import LayerContributionsResult
    from cw_lens.models.load import load_model
    from cw_lens.models.verify import ModelVerificationResult, verify_model
    from cw_lens.reproduction.run_comparison import RunComparisonResult, compare_runs
    from cw_lens.reproduction.verdicts import ClaimsTable

__all__ = [
    "Accumulator",
    "ClaimsTable",
    "ContributionResult",
    "Corpus",
    "CwLensError",
    "Document",
    "EmbeddedModelMissing",
    "FaithfulnessResult",
    "HeadTaxonomyAccumulator",
    "HeadTaxonomyResult",
    "HookSet",
    "IOIRouteStatisticsResult",
    "InputDeletionResult",
    "InputError",
    "LayerContributionsResult",
    "LayerSharesResult",
    "MemoryBudgetError",
    "Model",
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
    "SelectionGeometryAccumulator",
    "SelectionGeometryResult",
    "SinkAblationAccumulator",
    "SinkAblationResult",
    "SinkPatchComparisonResult",
    "SinkStatisticsAccumulator",
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
    "corpus_analyses",
    "detect_sinks",
    "faithfulness",
    "geometric_prf",
    "head_taxonomy",
    "input_deletion",
    "ioi_route_statistics",
    "load_corpus",
    "load_model",
    "load_result",
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
    """`{public name: module}` from the `if TYPE_CHECKING:` imports of this file."""
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
    """A public name (`cw_lens.load_model`), imported from its module on first use; the widget
    (`cw_lens.sink_patcher`) needs the optional `anywidget` (`pip install
    'cw_lens[widget]'`)."""
    global _EXPORTS
    if name == "reproduction":  # the layer above the toolkit: `cw_lens.reproduction.claims(...)`
        import importlib

        return importlib.import_module("cw_lens.reproduction")
    if _EXPORTS is None:
        _EXPORTS = _exports()
    module = _EXPORTS.get(name)
    if module is not None:
        import importlib

        value = getattr(importlib.import_module(module), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'cw_lens' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
