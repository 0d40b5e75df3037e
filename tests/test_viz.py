"""The self-contained HTML view (cw_lens.viz): page content, data fidelity, escaping, and real
headless-chromium runs (Playwright driving Debian's ``chromium``; the ``browser`` tests fail when
it is missing): what the page shows equals the tensors, and the controls change it."""

from __future__ import annotations

import dataclasses
import html
import json
import math
import re
from html.parser import HTMLParser

import numpy as np
import pytest
import torch
from browser import png_size, screenshot

import cw_lens
from cw_lens.core.errors import InputError
from cw_lens.interactive.comparison import PatchControls
from cw_lens.interactive.view_state import sink_patch_html
from cw_lens.viz import contributions_data, contributions_html, show_contributions, token_label
from cw_lens.viz.payload import round_sig

TEXT = "hello world, attention sinks"
# 4 significant digits: relative error at most 5e-4 (abs slack for values near 0)
RTOL, ATOL = 6e-4, 1e-7
HOSTILE = [
    "<|im_start|>",
    "</script><b>bold</b>",
    "</SCRIPT >",
    "<!--",
    "</style>",
    "\"'`",
    "&amp;&lt;",
    "\n",
    " ",
    "\t",
    "",
    "a\u2028b",
    "{{data}}",
    "\x00\x7f",
]


@pytest.fixture(scope="module")
def inter(llama):
    return cw_lens.contribution_weights(llama, TEXT, kind="inter")


@pytest.fixture(scope="module")
def intra(llama):
    return cw_lens.contribution_weights(llama, TEXT, kind="intra")


