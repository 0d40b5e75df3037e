"""Benchmark: how long one update of the live sink-patching widget takes, next to a forward pass.

Run with ``make bench`` (or ``python benchmarks/bench_widget.py [--repeats N] [--threads T]``). On
the embedded SmolLM2-135M (CPU, float32) and a short text, measured side by side in one run,
interleaved and repeated (medians, so the noise of a shared machine hits all of them alike):

1. ``forward``: a plain forward pass (logits) of the text;
2. ``patched_forward``: the same pass under ``cw_lens.patch_sink`` (layers 10-19);
3. ``resumed_forward``: that patched pass resumed at layer 10 from the clean pass's residual
   stream (:mod:`cw_lens.interactive.resume`: blocks 0-9 replayed, not run);
4. ``update_full``: :func:`cw_lens.interactive.view_state.patch_state` with the clean run cached
   but no stream — the full patched pass, as 0.4.0's widget ran it on every move (with its
   contribution weights of the viewed layer, the cone measures of the patched layers, the logits
   and the JSON-ready payload, the clean part rebuilt too);
5. ``update``: what the kernel does now when a control moves — the same, resumed at the first
   patched layer, the clean part of the payload not rebuilt (the viewed layer did not change);
6. ``widget``: the same through the widget (``patcher.controls = ...``: validation, the
   update, and the traitlets bookkeeping — no front end attached, so no transfer).

The first clean run (once per text: it records the stream, and on a model's first text the
resume self-check runs) is reported too. Wall time on a shared machine mostly measures the
neighbours, so the CPU time of this process is recorded next to it (with ``--threads 1`` it is
close to the wall time the same work takes on an idle core). The record goes to
``benchmarks/records/bench_widget.json`` (committed: docs/guides/interactive.md quotes it).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
import warnings
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

RECORD = Path(__file__).parent / "records" / "bench_widget.json"
TEXT = "The capital of France is Paris. The capital of Germany is"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()

    import torch

    import cw_lens
    from cw_lens.data.inputs import prepare_inputs
    from cw_lens.interactive.resume import CleanStream
    from cw_lens.interactive.view_state import clean_run, patch_state

    warnings.simplefilter("ignore", RuntimeWarning)
    torch.set_num_threads(max(1, min(args.threads, os.cpu_count() or 1)))
    model = cw_lens.load_model()
    tokens = model.to_tokens(TEXT)
    batch = prepare_inputs(model, TEXT)
    controls = {"layers": [10, 19], "heads": "all", "scale": 0.0, "mode": "scale", "sinks": [0]}
    patch = cw_lens.patch_sink(model, layers=range(10, 20), scale=0.0)
    stream = CleanStream()
    t0 = time.perf_counter()
    clean = clean_run(model, TEXT, stream=stream)
    first_clean = time.perf_counter() - t0
    assert stream.refusal is None, stream.refusal
    patcher = cw_lens.sink_patcher(model, TEXT, layers=(10, 19), layer=20)
    scales = [0.25, 0.5, 0.75, 0.0]

    def forward(_: int) -> None:
        with torch.inference_mode():
            model(tokens)

    def patched_forward(_: int) -> None:
        with torch.inference_mode(), patch:
            model(tokens)

    def resumed_forward(_: int) -> None:
        plan = stream.plan(model, batch, 10, [20])
        with torch.inference_mode(), plan.context(model), patch:
            model(tokens)

    def update_full(i: int) -> None:
        patch_state(model, TEXT, {**controls, "scale": scales[i % 4]}, layer=20, clean=clean)

    def update(i: int) -> None:
        state = {**controls, "scale": scales[i % 4]}
        patch_state(model, TEXT, state, layer=20, clean=clean, stream=stream, with_data=False)
        assert stream.note == "resumed at layer 10", stream.note

    def widget(i: int) -> None:
        patcher.controls = {**controls, "scale": scales[(i + 1) % 4]}
        assert patcher.status == "" and patcher.last_pass == "resumed at layer 10"

    runs = {"forward": forward, "patched_forward": patched_forward,
            "resumed_forward": resumed_forward, "update_full": update_full, "update": update,
            "widget": widget}  # fmt: skip
    times: dict[str, list[float]] = {name: [] for name in runs}
    cpu: dict[str, list[float]] = {name: [] for name in runs}
    for fn in runs.values():  # warm-up
        fn(0)
    for i in range(args.repeats):
        for name, fn in runs.items():
            t0, c0 = time.perf_counter(), time.process_time()
            fn(i)
            times[name].append(time.perf_counter() - t0)
            cpu[name].append(time.process_time() - c0)
    med = {name: statistics.median(v) for name, v in times.items()}
    med_cpu = {name: statistics.median(v) for name, v in cpu.items()}
    out = {
        "date": time.strftime("%Y-%m-%d"),
        "model": model.cfg.model_name,
        "torch": torch.__version__,
        "text": TEXT,
        "n_tokens": int(tokens.shape[1]),
        "repeats": args.repeats,
        "threads": torch.get_num_threads(),
        "median_s": med,
        "median_cpu_s": med_cpu,
        "load_average": os.getloadavg(),
        "all_s": times,
        "all_cpu_s": cpu,
        "ratio_to_forward": {k: v / med["forward"] for k, v in med.items()},
        "cpu_ratio_to_forward": {k: v / med_cpu["forward"] for k, v in med_cpu.items()},
        "first_clean_run_s": first_clean,
    }
    RECORD.parent.mkdir(exist_ok=True)
    RECORD.write_text(json.dumps(out, indent=1) + "\n")
    print(f"{out['n_tokens']} tokens, median of {args.repeats}, {out['threads']} threads")
    print(f"  load average {out['load_average'][0]:.1f}; wall and CPU time of this process, each")
    print("  with its ratio to the forward pass")
    for k, v in med.items():
        c = med_cpu[k]
        print(
            f"  {k:16s} {v * 1000:8.1f} ms x{v / med['forward']:.2f}   "
            f"{c * 1000:8.1f} ms CPU x{c / med_cpu['forward']:.2f}"
        )
    print(f"  first clean run  {first_clean * 1000:8.1f} ms (once per text)")


if __name__ == "__main__":
    main()
