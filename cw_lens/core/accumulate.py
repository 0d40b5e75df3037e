"""Mergeable accumulators: how corpus analyses fold streamed layers into small results.

Corpus analyses are map (per document batch, inside the forward pass) and reduce (merge the
accumulators). The building blocks make the reduce exact, whatever the order and sharding, and
hold a fixed amount of memory whatever the number of documents:

- `ExactSums` keeps named sums of float64 values *exactly* (integer fixed point,
  `cw_lens.core.exact`): any order of addition and any merge order give the same bits, so a
  corpus split over `torchrun` ranks gives bit-identical totals to a single process. Its size
  is fixed by the names and shapes summed (568 bytes per summed number), not by the corpus.
- `SampleReservoir` keeps at most `capacity` sample rows per group: those with the
  smallest keys, a seeded hash of each row and its document, so the sample is the same however
  the documents are sharded (a mergeable bottom-k sample).
- `Histogram` keeps integer counts over fixed bins (quantiles, shares); integer sums are
  exact in any order.
- `PerDocument` (opt-in, for resampling over documents such as a bootstrap) keeps a few
  float32 numbers per document: `4 * len(names) + 1` bytes per document, the only
  per-document state; `BootstrapSums` is the fixed-size alternative (seeded Poisson
  bootstrap replicates of exact sums).

All have `merge(other)`; `cw_lens.data.distributed.merge_across_ranks` gathers and merges any
object with a `merge` method. `state_bytes` measures what an accumulator holds. How `ExactSums`
and `SampleReservoir` store what they keep: `cw_lens.core.exact_slots`, `cw_lens.core.bottom_k`.
"""

# One concept: the four building blocks share one protocol (update, merge, state) and one
# reason to exist, folding streamed layers into results of fixed size.
from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence
from typing import Annotated, Any, ClassVar, Literal

import numpy as np
import torch
from jaxtyping import Bool, Float, Float32, Integer
from torch import Tensor

from cw_lens.core import exact
from cw_lens.core.bottom_k import BottomKBuffers
from cw_lens.core.devices import to_tensor
from cw_lens.core.errors import InputError
from cw_lens.core.exact_slots import ExactSlots
from cw_lens.core.memory import state_bytes  # noqa: F401  (re-exported: the tests read it here)
from cw_lens.core.registry import saveable
from cw_lens.core.row_hash import _hash_rows, _start_key, row_keys
from cw_lens.core.schema import Count

# Numbers an `ExactSums` buffers on a device other than the CPU before they travel to the host
# (and into its limbs): one transfer per 2^20 numbers, 16 MB of buffer with their indices.
DEVICE_BUFFER = 1 << 20


def _float64(values: Tensor | float | Sequence[float]) -> Tensor:
    """A tensor as is; Python numbers as float64 (`torch.as_tensor(0.1)` would be float32)."""
    if isinstance(values, Tensor):
        return values
    return torch.as_tensor(values, dtype=torch.float64, device="cpu")


