"""A small /dev/shm (Docker's default is 64 MB): tensors that do not fit go through a private file instead, and
when that cannot hold them either the call fails with what to do (--shm-size); never SIGBUS, and the pool stays
usable. Runs a pool in a private mount namespace with an 8 MiB /dev/shm (needs root; skipped otherwise)."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap

import pytest

from pool_kit import toy_checkpoint

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/<folder>/ -> the root
CHILD = textwrap.dedent("""
    import json, os, sys
    import torch
    from sp_runtime import SPConfig
    from sp_runtime.pool import WorkerPool
    from sp_runtime.pool.mappings import SharedMemoryFull
    report = {}
    with WorkerPool(SPConfig(["cpu", "cpu"])) as pool:
        model = pool.load_model(sys.argv[1])
        def run(shape):
            x = torch.randn(shape)
            out = model(x, torch.zeros(shape[0]), context=torch.zeros(shape[0], 2, 8), y=torch.zeros(shape[0], 6))
            return (out - x * 0.5).abs().max().item()  # the passthrough toy returns x * scale (0.5)
        report["big_error"] = run((1, 4, 1024, 768))  # 12 MiB in, 12 MiB out: more than /dev/shm holds
        report["segments"] = pool.segment_names()
        try:
            run((1, 4, 2048, 1536))  # 48 MiB: more than the 32 MiB folder of the fallback files too
        except SharedMemoryFull as error:
            report["error"] = str(error)
        report["small_error"] = run((1, 4, 8, 8))
        report["state"] = pool.state
    print(json.dumps(report), flush=True)
""")


def can_mount() -> bool:
    if shutil.which("unshare") is None:
        return False
    probe = subprocess.run(["unshare", "-m", "sh", "-c", "mount -t tmpfs -o size=1m tmpfs /mnt"],
                           capture_output=True)
    return probe.returncode == 0


@pytest.mark.skipif(not sys.platform.startswith("linux") or not can_mount(),
                    reason="needs Linux and the right to mount a tmpfs in a private mount namespace (root)")
def test_a_small_dev_shm_falls_back_to_a_file_then_says_what_to_do(tmp_path):
    checkpoint = toy_checkpoint(tmp_path, passthrough=True)
    spill = tmp_path / "tmp"
    spill.mkdir()
    script = (f"mount -t tmpfs -o size=8m,mode=1777 tmpfs /dev/shm && mount -t tmpfs -o size=32m,mode=1777 tmpfs "
              f"{spill} && exec \"$0\" -c \"$1\" \"$2\"")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])), TMPDIR=str(spill))
    done = subprocess.run(["unshare", "-m", "--propagation", "private", "sh", "-c", script, sys.executable, CHILD,
                           checkpoint], capture_output=True, text=True, env=env, timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]  # a SIGBUS would show as -7 / 135 here
    report = json.loads(done.stdout)
    assert report["big_error"] == 0.0 and report["small_error"] == 0.0 and report["state"] == "idle"
    assert any(os.path.isabs(name) for name in report["segments"])  # file-backed
    assert "--shm-size" in report["error"] and "/dev/shm" in report["error"]
    assert "using a file" in done.stderr
    assert os.listdir(spill) == []  # nothing left once the namespace is gone (and nothing was outside it)
