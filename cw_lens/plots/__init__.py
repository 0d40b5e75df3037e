"""Every figure of cw_lens, one module per analysis. Plotting only: each function takes computed
results and returns a `matplotlib.figure.Figure`; nothing here runs a model or computes a
statistic. Figures are named after the claim they illustrate (docs/methods.md#claims).
"""

from cw_lens.core.deprecation import moved_attributes
from cw_lens.plots.contributions import plot_attention_vs_contribution
from cw_lens.plots.faithfulness import plot_faithfulness_curves
from cw_lens.plots.flow import (
    plot_input_deletion,
    plot_residual_shares,
    plot_rollout,
    plot_rollout_deletion,
    plot_routes,
)
from cw_lens.plots.selection import (
    plot_pruning_signal,
    plot_retriever_share,
    plot_sink_lowers_fn,
    plot_topn_beats_random,
)
from cw_lens.plots.sinks import (
    plot_convex_sink_curve,
    plot_sink_ablation_cone,
    plot_sink_attention_vs_contribution,
    plot_sink_cancels_drift,
    plot_sink_contribution_drivers,
    plot_sink_value_geometry,
)
from cw_lens.plots.style import save_figure

__all__ = [
    "plot_attention_vs_contribution",
    "plot_convex_sink_curve",
    "plot_faithfulness_curves",
    "plot_input_deletion",
    "plot_pruning_signal",
    "plot_residual_shares",
    "plot_retriever_share",
    "plot_rollout",
    "plot_rollout_deletion",
    "plot_routes",
    "plot_sink_ablation_cone",
    "plot_sink_attention_vs_contribution",
    "plot_sink_cancels_drift",
    "plot_sink_contribution_drivers",
    "plot_sink_lowers_fn",
    "plot_sink_value_geometry",
    "plot_topn_beats_random",
    "save_figure",
]


# names of 0.4 that moved to the reproduction layer in 0.5 (until 0.6; not in __all__)
__getattr__ = moved_attributes(
    "cw_lens.plots",
    {
        "plot_per_layer_intervals": "cw_lens.reproduction.claim_plots",
    },
)
