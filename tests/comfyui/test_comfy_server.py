"""A real ComfyUI server with this package in custom_nodes: an API workflow (SP loader + stock KSampler + SaveLatent)
runs to execution_success through sp_runtime.cli.client, the saved latent equals ComfyUI's own model of the same
weights, a cancel mid-run gives execution_interrupted and the next prompt succeeds, a bad input is a node error,
the status route answers, the example API workflows validate, and stopping ComfyUI leaves no worker process or
shared-memory segment behind.

Needs COMFYUI_PATH (a ComfyUI checkout whose requirements are installed in this Python); skipped otherwise.
"""
import copy
import json
import os
import time
import urllib.error
import urllib.request

import pytest

import comfy_support as cs

pytestmark = pytest.mark.skipif(cs.comfyui_path() is None, reason=cs.NO_COMFYUI)

EXAMPLES = cs.EXAMPLES
# inputs naming files the test server does not have: weights, LoRAs, and the example's input image / video
FILE_INPUTS = {"unet_name", "ckpt_name", "clip_name", "clip_name1", "clip_name2", "clip_name3", "clip_name4",
               "vae_name", "text_encoder", "model_name", "lora_name", "image", "file", "control_net_name"}


def load_example(name: str) -> dict:
    with open(os.path.join(EXAMPLES, name)) as handle:
        return json.load(handle)


WORKFLOW = load_example("tiny_qwen_image_cpu_api.json")  # SP loader, random conditioning, KSampler (node 5)


def workflow(**sampler) -> dict:
    graph = copy.deepcopy(WORKFLOW)
    graph["5"]["inputs"].update(sampler)
    return graph


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with cs.running_server(str(tmp_path_factory.mktemp("comfy_base"))) as running:
        yield running


@pytest.fixture(scope="module")
def client():
    from sp_runtime.cli.client import ComfyClient
    return ComfyClient


def test_api_workflow_runs_and_saves_the_same_latent_as_comfys_model(server, client, tmp_path):
    from safetensors.torch import load_file
    cs.import_comfy()
    lines = []
    result = client(server.address, timeout=300, log=lines.append).run(workflow(), out_dir=str(tmp_path))
    assert result.status == "success", result.error
    assert any(line.strip().startswith("step 100/100 (node 1)") for line in lines), lines  # loading progress bar
    assert_sampler_progress(lines, steps=3)
    assert len(result.saved) == 1 and result.saved[0].endswith(".latent")
    saved = load_file(result.saved[0])["latent_tensor"]
    reference = cs.comfy_reference_model("qwen_image", server.checkpoints["qwen_image"])
    expected = cs.sample(reference, cs.conditioning("qwen_image", 1), cs.conditioning("qwen_image", 2),
                         steps=3, cfg=2.0, seed=42, width=14, height=10)
    cs.assert_close(saved, expected)


def assert_sampler_progress(lines, steps):
    """One progress message per sampling step (KSampler is node 5), where ComfyUI sends every update; newer
    ComfyUI's ProgressBar (0.33.0, not 0.3.64) throttles: the first and the last update always go out, those between
    only 100 ms after the previous one, so fast steps may be coalesced."""
    import comfy.utils
    sent = [int(line.split()[1].split("/")[0]) for line in lines if line.strip().endswith("(node 5)")
            and line.strip().startswith("step ")]
    if hasattr(comfy.utils, "PROGRESS_THROTTLE_MIN_INTERVAL"):
        assert sent[0] == 1 and sent[-1] == steps and sent == sorted(set(sent)), lines
    else:
        assert sent == list(range(1, steps + 1)), lines


def test_status_route_shows_the_pool(server):
    for route in ("/ulysses_sp/status", "/api/ulysses_sp/status"):
        status = server.get_json(route)
        pool = status["pools"][0]
        assert pool["devices"] == ["cpu", "cpu"] and pool["layout"] == "u2"
        assert [rank["rank"] for rank in pool["pool"]["ranks"]] == [0, 1]
        assert all(rank["alive"] and rank["pid"] for rank in pool["pool"]["ranks"])
        assert pool["models"][0]["path"].endswith("tiny_qwen_image.safetensors")
        assert pool["last_step"]["layout"] == "u2"


