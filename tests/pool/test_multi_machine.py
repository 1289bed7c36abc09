"""A pool over two "machines" on one computer: the second is `python -m sp_runtime join` in its own process tree,
its own run folder (TMPDIR) and, where the test may mount (root), a private /dev/shm (mount namespace): it cannot
see the host's shared memory, so everything reaches it over the join channel. Gloo over TCP on 127.0.0.1.
Without the right to mount, the joiner shares /dev/shm but uses only its own names (never the host's segments).

Covers: parity at u2 x r2 with the ring across the machines and at cfg2 across them (Flux.1's tiny model and its
reference), the status naming each rank's machine, a LoRA file each machine loads from its own folder (equal to the
merged checkpoint's single-device reference; one that differs on the joined machine is refused naming it), a cancel
that stops the remote ranks too, a remote killed mid-request (error naming machine and rank, the pool recovers when
it joins again), a wrong token, an unknown and a duplicate joiner, a model file that differs on the joined machine,
and the layout rule.
"""
from __future__ import annotations

import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time

import psutil
import pytest
import torch

from safetensors import safe_open
from safetensors.torch import load_file, save_file

from patch_reference import random_patch
from pool_kit import assert_matches, call_toy, reference as toy_reference, toy_checkpoint
from sp_lab.conformance import conformance, file_reference
from sp_runtime.lora.patch_set import PatchSet, TargetPatches
from sp_runtime import Cancelled, SPConfig
from sp_runtime.devices import parse_devices
from sp_runtime.pool import WorkerPool
from sp_runtime.pool.errors import WorkerError
from sp_runtime.pool.joined import Refused, connect
from sp_runtime.pool.remote import JoinPoint
from sp_runtime.pool.wire import read_token

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CASES = ("35_tokens", "odd_latent")  # odd token counts, batch 2
START_S = 240.0
WATCHDOG_S = 8.0  # the hung-remote case waits this long; above what a busy shared machine's pauses reach  # generous: the test machine is shared; a quiet one starts in seconds


def _can_mount_private_shm() -> bool:
    if shutil.which("unshare") is None or not sys.platform.startswith("linux"):
        return False
    probe = subprocess.run(["unshare", "-m", "--propagation", "private", "sh", "-c",
                            "mount -t tmpfs -o size=1m tmpfs /dev/shm"], capture_output=True)
    return probe.returncode == 0


PRIVATE_SHM = _can_mount_private_shm()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def write_token(path: str) -> str:
    with open(path, "w") as handle:
        handle.write(secrets.token_hex(32))
    os.chmod(path, 0o600)
    return path


class Joiner:
    """`python -m sp_runtime join` as another machine; stop() ends its whole process tree."""

    def __init__(self, folder: str, port: int, token: str, models: str, name: str = "node2", devices: str = "cpu:2",
                 env: dict | None = None):
        run_dir = os.path.join(folder, f"tmp_{secrets.token_hex(3)}")
        os.makedirs(run_dir)
        command = [sys.executable, "-m", "sp_runtime", "join", f"127.0.0.1:{port}", "--token-file", token,
                   "--name", name, "--devices", devices, "--models", models, "--threads", "1"]
        if PRIVATE_SHM:  # its own /dev/shm: the host's segments are not there
            command = ["unshare", "-m", "--propagation", "private", "sh", "-c",
                       'mount -t tmpfs -o size=256m tmpfs /dev/shm && exec "$0" "$@"'] + command
        self.log = open(os.path.join(folder, f"joiner_{name}.log"), "w+")
        self.process = subprocess.Popen(command, cwd=ROOT, stdout=self.log, stderr=subprocess.STDOUT,
                                        env={**os.environ, "TMPDIR": run_dir, "PYTHONPATH": ROOT, **(env or {})})

    def tree(self) -> list[psutil.Process]:
        try:
            parent = psutil.Process(self.process.pid)
            return [parent] + parent.children(recursive=True)
        except psutil.NoSuchProcess:
            return []

    def stop(self) -> None:
        for process in self.tree():
            try:
                process.kill()
            except psutil.NoSuchProcess:
                pass
        self.process.wait(timeout=30)
        psutil.wait_procs(self.tree(), timeout=10)

    def output(self) -> str:
        self.log.seek(0)
        return self.log.read()


