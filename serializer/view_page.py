"""The page ``kiln view`` writes (serializer/view.py fills in ``{{TITLE}}`` and ``{{DATA}}``).

Why a Python module rather than an .html/.js file beside it: it ships with the package as code, with no
package-data rule to keep in step, and the page needs nothing else -- no library, no font, no image.

The script reads the graph from the ``kiln-data`` JSON element and:

- lays each graph out top-down (``layout``): a vertex per node, graph input and output, and per value
  read from an enclosing graph; ranks by longest path (sources with no inputs moved down next to
  their first reader); one dummy point per rank crossed by a long edge, shared by the readers of
  one value; a few barycenter sweeps to order each rank; x positions by Brandes and Koepf (median
  alignment, so that a chain stays straight however deep the network; see ``positionX``); each edge
  enters its reader at a slot of its own, ordered by where it comes from.
  An expanded node (fused group, If, Loop) is a box holding the layouts of its bodies, so expanding
  one re-runs the layout with that box in place;
- draws it as SVG, text through ``textContent`` only (the model's strings are never parsed as markup);
- pans (drag, scroll) and zooms (Ctrl+scroll, buttons); finds nodes by name, op (``op:Conv``), module
  path or source line, opening the groups that hold a match; shows a node's or value's details on click.
"""

