"""Coverage study: how often each claim number's 95% bootstrap interval covers the truth.

Protocol (``docs/coverage.md`` holds the table and the run's numbers):

1. A pool of ``--pool`` documents (windows of 256 tokens of ``load_corpus("pydoc+stdlib")``)
   of the embedded model; every non-causal analysis (sink statistics, sink ablation, selection
   geometry, head taxonomy) runs once on it with ``per_document=True``. The results are cached
   under ``benchmarks/results/coverage_pool_<pool>/`` so reruns only redo step 2.
2. The truth of each interval-bearing claim number is its value on the whole pool (the
   analysis's own replicate formula on the pool's corpus row,
   :mod:`cw_lens.reproduction.resampled`).
3. For each document count ``n`` (``--sizes``) and each of ``--draws`` draws: ``n`` documents
   drawn from the pool with replacement (the pool is the population, so the truth is exactly
   the pool's number), seeded by the draw's index; the bootstrap (``--resamples``, its seed
   the draw's index) on those documents alone, through the analyses' own
   ``replicates(Bootstrap(documents=...))``; for every method of :data:`METHODS` the interval
   from the same replicates. A draw covers when ``low <= truth <= high``; a missing interval
   (NaN) counts as not covering and is counted apart.

The table: per (number, n, method), the share of draws that covered, with its binomial
standard error. Results go to ``benchmarks/results/coverage.json``.

    python benchmarks/coverage.py [--pool 128 | --run RUN] [--sizes 8 32 48 256]
                                  [--draws 300] [--resamples 2000] [--analyses sinks ...]

``--run RUN`` takes the pool from a finished main-job run instead of step 1: the per-document
records its non-causal steps stored (``cw-lens figures --preset paper --out RUN``: 256 windows
of 256 tokens of pydoc+stdlib, the same corpus as step 1 with more windows). Only from a run:
the causal analyses (``faithfulness``, ``pruning``), whose pool is the run's causal sample (32
windows drawn at random in the paper preset; ``--sizes 8 16 32``); pruning's random orders are
part of the population too, so each draw also takes as many orders as the run has from its
orders, with replacement. Their rankings (the taxonomy's, cross-fitted) stay the run's: the
study measures the intervals given them.

The comparison with other tools (``--run figures/field --analyses field_pairs`` with ``--sizes
8 16``, ``field_inputs_ioi field_inputs_arithmetic`` with ``--sizes 8 16 32``): the pool is
the ``field`` preset's own sample (16 windows; 32 task items each). Its numbers are the
subject's difference from the best rival, and each draw picks that rival on its own AOPCs, as
a run does (``field_comparison.field_numbers``); the truth is the difference from the whole
sample's best rival. The input-level numbers are named after their task, as the main job
names them (``job_numbers``).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch

from cw_lens import reproduction

RESULTS = Path(__file__).parent / "results"
METHODS = ("percentile", "bca", "expanded", "basic", "bias_corrected")
# the comparison with other tools (`cw-lens figures --preset field`): its pair-level test and
# its input-level test on each task corpus
FIELD = ("field_pairs", "field_inputs_ioi", "field_inputs_arithmetic")
ANALYSES = ("taxonomy", "sinks", "ablation", "selection", "faithfulness", "pruning", *FIELD)
# only from a run (--run): their pool costs hours
CAUSAL = ("faithfulness", "pruning", *FIELD)


def cw_lens_load_result(path: Path) -> object:
    """A result saved by ``result.save`` (``cw_lens.load_result``)."""
    from cw_lens import load_result

    return load_result(path)


def pool_results(n_pool: int, analyses: tuple[str, ...]) -> dict[str, object]:
    """Each analysis on the pool (cached: computed once, then loaded)."""
    folder = RESULTS / f"coverage_pool_{n_pool}"
    folder.mkdir(parents=True, exist_ok=True)
    out, model, corpus = {}, None, None
    for name in analyses:
        path = folder / f"{name}.safetensors"
        if path.exists():  # `result.save`'s format: loading runs no code from the file
            out[name] = cw_lens_load_result(path)
            continue
        import cw_lens
        from cw_lens.analyses.selection import selection_geometry
        from cw_lens.analyses.sinks import sink_ablation, sink_statistics
        from cw_lens.analyses.taxonomy import head_taxonomy

        if model is None:
            model = cw_lens.load_model()
            corpus = cw_lens.load_corpus(
                "pydoc+stdlib", n_docs=n_pool, max_tokens=256, model=model, seed=0
            )
        run = {
            "taxonomy": head_taxonomy,
            "sinks": sink_statistics,
            "ablation": sink_ablation,
            "selection": selection_geometry,
        }[name]
        start, cpu = time.perf_counter(), time.process_time()
        out[name] = run(model, corpus, progress=False, per_document=True)
        print(
            f"[pool] {name}: {time.perf_counter() - start:.0f} s wall, "
            f"{time.process_time() - cpu:.0f} s CPU",
            flush=True,
        )
        out[name].save(path)
    return out


# where the main job stores each analysis: (step name, key in the step's stored dict)
JOB_STEPS = {
    "sinks": ("sinks", "stats"),
    "ablation": ("ablation", "ablation"),
    "selection": ("selection", "result"),
    "taxonomy": ("taxonomy", "result"),
    "faithfulness": ("faithfulness", "result"),
    "pruning": ("pruning", "result"),
    "field_pairs": ("field_pairs", "result"),
    "field_inputs_ioi": ("field_inputs", "ioi"),
    "field_inputs_arithmetic": ("field_inputs", "arithmetic"),
}


def run_results(run: Path, analyses: tuple[str, ...]) -> dict[str, object]:
    """Each analysis as a finished main-job run stored it (``cw-lens figures --out RUN``): its
    per-document records are the pool, so the pool costs nothing beyond the run itself."""
    wanted = {JOB_STEPS[name][0] for name in analyses}
    from cw_lens.reproduction.stored_steps import STEP_SUFFIX, load_step

    states = [
        d
        for d in (run / ".state").glob("*")
        if wanted <= {p.stem for p in d.glob(f"*{STEP_SUFFIX}")}
    ]
    if len(states) != 1:
        raise SystemExit(
            f"{run}/.state/ holds {len(states)} stored runs with the steps {sorted(wanted)}; "
            "need exactly one (run `cw-lens figures --out RUN` to completion first)."
        )
    out = {}
    for name in analyses:
        step, key = JOB_STEPS[name]
        # a stored step (safetensors, `cw_lens.core.saving`): loading runs no code from the file
        stored, why = load_step(states[0] / f"{step}{STEP_SUFFIX}")
        if why is not None or not isinstance(stored, dict) or key not in stored:
            raise SystemExit(f"{run}: step {step!r} does not load ({why or 'no ' + repr(key)}).")
        out[name] = stored[key]
    return out


def replicate_numbers(
    result: object, bootstrap: object, drivers: bool = True
) -> dict[str, torch.Tensor]:
    """The claim numbers of one analysis in every row of ``bootstrap.weights`` (the sink
    statistics without their driver numbers when ``drivers`` is False)."""
    from cw_lens import SinkStatisticsResult

    if drivers or not isinstance(result, SinkStatisticsResult):  # only they have driver numbers
        reps = reproduction.replicates(result, bootstrap)
    else:
        reps = reproduction.replicates(result, bootstrap, drivers=False)
    if isinstance(reps, tuple):  # sink statistics: (numbers, per-head fields)
        reps = reps[0]
    return {k: v for k, v in reps.items() if v.dim() == 1}


def job_numbers(analysis: str, numbers: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The numbers under the names the main job gives them: an input-level test's after its
    task (``state.field_input_number``); of the pair-level test's faithfulness result only the
    comparison's (``pairs_...``: its ``faithfulness_order`` numbers are not the run's)."""
    from cw_lens.reproduction.state import field_input_number

    if analysis.startswith("field_inputs_"):
        task = analysis.removeprefix("field_inputs_")
        return {field_input_number(task, k): v for k, v in numbers.items()}
    if analysis == "field_pairs":
        return {k: v for k, v in numbers.items() if k.startswith("pairs_")}
    return numbers


