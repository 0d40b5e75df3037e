"""The main job's steps: one function per analysis, each computing its result from a
`Job` (the model, the corpus, the settings) and returning what the
job stores; the order in which the job runs them, and which step needs another.

The corpus steps (sinks, ablation, selection, taxonomy) share one streamed pass
(`corpus_pass`): the first of them to run computes every one the run still needs and stores
the others at once; each is still stored and loaded on its own, with its share of the time.

The causal steps (faithfulness, pruning) run on a seeded random sample of the corpus windows
when their document counts are smaller than the corpus (`cw_lens.reproduction.state.causal_corpus`),
never on its first windows, which are the start of the text; the others on the whole corpus.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from cw_lens.core.errors import InputError
from cw_lens.reproduction.state import FIELD_TASKS, causal_corpus

if TYPE_CHECKING:
    from cw_lens.reproduction.state import Job


def on_corpus(job: Job, analysis: Callable[..., Any], corpus: Any = None, **settings: Any) -> Any:
    """`analysis` run on the job's model and corpus (or `corpus`, a part of it) with the
    job's batch size and progress bar, keeping each document's numbers (`per_document=True`)
    for the bootstrap intervals; `settings` are the analysis's own arguments."""
    return analysis(
        job.model,
        job.corpus if corpus is None else corpus,
        batch_size=job.config.batch_size,
        progress=job.progress,
        per_document=True,
        **settings,
    )


# The corpus steps one streamed pass serves (`corpus_pass`): each step's analysis in
# `corpus_analyses`, the key of its result in the step's value, and its own settings.
CORPUS_STEPS: dict[str, tuple[str, str, tuple[str, ...]]] = {
    "sinks": ("sinks", "stats", ("seed",)),
    "ablation": ("ablation", "ablation", ()),
    "selection": ("selection", "result", ("seed",)),
    "taxonomy": ("taxonomy", "result", ()),
}


def corpus_pass(job: Job, name: str) -> dict[str, Any]:
    """Corpus step `name`'s value, from one streamed pass that also computes every other corpus
    step of the run not computed or stored yet (`cw_lens.corpus_analyses`): those are stored
    at once (a resumed run loads them) and wait for their turn in `job.ahead`.

    Each step is charged its share of the pass (`CorpusAnalyses.seconds`: its own
    accumulator's time and its result's, and an equal share of the forward passes).

    Args:
        job: The running job.
        name: The corpus step that runs now (a key of `CORPUS_STEPS`).

    Returns:
        Its value, as the job stores it.
    """
    from cw_lens.analyses.corpus import corpus_analyses

    wanted = [
        step
        for step in CORPUS_STEPS
        if step == name
        or (step in job.steps and step not in job.results and not job.is_stored(step))
    ]
    analyses = {
        CORPUS_STEPS[step][0]: {key: getattr(job.config, key) for key in CORPUS_STEPS[step][2]}
        for step in wanted
    }
    results = corpus_analyses(
        job.model,
        job.corpus,
        analyses=analyses,
        batch_size=job.config.batch_size,
        progress=job.progress,
        per_document=True,
    )
    for step in wanted:
        analysis, key, _ = CORPUS_STEPS[step]
        if step == name:
            job.charged[step] = results.seconds[analysis]
        else:
            job.store_ahead(step, {key: results[analysis]}, results.seconds[analysis])
    analysis, key, _ = CORPUS_STEPS[name]
    return {key: results[analysis]}


def step_sinks(job: Job) -> dict[str, Any]:
    return corpus_pass(job, "sinks")


