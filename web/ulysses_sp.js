// Ulysses SP panel: a live view of the worker pools (devices, ranks, memory, models, state, step time, speed-up).
// Fed by GET /api/ulysses_sp/status and by the websocket events the server pushes while models load and sample.
import { app } from "../../scripts/app.js";
import { api } from "../../scripts/api.js";

const TAB_ID = "ulysses-sp";
const EVENTS = ["ulysses_sp.status", "ulysses_sp.step", "ulysses_sp.state", "ulysses_sp.pool"];
const state = { status: null, lastStep: {}, stepEvents: {}, error: null, containers: new Set() };

function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(attrs)) {
    if (key === "className") node.className = value;
    else if (key === "onclick") node.addEventListener("click", value);
    else node.setAttribute(key, value);
  }
  for (const child of children) {
    if (child === null || child === undefined) continue;
    node.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
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
  return typeof seconds === "number" ? `${(seconds * 1000).toFixed(0)} ms` : "-";
}

function memoryText(memory) {
  if (!memory || typeof memory !== "object") return "-";
  const used = memory.allocated ?? memory.used ?? memory.rss;
  const extra = [];
  if (typeof memory.total === "number") extra.push(`of ${bytes(memory.total)}`);
  if (typeof memory.reserved === "number") extra.push(`reserved ${bytes(memory.reserved)}`);
  if (typeof memory.peak === "number") extra.push(`peak ${bytes(memory.peak)}`);
  return bytes(used) + (extra.length ? ` (${extra.join(", ")})` : "");
}

function ranksOf(pool) {
  const inner = pool.pool || {};
  if (Array.isArray(inner.ranks)) return inner.ranks;
  if (Array.isArray(inner.workers)) return inner.workers;
  return pool.devices.map((device, rank) => ({ rank, device }));
}

function rankLine(rank, index, pool) {
  const alive = rank.alive === undefined ? "-" : rank.alive ? "alive" : "dead";
  return el("li", { className: "usp-rank", "data-rank": rank.rank ?? index },
    el("span", { className: "usp-r-rank" }, `rank ${rank.rank ?? index}`), " ",
    el("span", { className: "usp-r-device" }, rank.device ?? pool.devices[index] ?? "-"), " ",
    el("span", { className: "usp-r-pid" }, `pid ${rank.pid ?? "-"}`), " · ",
    el("span", { className: "usp-r-memory" }, memoryText(rank.memory)), " · ",
    el("span", { className: "usp-r-call" }, `call ${ms(rank.last_call_s)}`), " · ",
    el("span", { className: "usp-r-state" }, alive));
}

function renderPool(pool) {
  const key = pool.devices.join(",");
  const step = state.lastStep[key] || pool.last_step;
  const speedup = step && typeof step.speedup === "number" ? `x${step.speedup.toFixed(2)}` : "-";
  const inner = pool.pool || {};
  const models = pool.models.length
    ? pool.models.map((model) => el("li", { className: "usp-model" },
        `${model.path.split(/[\\/]/).pop()} [${model.dtype}]`,
        ...model.loras.map((lora) => ` + ${String(lora[0]).split(/[\\/]/).pop()} x${lora[1]}`)))
    : [el("li", { className: "usp-model usp-none" }, "no model loaded")];
  return el("section", { className: "usp-pool", "data-devices": key, "data-step-events": state.stepEvents[key] || 0 },
    el("h4", {}, pool.devices.join(", ")),
    el("div", { className: "usp-line" }, `layout ${pool.layout} (${pool.backend}, ${pool.world_size} ranks)`),
    el("div", { className: "usp-line usp-state" }, `state: ${pool.state}` +
      (inner.state ? ` (workers ${inner.state}, restarts ${inner.restarts ?? 0})` : "")),
    el("div", { className: "usp-line usp-step", title: "speed-up = median step time on one device / here, for " +
      "the same model and latent size, once both were run in this ComfyUI" },
      `last step: ${step ? ms(step.seconds) : "-"}  speed-up: ${speedup}`),
    el("div", { className: "usp-line usp-calls" },
      `calls: ${inner.calls ?? 0} · copied last call: ${bytes(inner.last_bytes_copied)}`),
    el("ul", { className: "usp-models" }, ...models),
    el("ul", { className: "usp-ranks" }, ...ranksOf(pool).map((rank, index) => rankLine(rank, index, pool))),
    inner.error ? el("div", { className: "usp-error" }, inner.error) : null,
  );
}

