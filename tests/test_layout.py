"""The layout of the package: every public name of ``cw_lens`` 0.2 still there (under its
0.3 name), the module paths and class names of 0.2 and 0.3.0 gone since 0.4.1 (CHANGELOG.md
lists each with its new name), and the layout's own rules (module size, weight reads, devices)."""

from __future__ import annotations

import ast
import importlib
import importlib.util
import inspect
import re
import warnings
from pathlib import Path

import pytest

import cw_lens

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
# there under the same name, the others moved into subpackages in 0.3 (docs/architecture.md)
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


# entry points merged into another in 0.5: still importable from cw_lens (not in __all__), each
# call warns and names its replacement; removed in 0.6
DEPRECATED_0_5 = {"geometric_prf_batched": "geometric_prf"}


def test_merged_entry_points_warn_and_name_their_replacement():
    import torch

    values, attention = torch.randn(3, 6, 4), torch.softmax(torch.randn(3, 6), -1)
    calls = {"geometric_prf_batched": lambda f: f(values, attention, [1, 2])}
    assert set(calls) == set(DEPRECATED_0_5)
    for old, new in DEPRECATED_0_5.items():
        assert old not in cw_lens.__all__ and new in cw_lens.__all__
        with pytest.warns(DeprecationWarning, match=rf"{old}\(.*{new}\(.*removed in cw_lens 0\.6"):
            calls[old](getattr(cw_lens, old))


def test_public_names_are_those_of_0_2():
    # the result protocol (0.3), the model type, the memory budget's error, loading saved results
    # and several corpus analyses from one pass (0.4.1), the accumulators (0.5)
    added = {"Result", "ClaimsTable", "Model", "MemoryBudgetError", "load_result"}
    added |= {"corpus_analyses"}
    added |= {"Accumulator", "SinkStatisticsAccumulator", "SelectionGeometryAccumulator"}
    added |= {"HeadTaxonomyAccumulator", "SinkAblationAccumulator"}
    added |= {"input_deletion", "InputDeletionResult"}  # every attribution method, one test
    kept = {RENAMED_0_3.get(name, name) for name in PUBLIC_0_2} - set(DEPRECATED_0_5)
    now = sorted(kept | added)
    assert sorted(cw_lens.__all__) == now
    for name in now:
        if name == "sink_patcher" and importlib.util.find_spec("anywidget") is None:
            continue  # the optional widget extra
        with warnings.catch_warnings():
            warnings.simplefilter("error", DeprecationWarning)
            assert getattr(cw_lens, name) is not None
            exec(f"from cw_lens import {name}", {})


def test_the_result_class_names_of_0_2_are_gone():
    """Removed in 0.4.1 (kept with a DeprecationWarning until then): neither `cw_lens` nor the
    module that defines the class has the old name, so a pickle that names it no longer loads."""
    for old, new in RENAMED_0_3.items():
        assert not hasattr(cw_lens, old), old
        with pytest.raises(ImportError):
            exec(f"from cw_lens import {old}", {})
        cls = getattr(cw_lens, new)
        assert cls.__name__ == new and not hasattr(importlib.import_module(cls.__module__), old)
    sinks = importlib.import_module("cw_lens.analyses.sinks")  # re-exports two of the classes
    assert not any(hasattr(sinks, old) for old in RENAMED_0_3)


def test_the_module_paths_of_0_2_are_gone():
    """Removed in 0.4.1: `cw_lens.sinks`, `cw_lens.report`, `python -m cw_lens.cli` and the
    other flat module paths of 0.2 no longer import; `cw_lens.faithfulness` and
    `cw_lens.routes` are the functions of those names."""
    for old in sorted(set(FLAT_0_2) - KEPT):
        with pytest.raises(ModuleNotFoundError):
            importlib.import_module(f"cw_lens.{old}")
        assert not inspect.ismodule(getattr(cw_lens, old, None)), old
    assert inspect.isfunction(cw_lens.routes) and inspect.isfunction(cw_lens.faithfulness)
    assert not (Path(cw_lens.__file__).parent / "_moved.py").exists()


def test_data_and_models_keep_their_names_without_a_warning():
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        from cw_lens.data import Corpus, ioi_items, windows  # noqa: F401
        from cw_lens.models import EMBEDDED_NAME, embedded_tokenizer, load_model  # noqa: F401

    assert load_model is cw_lens.load_model and Corpus is cw_lens.Corpus


PACKAGE = Path(cw_lens.__file__).parent


