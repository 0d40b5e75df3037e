"""Benchmark: each corpus analysis's time over the forward passes it needs, alone and fused.

Run with ``python benchmarks/bench_overhead.py`` (``--quick``: fewer documents and repeats;
``--workload tiny`` or ``embedded``: one of the two; ``--profile CASE``: also print where one
case's time goes, by cProfile). Every case of a workload runs side by side in one process,
interleaved and repeated, and the medians are compared, so a shared machine slows every case
alike; read ratios from one run only. The record goes to
``benchmarks/records/bench_overhead.json`` (with ``--quick``: ``benchmarks/results/``).

Workloads (float32, on the CPU unless ``--device``): ``tiny``, the tiny Llama of the tests (2
layers, 4 query heads on 2 key/value heads, ``d_model`` 64) on 32 windows of 128 tokens of
pydoc; ``embedded``, SmolLM2-135M on 16 windows of 256 tokens. Batches of 8 documents.

Cases, per workload:

- ``forward``: a plain ``model(tokens)`` of every batch (logits included);
- ``capture``: the pass the streamed analyses run, with nothing computed from it: every layer's
  ``hook_pattern``, ``hook_v``, ``hook_z`` captured and checked (``z == pattern @ v``, finite),
  the layer output, every block of query rows built; it ends after the last layer's attention.
  ``capture_logits``: the same pass run to the logits (what the sink ablation's clean pass and
  a fused pass with it need);
- ``sinks``, ``selection``, ``taxonomy``, ``ablation``: each analysis's own function with its
  defaults and ``per_document=True``, as the main job calls it;
- ``fused``: ``corpus_analyses`` of those four in one pass; ``fused3``: of the first three.

Each call is timed in CPU seconds of the process (robust on a shared machine: what other
processes take is not counted; one torch thread by default, so CPU seconds are the work done)
and in wall seconds; the table's ratios are of CPU seconds, the record has both.
``ratio`` is a case's median over that of the forward passes it needs: one for the sink
statistics, the selection, the taxonomy and ``fused3``; two for the ablation and ``fused``
(the clean pass and the patched one, whose NLL needs its own pass). ``over capture`` divides
by the capture pass instead (``capture_logits`` and a patched forward for the ablation and
``fused``): what the analysis adds to the pass it reads.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import platform
import pstats
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

RECORD = Path(__file__).parent / "records" / "bench_overhead.json"
QUICK = Path(__file__).parent / "results" / "bench_overhead.json"  # git-ignored
WORKLOADS = {  # name: (model, documents, tokens per window, repeats)
    "tiny": ("testing:tiny-llama", 32, 128, 5),
    "embedded": (None, 16, 256, 2),  # a round is minutes on two cores: no warm-up round
}
PASSES = {"sinks": 1, "selection": 1, "taxonomy": 1, "fused3": 1, "ablation": 2, "fused": 2}
GOALS = {"tiny": 3.0, "embedded": 1.3}


def setup(workload: str, quick: bool, device: str):
    import torch

    import cw_lens
    from cw_lens.data.inputs import iter_batches, prepare_inputs

    name, n_docs, n_tokens, _ = WORKLOADS[workload]
    if quick:
        n_docs //= 4
    model = cw_lens.load_model(name, device=device) if name else cw_lens.load_model(device=device)
    corpus = cw_lens.load_corpus(n_docs=n_docs, max_tokens=n_tokens, model=model)
    batches = [b.tokens.to(device) for b in iter_batches(prepare_inputs(model, corpus), 8)]
    torch.set_grad_enabled(False)
    return model, corpus, batches


def cases(model, corpus, batches) -> dict:
    import torch

    import cw_lens

    quiet = dict(progress=False, per_document=True)
    four = ("sinks", "selection", "taxonomy", "ablation")

    def forward() -> None:
        with torch.inference_mode():
            for tokens in batches:
                model(tokens)

    def capture(logits: bool = False) -> None:
        cw_lens.stream_contributions(
            model,
            corpus,
            lambda lc: None,
            on_logits=(lambda batch, out: None) if logits else None,
            progress=False,
            reuse_buffers=True,
        )

    fused = {  # absent before 0.4.1: the script also times older trees (PYTHONPATH)
        "fused": lambda: cw_lens.corpus_analyses(model, corpus, analyses=four, **quiet),
        "fused3": lambda: cw_lens.corpus_analyses(model, corpus, analyses=four[:3], **quiet),
    }
    return {
        "forward": forward,
        "capture": capture,
        "capture_logits": lambda: capture(logits=True),
        "sinks": lambda: cw_lens.sink_statistics(model, corpus, **quiet),
        "selection": lambda: cw_lens.selection_geometry(model, corpus, **quiet),
        "taxonomy": lambda: cw_lens.head_taxonomy(model, corpus, **quiet),
        "ablation": lambda: cw_lens.sink_ablation(model, corpus, **quiet),
        **(fused if hasattr(cw_lens, "corpus_analyses") else {}),
    }


def interleaved(fns: dict, repeats: int, warm: bool = True) -> dict[str, dict[str, list[float]]]:
    """Every function once as a warm-up (with `warm`; else the capture alone, which verifies
    the model), then `repeats` rounds in turn; the wall and the CPU seconds (of this process:
    what other processes take from a shared machine is not in it) of every call."""
    times: dict[str, dict[str, list[float]]] = {k: {"wall": [], "cpu": []} for k in fns}
    for fn in fns.values() if warm else [fns["capture"]]:
        fn()
    for _ in range(repeats):
        for name, fn in fns.items():
            wall, cpu = time.perf_counter(), time.process_time()
            fn()
            times[name]["cpu"].append(time.process_time() - cpu)
            times[name]["wall"].append(time.perf_counter() - wall)
    return times


def ratios(medians: dict[str, float]) -> dict[str, dict[str, float]]:
    """Per analysis case: its ratio to the forward passes it needs and to the capture pass."""
    out = {}
    for case, passes in PASSES.items():
        if case not in medians:
            continue
        floor = medians["capture"] if passes == 1 else medians["capture_logits"]
        floor += (passes - 1) * medians["forward"]  # the patched pass: a forward with hooks
        out[case] = {
            "seconds": medians[case],
            "forward_passes": passes,
            "ratio": medians[case] / (passes * medians["forward"]),
            "over_capture": medians[case] / floor,
        }
    return out


def profile(fn, top: int = 25) -> str:
    """cProfile of one call: the operations with the most time of their own."""
    prof = cProfile.Profile()
    prof.runcall(fn)
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(top)
    return text.getvalue()


# the docs table's rows: (case, its label); the forward and capture rows come first
DOCS_ROWS = (
    ("sinks", "`sink_statistics`"),
    ("selection", "`selection_geometry`"),
    ("taxonomy", "`head_taxonomy`"),
    ("ablation", "`sink_ablation` (2 passes)"),
    ("fused3", "fused: sinks, selection, taxonomy"),
    ("fused", "fused: all four (2 passes)"),
)


def docs_table(record: dict) -> str:
    """docs/performance.md's table ("Ratios now") of a record with both workloads: CPU seconds,
    ratio (in bold above the workload's goal) and over capture, per case."""
    tiny, embedded = (record["workloads"][w] for w in ("tiny", "embedded"))

    def cells(work: dict, case: str, digits: int) -> str:
        row = work["cases"]["cpu"][case]
        ratio = f"{row['ratio']:.2f}"
        ratio = f"**{ratio}**" if row["ratio"] > work["goal_ratio"] else ratio
        return f"{row['seconds']:.{digits}f} | {ratio} | {row['over_capture']:.2f}"

    def capture(work: dict, digits: int) -> str:
        cpu = work["medians"]["cpu"]
        plain, logits = cpu["capture"], cpu["capture_logits"]
        return f"{plain:.{digits}f} ({logits:.{digits}f}) | {plain / cpu['forward']:.2f} | 1"

    lines = [
        "| case | tiny: CPU s | ratio | over capture | embedded: CPU s | ratio | over capture |",
        "|---|---:|---:|---:|---:|---:|---:|",
        f"| forward (plain `model(tokens)`) | {tiny['medians']['cpu']['forward']:.3f} | 1 | | "
        f"{embedded['medians']['cpu']['forward']:.2f} | 1 | |",
        f"| capture (with logits) | {capture(tiny, 3)} | {capture(embedded, 2)} |",
    ]
    lines += [
        f"| {label} | {cells(tiny, case, 3)} | {cells(embedded, case, 2)} |"
        for case, label in DOCS_ROWS
    ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workload", choices=[*WORKLOADS, "both"], default="both")
    parser.add_argument("--quick", action="store_true", help="a quarter of the documents")
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    parser.add_argument("--profile", default=None, help="a case to profile after timing")
    parser.add_argument("--note", default="", help="a line for the record (the machine's load)")
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

    import torch

    torch.set_num_threads(args.threads)
    record = {
        "note": args.note,
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
        "device": args.device,
        "quick": args.quick,
        "workloads": {},
    }
    chosen = list(WORKLOADS) if args.workload == "both" else [args.workload]
    for workload in chosen:
        model, corpus, batches = setup(workload, args.quick, args.device)
        fns = cases(model, corpus, batches)
        repeats = args.repeats or (2 if args.quick else WORKLOADS[workload][3])
        times = interleaved(fns, repeats, warm=workload == "tiny")
        medians = {
            clock: {k: statistics.median(v[clock]) for k, v in times.items()}
            for clock in ("cpu", "wall")
        }
        tables = {clock: ratios(m) for clock, m in medians.items()}
        record["workloads"][workload] = {
            "documents": len(corpus),
            "tokens": int(sum(t.numel() for t in batches)),
            "batch_size": 8,
            "repeats": repeats,
            "goal_ratio": GOALS[workload],
            "times": times,
            "medians": medians,
            "cases": tables,
        }
        cpu, wall = medians["cpu"], medians["wall"]
        print(
            f"\n{workload}: {len(corpus)} documents, {repeats} interleaved repeats; CPU seconds "
            f"(wall): forward {cpu['forward']:.3f} ({wall['forward']:.3f}), capture "
            f"{cpu['capture']:.3f} ({wall['capture']:.3f}), with logits "
            f"{cpu['capture_logits']:.3f} ({wall['capture_logits']:.3f})"
        )
        print(
            f"{'case':10s} {'CPU s':>8s} {'passes':>7s} {'ratio':>7s} {'over capture':>13s} "
            f"{'wall ratio':>11s}"
        )
        for case, row in tables["cpu"].items():
            goal = GOALS[workload]
            mark = "" if row["ratio"] <= goal else f"  (goal {goal})"
            print(
                f"{case:10s} {row['seconds']:8.3f} {row['forward_passes']:7d} "
                f"{row['ratio']:7.2f} {row['over_capture']:13.2f} "
                f"{tables['wall'][case]['ratio']:11.2f}{mark}"
            )
        if args.profile:
            print(f"\nprofile of {args.profile} ({workload}):")
            print(profile(fns[args.profile]))
        del model, corpus, batches, fns
    out = args.out or (QUICK if args.quick else RECORD)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=2) + "\n")
    print(f"\nwrote {out}", file=sys.stderr)


if __name__ == "__main__":
    main()
