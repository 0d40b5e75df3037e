"""Benchmark: tensor operations per intervened pass of the faithfulness curves and of pruning.

Run with ``python benchmarks/bench_interventions.py`` (``--workload tiny`` or ``embedded``: one of
the two; ``--quick``: the tiny workload alone, its record under ``benchmarks/results/``). The
record goes to ``benchmarks/records/bench_interventions.json``.

The faithfulness curves and structured pruning are the slowest steps of the presets: each runs
one forward pass per configuration (faithfulness: per granularity, metric, mode and fraction;
pruning: per removed set of heads) on top of the clean pass. What each pass adds to the forward
pass is the intervention (the removal mask built from the clean pass's ranks, or the zeroed
heads) and the scoring of its logits (the NLL sums). The operations are counted with
``bench_ops.count_operations`` (every ATen operation dispatched, the same a GPU would launch), so
the counts do not depend on the machine.

Cases, per workload (one batch of 8 documents):

- ``forward``: a plain ``model(tokens)`` of the batch, the floor;
- ``scored_forward``: the forward pass plus the NLL sums of its logits, unintervened (what a
  pass of ``corpus_nll`` costs);
- ``faithfulness_pass``: one intervened pass of the faithfulness curves (pairs, then tokens;
  ``contribution`` ranking, comprehensiveness, 10%), its mask built and its outcome recorded;
- ``faithfulness_run``: a whole ``faithfulness`` call (both granularities, every metric, both
  modes, two fractions) divided by its passes (``1 + configurations``: the clean one included);
- ``pruning_pass``: one pass of pruning (half the heads of every layer removed, the NLL scored);
- ``pruning_run``: a whole ``prune_heads`` call (``lone=False``) divided by its passes (counted).

Each is given per pass (``per_pass``), per layer and pass, and over the forward pass's count
(``x_forward``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch

sys.path.insert(0, str(Path(__file__).parent))
from bench_ops import count_operations

RECORD = Path(__file__).parent / "records" / "bench_interventions.json"
QUICK = Path(__file__).parent / "results" / "bench_interventions.json"  # git-ignored
WORKLOADS = {  # name: (model, documents, tokens per window)
    "tiny": ("testing:tiny-llama", 8, 64),
    "embedded": (None, 8, 64),
}
FRACTIONS = (0.1, 0.5)  # the faithfulness_run case's grid


def _load(workload: str) -> tuple[Any, Any]:
    import cw_lens

    name, n_docs, n_tokens = WORKLOADS[workload]
    model = cw_lens.load_model(name) if name else cw_lens.load_model()
    corpus = cw_lens.load_corpus(n_docs=n_docs, max_tokens=n_tokens, model=model, progress=False)
    return model, corpus


def _row(total: int, passes: int, n_layers: int, floor: float) -> dict[str, Any]:
    per_pass = total / passes
    return {
        "total": total,
        "passes": passes,
        "per_pass": per_pass,
        "per_layer_pass": per_pass / n_layers,
        "x_forward": per_pass / floor,
    }


def _outcome_recorder(model: Any, batch: Any, n_docs: int) -> Any:
    """A function recording one pass's logits as the faithfulness run does (0.5's outcome sums;
    0.4's, to measure the version before)."""
    try:
        from cw_lens.analyses.faithfulness.outcomes import Outcomes
    except ImportError:  # 0.4.x
        from cw_lens.analyses.faithfulness.outcomes import _Outcomes

        old = _Outcomes(["nll|x", "count|x"], n_docs)
        return lambda logits: old.record("x", batch, logits, batch.documents, None)
    new = Outcomes(["x"], ("nll", "count"), n_docs, device=model.cfg.device)
    return lambda logits: new.record("x", batch, logits, None)


