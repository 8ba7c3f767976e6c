// The swarm dashboard: polls /api/swarm and draws the map, the charts and the tables. No dependencies, no build.
// Everything a peer publishes is untrusted text: it only ever reaches the page through textContent/attributes.
"use strict";

const POLL_MS = 2000;
const HEALTHS = ["alive", "straggling", "idle", "leaving", "missing", "banned"];
const HEALTH_HELP = {
  alive: "heartbeating and working",
  straggling: "late heartbeat, or far slower than its peers",
  idle: "joined but does no work",
  leaving: "announced leaving (a clean leave)",
  missing: "stopped heartbeating without announcing leaving (killed, stalled or cut off)",
  banned: "a ban is in effect",
};
const MODES = ["direct", "relay", "client", "unknown"];
const MODE_HELP = {
  direct: "peers dial it at its own addresses",
  relay: "not reachable: peers reach it through a relay's circuit (slower)",
  client: "not reachable and no relay: it trains and pushes but serves nothing",
  unknown: "its heartbeat does not say (an older node)",
};
const PALETTE = ["#4c78a8", "#f58518", "#54a24b", "#b279a2", "#9d755d", "#e45756", "#72b7b2", "#eeca3b"];
const SVG_NS = "http://www.w3.org/2000/svg";

// ---- small DOM helpers ----

function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(attrs)) {
    if (value === undefined || value === null) continue;
    if (key === "text") node.textContent = value;
    else node.setAttribute(key, value);
  }
  for (const child of children) node.append(child);
  return node;
}

function svgEl(tag, attrs = {}, text) {
  const node = document.createElementNS(SVG_NS, tag);
  for (const [key, value] of Object.entries(attrs)) node.setAttribute(key, value);
  if (text !== undefined) node.textContent = text;
  return node;
}

function setText(id, text) {
  document.getElementById(id).textContent = text;
}

const shortId = (peerId) => (peerId ? String(peerId).slice(-8) : "--------");
const fmt = (value, digits = 0) =>
  value === null || value === undefined || Number.isNaN(value) ? "-" : Number(value).toLocaleString(undefined, {
    minimumFractionDigits: digits, maximumFractionDigits: digits,
  });
// three significant digits: held-out slopes range over orders of magnitude
const sig = (value) => (Number.isFinite(value) ? Number(value).toPrecision(3) : "-");
const clock = (seconds) => {
  const s = Math.max(0, Math.round(seconds));
  return `${Math.floor(s / 60)}:${String(s % 60).padStart(2, "0")}`;
};
const last = (values) => {
  for (let i = values.length - 1; i >= 0; i--) if (values[i] !== null && values[i] !== undefined) return values[i];
  return null;
};

// ---- charts: one small SVG line/dot chart ----

function niceTicks(lo, hi, count) {
  const span = hi - lo || 1;
  const step = 10 ** Math.floor(Math.log10(span / count));
  const unit = [1, 2, 5, 10].map((m) => m * step).find((s) => span / s <= count) || step * 10;
  const ticks = [];
  for (let v = Math.ceil(lo / unit) * unit; v <= hi + 1e-9; v += unit) ticks.push(Number(v.toFixed(10)));
  return ticks;
}

// Held-out loss of the global model and its perplexity (exp of the mean token cross-entropy).
function heldOut(loss) {
  const ppl = Number.isFinite(loss) ? Math.exp(loss) : NaN;
  return `held-out ${fmt(loss, 3)} · perplexity ${Number.isFinite(ppl) ? fmt(ppl, 2) : "-"}`;
}

