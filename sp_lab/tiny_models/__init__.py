"""Tiny random-weight models with the real architectures (diffusers' classes, small widths) and writers that save
them as the checkpoint files users have: ComfyUI/original key layout (with or without `model.diffusion_model.`),
diffusers single files and diffusers folders, in fp32 / bf16 / fp16 / fp8.

Defaults use 6 heads (so 4 ranks do not divide them) of size 16, and 2 (+2 single) blocks. The original-layout
writer is the inverse of the loader's key conversion, written separately so that a round trip checks both.
"""
from __future__ import annotations

from functools import partial
from types import SimpleNamespace
from typing import Optional

import torch

from . import chroma, cosmos, flux2, hidream, hunyuan_video, lumina2, ltx2, minimax_h3, qwen_image21, sd3, wan, z_image
from . import ideogram4
from . import qwen_image_controlnet
from . import kandinsky5, krea2, ltxv
from . import anima, boogu, ernie_image, hidream_o1, joyimage, longcat_image, mage_flow, omnigen2, ovis_image
from . import seedvr2
from . import lens
from . import cogvideox
from .weights import COMFY_PREFIX, random_model, randomize_, save_tiny, sized

__all__ = ["COMFY_PREFIX", "FAMILIES", "LAYOUTS", "build_tiny_model", "original_state_dict", "randomize_",
           "tiny_config", "write_tiny_checkpoint"]


def _hunyuan(version: str) -> SimpleNamespace:
    """hunyuan_video.py's API at one version (1.0, 1.5), as the other modules have theirs."""
    return SimpleNamespace(tiny_config=partial(hunyuan_video.tiny_config, version),
                           build_tiny_model=lambda seed=0, **size: hunyuan_video.build_tiny_model(seed, version, **size),
                           original_state_dict=hunyuan_video.tencent_state_dict,
                           write_tiny_checkpoint=partial(hunyuan_video.write_tiny_checkpoint, version=version))


# family -> its module (tiny_config(**size), build_tiny_model(seed, **size), original_state_dict(model), and
# write_tiny_checkpoint(path, layout, dtype, seed, prefix, [variant, max_shard_size,] **size) where saving the model
# as built is not all); Qwen-Image and Flux.1 are written here
MODULES = {"wan": wan, "qwen_image21": qwen_image21, "flux2": flux2, "hunyuan_video": _hunyuan("1.0"),
           "hunyuan_video15": _hunyuan("1.5"), "z_image": z_image, "ltx2": ltx2, "sd3": sd3, "chroma": chroma,
           "hidream": hidream, "lumina2": lumina2, "minimax_h3": minimax_h3, "cosmos": cosmos, "ideogram4": ideogram4,
           "qwen_image_controlnet": qwen_image_controlnet, "ltxv": ltxv, "kandinsky5": kandinsky5, "krea2": krea2,
           "mage_flow": mage_flow, "anima": anima, "ernie_image": ernie_image, "longcat_image": longcat_image,
           "omnigen2": omnigen2, "seedvr2": seedvr2, "boogu": boogu, "ovis_image": ovis_image,
           "hidream_o1": hidream_o1, "joyimage": joyimage,
           "lens": lens, "cogvideox": cogvideox}
FAMILIES = ("qwen_image", "flux", *MODULES)
LAYOUTS = ("original", "diffusers", "diffusers_folder")

QWEN_TINY = dict(patch_size=2, in_channels=64, out_channels=16, num_layers=2, attention_head_dim=16,
                 num_attention_heads=6, joint_attention_dim=32, axes_dims_rope=(4, 6, 6), zero_cond_t=False,
                 use_additional_t_cond=False, use_layer3d_rope=False)
FLUX_TINY = dict(patch_size=1, in_channels=64, out_channels=None, num_layers=2, num_single_layers=2,
                 attention_head_dim=16, num_attention_heads=6, joint_attention_dim=32, pooled_projection_dim=24,
                 guidance_embeds=True, axes_dims_rope=(4, 6, 6))
