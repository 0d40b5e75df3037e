"""The result protocol: every public result has a short repr (no tensor contents), a DataFrame
``summary()``, printable ``claims()``, and layer selection by layer number."""

from __future__ import annotations

import dataclasses
import json
import math
import pickle
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch

import cw_lens
from cw_lens import reproduction
from cw_lens.core.errors import InputError
from cw_lens.core.results import Result
from cw_lens.core.saving import object_state
from cw_lens.models.testing import tiny_llama
from cw_lens.reproduction.verdicts import VERDICTS, ClaimsTable

TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "Attention heads select tokens; some of them mostly look at the first one.",
]
RUNS = Path(__file__).parent / "fixtures" / "compare"
IOI_COLUMNS = ["reaches_io", "reaches_io_embedding", "reaches_s1", "reaches_s2",
               "io_into_target", "s_into_target", "n_edges", "n_mlp_edges"]  # fmt: skip
RESULT_NAMES = [
    "ContributionResult", "LayerContributionsResult", "SinkStatisticsResult",
    "SinkAblationResult", "SelectionGeometryResult", "HeadTaxonomyResult", "PruningResult",
    "FaithfulnessResult", "ResidualSharesResult", "LayerSharesResult", "RolloutResult",
    "RouteGraphResult", "RolloutDeletionResult", "InputDeletionResult", "IOIRouteStatisticsResult",
    "SinkPatchComparisonResult", "RunComparisonResult", "ModelVerificationResult",
]  # fmt: skip


@pytest.fixture(scope="module")
def model():
    return tiny_llama(seed=0, n_layers=2)


@pytest.fixture(scope="module")
def results(model):
    """One instance of every result an entry point returns (tiny settings)."""
    out = {
        "ContributionResult": cw_lens.contribution_weights(model, TEXTS, layers=[1]),
        "SinkStatisticsResult": cw_lens.sink_statistics(model, TEXTS, min_query=2),
        "SinkAblationResult": cw_lens.sink_ablation(model, TEXTS, layers=[1]),
        "SelectionGeometryResult": cw_lens.selection_geometry(
            model, TEXTS, n_random=2, progress=False
        ),
        "HeadTaxonomyResult": cw_lens.head_taxonomy(model, TEXTS, progress=False),
        "PruningResult": cw_lens.prune_heads(
            model, TEXTS, retention=(1.0, 0.5), n_random=1, progress=False
        ),
        "FaithfulnessResult": cw_lens.faithfulness(
            model, TEXTS, metrics=("attention", "value_norm", "value_norm_output",
            "contribution"), fractions=(0.1,), progress=False,
        ),
        "ResidualSharesResult": cw_lens.residual_shares(model, TEXTS, layers=[0, 1]),
        "RolloutResult": cw_lens.contribution_rollout(model, TEXTS),
        "RouteGraphResult": cw_lens.routes(model, TEXTS[0]),
        "RolloutDeletionResult": cw_lens.rollout_deletion(model, TEXTS, ks=(1,), n_random=1),
        "InputDeletionResult": cw_lens.input_deletion(
            model, TEXTS, methods=("contribution_rollout", "value_zeroing"), fractions=(0.5,),
            n_random=1, progress=False,
        ),
        "SinkPatchComparisonResult": cw_lens.compare_sink_patch(model, TEXTS[0], view_layers=[1]),
        "RunComparisonResult": cw_lens.compare_runs([RUNS / "run_a", RUNS / "run_b"]),
        "ModelVerificationResult": cw_lens.verify_model(model),
        "IOIRouteStatisticsResult": cw_lens.IOIRouteStatisticsResult(
            items=pd.DataFrame({c: [1.0] for c in IOI_COLUMNS}),
            heads=pd.DataFrame({"layer": [1, 0], "head": [0, 2], "io_items": [3, 5]}),
            threshold=0.02,
        ),
    }  # fmt: skip
    streamed = {}
    cw_lens.stream_contributions(model, TEXTS, lambda lc: streamed.setdefault("c", lc))
    cw_lens.stream_shares(model, TEXTS, lambda ls: streamed.setdefault("s", ls))
    out["LayerContributionsResult"], out["LayerSharesResult"] = streamed["c"], streamed["s"]
    return out


@pytest.mark.parametrize("name", RESULT_NAMES)
def test_repr_is_short_and_prints_no_tensor(results, name):
    result = results[name]
    assert type(result).__name__ == name and isinstance(result, Result)
    text = repr(result)
    assert text.startswith(name + "(")
    assert len(text) < 400, text
    assert "tensor(" not in text and "\n" not in text, text


@pytest.mark.parametrize("name", RESULT_NAMES)
def test_summary_is_a_dataframe(results, name):
    assert isinstance(results[name].summary(), pd.DataFrame)


