"""A killed parent: its workers exit by themselves within seconds and remove the shared memory segments and the
log folder the dead parent left behind; what a dead pool still left (its workers killed too) the next pool start
removes.
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

from sp_runtime.pool.ownership import OwnerLock
from sp_runtime.pool.segments import SHM_DIR
from pool_kit import alive, open_pool, segments_of, toy_checkpoint

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/<folder>/ -> the root
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


def test_workers_exit_and_clean_up_when_the_parent_is_killed(tmp_path):
    checkpoint = toy_checkpoint(tmp_path)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])))
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
    assert segments_of(child.pid) == [] and not os.path.exists(report["log_dir"])  # the workers removed them
    stale = _fake_dead_pool_leftovers(report["segments"][0])
    assert set(stale) <= set(segments_of(child.pid))
    with open_pool(1):
        assert segments_of(child.pid) == []


def _fake_dead_pool_leftovers(sibling: str) -> list[str]:
    """What a pool killed together with its workers leaves: a segment of its pid and token that no resource
    tracker will clean (as after a killed tracker), and its unlocked owner file."""
    owner = sibling.rsplit("_", 1)[0]
    shm = SharedMemory(name=owner + "_stale", create=True, size=64)
    resource_tracker.unregister(shm._name, "shared_memory")
    shm.close()
    OwnerLock(os.path.join(SHM_DIR, owner + "_lock")).forget()  # the lock is dropped with its descriptor
    return [shm.name, owner + "_lock"]


def test_sigterm_to_the_process_group_leaves_no_segment_folder_or_worker(tmp_path):
    """systemd, a supervisor or a terminal signal the whole group: the host dies at once; its workers clean up."""
    checkpoint = toy_checkpoint(tmp_path)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])))
    child = subprocess.Popen([sys.executable, "-c", CHILD, checkpoint], stdout=subprocess.PIPE, env=env, text=True,
                             start_new_session=True)
    workers = []
    try:
        report = json.loads(child.stdout.readline())
        workers = report["pids"]
        os.killpg(child.pid, signal.SIGTERM)
        child.wait(timeout=10)
        assert wait_until(lambda: not alive(workers), 5.0), f"workers {alive(workers)} outlived their parent"
        left = [name for name in report["segments"] if os.path.exists(f"/dev/shm/{name}")]
        assert left == [] and not os.path.exists(report["log_dir"])
    finally:
        child.kill()
        child.wait()
        for pid in alive(workers):
            os.kill(pid, signal.SIGKILL)


GARBAGE = textwrap.dedent("""
    import gc, json, os, sys
    import torch
    from sp_runtime import SPConfig
    from sp_runtime.pool import WorkerPool
    pool = WorkerPool(SPConfig(["cpu", "cpu"]))
    model = pool.load_model(sys.argv[1])
    model(torch.zeros(1, 4, 4, 4), torch.zeros(1), context=torch.zeros(1, 2, 8), y=torch.zeros(1, 6))
    names, pids = pool.segment_names(), pool.worker_pids
    del model, pool
    gc.collect()
    print(json.dumps({"pids": pids, "segments": names,
                      "left": [name for name in names if os.path.exists("/dev/shm/" + name)]}), flush=True)
""")


def test_a_pool_dropped_without_close_is_cleaned_up_without_warnings(tmp_path):
    checkpoint = toy_checkpoint(tmp_path)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])))
    done = subprocess.run([sys.executable, "-c", GARBAGE, checkpoint], capture_output=True, env=env, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert len(report["segments"]) == 3 and report["left"] == []  # released when collected, not at exit
    assert alive(report["pids"]) == []
    assert "leaked" not in done.stderr and "resource_tracker" not in done.stderr, done.stderr
    assert "Exception ignored" not in done.stderr, done.stderr
