"""shard_weights: a model whose blocks are sharded across the pool's ranks gives the same output, bitwise, as the
same model held whole, for Qwen-Image, Flux and Wan at Ulysses 2 and 4, u2r2 and u2cfg2, with a quantized file
(kept quantized) and with a LoRA; each rank holds its 1/P of the blocks (plus the replicated rest) and at most two
blocks gathered at once, by the workers' own accounting; unload / reload, two sharded models in one pool and a
pool restart keep it exact; bad values fail the load clearly."""
from __future__ import annotations

import os
import signal
import time

import pytest
import torch
from safetensors.torch import save_file

from sp_runtime.families import family_module
from sp_runtime.sharding import ShardSpec, model_shards, shard_model, sharded_loading
from sp_runtime.sharding.layout import ALIGN, block_slots, find_blocks, pack
from sp_lab.families.synthetic import build_model, write_spec
from sp_lab.tiny_models import tiny_config, write_tiny_checkpoint
from sp_lab.tiny_models.quant_files import write_quantized
from test_formats_models import make_case

pytest_plugins = ["family_pools"]
OPTIONS = {"qwen_image": {}, "flux": {}, "wan": {"head_dim": 16}}


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory):
    folder = tmp_path_factory.mktemp("shard")
    return {family: write_tiny_checkpoint(family, str(folder / f"{family}.safetensors"), seed=5)
            for family in OPTIONS}


# in one process: what each rank reads while loading, against the whole model's blocks

@pytest.mark.parametrize("family, layout, dtype", [
    ("qwen_image", "original", "float32"), ("flux", "original", "bfloat16"), ("flux", "diffusers", "float32"),
    ("wan", "original", "float32"), ("flux2", "original", "float32"), ("qwen_image21", "original", "float32"),
    ("flux", "comfy_quant", "default"), ("wan", "gguf", "default")])
def test_each_rank_loads_exactly_its_bytes_of_every_block(tmp_path, family, layout, dtype):
    """Three ranks (uneven splits) each load their shards straight from the file (plain files: only the rows they
    hold; quantized files: blocks read whole and cut); side by side they are the whole model's blocks, byte for
    byte, in the layout every rank agrees on."""
    if layout in ("comfy_quant", "gguf"):
        path = str(tmp_path / f"q.{'gguf' if layout == 'gguf' else 'safetensors'}")
        write_quantized(family, path, str(tmp_path / "reference.safetensors"), layout, 5, "",
                        {"ulysses_sp.head_dim": "16"} if family == "wan" else None,
                        **(dict(ffn_dim=256) if family == "wan" else {}))
    else:
        path = write_tiny_checkpoint(family, str(tmp_path / "m.safetensors"), layout=layout, seed=5)
    load = family_module(family).load_model
    options = OPTIONS.get(family, {})
    whole = load(path, dtype, options=options)[0]
    ranks = []
    for rank in range(3):
        with sharded_loading(ShardSpec(rank, 3)):
            ranks.append(model_shards(load(path, dtype, options=options)[0]))
    named = find_blocks(whole)
    assert len(named) == len(ranks[0].blocks) >= 2
    for index, (_, block) in enumerate(named):
        entries = block_slots(block)
        layout_of = ranks[0].blocks[index].layout
        assert [(s.module, s.name, s.shape, s.dtype) for s in layout_of.slots] == \
            [(m, n, tuple(t.shape), t.dtype) for m, n, _, t in entries]
        joined = torch.cat([shards.blocks[index].shard for shards in ranks])
        assert torch.equal(joined, pack(layout_of, [t for *_, t in entries], "cpu"))


