"""LoRA in the workers: a base model + WorkerPool.set_loras equals a checkpoint merged by hand (W + s x B @ A x
alpha / rank, computed here in the original key space) loaded without LoRA, for every LoRA naming format, Qwen-Image,
Flux (fused qkv) and Wan, at world 1 and 2; strength 0 and [] give the base back bitwise; LoRAs add; bad LoRAs fail
clearly and leave the weights alone; a restarted or reloaded model gets its LoRAs again; only changed weights move.
"""
from __future__ import annotations

import os
import signal
import time

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from sp_runtime.config import SPConfig
from sp_runtime.pool import RemoteError, WorkerPool
from sp_lab.tiny_models import COMFY_PREFIX, write_tiny_checkpoint

STRENGTH = 0.7
RANK, ALPHA = 4, 2.0  # scale alpha / rank = 0.5: a loader that ignored alpha would be off by 2x

# ----- the LoRA deltas, stated in the original (ComfyUI) key space of each family -----
# original module -> the diffusers modules it splits into: (name, rows) with rows a slice of the original rows, or
# "swap" (Flux's final modulation keeps (shift, scale), diffusers (scale, shift)). Written here, independently of
# the loaders' key plans.
H = 96  # the tiny models' width (6 heads x 16)
SPLITS = {
    "qwen_image": {m: [(m, slice(None))] for m in (
        "transformer_blocks.0.attn.to_q", "transformer_blocks.1.attn.add_k_proj", "transformer_blocks.0.img_mlp.net.2",
        "transformer_blocks.1.img_mod.1", "img_in", "proj_out")},
    "flux": {
        "double_blocks.0.img_attn.qkv": [(f"transformer_blocks.0.attn.to_{p}", slice(i * H, (i + 1) * H))
                                         for i, p in enumerate("qkv")],
        "double_blocks.1.txt_attn.qkv": [(f"transformer_blocks.1.attn.add_{p}_proj", slice(i * H, (i + 1) * H))
                                         for i, p in enumerate("qkv")],
        "double_blocks.0.img_mlp.2": [("transformer_blocks.0.ff.net.2", slice(None))],
        "single_blocks.1.linear1": [(f"single_transformer_blocks.1.attn.to_{p}", slice(i * H, (i + 1) * H))
                                    for i, p in enumerate("qkv")]
                                   + [("single_transformer_blocks.1.proj_mlp", slice(3 * H, 7 * H))],
        "single_blocks.0.linear2": [("single_transformer_blocks.0.proj_out", slice(None))],
        "final_layer.adaLN_modulation.1": [("norm_out.linear", "swap")],
        "txt_in": [("context_embedder", slice(None))],
    },
    "wan": {
        "blocks.0.self_attn.q": [("blocks.0.attn1.to_q", slice(None))],
        "blocks.1.cross_attn.o": [("blocks.1.attn2.to_out.0", slice(None))],
        "blocks.0.ffn.0": [("blocks.0.ffn.net.0.proj", slice(None))],
        "text_embedding.0": [("condition_embedder.text_embedder.linear_1", slice(None))],
        "head.head": [("proj_out", slice(None))],
        "patch_embedding": [("patch_embedding", slice(None))],  # a Conv3d: the delta is reshaped
    },
}
WAN_PATCH_KERNEL = (16, 1, 2, 2)  # the tiny Wan's patch embedding: 16 input channels, patch (1, 2, 2)
BIAS_DIFF = {"qwen_image": "transformer_blocks.1.attn.add_k_proj", "flux": "double_blocks.0.img_attn.qkv",
             "wan": "blocks.0.self_attn.q"}  # one `.diff_b` per LoRA as well