def n_records(result: object) -> int:
    """How many documents (task items) the analysis's per-document record holds."""
    from cw_lens import InputDeletionResult

    if isinstance(result, InputDeletionResult):  # one row of AOPCs per item that has them
        return len(result.item_aopc().dropna())
    record = getattr(result, "per_document", None)
    if record is None:  # the sink statistics: `record` [document, layer, head, recorded]
        record = getattr(result, "record", None)
    if record is None:
        raise SystemExit(
            f"{type(result).__name__}: no per-document record (run it with per_document=True)."
        )
    if isinstance(record, dict):  # pruning: one (NLL sum, count) table per condition
        record = next(iter(record.values()))
    elif isinstance(record, tuple):  # the first table of the record (faithfulness: names first)
        record = next(r for r in record if isinstance(r, torch.Tensor))
    return int(record.shape[0])


def draw_documents(n_pool: int, n: int, gen: torch.Generator, replace: bool = True) -> list[int]:
    """``n`` indices into a pool of ``n_pool`` documents: with replacement (the run's own
    windows as the population) or without (a population whose every document is known)."""
    if replace:
        return torch.randint(n_pool, (n,), generator=gen).tolist()
    if n > n_pool:
        raise ValueError(f"cannot draw {n} documents without replacement from {n_pool}.")
    return torch.randperm(n_pool, generator=gen)[:n].tolist()


