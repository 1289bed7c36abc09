"""Flux.1 (dev, schnell, Kontext, Fill, Depth/Canny) under Ulysses SP: detection from the header, loading into
diffusers' FluxTransformer2DModel, and ComfyUI's `diffusion_model(x, timestep, context, y, guidance, ref_latents)`.

Original (BFL / ComfyUI) key names are converted per tensor by `flux_key_plan`, our own width-aware version of
diffusers' `convert_flux_transformer_checkpoint_to_diffusers`. We do not call that converter because it hardcodes
the full-size width (3072) and needs the whole state dict in memory at once, which would stop us casting each tensor
to its final dtype as it is read (fp8 storage from a bf16 file would peak at the bf16 size). tests/test_flux.py
checks that both produce the same tensors on a full-size checkpoint.
"""
from __future__ import annotations

from typing import Iterable, Optional

import torch

from ..sp import AttentionSpec, Plan, PlanWorker, Stage, Stream, image_parts, text_stream
from ..sp.tokens import (ROPE_THETA, TokenGrid, as_list, grid_ids, reference_pack, reference_placements,
                         reference_unpack, rope_axes)
from ..contract import ComfyHost, Detection, HostHooks, LoadRequest, ModelInfo, config_entries
from ..checkpoints.loading import (KeyPlan, ProgressFn, Transform, WeightDtypes, count_blocks, detected_checkpoint,
                                   find_prefix, layout_keys, load_checkpoint_model, row_split, shape_of, strip_prefix,
                                   swap_halves)
from ..checkpoints.header import Header, header_config

FAMILY = "flux"
DESCRIPTION = "Flux.1 (dev, schnell, Kontext, Fill, Depth/Canny)"


def _comfy_unet_config(info: ModelInfo) -> dict:
    return {"in_channels": info.in_channels, "out_channels": info.out_channels}  # latent channels, as ComfyUI's


COMFY = ComfyHost(model_classes={"schnell": "FluxSchnell", "fill": "FluxInpaint", "": "Flux"},
                  unet_config=_comfy_unet_config, hooks=HostHooks(rope_options="applied"))
PATCH = 2
MLP_RATIO = 4  # diffusers' Flux blocks hardcode it
ORIGINAL_ANCHORS = ("double_blocks.0.img_attn.norm.key_norm.scale", "img_in.weight", "txt_in.weight",
                    "time_in.in_layer.weight", "vector_in.in_layer.weight", "final_layer.linear.weight")
DIFFUSERS_ANCHORS = ("x_embedder.weight", "context_embedder.weight", "transformer_blocks.0.attn.norm_added_k.weight",
                     "time_text_embed.text_embedder.linear_1.weight", "proj_out.weight")
REF_METHODS = ("index", "uxo")  # others ("offset", ComfyUI's default) place references side by side
CONFIG_KEYS = ("patch_size", "in_channels", "out_channels", "num_layers", "num_single_layers", "attention_head_dim",
               "num_attention_heads", "joint_attention_dim", "pooled_projection_dim", "guidance_embeds",
               "axes_dims_rope")


# ---------------------------------------------------------------------------------------------------------------
# Detection

def detect(header: Header) -> Optional[Detection]:
    """Flux.1 from its header alone (no weights read); None when the file is another family."""
    folder_config = header_config(header)
    if folder_config is not None:
        if folder_config.get("_class_name") != "FluxTransformer2DModel":
            return None
        config = {key: folder_config[key] for key in CONFIG_KEYS if key in folder_config}
        config["axes_dims_rope"] = tuple(config.get("axes_dims_rope", (16, 56, 56)))
        config["out_channels"] = config.get("out_channels") or config["in_channels"]  # diffusers' None = same
        return _detection(header, "diffusers", "", config)
    for layout, anchors in (("original", ORIGINAL_ANCHORS), ("diffusers", DIFFUSERS_ANCHORS)):
        prefix = find_prefix(header.tensors, anchors)
        if prefix is not None:
            return _detection(header, layout, prefix, architecture(strip_prefix(header.tensors, prefix), layout))
    return None


def _detection(header: Header, layout: str, prefix: str, config: dict) -> Detection:
    return Detection(family=FAMILY, variant=variant_of(config), layout=layout, prefix=prefix, config=config,
                     files=header.source.files)


