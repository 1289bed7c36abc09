"""The SP loader's MODEL inside ComfyUI's own sampling code (in this process), on tiny checkpoints at devices cpu:2:
equal results to ComfyUI's own network of the same weights, DIFFUSION_MODEL wrappers, cancel, errors, the SP LoRA node
(stock LoRA nodes: test_comfy_stock_lora.py).

Needs COMFYUI_PATH (a ComfyUI checkout whose requirements are installed in this Python); skipped otherwise.
"""
import json
import os
import signal

import pytest

import comfy_support as cs

pytestmark = pytest.mark.skipif(cs.comfyui_path() is None, reason=cs.NO_COMFYUI)

FAMILIES = ["qwen_image", "flux", "wan", "hunyuan_video"]
FRAMES = {"wan": 3, "hunyuan_video": 3}  # video latents [B, 16, T, H, W]; the image families get [B, 16, H, W]


@pytest.fixture(scope="module")
def comfy_env(tmp_path_factory):
    cs.import_comfy()
    import folder_paths
    models = tmp_path_factory.mktemp("models")
    folder_paths.add_model_folder_path("diffusion_models", str(models / "diffusion_models"), is_default=True)
    folder_paths.add_model_folder_path("loras", str(models / "loras"), is_default=True)
    owner = cs.import_node_module("pool_owner").OWNER
    checkpoints = {family: cs.write_tiny(family, str(models / "diffusion_models")) for family in FAMILIES}
    yield {"checkpoints": checkpoints, "models": models, "owner": owner}
    owner.close_all()


@pytest.fixture(scope="module")
def sp_models(comfy_env):
    """One MODEL per family from the real loader node, both on one cpu:2 pool."""
    loader = cs.import_node_module("loader")
    models = {}
    for family, path in comfy_env["checkpoints"].items():
        output = loader.SPModelLoader.execute(unet_name=os.path.basename(path), weight_dtype="fp32",
                                              devices="cpu:2", ulysses_degree=0, ring_degree=1, cfg_parallel=False)
        models[family] = output.result[0]
    assert comfy_env["owner"].pool_count == 1
    return models


@pytest.fixture(scope="module")
def references(comfy_env):
    return {family: cs.comfy_reference_model(family, path) for family, path in comfy_env["checkpoints"].items()}


@pytest.fixture
def interrupt_flag():
    import comfy.model_management
    yield comfy.model_management
    comfy.model_management.interrupt_current_processing(False)


@pytest.mark.parametrize("family", FAMILIES)
def test_stock_sampler_on_sp_model_equals_comfys_own_model(family, sp_models, references):
    positive, negative = cs.conditioning(family, 1), cs.conditioning(family, 2)
    frames = FRAMES.get(family, 0)
    expected = cs.sample(references[family], positive, negative, frames=frames)
    actual = cs.sample(sp_models[family], positive, negative, frames=frames)
    cs.assert_close(actual, expected)
    pool = next(iter(sp_models[family].model.diffusion_model.owner._pools.values()))
    assert pool.status()["last_conditioning_bytes_copied"] == 0  # same text every step: not sent again
    # and the conditioning matters (a model that ignored it would pass the line above only by luck)
    other = cs.sample(sp_models[family], cs.conditioning(family, 3), negative, frames=frames)
    assert (other - actual).abs().max() > 1e-3


@pytest.mark.parametrize("family", FAMILIES)
def test_sp_model_holds_no_weights_and_uses_comfys_model_class(family, sp_models, references):
    model = sp_models[family]
    assert sum(p.numel() for p in model.model.parameters()) == 0
    assert type(model.model) is type(references[family].model)
    assert model.load_device.type == "cpu" and model.offload_device.type == "cpu"


