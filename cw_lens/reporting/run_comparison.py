r"""Several runs of the main job side by side: ``compare_runs(RUN_DIR, ...)``.

Each run of ``cw-lens figures`` writes ``summary.json``: the reference claims of SPEC §6, each a
conjunction of checks ``value op threshold`` on a *headline number* (``claims.py``). This module
reads several of them — other models, corpora or seeds — and lines up every check of every
claim::

    number of run r  =  value_r  [low_r, high_r]   verdict_r  (check:  value op threshold)

where ``[low, high]`` is the run's 95% bootstrap interval over documents (schema 2) and the
verdict is ``yes`` / ``no`` / ``inconclusive`` (the interval straddles the threshold). Nothing is
recomputed: the numbers are the runs' own, so a difference between two columns is a difference
between the runs, read against their intervals — two runs whose intervals overlap widely do not
disagree about that number, whatever the point estimates say.

Reads summary schema 2 (``"schema": 2``: string verdicts, intervals) and schema 1 (no
``"schema"`` key: ``holds`` a bool, mapped to ``"yes"`` / ``"no"``, no intervals; the oldest
files have no ``checks`` either, and their claims show the claim verdict alone). Anything else is
refused with an :class:`~cw_lens.core.errors.InputError` naming the file and the problem. Per-layer
detail (schema 2 ``per_layer``) is not compared here; each run's REPORT.md shows it.

Example::

    from cw_lens.reporting.run_comparison import compare_runs
    cmp = compare_runs(["figures", "figures-licence"], labels=["pydoc", "licence"])
    print(cmp.to_markdown())       # one column per run: value [low, high] verdict
    cmp.to_dataframe()             # tidy: run, claim, number, value, low, high, op, ...
    cmp.plot()                     # forest plot: one panel per headline number, runs as rows
    cmp.disagreements()            # the claims whose verdict differs between runs

On the command line: ``cw-lens compare figures figures-licence --labels pydoc,licence``.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd

from cw_lens.core.claims import threshold_text
from cw_lens.core.deprecation import keyword_only
from cw_lens.core.errors import InputError
from cw_lens.core.results import Result

VERDICTS = ("yes", "no", "inconclusive")
SCHEMAS = (1, 2)
OPS = ("<", ">", "in")
NO_CHECK = {"number": "", "value": math.nan, "low": math.nan, "high": math.nan, "op": "",
            "threshold": None}  # fmt: skip
COLUMNS = [
    "run",
    "claim",
    "number",
    "value",
    "low",
    "high",
    "op",
    "threshold",
    "check",
    "holds",
]


@dataclass
class Run:
    """One run's header: its label, source and what it measured on."""

    label: str
    source: str
    schema: int
    model: str | None
    corpus: str | None
    n_documents: int | None
    n_tokens: int | None
    seed: int | None


