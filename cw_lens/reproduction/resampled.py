r"""The claims' headline numbers recomputed on bootstrap replicates of per-document sums.

Each function takes the replicates `[R, ...]` of the sums an analysis keeps (what
`cw_lens.reproduction.bootstrap.Bootstrap.resample` returns from a per-document record) and returns
every headline number of its claims for all `R` replicates at once, `{number: [R]}`, by the
same formula as the claim's point value (docs/methods.md#claims). Applied to the corpus totals (`R
= 1`) they give the point values back, which the tests check. Pure tensor math: no model, no
pandas.

What each interval is of, where the exact number cannot be recomputed from per-document sums:

- `median_cancelled_share` (`sink_cancels_drift`): the median over sink heads of each
  head's median cancelled share read from per-document *coarse* histograms (24 bins equal in
  `asinh(v / 1e-3)` on `[-10, 10]`, an edge at 0, plus the two edge bins: the sign of a
  head's median is exact, its size resolved to a factor of about 2.5). The claim's value is
  read from the same histograms summed over the corpus (`sink_claims.sink_statistics_claims`), not
  from the fine histogram of `heads()`' `drift_cancelled_median`, so the value and its interval
  are one number's (docs/methods.md#sinks says how far the two readings differ).
- `median_abs_rho_*` (`sink_contribution_drivers`): per head, the Spearman rho over the
  kept factor samples, each counted as often as its document is drawn — the rho of the
  resampled corpus exactly when every entry was kept (the reservoirs' capacity not reached),
  else a resample of the kept entries.
- Everything else is exact up to the float32 rounding of the per-document sums: sink heads,
  per-head means and ratios are recomputed per resample from the resampled sums; the s* and
  drift-cosine medians are decided by edge counts (`median s* in (0, 1)` iff fewer than half
  of the head's s* are `<= 0` and fewer than half `>= 1`; `median cos < 0` iff more than
  half of the cosines are negative), which is what the point value's histogram reads.

Example:

    from cw_lens.reproduction.bootstrap import Bootstrap
    from cw_lens.reproduction.resampled import taxonomy_numbers
    boot = Bootstrap(1000, seed=0)
    counts = boot.resample(per_doc_counts)        # [R, layer, head, 3]
    reps = taxonomy_numbers(counts)["retriever_share"]
    boot.pair(reps, number="retriever_share")   # (low, high), with .bias_to_se, .method
"""

from __future__ import annotations

import itertools
import math
from typing import Any

import torch
from jaxtyping import Bool, Float
from torch import Tensor

from cw_lens.core.histograms import Histogram
from cw_lens.reproduction.bootstrap import is_biased_plugin as is_biased_plugin  # re-exported
from cw_lens.reproduction.bootstrap import masked_mean, masked_median, ratio

Tables = dict[str, Tensor]


# --------------------------------------------------------------------------- sinks


def sink_head_fields(
    t: Tables, share_counts: Tensor, share_binning: dict, threshold: float
) -> Tables:
    """Per (replicate, layer, head) fields from resampled sums `t[name]` `[R, L, H]`."""
    rate = ratio(t["rate_sum"], t["rate_count"])
    hist = Histogram((), **share_binning)
    hist.counts = share_counts
    n = t["s_star_n"]
    return {
        "sink": rate > threshold,  # NaN (nothing counted) is not a sink head
        "attention": ratio(t["sink_attention_sum"], t["sink_count"]),
        "contribution": ratio(t["sink_contribution_sum"], t["sink_count"]),
        "norm_ratio": ratio(t["ratio_sum"], t["geometry_count"]),
        "cos_mixture": ratio(t["cos_mixture_sum"], t["cos_mixture_count"]),
        "s_star_n": n,
        "s_star_interior": (n > 0) & (2 * t["s_star_lo"] < n) & (2 * t["s_star_hi"] < n),
        "drift_negative": 2 * t["drift_neg"] > t["drift_count"],
        "cancelled_median": hist.quantile(0.5),
    }


def _sink_reduce(f: Tables, min_s_star_queries: int) -> Tables:
    """The sink claims' numbers over the last axis (heads) of the fields `f`."""
    sink = f["sink"]
    judged = sink & (f["s_star_n"] >= min_s_star_queries)
    return {
        "contribution_over_attention": ratio(
            masked_mean(f["contribution"], sink), masked_mean(f["attention"], sink)
        ),
        "median_ratio_sink_heads": masked_median(f["norm_ratio"], sink),
        "median_cos_sink_tail_mixture": masked_median(f["cos_mixture"], sink),
        "share_judged_sink_heads_interior_median_s_star": masked_mean(
            f["s_star_interior"].double(), judged
        ),
        "share_sink_heads_negative_cosine": masked_mean(f["drift_negative"].double(), sink),
        "median_cancelled_share": masked_median(f["cancelled_median"], sink),
    }