def test_diffusion_model_wrappers_run_around_the_pool_call(sp_models, references):
    import comfy.patcher_extension
    seen = []

    def wrapper(executor, *args, **kwargs):
        seen.append((tuple(args[0].shape), isinstance(args[-1], dict)))
        return executor(*args, **kwargs) * 0.5

    cs.import_node_module("model_options_policy").allow_host_only("wrappers.diffusion_model.test")
    model = sp_models["qwen_image"].clone()
    model.add_wrapper_with_key(comfy.patcher_extension.WrappersMP.DIFFUSION_MODEL, "test", wrapper)
    reference = references["qwen_image"].clone()
    reference.add_wrapper_with_key(comfy.patcher_extension.WrappersMP.DIFFUSION_MODEL, "test", wrapper)
    positive, negative = cs.conditioning("qwen_image", 1), cs.conditioning("qwen_image", 2)
    actual = cs.sample(model, positive, negative)
    assert len(seen) == 3 and all(ok for _, ok in seen)  # one batched cond+uncond call per step
    assert seen[0][0][0] == 2
    cs.assert_close(actual, cs.sample(reference, positive, negative))


def test_cancel_raises_comfys_interrupt_and_the_next_run_works(sp_models, references, interrupt_flag):
    positive, negative = cs.conditioning("flux", 1), cs.conditioning("flux", 2)
    calls = []

    def press_cancel_after_first_step(step, *args):
        calls.append(step)
        interrupt_flag.interrupt_current_processing(True)

    with pytest.raises(interrupt_flag.InterruptProcessingException):
        cs.sample(sp_models["flux"], positive, negative, steps=6, callback=press_cancel_after_first_step)
    assert calls == [0]  # stopped at the next model call, not at the end
    assert not interrupt_flag.processing_interrupted()  # consumed like ComfyUI's own interrupt
    cs.assert_close(cs.sample(sp_models["flux"], positive, negative), cs.sample(references["flux"], positive,
                                                                               negative))


def test_worker_error_is_a_clear_node_error_and_the_next_run_works(sp_models, references):
    proxy_module = cs.import_node_module("proxy")
    bad = [[cs.conditioning("qwen_image", 1)[0][0][..., :-1], {}]]  # text width 31 instead of 32
    with pytest.raises(proxy_module.SPPoolError) as error:
        cs.sample(sp_models["qwen_image"], bad, bad)
    assert "rank" in str(error.value) and "Ulysses SP" in str(error.value)
    positive, negative = cs.conditioning("qwen_image", 1), cs.conditioning("qwen_image", 2)
    cs.assert_close(cs.sample(sp_models["qwen_image"], positive, negative),
                    cs.sample(references["qwen_image"], positive, negative))


def test_killed_worker_between_prompts_is_replaced(comfy_env, sp_models, references):
    import psutil
    pool = next(iter(comfy_env["owner"]._pools.values()))
    victim = psutil.Process(pool.worker_pids[1])
    os.kill(victim.pid, signal.SIGKILL)
    victim.wait(timeout=10)
    positive, negative = cs.conditioning("flux", 1), cs.conditioning("flux", 2)
    cs.assert_close(cs.sample(sp_models["flux"], positive, negative),
                    cs.sample(references["flux"], positive, negative))


def test_sp_lora_node_refuses_models_from_other_loaders(references):
    lora = cs.import_node_module("lora")
    with pytest.raises(ValueError, match="Load Diffusion Model \\(Ulysses SP\\)"):
        lora.SPLoraLoader.execute(model=references["flux"], lora_name="x.safetensors", strength_model=1.0)


