"""``cw_lens.reproduction.run_comparison`` and ``cw-lens compare``: several summaries side by side.

Two hand-written runs in tests/fixtures/compare: ``run_a`` (schema 2: intervals, string
verdicts, one inconclusive claim) and ``run_b`` (schema 1: bool verdicts, no intervals, and one
claim written before checks existed).
"""

from __future__ import annotations

import json
import math
import sysconfig
from pathlib import Path

import matplotlib.colors as mcolors
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from cw_lens.core.errors import InputError
from cw_lens.reproduction.cli import app
from cw_lens.reproduction.comparison_plots import VERDICT_COLOURS
from cw_lens.reproduction.run_comparison import compare_runs
from cw_lens.reproduction.verdicts import Check, Claim, claims_dict

FIXTURES = Path(__file__).parent / "fixtures" / "compare"
RUN_A, RUN_B = FIXTURES / "run_a", FIXTURES / "run_b"

EXPECTED_MARKDOWN = """\
| run | model | corpus | documents | tokens | seed | schema |
|---|---|---|---|---|---|---|
| a | tiny/model-a | pydoc | 8 | 1032 | 0 | 2 |
| b | tiny/model-a | LICENSE.txt | 8 | 1024 | 1 | 1 |

| claim / number | check | a | b |
|---|---|---|---|
| `sink_value_norm_ratio` | claim | yes | yes |
| ↳ median_ratio_sink_heads | in [3, 10] | 4.84 [4.1, 5.62] yes | 3.5 yes |
| `sink_attention_vs_contribution` | claim | **no** | **no** |
| ↳ contribution_over_attention | < 0.5 | 0.642 [0.58, 0.71] no | 0.7 no |
| `retriever_share` | claim | **inconclusive** | yes |
| ↳ retriever_share | in [0.058, 0.172] | 0.06 [0.04, 0.09] inconclusive | 0.1 yes |
| ↳ n_heads | > 100 | 270 [270, 270] yes | 270 yes |
| `pruning_signal` | claim | — | **no** |

Differences from `a` (run - a; unadjusted 95% bootstrap interval of the difference, paired when \
both runs resampled the same documents; `differ` when the p-value adjusted by Holm's method over \
the 0 comparable numbers is below 0.05, which holds the chance of any false `differ` to 0.05; \
† bias-corrected replicates):

| claim / number | run | difference [interval] | resamples | p | p (Holm) | result |
|---|---|---|---|---|---|---|
| `sink_value_norm_ratio` ↳ median_ratio_sink_heads | b | -1.34 | — | — | — | \
not comparable ({NO}) |
| `sink_attention_vs_contribution` ↳ contribution_over_attention | b | +0.0582 | — | — | — | \
not comparable ({NO}) |
| `retriever_share` ↳ retriever_share | b | +0.04 | — | — | — | not comparable ({NO}) |
| `retriever_share` ↳ n_heads | b | +0 | — | — | — | not comparable ({NO}) |
""".replace("{NO}", "a: a summary of schema 1 or 2 keeps no bootstrap replicates")


def load(path: Path) -> dict:
    return json.loads((path / "summary.json").read_text())


@pytest.fixture
def comparison():
    return compare_runs([RUN_A, RUN_B], labels=["a", "b"])


def test_markdown_table_has_exactly_the_expected_cells(comparison):
    assert comparison.to_markdown() == EXPECTED_MARKDOWN


def test_tidy_table_values_equal_the_inputs(comparison):
    table = comparison.to_dataframe()
    assert list(table.columns) == [
        "run", "claim", "number", "value", "low", "high", "op", "threshold", "check", "holds",
    ]  # fmt: skip
    expected = 0
    for label, path in (("a", RUN_A), ("b", RUN_B)):
        summary = load(path)
        for cid, claim in summary["claims"].items():
            rows = table[(table["run"] == label) & (table["claim"] == cid)]
            checks = claim.get("checks", [])
            expected += max(1, len(checks))
            assert len(rows) == max(1, len(checks))
            if not checks:
                assert rows["number"].tolist() == [""] and rows["value"].isna().all()
            for check, (_, row) in zip(checks, rows.iterrows(), strict=bool(checks)):
                assert row["number"] == check["number"]
                assert row["value"] == check["value"]
                assert row["op"] == check["op"]
                threshold = check["threshold"]
                assert row["threshold"] == (tuple(threshold) if check["op"] == "in" else threshold)
                if "interval" in check:
                    assert [row["low"], row["high"]] == check["interval"]
                    assert row["check"] == check["holds"]
                    assert row["holds"] == claim["holds"]
                else:
                    assert math.isnan(row["low"]) and math.isnan(row["high"])
    assert len(table) == expected == 9


