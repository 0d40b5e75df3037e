"""Figures of contribution flow (docs/methods.md#flow): residual shares, rollouts, route graphs,
deletion. Plotting only: every number comes from the result objects."""

from __future__ import annotations

from typing import Any

import numpy as np

from cw_lens.plots.style import (
    SIGNED_CMAP,
    literal_text,
    plt,
    signed_norm,
    token_label,
    token_ticks,
)

PIECE_COLOURS = {"residual": "#9e9e9e", "attention": "#d62728", "mlp": "#1f77b4", "bias": "#2ca02c"}


def plot_residual_shares(result: Any, *, query: int, batch: int = 0, figsize=(9, 4)) -> Any:
    """Share of each piece (residual, attention, MLP, bias) in one position's stream, per layer."""
    fig, ax = plt.subplots(figsize=figsize, constrained_layout=True)
    layers = np.array(result.layers)
    width = 0.2
    for n, piece in enumerate(("residual", "attention", "mlp", "bias")):
        values = getattr(result, piece)[batch, :, query].detach().cpu().numpy()
        ax.bar(layers + (n - 1.5) * width, values, width, label=piece, color=PIECE_COLOURS[piece])
    ax.axhline(0, color="black", lw=0.6)
    ax.set_xlabel("layer")
    ax.set_ylabel("share of the stream after the block")
    token = token_label(result.str_tokens[batch][query])
    ax.set_title(f"residual shares at position {query} ({token!r})")
    ax.legend(ncol=4, fontsize=8)
    return literal_text(fig)


def plot_rollout(result: Any, *, batch: int = 0, query: int, figsize=(13, 4.6)) -> Any:
    """Contribution rollout next to attention rollout, and both rows of one query."""
    n = int(result.mask[batch].sum())
    tokens = result.str_tokens[batch][:n]
    fig, axes = plt.subplots(
        1, 3, figsize=figsize, constrained_layout=True, gridspec_kw={"width_ratios": [1, 1, 1.2]}
    )
    causal = np.tril(np.ones((n, n), dtype=bool))
    for ax, method in zip(axes[:2], ("contribution", "attention"), strict=True):
        m = getattr(result, method)[batch, :n, :n].detach().cpu().numpy()
        m = np.where(causal, m, np.nan)
        if method == "contribution":
            im = ax.imshow(m, cmap=SIGNED_CMAP, norm=signed_norm(m))
        else:
            im = ax.imshow(m, cmap="viridis", vmin=0)
        fig.colorbar(im, ax=ax, shrink=0.7)
        ax.set_title(f"{method} rollout")
        token_ticks(ax, tokens)
        ax.set_xlabel("input token")
        ax.set_ylabel("position")
    ax = axes[2]
    x = np.arange(query + 1)
    for off, method, colour in ((-0.2, "contribution", "#d62728"), (0.2, "attention", "#7f7f7f")):
        row = getattr(result, method)[batch, query, : query + 1].detach().cpu().numpy()
        ax.bar(x + off, row, 0.4, label=method, color=colour)
    ax.axhline(0, color="black", lw=0.6)
    ax.set_xticks(x, [token_label(t) for t in tokens[: query + 1]], rotation=90, fontsize=7)
    ax.set_title(f"row of position {query} ({token_label(tokens[query])!r})")
    ax.legend(fontsize=8)
    return literal_text(fig)


