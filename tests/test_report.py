"""The main job: every figure and claim, determinism, resuming, interruption, torchrun."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cw_lens.reproduction.bootstrap import Bootstrap
from cw_lens.reproduction.job import CLAIM_ORDER, FIELD_CLAIMS, STEPS, JobConfig, run_figures
from cw_lens.reproduction.markdown import size_limits
from cw_lens.reproduction.verdicts import VERDICTS, combine

pytestmark = pytest.mark.slow

# the same job as CLI_ARGS (defaults elsewhere), so CLI runs and in-process runs compare
# every option of the job: both faithfulness granularities and the global pruning variant
TINY = dict(
    model="testing:tiny-llama",
    n_docs=4,
    max_tokens=24,
    task=None,
    batch_size=2,
    faithfulness_granularity=("pairs", "tokens"),
    global_ranking=True,
)
CLI_ARGS = [
    "--model",
    "testing:tiny-llama",
    "--n-docs",
    "4",
    "--max-tokens",
    "24",
    "--task",
    "none",
    "--batch-size",
    "2",
    "--faithfulness-granularity",
    "pairs,tokens",
    "--global-ranking",
    "--quiet",
]


def claims_of(folder: Path) -> dict:
    return json.loads((folder / "summary.json").read_text())


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("figures")
    summary = run_figures(JobConfig(**TINY), out, progress=False)
    return out, summary


def test_job_writes_every_figure_claim_and_report(tiny_run):
    out, summary = tiny_run
    # the comparison with other tools runs only when asked (field_docs, field_items)
    assert list(summary["claims"]) == [c for c in CLAIM_ORDER if c not in FIELD_CLAIMS]
    for key in ("model", "corpus", "n_documents", "n_tokens", "seed", "versions"):
        assert key in summary
    assert summary["n_documents"] == 4 and summary["n_tokens"] == 4 * 25
    assert summary["schema"] == 3
    assert summary["bootstrap"] == {
        "resamples": 2000,
        "level": 0.95,
        "seed": 0,
        "unit": "document",
        "method": Bootstrap().to_dict()["method"],
    }
    layered = {
        "sink_attention_vs_contribution": "contribution_over_attention",
        "sink_value_norm_ratio": "median_ratio_sink_heads",
        "sink_anti_alignment": "median_cos_sink_tail_mixture",
        "retriever_share": "retriever_share",
    }
    for cid, claim in summary["claims"].items():
        assert ("per_layer" in claim) == (cid in layered), cid
        if cid in layered:  # tidy rows, one per layer of the tiny model, the claim's number
            rows = claim["per_layer"]
            assert [r["layer"] for r in rows] == [0, 1], cid
            keys = {"layer", "number", "value", "low", "high", "bias_to_se", "interval_method"}
            assert all(set(r) == keys for r in rows)
            assert {r["number"] for r in rows} == {layered[cid]}
    taxonomy = summary["claims"]["retriever_share"]
    # the tiny model's per-layer Retriever shares average to the overall share (equal layers)
    shares = [r["value"] for r in taxonomy["per_layer"]]
    assert abs(sum(shares) / 2 - taxonomy["checks"][0]["value"]) < 1e-6
    for cid, claim in summary["claims"].items():
        assert set(claim) >= {"paper", "measured", "holds", "figure", "criterion", "checks"}, cid
        assert claim["checks"], cid
        assert claim["holds"] == combine(c["holds"] for c in claim["checks"]), cid
        for check in claim["checks"]:  # every headline number is in measured
            assert claim["measured"][check["number"]] == check["value"], (cid, check)
            assert set(check) - {"undecided_because"} == {
                "number", "value", "op", "threshold", "interval", "bias_to_se",
                "interval_method", "holds",
            }  # fmt: skip
            assert check["holds"] in VERDICTS, (cid, check)
            # 4 documents, below every studied count: no interval decides (on any model)
            assert check["holds"] in ("inconclusive", "not measured"), (cid, check)
            if "undecided_because" in check:
                assert "fewer than 8 documents, on any model" in check["undecided_because"]
            # methods § Intervals: bias-corrected exactly for the known biased plug-ins,
            # whatever the run's bootstrap |bias| / SE (recorded for every number)
            ratio = check["bias_to_se"]
            biased = check["number"].startswith("geomean_head_ratio_n")
            want = "bias_corrected" if biased else "expanded"
            if check["interval_method"] is None:  # no bootstrap interval (pruning's 3 orders)
                assert check["interval"] == [None, None] and ratio is None, (cid, check)
            else:
                assert check["interval_method"] == want, (cid, check)
            low, high = check["interval"]
            if low is not None:  # None: undefined (e.g. no sink head in the tiny model)
                assert low <= high, (cid, check)
        stem = out / Path(claim["figure"]).stem
        assert stem.with_suffix(".png").stat().st_size > 1000, cid
        assert stem.with_suffix(".pdf").stat().st_size > 1000, cid
    assert summary["claims"]["faithfulness_order"]["measured"]["first_query"] == 1
    pruning = summary["claims"]["pruning_signal"]["measured"]
    assert "global_ranking" in pruning and "top_lone_heads" in pruning
    report = (out / "REPORT.md").read_text()
    assert "| claim | paper says | number = value [interval] (criterion) | verdict |" in report
    weights, corpus = summary["provenance"]["weights"], summary["provenance"]["corpus"]
    assert weights["fingerprint"] == "weights not fingerprinted"  # the tiny test model
    assert (corpus["n_documents"], corpus["tokens_per_window"]) == (4, 24)
    assert "## Provenance" in report and corpus["token_ids_sha256"] in report
    # no causal count set: faithfulness and pruning on every window, the lone-head costs on
    # lone_docs of them drawn at random (tests/test_causal_sample.py: the sampled counts)
    causal = summary["causal_sample"]
    assert (causal["seed"], causal["corpus_documents"]) == (0, 4)
    for part in ("faithfulness", "pruning"):
        assert causal[part]["corpus_indices"] == [0, 1, 2, 3]
    assert causal["lone_costs"]["n_documents"] == 2
    assert "The causal claims rest on windows drawn at random (causal seed 0)" in report
    # the claims' replicates beside the summary: one float32 vector per number with an interval
    from cw_lens.reproduction.run_replicates import unpack

    kept = summary["replicates"]
    reps = unpack(out / kept["file"], kept["sha256"])
    checks = [(cid, c) for cid, claim in summary["claims"].items() for c in claim["checks"]]
    every = {(cid, c["number"]) for cid, c in checks}
    with_interval = {
        (cid, c["number"])
        for cid, c in checks
        if c.get("interval") is not None and None not in c["interval"]
    }
    # every number with an interval keeps its replicates; a number without one (pruning's 3
    # random orders give pruning_signal none) may keep them or not, but nothing else is kept
    assert with_interval <= set(reps.numbers) <= every and kept["numbers"] == len(reps.numbers)
    assert {v.shape for v in reps.numbers.values()} == {(2000,)}
    assert len(reps.documents) == 4 and kept["bytes"] == (out / kept["file"]).stat().st_size
    assert kept["bytes"] < 250_000
    assert (out / "per_layer_intervals.png").stat().st_size > 1000
    for cid in CLAIM_ORDER:
        assert (f"`{cid}`" in report) == (cid not in FIELD_CLAIMS)
    assert not list(out.rglob(".*.tmp*"))


def test_rerun_is_deterministic_and_resumes_without_recomputing(tiny_run, tmp_path, monkeypatch):
    out, summary = tiny_run
    fresh = run_figures(JobConfig(**TINY), tmp_path / "again", progress=False)
    assert fresh["claims"] == summary["claims"]
    assert (tmp_path / "again" / "summary.json").read_text() == (out / "summary.json").read_text()

    import cw_lens.reproduction.job as report

    def fail(job):
        raise AssertionError("a finished step was recomputed")

    monkeypatch.setattr(report, "STEPS", tuple((name, fail) for name, _ in STEPS))
    timing_line = next(
        line for line in (out / "REPORT.md").read_text().splitlines() if "Step timings" in line
    )
    resumed = run_figures(JobConfig(**TINY), out, progress=False)
    assert resumed["claims"] == summary["claims"]
    # a resumed run reports how long its loaded steps took when they were computed, and how
    # the corpus steps' one shared pass is split between them
    assert timing_line in (out / "REPORT.md").read_text().splitlines()
    from cw_lens.reproduction.markdown import SHARED_PASS_NOTE

    assert SHARED_PASS_NOTE in (out / "REPORT.md").read_text().splitlines()
    with pytest.raises(AssertionError, match="recomputed"):
        run_figures(JobConfig(**TINY), out, progress=False, force=True)


def _cli(*args: str, env: dict | None = None) -> list[str]:
    return [sys.executable, "-m", "cw_lens.reproduction.cli", "figures", *CLI_ARGS, *args]


def test_killed_run_resumes_and_leaves_nothing_half_written(tiny_run, tmp_path):
    out = tmp_path / "killed"
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    proc = subprocess.Popen(
        _cli("--out", str(out)), env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    deadline = time.time() + 300
    state = None
    while time.time() < deadline:
        found = list(out.glob(".state/*/*.safetensors"))
        if found:
            state = found
            break
        time.sleep(0.05)
    assert state, "the job stored no step before the deadline"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not (out / "summary.json").exists()
    done = subprocess.run(_cli("--out", str(out)), env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    assert not list(out.rglob(".*.tmp*"))
    assert claims_of(out)["claims"] == claims_of(tiny_run[0])["claims"]
    _console_agrees_with_the_report(done.stdout, out)


def _console_agrees_with_the_report(stdout: str, out: Path) -> None:
    """The console's count line and per-claim verdicts say what REPORT.md and summary.json
    say, in the report's words, and the counts add up to the claims."""
    from cw_lens.reproduction.markdown import VERDICT_MARK

    claims = claims_of(out)["claims"]
    lines = stdout.strip().splitlines()
    counts = dict(
        reversed(part.split(" ", 1)) for part in lines[0].split(";")[0].split(": ")[1].split(", ")
    )
    assert lines[0].startswith(f"{len(claims)} claims: ")
    assert sum(map(int, counts.values())) == len(claims)
    assert counts == {v: str([c["holds"] for c in claims.values()].count(v)) for v in VERDICTS}
    printed = {line.split()[-1]: line.rsplit(" ", 1)[0].strip() for line in lines[1:]}
    assert printed == {cid: claim["holds"] for cid, claim in claims.items()}
    report = (out / "REPORT.md").read_text(encoding="utf-8")
    for cid, claim in claims.items():
        row = next(line for line in report.splitlines() if line.startswith(f"| `{cid}`"))
        assert VERDICT_MARK[claim["holds"]] in row, (cid, row)