def _docstring_lines(node: ast.AST) -> int:
    """Lines of the string statements (docstrings) directly in `node`'s body."""
    body = getattr(node, "body", None)
    return sum(
        s.end_lineno - s.lineno + 1
        for s in (body if isinstance(body, list) else [])
        if isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant)
        and isinstance(s.value.value, str)
    )  # fmt: skip


def test_long_modules_and_long_functions_say_why():
    """A module is one concept, and 600 lines is a hint, never a reason to split one: a module
    of over 600 lines (every line counts, docstrings and comments too, as `wc -l` counts them)
    says why it is one concept in a `# One concept:` comment, and none is over 900. A function
    of over 80 lines of code (docstrings not counted) says why in a `# Long:` comment of its
    body."""
    too_long, unexplained = [], []
    for path in sorted(PACKAGE.rglob("*.py")):
        text = path.read_text()
        tree = ast.parse(text)
        lines = len(text.splitlines())
        if lines > 900 or (lines > 600 and "# One concept:" not in text):
            too_long.append(f"{path.relative_to(PACKAGE)}: {lines} lines")
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                lines = node.end_lineno - node.lineno + 1 - _docstring_lines(node)
                if lines > 80 and "# Long:" not in ast.get_source_segment(text, node):
                    unexplained.append(f"{path.relative_to(PACKAGE)}:{node.lineno} {node.name}")
    assert not too_long, too_long
    assert not unexplained, f"over 80 lines without a '# Long:' reason: {unexplained}"


# weights as TransformerLens and PyTorch name them; `w` and `b` (norm gain and bias) only as
# getattr strings, the one way cw_lens reads them
WEIGHT_NAMES = {
    "W_Q", "W_K", "W_V", "W_O", "b_Q", "b_K", "b_V", "b_O", "W_in", "W_out", "W_gate", "b_in",
    "b_out", "W_U", "b_U", "W_E", "W_pos", "weight", "bias",
}  # fmt: skip
# receivers that hold weights already read: LayerWeights (`weights`, `w`, `output_weights(l)`),
# NormSpec (`spec`), a class's own fields (`self`)
READ_ALREADY = re.compile(r"(^|\.)(weights|w|spec|self)$|\.output_weights\(.*\)$")
# reads that are not outside a forward pass of an analysed model: the resident GGUF cache reads
# the model it builds; `_state_dict` runs inside `resident_weights` (hooked.from_hf)
WEIGHT_READS_ELSEWHERE = {"models/gguf_cache.py": "*", "models/hooked.py": "_state_dict"}


def _weight_reads(tree: ast.AST) -> list[tuple[int, str, str]]:
    """(line, innermost function, expression) of every weight read in a syntax tree."""
    found = []

    def visit(node: ast.AST, func: str) -> None:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            func = node.name
        receiver = attr = None
        if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load):
            if node.attr in WEIGHT_NAMES:
                receiver, attr = node.value, node.attr
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id == "getattr"
            and len(node.args) >= 2
            and isinstance(node.args[1], ast.Constant)
            and node.args[1].value in WEIGHT_NAMES | {"w", "b"}
        ):
            receiver, attr = node.args[0], node.args[1].value
        if receiver is not None and not READ_ALREADY.search(ast.unparse(receiver)):
            found.append((node.lineno, func, f"{ast.unparse(receiver)}.{attr}"))
        for child in ast.iter_child_nodes(node):
            visit(child, func)

    visit(tree, "<module>")
    return found


def test_weights_are_read_outside_a_forward_pass_only_through_resident_weights():
    """An offloaded model's weights are on `meta` between passes: a direct `attn.W_O` outside
    `cw_lens.models.offload` reads nothing (tests/test_offload.py checks the results)."""
    direct = []
    for path in sorted(PACKAGE.rglob("*.py")):
        where = path.relative_to(PACKAGE).as_posix()
        if where == "models/offload.py":
            continue
        for line, func, expr in _weight_reads(ast.parse(path.read_text())):
            if WEIGHT_READS_ELSEWHERE.get(where) not in ("*", func):
                direct.append(f"{where}:{line} {expr}")
    assert not direct, (
        "weights read directly; read them with cw_lens.models.offload.read_weights (or inside "
        f"resident_weights) so that offloaded models work: {direct}"
    )
    hooks = [
        path.relative_to(PACKAGE).as_posix()
        for path in PACKAGE.rglob("*.py")
        if re.search(r"align_module_device|align_offloaded_subtree|_hf_hook", path.read_text())
    ]
    assert hooks == ["models/offload.py"], hooks