def sink_numbers(fields: Tables, min_s_star_queries: int) -> dict[str, Float[Tensor, " R"]]:
    """The sink claims' numbers over all heads (`fields` from `sink_head_fields`)."""
    flat = {k: v.flatten(-2) for k, v in fields.items()}
    return _sink_reduce(flat, min_s_star_queries)


def sink_numbers_per_layer(
    fields: Tables, min_s_star_queries: int
) -> dict[str, Float[Tensor, "R layer"]]:
    """The same numbers within each layer's heads."""
    return _sink_reduce(fields, min_s_star_queries)


RANKS_EXACT_IN_FLOAT32 = 2**23  # half-integers below it are exact in float32 (24-bit significand)


def rank_basis(x: Float[Tensor, " n"], doc: Tensor, n_docs: int) -> Float[Tensor, "n document"]:
    """`A` such that, with row `j` repeated `w[d_j]` times (`w` per document), the
    average rank (1-based, ties share their mean rank, as pandas) of row `j` is
    `w @ A[j] + 1/2`: `A[j, d]` is the number of rows of document `d` below `x_j`
    plus half of those equal to it."""
    order = torch.argsort(x, stable=True)
    _, tie = torch.unique_consecutive(x[order], return_inverse=True)
    onehot = torch.zeros(len(x), n_docs, dtype=torch.float64, device=x.device)
    onehot[torch.arange(len(x), device=x.device), doc[order]] = 1.0
    per_tie = torch.zeros(
        int(tie.max()) + 1 if len(x) else 0, n_docs, dtype=torch.float64, device=x.device
    )
    per_tie.index_add_(0, tie, onehot)
    below = per_tie.cumsum(0) - per_tie
    basis = torch.empty_like(onehot)
    basis[order] = below[tie] + per_tie[tie] / 2
    return basis


def doc_weighted_spearman(
    xs: Float[Tensor, "factor n"],
    y: Float[Tensor, " n"],
    doc: Tensor,
    weights: Float[Tensor, "R document"],
) -> Float[Tensor, "R factor"]:
    """Spearman's rho of each row of `xs` with `y` in each replicate, row `j` repeated
    `weights[r, doc[j]]` times — pandas' `corr(method="spearman", min_periods=3)` on the
    repeated rows (NaN below 3 rows or for a constant column). Ranks are `weights @ basis`
    (`rank_basis`), one `[R, documents] x [documents, n]` product per column; the sums
    over the repeated rows weight each row by its document's count.

    With whole-number, non-negative weights and fewer than 2**23 repeated rows every rank is a
    half-integer that float32 holds exactly, and so is every partial sum of the product (its
    terms are not negative): the product is then taken in float32, twice as fast and equal bit
    for bit."""
    w = weights.double()
    counts = torch.bincount(doc, minlength=w.shape[1]).double()
    total = w @ counts  # [R] rows of the repeated sample
    middle = ((total + 1) / 2)[:, None]  # the mean of 1..total, whatever the ties
    exact32 = (
        bool(((w == w.round()) & (w >= 0)).all())
        and (float(total.max()) if len(total) else 0.0) < RANKS_EXACT_IN_FLOAT32
    )
    w_ranks = w.float() if exact32 else w
    row_weights = w[:, doc]  # [R, n]: each row's count in each replicate

    def centred_ranks(v: Tensor) -> Tensor:
        basis = rank_basis(v, doc, w.shape[1]).to(w_ranks.dtype)
        return (w_ranks @ basis.T).double() + 0.5 - middle

    def weighted_sum(values: Tensor) -> Tensor:  # sum over the repeated rows
        return (values * row_weights).sum(1)

    dy = centred_ranks(y)
    vy = weighted_sum(dy * dy)
    out = torch.full((w.shape[0], len(xs)), math.nan, dtype=torch.float64, device=w.device)
    for f, x in enumerate(xs):
        dx = centred_ranks(x)
        vx = weighted_sum(dx * dx)
        rho = weighted_sum(dx * dy) / (vx * vy).sqrt()
        ok = (total >= 3) & (vx > 1e-9) & (vy > 1e-9)
        out[:, f] = torch.where(ok, rho, math.nan)
    return out


