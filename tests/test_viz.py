"""The self-contained HTML token view (cw_lens.viz): page content, data fidelity, escaping, and a
real headless-browser render (Debian ``chromium``; the ``browser`` tests fail when it is missing).
"""

from __future__ import annotations

import dataclasses
import html
import json
import math
import re
import subprocess
from html.parser import HTMLParser
from pathlib import Path

import numpy as np
import pytest
import torch

import cw_lens
from cw_lens.errors import InputError
from cw_lens.viz import contributions_data, contributions_html, show_contributions, token_label
from cw_lens.viz.view import round_sig

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
CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
    "--hide-scrollbars",
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


def close(got, want) -> bool:
    return bool(np.allclose(got, want, rtol=RTOL, atol=ATOL, equal_nan=True))


# ---------------------------------------------------------------------- pure Python


def test_page_is_self_contained(inter):
    page = contributions_html(inter)
    assert page.startswith("<!DOCTYPE html>")
    assert "http://" not in page and "https://" not in page
    assert not re.search(r"<(link|img|iframe)\b|\bsrc\s*=|@import|url\(", page, re.I)
    assert len(re.findall(r"<script\b", page)) == 2  # the JSON block and the inline code
    assert "{{" not in page.replace("{{data}}", "")  # every template marker filled
    assert "<style>" in page and "cw-tok" in page


def test_embeds_every_token_and_the_metadata(inter):
    data = embedded(contributions_html(inter))
    assert data["tokens"] == inter.str_tokens[0]
    assert data["labels"] == [token_label(t) for t in inter.str_tokens[0]]
    assert data["model"] == inter.model_name and data["kind"] == "inter"
    assert data["layers"] == inter.layers and data["heads"] == inter.heads
    assert data["bos"] and data["bos_token"] == inter.str_tokens[0][0]
    n = len(inter.str_tokens[0])
    assert data["init"] == {"layer": inter.layers[0], "head": inter.heads[0], "query": n - 1}


@pytest.mark.parametrize(("layer", "head", "query"), [(0, 0, 28), (1, 2, 17), (1, 3, 0)])
def test_embedded_values_equal_the_tensors(inter, intra, layer, head, query):
    for r in (inter, intra):
        data = embedded(contributions_html(r))
        m = data["maps"][data["layers"].index(layer)][data["heads"].index(head)]
        li, hi = r.layers.index(layer), r.heads.index(head)
        for key, field in (("a", "attention"), ("c", "cosine"), ("w", "weights")):
            want = getattr(r, field)[0, li, hi, query, : query + 1].double().numpy()
            assert close(triangle(m[key], query), want), (r.kind, field)
        rel = np.array(m["pv"][: query + 1]) / m["on"][query]
        want = r.relative_norm[0, li, hi, query, : query + 1].double().numpy()
        assert close(rel, want), r.kind
        # the whole triangle, every (layer, head): rounding only
        n = len(r.str_tokens[0])
        rows, cols = np.tril_indices(n)
        got = np.array(m["w"], dtype=np.float64)
        assert close(got, r.weights[0, li, hi][rows, cols].double().numpy())


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
    assert len(data["maps"]) == 1 and len(data["maps"][0]) == 2
    assert data["init"] == {"layer": 1, "head": "all", "query": 5}
    # numpy integers are accepted and the payload stays JSON-serialisable
    data = contributions_data(inter, layer=np.int64(1), head=np.int64(2), layers=np.array([0, 1]))
    assert json.loads(json.dumps(data["init"])) == {"layer": 1, "head": 2, "query": 28}
    small = len(json.dumps(embedded(contributions_html(inter, layers=[1], heads=[0]))))
    assert small < len(json.dumps(embedded(contributions_html(inter)))) / 6
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
    assert len(data["maps"][0][0]["w"]) == 4 * 5 // 2
    # an undefined row (zero output norm -> NaN) is embedded as null, never as NaN
    out = r.output_norm.clone()
    out[0, :, :, 2] = math.nan
    page = contributions_html(dataclasses.replace(r, output_norm=out), batch=0)
    assert embedded(page)["maps"][0][0]["w"][3:6] == [None, None, None]
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


# ---------------------------------------------------------------------- headless browser


class TokenDom(HTMLParser):
    """Token spans (``.cw-tok``) of a dumped DOM, the root's attributes and the tooltip text."""

    def __init__(self):
        super().__init__()
        self.tokens: list[dict] = []
        self.root: dict = {}
        self.tip: dict | None = None
        self._stack: list[str] = []  # what each open span/div is ("tok", "tip" or "")

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        classes = (a.get("class") or "").split()
        if a.get("id") == "cw-root":
            self.root = a
        if tag in ("span", "div"):
            if "cw-tok" in classes:
                self.tokens.append({**a, "classes": classes, "text": ""})
                self._stack.append("tok")
            elif a.get("id") == "cw-tip":
                self.tip = {**a, "text": ""}
                self._stack.append("tip")
            else:
                self._stack.append("")
        if tag == "b" and "tok" in self._stack:
            raise AssertionError("a <b> element inside a token span: token text became markup")

    def handle_endtag(self, tag):
        if tag in ("span", "div") and self._stack:
            self._stack.pop()

    def handle_data(self, data):
        if "tok" in self._stack:
            self.tokens[-1]["text"] += data
        if "tip" in self._stack:
            self.tip["text"] += data


def chromium_bin() -> str:
    """The chromium binary; a missing one fails the test (never skips) and says how to fix it.

    Called inside each test (not in a fixture) so that a missing browser is a test failure.
    """
    if not CHROMIUM.exists():
        pytest.fail(
            f"{CHROMIUM} is missing: the browser tests need Debian's chromium. Install it with "
            "`apt-get install -y chromium` (as root), then rerun.",
            pytrace=False,
        )
    return str(CHROMIUM)


