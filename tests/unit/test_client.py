"""The API client (sp_runtime/cli/client.py) against a fake ComfyUI on 127.0.0.1: queueing, progress from /ws, errors,
interrupts, rejected workflows and saved outputs. No ComfyUI needed."""
import base64
import hashlib
import json
import os
import queue
import struct
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlsplit

import pytest

from sp_runtime.cli import client

WS_GUID = "258EAFA5-E914-47DA-95CA-C5AB0DC85B11"
WORKFLOW = {"3": {"class_type": "KSampler", "inputs": {"seed": 1}},
            "9": {"class_type": "SaveLatent", "inputs": {"filename_prefix": "x"}}}


def ws_frame(payload, binary=False) -> bytes:
    """One unmasked server frame (RFC 6455 5.2)."""
    data = payload if binary else json.dumps(payload).encode()
    head = bytes([0x82 if binary else 0x81])
    if len(data) < 126:
        head += bytes([len(data)])
    elif len(data) < 65536:
        head += bytes([126]) + struct.pack(">H", len(data))
    else:
        head += bytes([127]) + struct.pack(">Q", len(data))
    return head + data


class FakeComfy:
    """ComfyUI's HTTP routes and /ws on one port, as the client sees them. The websocket side is written by hand
    because the websockets library's server answers only GET requests, and ComfyUI serves POST /prompt on the same
    port."""

    def __init__(self, scenario):
        self.scenario = scenario  # (prompt_id, body) -> (ws messages, history outputs) or ("reject", body)
        self.bodies, self.ws_client_ids = [], []
        self.files = {}
        self.history = {}
        self.outbox: "queue.Queue" = queue.Queue()
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_GET(self):
                url = urlsplit(self.path)
                if url.path == "/ws":
                    return fake.serve_ws(self, parse_qs(url.query)["clientId"][0])
                if url.path.startswith("/history/"):
                    prompt_id = url.path.rsplit("/", 1)[1]
                    return self.reply(200, {prompt_id: fake.history.get(prompt_id, {})})
                if url.path == "/view":
                    name = parse_qs(url.query)["filename"][0]
                    return self.reply(200, fake.files[name], raw=True)
                self.reply(404, {})

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])) or b"{}")
                if self.path == "/interrupt":
                    return self.reply(200, {})
                fake.bodies.append(body)
                prompt_id = f"p{len(fake.bodies)}"
                outcome = fake.scenario(prompt_id, body)
                if outcome[0] == "reject":
                    return self.reply(400, outcome[1])
                messages, outputs = outcome
                fake.history[prompt_id] = {"outputs": outputs}
                for message in messages:
                    fake.outbox.put(message)
                self.reply(200, {"prompt_id": prompt_id, "number": 0})

            def reply(self, code, body, raw=False):
                data = body if raw else json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.address = f"127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def serve_ws(self, handler, client_id):
        self.ws_client_ids.append(client_id)
        accept = base64.b64encode(hashlib.sha1((handler.headers["Sec-WebSocket-Key"] + WS_GUID).encode()).digest())
        handler.wfile.write(b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
                            b"Sec-WebSocket-Accept: " + accept + b"\r\n\r\n")
        handler.wfile.write(ws_frame({"type": "status", "data": {"status": {"exec_info": {}}, "sid": client_id}}))
        handler.wfile.flush()
        closed = threading.Event()
        threading.Thread(target=self.read_until_close, args=(handler, closed), daemon=True).start()
        while not closed.is_set():
            try:
                message = self.outbox.get(timeout=0.05)
            except queue.Empty:
                continue
            if message is None:
                break
            handler.wfile.write(ws_frame(message, binary=isinstance(message, bytes)))
            handler.wfile.flush()
        handler.close_connection = True

    @staticmethod
    def read_until_close(handler, closed):
        """Read the client's masked frames; answer its close frame so it does not wait for a close timeout."""
        try:
            while True:
                opcode, length = handler.rfile.read(2)
                length &= 0x7F
                if length == 126:
                    length = struct.unpack(">H", handler.rfile.read(2))[0]
                elif length == 127:
                    length = struct.unpack(">Q", handler.rfile.read(8))[0]
                handler.rfile.read(4 + length)  # mask key and payload
                if opcode & 0x0F == 0x8:
                    handler.wfile.write(bytes([0x88, 0]))
                    handler.wfile.flush()
                    break
        except (ValueError, OSError):
            pass
        closed.set()

    def close(self):
        self.outbox.put(None)
        self.server.shutdown()
        self.server.server_close()


def success_run(prompt_id, body):
    messages = [
        {"type": "execution_start", "data": {"prompt_id": prompt_id}},
        {"type": "executing", "data": {"node": "99", "prompt_id": "someone-else"}},  # other prompt: ignored
        {"type": "executing", "data": {"node": "3", "prompt_id": prompt_id}},
        {"type": "progress", "data": {"value": 1, "max": 2, "node": "3", "prompt_id": prompt_id}},
        b"\x00\x00\x00\x01preview-bytes",
        {"type": "ulysses_sp.step", "data": {"seconds": 0.25, "layout": "u2"}},
        {"type": "progress", "data": {"value": 2, "max": 2, "node": "3", "prompt_id": prompt_id}},
        {"type": "executed", "data": {"node": "9", "prompt_id": prompt_id, "output": {}}},
        {"type": "execution_success", "data": {"prompt_id": prompt_id}},
    ]
    outputs = {"9": {"latents": [{"filename": "../../escape.latent", "subfolder": "", "type": "output"}]}}
    return messages, outputs