def weighted_spearman(
    x: Float[Tensor, " n"], y: Float[Tensor, " n"], w: Float[Tensor, "R n"]
) -> Float[Tensor, " R"]:
    """Spearman's rho of `x` and `y` in each replicate of rows repeated `w[r, j]` times
    (`doc_weighted_spearman` with one document per row)."""
    return doc_weighted_spearman(x[None], y, torch.arange(len(x), device=x.device), w)[:, 0]


def driver_numbers(
    samples: list[tuple[int, int, Float[Tensor, "n factor"], Tensor]],
    factors: tuple[str, ...],
    weights: Float[Tensor, "R document"],
    sink: Bool[Tensor, "R layer head"],
) -> dict[str, Float[Tensor, " R"]]:
    """`sink_contribution_drivers`' numbers, `median_abs_rho_<f>_minus_attention`, on
    replicates of the documents: per head, the Spearman rho of each factor with the
    contribution over its sampled sink entries, each entry counted as often as its document is
    drawn (`weights`); the median over the replicate's sink heads of `|rho|` (NaN rho left
    out, as pandas' median does).

    `samples`: per head `(layer index, head, table, documents)`, `table` `[n, factors +
    1]` (the factors, then the contribution), `documents` `[n]` indexes `weights`.
    """
    n_rep = weights.shape[0]
    rho = {
        f: torch.full((n_rep, len(samples)), math.nan, dtype=torch.float64, device=weights.device)
        for f in factors
    }
    member = torch.zeros(n_rep, len(samples), dtype=torch.bool, device=weights.device)
    used = weights.any(0)  # documents some row draws (once, not an [R, n] gather per head)
    for i, (layer, head, table, docs) in enumerate(samples):
        member[:, i] = sink[:, layer, head]
        if not member[:, i].any():
            continue  # a sink head in no replicate: its rho is never read
        drawn = used[docs]  # entries of documents no row draws count nowhere
        table, docs = table[drawn], docs[drawn]
        present, local = torch.unique(docs, return_inverse=True)
        rhos = doc_weighted_spearman(table[:, :-1].T, table[:, -1], local, weights[:, present])
        for j, f in enumerate(factors):
            rho[f][:, i] = rhos[:, j]
    median = {f: masked_median(rho[f].abs(), member) for f in factors}
    return {
        f"median_abs_rho_{f}_minus_attention": median[f] - median["attention"]
        for f in factors
        if f != "attention"
    }


# --------------------------------------------------------------------------- taxonomy


def retriever(counts: Float[Tensor, "... 3"]) -> Tensor:
    """Is a head a Retriever: `current` is its most frequent category (ties to Retriever)."""
    return counts.argmax(-1) == 0


def taxonomy_numbers(counts: Float[Tensor, "R layer head 3"]) -> dict[str, Tensor]:
    """`retriever_share` `[R]` and per layer `[R, layer]` from (current, sink, other)
    winner counts per head."""
    is_retriever = retriever(counts).double()
    return {
        "retriever_share": is_retriever.flatten(-2).mean(-1),
        "retriever_share_per_layer": is_retriever.mean(-1),
    }


def per_layer_rows(
    layers: list[int],
    number: str,
    value: Tensor,
    interval: Tensor,
    bias_se: Tensor | None = None,
    methods: list[str] | None = None,
) -> list[dict[str, Any]]:
    """Tidy rows, one per layer, of a number computed within each layer.

    Args:
        layers: The layers, in the order of the values.
        number: The number's name.
        value: Its point value per layer `[L]`.
        interval: Its interval per layer `[2, L]`.
        bias_se: Its bootstrap `|bias| / SE` per layer `[L]` (NaN: not computable), as
            `cw_lens.reproduction.bootstrap.Bootstrap.judged` gives it; None: not recorded.
        methods: The interval method of each layer (`Bootstrap.judged`'s); None: not
            recorded.

    Returns:
        `{"layer", "number", "value", "low", "high"}` per layer, with `"bias_to_se"` (None
        where not computable) and `"interval_method"` when given.
    """
    rows = []
    for i, layer in enumerate(layers):
        row = {
            "layer": int(layer),
            "number": number,
            "value": float(value[i]),
            "low": float(interval[0, i]),
            "high": float(interval[1, i]),
        }
        if bias_se is not None:
            ratio = float(bias_se[i])
            row["bias_to_se"] = None if math.isnan(ratio) else ratio
        if methods is not None:
            row["interval_method"] = methods[i]
        rows.append(row)
    return rows


