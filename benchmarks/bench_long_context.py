"""Benchmark: the embedded model's full context (8,192 tokens) on the CPU, every analysis family.

Each job runs in its own process on one 8,192-token window of the default corpus (8,191 text
tokens + BOS) and reports its time, its time divided by a plain forward pass, and its peak RSS
(VmHWM, reset after loading the model, so the figure is the job's own peak; the model's ~0.6 GB
of weights are included in ``peak_total_gb``). The limit to check: every peak under 24 GB.

    python benchmarks/bench_long_context.py [--tokens 8192]

Results go to ``benchmarks/results/long_context.json``.
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

JOBS = ("forward", "contributions", "sinks", "selection")


def child(job: str, n_tokens: int) -> None:
    import gc

    import torch

    import cw_lens

    model = cw_lens.load_model(device="cpu")
    corpus = cw_lens.load_corpus(n_docs=1, max_tokens=n_tokens - 1, model=model)
    torch.set_grad_enabled(False)

    def contributions() -> None:
        totals = torch.zeros(model.cfg.n_layers)

        def fold(lc) -> None:
            for kind in ("intra", "inter"):
                lc.cosine(kind)
                lc.relative_norm(kind)
            totals[lc.layer] += lc.weights("inter")[..., 0].nansum().item()

        cw_lens.stream_contributions(model, corpus, fold, reuse_buffers=True)

    def forward() -> None:
        from cw_lens.data.inputs import prepare_inputs

        with torch.inference_mode():
            model(prepare_inputs(model, corpus).tokens)

    jobs = {
        "forward": forward,
        "contributions": contributions,
        "sinks": lambda: cw_lens.sink_statistics(model, corpus),
        "selection": lambda: (
            cw_lens.selection_geometry(model, corpus),
            cw_lens.head_taxonomy(model, corpus),
        ),
    }
    gc.collect()
    reset_peak()
    before = rss_mb()
    start = time.perf_counter()
    jobs[job]()
    seconds = time.perf_counter() - start
    print(
        json.dumps(
            {"seconds": seconds, "peak_above_mb": peak_mb() - before, "peak_total_mb": peak_mb()}
        )
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--child", default=None)
    args = parser.parse_args()
    if args.child:
        child(args.child, args.tokens)
        return
    report = {"tokens": args.tokens}
    for job in JOBS:
        cmd = [sys.executable, __file__, "--child", job, "--tokens", str(args.tokens)]
        out = subprocess.run(cmd, capture_output=True, text=True)
        if out.returncode != 0:
            report[job] = {"error": out.stderr[-2000:]}
            print(f"{job}: FAILED\n{out.stderr[-2000:]}")
            continue
        report[job] = json.loads(out.stdout.strip().splitlines()[-1])
        r = report[job]
        ratio = r["seconds"] / report["forward"]["seconds"] if "forward" in report else 1.0
        r["ratio_to_forward"] = ratio
        print(
            f"{job:>13}: {r['seconds']:7.1f} s  ({ratio:4.2f} x forward)  "
            f"peak {r['peak_total_mb'] / 1024:5.1f} GB total, "
            f"+{r['peak_above_mb'] / 1024:5.1f} GB above the loaded model"
        )
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "long_context.json").write_text(json.dumps(report, indent=2))
    print(f"wrote {RESULTS / 'long_context.json'}")


if __name__ == "__main__":
    main()