def bias_to_se(reps: torch.Tensor, resamples: int) -> float:
    """``|mean(t*) - t| / sd(t*)`` of one number's replicates (``t`` the corpus row): the
    library's ``cw_lens.reproduction.bootstrap.bias_to_se``."""
    from cw_lens.reproduction.bootstrap import bias_to_se as library_bias_to_se

    return library_bias_to_se(float(reps[resamples]), reps[:resamples])


def binomial_se(covered: int, draws: int) -> float:
    """The binomial standard error of a coverage of ``covered`` in ``draws`` (floored above 0,
    so a coverage of 0 or 1 keeps a finite z)."""
    share = covered / draws
    return math.sqrt(max(share * (1 - share), 1e-12) / draws)


def study(
    results: dict[str, object],
    sizes: list[int],
    draws: int,
    resamples: int,
    drivers: bool = True,
    numbers: list[str] | None = None,
    *,
    replace: bool = True,
    pool: list[int] | None = None,
    seed_offset: int = 0,
    boot_seed_offset: int = 0,
    subset: object = None,
    draw: object = None,
) -> list[dict[str, object]]:
    """Coverage per (analysis, number, n, method) over ``draws`` draws of ``n`` documents
    from the pool (``pool``: these record rows only, e.g. a quarter of a population; the
    truth is then the sub-pool's value), with or without ``replace``-ment; the draws' seeds
    are ``10000 n + draw + seed_offset``, their bootstraps' ``draw + boot_seed_offset`` (a second,
    independent study changes both). ``subset(result, docs)`` (draws without replacement
    only): a result holding only those rows, bootstrapped as a whole — the same replicates as
    ``Bootstrap(documents=docs)`` on the whole result, at a cost in ``n``, not the pool.
    ``draw(n_pool, n, gen)``: another design of the draws (default ``draw_documents``)."""
    from cw_lens.reproduction.bootstrap import Bootstrap, interval

    rows = []
    for name, result in results.items():
        members = list(range(n_records(result))) if pool is None else list(pool)
        whole = Bootstrap(resamples=1, documents=None if pool is None else members)
        truth = {
            k: float(v[1])  # the corpus row of a one-resample bootstrap
            for k, v in job_numbers(name, replicate_numbers(result, whole, drivers)).items()
            if numbers is None or k in numbers
        }
        for n in sizes:
            start, cpu = time.perf_counter(), time.process_time()
            hits = {(k, m): [0, 0] for k in truth for m in METHODS}
            bias = {k: [] for k in truth}
            for d in range(draws):
                gen = torch.Generator().manual_seed(10_000 * n + d + seed_offset)
                picks = (
                    draw_documents(len(members), n, gen, replace)
                    if draw is None
                    else draw(len(members), n, gen)
                )
                docs = [members[i] for i in picks]
                # a random control (pruning's draws) is part of the population too: as many
                # draws as the pool has, drawn from them with replacement
                n_draws = getattr(result, "n_random_draws", 0) or 0
                picked = (
                    torch.randint(n_draws, (n_draws,), generator=gen).tolist() if n_draws else None
                )
                if subset is not None and not replace:
                    boot = Bootstrap(resamples=resamples, seed=d + boot_seed_offset, draws=picked)
                    target = subset(result, docs)
                else:
                    boot = Bootstrap(
                        resamples=resamples, seed=d + boot_seed_offset, documents=docs, draws=picked
                    )
                    target = result
                drawn = job_numbers(name, replicate_numbers(target, boot, drivers))
                for k, reps in drawn.items():
                    if k not in truth:
                        continue
                    bias[k].append(bias_to_se(reps, resamples))
                    for m in METHODS:
                        low, high = interval(reps, resamples, boot.level, m).tolist()
                        if math.isnan(low) or math.isnan(high):
                            hits[(k, m)][1] += 1
                        elif low <= truth[k] <= high:
                            hits[(k, m)][0] += 1
            wall, cpu = time.perf_counter() - start, time.process_time() - cpu
            print(f"[{name}] n={n}: {wall:.0f} s wall, {cpu:.0f} s CPU", flush=True)
            for (k, m), (covered, missing) in hits.items():
                share = covered / draws
                rows.append(
                    {
                        "analysis": name,
                        "number": k,
                        "truth": truth[k],
                        "n": n,
                        "method": m,
                        "coverage": share,
                        "covered": covered,
                        "se": binomial_se(covered, draws),
                        "missing": missing,
                        "draws": draws,
                        "mean_bias_to_se": float(torch.tensor(bias[k]).nanmean()),
                        "seconds": wall,
                        "cpu_seconds": cpu,
                    }
                )
    return rows