@pytest.fixture(scope="module")
def flux(tmp_path_factory):
    """Flux.1's tiny model in the host's folder and a copy in the joined machine's, and its reference outputs."""
    folder = tmp_path_factory.mktemp("multi")
    spec = conformance("flux")
    path = spec.write(str(folder / "host_models"))
    remote = folder / "node2_models"
    remote.mkdir()
    shutil.copy(path, remote / os.path.basename(path))
    forward = spec.reference(path)
    cases = {name: case for name, case in spec.cases().items() if name in CASES}
    outputs = {name: forward(x, t, **inputs) for name, (x, t, inputs) in cases.items()}
    return {"folder": str(folder), "path": path, "remote": str(remote), "cases": cases, "outputs": outputs,
            "token": write_token(str(folder / "token"))}


@pytest.fixture
def joiners(flux):
    """Start joiners with joiners(port, ...); all are stopped (whole trees) at the end, even on failure."""
    started: list[Joiner] = []

    def start(port: int, **options) -> Joiner:
        options.setdefault("token", flux["token"])
        options.setdefault("models", flux["remote"])
        started.append(Joiner(flux["folder"], port, **options))
        return started[-1]
    yield start
    for joiner in started:
        joiner.stop()


def check_parity(pool: WorkerPool, flux: dict) -> None:
    model = pool.load_model(flux["path"])
    for name, (x, t, inputs) in flux["cases"].items():
        expected = flux["outputs"][name]
        got = model(x, t, **inputs)
        scale = max(1.0, expected.abs().max().item())
        error = (got - expected).abs().max().item()
        assert error <= 1e-5 * scale, f"{name}: max abs diff {error:.3g} > 1e-5 x {scale:.3g}"


def test_killed_remote_then_rejoined_ring_across_machines(flux, joiners):
    """A remote killed during a request (a slow load) fails it naming the machine and rank; the same pool serves
    again once the machine joins again: u2 x r2, Ulysses inside each machine, the ring across them."""
    port = free_port()
    joiner = joiners(port, env={"ULYSSES_SP_TEST_SLOW_PROGRESS": "load=0.3"})
    config = SPConfig(parse_devices("cpu:2,node2:cpu:2"), ulysses_degree=2, ring_degree=2)
    with WorkerPool(config, listen=f"127.0.0.1:{port}", token_file=flux["token"], threads=1,
                    start_timeout_s=START_S) as pool:
        status = pool.status()
        ranks = status["ranks"]
        assert [rank["machine"] for rank in ranks] == ["here", "here", "node2", "node2"]
        assert [(m["name"], m["ranks"], m["joined"]) for m in status["machines"]] == [
            ("here", [0, 1], True), ("node2", [2, 3], True)]
        assert status["machines"][0]["host"] == socket.gethostname()
        assert status["machines"][1]["host"].startswith("127.0.0.1:")  # the joined machine's address
        if PRIVATE_SHM:  # the joined machine's workers cannot see the host's shared memory
            seen = set(os.listdir(f"/proc/{ranks[2]['pid']}/root/dev/shm"))
            assert pool.segment_names() and not seen & set(pool.segment_names())
        failure: list[BaseException] = []

        def load() -> None:
            try:
                pool.load_model(flux["path"])
            except BaseException as error:  # noqa: BLE001 - examined below
                failure.append(error)
        loading = threading.Thread(target=load)
        loading.start()
        time.sleep(1.0)  # the slow load is under way on every rank
        killed_at = time.monotonic()
        joiner.stop()
        loading.join(timeout=60)
        assert not loading.is_alive()
        assert failure and isinstance(failure[0], WorkerError), failure
        assert "node2" in str(failure[0]) and f"rank {failure[0].rank}" in str(failure[0])
        assert failure[0].rank in (2, 3) and time.monotonic() - killed_at < pool.timeouts.watchdog_s
        assert [(m["name"], m["joined"], m["host"]) for m in pool.status()["machines"]][1] == ("node2", False, None)
        joiners(port)  # the machine joins again: the next request restarts the pool with it
        check_parity(pool, flux)
        assert pool.restarts == 1
        check_patch_set_reaches_both_machines(pool, flux)
        check_lora_files_across_machines(pool, flux)
        check_cancel_stops_the_remote_ranks(pool, flux)


