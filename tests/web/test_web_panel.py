"""The Ulysses SP panel (web/ulysses_sp.js) in headless Chromium against a running ComfyUI: the sidebar tab draws
the pool (layout grid, its ranks grouped by machine for a pool over several, memory and compute bars per rank,
models, a step-time chart that gains a point per step from the websocket events), shows a killed worker as failed
and then the recovery, runs the doctor, and follows ComfyUI's light and dark palettes (screenshots go to the test's
temporary folder, or SP_PANEL_SCREENSHOT).

Needs COMFYUI_PATH, the `playwright` Python package and a Chromium at /usr/bin/chromium (Debian's `chromium`);
skipped with the reason otherwise.
"""
import os
import shutil

import pytest

import comfy_support as cs

CHROMIUM = os.environ.get("CHROMIUM", "/usr/bin/chromium")
CHROMIUM_FLAGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync"]


def _skip_reason():
    if cs.comfyui_path() is None:
        return cs.NO_COMFYUI
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        return "the playwright package is not installed (pip install playwright; the browser is Debian's chromium)"
    if not (os.path.isfile(CHROMIUM) or shutil.which(CHROMIUM)):
        return f"no Chromium at {CHROMIUM} (apt-get install chromium, or set CHROMIUM)"
    return None


pytestmark = pytest.mark.skipif(_skip_reason() is not None, reason=_skip_reason() or "")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with cs.running_server(str(tmp_path_factory.mktemp("comfy_web"))) as running:
        yield running


@pytest.fixture(scope="module")
def page(server, tmp_path_factory):
    from playwright.sync_api import sync_playwright
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_FLAGS)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 900})
            page.goto(server.url("/"), wait_until="domcontentloaded", timeout=120_000)
            page.wait_for_selector(".ulysses-sp-tab-button", timeout=120_000)
            yield page
        finally:
            browser.close()


def run_prompt(server, seed):
    from test_comfy_server import follow, workflow
    kind, data, _ = follow(server, workflow(seed=seed))
    assert kind == "execution_success", data


def close_dialogs(page):
    """A fresh ComfyUI user gets a templates dialog first; close it as a person would (Escape)."""
    for _ in range(10):  # the dialog's overlay: PrimeVue's mask (frontend 1.27) or the newer frontends' overlay
        if not page.query_selector(".p-dialog-mask, [data-testid='dialog-overlay'][data-state='open']"):
            return
        page.keyboard.press("Escape")
        page.wait_for_timeout(300)


def open_panel(page):
    close_dialogs(page)
    if not page.query_selector("#ulysses-sp-panel"):
        page.click(".ulysses-sp-tab-button")
    page.wait_for_selector("#ulysses-sp-panel", timeout=30_000)


POOL = "#ulysses-sp-panel .usp-pool[data-devices='cpu,cpu']"


def set_theme(page, palette):
    """ComfyUI's own colour palette setting ('dark' or 'light'); returns the panel's text colour under it."""
    page.evaluate("async (id) => await window.comfyAPI.app.app.extensionManager.setting.set("
                  "'Comfy.ColorPalette', id)", palette)
    page.wait_for_timeout(500)
    return page.evaluate("getComputedStyle(document.querySelector('#ulysses-sp-panel')).color")


def test_panel_shows_an_empty_state_then_the_pool_drawn(server, page, tmp_path):
    open_panel(page)
    page.wait_for_selector("#ulysses-sp-panel .usp-empty:has-text('No Ulysses SP pool')", timeout=30_000)
    run_prompt(server, seed=1)
    page.click("#ulysses-sp-panel .usp-refresh")
    page.wait_for_selector(f"{POOL}[data-state='idle'] .usp-compute-bar", timeout=30_000)
    pool = page.query_selector(POOL)
    # the layout grid: one cell per rank with its device
    assert pool.query_selector(".usp-grid").get_attribute("data-layout") == "u2"
    cells = pool.query_selector_all(".usp-cell")
    assert [cell.get_attribute("data-rank") for cell in cells] == ["0", "1"]
    assert all("cpu" in cell.inner_text() for cell in cells)
    # memory bars: RSS against the machine's memory (no address-space limit here), weights known
    bars = pool.query_selector_all(".usp-mem-bar")
    assert len(bars) == 2 and all(0 < float(bar.get_attribute("data-fraction")) < 1 for bar in bars)
    assert all(" / " in bar.inner_text() and "weights" in bar.get_attribute("title") for bar in bars)
    assert "weights" in pool.query_selector(".usp-weights").inner_text()
    # compute bars: the slowest rank's bar is full, every bar names its time
    compute = pool.query_selector_all(".usp-compute-bar")
    assert max(float(bar.get_attribute("data-fraction")) for bar in compute) == 1.0
    assert all(bar.inner_text().split(" ms")[0].replace(".", "").isdigit() for bar in compute)
    assert "tiny_qwen_image.safetensors" in pool.query_selector(".usp-models").inner_text()
    assert int(pool.query_selector(".usp-chart").get_attribute("data-points")) == 3  # steps=3 in the workflow
    dark = set_theme(page, "dark")
    page.screenshot(path=str(tmp_path / "panel_dark.png"))
    light = set_theme(page, "light")
    page.screenshot(path=str(tmp_path / "panel_light.png"))
    assert dark != light, "the panel's text colour must follow ComfyUI's palette"
    if os.environ.get("SP_PANEL_SCREENSHOT"):  # a folder outside the repository, for a person to look at
        for palette in ("light", "dark"):
            set_theme(page, palette)
            page.screenshot(path=os.path.join(os.environ["SP_PANEL_SCREENSHOT"], f"panel_{palette}.png"))


