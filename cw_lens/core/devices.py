"""Devices: every tensor cw_lens makes names where it goes.

A factory call without `device=` (`torch.zeros(n)`, `torch.tensor(rows)`,
`torch.as_tensor(mask)`) puts its tensor on PyTorch's *default* device: the CPU, unless the user
called `torch.set_default_device("cuda")`; and `torch.as_tensor` then moves even a tensor that
was somewhere else. cw_lens therefore names the device of every tensor it creates: the device of
the inputs it is computed with, or the CPU for what is kept there (accumulated statistics,
results, token ids, seeded random draws). `tests/test_device.py` runs the analyses under a
`TorchFunctionMode` that records any factory call from cw_lens that names no device, and
`tests/test_layout.py` checks the source for them.

Examples:
    >>> import torch
    >>> from cw_lens.core.devices import to_tensor
    >>> to_tensor([1, 2]).device, to_tensor(torch.ones(2, device="meta")).device
    (device(type='cpu'), device(type='meta'))
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor


def to_tensor(value: Any, *, dtype: torch.dtype | None = None) -> Tensor:
    """`value` as a tensor: a tensor stays on its device, anything else goes to the CPU
    (never to the default device).

    Args:
        value: A tensor, or anything `torch.as_tensor` takes (lists, numpy arrays, numbers).
        dtype: The dtype (default: the value's own).

    Returns:
        The tensor (the same object when `value` already is one of that dtype).

    Examples:
        >>> from cw_lens.core.devices import to_tensor
        >>> to_tensor([0.5, 1.0]).tolist()
        [0.5, 1.0]
    """
    device = value.device if isinstance(value, Tensor) else "cpu"
    return torch.as_tensor(value, dtype=dtype, device=device)
