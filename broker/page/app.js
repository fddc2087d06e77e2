// The runs page (docs/http-api.md, "The runs page"). Plain JS, no dependencies, no CDN.
//
// Live updates come from the events endpoints, read with fetch() streaming rather than EventSource:
// EventSource cannot send an Authorization header, and a token in a URL ends up in logs and history.
// The token is asked for once (when the API answers 401) and kept in sessionStorage (this tab only).
"use strict";

const CONFIG = JSON.parse(document.getElementById("runbrake-config").textContent || "null") ||
  { labels: { en: {}, de: {} }, lang: "en", tokens: false };
const TOKEN_KEY = "runbrake.token";
const TERMINAL = new Set(["completed", "failed", "cancelled"]);

const UI = {
  en: {
    "runs.title": "Runs", "runs.empty": "No runs yet.", "runs.none_match": "No run matches this filter.",
    "runs.more": "Show older runs",
    "action.cancel": "Cancel run", "action.approve": "Approve", "action.deny": "Deny",
    "action.steer": "Steer", "steer.input": "New message",
    "action.confirm": "Confirm", "action.back": "Back", "reason": "Reason",
    "pending.title": "Waiting for approval of", "live": "live", "reconnecting": "reconnecting…",
    "token.prompt": "API token", "token.use": "Use token", "token.hint": "Kept in this tab only (sessionStorage).",
    "elapsed": "elapsed", "error.forbidden": "Your token may not do this.", "back": "All runs",
    "runs.input": "Input", "runs.labels": "Labels", "runs.duration": "Duration", "runs.tokens": "Tokens",
    "filter.status": "Status", "filter.any": "any", "filter.label": "Label (KEY:VALUE)", "filter.apply": "Filter",
    "filter.clear": "Clear", "run.instructions": "Instructions", "run.input": "Input", "run.output": "Answer",
    "run.usage": "Usage", "run.model": "Model", "run.labels": "Labels",
    "usage.text": "{input} in + {output} out = {total} tokens, {calls}",
    "usage.calls.one": "{n} model call", "usage.calls.other": "{n} model calls",
    "run.forming": "answering…",
    "action.continue": "Continue", "continue.input": "Next message", "continue.send": "Send",
    "when.created": "Created", "when.started": "Started", "when.finished": "Finished",
    "when.note": "Times are in your time zone ({zone}), written year-month-day.",
    "filter.q": "Search text", "filter.since": "Created from", "filter.until": "to",
    "step.expand": "Show what this step saw and did", "step.collapse": "Hide the step's detail",
    "step.model": "Model", "step.attempts": "Attempts", "step.retried": "Retried after",
    "step.usage": "Usage", "step.tokens": "{input} in + {output} out = {total} tokens",
    "step.answer": "Answer", "step.asked": "Tool calls asked for", "step.error": "Error",
    "step.interrupted": "Cut off before it answered", "step.output_error": "Answer did not match the schema",
    "step.received": "Messages sent to the model", "step.received.loading": "loading…",
    "step.received.omitted": "{n} earlier messages not shown", "step.received.cut": "cut, {n} characters in all",
    "step.settings": "Model settings", "step.settings.none": "the model's defaults",
    "step.call": "Call", "step.arguments": "Arguments", "step.result": "Result", "step.side_effects": "Side effects",
    "step.reason": "Why", "step.duration": "Duration", "step.progress": "Progress seen on this page",
    "step.child": "Child run", "step.task": "MCP task", "step.detail": "Stored detail (JSON)",
    "step.decision": "Decision", "step.by": "By", "step.input": "New message",
    "timeline.title": "Timeline", "timeline.wait": "waiting for approval",
    "timeline.span": "{s} from the first step's start to the last step's end",
  },
  de: {
    "runs.title": "Läufe", "runs.empty": "Noch keine Läufe.", "runs.none_match": "Kein Lauf passt zu diesem Filter.",
    "runs.more": "Ältere Läufe zeigen",
    "action.cancel": "Lauf abbrechen", "action.approve": "Freigeben", "action.deny": "Ablehnen",
    "action.steer": "Umlenken", "steer.input": "Neue Nachricht",
    "action.confirm": "Bestätigen", "action.back": "Zurück", "reason": "Grund",
    "pending.title": "Wartet auf Freigabe von", "live": "live", "reconnecting": "verbinde neu…",
    "token.prompt": "API-Token", "token.use": "Token verwenden", "token.hint": "Nur in diesem Tab gespeichert (sessionStorage).",
    "elapsed": "vergangen", "error.forbidden": "Dieses Token darf das nicht.", "back": "Alle Läufe",
    "runs.input": "Eingabe", "runs.labels": "Labels", "runs.duration": "Dauer", "runs.tokens": "Tokens",
    "filter.status": "Status", "filter.any": "alle", "filter.label": "Label (SCHLÜSSEL:WERT)", "filter.apply": "Filtern",
    "filter.clear": "Zurücksetzen", "run.instructions": "Anweisungen", "run.input": "Eingabe", "run.output": "Antwort",
    "run.usage": "Verbrauch", "run.model": "Modell", "run.labels": "Labels",
    "usage.text": "{input} ein + {output} aus = {total} Tokens, {calls}",
    "usage.calls.one": "{n} Modellaufruf", "usage.calls.other": "{n} Modellaufrufe",
    "run.forming": "antwortet…",
    "action.continue": "Fortsetzen", "continue.input": "Nächste Nachricht", "continue.send": "Senden",
    "when.created": "Erstellt", "when.started": "Gestartet", "when.finished": "Beendet",
    "when.note": "Zeiten in Ihrer Zeitzone ({zone}), geschrieben Jahr-Monat-Tag.",
    "filter.q": "Text suchen", "filter.since": "Erstellt von", "filter.until": "bis",
    "step.expand": "Zeigen, was dieser Schritt sah und tat", "step.collapse": "Details des Schritts verbergen",
    "step.model": "Modell", "step.attempts": "Versuche", "step.retried": "Wiederholt nach",
    "step.usage": "Verbrauch", "step.tokens": "{input} ein + {output} aus = {total} Tokens",
    "step.answer": "Antwort", "step.asked": "Verlangte Werkzeugaufrufe", "step.error": "Fehler",
    "step.interrupted": "Abgebrochen, bevor es antwortete", "step.output_error": "Antwort passte nicht zum Schema",
    "step.received": "An das Modell gesendete Nachrichten", "step.received.loading": "lädt…",
    "step.received.omitted": "{n} frühere Nachrichten nicht gezeigt", "step.received.cut": "gekürzt, {n} Zeichen insgesamt",
    "step.settings": "Modelleinstellungen", "step.settings.none": "die Vorgaben des Modells",
    "step.call": "Aufruf", "step.arguments": "Argumente", "step.result": "Ergebnis", "step.side_effects": "Nebenwirkungen",
    "step.reason": "Warum", "step.duration": "Dauer", "step.progress": "Auf dieser Seite gesehener Fortschritt",
    "step.child": "Kind-Lauf", "step.task": "MCP-Task", "step.detail": "Gespeichertes Detail (JSON)",
    "step.decision": "Entscheidung", "step.by": "Von", "step.input": "Neue Nachricht",
    "timeline.title": "Zeitleiste", "timeline.wait": "wartet auf Freigabe",
    "timeline.span": "{s} vom Beginn des ersten bis zum Ende des letzten Schritts",
  },
};

