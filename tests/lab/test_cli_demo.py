"""`python -m sp_lab demo` end to end on 2 CPU workers: its printed and JSON results and its picture with the
tiny random-weight preset, the trained shapes preset (with a few training steps), its parity check (which must fail
when the pool's result differs), and its errors for impossible layouts."""
import json
import os
import subprocess
import sys
from dataclasses import replace

import numpy
import pytest
import torch

from sp_lab.__main__ import main
from sp_lab.cli.plotting import PANEL_GAP, TITLE_HEIGHT

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/<folder>/ -> the root
STEPS = 3


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("cli_demo_cache"))


def test_demo_command_runs_and_passes_its_parity_check(tmp_path, cache_dir):
    from PIL import Image
    out = tmp_path / "out"
    done = subprocess.run([sys.executable, "-m", "sp_lab", "demo", "--preset", "tiny", "--steps", str(STEPS),
                           "--devices", "cpu*2", "--out", str(out), "--cache-dir", cache_dir],
                          cwd=ROOT, capture_output=True, text=True, timeout=240,
                          env=dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")]))))
    assert done.returncode == 0, done.stdout + done.stderr
    assert "leaked shared_memory" not in done.stderr and "Warning" not in done.stderr, done.stderr
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
    assert summary["workload"]["latent_shape"][0] == 1 and "training" not in summary
    assert "random weights" in summary["shows"]
    _check_picture(out / "demo.png", summary)


def _check_picture(path, summary):
    """Three panels (pool, one device, difference) in a row; the first two show the same pictures."""
    from PIL import Image
    with Image.open(path) as picture:
        picture.verify()
    with Image.open(path) as picture:
        assert picture.mode == "RGB" and (picture.width - 4 * PANEL_GAP) % 3 == 0  # three panels of one width
        pixels = torch.from_numpy(numpy.array(picture)).float()
    panel = (picture.width - 4 * PANEL_GAP) // 3
    below_titles = pixels[TITLE_HEIGHT:]
    pool = below_titles[:, PANEL_GAP:PANEL_GAP + panel]
    one_device = below_titles[:, 2 * PANEL_GAP + panel:2 * PANEL_GAP + 2 * panel]
    assert pool.std() > 10  # not a blank panel
    assert (pool - one_device).abs().mean() < 1
    gain = summary["difference_gain"]
    assert gain >= 1 and (summary["max_abs_difference"] == 0 or 0.4 <= summary["max_abs_difference"] * gain <= 1)
    assert f"{gain:.0e}" in summary["difference_title"]


@pytest.fixture
def few_training_steps(monkeypatch):
    """The shapes preset trained for 3 steps instead of a minute (its own recipe hash, so its own cache file)."""
    from sp_lab.cli import demo_training
    real = demo_training.recipe_of
    monkeypatch.setattr(demo_training, "recipe_of", lambda preset: replace(real(preset), steps=3, batch=4))


def test_demo_trains_its_model_on_first_run_and_draws_every_shape(tmp_path, cache_dir, few_training_steps, capsys):
    code = main(["demo", "--steps", "2", "--devices", "cpu*2", "--out", str(tmp_path), "--cache-dir", cache_dir])
    output = capsys.readouterr().out
    assert code == 0, output
    assert "training the demo model, 3 steps" in output and "PASS" in output
    summary = json.loads((tmp_path / "demo.json").read_text())
    assert summary["preset"] == "shapes" and summary["passed"] is True
    assert "-trained-" in summary["checkpoint"]["path"]
    training = summary["training"]
    assert training["this_run"] is True and training["loss"]["steps"] == 3 and training["seconds"] > 0
    assert len(summary["samples"]) == summary["workload"]["batch"] == 12 and summary["samples"][0] == "red circle"
    assert summary["workload"]["latent_shape"] == [12, 16, 1, 12, 12]
    _check_picture(tmp_path / "demo.png", summary)


def test_demo_fails_when_the_pool_result_differs(tmp_path, cache_dir, few_training_steps, monkeypatch, capsys):
    from sp_lab.cli import demo
    real = demo._reference_model

    def perturbed(*args):
        model, forward = real(*args)
        return model, lambda *a, **k: forward(*a, **k) + 1e-3
    monkeypatch.setattr(demo, "_reference_model", perturbed)
    code = main(["demo", "--steps", "2", "--devices", "cpu*2", "--out", str(tmp_path), "--cache-dir", cache_dir])
    assert code == 1
    assert "FAIL" in capsys.readouterr().out
    summary = json.loads((tmp_path / "demo.json").read_text())
    assert summary["passed"] is False and summary["max_abs_difference"] > summary["tolerance_abs"]
    assert 0.4 <= summary["max_abs_difference"] * summary["difference_gain"] <= 1


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


def test_the_products_command_line_points_at_the_lab_for_lab_commands(capsys):
    from sp_runtime.__main__ import main as product_main
    assert product_main(["demo", "--steps", "2"]) == 2
    assert "python -m sp_lab demo" in capsys.readouterr().err
