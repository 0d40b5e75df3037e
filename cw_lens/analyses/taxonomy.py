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

Streaming (`HeadTaxonomyAccumulator`: float64 sums on the model's device), merging and weights
as in `cw_lens.analyses.selection`.

The public functions' docstrings have runnable examples.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd
import torch
from jaxtyping import Float, Int
from torch import Tensor

from cw_lens.analyses.common import check_sinks, kv_of_heads, rounded_dict
from cw_lens.core.accumulators import Accumulator, StackedSums, document_rows
from cw_lens.core.deprecation import moved_to_reproduction
from cw_lens.core.errors import InputError
from cw_lens.core.keywords import check_keywords
from cw_lens.core.registry import saveable
from cw_lens.core.results import Result
from cw_lens.data.documents import as_corpus
from cw_lens.data.streaming import stream_corpus
from cw_lens.models.access import Model
from cw_lens.models.capture import resolve_layers
from cw_lens.models.verify import require_verified

CATEGORIES = ("current", "sink", "other")
REGIMES = ("Retriever", "Mixer", "Reset")  # the regime of each category, in tie-break order


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

# per (layer, head): counts of current / sink / other, counted queries, sums of ||o_i^h||
# and of the attention entropy
TAXONOMY_FIELDS = ("current", "sink", "other", "n_queries", "output_norm", "entropy")


class HeadTaxonomyAccumulator(Accumulator):
    """The accumulator of [`head_taxonomy`][cw_lens.head_taxonomy] (`name` `"taxonomy"`).

    Float64 sums per (layer, head) over the counted queries `i` (real, not a sink position):
    the number whose source winner `j* = argmax_{j <= i} alpha[i,j] ||v_j||` is `current`,
    `sink` and `other`, the number of queries, `sum ||o_i^h||` and `sum` of the attention
    entropy (`TAXONOMY_FIELDS`), one `StackedSums.add` per block; with `per_document=True`
    each document's own as well. `finish` builds the
    [`HeadTaxonomyResult`][cw_lens.HeadTaxonomyResult]. The arguments are
    [`head_taxonomy`][cw_lens.head_taxonomy]'s, less the pass's `progress`.

    Args:
        model: The model.
        corpus: The documents.
        sink_positions: The sink positions.
        layers: Layers to classify (`None` = all).
        batch_size: Documents per forward pass (the pass's; not read here).
        prepend_bos: Whether BOS is prepended (to check the sink positions).
        per_document: Keep each document's sums (for bootstrap intervals).

    Examples:
        ```python
        import cw_lens
        from cw_lens.analyses.taxonomy import HeadTaxonomyAccumulator
        from cw_lens.data.streaming import stream_corpus

        model = cw_lens.load_model("testing:tiny-llama")
        corpus = cw_lens.load_corpus(n_docs=2, max_tokens=16, model=model)
        acc = HeadTaxonomyAccumulator(model, corpus)
        stats, _ = stream_corpus(model, corpus, [acc])
        acc.finish(stats).regime_shares()
        ```
    """

    name = "taxonomy"

    @check_keywords
    def __init__(
        self,
        model: Model,
        corpus: Any,
        *,
        sink_positions: Sequence[int] = (0,),
        layers: int | Sequence[int] | None = None,
        batch_size: int | None = 8,
        prepend_bos: bool = True,
        per_document: bool = False,
    ) -> None:
        require_verified(model)
        docs = as_corpus(corpus)
        self.sink_positions = check_sinks(
            sink_positions, model=model, inputs=docs, prepend_bos=prepend_bos
        )
        self.layers = resolve_layers(model, layers)
        self.per_document = per_document
        self.model_name = str(getattr(model.cfg, "model_name", ""))
        self._position = {layer: i for i, layer in enumerate(self.layers)}
        device = model.cfg.device
        shape = (len(self.layers), model.cfg.n_heads)
        record = len(docs) if per_document else None
        self.sums = StackedSums(TAXONOMY_FIELDS, shape, n_documents=record, device=device)
        with torch.inference_mode(False):  # uploaded once
            self._sinks = torch.tensor(self.sink_positions, dtype=torch.long, device=device)
        self._cache: tuple[Any, ...] = (None, None, None)

    def update(self, block: Any) -> None:
        """Fold one block of query rows: winner categories, counts, norms and entropies.

        Args:
            block: One layer's `LayerContributionsResult`.

        Examples:
            ```python
            import cw_lens
            from cw_lens.data.streaming import stream_corpus

            model = cw_lens.load_model("testing:tiny-llama")
            texts = ["The cat sat on the mat.", "Heads look at BOS, mostly."]
            accumulator = cw_lens.HeadTaxonomyAccumulator(model, texts)
            stats, _ = stream_corpus(model, texts, [accumulator])  # update(block) per block
            accumulator.finish(stats).regime_shares()
            ```
        """
        acts = block.acts
        n_keys = block.keys.stop
        is_sink, kv = self._tables(
            acts.n_heads, acts.values.shape[2], *acts.mask.shape[1:], acts.mask.device
        )
        positions = block.query_positions
        norms = acts.values[:, :n_keys].norm(dim=-1)[..., kv].transpose(1, 2)  # [b, head, key]
        winners = source_winners(block.attention, norms, positions)  # [batch, head, query]
        current = winners == positions
        sink = is_sink[winners] > current  # a sink position, not the query itself
        counted = block.query_mask[:, None, :] > is_sink[block.queries]  # real, not a sink
        rows = torch.stack(
            [
                current,
                sink,
                ~(current | sink),
                counted.expand_as(current),
                block.head_output_norm,
                attention_entropy(block.attention),
            ],
            -1,
        )  # [batch, head, query, statistic]; summed over the counted queries in float32
        rows = (rows * counted[..., None]).sum(2)
        documents = document_rows(acts.batch.documents, rows.device)
        self.sums.add(rows, documents, at=self._position[acts.layer])

    def _tables(self, n_heads: int, n_kv: int, n_pos: int, device: Any) -> tuple[Tensor, Tensor]:
        """Which positions are sinks, and each head's kv head: made once per shape."""
        key = (n_heads, n_kv, n_pos, str(device))
        if self._cache[0] != key:
            positions = torch.arange(n_pos, device=device)
            is_sink = torch.isin(positions, self._sinks.to(device))
            self._cache = (key, is_sink, kv_of_heads(n_heads, n_kv, device))
        return self._cache[1], self._cache[2]

    def finish(self, stats: Any) -> HeadTaxonomyResult:
        """The result of the merged sums (moved to the host once).

        Args:
            stats: The pass's `StreamStats`.

        Returns:
            A `HeadTaxonomyResult`.

        Examples:
            ```python
            import cw_lens
            from cw_lens.data.streaming import stream_corpus

            model = cw_lens.load_model("testing:tiny-llama")
            texts = ["The cat sat on the mat.", "Heads look at BOS, mostly."]
            accumulator = cw_lens.HeadTaxonomyAccumulator(model, texts)
            stats, _ = stream_corpus(model, texts, [accumulator])  # update(block) per block
            accumulator.finish(stats).regime_shares()
            ```
        """
        sums = self.sums.to_host()
        self._cache = (None, None, None)  # the last batch's tables go with the pass
        record = sums.document_table()[..., :3].clone() if self.per_document else None
        return HeadTaxonomyResult(
            table=_taxonomy_table(sums.total, self.layers),
            sink_positions=self.sink_positions,
            n_documents=stats.n_documents,
            model_name=self.model_name,
            per_document=record,
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
        """Share of heads in each regime.

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
        """Headline numbers: head count and regime shares.

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

    claims = moved_to_reproduction("claims")  # deprecated: cw_lens.reproduction.claims(result)
    replicates = moved_to_reproduction("replicates")

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
            intervals over documents (`cw_lens.reproduction.claims(result, Bootstrap(...))`).

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
    accumulator = HeadTaxonomyAccumulator(
        model,
        corpus,
        sink_positions=sink_positions,
        layers=layers,
        batch_size=batch_size,
        prepend_bos=prepend_bos,
        per_document=per_document,
    )
    label = "head taxonomy" if progress else False
    stats, _ = stream_corpus(
        model, corpus, [accumulator], batch_size=batch_size, prepend_bos=prepend_bos, progress=label
    )
    return accumulator.finish(stats)


def _taxonomy_table(sums: Float[Tensor, "layer head 6"], layers: list[int]) -> pd.DataFrame:
    """The per-(layer, head) table from the summed `TAXONOMY_FIELDS`."""
    field = {name: sums[..., k] for k, name in enumerate(TAXONOMY_FIELDS)}
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