def test_schema_1_bools_map_to_yes_no_and_have_no_interval(comparison):
    table = comparison.to_dataframe().query("run == 'b'")
    summary = load(RUN_B)
    for _, row in table.iterrows():
        claim = summary["claims"][row["claim"]]
        assert row["holds"] == {True: "yes", False: "no"}[claim["holds"]]
        if row["number"]:
            check = next(c for c in claim["checks"] if c["number"] == row["number"])
            assert row["check"] == {True: "yes", False: "no"}[check["holds"]]
    assert set(table["holds"]) == {"yes", "no"}
    # the claim written before checks existed keeps its verdict, with no number
    old = table[table["claim"] == "pruning_signal"].iloc[0]
    assert (old["number"], old["holds"], math.isnan(old["value"])) == ("", "no", True)
    assert [r.schema for r in comparison.runs] == [2, 1]


def test_reads_what_the_claims_module_writes():
    """Claims as cw_lens.reproduction.claims writes them (no intervals asked for) read back
    unchanged."""
    claims = claims_dict(
        [
            Claim("c1", "p", "crit", [Check("x", 0.25, "<", 0.5), Check("y", 2.0, ">", 3.0)]),
            Claim("c2", "p", "crit", [Check("z", float("nan"), "in", (0.1, 0.2))]),
        ]
    )
    summary = {"schema": 3, "model": "m", "claims": claims}
    summary = json.loads(json.dumps(summary).replace("NaN", "null"))
    table = compare_runs([summary]).to_dataframe()
    assert list(table["number"]) == ["x", "y", "z"]
    assert list(table["check"]) == ["yes", "no", "not measured"]
    assert list(table["holds"]) == ["no", "no", "not measured"]
    assert table["value"].iloc[:2].tolist() == [0.25, 2.0] and math.isnan(table["value"].iloc[2])
    assert "| ↳ z | in [0.1, 0.2] | n/a not measured |" in compare_runs([summary]).to_markdown()


def test_reads_a_schema_2_summary_as_the_job_writes_it():
    """fixtures/compare/tiny_schema2: `run_figures` of the intervals branch (2724857) on the
    tiny model, 4 documents x 24 tokens, 200 resamples — every check reads back unchanged."""
    path = FIXTURES / "tiny_schema2"
    summary = load(path)
    table = compare_runs([path]).to_dataframe()
    checks = [(cid, c) for cid, claim in summary["claims"].items() for c in claim["checks"]]
    assert len(table) == len(checks) > 12
    nan = float("nan")
    for (cid, check), (_, row) in zip(checks, table.iterrows(), strict=True):
        interval = [nan, nan] if check["interval"] is None else check["interval"]
        expected = [check["value"], *interval]
        got = [row["value"], row["low"], row["high"]]
        assert got == pytest.approx([nan if x is None else x for x in expected], nan_ok=True)
        assert (row["claim"], row["number"], row["check"]) == (cid, check["number"], check["holds"])
        assert row["holds"] == summary["claims"][cid]["holds"]


def test_schema_2_null_interval_is_no_interval():
    summary = load(RUN_A)
    summary["claims"]["retriever_share"]["checks"][1]["interval"] = None
    comparison = compare_runs([summary], labels=["a"])
    row = comparison.to_dataframe().query("number == 'n_heads'").iloc[0]
    assert math.isnan(row["low"]) and math.isnan(row["high"]) and row["value"] == 270
    assert "| ↳ n_heads | > 100 | 270 yes |" in comparison.to_markdown()


def test_labels_default_to_folder_names_and_accept_files_and_dicts():
    assert [r.label for r in compare_runs([RUN_A, RUN_B / "summary.json"]).runs] == [
        "run_a",
        "run_b",
    ]
    same = compare_runs([RUN_A, RUN_A])
    assert [r.label for r in same.runs] == ["1:run_a", "2:run_a"]
    from_dict = compare_runs([load(RUN_A)], labels=["x"])
    assert (
        from_dict.to_dataframe()["value"].tolist() == compare_runs([RUN_A]).rows["value"].tolist()
    )


