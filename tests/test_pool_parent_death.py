"""A killed parent: its workers exit by themselves within seconds, and the next pool start removes the shared
memory segments and the log folder the dead parent left behind.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from multiprocessing import resource_tracker
from multiprocessing.shared_memory import SharedMemory

from test_pool_kit import alive, open_pool, segments_of, toy_checkpoint

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CHILD = textwrap.dedent("""
    import json, sys, time
    import torch
    from sp_runtime import SPConfig
    from sp_runtime.pool import WorkerPool
    pool = WorkerPool(SPConfig(["cpu", "cpu"]))
    model = pool.load_model(sys.argv[1])
    model(torch.zeros(1, 4, 4, 4), torch.zeros(1), context=torch.zeros(1, 2, 8), y=torch.zeros(1, 6))
    print(json.dumps({"pids": pool.worker_pids, "segments": pool.segment_names(), "log_dir": pool.log_dir}),
          flush=True)
    time.sleep(600)
""")


def wait_until(condition, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.05)
    return condition()


def test_workers_exit_when_the_parent_is_killed(tmp_path):
    checkpoint = toy_checkpoint(tmp_path)
    env = dict(os.environ, PYTHONPATH=ROOT)
    child = subprocess.Popen([sys.executable, "-c", CHILD, checkpoint], stdout=subprocess.PIPE, env=env, text=True)
    workers = []
    try:
        report = json.loads(child.stdout.readline())
        workers = report["pids"]
        assert len(workers) == 2 and alive(workers) == workers
        assert len(report["segments"]) == 3
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=10)
        assert wait_until(lambda: not alive(workers), 5.0), f"workers {alive(workers)} outlived their parent"
    finally:
        child.kill()
        child.wait()
        for pid in alive(workers):  # only if the test failed: never leave them running
            os.kill(pid, signal.SIGKILL)
    stale = _fake_stale_segment(report["segments"][0])
    assert stale in segments_of(child.pid)
    with open_pool(1):
        assert segments_of(child.pid) == []
        assert not os.path.exists(report["log_dir"])


def _fake_stale_segment(sibling: str) -> str:
    """A segment of the dead pool (its pid and token) that no resource tracker will clean (as after a killed
    tracker)."""
    shm = SharedMemory(name=sibling.rsplit("_", 1)[0] + "_stale", create=True, size=64)
    resource_tracker.unregister(shm._name, "shared_memory")
    shm.close()
    return shm.name
