"""Benchmark: tensor operations per layer and batch of each corpus analysis and the forward pass.

Run with ``python benchmarks/bench_ops.py`` (``--workload tiny`` or ``embedded``: one of the two;
``--quick``: the tiny workload alone, without the growth sweeps; ``--docs-table``: print the
record's table for docs/performance.md, run nothing). The record goes to
``benchmarks/records/bench_ops.json`` (with ``--quick``: ``benchmarks/results/``).

On a GPU every tensor operation is a kernel launch plus Python dispatch, about 5-20 µs whatever
its size, so an analysis that issues many small operations per layer is launch-bound however fast
the GPU is. The number of operations does not depend on the machine: this script counts them,
with a ``TorchDispatchMode`` that sees every ATen operation a call dispatches (on the CPU, the
same operations a GPU would launch), and divides by the number of layers and of batches.

Cases, per workload (batches of 8 documents):

- ``forward``: a plain ``model(tokens)`` of every batch, the floor;
- ``sinks``, ``selection``, ``taxonomy``, ``ablation``: each analysis's own function with
  ``per_document=True``, as the main job calls it;
- ``fused``: ``corpus_analyses`` of those four in one pass;
- ``contribution_weights``: one batch's contribution weights (every layer).

Each case's ``per_layer_batch`` is its count over ``layers × batches``; ``ratio`` divides it by
the forward pass's. Each case is counted with two block plans (``block_plan``): the
accelerator's (``cases``: a batch is one block of query rows unless memory needs more, the plan
a GPU runs and the one the goals are for) and the CPU's (``cpu_cases``: at least 4 blocks, each
skipping the keys causality makes zero, which saves CPU time and repeats every per-block
operation). The growth sweeps (tiny width, 64 tokens) run the three streamed analyses on
one batch of 8, 16 and 32 documents, and on models of 4, 8 and 16 query heads: a count that grows
with documents is a loop over documents, one that grows with heads a loop over heads.

Workloads: ``tiny``, the tiny Llama of the tests (2 layers, 4 query heads on 2 key/value heads,
``d_model`` 64) on 32 windows of 128 tokens; ``embedded``, SmolLM2-135M (30 layers, 9 heads) on
8 windows of 64 tokens.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import os
import platform
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch
from torch.utils._python_dispatch import TorchDispatchMode

RECORD = Path(__file__).parent / "records" / "bench_ops.json"
QUICK = Path(__file__).parent / "results" / "bench_ops.json"  # git-ignored
WORKLOADS = {  # name: (model, documents, tokens per window)
    "tiny": ("testing:tiny-llama", 32, 128),
    "embedded": (None, 8, 64),
}
BATCH = 8
ANALYSES = ("sinks", "selection", "taxonomy", "ablation")
GROWTH = ("sinks", "selection", "taxonomy")  # the streamed analyses of the growth sweeps
GOALS = {"analysis": 3.0, "fused": 8.0}  # per layer and batch, over the forward pass's count
GOALS_CASES = (*ANALYSES, "fused")  # the cases the goals are for
PLANS = ("accelerator", "cpu")  # block plans: the goals are for the accelerator's


class OperationCounter(TorchDispatchMode):
    """Counts the ATen operations dispatched while it is active, by operation name."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def count_operations(fn: Any) -> collections.Counter[str]:
    """The operations `fn()` dispatches, by name.

    Args:
        fn: A callable of no arguments.

    Returns:
        `{operation name: count}`.
    """
    with OperationCounter() as counter:
        fn()
    return counter.counts


def analysis_calls(model: Any, corpus: Any, batch_size: int = BATCH) -> dict[str, Any]:
    """The corpus analyses as the main job calls them, each a callable of no arguments."""
    import cw_lens

    quiet = dict(progress=False, per_document=True, batch_size=batch_size)
    return {
        "sinks": lambda: cw_lens.sink_statistics(model, corpus, **quiet),
        "selection": lambda: cw_lens.selection_geometry(model, corpus, **quiet),
        "taxonomy": lambda: cw_lens.head_taxonomy(model, corpus, **quiet),
        "ablation": lambda: cw_lens.sink_ablation(model, corpus, **quiet),
        "fused": lambda: cw_lens.corpus_analyses(model, corpus, analyses=ANALYSES, **quiet),
    }


def token_batches(model: Any, corpus: Any, batch_size: int = BATCH) -> list[torch.Tensor]:
    """The corpus's token batches, as the analyses batch it."""
    from cw_lens.data.inputs import iter_batches, prepare_inputs

    return [b.tokens for b in iter_batches(prepare_inputs(model, corpus), batch_size)]


