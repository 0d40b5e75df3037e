"""What REPORT.md says about each figure: its caption and a reading from the run's numbers.

`FIGURE_CAPTIONS` says what each figure of the main job shows, one sentence each;
`figure_readings` writes one line per figure from `summary.json`'s measured numbers, with
`compact_text`, the report's compact text for a value. `cw_lens.reproduction.markdown.build_report`
puts both under each figure.
"""

from __future__ import annotations

from typing import Any


def compact_text(value: Any, depth: int = 0) -> str:
    """Compact text for the report: floats to 3 significant digits, at most 7 entries of a
    dict and 8 of a list, nested dicts as `{...}`.

    Args:
        value: A number, dict, list or anything with a `str`.
        depth: How deep inside a dict or list `value` is (nested dicts are cut at 1).

    Returns:
        The text.
    """
    if isinstance(value, float):
        return f"{value:.3g}"
    if isinstance(value, dict):
        if depth >= 1:
            return "{...}"
        inner = ", ".join(f"{k}: {compact_text(v, depth + 1)}" for k, v in list(value.items())[:7])
        return "{" + inner + "}"
    if isinstance(value, list):
        return "[" + ", ".join(compact_text(v, depth + 1) for v in value[:8]) + "]"
    return str(value)


def _random_draws_text(spread: dict[str, dict[str, float]] | None) -> str:
    comp = (spread or {}).get("comprehensiveness_pairs")
    if comp is None:
        return ""
    return (
        f" Random control over {int(comp['n_draws'])} draws (comprehensiveness, pairs): AOPC "
        f"mean {compact_text(comp['mean'])}, sd {compact_text(comp['sd'])}, range "
        f"[{compact_text(comp['min'])}, {compact_text(comp['max'])}]."
    )


# the input-level deletion figures' curves
_INPUT_CURVES = (
    "comprehensiveness (most important first, left) and sufficiency (least important first, "
    "right), against random rankings and the recency baseline."
)

