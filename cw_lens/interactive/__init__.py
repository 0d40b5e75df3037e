"""Interactive: the clean-vs-patched sink comparison, its view state and the Jupyter widget.

`comparison` ([`cw_lens.compare_sink_patch`][cw_lens.compare_sink_patch]), `resume` (the patched
pass started at the first patched layer from the clean pass's residual stream), `view_state` (the
JSON the page and the widget draw, and the saved HTML page), `widget`
([`cw_lens.sink_patcher`][cw_lens.sink_patcher]). Top layer (see `docs/architecture.md`), beside
`flow` and `reporting`.
"""
