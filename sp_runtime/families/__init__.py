"""The model families: a registry of Family objects (family.py), each declared by one package
(`sp_runtime/families/<name>/`, module-level `FAMILY = Family(...)`); docs/ADDING_A_FAMILY.md is the checklist.

FAMILIES maps each name to its module, imported only when the family is asked for (detection runs in the ComfyUI
process: a family's package imports no diffusers at import time). The detectors are tried in this order. Every other
table is derived from the Family objects: the supported kinds (`descriptions`), the GGUF architectures
(`gguf_architectures`), the key signatures named for files no detector takes (`signatures`), ComfyUI's classes.
"""
from __future__ import annotations

import importlib
import os
from types import ModuleType
from typing import Optional

from ..contract import ComfyHost
from .family import Family

FAMILIES = {
    "lens": "sp_runtime.families.lens",  # before qwen_image: its single-text-layer files have Qwen-Image's anchors
    "mage_flow": "sp_runtime.families.mage_flow",  # before qwen_image: the same key names
    "seedvr2": "sp_runtime.families.seedvr2",
    "qwen_image": "sp_runtime.families.qwen_image",
    "qwen_image_controlnet": "sp_runtime.families.qwen_image_controlnet",
    "qwen_image21": "sp_runtime.families.qwen_image21",
    "flux": "sp_runtime.families.flux",
    "flux2": "sp_runtime.families.flux2",
    "z_image": "sp_runtime.families.z_image",
    "lumina2": "sp_runtime.families.lumina2",
    "sd3": "sp_runtime.families.sd3",
    "chroma": "sp_runtime.families.chroma",
    "hidream": "sp_runtime.families.hidream",
    "hidream_o1": "sp_runtime.families.hidream_o1",
    "minimax_h3": "sp_runtime.families.minimax_h3",
    "wan": "sp_runtime.families.wan",
    "hunyuan_video": "sp_runtime.families.hunyuan_video",
    "hunyuan_video15": "sp_runtime.families.hunyuan_video15",
    "ltx2": "sp_runtime.families.ltx2",
    "ltxv": "sp_runtime.families.ltxv",
    "kandinsky5": "sp_runtime.families.kandinsky5",
    "krea2": "sp_runtime.families.krea2",
    "cosmos": "sp_runtime.families.cosmos",
    "anima": "sp_runtime.families.anima",
    "ideogram4": "sp_runtime.families.ideogram4",
    "ernie_image": "sp_runtime.families.ernie_image",
    "longcat_image": "sp_runtime.families.longcat_image",
    "omnigen2": "sp_runtime.families.omnigen2",
    "boogu": "sp_runtime.families.boogu",
    "ovis_image": "sp_runtime.families.ovis_image",
    "joyimage": "sp_runtime.families.joyimage",
    "cogvideox": "sp_runtime.families.cogvideox",
}


EXTRA_FAMILIES_ENV = "ULYSSES_SP_EXTRA_FAMILIES"  # "name=module,...": families registered at run time


def register_family(family: str, module: str) -> None:
    """Add a family module (importable by name) to FAMILIES, here and in every worker a pool starts afterwards
    (they read EXTRA_FAMILIES_ENV). Detectors are tried in registration order, after the built-in ones."""
    FAMILIES[family] = module
    extra = dict(item.split("=", 1) for item in os.environ.get(EXTRA_FAMILIES_ENV, "").split(",") if item)
    extra[family] = module
    os.environ[EXTRA_FAMILIES_ENV] = ",".join(f"{name}={path}" for name, path in extra.items())


for _item in filter(None, os.environ.get(EXTRA_FAMILIES_ENV, "").split(",")):
    FAMILIES.setdefault(*_item.split("=", 1))


def family_module(name: str) -> ModuleType:
    """The package (or module) that declares a registered family; ValueError naming the known ones otherwise."""
    if name not in FAMILIES:
        raise ValueError(f"model family {name!r} is not known to this version of ulysses-sp (known: "
                         f"{', '.join(FAMILIES)})")
    return importlib.import_module(FAMILIES[name])


def family(name: str) -> Family:
    """A registered family's Family object; ValueError naming the known ones otherwise."""
    declared = Family.of(family_module(name))
    if declared.name != name:
        raise ValueError(f"{FAMILIES[name]} is registered as {name!r} but declares the family {declared.name!r}")
    return declared


def families() -> list[Family]:
    """Every registered family, in detection order."""
    return [family(name) for name in FAMILIES]


def descriptions() -> list[str]:
    """The supported kinds of model, as error messages list them (internal families have none)."""
    return [entry.description for entry in families() if entry.description]


def gguf_architectures() -> dict[str, list[str]]:
    """GGUF `general.architecture` -> the families whose files carry it."""
    found: dict[str, list[str]] = {}
    for entry in families():
        for architecture in entry.gguf_architectures:
            found.setdefault(architecture, []).append(entry.name)
    return found


def signatures() -> dict[str, tuple[str, ...]]:
    """Description -> key suffixes only that family's files hold (see Family.signatures)."""
    return {entry.description: entry.signatures for entry in families() if entry.signatures}


def comfy_host(name: str) -> Optional[ComfyHost]:
    """The family's ComfyUI host-side description, or None when ComfyUI has no model class for it."""
    return family(name).comfy
