r"""Accumulators: how a corpus analysis folds streamed layers into a result of fixed size.

A corpus analysis is an accumulator. The stream hands it one layer's block of query rows at a
time (`update(block)`); it folds what it needs into a few tensors on the block's device and keeps
nothing else. Accumulators of several shards combine with `merge(other)` (in one process) or
`all_reduce()` (across `torchrun` ranks, with `torch.distributed` collectives), and `finish(stats)`
turns the merged state into the analysis's result: plain tensors and tables, moved to the host
once.

The building blocks every analysis shares:

- `StackedSums`: named float64 sums stacked in one tensor `[*shape, statistic]` on the inputs'
  device, so that one reduction serves every statistic of a block:
  `total[..., s] = sum over rows of values[row, ..., s]`. With a per-document record
  (`n_documents`), each document's own sums as well, filled by one `index_add_` per block:
  `per_document[d, ..., s] = sum over the rows of document d`. Sums are float64 whatever the
  inputs, so a total over a corpus matches a float64 reference to about `1e-12` relative
  (the order of addition, which batching and sharding change, moves only the last bits).
- `Histogram` (`cw_lens.core.histograms`): integer counts over fixed bins, per group; integer
  sums are exact in any order. Several are binned and filled at once with `fill_histograms`.
- `SampleReservoir`: per group, the `capacity` rows with the smallest keys. A key is a hash of
  the row's coordinates (`entry_keys`: seed, document, layer, head, query, key), so the kept rows
  are the same whatever the batching, the query blocks or the sharding: a uniform random sample
  without replacement of every row offered.

`Accumulator` is the base class of the analyses' accumulators: it merges and reduces every
building block it holds. A statistic of your own over the streamed contributions is a subclass
with an `update` and a `finish`:

```python
import torch

import cw_lens
from cw_lens.core.accumulators import Accumulator, StackedSums, document_rows


class MeanSinkAttention(Accumulator):
    name = "mean_sink_attention"

    def __init__(self, model):
        self.layers = list(range(model.cfg.n_layers))
        shape = (model.cfg.n_layers, model.cfg.n_heads)
        self.sums = StackedSums(["attention", "count"], shape, device=model.cfg.device)

    def update(self, block):
        sink = block.attention[..., 0]  # [batch, head, query]: attention to position 0
        real = block.acts.mask[:, None, block.queries].to(sink.dtype)  # [batch, 1, query]
        count = real.sum(-1).expand_as(sink[..., 0])
        rows = torch.stack([(sink * real).sum(-1), count], -1)  # [batch, head, statistic]
        self.sums.add(rows, document_rows(block.batch.documents, rows.device), at=block.layer)

    def finish(self, stats):
        sums = self.sums.to_host()
        return sums.column("attention") / sums.column("count")


model = cw_lens.load_model("testing:tiny-llama")
corpus = cw_lens.load_corpus(n_docs=4, max_tokens=32, model=model)
mine = MeanSinkAttention(model)
results = cw_lens.corpus_analyses(model, corpus, analyses=[mine], progress=False)
results["mean_sink_attention"]  # [layer, head]
```
"""

# One concept: the building blocks of a corpus accumulator and the base class that merges them;
# each block is a few tensors with the same three operations (add, merge, all_reduce).
from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from jaxtyping import Bool, Float, Int
from torch import Tensor

from cw_lens.core.collectives import process_group
from cw_lens.core.errors import InputError
from cw_lens.core.histograms import Histogram

# --------------------------------------------------------------------------- documents


_ROWS: dict[tuple[tuple[int, ...], str], Tensor] = {}
_LARGEST: dict[int, int] = {}  # the largest document of the tensor `document_rows` keeps


def document_rows(documents: Sequence[int], device: torch.device | str) -> Int[Tensor, " batch"]:
    """The documents of a batch's rows as an int64 tensor on `device`: the index a per-document
    record is filled with. Uploaded once per batch (the last batch's tensor is kept).

    Args:
        documents: Each row's document (`TokenBatch.documents`).
        device: The device of the values to be recorded.

    Returns:
        `[batch]` int64.

    Examples:
        >>> document_rows([4, 5], "cpu")
        tensor([4, 5])
    """
    key = (tuple(int(d) for d in documents), str(torch.device(device)))
    if key not in _ROWS:
        _ROWS.clear()
        _LARGEST.clear()
        with torch.inference_mode(False):
            _ROWS[key] = torch.tensor(key[0], dtype=torch.long, device=device)
        _LARGEST[id(_ROWS[key])] = max(key[0], default=-1)
    return _ROWS[key]