@saveable
class ExactSums(ExactSlots):
    """Named float64 sums, exact and independent of the order of addition and merging.

    `add_rows(docs, name, values)` adds every row of `values` (one per document; the
    document indices are not kept) to the sum `name`; `total` is the correctly rounded
    float64 of the exact sum of everything added under `name`. Additions are copied into a
    buffer allocated once (`buffer` numbers) and folded into the integer limbs when it is
    full: the state — limbs fixed by the names and shapes, plus the buffer — never grows with
    the corpus, and no allocation outlives the call that made it (so the heap does not
    fragment around long-lived small objects).
    """

    # what a file stores (`__getstate__`): the limbs packed, the buffer folded
    stored_fields: ClassVar[dict[str, Any]] = {
        "buffer": Annotated[int, Count()],
        "_slots": dict[str, tuple[int, tuple[int, ...]]],
        "_size": int,
        "_values": None,
        "_index": None,
        "_n_buffered": int,
        "_since_carry": int,
        "_totals": dict[str, Tensor],
        "_packed": dict[str, int | Integer[Tensor, "slot _"]],
    }

    def __init__(self, buffer: int = 1 << 16) -> None:
        self.buffer = int(buffer)
        self._slots: dict[str, tuple[int, tuple[int, ...]]] = {}  # name -> (offset, shape)
        self._size = 0
        self._limbs, self._special = exact.zeros(0)
        self._values: Tensor | None = None  # the buffer: values and their slot indices
        self._index: Tensor | None = None
        self._n_buffered = 0
        self._since_carry = 0
        self._totals: dict[str, Tensor] = {}

    def add(self, doc: int, name: str, value: Tensor | float) -> None:
        self.add_rows([doc], name, _float64(value)[None])

    def add_rows(self, docs: Sequence[int], name: str, values: Tensor) -> None:
        """Add `values[r]` (the numbers of document `docs[r]`) to `name` for every row."""
        self.add_many(docs, [(name, values)])

    def add_many(self, docs: Sequence[int], items: Sequence[tuple[str, Tensor]]) -> None:
        """`add_rows(docs, name, values)` for every `(name, values)` of `items`, in one copy
        into the buffer, which lives on the values' device: the numbers reach the host (and
        the limbs) only when the buffer is full or a total is read.

        Args:
            docs: The documents of the rows.
            items: `(name, values)` pairs, `values` with one row per document.
        """
        parts, slots = [], []
        for name, values in items:
            values = _float64(values).detach()
            if values.ndim == 0 or values.shape[0] != len(docs):
                got = f"{len(docs)}), got {tuple(values.shape)}"
                raise InputError(f"values must have one row per document ({got}.")
            slots.append((self._slot(name, tuple(values.shape[1:])), values[0].numel()))
            parts.append(values.reshape(len(docs), slots[-1][1]))
            self._totals.pop(name, None)
        width = sum(numel for _, numel in slots)
        device, n = parts[0].device if parts else None, len(docs) * width
        if n == 0:
            return
        cache = self.__dict__.setdefault("_index_rows", {})  # each layout's slot indices
        if (tuple(slots), device) not in cache:
            with torch.inference_mode(False):
                ranges = [torch.arange(o, o + k, device=device) for o, k in slots]
                cache[tuple(slots), device] = torch.cat(ranges)
        index = cache[tuple(slots), device]
        capacity = self.buffer if device.type == "cpu" else max(self.buffer, DEVICE_BUFFER)
        if n > capacity:  # too large to buffer: fold it in directly
            rows = torch.cat([p.to("cpu", torch.float64) for p in parts], dim=1).reshape(-1)
            self._fold(rows, index.to("cpu").repeat(len(docs)))
            return
        if self._values is None or self._values.device != device:
            self._flush()
            with torch.inference_mode(False):  # state outlives the (inference-mode) passes
                self._values = torch.empty(capacity, dtype=torch.float64, device=device)
                self._index = torch.empty(capacity, dtype=torch.int64, device=device)
        if self._n_buffered + n > self._values.numel():
            self._flush()
        rows = slice(self._n_buffered, self._n_buffered + n)
        buffered, start = self._values[rows].view(len(docs), width), 0
        for part in parts:  # each cast to float64 as it is copied (exact)
            buffered[:, start : start + part.shape[1]].copy_(part)
            start += part.shape[1]
        self._index[rows].view(len(docs), width).copy_(index)
        self._n_buffered += n

    def to_host(self) -> None:
        """Fold the buffer into the limbs (on the host); release a buffer off the CPU."""
        self._flush()
        if self._values is not None and self._values.device.type != "cpu":
            self._values = self._index = None

    def merge(self, other: ExactSums) -> None:
        self._flush()
        other._flush()
        exact.carry(self._limbs)  # both in [0, 2^32) per limb: the sums cannot overflow
        exact.carry(other._limbs)
        self._since_carry = 0
        for name, (offset, shape) in other._slots.items():
            numel = int(np.prod(shape, dtype=np.int64))
            mine = self._slot(name, shape)
            self._limbs[mine : mine + numel] += other._limbs[offset : offset + numel]
            self._special[mine : mine + numel] += other._special[offset : offset + numel]
        self._totals.clear()

    def total(self, name: str) -> Tensor:
        """The correctly rounded float64 of the exact sum of every value added to `name`."""
        if name not in self._slots:
            raise KeyError(f"nothing was added to {name!r}")
        if name not in self._totals:
            self._flush()
            offset, shape = self._slots[name]
            numel = int(np.prod(shape, dtype=np.int64))
            rows = slice(offset, offset + numel)
            self._totals[name] = exact.to_float(self._limbs[rows], self._special[rows]).reshape(
                shape
            )
        return self._totals[name].clone()

    @property
    def names(self) -> list[str]:
        return list(self._slots)

    def __contains__(self, name: str) -> bool:
        return name in self._slots