function drawChart(svg, { lines = [], dots = [], xMax, yMin = null, yFormat = (v) => fmt(v, 1), empty }) {
  const width = svg.clientWidth || 600;
  const height = svg.clientHeight || 210;
  svg.setAttribute("viewBox", `0 0 ${width} ${height}`);
  svg.replaceChildren();
  const pad = { left: 52, right: 10, top: 8, bottom: 24 };
  const ys = [...lines.flatMap((l) => l.ys), ...dots.map((d) => d.y)].filter((v) => v !== null && Number.isFinite(v));
  const pointCount = lines.reduce((n, l) => n + l.ys.filter((v) => v !== null).length, 0) + dots.length;
  svg.dataset.points = String(pointCount);
  if (!ys.length) {
    svg.append(svgEl("text", { x: width / 2, y: height / 2, "text-anchor": "middle", class: "nodata" }, empty || "no data yet"));
    return;
  }
  let lo = yMin === null ? Math.min(...ys) : Math.min(yMin, ...ys);
  let hi = Math.max(...ys);
  if (hi - lo < 1e-9) { hi += 1; lo = yMin === null ? lo - 1 : lo; }
  const margin = (hi - lo) * 0.06;
  hi += margin;
  lo = yMin === null ? lo - margin : lo;
  const xHi = Math.max(xMax, 1);
  const X = (x) => pad.left + (x / xHi) * (width - pad.left - pad.right);
  const Y = (y) => height - pad.bottom - ((y - lo) / (hi - lo)) * (height - pad.top - pad.bottom);
  for (const tick of niceTicks(lo, hi, 4)) {
    svg.append(svgEl("line", { x1: pad.left, x2: width - pad.right, y1: Y(tick), y2: Y(tick), class: "grid" }));
    svg.append(svgEl("text", { x: pad.left - 4, y: Y(tick) + 3, "text-anchor": "end" }, yFormat(tick)));
  }
  for (const tick of niceTicks(0, xHi, 6)) {
    svg.append(svgEl("text", { x: X(tick), y: height - 8, "text-anchor": "middle" }, clock(tick)));
  }
  svg.append(svgEl("line", { x1: pad.left, x2: pad.left, y1: pad.top, y2: height - pad.bottom, class: "axis" }));
  svg.append(svgEl("line", { x1: pad.left, x2: width - pad.right, y1: height - pad.bottom, y2: height - pad.bottom, class: "axis" }));
  for (const line of lines) {
    let d = "";
    let pen = false;
    line.xs.forEach((x, i) => {
      const y = line.ys[i];
      if (y === null || y === undefined || !Number.isFinite(y)) { pen = false; return; }
      d += `${pen ? "L" : "M"}${X(x).toFixed(1)},${Y(y).toFixed(1)}`;
      pen = true;
    });
    if (d) {
      svg.append(svgEl("path", {
        d, fill: "none", stroke: line.color, "stroke-width": line.width || 1.5, opacity: line.opacity || 1,
        class: line.cls || "series",
      }));
    }
    if ((d.match(/M/g) || []).length === (d.match(/[ML]/g) || []).length) {
      // only isolated points so far: a path of single points draws nothing, so mark them
      line.xs.forEach((x, i) => {
        const y = line.ys[i];
        if (y !== null && y !== undefined && Number.isFinite(y)) {
          svg.append(svgEl("circle", { cx: X(x), cy: Y(y), r: 2, fill: line.color, opacity: line.opacity || 1 }));
        }
      });
    }
  }
  for (const dot of dots) {
    const circle = svgEl("circle", { cx: X(dot.x), cy: Y(dot.y), r: dot.r || 3, fill: dot.color, opacity: 0.8, class: dot.cls || "dot" });
    if (dot.title) circle.append(svgEl("title", {}, dot.title));
    svg.append(circle);
  }
  let legendX = pad.left + 6;
  for (const item of lines.filter((l) => l.label)) {
    svg.append(svgEl("rect", { x: legendX, y: pad.top + 2, width: 10, height: 3, fill: item.color }));
    const label = svgEl("text", { x: legendX + 14, y: pad.top + 7 }, item.label);
    svg.append(label);
    legendX += 20 + item.label.length * 5.6;
  }
}

// ---- sections ----

