"""Run a ComfyUI API-format workflow from the command line: queue it, stream progress from /ws, report errors and
save the outputs.

    python -m sp_runtime client WORKFLOW_API.json --server 127.0.0.1:8188 --out outputs/

Uses only JSON over HTTP and the websocket (binary preview frames are skipped); never imports ComfyUI.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
import uuid
from dataclasses import dataclass, field
from typing import Callable, Optional

OUTPUT_KINDS = ("images", "gifs", "videos", "audio", "latents", "files", "3d")
EXIT_OK, EXIT_FAILED, EXIT_REJECTED, EXIT_INTERRUPTED, EXIT_UNREACHABLE = 0, 1, 2, 3, 4


class ClientError(RuntimeError):
    """The server refused the workflow or could not be reached; the message says what to fix."""

    def __init__(self, message: str, exit_code: int = EXIT_FAILED):
        super().__init__(message)
        self.exit_code = exit_code


@dataclass
class RunResult:
    prompt_id: str
    status: str                       # "success", "error" or "interrupted"
    error: Optional[dict] = None      # the execution_error message
    outputs: dict = field(default_factory=dict)
    saved: list[str] = field(default_factory=list)
    seconds: float = 0.0


def load_workflow(path: str) -> dict:
    """The API-format workflow in `path`; a UI-format file gets an error that says how to export the API format."""
    try:
        with open(path, encoding="utf-8") as handle:
            workflow = json.load(handle)
    except FileNotFoundError:
        raise ClientError(f"workflow file {path!r} does not exist", EXIT_REJECTED) from None
    except json.JSONDecodeError as error:
        raise ClientError(f"workflow file {path!r} is not JSON: {error}", EXIT_REJECTED) from None
    if isinstance(workflow, dict) and "prompt" in workflow and isinstance(workflow["prompt"], dict):
        workflow = workflow["prompt"]  # a saved /prompt request body
    if isinstance(workflow, dict) and "nodes" in workflow and "links" in workflow:
        raise ClientError(f"{path!r} is a UI-format workflow (it has 'nodes' and 'links'); the API needs the API "
                          f"format: in ComfyUI use Workflow > Export (API), or the *_api.json files in "
                          f"example_workflows/", EXIT_REJECTED)
    if not isinstance(workflow, dict) or not all(isinstance(n, dict) and "class_type" in n
                                                  for n in workflow.values()):
        raise ClientError(f"{path!r} is not an API-format workflow: expected {{node_id: {{'class_type': ..., "
                          f"'inputs': {{...}}}}}}", EXIT_REJECTED)
    return workflow


def apply_overrides(workflow: dict, overrides: list[str]) -> dict:
    """Apply NODE.INPUT=VALUE overrides (VALUE parsed as JSON when it can be, else kept as text)."""
    for item in overrides:
        target, sep, raw = item.partition("=")
        node_id, dot, name = target.partition(".")
        if not sep or not dot:
            raise ClientError(f"override {item!r} must look like NODE_ID.INPUT=VALUE, e.g. 3.seed=42", EXIT_REJECTED)
        if node_id not in workflow:
            raise ClientError(f"override {item!r}: the workflow has no node {node_id!r} (nodes: "
                              f"{', '.join(sorted(workflow))})", EXIT_REJECTED)
        try:
            value = json.loads(raw)
        except json.JSONDecodeError:
            value = raw
        workflow[node_id].setdefault("inputs", {})[name] = value
    return workflow


class ComfyClient:
    """A small HTTP + websocket client for one ComfyUI server."""

    def __init__(self, server: str = "127.0.0.1:8188", timeout: float = 3600.0,
                 log: Callable[[str], None] = print):
        server = server.strip().rstrip("/")
        if "://" not in server:
            server = "http://" + server
        parsed = urllib.parse.urlsplit(server)
        if parsed.scheme not in ("http", "https") or not parsed.netloc:
            raise ClientError(f"server {server!r} is not host:port or an http(s) URL", EXIT_REJECTED)
        self.base = f"{parsed.scheme}://{parsed.netloc}"
        self.ws_base = ("wss" if parsed.scheme == "https" else "ws") + f"://{parsed.netloc}"
        self.timeout = timeout
        self.client_id = uuid.uuid4().hex
        self.log = log

    # ----- HTTP -----
    def _request(self, method: str, route: str, body: Optional[dict] = None) -> bytes:
        data = json.dumps(body).encode() if body is not None else None
        request = urllib.request.Request(self.base + route, data=data, method=method,
                                         headers={"Content-Type": "application/json"} if data else {})
        try:
            with urllib.request.urlopen(request, timeout=60) as response:
                return response.read()
        except urllib.error.HTTPError as error:
            payload = error.read()
            raise _http_error(route, error.code, payload) from None
        except (urllib.error.URLError, ConnectionError, TimeoutError) as error:
            raise ClientError(f"cannot reach ComfyUI at {self.base} ({getattr(error, 'reason', error)}): is it "
                              f"running, and is --server right?", EXIT_UNREACHABLE) from None

    def get_json(self, route: str):
        return json.loads(self._request("GET", route))

    def queue(self, workflow: dict) -> str:
        reply = json.loads(self._request("POST", "/prompt", {"prompt": workflow, "client_id": self.client_id}))
        return reply["prompt_id"]

    def interrupt(self) -> None:
        self._request("POST", "/interrupt", {})

    def history(self, prompt_id: str) -> dict:
        return self.get_json(f"/history/{urllib.parse.quote(prompt_id)}").get(prompt_id, {})

    def download(self, item: dict, out_dir: str) -> str:
        query = urllib.parse.urlencode({"filename": item["filename"], "subfolder": item.get("subfolder", ""),
                                        "type": item.get("type", "output")})
        data = self._request("GET", f"/view?{query}")
        name = os.path.basename(item["filename"])  # never write outside out_dir, whatever the server says
        target = os.path.join(out_dir, name)
        os.makedirs(out_dir, exist_ok=True)
        with open(target, "wb") as handle:
            handle.write(data)
        return target

    # ----- a whole run -----
    def run(self, workflow: dict, out_dir: Optional[str] = None) -> RunResult:
        """Queue the workflow, follow it on /ws until it ends, then fetch (and save) its outputs."""
        from websockets.sync.client import connect
        started = time.monotonic()
        url = f"{self.ws_base}/ws?clientId={self.client_id}"
        try:
            socket = connect(url, open_timeout=30, max_size=None)
        except OSError as error:
            raise ClientError(f"cannot open the websocket {url} ({error}): is ComfyUI running?",
                              EXIT_UNREACHABLE) from None
        with socket:
            prompt_id = self.queue(workflow)
            self.log(f"queued prompt {prompt_id}")
            try:
                status, error = self._follow(socket, prompt_id, workflow, started)
            except KeyboardInterrupt:
                self.log("interrupting the running prompt ...")
                self.interrupt()
                raise
        result = RunResult(prompt_id, status, error, seconds=time.monotonic() - started)
        if status == "success":
            result.outputs = self.history(prompt_id).get("outputs", {})
            if out_dir:
                result.saved = [self.download(item, out_dir) for item in output_items(result.outputs)]
        return result

    def _follow(self, socket, prompt_id: str, workflow: dict, started: float) -> tuple[str, Optional[dict]]:
        from websockets.exceptions import ConnectionClosed
        while True:
            remaining = self.timeout - (time.monotonic() - started)
            if remaining <= 0:
                raise ClientError(f"prompt {prompt_id} did not finish within {self.timeout:.0f} s (it may still "
                                  f"run on the server; POST /interrupt stops it)")
            try:
                raw = socket.recv(timeout=min(remaining, 30))
            except TimeoutError:
                continue
            except ConnectionClosed as closed:
                raise ClientError(f"ComfyUI closed the websocket while prompt {prompt_id} ran ({closed}): the "
                                  f"server stopped or crashed; see its log") from None
            if isinstance(raw, bytes):
                continue  # preview images
            message = json.loads(raw)
            kind, data = message.get("type"), message.get("data") or {}
            if data.get("prompt_id") not in (None, prompt_id):
                continue
            outcome = self._report(kind, data, workflow)
            if outcome:
                return outcome

    def _report(self, kind: str, data: dict, workflow: dict) -> Optional[tuple[str, Optional[dict]]]:
        if kind == "executing" and data.get("node") is not None:
            node = data["node"]
            self.log(f"running node {node} ({workflow.get(str(node), {}).get('class_type', '?')})")
        elif kind == "progress":
            self.log(f"  step {data.get('value')}/{data.get('max')} (node {data.get('node')})")
        elif kind == "execution_cached" and data.get("nodes"):
            self.log(f"cached nodes: {', '.join(map(str, data['nodes']))}")
        elif kind == "ulysses_sp.step":
            self.log(f"  SP step {data.get('seconds', 0) * 1000:.0f} ms on {data.get('layout')}")
        elif kind == "execution_success":
            return "success", None
        elif kind == "execution_error":
            return "error", data
        elif kind == "execution_interrupted":
            return "interrupted", data
        elif kind == "executing" and data.get("node") is None and data.get("prompt_id"):
            return "success", None  # older servers end with executing(node=None) only
        return None


def output_items(outputs: dict) -> list[dict]:
    """Every saved file named in a /history entry's outputs (temporary previews included)."""
    items = []
    for node_output in outputs.values():
        for kind in OUTPUT_KINDS:
            for item in node_output.get(kind, []) or []:
                if isinstance(item, dict) and "filename" in item:
                    items.append(item)
    return items