# LoRA modules per family, in the naming a trainer would write for it: diffusers / peft names for Qwen-Image,
# kohya names of ComfyUI's (original) weights with an alpha for Flux (fused qkv and linear1) and Wan.
# name -> (rows, columns) of its weight in the tiny models (width 96, MLP 384, Wan FFN 128; HunyuanVideo 384, 768)
COMFY_LORA_MODULES = {
    "qwen_image": {f"transformer_blocks.{b}.{name}": (96, 384 if name == "img_mlp.net.2" else 96)
                   for b in range(2) for name in ("attn.to_q", "attn.to_v", "img_mlp.net.2")},
    "flux": {"lora_unet_double_blocks_0_img_attn_qkv": (288, 96), "lora_unet_double_blocks_1_txt_mlp_2": (96, 384),
             "lora_unet_single_blocks_1_linear1": (672, 96), "lora_unet_single_blocks_0_linear2": (96, 480)},
    "wan": {"lora_unet_blocks_0_self_attn_q": (96, 96), "lora_unet_blocks_1_cross_attn_k": (96, 96),
            "lora_unet_blocks_1_ffn_2": (96, 128)},
    "hunyuan_video": {"lora_unet_double_blocks_0_img_attn_qkv": (1152, 384),
                      "lora_unet_double_blocks_0_txt_mlp_2": (384, 768),
                      "lora_unet_single_blocks_0_linear1": (1920, 384)},
}


def _comfy_lora_state(family):
    import torch
    generator = torch.Generator().manual_seed(5)
    state = {}
    for module, (rows, columns) in COMFY_LORA_MODULES[family].items():
        down, up = torch.randn(4, columns, generator=generator), torch.randn(rows, 4, generator=generator) * 0.1
        if family == "qwen_image":
            state.update({f"{module}.lora_A.weight": down, f"{module}.lora_B.weight": up})
        else:
            state.update({f"{module}.lora_down.weight": down, f"{module}.lora_up.weight": up,
                          f"{module}.alpha": torch.tensor(2.0)})
    return state


@pytest.mark.parametrize("family", FAMILIES)
def test_sp_lora_node_applies_the_lora_in_the_workers(family, comfy_env, sp_models, references):
    """The SP LoRA node's MODEL samples as ComfyUI's own model patched by ComfyUI's own LoRA code; the base MODEL
    gets its weights back afterwards."""
    import comfy.sd
    from safetensors.torch import save_file
    lora_state = _comfy_lora_state(family)
    path = str(comfy_env["models"] / "loras" / f"tiny_{family}_lora.safetensors")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    save_file(lora_state, path)
    lora_module = cs.import_node_module("lora")
    sp_lora = lora_module.SPLoraLoader.execute(model=sp_models[family], lora_name=os.path.basename(path),
                                               strength_model=0.8).result[0]
    ref_lora, _ = comfy.sd.load_lora_for_models(references[family], None, lora_state, 0.8, 0)
    positive, negative = cs.conditioning(family, 1), cs.conditioning(family, 2)
    frames = FRAMES.get(family, 0)
    with_lora = cs.sample(sp_lora, positive, negative, frames=frames)
    cs.assert_close(with_lora, cs.sample(ref_lora, positive, negative, frames=frames))
    base = cs.sample(sp_models[family], positive, negative, frames=frames)  # the LoRA comes off again
    cs.assert_close(base, cs.sample(references[family], positive, negative, frames=frames))
    assert (with_lora - base).abs().max() > 1e-3


def test_loader_reports_progress_and_a_bad_file_is_a_clear_error(comfy_env):
    import comfy.utils
    loader = cs.import_node_module("loader")
    bad = comfy_env["models"] / "diffusion_models" / "not_a_model.safetensors"
    bad.write_bytes(b"this is not a checkpoint at all")
    with pytest.raises(ValueError, match="not_a_model.safetensors.*not a safetensors checkpoint"):
        loader.SPModelLoader.execute(unet_name=bad.name, weight_dtype="default", devices="cpu:2",
                                     ulysses_degree=0, ring_degree=1, cfg_parallel=False)
    with pytest.raises(ValueError, match="cannot be mixed"):
        loader.SPModelLoader.execute(unet_name="tiny_flux.safetensors", weight_dtype="default", devices="cpu,0",
                                     ulysses_degree=0, ring_degree=1, cfg_parallel=False)
    updates = []
    previous = comfy.utils.PROGRESS_BAR_HOOK
    comfy.utils.set_progress_bar_global_hook(lambda value, total, preview, node_id=None: updates.append(value))
    try:
        comfy_env["owner"].unload_all()
        loader.SPModelLoader.execute(unet_name="tiny_flux.safetensors", weight_dtype="fp32", devices="cpu:2",
                                     ulysses_degree=0, ring_degree=1, cfg_parallel=False)
    finally:
        comfy.utils.set_progress_bar_global_hook(previous)
    assert updates and updates[-1] == 100 and updates == sorted(updates)


