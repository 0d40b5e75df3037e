r"""Document-level bootstrap intervals for the claims' headline numbers (docs/methods.md#claims).

A claim's number is a function of sums over documents (sink-head attention, per-head counts,
NLL sums, ...). Resampling documents with replacement `R` times gives `R` replicates of each
sum at once as a matrix product:

    W[r, d] = how often document d is drawn in resample r     (multinomial(D, 1/D) counts)
    sums_r  = W @ X                                           X[d, ...]: document d's numbers

and the number is recomputed for all rows with tensor operations. `W` has `R + 1 + D` rows:
the `R` resamples, then the corpus itself (every document once: the point value), then the
`D` leave-one-out corpora (the jackknife, which BCa reads). `Bootstrap.interval` takes
the numbers of all rows.

Interval methods (`method`), for a level `1 - a` (`a = 0.05`) and the `R` replicates
`t*` of a number `t` measured on `D` documents:

- `"expanded"` (the default; Hesterberg's expanded percentile interval): the percentile
  interval at the widened tail `a' / 2 = Phi(sqrt(D / (D - 1)) * t_{a/2, D-1})`
  (`Phi` the normal CDF, `t_{q, k}` Student's t quantile): the `a'/2` and `1 - a'/2`
  quantiles of `t*`. It corrects the percentile interval's narrowness at small `D` (the
  bootstrap's spread is that of a `D`-document sample's plug-in, too small by about
  `sqrt((D - 1) / D)`, and the normal quantile too small against the t quantile). At 8
  documents the 95% interval reads the 0.57% and 99.43% quantiles.
- `"percentile"`: the `a/2` and `1 - a/2` quantiles of `t*`.
- `"bca"` (Efron's bias-corrected and accelerated interval, as `scipy.stats.bootstrap`):
  `z0 = Phi^-1(#{t* < t} / R)`; the acceleration `acc = sum (m - t_(i))^3 /
  (6 (sum (m - t_(i))^2)^(3/2))` from the leave-one-out values `t_(i)` (`m` their mean);
  the quantiles `Phi(z0 + (z0 + z_q) / (1 - acc (z0 + z_q)))` for `z_q = Phi^-1(a/2)`
  and `Phi^-1(1 - a/2)`.
- `"basic"` (the reverse percentile interval, Davison & Hinkley's "basic" interval) at the
  expanded tail: `[2 t - q_{1 - a'/2}, 2 t - q_{a'/2}]` (`q` the quantiles of `t*`). It
  reads `t* - t` as the distribution of `t - truth`, so a bias of the plug-in (`t*` above
  `t` on average) moves the interval the other way.
- `"bias_corrected"`: the expanded percentile interval shifted by twice the bootstrap's bias
  estimate `b = mean(t*) - t`: `[q_{a'/2} - 2 b, q_{1 - a'/2} - 2 b]`. When `t` sits
  `b` above the truth and `t*` another `b` above `t` (a ratio of sums or a geometric
  mean over heads on few documents), the percentile interval is centred `2 b` too high and
  widening does not help; this centres it on `t - b`, keeping its shape.

Which method a number gets (`needs_bias_correction`, the one rule): `Bootstrap.biased_method`
(`"bias_corrected"`) when its plug-in is known to be biased on few documents
(`is_biased_plugin`: `sink_lowers_fn`'s geometric means), `Bootstrap.method` (`"expanded"`)
otherwise. Every number's bootstrap bias is measured and reported (`bias_to_se`:
`|mean(t*) - t| / sd(t*)`, in `summary.json` and, above `BIAS_SE_LIMIT`, flagged in the
report), but a large bias/SE in one run does not switch the method (docs/coverage.md gives
the study behind this rule). A bias/SE that cannot be computed (no
point value, fewer than two defined replicates, or replicates that are all equal) is NaN.
`Bootstrap.pair` returns the interval with its bias/SE and the method used, which each check
writes into `summary.json`.

Quantiles interpolate linearly (as
`numpy.quantile`). Replicates where the number is undefined (e.g. a resample without any sink
head) are left out; when more of them are undefined than the tail the interval reads, the
interval is `(nan, nan)`.

Seeded: the resamples are drawn from `torch.Generator().manual_seed(seed)`, so two runs with
the same seed give identical intervals. No model here, no extra forward pass: the per-document
numbers come from the analyses' per-document records (each document's own sums, kept by
`cw_lens.core.accumulators.StackedSums` with `n_documents`).

Example:

    import torch
    from cw_lens.reproduction.bootstrap import Bootstrap
    boot = Bootstrap(resamples=2000, seed=0)
    x = torch.randn(8, 2).double()                 # per-document sums and counts
    reps = boot.resample(x)                        # [2000 + 1 + 8, 2]
    boot.interval(reps[:, 0] / reps[:, 1])         # 95% interval of the ratio of sums
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from jaxtyping import Bool, Float
from scipy import stats
from torch import Tensor

from cw_lens.core.devices import to_tensor
from cw_lens.core.errors import InputError

# One concept: the resampling of documents and the rule that turns its replicates into an
# interval (the methods, their choice per number, the bias ratio) are read together.

METHODS = ("expanded", "percentile", "bca", "basic", "bias_corrected")
METHOD_TEXT = {
    "expanded": "expanded percentile (Hesterberg)",
    "percentile": "percentile",
    "bca": "BCa",
    "basic": "basic (reverse percentile) at the expanded tail",
    "bias_corrected": "expanded percentile shifted by twice the bootstrap bias",
}
BIAS_SE_LIMIT = 0.25  # |bootstrap bias| / bootstrap SE above which the report flags a number


def is_biased_plugin(number: str | None) -> bool:
    """Whether a claim number's plug-in estimate is known to be biased on few documents.

    These are the geometric means of per-head ratios of sums (`sink_lowers_fn`), which sit
    above the truth by about as much again as their bootstrap replicates sit above them
    (docs/coverage.md); their interval is always `Bootstrap.biased_method`'s.

    Args:
        number: A claim number's name (None: an unnamed number, not known to be biased).

    Returns:
        True for the `geomean_head_ratio_n*` numbers.

    Examples:
        >>> is_biased_plugin("geomean_head_ratio_n2"), is_biased_plugin("delta_ppl")
        (True, False)
    """
    return number is not None and number.startswith("geomean_head_ratio_n")


def bias_to_se(value: float, replicates: Any) -> float:
    """The bootstrap's bias estimate of a number in units of its standard error.

    Args:
        value: The number's point value `t`.
        replicates: Its bootstrap replicates `t*` (array or tensor; undefined ones, NaN,
            left out).

    Returns:
        `|mean(t*) - t| / sd(t*)` (`sd` with `n - 1`); NaN without replicates (fewer than
        two defined), point or spread.

    Examples:
        >>> import numpy as np
        >>> round(bias_to_se(1.0, np.array([1.1, 1.3, 1.2, 1.4])), 2)
        1.94
    """
    if replicates is None or math.isnan(value):
        return math.nan
    if isinstance(replicates, Tensor):
        replicates = replicates.detach().cpu().double().numpy()
    x = np.asarray(replicates, np.float64).reshape(-1)
    x = x[~np.isnan(x)]
    if len(x) < 2 or float(x.std()) == 0.0:
        return math.nan
    return abs(float(x.mean()) - value) / float(x.std(ddof=1))


def needs_bias_correction(number: str | None, *, biased: bool = False) -> bool:
    """Whether a number's interval is the bias-corrected one (`Bootstrap.biased_method`).

    The one rule every claim interval follows (docs/methods.md#intervals): the plug-ins known
    to be biased on few documents, and only they. A run's own bias/SE does not decide it
    (`bias_flagged` only reports it): on the population of windows, correcting the numbers
    whose bias/SE exceeded `BIAS_SE_LIMIT` lowered their coverage (docs/coverage.md).

    Args:
        number: The number's name (None: unnamed).
        biased: The caller knows the plug-in to be biased (as `is_biased_plugin`).

    Returns:
        True when the plug-in is known to be biased.

    Examples:
        >>> needs_bias_correction("geomean_head_ratio_n2"), needs_bias_correction("delta_ppl")
        (True, False)
        >>> needs_bias_correction(None, biased=True)
        True
    """
    return biased or is_biased_plugin(number)


def bias_flagged(bias_se: float | None) -> bool:
    """Whether a number's bootstrap bias is large enough for the report to flag it.

    Args:
        bias_se: Its bootstrap `|bias| / SE` (`bias_to_se`; None or NaN when not
            computable, which is not flagged).

    Returns:
        True when `|bias_se|` exceeds `BIAS_SE_LIMIT`.

    Examples:
        >>> bias_flagged(0.3), bias_flagged(0.25), bias_flagged(float("nan"))
        (True, False, False)
    """
    return bias_se is not None and not math.isnan(bias_se) and abs(bias_se) > BIAS_SE_LIMIT


@dataclass(frozen=True)
class Bootstrap:
    """Settings of a seeded document-level bootstrap: `resamples`, `level`, `seed`, the
    interval `method` (`METHODS`), the `biased_method` of the numbers `needs_bias_correction`
    picks (set it to `method` for one method for all) and, optionally, `documents`: the rows
    of the records to use (with repeats; the coverage study draws sub-corpora of a pool this
    way), and `draws`: likewise the random-control draws to use (`draw_weights`). `None` =
    every document (draw) once."""

    resamples: int = 2000
    level: float = 0.95
    seed: int = 0
    method: str = "expanded"
    biased_method: str = "bias_corrected"  # for the numbers needs_bias_correction picks
    documents: Sequence[int] | None = None
    draws: Sequence[int] | None = None

    def __post_init__(self) -> None:
        if self.resamples < 1:
            raise InputError(f"resamples must be at least 1, got {self.resamples}.")
        if not 0 < self.level < 1:
            raise InputError(f"level must be in (0, 1), got {self.level}.")
        for method in (self.method, self.biased_method):
            if method not in METHODS:
                raise InputError(f"Unknown interval method {method!r}; use one of {METHODS}.")
        if self.documents is not None and len(self.documents) < 2:
            raise InputError("documents: the bootstrap needs at least two documents.")
        if self.draws is not None and len(self.draws) < 1:
            raise InputError("draws: give at least one random-control draw (or None: all).")

    def _drawn(self, n_documents: int) -> Tensor:
        """The record rows the corpus is made of (`documents`, or all of them)."""
        if n_documents < 1:
            raise InputError("The bootstrap needs at least one document.")
        if self.documents is None:
            return torch.arange(n_documents, device="cpu")
        drawn = torch.as_tensor(list(self.documents), dtype=torch.long, device="cpu")
        if drawn.min() < 0 or drawn.max() >= n_documents:
            raise InputError(
                f"documents index rows 0..{n_documents - 1} of the record; got "
                f"{int(drawn.min())}..{int(drawn.max())}."
            )
        return drawn

    def indices(self, n_documents: int) -> Tensor:
        """The record rows drawn by each resample, with replacement, from the seeded generator.

        Args:
            n_documents: The rows of the per-document record.

        Returns:
            `[resamples, D]` row indices (`D` the corpus's documents: `documents`, or all).

        Examples:
            ```python
            import torch
            from cw_lens.reproduction import Bootstrap

            boot = Bootstrap(resamples=200, seed=0)
            boot.indices(8).shape  # [200, 8]
            ```
        """
        drawn = self._drawn(n_documents)
        gen = torch.Generator().manual_seed(int(self.seed))
        return drawn[
            torch.randint(len(drawn), (self.resamples, len(drawn)), generator=gen, device="cpu")
        ]

    def weights(self, n_documents: int) -> Float[Tensor, "row document"]:
        """How often each document counts in each row.

        Args:
            n_documents: The rows of the per-document record.

        Returns:
            `[resamples + 1 + D, n_documents]` float64: the `resamples` resamples (rows sum to
            `D`), the corpus (every drawn document once), then the `D` leave-one-out corpora.

        Examples:
            ```python
            import torch
            from cw_lens.reproduction import Bootstrap

            boot = Bootstrap(resamples=200, seed=0)
            boot.weights(8).shape  # [200 + 1 + 8, 8]
            ```
        """
        drawn = self._drawn(n_documents)
        idx = self.indices(n_documents)
        w = torch.zeros(self.resamples, n_documents, dtype=torch.float64, device="cpu")
        w.scatter_add_(1, idx, torch.ones_like(idx, dtype=torch.float64))
        corpus = torch.zeros(n_documents, dtype=torch.float64, device="cpu").index_add_(
            0, drawn, torch.ones(len(drawn), dtype=torch.float64, device="cpu")
        )
        jack = corpus.repeat(len(drawn), 1)
        jack[torch.arange(len(drawn), device=drawn.device), drawn] -= 1
        return torch.cat([w, corpus[None], jack])

    def draw_weights(self, n_documents: int, n_draws: int) -> Float[Tensor, "row draw"]:
        """How often each random-control draw counts in each row of `weights`.

        Args:
            n_documents: The rows of the per-document record.
            n_draws: The random-control draws.

        Returns:
            `[rows, n_draws]` float64: resampled with replacement in the `resamples` rows
            (jointly with the documents; from the generator seeded `seed + 2**32`), every draw
            once in the corpus and leave-one-out rows (the `draws` given, with their repeats,
            where set).

        Examples:
            ```python
            import torch
            from cw_lens.reproduction import Bootstrap

            boot = Bootstrap(resamples=200, seed=0)
            boot.draw_weights(8, 3).shape  # [200 + 1 + 8, 3]
            ```
        """
        if n_draws < 1:
            raise InputError("draw_weights needs at least one draw.")
        drawn = torch.arange(n_draws, device="cpu")
        if self.draws is not None:
            drawn = torch.as_tensor(list(self.draws), dtype=torch.long, device="cpu")
            if drawn.min() < 0 or drawn.max() >= n_draws:
                raise InputError(f"draws index 0..{n_draws - 1}; got {drawn.tolist()}.")
        n_rows = self.resamples + 1 + len(self._drawn(n_documents))
        gen = torch.Generator().manual_seed(int(self.seed) + 2**32)
        idx = drawn[
            torch.randint(len(drawn), (self.resamples, len(drawn)), generator=gen, device="cpu")
        ]
        once = torch.zeros(n_draws, dtype=torch.float64, device="cpu").index_add_(
            0, drawn, torch.ones(len(drawn), dtype=torch.float64, device="cpu")
        )
        w = once.repeat(n_rows, 1)
        w[: self.resamples] = 0
        w[: self.resamples].scatter_add_(1, idx, torch.ones_like(idx, dtype=torch.float64))
        return w

    def resample(self, table: Float[Tensor, "document ..."]) -> Float[Tensor, "row ..."]:
        """The sums over documents of `table` in every row of `weights`: `W @ table`.

        Args:
            table: Each document's sums `[document, ...]`.

        Returns:
            `[rows, ...]` float64 sums, one per row of `weights`.

        Examples:
            ```python
            import torch
            from cw_lens.reproduction import Bootstrap

            boot = Bootstrap(resamples=200, seed=0)
            sums = boot.resample(torch.rand(8, 2))   # per-document sums and counts
            ratios = sums[:, 0] / sums[:, 1]          # the ratio of sums in every row
            ```
        """
        table = to_tensor(table).double()
        return _weighted_sums(self.weights(table.shape[0]), table)

    def resample_each(self, tables: dict[Any, Tensor]) -> dict[Any, Tensor]:
        """`resample` of every table of `tables`, drawing the weights once.

        Args:
            tables: Per-document tables of the same documents.

        Returns:
            Each table's sums in every row of `weights`, under the same keys.

        Raises:
            InputError: The tables hold different numbers of documents.

        Examples:
            ```python
            import torch
            from cw_lens.reproduction import Bootstrap

            boot = Bootstrap(resamples=200, seed=0)
            sums = boot.resample_each({"a": torch.rand(8, 2), "b": torch.rand(8)})
            ```
        """
        if not tables:
            return {}
        w = self.weights(next(iter(tables.values())).shape[0])
        out = {}
        for key, table in tables.items():
            t = to_tensor(table).double()
            if t.shape[0] != w.shape[1]:
                raise InputError(
                    f"resample_each: table {key!r} has {t.shape[0]} documents, the first "
                    f"{w.shape[1]}; every table must hold the same documents."
                )
            out[key] = _weighted_sums(w, t)
        return out

    def judged(
        self, replicates: Float[Tensor, "row ..."], biased: bool = False, number: str | None = None
    ) -> tuple[Float[Tensor, "2 ..."], Float[Tensor, "..."], list[str]]:
        """The numbers' intervals by the method `needs_bias_correction` picks for their name.

        Args:
            replicates: The numbers' values in every row of `weights` (NaN where undefined).
            biased: Their plug-in is known to be biased (`biased_method` for all of them).
            number: Their name (one name for all: e.g. one number per layer).

        Returns:
            The intervals `[2, ...]` (NaN where more replicates are NaN than the tail the
            method reads), each number's bootstrap `|bias| / SE` `[...]` (NaN where not
            computable) and the method each read (flat, in the numbers' order).

        Examples:
            ```python
            import torch
            from cw_lens.reproduction import Bootstrap

            boot = Bootstrap(resamples=200, seed=0)
            sums = boot.resample(torch.rand(8, 2))
            bounds, bias_to_se, methods = boot.judged(sums[:, 0] / sums[:, 1])
            ```
        """
        x = to_tensor(replicates).double()
        has_point = len(x) > self.resamples
        # one name, one method: every number of the call gets the same one; the interval
        # first, which refuses replicates without their corpus and leave-one-out rows
        corrected = has_point and needs_bias_correction(number, biased=biased)
        method = self.biased_method if corrected else self.method
        bounds = interval(x, self.resamples, self.level, method)
        boot = x[: self.resamples].reshape(self.resamples, -1).cpu()
        point = x[self.resamples].reshape(-1).tolist() if has_point else []
        ratios = [bias_to_se(p, boot[:, i]) for i, p in enumerate(point)]
        ratio = torch.tensor(ratios, dtype=torch.float64, device=x.device).reshape(x.shape[1:])
        return bounds, ratio, [method] * len(ratios)

    def interval(
        self, replicates: Float[Tensor, "row ..."], biased: bool = False, number: str | None = None
    ) -> Float[Tensor, "2 ..."]:
        """The interval of each number, by `method` or, where `needs_bias_correction` says
        so, `biased_method`.

        Args:
            replicates: The numbers' values in every row of `weights` (NaN where undefined:
                left out).
            biased: Their plug-in is known to be biased (`biased_method` for all of them).
            number: Their name (one name for all).

        Returns:
            `[low, high]` per number (`[2, ...]`); NaN where more replicates are NaN than the
            tail the method reads.

        Examples:
            ```python
            import torch
            from cw_lens.reproduction import Bootstrap

            boot = Bootstrap(resamples=200, seed=0)
            sums = boot.resample(torch.rand(8, 2))
            low, high = boot.interval(sums[:, 0] / sums[:, 1]).tolist()
            ```
        """
        return self.judged(replicates, biased, number)[0]

    def pair(self, replicates: Tensor, biased: bool = False, number: str | None = None) -> Interval:
        """`interval` of one number, as two floats that remember where they came from.

        Args:
            replicates: The number's values in every row of `weights`.
            biased: Its plug-in is known to be biased (`biased_method` whatever its bias).
            number: Its name (`is_biased_plugin` reads it).

        Returns:
            An `Interval` `(low, high)` keeping the `[resamples]` bootstrap replicates (not
            the corpus and leave-one-out rows), the number's bootstrap `bias_to_se` and the
            `method` used.

        Examples:
            ```python
            import torch
            from cw_lens.reproduction import Bootstrap

            boot = Bootstrap(resamples=200, seed=0)
            sums = boot.resample(torch.rand(8, 2))
            interval = boot.pair(sums[:, 0] / sums[:, 1], number="ratio")
            interval.method, tuple(interval)
            ```
        """
        bounds, ratio, [method] = self.judged(replicates, biased, number)
        low, high = bounds.tolist()
        kept = to_tensor(replicates).detach()[: self.resamples]
        return Interval(low, high, kept, float(ratio), method)

    def to_dict(self) -> dict[str, Any]:
        """The `bootstrap` block of `summary.json`.

        Returns:
            The resamples, level, seed, unit and interval method, JSON-ready.

        Examples:
            ```python
            import torch
            from cw_lens.reproduction import Bootstrap

            boot = Bootstrap(resamples=200, seed=0)
            boot.to_dict()["resamples"]  # 200
            ```
        """
        return {
            "resamples": self.resamples,
            "level": self.level,
            "seed": self.seed,
            "unit": "document",
            "method": (
                f"{METHOD_TEXT[self.method]}, {METHOD_TEXT[self.biased_method]} for the "
                "numbers whose plug-in is biased on few documents (sink_lowers_fn's geometric "
                "means); documents resampled with replacement; each number's bootstrap "
                f"|bias| / SE is recorded and flagged above {BIAS_SE_LIMIT:g}"
            ),
        }


def _weighted_sums(
    w: Float[Tensor, "row document"], table: Float[Tensor, "document ..."]
) -> Float[Tensor, "row ..."]:
    """`w @ table` over the first axis of `table` (float64 both)."""
    return (w @ table.reshape(table.shape[0], -1)).reshape(len(w), *table.shape[1:])


class Interval(tuple):
    """`(low, high)` as `Bootstrap.pair` returns it — a plain pair to every reader —
    carrying `replicates`, the number's bootstrap replicates it was read from, so that a run
    can keep them for tests of differences between runs (`cw_lens.replicates`), its
    bootstrap `bias_to_se` (NaN when not computable) and the interval `method` used (None
    when not known)."""

    replicates: Tensor | None
    bias_to_se: float
    method: str | None

    def __new__(
        cls,
        low: float,
        high: float,
        replicates: Tensor | None = None,
        bias_to_se: float = math.nan,
        method: str | None = None,
    ) -> Interval:
        interval = super().__new__(cls, (low, high))
        interval.replicates = replicates
        interval.bias_to_se = bias_to_se
        interval.method = method
        return interval


def expanded_tail(level: float, n_documents: int) -> float:
    """The expanded percentile interval's tail share `Phi(sqrt(D / (D - 1)) t_{a/2, D-1})`
    (`a = 1 - level`, `D` documents; `scipy.stats` distributions); NaN below 2."""
    if n_documents < 2:
        return math.nan
    widen = math.sqrt(n_documents / (n_documents - 1))
    return float(stats.norm.cdf(widen * stats.t.ppf((1 - level) / 2, n_documents - 1)))


def bca_levels(
    boot: Float[Tensor, "R ..."],
    point: Float[Tensor, "..."],
    jack: Float[Tensor, "D ..."],
    level: float,
) -> tuple[Tensor, Tensor]:
    """BCa's lower and upper quantile levels per number (the formulas of the module docstring;
    NaN replicates and leave-one-out values left out; no acceleration when every leave-one-out
    value is the same)."""
    ok = ~boot.isnan()
    below = ((boot < point) & ok).sum(0) / ok.sum(0).clamp_min(1)
    z0 = torch.special.ndtri(below)
    valid = ~jack.isnan()
    n = valid.sum(0).clamp_min(1)
    mean = torch.where(valid, jack, 0.0).sum(0) / n
    dev = torch.where(valid, mean - jack, 0.0)
    num, den = (dev**3).sum(0), (dev**2).sum(0)
    acc = torch.where(den > 0, num / (6 * den.clamp_min(1e-300) ** 1.5), 0.0)
    tail = (1 - level) / 2
    out = []
    for q in (tail, 1 - tail):
        zq = z0 + stats.norm.ppf(q)
        out.append(torch.special.ndtr(z0 + zq / (1 - acc * zq)))
    return out[0], out[1]


def quantiles(x: Float[Tensor, "R ..."], low: Tensor, high: Tensor) -> Float[Tensor, "2 ..."]:
    """The `low` and `high` quantiles (per number; linear interpolation, as
    `numpy.quantile`) of `x` over its first axis, NaN left out."""
    ordered = x.sort(0).values  # NaN last
    n = (~x.isnan()).sum(0)
    out = []
    for q in (low, high):
        at = torch.as_tensor(q, dtype=torch.float64, device=n.device)
        pos = at.expand(n.shape) * (n - 1).clamp_min(0)
        lo = pos.floor().long().clamp(0, max(len(x) - 1, 0))
        hi = pos.ceil().long().clamp(0, max(len(x) - 1, 0))
        a, b = ordered.gather(0, lo[None])[0], ordered.gather(0, hi[None])[0]
        out.append(a + (b - a) * (pos - lo))
    return torch.stack(out)


def interval(
    replicates: Float[Tensor, "row ..."], resamples: int, level: float, method: str
) -> Float[Tensor, "2 ..."]:
    """The 95% (`level`) interval of a number by `method` from its values in the rows of
    `Bootstrap.weights` (`resamples` resamples, the corpus, the leave-one-out
    corpora)."""
    x = to_tensor(replicates).double()
    if x.shape[0] < resamples + 2:
        raise InputError(
            f"interval() needs a number's values in every row of Bootstrap.weights(): "
            f"{resamples} resamples, the corpus, then one row per document; got {x.shape[0]} "
            "rows. Compute the number on Bootstrap.resample(...) of the whole record."
        )
    boot, point, jack = x[:resamples], x[resamples], x[resamples + 1 :]
    if len(jack) < 2:  # one document: resampling it says nothing about its spread
        return torch.full((2, *point.shape), math.nan, dtype=torch.float64, device=x.device)
    if method == "bca":
        low, high = bca_levels(boot, point, jack, level)
    else:  # expanded, basic and bias_corrected read the expanded tail
        tail = (1 - level) / 2 if method == "percentile" else expanded_tail(level, len(jack))
        low = torch.full(point.shape, tail, dtype=torch.float64, device=point.device)
        high = 1 - low
    out = quantiles(boot, low, high)
    if method == "basic":
        out = (2 * point - out).flip(0)
    elif method == "bias_corrected":
        rows_last = boot.movedim(0, -1)
        out = out - 2 * (masked_mean(rows_last, ~rows_last.isnan()) - point)
    undefined = boot.isnan().double().mean(0)
    bad = (undefined > torch.minimum(low, 1 - high) + 1e-12) | low.isnan() | high.isnan()
    bad = bad | ((low <= 0) | (high >= 1)) & (method == "bca")  # BCa: point outside t*
    return torch.where(bad, torch.tensor(math.nan, dtype=torch.float64, device=out.device), out)


def require_record(record: Any, call: str) -> Any:
    """`record` (an analysis's per-document record), or a clear error naming the call that
    keeps one."""
    if record is None:
        raise InputError(
            f"Intervals need each document's own sums: run {call}(..., per_document=True)."
        )
    return record


def masked_median(
    values: Float[Tensor, "... n"], mask: Bool[Tensor, "... n"]
) -> Float[Tensor, "..."]:
    """Median of `values` where `mask` (and the value is not NaN) along the last axis, the
    mean of the two middle values for an even count (as pandas); NaN where none is counted."""
    keep = mask & ~values.isnan()
    x = torch.where(keep, values.double(), math.inf).sort(-1).values
    n = keep.sum(-1, keepdim=True)
    lo = x.gather(-1, ((n - 1) // 2).clamp_min(0))
    hi = x.gather(-1, (n // 2).clamp_max(values.shape[-1] - 1))
    med = ((lo + hi) / 2)[..., 0]
    return torch.where(
        n[..., 0] > 0, med, torch.tensor(math.nan, dtype=torch.float64, device=med.device)
    )


def masked_mean(
    values: Float[Tensor, "... n"], mask: Bool[Tensor, "... n"]
) -> Float[Tensor, "..."]:
    """Mean of `values` where `mask` along the last axis (NaN where none is counted)."""
    v = values.double()
    n = mask.sum(-1)
    total = torch.where(mask, v, 0.0).sum(-1)
    return torch.where(
        n > 0,
        total / n.clamp_min(1),
        torch.tensor(math.nan, dtype=torch.float64, device=total.device),
    )


def ratio(num: Tensor, den: Tensor) -> Tensor:
    """`num / den`, NaN where `den` is 0."""
    return torch.where(den != 0, num / torch.where(den != 0, den, 1.0), math.nan)
