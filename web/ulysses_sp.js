// Ulysses SP panel: the worker pools drawn (layout grid, memory and compute bars per rank, live step-time chart,
// state), fed by GET /api/ulysses_sp/status, the websocket events the server pushes, and ComfyUI's own progress events.
import { app } from "../../scripts/app.js";
import { api } from "../../scripts/api.js";

const TAB_ID = "ulysses-sp";
const OUR_EVENTS = ["ulysses_sp.status", "ulysses_sp.step", "ulysses_sp.state", "ulysses_sp.pool"];
const POLL_MS = 4000;            // memory and liveness change without events (a worker killed while idle)
const WARN = 0.85, DANGER = 0.95; // memory bar colours
const STRAGGLER = 1.15;           // a rank this much slower than the median is marked
const state = {
  status: null, error: null, containers: new Set(),
  steps: {},          // pool key -> [{seconds, baseline}] of the current prompt (one per model call)
  promptId: {},       // pool key -> the prompt those steps belong to
  stepEvents: {},     // pool key -> step events seen (tests read it)
  loading: {},        // pool key -> {fraction, message} while a model loads
  progress: null,     // ComfyUI's sampler progress {value, max}
  doctor: { running: false, result: null, error: null },
};

function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(attrs)) {
    if (value === undefined || value === null) continue;
    if (key === "className") node.className = value;
    else if (key === "onclick") node.addEventListener("click", value);
    else node.setAttribute(key, value);
  }
  for (const child of children.flat()) {
    if (child === null || child === undefined) continue;
    node.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  return node;
}

function svg(tag, attrs = {}, ...children) {
  const node = document.createElementNS("http://www.w3.org/2000/svg", tag);
  for (const [key, value] of Object.entries(attrs)) node.setAttribute(key, value);
  node.append(...children);
  return node;
}

function bytes(value) {
  if (typeof value !== "number" || !isFinite(value)) return "-";
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let index = 0;
  while (value >= 1024 && index < units.length - 1) { value /= 1024; index += 1; }
  return `${value.toFixed(index ? 1 : 0)} ${units[index]}`;
}

function ms(seconds) {
  return typeof seconds === "number" ? `${(seconds * 1000).toFixed(seconds < 0.01 ? 1 : 0)} ms` : "-";
}

const keyOf = (devices) => (devices || []).join(",");
const fileName = (path) => String(path).split(/[\\/]/).pop();
const median = (values) => {
  const sorted = [...values].sort((a, b) => a - b);
  return sorted.length ? sorted[Math.floor((sorted.length - 1) / 2)] : null;
};

function ranksOf(pool) {
  const inner = pool.pool || {};
  return Array.isArray(inner.ranks) ? inner.ranks : pool.devices.map((device, rank) => ({ rank, device }));
}

// ---- state as the user sees it ---------------------------------------------------------------------------------
function userState(pool) {
  const inner = pool.pool || {};
  const dead = ranksOf(pool).filter((rank) => rank.alive === false);
  const key = keyOf(pool.devices);
  if (inner.error) return { name: "failed", detail: inner.error, remedy: "press Refresh; if it stays, Shut down" };
  if (pool.state === "broken" || (dead.length && pool.state !== "starting")) {
    const why = dead.length ? dead.map((r) => `rank ${r.rank} on ${r.device} ${r.exit_cause || "is gone"}`)
      : [inner.last_error ? inner.last_error.text : "the workers were stopped after a fault"];
    return { name: "failed", detail: why.join("; "), remedy: "the next prompt restarts the pool " +
      `(worker logs: ${inner.log_dir || "-"}); or press Shut down` };
  }
  if (pool.state === "starting") return { name: inner.restarts ? "restarting" : "starting", detail: "" };
  if (pool.state === "loading") {
    const load = state.loading[key];
    return { name: "loading", detail: load ? `${Math.round(load.fraction * 100)}% ${load.message || ""}` : "",
      fraction: load ? load.fraction : null };
  }
  if (pool.state === "sampling" || pool.state === "busy") {
    const p = state.progress;
    return { name: "sampling", detail: p ? `step ${p.value}/${p.max}` : "", fraction: p ? p.value / p.max : null };
  }
  if (pool.state === "idle") return { name: "idle", detail: "" };
  return { name: pool.state, detail: "" };
}

