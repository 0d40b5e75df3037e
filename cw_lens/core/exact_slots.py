"""Named slots of exact limbs: the storage behind `cw_lens.core.accumulate.ExactSums`.

Each named sum owns a slot, a run of numbers in one array of integer limbs (`cw_lens.core.exact`)
that grows by doubling as names arrive. Values reach the limbs from a buffer (`_flush`), and the
limbs are carried every `exact.CARRY_EVERY` additions so that they never overflow (`_fold`).
What is stored or sent between ranks is the limbs alone (`__getstate__`): the buffer is folded
in first, and only the sums and limb columns in use are kept (`exact.pack`).
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from cw_lens.core import exact
from cw_lens.core.errors import InputError


class ExactSlots:
    """The limbs of named sums and the buffer folded into them; a base of `ExactSums`.

    `ExactSums.__init__` sets the state: `_slots` (name -> offset and shape), `_size`, `_limbs`
    and `_special` (`exact.zeros`), the buffer `_values` / `_index` with `_n_buffered` numbers
    in it, `_since_carry` and the cache `_totals`.
    """

    def _slot(self, name: str, shape: tuple[int, ...]) -> int:
        if name in self._slots:
            offset, known = self._slots[name]
            if known != shape:
                raise InputError(f"Sum {name!r} has shape {known}; cannot add shape {shape}.")
            return offset
        numel = int(np.prod(shape, dtype=np.int64))
        if self._size + numel > self._limbs.shape[0]:  # grow by doubling (names come early)
            capacity = max(2 * self._limbs.shape[0], self._size + numel, 64)
            with torch.inference_mode(False):  # state outlives the (inference-mode) passes
                limbs, special = exact.zeros(capacity)
            limbs[: self._size] = self._limbs[: self._size]
            special[: self._size] = self._special[: self._size]
            self._limbs, self._special = limbs, special
        self._slots[name] = (self._size, shape)
        self._size += numel
        return self._size - numel

    def _fold(self, values: Tensor, index: Tensor) -> None:
        if self._since_carry + values.numel() >= exact.CARRY_EVERY:
            exact.carry(self._limbs)
            self._since_carry = 0
        exact.add(self._limbs, self._special, values, index)
        self._since_carry += values.numel()

    def _flush(self) -> None:
        if self._n_buffered:
            n, self._n_buffered = self._n_buffered, 0
            self._fold(self._values[:n].to("cpu"), self._index[:n].to("cpu"))

    def __getstate__(self) -> dict:
        self._flush()  # what travels between ranks is the limbs alone, not the buffer
        state = dict(self.__dict__)
        state.update(_totals={}, _values=None, _index=None)
        state.pop("_index_rows", None)  # a cache of the buffer's index rows
        # the sums in use only, and of their limbs only the columns in use (`exact.pack`; not
        # carried: a carried negative sum fills every column above its own)
        limbs, special = state.pop("_limbs"), state.pop("_special")
        state["_packed"] = exact.pack(limbs[: self._size], special[: self._size])
        return state

    def __setstate__(self, state: dict) -> None:
        state = dict(state)
        packed = state.pop("_packed", None)
        self.__dict__.update(state)
        if packed is not None:
            self._limbs, self._special = exact.unpack(packed, self._size)
