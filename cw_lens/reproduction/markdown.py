"""REPORT.md: the claims table with verdicts and intervals, and what each figure shows, from
`summary.json`.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pandas as pd

from cw_lens.reproduction.bootstrap import BIAS_SE_LIMIT, bias_flagged
from cw_lens.reproduction.figure_text import FIGURE_CAPTIONS, compact_text, figure_readings
from cw_lens.reproduction.state import FIELD_TASKS

if TYPE_CHECKING:
    from cw_lens.reproduction.state import Job, JobConfig


# the comparison with other tools: each protocol's subject, and what it is measured against
# (the main job names the input-level numbers after their task: `state.field_input_number`)
FIELD_SUBJECTS = (
    ("inputs", "inputs", "contribution_rollout", "contribution rollout"),
    *(
        (
            f"inputs_{task}",
            f"inputs ({task.upper() if task == 'ioi' else task})",
            "contribution_rollout",
            "contribution rollout",
        )
        for task in FIELD_TASKS
    ),
    ("pairs", "pairs", "contribution", "contribution"),
)
FIELD_RIVALS = (("best_other", "best other method"), ("best_control", "best control"))

# The plain name of every check's number: the report writes these, and its glossary maps each
# back to its key in summary.json (`claims.<claim>.checks[].number`; docs/methods.md#criteria).
NUMBER_NAMES = {
    "contribution_over_attention": "the sink's contribution over its attention",
    "comprehensiveness_value_norm_minus_attention": (
        "comprehensiveness AOPC, value norm − attention"
    ),
    "comprehensiveness_value_norm_output_minus_value_norm": (
        "comprehensiveness AOPC, value norm over output − value norm"
    ),
    "comprehensiveness_contribution_minus_value_norm_output": (
        "comprehensiveness AOPC, contribution − value norm over output"
    ),
    "sufficiency_lowest_other_minus_contribution": (
        "sufficiency AOPC, the best other metric − contribution"
    ),
    "median_ratio_sink_heads": "median value-norm ratio, other tokens over the sink, sink heads",
    "median_cos_sink_tail_mixture": "median cosine of the sink's value with the tail mixture",
    "median_abs_rho_relative_norm_minus_attention": (
        "median absolute Spearman ρ with the sink's contribution, relative norm − attention"
    ),
    "median_abs_rho_cosine_minus_attention": (
        "median absolute Spearman ρ with the sink's contribution, cosine − attention"
    ),
    "share_judged_sink_heads_interior_median_s_star": "share of sink heads whose s* is interior",
    "share_sink_heads_negative_cosine": "share of sink heads whose sink term opposes the drift",
    "median_cancelled_share": "median cancelled share",
    "cone_rise_low_norm_minus_other": "rise of the cone alignment, low-norm heads − the others",
    "delta_ppl": "perplexity rise without the sink's norm (ΔPPL)",
    "min_over_n_f_top_minus_random": "smallest F_N gap over N, top-N − random",
    "largest_gap_n2_n4_minus_larger_n": "largest F_N gap at N ∈ {2, 4} − at larger N",
    "geomean_head_ratio_n2": "F_N without the sink over F_N with it, geometric mean, N = 2",
    "geomean_head_ratio_n4": "F_N without the sink over F_N with it, geometric mean, N = 4",
    "retriever_share": "share of Retriever heads",
    "random_minus_taxonomy_delta_ppl_at_0.9": "ΔPPL, random − taxonomy order, 90% of heads kept",
    "random_minus_taxonomy_delta_ppl_at_0.75": "ΔPPL, random − taxonomy order, 75% of heads kept",
    **{
        f"{protocol}_comprehensiveness_{subject}_minus_{against}": (
            f"{words} comprehensiveness AOPC, {subject_words} − the {against_words}"
        )
        for protocol, words, subject, subject_words in FIELD_SUBJECTS
        for against, against_words in FIELD_RIVALS
    },
    **{
        f"{protocol}_sufficiency_{against}_minus_{subject}": (
            f"{words} sufficiency AOPC, the {against_words} − {subject_words}"
        )
        for protocol, words, subject, subject_words in FIELD_SUBJECTS
        for against, against_words in FIELD_RIVALS
    },
}


def number_name(number: str) -> str:
    """A check's number in words (`NUMBER_NAMES`).

    Args:
        number: The number's key in summary.json.

    Returns:
        Its plain name, or the key when it has none.
    """
    return NUMBER_NAMES.get(number, number)


def _cell(value: Any) -> str:
    """One value in a report table: floats to 3 significant digits (from 1,000 on, whole with
    thousands separators), a run of consecutive integers as its first and last (`0–29`), other
    lists in full, None as n/a."""
    if isinstance(value, float):
        return f"{value:,.0f}" if abs(value) >= 1000 else f"{value:.3g}"
    if value is None:
        return "n/a"
    if isinstance(value, list):
        whole = [v for v in value if isinstance(v, int) and not isinstance(v, bool)]
        if (
            len(value) > 2
            and len(whole) == len(value)
            and whole == list(range(whole[0], whole[0] + len(whole)))
        ):
            return f"{whole[0]}–{whole[-1]}"
        return "[" + ", ".join(_cell(v) for v in value) + "]"
    return str(value)


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    """A Markdown table, then a blank line."""
    return [
        "| " + " | ".join(header) + " |",
        "|" + "---|" * len(header),
        *("| " + " | ".join(row) + " |" for row in rows),
        "",
    ]


def _is_records(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(isinstance(v, dict) for v in value)


def measured_tables(measured: dict[str, Any]) -> list[str]:
    """A claim's other measured numbers as small tables, every value shown (nothing elided):

    - the single values (and lists of values) in one `number | value` table;
    - mappings of values (e.g. per N, per metric) one row each, those with the same keys in one
      table whose columns are the keys;
    - a mapping of mappings (pruning's ΔPPL per retention and order) as its own table, a list
      of records (the costliest lone heads) as its own table;
    - a mapping holding mappings among its values (the task's numbers) as its own block.

    Args:
        measured: The numbers, `{name: value}`.

    Returns:
        Markdown lines (tables, each followed by a blank line).
    """
    single: list[list[str]] = []
    grouped: dict[tuple[str, ...], list[list[str]]] = {}
    after: list[str] = []
    for name, value in measured.items():
        if not isinstance(value, dict) and not _is_records(value):
            single.append([f"`{name}`", _cell(value)])
        elif _is_records(value):
            keys = list(dict.fromkeys(k for record in value for k in record))
            rows = [[str(i + 1), *(_cell(r.get(k)) for k in keys)] for i, r in enumerate(value)]
            after += _table([f"`{name}`", *keys], rows)
        elif all(isinstance(v, dict) for v in value.values()) and value:
            inner = list(dict.fromkeys(k for v in value.values() for k in v))
            rows = [[str(k), *(_cell(v.get(c)) for c in inner)] for k, v in value.items()]
            after += _table([f"`{name}`", *inner], rows)
        elif any(isinstance(v, dict) or _is_records(v) for v in value.values()):
            after += [f"`{name}`:", "", *measured_tables(value)]
        else:
            grouped.setdefault(tuple(str(k) for k in value), []).append(
                [f"`{name}`", *(_cell(v) for v in value.values())]
            )
    lines = _table(["number", "value"], single) if single else []
    for keys, rows in grouped.items():
        lines += _table(["number", *keys], rows)
    return lines + after


def build_report(job: Job, summary: dict[str, Any], figures: dict[str, list[Path]]) -> str:
    """REPORT.md: the claims table, the provenance block, each claim's criterion and other
    numbers (nested ones as small tables), every figure with its caption and a reading from
    the numbers, and a glossary of the checks' keys in summary.json.

    Args:
        job: The job (its configuration, corpus size and step timings).
        summary: Its `summary.json` content.
        figures: The figures written, `{name: [png, pdf]}`, in the order they are shown.

    Returns:
        The report's Markdown.
    """
    from cw_lens.reproduction.provenance import causal_sample_markdown, provenance_markdown
    from cw_lens.reproduction.state import claim_documents

    lines = [
        f"# cw_lens report — {summary['model']}",
        "",
        f"Corpus `{summary['corpus']}`: {summary['n_documents']} documents, "
        f"{summary['n_tokens']} tokens (BOS `{summary['bos_token']}` prepended; it is the sink "
        f"at position 0); seed {summary['seed']}. Versions: "
        + ", ".join(f"{k} {v}" for k, v in summary["versions"].items())
        + ".",
        "",
        *provenance_markdown(summary.get("provenance")),
        *causal_sample_markdown(summary.get("causal_sample")),
        "## Claims",
        "",
        f"Each number with its {_interval_words(summary)}; verdict `yes` when the number and its "
        "whole interval satisfy the criterion, `no` when they all fail it, `inconclusive` when "
        "the interval straddles the threshold (or a number has no interval, or its interval's "
        "coverage is not certified at this run's size: docs/coverage.md), `not measured` when "
        "the run could not compute a number (docs/methods.md#claims). Each number has a plain "
        "name here; the glossary at the end gives its key in summary.json.",
        "",
        claims_markdown(summary),
        "",
        *bias_note(summary),
        *size_limits(job.config, summary, claim_documents(job, summary["claims"])),
        "## Criteria and the other measured numbers",
        "",
        *criteria_sections(summary),
    ]
    if summary.get("steps_not_run"):
        lines += [
            "Steps not run (--steps/--skip), so their claims and figures are not measured: "
            + ", ".join(summary["steps_not_run"])
            + ".",
            "",
        ]
    lines += ["## Figures", ""]
    # the one-line readings quote numbers of every claim: written for a complete run
    readings = {} if summary.get("steps_not_run") else figure_readings(summary)
    for name, paths in figures.items():
        png = paths[0].name
        caption = FIGURE_CAPTIONS.get(name, "")
        lines += [f"### {name}", "", f"![{name}]({png})", ""]
        lines += [f"*{caption}*", ""] if caption else []
        lines += [readings[name], ""] if readings.get(name) else []
    if job.timings:
        lines += [
            "## Run",
            "",
            "Step timings (s, when each step was computed): "
            + ", ".join(f"{k} {v:.1f}" for k, v in job.timings.items()),
            "",
        ]
        if len(CORPUS_STEP_NAMES & set(job.timings)) > 1:
            lines += [SHARED_PASS_NOTE, ""]
    return "\n".join(lines + glossary(summary))


CORPUS_STEP_NAMES = {"sinks", "ablation", "selection", "taxonomy"}
# how the corpus steps' times are split when one pass computes them
# (`reproduction.steps.corpus_pass`)
SHARED_PASS_NOTE = (
    "The corpus steps (sinks, ablation, selection, taxonomy) are computed together, in one "
    "pass over the corpus: each is charged its own accumulator's time and result's time plus "
    "an equal share of the forward passes, so their times add up to the pass."
)


def criteria_sections(summary: dict[str, Any]) -> list[str]:
    """REPORT.md's section per claim: its criterion, its verdict and every other measured
    number, in small tables (`measured_tables`): nothing is elided.

    Args:
        summary: A run's `summary.json` content.

    Returns:
        Markdown lines: per claim, in the summary's order, a `### claim` heading, a line with
        its criterion and verdict, and the tables of its other numbers.
    """
    lines = []
    for cid, claim in summary["claims"].items():
        numbers = {c["number"] for c in claim.get("checks", [])}
        other = {k: v for k, v in claim["measured"].items() if k not in numbers}
        lines += [
            f"### `{cid}`",
            "",
            f"Criterion: {claim.get('criterion', '')}. Verdict: {claim['holds']}.",
            "",
            *(measured_tables(other) if other else ["Nothing else measured.", ""]),
        ]
    return lines


def glossary(summary: dict[str, Any]) -> list[str]:
    """REPORT.md's last section: each check's plain name (`number_name`) and its key in
    summary.json, with its claim (none when the run has no checks).

    Args:
        summary: A run's `summary.json` content.

    Returns:
        Markdown lines: a heading, a sentence and a table, one row per check.
    """
    rows = [
        [number_name(c["number"]), f"`{c['number']}`", f"`{cid}`"]
        for cid, claim in summary["claims"].items()
        for c in claim.get("checks", [])
    ]
    if not rows:
        return []
    return [
        "## Glossary",
        "",
        "The checks' names in this report and their keys in summary.json "
        "(`claims.<claim>.checks[].number`; their criteria: docs/methods.md#criteria).",
        "",
        *_table(["name in this report", "key in summary.json", "claim"], rows),
    ]


def size_limits(config: JobConfig, summary: dict[str, Any], documents: dict[str, int]) -> list[str]:
    """REPORT.md lines on the verdicts a run of this size cannot settle (none: no lines):
    intervals not shown to cover at the claims' document counts (`documents`;
    `interval_coverage`), pruning (when it ran) with too few random orders."""
    from cw_lens.analyses.pruning import MIN_RANDOM_DRAWS
    from cw_lens.reproduction.interval_coverage import coverage_limits

    limits = coverage_limits(summary, documents, name=number_name)
    if "pruning_signal" in summary["claims"] and config.pruning_draws < MIN_RANDOM_DRAWS:
        limits.append(
            f"- `pruning_signal`: {config.pruning_draws} random orders, fewer than the "
            f"{MIN_RANDOM_DRAWS} its verdict compares with: the control's spread is not known, "
            "so the verdict is `inconclusive` whatever the numbers."
        )
    if not limits:
        return []
    return ["What this run's size cannot settle:", "", *limits, ""]


def _interval_words(summary: dict[str, Any]) -> str:
    boot = summary.get("bootstrap")
    if not boot:
        return "interval (none computed)"
    return (
        f"{boot['level']:.0%} bootstrap interval over {boot['unit']}s ({boot['resamples']} "
        f"resamples, bootstrap seed {boot['seed']}, its own: the run's seed "
        f"{summary.get('seed')} does not set it; {boot['method'].split(';')[0]})"
    )


def _interval_text(interval: Any) -> str:
    if interval is None:
        return "no interval"
    low, high = interval
    if low is None or high is None:
        return "[n/a]"
    return f"[{low:.3g}, {high:.3g}]"


VERDICT_MARK = {
    "yes": "yes",
    "no": "**no**",
    "inconclusive": "*inconclusive*",
    "not measured": "*not measured*",
}


def claims_markdown(summary: dict[str, Any]) -> str:
    """The claims table of a schema-2 summary as Markdown (REPORT.md and the docs):
    per claim the paper's statement, the criterion's checks — each number with its interval
    and threshold — and the verdict."""
    lines = [
        "| claim | paper says | number = value [interval] (criterion) | verdict |",
        "|---|---|---|---|",
    ]
    for cid, claim in summary["claims"].items():
        checks = "<br>".join(
            f"{number_name(c['number'])} = {compact_text(c['value'])} "
            f"{_interval_text(c.get('interval'))}{_corrected_mark(c)} "
            f"({_check_text(c)}: {c['holds']}"
            + (f"; {plain_reason(c['undecided_because'])}" if c.get("undecided_because") else "")
            + ")"
            for c in claim.get("checks", [])
        )
        mark = VERDICT_MARK.get(claim["holds"], str(claim["holds"]))
        lines.append(f"| `{cid}` | {claim['paper']} | {checks} | {mark} |")
    return "\n".join(lines)


_OLD_COVERAGE = re.compile(
    r"its interval covers (?P<coverage>[\d.]+) \(lower 95% bound (?P<bound>[\d.]+)\) at "
    r"(?P<n>\d+) documents(?P<between>, the largest count studied up to this run's \d+)?"
)


def plain_reason(reason: str) -> str:
    """A check's `undecided_because` as the report writes it: a summary written before 0.4.1
    said "its interval covers 0.932 (lower 95% bound 0.908) at 256 documents", which reads as
    if the interval contained 0.932; it is the interval's coverage (`coverage_text`'s words).

    Args:
        reason: The check's `undecided_because`.

    Returns:
        The reason, its coverage in today's words.

    Examples:
        >>> plain_reason("its interval covers 0.932 (lower 95% bound 0.908) at 256 documents")
        'its interval has coverage 0.932 at this size (256 documents; lower 95% bound 0.908)'
    """

    def words(match: re.Match[str]) -> str:
        coverage, bound, n = match["coverage"], match["bound"], match["n"]
        if match["between"]:
            return (
                f"its interval has coverage {coverage} at {n} documents{match['between']} "
                f"(lower 95% bound {bound})"
            )
        return (
            f"its interval has coverage {coverage} at this size ({n} documents; lower 95% "
            f"bound {bound})"
        )

    return _OLD_COVERAGE.sub(words, reason)


BIAS_MARK = "†"  # after an interval that is bias-corrected (`interval_method`)
FLAG_MARK = "‡"  # after an interval whose number's bootstrap |bias| / SE is over the limit


def _bias_mark(check: dict[str, Any]) -> str | None:
    """`BIAS_MARK` for a bias-corrected interval, `FLAG_MARK` for another whose bootstrap
    bias/SE exceeds the limit, None otherwise (and for a summary written before checks
    recorded their interval method)."""
    if check.get("interval_method") == "bias_corrected":
        return BIAS_MARK
    if check.get("interval_method") is not None and bias_flagged(check.get("bias_to_se")):
        return FLAG_MARK
    return None


def _corrected_mark(check: dict[str, Any]) -> str:
    """` †` or ` ‡` (`_bias_mark`) with the number's bootstrap bias/SE; empty without a
    mark."""
    mark = _bias_mark(check)
    if mark is None:
        return ""
    ratio = check.get("bias_to_se")
    return f" {mark}" + ("" if ratio is None else f" bias/SE {ratio:.2f}")


def bias_note(summary: dict[str, Any]) -> list[str]:
    """The lines under the claims table that explain its bias marks (none: no line).

    Args:
        summary: A run's `summary.json` content.

    Returns:
        The notes and a blank line, or nothing when no check's interval carries a mark.
    """
    checks = [c for claim in summary["claims"].values() for c in claim.get("checks", [])]
    marks = {_bias_mark(c) for c in checks}
    lines = []
    if BIAS_MARK in marks:
        lines.append(
            f"{BIAS_MARK} bias-corrected interval (the expanded one shifted by twice the "
            "bootstrap bias, `t* - 2b`): the number's plug-in is known to be biased on few "
            "documents (a geometric mean over heads)."
        )
    if FLAG_MARK in marks:
        lines.append(
            f"{FLAG_MARK} the number's bootstrap |bias| / SE exceeds {BIAS_SE_LIMIT:g} in this "
            "run. Its interval stays the expanded one: on the population of windows, the "
            "bias-corrected interval covered these numbers less often (docs/coverage.md)."
        )
    if not lines:
        return []
    lines.append("summary.json records each interval's `bias_to_se` and `interval_method`.")
    return [" ".join(lines), ""]


def _check_text(check: dict[str, Any]) -> str:
    if check["op"] == "in":
        low, high = check["threshold"]
        return f"in [{low:g}, {high:g}]"
    return f"{check['op']} {check['threshold']:g}"


def claims_table(summary: dict[str, Any]) -> pd.DataFrame:
    """The claims of a summary as a table (paper, holds: "yes" / "no" / "inconclusive" / "not
    measured",
    figure)."""
    rows = [
        {"claim": cid, "holds": c["holds"], "paper": c["paper"], "figure": c["figure"]}
        for cid, c in summary["claims"].items()
    ]
    return pd.DataFrame(rows)