function renderState(pool) {
  const shown = userState(pool);
  const inner = pool.pool || {};
  const parts = [el("span", { className: `usp-badge usp-badge-${shown.name}` }, shown.name),
    shown.detail ? el("span", { className: "usp-state-detail" }, ` ${shown.detail}`) : null];
  if (typeof shown.fraction === "number") parts.push(bar(shown.fraction, "usp-progress", ""));
  if (shown.remedy) parts.push(el("div", { className: "usp-remedy" }, `what to do: ${shown.remedy}`));
  if (shown.name !== "failed" && inner.last_error && inner.restarts)
    parts.push(el("div", { className: "usp-muted" }, `recovered after ${inner.restarts} restart(s); last fault: ` +
      inner.last_error.text.split("\n")[0]));
  return el("div", { className: "usp-state", "data-user-state": shown.name }, ...parts);
}

// ---- the machines the ranks run on (a pool may span machines: "node2:cuda:0" is on the joined machine node2) -----
const machineLabel = (name) => (name === "here" ? "this machine" : name);
const machineOfDevice = (device) => {
  const parts = String(device || "").split(":");
  return parts.length > 1 && !/^(cpu|cuda|mps|xpu|npu|\d+)$/.test(parts[0]) ? parts[0] : "here";
};

function machinesOf(pool) {
  const inner = pool.pool || {};
  if (Array.isArray(inner.machines) && inner.machines.length) return inner.machines;
  const found = new Map();  // an older status without the list: from each rank's machine or device
  ranksOf(pool).forEach((rank, index) => {
    const name = rank.machine || machineOfDevice(rank.device);
    if (!found.has(name)) found.set(name, { name, host: null, joined: null, ranks: [] });
    found.get(name).ranks.push(rank.rank ?? index);
  });
  return [...found.values()];
}

function rankSpan(ranks) {
  const sorted = [...ranks].sort((a, b) => a - b);
  const contiguous = sorted.every((value, i) => i === 0 || value === sorted[i - 1] + 1);
  return sorted.length > 1 && contiguous ? `r${sorted[0]}–r${sorted[sorted.length - 1]}` : sorted.map((r) => `r${r}`)
    .join(" ");
}

function renderMachines(machines) {
  if (machines.length < 2) return null;
  return el("div", { className: "usp-machines" }, ...machines.map((machine, index) => {
    const where = `${machineLabel(machine.name)}${machine.host ? ` (${machine.host})` : ""}` +
      (machine.joined === false ? " · not joined" : "");
    return el("span", { className: `usp-machine usp-machine-${index % 4}` + (machine.joined === false ?
      " usp-machine-away" : ""), "data-machine": machine.name }, `${where}: ${rankSpan(machine.ranks)}`);
  }));
}