# --------------------------------------------------------------------------- selection


def _nan_extreme(x: Tensor, largest: bool) -> Tensor:
    """Max (or min) over the last axis ignoring NaN; NaN where all are NaN."""
    fill = -math.inf if largest else math.inf
    filled = torch.where(x.isnan(), fill, x)
    out = filled.amax(-1) if largest else filled.amin(-1)
    return torch.where(x.isnan().all(-1), math.nan, out)


def selection_numbers(
    sums: Float[Tensor, "R layer rule head n 2"],
    n_grid: list[int],
    rules: tuple[str, ...],
    small_n: tuple[int, ...],
    sink_n: tuple[int, ...],
) -> dict[str, Tensor]:
    """`topn_beats_random` and `sink_lowers_fn`'s numbers from sums of (F, scored queries)
    per (layer, rule, head, N), as `cw_lens.reproduction.selection_claims.selection_claims` reads
    them: the mean over heads of each head's mean F per rule and N; the geometric mean over
    heads of F(sink excluded) / F(sink allowed) (`geometric_mean_ratio`)."""
    f = ratio(sums[..., 0], sums[..., 1])  # [R, L, rule, H, n]; NaN where nothing was scored
    f = f.transpose(1, 2).flatten(2, 3)  # [R, rule, heads, n]
    means = masked_mean(f.transpose(-1, -2), ~f.transpose(-1, -2).isnan())  # [R, rule, n]
    rule = {r: i for i, r in enumerate(rules)}
    n_index = {n: k for k, n in enumerate(n_grid)}
    grid = [n for n in n_grid if n > 1]
    out: dict[str, Tensor] = {}
    if "random" in rule and grid:
        gap = means[:, rule["top"]] - means[:, rule["random"]]  # [R, n]
        out["min_over_n_f_top_minus_random"] = -_nan_extreme(
            -gap[:, [n_index[n] for n in grid]], largest=True
        )
        small = [n_index[n] for n in grid if n in small_n]
        large = [n_index[n] for n in grid if n > max(small_n)]
        if large:
            peak = _nan_extreme(gap[:, small], largest=True) if small else gap[:, 0] * math.nan
            out["largest_gap_n2_n4_minus_larger_n"] = peak - _nan_extreme(
                gap[:, large], largest=True
            )
    with_sink, without = f[:, rule["top"]], f[:, rule["top_no_sink"]]  # [R, heads, n]
    for n in sink_n:
        if n in n_index:
            k = n_index[n]
            out[f"geomean_head_ratio_n{n}"] = geometric_mean_ratio(
                without[..., k], with_sink[..., k]
            )
    return out


F_EPS = 0.01  # added to both F's of a head in sink_lowers_fn's ratio (F_N is in [0, 1])


def geometric_mean_ratio(
    f_without: Float[Tensor, "... head"], f_with: Float[Tensor, "... head"]
) -> Float[Tensor, "..."]:
    """`exp(mean_h log((F_h(sink excluded) + eps) / (F_h(sink allowed) + eps)))` over the heads
    where both are measured (`eps` = `F_EPS`: a head whose F is 0 — no selected key
    closer than the nearest unselected one in any scored query — gets a finite ratio instead
    of 0 or infinity); NaN where no head is."""
    log_ratio = torch.log((f_without.double() + F_EPS) / (f_with.double() + F_EPS))
    return torch.exp(masked_mean(log_ratio, ~log_ratio.isnan()))


# --------------------------------------------------------------------------- faithfulness


def aopc_numbers(
    sums: Float[Tensor, "R statistic"],
    names: list[str],
    configs: list[tuple],
    task: bool,
) -> dict[tuple[str, str, str], Tensor]:
    """AOPC per (granularity, mode, metric) `[R]` from resampled per-configuration sums
    (`"nll|<tag>"` or `"logprob|<tag>"` and `"count|<tag>"`, tag `"clean"` or
    `"g|metric|mode|fraction"`): the mean over the fractions of the change of the mean NLL
    (on tasks: the drop of the mean answer log-probability), as
    `cw_lens.analyses.faithfulness.FaithfulnessResult.aopc`."""
    column = {n: i for i, n in enumerate(names)}
    value = "logprob" if task else "nll"

    def mean(tag: str) -> Tensor:
        return ratio(sums[:, column[f"{value}|{tag}"]], sums[:, column[f"count|{tag}"]])

    clean = mean("clean")
    curves: dict[tuple[str, str, str], list[Tensor]] = {}
    for g, m, mode, f in configs:
        delta = mean("|".join(map(str, (g, m, mode, f)))) - clean
        curves.setdefault((g, mode, m), []).append(-delta if task else delta)
    return {key: torch.stack(parts).mean(0) for key, parts in curves.items()}


