"""Seeded hashes of sample rows: the keys by which `cw_lens.core.accumulate.SampleReservoir`
keeps its bottom-k sample.

A row's key is splitmix64's finaliser folded over the row's float32 bits, column by column,
from a start key that is a SHA-1 of `(seed, document, group)`: a function of the row and its
document alone, so a sample is the same however the documents were batched or sharded.

Examples:
    >>> import numpy as np
    >>> from cw_lens.core.row_hash import row_keys
    >>> rows = np.ones((2, 3), np.float32)
    >>> bool(row_keys(0, 5, "g", rows)[0] == row_keys(0, 5, "g", rows[:1])[0])
    True
"""

from __future__ import annotations

import hashlib

import numpy as np


def _mix(h: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser (uint64 arithmetic wraps around)."""
    h = (h ^ (h >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    h = (h ^ (h >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return h ^ (h >> np.uint64(31))


def _start_key(seed: int, doc: int, group: str) -> int:
    digest = hashlib.sha1(f"{seed}/{doc}/{group}".encode()).digest()
    return int.from_bytes(digest[:8], "little")


def row_keys(seed: int, doc: int, group: str, rows: np.ndarray) -> np.ndarray:
    """A uint64 hash per row of float32 `rows`, seeded by `(seed, doc, group)`: a function of
    the row and its document only.

    Args:
        seed: The reservoir's seed.
        doc: The rows' document.
        group: The rows' group (e.g. `"sink/3/0"`).
        rows: `[n, c]` float32 rows.

    Returns:
        `[n]` uint64 keys.
    """
    return _hash_rows(np.full(rows.shape[0], _start_key(seed, doc, group), np.uint64), rows)


def _hash_rows(h: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """Fold each row's float32 bits, column by column, into its start key `h`."""
    bits = np.ascontiguousarray(rows, dtype=np.float32).view(np.uint32).astype(np.uint64)
    for c in range(rows.shape[1]):
        h = _mix(h ^ (bits[:, c] | np.uint64(c << 32)))
    return h