def test_the_weight_read_check_catches_a_direct_read():
    reads = _weight_reads(ast.parse("def f(model):\n    return model.blocks[0].attn.W_O\n"))
    assert reads == [(2, "f", "model.blocks[0].attn.W_O")]
    got = _weight_reads(ast.parse("def f(norm):\n    return getattr(norm, 'w', None)\n"))
    assert got == [(2, "f", "norm.w")]
    assert not _weight_reads(ast.parse("def f(acts):\n    return acts.weights.W_O\n"))


# the factory functions `torch.set_default_device` redirects (tests/device_trap.py has the
# run-time check; this one covers the code no test runs)
TORCH_FACTORIES = {
    "zeros", "ones", "empty", "full", "arange", "range", "tensor", "as_tensor", "asarray", "eye",
    "rand", "randn", "randint", "randperm", "linspace", "logspace", "tril_indices",
    "triu_indices", "scalar_tensor", "empty_strided",
}  # fmt: skip
# writes random test models and GGUF files on the CPU, never near an analysed model's tensors
FACTORIES_ELSEWHERE = {"models/gguf_writer.py"}


def test_every_tensor_cw_lens_creates_names_its_device():
    """`torch.zeros(n)` goes to the default device (the GPU after
    `torch.set_default_device("cuda")`), not to its inputs' device: name it."""
    unnamed = []
    for path in sorted(PACKAGE.rglob("*.py")):
        where = path.relative_to(PACKAGE).as_posix()
        if where in FACTORIES_ELSEWHERE:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and isinstance(node.func.value, ast.Name)
                and node.func.value.id == "torch"
                and node.func.attr in TORCH_FACTORIES
                and not any(k.arg == "device" for k in node.keywords)
            ):
                unnamed.append(f"{where}:{node.lineno} {ast.unparse(node)[:60]}")
    assert not unnamed, (
        "torch factory calls without device= (the inputs' device, or 'cpu' for what stays "
        f"there; cw_lens.core.devices.to_tensor for a value that may be a tensor): {unnamed}"
    )


# ---------------------------------------------------------------------- seams between modules


def _package_imports() -> dict[str, set[str]]:
    """Every module of the package and the modules it imports, deferred imports included."""
    import grimp

    graph = grimp.build_graph("cw_lens")
    return {m: set(graph.find_modules_directly_imported_by(m)) for m in graph.modules}


def test_there_is_no_import_cycle_deferred_imports_included():
    import networkx as nx

    edges = [(m, d) for m, deps in _package_imports().items() for d in deps]
    cycles = sorted(sorted(c) for c in nx.simple_cycles(nx.DiGraph(edges)))
    assert cycles == [], f"import cycles: {cycles}"


