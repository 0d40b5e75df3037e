"""The selection claims of methods § Claims (docs/methods.md#claims), `topn_beats_random` and
`sink_lowers_fn`, judged from a
[`SelectionGeometryResult`][cw_lens.SelectionGeometryResult], and the selection sizes they read.

- `topn_beats_random`: the mean over heads of F_N(top) - F_N(random) is > 0 at every N > 1,
  and the largest difference is at N in {2, 4} (`SMALL_N`);
- `sink_lowers_fn`: at N = 2 and N = 4 (`SINK_N`) the geometric mean over heads of
  F_N(sink excluded) / F_N(sink allowed) is > 1.

`cw_lens.reproduction.claims`, `replicates` and `intervals` of a selection result are
`selection_geometry_claims`, `selection_geometry_replicates` and
`selection_geometry_intervals` (registered here).

Example:
    ```python
    import cw_lens
    from cw_lens.reproduction import Bootstrap, claims

    model = cw_lens.load_model("testing:tiny-llama")
    corpus = cw_lens.load_corpus(n_docs=2, max_tokens=16, model=model)
    geo = cw_lens.selection_geometry(model, corpus, per_document=True, progress=False)
    claims(geo)["sink_lowers_fn"]["holds"]
    claims(geo, Bootstrap(resamples=100))
    ```
"""

from __future__ import annotations

import math
from typing import Any

import pandas as pd
import torch
from torch import Tensor

from cw_lens.analyses.common import rounded_dict
from cw_lens.analyses.selection.accumulation import RULES
from cw_lens.analyses.selection.geometry import SelectionGeometryResult, head_f_ratio
from cw_lens.reproduction.bootstrap import Bootstrap, require_record
from cw_lens.reproduction.protocol import claims, intervals, replicates
from cw_lens.reproduction.resampled import F_EPS, geometric_mean_ratio, selection_numbers
from cw_lens.reproduction.verdicts import Check, Claim, ClaimsDict, claims_dict, with_intervals

SMALL_N = (2, 4)  # topn_beats_random: the largest difference is at one of these N
SINK_N = (2, 4)  # sink_lowers_fn: the N it is judged at


def selection_claims(table: pd.DataFrame) -> list[Claim]:
    """`topn_beats_random` (when the random rule was run) and `sink_lowers_fn`, as the
    criteria of methods § Claims (docs/methods.md#claims) read them, from the per-head table of
    [`SelectionGeometryResult.to_dataframe`][cw_lens.SelectionGeometryResult.to_dataframe] (`layer,
    head, n, rule, f`).

    - `topn_beats_random`: the mean over heads of F_N(top) - F_N(random) is > 0 at every
      N > 1 (its minimum is the number), and the largest difference is at N in {2, 4} (the
      number: the largest difference there minus the largest at N > 4; omitted when no N > 4
      was measured).
    - `sink_lowers_fn`: at N = 2 and N = 4 the geometric mean over heads of
      F_N(sink excluded) / F_N(sink allowed) is > 1, each F plus 0.01 so that a head with
      F = 0 counts (`cw_lens.reproduction.resampled.geometric_mean_ratio`: a smooth statistic, where
      the median sits on the point mass of heads at exactly 1); the median ratio
      (`head_f_ratio`), the share of heads at >= 2x and the share of heads with an F of
      0 are reported beside it.

    Args:
        table: The per-head table (`layer, head, n, rule, f`).

    Returns:
        The claims, `topn_beats_random` first when the random rule was run.
    """
    # Long: the two claims share the per-head table and its N grid; split, each would re-derive
    # them.
    f = table.pivot_table(index=["layer", "head", "n"], columns="rule", values="f")
    means = f.groupby("n").mean()
    grid = [int(n) for n in means.index if n > 1]
    out = []
    if "random" in f:
        gap = (means["top"] - means["random"]).loc[grid]
        small = [n for n in grid if n in SMALL_N]
        large = [n for n in grid if n > max(SMALL_N)]
        checks = [Check("min_over_n_f_top_minus_random", gap.min() if grid else math.nan, ">", 0.0)]
        if large:
            peak_small = gap.loc[small].max() if small else math.nan
            checks.append(
                Check(
                    "largest_gap_n2_n4_minus_larger_n", peak_small - gap.loc[large].max(), ">", 0.0
                )
            )
        out.append(
            Claim(
                "topn_beats_random",
                paper="top-N selections more separable than random, most at small N (P2)",
                criterion="mean F_N(top) > F_N(random) at every N > 1, and the largest "
                "difference at N ∈ {2, 4}",
                checks=checks,
                measured={
                    "f_top_minus_random": rounded_dict(gap),
                    "f_top": rounded_dict(means.loc[grid, "top"]),
                    "f_random": rounded_dict(means.loc[grid, "random"]),
                    "top_over_random": rounded_dict(
                        means.loc[grid, "top"] / means.loc[grid, "random"]
                    ),
                    "n_with_largest_gap": int(gap.idxmax()) if grid else None,
                },
            )
        )
    ratio = head_f_ratio(f["top_no_sink"], f["top"])
    median = ratio.groupby("n").median()
    at_least_2x = (ratio.dropna() >= 2).groupby("n").mean()
    zero = ((f["top_no_sink"] == 0) | (f["top"] == 0)).groupby("n").mean()
    geomean = {
        n: float(
            geometric_mean_ratio(
                torch.tensor(g["top_no_sink"].values, device="cpu"),
                torch.tensor(g["top"].values, device="cpu"),
            )
        )
        for n, g in f.groupby("n")
    }
    out.append(
        Claim(
            "sink_lowers_fn",
            paper="including the sink in top-N lowers F_N (often about 2x) (P2)",
            criterion="at N = 2 and N = 4 the geometric mean over heads of F_N(sink "
            "excluded)/F_N(sink allowed) > 1 (a smooth statistic: the median sits on a point "
            "mass of heads at exactly 1 and its bootstrap is off-centre); the median and the "
            "share of heads at ≥ 2× are reported beside it",
            checks=[
                Check(f"geomean_head_ratio_n{n}", geomean.get(n, math.nan), ">", 1.0)
                for n in SINK_N
            ],
            measured={
                "share_heads_at_least_2x": {
                    n: round(float(at_least_2x.get(n, math.nan)), 4) for n in SINK_N
                },
                "share_heads_with_zero_f": {
                    n: round(float(zero.get(n, math.nan)), 4) for n in SINK_N
                },
                "f_eps": F_EPS,
                "median_head_ratio": rounded_dict(median.loc[grid]),
                "ratio_of_mean_f": rounded_dict(
                    means.loc[grid, "top_no_sink"] / means.loc[grid, "top"]
                ),
            },
        )
    )
    return out