def step_heatmaps(job: Job) -> dict[str, Any]:
    """P1 Fig. 1: attention and contribution matrices of two sink heads on one text — the sink
    heads (in different layers) whose sink attention exceeds the sink's contribution most."""
    from cw_lens.analyses.contributions import contribution_weights

    heads = job.results["sinks"]["stats"].heads()
    gap = heads["sink_attention"] - heads["sink_contribution"]
    sink = heads.assign(gap=gap)[heads["sink_head"]].sort_values("gap", ascending=False)
    picks = []
    for _, row in sink.iterrows():
        if all(abs(int(row["layer"]) - p[0]) > 3 for p in picks):
            picks.append((int(row["layer"]), int(row["head"])))
        if len(picks) == 2:
            break
    if not picks:
        picks = [(job.model.cfg.n_layers // 2, 0)]
    doc = job.corpus[0]
    text_tokens = list(doc.tokens[:31]) if doc.tokens is not None else None
    inputs = doc.text[:160] if text_tokens is None else job.model.tokenizer.decode(text_tokens)
    result = contribution_weights(
        job.model, inputs, layers=sorted({p[0] for p in picks}), kind="intra"
    )
    return {"result": result, "picks": picks}


def step_ablation(job: Job) -> dict[str, Any]:
    return corpus_pass(job, "ablation")


def step_faithfulness(job: Job) -> dict[str, Any]:
    from cw_lens.analyses.faithfulness import faithfulness

    result = on_corpus(
        job,
        faithfulness,
        causal_corpus(job, "faithfulness"),
        granularity=job.config.faithfulness_granularity,
        seed=job.config.seed,
        n_random=job.config.random_draws,
    )
    return {"result": result}


def step_task_faithfulness(job: Job) -> dict[str, Any] | None:
    from cw_lens.analyses.faithfulness import faithfulness
    from cw_lens.data.corpora import load_corpus

    if not job.config.task:
        return None
    items = load_corpus(
        job.config.task,
        n_docs=job.config.task_docs,
        model=job.model,
        only_correct=True,
        seed=job.config.seed,
    )
    result = faithfulness(
        job.model,
        items,
        fractions=(0.02, 0.1, 0.5),
        granularity="pairs",
        batch_size=16,
        seed=job.config.seed,
        progress=job.progress,
    )
    return {"result": result, "n_items": len(items), "task": job.config.task}


def step_selection(job: Job) -> dict[str, Any]:
    return corpus_pass(job, "selection")


def step_taxonomy(job: Job) -> dict[str, Any]:
    return corpus_pass(job, "taxonomy")


def step_pruning(job: Job) -> dict[str, Any]:
    """P2 pruning ranked within each layer (the methods page's reading, with the lone-head
    costs; the taxonomy and entropy rankings cross-fitted) and, as the variant, with one global
    ranking (3 random draws). Both on the random sample of `pruning_docs` windows (its two
    cross-fitting halves are that sample's even and odd documents), the lone-head costs on
    `lone_docs` of them."""
    from cw_lens.analyses.pruning import prune_heads

    cfg = job.config
    corpus = causal_corpus(job, "pruning")
    lone_corpus = causal_corpus(job, "lone_costs")
    orders = ("taxonomy", "magnitude", "entropy", "random")
    result = on_corpus(
        job,
        prune_heads,
        corpus,
        order=orders,
        seed=cfg.seed,
        scope="layer",
        n_draws=cfg.pruning_draws,
        draws_everywhere=cfg.pruning_draws_everywhere,
        lone_corpus=lone_corpus,
        lone_docs=len(lone_corpus),
    )
    global_ranking = None
    if cfg.global_ranking:
        global_ranking = prune_heads(
            job.model,
            corpus,
            order=orders,
            seed=cfg.seed,
            batch_size=cfg.batch_size,
            progress=job.progress,
            scope="global",
            lone=False,
        )
    return {"result": result, "global": global_ranking}


def step_field_pairs(job: Job) -> dict[str, Any] | None:
    """The pair-level comparison with other tools' metrics (`contribution_vs_field_pairs`):
    faithfulness at pairs granularity with every pair metric (`FIELD_PAIR_METRICS`) and 3
    random draws, on the random sample of `field_docs` windows.

    Args:
        job: The running job.

    Returns:
        `{"result": FaithfulnessResult}`, or None when `field_docs` is 0.
    """
    from cw_lens.analyses.faithfulness import faithfulness
    from cw_lens.reproduction.field_comparison import FIELD_PAIR_METRICS, FIELD_RANDOM_DRAWS

    if not job.config.field_docs:
        return None
    result = on_corpus(
        job,
        faithfulness,
        causal_corpus(job, "field"),
        metrics=FIELD_PAIR_METRICS,
        granularity=("pairs",),
        seed=job.config.seed,
        n_random=FIELD_RANDOM_DRAWS,
    )
    return {"result": result}


def step_field_inputs(job: Job) -> dict[str, Any] | None:
    """The input-level comparison with other tools' attribution methods
    (`contribution_vs_field_inputs_<task>`): every method of the input deletion test on
    `field_items` items of each task corpus of `FIELD_TASKS` that the model answers correctly.

    Args:
        job: The running job.

    Returns:
        `{task: InputDeletionResult}`, or None when `field_items` is 0.
    """
    from cw_lens.data.corpora import load_corpus
    from cw_lens.flow.input_deletion import input_deletion

    if not job.config.field_items:
        return None
    out = {}
    for task in FIELD_TASKS:
        items = load_corpus(
            task,
            n_docs=job.config.field_items,
            model=job.model,
            only_correct=True,
            seed=job.config.seed,
        )
        out[task] = input_deletion(
            job.model, items, seed=job.config.seed, batch_size=16, progress=job.progress
        )
    return out


STEPS: tuple[tuple[str, Callable[[Job], Any]], ...] = (
    ("sinks", step_sinks),
    ("heatmaps", step_heatmaps),
    ("ablation", step_ablation),
    ("faithfulness", step_faithfulness),
    ("task_faithfulness", step_task_faithfulness),
    ("selection", step_selection),
    ("taxonomy", step_taxonomy),
    ("pruning", step_pruning),
    ("field_pairs", step_field_pairs),
    ("field_inputs", step_field_inputs),
)
STEP_NAMES = tuple(name for name, _ in STEPS)
# a step that reads another's result: selecting it selects that one too
STEP_NEEDS = {"heatmaps": ("sinks",), "pruning": ("taxonomy",)}


# what each step's value holds (`stored_value_problem`): its keys and what each key may be, a
# result class (`result_classes`), "count", "text", "picks" ((layer, head) pairs) or None
STORED_FIELDS: dict[str, dict[str, tuple[str | None, ...]]] = {
    "sinks": {"stats": ("SinkStatisticsResult",)},
    "heatmaps": {"result": ("ContributionResult",), "picks": ("picks",)},
    "ablation": {"ablation": ("SinkAblationResult",)},
    "faithfulness": {"result": ("FaithfulnessResult",)},
    "task_faithfulness": {
        "result": ("FaithfulnessResult",),
        "n_items": ("count",),
        "task": ("text",),
    },
    "selection": {"result": ("SelectionGeometryResult",)},
    "taxonomy": {"result": ("HeadTaxonomyResult",)},
    "pruning": {"result": ("PruningResult",), "global": ("PruningResult", None)},
    "field_pairs": {"result": ("FaithfulnessResult",)},
    "field_inputs": {task: ("InputDeletionResult",) for task in FIELD_TASKS},
}
# the steps whose value is None when the run leaves them out (no task, no comparison)
OPTIONAL_STEPS = ("task_faithfulness", "field_pairs", "field_inputs")


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 1 << 31


def result_classes() -> dict[str, type]:
    """The result classes the steps store, by name.

    Returns:
        `{class name: class}`.
    """
    from cw_lens.analyses.contributions import ContributionResult
    from cw_lens.analyses.faithfulness import FaithfulnessResult
    from cw_lens.analyses.pruning import PruningResult
    from cw_lens.analyses.selection import SelectionGeometryResult
    from cw_lens.analyses.sinks import SinkAblationResult, SinkStatisticsResult
    from cw_lens.analyses.taxonomy import HeadTaxonomyResult
    from cw_lens.flow.input_deletion import InputDeletionResult

    classes = (
        InputDeletionResult,
        ContributionResult,
        FaithfulnessResult,
        PruningResult,
        SelectionGeometryResult,
        SinkAblationResult,
        SinkStatisticsResult,
        HeadTaxonomyResult,
    )
    return {cls.__name__: cls for cls in classes}


def _holds(value: Any, kind: str | None) -> bool:
    """Whether `value` is of `kind` (`STORED_FIELDS`)."""
    if kind is None:
        return value is None
    if kind == "count":
        return _is_count(value)
    if kind == "text":
        return isinstance(value, str)
    if kind == "picks":  # (layer, head) pairs
        return isinstance(value, (list, tuple)) and all(
            isinstance(p, (list, tuple)) and len(p) == 2 and all(map(_is_count, p)) for p in value
        )
    return isinstance(value, result_classes()[kind])


def stored_value_problem(name: str, value: Any) -> str | None:
    """Why `value`, loaded from the stored step `name`, is not a value that step returns.

    Args:
        name: A step of `STEPS`.
        value: What its file held.

    Returns:
        The problem (the key and what was expected), or None when it is such a value.

    Examples:
        >>> stored_value_problem("sinks", {})
        "expected the keys ['stats'], got []"
    """
    fields = STORED_FIELDS[name]
    if name in OPTIONAL_STEPS and value is None:  # the run has no task or no comparison
        return None
    if not isinstance(value, dict):
        return f"expected an object with the keys {sorted(fields)}, got a {type(value).__name__}"
    if set(value) != set(fields):
        return f"expected the keys {sorted(fields)}, got {sorted(map(str, value))[:8]}"
    for key, kinds in fields.items():
        if not any(_holds(value[key], kind) for kind in kinds):
            wanted = " or ".join(str(kind) for kind in kinds)
            return f"{key!r}: expected {wanted}, got a {type(value[key]).__name__}"
    return None


def select_steps(
    steps: Sequence[str] | None = None, skip: Sequence[str] | None = None
) -> tuple[str, ...]:
    """The steps a run computes, in job order: `steps` (default: all) without `skip`, plus
    what the chosen steps need (`heatmaps` needs `sinks`, `pruning` `taxonomy`).
    Unknown names are an error."""
    for given in (steps or (), skip or ()):
        unknown = [s for s in given if s not in STEP_NAMES]
        if unknown:
            raise InputError(
                f"Unknown step(s) {', '.join(map(repr, unknown))}; the steps are "
                f"{', '.join(STEP_NAMES)}."
            )
    chosen = {s for s in (STEP_NAMES if steps is None else steps) if s not in (skip or ())}
    if not chosen:
        raise InputError("No step left to run: --steps/--skip removed every step.")
    for name in list(chosen):
        chosen.update(STEP_NEEDS.get(name, ()))
    return tuple(s for s in STEP_NAMES if s in chosen)
