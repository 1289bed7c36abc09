"""The panel's doctor (nodes/doctor_button.py): one doctor at a time; a second request while one runs is refused
at once (the route answers HTTP 409) instead of starting another doctor with its rank processes."""
import subprocess
import threading

import pytest

from comfy_support import import_node_module

doctor_button = import_node_module("doctor_button")


def test_a_second_doctor_while_one_runs_is_refused_at_once(monkeypatch):
    started, release = threading.Event(), threading.Event()
    runs = []

    def slow_doctor(command, **kwargs):
        runs.append(command)
        started.set()
        release.wait(10)
        return subprocess.CompletedProcess(command, 0, stdout='{"recommendation": {}}', stderr="")
    monkeypatch.setattr(doctor_button.subprocess, "run", slow_doctor)
    first = threading.Thread(target=doctor_button.doctor_report, args=(["cpu", "cpu"],))
    first.start()
    try:
        assert started.wait(10)
        with pytest.raises(doctor_button.DoctorBusy, match="already running"):
            doctor_button.doctor_report(["cpu", "cpu"])
        assert len(runs) == 1
    finally:
        release.set()
        first.join(10)
    assert doctor_button.doctor_report(["cpu", "cpu"]) == {"recommendation": {}}  # free again afterwards
    assert len(runs) == 2
