"""Histograms: integer counts of values over fixed bins, per group, on the values' device.

A `Histogram` counts values over `n_bins` equal bins on `(lo, hi)` (or bins equal in
`asinh(v / unit)`, for values without a natural range), plus two edge bins for the values at or
beyond the edges, per group; integer counts are exact in any order, so a histogram merged from
shards or reduced across ranks is the same whatever the batching. Several histograms are binned
in one chain of operations (`bin_indices`) and filled at once (`fill_histograms`; `count_bins`
for bins already found): a corpus accumulator that keeps several histograms pays the binning
once per block, not once per histogram.

Examples:
    >>> import torch
    >>> from cw_lens.core.histograms import Histogram, fill_histograms
    >>> rate, cosine = Histogram((), 0.0, 1.0, 10), Histogram((), -1.0, 1.0, 20)
    >>> fill_histograms([rate, cosine], torch.tensor([[0.05, 0.5, 0.95], [-0.9, 0.0, 0.9]]))
    >>> round(float(rate.quantile(0.5)), 2), round(float(cosine.quantile(0.5)), 2)  # one bin
    (0.55, 0.05)
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Annotated, Any, ClassVar, Literal

import torch
from jaxtyping import Bool, Float, Int, Integer
from torch import Tensor

from cw_lens.core.collectives import process_group
from cw_lens.core.errors import InputError
from cw_lens.core.registry import saveable
from cw_lens.core.schema import Count


@saveable
class Histogram:
    """Counts of values over `n_bins` bins on `(lo, hi)` per group, plus two edge bins:
    values `<= lo` and values `>= hi` (so clamped values are counted exactly).

    `scale="linear"`: equal bins. `scale="asinh"`: bins equal in `asinh(v / unit)`, i.e.
    about `unit`-wide near 0 and of equal *relative* width for `|v| >> unit` — for values
    without a natural range (a quantile of a ratio that can be far from 0) over a very wide
    `(lo, hi)` without clipping them. `counts` is `[*shape, n_bins + 2]` int64 on the values'
    device; NaN values are not counted. A value within rounding of a bin edge may fall in
    either bin on different devices.

    Examples:
        >>> import torch
        >>> hist = Histogram((), 0.0, 1.0, 4)
        >>> hist.add(torch.tensor([0.1, 0.3, 0.35, 2.0, float("nan")]))
        >>> hist.counts.tolist()
        [0, 1, 2, 0, 0, 1]
        >>> round(float(hist.quantile(0.5)), 3)
        0.375

    Args:
        shape: The group axes.
        lo: The lower edge (values at or below it count in the first edge bin).
        hi: The upper edge (values at or above it count in the last edge bin).
        n_bins: Inner bins.
        scale: `"linear"` or `"asinh"`.
        unit: The asinh scale's unit.
        device: Where the counts live.
    """

    stored_fields: ClassVar[dict[str, Any]] = {
        "lo": float,
        "hi": float,
        "n_bins": Annotated[int, Count()],
        "scale": Literal["linear", "asinh"],
        "unit": float,
        "counts": Integer[Tensor, "*shape bin"],
    }

    def __init__(
        self,
        shape: Sequence[int],
        lo: float,
        hi: float,
        n_bins: int,
        *,
        scale: Literal["linear", "asinh"] = "linear",
        unit: float = 1.0,
        device: torch.device | str = "cpu",
    ) -> None:
        if not hi > lo or n_bins < 1:
            raise InputError("Histogram needs hi > lo and at least one bin.")
        if scale not in ("linear", "asinh") or not unit > 0:
            raise InputError("Histogram scale must be 'linear' or 'asinh' (with a unit > 0).")
        self.lo, self.hi, self.n_bins = float(lo), float(hi), int(n_bins)
        self.scale, self.unit = scale, float(unit)
        with torch.inference_mode(False):
            self.counts = torch.zeros((*shape, n_bins + 2), dtype=torch.int64, device=device)

    def _forward(self, v: Tensor) -> Tensor:
        """Value -> the axis on which the bins are equal."""
        return torch.asinh(v / self.unit) if self.scale == "asinh" else v

    def _inverse(self, t: Tensor) -> Tensor:
        return torch.sinh(t) * self.unit if self.scale == "asinh" else t

    def _axis(self) -> tuple[float, float]:
        if self.scale == "asinh":
            return math.asinh(self.lo / self.unit), math.asinh(self.hi / self.unit)
        return self.lo, self.hi

    @property
    def binning(self) -> tuple:
        return (self.lo, self.hi, self.n_bins, self.scale, self.unit)

    @property
    def edges(self) -> Float[Tensor, " edge"]:
        lo, hi = self._axis()
        return self._inverse(
            torch.linspace(lo, hi, self.n_bins + 1, dtype=torch.float64, device="cpu")
        )

    def bin_index(self, values: Tensor) -> Int[Tensor, "..."]:
        """Each value's bin.

        Args:
            values: The values.

        Returns:
            0 for `<= lo`, `n_bins + 1` for `>= hi`, else `1..n_bins` (int64).
        """
        return bin_indices([self], values[None])[0]

    def add(self, values: Tensor, index: int | tuple | None = None) -> None:
        """Count `values` `[*groups, n]` into `counts[index]` (all groups when None).

        Args:
            values: The group axes of `counts[index]` followed by one axis of samples.
            index: The part of the counts to fill, or None for all.
        """
        fill_histograms([self], values[None], index)

    def merge(self, other: Histogram) -> None:
        if other.counts.shape != self.counts.shape or other.binning != self.binning:
            raise InputError("Cannot merge histograms with different bins.")
        self.counts += other.counts.to(self.counts.device)

    def all_reduce(self) -> None:
        """Sum every rank's counts in place (a no-op outside a process group of 2+ ranks)."""
        dist = process_group()
        if dist is not None:
            dist.all_reduce(self.counts)

    def to_host(self) -> Histogram:
        """Move the counts to the CPU, in place.

        Returns:
            This histogram.
        """
        self.counts = self.counts.cpu()
        return self

    def __getstate__(self) -> dict:
        # what a file stores: counts as int32 when they fit (most bins are small), else int64
        counts = self.counts.cpu()
        if counts.numel() and int(counts.max()) <= torch.iinfo(torch.int32).max:
            counts = counts.to(torch.int32)
        return {**self.__dict__, "counts": counts}

    def __setstate__(self, state: dict) -> None:
        counts = state.get("counts")
        if not isinstance(counts, Tensor) or counts.is_floating_point() or counts.is_complex():
            raise InputError("A histogram's counts must be whole numbers; the file is damaged.")
        self.__dict__.update({**state, "counts": counts.to(torch.int64)})

    @property
    def total(self) -> Int[Tensor, "..."]:
        return self.counts.sum(-1)

    def share_at_or_below_lo(self) -> Float[Tensor, "..."]:
        return self.counts[..., 0] / self.total.clamp_min(1)

    def share_at_or_above_hi(self) -> Float[Tensor, "..."]:
        return self.counts[..., -1] / self.total.clamp_min(1)

    def quantile(self, q: float) -> Float[Tensor, "..."]:
        """Quantile with linear interpolation inside a bin (on the binning axis); edge bins map
        to `lo`/`hi`.

        Args:
            q: The quantile, in [0, 1].

        Returns:
            Per group the quantile (float64); NaN for empty groups. Resolution is one bin
            (relative, for `scale="asinh"`).
        """
        counts = self.counts.double()
        total = counts.sum(-1, keepdim=True)
        cum = counts.cumsum(-1)
        target = q * total
        idx = torch.searchsorted(cum.contiguous(), target.contiguous()).clamp_max(self.n_bins + 1)[
            ..., 0
        ]
        prev = torch.where(idx > 0, cum.gather(-1, (idx - 1).clamp_min(0)[..., None])[..., 0], 0.0)
        in_bin = counts.gather(-1, idx[..., None])[..., 0]
        frac = ((target[..., 0] - prev) / in_bin.clamp_min(1)).clamp(0, 1)
        lo, hi = self._axis()
        width = (hi - lo) / self.n_bins
        value = self._inverse(lo + (idx - 1).double() * width + frac * width)
        value = torch.where(idx == 0, self.lo, value)  # float64 scalars: a float64 result
        value = torch.where(idx == self.n_bins + 1, self.hi, value)
        return torch.where(total[..., 0] > 0, value, math.nan)


