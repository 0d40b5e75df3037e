"""Benchmark: the clean pass each faithfulness metric needs, against a forward pass.

Run with ``python benchmarks/bench_faithfulness_metrics.py`` (``--tokens N``: the documents'
length, 128 by default). The record goes to
``benchmarks/records/bench_faithfulness_metrics.json``; docs/guides/faithfulness.md quotes it.

On the embedded model, one batch of 8 documents, two threads, the best of ``--repeats`` timed
runs after one warm-up of each:

- ``forward``: a plain forward pass with its logits, the floor;
- ``p1_metrics``: the streamed clean pass that ranks every pair by `contribution` (the pass
  `attention`, `value_norm`, `value_norm_output`, `contribution` and `random` share);
- ``attribution_patching``: one forward and one backward pass, then every layer's ranks;
- ``alti``: one checked pass of the residual stream (`run_blocks`), then every layer's ranks.

The removal passes (one per mode and fraction) are the same for every metric and are not
counted here.
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from datetime import date
from pathlib import Path

import torch

import cw_lens
from cw_lens.analyses.faithfulness.curves import _clean_loss
from cw_lens.analyses.faithfulness.ranking import Ranks
from cw_lens.data.scoring import run_logits
from cw_lens.data.streaming import stream_contributions
from cw_lens.models.blocks import run_blocks
from cw_lens.models.gradients import attention_output_gradients

RECORD = Path(__file__).parent / "records" / "bench_faithfulness_metrics.json"


def best_time(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(2)
    model = cw_lens.load_model(device="cpu")
    corpus = cw_lens.load_corpus(n_docs=8, max_tokens=args.tokens, model=model)
    batch = cw_lens.data.inputs.prepare_inputs(model, corpus)
    layers = list(range(model.cfg.n_layers))

    def ranks(metric: str) -> Ranks:
        return Ranks(batch, layers, model.cfg.n_heads, [metric], ["pairs"], False, 0)

    def p1_metrics() -> None:
        stream_contributions(
            model,
            batch.tokens,
            ranks("contribution").update,
            layers=layers,
            batch_size=None,
            attention_mask=batch.mask.long(),
            progress=False,
            reuse_buffers=True,
        )

    def attribution_patching() -> None:
        loss = _clean_loss(batch, None)
        grads = attention_output_gradients(model, batch, loss, layers=layers)
        ranks("attribution_patching").update_gradients(grads)

    def alti() -> None:
        run_blocks(model, batch, ranks("alti").update_block, layers=layers)

    forward = best_time(lambda: run_logits(model, batch), args.repeats)
    cases = {"p1_metrics": p1_metrics, "attribution_patching": attribution_patching, "alti": alti}
    seconds = {name: best_time(fn, args.repeats) for name, fn in cases.items()}
    record = {
        "about": __doc__.splitlines()[0],
        "date": date.today().isoformat(),
        "machine": f"{platform.machine()}, 2 threads, torch {torch.__version__}",
        "batch": list(batch.tokens.shape),
        "cw_lens": cw_lens.__version__,
        "forward_s": round(forward, 2),
        "clean_pass_s": {k: round(v, 2) for k, v in seconds.items()},
        "x_forward": {k: round(v / forward, 1) for k, v in seconds.items()},
    }
    RECORD.write_text(json.dumps(record, indent=2) + "\n")
    print(json.dumps(record, indent=2))


if __name__ == "__main__":
    main()
