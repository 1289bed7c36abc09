"""What newer ComfyUI does to an SP MODEL (issue 26), on a tiny Wan checkpoint at devices cpu:2, against ComfyUI's
own code of the version under test (the newest tier: tools/comfyui_newest.py): clone's newer arguments and
TorchCompileModel, bypass LoRAs, ScaleROPE equal to ComfyUI's own Wan / Flux / Z-Image with the same options, LoKr
with a row offset and with both factors full, the options allow-list naming the node that set a refused option.

Needs COMFYUI_PATH (a ComfyUI checkout whose requirements are installed in this Python); skipped otherwise.
"""
import inspect
import os

import pytest

import comfy_support as cs

pytestmark = pytest.mark.skipif(cs.comfyui_path() is None, reason=cs.NO_COMFYUI)
FRAMES, STEPS = 3, 2


@pytest.fixture(scope="module")
def wan(tmp_path_factory):
    cs.import_comfy()
    import folder_paths
    models = tmp_path_factory.mktemp("models")
    folder_paths.add_model_folder_path("diffusion_models", str(models / "diffusion_models"), is_default=True)
    path = cs.write_tiny("wan", str(models / "diffusion_models"))
    loader = cs.import_node_module("loader")
    sp = loader.SPModelLoader.execute(unet_name=os.path.basename(path), weight_dtype="fp32", devices="cpu:2",
                                      ulysses_degree=0, ring_degree=1, cfg_parallel=False).result[0]
    yield {"sp": sp, "ref": cs.comfy_reference_model("wan", path)}
    cs.import_node_module("pool_owner").OWNER.close_all()


def run(model):
    return cs.sample(model, cs.conditioning("wan", 1), cs.conditioning("wan", 2), steps=STEPS, frames=FRAMES)


def test_clone_passes_every_argument_through(wan):
    import comfy.model_patcher
    sp = wan["sp"]
    names = list(inspect.signature(comfy.model_patcher.ModelPatcher.clone).parameters)[1:]
    calls = [{}] + [{name: True} for name in names if name in ("disable_dynamic", "force_deepcopy")]
    for kwargs in calls:
        copy = sp.clone(**kwargs)
        assert type(copy) is type(sp) and copy.get_model_object("diffusion_model") is sp.get_model_object(
            "diffusion_model"), kwargs
    if "model_override" in names:
        assert sp.clone(model_override=sp.get_clone_model_override()).model is sp.model


def test_torch_compile_node_compiles_in_the_workers(wan):
    import comfy.patcher_extension
    from comfy_extras.nodes_torch_compile import TorchCompileModel
    out = TorchCompileModel.execute(wan["sp"], "inductor")
    model = out.result[0] if hasattr(out, "result") else out[0]
    proxy = model.get_model_object("diffusion_model")
    assert proxy.spec.options.get("compile") is True
    assert not model.get_all_wrappers(comfy.patcher_extension.WrappersMP.APPLY_MODEL)  # no host torch.compile
    model.check_options()  # torch_compile_kwargs is served by the workers
    assert wan["sp"].get_model_object("diffusion_model").spec.options.get("compile") is None


def bypass_lora():
    import torch
    generator = torch.Generator().manual_seed(7)
    state = {}
    for module, rows, columns in (("lora_unet_blocks_0_self_attn_q", 96, 96), ("lora_unet_blocks_1_ffn_2", 96, 128)):
        state[f"{module}.lora_up.weight"] = torch.randn(rows, 4, generator=generator) * 0.2
        state[f"{module}.lora_down.weight"] = torch.randn(4, columns, generator=generator) * 0.2
        state[f"{module}.alpha"] = torch.tensor(2.0)
    return state


def test_bypass_lora_equals_comfys_bypass_lora(wan):
    import comfy.sd
    if not hasattr(comfy.sd, "load_bypass_lora_for_models"):
        pytest.skip("this ComfyUI has no bypass LoRAs (newer than 0.3.64)")
    sp = comfy.sd.load_bypass_lora_for_models(wan["sp"], None, bypass_lora(), 0.8, 0)[0]
    ref = comfy.sd.load_bypass_lora_for_models(wan["ref"], None, bypass_lora(), 0.8, 0)[0]
    actual = run(sp)
    cs.assert_close(actual, run(ref))
    assert (actual - run(wan["sp"])).abs().max() > 1e-3  # the LoRA was applied, not dropped