# format -> (naming: "original" or "diffusers", key of a module's tensors)
FORMATS = {
    "kohya": ("original", lambda m, t: f"lora_unet_{m.replace('.', '_')}.{t}"),
    "comfy": ("original", lambda m, t: f"diffusion_model.{m}.{t}"),
    "bare": ("original", lambda m, t: f"{m}.{t}"),
    "peft_diffusers": ("diffusers", lambda m, t: f"transformer.{m}.{t}"),
    "lora_transformer": ("diffusers", lambda m, t: f"lora_transformer_{m.replace('.', '_')}.{t}"),
    "wan_fun": ("original", lambda m, t: f"lora_unet__{m.replace('.', '_')}.{t}"),
}
FAMILY_FORMATS = {"qwen_image": ["kohya", "comfy", "bare", "peft_diffusers"],
                  "flux": ["kohya", "comfy", "peft_diffusers", "lora_transformer"],
                  "wan": ["kohya", "comfy", "peft_diffusers", "wan_fun"]}
# tensor names per format: (up, down, with alpha?)
TENSORS = {"kohya": ("lora_up.weight", "lora_down.weight", True), "wan_fun": ("lora_up.weight", "lora_down.weight",
                                                                               True),
           "comfy": ("lora_B.weight", "lora_A.weight", True), "bare": ("lora_B.weight", "lora_A.weight", False),
           "peft_diffusers": ("lora_B.weight", "lora_A.weight", False),
           "lora_transformer": ("lora_up.weight", "lora_down.weight", True)}


def make_deltas(family: str, base: dict, seed: int, modules=None) -> dict:
    """original module -> (B, A, scale) low-rank factors; plus ("bias", module) -> a bias difference."""
    generator = torch.Generator().manual_seed(seed)
    deltas = {}
    for module in modules or SPLITS[family]:
        weight = base[f"{module}.weight"]
        inner = weight[0].numel()
        up = torch.randn(weight.shape[0], RANK, generator=generator) * 0.3
        down = torch.randn(RANK, inner, generator=generator) / inner ** 0.5
        deltas[module] = (up, down, ALPHA / RANK)
    bias = base[f"{BIAS_DIFF[family]}.bias"]
    deltas[("bias", BIAS_DIFF[family])] = torch.randn(bias.shape, generator=generator) * 0.1
    return deltas


def merged_state(family: str, base: dict, loras: list[tuple[dict, float]]) -> dict:
    """The independent reference: each LoRA added to the original-layout weights, W + s x scale x B @ A."""
    state = {key: value.clone() for key, value in base.items()}
    for deltas, strength in loras:
        for module, value in deltas.items():
            if isinstance(module, tuple):
                state[f"{module[1]}.bias"] += strength * value
                continue
            up, down, scale = value
            weight = state[f"{module}.weight"]
            weight += (strength * scale * (up @ down)).reshape(weight.shape)
    return state


def write_lora(path: str, family: str, deltas: dict, form: str) -> str:
    naming, key = FORMATS[form]
    up_name, down_name, with_alpha = TENSORS[form]
    tensors = {}
    for module, value in deltas.items():
        if isinstance(module, tuple):
            for name, rows in _names(family, module[1], naming):
                tensors[key(name, "diff_b")] = _rows(value[:, None], rows)[:, 0].contiguous()
            continue
        up, down, scale = value
        for name, rows in _names(family, module, naming):
            # a conv LoRA (Wan's patch embedding) stores its factors as conv kernels, as trainers do
            shaped_down = down.reshape(RANK, *WAN_PATCH_KERNEL) if module == "patch_embedding" else down
            tensors[key(name, down_name)] = shaped_down.clone()
            part = _rows(up, rows)
            tensors[key(name, up_name)] = (part if with_alpha else part * scale).contiguous()
            if with_alpha:
                tensors[key(name, "alpha")] = torch.tensor(scale * RANK)
    save_file(tensors, path)
    return path


def _names(family: str, module: str, naming: str):
    if naming == "original" or family == "qwen_image":  # ComfyUI names Qwen-Image's weights as diffusers does
        return [(module, slice(None))]
    return SPLITS[family][module]