# What each figure of the main job shows, one sentence each (REPORT.md's captions); the
# readings below it (`figure_readings`) say what the run's numbers are.
FIGURE_CAPTIONS = {
    "contribution_heatmap_1": (
        "Attention (left) and intra-head contribution weight (right), a row per query and a "
        "column per key, of the sink head whose attention to the sink exceeds the sink's "
        "contribution the most, on the first 31 tokens of the corpus's first window."
    ),
    "contribution_heatmap_2": (
        "The same for the sink head with the next largest excess at least four layers away."
    ),
    "sink_attention_vs_contribution": (
        "Per layer, the mean attention to the sink and the sink's mean intra-head contribution "
        "over queries 16 and later, over all heads (lines) and over the sink heads (squares)."
    ),
    "sink_value_geometry": (
        "Sink heads against the other heads: the value-norm ratio of the other tokens over the "
        "sink (log10, dashed at 3x and 10x), the cosine of the sink's value with each tail "
        "token's, and its cosine with each query's tail mixture."
    ),
    "sink_contribution_drivers": (
        "The mean of each factor of the contribution (attention, relative norm, cosine) for the "
        "sink and for the tail in sink heads (left), and the median over sink heads of each "
        "factor's |Spearman rho| with the contribution (right)."
    ),
    "convex_sink_curve": (
        "The output norm of some sink heads as their sink rate s goes from 0 to 1 (left), and "
        "where each query's output norm is smallest, s*, over the sink heads' queries (right)."
    ),
    "sink_cancels_drift": (
        "Over sink heads, the median cosine of the sink's term with the drift of the weakly "
        "attended tokens (left) and the median share of that drift the sink cancels (right)."
    ),
    "sink_ablation_cone": (
        "The cone alignment (left) and the output norm (right) of the low-norm heads and the "
        "other heads, before and after the sink's norm is removed, with the perplexity change."
    ),
    "faithfulness_order": (
        "The NLL change as more (query, key) pairs are removed, ranked by each metric: "
        "comprehensiveness, most important first (left), and sufficiency, least important "
        "first (right), against a random ranking."
    ),
    "faithfulness_task": (
        "The same curves on the task items, as the drop of the answer's log-probability."
    ),
    "topn_beats_random": (
        "The mean F_N over heads of the top-N keys by attention and of N random keys, with "
        "their spread (left), and the ratio of the two (right), for N from 1 to 128."
    ),
    "sink_lowers_fn": (
        "The mean F_N over heads of top-N selections with the sink allowed and excluded "
        "(left), and per head F_N without the sink over F_N with it: median, ratio of means "
        "and share of heads at 2x or more (right)."
    ),
    "retriever_share": (
        "Per layer, the share of heads in each regime, Retriever, Mixer or Reset (left), and "
        "the share of queries whose winner is the current token, the sink or another (right)."
    ),
    "pruning_signal": (
        "The perplexity rise as heads are removed in each layer in taxonomy, magnitude, "
        "entropy and random order, down to 25% of the heads kept (left), and the heads whose "
        "removal alone costs the most (right)."
    ),
    "pruning_signal_global": (
        "The same with one global ranking of all heads instead of one ranking per layer."
    ),
    "contribution_vs_field_pairs": (
        "The pair-level test with other tools' metrics beside P1's: the NLL change as more "
        "(query, key) pairs are removed, ranked by each metric (ALTI-style L1 proximity and "
        "attribution patching among them), comprehensiveness (left) and sufficiency (right)."
    ),
    "contribution_vs_field_inputs_ioi": (
        "The input-level deletion test on IOI items: the drop of the answer's log-probability "
        f"as more input tokens are removed, ranked by each method, {_INPUT_CURVES}"
    ),
    "contribution_vs_field_inputs_arithmetic": (
        "The same on arithmetic word problems (the answer is the number that ends the equation)."
    ),
    "per_layer_intervals": (
        "Each claim about layers, layer by layer: the layer's number (dot), its bootstrap "
        "interval over documents (bar) and the criterion's threshold (dashed)."
    ),
}


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
    task = next((v for k, v in c["faithfulness_order"].items() if k.startswith("task_")), None)
    return {
        "sink_attention_vs_contribution": (
            f"Over {sink['n_sink_heads']} sink heads the sink takes "
            f"{compact_text(sink['mean_sink_attention'])} of the attention and contributes "
            f"{compact_text(sink['mean_sink_contribution_intra'])} of the head output (ratio "
            f"{compact_text(sink['contribution_over_attention'])}): the claim "
            f"{held['sink_attention_vs_contribution']}."
        ),
        "sink_value_geometry": (
            f"Median norm ratio ||pv_j||/||pv_0|| over sink heads "
            f"{compact_text(ratio['median_ratio_sink_heads'])}; median cos(pv_0, m_i) "
            f"{compact_text(anti['median_cos_sink_tail_mixture'])}."
        ),
        "sink_contribution_drivers": (
            "Median over sink heads of |Spearman rho| of each factor with the sink's "
            f"contribution: {compact_text(c['sink_contribution_drivers']['median_abs_rho_sink'])}; "
            f"the claim {held['sink_contribution_drivers']}."
        ),
        "convex_sink_curve": (
            f"{compact_text(convex['share_judged_sink_heads_interior_median_s_star'])} of the "
            f"{convex['n_sink_heads_judged']} sink heads with at least 16 counted queries have an "
            "interior median s* (median of medians "
            f"{compact_text(convex['median_of_median_s_star'])})."
        ),
        "sink_cancels_drift": (
            f"The sink term opposes the weak-token drift in "
            f"{compact_text(drift['share_sink_heads_negative_cosine'])} of sink heads; median "
            f"cancelled share {compact_text(drift['median_cancelled_share'])}."
        ),
        "sink_ablation_cone": (
            "Removing the sink: low-norm heads' cone alignment "
            f"{compact_text(cone['low_norm_cone_before'])} -> "
            f"{compact_text(cone['low_norm_cone_after'])}, others "
            f"{compact_text(cone['other_cone_before'])} -> "
            f"{compact_text(cone['other_cone_after'])}; PPL "
            f"{compact_text(cone['clean_ppl'])} -> {compact_text(cone['patched_ppl'])}."
        ),
        "faithfulness_order": (
            f"Comprehensiveness AOPC (mean NLL change, pairs): {compact_text(comp)}; most "
            f"faithful: {best}; P1's full ordering {held['faithfulness_order']}."
            + _random_draws_text(c["faithfulness_order"].get("random_aopc_over_draws"))
        ),
        "faithfulness_task": (
            f"Comprehensiveness AOPC (answer log-probability change, pairs) on "
            f"{task.get('n_items')} task items: "
            f"{compact_text(task.get('aopc_comprehensiveness_pairs'))}."
            if isinstance(task, dict)
            else ""
        ),
        "topn_beats_random": (
            f"F_N of top-N over random: {compact_text(topn.get('top_over_random', {}))}; the "
            f"largest gap is at N = {topn.get('n_with_largest_gap')}."
        ),
        "sink_lowers_fn": (
            "Median over heads of F_N without the sink / F_N with it: "
            f"{compact_text(sink_fn['median_head_ratio'])}; share of heads at >= 2x (N = 2, 4): "
            f"{compact_text(sink_fn['share_heads_at_least_2x'])}."
        ),
        "retriever_share": (
            f"Regime shares {compact_text(tax['regime_shares'])}; Retrievers "
            f"{compact_text(tax['retriever_share'])} of heads."
        ),
        "pruning_signal": (
            "ΔPPL per order and retention, the same share of heads removed in every layer "
            f"(the methods page's reading); the claim {held['pruning_signal']}."
        ),
    }