let lang = localStorage.getItem("runbrake.lang") || CONFIG.lang || "en";
let view = null;  // the current view: {stop(), render()}

function t(key) { return (UI[lang] && UI[lang][key]) || (CONFIG.labels[lang] || {})[key] || key; }
function label(key) { return (CONFIG.labels[lang] || {})[key] || key; }
function statusLabel(status) { return label("status." + status); }
function outcomeLabel(outcome) { return outcome ? label("outcome." + outcome) : ""; }

function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [name, value] of Object.entries(attrs || {})) {
    if (value === undefined || value === null || value === false) continue;
    if (name === "class") node.className = value;
    else if (name.startsWith("on")) node.addEventListener(name.slice(2), value);
    else node.setAttribute(name, value === true ? "" : String(value));
  }
  for (const child of children.flat(Infinity)) {
    if (child === null || child === undefined || child === false) continue;
    node.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  return node;
}

// Text that came from outside (a model, a tool, a server, a caller) goes in its own bidi isolate, so that a
// right-to-left override in it cannot reorder the words around it ("reason (by who)"): docs/security.md.
function user(text) { return el("bdi", { class: "user" }, text === null || text === undefined ? "" : text); }

// A point in time in the reader's time zone, written year-month-day (ISO 8601's order, never 05/12/2026, which
// reads as May or December depending on the reader), with the zone's offset; the page states it (when.note).
// A label of shared/timeline.py, or the key's own value where the page has none for it (a reason added later).
function known(key) { const text = label(key); return text === key ? key.slice(key.indexOf(".") + 1) : text; }

// ``server.tool``, or the name a model made up for a call to no server.
function callName(server, tool) { return server ? server + "." + tool : String(tool || ""); }

function when(epoch) {
  if (!epoch) return "-";
  const d = new Date(epoch * 1000);
  const two = (n) => String(n).padStart(2, "0");
  return d.getFullYear() + "-" + two(d.getMonth() + 1) + "-" + two(d.getDate()) + " " + two(d.getHours()) + ":" +
    two(d.getMinutes()) + ":" + two(d.getSeconds()) + " " + zone(d);
}

function zone(d) {
  const minutes = -(d || new Date()).getTimezoneOffset();
  const abs = Math.abs(minutes);
  return "UTC" + (minutes < 0 ? "−" : "+") + String(Math.floor(abs / 60)).padStart(2, "0") + ":" + String(abs % 60).padStart(2, "0");
}

function whenNote() { return t("when.note").replace("{zone}", zone()); }

// "1 model call", "2 model calls": the language's own plural rule.
function plural(key, n) {
  const form = new Intl.PluralRules(lang).select(n) === "one" ? "one" : "other";
  return t(key + "." + form).replace("{n}", n);
}

function seconds(ms) { return (ms / 1000).toFixed(1) + " s"; }

// A step's duration: milliseconds below a second (a 37 ms call is not "0.0 s"), else seconds.
function took(ms) { return ms < 1000 ? Math.round(ms) + " ms" : seconds(ms); }

// How long a run took (or has taken so far): from its start to its end, or to now while it runs.
function duration(run) {
  if (!run.started_at) return "";
  const end = run.finished_at || (TERMINAL.has(run.status) ? run.started_at : Date.now() / 1000);
  return seconds(Math.max(0, end - run.started_at) * 1000);
}

function labelChips(labels) {
  return Object.entries(labels || {}).sort().map(([key, value]) =>
    el("span", { class: "chip", "data-testid": "label" }, user(key + "=" + value)));
}

// What a run used of its budget (docs/usage.md, "Budgets"): tokens, cost, and the time left while it is not over.
function budgetParts(run) {
  const budget = run.budget, use = run.budget_use;
  if (!budget || !use) return [];
  const parts = [];
  if (budget.max_total_tokens) {
    parts.push(el("span", { "data-testid": "budget-tokens" }, label("run.budget_tokens") + " " + use.tokens + "/" + budget.max_total_tokens));
  }
  if (budget.max_cost_usd) {
    parts.push(el("span", { "data-testid": "budget-cost" },
      label("run.budget_cost") + " " + (use.cost_usd || 0).toFixed(6) + "/" + budget.max_cost_usd + " USD"));
  }
  if (use.deadline_at) {
    parts.push(el("span", { "data-testid": "budget-deadline" }, label("run.budget_deadline") + " " + when(use.deadline_at)));
    if (!TERMINAL.has(run.status)) {
      parts.push(el("span", { "data-testid": "budget-left", "data-deadline": use.deadline_at }, timeLeft(use.deadline_at)));
    }
  }
  return parts.flatMap((part, i) => (i ? [" · ", part] : [part]));
}

function timeLeft(deadlineAt) {
  return Math.max(0, Math.round(deadlineAt - Date.now() / 1000)) + " s " + label("run.budget_left");
}

function usageText(usage) {
  if (!usage) return "";
  const text = t("usage.text").replace("{input}", usage.input_tokens).replace("{output}", usage.output_tokens)
    .replace("{total}", usage.total_tokens).replace("{calls}", plural("usage.calls", usage.model_calls));
  return usage.cost_usd === undefined || usage.cost_usd === null ? text : text + ", " + usage.cost_usd.toFixed(6) + " USD";
}

// -- the API ------------------------------------------------------------------------------------

class ApiError extends Error {
  constructor(status, body) { super((body && body.error) || "HTTP " + status); this.status = status; this.body = body; }
}

function headers(extra) {
  const h = Object.assign({ Accept: "application/json" }, extra || {});
  const token = sessionStorage.getItem(TOKEN_KEY);
  if (token) h.Authorization = "Bearer " + token;
  return h;
}

async function api(path, options) {
  const opts = Object.assign({}, options || {});
  opts.headers = headers(opts.body ? { "Content-Type": "application/json" } : {});
  const response = await fetch(path, opts);
  let body = null;
  try { body = await response.json(); } catch (_) { body = null; }
  if (response.status === 401) askForToken(opts.headers);
  if (!response.ok) throw new ApiError(response.status, body);
  return body;
}

// Asked again only when the token refused is still the one in use: a request sent before a token was given
// (the page's first) is answered 401 after the form was already sent, and must not open it once more.
function askForToken(sent) {
  if (sent && sent.Authorization !== headers().Authorization) return;
  const form = document.getElementById("token-form");
  form.hidden = false;
  document.getElementById("token-input").focus();
}

document.getElementById("token-form").addEventListener("submit", (event) => {
  event.preventDefault();
  const value = document.getElementById("token-input").value.trim();
  if (!value) return;
  sessionStorage.setItem(TOKEN_KEY, value);
  document.getElementById("token-input").value = "";
  document.getElementById("token-form").hidden = true;
  route();
});

// A server-sent event stream read with fetch(): resumes with Last-Event-ID, stops on "end". With
// ``remember`` (a sessionStorage key) the last id outlives the page: reopened, it resumes where it was
// (the runs list's feed replays what happened meanwhile: docs/http-api.md, "Events: resuming").
class EventStream {
  constructor(path, handlers, remember) {
    this.path = path; this.handlers = handlers; this.remember = remember || null;
    this.lastId = this.remember ? sessionStorage.getItem(this.remember) : null;
    this.stopped = false; this.controller = null;
    this.retryMs = 1000;
    this.run();
  }