def variant_of(config: dict) -> str:
    """dev (also Kontext: same weights layout), schnell, fill or control (Depth / Canny), from the config."""
    if config["in_channels"] == 384:
        return "fill"
    if config["in_channels"] == 128:
        return "control"
    return "dev" if config.get("guidance_embeds") else "schnell"


# Where a header shows each architecture fact: (original key, diffusers key), prefix stripped
ARCHITECTURE_KEYS = {
    "embed": ("img_in.weight", "x_embedder.weight"),
    "head_norm": ("double_blocks.0.img_attn.norm.key_norm.scale", "transformer_blocks.0.attn.norm_q.weight"),
    "mlp": ("double_blocks.0.img_mlp.0.weight", "transformer_blocks.0.ff.net.0.proj.weight"),
    "out": ("final_layer.linear.weight", "proj_out.weight"),
    "double_blocks": ("double_blocks", "transformer_blocks"),
    "single_blocks": ("single_blocks", "single_transformer_blocks"),
    "text": ("txt_in.weight", "context_embedder.weight"),
    "pooled": ("vector_in.in_layer.weight", "time_text_embed.text_embedder.linear_1.weight"),
    "guidance": ("guidance_in.in_layer.weight", "time_text_embed.guidance_embedder.linear_1.weight"),
}


def architecture(keys: dict, layout: str) -> dict:
    """FluxTransformer2DModel config from a header in the "original" or "diffusers" key layout (keys without
    prefix)."""
    names = layout_keys(ARCHITECTURE_KEYS, layout)
    hidden, in_features = shape_of(keys, names["embed"])
    head_dim = shape_of(keys, names["head_norm"])[0]
    _check_width(hidden, head_dim, shape_of(keys, names["mlp"])[0])
    if layout == "original" and count_blocks(keys, "single_blocks"):  # fused qkv + MLP rows
        rows = shape_of(keys, "single_blocks.0.linear1.weight")[0]
        if rows != (3 + MLP_RATIO) * hidden:
            raise ValueError(f"Flux single blocks have {rows} fused rows; {(3 + MLP_RATIO) * hidden} expected for "
                             f"width {hidden}: unsupported variant")
    return {
        "patch_size": 1,
        "in_channels": in_features,
        "out_channels": shape_of(keys, names["out"])[0],
        "num_layers": count_blocks(keys, names["double_blocks"]),
        "num_single_layers": count_blocks(keys, names["single_blocks"]),
        "attention_head_dim": head_dim,
        "num_attention_heads": hidden // head_dim,
        "joint_attention_dim": shape_of(keys, names["text"])[1],
        "pooled_projection_dim": shape_of(keys, names["pooled"])[1],
        "guidance_embeds": names["guidance"] in keys,
        "axes_dims_rope": rope_axes(head_dim),
    }


def _check_width(hidden: int, head_dim: int, mlp_rows: int) -> None:
    if hidden % head_dim:
        raise ValueError(f"Flux width {hidden} is not a multiple of its head size {head_dim}")
    if mlp_rows != MLP_RATIO * hidden:
        raise ValueError(f"Flux MLP width {mlp_rows} is not {MLP_RATIO} x {hidden}: unsupported variant")


# ---------------------------------------------------------------------------------------------------------------
# Key conversion (original -> diffusers), one source tensor at a time

_TOP = {
    "time_in.in_layer": "time_text_embed.timestep_embedder.linear_1",
    "time_in.out_layer": "time_text_embed.timestep_embedder.linear_2",
    "vector_in.in_layer": "time_text_embed.text_embedder.linear_1",
    "vector_in.out_layer": "time_text_embed.text_embedder.linear_2",
    "guidance_in.in_layer": "time_text_embed.guidance_embedder.linear_1",
    "guidance_in.out_layer": "time_text_embed.guidance_embedder.linear_2",
    "txt_in": "context_embedder",
    "img_in": "x_embedder",
    "final_layer.linear": "proj_out",
}
_DOUBLE = {
    "img_mod.lin": "norm1.linear", "txt_mod.lin": "norm1_context.linear",
    "img_attn.proj": "attn.to_out.0", "txt_attn.proj": "attn.to_add_out",
    "img_mlp.0": "ff.net.0.proj", "img_mlp.2": "ff.net.2", "txt_mlp.0": "ff_context.net.0.proj",
    "txt_mlp.2": "ff_context.net.2",
    "img_attn.norm.query_norm": "attn.norm_q", "img_attn.norm.key_norm": "attn.norm_k",
    "txt_attn.norm.query_norm": "attn.norm_added_q", "txt_attn.norm.key_norm": "attn.norm_added_k",
}
_DOUBLE_FUSED = {"img_attn.qkv": ("attn.to_q", "attn.to_k", "attn.to_v"),
                 "txt_attn.qkv": ("attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj")}
