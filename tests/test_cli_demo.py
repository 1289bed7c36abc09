"""`python -m sp_runtime demo` end to end on 2 CPU workers with the tiny preset: its printed and JSON results, its
picture, its parity check (which must fail when the pool's result differs), and its errors for impossible layouts."""
import json
import os
import subprocess
import sys

import pytest

from sp_runtime.__main__ import main

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS = 3


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("cli_demo_cache"))


def test_demo_command_runs_and_passes_its_parity_check(tmp_path, cache_dir):
    from PIL import Image
    out = tmp_path / "out"
    done = subprocess.run([sys.executable, "-m", "sp_runtime", "demo", "--preset", "tiny", "--steps", str(STEPS),
                           "--devices", "cpu*2", "--out", str(out), "--cache-dir", cache_dir],
                          cwd=ROOT, capture_output=True, text=True, timeout=240,
                          env=dict(os.environ, PYTHONPATH=ROOT))
    assert done.returncode == 0, done.stdout + done.stderr
    assert "speed-up" in done.stdout and "PASS" in done.stdout
    assert done.stdout.count("step ") >= 2 * STEPS  # progress: every step of both loops is printed

    summary = json.loads((out / "demo.json").read_text())
    assert summary["passed"] is True
    assert summary["layout"] == "u2" and summary["devices"] == ["cpu", "cpu"]
    assert 0 <= summary["max_abs_difference"] <= summary["tolerance_abs"] == summary["tolerance"] * \
        summary["output_scale"]
    assert summary["tolerance"] == 1e-5  # fp32
    assert summary["speedup"] > 0
    for loop in ("pool", "pool_slowest_worker", "one_device"):
        assert len(summary["step_ms"][loop]) == STEPS and all(ms > 0 for ms in summary["step_ms"][loop])
    # the pool's host-side time of a call includes its slowest worker's time
    assert all(host >= worker for host, worker in zip(summary["step_ms"]["pool"],
                                                      summary["step_ms"]["pool_slowest_worker"]))
    assert summary["model"]["family"] == "qwen_image"
    latent = summary["workload"]["latent_shape"]  # [1, 16, 1, H, W]
    with Image.open(out / "demo.png") as picture:
        picture.verify()
    with Image.open(out / "demo.png") as picture:
        assert picture.mode == "RGB" and picture.size == (latent[4] * 8, latent[3] * 8)


def test_demo_fails_when_the_pool_result_differs(tmp_path, cache_dir, monkeypatch, capsys):
    from sp_runtime.cli import demo
    real = demo._reference_model

    def perturbed(*args):
        model, forward = real(*args)
        return model, lambda *a, **k: forward(*a, **k) + 1e-3
    monkeypatch.setattr(demo, "_reference_model", perturbed)
    code = main(["demo", "--preset", "tiny", "--steps", "2", "--devices", "cpu*2", "--out", str(tmp_path),
                 "--cache-dir", cache_dir])
    assert code == 1
    assert "FAIL" in capsys.readouterr().out
    summary = json.loads((tmp_path / "demo.json").read_text())
    assert summary["passed"] is False and summary["max_abs_difference"] > summary["tolerance_abs"]


@pytest.mark.parametrize("arguments, message", [
    (["--layout", "u3"], "u3"),
    (["--layout", "cfg4"], "cfg_degree=4"),
    (["--layout", "u2x"], "not understood"),
    (["--layout", "1"], "uses 1 of the 2 devices"),
    (["--preset", "huge"], "unknown preset 'huge'"),
    (["--steps", "0"], "--steps"),
    (["--devices", "gpu7"], "'gpu7' is not understood"),
])
def test_demo_refuses_impossible_requests_before_starting(arguments, message, tmp_path, capsys):
    code = main(["demo", "--devices", "cpu*2", "--out", str(tmp_path), *arguments]
                if "--devices" not in arguments else ["demo", "--out", str(tmp_path), *arguments])
    assert code == 2
    error = capsys.readouterr().err
    assert message in error, error
    assert not (tmp_path / "demo.json").exists()