def faithfulness_numbers(
    aopc: dict[tuple[str, str, str], Tensor], metrics: tuple[str, ...]
) -> dict[str, Tensor]:
    """`faithfulness_order`'s numbers from AOPC replicates, as
    `cw_lens.reproduction.faithfulness_claims.faithfulness_claim` reads them (pairs granularity)."""
    comp = {m: aopc[("pairs", "comprehensiveness", m)] for m in metrics}
    suff = {m: aopc[("pairs", "sufficiency", m)] for m in metrics}
    out = {
        f"comprehensiveness_{b}_minus_{a}": comp[b] - comp[a]
        for a, b in itertools.pairwise(metrics)
    }
    others = torch.stack([suff[m] for m in metrics if m != "contribution"]).amin(0)
    out["sufficiency_lowest_other_minus_contribution"] = others - suff["contribution"]
    return out


# --------------------------------------------------------------------------- sink ablation


def ablation_numbers(
    heads: Float[Tensor, "R statistic layer head"],
    nll: Float[Tensor, "R 4"],
    planned: Tensor,
    low_norm_quantile: float,
) -> dict[str, Tensor]:
    """`sink_ablation_cone`'s numbers from resampled per-head sums (`cone_before, count_before,
    cone_after, count_after, rel_norm`) of the patched heads and NLL sums (clean nll, count,
    patched nll, count), as `sink_claims.sink_ablation_claims` does: the low-norm
    heads (relative output norm at or below its `low_norm_quantile`, re-picked per resample)
    against the others."""
    cone_b, n_b, cone_a, n_a, rel = (heads[:, i][:, planned] for i in range(5))  # [R, heads]
    rel = rel / n_b.clamp_min(1)
    before, after = cone_b / n_b.clamp_min(1), cone_a / n_a.clamp_min(1)
    cut = torch.quantile(rel, low_norm_quantile, dim=-1, keepdim=True)
    low = rel <= cut
    rise = after - before
    clean_ppl = torch.exp(nll[:, 0] / nll[:, 1])
    patched_ppl = torch.exp(nll[:, 2] / nll[:, 3])
    return {
        "cone_rise_low_norm_minus_other": masked_mean(rise, low) - masked_mean(rise, ~low),
        "delta_ppl": patched_ppl - clean_ppl,
    }


# --------------------------------------------------------------------------- pruning


def pruning_numbers(
    nll: dict[Any, Float[Tensor, "R 2"]],
    levels: tuple[float, ...],
    draw_weights: Float[Tensor, "R draw"] | None = None,
) -> dict[str, Tensor]:
    """`pruning_signal`'s numbers, ΔPPL(random, mean of draws) - ΔPPL(taxonomy) per level,
    from resampled (NLL sum, count) per `(order, draw, level)` and `"clean"`. The mean over
    the random draws counts draw `k` `draw_weights[r, k]` times in row `r`
    (`cw_lens.reproduction.bootstrap.Bootstrap.draw_weights`: the draws resampled with the
    documents); `None` = each once."""

    def ppl(t: Tensor) -> Tensor:
        return torch.exp(t[:, 0] / t[:, 1])

    clean = ppl(nll["clean"])
    out = {}
    for level in levels:
        tax = [v for k, v in nll.items() if k != "clean" and k[0] == "taxonomy" and k[2] == level]
        keys = sorted(k for k in nll if k != "clean" and k[0] == "random" and k[2] == level)
        if tax and keys:
            delta = torch.stack([ppl(nll[k]) - clean for k in keys], -1)  # [R, draw]
            w = torch.ones_like(delta) if draw_weights is None else draw_weights
            random_mean = (delta * w).sum(-1) / w.sum(-1)
            out[f"random_minus_taxonomy_delta_ppl_at_{level}"] = random_mean - (ppl(tax[0]) - clean)
    return out
