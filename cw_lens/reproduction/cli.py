"""The `cw-lens` command line: `figures` (the main job), `analyze` and `compare`.

Nothing heavy is imported at module level: `cw-lens --help` and `cw-lens --version` answer
without importing torch or TransformerLens; each command imports what it needs when it runs.
Help is plain text (no rich boxes): the command docstrings below are what `--help` prints.
"""

from __future__ import annotations

from pathlib import Path

import typer

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    rich_markup_mode=None,
    pretty_exceptions_enable=False,
    help="Contribution weights and attention-sink geometry for TransformerLens models.",
)

# the main job's steps in order (reproduction.job.STEP_NAMES; tests/test_cli.py checks they agree)
STEP_NAMES = (
    "sinks",
    "heatmaps",
    "ablation",
    "faithfulness",
    "task_faithfulness",
    "selection",
    "taxonomy",
    "pruning",
    "field_pairs",
    "field_inputs",
)
# the default output folder of `cw-lens figures`: never the committed gallery `figures/`
DEFAULT_OUT = Path("runs") / "default"


def _version(value: bool) -> None:
    if value:
        from cw_lens.version import __version__

        typer.echo(f"cw_lens {__version__}")
        raise typer.Exit()


@app.callback()
def main(
    version: bool = typer.Option(
        False,
        "--version",
        callback=_version,
        is_eager=True,
        help="Print the cw_lens version and exit.",
    ),
) -> None:
    """Contribution weights and attention-sink geometry for TransformerLens models.

    Run a command with --help for its options.
    """


def verdict_line(claims: dict[str, dict]) -> str:
    """The console's one-line count of a summary's verdicts, in the report's words; the
    counts add up to the number of claims.

    Args:
        claims: The summary's `claims` (`{claim id: {"holds": verdict, ...}}`).

    Returns:
        E.g. `"11 claims: 3 yes, 2 no, 6 inconclusive, 0 not measured"`.

    Examples:
        >>> verdict_line({"a": {"holds": "yes"}, "b": {"holds": "no"}})
        '2 claims: 1 yes, 1 no, 0 inconclusive, 0 not measured'
    """
    from cw_lens.reproduction.verdicts import (
        VERDICTS,  # the report's own words (REPORT.md's column)
    )

    verdicts = [c["holds"] for c in claims.values()]
    unknown = sorted(set(verdicts) - set(VERDICTS))
    if unknown:  # never a claim left out of the count
        raise ValueError(f"unknown verdicts {unknown}")
    counts = ", ".join(f"{verdicts.count(v)} {v}" for v in VERDICTS)
    return f"{len(verdicts)} claims: {counts}"


def _clean_errors(fn):
    """Report cw_lens errors as one line on stderr with exit code 2, not a stack trace."""
    import functools

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        from cw_lens.core.errors import CwLensError

        try:
            return fn(*args, **kwargs)
        except CwLensError as exc:
            typer.echo(f"error: {exc}", err=True)
            raise typer.Exit(2) from None

    return wrapper


API_HELP = "bridge (TransformerBridge), hooked (HookedTransformer) or auto (the bridge if any)."


def _names(value: str | None) -> list[str] | None:
    """A comma-separated option as a list (None when not given)."""
    if value is None:
        return None
    return [s.strip() for s in value.split(",") if s.strip()]


def _granularity(value: str | None) -> tuple[str, ...] | None:
    """`--faithfulness-granularity pairs,tokens` as the job's tuple, checked."""
    names = _names(value)
    if names is None:
        return None
    unknown = [n for n in names if n not in ("pairs", "tokens")]
    if unknown or not names:
        raise typer.BadParameter(
            f"{value!r}: give pairs, tokens or both, comma-separated.",
            param_hint="--faithfulness-granularity",
        )
    return tuple(names)


def _load(model: str | None, device: str | None, api: str):
    from cw_lens.models.load import load_model

    return load_model(model, api=api, device=device)


