"""The main job: run every analysis on one model and corpus, store, plot, summarise.

`cw-lens figures` (`make figures`) calls `run_figures`. Each step stores its result
atomically (`<out>/.state/<fingerprint>/<step>.safetensors`, in the format of `result.save`,
written to a partial file and renamed) and a rerun skips the finished steps, so an
interrupted job resumes where it stopped;
`force=True` recomputes everything. The fingerprint covers the model, corpus, sizes, seeds and
cw_lens version, so changing any of them starts afresh; a stored step is loaded only when the
record and digest it carries are this run's (`cw_lens.reproduction.stored_steps`), else
recomputed. A run first removes the partial files a killed run left: only cw_lens's own
(`cw_lens.core.partial_files`), at the top of the output folder and in its state folders. The
figures (one PNG and one PDF each), `summary.json` and `REPORT.md` are rebuilt from the stored
results on every run, also atomically. With the same seed two runs give identical numbers in
`summary.json` (floats are rounded to 6 significant digits).

Under `torchrun` every rank computes its shard of each analysis, the accumulators are merged
exactly, and rank 0 writes.
"""

from __future__ import annotations

import hashlib
import json
import math
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from cw_lens import reproduction
from cw_lens.core.errors import InputError
from cw_lens.core.partial_files import remove_partial_files
from cw_lens.data.distributed import barrier, is_main_process, process_group_from_env
from cw_lens.reproduction.bootstrap import Bootstrap
from cw_lens.reproduction.claim_plots import plot_per_layer_intervals
from cw_lens.reproduction.markdown import build_report
from cw_lens.reproduction.run_replicates import FILE as REPLICATES_FILE
from cw_lens.reproduction.state import (
    CAUSAL_PARTS,
    FIELD_TASKS,
    MIN_RESAMPLES,
    PRESET_STEPS,
    PRESETS,
    Job,
    JobConfig,
    causal_samples,
    claim_documents,
    field_input_claim,
    field_input_number,
    item_resampled_claims,
)
from cw_lens.reproduction.steps import (
    STEP_NAMES,
    STEP_NEEDS,
    STEPS,
    select_steps,
    stored_value_problem,
)
from cw_lens.reproduction.stored_steps import (
    TIMINGS_FILE,
    atomic_write_bytes,
    atomic_write_text,
    state_root,
)
from cw_lens.reproduction.verdicts import ClaimsDict

# the steps live in reproduction.steps, the settings and the state in reproduction.state;
# re-exported for the CLI and the tests
__all__ = [
    "MIN_RESAMPLES",
    "PRESETS",
    "PRESET_STEPS",
    "STEPS",
    "STEP_NAMES",
    "STEP_NEEDS",
    "TIMINGS_FILE",
    "Job",
    "JobConfig",
    "atomic_write_bytes",
    "atomic_write_text",
    "claim_documents",
    "run_figures",
    "select_steps",
]

# summary.json's layout: 2 = three-valued verdicts ("yes" / "no" / "inconclusive"), an interval
# per check, a top-level "bootstrap" block and "per_layer" rows for the claims about layers;
# 3 = four verdicts (+ "not measured"), the bootstrap's own seed, a "provenance" block (weights
# and corpus windows) and the claim numbers' bootstrap replicates in replicates.npz; a schema-3
# summary may have a "causal_sample" block (the windows the causal analyses ran on), optional
# when read
SCHEMA = 3

