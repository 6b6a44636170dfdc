// The node's console: plain DOM and SVG over the node's own /v1 API, refreshed every few seconds.
// Everything a producer chose (ids, subjects, reasons) goes in as text, never as HTML.
"use strict";

const REFRESH_MS = 5000;
const COLORS = ["#2f6fde", "#1f9d55", "#d98b00", "#d1373f", "#7a4fd6", "#0f9ab8", "#b8527a", "#5c6b1f"];
const $ = (id) => document.getElementById(id);

function el(tag, props, ...children) {
  const node = document.createElement(tag);
  Object.assign(node, props || {});
  for (const child of children) node.append(child instanceof Node ? child : String(child ?? ""));
  return node;
}

function svg(tag, attrs, text) {
  const node = document.createElementNS("http://www.w3.org/2000/svg", tag);
  for (const [k, v] of Object.entries(attrs || {})) node.setAttribute(k, v);
  if (text !== undefined) node.textContent = text;
  return node;
}

const fmt = (n) => (n === undefined || n === null ? "–" : Number(n).toLocaleString("en-US"));
const iso = (ms) => (ms ? new Date(ms).toISOString().replace("T", " ").replace("Z", " UTC") : "–");

// --- the API ------------------------------------------------------------------------------------

async function api(path, options = {}) {
  const token = sessionStorage.getItem("delayserver-token");
  const headers = Object.assign({}, options.headers || {});
  if (token) headers["Authorization"] = "Bearer " + token;
  const response = await fetch(path, Object.assign({}, options, { headers }));
  if (response.status === 401) {
    $("login").hidden = false;
    throw new Error("this node wants a token");
  }
  const body = await response.json();
  body.httpStatus = response.status;
  return body;
}

// --- pages --------------------------------------------------------------------------------------

const pages = {
  async overview() {
    const ov = await api("/v1/overview");
    $("ov-pending").textContent = fmt(ov.pending);
    $("ov-due-minute").textContent = fmt(ov.due_next_minute);
    $("ov-due-hour").textContent = fmt(ov.due_next_hour);
    $("ov-rate").textContent = fmt(ov.delivery_rate_per_s);
    $("ov-delivered").textContent = fmt(ov.delivery.delivered);
    $("ov-inflight").textContent = fmt(ov.delivery.inflight);
    drawHistogram($("ov-lateness"), ov.lateness);
    fillRows($("ov-groups"), ov.broker_groups, (g) => [
      g.name, g.transport, el("span", { className: "breaker-" + g.breaker }, g.breaker),
      fmt(g.inflight), fmt(g.delivered), fmt(g.retried), fmt(g.parked), fmt(g.failed_batches)]);
  },

  async backlog() {
    const [buckets, history] = await Promise.all([api("/v1/buckets"), api("/v1/buckets/history")]);
    fillRows($("bl-table"), buckets.buckets, (b) => [
      b.bucket, fmt(b.scheduled), fmt(b.dispatched), fmt(b.cancelled), fmt(b.parked), fmt(b.pending)]);
    drawBacklog($("bl-chart"), $("bl-legend"), history.samples);
  },

  async messages() {
    const handle = $("message").dataset.handle;
    if (handle) await showMessage(handle);
  },

  async parked() {
    const parked = await api("/v1/parked");
    fillRows($("pk-table"), parked.parked, (p) => [iso(p.parked_time), p.subject, p.handle, p.attempt, p.reason]);
    $("redrive").disabled = parked.parked.length === 0;
  },

  async cluster() {
    const [node, nodes] = await Promise.all([api("/v1/node"), api("/v1/nodes")]);
    const dl = $("cl-node");
    dl.replaceChildren();
    const rep = node.replication || {};
    const rows = [["Node", node.node_id], ["Group", node.group], ["Role", node.role], ["Epoch", node.epoch],
      ["Master", node.master || (node.role === "master" ? "this node" : "–")], ["Meta server", node.meta || "none"],
      ["Read-only", node.read_only ? "yes " + (node.read_only_reason || "") : "no"],
      ["message_log end", fmt(node.message_log.end_offset)], ["Replayed to", fmt(node.message_log.replay_offset)]];
    for (const s of rep.slaves || []) rows.push(["Slave " + s.node_id, "behind by " + fmt(s.lag_bytes) + " bytes"]);
    if (rep.from_master) rows.push(["Replication lag", fmt(rep.from_master.lag_bytes) + " bytes, " +
                                    rep.from_master.lag_seconds + " s"]);
    for (const [k, v] of rows) dl.append(el("dt", {}, k), el("dd", {}, v));
    fillRows($("cl-nodes"), nodes.nodes, (n) => [n.node_id, n.address || "", n.role, n.state || (n.alive ? "alive" : ""),
                                                 n.epoch ?? ""]);
  },
};

function fillRows(table, items, cells) {
  const body = table.tBodies[0];
  body.replaceChildren();
  for (const item of items) {
    const tr = el("tr");
    for (const cell of cells(item)) tr.append(el("td", {}, cell));
    body.append(tr);
  }
  if (!items.length) body.append(el("tr", {}, el("td", { colSpan: table.tHead.rows[0].cells.length, className: "muted" }, "none")));
}

// --- charts -------------------------------------------------------------------------------------