ROPE_OPTIONS = [dict(scale_x=0.5, shift_x=3.0, scale_y=1.5, shift_y=-2.0, scale_t=2.0, shift_t=1.0), dict(scale_t=0.7)]


def scaled_rope(model, options):
    values = {**dict(scale_x=1.0, shift_x=0.0, scale_y=1.0, shift_y=0.0, scale_t=1.0, shift_t=0.0), **options}
    model = model.clone()
    model.set_model_rope_options(**values)
    return model


@pytest.mark.parametrize("options", ROPE_OPTIONS)
def test_scale_rope_on_wan_equals_comfys_model(wan, options):
    import comfy.model_patcher
    if not hasattr(comfy.model_patcher.ModelPatcher, "set_model_rope_options"):
        pytest.skip("this ComfyUI has no ScaleROPE")
    actual = run(scaled_rope(wan["sp"], options))
    cs.assert_close(actual, run(scaled_rope(wan["ref"], options)))
    assert (actual - run(wan["sp"])).abs().max() > 1e-3  # the options changed the picture, as in ComfyUI


def test_scale_rope_on_flux_with_a_reference_equals_comfys_model(wan, tmp_path):
    import comfy.model_patcher
    import torch
    if not hasattr(comfy.model_patcher.ModelPatcher, "set_model_rope_options"):
        pytest.skip("this ComfyUI has no ScaleROPE")
    loader = cs.import_node_module("loader")
    import folder_paths
    path = cs.write_tiny("flux", folder_paths.get_folder_paths("diffusion_models")[0])
    sp = loader.SPModelLoader.execute(unet_name=os.path.basename(path), weight_dtype="fp32", devices="cpu:2",
                                      ulysses_degree=0, ring_degree=1, cfg_parallel=False).result[0]
    ref = cs.comfy_reference_model("flux", path)
    reference = torch.randn(1, 16, 6, 8, generator=torch.Generator().manual_seed(5))
    positive = [[cs.conditioning("flux", 1)[0][0], {**cs.conditioning("flux", 1)[0][1],
                                                     "reference_latents": [reference]}]]
    negative = cs.conditioning("flux", 2)
    options = dict(scale_x=1.5, shift_x=2.0, scale_y=0.5, shift_y=-1.0, shift_t=0.5)
    actual = cs.sample(scaled_rope(sp, options), positive, negative, steps=STEPS)
    cs.assert_close(actual, cs.sample(scaled_rope(ref, options), positive, negative, steps=STEPS))
    assert (actual - cs.sample(sp, positive, negative, steps=STEPS)).abs().max() > 1e-3


def test_scale_rope_on_z_image_equals_comfys_next_dit(wan):
    """The SP model's diffusion_model called as ComfyUI's sampler calls it (rope_options in transformer_options)
    equals ComfyUI's NextDiT (Z-Image options, the tiny file's weights) called the same way."""
    import torch
    import comfy.ldm.lumina.model as lumina
    if "rope_options" not in inspect.getsource(lumina):
        pytest.skip("this ComfyUI's lumina NextDiT (Z-Image) reads no rope_options (ScaleROPE), so there is no "
                    "behaviour to match")
    import folder_paths
    import test_image_families_comfy as image_comfy
    from sp_lab.tiny_models import COMFY_PREFIX, write_tiny_checkpoint
    from test_z_image import SEED, make_cases
    if image_comfy.comfy_class("z_image") is None:
        pytest.skip("this ComfyUI has no Z-Image NextDiT")
    folder = folder_paths.get_folder_paths("diffusion_models")[0]
    path = write_tiny_checkpoint("z_image", os.path.join(folder, "tiny_z_image_rope.safetensors"), seed=SEED,
                                 prefix=COMFY_PREFIX, **image_comfy.Z_IMAGE_COMFY_SIZE)
    comfy_net = image_comfy.z_image_comfy_network(path)
    loader = cs.import_node_module("loader")
    sp = loader.SPModelLoader.execute(unet_name=os.path.basename(path), weight_dtype="fp32", devices="cpu:2",
                                      ulysses_degree=0, ring_degree=1, cfg_parallel=False).result[0]
    proxy = sp.get_model_object("diffusion_model")
    x, t, inputs = make_cases()["odd_latent_masked"]
    def rope():  # a fresh dict per call: NextDiT writes its block indices into the one it gets
        return {"rope_options": dict(ROPE_OPTIONS[0])}
    with torch.no_grad():
        want = comfy_net(x, t, inputs["context"], inputs["num_tokens"], transformer_options=rope())
        plain = comfy_net(x, t, inputs["context"], inputs["num_tokens"], transformer_options={})
    actual = proxy(x, t, inputs["context"], transformer_options=rope(), num_tokens=inputs["num_tokens"])
    cs.assert_close(actual, want)  # 3.9e-6 of the scale: ComfyUI's q / k norm epsilon
    assert (want - plain).abs().max() > 1e-3  # the options changed ComfyUI's output


