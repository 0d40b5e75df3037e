r"""A run's bootstrap replicates of its claim numbers, and the test of a difference between runs.

`cw-lens figures` keeps, next to `summary.json`, `replicates.npz` (compressed): for each
headline number of each claim the `R` bootstrap replicates its interval was read from
(float32), each document's token-id hash, and per claim how many documents were resampled. The
replicate `r` of every number of a run comes from the same resample of documents (the
bootstrap's seeded index matrix depends only on its seed, `R` and the number of documents), so
two runs over the same documents with the same bootstrap seed and `R` have *paired*
replicates: replicate `r` of both resampled the same documents.

The difference `Δ = value_b - value_a` of one number between two runs is tested with its own
bootstrap distribution:

    paired       Δ_r = rep_b[r] - rep_a[r]                   (same documents, same resamples)
    independent  Δ_r = rep_b[r] - rep_a[π(r)],  π a seeded random permutation

and the 95% interval of the `Δ_r` (the expanded percentile interval, the method
the claims' intervals use), and the test's p-value (`difference_p_value`: the smallest level
at which that interval excludes 0), which `holm` adjusts for the many numbers a comparison
tests (`cw_lens.reproduction.run_comparison`). The one test's result is `"differ"` when the hull
of the point `Δ` and its interval excludes 0, `"same within uncertainty"` when it includes 0,
`"not comparable"` when either number is missing or not measured, a run kept no replicates
(summaries of schema 1 and 2), or `Δ` is undefined in more resamples than the interval's
tail. Pairing is used only when it is exact; otherwise the resamples are independent, which
overstates the spread of `Δ` when the two runs share documents (a conservative test).

Example:

    from cw_lens.reproduction.run_replicates import difference_test
    difference_test(0.5, reps_a, 0.8, reps_b, paired=False).result    # "differ" or ...
"""

from __future__ import annotations

import hashlib
import io
import json
import math
import zipfile
import zlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from scipy import stats

from cw_lens.core.errors import InputError
from cw_lens.reproduction.bootstrap import BIAS_SE_LIMIT as BIAS_SE_LIMIT  # re-exported
from cw_lens.reproduction.bootstrap import bias_to_se as bias_to_se  # re-exported
from cw_lens.reproduction.bootstrap import expanded_tail, quantiles

FILE = "replicates.npz"
FORMAT = 1
# the largest replicates file read (a paper run's is well under 1 MB)
MAX_BYTES = 256 << 20
CHUNK = 1 << 20  # the chunks it is hashed in
DIFFER, SAME, NOT_COMPARABLE = "differ", "same within uncertainty", "not comparable"
RESULTS = (DIFFER, SAME, NOT_COMPARABLE)


@dataclass
class RunReplicates:
    """What `replicates.npz` holds.

    Attributes:
        numbers: `{(claim, number): float32 [R]}`, NaN where a resample left it undefined.
        documents: Each document's token-id hash, in the run's order.
        documents_per_claim: How many documents each claim resampled.
        bootstrap: The bootstrap's `resamples` and `seed`.
        claim_documents: For a claim resampling a sample of the documents (the causal
            claims), the positions in `documents` of that sample, in order; a claim not
            listed (and every claim of a file written without this record) resampled the
            first `documents_per_claim[claim]` documents.
    """

    numbers: dict[tuple[str, str], np.ndarray]
    documents: list[str]
    documents_per_claim: dict[str, int]
    bootstrap: dict[str, Any] = field(default_factory=dict)
    claim_documents: dict[str, list[int]] = field(default_factory=dict)

    def resampled(self, claim: str) -> list[str]:
        """The token-id hashes of the documents `claim` resampled, in order.

        Args:
            claim: A claim id.

        Returns:
            Their hashes (empty when the file records no count for `claim`).
        """
        positions = self.claim_documents.get(claim)
        if positions is not None:
            return [self.documents[i] for i in positions]
        return self.documents[: self.documents_per_claim.get(claim) or 0]

    def pairs_with(self, other: RunReplicates, claim: str) -> bool:
        """True when replicate r of `claim`'s numbers resampled the same documents in both
        runs: same bootstrap seed and resamples, same documents (hash by hash, in order)."""
        n, m = self.documents_per_claim.get(claim), other.documents_per_claim.get(claim)
        same_boot = all(
            self.bootstrap.get(k) == other.bootstrap.get(k) is not None
            for k in ("seed", "resamples")
        )
        return bool(n and n == m and same_boot and self.resampled(claim) == other.resampled(claim))


