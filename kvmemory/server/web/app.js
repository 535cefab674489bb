// The kvmemory page: documents (upload, deposit progress, list, delete), ask (streamed answer,
// passages, figures) and chat (a session, optionally a user's memory). Plain ES module, no build.

const $ = (sel) => document.querySelector(sel);
const KEY = "kvmemory-api-key";
let model = "kvmemory";

// ---------------------------------------------------------------- errors and the API key
export class ApiError extends Error {
  constructor(status, body, retryAfter) {
    const e = (body && body.error) || {};
    super(e.message || `HTTP ${status}`);
    this.status = status; this.param = e.param; this.code = e.code; this.retryAfter = retryAfter;
  }
}

function readable(err) {
  if (!(err instanceof ApiError)) return `Could not reach the server: ${err.message}`;
  switch (err.status) {
    case 401: return "The server needs a valid API key. " + err.message;
    case 413: return "Too large for this server: " + err.message;
    case 429: return "The server is busy" + (err.retryAfter ? `; try again in ${err.retryAfter} s` : "; try again shortly") +
                     ". " + err.message;
    case 400: case 422: return (err.param ? `${err.param}: ` : "") + err.message;
    case 404: return "Not found: " + err.message;
    case 409: return "Conflict: " + err.message;
    default: return `Error ${err.status}: ${err.message}`;
  }
}

export function showError(err) {
  const box = $("#error");
  box.textContent = typeof err === "string" ? err : readable(err);
  box.hidden = false;
  if (err instanceof ApiError && err.status === 401) askForKey();
}

function clearError() { $("#error").hidden = true; $("#error").textContent = ""; }

function askForKey() {
  const d = $("#key-dialog");
  if (!d.open) { $("#key-input").value = ""; d.showModal(); $("#key-input").focus(); }
}

function headers(extra = {}) {
  const key = sessionStorage.getItem(KEY);
  return key ? { ...extra, Authorization: `Bearer ${key}` } : extra;
}

async function api(path, opts = {}) {
  const r = await fetch(path, { ...opts, headers: headers(opts.headers || {}) });
  if (!r.ok) {
    let body = null;
    try { body = await r.json(); } catch (_) { /* not JSON */ }
    throw new ApiError(r.status, body, r.headers.get("retry-after"));
  }
  return r;
}

const postJSON = (path, body) =>
  api(path, { method: "POST", headers: { "Content-Type": "application/json" }, body: JSON.stringify(body) });

// ---------------------------------------------------------------- documents
const fmt = (n) => (n == null ? "–" : Number(n).toLocaleString("en-US"));
function bytes(n) {
  if (n == null) return "–";
  const u = ["B", "KB", "MB", "GB", "TB"]; let i = 0;
  while (n >= 1000 && i < u.length - 1) { n /= 1000; i++; }
  return `${n.toFixed(n < 10 && i ? 1 : 0)} ${u[i]}`;
}

async function loadDocuments() {
  const r = await api("/v1/documents");
  const { data } = await r.json();
  const body = $("#doc-list");
  body.replaceChildren();
  for (const d of data) {
    const tr = document.createElement("tr");
    tr.dataset.docId = d.doc_id;
    const cells = [d.doc_id, fmt(d.n_tokens), fmt(d.blocks), bytes(d.kv_bytes), new Date(d.created * 1000).toLocaleString()];
    cells.forEach((v, i) => {
      const td = document.createElement("td");
      td.textContent = v;
      if (i >= 1 && i <= 3) td.className = "num";
      tr.append(td);
    });
    const td = document.createElement("td");
    const b = document.createElement("button");
    b.type = "button"; b.className = "quiet delete"; b.textContent = "Delete";
    b.setAttribute("aria-label", `Delete ${d.doc_id}`);
    b.addEventListener("click", () => deleteDocument(d.doc_id, b));
    td.append(b); tr.append(td); body.append(tr);
  }
  $("#no-docs").hidden = data.length > 0;
}

async function deleteDocument(docId, button) {
  if (!confirm(`Delete ${docId}? Its KV stays on disk until \`kvmemory gc\`.`)) return;
  button.disabled = true;
  try { await api(`/v1/documents/${encodeURIComponent(docId)}`, { method: "DELETE" }); clearError(); }
  catch (e) { showError(e); }
  finally { button.disabled = false; await loadDocuments().catch(showError); }
}

