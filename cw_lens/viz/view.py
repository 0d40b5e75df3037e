r"""The self-contained HTML view: P1's Fig. 1 made interactive, with the sink patch built in.

One page (and the same front end, `view.js`, in the live widget
[`cw_lens.sink_patcher`][cw_lens.sink_patcher]) shows, for the chosen layer, head (or all heads) and
query:

- **Attention next to contribution** (P1, Fig. 1): the head's attention matrix and its
  contribution-weight matrix side by side (the query row outlined), and the query's row as
  tokens coloured by attention and by contribution. Red where a key pushes the output along
  itself (`C > 0`), blue where it interferes destructively (`C < 0`); attention in a
  sequential purple scale.
- **Hover** a cell or token: its string (exact, with escapes), position, attention `alpha`,
  relative norm `||pv_j|| / ||o_i||`, cosine and contribution weight (their product) — clean
  and, with a patch, patched.
- **Head grid**: every head of the layer as small multiples (attention | contribution), like
  circuitsvis' `attention_heads`; click one to select it.
- **Sink patch** (pages made by `cw_lens.interactive.view_state.sink_patch_html` /
  `SinkPatcher.to_html`): a
  precomputed sweep — `lambda` in {0, 0.25, 0.5, 0.75, 1} over a few layer ranges — so the
  reader patches the sink with the controls and watches, without a kernel, the top-k next-token
  probabilities, the per-token NLL change, the matrices and the per-head output norms and cone
  alignment of the patched layers change.
- **URL hash**: `page.html#layer=5&head=3&query=7` (`head=all`; `scale=auto|<number>`;
  `patch=R,S,M` — indices of the range, scale and mode; `hover=J` pins token `J`'s
  tooltip, for screenshots).

The page embeds its CSS, JS and data (JSON in a `<script type="application/json">` block with
`<`, `>` and `&` escaped, so no token can end the script); it loads nothing from the
network and works from a `file://` URL, in an e-mail attachment or in a notebook iframe. Token
text is inserted with `textContent` only; whitespace and control characters are drawn as
symbols (`token_label`).

Size: per (layer, head) four fields over the causal triangle (`n (n + 1) / 2` values each,
4 significant digits, ~8 bytes a value in JSON), about `16 n^2` bytes per head and layer and
run. A [`ContributionResult`][cw_lens.ContributionResult] page of SmolLM2-135M (30 layers x 9 heads)
at 16 tokens is ~1.3 MB; restrict it with `layers=[...]` / `heads=[...]`. A page over `max_mb`
(default 25 MB) is refused with an error that says so.

Example (runnable as is; the tiny random model needs no download):

    import cw_lens
    from cw_lens.models.testing import tiny_llama

    cw = cw_lens.contribution_weights(tiny_llama(), "hello world, attention sinks", kind="inter")
    cw.to_html("cw.html", layer=1, head="all")   # open cw.html (or cw.html#layer=0&head=2&query=5)
    cw.show()                                     # the same page inline in Jupyter
    cw_lens.interactive.view_state.sink_patch_html(
        tiny_llama(), "hello world, sinks", path="patch.html"
    )
"""

from __future__ import annotations

import html
import re
from importlib import resources
from typing import Any

from cw_lens.core.errors import InputError
from cw_lens.viz.payload import (
    initial_state,
    layer_maps,
    map_bytes,
    page_header,
    real_length,
    script_json,
    select,
)

DEFAULT_MAX_MB = 25.0
_MARKER = re.compile(r"\{\{(title|css|js|data)\}\}")


def check_size(n: int, n_layers: int, n_heads: int, n_runs: int, max_mb: float, hint: str) -> None:
    """Refuse a page whose maps would exceed `max_mb` (with what to restrict)."""
    est_mb = n_runs * map_bytes(n, n_layers, n_heads) / 1e6
    if est_mb > max_mb:
        raise InputError(
            f"The page would embed about {est_mb:.0f} MB ({n_runs} run(s) x {n_layers} layers x "
            f"{n_heads} heads x {n} tokens, over max_mb={max_mb:g}). Restrict it, e.g. {hint}, "
            "or pass a larger max_mb."
        )


