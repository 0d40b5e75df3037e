r"""Several runs of the main job side by side: `compare_runs(RUN_DIR, ...)`.

Each run of `cw-lens figures` writes `summary.json`: the reference claims of methods § Claims
(docs/methods.md#claims), each a conjunction of checks `value op threshold` on a *headline number*
(`claims.py`). This module reads several of them — other models, corpora or seeds — and lines up
every check of every
claim:

    number of run r  =  value_r  [low_r, high_r]   verdict_r  (check:  value op threshold)

where `[low, high]` is the run's 95% bootstrap interval over documents (schemas 2 and 3) and
the verdict is `yes` / `no` / `inconclusive` / `not measured` (docs/methods.md#claims).

Whether two runs differ is *tested*, never read off the verdict strings (two verdicts can differ
with no real difference — 0.06 [0.04, 0.09] against 0.10 — and agree across a real one — 4.84 [4.10,
5.62] against 3.50 [3.2, 3.8]). Every number of every run is compared with the first run's
([`RunComparisonResult.differences`][cw_lens.RunComparisonResult.differences]) from the bootstrap
replicates each schema-3 run keeps in `replicates.npz` (`cw_lens.reproduction.run_replicates`): a
paired bootstrap of the difference when both runs resampled the same documents (same token-id
hashes, bootstrap seed and resamples), independent resamples otherwise. Each difference gets a
p-value (the smallest level at which its expanded percentile interval excludes 0), and the p-values
of all the numbers compared — every number of every run against the first — are adjusted together by
Holm's step-down method: `"differ"` when the adjusted p-value is below 0.05, `"same within
uncertainty"` otherwise, `"not comparable"` when a number is missing or not measured, a run kept
no replicates (schemas 1 and 2), a biased number is compared across different document counts,
or the number's interval is not certified at a run's document count.
Holm controls the family-wise error — the chance that *any* number is called different when none
is — at 0.05 in the strong sense and whatever the dependence between the numbers (they come from
the same documents, so they are dependent); the question a comparison answers is "did any number
change", which is a family-wise question (a false discovery rate would allow some false
"differ"s among many). The table shows each number's unadjusted 95% interval, its raw and its
adjusted p-value.

Biased numbers: the numbers whose plug-in the code knows to be biased on few documents
(`cw_lens.reproduction.bootstrap.is_biased_plugin`: `sink_lowers_fn`'s geometric means) and any
whose bootstrap bias is more than a quarter of its standard error in either run (`|mean(t*) - t| /
sd(t*) > 0.25`, `cw_lens.reproduction.bootstrap.bias_to_se`,
`cw_lens.reproduction.bootstrap.bias_flagged`: e.g. the Retriever share, a median of |rho| on few
documents). Their bias depends on the document count, so runs of different counts are not compared
on them (`"not comparable"`, the reason says why); runs of equal counts are compared from their
replicates, where the bias is the same in both; the geometric means from bias-corrected replicates
(`t* - 2b`, point `t - b`, as their `bias_corrected` interval).

Uncertified intervals: a difference is built from the replicates behind each run's interval,
so where the coverage study (`cw_lens.reproduction.interval_coverage`, docs/coverage.md) did not
certify that interval at the run's document count, the difference is not trusted either: such a
number is `"not comparable"` (`not_certified_because`: for the studied model and corpus the
verdicts' certificate; for any other run, fewer documents than the smallest studied count).

Reads summary schema 3 (four verdicts, a `replicates` record), schema 2 (three verdicts,
intervals) and schema 1 (no `"schema"` key: `holds` a bool, mapped to `"yes"` / `"no"`,
no intervals; the oldest files have no `checks` either, and their claims show the claim
verdict alone). Anything else is refused with an [`InputError`][cw_lens.InputError] naming the
file and the problem, as is a `replicates.npz` whose SHA-256 is not the one its summary
records. Per-layer detail (`per_layer`) is not compared here; each run's REPORT.md shows it.

The public functions' docstrings have runnable examples.

On the command line: `cw-lens compare figures figures-licence --labels pydoc,licence`.
"""

# One concept: comparing runs is reading their folders (summary.json and the replicates it
# names, every field checked) and lining their numbers up; the reading is what the comparison
# trusts, so it stays beside it.
from __future__ import annotations

import json
import math
import re
import reprlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd

from cw_lens.core.deprecation import keyword_only
from cw_lens.core.errors import InputError
from cw_lens.core.keywords import check_keywords
from cw_lens.core.registry import saveable
from cw_lens.core.results import Result
from cw_lens.reproduction.comparison_markdown import (
    differences_markdown,
    table_cell,
    value_cell,
    verdict_cell,
)
from cw_lens.reproduction.difference_tests import DIFFERENCE_COLUMNS as DIFFERENCE_COLUMNS
from cw_lens.reproduction.difference_tests import FAMILY_LEVEL as FAMILY_LEVEL
from cw_lens.reproduction.difference_tests import holm_results as holm_results
from cw_lens.reproduction.difference_tests import run_differences
from cw_lens.reproduction.run_replicates import DIFFER, RunReplicates, unpack
from cw_lens.reproduction.run_replicates import FILE as REPLICATES_FILE
from cw_lens.reproduction.verdicts import VERDICTS, threshold_text

SCHEMAS = (1, 2, 3)
# the verdicts each schema writes: 1 true/false, 2 three values, 3 four (docs/methods.md#claims)
SCHEMA_VERDICTS = {2: ("yes", "no", "inconclusive"), 3: VERDICTS}
OPS = ("<", ">", "in")
# the run header's fields: what each holds, and its test (each may be null)
HEADER = {
    "model": ("a string", lambda v: isinstance(v, str)),
    "corpus": ("a string", lambda v: isinstance(v, str)),
    "n_documents": ("a count", lambda v: _is_count(v)),
    "n_tokens": ("a count", lambda v: _is_count(v)),
    "seed": ("an integer", lambda v: _is_integer(v)),
}
MAX_SUMMARY_BYTES = 64 << 20  # the largest summary.json read
SHA256 = re.compile(r"[0-9a-f]{64}")
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


@saveable
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
    replicates: RunReplicates | None = field(default=None, repr=False)
    no_replicates: str = "a summary of schema 1 or 2 keeps no bootstrap replicates"