def _rows(tensor: torch.Tensor, rows) -> torch.Tensor:
    if rows == "swap":
        first, second = tensor.chunk(2)
        return torch.cat([second, first])
    return tensor[rows]


def save_like(path: str, base_path: str, state: dict) -> str:
    with safe_open(base_path, "pt") as handle:
        metadata = handle.metadata()
    save_file(state, path, metadata=metadata)
    return path


def inputs(family: str, seed: int = 0) -> tuple:
    g = torch.Generator().manual_seed(seed)
    if family == "qwen_image":
        return torch.randn(2, 16, 1, 9, 7, generator=g), torch.tensor([0.7, 0.3]), {
            "context": torch.randn(2, 5, 32, generator=g)}
    if family == "flux":
        return torch.randn(2, 16, 9, 7, generator=g), torch.tensor([0.7, 0.3]), {
            "context": torch.randn(2, 5, 32, generator=g), "y": torch.randn(2, 24, generator=g),
            "guidance": torch.tensor([3.5, 3.5])}
    return torch.randn(2, 16, 3, 6, 5, generator=g), torch.tensor([700.0, 300.0]), {
        "context": torch.randn(2, 7, 32, generator=g)}


def run(handle, family: str, seed: int = 0) -> torch.Tensor:
    x, t, kwargs = inputs(family, seed)
    return handle(x, t, **kwargs).clone()  # results are compared across later calls: each its own copy


def relative(got: torch.Tensor, want: torch.Tensor) -> float:
    return (got - want).abs().max().item() / max(1.0, want.abs().max().item())


# ----- fixtures -----

@pytest.fixture(scope="module")
def pools():
    opened = {}
    try:
        for world in (1, 2):
            opened[world] = WorkerPool(SPConfig(["cpu"] * world), error_grace_s=2.0)
        yield opened
    finally:
        for pool in opened.values():
            pool.close()


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """Per family: a base checkpoint (original layout, Flux with ComfyUI's prefix), its LoRA in every format, and
    the merged checkpoint that every format must reproduce."""
    folder = tmp_path_factory.mktemp("lora")
    out = {}
    for family in SPLITS:
        prefix = COMFY_PREFIX if family == "flux" else ""
        base_path = write_tiny_checkpoint(family, str(folder / f"{family}_base.safetensors"), seed=2, prefix=prefix)
        base = {key[len(prefix):]: value for key, value in load_file(base_path).items()}
        deltas = make_deltas(family, base, seed=7)
        merged = merged_state(family, base, [(deltas, STRENGTH)])
        out[family] = {
            "base": base_path, "base_state": base, "deltas": deltas,
            "merged": save_like(str(folder / f"{family}_merged.safetensors"), base_path,
                                {prefix + key: value for key, value in merged.items()}),
            "loras": {form: write_lora(str(folder / f"{family}_{form}.safetensors"), family, deltas, form)
                      for form in FAMILY_FORMATS[family]}}
    return out


# ----- parity with a merged checkpoint -----

@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("family", list(SPLITS))
def test_every_format_equals_the_merged_checkpoint(pools, files, family, world):
    pool, case = pools[world], files[family]
    merged = pool.load_model(case["merged"], "fp32")
    want = run(merged, family)
    merged.unload()
    base = pool.load_model(case["base"], "fp32")
    plain = run(base, family)
    assert relative(plain, want) > 1e-3  # the LoRA matters: a loader that dropped it fails below
    for form, lora in case["loras"].items():
        summary = pool.set_loras(base, [[lora, STRENGTH]])
        assert summary["updated"] == summary["parameters"] > 0, form
        got = run(base, family)
        assert relative(got, want) <= 1e-5, f"{family} {form}: {relative(got, want):.2e}"
        pool.set_loras(base, [])
    assert torch.equal(run(base, family), plain)
    base.unload()


