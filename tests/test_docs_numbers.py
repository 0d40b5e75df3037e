"""Every timing, test count, memory figure and corpus count the README, the docs and the CLI
help quote is the one a committed record holds: `benchmarks/records/timings.json` (wall times
no benchmark script writes, each with its date), `benchmarks/records/bench_7b.json` (memory at
7B width), `benchmarks/records/population/manifest.json` (the corpus) and `figures/summary.json`
(the gallery's claims). A new measurement goes into the record; these tests then name every
page that still quotes the old one. Fast: nothing is run but the CLI's help."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
RECORDS = ROOT / "benchmarks" / "records"


def _read(path: str) -> str:
    return (ROOT / path).read_text(encoding="utf-8")


def _flat(path: str) -> str:
    """The file's text with every run of whitespace one space (a figure may wrap)."""
    return " ".join(_read(path).split())


def _record(name: str) -> dict:
    return json.loads((RECORDS / f"{name}.json").read_text(encoding="utf-8"))


def _span(pair: list[float], unit: str) -> str:
    """`[10, 14]` -> "10–14 s" (one value: "3 s"), as the pages write a range."""
    low, high = (f"{v:g}" for v in pair)
    return f"{low} {unit}" if low == high else f"{low}–{high} {unit}"


def _min_s(seconds: float) -> str:
    """4483 -> "74 min 43 s"."""
    return f"{int(seconds // 60)} min {round(seconds % 60)} s"


def test_the_quickstart_timings_are_the_recorded_ones():
    """README's sentence under the Quickstart, getting started's timing table and notebook 01
    quote the 2026-12-03 measurement on idle cores (and getting started the busy-machine one,
    said to be busy); no page keeps an older figure (the notebook's "~2 s")."""
    idle, busy = _record("timings")["quickstart"], _record("timings")["load_model_busy"]
    readme = _flat("README.md")
    assert f"the block takes {_span(idle['wall_s'], 's')} once the weight cache is built" in readme
    assert f"`load_model()` {_span(idle['load_model_s'], 's')} of it ({idle['date']})" in readme
    assert f"({busy['first_load_s']} s on a busy machine" in readme
    page = _flat("docs/getting-started.md")
    assert f"Measured on {idle['date']} with cw_lens {idle['cw_lens']} on two idle cores" in page
    rows = {
        "the whole Quickstart block": f"{_span(idle['wall_s'], 's')} ({_span(idle['cpu_s'], 's')}"
        " of CPU)",
        "`import cw_lens`": _span(idle["import_s"], "s"),
        "`load_model()`": _span(idle["load_model_s"], "s"),
        "`verify_model`, which every analysis runs once per model before its first number": _span(
            idle["verify_model_s"], "s"
        ),
        "the contribution weights, `top` and the plot": _span(
            idle["contribution_weights_top_plot_s"], "s"
        ),
        "the corpus and `sink_statistics`": _span(idle["corpus_and_sink_statistics_s"], "s"),
    }
    for step, time in rows.items():
        assert f"| {step} | {time} |" in page, step
    assert f"`load_model()` took {_span(busy['load_model_s'], 's')}" in page
    assert f"cache, {busy['first_load_s']} s" in page
    for notebook in ("notebooks/01_quickstart.ipynb", "notebooks/build_notebooks.py"):
        text = _read(notebook)
        assert f"# {_span(idle['load_model_s'], 's')} on two idle cores once" in text, notebook
        assert "~2 s" not in text, notebook


