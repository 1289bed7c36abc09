"""How ComfyUI's host side sees CogVideoX: its model class (supported_models' CogVideoX, which VOID's passes load
as; the inpainting condition arrives concatenated to x by the host) and the patch its class reads."""
from __future__ import annotations

from ...contract import ComfyHost, ModelInfo, latent_channels


def comfy_attributes(info: ModelInfo) -> dict:
    config = info.config
    return {"patch_size": config["patch_size"], "patch_size_t": config["patch_size_t"]}


COMFY = ComfyHost(model_classes={"": "CogVideoX_T2V"}, unet_config=latent_channels, attributes=comfy_attributes)