def table(rows: list[dict[str, object]]) -> str:
    """Markdown: one row per (number, n), one column per method."""
    import pandas as pd

    df = pd.DataFrame(rows)
    df["cell"] = [
        f"{c:.3f}" + (f" ({m} missing)" if m else "")
        for c, m in zip(df["coverage"], df["missing"], strict=True)
    ]
    wide = df.pivot_table(
        index=["analysis", "number", "n"], columns="method", values="cell", aggfunc="first"
    )
    wide = wide[[m for m in METHODS if m in wide.columns]].reset_index()
    lines = ["| " + " | ".join(wide.columns) + " |", "|" + "---|" * len(wide.columns)]
    lines += ["| " + " | ".join(map(str, row)) + " |" for row in wide.itertuples(index=False)]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--pool", type=int, default=128)
    parser.add_argument(
        "--run",
        type=Path,
        help="a finished main-job output folder whose per-document records are the pool "
        "(e.g. the paper preset's 256 windows); --pool is then ignored",
    )
    parser.add_argument("--sizes", type=int, nargs="+", default=[8, 32, 48, 256])
    parser.add_argument("--draws", type=int, default=300)
    parser.add_argument("--resamples", type=int, default=2000)
    parser.add_argument("--analyses", nargs="+", default=list(ANALYSES), choices=ANALYSES)
    parser.add_argument(
        "--without-drivers",
        action="store_true",
        help="leave out the sink statistics' driver numbers (median_abs_rho_*): about 95%% of "
        "a sink draw's cost at 256 documents; their rows from earlier studies are kept",
    )
    parser.add_argument(
        "--numbers",
        nargs="+",
        help="study only these claim numbers (the others' rows from earlier studies are kept)",
    )
    parser.add_argument(
        "--seed-offset",
        type=int,
        default=0,
        help="added to every draw's and bootstrap's seed: a nonzero offset makes an independent "
        "second study of the same design (``population.py package-table --second-single-pool``)",
    )
    parser.add_argument("--result", type=Path, default=RESULTS / "coverage.json")
    args = parser.parse_args()
    torch.set_num_threads(int(os.environ.get("CW_COVERAGE_THREADS", "2")))
    start, cpu = time.perf_counter(), time.process_time()
    if args.run is not None:
        results = run_results(args.run, tuple(args.analyses))
        args.pool = n_records(next(iter(results.values())))
    else:
        if set(args.analyses) & set(CAUSAL):
            raise SystemExit(
                f"{sorted(set(args.analyses) & set(CAUSAL))}: the causal analyses' pool comes "
                "only from a finished run (--run RUN); computing it here would take hours."
            )
        results = pool_results(args.pool, tuple(args.analyses))
    rows = study(
        results,
        args.sizes,
        args.draws,
        args.resamples,
        not args.without_drivers,
        args.numbers,
        seed_offset=args.seed_offset,
        boot_seed_offset=args.seed_offset,
    )
    out = args.result
    previous = json.loads(out.read_text()) if out.exists() else {"rows": []}
    done = {(r["analysis"], r["number"], r["n"]) for r in rows}  # rows replaced per number
    kept = [r for r in previous["rows"] if (r["analysis"], r["number"], r["n"]) not in done]
    meta = {"pool": args.pool, "draws": args.draws, "resamples": args.resamples}
    meta["seed_offset"] = args.seed_offset
    meta["source"] = str(args.run) if args.run is not None else f"coverage_pool_{args.pool}"
    meta.update(wall_s=time.perf_counter() - start, cpu_s=time.process_time() - cpu)
    out.write_text(json.dumps({"meta": meta, "rows": kept + rows}, indent=1))
    print(table(kept + rows))
    # the reports' table is written by `population.py package-table --single-pool`, which
    # keeps the population study's rows for the numbers it measures
    print(json.dumps(meta))


if __name__ == "__main__":
    main()