@saveable
class SampleReservoir(BottomKBuffers):
    """At most `capacity` sample rows (`[n, n_columns]` float32) per named group.

    For statistics that need raw samples (rank correlations). Each row gets a key, a seeded hash
    of the row and its document (`row_keys`); the reservoir keeps the `capacity` rows
    with the smallest keys (ties: by the row's values). The kept rows are therefore a function
    of the set of rows offered, not of their order or of how documents were split over ranks:
    a uniform random sample of all rows offered, the same in a sharded and a single run.
    Each kept row remembers its document (`documents`; not part of its key), for
    resampling documents (`cw_lens.core.bootstrap`).
    Memory: a buffer of `2 * capacity` rows, keys and documents per group,
    `capacity * (8 * n_columns + 32)` bytes, allocated once.
    """

    stored_fields: ClassVar[dict[str, Any]] = {
        "columns": list[str],
        "capacity": Annotated[int, Count()],  # allocates 2 * capacity rows per group
        "seed": int,
        "_rows": dict[str, np.ndarray],
        "_keys": dict[str, np.ndarray],
        "_docs": dict[str, np.ndarray],
        "_n": dict[str, int],
    }
    optional_fields = ("_docs",)  # absent in states stored before documents were kept

    def __init__(self, columns: Sequence[str], capacity: int = 100_000, seed: int = 0) -> None:
        if capacity < 1:
            raise InputError(f"capacity must be at least 1, got {capacity}.")
        self.columns, self.capacity, self.seed = list(columns), int(capacity), int(seed)
        self._rows: dict[str, np.ndarray] = {}  # [2 capacity, n_columns] buffers
        self._keys: dict[str, np.ndarray] = {}
        self._docs: dict[str, np.ndarray] = {}  # each row's document (-1: not recorded)
        self._n: dict[str, int] = {}  # rows held per group

    def add(self, doc: int, group: str, rows: Tensor) -> None:
        if rows.ndim != 2 or rows.shape[1] != len(self.columns):
            raise InputError(f"rows must be [n, {len(self.columns)}], got {tuple(rows.shape)}.")
        table = rows.detach().to("cpu", torch.float32).numpy()
        docs = np.full(len(table), doc, np.int64)
        self._offer(group, table, row_keys(self.seed, doc, group, table), docs)

    def add_many(
        self,
        docs: Sequence[int],
        groups: Sequence[str],
        rows: Tensor,
        row_doc: Tensor,
        row_group: Tensor,
    ) -> None:
        """Rows of several documents and groups at once: row `i` belongs to document
        `docs[row_doc[i]]` and group `groups[row_group[i]]`. The same as `add` for
        each (document, group) that has rows, with the keys hashed in one pass."""
        if rows.ndim != 2 or rows.shape[1] != len(self.columns):
            raise InputError(f"rows must be [n, {len(self.columns)}], got {tuple(rows.shape)}.")
        if not (len(rows) == len(row_doc) == len(row_group)):
            raise InputError("rows, row_doc and row_group must have the same length.")
        table = rows.detach().to("cpu", torch.float32).numpy()
        doc_of = row_doc.detach().cpu().numpy().astype(np.int64)
        group_of = row_group.detach().cpu().numpy().astype(np.int64)
        start = np.array(
            [[_start_key(self.seed, doc, group) for group in groups] for doc in docs], np.uint64
        ).reshape(len(docs), len(groups))
        keys = _hash_rows(start[doc_of, group_of], table)
        doc_ids = np.asarray(list(docs), np.int64)[doc_of]
        for g in np.unique(group_of).tolist():
            mine = group_of == g
            self._offer(groups[g], table[mine], keys[mine], doc_ids[mine])

    def merge(self, other: SampleReservoir) -> None:
        if other.columns != self.columns or (other.capacity, other.seed) != (
            self.capacity,
            self.seed,
        ):
            raise InputError("Cannot merge sample reservoirs with different columns, size or seed.")
        for group in other._rows:
            self._offer(group, *other._held(group))

    def subset(self, groups: Sequence[str]) -> SampleReservoir:
        """A new reservoir holding the kept rows of `groups` only (same columns, size and
        seed), e.g. the groups of one layer.

        Args:
            groups: Group names; those never offered rows are left out.

        Returns:
            The new reservoir; this one is unchanged.

        Examples:
            >>> import torch
            >>> from cw_lens.core.accumulate import SampleReservoir
            >>> reservoir = SampleReservoir(["x"], capacity=4)
            >>> reservoir.add(0, "a", torch.ones(2, 1))
            >>> reservoir.add(0, "b", torch.ones(3, 1))
            >>> reservoir.subset(["b"]).groups()
            ['b']
        """
        out = SampleReservoir(self.columns, self.capacity, self.seed)
        for group in groups:
            if group in self._rows:
                out._offer(group, *self._held(group))
        return out

    def groups(self) -> list[str]:
        """The groups offered rows so far, sorted."""
        return sorted(self._rows)

    def table(self, group: str) -> Tensor:
        """The kept rows of `group` in key order, `[n, n_columns]`."""
        return torch.from_numpy(self._held(group)[0].copy())

    def documents(self, group: str) -> Tensor:
        """The document of each kept row of `group`, in `table`'s order (int64; -1
        for rows stored by a version that did not record it)."""
        return torch.from_numpy(self._held(group)[2].copy())