@saveable
@dataclass(repr=False)
class RunComparisonResult(Result):
    """Checks of several runs, one row per run x claim x headline number.

    Attributes:
        runs: The runs, in the order given (their labels are unique).
        rows: The tidy table (see `to_dataframe`).
    """

    runs: list[Run]
    rows: pd.DataFrame = field(repr=False)

    def to_dataframe(self) -> pd.DataFrame:
        """Tidy table: `run` (label), `claim`, `number` (the headline number; empty for a
        claim without checks), `value`, `low`/`high` (the interval; NaN when the run has
        none), `op` and `threshold` (a float, or `(low, high)` for `"in"`), `check`
        (this check's verdict) and `holds` (the claim's verdict), verdicts `yes`/`no`/
        `inconclusive`.

        Returns:
            The tidy table, one row per run x claim x headline number.

        Examples:
            ```python
            import cw_lens
            from cw_lens.reproduction import claims

            model = cw_lens.load_model("testing:tiny-llama")
            runs = []
            for seed in (0, 1):  # usually: cw_lens.compare_runs(["runs/a", "runs/b"])
                corpus = cw_lens.load_corpus(n_docs=2, max_tokens=16, model=model, seed=seed)
                tax = cw_lens.head_taxonomy(model, corpus, progress=False)
                runs.append({"schema": 3, "model": "tiny-llama", "claims": claims(tax)})
            comparison = cw_lens.compare_runs(runs, labels=["seed 0", "seed 1"])
            comparison.to_dataframe()
            ```
        """
        return self.rows.copy()

    def differences(self) -> pd.DataFrame:
        """Every headline number of every run tested against the first run (the reference):
        `claim`, `number`, `run`, `reference`, `value` (the run's), `reference_value`,
        `difference` (run - reference) with its unadjusted 95% interval `low`/`high`,
        `paired` (the replicates resampled the same documents), `p_value` (the test's),
        `p_holm` (Holm-adjusted over every comparable number of the table),
        `bias_corrected` (a biased number compared from bias-corrected replicates),
        `result` (`"differ"` when `p_holm < 0.05` / `"same within uncertainty"` / `"not
        comparable"`) and `reason` (module docstring; `cw_lens.reproduction.run_replicates`).

        Returns:
            A DataFrame, one row per (number, run other than the first).

        Examples:
            ```python
            import cw_lens
            from cw_lens.reproduction import claims

            model = cw_lens.load_model("testing:tiny-llama")
            runs = []
            for seed in (0, 1):  # usually: cw_lens.compare_runs(["runs/a", "runs/b"])
                corpus = cw_lens.load_corpus(n_docs=2, max_tokens=16, model=model, seed=seed)
                tax = cw_lens.head_taxonomy(model, corpus, progress=False)
                runs.append({"schema": 3, "model": "tiny-llama", "claims": claims(tax)})
            comparison = cw_lens.compare_runs(runs, labels=["seed 0", "seed 1"])
            comparison.differences()
            ```
        """
        return run_differences(self.runs, self.rows)

    def disagreements(self) -> pd.DataFrame:
        """The numbers whose difference from the first run's is significant after Holm's
        adjustment over all the numbers compared (result `"differ"`): `differences` rows.
        Verdict strings are not compared — two verdicts can differ without any real
        difference and agree despite one.

        Returns:
            The rows of `differences` whose result is `"differ"`.

        Examples:
            ```python
            import cw_lens
            from cw_lens.reproduction import claims

            model = cw_lens.load_model("testing:tiny-llama")
            runs = []
            for seed in (0, 1):  # usually: cw_lens.compare_runs(["runs/a", "runs/b"])
                corpus = cw_lens.load_corpus(n_docs=2, max_tokens=16, model=model, seed=seed)
                tax = cw_lens.head_taxonomy(model, corpus, progress=False)
                runs.append({"schema": 3, "model": "tiny-llama", "claims": claims(tax)})
            comparison = cw_lens.compare_runs(runs, labels=["seed 0", "seed 1"])
            comparison.disagreements()
            ```
        """
        table = self.differences()
        return table[table["result"] == DIFFER].reset_index(drop=True)

    def top(self, k: int = 10) -> pd.DataFrame:
        """The `k` headline numbers that moved most from the first run's.

        Args:
            k: How many rows.

        Returns:
            Rows of [`differences`][cw_lens.RunComparisonResult.differences], the largest
            `|difference|` first (numbers not in the reference run last).

        Examples:
            ```python
            import cw_lens
            from cw_lens.reproduction import claims

            model = cw_lens.load_model("testing:tiny-llama")
            runs = []
            for seed in (0, 1):  # usually: cw_lens.compare_runs(["runs/a", "runs/b"])
                corpus = cw_lens.load_corpus(n_docs=2, max_tokens=16, model=model, seed=seed)
                tax = cw_lens.head_taxonomy(model, corpus, progress=False)
                runs.append({"schema": 3, "model": "tiny-llama", "claims": claims(tax)})
            comparison = cw_lens.compare_runs(runs, labels=["seed 0", "seed 1"])
            comparison.top(5)
            ```
        """
        table = self.differences()
        size = table["difference"].astype(float).abs()
        order = size.sort_values(ascending=False, na_position="last", kind="stable").index
        return table.loc[order].head(k).reset_index(drop=True)

    def claim_verdicts(self) -> pd.DataFrame:
        """Claim verdict per run: one row per claim (first-seen order), one column per run.

        Returns:
            A DataFrame: one row per claim (first-seen order), one column per run.

        Examples:
            ```python
            import cw_lens
            from cw_lens.reproduction import claims

            model = cw_lens.load_model("testing:tiny-llama")
            runs = []
            for seed in (0, 1):  # usually: cw_lens.compare_runs(["runs/a", "runs/b"])
                corpus = cw_lens.load_corpus(n_docs=2, max_tokens=16, model=model, seed=seed)
                tax = cw_lens.head_taxonomy(model, corpus, progress=False)
                runs.append({"schema": 3, "model": "tiny-llama", "claims": claims(tax)})
            comparison = cw_lens.compare_runs(runs, labels=["seed 0", "seed 1"])
            comparison.claim_verdicts()
            ```
        """
        claims = self.rows.drop_duplicates(["run", "claim"])
        table = claims.pivot(index="claim", columns="run", values="holds")
        order = list(dict.fromkeys(self.rows["claim"]))
        return table.reindex(index=order, columns=[r.label for r in self.runs])

    def to_markdown(self) -> str:
        """The runs' header table, then the claims table: for each claim a row with its verdict
        per run, then one row per headline number with `value [low, high] verdict` per run
        (`—` where a run did not measure it).

        Returns:
            The tables as Markdown text.

        Examples:
            ```python
            import cw_lens
            from cw_lens.reproduction import claims

            model = cw_lens.load_model("testing:tiny-llama")
            runs = []
            for seed in (0, 1):  # usually: cw_lens.compare_runs(["runs/a", "runs/b"])
                corpus = cw_lens.load_corpus(n_docs=2, max_tokens=16, model=model, seed=seed)
                tax = cw_lens.head_taxonomy(model, corpus, progress=False)
                runs.append({"schema": 3, "model": "tiny-llama", "claims": claims(tax)})
            comparison = cw_lens.compare_runs(runs, labels=["seed 0", "seed 1"])
            print(comparison.to_markdown())
            ```
        """
        labels = [r.label for r in self.runs]
        lines = [
            "| run | model | corpus | documents | tokens | seed | schema |",
            "|---|---|---|---|---|---|---|",
        ]
        for r in self.runs:
            cells = [r.label, r.model, r.corpus, r.n_documents, r.n_tokens, r.seed, r.schema]
            lines.append("| " + " | ".join(table_cell(c) for c in cells) + " |")
        lines += [
            "",
            "| claim / number | check | " + " | ".join(labels) + " |",
            "|---|---|" + "---|" * len(labels),
        ]
        verdicts = self.claim_verdicts()
        for claim, per_run in verdicts.iterrows():
            marks = [verdict_cell(per_run[lab]) for lab in labels]
            lines.append(f"| `{claim}` | claim | " + " | ".join(marks) + " |")
            checks = self.rows[(self.rows["claim"] == claim) & (self.rows["number"] != "")]
            for number in dict.fromkeys(checks["number"]):
                rows = checks[checks["number"] == number].set_index("run")
                # runs of different cw_lens versions may judge a number differently: show each
                check = " / ".join(
                    dict.fromkeys(map(threshold_text, rows["op"], rows["threshold"]))
                )
                cells = [value_cell(rows.loc[lab]) if lab in rows.index else "—" for lab in labels]
                lines.append(f"| ↳ {number} | {check} | " + " | ".join(cells) + " |")
        if len(self.runs) > 1:
            lines += ["", *differences_markdown(self.differences(), labels[0])]
        return "\n".join(lines) + "\n"

    def plot(self, **kwargs: Any) -> Any:
        """Forest plot: one panel per headline number, one row per run (point = value, bar =
        interval), the threshold(s) as vertical lines, the check's verdict by colour.

        Args:
            **kwargs: Passed to `cw_lens.reproduction.comparison_plots.plot_run_comparison`
                (`figsize`).

        Returns:
            A matplotlib Figure.

        Examples:
            ```python
            import cw_lens
            from cw_lens.reproduction import claims

            model = cw_lens.load_model("testing:tiny-llama")
            runs = []
            for seed in (0, 1):  # usually: cw_lens.compare_runs(["runs/a", "runs/b"])
                corpus = cw_lens.load_corpus(n_docs=2, max_tokens=16, model=model, seed=seed)
                tax = cw_lens.head_taxonomy(model, corpus, progress=False)
                runs.append({"schema": 3, "model": "tiny-llama", "claims": claims(tax)})
            comparison = cw_lens.compare_runs(runs, labels=["seed 0", "seed 1"])
            fig = comparison.plot()
            ```
        """
        from cw_lens.reproduction.comparison_plots import plot_run_comparison

        return plot_run_comparison(self.rows, [r.label for r in self.runs], **kwargs)


