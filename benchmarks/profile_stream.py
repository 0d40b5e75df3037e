"""Where the time of a streamed all-layer analysis goes, measured inside the pass.

Run with ``python benchmarks/profile_stream.py [--repeats 5]``. The workload is the one of
``bench_contributions.py`` [1]: the embedded SmolLM2-135M, 4 x 512 tokens, all 30 layers,
intra + inter weights, cosine and relative norm. Three passes are interleaved and repeated in
one process (a plain forward pass, the streamed pass with a consumer that computes nothing,
the streamed pass with every field), and inside the streamed passes a wall-clock timer is put
around each piece:

- ``checks``: the per-layer ``z == pattern @ v`` and finite-activation checks;
- ``layer output``: ``o_i = sum_h z_i^h W_O^h`` (computed from ``hook_z``);
- ``fields``: the consumer, split by PyTorch's profiler (one more pass) into the matrix
  products (``mm``/``bmm``: query sides, ``<pv_j, o_i>``, ``||pv_j||``), the element-wise
  passes that write the fields (``mul``, ``mul_``, ``tril_``) and the other operators, as
  shares of the operator time (the Python between operators is not in the split).

Medians over the repeats are written to ``benchmarks/results/profile_stream.json`` and printed;
docs/performance.md has the table. Timers wrap functions by monkeypatching, so the numbers are
for this script only; the ratios of record come from ``bench_contributions.py``.
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import bench_contributions as bench

PRODUCTS = ("aten::mm", "aten::bmm")
ELEMENTWISE = ("aten::mul", "aten::mul_", "aten::tril_")


def timed(acc: collections.Counter, key: str, fn):
    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            acc[key] += time.perf_counter() - start

    return wrapper


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()

    from torch.profiler import profile

    import cw_lens.models.capture as capture

    model, tokens = bench.setup(4, 512)
    acc: collections.Counter = collections.Counter()
    capture.check_consistent = timed(acc, "checks", capture.check_consistent)
    capture.check_finite = timed(acc, "checks", capture.check_finite)
    capture.LayerWeights.layer_output = timed(
        acc, "layer output", capture.LayerWeights.layer_output
    )
    fields = timed(acc, "fields", bench.all_fields)
    passes = {
        "forward": lambda: bench.forward(model, tokens),
        "capture": lambda: bench.stream(model, tokens, consumer=lambda lc: None),
        "stream": lambda: bench.stream(model, tokens, consumer=fields),
    }
    rows: dict[str, list[dict[str, float]]] = collections.defaultdict(list)
    for repeat in range(args.repeats + 1):  # the first round warms up
        for name, run in passes.items():
            acc.clear()
            start = time.perf_counter()
            run()
            if repeat:
                rows[name].append({"wall": time.perf_counter() - start, **acc})
    median = {
        name: {k: statistics.median(r.get(k, 0.0) for r in runs) for k in runs[0]}
        for name, runs in rows.items()
    }

    # one more pass under the profiler, counting only the ops inside the consumer
    ops: collections.Counter = collections.Counter()

    def profiled(lc) -> None:
        with profile() as prof:
            bench.all_fields(lc)
        for event in prof.key_averages():
            ops[event.key] += event.self_cpu_time_total / 1e6

    bench.stream(model, tokens, consumer=profiled)
    total = sum(ops.values())
    split = {
        "products": sum(ops[k] for k in PRODUCTS) / total,
        "elementwise": sum(ops[k] for k in ELEMENTWISE) / total,
    }
    split["other"] = 1 - split["products"] - split["elementwise"]
    forward = median["forward"]["wall"]
    report = {"median_seconds": median, "fields_split": split, "repeats": args.repeats}
    bench.RESULTS.mkdir(exist_ok=True)
    (bench.RESULTS / "profile_stream.json").write_text(json.dumps(report, indent=2))
    stream = median["stream"]
    print(
        f"forward {forward:.2f} s; capture {median['capture']['wall']:.2f} s; "
        f"stream {stream['wall']:.2f} s ({stream['wall'] / forward:.2f}x)"
    )
    for key in ("checks", "layer output", "fields"):
        print(f"  {key:13s} {stream[key]:.2f} s  ({stream[key] / forward:.1%} of a forward pass)")
    print("  fields: " + ", ".join(f"{k} {v:.0%}" for k, v in split.items()))


if __name__ == "__main__":
    main()
