"""The reproduction of the two papers, as a layer above the toolkit.

The toolkit (`cw_lens.analyses`, `cw_lens.flow`, ...) computes numbers and per-document
tables. This layer turns them into the papers' claims and judges each one: its criterion, its
95% bootstrap interval over documents, the coverage certificate of that interval, the main job
that runs every analysis and writes the report (`cw-lens figures`), and the comparison of two
runs (`cw-lens compare`). The toolkit never imports it.

- `claims(result, bootstrap=None, **options)`, `replicates(result, bootstrap)`,
  `intervals(result, bootstrap)`: the claims a result bears on, their numbers in every
  bootstrap row, and their intervals (`protocol`).
- [`Bootstrap`][cw_lens.reproduction.Bootstrap]: the resampling of documents and the interval
  rule (`bootstrap`).
- The claims of each analysis, as pure functions of its result: `sink_claims`,
  `selection_claims`, `taxonomy_claims`, `faithfulness_claims`, `pruning_claims`, and one
  beyond the papers, `field_claims` (`contribution_vs_field`: cw_lens against the field's
  attribution methods); their criteria are built from `verdicts.Check` and `verdicts.Claim`.
- `job` (`cw-lens figures`; its settings and state in `state`, its steps in `steps`),
  `run_comparison` ([`cw_lens.compare_runs`][cw_lens.compare_runs]), `interval_coverage`
  (the certificates), `cli` (the `cw-lens` console script).

Example:
    ```python
    import cw_lens
    from cw_lens.reproduction import Bootstrap, claims

    model = cw_lens.load_model("testing:tiny-llama")
    corpus = cw_lens.load_corpus(n_docs=2, max_tokens=16, model=model)
    stats = cw_lens.sink_statistics(model, corpus, per_document=True, progress=False)
    claims(stats)                          # point verdicts
    claims(stats, Bootstrap(resamples=50))  # verdicts that read the intervals
    ```
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from cw_lens.reproduction.bootstrap import Bootstrap
    from cw_lens.reproduction.protocol import claims, intervals, replicates
    from cw_lens.reproduction.verdicts import ClaimsTable

__all__ = ["Bootstrap", "ClaimsTable", "claims", "intervals", "replicates"]


def __getattr__(name: str) -> Any:
    """A public name, imported on first use (the console script stays light).

    Asking for any of them imports every analysis's claims module, which registers its answers.

    Args:
        name: The name asked for.

    Returns:
        The public object of that name.

    Raises:
        AttributeError: The module has no such name.
    """
    if name not in __all__:
        raise AttributeError(f"module 'cw_lens.reproduction' has no attribute {name!r}")
    from cw_lens.reproduction import (  # noqa: F401  (their registrations)
        faithfulness_claims,
        field_claims,
        pruning_claims,
        selection_claims,
        sink_claims,
        taxonomy_claims,
    )
    from cw_lens.reproduction.bootstrap import Bootstrap
    from cw_lens.reproduction.protocol import claims, intervals, replicates
    from cw_lens.reproduction.verdicts import ClaimsTable

    public = {
        "Bootstrap": Bootstrap,
        "ClaimsTable": ClaimsTable,
        "claims": claims,
        "intervals": intervals,
        "replicates": replicates,
    }
    globals().update(public)
    return public[name]


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
