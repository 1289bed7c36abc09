"""Qwen-Image InstantX ControlNet (Union; Inpainting with its mask channels): diffusers' QwenImageControlNetModel,
run in the workers on the main Qwen-Image call's own token shards (plan.py); ComfyUI's ControlNetApplyAdvanced
chooses its hint, strength and step range on the host (nodes/controlnet.py)."""
from ...checkpoints.loading import diffusers_names
from ..family import Family, PlanModel
from .detection import CONFIG_KEYS, NAME, detect
from .plan import PLAN

MODEL = PlanModel(NAME, "Qwen-Image ControlNet", "QwenImageControlNetModel", detect, diffusers_names, PLAN, 5,
                  CONFIG_KEYS, channels=lambda model: (model.config.in_channels // 4,) * 2)
load, load_model, worker_from_model = MODEL.load, MODEL.load_model, MODEL.worker

FAMILY = Family(NAME, "Qwen-Image InstantX ControlNet", detect, load, load_model=load_model)

__all__ = ["CONFIG_KEYS", "FAMILY", "MODEL", "NAME", "PLAN", "detect", "load", "load_model", "worker_from_model"]
