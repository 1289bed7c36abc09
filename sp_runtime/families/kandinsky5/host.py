"""How ComfyUI's host side sees Kandinsky 5: its Kandinsky5Image (4-D latents) and Kandinsky5 (video: the latent with
the image latent and mask channels of its concat_cond; image to video's first frames as `time_dim_replace`)."""
from __future__ import annotations

from ...contract import ComfyHost

COMFY = ComfyHost(model_classes={"image": "Kandinsky5Image", "video": "Kandinsky5"},
                  unet_config=lambda info: {"image_model": "kandinsky5", "model_dim": info.config["model_dim"],
                                            "visual_embed_dim": info.in_channels * 4})