def test_differing_verdicts_are_not_disagreements_without_a_test(comparison):
    """The verdicts of retriever_share differ (inconclusive / yes), but neither summary kept
    replicates: nothing is flagged, every difference is not comparable."""
    assert comparison.claim_verdicts().loc["retriever_share"].tolist() == ["inconclusive", "yes"]
    assert comparison.disagreements().empty
    assert set(comparison.differences()["result"]) == {"not comparable"}


def test_plot_has_one_row_per_run_per_number(comparison):
    fig = comparison.plot()
    axes = [ax for ax in fig.axes if ax.get_visible()]
    table = comparison.to_dataframe()
    numbers = table[table["number"] != ""]
    assert len(axes) == numbers.groupby(["claim", "number"]).ngroups == 4
    for ax in axes:
        claim, title = ax.get_title().split("\n")
        number = title.split(" ")[0]
        assert [t.get_text() for t in ax.get_yticklabels()] == ["a", "b"]
        points = [line for line in ax.lines if line.get_marker() == "o"]
        assert len(points) == 2
        for y, label in enumerate(["a", "b"]):
            row = numbers[
                (numbers["run"] == label)
                & (numbers["claim"] == claim)
                & (numbers["number"] == number)
            ].iloc[0]
            point = points[y]
            assert (point.get_xdata()[0], point.get_ydata()[0]) == (row["value"], y)
            assert mcolors.same_color(point.get_color(), VERDICT_COLOURS[row["check"]])
        # only run a (schema 2) has an interval bar, spanning [low, high]
        bars = [seg for coll in ax.collections for seg in coll.get_segments()]
        low, high = numbers[(numbers["run"] == "a") & (numbers["number"] == number)].iloc[0][
            ["low", "high"]
        ]
        assert [tuple(map(tuple, seg)) for seg in bars] == [((low, 0), (high, 0))]


def write(tmp_path: Path, name: str, text: str) -> Path:
    folder = tmp_path / name
    folder.mkdir()
    (folder / "summary.json").write_text(text)
    return folder


def edited(path: Path, edit) -> str:
    summary = load(path)
    edit(summary)
    return json.dumps(summary)