def test_two_loras_add_and_order_does_not_matter_beyond_rounding(pools, files, tmp_path):
    pool, case = pools[2], files["qwen_image"]
    modules = ["transformer_blocks.0.attn.to_q", "transformer_blocks.1.attn.to_v", "proj_out"]  # overlaps the first
    second = make_deltas("qwen_image", case["base_state"], seed=8, modules=modules)
    second_path = write_lora(str(tmp_path / "second.safetensors"), "qwen_image", second, "kohya")
    merged = merged_state("qwen_image", case["base_state"], [(case["deltas"], STRENGTH), (second, -0.4)])
    merged_handle = pool.load_model(save_like(str(tmp_path / "merged2.safetensors"), case["base"], merged), "fp32")
    want = run(merged_handle, "qwen_image")
    merged_handle.unload()
    base = pool.load_model(case["base"], "fp32")
    pool.set_loras(base, [[case["loras"]["peft_diffusers"], STRENGTH], [second_path, -0.4]])
    assert relative(run(base, "qwen_image"), want) <= 1e-5
    pool.set_loras(base, [[second_path, -0.4], [case["loras"]["kohya"], STRENGTH]])
    assert relative(run(base, "qwen_image"), want) <= 1e-5
    pool.set_loras(base, [])


# ----- exact restore, low precision -----

@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float8_e4m3fn"])
def test_strength_zero_and_empty_list_restore_the_base_bitwise(pools, files, tmp_path, dtype):
    pool, case = pools[2], files["qwen_image"]
    path = write_tiny_checkpoint("qwen_image", str(tmp_path / f"base_{dtype}.safetensors"), dtype=dtype, seed=2)
    base = pool.load_model(path)  # the file's own dtype (fp8: fp8 storage, bf16 compute)
    lora = case["loras"]["kohya"]
    plain = run(base, "qwen_image")
    pool.set_loras(base, [[lora, 1.0]])
    patched = run(base, "qwen_image")
    assert relative(patched, plain) > 1e-2  # the LoRA shows, in every storage dtype
    pool.set_loras(base, [[lora, 0.0]])
    assert torch.equal(run(base, "qwen_image"), plain)
    pool.set_loras(base, [[lora, 1.0]])
    assert torch.equal(run(base, "qwen_image"), patched)  # the same bits each time (seeded rounding)
    pool.set_loras(base, [])
    assert torch.equal(run(base, "qwen_image"), plain)
    base.unload()


# ----- caching -----

def test_same_list_is_a_no_op_and_a_change_touches_only_affected_weights(pools, files, tmp_path):
    pool, case = pools[2], files["qwen_image"]
    other = make_deltas("qwen_image", case["base_state"], seed=9, modules=["transformer_blocks.1.attn.to_out.0"])
    other = {key: value for key, value in other.items() if not isinstance(key, tuple)}  # weights only: disjoint
    other_path = write_lora(str(tmp_path / "other.safetensors"), "qwen_image", other, "peft_diffusers")
    lora = case["loras"]["comfy"]
    base = pool.load_model(case["base"], "fp32")
    first = pool.set_loras(base, [[lora, STRENGTH]])
    assert first["updated"] == first["parameters"] == len(SPLITS["qwen_image"]) + 1  # + the bias difference
    assert pool.set_loras(base, [[lora, STRENGTH]])["updated"] == 0
    assert pool.set_loras(base, [[lora, STRENGTH], [other_path, 1.0]])["updated"] == 1
    assert pool.set_loras(base, [[lora, 0.5], [other_path, 1.0]])["updated"] == first["parameters"]
    assert pool.set_loras(base, [[other_path, 1.0]])["updated"] == first["parameters"]
    assert pool.set_loras(base, [])["updated"] == 1
    status = pool.status()["models"]
    assert [entry["loras"] for entry in status if entry["key"] == base.key] == [[]]


