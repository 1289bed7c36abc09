"""SD3 / SD3.5 (Large, Large Turbo, Medium) under Ulysses SP: MMDiT on diffusers' SD3Transformer2DModel, ComfyUI's
`diffusion_model(x, timesteps, context, y)` (ComfyUI's SD3 model class).

detect.py reads the header (ComfyUI's `joint_blocks` layout with or without `model.diffusion_model.`, all-in-one
checkpoints, diffusers files and folders), keys.py maps ComfyUI names through diffusers' own converter, plan.py is
the sequence-parallel forward (the image split, each rank embedding its own tokens with their learned positions;
text replicated and joined in every block; SD3.5 Medium's second, image-only attention).
"""
from ...contract import ComfyHost, ModelInfo
from .detect import DESCRIPTION, FAMILY, detect
from .keys import original_plan, weight_plan
from .plan import PLAN, load, load_model


def _comfy_unet_config(info: ModelInfo) -> dict:
    return {"in_channels": info.in_channels, "out_channels": info.out_channels}


COMFY = ComfyHost(model_classes={"": "SD3"}, unet_config=_comfy_unet_config)

__all__ = ["COMFY", "DESCRIPTION", "FAMILY", "PLAN", "detect", "load", "load_model", "original_plan", "weight_plan"]