def _benchmark(name: str) -> Any:
    """The benchmark script `benchmarks/<name>.py`, imported as a module (its table printers)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        f"cw_lens_{name}", ROOT / "benchmarks" / f"{name}.py"
    )
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    return bench


def test_the_paper_presets_time_is_the_recorded_range():
    """README, the docs' home page, the reproducing page, `cw-lens figures --help` and the
    Makefile give the paper preset's time as the range of the recorded gallery runs (no "under
    an hour", no "60–75 min"); the reproducing page lists every run and the committed gallery's
    steps as recorded, and those are figures/REPORT.md's Run line."""
    from typer.testing import CliRunner

    from cw_lens.reproduction.cli import app

    paper = _record("timings")["paper_preset"]
    walls = [run["wall_s"] for run in paper["runs"]]
    low, high = round(min(walls) / 60), round(max(walls) / 60)
    span = f"{low}–{high} min"
    for page in ("README.md", "docs/index.md", "docs/reproducing.md"):
        text = _flat(page)
        words = {4: "four", 5: "five", 6: "six", 7: "seven"}[len(walls)]
        assert f"{span} on two cores" in text or f"{span} over {words} gallery runs" in text, page
        assert "60–75 min" not in text and "under an hour" not in text, page
    helped = CliRunner().invoke(app, ["figures", "--help"], terminal_width=200)
    assert helped.exit_code == 0, helped.output
    assert f"{low}-{high} min on two cores" in " ".join(helped.output.split())
    assert f"({low}-{high} min on two cores" in _read("Makefile")
    reproducing = _flat("docs/reproducing.md")
    for run in paper["runs"]:
        assert f"{_min_s(run['wall_s'])} ({run['cw_lens']}" in reproducing, run
    gallery = paper["runs"][-1]
    steps = gallery["steps_s"]
    written = {
        "faithfulness": f"faithfulness {steps['faithfulness'] / 60:.1f} min "
        f"({gallery['faithfulness_intervened_passes']} intervened passes)",
        "pruning": f"pruning {steps['pruning'] / 60:.1f} min",
        "sinks": f"sinks {steps['sinks'] / 60:.1f} min",
        "ablation": f"ablation {steps['ablation'] / 60:.1f} min",
        "selection": f"selection {steps['selection'] / 60:.1f} min",
        "taxonomy": f"taxonomy {steps['taxonomy'] / 60:.1f} min",
        "task_faithfulness": f"the IOI task {steps['task_faithfulness'] / 60:.1f} min",
    }
    for step, text in written.items():
        assert text in reproducing, step
    by_version = {run["cw_lens"]: run["wall_s"] for run in paper["runs"]}
    assert (
        f"{by_version['0.3.3'] / 60:.1f} min with 0.3.3, {by_version['0.4.0'] / 60:.1f} min"
        f" with 0.4.0 on a slower day, {gallery['wall_s'] / 60:.1f} min" in reproducing
    )
    report = _read("figures/REPORT.md")
    run_line = "Step timings (s, when each step was computed): " + ", ".join(
        f"{k} {v:.1f}" for k, v in steps.items()
    )
    assert run_line in report.splitlines()


def test_the_quick_preset_and_make_test_times_are_the_recorded_ones():
    """`make figures` takes "about 7 minutes" (the middle of the recorded runs, in minutes) and
    `make test` "about 8 min" wherever they are quoted; the models page's compatibility table
    has the recorded counts and wall times, each with its date, one cell per column."""
    timings = _record("timings")
    quick = round(sum(timings["quick_preset"]["wall_s"]) / 2 / 60)
    low, high = timings["quick_preset"]["wall_s"]
    runs = {2: "two", 3: "three", 4: "four"}[timings["quick_preset"]["runs"]]
    assert f"`make figures` takes about {quick} minutes on two cores" in _flat("README.md")
    assert f"about {quick} minutes ({low}–{high} s over {runs} runs)" in _flat(
        "docs/reproducing.md"
    )
    assert f"(8 x 128 tokens of pydoc, about {quick} min)" in _read("cw_lens/reproduction/cli.py")
    assert f"**about {quick} minutes** ({low}–{high} s over {runs} runs" in _flat(
        "docs/benchmarks.md"
    )
    assert f"With the defaults the job takes about {quick} minutes on two" in _flat(
        "docs/guides/cli.md"
    )
    make_test = timings["make_test"]
    minutes = make_test["make_test_min"]
    assert f"(about {minutes} min on two cores" in _read("README.md")
    models = _flat("docs/models.md")
    assert (
        f"on {make_test['date']} `make test` took about {minutes} min on two cores, lint and the "
        f"docs included (pytest {make_test['pytest_s'] / 60:.1f} min)" in models
    )
    suite = timings["test_suite"]
    assert (
        f"| environment | model classes | tests | last recorded run ({suite['date']}) |" in models
    )
    for env in suite["environments"].values():
        counts = f"{env['passed']} passed, {env['skipped']} skipped, {env['failed']} failed"
        wall = _min_s(env["wall_s"]).replace(" 0 s", "")
        assert f"| {counts} in {wall} |" in models, counts


