// The Ironflow dashboard: one page, hash routes, the node's /v1 API.
//
// Every value from the API is put into the page as text (textContent, text
// nodes, attribute values set one by one): never innerHTML, so a step output
// holding "<script>" shows as those characters.
"use strict";

(() => {
  // One request per view every POLL_MS while the tab is visible: live, and cheap for the node.
  const POLL_MS = 2000;
  // The API key lives in this tab's sessionStorage only (gone when the tab closes).
  const KEY_STORAGE = "ironflow.apiKey";
  const TERMINAL = new Set(["completed", "failed", "cancelled"]);
  const RUN_STATUSES = ["waiting_for_capacity", "running", "waiting", "paused", "completed", "failed", "cancelled"];
  // The chart and the failure rates change slowly: re-read them every STATS_EVERY polls (30 s).
  const STATS_EVERY = 15;
  const STATS_QUERY = "/v1/stats/runs?window_s=3600&bucket_s=60";
  const CHART_GROUPS = ["completed", "failed", "cancelled", "active"];
  const chartGroup = (status) => (CHART_GROUPS.includes(status) ? status : "active");

  const main = document.getElementById("view");
  let view = null;        // the view on screen: {refresh(), token}
  let routeToken = 0;     // bumps on navigation: late answers for an old view are dropped
  let inflight = false;

  // ── DOM helpers: text only ──────────────────────────────────────────────

  function el(tag, attrs, ...children) {
    const node = document.createElement(tag);
    for (const [name, value] of Object.entries(attrs || {})) {
      if (value === null || value === undefined || value === false) continue;
      if (name === "class") node.className = value;
      else if (name === "text") node.textContent = String(value);
      else if (name.startsWith("on")) node.addEventListener(name.slice(2), value);
      else if (name === "dataset") Object.assign(node.dataset, value);
      else node.setAttribute(name, value === true ? "" : String(value));
    }
    append(node, children);
    return node;
  }

  function append(node, children) {
    for (const child of children) {
      if (child === null || child === undefined || child === false) continue;
      if (Array.isArray(child)) append(node, child);
      else node.append(child instanceof Node ? child : document.createTextNode(String(child)));
    }
  }

  // Replace a node's children; null/false children are skipped (replaceChildren would print "null").
  function fill(node, ...children) {
    node.replaceChildren();
    append(node, children);
    return node;
  }

  function badge(status) { return el("span", { class: `badge ${status}`, text: status }); }
  function runLink(id) { return el("a", { href: `#/runs/${encodeURIComponent(id)}`, class: "mono", text: id }); }
  function json(value) { return JSON.stringify(value, null, 2); }
  function fmtTime(epoch) { return epoch == null ? "—" : new Date(epoch * 1000).toLocaleString(); }

  function fmtDuration(seconds) {
    if (seconds == null || !isFinite(seconds)) return "—";
    const s = Math.max(0, seconds);
    if (s < 1) return `${Math.round(s * 1000)} ms`;
    if (s < 60) return `${s.toFixed(1)} s`;
    if (s < 3600) return `${Math.floor(s / 60)} m ${Math.floor(s % 60)} s`;
    return `${Math.floor(s / 3600)} h ${Math.floor((s % 3600) / 60)} m`;
  }

  // A live countdown to `inSeconds` from now; the ticker below updates it every second.
  function countdown(inSeconds) {
    const until = Date.now() / 1000 + inSeconds;
    const node = el("span", { class: "countdown", dataset: { until: String(until) } });
    tickOne(node);
    return node;
  }

  function tickOne(node) {
    const left = Number(node.dataset.until) - Date.now() / 1000;
    node.textContent = left > 0 ? `in ${fmtDuration(left)}` : "now (due)";
  }

  setInterval(() => document.querySelectorAll(".countdown").forEach(tickOne), 1000);

  function notice(message, isError) {
    const box = document.getElementById("notice");
    box.hidden = !message;
    box.className = isError ? "error" : "";
    box.textContent = message || "";
  }

  // ── the API ─────────────────────────────────────────────────────────────

  class ApiError extends Error {
    constructor(status, code, message) { super(message); this.status = status; this.code = code; }
  }

  async function api(method, path, body) {
    const headers = { Accept: "application/json" };
    const key = sessionStorage.getItem(KEY_STORAGE);
    if (key) headers.Authorization = `Bearer ${key}`;
    if (body !== undefined) headers["Content-Type"] = "application/json";
    const resp = await fetch(path, { method, headers, body: body === undefined ? undefined : JSON.stringify(body) });
    let data = null;
    try { data = await resp.json(); } catch (_) { data = null; }
    if (!resp.ok) {
      const err = new ApiError(resp.status, data && data.code, (data && data.message) || resp.statusText);
      if (resp.status === 401) renderAccess(true);
      throw err;
    }
    return data;
  }

  const get = (path) => api("GET", path);
  const post = (path, body) => api("POST", path, body);

  // ── access: the key, or none on a --dev node ────────────────────────────

  function renderAccess(needKey) {
    const box = document.getElementById("access");
    const key = sessionStorage.getItem(KEY_STORAGE);
    if (key) {
      box.replaceChildren(
        el("span", { class: "muted", text: `key …${key.slice(-4)}` }),
        el("button", { type: "button", text: "Forget key", onclick: () => { sessionStorage.removeItem(KEY_STORAGE); renderAccess(false); route(); } }),
      );
      return;
    }
    const input = el("input", { type: "password", id: "api-key", placeholder: "API key (ifkey_… or ifplatform_…)", autocomplete: "off" });
    const use = () => {
      const value = input.value.trim();
      if (!value) return;
      sessionStorage.setItem(KEY_STORAGE, value);
      renderAccess(false);
      notice("");
      route();
    };
    input.addEventListener("keydown", (e) => { if (e.key === "Enter") use(); });
    box.replaceChildren(
      needKey ? el("span", { text: "This node needs an API key:" }) : el("span", { class: "muted", text: "no key (dev node)" }),
      input,
      el("button", { type: "button", class: "primary", text: "Use key", onclick: use }),
    );
    if (needKey) notice("This node needs an API key. It is kept in this browser tab's session only.", true);
  }

  // ── views ───────────────────────────────────────────────────────────────

  function errorBox(err) {
    if (err instanceof ApiError && err.status === 403) {
      return el("div", { class: "panel" }, "This view needs a platform key (ifplatform_…); the key in use may not see it. ", el("span", { class: "muted", text: err.message }));
    }
    if (err instanceof ApiError && err.status === 401) {
      return el("div", { class: "panel" }, "Enter an API key above to see this view.");
    }
    return el("div", { class: "panel" }, el("span", { class: "badge failed", text: "error" }), " ", String(err.message || err));
  }

  // A view is {title, build(root) → refresh function}; refresh redraws only the live parts.
  const views = {
    runs: runsView,
    run: runView,
    functions: functionsView,
    events: eventsView,
    workers: workersView,
  };

  function runsView(root, params) {
    const status = el("select", { id: "filter-status" }, el("option", { value: "", text: "any status" }),
      RUN_STATUSES.map((s) => el("option", { value: s, text: s })));
    const fn = el("select", { id: "filter-function" }, el("option", { value: "", text: "any function" }));
    const search = el("input", { id: "search", placeholder: "run id or event id", size: 32 });
    status.value = params.get("status") || "";
    search.value = params.get("q") || "";
    const live = el("div", { id: "runs-live" });
    const chart = el("div", { class: "panel", id: "runs-chart" });
    let polls = 0;
    const setQuery = () => {
      const q = new URLSearchParams();
      if (status.value) q.set("status", status.value);
      if (fn.value) q.set("function", fn.value);
      if (search.value.trim()) q.set("q", search.value.trim());
      location.hash = `#/runs?${q}`;
    };
    status.addEventListener("change", setQuery);
    fn.addEventListener("change", setQuery);
    search.addEventListener("keydown", (e) => { if (e.key === "Enter") setQuery(); });
    root.append(
      el("h1", { text: "Runs" }),
      el("div", { class: "toolbar" }, status, fn, search,
        el("button", { type: "button", text: "Search", onclick: setQuery }),
        (params.toString() ? el("a", { href: "#/runs", text: "clear" }) : null)),
      chart,
      live,
    );
    get("/v1/functions?all=true").then((data) => {
      for (const f of data.functions) fn.append(el("option", { value: f.id, text: f.id }));
      fn.value = params.get("function") || "";
    }).catch(() => {});

    const q = (params.get("q") || "").trim();
    return async () => {
      let runs;
      let caption = null;
      if (q) {
        [runs, caption] = await searchRuns(q);
      } else {
        const query = new URLSearchParams({ limit: "50" });
        if (params.get("status")) query.set("status", params.get("status"));
        if (params.get("function")) query.set("function", params.get("function"));
        runs = (await get(`/v1/runs?${query}`)).runs;
      }
      fill(live, caption, runsTable(runs));
      if (polls++ % STATS_EVERY === 0) fill(chart, runsChart(await get(STATS_QUERY)));
    };
  }

  // Runs created per minute over the last hour, stacked by (current) status.
  function runsChart(stats) {
    const width = stats.bucket_s;
    const first = Math.floor(stats.since / width) * width;
    const columns = new Map();
    for (let t = first; t <= stats.db_now; t += width) columns.set(t, { completed: 0, failed: 0, cancelled: 0, active: 0 });
    for (const b of stats.buckets) {
      const col = columns.get(b.start);
      if (col) col[chartGroup(b.status)] += b.count;
    }
    const totals = [...columns.values()].map((c) => CHART_GROUPS.reduce((n, g) => n + c[g], 0));
    const peak = Math.max(1, ...totals);
    const bars = [...columns.entries()].map(([start, col], i) => {
      const column = el("div", { class: "col", title: `${new Date(start * 1000).toLocaleTimeString()}: ${totals[i]} runs` });
      for (const g of CHART_GROUPS) {
        if (!col[g]) continue;
        const part = el("div", { class: `c-${g}` });
        part.style.height = `${(col[g] / peak) * 72}px`;
        column.append(part);
      }
      return column;
    });
    return el("div", {},
      el("div", { class: "legend" }, el("strong", { text: "Runs per minute, last hour" }),
        el("span", { class: "muted", text: `peak ${peak}/min · ${totals.reduce((a, b) => a + b, 0)} runs` }),
        CHART_GROUPS.map((g) => el("span", {}, el("i", { class: `c-${g}` }), g))),
      el("div", { class: "chart" }, bars));
  }

  async function searchRuns(q) {
    try {
      const detail = await get(`/v1/runs/${encodeURIComponent(q)}`);
      return [[detail.run], el("p", { class: "muted", text: `Run ${q}` })];
    } catch (err) {
      if (!(err instanceof ApiError && err.status === 404)) throw err;
    }
    try {
      const event = await get(`/v1/events/${encodeURIComponent(q)}`);
      const details = await Promise.all(event.run_ids.slice(0, 50).map((id) => get(`/v1/runs/${encodeURIComponent(id)}`).catch(() => null)));
      return [details.filter(Boolean).map((d) => d.run),
        el("p", { class: "muted", text: `Runs started by event ${event.id} (${event.name})` })];
    } catch (err) {
      if (!(err instanceof ApiError && err.status === 404)) throw err;
    }
    return [[], el("p", { class: "muted", text: `No run or event has the id ${q}` })];
  }

  function runsTable(runs) {
    const now = Date.now() / 1000;
    const rows = runs.map((r) => el("tr", { class: "run-row", dataset: { runId: r.id, status: r.status } },
      el("td", {}, runLink(r.id)),
      el("td", {}, badge(r.status)),
      el("td", { text: r.function_id }),
      el("td", { text: `${r.attempt}/${r.max_attempts}` }),
      el("td", { text: r.recovery_count }),
      el("td", { text: fmtTime(r.started_at ?? r.created_at) }),
      el("td", { text: r.started_at == null ? "—" : fmtDuration((r.ended_at ?? now) - r.started_at) }),
    ));
    return el("table", { id: "runs-table" },
      el("thead", {}, el("tr", {}, ["run", "status", "function", "attempt", "recoveries", "started", "duration"].map((h) => el("th", { text: h })))),
      el("tbody", {}, rows.length ? rows : el("tr", {}, el("td", { colspan: 7, class: "muted", text: "No runs yet." }))));
  }

  function runView(root, params, runId) {
    const head = el("div");
    // Outlives the header's redraws, so an action's answer stays while the run moves on.
    const result = el("span", { id: "action-result", class: "muted" });
    const live = el("div", { id: "run-live" });
    root.append(head, live);
    let lastStatus = null;
    return async () => {
      const [detail, audit] = await Promise.all([
        get(`/v1/runs/${encodeURIComponent(runId)}`),
        get(`/v1/audit?run_id=${encodeURIComponent(runId)}&limit=200&include=data`),
      ]);
      const run = detail.run;
      if (run.status !== lastStatus) {
        lastStatus = run.status;
        head.replaceChildren(runHeader(run, detail.steps, result));
      }
      fill(live,
        runFacts(run, detail),
        waitingPanel(detail),
        runOutcome(run),
        el("h2", { text: "Timeline" }), timeline(detail, audit.events),
        el("h2", { text: "Steps" }), stepsPanel(detail.steps),
        el("h2", { text: "Audit trail" }), auditTable(audit.events),
      );
    };
  }

  function runHeader(run, steps, result) {
    const cancel = el("button", { type: "button", id: "cancel-run", class: "danger", text: "Cancel run",
      disabled: TERMINAL.has(run.status) });
    cancel.addEventListener("click", async () => {
      cancel.disabled = true;
      try {
        const answer = await post(`/v1/runs/${encodeURIComponent(run.id)}/cancel`, { reason: "cancelled from the dashboard" });
        // A run with undos (step.compensate) runs them, then ends cancelled.
        result.textContent = answer.compensating ? "cancelled: its undos run first" : "cancelled";
        refreshNow();
      } catch (err) { result.textContent = `cancel failed: ${err.message}`; cancel.disabled = false; }
    });
    const rerun = el("button", { type: "button", id: "rerun-run", text: "Re-run with the same event", disabled: !run.event_id });
    rerun.addEventListener("click", async () => {
      rerun.disabled = true;
      try {
        const answer = await post(`/v1/runs/${encodeURIComponent(run.id)}/rerun`);
        location.hash = `#/runs/${encodeURIComponent(answer.run_id)}`;
      } catch (err) { result.textContent = `re-run failed: ${err.message}`; rerun.disabled = false; }
    });
    return el("div", {},
      el("h1", {}, "Run ", el("span", { class: "mono", text: run.id }), " ", el("span", { id: "run-status" }, badge(run.status))),
      el("div", { class: "toolbar" }, cancel, rerun, runControl(run, steps, result), result));
  }

  // Run control (docs/run-control.md): the one action the run's status allows.
  function runControl(run, steps, result) {
    const action = (id, verb, text, body, describe) => {
      const button = el("button", { type: "button", id, class: "primary", text });
      button.addEventListener("click", async () => {
        button.disabled = true;
        try {
          result.textContent = describe(await post(`/v1/runs/${encodeURIComponent(run.id)}/${verb}`, body()));
          refreshNow();
        } catch (err) { result.textContent = `${text.toLowerCase()} failed: ${err.message}`; button.disabled = false; }
      });
      return button;
    };
    const resumed = (a) => `resumed (was ${a.resumed_from})${a.from_step ? ` from step '${a.from_step}'` : ""}` +
      `, ${a.steps_deleted} step row${a.steps_deleted === 1 ? "" : "s"} deleted, execution_seq ${a.execution_seq}` +
      (a.status === "waiting" ? "; waiting on its parked step (a sleep or wait not over yet)" : "");
    if (run.status === "paused") return action("resume-run", "resume", "Resume", () => ({}), resumed);
    if (run.status === "failed") {
      // Empty: the step that failed the run; otherwise that step and every later one run again.
      const names = [...new Set(steps.map((s) => s.name))];
      const picker = el("select", { id: "resume-from-step", title: "run again from this step" },
        el("option", { value: "", text: "from the failed step" }), names.map((n) => el("option", { value: n, text: `from step ${n}` })));
      return [action("resume-failed-run", "resume", "Resume from failed step", () => ({ from_step: picker.value || null }), resumed), picker];
    }
    if (TERMINAL.has(run.status)) return null;
    return action("pause-run", "pause", "Pause", () => undefined, () => "paused: resume it to go on from its next step");
  }

  function fact(label, value) { return el("div", {}, el("span", { text: label }), value); }

  function runFacts(run, detail) {
    const end = run.ended_at ?? detail.db_now;
    return el("div", { class: "panel grid" },
      fact("function", el("a", { href: `#/runs?function=${encodeURIComponent(run.function_id)}`, text: run.function_id })),
      fact("event", run.event_id ? el("a", { class: "mono", href: `#/runs?q=${encodeURIComponent(run.event_id)}`, text: run.event_id }) : "—"),
      fact("parent run", run.parent_run_id ? runLink(run.parent_run_id) : "—"),
      fact("attempt", `${run.attempt} / ${run.max_attempts}`),
      fact("recoveries", String(run.recovery_count)),
      fact("execution_seq", String(run.current_execution_seq)),
      fact("created", fmtTime(run.created_at)),
      fact("started", fmtTime(run.started_at)),
      fact("ended", fmtTime(run.ended_at)),
      fact("duration", run.started_at == null ? "—" : fmtDuration(end - run.started_at)),
      fact("concurrency key", run.concurrency_key ?? "—"),
      fact("lease", detail.lease ? el("span", {}, el("span", { class: "mono", text: detail.lease.session_id }), " expires ", countdown(detail.lease.expires_in_s)) : "—"),
    );
  }

  // Why the run waits and until when: the queue row, or the parked step.
  function waitingPanel(detail) {
    if (TERMINAL.has(detail.run.status)) return null;
    const reason = detail.waiting_reason;
    if (detail.run.status === "paused") {
      // A parked step still settles while paused; the run waits for a resume either way.
      return el("div", { class: "panel waiting", id: "waiting" },
        el("strong", { text: "Paused: " }), el("span", { id: "waiting-reason",
          text: `off the queue, holding no slot, until resumed${reason ? ` (its step: ${reason})` : ""}` }));
    }
    let until = null;
    if (detail.queue && detail.queue.eligible_at > detail.db_now) until = detail.queue.eligible_at - detail.db_now;
    for (const s of detail.steps) {
      if ((s.status === "sleeping" || s.status === "waiting") && s.wake_at != null) until = s.wake_at - detail.db_now;
    }
    if (!reason && until == null) return null;
    const child = reason && /invoked run (\S+)/.exec(reason);
    return el("div", { class: "panel waiting", id: "waiting" },
      el("strong", { text: "Waiting: " }), el("span", { id: "waiting-reason", text: reason || "queued" }),
      child ? el("span", {}, " → ", runLink(child[1])) : null,
      until != null ? el("span", {}, " — resumes ", countdown(until)) : null,
      detail.queue ? el("div", { class: "muted", text: `queue: ${detail.queue.reason}, execution_seq ${detail.queue.execution_seq}` }) : null);
  }

  function runOutcome(run) {
    if (run.error) {
      return el("div", { class: "panel", id: "run-outcome" }, el("h2", { text: "Error" }), errorView(run.error));
    }
    if (run.status === "completed") {
      return el("div", { class: "panel", id: "run-outcome" }, el("h2", { text: "Output" }), el("pre", { id: "run-output", text: json(run.output) }));
    }
    return null;
  }

  function errorView(error) {
    return el("div", {},
      el("pre", { class: "error", text: `${error.code}: ${error.message}` }),
      error.traceback ? el("details", {}, el("summary", { text: "traceback" }), el("pre", { class: "error", text: error.traceback })) : null);
  }

  // Each step's span: a run step ends when recorded (created_at) after duration_ms;
  // a durable step (sleep, wait, invoke) starts when recorded and lasts until wake_at.
  function stepSpan(step, now) {
    if (step.kind === "run") {
      const dur = (step.duration_ms || 0) / 1000;
      return [step.created_at - dur, step.status === "running" ? now : step.created_at];
    }
    const end = step.wake_at != null ? step.wake_at : (["sleeping", "waiting", "waking"].includes(step.status) ? now : step.created_at);
    return [step.created_at, Math.max(end, step.created_at)];
  }

  function segmentCause(seq, prevSteps, audit) {
    const recovered = audit.find((a) => a.type === "capacity.segment.recovered" && a.data && a.data.new_execution_seq === seq);
    if (recovered) {
      return `recovered: the lease of session ${recovered.data.session_id} was lost (recovery ${recovered.data.recovery_count})`;
    }
    const last = prevSteps[prevSteps.length - 1];
    if (last && last.kind !== "run") return `resumed after ${last.kind} "${last.name}"`;
    if (prevSteps.some((s) => s.status === "failed")) return "retry after a failed attempt";
    return "new segment (retry, nack or drain hand-off)";
  }

  function timeline(detail, audit) {
    const steps = detail.steps;
    const recoveries = audit.filter((a) => a.type === "capacity.segment.recovered" && a.data);
    if (!steps.length && !recoveries.length) return el("p", { class: "muted", text: "No steps recorded yet." });
    const now = detail.db_now;
    const spans = new Map(steps.map((s) => [s, stepSpan(s, now)]));
    const starts = [...spans.values()];
    const t0 = Math.min(detail.run.started_at ?? detail.run.created_at, ...starts.map((x) => x[0]));
    const t1 = Math.max(detail.run.ended_at ?? now, ...starts.map((x) => x[1]));
    const total = Math.max(t1 - t0, 0.001);
    // Every segment that left a trace: its steps, or a recovery that fenced it or started it.
    const seqs = new Set(steps.map((s) => s.execution_seq));
    for (const r of recoveries) { seqs.add(r.data.old_execution_seq); seqs.add(r.data.new_execution_seq); }
    const ordered = [...seqs].sort((a, b) => a - b);
    const rows = [];
    let previous = [];
    for (const seq of ordered) {
      const segSteps = steps.filter((s) => s.execution_seq === seq).sort((a, b) => spans.get(a)[0] - spans.get(b)[0]);
      const lost = recoveries.find((r) => r.data.old_execution_seq === seq);
      const cause = seq === ordered[0] ? "first segment" : segmentCause(seq, previous, audit);
      rows.push(el("div", { class: `tl-seg${recoveries.some((r) => r.data.new_execution_seq === seq) ? " gap" : ""}`, dataset: { seq: String(seq) } },
        `segment execution_seq ${seq} — ${cause}`,
        lost ? ` · lost its lease (session ${lost.data.session_id})` : "",
        segSteps.length ? "" : " · no steps recorded in it"));
      for (const s of segSteps) {
        const [a, b] = spans.get(s);
        const bar = el("div", { class: `tl-bar ${s.status}`, title: `${s.name}: ${s.status}, ${fmtDuration(b - a)}` });
        bar.style.left = `${((a - t0) / total) * 100}%`;
        bar.style.width = `${Math.max(((b - a) / total) * 100, 0.3)}%`;
        rows.push(el("div", { class: "tl-row" },
          el("div", { class: "name", title: s.name }, `${s.name} `, el("span", { class: "muted", text: `(${s.kind})` })),
          el("div", { class: "tl-track" }, bar),
          el("div", { class: "muted", text: fmtDuration(b - a) })));
      }
      previous = segSteps;
    }
    return el("div", { class: "panel timeline", id: "timeline" },
      el("div", { class: "muted", text: `${fmtTime(t0)} → ${fmtDuration(total)}` }), rows);
  }

  function stepsPanel(steps) {
    if (!steps.length) return el("p", { class: "muted", text: "No steps." });
    return el("div", { class: "panel", id: "steps" }, steps.map((s) => el("div", { class: "step", dataset: { step: s.name } },
      el("div", { class: "step-head" }, el("strong", { text: s.name }), badge(s.status),
        el("span", { class: "muted", text: `${s.kind} · execution_seq ${s.execution_seq} · ${s.duration_ms == null ? "—" : fmtDuration(s.duration_ms / 1000)}` })),
      s.error ? errorView(s.error) : null,
      s.output !== null && s.output !== undefined ? el("pre", { class: "step-output", text: json(s.output) }) : null)));
  }

  function auditTable(events) {
    if (!events.length) return el("p", { class: "muted", text: "No audit entries for this run (ordinary entries need audit: true on the function)." });
    return el("table", { id: "audit" },
      el("thead", {}, el("tr", {}, ["at", "type", "data"].map((h) => el("th", { text: h })))),
      el("tbody", {}, events.map((a) => el("tr", {},
        el("td", { text: fmtTime(a.at) }), el("td", { class: "mono", text: a.type }),
        el("td", { class: "mono", text: JSON.stringify(a.data) })))));
  }

  function jsonInput(textarea) {
    const raw = textarea.value.trim();
    return raw ? JSON.parse(raw) : {};
  }

  function functionsView(root) {
    const live = el("div", { id: "functions-live" });
    root.append(el("h1", { text: "Functions" }), live);
    const forms = new Map();  // keep each invoke form (and what was typed) across refreshes
    let polls = 0;
    let counts = new Map();  // function id → {runs, failed} over the last hour
    return async () => {
      const functions = (await get("/v1/functions?all=true")).functions;
      if (polls++ % STATS_EVERY === 0) {
        counts = new Map();
        for (const c of (await get(STATS_QUERY)).functions) {
          const entry = counts.get(c.function_id) || { runs: 0, failed: 0 };
          entry.runs += c.count;
          if (c.status === "failed") entry.failed += c.count;
          counts.set(c.function_id, entry);
        }
      }
      fill(live, el("table", { id: "functions-table" },
        el("thead", {}, el("tr", {}, ["function", "triggers", "retries", "concurrency", "runs (1 h)", "failed (1 h)", "last seen", "state", "invoke"].map((h) => el("th", { text: h })))),
        el("tbody", {}, functions.length ? functions.map((f) => {
          if (!forms.has(f.id)) forms.set(f.id, invokeForm(f.id));
          const d = f.definition;
          const r = d.retries;
          return el("tr", { dataset: { functionId: f.id } },
            el("td", {}, el("a", { href: `#/runs?function=${encodeURIComponent(f.id)}`, class: "mono", text: f.id }),
              f.deleted_at != null ? el("div", { class: "badge failed", text: `deleted ${fmtTime(f.deleted_at)}` })
                : f.live ? null : el("div", { class: "muted", text: "not live" })),
            el("td", { class: "mono" }, d.triggers.map((t) => t.event).filter(Boolean).join(", ") || null,
              scheduleLines(f)),
            el("td", { text: `${r.max_attempts} attempts, ${r.initial_delay_s}s ×${r.backoff_factor} ≤ ${r.max_delay_s}s` }),
            el("td", { text: d.concurrency ? `${d.concurrency.limit}${d.concurrency.key ? ` per ${d.concurrency.key}` : ""}` : "unlimited" }),
            el("td", { class: "runs-1h", text: (counts.get(f.id) || { runs: 0 }).runs }),
            el("td", { class: "failed-1h", text: failureRate(counts.get(f.id)) }),
            el("td", { text: fmtTime(f.last_seen_at) }),
            el("td", {}, pauseButton(f)),
            el("td", {}, forms.get(f.id)));
        }) : el("tr", {}, el("td", { colspan: 9, class: "muted", text: "No functions registered: start a worker." })))));
    };
  }

  // Cron triggers and pause/resume (docs/schedules.md).
  function scheduleLines(f) {
    return (f.schedules || []).map((sc) =>
      el("div", { class: "schedule", text: `cron ${sc.cron}${sc.timezone === "UTC" ? "" : ` (${sc.timezone})`} · next ${fmtTime(sc.next_at)}${lastTick(sc)}` }));
  }

  // What the schedule's last tick did: fired, or skipped (how many in a row, why).
  function lastTick(sc) {
    if (sc.last_tick_at == null) return "";
    if (sc.skip_reason == null) return ` · last ${fmtTime(sc.last_tick_at)}`;
    return ` · skipped ${sc.skipped_ticks}× ${sc.skip_reason}`;
  }

  function pauseButton(f) {
    const paused = f.paused_at != null;
    const result = el("div", { class: "result" });
    const button = el("button", { type: "button", class: paused ? "primary pause-toggle" : "danger pause-toggle",
      text: paused ? "Resume" : "Pause" });
    button.addEventListener("click", async () => {
      button.disabled = true;
      try {
        await post(`/v1/functions/${encodeURIComponent(f.id)}/${paused ? "resume" : "pause"}`, paused ? { catchup: false } : undefined);
        result.textContent = paused ? "resumed" : "paused";
      } catch (err) { result.textContent = `failed: ${err.message}`; button.disabled = false; }
    });
    return el("div", {}, el("div", { class: paused ? "badge failed" : "muted", text: paused ? `paused ${fmtTime(f.paused_at)}` : "active" }), button, result);
  }

  function failureRate(count) {
    if (!count || !count.runs) return "—";
    return `${count.failed} (${Math.round((100 * count.failed) / count.runs)} %)`;
  }

  function invokeForm(functionId) {
    const data = el("textarea", { class: "invoke-data", placeholder: '{"key": "value"}', rows: 2 });
    const result = el("div", { class: "result" });
    const button = el("button", { type: "button", class: "primary", text: "Invoke" });
    button.addEventListener("click", async () => {
      result.replaceChildren();
      let body;
      try { body = { data: jsonInput(data) }; } catch (err) { result.textContent = `invalid JSON: ${err.message}`; return; }
      try {
        const answer = await post(`/v1/functions/${encodeURIComponent(functionId)}/invoke`, body);
        result.replaceChildren("started ", runLink(answer.run_id));
      } catch (err) { result.textContent = `invoke failed: ${err.message}`; }
    });
    return el("div", {}, data, button, result);
  }

  function eventsView(root) {
    const name = el("input", { id: "event-name", placeholder: "event name, e.g. order.created", size: 30 });
    const data = el("textarea", { id: "event-data", placeholder: '{"order": 1}' });
    const result = el("div", { class: "result", id: "send-result" });
    const send = async () => {
      result.replaceChildren();
      let body;
      try { body = { name: name.value.trim(), data: jsonInput(data) }; } catch (err) { result.textContent = `invalid JSON: ${err.message}`; return; }
      try {
        const answer = await post("/v1/events", body);
        fill(result, `event ${answer.event_id} `, answer.run_ids.length ? ["started ", answer.run_ids.map((id) => [runLink(id), " "])] : "started no run",
          (answer.paused_function_ids || []).length ? ` (paused, not started: ${answer.paused_function_ids.join(", ")})` : "");
        refreshNow();
      } catch (err) { result.textContent = `send failed: ${err.message}`; }
    };
    const live = el("div", { id: "events-live" });
    root.append(el("h1", { text: "Events" }),
      el("div", { class: "panel" }, el("h2", { text: "Send an event" }), el("div", { class: "toolbar" }, name), data,
        el("div", { class: "toolbar" }, el("button", { type: "button", id: "send-event", class: "primary", text: "Send", onclick: send })), result),
      el("h2", { text: "Recent events" }), live);
    return async () => {
      // Ingest-side flow control (docs/flow-control.md): pending debounces, and per event what it did.
      const [events, debounces] = await Promise.all([
        get("/v1/events?limit=50&include=data").then((d) => d.events), get("/v1/debounces").then((d) => d.debounces)]);
      const flow = (e) => (e.flow || []).map((n) => [el("span", { class: "muted", text: `${n.function_id}: ${n.reason}` }), el("br")]);
      fill(live, el("table", { id: "events-table" },
        el("thead", {}, el("tr", {}, ["event", "name", "received", "runs", "flow control", "data"].map((h) => el("th", { text: h })))),
        el("tbody", {}, events.length ? events.map((e) => el("tr", {},
          el("td", { class: "mono", text: e.id }), el("td", { text: e.name }), el("td", { text: fmtTime(e.received_at) }),
          el("td", {}, e.run_ids.length ? e.run_ids.map((id) => [runLink(id), el("br")]) : el("span", { class: "muted", text: "none" }),
            // Trigger filters and cancel-on (docs/triggers.md): who it did not start and why, what it cancelled.
            (e.filtered || []).map((f) => el("div", { class: f.error ? "filtered error" : "filtered muted", text: `not started: ${f.function_id}: ${f.reason}` })),
            (e.cancelled_run_ids || []).map((id) => el("div", {}, "cancelled ", runLink(id)))),
          el("td", {}, flow(e)),
          el("td", { class: "mono", text: JSON.stringify(e.data).slice(0, 200) })))
          : el("tr", {}, el("td", { colspan: 6, class: "muted", text: "No events yet." })))),
        el("h2", { text: `Pending debounces (${debounces.length})` }),
        table("debounces-table", ["function", "key", "run", "last event", "fires"],
          debounces.map((d) => [d.function_id, d.key || "—", runLink(d.run_id), el("span", { class: "mono", text: d.event_id }), countdown(d.fire_in_s)])));
    };
  }

  function workersView(root) {
    const live = el("div", { id: "workers-live" });
    root.append(el("h1", { text: "Workers & capacity" }),
      el("p", { class: "muted", text: "Platform key only, like `ironflow capacity`." }), live);
    return async () => {
      const [sessions, leases, queue] = await Promise.all([
        get("/v1/capacity/sessions"), get("/v1/capacity/leases"), get("/v1/capacity/queue")]);
      fill(live,
        el("h2", { text: `Sessions (${sessions.sessions.length})` }),
        table("sessions-table", ["session", "worker", "node", "mode", "busy / held / max", "state", "expires", "functions"],
          sessions.sessions.map((s) => [el("span", { class: "mono", text: s.session_id }), s.worker_id, s.node_id, s.mode,
            `${s.credits_claimed} / ${s.credits_held} / ${s.max_concurrent_jobs}`, s.draining ? "DRAINING" : "active",
            fmtTime(s.expires_at), s.function_ids.join(", ")])),
        el("h2", { text: `Leases (${leases.leases.length})` }),
        table("leases-table", ["run", "function", "execution_seq", "session", "node", "expires"],
          leases.leases.map((l) => [runLink(l.run_id), l.function_id, l.execution_seq, el("span", { class: "mono", text: l.session_id }), l.node_id, countdown(l.expires_in_s)])),
        el("h2", { text: `Queue (${queue.queue.length})` }),
        table("queue-table", ["run", "function", "execution_seq", "reason", "eligible", "reserved by"],
          queue.queue.map((q) => [runLink(q.run_id), q.function_id, q.execution_seq, q.reason, countdown(q.eligible_in_s), q.reservation_owner ?? "—"])),
      );
    };
  }

  function table(id, headers, rows) {
    return el("table", { id },
      el("thead", {}, el("tr", {}, headers.map((h) => el("th", { text: h })))),
      el("tbody", {}, rows.length ? rows.map((cells) => el("tr", {}, cells.map((c) => el("td", {}, c))))
        : el("tr", {}, el("td", { colspan: headers.length, class: "muted", text: "none" }))));
  }

  // ── routing and the poll ────────────────────────────────────────────────

  function parseHash() {
    const hash = location.hash.replace(/^#\/?/, "");
    const [path, query] = hash.split("?");
    const parts = path.split("/").filter(Boolean).map(decodeURIComponent);
    const params = new URLSearchParams(query || "");
    if (parts[0] === "runs" && parts[1]) return ["run", params, parts[1]];
    return [views[parts[0]] ? parts[0] : "runs", params, null];
  }

  async function refreshNow() {
    if (!view || inflight || view.refused) return;
    const token = routeToken;
    inflight = true;
    try {
      await view.refresh();
      if (token === routeToken) notice("");
    } catch (err) {
      if (token === routeToken && view.errorSlot) {
        view.errorSlot.replaceChildren(errorBox(err));
        // Refused for this key: asking again every 2 s would only load the node.
        if (err instanceof ApiError && (err.status === 401 || err.status === 403)) view.refused = true;
      }
    } finally {
      inflight = false;
    }
  }

  function route() {
    routeToken += 1;
    inflight = false;
    const [name, params, arg] = parseHash();
    document.querySelectorAll("header nav a").forEach((a) =>
      a.classList.toggle("active", a.dataset.view === (name === "run" ? "runs" : name)));
    const errorSlot = el("div", { id: "view-error" });
    main.replaceChildren(errorSlot);
    const refresh = views[name](main, params, arg);
    view = {
      errorSlot,
      refresh: async () => { await refresh(); errorSlot.replaceChildren(); },
    };
    refreshNow();
  }

  setInterval(() => { if (!document.hidden) refreshNow(); }, POLL_MS);
  document.addEventListener("visibilitychange", () => { if (!document.hidden) refreshNow(); });
  window.addEventListener("hashchange", route);
  renderAccess(false);
  route();
})();
