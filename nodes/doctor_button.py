"""The panel's "Run doctor" button: `python -m sp_runtime doctor` in a fresh interpreter (a hung probe cannot stall
ComfyUI), its JSON report read back; one doctor at a time (it starts rank processes on the pool's own devices)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from typing import Optional

import sp_runtime

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(sp_runtime.__file__)))  # the folder holding sp_runtime
_running = threading.Lock()


class DoctorBusy(RuntimeError):
    """A doctor is running already (the route answers 409)."""


def doctor_report(devices: list[str], family: Optional[str] = None, timeout_s: float = 600.0) -> dict:
    """The doctor's report for these devices and the model family in use (no worker check: the pool shows that).
    Raises DoctorBusy at once while another doctor runs."""
    if not _running.acquire(blocking=False):
        raise DoctorBusy("the doctor is already running (one at a time): wait for its report")
    try:
        return _run_doctor(devices, family, timeout_s)
    finally:
        _running.release()


def _run_doctor(devices: list[str], family: Optional[str], timeout_s: float) -> dict:
    family = family or ""
    model = "flux" if family.startswith("flux") else "wan" if family.startswith("wan") else "qwen-image"
    spec = f"cpu:{len(devices)}" if all(d.startswith("cpu") for d in devices) else ",".join(devices)
    command = [sys.executable, "-m", "sp_runtime", "doctor", "--json", "-", "--skip-workers", "--repeats", "2",
               "--devices", spec, "--model", model]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (_ROOT, os.environ.get("PYTHONPATH")) if p))
    done = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s, env=env)
    if done.returncode not in (0, 1) or not done.stdout.strip():  # 1: the report says what failed
        raise RuntimeError(f"doctor exited with {done.returncode}: {(done.stderr or done.stdout).strip()[-800:]}")
    return json.loads(done.stdout)