def test_the_7b_memory_is_the_measured_peak():
    """README and the large-models page give a layer-streamed 7B-width GGUF model's memory as
    the range of every peak RSS bench_7b.json records, not "a few GB"."""

    def peaks(value: object) -> list[float]:
        # each run's whole-process peak: not its phases' own (a phase of a run, e.g. the
        # verification alone, peaks lower), nor the peak of the process that wrote its file
        if isinstance(value, dict):
            found = [v for k, v in value.items() if k == "peak_rss_mb"]
            inner = [v for k, v in value.items() if k not in ("file", "phases")]
            return found + [p for v in inner for p in peaks(v)]
        return []

    measured = peaks(_record("bench_7b"))
    assert len(measured) >= 6
    span = f"{min(measured) / 1000:.1f}–{max(measured) / 1000:.1f} GB"
    assert f"a peak of {span} of RAM at Qwen2-7B's width" in _flat("README.md")
    large = _flat("docs/large-models.md")
    assert f"# layer-streamed: {span} peak" in large
    assert f"The memory to plan for at 7B width is {span}" in large
    assert f"a 7B model peaks at {span} of memory" in _flat("cw_lens/models/load.py")
    for page in ("README.md", "docs/large-models.md", "docs/index.md", "cw_lens/models/load.py"):
        assert "few GB" not in _read(page), page


def test_the_28_layer_run_is_quoted_from_its_record():
    """The large-models page's end-to-end row is bench_7b.json's `e2e_28_layers`: the file's
    write, load, verification and its de-quantisations (one per layer), the first contribution
    weights, the corpus analyses and their split, the peak."""
    run = _record("bench_7b")["e2e_28_layers"]
    phases, split = run["phases"], run["corpus_seconds_by_analysis"]
    assert phases["verify"]["layer_loads"] == run["layers"] == 28
    corpus = phases["corpus_32x128"]["s"]
    assert sum(split.values()) == pytest.approx(corpus, rel=1e-3)
    row = (
        f"| {run['file']['write_s']:.0f} s ({run['file']['file_gb']:.1f} GB) "
        f"| {run['load_s']:.0f} s "
        f"| {phases['verify']['s']:.0f} s ({phases['verify']['layer_loads']}) "
        f"| {phases['contributions_8x128']['s']:.0f} s ({run['first_contributions_s']:.0f} s) "
        f"| {corpus:,.0f} s: "
        + ", ".join(
            f"{name} {split[name]:.0f} s" for name in ("sinks", "selection", "taxonomy", "ablation")
        )
        + f" | {run['peak_rss_mb'] / 1000:.1f} GB |"
    )
    large = _flat("docs/large-models.md")
    assert row in large, row
    four = _record("bench_7b")["e2e_4_layers"]
    gb = {k: f"{r['peak_rss_mb'] / 1000:.1f} GB" for k, r in (("4", four), ("28", run))}
    assert f"peaked at {gb['4']} with 4 layers and at {gb['28']} with 28" in large
    assert (
        "4 layers (`--layers 4`, under `e2e_4_layers`" in large and f"peaked at {gb['4']}." in large
    )
    contributions = {
        k: f"{r['phases']['contributions_8x128']['peak_rss_mb'] / 1000:.1f} GB"
        for k, r in (("4", four), ("28", run))
    }
    assert f"process to {contributions['28']} ({contributions['4']} with 4 layers)" in large
    assert (
        f"measured {phases['contributions_8x128']['s']:.0f} s for the contribution weights and "
        f"{phases['verify']['s']:.0f} s with {phases['verify']['layer_loads']} de-quantisations"
    ) in large
    cpu = phases["corpus_32x128"]["cpu_s"]
    assert f"used {cpu / corpus:.2f} of the two cores" in large
    assert f"(CPU time {cpu:,.0f} s in {corpus:,.0f} s" in large
    assert "nice 19" in run["conditions"]
    assert f"{phases['corpus_32x128']['layer_loads']} de-quantisations" in large


def test_the_corpus_window_counts_add_up():
    """`pydoc+stdlib` holds one window more than its two parts (the texts are joined before they
    are cut); the counts the pages quote are the recorded ones, and the whole corpus is the
    population the coverage study drew from."""
    windows = _record("timings")["corpus_windows"]["windows_256"]
    population = json.loads((RECORDS / "population" / "manifest.json").read_text())
    assert (
        windows["pydoc+stdlib"]
        == population["n_windows"]
        == windows["pydoc"] + windows["stdlib"] + 1
    )
    both = f"{windows['pydoc+stdlib']:,}"
    started = _flat("docs/getting-started.md")
    assert f"{windows['pydoc']} windows of 256 tokens" in started
    assert f"{windows['stdlib']} windows of 256 tokens" in started
    assert (
        f"({both} windows: the two texts' leftover tokens make one more window than "
        f"{windows['pydoc']} + {windows['stdlib']})" in started
    )
    assert f"all {both} windows of the corpus" in _flat("README.md")
    documents = _flat("cw_lens/data/sources.py")
    assert f"{both} windows of 256 tokens on Python 3.11, one more than" in documents


