"""Figures of P2's selection geometry, head taxonomy and head pruning. Plotting only: each function
reads the tables a result already computed and returns a `matplotlib.figure.Figure`; each is
named after the claim it illustrates (docs/methods.md#claims).
"""

from __future__ import annotations

from typing import Any

from matplotlib.ticker import MaxNLocator

from cw_lens.plots.style import literal_text, plt

RULE_STYLE = {
    "top": {"color": "C0", "label": "top-N by attention"},
    "random": {"color": "0.45", "label": "random N (baseline)", "linestyle": "--"},
    "top_no_sink": {"color": "C3", "label": "top-N, sink excluded"},
}
REGIME_COLORS = {"Retriever": "C2", "Mixer": "C1", "Reset": "C4"}
ORDER_COLORS = {"taxonomy": "C0", "magnitude": "C1", "entropy": "C2", "random": "0.4"}


def _log2_n_axis(ax: Any, n_grid: list[int]) -> None:
    ax.set_xscale("log", base=2)
    ax.set_xticks(n_grid, [str(n) for n in n_grid])
    ax.set_xlabel("N (selected keys)")


def _f_curves(ax: Any, result: Any, rules: tuple[str, ...], metric: str = "f") -> None:
    means = result.f_by_n(metric)
    spread = result.head_quantiles(metric=metric)
    for rule in rules:
        if rule not in means:
            continue
        style = RULE_STYLE[rule]
        ax.plot(means.index, means[rule], marker="o", **style)
        band = spread[spread["rule"] == rule]
        ax.fill_between(band["n"], band["q25"], band["q75"], color=style["color"], alpha=0.15)
    _log2_n_axis(ax, result.n_grid)
    ax.set_ylim(0, 1.02)
    ax.set_ylabel(f"mean {'F_N' if metric == 'f' else metric} over heads")
    ax.grid(alpha=0.3)


def plot_topn_beats_random(result: Any, *, figsize: tuple = (10, 4)) -> Any:
    """Claim `topn_beats_random` (P2): F_N of top-N selections against random N-sets, mean over
    heads with the interquartile range over heads shaded; right: the ratio top / random."""
    fig, axes = plt.subplots(1, 2, figsize=figsize, constrained_layout=True)
    _f_curves(axes[0], result, ("top", "random"))
    axes[0].set_title(f"Selection separability ({result.query} query, {result.n_documents} docs)")
    axes[0].legend(fontsize=8)
    table = result.f_by_n()
    if "top_over_random" in table:
        axes[1].plot(table.index, table["top_over_random"], marker="o", color="C0")
    axes[1].axhline(1.0, color="0.5", linewidth=0.8)
    _log2_n_axis(axes[1], result.n_grid)
    axes[1].set_ylabel("F_N(top) / F_N(random)")
    axes[1].set_title("Advantage of top-N over random")
    axes[1].grid(alpha=0.3)
    return literal_text(fig)


def plot_sink_lowers_fn(result: Any, *, figsize: tuple = (10, 4)) -> Any:
    """Claim `sink_lowers_fn` (P2): F_N with the sink among the candidates against F_N with
    the sink excluded; right: the median per-head ratio F(no sink) / F(with sink) (the claim's
    number), the ratio of the means, and the share of heads whose ratio is at least 2."""
    fig, axes = plt.subplots(1, 2, figsize=figsize, constrained_layout=True)
    _f_curves(axes[0], result, ("top", "top_no_sink"))
    axes[0].set_title(f"Sink effect on F_N (sink positions {list(result.sink_positions)})")
    axes[0].legend(fontsize=8)
    effect = result.sink_effect()
    axes[1].plot(
        effect.index, effect["median_head_ratio"], marker="o", color="C3", label="median per head"
    )
    axes[1].plot(
        effect.index,
        effect["ratio"],
        marker="s",
        color="C3",
        alpha=0.5,
        linestyle=":",
        label="ratio of means",
    )
    axes[1].axhline(1.0, color="0.5", linewidth=0.8)
    axes[1].set_ylabel("F_N(no sink) / F_N(with sink)")
    share = axes[1].twinx()
    share.bar(
        effect.index,
        effect["share_heads_at_least_2x"],
        width=[0.3 * n for n in effect.index],
        color="C3",
        alpha=0.15,
    )
    share.set_ylim(0, 1)
    share.set_ylabel("share of heads at >= 2x (bars)")
    _log2_n_axis(axes[1], result.n_grid)
    axes[1].legend(fontsize=8, loc="upper left")
    axes[1].set_title("Excluding the sink")
    return literal_text(fig)


