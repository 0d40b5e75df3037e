"""P2's taxonomy claim `retriever_share` (methods § Claims, docs/methods.md#claims), judged from a
[`HeadTaxonomyResult`][cw_lens.HeadTaxonomyResult].

The claim: Retrievers (heads whose most frequent source winner is the current token) are a
minority of the heads. Its criterion: the share of Retriever heads lies in P2's range
`RETRIEVER_RANGE` = [5.8%, 17.2%]; with a bootstrap the verdict reads the share's 95% interval
over documents, and each layer's share gets its own interval (the claim's `per_layer` rows).

`cw_lens.reproduction.claims`, `replicates` and `intervals` of a taxonomy result are
`head_taxonomy_claims`, `head_taxonomy_replicates` and `head_taxonomy_intervals` (registered
here).

Example:
    ```python
    import cw_lens
    from cw_lens.reproduction import Bootstrap, claims

    model = cw_lens.load_model("testing:tiny-llama")
    corpus = cw_lens.load_corpus(n_docs=2, max_tokens=16, model=model)
    taxonomy = cw_lens.head_taxonomy(model, corpus, per_document=True, progress=False)
    claims(taxonomy)["retriever_share"]["holds"]
    claims(taxonomy, Bootstrap(resamples=100))["retriever_share"]["per_layer"]
    ```
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from cw_lens.analyses.common import rounded_dict
from cw_lens.analyses.taxonomy import HeadTaxonomyResult
from cw_lens.reproduction.bootstrap import Bootstrap, require_record
from cw_lens.reproduction.protocol import claims, intervals, replicates
from cw_lens.reproduction.resampled import per_layer_rows, taxonomy_numbers
from cw_lens.reproduction.verdicts import Check, Claim, ClaimsDict, claims_dict, with_intervals

RETRIEVER_RANGE = (0.058, 0.172)  # P2's range of Retriever shares (docs/methods.md#claims)


def retriever_share_claim(result: HeadTaxonomyResult) -> Claim:
    """The claim `retriever_share` at its point values: the share of Retriever heads in
    `RETRIEVER_RANGE`.

    Args:
        result: A head-taxonomy result.

    Returns:
        The claim, with the regime shares, the dominant regime and the number of heads measured.

    Examples:
        ```python
        import cw_lens
        from cw_lens.reproduction.taxonomy_claims import retriever_share_claim

        model = cw_lens.load_model("testing:tiny-llama")
        corpus = cw_lens.load_corpus(n_docs=2, max_tokens=16, model=model)
        taxonomy = cw_lens.head_taxonomy(model, corpus, progress=False)
        retriever_share_claim(taxonomy).holds
        ```
    """
    shares = result.regime_shares()
    return Claim(
        "retriever_share",
        paper="Retrievers are a minority, 5.8-17.2% of heads (P2)",
        criterion="Retriever share in [5.8%, 17.2%]",
        checks=[Check("retriever_share", float(shares["Retriever"]), "in", RETRIEVER_RANGE)],
        measured={
            "regime_shares": rounded_dict(shares),
            "dominant_regime": str(shares.idxmax()),
            "n_heads": len(result.table),
        },
    )


@claims.register(HeadTaxonomyResult)
def head_taxonomy_claims(
    result: HeadTaxonomyResult, bootstrap: Bootstrap | None = None
) -> ClaimsDict:
    """P2's taxonomy claim `retriever_share` with the numbers measured in `result`.

    Args:
        result: A head-taxonomy result.
        bootstrap: With a [`Bootstrap`][cw_lens.reproduction.Bootstrap], the share's 95%
            interval over documents and each layer's (`head_taxonomy_intervals`; the result
            needs `per_document=True`), which the verdict then reads.

    Returns:
        `{claim id: claim}`, each claim a JSON-ready dict with its verdict and `measured`
        numbers (with a bootstrap, also the `per_layer` rows).

    Examples:
        ```python
        import cw_lens
        from cw_lens.reproduction import Bootstrap, claims

        model = cw_lens.load_model("testing:tiny-llama")
        corpus = cw_lens.load_corpus(n_docs=2, max_tokens=16, model=model)
        taxonomy = cw_lens.head_taxonomy(model, corpus, per_document=True, progress=False)
        claims(taxonomy)["retriever_share"]["holds"]
        claims(taxonomy, Bootstrap(resamples=100))
        ```
    """
    out = [retriever_share_claim(result)]
    if bootstrap is not None:
        out = with_intervals(out, *head_taxonomy_intervals(result, bootstrap))
    return claims_dict(out)


@replicates.register(HeadTaxonomyResult)
def head_taxonomy_replicates(result: HeadTaxonomyResult, bootstrap: Bootstrap) -> dict[str, Tensor]:
    """`retriever_share` in every row of `bootstrap`'s weights: each row reclassifies every head
    from its resampled winner counts (`cw_lens.reproduction.resampled.taxonomy_numbers`).

    Args:
        result: A head-taxonomy result run with `per_document=True`.
        bootstrap: The resampling of documents.

    Returns:
        `{number: tensor}`: the share `[rows]` and per layer `[rows, layer]`.

    Examples:
        ```python
        import cw_lens
        from cw_lens.reproduction import Bootstrap, replicates

        model = cw_lens.load_model("testing:tiny-llama")
        corpus = cw_lens.load_corpus(n_docs=2, max_tokens=16, model=model)
        taxonomy = cw_lens.head_taxonomy(model, corpus, per_document=True, progress=False)
        replicates(taxonomy, Bootstrap(resamples=100))["retriever_share"].shape
        ```
    """
    record = require_record(result.per_document, "head_taxonomy")
    return taxonomy_numbers(bootstrap.resample(record))


@intervals.register(HeadTaxonomyResult)
def head_taxonomy_intervals(
    result: HeadTaxonomyResult, bootstrap: Bootstrap
) -> tuple[dict[str, Any], dict[str, list[dict[str, Any]]]]:
    """The 95% interval over documents of the Retriever share, and of each layer's share.

    Args:
        result: A head-taxonomy result run with `per_document=True`.
        bootstrap: The resampling of documents.

    Returns:
        `({"retriever_share": (low, high)}, {"retriever_share": per-layer rows})`, the rows of
        `cw_lens.reproduction.resampled.per_layer_rows`.

    Examples:
        ```python
        import cw_lens
        from cw_lens.reproduction import Bootstrap, intervals

        model = cw_lens.load_model("testing:tiny-llama")
        corpus = cw_lens.load_corpus(n_docs=2, max_tokens=16, model=model)
        taxonomy = cw_lens.head_taxonomy(model, corpus, per_document=True, progress=False)
        share, per_layer = intervals(taxonomy, Bootstrap(resamples=100))
        ```
    """
    reps = head_taxonomy_replicates(result, bootstrap)
    layers = result.layers
    point = result.table.groupby("layer")["regime"].apply(lambda r: (r == "Retriever").mean())
    rows = per_layer_rows(
        layers,
        "retriever_share",
        torch.tensor(point.loc[layers].to_numpy(), device="cpu"),
        *bootstrap.judged(reps["retriever_share_per_layer"], number="retriever_share"),
    )
    share = bootstrap.pair(reps["retriever_share"], number="retriever_share")
    return {"retriever_share": share}, {"retriever_share": rows}
