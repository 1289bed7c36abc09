"""ComfyUI's own model config for an SP checkpoint, built from the safetensors header alone, and the weightless
MODEL (BaseModel + proxy diffusion_model + ModelPatcher on the CPU) that the stock sampler nodes take.

Real checkpoints go through ComfyUI's detection (comfy.model_detection) on a state dict of meta tensors, so the
config is what ComfyUI itself would build. ComfyUI's detection hardcodes real sizes and does not know this
project's test checkpoints, so when it finds nothing the config comes from our ModelInfo through the family's
ComfyHost (sp_runtime.families.comfy_host). Sizes in unet_config never matter here: no ComfyUI network is created.
"""
from __future__ import annotations

import logging

import torch

import comfy.model_detection
import comfy.model_patcher
import comfy.supported_models
import comfy.utils

from sp_runtime.families import FAMILIES, comfy_host
from sp_runtime.families.checkpoint import SAFETENSORS_DTYPES

log = logging.getLogger("ulysses_sp")


HOST_MEMORY_FACTOR = 0.01  # read by some ComfyUI code paths; memory_required below is what the host needs
HOST_LATENT_COPIES = 8  # x, noise, denoised, the sampler's state and the shared-memory copies, in float32


def meta_state_dict(header) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint header as a meta tensor of the right shape and dtype (no weight is read)."""
    state = {}
    for name, (dtype, shape) in header.tensors.items():
        state[name] = torch.empty(shape, dtype=SAFETENSORS_DTYPES.get(dtype, torch.float32), device="meta")
    return state


def detect_with_comfy(header):
    """ComfyUI's model config for the checkpoint, as comfy.sd.load_diffusion_model_state_dict detects it, or None."""
    state = meta_state_dict(header)
    prefix = comfy.model_detection.unet_prefix_from_state_dict(state)
    stripped = comfy.utils.state_dict_prefix_replace(state, {prefix: ""}, filter_keys=True)
    if stripped:
        state = stripped
    try:
        config = comfy.model_detection.model_config_from_unet(state, "")
        if config is None:
            converted = comfy.model_detection.convert_diffusers_mmdit(state, "")
            if converted is not None:
                config = comfy.model_detection.model_config_from_unet(converted, "")
    except Exception as error:  # detection of odd files may trip over shapes; our own detection decides then
        log.debug("ulysses-sp: ComfyUI detection failed on %s: %s", header.path, error)
        return None
    return config


def config_from_info(info) -> "comfy.supported_models_base.BASE":
    """Model config from our ModelInfo (family, variant, channels) when ComfyUI's detection does not apply."""
    host = comfy_host(info.family)
    name = host.model_class(info.variant) if host else None
    if name is None:
        supported = sorted(family for family in FAMILIES if comfy_host(family))
        raise ValueError(f"model family {info.family!r} (variant {info.variant or ''!r}) has no ComfyUI model class "
                         f"in ulysses-sp; supported families: {', '.join(supported)}")
    config_cls = getattr(comfy.supported_models, name, None)
    if config_cls is None:
        raise ValueError(f"model family {info.family!r} needs ComfyUI's model class supported_models.{name}, which "
                         f"this ComfyUI does not have: update ComfyUI (the README lists the version each family "
                         f"needs)")
    unet_config = {**config_cls.unet_config, **host.unet_config(info)}
    return config_cls(unet_config)


def comfy_model_config(header, info):
    """ComfyUI's config for the checkpoint (its header, as the pool read it); ComfyUI's detection first, our
    ModelInfo when it finds nothing."""
    config = detect_with_comfy(header)
    if config is None:
        config = config_from_info(info)
    elif comfy_host(info.family) and not _same_family(config, info):
        log.warning("ulysses-sp: ComfyUI detects %s as %s but the workers load it as %s; using the workers' view",
                    header.path, type(config).__name__, info.family)
        config = config_from_info(info)
    return config


def _same_family(config, info) -> bool:
    wanted = set(comfy_host(info.family).model_classes.values())
    classes = [getattr(comfy.supported_models, name, None) for name in wanted]
    return any(isinstance(config, cls) for cls in classes if cls is not None)


def host_memory_required(input_shape, cond_shapes={}) -> int:
    elements = 1
    for size in input_shape:
        elements *= int(size)
    return elements * 4 * HOST_LATENT_COPIES


class SPModelPatcher(comfy.model_patcher.ModelPatcher):
    """A ModelPatcher whose weights live in the SP workers: weight patches made on the host would do nothing,
    so they raise a clear error instead of being dropped silently."""

    def add_patches(self, patches, strength_patch=1.0, strength_model=1.0):
        # Raise even for an empty dict: ComfyUI finds no LoRA keys in a weightless model, so a stock LoRA node
        # calls this with {} and would otherwise "succeed" while doing nothing.
        if strength_patch != 0:
            raise RuntimeError(
                "This model is a Ulysses SP model: its weights live in the SP worker processes, so a stock LoRA or "
                "model-merge node cannot patch it here (the patch would silently do nothing). Use the "
                "'LoRA (Ulysses SP)' node to apply a LoRA in the workers.")
        return super().add_patches(patches, strength_patch, strength_model)

    def add_hook_patches(self, hook, patches, strength_patch=1.0, strength_model=1.0):
        if strength_patch != 0:
            raise RuntimeError(
                "Hook LoRAs / weight hooks cannot patch a Ulysses SP model: its weights live in the SP worker "
                "processes. Use the 'LoRA (Ulysses SP)' node instead.")
        return super().add_hook_patches(hook, patches, strength_patch, strength_model)


def build_sp_model(model_config, proxy: torch.nn.Module, compute_dtype: torch.dtype) -> SPModelPatcher:
    """A MODEL for the stock nodes: ComfyUI's BaseModel of the family with `proxy` as its diffusion_model,
    patched and sampled on the CPU (no weights, no VRAM in the ComfyUI process)."""
    model_config.unet_config["disable_unet_model_creation"] = True
    model_config.set_inference_dtype(compute_dtype, None)
    model_config.memory_usage_factor = HOST_MEMORY_FACTOR
    model = model_config.get_model({}, "")
    model.diffusion_model = proxy
    model.memory_usage_factor = HOST_MEMORY_FACTOR
    # ComfyUI sizes batches and frees memory from this estimate; the network runs in the workers, so the host
    # needs room for a few latent copies only (a network-sized estimate would split cond/uncond into two calls)
    model.memory_required = host_memory_required
    cpu = torch.device("cpu")
    return SPModelPatcher(model, load_device=cpu, offload_device=cpu)