@check_keywords
@keyword_only("labels")
def compare_runs(
    runs: Sequence[str | Path | Mapping[str, Any]], *, labels: Sequence[str] | None = None
) -> RunComparisonResult:
    """Read several runs' `summary.json` and line up their claims.

    Args:
        runs: Each a run folder (holding `summary.json`), a `summary.json` path, or an
            already loaded summary dict.
        labels: One unique label per run (default: the run folder's name; `run N` for a dict).

    Returns:
        A [`RunComparisonResult`][cw_lens.RunComparisonResult].

    Raises:
        InputError: No runs, labels that do not match, or a run that is not a readable summary
            of schema 1 or 2 (the message names the file and the problem).

    Examples:
        ```python
        import cw_lens
        from cw_lens.reproduction import claims

        model = cw_lens.load_model("testing:tiny-llama")
        runs = []
        for seed in (0, 1):  # usually: cw_lens.compare_runs(["runs/a", "runs/b"])
            corpus = cw_lens.load_corpus(n_docs=2, max_tokens=16, model=model, seed=seed)
            tax = cw_lens.head_taxonomy(model, corpus, progress=False)
            runs.append({"schema": 3, "model": "tiny-llama", "claims": claims(tax)})
        comparison = cw_lens.compare_runs(runs, labels=["seed 0", "seed 1"])
        comparison.claim_verdicts()     # one row per claim, one column per run
        ```
    """
    if isinstance(runs, (str, Path, Mapping)):
        runs = [runs]
    if not runs:
        raise InputError("compare_runs needs at least one run folder or summary.json.")
    loaded = [_load(r, i) for i, r in enumerate(runs)]
    if labels is None:
        labels = [name for name, _, _, _ in loaded]
        if len(set(labels)) < len(labels):
            labels = [f"{i + 1}:{name}" for i, name in enumerate(labels)]
    else:
        labels = [str(lab) for lab in labels]
        if len(labels) != len(loaded):
            raise InputError(f"{len(labels)} labels for {len(loaded)} runs; give one per run.")
        if len(set(labels)) < len(labels) or "" in labels:
            raise InputError(f"Labels must be unique and non-empty, got {labels}.")
    header, rows = [], []
    for label, (_, source, summary, path) in zip(labels, loaded, strict=True):
        run, run_rows = _read(summary, label, source)
        _attach_replicates(run, summary, path)
        header.append(run)
        rows += run_rows
    return RunComparisonResult(header, pd.DataFrame(rows, columns=COLUMNS))


