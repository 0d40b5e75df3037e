"""Mergeable accumulators: how corpus analyses fold streamed layers into small results.

Corpus analyses are map (per document batch, inside the forward pass) and reduce (merge the
accumulators). Two building blocks make the reduce exact, whatever the order and sharding:

- :class:`DocSums` keeps float64 sums *per document*; totals add the documents in index order,
  so a corpus split over ``torchrun`` ranks gives bit-identical totals to a single process.
- :class:`Histogram` keeps integer counts over fixed bins (quantiles, shares); integer sums are
  exact in any order.

Both have ``merge(other)``; :func:`cw_lens.distributed.merge_across_ranks` gathers and merges any
object with a ``merge`` method.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
from jaxtyping import Float
from torch import Tensor

from cw_lens.errors import InputError


class DocSums:
    """Named float64 sums kept per document (exact to merge)."""

    def __init__(self) -> None:
        self._docs: dict[int, dict[str, Tensor]] = {}

    def add(self, doc: int, name: str, value: Tensor | float) -> None:
        value = torch.as_tensor(value).detach().to("cpu", torch.float64)
        entry = self._docs.setdefault(int(doc), {})
        if name in entry:
            entry[name] = entry[name] + value
        else:
            entry[name] = value.clone()

    def add_rows(self, docs: Sequence[int], name: str, values: Tensor) -> None:
        """Add ``values[r]`` to document ``docs[r]`` for every row ``r``."""
        values = values.detach().to("cpu", torch.float64)
        for r, doc in enumerate(docs):
            self.add(doc, name, values[r])

    def merge(self, other: DocSums) -> None:
        overlap = set(self._docs) & set(other._docs)
        if overlap:
            raise InputError(f"Cannot merge: documents {sorted(overlap)[:5]} were counted twice.")
        self._docs.update(other._docs)

    @property
    def documents(self) -> list[int]:
        return sorted(self._docs)

    def total(self, name: str) -> Tensor:
        """Sum over documents, in document order (float64)."""
        out = None
        for doc in self.documents:
            value = self._docs[doc].get(name)
            if value is None:
                continue
            out = value.clone() if out is None else out + value
        if out is None:
            raise KeyError(f"no document recorded {name!r}")
        return out

    def __contains__(self, name: str) -> bool:
        return any(name in entry for entry in self._docs.values())


class DocSamples:
    """Per-document sample rows (``[n, n_columns]`` float32) under named groups.

    For statistics that need raw samples (rank correlations). Which entries are sampled must be
    decided per document (e.g. a generator seeded by the document index), so the union over
    shards equals a single-process run; :meth:`table` concatenates in document order.
    """

    def __init__(self, columns: Sequence[str]) -> None:
        self.columns = list(columns)
        self._docs: dict[int, dict[str, list[Tensor]]] = {}

    def add(self, doc: int, group: str, rows: Tensor) -> None:
        if rows.ndim != 2 or rows.shape[1] != len(self.columns):
            raise InputError(f"rows must be [n, {len(self.columns)}], got {tuple(rows.shape)}")
        entry = self._docs.setdefault(int(doc), {})
        entry.setdefault(group, []).append(rows.detach().to("cpu", torch.float32))

    def merge(self, other: DocSamples) -> None:
        overlap = set(self._docs) & set(other._docs)
        if overlap:
            raise InputError(f"Cannot merge: documents {sorted(overlap)[:5]} were sampled twice.")
        self._docs.update(other._docs)

    def table(self, group: str) -> Tensor:
        """All rows of ``group`` in document order, ``[n, n_columns]``."""
        parts = [r for d in sorted(self._docs) for r in self._docs[d].get(group, [])]
        if not parts:
            return torch.zeros(0, len(self.columns))
        return torch.cat(parts)


class Histogram:
    """Counts of values over ``n_bins`` equal bins on ``(lo, hi)`` per group, plus two edge
    bins: values ``<= lo`` and values ``>= hi`` (so clamped values are counted exactly).

    ``counts`` is ``[*shape, n_bins + 2]`` int64; NaN values are ignored.
    """

    def __init__(self, shape: Sequence[int], lo: float, hi: float, n_bins: int) -> None:
        if not hi > lo or n_bins < 1:
            raise InputError("Histogram needs hi > lo and at least one bin.")
        self.lo, self.hi, self.n_bins = float(lo), float(hi), int(n_bins)
        self.counts = torch.zeros((*shape, n_bins + 2), dtype=torch.int64)

    @property
    def edges(self) -> Tensor:
        return torch.linspace(self.lo, self.hi, self.n_bins + 1, dtype=torch.float64)

    def bin_index(self, values: Tensor) -> Tensor:
        v = values.double()
        inner = ((v - self.lo) / (self.hi - self.lo) * self.n_bins).floor().long() + 1
        inner = inner.clamp(1, self.n_bins)
        return torch.where(v <= self.lo, 0, torch.where(v >= self.hi, self.n_bins + 1, inner))

    def add(self, values: Tensor, index: int | tuple | None = None) -> None:
        """Count ``values`` ``[*groups, n]`` into ``counts[index]`` (all groups when None).

        ``values`` has the group axes of ``counts[index]`` followed by one axis of samples.
        """
        target = self.counts if index is None else self.counts[index]
        shape = target.shape[:-1]
        values = values.detach().to("cpu").reshape(*shape, -1)
        ok = ~values.isnan()
        bins = self.bin_index(values.nan_to_num(self.lo))
        n_groups = int(torch.tensor(shape).prod()) if len(shape) else 1
        offsets = torch.arange(n_groups).reshape(*shape, 1) * (self.n_bins + 2)
        flat = (bins + offsets)[ok]
        target += torch.bincount(flat, minlength=n_groups * (self.n_bins + 2)).reshape(target.shape)

    def merge(self, other: Histogram) -> None:
        if other.counts.shape != self.counts.shape or (other.lo, other.hi) != (self.lo, self.hi):
            raise InputError("Cannot merge histograms with different bins.")
        self.counts += other.counts

    @property
    def total(self) -> Tensor:
        return self.counts.sum(-1)

    def share_at_or_below_lo(self) -> Float[Tensor, "..."]:
        return self.counts[..., 0] / self.total.clamp_min(1)

    def share_at_or_above_hi(self) -> Float[Tensor, "..."]:
        return self.counts[..., -1] / self.total.clamp_min(1)

    def quantile(self, q: float) -> Float[Tensor, "..."]:
        """Quantile with linear interpolation inside a bin; edge bins map to ``lo``/``hi``.

        NaN for empty groups. Resolution is one bin width.
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
        width = (self.hi - self.lo) / self.n_bins
        left = self.lo + (idx - 1).double() * width
        value = left + frac * width
        value = torch.where(idx == 0, torch.tensor(self.lo, dtype=torch.float64), value)
        value = torch.where(
            idx == self.n_bins + 1, torch.tensor(self.hi, dtype=torch.float64), value
        )
        return torch.where(
            total[..., 0] > 0, value, torch.tensor(float("nan"), dtype=torch.float64)
        )


def merge_all(items: Iterable) -> object:
    """Merge a sequence of accumulators of one type into the first (in order)."""
    items = list(items)
    first = items[0]
    for other in items[1:]:
        first.merge(other)
    return first
