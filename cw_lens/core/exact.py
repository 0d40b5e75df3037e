r"""Exact, order-independent sums of float64 values (integer fixed point over the float64 range).

Every finite float64 `x` is an integer multiple of `2^-1074` (the smallest subnormal), so
`x = n 2^-1074` with an integer `n` of at most 2,098 bits. Adding the integers is exact, and
integer addition is associative: the sum is the same, bit for bit, whatever the order and
grouping of the additions — a corpus split over `torchrun` ranks, batches or query blocks in
any way gives the same total. The total is rounded to float64 once, correctly (round half to
even), by Python's exact `int / int` division.

Representation: per summed element, `N_LIMBS` int64 limbs of `LIMB_BITS` = 32 bits,
`n = sum_k limb_k 2^(32 k)`. Adding a float64 scatters its 53-bit significand into three
consecutive limbs; `carry` moves what exceeds 32 bits into the next limb (needed only
every `2^29` additions, well before an int64 limb could overflow). NaN and infinities are
counted apart (`[n, 3]`: NaN, +inf, -inf) and rule the total as IEEE addition would.
Size: `N_LIMBS * 8 + 24` = 568 bytes per summed element, whatever the number of additions.

Example:

    from cw_lens.core import exact
    limbs, special = exact.zeros(1)
    values = torch.tensor([1e16, 1.0, -1e16], dtype=torch.float64)
    exact.add(limbs, special, values, torch.zeros(3, dtype=torch.long))
    exact.to_float(limbs, special)    # tensor([1.]); values.sum() gives 0.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from jaxtyping import Float, Int
from torch import Tensor

from cw_lens.core.errors import InputError

LIMB_BITS = 32
OFFSET = 1074  # x = n * 2^-OFFSET
# 1074 + 1024 = 2098 bits for any finite float64, two limbs more of headroom for sums
N_LIMBS = (OFFSET + 1024) // LIMB_BITS + 3
LIMB = 1 << LIMB_BITS
# each addition moves a limb by less than 2^33: carry before 2^29 additions can reach 2^62
CARRY_EVERY = 1 << 29
SPECIALS = ("nan", "+inf", "-inf")


def zeros(n: int) -> tuple[Tensor, Tensor]:
    """Limbs `[n, N_LIMBS]` and special counts `[n, 3]` of `n` zero sums."""
    return torch.zeros(n, N_LIMBS, dtype=torch.int64, device="cpu"), torch.zeros(
        n, 3, dtype=torch.int64, device="cpu"
    )


def add(
    limbs: Int[Tensor, "n limb"],
    special: Int[Tensor, "n 3"],
    values: Float[Tensor, " m"],
    index: Int[Tensor, " m"],
) -> None:
    """Add `values[i]` to sum `index[i]`, exactly and in place (any order gives the same)."""
    values = values.to(torch.float64).reshape(-1)
    index = index.reshape(-1)
    finite = torch.isfinite(values)
    if not bool(finite.all()):
        for k, bad in enumerate((values.isnan(), values == math.inf, values == -math.inf)):
            special[:, k].index_add_(0, index[bad], torch.ones_like(index[bad]))
        values, index = values[finite], index[finite]
    nonzero = values != 0
    values, index = values[nonzero], index[nonzero]
    if values.numel() == 0:
        return
    mantissa, exponent = torch.frexp(values)  # values = mantissa 2^exponent, |mantissa| in [.5, 1)
    significand = (mantissa * 2.0**53).long()  # exact: |mantissa| < 1 has 53 bits
    shift = exponent.long() - 53 + OFFSET  # values = significand 2^(shift - OFFSET)
    sign, a = significand.sign(), significand.abs()
    # subnormals: the significand ends in (-shift) zero bits, so this division is exact
    a = torch.bitwise_right_shift(a, (-shift).clamp_min(0))
    shift = shift.clamp_min(0)
    limb, bit = shift // LIMB_BITS, shift % LIMB_BITS
    lo = torch.bitwise_left_shift(a % LIMB, bit)  # < 2^63
    hi = torch.bitwise_left_shift(a // LIMB, bit)  # < 2^53
    parts = (lo % LIMB, lo // LIMB + hi % LIMB, hi // LIMB)
    flat = limbs.view(-1)
    base = index * N_LIMBS + limb
    for j, part in enumerate(parts):
        flat.index_add_(0, base + j, sign * part)


def carry(limbs: Int[Tensor, "n limb"]) -> None:
    """Normalise in place: limbs `0 .. N_LIMBS - 2` in `[0, 2^32)`, the top limb signed."""
    for j in range(N_LIMBS - 1):
        over = torch.div(limbs[:, j], LIMB, rounding_mode="floor")
        limbs[:, j] -= over * LIMB
        limbs[:, j + 1] += over


def to_int(limbs: Int[Tensor, "n limb"]) -> list[int]:
    """The exact integers `n` (sum `= n 2^-1074`) of every row."""
    limbs = limbs.clone()
    carry(limbs)
    low = limbs[:, :-1].numpy().astype("<u4")
    top = limbs[:, -1].tolist()
    shift = LIMB_BITS * (N_LIMBS - 1)
    return [int.from_bytes(low[r].tobytes(), "little") + (top[r] << shift) for r in range(len(top))]


def to_float(limbs: Int[Tensor, "n limb"], special: Int[Tensor, "n 3"]) -> Float[Tensor, " n"]:
    """The correctly rounded float64 of every sum (NaN/inf as IEEE addition would give)."""
    scale = 1 << OFFSET
    out = []
    for n, (nan, pos, neg) in zip(to_int(limbs), special.tolist(), strict=True):
        if nan or (pos and neg):
            out.append(math.nan)
        elif pos or neg:
            out.append(math.inf if pos else -math.inf)
        else:
            try:
                out.append(n / scale)  # int / int: correctly rounded
            except OverflowError:
                out.append(math.inf if n > 0 else -math.inf)  # beyond float64
    return torch.tensor(out, dtype=torch.float64, device="cpu")


# --------------------------------------------------------------------------- stored form


_WHOLE = (torch.int8, torch.int16, torch.int32, torch.int64)


def narrowest(counts: Int[Tensor, "..."]) -> Int[Tensor, "..."]:
    """Whole numbers in the narrowest signed integer dtype that holds them all (lossless): what
    a file stores of counts and limbs, most of which are small or zero.

    Args:
        counts: Integer values.

    Returns:
        The same values as int8, int16, int32 or int64.
    """
    if counts.numel() == 0:
        return counts.to(torch.int8)
    low, high = int(counts.min()), int(counts.max())
    for dtype in (torch.int8, torch.int16, torch.int32):
        info = torch.iinfo(dtype)
        if info.min <= low and high <= info.max:
            return counts.to(dtype)
    return counts.to(torch.int64)


def pack(limbs: Int[Tensor, "n limb"], special: Int[Tensor, "n 3"]) -> dict:
    """The stored form of `n` sums: only the limb columns that hold a nonzero limb in some
    row (a run's sums span a few of the `N_LIMBS`), each array in its narrowest dtype.

    Args:
        limbs: The sums' limbs.
        special: Their NaN / +inf / -inf counts.

    Returns:
        `{"first": first stored column, "limbs": [n, width], "special": [n, 3]}`, which
        `unpack` turns back into exactly `limbs` and `special`.
    """
    used = (limbs != 0).any(0).nonzero().flatten()
    first, last = (int(used[0]), int(used[-1]) + 1) if used.numel() else (0, 0)
    return {
        "first": first,
        "limbs": narrowest(limbs[:, first:last]).clone(),
        "special": narrowest(special).clone(),
    }


def unpack(packed: Any, n: int) -> tuple[Tensor, Tensor]:
    """Limbs `[n, N_LIMBS]` and special counts `[n, 3]` from `pack`'s stored form, checked
    (a file's content is not trusted: a wrong shape, dtype or column is an `InputError`).

    Args:
        packed: What `pack` returned, as read from a file.
        n: The number of sums the state says it holds.

    Returns:
        The limbs and the special counts, int64.

    Raises:
        InputError: When the stored form does not describe `n` sums.
    """

    def whole(t: Any) -> bool:
        return isinstance(t, Tensor) and t.dim() == 2 and t.dtype in _WHOLE

    if not (isinstance(packed, dict) and set(packed) == {"first", "limbs", "special"}):
        raise InputError("The file's exact sums are damaged: their stored form is not readable.")
    stored, special, first = packed["limbs"], packed["special"], packed["first"]
    if not (whole(stored) and whole(special) and type(first) is int):
        raise InputError("The file's exact sums are damaged: their limbs are not whole numbers.")
    if stored.shape[0] != n or tuple(special.shape) != (n, 3):
        raise InputError("The file's exact sums are damaged: their limbs do not match their names.")
    if not 0 <= first <= N_LIMBS - stored.shape[1]:
        raise InputError("The file's exact sums are damaged: their limb columns are out of range.")
    limbs, counts = zeros(n)
    limbs[:, first : first + stored.shape[1]] = stored.to(torch.int64)
    counts[:] = special.to(torch.int64)
    return limbs, counts
