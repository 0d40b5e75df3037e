"""Shared figure helpers (colour maps, token tick labels, saving)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib.pyplot as plt
import numpy as np
from matplotlib.colors import TwoSlopeNorm

SIGNED_CMAP = "RdBu_r"
MAX_TICK_LABELS = 40


def token_ticks(ax: Any, tokens: list[str]) -> None:
    """Label both axes with (shortened) tokens when there are few enough of them."""
    if len(tokens) > MAX_TICK_LABELS:
        return
    labels = [repr(t)[1:-1][:12] for t in tokens]
    ax.set_xticks(range(len(tokens)), labels, rotation=90, fontsize=7)
    ax.set_yticks(range(len(tokens)), labels, fontsize=7)


def signed_norm(values: np.ndarray) -> TwoSlopeNorm:
    """A colour norm centred at 0 and symmetric around it."""
    finite = values[np.isfinite(values)]
    lim = float(np.abs(finite).max()) if finite.size else 1.0
    lim = lim or 1.0
    return TwoSlopeNorm(vcenter=0.0, vmin=-lim, vmax=lim)


def save_figure(fig: Any, stem: Path | str, formats: tuple[str, ...] = ("png", "pdf")) -> list:
    """Write `stem.png` and `stem.pdf` atomically (temp file, then rename); close the figure."""
    import os

    stem = Path(stem)
    stem.parent.mkdir(parents=True, exist_ok=True)
    paths = []
    for fmt in formats:
        path = stem.with_suffix(f".{fmt}")
        tmp = path.with_name(f".{path.name}.tmp")
        fig.savefig(tmp, format=fmt, dpi=130, bbox_inches="tight", metadata=_metadata(fmt))
        os.replace(tmp, path)
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