def test_torchrun_two_processes_merge_to_the_single_process_numbers(tmp_path):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    single = subprocess.run(
        _cli("--out", str(tmp_path / "one")), env=env, capture_output=True, text=True
    )
    assert single.returncode == 0, single.stderr[-2000:]
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        "-m",
        "cw_lens.reproduction.cli",
        "figures",
        *CLI_ARGS,
        "--out",
        str(tmp_path / "two"),
    ]
    # a deadlock between ranks would otherwise wait for gloo's 30-minute timeout
    double = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    rank0 = "\n".join(line for line in double.stderr.splitlines() if "[rank0]" in line)
    assert double.returncode == 0, rank0[-3000:] + "\n...\n" + double.stderr[-3000:]
    # the job destroys its process group at the end; rank 0 alone still prints the verdicts
    assert double.stdout.count(" claims: ") == 1, double.stdout
    one, two = claims_of(tmp_path / "one"), claims_of(tmp_path / "two")
    assert one["claims"] == two["claims"]
    assert one["n_documents"] == two["n_documents"] == 4


def test_random_draws_and_the_field_comparison_change_the_fingerprint_only_when_used():
    import hashlib

    from cw_lens.version import __version__

    keys = {
        k: v
        for k, v in JobConfig().__dict__.items()
        if k
        not in (
            "device",
            "api",
            "random_draws",
            "n_resamples",
            "bootstrap_seed",
            "field_docs",
            "field_items",
        )
    }
    keys["version"] = __version__
    before = hashlib.sha256(json.dumps(keys, sort_keys=True).encode()).hexdigest()[:12]
    assert JobConfig().fingerprint() == before  # runs stored before the options still resume
    assert JobConfig(random_draws=2).fingerprint() != before
    assert JobConfig(field_docs=2).fingerprint() != before
    assert JobConfig(field_items=2).fingerprint() != JobConfig(field_docs=2).fingerprint()


