"""Flux.2 (dev, klein) under Ulysses SP: detection from the header, loading into diffusers' Flux2Transformer2DModel,
and ComfyUI's `diffusion_model(x, timestep, context, guidance, ref_latents)` (ComfyUI's Flux class with Flux.2
params: unpatched 128-channel latents, 4-axis rotary with theta 2000, text positions on the fourth axis, references
at index 10, 20, ...).

PLAN is flux.PLAN with its differences (dataclasses.replace): image tokens (target, then references) are split
over the ranks, text is replicated and each rank attends with its heads of it; double blocks then fused single
blocks. Original (BFL / ComfyUI) key names go through diffusers' own converter one tensor at a time (every rule
of convert_flux2_transformer_checkpoint_to_diffusers looks at one key and splits by thirds, so it is
width-independent and streams).
"""
from __future__ import annotations

from dataclasses import replace
from typing import Iterable, Optional

import torch

from ..sp import AttentionSpec, PlanWorker, Stage
from ..sp.tokens import TokenGrid, as_list, grid_ids, reference_placements
from . import flux
from ..contract import ComfyHost, Detection, HostHooks, LoadRequest, ModelInfo, config_entries
from ..checkpoints.loading import (KeyPlan, ProgressFn, WeightDtypes, count_blocks, detected_checkpoint, find_prefix,
                                   layout_keys, load_checkpoint_model, shape_of, strip_prefix)
from ..checkpoints.header import Header, header_config

FAMILY = "flux2"
DESCRIPTION = "Flux.2 (dev, klein)"


def _comfy_unet_config(info: ModelInfo) -> dict:
    return {"image_model": "flux2", "in_channels": info.in_channels, "out_channels": info.out_channels,
            "patch_size": PATCH}


COMFY = ComfyHost(model_classes={"": "Flux2"}, unet_config=_comfy_unet_config,
                  attributes=lambda info: {"patch_size": PATCH}, hooks=HostHooks(rope_options="applied"))
PATCH = 1                  # ComfyUI's Flux.2 takes its 128-channel latents unpatched
ROPE_THETA = 2000
REF_INDEX_SCALE = 10       # ComfyUI's ref_index_scale: reference i sits at index 10 * (i + 1)
REF_METHODS = ("index", "uxo")  # others ("offset") place references side by side at index 1
DEFAULT_REF_METHOD = "index"
ORIGINAL_ANCHORS = ("double_stream_modulation_img.lin.weight", "img_in.weight", "txt_in.weight",
                    "time_in.in_layer.weight", "double_blocks.0.img_attn.norm.key_norm.scale",
                    "final_layer.linear.weight")
DIFFUSERS_ANCHORS = ("double_stream_modulation_img.linear.weight", "x_embedder.weight", "context_embedder.weight",
                     "transformer_blocks.0.attn.norm_k.weight", "proj_out.weight")
CLASS_NAME = "Flux2Transformer2DModel"
CONFIG_KEYS = ("patch_size", "in_channels", "out_channels", "num_layers", "num_single_layers", "attention_head_dim",
               "num_attention_heads", "joint_attention_dim", "mlp_ratio", "axes_dims_rope", "rope_theta",
               "guidance_embeds")
# Flux2Transformer2DModel arguments a diffusers folder's config.json may set away from the released value (the
# original layout's files fix them at diffusers' defaults)
FOLDER_ONLY_KEYS = ("timestep_guidance_channels", "eps")
# Where a header shows each architecture fact: (original key, diffusers key), prefix stripped
ARCHITECTURE_KEYS = {
    "embed": ("img_in.weight", "x_embedder.weight"),
    "head_norm": ("double_blocks.0.img_attn.norm.key_norm.scale", "transformer_blocks.0.attn.norm_k.weight"),
    "mlp": ("double_blocks.0.img_mlp.0.weight", "transformer_blocks.0.ff.linear_in.weight"),
    "out": ("final_layer.linear.weight", "proj_out.weight"),
    "double_blocks": ("double_blocks", "transformer_blocks"),
    "single_blocks": ("single_blocks", "single_transformer_blocks"),
    "text": ("txt_in.weight", "context_embedder.weight"),
    "guidance": ("guidance_in.in_layer.weight", "time_guidance_embed.guidance_embedder.linear_1.weight"),
}


