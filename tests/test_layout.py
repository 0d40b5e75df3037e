"""The layout of 0.3 keeps the API of 0.2: every public name of ``cw_lens`` as before, and every
old module path (``cw_lens.sinks``, ``cw_lens.report``, ...) for one minor version, with a
``DeprecationWarning`` naming the new path."""

from __future__ import annotations

import ast
import importlib
import importlib.util
import inspect
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

import cw_lens
from cw_lens import _moved

# cw_lens.__all__ at e018d9b (0.2.1, the last flat layout)
PUBLIC_0_2 = [
    "ContributionResult", "Corpus", "CwLensError", "Document", "EmbeddedModelMissing",
    "FaithfulnessResult", "HeadTaxonomyResult", "HookSet", "IOIRouteStatistics", "InputError",
    "LayerContributions", "LayerShares", "ModelLoadError", "ModelVerification", "PatchControls",
    "PruningResult", "ResidualShares", "RolloutDeletion", "RolloutResult", "RouteGraph",
    "RunComparison", "SelectionGeometryResult", "SinkAblation", "SinkPatchComparison",
    "SinkStatistics", "UnsupportedModelError", "__version__", "attention_rollout", "cache_names",
    "compare_runs", "compare_sink_patch", "contribution_rollout", "contribution_weights",
    "contribution_weights_from_cache", "detect_sinks", "faithfulness", "geometric_prf",
    "geometric_prf_batched", "head_taxonomy", "ioi_route_statistics", "load_corpus", "load_model",
    "lone_head_costs", "mask_attention", "patch_sink", "prune_heads", "remove_heads",
    "residual_shares", "rollout_deletion", "routes", "selection_geometry", "sink_ablation",
    "sink_patcher", "sink_rates", "sink_statistics", "stream_contributions", "stream_shares",
    "verify_model",
]  # fmt: skip

# the modules of cw_lens/ at e018d9b; `data`, `models`, `version` (and plots/, viz/) are still
# there under the same name, the others are deprecated aliases
FLAT_0_2 = [
    "access", "accumulate", "bootstrap", "capture", "claims", "cli", "compare", "contributions",
    "corpora", "data", "distributed", "edits", "errors", "exact", "faithfulness", "flow_capture",
    "flow_evaluation", "flow_geometry", "geometry", "gguf_cache", "hooked", "inputs",
    "interventions", "layer_contributions", "models", "patch_view", "pruning", "report",
    "resampled", "rollout", "routes", "scoring", "selection", "shares", "sink_patching", "sinks",
    "streaming", "taxonomy", "testing", "verify", "version", "weight_processing", "widget",
]  # fmt: skip
KEPT = {"data", "models", "version"}


# result classes renamed in 0.3 so that every result class name ends in `Result`
RENAMED_0_3 = {
    name: name + "Result"
    for name in ("IOIRouteStatistics", "LayerContributions", "LayerShares", "ModelVerification",
                 "ResidualShares", "RolloutDeletion", "RouteGraph", "RunComparison",
                 "SinkAblation", "SinkPatchComparison", "SinkStatistics")
}  # fmt: skip


def test_public_names_are_those_of_0_2():
    added = {"Result", "ClaimsTable"}  # the result protocol (0.3)
    now = sorted({RENAMED_0_3.get(name, name) for name in PUBLIC_0_2} | added)
    assert sorted(cw_lens.__all__) == now
    for name in sorted(set(PUBLIC_0_2) - set(RENAMED_0_3)):
        if name == "sink_patcher" and importlib.util.find_spec("anywidget") is None:
            continue  # the optional widget extra
        with warnings.catch_warnings():
            warnings.simplefilter("error", DeprecationWarning)
            assert getattr(cw_lens, name) is not None
            exec(f"from cw_lens import {name}", {})