def check_patch_set_reaches_both_machines(pool: WorkerPool, flux: dict) -> None:
    """A ComfyUI weight patch set (sent as bytes to the joined machine) changes the output as the same change
    written into a file does (that file loaded by both machines, each from its own folder)."""
    key = "double_blocks.0.img_mlp.0.weight"
    patch = random_patch("diff", (384, 96), 7, strength=1.0)
    patches = PatchSet({key: TargetPatches((384, 96), (patch,))}, (("diff", 1.0),))
    with safe_open(flux["path"], "pt") as handle:
        metadata = handle.metadata()
        weights = {name: handle.get_tensor(name) for name in handle.keys()}
    weights["model.diffusion_model." + key] = weights["model.diffusion_model." + key] + patch.tensors["diff"]
    patched_path = os.path.join(flux["folder"], "patched", "flux_patched.safetensors")
    os.makedirs(os.path.dirname(patched_path), exist_ok=True)
    save_file(weights, patched_path, metadata)
    shutil.copy(patched_path, os.path.join(flux["remote"], "flux_patched.safetensors"))
    x, t, inputs = flux["cases"][CASES[0]]
    expected = pool.load_model(patched_path)(x, t, **inputs).clone()
    model = pool.load_model(flux["path"])
    pool.set_loras(model, [], patches=patches)
    got = model(x, t, **inputs)
    scale = max(1.0, expected.abs().max().item())
    assert (got - expected).abs().max().item() <= 1e-5 * scale
    assert (got - flux["outputs"][CASES[0]]).abs().max().item() > 1e-3 * scale  # the patch changed the output


LORA_KEY, LORA_RANK, LORA_ALPHA, LORA_STRENGTH = "double_blocks.0.img_mlp.0", 4, 2.0, 0.7


def write_lora(path: str, rank: int = LORA_RANK, seed: int = 9) -> tuple[torch.Tensor, torch.Tensor]:
    """A ComfyUI-named LoRA (B @ A, alpha) on one Linear of Flux's first double block; returns (B, A)."""
    g = torch.Generator().manual_seed(seed)
    up, down = torch.randn(384, rank, generator=g), torch.randn(rank, 96, generator=g)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    save_file({f"diffusion_model.{LORA_KEY}.lora_B.weight": up, f"diffusion_model.{LORA_KEY}.lora_A.weight": down,
               f"diffusion_model.{LORA_KEY}.alpha": torch.tensor(LORA_ALPHA)}, path)
    return up, down


