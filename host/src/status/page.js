// Kiln's status page: polls /v1/status (the admin or metrics token, from
// the URL's #token=... or typed in once) and draws it. Every number shown
// in a table or tile carries `data-series`, the /metrics sample it is.
"use strict";

const COLORS = ["#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#17becf"];
const STATE_COLORS = { in_use: "#d62728", cached: "#ff7f0e", free: "#2ca02c" };
const plots = {};

function token() {
  const fromHash = new URLSearchParams(location.hash.slice(1)).get("token");
  if (fromHash) return fromHash;
  let t = sessionStorage.getItem("kiln-token");
  if (!t) {
    t = prompt("Admin or metrics token") || "";
    sessionStorage.setItem("kiln-token", t);
  }
  return t;
}

function el(tag, attrs, text) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) e.setAttribute(k, v);
  if (text !== undefined) e.textContent = text;
  return e;
}

// A cell (or tile number) showing one /metrics sample, or 0 without one.
function figure(tag, series) {
  return series ? el(tag, { "data-series": series.key }, String(series.value)) : el(tag, {}, "0");
}

function index(series) {
  const by = {};
  for (const s of series) (by[s.name] ||= []).push(s);
  return by;
}

function find(list, labels) {
  return (list || []).find((s) => Object.entries(labels).every(([k, v]) => s.labels[k] === v));
}

function tiles(by) {
  const box = document.getElementById("tiles");
  box.replaceChildren();
  const add = (title, series, alarm) => {
    const t = el("div", { class: "tile" + (alarm && series && series.value > 0 ? " alarm" : "") });
    t.append(el("div", {}, title), figure("div", series));
    t.lastChild.classList.add("n");
    box.append(t);
  };
  // Each kind of trouble gets a tile, at 0 until it first happens.
  const each = (list, title, fallback) => {
    if (!list || list.length === 0) add(fallback, undefined, true);
    for (const s of list || []) add(title(s), s, true);
  };
  each(by.kiln_kv_integrity_aborts_total, (s) => `integrity aborts (${s.labels.model} pool ${s.labels.pool})`, "integrity aborts");
  each(by.kiln_engine_restarts_total, (s) => `engine restarts (${s.labels.model} pool ${s.labels.pool})`, "engine restarts");
  each(by.kiln_limit_violations_total, (s) => `limit violations: ${s.labels.kind}`, "limit violations");
  add("connections refused", (by.kiln_connections_refused_total || [])[0], true);
}

function poolsTable(by) {
  const table = document.getElementById("pools");
  const head = el("tr");
  for (const h of ["model", "pool", "pages in use", "cached", "free", "requests routed", "preemptions", "integrity aborts"]) head.append(el("th", {}, h));
  table.replaceChildren(head);
  const keys = new Set((by.kiln_kv_pages || []).map((s) => `${s.labels.model}\u0000${s.labels.pool}`));
  for (const key of [...keys].sort()) {
    const [model, pool] = key.split("\u0000");
    const row = el("tr");
    row.append(el("td", {}, model), el("td", {}, pool));
    for (const state of ["in_use", "cached", "free"]) row.append(figure("td", find(by.kiln_kv_pages, { model, pool, state })));
    row.append(figure("td", find(by.kiln_pool_requests_total, { model, pool })));
    row.append(figure("td", find(by.kiln_engine_preemptions_total, { model, pool })));
    row.append(figure("td", find(by.kiln_kv_integrity_aborts_total, { model, pool })));
    table.append(row);
  }
}

