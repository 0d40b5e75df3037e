"""Several corpus analyses from one streamed pass ([`corpus_analyses`][cw_lens.corpus_analyses]).

[`sink_statistics`][cw_lens.sink_statistics], [`selection_geometry`][cw_lens.selection_geometry],
[`head_taxonomy`][cw_lens.head_taxonomy] and the clean pass of
[`sink_ablation`][cw_lens.sink_ablation] each stream the corpus through the model once, batch by
batch. `corpus_analyses` runs one forward pass per document batch for all of those asked for:
one capture, each layer's activations handed to every analysis's accumulator in turn, as the
same blocks of query rows (so what two analyses both read, such as the attention or the
per-head output norms, is computed once). Each analysis keeps its own accumulator and builds
its own result from it, so every result is bit for bit the one its own function returns with
the same arguments.

The sink ablation's patched passes (the patched NLL, and with `effect="total"` the patched
activations) cannot share the clean pass: they run after it, as in `sink_ablation`. A sink
detection (`sink_positions="detect"`) runs its own pass first, as in `sink_statistics`.

The time of the shared pass is split between the analyses it serves: each is charged what its
own accumulator took inside the pass (timed around its calls; on an accelerator this counts
only the work the host waits for) and what building its result took (with any further pass of
its own), plus an equal share of the rest of the pass (the forward pass, the capture, its
checks). The shares add up to the wall time of the call.

The public functions' docstrings have runnable examples.
"""

from __future__ import annotations

import inspect
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from torch import Tensor

from cw_lens.analyses.common import CorpusPlan
from cw_lens.analyses.selection.geometry import (
    SelectionGeometryResult,
    _plan_selection_geometry,
    selection_geometry,
)
from cw_lens.analyses.sinks.ablation import SinkAblationResult, _plan_sink_ablation, sink_ablation
from cw_lens.analyses.sinks.statistics import (
    SinkStatisticsResult,
    _plan_sink_statistics,
    sink_statistics,
)
from cw_lens.analyses.taxonomy import HeadTaxonomyResult, _plan_head_taxonomy, head_taxonomy
from cw_lens.core.errors import InputError
from cw_lens.core.keywords import check_keywords
from cw_lens.data.documents import as_corpus
from cw_lens.data.inputs import TokenBatch
from cw_lens.data.streaming import stream_corpus
from cw_lens.models.access import Model
from cw_lens.models.verify import require_verified

# each analysis: its own function (whose signature gives the defaults and the options it takes)
# and the plan that function streams
ANALYSES: dict[str, tuple[Callable[..., Any], Callable[..., CorpusPlan]]] = {
    "sinks": (sink_statistics, _plan_sink_statistics),
    "selection": (selection_geometry, _plan_selection_geometry),
    "taxonomy": (head_taxonomy, _plan_head_taxonomy),
    "ablation": (sink_ablation, _plan_sink_ablation),
}
# the arguments every analysis of the call shares: those of the pass
SHARED = ("batch_size", "prepend_bos", "progress", "per_document")


@dataclass(repr=False)
class CorpusAnalyses(Mapping):
    """The results of [`corpus_analyses`][cw_lens.corpus_analyses]: a mapping from each analysis
    run (`"sinks"`, `"selection"`, `"taxonomy"`, `"ablation"`) to its own result, in the order
    asked for; the same results are attributes (`None` for an analysis not run).

    Attributes:
        sinks: A [`SinkStatisticsResult`][cw_lens.SinkStatisticsResult].
        selection: A [`SelectionGeometryResult`][cw_lens.SelectionGeometryResult].
        taxonomy: A [`HeadTaxonomyResult`][cw_lens.HeadTaxonomyResult].
        ablation: A [`SinkAblationResult`][cw_lens.SinkAblationResult].
        seconds: Per analysis, the seconds of the call charged to it (the module docstring
            says how the shared pass is split); they add up to the call's wall time.
        n_documents: Documents streamed.
    """

    sinks: SinkStatisticsResult | None = None
    selection: SelectionGeometryResult | None = None
    taxonomy: HeadTaxonomyResult | None = None
    ablation: SinkAblationResult | None = None
    seconds: dict[str, float] = field(default_factory=dict)
    n_documents: int = 0

    def __getitem__(self, name: str) -> Any:
        if name not in self.seconds:
            raise KeyError(name)
        return getattr(self, name)

    def __iter__(self) -> Iterator[str]:
        return iter(self.seconds)

    def __len__(self) -> int:
        return len(self.seconds)

    def __repr__(self) -> str:
        return f"CorpusAnalyses({', '.join(self.seconds)}; {self.n_documents} documents)"


class _FanOut:
    """One accumulator that hands every streamed block to several (those that read its
    layer), timing each; it merges and comes to the host analysis by analysis."""

    def __init__(self, plans: Sequence[CorpusPlan]) -> None:
        """One pass's fan-out.

        Args:
            plans: The analyses' plans (their accumulators, layers and whether they read the
                logits).
        """
        self.accumulators = [plan.accumulator for plan in plans]
        self.layers = [set(plan.layers) for plan in plans]
        self.logits = [plan.need_logits for plan in plans]
        self.seconds = [0.0] * len(plans)

    def update(self, lc: Any) -> None:
        for i, accumulator in enumerate(self.accumulators):
            if lc.layer in self.layers[i]:
                start = time.perf_counter()
                accumulator.update(lc)
                self.seconds[i] += time.perf_counter() - start

    def update_logits(self, batch: TokenBatch, logits: Tensor) -> None:
        for i, accumulator in enumerate(self.accumulators):
            if self.logits[i]:
                start = time.perf_counter()
                accumulator.update_logits(batch, logits)
                self.seconds[i] += time.perf_counter() - start

    def to_host(self) -> None:
        for accumulator in self.accumulators:
            if callable(getattr(accumulator, "to_host", None)):
                accumulator.to_host()

    def merge(self, other: _FanOut) -> None:
        for mine, theirs in zip(self.accumulators, other.accumulators, strict=True):
            mine.merge(theirs)


