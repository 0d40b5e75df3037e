"""Figures of the sink analyses (P1 §sinks). Plotting only: inputs are computed tables."""

from __future__ import annotations

from typing import Any

import numpy as np
import pandas as pd
import seaborn as sns

from cw_lens.plots.style import literal_text, plt


def plot_sink_attention_vs_contribution(heads: pd.DataFrame, *, figsize: tuple = (9, 4)) -> Any:
    """Per layer: mean attention to the sink versus the sink's mean intra contribution.

    `sink_attention_vs_contribution`: the first token takes much attention but (P1) little
    contribution. Lines: mean over all heads; markers: over sink heads only.
    """
    fig, ax = plt.subplots(figsize=figsize, constrained_layout=True)
    per_layer = heads.groupby("layer")[["sink_attention", "sink_contribution"]].mean()
    ax.plot(
        per_layer.index,
        per_layer["sink_attention"],
        "-o",
        color="tab:gray",
        ms=3,
        label="attention to sink (all heads)",
    )
    ax.plot(
        per_layer.index,
        per_layer["sink_contribution"],
        "-o",
        color="tab:red",
        ms=3,
        label="sink contribution (all heads)",
    )
    sink = heads[heads["sink_head"]].groupby("layer")[["sink_attention", "sink_contribution"]]
    sink = sink.mean()
    ax.scatter(
        sink.index,
        sink["sink_attention"],
        marker="s",
        color="black",
        s=14,
        label="attention, sink heads",
    )
    ax.scatter(
        sink.index,
        sink["sink_contribution"],
        marker="s",
        color="darkred",
        s=14,
        label="contribution, sink heads",
    )
    ax.axhline(0, color="k", lw=0.5)
    ax.set_xlabel("layer")
    ax.set_ylabel("mean over queries i >= 16")
    ax.set_title("Attention to the sink vs its contribution (intra-head)")
    ax.legend(fontsize=7, ncol=2)
    return literal_text(fig)


def plot_sink_value_geometry(heads: pd.DataFrame, *, figsize: tuple = (12, 3.6)) -> Any:
    """`sink_value_norm_ratio` and `sink_anti_alignment`: per head, the norm ratio
    `||pv_j|| / ||pv_0||` and the cosines of `pv_0` with tail tokens and the tail mixture."""
    fig, axes = plt.subplots(1, 3, figsize=figsize, constrained_layout=True)
    hue = heads["sink_head"].map({True: "sink heads", False: "other heads"})
    sns.histplot(
        x=np.log10(heads["norm_ratio"].clip(lower=1e-3)),
        hue=hue,
        ax=axes[0],
        bins=30,
        element="step",
        stat="count",
        common_norm=False,
    )
    axes[0].axvline(np.log10(3), color="k", ls="--", lw=0.8)
    axes[0].axvline(1.0, color="k", ls="--", lw=0.8)
    axes[0].set_xlabel("log10 mean ||pv_j|| / ||pv_0||  (dashed: 3x, 10x)")
    axes[0].set_title("Sink value norm ratio")
    for ax, col, title in (
        (axes[1], "cos_sink_token", "cos(pv_0, pv_j), mean over tail tokens"),
        (axes[2], "cos_sink_mixture", "cos(pv_0, m_i), mean over queries"),
    ):
        sns.histplot(
            x=heads[col],
            hue=hue,
            ax=ax,
            bins=30,
            binrange=(-1, 1),
            element="step",
            common_norm=False,
        )
        ax.axvline(0, color="k", lw=0.8)
        ax.set_xlabel("cosine")
        ax.set_title(title, fontsize=9)
    return literal_text(fig)


def plot_sink_contribution_drivers(
    heads: pd.DataFrame, decomposition: pd.DataFrame, *, figsize: tuple = (11, 3.8)
) -> Any:
    """`sink_contribution_drivers`: the three factors of the weight for sink and tail entries
    of sink heads (means), and the median over sink heads of each factor's |Spearman rho| with
    the contribution (the claim's criterion: attention's should be the smallest)."""
    fig, axes = plt.subplots(1, 2, figsize=figsize, constrained_layout=True)
    factors = ["attention", "relative_norm", "cosine", "contribution"]
    sink = heads[heads["sink_head"]]
    means = pd.DataFrame(
        {
            "sink (j = 0)": [sink[f"sink_{f}"].mean() for f in factors],
            "tail (j > 0)": [sink[f"tail_{f}"].mean() for f in factors],
        },
        index=factors,
    )
    means.plot.bar(ax=axes[0], rot=0, color=["tab:red", "tab:blue"])
    axes[0].set_yscale("symlog", linthresh=0.01)
    axes[0].set_title("Mean factor, sink heads")
    rho = (
        decomposition[decomposition["factor"] != "contribution"]
        .pivot(index="factor", columns="group", values="median_head_abs_rho")
        .reindex(["attention", "relative_norm", "cosine"])
    )
    rho.plot.bar(ax=axes[1], rot=0, color=["tab:red", "tab:blue"])
    axes[1].set_ylim(0, 1)
    axes[1].set_title("Median over sink heads of |Spearman rho| with the contribution", fontsize=9)
    return literal_text(fig)


