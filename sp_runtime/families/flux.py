"""Flux.1 (dev, schnell, Kontext, Fill, Depth/Canny) under Ulysses SP: detection from the header, loading into
diffusers' FluxTransformer2DModel, and ComfyUI's `diffusion_model(x, timestep, context, y, guidance, ref_latents)`.

Original (BFL / ComfyUI) key names are converted per tensor by `flux_key_plan`, our own width-aware version of
diffusers' `convert_flux_transformer_checkpoint_to_diffusers`. We do not call that converter because it hardcodes
the full-size width (3072) and needs the whole state dict in memory at once, which would stop us casting each tensor
to its final dtype as it is read (fp8 storage from a bf16 file would peak at the bf16 size). tests/test_flux.py
checks that both produce the same tensors on a full-size checkpoint.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Optional

import torch

from .base import ComfyHost, Detection, LoadRequest, ModelInfo, ProgressFn, config_entries
from .checkpoint import (KeyPlan, Transform, WeightDtypes, count_blocks, detected_checkpoint, find_prefix, layout_keys,
                         load_checkpoint_model, row_split, shape_of, strip_prefix, swap_halves)
from .header import Header, header_config
from .joint_dit import (ImageSequence, JointAttention, TokenGrid, as_list, grid_ids, image_sequence,
                        reference_placements, rope_axes, rotary)

FAMILY = "flux"
DESCRIPTION = "Flux.1 (dev, schnell, Kontext, Fill, Depth/Canny)"


def _comfy_unet_config(info: ModelInfo) -> dict:
    return {"in_channels": info.in_channels, "out_channels": info.out_channels}  # latent channels, as ComfyUI's


COMFY = ComfyHost(model_classes={"schnell": "FluxSchnell", "fill": "FluxInpaint", "": "Flux"},
                  unet_config=_comfy_unet_config)
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
         ) -> "FluxWorker":
    """The pool's entry point: load on this worker's device and switch attention to sequence parallel."""
    model, detection, dtypes = load_model(request.path, request.dtype, device, detection, request.options, progress,
                                          request.header)
    return worker_from_model(model, detection, dtypes, request.options)


def worker_from_model(model, detection: Detection, dtypes: WeightDtypes, options: Optional[dict] = None
                      ) -> "FluxWorker":
    """The worker around a built model (load(), synthetic models), its attention switched to sequence parallel."""
    model.set_attn_processor(FluxSPAttnProcessor())
    return FluxWorker(model, detection, dtypes, options)


def model_info(model, detection: Detection, dtypes: WeightDtypes) -> ModelInfo:
    config = model.config
    return ModelInfo(family=FAMILY, variant=detection.variant, in_channels=config.in_channels // (PATCH * PATCH),
                     out_channels=model.proj_out.out_features // (PATCH * PATCH), x_ndim=4,
                     config=config_entries(config, CONFIG_KEYS),
                     weight_dtype=dtypes.storage_name, compute_dtype=dtypes.compute_name)


# ---------------------------------------------------------------------------------------------------------------
# Sequence-parallel forward

class FluxSPAttnProcessor:
    """Joint attention of diffusers' Flux blocks through sp_attention (replaces FluxAttnProcessor).

    Double blocks hand us this rank's image tokens and all text tokens; single blocks one sequence [text, image]
    whose first `text_len` tokens are the (replicated) text. `image_rotary_emb` is a JointAttention.
    """

    def __call__(self, attn, hidden_states: torch.Tensor, encoder_hidden_states: Optional[torch.Tensor] = None,
                 attention_mask: Optional[torch.Tensor] = None,
                 image_rotary_emb: Optional[JointAttention] = None):
        joint = image_rotary_emb
        if not isinstance(joint, JointAttention):
            raise TypeError("FluxSPAttnProcessor runs inside the sequence-parallel forward only")

        def split_heads(tensor):
            return tensor.unflatten(-1, (-1, attn.head_dim))

        qkv = [split_heads(proj(hidden_states)) for proj in (attn.to_q, attn.to_k, attn.to_v)]
        qkv[0], qkv[1] = attn.norm_q(qkv[0]), attn.norm_k(qkv[1])
        if encoder_hidden_states is None:  # single block
            length = joint.text_len
            text, image = [t[:, :length] for t in qkv], [t[:, length:] for t in qkv]
        else:
            image = qkv
            text = [split_heads(proj(encoder_hidden_states)) for proj in (attn.add_q_proj, attn.add_k_proj,
                                                                          attn.add_v_proj)]
            text[0], text[1] = attn.norm_added_q(text[0]), attn.norm_added_k(text[1])
        image_out, text_out = joint(image, text)
        dtype = qkv[0].dtype
        image_out, text_out = image_out.flatten(2, 3).to(dtype), text_out.flatten(2, 3).to(dtype)
        if encoder_hidden_states is None:
            return torch.cat([text_out, image_out], dim=1)
        return attn.to_out[1](attn.to_out[0](image_out.contiguous())), attn.to_add_out(text_out.contiguous())


class FluxWorker:
    """A loaded Flux in one worker; forward() is ComfyUI's diffusion_model call, split over the Ulysses group."""

    def __init__(self, model, detection: Detection, dtypes: WeightDtypes, options: Optional[dict] = None):
        self.model = model
        self.dtypes = dtypes
        self.info = model_info(model, detection, dtypes)
        self.default_ref_method = (options or {}).get("ref_latents_method") or "offset"
        self.axes = tuple(model.config.axes_dims_rope)

    def forward(self, x: torch.Tensor, timestep: torch.Tensor, inputs: dict[str, Any], out: torch.Tensor,
                ctx) -> None:
        call = _prepare_call(self, x, timestep, inputs, ctx)
        call.image.write(out, _run_blocks(self.model, call, ctx))