function renderSummary(doc) {
  const history = doc.history || {};
  const map = doc.map || { counts: {} };
  const counts = map.counts || {};
  setText("run-name", doc.run_name || "swarm");
  setText("run-meta", `run ${doc.run_id || "?"} · owner ${shortId(doc.owner)} · ${doc.settings ? doc.settings.num_stages : "?"} stage(s)`);
  const live = (doc.peers || []).length;
  setText("summary-peers", String(live));
  const modes = map.modes || {};
  const health = HEALTHS.filter((h) => counts[h]).map((h) => `${counts[h]} ${h}`);
  // direct is the usual case: say only how many are relayed, client-only or of unknown mode
  const reach = MODES.filter((m) => m !== "direct" && modes[m]).map((m) => `${modes[m]} ${m}`);
  setText("summary-health", [...health, ...reach].join(", "));
  setText("summary-throughput", fmt(last(history.throughput || [])));
  // goodput is merged work only: 0 before the first merge, unknown (never a heartbeat figure) if undescribed
  const source = history.goodput_source;
  const goodput = source === "syncer" ? fmt(last(history.goodput || [])) : source === "no merges yet" ? "0" : "?";
  setText("summary-goodput", goodput);
  setText("summary-goodput-source", source === "syncer" ? "tokens/s merged (syncer)"
    : source === "no merges yet" ? "no merges yet" : `unknown: ${source || "no history"}`);
  setText("summary-loss", fmt(last(history.loss || []), 3));
  const evals = history.eval || [];
  setText("summary-eval", evals.length ? heldOut(evals[evals.length - 1].loss) : "mean of peers");
  const totals = history.totals || {};
  setText("summary-merges", fmt(totals.merges));
  const active = (doc.syncer || []).filter((s) => s.state === "active");
  const syncer = active.sort((a, b) => (b.term - a.term) || (b.lease_until - a.lease_until))[0];
  setText("summary-versions", syncer ? `versions ${syncer.versions.join(" ")}` : "no syncer record");
  setText("summary-bans", String((doc.bans || []).length));
}

function peerTile(cell) {
  const mode = MODES.includes(cell.mode) ? cell.mode : "unknown";
  const lines = [`${cell.role}${cell.stage !== null && cell.stage !== undefined ? ` · stage ${cell.stage}` : ""} · ${mode}`];
  if (cell.role === "learner" || cell.role === "stage") {
    lines.push(`${fmt(cell.throughput)} tok/s`);
    lines.push(`step ${fmt(cell.inner_step)} · loss ${fmt(cell.loss, 2)}`);
  } else {
    lines.push(cell.state || "");
  }
  const title = `${cell.peer_id}\n${cell.health}: ${HEALTH_HELP[cell.health] || ""}\n${mode}: ${MODE_HELP[mode]}\nstate ${cell.state}\n${cell.http ? `http ${cell.http}` : ""}`;
  const tile = el("div", { class: "peer", "data-peer-id": cell.peer_id, "data-health": cell.health, "data-role": cell.role, "data-mode": mode, title });
  tile.append(el("b", { text: cell.short }));
  for (const line of lines) tile.append(el("br"), document.createTextNode(line));
  return tile;
}

function tiles(cells) {
  const box = el("div", { class: "tiles" });
  if (!cells.length) box.append(el("span", { class: "empty", text: "none" }));
  for (const cell of cells) box.append(peerTile(cell));
  return box;
}

function renderMap(doc) {
  const map = doc.map || { stages: [], learners: [], verifiers: [], syncers: [], bootstraps: [] };
  const pipeline = document.getElementById("map-pipeline");
  const stages = map.stages || [];
  pipeline.replaceChildren();
  const hasPipeline = stages.some((replicas) => replicas.length);
  stages.forEach((replicas, index) => {
    const span = replicas.length && replicas[0].span ? ` layers ${replicas[0].span[0]}-${replicas[0].span[1]}` : "";
    const box = el("div", { class: "stage", "data-stage": String(index) });
    box.append(el("h3", { text: `stage ${index}${span} · ${replicas.length} replica(s)` }), tiles(replicas));
    pipeline.append(box);
  });
  pipeline.hidden = !hasPipeline;
  const roles = document.getElementById("map-roles");
  roles.replaceChildren();
  for (const [name, cells] of [["learners", map.learners], ["verifiers", map.verifiers], ["syncer", map.syncers], ["bootstrap", map.bootstraps]]) {
    const box = el("div", { class: "role", "data-role-group": name });
    box.append(el("h3", { text: `${name} (${(cells || []).length})` }), tiles(cells || []));
    roles.append(box);
  }
}