def test_the_readme_architecture_count_is_the_matrix():
    """README's "Of N decoder architectures tested, M are exact" counts the models page's
    architecture matrix."""
    rows = [
        line.split("|")[3].strip()
        for line in _read("docs/models.md").splitlines()
        if re.match(r"^\| [^|]+ \| `\w+` \| ", line)
    ]
    exact = sum(status.startswith("exact") for status in rows)
    assert f"Of {len(rows)} decoder architectures tested, {exact} are exact" in _flat("README.md")


NUMBER = r"−?\d+(?:\.\d+)?"


def _value(text: str) -> float:
    return float(text.replace("−", "-"))


def _decimals(text: str) -> int:
    return len(text.split(".")[1]) if "." in text else 0


def _agrees(written: str, value: float | None) -> bool:
    """The written number is `value` rounded to as many decimals as it shows."""
    return value is not None and round(value, _decimals(written)) == _value(written)


def _claims_table_is(readme: str, header: str, summaries: list[dict]) -> None:
    """The README's claims table under `header` has one row per claim of `summaries`, in
    order, with its verdict and only numbers [low, high] that are its checks, rounded as
    written."""
    claims = [claim for summary in summaries for claim in summary["claims"].values()]
    lines = readme.split(f"{header} number [95% interval] | verdict |")[1].splitlines()[2:]
    rows = lines[: next((i for i, r in enumerate(lines) if not r.startswith("|")), len(lines))]
    assert len(rows) == len(claims)
    for row, claim in zip(rows, claims, strict=True):
        cells = [c.strip() for c in re.split(r"(?<!\\)\|", row)[1:-1]]
        assert cells[-1] == claim["holds"], (row, claim["holds"])
        quoted = re.findall(rf"({NUMBER}) \[({NUMBER}), ({NUMBER})\]", cells[1])
        assert quoted, row
        for value, low, high in quoted:
            assert any(
                _agrees(value, c["value"])
                and _agrees(low, c["interval"][0])
                and _agrees(high, c["interval"][1])
                for c in claim["checks"]
            ), (row, value, low, high)


def test_the_readme_claims_table_is_the_gallerys():
    """Each row of the README's claims table (in the order of figures/summary.json's claims,
    then figures/field/summary.json's) has its claim's verdict, and every "number [low, high]"
    in it is one of that claim's checks, the value and both ends rounded as written; the caption
    under the headline figure and the docs' home page quote the same gallery."""
    summary = json.loads(_read("figures/summary.json"))
    readme = _read("README.md")
    # the papers' claims, then the comparison with other tools' methods (figures/field/)
    field = json.loads(_read("figures/field/summary.json"))
    _claims_table_is(readme, "| claim (paper) |", [summary, field])
    sink = summary["claims"]["sink_attention_vs_contribution"]["measured"]
    caption = " ".join(readme.split("![Attention (left)")[1].split("## Install")[0].split())
    assert f"Over the {sink['n_sink_heads']} sink heads" in caption
    ratio = f"{sink['contribution_over_attention']:.2f}"
    assert (
        f"mean contribution is {ratio} of its mean attention "
        f"({sink['mean_sink_contribution_intra']:.2f} against {sink['mean_sink_attention']:.2f})"
        in caption
    )
    assert f"it contributes {ratio} of it over all sink heads" in _flat("docs/index.md")


