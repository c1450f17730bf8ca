// modelyard's status page: polls /ui/api/status, follows /ui/api/events, and loads / unloads models
// through /admin/models/{load,unload}. No framework, no build step; talks to this router only.
"use strict";

const POLL_MS = 2000;
const MAX_EVENTS = 200;
const COLORS = ["#0969da", "#cf222e", "#1a7f37", "#9a6700", "#8250df", "#bf3989", "#1b7c83", "#57606a"];

const $ = (sel) => document.querySelector(sel);
const keys = {
  get api() { return sessionStorage.getItem("modelyard.api_key") || ""; },
  get admin() { return sessionStorage.getItem("modelyard.admin_key") || ""; },
};
let clockSkew = 0;          // server time - browser time, s
let lastStatus = null;
let pollTimer = null;
let eventsAbort = null;
let colorOf = {};

function el(tag, attrs, ...kids) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v === null || v === undefined) continue;
    if (k === "class") e.className = v; else if (k === "text") e.textContent = v; else e.setAttribute(k, v);
  }
  for (const k of kids) if (k !== null && k !== undefined) e.append(k);
  return e;
}

function authHeaders(admin) {
  const key = admin ? (keys.admin || keys.api) : keys.api;
  return key ? { "Authorization": "Bearer " + key } : {};
}

function size(n) {
  if (n === null || n === undefined) return "–";
  const units = ["B", "KiB", "MiB", "GiB"];
  let v = n, i = 0;
  while (v >= 1024 && i < units.length - 1) { v /= 1024; i++; }
  return i === 0 ? `${v} B` : `${v.toFixed(1)} ${units[i]}`;
}

function dur(s) {
  s = Math.max(0, Math.round(s));
  if (s < 60) return `${s}s`;
  if (s < 3600) return `${Math.floor(s / 60)}m${String(s % 60).padStart(2, "0")}s`;
  return `${Math.floor(s / 3600)}h${String(Math.floor(s % 3600 / 60)).padStart(2, "0")}m`;
}

function serverNow() { return Date.now() / 1000 + clockSkew; }

function hhmmss(t) { return new Date(t * 1000).toLocaleTimeString([], { hour12: false }); }

function setConn(state, text) { const c = $("#conn"); c.dataset.state = state; c.textContent = text; }

function showKeys(why) {
  $("#keys").hidden = false;
  if (why) $("#keys-why").textContent = why;
}

function message(text, isError) {
  const m = $("#action-msg");
  m.textContent = text;
  m.classList.toggle("error", !!isError);
}

async function errorText(resp) {
  try { const j = await resp.json(); return (j.error && j.error.message) || JSON.stringify(j); }
  catch (e) { return `HTTP ${resp.status}`; }
}

// ------------------------------------------------------------------------------------- status poll

let polling = false, pollAgain = false;

async function poll() {
  if (polling) { pollAgain = true; return; }  // one poll at a time; one more after it
  polling = true;
  clearTimeout(pollTimer);
  try {
    const resp = await fetch("/ui/api/status", { headers: authHeaders(false), cache: "no-store" });
    if (resp.status === 401) {
      setConn("error", "API key needed");
      showKeys("This service needs its API key to show anything.");
      $("#main").hidden = true;
      polling = false;
      return;  // polling resumes when a key is given
    }
    if (!resp.ok) throw new Error(await errorText(resp));
    const data = await resp.json();
    $("#main").hidden = false;
    clockSkew = data.now - Date.now() / 1000;
    lastStatus = data;  // renderModels reads its invalid list
    render(data);
    setConn("live", "live");
    if (!eventsAbort) followEvents();
  } catch (e) {
    setConn("error", "cannot reach the router");
  }
  polling = false;
  if (pollAgain) { pollAgain = false; poll(); return; }
  pollTimer = setTimeout(poll, POLL_MS);
}

function render(data) {
  $("#version").textContent = "v" + data.server.version;
  data.models.forEach((m, i) => { if (!(m.id in colorOf)) colorOf[m.id] = COLORS[Object.keys(colorOf).length % COLORS.length]; });
  renderModels(data.models);
  renderRequests(data.requests);
  renderPlots(data.history);
}