# ---------------------------------------------------------------------------------------------------------------
# Detection

def detect(header: Header) -> Optional[Detection]:
    """Flux.2 from its header alone (no weights read); None when the file is another family."""
    folder_config = header_config(header)
    if folder_config is not None:
        if folder_config.get("_class_name") != CLASS_NAME:
            return None
        config = {key: folder_config[key] for key in CONFIG_KEYS + FOLDER_ONLY_KEYS if key in folder_config}
        config["axes_dims_rope"] = tuple(config.get("axes_dims_rope", (32, 32, 32, 32)))
        config["out_channels"] = config.get("out_channels") or config["in_channels"]
        return _detection(header, "diffusers", "", config)
    for layout, anchors in (("original", ORIGINAL_ANCHORS), ("diffusers", DIFFUSERS_ANCHORS)):
        prefix = find_prefix(header.tensors, anchors)
        if prefix is not None:
            return _detection(header, layout, prefix, architecture(strip_prefix(header.tensors, prefix), layout))
    return None


def _detection(header: Header, layout: str, prefix: str, config: dict) -> Detection:
    variant = "dev" if config.get("guidance_embeds", True) else "klein"
    return Detection(family=FAMILY, variant=variant, layout=layout, prefix=prefix, config=config,
                     files=header.source.files)