def test_grid_splits_each_ulysses_column_into_its_tp_ranks(server, page):
    """A TP pool's status (the running pool's, its layout restated as Ulysses 1 x TP 2) draws rank r at
    ((cfg * R + ring) * U + ulysses) * T + tp, as sp_runtime.config numbers the ranks, and names the TP axis."""
    open_panel(page)
    page.wait_for_selector(POOL, timeout=30_000)
    titles = page.evaluate("""async () => {
        const api = window.comfyAPI.api.api;
        const status = await (await api.fetchApi("/ulysses_sp/status")).json();
        const pool = status.pools.find((p) => p.devices.join(",") === "cpu,cpu");
        Object.assign(pool.config, { ulysses_degree: 1, ring_degree: 1, cfg_degree: 1, tensor_parallel_degree: 2 });
        pool.layout = "tp2";
        api.dispatchEvent(new CustomEvent("ulysses_sp.status", { detail: status }));
        const grid = document.querySelector("#ulysses-sp-panel .usp-pool[data-devices='cpu,cpu'] .usp-grid");
        return [grid.querySelector(".usp-label").innerText,
                ...[...grid.querySelectorAll(".usp-cell")].map((cell) => cell.title)];
    }""")
    assert "TP 2" in titles[0], titles
    assert titles[1:] == ["rank 0: ulysses 0, ring 0, cfg 0, tp 0", "rank 1: ulysses 0, ring 0, cfg 0, tp 1"]


def test_grid_groups_the_ranks_by_machine(server, page):
    """A pool over two machines (the running pool's status restated as u1 x r2 with rank 1 on the joined machine
    node2, as pool.status() reports it): each cell names its machine, each ring row that one machine holds is
    labelled with it, and a legend lists the machines with their hosts and ranks."""
    open_panel(page)
    page.wait_for_selector(POOL, timeout=30_000)
    drawn = page.evaluate("""async () => {
        const api = window.comfyAPI.api.api;
        const status = await (await api.fetchApi("/ulysses_sp/status")).json();
        const pool = status.pools.find((p) => p.devices.join(",") === "cpu,cpu");
        Object.assign(pool.config, { ulysses_degree: 1, ring_degree: 2, cfg_degree: 1, tensor_parallel_degree: 1 });
        pool.layout = "r2";
        Object.assign(pool.pool.ranks[1], { device: "node2:cpu", machine: "node2" });
        pool.pool.machines = [{ name: "here", host: "hostbox", joined: true, ranks: [0] },
                              { name: "node2", host: "10.0.0.2:40000", joined: true, ranks: [1] }];
        api.dispatchEvent(new CustomEvent("ulysses_sp.status", { detail: status }));
        const grid = document.querySelector("#ulysses-sp-panel .usp-pool[data-devices='cpu,cpu'] .usp-grid");
        return { machines: grid.dataset.machines,
                 cells: [...grid.querySelectorAll(".usp-cell")].map((cell) => [cell.dataset.machine, cell.title]),
                 rows: [...grid.querySelectorAll(".usp-axis")].map((th) => th.innerText),
                 legend: [...grid.querySelectorAll(".usp-machine")].map((chip) => chip.innerText),
                 colours: [...grid.querySelectorAll(".usp-cell")]
                     .map((cell) => getComputedStyle(cell).borderLeftColor) };
    }""")
    assert drawn["machines"] == "2"
    assert drawn["cells"] == [["here", "rank 0: ulysses 0, ring 0, cfg 0, on this machine"],
                              ["node2", "rank 1: ulysses 0, ring 1, cfg 0, on node2"]]
    assert drawn["rows"] == ["ring 0 · this machine", "ring 1 · node2"]
    assert drawn["legend"] == ["this machine (hostbox): r0", "node2 (10.0.0.2:40000): r1"]
    assert drawn["colours"][0] != drawn["colours"][1], "each machine's ranks are drawn in its own colour"
    page.click("#ulysses-sp-panel .usp-refresh")  # the real single-machine status again: no machine legend
    page.wait_for_selector(f"{POOL} .usp-grid[data-machines='1']", timeout=30_000)
    assert not page.query_selector(f"{POOL} .usp-machine")