function expiry(m) {
  if (m.expires_at !== null && m.expires_at !== undefined) return "in " + dur(m.expires_at - serverNow());
  if (m.state !== "ready") return "–";
  if (!m.idle_ttl_s || (m.placement && m.placement.pinned)) return "never";
  return "busy";
}

function renderModels(models) {
  const body = $("#models tbody");
  const rows = [];
  for (const m of models) {
    const g = m.gguf || {};
    const facts = [g.architecture, g.parameters_text, g.quantization, g.context_length ? `ctx ${g.context_length}` : null,
      size(g.file_size)].filter(Boolean).join(" · ");
    const file = el("td", { class: "file" }, m.file, el("br"),
      g.valid === false ? el("span", { class: "invalid", text: "invalid: " + g.reason }) : facts);
    const loaded = ["loading", "ready", "unresponsive", "draining"].includes(m.state);
    const btn = el("button", { type: "button", "data-action": loaded ? "unload" : "load", "data-model": m.id,
      text: loaded ? "Unload" : "Load" });
    if (m.state === "loading" || m.state === "draining") btn.disabled = true;
    btn.addEventListener("click", () => act(btn.dataset.action, m.id, btn));
    rows.push(el("tr", { "data-model": m.id },
      el("td", {}, el("strong", { text: m.id }),
        m.aliases && m.aliases.length ? el("div", { class: "aliases", text: m.aliases.join(", ") }) : null),
      el("td", {}, el("span", { class: "state", "data-state": m.state, "data-field": "state", text: m.state }),
        m.condition !== m.state ? el("div", { class: "cond", text: m.condition }) : null,
        m.last_error ? el("div", { class: "cond", title: m.last_error, text: "last error: " + m.last_error.slice(0, 60) }) : null),
      el("td", { "data-field": "memory", text: size(m.rss_bytes) }),
      el("td", { "data-field": "slots", text: `${m.slots_busy}/${m.slots_total}` }),
      el("td", { "data-field": "queue", text: `${m.queue_depth}/${m.max_queue}` }),
      el("td", { "data-field": "load_time", text: m.load_ms !== null ? (m.load_ms / 1000).toFixed(2) + " s" : "–" }),
      el("td", { text: loaded && m.loaded_at ? dur(serverNow() - m.loaded_at) + " ago" : "–" }),
      el("td", { "data-field": "expiry", text: expiry(m) }),
      file,
      el("td", {}, btn)));
    for (const r of m.replicas || []) {  // replicas = N: each one's node, state, slots, queue, load
      rows.push(el("tr", { "data-model": m.id, "data-replica": String(r.replica), class: "replica-row" },
        el("td", { class: "cond", text: `↳ replica ${r.replica}` + (r.node ? ` on ${r.node}` : "") }),
        el("td", {}, el("span", { class: "state", "data-state": r.state, "data-field": "state", text: r.state }),
          r.condition !== r.state ? el("div", { class: "cond", text: r.condition }) : null),
        el("td", { text: "–" }),
        el("td", { "data-field": "slots", text: `${r.slots_busy}/${r.slots_total}` }),
        el("td", { "data-field": "queue", text: String(r.queue_depth) }),
        el("td", { colspan: "3", class: "cond", text: `load ${r.load} · ${r.prefix_blocks} cached blocks` +
          (r.pid ? ` · pid ${r.pid}` : "") }),
        el("td", {}), el("td", {})));
    }
  }
  for (const p of lastStatus && lastStatus.presets ? lastStatus.presets : []) {  // a preset: its model's worker
    const sets = Object.entries(p.sampling).map(([k, v]) => `${k}=${v}`);
    if (p.n_predict > 0) sets.push(`n_predict=${p.n_predict}`);
    if (p.system_prompt) sets.push("system prompt");
    rows.push(el("tr", { "data-model": p.id, class: "preset-row" },
      el("td", {}, el("strong", { text: p.id }),
        p.aliases.length ? el("div", { class: "aliases", text: p.aliases.join(", ") }) : null),
      el("td", {}, el("span", { class: "state", "data-state": p.state, text: p.state || "–" })),
      el("td", { colspan: "6", class: "cond", text: `preset of ${p.model} (its one worker)` }),
      el("td", { class: "file", text: sets.join(" · ") || "no defaults of its own" }),
      el("td", {})));
  }
  for (const bad of lastStatus && lastStatus.invalid ? lastStatus.invalid : []) {  // found in models_dir, not served
    rows.push(el("tr", { "data-model": bad.id, class: "invalid-row" },
      el("td", {}, el("strong", { text: bad.id })),
      el("td", {}, el("span", { class: "state", "data-state": "failed", "data-field": "state", text: "invalid" })),
      el("td", { colspan: "6", class: "cond", text: "found in models_dir; not served" }),
      el("td", { class: "file" }, bad.file, el("br"), el("span", { class: "invalid", text: "invalid: " + bad.reason })),
      el("td", {})));
  }
  body.replaceChildren(...rows);
}