@claims.register(SelectionGeometryResult)
def selection_geometry_claims(
    result: SelectionGeometryResult, bootstrap: Bootstrap | None = None
) -> ClaimsDict:
    """P2's selection claims (`selection_claims`) with the numbers measured in `result`.

    Args:
        result: A selection-geometry result.
        bootstrap: With a [`Bootstrap`][cw_lens.reproduction.Bootstrap], each number's 95%
            interval over documents (`selection_geometry_intervals`; the result needs
            `per_document=True`), which the verdicts then read.

    Returns:
        `{claim id: claim}`, each claim a JSON-ready dict with its verdict and `measured`
        numbers.

    Examples:
        ```python
        import cw_lens
        from cw_lens.reproduction import Bootstrap, claims

        model = cw_lens.load_model("testing:tiny-llama")
        corpus = cw_lens.load_corpus(n_docs=2, max_tokens=16, model=model)
        geo = cw_lens.selection_geometry(model, corpus, per_document=True, progress=False)
        claims(geo)["topn_beats_random"]["holds"]
        claims(geo, Bootstrap(resamples=100))
        ```
    """
    out = selection_claims(result.to_dataframe())
    if bootstrap is not None:
        out = with_intervals(out, selection_geometry_intervals(result, bootstrap)[0])
    return claims_dict(out)


@replicates.register(SelectionGeometryResult)
def selection_geometry_replicates(
    result: SelectionGeometryResult, bootstrap: Bootstrap
) -> dict[str, Tensor]:
    """The selection claims' numbers in every row of `bootstrap`'s weights
    (`cw_lens.reproduction.resampled.selection_numbers` of the resampled per-document sums).

    Args:
        result: A selection-geometry result run with `per_document=True`.
        bootstrap: The resampling of documents.

    Returns:
        `{number: tensor of one value per row}`.

    Examples:
        ```python
        import cw_lens
        from cw_lens.reproduction import Bootstrap, replicates

        model = cw_lens.load_model("testing:tiny-llama")
        corpus = cw_lens.load_corpus(n_docs=2, max_tokens=16, model=model)
        geo = cw_lens.selection_geometry(model, corpus, per_document=True, progress=False)
        replicates(geo, Bootstrap(resamples=100))
        ```
    """
    record = require_record(result.per_document, "selection_geometry")
    return selection_numbers(bootstrap.resample(record), result.n_grid, RULES, SMALL_N, SINK_N)


@intervals.register(SelectionGeometryResult)
def selection_geometry_intervals(
    result: SelectionGeometryResult, bootstrap: Bootstrap
) -> tuple[dict[str, Any], dict[str, list[dict[str, Any]]]]:
    """The 95% intervals over documents of the selection claims' numbers.

    Args:
        result: A selection-geometry result run with `per_document=True`.
        bootstrap: The resampling of documents.

    Returns:
        `({number: (low, high)}, {})`: no selection claim is about layers.

    Examples:
        ```python
        import cw_lens
        from cw_lens.reproduction import Bootstrap, intervals

        model = cw_lens.load_model("testing:tiny-llama")
        corpus = cw_lens.load_corpus(n_docs=2, max_tokens=16, model=model)
        geo = cw_lens.selection_geometry(model, corpus, per_document=True, progress=False)
        numbers, _ = intervals(geo, Bootstrap(resamples=100))
        ```
    """
    reps = selection_geometry_replicates(result, bootstrap)
    return {k: bootstrap.pair(v, number=k) for k, v in reps.items()}, {}