# the claims of the comparison with other tools' attribution methods: one on pairs, one per task
# corpus of the input-level test
FIELD_CLAIMS = (
    "contribution_vs_field_pairs",
    *(field_input_claim(task) for task in FIELD_TASKS),
)
CLAIM_ORDER = (
    "sink_attention_vs_contribution",
    "faithfulness_order",
    "sink_value_norm_ratio",
    "sink_anti_alignment",
    "sink_contribution_drivers",
    "convex_sink_curve",
    "sink_cancels_drift",
    "sink_ablation_cone",
    "topn_beats_random",
    "sink_lowers_fn",
    "retriever_share",
    "pruning_signal",
    # beyond the papers: the comparison with other tools' attribution methods (the `field`
    # preset; a run measures them only with `field_docs` / `field_items`)
    *FIELD_CLAIMS,
)
CLAIM_FIGURES = {
    "sink_attention_vs_contribution": "sink_attention_vs_contribution",
    "faithfulness_order": "faithfulness_order",
    "sink_value_norm_ratio": "sink_value_geometry",
    "sink_anti_alignment": "sink_value_geometry",
    "sink_contribution_drivers": "sink_contribution_drivers",
    "convex_sink_curve": "convex_sink_curve",
    "sink_cancels_drift": "sink_cancels_drift",
    "sink_ablation_cone": "sink_ablation_cone",
    "topn_beats_random": "topn_beats_random",
    "sink_lowers_fn": "sink_lowers_fn",
    "retriever_share": "retriever_share",
    "pruning_signal": "pruning_signal",
    **{cid: cid for cid in FIELD_CLAIMS},
}


def runs_every_step(job: Job) -> bool:
    """Whether every step of the main job runs (the claims and readings then cover everything).

    Args:
        job: The running job.

    Returns:
        True when `job.steps` include every step of `STEP_NAMES`.
    """
    return set(job.steps) >= set(STEP_NAMES)


def clean_partial_files(out: Path) -> int:
    """Remove the partial files a killed run left behind: only files named as cw_lens names
    its partial files (`cw_lens.core.partial_files`), at the top level of `out` (the figures,
    `summary.json`, `REPORT.md`, `replicates.npz`) and in its state folders (the stored steps);
    nothing else, and no other folder.

    Args:
        out: The output folder.

    Returns:
        How many were removed.

    Raises:
        InputError: when `out/.state` is a symbolic link
            (`cw_lens.reproduction.stored_steps.state_root`).
    """
    n = remove_partial_files(out)
    root = state_root(out)
    if root.is_dir():
        n += remove_partial_files(root)
        for entry in root.iterdir():
            if entry.is_dir() and not entry.is_symlink():  # a link is never followed
                n += remove_partial_files(entry)
    return n


def run_provenance(job: Job) -> dict[str, Any]:
    """What the run measured on: the weights' record and the corpus windows' record
    (`cw_lens.reproduction.provenance`); summary.json's `provenance` block, and the inputs every
    stored step records (`Job.inputs`).

    Args:
        job: The running job (its model and corpus loaded).

    Returns:
        `{"weights": ..., "corpus": ...}`.
    """
    from cw_lens.reproduction.provenance import corpus_provenance, weights_provenance

    cfg = job.config
    return {
        "weights": weights_provenance(cfg.model, job.model, cfg.dtype),
        "corpus": corpus_provenance(job.corpus, job.model.tokenizer),
    }


def expected_claims(job: Job) -> list[str]:
    """The claims a run of every step measures: the papers' and those of the comparison with
    other tools that its settings ask for (`field_docs`, `field_items`).

    Args:
        job: The running job.

    Returns:
        Claim ids, in `CLAIM_ORDER`.
    """
    field = {"contribution_vs_field_pairs"} if job.config.field_docs else set()
    if job.config.field_items:
        field |= {field_input_claim(task) for task in FIELD_TASKS}
    return [c for c in CLAIM_ORDER if c not in FIELD_CLAIMS or c in field]


# --------------------------------------------------------------------------- figures


