r"""Reference claims (docs/methods.md#claims): each claim's verdict is a list of checks, "number vs
threshold".

A claim of the papers is judged by the criterion methods § Claims (docs/methods.md#claims) fixes for
it. Every criterion here is a
conjunction of comparisons of one measured *headline number* with a fixed threshold:

    Check("median_ratio_sink_heads", 4.8, "in", (3.0, 10.0))    # 3 <= 4.8 <= 10
    Check("contribution_over_attention", 0.64, "<", 0.5)       # fails

Each number may carry an `interval` (a 95% bootstrap interval over documents,
`cw_lens.reproduction.bootstrap`), and each check has a four-valued verdict `holds`
(docs/methods.md#claims):

- `"not measured"`: the number is NaN (the run could not compute it: no sink heads, too few
  queries, ...). Never `"no"`: an unmeasured number refutes nothing;
- `"yes"`: the point value *and* the whole interval satisfy the comparison;
- `"no"`: the point value and the whole interval fail it (for `"in"`: each lies outside the
  band, on either side of it);
- `"inconclusive"`: anything else — the interval straddles the threshold, the point value and
  the interval disagree, or a bootstrap was run but gave this number no interval (`(nan,
  nan)`): a check that should have an interval never falls back to a decisive point verdict.

Without a bootstrap (`interval=None`: none was asked for) the verdict is the point comparison,
`"yes"`/`"no"`. A claim (a conjunction of checks) combines its checks' verdicts with
`combine`: `"no"` if any check is no (one decisively failed conjunct refutes the
conjunction whatever the others say), else `"not measured"` if any is not measured (more
documents of the same kind cannot settle it), else `"inconclusive"` if any is inconclusive, else
`"yes"`; a claim without checks is `"not measured"`. Orderings are written as differences
against 0 (`AOPC(b) - AOPC(a) > 0`) so that every criterion reads numbers one by one and an
interval around each number decides it the same way.

Each analysis builds its claims from its result tables with a pure function (e.g.
`cw_lens.analyses.sinks.sink_claims`), so a claim can be recomputed from any table of the
same shape.

Example:

    from cw_lens.reproduction.verdicts import Check, Claim
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
from typing import Any, ClassVar, Literal

import numpy as np
import pandas as pd

from cw_lens.core.registry import saveable

Op = Literal["<", ">", "in"]
OPS = ("<", ">", "in")
NO_INTERVAL = (math.nan, math.nan)  # a bootstrap was run but gave the number no interval
Verdict = Literal["yes", "no", "inconclusive", "not measured"]
VERDICTS = ("yes", "no", "inconclusive", "not measured")
NOT_MEASURED = "not measured"


def combine(verdicts: Iterable[str]) -> Verdict:
    """A conjunction's verdict: `"no"` if any is no; else `"not measured"` if any is not
    measured (or there is none); else `"inconclusive"` if any is inconclusive; else
    `"yes"`."""
    verdicts = list(verdicts)
    unknown = [v for v in verdicts if v not in VERDICTS]
    if unknown:
        raise ValueError(f"verdicts are {VERDICTS}, got {unknown}")
    for verdict in ("no", NOT_MEASURED, "inconclusive"):
        if verdict in verdicts:
            return verdict  # type: ignore[return-value]
    return "yes" if verdicts else NOT_MEASURED


@dataclass(frozen=True)
class Check:
    """One comparison of a criterion: `value op threshold`.

    Attributes:
        number: Name of the headline number (also a key of the claim's `measured`).
        value: The measured number (NaN when it could not be measured).
        op: `"<"` or `">"` (strict), or `"in"` (the closed interval `threshold`).
        threshold: A float, or `(low, high)` for `"in"`.
        interval: `(low, high)` around `value` (a bootstrap interval), `(nan, nan)` when
            a bootstrap was run but could not give one (the check is then inconclusive), or
            None when no bootstrap was asked for (the point verdict).
        replicates: The bootstrap replicates the interval was read from (None: not kept).
        bias_to_se: The number's bootstrap `|bias| / SE` in this run
            (`cw_lens.reproduction.bootstrap.bias_to_se`; NaN when not computable or unknown).
        interval_method: The interval method used (`cw_lens.reproduction.bootstrap.METHODS`; None
            when unknown or no bootstrap was asked for).
    """

    number: str
    value: float
    op: Op
    threshold: float | tuple[float, float]
    interval: tuple[float, float] | None = None
    replicates: Any = field(default=None, compare=False, repr=False)
    bias_to_se: float | None = math.nan
    interval_method: str | None = None

    def __post_init__(self) -> None:
        if self.op not in OPS:
            raise ValueError(f"op must be one of {OPS}, got {self.op!r}")
        if (self.op == "in") != isinstance(self.threshold, tuple):
            raise ValueError("op 'in' takes a (low, high) threshold; '<' and '>' take a number")
        object.__setattr__(self, "value", float(self.value))
        ratio = self.bias_to_se
        object.__setattr__(self, "bias_to_se", math.nan if ratio is None else float(ratio))
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
        """yes: every value of `[low, high]` satisfies the comparison; no: none does."""
        if self.op == "<":
            yes, no = high < self.threshold, low >= self.threshold
        elif self.op == ">":
            yes, no = low > self.threshold, high <= self.threshold
        else:
            a, b = self.threshold
            yes, no = a <= low and high <= b, high < a or low > b
        return "yes" if yes else "no" if no else "inconclusive"

    def _verdict(self, point: Verdict, low: float, high: float) -> Verdict:
        """The point value's verdict and the interval's together: yes when both satisfy the
        comparison, no when both fail it (the point on either side of an `in` band: a
        point below the band and an interval wholly above it both fail), else
        inconclusive."""
        interval = self._interval_verdict(low, high)
        return point if interval == point else "inconclusive"

    @property
    def holds(self) -> Verdict:
        """`"yes"`, `"no"`, `"inconclusive"` or `"not measured"` (see the module
        docstring)."""
        v = self.value
        if math.isnan(v):
            return NOT_MEASURED
        point: Verdict = "yes" if self._satisfied(v) else "no"
        if self.interval is None:
            return point
        low, high = self.interval
        if math.isnan(low) or math.isnan(high):
            return "inconclusive"
        # the point and the interval each (a percentile interval may miss the point): for
        # `<` and `>` the same as judging their hull; for `in` a point and an interval on
        # opposite sides of the band both fail it, which their hull (reaching across the
        # band) would call inconclusive
        return self._verdict(point, low, high)

    def describe(self) -> str:
        if self.op == "in":
            low, high = self.threshold
            return f"{self.number} in [{low:g}, {high:g}]"
        return f"{self.number} {self.op} {self.threshold:g}"

    def to_dict(self) -> dict[str, Any]:
        """The check as `summary.json` writes it.

        Returns:
            `number`, `value`, `op`, `threshold`, `interval` and, for a check with a
            bootstrap interval, `bias_to_se` (None when not computable) and
            `interval_method` (None when unknown), then `holds`.
        """
        threshold = list(self.threshold) if isinstance(self.threshold, tuple) else self.threshold
        out = {
            "number": self.number,
            "value": self.value,
            "op": self.op,
            "threshold": threshold,
            "interval": None if self.interval is None else list(self.interval),
        }
        if self.interval is not None:
            ratio = self.bias_to_se
            out["bias_to_se"] = None if math.isnan(ratio) else ratio
            out["interval_method"] = self.interval_method
        out["holds"] = self.holds
        return out


@dataclass
class Claim:
    """A reference claim (docs/methods.md#claims): what the paper says, the criterion, its checks
    and the other measured numbers reported beside them. `holds`: `combine` of the checks'
    verdicts. `per_layer` (claims about layers): tidy rows `{"layer", "number", "value", "low",
    "high"}` (from a bootstrap, also `"bias_to_se"` and `"interval_method"`), the claim's
    number computed within each layer, with its interval."""

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
        """`paper`, `measured` (the checks' numbers first), `holds`, `criterion`,
        `checks` (each check's number, value, op, threshold, interval and verdict; with an
        interval, its bootstrap bias/SE and method) and, for claims about layers,
        `per_layer`."""
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


@saveable
class ClaimsTable(dict):
    """The claims of a result: `{claim id: claim dict}` (`paper`, `measured`, `holds`,
    `criterion`, `checks`) that prints as a table.

    It is a `dict`, so `claims["sink_anti_alignment"]["holds"]`, iteration, `json.dumps`
    and `.update` work as before; `to_dataframe()` is one row per claim, `to_dict()` the
    plain nested dict, and Jupyter renders it as a Markdown table.
    """

    stored_items: ClassVar[Any] = dict[str, dict[str, Any]]  # what a file stores of it

    def to_dict(self) -> dict[str, dict[str, Any]]:
        """The plain nested dict.

        Returns:
            `{claim id: claim dict}` (copies of the claims).

        Examples:
            ```python
            import cw_lens
            from cw_lens.reproduction import claims

            model = cw_lens.load_model("testing:tiny-llama")
            corpus = cw_lens.load_corpus(n_docs=2, max_tokens=16, model=model)
            table = claims(cw_lens.head_taxonomy(model, corpus, progress=False))
            table.to_dict()
            ```
        """
        return {cid: dict(claim) for cid, claim in self.items()}

    def to_dataframe(self) -> pd.DataFrame:
        """One row per claim.

        Returns:
            A DataFrame with `claim`, `holds`, `paper`, `criterion` and the claim's checked
            numbers as `number=value` text.

        Examples:
            ```python
            import cw_lens
            from cw_lens.reproduction import claims

            model = cw_lens.load_model("testing:tiny-llama")
            corpus = cw_lens.load_corpus(n_docs=2, max_tokens=16, model=model)
            table = claims(cw_lens.head_taxonomy(model, corpus, progress=False))
            table.to_dataframe()
            ```
        """
        rows = [
            {
                "claim": cid,
                "holds": claim.get("holds"),
                "paper": claim.get("paper"),
                "criterion": claim.get("criterion"),
                "numbers": ", ".join(
                    f"{c['number']}={c['value']:.3g}" for c in claim.get("checks", [])
                ),
            }
            for cid, claim in self.items()
        ]
        return pd.DataFrame(rows, columns=["claim", "holds", "paper", "criterion", "numbers"])

    def __repr__(self) -> str:
        if not self:
            return "ClaimsTable(no claims)"
        df = self.to_dataframe()[["claim", "holds", "numbers"]]
        return "ClaimsTable\n" + df.to_string(index=False, max_colwidth=70)

    def _repr_pretty_(self, printer: Any, cycle: bool) -> None:
        printer.text(repr(self))

    def _repr_markdown_(self) -> str:
        lines = ["| claim | holds | paper | numbers |", "|---|---|---|---|"]
        for row in self.to_dataframe().itertuples(index=False):
            lines.append(f"| `{row.claim}` | {row.holds} | {row.paper} | {row.numbers} |")
        return "\n".join(lines)


class ClaimsDict(ClaimsTable):
    """A printable [`ClaimsTable`][cw_lens.ClaimsTable] `{claim id: claim dict}` (plain JSON-ready
    dicts) with `replicates`: `{(claim id, number): float32 [R]}`, the bootstrap replicates of the
    checks that have them."""

    replicates: dict[tuple[str, str], np.ndarray]


def claims_dict(claims: Iterable[Claim]) -> ClaimsDict:
    """`{claim id: claim.to_dict()}` in the given order; `.replicates` keeps the checks'
    bootstrap replicates (float32) for tests of differences between runs."""
    claims = list(claims)
    out = ClaimsDict((c.id, c.to_dict()) for c in claims)
    out.replicates = {
        (claim.id, check.number): np.asarray(check.replicates, dtype=np.float32).reshape(-1)
        for claim in claims
        for check in claim.checks
        if check.replicates is not None
    }
    return out


def threshold_text(op: str, threshold: float | Sequence[float]) -> str:
    """A check's criterion without its number: `"< 0.5"`, `"in [3, 10]"`."""
    if op == "in":
        low, high = threshold
        return f"in [{low:g}, {high:g}]"
    return f"{op} {threshold:g}"


def with_intervals(
    claims: Iterable[Claim],
    intervals: Mapping[str, tuple[float, float]],
    per_layer: Mapping[str, list[dict[str, Any]]] | None = None,
) -> list[Claim]:
    """The claims with `intervals[number]` set on each of their checks and `per_layer[claim
    id]` attached. `intervals` comes from a bootstrap, so a check whose number it lacks gets
    `(nan, nan)`: a check that should have an interval and has none is inconclusive, never
    judged on its point value alone. An interval from `Bootstrap.pair` also gives the check
    its replicates, its bootstrap `bias_to_se` and the `interval_method` used."""
    per_layer = per_layer or {}
    out = []
    for claim in claims:
        checks = []
        for c in claim.checks:
            interval = intervals.get(c.number, NO_INTERVAL)
            # kept by Bootstrap.pair's Interval; a plain pair knows none of them
            checks.append(
                replace(
                    c,
                    interval=interval,
                    replicates=getattr(interval, "replicates", None),
                    bias_to_se=getattr(interval, "bias_to_se", math.nan),
                    interval_method=getattr(interval, "method", None),
                )
            )
        out.append(
            replace(claim, checks=checks, per_layer=per_layer.get(claim.id, claim.per_layer))
        )
    return out