def _http_error(route: str, code: int, payload: bytes) -> ClientError:
    try:
        body = json.loads(payload)
    except (json.JSONDecodeError, UnicodeDecodeError):
        body = {}
    if route == "/prompt" and code == 400:
        return ClientError("ComfyUI rejected the workflow:\n" + describe_rejection(body), EXIT_REJECTED)
    return ClientError(f"HTTP {code} from {route}: {payload[:300].decode(errors='replace')}")


def describe_rejection(body: dict) -> str:
    """Readable lines for /prompt's 400 reply: the error, then each node's errors."""
    error = body.get("error") or {}
    lines = [f"  {error.get('message', 'invalid prompt')}: {error.get('details', '')}".rstrip(": ")]
    for node_id, node in (body.get("node_errors") or {}).items():
        for item in node.get("errors", []):
            lines.append(f"  node {node_id} ({node.get('class_type', '?')}): {item.get('message')}: "
                         f"{item.get('details', '')}")
    return "\n".join(lines)


def describe_error(error: dict) -> str:
    lines = [f"node {error.get('node_id')} ({error.get('node_type')}) failed: {error.get('exception_type')}: "
             f"{error.get('exception_message', '').strip()}"]
    trace = error.get("traceback") or []
    if trace:
        lines.append("".join(trace[-3:]).rstrip())
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("workflow", help="API-format workflow JSON (Workflow > Export (API) in ComfyUI)")
    parser.add_argument("--server", default="127.0.0.1:8188", help="ComfyUI address (default 127.0.0.1:8188)")
    parser.add_argument("--out", default="comfy_outputs", help="folder for the outputs (default comfy_outputs)")
    parser.add_argument("--set", action="append", default=[], metavar="NODE.INPUT=VALUE",
                        help="override an input, e.g. --set 3.seed=42 (repeatable)")
    parser.add_argument("--timeout", type=float, default=3600.0, help="seconds to wait for the run (default 3600)")
    parser.add_argument("--quiet", action="store_true", help="print only errors and saved files")


def main(argv: Optional[list[str]] = None) -> int:
    """`python -m sp_runtime.cli.client ...`, the same as `python -m sp_runtime client ...`."""
    parser = argparse.ArgumentParser(prog="python -m sp_runtime client", description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


def run(args) -> int:
    log = (lambda text: None) if args.quiet else (lambda text: print(text, flush=True))
    try:
        workflow = apply_overrides(load_workflow(args.workflow), args.set)
        client = ComfyClient(args.server, timeout=args.timeout, log=log)
        result = client.run(workflow, out_dir=args.out)
    except ClientError as error:
        print(f"error: {error}", file=sys.stderr)
        return error.exit_code
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    if result.status == "error":
        print("error: " + describe_error(result.error or {}), file=sys.stderr)
        return EXIT_FAILED
    if result.status == "interrupted":
        print(f"prompt {result.prompt_id} was interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    print(f"done in {result.seconds:.1f} s")
    for path in result.saved:
        print(f"saved {path}")
    if not result.saved:
        print("the workflow produced no output files (add a Save node)")
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