function renderCharts(doc) {
  const h = doc.history || {};
  const t0 = h.started_at || (h.t && h.t[0]) || 0;
  const xs = (h.t || []).map((t) => t - t0);
  // merges and evaluations may be newer than the last sample: the axis reaches them too
  const xMax = Math.max(1, ...xs, ...(h.eval || []).map((p) => p.t - t0), ...(h.merges || []).map((m) => m.t - t0));

  const peerLines = Object.entries(h.peer_loss || {}).map(([peerId, series], i) => ({
    xs: series.t.map((t) => t - t0), ys: series.loss, color: PALETTE[i % PALETTE.length], width: 1, opacity: 0.45, cls: "series peer-loss",
  }));
  drawChart(document.getElementById("chart-loss"), {
    xMax,
    lines: [...peerLines, { xs, ys: h.loss || [], color: "#1d232a", width: 2, label: "training (mean)", cls: "series loss-mean" }],
    dots: (h.eval || []).map((p) => ({ x: p.t - t0, y: p.loss, r: 4, color: "#d0342c", cls: "dot eval", title: `held-out ${p.loss}` })),
    yFormat: (v) => fmt(v, 2),
    empty: "no loss reported yet",
  });
  drawChart(document.getElementById("chart-throughput"), {
    xMax, yMin: 0,
    lines: [
      { xs, ys: h.throughput || [], color: "#4c78a8", label: "processed (reported by heartbeats)" },
      { xs, ys: h.goodput || [], color: "#54a24b", label: "goodput (merged)" },
    ],
    yFormat: (v) => fmt(v),
  });
  const merges = h.merges || [];
  drawChart(document.getElementById("chart-merges"), {
    xMax, yMin: 0,
    dots: merges.map((m) => ({
      x: m.t - t0, y: m.fragment, r: 2.5 + 1.5 * (m.quorum || 1), color: PALETTE[m.fragment % PALETTE.length], cls: "dot merge",
      title: `fragment ${m.fragment} -> v${m.version}${m.quorum ? `, quorum ${m.quorum}` : ""}`,
    })),
    yFormat: (v) => (Number.isInteger(v) ? `frag ${v}` : ""),
    empty: "no merge seen yet",
  });
  drawChart(document.getElementById("chart-peers"), {
    xMax, yMin: 0,
    lines: [
      { xs, ys: h.alive || [], color: "#2e9e4f", label: "alive" },
      { xs, ys: h.straggling || [], color: "#e0a020", label: "straggling" },
      { xs, ys: h.missing || [], color: "#5a5a5a", label: "missing" },
      { xs, ys: h.banned || [], color: "#d0342c", label: "banned" },
    ],
    yFormat: (v) => (Number.isInteger(v) ? String(v) : ""),
  });
}

function renderMerges(doc) {
  const h = doc.history || {};
  const t0 = h.started_at || 0;
  const body = document.querySelector("#merges tbody");
  body.replaceChildren();
  const merges = (h.merges || []).slice(-15).reverse();
  if (!merges.length) body.append(el("tr", {}, el("td", { colspan: "6", class: "empty", text: "no merge seen yet" })));
  for (const m of merges) {
    body.append(mergeRow(m, t0));
  }
}

// A merge the syncer has not described (yet) says why in `undescribed`: that reason fills its row, never a blank.
function mergeRow(m, t0) {
  const described = m.undescribed === undefined || m.undescribed === null;
  const weights = m.weights && typeof m.weights === "object" ? Object.entries(m.weights) : null;
  let weightsText = m.undescribed || "not described";
  if (described && weights) {
    weightsText = weights.length ? weights.map(([peer, w]) => `${shortId(peer)} ${fmt(w, 2)}`).join(", ")
      : "none (nothing merged)";
  }
  const quorum = m.quorum !== undefined && m.quorum !== null ? String(m.quorum) : described ? "not given" : "?";
  const grace = m.grace_s !== undefined && m.grace_s !== null ? `${fmt(m.grace_s, 2)} s` : described ? "not given" : "?";
  const row = el("tr", { "data-fragment": String(m.fragment), "data-described": String(described) },
    el("td", { text: clock(m.t - t0) }),
    el("td", { text: String(m.fragment) }),
    el("td", { text: `v${m.version}${m.count > 1 ? ` (${m.count} merges)` : ""}` }),
    el("td", { class: "quorum", text: quorum }),
    el("td", { text: grace }),
    el("td", { class: described && weights ? "mono weights" : "weights undescribed", text: weightsText }));
  if (!described) row.title = m.undescribed;
  return row;
}