@dataclass
class _Call:
    """One call's inputs on this rank, ready for the blocks."""

    image: ImageSequence
    text: torch.Tensor                 # [b, L, joint_attention_dim]
    sigma: torch.Tensor                # [b] float32
    guidance: Optional[torch.Tensor]   # [b] in the compute dtype, or None (no guidance term)
    pooled: torch.Tensor               # [b, pooled_projection_dim]
    joint: JointAttention


def _prepare_call(worker: FluxWorker, x, timestep, inputs, ctx) -> _Call:
    config, dtype = worker.model.config, worker.dtypes.compute
    _check_inputs(config, x, inputs)
    refs = as_list(inputs.get("ref_latents"))
    method = inputs.get("ref_latents_method") or worker.default_ref_method
    placements = reference_placements(method, tuple(x.shape[-2:]), [r.shape[-2:] for r in refs], PATCH,
                                      REF_METHODS)
    latents = [ctx.to_device("x", x, dtype)] + [ctx.to_device(f"ref_latents.{n}", ref, dtype)
                                                 for n, ref in enumerate(refs)]
    image = image_sequence(latents, [(0, 0, 0), *placements], ctx.groups.seq, worker.axes, PATCH, centred=False,
                           id_dtype=x.dtype, rope_options=inputs.get("rope_options"))
    text = ctx.to_device("context", inputs["context"], dtype)
    text_rope = rotary(torch.zeros(text.shape[1], 3, device=ctx.device), worker.axes)  # ComfyUI: text ids 0
    joint = JointAttention(ctx.groups.seq, image.split.shards, image.rope, text_rope, None, text.shape[1])
    # ComfyUI embeds the timestep from float32 sigma; the guidance arrives in the model's dtype
    sigma = _per_item(ctx.to_device("timestep", timestep.reshape(-1), torch.float32), x.shape[0])
    guidance = inputs.get("guidance")
    if config.guidance_embeds and guidance is not None:
        guidance = _per_item(ctx.to_device("guidance", guidance.reshape(-1), dtype), x.shape[0])
    else:
        guidance = None  # schnell has no guidance embedding; ComfyUI ignores it there
    pooled = _pooled(inputs.get("y"), config.pooled_projection_dim, x.shape[0], dtype, ctx)
    return _Call(image, text, sigma, guidance, pooled, joint)


def _check_inputs(config, x: torch.Tensor, inputs: dict) -> None:
    if inputs.get("attention_mask") is not None:
        raise ValueError("attention_mask (regional prompting) is not supported by the sequence-parallel Flux")
    if inputs.get("control") is not None:
        raise ValueError("ControlNet inputs are not supported by the sequence-parallel Flux")
    channels = config.in_channels // (PATCH * PATCH)
    if x.dim() != 4 or x.shape[1] != channels:
        raise ValueError(f"x has shape {tuple(x.shape)}; this Flux takes [B, {channels}, H, W]")
    for number, ref in enumerate(as_list(inputs.get("ref_latents"))):
        if ref.dim() != 4 or ref.shape[1] != channels:
            raise ValueError(f"ref_latents[{number}] has shape {tuple(ref.shape)}; expected [B, {channels}, h, w]")
    context = inputs.get("context")
    if context is None or context.dim() != 3:
        raise ValueError("Flux needs context [batch, text tokens, features] (the T5 output)")


def _run_blocks(model, call: _Call, ctx) -> torch.Tensor:
    """x_embedder .. proj_out on this rank's tokens; returns its output tokens [b, hi - lo, C*p*p]."""
    hidden = model.x_embedder(call.image.tokens)
    embed, sigma, pooled = model.time_text_embed, call.sigma * 1000, call.pooled
    if call.guidance is not None:
        temb = embed(sigma, call.guidance * 1000, pooled)
    elif model.config.guidance_embeds:  # ComfyUI leaves the guidance term out when no guidance is given
        temb = embed.timestep_embedder(embed.time_proj(sigma).to(pooled.dtype)) + embed.text_embedder(pooled)
    else:
        temb = embed(sigma, pooled)
    text = model.context_embedder(call.text)
    for block in [*model.transformer_blocks, *model.single_transformer_blocks]:
        ctx.check_cancel()
        text, hidden = block(hidden_states=hidden, encoder_hidden_states=text, temb=temb,
                             image_rotary_emb=call.joint)
    return model.proj_out(model.norm_out(hidden, temb))


def _per_item(values: torch.Tensor, batch: int) -> torch.Tensor:
    return values.expand(batch) if values.numel() == 1 else values


def _pooled(y, width: int, batch: int, dtype, ctx) -> torch.Tensor:
    """ComfyUI's y (CLIP pooled output), cut to the model's width; zeros when absent, as ComfyUI does."""
    if y is None:
        return torch.zeros(batch, width, device=ctx.device, dtype=dtype)
    y = ctx.to_device("y", y, dtype)[:, :width]
    return y.expand(batch, -1) if y.shape[0] == 1 else y


# ---------------------------------------------------------------------------------------------------------------
# Single-process reference (tests, demo, benchmarks): diffusers' stock forward and processors, ComfyUI's packing

def reference_forward(model_or_path, x: torch.Tensor, timestep: torch.Tensor, context: torch.Tensor,
                      y: Optional[torch.Tensor] = None, guidance: Optional[torch.Tensor] = None, ref_latents=None,
                      ref_latents_method: Optional[str] = None, dtype: str = "default", **_ignored) -> torch.Tensor:
    """ComfyUI's Flux diffusion_model(...) computed by diffusers' own forward on one process."""
    from .joint_dit import reference_pack, reference_unpack
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