def test_handles_of_one_model_keep_their_own_lists(pools, files):
    pool, case = pools[2], files["qwen_image"]
    plain_handle = pool.load_model(case["base"], "fp32")
    lora_handle = pool.load_model(case["base"], "fp32")
    plain = run(plain_handle, "qwen_image")
    pool.set_loras(lora_handle, [[case["loras"]["bare"], STRENGTH]])
    patched = run(lora_handle, "qwen_image")
    assert torch.equal(run(plain_handle, "qwen_image"), plain)  # the pool switched the workers back
    assert torch.equal(run(lora_handle, "qwen_image"), patched)
    pool.set_loras(lora_handle, [])


# ----- errors -----

def test_unknown_keys_wrong_sizes_and_missing_files_fail_clearly_and_change_nothing(pools, files, tmp_path):
    pool, case = pools[2], files["qwen_image"]
    base = pool.load_model(case["base"], "fp32")
    good = case["loras"]["kohya"]
    pool.set_loras(base, [[good, STRENGTH]])
    patched, pids = run(base, "qwen_image"), pool.worker_pids

    unknown = str(tmp_path / "unknown.safetensors")
    save_file({"transformer_blocks.0.attn.to_nowhere.lora_A.weight": torch.zeros(4, 96),
               "transformer_blocks.0.attn.to_nowhere.lora_B.weight": torch.zeros(96, 4)}, unknown)
    flux_lora = files["flux"]["loras"]["kohya"]
    wrong_size = str(tmp_path / "wrong_size.safetensors")
    save_file({"transformer_blocks.0.attn.to_q.lora_A.weight": torch.zeros(4, 50),
               "transformer_blocks.0.attn.to_q.lora_B.weight": torch.zeros(96, 4)}, wrong_size)
    dora = str(tmp_path / "dora.safetensors")
    save_file({"transformer_blocks.0.attn.to_q.lora_A.weight": torch.zeros(4, 96),
               "transformer_blocks.0.attn.to_q.lora_B.weight": torch.zeros(96, 4),
               "transformer_blocks.0.attn.to_q.dora_scale": torch.ones(96, 1)}, dora)
    not_safetensors = tmp_path / "lora.ckpt"
    not_safetensors.write_bytes(b"PK\x03\x04 a zip file")
    cases = [(unknown, r"1 of 1 modules match no weight of this qwen_image model.*to_nowhere"),
             (flux_lora, r"modules match no weight of this qwen_image model.*double_blocks"),
             (wrong_size, r"to_q.* gives a \[96, 50\] change for .*to_q.weight of shape \[96, 96\]"),
             (dora, r"DoRA adapter"),
             (str(not_safetensors), r"only \.safetensors LoRA files load")]
    for path, message in cases:
        with pytest.raises(RemoteError, match=message):
            pool.set_loras(base, [[good, STRENGTH], [path, 1.0]])
        assert pool.state == "idle" and pool.worker_pids == pids
    with pytest.raises(FileNotFoundError, match="missing.safetensors"):
        pool.set_loras(base, [[str(tmp_path / "missing.safetensors"), 1.0]])
    with pytest.raises(ValueError, match=r"loras\[0\] must be a \[path, strength\] pair"):
        pool.set_loras(base, [good])
    assert base.loras == ((good, STRENGTH),)
    assert torch.equal(run(base, "qwen_image"), patched)  # nothing changed, and the pool still works
    pool.set_loras(base, [])


def test_text_encoder_parts_are_skipped_with_a_note(pools, files, tmp_path):
    pool, case = pools[2], files["qwen_image"]
    state = load_file(case["loras"]["kohya"])
    state["lora_te1_text_model_encoder_layers_0_mlp_fc1.lora_up.weight"] = torch.zeros(8, 4)
    state["lora_te1_text_model_encoder_layers_0_mlp_fc1.lora_down.weight"] = torch.zeros(4, 8)
    path = str(tmp_path / "with_te.safetensors")
    save_file(state, path)
    base = pool.load_model(case["base"], "fp32")
    summary = pool.set_loras(base, [[path, 1.0]])
    assert summary["skipped"] == ["lora_te1_text_model_encoder_layers_0_mlp_fc1"]
    pool.set_loras(base, [])


