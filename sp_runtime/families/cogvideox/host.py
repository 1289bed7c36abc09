"""How ComfyUI's host side sees CogVideoX: supported_models' CogVideoX_T2V / _I2V (32 input channels) / _Inpaint (48:
VOID's passes; its concat_latent_image is concatenated to x by the host's model_base.CogVideoX), the unet_config
entries they read (the heads choose the 5B latent scale, patch_size_t the 1.5 defaults) and the patch."""
from __future__ import annotations

from ...contract import ComfyHost, ModelInfo, latent_channels

MODEL_CLASSES = {"inpaint": "CogVideoX_Inpaint", "i2v": "CogVideoX_I2V", "": "CogVideoX_T2V"}


def comfy_unet_config(info: ModelInfo) -> dict:
    config = info.config
    return {**latent_channels(info), "image_model": "cogvideox", "num_attention_heads": config["num_attention_heads"],
            "patch_size": config["patch_size"], "patch_size_t": config["patch_size_t"]}


def comfy_attributes(info: ModelInfo) -> dict:
    config = info.config
    return {"patch_size": config["patch_size"], "patch_size_t": config["patch_size_t"]}


COMFY = ComfyHost(model_classes=MODEL_CLASSES, unet_config=comfy_unet_config, attributes=comfy_attributes)
