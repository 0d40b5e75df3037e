"""Sharding corpus runs over `torchrun` ranks.

Under `torchrun --nproc-per-node N` (`RANK`/`WORLD_SIZE` set) every corpus analysis
shards its document batches round-robin over the ranks — the batch plan is computed from the
whole corpus on every rank, so each document is processed in exactly the batch it would be in
a single process — and then reduces its accumulators with `torch.distributed` collectives
(`cw_lens.core.accumulators`: float64 sums and integer counts are summed, sample reservoirs keep
the smallest keys of every rank's rows). Counts and samples equal a single process's exactly;
sums differ only by the order of addition (the last bits of a float64). The backend is gloo on
CPU, nccl on GPU.

Example (2 CPU processes):

    torchrun --nproc-per-node 2 -m cw_lens.reproduction.cli figures --out figures-ddp
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable, Iterator
from typing import Any

import torch


def init_from_env(device: str | None = None) -> tuple[int, int] | None:
    """Initialise the process group when launched by torchrun; return `(rank, world)`."""
    if "WORLD_SIZE" not in os.environ or int(os.environ["WORLD_SIZE"]) <= 1:
        return current_shard()
    import torch.distributed as dist

    if not dist.is_initialized():
        use_nccl = torch.cuda.is_available() and (device is None or str(device).startswith("cuda"))
        dist.init_process_group(backend="nccl" if use_nccl else "gloo")
        if use_nccl:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    return current_shard()


@contextlib.contextmanager
def process_group_from_env(device: str | None = None) -> Iterator[tuple[int, int] | None]:
    """`init_from_env` for the length of a `with` block.

    A process group this call creates is destroyed when the block ends, so that no gloo or
    nccl thread is still running while the interpreter shuts down (a group left alive is torn
    down with the interpreter, where gloo's threads can abort the process). A group that was
    already initialised, e.g. by the caller, is left as it was.

    Args:
        device: The job's device (`"cuda..."` picks nccl when CUDA is available).

    Yields:
        `(rank, world_size)` inside a process group of 2+ ranks, else None.
    """
    import torch.distributed as dist

    existed = not dist.is_available() or dist.is_initialized()
    shard = init_from_env(device)
    try:
        yield shard
    finally:
        if not existed and dist.is_initialized():
            dist.destroy_process_group()


def current_shard() -> tuple[int, int] | None:
    """`(rank, world_size)` inside an initialised process group of 2+ ranks, else None."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return dist.get_rank(), dist.get_world_size()
    return None


def is_main_process() -> bool:
    """Whether this process is rank 0: of the process group, or outside one, the rank torchrun
    started it as (`RANK`, read only when `WORLD_SIZE` > 1, as torchrun sets them), so a job's
    ranks still tell themselves apart once its group is destroyed.

    Returns:
        True for rank 0 and for a process that no torchrun started.
    """
    shard = current_shard()
    if shard is not None:
        return shard[0] == 0
    # torchrun's environment (both variables, as `init_from_env` reads it), nothing else's
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return True
    return int(os.environ.get("RANK", "0")) == 0


def merge_across_ranks(obj: Any) -> Any:
    """Gather `obj` (anything with `merge`) from every rank and merge in rank order."""
    shard = current_shard()
    if shard is None:
        return obj
    import torch.distributed as dist

    gathered: list[Any] = [None] * shard[1]
    dist.all_gather_object(gathered, obj)
    return merge_all(gathered)


def main_process_decides(flag: bool) -> bool:
    """Rank 0's `flag` on every rank (`flag` itself outside a process group).

    For choices every rank must make alike because collectives follow them — e.g. whether a step
    is loaded from disk or computed: a rank that checked a moment later could otherwise see a file
    rank 0 has just written, skip the step's collectives and deadlock the others.
    """
    if current_shard() is None:
        return flag
    import torch.distributed as dist

    box = [bool(flag)]
    dist.broadcast_object_list(box, src=0)
    return bool(box[0])


def barrier() -> None:
    if current_shard() is not None:
        import torch.distributed as dist

        dist.barrier()


def merge_all(items: Iterable) -> object:
    """Merge a sequence of accumulators of one type into the first (in order).

    Args:
        items: Accumulators with a `merge` method (at least one).

    Returns:
        The first, with the others merged into it.
    """
    items = list(items)
    first = items[0]
    for other in items[1:]:
        first.merge(other)
    return first