def measure(model: Any, corpus: Any) -> dict[str, Any]:
    """Every case's count on one batch of `corpus`, per pass and over the forward pass's."""
    import cw_lens
    from cw_lens.analyses.faithfulness.ranking import Ranks
    from cw_lens.analyses.pruning import passes
    from cw_lens.data import scoring
    from cw_lens.data.inputs import TokenBatch, iter_batches, prepare_inputs
    from cw_lens.data.streaming import stream_contributions

    n_layers, n_heads = model.cfg.n_layers, model.cfg.n_heads
    layers = list(range(n_layers))
    (batch,) = list(iter_batches(prepare_inputs(model, corpus), len(corpus)))
    local = TokenBatch(
        batch.tokens, batch.mask, batch.prepend_bos, batch.bos_token, list(range(len(corpus)))
    )
    out: dict[str, Any] = {}

    def forward() -> None:
        with torch.inference_mode():
            model(batch.tokens)

    floor = sum(count_operations(forward).values())
    out["forward"] = _row(floor, 1, n_layers, floor)

    def scored() -> None:
        with torch.inference_mode():
            scoring.corpus_nll(model, corpus, batch_size=len(corpus), per_document=True)

    out["scored_forward"] = _row(sum(count_operations(scored).values()), 1, n_layers, floor)

    metrics = ("contribution",)
    ranks = Ranks(batch, layers, n_heads, metrics, ("pairs", "tokens"), False, 0, 1)
    with torch.inference_mode():
        stream_contributions(
            model,
            local.tokens,
            ranks.update,
            layers=layers,
            batch_size=None,
            attention_mask=local.mask.long(),
            progress=False,
            reuse_buffers=True,
        )
    for granularity in ("pairs", "tokens"):
        record = _outcome_recorder(model, batch, len(corpus))

        def one_pass(granularity: str = granularity, record: Any = record) -> None:
            with torch.inference_mode():
                hooks = ranks.hooks(
                    model, granularity, "contribution", "comprehensiveness", 0.1, layers
                )
                record(scoring.run_logits(model, local, hooks))

        counts = count_operations(one_pass)
        row = _row(sum(counts.values()), 1, n_layers, floor)
        row["most_common"] = dict(counts.most_common(8))
        out[f"faithfulness_pass_{granularity}"] = row

    grans = ("pairs", "tokens")
    n_configs = len(grans) * 5 * 2 * len(FRACTIONS)

    def faith_run() -> None:
        cw_lens.faithfulness(
            model,
            corpus,
            granularity=grans,
            fractions=FRACTIONS,
            batch_size=len(corpus),
            per_document=True,
            progress=False,
        )

    counts = count_operations(faith_run)
    row = _row(sum(counts.values()), 1 + n_configs, n_layers, floor)
    row["most_common"] = dict(counts.most_common(8))
    out["faithfulness_run"] = row

    removed = tuple(frozenset((layer, h) for layer in layers for h in range(n_heads // 2)))

    def prune_pass() -> None:
        with torch.inference_mode():
            hooks = passes._fold_hooks(model, (frozenset(removed),))
            scoring.corpus_nll(
                model, corpus, hooks=hooks, batch_size=len(corpus), per_document=True
            )

    counts = count_operations(prune_pass)
    row = _row(sum(counts.values()), 1, n_layers, floor)
    row["most_common"] = dict(counts.most_common(8))
    out["pruning_pass"] = row

    calls = {"n": 0}
    original = scoring.run_logits

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls["n"] += 1
        return original(*args, **kwargs)

    def prune_run() -> None:
        cw_lens.prune_heads(
            model,
            corpus,
            retention=(0.75, 0.5),
            n_random=2,
            lone=False,
            batch_size=len(corpus),
            per_document=True,
            progress=False,
        )

    scoring.run_logits = counted
    try:
        counts = count_operations(prune_run)
    finally:
        scoring.run_logits = original
    # the taxonomy's streamed passes (cross-fitted: one per half) are counted as passes too
    streamed = 2
    row = _row(sum(counts.values()), calls["n"] + streamed, n_layers, floor)
    row["most_common"] = dict(counts.most_common(8))
    out["pruning_run"] = row
    return out


def print_table(workload: str, cases: dict) -> None:
    print(f"\n{workload}: operations per pass (one batch of 8 documents)")
    print(f"{'case':26s} {'per pass':>10s} {'per layer':>10s} {'x forward':>10s}")
    for case, row in cases.items():
        print(
            f"{case:26s} {row['per_pass']:10.0f} {row['per_layer_pass']:10.1f} "
            f"{row['x_forward']:10.2f}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workload", choices=sorted(WORKLOADS))
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(2)
    import cw_lens

    workloads = ["tiny"] if args.quick else [args.workload] if args.workload else list(WORKLOADS)
    path = QUICK if args.quick else RECORD
    record = json.loads(path.read_text()) if path.exists() else {}
    record.update(
        {
            "about": __doc__.split("\n\n")[1].replace("\n", " "),
            "cw_lens": cw_lens.__version__,
            "torch": torch.__version__,
            "machine": platform.machine(),
        }
    )
    record.setdefault("workloads", {})
    for workload in workloads:
        model, corpus = _load(workload)
        cases = measure(model, corpus)
        print_table(workload, cases)
        record["workloads"][workload] = {
            "documents": len(corpus),
            "tokens": WORKLOADS[workload][2],
            "n_layers": model.cfg.n_layers,
            "n_heads": model.cfg.n_heads,
            "cases": cases,
        }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=1) + "\n")
    print(f"\nwritten {path}")


if __name__ == "__main__":
    main()