@pytest.fixture
def fake_server(request):
    server = FakeComfy(request.param)
    server.files["../../escape.latent"] = b"LATENT-BYTES"
    yield server
    server.close()


def write(tmp_path, data, name="wf.json"):
    path = tmp_path / name
    path.write_text(json.dumps(data))
    return str(path)


@pytest.mark.parametrize("fake_server", [success_run], indirect=True)
def test_success_streams_progress_and_saves_outputs_inside_out_dir(fake_server, tmp_path, capsys):
    out_dir = tmp_path / "out"
    code = client.main([write(tmp_path, WORKFLOW), "--server", fake_server.address, "--out", str(out_dir),
                        "--set", "3.seed=42", "--set", "9.filename_prefix=run"])
    printed = capsys.readouterr().out
    assert code == client.EXIT_OK
    body = fake_server.bodies[0]
    assert body["client_id"] == fake_server.ws_client_ids[0]
    assert body["prompt"]["3"]["inputs"]["seed"] == 42 and body["prompt"]["9"]["inputs"]["filename_prefix"] == "run"
    assert "step 1/2" in printed and "step 2/2" in printed and "SP step 250 ms on u2" in printed
    assert "node 99" not in printed
    assert os.listdir(out_dir) == ["escape.latent"]  # a server-given '../' never leaves the out folder
    assert (out_dir / "escape.latent").read_bytes() == b"LATENT-BYTES"


def error_run(prompt_id, body):
    return [{"type": "execution_start", "data": {"prompt_id": prompt_id}},
            {"type": "execution_error", "data": {"prompt_id": prompt_id, "node_id": "3", "node_type": "KSampler",
                                                 "exception_type": "SPPoolError",
                                                 "exception_message": "worker pool failed on rank 1 (cpu)",
                                                 "traceback": ["  File x\n", "SPPoolError: boom\n"]}}], {}


@pytest.mark.parametrize("fake_server", [error_run], indirect=True)
def test_execution_error_is_reported_with_node_and_message(fake_server, tmp_path, capsys):
    code = client.main([write(tmp_path, WORKFLOW), "--server", fake_server.address, "--out", str(tmp_path)])
    err = capsys.readouterr().err
    assert code == client.EXIT_FAILED
    assert "node 3 (KSampler) failed" in err and "rank 1" in err


def interrupted_run(prompt_id, body):
    return [{"type": "execution_interrupted", "data": {"prompt_id": prompt_id, "node_id": "3"}}], {}


@pytest.mark.parametrize("fake_server", [interrupted_run], indirect=True)
def test_interrupted_run_exits_3(fake_server, tmp_path, capsys):
    code = client.main([write(tmp_path, WORKFLOW), "--server", fake_server.address, "--quiet"])
    assert code == client.EXIT_INTERRUPTED and "interrupted" in capsys.readouterr().err


def rejected_run(prompt_id, body):
    return "reject", {"error": {"type": "prompt_outputs_failed_validation", "message": "Prompt outputs failed "
                                "validation", "details": ""},
                      "node_errors": {"4": {"class_type": "SPModelLoader", "errors": [
                          {"message": "Value not in list", "details": "unet_name: 'x.safetensors' not in []"}]}}}


@pytest.mark.parametrize("fake_server", [rejected_run], indirect=True)
def test_rejected_workflow_lists_node_errors(fake_server, tmp_path, capsys):
    code = client.main([write(tmp_path, WORKFLOW), "--server", fake_server.address])
    err = capsys.readouterr().err
    assert code == client.EXIT_REJECTED
    assert "node 4 (SPModelLoader): Value not in list" in err and "x.safetensors" in err


def test_ui_format_workflow_is_refused_with_the_fix(tmp_path, capsys):
    code = client.main([write(tmp_path, {"nodes": [], "links": [], "version": 0.4}), "--server", "127.0.0.1:9"])
    assert code == client.EXIT_REJECTED and "Export (API)" in capsys.readouterr().err


def test_bad_override_and_missing_file(tmp_path, capsys):
    assert client.main([write(tmp_path, WORKFLOW), "--set", "7.seed=1"]) == client.EXIT_REJECTED
    assert "no node '7'" in capsys.readouterr().err
    assert client.main([str(tmp_path / "nope.json")]) == client.EXIT_REJECTED
    assert "does not exist" in capsys.readouterr().err


def test_unreachable_server_says_so(tmp_path, capsys):
    import socket
    with socket.socket() as probe:  # a port that was free a moment ago: nothing listens there
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    code = client.main([write(tmp_path, WORKFLOW), "--server", f"127.0.0.1:{port}"])
    assert code == client.EXIT_UNREACHABLE and "is ComfyUI running" in capsys.readouterr().err


def test_saved_request_body_is_accepted(tmp_path):
    assert client.load_workflow(write(tmp_path, {"prompt": WORKFLOW, "client_id": "x"})) == WORKFLOW
