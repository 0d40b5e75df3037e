"""Benchmark: residual shares and rollout of every layer versus a plain forward pass.

Run with ``python benchmarks/bench_flow.py [--quick]``. The functions are timed interleaved and
repeated in one process (medians), so the ratios are robust to the noise of a shared machine.
Results go to ``benchmarks/results/flow.json``.

Measured (embedded SmolLM2-135M, CPU, float32, a batch of 4 x 512 tokens):

1. ``shares``: all 30 blocks, every (head, key) pair share and the per-position pieces (residual,
   attention, bias, MLP), summed into the token-level matrix ``T_l`` (and the three model checks
   of ``cw_lens.models.blocks``), streamed — divided by a plain forward pass with logits.
2. ``rollout``: the same plus the composition ``R = T_{L-1} ... T_0`` and the attention rollout.
"""

from __future__ import annotations

import argparse
import json
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from bench_contributions import RESULTS, forward, setup, timed_pairs  # same measurement helpers


def shares(model, tokens) -> None:
    import cw_lens

    cw_lens.stream_shares(
        model, tokens, lambda ls: ls.token_rows(), batch_size=None, reuse_buffers=True
    )


def rollout(model, tokens) -> None:
    from cw_lens.data.inputs import prepare_inputs
    from cw_lens.flow.rollout import rollout_batches

    for _ in rollout_batches(model, prepare_inputs(model, tokens), None):
        pass


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="smaller sizes, fewer repeats")
    args = parser.parse_args()
    import torch

    docs, n_tok = (2, 256) if args.quick else (4, 512)
    repeats = 2 if args.quick else 5
    model, tokens = setup(docs, n_tok)
    t = timed_pairs(
        {
            "forward": lambda: forward(model, tokens),
            "shares": lambda: shares(model, tokens),
            "rollout": lambda: rollout(model, tokens),
        },
        repeats,
    )
    report = {
        "torch_threads": torch.get_num_threads(),
        "batch": [docs, n_tok],
        "seconds": t,
        "shares_ratio": t["shares"] / t["forward"],
        "rollout_ratio": t["rollout"] / t["forward"],
    }
    print(
        f"{docs}x{n_tok}, 30 layers: forward {t['forward']:.2f} s, residual shares "
        f"{t['shares']:.2f} s (ratio {report['shares_ratio']:.2f}), with both rollouts "
        f"{t['rollout']:.2f} s (ratio {report['rollout_ratio']:.2f})"
    )
    RESULTS.mkdir(exist_ok=True)
    name = "flow_quick.json" if args.quick else "flow.json"
    (RESULTS / name).write_text(json.dumps(report, indent=2))
    print(f"wrote {RESULTS / name}")


if __name__ == "__main__":
    main()
