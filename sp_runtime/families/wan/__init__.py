"""Wan 2.1 / 2.2 video (T2V, I2V, FLF2V, the A14B experts, TI2V 5B) and its variants under sequence parallelism:
detection (detect.py), key plan (keys.py), loading (load.py), the executor's plan (plan.py) and ComfyUI's host
description (host.py). Each variant is one module that registers a wan.variants.Variant (the base never imports
one): VACE (vace), Fun Control's reference image (fun), Fun Camera (camera), HuMo (humo), S2V (s2v), Wan 2.2
Animate (animate), Wan Animate 2 (animate2), in-context references (in_context: Wan 2.2 Bernini-R) and Wan 2.1
SCAIL / SCAIL-2 (scail) and Wan 2.2 Dancer (dancer); importing this package registers them all.
"""
from . import vace, s2v, humo, animate, animate2, camera, fun, in_context, scail, dancer  # noqa: F401 (order: detection's)
from ..family import Family
from .detect import FAMILY as NAME, HEAD_DIM_METADATA_KEY, detect, variant_of
from .host import comfy_host
from .load import (attach_extra_modules, extra_module_keys, load, load_model, model_config, model_info,
                   original_plan, weight_plan, worker_from_model)
from .plan import PLAN

DESCRIPTION = ("Wan 2.1 / 2.2 (T2V, I2V, FLF2V, A14B experts, TI2V 5B, VACE, Fun InP / Control / Camera, HuMo, S2V, "
               "Animate, Animate 2, Bernini-R in-context references, SCAIL / SCAIL-2, Dancer)")
COMFY = comfy_host()
EXTRA_MODULE_KEYS = extra_module_keys()
FAMILY = Family(NAME, DESCRIPTION, detect, load, COMFY, weight_plan, original_plan, load_model,
                gguf_architectures=("wan",), signatures=("head.modulation", "condition_embedder.time_proj.weight"))

__all__ = ["COMFY", "DESCRIPTION", "EXTRA_MODULE_KEYS", "FAMILY", "HEAD_DIM_METADATA_KEY", "PLAN",
           "attach_extra_modules", "detect", "load", "load_model", "model_config", "model_info", "original_plan",
           "variant_of", "weight_plan", "worker_from_model"]