def test_report_reads_the_random_controls_spread():
    from cw_lens.reproduction.figure_text import _random_draws_text

    assert _random_draws_text(None) == ""
    spread = {"comprehensiveness_pairs": dict(n_draws=3.0, mean=0.5, sd=0.1, min=0.4, max=0.6)}
    assert _random_draws_text(spread) == (
        " Random control over 3 draws (comprehensiveness, pairs): AOPC mean 0.5, sd 0.1, "
        "range [0.4, 0.6]."
    )


def test_steps_run_alone_report_only_their_claims(tmp_path):
    """--steps / --skip: the claims and figures of the steps that ran, the others listed as not
    run (never reported as failing); a step another needs runs with it."""
    out = tmp_path / "partial"
    summary = run_figures(JobConfig(**TINY), out, progress=False, steps=["pruning"])
    assert list(summary["claims"]) == ["retriever_share", "pruning_signal"]
    assert summary["steps_not_run"] == [
        "sinks",
        "heatmaps",
        "ablation",
        "faithfulness",
        "task_faithfulness",
        "selection",
        "field_pairs",
        "field_inputs",
    ]
    written = {p.stem for p in out.glob("*.png")}
    assert {"retriever_share", "pruning_signal", "pruning_signal_global"} <= written
    assert not written & {"sink_value_geometry", "faithfulness_order", "topn_beats_random"}
    report = (out / "REPORT.md").read_text()
    assert "Steps not run (--steps/--skip)" in report and "`sinks`" not in report