// ---- the layout as a grid: one block per CFG group, ring rows x Ulysses columns, each Ulysses column split into
// its tensor-parallel ranks (TP is innermost: rank = ((cfg * R + ring) * U + ulysses) * T + tp, as sp_runtime.config).
// A pool over several machines colours each rank by its machine and names the machine of a row that has one.
function renderGrid(pool) {
  const config = pool.config || {};
  const u = config.ulysses_degree || 1, r = config.ring_degree || 1, c = config.cfg_degree || 1;
  const t = config.tensor_parallel_degree || 1;
  const ranks = ranksOf(pool);
  const machines = machinesOf(pool);
  const several = machines.length > 1;
  const machineIndex = new Map();
  machines.forEach((machine, index) => machine.ranks.forEach((rank) => machineIndex.set(rank, index)));
  const groups = [];
  for (let cfg = 0; cfg < c; cfg += 1) {
    const rows = [];
    for (let ring = 0; ring < r; ring += 1) {
      const cells = [], rowMachines = new Set();
      for (let uly = 0; uly < u; uly += 1) {
        for (let tp = 0; tp < t; tp += 1) {
          const index = ((cfg * r + ring) * u + uly) * t + tp;
          const rank = ranks[index] || { rank: index, device: pool.devices[index] };
          const machineAt = machineIndex.has(index) ? machineIndex.get(index) : 0;
          const machine = (machines[machineAt] || { name: "here" }).name;
          rowMachines.add(machine);
          const where = `ulysses ${uly}, ring ${ring}, cfg ${cfg}` + (t > 1 ? `, tp ${tp}` : "") +
            (several ? `, on ${machineLabel(machine)}` : "");
          cells.push(el("td", { className: "usp-cell" + (rank.alive === false ? " usp-dead" : "") +
            (t > 1 && tp === 0 && uly > 0 ? " usp-tp-first" : "") + (several ? ` usp-machine-${machineAt % 4}` : ""),
          "data-rank": index, "data-machine": machine, title: `rank ${index}: ${where}` },
            el("b", {}, `r${index}`), el("br"), rank.device));
        }
      }
      const rowMachine = several && rowMachines.size === 1 ? machineLabel([...rowMachines][0]) : "";
      const axis = [r > 1 ? `ring ${ring}` : "", rowMachine].filter(Boolean).join(" · ");
      rows.push(el("tr", {}, el("th", { className: "usp-axis" }, axis), ...cells));
    }
    groups.push(el("div", { className: "usp-cfg" },
      c > 1 ? el("div", { className: "usp-muted" }, cfg === 0 ? "CFG group 0 (cond)" : `CFG group ${cfg} (uncond)`)
        : null,
      el("table", { className: "usp-grid-table" }, ...rows)));
  }
  const title = `Ulysses ${u} × Ring ${r} × CFG ${c}` + (t > 1 ? ` × TP ${t}` : "") +
    ` = ${pool.world_size} ranks (${pool.backend})` + (several ? ` on ${machines.length} machines` : "");
  return el("div", { className: "usp-grid", "data-layout": pool.layout, "data-machines": machines.length },
    el("div", { className: "usp-label" }, "layout ", el("b", {}, pool.layout), ` · ${title}`),
    renderMachines(machines), ...groups);
}

// ---- bars ------------------------------------------------------------------------------------------------------
function bar(fraction, className, label, attrs = {}, split = null) {
  const clamped = Math.max(0, Math.min(1, fraction || 0));
  const level = clamped >= DANGER ? " usp-danger" : clamped >= WARN ? " usp-warn" : "";
  const fills = [];
  if (split !== null && split > 0) fills.push(el("div", { className: "usp-fill usp-fill-weights",
    style: `width:${(Math.min(split, clamped) * 100).toFixed(1)}%` }));
  fills.push(el("div", { className: "usp-fill" + level, style: `width:${(clamped * 100).toFixed(1)}%` }));
  return el("div", { className: `usp-bar ${className}`, "data-fraction": clamped.toFixed(3), ...attrs },
    ...fills, el("span", { className: "usp-bar-label" }, label));
}

function memoryFigures(memory) {
  if (!memory) return null;
  const used = memory.allocated ?? memory.rss;
  const limit = memory.total ?? memory.limit;
  if (typeof used !== "number" || typeof limit !== "number" || !limit) return null;
  const kind = memory.total ? "GPU memory" : memory.limit_kind || "limit";
  return { used, limit, kind, weights: memory.weights, peak: memory.peak, reserved: memory.reserved };
}

function renderMemory(pool) {
  const rows = ranksOf(pool).map((rank, index) => {
    const figures = memoryFigures(rank.memory);
    const name = `r${rank.rank ?? index} ${rank.device ?? ""}`;
    if (!figures) return el("div", { className: "usp-row" }, el("span", { className: "usp-row-name" }, name),
      el("span", { className: "usp-muted" }, rank.alive === false ? "not running" : "no figures yet"));
    const fraction = figures.used / figures.limit;
    const weights = typeof figures.weights === "number" ? figures.weights / figures.limit : null;
    const label = `${bytes(figures.used)} / ${bytes(figures.limit)}`;
    const title = `used / ${figures.kind}; peak ${bytes(figures.peak)}` +
      (figures.reserved ? `, reserved ${bytes(figures.reserved)}` : "") +
      (typeof figures.weights === "number" ? `; weights ${bytes(figures.weights)} (the darker part)` : "");
    return el("div", { className: "usp-row" }, el("span", { className: "usp-row-name" }, name),
      bar(fraction, "usp-mem-bar", label, { "data-rank": rank.rank ?? index, title }, weights));
  });
  const weights = ranksOf(pool).map((rank) => rank.memory && rank.memory.weights).find((w) => typeof w === "number");
  return el("div", { className: "usp-memory" }, el("div", { className: "usp-label" }, "memory per rank",
    weights ? el("span", { className: "usp-muted usp-weights" }, ` · weights ${bytes(weights)} per rank (darker)`)
      : null), ...rows);
}

