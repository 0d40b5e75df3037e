"""This checkout's analyses against another version's, timed side by side in one run.

Run with ``python benchmarks/bench_versions.py --baseline REF [--rounds 2] [--docs 16]`` on
idle cores, where ``REF`` is any git commit or tag (for example the commit of the last
release). The script checks ``REF`` out into a temporary ``git worktree`` and times the same
workload with both code trees, in the same Python environment, on the embedded SmolLM2-135M
and ``--docs`` windows of 256 tokens of ``pydoc+stdlib`` (batch size 8, the paper preset's):

- ``forward``: a plain forward pass of one batch (the machine's speed that day);
- ``sinks``, ``ablation``, ``selection``, ``taxonomy``: the corpus analyses with their
  defaults, as the main job's steps call them;
- ``faithfulness``: the contribution ranking at one fraction, both modes (two removal passes
  a batch, and the clean pass);
- ``pruning``: the magnitude order at one retention level, no lone-head costs.

Each round runs one process per code tree, alternating which goes first, and every process
times each case once after a warm-up pass, so a change of the machine's speed during the run
reaches both trees alike. The medians over rounds and their ratio (this checkout over the
baseline; above 1 is slower) are printed and written to
``benchmarks/results/versions.json``. Both trees must accept the calls above, which every
version since 0.3 does.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OUT = Path(__file__).parent / "results" / "versions.json"
CASES = ("forward", "sinks", "ablation", "selection", "taxonomy", "faithfulness", "pruning")

# what one process runs: imports cw_lens from the tree on its PYTHONPATH, prints one JSON line
WORKER = r"""
import json, sys, time
import torch
import cw_lens
from cw_lens.data.inputs import prepare_inputs

n_docs, threads = int(sys.argv[1]), int(sys.argv[2])
torch.set_num_threads(threads)
model = cw_lens.load_model("smollm2-135m")
corpus = cw_lens.load_corpus("pydoc+stdlib", n_docs=n_docs, max_tokens=256, model=model)
tokens = prepare_inputs(model, corpus[:8], prepend_bos=True).tokens
quiet = {"progress": False}
cases = {
    "forward": lambda: model(tokens),
    "sinks": lambda: cw_lens.sink_statistics(model, corpus, **quiet),
    "ablation": lambda: cw_lens.sink_ablation(model, corpus, **quiet),
    "selection": lambda: cw_lens.selection_geometry(model, corpus, **quiet),
    "taxonomy": lambda: cw_lens.head_taxonomy(model, corpus, **quiet),
    "faithfulness": lambda: cw_lens.faithfulness(
        model, corpus, metrics=("contribution",), fractions=(0.1,), **quiet
    ),
    "pruning": lambda: cw_lens.prune_heads(
        model, corpus, order="magnitude", retention=(0.5,), lone=False, **quiet
    ),
}
with torch.no_grad():
    model(tokens)  # warm-up
seconds = {}
for name in sys.argv[3].split(","):
    start = time.perf_counter()
    with torch.no_grad():
        cases[name]()
    seconds[name] = time.perf_counter() - start
print(json.dumps({"version": cw_lens.__version__, "seconds": seconds}))
"""


def run_tree(tree: Path, docs: int, threads: int, cases: list[str]) -> dict:
    env = {**os.environ, "PYTHONPATH": str(tree), "HF_HUB_OFFLINE": "1"}
    env["OMP_NUM_THREADS"] = str(threads)
    done = subprocess.run(
        [sys.executable, "-c", WORKER, str(docs), str(threads), ",".join(cases)],
        cwd=tree,
        env=env,
        capture_output=True,
        text=True,
    )
    if done.returncode:
        raise SystemExit(f"the run in {tree} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--baseline", required=True, help="a git commit or tag")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--docs", type=int, default=16)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--cases", nargs="+", default=list(CASES), choices=CASES)
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()
    if args.rounds < 1 or args.docs < 8:
        parser.error("--rounds must be at least 1 and --docs at least 8 (one batch)")
    commit = subprocess.run(
        ["git", "rev-parse", "--verify", f"{args.baseline}^{{commit}}"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    if commit.returncode:
        parser.error(f"--baseline {args.baseline!r} is not a commit of this repository")
    times: dict[str, dict[str, list[float]]] = {"baseline": {}, "this": {}}
    versions = {}
    with tempfile.TemporaryDirectory() as scratch:
        base = Path(scratch) / "baseline"
        subprocess.run(
            ["git", "worktree", "add", "--detach", "-q", str(base), commit.stdout.strip()],
            cwd=ROOT,
            check=True,
        )
        try:
            for r in range(args.rounds):
                order = [("baseline", base), ("this", ROOT)]
                for label, tree in order if r % 2 == 0 else order[::-1]:
                    got = run_tree(tree, args.docs, args.threads, args.cases)
                    versions[label] = got["version"]
                    for name, value in got["seconds"].items():
                        times[label].setdefault(name, []).append(value)
                    print(f"round {r + 1} {label} ({got['version']}): {got['seconds']}")
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(base)], cwd=ROOT)
    rows = []
    print(f"\n{'case':<14}{'baseline s':>12}{'this s':>10}{'ratio':>8}")
    for name in args.cases:
        base_s = statistics.median(times["baseline"][name])
        this_s = statistics.median(times["this"][name])
        rows.append(
            {"case": name, "baseline_s": base_s, "this_s": this_s, "ratio": this_s / base_s}
        )
        print(f"{name:<14}{base_s:>12.2f}{this_s:>10.2f}{this_s / base_s:>8.3f}")
    record = {
        "baseline": args.baseline,
        "baseline_commit": commit.stdout.strip(),
        "versions": versions,
        "docs": args.docs,
        "rounds": args.rounds,
        "threads": args.threads,
        "rows": rows,
        "raw": times,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