@dataclass(repr=False)
class RunComparison(Result):
    """Checks of several runs, one row per run x claim x headline number.

    Attributes:
        runs: The runs, in the order given (their labels are unique).
        rows: The tidy table (see :meth:`to_dataframe`).
    """

    runs: list[Run]
    rows: pd.DataFrame = field(repr=False)

    def to_dataframe(self) -> pd.DataFrame:
        """Tidy table: ``run`` (label), ``claim``, ``number`` (the headline number; empty for a
        claim without checks), ``value``, ``low``/``high`` (the interval; NaN when the run has
        none), ``op`` and ``threshold`` (a float, or ``(low, high)`` for ``"in"``), ``check``
        (this check's verdict) and ``holds`` (the claim's verdict), verdicts ``yes``/``no``/
        ``inconclusive``."""
        return self.rows.copy()

    def disagreements(self) -> pd.DataFrame:
        """The claims whose verdict is not the same in every run: one row per claim, one column
        per run."""
        verdicts = self.claim_verdicts()
        same = verdicts.nunique(axis=1, dropna=False) == 1
        return verdicts[~same]

    def claim_verdicts(self) -> pd.DataFrame:
        """Claim verdict per run: one row per claim (first-seen order), one column per run."""
        claims = self.rows.drop_duplicates(["run", "claim"])
        table = claims.pivot(index="claim", columns="run", values="holds")
        order = list(dict.fromkeys(self.rows["claim"]))
        return table.reindex(index=order, columns=[r.label for r in self.runs])

    def to_markdown(self) -> str:
        """The runs' header table, then the claims table: for each claim a row with its verdict
        per run, then one row per headline number with ``value [low, high] verdict`` per run
        (``—`` where a run did not measure it)."""
        labels = [r.label for r in self.runs]
        lines = [
            "| run | model | corpus | documents | tokens | seed | schema |",
            "|---|---|---|---|---|---|---|",
        ]
        for r in self.runs:
            cells = [r.label, r.model, r.corpus, r.n_documents, r.n_tokens, r.seed, r.schema]
            lines.append("| " + " | ".join(_cell(c) for c in cells) + " |")
        lines += [
            "",
            "| claim / number | check | " + " | ".join(labels) + " |",
            "|---|---|" + "---|" * len(labels),
        ]
        verdicts = self.claim_verdicts()
        for claim, per_run in verdicts.iterrows():
            marks = [_bold(per_run[lab]) for lab in labels]
            lines.append(f"| `{claim}` | claim | " + " | ".join(marks) + " |")
            checks = self.rows[(self.rows["claim"] == claim) & (self.rows["number"] != "")]
            for number in dict.fromkeys(checks["number"]):
                rows = checks[checks["number"] == number].set_index("run")
                # runs of different cw_lens versions may judge a number differently: show each
                check = " / ".join(
                    dict.fromkeys(map(threshold_text, rows["op"], rows["threshold"]))
                )
                cells = [_value_cell(rows.loc[lab]) if lab in rows.index else "—" for lab in labels]
                lines.append(f"| ↳ {number} | {check} | " + " | ".join(cells) + " |")
        return "\n".join(lines) + "\n"

    def plot(self, **kwargs: Any) -> Any:
        """Forest plot: one panel per headline number, one row per run (point = value, bar =
        interval), the threshold(s) as vertical lines, the check's verdict by colour."""
        from cw_lens.plots.compare import plot_run_comparison

        return plot_run_comparison(self.rows, [r.label for r in self.runs], **kwargs)


@keyword_only("labels")
def compare_runs(
    runs: Sequence[str | Path | Mapping[str, Any]], *, labels: Sequence[str] | None = None
) -> RunComparison:
    """Read several runs' ``summary.json`` and line up their claims.

    Args:
        runs: Each a run folder (holding ``summary.json``), a ``summary.json`` path, or an
            already loaded summary dict.
        labels: One unique label per run (default: the run folder's name; ``run N`` for a dict).

    Returns:
        A :class:`RunComparison`.

    Raises:
        InputError: No runs, labels that do not match, or a run that is not a readable summary
            of schema 1 or 2 (the message names the file and the problem).
    """
    if isinstance(runs, (str, Path, Mapping)):
        runs = [runs]
    if not runs:
        raise InputError("compare_runs needs at least one run folder or summary.json.")
    loaded = [_load(r, i) for i, r in enumerate(runs)]
    if labels is None:
        labels = [name for name, _, _ in loaded]
        if len(set(labels)) < len(labels):
            labels = [f"{i + 1}:{name}" for i, name in enumerate(labels)]
    else:
        labels = [str(lab) for lab in labels]
        if len(labels) != len(loaded):
            raise InputError(f"{len(labels)} labels for {len(loaded)} runs; give one per run.")
        if len(set(labels)) < len(labels) or "" in labels:
            raise InputError(f"Labels must be unique and non-empty, got {labels}.")
    header, rows = [], []
    for label, (_, source, summary) in zip(labels, loaded, strict=True):
        run, run_rows = _read(summary, label, source)
        header.append(run)
        rows += run_rows
    return RunComparison(header, pd.DataFrame(rows, columns=COLUMNS))


# --------------------------------------------------------------------------- reading


def _load(run: str | Path | Mapping[str, Any], index: int) -> tuple[str, str, Any]:
    """``(default label, source name, parsed JSON)`` of one run."""
    if isinstance(run, Mapping):
        return f"run {index + 1}", f"summary #{index + 1}", run
    path = Path(run)
    if path.is_dir():
        name = path.resolve().name
        path = path / "summary.json"
        if not path.is_file():
            raise InputError(
                f"{path.parent} has no summary.json: give a folder written by `cw-lens figures "
                "--out DIR` (or the summary.json itself)."
            )
    elif not path.is_file():
        raise InputError(f"{path}: no such file or folder.")
    else:
        name = path.resolve().parent.name
    try:
        summary = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise InputError(f"{path} is not a cw_lens summary: not JSON ({exc}).") from None
    return name, str(path), summary


