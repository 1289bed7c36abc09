"""The speed model's arithmetic on known cases (DeepSpeed-Ulysses' 4 N h / P all-to-all volume per layer, FLOPs of a
rank's share, link time, memory with shard_weights) and the doctor's table of predicted step times per layout."""
import pytest

from sp_runtime.__main__ import main
from sp_runtime.cli.speed_model import Device, Layout, Link, ModelShape, layouts, plan, predict

SHAPE = ModelShape("toy", "wan", layers=3, heads=8, head_dim=16, image_weights=1000, text_weights=400,
                   parameters=5000, blocks=3, joint_text=False)
ONE_FLOP = Device("unit", matmul_flops=1.0, attention_flops=1.0)
NO_LINK = Link(bandwidth=float("inf"), latency_s=0.0)


@pytest.mark.parametrize("degree", [2, 4])
def test_all_to_all_bytes_are_deepspeeds_4_n_h_over_p_per_layer(degree):
    tokens, width, element = 1024, 8 * 16, 2
    row = predict(SHAPE, tokens, 0, Layout(ulysses=degree), ONE_FLOP, NO_LINK, element_bytes=element)
    # q, k, v out and the output back: 4 N h / P values per layer leave... all but the 1/P kept at home
    per_layer = 4 * tokens * width / degree * (degree - 1) / degree
    assert row.bytes_sent == SHAPE.layers * per_layer * element
    link = Link(bandwidth=1e9, latency_s=1e-5)
    timed = predict(SHAPE, tokens, 0, Layout(ulysses=degree), ONE_FLOP, link, element_bytes=element)
    assert timed.exchange_s == pytest.approx(2 * SHAPE.layers * 1e-5 + row.bytes_sent / 1e9)


def test_a_ranks_compute_is_its_tokens_its_heads_and_all_the_text():
    tokens, text, degree = 1000, 10, 4  # 8 heads: 2 per rank; Wan: cross-attention to the text per rank
    row = predict(SHAPE, tokens, text, Layout(ulysses=degree), ONE_FLOP, NO_LINK)
    linear = 2 * (250 * 1000 + text * 400)
    self_attention = 4 * 3 * 16 * 8 * tokens * tokens / degree
    cross_attention = 4 * 3 * 16 * 8 * 250 * text / degree
    assert row.compute_s == pytest.approx(linear + self_attention + cross_attention)
    padded = predict(SHAPE, tokens, text, Layout(ulysses=3), ONE_FLOP, NO_LINK)  # 8 heads padded to 9
    assert padded.parts["attention_s"] == pytest.approx(4 * 3 * 16 * 9 * tokens * tokens / 3
                                                        + 4 * 3 * 16 * 9 * 334 * text / 3)


def test_cpu_workers_sharing_cores_gain_nothing_and_cfg_halves_the_batch():
    shared = Device("cpu", 1.0, 1.0, shared_cores=True)
    one, two = (predict(SHAPE, 512, 0, Layout(ulysses=u), shared, NO_LINK) for u in (1, 2))
    assert two.compute_s == pytest.approx(one.compute_s, rel=1e-9)
    cfg_shape = ModelShape(**{**SHAPE.__dict__, "cfg": True})
    whole, halves = (predict(cfg_shape, 512, 0, Layout(cfg=c), ONE_FLOP, NO_LINK) for c in (1, 2))
    assert halves.compute_s == pytest.approx(whole.compute_s / 2) and halves.bytes_sent == 0


def test_the_plan_recommends_the_fastest_layout_that_fits_and_shards_when_nothing_else_fits():
    big = ModelShape("big", "flux", layers=57, heads=24, head_dim=128, image_weights=6_455_000_000,
                     text_weights=6_455_000_000, parameters=11_900_000_000, blocks=57)
    h100 = Device("h100", 600e12, 350e12, memory_bytes=80e9)
    result = plan(big, 4096, 512, 4, h100, Link(450e9))
    assert {row.layout for row in result["rows"]} == {layout.name for layout in layouts(4, cfg=False, heads=24)}
    assert result["recommended"].devices == 4 and "shard" not in result["recommended"].layout
    small = Device("h100", 600e12, 350e12, memory_bytes=16e9)
    tight = plan(big, 4096, 512, 4, small, Link(450e9))
    assert "tp" in tight["recommended"].layout or tight["recommended"].layout.endswith("+shard_weights")
    assert all(not row.fits for row in tight["rows"] if "shard" not in row.layout and "tp" not in row.layout)