def plot_retriever_share(result: Any, *, figsize: tuple = (11, 4)) -> Any:
    """Claim `retriever_share` (P2): regimes over depth — the share of Retriever, Mixer and
    Reset heads per layer (stacked) — and the mean winner-category shares per layer."""
    table = result.shares_by_layer()
    overall = result.regime_shares()
    fig, axes = plt.subplots(1, 2, figsize=figsize, constrained_layout=True)
    bottom = None
    for regime, color in REGIME_COLORS.items():
        label = f"{regime} ({100 * overall[regime]:.1f}% of heads)"
        axes[0].bar(table.index, table[regime], bottom=bottom, color=color, label=label)
        bottom = table[regime] if bottom is None else bottom + table[regime]
    axes[0].set_xlabel("layer")
    axes[0].set_ylabel("share of heads")
    axes[0].set_ylim(0, 1)
    axes[0].set_title("Head regimes by layer (source winner)")
    axes[0].legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=3)
    for category, regime in zip(("current", "sink", "other"), REGIME_COLORS, strict=True):
        axes[1].plot(
            table.index,
            table[f"share_{category}"],
            marker=".",
            color=REGIME_COLORS[regime],
            label=f"winner = {category}",
        )
    axes[1].set_xlabel("layer")
    axes[1].set_ylabel("mean share of queries")
    axes[1].set_ylim(0, 1)
    axes[1].set_title("Winner categories by layer")
    for ax in axes:
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    axes[1].legend(fontsize=8)
    axes[1].grid(alpha=0.3)
    return literal_text(fig)


def plot_pruning_signal(result: Any, *, k: int = 10, figsize: tuple = (11, 4)) -> Any:
    """Claim `pruning_signal` (P2): ΔPPL against retention per removal order (random: each
    draw and their mean); right, when measured: the `k` heads whose lone removal costs most."""
    has_lone = result.lone is not None
    fig, axes = plt.subplots(
        1, 2 if has_lone else 1, figsize=figsize if has_lone else (6, 4), constrained_layout=True
    )
    ax = axes[0] if has_lone else axes
    summary = result.by_retention()
    for order in result.orders:
        ax.plot(
            summary.index,
            summary[order],
            marker="o",
            color=ORDER_COLORS[order],
            label=order,
            linestyle="--" if order == "random" else "-",
        )
    draws = result.table[result.table["order"] == "random"]
    ax.scatter(
        draws["retention"], draws["delta_ppl"], color=ORDER_COLORS["random"], s=10, alpha=0.5
    )
    ax.set_xlabel("retention (fraction of heads kept)")
    ax.set_ylabel(f"ΔPPL (clean PPL {result.clean_ppl:.2f})")
    ax.set_yscale("symlog", linthresh=1.0)
    ax.invert_xaxis()
    ax.set_title(f"Structured head pruning ({result.scope} ranking)")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    if has_lone:
        top = result.top(k)
        labels = [f"L{layer}H{head}" for layer, head in zip(top["layer"], top["head"], strict=True)]
        axes[1].barh(labels[::-1], top["delta_ppl"][::-1], color="C3")
        axes[1].set_xlabel(f"ΔPPL when removed alone (clean {result.lone_clean_ppl:.2f})")
        axes[1].set_title(
            f"Costliest single heads ({result.lone_shape[0]} docs x {result.lone_shape[1]} tokens)"
        )
    return literal_text(fig)
