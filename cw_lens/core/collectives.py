"""The `torch.distributed` process group the corpus accumulators reduce across, when there is
one: under `torchrun` with two or more ranks, every building block of an accumulator sums (or
gathers) its state across the ranks; in one process it keeps its own.

Examples:
    >>> from cw_lens.core.collectives import process_group
    >>> process_group() is None  # one process
    True
"""

from __future__ import annotations

from typing import Any


def process_group() -> Any:
    """`torch.distributed` when a process group of 2+ ranks is up, else None.

    Returns:
        The `torch.distributed` module, or None outside a process group of 2+ ranks.
    """
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return dist
    return None