def check_lora_files_across_machines(pool: WorkerPool, flux: dict) -> None:
    """A LoRA file (each machine reads its own copy, checked against the host's identity) at u2 x r2 equals the
    single-device reference of the checkpoint with it merged by hand (W + strength x alpha / rank x B @ A); a LoRA
    whose copy on the joined machine differs is refused naming the machine and file, and the pool serves after."""
    lora = os.path.join(flux["folder"], "host_loras", "cross_lora.safetensors")
    up, down = write_lora(lora)
    shutil.copy(lora, os.path.join(flux["remote"], "cross_lora.safetensors"))
    state = load_file(flux["path"])
    with safe_open(flux["path"], "pt") as handle:
        metadata = handle.metadata()
    key = f"model.diffusion_model.{LORA_KEY}.weight"
    state[key] = state[key] + LORA_STRENGTH * LORA_ALPHA / LORA_RANK * (up @ down)
    merged = os.path.join(flux["folder"], "host_loras", "merged.safetensors")
    save_file(state, merged, metadata)
    x, t, inputs = flux["cases"][CASES[0]]
    want = file_reference("flux", merged)(x, t, **inputs)
    base = flux["outputs"][CASES[0]]
    scale = max(1.0, want.abs().max().item())
    assert (want - base).abs().max().item() > 1e-3 * scale, "the LoRA changes nothing"
    model = pool.load_model(flux["path"])
    assert model.set_loras([[lora, LORA_STRENGTH]])["parameters"] >= 1
    error = (model(x, t, **inputs) - want).abs().max().item()
    assert error <= 1e-5 * scale, f"LoRA across machines: max abs diff {error:.3g} > 1e-5 x {scale:.3g}"
    differs = os.path.join(flux["folder"], "host_loras", "lora_differs.safetensors")
    write_lora(differs)
    write_lora(os.path.join(flux["remote"], "lora_differs.safetensors"), rank=2)  # same name, another file
    restarts = pool.restarts
    with pytest.raises(WorkerError, match=r"machine 'node2'.*lora_differs\.safetensors"):
        model.set_loras([[differs, LORA_STRENGTH]])
    assert pool.restarts == restarts and pool.state == "idle"  # refused before node2's ranks began: no restart
    model.set_loras([])
    assert_matches(model(x, t, **inputs), base)


def check_cancel_stops_the_remote_ranks(pool: WorkerPool, flux: dict) -> None:
    """A call cancelled mid-run (the toy's blocks sleep 1 s each) stops every rank, the joined machine's too, at the
    same block check, without a restart; the next call equals the reference."""
    os.makedirs(os.path.join(flux["folder"], "host_toy"), exist_ok=True)
    path = toy_checkpoint(os.path.join(flux["folder"], "host_toy"), depth=3, heads=4)
    shutil.copy(path, os.path.join(flux["remote"], os.path.basename(path)))
    model = pool.load_model(path)
    pids, restarts = pool.worker_pids, pool.restarts
    started = time.monotonic()
    with pytest.raises(Cancelled):
        call_toy(model, toy_sleep=1.0, should_cancel=lambda: time.monotonic() - started > 0.3)
    elapsed = time.monotonic() - started
    assert elapsed < 2 * 1.0 + 1.0, f"cancel across machines took {elapsed:.1f} s (the call takes > 3 s)"
    assert pool.worker_pids == pids and pool.restarts == restarts and pool.state == "idle"
    deadline = time.monotonic() + 2.0  # the joined machine's counters come with its next beat (5 a second)
    while len({rank["blocks_done"] for rank in pool.status()["ranks"]}) > 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    done = [rank["blocks_done"] for rank in pool.status()["ranks"]]
    assert len(set(done)) == 1 and done[0] < 3, f"blocks passed per rank after the cancel: {done}"
    out, inputs = call_toy(model, seed=4)
    assert_matches(out, toy_reference(path)(**inputs))


