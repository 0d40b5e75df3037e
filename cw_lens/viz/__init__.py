"""Interactive views of cw_lens results: a self-contained HTML page and a live Jupyter widget.

One front end (``view.js``, an ES module) serves both:

- :func:`contributions_html` / :func:`show_contributions` — the page of a
  :class:`~cw_lens.ContributionResult` (``result.to_html()``, ``result.show()``): attention next
  to contribution (P1, Fig. 1), the factors on hover, the head grid;
- :func:`sink_patch_html` — the same page with a precomputed sink-patching sweep (no kernel
  needed);
- :func:`sink_patcher` — the live widget (anywidget): it re-runs the model with
  :func:`cw_lens.patch_sink` on every control change.

The data the front end draws comes from :mod:`cw_lens.viz.payload` (every number computed in
Python) via :mod:`cw_lens.viz.state`.
"""

from cw_lens.viz.payload import token_label
from cw_lens.viz.state import patch_state, sink_patch_data, sink_patch_html
from cw_lens.viz.view import contributions_data, contributions_html, show_contributions


def sink_patcher(*args, **kwargs):
    """The live sink-patching widget (:class:`cw_lens.viz.widget.SinkPatcher`); needs
    ``anywidget`` (``pip install 'cw_lens[widget]'``)."""
    from cw_lens.viz.widget import sink_patcher as make

    return make(*args, **kwargs)


__all__ = [
    "contributions_data",
    "contributions_html",
    "patch_state",
    "show_contributions",
    "sink_patch_data",
    "sink_patch_html",
    "sink_patcher",
    "token_label",
]
