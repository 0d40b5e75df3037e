"""Bottom-k buffers by group: the storage behind `cw_lens.core.accumulate.SampleReservoir`.

Each group's rows, their keys and their documents live in buffers of `2 * capacity` rows,
allocated once. Rows offered to a full buffer first shrink it to the `capacity` rows of smallest
key (ties: by the rows' values), in place (`_shrink`); the rows held are read back in key order
(`_held`). What is stored or sent between ranks is the rows held, not the buffers
(`__getstate__`); a stored state is offered again on loading (`__setstate__`), documents of
states stored before they were kept read as -1.
"""

from __future__ import annotations

import numpy as np
import torch

from cw_lens.core import exact


class BottomKBuffers:
    """Per-group buffers keeping the `capacity` rows of smallest key; a base of
    `SampleReservoir`.

    `SampleReservoir.__init__` sets `columns`, `capacity` and the per-group state: `_rows`
    (`[2 capacity, n_columns]` float32), `_keys` (uint64), `_docs` (int64) and `_n` (rows held).
    """

    def _offer(self, group: str, rows: np.ndarray, keys: np.ndarray, docs: np.ndarray) -> None:
        if group not in self._rows:
            self._rows[group] = np.empty((2 * self.capacity, len(self.columns)), np.float32)
            self._keys[group] = np.empty(2 * self.capacity, np.uint64)
            self._docs[group] = np.empty(2 * self.capacity, np.int64)
            self._n[group] = 0
        for start in range(0, len(rows), self.capacity):
            part = slice(start, start + self.capacity)
            n, m = self._n[group], len(rows[part])
            if n + m > 2 * self.capacity:
                n = self._shrink(group)
            self._rows[group][n : n + m] = rows[part]
            self._keys[group][n : n + m] = keys[part]
            self._docs[group][n : n + m] = docs[part]
            self._n[group] = n + m

    def _shrink(self, group: str) -> int:
        """Keep the `capacity` smallest (key, row) in place; returns the rows held."""
        n, k = self._n[group], self.capacity
        if n > k:
            rows, keys, docs = self._rows[group][:n], self._keys[group][:n], self._docs[group][:n]
            kth = np.partition(keys, k - 1)[k - 1]
            below = np.flatnonzero(keys < kth)
            tied = np.flatnonzero(keys == kth)  # practically one row: order ties by value
            tied = tied[np.lexsort(rows[tied].T[::-1])][: k - len(below)]
            keep = np.concatenate([below, tied])
            self._rows[group][:k], self._keys[group][:k] = rows[keep], keys[keep]
            self._docs[group][:k] = docs[keep]
            self._n[group] = k
        return self._n[group]

    def _held(self, group: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The kept rows, keys and documents of `group`, ordered by key then values."""
        if group not in self._rows:
            empty = np.zeros((0, len(self.columns)), np.float32)
            return empty, np.zeros(0, np.uint64), np.zeros(0, np.int64)
        n = self._shrink(group)
        rows, keys, docs = self._rows[group][:n], self._keys[group][:n], self._docs[group][:n]
        order = np.lexsort((*rows.T[::-1], keys))
        return rows[order], keys[order], docs[order]

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)  # what travels between ranks: the kept rows, not the buffer
        held = {g: self._held(g) for g in self._rows}
        state.update(
            _rows={g: r for g, (r, _, _) in held.items()},
            _keys={g: k for g, (_, k, _) in held.items()},
            # documents in the narrowest integer dtype (`exact.narrowest`; `_offer` widens them)
            _docs={
                g: exact.narrowest(torch.from_numpy(d)).numpy() for g, (_, _, d) in held.items()
            },
        )
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        old = state.get("_docs") or {}  # absent in states stored before documents were kept
        kept = {
            g: (self._rows[g], self._keys[g], old.get(g, np.full(len(self._keys[g]), -1, np.int64)))
            for g in self._rows
        }
        self._rows, self._keys, self._docs, self._n = {}, {}, {}, {}
        for group, (rows, keys, docs) in kept.items():
            self._offer(group, rows, keys, docs)
