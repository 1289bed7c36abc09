"""HunyuanVideo 1.5 (480p / 720p T2V and I2V, the 1080p super-resolution model) under Ulysses SP: detection from
the header, the Tencent / ComfyUI key layouts -> diffusers' HunyuanVideo15Transformer3DModel, and ComfyUI's
`diffusion_model(x, timestep, context, txt_byt5, clip_fea, attention_mask, ref_latent, timestep_r)` (ComfyUI 0.3.71
or newer).

ComfyUI's call: x [B, 65, T, H, W] (noise 32 + image latent 32 + mask 1; zeros for text-to-video; the SR model:
98 = noise 32 + its concat of 66, the upscaled low-resolution latent among them, built by ComfyUI's
HunyuanVideo15_SR_Distilled.concat_cond), timestep = sigma x 1000 [B], context [B, L, 3584] (Qwen2.5-VL tokens),
txt_byt5 [B, Lb, 1472] (ByT5 glyph tokens, when the prompt quotes text), clip_fea [B, 729, 1152] (SigLIP image
tokens, image-to-video), attention_mask [B, L] (only when some Qwen token is padding), ref_latent [B, C, Tr, Hr, Wr]
(C = x's channels: patch-embedded like x, ahead of the video tokens at frame -1, columns shifted by x's width,
dropped from the output; ComfyUI's only node that sets it, HunyuanImageToVideo's "custom" guidance, gives a 32-channel
VAE latent, which 1.5's img_in takes in neither ComfyUI nor here). Returns [B, 32, T, H, W].

The SR model is a meanflow model: ComfyUI adds the embedding of the sampler's next sigma to the timestep's,
finding it in transformer_options (host-only); the host's hook (SamplerSigma: `sampler_inputs`) hands it to the
pool as `timestep_r` (x 1000, like timestep) and the worker adds time_embed's second embedding of it, as diffusers'
`timestep_r` does.

PLAN is HunyuanVideo 1.0's (hunyuan_video.PLAN) with its differences: the image stream ([reference, video]) split
as there; the text stream [SigLIP, ByT5, Qwen tokens], each with its condition-type embedding, replicated; 54
double-stream blocks and no token replace.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Iterable, Optional

import torch

from ..sp import PlanWorker, Stream, text_stream
from ..sp.tokens import rope_axes
from . import hunyuan_video
from ..contract import ComfyHost, Detection, HostHooks, LoadRequest, ModelInfo
from ..checkpoints.loading import (KeyPlan, ProgressFn, WeightDtypes, count_blocks, detected_checkpoint, find_prefix,
                                   layout_keys, load_checkpoint_model, shape_of, strip_prefix)
from ..checkpoints.header import Header, header_config
from .hunyuan_keys import REFINER_STEM, SHARED_ARCHITECTURE_KEYS, hunyuan_key_plan
from .hunyuan_video import (check_latent, check_reference, comfy_attributes, comfy_names, embedded, image_stream,
                            model_info, patch_of, per_item, reference_latent_hooks, refined_text, text_keep,
                            time_embedding)

FAMILY = "hunyuan_video15"
DESCRIPTION = "HunyuanVideo 1.5 (480p / 720p, T2V, I2V, 1080p super-resolution)"
CONFIG_KEYS = ("in_channels", "out_channels", "num_attention_heads", "attention_head_dim", "num_layers",
               "num_refiner_layers", "mlp_ratio", "patch_size", "patch_size_t", "text_embed_dim", "text_embed_2_dim",
               "image_embed_dim", "rope_axes_dim", "use_meanflow")
ARCHITECTURE_KEYS = {
    **SHARED_ARCHITECTURE_KEYS,
    "byt5": ("byt5_in.fc1.weight", "context_embedder_2.linear_1.weight"),
    "image": ("vision_in.proj.0.weight", "image_embedder.norm_in.weight"),
    "guidance": ("guidance_in.in_layer.weight", "time_embed.guidance_embedder.linear_1.weight"),
    "meanflow": ("time_r_in.in_layer.weight", "time_embed.timestep_embedder_r.linear_1.weight"),
}
ORIGINAL_ANCHORS = ("cond_type_embedding.weight", f"{REFINER_STEM}.0.norm1.weight", "img_in.proj.weight",
                    "final_layer.linear.weight")
DIFFUSERS_ANCHORS = ("cond_type_embed.weight", "x_embedder.proj.weight", "context_embedder_2.linear_1.weight",
                     "proj_out.weight")
TEXT, BYT5, IMAGE = 0, 1, 2  # condition types (rows of cond_type_embed)
SR = "sr"  # the variant of meanflow (super-resolution) files


def _comfy_unet_config(info: ModelInfo) -> dict:
    return {"in_channels": info.in_channels, "out_channels": info.out_channels,
            "vision_in_dim": info.config["image_embed_dim"]}


def sampler_inputs(transformer_options: dict, inputs: dict) -> dict:
    """ComfyUI's meanflow step, read on the host: `timestep_r` = the sampler's sigma after the current one, x 1000
    (ComfyUI's time_r_in embeds it with time factor 1000; a 0-D tensor, for every batch item), where ComfyUI's
    model would use it: the current sigma is in the schedule and the call does not set disable_time_r. Models
    without time_r_in ignore it."""
    sigmas, schedule = transformer_options.get("sigmas"), transformer_options.get("sample_sigmas")
    if inputs.get("disable_time_r") or sigmas is None or schedule is None:
        return {}
    found = torch.where(sigmas[0] == schedule)[0]
    if len(found) == 0:
        return {}
    return {"timestep_r": (schedule[found[0] + 1] * 1000).to(torch.float32)}  # 0-D: one value for the batch


class SamplerSigma(HostHooks):
    """The host hook of HunyuanVideo 1.5: sampler_inputs on every call; rope_options ignored, as ComfyUI does."""

    rope_options = "ignored"

    def call_inputs(self, transformer_options: dict, inputs: dict) -> dict:
        return sampler_inputs(transformer_options, inputs)


COMFY = ComfyHost(model_classes={SR: "HunyuanVideo15_SR_Distilled", "": "HunyuanVideo15"},
                  unet_config=_comfy_unet_config, attributes=comfy_attributes, hooks=SamplerSigma())


# ---------------------------------------------------------------------------------------------------------------
# Detection

def detect(header: Header) -> Optional[Detection]:
    """HunyuanVideo 1.5 from its header alone; None for other files."""
    folder_config = header_config(header)
    if folder_config is not None:
        if folder_config.get("_class_name") != "HunyuanVideo15Transformer3DModel":
            return None
        config = {key: folder_config[key] for key in CONFIG_KEYS if key in folder_config}
        return _detection(header, "diffusers", "", {**config, "rope_axes_dim": tuple(config["rope_axes_dim"])})
    for layout, anchors in (("original", ORIGINAL_ANCHORS), ("diffusers", DIFFUSERS_ANCHORS)):
        prefix = find_prefix(header.tensors, anchors)
        if prefix is not None:
            tensors = strip_prefix(header.tensors, prefix)
            keys = comfy_names(tensors) if layout == "original" else tensors
            return _detection(header, layout, prefix, architecture(keys, layout, header.path))
    return None


def _detection(header: Header, layout: str, prefix: str, config: dict) -> Detection:
    return Detection(family=FAMILY, variant=SR if config.get("use_meanflow") else "", layout=layout, prefix=prefix,
                     config=config, files=header.source.files)


def architecture(keys: dict, layout: str, path: str = "") -> dict:
    """HunyuanVideo15Transformer3DModel config from a header (keys without prefix, ComfyUI or diffusers names)."""
    names = layout_keys(ARCHITECTURE_KEYS, layout)
    if names["guidance"] in keys or count_blocks(keys, names["single_blocks"]):
        raise ValueError(f"{path!r} is a HunyuanVideo 1.5 variant with a guidance embedding or single-stream blocks, "
                         f"which diffusers' HunyuanVideo 1.5 (and so ulysses-sp) does not have")
    hidden, in_channels, patch_t, patch, patch_w = shape_of(keys, names["embed"])
    head_dim = shape_of(keys, names["head_norm"])[0]
    if patch != patch_w or hidden % head_dim:
        raise ValueError(f"HunyuanVideo 1.5 patch ({patch_t}, {patch}, {patch_w}) / width {hidden} with head size "
                         f"{head_dim}: unsupported variant")
    return {
        "in_channels": in_channels,
        "out_channels": shape_of(keys, names["out"])[0] // (patch_t * patch * patch),
        "num_attention_heads": hidden // head_dim,
        "attention_head_dim": head_dim,
        "num_layers": count_blocks(keys, names["double_blocks"]),
        "num_refiner_layers": count_blocks(keys, names["refiner_blocks"]),
        "mlp_ratio": shape_of(keys, names["mlp"])[0] / hidden,
        "patch_size": patch,
        "patch_size_t": patch_t,
        "text_embed_dim": shape_of(keys, names["text"])[1],
        "text_embed_2_dim": shape_of(keys, names["byt5"])[1],
        "image_embed_dim": shape_of(keys, names["image"])[0],
        "rope_axes_dim": rope_axes(head_dim),
        "use_meanflow": names["meanflow"] in keys,
    }


# ---------------------------------------------------------------------------------------------------------------
# Loading

def weight_plan(detection: Detection, keys: Iterable[str]) -> Optional[KeyPlan]:
    """Tencent / ComfyUI names through original_plan; diffusers names as they are (None)."""
    return original_plan(keys, detection.config) if detection.layout == "original" else None


def original_plan(keys: Iterable[str], config) -> KeyPlan:
    """Tencent / ComfyUI key names -> parameters of the model of `config` (LoRAs use these names too)."""
    hidden = config["num_attention_heads"] * config["attention_head_dim"]
    return hunyuan_key_plan(keys, hidden, 0, "time_embed")


def load_model(path: str, dtype: str = "default", device: torch.device | str = "cpu",
               detection: Optional[Detection] = None, options: Optional[dict] = None,
               progress: Optional[ProgressFn] = None, header: Optional[Header] = None
               ) -> tuple[torch.nn.Module, Detection, WeightDtypes]:
    """A diffusers HunyuanVideo15Transformer3DModel with the checkpoint's weights (stock attention processors)."""
    from diffusers import HunyuanVideo15Transformer3DModel

    header, detection = detected_checkpoint(path, header, detection, detect, FAMILY, "HunyuanVideo 1.5")
    plan = weight_plan(detection, strip_prefix(header.tensors, detection.prefix))
    model, dtypes = load_checkpoint_model(HunyuanVideo15Transformer3DModel, detection.config, header, detection,
                                          dtype, device, plan, progress)
    return model, detection, dtypes


def load(request: LoadRequest, detection: Detection, device: torch.device, groups, progress: ProgressFn
         ) -> PlanWorker:
    """The pool's entry point: load on this worker's device, the executor running PLAN."""
    model, detection, dtypes = load_model(request.path, request.dtype, device, detection, request.options, progress,
                                          request.header)
    return PlanWorker(model, model_info(model, detection, dtypes, CONFIG_KEYS), PLAN, dtypes, request.options)


# ---------------------------------------------------------------------------------------------------------------
# Sequence-parallel plan: HunyuanVideo 1.0's with its differences (double-stream blocks only, no token replace, the
# text stream with SigLIP and ByT5 tokens, the meanflow time embedding)

def check(call) -> None:
    config, x, inputs = call.config, call.x, call.inputs
    check_latent(x, config.in_channels, patch_of(config), "this HunyuanVideo 1.5")
    streams = {"context": (config.text_embed_dim, "the Qwen2.5-VL tokens"),
               "txt_byt5": (config.text_embed_2_dim, "the ByT5 tokens"),
               "clip_fea": (config.image_embed_dim, "the SigLIP image tokens")}
    for name, (width, what) in streams.items():
        value = inputs.get(name)
        if value is None and name != "context":
            continue  # ComfyUI leaves glyph and image tokens out when the prompt has none
        if value is None or value.dim() != 3 or value.shape[-1] != width:
            raise ValueError(f"HunyuanVideo 1.5 takes {name} [B, L, {width}] ({what}); got "
                             f"{None if value is None else list(value.shape)}")
    check_reference(inputs.get("ref_latent"), x, config.in_channels, patch_of(config), "HunyuanVideo 1.5")
    timestep_r = inputs.get("timestep_r")
    if timestep_r is not None and timestep_r.numel() not in (1, x.shape[0]):
        raise ValueError(f"timestep_r has {timestep_r.numel()} values; HunyuanVideo 1.5 takes one or one per batch "
                         f"item ({x.shape[0]})")


def layout(call) -> list[Stream]:
    """The image stream as 1.0's; the text stream [SigLIP image tokens, ByT5 tokens, refined Qwen tokens], each with
    its condition-type embedding, its keep-mask covering the Qwen tokens."""
    model, batch, dtype = call.model, call.batch, call.dtype
    context = per_item(call.input("context"), batch)
    keep = text_keep(call, context.shape[1])
    types = model.cond_type_embed.weight.to(dtype)
    parts = [refined_text(model.context_embedder, context, call.sigma(), keep) + types[TEXT]]
    if call.inputs.get("txt_byt5") is not None:
        parts.insert(0, model.context_embedder_2(per_item(call.input("txt_byt5"), batch)) + types[BYT5])
    if call.inputs.get("clip_fea") is not None:
        parts.insert(0, model.image_embedder(per_item(call.input("clip_fea"), batch)) + types[IMAGE])
    text = torch.cat(parts, dim=1)
    if keep is not None and text.shape[1] > keep.shape[1]:
        keep = torch.cat([keep.new_ones(batch, text.shape[1] - keep.shape[1]), keep], dim=1)
    return [image_stream(call), text_stream(text, None, embedded, keep)]


def condition(call) -> None:
    """The timestep's embedding, plus (meanflow models, when the call gives timestep_r) the next sigma's through the
    second embedder: ComfyUI's HunyuanVideo 1.5 sums them (meanflow_sum), as diffusers does."""
    embed, timestep_r = call.model.time_embed, call.inputs.get("timestep_r")
    call.temb = time_embedding(embed, call.sigma(), call.dtype)
    if embed.timestep_embedder_r is not None and timestep_r is not None:
        values = per_item(call.ctx.to_device("timestep_r", timestep_r.reshape(-1), torch.float32), call.batch)
        call.temb = call.temb + embed.timestep_embedder_r(embed.time_proj_r(values).to(call.dtype))


def double_block(block, call) -> None:
    call.image, call.text = block(call.image, call.text, call.temb, None, None)


PLAN = replace(hunyuan_video.PLAN, check=check, layout=layout, condition=condition,
               stages=(replace(hunyuan_video.PLAN.stages[0], run=double_block),),
               head=lambda call: call.model.proj_out(call.model.norm_out(call.image, call.temb)))


# ---------------------------------------------------------------------------------------------------------------
# Single-process reference (tests): diffusers' stock forward, ComfyUI's call convention around it

def reference_forward(model, x: torch.Tensor, timestep: torch.Tensor, context: torch.Tensor,
                      txt_byt5: Optional[torch.Tensor] = None, clip_fea: Optional[torch.Tensor] = None,
                      timestep_r: Optional[torch.Tensor] = None, ref_latent: Optional[torch.Tensor] = None,
                      **_ignored) -> torch.Tensor:
    """ComfyUI's HunyuanVideo 1.5 diffusion_model(...) computed by diffusers' own forward on one process; inputs
    ComfyUI leaves out are given to diffusers as fully masked (all-zero image embeddings: text-to-video). diffusers
    has no reference latent: with ref_latent its forward runs under hunyuan_video.reference_latent_hooks."""
    compute, device = model.proj_out.weight.dtype, model.proj_out.weight.device
    batch, config = x.shape[0], model.config
    glyph_mask = torch.ones if txt_byt5 is not None else torch.zeros
    txt_byt5 = torch.zeros(batch, 1, config.text_embed_2_dim) if txt_byt5 is None else txt_byt5
    clip_fea = torch.zeros(batch, 1, config.image_embed_dim) if clip_fea is None else clip_fea
    if timestep_r is not None and config.use_meanflow:  # ComfyUI's models without time_r_in ignore it
        timestep_r = timestep_r.reshape(-1).expand(batch).to(device, compute)
    else:
        timestep_r = None
    # diffusers embeds the timestep in its own dtype: the compute dtype, as its pipeline
    with torch.no_grad(), reference_latent_hooks(model, x, ref_latent):
        out = model(hidden_states=x.to(device, compute),
                    timestep=timestep.reshape(-1).expand(batch).to(device, compute), timestep_r=timestep_r,
                    encoder_hidden_states=context.to(device, compute),
                    encoder_attention_mask=torch.ones(batch, context.shape[1], device=device),
                    encoder_hidden_states_2=txt_byt5.to(device, compute),
                    encoder_attention_mask_2=glyph_mask(batch, txt_byt5.shape[1], device=device),
                    image_embeds=clip_fea.to(device, compute), return_dict=False)[0]
    return out.to(x.dtype).cpu()

