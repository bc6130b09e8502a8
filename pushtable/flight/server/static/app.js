// pushtable serve's live view: tables with rates and queue fill (polled every second), and a
// live SQL query whose rows arrive as newline-delimited JSON over one streaming fetch.
"use strict";
const KEEP = 1000;
const $ = (id) => document.getElementById(id);
const tokenBox = $("token");
tokenBox.value = sessionStorage.getItem("pushtable-token") || "";
tokenBox.addEventListener("change", () => sessionStorage.setItem("pushtable-token", tokenBox.value));
const headers = () => (tokenBox.value ? { Authorization: "Bearer " + tokenBox.value } : {});

// --- tables ------------------------------------------------------------------------------
const lastSeen = new Map(); // name -> [time ms, rows]
function cell(text, cls) {
  const td = document.createElement("td");
  td.textContent = text;
  if (cls) td.className = cls;
  return td;
}
async function refreshTables() {
  const status = $("tables-status");
  try {
    const reply = await fetch("/api/tables", { headers: headers(), cache: "no-store" });
    const body = await reply.json();
    if (!reply.ok) throw new Error(body.error || reply.statusText);
    const tbody = $("tables").querySelector("tbody");
    tbody.replaceChildren();
    const now = Date.now();
    for (const t of body) {
      const s = t.stats;
      const rows = s.rows ?? s.rows_written ?? 0;
      const prev = lastSeen.get(t.name);
      const rate = prev ? ((rows - prev[1]) * 1000) / Math.max(1, now - prev[0]) : 0;
      lastSeen.set(t.name, [now, rows]);
      const queued = s.queued_batches ?? 0;
      const capacity = t.bound_batches || 0;
      const byBytes = t.bound_bytes ? (s.queued_bytes ?? 0) / t.bound_bytes : 0;
      const fill = Math.min(1, Math.max(capacity ? queued / capacity : 0, byBytes));
      const tr = document.createElement("tr");
      tr.dataset.table = t.name;
      tr.append(
        cell(t.name), cell(t.topic ? "topic" : "table"),
        cell(rows.toLocaleString(), "num"), cell(Math.round(rate).toLocaleString(), "num"),
        cell((s.batches ?? 0).toLocaleString(), "num"),
        cell(capacity ? `${queued} / ${capacity}` : String(queued), "num"),
      );
      const bar = document.createElement("td");
      bar.innerHTML = `<span class="fill"><span style="width:${(fill * 100).toFixed(0)}%"></span></span>`;
      tr.append(bar, cell(String(s.waiting_writers ?? 0), "num"), cell(t.columns.join(", ")));
      tbody.append(tr);
    }
    status.textContent = `${body.length} table(s) and topic(s), updated ${new Date().toLocaleTimeString()}`;
    status.classList.remove("error");
  } catch (err) {
    status.textContent = "tables: " + err.message;
    status.classList.add("error");
  }
}
setInterval(refreshTables, 1000);
refreshTables();

// --- live query --------------------------------------------------------------------------
let running = null; // AbortController of the query being read
let columns = [], types = [], kept = [], received = 0;
// An updating aggregate's key columns (its changes replace rows in place), or null.
let upsertKey = null;
const rowsByKey = new Map(); // key text -> <tr> of the grid, in upsert mode
const valuesByKey = new Map(); // key text -> the row's values, for the chart
const numeric = (t) => /^(u?int|float|double|decimal)/.test(t);

const textual = (t) => /^(string|large_string|utf8|large_utf8|string_view|dictionary<.*, (string|utf8))/.test(t);
const temporal = (t) => /^(timestamp|date|time)/.test(t);
// A number as a person reads it: integers as they are (ids, years), fractions to 4 decimals.
const number = (v) => (Number.isInteger(v) ? String(v) : v.toLocaleString(undefined, { maximumFractionDigits: 4 }));

function fillRow(tr, r) {
  tr.replaceChildren();
  for (const v of r) tr.append(cell(v === null ? "∅" : typeof v === "number" ? number(v) : String(v), typeof v === "number" ? "num" : ""));
}

// Upsert mode: a change replaces the row of its key where it stands (and flashes it).
function upsertGrid(newRows) {
  const tbody = $("grid").querySelector("tbody");
  for (const r of newRows) {
    const key = JSON.stringify(upsertKey.map((i) => r[i]));
    let tr = rowsByKey.get(key);
    if (!tr) {
      tr = document.createElement("tr");
      rowsByKey.set(key, tr);
      tbody.append(tr);
    }
    fillRow(tr, r);
    tr.classList.remove("changed");
    void tr.offsetWidth; // restart the flash
    tr.classList.add("changed");
    valuesByKey.set(key, r);
  }
  kept = Array.from(valuesByKey.values()).slice(-KEEP);
}

function drawGrid(newRows) {
  const tbody = $("grid").querySelector("tbody");
  if (upsertKey) { upsertGrid(newRows); return; }
  for (const r of newRows) {
    const tr = document.createElement("tr");
    fillRow(tr, r);
    tbody.append(tr);
  }
  while (tbody.rows.length > KEEP) tbody.deleteRow(0);
  const wrap = $("grid-wrap");
  wrap.scrollTop = wrap.scrollHeight;
}

