"""How ComfyUI's host side sees HunyuanVideo (1.0; 1.5 reuses comfy_attributes): its model classes per variant, the
patch, and the img_in weight shape its classes read from diffusion_model."""
from __future__ import annotations

from types import SimpleNamespace

import torch

from ...contract import ComfyHost, HostHooks, ModelInfo, latent_channels


def comfy_attributes(info: ModelInfo) -> dict:
    """What ComfyUI's HunyuanVideo classes read from diffusion_model: the patch and img_in.proj.weight.shape (1.5's
    concat_cond sizes the image condition from it); plain objects, no weights."""
    config = info.config
    patch = [config["patch_size_t"], config["patch_size"], config["patch_size"]]
    shape = torch.Size((config["num_attention_heads"] * config["attention_head_dim"], info.in_channels, *patch))
    return {"patch_size": patch, "img_in": SimpleNamespace(proj=SimpleNamespace(weight=SimpleNamespace(shape=shape)))}


COMFY = ComfyHost(model_classes={"i2v": "HunyuanVideoI2V", "skyreels_i2v": "HunyuanVideoSkyreelsI2V",
                                 "": "HunyuanVideo"}, attributes=comfy_attributes,
                  unet_config=lambda info: {**latent_channels(info),
                                            "patch_size": comfy_attributes(info)["patch_size"]},
                  hooks=HostHooks(rope_options="ignored"))