def pack(
    numbers: Mapping[tuple[str, str], Any],
    documents: list[str],
    documents_per_claim: Mapping[str, int],
    bootstrap: Mapping[str, Any],
    claim_documents: Mapping[str, list[int]] | None = None,
) -> bytes:
    """`replicates.npz`'s bytes (compressed, no pickled objects).

    Args:
        numbers: `{(claim, number): replicates}`.
        documents: Each document's token-id hash, in the run's order.
        documents_per_claim: How many documents each claim resampled.
        bootstrap: The bootstrap's record (its `resamples` and `seed` are kept).
        claim_documents: The positions in `documents` of the sample a claim resampled, for
            the claims that resampled a sample rather than the first documents.

    Returns:
        The file's bytes.
    """
    meta = {
        "format": FORMAT,
        "numbers": [list(key) for key in numbers],
        "documents_per_claim": dict(documents_per_claim),
        "bootstrap": {k: bootstrap[k] for k in ("resamples", "seed")},
    }
    if claim_documents:
        meta["claim_documents"] = {c: [int(i) for i in p] for c, p in claim_documents.items()}
    arrays = {
        f"n{i}": np.asarray(v, dtype=np.float32).reshape(-1) for i, v in enumerate(numbers.values())
    }
    buffer = io.BytesIO()
    np.savez_compressed(
        buffer, meta=np.array(json.dumps(meta)), documents=np.array(documents, dtype=str), **arrays
    )
    return buffer.getvalue()


def read_checked(path: Path, sha256: str | None, size: int | None = None) -> bytes:
    """The bytes of `path`, refused before they are read when its size (from the file system)
    is over `MAX_BYTES` or is not `size`, and when its SHA-256, computed while the file is
    streamed in chunks, is not `sha256` (not checked when None). Only then is it read whole,
    and those bytes checked again (the file may change between the two reads).

    Args:
        path: The file.
        sha256: Its expected SHA-256 (hex), or None.
        size: Its expected size in bytes, or None.

    Returns:
        Its bytes.

    Raises:
        InputError: when its size or hash is not the one expected, or it cannot be read.
    """
    mismatch = InputError(
        f"{path} does not belong to the summary.json beside it (its SHA-256 differs from the "
        "one the summary records); rerun `cw-lens figures` into that folder."
    )
    try:
        found = path.stat().st_size
        if found > MAX_BYTES or (size is not None and found != size):
            expected = f"{size} bytes" if size is not None else f"at most {MAX_BYTES} bytes"
            raise InputError(
                f"{path} is {found} bytes; its summary's replicates file is {expected}. It was "
                "not read: rerun `cw-lens figures` into that folder."
            )
        with open(path, "rb") as f:
            if sha256 is not None:
                streamed = hashlib.sha256()
                while chunk := f.read(CHUNK):
                    streamed.update(chunk)
                if streamed.hexdigest() != sha256:
                    raise mismatch
                f.seek(0)
            data, more = f.read(found), f.read(1)  # the size it had (`read` allocates that)
    except OSError as exc:
        raise InputError(f"{path} cannot be read ({exc}).") from None
    if more:
        raise InputError(f"{path} grew while it was read; read it again when it is written.")
    if sha256 is not None and hashlib.sha256(data).hexdigest() != sha256:
        raise mismatch  # it changed after it was checked
    return data


