"""`python -m sp_lab bench` end to end on 2 CPU workers (tiny presets, written and drawn on the workers): the
JSON fields, parity against layout 1, the communication bytes against an independent count, the plot, the random
weights agreeing across ranks, and clear errors for impossible requests."""
import json
from collections import namedtuple

import pytest
import torch

from sp_lab.__main__ import main


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("cli_bench_cache"))


def _ulysses_bytes(tokens, text, heads, head_dim, layers, degree, element_bytes=4):
    """Bytes one rank sends per step in Ulysses attention, counted here from the exchange shapes on their own."""
    chunk = -(-tokens // degree)                # shards padded to the longest
    local_heads = -(-heads // degree)           # heads padded to a multiple of the degree
    to_heads = degree * 3 * local_heads * chunk * head_dim       # q, k, v of my tokens for every rank's heads
    to_tokens = degree * local_heads * (chunk + text) * head_dim  # my heads' output for every rank (+ joint text)
    return int((to_heads + to_tokens) * (degree - 1) / degree * element_bytes * layers)


def test_bench_tiny_preset_reports_every_field(tmp_path, cache_dir, capsys):
    from PIL import Image
    out = tmp_path / "bench.json"
    code = main(["bench", "--preset", "tiny", "--layouts", "1,u2", "--devices", "cpu*2", "--steps", "2",
                 "--warmup", "1", "--exchange-repeats", "2", "--out", str(out), "--cache-dir", cache_dir])
    printed = capsys.readouterr().out
    assert code == 0, printed
    report = json.loads(out.read_text())
    baseline, ulysses = report["layouts"]
    assert (baseline["layout"], ulysses["layout"]) == ("1", "u2")
    assert baseline["speedup"] == 1.0 and baseline["comm_bytes_per_step"] == 0
    for row in (baseline, ulysses):
        assert row["ok"] and len(row["step_ms"]) == 2 and row["step"]["median_ms"] > 0
        assert row["step"]["min_ms"] <= row["step"]["median_ms"] <= row["step"]["max_ms"]
        assert row["max_abs_difference_vs_1"] <= row["tolerance"] * row["output_scale"]
        assert [m["rank"] for m in row["memory"]] == list(range(row["world_size"]))
        assert all(m["peak_bytes"] > 0 for m in row["memory"])
    assert ulysses["speedup"] == pytest.approx(baseline["step"]["median_ms"] / ulysses["step"]["median_ms"],
                                               rel=1e-3)
    assert ulysses["efficiency"] == pytest.approx(ulysses["speedup"] / 2, rel=1e-3)
    workload, config = report["workload"], report["model"]["config"]
    assert workload["image_tokens"] == 99  # 18 x 22 latent -> 9 x 11 tokens: an uneven split over 2 ranks
    assert ulysses["comm_bytes_per_step"] == ulysses["all_to_all_bytes_per_step"] == _ulysses_bytes(
        99, workload["text_tokens"], config["num_attention_heads"], config["attention_head_dim"],
        config["num_layers"], 2)
    # comm time is measured apart from the step, so on a loaded machine their ratio can pass 1: no timing bound here
    assert 0 < ulysses["comm_ms_per_step"] and 0 < ulysses["comm_share"]
    assert "not requested" in report["diffusers_context_parallel"]["skipped"]
    assert "u2" in printed and "speed-up" in printed
    with Image.open(tmp_path / "bench.png") as plot:
        plot.verify()


def test_bench_random_weights_drawn_on_the_workers_match_across_layouts(tmp_path, cache_dir):
    out = tmp_path / "flux.json"
    code = main(["bench", "--preset", "tiny-flux", "--random-init", "--layouts", "u2", "--devices", "cpu*2",
                 "--steps", "1", "--warmup", "0", "--exchange-repeats", "0", "--out", str(out),
                 "--cache-dir", cache_dir])
    report = json.loads(out.read_text())
    assert code == 0, report
    assert [row["layout"] for row in report["layouts"]] == ["1", "u2"]  # the baseline is always measured
    assert report["model"]["family"] == "flux" and report["model"]["variant"] == "dev"
    ulysses = report["layouts"][1]
    assert ulysses["output_scale"] > 1  # random weights really were drawn (not zeros)
    assert ulysses["max_abs_difference_vs_1"] <= 1e-5 * ulysses["output_scale"]
    assert ulysses["comm_share"] is None and ulysses["comm_bytes_per_step"] > 0


def _disagreeing_ranks(rank, world_size):
    from sp_lab.families.synthetic import agree_across_ranks, build_model
    from sp_runtime.config import SPConfig
    from sp_runtime.groups import build_groups
    from sp_lab.tiny_models import tiny_config
    groups = build_groups(SPConfig(["cpu"] * world_size))
    model, _ = build_model("qwen_image", tiny_config("qwen_image"), "float32", torch.device("cpu"), seed=rank)
    agreed = agree_across_ranks(model, groups)
    return agreed, torch.cat([p.flatten() for p in model.parameters()])


def test_random_weights_fall_back_to_rank_0_when_ranks_disagree():
    from sp_runtime.local_ranks import run_distributed
    (agreed0, weights0), (agreed1, weights1) = run_distributed(_disagreeing_ranks, 2)
    assert not agreed0 and not agreed1
    assert torch.equal(weights0, weights1)


@pytest.mark.parametrize("arguments, message", [
    (["--layouts", "1,u3"], "layout 'u3' is impossible on 2 devices"),
    (["--layouts", "1,cfg4"], "cfg_degree=4 is not possible"),
    (["--layouts", "u2,q9"], "'q9' is not understood"),
    (["--layouts", "u2,u2"], "lists a layout twice"),
    (["--preset", "giant"], "unknown preset 'giant'"),
    (["--checkpoint", "/nonexistent/model.safetensors"], "does not exist"),
    (["--steps", "0"], "--steps must be at least 1"),
])
def test_bench_refuses_impossible_requests_before_starting(arguments, message, tmp_path, capsys):
    code = main(["bench", "--devices", "cpu*2", "--out", str(tmp_path / "b.json"), *arguments])
    assert code == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "b.json").exists()


def test_bench_refuses_a_full_size_preset_that_cannot_fit(tmp_path, capsys, monkeypatch):
    import psutil
    memory = namedtuple("memory", "total available")
    monkeypatch.setattr(psutil, "virtual_memory", lambda: memory(64 * 2**30, 60 * 2**30))
    code = main(["bench", "--preset", "qwen-image-20b", "--devices", "cpu*2", "--out", str(tmp_path / "b.json")])
    assert code == 2
    error = capsys.readouterr().err
    assert "qwen-image-20b needs about 40.9 GB of bfloat16 weights on every worker" in error, error
    assert not (tmp_path / "b.json").exists()


@pytest.mark.parametrize("family, channels", [("qwen_image", 16), ("flux", 16), ("wan", 16)])
def test_diffusers_side_by_side_inputs_fit_the_stock_forward(family, channels):
    """The GPU-only comparison calls diffusers' stock forward; its arguments are checked here on one CPU process."""
    from sp_lab.cli.diffusers_cp import native_inputs, skip_reason
    from sp_lab.cli.sampling import make_workload
    from sp_lab.tiny_models import build_tiny_model
    model = build_tiny_model(family)
    workload = make_workload(family, dict(model.config), channels, 80, 48, frames=5, text_tokens=7)
    with torch.no_grad():
        out = model(**native_inputs(family, model, workload.noise, workload.conditioning, torch.device("cpu")),
                    return_dict=False)[0]
    expected = workload.noise.shape if family == "wan" else (1, workload.tokens, 64)
    assert tuple(out.shape) == tuple(expected)
    assert skip_reason(["cpu", "cpu"]) is None  # diffusers' context parallel runs on CPU ranks too


def test_compare_diffusers_runs_diffusers_context_parallel_on_cpu_ranks(tmp_path, cache_dir):
    """diffusers' Ulysses over gloo (its device count patched in its own ranks), on the same weights and tokens:
    256 image and 8 text tokens, divisible by 2 as diffusers needs; one run gives both times and their ratio."""
    out = tmp_path / "side.json"
    code = main(["bench", "--preset", "tiny", "--width", "128", "--height", "128", "--text-tokens", "8",
                 "--layouts", "u2", "--devices", "cpu*2", "--steps", "1", "--warmup", "1", "--exchange-repeats", "0",
                 "--compare-diffusers", "--out", str(out), "--cache-dir", cache_dir])
    report = json.loads(out.read_text())
    assert code == 0, report
    side = report["diffusers_context_parallel"]
    assert "patched" in side["how"]
    assert [entry["layout"] for entry in side["layouts"]] == ["1", "u2"]
    for entry, ours in zip(side["layouts"], report["layouts"]):
        assert "error" not in entry, entry
        assert entry["median_ms"] > 0 and entry["ours_median_ms"] == ours["step"]["median_ms"]
        assert entry["ours_vs_diffusers"] == pytest.approx(entry["median_ms"] / ours["step"]["median_ms"], rel=1e-3)


def test_speedup_plot_without_matplotlib_is_drawn_with_pillow(tmp_path, monkeypatch):
    import builtins

    from PIL import Image

    from sp_lab.cli.plotting import save_speedup_plot
    real_import = builtins.__import__

    def no_matplotlib(name, *args, **kwargs):
        if name.startswith("matplotlib"):
            raise ImportError("matplotlib is not installed")
        return real_import(name, *args, **kwargs)
    monkeypatch.setattr(builtins, "__import__", no_matplotlib)
    path = save_speedup_plot({"ulysses": [(1, 1.0), (2, 1.8), (4, 3.1)]}, str(tmp_path / "plot.png"), "title")
    with Image.open(path) as plot:
        assert plot.size == (640, 440)
        colours = {colour for _, colour in plot.getcolors(maxcolors=10_000)}
    assert (31, 119, 180) in colours  # the series was drawn in its colour, not only the axes