def forward_count(model: Any, batches: list[torch.Tensor]) -> int:
    """The operations of a plain forward pass over `batches`."""

    def forward() -> None:
        with torch.inference_mode():
            for tokens in batches:
                model(tokens)

    return sum(count_operations(forward).values())


def per_layer_batch(total: int, n_layers: int, n_batches: int) -> float:
    """A count per layer and batch."""
    return total / (n_layers * n_batches)


@contextlib.contextmanager
def block_plan(plan: str) -> Iterator[None]:
    """Stream with the block plan of `plan` (`"cpu"` or `"accelerator"`) while counting on this
    CPU: the operations are the same on every device, the number of query blocks per layer and
    batch is the plan's (`cw_lens.data.streaming.CAUSAL_BLOCKS`). A benchmark-only switch."""
    from cw_lens.data import streaming

    if plan not in PLANS:
        raise ValueError(f"plan must be one of {PLANS}, got {plan!r}")
    saved = dict(streaming.CAUSAL_BLOCKS)
    streaming.CAUSAL_BLOCKS["cpu"] = saved.get("cpu" if plan == "cpu" else "cuda", 1)
    try:
        yield
    finally:
        streaming.CAUSAL_BLOCKS.clear()
        streaming.CAUSAL_BLOCKS.update(saved)


def measure(
    model: Any,
    corpus: Any,
    cases: tuple[str, ...] = (*ANALYSES, "fused"),
    plan: str = "accelerator",
) -> dict:
    """Every case's count on `corpus`, per layer and batch, and its ratio to the forward's,
    with the block plan of `plan` (`block_plan`)."""
    with block_plan(plan):
        return _measure(model, corpus, cases)


def _measure(model: Any, corpus: Any, cases: tuple[str, ...]) -> dict:
    from cw_lens.models.verify import require_verified

    require_verified(model)  # once, before anything is counted (the first case would pay it)
    n_layers = model.cfg.n_layers
    batches = token_batches(model, corpus)
    floor = per_layer_batch(forward_count(model, batches), n_layers, len(batches))
    out: dict[str, Any] = {"forward": {"per_layer_batch": floor, "ratio": 1.0}}
    calls = analysis_calls(model, corpus)
    for case in cases:
        counts = count_operations(calls[case])
        total = sum(counts.values())
        passes = 2 if case in ("ablation", "fused") else 1  # the patched pass is a second one
        value = per_layer_batch(total, n_layers, len(batches))
        out[case] = {
            "total": total,
            "per_layer_batch": value,
            "ratio": value / floor,
            "forward_passes": passes,
            "ratio_per_pass": value / (floor * passes),
            "most_common": dict(counts.most_common(8)),
        }
    import cw_lens

    one = batches[0]
    counts = count_operations(lambda: cw_lens.contribution_weights(model, one, prepend_bos=False))
    value = sum(counts.values()) / n_layers
    floor_one = per_layer_batch(forward_count(model, [one]), n_layers, 1)
    out["contribution_weights"] = {
        "total": sum(counts.values()),
        "per_layer_batch": value,
        "ratio": value / floor_one,
        "most_common": dict(counts.most_common(8)),
    }
    return out


def growth(tokens: int = 64) -> dict:
    """The streamed analyses' counts per layer and batch, with documents per batch and heads
    (the accelerator's block plan: one block per batch, so a count that grows is a loop)."""
    import cw_lens
    from cw_lens.models.testing import tiny_llama
    from cw_lens.models.verify import require_verified

    def per_layer(model: Any, n_docs: int) -> dict[str, float]:
        require_verified(model)  # before anything is counted (the first case would pay it)
        corpus = cw_lens.load_corpus(n_docs=n_docs, max_tokens=tokens, model=model, progress=False)
        calls = analysis_calls(model, corpus, batch_size=n_docs)
        return {
            case: sum(count_operations(calls[case]).values()) / model.cfg.n_layers
            for case in GROWTH
        }

    with block_plan("accelerator"):
        model = tiny_llama()
        documents = {n_docs: per_layer(model, n_docs) for n_docs in (8, 16, 32)}
        heads = {n_heads: per_layer(tiny_llama(n_heads=n_heads), BATCH) for n_heads in (4, 8, 16)}
    return {"documents": documents, "heads": heads}


def load(workload: str) -> tuple[Any, Any]:
    """The workload's model and corpus."""
    import cw_lens

    name, n_docs, n_tokens = WORKLOADS[workload]
    model = cw_lens.load_model(name) if name else cw_lens.load_model()
    corpus = cw_lens.load_corpus(n_docs=n_docs, max_tokens=n_tokens, model=model, progress=False)
    return model, corpus