def test_presets_and_what_a_quick_run_cannot_settle():
    """``paper``: 256 x 256 tokens of pydoc+stdlib, the causal analyses on 32 windows, 20
    random pruning orders; the quick default's report names the verdicts its size cannot
    settle (its intervals, pruning's 3 random orders), the paper run's only the intervals'."""
    from cw_lens.core.errors import InputError
    from cw_lens.reproduction.markdown import number_name

    paper = JobConfig.preset("paper")
    assert (paper.corpus, paper.n_docs, paper.max_tokens) == ("pydoc+stdlib", 256, 256)
    assert paper.faithfulness_docs == paper.pruning_docs == 32 and paper.pruning_draws == 20
    # quick: the defaults, with the paper preset's choices of what to run
    assert JobConfig.preset("quick") == JobConfig()
    assert (JobConfig().faithfulness_granularity, JobConfig().global_ranking) == (("pairs",), False)
    assert JobConfig.preset("paper", n_docs=64, corpus=None).n_docs == 64  # None: the preset's
    assert JobConfig.preset("paper", corpus=None).corpus == "pydoc+stdlib"
    from cw_lens.reproduction.interval_coverage import (
        LOWER_TARGET,
        STUDIED_MODEL,
        TARGET,
        certified_at,
        coverage_at,
    )

    lowers, pruning = "geomean_head_ratio_n2", "random_minus_taxonomy_delta_ppl_at_0.9"
    summary = {
        "model": STUDIED_MODEL,
        "corpus": "pydoc",
        "max_tokens": 128,
        "n_documents": 8,
        "claims": {
            "sink_lowers_fn": {"checks": [{"number": lowers, "interval": [1.0, 1.2]}]},
            "pruning_signal": {"checks": [{"number": pruning, "interval": [1.0, 2.0]}]},
            "retriever_share": {"checks": [{"number": "retriever_share", "interval": None}]},
        },
    }
    docs = {"sink_lowers_fn": 8, "pruning_signal": 8, "retriever_share": 8}
    quick = "\n".join(size_limits(JobConfig(), summary, docs))
    assert "`pruning_signal`: 3 random orders" in quick
    # the measured coverage decides (cw_lens/reproduction/interval_coverage.json)
    assert (f"{number_name(lowers)}, coverage" in quick) == (not certified_at(lowers, 8))
    assert (f"{number_name(pruning)}, coverage" in quick) == (not certified_at(pruning, 8))
    # below the smallest certified count (8 here): inconclusive, and the report says from when
    assert coverage_at(pruning, 7) is None and (
        f"`pruning_signal` at 7 documents ({number_name(pruning)}: "
        in "\n".join(size_limits(JobConfig(), summary, {"pruning_signal": 7}))
    )
    # no interval: the verdict says inconclusive already
    assert "retriever_share" not in quick and number_name("retriever_share") not in quick
    rule = f"certified (coverage >= {TARGET}, lower bound >= {LOWER_TARGET}) only from 256"
    assert coverage_at(lowers, 7) is None and f"{number_name(lowers)}: {rule}" in (
        "\n".join(size_limits(JobConfig(), summary, {"sink_lowers_fn": 7}))
    )
    assert "3 random orders" not in "\n".join(size_limits(paper, summary, docs))
    # the quick preset's windows (128 tokens of pydoc) are not the study's pool: said so
    assert "a related pool" in quick
    studied = {**summary, "corpus": "pydoc+stdlib", "max_tokens": 256}
    assert "a related pool" not in "\n".join(size_limits(paper, studied, docs))
    elsewhere = "\n".join(size_limits(paper, {**summary, "model": "gpt2"}, docs))
    assert "not measured, so the verdicts are indicative" in elsewhere
    with pytest.raises(InputError, match="Unknown preset"):
        JobConfig.preset("huge")