def test_repr_names_model_and_layers_and_shapes(results):
    text = repr(results["ContributionResult"])
    assert "layers=[1]" in text and "attention=Tensor[2x1x" in text, text


def test_jupyter_pretty_printer_uses_the_short_repr(results):
    IPython = pytest.importorskip("IPython.lib.pretty")
    result = results["ResidualSharesResult"]
    assert IPython.pretty(result) == repr(result)


def test_old_summaries_stay_reachable(results):
    assert isinstance(results["SelectionGeometryResult"].summary_dict(), dict)
    tax = results["HeadTaxonomyResult"]
    assert tax.summary()["retriever_share"].iloc[0] == tax.summary_dict()["retriever_share"]
    assert isinstance(results["IOIRouteStatisticsResult"].summary_dict(), dict)
    verification = results["ModelVerificationResult"]
    assert verification.summary_text() == str(verification)
    assert bool(verification.summary()["ok"].iloc[0]) is verification.ok


CLAIMS = ["SinkStatisticsResult", "SinkAblationResult", "SelectionGeometryResult",
          "HeadTaxonomyResult", "PruningResult", "FaithfulnessResult"]  # fmt: skip


@pytest.mark.parametrize("name", CLAIMS)
def test_claims_are_a_printable_table(results, name):
    claims = reproduction.claims(results[name])
    assert isinstance(claims, ClaimsTable) and claims
    cid = next(iter(claims))
    assert all(c["holds"] in VERDICTS for c in claims.values())
    text = repr(claims)
    assert text.startswith("ClaimsTable") and cid in text and "{" not in text
    frame = claims.to_dataframe()
    assert list(frame["claim"]) == list(claims) and len(frame) == len(claims)
    assert type(claims.to_dict()) is dict and claims.to_dict() == claims
    assert f"`{cid}`" in claims._repr_markdown_()


@pytest.mark.parametrize("name", CLAIMS)
def test_the_old_claims_method_warns_and_gives_what_the_reproduction_gives(results, name):
    result = results[name]
    with pytest.warns(DeprecationWarning, match=r"cw_lens\.reproduction\.claims\(result"):
        old = result.claims()
    new = reproduction.claims(result)
    assert json.dumps(old, sort_keys=True) == json.dumps(new, sort_keys=True)  # NaN-aware


def test_a_result_without_claims_is_told_which_results_have_them(results):
    with pytest.raises(InputError, match=r"bears on none of the papers.*HeadTaxonomyResult"):
        reproduction.claims(results["ContributionResult"])


def test_layer_selects_by_layer_number(model):
    cw = cw_lens.contribution_weights(model, TEXTS, layers=[0, 1])
    one = cw.layer(1)
    assert isinstance(one, cw_lens.ContributionResult) and one.layers == [1]
    assert one.weights.shape[1] == 1
    torch.testing.assert_close(one.weights[:, 0], cw.weights[:, 1], equal_nan=True)
    assert cw.layer_index(1) == 1
    with pytest.raises(InputError, match=r"Layer 5 is not in this ContributionResult.*\[0, 1\]"):
        cw.layer(5)


def test_layer_on_shares_and_selection(results):
    shares = results["ResidualSharesResult"]
    torch.testing.assert_close(
        shares.layer(1).residual[:, 0], shares.residual[:, 1], equal_nan=True
    )
    geo = results["SelectionGeometryResult"]
    assert geo.layer(0).sums[0].equal(geo.sums[0])
    with pytest.raises(InputError, match="has no layer axis"):
        results["RolloutResult"].layer(0)


def test_layer_on_the_sink_tables(model, results):
    """`layer(n)` of the sink results: the result of layer NUMBER n, whose table is the
    per-head rows of layer n."""
    stats = results["SinkStatisticsResult"]
    n_heads = model.cfg.n_heads
    assert stats.layers == [0, 1]
    expected = stats.heads().iloc[n_heads:].reset_index(drop=True)  # layer-major: layer 1
    one = stats.layer(1)
    assert isinstance(one, cw_lens.SinkStatisticsResult) and one.layers == [1]
    pd.testing.assert_frame_equal(one.to_dataframe(), expected)
    top = expected.nlargest(2, "sink_rate").reset_index(drop=True)
    pd.testing.assert_frame_equal(one.top(k=2), top)
    assert stats.layers == [0, 1] and len(stats.heads()) == 2 * n_heads  # unchanged
    # the same rows when layer 1 is the only one analysed (position 0 of that result)
    only = cw_lens.sink_statistics(model, TEXTS, layers=[1], min_query=2, progress=False)
    pd.testing.assert_frame_equal(only.layer(1).to_dataframe(), expected)
    pd.testing.assert_frame_equal(one.drivers(), only.drivers())
    pd.testing.assert_frame_equal(one.curve(), only.curve())
    with pytest.raises(InputError, match=r"Layer 0 is not in this SinkStatisticsResult.*\[1\]"):
        only.layer(0)
    ablation = results["SinkAblationResult"]  # layer 1 patched
    rows = ablation.layer(1)
    assert isinstance(rows, cw_lens.SinkAblationResult) and rows.layers == [1]
    assert list(rows.to_dataframe()["head"]) == list(range(n_heads))
    assert set(rows.to_dataframe()["layer"]) == {1}
    pd.testing.assert_frame_equal(rows.to_dataframe(), ablation.per_head.reset_index(drop=True))
    assert rows.delta_nll == ablation.delta_nll  # of all patched layers together
    with pytest.raises(InputError, match=r"Layer 0 is not in this SinkAblationResult.*\[1\]"):
        ablation.layer(0)