# --------------------------------------------------------------------------- sums


class StackedSums:
    """Named float64 sums, stacked: `total` is `[*shape, statistic]` on the inputs' device.

    `add(values, documents, at=...)` adds `values.sum(0)` (one row per batch row) to `total`
    (or to its part `total[at]`); with a per-document record (`n_documents`) it also adds each
    row to its document's `per_document[document]` with one `index_add_`. Memory:
    `8 * prod(shape) * len(names)` bytes, plus as much per document with the record (the only
    state that grows with the corpus).

    Args:
        names: The statistics, the last axis of the stack.
        shape: The axes before it, e.g. `(layer, head)`.
        n_documents: Documents of the corpus, to keep each one's sums (`None`: no record).
        device: Where the sums live (the model's device).

    Examples:
        >>> import torch
        >>> sums = StackedSums(["x", "count"], (2,), n_documents=3)
        >>> rows = torch.tensor([[[1.0, 1.0], [2.0, 1.0]], [[3.0, 1.0], [4.0, 1.0]]])
        >>> sums.add(rows, document_rows([0, 2], "cpu"))
        >>> sums.column("x")
        tensor([4., 6.], dtype=torch.float64)
        >>> sums.document_table("x")  # documents 0 and 2, those recorded
        tensor([[1., 2.],
                [3., 4.]], dtype=torch.float64)
    """

    def __init__(
        self,
        names: Sequence[str],
        shape: Sequence[int] = (),
        *,
        n_documents: int | None = None,
        device: torch.device | str = "cpu",
    ) -> None:
        self.names = list(names)
        if len(set(self.names)) != len(self.names) or not self.names:
            raise InputError(f"StackedSums needs distinct statistic names, got {self.names}.")
        self.shape = tuple(int(s) for s in shape)
        self._column = {name: i for i, name in enumerate(self.names)}
        with torch.inference_mode(False):  # state outlives the (inference-mode) passes
            self.total = torch.zeros(
                (*self.shape, len(self.names)), dtype=torch.float64, device=device
            )
            self.per_document: Tensor | None = None
            self.seen: Tensor | None = None
            if n_documents is not None:
                self.per_document = torch.zeros(
                    (int(n_documents), *self.total.shape), dtype=torch.float64, device=device
                )
                self.seen = torch.zeros(int(n_documents), dtype=torch.bool, device=device)

    def add(
        self,
        values: Float[Tensor, "batch *part statistic"],
        documents: Int[Tensor, " batch"] | None = None,
        *,
        at: int | tuple[int, ...] | None = None,
    ) -> None:
        """Add one block's rows.

        Args:
            values: One row per batch row; the axes after it are those of `total[at]`
                (the last one the statistics, in `names` order). Cast to float64.
            documents: Each row's document (`document_rows`); needed with the record.
            at: An index into `shape` that the values fill (e.g. the layer's position);
                `None`: all of it.
        """
        values = values.to(torch.float64)
        index = () if at is None else at if isinstance(at, tuple) else (at,)
        target = self.total[index] if index else self.total
        if values.shape[1:] != target.shape:
            raise InputError(
                f"values must be [batch, {', '.join(map(str, target.shape))}] to add to "
                f"total[{index}], got {tuple(values.shape)}."
            )
        target += values.sum(0)
        if self.per_document is not None:
            if documents is None:
                raise InputError("This record keeps each document's sums: pass the documents.")
            largest = _LARGEST.get(id(documents))  # known on the host for document_rows' tensor
            if largest is not None and largest >= self.per_document.shape[0]:
                raise InputError(
                    f"Document {largest} is beyond the {self.per_document.shape[0]} documents "
                    "this record was sized for: pass n_documents=len(corpus)."
                )
            record = self.per_document[(slice(None), *index)] if index else self.per_document
            record.index_add_(0, documents, values)
            self.seen.index_fill_(0, documents, True)

    def merge(self, other: StackedSums) -> None:
        """Add another shard's sums (and records: each document lies in one shard).

        Args:
            other: The same sums of another shard.
        """
        if other.names != self.names or other.total.shape != self.total.shape:
            raise InputError("Cannot merge sums of different statistics or shapes.")
        self.total += other.total.to(self.total.device)
        if self.per_document is not None:
            self.per_document += other.per_document.to(self.per_document.device)
            self.seen |= other.seen.to(self.seen.device)

    def all_reduce(self) -> None:
        """Sum every rank's state in place (a no-op outside a process group of 2+ ranks)."""
        dist = process_group()
        if dist is None:
            return
        dist.all_reduce(self.total)
        if self.per_document is not None:
            dist.all_reduce(self.per_document)
            seen = self.seen.to(torch.uint8)
            dist.all_reduce(seen, op=dist.ReduceOp.MAX)
            self.seen = seen.bool()

    def to_host(self) -> StackedSums:
        """Move the sums (and record) to the CPU, in place: the one transfer of a run.

        Returns:
            This object.
        """
        self.total = self.total.cpu()
        if self.per_document is not None:
            self.per_document, self.seen = self.per_document.cpu(), self.seen.cpu()
        return self

    def column(self, name: str) -> Float[Tensor, "..."]:
        """The total of one statistic.

        Args:
            name: The statistic.

        Returns:
            Its sums, `[*shape]`.
        """
        return self.total[..., self._index(name)]

    def document_table(self, name: str | None = None) -> Float[Tensor, "document ..."]:
        """Each recorded document's sums, in document order (only the documents some block
        recorded).

        Args:
            name: One statistic, or None for all.

        Returns:
            `[document, *shape]` of `name`, or `[document, *shape, statistic]` of all.
        """
        if self.per_document is None:
            raise InputError("These sums keep no per-document record (pass n_documents).")
        table = self.per_document[self.seen]
        return table if name is None else table[..., self._index(name)]

    def _index(self, name: str) -> int:
        if name not in self._column:
            raise InputError(f"Unknown statistic {name!r}; these sums keep {self.names}.")
        return self._column[name]