function renderCompute(pool) {
  const ranks = ranksOf(pool);
  const times = ranks.map((rank) => rank.last_call_s).filter((t) => typeof t === "number");
  if (!times.length) return null;
  const slowest = Math.max(...times), middle = median(times);
  const rows = ranks.map((rank, index) => {
    const seconds = rank.last_call_s;
    const straggler = ranks.length > 1 && seconds === slowest && slowest > STRAGGLER * middle;
    return el("div", { className: "usp-row" + (straggler ? " usp-straggler" : "") },
      el("span", { className: "usp-row-name" }, `r${rank.rank ?? index}`),
      bar(typeof seconds === "number" ? seconds / slowest : 0, "usp-compute-bar",
        ms(seconds) + (straggler ? " · slowest" : ""), { "data-rank": rank.rank ?? index }));
  });
  const exchange = pool.pool && pool.pool.last_exchange_share;
  return el("div", { className: "usp-compute" },
    el("div", { className: "usp-label", title: "time each rank spent in the last model call (compute and exchanges)" },
      "last step per rank", typeof exchange === "number" ? ` · all-to-all ${(exchange * 100).toFixed(0)}%` : ""),
    ...rows);
}

// ---- the live step-time chart ------------------------------------------------------------------------------------
function renderChart(pool) {
  const key = keyOf(pool.devices);
  const points = state.steps[key] || [];
  const width = 260, height = 80, pad = 4;
  const baseline = [...points].reverse().find((p) => typeof p.baseline === "number");
  const top = Math.max(...points.map((p) => p.seconds), baseline ? baseline.baseline : 0, 1e-6) * 1.15;
  const x = (i) => pad + (points.length > 1 ? (i * (width - 2 * pad)) / (points.length - 1) : (width - 2 * pad) / 2);
  const y = (seconds) => height - pad - (seconds / top) * (height - 2 * pad);
  const chart = svg("svg", { viewBox: `0 0 ${width} ${height}`, class: "usp-chart-svg", width: "100%",
    height: String(height) });
  chart.append(svg("rect", { x: 0, y: 0, width, height, class: "usp-chart-bg" }));
  if (baseline) chart.append(svg("line", { x1: pad, x2: width - pad, y1: y(baseline.baseline),
    y2: y(baseline.baseline), class: "usp-chart-baseline" }));
  if (points.length > 1) chart.append(svg("polyline", { class: "usp-chart-line",
    points: points.map((p, i) => `${x(i).toFixed(1)},${y(p.seconds).toFixed(1)}`).join(" ") }));
  points.forEach((p, i) => chart.append(svg("circle", { cx: x(i).toFixed(1), cy: y(p.seconds).toFixed(1), r: 2.5,
    class: "usp-chart-point" })));
  const last = points[points.length - 1];
  const legend = last ? `step ${points.length}: ${ms(last.seconds)}` +
    (baseline ? ` · one device ${ms(baseline.baseline)} (measured) · x${(baseline.baseline / last.seconds).toFixed(2)}`
      : " · one device: not measured yet (run the same model on one device once)") : "no step in this prompt yet";
  return el("div", { className: "usp-chart", "data-points": points.length },
    el("div", { className: "usp-label" }, "step time, this prompt"), chart,
    el("div", { className: "usp-muted usp-chart-legend" }, legend));
}

