"""REPORT.md: the claims table with verdicts and intervals, and what each figure shows, from
`summary.json`.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import pandas as pd

from cw_lens.core.bootstrap import BIAS_SE_LIMIT, bias_flagged

if TYPE_CHECKING:
    from cw_lens.reporting.state import Job, JobConfig


def _fmt(value: Any, depth: int = 0) -> str:
    """Compact text for the report: floats to 3 digits, dicts shortened."""
    if isinstance(value, float):
        return f"{value:.3g}"
    if isinstance(value, dict):
        if depth >= 1:
            return "{...}"
        inner = ", ".join(f"{k}: {_fmt(v, depth + 1)}" for k, v in list(value.items())[:7])
        return "{" + inner + "}"
    if isinstance(value, list):
        return "[" + ", ".join(_fmt(v, depth + 1) for v in value[:8]) + "]"
    return str(value)


def build_report(job: Job, summary: dict[str, Any], figures: dict[str, list[Path]]) -> str:
    """REPORT.md: the claims table, the provenance block and every figure with a one-line
    reading."""
    from cw_lens.reporting.provenance import causal_sample_markdown, provenance_markdown
    from cw_lens.reporting.state import claim_documents

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
        "the interval straddles the threshold (or a number has no interval, or its interval "
        "was measured to cover less than 0.93 at this run's size: docs/coverage.md), "
        "`not measured` when the run could not compute a number (docs/methods.md#claims).",
        "",
        claims_markdown(summary),
        "",
        *bias_note(summary),
        *size_limits(job.config, summary, claim_documents(job, summary["claims"])),
        "Criteria (docs/methods.md#claims) and the other measured numbers:",
        "",
        *criteria_lines(summary),
    ]
    if summary.get("steps_not_run"):
        lines += [
            "",
            "Steps not run (--steps/--skip), so their claims and figures are not measured: "
            + ", ".join(summary["steps_not_run"])
            + ".",
        ]
    lines += ["", "## Figures", ""]
    # the one-line readings quote numbers of every claim: written for a complete run
    readings = {} if summary.get("steps_not_run") else figure_readings(summary)
    for name, paths in figures.items():
        png = paths[0].name
        lines += [f"### {name}", "", f"![{name}]({png})", "", readings.get(name, ""), ""]
    if job.timings:
        lines += [
            "## Run",
            "",
            "Step timings (s, when each step was computed): "
            + ", ".join(f"{k} {v:.1f}" for k, v in job.timings.items()),
            "",
        ]
    return "\n".join(lines)


MEASURED_CHARS = 600  # the most characters of other measured numbers a claim's line shows


def criteria_lines(summary: dict[str, Any]) -> list[str]:
    """REPORT.md's line per claim: its criterion, its verdict and the other measured numbers.

    The other numbers are whole `name = value` items, at most `MEASURED_CHARS` characters of
    them, then the names of those left out (their values are in `summary.json`): an item is
    never cut off.

    Args:
        summary: A run's `summary.json` content.

    Returns:
        One Markdown list item per claim, in the summary's order.
    """
    lines = []
    for cid, claim in summary["claims"].items():
        numbers = {c["number"] for c in claim.get("checks", [])}
        items = [(k, f"{k} = {_fmt(v)}") for k, v in claim["measured"].items() if k not in numbers]
        shown: list[str] = []
        for _, item in items:
            if len("; ".join([*shown, item])) > MEASURED_CHARS:
                break
            shown.append(item)
        other = "; ".join(shown)
        left_out = [k for k, _ in items[len(shown) :]]
        if left_out:
            other += "; more in summary.json: " + ", ".join(left_out)
        lines.append(
            f"- `{cid}`: {claim.get('criterion', '')}. Verdict: {claim['holds']}. "
            f"Also measured: {other or 'nothing else'}."
        )
    return lines


def size_limits(config: JobConfig, summary: dict[str, Any], documents: dict[str, int]) -> list[str]:
    """REPORT.md lines on the verdicts a run of this size cannot settle (none: no lines):
    intervals not shown to cover at the claims' document counts (`documents`;
    `interval_coverage`), pruning with too few random orders."""
    from cw_lens.analyses.pruning import MIN_RANDOM_DRAWS
    from cw_lens.reporting.interval_coverage import coverage_limits

    limits = coverage_limits(summary, documents)
    if config.pruning_draws < MIN_RANDOM_DRAWS:
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
            f"{c['number']} = {_fmt(c['value'])} {_interval_text(c.get('interval'))}"
            f"{_corrected_mark(c)} ({_check_text(c)}: {c['holds']}"
            + (f"; {c['undecided_because']}" if c.get("undecided_because") else "")
            + ")"
            for c in claim.get("checks", [])
        )
        mark = VERDICT_MARK.get(claim["holds"], str(claim["holds"]))
        lines.append(f"| `{cid}` | {claim['paper']} | {checks} | {mark} |")
    return "\n".join(lines)


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


def _random_draws_text(spread: dict[str, dict[str, float]] | None) -> str:
    comp = (spread or {}).get("comprehensiveness_pairs")
    if comp is None:
        return ""
    return (
        f" Random control over {int(comp['n_draws'])} draws (comprehensiveness, pairs): AOPC "
        f"mean {_fmt(comp['mean'])}, sd {_fmt(comp['sd'])}, range "
        f"[{_fmt(comp['min'])}, {_fmt(comp['max'])}]."
    )


def figure_readings(summary: dict[str, Any]) -> dict[str, str]:
    """One line per figure, written from the measured numbers."""
    # Long: one sentence per figure read from summary.json, a table of f-strings.
    c = {cid: claim["measured"] for cid, claim in summary["claims"].items()}
    words = {
        "yes": "holds",
        "no": "does not hold",
        "inconclusive": "is inconclusive",
        "not measured": "could not be measured",
    }
    held = {cid: words[claim["holds"]] for cid, claim in summary["claims"].items()}
    sink = c["sink_attention_vs_contribution"]
    ratio = c["sink_value_norm_ratio"]
    anti = c["sink_anti_alignment"]
    convex = c["convex_sink_curve"]
    drift = c["sink_cancels_drift"]
    cone = c["sink_ablation_cone"]
    comp = c["faithfulness_order"].get("aopc_comprehensiveness_pairs", {})
    best = max(comp, key=lambda k: comp[k] if comp[k] is not None else -1) if comp else "?"
    topn = c["topn_beats_random"]
    sink_fn = c["sink_lowers_fn"]
    tax = c["retriever_share"]
    heat = (
        "Attention (left) versus intra-head contribution weights (right) of a strong sink "
        "head on one text (P1, Fig. 1)."
    )
    return {
        "contribution_heatmap_1": heat,
        "contribution_heatmap_2": heat,
        "sink_attention_vs_contribution": (
            f"Over {sink['n_sink_heads']} sink heads the sink takes "
            f"{_fmt(sink['mean_sink_attention'])} of the attention and contributes "
            f"{_fmt(sink['mean_sink_contribution_intra'])} of the head output (ratio "
            f"{_fmt(sink['contribution_over_attention'])}): the claim "
            f"{held['sink_attention_vs_contribution']}."
        ),
        "sink_value_geometry": (
            f"Median norm ratio ||pv_j||/||pv_0|| over sink heads "
            f"{_fmt(ratio['median_ratio_sink_heads'])}; median cos(pv_0, m_i) "
            f"{_fmt(anti['median_cos_sink_tail_mixture'])}."
        ),
        "sink_contribution_drivers": (
            "Median over sink heads of |Spearman rho| of each factor with the sink's "
            f"contribution: {_fmt(c['sink_contribution_drivers']['median_abs_rho_sink'])}; "
            f"the claim {held['sink_contribution_drivers']}."
        ),
        "convex_sink_curve": (
            f"{_fmt(convex['share_judged_sink_heads_interior_median_s_star'])} of the "
            f"{convex['n_sink_heads_judged']} sink heads with at least 16 counted queries have an "
            f"interior median s* (median of medians {_fmt(convex['median_of_median_s_star'])})."
        ),
        "sink_cancels_drift": (
            f"The sink term opposes the weak-token drift in "
            f"{_fmt(drift['share_sink_heads_negative_cosine'])} of sink heads; median cancelled "
            f"share {_fmt(drift['median_cancelled_share'])}."
        ),
        "sink_ablation_cone": (
            "Removing the sink: low-norm heads' cone alignment "
            f"{_fmt(cone['low_norm_cone_before'])} -> {_fmt(cone['low_norm_cone_after'])}, others "
            f"{_fmt(cone['other_cone_before'])} -> {_fmt(cone['other_cone_after'])}; PPL "
            f"{_fmt(cone['clean_ppl'])} -> {_fmt(cone['patched_ppl'])}."
        ),
        "faithfulness_order": (
            f"Comprehensiveness AOPC (mean NLL change, pairs): {_fmt(comp)}; most faithful: "
            f"{best}; P1's full ordering {held['faithfulness_order']}."
            + _random_draws_text(c["faithfulness_order"].get("random_aopc_over_draws"))
        ),
        "faithfulness_task": "Faithfulness on the task items: drop of the answer log-probability.",
        "topn_beats_random": (
            f"F_N of top-N over random: {_fmt(topn.get('top_over_random', {}))}; the largest gap "
            f"is at N = {topn.get('n_with_largest_gap')}."
        ),
        "sink_lowers_fn": (
            "Median over heads of F_N without the sink / F_N with it: "
            f"{_fmt(sink_fn['median_head_ratio'])}; share of heads at >= 2x (N = 2, 4): "
            f"{_fmt(sink_fn['share_heads_at_least_2x'])}."
        ),
        "retriever_share": (
            f"Regime shares {_fmt(tax['regime_shares'])}; Retrievers "
            f"{_fmt(tax['retriever_share'])} of heads."
        ),
        "pruning_signal": (
            "ΔPPL per order and retention, the same share of heads removed in every layer "
            f"(the methods page's reading); the claim {held['pruning_signal']}."
        ),
        "pruning_signal_global": "The variant: one global ranking of all heads.",
        "per_layer_intervals": (
            "The claims about layers, layer by layer: each layer's number (dot) with its "
            "bootstrap interval over documents (bar) and the criterion's threshold (dashed)."
        ),
    }


def claims_table(summary: dict[str, Any]) -> pd.DataFrame:
    """The claims of a summary as a table (paper, holds: "yes" / "no" / "inconclusive" / "not
    measured",
    figure)."""
    rows = [
        {"claim": cid, "holds": c["holds"], "paper": c["paper"], "figure": c["figure"]}
        for cid, c in summary["claims"].items()
    ]
    return pd.DataFrame(rows)
