"""Model families, found by name through FAMILIES: adding a family is adding its module and one line below (or
register_family at run time); docs/ADDING_A_FAMILY.md is the checklist.

A family module (or sub-package) provides, at module level:
    FAMILY = "name"                  its key in FAMILIES (and ModelInfo.family)
    DESCRIPTION = "..."              named in "supported: ..." errors ("" for internal families: toy, synthetic)
    detect(header) -> Detection | None
        From a header.Header alone (no weights read, no diffusers import: this runs in the ComfyUI process);
        None when the file is another family; ValueError naming the file for a variant it cannot run.
    load(request, detection, device, groups, progress) -> WorkerModel
        Worker side: build the model on `device` (diffusers imported here), read the weights (checkpoints/loading:
        choose_dtypes, build_empty_model, load_weights with the family's key plan) and return a WorkerModel whose
        forward(x, timestep, inputs, out, ctx) is the family's sequence-parallel forward (contract.py). The image
        families and HunyuanVideo return sp.PlanWorker(model, info, PLAN, ...): their forward is PLAN, a sp.Plan
        (the call's token streams, conditioning, stages of blocks, head) that the executor runs (ltx2 too, a
        package); wan* still define their own workers.
    COMFY = ComfyHost(...)           ComfyUI's model classes and the attributes its host side reads from
                                     `diffusion_model` (base.ComfyHost); leave it out when ComfyUI cannot use it.
Optional, each used where present: weight_plan(detection, keys) and original_plan(keys, model_config) (LoRAs by
original / ComfyUI key names), load_model(path, dtype, device) and reference_forward(...) (single-device runs of
the CLI demo and the tests). The detectors are tried in the order of FAMILIES.
"""
from __future__ import annotations

import importlib
import os
from types import ModuleType
from typing import Optional

from ..contract import ComfyHost

FAMILIES = {
    "qwen_image": "sp_runtime.families.qwen_image",
    "qwen_image21": "sp_runtime.families.qwen_image21",
    "flux": "sp_runtime.families.flux",
    "flux2": "sp_runtime.families.flux2",
    "z_image": "sp_runtime.families.z_image",
    "wan": "sp_runtime.families.wan",
    "hunyuan_video": "sp_runtime.families.hunyuan_video",
    "hunyuan_video15": "sp_runtime.families.hunyuan_video15",
    "ltx2": "sp_runtime.families.ltx2",
}


EXTRA_FAMILIES_ENV = "ULYSSES_SP_EXTRA_FAMILIES"  # "name=module,...": families registered at run time


def register_family(family: str, module: str) -> None:
    """Add a family module (importable by name) to FAMILIES, here and in every worker a pool starts afterwards
    (they read EXTRA_FAMILIES_ENV). Detectors are tried in registration order, after the built-in ones."""
    FAMILIES[family] = module
    extra = dict(item.split("=", 1) for item in os.environ.get(EXTRA_FAMILIES_ENV, "").split(",") if item)
    extra[family] = module
    os.environ[EXTRA_FAMILIES_ENV] = ",".join(f"{name}={path}" for name, path in extra.items())


def unregister_family(family: str) -> None:
    """Undo register_family (tests)."""
    FAMILIES.pop(family, None)
    extra = [item for item in os.environ.get(EXTRA_FAMILIES_ENV, "").split(",")
             if item and item.split("=", 1)[0] != family]
    os.environ[EXTRA_FAMILIES_ENV] = ",".join(extra)


for _item in filter(None, os.environ.get(EXTRA_FAMILIES_ENV, "").split(",")):
    FAMILIES.setdefault(*_item.split("=", 1))


def family_module(family: str) -> ModuleType:
    """The module of a registered family; ValueError naming the known ones otherwise."""
    if family not in FAMILIES:
        raise ValueError(f"model family {family!r} is not known to this version of ulysses-sp (known: "
                         f"{', '.join(FAMILIES)})")
    return importlib.import_module(FAMILIES[family])


def comfy_host(family: str) -> Optional[ComfyHost]:
    """The family's ComfyUI host-side description, or None when ComfyUI has no model class for it."""
    return getattr(family_module(family), "COMFY", None)