def unpack(path: Path, sha256: str | None, size: int | None = None) -> RunReplicates:
    """Read `replicates.npz`, checked before anything is parsed (`read_checked`).

    Args:
        path: The file.
        sha256: The summary's record of its SHA-256 (None: not checked): it must match, so
            that a file left by another run is never read as this run's.
        size: The summary's record of its size in bytes (None: not checked).

    Returns:
        What it holds.

    Raises:
        InputError: when it is not the file the summary records, or not a replicates file.
    """
    data = read_checked(path, sha256, size)
    try:
        with np.load(io.BytesIO(data), allow_pickle=False) as npz:
            meta = json.loads(str(npz["meta"]))
            arrays = [npz[f"n{i}"] for i in range(len(meta["numbers"]))]
            documents = [str(d) for d in npz["documents"]]
        return _checked(meta, arrays, documents)
    except InputError as exc:
        raise InputError(f"{path} is not a cw_lens replicates file ({exc}).") from None
    except (ValueError, KeyError, OSError, EOFError, TypeError, IndexError, AttributeError,
            RecursionError, zipfile.BadZipFile, zlib.error) as exc:  # fmt: skip
        raise InputError(
            f"{path} is not a cw_lens replicates file ({type(exc).__name__}: {str(exc)[:200]})."
        ) from None


def _checked(meta: Any, arrays: list[np.ndarray], documents: list[str]) -> RunReplicates:
    """The file's contents, every entry of the kind `pack` writes (else an `InputError`)."""

    def count(value: Any) -> bool:
        return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 1 << 63

    if not isinstance(meta, dict):
        raise InputError("its record is not an object")
    keys = meta["numbers"]
    if not all(
        isinstance(k, list) and len(k) == 2 and all(isinstance(x, str) for x in k) for k in keys
    ):
        raise InputError("its numbers are not (claim, number) names")
    if not all(a.ndim == 1 and a.dtype.kind == "f" for a in arrays):
        raise InputError("its replicates are not one-dimensional float arrays")
    per_claim = meta["documents_per_claim"]
    if not isinstance(per_claim, dict) or not all(count(n) for n in per_claim.values()):
        raise InputError("its document counts are not counts")
    bootstrap = meta["bootstrap"]
    if not isinstance(bootstrap, dict) or not all(
        count(bootstrap[k]) for k in ("resamples", "seed")
    ):
        raise InputError("its bootstrap record is not a count of resamples and a seed")
    claim_documents = meta.get("claim_documents", {})  # absent from files written before it
    if not isinstance(claim_documents, dict) or not all(
        isinstance(p, list) and all(count(i) and i < len(documents) for i in p)
        for p in claim_documents.values()
    ):
        raise InputError("its documents per claim are not positions of its documents")
    numbers = {(c, n): a for (c, n), a in zip(keys, arrays, strict=True)}
    return RunReplicates(numbers, documents, per_claim, bootstrap, claim_documents)


@dataclass(frozen=True)
class Difference:
    """`value_b - value_a` of one number with its bootstrap interval, the result of the one
    test, and its p-value (`difference_p_value`; NaN when not comparable)."""

    value: float
    low: float
    high: float
    paired: bool
    result: str
    reason: str
    p_value: float = math.nan
    bias_corrected: bool = False


def bias_corrected(value: float, replicates: np.ndarray) -> tuple[float, np.ndarray]:
    """A number and its replicates corrected for the bootstrap's bias estimate.

    Args:
        value: The point value `t`.
        replicates: Its bootstrap replicates `t*`.

    Returns:
        The corrected point `t - b` and replicates `t* - 2 b` (`b = mean(t*) - t`): the
        replicates the `bias_corrected` interval reads (`cw_lens.reproduction.bootstrap`), centred
        on the corrected point.

    Examples:
        >>> import numpy as np
        >>> point, reps = bias_corrected(1.0, np.array([1.1, 1.3]))
        >>> round(point, 3), reps.round(3).tolist()
        (0.8, [0.7, 0.9])
    """
    x = np.asarray(replicates, np.float64)
    b = float(np.nanmean(x)) - value
    return value - b, x - 2 * b