_BINNINGS: dict[tuple, tuple[Tensor, ...]] = {}


def _binning_tensors(histograms: Sequence[Histogram], device: torch.device, ndim: int) -> tuple:
    """The binnings of `histograms` as float64 tensors `[histogram, 1, ...]` on `device`, made
    once per binning and device (no upload per block)."""
    key = (tuple(h.binning for h in histograms), str(device), ndim)
    if key not in _BINNINGS:
        if len(_BINNINGS) > 64:
            _BINNINGS.clear()
        columns = []
        for h in histograms:
            lo, hi = h._axis()
            columns.append((h.lo, h.hi, lo, h.n_bins / (hi - lo), h.unit, h.n_bins))
        with torch.inference_mode(False):
            table = torch.tensor(columns, dtype=torch.float64, device=device)
            shape = (len(histograms),) + (1,) * (ndim - 1)
            parts = [table[:, i].reshape(shape) for i in range(5)]
            n_bins = table[:, 5].long().reshape(shape)
            is_asinh = torch.tensor(
                [h.scale == "asinh" for h in histograms], device=device
            ).reshape(shape)
        _BINNINGS[key] = (*parts, n_bins, is_asinh)
    return _BINNINGS[key]


def bin_indices(
    histograms: Sequence[Histogram], values: Float[Tensor, "histogram ..."]
) -> Int[Tensor, "histogram ..."]:
    """The bins of several histograms' values at once: `values[i]` binned as `histograms[i]`
    bins (`Histogram.bin_index`), in one chain of about a dozen operations whatever the number
    of histograms.

    Args:
        histograms: The binnings.
        values: One slice of values per histogram (NaN values get some bin: mask them).

    Returns:
        int64 bins of `values`' shape: 0 for `<= lo`, `n_bins + 1` for `>= hi`, else
        `1..n_bins`.

    Examples:
        >>> import torch
        >>> a, b = Histogram((), 0.0, 1.0, 4), Histogram((), -1.0, 1.0, 2)
        >>> bin_indices([a, b], torch.tensor([[0.3, 2.0], [-0.5, 0.5]])).tolist()
        [[2, 5], [1, 2]]
    """
    if values.shape[0] != len(histograms):
        raise InputError(
            f"bin_indices needs one slice of values per histogram: {len(histograms)} "
            f"histograms, values {tuple(values.shape)}."
        )
    v = values.double()
    lo, hi, axis_lo, per_unit, unit, n_bins, is_asinh = _binning_tensors(
        histograms, v.device, v.dim()
    )
    if any(h.scale == "asinh" for h in histograms):
        t = torch.where(is_asinh, torch.asinh(v / unit), v)
    else:
        t = v
    inner = ((t - axis_lo) * per_unit).floor_().long()
    inner = torch.minimum(inner.add_(1).clamp_(min=1), n_bins)
    inner = inner.masked_fill_(v <= lo, 0)
    return torch.where(v >= hi, n_bins + 1, inner)


