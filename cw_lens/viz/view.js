/* cw_lens contribution-weight token view. No dependencies, no network.
 * Data: the JSON block #cw-data written by cw_lens.viz.view.contributions_data.
 * State (layer, head, query, scale) lives in the URL hash: #layer=5&head=3&query=7&scale=1. */
(function () {
  "use strict";

  var D = JSON.parse(document.getElementById("cw-data").textContent);
  var INTER = D.kind === "inter";
  var ALL = "all";
  // RdBu_r (as in the paper figures): -1 dark blue ... 0 near-white ... +1 dark red
  var STOPS = [
    [5, 48, 97], [33, 102, 172], [67, 147, 195], [146, 197, 222], [209, 229, 240],
    [247, 247, 247],
    [253, 219, 199], [244, 165, 130], [214, 96, 77], [178, 24, 43], [103, 0, 31]
  ];
  var WS = /[·↵→␍⍽∅␡\u2400-\u241f]/;

  function $(id) { return document.getElementById(id); }
  function el(tag, cls, text) {
    var e = document.createElement(tag);
    if (cls) e.className = cls;
    if (text !== undefined && text !== null) e.textContent = text;
    return e;
  }
  function int(s) { return /^-?\d+$/.test(s) ? parseInt(s, 10) : NaN; }
  function tri(i) { return i * (i + 1) / 2; }

  function colour(t) {
    t = Math.max(-1, Math.min(1, t));
    var x = (t + 1) / 2 * (STOPS.length - 1);
    var i = Math.min(Math.floor(x), STOPS.length - 2), f = x - i;
    var a = STOPS[i], b = STOPS[i + 1], c = [];
    for (var k = 0; k < 3; k++) c.push(Math.round(a[k] + f * (b[k] - a[k])));
    return "rgb(" + c.join(", ") + ")";
  }

  function fmt(v, signed) {
    if (v === null || v === undefined || isNaN(v)) return "—";
    if (v === 0) return "0";
    var a = Math.abs(v);
    var s = a >= 1e-3 && a < 1e5 ? a.toFixed(4) : a.toExponential(2);
    return (v < 0 ? "−" : signed ? "+" : "") + s;
  }

  function headName(h) { return h === ALL ? (INTER ? "Σ heads" : "mean of heads") : "head " + h; }

  // ------------------------------------------------------------------ state
  var S = { layer: D.init.layer, head: D.init.head, query: D.init.query, scale: "auto" };
  var pinned = -1; // #hover=J: show the tooltip of token J (for screenshots), until the mouse moves

  function parseHash() {
    var h = {};
    (location.hash || "").replace(/^#/, "").split("&").forEach(function (kv) {
      var p = kv.split("=");
      if (p[0]) h[decodeURIComponent(p[0])] = decodeURIComponent(p.slice(1).join("="));
    });
    if (D.layers.indexOf(int(h.layer)) >= 0) S.layer = int(h.layer);
    if (/^(all|sum|mean)$/.test(h.head || "")) S.head = ALL;
    else if (D.heads.indexOf(int(h.head)) >= 0) S.head = int(h.head);
    var q = int(h.query);
    if (q >= 0 && q < D.n) S.query = q;
    if (h.scale === "auto" || (h.scale === "nobos" && D.bos) || parseFloat(h.scale) > 0) {
      S.scale = h.scale;
    }
    var j = int(h.hover);
    pinned = j >= 0 && j < D.n ? j : -1;
  }

  function writeHash() {
    var h = "#layer=" + S.layer + "&head=" + S.head + "&query=" + S.query +
      (S.scale === "auto" ? "" : "&scale=" + S.scale);
    if (location.hash === h) return;
    try { history.replaceState(null, "", h); } catch (e) { /* sandboxed srcdoc iframe */ }
  }

  // ------------------------------------------------------------------ data for one row
  function row() {
    var q = S.query, off = tri(q), maps = D.maps[D.layers.indexOf(S.layer)];
    var hs = S.head === ALL ? maps.map(function (_, i) { return i; }) : [D.heads.indexOf(S.head)];
    var out = [];
    for (var k = 0; k <= q; k++) {
      var r = { per: hs.map(function (h) { return maps[h].w[off + k]; }) };
      if (S.head === ALL) {
        var ok = r.per.every(function (v) { return v !== null; });
        var sum = r.per.reduce(function (s, v) { return s + v; }, 0);
        var att = hs.reduce(function (s, h) { return s + maps[h].a[off + k]; }, 0);
        r.w = ok ? (INTER ? sum : sum / hs.length) : null;
        r.a = att / hs.length;
      } else {
        var m = maps[hs[0]];
        r.w = m.w[off + k];
        r.a = m.a[off + k];
        r.c = m.c[off + k];
        r.rn = m.pv[k] !== null && m.on[q] ? m.pv[k] / m.on[q] : null;
        r.on = m.on[q];
      }
      out.push(r);
    }
    return out;
  }

  // ------------------------------------------------------------------ static parts
  var root = $("cw-root"), box = $("cw-tokens"), tip = $("cw-tip");

  var meta = [D.model || "model",
    "kind: " + D.kind + (INTER ? " (share of the layer output)" : " (share of each head's output)"),
    "text " + D.batch, D.n + " tokens",
    D.layers.length + " layer" + (D.layers.length > 1 ? "s" : "") + ", " +
    D.heads.length + " head" + (D.heads.length > 1 ? "s" : "") + " on this page"];
  meta.forEach(function (m, i) {
    var s = el("span", i === 0 ? "cw-meta-model" : "cw-meta-item", m);
    $("cw-meta").appendChild(s);
  });

  D.layers.forEach(function (l) {
    var o = el("option", null, "layer " + l); o.value = l; $("cw-layer").appendChild(o);
  });
  D.heads.forEach(function (h) {
    var o = el("option", null, "head " + h); o.value = h; $("cw-head").appendChild(o);
  });
  var agg = el("option", null, INTER ? "Σ all heads" : "mean of heads");
  agg.value = ALL;
  $("cw-head").appendChild(agg);

  var spans = D.labels.map(function (label, j) {
    var s = el("span", "cw-tok");
    s.dataset.pos = j;
    if (D.bos && j === 0) s.classList.add("cw-special");
    var run = "", dim = false;
    function flush() {
      if (run) s.appendChild(dim ? el("span", "cw-ws", run) : document.createTextNode(run));
      run = "";
    }
    Array.from(label).forEach(function (ch) {
      var w = WS.test(ch);
      if (w !== dim) { flush(); dim = w; }
      run += ch;
    });
    flush();
    box.appendChild(s);
    var breaks = (D.tokens[j].match(/\n/g) || []).length;
    for (var b = 0; b < Math.min(breaks, 2); b++) box.appendChild(el("br"));
    return s;
  });

  if (D.bos) {
    var nb = el("option", null, "row max w/o BOS");
    nb.value = "nobos";
    $("cw-scale").insertBefore(nb, $("cw-scale").options[1]);
  }

  var stops = [];
  for (var i = 0; i <= 20; i++) stops.push(colour(i / 10 - 1) + " " + i * 5 + "%");
  $("cw-legend-bar").style.background = "linear-gradient(to right, " + stops.join(", ") + ")";

  var notes = [
    INTER
      ? "C[i,j] = ⟨α_ij pv_j, o_i⟩ / ‖o_i‖²: the share of the layer output o_i (all heads) " +
        "that key j moves through this head; over all keys and heads the weights sum to 1."
      : "c[i,j] = ⟨α_ij pv_j, o_i^h⟩ / ‖o_i^h‖²: the share of this head's output o_i^h due to " +
        "key j; over the keys of a head the weights sum to 1.",
    "C = attention × relative norm × cosine. Negative weights (blue) interfere destructively; " +
      "weights can exceed 1."
  ];
  if (D.bos) {
    notes.push("Position 0 is the BOS token " + JSON.stringify(D.bos_token) + ", the usual " +
      "attention sink: compare its attention with its contribution weight.");
  }
  if (D.heads.length < D.all_heads.length) {
    notes.push("The " + (INTER ? "sum" : "mean") + " over heads covers the " + D.heads.length +
      " heads on this page, not all " + D.all_heads.length + " of the result.");
  }
  notes.push("Hover a token for its decomposition; click a token (or press ← →) to change the " +
    "query. The state is in the URL: #layer=…&head=…&query=…");
  notes.forEach(function (n) { $("cw-notes").appendChild(el("p", null, n)); });

  // ------------------------------------------------------------------ rendering
  var current = [];

  function update() {
    var q = S.query, r = row();
    current = r;
    var lim = 0, skip = S.scale === "nobos" && q > 0 ? 0 : -1;
    r.forEach(function (x, j) { if (x.w !== null && j !== skip) lim = Math.max(lim, Math.abs(x.w)); });
    lim = S.scale === "auto" || S.scale === "nobos" ? lim || 1 : parseFloat(S.scale);

    spans.forEach(function (s, j) {
      s.classList.toggle("cw-q", j === q);
      s.classList.toggle("cw-future", j > q);
      s.classList.toggle("cw-nan", j <= q && r[j].w === null);
      if (j > q || r[j].w === null) {
        s.style.backgroundColor = "";
        s.style.color = "";
        delete s.dataset.w;
        return;
      }
      var t = r[j].w / lim;
      s.style.backgroundColor = colour(t);
      s.style.color = Math.abs(t) > 0.55 ? "#fff" : "";
      s.dataset.w = String(r[j].w);
    });

    root.dataset.layer = S.layer;
    root.dataset.head = S.head;
    root.dataset.query = q;
    root.dataset.scale = lim;
    $("cw-layer").value = String(S.layer);
    $("cw-head").value = String(S.head);
    var sc = $("cw-scale");
    if (!Array.prototype.some.call(sc.options, function (o) { return o.value === S.scale; })) {
      var o = el("option", null, "fixed ±" + S.scale); o.value = S.scale; sc.appendChild(o);
    }
    sc.value = S.scale;
    $("cw-query").textContent = D.labels[q] + "  (" + q + ")";
    $("cw-prev").disabled = q === 0;
    $("cw-next").disabled = q === D.n - 1;

    $("cw-legend-min").textContent = fmt(-lim);
    $("cw-legend-max").textContent = fmt(lim, true);
    $("cw-legend-text").textContent = "contribution weight of each key to the query" +
      (S.head === ALL ? (INTER ? ", summed over heads" : ", mean over heads") : "") + "  ·  " +
      (S.scale === "auto" ? "scale: max |C| of the row"
        : S.scale === "nobos" ? "scale: max |C| of the row without BOS (BOS may saturate)"
          : "fixed scale");

    summary(r);
    writeHash();
  }

  function summary(r) {
    var box = $("cw-summary"), q = S.query;
    box.textContent = "";
    var total = r.reduce(function (s, x) { return x.w === null ? s : s + x.w; }, 0);
    var line = el("div", "cw-sum-line");
    var what;
    if (S.head === ALL) what = INTER ? "Σ over keys and heads" : "Σ over keys (mean of heads)";
    else what = INTER ? "Σ over keys = this head's share of the layer output" : "Σ over keys";
    line.appendChild(el("span", null, what + ": "));
    line.appendChild(el("b", null, fmt(total)));
    if (S.head !== ALL) {
      line.appendChild(el("span", "cw-dim", "   ·   " + (INTER ? "‖o_i‖ (layer)" : "‖o_i^h‖") +
        " = " + fmt(r[q].on)));
    }
    box.appendChild(line);

    var order = r.map(function (x, j) { return j; })
      .filter(function (j) { return r[j].w !== null; })
      .sort(function (a, b) { return Math.abs(r[b].w) - Math.abs(r[a].w); })
      .slice(0, 5);
    var top = el("div", "cw-top");
    top.appendChild(el("span", "cw-dim", "Top keys by |C|: "));
    var lim = parseFloat(root.dataset.scale) || 1;
    order.forEach(function (j) {
      var chip = el("span", "cw-chip");
      var tok = el("span", "cw-chip-tok", D.labels[j]);
      tok.style.backgroundColor = colour(r[j].w / lim);
      if (Math.abs(r[j].w / lim) > 0.55) tok.style.color = "#fff";
      chip.appendChild(tok);
      chip.appendChild(el("span", "cw-chip-val", fmt(r[j].w, true) + " (pos " + j + ")"));
      top.appendChild(chip);
    });
    box.appendChild(top);
  }

  function addRow(table, name, value, strong) {
    var tr = el("tr", strong ? "cw-strong" : null);
    tr.appendChild(el("td", null, name));
    tr.appendChild(el("td", "cw-num", value));
    table.appendChild(tr);
  }

  function showTip(j, ev) {
    var q = S.query;
    tip.textContent = "";
    tip.appendChild(el("div", "cw-tip-tok", JSON.stringify(D.tokens[j])));
    tip.appendChild(el("div", "cw-tip-pos", "position " + j + (j === q ? " · query" : "") +
      " · layer " + S.layer + " · " + headName(S.head)));
    if (j > q) {
      tip.appendChild(el("div", "cw-tip-note", "after the query: no contribution (causal mask)"));
    } else {
      var r = current[j], t = el("table", "cw-tip-table"), t2 = null;
      if (r.w === null) {
        tip.appendChild(el("div", "cw-tip-note", "undefined: the output norm is zero"));
      }
      if (S.head === ALL) {
        addRow(t, INTER ? "Σ_h contribution C" : "mean_h contribution c", fmt(r.w, true), true);
        addRow(t, "mean attention α", fmt(r.a));
        var maps = D.maps[D.layers.indexOf(S.layer)], k = tri(q) + j;
        t2 = el("table", "cw-tip-table cw-tip-heads");
        var hd = el("tr", "cw-tip-head");
        ["head", "attention α", INTER ? "C" : "c"].forEach(function (c, i) {
          hd.appendChild(el("td", i ? "cw-num" : null, c));
        });
        t2.appendChild(hd);
        D.heads.forEach(function (h, i) {
          var tr = el("tr");
          tr.appendChild(el("td", null, String(h)));
          tr.appendChild(el("td", "cw-num", fmt(maps[i].a[k])));
          tr.appendChild(el("td", "cw-num", fmt(r.per[i], true)));
          t2.appendChild(tr);
        });
      } else {
        addRow(t, "contribution weight " + (INTER ? "C" : "c"), fmt(r.w, true), true);
        addRow(t, "attention α", fmt(r.a));
        var o = INTER ? "o_i" : "o_i^h";
        addRow(t, "relative norm ‖pv_j‖/‖" + o + "‖", fmt(r.rn));
        addRow(t, "cosine cos(pv_j, " + o + ")", fmt(r.c, true));
      }
      tip.appendChild(t);
      if (t2) tip.appendChild(t2);
    }
    tip.hidden = false;
    moveTip(ev);
  }

  function moveTip(ev) {
    if (tip.hidden || !ev) return;
    var w = tip.offsetWidth, h = tip.offsetHeight, x, y;
    if (ev.anchor) { // pinned: below the token (above it near the bottom edge)
      var b = ev.anchor.getBoundingClientRect();
      x = Math.min(b.left, window.innerWidth - w - 8);
      y = b.bottom + 8 + h > window.innerHeight - 8 ? b.top - h - 8 : b.bottom + 8;
    } else {
      x = ev.clientX + 14;
      y = ev.clientY + 18;
      if (x + w > window.innerWidth - 8) x = ev.clientX - w - 14;
      if (y + h > window.innerHeight - 8) y = ev.clientY - h - 18;
    }
    tip.style.left = Math.max(8, x) + "px";
    tip.style.top = Math.max(8, y) + "px";
  }

  // ------------------------------------------------------------------ events
  function setQuery(q) {
    if (q >= 0 && q < D.n && q !== S.query) { S.query = q; update(); }
  }
  function tokenOf(ev) {
    var s = ev.target.closest ? ev.target.closest(".cw-tok") : null;
    return s ? parseInt(s.dataset.pos, 10) : -1;
  }
  box.addEventListener("mouseover", function (ev) {
    var j = tokenOf(ev);
    if (j >= 0) showTip(j, ev);
  });
  box.addEventListener("mousemove", moveTip);
  box.addEventListener("mouseleave", function () { tip.hidden = true; });
  box.addEventListener("click", function (ev) {
    var j = tokenOf(ev);
    if (j >= 0) { setQuery(j); showTip(j, ev); }
  });
  $("cw-layer").addEventListener("change", function (ev) { S.layer = int(ev.target.value); update(); });
  $("cw-head").addEventListener("change", function (ev) {
    S.head = ev.target.value === ALL ? ALL : int(ev.target.value);
    update();
  });
  $("cw-scale").addEventListener("change", function (ev) { S.scale = ev.target.value; update(); });
  $("cw-prev").addEventListener("click", function () { setQuery(S.query - 1); });
  $("cw-next").addEventListener("click", function () { setQuery(S.query + 1); });
  document.addEventListener("keydown", function (ev) {
    if (/^(SELECT|INPUT|TEXTAREA)$/.test(ev.target.tagName)) return;
    if (ev.key === "ArrowLeft") setQuery(S.query - 1);
    else if (ev.key === "ArrowRight") setQuery(S.query + 1);
    else return;
    ev.preventDefault();
  });

  function pin() {
    if (pinned < 0) return;
    spans[pinned].classList.add("cw-pinned");
    showTip(pinned, { anchor: spans[pinned], clientX: 0, clientY: 0 });
  }
  function unpin() {
    if (pinned < 0) return;
    spans[pinned].classList.remove("cw-pinned");
    pinned = -1;
    tip.hidden = true;
  }
  box.addEventListener("mouseenter", unpin);

  window.addEventListener("hashchange", function () { unpin(); parseHash(); update(); pin(); });
  parseHash();
  update();
  pin();
  root.classList.add("cw-ready");
})();