function renderModels(pool) {
  const models = pool.models.length ? pool.models.map((model) => {
    const facts = [model.family, model.variant, model.weight_dtype || model.dtype, model.quant,
      model.options && model.options.shard_weights ? "sharded" : null].filter(Boolean).join(" · ");
    const loras = (model.loras || []).map((lora) => `${fileName(lora[0])} x${lora[1]}`)
      .concat(((model.weight_patches || {}).loras || []).map((lora) => `${lora[0]} x${lora[1]}`));
    return el("li", { className: "usp-model" }, el("b", {}, fileName(model.path)), ` ${facts}`,
      loras.length ? el("div", { className: "usp-muted" }, `LoRAs: ${loras.join(", ")}`) : null);
  }) : [el("li", { className: "usp-model usp-none" }, "no model loaded")];
  return el("ul", { className: "usp-models" }, ...models);
}

function renderPool(pool) {
  const key = keyOf(pool.devices);
  const inner = pool.pool || {};
  const shown = userState(pool);
  return el("section", { className: "usp-pool", "data-devices": key, "data-state": shown.name,
    "data-step-events": state.stepEvents[key] || 0 },
    el("h4", {}, pool.devices.join(", ")),
    renderState(pool), renderGrid(pool), renderModels(pool), renderMemory(pool), renderCompute(pool),
    renderChart(pool),
    el("div", { className: "usp-muted usp-calls" },
      `calls ${inner.calls ?? 0} · copied last call ${bytes(inner.last_bytes_copied)}`));
}

function renderDoctor() {
  const doctor = state.doctor;
  if (doctor.running) return el("div", { className: "usp-doctor usp-muted" }, "doctor running (about a minute)...");
  if (doctor.error) return el("div", { className: "usp-doctor usp-error" }, `doctor failed: ${doctor.error}`);
  const result = doctor.result && doctor.result.recommendation;
  if (!result) return null;
  return el("div", { className: "usp-doctor usp-doctor-result" },
    el("div", {}, "doctor recommends ", el("b", {}, result.recommended_layout),
      ` for ${result.model} at ${result.width}x${result.height} on ${doctor.result.devices.join(", ")}`),
    el("ul", {}, ...(result.reasons || []).map((reason) => el("li", {}, reason))));
}

function render(container) {
  container.replaceChildren();
  const status = state.status;
  const actions = el("div", { className: "usp-actions" },
    el("button", { className: "usp-refresh", onclick: refresh }, "Refresh"),
    el("button", { className: "usp-unload", onclick: () => post("/ulysses_sp/unload") }, "Unload models"),
    el("button", { className: "usp-shutdown", onclick: () => post("/ulysses_sp/shutdown") }, "Shut down pools"),
    el("button", { className: "usp-doctor-run", onclick: runDoctor }, "Run doctor"));
  const body = [];
  if (state.error) body.push(el("div", { className: "usp-error" }, state.error));
  if (!status) body.push(el("div", { className: "usp-empty" }, "loading..."));
  else if (!status.pools.length) body.push(el("div", { className: "usp-empty" }, "No Ulysses SP pool is running."));
  else body.push(...status.pools.map(renderPool));
  container.append(el("div", { id: "ulysses-sp-panel", className: "usp-panel" },
    el("h3", {}, "Ulysses SP"), actions, renderDoctor(), ...body));
}

function renderAll() {
  for (const container of state.containers) {
    if (container.isConnected) render(container);
    else state.containers.delete(container);
  }
}

// ---- server calls ------------------------------------------------------------------------------------------------
async function refresh() {
  try {
    const response = await api.fetchApi("/ulysses_sp/status");
    if (!response.ok) throw new Error(`status request failed: HTTP ${response.status}`);
    state.status = await response.json();
    state.error = null;
  } catch (error) {
    state.error = String(error);
  }
  renderAll();
}

let refreshTimer = null;

function refreshSoon(delayMs = 500) {
  clearTimeout(refreshTimer);
  refreshTimer = setTimeout(refresh, delayMs);
}

async function post(route) {
  try {
    const response = await api.fetchApi(route, { method: "POST" });
    if (!response.ok) throw new Error(`${route} failed: HTTP ${response.status}`);
    state.status = (await response.json()).status;
    state.error = null;
  } catch (error) {
    state.error = String(error);
  }
  renderAll();
}

