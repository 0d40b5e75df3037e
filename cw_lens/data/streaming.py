"""Streaming a corpus through the model, one layer and one block of query rows at a time.

[`stream_contributions`][cw_lens.stream_contributions] runs the forward passes (document batches)
and hands each requested layer's [`LayerContributionsResult`][cw_lens.LayerContributionsResult] —
one block of query rows at a time — to a consumer *inside* the pass; nothing outlives a layer, so
memory is flat in depth and corpus size. `stream_corpus` is the corpus driver every analysis uses:
one pass feeds any set of accumulators (`cw_lens.core.accumulators`) and, under `torchrun`, shards
the document batches over ranks and reduces the accumulators with collectives.

The public functions' docstrings have runnable examples.
"""

from __future__ import annotations

import math
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor
from tqdm.auto import tqdm

from cw_lens.core.errors import InputError
from cw_lens.core.keywords import check_keywords
from cw_lens.data.distributed import current_shard
from cw_lens.data.inputs import TokenBatch, iter_batches, prepare_inputs
from cw_lens.models.access import Model
from cw_lens.models.capture import (
    LayerActivations,
    LayerWeights,
    resolve_heads,
    resolve_layers,
    run_layers,
)
from cw_lens.models.layer_contributions import KINDS, LayerContributionsResult, Workspace
from cw_lens.models.verify import require_verified

# Bytes the streamed query blocks may use. A fixed number, not a share of the momentary free
# memory: the block plan changes the float rounding of per-block reductions, so a plan that
# followed MemAvailable would make results depend on what else the machine was doing in their
# last bits, and could differ between torchrun ranks. 1.5 GB is the cap
# the old rule (a tenth of MemAvailable) reached on any machine with 15 GB free: the plan every
# benchmark in docs/benchmarks.md used. Batches of 8 x 256 tokens use 4 blocks of 65 rows
# under any budget above 48 MB (causality caps them); an 8,192-token window uses 17 blocks.
BLOCK_BUDGET_BYTES = 1.5e9


# The fewest blocks of query rows a batch is cut into, by device type (others: 1). Each block
# repeats every per-block operation of the capture and of each analysis, and saves the share of
# the `query x key` work that causality makes zero (`(1 - 1/blocks) / 2`). On a CPU the
# arithmetic is the cost: the embedded model's sink statistics on 16 windows of 256 tokens took
# 20-23 s with 4 blocks and 41-47 s with one. On an accelerator every operation is a kernel
# launch, which costs about as much as the element-wise work of a block at these sizes, so a
# batch is cut only where memory requires it.
CAUSAL_BLOCKS: dict[str, int] = {"cpu": 4}


