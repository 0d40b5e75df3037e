"""Figures of contribution weights (P1 Fig. 1). Plotting only."""

from __future__ import annotations

from typing import Any

import numpy as np

from cw_lens.plots.style import SIGNED_CMAP, literal_text, plt, signed_norm, token_ticks


def plot_attention_vs_contribution(
    result: Any, *, layer: int, head: int, batch: int = 0, figsize: tuple = (11, 4.8)
) -> Any:
    """P1 Fig. 1: the attention matrix next to the contribution-weight matrix of one head.

    Contribution weights use a signed colour map centred at 0 (red: the token pushes the output
    along itself; blue: against). The first token typically takes much attention but little
    contribution.
    """
    li, hi = result.layers.index(layer), result.heads.index(head)
    n = int(result.mask[batch].sum())
    attention = result.attention[batch, li, hi, :n, :n].detach().cpu().numpy()
    weights = result.weights[batch, li, hi, :n, :n].detach().cpu().numpy()
    causal = np.tril(np.ones((n, n), dtype=bool))
    fig, axes = plt.subplots(1, 2, figsize=figsize, constrained_layout=True)
    im = axes[0].imshow(np.where(causal, attention, np.nan), cmap="viridis", vmin=0, vmax=1)
    axes[0].set_title(f"attention  (L{layer} H{head})")
    fig.colorbar(im, ax=axes[0], shrink=0.8)
    w = np.where(causal, weights, np.nan)
    im = axes[1].imshow(w, cmap=SIGNED_CMAP, norm=signed_norm(w))
    axes[1].set_title(f"contribution weight, {result.kind}  (L{layer} H{head})")
    fig.colorbar(im, ax=axes[1], shrink=0.8)
    for ax in axes:
        token_ticks(ax, result.str_tokens[batch][:n])
        ax.set_xlabel("key")
        ax.set_ylabel("query")
    return literal_text(fig)
