"""The faithfulness run over a corpus ([`faithfulness`][cw_lens.faithfulness]): clean ranks, the
removal passes, their curves and AOPC, and its result class
([`FaithfulnessResult`][cw_lens.FaithfulnessResult]); its sums are kept in
`cw_lens.analyses.faithfulness.outcomes`, its claim judged in
`cw_lens.reproduction.faithfulness_claims`.

The protocol, its formulas, citations and a runnable example are in the package docstring,
`cw_lens.analyses.faithfulness`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import pandas as pd
from torch import Tensor
from tqdm.auto import tqdm

from cw_lens.analyses.faithfulness.outcomes import TASK_SUMS, TEXT_SUMS, Outcomes
from cw_lens.analyses.faithfulness.ranking import (
    ALL_METRICS,
    FRACTIONS,
    GRANULARITIES,
    KNOWN_METRICS,
    MODES,
    Ranks,
    random_draw_names,
)
from cw_lens.core.deprecation import keyword_only, moved_to_reproduction, renamed_kwargs
from cw_lens.core.errors import InputError
from cw_lens.core.keywords import check_keywords
from cw_lens.core.registry import saveable
from cw_lens.core.results import Result
from cw_lens.data.distributed import current_shard
from cw_lens.data.documents import as_corpus
from cw_lens.data.inputs import TokenBatch, answer_spans, iter_batches, prepare_inputs
from cw_lens.data.scoring import answer_logprobs, run_logits, token_nll
from cw_lens.data.streaming import stream_contributions
from cw_lens.models.access import Model
from cw_lens.models.blocks import run_blocks
from cw_lens.models.gradients import attention_output_gradients
from cw_lens.models.verify import require_flow, require_verified


@saveable
@dataclass(repr=False)
class FaithfulnessResult(Result):
    """Curves of the faithfulness protocol; one row per (granularity, metric, mode, fraction).

    Columns: `granularity, metric, mode, fraction, nll, delta_nll, ppl, delta_ppl` and, on
    task corpora, `logprob, delta_logprob, accuracy` (the clean values are in `clean`).
    `delta_nll` is the change of the mean next-token NLL (what methods § Faithfulness
    (docs/methods.md#faithfulness) calls ΔPPL); `delta_ppl` is the change of `exp(mean NLL)`.
    """

    curves: pd.DataFrame
    clean: dict[str, float]
    task: bool
    n_documents: int
    n_tokens: int
    ranking: Literal["abs", "signed"]
    seed: int
    first_query: int = 1
    # opt-in: (statistic names, [document, statistic] sums, configurations) for intervals
    per_document: tuple[list[str], Tensor, list] | None = None

    def to_dataframe(self) -> pd.DataFrame:
        """The curves: one row per (granularity, metric, mode, fraction).

        Returns:
            A copy of `curves` (the columns are listed in the class docstring).

        Examples:
            ```python
            import cw_lens

            model = cw_lens.load_model("testing:tiny-llama")
            corpus = cw_lens.load_corpus(n_docs=2, max_tokens=16, model=model)
            faith = cw_lens.faithfulness(
                model, corpus, fractions=(0.5,), per_document=True, progress=False
            )
            faith.to_dataframe().head()
            ```
        """
        return self.curves.copy()

    @property
    def value_column(self) -> str:
        """The main damage measure: `delta_logprob` on tasks (a drop), else `delta_nll`."""
        return "delta_logprob" if self.task else "delta_nll"

    def aopc(self, column: str | None = None) -> pd.DataFrame:
        """Area over the perturbation curve: the mean of `column` over the fraction grid.

        Comprehensiveness: higher = more faithful; sufficiency: lower = more faithful. (For
        `delta_logprob` the drop is counted, so the same holds.)

        Args:
            column: The damage measure (default: `value_column`, `delta_logprob` on task corpora,
                else `delta_nll`).

        Returns:
            A DataFrame indexed by (granularity, mode), one column per metric.

        Examples:
            ```python
            import cw_lens

            model = cw_lens.load_model("testing:tiny-llama")
            corpus = cw_lens.load_corpus(n_docs=2, max_tokens=16, model=model)
            faith = cw_lens.faithfulness(
                model, corpus, fractions=(0.5,), per_document=True, progress=False
            )
            faith.aopc()
            ```
        """
        column = column or self.value_column
        values = self.curves[column]
        if column == "delta_logprob":
            values = -values
        frame = self.curves.assign(value=values)
        table = frame.groupby(["granularity", "mode", "metric"])["value"].mean()
        present = list(frame["metric"].unique())
        extra_draws = [m for m in present if m not in KNOWN_METRICS]
        return table.unstack("metric").reindex(
            columns=[m for m in KNOWN_METRICS if m in present] + extra_draws
        )

    def random_spread(self, column: str | None = None) -> pd.DataFrame:
        """The random-ranking control over its independent draws (`n_random`).

        Args:
            column: The damage measure (default: `value_column`).

        Returns:
            A DataFrame per (granularity, mode): the number of draws and the mean, standard
            deviation (ddof=1; NaN for one draw), minimum and maximum of their AOPCs.

        Examples:
            ```python
            import cw_lens

            model = cw_lens.load_model("testing:tiny-llama")
            corpus = cw_lens.load_corpus(n_docs=2, max_tokens=16, model=model)
            faith = cw_lens.faithfulness(
                model, corpus, fractions=(0.5,), per_document=True, progress=False
            )
            faith.random_spread()  # n_random=3 for a spread over three draws
            ```
        """
        draws = _random_columns(self.aopc(column))
        if draws.shape[1] == 0:
            raise InputError("This result has no random ranking; run with metrics incl. 'random'.")
        return pd.DataFrame(
            {
                "n_draws": draws.shape[1],
                "mean": draws.mean(1),
                "sd": draws.std(1, ddof=1),
                "min": draws.min(1),
                "max": draws.max(1),
            }
        )

    @keyword_only("mode")
    def top(self, k: int = 10, *, mode: str = "comprehensiveness") -> pd.DataFrame:
        """Metrics ranked by AOPC for one mode (best first).

        Args:
            k: How many metrics.
            mode: `"comprehensiveness"` (highest AOPC first) or `"sufficiency"` (lowest first);
                keyword only (by position it is deprecated).

        Returns:
            A DataFrame, one row per metric, one column per granularity.

        Examples:
            ```python
            import cw_lens

            model = cw_lens.load_model("testing:tiny-llama")
            corpus = cw_lens.load_corpus(n_docs=2, max_tokens=16, model=model)
            faith = cw_lens.faithfulness(
                model, corpus, fractions=(0.5,), per_document=True, progress=False
            )
            faith.top(3)
            ```
        """
        table = self.aopc().xs(mode, level="mode").T
        ascending = mode == "sufficiency"
        return table.sort_values(table.columns[0], ascending=ascending).head(k)

    @property
    def n_random_draws(self) -> int:
        """How many draws of the random ranking the curves hold (`random`, `random#2`, ...; 0
        without the `random` metric)."""
        return sum(str(m).startswith("random") for m in self.curves["metric"].unique())

    # deprecated: cw_lens.reproduction.claims(result, bootstrap)
    claims = moved_to_reproduction("claims")
    replicates = moved_to_reproduction("replicates")

    def plot(self, **kw: Any) -> Any:
        """The perturbation curves: the damage against the fraction removed, per metric.

        Args:
            **kw: Passed to `cw_lens.plots.faithfulness.plot_faithfulness_curves` (`column`,
                `figsize_per_panel`).

        Returns:
            A matplotlib Figure.

        Examples:
            ```python
            import cw_lens

            model = cw_lens.load_model("testing:tiny-llama")
            corpus = cw_lens.load_corpus(n_docs=2, max_tokens=16, model=model)
            faith = cw_lens.faithfulness(
                model, corpus, fractions=(0.5,), per_document=True, progress=False
            )
            fig = faith.plot()
            ```
        """
        from cw_lens.plots.faithfulness import plot_faithfulness_curves

        return plot_faithfulness_curves(self, **kw)


def _random_columns(aopc: pd.DataFrame) -> pd.DataFrame:
    """The AOPC columns of the random ranking's draws (`random`, `random#2`, ...)."""
    return aopc[[m for m in aopc.columns if m.startswith("random")]]


@check_keywords
@renamed_kwargs(random_draws="n_random")
def faithfulness(
    model: Model,
    corpus: Any,
    *,
    metrics: Sequence[str] = ALL_METRICS,
    fractions: Sequence[float] = FRACTIONS,
    modes: Sequence[str] = MODES,
    ranking: Literal["abs", "signed"] = "abs",
    granularity: str | Sequence[str] = "pairs",
    batch_size: int | None = 8,
    seed: int = 0,
    first_query: int = 1,
    prepend_bos: bool = True,
    progress: bool = True,
    per_document: bool = False,
    n_random: int = 1,
) -> FaithfulnessResult:
    """Run the faithfulness protocol of methods § Faithfulness (docs/methods.md#faithfulness) on a
    corpus.

    Args:
        model: A `TransformerBridge`.
        corpus: Text (`load_corpus()`, a list of strings) — measured by the NLL change — or a
            task corpus (`load_corpus("ioi")`, items with `answer`) — measured by the answer
            log-probability and accuracy.
        metrics: Any of `attention`, `value_norm`, `value_norm_output`, `contribution`
            (inter-head), `random` (the default: all five), and two metrics of other tools
            (docs/methods.md#faithfulness): `alti` (L1 proximity, as the LLM Transparency Tool
            scores attention; one more clean pass per batch, on models the flow analyses
            support) and `attribution_patching` (`-alpha dL/dalpha`, the first-order
            prediction of the removal; one forward and one backward pass per batch).
        fractions: Shares of candidates removed (each in [0, 1]).
        modes: `comprehensiveness` (remove the top) and/or `sufficiency` (the bottom).
        ranking: `"abs"` ranks by `|score|`; `"signed"` by the score.
        granularity: `"pairs"`, `"tokens"` or both (`("pairs", "tokens")`): they share
            the clean pass.
        batch_size: Documents per pass. One clean (streamed) pass per batch, then one
            intervened pass per (granularity, metric, mode, fraction).
        seed: Seed of the `random` ranking (per document and layer, so it is reproducible).
        first_query: Queries `i < first_query` are never intervened on
            (docs/methods.md#faithfulness: 1, so query 0 is left intact: it has a single
            candidate, BOS reading itself, and the at-least-one rule would remove the sink's own
            attention output in every layer for every metric and mode; `first_query=0`
            intervenes on every query).
        prepend_bos: Prepend BOS (position 0 is then the usual sink).
        progress: Show a progress bar over document batches.
        per_document: Also keep each document's NLL (or answer log-probability) sum and count
            per configuration (`8 * (1 + configurations) + 1` bytes per document, 969 bytes
            with both granularities and the defaults) for bootstrap intervals of the AOPCs
            (`cw_lens.reproduction.claims(result, bootstrap)`).
        n_random: Independent draws of the `random` ranking (metrics `random`,
            `random#2`, ...; the first is the same with any number of draws), for the
            control's spread over draws
            ([`FaithfulnessResult.random_spread`][cw_lens.FaithfulnessResult.random_spread]). Each
            extra draw costs `len(granularity) * len(modes) * len(fractions)` passes per batch
            (24 with the defaults). Default 1, P1's single draw: this is the slowest analysis.

    Returns:
        A [`FaithfulnessResult`][cw_lens.FaithfulnessResult]: the curves, the clean values
        and, with `per_document`, the per-document record.

    Cost: `1 + len(granularity) * len(metrics) * len(modes) * len(fractions)` forward passes
    per batch (61 for one granularity with the defaults), one more with `alti` and one forward
    and backward pass more with `attribution_patching`; ranks are kept as int16.

    Examples:
        ```python
        import cw_lens

        model = cw_lens.load_model("testing:tiny-llama")
        corpus = cw_lens.load_corpus(n_docs=2, max_tokens=16, model=model)
        faith = cw_lens.faithfulness(
            model, corpus, fractions=(0.5,), per_document=True, progress=False
        )
        faith.aopc()            # AOPC per (granularity, mode) and metric
        faith.top(3)            # the metrics, most faithful first
        fig = faith.plot()
        ```
    """
    # Long: after the checks (_checked_options), one loop per batch (the clean pass, then one
    # intervened pass per configuration) whose ranks are freed before the next batch's are built.
    require_verified(model)
    metrics, modes, grans, fractions = _checked_options(
        metrics, modes, granularity, ranking, fractions, first_query, n_random
    )
    if "alti" in metrics:
        require_flow(model)  # ALTI reads the residual stream: its hooks are checked

    docs = as_corpus(corpus)
    task = docs.is_task
    if task:
        prepared, all_spans = answer_spans(model, list(docs), prepend_bos)
    else:
        prepared, all_spans = prepare_inputs(model, docs, prepend_bos=prepend_bos), None
    n_tokens = int(prepared.mask.sum())  # the corpus's, whatever the shard
    batches = list(iter_batches(prepared, batch_size))
    shard = current_shard()
    if shard is not None:
        batches = batches[shard[0] :: shard[1]]
    layers = list(range(model.cfg.n_layers))
    configs = [(g, m, mode, f) for g in grans for m in metrics for mode in modes for f in fractions]
    tags = ["clean"] + ["|".join(map(str, c)) for c in configs]
    value = "logprob" if task else "nll"
    outcomes = Outcomes(
        tags,
        TASK_SUMS if task else TEXT_SUMS,
        len(docs) if per_document else None,
        device=model.cfg.device,
    )
    bar = tqdm(
        total=len(batches) * (1 + len(configs)),
        desc="faithfulness",
        disable=not progress,
        leave=False,
    )
    for batch in batches:
        spans = None if all_spans is None else [all_spans[d] for d in batch.documents]
        ranks = Ranks(
            batch, layers, model.cfg.n_heads, metrics, grans, ranking == "signed", seed, first_query
        )
        local = TokenBatch(
            batch.tokens,
            batch.mask,
            batch.prepend_bos,
            batch.bos_token,
            list(range(len(batch.documents))),
        )

        def on_logits(
            _: TokenBatch, logits: Tensor, batch: TokenBatch = batch, spans: list | None = spans
        ) -> None:
            outcomes.record("clean", batch, logits, spans)

        stream_contributions(
            model,
            local.tokens,
            ranks.update,
            layers=layers,
            batch_size=None,
            attention_mask=local.mask.long(),
            on_logits=on_logits,
            progress=False,
            reuse_buffers=True,  # ranked inside the call
        )
        if "alti" in metrics:  # its own clean pass, every block checked (run_blocks)
            run_blocks(model, local, ranks.update_block, layers=layers)
        if "attribution_patching" in metrics:  # one forward and one backward pass
            loss = _clean_loss(local, spans)
            ranks.update_gradients(attention_output_gradients(model, local, loss, layers=layers))
        bar.update(1)
        for config in configs:  # no reference to a pass's logits outlives its record
            tag = "|".join(map(str, config))
            logits = run_logits(model, local, ranks.hooks(model, *config, layers))
            outcomes.record(tag, batch, logits, spans)
            del logits
            bar.update(1)
        del ranks  # the batch's ranks (the largest state): freed before the next are built
    bar.close()
    outcomes.all_reduce()  # collectives under torchrun; then the one transfer to the host
    result = _result(
        outcomes.to_host(), configs, task, (len(docs), n_tokens), ranking, seed, first_query
    )
    if per_document:
        names, table = outcomes.document_record((value, "count"))
        result.per_document = (names, table, configs)
    return result


def _clean_loss(batch: TokenBatch, spans: list | None) -> Callable[[Tensor], Tensor]:
    """The loss attribution patching differentiates: the batch's summed next-token NLL on text,
    minus the summed answer log-probability on task items (the damage the removals measure)."""
    if spans is None:
        return lambda logits: token_nll(logits, batch.tokens, batch.mask).nansum()
    return lambda logits: -answer_logprobs(logits, batch.tokens, spans).sum()


def _checked_options(
    metrics: str | Sequence[str],
    modes: str | Sequence[str],
    granularity: str | Sequence[str],
    ranking: str,
    fractions: Sequence[float],
    first_query: int,
    n_random: int,
) -> tuple[list[str], list[str], list[str], list[float]]:
    """[`faithfulness`][cw_lens.faithfulness]'s options checked: metrics (with the extra random
    draws), modes, granularities and fractions as lists."""
    metrics = [metrics] if isinstance(metrics, str) else list(metrics)
    modes = [modes] if isinstance(modes, str) else list(modes)
    if isinstance(first_query, bool) or not isinstance(first_query, int) or first_query < 0:
        raise InputError(f"first_query must be a non-negative integer, got {first_query!r}.")
    for m in metrics:
        if m not in KNOWN_METRICS:
            raise InputError(f"Unknown metric {m!r}; choose from {', '.join(KNOWN_METRICS)}.")
    if isinstance(n_random, bool) or not isinstance(n_random, int) or n_random < 1:
        raise InputError(f"n_random must be a positive integer, got {n_random!r}.")
    if n_random > 1:
        if "random" not in metrics:
            raise InputError("n_random > 1 needs the 'random' metric; add it to metrics.")
        metrics += random_draw_names(n_random)[1:]
    for mode in modes:
        if mode not in MODES:
            raise InputError(f"Unknown mode {mode!r}; choose from {', '.join(MODES)}.")
    grans = [granularity] if isinstance(granularity, str) else list(granularity)
    for g in grans:
        if g not in GRANULARITIES:
            raise InputError(f"granularity must be 'pairs' or 'tokens', got {g!r}.")
    if ranking not in ("abs", "signed"):
        raise InputError(f"ranking must be 'abs' or 'signed', got {ranking!r}.")
    fractions = [float(f) for f in fractions]
    if not fractions or any(not 0.0 <= f <= 1.0 for f in fractions):
        raise InputError(f"fractions must lie in [0, 1], got {fractions}.")
    if not metrics or not modes:
        raise InputError("Pass at least one metric and one mode.")
    return metrics, modes, grans, fractions


def _result(
    outcomes: Outcomes,
    configs: list,
    task: bool,
    size: tuple[int, int],
    ranking: str,
    seed: int,
    first_query: int,
) -> FaithfulnessResult:
    mean = outcomes.mean

    if task:
        clean = {"logprob": mean("logprob", "clean"), "accuracy": mean("correct", "clean")}
    else:
        nll = mean("nll", "clean")
        clean = {"nll": nll, "ppl": math.exp(nll)}
    rows = []
    for g, m, mode, f in configs:
        tag = "|".join(map(str, (g, m, mode, f)))
        row: dict[str, Any] = {"granularity": g, "metric": m, "mode": mode, "fraction": f}
        if task:
            lp = mean("logprob", tag)
            row.update(
                logprob=lp, delta_logprob=lp - clean["logprob"], accuracy=mean("correct", tag)
            )
        else:
            nll = mean("nll", tag)
            row.update(
                nll=nll,
                delta_nll=nll - clean["nll"],
                ppl=math.exp(nll),
                delta_ppl=math.exp(nll) - clean["ppl"],
            )
        rows.append(row)
    curves = pd.DataFrame(rows)
    return FaithfulnessResult(curves, clean, task, *size, ranking, seed, first_query)
