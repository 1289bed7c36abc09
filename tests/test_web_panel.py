"""The Ulysses SP panel (web/ulysses_sp.js) in headless Chromium against a running ComfyUI: the sidebar tab shows
the pool's devices, ranks, layout and model from GET /ulysses_sp/status, and updates from websocket events while a
prompt samples.

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
    for _ in range(10):
        if not page.query_selector(".p-dialog-mask"):
            return
        page.keyboard.press("Escape")
        page.wait_for_timeout(300)


def open_panel(page):
    close_dialogs(page)
    if not page.query_selector("#ulysses-sp-panel"):
        page.click(".ulysses-sp-tab-button")
    page.wait_for_selector("#ulysses-sp-panel", timeout=30_000)


def test_panel_shows_an_empty_state_then_the_pool(server, page, tmp_path):
    open_panel(page)
    page.wait_for_selector("#ulysses-sp-panel .usp-empty:has-text('No Ulysses SP pool')", timeout=30_000)
    run_prompt(server, seed=1)
    page.click("#ulysses-sp-panel .usp-refresh")
    # The refresh is asynchronous: wait until its render (with the ranks' call times) replaced the earlier one.
    page.wait_for_function("() => [...document.querySelectorAll('#ulysses-sp-panel .usp-r-call')]"
                           ".some((node) => node.textContent.endsWith(' ms'))", timeout=30_000)
    pool = page.wait_for_selector("#ulysses-sp-panel .usp-pool[data-devices='cpu,cpu']", timeout=30_000)
    text = pool.inner_text()
    assert "layout u2 (gloo, 2 ranks)" in text
    assert "tiny_qwen_image.safetensors [fp32]" in text
    ranks = page.query_selector_all("#ulysses-sp-panel .usp-rank")
    assert [rank.get_attribute("data-rank") for rank in ranks] == ["0", "1"]
    part = lambda name: ranks[1].query_selector(f".usp-r-{name}").inner_text()  # noqa: E731
    assert part("device") == "cpu" and part("pid").split()[1].isdigit() and "MiB" in part("memory")
    assert part("state") == "alive" and part("call").endswith(" ms")
    assert "last step:" in text and " ms" in text
    page.screenshot(path=str(tmp_path / "panel.png"))
    if os.environ.get("SP_PANEL_SCREENSHOT"):
        page.screenshot(path=os.environ["SP_PANEL_SCREENSHOT"])


def test_panel_follows_websocket_events_while_sampling(server, page):
    open_panel(page)
    section = "#ulysses-sp-panel .usp-pool[data-devices='cpu,cpu']"
    page.wait_for_selector(section, timeout=30_000)
    before = int(page.get_attribute(section, "data-step-events"))
    run_prompt(server, seed=2)  # 3 steps, no refresh: only the pushed events can change the panel
    page.wait_for_function(f"document.querySelector(\"{section}\").dataset.stepEvents >= {before + 3}",
                           timeout=30_000)


def test_panel_unload_button_empties_the_model_list(server, page):
    open_panel(page)
    page.click("#ulysses-sp-panel .usp-unload")
    page.wait_for_selector("#ulysses-sp-panel .usp-model.usp-none", timeout=30_000)
    assert server.get_json("/ulysses_sp/status")["pools"][0]["models"] == []
    run_prompt(server, seed=3)  # the cached MODEL reloads its weights on the next prompt
    assert server.get_json("/ulysses_sp/status")["pools"][0]["models"] != []


EXAMPLES = os.path.join(cs.ROOT, "example_workflows")
UI_WORKFLOWS = sorted(name for name in os.listdir(EXAMPLES) if name.endswith(".json") and "_api" not in name)


@pytest.mark.parametrize("name", UI_WORKFLOWS)
def test_ui_example_workflow_loads_and_matches_its_api_twin(page, name):
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
    for node_id, node in api_workflow.items():
        assert prompt[node_id]["class_type"] == node["class_type"]
        assert prompt[node_id]["inputs"] == node["inputs"], node_id