function render(container) {
  container.replaceChildren();
  const status = state.status;
  const actions = el("div", { className: "usp-actions" },
    el("button", { className: "usp-refresh", onclick: refresh }, "Refresh"),
    el("button", { className: "usp-unload", onclick: () => post("/ulysses_sp/unload") }, "Unload models"),
    el("button", { className: "usp-shutdown", onclick: () => post("/ulysses_sp/shutdown") }, "Shut down pools"));
  const body = [];
  if (state.error) body.push(el("div", { className: "usp-error" }, state.error));
  if (!status) body.push(el("div", { className: "usp-empty" }, "loading..."));
  else if (!status.pools.length) body.push(el("div", { className: "usp-empty" }, "No Ulysses SP pool is running."));
  else body.push(...status.pools.map(renderPool));
  container.append(el("div", { id: "ulysses-sp-panel", className: "usp-panel" },
    el("h3", {}, "Ulysses SP"), actions, ...body));
}

function renderAll() {
  for (const container of state.containers) {
    if (container.isConnected) render(container);
    else state.containers.delete(container);
  }
}

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

function refreshSoon(delayMs = 1000) {
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

function onEvent(event) {
  const data = event.detail || {};
  if (event.type === "ulysses_sp.status") state.status = data;
  else if (event.type === "ulysses_sp.step") {
    const key = (data.devices || []).join(",");
    state.lastStep[key] = data;
    state.stepEvents[key] = (state.stepEvents[key] || 0) + 1;
    refreshSoon();  // per-rank memory and call times come with the status, not with the step event
  }
  else if (state.status && (event.type === "ulysses_sp.state" || data.event === "state")) {
    const pool = state.status.pools.find((p) => p.devices.join(",") === (data.devices || []).join(","));
    if (pool && event.type === "ulysses_sp.state") pool.state = data.state;
    else if (pool && pool.pool) pool.pool.state = data.state;
  }
  renderAll();
}

const STYLE = `
.usp-panel { padding: 8px; font-size: 13px; }
.usp-panel h4 { margin: 10px 0 4px; }
.usp-actions button { margin: 2px 4px 6px 0; }
.usp-ranks { margin: 4px 0; padding-left: 0; list-style: none; }
.usp-rank { padding: 2px 0; border-bottom: 1px solid #8884; }
.usp-r-rank { font-weight: bold; }
.usp-error { color: #e66; white-space: pre-wrap; }
.usp-models { margin: 4px 0; padding-left: 18px; }
`;

function mountFloating() {
  // Older frontends without sidebar tabs: a small fixed panel instead.
  const box = el("div", { style: "position:fixed;right:8px;bottom:8px;z-index:1000;background:#222d;color:#eee;" +
    "max-height:50vh;overflow:auto;border-radius:6px" });
  document.body.append(box);
  state.containers.add(box);
  render(box);
}

app.registerExtension({
  name: "ulysses_sp.panel",
  async setup() {
    document.head.append(el("style", {}, STYLE));
    for (const name of EVENTS) api.addEventListener(name, onEvent);
    const manager = app.extensionManager;
    if (manager && typeof manager.registerSidebarTab === "function") {
      manager.registerSidebarTab({
        id: TAB_ID,
        icon: "pi pi-server",
        title: "Ulysses SP",
        tooltip: "Ulysses SP worker pools",
        type: "custom",
        render: (container) => { state.containers.add(container); render(container); refresh(); },
      });
    } else {
      mountFloating();
    }
    refresh();
  },
});
