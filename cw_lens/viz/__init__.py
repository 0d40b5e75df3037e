"""Interactive views of cw_lens results: one front end for a saved HTML page and a live widget.

The front end (`view.js`, an ES module, with `view.css`) draws the JSON-ready data of
`cw_lens.viz.payload` (every number computed in Python) and computes nothing:

- `contributions_html` / `show_contributions` — the page of a
  [`ContributionResult`][cw_lens.ContributionResult] (`result.to_html()`, `result.show()`):
  attention next to contribution (P1, Fig. 1), the factors on hover, the head grid;
- `cw_lens.interactive.view_state.sink_patch_html` — the same page with a precomputed
  sink-patching
  sweep (no kernel needed);
- [`cw_lens.sink_patcher`][cw_lens.sink_patcher] (`cw_lens.interactive.widget`) — the live Jupyter
  widget (anywidget).

This package knows nothing of models: the producers that run one live above it
(`cw_lens.interactive.view_state`, `cw_lens.interactive.widget`).
"""

from cw_lens.viz.payload import token_label
from cw_lens.viz.view import contributions_data, contributions_html, show_contributions

__all__ = ["contributions_data", "contributions_html", "show_contributions", "token_label"]
