"""Memory known before the pass: what a result will take, checked against a budget.

An analysis that returns a `[batch, layer, head, query, key]` tensor
([`contribution_weights`][cw_lens.contribution_weights],
[`residual_shares`][cw_lens.residual_shares], the clean and patched runs of
[`compare_sink_patch`][cw_lens.compare_sink_patch]) estimates its result's size from the shapes
alone and, above the budget, raises [`MemoryBudgetError`][cw_lens.MemoryBudgetError] before any
forward pass, naming the size and the ways out: fewer `layers=` or `heads=`, shorter or fewer
texts, the streaming consumers ([`stream_contributions`][cw_lens.stream_contributions],
[`stream_shares`][cw_lens.stream_shares]) or the corpus analyses, whose memory is flat in the
number of documents.

The budget, in this order:

1. the analysis's `memory_budget=` argument;
2. the environment variable `CW_LENS_MEMORY_BUDGET`;
3. half the memory available on the result's device: `torch.cuda.mem_get_info` on a CUDA
   device; `MemAvailable` in `/proc/meminfo` on Linux, else `psutil.virtual_memory().available`
   when `psutil` is installed, else the free physical pages (`os.sysconf`). Where none of these
   answers (a device type other than CPU and CUDA, say), there is no default limit.

A budget is a number of bytes (`8e9`) or a string with a decimal or binary unit (`"8GB"`,
`"512 MiB"`, `"1.5GiB"`); `"none"` (or `math.inf`) turns the check off.

Examples:
    >>> from cw_lens.core.memory import parse_bytes, pair_field_bytes
    >>> parse_bytes("1.5GiB"), parse_bytes("8GB"), parse_bytes(2e9)
    (1610612736.0, 8000000000.0, 2000000000.0)
    >>> pair_field_bytes(1, 30, 9, 512, pair_fields=6, row_fields=3) / 1e9  # GB
    1.700352
"""

from __future__ import annotations

import math
import os
import re
import sys
from collections.abc import Sequence

import numpy as np
import torch
from torch import Tensor

from cw_lens.core.errors import InputError, MemoryBudgetError

MEMORY_ENV = "CW_LENS_MEMORY_BUDGET"
DEFAULT_SHARE = 0.5  # of the memory available on the device, when no budget is given
_UNITS = {
    "": 1, "b": 1, "kb": 1e3, "mb": 1e6, "gb": 1e9, "tb": 1e12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}  # fmt: skip
_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*([a-z]*)\s*$")


def parse_bytes(value: float | int | str) -> float:
    """A memory size in bytes from a number or a string with a unit.

    Args:
        value: Bytes (`8e9`), or a string such as `"8GB"`, `"512 MiB"`, `"1.5GiB"`
            (decimal `kB`/`MB`/`GB`/`TB`, binary `KiB`/`MiB`/`GiB`/`TiB`, case-insensitive);
            `"none"`, `"inf"` or `math.inf` for no limit.

    Returns:
        The size in bytes (`math.inf` for no limit).

    Raises:
        InputError: The value is negative or not a size.

    Examples:
        >>> from cw_lens.core.memory import parse_bytes
        >>> parse_bytes("512 MiB")
        536870912.0
    """
    if isinstance(value, str):
        text = value.strip().lower()
        if text in ("none", "inf", "unlimited"):
            return math.inf
        match = _SIZE.match(text)
        if match is None or match.group(2) not in _UNITS:
            raise InputError(
                f"A memory budget must be bytes or a size such as '8GB' or '512MiB'; got {value!r}."
            )
        size = float(match.group(1)) * _UNITS[match.group(2)]
    elif isinstance(value, int | float) and not isinstance(value, bool):
        size = float(value)
    else:
        raise InputError(f"A memory budget must be a number of bytes or a string; got {value!r}.")
    if not size >= 0:
        raise InputError(f"A memory budget cannot be negative; got {value!r}.")
    return size


def format_bytes(nbytes: float) -> str:
    """A size for a message: `"12.3 GB"`, `"512 MB"`, `"57.6 kB"`, `"12 bytes"`.

    Args:
        nbytes: The size in bytes.

    Returns:
        The size with a decimal unit and three significant digits.

    Examples:
        >>> from cw_lens.core.memory import format_bytes
        >>> format_bytes(1.23e10), format_bytes(57_600)
        ('12.3 GB', '57.6 kB')
    """
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if nbytes >= scale:
            return f"{nbytes / scale:.3g} {unit}"
    return f"{nbytes:.0f} bytes"


def available_memory(device: torch.device | str | None = None) -> int | None:
    """The memory available to new allocations on `device`, in bytes (`None` if unknown).

    Args:
        device: A CUDA device (free memory from `torch.cuda.mem_get_info`) or the CPU (Linux
            `MemAvailable`, else `psutil`, else the free physical pages).

    Returns:
        Bytes, or `None` where no source answers.

    Examples:
        >>> from cw_lens.core.memory import available_memory
        >>> available_memory("cpu") > 0
        True
    """
    device = torch.device(device or "cpu")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            return None
        free, _ = torch.cuda.mem_get_info(device)
        return int(free)
    if device.type != "cpu":
        return None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        import psutil

        return int(psutil.virtual_memory().available)
    except ImportError:
        pass
    try:
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return None


