"""`python -m sp_runtime doctor` on 2 CPU workers (devices, worker start, gloo all-to-all bandwidth, JSON), the
peer-to-peer report with a GPU pair that lacks P2P (simulated), and the degree recommendation's model on GPU-like
numbers."""
import json

import pytest

from sp_runtime.__main__ import main
from sp_runtime.cli.recommend import Throughput, recommend, shard_weights_estimate, transfer_seconds


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
    assert [c["layout"] for c in recommendation["candidates"]] == ["1", "u2"]
    assert recommendation["candidates"][1]["comm_ms"] > 0
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


def _link(gigabytes_per_s):
    return [{"bytes": size, "seconds": 20e-6 + size / (gigabytes_per_s * 1e9)} for size in (2**16, 2**20, 2**28)]


H100_LIKE = Throughput("cuda:0", "bfloat16", 400e12, 600e12)


def test_recommendation_uses_every_gpu_when_the_link_is_fast():
    result = recommend("wan", 832, 480, 81, None, [f"cuda:{i}" for i in range(4)], _link(100), H100_LIKE, 80e9)
    assert result["image_tokens"] == 21 * 30 * 52
    assert result["recommended_layout"] == "u4"
    u4 = result["candidates"][-1]
    assert u4["estimated_speedup"] > 3 and u4["comm_ms"] < u4["compute_ms"]
    assert any("40 heads on 4 ranks: divisible" in reason for reason in result["reasons"])


def test_recommendation_stays_small_when_the_link_is_slow_and_names_head_padding():
    small_image = recommend("flux", 512, 512, 1, None, ["cuda:0", "cuda:1", "cuda:2"], _link(0.5), H100_LIKE, 80e9)
    assert small_image["recommended_layout"] == "1"
    three = small_image["candidates"][-1]
    assert three["layout"] == "u3" and three["comm_ms"] > three["compute_ms"]
    assert any("24 heads on 3 ranks: divisible" in reason for reason in three["reasons"])
    wan = recommend("wan", 832, 480, 81, None, ["cuda:0", "cuda:1", "cuda:2"], _link(100), H100_LIKE, 24e9)
    assert any("padded to 42" in reason for reason in wan["candidates"][-1]["reasons"])
    assert any("do not fit in 24.0 GB" in reason for reason in wan["reasons"])


def test_recommendation_weighs_shard_weights_when_the_model_does_not_fit():
    gpus = [f"cuda:{i}" for i in range(4)]
    fast = recommend("qwen-image", 1328, 1328, 1, None, gpus, _link(1000), H100_LIKE, 24e9)
    weights = fast["parameters"] * 2
    sharding = fast["shard_weights"]
    assert sharding["bytes_moved_per_step"] == pytest.approx(weights * 3 / 4, rel=1e-6)
    assert weights / 4 < sharding["weights_per_device_bytes"] < weights / 4 + 0.1 * weights  # + two blocks
    assert any("load with shard_weights" in reason for reason in fast["reasons"])
    assert "(overlapped: hidden)" in sharding["advice"]
    compute_s = fast["candidates"][-1]["compute_ms"] / 1e3
    slow = shard_weights_estimate(weights, fast["attention_layers"], 4, _link(25), compute_s)
    assert slow["gather_ms"] > 10 * sharding["gather_ms"] and "adds ~" in slow["advice"]
    assert shard_weights_estimate(weights, 60, 1, _link(25), compute_s) is None