  stop() { this.stopped = true; if (this.controller) this.controller.abort(); }

  async run() {
    while (!this.stopped) {
      this.controller = new AbortController();
      let ended = false;
      try {
        const extra = { Accept: "text/event-stream" };
        if (this.lastId !== null) extra["Last-Event-ID"] = this.lastId;
        const sent = headers(extra);
        const response = await fetch(this.path, { headers: sent, signal: this.controller.signal });
        if (response.status === 401) { askForToken(sent); return; }
        if (!response.ok) throw new Error("HTTP " + response.status);
        setConnection(t("live"));
        ended = await this.read(response.body.getReader());
      } catch (error) {
        if (this.stopped) return;
      }
      if (ended || this.stopped) return;
      setConnection(t("reconnecting"));
      await new Promise((resolve) => setTimeout(resolve, this.retryMs));
    }
  }

  async read(reader) {
    const decoder = new TextDecoder();
    let buffer = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) return false;
      buffer += decoder.decode(value, { stream: true });
      let cut;
      while ((cut = buffer.indexOf("\n\n")) >= 0) {
        const block = buffer.slice(0, cut);
        buffer = buffer.slice(cut + 2);
        if (this.dispatch(block)) return true;
      }
    }
  }

  dispatch(block) {
    let event = "message", data = "", id = null;
    for (const line of block.split("\n")) {
      if (line.startsWith(":")) continue;
      const colon = line.indexOf(":");
      const field = colon < 0 ? line : line.slice(0, colon);
      const value = colon < 0 ? "" : line.slice(colon + 1).replace(/^ /, "");
      if (field === "event") event = value;
      else if (field === "data") data += (data ? "\n" : "") + value;
      else if (field === "id") id = value;
      else if (field === "retry" && /^\d+$/.test(value)) this.retryMs = Number(value);
    }
    if (id !== null) {
      this.lastId = id;
      if (this.remember) sessionStorage.setItem(this.remember, id);
    }
    if (!data) return false;
    const payload = JSON.parse(data);
    if (event === "end") { if (this.handlers.end) this.handlers.end(payload); return true; }
    if (this.handlers[event]) this.handlers[event](payload);
    return false;
  }
}

function setConnection(text) { document.getElementById("connection").textContent = text; }

// A view draws its page again at every event it gets (several a second on a busy system); the parts a user
// acts on are kept, node for node, while what they show (key) is unchanged. A button drawn anew between the
// press and the release of a click loses the click, a field drawn anew what was typed in it and the focus.
// Each drawing starts with keep.drawing(): what the drawing before did not use is let go.
function keeper() {
  let kept = new Map(), used = new Map();
  function keep(name, key, build) {
    const last = kept.get(name);
    const entry = last && last.key === key ? last : { key, node: build() };
    used.set(name, entry);
    return entry.node;
  }
  keep.drawing = () => { kept = used; used = new Map(); };
  return keep;
}

// Draws a view's page again with draw(), the focus given back to a kept field that had it.
function redraw(main, keep, draw) {
  const focused = document.activeElement;
  keep.drawing();
  main.replaceChildren();
  draw();
  if (focused !== document.activeElement && main.contains(focused)) focused.focus();
}

// -- the list of runs -----------------------------------------------------------------------------