def memory_budget(
    device: torch.device | str | None = None, budget: float | int | str | None = None
) -> tuple[float, str]:
    """The budget in bytes and where it comes from (see the module docstring).

    Args:
        device: The device the result will be on.
        budget: An explicit budget (the analysis's `memory_budget=`), or `None`.

    Returns:
        `(bytes, source)`: `math.inf` when there is no limit; `source` says which rule set it.

    Examples:
        >>> from cw_lens.core.memory import memory_budget
        >>> memory_budget("cpu", "2GB")
        (2000000000.0, 'memory_budget=2GB')
    """
    if budget is not None:
        return parse_bytes(budget), f"memory_budget={budget}"
    env = os.environ.get(MEMORY_ENV, "").strip()
    if env:
        return parse_bytes(env), f"${MEMORY_ENV}={env}"
    free = available_memory(device)
    if free is None:
        return math.inf, "no limit (the available memory is unknown)"
    share = f"{DEFAULT_SHARE:.0%}"
    return DEFAULT_SHARE * free, f"{share} of the {format_bytes(free)} available on {device}"


def pair_field_bytes(
    n_batch: int,
    n_layers: int,
    n_heads: int,
    n_pos: int,
    *,
    pair_fields: int,
    row_fields: int = 0,
    itemsize: int = 4,
) -> int:
    """Bytes of `pair_fields` tensors `[batch, layer, head, query, key]` and `row_fields`
    tensors `[batch, layer, head, pos]` of `itemsize`-byte elements.

    Args:
        n_batch: Texts.
        n_layers: Layers.
        n_heads: Heads per layer.
        n_pos: Positions per text.
        pair_fields: Tensors with a query and a key axis.
        row_fields: Tensors with one position axis.
        itemsize: Bytes per element (4 for float32).

    Returns:
        The total size in bytes.

    Examples:
        >>> from cw_lens.core.memory import pair_field_bytes
        >>> pair_field_bytes(2, 1, 4, 8, pair_fields=1)
        2048
    """
    per_head = pair_fields * n_pos * n_pos + row_fields * n_pos
    return n_batch * n_layers * n_heads * per_head * itemsize


def check_memory(
    nbytes: float,
    *,
    device: torch.device | str | None,
    budget: float | int | str | None,
    what: str,
    ways_out: Sequence[str],
) -> None:
    """Raise [`MemoryBudgetError`][cw_lens.MemoryBudgetError] when `nbytes` exceed the budget.

    Args:
        nbytes: What the result will take.
        device: Where it will be.
        budget: The analysis's `memory_budget=` argument (`None`: the environment variable,
            else half the available memory).
        what: The result, as the message names it.
        ways_out: What to do instead, one phrase each.

    Examples:
        >>> from cw_lens.core.memory import check_memory
        >>> check_memory(1e6, device="cpu", budget="1GB", what="x", ways_out=["y"])
    """
    limit, source = memory_budget(device, budget)
    if nbytes <= limit:
        return
    raise MemoryBudgetError(
        f"{what} would take {format_bytes(nbytes)}, over the memory budget of "
        f"{format_bytes(limit)} ({source}); nothing was run. Ways out: "
        + "; ".join(ways_out)
        + f". To allow it, pass memory_budget= (bytes or a size like '64GB', 'none' for no "
        f"limit) or set ${MEMORY_ENV}."
    )


def state_bytes(obj: object) -> int:
    """Bytes an accumulator holds: tensors and arrays by their storage, other objects by
    `sys.getsizeof`, followed through attributes and containers (each object counted once).

    Used by the tests to check that accumulator state does not grow with the corpus.

    Args:
        obj: The accumulator (any object).

    Returns:
        The bytes.
    """
    seen: set[int] = set()

    def walk(x: object) -> int:
        if isinstance(x, (str, bytes, int, float, bool)):  # shared singletons: count each use
            return sys.getsizeof(x)
        if id(x) in seen or x is None or isinstance(x, type):
            return 0
        seen.add(id(x))
        if isinstance(x, Tensor):
            return x.untyped_storage().nbytes()
        if isinstance(x, np.ndarray):
            return int(x.nbytes if x.base is None else walk(x.base))
        if isinstance(x, dict):
            return sys.getsizeof(x) + sum(walk(k) + walk(v) for k, v in x.items())
        if isinstance(x, (list, tuple, set, frozenset)):
            return sys.getsizeof(x) + sum(walk(v) for v in x)
        if callable(x) and not hasattr(x, "__dict__"):
            return 0
        if hasattr(x, "__dict__"):  # attributes (an instance dict's size is CPython's detail)
            return sys.getsizeof(x) + sum(walk(v) for v in vars(x).values())
        return sys.getsizeof(x)

    return walk(obj)