def run_chromium(chromium: str, tmp_path: Path, url: str, *extra: str) -> str:
    cmd = [chromium, *CHROMIUM_FLAGS, f"--user-data-dir={tmp_path / 'profile'}", *extra, url]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


def render(chromium, tmp_path, page: str, state: str) -> TokenDom:
    path = tmp_path / "view.html"
    path.write_text(page, encoding="utf-8")
    dom = run_chromium(chromium, tmp_path, f"{path.as_uri()}#{state}", "--dump-dom")
    parsed = TokenDom()
    parsed.feed(dom)
    assert parsed.root.get("class", "").split().count("cw-ready") == 1, "the script did not run"
    return parsed


def rgb(style: str) -> tuple[int, ...] | None:
    m = re.search(r"background-color:\s*rgb\((\d+), (\d+), (\d+)\)", style or "")
    return tuple(int(v) for v in m.groups()) if m else None


@pytest.mark.browser
def test_browser_renders_the_state_from_the_hash(inter, tmp_path):
    chromium = chromium_bin()
    layer, head, query = 1, 2, 20
    dom = render(
        chromium, tmp_path, contributions_html(inter), f"layer={layer}&head={head}&query={query}"
    )
    assert (dom.root["data-layer"], dom.root["data-head"], dom.root["data-query"]) == (
        str(layer),
        str(head),
        str(query),
    )
    labels = [token_label(t) for t in inter.str_tokens[0]]
    assert [t["text"] for t in dom.tokens] == labels
    assert [int(t["data-pos"]) for t in dom.tokens] == list(range(len(labels)))
    assert [i for i, t in enumerate(dom.tokens) if "cw-q" in t["classes"]] == [query]

    want = inter.weights[0, inter.layers.index(layer), inter.heads.index(head), query]
    want = want.double().numpy()
    past, future = dom.tokens[: query + 1], dom.tokens[query + 1 :]
    got = np.array([float(t["data-w"]) for t in past])
    assert close(got, want[: query + 1])
    assert all("cw-future" in t["classes"] and "data-w" not in t for t in future)
    # colours follow the data: the largest |C| gets the darkest end of the diverging scale
    top = int(np.abs(got).argmax())
    end = (103, 0, 31) if got[top] > 0 else (5, 48, 97)
    assert rgb(past[top].get("style")) == end
    assert sum(rgb(t.get("style")) == end for t in past) == 1
    lim = float(dom.root["data-scale"])
    assert lim == pytest.approx(abs(got[top]))
    for t, w in zip(past, got, strict=True):
        c = rgb(t.get("style"))
        assert c is not None
        red_side = c[0] > c[2]
        if abs(w) > 0.1 * lim:
            assert red_side == (w > 0), (t, w)


@pytest.mark.browser
def test_browser_aggregates_heads(inter, intra, tmp_path):
    chromium = chromium_bin()
    query = 12
    for r, reduce in ((inter, torch.sum), (intra, torch.mean)):
        state = f"layer=0&head=all&query={query}&hover=3"
        dom = render(chromium, tmp_path, contributions_html(r), state)
        assert dom.root["data-head"] == "all"
        got = np.array([float(t["data-w"]) for t in dom.tokens[: query + 1]])
        want = reduce(r.weights[0, 0, :, query, : query + 1], 0).double().numpy()
        assert np.allclose(got, want, rtol=2e-3, atol=1e-6), r.kind
        # the tooltip lists every head's attention and weight
        assert dom.tip is not None and "hidden" not in dom.tip
        assert "mean attention" in dom.tip["text"] and "head" in dom.tip["text"]
        assert ("Σ_h contribution C" if r.kind == "inter" else "mean_h") in dom.tip["text"]


@pytest.mark.browser
def test_browser_escapes_hostile_tokens_and_shows_the_tooltip(hostile, tmp_path):
    chromium = chromium_bin()
    n = len(hostile.str_tokens[0])
    page = contributions_html(hostile)
    dom = render(chromium, tmp_path, page, f"layer=0&head=1&query={n - 1}&hover=1")
    assert [t["text"] for t in dom.tokens] == [token_label(t) for t in hostile.str_tokens[0]]
    assert dom.tip is not None and "hidden" not in dom.tip
    tip = dom.tip["text"]
    assert json.dumps(hostile.str_tokens[0][1]) in tip  # the exact string, JSON-escaped
    for word in ("position 1", "attention", "relative norm", "cosine", "contribution weight"):
        assert word in tip
    shown = {
        name: float(
            re.search(rf"{label}\s*([−+]?[0-9.]+(?:e[−+-]?[0-9]+)?)", tip)[1].replace("−", "-")
        )
        for name, label in (("attention", "attention α"), ("weights", "contribution weight C"))
    }
    for name, value in shown.items():
        want = getattr(hostile, name)[0, 0, 1, n - 1, 1].item()
        assert value == pytest.approx(want, rel=2e-3, abs=2e-4), name


@pytest.mark.browser
def test_browser_screenshot(inter, tmp_path):
    chromium = chromium_bin()
    path = tmp_path / "view.html"
    path.write_text(contributions_html(inter), encoding="utf-8")
    png = tmp_path / "view.png"
    run_chromium(
        chromium,
        tmp_path,
        f"{path.as_uri()}#layer=1&head=all&query=22&hover=14",
        f"--screenshot={png}",
        "--window-size=1200,800",
    )
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000
    width, height = int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")
    assert (width, height) == (1200, 800)