def plot_convex_sink_curve(
    curve: pd.DataFrame,
    s_star: pd.DataFrame,
    heads: pd.DataFrame,
    *,
    n_heads: int = 6,
    figsize: tuple = (12, 4),
) -> Any:
    """`convex_sink_curve`: (left) empirical mean `||o_i^h||` per sink-rate bin for the
    strongest sink heads; (right) the distribution of the counterfactual minimiser `s*`."""
    fig, axes = plt.subplots(1, 2, figsize=figsize, constrained_layout=True)
    top = heads[heads["sink_head"]].nlargest(n_heads, "drift_count")[["layer", "head"]]
    for _, row in top.iterrows():
        c = curve[(curve["layer"] == row["layer"]) & (curve["head"] == row["head"])]
        c = c[c["count"] >= 5]
        if len(c):
            norm = c["output_norm"] / c["output_norm"].max()
            axes[0].plot(c["sink_rate"], norm, "-o", ms=3, label=f"L{row['layer']}H{row['head']}")
    axes[0].set_xlabel("sink rate s")
    axes[0].set_ylabel("mean ||o|| (normalised per head)")
    axes[0].set_title("Empirical output norm vs sink rate")
    if axes[0].lines:
        axes[0].legend(fontsize=7)
    else:
        axes[0].text(
            0.5, 0.5, "no sink head with enough queries", ha="center", transform=axes[0].transAxes
        )
    interior = s_star[s_star["edge"] == "interior"]
    width = float(interior["s_star"].diff().median()) if len(interior) > 1 else 0.02
    axes[1].bar(
        interior["s_star"], interior["count"], width=width, color="tab:purple", label="0 < s* < 1"
    )
    ends = s_star[s_star["edge"] != "interior"]
    axes[1].bar(
        ends["s_star"],
        ends["count"],
        width=width * 2,
        color="tab:orange",
        label="clamped at 0 or 1",
    )
    axes[1].set_xlabel("counterfactual minimiser s*")
    axes[1].set_ylabel("queries (sink heads)")
    axes[1].set_title("Where ||s pv_0 + (1-s) m|| is smallest")
    axes[1].legend(fontsize=7)
    return literal_text(fig)


def plot_sink_cancels_drift(heads: pd.DataFrame, *, figsize: tuple = (11, 3.6)) -> Any:
    """`sink_cancels_drift`: per sink head, the median cosine between the sink term and the
    weak-token drift, and the median share of the drift the sink cancels."""
    fig, axes = plt.subplots(1, 2, figsize=figsize, constrained_layout=True)
    sink = heads[heads["sink_head"]]
    sns.histplot(sink["drift_cos_median"], bins=25, binrange=(-1, 1), ax=axes[0], color="tab:green")
    axes[0].axvline(0, color="k", lw=0.8)
    axes[0].set_xlabel("median cos(alpha_0 pv_0, d_i) per sink head")
    axes[0].set_title(f"{(sink['drift_cos_median'] < 0).mean():.0%} of sink heads negative")
    share = sink["drift_cancelled_median"]
    outside = int((share.abs() > 2).sum())
    # display only: values beyond +-2 are drawn in the edge bins (the medians are unclipped)
    sns.histplot(share.clip(-2, 2), bins=25, binrange=(-2, 2), ax=axes[1], color="tab:olive")
    axes[1].axvline(0, color="k", lw=0.8)
    axes[1].set_xlabel("median cancelled share -<alpha_0 pv_0, d>/||d||^2 (shown clipped to +-2)")
    axes[1].set_title(
        f"median over sink heads {share.median():.2f}; {outside} heads beyond +-2", fontsize=9
    )
    return literal_text(fig)


def plot_sink_ablation_cone(ablation: Any, *, figsize: tuple = (10, 3.8)) -> Any:
    """`sink_ablation_cone`: cone alignment and output norm before/after removing the sink,
    low-norm heads versus the rest; the title gives the perplexity change."""
    fig, axes = plt.subplots(1, 2, figsize=figsize, constrained_layout=True)
    s = ablation.summary()
    x = np.arange(len(s.index))
    for ax, (before, after, label) in zip(
        axes,
        (
            ("cone_before", "cone_after", "cos(o_i^h, u^h)"),
            ("norm_before", "norm_after", "||o_i^h||"),
        ),
        strict=True,
    ):
        ax.bar(x - 0.18, s[before], width=0.36, label="before", color="tab:gray")
        ax.bar(x + 0.18, s[after], width=0.36, label="sink removed", color="tab:red")
        ax.set_xticks(x, s.index)
        ax.set_ylabel(label)
        ax.legend(fontsize=7)
    fig.suptitle(
        f"Sink-norm ablation ({ablation.effect} effect, {len(ablation.layers)} layers): "
        f"PPL {ablation.clean_ppl:.2f} -> {ablation.patched_ppl:.2f}",
        fontsize=10,
    )
    return literal_text(fig)