def test_the_coverage_pages_second_studies_are_the_package_tables_pooled_rows():
    """Every row of the coverage page's second-study tables (first study, second study,
    pooled, certified) is the pooled row `interval_coverage.json` certifies from, each
    `coverage [lower bound]` to three digits; every pooled row is on the page; the count the
    causal table's sentence gives is the number of pooled causal rows."""
    table = json.loads((ROOT / "cw_lens/reproduction/interval_coverage.json").read_text())
    pooled = {(r["number"], r["n"]): r for r in table["rows"] if "studies" in r}

    def cell(row: dict) -> str:
        return f"{row['coverage']:.3f} [{row['lower']:.3f}]"

    seen = set()
    header: list[str] | None = None
    for line in _read("docs/coverage.md").splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")] if "|" in line else []
        if "first study" in cells and "second study" in cells:
            header = cells
            continue
        if header is None or not cells or set(line) <= set("|-: "):
            header = None if not cells else header
            continue
        row = dict(zip(header, cells, strict=True))
        key = (row["number"].strip("`"), int(row["n"]))
        assert key in pooled, f"{key}: on the page, not a pooled row of the package table"
        want = pooled[key]
        first, second = want["studies"]
        assert row["first study"] == cell(first), key
        assert row["second study"] == cell(second), key
        assert row[next(h for h in header if h.startswith("pooled"))] == cell(want), key
        assert row["certified"] == ("yes" if want["certified"] else "no"), key
        seen.add(key)
    assert seen == set(pooled)
    # the drivers' second study: a row it measured but does not pool (its first study was not
    # near 0.93) is quoted from its record
    drivers = json.loads((RECORDS / "coverage_drivers_second.json").read_text())
    unpooled = [
        r
        for r in drivers["rows"]
        if r["method"] == "expanded" and (r["number"], r["n"]) not in pooled
    ]
    assert len(unpooled) == 1
    row = unpooled[0]
    assert f"was measured in the same draws, {row['coverage']:.3f} of {row['draws']}" in _flat(
        "docs/coverage.md"
    )
    words = {9: "Nine", 10: "Ten", 11: "Eleven", 12: "Twelve", 13: "Thirteen"}
    causal = [r for r in pooled.values() if r["analysis"] in ("faithfulness", "pruning")]
    assert f"{words[len(causal)]} of these rows lie within two binomial" in _flat(
        "docs/coverage.md"
    )


def test_the_quick_presets_profile_is_its_latest_run():
    """The performance page's quick-preset table and the benchmarks page's step list are the
    latest recorded quick run's step times (faithfulness's passes counted by its docstring's
    formula)."""
    latest = _record("timings")["quick_preset"]["latest"]
    steps, wall = latest["steps_s"], latest["wall_s"]
    corpus = sum(steps[k] for k in ("sinks", "ablation", "selection", "taxonomy"))
    rest = wall - steps["faithfulness"] - steps["pruning"] - steps["task_faithfulness"] - corpus
    page = _flat("docs/performance.md")
    assert f"the latest, with cw_lens {latest['cw_lens']}, {wall} s" in page
    rows = (
        ("faithfulness", steps["faithfulness"], 0),
        ("pruning (layer-wise ranking, its lone-head costs)", steps["pruning"], 0),
        ("IOI task faithfulness", steps["task_faithfulness"], 0),
        ("the corpus steps (sinks, ablation, selection, taxonomy: one shared pass)", corpus, 1),
        ("the rest (loading, the heatmaps, claims and their intervals, figures, report)", rest, 0),
    )
    for label, seconds, digits in rows:
        row = f"| {label} | {seconds:.{digits}f} | {100 * seconds / wall:.0f}% |"
        assert row in page, row
    assert f"{wall - 300:.0f} s over" in page  # the goal: 5 minutes
    from cw_lens.analyses.faithfulness.ranking import ALL_METRICS, FRACTIONS, MODES
    from cw_lens.reproduction.state import JobConfig

    grans = JobConfig.preset("quick").faithfulness_granularity
    passes = 1 + len(grans) * len(ALL_METRICS) * len(MODES) * len(FRACTIONS)
    assert f"{passes} of them over its one batch" in page
    assert f"{steps['faithfulness'] / passes:.1f} s a pass on average" in page
    bench = _flat("docs/benchmarks.md")
    assert f"latest run ({wall} s, {latest['date']}, cw_lens {latest['cw_lens']})" in bench
    assert f"faithfulness {steps['faithfulness']:.0f} s ({passes} model passes" in bench
    small = ", ".join(
        f"{name} {steps[key]:g} s"
        for name, key in (("ablation", "ablation"), ("sinks", "sinks"), ("selection", "selection"),
                          ("taxonomy", "taxonomy"))
    )  # fmt: skip
    assert (
        f"pruning {steps['pruning']:.0f} s, IOI task faithfulness "
        f"{steps['task_faithfulness']:.0f} s, {small};" in bench
    )