def test_sink_ablation_top_ranks_heads(results):
    ablation = results["SinkAblationResult"]
    top = ablation.top(k=2)
    rise = (ablation.per_head["cone_after"] - ablation.per_head["cone_before"]).nlargest(2)
    assert len(top) == 2 and list(top["cone_rise"]) == list(rise)
    assert ablation.top(by="norm_after")["norm_after"].is_monotonic_decreasing
    with pytest.raises(InputError, match="by must be one of"):
        ablation.top(by="head")


def test_attention_rollout_returns_a_rollout_result(model, results):
    alone = cw_lens.attention_rollout(model, TEXTS)
    assert isinstance(alone, cw_lens.RolloutResult) and alone.contribution is None
    full = results["RolloutResult"]
    torch.testing.assert_close(alone.matrix, full.attention, equal_nan=True, atol=1e-6, rtol=0)
    assert list(alone.top(k=2).columns[-1:]) == ["attention"] and len(repr(alone)) < 400
    with pytest.raises(InputError, match="contribution_rollout"):
        alone.plot()
    # the bare tensor of 0.2 keeps working for one minor version, with a warning
    with pytest.warns(DeprecationWarning, match="result.matrix"):
        assert alone[0].nan_to_num().equal(alone.matrix[0].nan_to_num())
    with pytest.warns(DeprecationWarning, match="shape"):
        assert alone.shape == alone.matrix.shape
    with pytest.warns(DeprecationWarning, match="allclose"):
        assert torch.allclose(alone, alone.matrix, equal_nan=True)


NO_TABLE = {"LayerContributionsResult", "LayerSharesResult"}  # one streamed block: read its tensors


@pytest.mark.parametrize("name", sorted(set(RESULT_NAMES) - NO_TABLE))
def test_every_result_has_a_table(results, name):
    assert isinstance(results[name].to_dataframe(), pd.DataFrame)


def _subclasses(cls: type) -> set[type]:
    return {c for sub in cls.__subclasses__() for c in {sub} | _subclasses(sub)}


def test_every_result_class_is_public_covered_here_and_named_result(results):
    """A result class of cw_lens is exported, has an instance in ``results``, and its name ends
    in ``Result`` (``SinkStatisticsResult``, not ``SinkStatistics``)."""
    exported = {
        name for name in cw_lens.__all__
        if isinstance(obj := getattr(cw_lens, name), type) and issubclass(obj, Result)
    } - {"Result"}  # fmt: skip
    assert exported == set(RESULT_NAMES) == set(results)
    defined = {c for c in _subclasses(Result) if c.__module__.startswith("cw_lens.")}
    assert {c.__name__ for c in defined} == set(RESULT_NAMES)
    badly_named = sorted(c.__qualname__ for c in defined if not c.__name__.endswith("Result"))
    assert not badly_named, f"result classes whose name does not end in 'Result': {badly_named}"


def test_protocol_is_public():
    assert cw_lens.Result is Result and cw_lens.ClaimsTable is ClaimsTable


