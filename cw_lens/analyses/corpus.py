"""Several corpus analyses from one streamed pass ([`corpus_analyses`][cw_lens.corpus_analyses]).

Every corpus analysis is an accumulator (`cw_lens.core.accumulators.Accumulator`): it folds each
streamed layer block into a few tensors on the model's device, and builds its result from them
once the pass is over. [`sink_statistics`][cw_lens.sink_statistics],
[`selection_geometry`][cw_lens.selection_geometry], [`head_taxonomy`][cw_lens.head_taxonomy] and
the clean pass of [`sink_ablation`][cw_lens.sink_ablation] each run one pass for their own
accumulator. `corpus_analyses` runs one forward pass per document batch for all of those asked
for, and for accumulators of your own: one capture, each layer's blocks handed to every
accumulator that reads that layer, so what two of them both read (the attention, the per-head
output norms) is computed once. Each accumulator is the same object its own function feeds, so
each result equals that function's.

The sink ablation's patched passes (the patched NLL, and with `effect="total"` the patched
activations) cannot share the clean pass: they run after it, from its `finish`. A sink detection
(`sink_positions="detect"`) runs its own pass when its accumulator is built.

The time of the shared pass is split between the analyses it serves: each is charged what
building its accumulator took (its checks, a detection's pass), what its own calls took inside
the pass (on an accelerator this counts only the work the host waits for) and what its `finish`
took (with any further pass of its own), plus an equal share of the rest of the pass (the forward
pass, the capture, its checks). The shares add up to the wall time of the call.

Examples:
    ```python
    import cw_lens

    model = cw_lens.load_model("testing:tiny-llama")
    corpus = cw_lens.load_corpus(n_docs=4, max_tokens=32, model=model)
    sinks = cw_lens.SinkStatisticsAccumulator(model, corpus, seed=1)
    results = cw_lens.corpus_analyses(model, corpus, analyses=[sinks, "taxonomy"], progress=False)
    results["sinks"].heads()
    results.taxonomy.regime_shares()
    ```
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from cw_lens.analyses.selection.geometry import (
    SelectionGeometryAccumulator,
    SelectionGeometryResult,
)
from cw_lens.analyses.sinks import (
    SinkAblationAccumulator,
    SinkAblationResult,
    SinkStatisticsAccumulator,
    SinkStatisticsResult,
)
from cw_lens.analyses.taxonomy import HeadTaxonomyAccumulator, HeadTaxonomyResult
from cw_lens.core.accumulators import Accumulator
from cw_lens.core.errors import InputError
from cw_lens.core.keywords import check_keywords
from cw_lens.data.documents import as_corpus
from cw_lens.data.streaming import stream_corpus
from cw_lens.models.access import Model
from cw_lens.models.verify import require_verified

# the analyses corpus_analyses builds by name: each one's accumulator class (its constructor takes
# that analysis's options, the keyword arguments of its function)
ANALYSES: dict[str, type[Accumulator]] = {
    "sinks": SinkStatisticsAccumulator,
    "selection": SelectionGeometryAccumulator,
    "taxonomy": HeadTaxonomyAccumulator,
    "ablation": SinkAblationAccumulator,
}
# the arguments every analysis of the call shares: those of the pass
SHARED = ("batch_size", "prepend_bos", "progress", "per_document")


class CorpusAnalyses(Mapping):
    """The results of [`corpus_analyses`][cw_lens.corpus_analyses]: a mapping from each
    accumulator's name (`"sinks"`, `"selection"`, `"taxonomy"`, `"ablation"`, or your own's) to
    its result, in the order given; the four built-in results are also attributes (`None` for an
    analysis not run).

    Args:
        results: Each accumulator's result, by its name, in the order run.
        seconds: Per analysis, the seconds of the call charged to it.
        n_documents: Documents streamed.

    Attributes:
        seconds: Per analysis, the seconds of the call charged to it (the module docstring
            says how the shared pass is split); they add up to the call's wall time.
        n_documents: Documents streamed.
    """

    def __init__(self, results: dict[str, Any], seconds: dict[str, float], n_documents: int):
        self._results = dict(results)
        self.seconds = dict(seconds)
        self.n_documents = n_documents

    @property
    def sinks(self) -> SinkStatisticsResult | None:
        """The sink statistics, or None."""
        return self._results.get("sinks")

    @property
    def selection(self) -> SelectionGeometryResult | None:
        """The selection geometry, or None."""
        return self._results.get("selection")

    @property
    def taxonomy(self) -> HeadTaxonomyResult | None:
        """The head taxonomy, or None."""
        return self._results.get("taxonomy")

    @property
    def ablation(self) -> SinkAblationResult | None:
        """The sink ablation, or None."""
        return self._results.get("ablation")

    def __getitem__(self, name: str) -> Any:
        if name not in self._results:
            raise KeyError(name)
        return self._results[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._results)

    def __len__(self) -> int:
        return len(self._results)

    def __repr__(self) -> str:
        return f"CorpusAnalyses({', '.join(self._results)}; {self.n_documents} documents)"


def _requested(
    analyses: Sequence[str | Accumulator] | Mapping[str, Mapping[str, Any]],
) -> list[tuple[str, Accumulator | dict]]:
    """`[(name, accumulator or the options to build it with)]`, checked."""
    if isinstance(analyses, str | Accumulator) or not isinstance(analyses, Sequence | Mapping):
        raise InputError(
            "analyses must be a list of names and accumulators, or a mapping of names to "
            f"options, got {analyses!r}."
        )
    if isinstance(analyses, Mapping):
        items = list(analyses.items())
    else:
        items = [(a.name, a) if isinstance(a, Accumulator) else (a, {}) for a in analyses]
    names = [name for name, _ in items]
    unknown = [n for n, what in items if not isinstance(what, Accumulator) and n not in ANALYSES]
    if unknown or not items or len(set(names)) != len(names):
        raise InputError(
            f"analyses must name each of {', '.join(ANALYSES)} (or give an accumulator) at most "
            f"once, at least one, got {names!r}."
        )
    for name, what in items:
        if isinstance(what, Accumulator):
            if not what.name:
                raise InputError(
                    f"The accumulator {type(what).__name__} has no name to file its result "
                    "under: set its class attribute `name`."
                )
            continue
        if not isinstance(what, Mapping):
            raise InputError(f"The options of {name!r} must be a mapping, got {what!r}.")
        shared = sorted(set(what) & set(SHARED))
        if shared:
            raise InputError(
                f"{', '.join(shared)} is an argument of corpus_analyses, shared by every "
                f"analysis of the pass; pass it there, not among the options of {name!r}."
            )
    return [(n, w if isinstance(w, Accumulator) else dict(w)) for n, w in items]


@check_keywords
def corpus_analyses(
    model: Model,
    corpus: Any,
    *,
    analyses: Sequence[str | Accumulator] | Mapping[str, Mapping[str, Any]] = tuple(ANALYSES),
    batch_size: int | None = 8,
    prepend_bos: bool = True,
    progress: bool = True,
    per_document: bool = False,
) -> CorpusAnalyses:
    """Several corpus analyses from one forward pass per document batch.

    Each result equals the one its own function returns on the same corpus with the same
    arguments: [`sink_statistics`][cw_lens.sink_statistics] (`"sinks"`),
    [`selection_geometry`][cw_lens.selection_geometry] (`"selection"`),
    [`head_taxonomy`][cw_lens.head_taxonomy] (`"taxonomy"`) and
    [`sink_ablation`][cw_lens.sink_ablation] (`"ablation"`, whose patched passes run after the
    shared one): both feed the same accumulator the same blocks. Accumulators of your own
    (`cw_lens.core.accumulators.Accumulator`) ride along on the same pass.

    Args:
        model: A `TransformerBridge` (`cw_lens.load_model()`) or a `HookedTransformer`.
        corpus: What [`cw_lens.load_corpus`][cw_lens.load_corpus] returns, a string, a list of
            strings, or token ids (a tensor `[pos]` or `[batch, pos]`, or a list of token-id
            lists, read as given).
        analyses: The analyses to run: names (default: all four) and accumulators (built with
            their options, e.g. `cw_lens.SinkStatisticsAccumulator(model, corpus, seed=1)`, or
            your own), or a mapping from each name to its options, the keyword arguments of its
            function (`{"sinks": {"seed": 1}, "selection": {"n_random": 8}}`); an option not given
            takes that function's default.
        batch_size: Documents per forward pass (shared by every analysis).
        prepend_bos: Prepend BOS to text (shared).
        progress: Show a progress bar over the document batches of the shared pass.
        per_document: Also keep each analysis's per-document record, for bootstrap intervals
            (shared by the analyses built by name; as in each function).

    Returns:
        A [`CorpusAnalyses`][cw_lens.analyses.corpus.CorpusAnalyses]: each analysis's result by
        name (`results["sinks"]`, or `results.sinks`) and the seconds charged to each.

    Raises:
        InputError: for an unknown analysis name, a name given twice, options that are not a
            mapping or that hold an argument of the pass, or an option its analysis does not take.

    Examples:
        ```python
        import cw_lens

        model = cw_lens.load_model("testing:tiny-llama")
        corpus = cw_lens.load_corpus(n_docs=4, max_tokens=32, model=model)
        results = cw_lens.corpus_analyses(
            model, corpus, analyses=("sinks", "selection", "taxonomy"), progress=False
        )
        results.sinks.heads()          # as cw_lens.sink_statistics(model, corpus) gives it
        results.taxonomy.regime_shares()
        results.seconds                # each analysis's share of the time
        ```
    """
    start = time.perf_counter()
    requested = _requested(analyses)
    require_verified(model)  # once, before any analysis's share is timed
    docs = as_corpus(corpus)
    accumulators, seconds = [], {}
    for name, what in requested:
        began = time.perf_counter()
        if not isinstance(what, Accumulator):
            shared = dict(batch_size=batch_size, prepend_bos=prepend_bos, per_document=per_document)
            try:
                what = ANALYSES[name](model, docs, **what, **shared)
            except TypeError as error:  # an option the analysis does not take
                what_takes = ANALYSES[name].__name__
                raise InputError(f"{name}: {error} (the options of {what_takes})") from None
        accumulators.append(what)
        seconds[name] = time.perf_counter() - began  # checks, a sink detection's pass
    stats, inside = stream_corpus(
        model,
        docs,
        accumulators,
        batch_size=batch_size,
        prepend_bos=prepend_bos,
        progress=progress and "corpus analyses",
    )
    # what no accumulator's own calls took (the forward pass, the capture and its checks),
    # shared equally
    rest = (time.perf_counter() - start) - sum(seconds.values()) - sum(inside)
    results = {}
    for (name, _), accumulator, own in zip(requested, accumulators, inside, strict=True):
        began = time.perf_counter()
        results[name] = accumulator.finish(stats)
        seconds[name] += own + rest / len(accumulators) + time.perf_counter() - began
    return CorpusAnalyses(results, seconds, stats.n_documents)