def follow(server, graph, on_message=None, timeout=300.0):
    """Queue `graph` over HTTP, follow /ws; returns (final message type, data, every message type seen)."""
    from websockets.sync.client import connect
    client_id = f"test{time.monotonic_ns()}"
    with connect(f"ws://{server.address}/ws?clientId={client_id}", max_size=None) as socket:
        request = urllib.request.Request(server.url("/prompt"), method="POST",
                                         data=json.dumps({"prompt": graph, "client_id": client_id}).encode())
        prompt_id = json.loads(urllib.request.urlopen(request, timeout=30).read())["prompt_id"]
        seen, deadline = [], time.monotonic() + timeout
        while time.monotonic() < deadline:
            raw = socket.recv(timeout=deadline - time.monotonic())
            if isinstance(raw, bytes):
                continue
            message = json.loads(raw)
            data = message.get("data") or {}
            if data.get("prompt_id") not in (None, prompt_id):
                continue
            seen.append(message["type"])
            if on_message:
                on_message(message)
            if message["type"] in ("execution_success", "execution_error", "execution_interrupted"):
                return message["type"], data, seen
    raise AssertionError(f"prompt {prompt_id} did not end within {timeout} s; seen {seen[-10:]}")


def test_cancel_mid_run_interrupts_within_a_step_and_the_next_prompt_succeeds(server):
    pressed = {"after": 0}

    def cancel_on_first_step(message):
        if message["type"] != "progress" or message["data"].get("node") != "5":
            return
        if "at" in pressed:
            pressed["after"] += 1
            return
        pressed["at"] = time.monotonic()
        urllib.request.urlopen(urllib.request.Request(server.url("/interrupt"), method="POST", data=b"{}"),
                               timeout=30)

    kind, data, seen = follow(server, workflow(steps=5000, seed=7), on_message=cancel_on_first_step)
    assert kind == "execution_interrupted", (kind, data)
    assert time.monotonic() - pressed["at"] < 20  # 5000 steps would take minutes
    assert pressed["after"] <= 2, pressed  # stopped within a step or two of the Cancel
    kind, data, _ = follow(server, workflow(seed=8))
    assert kind == "execution_success", data


def test_bad_devices_is_a_node_error_and_the_next_prompt_succeeds(server):
    graph = workflow(seed=9)
    graph["1"]["inputs"]["devices"] = "cpu,0"
    kind, data, _ = follow(server, graph)
    assert kind == "execution_error"
    assert data["node_id"] == "1" and "cannot be mixed" in data["exception_message"]
    kind, data, _ = follow(server, workflow(seed=10))
    assert kind == "execution_success", data


def test_sp_events_are_pushed_while_sampling(server):
    events = []
    kind, _, seen = follow(server, workflow(seed=11), on_message=lambda m: events.append(m))
    assert kind == "execution_success"
    steps = [m["data"] for m in events if m["type"] == "ulysses_sp.step"]
    assert len(steps) == 3 and all(step["layout"] == "u2" and step["seconds"] > 0 for step in steps)


@pytest.mark.parametrize("name", sorted(n for n in os.listdir(EXAMPLES) if n.endswith("_api.json")
                                         and not n.startswith("tiny_")))