async function runDoctor() {
  state.doctor = { running: true, result: null, error: null };
  renderAll();
  try {
    const response = await api.fetchApi("/ulysses_sp/doctor", { method: "POST" });
    const data = await response.json();
    if (!response.ok) throw new Error(data.error || `HTTP ${response.status}`);
    state.doctor = { running: false, result: data, error: null };
  } catch (error) {
    state.doctor = { running: false, result: null, error: String(error) };
  }
  renderAll();
}

// ---- events ------------------------------------------------------------------------------------------------------
function onOurEvent(event) {
  const data = event.detail || {};
  const key = keyOf(data.devices);
  if (event.type === "ulysses_sp.status") state.status = data;
  else if (event.type === "ulysses_sp.step") {
    if (data.prompt_id && data.prompt_id !== state.promptId[key]) {
      state.promptId[key] = data.prompt_id;
      state.steps[key] = [];  // the chart follows the current prompt
    }
    (state.steps[key] = state.steps[key] || []).push({ seconds: data.seconds, baseline: data.baseline_s });
    state.stepEvents[key] = (state.stepEvents[key] || 0) + 1;
    refreshSoon();  // per-rank memory and call times come with the status, not with the step event
  } else if (event.type === "ulysses_sp.state") {
    const pool = state.status && state.status.pools.find((p) => keyOf(p.devices) === key);
    if (pool) pool.state = data.state;
    if (data.state !== "loading") delete state.loading[key];
  } else if (data.event === "load_progress") {
    state.loading[key] = { fraction: data.fraction, message: data.message };
  } else if (data.event === "worker_died" || data.event === "restarted") {
    refreshSoon(0);
  }
  renderAll();
}

function onComfyEvent(event) {
  if (event.type === "execution_start") {
    state.progress = null;
  } else if (event.type === "progress") {
    state.progress = { value: event.detail.value, max: event.detail.max };
  } else if (event.type === "executing" && event.detail === null) {
    state.progress = null;
  }
  renderAll();
}

// ComfyUI's theme variables (light and dark palettes set them); fixed colours only for warning levels.
const STYLE = `
.usp-panel { padding: 8px; font-size: 12px; color: var(--fg-color); }
.usp-panel h3 { margin: 0 0 6px; }
.usp-panel h4 { margin: 12px 0 4px; border-top: 1px solid var(--border-color); padding-top: 8px; }
.usp-actions button { margin: 2px 4px 6px 0; background: var(--comfy-input-bg); color: var(--input-text, var(--fg-color));
  border: 1px solid var(--border-color); border-radius: 4px; padding: 3px 8px; cursor: pointer; }
.usp-label { margin: 8px 0 3px; font-weight: 600; }
.usp-muted { color: var(--descrip-text, #888); }
.usp-error { color: var(--error-text, #e55); white-space: pre-wrap; }
.usp-remedy { margin-top: 2px; color: var(--descrip-text, #888); }
.usp-badge { display: inline-block; padding: 1px 7px; border-radius: 9px; font-weight: 600; color: #fff;
  background: #6b7280; }
.usp-badge-idle { background: #15803d; } .usp-badge-sampling { background: #2563eb; }
.usp-badge-loading, .usp-badge-starting, .usp-badge-restarting { background: #b45309; }
.usp-badge-failed { background: #b91c1c; }
.usp-state-detail { font-variant-numeric: tabular-nums; }
.usp-state[data-user-state=failed] .usp-state-detail { color: var(--error-text, #e55); white-space: pre-wrap; }
.usp-grid-table { border-collapse: separate; border-spacing: 3px; }
.usp-cell { border: 1px solid var(--border-color); background: var(--comfy-input-bg); border-radius: 4px;
  padding: 2px 6px; text-align: center; min-width: 44px; }
.usp-cell.usp-dead { border-color: #b91c1c; background: #b91c1c33; }
.usp-cell.usp-tp-first { border-left-width: 3px; }  /* where a Ulysses column's TP group starts */
.usp-axis { font-weight: normal; color: var(--descrip-text, #888); padding-right: 4px; }
.usp-machines { display: flex; flex-wrap: wrap; gap: 4px; margin: 2px 0 4px; }
.usp-machine { border: 1px solid var(--border-color); border-radius: 4px; padding: 0 5px; }
.usp-machine.usp-machine-away { border-style: dashed; color: var(--descrip-text, #888); }
.usp-machine-0 { border-left: 4px solid #3b82f6; } .usp-machine-1 { border-left: 4px solid #a855f7; }
.usp-machine-2 { border-left: 4px solid #14b8a6; } .usp-machine-3 { border-left: 4px solid #f97316; }
.usp-row { display: flex; align-items: center; gap: 6px; margin: 2px 0; }
.usp-row-name { width: 72px; flex: none; overflow: hidden; text-overflow: ellipsis; white-space: nowrap; }
.usp-bar { position: relative; flex: 1; height: 16px; background: var(--comfy-input-bg);
  border: 1px solid var(--border-color); border-radius: 3px; overflow: hidden; }
.usp-fill { position: absolute; left: 0; top: 0; bottom: 0; background: #3b82f6aa; }
.usp-fill-weights { background: #3b82f6; z-index: 1; }
.usp-fill.usp-warn { background: #f59e0bcc; } .usp-fill.usp-danger { background: #dc2626cc; }
.usp-bar-label { position: relative; z-index: 2; padding-left: 4px; line-height: 16px; white-space: nowrap; }
.usp-compute-bar .usp-fill { background: #10b981aa; }
.usp-straggler .usp-compute-bar .usp-fill { background: #f59e0bcc; }
.usp-progress { height: 6px; margin-top: 3px; }
.usp-chart-bg { fill: var(--comfy-input-bg); stroke: var(--border-color); }
.usp-chart-line { fill: none; stroke: #3b82f6; stroke-width: 1.5; }
.usp-chart-point { fill: #3b82f6; }
.usp-chart-baseline { stroke: var(--descrip-text, #888); stroke-dasharray: 4 3; }
.usp-models { margin: 6px 0; padding-left: 16px; }
.usp-doctor { margin: 4px 0 8px; padding: 6px; border: 1px solid var(--border-color); border-radius: 4px; }
.usp-doctor ul { margin: 4px 0 0; padding-left: 16px; }
`;

