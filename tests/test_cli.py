"""The command line: ``cw-lens analyze``, the options of ``figures`` (the job itself is covered
by test_report.py), ``--version``, plain help and an entry point that does not import torch."""

from __future__ import annotations

import dataclasses
import re
import subprocess
import sys
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

import cw_lens
from cw_lens.models.testing import tiny_llama
from cw_lens.reproduction.cli import app


def test_analyze_prints_top_tokens_per_layer_and_writes_html(tmp_path):
    html = tmp_path / "view.html"
    result = CliRunner().invoke(
        app,
        [
            "analyze",
            "hello sinks",
            "--model",
            "testing:tiny-llama",
            "--k",
            "2",
            "--html",
            str(html),
        ],
    )
    assert result.exit_code == 0, result.output
    lines = [line for line in result.output.splitlines() if line.startswith("layer")]
    assert len(lines) == 2  # the tiny model has two layers
    # the printed numbers are the summed inter weights of the last token
    cw = cw_lens.contribution_weights(tiny_llama(), "hello sinks", kind="inter")
    top = cw.top(layer=1, k=2, sum_heads=True)
    printed = [float(x) for x in re.findall(r"[+-]\d\.\d{3}", lines[1])]
    assert printed == [round(v, 3) for v in top["weights"]]
    assert "<html" in html.read_text().lower()


def test_analyze_bad_layer_is_a_clear_error():
    result = CliRunner().invoke(
        app, ["analyze", "hi", "--model", "testing:tiny-llama", "--layer", "9"]
    )
    assert result.exit_code == 2
    assert "error: Layer 9 is out of range" in result.output
    assert "Traceback" not in result.output


def fake_figures(monkeypatch) -> dict:
    """Replace the job by a recorder of what the command passes it (the job: test_report)."""
    import cw_lens.reproduction.job as report

    seen: dict = {}

    def fake_run(config, out, *, force, progress, steps=None, skip=None):
        seen.update(config=config, out=out, steps=steps, skip=skip)
        return {"claims": {}}

    monkeypatch.setattr(report, "run_figures", fake_run)
    return seen


def test_figures_options_reach_the_job_config(monkeypatch, tmp_path):
    seen = fake_figures(monkeypatch)
    args = ["figures", "--random-draws", "3", "--n-docs", "5", "--task", "none", "--quiet"]
    args += ["--faithfulness-docs", "2", "--lone-docs", "1"]
    args += ["--bootstrap-seed", "7", "--n-resamples", "3000"]
    result = CliRunner().invoke(app, [*args, "--out", str(tmp_path)])
    assert result.exit_code == 0, result.output
    config = seen["config"]
    assert (config.random_draws, config.n_docs, config.task) == (3, 5, None)
    assert (config.faithfulness_docs, config.lone_docs) == (2, 1)
    assert (config.bootstrap_seed, config.n_resamples, config.seed) == (7, 3000, 0)
    args = ["figures", "--pruning-draws", "20", "--no-global-ranking", "--quiet"]
    args += ["--faithfulness-granularity", "pairs", "--pruning-docs", "4", "--causal-seed", "3"]
    result = CliRunner().invoke(app, [*args, "--out", str(tmp_path)])
    assert result.exit_code == 0, result.output
    config = seen["config"]
    assert (config.pruning_draws, config.global_ranking, config.pruning_docs) == (20, False, 4)
    assert config.causal_seed == 3
    assert config.faithfulness_granularity == ("pairs",)
    result = CliRunner().invoke(app, ["figures", "--faithfulness-granularity", "pair"])
    assert result.exit_code == 2 and "give pairs, tokens or both" in result.output
    result = CliRunner().invoke(app, ["figures", "--n-resamples", "500", "--out", str(tmp_path)])
    assert result.exit_code == 2 and "at least 2000 bootstrap resamples" in result.output


