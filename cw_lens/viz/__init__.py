"""Interactive views of cw_lens results (self-contained HTML; see :mod:`cw_lens.viz.view`).

- :func:`contributions_html` — one offline HTML page with the tokens of a text coloured by
  contribution weight (hover for the decomposition, click to pick the query, state in the URL
  hash); ``ContributionResult.to_html`` calls it.
- :func:`show_contributions` — the same page inline in Jupyter; ``ContributionResult.show``.
"""

from cw_lens.viz.view import (
    contributions_data,
    contributions_html,
    show_contributions,
    token_label,
)

__all__ = ["contributions_data", "contributions_html", "show_contributions", "token_label"]