BAD = {
    "not json": ("{not json", "is not a cw_lens summary: not JSON"),
    "a list": ("[1, 2]", "not a cw_lens summary (no 'claims' object)"),
    "no claims": ('{"model": "m"}', "not a cw_lens summary (no 'claims' object)"),
    "empty claims": ('{"claims": {}}', "the summary has no claims"),
    "schema 4": (
        edited(RUN_A, lambda s: s.update(schema=4)),
        "unknown summary schema 4; this cw_lens reads schemas (1, 2, 3)",
    ),
    "schema 2 with a four-valued verdict": (
        edited(RUN_A, lambda s: s["claims"]["retriever_share"].update(holds="not measured")),
        "schema 2 verdicts are ('yes', 'no', 'inconclusive'), got 'not measured'",
    ),
    "schema as text": (
        edited(RUN_A, lambda s: s.update(schema="2")),
        "unknown summary schema '2'",
    ),
    "bool verdict in schema 2": (
        edited(RUN_A, lambda s: s["claims"]["retriever_share"].update(holds=True)),
        "claim 'retriever_share': schema 2 verdicts are ('yes', 'no', 'inconclusive'), got True",
    ),
    "text verdict in schema 1": (
        edited(RUN_B, lambda s: s["claims"]["retriever_share"].update(holds="yes")),
        "claim 'retriever_share': schema 1 verdicts are true/false, got 'yes'",
    ),
    "no verdict": (
        edited(RUN_B, lambda s: s["claims"]["pruning_signal"].pop("holds")),
        "claim 'pruning_signal' has no 'holds' verdict",
    ),
    "schema 2 check without interval": (
        edited(RUN_A, lambda s: s["claims"]["retriever_share"]["checks"][1].pop("interval")),
        "claim 'retriever_share', check 1: schema 2 checks carry an 'interval'",
    ),
    "interval not a pair": (
        edited(RUN_A, lambda s: s["claims"]["retriever_share"]["checks"][1].update(interval=[1])),
        "check 1: the interval must be [low, high] or null, got [1]",
    ),
    "unknown op": (
        edited(RUN_B, lambda s: s["claims"]["retriever_share"]["checks"][0].update(op="<=")),
        "claim 'retriever_share', check 0: unknown op '<='",
    ),
    "in without a range": (
        edited(RUN_B, lambda s: s["claims"]["retriever_share"]["checks"][0].update(threshold=3)),
        "check 0: op 'in' needs a [low, high] threshold, got 3",
    ),
    "check without value": (
        edited(RUN_B, lambda s: s["claims"]["retriever_share"]["checks"][1].pop("value")),
        "claim 'retriever_share', check 1: missing ['value']",
    ),
    "value not a number": (
        edited(RUN_B, lambda s: s["claims"]["retriever_share"]["checks"][1].update(value="1")),
        "check 1: expected a number, got '1'",
    ),
    "one number checked twice": (
        edited(
            RUN_B,
            lambda s: s["claims"]["retriever_share"]["checks"][1].update(number="retriever_share"),
        ),
        "claim 'retriever_share' checks 'retriever_share' twice",
    ),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_summary_is_an_input_error_naming_file_and_problem(tmp_path, case):
    text, message = BAD[case]
    folder = write(tmp_path, "bad_run", text)
    with pytest.raises(InputError) as info:
        compare_runs([RUN_A, folder])
    assert str(folder / "summary.json") in str(info.value)
    assert message in str(info.value)


@pytest.mark.parametrize(
    ("runs", "labels", "message"),
    [
        ([], None, "needs at least one run"),
        (["no/such/run"], None, "no/such/run: no such file or folder"),
        ([RUN_A, RUN_B], ["only-one"], "1 labels for 2 runs"),
        ([RUN_A, RUN_B], ["x", "x"], "Labels must be unique"),
    ],
)
def test_bad_runs_or_labels_are_input_errors(runs, labels, message):
    with pytest.raises(InputError, match=message):
        compare_runs(runs, labels=labels)


def test_folder_without_summary_is_an_input_error(tmp_path):
    with pytest.raises(InputError, match=r"has no summary.json: give a folder written by"):
        compare_runs([tmp_path])


def test_cli_prints_the_table_and_writes_markdown_and_figure(tmp_path):
    out = tmp_path / "cmp"
    result = CliRunner().invoke(
        app, ["compare", str(RUN_A), str(RUN_B), "--labels", "a, b", "--out", str(out)]
    )
    assert result.exit_code == 0, result.output
    assert EXPECTED_MARKDOWN in result.output
    assert (out / "compare.md").read_text() == "# Runs compared\n\n" + EXPECTED_MARKDOWN
    assert (out / "compare.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (out / "compare.pdf").read_bytes()[:5] == b"%PDF-"


def test_cli_bad_run_is_a_one_line_error(tmp_path):
    result = CliRunner().invoke(app, ["compare", str(RUN_A), str(tmp_path)])
    assert result.exit_code == 2
    assert f"error: {tmp_path} has no summary.json" in result.output
    assert "Traceback" not in result.output


@pytest.mark.slow
def test_compare_reads_two_runs_of_the_main_job(tmp_path):
    """Two corpora through the real job on the tiny model: compare lines up exactly the claims,
    numbers and verdicts each run's summary.json holds, whatever schema the job writes now."""
    from cw_lens.reproduction.job import JobConfig, run_figures

    licence = Path(sysconfig.get_paths()["stdlib"]) / "LICENSE.txt"
    text = tmp_path / "licence.txt"
    text.write_text(licence.read_text() if licence.is_file() else "Permission is granted. " * 400)
    # 8 documents: the fewest at which any interval's coverage was studied (fewer: not compared)
    tiny = dict(model="testing:tiny-llama", n_docs=8, max_tokens=24, task=None, batch_size=8)
    run_figures(JobConfig(**tiny), tmp_path / "pydoc", progress=False)
    run_figures(JobConfig(**tiny, corpus=str(text)), tmp_path / "licence", progress=False)
    result = CliRunner().invoke(
        app, ["compare", str(tmp_path / "pydoc"), str(tmp_path / "licence"), "--out", str(tmp_path)]
    )
    assert result.exit_code == 0, result.output
    table = compare_runs([tmp_path / "pydoc", tmp_path / "licence"]).to_dataframe()
    verdict = {True: "yes", False: "no"}
    for label in ("pydoc", "licence"):
        summary = load(tmp_path / label)
        rows = table[table["run"] == label]
        assert list(dict.fromkeys(rows["claim"])) == list(summary["claims"])
        for cid, claim in summary["claims"].items():
            mine = rows[rows["claim"] == cid]
            assert set(mine["holds"]) == {verdict.get(claim["holds"], claim["holds"])}
            values = [math.nan if c["value"] is None else c["value"] for c in claim["checks"]]
            assert mine["number"].tolist() == [c["number"] for c in claim["checks"]]
            assert mine["value"].tolist() == pytest.approx(values, nan_ok=True)
            assert f"`{cid}`" in result.output
    assert (tmp_path / "compare.png").is_file()
    # different windows: independent resamples; a run against itself: paired, difference 0
    across = compare_runs([tmp_path / "pydoc", tmp_path / "licence"]).differences()
    assert not across["paired"].any() and len(across) == len(table) / 2
    itself = compare_runs([tmp_path / "pydoc", tmp_path / "pydoc"], labels=["a", "b"])
    same = itself.differences()
    measured = same[same["result"] != "not comparable"]
    assert len(measured) > 5 and measured["paired"].all()
    assert set(measured["result"]) == {"same within uncertainty"}
    assert (measured["difference"] == 0).all() and (measured["low"] == 0).all()
    # not comparable: a number the run did not measure, or one without an interval (pruning's
    # 3 random orders give pruning_signal none), never a measured number with replicates
    unmeasured = same[same["result"] == "not comparable"]
    no_interval = unmeasured["reason"].str.contains("no replicates")
    assert (unmeasured["value"].isna() | no_interval).all(), unmeasured
    assert itself.disagreements().empty


# --------------------------------------------------------------------------- errors controlled


def test_holm_adjusts_known_p_values():
    """Holm's step-down: sorted p times (m, m - 1, ...), made non-decreasing, capped at 1; NaN
    (a number not compared) is left out of the family."""
    from cw_lens.reproduction.run_replicates import holm

    assert holm([0.01, 0.04, 0.03, 0.005]).tolist() == pytest.approx([0.03, 0.06, 0.06, 0.02])
    with_nan = holm([0.01, math.nan, 0.04])
    assert with_nan[[0, 2]].tolist() == pytest.approx([0.02, 0.04]) and math.isnan(with_nan[1])
    assert holm([0.5, 0.6]).tolist() == [1.0, 1.0]
    assert holm([0.02]).tolist() == [0.02] and holm([]).tolist() == []


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.floats(0, 1), min_size=1, max_size=12),
    st.sampled_from([0.01, 0.05, 0.1]),
)
def test_holm_rejects_what_the_step_down_procedure_rejects(p, alpha):
    """Adjusted p <= alpha exactly for the hypotheses Holm's sequential procedure rejects:
    the i-th smallest p (from 0) against alpha / (m - i), stopping at the first that fails."""
    from cw_lens.reproduction.run_replicates import holm

    m, rejected = len(p), set()
    for i, j in enumerate(sorted(range(m), key=lambda k: (p[k], k))):
        if (m - i) * p[j] > alpha:
            break
        rejected.add(j)
    adjusted = holm(p)
    assert {j for j in range(m) if adjusted[j] <= alpha} == rejected
    assert all(a >= x - 1e-15 for a, x in zip(adjusted, p, strict=True))


