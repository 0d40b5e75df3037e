"""The passes of [`prune_heads`][cw_lens.prune_heads]: the head statistics each fold of documents
is ranked by (learnt on the other fold when cross-fitted), the hooks that remove each fold's heads,
and the ΔPPL of every (order, draw, retention level).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pandas as pd
import torch
from tqdm.auto import tqdm

from cw_lens.analyses.pruning.lone_heads import row_removal
from cw_lens.analyses.pruning.orders import MODERATE, Head, head_magnitudes, removed_heads
from cw_lens.analyses.taxonomy import HeadTaxonomyResult, head_taxonomy
from cw_lens.core.errors import InputError
from cw_lens.data.documents import Corpus
from cw_lens.data.inputs import TokenBatch
from cw_lens.data.scoring import NLLResult, corpus_nll
from cw_lens.models.interventions import remove_heads


def _head_statistics(
    model: Any,
    docs: Corpus,
    layers: list[int],
    orders: tuple[str, ...],
    taxonomy: HeadTaxonomyResult | None,
    stream_args: dict[str, Any],
) -> pd.DataFrame:
    """One row per prunable head: magnitude, and the taxonomy statistics when needed."""
    n_heads = model.cfg.n_heads
    layer, head = np.meshgrid(layers, range(n_heads), indexing="ij")
    stats = pd.DataFrame(
        {
            "layer": layer.ravel(),
            "head": head.ravel(),
            "magnitude": head_magnitudes(model, layers).numpy().ravel(),
        }
    )
    if taxonomy is None and not {"taxonomy", "entropy"} & set(orders):
        return stats
    if taxonomy is None:
        taxonomy = head_taxonomy(model, docs, layers=layers, **stream_args)
    missing = sorted(set(layers) - set(taxonomy.layers))
    if missing:
        raise InputError(
            f"The taxonomy passed in lacks layers {missing}; compute it with layers=None or "
            "prune only its layers."
        )
    return stats.merge(taxonomy.table, on=["layer", "head"], how="left")


def fold_statistics(
    model: Any,
    docs: Corpus,
    layers: list[int],
    orders: tuple[str, ...],
    taxonomy: HeadTaxonomyResult | None,
    stream_args: dict[str, Any],
    learnt: tuple[str, ...],
) -> tuple[pd.DataFrame, list[pd.DataFrame]]:
    """The head statistics to report and those each fold's documents are ranked by: one fold
    (every document, ranked on the whole corpus) or, cross-fitted (`learnt` orders), two —
    the even-indexed documents ranked by statistics of the odd-indexed ones and vice versa
    (the reported statistics: those learnt on the odd ones).

    Args:
        model: A `TransformerBridge`.
        docs: The corpus.
        layers: The prunable layers.
        orders: The orders ranked (the taxonomy statistics are measured when `taxonomy` or
            `entropy` is among them).
        taxonomy: A taxonomy already computed on the whole corpus (only without `learnt`).
        stream_args: Passed to [`head_taxonomy`][cw_lens.head_taxonomy] (`sink_positions`,
            `batch_size`, `prepend_bos`, `progress`).
        learnt: The orders learnt on held-out documents (cross-fitting); empty: one fold.

    Returns:
        `(reported statistics, [statistics fold f is ranked by])`, one row per prunable head
        (`layer`, `head`, `magnitude` and, when measured, the taxonomy columns).
    """
    if not learnt:
        stats = _head_statistics(model, docs, layers, orders, taxonomy, stream_args)
        return stats, [stats]
    if taxonomy is not None:
        raise InputError(
            f"Cross-fitting learns the {' and '.join(learnt)} ranking on each half of the "
            "documents, so a taxonomy computed on all of them cannot be used: pass "
            "taxonomy=None, or cross_fit=False to rank on the whole corpus."
        )
    if len(docs) < 2:
        raise InputError(
            "Cross-fitting learns the rankings on one half of the documents and evaluates them "
            "on the other: it needs at least 2 documents (pass cross_fit=False for one)."
        )
    halves = [docs[0::2], docs[1::2]]
    learnt_on = [_head_statistics(model, h, layers, orders, None, stream_args) for h in halves]
    return learnt_on[1], [learnt_on[1], learnt_on[0]]


def _fold_hooks(model: Any, removed: tuple[frozenset, ...]) -> Any:
    """Hooks removing `removed[f]` from the documents of fold `f` (document index modulo
    the number of folds); one set for all: [`cw_lens.remove_heads`][cw_lens.remove_heads]."""
    if len(removed) == 1:
        return [remove_heads(model, sorted(removed[0]))]

    def hooks(batch: TokenBatch) -> list[tuple[str, Any]]:
        fold = torch.as_tensor(batch.documents, device="cpu") % len(removed)
        return row_removal(fold, [sorted(r) for r in removed], model.cfg.n_heads)

    return hooks


def pruning_table(
    model: Any,
    docs: Corpus,
    folds: list[dict[str, list[list[Head]]]],
    plan_args: tuple[tuple[float, ...], str, int | None],
    clean: NLLResult,
    nll_args: dict[str, Any],
    progress: bool,
) -> tuple[pd.DataFrame, dict | None]:
    """ΔPPL per (order, draw, level) and, when `nll_args` asks for it, each document's (NLL
    sum, count) per (order, draw, level) with `"clean"`'s. A set of removed heads met twice
    is evaluated once.

    Args:
        model: A `TransformerBridge`.
        docs: The corpus.
        folds: `folds[f]`: the rankings (`{order: [ranking per draw]}`) of the documents whose
            index is `f` modulo `len(folds)`.
        plan_args: The retention levels, the scope (`"layer"` or `"global"`) and how many
            random draws run at every level (the others at `MODERATE` only; `None`: all).
        clean: The unpruned model's NLL on `docs`.
        nll_args: Passed to `cw_lens.data.scoring.corpus_nll` (`batch_size`,
            `prepend_bos`, `per_document`).
        progress: Show a progress bar over the passes.

    Returns:
        `(table, record)`: one row per (order, draw, retention) with `n_removed`, `n_heads`,
        `ppl`, `delta_ppl`, `nll`, `delta_nll`; and, with `per_document`, `{(order, draw,
        retention) or "clean": [document, 2] (NLL sum, count)}`, else None.
    """
    levels, scope, everywhere = plan_args

    def removed(name: str, draw: int, level: float) -> tuple[frozenset, ...]:
        sets = tuple(frozenset(removed_heads(f[name][draw], level, scope)) for f in folds)
        return sets[:1] if len(set(sets)) == 1 else sets

    plan = [
        (name, draw, level, removed(name, draw, level), len(ranking))
        for name, draws in folds[0].items()
        for draw, ranking in enumerate(draws)
        for level in levels
        if everywhere is None or draw < everywhere or level in MODERATE
    ]
    scores: dict[tuple, NLLResult] = {(frozenset(),): clean}
    rows = []
    for name, draw, level, sets, n_total in tqdm(
        plan, desc="pruning", disable=not progress, leave=False
    ):
        if sets not in scores:
            hooks = _fold_hooks(model, sets)
            scores[sets] = corpus_nll(model, docs, hooks=hooks, **nll_args)
        score = scores[sets]
        rows.append(
            {
                "order": name,
                "draw": draw,
                "retention": level,
                "n_removed": len(sets[0]),
                "n_heads": n_total,
                "ppl": score.ppl,
                "delta_ppl": score.ppl - clean.ppl,
                "nll": score.mean_nll,
                "delta_nll": score.mean_nll - clean.mean_nll,
            }
        )
    per_doc = None
    if clean.sums.per_document is not None:
        per_doc = {"clean": clean.sums.document_table()}
        for name, draw, level, sets, _ in plan:
            per_doc[(name, draw, level)] = scores[sets].sums.document_table()
    return pd.DataFrame(rows), per_doc
