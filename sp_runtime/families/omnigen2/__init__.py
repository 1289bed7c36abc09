"""OmniGen2: ComfyUI's `diffusion_model(x, timesteps, context, num_tokens, ref_latents, attention_mask)`
(comfy/ldm/omnigen/omnigen2.py: t = 1 - sigma at timestep scale 1000, output negated) on diffusers' Lumina 2 blocks
with OmniGen2's reference modules (loading.py; diffusers has no OmniGen2 class).

Plan (plan.py): the caption (Qwen2.5-VL tokens), the reference latents and the image are three split streams;
`context_refiner`, `ref_image_refiner` and `noise_refiner` attend within one, `layers` over their union; grouped key /
value heads repeated to the query heads (Ulysses pads heads to the degree). A padded text mask is refused by name.
"""
from ...checkpoints.loading import diffusers_names as weight_plan, identity_plan as original_plan
from ..family import Family, PlanModel
from .detection import CLASS_NAME, CONFIG_KEYS, NAME, PATCH, architecture, detect
from .host import COMFY
from .loading import add_reference_modules, build_model
from .plan import PLAN

MODEL = PlanModel(NAME, "OmniGen2", CLASS_NAME, detect, weight_plan, PLAN, 4, CONFIG_KEYS, build=build_model,
                  channels=lambda model: (model.config.in_channels, model.config.in_channels))
load, load_model = MODEL.load, MODEL.load_model

FAMILY = Family(NAME, "OmniGen2 (text to image, image editing with reference images)", detect, load, COMFY,
                weight_plan, original_plan, load_model)  # no signature: Boogu-Image files hold every OmniGen2 key

__all__ = ["FAMILY", "CONFIG_KEYS", "COMFY", "MODEL", "NAME", "PATCH", "PLAN", "add_reference_modules",
           "architecture", "detect", "load", "load_model", "original_plan", "weight_plan"]