function mountFloating() {
  // Older frontends without sidebar tabs: a small fixed panel instead.
  const box = el("div", { style: "position:fixed;right:8px;bottom:8px;z-index:1000;background:var(--comfy-menu-bg);" +
    "max-height:60vh;width:340px;overflow:auto;border-radius:6px;border:1px solid var(--border-color)" });
  document.body.append(box);
  state.containers.add(box);
  render(box);
}

const SIDEBAR_TAB = {
  id: TAB_ID,
  icon: "pi pi-server",
  title: "Ulysses SP",
  tooltip: "Ulysses SP worker pools",
  type: "custom",
  render: (container) => { state.containers.add(container); render(container); refresh(); },
};

function registeredByFrontend(manager) {
  // Frontends that read an extension's declared `sidebarTabs` have registered the tab by setup() time.
  const tabs = typeof manager.getSidebarTabs === "function" ? manager.getSidebarTabs() : [];
  return Array.isArray(tabs) && tabs.some((tab) => tab.id === TAB_ID);
}

app.registerExtension({
  name: "ulysses_sp.panel",
  sidebarTabs: [SIDEBAR_TAB],  // the declarative form, for frontends that take it
  async setup() {
    document.head.append(el("style", {}, STYLE));
    for (const name of OUR_EVENTS) api.addEventListener(name, onOurEvent);
    for (const name of ["execution_start", "progress", "executing"]) api.addEventListener(name, onComfyEvent);
    const manager = app.extensionManager;
    if (manager && registeredByFrontend(manager)) {
      // the frontend took the declared tab
    } else if (manager && typeof manager.registerSidebarTab === "function") {
      manager.registerSidebarTab(SIDEBAR_TAB);  // frontends 1.2 - 1.49 (ComfyUI 0.3.64 - 0.33)
    } else {
      mountFloating();
    }
    setInterval(() => {
      if (document.visibilityState === "visible" && [...state.containers].some((c) => c.isConnected)) refresh();
    }, POLL_MS);
    refresh();
  },
});