function listView() {
  const params = new URLSearchParams(location.hash.split("?")[1] || "");
  const filter = { status: params.get("status") || "", labels: params.getAll("label"), q: params.get("q") || "",
    since: params.get("since") || "", until: params.get("until") || "" };
  const state = { runs: [], error: null, next: null };  // next: the listing's next_cursor (more runs after these)
  const main = document.getElementById("main");
  const keep = keeper();
  let stream = null, stopped = false;  // stopped: another view has the page (see route)

  function query() {
    const q = new URLSearchParams({ limit: "100" });
    if (filter.status) q.set("status", filter.status);
    for (const item of filter.labels) q.append("label", item);
    for (const name of ["q", "since", "until"]) if (filter[name]) q.set(name, filter[name]);
    return q;
  }

  // The search runs on the server (GET /v1/runs?q=&since=&until=: docs/http-api.md, "Runs: reading"); the times
  // typed in the reader's zone go there as ISO 8601 in UTC, so that the server never guesses a zone.
  function applyFilter(form) {
    const q = new URLSearchParams();
    if (form.status) q.set("status", form.status);
    for (const item of form.labels.split(/[\s,]+/).filter(Boolean)) q.append("label", item);
    if (form.q.trim()) q.set("q", form.q.trim());
    for (const name of ["since", "until"]) {
      const moment = form[name] ? new Date(form[name]) : null;  // datetime-local: the reader's zone
      if (moment && !isNaN(moment)) q.set(name, moment.toISOString());
    }
    location.hash = "#/" + (q.toString() ? "?" + q.toString() : "");
  }

  // An ISO 8601 time from the address as the value of a datetime-local field (the reader's zone, to the minute).
  function localInput(iso) {
    const d = iso ? new Date(iso) : null;
    if (!d || isNaN(d)) return "";
    const two = (n) => String(n).padStart(2, "0");
    return d.getFullYear() + "-" + two(d.getMonth() + 1) + "-" + two(d.getDate()) + "T" + two(d.getHours()) + ":" +
      two(d.getMinutes());
  }

  function filterForm() {
    const select = el("select", { "data-testid": "filter-status", "aria-label": t("filter.status") },
      el("option", { value: "" }, t("filter.any")),
      ...["queued", "running", "waiting_for_approval", "completed", "failed", "cancelled"].map((status) =>
        el("option", { value: status, selected: status === filter.status }, statusLabel(status))));
    const input = el("input", { type: "text", "data-testid": "filter-label", "aria-label": t("filter.label"),
      placeholder: t("filter.label"), value: filter.labels.join(" ") });
    const text = el("input", { type: "search", "data-testid": "filter-q", "aria-label": t("filter.q"),
      placeholder: t("filter.q"), maxlength: 200, value: filter.q });
    const since = el("input", { type: "datetime-local", "data-testid": "filter-since", "aria-label": t("filter.since"),
      value: localInput(filter.since) });
    const until = el("input", { type: "datetime-local", "data-testid": "filter-until", "aria-label": t("filter.until"),
      value: localInput(filter.until) });
    return el("form", { class: "filters", "data-testid": "filters",
      onsubmit: (event) => {
        event.preventDefault();
        applyFilter({ status: select.value, labels: input.value, q: text.value, since: since.value, until: until.value });
      } },
    text, " ", el("label", {}, t("filter.status") + " "), select, " ", input, " ",
    el("label", {}, t("filter.since") + " "), since, el("label", {}, " " + t("filter.until") + " "), until, " ",
    el("button", { type: "submit", class: "action", "data-testid": "filter-apply" }, t("filter.apply")), " ",
    el("button", { type: "button", class: "action", onclick: () => { location.hash = "#/"; } }, t("filter.clear")));
  }

  function matches(run) {
    if (filter.status && run.status !== filter.status) return false;
    return filter.labels.every((item) => {
      const cut = item.indexOf(":");
      return cut > 0 && (run.labels || {})[item.slice(0, cut)] === item.slice(cut + 1);
    });
  }

  function runRow(run) {
    return el("tr", {
      class: "run-row", "data-testid": "run-row", "data-run-id": run.run_id,
      onclick: () => { location.hash = "#/runs/" + run.run_id; },
    },
    el("td", {}, el("a", { href: "#/runs/" + run.run_id }, el("code", {}, run.run_id.slice(0, 8)))),
    el("td", { class: "status s-" + run.status, "data-testid": "run-status" }, statusLabel(run.status)),
    el("td", {}, run.termination_reason ? label("reason." + run.termination_reason) : ""),
    el("td", { class: "preview", "data-testid": "run-input" }, user(run.input_preview || "")),
    el("td", { "data-testid": "run-labels" }, labelChips(run.labels)),
    el("td", { class: "num", "data-testid": "run-duration" }, duration(run)),
    el("td", { class: "num", "data-testid": "run-tokens" }, run.usage ? run.usage.total_tokens : ""),
    el("td", { "data-testid": "run-created" }, when(run.created_at)));
  }

  function render() { if (!stopped) redraw(main, keep, draw); }

  function draw() {
    main.append(el("h1", {}, t("runs.title")), keep("filters", lang, filterForm));
    // An answer that failed (a 401 without a token above all) says only that: no runs were read, so "none yet"
    // would be a second, contradictory message.
    if (state.error) { main.append(el("p", { class: "error", "data-testid": "error" }, state.error)); return; }
    const runs = state.runs.filter(matches);
    if (!runs.length) {
      const searching = filter.status || filter.labels.length || filter.q || filter.since || filter.until;
      main.append(el("p", { class: "empty", "data-testid": "empty" }, t(searching ? "runs.none_match" : "runs.empty")));
      more();
      return;
    }
    const rows = runs.map((run) => {
      const row = keep("run " + run.run_id, lang + JSON.stringify(run), () => runRow(run));
      row.querySelector("[data-testid=run-duration]").textContent = duration(run);  // a running run's grows
      return row;
    });
    main.append(el("table", {}, el("thead", {}, el("tr", {},
      el("th", {}, label("run.run")), el("th", {}, label("run.status")), el("th", {}, label("run.reason")),
      el("th", {}, t("runs.input")), el("th", {}, t("runs.labels")), el("th", {}, t("runs.duration")),
      el("th", {}, t("runs.tokens")), el("th", {}, t("when.created")))), el("tbody", {}, rows)));
    more();
    main.append(el("p", { class: "hint", "data-testid": "when-note" }, whenNote()));
  }

  // A listing stops at 100 runs, a search after 1000 examined (docs/http-api.md, "Runs: reading"): what is past
  // them is one click away, never silently left out.
  function more() {
    if (!state.next) return;
    main.append(keep("more", lang + state.next, () => el("p", {}, el("button", { type: "button", class: "action",
      "data-testid": "more", onclick: () => loadMore() }, t("runs.more")))));
  }

  async function loadMore() {
    const q = query();
    q.set("cursor", state.next);
    try {
      const page = await api("/v1/runs?" + q.toString());
      const known = new Set(state.runs.map((r) => r.run_id));
      state.runs = state.runs.concat(page.runs.filter((r) => !known.has(r.run_id)));
      state.next = page.next_cursor;
    } catch (error) {
      state.error = error.message;
    }
    render();
  }

  async function load() {
    try {
      const page = await api("/v1/runs?" + query().toString());
      state.runs = page.runs;
      state.next = page.next_cursor;
      state.error = null;
    } catch (error) {
      state.error = error.message;
    }
    render();
  }

  load().then(() => {
    if (stopped) return;
    stream = new EventStream("/v1/events", {
      status: (event) => {
        const run = state.runs.find((r) => r.run_id === event.run_id);
        if (run) { run.status = event.status; run.termination_reason = event.termination_reason; render(); }
        else load();  // a new run: its labels, input and usage come with the listing
      },
      resync: () => load(),
    }, "runbrake.events.last");
  });
  return { render, stop: () => { stopped = true; if (stream) stream.stop(); } };
}

// -- one run ---------------------------------------------------------------------------------------

