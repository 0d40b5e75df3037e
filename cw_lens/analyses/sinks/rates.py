"""Per-query sink rates of a few texts ([`sink_rates`][cw_lens.sink_rates]): `s_i^h`, the
attention each query puts on the sink positions, for every layer and head
(docs/methods.md#sinks).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from jaxtyping import Float
from torch import Tensor

from cw_lens.analyses.sinks.detection import SinkPositions, resolve_sinks
from cw_lens.core import geometry as geo
from cw_lens.core.keywords import check_keywords
from cw_lens.data.documents import as_corpus
from cw_lens.data.inputs import prepare_inputs
from cw_lens.data.streaming import stream_contributions
from cw_lens.models.access import Model
from cw_lens.models.capture import resolve_layers
from cw_lens.models.layer_contributions import LayerContributionsResult


@check_keywords
def sink_rates(
    model: Model,
    inputs: Any,
    *,
    sink_positions: SinkPositions = (0,),
    layers: Any = None,
    prepend_bos: bool = True,
) -> Float[Tensor, "batch layer head query"]:
    """Per-query sink rate `s_i^h` for a few texts (NaN at padding and at sink queries);
    `sink_positions` as in [`sink_statistics`][cw_lens.sink_statistics] (positions or
    `"detect"`).

    Every query's own value, held in memory (`[batch, layer, head, query]`): for a few texts.
    Over a corpus, [`sink_statistics`][cw_lens.sink_statistics] streams the per-head means
    (`heads()["sink_rate"]`) in fixed memory.

    Args:
        model: A TransformerLens model.
        inputs: A string, a list of strings, token ids (a tensor `[pos]` or `[batch, pos]`, or a
            list of token-id lists, read as given) or a [`Corpus`][cw_lens.Corpus].
        sink_positions: Sink positions, as in [`sink_statistics`][cw_lens.sink_statistics]
            (positions or `"detect"`).
        layers: Layers (`None` = all).
        prepend_bos: Prepend BOS to text.

    Returns:
        The sink rate `s_i^h` per query, `[batch, layer, head, query]`: NaN at padding and at
        sink queries.

    Examples:
        ```python
        import cw_lens

        model = cw_lens.load_model("testing:tiny-llama")
        rates = cw_lens.sink_rates(model, "The cat sat on the mat.")
        rates.shape  # [batch, layer, head, query]
        ```
    """
    inputs = as_corpus(inputs)  # once: the batch and the sink positions read this Corpus
    layer_list = resolve_layers(model, layers)
    batch = prepare_inputs(model, inputs, prepend_bos=prepend_bos)
    sinks = resolve_sinks(model, inputs, sink_positions, prepend_bos=prepend_bos)
    n_pos = batch.tokens.shape[1]
    out = torch.full(
        (batch.tokens.shape[0], len(layer_list), model.cfg.n_heads, n_pos), math.nan, device="cpu"
    )

    def fill(lc: LayerContributionsResult) -> None:
        mask = sinks.mask(lc.batch, lc.attention.device)
        s = geo.sink_rate(lc.attention, mask[:, : lc.keys.stop])
        ok = lc.query_mask & ~mask[:, lc.queries]
        rows = torch.tensor(lc.batch.documents, device="cpu")
        out[rows, layer_list.index(lc.layer), :, lc.queries] = s.masked_fill(
            ~ok[:, None, :], math.nan
        ).cpu()

    stream_contributions(
        model,
        batch.tokens,
        fill,
        layers=layer_list,
        attention_mask=batch.mask.long(),
        progress=False,
        reuse_buffers=True,  # reduced inside the call
    )
    return out