@pytest.mark.parametrize("n_documents", [None, 8, 32, 256])
def test_the_p_value_is_the_level_at_which_the_difference_interval_reaches_zero(n_documents):
    """p is the level whose interval has 0 as its end: for the expanded interval, the tail
    `expanded_tail(1 - p, D)` equals the share of replicates across 0; for the percentile
    interval p = 2 x that share. And p < 0.05 agrees with the one test's interval."""
    import numpy as np

    from cw_lens.reproduction.bootstrap import expanded_tail
    from cw_lens.reproduction.run_replicates import DIFFER, difference_p_value, difference_test

    rng = np.random.default_rng(0)
    diff = rng.normal(1.0, 0.5, 2000)
    share = (float((diff <= 0).sum()) + 1) / (len(diff) + 1)  # never 0: (k + 1) / (R + 1)
    p = difference_p_value(diff, 1.0, n_documents)
    if n_documents is None:
        assert p == pytest.approx(2 * share)
    else:
        assert expanded_tail(1 - p, n_documents) == pytest.approx(share, rel=1e-6)
    assert difference_p_value(-diff, -1.0, n_documents) == pytest.approx(p)  # symmetric
    assert difference_p_value(diff, 0.0, n_documents) == 1.0
    assert difference_p_value(diff + 10, 11.0, n_documents) > 0  # no replicate across 0
    agree = 0
    for seed in range(100):
        a = np.random.default_rng(seed).normal(0.0, 1.0, 2000)
        b = a + np.random.default_rng(1000 + seed).normal(seed / 40, 1.0, 2000)
        test = difference_test(0.0, a, seed / 40, b, paired=True, n_documents=n_documents)
        agree += (test.p_value < 0.05) == (test.result == DIFFER)
    assert agree >= 98  # up to the quantiles' interpolation at the boundary