BIG = ModelShape("big", "flux", layers=57, heads=24, head_dim=128, image_weights=6_455_000_000,
                 text_weights=6_455_000_000, parameters=11_900_000_000, blocks=57)  # Flux.1-dev's counts
SMALL = ModelShape("small", "flux", layers=57, heads=24, head_dim=128, image_weights=1_000_000_000,
                   text_weights=1_000_000_000, parameters=2_000_000_000, blocks=57)
GPU_16GB = Device("h100-16g", 600e12, 350e12, memory_bytes=16e9)
NVLINK, PCIE = Link(450e9), Link(25e9)


@pytest.mark.parametrize("shape, tokens, link, wanted", [
    (SMALL, 4096, NVLINK, "sequence"),          # fits whole: no weight splitting at all
    (BIG, 4096, NVLINK, "tp"),                  # 24 GB of bf16 on 16 GB cards, an image: TP's all-reduces are small
    (BIG, 65536, NVLINK, "shard_weights"),      # a long video: all-reduces of 65k tokens outweigh the gathers
    (BIG, 16384, NVLINK, "tp"),                 # the same model at 16k tokens on NVLink: TP
    (BIG, 16384, PCIE, "shard_weights"),        # ... over PCIe the all-reduces cost more than the gathers
])
def test_the_recommendation_follows_model_size_resolution_and_link(shape, tokens, link, wanted):
    """Stated inputs: 4 GPUs of 16 GB at 600 / 350 TFLOP/s, 512 text tokens, bf16; the doctor's choice between
    plain sequence parallelism, tensor parallelism and shard_weights moves as the bytes say it should."""
    best = plan(shape, tokens, 512, 4, GPU_16GB, link)["recommended"]
    kind = "tp" if "tp" in best.layout else "shard_weights" if "shard" in best.layout else "sequence"
    assert kind == wanted, best.layout


def test_tp_divides_weights_and_adds_two_all_reduces_of_tokens_by_width_per_block():
    tokens, text, width, element = 1000, 10, 8 * 16, 2
    row = predict(SHAPE, tokens, text, Layout(tp=2), ONE_FLOP, NO_LINK, element_bytes=element)
    # Wan: the text is not in the residual stream (cross-attention reads it), so only the video tokens are reduced
    assert row.bytes_sent == SHAPE.layers * 2 * tokens * width * element * 2 * (2 - 1) / 2
    assert row.parts["linear_s"] == pytest.approx(2 * (tokens * 1000 + text * 400) / 2)
    whole = predict(SHAPE, tokens, text, Layout(), ONE_FLOP, NO_LINK, element_bytes=element)
    assert row.memory_bytes < whole.memory_bytes


def test_doctor_prints_the_predicted_table_and_its_recommendation(capsys):
    code = main(["doctor", "--devices", "cpu*2", "--skip-workers", "--skip-bandwidth", "--model", "flux",
                 "--width", "512", "--height", "512", "--plan-devices", "4", "--link-gbs", "450",
                 "--tflops", "600,350", "--memory-gb", "80"])
    printed = capsys.readouterr().out
    assert code == 0, printed
    table = printed.split("== predicted step time per layout for flux")[1]
    for layout in ("u4", "u2r2", "r4", "u2+shard_weights", "1 "):
        assert f"  {layout}" in table
    assert "stated 450 GB/s per direction" in table and "predicted fastest that fits: " in table


def test_doctor_refuses_a_bad_stated_throughput(capsys):
    assert main(["doctor", "--devices", "cpu*2", "--tflops", "fast"]) == 2
    assert "--tflops 'fast' must be" in capsys.readouterr().err