@app.command()
@_clean_errors
def analyze(
    text: str = typer.Argument(..., help="The text to analyse."),
    layer: int | None = typer.Option(None, help="Only this layer (default: every layer)."),
    head: int | None = typer.Option(None, help="Only this head (default: summed over heads)."),
    k: int = typer.Option(5, help="Tokens to list per layer."),
    html: Path | None = typer.Option(None, help="Write the interactive HTML view here."),
    model: str | None = typer.Option(None, help="Model name or .gguf path (default: embedded)."),
    device: str | None = typer.Option(None, help="cpu, cuda, ..."),
    api: str = typer.Option("auto", help=API_HELP),
) -> None:
    """Print the tokens that contribute most to the last token's attention output per layer.

    Scores are inter-head contribution weights summed over heads (a token's share of the layer
    output, printed as token@position weight), or one head's with --head.
    """
    from cw_lens.analyses.contributions import contribution_weights

    loaded = _load(model, device, api)
    result = contribution_weights(
        loaded, text, kind="inter", layers=None if layer is None else [layer]
    )
    tokens = result.str_tokens[0]
    typer.echo(f"{len(tokens)} tokens; query = last token {tokens[-1]!r}")
    for lay in result.layers:
        top = result.top(layer=lay, head=head, k=k, sum_heads=head is None)
        cells = ", ".join(
            f"{t!r}@{p} {w:+.3f}"
            for t, p, w in zip(top["key_token"], top["key"], top["weights"], strict=True)
        )
        typer.echo(f"layer {lay:>2}: {cells}")
    if html is not None:
        result.to_html(html)
        typer.echo(f"wrote {html}")


FIGURES_HELP = """Run every analysis and write figures (PNG + PDF), summary.json and REPORT.md.

    Resumable: finished steps are stored and skipped on a rerun (--force recomputes). A step
    that another needs is added (heatmaps needs sinks, pruning needs taxonomy); the claims of
    steps that did not run are left out. On a GPU: --device cuda --dtype bfloat16 --n-docs 256
    --max-tokens 1024 --batch-size 16. Under torchrun the documents are sharded over ranks and
    the results merged exactly.
    """