function renderRequests(reqs) {
  const rows = reqs.slice(0, 50).map((r) => el("tr", {},
    el("td", { text: hhmmss(r.at) }),
    el("td", { text: `${r.method} ${r.route}` }),
    el("td", { text: r.model || "–" }),
    el("td", { class: "status-" + String(r.status)[0], text: String(r.status) }),
    el("td", { text: r.completion_tokens !== null && r.completion_tokens !== undefined
      ? `${r.prompt_tokens ?? "–"} → ${r.completion_tokens}` : "–" }),
    el("td", { text: r.ttft_ms !== null && r.ttft_ms !== undefined ? r.ttft_ms.toFixed(0) + " ms" : "–" }),
    el("td", { text: r.duration_ms.toFixed(0) + " ms" })));
  $("#requests tbody").replaceChildren(...rows);
}

// ------------------------------------------------------------------------------------------- plots

const SVGNS = "http://www.w3.org/2000/svg";

function renderPlots(hist) {
  const n = hist.t.length;
  $("#plots-note").textContent = n ? `(every ${hist.interval_s} s, ${dur(hist.t[n - 1] - hist.t[0])})` : "";
  for (const key of ["tok_s", "ttft_ms", "queue"]) {
    const svg = document.getElementById("plot-" + key);
    let max = 0;
    for (const s of Object.values(hist.models)) for (const v of s[key]) if (v !== null && v > max) max = v;
    const top = max > 0 ? max * 1.1 : 1;
    const kids = [];
    for (const [model, s] of Object.entries(hist.models)) {
      const pts = [];
      s[key].forEach((v, i) => {
        if (v === null) return;
        const x = n > 1 ? (i / (n - 1)) * 300 : 300;
        pts.push(`${x.toFixed(1)},${(88 - (v / top) * 84).toFixed(1)}`);
      });
      if (!pts.length) continue;
      const line = document.createElementNS(SVGNS, "polyline");
      line.setAttribute("points", pts.join(" "));
      line.setAttribute("fill", "none");
      line.setAttribute("stroke", colorOf[model] || "#57606a");
      line.setAttribute("stroke-width", "1.5");
      line.setAttribute("vector-effect", "non-scaling-stroke");
      line.setAttribute("data-model", model);
      kids.push(line);
    }
    const label = document.createElementNS(SVGNS, "text");
    label.setAttribute("x", "3"); label.setAttribute("y", "11"); label.setAttribute("font-size", "10");
    label.setAttribute("fill", "#68717c");
    label.textContent = "max " + (max >= 100 ? max.toFixed(0) : max.toFixed(max ? 1 : 0));
    kids.push(label);
    svg.replaceChildren(...kids);
  }
  const legend = Object.keys(hist.models).map((m) => {
    const sw = el("i"); sw.style.background = colorOf[m] || "#57606a";
    return el("span", {}, sw, m);
  });
  $("#legend").replaceChildren(...legend);
}

// ------------------------------------------------------------------------------------------ events