def test_every_job_setting_is_an_option_of_figures():
    from cw_lens.reproduction.job import JobConfig

    options = {p.name for p in typer.main.get_command(app).commands["figures"].params}
    missing = [f.name for f in dataclasses.fields(JobConfig) if f.name not in options]
    assert not missing, f"JobConfig fields without a `cw-lens figures` option: {missing}"


def test_figures_steps_and_skip_and_default_folder(monkeypatch):
    seen = fake_figures(monkeypatch)
    result = CliRunner().invoke(app, ["figures", "--steps", "sinks, selection", "--quiet"])
    assert result.exit_code == 0, result.output
    assert seen["steps"] == ["sinks", "selection"] and seen["skip"] is None
    # the default folder is a git-ignored run folder, never the committed gallery
    assert seen["out"] == Path("runs") / "default"
    result = CliRunner().invoke(app, ["figures", "--skip", "faithfulness,pruning", "--quiet"])
    assert result.exit_code == 0, result.output
    assert seen["steps"] is None and seen["skip"] == ["faithfulness", "pruning"]


def test_step_selection_adds_what_a_step_needs_and_names_unknown_steps():
    from cw_lens.core.errors import InputError
    from cw_lens.reproduction.cli import STEP_NAMES
    from cw_lens.reproduction.job import STEP_NAMES as JOB_STEPS
    from cw_lens.reproduction.job import select_steps

    assert STEP_NAMES == JOB_STEPS  # the help lists the job's steps
    assert select_steps() == JOB_STEPS
    assert select_steps(["pruning"]) == ("taxonomy", "pruning")
    assert select_steps(None, ["faithfulness", "task_faithfulness", "pruning"]) == (
        "sinks",
        "heatmaps",
        "ablation",
        "selection",
        "taxonomy",
        "field_pairs",
        "field_inputs",
    )
    with pytest.raises(InputError, match=r"Unknown step.*'sink'.*the steps are sinks"):
        select_steps(["sink"])
    with pytest.raises(InputError, match="No step left"):
        select_steps(["sinks"], ["sinks"])
    result = CliRunner().invoke(app, ["figures", "--steps", "sink"])
    assert result.exit_code == 2 and "error: Unknown step(s) 'sink'" in result.output


def test_version_and_plain_help():
    from cw_lens.version import __version__

    result = CliRunner().invoke(app, ["--version"])
    assert result.exit_code == 0 and result.output.strip() == f"cw_lens {__version__}"
    for command in ([], ["analyze"], ["figures"], ["compare"]):
        result = CliRunner().invoke(app, [*command, "--help"])
        assert result.exit_code == 0, result.output
        # plain text: no rich boxes, no reST markup
        assert not set("╭╮╰╯│─") & set(result.output), result.output
        assert "``" not in result.output and ":func:" not in result.output, result.output


def test_the_entry_point_does_not_import_torch():
    """`cw-lens --help` / `--version` stay fast: importing the CLI (and so the cw_lens package)
    imports neither torch nor TransformerLens; the commands import them when they run."""
    code = (
        "import sys, cw_lens.reproduction.cli, cw_lens; cw_lens.__version__; dir(cw_lens); "
        "print(sorted(m for m in ('torch', 'transformer_lens', 'transformers', 'pandas') "
        "if m in sys.modules))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout
    assert out.strip() == "[]", out


def test_the_cli_guide_lists_every_option_of_the_main_job():
    """docs/guides/cli.md's options table names every option `cw-lens figures` takes, and no
    option it does not take."""
    command = typer.main.get_command(app).commands["figures"]
    options = {
        name
        for param in command.params
        if param.param_type_name == "option"
        for name in (*param.opts, *param.secondary_opts)
        if name.startswith("--") and name != "--help"
    }
    guide = (Path(__file__).parents[1] / "docs" / "guides" / "cli.md").read_text()
    table = guide.split("Every option of the job:")[1].split("\n\n")[1]
    listed = {name for row in table.splitlines()[2:] for name in re.findall(r"`(--[a-z-]+)`", row)}
    assert listed == options, (sorted(options - listed), sorted(listed - options))