def test_cfg_across_machines_a_model_that_differs_there_and_a_hung_remote(flux, joiners, tmp_path):
    """cfg2: one CFG half per machine. A model whose file on the joined machine is not the host's is refused with
    an error naming the machine and file; the pool then serves the matching one. A joined machine that stops
    (SIGSTOP: no heartbeat) fails the call within the watchdog time naming machine and rank; once it runs again it
    joins again and the pool serves."""
    other = conformance("flux").write(str(tmp_path / "host"))  # same architecture, written again under a new name
    renamed = os.path.join(os.path.dirname(other), "differs.safetensors")
    os.rename(other, renamed)
    with open(os.path.join(flux["remote"], "differs.safetensors"), "wb") as handle:  # same name, other file
        with open(renamed, "rb") as source:
            handle.write(source.read() + bytes(8))
    port = free_port()
    joiner = joiners(port)
    config = SPConfig(parse_devices("cpu,node2:cpu"), cfg_degree=2)
    with WorkerPool(config, listen=f"127.0.0.1:{port}", token_file=flux["token"], threads=1,
                    start_timeout_s=START_S, watchdog_s=WATCHDOG_S) as pool:
        check_parity(pool, flux)
        pool.unload_all()
        with pytest.raises(WorkerError, match=r"machine 'node2'.*differs\.safetensors"):
            pool.load_model(renamed)
        assert pool.restarts == 0 and pool.state == "idle"  # refused before node2's rank began: no restart
        check_parity(pool, flux)
        x, t, inputs = flux["cases"][CASES[0]]
        model = pool.load_model(flux["path"])
        stopped = joiner.tree()
        for process in stopped:
            process.suspend()
        started = time.monotonic()
        try:
            with pytest.raises(WorkerError, match=r"rank 1 on node2:cpu .*no progress") as hung:
                model(x, t, **inputs)
            assert hung.value.rank == 1 and time.monotonic() - started < WATCHDOG_S + 15
        finally:
            for process in stopped:
                try:
                    process.resume()
                except psutil.NoSuchProcess:
                    pass
        check_parity(pool, flux)


def test_wrong_token_unknown_and_duplicate_joiners_are_refused(flux, joiners, tmp_path):
    """The join command with a wrong token exits (2) saying why, and the host logs it; an unknown machine name, a
    duplicate of a joined machine and too few devices are refused by the same handshake (here in-process)."""
    point = JoinPoint("127.0.0.1:0", flux["token"], {"node2": ["cpu", "cpu"]})
    token = read_token(flux["token"])
    try:
        wrong = joiners(point.port, token=write_token(str(tmp_path / "other_token")))
        assert wrong.process.wait(timeout=120) == 2
        assert "wrong token" in wrong.output() and "wrong token" in point.refusals[-1]
        with pytest.raises(Refused, match="no devices on machine 'node3'"):
            connect("127.0.0.1", point.port, token, "node3", ["cpu"])
        with pytest.raises(Refused, match=r"needs devices \['cpu', 'cpu'\] on machine 'node2'"):
            connect("127.0.0.1", point.port, token, "node2", ["cpu"])
        first = connect("127.0.0.1", point.port, token, "node2", ["cpu", "cpu"])
        try:
            with pytest.raises(Refused, match="already joined"):
                connect("127.0.0.1", point.port, token, "node2", ["cpu", "cpu"])
        finally:
            first.close()
    finally:
        point.close()


def test_layout_keeps_ulysses_inside_a_machine(flux):
    devices = parse_devices("cpu:2,node2:cpu:2")
    assert devices == ["cpu", "cpu", "node2:cpu", "node2:cpu"]
    assert SPConfig(devices, ulysses_degree=2, ring_degree=2).ulysses_groups_across_machines() == []
    with pytest.raises(ValueError, match="Ulysses groups .* across machines"):
        WorkerPool(SPConfig(devices, ulysses_degree=4), token_file=flux["token"])
    with pytest.raises(ValueError, match="token_file"):
        WorkerPool(SPConfig(devices, ulysses_degree=2, ring_degree=2))


def test_doctor_measures_the_link_and_recommends_a_layout(flux, joiners):
    port = free_port()
    joiners(port, devices="cpu")
    done = subprocess.run([sys.executable, "-m", "sp_runtime", "doctor", "--devices", "cpu:2", "--skip-workers",
                           "--skip-bandwidth", "--tflops", "1,1", "--model", "wan", "--machines", "node2",
                           "--listen", f"127.0.0.1:{port}", "--token-file", flux["token"]],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "machine node2" in done.stdout and "GB/s per direction" in done.stdout
    assert "Ulysses across machines" in done.stdout and "recommended across machines: u2" in done.stdout
