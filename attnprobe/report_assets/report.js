// attnprobe report: draws the page from the inline JSON. Vanilla JS, no network, no framework.
"use strict";
(function () {
  const D = JSON.parse(document.getElementById("attnprobe-data").textContent);
  const NS = "http://www.w3.org/2000/svg"; // the SVG namespace name, not a resource
  const L = D.layers, H = D.heads;
  const $ = (id) => document.getElementById(id);
  const state = { score: D.scores.length ? D.scores[0].key : null, sel: null, focus: [0, 0], threshold: 0.05,
    positionScore: null };
  const scoreInfo = Object.fromEntries(D.scores.map((s) => [s.key, s]));
  const VIRIDIS = ["#440154", "#482878", "#3e4989", "#31688e", "#26828e", "#1f9e89", "#35b779", "#6ece58",
    "#b5de2b", "#fde725"];
  const PALETTE = ["#0072b2", "#d55e00", "#009e73", "#cc79a7", "#e69f00", "#56b4e9", "#000000", "#999933"];
  const DASHES = ["", "6 3", "2 3", "8 3 2 3", "1 2", "10 4", "4 4", "12 2 2 2 2 2"];
  const MARKERS = ["circle", "square", "triangle", "diamond", "cross", "circle", "square", "triangle"];

  // ---------- helpers ----------
  function el(tag, attrs, text) {
    const node = document.createElement(tag);
    for (const [k, v] of Object.entries(attrs || {})) node.setAttribute(k, v);
    if (text !== undefined) node.textContent = text;
    return node;
  }
  function svg(tag, attrs, text) {
    const node = document.createElementNS(NS, tag);
    for (const [k, v] of Object.entries(attrs || {})) node.setAttribute(k, v);
    if (text !== undefined) node.textContent = text;
    return node;
  }
  function titled(node, text) { node.appendChild(svg("title", {}, text)); return node; }
  const idx = (l, h) => l * H + h;
  const headName = (l, h) => "L" + l + "H" + h;
  const finite = (v) => typeof v === "number" && isFinite(v);
  function fmt(v) {
    if (!finite(v)) return "n/a";
    const a = Math.abs(v);
    return a >= 100 ? v.toFixed(1) : a >= 10 ? v.toFixed(2) : v.toFixed(3);
  }
  function interval(lo, hi) { return finite(lo) && finite(hi) ? " [" + fmt(lo) + ", " + fmt(hi) + "]" : ""; }
  function hexRgb(hex) { return [1, 3, 5].map((i) => parseInt(hex.slice(i, i + 2), 16)); }
  function viridis(t) {
    t = Math.min(1, Math.max(0, t)) * (VIRIDIS.length - 1);
    const i = Math.min(VIRIDIS.length - 2, Math.floor(t)), f = t - i;
    const a = hexRgb(VIRIDIS[i]), b = hexRgb(VIRIDIS[i + 1]);
    return a.map((x, j) => Math.round(x + (b[j] - x) * f));
  }
  const rgb = (c) => "rgb(" + c.join(",") + ")";
  const inkOn = (c) => (0.299 * c[0] + 0.587 * c[1] + 0.114 * c[2] > 150 ? "#000" : "#fff");
  function weightColour(w) { // white -> dark blue, linear in the weight
    const end = [8, 48, 107];
    return rgb(end.map((x) => Math.round(255 + (x - 255) * w)));
  }
  function tokenText(t, limit) {
    let s = String(t).replace(/\n/g, "⏎").replace(/\t/g, "⇥");
    if (s.trim() === "") s = s.length ? "␣" : "∅"; else s = s.trim();
    return limit && s.length > limit ? s.slice(0, limit - 1) + "…" : s;
  }
  const SENTENCE_CHARS = 240; // a longer example (one long document) is cut, with an ellipsis
  function shortSentence(text) {
    const s = String(text);
    return s.length > SENTENCE_CHARS ? s.slice(0, SENTENCE_CHARS - 1).trimEnd() + "…" : s;
  }
  function typeOf(l, h) { return D.types[idx(l, h)]; }
  function typeLabel(t) { return t ? t + " (" + (D.typeMeaning[t] || "") + ")" : "no type"; }
  const tooltip = $("tooltip");
  function showTip(text, x, y) {
    tooltip.textContent = text;
    tooltip.hidden = false;
    const r = tooltip.getBoundingClientRect();
    const left = Math.min(window.innerWidth - r.width - 8, x + 14), top = y + 16 + r.height > window.innerHeight
      ? y - r.height - 10 : y + 16;
    tooltip.style.left = Math.max(4, left) + "px";
    tooltip.style.top = Math.max(4, top) + "px";
  }
  function hideTip() { tooltip.hidden = true; state.tipCell = null; }
  const plural = (n, word) => n + " " + word + (n === 1 ? "" : "s");
  // Colours run dark = low, light = high for every score (viridis); for entropy that is dark = sharp.
  function darkMeans(key) {
    return /^entropy/.test(key) ? "dark = sharp, light = diffuse" : "dark = low, light = high";
  }

  // ---------- the grid ----------
  const cells = [];
  function cellText(l, h) {
    const info = scoreInfo[state.score], i = idx(l, h);
    const v = D.values[state.score][i];
    const lo = (D.low[state.score] || [])[i], hi = (D.high[state.score] || [])[i];
    return headName(l, h) + ": " + typeLabel(typeOf(l, h)) + "\n" + info.label + " " + fmt(v) + interval(lo, hi);
  }
  function buildGrid() {
    const table = el("table", { class: "grid", role: "grid", "aria-label": "layers x heads; arrow keys move" });
    const head = el("tr");
    head.appendChild(el("th", { scope: "col" }, ""));
    for (let h = 0; h < H; h++) head.appendChild(el("th", { scope: "col" }, "H" + h));
    table.appendChild(el("thead")).appendChild(head);
    const body = table.appendChild(el("tbody"));
    for (let l = 0; l < L; l++) {
      const row = body.appendChild(el("tr"));
      row.appendChild(el("th", { scope: "row" }, "L" + l));
      cells.push([]);
      for (let h = 0; h < H; h++) {
        const t = typeOf(l, h);
        const td = el("td", { role: "gridcell", tabindex: "-1", "data-l": l, "data-h": h, "data-name": headName(l, h) },
          t ? D.typeLetters[t] || t[0].toUpperCase() : "");
        row.appendChild(td);
        cells[l].push(td);
      }
    }
    const cellOf = (e) => e.target.closest && e.target.closest("td[data-l]");
    table.addEventListener("mouseover", (e) => {
      const td = cellOf(e);
      if (td) {
        showTip(cellText(+td.dataset.l, +td.dataset.h), e.clientX, e.clientY);
        state.tipCell = [+td.dataset.l, +td.dataset.h];
      }
    });
    table.addEventListener("mousemove", (e) => {
      const td = cellOf(e);
      if (td && !tooltip.hidden) showTip(tooltip.textContent, e.clientX, e.clientY);
    });
    table.addEventListener("mouseout", hideTip);
    table.addEventListener("focusin", (e) => {
      const td = cellOf(e);
      if (!td) return;
      const l = +td.dataset.l, h = +td.dataset.h;
      state.focus = [l, h];
      const text = cellText(l, h);
      $("grid-status").textContent = text.replace("\n", " · ");
      const r = td.getBoundingClientRect();
      showTip(text, r.right, r.top);
      state.tipCell = [l, h];
    });
    table.addEventListener("focusout", hideTip);
    table.addEventListener("click", (e) => {
      const td = cellOf(e);
      if (td) { focusCell(+td.dataset.l, +td.dataset.h); selectHead(+td.dataset.l, +td.dataset.h); }
    });
    table.addEventListener("keydown", (e) => {
      let [l, h] = state.focus;
      switch (e.key) {
        case "ArrowUp": l -= 1; break;
        case "ArrowDown": l += 1; break;
        case "ArrowLeft": h -= 1; break;
        case "ArrowRight": h += 1; break;
        case "Home": h = 0; break;
        case "End": h = H - 1; break;
        case "PageUp": l = 0; break;
        case "PageDown": l = L - 1; break;
        case "Enter": case " ": selectHead(l, h); e.preventDefault(); return;
        default: return;
      }
      e.preventDefault();
      focusCell(Math.min(L - 1, Math.max(0, l)), Math.min(H - 1, Math.max(0, h)));
    });
    $("grid-wrap").appendChild(table);
    cells[0][0].tabIndex = 0;
  }
  function focusCell(l, h) {
    const [pl, ph] = state.focus;
    cells[pl][ph].tabIndex = -1;
    cells[l][h].tabIndex = 0;
    state.focus = [l, h];
    cells[l][h].focus();
  }
  function scoreRange(key) {
    const vs = D.values[key].filter(finite);
    let lo = Math.min(...vs), hi = Math.max(...vs);
    if (!vs.length) { lo = 0; hi = 1; }
    return [lo, hi];
  }
  function paintGrid() {
    const key = state.score, info = scoreInfo[key];
    const [lo, hi] = scoreRange(key);
    for (let l = 0; l < L; l++) {
      for (let h = 0; h < H; h++) {
        const td = cells[l][h], v = D.values[key][idx(l, h)];
        td.setAttribute("aria-label", cellText(l, h).replace("\n", ", "));
        td.dataset.value = finite(v) ? String(v) : "";
        if (!finite(v)) {
          td.classList.add("nan"); td.style.background = ""; td.style.color = "";
          continue;
        }
        td.classList.remove("nan");
        const c = viridis(hi > lo ? (v - lo) / (hi - lo) : 0.5);
        td.style.background = rgb(c);
        td.style.color = inkOn(c);
      }
    }
    $("score-meaning").textContent = info.meaning + " (from " + info.source + ")";
    const legend = $("grid-legend");
    legend.textContent = "";
    legend.appendChild(el("span", {}, info.label + ": " + fmt(lo)));
    const bar = legend.appendChild(el("span", { class: "bar", "aria-hidden": "true" }));
    bar.style.background = "linear-gradient(to right," + VIRIDIS.join(",") + ")";
    legend.appendChild(el("span", {}, fmt(hi)));
    legend.appendChild(el("span", { class: "muted", id: "grid-dark" }, "(" + darkMeans(key) + ")"));
    if (state.tipCell && !tooltip.hidden) tooltip.textContent = cellText(state.tipCell[0], state.tipCell[1]);
    if (state.sel) $("grid-status").textContent = cellText(state.sel[0], state.sel[1]).replace("\n", " · ");
    drawGradient();
  }
  function buildTypeLegend() {
    const legend = $("type-legend");
    const counts = {};
    D.types.forEach((t) => { if (t) counts[t] = (counts[t] || 0) + 1; });
    if (!Object.keys(counts).length) return;
    legend.appendChild(el("span", { class: "muted" }, "Types (" + D.scheme + " scheme):"));
    for (const t of typeOrder()) {
      if (!counts[t]) continue;
      const item = legend.appendChild(el("span", { title: D.typeMeaning[t] || "" }));
      item.appendChild(el("span", { class: "chip" }, D.typeLetters[t] || t[0].toUpperCase()));
      item.appendChild(document.createTextNode(" " + t + " " + counts[t]));
    }
  }
  function typeOrder() {
    const orders = { default: ["local", "copy", "broad", "mixed"], extended: ["previous", "local", "sink", "dormant",
      "copy", "broad", "mixed"], kv: ["streaming", "full-cache"] };
    const order = (orders[D.scheme] || []).slice();
    D.types.forEach((t) => { if (t && !order.includes(t)) order.push(t); });
    return order;
  }

  // ---------- one head's attention ----------
  const decoded = new Map();
  function bytesOf(i) {
    if (!decoded.has(i)) {
      const raw = atob(D.examples[i].maps), bytes = new Uint8Array(raw.length);
      for (let j = 0; j < raw.length; j++) bytes[j] = raw.charCodeAt(j);
      decoded.set(i, bytes);
    }
    return decoded.get(i);
  }
  function weights(i, l, h) { // [query][key] of one head on example i, from the stored bytes
    const ex = D.examples[i], n = ex.tokens.length, bytes = bytesOf(i);
    const per = ex.tri ? (n * (n + 1)) / 2 : n * n, base = idx(l, h) * per;
    const rows = [];
    for (let q = 0; q < n; q++) {
      const row = new Float32Array(n);
      for (let k = 0; k < n; k++) {
        if (ex.tri && k > q) continue;
        row[k] = bytes[base + (ex.tri ? (q * (q + 1)) / 2 + k : q * n + k)] / D.levels;
      }
      rows.push(row);
    }
    return rows;
  }
  function selectHead(l, h) {
    if (state.sel) cells[state.sel[0]][state.sel[1]].setAttribute("aria-selected", "false");
    state.sel = [l, h];
    cells[l][h].setAttribute("aria-selected", "true");
    $("grid-status").textContent = cellText(l, h).replace("\n", " · ");
    try { history.replaceState(null, "", "#" + headName(l, h)); } catch (err) { /* not allowed here: no matter */ }
    renderPattern();
    drawGradient();
    drawPositions();
    drawScatter();
    renderHeadPage();
  }
  function renderPattern() {
    const [l, h] = state.sel, name = headName(l, h), t = typeOf(l, h);
    const panel = $("pattern");
    panel.dataset.name = name;
    $("pattern-title").textContent = "Head " + name + (t ? " · " + t : "") + ": layer " + l + ", head " + h;
    const scores = $("head-scores");
    scores.textContent = "";
    const list = scores.appendChild(el("dl", { class: "head-scores" }));
    for (const s of D.scores) {
      const i = idx(l, h), item = list.appendChild(el("div", { "data-score": s.key }));
      item.appendChild(el("dt", { title: s.meaning }, s.label));
      const value = item.appendChild(el("dd", {}, fmt(D.values[s.key][i])));
      value.appendChild(el("span", { class: "muted" }, interval((D.low[s.key] || [])[i], (D.high[s.key] || [])[i])));
    }
    renderRelated(l, h);
    const box = $("examples");
    box.textContent = "";
    if (!D.examples.length) {
      box.appendChild(el("p", { class: "muted" }, "No example maps in this results folder."));
      return;
    }
    D.examples.forEach((ex, i) => {
      const card = box.appendChild(el("div", { class: "example", "data-example": i }));
      const n = ex.tokens.length;
      const cut = ex.total > n ? " (its first " + n + " of " + ex.total + " tokens)" : " (" + n + " tokens)";
      const p = card.appendChild(el("p", { class: "sentence" }));
      p.appendChild(el("strong", {}, "Example " + (i + 1) + (ex.category ? " · " + ex.category : "") + ": "));
      p.appendChild(document.createTextNode("“" + shortSentence(ex.sentence) + "”" + cut));
      if (ex.query === undefined) ex.query = n - 1;
      const rows = weights(i, l, h);
      const views = card.appendChild(el("div", { class: "example-views" }));
      views.appendChild(heatmap(ex, rows, i));
      const wrap = views.appendChild(el("div", { class: "arcs-wrap" }));
      wrap.appendChild(arcs(ex, rows, i));
      ex.drawArcs(rows);
      card.appendChild(el("p", { class: "attends" }));
      describe(card, ex, rows);
    });
  }
  function renderRelated(l, h) { // the nearest heads by JS divergence (attnprobe related), each a button to it
    const box = $("related-heads");
    box.textContent = "";
    box.hidden = !D.related;
    if (!D.related) return;
    const i = idx(l, h);
    box.appendChild(el("h4", {}, "Nearest heads: JS divergence of their attention (nats)"));
    const list = box.appendChild(el("ol", { class: "related" }));
    D.related.nearest[i].forEach((j, k) => {
      const lj = Math.floor(j / H), hj = j % H, t = typeOf(lj, hj);
      const item = list.appendChild(el("li", { "data-name": headName(lj, hj), "data-js": String(D.related.js[i][k]) }));
      const button = item.appendChild(el("button", { type: "button", title: "show " + headName(lj, hj) },
        headName(lj, hj)));
      button.addEventListener("click", () => { focusCell(lj, hj); selectHead(lj, hj); });
      item.appendChild(document.createTextNode((t ? " " + t : "") + " " + D.related.js[i][k].toFixed(4)));
    });
    box.appendChild(el("p", { class: "muted" }, "0 = the same attention, ln 2 = 0.693 = on disjoint keys; mean over " +
      plural(D.related.rows, "query row") + " of " + plural(D.related.sentences, "sentence") +
      " (attnprobe related)"));
  }
  const LABEL_PX = 13; // px an 11px label needs: smaller cells label every `step`th token
  function heatmap(ex, rows, i) {
    const n = ex.tokens.length, cell = Math.max(8, Math.min(18, Math.floor(420 / n)));
    const longest = Math.max(...ex.tokens.map((t) => tokenText(t, 14).length));
    const label = Math.min(14, longest) * 6.4 + 10;
    const width = Math.max(label + n * cell + 4, 170), height = label + n * cell + 20;
    const root = svg("svg", { class: "heatmap", width, height, role: "img", "data-example": i,
      "aria-label": "attention heatmap, example " + (i + 1) + ": rows are queries, columns keys" });
    root.appendChild(svg("rect", { x: label, y: label, width: n * cell, height: n * cell, fill: "#ececec" }));
    for (let q = 0; q < n; q++) {
      for (let k = 0; k < n; k++) {
        if (ex.tri && k > q) continue;
        const w = rows[q][k];
        root.appendChild(svg("rect", { class: "cell", x: label + k * cell, y: label + q * cell, width: cell,
          height: cell, fill: weightColour(w), "data-q": q, "data-k": k, "data-v": w.toFixed(3) }));
      }
    }
    const step = Math.max(1, Math.ceil(LABEL_PX / cell));
    ex.tokens.forEach((t, j) => {
      const text = tokenText(t, 14), y = label + j * cell + cell / 2 + 4, x = label + j * cell + cell / 2 + 4;
      const thin = j % step ? " thinned" : "";
      root.appendChild(titled(svg("text", { class: "token-label query" + thin, "data-q": j, x: label - 4, y,
        "text-anchor": "end" }, text), "query " + j + ": click to show its attention"));
      root.appendChild(svg("text", { class: "token-label key" + thin, "data-k": j, x, y: label - 4,
        "text-anchor": "start", transform: "rotate(-90 " + x + " " + (label - 4) + ")" }, text));
    });
    root.appendChild(svg("text", { x: 2, y: height - 4 }, "rows: queries · columns: keys" +
      (step > 1 ? " · a label every " + step + " tokens" : "")));
    const mark = root.appendChild(svg("rect", { class: "row-mark", x: label, width: n * cell, height: cell,
      fill: "none", stroke: "#d1261f", "stroke-width": 2 }));
    ex.markRow = () => {
      mark.setAttribute("y", label + ex.query * cell);
      root.querySelectorAll(".token-label.query").forEach((node) => {
        const j = +node.dataset.q, q = ex.query;
        node.classList.toggle("active", j === q);
        node.classList.toggle("crowded", j !== q && q % step > 0 && Math.abs(j - q) < step); // room for the chosen
      });
    };
    ex.markRow();
    root.addEventListener("mousemove", (e) => {
      const r = e.target;
      if (!r.classList || !r.classList.contains("cell")) { hideTip(); return; }
      const q = +r.dataset.q, k = +r.dataset.k;
      showTip("query " + q + " “" + tokenText(ex.tokens[q]) + "” → key " + k + " “" + tokenText(ex.tokens[k]) + "”: " +
        r.dataset.v, e.clientX, e.clientY);
    });
    root.addEventListener("mouseleave", hideTip);
    root.addEventListener("click", (e) => {
      const r = e.target;
      if (r.classList && (r.classList.contains("cell") || r.classList.contains("query"))) {
        setQuery(ex, rows, +r.dataset.q, i);
      }
    });
    return root;
  }
  function arcs(ex, rows, i) {
    const n = ex.tokens.length, texts = ex.tokens.map((t) => tokenText(t, 16));
    const widths = texts.map((t) => Math.max(22, t.length * 6.6 + 10)), xs = [];
    let x = 6;
    widths.forEach((w) => { xs.push(x + w / 2); x += w + 4; });
    const width = x + 6, arcHeight = Math.min(110, 24 + width * 0.15), base = arcHeight + 6, height = base + 26;
    const root = svg("svg", { class: "arcs", width, height, "data-example": i,
      "aria-label": "arcs from the chosen token to the tokens it attends to" });
    const layer = root.appendChild(svg("g", { class: "arc-layer" }));
    texts.forEach((t, j) => {
      const g = root.appendChild(svg("g", { class: "tok", tabindex: 0, role: "button", "data-t": j,
        "aria-label": "token " + j + " " + t + ": show its attention" }));
      g.appendChild(svg("rect", { x: xs[j] - widths[j] / 2, y: base, width: widths[j], height: 18, rx: 3 }));
      g.appendChild(svg("text", { x: xs[j], y: base + 13, "text-anchor": "middle" }, t));
      g.addEventListener("click", () => setQuery(ex, rows, j, i));
      g.addEventListener("keydown", (e) => {
        let to = null;
        if (e.key === "Enter" || e.key === " ") to = j;
        else if (e.key === "ArrowLeft") to = Math.max(0, j - 1);
        else if (e.key === "ArrowRight") to = Math.min(n - 1, j + 1);
        if (to === null) return;
        e.preventDefault();
        setQuery(ex, rows, to, i);
        root.querySelector('.tok[data-t="' + to + '"]').focus();
      });
    });
    ex.drawArcs = (rowsNow) => {
      layer.textContent = "";
      const q = ex.query, row = rowsNow[q];
      root.querySelectorAll(".tok").forEach((g) => {
        const on = +g.dataset.t === q;
        g.classList.toggle("active", on);
        g.setAttribute("aria-pressed", on ? "true" : "false");
      });
      for (let k = 0; k < n; k++) {
        const w = row[k];
        if (!(w > 0) || w < state.threshold) continue;
        const style = { class: "arc", "stroke-width": (1 + 9 * w).toFixed(2), "stroke-opacity": (0.3 + 0.7 * w).toFixed(2),
          "data-k": k, "data-v": w.toFixed(3) };
        let shape;
        if (k === q) {
          shape = svg("circle", { ...style, cx: xs[q], cy: base - 9, r: 8 });
        } else {
          const lift = Math.min(arcHeight - 4, 12 + Math.abs(xs[q] - xs[k]) * 0.25);
          shape = svg("path", { ...style, d: "M" + xs[q] + "," + base + " Q" + (xs[q] + xs[k]) / 2 + "," +
            (base - 2 * lift) + " " + xs[k] + "," + base });
        }
        layer.appendChild(titled(shape, "“" + texts[q] + "” → “" + texts[k] + "”: " + w.toFixed(3)));
      }
      const wrap = root.parentNode; // keep the chosen token in view when the row is wider than the panel
      const left = xs[q] - widths[q] / 2, right = xs[q] + widths[q] / 2;
      if (wrap && wrap.clientWidth && (left < wrap.scrollLeft || right > wrap.scrollLeft + wrap.clientWidth)) {
        wrap.scrollLeft = Math.max(0, xs[q] - wrap.clientWidth / 2);
      }
    };
    return root;
  }
  function describe(card, ex, rows) {
    const q = ex.query, row = rows[q];
    const shown = [];
    for (let k = 0; k < row.length; k++) if (row[k] > 0 && row[k] >= state.threshold) shown.push(k);
    shown.sort((a, b) => row[b] - row[a]);
    const sum = shown.reduce((s, k) => s + row[k], 0);
    const list = shown.slice(0, 8).map((k) => "“" + tokenText(ex.tokens[k]) + "” (" + k + ") " + row[k].toFixed(3));
    const more = shown.length > 8 ? ", … " + (shown.length - 8) + " more" : "";
    card.querySelector(".attends").textContent = "Token " + q + " “" + tokenText(ex.tokens[q]) + "” attends to " +
      (shown.length ? list.join(", ") + more + " (" + plural(shown.length, "key") + " at or above " +
        state.threshold.toFixed(2) + ", together " + sum.toFixed(3) + ")." : "no key at or above " +
        state.threshold.toFixed(2) + ".");
  }
  function setQuery(ex, rows, q, i) {
    ex.query = q;
    ex.markRow();
    ex.drawArcs(rows);
    describe(document.querySelector('.example[data-example="' + i + '"]'), ex, rows);
  }
  function redrawArcs() {
    if (!state.sel) return;
    D.examples.forEach((ex, i) => {
      const rows = weights(i, state.sel[0], state.sel[1]);
      ex.drawArcs(rows);
      describe(document.querySelector('.example[data-example="' + i + '"]'), ex, rows);
    });
  }

  // ---------- charts ----------
  function niceTicks(lo, hi, count) {
    if (!(hi > lo)) { hi = lo + 1; lo -= 1; }
    const step0 = (hi - lo) / count, mag = Math.pow(10, Math.floor(Math.log10(step0)));
    const step = [1, 2, 2.5, 5, 10].map((m) => m * mag).find((s) => s >= step0);
    const ticks = [];
    for (let v = Math.ceil(lo / step) * step; v <= hi + step * 1e-9; v += step) ticks.push(+v.toFixed(10));
    return ticks;
  }
  // as many decimals as the ticks need
  function tickLabels(ticks) {
    let digits = 0;
    while (digits < 6 && !ticks.every((t) => Math.abs(+t.toFixed(digits) - t) <= 1e-9 * Math.max(1, Math.abs(t)))) {
      digits++;
    }
    return ticks.map((t) => { const s = t.toFixed(digits); return +s === 0 ? (0).toFixed(digits) : s; });
  }
  function marker(kind, x, y, size, attrs) {
    const s = size;
    if (kind === "square") return svg("rect", { x: x - s, y: y - s, width: 2 * s, height: 2 * s, ...attrs });
    if (kind === "triangle") return svg("path", { d: "M" + x + "," + (y - s * 1.2) + " L" + (x + s) + "," + (y + s) +
      " L" + (x - s) + "," + (y + s) + "Z", ...attrs });
    if (kind === "diamond") return svg("path", { d: "M" + x + "," + (y - s * 1.4) + " L" + (x + s * 1.4) + "," + y +
      " L" + x + "," + (y + s * 1.4) + " L" + (x - s * 1.4) + "," + y + "Z", ...attrs });
    if (kind === "cross") return svg("path", { d: "M" + (x - s) + "," + (y - s) + " L" + (x + s) + "," + (y + s) +
      " M" + (x - s) + "," + (y + s) + " L" + (x + s) + "," + (y - s), fill: "none", ...attrs,
      stroke: attrs.fill || "#000", "stroke-width": 2 });
    return svg("circle", { cx: x, cy: y, r: s, ...attrs });
  }
  // series: {name, ys, lo, hi, colour, width, dash, marker, titles}; dots: {x, y, title, colour, marker, size}
  function lineChart(box, opts) {
    box.textContent = "";
    const width = opts.width || 420, height = opts.height || 250;
    const xs = opts.x, nx = xs.length;
    const CHAR = 6.6; // px per character of an 11px tick label, a little generous
    const textWidth = (t) => String(t).length * CHAR;
    // room on the right for half the last tick label, so "32-39" is not clipped at the edge
    const m = { left: 52, right: Math.max(12, textWidth(xs[nx - 1] === undefined ? "" : xs[nx - 1]) / 2 + 4),
      top: 10, bottom: 38 };
    const all = [];
    opts.series.forEach((s) => [s.ys, s.lo || [], s.hi || []].forEach((a) => a.forEach((v) => {
      if (finite(v)) all.push(v);
    })));
    (opts.dots || []).forEach((d) => { if (finite(d.y)) all.push(d.y); });
    if (!all.length) { box.appendChild(el("p", { class: "muted" }, "No values to draw.")); return; }
    let lo = Math.min(...all), hi = Math.max(...all);
    const pad = (hi - lo) * 0.05 || Math.abs(hi) * 0.05 || 0.05;
    lo -= pad; hi += pad;
    const ticks = niceTicks(lo, hi, 5);
    lo = Math.min(lo, ticks[0]); hi = Math.max(hi, ticks[ticks.length - 1]);
    const X = (i) => m.left + (nx > 1 ? (i / (nx - 1)) * (width - m.left - m.right) : (width - m.left - m.right) / 2);
    const Y = (v) => m.top + (1 - (v - lo) / (hi - lo)) * (height - m.top - m.bottom);
    const root = svg("svg", { width, height, role: "img", "aria-label": opts.label || "chart" });
    const axis = root.appendChild(svg("g", { class: "axis" }));
    const tickText = tickLabels(ticks);
    ticks.forEach((t, i) => {
      axis.appendChild(svg("line", { class: "gridline", x1: m.left, x2: width - m.right, y1: Y(t), y2: Y(t) }));
      axis.appendChild(svg("text", { class: "ytick", x: m.left - 5, y: Y(t) + 4, "text-anchor": "end" }, tickText[i]));
    });
    // every `every`-th tick label, as many as fit side by side; the last one always, and the one before it
    // dropped when the two would touch ("28" and "29")
    const widest = Math.max(...xs.map(textWidth)) + 8, span = nx > 1 ? (width - m.left - m.right) / (nx - 1) : 1;
    const every = Math.max(1, Math.ceil(widest / span));
    const shownTicks = xs.map((_, i) => i).filter((i) => i % every === 0);
    if (shownTicks[shownTicks.length - 1] !== nx - 1) {
      const before = shownTicks[shownTicks.length - 1];
      if ((X(nx - 1) - X(before)) < (textWidth(xs[nx - 1]) + textWidth(xs[before])) / 2 + 8) shownTicks.pop();
      shownTicks.push(nx - 1);
    }
    xs.forEach((label, i) => {
      if (!shownTicks.includes(i)) return;
      axis.appendChild(svg("line", { x1: X(i), x2: X(i), y1: height - m.bottom, y2: height - m.bottom + 4 }));
      axis.appendChild(svg("text", { class: "xtick", x: X(i), y: height - m.bottom + 15, "text-anchor": "middle" },
        String(label)));
    });
    axis.appendChild(svg("line", { x1: m.left, x2: width - m.right, y1: height - m.bottom, y2: height - m.bottom }));
    axis.appendChild(svg("line", { x1: m.left, x2: m.left, y1: m.top, y2: height - m.bottom }));
    axis.appendChild(svg("text", { x: (m.left + width - m.right) / 2, y: height - 4, "text-anchor": "middle" },
      opts.xTitle || ""));
    axis.appendChild(svg("text", { x: 12, y: (m.top + height - m.bottom) / 2, "text-anchor": "middle",
      transform: "rotate(-90 12 " + (m.top + height - m.bottom) / 2 + ")" }, opts.yTitle || ""));
    opts.series.forEach((s) => {
      if (s.lo && s.hi) { // the interval as a band, split where values are missing
        let top = [], bottom = [];
        const flush = () => {
          if (top.length) {
            root.appendChild(svg("path", { d: "M" + top.concat(bottom.reverse()).join(" L") + "Z", fill: s.colour,
              "fill-opacity": 0.15, stroke: "none" }));
          }
          top = []; bottom = [];
        };
        xs.forEach((_, i) => {
          if (finite(s.lo[i]) && finite(s.hi[i])) { top.push(X(i) + "," + Y(s.hi[i])); bottom.push(X(i) + "," + Y(s.lo[i])); }
          else flush();
        });
        flush();
      }
      let d = "", pen = false;
      s.ys.forEach((v, i) => {
        if (!finite(v)) { pen = false; return; }
        d += (pen ? " L" : " M") + X(i) + "," + Y(v);
        pen = true;
      });
      if (d) root.appendChild(svg("path", { d, fill: "none", stroke: s.colour, "stroke-width": s.width || 1.5,
        "stroke-dasharray": s.dash || "" }));
      if (s.marker) {
        s.ys.forEach((v, i) => {
          if (!finite(v)) return;
          const lohi = s.lo ? interval(s.lo[i], s.hi[i]) : s.ciLo ? interval(s.ciLo[i], s.ciHi[i]) : "";
          root.appendChild(titled(marker(s.marker, X(i), Y(v), s.size || 3, { fill: s.colour }),
            s.name + ", " + (opts.xName || "x") + " " + xs[i] + ": " + fmt(v) + lohi));
        });
      }
    });
    (opts.dots || []).forEach((d) => {
      if (!finite(d.y)) return;
      root.appendChild(titled(marker(d.marker || "circle", X(d.x), Y(d.y), d.size || 2,
        { fill: d.colour || "#999", "fill-opacity": d.opacity || 0.6, stroke: d.stroke || "none" }), d.title));
    });
    box.appendChild(root);
    if (opts.legend !== false) {
      const legend = box.appendChild(el("div", { class: "legend" }));
      opts.series.filter((s) => s.name && !s.hideLegend).concat(opts.extraLegend || []).forEach((s) => {
        const item = legend.appendChild(el("span"));
        const sw = item.appendChild(svg("svg", { width: 30, height: 12, "aria-hidden": "true" }));
        sw.appendChild(svg("line", { x1: 0, x2: 30, y1: 6, y2: 6, stroke: s.colour, "stroke-width": s.width || 1.5,
          "stroke-dasharray": s.dash || "" }));
        if (s.marker) sw.appendChild(marker(s.marker, 15, 6, 3, { fill: s.colour }));
        item.appendChild(document.createTextNode(" " + s.name));
      });
    }
  }
  function drawGradient() {
    const key = state.score;
    if (!key) return;
    const info = scoreInfo[key], layerData = D.layerScores[key];
    const layersX = Array.from({ length: L }, (_, i) => i);
    let series, caption;
    if (layerData) {
      series = [{ name: "mean over the layer's heads, 95% interval band", ys: layerData.mean, lo: layerData.low,
        hi: layerData.high, colour: "#1f4fd1", width: 2, marker: "circle" }];
      caption = "Layer gradient: " + info.label + " (mean over heads, 95% interval over " + (D.intervalsOver || "sentences")
        + "; dots: heads)";
    } else {
      const means = layersX.map((l) => {
        const vs = Array.from({ length: H }, (_, h) => D.values[key][idx(l, h)]).filter(finite);
        return vs.length ? vs.reduce((a, b) => a + b, 0) / vs.length : null;
      });
      series = [{ name: "mean over the layer's heads (no interval: not in layers.csv)", ys: means, colour: "#1f4fd1",
        width: 2, marker: "circle" }];
      caption = "Layer gradient: " + info.label + " (mean over heads; dots: heads)";
    }
    const dots = [];
    for (let l = 0; l < L; l++) {
      for (let h = 0; h < H; h++) {
        const v = D.values[key][idx(l, h)];
        dots.push({ x: l, y: v, title: headName(l, h) + ": " + fmt(v), size: 1.8 });
      }
    }
    const extraLegend = [];
    if (state.sel) {
      const [l, h] = state.sel;
      dots.push({ x: l, y: D.values[key][idx(l, h)], title: "selected " + headName(l, h) + ": " +
        fmt(D.values[key][idx(l, h)]), marker: "diamond", size: 4.5, colour: "#d1261f", opacity: 1, stroke: "#fff" });
      extraLegend.push({ name: "selected head " + headName(l, h), colour: "#d1261f", marker: "diamond", width: 0 });
    }
    $("gradient-caption").textContent = caption;
    lineChart($("gradient-chart"), { x: layersX, series, dots, xTitle: "layer", yTitle: info.label, xName: "layer",
      label: caption, extraLegend });
  }
  function drawCategories() {
    if (!D.categories) { $("categories-figure").hidden = true; return; }
    const layersX = Array.from({ length: L }, (_, i) => i);
    const series = D.categories.lines.map((c, i) => ({
      name: c.name + (c.sentences ? " (" + c.sentences + ")" : ""), ys: c.mean, colour: PALETTE[i % PALETTE.length],
      dash: DASHES[i % DASHES.length], marker: MARKERS[i % MARKERS.length], size: 2.5,
      ciLo: c.low, ciHi: c.high, // intervals in the points' titles: six bands would hide each other
    }));
    $("categories-caption").textContent = D.categories.caption;
    lineChart($("categories-chart"), { x: layersX, series, xTitle: "layer", yTitle: D.categories.label,
      xName: "layer", label: D.categories.caption });
  }
  function drawPositions() {
    const P = D.positions;
    if (!P) { $("positions-figure").hidden = true; return; }
    const key = state.positionScore, values = P.values[key];
    const nb = P.bins.length, series = [];
    for (let l = 0; l < L; l++) {
      const ys = [];
      for (let b = 0; b < nb; b++) {
        const vs = Array.from({ length: H }, (_, h) => values[idx(l, h)][b]).filter(finite);
        ys.push(vs.length ? vs.reduce((a, c) => a + c, 0) / vs.length : null);
      }
      const shade = L > 1 ? l / (L - 1) : 0.5;
      // light = early, dark = deep, as position_profile.png
      const c = [190, 200, 220].map((x, j) => Math.round(x + ([20, 40, 90][j] - x) * shade));
      series.push({ name: l === 0 ? "layer 0 (light) … layer " + (L - 1) + " (dark)" : "", ys, colour: rgb(c),
        width: 1, hideLegend: l !== 0 });
    }
    if (state.sel) {
      const [l, h] = state.sel;
      series.push({ name: "selected head " + headName(l, h), ys: values[idx(l, h)], colour: "#d1261f", width: 3,
        marker: "diamond", size: 3.5 });
    }
    lineChart($("positions-chart"), { x: P.bins, series, xTitle: "query position (0-based; bins double)", yTitle: key,
      xName: "position", label: key + " by query position" });
  }
  function buildPositionSelect() {
    const P = D.positions;
    if (!P) return;
    const select = $("position-select");
    Object.keys(P.values).forEach((k) => select.appendChild(el("option", { value: k }, k)));
    state.positionScore = Object.keys(P.values)[0];
    select.addEventListener("change", () => { state.positionScore = select.value; drawPositions(); });
  }
  function buildTypesTable() {
    const order = typeOrder().filter((t) => D.types.includes(t));
    const box = $("types-table");
    if (!order.length) { box.appendChild(el("p", { class: "muted" }, "No head types.")); return; }
    const table = box.appendChild(el("table", { class: "types" }));
    const head = table.appendChild(el("thead")).appendChild(el("tr"));
    head.appendChild(el("th", { scope: "col" }, "layer"));
    order.forEach((t) => head.appendChild(el("th", { scope: "col", title: D.typeMeaning[t] || "" },
      t + " (" + (D.typeLetters[t] || "") + ")")));
    const body = table.appendChild(el("tbody"));
    const totals = Object.fromEntries(order.map((t) => [t, 0]));
    for (let l = 0; l < L; l++) {
      const row = body.appendChild(el("tr"));
      row.appendChild(el("th", { scope: "row" }, "L" + l));
      order.forEach((t) => {
        let count = 0;
        for (let h = 0; h < H; h++) if (typeOf(l, h) === t) count += 1;
        totals[t] += count;
        const td = row.appendChild(el("td", {}, String(count)));
        const bar = td.appendChild(el("span", { class: "cellbar", "aria-hidden": "true" }));
        bar.style.width = Math.round((40 * count) / H) + "px";
      });
    }
    const row = body.appendChild(el("tr"));
    row.appendChild(el("th", { scope: "row" }, "all"));
    order.forEach((t) => row.appendChild(el("td", {}, String(totals[t]))));
  }

  // ---------- heads on two statistics, and each head's page across the corpus ----------
  // One canvas for every head (1,024 points stay one draw); a click finds the nearest point by a scan of the stored
  // pixel positions, never by redrawing. A head's page shows its picked windows only: never a whole long sequence.
  const HP = D.headPages;
  const SC = { width: 520, height: 440, left: 58, right: 14, top: 12, bottom: 46, radius: 3.5 };
  const scatter = { x: null, y: null, px: new Float64Array(2 * L * H) };
  function buildScatter() {
    const xs = $("scatter-x"), ys = $("scatter-y");
    D.scores.forEach((s) => {
      xs.appendChild(el("option", { value: s.key }, s.label));
      ys.appendChild(el("option", { value: s.key }, s.label));
    });
    const keys = D.scores.map((s) => s.key);
    scatter.x = keys[0] || null;
    scatter.y = keys.includes("first_token") ? "first_token" : keys[1] || keys[0] || null;
    xs.value = scatter.x; ys.value = scatter.y;
    xs.addEventListener("change", () => { scatter.x = xs.value; drawScatter(); });
    ys.addEventListener("change", () => { scatter.y = ys.value; drawScatter(); });
    const canvas = $("scatter");
    const ratio = window.devicePixelRatio || 1;
    canvas.width = SC.width * ratio; canvas.height = SC.height * ratio;
    canvas.style.width = SC.width + "px"; canvas.style.height = SC.height + "px";
    canvas.getContext("2d").scale(ratio, ratio);
    const at = (e) => { const r = canvas.getBoundingClientRect(); return nearestHead(e.clientX - r.left, e.clientY - r.top); };
    canvas.addEventListener("mousemove", (e) => {
      const i = at(e);
      if (i < 0) { hideTip(); return; }
      showTip(scatterText(i), e.clientX, e.clientY);
    });
    canvas.addEventListener("mouseleave", hideTip);
    canvas.addEventListener("click", (e) => {
      const i = at(e);
      if (i >= 0) selectHead(Math.floor(i / H), i % H);
    });
    const select = $("head-page-score");
    (HP ? HP.scores : []).forEach((k) => select.appendChild(el("option", { value: k }, scoreInfo[k] ? scoreInfo[k].label : k)));
    state.pageScore = HP && HP.scores.length ? HP.scores[0] : null;
    select.addEventListener("change", () => { state.pageScore = select.value; renderHeadPage(); });
  }
  function scatterText(i) {
    const l = Math.floor(i / H), h = i % H;
    return headName(l, h) + ": " + typeLabel(typeOf(l, h)) + "\n" + scoreInfo[scatter.x].label + " " +
      fmt(D.values[scatter.x][i]) + "\n" + scoreInfo[scatter.y].label + " " + fmt(D.values[scatter.y][i]);
  }
  function nearestHead(x, y) { // the head whose point lies nearest (x, y) in CSS px, within 8 px; else -1
    let best = -1, bestD = 64;
    for (let i = 0; i < L * H; i++) {
      const dx = scatter.px[2 * i] - x, dy = scatter.px[2 * i + 1] - y, d = dx * dx + dy * dy;
      if (d < bestD) { best = i; bestD = d; }
    }
    return best;
  }
  function axisRange(key) {
    const [lo, hi] = scoreRange(key), pad = (hi - lo) * 0.04 || Math.abs(hi) * 0.05 || 0.05;
    const ticks = niceTicks(lo - pad, hi + pad, 5);
    return [Math.min(lo - pad, ticks[0]), Math.max(hi + pad, ticks[ticks.length - 1]), ticks];
  }
  function drawScatter() {
    if (!scatter.x) return;
    const ctx = $("scatter").getContext("2d");
    const [x0, x1, xt] = axisRange(scatter.x), [y0, y1, yt] = axisRange(scatter.y);
    const w = SC.width - SC.left - SC.right, hgt = SC.height - SC.top - SC.bottom;
    const X = (v) => SC.left + ((v - x0) / (x1 - x0)) * w, Y = (v) => SC.top + (1 - (v - y0) / (y1 - y0)) * hgt;
    ctx.clearRect(0, 0, SC.width, SC.height);
    ctx.font = "11px system-ui, sans-serif"; ctx.fillStyle = "#1b1b1f"; ctx.strokeStyle = "#eee"; ctx.lineWidth = 1;
    const xLabels = tickLabels(xt), yLabels = tickLabels(yt);
    ctx.textAlign = "center";
    xt.forEach((t, k) => {
      if (t < x0 || t > x1) return;
      ctx.beginPath(); ctx.moveTo(X(t), SC.top); ctx.lineTo(X(t), SC.top + hgt); ctx.stroke();
      ctx.fillText(xLabels[k], X(t), SC.top + hgt + 14);
    });
    ctx.textAlign = "right";
    yt.forEach((t, k) => {
      if (t < y0 || t > y1) return;
      ctx.beginPath(); ctx.moveTo(SC.left, Y(t)); ctx.lineTo(SC.left + w, Y(t)); ctx.stroke();
      ctx.fillText(yLabels[k], SC.left - 5, Y(t) + 4);
    });
    ctx.strokeStyle = "#888";
    ctx.strokeRect(SC.left, SC.top, w, hgt);
    ctx.textAlign = "center";
    ctx.fillText(scoreInfo[scatter.x].label, SC.left + w / 2, SC.height - 8);
    ctx.save(); ctx.translate(13, SC.top + hgt / 2); ctx.rotate(-Math.PI / 2);
    ctx.fillText(scoreInfo[scatter.y].label, 0, 0); ctx.restore();
    const xs = D.values[scatter.x], ys = D.values[scatter.y];
    for (let l = 0; l < L; l++) {
      const shade = L > 1 ? l / (L - 1) : 0.5;
      ctx.fillStyle = rgb([190, 200, 220].map((c, j) => Math.round(c + ([20, 40, 90][j] - c) * shade)));
      for (let h = 0; h < H; h++) {
        const i = idx(l, h), ok = finite(xs[i]) && finite(ys[i]);
        scatter.px[2 * i] = ok ? X(xs[i]) : NaN; scatter.px[2 * i + 1] = ok ? Y(ys[i]) : NaN;
        if (!ok) continue;
        ctx.beginPath(); ctx.arc(scatter.px[2 * i], scatter.px[2 * i + 1], SC.radius, 0, 2 * Math.PI); ctx.fill();
      }
    }
    if (state.sel) {
      const i = idx(state.sel[0], state.sel[1]);
      if (finite(scatter.px[2 * i])) {
        ctx.strokeStyle = "#d1261f"; ctx.lineWidth = 2.5;
        ctx.beginPath(); ctx.arc(scatter.px[2 * i], scatter.px[2 * i + 1], 7, 0, 2 * Math.PI); ctx.stroke();
      }
    }
    const missing = L * H - Array.from({ length: L * H }, (_, i) => finite(scatter.px[2 * i])).filter(Boolean).length;
    $("scatter-status").textContent = (state.sel ? "Selected " + headName(state.sel[0], state.sel[1]) + ". " : "") +
      (missing ? plural(missing, "head") + " without both values not drawn." : "");
  }
  let hpKeys = null, hpWeights = null;
  function hpArrays() { // the top keys and weights, decoded once
    if (!hpKeys) {
      const bytes = (text) => { const raw = atob(text), out = new Uint8Array(raw.length);
        for (let j = 0; j < raw.length; j++) out[j] = raw.charCodeAt(j); return out; };
      const k = bytes(HP.keys);
      hpKeys = HP.wide ? new Uint16Array(k.buffer) : k;
      hpWeights = bytes(HP.weights);
    }
    return [hpKeys, hpWeights];
  }
  const GROUPS = [["highest", "Highest", (p) => p[3] === 1]].concat(
    Array.from({ length: 10 }, (_, k) => 9 - k).map((d) => ["decile-" + (d + 1), "Tenth " + (d + 1) + " of 10" +
      (d === 9 ? " (highest values)" : d === 0 ? " (lowest values)" : ""), (p) => p[3] === 0 && p[2] === d]),
    [["lowest", "Lowest", (p) => p[3] === -1]]);
  function renderHeadPage() {
    const [l, h] = state.sel, box = $("head-page-examples");
    box.textContent = "";
    $("head-page").dataset.name = headName(l, h);
    $("head-page-title").textContent = "Head " + headName(l, h) + " across the corpus";
    if (!HP) {
      box.appendChild(el("p", { class: "muted" }, "No head_examples.npz in this results folder: " +
        "`attnprobe analyze --head-examples` writes it (`make demo` does)."));
      return;
    }
    const key = state.pageScore, info = scoreInfo[key];
    $("head-page-meaning").textContent = info ? info.meaning : "";
    const picks = (HP.picks[String(idx(l, h))] || {})[key] || [];
    if (!picks.length) { box.appendChild(el("p", { class: "muted" }, "No example of this head for " + key + ".")); return; }
    GROUPS.forEach(([id, title, keep]) => {
      const chosen = picks.filter(keep);
      if (!chosen.length) return;
      box.appendChild(el("h4", { class: "hp-group", "data-group": id }, title));
      chosen.forEach((pick, rank) => box.appendChild(pageExample(pick, id, rank, info ? info.label : key)));
    });
  }
  function asWritten(t) { // a token as it sits in its text (its leading space kept), layout shown as ⏎ and ⇥
    const s = String(t).replace(/\n/g, "⏎").replace(/\t/g, "⇥");
    return s === "" ? "·" : s;
  }
  function pageExample(pick, group, rank, label) {
    const [entry, value, decile] = pick, seg = HP.segments[HP.entrySegment[entry]];
    const card = el("div", { class: "hp-example", "data-group": group, "data-rank": rank, "data-entry": entry });
    const where = seg.total > seg.stop - seg.start ? "tokens " + seg.start + "-" + (seg.stop - 1) + " of " + seg.total
      : plural(seg.total, "token");
    card.appendChild(el("p", { class: "hp-meta" }, label + " " + fmt(value) + " · tenth " + (decile + 1) + " · line " +
      seg.line + (seg.category ? " · " + seg.category : "") + " · " + where));
    const far = card.appendChild(el("div", { class: "hp-far" }));
    const line = card.appendChild(el("div", { class: "hp-tokens" }));
    const spans = new Map();
    seg.pos.forEach((position, j) => {
      if (position < seg.start || position >= seg.stop) return;
      const span = line.appendChild(el("span", { class: "hp-tok", "data-pos": position, title: "token " + position },
        asWritten(seg.labels[j])));
      span.addEventListener("click", () => show(position));
      spans.set(position, span);
    });
    const text = card.appendChild(el("p", { class: "hp-attends" }));
    function show(q) {
      const [keys, weights] = hpArrays(), row = HP.rowOffsets[entry] + (q - seg.start);
      card.dataset.query = q;
      far.textContent = "";
      spans.forEach((span, position) => { span.className = "hp-tok" + (position === q ? " query" : "");
        span.style.background = ""; span.style.color = ""; span.removeAttribute("data-w"); });
      const said = [];
      for (let r = 0; r < HP.k; r++) {
        const j = keys[row * HP.k + r];
        if (j === HP.none) continue;
        const w = weights[row * HP.k + r] / D.levels, position = seg.pos[j];
        let span = spans.get(position);
        if (!span) { // a key before the window: shown apart, with its position
          span = far.appendChild(el("span", { class: "hp-tok", "data-pos": position }, tokenText(seg.labels[j])));
          far.appendChild(document.createTextNode(" (" + position + ") "));
        }
        span.classList.add("attended");
        if (r === 0) span.classList.add("top1");
        span.dataset.w = w.toFixed(3);
        const c = [31, 79, 209].map((x) => Math.round(255 + (x - 255) * (0.15 + 0.85 * w)));
        span.style.background = rgb(c); span.style.color = inkOn(c);
        said.push("“" + tokenText(seg.labels[j]) + "” (" + position + ") " + w.toFixed(3));
      }
      if (far.childNodes.length) far.insertBefore(document.createTextNode("earlier keys: "), far.firstChild);
      const qLabel = seg.labels[seg.pos.indexOf(q)];
      text.textContent = "Token " + q + " “" + tokenText(qLabel) + "” attends most to " +
        (said.length ? said.join(", ") : "no key") + ".";
    }
    show(seg.stop - 1);
    return card;
  }
  window.attnprobeReport = { // for tests and the console: where a head's point is drawn (client px), or null
    scatterPoint(l, h) {
      const i = idx(l, h), r = $("scatter").getBoundingClientRect();
      return finite(scatter.px[2 * i]) ? [r.left + scatter.px[2 * i], r.top + scatter.px[2 * i + 1]] : null;
    },
  };

  // ---------- start ----------
  function start() {
    const select = $("score-select");
    D.scores.forEach((s) => select.appendChild(el("option", { value: s.key }, s.label)));
    select.addEventListener("change", () => { state.score = select.value; paintGrid(); });
    const slider = $("threshold");
    slider.addEventListener("input", () => {
      state.threshold = +slider.value;
      $("threshold-value").textContent = state.threshold.toFixed(2);
      redrawArcs();
    });
    buildGrid();
    buildTypeLegend();
    buildPositionSelect();
    paintGrid();
    drawCategories();
    buildTypesTable();
    buildScatter();
    let first = D.initial;
    const wanted = /^#L(\d+)H(\d+)$/.exec(location.hash);
    if (wanted && +wanted[1] < L && +wanted[2] < H) first = [+wanted[1], +wanted[2]];
    state.focus = [0, 0];
    cells[0][0].tabIndex = -1;
    cells[first[0]][first[1]].tabIndex = 0;
    state.focus = first;
    selectHead(first[0], first[1]);
    document.body.dataset.ready = "true";
  }
  start();
})();
