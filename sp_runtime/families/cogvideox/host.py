"""How ComfyUI's host side sees CogVideoX: supported_models' CogVideoX_T2V / _I2V (32 input channels) / _Inpaint (48:
VOID's passes; its concat_latent_image is concatenated to x by the host's model_base.CogVideoX), the unet_config
entries they read (the heads choose the 5B latent scale, patch_size_t the 1.5 defaults) and the attributes
model_base.CogVideoX reads from diffusion_model."""
from __future__ import annotations

from ...contract import ComfyHost, ModelInfo, latent_channels

MODEL_CLASSES = {"inpaint": "CogVideoX_Inpaint", "i2v": "CogVideoX_I2V", "": "CogVideoX_T2V"}


def comfy_unet_config(info: ModelInfo) -> dict:
    config = info.config
    return {**latent_channels(info), "image_model": "cogvideox", "num_attention_heads": config["num_attention_heads"],
            "patch_size": config["patch_size"], "patch_size_t": config["patch_size_t"]}


def comfy_attributes(info: ModelInfo) -> dict:
    """What model_base.CogVideoX reads from diffusion_model: in_channels (concat_cond sizes the condition by it) and
    ofs_proj_dim (set: it sends ofs, 2.0 by default); the patch."""
    config = info.config
    return {"in_channels": info.in_channels, "ofs_proj_dim": config["ofs_embed_dim"],
            "patch_size": config["patch_size"], "patch_size_t": config["patch_size_t"]}


COMFY = ComfyHost(model_classes=MODEL_CLASSES, unet_config=comfy_unet_config, attributes=comfy_attributes)