function drawHistogram(target, lateness) {
  target.replaceChildren();
  if (!lateness) return;
  const W = 720, H = 200, pad = 28, counts = lateness.counts;  // bars: one per bound, then "over"
  const label = (ms) => (ms >= 1000 ? ms / 1000 + "s" : ms + "ms");
  const labels = lateness.bounds_ms.map(label).concat([">" + label(lateness.bounds_ms.at(-1))]);
  const max = Math.max(1, ...counts), bw = (W - pad) / counts.length;
  counts.forEach((c, i) => {
    const h = (H - 2 * pad) * c / max, x = pad + i * bw;
    target.append(svg("rect", { x: x + 2, y: H - pad - h, width: bw - 4, height: h, fill: "#2f6fde", "data-count": c }));
    if (c) target.append(svg("text", { x: x + bw / 2, y: H - pad - h - 4, "text-anchor": "middle" }, fmt(c)));
    target.append(svg("text", { x: x + bw / 2, y: H - 10, "text-anchor": "middle" }, labels[i]));
  });
  target.append(svg("line", { x1: pad, x2: W, y1: H - pad, y2: H - pad, stroke: "#c5cad5" }));
}

function drawBacklog(target, legend, samples) {
  target.replaceChildren();
  legend.replaceChildren();
  const W = 720, H = 240, left = 56, bottom = 24, top = 10;
  if (!samples.length) return;
  const buckets = [...new Set(samples.flatMap((s) => Object.keys(s.pending)))].sort().slice(-COLORS.length);
  const t0 = samples[0].time, t1 = Math.max(samples.at(-1).time, t0 + 1);
  const max = Math.max(1, ...samples.flatMap((s) => buckets.map((b) => s.pending[b] || 0)));
  const x = (t) => left + (W - left - 8) * (t - t0) / (t1 - t0);
  const y = (v) => H - bottom - (H - bottom - top) * v / max;
  for (const v of new Set([0, Math.round(max / 2), max])) {
    target.append(svg("line", { x1: left, x2: W - 8, y1: y(v), y2: y(v), stroke: "#e1e4ea" }));
    target.append(svg("text", { x: left - 6, y: y(v) + 4, "text-anchor": "end" }, fmt(v)));
  }
  target.append(svg("text", { x: left, y: H - 6 }, iso(t0)));
  target.append(svg("text", { x: W - 8, y: H - 6, "text-anchor": "end" }, iso(t1)));
  buckets.forEach((bucket, i) => {
    const points = samples.map((s) => x(s.time).toFixed(1) + "," + y(s.pending[bucket] || 0).toFixed(1)).join(" ");
    target.append(svg("polyline", { points, fill: "none", stroke: COLORS[i], "stroke-width": 2, "data-bucket": bucket }));
    legend.append(el("span", {}, el("i", { style: "background:" + COLORS[i] }), bucket));
  });
}

// --- messages: look up and cancel ---------------------------------------------------------------

async function showMessage(handle) {
  const box = $("message");
  box.dataset.handle = handle;
  const st = await api("/v1/messages/" + handle);
  box.hidden = false;
  $("msg-handle").textContent = st.handle || handle;
  $("msg-due").textContent = st.schedule_time ? iso(st.schedule_time) : "–";
  const state = st.state || st.code;
  $("msg-state").replaceChildren(el("span", { className: "state-" + state }, state));
  $("msg-delivered").textContent = iso(st.dispatch_time);
  $("msg-group").textContent = st.broker_group || "–";
  $("msg-cancel").disabled = state !== "pending";
  if (st.httpStatus >= 400 && st.code !== "NOT_FOUND") $("msg-outcome").textContent = st.code + ": " + st.message;
}

$("search").addEventListener("submit", async (event) => {
  event.preventDefault();
  $("msg-outcome").textContent = "";
  const handle = $("search-handle").value.trim();
  if (handle) await guarded(() => showMessage(handle));
});

$("msg-cancel").addEventListener("click", () => guarded(async () => {
  const handle = $("message").dataset.handle;
  $("msg-cancel").disabled = true;
  const result = await api("/v1/messages/" + handle, { method: "DELETE" });
  const outcome = (result.outcome || result.code).replaceAll("_", " ");
  const detail = result.message && result.message !== outcome ? " (" + result.message + ")" : "";
  $("msg-outcome").textContent = "Cancel: " + outcome + detail;
  await showMessage(handle);
}));

$("redrive").addEventListener("click", () => guarded(async () => {
  $("redrive").disabled = true;
  const result = await api("/v1/parked/redrive", { method: "POST" });
  $("redrive-result").textContent = result.code === "OK" ? "redrove " + result.redriven : result.code + ": " + result.message;
  await pages.parked();
}));

$("login").addEventListener("submit", (event) => {
  event.preventDefault();
  sessionStorage.setItem("delayserver-token", $("token").value);
  $("login").hidden = true;
  refresh();
});

// --- navigation and refresh ---------------------------------------------------------------------

function currentPage() {
  const name = location.hash.replace("#", "");
  return pages[name] ? name : "overview";
}

async function guarded(work) {
  try {
    await work();
    $("error").hidden = true;
  } catch (e) {
    $("error").textContent = String(e.message || e);
    $("error").hidden = false;
  }
}

async function refresh() {
  const page = currentPage();
  for (const a of document.querySelectorAll("nav a")) a.classList.toggle("active", a.dataset.page === page);
  for (const section of document.querySelectorAll(".page")) section.hidden = section.id !== "page-" + page;
  await guarded(async () => {
    await pages[page]();
    const node = await api("/v1/node");
    const badge = $("node-badge");
    badge.textContent = node.node_id + " · " + node.role;
    badge.className = "badge " + node.role;
    $("refreshed").textContent = "updated " + new Date().toISOString().slice(11, 19) + " UTC";
    document.body.dataset.loaded = page;
  });
}

window.addEventListener("hashchange", refresh);
setInterval(() => { if (!document.hidden) refresh(); }, REFRESH_MS);
refresh();
