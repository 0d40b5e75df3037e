"""The streamed pass of [`sink_statistics`][cw_lens.sink_statistics]: the entry point, which
builds a `SinkStatisticsAccumulator` and streams the corpus through it (one pass, or
[`corpus_analyses`][cw_lens.corpus_analyses] with others). `cw_lens.analyses.sinks.statistics`
holds the result it builds.
"""

from __future__ import annotations

from typing import Any

from cw_lens.analyses.sinks.accumulation import SinkStatisticsAccumulator
from cw_lens.analyses.sinks.detection import MIN_QUERY, SinkPositions
from cw_lens.analyses.sinks.statistics import SinkStatisticsResult
from cw_lens.analyses.sinks.statistics_layout import MAX_SAMPLES_PER_HEAD
from cw_lens.core.keywords import check_keywords
from cw_lens.data.documents import as_corpus
from cw_lens.data.streaming import stream_corpus
from cw_lens.models.access import Model


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
    samples_per_head: int | None = None,
    max_samples: int = MAX_SAMPLES_PER_HEAD,
    seed: int = 0,
    prepend_bos: bool = True,
    progress: bool = True,
    per_document: bool = False,
) -> SinkStatisticsResult:
    """Sink geometry over a corpus in one streamed pass (docs/methods.md#sinks).

    Args:
        model: A `TransformerBridge`.
        corpus: What [`cw_lens.load_corpus`][cw_lens.load_corpus] returns, a string, a list of
            strings, or token ids (read as [`cw_lens.Corpus`][cw_lens.Corpus] once, here: the
            sink detection, the accumulator and the pass read that corpus).
        sink_positions: Sink positions (default BOS, position 0) or `"detect"` (per document,
            keys whose mean attention exceeds 0.3 in some head). Positions count from each
            document's first token (BOS is 0; right padding never shifts them) and must be
            tokens of every document: one beyond a document raises
            [`InputError`][cw_lens.InputError] naming the document and its length.
        layers: Layers (`None` = all).
        batch_size: Documents per forward pass.
        min_query: Queries `i >= min_query` define sink rates and curves (methods page: 16).
        drift_k: Top-attended tail tokens kept out of the drift (methods page: 4).
        samples_per_head: `0` keeps no factor sample (no
            [`SinkStatisticsResult.drivers`][cw_lens.SinkStatisticsResult.drivers]); `None`
            (default) the sample of `max_samples`. Deprecated: any other value warns
            (`FutureWarning`) and acts as `None` (until 0.4.1 it was a per-document draw).
        max_samples: Factor samples kept per (layer, head) and group (sink / tail entries)
            over the whole corpus for the per-head rank correlations: the `max_samples` valid
            entries with the smallest keys `entry_keys(seed, layer, document, head, query,
            key)`, a uniform sample without replacement of the group's entries, the same for
            any batch size, query-block plan and sharding (memory fixed at about 44 bytes per
            sample, 24 MB for SmolLM2's 270 heads at the default); small corpora keep every
            entry.
        seed: Seed of the factor sample's keys.
        prepend_bos: Prepend BOS to text.
        progress: Show a progress bar.
        per_document: Also keep each document's sums per head (`RECORDED_SUMS` and a coarse
            cancelled-share histogram, float64: `8 * (14 + 26) * n_layers * n_heads` bytes per
            document, 86.4 KB for SmolLM2-135M's 270 heads): what a bootstrap over documents
            reads (`cw_lens.reproduction.claims(stats, Bootstrap(...))`).

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
    corpus = as_corpus(corpus)  # once: every step below reads this Corpus
    acc = SinkStatisticsAccumulator(
        model,
        corpus,
        sink_positions=sink_positions,
        layers=layers,
        min_query=min_query,
        drift_k=drift_k,
        samples_per_head=samples_per_head,
        max_samples=max_samples,
        seed=seed,
        batch_size=batch_size,
        prepend_bos=prepend_bos,
        per_document=per_document,
    )
    label = progress and "sink statistics"
    stats, _ = stream_corpus(
        model, corpus, [acc], batch_size=batch_size, prepend_bos=prepend_bos, progress=label
    )
    return acc.finish(stats)
