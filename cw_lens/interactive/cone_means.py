"""Per-head means of the output norm and the cone alignment over one pass of one text.

`run_text` (`cw_lens.interactive.comparison`) hands `ConeMeans` to the forward pass as its
block consumer: per (layer, head) it sums `||o_i^h||` and `cos(o_i^h, u^h)` over the queries after
the first sink (the measures of `cw_lens.sink_ablation` with `effect="total"`), and `means`
divides by their count.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from cw_lens.analyses.sinks import SinkSpec, cone_axis, norm_and_cone, queries_after_sink
from cw_lens.models.layer_contributions import LayerContributionsResult


class ConeMeans:
    """Per (layer, head): sums of `||o_i^h||` and `cos(o_i^h, u^h)` over counted queries.

    Args:
        layers: The layers whose heads are summed (the order of the sums' layer axis).
        n_heads: Heads per layer.
        sinks: The sink positions (the queries after the first sink are counted).
    """

    def __init__(self, layers: list[int], n_heads: int, sinks: SinkSpec) -> None:
        self.index = {layer: i for i, layer in enumerate(layers)}
        self.sinks = sinks
        self.sums = torch.zeros(3, len(layers), n_heads, dtype=torch.float64, device="cpu")

    def __call__(self, lc: LayerContributionsResult) -> None:
        """Add one block's norms and cone alignments (blocks of other layers are skipped).

        Args:
            lc: A streamed block (only its activations are read).
        """
        if lc.layer not in self.index:
            return
        acts = lc.acts
        sink_full = self.sinks.mask(lc.batch, acts.pattern.device)
        z = acts.z[:, lc.queries]
        axis = cone_axis(acts, sink_full)[:, None].expand(-1, z.shape[1], -1, -1)
        norm, cos, defined = norm_and_cone(z, axis, acts.weights.gram)  # [b, h, q]
        ok = defined & queries_after_sink(lc, sink_full)[:, None, :]
        li = self.index[lc.layer]
        self.sums[0, li] += torch.where(ok, norm, 0.0).sum((0, 2)).double().cpu()
        self.sums[1, li] += torch.where(ok, cos, 0.0).sum((0, 2)).double().cpu()
        self.sums[2, li] += ok.sum((0, 2)).double().cpu()

    def means(self) -> tuple[Tensor, Tensor]:
        """The means of the sums.

        Returns:
            `(norm, cone)`, each `[layer, head]` (float32; NaN where no query was counted).
        """
        count = self.sums[2]
        norm = torch.where(count > 0, self.sums[0] / count.clamp_min(1), math.nan)
        cone = torch.where(count > 0, self.sums[1] / count.clamp_min(1), math.nan)
        return norm.float(), cone.float()
