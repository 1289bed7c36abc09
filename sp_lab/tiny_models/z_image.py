"""Tiny random-weight Z-Image models (diffusers' ZImageTransformer2DModel: real head size 128, 5 heads, 1 refiner
block per stream, 2 main blocks) and their files in ComfyUI's key layout (fused `attention.qkv`, `attention.out`,
`q_norm` / `k_norm`, `x_embedder`, `final_layer`), as diffusers single files and as diffusers folders. The package's
API dispatches here; the ComfyUI writer fuses what the loader's key plan splits, written separately so that a round
trip checks both. Variant "ming_image": Ming-Image Design's file (no learned pad tokens)."""
from __future__ import annotations

import torch

from .weights import random_model, sized

Z_IMAGE_TINY = dict(all_patch_size=(2,), all_f_patch_size=(1,), in_channels=16, dim=640, n_layers=2,
                    n_refiner_layers=1, n_heads=5, n_kv_heads=5, cap_feat_dim=32, rope_theta=256.0, t_scale=1000.0,
                    axes_dims=(32, 48, 48), axes_lens=(1536, 512, 512))
_RENAMES = {"all_x_embedder.2-1.": "x_embedder.", "all_final_layer.2-1.": "final_layer.",
            ".attention.to_out.0.": ".attention.out.", ".attention.norm_q.": ".attention.q_norm.",
            ".attention.norm_k.": ".attention.k_norm."}


def tiny_config(**size) -> dict:
    config = sized("z_image", Z_IMAGE_TINY, size)
    if "n_heads" in size and "n_kv_heads" not in size:
        config["n_kv_heads"] = config["n_heads"]
    return config


def build_tiny_model(seed: int = 0, variant: str = "", **size) -> torch.nn.Module:
    model = random_model("ZImageTransformer2DModel", tiny_config(**size), seed)
    if variant == "ming_image":
        model.x_pad_token = model.cap_pad_token = None
    elif variant:
        raise ValueError(f"unknown variant {variant!r} for z_image (known: ming_image)")
    return model


def original_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """ComfyUI's names: q, k, v rows stacked into attention.qkv, the other renames of _RENAMES."""
    state = {key: value.detach() for key, value in model.state_dict().items()}
    out = {}
    for key, value in state.items():
        if key.endswith(".attention.to_q.weight"):
            stem = key[:-len("to_q.weight")]
            out[stem + "qkv.weight"] = torch.cat([state[stem + f"to_{part}.weight"] for part in "qkv"])
        elif not key.endswith((".attention.to_k.weight", ".attention.to_v.weight")):
            for ours, theirs in _RENAMES.items():
                key = key.replace(ours, theirs)
            out[key] = value
    return out
