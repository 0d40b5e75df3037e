"""The main job's comparison with other tools' attribution methods (the `field` preset): its
claims are the ones `claims` judges on the same results computed directly, its figures, its
record of what each claim resampled, and the verdicts its unstudied intervals cannot settle."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

import cw_lens
import cw_lens.data.corpora as corpora
from cw_lens.reproduction import Bootstrap, claims
from cw_lens.reproduction.field_comparison import FIELD_PAIR_METRICS, FIELD_RANDOM_DRAWS
from cw_lens.reproduction.interval_coverage import certified_from, never_studied_because
from cw_lens.reproduction.job import FIELD_CLAIMS, PRESET_STEPS, JobConfig, run_figures
from cw_lens.reproduction.state import FIELD_TASKS, field_input_number
from cw_lens.reproduction.steps import stored_value_problem

pytestmark = pytest.mark.slow

SETTINGS = dict(model="testing:tiny-llama", n_docs=4, max_tokens=24, task=None, batch_size=2)
FIELD = dict(field_docs=2, field_items=4)
ROOT = Path(__file__).parents[1]


@pytest.fixture(scope="module")
def every_item():
    """A random tiny model answers no task item correctly, and the job keeps only those it
    answers (`only_correct=True`): for these tests the items are taken as they come."""
    original = corpora.load_corpus

    def load_corpus(*args, only_correct=False, **kwargs):
        return original(*args, **kwargs)

    corpora.load_corpus = load_corpus
    yield original
    corpora.load_corpus = original


@pytest.fixture(scope="module")
def field_run(every_item, tmp_path_factory):
    out = tmp_path_factory.mktemp("field")
    config = JobConfig(**SETTINGS, **FIELD)
    summary = run_figures(config, out, progress=False, steps=PRESET_STEPS["field"])
    return out, summary


def test_the_field_claims_are_the_claims_of_the_same_results_computed_directly(field_run):
    """Pairs: faithfulness with every pair metric on the run's random sample of `field_docs`
    windows; inputs: the input deletion test on `field_items` items of each task; each
    claim's numbers and intervals are what `claims` gives on those results."""
    out, summary = field_run
    assert list(summary["claims"]) == list(FIELD_CLAIMS)
    model = cw_lens.load_model(SETTINGS["model"])
    corpus = cw_lens.load_corpus(n_docs=4, max_tokens=24, model=model)
    sample = summary["causal_sample"]["field"]["corpus_indices"]
    assert len(sample) == 2 and summary["causal_sample"]["field"]["n_documents"] == 2
    pairs = cw_lens.faithfulness(
        model,
        corpus.subset(sample),
        metrics=FIELD_PAIR_METRICS,
        granularity=("pairs",),
        seed=0,
        n_random=FIELD_RANDOM_DRAWS,
        batch_size=2,
        per_document=True,
        progress=False,
    )
    direct = {"contribution_vs_field_pairs": claims(pairs, Bootstrap())}
    for task in FIELD_TASKS:
        items = cw_lens.load_corpus(task, n_docs=4, model=model, seed=0)
        result = cw_lens.input_deletion(model, items, seed=0, batch_size=16, progress=False)
        direct[f"contribution_vs_field_inputs_{task}"] = claims(result, Bootstrap())
    for cid, claim in summary["claims"].items():
        general = cid if cid == "contribution_vs_field_pairs" else "contribution_vs_field_inputs"
        expected = direct[cid][general]
        task = claim["measured"].get("task")  # the input-level numbers are named after it
        names = [c["number"] for c in expected["checks"]]
        if task is not None:
            names = [field_input_number(task, n) for n in names]
            assert all(claim["measured"][n] == pytest.approx(c["value"], rel=1e-5, abs=1e-6)
                       for n, c in zip(names, expected["checks"], strict=True))  # fmt: skip
        assert [c["number"] for c in claim["checks"]] == names
        for got, want in zip(claim["checks"], expected["checks"], strict=True):
            assert got["value"] == pytest.approx(want["value"], rel=1e-5, abs=1e-6), cid
            assert got["interval"] == pytest.approx(want["interval"], rel=1e-5, abs=1e-6), cid
        assert claim["measured"]["best_other"] == expected["measured"]["best_other"]
        assert claim["figure"] == f"{cid}.png" and (out / f"{cid}.png").stat().st_size > 1000
    assert summary["claims"]["contribution_vs_field_inputs_ioi"]["measured"]["task"] == "ioi"
    assert not (out / "per_layer_intervals.png").exists()  # no claim about layers ran


