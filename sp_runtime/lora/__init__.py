"""LoRA inside the workers: LoRA files read with safetensors mmap, their keys mapped onto a loaded diffusers model
through its family's key plan, and weights set to base + sum(strength x delta), re-read from the base checkpoint
whenever a parameter's set of LoRAs changes (so an empty list restores the base weights exactly).

The host only names files and strengths (`spec.normalize_loras`); everything else runs in the worker processes.
ComfyUI's own weight patches (stock LoRA nodes) come as a neutral `patch_set.PatchSet` instead, resolved onto the
model by `patch_targets` and applied with ComfyUI's formulas restated in `patch_math`.
"""
from .spec import LoraList, normalize_loras

__all__ = ["LoraList", "normalize_loras"]