def make_figures(job: Job, summary: dict[str, Any] | None = None) -> dict[str, list[Path]]:
    """Every figure, named after its claim (and, given the summary, the per-layer intervals of
    the claims about layers); returns `{name: [png, pdf]}`."""
    from cw_lens import plots

    r = job.results
    figures: dict[str, Any] = {}
    if "heatmaps" in r:
        heat = r["heatmaps"]
        for i, (layer, head) in enumerate(heat["picks"]):
            figures[f"contribution_heatmap_{i + 1}"] = plots.plot_attention_vs_contribution(
                heat["result"], layer=layer, head=head
            )
    if "sinks" in r:
        stats = r["sinks"]["stats"]
        heads, decomposition = stats.heads(), stats.decomposition()
        figures["sink_attention_vs_contribution"] = plots.plot_sink_attention_vs_contribution(heads)
        figures["sink_value_geometry"] = plots.plot_sink_value_geometry(heads)
        figures["sink_contribution_drivers"] = plots.plot_sink_contribution_drivers(
            heads, decomposition
        )
        figures["convex_sink_curve"] = plots.plot_convex_sink_curve(
            stats.curve(), stats.s_star_distribution(), heads
        )
        figures["sink_cancels_drift"] = plots.plot_sink_cancels_drift(heads)
    if "ablation" in r:
        figures["sink_ablation_cone"] = plots.plot_sink_ablation_cone(r["ablation"]["ablation"])
    if "faithfulness" in r:
        figures["faithfulness_order"] = plots.plot_faithfulness_curves(r["faithfulness"]["result"])
    if r.get("task_faithfulness"):
        figures["faithfulness_task"] = plots.plot_faithfulness_curves(
            r["task_faithfulness"]["result"]
        )
    if "selection" in r:
        figures["topn_beats_random"] = r["selection"]["result"].plot()
        figures["sink_lowers_fn"] = r["selection"]["result"].plot_sink_effect()
    if "taxonomy" in r:
        figures["retriever_share"] = r["taxonomy"]["result"].plot()
    if "pruning" in r:
        figures["pruning_signal"] = r["pruning"]["result"].plot()
        if r["pruning"]["global"] is not None:
            figures["pruning_signal_global"] = r["pruning"]["global"].plot()
    if r.get("field_pairs"):
        figures["contribution_vs_field_pairs"] = plots.plot_faithfulness_curves(
            r["field_pairs"]["result"]
        )
    for task, result in (r.get("field_inputs") or {}).items():
        figures[field_input_claim(task)] = result.plot()
    if summary is not None and any(c.get("per_layer") for c in summary["claims"].values()):
        figures["per_layer_intervals"] = plot_per_layer_intervals(summary["claims"])
    written = {}
    for name, fig in figures.items():
        written[name] = plots.save_figure(fig, job.out / name)
    return written


# --------------------------------------------------------------------------- summary


def _round(value: Any, digits: int = 6) -> Any:
    """JSON-ready: floats to `digits` significant digits, NaN/inf to None, recursively."""
    if isinstance(value, dict):
        return {str(k): _round(v, digits) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_round(v, digits) for v in value]
    if isinstance(value, torch.Tensor):
        return _round(value.tolist(), digits)
    if hasattr(value, "item") and not isinstance(value, (str, bytes)):
        try:
            value = value.item()
        except (ValueError, AttributeError):
            pass
    if isinstance(value, bool) or value is None or isinstance(value, (int, str)):
        return value
    if isinstance(value, float):
        if not math.isfinite(value):
            return None
        return float(f"{value:.{digits}g}")
    return str(value)


def job_bootstrap(config: JobConfig) -> Bootstrap:
    """The bootstrap of a run's claim intervals: `config.n_resamples` resamples, 95%, seeded
    by `config.bootstrap_seed` (its own seed, not the run's: two run seeds change the
    documents and random baselines, not the resampling noise)."""
    return Bootstrap(resamples=config.n_resamples, level=0.95, seed=config.bootstrap_seed)