function jobRow(name) {
  const li = document.createElement("li");
  const label = document.createElement("span"); label.textContent = name;
  const bar = document.createElement("progress"); bar.max = 1; bar.value = 0;
  bar.setAttribute("aria-label", `deposit of ${name}`);
  const text = document.createElement("span"); text.className = "job-status"; text.textContent = "uploading…";
  li.append(label, bar, text); $("#jobs").append(li);
  return { li, bar, text };
}

export function progressText(p, seconds) {
  const done = p.tokens_done || 0, total = p.tokens_total;
  const rate = seconds > 0 ? done / seconds : 0;
  let s = total ? `${fmt(done)} / ${fmt(total)} tokens` : `${fmt(done)} tokens`;
  if (rate > 0) s += `, ${fmt(Math.round(rate))} tok/s`;
  if (rate > 0 && total) s += `, ~${Math.max(0, Math.ceil((total - done) / rate))} s left`;
  return s;
}

async function upload(file) {
  const row = jobRow(file.name);
  const form = new FormData();
  form.append("file", file, file.name);
  let job;
  try {
    job = await (await api("/v1/documents", { method: "POST", body: form })).json();
  } catch (e) {
    row.text.textContent = "failed"; row.text.classList.add("failed"); showError(e); return;
  }
  clearError();
  const started = performance.now();
  for (;;) {
    let j;
    try { j = await (await api(`/v1/jobs/${encodeURIComponent(job.job_id)}`)).json(); }
    catch (e) { showError(e); return; }
    const p = j.progress;
    if (p.tokens_total) { row.bar.max = p.tokens_total; row.bar.value = p.tokens_done; }
    row.text.textContent = progressText(p, (performance.now() - started) / 1000);
    if (j.status === "done") {
      row.bar.max = 1; row.bar.value = 1;
      row.text.textContent = `done: ${fmt(p.tokens_total)} tokens`;
      row.li.classList.add("done");
      break;
    }
    if (j.status === "failed") {
      row.text.textContent = `failed: ${j.error}`; row.text.classList.add("failed");
      showError(`The deposit of ${file.name} failed: ${j.error}`);
      break;
    }
    await new Promise((ok) => setTimeout(ok, 300));
  }
  await loadDocuments().catch(showError);
}

function wireDocuments() {
  const drop = $("#drop"), input = $("#file-input");
  const take = (files) => { for (const f of files) upload(f); };
  input.addEventListener("change", () => { take(input.files); input.value = ""; });
  drop.addEventListener("dragover", (e) => { e.preventDefault(); drop.classList.add("over"); });
  drop.addEventListener("dragleave", () => drop.classList.remove("over"));
  drop.addEventListener("drop", (e) => { e.preventDefault(); drop.classList.remove("over"); take(e.dataTransfer.files); });
  drop.addEventListener("keydown", (e) => { if (e.key === "Enter" || e.key === " ") { e.preventDefault(); input.click(); } });
}

// ---------------------------------------------------------------- server-sent events over fetch
export async function* events(response) {
  const reader = response.body.getReader();
  const dec = new TextDecoder();
  let buf = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buf += dec.decode(value, { stream: true });
    let i;
    while ((i = buf.indexOf("\n\n")) >= 0) {
      const chunk = buf.slice(0, i); buf = buf.slice(i + 2);
      const data = chunk.split("\n").filter((l) => l.startsWith("data: ")).map((l) => l.slice(6)).join("\n");
      if (!data) continue;
      if (data === "[DONE]") return;
      yield JSON.parse(data);
    }
  }
}

// ---------------------------------------------------------------- ask
function showPassages(sources) {
  const ol = $("#passages");
  ol.replaceChildren();
  for (const s of sources) {
    const li = document.createElement("li");
    const h = document.createElement("div");
    h.className = "source";
    h.textContent = `${s.doc_id}, tokens ${fmt(s.start_token)}–${fmt(s.end_token)}` +
      (s.score ? ` (score ${s.score.toFixed(3)})` : "");
    const pre = document.createElement("div"); pre.className = "passage"; pre.textContent = s.text;
    li.append(h, pre); ol.append(li);
  }
}

export function askFigures(st) {
  const restored = st.tokens_restored, prefilled = st.tokens_prefilled;
  const ttft = st.timings_s && st.timings_s.ttft;
  return `${fmt(restored)} tokens restored, ${fmt(prefilled)} prefilled` +
    (ttft != null ? `; first token after ${(ttft * 1000).toFixed(0)} ms` : "") +
    `; re-reading these passages would have prefilled ${fmt(restored + prefilled)} tokens`;
}

