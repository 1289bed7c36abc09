"""`python -m sp_runtime doctor` on 2 CPU workers (devices, worker start, gloo all-to-all bandwidth, JSON), the
peer-to-peer report with a GPU pair that lacks P2P (simulated), and the speed model's recommendation on stated
GPU-like numbers."""
import json

import pytest

from sp_runtime.__main__ import main
from sp_runtime.cli.speed_model import transfer_seconds


def test_doctor_on_cpu_workers_writes_its_report(tmp_path, capsys):
    out = tmp_path / "doctor.json"
    code = main(["doctor", "--devices", "cpu*2", "--sizes", "0.0625,1", "--repeats", "2", "--model", "flux",
                 "--width", "512", "--height", "512", "--json", str(out)])
    printed = capsys.readouterr().out
    assert code == 0, printed
    report = json.loads(out.read_text())
    assert report["gpus"]["count"] == 0 and report["cpu"]["logical_cores"] >= 1
    assert report["workers"]["ok"] is True and report["workers"]["start_s"] > 0
    rows = report["all_to_all"]["rows"]
    assert [row["bytes"] for row in rows] == [2**16, 2**20]
    assert all(row["seconds"] > 0 and row["algbw_gb_s"] > 0 for row in rows)
    # the report rounds to 1e-3 GB/s: on a slow, loaded machine that rounding is above 1% of the figures
    assert rows[0]["busbw_gb_s"] == pytest.approx(rows[0]["algbw_gb_s"] / 2, rel=1e-2, abs=1e-3)
    recommendation = report["recommendation"]
    assert recommendation["image_tokens"] == 1024 and recommendation["heads"] == 24
    assert recommendation["recommended_layout"] == "1"  # CPU workers share their cores
    layouts = {row["layout"]: row for row in recommendation["rows"]}
    assert {"1", "u2", "r2", "u2+shard_weights"} <= set(layouts) and layouts["u2"]["exchange_s"] > 0
    assert recommendation["link"] == "the measured all-to-all sweep"
    assert any("share the same cores" in reason for reason in recommendation["reasons"])
    assert "all-to-all bandwidth" in printed and "recommended: 1" in printed


def test_doctor_json_to_stdout_is_pure_json(capsys):
    code = main(["doctor", "--devices", "cpu*2", "--skip-workers", "--skip-bandwidth", "--model", "wan",
                 "--width", "320", "--height", "192", "--frames", "9", "--json", "-"])
    assert code == 0
    report = json.loads(capsys.readouterr().out)
    assert report["recommendation"]["image_tokens"] == 3 * 12 * 20
    assert "workers" not in report and "all_to_all" not in report


@pytest.mark.parametrize("arguments, message", [
    (["--devices", "gpu7"], "'gpu7' is not understood"),
    (["--devices", "cpu,cuda:0"], "mix CPU and CUDA"),
    (["--sizes", "abc"], "--sizes 'abc' must be numbers"),
    (["--repeats", "0"], "--repeats must be at least 1"),
])
def test_doctor_refuses_bad_arguments(arguments, message, capsys):
    args = ["doctor", *arguments] if "--devices" in arguments else ["doctor", "--devices", "cpu*2", *arguments]
    assert main(args) == 2
    assert message in capsys.readouterr().err


def test_missing_peer_to_peer_is_reported_with_the_nccl_remedies(monkeypatch, capsys):
    import torch

    from sp_runtime.cli import doctor
    monkeypatch.setattr(torch.cuda, "can_device_access_peer", lambda a, b: {a, b} != {0, 2})
    result = doctor._peer_access(doctor._Printer(False), ["cuda:0", "cuda:1", "cuda:2"])
    assert result["missing"] == ["0->2", "2->0"]
    printed = capsys.readouterr().out
    assert "NCCL_P2P_DISABLE=1" in printed and "0->2" in printed


def test_transfer_time_interpolates_the_measured_sweep():
    sweep = [{"bytes": 2**20, "seconds": 1e-3}, {"bytes": 2**24, "seconds": 4e-3}]
    assert transfer_seconds(2**20, sweep) == pytest.approx(1e-3)
    assert transfer_seconds(2**22, sweep) == pytest.approx(2e-3)  # halfway in log-log
    assert transfer_seconds(2**26, sweep) == pytest.approx(16e-3)  # the largest message's bandwidth beyond it
    assert transfer_seconds(1, sweep) == pytest.approx(1e-3)


def _stated_doctor(capsys, model: str, size: list[str], devices: int, link_gbs: float, memory_gb: float) -> dict:
    """The doctor's report for stated H100-like GPUs (600 / 400 TFLOP/s): no worker, no link measured."""
    code = main(["doctor", "--devices", "cpu*2", "--skip-workers", "--skip-bandwidth", "--model", model, *size,
                 "--plan-devices", str(devices), "--tflops", "600,400", "--link-gbs", str(link_gbs),
                 "--memory-gb", str(memory_gb), "--json", "-"])
    assert code == 0
    return json.loads(capsys.readouterr().out)["recommendation"]


def test_recommendation_uses_every_gpu_when_the_link_is_fast(capsys):
    result = _stated_doctor(capsys, "wan", ["--width", "832", "--height", "480", "--frames", "81"], 4, 100, 80)
    assert result["image_tokens"] == 21 * 30 * 52
    best = next(row for row in result["rows"] if row["layout"] == result["recommended_layout"])
    assert best["devices"] == 4 and best["speedup"] > 3 and best["exchange_s"] < best["compute_s"]
    assert result["reasons"][0].startswith(f"predicted {best['speedup']:.2f}x faster than one device")


def test_recommendation_stays_on_one_gpu_when_the_link_is_slow(capsys):
    result = _stated_doctor(capsys, "flux", ["--width", "512", "--height", "512"], 4, 0.5, 80)
    assert result["recommended_layout"] == "1"
    assert "no layout on more devices is predicted to be at least 5% faster" in result["reasons"][0]


def test_recommendation_splits_the_weights_when_the_model_does_not_fit(capsys):
    result = _stated_doctor(capsys, "qwen-image", ["--width", "1328", "--height", "1328"], 4, 450, 24)
    layout = result["recommended_layout"]
    assert "shard_weights" in layout or "tp" in layout
    assert any("do not fit on one device (24.0 GB)" in reason for reason in result["reasons"])