def difference_p_value(diff: np.ndarray, delta: float, n_documents: int | None) -> float:
    """The two-sided p-value of the difference test: the smallest `1 - level` at which the
    test's interval (the hull of `delta` and the expanded percentile interval of the `diff`
    replicates for `n_documents`; the plain percentile one when None) excludes 0.

    Args:
        diff: The difference's bootstrap replicates (NaN where undefined).
        delta: The point difference.
        n_documents: The documents the interval is expanded for (the smaller run's), or
            None for the percentile interval.

    Returns:
        The p-value in `[0, 1]`.

    `s = (k + 1) / (R + 1)`, `k` of the `R` replicates on the other side of 0 from `delta`
    (undefined ones counted there too) — the Monte Carlo estimate of that share that is never
    0 (Davison & Hinkley 1997, eq. 4.11), since `R` replicates cannot show a tail thinner than
    about `1 / R`; the expanded interval at level `1 - a` excludes 0 when `s < Phi(sqrt(D/(D-1))
    t_{a/2, D-1})`, so `p = 2 T_{D-1}(Phi^-1(s) / sqrt(D/(D-1)))` (`T` Student's t CDF);
    `p = 2 s` for the percentile interval. 1 when `delta` is 0 or NaN.

    Examples:
        >>> import numpy as np
        >>> round(difference_p_value(np.linspace(-1.0, 3.0, 1999), 1.0, None), 3)
        0.501
    """
    if math.isnan(delta) or delta == 0:
        return 1.0
    x = np.asarray(diff, np.float64)
    across = np.isnan(x) | ((x <= 0) if delta > 0 else (x >= 0))
    s = (float(across.sum()) + 1) / (len(x) + 1)
    if n_documents is None:
        return min(1.0, 2 * s)
    if n_documents < 2:
        return 1.0
    widen = math.sqrt(n_documents / (n_documents - 1))
    return min(1.0, float(2 * stats.t.cdf(stats.norm.ppf(s) / widen, n_documents - 1)))


def holm(p_values: Any) -> np.ndarray:
    """Holm's step-down adjustment of p-values for the family-wise error.

    With the `m` defined p-values sorted, `p~_(i) = max_{j <= i} min(1, (m - j + 1) p_(j))`;
    rejecting where `p~ < a` controls the family-wise error at `a` in the strong sense, for
    any dependence between the tests.

    Args:
        p_values: The raw p-values (array-like; NaN for a test not made).

    Returns:
        The adjusted p-values in the same order (NaN stays NaN and does not count in `m`).

    Examples:
        >>> holm([0.01, 0.04, 0.03, 0.005]).round(3).tolist()
        [0.03, 0.06, 0.06, 0.02]
    """
    p = np.asarray(p_values, np.float64).reshape(-1)
    out = np.full(p.shape, np.nan)
    defined = np.flatnonzero(~np.isnan(p))
    m = len(defined)
    if m == 0:
        return out
    order = defined[np.argsort(p[defined], kind="stable")]
    steps = (m - np.arange(m)) * p[order]
    out[order] = np.minimum(1.0, np.maximum.accumulate(steps))
    return out


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
    """The test of `value_b - value_a` (module docstring). `paired` only when replicate r
    of both resampled the same documents (`RunReplicates.pairs_with`). The interval is
    the claims' expanded percentile interval (`cw_lens.reproduction.bootstrap.expanded_tail`) for
    `n_documents` (the smaller run's documents); the plain percentile one when it is None."""
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
    q = torch.tensor([tail, 1 - tail], dtype=torch.float64, device=x.device)
    low, high = quantiles(x, q[0], q[1]).tolist()
    if math.isnan(tail) or undefined > tail:
        low = high = math.nan
    if math.isnan(low) or math.isnan(high):
        return not_comparable("the difference is undefined in too many resamples")
    lo, hi = min(low, delta), max(high, delta)
    p = difference_p_value(diff, delta, n_documents)
    if lo > 0 or hi < 0:
        return Difference(delta, low, high, paired, DIFFER, "the interval excludes 0", p)
    return Difference(delta, low, high, paired, SAME, "the interval includes 0", p)
