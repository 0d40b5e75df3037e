"""Every figure of cw_lens, one module per analysis. Plotting only: each function takes computed
results and returns a ``matplotlib.figure.Figure``; nothing here runs a model or computes a
statistic. Figures are named after the claim they illustrate (SPEC §6).
"""

from cw_lens.plots._style import save_figure
from cw_lens.plots.contributions import plot_attention_vs_contribution

__all__ = ["plot_attention_vs_contribution", "save_figure"]