def _private_imports(source: str) -> list[tuple[int, str, str]]:
    """`(line, module, name)` of every `from cw_lens... import _name` in `source`."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("cw_lens"):
            for alias in node.names:
                if alias.name.startswith("_") and not alias.name.startswith("__"):
                    found.append((node.lineno, node.module, alias.name))
    return found


def test_no_module_imports_a_private_name_of_another():
    """A name another module uses is public: `from cw_lens.x import _y` is refused anywhere in
    the package (tests and benchmarks may reach in)."""
    offenders = [
        f"{path.relative_to(PACKAGE.parent)}:{line}: {name} from {module}"
        for path in sorted(PACKAGE.rglob("*.py"))
        for line, module, name in _private_imports(path.read_text())
    ]
    assert offenders == [], "\n".join(offenders)


def test_the_private_import_check_catches_one():
    source = "from cw_lens.analyses.pruning.passes import (\n    public,\n    _hidden,\n)\n"
    assert _private_imports(source) == [(1, "cw_lens.analyses.pruning.passes", "_hidden")]


TOOLKIT = ("analyses", "core", "data", "flow", "interactive", "models", "plots", "reference", "viz")


def test_the_toolkit_never_imports_the_reproduction():
    """The contract lint-imports checks, read from the import graph itself (deferred imports
    included): no toolkit module imports `cw_lens.reproduction` or anything in it."""
    offenders = sorted(
        f"{m} -> {d}"
        for m, deps in _package_imports().items()
        if m.split(".")[1:2] and m.split(".")[1] in TOOLKIT
        for d in deps
        if d == "cw_lens.reproduction" or d.startswith("cw_lens.reproduction.")
    )
    assert offenders == [], "\n".join(offenders)


def test_every_mutant_names_a_snippet_that_occurs_once():
    """`make mutants` applies each curated wrong formula to one snippet of one file; a snippet
    that moved or changed would make the mutant an error instead of a check, so every snippet
    is checked here, on every `make test`."""
    import sys

    sys.path.insert(0, str(PACKAGE.parent / "tests"))
    try:
        import mutants
    finally:
        sys.path.pop(0)
    stale = [
        f"{mu.name}: {mu.path} holds the snippet {count} times"
        for mu in mutants.MUTANTS
        for count in [(PACKAGE.parent / mu.path).read_text().count(mu.old)]
        if count != 1
    ]
    assert stale == [], "\n".join(stale)
    tests = {t.split("::")[0] for mu in mutants.MUTANTS for t in mu.tests}
    assert all((PACKAGE.parent / t).exists() for t in tests), tests


def test_the_reproduction_is_reached_from_the_package_in_a_fresh_process():
    """`import cw_lens` then `cw_lens.reproduction.claims(...)`, as the docs write it, works
    in any import order: the attribute is the function, every analysis's answer registered."""
    import subprocess
    import sys

    code = (
        "import cw_lens\n"
        "claims = cw_lens.reproduction.claims\n"
        "import cw_lens.reproduction.verdicts, cw_lens.reproduction.protocol\n"
        "assert cw_lens.reproduction.claims is claims and callable(claims)\n"
        "print(sorted(c.__name__ for c in claims.registry if c is not object))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == [
        "['FaithfulnessResult',",
        "'HeadTaxonomyResult',",
        "'InputDeletionResult',",
        "'PruningResult',",
        "'SelectionGeometryResult',",
        "'SinkAblationResult',",
        "'SinkStatisticsResult']",
    ]


def test_the_module_paths_of_0_4_that_moved_still_import_with_a_warning():
    """Each old path of `cw_lens.moved_modules.MOVED_MODULES` is no file any more, imports as
    the new module itself (one object), and warns with the new path; a fresh process, so that
    no earlier import has cached a path."""
    import subprocess
    import sys

    from cw_lens.moved_modules import MOVED_MODULES

    for old in MOVED_MODULES:
        relative = Path(*old.split(".")[1:])
        assert not (PACKAGE / f"{relative}.py").exists() and not (PACKAGE / relative).exists()
    code = (
        "import importlib, warnings\n"
        "from cw_lens.moved_modules import MOVED_MODULES\n"
        "for old, new in MOVED_MODULES.items():\n"
        "    with warnings.catch_warnings(record=True) as seen:\n"
        "        warnings.simplefilter('always')\n"
        "        module = importlib.import_module(old)\n"
        "    assert module is importlib.import_module(new), old\n"
        "    assert any(f'{old} is now {new}' in str(w.message) for w in seen), old\n"
        "from cw_lens.reporting.job import JobConfig\n"
        "from cw_lens.reproduction.job import JobConfig as New\n"
        "assert JobConfig is New\n"
        "print('ok', len(MOVED_MODULES))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.stdout.startswith("ok"), out.stdout + out.stderr
    cli = subprocess.run(
        [sys.executable, "-m", "cw_lens.reporting.cli", "--version"], capture_output=True, text=True
    )
    assert cli.stdout.strip() == f"cw_lens {cw_lens.__version__}", cli.stdout + cli.stderr


MOVED_NAMES_0_5 = {
    "cw_lens.analyses.sinks": ("sink_claims", "LAYER_NUMBERS", "MIN_S_STAR_QUERIES"),
    "cw_lens.analyses.selection": ("selection_claims", "SINK_N", "SMALL_N"),
    "cw_lens.analyses.faithfulness": ("faithfulness_claim",),
    "cw_lens.analyses.pruning": ("pruning_claim",),
    "cw_lens.plots": ("plot_per_layer_intervals",),
}


@pytest.mark.parametrize("package", sorted(MOVED_NAMES_0_5))
def test_names_that_moved_to_the_reproduction_still_import_with_a_warning(package):
    module = importlib.import_module(package)
    for name in MOVED_NAMES_0_5[package]:
        assert name not in module.__all__
        vars(module).pop(name, None)  # a name asked for once is cached: ask afresh
        with pytest.warns(DeprecationWarning, match=rf"{package}\.{name} is now cw_lens\.repro"):
            value = getattr(module, name)
        assert value is not None