const MAX_SERIES = 24;
let chartPending = false;
// One line per group key (the non-time text columns, e.g. `level` of GROUP BY second, level)
// and numeric column, against the first column.
function drawChart() {
  if (chartPending) return;
  chartPending = true;
  requestAnimationFrame(() => {
    chartPending = false;
    const ys = columns.map((c, i) => i).filter((i) => i > 0 && numeric(types[i]));
    if (!ys.length) {
      $("chart-note").textContent = "(a line per numeric column and group against the first column)";
      return;
    }
    const keys = columns.map((c, i) => i).filter((i) => i > 0 && textual(types[i]) && !temporal(types[i]));
    const groups = new Map();
    for (const r of kept) {
      const key = keys.map((i) => (r[i] === null ? "∅" : String(r[i]))).join(" / ");
      if (!groups.has(key)) groups.set(key, []);
      groups.get(key).push(r);
    }
    const traces = [];
    for (const [key, rs] of groups) {
      for (const i of ys) {
        if (traces.length >= MAX_SERIES) break;
        const name = !keys.length ? columns[i] : ys.length > 1 ? `${key} · ${columns[i]}` : key;
        // Categories on the x axis (GROUP BY level) read as bars; times and numbers as lines.
        const shape = textual(types[0]) ? { type: "bar" } : { mode: "lines+markers", type: "scatter" };
        traces.push({ x: rs.map((r) => r[0]), y: rs.map((r) => r[i]), name, ...shape, hovertemplate: "%{x}<br>%{y:,.4~f}<extra>%{fullData.name}</extra>" });
      }
    }
    const by = keys.length ? ` per ${keys.map((i) => columns[i]).join(", ")}` : "";
    const more = groups.size * ys.length > MAX_SERIES ? ` (first ${MAX_SERIES} lines)` : "";
    $("chart-note").textContent = `(${ys.map((i) => columns[i]).join(", ")}${by} by ${columns[0]}${more})`;
    const layout = {
      margin: { t: 10, r: 16, b: 10, l: 10 },
      xaxis: { automargin: true },
      yaxis: { automargin: true, tickformat: ",.4~f" },
      legend: { orientation: "h", y: -0.25 },
    };
    Plotly.react("chart", traces, layout, { displaylogo: false, responsive: true });
  });
}

function setStatus(text, isError) {
  $("status").textContent = text;
  $("status").classList.toggle("error", !!isError);
}

async function run() {
  stop();
  const controller = new AbortController();
  running = controller;
  $("run").disabled = true;
  $("stop").disabled = false;
  columns = []; types = []; kept = []; received = 0;
  upsertKey = null; rowsByKey.clear(); valuesByKey.clear();
  $("grid").querySelector("thead").replaceChildren();
  $("grid").querySelector("tbody").replaceChildren();
  Plotly.purge("chart");
  const started = performance.now();
  let first = null;
  setStatus("running…");
  try {
    const reply = await fetch("/api/query", { method: "POST", headers: headers(), body: $("sql").value, signal: controller.signal });
    const reader = reply.body.getReader();
    const decoder = new TextDecoder();
    let buffer = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buffer += decoder.decode(value, { stream: true });
      let at;
      while ((at = buffer.indexOf("\n")) >= 0) {
        const msg = JSON.parse(buffer.slice(0, at));
        buffer = buffer.slice(at + 1);
        if (msg.error) { setStatus(msg.error, true); return; }
        if (msg.columns) {
          columns = msg.columns; types = msg.types;
          upsertKey = msg.key || null;
          const tr = document.createElement("tr");
          for (const c of columns) { const th = document.createElement("th"); th.textContent = c; tr.append(th); }
          $("grid").querySelector("thead").replaceChildren(tr);
        }
        if (msg.rows) {
          if (first === null) first = performance.now() - started;
          received += msg.rows.length;
          if (!upsertKey) kept = kept.concat(msg.rows).slice(-KEEP);
          drawGrid(msg.rows);
          drawChart();
          const groups = upsertKey ? `, ${rowsByKey.size.toLocaleString()} group(s) updated in place` : "";
          setStatus(`${received.toLocaleString()} row(s) so far${groups}; first after ${first.toFixed(0)} ms`);
        }
        if (msg.end) { setStatus(`${received.toLocaleString()} row(s); the query ended`); }
      }
    }
  } catch (err) {
    if (err.name !== "AbortError") setStatus(err.message, true);
  } finally {
    if (running === controller) { running = null; $("run").disabled = false; $("stop").disabled = true; }
  }
}

function stop() {
  if (running) { running.abort(); running = null; setStatus(`stopped after ${received.toLocaleString()} row(s)`); }
  $("run").disabled = false;
  $("stop").disabled = true;
}

$("run").addEventListener("click", run);
$("stop").addEventListener("click", stop);