def test_checks_whose_interval_undercovers_at_the_run_size_are_inconclusive():
    """A decisive check whose interval was measured to cover less than 0.93 at the run's size
    becomes inconclusive (the claim recombined); one that covers, or a run the study does not
    speak for, keeps its verdict."""
    from cw_lens.reproduction.interval_coverage import (
        STUDIED_MODEL,
        TARGET,
        coverage_at,
        settle_by_coverage,
        where_measured,
    )
    from cw_lens.reproduction.markdown import claims_markdown

    # the sink-tail cosine covers 0.905 at 8 documents and 0.983 at 256 (population study)
    share, ppl = "median_cos_sink_tail_mixture", "delta_ppl"
    assert coverage_at(share, 8) < TARGET <= coverage_at(share, 256)

    def summary(model: str = STUDIED_MODEL) -> dict:
        check = {"number": share, "value": 0.07, "interval": [0.06, 0.08], "holds": "yes"}
        missing = {"number": ppl, "value": 5.0, "interval": None, "holds": "yes"}
        for c in (check, missing):
            c.update(op=">", threshold=0.05)
        return {
            "model": model,
            "corpus": "pydoc",
            "n_documents": 8,
            "claims": {
                "retriever_share": {"holds": "yes", "paper": "P2", "checks": [check]},
                "other": {"holds": "yes", "paper": "P1", "checks": [missing]},  # no interval
            },
        }

    quick = summary()
    assert settle_by_coverage(quick, {}) == ["retriever_share"]
    [check] = quick["claims"]["retriever_share"]["checks"]
    assert quick["claims"]["retriever_share"]["holds"] == check["holds"] == "inconclusive"
    assert check["coverage"] == pytest.approx(coverage_at(share, 8), abs=1e-3)
    assert "was yes, but its interval has coverage" in check["undecided_because"]
    assert (
        "has coverage 0.905 at this size (8 documents; lower 95% bound 0.886), short of a "
        "certificate" in (check["undecided_because"])
    )
    # a count between two studied ones reads the smaller, and says so
    assert where_measured(share, 100) == (
        "at 32 documents, the largest count studied up to this run's 100"
    )
    assert quick["claims"]["other"]["holds"] == "yes"
    assert "was yes" in claims_markdown(quick)
    paper = summary()
    assert settle_by_coverage(paper, {"retriever_share": 256}) == []
    assert paper["claims"]["retriever_share"]["holds"] == "yes"
    elsewhere = summary("gpt2")
    assert settle_by_coverage(elsewhere, {}) == []
    assert elsewhere["claims"]["retriever_share"]["holds"] == "yes"


def _render_committed_gallery(folder: Path) -> tuple[str, str]:
    """The committed REPORT.md and what `build_report` writes from the committed summary.json,
    given what summary.json does not keep: the job's configuration (the paper preset), its
    step timings and its figures (the report's own Run line and figure headings)."""
    import re

    from cw_lens.reproduction.markdown import build_report
    from cw_lens.reproduction.state import Job

    summary = json.loads((folder / "summary.json").read_text(encoding="utf-8"))
    committed = (folder / "REPORT.md").read_text(encoding="utf-8")
    job = Job(JobConfig.preset("paper"), folder)
    job.corpus = [None] * summary["n_documents"]  # claim_documents reads only its length
    (run_line,) = [line for line in committed.splitlines() if line.startswith("Step timings")]
    for part in run_line.split(": ", 1)[1].split(", "):
        step, seconds = part.rsplit(" ", 1)
        job.timings[step] = float(seconds)
    shown = committed.split("## Figures")[1].split("## Run")[0]
    figures = {n: [folder / f"{n}.png"] for n in re.findall(r"^### (\S+)$", shown, re.M)}
    return committed, build_report(job, summary, figures)


