"""Flux.2 (dev, klein) under Ulysses SP: detection from the header, loading into diffusers' Flux2Transformer2DModel,
and ComfyUI's `diffusion_model(x, timestep, context, guidance, ref_latents)` (ComfyUI's Flux class with Flux.2
params: unpatched 128-channel latents, 4-axis rotary with theta 2000, text positions on the fourth axis, references
at index 10, 20, ...).

The SP plan is Flux.1's: image tokens (target, then references) are split over the ranks, text is replicated and
each rank attends with its heads of it; double blocks then fused single blocks. Original (BFL / ComfyUI) key names
go through diffusers' own converter one tensor at a time (every rule of convert_flux2_transformer_checkpoint_to_
diffusers looks at one key and splits by thirds, so it is width-independent and streams).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Optional

import torch

from .base import ComfyHost, Detection, LoadRequest, ModelInfo, ProgressFn, config_entries
from .checkpoint import (KeyPlan, WeightDtypes, count_blocks, detected_checkpoint, find_prefix, layout_keys,
                         load_checkpoint_model, shape_of, strip_prefix)
from .header import Header, header_config
from .joint_dit import (ImageSequence, JointAttention, TokenGrid, as_list, grid_ids, image_sequence,
                        reference_placements, rotary)

FAMILY = "flux2"
DESCRIPTION = "Flux.2 (dev, klein)"


def _comfy_unet_config(info: ModelInfo) -> dict:
    return {"image_model": "flux2", "in_channels": info.in_channels, "out_channels": info.out_channels,
            "patch_size": PATCH}


COMFY = ComfyHost(model_classes={"": "Flux2"}, unet_config=_comfy_unet_config,
                  attributes=lambda info: {"patch_size": PATCH})
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
         ) -> "Flux2Worker":
    """The pool's entry point: load on this worker's device and switch attention to sequence parallel."""
    model, detection, dtypes = load_model(request.path, request.dtype, device, detection, request.options, progress,
                                          request.header)
    return worker_from_model(model, detection, dtypes, request.options)


def worker_from_model(model, detection: Detection, dtypes: WeightDtypes, options: Optional[dict] = None
                      ) -> "Flux2Worker":
    for block in model.transformer_blocks:
        block.attn.set_processor(Flux2DoubleSPProcessor())
    for block in model.single_transformer_blocks:
        block.attn.set_processor(Flux2SingleSPProcessor())
    return Flux2Worker(model, detection, dtypes, options)


# ---------------------------------------------------------------------------------------------------------------
# Sequence-parallel forward

def _heads(attn, tensor: torch.Tensor) -> torch.Tensor:
    return tensor.unflatten(-1, (-1, attn.head_dim))


def _joint_of(image_rotary_emb) -> JointAttention:
    if not isinstance(image_rotary_emb, JointAttention):
        raise TypeError("the Flux.2 SP processors run inside the sequence-parallel forward only")
    return image_rotary_emb


class Flux2DoubleSPProcessor:
    """Joint attention of a Flux.2 double block: this rank's image tokens with all (replicated) text tokens."""

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, image_rotary_emb=None):
        joint = _joint_of(image_rotary_emb)
        image = [_heads(attn, proj(hidden_states)) for proj in (attn.to_q, attn.to_k, attn.to_v)]
        text = [_heads(attn, proj(encoder_hidden_states)) for proj in (attn.add_q_proj, attn.add_k_proj,
                                                                         attn.add_v_proj)]
        image[0], image[1] = attn.norm_q(image[0]), attn.norm_k(image[1])
        text[0], text[1] = attn.norm_added_q(text[0]), attn.norm_added_k(text[1])
        image_out, text_out = joint(image, text)
        dtype = image[0].dtype
        image_out = attn.to_out[1](attn.to_out[0](image_out.flatten(2, 3).to(dtype).contiguous()))
        return image_out, attn.to_add_out(text_out.flatten(2, 3).to(dtype).contiguous())


class Flux2SingleSPProcessor:
    """A Flux.2 single block's fused attention + MLP on [all text, this rank's image tokens]."""

    def __call__(self, attn, hidden_states, attention_mask=None, image_rotary_emb=None):
        joint = _joint_of(image_rotary_emb)
        fused = attn.to_qkv_mlp_proj(hidden_states)
        qkv, mlp = fused.split([3 * attn.inner_dim, fused.shape[-1] - 3 * attn.inner_dim], dim=-1)
        qkv = [_heads(attn, part) for part in qkv.chunk(3, dim=-1)]
        qkv[0], qkv[1] = attn.norm_q(qkv[0]), attn.norm_k(qkv[1])
        length = joint.text_len
        image_out, text_out = joint([t[:, length:] for t in qkv], [t[:, :length] for t in qkv])
        attended = torch.cat([text_out, image_out], dim=1).flatten(2, 3).to(qkv[0].dtype)
        return attn.to_out(torch.cat([attended, attn.mlp_act_fn(mlp)], dim=-1))


