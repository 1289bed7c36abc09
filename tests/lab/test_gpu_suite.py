"""`python -m sp_lab gpu-suite`: refuses without CUDA unless --allow-cpu; on CPU its sections run with tiny sizes
and write their JSON after each section; a section that does not fit the budget is skipped with the reason, and a
failing one is recorded without losing the others."""
import json

import pytest

from sp_lab.__main__ import main
from sp_lab.cli import gpu_suite


def _report(folder):
    return json.loads((folder / "gpu_suite.json").read_text())


def test_refuses_cleanly_without_cuda(tmp_path, capsys, monkeypatch):
    import torch
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main(["gpu-suite", "--out", str(tmp_path)]) == 2
    assert "no CUDA device is visible" in capsys.readouterr().err
    assert not (tmp_path / "gpu_suite.json").exists()


@pytest.mark.parametrize("arguments, message", [(["--sections", "environment,warp"], "unknown ['warp']"),
                                                (["--budget-s", "0"], "--budget-s must be positive")])
def test_refuses_bad_arguments(arguments, message, tmp_path, capsys):
    assert main(["gpu-suite", "--allow-cpu", "--out", str(tmp_path), *arguments]) == 2
    assert message in capsys.readouterr().err


def test_cpu_safe_sections_run_and_report(tmp_path, capsys):
    code = main(["gpu-suite", "--allow-cpu", "--out", str(tmp_path),
                 "--sections", "environment,attention,fp8,bandwidth,multi_gpu_parity"])
    printed = capsys.readouterr().out
    assert code == 0, printed
    sections = _report(tmp_path)["sections"]
    assert [sections[n]["status"] for n in ("environment", "attention", "fp8", "bandwidth")] == ["ok"] * 4
    assert sections["multi_gpu_parity"] == {"estimated_s": None, "status": "skipped",
                                            "reason": "needs 2 or more GPUs (NCCL between distinct GPUs)"}
    assert sections["environment"]["machine"]["torch"]
    layouts = sections["attention"]["layouts"]
    assert set(layouts) == {"u2", "r2"}
    variants = {(row["case"], row["variant"]) for row in layouts["u2"]["rows"]}
    assert len(variants) == 3 * 3 and all(row["ok"] for row in layouts["u2"]["rows"] + layouts["r2"]["rows"])
    assert sections["fp8"]["bytes_ratio"] == pytest.approx(18 / 32)  # D=16: 16 code bytes + a bf16 scale vs 32
    rows = sections["bandwidth"]["rows"]
    assert [row["bf16_bytes_per_rank"] for row in rows] == [2**16, 2**20]
    assert all(row["plain_ms"] > 0 and row["fp8_ms"] > 0 for row in rows)
    assert (tmp_path / "gpu_suite.png").stat().st_size > 0
    assert "section" in printed and "bandwidth" in printed


def test_budget_skips_and_failures_are_recorded_without_losing_other_sections(tmp_path, monkeypatch):
    def broken(suite):
        raise RuntimeError("kernel exploded")
    monkeypatch.setitem(gpu_suite.SECTIONS, "fp8", (lambda s: 1, broken))
    code = main(["gpu-suite", "--allow-cpu", "--out", str(tmp_path), "--budget-s", "30",
                 "--sections", "environment,fp8,attention"])
    sections = _report(tmp_path)["sections"]
    assert code == 1
    assert sections["environment"]["status"] == "ok"
    assert sections["fp8"]["status"] == "failed" and sections["fp8"]["error"] == "RuntimeError: kernel exploded"
    assert sections["attention"]["status"] == "skipped"
    assert sections["attention"]["reason"].startswith("estimated 60 s but ")



def test_quant_vs_comfyui_is_skipped_with_the_reason_without_comfyui(tmp_path, monkeypatch):
    monkeypatch.delenv("COMFYUI_PATH", raising=False)
    assert main(["gpu-suite", "--allow-cpu", "--out", str(tmp_path), "--sections", "quant_vs_comfyui"]) == 0
    assert _report(tmp_path)["sections"]["quant_vs_comfyui"] == {
        "estimated_s": None, "status": "skipped", "reason": gpu_suite.NOT_APPLICABLE["quant_vs_comfyui"]}
    assert "COMFYUI_PATH" in gpu_suite.NOT_APPLICABLE["quant_vs_comfyui"]