@saveable
class Histogram:
    """Counts of values over `n_bins` bins on `(lo, hi)` per group, plus two edge bins:
    values `<= lo` and values `>= hi` (so clamped values are counted exactly).

    `scale="linear"`: equal bins. `scale="asinh"`: bins equal in `asinh(v / unit)`, i.e.
    about `unit`-wide near 0 and of equal *relative* width for `|v| >> unit` — for values
    without a natural range (a quantile of a ratio that can be far from 0) over a very wide
    `(lo, hi)` without clipping them. `counts` is `[*shape, n_bins + 2]` int64; NaN values
    are ignored.
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
    ) -> None:
        if not hi > lo or n_bins < 1:
            raise InputError("Histogram needs hi > lo and at least one bin.")
        if scale not in ("linear", "asinh") or not unit > 0:
            raise InputError("Histogram scale must be 'linear' or 'asinh' (with a unit > 0).")
        self.lo, self.hi, self.n_bins = float(lo), float(hi), int(n_bins)
        self.scale, self.unit = scale, float(unit)
        self.counts = torch.zeros((*shape, n_bins + 2), dtype=torch.int64, device="cpu")

    def _forward(self, v: Tensor) -> Tensor:
        """Value -> the axis on which the bins are equal."""
        return torch.asinh(v / self.unit) if self.scale == "asinh" else v

    def _inverse(self, t: Tensor) -> Tensor:
        return torch.sinh(t) * self.unit if self.scale == "asinh" else t

    def _axis(self) -> tuple[float, float]:
        lo, hi = self._forward(
            torch.tensor([self.lo, self.hi], dtype=torch.float64, device="cpu")
        ).tolist()
        return lo, hi

    @property
    def binning(self) -> tuple:
        return (self.lo, self.hi, self.n_bins, self.scale, self.unit)

    @property
    def edges(self) -> Tensor:
        lo, hi = self._axis()
        return self._inverse(
            torch.linspace(lo, hi, self.n_bins + 1, dtype=torch.float64, device="cpu")
        )

    def bin_index(self, values: Tensor) -> Tensor:
        v = values.double()
        lo, hi = self._axis()
        inner = ((self._forward(v) - lo) / (hi - lo) * self.n_bins).floor().long() + 1
        inner = inner.clamp(1, self.n_bins)
        return torch.where(v <= self.lo, 0, torch.where(v >= self.hi, self.n_bins + 1, inner))

    def add(self, values: Tensor, index: int | tuple | None = None) -> None:
        """Count `values` `[*groups, n]` into `counts[index]` (all groups when None).

        `values` has the group axes of `counts[index]` followed by one axis of samples.
        """
        # counted on the values' device, but asinh bins on the host's asinh (others round apart)
        device = values.device if self.scale == "linear" else torch.device("cpu")
        self.counts = self.counts.to(device)
        target = self.counts if index is None else self.counts[index]
        shape = target.shape[:-1]
        values = values.detach().to(device).reshape(*shape, -1)
        ok, width = ~values.isnan(), self.n_bins + 2
        bins = self.bin_index(values.nan_to_num(self.lo))
        bins += torch.arange(math.prod(shape), device=device).reshape(*shape, 1) * width
        # a NaN adds 0 (no selection of the valid values: that would wait for the device)
        target.view(-1).index_add_(0, bins.masked_fill_(~ok, 0).reshape(-1), ok.reshape(-1).long())

    def to_host(self) -> None:
        """Bring the counts to the CPU (they follow the values' device while counting)."""
        self.counts = self.counts.to("cpu")

    def __getstate__(self) -> dict:
        self.to_host()  # what is saved or travels between ranks is on the host
        # counts in the narrowest integer dtype that holds them (lossless; most bins are 0)
        return {**self.__dict__, "counts": exact.narrowest(self.counts)}

    def __setstate__(self, state: dict) -> None:
        counts = state.get("counts")
        if not isinstance(counts, Tensor) or counts.is_floating_point() or counts.is_complex():
            raise InputError("A histogram's counts must be whole numbers; the file is damaged.")
        self.__dict__.update({**state, "counts": counts.to(torch.int64)})

    def merge(self, other: Histogram) -> None:
        if other.counts.shape != self.counts.shape or other.binning != self.binning:
            raise InputError("Cannot merge histograms with different bins.")
        self.counts += other.counts.to(self.counts.device)

    @property
    def total(self) -> Tensor:
        return self.counts.sum(-1)

    def share_at_or_below_lo(self) -> Float[Tensor, "..."]:
        return self.counts[..., 0] / self.total.clamp_min(1)

    def share_at_or_above_hi(self) -> Float[Tensor, "..."]:
        return self.counts[..., -1] / self.total.clamp_min(1)

    def quantile(self, q: float) -> Float[Tensor, "..."]:
        """Quantile with linear interpolation inside a bin (on the binning axis); edge bins map
        to `lo`/`hi`.

        NaN for empty groups. Resolution is one bin (relative, for `scale="asinh"`).
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


@saveable
class PerDocument:
    """A few float32 numbers per document under named statistics (opt-in, for resampling).

    For a bootstrap over documents (`cw_lens.core.bootstrap`), which needs each document's own
    numbers. Sized for a corpus of `n_documents` up front: each statistic is a `shape`
    float32 array per document (`()`: one number; `(layer, head)`: one per head), plus one
    byte per document marking it seen — `4 * len(names) * prod(shape) + 1` bytes per document
    (`bytes_per_document`), the only state that grows with the corpus. Additions to one
    document happen on the rank that holds its batch, in the same order as in a single process,
    so merged tables are bit-identical.
    """

    stored_fields: ClassVar[dict[str, Any]] = {
        "names": list[str],
        "shape": tuple[int, ...],
        "_column": dict[str, int],
        "values": Float32[Tensor, "document statistic *shape"],
        "seen": Bool[Tensor, " document"],
    }

    def __init__(self, names: Sequence[str], n_documents: int, shape: Sequence[int] = ()) -> None:
        self.names = list(names)
        self.shape = tuple(int(s) for s in shape)
        self._column = {n: i for i, n in enumerate(self.names)}
        self.values = torch.zeros(
            int(n_documents), len(self.names), *self.shape, dtype=torch.float32, device="cpu"
        )
        self.seen = torch.zeros(int(n_documents), dtype=torch.bool, device="cpu")

    @property
    def bytes_per_document(self) -> int:
        return 4 * len(self.names) * int(np.prod(self.shape, dtype=np.int64)) + 1

    def add_rows(
        self, docs: Sequence[int], name: str, values: Tensor, at: int | tuple | None = None
    ) -> None:
        """Add `values[r]` to document `docs[r]`'s statistic `name` (to its part `at`,
        an index into `shape`, when given: e.g. one layer of a `(layer, head)` statistic)."""
        self.add_many(docs, [(name, values)], at=at)

    def add_many(
        self,
        docs: Sequence[int],
        items: Sequence[tuple[str, Tensor]],
        at: int | tuple | None = None,
    ) -> None:
        """`add_rows(docs, name, values, at)` for every `(name, values)` of `items`, on the
        values' device (the record follows it until `to_host`; each number is added in
        float32 as on the host, in the same order).

        Args:
            docs: The documents of the rows.
            items: `(name, values)` pairs, `values` with one row per document.
            at: The part of `shape` the values go to (`None`: all of it).
        """
        unknown = [name for name, _ in items if name not in self._column]
        if unknown:
            raise InputError(f"Unknown statistic {unknown[0]!r}; this record keeps {self.names}.")
        docs = [int(d) for d in docs]
        if docs and max(docs) >= self.values.shape[0]:
            raise InputError(
                f"Document {max(docs)} is beyond the {self.values.shape[0]} documents "
                "this record was sized for."
            )
        device = self.values.device  # off the CPU already, or to the first values' device
        if items and device.type == "cpu" and to_tensor(items[0][1]).device.type != "cpu":
            device = to_tensor(items[0][1]).device
            self.values, self.seen = self.values.to(device), self.seen.to(device)
        last = self.__dict__.get("_index")  # the batch's rows: one upload per batch
        if last is None or last[0] != (docs, device):
            last = self._index = (
                (docs, device),
                torch.tensor(docs, dtype=torch.long, device=device),
            )
        index = last[1]
        part = (slice(None), *(() if at is None else at if isinstance(at, tuple) else (at,)))
        for name, values in items:
            target = self.values[:, self._column[name]][part]
            values = to_tensor(values).detach().to(device, torch.float32)
            target[index] += values.reshape(len(index), *target.shape[1:])
        self.seen[index] = True

    def to_host(self) -> None:
        """Bring the record to the CPU (it follows the values' device while recording)."""
        self.values, self.seen, self._index = self.values.to("cpu"), self.seen.to("cpu"), None

    def merge(self, other: PerDocument) -> None:
        if other.names != self.names or other.values.shape != self.values.shape:
            raise InputError("Cannot merge per-document records of different statistics.")
        self.to_host(), other.to_host()
        both = self.seen & other.seen
        if bool(both.any()):
            docs = both.nonzero().flatten()[:5].tolist()
            raise InputError(f"Cannot merge: documents {docs} were recorded twice.")
        seen = other.seen.reshape(-1, *[1] * (self.values.ndim - 1))
        self.values = torch.where(seen, other.values, self.values)
        self.seen |= other.seen

    def table(self, name: str | None = None) -> Float[Tensor, "document ..."]:
        """The numbers of the documents seen, in document order: `[document, statistic,
        *shape]`, or `[document, *shape]` for one statistic `name` (on the host)."""
        self.to_host()
        values = self.values[self.seen]
        return values if name is None else values[:, self._column[name]]

    def __getstate__(self) -> dict:
        self.to_host()  # what is saved or travels between ranks is on the host
        return {k: v for k, v in self.__dict__.items() if k != "_index"}


@saveable
class BootstrapSums:
    """Seeded Poisson-bootstrap replicates of exact sums: a fixed-size alternative to
    `PerDocument`.

    Each document gets `n_replicates` Poisson(1) weights drawn from a generator seeded by
    `(seed, document)` — the same on any rank and for every statistic — and replicate `r` of
    a sum is `sum_d w[d, r] x_d`, kept in an `ExactSums` (so sharded runs are
    bit-identical). Size: `n_replicates` times 568 bytes per summed number, whatever the
    corpus size; `total(name)` is `[n_replicates, *shape]`.
    """

    stored_fields: ClassVar[dict[str, Any]] = {
        "n_replicates": Annotated[int, Count()],
        "seed": int,
        "sums": ExactSums,
    }

    def __init__(self, n_replicates: int = 1000, seed: int = 0) -> None:
        if n_replicates < 1:
            raise InputError(f"n_replicates must be at least 1, got {n_replicates}.")
        self.n_replicates, self.seed = int(n_replicates), int(seed)
        self.sums = ExactSums()

    def weights(self, doc: int) -> Float[Tensor, " replicate"]:
        """The Poisson(1) weights of document `doc`, one per replicate."""
        digest = hashlib.sha1(f"poisson/{self.seed}/{doc}".encode()).digest()
        gen = torch.Generator().manual_seed(int.from_bytes(digest[:7], "little"))
        return torch.poisson(
            torch.ones(self.n_replicates, dtype=torch.float64, device="cpu"), generator=gen
        )

    def add_rows(self, docs: Sequence[int], name: str, values: Tensor) -> None:
        values = _float64(values).detach().to("cpu", torch.float64)
        w = torch.stack([self.weights(d) for d in docs])  # [doc, replicate]
        shape = (len(docs), self.n_replicates, *values.shape[1:])
        self.sums.add_rows(
            docs,
            name,
            (w.reshape(*w.shape, *[1] * (values.ndim - 1)) * values[:, None]).reshape(shape),
        )

    def merge(self, other: BootstrapSums) -> None:
        if (other.n_replicates, other.seed) != (self.n_replicates, self.seed):
            raise InputError("Cannot merge bootstrap sums with different replicates or seed.")
        self.sums.merge(other.sums)

    def total(self, name: str) -> Tensor:
        return self.sums.total(name)
