// The cluster page: polls /admin/cluster every 2 s and redraws. No libraries, no CDN.
// The admin key (when the gateway has keys) comes from the URL's #key=... fragment or the
// form, is kept in sessionStorage and sent as a bearer token; it never goes in a URL.
"use strict";

const POLL_MS = 2000;
const COLORS = ["#2f6fde", "#d9480f", "#2b8a3e", "#862e9c", "#e8590c", "#1098ad"];
const SVG_NS = "http://www.w3.org/2000/svg";
const STAGE_COLORS = { queued: "#adb5bd", prefill: "#2f6fde", decode: "#2b8a3e",
                       route: "#862e9c", retry: "#b3261e" };
let timer = null;

function $(id) { return document.getElementById(id); }

function el(tag, attrs, ...children) {
  const node = tag.startsWith("svg:") ? document.createElementNS(SVG_NS, tag.slice(4))
                                      : document.createElement(tag);
  for (const [name, value] of Object.entries(attrs || {})) {
    if (value !== null && value !== undefined) node.setAttribute(name, String(value));
  }
  for (const child of children) {
    node.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  return node;
}

function takeKeyFromFragment() {
  const match = /(?:^|&)key=([^&]*)/.exec(location.hash.slice(1));
  if (match) {
    sessionStorage.setItem("pdserve-admin-key", decodeURIComponent(match[1]));
    history.replaceState(null, "", location.pathname + location.search);
  }
}

function headers() {
  const key = sessionStorage.getItem("pdserve-admin-key");
  return key ? { Authorization: "Bearer " + key } : {};
}

function percent(part, whole) { return whole ? Math.round(100 * part / whole) + "%" : "–"; }
function ms(value) { return value === null || value === undefined ? "–" : value < 1000 ? value.toFixed(0) + " ms" : (value / 1000).toFixed(2) + " s"; }

function setStatus(text, stale) {
  const status = $("status");
  status.textContent = text;
  status.classList.toggle("stale", Boolean(stale));
}

function askForKey(message) {
  $("content").hidden = true;
  $("key-form").hidden = false;
  $("key-error").textContent = message;
  document.body.dataset.state = "needs-key";
  setStatus("an admin key is needed", true);
}

async function poll() {
  try {
    const answer = await fetch("/admin/cluster", { headers: headers(), cache: "no-store",
                                                   signal: AbortSignal.timeout(10000) });
    if (answer.status === 401 || answer.status === 403) {
      const body = await answer.json().catch(() => ({}));
      askForKey((body.error && body.error.message) || "This page needs an admin API key.");
      return;
    }
    if (!answer.ok) throw new Error("HTTP " + answer.status);
    render(await answer.json());
    document.body.dataset.state = "live";
    setStatus("live · updated " + new Date().toLocaleTimeString());
  } catch (error) {
    setStatus("cannot reach the gateway (" + error.message + "); retrying", true);
    if (document.body.dataset.state === "live") document.body.dataset.state = "stale";
  }
  timer = setTimeout(poll, POLL_MS);
}

function render(data) {
  $("key-form").hidden = true;
  $("content").hidden = false;
  $("model").textContent = data.models.join(", ");
  renderWorkers(data.workers);
  const totals = tierTotals(data);
  renderTiers(data, totals);
  const tiers = data.tiers.map(t => t.name);
  renderChart($("attainment-chart"), data, tiers, counts => {
    const done = counts.met + counts.missed + counts.refused + counts.failed;
    return done ? 100 * counts.met / done : null;
  }, 100, "%");
  renderChart($("goodput-chart"), data, tiers, counts => counts.met / data.bucket_s, null, "/s");
  renderRecent(data.recent);
  renderAgent(data.agent_events);
  renderReports(data.agent_reports || []);
}

function renderReports(reports) {
  $("reports-empty").hidden = reports.length > 0;
  $("reports").replaceChildren(...reports.map(r => {
    const cause = r.causes[0];
    const when = new Date(r.at_unix_ms).toLocaleTimeString();
    const what = cause ? `${cause.kind} (${cause.stage}${cause.worker_ids.length ? " on " + cause.worker_ids.join(", ") : ""})`
                       : "no cause found";
    return el("li", { "data-tier": r.tier },
      el("strong", {}, `${r.tier}: ${what}`), ` · ${when}`,
      el("div", { class: "muted" }, r.trigger),
      el("div", {}, cause ? cause.evidence : ""),
      el("div", { class: "muted" }, cause ? cause.action : ""));
  }));
}

function renderWorkers(workers) {
  const body = $("workers").tBodies[0];
  body.replaceChildren(...workers.map(w => {
    const load = w.load || {};
    const used = load.kv_blocks_used || 0, total = load.kv_blocks_total || 0;
    const hostUsed = load.host_blocks_used || 0, hostTotal = load.host_blocks_total || 0;
    const bar = el("span", { class: "bar" }, el("span", { style: null }));
    bar.firstChild.style.width = total ? (100 * used / total).toFixed(1) + "%" : "0";
    return el("tr", { "data-worker-id": w.id },
      el("td", {}, w.id), el("td", {}, w.role || "–"),
      el("td", { class: "state-" + w.state }, w.state), el("td", {}, w.device || "–"),
      el("td", { class: "num" }, load.num_running ?? "–"),
      el("td", { class: "num" }, load.num_waiting ?? "–"),
      el("td", { class: "num" }, load.num_queued_prefill_tokens ?? "–"),
      el("td", {}, bar, total ? `${used} / ${total} blocks (${percent(used, total)})` : "–",
        hostTotal ? ` · host ${hostUsed} / ${hostTotal} (${percent(hostUsed, hostTotal)})` : "",
        load.moe_imbalance ? el("div", { class: "muted" },
          `experts: busiest ${load.moe_imbalance}x the mean (layer ${load.moe_layer}, expert ` +
          `${load.moe_hottest})` + (load.moe_rank_imbalance ? `; busiest rank ` +
          `${load.moe_rank_imbalance}x, ${load.moe_rebalances} switch(es)` : "")) : ""));
  }));
  if (!workers.length) body.append(el("tr", {}, el("td", { colspan: 8 }, "No worker registered.")));
}

function tierTotals(data) {
  const totals = {};
  for (const tier of data.tiers) totals[tier.name] = { met: 0, missed: 0, refused: 0, failed: 0 };
  for (const bucket of data.attainment) {
    for (const [name, counts] of Object.entries(bucket.tiers)) {
      const total = totals[name] || (totals[name] = { met: 0, missed: 0, refused: 0, failed: 0 });
      for (const key of Object.keys(total)) total[key] += counts[key];
    }
  }
  return totals;
}

function renderTiers(data, totals) {
  const minutes = data.window_s / 60;
  $("window").textContent = minutes >= 1 ? `(last ${minutes.toFixed(0)} min)` : `(last ${data.window_s.toFixed(0)} s)`;
  $("tiers").tBodies[0].replaceChildren(...data.tiers.map(t => {
    const c = totals[t.name];
    const done = c.met + c.missed + c.refused + c.failed;
    const goodput = c.met / Math.max(1, data.window_s);  // a young gateway: its uptime
    return el("tr", { "data-tier": t.name },
      el("td", {}, t.name), el("td", {}, `${ms(t.ttft_ms)} / ${ms(t.tpot_ms)}`),
      el("td", { class: "num" }, t.queued), el("td", { class: "num" }, t.running),
      el("td", { class: "num", title: `met ${c.met}, missed ${c.missed}, refused ${c.refused}, failed ${c.failed}` }, done),
      el("td", { class: "num" }, percent(c.met, done)),
      el("td", { class: "num" }, goodput.toFixed(3) + " req/s"));
  }));
}

function renderChart(svg, data, tiers, value, fixedMax, unit) {
  const W = 600, H = 200, left = 40, right = 100, top = 10, bottom = 25;
  const buckets = data.attainment;
  const series = tiers.map(name => buckets.map(b => b.tiers[name] ? value(b.tiers[name]) : null));
  const seen = series.flat().filter(v => v !== null);
  const max = fixedMax || Math.max(1e-9, ...seen) * 1.1;
  const x = i => left + (W - left - right) * (buckets.length > 1 ? i / (buckets.length - 1) : 0);
  const y = v => top + (H - top - bottom) * (1 - v / max);
  const nodes = [];
  for (const fraction of [0, 0.5, 1]) {
    nodes.push(el("svg:line", { class: "grid", x1: left, x2: W - right, y1: y(max * fraction), y2: y(max * fraction) }));
    nodes.push(el("svg:text", { x: 2, y: y(max * fraction) + 4 }, (max * fraction).toFixed(fixedMax ? 0 : 2) + unit));
  }
  const span = buckets.length * data.bucket_s;
  nodes.push(el("svg:text", { x: left, y: H - 6 }, `-${Math.round(span / 60)} min`));
  nodes.push(el("svg:text", { x: W - right - 20, y: H - 6 }, "now"));
  series.forEach((points, index) => {
    const color = COLORS[index % COLORS.length];
    let path = "";
    points.forEach((v, i) => { if (v !== null) path += (path && points[i - 1] !== null ? "L" : "M") + x(i).toFixed(1) + "," + y(v).toFixed(1); });
    if (path) nodes.push(el("svg:path", { d: path, fill: "none", stroke: color, "stroke-width": 2 }));
    points.forEach((v, i) => { if (v !== null) nodes.push(el("svg:circle", { cx: x(i), cy: y(v), r: 2.5, fill: color })); });
    const label = el("svg:text", { x: W - right + 8, y: top + 14 * (index + 1) }, tiers[index]);
    label.style.fill = color;  // CSSOM, not an inline style attribute: the CSP allows it
    nodes.push(label);
  });
  svg.replaceChildren(...nodes);
  svg.dataset.points = String(seen.length);
}

function timeline(record) {
  const end = Math.max(1, ...record.stages.map(s => s[2]));
  const svg = el("svg:svg", { class: "timeline", viewBox: "0 0 200 14" });
  for (const [name, start, stop, detail] of record.stages) {
    const width = Math.max(1.5, 200 * (stop - start) / end);
    const rect = el("svg:rect", { x: 200 * start / end, y: 2, width, height: 10, fill: STAGE_COLORS[name] || "#868e96" });
    rect.append(el("svg:title", {}, `${name}: ${ms(start)} → ${ms(stop)}${detail ? " · " + detail : ""}`));
    svg.append(rect);
  }
  return svg;
}

function renderRecent(recent) {
  $("recent-empty").hidden = recent.length > 0;
  $("recent").tBodies[0].replaceChildren(...recent.map(r => el("tr", { "data-request-id": r.request_id },
    el("td", {}, new Date(r.arrived_unix_ms).toLocaleTimeString()),
    el("td", { title: r.trace_id ? "trace " + r.trace_id : "" }, r.request_id.slice(0, 18)),
    el("td", {}, r.tier), el("td", { class: "outcome-" + r.outcome }, r.outcome + (r.error ? ` (${r.error})` : "")),
    el("td", { class: "num" }, ms(r.ttft_ms)),
    el("td", {}, r.route ? `${r.route}: ${r.workers.join(" → ")}` : "–"),
    el("td", {}, timeline(r)))));
}

function renderAgent(events) {
  $("agent-empty").hidden = events.length > 0;
  $("agent").replaceChildren(...events.map(e => el("li", {}, JSON.stringify(e))));
}

function start() {
  takeKeyFromFragment();
  $("key-form").addEventListener("submit", event => {
    event.preventDefault();
    sessionStorage.setItem("pdserve-admin-key", $("key-input").value.trim());
    $("key-input").value = "";
    clearTimeout(timer);
    poll();
  });
  poll();
}

document.addEventListener("DOMContentLoaded", start);