EDIT_2511_MARKER = "__index_timestep_zero__"


def tiny_config(family: str, **size) -> dict:
    """diffusers config of a tiny model; `size` overrides (e.g. guidance_embeds=False for Flux schnell)."""
    if family not in FAMILIES:
        raise ValueError(f"unknown family {family!r}; tiny models exist for {FAMILIES}")
    if family in MODULES:
        return MODULES[family].tiny_config(**size)
    return sized(family, QWEN_TINY if family == "qwen_image" else FLUX_TINY, size, "axes_dims_rope")


def build_tiny_model(family: str, seed: int = 0, **size) -> torch.nn.Module:
    """A float32 diffusers model of the family with seeded random weights (stock attention processors)."""
    if family in MODULES:
        return MODULES[family].build_tiny_model(seed, **size)
    class_name = "QwenImageTransformer2DModel" if family == "qwen_image" else "FluxTransformer2DModel"
    return random_model(class_name, tiny_config(family, **size), seed)


# ---------------------------------------------------------------------------------------------------------------
# Key layouts

def original_state_dict(family: str, model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The model's weights under ComfyUI's / the original release's key names."""
    if family in MODULES:
        return MODULES[family].original_state_dict(model)
    state = {key: value.detach() for key, value in model.state_dict().items()}
    if family == "qwen_image":
        return state  # ComfyUI uses diffusers' names for Qwen-Image
    return _flux_to_original(state, model.config.num_layers, model.config.num_single_layers)


_FLUX_TOP = {
    "time_text_embed.timestep_embedder.linear_1": "time_in.in_layer",
    "time_text_embed.timestep_embedder.linear_2": "time_in.out_layer",
    "time_text_embed.guidance_embedder.linear_1": "guidance_in.in_layer",
    "time_text_embed.guidance_embedder.linear_2": "guidance_in.out_layer",
    "time_text_embed.text_embedder.linear_1": "vector_in.in_layer",
    "time_text_embed.text_embedder.linear_2": "vector_in.out_layer",
    "context_embedder": "txt_in",
    "x_embedder": "img_in",
    "proj_out": "final_layer.linear",
}
_FLUX_DOUBLE = {
    "norm1.linear": "img_mod.lin", "norm1_context.linear": "txt_mod.lin",
    "attn.to_out.0": "img_attn.proj", "attn.to_add_out": "txt_attn.proj",
    "ff.net.0.proj": "img_mlp.0", "ff.net.2": "img_mlp.2",
    "ff_context.net.0.proj": "txt_mlp.0", "ff_context.net.2": "txt_mlp.2",
}
_FLUX_DOUBLE_NORMS = {"attn.norm_q": "img_attn.norm.query_norm", "attn.norm_k": "img_attn.norm.key_norm",
                      "attn.norm_added_q": "txt_attn.norm.query_norm", "attn.norm_added_k": "txt_attn.norm.key_norm"}
_FLUX_SINGLE = {"norm.linear": "modulation.lin", "proj_out": "linear2"}
_FLUX_SINGLE_NORMS = {"attn.norm_q": "norm.query_norm", "attn.norm_k": "norm.key_norm"}


def _flux_to_original(state: dict, double: int, single: int) -> dict[str, torch.Tensor]:
    out = {}
    for ours, theirs in _FLUX_TOP.items():
        for kind in ("weight", "bias"):
            if f"{ours}.{kind}" in state:
                out[f"{theirs}.{kind}"] = state[f"{ours}.{kind}"]
    for kind in ("weight", "bias"):  # diffusers keeps (scale, shift), the original (shift, scale)
        scale, shift = state[f"norm_out.linear.{kind}"].chunk(2, dim=0)
        out[f"final_layer.adaLN_modulation.1.{kind}"] = torch.cat([shift, scale])
    for i in range(double):
        ours, theirs = f"transformer_blocks.{i}.", f"double_blocks.{i}."
        for kind in ("weight", "bias"):
            for a, b in _FLUX_DOUBLE.items():
                out[f"{theirs}{b}.{kind}"] = state[f"{ours}{a}.{kind}"]
            out[f"{theirs}img_attn.qkv.{kind}"] = torch.cat([state[f"{ours}attn.to_{p}.{kind}"] for p in "qkv"])
            out[f"{theirs}txt_attn.qkv.{kind}"] = torch.cat([state[f"{ours}attn.add_{p}_proj.{kind}"]
                                                             for p in "qkv"])
        for a, b in _FLUX_DOUBLE_NORMS.items():
            out[f"{theirs}{b}.scale"] = state[f"{ours}{a}.weight"]
    for i in range(single):
        ours, theirs = f"single_transformer_blocks.{i}.", f"single_blocks.{i}."
        for kind in ("weight", "bias"):
            for a, b in _FLUX_SINGLE.items():
                out[f"{theirs}{b}.{kind}"] = state[f"{ours}{a}.{kind}"]
            parts = [state[f"{ours}attn.to_{p}.{kind}"] for p in "qkv"] + [state[f"{ours}proj_mlp.{kind}"]]
            out[f"{theirs}linear1.{kind}"] = torch.cat(parts)
        for a, b in _FLUX_SINGLE_NORMS.items():
            out[f"{theirs}{b}.scale"] = state[f"{ours}{a}.weight"]
    return out


# ---------------------------------------------------------------------------------------------------------------
# Writers

def write_tiny_checkpoint(family: str, path: str, layout: str = "original", dtype: str = "float32", seed: int = 0,
                          prefix: str = "", variant: str = "", max_shard_size: Optional[str] = None,
                          **size) -> str:
    """Build a tiny model and save it; returns the path written (a file, or a folder for "diffusers_folder").

    layout: "original" (ComfyUI key names), "diffusers" (one file, diffusers names), "diffusers_folder"
    (config.json + weights via diffusers' save_pretrained; max_shard_size e.g. "100KB" writes shards + index).
    prefix: prepended to every key of a file, e.g. "model.diffusion_model." as in ComfyUI's full checkpoints.
    variant: "edit_2511" (Qwen: ComfyUI's marker tensor / zero_cond_t), "layered" (Qwen-Image-Layered's
    addition_t_embedding), "schnell" (Flux without guidance),
    "fill" (Flux with 384 input features).
    """
    if layout not in LAYOUTS:
        raise ValueError(f"layout {layout!r} is not one of {LAYOUTS}")
    module = MODULES.get(family)
    if module is not None and not hasattr(module, "write_tiny_checkpoint"):  # the model as built, saved
        model = module.build_tiny_model(seed, **({"variant": variant} if variant else {}), **size)
        return save_tiny(model, path, layout, dtype, prefix, max_shard_size, module.original_state_dict)
    if module is not None:
        options = {**({"variant": variant} if variant else {}),
                   **({"max_shard_size": max_shard_size} if max_shard_size else {})}
        return module.write_tiny_checkpoint(path, layout=layout, dtype=dtype, seed=seed, prefix=prefix, **options,
                                            **size)
    model = build_tiny_model(family, seed, **{**_variant_size(family, variant, layout), **size})
    marker = family == "qwen_image" and variant == "edit_2511" and layout == "original"
    return save_tiny(model, path, layout, dtype, prefix, max_shard_size, partial(original_state_dict, family),
                     extra={EDIT_2511_MARKER: torch.tensor([])} if marker else None)


def _variant_size(family: str, variant: str, layout: str) -> dict:
    if not variant:
        return {}
    if family == "qwen_image" and variant == "edit_2511":
        return {"zero_cond_t": True} if layout == "diffusers_folder" else {}
    if family == "qwen_image" and variant == "layered":
        return {"use_additional_t_cond": True, "use_layer3d_rope": True}
    if family == "flux" and variant == "schnell":
        return {"guidance_embeds": False}
    if family == "flux" and variant == "fill":
        return {"in_channels": 384, "out_channels": 64}
    raise ValueError(f"unknown variant {variant!r} for {family}")