function renderBans(doc) {
  const body = document.querySelector("#bans tbody");
  body.replaceChildren();
  const bans = (doc.history && doc.history.bans) || [];
  if (!bans.length) body.append(el("tr", {}, el("td", { colspan: "5", class: "empty", text: "no bans" })));
  for (const ban of bans) {
    const evidence = el("div");
    for (const notice of ban.notices || []) {
      const details = el("details");
      details.append(el("summary", { text: `${notice.reason || "no reason"} (by ${shortId(notice.verifier)}, ${notice.evidence_bytes} B evidence)` }));
      details.append(el("pre", { text: notice.evidence || "(none)" }));
      evidence.append(details);
    }
    body.append(el("tr", { "data-offender": ban.offender },
      el("td", { class: "mono", title: ban.offender, text: shortId(ban.offender) }),
      el("td", { text: ban.stage !== null && ban.stage !== undefined ? String(ban.stage) : "-" }),
      el("td", { text: ban.in_effect ? "yes" : "not yet" }),
      el("td", { class: "mono", text: (ban.verifiers || []).map(shortId).join(", ") }),
      el("td", {}, evidence)));
  }
}

// Per contributor, the active syncer's scores (the bootstrap reads its /api/status): banned and most rejected first.
function renderScores(doc) {
  const scores = doc.scores || { learners: [], unavailable: "this bootstrap serves no scores (an older version)" };
  const rows = scores.learners || [];
  const body = document.querySelector("#scores tbody");
  body.replaceChildren();
  if (!rows.length) body.append(el("tr", {}, el("td", { colspan: "7", class: "empty", text: scores.unavailable || "nobody scored yet" })));
  for (const s of rows) {
    const verdict = s.banned ? `banned: ${s.ban_reason || "no reason given"}`
      : s.last_refusal ? `no; last refusal ${s.last_refusal}` : "no";
    body.append(el("tr", { "data-peer-id": s.peer_id, "data-banned": String(Boolean(s.banned)) },
      el("td", { class: "mono", title: s.peer_id, text: shortId(s.peer_id) }),
      el("td", { class: "num", text: fmt(s.evidence_factor, 2) }),
      el("td", { class: "num", text: sig(s.held_out_slope) }),
      el("td", { class: "num", text: fmt(s.merge_weight, 3) }),
      el("td", { class: "num", text: fmt(s.trust, 2) }),
      el("td", { class: "num", text: fmt(s.rejected) }),
      el("td", { class: "verdict", text: verdict })));
  }
  const shown = rows.length < (scores.total || 0) ? `${rows.length} of ${scores.total} peers, ` : "";
  setText("scores-note", `(${shown}the active syncer's${scores.syncer ? ` ${shortId(scores.syncer)}` : ""})`);
}

function renderEvents(doc) {
  const list = document.getElementById("events");
  const t0 = (doc.history && doc.history.started_at) || 0;
  list.replaceChildren();
  const events = doc.events || [];
  if (!events.length) list.append(el("li", { class: "empty", text: "no events yet" }));
  for (const event of events.slice(0, 100)) {
    list.append(el("li", { "data-kind": event.kind },
      el("span", { class: "mono muted", text: `${clock(event.t - t0)}  ` }),
      el("span", { class: "kind", text: event.kind }),
      document.createTextNode(event.text || "")));
  }
}

function renderLegend() {
  const legend = document.getElementById("legend");
  for (const health of HEALTHS) {
    legend.append(el("span", { style: `--c: var(--${health})`, title: HEALTH_HELP[health], text: health }));
  }
}

// ---- polling ----

function render(doc) {
  renderSummary(doc);
  renderMap(doc);
  renderCharts(doc);
  renderMerges(doc);
  renderBans(doc);
  renderScores(doc);
  renderEvents(doc);
}

async function poll() {
  const conn = document.getElementById("conn");
  try {
    const response = await fetch("/api/swarm", { cache: "no-store" });
    if (!response.ok) throw new Error(`HTTP ${response.status}`);
    const doc = await response.json();
    render(doc);
    conn.dataset.state = "ok";
    conn.textContent = `updated ${new Date().toLocaleTimeString()}`;
  } catch (error) {
    conn.dataset.state = "error";
    conn.textContent = `cannot reach /api/swarm: ${error.message}`;
  } finally {
    setTimeout(poll, POLL_MS);
  }
}

renderLegend();
poll();
