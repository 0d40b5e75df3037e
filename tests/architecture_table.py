"""Print the architecture table of docs/models.md (``python tests/architecture_table.py``).

Runs the same measurements as ``tests/test_architectures.py`` and prints one Markdown row per
architecture: the HF class, the status cw_lens gives it, the measured worst relative errors
against the independent HF reference (intra and inter weights, unpadded and padded batches;
the three interventions on logits) and notes. ``--raw`` adds the bridge-vs-HF logits error and
each intervention apart; ``--float32`` runs every bridge in float32 (the errors then include
the model's own float32 drift against the float64 reference). A cell that raises shows the
exception instead of a number.
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch
from arch_checks import (
    INTERVENTIONS,
    built,
    clean_logits_error,
    contribution_error,
    intervention_error,
    refusal,
)
from architectures import ARCHS, BY_NAME, Arch

TOL = 1e-5


def _try(fn):
    try:
        return fn(), None
    except Exception as err:
        return None, f"{type(err).__name__}: {str(err).splitlines()[0][:90]}"


def measure(arch: Arch) -> dict:
    """Every number of one row (errors kept as text)."""
    row: dict = {"arch": arch}
    b = built(arch.name)
    if b.error is not None:
        row["bridge_error"] = f"{type(b.error).__name__}: {str(b.error).splitlines()[0][:90]}"
        return row
    row["logits"] = _try(lambda: clean_logits_error(arch.name))
    row["verify"] = _try(lambda: refusal(b.bridge))
    for kind in ("intra", "inter"):
        plain = _try(lambda kind=kind: contribution_error(arch.name, kind))
        padded = _try(lambda kind=kind: contribution_error(arch.name, kind, padded=True))
        row[kind] = _worst(plain, padded)
    row["interventions"] = {
        w: _try(lambda w=w: intervention_error(arch.name, w)[0]) for w in INTERVENTIONS
    }
    return row


def _worst(*cells):
    errs = [e for _, e in cells if e]
    if errs:
        return None, errs[0]
    return max(v for v, _ in cells), None


def status(row: dict) -> tuple[str, str]:
    """(status, why) as cw_lens behaves today."""
    arch: Arch = row["arch"]
    if "bridge_error" in row:
        return "not bridged by TransformerLens", row["bridge_error"]
    refused, err = row["verify"]
    if err:
        return "error", err
    if refused:
        return "refused", refused.splitlines()[0][:160]
    cells = [row["intra"], row["inter"], *row["interventions"].values()]
    if all(e is None and v <= TOL for v, e in cells):
        return ("exact with notes" if arch.caveat else "exact"), ""
    return "WRONG", "verify_model passed but the numbers differ from the HF reference"


def _notes(arch: Arch, state: str, why: str) -> tuple[str, ...]:
    if state.startswith("exact"):
        return arch.caveat, arch.notes
    if state == "refused" and arch.status == "refused":
        return (arch.notes,)
    if state.startswith("not bridged"):
        return arch.notes, f"`{why}`"
    return (f"`{why}`",)


def declared(arch: Arch) -> str:
    return {"exact": "exact", "refused": "refused", "unbridged": "not bridged"}[arch.status]


def fmt(cell) -> str:
    value, err = cell
    if err:
        kind = err.split(":")[0]
        return "refused" if kind == "UnsupportedModelError" else f"`{kind}`"
    return f"{value:.1e}"


def table(rows: list[dict], raw: bool = False) -> str:
    head = ["Architecture", "HF class", "Status", "intra", "inter", "interventions", "Notes"]
    if raw:
        head[6:6] = ["logits", *INTERVENTIONS]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in rows:
        arch: Arch = row["arch"]
        state, why = status(row)
        notes = "; ".join(n for n in _notes(arch, state, why) if n)
        if "bridge_error" in row:
            cells = ["—", "—", "—"]
            extra = ["—"] * (1 + len(INTERVENTIONS))
        else:
            inter_cells = list(row["interventions"].values())
            cells = [fmt(row["intra"]), fmt(row["inter"]), fmt(_worst(*inter_cells))]
            extra = [fmt(row["logits"]), *(fmt(c) for c in inter_cells)]
        line = [arch.name, f"`{arch.hf_class}`", state, *cells, notes.replace("|", "/")]
        if raw:
            line[6:6] = extra
        lines.append("| " + " | ".join(line) + " |")
    return "\n".join(lines)


def main(argv: list[str]) -> None:
    raw = "--raw" in argv
    names = [a for a in argv if not a.startswith("--")]
    if "--float32" in argv:
        for name, arch in BY_NAME.items():
            BY_NAME[name] = replace(arch, dtype=torch.float32)
    torch.set_num_threads(1)
    start = time.perf_counter()
    rows = [measure(BY_NAME[a.name]) for a in ARCHS if not names or a.name in names]
    print(table(rows, raw))
    off = [
        f"{row['arch'].name} (declared {declared(row['arch'])}, measured {status(row)[0]})"
        for row in rows
        if not status(row)[0].startswith(declared(row["arch"]))
    ]
    if off:
        print("\nNot as declared in tests/architectures.py: " + "; ".join(off))
    print(
        f"\nErrors: worst relative error against the float64 HF reference (contribution weights "
        f"per row, conditioned; logits per position), padded batch included. "
        f"{len(rows)} architectures in {time.perf_counter() - start:.0f} s."
    )


if __name__ == "__main__":
    main(sys.argv[1:])