PAGE = r"""<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<meta http-equiv="Content-Security-Policy"
      content="default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; img-src data:">
<link rel="icon" href="data:,">
<title>{{TITLE}}</title>
<style>
:root {
  --bg: #fafafa; --fg: #1d1d1f; --muted: #6b6b70; --panel: #ffffff; --border: #d5d5da; --edge: #8a8a92;
  --node: #ffffff; --sel: #1a73e8; --match: #f5b400;
  --c-anchor: #dbe8ff; --c-elementwise: #e7f4e4; --c-other: #f0f0f3; --c-fused: #efe2ff;
  --c-control: #ddf3f7; --c-guard: #ffe3c2; --c-io: #fff7d6; --cluster: rgba(120, 80, 200, 0.05);
}
@media (prefers-color-scheme: dark) {
  :root {
    --bg: #17171a; --fg: #e8e8ea; --muted: #9a9aa2; --panel: #202024; --border: #3a3a42; --edge: #7b7b85;
    --node: #26262b; --sel: #6ea8ff; --match: #ffcc33;
    --c-anchor: #24354f; --c-elementwise: #223a26; --c-other: #2c2c31; --c-fused: #3a2c52;
    --c-control: #1f3d44; --c-guard: #4e3418; --c-io: #403a1e; --cluster: rgba(160, 120, 255, 0.07);
  }
}
* { box-sizing: border-box; }
html, body { margin: 0; height: 100%; background: var(--bg); color: var(--fg);
  font: 13px/1.35 system-ui, -apple-system, "Segoe UI", Roboto, sans-serif; }
#app { display: grid; grid-template-rows: auto 1fr; grid-template-columns: 1fr 360px; height: 100vh; }
header { grid-column: 1 / 3; display: flex; gap: 8px; align-items: center; padding: 6px 10px;
  border-bottom: 1px solid var(--border); background: var(--panel); flex-wrap: wrap; }
header h1 { font-size: 14px; margin: 0 8px 0 0; white-space: nowrap; overflow: hidden; text-overflow: ellipsis;
  max-width: 30vw; }
header input { width: 260px; padding: 4px 8px; border: 1px solid var(--border); border-radius: 4px;
  background: var(--bg); color: var(--fg); }
button { padding: 3px 9px; border: 1px solid var(--border); border-radius: 4px; background: var(--bg);
  color: var(--fg); cursor: pointer; font: inherit; }
button:hover { border-color: var(--sel); }
#count { color: var(--muted); min-width: 80px; }
.hint { color: var(--muted); margin-left: auto; font-size: 12px; }
#canvas { position: relative; overflow: hidden; cursor: grab; }
#canvas.panning { cursor: grabbing; }
svg { width: 100%; height: 100%; display: block; user-select: none; }
aside { border-left: 1px solid var(--border); background: var(--panel); overflow: auto; padding: 10px 12px; }
aside h2 { font-size: 15px; margin: 0 0 2px; word-break: break-all; }
aside h3 { font-size: 12px; text-transform: uppercase; letter-spacing: .04em; color: var(--muted);
  margin: 14px 0 4px; }
aside table { border-collapse: collapse; width: 100%; }
aside td { vertical-align: top; padding: 2px 4px 2px 0; word-break: break-word; }
aside td.k { color: var(--muted); white-space: nowrap; width: 1%; padding-right: 10px; }
aside code, aside pre { font: 12px/1.35 ui-monospace, SFMono-Regular, Menlo, Consolas, monospace; }
aside pre { white-space: pre-wrap; background: var(--bg); padding: 6px; border-radius: 4px; margin: 4px 0; }
a.link { color: var(--sel); cursor: pointer; text-decoration: none; }
a.link:hover { text-decoration: underline; }
.sub { color: var(--muted); }
.ops td.n { text-align: right; color: var(--muted); }
.legend span { display: inline-block; padding: 1px 6px; margin: 2px 2px 0 0; border-radius: 3px;
  border: 1px solid var(--border); font-size: 11px; }
g.node > rect.box { stroke: var(--border); stroke-width: 1; }
g.node { cursor: pointer; }
g.node text { fill: var(--fg); font-size: 12px; }
g.node text.op { font-weight: 600; }
g.node text.small, g.io text.small { fill: var(--muted); font-size: 10.5px; }
g.node text.toggle { font-size: 15px; font-weight: 700; fill: var(--muted); }
g.node text.toggle:hover { fill: var(--sel); }
g.cat-anchor > rect.box { fill: var(--c-anchor); }
g.cat-elementwise > rect.box { fill: var(--c-elementwise); }
g.cat-other > rect.box { fill: var(--c-other); }
g.cat-fused > rect.box { fill: var(--c-fused); }
g.cat-control > rect.box { fill: var(--c-control); }
g.cat-guard > rect.box { fill: var(--c-guard); stroke-dasharray: 4 2; }
g.cluster > rect.box { fill: var(--cluster); stroke-dasharray: 5 3; }
g.cluster text.label { fill: var(--muted); font-size: 11px; font-style: italic; }
g.io rect { fill: var(--c-io); stroke: var(--border); }
g.io.outer rect { fill: none; stroke-dasharray: 3 2; }
g.io text { fill: var(--fg); font-size: 11.5px; }
g.io { cursor: pointer; }
path.edge { fill: none; stroke: var(--edge); stroke-width: 1.2; }
path.edge.cap { stroke-dasharray: 4 3; }
path.edge.hot { stroke: var(--sel); stroke-width: 2.2; }
g.selected > rect.box, g.io.selected rect { stroke: var(--sel); stroke-width: 2.5; }
g.match > rect.box { stroke: var(--match); stroke-width: 3; }
g.match-inside > rect.box { stroke: var(--match); stroke-width: 2; stroke-dasharray: 2 2; }
.dim { opacity: 0.28; }
#empty { position: absolute; inset: 40% 0 auto 0; text-align: center; color: var(--muted); }
</style>
</head>
<body>
<div id="app">
  <header>
    <h1 id="title"></h1>
    <input id="search" type="search" placeholder="find: name, op:Conv, module path ( / )" autocomplete="off"
           aria-label="find nodes">
    <button id="prev" title="previous match (Shift+Enter)">&#8593;</button>
    <button id="next" title="next match (Enter)">&#8595;</button>
    <span id="count"></span>
    <button id="expand-all" title="open every fused group, If and Loop">Expand all</button>
    <button id="collapse-all">Collapse all</button>
    <button id="fit" title="fit the graph in the window">Fit</button>
    <button id="zoom-in" title="zoom in">+</button>
    <button id="zoom-out" title="zoom out">&#8722;</button>
    <span class="hint">drag or scroll to pan &middot; Ctrl+scroll to zoom &middot; click a node for details</span>
  </header>
  <div id="canvas"><svg id="svg" xmlns="http://www.w3.org/2000/svg">
    <defs><marker id="arrow" viewBox="0 0 10 10" refX="9" refY="5" markerWidth="8" markerHeight="8"
      markerUnits="userSpaceOnUse"
      orient="auto-start-reverse"><path d="M0,0 L10,5 L0,10 z" fill="var(--edge)"></path></marker></defs>
    <g id="viewport"></g></svg><div id="empty" hidden>this graph has no nodes</div></div>
  <aside id="panel"></aside>
</div>
<script id="kiln-data" type="application/json">{{DATA}}</script>
<script>
"use strict";
(function () {
const DATA = JSON.parse(document.getElementById("kiln-data").textContent);
const VALUES = DATA.values, MODEL = DATA.model, ROOT = DATA.graph;
const SVGNS = "http://www.w3.org/2000/svg";
const NODE_W = 210, NODE_H = 54, IO_H = 30, RANK_GAP = 34, GAP = 22, DUMMY_GAP = 8, PAD = 14, HEAD = 30,
      LABEL = 18;

// ---- indexes over the whole model (every depth)
const NODES = {}, PARENT = {}, CONSUMERS = {};
(function index(g, parent) {
  for (const n of g.nodes) {
    NODES[n.id] = n; PARENT[n.id] = parent;
    for (const v of n.in.concat(n.caps || [])) if (v !== null) (CONSUMERS[v] = CONSUMERS[v] || []).push(n.id);
    for (const s of n.subs) index(s.graph, n.id);
  }
})(ROOT, null);

const expanded = new Set();
let selected = null;          // {node: id} or {value: name}
let matches = [], matchAt = -1, query = "";
const view = {x: 20, y: 20, k: 1};
let POS = {};                 // node id -> absolute box {x, y, w, h} of the last drawing
let laid = null;

// ---- helpers
function el(tag, attrs, parent, text) {
  const e = document.createElementNS(SVGNS, tag);
  for (const k in attrs) e.setAttribute(k, attrs[k]);
  if (text !== undefined) e.textContent = text;
  if (parent) parent.appendChild(e);
  return e;
}
function h(tag, parent, text, cls) {
  const e = document.createElement(tag);
  if (text !== undefined && text !== null) e.textContent = text;
  if (cls) e.className = cls;
  if (parent) parent.appendChild(e);
  return e;
}
function bytes(n) {
  if (n < 1024) return n + " B";
  const units = ["KiB", "MiB", "GiB", "TiB"];
  let v = n, u = -1;
  do { v /= 1024; u++; } while (v >= 1024 && u < units.length - 1);
  return v.toFixed(1) + " " + units[u];
}
function cut(s, n) { return s.length <= n ? s : s.slice(0, n - 1) + "\u2026"; }
function typeOf(name) { const v = VALUES[name]; return v ? v.t : "?"; }
function ioWidth(name) { return Math.min(NODE_W, Math.max(90, 7 * (name.length + typeOf(name).length) + 24)); }

// ---- layout
function layout(g) {
  const verts = [], edges = [], prod = new Map(), outer = new Map();
  const add = v => { v.i = verts.length; verts.push(v); return v; };
  for (const name of g.inputs) prod.set(name, [add({kind: "input", name, w: ioWidth(name), h: IO_H}).i, 0]);
  function source(name) {
    if (prod.has(name)) return prod.get(name);
    const info = VALUES[name];
    if (info && info.k === "init") return null;          // weights are shown on their readers
    if (!outer.has(name)) outer.set(name, add({kind: "outer", name, w: ioWidth(name), h: IO_H}).i);
    return [outer.get(name), 0];
  }
  for (const n of g.nodes) {
    const v = add({kind: "node", n, w: NODE_W, h: NODE_H});
    if (n.subs.length && expanded.has(n.id)) {
      v.subs = n.subs.map(s => ({attr: s.attr, lay: layout(s.graph)}));
      let w = PAD, hh = 0;
      for (const s of v.subs) { s.x = w; w += s.lay.w + PAD; hh = Math.max(hh, s.lay.h); }
      v.w = Math.max(NODE_W, w); v.h = HEAD + LABEL + hh + PAD;
      if (v.w > w) { const shift = (v.w - w) / 2; for (const s of v.subs) s.x += shift; }
    }
    n.out.forEach((o, k) => prod.set(o, [v.i, k]));
    n.in.forEach((name, k) => {
      if (name === null) return;
      const s = source(name);
      if (s) edges.push({s: s[0], so: s[1], t: v.i, ti: k, value: name});
    });
    for (const name of n.caps || []) {
      const s = source(name);
      if (s) edges.push({s: s[0], so: s[1], t: v.i, ti: -1, value: name, cap: true});
    }
  }
  for (const name of g.outputs) {
    const o = add({kind: "output", name, w: ioWidth(name), h: IO_H});
    const s = source(name);
    if (s) edges.push({s: s[0], so: s[1], t: o.i, ti: 0, value: name});
  }
  // ranks: longest path from the sources; then sources with no inputs moved down next to their readers
  const preds = verts.map(() => []), succs = verts.map(() => []);
  for (const e of edges) { preds[e.t].push(e.s); succs[e.s].push(e.t); }
  const rank = new Array(verts.length).fill(0);
  for (let i = 0; i < verts.length; i++) for (const p of preds[i]) rank[i] = Math.max(rank[i], rank[p] + 1);
  for (let i = verts.length - 1; i >= 0; i--) {
    if (preds[i].length || !succs[i].length || verts[i].kind === "input") continue;
    let r = Infinity;
    for (const t of succs[i]) r = Math.min(r, rank[t]);  // a loop: an input read 100k times is no spread call
    rank[i] = r - 1;
  }
  let nranks = 0;
  for (let i = 0; i < verts.length; i++) { verts[i].rank = rank[i]; nranks = Math.max(nranks, rank[i] + 1); }
  // long edges through dummy points, one chain per (source, value) shared by its readers
  const chains = new Map();
  for (const e of edges) {
    e.path = [e.s];
    const key = e.s + "|" + e.value;
    let chain = chains.get(key);
    if (!chain) chains.set(key, chain = {});
    for (let r = rank[e.s] + 1; r < rank[e.t]; r++) {
      if (chain[r] === undefined) chain[r] = add({kind: "dummy", w: 2, h: 0, rank: r}).i;
      e.path.push(chain[r]);
    }
    e.path.push(e.t);
  }
  const up = verts.map(() => []), down = verts.map(() => []);
  const seenLink = new Set();
  for (const e of edges) for (let k = 0; k + 1 < e.path.length; k++) {
    const a = e.path[k], b = e.path[k + 1], key = a + ">" + b;
    if (seenLink.has(key)) continue;
    seenLink.add(key); down[a].push(b); up[b].push(a);
  }
  const layers = [];
  for (let r = 0; r < nranks; r++) layers.push([]);
  for (const v of verts) layers[v.rank].push(v.i);
  const pos = new Array(verts.length);
  const number = L => L.forEach((i, k) => { pos[i] = k; });
  layers.forEach(number);
  const mean = (list, fallback) => {
    if (!list.length) return fallback;
    let s = 0; for (const j of list) s += pos[j]; return s / list.length;
  };
  for (let it = 0; it < 4; it++) {
    for (let r = 1; r < nranks; r++) {
      const key = new Map(layers[r].map(i => [i, mean(up[i], pos[i])]));
      layers[r].sort((a, b) => key.get(a) - key.get(b) || pos[a] - pos[b]); number(layers[r]);
    }
    for (let r = nranks - 2; r >= 0; r--) {
      const key = new Map(layers[r].map(i => [i, mean(down[i], pos[i])]));
      layers[r].sort((a, b) => key.get(a) - key.get(b) || pos[a] - pos[b]); number(layers[r]);
    }
  }
  const x = positionX(verts, layers, up, down);
  let minX = Infinity, maxX = -Infinity;
  for (const v of verts) { minX = Math.min(minX, x[v.i] - v.w / 2); maxX = Math.max(maxX, x[v.i] + v.w / 2); }
  if (!verts.length) { minX = 0; maxX = NODE_W; }
  const top = [], heights = [];
  let y = 0;
  for (let r = 0; r < nranks; r++) {
    let hh = 0; for (const i of layers[r]) hh = Math.max(hh, verts[i].h);
    top.push(y); heights.push(hh); y += hh + RANK_GAP;
  }
  for (const v of verts) {
    v.x = x[v.i] - v.w / 2 - minX;
    v.y = top[v.rank] + (heights[v.rank] - v.h) / 2;
    v.top = top[v.rank]; v.bottom = top[v.rank] + heights[v.rank];
  }
  // each edge enters its reader at a slot of its own along the top, in the order the edges arrive from
  // left to right (not by input position, which would cross a residual coming from the right)
  const into = verts.map(() => []);
  for (const e of edges) into[e.t].push(e);
  for (const list of into) {
    list.sort((a, b) => verts[a.path[a.path.length - 2]].x - verts[b.path[b.path.length - 2]].x || a.ti - b.ti);
    list.forEach((e, k) => { e.slot = k; e.slots = list.length; });
  }
  return {verts, edges, w: maxX - minX, h: Math.max(y - RANK_GAP, IO_H)};
}

// x coordinates by Brandes and Koepf ("Fast and Simple Horizontal Coordinate Assignment", 2001), as dagre
// does: four alignments (each vertex joins the block of its median upper / lower neighbour, scanning from
// the left / right; a long edge's dummy points win a crossing), each compacted as far left (right) as the
// order and the gaps allow, and every vertex put at the mean of its two middle candidates. Why not the
// mean of the neighbours, swept a few times: on a deep network each block shifts its successor by a
// fraction of a node width (a residual add between the block and the skip beside it), which the sweeps
// cannot undo; median alignment keeps a chain straight however long.
function positionX(verts, layers, up, down) {
  const n = verts.length;
  const isDummy = i => verts[i].kind === "dummy";
  const gap = (a, b) => (isDummy(a) || isDummy(b)) ? DUMMY_GAP : GAP;
  const sep = (a, b) => verts[a].w / 2 + gap(a, b) + verts[b].w / 2;
  const order = new Array(n);
  layers.forEach(L => L.forEach((v, k) => { order[v] = k; }));
  // type 1 conflicts: an edge crossing a dummy-to-dummy segment; the segment is kept straight
  const conflicts = new Set();
  const ckey = (a, b) => a < b ? a + "," + b : b + "," + a;
  for (let r = 1; r < layers.length; r++) {
    const prevLen = layers[r - 1].length, L = layers[r];
    let k0 = 0, scan = 0;
    L.forEach((v, i) => {
      const w = isDummy(v) ? up[v].find(isDummy) : undefined;
      const k1 = w !== undefined ? order[w] : prevLen;
      if (w === undefined && i !== L.length - 1) return;
      for (let s = scan; s <= i; s++) for (const u of up[L[s]])
        if ((order[u] < k0 || k1 < order[u]) && !(isDummy(u) && isDummy(L[s]))) conflicts.add(ckey(u, L[s]));
      scan = i + 1; k0 = k1;
    });
  }
  const runs = [];
  for (const vert of ["u", "d"]) for (const horiz of ["l", "r"]) {
    let lay = vert === "u" ? layers : layers.slice().reverse();
    if (horiz === "r") lay = lay.map(L => L.slice().reverse());
    const nb = vert === "u" ? up : down;
    const pos = new Array(n), root = new Array(n), align = new Array(n);
    lay.forEach(L => L.forEach((v, k) => { pos[v] = k; root[v] = v; align[v] = v; }));
    for (const L of lay) {
      let prevIdx = -1;
      for (const v of L) {
        if (!nb[v].length) continue;
        const ws = nb[v].slice().sort((a, b) => pos[a] - pos[b]);
        const mp = (ws.length - 1) / 2;
        for (let i = Math.floor(mp); i <= Math.ceil(mp); i++) {
          const w = ws[i];
          if (align[v] === v && prevIdx < pos[w] && !conflicts.has(ckey(v, w))) {
            align[w] = v; align[v] = root[v] = root[w]; prevIdx = pos[w];
          }
        }
      }
    }
    // compaction: a graph of blocks (left neighbour -> right neighbour, weighted by the gap they need)
    const pred = new Map(), succ = new Map();
    for (const L of lay) for (let k = 1; k < L.length; k++) {
      const a = root[L[k - 1]], b = root[L[k]], s = sep(L[k - 1], L[k]);
      if (!succ.has(a)) succ.set(a, new Map());
      if (!pred.has(b)) pred.set(b, new Map());
      if (s > (succ.get(a).get(b) || 0)) { succ.get(a).set(b, s); pred.get(b).set(a, s); }
    }
    const blocks = [];
    for (let v = 0; v < n; v++) if (root[v] === v) blocks.push(v);
    const xs = new Array(n).fill(0);
    const visit = (next, set) => {  // each block after every block it depends on (iterative depth first)
      const done = new Uint8Array(n), seen = new Uint8Array(n);
      for (const b of blocks) {
        if (done[b]) continue;
        const stack = [b];
        while (stack.length) {
          const e = stack[stack.length - 1];
          if (done[e]) { stack.pop(); continue; }
          if (!seen[e]) {
            seen[e] = 1;
            const m = next.get(e);
            if (m) for (const d of m.keys()) if (!done[d]) stack.push(d);
          } else { set(e); done[e] = 1; stack.pop(); }
        }
      }
    };
    visit(pred, e => { let m = 0; const p = pred.get(e); if (p) for (const [a, s] of p) m = Math.max(m, xs[a] + s); xs[e] = m; });
    visit(succ, e => {
      let m = Infinity; const q = succ.get(e);
      if (q) for (const [b, s] of q) m = Math.min(m, xs[b] - s);
      if (m !== Infinity) xs[e] = Math.max(xs[e], m);
    });
    const out = new Array(n);
    for (let v = 0; v < n; v++) out[v] = (horiz === "r" ? -1 : 1) * xs[root[v]];
    runs.push({xs: out, left: horiz === "l"});
  }
  // align the four to the narrowest (left runs by their left edge, right runs by their right edge), balance
  const extent = xs => {
    let lo = Infinity, hi = -Infinity;
    for (let v = 0; v < n; v++) { lo = Math.min(lo, xs[v] - verts[v].w / 2); hi = Math.max(hi, xs[v] + verts[v].w / 2); }
    return [lo, hi];
  };
  const ext = runs.map(r => extent(r.xs));
  let best = 0;
  ext.forEach((e, k) => { if (e[1] - e[0] < ext[best][1] - ext[best][0]) best = k; });
  runs.forEach((r, k) => {
    const d = r.left ? ext[best][0] - ext[k][0] : ext[best][1] - ext[k][1];
    if (d) for (let v = 0; v < n; v++) r.xs[v] += d;
  });
  const x = new Array(n);
  for (let v = 0; v < n; v++) {
    const c = runs.map(r => r.xs[v]).sort((a, b) => a - b);
    x[v] = (c[1] + c[2]) / 2;
  }
  return x;
}

// ---- drawing
function portOut(v, k) {
  const n = v.kind === "node" ? v.n.out.length : 1;
  return v.x + v.w * (k + 1) / (n + 1);
}
function portIn(v, e) {
  if (v.kind !== "node") return v.x + v.w / 2;
  return v.x + v.w * (e.slot + 1) / (e.slots + 1);
}
function edgePath(lay, e) {
  const V = lay.verts, s = V[e.s], t = V[e.t];
  const pts = [[portOut(s, e.so), s.y + s.h]];
  for (let k = 1; k + 1 < e.path.length; k++) {
    const d = V[e.path[k]];
    pts.push([d.x + d.w / 2, d.top], [d.x + d.w / 2, d.bottom]);
  }
  pts.push([portIn(t, e), t.y]);
  let p = "M" + pts[0][0].toFixed(1) + "," + pts[0][1].toFixed(1);
  for (let k = 1; k < pts.length; k++) {
    const [ax, ay] = pts[k - 1], [bx, by] = pts[k];
    if (ax === bx) { p += "L" + bx.toFixed(1) + "," + by.toFixed(1); continue; }
    const m = (by - ay) / 2;
    p += "C" + ax.toFixed(1) + "," + (ay + m).toFixed(1) + " " + bx.toFixed(1) + "," + (by - m).toFixed(1) + " "
       + bx.toFixed(1) + "," + by.toFixed(1);
  }
  return p;
}
function drawGraph(lay, parent, ox, oy) {
  const V = lay.verts;
  for (const e of lay.edges) {
    const s = V[e.s], t = V[e.t];
    const p = el("path", {d: edgePath(lay, e), class: "edge" + (e.cap ? " cap" : ""), "marker-end": "url(#arrow)",
      "data-from": s.kind === "node" ? s.n.id : "", "data-to": t.kind === "node" ? t.n.id : "",
      "data-value": e.value}, parent);
    el("title", {}, p, e.value + ": " + typeOf(e.value) + (e.cap ? " (read inside the body)" : ""));
  }
  for (const v of V) {
    if (v.kind === "dummy") continue;
    const g = el("g", {transform: "translate(" + v.x.toFixed(1) + "," + v.y.toFixed(1) + ")"}, parent);
    if (v.kind !== "node") { drawValue(g, v); continue; }
    const n = v.n;
    POS[n.id] = {x: ox + v.x, y: oy + v.y, w: v.w, h: v.h};
    g.setAttribute("class", "node cat-" + n.cat + (v.subs ? " cluster" : ""));
    g.setAttribute("data-node", n.id);
    g.setAttribute("data-op", n.qop);
    g.setAttribute("data-name", n.name);
    el("rect", {class: "box", width: v.w, height: v.h, rx: 6}, g);
    el("title", {}, g, n.qop + " '" + n.name + "'" + (n.meta.scope ? " at " + n.meta.scope : ""));
    if (n.subs.length) {
      const tg = el("text", {class: "toggle", x: v.w - 16, y: 19, "data-toggle": n.id}, g, v.subs ? "\u2212" : "+");
      el("title", {}, tg, v.subs ? "collapse" : "expand: show the body (" + n.size + " nodes)");
    }
    const weights = n.subs.length ? n.wt : n.w;
    el("text", {class: "op", x: 9, y: 18}, g, cut(headline(n), v.subs ? 60 : 24));
    if (v.subs) {
      el("text", {class: "small", x: v.w - 34, y: 18, "text-anchor": "end"}, g,
         cut((n.meta.scope || "") + (weights ? "  \u25a3 " + bytes(weights) : ""), 60));
      for (const s of v.subs) {
        el("text", {class: "label", x: s.x, y: HEAD + 12}, g, s.attr + ": " + s.lay.verts.filter(q => q.kind === "node").length + " nodes");
        const sg = el("g", {transform: "translate(" + s.x + "," + (HEAD + LABEL) + ")"}, g);
        drawGraph(s.lay, sg, ox + v.x + s.x, oy + v.y + HEAD + LABEL);
      }
      continue;
    }
    el("text", {x: 9, y: 34}, g, cut(secondLine(n), 31));
    el("text", {class: "small", x: 9, y: 48}, g, cut(n.meta.scope || n.meta.source || "", weights ? 20 : 32));
    if (weights) el("text", {class: "small", x: v.w - 8, y: 48, "text-anchor": "end"}, g, "\u25a3 " + bytes(weights));
  }
}
function headline(n) {
  if (n.cat === "fused") return n.op + " \u00d7" + n.size;
  return n.op;
}
function secondLine(n) {
  if (n.guard) return n.guard.what + " == " + n.guard.expected;
  if (!n.out.length) return n.name;
  const t = typeOf(n.out[0]);
  return n.out.length > 1 ? t + " (+" + (n.out.length - 1) + ")" : t;
}
function drawValue(g, v) {
  g.setAttribute("class", "io " + v.kind);
  g.setAttribute("data-value", v.name);
  el("rect", {width: v.w, height: v.h, rx: v.kind === "outer" ? 4 : 14}, g);
  el("text", {x: 10, y: 19}, g, cut(v.name, Math.max(6, Math.floor((v.w - 20) / 7) - typeOf(v.name).length)));
  el("text", {class: "small", x: v.w - 10, y: 19, "text-anchor": "end"}, g, cut(typeOf(v.name), 24));
  el("title", {}, g, (v.kind === "outer" ? "read from the enclosing graph: " : "graph " + v.kind + ": ")
     + v.name + ": " + typeOf(v.name));
}

const svg = document.getElementById("svg"), viewport = document.getElementById("viewport");
function redraw() {
  laid = layout(ROOT);
  POS = {};
  viewport.textContent = "";
  drawGraph(laid, viewport, 0, 0);
  document.getElementById("empty").hidden = ROOT.nodes.length > 0;
  applyHighlights();
  transform();
}
function transform() {
  viewport.setAttribute("transform", "translate(" + view.x.toFixed(1) + "," + view.y.toFixed(1) + ") scale(" + view.k + ")");
}
function fit(whole) {
  // whole: the entire graph in the window; else (the first view) as wide as the window allows at most
  // 1:1, top first, so that a long graph opens readable and scrolls down
  const r = svg.getBoundingClientRect();
  const kw = (r.width - 40) / Math.max(laid.w, 1), kh = (r.height - 40) / Math.max(laid.h, 1);
  view.k = Math.max(0.02, whole ? Math.min(1, kw, kh) : Math.min(1, Math.max(kw, 0.5)));
  view.x = Math.max(20, (r.width - laid.w * view.k) / 2);
  view.y = whole ? Math.max(20, (r.height - laid.h * view.k) / 2) : 20;
  transform();
}
function zoom(f, cx, cy) {
  const r = svg.getBoundingClientRect();
  if (cx === undefined) { cx = r.width / 2; cy = r.height / 2; }
  const k = Math.min(4, Math.max(0.03, view.k * f));
  view.x = cx - (cx - view.x) * k / view.k; view.y = cy - (cy - view.y) * k / view.k; view.k = k;
  transform();
}
function center(id) {
  const p = POS[id]; if (!p) return;
  const r = svg.getBoundingClientRect();
  if (view.k < 0.6) view.k = 0.8;
  view.x = r.width / 2 - (p.x + p.w / 2) * view.k; view.y = r.height / 3 - (p.y + Math.min(p.h, 80) / 2) * view.k;
  transform();
}

// ---- highlights: selection, search matches
function applyHighlights() {
  const sel = selected && selected.node, selv = selected && selected.value;
  const inside = new Set();
  for (const id of matches) for (let p = PARENT[id]; p; p = PARENT[p]) inside.add(p);
  const set = new Set(matches);
  for (const g of viewport.querySelectorAll("g.node")) {
    const id = g.getAttribute("data-node");
    g.classList.toggle("selected", id === sel);
    g.classList.toggle("match", set.has(id));
    g.classList.toggle("match-inside", !set.has(id) && inside.has(id) && !expanded.has(id));
    g.classList.toggle("dim", query !== "" && !set.has(id) && !inside.has(id));
  }
  for (const g of viewport.querySelectorAll("g.io")) {
    g.classList.toggle("selected", g.getAttribute("data-value") === selv);
    g.classList.toggle("dim", query !== "");
  }
  for (const p of viewport.querySelectorAll("path.edge")) {
    const hot = sel ? (p.getAttribute("data-from") === sel || p.getAttribute("data-to") === sel)
                    : (selv !== undefined && selv !== null && p.getAttribute("data-value") === selv);
    p.classList.toggle("hot", !!hot);
    p.classList.toggle("dim", query !== "" && !hot);
  }
}
function reveal(id) {
  let changed = false;
  for (let p = PARENT[id]; p; p = PARENT[p]) if (!expanded.has(p)) { expanded.add(p); changed = true; }
  if (changed) redraw();
}
function selectNode(id, scroll) {
  reveal(id);
  selected = {node: id};
  applyHighlights();
  showNode(NODES[id]);
  if (scroll) center(id);
}
function selectValue(name) {
  const v = VALUES[name];
  if (v && v.k === "node" && v.p) { selectNode(v.p, true); return; }
  selected = {value: name};
  applyHighlights();
  showValue(name);
}
function toggle(id) {
  if (expanded.has(id)) {
    expanded.delete(id);
    for (const k of Array.from(expanded)) { for (let p = PARENT[k]; p; p = PARENT[p]) if (p === id) expanded.delete(k); }
  } else expanded.add(id);
  redraw();
  if (selected && selected.node === id) showNode(NODES[id]);
}

// ---- search
function nodeMatches(n, q) {
  if (q.startsWith("op:")) {
    const op = q.slice(3).trim();
    return n.op.toLowerCase() === op || n.qop.toLowerCase() === op;
  }
  return n.name.toLowerCase().includes(q) || n.qop.toLowerCase().includes(q)
    || (n.meta.scope || "").toLowerCase().includes(q) || (n.meta.source || "").toLowerCase().includes(q);
}
function search(text) {
  query = text.trim().toLowerCase();
  matches = query ? Object.keys(NODES).filter(id => nodeMatches(NODES[id], query)) : [];
  matchAt = -1;
  document.getElementById("count").textContent = query ? matches.length + (matches.length === 1 ? " match" : " matches") : "";
  applyHighlights();
}
function step(d) {
  if (!matches.length) return;
  matchAt = (matchAt + d + matches.length) % matches.length;
  document.getElementById("count").textContent = (matchAt + 1) + " of " + matches.length;
  selectNode(matches[matchAt], true);
}

// ---- the panel
const panel = document.getElementById("panel");
function table(parent, rows) {
  const t = h("table", parent);
  for (const [k, v] of rows) {
    const tr = h("tr", t);
    h("td", tr, k, "k");
    const td = h("td", tr);
    if (v instanceof Node) td.appendChild(v); else td.textContent = v;
  }
  return t;
}
function valueLink(name) {
  const span = document.createElement("span");
  const a = h("a", span, name, "link");
  a.addEventListener("click", () => selectValue(name));
  const info = VALUES[name];
  let what = " " + typeOf(name);
  if (info && info.k === "init") what += "  weight " + bytes(info.bytes);
  else if (info && info.k === "input") what += "  graph input";
  h("span", span, what, "sub");
  return span;
}
function nodeLink(id) {
  const n = NODES[id];
  const a = document.createElement("a");
  a.className = "link"; a.textContent = n.name + " (" + n.qop + ")";
  a.addEventListener("click", () => selectNode(id, true));
  return a;
}
function showNode(n) {
  panel.textContent = "";
  const back = h("button", panel, "\u2190 model");
  back.addEventListener("click", () => { selected = null; applyHighlights(); showModel(); });
  h("h2", panel, n.qop);
  h("div", panel, n.name, "sub");
  const rows = [];
  if (n.meta.scope) rows.push(["module", n.meta.scope]);
  if (n.meta.source) rows.push(["source", n.meta.source]);
  for (const k in n.meta) if (k !== "scope" && k !== "source") rows.push([k, n.meta[k]]);
  if (PARENT[n.id]) rows.push(["inside", nodeLink(PARENT[n.id])]);
  const weights = n.subs.length ? n.wt : n.w;
  if (weights) rows.push(["weights", bytes(weights) + " (" + weights.toLocaleString() + " bytes)"]);
  if (rows.length) table(panel, rows);
  if (n.guard) {
    h("h3", panel, "guard");
    table(panel, [["checks", n.guard.what + " (read: " + n.guard.read + ")"], ["must be", n.guard.expected],
                  ["at", n.guard.location || "?"]]);
    if (n.guard.code) h("pre", panel, n.guard.code);
    h("div", panel, "The run fails when an input changes this value, which the trace depended on.", "sub");
  }
  if (n.in.length) {
    h("h3", panel, "inputs");
    table(panel, n.in.map((v, k) => [String(k), v === null ? "(omitted)" : valueLink(v)]));
  }
  if (n.caps && n.caps.length) {
    h("h3", panel, "read inside the body");
    table(panel, n.caps.map(v => ["", valueLink(v)]));
  }
  if (n.out.length) {
    h("h3", panel, "outputs");
    const t = h("table", panel);
    n.out.forEach((v, k) => {
      const tr = h("tr", t); h("td", tr, String(k), "k");
      const td = h("td", tr); td.appendChild(valueLink(v));
      for (const c of CONSUMERS[v] || []) { const d = h("div", td, "\u2192 "); d.appendChild(nodeLink(c)); }
    });
  }
  if (n.attrs.length) {
    h("h3", panel, "attributes");
    const t = h("table", panel);
    for (const [k, v] of n.attrs) { const tr = h("tr", t); h("td", tr, k, "k"); h("code", h("td", tr), v); }
  }
  if (n.subs.length) {
    h("h3", panel, "body");
    for (const s of n.subs) {
      const ops = {};
      for (const m of s.graph.nodes) ops[m.qop] = (ops[m.qop] || 0) + 1;
      h("div", panel, s.attr + ": " + s.graph.nodes.length + " nodes: " +
        Object.entries(ops).map(([o, c]) => c > 1 ? o + " \u00d7" + c : o).join(", "));
    }
    const b = h("button", panel, expanded.has(n.id) ? "collapse" : "expand");
    b.addEventListener("click", () => toggle(n.id));
  }
}
function showValue(name) {
  panel.textContent = "";
  const back = h("button", panel, "\u2190 model");
  back.addEventListener("click", () => { selected = null; applyHighlights(); showModel(); });
  const info = VALUES[name] || {};
  h("h2", panel, name);
  const kinds = {input: "graph input", init: "weight (initializer)", node: "node output"};
  const rows = [["type", typeOf(name)], ["kind", kinds[info.k] || "value of an enclosing graph"]];
  if (info.bytes !== undefined) rows.push(["size", bytes(info.bytes)]);
  if (info.p) rows.push(["from", nodeLink(info.p)]);
  table(panel, rows);
  const readers = CONSUMERS[name] || [];
  if (readers.length) {
    h("h3", panel, "read by");
    for (const c of readers) h("div", panel).appendChild(nodeLink(c));
  }
}
function showModel() {
  panel.textContent = "";
  h("h2", panel, MODEL.source || MODEL.name);
  const rows = [["graph", MODEL.name], ["producer", MODEL.producer], ["versions", "IR " + MODEL.ir_version + ", opset " + MODEL.opset
                  + (MODEL.optimized ? ", optimized" : "")],
                ["nodes", MODEL.nodes + (MODEL.nodes !== MODEL.top_level ? " (" + MODEL.top_level + " at the top level)" : "")],
                ["parameters", MODEL.parameters.toLocaleString() + " (" + bytes(MODEL.parameter_bytes) + ")"]];
  if (MODEL.doc) rows.push(["doc", MODEL.doc]);
  for (const k in MODEL.props) rows.push([k, MODEL.props[k]]);
  table(panel, rows);
  h("h3", panel, "inputs");
  table(panel, ROOT.inputs.map(v => ["", valueLink(v)]));
  h("h3", panel, "outputs");
  table(panel, ROOT.outputs.map(v => ["", valueLink(v)]));
  if (MODEL.guards.length) {
    h("h3", panel, "guards (" + MODEL.guards.length + ")");
    for (const g of MODEL.guards) {
      const d = h("div", panel);
      const a = h("a", d, (g.location || "?") + ": ", "link");
      a.addEventListener("click", () => selectNode(g.id, true));
      h("span", d, g.what + " must be " + g.expected);
    }
  }
  h("h3", panel, "ops");
  const t = h("table", panel, null, "ops");
  for (const [op, c] of MODEL.ops) {
    const tr = h("tr", t);
    const a = h("a", h("td", tr), op, "link");
    a.addEventListener("click", () => { const s = document.getElementById("search"); s.value = "op:" + op; search(s.value); step(1); });
    h("td", tr, String(c), "n");
  }
  h("h3", panel, "colours");
  const lg = h("div", panel, null, "legend");
  for (const [c, label] of [["anchor", "Conv / MatMul / Gemm"], ["elementwise", "elementwise"], ["fused", "fused kernel"],
                            ["control", "If / Loop"], ["guard", "kiln.Guard"], ["other", "other"]]) {
    const s = h("span", lg, label); s.style.background = "var(--c-" + c + ")";
  }
  h("div", panel, "\u25a3 marks the bytes of the weights a node reads. Written by kiln " + MODEL.kiln + ".", "sub");
}

// ---- events
document.getElementById("title").textContent = (MODEL.source || MODEL.name) + "  \u00b7  " + MODEL.nodes + " nodes";
svg.addEventListener("click", ev => {
  if (dragged) return;
  const tg = ev.target.closest("[data-toggle]");
  if (tg) { toggle(tg.getAttribute("data-toggle")); return; }
  const g = ev.target.closest("g.node");
  if (g) { selectNode(g.getAttribute("data-node"), false); return; }
  const io = ev.target.closest("g.io");
  if (io) { selectValue(io.getAttribute("data-value")); return; }
});
svg.addEventListener("dblclick", ev => {
  const g = ev.target.closest("g.node");
  if (g && NODES[g.getAttribute("data-node")].subs.length && !ev.target.closest("[data-toggle]")) toggle(g.getAttribute("data-node"));
});
let drag = null, dragged = false;
svg.addEventListener("mousedown", ev => { drag = {x: ev.clientX, y: ev.clientY, vx: view.x, vy: view.y}; dragged = false; });
window.addEventListener("mousemove", ev => {
  if (!drag) return;
  const dx = ev.clientX - drag.x, dy = ev.clientY - drag.y;
  if (Math.abs(dx) + Math.abs(dy) > 3) { dragged = true; document.getElementById("canvas").classList.add("panning"); }
  view.x = drag.vx + dx; view.y = drag.vy + dy; transform();
});
window.addEventListener("mouseup", () => { drag = null; document.getElementById("canvas").classList.remove("panning");
  setTimeout(() => { dragged = false; }, 0); });
svg.addEventListener("wheel", ev => {
  ev.preventDefault();
  if (ev.ctrlKey || ev.metaKey) {
    const r = svg.getBoundingClientRect();
    zoom(Math.exp(-ev.deltaY * 0.002), ev.clientX - r.left, ev.clientY - r.top);
  } else { view.x -= ev.deltaX; view.y -= ev.deltaY; transform(); }
}, {passive: false});
const box = document.getElementById("search");
box.addEventListener("input", () => search(box.value));
box.addEventListener("keydown", ev => {
  if (ev.key === "Enter") { step(ev.shiftKey ? -1 : 1); ev.preventDefault(); }
  if (ev.key === "Escape") { box.value = ""; search(""); }
});
document.addEventListener("keydown", ev => {
  if (ev.key === "/" && document.activeElement !== box) { box.focus(); ev.preventDefault(); }
});
document.getElementById("next").addEventListener("click", () => step(1));
document.getElementById("prev").addEventListener("click", () => step(-1));
document.getElementById("expand-all").addEventListener("click", () => {
  for (const id in NODES) if (NODES[id].subs.length) expanded.add(id);
  redraw();
});
document.getElementById("collapse-all").addEventListener("click", () => { expanded.clear(); redraw(); });
document.getElementById("fit").addEventListener("click", () => fit(true));
document.getElementById("zoom-in").addEventListener("click", () => zoom(1.25));
document.getElementById("zoom-out").addEventListener("click", () => zoom(0.8));

redraw();
fit(false);
showModel();
document.body.setAttribute("data-ready", "1");
})();
</script>
</body>
</html>
"""