@pytest.mark.parametrize("old", sorted(RENAMED_0_3))
def test_renamed_result_classes_keep_their_old_name_with_a_warning(old):
    new = getattr(cw_lens, RENAMED_0_3[old])
    with pytest.warns(DeprecationWarning, match=f"cw_lens.{old} is now cw_lens.{new.__name__}"):
        assert getattr(cw_lens, old) is new
    with pytest.warns(DeprecationWarning, match=new.__name__):
        namespace: dict = {}
        exec(f"from cw_lens import {old}", namespace)
    assert namespace[old] is new
    assert old not in dir(cw_lens)
    # the module that defines the class still has the old name (pickles name it there)
    module = importlib.import_module(new.__module__)
    with pytest.warns(DeprecationWarning, match=f"{module.__name__}.{old} is now {new.__name__}"):
        assert getattr(module, old) is new


def test_every_old_module_has_a_new_home():
    assert set(_moved.MOVED) == set(FLAT_0_2) - KEPT
    for old in _moved.MOVED:
        for new in _moved.homes(old):
            importlib.import_module(new)


def _public_object(module) -> str:
    """A function or class defined in ``module`` (or its subpackage) and not private."""
    for name, obj in sorted(vars(module).items()):
        if name.startswith("_") or not (inspect.isfunction(obj) or inspect.isclass(obj)):
            continue
        if getattr(obj, "__module__", "").startswith(module.__name__):
            return name
    raise AssertionError(f"{module.__name__} defines no public function or class")


@pytest.mark.parametrize("old", sorted(_moved.MOVED))
def test_old_module_path_warns_and_forwards(old):
    new = importlib.import_module(_moved.homes(old)[0])
    name = _public_object(new)
    with pytest.warns(DeprecationWarning, match=rf"cw_lens\.{old} .*{new.__name__}"):
        namespace: dict = {}
        exec(f"from cw_lens.{old} import {name}", namespace)
    assert namespace[name] is getattr(new, name)
    with pytest.warns(DeprecationWarning, match=new.__name__):
        module = importlib.import_module(f"cw_lens.{old}")
        assert getattr(module, name) is getattr(new, name)


def test_old_paths_do_not_hide_the_functions_of_the_same_name():
    import cw_lens.faithfulness
    import cw_lens.routes

    assert inspect.isfunction(cw_lens.routes)
    assert inspect.isfunction(cw_lens.faithfulness)
    with pytest.warns(DeprecationWarning, match="cw_lens.analyses.sinks"):
        assert cw_lens.sinks.sink_statistics is cw_lens.sink_statistics
    # a module split in two: each name from where it lives now
    with pytest.warns(DeprecationWarning, match="cw_lens.reporting.markdown"):
        from cw_lens.report import claims_markdown
    with pytest.warns(DeprecationWarning, match="cw_lens.reporting.job"):
        from cw_lens.report import run_figures
    from cw_lens.reporting import job, markdown

    assert claims_markdown is markdown.claims_markdown and run_figures is job.run_figures


def test_data_and_models_keep_their_names_without_a_warning():
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        from cw_lens.data import Corpus, ioi_items, windows  # noqa: F401
        from cw_lens.models import EMBEDDED_NAME, embedded_tokenizer, load_model  # noqa: F401

    assert load_model is cw_lens.load_model and Corpus is cw_lens.Corpus


def test_python_m_old_cli_runs_the_new_one():
    out = subprocess.run(
        [sys.executable, "-W", "ignore::RuntimeWarning", "-m", "cw_lens.cli", "--help"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    assert "figures" in out.stdout
    assert "deprecated" in out.stderr


PACKAGE = Path(cw_lens.__file__).parent


def test_no_module_over_600_lines_and_long_functions_say_why():
    too_long, unexplained = [], []
    for path in sorted(PACKAGE.rglob("*.py")):
        text = path.read_text()
        if text.count("\n") > 600:
            too_long.append(f"{path.relative_to(PACKAGE)}: {text.count(chr(10))} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                lines = node.end_lineno - node.lineno + 1
                if lines > 80 and "Long:" not in (ast.get_docstring(node) or ""):
                    unexplained.append(f"{path.relative_to(PACKAGE)}:{node.lineno} {node.name}")
    assert not too_long, too_long
    assert not unexplained, f"over 80 lines without a 'Long:' reason: {unexplained}"
