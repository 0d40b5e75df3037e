// Route-graph panel of cw_lens (see cw_lens/viz/routes.py). Data: #route-data (JSON).
(function(){
const D = JSON.parse(document.getElementById('route-data').textContent);
const NS = 'http://www.w3.org/2000/svg', svg = document.getElementById('routes');
const tip = document.getElementById('tip');
const dx = 44, dy = 34, left = 50, top = 16, bottom = 90;
const W = left + dx * D.tokens.length, H = top + dy * D.n_layers + bottom;
svg.setAttribute('width', W); svg.setAttribute('height', H);
const X = p => left + dx * p + dx / 2, Y = l => top + dy * (D.n_layers - l);
function el(name, attrs, parent) {
  const e = document.createElementNS(NS, name);
  for (const k in attrs) e.setAttribute(k, attrs[k]);
  (parent || svg).appendChild(e); return e;
}
const fmt = v => v === null ? 'n/a' : Number(v).toPrecision(4);
function show(text, x, y) {
  tip.textContent = text; tip.style.display = 'block';
  tip.style.left = (x + 12) + 'px'; tip.style.top = (y + 12) + 'px';
}
const nodeName = l => Number.isInteger(l) ? `x${l}` : `m${l - 0.5}`;
function edgeText(e) {
  const s = D.labels[e.source], t = D.labels[e.target];
  if (e.kind === 'residual' || e.kind === 'mlp')
    return `layer ${e.layer}  ${e.kind}\n${nodeName(e.source_layer)} -> ${nodeName(e.target_layer)}` +
      ` at ${e.source} '${s}'\nshare ${fmt(e.share)}`;
  return `layer ${e.layer}  head ${e.head}\nkey ${e.source} '${s}' -> query ${e.target} '${t}'` +
    `\nshare ${fmt(e.share)}\n = attention ${fmt(e.attention)}` +
    `\n x relative norm ${fmt(e.relative_norm)}\n x cosine ${fmt(e.cosine)}`;
}
const top_share = Math.max(D.threshold * 2, ...D.edges.filter(e => e.kind === 'attention').map(e => e.share));
D.edges.forEach((e, i) => {
  const g = el('g', {'class': 'edge', 'data-edge': i});
  const c = [X(e.source), Y(e.source_layer), X(e.target), Y(e.target_layer)];
  const f = Math.min(1, e.share / top_share);
  const colour = e.kind === 'residual' ? '#bbb' : e.kind === 'mlp' ? '#1f77b4' :
    `rgb(${200 + 55 * f | 0},${(1 - f) * 160 | 0},${(1 - f) * 140 | 0})`;
  el('line', {x1: c[0], y1: c[1], x2: c[2], y2: c[3], 'class': 'vis', stroke: colour,
              'stroke-width': e.kind === 'attention' ? 1 + 3 * f : 1.2 + Math.min(1, e.share)}, g);
  el('line', {x1: c[0], y1: c[1], x2: c[2], y2: c[3], 'class': 'hit'}, g);
  g.addEventListener('mousemove', ev => show(edgeText(e), ev.clientX, ev.clientY));
  g.addEventListener('mouseleave', () => tip.style.display = 'none');
});
D.nodes.forEach(n => {
  const c = el('circle', {cx: X(n.position), cy: Y(n.layer), r: n.half ? 3 : 3.5,
                          'class': n.half ? 'node half' : 'node'});
  const into = `\nshares in: residual ${fmt(n.residual)}, attention ${fmt(n.attention)}, ` +
    `mlp ${fmt(n.mlp)}, bias ${fmt(n.bias)}`;
  const what = n.layer === 0 ? '\nembedding' : n.half ?
    `\nm${n.layer - 0.5}: the MLP's input in block ${n.layer - 0.5}` + into :
    `\nafter block ${n.layer - 1}` + into;
  const text = `node ${nodeName(n.layer)} at ${n.position} '${D.labels[n.position]}'` + what;
  c.addEventListener('mousemove', ev => show(text, ev.clientX, ev.clientY));
  c.addEventListener('mouseleave', () => tip.style.display = 'none');
});
el('circle', {cx: X(D.target), cy: Y(D.n_layers), r: 8, 'class': 'target'});
D.labels.forEach((t, p) => {
  const x = X(p), y = top + dy * D.n_layers + 12;
  const txt = el('text', {x: x, y: y, 'font-size': 11, transform: `rotate(60 ${x} ${y})`});
  txt.textContent = t;
});
for (let l = 0; l <= D.n_layers; l += Math.max(1, Math.ceil(D.n_layers / 10))) {
  const txt = el('text', {x: 4, y: Y(l) + 4, 'font-size': 10, fill: '#666'}); txt.textContent = 'L' + l;
}
document.getElementById('meta').textContent =
  `${D.model}: routes to position ${D.target} '${D.labels[D.target]}', share > ${D.threshold}, ` +
  `${D.edges.filter(e => e.kind === 'attention').length} attention edges, ` +
  `${D.edges.filter(e => e.kind === 'mlp').length} MLP edges (blue; hollow nodes: the MLP's input m). ` +
  'Hover an edge or a node.';
const m = /edge=(\d+)/.exec(location.hash);
if (m && D.edges[+m[1]]) { show(edgeText(D.edges[+m[1]]), 40, 40); tip.setAttribute('data-edge', m[1]); }
})();