def auto_query_chunk(
    n_batch: int,
    n_heads: int,
    n_keys: int,
    budget_bytes: float = BLOCK_BUDGET_BYTES,
    temporaries: int = 10,
    min_blocks: int | None = None,
    *,
    device_type: str = "cpu",
) -> int:
    """Query rows per block: a function of the batch shape and the device type alone (no
    free-memory probe).

    At most what lets `temporaries` float32 `[batch, head, rows, keys]` tensors fit in
    `budget_bytes` (`BLOCK_BUDGET_BYTES`, 1.5 GB), and at most `n_keys / min_blocks`:
    block `b` only needs the keys up to its last row, so `min_blocks` blocks skip about
    `(1 - 1/min_blocks) / 2` of the `query x key` work that causality makes zero. At least
    32 rows (and never more than `n_keys`). `min_blocks` defaults to `CAUSAL_BLOCKS` of the
    device type: 4 on a CPU, 1 (blocks only for memory) on an accelerator.

    Args:
        n_batch: Documents in the batch.
        n_heads: Query heads.
        n_keys: Positions of the batch (its keys, and its query rows).
        budget_bytes: Bytes the block temporaries may use.
        temporaries: How many float32 `[batch, head, rows, keys]` tensors a block holds.
        min_blocks: The fewest blocks; `None`: `CAUSAL_BLOCKS` of `device_type`.
        device_type: The device type of the activations (`"cpu"`, `"cuda"`, ...).

    Returns:
        Query rows per block.

    Examples:
        >>> auto_query_chunk(8, 9, 256), auto_query_chunk(8, 9, 256, device_type="cuda")
        (64, 256)
    """
    if min_blocks is None:
        min_blocks = CAUSAL_BLOCKS.get(device_type, 1)
    per_row = n_batch * n_heads * n_keys * 4 * temporaries
    by_memory = int(budget_bytes // max(per_row, 1))
    by_causality = math.ceil(n_keys / min_blocks)
    return min(n_keys, max(32, min(by_memory, by_causality)))


@dataclass
class StreamStats:
    """What a streaming run saw: documents, tokens, and NaN rows per kind."""

    n_documents: int = 0
    n_tokens: int = 0
    n_nan_rows: dict[str, int] = field(default_factory=lambda: {k: 0 for k in KINDS})

    def count(self, batch: TokenBatch) -> None:
        """Count a streamed document batch."""
        self.n_documents += batch.tokens.shape[0]
        self.n_tokens += int(batch.mask.sum())

    def all_reduce(self) -> None:
        """Sum every torchrun rank's counts in place (a no-op outside a process group)."""
        if current_shard() is None:
            return
        import torch
        import torch.distributed as dist

        kinds = sorted(self.n_nan_rows)
        counts = [self.n_documents, self.n_tokens, *(self.n_nan_rows[k] for k in kinds)]
        total = torch.tensor(counts, dtype=torch.int64, device="cpu")
        dist.all_reduce(total)
        self.n_documents, self.n_tokens, *nan = total.tolist()
        self.n_nan_rows = dict(zip(kinds, nan, strict=True))

    def merge(self, other: StreamStats) -> None:
        self.n_documents += other.n_documents
        self.n_tokens += other.n_tokens
        for kind, n in other.n_nan_rows.items():
            self.n_nan_rows[kind] = self.n_nan_rows.get(kind, 0) + n


def check_query_chunk(query_chunk: Any) -> None:
    """`query_chunk` must be a positive integer or `None` (automatic)."""
    if query_chunk is not None and (
        isinstance(query_chunk, bool) or not isinstance(query_chunk, int) or query_chunk < 1
    ):
        raise InputError(f"query_chunk must be a positive integer or None, got {query_chunk!r}.")


def document_batches(
    model: Any,
    prepared: TokenBatch,
    batch_size: int | None,
    query_chunk: int | None,
    n_heads: int,
    *,
    shard: tuple[int, int] | None = None,
    progress: bool | str = False,
) -> Iterator[tuple[TokenBatch, int]]:
    """The document batches of a prepared input (this rank's share under `shard`), each with
    its query rows per block (`query_chunk`, or `auto_query_chunk`)."""
    batches = list(iter_batches(prepared, batch_size))
    if shard is not None:
        rank, world = shard
        batches = batches[rank::world]
    label = progress if isinstance(progress, str) else None
    kind = torch.device(getattr(model.cfg, "device", None) or "cpu").type
    for batch in tqdm(batches, desc=label, disable=not progress, leave=False):
        n_batch, n_pos = batch.tokens.shape
        yield batch, query_chunk or auto_query_chunk(n_batch, n_heads, n_pos, device_type=kind)


def query_blocks(n_pos: int, chunk: int) -> Iterator[slice]:
    """Consecutive blocks of at most `chunk` query rows covering `0 .. n_pos - 1`."""
    for start in range(0, n_pos, chunk):
        yield slice(start, min(n_pos, start + chunk))


def run_batches(
    model: Any,
    prepared: TokenBatch,
    run_pass: Callable[..., Tensor | None],
    on_rows: Callable[[Any, slice, dict[str, Any]], None],
    stats: StreamStats,
    *,
    layers: Sequence[int],
    n_heads: int,
    batch_size: int | None,
    query_chunk: int | None,
    fwd_hooks: Sequence | Callable[[TokenBatch], Sequence],
    on_logits: Callable[[TokenBatch, Tensor], None] | None,
    shard: tuple[int, int] | None = None,
    progress: bool | str = False,
) -> None:
    """The document-batch loop of the streams: one forward pass a batch (`run_pass`:
    `run_layers` or `run_blocks`),
    and for each layer's activations `on_rows(acts, rows, shared)` once per block of query
    rows (`shared`: a dict per layer and batch, for what the blocks of a layer share).

    `fwd_hooks` may be a function of the batch; `on_logits` (if given) gets `(batch,
    logits)` after each pass; `stats` counts every batch. Layer weights are cached across
    the batches.
    """
    weights: dict[int, LayerWeights] = {}
    for batch, chunk in document_batches(
        model, prepared, batch_size, query_chunk, n_heads, shard=shard, progress=progress
    ):

        def on_acts(acts: Any, n_pos: int = batch.tokens.shape[1], chunk: int = chunk) -> None:
            shared: dict[str, Any] = {}
            for rows in query_blocks(n_pos, chunk):
                on_rows(acts, rows, shared)

        logits = run_pass(
            model,
            batch,
            on_acts,
            layers=layers,
            fwd_hooks=fwd_hooks(batch) if callable(fwd_hooks) else fwd_hooks,
            need_logits=on_logits is not None,
            weights=weights,
        )
        if on_logits is not None:
            on_logits(batch, logits)
        stats.count(batch)


@check_keywords
def stream_contributions(
    model: Model,
    inputs: Any,
    consumer: Callable[[LayerContributionsResult], None],
    *,
    layers: int | Sequence[int] | None = None,
    heads: int | Sequence[int] | None = None,
    query_chunk: int | None = None,
    batch_size: int | None = 8,
    prepend_bos: bool = True,
    attention_mask: Tensor | None = None,
    fwd_hooks: Sequence[tuple[str, Callable]] | Callable[[TokenBatch], Sequence] = (),
    on_logits: Callable[[TokenBatch, Tensor], None] | None = None,
    progress: bool = True,
    count_nan: Sequence[str] = (),
    reuse_buffers: bool = False,
    shard: tuple[int, int] | None = None,
) -> StreamStats:
    """Stream one layer (and one block of query rows) at a time to `consumer`.

    The consumer is called inside the forward pass with a
    [`LayerContributionsResult`][cw_lens.LayerContributionsResult]; it should fold what it needs
    into a small accumulator (a kept block holds its layer's activations). By default each block
    owns what it computes: a block or a field kept from the call stays valid after the stream has
    moved on. With `reuse_buffers=True` the block is a view (`block.is_view`) whose fields live
    in buffers the next block overwrites, valid only during the call: keep
    `block.detach_copy()` instead (a view read after a later block has begun raises
    [`InputError`][cw_lens.InputError]; a tensor taken from it is not guarded: `.clone()` it).

    Args:
        model: A `TransformerBridge`.
        inputs: A string, a list of strings, token ids (a tensor `[pos]` or `[batch, pos]`, or a
            list of token-id lists, read as given) or a [`Corpus`][cw_lens.Corpus].
        consumer: Called once per (document batch, layer, query block).
        layers: Layers to analyse (`None` = all).
        heads: Query heads to analyse (`None` = all; negative indices count from the end:
            `-1` is the last head).
        query_chunk: Query rows per block; `None` picks one from the batch shape
            (`auto_query_chunk`, a fixed 1.5 GB budget).
        batch_size: Documents per forward pass (`None` = all at once).
        prepend_bos: Prepend BOS to text inputs.
        attention_mask: Mask for token-tensor inputs with padding.
        fwd_hooks: Interventions active during the passes: hook pairs, or a function of the
            document batch that returns them (for interventions that need the batch's mask).
        on_logits: If given, the passes run to the end and this gets `(batch, logits)`.
        progress: Show a tqdm bar over document batches.
        count_nan: Kinds (`"intra"`/`"inter"`) whose zero-norm rows to count and warn about.
        reuse_buffers: Hand the consumer views: one buffer per field, reused by every block
            (no allocation per block; the block and its tensors are valid only during the call,
            see above). `False` (the default): every block allocates its own fields.
        shard: `(rank, world)`: process only document batches `rank, rank + world, ...` of
            the batch plan (the plan itself is the same on every rank).

    Returns:
        A `StreamStats`: the number of blocks and documents, and the NaN rows counted.

    Examples:
        ```python
        import cw_lens

        model = cw_lens.load_model("testing:tiny-llama")

        def consumer(block):  # called inside the forward pass, once per block
            print(block.layer, block.weights("inter").shape)

        cw_lens.stream_contributions(model, "The cat sat on the mat.", consumer)
        ```
    """
    # Long: mostly the argument checks and the plan of query blocks; the pass itself is run_layers.
    require_verified(model)
    if not callable(consumer):
        raise InputError(
            "consumer must be a function of one LayerContributionsResult, got "
            f"{type(consumer).__name__}."
        )
    check_query_chunk(query_chunk)
    layer_list = resolve_layers(model, layers)
    head_list = None if heads is None else resolve_heads(model, heads)
    prepared = prepare_inputs(model, inputs, prepend_bos=prepend_bos, attention_mask=attention_mask)
    stats = StreamStats()
    workspace = Workspace(reuse=reuse_buffers)
    n_heads = len(head_list or range(model.cfg.n_heads))
    # the analyses' stream_corpus passes its bar's label as `progress` (not a public option)
    label = progress if isinstance(progress, str) else "contributions"

    def on_rows(acts: LayerActivations, rows: slice, shared: dict[str, Any]) -> None:
        lc = LayerContributionsResult(acts, head_list, rows, shared, workspace)
        for kind in count_nan:
            stats.n_nan_rows[kind] += lc.n_zero_rows(kind)
        consumer(lc)

    run_batches(
        model,
        prepared,
        run_layers,
        on_rows,
        stats,
        layers=layer_list,
        n_heads=n_heads,
        batch_size=batch_size,
        query_chunk=query_chunk,
        fwd_hooks=fwd_hooks,
        on_logits=on_logits,
        shard=shard,
        progress=progress and label,
    )
    for kind in count_nan:
        if stats.n_nan_rows[kind]:
            warnings.warn(
                f"{stats.n_nan_rows[kind]} (layer, head, query) rows have a numerically zero "
                f"{kind}-head output norm; their contribution weights are NaN (undefined).",
                RuntimeWarning,
                stacklevel=2,
            )
    return stats


def stream_corpus(
    model: object,
    corpus: object,
    accumulators: Sequence[Any],
    *,
    batch_size: int | None = 8,
    prepend_bos: bool = True,
    fwd_hooks: Sequence | Callable = (),
    progress: bool | str = False,
    count_nan: Sequence[str] = (),
) -> tuple[StreamStats, list[float]]:
    """One streamed pass over a corpus that feeds every accumulator of `accumulators`.

    Each accumulator ([`Accumulator`][cw_lens.core.accumulators.Accumulator]: `layers`,
    `need_logits`, `update(block)`, `update_logits(batch, logits)`, `all_reduce()`) is handed
    the blocks of the layers it reads, in the order given, so what two of them both read (the
    attention, the per-head output norms) is computed once. The blocks are views
    (`reuse_buffers=True` of `stream_contributions`: no allocation or copy per block), valid
    only during `update`, which folds them into its sums. Under torchrun the document batches
    are sharded over the ranks and every accumulator is then reduced across them with
    collectives (`all_reduce`); the stats are summed likewise.

    Args:
        model: The model.
        corpus: The documents.
        accumulators: The accumulators to feed (at least one).
        batch_size: Documents per forward pass.
        prepend_bos: Whether BOS is prepended to text.
        fwd_hooks: Interventions active during the pass (as in `stream_contributions`).
        progress: The progress bar's label, or False.
        count_nan: Kinds whose zero-norm rows to count (as in `stream_contributions`).

    Returns:
        The pass's `StreamStats` (every rank's) and, per accumulator, the seconds its own
        calls took inside the pass (on an accelerator, only the work the host waited for).
    """
    accumulators = list(accumulators)
    if not accumulators:
        raise InputError("stream_corpus needs at least one accumulator to feed.")
    reads = [set(accumulator.layers) for accumulator in accumulators]
    seconds = [0.0] * len(accumulators)

    def consumer(block: LayerContributionsResult) -> None:
        for i, accumulator in enumerate(accumulators):
            if block.layer in reads[i]:
                began = time.perf_counter()
                accumulator.update(block)
                seconds[i] += time.perf_counter() - began

    def on_logits(batch: TokenBatch, logits: Tensor) -> None:
        for i, accumulator in enumerate(accumulators):
            if accumulator.need_logits:
                began = time.perf_counter()
                accumulator.update_logits(batch, logits)
                seconds[i] += time.perf_counter() - began

    stats = stream_contributions(
        model,
        corpus,
        consumer,
        layers=sorted(set().union(*reads)),
        batch_size=batch_size,
        prepend_bos=prepend_bos,
        fwd_hooks=fwd_hooks,
        on_logits=on_logits if any(a.need_logits for a in accumulators) else None,
        progress=progress,
        count_nan=count_nan,
        reuse_buffers=True,
        shard=current_shard(),
    )
    for accumulator in accumulators:
        accumulator.all_reduce()  # a no-op outside a process group of 2+ ranks
    stats.all_reduce()
    return stats, seconds