def test_the_overhead_table_is_the_records():
    """docs/performance.md's "Ratios now" table is what `bench_overhead.py --docs-table` prints
    from the committed record."""
    bench = _benchmark("bench_overhead")
    record = _record("bench_overhead")
    assert bench.docs_table(record) in _read("docs/performance.md")
    share = {}
    for workload in ("tiny", "embedded"):
        cpu = record["workloads"][workload]["medians"]["cpu"]
        share[workload] = cpu["fused3"] / (cpu["sinks"] + cpu["selection"] + cpu["taxonomy"])
    assert (
        f"costs {share['tiny']:.2f} of the three standalone calls on the tiny workload and "
        f"{share['embedded']:.2f} on the embedded model" in _flat("docs/performance.md")
    )
    assert "idle" in record["note"] and "otherwise idle cores" in _flat("docs/performance.md")


def test_the_operation_count_table_is_the_records():
    """docs/performance.md's "Operations per layer and batch" table and its growth figures are
    what `bench_ops.py` recorded."""
    bench = _benchmark("bench_ops")
    record = _record("bench_ops")
    page = _flat("docs/performance.md")
    assert bench.docs_table(record) in _read("docs/performance.md")
    heads = [f"{record['growth']['heads'][n]['sinks']:,.0f}" for n in ("4", "8", "16")]
    docs = [f"{record['growth']['documents'][n]['selection']:,.0f}" for n in ("8", "16", "32")]
    assert f"the sink statistics: {heads[0]}, {heads[1]} and {heads[2]} with 4, 8" in page
    assert f"the selection: {docs[0]}, {docs[1]} and {docs[2]} with 8, 16" in page


def test_the_faithfulness_metrics_costs_are_the_recorded_ones():
    record = _record("bench_faithfulness_metrics")
    guide = _flat("docs/guides/faithfulness.md")
    batch = record["batch"]
    assert f"8 documents × {batch[1]} tokens, two CPU threads (a forward pass: " in guide
    assert f"a forward pass: {record['forward_s']:g} s)" in guide
    rows = {"p1_metrics": "P1", "attribution_patching": "AP", "alti": "ALTI"}
    for case in rows:
        seconds, times = record["clean_pass_s"][case], record["x_forward"][case]
        assert f"| {seconds:g} s ({times:g} ×" in guide, case


def test_the_input_deletion_section_is_the_record():
    """docs/guides/faithfulness.md's input-level section (its cost table, both corpora's tables,
    the claim's intervals and every number of its prose) is what `bench_input_deletion.py`
    recorded, rendered by that script's `guide_pieces`."""
    bench = _benchmark("bench_input_deletion")
    pieces = bench.guide_pieces(_record("bench_input_deletion"))
    guide = _read("docs/guides/faithfulness.md")
    for name in ("cost_table", "ioi_table", "arith_table", "ioi_claim", "arith_claim"):
        assert pieces[name] in guide, name
    flat = _flat("docs/guides/faithfulness.md")
    p = pieces
    for fragment in (
        f"one batch of {p['cost_batch']}, two CPU threads (a forward pass: {p['forward_s']} s)",
        f"on 32 items took {p['ioi_s']} on IOI and {p['arith_s']} on `arithmetic`",
        f"IOI ({p['ioi_candidates']} candidate tokens per item, median)",
        f"`arithmetic` ({p['arith_candidates']} candidate tokens per item, median)",
        f"it ranks {p['arith_rank']} of 8 methods on comprehensiveness",
        f"the median deviation is {p['ioi_ig']} nats on IOI and {p['arith_ig']} on `arithmetic`",
        f"reaches ({p['ioi_range']} and {p['arith_range']})",
    ):
        assert fragment in flat, fragment


def test_the_pairs_claim_table_is_the_record():
    """The guide's table of `contribution_vs_field_pairs` is what `bench_field_pairs.py`
    recorded, rendered by that script's `claim_table`."""
    bench = _benchmark("bench_field_pairs")
    record = _record("bench_field_pairs")
    assert bench.claim_table(record) in _read("docs/guides/faithfulness.md")
    prose = record["prose"]
    sizes = f"{prose['n_documents']} windows × {prose['tokens']} tokens of prose and "
    guide = _flat("docs/guides/faithfulness.md")
    assert f"{sizes}{record['ioi']['n_documents']} IOI items" in guide