# --------------------------------------------------------------------------- reading


def _load(run: str | Path | Mapping[str, Any], index: int) -> tuple[str, str, Any, Path | None]:
    """`(default label, source name, parsed JSON, summary path)` of one run."""
    if isinstance(run, Mapping):
        return f"run {index + 1}", f"summary #{index + 1}", run, None
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
    summary = read_summary(path)
    return name, str(path), summary, path


def _json_int(text: str) -> int | float:
    """A JSON integer: exact up to 20 digits, else infinite (refused where a number is read:
    no field of a summary holds more, and Python refuses to convert more than 4,300 digits)."""
    if len(text) <= 20:
        return int(text)
    return -math.inf if text.startswith("-") else math.inf


def read_summary(path: Path) -> Any:
    """`path`'s JSON, with integers of more than 20 digits read as infinite (`_json_int`).

    Args:
        path: A `summary.json`.

    Returns:
        The parsed JSON (not yet checked).

    Raises:
        InputError: when the file is over `MAX_SUMMARY_BYTES`, not UTF-8 JSON, or nested
            deeper than Python's parser reads.
    """
    try:
        if path.stat().st_size > MAX_SUMMARY_BYTES:
            raise InputError(
                f"{path} is over {MAX_SUMMARY_BYTES} bytes: not a cw_lens summary (a run's "
                "summary.json is a few hundred kilobytes at most)."
            )
        return json.loads(path.read_text(encoding="utf-8"), parse_int=_json_int)
    except (UnicodeDecodeError, ValueError) as exc:  # a JSONDecodeError is a ValueError
        raise InputError(f"{path} is not a cw_lens summary: not JSON ({str(exc)[:200]}).") from None
    except RecursionError:
        raise InputError(
            f"{path} is not a cw_lens summary: its JSON is nested too deep to read."
        ) from None
    except OSError as exc:
        raise InputError(f"{path} cannot be read ({exc}).") from None


def _attach_replicates(run: Run, summary: Mapping[str, Any], path: Path | None) -> None:
    """Read the run's `replicates.npz` (schema 3) if it is there; else say why not. The file
    the summary names must lie inside the run's folder; its size and SHA-256 are checked before
    it is parsed (`cw_lens.reproduction.run_replicates.read_checked`)."""
    block = summary.get("replicates")
    if run.schema < 3:
        return
    if not isinstance(block, Mapping) or "file" not in block:
        run.no_replicates = "the summary records no replicates file"
    elif path is None:
        run.no_replicates = "a summary given as a dict brings no replicates file"
    else:
        file = inside_folder(path, block["file"])
        sha256 = block.get("sha256")
        if not (isinstance(sha256, str) and SHA256.fullmatch(sha256)):
            raise InputError(
                f"{path}: replicates.sha256 is {reprlib.repr(sha256)}; expected the file's SHA-256 "
                "(64 hex digits), as `cw-lens figures` writes it."
            )
        size = block.get("bytes")
        if size is not None and not _is_count(size):
            raise InputError(
                f"{path}: replicates.bytes is {reprlib.repr(size)}; expected the file's size in "
                "bytes (a count), as `cw-lens figures` writes it."
            )
        if not file.is_file():
            run.no_replicates = f"{block['file']} is missing beside {path}"
        else:
            run.replicates = unpack(file, sha256, size)


