r"""Interactive route-graph panel: one self-contained HTML page (no network, no dependencies).

The page draws the routes of
[`cw_lens.RouteGraphResult.panel_data`][cw_lens.RouteGraphResult.panel_data] on a grid — positions
left to right (token strings below), layers bottom to top, the half nodes `m_l` (the MLP's input on
sequential blocks, hollow) half-way — with attention edges coloured and widened by their share, MLP
edges blue and residual edges grey. **Hover an edge**: its layer and head (or residual / MLP), the
source and target tokens, the share and its factors (`share = attention x relative norm x cosine`).
**Hover a node**: the shares of the pieces entering it (residual, attention, MLP, bias; they sum to
1). The state can be set in the URL hash: `page.html#edge=3` opens edge 3's tooltip (for
headless screenshots and tests).

The page is the template `routes.html` with `routes.js` and the data inlined;
`rerender_routes_page` writes a saved page again from its own data with the current
template and script (how `docs/flow/make_flow_figures.py --panel` keeps the documentation's
panel in step with `routes.js` without recomputing its routes).

This is a minimal stand-alone panel; the data come from a JSON-able dict
(`RouteGraphResult.panel_data()`), so the shared front end (`cw_lens.viz.view`) can embed the
same panel.

Example:

    import cw_lens
    from cw_lens.models.testing import tiny_llama
    cw_lens.routes(tiny_llama(), "hello world", threshold=0.02).to_html("routes.html")
"""

from __future__ import annotations

import html
import json
import re
from importlib import resources
from typing import Any

from cw_lens.core.errors import InputError
from cw_lens.viz.payload import script_json, token_label

_MARKER = re.compile(r"\{\{(title|js|data)\}\}")
_TITLE = re.compile(r"<title>(.*?)</title>", re.S)
_DATA = re.compile(r'<script type="application/json" id="route-data">(.*?)</script>', re.S)


def routes_html(data: dict[str, Any], title: str | None = None) -> str:
    """The panel page for `RouteGraphResult.panel_data()` (token labels made visible)."""
    data = {**data, "labels": [token_label(t) for t in data["tokens"]]}
    title = title or f"Routes to position {data['target']}"
    files = resources.files("cw_lens.viz")
    template = files.joinpath("routes.html").read_text(encoding="utf-8")
    parts = {
        "title": html.escape(title, quote=True),
        "js": files.joinpath("routes.js").read_text(encoding="utf-8"),
        "data": script_json(data),
    }
    return _MARKER.sub(lambda m: parts[m.group(1)], template)


def rerender_routes_page(page: str) -> str:
    """A page written by `routes_html`, written again from its own title and embedded
    data with the current template and `routes.js` (no number is recomputed)."""
    title, data = _TITLE.search(page), _DATA.search(page)
    if title is None or data is None or 'content="cw_lens.viz.routes"' not in page:
        raise InputError(
            "Not a route panel page written by cw_lens (RouteGraphResult.to_html / routes_html): "
            "it has no embedded route data; write the page with RouteGraphResult.to_html instead."
        )
    return routes_html(json.loads(data.group(1)), html.unescape(title.group(1)))