# ----- in-process pieces -----

def test_original_names_reach_a_model_loaded_from_a_sharded_diffusers_folder(files, tmp_path):
    """Kohya names of fused original Flux tensors, on a model whose checkpoint never spelled them; the base is
    re-read from the right shard."""
    from sp_runtime.families import flux
    from sp_runtime.checkpoints.header import resolve_checkpoint
    from sp_runtime.lora.apply import LoraState
    folder = write_tiny_checkpoint("flux", str(tmp_path / "flux_folder"), layout="diffusers_folder", seed=2,
                                   max_shard_size="150KB")
    assert len(resolve_checkpoint(folder).files) > 1
    model = flux.load_model(folder, "float32")[0]
    state = LoraState(model, "flux", folder, torch.device("cpu"))
    summary = state.set([[files["flux"]["loras"]["kohya"], STRENGTH]])
    assert summary["parameters"] == 17  # 14 weights (each qkv split in 3, linear1 in 4) and 3 qkv biases
    want = flux.load_model(files["flux"]["merged"], "float32")[0].state_dict()
    for name, value in model.state_dict().items():
        assert relative(value, want[name]) <= 1e-6, name
    state.set([])
    fresh = flux.load_model(folder, "float32")[0].state_dict()
    assert all(torch.equal(value, fresh[name]) for name, value in model.state_dict().items())


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_fp8_stochastic_rounding_picks_a_neighbour_without_bias_and_repeats(dtype):
    from sp_runtime.lora.rounding import store_as
    value = torch.randn(50_000, generator=torch.Generator().manual_seed(0)) * 4
    value[:3] = torch.tensor([0.0, -1e-12, 1e9])  # zero, a negative below the smallest step, beyond the range
    draws = torch.stack([store_as(value, dtype, f"weight{i}").float() for i in range(64)])
    info = torch.finfo(dtype)
    clamped = value.clamp(info.min, info.max)
    table = torch.arange(256, dtype=torch.uint8).view(dtype).float()
    table = table[table.isfinite()].unique()  # every fp8 value, sorted
    upper = table[torch.searchsorted(table, clamped).clamp(max=len(table) - 1)]
    lower = table[(torch.searchsorted(table, clamped, right=True) - 1).clamp(min=0)]
    assert bool(((draws == lower) | (draws == upper)).all())  # always one of the two fp8 neighbours
    bias = (draws.mean(0) - clamped).abs().mean() / clamped.abs().mean()
    nearest_bias = (clamped.to(dtype).float() - clamped).abs().mean() / clamped.abs().mean()
    assert bias < nearest_bias / 3  # unbiased: the average of draws lands much closer than round-to-nearest
    assert torch.equal(store_as(value, dtype, "w").view(torch.uint8), store_as(value, dtype, "w").view(torch.uint8))
    small = torch.full((20_000,), 1.01)  # a change below half an fp8 step survives on average
    assert abs(store_as(small, dtype, "w").float().mean().item() - 1.01) < 2e-3
    assert small.to(dtype).float().mean().item() == 1.0


# ----- restart and reload (last: kills a worker of the world-2 pool) -----

def test_loras_come_back_after_a_reload_and_a_pool_restart(pools, files):
    pool, case = pools[2], files["flux"]
    base = pool.load_model(case["base"], "fp32")
    pool.set_loras(base, [[case["loras"]["kohya"], STRENGTH]])
    patched = run(base, "flux")
    base.unload()
    assert torch.equal(run(base, "flux"), patched)  # loaded again, LoRA applied again
    restarts, victim = pool.restarts, pool.worker_pids[1]
    os.kill(victim, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while pool.status()["ranks"][1]["alive"] and time.monotonic() < deadline:  # reaped before the call: a
        time.sleep(0.05)                                                          # restart, not a failed call
    assert torch.equal(run(base, "flux"), patched)
    assert pool.restarts == restarts + 1
    pool.set_loras(base, [])
