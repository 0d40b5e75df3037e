"""Shared figure helpers (colour maps, token tick labels, saving)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib.pyplot as plt
import numpy as np
from matplotlib.colors import TwoSlopeNorm

SIGNED_CMAP = "RdBu_r"
MAX_TICK_LABELS = 40


def token_label(token: str) -> str:
    """A token as a figure shows it: its `repr` without the quotes (so a newline reads `\\n`
    and a space is visible), cut to 12 characters.

    Args:
        token: The token string.

    Returns:
        The label (drawn as written: see `literal_text`).
    """
    return repr(token)[1:-1][:12]


def token_ticks(ax: Any, tokens: list[str]) -> None:
    """Label both axes with (shortened) tokens when there are few enough of them."""
    if len(tokens) > MAX_TICK_LABELS:
        return
    labels = [token_label(t) for t in tokens]
    ax.set_xticks(range(len(tokens)), labels, rotation=90, fontsize=7)
    ax.set_yticks(range(len(tokens)), labels, fontsize=7)


def literal_text(fig: Any) -> Any:
    """Make every text of `fig` that shows strings draw them as written: no mathtext, no TeX.

    Token strings, run labels, claim names and corpus names come from the model, the user or
    a loaded file; `$\\frac{$` in one of them made matplotlib parse it as mathtext (a raw
    `ValueError` when the figure is drawn) and `$x$` drew as math. Every figure of cw_lens
    passes through here before it is returned: titles, axis labels, legends, free texts and
    the tick labels of axes labelled with strings (fixed or categorical ticks) get
    `parse_math=False` and `usetex=False`, so each draws exactly its `get_text()`. cw_lens
    writes no mathtext of its own; the tick labels and offset text of numeric axes
    (matplotlib's scalar and log formatters, colour bars included) are left to their
    formatters (a log axis's `10^{-1}` is mathtext).

    Args:
        fig: A matplotlib Figure.

    Returns:
        The same figure.
    """
    from matplotlib.text import Text
    from matplotlib.ticker import LogFormatter, ScalarFormatter

    texts = fig.findobj(Text)  # creates the ticks the current view has, so first
    numeric: set[int] = set()
    for ax in fig.axes:
        for axis in (ax.xaxis, ax.yaxis):
            numeric.add(id(axis.offsetText))
            for ticks, formatter in (
                (axis.get_major_ticks(), axis.get_major_formatter()),
                (axis.get_minor_ticks(), axis.get_minor_formatter()),
            ):
                if isinstance(formatter, (ScalarFormatter, LogFormatter)):
                    numeric.update(id(t) for tick in ticks for t in (tick.label1, tick.label2))
    for text in texts:
        if id(text) not in numeric:
            text.set_parse_math(False)
            text.set_usetex(False)
    return fig


def signed_norm(values: np.ndarray) -> TwoSlopeNorm:
    """A colour norm centred at 0 and symmetric around it."""
    finite = values[np.isfinite(values)]
    lim = float(np.abs(finite).max()) if finite.size else 1.0
    lim = lim or 1.0
    return TwoSlopeNorm(vcenter=0.0, vmin=-lim, vmax=lim)


def save_figure(fig: Any, stem: Path | str, formats: tuple[str, ...] = ("png", "pdf")) -> list:
    """Write `stem.png` and `stem.pdf` atomically (a partial file, then a rename:
    `cw_lens.core.partial_files`); close the figure."""
    from cw_lens.core.partial_files import write_atomically

    stem = Path(stem)
    paths = []
    for fmt in formats:
        path = stem.with_suffix(f".{fmt}")
        write_atomically(
            path,
            lambda tmp, fmt=fmt: fig.savefig(
                tmp, format=fmt, dpi=130, bbox_inches="tight", metadata=_metadata(fmt)
            ),
        )
        paths.append(path)
    plt.close(fig)
    return paths


def _metadata(fmt: str) -> dict:
    # fixed metadata so reruns write identical files
    if fmt == "pdf":
        return {"CreationDate": None, "ModDate": None, "Producer": "cw_lens"}
    if fmt == "png":
        return {"Software": "cw_lens"}
    return {}