def contributions_data(
    result: Any,
    *,
    batch: int = 0,
    layer: int | None = None,
    head: int | str | None = None,
    query: int | None = None,
    layers: Any = None,
    heads: Any = None,
    max_mb: float = DEFAULT_MAX_MB,
) -> dict:
    """The payload of a [`ContributionResult`][cw_lens.ContributionResult] page (schema:
    `cw_lens.viz.payload`; no patch, no predictions)."""
    n = real_length(result, batch)
    layer_list = select(layers, list(result.layers), "Layers")
    head_list = select(heads, list(result.heads), "Heads")
    init = initial_state(layer_list, head_list, n, layer, head, query)
    check_size(n, len(layer_list), len(head_list), 1, max_mb, f"layers=[{init['layer']}]")
    data = page_header(result, batch, layer_list, head_list)
    empty = {"top": None, "nll": None, "nll_mean": None, "ppl": None, "cone": None}
    data.update(
        init=init, clean={"maps": layer_maps(result, batch, layer_list, head_list), **empty}
    )
    data["patch"] = None
    return data


def _asset(name: str) -> str:
    return resources.files("cw_lens.viz").joinpath(name).read_text(encoding="utf-8")


def render_page(data: dict, title: str | None = None) -> str:
    """Fill the template with the CSS, JS and `data` (one pass, so nothing is re-expanded)."""
    template, css, js = (_asset(name) for name in ("template.html", "view.css", "view.js"))
    for name, text in (("view.css", css), ("view.js", js)):
        if re.search(r"</(script|style)", text, re.IGNORECASE):
            raise RuntimeError(f"{name} must not contain a closing script/style tag.")
    if title is None:
        title = "Sink patching" if data.get("patch") else "Contribution weights"
    parts = {
        "title": html.escape(title, quote=True),
        "css": css,
        "js": js,
        "data": script_json(data),
    }
    return _MARKER.sub(lambda m: parts[m.group(1)], template)


def contributions_html(
    result: Any,
    *,
    batch: int = 0,
    layer: int | None = None,
    head: int | str | None = None,
    query: int | None = None,
    title: str | None = None,
    layers: Any = None,
    heads: Any = None,
    max_mb: float = DEFAULT_MAX_MB,
) -> str:
    """One self-contained HTML page of a [`ContributionResult`][cw_lens.ContributionResult] (one
    text).

    Args:
        result: A [`ContributionResult`][cw_lens.ContributionResult].
        batch: The batch row (text) to show.
        layer: Initial layer (a model layer index; default the first on the page).
        head: Initial head (a model head index, or `"all"` for the sum over heads with
            `kind="inter"` / the mean with `kind="intra"`; default the first head).
        query: Initial query position (default the last real token).
        title: Page title.
        layers: Layers to embed (default all of the result) — restricts the page size.
        heads: Heads to embed (default all of the result); the aggregate covers these.
        max_mb: Refuse pages whose embedded data would exceed this (see the module docs).

    Returns:
        The page as a string; the URL hash overrides the initial state when it is opened.
    """
    data = contributions_data(
        result,
        batch=batch,
        layer=layer,
        head=head,
        query=query,
        layers=layers,
        heads=heads,
        max_mb=max_mb,
    )
    return render_page(data, title)


def iframe(page: str, height: int) -> Any:
    """An `IPython.display.HTML` with `page` in a sandboxed iframe (`srcdoc`), so its
    script runs in classic Notebook, JupyterLab, VS Code and Colab outputs (no trust needed)."""
    from IPython.display import HTML

    srcdoc = html.escape(page, quote=True)
    return HTML(
        f'<div class="cw-lens-view"><iframe srcdoc="{srcdoc}" sandbox="allow-scripts" '
        f'style="width: 100%; height: {int(height)}px; border: 1px solid #e5e7eb; '
        f'border-radius: 6px; background: #fff;" title="cw_lens view"></iframe></div>'
    )


def show_contributions(result: Any, *, height: int | None = None, **kwargs: Any) -> Any:
    """The page of `contributions_html` inline in Jupyter (`ContributionResult.show`).

    `height` (pixels) defaults to one that fits the matrices and the head grid.
    """
    data = contributions_data(result, **{k: v for k, v in kwargs.items() if k != "title"})
    page = render_page(data, kwargs.get("title"))
    return iframe(page, page_height(data) if height is None else height)


def page_height(data: dict) -> int:
    """A height (pixels) that shows the page without an inner scroll bar in most cases."""
    n, n_heads = data["n"], len(data["heads"])
    cell = max(4, min(16, 320 // max(n, 1)))
    matrix = n * cell + 90
    rows = 2 if data.get("patch") else 1
    grid = ((n_heads + 3) // 4) * (2 * n * max(2, min(6, 96 // max(n, 1))) // 2 + 60)
    extra = 520 if data.get("patch") else 160
    return int(min(2400, 220 + rows * matrix + grid + extra))


def write(page: str, path: Any) -> str:
    """Write `page` to `path` (UTF-8) when a path is given; return the page."""
    if path is not None:
        from pathlib import Path

        Path(path).write_text(page, encoding="utf-8")
    return page