def test_results_are_decided_by_the_holm_adjusted_p_values():
    """Three comparable numbers with raw p 0.001, 0.03, 0.5 (the first two's intervals exclude
    0) and one not comparable: Holm gives 0.003, 0.06, 0.5, so only the first differs, and the
    second says that its interval excluded 0 but the adjustment did not pass it."""
    import pandas as pd

    from cw_lens.reproduction.run_comparison import holm_results
    from cw_lens.reproduction.run_replicates import DIFFER, NOT_COMPARABLE, SAME

    table = pd.DataFrame(
        {
            "p_value": [0.001, 0.03, 0.5, math.nan],
            "result": [DIFFER, DIFFER, SAME, NOT_COMPARABLE],
            "reason": ["", "", "", "not measured in b"],
        }
    )
    out = holm_results(table)
    assert out["p_holm"].tolist()[:3] == pytest.approx([0.003, 0.06, 0.5])
    assert math.isnan(out["p_holm"].iloc[3])
    assert out["result"].tolist() == [DIFFER, SAME, SAME, NOT_COMPARABLE]
    assert out["reason"].iloc[0] == "adjusted p = 0.003 < 0.05 (Holm over 3 numbers)"
    assert out["reason"].iloc[1] == (
        "the interval excludes 0 (p = 0.03), but the adjusted p = 0.06 >= 0.05 "
        "(Holm over 3 numbers)"
    )
    assert out["reason"].iloc[3] == "not measured in b"


def _run_with(
    folder: Path, numbers: dict, documents: list[str], model: str = "m", corpus: str | None = None
) -> Path:
    """A schema-3 run of one claim `c` whose checks have the given `(value, replicates)`."""
    import hashlib

    import numpy as np

    from cw_lens.reproduction.run_replicates import FILE, pack

    checks = []
    for number, (value, reps) in numbers.items():
        low, high = (float(q) for q in np.quantile(reps, [0.025, 0.975]))
        interval = (min(low, value), max(high, value))
        checks.append(Check(number, value, ">", 0.0, interval=interval, replicates=reps))
    claims = claims_dict([Claim("c", "paper", "crit", checks)])
    boot = {"resamples": 2000, "seed": 0}
    npz = pack(claims.replicates, documents, {"c": len(documents)}, boot)
    summary = {
        "schema": 3,
        "model": model,
        "corpus": corpus,
        "claims": dict(claims),
        "replicates": {"file": FILE, "sha256": hashlib.sha256(npz).hexdigest()},
    }
    folder.mkdir(parents=True)
    (folder / "summary.json").write_text(json.dumps(summary))
    (folder / FILE).write_bytes(npz)
    return folder