def test_every_number_of_the_comparison_has_its_coverage_and_a_small_run_cannot_settle(
    field_run,
):
    """Each number the job reports (the input-level ones named after their task) is a row
    of the coverage table; a number no study measured could settle nothing. This run (another
    model, 2 windows and 4 items) is below the smallest studied size, so every decisive check
    is inconclusive, saying why, and REPORT.md says it."""
    out, summary = field_run
    assert never_studied_because("inputs_comprehensiveness_x_minus_best_other") == (
        "its interval's coverage was never studied, on any model or size"
    )
    for claim in summary["claims"].values():
        assert claim["holds"] in ("inconclusive", "not measured")
        for check in claim["checks"]:
            assert never_studied_because(check["number"]) is None, check["number"]
            assert certified_from(check["number"]) is not None or check["number"] == (
                "pairs_sufficiency_best_other_minus_contribution"  # not certified at any size
            )
            assert check["holds"] in ("inconclusive", "not measured")
            if "undecided_because" in check:
                assert "studied at fewer than 8 documents" in check["undecided_because"]
    report = (out / "REPORT.md").read_text()
    assert "Intervals whose coverage no study has measured" not in report
    assert "Checks run on fewer than 8 documents" in report
    for cid in FIELD_CLAIMS:
        assert f"`{cid}`" in report and f"### {cid}\n" in report
    assert "Steps not run (--steps/--skip)" in report
    # nothing about steps that did not run
    assert "random orders" not in report


def test_the_committed_field_run_reads_its_own_studys_pool():
    """figures/field/: its numbers were studied on its own windows and items, so REPORT.md
    tells it of no related pool, and the one uncertified number is named with its coverage."""
    from cw_lens.reproduction.interval_coverage import coverage_limits, study_pool
    from cw_lens.reproduction.markdown import number_name

    summary = json.loads((ROOT / "figures/field/summary.json").read_text())
    documents = {cid: 32 for cid in FIELD_CLAIMS[1:]} | {FIELD_CLAIMS[0]: 16}
    assert study_pool("pairs_comprehensiveness_contribution_minus_best_other") == ("pydoc", 128)
    assert study_pool("inputs_ioi_sufficiency_best_other_minus_contribution_rollout") is None
    assert study_pool("delta_ppl") == ("pydoc+stdlib", 256)
    lines = coverage_limits(summary, documents, name=number_name)
    assert not any("a related pool" in line for line in lines), lines
    assert len(lines) == 1 and "coverage 0.818 at this size (16 documents" in lines[0], lines
    verdicts = {cid: c["holds"] for cid, c in summary["claims"].items()}
    assert verdicts == {
        "contribution_vs_field_pairs": "inconclusive",
        "contribution_vs_field_inputs_ioi": "yes",
        "contribution_vs_field_inputs_arithmetic": "no",
    }


def test_replicates_pair_the_pair_claim_by_its_windows_and_never_the_item_claims(field_run):
    """replicates.npz: the pair-level claim records its random sample (so two runs pair only
    on the same windows); the input-level claims resample task items, not corpus documents,
    and record no documents, so no comparison of two runs pairs them."""
    from cw_lens.reproduction.run_replicates import unpack

    out, summary = field_run
    kept = summary["replicates"]
    reps = unpack(out / kept["file"], kept["sha256"], kept["bytes"])
    assert reps.documents_per_claim == {"contribution_vs_field_pairs": 2}
    assert (
        reps.claim_documents["contribution_vs_field_pairs"]
        == (summary["causal_sample"]["field"]["corpus_indices"])
    )
    for cid in FIELD_CLAIMS[1:]:
        assert reps.resampled(cid) == [] and not reps.pairs_with(reps, cid)
        assert {n for c, n in reps.numbers if c == cid}  # its replicates are kept
    assert all(np.isfinite(v).any() for v in reps.numbers.values())


def test_the_steps_are_left_out_unless_asked_and_their_stored_values_are_checked():
    """`field_docs` / `field_items` 0 (quick, paper): the steps store None; a stored value of
    the wrong kind is refused with what was expected."""
    assert JobConfig().field_docs == JobConfig.preset("paper").field_items == 0
    field = JobConfig.preset("field")
    assert (field.n_docs, field.max_tokens, field.field_docs, field.field_items) == (
        16,
        128,
        16,
        32,
    )
    assert stored_value_problem("field_inputs", None) is None
    assert stored_value_problem("field_pairs", {"result": None}) == (
        "'result': expected FaithfulnessResult, got a NoneType"
    )
    assert "expected the keys ['arithmetic', 'ioi']" in stored_value_problem(
        "field_inputs", {"ioi": None}
    )


def test_the_field_preset_runs_only_the_comparison_from_the_command_line(monkeypatch, tmp_path):
    import cw_lens.reproduction.job as job
    from cw_lens.reproduction.cli import app

    seen: dict = {}

    def fake_run(config, out, *, force, progress, steps=None, skip=None):
        seen.update(config=config, steps=steps)
        return {"claims": {}}

    monkeypatch.setattr(job, "run_figures", fake_run)
    args = ["figures", "--preset", "field", "--quiet", "--out", str(tmp_path)]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    assert tuple(seen["steps"]) == ("field_pairs", "field_inputs")
    assert (seen["config"].field_docs, seen["config"].field_items) == (16, 32)
    result = CliRunner().invoke(app, [*args, "--steps", "field_pairs", "--field-docs", "4"])
    assert result.exit_code == 0, result.output
    assert seen["steps"] == ["field_pairs"] and seen["config"].field_docs == 4
    json.dumps(seen["config"].settings())  # JSON-ready with the new settings