function wireAsk() {
  $("#ask-form").addEventListener("submit", async (e) => {
    e.preventDefault();
    const q = $("#question").value.trim();
    if (!q) return;
    const button = $("#ask-button");
    button.disabled = true;
    $("#answer").textContent = ""; $("#ask-figures").textContent = "asking…"; $("#passages").replaceChildren();
    try {
      const r = await postJSON("/v1/ask", { question: q, stream: true });
      clearError();
      for await (const ev of events(r)) {
        if (ev.type === "delta") $("#answer").textContent += ev.text;
        else if (ev.type === "final") {
          $("#answer").textContent = ev.answer;
          showPassages(ev.sources);
          $("#ask-figures").textContent = askFigures(ev.stats);
        } else if (ev.error) {
          throw new ApiError(ev.error.status || 500, ev);
        }
      }
    } catch (err) { $("#ask-figures").textContent = ""; showError(err); }
    finally { button.disabled = false; }
  });
}

// ---------------------------------------------------------------- chat
const history = [];
function newSession() {
  history.length = 0;
  $("#turns").replaceChildren();
  $("#chat-session").value = "web-" + Math.random().toString(36).slice(2, 10);
}

export function chatFigures(c) {
  const u = c.usage || {};
  const cached = (u.prompt_tokens_details && u.prompt_tokens_details.cached_tokens) || 0;
  let s = `${fmt(cached)} of ${fmt(u.prompt_tokens)} prompt tokens restored`;
  const m = c.kvmemory;
  if (m && m.recalled) {
    s += m.recalled.length ? `; recalled ${m.recalled.length} earlier turn${m.recalled.length > 1 ? "s" : ""} ` +
      `(${fmt(m.tokens_grafted)} tokens grafted as KV)` : "; nothing recalled from memory";
  }
  return s;
}

function addTurn(role, text) {
  const li = document.createElement("li");
  li.className = role;
  li.textContent = (role === "user" ? "You: " : "") + text;
  $("#turns").append(li);
  return li;
}

function wireChat() {
  newSession();
  $("#chat-new").addEventListener("click", newSession);
  $("#chat-form").addEventListener("submit", async (e) => {
    e.preventDefault();
    const text = $("#chat-message").value.trim();
    if (!text) return;
    const send = $("#chat-send");
    send.disabled = true;
    history.push({ role: "user", content: text });
    addTurn("user", text);
    $("#chat-message").value = "";
    const body = { model, messages: history, max_tokens: 96, prompt_cache_key: $("#chat-session").value.trim() || undefined };
    const user = $("#chat-user").value.trim();
    if (user) body.user = user;
    try {
      const c = await (await postJSON("/v1/chat/completions", body)).json();
      clearError();
      const reply = c.choices[0].message.content;
      history.push({ role: "assistant", content: reply });
      const li = addTurn("assistant", reply);
      const meta = document.createElement("div"); meta.className = "meta"; meta.textContent = chatFigures(c);
      if (c.kvmemory && c.kvmemory.recalled && c.kvmemory.recalled.length) {
        const d = document.createElement("details");
        const s = document.createElement("summary"); s.textContent = "what was recalled";
        d.append(s);
        for (const r of c.kvmemory.recalled) {
          const p = document.createElement("div"); p.className = "passage";
          p.textContent = `session ${r.session}, turn ${r.turn}: ${r.text}`;
          d.append(p);
        }
        meta.append(d);
      }
      li.append(meta);
    } catch (err) {
      history.pop();
      showError(err);
    } finally { send.disabled = false; $("#chat-message").focus(); }
  });
}

// ---------------------------------------------------------------- start
function wireKey() {
  $("#key-button").addEventListener("click", askForKey);
  $("#key-cancel").addEventListener("click", () => $("#key-dialog").close());
  $("#key-form").addEventListener("submit", () => {
    sessionStorage.setItem(KEY, $("#key-input").value);
    clearError();
    start();
  });
}

async function start() {
  try {
    const r = await api("/v1/models");
    const { data } = await r.json();
    if (data.length) { model = data[0].id; $("#model").textContent = `Model: ${model}.`; }
    await loadDocuments();
  } catch (e) { showError(e); }
}

wireKey(); wireDocuments(); wireAsk(); wireChat();
start();