def test_a_model_loaded_whole_shards_into_each_rank_s_bytes(tmp_path):
    """shard_model, the fallback for models no checkpoint streams (the synthetic benchmark family): three ranks of a
    whole model each keep their bytes of every block; side by side, in rank order, they are the whole blocks."""
    def build():
        return build_model("flux", tiny_config("flux"), "float32", torch.device("cpu"), seed=3)[0]
    named = find_blocks(build())
    ranks = [shard_model(build(), rank, 3) for rank in range(3)]
    assert len(named) == len(ranks[0].blocks) >= 2
    for index, (_, block) in enumerate(named):
        entries = block_slots(block)
        layout = ranks[0].blocks[index].layout
        joined = torch.cat([shards.blocks[index].shard for shards in ranks])
        assert torch.equal(joined, pack(layout, [t for *_, t in entries], "cpu"))


def weights(pool) -> list[dict]:
    return [rank["weights"] for rank in pool.status()["ranks"]]


def sharded_and_whole(pool, path: str, family: str, dtype: str = "float32") -> tuple:
    """(sharded output, whole output, per-rank accounting with only the sharded model, with only the whole one)."""
    x, t, inputs = make_case(family)
    pool.unload_all()
    sharded = pool.load_model(path, dtype, shard_weights=True, **OPTIONS[family])
    got = sharded(x, t, **inputs).clone()  # a private copy, whatever the pool returns: the next call follows
    alone = weights(pool)
    ranks = pool.status()["ranks"]
    assert [rank["memory"]["weights"] for rank in ranks] == [rank["weights"]["resident"] for rank in ranks]
    pool.unload_all()
    whole = pool.load_model(path, dtype, **OPTIONS[family])
    want = whole(x, t, **inputs)
    reference = weights(pool)
    pool.unload_all()
    return got, want, alone, reference


def assert_one_share_per_rank(alone: list[dict], reference: list[dict]) -> None:
    """Each rank holds the replicated rest plus 1/P of the blocks (padding aside), and never more than two blocks
    gathered at once."""
    world = len(alone)
    for rank in alone:
        blocks = rank["sharded_blocks"]
        assert blocks > 0.5 * reference[0]["resident"]  # the tiny models are mostly blocks
        replicated = reference[0]["resident"] - blocks
        assert replicated - ALIGN * 64 <= rank["resident"] - blocks // world <= replicated + ALIGN * 64, rank
        assert rank["largest_block"] <= rank["gathered_peak"] <= 2 * rank["largest_block"], rank
        assert rank["bytes_moved"] > 0


@pytest.mark.parametrize("family_pool", [2, 4], indirect=True, ids=["u2", "u4"])
@pytest.mark.parametrize("family", OPTIONS)
def test_sharded_equals_whole_at_ulysses_2_and_4(family_pool, checkpoints, family):
    got, want, alone, reference = sharded_and_whole(family_pool, checkpoints[family], family)
    assert torch.equal(got, want)
    assert_one_share_per_rank(alone, reference)


@pytest.mark.parametrize("family_pool", [3], indirect=True, ids=["u3"])
def test_a_model_loaded_whole_then_sharded_equals_whole(family_pool, tmp_path):
    """The synthetic family builds its model whole; shard_weights then shards it (shard_model) on each rank."""
    path = write_spec(str(tmp_path / "spec.safetensors"), "flux", tiny_config("flux"), seed=3, dtype="float32")
    got, want, alone, reference = sharded_and_whole(family_pool, path, "flux")
    assert torch.equal(got, want)
    assert_one_share_per_rank(alone, reference)


@pytest.mark.parametrize("layout_pool", ["u2r2", "u2cfg2"], indirect=True)  # the shared pools of family_pools
@pytest.mark.parametrize("family", OPTIONS)
def test_sharded_equals_whole_under_ring_and_cfg(layout_pool, checkpoints, family):
    got, want, alone, reference = sharded_and_whole(layout_pool[1], checkpoints[family], family)
    assert torch.equal(got, want)
    assert_one_share_per_rank(alone, reference)


@pytest.mark.parametrize("fmt", ["comfy_quant", "gguf"])
@pytest.mark.parametrize("family_pool", [2], indirect=True, ids=["u2"])
def test_a_quantized_file_stays_quantized_and_exact(family_pool, tmp_path, fmt):
    path = str(tmp_path / f"q.{'gguf' if fmt == 'gguf' else 'safetensors'}")
    write_quantized("flux", path, str(tmp_path / "reference.safetensors"), fmt, 5,
                    **(dict(attention_head_dim=32, num_layers=3) if fmt == "gguf" else {}))
    got, want, alone, reference = sharded_and_whole(family_pool, path, "flux", "default")
    assert torch.equal(got, want)
    assert_one_share_per_rank(alone, reference)


