"""Benchmark: corpus analyses at growing corpus sizes — time per token and peak memory.

Each corpus analysis runs on 8, 32 and 128 documents x 256 tokens (``--full`` adds 512) of one
corpus for every size: ``load_corpus("pydoc+stdlib")``, pydoc's topics followed by the standard
library's own docstrings (the default: pydoc alone holds only 441 windows of 256 tokens;
``--corpus`` takes any corpus name or file). Each (analysis, size) runs in a fresh process on
the embedded model, and the table shows side by side, per size: seconds per 1,000 tokens (wall
clock, and the process's CPU time, which a busy machine inflates less) and the peak RSS (VmHWM)
after the model and corpus are loaded (the kernel's peak mark is reset there, so this is the
process's peak during the job) and over the whole process. Targets (issue 16): seconds per
token at the largest size within 1.25x of that at 32 documents, and peak RSS within 1.2x.

Faithfulness and pruning run a reduced protocol so that the large sizes finish: faithfulness
with two metrics (attention, contribution) at one fraction (10%) — 5 forward passes per batch
instead of 61 — and pruning with the taxonomy and one random order at 50% retention, without
lone-head costs; the flow analysis's deletion test (``rollout_deletion``, each document's last
token the target) with one k (4) and one random draw — 3 deleted passes per batch instead of
28. The code paths (clean streamed pass, per-batch ranks, intervened passes, exact NLL sums)
are the default ones; only the number of configurations differs.

    python benchmarks/bench_scaling.py [--full] [--sizes 8 32 128] [--analyses sink_statistics]
                                       [--corpus pydoc+stdlib]

Results go to ``benchmarks/results/scaling.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).parent))

from bench_contributions import RESULTS, peak_mb, reset_peak, rss_mb

from cw_lens import reproduction

ANALYSES = (
    "sink_statistics",
    "sink_ablation",
    "selection_geometry",
    "head_taxonomy",
    "faithfulness",
    "prune_heads",
    "rollout_deletion",
)
SIZES = (8, 32, 128)
FULL_SIZES = (8, 32, 128, 512)
TARGET_TIME, TARGET_RSS = 1.25, 1.2


def child(analysis: str, n_docs: int, n_tokens: int, corpus: str) -> None:
    import gc

    import torch

    import cw_lens
    from cw_lens.data.inputs import prepare_inputs

    model = cw_lens.load_model(device="cpu")
    corpus = cw_lens.load_corpus(corpus, n_docs=n_docs, max_tokens=n_tokens, model=model)
    tokens = int(prepare_inputs(model, corpus).mask.sum())
    torch.set_grad_enabled(False)
    jobs = {
        "sink_statistics": lambda: reproduction.claims(cw_lens.sink_statistics(model, corpus)),
        "sink_ablation": lambda: reproduction.claims(
            cw_lens.sink_ablation(model, corpus, layers=[10])
        ),
        "selection_geometry": lambda: reproduction.claims(
            cw_lens.selection_geometry(model, corpus, progress=False)
        ),
        "head_taxonomy": lambda: reproduction.claims(
            cw_lens.head_taxonomy(model, corpus, progress=False)
        ),
        "faithfulness": lambda: cw_lens.faithfulness(
            model,
            corpus,
            metrics=("attention", "contribution"),
            fractions=(0.1,),
            progress=False,
        ).aopc(),  # the reduced protocol cannot judge the claim (it needs all four metrics)
        "prune_heads": lambda: cw_lens.prune_heads(
            model,
            corpus,
            order=("taxonomy", "random"),
            retention=0.5,
            n_draws=1,
            lone=False,
            progress=False,
        ).summary(),
        "rollout_deletion": lambda: cw_lens.rollout_deletion(
            model, corpus, ks=(4,), n_random=1
        ).summary(),
    }
    gc.collect()
    load_peak = peak_mb()
    reset_peak()
    before = rss_mb()
    cpu0, start = time.process_time(), time.perf_counter()
    jobs[analysis]()
    seconds, cpu = time.perf_counter() - start, time.process_time() - cpu0
    peak = peak_mb()
    print(
        json.dumps(
            {
                "documents": n_docs,
                "tokens": tokens,
                "seconds": seconds,
                "cpu_seconds": cpu,
                "s_per_1k": 1000 * seconds / tokens,
                "cpu_s_per_1k": 1000 * cpu / tokens,
                "rss_loaded_mb": before,
                "peak_mb": peak,
                "peak_above_loaded_mb": peak - before,
                "peak_total_mb": max(peak, load_peak),
            }
        )
    )


def _load() -> str:
    try:
        return Path("/proc/loadavg").read_text().split()[0]
    except OSError:
        return "?"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--full", action="store_true", help="add 512 documents")
    parser.add_argument("--sizes", type=int, nargs="+", default=None)
    parser.add_argument("--analyses", nargs="+", default=list(ANALYSES), choices=ANALYSES)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--corpus", default="pydoc+stdlib", help="a load_corpus name or file")
    parser.add_argument("--child", nargs=2, default=None, metavar=("ANALYSIS", "DOCS"))
    args = parser.parse_args()
    if args.child:
        child(args.child[0], int(args.child[1]), args.tokens, args.corpus)
        return
    sizes = args.sizes or (FULL_SIZES if args.full else SIZES)
    report: dict = {
        "tokens_per_document": args.tokens,
        "sizes": list(sizes),
        "corpus": args.corpus,
        "runs": {},
    }
    print(f"{len(sizes)} sizes x {len(args.analyses)} analyses; load average {_load()}")
    for analysis in args.analyses:
        runs = report["runs"].setdefault(analysis, {})
        for n in sizes:
            cmd = [
                sys.executable,
                __file__,
                "--child",
                analysis,
                str(n),
                "--tokens",
                str(args.tokens),
                "--corpus",
                args.corpus,
            ]
            load = _load()
            out = subprocess.run(cmd, capture_output=True, text=True)
            if out.returncode != 0:
                runs[n] = {"error": out.stderr[-2000:]}
                print(f"{analysis} x {n}: FAILED\n{out.stderr[-2000:]}")
                continue
            runs[n] = {**json.loads(out.stdout.strip().splitlines()[-1]), "load_before": load}
            r = runs[n]
            print(
                f"{analysis:>18} {n:4d} docs: {r['s_per_1k']:6.2f} s/1k tok "
                f"(cpu {r['cpu_s_per_1k']:6.2f})  peak {r['peak_mb'] / 1024:5.2f} GB "
                f"(+{r['peak_above_loaded_mb'] / 1024:4.2f} above loaded, "
                f"{r['peak_total_mb'] / 1024:4.2f} total)  load {load}",
                flush=True,
            )
    print(_table(report, sizes))
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "scaling.json").write_text(json.dumps(report, indent=2))
    print(f"wrote {RESULTS / 'scaling.json'}")


def _table(report: dict, sizes: list[int]) -> str:
    """Markdown: per analysis and size, s/1k tokens | peak GB; then largest-over-32 ratios."""
    base, top = (32 if 32 in sizes else sizes[0]), sizes[-1]
    head = " | ".join(f"{n} docs: s/1k tok, peak GB" for n in sizes)
    lines = [
        f"| analysis | {head} | time {top}/{base} | peak {top}/{base} |",
        "|---" * (len(sizes) + 3) + "|",
    ]
    for analysis, runs in report["runs"].items():
        cells = []
        for n in sizes:
            r = runs.get(n, {})
            cells.append(
                f"{r['s_per_1k']:.2f}, {r['peak_mb'] / 1024:.2f}" if "s_per_1k" in r else "failed"
            )
        ratios = ["", ""]
        if top != base and "s_per_1k" in runs.get(base, {}) and "s_per_1k" in runs.get(top, {}):
            t = runs[top]["s_per_1k"] / runs[base]["s_per_1k"]
            m = runs[top]["peak_mb"] / runs[base]["peak_mb"]
            ratios = [
                f"{t:.2f} {'ok' if t <= TARGET_TIME else 'over'}",
                f"{m:.2f} {'ok' if m <= TARGET_RSS else 'over'}",
            ]
        lines.append(f"| {analysis} | {' | '.join(cells)} | {' | '.join(ratios)} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
