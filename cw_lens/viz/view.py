r"""Interactive token view of contribution weights: one self-contained HTML page.

The view shows the tokens of one text (one batch row of a :class:`~cw_lens.ContributionResult`)
as inline spans coloured by the **signed contribution weight** of each key token ``j`` for the
selected query ``i`` — red where the key pushes the output along itself (``C > 0``), blue where
it interferes destructively (``C < 0``), white at 0 (a diverging scale centred at 0, the RdBu
map of the paper figures). The query token is outlined; tokens after it are greyed (causal
mask: no contribution).

- **Hover** a token: its string (exact, with escapes), position, attention ``alpha``, relative
  norm ``||pv_j|| / ||o_i||``, cosine and contribution weight (their product).
- **Click** a token: it becomes the query (the ← / → keys move the query too).
- **Layer / head** selectors choose the map. The extra head option aggregates the heads on the
  page: with ``kind="inter"`` it is the **sum over heads**, ``sum_h C[i,j]^h`` — the token's
  share of the whole layer output (rows sum to 1 when every head is on the page); with
  ``kind="intra"`` the per-head weights are each normalised by their own head's output, so a
  sum is meaningless and the option shows the **mean over heads** instead (rows still sum to
  1, but every head counts equally whatever its output norm — prefer ``kind="inter"`` for a
  layer-level view).
- **Colour scale**: ``row max`` maps the largest ``|C|`` of the shown row to full colour (the
  legend prints that value); ``row max w/o BOS`` ignores position 0 (the sink may then
  saturate); ``fixed ±1`` compares rows and heads on one scale.
- **Summary**: the row sum (with ``kind="inter"``: the head's share of the layer output), the
  output norm, and the five keys with the largest ``|C|``.
- **URL hash**: the state lives in the hash, e.g. ``page.html#layer=5&head=3&query=7``
  (``head=all`` for the aggregate; ``scale=auto|nobos|<number>``), so a link or a headless
  browser renders a given state without clicking; ``hover=J`` also opens token ``J``'s tooltip
  (for screenshots: ``chromium --headless --screenshot=view.png --window-size=1200,800
  'file:///.../page.html#layer=5&head=all&query=7&hover=0'``).

The page embeds its CSS, JS and data (JSON in a ``<script type="application/json">`` block with
``<``, ``>`` and ``&`` escaped, so no token can end the script); it loads nothing from the
network and works from a ``file://`` URL, in an e-mail attachment or in a notebook iframe.
Token text is inserted with ``textContent`` only; spaces, newlines, tabs and control characters
are drawn as visible symbols (``·``, ``↵``, ``→``, ``␀``...; see :func:`token_label`), a token
with a newline also breaks the line, and an empty token is shown as ``∅``.

Size: the page stores, per (layer, head), three fields (attention, cosine, weight) over the
causal triangle of the real tokens, ``n (n + 1) / 2`` values each, rounded to 4 significant
digits (about 9 bytes of JSON per value), plus the key and output norms (``2 n`` values, 6
digits) from which the relative norm is rebuilt: about ``13.5 n^2`` bytes per (layer, head),
plus ~30 kB of code. SmolLM2-135M (30 layers x 9 heads) at 16 tokens is ~1 MB, at 34 tokens
4.4 MB, at 64 tokens ~15 MB. Restrict what is embedded with ``layers=[...]`` /
``heads=[...]``; a page over ``max_mb`` (default 25 MB) is refused with an error that says so.

Example (runnable as is; the tiny random model needs no download)::

    import cw_lens
    from cw_lens.testing import tiny_llama

    cw = cw_lens.contribution_weights(tiny_llama(), "hello world, attention sinks", kind="inter")
    cw.to_html("cw.html", layer=1, head="all")   # open cw.html (or cw.html#layer=0&head=2&query=5)
    cw.show()                                     # the same page inline in Jupyter

With the embedded model: ``m = cw_lens.load_model(); cw_lens.contribution_weights(m, "The
capital of France is Paris.", kind="inter").to_html("paris.html", layers=[3, 4, 5])``.
``python -m cw_lens.viz out.html`` writes the tiny-model demo page.
"""

from __future__ import annotations

import html
import json
import numbers
import re
import unicodedata
from importlib import resources
from typing import Any

import numpy as np

from cw_lens.errors import InputError

SIG_DIGITS = 4
#: Rough JSON size of one embedded value (``-0.1234,``), for the size estimate.
BYTES_PER_VALUE = 9
DEFAULT_MAX_MB = 25.0
#: Head value that selects the aggregate over heads (sum for inter, mean for intra).
ALL_HEADS = "all"
_ALL_ALIASES = ("all", "sum", "mean")

_WHITESPACE = {" ": "·", "\n": "↵", "\t": "→", "\r": "␍"}
_ASSETS = ("template.html", "view.css", "view.js")
_MARKER = re.compile(r"\{\{(title|css|js|data)\}\}")


