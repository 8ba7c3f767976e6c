// The bootstrap's contribution ledger as a sortable table; polls /api/leaderboard every 5 s.
"use strict";

const state = { rows: [], key: "verified_tokens", descending: true };

function cell(text, cls) {
  const td = document.createElement("td");
  td.textContent = text;
  if (cls) td.className = cls;
  return td;
}

function ago(t) {
  if (!t) return "-";
  const s = Math.max(0, Date.now() / 1000 - t);
  return s < 90 ? `${s.toFixed(0)} s ago` : s < 5400 ? `${(s / 60).toFixed(0)} min ago` : `${(s / 3600).toFixed(1)} h ago`;
}

function compare(a, b) {
  const x = a[state.key], y = b[state.key];
  const order = typeof x === "number" && typeof y === "number" ? x - y : String(x ?? "").localeCompare(String(y ?? ""));
  return state.descending ? -order : order;
}

function render() {
  const body = document.querySelector("#leaderboard tbody");
  const ranked = [...state.rows].sort((a, b) => b.verified_tokens - a.verified_tokens || b.accepted - a.accepted);
  ranked.forEach((row, i) => { row.rank = i + 1; });
  const rows = [...ranked].sort(compare);
  body.replaceChildren(...rows.map((row) => {
    const tr = document.createElement("tr");
    tr.dataset.peerId = row.peer_id;
    tr.append(
      cell(row.rank), cell(`…${row.peer_id.slice(-8)}`, "peer-id"), cell(row.role || "-"),
      cell(Math.round(row.verified_tokens).toLocaleString(), "num"), cell(row.accepted, "num"),
      cell(row.rejected, "num"), cell(row.last_reject_reason || "-"),
      cell(`${Math.round(row.uptime_s)} s`, "num"), cell(ago(row.last_seen)),
    );
    tr.title = row.peer_id;
    return tr;
  }));
  for (const th of document.querySelectorAll("#leaderboard th")) {
    th.dataset.sorted = th.dataset.key === state.key ? (state.descending ? "desc" : "asc") : "";
  }
}

// Pushes the syncer refused for want of the run's admission cost (proof-of-work or allow-list), before any
// screening: those identities never contributed, so they have no row above.
const ADMISSION_REASONS = {
  no_proof: "no proof-of-work", weak_proof: "proof too weak", malformed_proof: "malformed proof",
  not_allowlisted: "not on the allow-list",
};

function renderAdmission(counts) {
  const entries = Object.entries(counts || {}).filter(([, n]) => n > 0);
  const total = entries.reduce((sum, [, n]) => sum + n, 0);
  const detail = entries.map(([reason, n]) => `${ADMISSION_REASONS[reason] || reason} ${n}`).join(" · ");
  const p = document.getElementById("admission");
  p.dataset.total = String(total);
  p.textContent = total
    ? `Refused at admission (the run's proof-of-work, before any screening; not in the table): ${total} push(es): ${detail}`
    : "Refused at admission: none";
}

async function poll() {
  const conn = document.getElementById("conn");
  try {
    const response = await fetch("/api/leaderboard");
    if (!response.ok) throw new Error(`HTTP ${response.status}`);
    const data = await response.json();
    state.rows = data.peers;
    document.getElementById("run-meta").textContent = `run ${data.run_id} · ${data.peers.length} peer(s)`;
    conn.dataset.state = "ok";
    conn.textContent = "live";
    render();
    renderAdmission(data.admission_refused);
  } catch (e) {
    conn.dataset.state = "error";
    conn.textContent = `error: ${e.message}`;
  }
}

for (const th of document.querySelectorAll("#leaderboard th")) {
  th.style.cursor = "pointer";
  th.addEventListener("click", () => {
    state.descending = th.dataset.key === state.key ? !state.descending : th.dataset.key !== "peer_id";
    state.key = th.dataset.key;
    render();
  });
}
poll();
setInterval(poll, 5000);