function tenantsTable(by) {
  const table = document.getElementById("tenants");
  const head = el("tr");
  for (const h of ["tenant", "model", "prompt tokens", "completion tokens", "prefix hits", "prefix misses", "hit rate", "first tokens", "mean TTFT ms"]) head.append(el("th", {}, h));
  table.replaceChildren(head);
  const keys = new Set((by.kiln_model_tokens_total || []).map((s) => `${s.labels.tenant}\u0000${s.labels.model}`));
  for (const key of [...keys].sort()) {
    const [tenant, model] = key.split("\u0000");
    const row = el("tr");
    row.append(el("td", {}, tenant), el("td", {}, model));
    row.append(figure("td", find(by.kiln_model_tokens_total, { tenant, model, kind: "prompt" })));
    row.append(figure("td", find(by.kiln_model_tokens_total, { tenant, model, kind: "completion" })));
    const hit = find(by.kiln_prefix_cache_tokens_total, { tenant, model, result: "hit" });
    const miss = find(by.kiln_prefix_cache_tokens_total, { tenant, model, result: "miss" });
    row.append(figure("td", hit), figure("td", miss));
    const h = hit ? hit.value : 0, m = miss ? miss.value : 0;
    row.append(el("td", {}, h + m > 0 ? `${((100 * h) / (h + m)).toFixed(1)}%` : "–"));
    const count = find(by.kiln_model_first_token_seconds_count, { tenant, model });
    const sum = find(by.kiln_model_first_token_seconds_sum, { tenant, model });
    row.append(figure("td", count));
    row.append(el("td", {}, count && count.value > 0 ? ((1000 * sum.value) / count.value).toFixed(1) : "–"));
    table.append(row);
  }
}

// Draws (or updates) one plot of named series over the history's times.
function plot(id, t, named, opts) {
  const names = Object.keys(named);
  const sig = names.join("\u0000");
  const data = [t, ...names.map((n) => named[n])];
  const box = document.getElementById(id);
  const have = plots[id];
  if (have && have.sig === sig) {
    have.u.setData(data);
    return;
  }
  if (have) have.u.destroy();
  const series = [{}, ...names.map((n, i) => ({
    label: n,
    stroke: (opts.colors && opts.colors(n)) || COLORS[i % COLORS.length],
    width: 2,
    spanGaps: false,
  }))];
  const u = new uPlot({
    width: Math.max(520, box.clientWidth || 560),
    height: 220,
    series,
    scales: opts.scales || {},
    axes: [{}, { label: opts.unit || "" }],
  }, data, box);
  plots[id] = { u, sig };
}

function plots_(h) {
  const pages = {};
  for (const [model, states] of Object.entries(h.pages || {})) {
    for (const state of ["in_use", "cached", "free"]) {
      if (states[state]) pages[Object.keys(h.pages).length > 1 ? `${model} ${state}` : state] = states[state];
    }
  }
  plot("plot-pages", h.t, pages, { unit: "pages", colors: (n) => STATE_COLORS[n.split(" ").pop()] });
  plot("plot-hits", h.t, { "hit rate": h.hit_rate }, { unit: "fraction", scales: { y: { range: [0, 1] } } });
  plot("plot-completion", h.t, h.completion_tps || {}, { unit: "tokens/s" });
  plot("plot-prompt", h.t, h.prompt_tps || {}, { unit: "tokens/s" });
  plot("plot-ttft", h.t, h.first_token_ms || {}, { unit: "ms" });
}

async function refresh() {
  try {
    const r = await fetch("/v1/status", { headers: { authorization: `Bearer ${token()}` } });
    const body = await r.json();
    if (!r.ok) throw new Error(body.error ? body.error.message : r.statusText);
    document.getElementById("error").textContent = "";
    const by = index(body.series);
    tiles(by);
    poolsTable(by);
    tenantsTable(by);
    plots_(body.history);
    document.getElementById("meta").textContent =
      `updated ${new Date().toLocaleTimeString()}; a point every ${body.interval_s} s over the last ${Math.round(body.history.t.length * body.interval_s)} s`;
    document.body.setAttribute("data-loaded", "true");
  } catch (e) {
    document.getElementById("error").textContent = `cannot read /v1/status: ${e.message}`;
    if (!location.hash.includes("token=")) sessionStorage.removeItem("kiln-token");
  }
}

document.addEventListener("DOMContentLoaded", () => {
  refresh();
  setInterval(refresh, 2000);
});