def test_pool_control_node_shows_unloads_and_shuts_down(comfy_env, sp_models):
    control = cs.import_node_module("pool_control").SPPoolControl
    output = control.execute(action="show status")
    status = json.loads(output.result[0])
    assert status["pools"][0]["devices"] == ["cpu", "cpu"] and status["pools"][0]["models"]
    assert "cpu, cpu: layout u2" in output.ui.as_dict()["text"][0]
    assert not json.loads(control.execute(action="unload models").result[0])["pools"][0]["models"]
    assert json.loads(control.execute(action="shut down pools").result[0])["pools"] == []
    assert comfy_env["owner"].pool_count == 0


@pytest.mark.parametrize("layout", [{"cfg_parallel": True}, {"ring_degree": 2}])
def test_other_layouts_through_the_stock_sampler_equal_comfys_model(comfy_env, references, layout):
    """Runs last: each layout replaces the cpu:2 pool (same devices, other degrees)."""
    loader = cs.import_node_module("loader")
    inputs = {"ulysses_degree": 0, "ring_degree": 1, "cfg_parallel": False, **layout}
    model = loader.SPModelLoader.execute(unet_name="tiny_qwen_image.safetensors", weight_dtype="fp32",
                                         devices="cpu:2", **inputs).result[0]
    positive, negative = cs.conditioning("qwen_image", 1), cs.conditioning("qwen_image", 2)
    cs.assert_close(cs.sample(model, positive, negative), cs.sample(references["qwen_image"], positive, negative))
    pool = comfy_env["owner"].status()["pools"][0]
    assert pool["layout"] == ("cfg2" if layout.get("cfg_parallel") else "r2")


def test_loader_with_shard_weights_samples_exactly_like_without(comfy_env, sp_models):
    """The loader's shard_weights input: the workers hold 1/2 of each block, the stock sampler's result is the same,
    bitwise."""
    loader = cs.import_node_module("loader")
    path = comfy_env["checkpoints"]["flux"]
    sharded = loader.SPModelLoader.execute(unet_name=os.path.basename(path), weight_dtype="fp32", devices="cpu:2",
                                           ulysses_degree=0, ring_degree=1, cfg_parallel=False,
                                           shard_weights=True).result[0]
    positive, negative = cs.conditioning("flux", 1), cs.conditioning("flux", 2)
    assert (cs.sample(sharded, positive, negative) == cs.sample(sp_models["flux"], positive, negative)).all()
    pool = next(iter(sharded.model.diffusion_model.owner._pools.values()))
    ranks = pool.status()["ranks"]
    assert all(rank["weights"]["sharded_blocks"] > 0 for rank in ranks)
    assert [model["options"] for model in pool.status()["models"] if model["options"]] == [{"shard_weights": True}]


@pytest.mark.parametrize("options, named", [
    ({"patches": {"attn2_patch": [object()]}}, "attn2_patch"),
    ({"stg_self_attn_blocks": [3]}, "stg_self_attn_blocks"),
    ({"run_ax": False}, "run_ax"),
    ({"a2v_cross_attn": False}, "a2v_cross_attn")])
def test_host_patches_and_stream_switches_are_refused_not_ignored(comfy_env, sp_models, options, named):
    proxy_module = cs.import_node_module("proxy")
    proxy = sp_models["qwen_image"].get_model_object("diffusion_model")
    with pytest.raises(proxy_module.SPPoolError, match=named):
        proxy._check_options(options)
    proxy._check_options({"run_vx": True, "stg_self_attn_blocks": [], "patches": {}})