def test_example_api_workflows_only_lack_their_model_files(server, name):
    """Every node class and input of the real-model examples exists (or the example is listed as needing a newer
    ComfyUI, naming the classes older ones lack: only those may be missing); the server only misses the weight and
    input files."""
    workflow = load_example(name)
    available = server.get_json("/object_info")
    missing = sorted({node["class_type"] for node in workflow.values()} - set(available))
    newer_nodes, _ = cs.NEEDS_NEWER_COMFYUI.get(cs.example_name(name), ((), ""))
    assert set(missing) <= set(newer_nodes), f"{name}: node classes this ComfyUI lacks: {missing}"
    if not missing:  # a listed class this ComfyUI has in an older form (an input or an option the example uses)
        missing = [node["class_type"] for node in workflow.values() if node["class_type"] in newer_nodes
                   and node["class_type"] in available and node["class_type"] not in cs.ACCEPTS_ALL_INPUTS
                   and _older_form(available[node["class_type"]], node)]
    for node_id, node in workflow.items():
        if missing:
            break  # a ComfyUI older than the example needs: the nodes it has may lack newer inputs too
        spec = available.get(node["class_type"])
        if spec and node["class_type"] not in cs.ACCEPTS_ALL_INPUTS:
            known = set(cs.declared_inputs(spec["input"], node["inputs"]))
            assert set(node["inputs"]) <= known, (node_id, set(node["inputs"]) - known)
    if missing:
        return  # this ComfyUI cannot validate the rest of the prompt
    request = urllib.request.Request(server.url("/prompt"), method="POST",
                                     data=json.dumps({"prompt": workflow}).encode())
    try:
        accepted = urllib.request.urlopen(request, timeout=30)
    except urllib.error.HTTPError as rejected:
        body = json.loads(rejected.read())
    else:  # older ComfyUI does not check a V3 node's file list (a lone SPCheckpointLoader): the run names the file;
        body = json.loads(accepted.read())  # or it runs the outputs that validate (text previews) and lists the rest
        if not body.get("node_errors"):
            assert_run_fails_on_a_missing_file(server, body["prompt_id"], workflow)
            return
    errors = [(node_id, error) for node_id, node in body["node_errors"].items() for error in node["errors"]]
    assert errors, body
    for node_id, error in errors:
        assert error["type"] in ("value_not_in_list", "custom_validation_failed"), (node_id, error)
        assert error["extra_info"]["input_name"] in FILE_INPUTS, (node_id, error)


def _older_form(spec: dict, node: dict) -> bool:
    """This ComfyUI's declaration of the node lacks an input the example sends, or a (non-file) option it picks."""
    declared = cs.declared_inputs(spec["input"], node["inputs"])
    for input_name, value in node["inputs"].items():
        if input_name not in declared:
            return True
        spec_of = declared[input_name]
        options = spec_of[0] if isinstance(spec_of[0], list) else (
            spec_of[1].get("options") if spec_of[0] == "COMBO" and len(spec_of) > 1 else None)
        if (isinstance(options, list) and isinstance(value, str) and input_name not in FILE_INPUTS
                and value not in options):
            return True
    return False


def assert_run_fails_on_a_missing_file(server, prompt_id: str, workflow: dict) -> None:
    deadline = time.monotonic() + 120
    while not (history := server.get_json(f"/history/{prompt_id}")):
        assert time.monotonic() < deadline, f"prompt {prompt_id} did not finish"
        time.sleep(0.5)
    status = history[prompt_id]["status"]
    errors = [data for event, data in status["messages"] if event == "execution_error"]
    files = {value for node in workflow.values() for name, value in node["inputs"].items()
             if name in FILE_INPUTS and isinstance(value, str)}  # an `image` input may be a link
    assert status["status_str"] == "error" and errors, status
    assert any(name in errors[0]["exception_message"] for name in files), errors[0]


def test_stopping_comfyui_leaves_nothing_behind(server):
    """Runs last in this module: stop the server here and check the workers and segments went with it."""
    pids = set(server.descendants())
    workers = [pid for pid in pids if _is_worker(pid)]
    assert len(workers) == 2
    killed = server.stop()
    assert killed == [], f"processes still alive after Ctrl-C: {killed}\n{server.log_tail()}"
    leftovers = [name for name in os.listdir("/dev/shm") if name.startswith(f"usp_{server.process.pid}_")]
    assert leftovers == []


def _is_worker(pid: int) -> bool:
    import psutil
    try:
        return "sp_runtime.pool.worker" in " ".join(psutil.Process(pid).cmdline())
    except psutil.NoSuchProcess:
        return False