def _options(analyses: Sequence[str] | Mapping[str, Mapping[str, Any]]) -> dict[str, dict]:
    """`{analysis: its own options}` from a list of names or a mapping, checked."""
    if isinstance(analyses, str) or not isinstance(analyses, Sequence | Mapping):
        raise InputError(
            f"analyses must be a list of names or a mapping of names to options, got {analyses!r}."
        )
    chosen = dict(analyses) if isinstance(analyses, Mapping) else {a: {} for a in analyses}
    unknown = [a for a in chosen if a not in ANALYSES]
    if unknown or not chosen or len(chosen) != len(analyses):
        raise InputError(
            f"analyses must name each of {', '.join(ANALYSES)} at most once (at least one), "
            f"got {list(analyses)!r}."
        )
    for name, options in chosen.items():
        if not isinstance(options, Mapping):
            raise InputError(f"The options of {name!r} must be a mapping, got {options!r}.")
        shared = sorted(set(options) & set(SHARED))
        if shared:
            raise InputError(
                f"{', '.join(shared)} is an argument of corpus_analyses, shared by every "
                f"analysis of the pass; pass it there, not among the options of {name!r}."
            )
    return {name: dict(options) for name, options in chosen.items()}


def _plan(model: Model, docs: Any, name: str, options: dict, shared: dict) -> CorpusPlan:
    """The plan of analysis `name`: its function's defaults, then `options` and the shared
    arguments (an option its function does not take is an error)."""
    function, plan = ANALYSES[name]
    try:
        bound = inspect.signature(function).bind(model, docs, **options, **shared)
    except TypeError as error:
        raise InputError(f"{name}: {error} (the options of {function.__name__})") from None
    bound.apply_defaults()
    return plan(**bound.arguments)


@check_keywords
def corpus_analyses(
    model: Model,
    corpus: Any,
    *,
    analyses: Sequence[str] | Mapping[str, Mapping[str, Any]] = tuple(ANALYSES),
    batch_size: int | None = 8,
    prepend_bos: bool = True,
    progress: bool = True,
    per_document: bool = False,
) -> CorpusAnalyses:
    """Several corpus analyses from one forward pass per document batch.

    Each result equals, bit for bit, the one its own function returns on the same corpus with
    the same arguments: [`sink_statistics`][cw_lens.sink_statistics] (`"sinks"`),
    [`selection_geometry`][cw_lens.selection_geometry] (`"selection"`),
    [`head_taxonomy`][cw_lens.head_taxonomy] (`"taxonomy"`) and
    [`sink_ablation`][cw_lens.sink_ablation] (`"ablation"`, whose patched passes run after the
    shared one). The pass is the capture every one of them needs, run once instead of once per
    analysis.

    Args:
        model: A `TransformerBridge` (`cw_lens.load_model()`).
        corpus: What [`cw_lens.load_corpus`][cw_lens.load_corpus] returns, a string, a list of
            strings, or token ids (a tensor `[pos]` or `[batch, pos]`, or a list of token-id
            lists, read as given).
        analyses: The analyses to run: names (default: all four), or a mapping from each name to
            its own options, the keyword arguments of its function
            (`{"sinks": {"seed": 1}, "selection": {"n_random": 8}}`); an option not given takes
            that function's default.
        batch_size: Documents per forward pass (shared by every analysis).
        prepend_bos: Prepend BOS to text (shared).
        progress: Show a progress bar over the document batches of the shared pass.
        per_document: Also keep each analysis's per-document record, for bootstrap intervals
            (shared; as in each function).

    Returns:
        A [`CorpusAnalyses`][cw_lens.analyses.corpus.CorpusAnalyses]: each analysis's result by
        name (`results["sinks"]`, or `results.sinks`) and the seconds charged to each.

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
    chosen = _options(analyses)
    require_verified(model)  # once, before any analysis's share is timed
    docs = as_corpus(corpus)
    shared = dict(
        batch_size=batch_size, prepend_bos=prepend_bos, progress=progress, per_document=per_document
    )
    plans, seconds = [], {}
    for name, options in chosen.items():
        began = time.perf_counter()
        plans.append(_plan(model, docs, name, options, shared))
        seconds[name] = time.perf_counter() - began  # checks, a sink detection's pass
    fan = _FanOut(plans)
    fan, stats = stream_corpus(
        model,
        docs,
        fan,
        layers=sorted(set().union(*(plan.layers for plan in plans))),
        batch_size=batch_size,
        prepend_bos=prepend_bos,
        need_logits=any(plan.need_logits for plan in plans),
        progress=progress and "corpus analyses",
    )
    # what no accumulator's own calls took (the forward pass, the capture and its checks),
    # shared equally
    rest = (time.perf_counter() - start) - sum(seconds.values()) - sum(fan.seconds)
    results = {}
    for plan, accumulator, own in zip(plans, fan.accumulators, fan.seconds, strict=True):
        began = time.perf_counter()
        results[plan.name] = plan.finish(accumulator, stats)
        seconds[plan.name] += own + rest / len(plans) + time.perf_counter() - began
    return CorpusAnalyses(**results, seconds=seconds, n_documents=stats.n_documents)