@pytest.mark.parametrize("family_pool", [2], indirect=True, ids=["u2"])
def test_fp8_weights_stay_fp8_on_the_wire_and_exact(family_pool, checkpoints):
    """fp8 storage (diffusers' layerwise casting around each layer) works on the gathered views."""
    got, want, alone, reference = sharded_and_whole(family_pool, checkpoints["flux"], "flux", "float8_e4m3fn")
    assert torch.equal(got, want)
    assert_one_share_per_rank(alone, reference)


@pytest.mark.parametrize("family_pool", [2], indirect=True, ids=["u2"])
def test_lora_on_sharded_blocks_equals_lora_on_whole_blocks_and_comes_off_bitwise(family_pool, checkpoints,
                                                                                 tmp_path):
    g = torch.Generator().manual_seed(3)
    lora = str(tmp_path / "lora.safetensors")
    inputs_of = {"transformer_blocks.0.attn.to_q": 96, "transformer_blocks.1.img_mlp.net.2": 384, "img_in": 64}
    save_file({f"{module}.lora_{part}.weight": torch.randn(*shape, generator=g) * 0.1
               for module, width in inputs_of.items() for part, shape in (("A", (4, width)), ("B", (96, 4)))}, lora)
    x, t, inputs = make_case("qwen_image")
    path = checkpoints["qwen_image"]
    outputs = {}
    for shard in (True, False):
        handle = family_pool.load_model(path, "float32", shard_weights=shard)
        base = handle(x, t, **inputs).clone()
        family_pool.set_loras(handle, [[lora, 0.8]])
        outputs[shard] = handle(x, t, **inputs).clone()
        family_pool.set_loras(handle, [])
        assert torch.equal(handle(x, t, **inputs), base)
        assert (outputs[shard] - base).abs().max() > 1e-3  # the LoRA really acts on the blocks
    family_pool.unload_all()
    assert torch.equal(outputs[True], outputs[False])


@pytest.mark.parametrize("family_pool", [2], indirect=True, ids=["u2"])
def test_two_sharded_models_unload_reload_and_a_restart_stay_exact(family_pool, checkpoints):
    cases = {family: make_case(family) for family in ("qwen_image", "wan")}
    wanted = {family: family_pool.load_model(checkpoints[family], "float32", **OPTIONS[family])(x, t, **inputs)
              .clone() for family, (x, t, inputs) in cases.items()}
    family_pool.unload_all()
    handles = {family: family_pool.load_model(checkpoints[family], "float32", shard_weights=True,
                                              **OPTIONS[family]) for family in cases}

    def all_exact():
        for family, (x, t, inputs) in cases.items():
            assert torch.equal(handles[family](x, t, **inputs), wanted[family]), family
    all_exact()
    handles["wan"].unload()
    all_exact()  # reloaded by the call
    restarts = family_pool.restarts
    os.kill(family_pool.worker_pids[1], signal.SIGKILL)
    deadline = time.monotonic() + 10
    while family_pool.status()["ranks"][1]["alive"] and time.monotonic() < deadline:
        time.sleep(0.05)
    all_exact()
    assert family_pool.restarts == restarts + 1
    family_pool.unload_all()


@pytest.mark.parametrize("family_pool", [2], indirect=True, ids=["u2"])
@pytest.mark.parametrize("options, message", [({"shard_weights": "yes"}, "shard_weights must be true or false"),
                                              ({"shard_weights": True, "compile": True}, "cannot be combined")])
def test_bad_values_fail_the_load_clearly(family_pool, checkpoints, options, message):
    with pytest.raises(ValueError, match=message):
        family_pool.load_model(checkpoints["flux"], "float32", **options)
