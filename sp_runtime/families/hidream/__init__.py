"""HiDream I1 (full, dev, fast) and E1 (edit) under Ulysses SP: diffusers' HiDreamImageTransformer2DModel, ComfyUI's
`diffusion_model(x, t, y, context, encoder_hidden_states_llama3, image_cond)`.

The plan (plan.py): the image tokens split (E1's reference latent joined on the right, as ComfyUI concatenates it,
split with them); the text replicated: T5 and the last Llama layer throughout, plus each block's own Llama layer,
projected per block and joined to that block's attention only (double blocks through the text projections, single
blocks as leading tokens of the joint sequence). The feed-forwards, mixture-of-experts included, route every token
on its own, so they run on each rank's tokens. detection.py reads the header (ComfyUI and diffusers name the weights
alike: the key plan is the identity), host.py is what ComfyUI's host side reads.
"""
from ...checkpoints.loading import diffusers_names as weight_plan, identity_plan as original_plan
from ..family import Family, PlanModel
from .detection import CLASS_NAME, CONFIG_KEYS, DESCRIPTION, NAME, detect
from .host import COMFY
from .plan import PLAN

MODEL = PlanModel(NAME, "HiDream", CLASS_NAME, detect, weight_plan, PLAN, 4, CONFIG_KEYS,
                  channels=lambda model: (model.config.in_channels, model.out_channels))
load, load_model = MODEL.load, MODEL.load_model

FAMILY = Family(NAME, DESCRIPTION, detect, load, COMFY, weight_plan, original_plan, load_model,
                signatures=("double_stream_blocks.0.block.adaLN_modulation.1.bias",))

__all__ = ["COMFY", "DESCRIPTION", "FAMILY", "NAME", "PLAN", "detect", "load", "load_model", "original_plan",
           "weight_plan"]
