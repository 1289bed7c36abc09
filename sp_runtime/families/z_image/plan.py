"""Z-Image (base and turbo) under Ulysses SP: detection from the header, loading into diffusers'
ZImageTransformer2DModel, and ComfyUI's `diffusion_model(x, timestep, context, num_tokens, attention_mask)` (ComfyUI's
NextDiT in comfy/ldm/lumina with Z-Image's options: 32-token padding with learned pad tokens, theta 256, t = 1 - sigma,
output negated).

Two refiner stages run apart, then one single-stream stage: the caption (padded to 32 tokens with `cap_pad_token`)
through `context_refiner`, the image tokens (padded to 32 with `x_pad_token`) through `noise_refiner`, then both as
one sequence through `layers`. Each stream is split over the ranks on its own, so everything but attention is
token-local; the joint sequence is each rank's caption shard followed by its image shard, in rank order. No attention
is masked (ComfyUI attends the pad tokens too and reads no text mask), so that order changes nothing: each token
keeps its own rotary position. Ulysses pads heads to a multiple of the degree, so 30 heads work at any degree; Ring
and Ulysses x Ring apply as they are (no mask to honour).
"""
from __future__ import annotations

from typing import Iterable, Optional

import torch

from ..sp import Output, Part, Plan, PlanWorker, Stage, Stream
from ..sp.tokens import TokenGrid, pad_to_patch, patchify
from ..contract import ComfyHost, Detection, LoadRequest, ModelInfo, config_entries
from ..checkpoints.loading import (KeyPlan, ProgressFn, WeightDtypes, count_blocks, detected_checkpoint, find_prefix,
                                   load_checkpoint_model, row_split, shape_of, strip_prefix)
from ..checkpoints.header import Header, header_config

FAMILY = "z_image"
DESCRIPTION = "Z-Image (base, turbo)"


def _comfy_unet_config(info: ModelInfo) -> dict:
    return {"in_channels": info.in_channels}


COMFY = ComfyHost(model_classes={"": "ZImage"}, unet_config=_comfy_unet_config,
                  attributes=lambda info: {"patch_size": PATCH, "pad_tokens_multiple": PAD_MULTIPLE})
CLASS_NAME = "ZImageTransformer2DModel"
PATCH = 2
PAD_MULTIPLE = 32            # ComfyUI's pad_tokens_multiple, diffusers' SEQ_MULTI_OF
ROPE_THETA = 256.0
AXES_LENS = (1536, 512, 512)  # rotary table sizes of diffusers' model (ComfyUI computes the angles directly)
ANCHORS = ("cap_embedder.1.weight", "t_embedder.mlp.0.weight", "noise_refiner.0.adaLN_modulation.0.weight",
           "context_refiner.0.attention_norm1.weight", "layers.0.feed_forward.w1.weight")
PAD_TOKENS = ("x_pad_token", "cap_pad_token")
FUSED_QKV = ".attention.qkv.weight"     # ComfyUI's files: [q; k; v] rows in one tensor
UNUSED = ("norm_final.weight",)         # in some original files, used by neither ComfyUI nor diffusers
TOP_RENAMES = {"x_embedder.": "all_x_embedder.2-1.", "final_layer.": "all_final_layer.2-1."}
ATTENTION_RENAMES = {".attention.out.": ".attention.to_out.0.", ".attention.q_norm.": ".attention.norm_q.",
                     ".attention.k_norm.": ".attention.norm_k."}
CONFIG_KEYS = ("in_channels", "dim", "n_layers", "n_refiner_layers", "n_heads", "n_kv_heads", "cap_feat_dim",
               "rope_theta", "t_scale", "axes_dims", "axes_lens")
UNSUPPORTED_INPUTS = ("ref_latents", "ref_contexts", "siglip_feats", "direct_context", "ref_frames",
                      "clip_text_pooled")


# ---------------------------------------------------------------------------------------------------------------
# Detection