# --------------------------------------------------------------------------- saving and loading
def _assert_same(a, b, path: str) -> None:
    """`a == b` exactly, recursively: tensors and arrays bit for bit (NaN equal to NaN, same
    dtype), DataFrames with their dtypes and index, cw_lens objects field by field."""
    assert type(a) is type(b), f"{path}: {type(a).__name__} != {type(b).__name__}"
    if isinstance(a, torch.Tensor):
        assert (a.dtype, a.shape) == (b.dtype, b.shape), path
        torch.testing.assert_close(a.cpu(), b, rtol=0, atol=0, equal_nan=True, msg=path)
    elif isinstance(a, np.ndarray):
        assert (a.dtype, a.shape) == (b.dtype, b.shape), path
        if a.dtype.kind in "biuf":
            np.testing.assert_array_equal(a, b, err_msg=path)
        else:
            _assert_same(a.ravel().tolist(), b.ravel().tolist(), path)
    elif isinstance(a, pd.DataFrame):
        pd.testing.assert_frame_equal(a, b, check_exact=True, obj=path)
    elif isinstance(a, float):
        assert (math.isnan(a) and math.isnan(b)) or a == b, path
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _assert_same(x, y, f"{path}[{i}]")
    elif isinstance(a, dict):
        assert list(a) == list(b), path
        for key in a:
            _assert_same(a[key], b[key], f"{path}[{key!r}]")
    elif type(a).__module__.startswith("networkx"):
        _assert_same(list(a.nodes(data=True)), list(b.nodes(data=True)), f"{path}.nodes")
        edges = [list(g.edges(keys=True, data=True)) for g in (a, b)]
        _assert_same(*edges, f"{path}.edges")
    elif type(a).__module__.startswith("cw_lens"):
        _assert_same(object_state(a), object_state(b), path)
    else:
        assert a == b, f"{path}: {a!r} != {b!r}"


@pytest.mark.parametrize("name", RESULT_NAMES)
def test_a_saved_result_loads_equal(results, name, tmp_path):
    """Every result class round-trips through `save` / `load_result`: every field equal, and
    its helpers give the same tables."""
    result = results[name]
    path = tmp_path / f"{name}.safetensors"
    result.save(path)
    loaded = cw_lens.load_result(path)
    assert type(loaded) is type(result)
    fields = dataclasses.fields(result) if dataclasses.is_dataclass(result) else ()
    # the dataclass fields, then everything else the object holds
    for field in (f.name for f in fields):
        _assert_same(getattr(result, field), getattr(loaded, field), f"{name}.{field}")
    _assert_same(object_state(result), object_state(loaded), name)
    assert repr(loaded) == repr(result)
    _assert_same(result.summary(), loaded.summary(), f"{name}.summary()")
    if name not in NO_TABLE:
        _assert_same(result.to_dataframe(), loaded.to_dataframe(), f"{name}.to_dataframe()")
    if hasattr(result, "top"):
        _assert_same(result.top(k=3), loaded.top(k=3), f"{name}.top()")
    if name in CLAIMS:
        _assert_same(
            reproduction.claims(result).to_dict(),
            reproduction.claims(loaded).to_dict(),
            f"reproduction.claims({name})",
        )


def test_a_result_file_is_safetensors_with_json_metadata(results, tmp_path):
    from safetensors import safe_open

    path = tmp_path / "cw.safetensors"
    results["ContributionResult"].save(path)
    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata()
        keys = set(f.keys())
    assert meta["format"] == "cw_lens.result" and meta["format_version"] == "1"
    assert meta["class"] == "cw_lens.analyses.contributions:ContributionResult"
    assert {"attention", "cosine", "tokens", "mask"} <= keys
    assert "weights" not in keys  # derived on access, not stored
    content = json.loads(meta["content"])
    assert content["$type"] == "object" and content["state"]["layers"] == [1]
    assert b"\x80\x04" not in path.read_bytes()[:8]  # no pickle header


def test_loading_refuses_other_files_and_versions(results, tmp_path):
    from safetensors.torch import load_file, save_file

    path = tmp_path / "rollout.safetensors"
    results["RolloutResult"].save(path)
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata()
    tensors = load_file(str(path))
    newer = tmp_path / "newer.safetensors"
    save_file(tensors, str(newer), metadata={**meta, "format_version": "99"})
    with pytest.raises(InputError, match=r"format version 99 .*reads versions up to 1: upgrade"):
        cw_lens.load_result(newer)
    bare = tmp_path / "weights.safetensors"
    save_file(tensors, str(bare))
    with pytest.raises(InputError, match="a safetensors file but not a cw_lens result"):
        cw_lens.load_result(bare)
    text = tmp_path / "notes.txt"
    text.write_text("not a result at all", encoding="utf-8")
    with pytest.raises(InputError, match="is not a cw_lens result file"):
        cw_lens.load_result(text)
    pickled = tmp_path / "result.pkl"
    pickled.write_bytes(pickle.dumps(results["RolloutResult"]))
    with pytest.raises(InputError, match="is not a cw_lens result file"):
        cw_lens.load_result(pickled)
    with pytest.raises(FileNotFoundError):
        cw_lens.load_result(tmp_path / "missing.safetensors")


def test_a_field_that_cannot_be_saved_is_named(results, tmp_path):
    odd = dataclasses.replace(results["IOIRouteStatisticsResult"], threshold=lambda: 0.02)
    with pytest.raises(InputError, match=r"IOIRouteStatistics\w+ cannot be saved: field threshold"):
        odd.save(tmp_path / "odd.safetensors")
