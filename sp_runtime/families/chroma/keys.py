"""Chroma key plan: ComfyUI names -> diffusers' ChromaTransformer2DModel parameters. Flux.1's plan for the blocks,
embedders and output layer (Chroma's blocks are Flux's without modulation), plus the distilled guidance network's
renames (diffusers' convert_chroma_transformer_checkpoint_to_diffusers hardcodes the 3072 width, so it is not
called; tests/families/test_chroma.py checks the plan against it at full size). Chroma Radiance: its pixel patch
convolution `img_in_patch` as x_embedder's Linear, its NeRF head under ComfyUI's names (`.scale` norms as `.weight`)."""
from __future__ import annotations

from typing import Iterable

import torch

from .. import flux
from ...checkpoints.loading import KeyPlan, original_layout_plan
from .detection import GUIDANCE

NERF = ("nerf_image_embedder.", "nerf_blocks.", "nerf_final_layer.", "nerf_final_layer_conv.")  # Radiance's head
GUIDANCE_RENAMES = {".in_layer.": ".linear_1.", ".out_layer.": ".linear_2.", ".scale": ".weight"}


def original_plan(keys: Iterable[str], config) -> KeyPlan:
    keys = list(keys)
    plan = flux.flux_key_plan([key for key in keys if not key.startswith(GUIDANCE)],
                              config["num_attention_heads"] * config["attention_head_dim"])
    for key in keys:
        if key.startswith(GUIDANCE + "."):
            target = key
            for old, new in GUIDANCE_RENAMES.items():
                target = target.replace(old, new)
            plan[key] = [(target, None)]
        elif key.startswith("img_in_patch."):  # Radiance's strided convolution over a patch = a Linear over it
            kernel = key.endswith(".weight")
            plan[key] = [(key.replace("img_in_patch.", "x_embedder."), flatten_patch if kernel else None)]
        elif key.startswith(NERF):
            plan[key] = [(key[:-len(".scale")] + ".weight" if key.endswith(".scale") else key, None)]
    return plan


def flatten_patch(tensor: torch.Tensor) -> torch.Tensor:
    """A patch convolution's kernel [hidden, C, P, P] as a Linear's weight over (c, ph, pw) features."""
    return tensor.reshape(tensor.shape[0], -1)


weight_plan = original_layout_plan(original_plan)