def collect_claims(job: Job) -> ClaimsDict:
    """Every claim of the run in `CLAIM_ORDER`, with its intervals; `.replicates`
    keeps the checks' bootstrap replicates."""
    r = job.results
    boot = job_bootstrap(job.config)
    claims = ClaimsDict()
    claims.replicates = {}

    def add(part: dict[str, dict[str, Any]]) -> None:
        claims.update(part)
        claims.replicates.update(getattr(part, "replicates", {}))

    if "sinks" in r:
        add(reproduction.claims(r["sinks"]["stats"], boot))
    if "ablation" in r:
        add(reproduction.claims(r["ablation"]["ablation"], boot))
    if "faithfulness" in r:
        add(reproduction.claims(r["faithfulness"]["result"], boot))
    if r.get("task_faithfulness") and "faithfulness_order" in claims:
        task = r["task_faithfulness"]
        task_claim = reproduction.claims(task["result"])["faithfulness_order"]
        claims["faithfulness_order"]["measured"][f"task_{task['task']}"] = {
            "n_items": task["n_items"],
            **task_claim["measured"],
        }
    if "selection" in r:
        add(reproduction.claims(r["selection"]["result"], boot))
    if "taxonomy" in r:
        add(reproduction.claims(r["taxonomy"]["result"], boot))
    if "pruning" in r:
        pruning = r["pruning"]["result"]
        add(reproduction.claims(pruning, boot, other_scope=r["pruning"]["global"]))
    if r.get("field_pairs"):
        part = reproduction.claims(r["field_pairs"]["result"], boot)
        cid = "contribution_vs_field_pairs"  # its faithfulness_order is not the run's
        claims[cid] = part[cid]
        claims.replicates.update({k: v for k, v in part.replicates.items() if k[0] == cid})
    for task, result in (r.get("field_inputs") or {}).items():
        # one claim per task corpus, named after it
        part, general = reproduction.claims(result, boot), "contribution_vs_field_inputs"
        cid, claim = field_input_claim(task), part[general]
        # and its numbers after it too: each task's have their own coverage
        numbers = {c["number"]: field_input_number(task, c["number"]) for c in claim["checks"]}
        claims[cid] = {
            **claim,
            "measured": {numbers.get(k, k): v for k, v in claim["measured"].items()}
            | {"task": task},
            "checks": [{**c, "number": numbers[c["number"]]} for c in claim["checks"]],
        }
        claims.replicates.update(
            {(cid, numbers[n]): v for (c, n), v in part.replicates.items() if c == general}
        )
    for cid, claim in claims.items():
        claim["figure"] = f"{CLAIM_FIGURES.get(cid, cid)}.png"
    missing = [c for c in expected_claims(job) if c not in claims]
    if missing and runs_every_step(job):
        raise RuntimeError(f"claims not measured: {missing}")
    ordered = ClaimsDict((cid, claims[cid]) for cid in CLAIM_ORDER if cid in claims)
    ordered.replicates = claims.replicates
    return ordered


# the causal claims and the sample (`causal_samples`) each resamples
CAUSAL_CLAIMS = {
    "faithfulness_order": "faithfulness",
    "pruning_signal": "pruning",
    "contribution_vs_field_pairs": "field",
}


def replicates_file(job: Job, claims: ClaimsDict) -> bytes:
    """`replicates.npz` of the run (`cw_lens.reproduction.run_replicates`): the claims' replicates,
    the documents' token-id hashes, how many documents each claim resampled and which ones for
    the causal claims (their random samples), so that a comparison pairs two runs' causal
    claims only when both resampled the same documents (and never pairs the claims that
    resample task items)."""
    from cw_lens.reproduction.provenance import document_hashes
    from cw_lens.reproduction.run_replicates import pack

    # the input-level comparisons resample task items, not corpus documents: recorded with no
    # documents, so a comparison of two runs never pairs their replicates
    items = item_resampled_claims(job)
    per_claim = {c: n for c, n in claim_documents(job, claims).items() if c not in items}
    samples = causal_samples(job)
    sampled = {cid: samples[part] for cid, part in CAUSAL_CLAIMS.items() if cid in claims}
    documents = document_hashes(job.corpus, job.model.tokenizer)
    boot = job_bootstrap(job.config).to_dict()
    return pack(claims.replicates, documents, per_claim, boot, claim_documents=sampled)


