/* cw_lens view: attention next to contribution (P1, Fig. 1), the head grid and the sink patch.
 *
 * One ES module for both front ends:
 *  - the Jupyter widget: anywidget calls render({model, el}); the kernel computes every state;
 *  - the saved page: bootPage() reads the JSON block #cw-data and serves the same render() a
 *    model (PageModel) that looks the states up in the precomputed sweep.
 * It draws the numbers it is given: every value, aggregate and difference comes from Python
 * (cw_lens/viz/payload.py). No dependencies, no network. */

const DIVERGING = [ // RdBu_r, as in the paper figures: -1 dark blue ... 0 white ... +1 dark red
  [5, 48, 97], [33, 102, 172], [67, 147, 195], [146, 197, 222], [209, 229, 240],
  [247, 247, 247],
  [253, 219, 199], [244, 165, 130], [214, 96, 77], [178, 24, 43], [103, 0, 31]];
const SEQUENTIAL = [ // Purples: 0 white ... 1 dark purple
  [252, 251, 253], [239, 237, 245], [218, 218, 235], [188, 189, 220], [158, 154, 200],
  [128, 125, 186], [106, 81, 163], [84, 39, 143], [63, 0, 125]];
const ALL = "all";

function ramp(stops, t) {
  t = Math.max(0, Math.min(1, t));
  const x = t * (stops.length - 1);
  const i = Math.min(Math.floor(x), stops.length - 2), f = x - i;
  const a = stops[i], b = stops[i + 1];
  return "rgb(" + [0, 1, 2].map((k) => Math.round(a[k] + f * (b[k] - a[k]))).join(", ") + ")";
}
const diverging = (t) => ramp(DIVERGING, (Math.max(-1, Math.min(1, t)) + 1) / 2);
const sequential = (t) => ramp(SEQUENTIAL, t);
const dark = (t) => Math.abs(t) > 0.55;

function h(tag, cls, text) {
  const e = document.createElement(tag);
  if (cls) e.className = cls;
  if (text !== undefined && text !== null) e.textContent = text;
  return e;
}
function svg(tag, attrs) {
  const e = document.createElementNS("http://www.w3.org/2000/svg", tag);
  for (const k in attrs) e.setAttribute(k, attrs[k]);
  return e;
}
function fmt(v, signed) {
  if (v === null || v === undefined || Number.isNaN(v)) return "—";
  if (v === 0) return "0";
  const a = Math.abs(v);
  const s = a >= 1e-3 && a < 1e5 ? a.toPrecision(4) : a.toExponential(2);
  return (v < 0 ? "−" : signed ? "+" : "") + s;
}
const tri = (i) => (i * (i + 1)) / 2;
const int = (s) => (/^-?\d+$/.test(String(s)) ? parseInt(s, 10) : NaN);
const absMax = (vals) => vals.reduce((m, v) => (v === null ? m : Math.max(m, Math.abs(v))), 0);

// ------------------------------------------------------------------ the saved page's model
/* The anywidget model interface (get / set / save_changes / on / off) over the page's data:
 * "patched" is the precomputed run of the current controls. */
class PageModel {
  constructor(data) {
    this.state = { data, controls: data.patch ? data.patch.controls : null,
      view: { layer: data.init.layer }, status: "" };
    this.handlers = {};
    this.dirty = new Set();
    this.isPage = true;
  }
  key(c) {
    const o = this.state.data.patch.options;
    const ri = o.ranges.findIndex((r) => r[0] === c.layers[0] && r[1] === c.layers[1]);
    const mi = o.modes.indexOf(c.mode);
    const si = c.mode === "scale" ? o.scales.indexOf(c.scale) : 0;
    return ri < 0 || mi < 0 || si < 0 ? null : ri + "," + si + "," + mi;
  }
  get(name) {
    if (name !== "patched") return this.state[name];
    const p = this.state.data.patch;
    return p ? p.runs[this.key(this.state.controls)] || null : null;
  }
  set(name, value) { this.state[name] = value; this.dirty.add(name); }
  save_changes() {
    const names = [...this.dirty];
    this.dirty.clear();
    if (names.includes("controls")) names.push("patched");
    names.forEach((n) => (this.handlers["change:" + n] || []).forEach((f) => f()));
  }
  on(evt, f) { (this.handlers[evt] = this.handlers[evt] || []).push(f); }
  off(evt, f) { this.handlers[evt] = (this.handlers[evt] || []).filter((g) => g !== f); }
}