_SINGLE = {"modulation.lin": "norm.linear", "linear2": "proj_out",
           "norm.query_norm": "attn.norm_q", "norm.key_norm": "attn.norm_k"}
_SINGLE_FUSED = ("attn.to_q", "attn.to_k", "attn.to_v", "proj_mlp")


def weight_plan(detection: Detection, keys: Iterable[str]) -> Optional[KeyPlan]:
    """How a checkpoint's keys (prefix stripped) become parameters, for load_model and for LoRA's re-reading of
    base weights: original-layout files through original_plan, diffusers layouts as they are (None)."""
    return original_plan(keys, detection.config) if detection.layout == "original" else None


def original_plan(keys: Iterable[str], config) -> KeyPlan:
    """Original (BFL / ComfyUI) key names -> parameters of the model of `config` (LoRAs use these names too)."""
    return flux_key_plan(keys, config["num_attention_heads"] * config["attention_head_dim"])


def flux_key_plan(keys: Iterable[str], hidden: int) -> dict[str, list[tuple[str, Transform]]]:
    """Original-layout key (no prefix) -> [(diffusers key, transform)] for every key of a Flux.1 checkpoint.

    Keys it does not know are left out (load_weights reports them).
    """
    plan = {}
    for key in keys:
        module, _, kind = key.rpartition(".")  # marker tensors without a dot (scaled_fp8) map to nothing
        kind = "weight" if kind == "scale" else kind
        targets = _convert(module, kind, hidden)
        if targets:
            plan[key] = targets
    return plan


def _convert(module: str, kind: str, hidden: int) -> list[tuple[str, Transform]]:
    if module in _TOP:
        return [(f"{_TOP[module]}.{kind}", None)]
    if module == "final_layer.adaLN_modulation.1":  # (shift, scale) -> diffusers' (scale, shift)
        return [(f"norm_out.linear.{kind}", swap_halves)]
    stem, _, rest = module.partition(".")
    index, _, inner = rest.partition(".")
    if not index.isdigit():
        return []
    if stem == "double_blocks":
        prefix = f"transformer_blocks.{index}."
        if inner in _DOUBLE:
            return [(f"{prefix}{_DOUBLE[inner]}.{kind}", None)]
        if inner in _DOUBLE_FUSED:
            return row_split(prefix, _DOUBLE_FUSED[inner], kind, (hidden,) * 3)
    if stem == "single_blocks":
        prefix = f"single_transformer_blocks.{index}."
        if inner in _SINGLE:
            return [(f"{prefix}{_SINGLE[inner]}.{kind}", None)]
        if inner == "linear1":
            return row_split(prefix, _SINGLE_FUSED, kind, (hidden,) * 3 + (MLP_RATIO * hidden,))
    return []


# ---------------------------------------------------------------------------------------------------------------
# Loading

def load_model(path: str, dtype: str = "default", device: torch.device | str = "cpu",
               detection: Optional[Detection] = None, options: Optional[dict] = None,
               progress: Optional[ProgressFn] = None, header: Optional[Header] = None
               ) -> tuple[torch.nn.Module, Detection, WeightDtypes]:
    """A diffusers FluxTransformer2DModel with the checkpoint's weights (stock attention processors)."""
    from diffusers import FluxTransformer2DModel

    header, detection = detected_checkpoint(path, header, detection, detect, FAMILY, "Flux.1")
    config = dict(detection.config)
    if options and "axes_dims_rope" in options:
        config["axes_dims_rope"] = tuple(options["axes_dims_rope"])
    plan = weight_plan(detection, strip_prefix(header.tensors, detection.prefix))
    model, dtypes = load_checkpoint_model(FluxTransformer2DModel, config,
                                          header, detection, dtype, device, plan, progress)
    return model, detection, dtypes


