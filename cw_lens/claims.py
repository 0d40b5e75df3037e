r"""Reference claims (SPEC §6): each claim's verdict is a list of checks, "number vs threshold".

A claim of the papers is judged by the criterion SPEC §6 fixes for it. Every criterion here is a
conjunction of comparisons of one measured *headline number* with a fixed threshold::

    Check("median_ratio_sink_heads", 4.8, "in", (3.0, 10.0))    # 3 <= 4.8 <= 10
    Check("contribution_over_attention", 0.64, "<", 0.5)       # fails

and ``holds`` is true when every check holds (a NaN number never holds: the claim was not
measured). Orderings are written as differences against 0 (``AOPC(b) - AOPC(a) > 0``) so that
every criterion reads numbers one by one: an interval around each number (a bootstrap over
documents) then decides each check as yes / no / inconclusive the same way.

Each analysis builds its claims from its result tables with a pure function (e.g.
:func:`cw_lens.sinks.sink_claims`), so a claim can be recomputed from any table of the same shape.

Example::

    from cw_lens.claims import Check, Claim
    claim = Claim(
        "retriever_share",
        paper="Retrievers are a minority, 5.8-17.2% of heads (P2)",
        criterion="Retriever share in [5.8%, 17.2%]",
        checks=[Check("retriever_share", 0.082, "in", (0.058, 0.172))],
    )
    claim.holds          # True
    claim.to_dict()      # {"paper", "measured", "holds", "criterion", "checks"}
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

Op = Literal["<", ">", "in"]
OPS = ("<", ">", "in")


@dataclass(frozen=True)
class Check:
    """One comparison of a criterion: ``value op threshold``.

    Attributes:
        number: Name of the headline number (also a key of the claim's ``measured``).
        value: The measured number (NaN when it could not be measured).
        op: ``"<"`` or ``">"`` (strict), or ``"in"`` (the closed interval ``threshold``).
        threshold: A float, or ``(low, high)`` for ``"in"``.
    """

    number: str
    value: float
    op: Op
    threshold: float | tuple[float, float]

    def __post_init__(self) -> None:
        if self.op not in OPS:
            raise ValueError(f"op must be one of {OPS}, got {self.op!r}")
        if (self.op == "in") != isinstance(self.threshold, tuple):
            raise ValueError("op 'in' takes a (low, high) threshold; '<' and '>' take a number")
        object.__setattr__(self, "value", float(self.value))

    @property
    def holds(self) -> bool:
        v = self.value
        if math.isnan(v):
            return False
        if self.op == "<":
            return v < self.threshold
        if self.op == ">":
            return v > self.threshold
        low, high = self.threshold
        return low <= v <= high

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
            "holds": self.holds,
        }


@dataclass
class Claim:
    """A reference claim (SPEC §6): what the paper says, the criterion, its checks and the
    other measured numbers reported beside them. ``holds`` = every check holds."""

    id: str
    paper: str
    criterion: str
    checks: list[Check]
    measured: dict[str, Any] = field(default_factory=dict)

    @property
    def holds(self) -> bool:
        return bool(self.checks) and all(c.holds for c in self.checks)

    def to_dict(self) -> dict[str, Any]:
        """``paper``, ``measured`` (the checks' numbers first), ``holds``, ``criterion`` and
        ``checks`` (each check's number, value, op, threshold and verdict)."""
        return {
            "paper": self.paper,
            "measured": {**{c.number: c.value for c in self.checks}, **self.measured},
            "holds": self.holds,
            "criterion": self.criterion,
            "checks": [c.to_dict() for c in self.checks],
        }


def claims_dict(claims: Iterable[Claim]) -> dict[str, dict[str, Any]]:
    """``{claim id: claim.to_dict()}`` in the given order."""
    return {c.id: c.to_dict() for c in claims}


def threshold_text(op: str, threshold: float | Sequence[float]) -> str:
    """A check's criterion without its number: ``"< 0.5"``, ``"in [3, 10]"``."""
    if op == "in":
        low, high = threshold
        return f"in [{low:g}, {high:g}]"
    return f"{op} {threshold:g}"