# --------------------------------------------------------------------------- samples

# keys are non-negative int64; an empty slot holds the largest
EMPTY_KEY = (1 << 63) - 1
_MASK_63 = (1 << 63) - 1
_GOLDEN = 0x9E3779B97F4A7C15 - (1 << 64)  # as a signed int64
_MIX_1 = 0xBF58476D1CE4E5B9 - (1 << 64)
_MIX_2 = 0x94D049BB133111EB - (1 << 64)


def _mix_int(x: int) -> int:
    """splitmix64's finaliser on a Python int (mod 2^64, as a signed int64)."""
    x &= (1 << 64) - 1
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & ((1 << 64) - 1)
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & ((1 << 64) - 1)
    x ^= x >> 31
    return x - (1 << 64) if x >= 1 << 63 else x


def _shift_right(x: Tensor, bits: int) -> Tensor:
    """Logical right shift of int64 (torch's `>>` keeps the sign)."""
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def _mix(x: Tensor) -> Tensor:
    """splitmix64's finaliser, elementwise on int64 (multiplication wraps mod 2^64)."""
    x = (x ^ _shift_right(x, 30)) * _MIX_1
    x = (x ^ _shift_right(x, 27)) * _MIX_2
    return x ^ _shift_right(x, 31)


def entry_keys(seed: int, *coordinates: Tensor | int) -> Int[Tensor, "..."]:
    """A pseudo-random non-negative int64 key for every entry of the broadcast coordinates.

    The key is a hash (splitmix64 rounds) of the seed and the coordinates, in order, so it
    depends on what an entry is (e.g. document, layer, head, query, key) and on nothing else: the
    same on every rank, for every batching and every block of query rows. Integer coordinates
    (Python ints) are folded in on the host; tensors are mixed in the order given, the smallest
    first being cheapest.

    Args:
        seed: The seed.
        *coordinates: int64 tensors (broadcastable) or Python ints.

    Returns:
        Keys in `[0, 2^63 - 1)`, with the broadcast shape of the tensor coordinates.

    Examples:
        >>> import torch
        >>> a = entry_keys(0, 3, torch.arange(4))
        >>> bool((a == entry_keys(0, 3, torch.arange(4))).all()), len(set(a.tolist()))
        (True, 4)
    """
    state = _mix_int(int(seed) * 0x9E3779B97F4A7C15 + 0x632BE59BD9B4E019)
    key: Tensor | None = None
    for c in coordinates:
        if isinstance(c, Tensor):
            c = c if c.dtype == torch.int64 else c.to(torch.int64)
            key = _mix((c + state) * _GOLDEN) if key is None else _mix((key ^ c) * _GOLDEN)
        else:
            if key is not None:
                raise InputError("entry_keys: give the integer coordinates before the tensors.")
            state = _mix_int((state ^ int(c)) * 0x9E3779B97F4A7C15)
    if key is None:
        raise InputError("entry_keys needs at least one tensor coordinate.")
    return (key & _MASK_63).clamp_(max=EMPTY_KEY - 1)