def load(request: LoadRequest, detection: Detection, device: torch.device, groups, progress: ProgressFn
         ) -> PlanWorker:
    """The pool's entry point: load on this worker's device and switch attention to sequence parallel."""
    model, detection, dtypes = load_model(request.path, request.dtype, device, detection, request.options, progress,
                                          request.header)
    return worker_from_model(model, detection, dtypes, request.options)


def worker_from_model(model, detection: Detection, dtypes: WeightDtypes, options: Optional[dict] = None
                      ) -> PlanWorker:
    """The worker around a built model (load(), synthetic models): the executor running PLAN."""
    return PlanWorker(model, model_info(model, detection, dtypes), PLAN, dtypes, options)


def model_info(model, detection: Detection, dtypes: WeightDtypes) -> ModelInfo:
    config = model.config
    return ModelInfo(family=FAMILY, variant=detection.variant, in_channels=config.in_channels // (PATCH * PATCH),
                     out_channels=model.proj_out.out_features // (PATCH * PATCH), x_ndim=4,
                     config=config_entries(config, CONFIG_KEYS),
                     weight_dtype=dtypes.storage_name, compute_dtype=dtypes.compute_name)


# ---------------------------------------------------------------------------------------------------------------
# Sequence-parallel plan: the image latents (output, then references) split, the text replicated and joined in every
# block's attention (double blocks through the added projections, single blocks as the first tokens)

def check(call) -> None:
    inputs, x = call.inputs, call.x
    if inputs.get("attention_mask") is not None:
        raise ValueError("attention_mask (regional prompting) is not supported by the sequence-parallel Flux")
    if inputs.get("control") is not None:
        raise ValueError("ControlNet inputs are not supported by the sequence-parallel Flux")
    channels = call.config.in_channels // (PATCH * PATCH)
    if x.dim() != 4 or x.shape[1] != channels:
        raise ValueError(f"x has shape {tuple(x.shape)}; this Flux takes [B, {channels}, H, W]")
    for number, ref in enumerate(as_list(inputs.get("ref_latents"))):
        if ref.dim() != 4 or ref.shape[1] != channels:
            raise ValueError(f"ref_latents[{number}] has shape {tuple(ref.shape)}; expected [B, {channels}, h, w]")
    context = inputs.get("context")
    if context is None or context.dim() != 3:
        raise ValueError("Flux needs context [batch, text tokens, features] (the T5 output)")


def image_and_text(call, patch: int, placements, default_method: str, text_ids, id_dtype) -> list[Stream]:
    """The output latent and its references (split), then the text (replicated); placements(method, x_hw, refs_hw)
    places the references (the call's method, else the load option's, else default_method), text_ids(length,
    device) gives the text's position ids."""
    refs = as_list(call.inputs.get("ref_latents"))
    method = (call.inputs.get("ref_latents_method") or call.options.get("ref_latents_method")
              or default_method)
    found = placements(method, tuple(call.x.shape[-2:]), [r.shape[-2:] for r in refs])
    latents = [call.input("x")] + [call.ctx.to_device(f"ref_latents.{n}", ref, call.dtype)
                                   for n, ref in enumerate(refs)]
    axes = len(call.config.axes_dims_rope)
    image = image_parts(latents, [(0, 0, 0), *found], patch, False, id_dtype, axes, "x_embedder",
                        rope_options=call.inputs.get("rope_options"))
    text = call.input("context")
    return [Stream("image", image), text_stream(text, text_ids(text.shape[1], call.device), "context_embedder")]


def layout(call) -> list[Stream]:
    """ComfyUI's Flux ids: images in the latent's dtype, text at 0."""
    return image_and_text(call, PATCH, placements, "offset", text_ids, call.x.dtype)


def placements(method: str, x_hw, refs_hw) -> list[tuple[int, int, int]]:
    return reference_placements(method, tuple(x_hw), list(refs_hw), PATCH, REF_METHODS)


def text_ids(length: int, device) -> torch.Tensor:
    return torch.zeros(length, 3, device=device)