def test_chart_gains_one_point_per_step_while_sampling(server, page):
    open_panel(page)
    page.wait_for_selector(POOL, timeout=30_000)
    before = int(page.get_attribute(POOL, "data-step-events"))
    page.evaluate("""() => {  // every point count the chart shows, in order (each event renders the panel)
        window.uspSeen = [];
        const note = () => {
            const chart = document.querySelector("#ulysses-sp-panel .usp-chart");
            const value = chart && Number(chart.dataset.points);
            if (value !== window.uspSeen[window.uspSeen.length - 1]) window.uspSeen.push(value);
        };
        new MutationObserver(note).observe(document.body, {childList: true, subtree: true});
    }""")
    run_prompt(server, seed=2)  # 3 steps, no refresh: only the pushed events can change the panel
    page.wait_for_function(f"document.querySelector(\"{POOL}\").dataset.stepEvents >= {before + 3}",
                           timeout=30_000)
    seen = page.evaluate("window.uspSeen")
    assert seen[-3:] == [1, 2, 3], f"points seen on the chart while sampling: {seen}"


def test_a_killed_worker_shows_failed_then_recovery(server, page, tmp_path):
    import signal
    open_panel(page)
    page.wait_for_selector(f"{POOL}[data-state='idle']", timeout=30_000)
    victim = server.get_json("/ulysses_sp/status")["pools"][0]["pool"]["ranks"][1]["pid"]
    assert victim in server.descendants()  # a worker of the server this test started
    os.kill(victim, signal.SIGKILL)
    page.wait_for_selector(f"{POOL}[data-state='failed']", timeout=30_000)  # the panel polls: no prompt needed
    state = page.query_selector(f"{POOL} .usp-state").inner_text()
    assert "rank 1 on cpu" in state and "the next prompt restarts the pool" in state
    assert page.query_selector(f"{POOL} .usp-cell.usp-dead[data-rank='1']")
    page.screenshot(path=str(tmp_path / "panel_failed.png"))
    run_prompt(server, seed=4)
    page.wait_for_selector(f"{POOL}[data-state='idle']", timeout=60_000)
    assert "recovered after 1 restart" in page.query_selector(f"{POOL} .usp-state").inner_text()


def test_doctor_button_shows_its_recommendation(server, page):
    open_panel(page)
    page.click("#ulysses-sp-panel .usp-doctor-run")
    result = page.wait_for_selector("#ulysses-sp-panel .usp-doctor-result", timeout=300_000)
    text = result.inner_text()
    assert "doctor recommends" in text and "cpu, cpu" in text and "CPU workers share the same cores" in text


def test_panel_unload_button_empties_the_model_list(server, page):
    open_panel(page)
    page.click("#ulysses-sp-panel .usp-unload")
    page.wait_for_selector("#ulysses-sp-panel .usp-model.usp-none", timeout=30_000)
    assert server.get_json("/ulysses_sp/status")["pools"][0]["models"] == []
    run_prompt(server, seed=3)  # the cached MODEL reloads its weights on the next prompt
    assert server.get_json("/ulysses_sp/status")["pools"][0]["models"] != []


EXAMPLES = cs.EXAMPLES
UI_WORKFLOWS = sorted(name for name in os.listdir(EXAMPLES) if name.endswith(".json") and "_api" not in name)


@pytest.fixture(scope="module")
def object_info(server):
    return server.get_json("/object_info")


def with_added_defaults(frontend_inputs: dict, example_inputs: dict, declared: dict) -> dict:
    """The example's inputs plus those the frontend added at their defaults: inputs newer than the example
    (ComfyUI 0.33.0, not 0.3.64: CreateVideo's optional `bit_depth`, SaveVideo's `format.codec` in its DynamicCombo)
    get their widget's default when a UI workflow saved before them loads; the example's API form runs the same."""
    added = {name: value for name, value in frontend_inputs.items() if name not in example_inputs
             and name in declared and cs.widget_default(declared[name]) == value}
    return {**example_inputs, **added}


@pytest.mark.parametrize("name", UI_WORKFLOWS)
def test_ui_example_workflow_loads_and_matches_its_api_twin(page, object_info, name):
    """The frontend itself loads the UI-format example and turns it into an API prompt equal to the *_api.json."""
    import json
    close_dialogs(page)
    with open(os.path.join(EXAMPLES, name)) as handle:
        ui_workflow = json.load(handle)
    with open(os.path.join(EXAMPLES, name.replace(".json", "_api.json"))) as handle:
        api_workflow = json.load(handle)
    prompt = page.evaluate("""async (workflow) => {
        const app = window.comfyAPI.app.app;
        await app.loadGraphData(workflow, true, true, "example");
        return (await app.graphToPrompt()).output;
    }""", ui_workflow)
    close_dialogs(page)
    assert set(prompt) == set(api_workflow)
    newer_nodes, _ = cs.NEEDS_NEWER_COMFYUI.get(cs.example_name(name), ((), ""))
    for node_id, node in api_workflow.items():
        if node["class_type"] in newer_nodes:  # a class this ComfyUI's frontend does not know: nothing to compare
            continue
        assert prompt[node_id]["class_type"] == node["class_type"]
        declared = cs.declared_inputs(object_info[node["class_type"]]["input"], prompt[node_id]["inputs"])
        assert prompt[node_id]["inputs"] == with_added_defaults(prompt[node_id]["inputs"], node["inputs"],
                                                                declared), node_id