class SampleReservoir:
    """Per group, the `capacity` rows with the smallest keys (`[group, capacity, column]`).

    `offer(keys, rows)` takes one block's candidates: a key per (group, candidate), with
    `EMPTY_KEY` where a candidate is not a valid row, and a function that gathers the rows of
    chosen candidates. It keeps, per group, the `capacity` smallest keys among those held and
    those offered (two `topk`s, whatever the number of candidates), in ascending key order, so
    a group's rows come in the same order whatever the order they were offered in. With keys from
    `entry_keys`, what is kept is a uniform random sample without replacement of every valid row
    offered, the same whatever the order, batching or sharding. Memory: `capacity * (8 + 4 *
    n_columns)` bytes per group.

    Args:
        n_groups: Groups (e.g. layer x head x kind of entry).
        capacity: Rows kept per group.
        columns: The names of the row's columns (float32).
        device: Where the reservoir lives.

    Examples:
        >>> import torch
        >>> reservoir = SampleReservoir(1, 2, ["x"])
        >>> keys = torch.tensor([[5, 1, EMPTY_KEY, 3]])
        >>> x = torch.tensor([[50.0, 10.0, 0.0, 30.0]])
        >>> reservoir.offer(keys, lambda idx: x.gather(1, idx)[..., None])
        >>> reservoir.table(0)
        tensor([[10.],
                [30.]])
    """

    def __init__(
        self,
        n_groups: int,
        capacity: int,
        columns: Sequence[str],
        *,
        device: torch.device | str = "cpu",
    ) -> None:
        if capacity < 1:
            raise InputError(f"capacity must be at least 1, got {capacity}.")
        self.capacity, self.columns = int(capacity), list(columns)
        with torch.inference_mode(False):
            self.keys = torch.full(
                (int(n_groups), self.capacity), EMPTY_KEY, dtype=torch.int64, device=device
            )
            self.rows = torch.zeros(
                (int(n_groups), self.capacity, len(self.columns)),
                dtype=torch.float32,
                device=device,
            )

    def offer(
        self,
        keys: Int[Tensor, "group candidate"],
        rows: Callable[[Int[Tensor, "group chosen"]], Float[Tensor, "group chosen column"]],
        groups: slice | Int[Tensor, " group"] = slice(None),
    ) -> None:
        """Offer one block's candidates to `groups` (all, or a slice or index of them).

        Args:
            keys: `[group, candidate]` keys, `EMPTY_KEY` for candidates that are not rows.
            rows: Given `[group, k]` candidate indices, their rows `[group, k, column]`.
            groups: The groups `keys` stands for, in order.
        """
        k = min(self.capacity, keys.shape[1])
        chosen_keys, chosen = keys.topk(k, dim=1, largest=False, sorted=False)
        offered = rows(chosen).to(torch.float32)
        both_keys = torch.cat([self.keys[groups], chosen_keys], 1)
        both_rows = torch.cat([self.rows[groups], offered], 1)
        kept_keys, kept = both_keys.topk(self.capacity, dim=1, largest=False, sorted=True)
        self.keys[groups] = kept_keys
        self.rows[groups] = both_rows.gather(1, kept[..., None].expand(-1, -1, len(self.columns)))

    def merge(self, other: SampleReservoir) -> None:
        """Keep the smallest keys of both.

        Args:
            other: Another shard's reservoir of the same groups.
        """
        if other.keys.shape != self.keys.shape or other.columns != self.columns:
            raise InputError("Cannot merge sample reservoirs of different groups or columns.")
        rows = other.rows.to(self.rows.device)
        self.offer(other.keys.to(self.keys.device), lambda idx: rows.gather(1, _expand(idx, rows)))

    def all_reduce(self) -> None:
        """Every rank's rows merged in place (gathered with `all_gather`)."""
        dist = process_group()
        if dist is None:
            return
        world = dist.get_world_size()
        keys = [torch.empty_like(self.keys) for _ in range(world)]
        rows = [torch.empty_like(self.rows) for _ in range(world)]
        dist.all_gather(keys, self.keys)
        dist.all_gather(rows, self.rows)
        all_keys, all_rows = torch.cat(keys, 1), torch.cat(rows, 1)
        kept_keys, kept = all_keys.topk(self.capacity, dim=1, largest=False, sorted=True)
        self.keys, self.rows = kept_keys, all_rows.gather(1, _expand(kept, all_rows))

    def to_host(self) -> SampleReservoir:
        """Move the reservoir to the CPU, in place.

        Returns:
            This reservoir.
        """
        self.keys, self.rows = self.keys.cpu(), self.rows.cpu()
        return self

    def held(self) -> Bool[Tensor, "group capacity"]:
        """Which slots hold a row.

        Returns:
            `[group, capacity]` booleans.
        """
        return self.keys != EMPTY_KEY

    def table(self, group: int) -> Float[Tensor, "row column"]:
        """The rows kept for one group, in key order.

        Args:
            group: The group.

        Returns:
            `[row, column]`.
        """
        order = self.keys[group].argsort()
        held = self.keys[group][order] != EMPTY_KEY
        return self.rows[group][order][held]