def detect(header: Header) -> Optional[Detection]:
    """Z-Image from its header alone (no weights read); None when the file is another family."""
    folder_config = header_config(header)
    if folder_config is not None and folder_config.get("_class_name") != CLASS_NAME:
        return None
    prefix = find_prefix(header.tensors, ANCHORS)
    if prefix is None:
        return None
    keys = strip_prefix(header.tensors, prefix)
    if any(key.startswith("siglip_") for key in keys) or (folder_config or {}).get("siglip_feat_dim"):
        raise ValueError(f"{header.path!r} is Z-Image Omni (SigLIP image features), which is not supported (Z-Image "
                         f"and Z-Image-Turbo load)")
    missing = [name for name in PAD_TOKENS if name not in keys]
    if missing:
        raise ValueError(f"{header.path!r} looks like Z-Image but has no {missing}: Z-Image pads its sequences with "
                         f"these learned tokens; the file is incomplete or another Lumina-type model")
    original = f"layers.0{FUSED_QKV}" in keys
    if folder_config:
        config = {key: folder_config[key] for key in CONFIG_KEYS if key in folder_config}
    else:
        config = architecture(keys, original)
    return Detection(family=FAMILY, variant="image", layout="original" if original else "diffusers", prefix=prefix,
                     config=config, files=header.source.files)


def architecture(keys: dict, original: bool) -> dict:
    """ZImageTransformer2DModel config from header shapes (keys without prefix)."""
    dim, cap_feat_dim = shape_of(keys, "cap_embedder.1.weight")
    head_dim = shape_of(keys, "layers.0.attention." + ("q_norm" if original else "norm_q") + ".weight")[0]
    if dim % head_dim:
        raise ValueError(f"Z-Image width {dim} is not a multiple of its head size {head_dim}")
    key_rows = (shape_of(keys, f"layers.0{FUSED_QKV}")[0] - dim) // 2 if original else \
        shape_of(keys, "layers.0.attention.to_k.weight")[0]
    if key_rows != dim:
        raise ValueError(f"Z-Image with grouped key / value heads ({key_rows // head_dim} for {dim // head_dim} "
                         f"query heads) is not supported")
    hidden = shape_of(keys, "layers.0.feed_forward.w1.weight")[0]
    if hidden != int(dim / 3 * 8):  # diffusers' class fixes it
        raise ValueError(f"Z-Image feed-forward width {hidden} is not 8/3 of its width {dim} as diffusers' "
                         f"ZImageTransformer2DModel builds it; this variant is not supported")
    patch_features = shape_of(keys, ("x_embedder" if original else "all_x_embedder.2-1") + ".weight")[1]
    return {
        "all_patch_size": (PATCH,),
        "all_f_patch_size": (1,),
        "in_channels": patch_features // (PATCH * PATCH),
        "dim": dim,
        "n_layers": count_blocks(keys, "layers"),
        "n_refiner_layers": count_blocks(keys, "noise_refiner"),
        "n_heads": dim // head_dim,
        "n_kv_heads": dim // head_dim,
        "cap_feat_dim": cap_feat_dim,
        "rope_theta": ROPE_THETA,
        "t_scale": 1000.0,
        "axes_dims": z_image_axes(head_dim),
        "axes_lens": AXES_LENS,
    }


def z_image_axes(head_dim: int) -> tuple[int, int, int]:
    """Rotary dims of the (sequence, row, column) axes: (32, 48, 48) at the real head size 128 (checkpoints do not
    store them); other head sizes keep the proportions 1/4, 3/8, 3/8 (ComfyUI's 64-wide variant: 16, 24, 24)."""
    if head_dim % 16:
        raise ValueError(f"Z-Image head size {head_dim} cannot carry its rotary axes (needs a multiple of 16)")
    return head_dim // 4, 3 * head_dim // 8, 3 * head_dim // 8


# ---------------------------------------------------------------------------------------------------------------
# Key plan: ComfyUI's names -> diffusers' (what diffusers' convert_z_image_transformer_checkpoint_to_diffusers does)

def weight_plan(detection: Detection, keys: Iterable[str]) -> Optional[KeyPlan]:
    """How a checkpoint's keys (prefix stripped) become parameters: ComfyUI files through original_plan, diffusers
    layouts as they are (None)."""
    return original_plan(keys, detection.config) if detection.layout == "original" else None


def original_plan(keys: Iterable[str], config) -> KeyPlan:
    """ComfyUI key names -> parameters (LoRAs use these names too); the fused qkv splits into to_q, to_k, to_v."""
    rows = config["dim"]
    plan = {}
    for key in keys:
        if key in UNUSED:
            continue
        if key.endswith(FUSED_QKV):
            plan[key] = row_split(key[:-len("qkv.weight")], ("to_q", "to_k", "to_v"), "weight", (rows,) * 3)
            continue
        target = key
        for old, new in TOP_RENAMES.items():
            if target.startswith(old):
                target = new + target[len(old):]
        for old, new in ATTENTION_RENAMES.items():
            target = target.replace(old, new)
        plan[key] = [(target, None)]
    return plan


