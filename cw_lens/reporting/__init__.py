"""Reporting: the main job (figures, summary.json, REPORT.md), run comparison and the CLI.

`job` (`cw-lens figures`; its settings and state are `state`, its steps `steps`),
`run_comparison` ([`cw_lens.compare_runs`][cw_lens.compare_runs]), `cli`
(the `cw-lens` console script; `python -m cw_lens.reporting.cli`). Top layer (see
`docs/architecture.md`), beside `flow` and `interactive`.
"""