@app.command(help=FIGURES_HELP)
@_clean_errors
def figures(
    model: str | None = typer.Option(None, help="Model name or .gguf path (default: embedded)."),
    preset: str = typer.Option(
        "quick",
        help="Sizes: quick (8 x 128 tokens of pydoc, about 7 min), paper (256 x 256 tokens of "
        "pydoc+stdlib, causal analyses on 32 of them drawn at random, 20 random pruning orders; "
        "43-75 min on two cores) or field (only the comparison with other tools' attribution "
        "methods: 16 x 128 tokens of pydoc for the pair-level test, 32 items each of ioi and "
        "arithmetic for the input-level test). The options below override it.",
    ),
    corpus: str | None = typer.Option(
        None, help="Corpus: pydoc (default), stdlib, pydoc+stdlib, a .txt/.jsonl path or hf:NAME."
    ),
    n_docs: int | None = typer.Option(None, help="Documents (quick 8, paper 256)."),
    max_tokens: int | None = typer.Option(
        None, help="Tokens per document, BOS added on top (quick 128, paper 256)."
    ),
    out: Path = typer.Option(
        DEFAULT_OUT, help="Output folder (--out figures regenerates the committed gallery)."
    ),
    steps: str | None = typer.Option(
        None, help=f"Run only these steps, comma-separated: {', '.join(STEP_NAMES)}."
    ),
    skip: str | None = typer.Option(None, help="Leave these steps out, comma-separated."),
    device: str | None = typer.Option(None, help="cpu, cuda, ... (default: TransformerLens')."),
    dtype: str = typer.Option("float32", help="Model dtype: float32, bfloat16, float16."),
    api: str = typer.Option("auto", help=API_HELP),
    seed: int = typer.Option(0, help="Seed for windows, random baselines and sampling."),
    n_resamples: int = typer.Option(
        2000, help="Bootstrap resamples of the claims' intervals (at least 2000)."
    ),
    bootstrap_seed: int = typer.Option(
        0, help="The bootstrap's own seed (resampling only; --seed leaves it unchanged)."
    ),
    batch_size: int = typer.Option(8, help="Documents per forward pass."),
    task: str = typer.Option("ioi", help="Task set for task faithfulness ('none' to skip)."),
    task_docs: int = typer.Option(24, help="Task items (kept only if answered correctly)."),
    faithfulness_docs: int | None = typer.Option(
        None,
        help="Documents the faithfulness step uses, drawn at random from the corpus (default: "
        "all; paper 32; it is the slow step).",
    ),
    lone_docs: int | None = typer.Option(
        None, help="Documents for the lone-head costs of pruning (2)."
    ),
    random_draws: int | None = typer.Option(
        None, help="Draws of faithfulness's random ranking (> 1 reports their spread; 1)."
    ),
    faithfulness_granularity: str | None = typer.Option(
        None,
        "--faithfulness-granularity",
        help="Faithfulness granularities: pairs, tokens or both (quick and paper: pairs).",
    ),
    pruning_docs: int | None = typer.Option(
        None,
        help="Documents pruning runs on, drawn at random from the corpus (default: all; paper 32).",
    ),
    causal_seed: int = typer.Option(
        0,
        help="Seed of the random sample of documents faithfulness and pruning run on (equal "
        "counts: the same documents).",
    ),
    pruning_draws: int | None = typer.Option(
        None, help="Random pruning orders (quick 3, paper 20; a verdict needs at least 20)."
    ),
    pruning_draws_everywhere: int | None = typer.Option(
        None, help="Random orders also evaluated at 50% and 25% retention (default: all)."
    ),
    global_ranking: bool | None = typer.Option(
        None,
        "--global-ranking/--no-global-ranking",
        help="Also prune with one global ranking, the variant (quick and paper: no).",
    ),
    field_docs: int | None = typer.Option(
        None,
        help="Windows of the pair-level comparison with other tools' metrics, drawn at random "
        "(quick and paper 0: left out; field 16).",
    ),
    field_items: int | None = typer.Option(
        None,
        help="Items per task corpus (ioi, arithmetic) of the input-level comparison (quick and "
        "paper 0: left out; field 32).",
    ),
    force: bool = typer.Option(False, "--force", help="Recompute every step."),
    quiet: bool = typer.Option(False, "--quiet", help="No progress output."),
) -> None:
    """The `figures` command (its help text is `FIGURES_HELP`)."""
    # Long: one typer option per job setting.

    from cw_lens.reproduction.job import PRESET_STEPS, JobConfig, run_figures

    config = JobConfig.preset(
        preset,
        model=model,
        corpus=corpus,
        n_docs=n_docs,
        max_tokens=max_tokens,
        seed=seed,
        batch_size=batch_size,
        task=task,
        task_docs=task_docs,
        faithfulness_docs=faithfulness_docs,
        lone_docs=lone_docs,
        device=device,
        dtype=dtype,
        api=api,
        random_draws=random_draws,
        n_resamples=n_resamples,
        bootstrap_seed=bootstrap_seed,
        faithfulness_granularity=_granularity(faithfulness_granularity),
        pruning_docs=pruning_docs,
        pruning_draws=pruning_draws,
        pruning_draws_everywhere=pruning_draws_everywhere,
        global_ranking=global_ranking,
        causal_seed=causal_seed,
        field_docs=field_docs,
        field_items=field_items,
    )
    if task.lower() == "none":
        config.task = None
    summary = run_figures(
        config,
        out,
        force=force,
        progress=not quiet,
        steps=_names(steps) or PRESET_STEPS.get(preset),
        skip=_names(skip),
    )
    from cw_lens.data.distributed import is_main_process

    if is_main_process():
        typer.echo(
            f"{verdict_line(summary['claims'])}; wrote {out}/REPORT.md, "
            f"{out}/summary.json and the figures"
        )
        for cid, claim in summary["claims"].items():
            typer.echo(f"  {claim['holds']:<12}  {cid}")


@app.command()
@_clean_errors
def compare(
    runs: list[Path] = typer.Argument(
        ..., help="Run folders of `cw-lens figures` (or their summary.json files)."
    ),
    labels: str | None = typer.Option(
        None, help="Comma-separated labels, one per run (default: the folder names)."
    ),
    out: Path = typer.Option(Path("compare"), help="Output folder."),
) -> None:
    """Print several runs' claims side by side and write compare.md, compare.png and .pdf.

    One column per run: each headline number with its interval and the verdict (yes / no /
    inconclusive / not measured); then each number of each run minus the first run's, with the
    95% bootstrap interval of the difference (paired when the runs resampled the same
    documents): "differ" when it excludes 0, "same within uncertainty" when it includes 0,
    "not comparable" without replicates (summary schemas 1 and 2) or a measured number.
    """
    from cw_lens.plots import save_figure
    from cw_lens.reproduction.run_comparison import compare_runs
    from cw_lens.reproduction.stored_steps import atomic_write_text

    names = None if labels is None else [s.strip() for s in labels.split(",")]
    comparison = compare_runs(runs, labels=names)
    table = comparison.to_markdown()
    typer.echo(table)
    atomic_write_text(out / "compare.md", "# Runs compared\n\n" + table)
    paths = save_figure(comparison.plot(), out / "compare")
    typer.echo(f"wrote {out / 'compare.md'}, " + ", ".join(str(p) for p in paths))


if __name__ == "__main__":
    app()