class Flux2Worker:
    """A loaded Flux.2 in one worker; forward() is ComfyUI's diffusion_model call, split over the Ulysses group."""

    def __init__(self, model, detection: Detection, dtypes: WeightDtypes, options: Optional[dict] = None):
        self.model = model
        self.dtypes = dtypes
        config = model.config
        self.info = ModelInfo(family=FAMILY, variant=detection.variant, in_channels=config.in_channels,
                              out_channels=model.out_channels, x_ndim=4, config=config_entries(config, CONFIG_KEYS),
                              weight_dtype=dtypes.storage_name, compute_dtype=dtypes.compute_name)
        self.default_ref_method = (options or {}).get("ref_latents_method") or DEFAULT_REF_METHOD
        self.axes = tuple(config.axes_dims_rope)

    def forward(self, x: torch.Tensor, timestep: torch.Tensor, inputs: dict[str, Any], out: torch.Tensor,
                ctx) -> None:
        call = _prepare_call(self, x, timestep, inputs, ctx)
        call.image.write(out, _run_blocks(self.model, call, ctx))


@dataclass
class _Call:
    image: ImageSequence
    text: torch.Tensor                 # [b, L, joint_attention_dim]
    sigma: torch.Tensor                # [b] float32
    guidance: Optional[torch.Tensor]   # [b] in the compute dtype, or None (no guidance term)
    joint: JointAttention


def placements(method: str, x_hw, refs_hw) -> list[tuple[int, int, int]]:
    """ComfyUI's Flux.2 reference placement: "index" steps the index by 10 per reference."""
    found = reference_placements(method, tuple(x_hw), list(refs_hw), PATCH, REF_METHODS)
    return [(index * REF_INDEX_SCALE if method == "index" else index, row, col) for index, row, col in found]


def text_ids(length: int, device) -> torch.Tensor:
    """ComfyUI's Flux.2 text positions: 0 on the first three axes, the token index on the fourth."""
    ids = torch.zeros(length, 4, device=device)
    ids[:, 3] = torch.arange(length, device=device, dtype=torch.float32)
    return ids


def _prepare_call(worker: Flux2Worker, x, timestep, inputs, ctx) -> _Call:
    config, dtype = worker.model.config, worker.dtypes.compute
    _check_inputs(config, x, inputs)
    refs = as_list(inputs.get("ref_latents"))
    method = inputs.get("ref_latents_method") or worker.default_ref_method
    latents = [ctx.to_device("x", x, dtype)] + [ctx.to_device(f"ref_latents.{n}", ref, dtype)
                                                 for n, ref in enumerate(refs)]
    image = image_sequence(latents, [(0, 0, 0), *placements(method, x.shape[-2:], [r.shape[-2:] for r in refs])],
                           ctx.groups.seq, worker.axes, PATCH, centred=False, id_dtype=torch.float32,
                           theta=config.rope_theta, rope_options=inputs.get("rope_options"))
    text = ctx.to_device("context", inputs["context"], dtype)
    text_rope = rotary(text_ids(text.shape[1], ctx.device), worker.axes, config.rope_theta)
    joint = JointAttention(ctx.groups.seq, image.split.shards, image.rope, text_rope, None, text.shape[1])
    sigma = _per_item(ctx.to_device("timestep", timestep.reshape(-1), torch.float32), x.shape[0])
    guidance = inputs.get("guidance")
    if config.guidance_embeds and guidance is not None:
        guidance = _per_item(ctx.to_device("guidance", guidance.reshape(-1), dtype), x.shape[0])
    else:
        guidance = None  # klein has no guidance embedding; ComfyUI ignores it there
    return _Call(image, text, sigma, guidance, joint)


def _check_inputs(config, x: torch.Tensor, inputs: dict) -> None:
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


def _run_blocks(model, call: _Call, ctx) -> torch.Tensor:
    """x_embedder .. proj_out on this rank's tokens; returns its output tokens [b, hi - lo, C]."""
    hidden = model.x_embedder(call.image.tokens)
    dtype = hidden.dtype
    embed = model.time_guidance_embed
    temb = embed.timestep_embedder(embed.time_proj(call.sigma * 1000).to(dtype))
    if call.guidance is not None:  # ComfyUI leaves the guidance term out when no guidance is given
        temb = temb + embed.guidance_embedder(embed.time_proj(call.guidance * 1000).to(dtype))
    text = model.context_embedder(call.text)
    mod_img, mod_txt = model.double_stream_modulation_img(temb), model.double_stream_modulation_txt(temb)
    for block in model.transformer_blocks:
        ctx.check_cancel()
        text, hidden = block(hidden_states=hidden, encoder_hidden_states=text, temb_mod_img=mod_img,
                             temb_mod_txt=mod_txt, image_rotary_emb=call.joint)
    mod_single = model.single_stream_modulation(temb)
    length = text.shape[1]
    hidden = torch.cat([text, hidden], dim=1)
    for block in model.single_transformer_blocks:
        ctx.check_cancel()
        hidden = block(hidden_states=hidden, encoder_hidden_states=None, temb_mod=mod_single,
                       image_rotary_emb=call.joint)
    return model.proj_out(model.norm_out(hidden[:, length:], temb))


def _per_item(values: torch.Tensor, batch: int) -> torch.Tensor:
    return values.expand(batch) if values.numel() == 1 else values


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