def token_label(token: str) -> str:
    """The visible form of a token string: whitespace and control characters as symbols.

    Space ``·``, newline ``↵``, tab ``→``, carriage return ``␍``, other control characters
    their Unicode control picture (``␀``...``␟``, ``␡``), other invisible characters (no-break
    and exotic spaces, zero-width and format characters) ``⍽``; an empty token is ``∅``.
    """
    if token == "":
        return "∅"
    out = []
    for ch in token:
        code = ord(ch)
        if ch in _WHITESPACE:
            out.append(_WHITESPACE[ch])
        elif code < 32:
            out.append(chr(0x2400 + code))
        elif code == 127:
            out.append("␡")
        elif unicodedata.category(ch) in ("Zs", "Zl", "Zp", "Cf", "Cc"):
            out.append("⍽")
        else:
            out.append(ch)
    return "".join(out)


def round_sig(values: Any, digits: int = SIG_DIGITS) -> np.ndarray:
    """Round to ``digits`` significant digits (float64; NaN and inf unchanged).

    Vectorised; the result equals ``float(f"{x:.{digits}g}")``, so ``json`` writes the short
    decimal form.
    """
    x = np.asarray(values, dtype=np.float64)
    out = x.copy()
    ok = np.isfinite(x) & (x != 0)
    v = x[ok]
    k = (digits - 1 - np.floor(np.log10(np.abs(v)))).astype(np.int64)
    scale = 10.0 ** np.abs(k)
    up = k >= 0
    r = np.empty_like(v)
    r[up] = np.round(v[up] * scale[up]) / scale[up]
    r[~up] = np.round(v[~up] / scale[~up]) * scale[~up]
    out[ok] = r
    return out


def _json_list(values: np.ndarray, digits: int = SIG_DIGITS) -> list:
    """Rounded values as a JSON-ready list (NaN and inf as ``None``)."""
    r = round_sig(values, digits)
    bad = ~np.isfinite(r)
    if not bad.any():
        return r.tolist()
    obj = r.astype(object)
    obj[bad] = None
    return obj.tolist()