def inside_folder(summary: Path, name: Any) -> Path:
    """The file `name` that `summary` names (its `replicates.file`), resolved inside the
    summary's folder: never an absolute path, a path leaving the folder, or a link out of it.

    Args:
        summary: The `summary.json` path.
        name: The name it gives.

    Returns:
        The file's path.

    Raises:
        InputError: when `name` is not a relative path inside the folder, naming the field.
    """
    folder = summary.parent.resolve()
    if isinstance(name, str) and name and "\0" not in name and not Path(name).is_absolute():
        file = (folder / name).resolve()
        if file.is_relative_to(folder) and file != folder:
            return file
    raise InputError(
        f"{summary}: replicates.file is {reprlib.repr(name)}; expected the name of a file inside "
        f"the run's folder {folder} ({REPLICATES_FILE!r}, as `cw-lens figures` writes it). A "
        "summary never points outside its own folder; nothing was read."
    )


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
    header = {}
    for key, (wanted, holds) in HEADER.items():
        value = summary.get(key)
        if value is not None and not holds(value):
            raise fail(f"{key!r} is {reprlib.repr(value)}; expected {wanted} or null.")
        header[key] = value
    run = Run(label, source, schema, **header)
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
        raise fail(f"unknown op {reprlib.repr(op)}; expected one of {OPS}.")
    if op == "in":
        if not (isinstance(threshold, list) and len(threshold) == 2):
            raise fail(f"op 'in' needs a [low, high] threshold, got {reprlib.repr(threshold)}.")
        threshold = tuple(_number(t, fail, "threshold") for t in threshold)
    else:
        threshold = _number(threshold, fail, "threshold")
    low = high = math.nan
    if schema >= 2:  # the key is always written; null = no interval was asked for
        if "interval" not in check:
            raise fail("schema 2 checks carry an 'interval' ([low, high] or null); none here.")
        interval = check["interval"]
        if interval is not None and not (isinstance(interval, list) and len(interval) == 2):
            raise fail(f"the interval must be [low, high] or null, got {reprlib.repr(interval)}.")
        if interval is not None:
            low, high = (_number(end, fail, "interval") for end in interval)
    return {
        "number": _text(check["number"], fail),
        "value": _number(check["value"], fail, "value"),
        "low": low,
        "high": high,
        "op": op,
        "threshold": threshold,
        "check": _verdict(check["holds"], schema, fail),
    }


def _text(value: Any, fail: Any) -> str:
    """A check's number's name: a string."""
    if not isinstance(value, str):
        raise fail(f"the number's name is {reprlib.repr(value)}; expected a string.")
    return value


def _verdict(holds: Any, schema: int, fail: Any) -> str:
    if schema == 1:
        if not isinstance(holds, bool):
            raise fail(f"schema 1 verdicts are true/false, got {reprlib.repr(holds)}.")
        return "yes" if holds else "no"
    if holds not in SCHEMA_VERDICTS[schema]:
        raise fail(
            f"schema {schema} verdicts are {SCHEMA_VERDICTS[schema]}, got {reprlib.repr(holds)}."
        )
    return holds


def _number(value: Any, fail: Any, what: str) -> float:
    """A JSON number (`null` or NaN = not measured = NaN) as a float; infinite ones refused."""
    if value is None:
        return math.nan
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise fail(f"expected a number, got {reprlib.repr(value)} (its {what}).")
    try:
        number = float(value)
    except OverflowError:
        number = math.inf
    if math.isinf(number):  # beyond a float's range (NaN: not measured, as null)
        raise fail(
            f"expected a finite number (null when not measured), got {reprlib.repr(value)} (its "
            f"{what}): a summary never holds one beyond +-1.8e308, nor an integer of over 20 "
            "digits."
        )
    return number


def _is_integer(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and -(1 << 63) <= value < 1 << 63


def _is_count(value: Any) -> bool:
    return _is_integer(value) and value >= 0
