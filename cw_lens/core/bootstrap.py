r"""Document-level bootstrap intervals for the claims' headline numbers (docs/methods.md#claims).

A claim's number is a function of sums over documents (sink-head attention, per-head counts,
NLL sums, ...). Resampling documents with replacement ``R`` times gives ``R`` replicates of each
sum at once as a matrix product::

    W[r, d] = how often document d is drawn in resample r     (multinomial(D, 1/D) counts)
    sums_r  = W @ X                                           X[d, ...]: document d's numbers

and the number is recomputed for all ``R`` replicates with tensor operations. The interval is
the percentile interval: the ``(1 - level) / 2`` and ``(1 + level) / 2`` quantiles of the
replicates (linear interpolation, as ``numpy.quantile``). Replicates where the number is
undefined (e.g. a resample without any sink head) are left out; when more than
``(1 - level) / 2`` of them are undefined the interval is ``(nan, nan)``.

Seeded: the weights are drawn from ``torch.Generator().manual_seed(seed)`` for a corpus of
``D`` documents, so two runs with the same seed give identical intervals. No model here, no
extra forward pass: the per-document numbers come from the analyses'
:class:`cw_lens.core.accumulate.PerDocument` records.

Example::

    import torch
    from cw_lens.core.bootstrap import Bootstrap
    boot = Bootstrap(resamples=1000, seed=0)
    x = torch.randn(8, 2).double()                 # per-document sums and counts
    reps = boot.resample(x)                        # [1000, 2]
    boot.interval(reps[:, 0] / reps[:, 1])         # 95% interval of the ratio of sums
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from jaxtyping import Bool, Float
from torch import Tensor

from cw_lens.core.errors import InputError

METHOD = "percentile; documents resampled with replacement (multinomial weights)"


@dataclass(frozen=True)
class Bootstrap:
    """Settings of a seeded document-level bootstrap: ``resamples``, ``level`` and ``seed``."""

    resamples: int = 2000
    level: float = 0.95
    seed: int = 0

    def __post_init__(self) -> None:
        if self.resamples < 1:
            raise InputError(f"resamples must be at least 1, got {self.resamples}.")
        if not 0 < self.level < 1:
            raise InputError(f"level must be in (0, 1), got {self.level}.")

    def indices(self, n_documents: int) -> Tensor:
        """``[resamples, n_documents]``: the documents drawn by each resample (with
        replacement), from the seeded generator."""
        if n_documents < 1:
            raise InputError("The bootstrap needs at least one document.")
        gen = torch.Generator().manual_seed(int(self.seed))
        return torch.randint(n_documents, (self.resamples, n_documents), generator=gen)

    def weights(self, n_documents: int) -> Float[Tensor, "resample document"]:
        """How often each document is drawn in each resample (float64 counts, rows sum to
        ``n_documents``)."""
        idx = self.indices(n_documents)
        w = torch.zeros(self.resamples, n_documents, dtype=torch.float64)
        return w.scatter_add_(1, idx, torch.ones_like(idx, dtype=torch.float64))

    def resample(self, table: Float[Tensor, "document ..."]) -> Float[Tensor, "resample ..."]:
        """Replicates of the sums over documents of ``table``: ``W @ table`` (float64)."""
        table = torch.as_tensor(table).double()
        w = self.weights(table.shape[0])
        return (w @ table.reshape(table.shape[0], -1)).reshape(self.resamples, *table.shape[1:])

    def interval(self, replicates: Float[Tensor, "resample ..."]) -> Float[Tensor, "2 ..."]:
        """Percentile interval ``[low, high]`` over the resample axis (NaN replicates left out;
        NaN where more than ``(1 - level) / 2`` of them are NaN)."""
        x = torch.as_tensor(replicates).double()
        tail = (1 - self.level) / 2
        q = torch.tensor([tail, 1 - tail], dtype=torch.float64)
        out = torch.nanquantile(x, q, dim=0) if x.numel() else torch.full((2,), math.nan)
        undefined = x.isnan().double().mean(0)
        too_many = undefined > tail + 1e-12
        return torch.where(too_many, torch.tensor(math.nan, dtype=torch.float64), out)

    def pair(self, replicates: Tensor) -> Interval:
        """:meth:`interval` of one number's ``[resamples]`` replicates, as two floats (an
        :class:`Interval`, which keeps the replicates)."""
        low, high = self.interval(replicates).tolist()
        return Interval(low, high, torch.as_tensor(replicates).detach())

    def to_dict(self) -> dict[str, Any]:
        """The ``bootstrap`` block of ``summary.json``."""
        return {
            "resamples": self.resamples,
            "level": self.level,
            "seed": self.seed,
            "unit": "document",
            "method": METHOD,
        }


class Interval(tuple):
    """``(low, high)`` as :meth:`Bootstrap.pair` returns it — a plain pair to every reader —
    carrying ``replicates``, the number's bootstrap replicates it was read from, so that a run
    can keep them for tests of differences between runs (:mod:`cw_lens.replicates`)."""

    replicates: Tensor | None

    def __new__(cls, low: float, high: float, replicates: Tensor | None = None) -> Interval:
        interval = super().__new__(cls, (low, high))
        interval.replicates = replicates
        return interval


def require_record(record: Any, call: str) -> Any:
    """``record`` (an analysis's per-document record), or a clear error naming the call that
    keeps one."""
    if record is None:
        raise InputError(
            f"Intervals need each document's own sums: run {call}(..., per_document=True)."
        )
    return record


def masked_median(
    values: Float[Tensor, "... n"], mask: Bool[Tensor, "... n"]
) -> Float[Tensor, "..."]:
    """Median of ``values`` where ``mask`` (and the value is not NaN) along the last axis, the
    mean of the two middle values for an even count (as pandas); NaN where none is counted."""
    keep = mask & ~values.isnan()
    x = torch.where(keep, values.double(), math.inf).sort(-1).values
    n = keep.sum(-1, keepdim=True)
    lo = x.gather(-1, ((n - 1) // 2).clamp_min(0))
    hi = x.gather(-1, (n // 2).clamp_max(values.shape[-1] - 1))
    med = ((lo + hi) / 2)[..., 0]
    return torch.where(n[..., 0] > 0, med, torch.tensor(math.nan, dtype=torch.float64))


def masked_mean(
    values: Float[Tensor, "... n"], mask: Bool[Tensor, "... n"]
) -> Float[Tensor, "..."]:
    """Mean of ``values`` where ``mask`` along the last axis (NaN where none is counted)."""
    v = values.double()
    n = mask.sum(-1)
    total = torch.where(mask, v, 0.0).sum(-1)
    return torch.where(n > 0, total / n.clamp_min(1), torch.tensor(math.nan, dtype=torch.float64))


def ratio(num: Tensor, den: Tensor) -> Tensor:
    """``num / den``, NaN where ``den`` is 0."""
    return torch.where(den != 0, num / torch.where(den != 0, den, 1.0), math.nan)
