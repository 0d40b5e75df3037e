"""Every figure of cw_lens. Plotting only: each function takes computed results and returns a
``matplotlib.figure.Figure``; nothing here runs a model or computes a statistic.

Figures are named after the claim they illustrate (SPEC §6), so ``REPORT.md`` and
``summary.json`` point at ``plot_<claim>`` outputs.
"""

from __future__ import annotations

from typing import Any

import matplotlib

matplotlib.use("Agg") if matplotlib.get_backend().lower() == "agg" else None
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
from matplotlib.colors import TwoSlopeNorm  # noqa: E402

SIGNED_CMAP = "RdBu_r"
MAX_TICK_LABELS = 40


def _token_ticks(ax: Any, tokens: list[str]) -> None:
    if len(tokens) > MAX_TICK_LABELS:
        return
    labels = [repr(t)[1:-1][:12] for t in tokens]
    ax.set_xticks(range(len(tokens)), labels, rotation=90, fontsize=7)
    ax.set_yticks(range(len(tokens)), labels, fontsize=7)


def _signed_norm(values: np.ndarray) -> TwoSlopeNorm:
    finite = values[np.isfinite(values)]
    lim = float(np.abs(finite).max()) if finite.size else 1.0
    lim = lim or 1.0
    return TwoSlopeNorm(vcenter=0.0, vmin=-lim, vmax=lim)


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
    im = axes[1].imshow(w, cmap=SIGNED_CMAP, norm=_signed_norm(w))
    axes[1].set_title(f"contribution weight, {result.kind}  (L{layer} H{head})")
    fig.colorbar(im, ax=axes[1], shrink=0.8)
    for ax in axes:
        _token_ticks(ax, result.str_tokens[batch][:n])
        ax.set_xlabel("key")
        ax.set_ylabel("query")
    return fig