def test_compare_adjusts_every_number_of_every_run_together(tmp_path):
    """The family is every comparable number of every run against the first: `p_holm` is
    Holm's adjustment of all their p-values, and `differ` exactly where it is below 0.05."""
    import numpy as np

    from cw_lens.reproduction.run_replicates import DIFFER, holm

    def reps(centre: float, seed: int) -> np.ndarray:
        return np.random.default_rng(seed).normal(centre, 0.1, 2000).astype(np.float32)

    docs = [f"{i:016d}" for i in range(32)]
    a = _run_with(tmp_path / "a", {"x": (1.0, reps(1.0, 0)), "y": (1.0, reps(1.0, 1))}, docs)
    b = _run_with(tmp_path / "b", {"x": (1.5, reps(1.5, 2)), "y": (1.0, reps(1.0, 3))}, docs)
    c = _run_with(tmp_path / "c", {"x": (1.25, reps(1.25, 4)), "y": (1.2, reps(1.2, 5))}, docs)
    table = compare_runs([a, b, c]).differences()
    assert len(table) == 4 and table["p_value"].notna().all()
    assert table["p_holm"].tolist() == pytest.approx(holm(table["p_value"]).tolist())
    assert ((table["result"] == DIFFER) == (table["p_holm"] < 0.05)).all()
    assert table.set_index(["run", "number"]).loc[("b", "x"), "result"] == DIFFER
    assert table.set_index(["run", "number"]).loc[("b", "y"), "result"] != DIFFER


def test_biased_numbers_are_bias_corrected_or_not_compared_across_document_counts(tmp_path):
    """A number the code knows to be biased (a geometric mean) or whose bootstrap bias
    exceeds 0.25 standard errors: not compared between runs of 8 and 16 documents (the reason
    says why); between runs of 8 and 8, compared: the geometric mean from bias-corrected
    replicates and points, the other from its own (the same bias in both runs cancels)."""
    import numpy as np

    from cw_lens.reproduction.run_replicates import NOT_COMPARABLE, bias_to_se

    rng = np.random.default_rng(0)
    unbiased = rng.normal(1.0, 0.1, 2000).astype(np.float32)
    shifted = unbiased + np.float32(0.05)  # mean(t*) - t = 0.05: half a standard error
    geomean = "geomean_head_ratio_n2"
    numbers_a = {geomean: (1.0, unbiased), "x": (1.0, shifted), "z": (1.0, unbiased)}
    numbers_b = {geomean: (1.0, unbiased), "x": (1.2, shifted + 0.2), "z": (1.0, unbiased)}
    eight = [f"a{i:015d}" for i in range(8)]
    a = _run_with(tmp_path / "a", numbers_a, eight)
    b16 = _run_with(tmp_path / "b16", numbers_b, [f"b{i:015d}" for i in range(16)])
    table = compare_runs([a, b16]).differences().set_index("number")
    for number in (geomean, "x"):
        assert table.loc[number, "result"] == NOT_COMPARABLE
        assert "across different document counts (8 vs 16)" in table.loc[number, "reason"]
    assert "geometric mean" in table.loc[geomean, "reason"]
    ratio = bias_to_se(1.0, shifted)
    assert 0.4 < ratio < 0.6 and bias_to_se(1.0, unbiased) < 0.25
    assert f"|bias| / SE exceeds 0.25 (a {ratio:.2f}, b16 " in table.loc["x", "reason"]
    assert table.loc["z", "result"] != NOT_COMPARABLE and not table.loc["z", "bias_corrected"]
    b8 = _run_with(tmp_path / "b8", numbers_b, [f"b{i:015d}" for i in range(8)])
    table = compare_runs([a, b8]).differences().set_index("number")
    assert table.loc[geomean, "bias_corrected"] and not table.loc["x", "bias_corrected"]
    assert table.loc["x", "result"] != NOT_COMPARABLE
    assert table.loc["x", "difference"] == pytest.approx(1.2 - 1.0)
    assert "† bias-corrected" in compare_runs([a, b8]).to_markdown()


