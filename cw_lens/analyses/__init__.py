"""Analyses: one entry point and one result class each.

`contributions`, `sinks`, `selection`, `taxonomy`, `pruning`, `faithfulness`; what
two of them share lives in `cw_lens.analyses.common` (or lower). Sibling analyses do not
import each other, except that `pruning` ranks heads by the taxonomy it computes. Layer 4 of
5 (see `docs/architecture.md`): may import `plots`/`viz` (for `.plot()` / `.to_html()`),
`data`, `models` and `core`.
"""
