"""The streamed pass of [`sink_statistics`][cw_lens.sink_statistics]: its checks, its sink
positions (detected by a pass of their own with `"detect"`) and its accumulator, as the
`CorpusPlan` that one pass (or [`corpus_analyses`][cw_lens.corpus_analyses]) runs, and the entry
point itself. `cw_lens.analyses.sinks.statistics` holds the result it builds.
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Any

from cw_lens.analyses.common import CorpusPlan, run_plan
from cw_lens.analyses.sinks.accumulation import MAX_SAMPLES_PER_HEAD, SinkAccumulator
from cw_lens.analyses.sinks.detection import MIN_QUERY, SinkPositions, resolve_sinks
from cw_lens.core.errors import InputError
from cw_lens.core.keywords import check_keywords
from cw_lens.data.documents import as_corpus
from cw_lens.models.access import Model
from cw_lens.models.capture import resolve_layers

if TYPE_CHECKING:
    from cw_lens.analyses.sinks.statistics import SinkStatisticsResult


@check_keywords
def sink_statistics(
    model: Model,
    corpus: Any,
    *,
    sink_positions: SinkPositions = (0,),
    layers: Any = None,
    batch_size: int | None = 8,
    min_query: int = MIN_QUERY,
    drift_k: int = 4,
    samples_per_head: int = 128,
    max_samples: int = MAX_SAMPLES_PER_HEAD,
    seed: int = 0,
    prepend_bos: bool = True,
    progress: bool = True,
    per_document: bool = False,
) -> SinkStatisticsResult:
    """Sink geometry over a corpus in one streamed pass (docs/methods.md#sinks).

    Args:
        model: A `TransformerBridge`.
        corpus: `load_corpus(...)` output or a list of strings.
        sink_positions: Sink positions (default BOS, position 0) or `"detect"` (per document,
            keys whose mean attention exceeds 0.3 in some head). Positions count from each
            document's first token (BOS is 0; right padding never shifts them) and must be
            tokens of every document: one beyond a document raises
            [`InputError`][cw_lens.InputError] naming the document and its length.
        layers: Layers (`None` = all).
        batch_size: Documents per forward pass.
        min_query: Queries `i >= min_query` define sink rates and curves (methods page: 16).
        drift_k: Top-attended tail tokens kept out of the drift (methods page: 4).
        samples_per_head: Factor samples per (document, layer, head) and group (sink /
            tail entries) for the per-head rank correlations
            ([`SinkStatisticsResult.drivers`][cw_lens.SinkStatisticsResult.drivers]).
        max_samples: Factor samples kept per (layer, head) and group over the whole corpus (a
            seeded bottom-k reservoir: the same sample whatever the sharding; memory fixed at
            about 80 bytes per sample, 44 MB for SmolLM2's 270 heads at the default); small
            corpora keep every sample drawn.
        seed: Seed of the factor sampling (per document, so sharded runs sample the same).
        prepend_bos: Prepend BOS to text.
        progress: Show a progress bar.
        per_document: Also keep each document's sums per head (`RECORDED_SUMS` and a coarse
            cancelled-share histogram: `4 * (14 + 26) * n_layers * n_heads + 2` bytes per
            document, 43.2 KB for SmolLM2-135M's 270 heads) so that
            [`SinkStatisticsResult.claims`][cw_lens.SinkStatisticsResult.claims] can give bootstrap
            intervals.

    Returns:
        A [`SinkStatisticsResult`][cw_lens.SinkStatisticsResult].

    Examples:
        ```python
        import cw_lens

        model = cw_lens.load_model("testing:tiny-llama")
        corpus = cw_lens.load_corpus(n_docs=2, max_tokens=16, model=model)
        stats = cw_lens.sink_statistics(model, corpus, progress=False)
        stats.heads()        # per head: sink rate, value norms, cosines, s*, drift
        stats.top(5)
        ```
    """
    plan = _plan_sink_statistics(
        model,
        corpus,
        sink_positions=sink_positions,
        layers=layers,
        batch_size=batch_size,
        min_query=min_query,
        drift_k=drift_k,
        samples_per_head=samples_per_head,
        max_samples=max_samples,
        seed=seed,
        prepend_bos=prepend_bos,
        per_document=per_document,
    )
    label = progress and "sink statistics"
    return run_plan(
        model, corpus, plan, batch_size=batch_size, prepend_bos=prepend_bos, progress=label
    )


def _plan_sink_statistics(
    model: Model,
    corpus: Any,
    *,
    sink_positions: SinkPositions,
    layers: Any,
    batch_size: int | None,
    min_query: int,
    drift_k: int,
    samples_per_head: int,
    max_samples: int,
    seed: int,
    prepend_bos: bool,
    per_document: bool,
    **_: Any,
) -> CorpusPlan:
    """[`sink_statistics`][cw_lens.sink_statistics]'s checks, sink positions (detected by a
    pass of their own with `"detect"`) and accumulator, as a `CorpusPlan`."""
    if drift_k < 1:
        raise InputError(f"drift_k must be at least 1, got {drift_k}.")
    if min_query < 1:
        raise InputError(f"min_query must be at least 1, got {min_query}.")
    if samples_per_head < 0:
        raise InputError(f"samples_per_head must be >= 0, got {samples_per_head}.")
    layer_list = resolve_layers(model, layers)
    sinks = resolve_sinks(
        model, corpus, sink_positions, batch_size=batch_size, prepend_bos=prepend_bos
    )
    accumulator = SinkAccumulator(
        layer_list,
        model.cfg.n_heads,
        sinks,
        min_query=min_query,
        drift_k=drift_k,
        samples_per_head=samples_per_head,
        max_samples=max_samples,
        seed=seed,
        n_documents=len(as_corpus(corpus)) if per_document else None,
    )

    def finish(acc: SinkAccumulator, stats: Any) -> SinkStatisticsResult:
        # here, not at the top: the result's module imports this one (and re-exports its functions)
        from cw_lens.analyses.sinks.statistics import SinkStatisticsResult

        result = SinkStatisticsResult(
            layer_list,
            model.cfg.n_heads,
            sinks.describe(),
            stats.n_documents,
            stats.n_tokens,
            acc,
            min_query,
        )
        if bool(result.sink_rate.isnan().all()):
            warnings.warn(
                f"No query at position >= min_query={min_query} after a sink: the documents are "
                "too short (or no sink position lies inside them), so sink rates are NaN and no "
                "head is a sink head. Use longer texts or a smaller min_query.",
                RuntimeWarning,
                stacklevel=4,
            )
        return result

    return CorpusPlan("sinks", accumulator, layer_list, finish)