# ---------------------------------------------------------------------------------------------------------------
# Loading

def load_model(path: str, dtype: str = "default", device: torch.device | str = "cpu",
               detection: Optional[Detection] = None, options: Optional[dict] = None,
               progress: Optional[ProgressFn] = None, header: Optional[Header] = None
               ) -> tuple[torch.nn.Module, Detection, WeightDtypes]:
    """A diffusers ZImageTransformer2DModel with the checkpoint's weights (stock attention processors)."""
    from diffusers import ZImageTransformer2DModel

    header, detection = detected_checkpoint(path, header, detection, detect, FAMILY, "Z-Image")
    plan = weight_plan(detection, strip_prefix(header.tensors, detection.prefix))
    model, dtypes = load_checkpoint_model(ZImageTransformer2DModel, detection.config, header, detection, dtype,
                                          device, plan, progress, ignore=UNUSED)
    return model, detection, dtypes


def load(request: LoadRequest, detection: Detection, device: torch.device, groups, progress: ProgressFn
         ) -> PlanWorker:
    """The pool's entry point: load on this worker's device, the executor running PLAN."""
    model, detection, dtypes = load_model(request.path, request.dtype, device, detection, request.options, progress,
                                          request.header)
    config = model.config
    info = ModelInfo(family=FAMILY, variant=detection.variant, in_channels=config.in_channels,
                     out_channels=config.in_channels, x_ndim=4, config=config_entries(config, CONFIG_KEYS),
                     weight_dtype=dtypes.storage_name, compute_dtype=dtypes.compute_name)
    return PlanWorker(model, info, PLAN, dtypes)


# ---------------------------------------------------------------------------------------------------------------
# Sequence-parallel plan: caption and image are two split streams, each padded to PAD_MULTIPLE with learned pad
# tokens; the refiners attend within one stream, the main layers over their union (each rank's caption shard, then
# its image shard)

def check(call) -> None:
    config, x, inputs = call.config, call.x, call.inputs
    for name in UNSUPPORTED_INPUTS:
        value = inputs.get(name)
        if value is not None and not (isinstance(value, (list, tuple)) and len(value) == 0):  # ComfyUI's default []
            raise ValueError(f"{name} (Z-Image Omni / Ming-Image / NewBie inputs) is not supported by the "
                             f"sequence-parallel Z-Image")
    if x.dim() != 4 or x.shape[1] != config.in_channels:
        raise ValueError(f"x has shape {tuple(x.shape)}; Z-Image takes [B, {config.in_channels}, H, W]")
    context = inputs.get("context")
    if context is None or context.dim() != 3 or context.shape[-1] != config.cap_feat_dim or \
            context.shape[0] not in (1, x.shape[0]):
        raise ValueError(f"Z-Image needs context [batch, text tokens, {config.cap_feat_dim}] (the text encoder "
                         f"output); got {None if context is None else tuple(context.shape)}")
    # attention_mask and num_tokens are read past, as ComfyUI's NextDiT does: it attends every context token