def architecture(keys: dict, layout: str) -> dict:
    """Flux2Transformer2DModel config from a header in the "original" or "diffusers" key layout."""
    names = layout_keys(ARCHITECTURE_KEYS, layout)
    hidden, in_channels = shape_of(keys, names["embed"])
    head_dim = shape_of(keys, names["head_norm"])[0]
    if hidden % head_dim or head_dim % 8:
        raise ValueError(f"Flux.2 width {hidden} / head size {head_dim} do not fit a 4-axis rotary embedding")
    mlp_rows = shape_of(keys, names["mlp"])[0]  # SwiGLU: gate and value rows
    return {
        "patch_size": 1,
        "in_channels": in_channels,
        "out_channels": shape_of(keys, names["out"])[0],
        "num_layers": count_blocks(keys, names["double_blocks"]),
        "num_single_layers": count_blocks(keys, names["single_blocks"]),
        "attention_head_dim": head_dim,
        "num_attention_heads": hidden // head_dim,
        "joint_attention_dim": shape_of(keys, names["text"])[1],
        "mlp_ratio": mlp_rows / (2 * hidden),
        "axes_dims_rope": (head_dim // 4,) * 4,  # (32, 32, 32, 32) at the real head size 128
        "rope_theta": ROPE_THETA,
        "guidance_embeds": names["guidance"] in keys,
    }


# ---------------------------------------------------------------------------------------------------------------
# Key plan: diffusers' converter, asked one key at a time

def weight_plan(detection: Detection, keys: Iterable[str]) -> Optional[KeyPlan]:
    """Original-layout files through original_plan, diffusers layouts as they are (None)."""
    return original_plan(keys, detection.config) if detection.layout == "original" else None


def original_plan(keys: Iterable[str], config=None) -> KeyPlan:
    """Original key -> [(diffusers key, transform)], each transform diffusers' converter applied to that tensor.

    The names come from converting a 6-row meta tensor (fused qkv splits in thirds, the final modulation in
    halves), so planning reads no weights."""
    plan = {}
    for key in keys:
        names = list(_convert({key: torch.empty(6, device="meta")}))
        plan[key] = [(name, _converted(key, name)) for name in names]
    return plan


def _convert(state: dict) -> dict:
    from diffusers.loaders.single_file_utils import convert_flux2_transformer_checkpoint_to_diffusers
    return convert_flux2_transformer_checkpoint_to_diffusers(state)


def _converted(key: str, name: str):
    return lambda tensor: _convert({key: tensor})[name]


# ---------------------------------------------------------------------------------------------------------------
# Loading

def load_model(path: str, dtype: str = "default", device: torch.device | str = "cpu",
               detection: Optional[Detection] = None, options: Optional[dict] = None,
               progress: Optional[ProgressFn] = None, header: Optional[Header] = None
               ) -> tuple[torch.nn.Module, Detection, WeightDtypes]:
    """A diffusers Flux2Transformer2DModel with the checkpoint's weights (stock attention processors)."""
    from diffusers import Flux2Transformer2DModel

    header, detection = detected_checkpoint(path, header, detection, detect, FAMILY, "Flux.2")
    plan = weight_plan(detection, strip_prefix(header.tensors, detection.prefix))
    model, dtypes = load_checkpoint_model(Flux2Transformer2DModel, detection.config,
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
    config = model.config
    info = ModelInfo(family=FAMILY, variant=detection.variant, in_channels=config.in_channels,
                     out_channels=model.out_channels, x_ndim=4, config=config_entries(config, CONFIG_KEYS),
                     weight_dtype=dtypes.storage_name, compute_dtype=dtypes.compute_name)
    return PlanWorker(model, info, PLAN, dtypes, options)


# ---------------------------------------------------------------------------------------------------------------
# Sequence-parallel plan: Flux.1's, with these differences: unpatched latents, a fourth rotary axis (the text
# position), shared modulations, and single blocks that take [text, image] as one sequence with a fused
# attention + MLP projection

def placements(method: str, x_hw, refs_hw) -> list[tuple[int, int, int]]:
    """ComfyUI's Flux.2 reference placement: "index" steps the index by 10 per reference."""
    found = reference_placements(method, tuple(x_hw), list(refs_hw), PATCH, REF_METHODS)
    return [(index * REF_INDEX_SCALE if method == "index" else index, row, col) for index, row, col in found]


def text_ids(length: int, device) -> torch.Tensor:
    """ComfyUI's Flux.2 text positions: 0 on the first three axes, the token index on the fourth."""
    ids = torch.zeros(length, 4, device=device)
    ids[:, 3] = torch.arange(length, device=device, dtype=torch.float32)
    return ids


def check(call) -> None:
    config, x, inputs = call.config, call.x, call.inputs
    if inputs.get("attention_mask") is not None:
        raise ValueError("attention_mask is not supported by the sequence-parallel Flux.2 (ComfyUI's Flux.2 text "
                         "encoders pass none; regional prompting masks would need the joint mask)")
    if inputs.get("control") is not None:
        raise ValueError("ControlNet inputs are not supported by the sequence-parallel Flux.2")
    if x.dim() != 4 or x.shape[1] != config.in_channels:
        raise ValueError(f"x has shape {tuple(x.shape)}; this Flux.2 takes [B, {config.in_channels}, H, W]")
    for number, ref in enumerate(as_list(inputs.get("ref_latents"))):
        if ref.dim() != 4 or ref.shape[1] != config.in_channels:
            raise ValueError(f"ref_latents[{number}] has shape {tuple(ref.shape)}; expected [B, "
                             f"{config.in_channels}, h, w]")
    context = inputs.get("context")
    if context is None or context.dim() != 3 or context.shape[-1] != config.joint_attention_dim:
        raise ValueError(f"Flux.2 needs context [batch, text tokens, {config.joint_attention_dim}] (the text "
                         f"encoder output)")


def condition(call) -> None:
    """Time (+ guidance, when the model has it and the call gives it) embedding and the shared modulations."""
    model, embed, guidance = call.model, call.model.time_guidance_embed, call.inputs.get("guidance")
    temb = embed.timestep_embedder(embed.time_proj(call.sigma() * 1000).to(call.dtype))
    if call.config.guidance_embeds and guidance is not None:  # klein has no guidance embedding
        guidance = flux.per_item(call.ctx.to_device("guidance", guidance.reshape(-1), call.dtype), call.batch)
        temb = temb + embed.guidance_embedder(embed.time_proj(guidance * 1000).to(call.dtype))
    call.temb = temb
    call.mod_img, call.mod_txt = model.double_stream_modulation_img(temb), model.double_stream_modulation_txt(temb)
    call.mod_single = model.single_stream_modulation(temb)


def double_block(block, call) -> None:
    call.text, call.image = block(hidden_states=call.image, encoder_hidden_states=call.text,
                                  temb_mod_img=call.mod_img, temb_mod_txt=call.mod_txt)


def single_block(block, call) -> None:
    call.image = block(hidden_states=call.image, encoder_hidden_states=None, temb_mod=call.mod_single)


def join_text(call) -> None:
    call.image = torch.cat([call.text, call.image], dim=1)


def project_fused(attn, hidden: torch.Tensor):
    fused = attn.to_qkv_mlp_proj(hidden)
    qkv, mlp = fused.split([3 * attn.inner_dim, fused.shape[-1] - 3 * attn.inner_dim], dim=-1)
    query, key, value = (part.unflatten(-1, (-1, attn.head_dim)) for part in qkv.chunk(3, dim=-1))
    return [attn.norm_q(query), attn.norm_k(key), value], mlp


def finish_fused(attn, attended: torch.Tensor, mlp: torch.Tensor) -> torch.Tensor:
    return attn.to_out(torch.cat([attended, attn.mlp_act_fn(mlp)], dim=-1))


PLAN = replace(
    flux.PLAN, check=check, condition=condition,
    layout=lambda call: flux.image_and_text(call, PATCH, placements, DEFAULT_REF_METHOD, text_ids, torch.float32),
    rope=lambda config: (config.axes_dims_rope, config.rope_theta),
    stages=(Stage("transformer_blocks", double_block),
            Stage("single_transformer_blocks", single_block, before=join_text,
                  attention=AttentionSpec(project_fused, finish_fused, text_prefix=True))),
    head=lambda call: call.model.proj_out(call.model.norm_out(call.image[:, call.text.shape[1]:], call.temb)))


# ---------------------------------------------------------------------------------------------------------------
# Single-process reference (tests, demo): diffusers' stock forward and processors, ComfyUI's ids

def reference_forward(model_or_path, x: torch.Tensor, timestep: torch.Tensor, context: torch.Tensor,
                      guidance: Optional[torch.Tensor] = None, ref_latents=None,
                      ref_latents_method: Optional[str] = None, dtype: str = "default", **_ignored) -> torch.Tensor:
    """ComfyUI's Flux.2 diffusion_model(...) computed by diffusers' own forward on one process."""
    model = model_or_path
    if not isinstance(model, torch.nn.Module):
        model = load_model(model_or_path, dtype)[0]
    compute, device = model.proj_out.weight.dtype, model.proj_out.weight.device
    batch, _, height, width = x.shape
    refs = as_list(ref_latents)
    found = placements(ref_latents_method or DEFAULT_REF_METHOD, (height, width), [r.shape[-2:] for r in refs])
    packed, ids = [], []
    for part, (index, row_offset, col_offset) in zip([x, *refs], [(0, 0, 0), *found]):
        packed.append(part.expand(batch, *part.shape[1:]).flatten(2).transpose(1, 2).to(device, compute))
        grid = TokenGrid.of(part.shape[-2], part.shape[-1], PATCH)
        three = grid_ids(grid, index, row_offset, col_offset, False, torch.float32, device)
        ids.append(torch.cat([three, torch.zeros(len(three), 1, device=device)], dim=1))
    if not model.config.guidance_embeds:
        guidance = None
    with torch.no_grad():
        tokens = model(hidden_states=torch.cat(packed, dim=1), encoder_hidden_states=context.to(device, compute),
                       timestep=timestep.reshape(-1).expand(batch).to(device), img_ids=torch.cat(ids),
                       txt_ids=text_ids(context.shape[1], device),
                       guidance=None if guidance is None else guidance.reshape(-1).expand(batch).to(device, compute),
                       return_dict=False)[0]
    return tokens[:, :height * width].transpose(1, 2).reshape(x.shape).to(x.dtype).cpu()