def _select(requested: Any, available: list[int], what: str) -> list[int]:
    if requested is None:
        return list(available)
    items = [requested] if isinstance(requested, numbers.Integral) else list(requested)
    missing = [int(i) for i in items if i not in available]
    if missing or not items:
        raise InputError(
            f"{what} {missing or items} not in this result ({what.lower()} {available}); "
            f"pick from those, or compute the result with them."
        )
    return sorted({int(i) for i in items})


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
    """The JSON payload of the page (a plain dict; see :func:`contributions_html`).

    Layout: ``tokens`` (raw strings) and ``labels`` (:func:`token_label`) of the ``n`` real
    tokens; ``layers``, ``heads`` (the model indices on the page); ``maps[l][h]`` for the
    ``l``-th layer and ``h``-th head on the page, with ``a`` (attention), ``c`` (cosine) and
    ``w`` (contribution weight) over the causal triangle, row-major — query ``i``, key ``j <= i``
    at ``i (i + 1) / 2 + j`` — and ``pv`` (``||pv_j||`` per key) and ``on`` (the output norm
    the weights refer to, per query; relative norm = ``pv[j] / on[i]``). Values are rounded to
    4 significant digits (the norms to 6); undefined ones (zero output norm) are ``null``.
    ``init`` is the initial state.
    """
    n_batch = int(result.tokens.shape[0])
    if not 0 <= batch < n_batch:
        raise InputError(f"batch must be in 0..{n_batch - 1}, got {batch}.")
    mask = result.mask[batch].detach().cpu().numpy().astype(bool)
    n = int(mask.sum())
    if n == 0 or not mask[:n].all():
        raise InputError(f"Batch row {batch} has no real tokens at positions 0..{n - 1}.")
    str_tokens = list(result.str_tokens[batch])[:n]

    layer_list = _select(layers, list(result.layers), "Layers")
    head_list = _select(heads, list(result.heads), "Heads")
    layer = layer_list[0] if layer is None else int(layer)
    if layer not in layer_list:
        raise InputError(f"layer {layer} is not among the layers on the page ({layer_list}).")
    if head is None:
        head = head_list[0]
    elif isinstance(head, str):
        if head not in _ALL_ALIASES:
            raise InputError(f"head must be a head index or 'all', got {head!r}.")
        head = ALL_HEADS
    elif int(head) not in head_list:
        raise InputError(f"head {head} is not among the heads on the page ({head_list}).")
    else:
        head = int(head)
    query = n - 1 if query is None else int(query)
    if not 0 <= query < n:
        raise InputError(f"query must be a real position 0..{n - 1} of batch row {batch}.")

    n_maps = len(layer_list) * len(head_list)
    est_mb = n_maps * (3 * n * (n + 1) // 2 + 2 * n) * BYTES_PER_VALUE / 1e6
    if est_mb > max_mb:
        raise InputError(
            f"The page would embed about {est_mb:.0f} MB ({len(layer_list)} layers x "
            f"{len(head_list)} heads x {n} tokens, over max_mb={max_mb:g}). Restrict it, e.g. "
            f"layers=[{layer}] or heads=[...], or pass a larger max_mb."
        )

    li = [list(result.layers).index(v) for v in layer_list]
    hi = [list(result.heads).index(v) for v in head_list]
    rows, cols = np.tril_indices(n)
    sel = np.ix_(li, hi)

    def pairwise(t: Any) -> np.ndarray:  # [layer, head, n(n+1)/2]
        arr = t[batch].detach().cpu().float().numpy()[sel]
        return arr[..., :n, :n][..., rows, cols]

    def per_pos(t: Any) -> np.ndarray:  # [layer, head, n]
        return t[batch].detach().cpu().float().numpy()[sel][..., :n]

    fields = {
        "a": pairwise(result.attention),
        "c": pairwise(result.cosine),
        "w": pairwise(result.weights),
        "pv": per_pos(result.projected_value_norm),
        "on": per_pos(result.output_norm),
    }
    # the O(n) norms get 2 more digits, so the rebuilt relative norm keeps 4 significant ones
    digits = {"pv": SIG_DIGITS + 2, "on": SIG_DIGITS + 2}
    maps = [
        [
            {k: _json_list(v[i, j], digits.get(k, SIG_DIGITS)) for k, v in fields.items()}
            for j in range(len(head_list))
        ]
        for i in range(len(layer_list))
    ]
    bos = bool(result.prepend_bos) and (
        result.bos_token is None or str_tokens[0] == result.bos_token
    )
    return {
        "version": 1,
        "model": str(result.model_name or ""),
        "kind": str(result.kind),
        "batch": batch,
        "n": n,
        "tokens": str_tokens,
        "labels": [token_label(t) for t in str_tokens],
        "layers": layer_list,
        "heads": head_list,
        "all_heads": list(result.heads),
        "bos": bos,
        "bos_token": str_tokens[0] if bos else None,
        "maps": maps,
        "init": {"layer": layer, "head": head, "query": query},
    }


def _asset(name: str) -> str:
    return resources.files("cw_lens.viz").joinpath(name).read_text(encoding="utf-8")


def _script_json(data: dict) -> str:
    """JSON safe inside ``<script>``: no ``<``, ``>``, ``&`` or line separators in the text."""
    text = json.dumps(data, ensure_ascii=True, separators=(",", ":"), allow_nan=False)
    return text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")


def render_page(data: dict, title: str | None = None) -> str:
    """Fill the template with the CSS, JS and ``data`` (one pass, so nothing is re-expanded)."""
    template, css, js = (_asset(name) for name in _ASSETS)
    for name, text in (("view.css", css), ("view.js", js)):
        if re.search(r"</(script|style)", text, re.IGNORECASE):
            raise RuntimeError(f"{name} must not contain a closing script/style tag.")
    if title is None:
        title = "Contribution weights"
    parts = {
        "title": html.escape(title, quote=True),
        "css": css,
        "js": js,
        "data": _script_json(data),
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
    """One self-contained HTML page: the tokens of ``batch`` coloured by contribution weight.

    Args:
        result: A :class:`~cw_lens.ContributionResult`.
        batch: The batch row (text) to show.
        layer: Initial layer (a model layer index; default the first on the page).
        head: Initial head (a model head index, or ``"all"`` for the sum over heads with
            ``kind="inter"`` / the mean with ``kind="intra"``; default the first head).
        query: Initial query position (default the last real token).
        title: Page title (default names the kind and the model).
        layers: Layers to embed (default all of the result) — restricts the page size.
        heads: Heads to embed (default all of the result); the aggregate covers these.
        max_mb: Refuse pages whose embedded data would exceed this (see the module docs).

    Returns:
        The page as a string; the URL hash (``#layer=..&head=..&query=..&scale=..``)
        overrides the initial state when the file is opened.
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


def _iframe_height(data: dict) -> int:
    chars = sum(len(t) + 1 for t in data["labels"])
    lines = chars // 90 + 1 + sum(t.count("\n") for t in data["tokens"])
    return int(min(900, 330 + 34 * lines))


def show_contributions(result: Any, *, height: int | None = None, **kwargs: Any) -> Any:
    """The view for Jupyter: an ``IPython.display.HTML`` with the page in a sandboxed iframe.

    The page is passed as ``srcdoc`` so its script runs in classic Notebook, JupyterLab,
    VS Code and Colab outputs alike (no trust needed). ``kwargs`` are those of
    :func:`contributions_html`; ``height`` (pixels) defaults to an estimate from the text.
    """
    from IPython.display import HTML

    data = contributions_data(result, **{k: v for k, v in kwargs.items() if k != "title"})
    page = render_page(data, kwargs.get("title"))
    h = _iframe_height(data) if height is None else int(height)
    srcdoc = html.escape(page, quote=True)
    return HTML(
        f'<div class="cw-lens-view"><iframe srcdoc="{srcdoc}" sandbox="allow-scripts" '
        f'style="width: 100%; height: {h}px; border: 1px solid #e5e7eb; border-radius: 6px; '
        f'background: #fff;" title="cw_lens contribution view"></iframe></div>'
    )
