"""LoRAs on Wan 2.2 S2V and Animate through the SP loader's MODEL (devices cpu:2), against ComfyUI's own WAN22_S2V /
WAN22_Animate model with the same LoRA through the stock LoraLoaderModelOnly, in the stock sampler with the
variants' conditioning: the stock node on the SP MODEL and the LoRA (Ulysses SP) node both equal it at strengths 1.0
and 0.5, with LoRA keys on the variants' extra modules (S2V: audio injector, its adaptive norm, the audio encoder;
Animate: the face adapter's fused kv, the face encoder, the motion encoder) besides the blocks; the base MODEL
samples bitwise as before afterwards. The same on quantized files kept quantized (S2V as GGUF, Animate as ComfyUI
mixed precision, their extra modules quantized too; bf16 compute) against ComfyUI's model on the dequantized weights,
within bf16 rounding. Needs COMFYUI_PATH; skipped otherwise."""
from __future__ import annotations

import os

import pytest
import torch

import comfy_support as cs
from family_support import BF16_TOL
from sp_lab.tiny_models import COMFY_PREFIX, write_tiny_checkpoint
from sp_lab.tiny_models.quant_files import write_quantized

pytestmark = pytest.mark.skipif(cs.comfyui_path() is None, reason=cs.NO_COMFYUI)

RANK = 4
QUANTIZED = {"s2v_gguf": ("s2v", "gguf"), "animate_comfy_quant": ("animate", "comfy_quant")}  # name -> (variant, format)
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
    modules = {"s2v": test_wan_s2v, "animate": test_wan_animate}
    owner = cs.import_node_module("pool_owner").OWNER
    loader = cs.import_node_module("loader")
    sp_models, own = {}, {}
    for seed, (variant, module) in enumerate(modules.items()):
        save_file(lora_state(variant, seed), str(root / "loras" / f"{variant}_lora.safetensors"))
    for name in (*modules, *QUANTIZED):
        variant, fmt = QUANTIZED.get(name, (name, None))
        size = modules[variant].SIZE
        file = f"tiny_{name}.{'gguf' if fmt == 'gguf' else 'safetensors'}"
        if fmt is None:  # the variant's own test file; ComfyUI's model holds the same weights
            source = write_tiny_checkpoint("wan", str(root / "diffusion_models" / file), seed=modules[variant].SEED,
                                           variant=variant, prefix=COMFY_PREFIX, **size)
        else:  # ComfyUI's model holds the weights the quantized file encodes
            source = str(root / f"{name}_dequantized.safetensors")
            write_quantized("wan", str(root / "diffusion_models" / file), source, fmt, 7, "",
                            {"ulysses_sp.head_dim": "128"}, variant=variant, **size)
        sp_models[name] = loader.SPModelLoader.execute(
            unet_name=file, weight_dtype="fp32" if fmt is None else "default", devices="cpu:2", ulysses_degree=0,
            ring_degree=1, cfg_parallel=False).result[0]
        own[name] = comfy_own(variant, source)
        assert type(sp_models[name].model) is type(own[name].model)
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


@pytest.mark.parametrize("name", [*LORAS, *QUANTIZED])
def test_loras_on_the_variants_extra_modules_equal_comfys_model(name, env):
    """fp32 files: within 1e-5 of ComfyUI's model; quantized files kept quantized (bf16 compute): within bf16
    rounding of ComfyUI's fp32 model on the dequantized weights."""
    variant = QUANTIZED.get(name, (name,))[0]
    bound = BF16_TOL if name in QUANTIZED else 1e-5
    sp, own = env["sp"][name], env["own"][name]
    base = run(sp, variant)
    cs.assert_close(base, run(own, variant), bound)
    for strength in (1.0, 0.5):
        expected = run(stock_lora(own, variant, strength), variant)
        assert (expected - base).abs().max() > 1e-3, "the LoRA changed nothing"
        cs.assert_close(run(stock_lora(sp, variant, strength), variant), expected, bound)
        cs.assert_close(run(sp_lora(sp, variant, strength), variant), expected, bound)
    assert run(sp, variant).equal(base)  # the patches came off exactly