def test_scale_rope_on_a_family_without_it_is_refused_by_name(wan):
    import dataclasses
    proxy_module = cs.import_node_module("proxy")
    proxy = wan["sp"].get_model_object("diffusion_model")
    other = proxy_module.SPDiffusionModel(proxy.spec, dataclasses.replace(proxy.info, family="sd3"))
    with pytest.raises(proxy_module.SPPoolError, match="ScaleROPE"):
        other._rope_input({"rope_options": {"scale_x": 2.0}})
    qwen = proxy_module.SPDiffusionModel(proxy.spec, dataclasses.replace(proxy.info, family="qwen_image"))
    assert qwen._rope_input({"rope_options": {"scale_x": 2.0}}) == {}  # ComfyUI's Qwen-Image ignores them too


def test_lokr_with_a_row_offset_equals_comfys_math_on_the_fused_rows(wan):
    import torch
    from comfy.weight_adapter.lokr import LoKrAdapter
    patches = cs.import_node_module("weight_patches")
    generator = torch.Generator().manual_seed(3)
    w1, w2a, w2b = (torch.randn(*shape, generator=generator) for shape in ((3, 2), (96, 4), (4, 48)))
    adapter = LoKrAdapter(set(), (None, None, 2.0, None, None, None, None, None, None))
    adapter.weights = (w1, None, 2.0, None, None, w2a, w2b, None, None)
    adapter.row_offset, adapter.key = 96, "blocks.0.self_attn.qkv"
    fused = adapter.calculate_weight(torch.zeros(288, 96), "qkv", 0.5, 1.0, None, lambda a: a)
    patch_set = patches.translate({"diffusion_model.blocks.0.self_attn.k.weight": [(0.5, adapter, 1.0, None, None)]},
                                  {"blocks.0.self_attn.k.weight": (96, 96)})
    from sp_runtime.lora.patch_math import patched_weight
    target = patch_set.targets["blocks.0.self_attn.k.weight"]
    actual = patched_weight(torch.zeros(96, 96), target.patches, "k")
    cs.assert_close(actual, fused[96:192], rel=1e-6)
    assert actual.abs().max() > 0


def test_lokr_with_both_factors_full_equals_comfys_calculate_weight():
    """The newest lokr.py scales full w1 / w2 by alpha / (w2 rows // w1 rows) (0.3.64 - 0.33.0 by 1): ours follows."""
    cs.import_comfy()
    import torch
    import comfy.lora
    from comfy.weight_adapter.lokr import LoKrAdapter
    from sp_runtime.lora.patch_math import patched_weight
    generator = torch.Generator().manual_seed(4)
    w1, w2, weight = (torch.randn(*shape, generator=generator) for shape in ((2, 3), (8, 4), (16, 12)))
    comfy_patches = [(0.5, LoKrAdapter(set(), (w1, w2, 3.0, None, None, None, None, None, None)), 1.0, None, None)]
    patch_set = cs.import_node_module("weight_patches").translate({"diffusion_model.w.weight": comfy_patches},
                                                                  {"w.weight": (16, 12)})
    expected = comfy.lora.calculate_weight(comfy_patches, weight.clone(), "w.weight")
    if torch.allclose(expected, weight + 0.5 * torch.kron(w1, w2), rtol=1e-6, atol=1e-6):
        pytest.skip("this ComfyUI scales full LoKr factors by 1 (0.3.64 - 0.33.0); the workers follow the newest")
    actual = patched_weight(weight.clone(), patch_set.targets["w.weight"].patches, "w.weight")
    cs.assert_close(actual, expected, rel=1e-6)
    assert (actual - weight).abs().max() > 1e-3