function addEvent(ev) {
  const list = $("#events");
  const skip = new Set(["seq", "at", "model", "event"]);
  const fields = Object.entries(ev).filter(([k, v]) => !skip.has(k) && v !== null)
    .map(([k, v]) => `${k}=${typeof v === "object" ? JSON.stringify(v)
      : typeof v === "number" && !Number.isInteger(v) ? v.toFixed(1) : v}`).join(" ");
  const li = el("li", { "data-event": ev.event, "data-model": ev.model },
    el("span", { class: "t", text: hhmmss(ev.at) + " " }), el("span", { class: "k", text: `${ev.model} ${ev.event}` }),
    " " + fields);
  list.prepend(li);
  while (list.children.length > MAX_EVENTS) list.lastElementChild.remove();
}

async function followEvents() {
  const ctl = new AbortController();
  eventsAbort = ctl;
  $("#events-state").textContent = "(live)";
  try {
    const resp = await fetch("/ui/api/events?recent=50", { headers: authHeaders(false), signal: ctl.signal });
    if (!resp.ok) throw new Error(await errorText(resp));
    const reader = resp.body.getReader();
    const dec = new TextDecoder();
    let buf = "";
    $("#events").replaceChildren();
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buf += dec.decode(value, { stream: true });
      let cut;
      while ((cut = buf.indexOf("\n\n")) >= 0) {
        const block = buf.slice(0, cut);
        buf = buf.slice(cut + 2);
        for (const line of block.split("\n")) {
          if (!line.startsWith("data:")) continue;
          const ev = JSON.parse(line.slice(5));
          addEvent(ev);
          if (ev.event === "state" || ev.event === "ready") poll();  // the table follows at once
        }
      }
    }
  } catch (e) {
    if (ctl.signal.aborted) return;
  }
  $("#events-state").textContent = "(reconnecting…)";
  eventsAbort = null;
  setTimeout(() => { if (!eventsAbort) followEvents(); }, 2000);
}

// ----------------------------------------------------------------------------------- load / unload

async function act(action, model, btn) {
  btn.disabled = true;
  message(`${action === "load" ? "loading" : "unloading"} ${model}…`);
  try {
    const resp = await fetch(`/admin/models/${action}`, {
      method: "POST", headers: { "Content-Type": "application/json", ...authHeaders(true) },
      body: JSON.stringify({ model }),
    });
    if (resp.status === 401 || resp.status === 403) {
      const why = await errorText(resp);
      message(`${action} ${model}: ${why}`, true);
      showKeys(`${action} needs the admin key (or the API key when the service has no admin key).`);
      return;
    }
    if (!resp.ok) { message(`${action} ${model}: ${await errorText(resp)}`, true); return; }
    const j = await resp.json();
    message(action === "load" ? `${model} ready (loaded in ${((j.load_ms || 0) / 1000).toFixed(2)} s)`
      : `${model} unloaded`);
  } catch (e) {
    message(`${action} ${model}: cannot reach the router`, true);
  } finally {
    btn.disabled = false;
    poll();
  }
}

// -------------------------------------------------------------------------------------------- keys

function initKeys() {
  $("#api-key").value = keys.api;
  $("#admin-key").value = keys.admin;
  $("#keys-toggle").addEventListener("click", () => { $("#keys").hidden = !$("#keys").hidden; });
  $("#keys-save").addEventListener("click", () => {
    sessionStorage.setItem("modelyard.api_key", $("#api-key").value.trim());
    sessionStorage.setItem("modelyard.admin_key", $("#admin-key").value.trim());
    if (eventsAbort) { eventsAbort.abort(); eventsAbort = null; }
    poll();
  });
  $("#keys-forget").addEventListener("click", () => {
    sessionStorage.removeItem("modelyard.api_key");
    sessionStorage.removeItem("modelyard.admin_key");
    $("#api-key").value = ""; $("#admin-key").value = "";
    if (eventsAbort) { eventsAbort.abort(); eventsAbort = null; }
    poll();
  });
}

initKeys();
poll();
setInterval(() => {  // the countdowns tick between polls
  if (!lastStatus) return;
  for (const m of lastStatus.models) {
    const cell = document.querySelector(`tr[data-model="${CSS.escape(m.id)}"] [data-field="expiry"]`);
    if (cell) cell.textContent = expiry(m);
  }
}, 1000);