@pytest.fixture(scope="module")
def hostile(inter):
    """The tiny result with hostile token strings (the byte tokenizer never makes these)."""
    n = len(inter.str_tokens[0])
    toks = (HOSTILE * (n // len(HOSTILE) + 1))[:n]
    return dataclasses.replace(inter, str_tokens=[toks])


def embedded(page: str) -> dict:
    """The JSON payload of a page."""
    m = re.search(r'<script type="application/json" id="cw-data">(.*?)</script>', page, re.S)
    assert m, "no data block"
    return json.loads(m.group(1))


def triangle(flat: list, q: int) -> np.ndarray:
    """Row ``q`` (keys 0..q) of a flattened causal triangle; None -> NaN."""
    row = flat[q * (q + 1) // 2 : q * (q + 1) // 2 + q + 1]
    return np.array([math.nan if v is None else v for v in row], dtype=np.float64)


def close(got, want, rtol=RTOL, atol=ATOL) -> bool:
    return bool(np.allclose(got, want, rtol=rtol, atol=atol, equal_nan=True))


# ---------------------------------------------------------------------- pure Python


def test_page_is_self_contained(inter):
    page = contributions_html(inter)
    assert page.startswith("<!DOCTYPE html>")
    assert "http://" not in page.replace("http://www.w3.org/2000/svg", "")
    assert "https://" not in page
    assert not re.search(r"<(link|img|iframe)\b|\bsrc\s*=|@import|url\(|\bimport\s*\(", page, re.I)
    assert len(re.findall(r"<script\b", page)) == 2  # the JSON block and the inline module
    assert '<script type="module">' in page and "bootPage();" in page
    assert "{{" not in page.replace("{{data}}", "")  # every template marker filled
    assert "<style>" in page and ".cw-tok" in page


def test_embeds_every_token_and_the_metadata(inter):
    data = embedded(contributions_html(inter))
    assert data["tokens"] == inter.str_tokens[0]
    assert data["labels"] == [token_label(t) for t in inter.str_tokens[0]]
    assert data["model"] == inter.model_name and data["kind"] == "inter"
    assert data["layers"] == inter.layers and data["heads"] == inter.heads
    assert data["bos"] and data["patch"] is None and data["clean"]["top"] is None
    n = len(inter.str_tokens[0])
    assert data["init"] == {"layer": inter.layers[0], "head": inter.heads[0], "query": n - 1}


@pytest.mark.parametrize(("layer", "head", "query"), [(0, 0, 28), (1, 2, 17), (1, 3, 0)])
def test_embedded_values_equal_the_tensors(inter, intra, layer, head, query):
    for r in (inter, intra):
        data = embedded(contributions_html(r))
        m = data["clean"]["maps"][data["layers"].index(layer)]["h"][data["heads"].index(head)]
        li, hi = r.layers.index(layer), r.heads.index(head)
        fields = (("a", "attention"), ("c", "cosine"), ("w", "weights"), ("r", "relative_norm"))
        for key, field in fields:
            want = getattr(r, field)[0, li, hi, query, : query + 1].double().numpy()
            assert close(triangle(m[key], query), want), (r.kind, field)
        n = len(r.str_tokens[0])
        rows, cols = np.tril_indices(n)
        got = np.array(m["w"], dtype=np.float64)
        assert close(got, r.weights[0, li, hi][rows, cols].double().numpy())
        assert close(np.array(m["on"]), r.output_norm[0, li, hi].double().numpy(), rtol=6e-6)


def test_rounding_is_four_significant_digits():
    x = np.array([0.123456, -98765.4321, 1.23456e-9, 0.0, -0.0, 5.5555e3, 1e-40], np.float32)
    want = [float(f"{float(v):.4g}") for v in x]
    assert round_sig(x).tolist() == want
    r = round_sig(np.array([math.nan, math.inf]))
    assert math.isnan(r[0]) and math.isinf(r[1])


def test_hostile_tokens_cannot_break_out(hostile):
    page = contributions_html(hostile, title="</title><script>alert(1)</script>")
    # only our own two closing script tags; no raw token text anywhere in the page
    assert len(re.findall(r"</script", page, re.I)) == 2
    assert "<b>bold" not in page and '</style>"' not in page and "<!--" not in page
    assert "&lt;/title&gt;&lt;script&gt;alert(1)" in page
    data = embedded(page)
    assert data["tokens"] == hostile.str_tokens[0]  # round trip, exactly

    class Scripts(HTMLParser):
        def __init__(self):
            super().__init__()
            self.tags: list[str] = []

        def handle_starttag(self, tag, attrs):
            self.tags.append(tag)

    p = Scripts()
    p.feed(page)
    assert p.tags.count("script") == 2 and "b" not in p.tags


def test_token_labels_make_whitespace_visible():
    assert token_label(" the") == "·the"
    assert token_label("\n\n") == "↵↵"
    assert token_label("\tx\r") == "→x␍"
    assert token_label("") == "∅"
    assert token_label("\x00\x1b\x7f") == "␀␛␡"
    assert token_label("a\u00a0b\u200b") == "a⍽b⍽"
    assert token_label("<|im_start|>") == "<|im_start|>"


def test_selection_restricts_the_page_and_validates(inter):
    data = contributions_data(inter, layers=[1], heads=[0, 3], head="all", query=5)
    assert data["layers"] == [1] and data["heads"] == [0, 3]
    maps = data["clean"]["maps"]
    assert len(maps) == 1 and len(maps[0]["h"]) == 2
    # the aggregate covers the heads on the page only: the sum of heads 0 and 3
    rows, cols = np.tril_indices(len(inter.str_tokens[0]))
    want = inter.weights[0, 1][[0, 3]].sum(0).double().numpy()[rows, cols]
    assert close(np.array(maps[0]["all"]["w"], dtype=np.float64), want, atol=1e-6)
    assert data["init"] == {"layer": 1, "head": "all", "query": 5}
    # numpy integers are accepted and the payload stays JSON-serialisable
    data = contributions_data(inter, layer=np.int64(1), head=np.int64(2), layers=np.array([0, 1]))
    assert json.loads(json.dumps(data["init"])) == {"layer": 1, "head": 2, "query": 28}
    small = len(json.dumps(embedded(contributions_html(inter, layers=[1], heads=[0]))))
    assert small < len(json.dumps(embedded(contributions_html(inter)))) / 4
    for bad in (
        {"layer": 7},
        {"head": 9},
        {"head": "every"},
        {"query": 29},
        {"query": -1},
        {"batch": 1},
        {"layers": [5]},
        {"layers": [1], "layer": 0},
    ):
        with pytest.raises(InputError):
            contributions_data(inter, **bad)
    with pytest.raises(InputError, match="layers="):
        contributions_html(inter, max_mb=0.001)


def test_padded_batch_row_and_nan_rows(llama):
    r = cw_lens.contribution_weights(llama, ["a b", "a longer second text"], kind="inter")
    data = contributions_data(r, batch=0)
    assert data["n"] == 4 and data["tokens"] == r.str_tokens[0]
    assert len(data["clean"]["maps"][0]["h"][0]["w"]) == 4 * 5 // 2
    # an undefined row (zero output norm -> NaN) is embedded as null, never as NaN
    out = r.output_norm.clone()
    out[0, :, :, 2] = math.nan
    page = contributions_html(dataclasses.replace(r, output_norm=out), batch=0)
    assert embedded(page)["clean"]["maps"][0]["h"][0]["w"][3:6] == [None, None, None]
    block = page[page.index('id="cw-data">') : page.index("</script>")]
    assert "NaN" not in block and "Infinity" not in block


def test_to_html_and_show(inter, tmp_path):
    path = tmp_path / "cw.html"
    page = inter.to_html(path, layer=1, head="all")
    assert path.read_text(encoding="utf-8") == page
    assert embedded(page)["init"]["head"] == "all"
    shown = show_contributions(inter, layer=1, title="T")
    assert type(shown).__name__ == "HTML"
    m = re.fullmatch(
        r'<div class="cw-lens-view"><iframe srcdoc="([^"]*)" sandbox="allow-scripts".*</div>',
        shown.data,
        re.S,
    )
    assert m, shown.data[:200]
    assert html.unescape(m.group(1)) == contributions_html(inter, layer=1, title="T")
    assert inter.show(height=300).data.count("height: 300px") == 1


def test_sink_page_size_is_bounded(llama):
    with pytest.raises(InputError, match="max_mb"):
        sink_patch_html(llama, TEXT, max_mb=0.01)


# ---------------------------------------------------------------------- headless browser


def open_page(browser, tmp_path, page_html: str, state: str = "", name: str = "view.html"):
    path = tmp_path / name
    path.write_text(page_html, encoding="utf-8")
    page = browser.new_page(viewport={"width": 1200, "height": 900})
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.goto(path.as_uri() + (f"#{state}" if state else ""))
    page.wait_for_selector(".cw.cw-ready", timeout=20_000)
    page.errors = errors  # checked by the tests
    return page


def cells(page, cond: str, field: str) -> dict[tuple[int, int], float]:
    """``(query, key) -> value`` of every cell of one matrix on the page."""
    got = page.eval_on_selector_all(
        f'svg.cw-svg[data-cond="{cond}"][data-field="{field}"] rect[data-tip]',
        "els => els.map(e => [+e.dataset.query, +e.dataset.key, e.dataset.v])",
    )
    return {(i, j): (math.nan if v == "" else float(v)) for i, j, v in got}


def strip(page, cond: str, field: str) -> list[float | None]:
    got = page.eval_on_selector_all(
        f'.cw-strip[data-cond="{cond}"][data-field="{field}"] .cw-tok',
        "els => els.map(e => e.dataset.v === undefined ? null : +e.dataset.v)",
    )
    return got


def root(page) -> dict:
    return page.eval_on_selector("#cw-root", "e => Object.assign({}, e.dataset)")


def check_matrix(page, cond, result, layer, head, field_map=(("a", "attention"), ("w", "weights"))):
    li, hi = result.layers.index(layer), result.heads.index(head)
    n = len(result.str_tokens[0])
    for key, field in field_map:
        got = cells(page, cond, key)
        assert len(got) == n * (n + 1) // 2
        want = getattr(result, field)[0, li, hi].double().numpy()
        for (i, j), v in got.items():
            assert close(v, want[i, j]), (cond, key, i, j, v, want[i, j])


@pytest.mark.browser
def test_browser_shows_attention_next_to_contribution(browser, inter, tmp_path):
    layer, head, query = 1, 2, 20
    page = open_page(
        browser, tmp_path, contributions_html(inter), f"layer={layer}&head={head}&query={query}"
    )
    assert root(page)["layer"] == str(layer) and root(page)["head"] == str(head)
    assert root(page)["query"] == str(query)
    check_matrix(page, "clean", inter, layer, head)
    # the query's row as tokens: every label, the values of the row, nothing after the query
    labels = page.eval_on_selector_all(
        '.cw-strip[data-cond="clean"][data-field="w"] .cw-tok', "els => els.map(e => e.textContent)"
    )
    assert labels == [token_label(t) for t in inter.str_tokens[0]]
    want = inter.weights[0, 1, 2, query].double().numpy()
    got = strip(page, "clean", "w")
    assert close(np.array(got[: query + 1], dtype=np.float64), want[: query + 1])
    assert all(v is None for v in got[query + 1 :])
    # colours follow the data: the largest |C| of the row gets an end of the diverging scale
    styles = page.eval_on_selector_all(
        '.cw-strip[data-cond="clean"][data-field="w"] .cw-tok',
        "els => els.map(e => e.style.backgroundColor)",
    )
    top = int(np.abs(want[: query + 1]).argmax())
    assert styles[top] == ("rgb(103, 0, 31)" if want[top] > 0 else "rgb(5, 48, 97)")
    for j in range(query + 1):
        r, _, b = map(int, re.findall(r"\d+", styles[j]))
        if abs(want[j]) > 0.1 * abs(want[top]):
            assert (r > b) == (want[j] > 0), j
    assert not page.errors
    page.close()


@pytest.mark.browser
def test_browser_hover_shows_the_three_factors(browser, intra, tmp_path):
    page = open_page(browser, tmp_path, contributions_html(intra), "layer=0&head=1&query=14")
    page.hover('svg.cw-svg[data-cond="clean"][data-field="w"] rect[data-query="14"][data-key="6"]')
    tip = page.inner_text(".cw-tip")
    assert page.is_visible(".cw-tip")
    assert json.dumps(intra.str_tokens[0][6]) in tip
    for name, label in (
        ("weights", "contribution c"),
        ("attention", "attention α"),
        ("relative_norm", "relative norm"),
        ("cosine", "cosine"),
    ):
        m = re.search(rf"{label}[^\t\n]*\t([−+]?[0-9.]+(?:e[−+-]?[0-9]+)?)", tip)
        assert m, (label, tip)
        value = float(m[1].replace("−", "-"))
        want = getattr(intra, name)[0, 0, 1, 14, 6].item()
        assert value == pytest.approx(want, rel=2e-3, abs=2e-6), name
    # the factors multiply back to the weight (as shown)
    page.close()


@pytest.mark.browser
def test_browser_controls_change_what_is_shown(browser, inter, tmp_path):
    page = open_page(browser, tmp_path, contributions_html(inter), "layer=0&head=0&query=28")
    page.select_option("select.cw-head", "3")
    page.select_option("select.cw-layer", "1")
    assert (root(page)["layer"], root(page)["head"]) == ("1", "3")
    check_matrix(page, "clean", inter, 1, 3)
    # a click on a matrix cell picks its row as the query; the arrow keys move it
    page.click('svg.cw-svg[data-cond="clean"][data-field="a"] rect[data-query="9"][data-key="2"]')
    assert root(page)["query"] == "9"
    page.focus("#cw-root")
    page.keyboard.press("ArrowLeft")
    assert root(page)["query"] == "8"
    assert close(
        np.array(strip(page, "clean", "w")[:9], dtype=np.float64),
        inter.weights[0, 1, 3, 8, :9].double().numpy(),
    )
    # the head grid: every head of the layer plus the aggregate; a click selects one
    titles = page.eval_on_selector_all(
        ".cw-grid-cell .cw-grid-title", "els => els.map(e => e.textContent)"
    )
    assert titles == ["head 0", "head 1", "head 2", "head 3", "all"]
    n = len(inter.str_tokens[0])
    rows, cols = np.tril_indices(n)
    for hd in range(4):  # every small multiple shows its own head's values
        for field, name in (("a", "attention"), ("w", "weights")):
            got = page.eval_on_selector_all(
                f'svg.cw-mini[data-head="{hd}"][data-field="{field}"] rect',
                "els => els.map(e => +e.dataset.v)",
            )
            want = getattr(inter, name)[0, 1, hd].double().numpy()[rows, cols]
            assert close(np.array(got), want), (hd, field)
    page.click('.cw-grid-cell[data-pick-head="1"]')
    assert root(page)["head"] == "1"
    check_matrix(page, "clean", inter, 1, 1)
    assert "layer=1&head=1&query=8" in page.url
    assert not page.errors
    page.close()


@pytest.mark.browser
def test_browser_aggregates_heads(browser, inter, intra, tmp_path):
    query = 12
    for r, reduce in ((inter, torch.sum), (intra, torch.mean)):
        page = open_page(
            browser, tmp_path, contributions_html(r), f"layer=0&head=all&query={query}"
        )
        assert root(page)["head"] == "all"
        got = np.array(strip(page, "clean", "w")[: query + 1], dtype=np.float64)
        want = reduce(r.weights[0, 0, :, query, : query + 1], 0).double().numpy()
        assert close(got, want, atol=1e-6), r.kind
        mean_att = r.attention[0, 0, :, query, : query + 1].double().mean(0).numpy()
        assert close(
            np.array(strip(page, "clean", "a")[: query + 1], dtype=np.float64), mean_att, atol=1e-6
        )
        page.close()


@pytest.mark.browser
def test_browser_escapes_hostile_tokens(browser, hostile, tmp_path):
    n = len(hostile.str_tokens[0])
    page = open_page(
        browser, tmp_path, contributions_html(hostile), f"layer=0&head=1&query={n - 1}"
    )
    labels = page.eval_on_selector_all(
        '.cw-strip[data-cond="clean"][data-field="w"] .cw-tok', "els => els.map(e => e.textContent)"
    )
    assert labels == [token_label(t) for t in hostile.str_tokens[0]]
    assert page.eval_on_selector_all("#cw-root b", "els => els.length") == 0
    page.hover('.cw-strip[data-cond="clean"][data-field="w"] .cw-tok[data-key="1"]')
    assert json.dumps(hostile.str_tokens[0][1]) in page.inner_text(".cw-tip")
    assert not page.errors
    page.close()


# ---------------------------------------------------------------------- the saved sink page


def direct_top(model, text, controls: PatchControls | None, k=5):
    tokens = model.to_tokens(text)
    hooks = () if controls is None else controls.hooks(model).hooks
    with torch.inference_mode(), model.hooks(fwd_hooks=list(hooks)):
        logits = model(tokens)[0].double()
    nll = -logits.log_softmax(-1)[:-1].gather(-1, tokens[0, 1:, None])[:, 0]
    return logits.softmax(-1).topk(k, dim=-1), nll


def shown_predictions(page, cond):
    return page.eval_on_selector_all(
        f'.cw-pred-col[data-cond="{cond}"] .cw-pred-row',
        "els => els.map(e => [e.querySelector('.cw-pred-tok').textContent, +e.dataset.p])",
    )


def sink_page_checks(browser, model, text, tmp_path, *, layers, shot):
    page_html = sink_patch_html(model, text, layers=layers)
    size_mb = len(page_html.encode()) / 1e6
    data = embedded(page_html)
    o = data["patch"]["options"]
    n = data["n"]
    page = open_page(browser, tmp_path, page_html, f"layer={layers[-1]}&head=0&query={n - 1}")
    tok = model.tokenizer
    # initial state: the first range, lambda = 0 — patched predictions equal patch_sink's
    for ri, si in ((0, 0), (len(o["ranges"]) - 1, 1), (1, 4), (len(o["ranges"]) - 1, 0)):
        page.select_option("select.cw-range", str(ri))
        page.eval_on_selector(
            "input.cw-lambda",
            f"(e) => {{ e.value = {si}; e.dispatchEvent(new Event('input', {{bubbles: true}})); }}",
        )
        c = PatchControls.of(model, layers=tuple(o["ranges"][ri]), scale=o["scales"][si])
        assert f"patch={ri},{si},0" in page.url
        assert page.inner_text(".cw-lambda-value") == f"{o['scales'][si]:.2f}"
        (p, ids), nll = direct_top(model, text, c)
        (p0, _), nll0 = direct_top(model, text, None)
        shown = shown_predictions(page, "patched")
        assert [s[0] for s in shown] == [token_label(tok.decode([i])) for i in ids[n - 1].tolist()]
        assert close([s[1] for s in shown], p[n - 1].numpy())
        clean = shown_predictions(page, "clean")
        assert close([s[1] for s in clean], p0[n - 1].numpy())
        # the per-token NLL change
        got = page.eval_on_selector_all(
            ".cw-nll-strip .cw-tok", "els => els.slice(1).map(e => +e.dataset.v)"
        )
        assert close(got, (nll - nll0).numpy(), atol=2e-5), (ri, si)
        # the patched matrices equal contribution_weights under patch_sink
        with c.hooks(model):
            cw = cw_lens.contribution_weights(model, text, layers=[layers[-1]], heads=[0])
        check_matrix(page, "patched", cw, layers[-1], 0)
        # the cone table: one row per patched layer, values of the comparison
        rows = page.eval_on_selector_all(".cw-cone-table tr", "els => els.length")
        assert rows == 1 + len(c.layer_list)
    assert not page.errors
    png = screenshot(page, tmp_path, shot, full_page=True)
    assert png_size(png)[0] == 1200
    page.close()
    return size_mb


@pytest.mark.browser
def test_browser_sink_page_controls_patch_the_sink(browser, llama, tmp_path):
    sink_page_checks(browser, llama, TEXT, tmp_path, layers=[0, 1], shot="sink_page_tiny.png")


@pytest.mark.browser
@pytest.mark.model
@pytest.mark.slow
def test_browser_sink_page_embedded_model(browser, smollm, tmp_path):
    text = "The capital of France is Paris. The capital of Germany is"
    size_mb = sink_page_checks(
        browser, smollm, text, tmp_path, layers=[6, 12, 17, 23], shot="sink_page.png"
    )
    assert size_mb < 4.0  # a few MB for a short text on SmolLM2
