"""The command line: ``cw-lens analyze`` (``figures`` is covered by test_report.py)."""

from __future__ import annotations

import re

from typer.testing import CliRunner

import cw_lens
from cw_lens.models.testing import tiny_llama
from cw_lens.reporting.cli import app


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


def test_figures_options_reach_the_job_config(monkeypatch, tmp_path):
    import cw_lens.reporting.job as report

    seen = {}

    def fake_run(config, out, force, progress):  # the job itself is tested in test_report
        seen.update(config=config, out=out)
        return {"claims": {}}

    monkeypatch.setattr(report, "run_figures", fake_run)
    args = ["figures", "--random-draws", "3", "--n-docs", "5", "--task", "none", "--quiet"]
    args += ["--bootstrap-seed", "7", "--n-resamples", "3000"]
    result = CliRunner().invoke(app, [*args, "--out", str(tmp_path)])
    assert result.exit_code == 0, result.output
    config = seen["config"]
    assert (config.random_draws, config.n_docs, config.task) == (3, 5, None)
    assert (config.bootstrap_seed, config.n_resamples, config.seed) == (7, 3000, 0)
    result = CliRunner().invoke(app, ["figures", "--n-resamples", "500", "--out", str(tmp_path)])
    assert result.exit_code == 2 and "at least 2000 bootstrap resamples" in result.output
