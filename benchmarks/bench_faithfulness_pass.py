"""What one faithfulness removal pass costs against a plain forward pass, and where it goes.

Run with ``python benchmarks/bench_faithfulness_pass.py [--repeats 3] [--threads 2]`` on idle
cores. The workload is the paper preset's causal batch: the embedded SmolLM2-135M, 8 windows of
256 tokens of ``pydoc+stdlib``, batch size 8. One process interleaves, ``--repeats`` times:

- ``forward``: a plain forward pass with the next-token NLL (what every removal pass must at
  least cost: it changes attention in every layer, so nothing downstream of layer 0 can be
  reused from the clean pass);
- ``removal``: one of faithfulness's removal passes (contribution ranking, comprehensiveness,
  10% of the pairs removed in every layer), NLL included.

Then one removal pass under PyTorch's profiler splits its operator time into the layers'
matrix products, the output head (``addmm``), and the element-wise rest. The clean pass that
ranks the pairs (once per batch, for all configurations) is timed once. Medians are written to
``benchmarks/results/faithfulness_pass.json`` and printed.

The paper preset runs ``1 + 5 metrics x 2 modes x 6 fractions = 61`` passes per batch of 8
documents: its faithfulness step costs about ``batches x (clean + 60 x removal)``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch

OUT = Path(__file__).parent / "results" / "faithfulness_pass.json"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    import cw_lens
    from cw_lens.analyses.faithfulness.ranking import ALL_METRICS, Ranks
    from cw_lens.data.inputs import TokenBatch, iter_batches, prepare_inputs
    from cw_lens.data.scoring import run_logits, token_nll
    from cw_lens.data.streaming import stream_contributions

    model = cw_lens.load_model()
    cw_lens.verify_model(model)
    corpus = cw_lens.load_corpus("pydoc+stdlib", n_docs=8, max_tokens=256, model=model)
    batch = next(iter(iter_batches(prepare_inputs(model, corpus, prepend_bos=True), 8)))
    local = TokenBatch(batch.tokens, batch.mask, batch.prepend_bos, batch.bos_token, list(range(8)))
    layers = list(range(model.cfg.n_layers))
    ranks = Ranks(batch, layers, model.cfg.n_heads, list(ALL_METRICS), ["pairs"], False, 0, 1)

    start = time.perf_counter()
    stream_contributions(
        model,
        local.tokens,
        ranks.update,
        layers=layers,
        batch_size=None,
        attention_mask=local.mask.long(),
        on_logits=lambda *_: None,
        progress=False,
        reuse_buffers=True,
    )
    clean = time.perf_counter() - start

    def removal_hooks() -> list:
        return ranks.hooks(model, "pairs", "contribution", "comprehensiveness", 0.1, layers)

    def timed(hooks: list) -> float:
        start = time.perf_counter()
        nll = token_nll(run_logits(model, local, hooks), batch.tokens, batch.mask)
        del nll
        return time.perf_counter() - start

    times: dict[str, list[float]] = {"forward": [], "removal": []}
    for _ in range(args.repeats):
        times["forward"].append(timed([]))
        times["removal"].append(timed(removal_hooks()))

    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        timed(removal_hooks())
    ops = {e.key: e.self_cpu_time_total for e in prof.key_averages()}
    total = sum(ops.values())
    split = {
        "layer matrix products (mm, bmm)": (ops.get("aten::mm", 0) + ops.get("aten::bmm", 0)),
        "output head (addmm)": ops.get("aten::addmm", 0),
    }
    split["element-wise and the rest"] = total - sum(split.values())
    medians = {k: statistics.median(v) for k, v in times.items()}
    body = {
        "threads": args.threads,
        "repeats": args.repeats,
        "tokens": list(batch.tokens.shape),
        "clean_ranking_pass_s": clean,
        "median_s": medians,
        "removal_over_forward": medians["removal"] / medians["forward"],
        "removal_operator_shares": {k: v / total for k, v in split.items()},
        "all_s": times,
    }
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps(body, indent=1) + "\n")
    print(json.dumps(body, indent=1))


if __name__ == "__main__":
    main()