// ------------------------------------------------------------------ the view
class View {
  constructor(model, root) {
    this.m = model;
    this.root = root;
    root.classList.add("cw");
    const D = model.get("data");
    this.s = { layer: D.init.layer, head: D.init.head, query: D.init.query, scale: "auto",
      grid: D.patch ? "patched" : "clean" };
    this.pin = -1;
    this.pending = false;
    if (model.isPage) this.readHash();
    this.build();
    this.subs = [
      ["change:data", () => { this.buildSelectors(); this.draw(); }],
      ["change:patched", () => { this.pending = false; this.draw(); }],
      ["change:status", () => this.drawStatus()],
    ];
    this.subs.forEach(([e, f]) => model.on(e, f));
    if (model.isPage) {
      this.onHash = () => { this.readHash(); this.syncControls(); this.draw(); };
      window.addEventListener("hashchange", this.onHash);
    }
    this.draw();
    root.classList.add("cw-ready");
  }

  destroy() {
    this.subs.forEach(([e, f]) => this.m.off(e, f));
    if (this.onHash) window.removeEventListener("hashchange", this.onHash);
  }

  get D() { return this.m.get("data"); }

  // ---------------------------------------------------------------- state <-> URL hash (page)
  readHash() {
    const D = this.D, q = {};
    (location.hash || "").replace(/^#/, "").split("&").forEach((kv) => {
      const p = kv.split("=");
      if (p[0]) q[decodeURIComponent(p[0])] = decodeURIComponent(p.slice(1).join("="));
    });
    if (D.layers.indexOf(int(q.layer)) >= 0) this.s.layer = int(q.layer);
    if (/^(all|sum|mean)$/.test(q.head || "")) this.s.head = ALL;
    else if (D.heads.indexOf(int(q.head)) >= 0) this.s.head = int(q.head);
    if (int(q.query) >= 0 && int(q.query) < D.n) this.s.query = int(q.query);
    if (q.scale === "auto" || parseFloat(q.scale) > 0) this.s.scale = q.scale;
    if (q.grid === "clean" || (q.grid === "patched" && D.patch)) this.s.grid = q.grid;
    this.pin = int(q.hover) >= 0 && int(q.hover) < D.n ? int(q.hover) : -1;
    if (q.patch && D.patch) {
      const [ri, si, mi] = q.patch.split(",").map(int), o = D.patch.options;
      if (o.ranges[ri] && o.scales[si] !== undefined && o.modes[mi]) {
        this.m.set("controls", { ...this.m.get("controls"), layers: o.ranges[ri],
          scale: o.scales[si], mode: o.modes[mi] });
        this.m.save_changes();
      }
    }
  }

  writeHash() {
    if (!this.m.isPage) return;
    const s = this.s;
    let hash = "#layer=" + s.layer + "&head=" + s.head + "&query=" + s.query +
      (s.scale === "auto" ? "" : "&scale=" + s.scale);
    const key = this.D.patch ? this.m.key(this.m.get("controls")) : null;
    if (key) hash += "&patch=" + key;
    if (location.hash === hash) return;
    try { history.replaceState(null, "", hash); } catch (e) { /* sandboxed srcdoc iframe */ }
  }

  // ---------------------------------------------------------------- skeleton
  build() {
    const r = this.root, D = this.D;
    r.textContent = "";
    const head = h("header", "cw-header");
    head.appendChild(h("div", "cw-title", this.m.isPage ? document.title : "cw_lens · sink patching"));
    this.meta = head.appendChild(h("div", "cw-meta"));
    r.appendChild(head);

    if (D.patch) r.appendChild(this.buildPatchBar(D.patch.options));

    const bar = h("div", "cw-controls");
    const field = (label, child) => {
      const f = h("label", "cw-field", label + " ");
      f.appendChild(child);
      return bar.appendChild(f);
    };
    this.selLayer = field("Layer", h("select", "cw-layer"));
    this.selLayer = this.selLayer.querySelector("select");
    this.selHead = field("Head", h("select", "cw-head")).querySelector("select");
    const q = h("span", "cw-field", "Query ");
    this.prev = q.appendChild(h("button", "cw-btn cw-prev", "◀"));
    this.qLabel = q.appendChild(h("span", "cw-query-label"));
    this.next = q.appendChild(h("button", "cw-btn cw-next", "▶"));
    bar.appendChild(q);
    this.selScale = field("Colour", h("select", "cw-scale")).querySelector("select");
    [["auto", "row max"], ["1", "fixed ±1"]].forEach(([v, t]) => {
      const o = this.selScale.appendChild(h("option", null, t)); o.value = v;
    });
    r.appendChild(bar);

    if (D.clean.top) {
      const row = r.appendChild(h("div", "cw-two"));
      this.predBox = row.appendChild(h("section", "cw-panel cw-pred"));
      this.nllBox = row.appendChild(h("section", "cw-panel cw-nll"));
    }
    this.figBox = r.appendChild(h("section", "cw-panel cw-fig"));
    this.gridBox = r.appendChild(h("section", "cw-panel cw-grid"));
    if (D.patch) this.coneBox = r.appendChild(h("section", "cw-panel cw-cone"));
    const notes = r.appendChild(h("div", "cw-notes"));
    [
      "Attention α (purple) next to the contribution weight (red: pushes the output along the " +
      "key's value, blue: against it) of every key j ≤ query i. Hover a cell or token for the " +
      "factors: contribution = attention × relative norm ‖pv_j‖/‖o_i‖ × cosine cos(pv_j, o_i).",
      "Click a matrix row or a token to pick the query (← → move it); click a head in the grid " +
      "to select it." + (D.patch ? " The sink patch scales the sink's projected value " +
        "pv_0 → λ·pv_0 in the chosen layers and heads (the model's attention is untouched; λ > 1 " +
        "amplifies); in a patched layer the attention shown is the effective one, α_i0 scaled by λ, " +
        "so that contribution = attention × relative norm × cosine still holds." : ""),
    ].forEach((t) => notes.appendChild(h("p", null, t)));
    this.tip = r.appendChild(h("div", "cw-tip"));
    this.tip.hidden = true;
    this.buildSelectors();
    this.wire();
  }

  buildSelectors() {
    const D = this.D;
    this.selLayer.textContent = "";
    (D.choices || D.layers).forEach((l) => {
      const o = this.selLayer.appendChild(h("option", null, "layer " + l)); o.value = l;
    });
    this.selHead.textContent = "";
    D.heads.forEach((hd) => {
      const o = this.selHead.appendChild(h("option", null, "head " + hd)); o.value = hd;
    });
    const o = this.selHead.appendChild(h("option", null,
      D.kind === "inter" ? "all heads (Σ)" : "all heads (mean)"));
    o.value = ALL;
    this.meta.textContent = "";
    [D.model || "model",
      "kind: " + D.kind + (D.kind === "inter" ? " (share of the layer output)" : " (share of each head's output)"),
      D.n + " tokens", D.layers.length + " layer(s) on the page", D.heads.length + " heads"]
      .forEach((t, i) => this.meta.appendChild(h("span", i ? "cw-meta-item" : "cw-meta-model", t)));
  }

  buildPatchBar(o) {
    const bar = h("div", "cw-patchbar");
    bar.appendChild(h("span", "cw-patch-title", "Sink patch"));
    const field = (label, child, cls) => {
      const f = bar.appendChild(h("label", "cw-field " + (cls || ""), label + " "));
      f.appendChild(child);
      return child;
    };
    const c = this.m.get("controls");
    const ctl = (this.ctl = {});
    if (o.free) {
      ctl.first = field("Layers", h("input", "cw-first"));
      ctl.last = field("to", h("input", "cw-last"));
      [ctl.first, ctl.last].forEach((e) => Object.assign(e, { type: "number", min: 0, max: o.n_layers - 1, step: 1 }));
      ctl.heads = field("Heads", h("input", "cw-heads"));
      ctl.heads.placeholder = "all or 0,3";
      ctl.heads.size = 8;
      ctl.sinks = field("Sinks", h("input", "cw-sinks"));
      ctl.sinks.size = 5;
    } else {
      ctl.range = field("Layers", h("select", "cw-range"));
      o.ranges.forEach((r, i) => {
        const e = ctl.range.appendChild(h("option", null, r[0] === r[1] ? String(r[0]) : r[0] + "–" + r[1]));
        e.value = i;
      });
      bar.appendChild(h("span", "cw-field cw-fixed", "Heads all · Sinks " + c.sinks.join(",")));
    }
    ctl.scale = field("λ", h("input", "cw-lambda"));
    ctl.scale.type = "range";
    if (o.free) Object.assign(ctl.scale, { min: 0, max: o.max_scale, step: 0.05 });
    else Object.assign(ctl.scale, { min: 0, max: o.scales.length - 1, step: 1 });
    ctl.scaleOut = bar.appendChild(h("output", "cw-lambda-value"));
    ctl.mode = field("Mode", h("select", "cw-mode"));
    o.modes.forEach((m) => { const e = ctl.mode.appendChild(h("option", null, m.replace("_", "-"))); e.value = m; });
    this.status = bar.appendChild(h("span", "cw-status"));
    this.syncControls();
    const send = () => this.sendControls();
    [ctl.first, ctl.last, ctl.heads, ctl.sinks, ctl.range, ctl.mode].forEach((e) => e && e.addEventListener("change", send));
    ctl.scale.addEventListener(o.free ? "change" : "input", send);
    ctl.scale.addEventListener("input", () => this.showScale());
    return bar;
  }

  syncControls() {
    if (!this.ctl) return;
    const c = this.m.get("controls"), o = this.D.patch.options, ctl = this.ctl;
    if (o.free) {
      ctl.first.value = c.layers[0];
      ctl.last.value = c.layers[1];
      ctl.heads.value = c.heads === ALL ? ALL : c.heads.join(",");
      ctl.sinks.value = c.sinks.join(",");
      ctl.scale.value = c.scale;
    } else {
      ctl.range.value = o.ranges.findIndex((r) => r[0] === c.layers[0] && r[1] === c.layers[1]);
      ctl.scale.value = Math.max(0, o.scales.indexOf(c.scale));
    }
    ctl.mode.value = c.mode;
    ctl.scale.disabled = c.mode !== "scale";
    this.showScale();
  }

  showScale() {
    const o = this.D.patch.options, v = this.ctl.scale.value;
    this.ctl.scaleOut.textContent = this.ctl.scale.disabled ? "norm-matched"
      : (o.free ? parseFloat(v) : o.scales[int(v)]).toFixed(2);
  }

  sendControls() {
    const o = this.D.patch.options, ctl = this.ctl, c = { ...this.m.get("controls") };
    const list = (s) => s.split(/[\s,]+/).filter(Boolean).map(Number);
    if (o.free) {
      c.layers = [Number(ctl.first.value), Number(ctl.last.value)];
      c.heads = /^\s*(all)?\s*$/i.test(ctl.heads.value) ? ALL : list(ctl.heads.value);
      c.sinks = list(ctl.sinks.value);
      c.scale = parseFloat(ctl.scale.value);
    } else {
      c.layers = o.ranges[int(ctl.range.value)];
      c.scale = o.scales[int(ctl.scale.value)];
    }
    c.mode = ctl.mode.value;
    ctl.scale.disabled = c.mode !== "scale";
    this.showScale();
    this.pending = !this.m.isPage;
    this.m.set("controls", c);
    this.m.save_changes();
    this.drawStatus();
  }

  drawStatus() {
    if (!this.status) return;
    const err = this.m.get("status");
    this.status.textContent = err || (this.pending ? "computing…" : "");
    this.status.classList.toggle("cw-error", Boolean(err));
    this.root.dataset.status = err ? "error" : this.pending ? "computing" : "ready";
  }

  wire() {
    this.selLayer.addEventListener("change", () => {
      this.s.layer = int(this.selLayer.value);
      if (this.D.layers.indexOf(this.s.layer) < 0) { // the widget computes the layer's maps
        this.pending = true;
        this.m.set("view", { layer: this.s.layer });
        this.m.save_changes();
      }
      this.draw();
    });
    this.selHead.addEventListener("change", () => {
      this.s.head = this.selHead.value === ALL ? ALL : int(this.selHead.value);
      this.draw();
    });
    this.selScale.addEventListener("change", () => { this.s.scale = this.selScale.value; this.draw(); });
    this.prev.addEventListener("click", () => this.setQuery(this.s.query - 1));
    this.next.addEventListener("click", () => this.setQuery(this.s.query + 1));
    this.root.tabIndex = 0;
    this.root.addEventListener("keydown", (ev) => {
      if (/^(SELECT|INPUT|TEXTAREA)$/.test(ev.target.tagName)) return;
      if (ev.key === "ArrowLeft") this.setQuery(this.s.query - 1);
      else if (ev.key === "ArrowRight") this.setQuery(this.s.query + 1);
      else return;
      ev.preventDefault();
    });
    // one set of listeners for every hoverable thing: [data-tip] names what it describes
    this.root.addEventListener("mouseover", (ev) => {
      const t = ev.target.closest ? ev.target.closest("[data-tip]") : null;
      if (t && this.root.contains(t)) { this.unpin(); this.showTip(t, ev); }
    });
    this.root.addEventListener("mousemove", (ev) => this.moveTip(ev));
    this.root.addEventListener("mouseout", (ev) => {
      const t = ev.target.closest ? ev.target.closest("[data-tip]") : null;
      if (t && !t.contains(ev.relatedTarget)) this.tip.hidden = true;
    });
    this.root.addEventListener("click", (ev) => {
      const t = ev.target.closest ? ev.target.closest("[data-query],[data-pick-head]") : null;
      if (!t) return;
      if (t.dataset.pickHead !== undefined) {
        const hd = t.dataset.pickHead;
        this.s.head = hd === ALL ? ALL : int(hd);
        this.draw();
      } else this.setQuery(int(t.dataset.query));
    });
  }

  setQuery(q) {
    if (q >= 0 && q < this.D.n && q !== this.s.query) { this.s.query = q; this.draw(); }
  }

  // ---------------------------------------------------------------- data access
  maps() {
    const D = this.D, li = D.layers.indexOf(this.s.layer);
    if (li < 0) return null;
    const P = this.m.get("patched");
    const clean = D.clean.maps[li];
    return { clean, patched: P ? P.maps[li] || clean : null, P };
  }
  pick(map) {
    return this.s.head === ALL ? map.all : map.h[this.D.heads.indexOf(this.s.head)];
  }

  // ---------------------------------------------------------------- drawing
  draw() {
    const D = this.D, s = this.s;
    if (D.choices && D.choices.indexOf(s.layer) < 0) s.layer = D.init.layer;
    if (s.head !== ALL && D.heads.indexOf(s.head) < 0) s.head = D.heads[0];
    s.query = Math.min(s.query, D.n - 1);
    this.selLayer.value = String(s.layer);
    this.selHead.value = String(s.head);
    if (![...this.selScale.options].some((o) => o.value === s.scale)) {
      const o = this.selScale.appendChild(h("option", null, "fixed ±" + s.scale)); o.value = s.scale;
    }
    this.selScale.value = s.scale;
    this.qLabel.textContent = D.labels[s.query] + "  (" + s.query + ")";
    this.prev.disabled = s.query === 0;
    this.next.disabled = s.query === D.n - 1;
    Object.assign(this.root.dataset, { layer: s.layer, head: s.head, query: s.query, scale: s.scale });
    const M = this.maps();
    if (this.ctl) this.syncControls();
    this.drawStatus();
    if (!M) {
      this.figBox.textContent = "";
      this.figBox.appendChild(h("div", "cw-dim", "computing layer " + s.layer + "…"));
      return;
    }
    if (this.predBox) this.drawPredictions(M.P);
    if (this.nllBox) this.drawNll(M.P);
    this.drawFigure(M);
    this.drawGrid(M);
    if (this.coneBox) this.drawCone(M.P);
    this.writeHash();
    if (this.pin >= 0) {
      const t = this.figBox.querySelector('.cw-strip[data-cond="clean"][data-field="w"] [data-key="' + this.pin + '"]');
      if (t) this.showTip(t, null);
    }
  }

  drawPredictions(P) {
    const D = this.D, q = this.s.query, box = this.predBox;
    box.textContent = "";
    box.appendChild(h("h3", null, "Next token after “" + D.labels[q] + "” (position " + q + ")"));
    const cols = box.appendChild(h("div", "cw-pred-cols"));
    const list = (name, run) => {
      const col = cols.appendChild(h("div", "cw-pred-col"));
      col.dataset.cond = name;
      col.appendChild(h("div", "cw-pred-head", name));
      run.top.tok[q].forEach((tok, k) => {
        const p = run.top.p[q][k], row = col.appendChild(h("div", "cw-pred-row"));
        row.dataset.p = p;
        row.appendChild(h("span", "cw-pred-tok", tok));
        const bar = row.appendChild(h("span", "cw-pred-bar"));
        bar.style.width = Math.round(100 * p) + "px";
        row.appendChild(h("span", "cw-pred-p", fmt(p)));
      });
    };
    list("clean", D.clean);
    if (P) list("patched", P);
    const line = box.appendChild(h("div", "cw-nll-line"));
    line.textContent = "mean NLL " + fmt(D.clean.nll_mean) + " (PPL " + fmt(D.clean.ppl) + ")" +
      (P ? " → patched " + fmt(P.nll_mean) + " (PPL " + fmt(P.ppl) + "), ΔNLL " + fmt(P.delta.nll_mean, true) : "");
  }

  drawNll(P) {
    const D = this.D, box = this.nllBox;
    box.textContent = "";
    box.appendChild(h("h3", null, P ? "NLL change per token (patched − clean)" : "NLL per token"));
    const vals = P ? P.delta.nll : D.clean.nll;
    const lim = absMax(vals) || 1;
    const strip = box.appendChild(h("div", "cw-strip cw-nll-strip"));
    D.labels.forEach((lab, t) => {
      const s = strip.appendChild(h("span", "cw-tok", lab));
      if (t === 0) { s.classList.add("cw-future"); return; }
      const v = vals[t - 1];
      s.dataset.v = v;
      s.dataset.tip = "nll";
      s.dataset.pos = t;
      s.style.backgroundColor = P ? diverging(v / lim) : sequential(v / lim);
      if (dark(v / lim)) s.style.color = "#fff";
    });
    box.appendChild(h("div", "cw-legend-text", (P ? "red: the patch makes the token less likely; blue: more likely · scale ±" : "scale 0–") + fmt(lim)));
  }

  drawFigure(M) {
    const D = this.D, s = this.s, box = this.figBox;
    box.textContent = "";
    const who = s.head === ALL ? (D.kind === "inter" ? "all heads (Σ)" : "all heads (mean)") : "head " + s.head;
    box.appendChild(h("h3", null, "Attention | contribution — layer " + s.layer + ", " + who +
      ", query “" + D.labels[s.query] + "” (" + s.query + ")"));
    const conds = [["clean", this.pick(M.clean)]];
    if (M.patched) conds.push(["patched", this.pick(M.patched)]);
    const n = D.n, cell = Math.max(4, Math.min(16, Math.floor(320 / n)));
    conds.forEach(([cond, f]) => {
      const row = box.appendChild(h("div", "cw-fig-row"));
      row.appendChild(h("div", "cw-fig-label", cond));
      [["a", "attention α"], ["w", "contribution " + (D.kind === "inter" ? "C" : "c")]].forEach(([field, title]) => {
        const fig = row.appendChild(h("figure", "cw-matrix"));
        fig.appendChild(h("figcaption", null, title));
        fig.appendChild(this.matrix(f[field], n, cell, field, cond));
      });
    });
    const strips = box.appendChild(h("div", "cw-strips"));
    conds.forEach(([cond, f]) => {
      [["a", "attention"], ["w", "contribution"]].forEach(([field, title]) => {
        const line = strips.appendChild(h("div", "cw-strip-line"));
        line.appendChild(h("span", "cw-strip-label", title + " · " + cond));
        line.appendChild(this.strip(f[field], field, cond));
      });
    });
  }

  colourFor(field, v, lim) {
    return field === "a" ? sequential(v / lim) : diverging(v / lim);
  }

  rowLimit(vals, off, q) {
    if (this.s.scale !== "auto") return parseFloat(this.s.scale);
    return absMax(vals.slice(off, off + q + 1)) || 1;
  }

  matrix(vals, n, cell, field, cond) {
    const pad = 2, size = n * cell + 2 * pad;
    const g = svg("svg", { width: size, height: size, viewBox: "0 0 " + size + " " + size,
      class: "cw-svg", "data-field": field, "data-cond": cond });
    for (let i = 0; i < n; i++) {
      const off = tri(i), lim = this.rowLimit(vals, off, i);
      for (let j = 0; j <= i; j++) {
        const v = vals[off + j];
        const r = g.appendChild(svg("rect", { x: pad + j * cell, y: pad + i * cell, width: cell,
          height: cell, fill: v === null ? "#eee" : this.colourFor(field, v, lim) }));
        r.dataset.query = i;
        r.dataset.key = j;
        r.dataset.v = v === null ? "" : v;
        r.dataset.tip = "pair";
        r.dataset.cond = cond;
      }
    }
    g.appendChild(svg("rect", { x: pad - 0.5, y: pad + this.s.query * cell - 0.5, width: (this.s.query + 1) * cell + 1,
      height: cell + 1, fill: "none", stroke: "#111827", "stroke-width": 1.5, class: "cw-qrow" }));
    return g;
  }

  strip(vals, field, cond) {
    const D = this.D, q = this.s.query, off = tri(q), lim = this.rowLimit(vals, off, q);
    const box = h("div", "cw-strip");
    Object.assign(box.dataset, { field, cond });
    D.labels.forEach((lab, j) => {
      const s = box.appendChild(h("span", "cw-tok", lab));
      s.dataset.key = j;
      if (j === q) s.classList.add("cw-q");
      if (j > q) { s.classList.add("cw-future"); return; }
      const v = vals[off + j];
      Object.assign(s.dataset, { query: j, tip: "pair", cond, row: q });
      if (v === null) { s.classList.add("cw-nan"); return; }
      s.dataset.v = v;
      s.style.backgroundColor = this.colourFor(field, v, lim);
      if (dark(field === "a" ? v / lim : Math.abs(v) / lim)) s.style.color = "#fff";
    });
    return box;
  }

  drawGrid(M) {
    const D = this.D, s = this.s, box = this.gridBox;
    box.textContent = "";
    const head = box.appendChild(h("h3", null, "All heads of layer " + s.layer + " (attention | contribution" +
      (M.patched ? ", " : ", clean)")));
    if (M.patched) {
      const sel = head.appendChild(h("select", "cw-grid-cond"));
      ["patched", "clean"].forEach((c) => { const o = sel.appendChild(h("option", null, c)); o.value = c; });
      sel.value = s.grid;
      sel.addEventListener("change", () => { s.grid = sel.value; this.draw(); });
      head.appendChild(document.createTextNode(")"));
    }
    const map = M.patched && s.grid === "patched" ? M.patched : M.clean;
    const n = D.n, cell = Math.max(2, Math.min(6, Math.floor(96 / n)));
    const grid = box.appendChild(h("div", "cw-grid-cells"));
    const items = D.heads.map((hd, i) => [hd, map.h[i]]).concat([[ALL, map.all]]);
    items.forEach(([hd, f]) => {
      const c = grid.appendChild(h("div", "cw-grid-cell" + (hd === s.head ? " cw-selected" : "")));
      c.dataset.pickHead = hd;
      c.appendChild(h("div", "cw-grid-title", hd === ALL ? "all" : "head " + hd));
      const pair = c.appendChild(h("div", "cw-grid-pair"));
      ["a", "w"].forEach((field) => {
        const g = pair.appendChild(this.mini(f[field], n, cell, field));
        Object.assign(g.dataset, { head: hd, field });
      });
    });
  }

  mini(vals, n, cell, field) {
    const size = n * cell;
    const g = svg("svg", { width: size, height: size, class: "cw-mini" });
    for (let i = 0; i < n; i++) {
      const off = tri(i), lim = this.rowLimit(vals, off, i);
      for (let j = 0; j <= i; j++) {
        const v = vals[off + j];
        if (v === null) continue;
        const r = g.appendChild(svg("rect", { x: j * cell, y: i * cell, width: cell, height: cell,
          fill: this.colourFor(field, v, lim) }));
        r.dataset.v = v;
      }
    }
    return g;
  }

  drawCone(P) {
    const box = this.coneBox;
    box.textContent = "";
    box.appendChild(h("h3", null, "Patched layers: cone alignment cos(o_i^h, u^h), patched (colour: change from clean)"));
    if (!P) return;
    const c = this.m.get("controls"), D = this.D;
    const table = box.appendChild(h("table", "cw-cone-table"));
    const hr = table.appendChild(h("tr"));
    hr.appendChild(h("th", null, "layer"));
    D.all_heads.forEach((hd) => hr.appendChild(h("th", null, "h" + hd)));
    const lim = absMax([].concat(...P.delta.cone)) || 1;
    P.cone.layers.forEach((layer, li) => {
      const tr = table.appendChild(h("tr"));
      tr.appendChild(h("th", null, String(layer)));
      D.all_heads.forEach((hd, i) => {
        const v = P.cone.cone[li][i], d = P.delta.cone[li][i];
        const td = tr.appendChild(h("td", "cw-cone-cell", fmt(v)));
        Object.assign(td.dataset, { tip: "cone", layer, head: hd, li, hi: i, v: v === null ? "" : v });
        if (d !== null) { td.style.backgroundColor = diverging(d / lim); if (dark(d / lim)) td.style.color = "#fff"; }
        if (c.heads !== ALL && c.heads.indexOf(hd) < 0) td.classList.add("cw-unpatched");
      });
    });
    box.appendChild(h("div", "cw-legend-text", "red: the head's output turns towards its semantic cone; blue: away · scale ±" + fmt(lim) +
      " · hover for output norms. Heads outside the patch are faded."));
  }

  // ---------------------------------------------------------------- tooltips
  showTip(t, ev) {
    const D = this.D, tip = this.tip, kind = t.dataset.tip;
    tip.textContent = "";
    const table = h("table", "cw-tip-table");
    const row = (name, vals, strong) => {
      const tr = table.appendChild(h("tr", strong ? "cw-strong" : null));
      tr.appendChild(h("td", null, name));
      vals.forEach((v) => tr.appendChild(h("td", "cw-num", v)));
    };
    if (kind === "pair") {
      const M = this.maps(), i = int(t.dataset.query === undefined ? this.s.query : (t.dataset.row || t.dataset.query)),
        j = int(t.dataset.key);
      tip.appendChild(h("div", "cw-tip-tok", JSON.stringify(D.tokens[j])));
      tip.appendChild(h("div", "cw-tip-pos", "key " + j + " → query " + i + " " + JSON.stringify(D.tokens[i]) +
        " · layer " + this.s.layer + " · " + (this.s.head === ALL ? "all heads" : "head " + this.s.head)));
      const conds = [["clean", this.pick(M.clean)]];
      if (M.patched) conds.push(["patched", this.pick(M.patched)]);
      const k = tri(i) + j, o = D.kind === "inter" ? "o_i" : "o_i^h";
      if (conds.length > 1) row("", conds.map((c) => c[0]));
      row("contribution " + (D.kind === "inter" ? "C" : "c"), conds.map((c) => fmt(c[1].w[k], true)), true);
      row(this.s.head === ALL ? "mean attention α" : "attention α", conds.map((c) => fmt(c[1].a[k])));
      if (this.s.head !== ALL) {
        row("relative norm ‖pv_j‖/‖" + o + "‖", conds.map((c) => fmt(c[1].r[k])));
        row("cosine cos(pv_j, " + o + ")", conds.map((c) => fmt(c[1].c[k], true)));
        row("output norm ‖" + o + "‖", conds.map((c) => fmt(c[1].on[i])));
      }
    } else if (kind === "nll") {
      const P = this.m.get("patched"), p = int(t.dataset.pos);
      tip.appendChild(h("div", "cw-tip-tok", JSON.stringify(D.tokens[p])));
      tip.appendChild(h("div", "cw-tip-pos", "position " + p + ": −log p(token | tokens before)"));
      row("NLL clean", [fmt(D.clean.nll[p - 1])]);
      if (P) { row("NLL patched", [fmt(P.nll[p - 1])]); row("change", [fmt(P.delta.nll[p - 1], true)], true); }
    } else if (kind === "cone") {
      const P = this.m.get("patched"), li = int(t.dataset.li), hi = int(t.dataset.hi);
      tip.appendChild(h("div", "cw-tip-tok", "layer " + t.dataset.layer + " · head " + t.dataset.head));
      row("", ["clean", "patched", "change"]);
      row("cone alignment", [fmt(P.delta.clean_cone[li][hi], true), fmt(P.cone.cone[li][hi], true), fmt(P.delta.cone[li][hi], true)], true);
      row("output norm ‖o^h‖", [fmt(P.delta.clean_norm[li][hi]), fmt(P.cone.norm[li][hi]), fmt(P.delta.norm[li][hi], true)]);
    }
    tip.appendChild(table);
    tip.hidden = false;
    this.moveTip(ev, t);
  }

  moveTip(ev, anchor) {
    const tip = this.tip;
    if (tip.hidden || (!ev && !anchor)) return;
    const w = tip.offsetWidth, ht = tip.offsetHeight;
    let x, y;
    if (!ev) {
      const b = anchor.getBoundingClientRect();
      x = Math.min(b.left, window.innerWidth - w - 8);
      y = b.bottom + 8 + ht > window.innerHeight - 8 ? b.top - ht - 8 : b.bottom + 8;
    } else {
      x = ev.clientX + 14;
      y = ev.clientY + 18;
      if (x + w > window.innerWidth - 8) x = ev.clientX - w - 14;
      if (y + ht > window.innerHeight - 8) y = ev.clientY - ht - 18;
    }
    tip.style.left = Math.max(8, x) + "px";
    tip.style.top = Math.max(8, y) + "px";
  }

  unpin() { this.pin = -1; }
}

export function render({ model, el }) {
  const view = new View(model, el);
  return () => view.destroy();
}

export function bootPage() {
  const data = JSON.parse(document.getElementById("cw-data").textContent);
  render({ model: new PageModel(data), el: document.getElementById("cw-root") });
}

export default { render };