def over_goal(case: str, row: dict) -> bool | None:
    """Whether a case is above its goal, judged per forward pass it needs (the ablation and the
    fused pass need two: the floor is two forward passes); None for a case without a goal."""
    if case not in GOALS_CASES:
        return None
    return row["ratio_per_pass"] > goal_of(case)


def goal_of(case: str) -> float:
    """A goal case's goal, × the forward pass's operations per pass."""
    return GOALS["fused" if case == "fused" else "analysis"]


def print_table(workload: str, cases: dict) -> None:
    """One workload's counts, as a table."""
    print(f"\n{workload}: operations per layer and batch of {BATCH} documents")
    print(
        f"{'case':22s} {'per layer, batch':>17s} {'x forward':>10s} {'per pass':>9s} {'goal':>6s}"
    )
    for case, row in cases.items():
        over = over_goal(case, row)
        mark = "" if over is None else f"{goal_of(case):6.0f}" + ("  over" if over else "")
        per_pass = row.get("ratio_per_pass", row["ratio"])
        count, ratio = row["per_layer_batch"], row["ratio"]
        print(f"{case:22s} {count:17,.0f} {ratio:10.1f} {per_pass:9.1f} {mark}")


def docs_table(record: dict) -> str:
    """docs/performance.md's table ("Operations per layer and batch") of a record with both
    workloads: each case's count per layer and batch with the accelerator's block plan, its
    ratio to the forward pass's (per forward pass the case needs), and the ratio with the CPU's
    plan."""
    rows = [record["workloads"][w] for w in ("tiny", "embedded")]
    lines = [
        "| case | passes | tiny: per layer and batch | × forward per pass | CPU plan "
        "| embedded | × forward per pass | CPU plan |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for case in ("forward", *GOALS_CASES, "contribution_weights"):
        passes = rows[0]["cases"][case].get("forward_passes", 1)
        cells = []
        for w in rows:
            accelerator, cpu = w["cases"][case], w["cpu_cases"][case]
            ratio = accelerator.get("ratio_per_pass", accelerator["ratio"])
            bold = "**" if over_goal(case, accelerator) else ""
            cells.append(
                f"{accelerator['per_layer_batch']:,.0f} | {bold}{ratio:.1f}{bold} | "
                f"{cpu.get('ratio_per_pass', cpu['ratio']):.1f}"
            )
        lines.append(f"| `{case}` | {passes} | {cells[0]} | {cells[1]} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workload", choices=[*WORKLOADS, "both"], default="both")
    parser.add_argument("--quick", action="store_true", help="tiny workload, no growth sweeps")
    parser.add_argument("--out", type=Path, help="default: the record (--quick: results/)")
    parser.add_argument(
        "--docs-table",
        action="store_true",
        help="print the record's table for the docs, run nothing",
    )
    args = parser.parse_args()
    if args.docs_table:
        print(docs_table(json.loads((args.out or RECORD).read_text())))
        return

    torch.set_grad_enabled(False)
    record: dict[str, Any] = {
        "torch": torch.__version__,
        "python": platform.python_version(),
        "machine": platform.machine(),
        "batch_size": BATCH,
        "goals": GOALS,
        "workloads": {},
    }
    chosen = (
        ["tiny"]
        if args.quick
        else (list(WORKLOADS) if args.workload == "both" else [args.workload])
    )
    for workload in chosen:
        model, corpus = load(workload)
        cases = measure(model, corpus, plan="accelerator")
        cpu_cases = measure(model, corpus, plan="cpu")
        record["workloads"][workload] = {
            "layers": model.cfg.n_layers,
            "heads": model.cfg.n_heads,
            "documents": len(corpus),
            "tokens_per_document": WORKLOADS[workload][2],
            "cases": cases,
            "cpu_cases": cpu_cases,
        }
        print_table(f"{workload}, accelerator plan", cases)
        print_table(f"{workload}, CPU plan", cpu_cases)
        del model, corpus
    if not args.quick:
        record["growth"] = growth()
        print("\ngrowth (tiny width, 64 tokens), per layer and batch:")
        for axis, rows in record["growth"].items():
            for size, row in rows.items():
                cells = ", ".join(f"{case} {n:,.0f}" for case, n in row.items())
                print(f"  {axis} {size:>2}: {cells}")
    out = args.out or (QUICK if args.quick else RECORD)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=2) + "\n")
    print(f"\nwrote {out}", file=sys.stderr)


if __name__ == "__main__":
    main()