def plot_routes(graph: Any, *, figsize: tuple | None = None, max_labels: int = 60) -> Any:
    """The route graph on a layers x positions grid: attention edges coloured by share (width
    too), MLP edges blue, residual edges grey; half nodes `m_l` (the MLP's input on
    sequential blocks) hollow at `l + 0.5`; the target outlined."""
    import networkx as nx

    g = graph.graph
    n_pos = len(graph.str_tokens)
    figsize = figsize or (max(7, 0.45 * n_pos + 2), max(5, 0.3 * graph.n_layers + 2))
    fig, ax = plt.subplots(figsize=figsize, constrained_layout=True)
    pos = {node: (node[1], node[0]) for node in g.nodes}
    by_kind = {k: [(u, v, d) for u, v, d in g.edges(data=True) if d["kind"] == k]
               for k in ("residual", "mlp", "attention")}  # fmt: skip
    for kind, colour in (("residual", "#bbbbbb"), ("mlp", PIECE_COLOURS["mlp"])):
        edges = by_kind[kind]
        widths = [0.8 + 1.5 * min(1.0, d["share"]) for *_, d in edges]
        nx.draw_networkx_edges(g, pos, edgelist=[(u, v) for u, v, _ in edges], ax=ax,
                               edge_color=colour, width=widths or 1.0, arrows=False)  # fmt: skip
    attention = by_kind["attention"]
    if attention:
        shares = np.array([d["share"] for *_, d in attention])
        top = max(float(shares.max()), graph.threshold * 2)
        colours = plt.get_cmap("Reds")(0.35 + 0.65 * np.clip(shares / top, 0, 1))
        nx.draw_networkx_edges(
            g,
            pos,
            edgelist=[(u, v) for u, v, _ in attention],
            ax=ax,
            edge_color=colours,
            width=0.8 + 3.0 * np.clip(shares / top, 0, 1),
            arrows=False,
        )
    half = [n for n, d in g.nodes(data=True) if d.get("half")]
    full = [n for n in g.nodes if n not in set(half)]
    nx.draw_networkx_nodes(g, pos, nodelist=full, ax=ax, node_size=14, node_color="#333333")
    if half:
        nx.draw_networkx_nodes(g, pos, nodelist=half, ax=ax, node_size=12, node_color="white",
                               edgecolors="#333333", linewidths=0.8)  # fmt: skip
    target = (graph.n_layers, graph.target)
    if target in pos:
        ax.scatter(*pos[target], s=120, facecolors="none", edgecolors="#d62728", lw=1.5)
    if n_pos <= max_labels:
        ax.set_xticks(
            range(n_pos), [token_label(t) for t in graph.str_tokens], rotation=90, fontsize=7
        )
    step = max(1, graph.n_layers // 10)
    ax.set_yticks(range(0, graph.n_layers + 1, step))
    ax.tick_params(left=True, bottom=True, labelleft=True, labelbottom=True)
    ax.set_ylabel("layer (stream entering the block; l + 0.5: the MLP's input)")
    ax.set_xlim(-0.7, n_pos - 0.3)
    ax.set_ylim(-0.7, graph.n_layers + 0.7)
    ax.set_title(
        f"routes to position {graph.target} ({token_label(graph.str_tokens[graph.target])!r}), "
        f"share > {graph.threshold:g}: {len(attention)} attention edges, "
        f"{len(by_kind['mlp'])} MLP edges"
    )
    return literal_text(fig)


def plot_rollout_deletion(result: Any, *, figsize=(6.5, 4)) -> Any:
    """Mean drop of the target's log-probability against the number of deleted tokens."""
    summary = result.summary()
    fig, ax = plt.subplots(figsize=figsize, constrained_layout=True)
    colours = {"contribution": "#d62728", "attention": "#7f7f7f", "random": "#1f77b4"}
    for method, df in summary.groupby("method"):
        ax.errorbar(
            df["k"], df["mean_drop"], yerr=df["sem"], marker="o", capsize=3,
            label=method, color=colours.get(method),
        )  # fmt: skip
    ax.set_xlabel("input tokens deleted (top-k by ranking)")
    ax.set_ylabel("drop of the target log-probability")
    ax.set_title(f"rollout deletion test ({result.corpus})")
    ax.legend(fontsize=8)
    return literal_text(fig)


def plot_input_deletion(result: Any, *, figsize: tuple[float, float] = (10, 4)) -> Any:
    """Every method's mean drop against the share of input tokens removed: comprehensiveness
    (the top removed; higher is more faithful) beside sufficiency (the bottom; lower is).

    Args:
        result: An `InputDeletionResult`.
        figsize: The figure's size in inches.

    Returns:
        A matplotlib Figure, one panel per mode (error bars: the standard error over items).
    """
    summary = result.summary()
    modes = [m for m in ("comprehensiveness", "sufficiency") if m in set(summary["mode"])]
    fig, axes = plt.subplots(1, len(modes), figsize=figsize, constrained_layout=True, squeeze=False)
    methods = list(dict.fromkeys([*result.methods, "random"]))
    # tab10 without its grey, which the controls wear
    palette = [plt.get_cmap("tab10")(i) for i in (0, 1, 2, 3, 4, 5, 6, 8, 9)]
    for ax, mode in zip(axes[0], modes, strict=True):
        for n, method in enumerate(methods):
            df = summary[(summary["mode"] == mode) & (summary["method"] == method)]
            if df.empty:
                continue
            style = {}
            if method in ("random", "recency"):  # the controls
                style = {"color": "#7f7f7f", "linestyle": "--" if method == "random" else ":"}
            if method in ("contribution", "contribution_rollout"):
                style = {"linewidth": 2.4}
            ax.errorbar(
                100 * df["fraction"], df["mean_drop"], yerr=df["sem"], marker="o", capsize=2,
                label=method, **({"color": palette[n % len(palette)]} | style),
            )  # fmt: skip
        ax.set_xscale("log")
        ax.set_xlabel("input tokens removed (%)")
        ax.set_ylabel("drop of the answer log-probability")
        ax.set_title(f"{mode} ({result.corpus})")
    axes[0][0].legend(fontsize=7)
    return literal_text(fig)