def test_the_committed_gallery_report_is_what_the_renderer_writes():
    """figures/REPORT.md is what the renderer writes from the committed figures/summary.json,
    character for character: every other measured number in a small table (nothing elided:
    the 0.4.0 report wrote pruning's ΔPPL as `{0.9: {...}, ...}`), each interval's coverage in
    words that cannot be read as the interval containing a value, every check under a plain
    name with its key in the glossary at the end, and a caption under every figure."""
    from cw_lens.reproduction.markdown import FIGURE_CAPTIONS, number_name

    folder = Path(__file__).parents[1] / "figures"
    committed, rendered = _render_committed_gallery(folder)
    assert rendered == committed
    assert "{...}" not in committed and "interval covers" not in committed
    # every check of the paper preset is certified at its size, so no coverage sentence (the
    # wording of one is tested on an 8-document summary above)
    assert "at this size" not in committed
    summary = json.loads((folder / "summary.json").read_text(encoding="utf-8"))
    glossary = committed.split("## Glossary")[1]
    table = committed.split("## Claims")[1].split("## Criteria")[0]
    for cid, claim in summary["claims"].items():
        for check in claim["checks"]:
            name, key = number_name(check["number"]), check["number"]
            assert name != key and f"| {name} | `{key}` | `{cid}` |" in glossary, key
            assert f"{name} = " in table and f"{key} = " not in table, key
    figures = committed.split("## Figures")[1].split("## Run")[0]
    for name in [n for n in FIGURE_CAPTIONS if f"### {name}\n" in figures]:
        assert f"*{FIGURE_CAPTIONS[name]}*" in figures, name
    assert figures.count("### ") == sum(f"### {n}\n" in figures for n in FIGURE_CAPTIONS)
    pruning = committed.split("### `pruning_signal`")[1].split("## Figures")[0]
    assert "| `delta_ppl` | taxonomy | magnitude | entropy | random |" in pruning
    assert "| 0.9 | 3.83 | 16.2 | 18.7 | 11.1 |" in pruning


def test_the_report_shows_nested_numbers_as_small_tables():
    """A claim's other numbers: single values in one table, mappings with the same keys one
    row each in a table whose columns are the keys, a mapping of mappings and a list of
    records each as their own table, a mapping holding mappings as its own block; every value
    is written (none cut off), a run of layers as its first and last."""
    from cw_lens.reproduction.markdown import criteria_sections, measured_tables

    measured = {
        "n": 3,
        "layers": list(range(30)),
        "f_top": {"2": 0.5, "4": 0.25},
        "f_random": {"2": 0.125, "4": 1 / 3},
        "delta_ppl": {"0.9": {"taxonomy": 1.0, "random": 12345.6}},
        "top": [{"layer": 1, "head": 2}],
        "task": {"n_items": 4, "aopc": {"a": 1.5}},
    }
    lines = measured_tables(measured)
    text = "\n".join(lines)
    assert "| `n` | 3 |" in text and "| `layers` | 0–29 |" in text
    assert "| number | 2 | 4 |\n|---|---|---|\n| `f_top` | 0.5 | 0.25 |" in text
    assert "| `f_random` | 0.125 | 0.333 |" in text
    assert "| `delta_ppl` | taxonomy | random |\n|---|---|---|\n| 0.9 | 1 | 12,346 |" in text
    assert "| `top` | layer | head |\n|---|---|---|\n| 1 | 1 | 2 |" in text
    assert "`task`:\n\n| number | value |\n|---|---|\n| `n_items` | 4 |" in text
    assert "| number | a |\n|---|---|\n| `aopc` | 1.5 |" in text
    claim = {"criterion": "c", "holds": "yes", "checks": [{"number": "n"}], "measured": measured}
    sections = criteria_sections({"claims": {"x": claim}})
    assert sections[:3] == ["### `x`", "", "Criterion: c. Verdict: yes."]
    assert "| `n` | 3 |" not in "\n".join(sections)  # a check's own number is in the table
