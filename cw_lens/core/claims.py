r"""Reference claims (SPEC §6): each claim's verdict is a list of checks, "number vs threshold".

A claim of the papers is judged by the criterion SPEC §6 fixes for it. Every criterion here is a
conjunction of comparisons of one measured *headline number* with a fixed threshold::

    Check("median_ratio_sink_heads", 4.8, "in", (3.0, 10.0))    # 3 <= 4.8 <= 10
    Check("contribution_over_attention", 0.64, "<", 0.5)       # fails

Each number may carry an ``interval`` (a 95% bootstrap interval over documents,
:mod:`cw_lens.core.bootstrap`), and each check has a three-valued verdict ``holds``:

- ``"yes"``: the point value *and* the whole interval satisfy the comparison;
- ``"no"``: the point value and the whole interval fail it — or the number is NaN (not measured);
- ``"inconclusive"``: the interval straddles the threshold (or the point value and the interval
  disagree, or the interval could not be computed although the point value could).

Without an interval (``interval=None``) the verdict is the point comparison, ``"yes"``/``"no"``.
A claim is ``"yes"`` when every check is yes, ``"no"`` when any check is no (or it has no
check), else ``"inconclusive"``. Orderings are written as differences against 0
(``AOPC(b) - AOPC(a) > 0``) so that every criterion reads numbers one by one and an interval
around each number decides it the same way.

Each analysis builds its claims from its result tables with a pure function (e.g.
:func:`cw_lens.analyses.sinks.sink_claims`), so a claim can be recomputed from any table of the
same shape.

Example::

    from cw_lens.core.claims import Check, Claim
    claim = Claim(
        "retriever_share",
        paper="Retrievers are a minority, 5.8-17.2% of heads (P2)",
        criterion="Retriever share in [5.8%, 17.2%]",
        checks=[Check("retriever_share", 0.082, "in", (0.058, 0.172))],
    )
    claim.holds          # "yes"
    Check("retriever_share", 0.082, "in", (0.058, 0.172), interval=(0.05, 0.11)).holds
    # "inconclusive": the interval straddles 0.058
    claim.to_dict()      # {"paper", "measured", "holds", "criterion", "checks"}
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Literal

from cw_lens.core.results import ClaimsTable

Op = Literal["<", ">", "in"]
OPS = ("<", ">", "in")
Verdict = Literal["yes", "no", "inconclusive"]
VERDICTS = ("yes", "no", "inconclusive")


def combine(verdicts: Iterable[str]) -> Verdict:
    """A conjunction's verdict: ``"no"`` if any is no (or there is none), ``"yes"`` if all are
    yes, else ``"inconclusive"``."""
    verdicts = list(verdicts)
    if not verdicts or "no" in verdicts:
        return "no"
    return "yes" if all(v == "yes" for v in verdicts) else "inconclusive"


@dataclass(frozen=True)
class Check:
    """One comparison of a criterion: ``value op threshold``.

    Attributes:
        number: Name of the headline number (also a key of the claim's ``measured``).
        value: The measured number (NaN when it could not be measured).
        op: ``"<"`` or ``">"`` (strict), or ``"in"`` (the closed interval ``threshold``).
        threshold: A float, or ``(low, high)`` for ``"in"``.
        interval: ``(low, high)`` around ``value`` (a bootstrap interval), ``(nan, nan)`` when
            it could not be computed, or None when none was asked for.
    """

    number: str
    value: float
    op: Op
    threshold: float | tuple[float, float]
    interval: tuple[float, float] | None = None

    def __post_init__(self) -> None:
        if self.op not in OPS:
            raise ValueError(f"op must be one of {OPS}, got {self.op!r}")
        if (self.op == "in") != isinstance(self.threshold, tuple):
            raise ValueError("op 'in' takes a (low, high) threshold; '<' and '>' take a number")
        object.__setattr__(self, "value", float(self.value))
        if self.interval is not None:
            low, high = (float(x) for x in self.interval)
            if low > high:
                raise ValueError(
                    f"interval must be (low, high) with low <= high, got {self.interval}"
                )
            object.__setattr__(self, "interval", (low, high))

    def _satisfied(self, v: float) -> bool:
        if self.op == "<":
            return v < self.threshold
        if self.op == ">":
            return v > self.threshold
        low, high = self.threshold
        return low <= v <= high

    def _interval_verdict(self, low: float, high: float) -> Verdict:
        """yes: every value of ``[low, high]`` satisfies the comparison; no: none does."""
        if self.op == "<":
            yes, no = high < self.threshold, low >= self.threshold
        elif self.op == ">":
            yes, no = low > self.threshold, high <= self.threshold
        else:
            a, b = self.threshold
            yes, no = a <= low and high <= b, high < a or low > b
        return "yes" if yes else "no" if no else "inconclusive"

    @property
    def holds(self) -> Verdict:
        """``"yes"``, ``"no"`` or ``"inconclusive"`` (see the module docstring)."""
        v = self.value
        if math.isnan(v):
            return "no"
        point: Verdict = "yes" if self._satisfied(v) else "no"
        if self.interval is None:
            return point
        low, high = self.interval
        if math.isnan(low) or math.isnan(high):
            return "inconclusive"
        # the hull of the interval and the point value (a percentile interval may miss it)
        return self._interval_verdict(min(low, v), max(high, v))

    def describe(self) -> str:
        if self.op == "in":
            low, high = self.threshold
            return f"{self.number} in [{low:g}, {high:g}]"
        return f"{self.number} {self.op} {self.threshold:g}"

    def to_dict(self) -> dict[str, Any]:
        threshold = list(self.threshold) if isinstance(self.threshold, tuple) else self.threshold
        return {
            "number": self.number,
            "value": self.value,
            "op": self.op,
            "threshold": threshold,
            "interval": None if self.interval is None else list(self.interval),
            "holds": self.holds,
        }


@dataclass
class Claim:
    """A reference claim (SPEC §6): what the paper says, the criterion, its checks and the
    other measured numbers reported beside them. ``holds``: :func:`combine` of the checks'
    verdicts. ``per_layer`` (claims about layers): tidy rows ``{"layer", "number", "value",
    "low", "high"}``, the claim's number computed within each layer, with its interval."""

    id: str
    paper: str
    criterion: str
    checks: list[Check]
    measured: dict[str, Any] = field(default_factory=dict)
    per_layer: list[dict[str, Any]] | None = None

    @property
    def holds(self) -> Verdict:
        return combine(c.holds for c in self.checks)

    def to_dict(self) -> dict[str, Any]:
        """``paper``, ``measured`` (the checks' numbers first), ``holds``, ``criterion``,
        ``checks`` (each check's number, value, op, threshold, interval and verdict) and, for
        claims about layers, ``per_layer``."""
        out = {
            "paper": self.paper,
            "measured": {**{c.number: c.value for c in self.checks}, **self.measured},
            "holds": self.holds,
            "criterion": self.criterion,
            "checks": [c.to_dict() for c in self.checks],
        }
        if self.per_layer is not None:
            out["per_layer"] = self.per_layer
        return out


def claims_dict(claims: Iterable[Claim]) -> ClaimsTable:
    """``{claim id: claim.to_dict()}`` in the given order, as a printable :class:`ClaimsTable`."""
    return ClaimsTable((c.id, c.to_dict()) for c in claims)


def threshold_text(op: str, threshold: float | Sequence[float]) -> str:
    """A check's criterion without its number: ``"< 0.5"``, ``"in [3, 10]"``."""
    if op == "in":
        low, high = threshold
        return f"in [{low:g}, {high:g}]"
    return f"{op} {threshold:g}"


def with_intervals(
    claims: Iterable[Claim],
    intervals: Mapping[str, tuple[float, float]],
    per_layer: Mapping[str, list[dict[str, Any]]] | None = None,
) -> list[Claim]:
    """The claims with ``intervals[number]`` set on each of their checks (a number missing from
    ``intervals`` keeps no interval) and ``per_layer[claim id]`` attached."""
    per_layer = per_layer or {}
    out = []
    for claim in claims:
        checks = [
            replace(c, interval=intervals[c.number]) if c.number in intervals else c
            for c in claim.checks
        ]
        out.append(
            replace(claim, checks=checks, per_layer=per_layer.get(claim.id, claim.per_layer))
        )
    return out