def fill_histograms(
    histograms: Sequence[Histogram],
    values: Float[Tensor, "histogram *group sample"],
    index: int | tuple | None = None,
) -> None:
    """Count `values[i]` into `histograms[i].counts[index]`, for every histogram at once.

    The histograms' counts at `index` must have the same group axes. NaN values are not
    counted (no selection of the valid values: that would wait for the device).

    Args:
        histograms: The histograms.
        values: Per histogram, the group axes of `counts[index]` followed by one axis of
            samples.
        index: The part of each histogram's counts to fill, or None for all.

    Examples:
        >>> import torch
        >>> a, b = Histogram((2,), 0.0, 1.0, 4), Histogram((2,), -1.0, 1.0, 2)
        >>> fill_histograms([a, b], torch.tensor([[[0.3], [2.0]], [[-0.5], [float("nan")]]]))
        >>> a.counts.tolist(), b.counts.tolist()
        ([[0, 0, 1, 0, 0, 0], [0, 0, 0, 0, 0, 1]], [[0, 1, 0, 0], [0, 0, 0, 0]])
    """
    values = values.detach()
    bins = bin_indices(histograms, values.nan_to_num(0.0))
    count_bins(histograms, bins, ~values.isnan(), index)


def count_bins(
    histograms: Sequence[Histogram],
    bins: Int[Tensor, "histogram *group sample"],
    counted: Bool[Tensor, "histogram *group sample"],
    index: int | tuple | None = None,
) -> None:
    """Count bins already found (`bin_indices`) into `histograms[i].counts[index]` where
    `counted` (what `fill_histograms` does after binning; for a caller that reads the bins too).

    Args:
        histograms: The histograms.
        bins: Per histogram, the group axes of `counts[index]` followed by the samples' bins.
        counted: Which samples to count.
        index: The part of each histogram's counts to fill, or None for all.
    """
    targets = [h.counts if index is None else h.counts[index] for h in histograms]
    shape = targets[0].shape[:-1]
    if any(t.shape[:-1] != shape for t in targets):
        raise InputError("fill_histograms needs histograms with the same group axes.")
    bins = bins.reshape(len(histograms), *shape, -1)
    counted = counted.reshape(bins.shape).long()
    n_bins = _binning_tensors(histograms, bins.device, bins.dim())[5]
    # each group's bins follow the previous group's: group g starts at g * (n_bins + 2)
    group = torch.arange(math.prod(shape), device=bins.device).reshape(1, *shape, 1)
    bins = bins + group * (n_bins + 2)
    for target, h_bins, h_counted in zip(targets, bins, counted, strict=True):
        if target.is_contiguous():
            target.view(-1).index_add_(0, h_bins.reshape(-1), h_counted.reshape(-1))
        else:  # a part of the counts that is not one stretch of memory
            added = torch.zeros_like(target).view(-1)
            added.index_add_(0, h_bins.reshape(-1), h_counted.reshape(-1))
            target += added.view(target.shape)
