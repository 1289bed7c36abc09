"""SD3 / SD3.5 (Large, Large Turbo, Medium) under Ulysses SP: MMDiT on diffusers' SD3Transformer2DModel, ComfyUI's
`diffusion_model(x, timesteps, context, y)` (ComfyUI's SD3 model class).

detection.py reads the header (ComfyUI's `joint_blocks` layout with or without `model.diffusion_model.`,
all-in-one checkpoints, diffusers files and folders), keys.py maps ComfyUI names through diffusers' own converter,
MODEL below builds the model, plan.py is the sequence-parallel forward (the image split, each rank embedding its own
tokens with their learned positions; text replicated and joined in every block; SD3.5 Medium's second, image-only
attention), host.py is what ComfyUI's host side reads.
"""
from ..family import Family, PlanModel
from .detection import CLASS_NAME, CONFIG_KEYS, DESCRIPTION, NAME, detect
from .host import COMFY
from .keys import original_plan, weight_plan
from .plan import PLAN

MODEL = PlanModel(NAME, "SD3 / SD3.5", CLASS_NAME, detect, weight_plan, PLAN, 4, CONFIG_KEYS)
load, load_model = MODEL.load, MODEL.load_model

FAMILY = Family(NAME, DESCRIPTION, detect, load, COMFY, weight_plan, original_plan, load_model,
                signatures=("joint_blocks.0.context_block.attn.qkv.weight",))

__all__ = ["COMFY", "DESCRIPTION", "FAMILY", "NAME", "PLAN", "detect", "load", "load_model", "original_plan",
           "weight_plan"]