def _expand(index: Tensor, rows: Tensor) -> Tensor:
    return index[..., None].expand(-1, -1, rows.shape[-1])


# --------------------------------------------------------------------------- accumulators

Part = StackedSums | Histogram | SampleReservoir


class Accumulator:
    """The base of a corpus accumulator: what the stream feeds, and how shards combine.

    A subclass sets `name` (the key of its result in `corpus_analyses`), `layers` (the layers it
    reads: the stream hands it no other) and `need_logits`, and implements `update(block)` (one
    layer's `LayerContributionsResult`, one block of query rows, inside the forward pass),
    `update_logits(batch, logits)` if it reads the logits, and `finish(stats)`, which builds the
    result from the merged state (it may run further passes of its own). `merge` and `all_reduce`
    combine every building block it holds as an attribute (`StackedSums`, `Histogram`,
    `SampleReservoir`, or a list or dict of them), in the order they were set.
    """

    name: str = ""
    layers: list[int]
    need_logits: bool = False

    def parts(self) -> Iterator[tuple[str, Part]]:
        """The building blocks held, by attribute name, in the order they were set.

        Yields:
            `(attribute, building block)` pairs.

        Examples:
            ```python
            import cw_lens
            from cw_lens.data.streaming import stream_corpus

            model = cw_lens.load_model("testing:tiny-llama")
            texts = ["The cat sat on the mat.", "Heads look at BOS, mostly."]
            first = cw_lens.HeadTaxonomyAccumulator(model, texts[:1])
            second = cw_lens.HeadTaxonomyAccumulator(model, texts[1:])
            stats, _ = stream_corpus(model, texts[:1], [first])  # update(block) per block
            more, _ = stream_corpus(model, texts[1:], [second])
            first.merge(second)  # what all_reduce() does across torchrun ranks
            stats.merge(more)
            [name for name, _ in first.parts()]  # ['sums']
            first.finish(stats).regime_shares()
            ```
        """
        for attribute, value in vars(self).items():
            if isinstance(value, Part):
                yield attribute, value
            elif isinstance(value, dict):
                for key, part in value.items():
                    if isinstance(part, Part):
                        yield f"{attribute}[{key!r}]", part
            elif isinstance(value, list | tuple):
                for i, part in enumerate(value):
                    if isinstance(part, Part):
                        yield f"{attribute}[{i}]", part

    def update(self, block: Any) -> None:
        """Fold one layer's block of query rows into the state.

        Args:
            block: One layer's `LayerContributionsResult`, a view valid during this call only
                (its `detach_copy()` keeps it).

        Examples:
            ```python
            import cw_lens
            from cw_lens.data.streaming import stream_corpus

            model = cw_lens.load_model("testing:tiny-llama")
            texts = ["The cat sat on the mat.", "Heads look at BOS, mostly."]
            first = cw_lens.HeadTaxonomyAccumulator(model, texts[:1])
            second = cw_lens.HeadTaxonomyAccumulator(model, texts[1:])
            stats, _ = stream_corpus(model, texts[:1], [first])  # update(block) per block
            more, _ = stream_corpus(model, texts[1:], [second])
            first.merge(second)  # what all_reduce() does across torchrun ranks
            stats.merge(more)
            [name for name, _ in first.parts()]  # ['sums']
            first.finish(stats).regime_shares()
            ```
        """
        raise NotImplementedError(f"{type(self).__name__} must implement update(block).")

    def update_logits(self, batch: Any, logits: Tensor) -> None:
        """Fold one document batch's logits (only when `need_logits`).

        Args:
            batch: The `TokenBatch`.
            logits: Its logits `[batch, pos, vocab]`.

        Examples:
            ```python
            import cw_lens
            from cw_lens.data.streaming import stream_corpus

            model = cw_lens.load_model("testing:tiny-llama")
            texts = ["The cat sat on the mat.", "Heads look at BOS, mostly."]
            first = cw_lens.SinkAblationAccumulator(model, texts[:1])
            second = cw_lens.SinkAblationAccumulator(model, texts[1:])
            stats, _ = stream_corpus(model, texts[:1], [first])  # update(block) per block
            more, _ = stream_corpus(model, texts[1:], [second])
            first.merge(second)  # what all_reduce() does across torchrun ranks
            stats.merge(more)
            [name for name, _ in first.parts()]
            first.finish(stats).summary()  # the clean NLL came from update_logits
            ```
        """
        raise NotImplementedError(f"{type(self).__name__} reads no logits.")

    def merge(self, other: Accumulator) -> None:
        """Add another shard's state (the same accumulator, fed other documents).

        Args:
            other: An accumulator of the same type and options.

        Examples:
            ```python
            import cw_lens
            from cw_lens.data.streaming import stream_corpus

            model = cw_lens.load_model("testing:tiny-llama")
            texts = ["The cat sat on the mat.", "Heads look at BOS, mostly."]
            first = cw_lens.HeadTaxonomyAccumulator(model, texts[:1])
            second = cw_lens.HeadTaxonomyAccumulator(model, texts[1:])
            stats, _ = stream_corpus(model, texts[:1], [first])  # update(block) per block
            more, _ = stream_corpus(model, texts[1:], [second])
            first.merge(second)  # what all_reduce() does across torchrun ranks
            stats.merge(more)
            [name for name, _ in first.parts()]  # ['sums']
            first.finish(stats).regime_shares()
            ```
        """
        theirs = dict(other.parts())
        for attribute, part in self.parts():
            part.merge(theirs[attribute])

    def all_reduce(self) -> None:
        """Combine every torchrun rank's state in place, with collectives (every rank calls it).

        Outside a process group of 2+ ranks it does nothing; `merge` is its one-process form.

        Examples:
            ```python
            import cw_lens
            from cw_lens.data.streaming import stream_corpus

            model = cw_lens.load_model("testing:tiny-llama")
            texts = ["The cat sat on the mat.", "Heads look at BOS, mostly."]
            first = cw_lens.HeadTaxonomyAccumulator(model, texts[:1])
            second = cw_lens.HeadTaxonomyAccumulator(model, texts[1:])
            stats, _ = stream_corpus(model, texts[:1], [first])  # update(block) per block
            more, _ = stream_corpus(model, texts[1:], [second])
            first.merge(second)  # what all_reduce() does across torchrun ranks
            stats.merge(more)
            [name for name, _ in first.parts()]  # ['sums']
            first.finish(stats).regime_shares()
            ```
        """
        for _, part in self.parts():
            part.all_reduce()

    def finish(self, stats: Any) -> Any:
        """The analysis's result from the merged state.

        Args:
            stats: The pass's `StreamStats`.

        Returns:
            The analysis's result.

        Examples:
            ```python
            import cw_lens
            from cw_lens.data.streaming import stream_corpus

            model = cw_lens.load_model("testing:tiny-llama")
            texts = ["The cat sat on the mat.", "Heads look at BOS, mostly."]
            first = cw_lens.HeadTaxonomyAccumulator(model, texts[:1])
            second = cw_lens.HeadTaxonomyAccumulator(model, texts[1:])
            stats, _ = stream_corpus(model, texts[:1], [first])  # update(block) per block
            more, _ = stream_corpus(model, texts[1:], [second])
            first.merge(second)  # what all_reduce() does across torchrun ranks
            stats.merge(more)
            [name for name, _ in first.parts()]  # ['sums']
            first.finish(stats).regime_shares()
            ```
        """
        raise NotImplementedError(f"{type(self).__name__} must implement finish(stats).")
