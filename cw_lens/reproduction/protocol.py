"""The reproduction's three questions about a toolkit result: its claims, their numbers'
replicates, and their intervals.

A toolkit result (a [`SinkStatisticsResult`][cw_lens.SinkStatisticsResult], a
[`HeadTaxonomyResult`][cw_lens.HeadTaxonomyResult], ...) holds numbers and per-document tables;
it knows nothing of the papers. The reproduction layer reads those numbers and judges the
papers' claims:

- `claims(result, bootstrap=None, **options)`: the claims the result bears on, each with its
  measured numbers and verdict (a [`ClaimsTable`][cw_lens.ClaimsTable]); with a
  [`Bootstrap`][cw_lens.reproduction.Bootstrap], every number gets its 95% interval over
  documents and the verdict reads the interval (docs/methods.md#claims);
- `replicates(result, bootstrap, **options)`: the claims' numbers in every row of the
  bootstrap's weights (the resamples, the corpus, the leave-one-out corpora), from the result's
  per-document record (the analysis run with `per_document=True`);
- `intervals(result, bootstrap)`: the intervals alone, and the per-layer detail where a claim
  is about layers.

Each is one generic function (`functools.singledispatch`): the module that holds an analysis's
claims (`cw_lens.reproduction.sink_claims`, ...) registers its implementation for that
analysis's result class. A result class with no claims gets a clear error.

Example:
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

from __future__ import annotations

from functools import singledispatch
from typing import Any

from cw_lens.core.errors import InputError


def _no_claims(result: Any, question: Any) -> InputError:
    known = sorted(cls.__name__ for cls in question.registry if cls is not object)
    name = question.__name__
    if not known:  # only this module was imported: no analysis has registered its answer
        return InputError(
            f"{name}(): no analysis's answer is registered yet; import the function from the "
            f"package (`from cw_lens.reproduction import {name}`), which registers them all."
        )
    return InputError(
        f"{name}(): a {type(result).__name__} bears on none of the papers' claims; the "
        f"results that do are {', '.join(known)}."
    )


@singledispatch
def claims(result: Any, bootstrap: Any = None, **options: Any) -> Any:
    """The papers' claims that `result` bears on, with the numbers measured in it.

    Args:
        result: A toolkit result with claims (its class is registered here).
        bootstrap: With a [`Bootstrap`][cw_lens.reproduction.Bootstrap], every number's 95%
            interval over documents; the verdicts then read the intervals (the result needs
            `per_document=True`).
        **options: What the analysis's claims take besides (for a pruning result,
            `other_scope`).

    Returns:
        A [`ClaimsTable`][cw_lens.ClaimsTable]: `{claim id: claim}`, each a JSON-ready dict
        with its verdict (`holds`), criterion and `measured` numbers.

    Raises:
        InputError: The result bears on no claim.

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
    raise _no_claims(result, claims)


@singledispatch
def replicates(result: Any, bootstrap: Any, **options: Any) -> Any:
    """The claims' numbers in every row of `bootstrap`'s weights.

    Args:
        result: A toolkit result with claims, run with `per_document=True`.
        bootstrap: The resampling of documents.
        **options: What the analysis's replicates take besides (for sink statistics,
            `drivers`).

    Returns:
        The numbers' replicates, `{number: [rows]}` (sink statistics: that and the per-head
        fields they come from).

    Raises:
        InputError: The result bears on no claim.

    Examples:
        ```python
        import cw_lens
        from cw_lens.reproduction import Bootstrap, replicates

        model = cw_lens.load_model("testing:tiny-llama")
        corpus = cw_lens.load_corpus(n_docs=2, max_tokens=16, model=model)
        taxonomy = cw_lens.head_taxonomy(model, corpus, per_document=True, progress=False)
        replicates(taxonomy, Bootstrap(resamples=100))["retriever_share"].shape  # [100 + 1 + 2]
        ```
    """
    raise _no_claims(result, replicates)


@singledispatch
def intervals(result: Any, bootstrap: Any) -> Any:
    """The 95% intervals over documents of the claims' numbers.

    Args:
        result: A toolkit result with claims, run with `per_document=True`.
        bootstrap: The resampling of documents.

    Returns:
        `({number: (low, high)}, {claim id: per-layer rows})`; the second is empty where no
        claim is about layers.

    Raises:
        InputError: The result bears on no claim.

    Examples:
        ```python
        import cw_lens
        from cw_lens.reproduction import Bootstrap, intervals

        model = cw_lens.load_model("testing:tiny-llama")
        corpus = cw_lens.load_corpus(n_docs=2, max_tokens=16, model=model)
        taxonomy = cw_lens.head_taxonomy(model, corpus, per_document=True, progress=False)
        numbers, per_layer = intervals(taxonomy, Bootstrap(resamples=100))
        numbers["retriever_share"]  # (low, high)
        ```
    """
    raise _no_claims(result, intervals)
