"""Z-Image (base, turbo): ComfyUI's `diffusion_model(x, timestep, context, num_tokens, attention_mask)` (NextDiT in
comfy/ldm/lumina with Z-Image's options: 32-token padding with learned pad tokens, theta 256, t = 1 - sigma, output
negated) on diffusers' ZImageTransformer2DModel.

Plan (plan.py): the caption and the image tokens are two streams, each padded to 32 and split over the ranks on its
own; `context_refiner` and `noise_refiner` attend within one stream, `layers` over both (each rank's caption shard,
then its image shard; nothing is masked, so the order changes nothing). Ulysses pads heads to the degree.
Ming-Image (variant "ming_image", ming.py): 5-D latents, reference frames and direct caption tokens in the same two
streams, without pad tokens where its file has none; one PlanModel per variant (x is 4-D / 5-D).
"""
from ..family import Family, PlanModel, by_variant
from . import ming
from .detection import CLASS_NAME, CONFIG_KEYS, NAME, PAD_MULTIPLE, PATCH, UNUSED, architecture, detect
from .host import COMFY
from .keys import original_plan, weight_plan
from .plan import PLAN

MODELS = {variant: PlanModel(NAME, "Z-Image", CLASS_NAME, detect, weight_plan, plan, x_ndim, CONFIG_KEYS,
                             ignore=UNUSED, channels=lambda model: (model.config.in_channels, model.config.in_channels),
                             build=ming.build_model, describe=ming.describe)
          for variant, plan, x_ndim in (("image", PLAN, 4), ("ming_image", ming.MING_PLAN, 5))}
MODEL = MODELS["image"]

load_model, load = by_variant(MODELS, detect, NAME, "Z-Image")  # the file's variant picks its model


FAMILY = Family(NAME, "Z-Image (base, turbo, Ming-Image)", detect, load, COMFY, weight_plan, original_plan,
                load_model, gguf_architectures=("lumina2",))

__all__ = ["FAMILY", "CONFIG_KEYS", "COMFY", "MODELS", "NAME", "PAD_MULTIPLE", "PATCH", "PLAN", "architecture",
           "detect", "load", "load_model", "original_plan", "weight_plan"]
