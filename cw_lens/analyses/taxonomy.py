r"""Head taxonomy (P2): Retriever, Mixer and Reset heads by the source-winner rule.

Mudarisov, Burtsev, Petrova, State, "Geometric Analysis of Token Selection in Multi-Head
Attention" (arXiv 2602.01893); the formulas and the readings fixed where the paper is open are
those of methods § Token selection (docs/methods.md#selection).

**Head taxonomy** (parameter-free "source winner"). For every counted query `i` the winner is
`j* = argmax_{j <= i} alpha[i,j] ||v_j||` (value norm before `W_O`, of the kv head the query
head reads; ties to the smaller index); its category is `current` (`j* = i`), `sink` (`j*`
a sink position) or `other`. Counted queries: real (non-padding) positions that are not sink
positions (a query at the sink would be both `current` and `sink`). A head is a
**Retriever** / **Mixer** / **Reset** when `current` / `sink` / `other` is its most frequent
category; a tie goes to the first of Retriever, Mixer, Reset. Under uniform attention the winner
is simply the key with the largest value norm, so a diffuse head is a Reset unless its largest
values sit at the current token or the sink.

Streaming, exact merging and weights as in `cw_lens.analyses.selection`.

The public functions' docstrings have runnable examples.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import einops
import numpy as np
import pandas as pd
import torch
from jaxtyping import Float, Int
from torch import Tensor

from cw_lens.analyses.common import (
    CorpusPlan,
    SumsAndRecords,
    check_sinks,
    kv_of_heads,
    layer_sums,
    rounded_dict,
    run_plan,
)
from cw_lens.core.accumulate import ExactSums, PerDocument
from cw_lens.core.bootstrap import Bootstrap, require_record
from cw_lens.core.claims import Check, Claim, claims_dict, with_intervals
from cw_lens.core.errors import InputError
from cw_lens.core.keywords import check_keywords
from cw_lens.core.registry import saveable
from cw_lens.core.resampled import per_layer_rows, taxonomy_numbers
from cw_lens.core.results import Result
from cw_lens.data.documents import as_corpus
from cw_lens.models.access import Model
from cw_lens.models.capture import resolve_layers
from cw_lens.models.verify import require_verified

CATEGORIES = ("current", "sink", "other")
REGIMES = ("Retriever", "Mixer", "Reset")  # the regime of each category, in tie-break order
RETRIEVER_RANGE = (0.058, 0.172)  # P2's range of Retriever shares (docs/methods.md#claims)


def source_winners(
    attention: Float[Tensor, "*rows query key"],
    value_norms: Float[Tensor, "*rows key"],
    query_positions: Int[Tensor, " query"],
) -> Int[Tensor, "*rows query"]:
    """`j* = argmax_{j <= i} alpha[i,j] ||v_j||` (ties: the smaller index)."""
    score = attention * value_norms[..., None, :]
    keys = torch.arange(attention.shape[-1], device=attention.device)
    later = keys[None, :] > query_positions[:, None]
    return score.masked_fill(later, -math.inf).argmax(-1)


def winner_categories(
    winners: Int[Tensor, "*rows query"],
    query_positions: Int[Tensor, " query"],
    sink_positions: Sequence[int] | Tensor,
) -> Int[Tensor, "*rows query"]:
    """Each winner's category: 0 = `current` (`j* = i`), 1 = `sink` (`j*` a sink position),
    2 = `other`.

    Args:
        winners: The source winner `j*` of every query (`source_winners`).
        query_positions: The position `i` of each query.
        sink_positions: The sink positions (a tensor on the winners' device is used as is).

    Returns:
        The categories, shaped like `winners`.
    """
    sinks = torch.as_tensor(sink_positions, dtype=torch.long, device=winners.device)
    current = winners == query_positions
    sink = torch.isin(winners, sinks) & ~current
    return torch.where(current, 0, torch.where(sink, 1, 2))


def attention_entropy(attention: Float[Tensor, "*rows key"]) -> Float[Tensor, "*rows"]:
    """`-sum_j alpha log alpha` in nats (`0 log 0 = 0`)."""
    return -torch.special.xlogy(attention, attention).sum(-1)


# =========================================================================== head taxonomy

# per (document, head): counts of current / sink / other, counted queries, sums of ||o_i^h||
# and of the attention entropy
_TAXONOMY_FIELDS = ("current", "sink", "other", "n_queries", "output_norm", "entropy")


class _TaxonomyAccumulator(SumsAndRecords):
    def __init__(
        self, sinks: tuple[int, ...], layers: list[int], n_heads: int, n_documents: int | None
    ) -> None:
        self.sinks = sinks
        self.sums = ExactSums()
        self.pos = {layer: i for i, layer in enumerate(layers)}
        # opt-in, for bootstrap intervals: each document's winner counts per head
        self.per_doc = (
            None
            if n_documents is None
            else PerDocument(["winners"], n_documents, (len(layers), n_heads, len(CATEGORIES)))
        )

    def to_host(self) -> None:
        """After a pass: what was accumulated on the model's device, to the host (once)."""
        super().to_host()
        self.__dict__.pop("_sinks", None)

    def update(self, lc: Any) -> None:
        acts = lc.acts
        positions = lc.query_positions
        kv = kv_of_heads(acts.n_heads, acts.values.shape[2], positions.device)
        norms = einops.rearrange(acts.values[:, lc.keys].norm(dim=-1)[..., kv], "b k h -> b h k")
        sinks = self.__dict__.get("_sinks")  # uploaded once per pass
        if sinks is None or sinks.device != positions.device:
            sinks = self._sinks = torch.tensor(self.sinks, device=positions.device)
        categories = winner_categories(
            source_winners(lc.attention, norms, positions), positions, sinks
        )
        counted = (lc.query_mask & ~torch.isin(positions, sinks))[:, None, :]
        counted = counted.expand(-1, acts.n_heads, -1)
        per_category = torch.nn.functional.one_hot(categories, len(CATEGORIES)) * counted[..., None]
        stats = [
            per_category.sum(2).double(),
            counted.sum(-1, keepdim=True).double(),
            torch.where(counted, lc.head_output_norm, 0.0).sum(-1, keepdim=True).double(),
            torch.where(counted, attention_entropy(lc.attention), 0.0)
            .sum(-1, keepdim=True)
            .double(),
        ]
        self.sums.add_rows(acts.batch.documents, f"layer{acts.layer}", torch.cat(stats, -1))
        if self.per_doc is not None:
            self.per_doc.add_rows(
                acts.batch.documents, "winners", stats[0], at=self.pos[acts.layer]
            )


@saveable
@dataclass(repr=False)
class HeadTaxonomyResult(Result):
    """P2's source-winner taxonomy: one row per (layer, head) in `table`.

    Columns: `layer`, `head`, `n_queries` (counted queries), `share_current`,
    `share_sink`, `share_other` (shares of those queries whose winner is the current token,
    a sink, another token), `regime` (Retriever / Mixer / Reset), `mean_output_norm`
    (mean `||o_i^h||`) and `mean_entropy` (mean attention entropy, nats), over the counted
    queries.
    """

    table: pd.DataFrame
    sink_positions: tuple[int, ...]
    n_documents: int
    model_name: str = ""
    per_document: Tensor | None = None  # [document, layer, head, category] winner counts

    @property
    def layers(self) -> list[int]:
        return sorted(self.table["layer"].unique().tolist())

    def to_dataframe(self) -> pd.DataFrame:
        """One row per (layer, head): winner shares, regime, mean output norm and entropy.

        Returns:
            A copy of `table` (the columns are listed in the class docstring).

        Examples:
            ```python
            import cw_lens

            model = cw_lens.load_model("testing:tiny-llama")
            corpus = cw_lens.load_corpus(n_docs=2, max_tokens=16, model=model)
            tax = cw_lens.head_taxonomy(model, corpus, progress=False)
            tax.to_dataframe().head()
            ```
        """
        return self.table.copy()

    def regime_shares(self) -> pd.Series:
        """Share of heads in each regime (claim `retriever_share`: Retrievers 5.8–17.2%).

        Returns:
            A Series indexed by regime (`Retriever`, `Mixer`, `Reset`).

        Examples:
            ```python
            import cw_lens

            model = cw_lens.load_model("testing:tiny-llama")
            corpus = cw_lens.load_corpus(n_docs=2, max_tokens=16, model=model)
            tax = cw_lens.head_taxonomy(model, corpus, progress=False)
            tax.regime_shares()
            ```
        """
        shares = self.table["regime"].value_counts(normalize=True)
        return shares.reindex(REGIMES, fill_value=0.0).rename("share")

    def shares_by_layer(self) -> pd.DataFrame:
        """Per layer: the share of heads in each regime and the mean category shares.

        Returns:
            A DataFrame indexed by layer.

        Examples:
            ```python
            import cw_lens

            model = cw_lens.load_model("testing:tiny-llama")
            corpus = cw_lens.load_corpus(n_docs=2, max_tokens=16, model=model)
            tax = cw_lens.head_taxonomy(model, corpus, progress=False)
            tax.shares_by_layer()
            ```
        """
        counts = pd.crosstab(self.table["layer"], self.table["regime"], normalize="index")
        counts = counts.reindex(columns=list(REGIMES), fill_value=0.0)
        categories = [f"share_{c}" for c in CATEGORIES]
        out = counts.join(self.table.groupby("layer")[categories].mean())
        out.columns.name = None
        return out

    def heads(self, regime: str) -> list[tuple[int, int]]:
        """The (layer, head) pairs of one regime.

        Args:
            regime: `"Retriever"`, `"Mixer"` or `"Reset"`.

        Returns:
            A list of `(layer, head)` pairs.

        Examples:
            ```python
            import cw_lens

            model = cw_lens.load_model("testing:tiny-llama")
            corpus = cw_lens.load_corpus(n_docs=2, max_tokens=16, model=model)
            tax = cw_lens.head_taxonomy(model, corpus, progress=False)
            tax.heads("Mixer")
            ```
        """
        if regime not in REGIMES:
            raise InputError(f"regime must be one of {REGIMES}, got {regime!r}.")
        rows = self.table[self.table["regime"] == regime]
        return list(zip(rows["layer"].tolist(), rows["head"].tolist(), strict=True))

    def top(self, k: int = 10, *, by: str = "share_current") -> pd.DataFrame:
        """The `k` heads with the largest `by` (e.g. the clearest Retrievers).

        Args:
            k: How many heads.
            by: A column of the table.

        Returns:
            `k` rows of the table, largest first.

        Examples:
            ```python
            import cw_lens

            model = cw_lens.load_model("testing:tiny-llama")
            corpus = cw_lens.load_corpus(n_docs=2, max_tokens=16, model=model)
            tax = cw_lens.head_taxonomy(model, corpus, progress=False)
            tax.top(5, by="share_sink")
            ```
        """
        if by not in self.table.columns:
            raise InputError(f"by must be a column of the table, got {by!r}.")
        return self.table.sort_values(by, ascending=False, kind="stable").head(k)

    def summary_dict(self) -> dict[str, Any]:
        """Headline numbers of the claim `retriever_share`: head count and regime shares.

        Returns:
            A JSON-ready dict (`summary()`: this dict as a one-row DataFrame).

        Examples:
            ```python
            import cw_lens

            model = cw_lens.load_model("testing:tiny-llama")
            corpus = cw_lens.load_corpus(n_docs=2, max_tokens=16, model=model)
            tax = cw_lens.head_taxonomy(model, corpus, progress=False)
            tax.summary_dict()
            ```
        """
        shares = self.regime_shares()
        return {
            "n_heads": len(self.table),
            "n_documents": self.n_documents,
            "regime_shares": rounded_dict(shares),
            "retriever_share": float(shares["Retriever"]),
            "dominant_regime": str(shares.idxmax()),
        }

    def claims(self, bootstrap: Bootstrap | None = None) -> dict[str, dict[str, Any]]:
        """P2's taxonomy claim (docs/methods.md#claims `retriever_share`), measured.

        Args:
            bootstrap: With a `cw_lens.core.bootstrap.Bootstrap`, the interval over documents
                and the per-layer intervals (needs `per_document=True`).

        Returns:
            `{claim id: claim}`, each claim a JSON-ready dict with whether it holds and its
            `measured` numbers.

        Examples:
            ```python
            import cw_lens

            model = cw_lens.load_model("testing:tiny-llama")
            corpus = cw_lens.load_corpus(n_docs=2, max_tokens=16, model=model)
            tax = cw_lens.head_taxonomy(model, corpus, per_document=True, progress=False)
            from cw_lens.core.bootstrap import Bootstrap

            tax.claims()["retriever_share"]["holds"]
            tax.claims(Bootstrap(resamples=100))
            ```
        """
        claims = [self._claim()]
        if bootstrap is not None:
            reps = self.replicates(bootstrap)
            layers = self.layers
            point = self.table.groupby("layer")["regime"].apply(lambda r: (r == "Retriever").mean())
            rows = per_layer_rows(
                layers,
                "retriever_share",
                torch.tensor(point.loc[layers].to_numpy(), device="cpu"),
                *bootstrap.judged(reps["retriever_share_per_layer"], number="retriever_share"),
            )
            share = bootstrap.pair(reps["retriever_share"], number="retriever_share")
            intervals = {"retriever_share": share}
            claims = with_intervals(claims, intervals, {"retriever_share": rows})
        return claims_dict(claims)

    def replicates(self, bootstrap: Bootstrap) -> dict[str, Tensor]:
        """`retriever_share` in every row of `bootstrap.weights`.

        Each row reclassifies every head from its winner counts.

        Args:
            bootstrap: The resampling of documents (`cw_lens.core.bootstrap.Bootstrap`); the result
                needs `per_document=True`.

        Returns:
            `{number: tensor}`: the share `[rows]` and per layer `[rows, layer]`.

        Examples:
            ```python
            import cw_lens

            model = cw_lens.load_model("testing:tiny-llama")
            corpus = cw_lens.load_corpus(n_docs=2, max_tokens=16, model=model)
            tax = cw_lens.head_taxonomy(model, corpus, per_document=True, progress=False)
            from cw_lens.core.bootstrap import Bootstrap

            replicates = tax.replicates(Bootstrap(resamples=100))
            ```
        """
        record = require_record(self.per_document, "head_taxonomy")
        return taxonomy_numbers(bootstrap.resample(record))

    def _claim(self) -> Claim:
        shares = self.regime_shares()
        claim = Claim(
            "retriever_share",
            paper="Retrievers are a minority, 5.8-17.2% of heads (P2)",
            criterion="Retriever share in [5.8%, 17.2%]",
            checks=[Check("retriever_share", float(shares["Retriever"]), "in", RETRIEVER_RANGE)],
            measured={
                "regime_shares": rounded_dict(shares),
                "dominant_regime": str(shares.idxmax()),
                "n_heads": len(self.table),
            },
        )
        return claim

    def plot(self, **kwargs: Any) -> Any:
        """Regimes over depth: stacked shares of heads per layer (claim `retriever_share`).

        Args:
            **kwargs: Passed to `cw_lens.plots.selection.plot_retriever_share` (`figsize`).

        Returns:
            A matplotlib Figure.

        Examples:
            ```python
            import cw_lens

            model = cw_lens.load_model("testing:tiny-llama")
            corpus = cw_lens.load_corpus(n_docs=2, max_tokens=16, model=model)
            tax = cw_lens.head_taxonomy(model, corpus, progress=False)
            fig = tax.plot()
            ```
        """
        from cw_lens.plots.selection import plot_retriever_share

        return plot_retriever_share(self, **kwargs)


@check_keywords
def head_taxonomy(
    model: Model,
    corpus: Any,
    *,
    sink_positions: Sequence[int] = (0,),
    layers: int | Sequence[int] | None = None,
    batch_size: int | None = 8,
    prepend_bos: bool = True,
    progress: bool = True,
    per_document: bool = False,
) -> HeadTaxonomyResult:
    """P2's parameter-free head taxonomy (source winner `argmax_j alpha[i,j] ||v_j||`).

    Every real query that is not a sink position is counted; each head's regime is its most
    frequent winner category (ties: Retriever, then Mixer, then Reset).

    Args:
        model: A `TransformerBridge`.
        corpus: What [`cw_lens.load_corpus`][cw_lens.load_corpus] returns, a string, a list of
            strings, or token ids (a tensor `[pos]` or `[batch, pos]`, or a list of token-id
            lists, read as given).
        sink_positions: Positions whose winning makes a query `sink` (and that are not
            counted as queries); each must be a token of every document (as in
            [`sink_statistics`][cw_lens.sink_statistics]).
        layers: Layers to classify (`None` = all).
        batch_size: Documents per forward pass.
        prepend_bos: Prepend BOS (position 0 is then the usual sink).
        progress: Show a progress bar over document batches.
        per_document: Also keep each document's winner counts per head (`12 * n_layers *
            n_heads + 1` bytes per document, 3.2 KB for SmolLM2-135M) for bootstrap
            intervals
            ([`HeadTaxonomyResult.claims`][cw_lens.HeadTaxonomyResult.claims]).

    Returns:
        A [`HeadTaxonomyResult`][cw_lens.HeadTaxonomyResult].

    Examples:
        ```python
        import cw_lens

        model = cw_lens.load_model("testing:tiny-llama")
        corpus = cw_lens.load_corpus(n_docs=2, max_tokens=16, model=model)
        tax = cw_lens.head_taxonomy(model, corpus, progress=False)
        tax.regime_shares()   # share of Retriever / Mixer / Reset heads
        tax.heads("Retriever")
        ```
    """
    plan = _plan_head_taxonomy(
        model,
        corpus,
        sink_positions=sink_positions,
        layers=layers,
        prepend_bos=prepend_bos,
        per_document=per_document,
    )
    label = "head taxonomy" if progress else False
    return run_plan(
        model, corpus, plan, batch_size=batch_size, prepend_bos=prepend_bos, progress=label
    )


def _plan_head_taxonomy(
    model: Model,
    corpus: Any,
    *,
    sink_positions: Sequence[int],
    layers: int | Sequence[int] | None,
    prepend_bos: bool,
    per_document: bool,
    **_: Any,
) -> CorpusPlan:
    """[`head_taxonomy`][cw_lens.head_taxonomy]'s checks and accumulator, as a `CorpusPlan`
    (its other arguments, the pass's, are ignored here)."""
    require_verified(model)
    docs = as_corpus(corpus)
    sinks = check_sinks(sink_positions, model=model, inputs=docs, prepend_bos=prepend_bos)
    layer_list = resolve_layers(model, layers)
    n_documents = len(docs) if per_document else None
    accumulator = _TaxonomyAccumulator(sinks, layer_list, model.cfg.n_heads, n_documents)
    model_name = str(getattr(model.cfg, "model_name", ""))

    def finish(accumulator: _TaxonomyAccumulator, stats: Any) -> HeadTaxonomyResult:
        sums, record = layer_sums(accumulator, layer_list, "winners")
        return HeadTaxonomyResult(
            table=_taxonomy_table(sums, layer_list),
            sink_positions=sinks,
            n_documents=stats.n_documents,
            model_name=model_name,
            per_document=record,
        )

    return CorpusPlan("taxonomy", accumulator, layer_list, finish)


def _taxonomy_table(sums: Float[Tensor, "layer head 6"], layers: list[int]) -> pd.DataFrame:
    """The per-(layer, head) table from the summed `_TAXONOMY_FIELDS`."""
    field = {name: sums[..., k] for k, name in enumerate(_TAXONOMY_FIELDS)}
    n_queries = field["n_queries"]
    if bool((n_queries == 0).any()):
        raise InputError(
            "No query could be classified: every position of the corpus is a sink position or "
            "padding. Use longer documents or fewer sink_positions."
        )
    counts = torch.stack([field[c] for c in CATEGORIES], dim=-1)
    layer, head = np.meshgrid(layers, range(n_queries.shape[1]), indexing="ij")
    columns = {
        "layer": layer,
        "head": head,
        "n_queries": n_queries.long(),
        **{f"share_{c}": field[c] / n_queries for c in CATEGORIES},
        "regime": np.array(REGIMES)[counts.argmax(-1).numpy()],
        "mean_output_norm": field["output_norm"] / n_queries,
        "mean_entropy": field["entropy"] / n_queries,
    }
    return pd.DataFrame({k: np.asarray(v).ravel() for k, v in columns.items()})
