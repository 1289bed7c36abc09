"""Kandinsky 5 (Lite text to image, Lite / Pro text and image to video): ComfyUI's Kandinsky5 / Kandinsky5Image
`diffusion_model(x, timestep, context, y, time_dim_replace)` on diffusers' Kandinsky5Transformer3DModel.

detection.py reads the header (the release names the weights as diffusers does: the key plan is the identity),
plan.py is the sequence-parallel plan (latent tokens split, text blocks replicated), host.py ComfyUI's classes. The
image model takes 4-D latents, the video model 5-D: one PlanModel each, chosen by the detection's variant. The
reference is sp_lab.references.kandinsky5.
"""
from ...checkpoints.loading import diffusers_names, identity_plan
from ..family import Family, PlanModel, by_variant
from .detection import CLASS_NAME, CONFIG_KEYS, DESCRIPTION, NAME, detect
from .host import COMFY
from .plan import PLAN

MODELS = {variant: PlanModel(NAME, "Kandinsky 5", CLASS_NAME, detect, diffusers_names, PLAN, x_ndim,
                             CONFIG_KEYS, channels=lambda model: (model.visual_embeddings.in_layer.in_features // 4,
                                                                  model.config.out_visual_dim))
          for variant, x_ndim in (("image", 4), ("video", 5))}
_, load = by_variant(MODELS, detect, NAME, "Kandinsky 5")
load_model = MODELS["video"].load_model  # the same model for both variants


FAMILY = Family(NAME, DESCRIPTION, detect, load, COMFY, diffusers_names, identity_plan, load_model,
                signatures=("visual_transformer_blocks.0.visual_modulation.out_layer.weight",))

__all__ = ["COMFY", "CONFIG_KEYS", "DESCRIPTION", "FAMILY", "MODELS", "NAME", "PLAN", "detect", "load",
           "load_model"]
