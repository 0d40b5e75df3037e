"""Structured head pruning over a corpus ([`prune_heads`][cw_lens.prune_heads]): ΔPPL of each order
at each retention level, the lone-head costs and its result class
([`PruningResult`][cw_lens.PruningResult]); its passes run in `cw_lens.analyses.pruning.passes`, its
claim is judged in `cw_lens.reproduction.pruning_claims`.

The orders, formulas, citation and a runnable example are in the package docstring,
`cw_lens.analyses.pruning`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import pandas as pd

from cw_lens.analyses.common import check_count, check_sinks
from cw_lens.analyses.pruning.lone_heads import (
    check_lone_heads,
    lone_head_batch,
    lone_head_costs,
)
from cw_lens.analyses.pruning.orders import AGGRESSIVE as AGGRESSIVE  # re-exported
from cw_lens.analyses.pruning.orders import MODERATE as MODERATE  # re-exported
from cw_lens.analyses.pruning.orders import ORDERS, RETENTION, Head, pruning_rankings
from cw_lens.analyses.pruning.passes import fold_statistics, pruning_table
from cw_lens.analyses.taxonomy import HeadTaxonomyResult
from cw_lens.core.deprecation import moved_to_reproduction, renamed_kwargs
from cw_lens.core.errors import InputError
from cw_lens.core.keywords import check_keywords
from cw_lens.core.registry import saveable
from cw_lens.core.results import Result
from cw_lens.data.documents import as_corpus
from cw_lens.data.scoring import corpus_nll
from cw_lens.models.access import Model
from cw_lens.models.capture import resolve_layers
from cw_lens.models.verify import require_verified

# random orders P2's `pruning_signal` needs for a verdict (methods § Claims): with fewer, the
# spread of the random control is not known well enough
MIN_RANDOM_DRAWS = 20


@saveable
@dataclass(repr=False)
class PruningResult(Result):
    """ΔPPL of structured head pruning (P2) per order and retention level.

    Attributes:
        table: One row per (order, draw, retention): `n_removed`, `n_heads`, `ppl`,
            `delta_ppl`, `nll`, `delta_nll` (`draw` is 0 for the deterministic orders).
        head_stats: One row per prunable head: `magnitude` and, when computed, the taxonomy
            columns (`regime`, `mean_output_norm`, `mean_entropy`, shares) and the lone
            removal cost `lone_delta_ppl`.
        rankings: The removal order(s) per order name (first = removed first).
        clean_ppl, clean_nll: The unpruned model on the corpus.
        lone: Lone-removal costs (`layer`, `head`, `ppl`, `delta_ppl`, `nll`,
            `delta_nll`), most costly first, on the small lone corpus; `None` if skipped.
        lone_clean_ppl: The unpruned PPL on the lone corpus.
        lone_shape: (documents, tokens per document incl. BOS) of the lone corpus.
        scope: `"layer"` or `"global"` (see `removed_heads`).
    """

    table: pd.DataFrame
    head_stats: pd.DataFrame
    rankings: dict[str, list[list[Head]]]
    clean_ppl: float
    clean_nll: float
    retention: tuple[float, ...]
    orders: tuple[str, ...]
    seed: int
    n_documents: int
    scope: Literal["layer", "global"] = "layer"
    lone: pd.DataFrame | None = None
    lone_clean_ppl: float | None = None
    lone_shape: tuple[int, int] | None = None
    model_name: str = ""
    # opt-in: each document's (NLL sum, count) per (order, draw, retention) and "clean"
    per_document: dict | None = None
    # the orders ranked by cross-fitting; their `rankings` entry is the even documents' one
    cross_fitted: tuple[str, ...] = ()

    def to_dataframe(self) -> pd.DataFrame:
        """One row per (order, draw, retention).

        Returns:
            A copy of `table`: `order, draw, retention, n_removed, n_heads, ppl, delta_ppl, nll,
            delta_nll`.

        Examples:
            ```python
            import cw_lens

            model = cw_lens.load_model("testing:tiny-llama")
            corpus = cw_lens.load_corpus(n_docs=2, max_tokens=16, model=model)
            pruned = cw_lens.prune_heads(
                model, corpus, retention=(0.5,), n_random=2, per_document=True, progress=False
            )
            pruned.to_dataframe().head()
            ```
        """
        return self.table.copy()

    def by_retention(self, value: str = "delta_ppl") -> pd.DataFrame:
        """`value` per retention level and order.

        Args:
            value: `"delta_ppl"`, `"delta_nll"`, `"ppl"` or `"nll"`.

        Returns:
            A DataFrame: one row per retention (descending), one column per order (`random` = the
            mean over draws, with `random_min` / `random_max`).

        Examples:
            ```python
            import cw_lens

            model = cw_lens.load_model("testing:tiny-llama")
            corpus = cw_lens.load_corpus(n_docs=2, max_tokens=16, model=model)
            pruned = cw_lens.prune_heads(
                model, corpus, retention=(0.5,), n_random=2, per_document=True, progress=False
            )
            pruned.by_retention()
            ```
        """
        if value not in ("delta_ppl", "delta_nll", "ppl", "nll"):
            raise InputError(f"value must be delta_ppl, delta_nll, ppl or nll, got {value!r}.")
        table = self.table.pivot_table(index="retention", columns="order", values=value)
        table = table[list(self.orders)].sort_index(ascending=False)
        if "random" in self.orders:
            draws = self.table[self.table["order"] == "random"].groupby("retention")[value]
            table["random_min"] = draws.min()
            table["random_max"] = draws.max()
        table.columns.name = None
        return table

    def top(self, k: int = 10) -> pd.DataFrame:
        """The `k` heads whose lone removal raises the PPL most.

        Args:
            k: How many heads.

        Returns:
            The first `k` rows of the lone-head table (`layer, head, ppl, delta_ppl, nll,
            delta_nll`); the result needs `lone=True` (the default).

        Examples:
            ```python
            import cw_lens

            model = cw_lens.load_model("testing:tiny-llama")
            corpus = cw_lens.load_corpus(n_docs=2, max_tokens=16, model=model)
            pruned = cw_lens.prune_heads(
                model, corpus, retention=(0.5,), n_random=2, per_document=True, progress=False
            )
            pruned.top(5)
            ```
        """
        if self.lone is None:
            raise InputError("This result has no lone-head costs; rerun prune_heads(lone=True).")
        return self.lone.head(k).reset_index(drop=True)

    def summary_dict(self) -> dict[str, Any]:
        """Headline numbers of the claim `pruning_signal`.

        Returns:
            A JSON-ready dict.

        Examples:
            ```python
            import cw_lens

            model = cw_lens.load_model("testing:tiny-llama")
            corpus = cw_lens.load_corpus(n_docs=2, max_tokens=16, model=model)
            pruned = cw_lens.prune_heads(
                model, corpus, retention=(0.5,), n_random=2, per_document=True, progress=False
            )
            pruned.summary_dict()
            ```
        """
        table = self.by_retention()
        out: dict[str, Any] = {
            "scope": self.scope,
            "n_documents": self.n_documents,
            "clean_ppl": round(self.clean_ppl, 4),
            "delta_ppl": {
                str(r): {k: round(float(v), 4) for k, v in row.items()}
                for r, row in table.iterrows()
            },
            "best_order": {
                str(r): str(row[list(self.orders)].idxmin()) for r, row in table.iterrows()
            },
        }
        if self.lone is not None:
            out["top_lone_heads"] = [
                {"layer": int(r.layer), "head": int(r.head), "delta_ppl": round(r.delta_ppl, 4)}
                for r in self.top(5).itertuples()
            ]
        return out

    # deprecated: cw_lens.reproduction.claims(result, bootstrap, other_scope=...)
    claims = moved_to_reproduction("claims", old_parameters=("other_scope", "bootstrap"))
    replicates = moved_to_reproduction("replicates")

    @property
    def n_random_draws(self) -> int:
        """How many random orders were drawn (0 without the `random` order)."""
        return len(self.rankings.get("random", []))

    def plot(self, **kwargs: Any) -> Any:
        """ΔPPL against retention per order (claim `pruning_signal`).

        Args:
            **kwargs: Passed to `cw_lens.plots.selection.plot_pruning_signal` (`k`, `figsize`).

        Returns:
            A matplotlib Figure.

        Examples:
            ```python
            import cw_lens

            model = cw_lens.load_model("testing:tiny-llama")
            corpus = cw_lens.load_corpus(n_docs=2, max_tokens=16, model=model)
            pruned = cw_lens.prune_heads(
                model, corpus, retention=(0.5,), n_random=2, per_document=True, progress=False
            )
            fig = pruned.plot()
            ```
        """
        from cw_lens.plots.selection import plot_pruning_signal

        return plot_pruning_signal(self, **kwargs)


def _check_orders(order: str | Sequence[str]) -> tuple[str, ...]:
    orders = (order,) if isinstance(order, str) else tuple(order)
    unknown = [o for o in orders if o not in ORDERS]
    if not orders or unknown:
        raise InputError(
            f"order must be one or several of {', '.join(ORDERS)}; got {order!r}"
            + (f" (unknown: {unknown})." if unknown else ".")
        )
    return tuple(dict.fromkeys(orders))


def _check_retention(retention: float | Sequence[float]) -> tuple[float, ...]:
    levels = (retention,) if isinstance(retention, (int, float)) else tuple(retention)
    if not levels:
        raise InputError("retention is empty; pass fractions of heads to keep, e.g. (0.9, 0.5).")
    for r in levels:
        ok = not isinstance(r, bool) and isinstance(r, (int, float, np.floating))
        if not ok or not math.isfinite(r) or not 0 <= r <= 1:
            hint = " Use fractions, not percentages (0.9, not 90)." if ok and 1 < r <= 100 else ""
            raise InputError(
                f"retention levels are the fractions of heads kept, in [0, 1] (0.9 keeps 90%); "
                f"got {r!r}.{hint}"
            )
    return tuple(sorted({float(r) for r in levels}, reverse=True))


LEARNT = ("taxonomy", "entropy")  # orders ranked by statistics measured on documents


@check_keywords
@renamed_kwargs(n_draws="n_random")
def prune_heads(
    model: Model,
    corpus: Any,
    *,
    order: str | Sequence[str] = ORDERS,
    retention: float | Sequence[float] = RETENTION,
    scope: Literal["layer", "global"] = "layer",
    layers: int | Sequence[int] | None = None,
    n_random: int = 3,
    draws_everywhere: int | None = None,
    seed: int = 0,
    sink_positions: Sequence[int] = (0,),
    taxonomy: HeadTaxonomyResult | None = None,
    cross_fit: bool = True,
    lone: bool = True,
    lone_corpus: Any = None,
    lone_docs: int | None = 2,
    lone_tokens: int | None = 32,
    lone_heads: Sequence[Head] | None = None,
    lone_heads_per_pass: int = 8,
    batch_size: int | None = 8,
    prepend_bos: bool = True,
    progress: bool = True,
    per_document: bool = False,
) -> PruningResult:
    """P2's structured head pruning: ΔPPL per removal order and retention level.

    The clean PPL and the head statistics are computed once for all orders; a set of removed
    heads met twice (e.g. by two orders) is evaluated once.

    Args:
        model: A `TransformerBridge`.
        corpus: What [`cw_lens.load_corpus`][cw_lens.load_corpus] returns, or a list of strings; PPL
            and the head statistics are measured on it.
        order: One or several of `"taxonomy"`, `"magnitude"`, `"entropy"`, `"random"`
            (default: all four).
        retention: Fractions of heads kept (default 0.9, 0.75, 0.5, 0.25); 1.0 removes
            nothing (ΔPPL 0 exactly).
        scope: `"layer"` (the methods page's reading) removes the same fraction in every
            layer, in the order's ranking within the layer; `"global"` ranks all heads in one
            order and removes the first ones (norms and magnitudes grow with depth, so global
            orders by them concentrate removal in the first layers).
        layers: Layers whose heads may be removed (`None` = all); retention counts them.
        n_random: Random orders (seeds `(seed, 0)`, `(seed, 1)`, ...); `pruning_signal`'s
            verdict needs at least 20. Default 3, P2's count: each order costs a pass over the
            corpus per retention level (`draws_everywhere` trims that), so 20 is the paper
            preset's choice, not the default.
        draws_everywhere: How many of the random orders are evaluated at every retention
            level; the others only at 90% and 75%, the levels `pruning_signal` compares
            (saves passes). `None` = all of them everywhere.
        seed: Seed of the random orders.
        sink_positions: For the taxonomy (see [`head_taxonomy`][cw_lens.head_taxonomy]).
        taxonomy: A [`HeadTaxonomyResult`][cw_lens.HeadTaxonomyResult] already computed on this
            model (saves a pass; only with `cross_fit=False`).
        cross_fit: Learn the taxonomy and entropy rankings on documents other than those they
            are evaluated on (methods § Claims): the even-indexed documents are pruned by the
            ranking
            learnt on the odd-indexed ones and vice versa, and ΔPPL pools both halves' NLL.
            `False`: one ranking learnt on the whole corpus (optimistic: the ranking has
            seen the text it is judged on). Magnitude and random orders need no data.
        lone: Also measure each head's lone removal ([`lone_head_costs`][cw_lens.lone_head_costs]).
        lone_corpus: Corpus for the lone costs (default: `corpus`).
        lone_docs: The lone costs use the first `lone_docs` documents of that corpus
            (`None` = all); with `lone_tokens` the defaults (2 x 32) take about 25 s for the
            270 heads of SmolLM2-135M on two CPU cores.
        lone_tokens: Those documents are cut to `lone_tokens` tokens (`None` = whole).
        lone_heads: Candidate heads for the lone costs (default: every prunable head).
        lone_heads_per_pass: Heads per forward pass in the lone costs.
        batch_size: Documents per forward pass.
        prepend_bos: Prepend BOS.
        progress: Show progress bars.
        per_document: Also keep each document's NLL sum and count per pruned configuration
            (`9 * (1 + rankings * levels)` bytes per document — a ranking per order and
            random draw: 225 bytes with the defaults) for bootstrap intervals
            (`cw_lens.reproduction.claims(result, bootstrap)`).

    Returns:
        A [`PruningResult`][cw_lens.PruningResult].

    Examples:
        ```python
        import cw_lens

        model = cw_lens.load_model("testing:tiny-llama")
        corpus = cw_lens.load_corpus(n_docs=2, max_tokens=16, model=model)
        pruned = cw_lens.prune_heads(
            model, corpus, retention=(0.5,), n_random=2, per_document=True, progress=False
        )
        pruned.by_retention()     # ΔPPL: rows = retention, columns = order
        pruned.top(5)             # heads whose lone removal costs most
        ```
    """
    # Long: the protocol's passes in order (taxonomy, each order and retention level, lone heads)
    # share the batches, the per-document record and the progress bar; each step is a function of
    # this package.
    require_verified(model)
    orders = _check_orders(order)
    levels = _check_retention(retention)
    if scope not in ("global", "layer"):
        raise InputError(f"scope must be 'global' or 'layer', got {scope!r}.")
    check_count(n_random, "n_random (3 in P2)")
    check_count(lone_heads_per_pass, "lone_heads_per_pass")
    docs = as_corpus(corpus)
    sinks = check_sinks(sink_positions, model=model, inputs=docs, prepend_bos=prepend_bos)
    layer_list = resolve_layers(model, layers)
    lone_list = check_lone_heads(model, lone_heads, layer_list) if lone else []
    lone_source = docs if lone_corpus is None else as_corpus(lone_corpus)
    lone_batch = (
        lone_head_batch(model, lone_source, lone_docs, lone_tokens, prepend_bos) if lone else None
    )
    stream_args = {
        "sink_positions": sinks,
        "batch_size": batch_size,
        "prepend_bos": prepend_bos,
        "progress": progress,
    }
    learnt = tuple(o for o in LEARNT if o in orders) if cross_fit else ()
    stats, folds = fold_statistics(model, docs, layer_list, orders, taxonomy, stream_args, learnt)
    folds = [pruning_rankings(s, orders, n_random, seed) for s in folds]
    nll_args = {"batch_size": batch_size, "prepend_bos": prepend_bos, "per_document": per_document}
    clean = corpus_nll(model, docs, **nll_args)
    if draws_everywhere is not None:
        check_count(draws_everywhere, "draws_everywhere")
    plan_args = (levels, scope, draws_everywhere)
    table, per_doc = pruning_table(model, docs, folds, plan_args, clean, nll_args, progress)
    result = PruningResult(
        table=table,
        head_stats=stats,
        rankings=folds[0],
        cross_fitted=learnt,
        clean_ppl=clean.ppl,
        clean_nll=clean.mean_nll,
        retention=levels,
        orders=orders,
        scope=scope,
        seed=seed,
        n_documents=len(docs),
        model_name=str(getattr(model.cfg, "model_name", "")),
        per_document=per_doc,
    )
    if lone_batch is not None:
        result.lone_clean_ppl, result.lone = lone_head_costs(
            model,
            lone_source,
            heads=lone_list,
            n_docs=lone_docs,
            max_tokens=lone_tokens,
            heads_per_pass=lone_heads_per_pass,
            prepend_bos=prepend_bos,
            progress=progress,
        )
        result.lone_shape = tuple(lone_batch.tokens.shape)
        lone_cost = result.lone[["layer", "head", "delta_ppl"]].rename(
            columns={"delta_ppl": "lone_delta_ppl"}
        )
        result.head_stats = stats.merge(lone_cost, on=["layer", "head"], how="left")
    return result