function runView(runId) {
  const state = { run: null, steps: new Map(), status: null, reason: "", progress: null, error: null,
    deciding: null, message: null, forming: null, thread: [],
    tree: [],  // the runs of this run's agent tree (GET /v1/runs?root=), when it is in one
    expanded: new Set(),  // the steps opened, by sequence
    received: new Map(),  // sequence → what that model call was sent: {body} or {error}, once asked for
    progressLog: new Map() };  // tool call id → the progress reports this page saw, oldest first
  const main = document.getElementById("main");
  const keep = keeper();
  let opened = 0;  // forms opened, so that one opened again is drawn anew, empty
  let stream = null, stopped = false;  // stopped: another view has the page (see route)
  // An agent tree's other runs have events of their own: while one of them is unfinished, the tree is read again
  // every second (a listing of at most 100 runs; docs/usage.md, "Agent trees").
  const treeTicker = setInterval(() => {
    if (state.tree.some((r) => !TERMINAL.has(r.status))) loadTree().then(render);
  }, 1000);
  const ticker = setInterval(() => {
    const cell = document.querySelector("[data-testid=elapsed]");
    if (cell) cell.textContent = elapsedText();
    const left = document.querySelector("[data-testid=budget-left]");
    if (left) left.textContent = timeLeft(Number(left.dataset.deadline));
  }, 200);

  function sortedSteps() { return [...state.steps.values()].sort((a, b) => a.sequence - b.sequence); }

  // The call in flight: the first call the latest model turn asked for that has no tool step yet.
  function inFlight() {
    if (state.status !== "running") return null;
    const steps = sortedSteps();
    const model = [...steps].reverse().find((s) => s.kind === "model");
    if (!model) return null;
    const done = new Set(steps.filter((s) => s.kind === "tool").map((s) => s.tool_call_id));
    const call = ((model.detail && model.detail.tool_calls) || []).find((c) => !done.has(c.id));
    if (!call) return null;
    const last = steps[steps.length - 1];
    const progress = state.progress && state.progress.tool_call_id === call.id ? state.progress : null;
    return { call, round: model.round, started: progress ? progress.started_at : last.recorded_at, progress };
  }

  function elapsedText() {
    const call = inFlight();
    return call ? seconds(Date.now() - call.started * 1000) : "";
  }

  function detail(step) {
    if (step.kind === "tool") {
      const d = step.detail || {};
      const notes = [d.reason ? known("step_reason." + d.reason) : null, d.side_effects ? known("side_effects." + d.side_effects) : null]
        .filter(Boolean).map((text) => el("span", { class: "note", "data-testid": "step-note" }, " (" + text + ")"));
      return [user(callName(step.tool_server, step.tool_name)), notes, ": ", el("span", { class: "excerpt" }, user(step.content))];
    }
    if (step.kind === "model") {
      const calls = ((step.detail && step.detail.tool_calls) || []).map((c) => c.server + "." + c.tool).join(", ");
      const text = step.error || step.content || "";
      if (calls) return text ? [user(text), " (" + label("run.calls") + " ", user(calls), ")"] : [label("run.calls") + " ", user(calls)];
      return [user(text)];
    }
    const d = step.detail || {};
    if (step.kind === "steer") {
      return [user(d.input || ""), d.requested_by ? [" (" + label("run.by") + " ", user(d.requested_by), ")"] : null];
    }
    return [(d.decision ? label("decision." + d.decision) : "") + ": ", user(step.content),
      d.decided_by ? [" (" + label("run.by") + " ", user(d.decided_by), ")"] : null];
  }

  function stepRow(step) {
    const open = state.expanded.has(step.sequence);
    const toggle = el("button", { type: "button", class: "expand", "data-testid": "expand", "aria-expanded": String(open),
      title: t(open ? "step.collapse" : "step.expand"), "aria-label": t(open ? "step.collapse" : "step.expand"),
      onclick: () => expand(step) }, open ? "▾" : "▸");
    return el("tr", { "data-testid": "step-row", "data-seq": step.sequence, "data-kind": step.kind },
      el("td", { class: "num" }, toggle, " ", step.sequence), el("td", { class: "num" }, step.round),
      el("td", {}, label("kind." + step.kind)), el("td", { class: "num" }, step.duration_ms),
      el("td", { class: "outcome o-" + (step.outcome || "none"), "data-testid": "outcome" }, outcomeLabel(step.outcome)),
      el("td", { class: "detail" }, detail(step)));
  }

  function expand(step) {
    if (state.expanded.has(step.sequence)) state.expanded.delete(step.sequence);
    else {
      state.expanded.add(step.sequence);
      if (step.kind === "model" && !state.received.has(step.sequence)) loadReceived(step.sequence);
    }
    render();
  }

  // What a model call was sent, rebuilt by the server from the run's record (docs/http-api.md, "What a model
  // call received"); asked for once, when its step is first opened.
  async function loadReceived(sequence) {
    state.received.set(sequence, { loading: true });
    try {
      state.received.set(sequence, { body: await api("/v1/runs/" + runId + "/steps/" + sequence + "/messages") });
    } catch (error) {
      state.received.set(sequence, { error: error.message });
    }
    render();
  }

  function callOf(step) {
    const asked = [...state.steps.values()].filter((s) => s.kind === "model")
      .flatMap((s) => (s.detail && s.detail.tool_calls) || []);
    return asked.find((c) => c.id === step.tool_call_id) || null;
  }

  // One opened step: what it saw and did, by kind, and its stored detail as JSON.
  function stepDetail(step) {
    const d = step.detail || {};
    const facts = el("dl", { class: "facts" });
    const fact = (key, value, testid) => {
      if (value === null || value === undefined || value === "") return;
      facts.append(el("dt", {}, t(key)), el("dd", testid ? { "data-testid": testid } : {}, value));
    };
    const blocks = [];
    const block = (key, body, testid) => blocks.push(el("h3", {}, t(key)), el("div", { class: "text", "data-testid": testid }, body));
    if (step.kind === "model") {
      fact("step.model", d.model ? user(d.model) : null);
      fact("step.attempts", d.attempts, "step-attempts");
      fact("step.retried", (d.retried || []).length ? (d.retried || []).map((r) =>
        el("div", {}, user(r.error), r.status ? " (HTTP " + r.status + ")" : "", r.wait_s !== undefined ? ", " + r.wait_s + " s" : "")) : null,
      "step-retried");
      fact("step.usage", d.usage ? t("step.tokens").replace("{input}", d.usage.input_tokens)
        .replace("{output}", d.usage.output_tokens).replace("{total}", d.usage.total_tokens) +
        (typeof d.usage.cost_usd === "number" ? ", " + d.usage.cost_usd.toFixed(6) + " USD" : "") : null, "step-usage");
      fact("step.duration", took(step.duration_ms));
      if (step.interrupted) fact("step.interrupted", d.reason ? known("step_reason." + d.reason) : "✓");
      fact("step.error", step.error ? user(step.error) : null, "step-error");
      fact("step.output_error", d.output_error ? user(d.output_error) : null);
      if (step.content) block("step.answer", user(step.content), "step-answer");
      const calls = d.tool_calls || [];
      if (calls.length) {
        block("step.asked", calls.map((c) => el("div", { class: "call" }, el("code", {}, user(callName(c.server, c.tool))), " ",
          el("pre", { dir: "ltr" }, user(JSON.stringify(c.arguments, null, 2))))), "step-asked");
      }
      blocks.push(receivedBox(step));
    } else if (step.kind === "tool") {
      const call = callOf(step);
      fact("step.call", [el("code", {}, user(callName(step.tool_server, step.tool_name))), " ", el("code", {}, user(step.tool_call_id || ""))]);
      fact("step.duration", took(step.duration_ms), "step-duration");
      fact("step.reason", d.reason ? known("step_reason." + d.reason) : null);
      fact("step.side_effects", d.side_effects ? known("side_effects." + d.side_effects) : null, "step-side-effects");
      fact("step.task", d.task_id ? user(d.task_id + (d.task_status ? " (" + d.task_status + ")" : "")) : null);
      fact("step.child", d.child_run_id ? el("a", { href: "#/runs/" + d.child_run_id }, el("code", {}, d.child_run_id)) : null);
      block("step.arguments", el("pre", { dir: "ltr" }, user(call ? JSON.stringify(call.arguments, null, 2) : "-")), "step-arguments");
      block("step.result", user(step.content), "step-result");
      const kept = (d.progress_history || []).map((p) => Object.assign({}, p, { updated_at: p.at }));
      const seen = kept.length ? kept : state.progressLog.get(step.tool_call_id) || [];
      if (seen.length) {
        block("step.progress", el("ol", {}, seen.map((p) => el("li", {}, when(p.updated_at), " · ",
          p.progress + (p.total ? "/" + p.total : ""), p.message ? [" · ", user(p.message)] : null))), "step-progress");
      }
    } else if (step.kind === "approval") {
      fact("step.decision", d.decision ? label("decision." + d.decision) : null);
      fact("step.by", d.decided_by ? user(d.decided_by) : null);
      fact("reason", step.content ? user(step.content) : null);
    } else if (step.kind === "steer") {
      fact("step.input", d.input ? user(d.input) : null);
      fact("step.by", d.requested_by ? user(d.requested_by) : null);
      fact("reason", d.reason ? user(d.reason) : null);
    } else {
      fact("reason", step.content ? user(step.content) : null);
    }
    const raw = el("details", {}, el("summary", {}, t("step.detail")), el("pre", { dir: "ltr" }, user(JSON.stringify(d, null, 2))));
    return el("tr", { class: "step-detail", "data-testid": "step-detail", "data-seq": step.sequence },
      el("td", { colspan: 6 }, facts.childNodes.length ? facts : null, blocks, raw));
  }

  function receivedBox(step) {
    const got = state.received.get(step.sequence) || { loading: true };
    const box = el("div", { class: "received", "data-testid": "received" }, el("h3", {}, t("step.received")));
    if (got.loading) { box.append(el("p", { class: "hint" }, t("step.received.loading"))); return box; }
    if (got.error) { box.append(el("p", { class: "error" }, got.error)); return box; }
    const body = got.body;
    const settings = Object.entries(body.settings || {});
    box.append(el("p", { "data-testid": "received-settings" }, t("step.settings") + ": ",
      settings.length ? settings.map(([k, v], i) => [i ? ", " : "", k + " = ", user(JSON.stringify(v))]) : t("step.settings.none")));
    if (body.omitted) box.append(el("p", { class: "hint" }, t("step.received.omitted").replace("{n}", body.omitted)));
    const message = (m) => el("li", { class: "message m-" + m.role, "data-testid": "received-message", "data-role": m.role },
      el("span", { class: "role" }, m.role), m.tool_call_id ? [" ", el("code", {}, user(m.tool_call_id))] : null,
      m.content ? el("div", { class: "text" }, user(m.content)) : null,
      m.content_truncated ? el("p", { class: "hint" }, t("step.received.cut").replace("{n}", m.content_truncated.chars)) : null,
      (m.tool_calls || []).map((c) => el("div", { class: "call" }, el("code", {}, user(callName(c.server, c.tool))), " ",
        el("pre", { dir: "ltr" }, user(JSON.stringify(c.arguments))))));
    box.append(el("ol", { class: "messages", start: body.omitted + 1 }, body.messages.map(message)));
    return box;
  }

  // The run's steps drawn to scale on one time axis: model calls on the first lane, tool calls on as many lanes
  // as ran at once, a wait for approval from the call that asked to the decision, hand-overs and steers as
  // marks. A bar opens its step.
  function chart() {
    const steps = sortedSteps().filter((s) => s.recorded_at);
    if (!steps.length) return null;
    const items = steps.map((s) => ({ step: s, start: s.recorded_at - (s.duration_ms || 0) / 1000, end: s.recorded_at }));
    for (const item of [...items]) {
      if (item.step.kind !== "approval") continue;
      const asked = [...items].reverse().find((i) => i.step.kind === "model" && i.step.sequence < item.step.sequence);
      if (asked) items.push({ wait: true, step: item.step, start: asked.end, end: item.step.recorded_at });
    }
    const t0 = Math.min(...items.map((i) => i.start)), t1 = Math.max(...items.map((i) => i.end));
    const span = Math.max(t1 - t0, 0.001);
    const lanes = [];  // per lane, when its last bar ends
    const laneOf = (item) => {
      if (item.wait) return "wait";
      if (item.step.kind !== "tool") return "main";
      let lane = lanes.findIndex((end) => end <= item.start + 1e-6);
      if (lane < 0) { lane = lanes.length; lanes.push(0); }
      lanes[lane] = item.end;
      return "tool" + lane;
    };
    const rows = new Map([["main", []]]);
    for (const item of items.sort((a, b) => a.start - b.start)) {
      const lane = laneOf(item);
      if (!rows.has(lane)) rows.set(lane, []);
      const kind = item.wait ? "wait" : item.step.kind;
      const name = item.wait ? t("timeline.wait") : label("kind." + item.step.kind) +
        (item.step.kind === "tool" ? " " + callName(item.step.tool_server, item.step.tool_name) : "");
      rows.get(lane).push(el("button", { type: "button", class: "bar k-" + kind + " o-" + (item.step.outcome || "none"),
        "data-testid": "bar", "data-kind": kind, "data-seq": item.step.sequence,
        "data-left": ((item.start - t0) / span) * 100, "data-width": ((item.end - item.start) / span) * 100,
        title: "#" + item.step.sequence + " " + name + " · " + took((item.end - item.start) * 1000),
        onclick: () => { if (!state.expanded.has(item.step.sequence)) expand(item.step); } }, "#" + item.step.sequence));
    }
    const order = ["main", ...[...rows.keys()].filter((k) => k.startsWith("tool")).sort(), ...(rows.has("wait") ? ["wait"] : [])];
    return el("div", { class: "chart", "data-testid": "chart", "data-span": span },
      el("h2", {}, t("timeline.title")),
      order.map((lane) => el("div", { class: "lane", "data-testid": "lane", "data-lane": lane }, rows.get(lane))),
      el("p", { class: "hint", "data-testid": "chart-span" }, t("timeline.span").replace("{s}", seconds(span * 1000))));
  }

  function inFlightRow(flight) {
    const p = flight.progress;
    let progress = null;
    if (p && p.progress !== null) {
      const share = p.total ? Math.min(100, Math.round((p.progress / p.total) * 100)) : null;
      progress = el("span", { "data-testid": "progress" },
        share !== null ? el("span", { class: "progress" }, el("span", { style: null, "data-share": share })) : null,
        p.progress + (p.total ? "/" + p.total : ""), p.message ? [" · ", user(p.message)] : null);
    }
    return el("tr", { class: "in-flight", "data-testid": "in-flight" },
      el("td", { class: "num" }, "…"), el("td", { class: "num" }, flight.round), el("td", {}, label("kind.tool")),
      el("td", { class: "num", "data-testid": "elapsed" }, elapsedText()),
      el("td", { class: "outcome o-in_flight" }, label("run.in_flight")),
      el("td", { class: "detail" }, user(flight.call.server + "." + flight.call.tool), " ", progress));
  }

  // The model's answer as it streams in (delta events), until its model step is recorded.
  function formingRow(forming) {
    return el("tr", { class: "in-flight", "data-testid": "forming", "data-round": forming.round },
      el("td", { class: "num" }, "…"), el("td", { class: "num" }, forming.round), el("td", {}, label("kind.model")),
      el("td", { class: "num" }, ""), el("td", { class: "outcome o-in_flight" }, t("run.forming")),
      el("td", { class: "detail", "data-testid": "forming-text" }, user(forming.text)));
  }

  function formingNow() {
    const f = state.forming;
    if (!f || state.status !== "running") return null;
    return [...state.steps.values()].some((s) => s.kind === "model" && s.round >= f.round) ? null : f;
  }

  // A delta carries the text since the one before; a new round starts a new answer.
  function addDelta(delta) {
    const f = state.forming;
    state.forming = f && f.round === delta.round ? { round: f.round, text: f.text + delta.text } : { round: delta.round, text: delta.text };
  }

  function actions() {
    const box = el("div", { class: "actions" });
    if (state.status && !TERMINAL.has(state.status)) {
      box.append(el("button", { type: "button", class: "action danger", "data-testid": "cancel",
        onclick: () => decide("cancel") }, t("action.cancel")));
    }
    if (state.status === "running" || state.status === "waiting_for_approval") {
      box.append(el("button", { type: "button", class: "action", "data-testid": "steer",
        onclick: () => decide("steer") }, t("action.steer")));
    }
    if (state.status === "waiting_for_approval") {
      box.append(el("button", { type: "button", class: "action go", "data-testid": "approve",
        onclick: () => decide("approve") }, t("action.approve")));
      box.append(el("button", { type: "button", class: "action danger", "data-testid": "deny",
        onclick: () => decide("deny") }, t("action.deny")));
    }
    if (TERMINAL.has(state.status)) {
      box.append(el("button", { type: "button", class: "action go", "data-testid": "continue",
        onclick: () => decide("continue") }, t("action.continue")));
    }
    if (state.message) box.append(el("span", { class: "error", "data-testid": "message" }, state.message));
    return box;
  }

  // A finished run is carried on by a new run (docs/usage.md, "Continue a finished run"): its page opens.
  function continueForm() {
    const draft = state.draft;
    const input = el("textarea", { rows: 3, maxlength: 100000, "data-testid": "continue-input",
      "aria-label": t("continue.input"), oninput: (event) => { draft.text = event.target.value; } });
    input.value = draft.text;
    const form = el("form", { class: "decision", "data-testid": "continue-form",
      onsubmit: (event) => { event.preventDefault(); continueRun(input.value); } },
    el("label", {}, t("continue.input") + ": "), input, " ",
    el("button", { type: "submit", class: "action go", "data-testid": "continue-send" }, t("continue.send")), " ",
    el("button", { type: "button", class: "action", onclick: () => { state.deciding = null; render(); } }, t("action.back")));
    if (draft.focus) {
      draft.focus = false;
      setTimeout(() => input.focus(), 0);
    }
    return form;
  }

  async function continueRun(text) {
    try {
      const created = await api("/v1/runs/" + runId + "/continue", { method: "POST", body: JSON.stringify({ input: text }) });
      location.hash = "#/runs/" + created.run_id;
    } catch (error) {
      state.message = error.status === 403 ? t("error.forbidden") : error.message;
      render();
    }
  }

  // The runs of this run's thread, oldest first, this one marked.
  function threadBox() {
    if (state.thread.length < 2) return null;
    return el("div", { class: "thread", "data-testid": "thread" }, el("h2", {}, label("run.thread")),
      el("ol", {}, ...state.thread.map((r) => el("li", { "data-testid": "thread-run", "data-run-id": r.run_id },
        r.run_id === runId ? el("strong", {}, el("code", {}, r.run_id)) : el("a", { href: "#/runs/" + r.run_id }, el("code", {}, r.run_id)),
        " ", el("span", { class: "status s-" + r.status }, statusLabel(r.status)), " ", user(r.input_preview)))));
  }

  // The agent tree this run is in, drawn from its first run down, each run with its status; this one marked.
  function treeBox() {
    if (state.tree.length < 2) return null;
    const below = new Map();  // caller run id → its child runs, in the listing's order (level by level)
    for (const r of state.tree) {
      if (r.caller_run_id) below.set(r.caller_run_id, [...(below.get(r.caller_run_id) || []), r]);
    }
    const node = (r) => el("li", { "data-testid": "tree-run", "data-run-id": r.run_id, "data-status": r.status,
      "data-depth": r.depth || 0 },
      r.run_id === runId ? el("strong", {}, el("code", {}, r.run_id)) : el("a", { href: "#/runs/" + r.run_id }, el("code", {}, r.run_id)),
      " ", el("span", { class: "status s-" + r.status, "data-testid": "tree-status" }, statusLabel(r.status)), " ",
      user(r.input_preview),
      (below.get(r.run_id) || []).length ? el("ul", {}, ...below.get(r.run_id).map(node)) : null);
    const first = state.tree.find((r) => !r.caller_run_id) || state.tree[0];
    return el("div", { class: "tree", "data-testid": "tree" }, el("h2", {}, label("run.root")), el("ul", {}, node(first)));
  }

  async function loadTree() {
    const run = state.run;
    if (!run || (!run.caller_run_id && !(run.children || []).length)) { state.tree = []; return; }
    try {
      state.tree = (await api("/v1/runs?root=" + (run.root_run_id || runId) + "&limit=100")).runs;
    } catch (error) {
      state.tree = [];  // the tree is an aid: the run's own page stands without it
    }
  }

  function decisionForm() {
    // Kept across the redraws at each event of the run (see keep); what was typed is also kept in state.draft,
    // for the form a change of language draws anew.
    const draft = state.draft;
    const input = el("input", { type: "text", maxlength: 1000, "data-testid": "reason", "aria-label": t("reason"),
      oninput: (event) => { draft.reason = event.target.value; } });
    input.value = draft.reason;
    // A steer's new message (docs/http-api.md, "Steer a run"), sent with the reason.
    const text = state.deciding === "steer"
      ? el("textarea", { rows: 3, "data-testid": "steer-input", "aria-label": t("steer.input"),
          oninput: (event) => { draft.text = event.target.value; } }) : null;
    if (text) text.value = draft.text;
    const form = el("form", { class: "decision", "data-testid": "decision",
      onsubmit: (event) => { event.preventDefault(); submit(state.deciding, input.value, text && text.value); } },
    text ? [el("label", {}, t("steer.input") + ": "), text, el("br")] : null,
    el("label", {}, t("reason") + " (" + t("action." + state.deciding) + "): "), input, " ",
    el("button", { type: "submit", class: "action", "data-testid": "confirm" }, t("action.confirm")), " ",
    el("button", { type: "button", class: "action", onclick: () => { state.deciding = null; render(); } }, t("action.back")));
    if (draft.focus) {
      draft.focus = false;
      setTimeout(() => (text || input).focus(), 0);
    }
    return form;
  }

  // What the run was asked and what it answered: a structured answer pretty-printed.
  function conversation(run) {
    const box = el("div", { class: "conversation" });
    const part = (key, testid, body) => box.append(el("h2", {}, t(key)), el("div", { class: "text", "data-testid": testid }, body));
    if (run.instructions) part("run.instructions", "run-instructions", user(run.instructions));
    if (run.input !== null && run.input !== undefined) part("run.input", "run-input", user(run.input));
    if (run.output_json !== null && run.output_json !== undefined) {
      part("run.output", "run-output", el("pre", { dir: "ltr" }, user(JSON.stringify(run.output_json, null, 2))));
    } else if (run.output !== null && run.output !== undefined) {
      part("run.output", "run-output", user(run.output));
    }
    return box.childNodes.length ? box : null;
  }

  function pendingBox() {
    const call = state.run && state.run.pending_call;
    if (state.status !== "waiting_for_approval" || !call) return null;
    return el("div", { class: "pending", "data-testid": "pending-call" },
      el("strong", {}, t("pending.title") + " "), el("code", { "data-testid": "pending-tool" }, call.tool_server + "." + call.tool_name),
      el("pre", { "data-testid": "pending-arguments", dir: "ltr" }, user(call.arguments_text)));
  }

  function render() { if (!stopped) redraw(main, keep, draw); }

  function draw() {
    main.append(el("p", {}, el("a", { href: "#/" }, "← " + t("back"))));
    main.append(el("h1", {}, label("run.run") + " ", el("code", {}, runId)));
    if (state.error) { main.append(el("p", { class: "error", "data-testid": "error" }, state.error)); return; }
    const run = state.run || {};
    const facts = el("dl", { class: "facts" },
      el("dt", {}, label("run.status")),
      el("dd", {}, el("span", { class: "status s-" + state.status, "data-testid": "run-status" }, state.status ? statusLabel(state.status) : "")),
      el("dt", {}, label("run.reason")), el("dd", { "data-testid": "run-reason" }, state.reason ? label("reason." + state.reason) : "-"),
      el("dt", {}, t("when.created")), el("dd", { "data-testid": "run-created" }, when(run.created_at)),
      el("dt", {}, t("when.started")), el("dd", { "data-testid": "run-started" }, when(run.started_at)),
      el("dt", {}, t("when.finished")), el("dd", { "data-testid": "run-finished" }, when(run.finished_at)));
    if (run.cancel) facts.append(el("dt", {}, label("run.cancel")), el("dd", { "data-testid": "run-cancel" },
      user(run.cancel.reason), " (" + label("run.by") + " ", user(run.cancel.requested_by), ")"));
    if (run.error) facts.append(el("dt", {}, label("run.error")), el("dd", {}, user(run.error)));
    if (run.lost_worker) {
      facts.append(el("dt", {}, label("run.worker_lost")),
        el("dd", { "data-testid": "run-worker-lost" }, el("code", {}, user(run.lost_worker))));
    }
    if (run.parent_run_id) {
      facts.append(el("dt", {}, label("run.parent")), el("dd", {}, el("a", { href: "#/runs/" + run.parent_run_id,
        "data-testid": "run-parent" }, el("code", {}, run.parent_run_id))));
    }
    if (run.model) facts.append(el("dt", {}, t("run.model")), el("dd", { "data-testid": "run-model" }, user(run.model)));
    if (run.labels && Object.keys(run.labels).length) {
      facts.append(el("dt", {}, t("run.labels")), el("dd", { "data-testid": "run-labels" }, labelChips(run.labels)));
    }
    if (run.usage && run.usage.model_calls) {
      facts.append(el("dt", {}, t("run.usage")), el("dd", { "data-testid": "run-usage" }, usageText(run.usage)));
    }
    const budget = budgetParts({ ...run, status: state.status || run.status });
    if (budget.length) facts.append(el("dt", {}, label("run.budget")), el("dd", { "data-testid": "run-budget" }, budget));
    main.append(...[facts, threadBox(), keep("tree", [lang, JSON.stringify(state.tree)].join("|"), treeBox),
      conversation(run), pendingBox(),
      keep("actions", [lang, state.status, state.message].join("|"), actions)].filter(Boolean));
    if (state.deciding) {
      const key = [lang, state.deciding, state.draft.opened].join("|");
      main.append(keep("form", key, state.deciding === "continue" ? continueForm : decisionForm));
    }
    const rows = sortedSteps().flatMap((step) => {
      // Kept node for node while the step and whether it is open are unchanged: a click on its button (or the
      // text selected in its detail) survives the redraws of a busy run.
      const open = state.expanded.has(step.sequence);
      const shown = [lang, JSON.stringify(step), open].join("|");
      const row = keep("step " + step.sequence, shown, () => stepRow(step));
      if (!open) return [row];
      const extra = step.kind === "model" ? JSON.stringify(state.received.get(step.sequence) || null)
        : step.kind === "tool" ? JSON.stringify(state.progressLog.get(step.tool_call_id) || null) : "";
      return [row, keep("detail " + step.sequence, shown + "|" + extra, () => stepDetail(step))];
    });
    const flight = inFlight();
    if (flight) rows.push(inFlightRow(flight));
    const forming = formingNow();
    if (forming) rows.push(formingRow(forming));
    const drawn = chart();
    if (drawn) main.append(keep("chart", [lang, drawn.outerHTML].join("|"), () => drawn));
    main.append(el("table", { "data-testid": "timeline" }, el("thead", {}, el("tr", {},
      ...["column.sequence", "column.round", "column.kind", "column.duration", "column.outcome", "column.detail"]
        .map((key) => el("th", {}, label(key))))), el("tbody", {}, rows)));
    main.append(el("p", { class: "hint", "data-testid": "when-note" }, whenNote()));
    // Sizes set through the style object: the page's Content-Security-Policy allows no inline style attribute.
    for (const bar of main.querySelectorAll("[data-share]")) bar.style.width = bar.dataset.share + "%";
    for (const bar of main.querySelectorAll("[data-left]")) {
      bar.style.left = bar.dataset.left + "%";
      bar.style.width = "max(" + bar.dataset.width + "%, 3px)";
    }
  }

  function decide(action) {
    state.deciding = action;
    state.draft = { text: "", reason: "", focus: true, opened: ++opened };
    state.message = null;
    render();
  }

  async function submit(action, reason, text) {
    const body = action === "steer" ? { input: text || "", reason } : (reason ? { reason } : {});
    try {
      await api("/v1/runs/" + runId + "/" + action, { method: "POST", body: JSON.stringify(body) });
      state.deciding = null;
      state.message = null;
    } catch (error) {
      state.message = error.status === 403 ? t("error.forbidden") : error.message;
    }
    render();
  }

  async function refresh() {
    try {
      state.run = await api("/v1/runs/" + runId);
      state.error = null;
      state.thread = (await api("/v1/runs?thread=" + state.run.thread + "&limit=100")).runs;
      await loadTree();
      if (!state.status) { state.status = state.run.status; state.reason = state.run.termination_reason; }
    } catch (error) {
      state.error = error.message;
    }
    render();
  }

  refresh().then(() => {
    if (state.error || stopped) return;
    stream = new EventStream("/v1/runs/" + runId + "/events", {
      step: (step) => {
        state.steps.set(step.sequence, step);
        // A model step changes what the run used of its budget: read the run again for its budget_use.
        if (step.kind === "model" && state.run && state.run.budget) refresh(); else render();
      },
      status: (event) => {
        const changed = event.status !== state.status;
        state.status = event.status; state.reason = event.termination_reason;
        if (changed) refresh(); else render();
      },
      progress: (progress) => {
        state.progress = progress;
        const seen = state.progressLog.get(progress.tool_call_id) || [];
        if (seen.length < 200) state.progressLog.set(progress.tool_call_id, [...seen, progress]);
        render();
      },
      delta: (delta) => {
        addDelta(delta);
        // Up to ten a second while an answer streams: the growing answer is written in place, the rest of the
        // page is left as it is (render draws it anew when the round is new).
        const cell = main.querySelector(`[data-testid=forming][data-round="${delta.round}"] [data-testid=forming-text] > bdi`);
        if (cell) cell.textContent = state.forming.text; else render();
      },
      end: () => { setConnection(""); refresh(); },
    });
  });
  return { render, stop: () => { stopped = true; clearInterval(ticker); clearInterval(treeTicker); if (stream) stream.stop(); } };
}

// -- routing and language ----------------------------------------------------------------------

function route() {
  if (view) view.stop();
  setConnection("");
  const match = location.hash.match(/^#\/runs\/([0-9a-f]{32})$/);  // else the list, with its filters after "?"
  view = match ? runView(match[1]) : listView();
}

function applyLanguage() {
  document.documentElement.lang = lang;
  for (const button of document.querySelectorAll("[data-lang]")) button.classList.toggle("active", button.dataset.lang === lang);
  for (const node of document.querySelectorAll("[data-ui]")) node.textContent = t(node.dataset.ui);
}

for (const button of document.querySelectorAll("[data-lang]")) {
  button.addEventListener("click", () => {
    lang = button.dataset.lang;
    localStorage.setItem("runbrake.lang", lang);
    applyLanguage();
    if (view) view.render();
  });
}

window.addEventListener("hashchange", route);
applyLanguage();
if (CONFIG.tokens && !sessionStorage.getItem(TOKEN_KEY)) askForToken();
route();