def test_a_node_setting_an_unknown_option_is_named(wan):
    from comfy_api.latest import io
    policy = cs.import_node_module("model_options_policy")

    class MadeUpPatchNode(io.ComfyNode):
        @classmethod
        def define_schema(cls):
            return io.Schema(node_id="MadeUpPatchNode", inputs=[io.Model.Input("model")],
                             outputs=[io.Model.Output()])

        @classmethod
        def execute(cls, model):
            m = model.clone()
            m.model_options["transformer_options"]["made_up_option"] = 1.5
            return io.NodeOutput(m)

    model = MadeUpPatchNode.execute(wan["sp"]).result[0]
    with pytest.raises(policy.RefusedOption, match=r"made_up_option' set by MadeUpPatchNode"):
        run(model)
    run(wan["sp"])  # the pool stays usable


def test_core_nodes_on_the_list_work_and_refused_ones_name_the_node(wan):
    from comfy_extras.nodes_slg import SkipLayerGuidanceDiT
    from comfy_extras.nodes_perpneg import PerpNeg
    policy = cs.import_node_module("model_options_policy")
    out = PerpNeg.execute(wan["sp"], cs.conditioning("wan", 3), 1.0)
    model = out.result[0] if hasattr(out, "result") else out[0]
    model.check_options()  # sampler_cfg_function: host-only
    slg = SkipLayerGuidanceDiT.execute(wan["sp"], 3.0, 0.01, 0.9, double_layers="0", single_layers="1")
    model = slg.result[0] if hasattr(slg, "result") else slg[0]
    model.check_options()  # its post-CFG function is host-only; its block skips are served (test_slg_comfy.py)
    run(model)


def test_an_interrupt_from_the_progress_bar_never_breaks_a_load():
    """Newer ComfyUI's InterruptProcessingException is a BaseException: `except Exception` lets it through, so the
    load progress reporter names it (the load finishes on every rank, the cancel is raised after)."""
    cs.import_comfy()
    import comfy.model_management

    class InterruptingBar:
        def update_absolute(self, value):
            raise comfy.model_management.InterruptProcessingException()

    cs.import_node_module("loader").progress_reporter(InterruptingBar())(0.5, "loading")


def test_ram_pressure_cache_frees_nothing_in_the_workers_and_the_loader_names_the_flag(wan, monkeypatch, caplog):
    """ComfyUI's RAM-pressure cache (newer ComfyUI's default) sizes the SP MODEL's entry as it sizes its own models,
    claiming none of the workers' memory; once evicted, the loader runs again and the workers load nothing. While
    free RAM is below the cache's headroom, a load logs which ComfyUI flag to start with."""
    from types import SimpleNamespace
    caching = pytest.importorskip("comfy_execution.caching")
    if not hasattr(caching, "RAMPressureCache"):
        pytest.skip("this ComfyUI has no RAM-pressure cache (0.3.64)")
    import comfy.memory_management as memory
    ram_cache, loader = cs.import_node_module("ram_cache"), cs.import_node_module("loader")
    spec = wan["sp"].get_model_object("diffusion_model").spec
    cache = caching.RAMPressureCache(caching.CacheKeySetID)
    cache.cache["sp"], cache.used_generation["sp"], cache.timestamps["sp"] = SimpleNamespace(
        outputs=[[wan["sp"]]], ui=None), cache.generation, 0.0
    with monkeypatch.context() as patch:  # no RAM free: ComfyUI evicts whatever it can
        if hasattr(caching, "virtual_memory_available"):
            patch.setattr(caching, "virtual_memory_available", lambda: 0)
        else:
            patch.setattr(caching.psutil, "virtual_memory", lambda: SimpleNamespace(available=0))
        assert cache.ram_release(1, free_active=True) < 1 and not cache.cache
    pool = loader.OWNER.pool_for(spec.config)
    events = []
    pool.add_listener(events.append)
    ram_cache._warned.clear()
    memory.set_ram_cache_release_state(cache.ram_release, ram_cache.available_ram() + 64 * ram_cache.GIB)
    try:
        with caplog.at_level("WARNING", logger="ulysses_sp"):
            loader.load_sp_model(spec)
    finally:
        memory.set_ram_cache_release_state(None, 0)
        pool.remove_listener(events.append)
    assert not [event for event in events if event["event"] == "loaded"]
    assert "SP workers hold" in caplog.text and "ComfyUI with --cache-" in caplog.text
    memory.set_ram_cache_release_state(cache.ram_release, 1)
    try:
        assert ram_cache.pressure_warning(pool.worker_pids) is None
    finally:
        memory.set_ram_cache_release_state(None, 0)