def test_numbers_not_certified_at_a_runs_document_count_are_not_compared(tmp_path):
    """As the verdicts do, compare refuses a number whose interval the coverage study did not
    certify at either run's document count: on the studied model and corpus, the sink-tail
    cosine (certified only from 256 documents) between runs of 32, but not between runs of
    256; on another model only runs below the smallest studied count (8 documents)."""
    import numpy as np

    from cw_lens.reproduction.interval_coverage import STUDIED_MODEL, certified_from
    from cw_lens.reproduction.run_replicates import NOT_COMPARABLE

    cosine, share = "median_cos_sink_tail_mixture", "retriever_share"
    assert certified_from(cosine) == 256 and certified_from(share) == 8
    rng = np.random.default_rng(1)
    numbers = {
        cosine: (-0.1, rng.normal(-0.1, 0.01, 2000).astype(np.float32)),
        share: (0.07, rng.normal(0.07, 0.01, 2000).astype(np.float32)),
    }

    def run(name: str, n: int, model: str = STUDIED_MODEL) -> Path:
        docs = [f"{name}{i:015d}" for i in range(n)]
        return _run_with(tmp_path / name, numbers, docs, model, "pydoc+stdlib")

    table = compare_runs([run("a", 32), run("b", 32)]).differences().set_index("number")
    assert table.loc[cosine, "result"] == NOT_COMPARABLE
    reason = table.loc[cosine, "reason"]
    assert "not certified at the run's document count" in reason
    assert "a: its interval has coverage 0.855 at this size" in reason and "; b: " in reason
    assert table.loc[share, "result"] != NOT_COMPARABLE
    table = compare_runs([run("c", 256), run("d", 256)]).differences().set_index("number")
    assert (table["result"] != NOT_COMPARABLE).all(), table["reason"]
    # one uncertified run is enough: 32 against 256
    table = compare_runs([run("e", 256), run("f", 32)]).differences().set_index("number")
    assert (
        table.loc[cosine, "result"] == NOT_COMPARABLE and "e: " not in table.loc[cosine, "reason"]
    )
    # another model: the study says nothing about it, except that below 8 documents no
    # interval was shown to cover
    table = compare_runs([run("g", 4, "m"), run("h", 4, "m")]).differences()
    assert (table["result"] == NOT_COMPARABLE).all()
    assert (
        table["reason"].str.contains("fewer than 8 documents, on any model; this run has 4").all()
    )
    table = compare_runs([run("i", 8, "m"), run("j", 8, "m")]).differences()
    assert (table["result"] != NOT_COMPARABLE).all(), table["reason"]


def test_the_compare_study_judges_its_family_wise_error_by_the_certificates_rule():
    """`benchmarks/population.py compare-study`'s `within_target` is the coverage certificate
    (`cw_lens.reproduction.interval_coverage.certifies`) read on the share of draws with no false
    `differ`: at least 0.93 with a one-sided Clopper-Pearson lower 95% bound of at least 0.91,
    i.e. a family-wise error <= 0.07 with an upper bound <= 0.09. The rule it replaces (the rate
    within 0.05 plus two Monte Carlo standard errors, no bound) passed 12 false `differ` in 200
    draws (0.060, upper bound 0.095); every stored record agrees with the rule."""
    import importlib.util

    from scipy.stats import beta

    from cw_lens.reproduction.interval_coverage import certifies

    root = Path(__file__).resolve().parents[1] / "benchmarks"
    spec = importlib.util.spec_from_file_location(
        "cw_lens_bench_pop_compare", root / "population.py"
    )
    pop = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(pop)

    def upper(k: int, n: int) -> float:  # as compare_study records it
        return 1.0 if k == n else float(beta.ppf(0.95, k + 1, n - k))

    for k, n in ((0, 200), (2, 200), (6, 200), (12, 200), (14, 200), (3, 40), (30, 400)):
        rate = k / n
        assert pop.within_target(k, n) == certifies(1 - rate, 1 - upper(k, n)), (k, n)
        assert pop.within_target(k, n) == (rate <= 0.07 and upper(k, n) <= 0.09 + 1e-12), (k, n)
    # the old rule accepted 12 of 200, 0.060 <= 0.05 + 2 * 0.0154; its bound 0.095 > 0.09
    assert 12 / 200 <= 0.05 + 2 * math.sqrt(0.05 * 0.95 / 200) and not pop.within_target(12, 200)
    assert pop.within_target(6, 200)  # 32 vs 256 documents: 0.030, bound 0.058
    for path in sorted((root / "records").glob("compare_population*.json")):
        for row in json.loads(path.read_text())["rows"]:
            k = round(row["family_wise_error"] * row["draws"])
            assert row["upper_95"] == pytest.approx(upper(k, row["draws"]))
            assert row["within_target"] == pop.within_target(k, row["draws"]), path.name