def condition(call) -> None:
    """The time / guidance / pooled-text embedding; ComfyUI leaves the guidance term out when none is given."""
    config, embed = call.config, call.model.time_text_embed
    sigma, guidance = call.sigma() * 1000, call.inputs.get("guidance")
    pooled = _pooled(call.inputs.get("y"), config.pooled_projection_dim, call)
    if config.guidance_embeds and guidance is not None:  # the guidance arrives in the model's dtype
        guidance = per_item(call.ctx.to_device("guidance", guidance.reshape(-1), call.dtype), call.batch)
        call.temb = embed(sigma, guidance * 1000, pooled)
    elif config.guidance_embeds:
        call.temb = embed.timestep_embedder(embed.time_proj(sigma).to(pooled.dtype)) + embed.text_embedder(pooled)
    else:
        call.temb = embed(sigma, pooled)


def joint_block(block, call) -> None:
    call.text, call.image = block(hidden_states=call.image, encoder_hidden_states=call.text, temb=call.temb)


PLAN = Plan(check=check, layout=layout, rope=lambda config: (config.axes_dims_rope, ROPE_THETA), condition=condition,
            stages=(Stage("transformer_blocks", joint_block),
                    Stage("single_transformer_blocks", joint_block, attention=AttentionSpec(text_prefix=True))),
            head=lambda call: call.model.proj_out(call.model.norm_out(call.image, call.temb)))


def per_item(values: torch.Tensor, batch: int) -> torch.Tensor:
    return values.expand(batch) if values.numel() == 1 else values


def _pooled(y, width: int, call) -> torch.Tensor:
    """ComfyUI's y (CLIP pooled output), cut to the model's width; zeros when absent, as ComfyUI does."""
    if y is None:
        return torch.zeros(call.batch, width, device=call.device, dtype=call.dtype)
    y = call.ctx.to_device("y", y, call.dtype)[:, :width]
    return y.expand(call.batch, -1) if y.shape[0] == 1 else y


# ---------------------------------------------------------------------------------------------------------------
# Single-process reference (tests, demo, benchmarks): diffusers' stock forward and processors, ComfyUI's packing

def reference_forward(model_or_path, x: torch.Tensor, timestep: torch.Tensor, context: torch.Tensor,
                      y: Optional[torch.Tensor] = None, guidance: Optional[torch.Tensor] = None, ref_latents=None,
                      ref_latents_method: Optional[str] = None, dtype: str = "default", **_ignored) -> torch.Tensor:
    """ComfyUI's Flux diffusion_model(...) computed by diffusers' own forward on one process."""
    model = model_or_path
    if not isinstance(model, torch.nn.Module):
        model = load_model(model_or_path, dtype)[0]
    compute, device = model.proj_out.weight.dtype, model.proj_out.weight.device
    batch, _, height, width = x.shape
    refs = as_list(ref_latents)
    placements = [(0, 0, 0)] + reference_placements(ref_latents_method or "offset", (height, width),
                                                    [r.shape[-2:] for r in refs], PATCH, REF_METHODS)
    packed, ids = [], []
    for part, (index, row_offset, col_offset) in zip([x, *refs], placements):
        tokens, grid = reference_pack(part.expand(batch, *part.shape[1:]).to(device, compute), PATCH)
        packed.append(tokens)
        ids.append(grid_ids(grid, index, row_offset, col_offset, False, x.dtype, device))
    if model.config.guidance_embeds and guidance is None:
        raise ValueError("diffusers' Flux with guidance embedding needs guidance (ComfyUI passes 3.5 by default)")
    pooled = torch.zeros(batch, model.config.pooled_projection_dim) if y is None else y[:, :model.config.
                                                                                       pooled_projection_dim]
    guidance = None if not model.config.guidance_embeds else guidance.reshape(-1).expand(batch).to(device, compute)
    with torch.no_grad():
        tokens = model(hidden_states=torch.cat(packed, dim=1), encoder_hidden_states=context.to(device, compute),
                       pooled_projections=pooled.expand(batch, -1).to(device, compute),
                       timestep=timestep.reshape(-1).expand(batch).to(device), img_ids=torch.cat(ids),
                       txt_ids=torch.zeros(context.shape[1], 3, device=device), guidance=guidance,
                       return_dict=False)[0]
    grid = TokenGrid.of(height, width, PATCH)
    return reference_unpack(tokens[:, :grid.count], grid).to(x.dtype).cpu()
