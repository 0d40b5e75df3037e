r"""A run's bootstrap replicates of its claim numbers, and the test of a difference between runs.

``cw-lens figures`` keeps, next to ``summary.json``, ``replicates.npz`` (compressed): for each
headline number of each claim the ``R`` bootstrap replicates its interval was read from
(float32), each document's token-id hash, and per claim how many documents were resampled. The
replicate ``r`` of every number of a run comes from the same resample of documents (the
bootstrap's seeded index matrix depends only on its seed, ``R`` and the number of documents), so
two runs over the same documents with the same bootstrap seed and ``R`` have *paired*
replicates: replicate ``r`` of both resampled the same documents.

The difference ``Δ = value_b - value_a`` of one number between two runs is tested with its own
bootstrap distribution::

    paired       Δ_r = rep_b[r] - rep_a[r]                   (same documents, same resamples)
    independent  Δ_r = rep_b[r] - rep_a[π(r)],  π a seeded random permutation

and the 95% interval of the ``Δ_r`` (the expanded percentile interval, the method
the claims' intervals use). The result is ``"differ"`` when the hull of the point ``Δ`` and its
interval excludes 0, ``"same within uncertainty"`` when it includes 0, ``"not comparable"`` when
either number is missing or not measured, a run kept no replicates (summaries of schema 1 and
2), or ``Δ`` is undefined in more resamples than the interval's tail. Pairing is used only when
it is exact; otherwise the resamples are independent, which overstates the spread of ``Δ`` when
the two runs share documents (a conservative test).

Example::

    from cw_lens.core.replicates import difference_test
    difference_test(0.5, reps_a, 0.8, reps_b, paired=False).result    # "differ" or ...
"""

from __future__ import annotations

import hashlib
import io
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from cw_lens.core.bootstrap import expanded_tail, quantiles
from cw_lens.core.errors import InputError

FILE = "replicates.npz"
FORMAT = 1
DIFFER, SAME, NOT_COMPARABLE = "differ", "same within uncertainty", "not comparable"
RESULTS = (DIFFER, SAME, NOT_COMPARABLE)


@dataclass
class RunReplicates:
    """What ``replicates.npz`` holds.

    Attributes:
        numbers: ``{(claim, number): float32 [R]}``, NaN where a resample left it undefined.
        documents: Each document's token-id hash, in the run's order.
        documents_per_claim: How many of the first documents each claim resampled.
        bootstrap: The bootstrap's ``resamples`` and ``seed``.
    """

    numbers: dict[tuple[str, str], np.ndarray]
    documents: list[str]
    documents_per_claim: dict[str, int]
    bootstrap: dict[str, Any] = field(default_factory=dict)

    def pairs_with(self, other: RunReplicates, claim: str) -> bool:
        """True when replicate r of ``claim``'s numbers resampled the same documents in both
        runs: same bootstrap seed and resamples, same documents (hash by hash, in order)."""
        n, m = self.documents_per_claim.get(claim), other.documents_per_claim.get(claim)
        same_boot = all(
            self.bootstrap.get(k) == other.bootstrap.get(k) is not None
            for k in ("seed", "resamples")
        )
        return bool(n and n == m and same_boot and self.documents[:n] == other.documents[:n])


def pack(
    numbers: Mapping[tuple[str, str], Any],
    documents: list[str],
    documents_per_claim: Mapping[str, int],
    bootstrap: Mapping[str, Any],
) -> bytes:
    """``replicates.npz``'s bytes (compressed, no pickled objects)."""
    meta = {
        "format": FORMAT,
        "numbers": [list(key) for key in numbers],
        "documents_per_claim": dict(documents_per_claim),
        "bootstrap": {k: bootstrap[k] for k in ("resamples", "seed")},
    }
    arrays = {
        f"n{i}": np.asarray(v, dtype=np.float32).reshape(-1) for i, v in enumerate(numbers.values())
    }
    buffer = io.BytesIO()
    np.savez_compressed(
        buffer, meta=np.array(json.dumps(meta)), documents=np.array(documents, dtype=str), **arrays
    )
    return buffer.getvalue()


def unpack(path: Path, sha256: str | None) -> RunReplicates:
    """Read ``replicates.npz``; ``sha256`` (the summary's record of it) must match, so that a
    file left by another run is never read as this run's."""
    data = path.read_bytes()
    if sha256 is not None and hashlib.sha256(data).hexdigest() != sha256:
        raise InputError(
            f"{path} does not belong to the summary.json beside it (its SHA-256 differs from "
            "the one the summary records); rerun `cw-lens figures` into that folder."
        )
    try:
        with np.load(io.BytesIO(data), allow_pickle=False) as npz:
            meta = json.loads(str(npz["meta"]))
            arrays = [npz[f"n{i}"] for i in range(len(meta["numbers"]))]
            documents = [str(d) for d in npz["documents"]]
    except (ValueError, KeyError, OSError) as exc:
        raise InputError(f"{path} is not a cw_lens replicates file ({exc}).") from None
    numbers = {(c, n): a for (c, n), a in zip(meta["numbers"], arrays, strict=True)}
    return RunReplicates(numbers, documents, meta["documents_per_claim"], meta["bootstrap"])


@dataclass(frozen=True)
class Difference:
    """``value_b - value_a`` of one number with its bootstrap interval and the result."""

    value: float
    low: float
    high: float
    paired: bool
    result: str
    reason: str


def difference_test(
    value_a: float,
    reps_a: np.ndarray | None,
    value_b: float,
    reps_b: np.ndarray | None,
    *,
    paired: bool,
    n_documents: int | None = None,
    level: float = 0.95,
    seed: int = 0,
) -> Difference:
    """The test of ``value_b - value_a`` (module docstring). ``paired`` only when replicate r
    of both resampled the same documents (:meth:`RunReplicates.pairs_with`). The interval is
    the claims' expanded percentile interval (:func:`cw_lens.core.bootstrap.expanded_tail`) for
    ``n_documents`` (the smaller run's documents); the plain percentile one when it is None."""
    delta = value_b - value_a

    def not_comparable(reason: str) -> Difference:
        return Difference(delta, math.nan, math.nan, paired, NOT_COMPARABLE, reason)

    if math.isnan(value_a) or math.isnan(value_b):
        return not_comparable("not measured in a run")
    if reps_a is None or reps_b is None:
        return not_comparable("a run kept no bootstrap replicates")
    a, b = np.asarray(reps_a, np.float64), np.asarray(reps_b, np.float64)
    if paired:
        if len(a) != len(b):
            raise InputError(f"paired replicates differ in length ({len(a)} vs {len(b)}).")
        diff = b - a
    else:
        n = min(len(a), len(b))
        order = np.random.default_rng(seed).permutation(len(a))[:n]
        diff = b[:n] - a[order]
    tail = (1 - level) / 2 if n_documents is None else expanded_tail(level, n_documents)
    x = torch.from_numpy(diff)
    undefined = float(x.isnan().double().mean())
    q = torch.tensor([tail, 1 - tail], dtype=torch.float64)
    low, high = quantiles(x, q[0], q[1]).tolist()
    if math.isnan(tail) or undefined > tail:
        low = high = math.nan
    if math.isnan(low) or math.isnan(high):
        return not_comparable("the difference is undefined in too many resamples")
    lo, hi = min(low, delta), max(high, delta)
    if lo > 0 or hi < 0:
        return Difference(delta, low, high, paired, DIFFER, "the interval excludes 0")
    return Difference(delta, low, high, paired, SAME, "the interval includes 0")
