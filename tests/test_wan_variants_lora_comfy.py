"""LoRAs on Wan 2.2 S2V and Animate through the SP loader's MODEL (devices cpu:2), against ComfyUI's own WAN22_S2V /
WAN22_Animate model with the same LoRA through the stock LoraLoaderModelOnly, in the stock sampler with the
variants' conditioning: the stock node on the SP MODEL and the LoRA (Ulysses SP) node both equal it at strengths 1.0
and 0.5, with LoRA keys on the variants' extra modules (S2V: audio injector, its adaptive norm, the audio encoder;
Animate: the face adapter's fused kv, the face encoder, the motion encoder) besides the blocks; the base MODEL
samples bitwise as before afterwards. Needs COMFYUI_PATH; skipped otherwise."""
from __future__ import annotations

import os

import pytest
import torch

import comfy_support as cs
from sp_runtime.tiny_models import COMFY_PREFIX, write_tiny_checkpoint

pytestmark = pytest.mark.skipif(cs.comfyui_path() is None, reason=cs.NO_COMFYUI)

RANK = 4
# variant -> (LoRA naming, {module (ComfyUI's name): (rows, columns) of its weight})
LORAS = {
    "s2v": ("kohya", {"audio_injector.injector.0.k": (384, 384), "audio_injector.injector_adain_layers.1.linear":
                      (768, 384), "casual_audio_encoder.encoder.final_linear": (384, 384),
                      "blocks.2.ffn.0": (128, 384)}),
    "animate": ("diffusers", {"face_adapter.fuser_blocks.0.linear1_kv": (768, 384),
                              "face_encoder.out_proj": (384, 1024), "motion_encoder.enc.fc.2": (512, 512),
                              "blocks.0.self_attn.v": (384, 384)}),
}


def lora_state(variant: str, seed: int) -> dict:
    """A rank-4 LoRA with alpha 2 in the trainers' naming: kohya `lora_unet_<module with _>` or `diffusion_model.`
    dotted names with lora_A / lora_B."""
    generator = torch.Generator().manual_seed(seed)
    naming, modules = LORAS[variant]
    state = {}
    for module, (rows, columns) in modules.items():
        up = torch.randn(rows, RANK, generator=generator) * 0.2
        down = torch.randn(RANK, columns, generator=generator) * 0.2
        if naming == "kohya":
            name = "lora_unet_" + module.replace(".", "_")
            state.update({f"{name}.lora_up.weight": up, f"{name}.lora_down.weight": down})
        else:
            name = "diffusion_model." + module
            state.update({f"{name}.lora_B.weight": up, f"{name}.lora_A.weight": down})
        state[f"{name}.alpha"] = torch.tensor(2.0)
    return state


def comfy_own(variant: str, path: str):
    """ComfyUI's own model of the variant with the file's weights, in a ModelPatcher (as the variants' own tests)."""
    import comfy.model_patcher
    import comfy.supported_models
    import comfy.utils
    from test_wan_animate import COMFY_UNET as ANIMATE_UNET
    from test_wan_s2v import comfy_unet_config
    config = comfy.supported_models.WAN22_S2V(comfy_unet_config()) if variant == "s2v" \
        else comfy.supported_models.WAN22_Animate(dict(ANIMATE_UNET))
    config.set_inference_dtype(torch.float32, None)
    model = config.get_model({})
    weights = comfy.utils.load_torch_file(path)
    model.diffusion_model.load_state_dict({key.removeprefix(COMFY_PREFIX): value for key, value in weights.items()},
                                          strict=True)
    cpu = torch.device("cpu")
    return comfy.model_patcher.ModelPatcher(model, load_device=cpu, offload_device=cpu)


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    cs.import_comfy()
    import folder_paths
    from safetensors.torch import save_file
    import test_wan_animate
    import test_wan_s2v
    root = tmp_path_factory.mktemp("models")
    for kind in ("diffusion_models", "loras"):
        os.makedirs(root / kind)
        folder_paths.add_model_folder_path(kind, str(root / kind), is_default=True)
    sources = {variant: write_tiny_checkpoint("wan", str(root / "diffusion_models" / f"tiny_{variant}.safetensors"),
                                              seed=module.SEED, variant=variant, prefix=COMFY_PREFIX, **module.SIZE)
               for variant, module in (("s2v", test_wan_s2v), ("animate", test_wan_animate))}
    owner = cs.import_node_module("pool_owner").OWNER
    loader = cs.import_node_module("loader")
    sp_models, own = {}, {}
    for seed, (variant, source) in enumerate(sources.items()):
        save_file(lora_state(variant, seed), str(root / "loras" / f"{variant}_lora.safetensors"))
        sp_models[variant] = loader.SPModelLoader.execute(
            unet_name=f"tiny_{variant}.safetensors", weight_dtype="fp32", devices="cpu:2", ulysses_degree=0,
            ring_degree=1, cfg_parallel=False).result[0]
        own[variant] = comfy_own(variant, source)
        assert type(sp_models[variant].model) is type(own[variant].model)
    yield {"sp": sp_models, "own": own}
    owner.close_all()


def run(model, variant: str) -> torch.Tensor:
    """Two stock KSampler steps with the variant's conditioning (as its conditioning node sets it)."""
    if variant == "s2v":
        from test_wan_s2v import s2v_conditioning
        return cs.sample(model, *s2v_conditioning(), steps=2, frames=3)
    from test_wan_animate import animate_conditioning
    return cs.sample(model, *animate_conditioning(5, frames=3, height=4, width=6), steps=2, frames=3, height=4,
                     width=6)


def stock_lora(model, variant: str, strength: float):
    import nodes  # ComfyUI's own nodes.py
    return nodes.LoraLoaderModelOnly().load_lora_model_only(model, f"{variant}_lora.safetensors", strength)[0]


def sp_lora(model, variant: str, strength: float):
    return cs.import_node_module("lora").SPLoraLoader.execute(model, f"{variant}_lora.safetensors",
                                                              strength).result[0]


@pytest.mark.parametrize("variant", LORAS)
def test_loras_on_the_variants_extra_modules_equal_comfys_model(variant, env):
    sp, own = env["sp"][variant], env["own"][variant]
    base = run(sp, variant)
    cs.assert_close(base, run(own, variant))
    for strength in (1.0, 0.5):
        expected = run(stock_lora(own, variant, strength), variant)
        assert (expected - base).abs().max() > 1e-3, "the LoRA changed nothing"
        cs.assert_close(run(stock_lora(sp, variant, strength), variant), expected)
        cs.assert_close(run(sp_lora(sp, variant, strength), variant), expected)
    assert run(sp, variant).equal(base)  # the patches came off exactly