def layout(call) -> list[Stream]:
    """Caption ids (1 + i, 0, 0), pads included; image ids (caption_total + 1, row, col), pads (0, 0, 0); image
    patches in ComfyUI's (row, col, channel) feature order."""
    context, x = call.input("context"), call.input("x")
    caption_total = _padded(context.shape[1])
    caption_ids = torch.zeros(caption_total, 3)
    caption_ids[:, 0] = torch.arange(caption_total) + 1
    grid = TokenGrid.of(x.shape[-2], x.shape[-1], PATCH)
    tokens = patchify(pad_to_patch(x, PATCH), PATCH).unflatten(-1, (x.shape[1], PATCH, PATCH))
    image_ids = torch.zeros(_padded(grid.count), 3)
    image_ids[:grid.count, 0] = caption_total + 1
    image_ids[:grid.count, 1] = (torch.arange(grid.count) // grid.cols).float()
    image_ids[:grid.count, 2] = (torch.arange(grid.count) % grid.cols).float()
    caption = [Part(context, caption_ids[:context.shape[1]], "cap_embedder"),
               _pads(caption_ids[context.shape[1]:], _caption_pad, call.dtype)]
    image = [Part(tokens.permute(0, 1, 3, 4, 2).flatten(2), image_ids[:grid.count], _embed_image, Output(grid)),
             _pads(image_ids[grid.count:], _image_pad, call.dtype)]
    return [Stream("caption", caption), Stream("image", image)]


def _padded(count: int) -> int:
    return -(-count // PAD_MULTIPLE) * PAD_MULTIPLE


def _pads(ids: torch.Tensor, embed, dtype) -> Part:
    return Part(torch.zeros(1, ids.shape[0], 0, dtype=dtype), ids, embed)


def _caption_pad(model, raw: torch.Tensor) -> torch.Tensor:
    return model.cap_pad_token.to(raw.dtype).expand(raw.shape[0], raw.shape[1], -1)


def _image_pad(model, raw: torch.Tensor) -> torch.Tensor:
    return model.x_pad_token.to(raw.dtype).expand(raw.shape[0], raw.shape[1], -1)


def _embed_image(model, raw: torch.Tensor) -> torch.Tensor:
    return model.all_x_embedder[f"{PATCH}-1"](raw)


def condition(call) -> None:
    """ComfyUI's t_embedder((1 - sigma) * 1000): sinusoids in float32, cast to the compute dtype, then the MLP."""
    embedder = call.model.t_embedder
    frequencies = embedder.timestep_embedding((1 - call.sigma()) * call.config.t_scale,
                                              embedder.frequency_embedding_size)
    call.adaln = embedder.mlp(frequencies.to(call.dtype))


def join(call) -> None:
    call.joint = torch.cat([call.caption, call.image], dim=1)


def output_tokens(call, tokens: torch.Tensor) -> torch.Tensor:
    """(ph, pw, c) features -> (c, ph, pw), negated as ComfyUI's NextDiT returns."""
    return -tokens.unflatten(-1, (PATCH, PATCH, call.x.shape[1])).permute(0, 1, 4, 2, 3).flatten(2)


def _caption_block(block, call) -> None:
    call.caption = block(call.caption, None, None)


def _image_block(block, call) -> None:
    call.image = block(call.image, None, None, call.adaln)


def _joint_block(block, call) -> None:
    call.joint = block(call.joint, None, None, call.adaln)


PLAN = Plan(check=check, layout=layout, rope=lambda config: (config.axes_dims, config.rope_theta),
            condition=condition,
            stages=(Stage("context_refiner", _caption_block, attends="caption", text=None),
                    Stage("noise_refiner", _image_block, attends="image", text=None),
                    Stage("layers", _joint_block, attends=("caption", "image"), text=None, before=join)),
            head=lambda call: call.model.all_final_layer[f"{PATCH}-1"](call.joint[:, call.caption.shape[1]:],
                                                                       c=call.adaln),
            output_tokens=output_tokens)


# ---------------------------------------------------------------------------------------------------------------
# Single-process reference (tests): diffusers' stock forward, fed ComfyUI's call in its own convention

def reference_forward(model_or_path, x: torch.Tensor, timestep: torch.Tensor, context: torch.Tensor,
                      dtype: str = "default", **_ignored) -> torch.Tensor:
    """ComfyUI's Z-Image diffusion_model(...) computed by diffusers' own forward on one process: per-item lists,
    t = 1 - sigma, the latent padded to the patch by wrap-around (ComfyUI's circular padding), output negated."""
    model = model_or_path
    if not isinstance(model, torch.nn.Module):
        model = load_model(model_or_path, dtype)[0]
    weight = model.all_x_embedder[f"{PATCH}-1"].weight
    compute, device = weight.dtype, weight.device
    height, width = x.shape[-2:]
    padded = torch.cat([x, x[:, :, :height % PATCH]], dim=2)
    padded = torch.cat([padded, padded[:, :, :, :width % PATCH]], dim=3)
    context = context.expand(x.shape[0], -1, -1)
    sigma = timestep.reshape(-1).expand(x.shape[0]).float()
    with torch.no_grad():
        outputs = model([item[:, None].to(device, compute) for item in padded], (1 - sigma).to(device),
                        [item.to(device, compute) for item in context], return_dict=False)[0]
    return -torch.stack(outputs)[:, :, 0, :height, :width].to(x.dtype).cpu()