def build_summary(job: Job) -> tuple[dict[str, Any], bytes]:
    """`summary.json`'s content and `replicates.npz`'s bytes (the summary records their
    SHA-256, so a comparison never reads another run's replicates)."""
    from cw_lens.models.load import model_name
    from cw_lens.reproduction.interval_coverage import settle_by_coverage
    from cw_lens.reproduction.provenance import causal_sample_record, versions

    cfg = job.config
    corpus = job.corpus
    n_tokens = sum(len(d.tokens) for d in corpus if d.tokens is not None)
    claims = collect_claims(job)
    replicates = replicates_file(job, claims)
    # the causal steps that ran: which windows they ran on (`causal_samples`)
    ran = {p: ix for p, ix in causal_samples(job).items() if CAUSAL_PARTS[p] in job.steps}
    causal = {"causal_sample": causal_sample_record(corpus, ran, cfg.causal_seed)} if ran else {}
    summary = {
        "schema": SCHEMA,
        "model": model_name(job.model),
        "corpus": corpus.name,
        "n_documents": len(corpus),
        "n_tokens": n_tokens + len(corpus),  # text tokens plus one BOS per document
        "max_tokens": cfg.max_tokens,
        "seed": cfg.seed,
        "prepend_bos": True,
        "bos_token": job.model.tokenizer.bos_token if job.model.tokenizer else None,
        "versions": versions(),
        "provenance": job.inputs or run_provenance(job),
        **causal,
        "bootstrap": job_bootstrap(cfg).to_dict(),
        "replicates": {
            "file": REPLICATES_FILE,
            "sha256": hashlib.sha256(replicates).hexdigest(),
            "numbers": len(claims.replicates),
            "bytes": len(replicates),
        },
        "claims": dict(claims),
    }
    settle_by_coverage(summary, claim_documents(job, summary["claims"]))
    if not runs_every_step(job):  # a full run's summary is unchanged by the option
        summary["steps_not_run"] = [s for s in STEP_NAMES if s not in job.steps]
    return _round(summary), replicates


def run_figures(
    config: JobConfig,
    out: Path | str = "figures",
    *,
    force: bool = False,
    progress: bool = True,
    steps: Sequence[str] | None = None,
    skip: Sequence[str] | None = None,
) -> dict[str, Any]:
    """Run (or resume) the main job and write figures, `summary.json` and `REPORT.md`.

    `steps` / `skip` choose the steps (`STEP_NAMES`; default: all) — see
    `select_steps`. The claims and figures of a step that does not run are left out and
    the summary lists it under `steps_not_run`; stored steps are shared with full runs of the
    same configuration, so a later full run resumes them."""
    from cw_lens.data.corpora import load_corpus
    from cw_lens.models.load import load_model

    chosen = select_steps(steps, skip)

    out = Path(out)
    with process_group_from_env(config.device):
        if is_main_process():
            removed = clean_partial_files(out)
            if removed and progress:
                print(f"removed {removed} partial file(s) of an interrupted run", file=sys.stderr)
        barrier()
        torch.manual_seed(config.seed)
        dtype = getattr(torch, config.dtype, None)
        if not isinstance(dtype, torch.dtype):
            raise InputError(f"Unknown dtype {config.dtype!r}; use float32, bfloat16 or float16.")
        job = Job(
            config,
            out,
            force=force,
            progress=progress,
            steps=chosen,
            needs=STEP_NEEDS,
            check_value=stored_value_problem,
        )
        job.model = load_model(config.model, api=config.api, device=config.device, dtype=dtype)
        job.corpus = load_corpus(
            config.corpus,
            n_docs=config.n_docs,
            max_tokens=config.max_tokens,
            tokenizer=job.model,
            seed=config.seed,
        )
        job.inputs = run_provenance(job)  # every stored step records them
        for name, fn in STEPS:
            if name in chosen:
                job.step(name, fn)
        summary, replicates = build_summary(job)
        if is_main_process():
            figures = make_figures(job, summary)
            atomic_write_bytes(out / REPLICATES_FILE, replicates)
            atomic_write_text(out / "summary.json", json.dumps(summary, indent=2) + "\n")
            atomic_write_text(out / "REPORT.md", build_report(job, summary, figures))
        barrier()
        return summary