def _read(summary: Any, label: str, source: str) -> tuple[Run, list[dict[str, Any]]]:
    def fail(problem: str) -> InputError:
        return InputError(f"{source}: {problem}")

    if not isinstance(summary, Mapping) or not isinstance(summary.get("claims"), Mapping):
        raise fail("not a cw_lens summary (no 'claims' object); expected a `cw-lens figures` run.")
    schema = summary.get("schema", 1)
    if schema not in SCHEMAS or isinstance(schema, bool):
        raise fail(
            f"unknown summary schema {schema!r}; this cw_lens reads schemas {SCHEMAS} "
            "(a newer cw_lens wrote it?)."
        )
    if not summary["claims"]:
        raise fail("the summary has no claims.")
    run = Run(
        label,
        source,
        schema,
        summary.get("model"),
        summary.get("corpus"),
        summary.get("n_documents"),
        summary.get("n_tokens"),
        summary.get("seed"),
    )
    rows = []
    for cid, claim in summary["claims"].items():
        if not isinstance(claim, Mapping) or "holds" not in claim:
            raise fail(f"claim {cid!r} has no 'holds' verdict.")
        holds = _verdict(claim["holds"], schema, lambda p, c=cid: fail(f"claim {c!r}: {p}"))
        checks = claim.get("checks", [])
        if not isinstance(checks, list):
            raise fail(f"claim {cid!r}: 'checks' is not a list.")
        base = {"run": label, "claim": cid, "holds": holds}
        if not checks:  # written before checks existed: the claim's verdict alone
            rows.append({**base, **NO_CHECK, "check": holds})
        numbers = []
        for i, check in enumerate(checks):
            where = f"claim {cid!r}, check {i}"
            read = _read_check(check, schema, lambda p, w=where: fail(f"{w}: {p}"))
            if read["number"] in numbers:
                raise fail(
                    f"claim {cid!r} checks {read['number']!r} twice; a number has one check."
                )
            numbers.append(read["number"])
            rows.append({**base, **read})
    return run, rows


def _read_check(check: Any, schema: int, fail: Any) -> dict[str, Any]:
    if not isinstance(check, Mapping):
        raise fail("not an object.")
    missing = [k for k in ("number", "value", "op", "threshold", "holds") if k not in check]
    if missing:
        raise fail(f"missing {missing}.")
    op, threshold = check["op"], check["threshold"]
    if op not in OPS:
        raise fail(f"unknown op {op!r}; expected one of {OPS}.")
    if op == "in":
        if not (isinstance(threshold, list) and len(threshold) == 2):
            raise fail(f"op 'in' needs a [low, high] threshold, got {threshold!r}.")
        threshold = (_number(threshold[0], fail), _number(threshold[1], fail))
    else:
        threshold = _number(threshold, fail)
    low = high = math.nan
    if schema >= 2:  # the key is always written; null = no interval was asked for
        if "interval" not in check:
            raise fail("schema 2 checks carry an 'interval' ([low, high] or null); none here.")
        interval = check["interval"]
        if interval is not None and not (isinstance(interval, list) and len(interval) == 2):
            raise fail(f"the interval must be [low, high] or null, got {interval!r}.")
        low, high = (math.nan, math.nan) if interval is None else map(_number, interval, [fail] * 2)
    return {
        "number": str(check["number"]),
        "value": _number(check["value"], fail),
        "low": low,
        "high": high,
        "op": op,
        "threshold": threshold,
        "check": _verdict(check["holds"], schema, fail),
    }


def _verdict(holds: Any, schema: int, fail: Any) -> str:
    if schema == 1:
        if not isinstance(holds, bool):
            raise fail(f"schema 1 verdicts are true/false, got {holds!r}.")
        return "yes" if holds else "no"
    if holds not in VERDICTS:
        raise fail(f"schema 2 verdicts are {VERDICTS}, got {holds!r}.")
    return holds


def _number(value: Any, fail: Any) -> float:
    """A JSON number (``null`` = not measured = NaN) as a float."""
    if value is None:
        return math.nan
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise fail(f"expected a number, got {value!r}.")
    return float(value)


# --------------------------------------------------------------------------- formatting


def _cell(value: Any) -> str:
    return "—" if value is None else str(value).replace("|", "\\|")


def _bold(verdict: Any) -> str:
    if not isinstance(verdict, str):
        return "—"
    return verdict if verdict == "yes" else f"**{verdict}**"


def _value_cell(row: pd.Series) -> str:
    value = "n/a" if math.isnan(row["value"]) else f"{row['value']:.3g}"
    if not (math.isnan(row["low"]) and math.isnan(row["high"])):
        value += f" [{row['low']:.3g}, {row['high']:.3g}]"
    return f"{value} {row['check']}"
