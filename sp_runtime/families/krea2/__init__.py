"""Krea 2 (Raw, Turbo; text to image): ComfyUI's Krea2 `diffusion_model(x, timesteps, context)` (SingleStreamDiT) on
diffusers' Krea2Transformer2DModel. detection.py reads the header, keys.py renames ComfyUI's keys, plan.py is the
sequence-parallel plan (image tokens split, the fused text replicated and joined to every single-stream block),
host.py ComfyUI's class. The reference is sp_lab.references.krea2."""
from ..family import Family, PlanModel
from .detection import CLASS_NAME, CONFIG_KEYS, DESCRIPTION, NAME, detect
from .host import COMFY
from .keys import original_plan, weight_plan
from .plan import PLAN

MODEL = PlanModel(NAME, "Krea 2", CLASS_NAME, detect, weight_plan, PLAN, 4, CONFIG_KEYS,
                  channels=lambda model: (model.config.in_channels // 4, model.config.in_channels // 4))
load, load_model = MODEL.load, MODEL.load_model

FAMILY = Family(NAME, DESCRIPTION, detect, load, COMFY, weight_plan, original_plan, load_model,
                signatures=("txtfusion.projector.weight",))

__all__ = ["COMFY", "CONFIG_KEYS", "DESCRIPTION", "FAMILY", "NAME", "PLAN", "detect", "load", "load_model",
           "original_plan", "weight_plan"]
