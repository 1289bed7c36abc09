"""HunyuanVideo 1.0 (T2V, I2V v1 concat, I2V v2 token replace, SkyReels I2V) under Ulysses SP: detection from the
header, loading into diffusers' HunyuanVideoTransformer3DModel, and ComfyUI's
`diffusion_model(x, timestep, context, y, guidance, attention_mask, guiding_frame_index, ref_latent)`.

ComfyUI's call: x [B, C, T, H, W] (16 channels; I2V v1 33 = noise + image latent + mask; SkyReels 32), timestep =
sigma x 1000 [B], context [B, L, 4096] (LLaVA-Llama tokens), y [B, 768] (CLIP-L pooled), guidance [B] raw (6.0;
embedded as guidance x 1000), attention_mask [B, L] text keep-mask, guiding_frame_index [B] (I2V v2: the first
frame's tokens are modulated with the embedding of this timestep), ref_latent [B, C, Tr, Hr, Wr] (HunyuanImageToVideo's
"custom" guidance: the start image's latent, patch-embedded like x, ahead of the video at frame -1 with its columns
shifted by x's width, dropped from the output). Returns [B, 16, T, H, W].

PLAN (run by sp.PlanWorker): the image stream [reference, video] split in balanced shards, each rank patch-embedding
its own tokens at their (frame, row, column) rotary; the text (LLaVA tokens through the token refiner) replicated and
joined after the image tokens in the double- and single-stream blocks; token replace modulates the first frame's
tokens wherever they fall (diffusers' token-replace blocks); each rank writes its own output tokens.

Where ComfyUI and diffusers differ we follow ComfyUI: the refiner's pooled text is the plain mean of all tokens
(padding included), and the token-replace embedding gets the guidance term and also modulates the final layer.
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import replace
from types import SimpleNamespace
from typing import Iterable, Optional

import torch

from ..sp import AttentionSpec, Plan, PlanWorker, Stage, Stream, project_qkv, text_stream, video_part
from ..sp.tokens import rope_axes, text_key_mask
from ..sp.video_tokens import conv_patch_embed
from ..contract import ComfyHost, Detection, HostHooks, LoadRequest, ModelInfo, config_entries
from ..checkpoints.loading import (KeyPlan, ProgressFn, WeightDtypes, count_blocks, detected_checkpoint, find_prefix,
                                   layout_keys, load_checkpoint_model, shape_of, strip_prefix)
from ..checkpoints.header import Header, header_config
from .hunyuan_keys import REFINER_STEM, SHARED_ARCHITECTURE_KEYS, comfy_name, hunyuan_key_plan

FAMILY = "hunyuan_video"
DESCRIPTION = "HunyuanVideo 1.0 (T2V, I2V concat / token replace, SkyReels I2V)"
ROPE_THETA = 256
VARIANTS = {16: "t2v", 33: "i2v", 32: "skyreels_i2v"}  # by input channels, as ComfyUI's supported_models
CONFIG_KEYS = ("in_channels", "out_channels", "num_attention_heads", "attention_head_dim", "num_layers",
               "num_single_layers", "num_refiner_layers", "mlp_ratio", "patch_size", "patch_size_t",
               "guidance_embeds", "text_embed_dim", "pooled_projection_dim", "rope_axes_dim")
# ComfyUI's module names (after hunyuan_keys.comfy_name) and diffusers' of the facts a header shows
ARCHITECTURE_KEYS = {
    **SHARED_ARCHITECTURE_KEYS,
    "pooled": ("vector_in.in_layer.weight", "time_text_embed.text_embedder.linear_1.weight"),
    "guidance": ("guidance_in.in_layer.weight", "time_text_embed.guidance_embedder.linear_1.weight"),
}
ORIGINAL_ANCHORS = (f"{REFINER_STEM}.0.norm1.weight", "img_in.proj.weight", "final_layer.linear.weight")
DIFFUSERS_ANCHORS = ("context_embedder.token_refiner.refiner_blocks.0.norm1.weight", "x_embedder.proj.weight",
                     "time_text_embed.timestep_embedder.linear_1.weight", "proj_out.weight")
VERSION_15_KEYS = ("cond_type_embedding.weight", "cond_type_embed.weight")  # HunyuanVideo 1.5 (its own family)
UNSUPPORTED_INPUTS = {"txt_byt5": "ByT5 glyph text (HunyuanImage 2.1)"}


def _comfy_unet_config(info: ModelInfo) -> dict:
    patch = [info.config["patch_size_t"], info.config["patch_size"], info.config["patch_size"]]
    return {"in_channels": info.in_channels, "out_channels": info.out_channels, "patch_size": patch}


def comfy_attributes(info: ModelInfo) -> dict:
    """What ComfyUI's HunyuanVideo classes read from diffusion_model: the patch and img_in.proj.weight.shape (1.5's
    concat_cond sizes the image condition from it); plain objects, no weights."""
    config = info.config
    patch = [config["patch_size_t"], config["patch_size"], config["patch_size"]]
    shape = torch.Size((config["num_attention_heads"] * config["attention_head_dim"], info.in_channels, *patch))
    return {"patch_size": patch, "img_in": SimpleNamespace(proj=SimpleNamespace(weight=SimpleNamespace(shape=shape)))}


COMFY = ComfyHost(model_classes={"i2v": "HunyuanVideoI2V", "skyreels_i2v": "HunyuanVideoSkyreelsI2V",
                                 "": "HunyuanVideo"},
                  unet_config=_comfy_unet_config, attributes=comfy_attributes, hooks=HostHooks(rope_options="ignored"))


# ---------------------------------------------------------------------------------------------------------------
# Detection

def detect(header: Header) -> Optional[Detection]:
    """HunyuanVideo 1.0 from its header alone; None for other files (HunyuanVideo 1.5, HunyuanImage 2.1 ...)."""
    if any(key.endswith(VERSION_15_KEYS) for key in header.tensors):
        return None
    folder_config = header_config(header)
    if folder_config is not None:
        if folder_config.get("_class_name") != "HunyuanVideoTransformer3DModel":
            return None
        config = {key: folder_config[key] for key in CONFIG_KEYS if key in folder_config}
        return _detection(header, "diffusers", "", {**config, "rope_axes_dim": tuple(config["rope_axes_dim"])})
    for layout, anchors in (("original", ORIGINAL_ANCHORS), ("diffusers", DIFFUSERS_ANCHORS)):
        prefix = find_prefix(header.tensors, anchors)
        if prefix is not None:
            keys = comfy_names(strip_prefix(header.tensors, prefix)) if layout == "original" else \
                strip_prefix(header.tensors, prefix)
            config = architecture(keys, layout)
            return None if config is None else _detection(header, layout, prefix, config)
    return None


def comfy_names(tensors: dict) -> dict:
    """Header entries under ComfyUI's module names (Tencent's renamed)."""
    return {comfy_name(key): value for key, value in tensors.items()}


def _detection(header: Header, layout: str, prefix: str, config: dict) -> Detection:
    return Detection(family=FAMILY, variant=VARIANTS.get(config["in_channels"], ""), layout=layout, prefix=prefix,
                     config=config, files=header.source.files)


def architecture(keys: dict, layout: str) -> Optional[dict]:
    """HunyuanVideoTransformer3DModel config from a header (keys without prefix, ComfyUI or diffusers names);
    None for a 2-D patch (HunyuanImage 2.1)."""
    names = layout_keys(ARCHITECTURE_KEYS, layout)
    embed = shape_of(keys, names["embed"])
    if len(embed) != 5:
        return None
    hidden, in_channels, patch_t, patch, patch_w = embed
    head_dim = shape_of(keys, names["head_norm"])[0]
    if patch != patch_w or hidden % head_dim:
        raise ValueError(f"HunyuanVideo patch {embed[2:]} / width {hidden} with head size {head_dim}: unsupported "
                         f"variant")
    return {
        "in_channels": in_channels,
        "out_channels": shape_of(keys, names["out"])[0] // (patch_t * patch * patch),
        "num_attention_heads": hidden // head_dim,
        "attention_head_dim": head_dim,
        "num_layers": count_blocks(keys, names["double_blocks"]),
        "num_single_layers": count_blocks(keys, names["single_blocks"]),
        "num_refiner_layers": count_blocks(keys, names["refiner_blocks"]),
        "mlp_ratio": shape_of(keys, names["mlp"])[0] / hidden,
        "patch_size": patch,
        "patch_size_t": patch_t,
        "guidance_embeds": names["guidance"] in keys,
        "text_embed_dim": shape_of(keys, names["text"])[1],
        "pooled_projection_dim": shape_of(keys, names["pooled"])[1],
        "rope_axes_dim": rope_axes(head_dim),
    }


# ---------------------------------------------------------------------------------------------------------------
# Loading

def weight_plan(detection: Detection, keys: Iterable[str]) -> Optional[KeyPlan]:
    """How a checkpoint's keys (prefix stripped) become parameters: Tencent / ComfyUI names through original_plan,
    diffusers names as they are (None)."""
    return original_plan(keys, detection.config) if detection.layout == "original" else None


def original_plan(keys: Iterable[str], config) -> KeyPlan:
    """Tencent / ComfyUI key names -> parameters of the model of `config` (LoRAs use these names too)."""
    hidden = config["num_attention_heads"] * config["attention_head_dim"]
    return hunyuan_key_plan(keys, hidden, int(hidden * config["mlp_ratio"]), "time_text_embed")


def load_model(path: str, dtype: str = "default", device: torch.device | str = "cpu",
               detection: Optional[Detection] = None, options: Optional[dict] = None,
               progress: Optional[ProgressFn] = None, header: Optional[Header] = None
               ) -> tuple[torch.nn.Module, Detection, WeightDtypes]:
    """A diffusers HunyuanVideoTransformer3DModel with the checkpoint's weights, built with token-replace blocks
    (the same weights as the plain blocks; with no token to replace they compute the plain blocks)."""
    from diffusers import HunyuanVideoTransformer3DModel

    header, detection = detected_checkpoint(path, header, detection, detect, FAMILY, "HunyuanVideo 1.0")
    config = {**detection.config, "image_condition_type": "token_replace"}
    plan = weight_plan(detection, strip_prefix(header.tensors, detection.prefix))
    model, dtypes = load_checkpoint_model(HunyuanVideoTransformer3DModel, config, header, detection, dtype, device,
                                          plan, progress)
    return model, detection, dtypes


def load(request: LoadRequest, detection: Detection, device: torch.device, groups, progress: ProgressFn
         ) -> PlanWorker:
    """The pool's entry point: load on this worker's device, the executor running PLAN."""
    model, detection, dtypes = load_model(request.path, request.dtype, device, detection, request.options, progress,
                                          request.header)
    return PlanWorker(model, model_info(model, detection, dtypes), PLAN, dtypes, request.options)


def model_info(model, detection: Detection, dtypes: WeightDtypes, config_keys=CONFIG_KEYS) -> ModelInfo:
    """What the host needs of a loaded HunyuanVideo (1.0 or 1.5: its own config keys)."""
    config = model.config
    return ModelInfo(family=detection.family, variant=detection.variant, in_channels=config.in_channels,
                     out_channels=config.out_channels, x_ndim=5, config=config_entries(config, config_keys),
                     weight_dtype=dtypes.storage_name, compute_dtype=dtypes.compute_name)


# ---------------------------------------------------------------------------------------------------------------
# Sequence-parallel plan (HunyuanVideo 1.5's is this one with its differences): the image tokens [reference, video]
# split, each rank embedding its own share; the refined text replicated, after the image tokens in every block's
# joint attention (single blocks project it like the image); token replace modulates this rank's first-frame tokens

def check(call) -> None:
    config, x, inputs = call.config, call.x, call.inputs
    patch = patch_of(config)
    check_latent(x, config.in_channels, patch, "this HunyuanVideo")
    context = inputs.get("context")
    if context is None or context.dim() != 3 or context.shape[-1] != config.text_embed_dim:
        shape = None if context is None else list(context.shape)
        raise ValueError(f"HunyuanVideo needs context [B, L, {config.text_embed_dim}] (the text encoder's tokens); "
                         f"got {shape}")
    y = inputs.get("y")
    if y is None or y.dim() != 2 or y.shape[-1] < config.pooled_projection_dim:
        raise ValueError(f"HunyuanVideo needs y [B, {config.pooled_projection_dim}] (the CLIP pooled output); got "
                         f"{None if y is None else list(y.shape)}")
    for name, what in UNSUPPORTED_INPUTS.items():
        if inputs.get(name) is not None:
            raise ValueError(f"{name} ({what}) is not supported by the sequence-parallel HunyuanVideo")
    check_reference(inputs.get("ref_latent"), x, config.in_channels, patch, "HunyuanVideo")
    if inputs.get("ref_latent") is not None and inputs.get("guiding_frame_index") is not None:
        raise ValueError("ref_latent together with guiding_frame_index (token replace) is not supported by the "
                         "sequence-parallel HunyuanVideo: ComfyUI's blocks and final layer disagree there on which "
                         "tokens are the first frame's")


def check_reference(reference: Optional[torch.Tensor], x: torch.Tensor, channels: int, patch, name: str) -> None:
    """A ref_latent (if any) that x_embedder takes (x's channels, whole patches), one per batch item or one."""
    if reference is None:
        return
    check_latent(reference, channels, patch, f"this {name} (patch-embedding it like x)", "ref_latent")
    if reference.shape[0] not in (1, x.shape[0]):
        raise ValueError(f"ref_latent has batch {reference.shape[0]}; x has {x.shape[0]}: give one per item or one")


def check_latent(x: torch.Tensor, channels: int, patch: tuple[int, int, int], name: str, label: str = "x") -> None:
    """A [B, C, T, H, W] latent of whole patches (ComfyUI's HunyuanVideo models need them too); `label` names it."""
    if x.dim() != 5 or x.shape[1] != channels:
        raise ValueError(f"{label} has shape {list(x.shape)}; {name} takes [B, {channels}, T, H, W]")
    if any(size % p for size, p in zip(x.shape[2:], patch)):
        raise ValueError(f"{label} has frames, height, width {list(x.shape[2:])}, not multiples of {name}'s patch "
                         f"{list(patch)}: use a latent of whole patches (e.g. an image size divisible by 16)")


def patch_of(config) -> tuple[int, int, int]:
    return config.patch_size_t, config.patch_size, config.patch_size


def layout(call) -> list[Stream]:
    context = per_item(call.input("context"), call.batch)
    keep = text_keep(call, context.shape[1])
    text = refined_text(call.model.context_embedder, context, call.sigma(), keep)
    return [image_stream(call), text_stream(text, None, embedded, keep)]


def image_stream(call) -> Stream:
    """The video's tokens, led by ref_latent's when the call gives one: ComfyUI places those at frame -1, their
    columns shifted right by the video's width, and drops them from the output."""
    patch = patch_of(call.config)
    video = video_part(call.input("x"), patch, embed_patches)
    if call.inputs.get("ref_latent") is None:
        return Stream("image", [video])
    ahead = video_part(call.input("ref_latent"), patch, embed_patches, output=False)
    ahead.ids[:, 0] = -1
    ahead.ids[:, 2] += video.output.grid.cols
    return Stream("image", [ahead, video])


def embed_patches(model, patches: torch.Tensor) -> torch.Tensor:
    """x_embedder's Conv3d on this rank's patches, in the compute dtype (as ComfyUI)."""
    return conv_patch_embed(model.x_embedder.proj, patches, patches.dtype)


def embedded(model, states: torch.Tensor) -> torch.Tensor:
    """The text stream's embedder: its tokens are embedded (refined) whole in the layout already."""
    return states


def text_keep(call, length: int) -> Optional[torch.Tensor]:
    """The call's attention_mask as a text keep-mask on the device (None: every token kept)."""
    keep = text_key_mask(call.inputs.get("attention_mask"), call.batch, length)
    return None if keep is None else keep.to(call.device)


def refined_text(refiner, context: torch.Tensor, sigma: torch.Tensor, keep: Optional[torch.Tensor]) -> torch.Tensor:
    """The token refiner on the whole text, as ComfyUI runs it: pooled over every token (padding too) and every
    token attending to the kept ones. diffusers' refiners pool over kept tokens only and mask padded queries
    (1.5: into NaN rows), so their blocks run here with a keys-only mask."""
    embedding = refiner.time_text_embed(sigma, context.mean(dim=1))
    hidden = refiner.proj_in(context)
    mask = None if keep is None else keep[:, None, None, :]
    for block in refiner.token_refiner.refiner_blocks:
        hidden = block(hidden, embedding, mask)
    return hidden


def condition(call) -> None:
    """temb = time + pooled CLIP + guidance; token replace: replace_temb (the guiding frame index's time instead)
    for the `replaced` first-frame tokens that lead this rank's share."""
    embed, dtype = call.model.time_text_embed, call.dtype
    y = per_item(call.input("y"), call.batch)
    pooled = embed.text_embedder(y[:, :call.config.pooled_projection_dim])  # ComfyUI cuts y to the model's width
    guidance = _guidance_term(embed, call)
    call.temb = time_embedding(embed, call.sigma(), dtype) + pooled + guidance
    call.replace_temb, call.replaced = call.temb, 0
    index = call.inputs.get("guiding_frame_index")
    if index is not None:
        index = per_item(call.ctx.to_device("guiding_frame_index", index.reshape(-1), torch.float32), call.batch)
        call.replace_temb = time_embedding(embed, index, dtype) + pooled + guidance
        shard = call.shards["image"]
        call.replaced = max(0, min(shard.hi, shard.stream.parts[-1].output.grid.per_frame) - shard.lo)


def _guidance_term(embed, call):
    """The embedded guidance (x 1000, ComfyUI's timestep_embedding factor), or 0 when the model has no guidance
    embedding or the call gives none (ComfyUI leaves it out then)."""
    guidance = call.inputs.get("guidance")
    if embed.guidance_embedder is None or guidance is None:
        return 0
    values = per_item(call.ctx.to_device("guidance", guidance.reshape(-1), torch.float32), call.batch) * 1000
    return embed.guidance_embedder(embed.time_proj(values).to(call.dtype))


def time_embedding(embedder, values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """diffusers' sinusoidal projection + MLP of timestep-like values [B] (ComfyUI's timestep_embedding, factor 1)."""
    return embedder.timestep_embedder(embedder.time_proj(values).to(dtype))


def per_item(tensor: torch.Tensor, batch: int) -> torch.Tensor:
    """An input with one row per batch item; a batch-1 (or 0-D) input serves every item."""
    tensor = tensor.reshape(1) if tensor.dim() == 0 else tensor
    return tensor.expand(batch, *tensor.shape[1:]) if tensor.shape[0] == 1 else tensor


def token_replace_block(block, call) -> None:
    """diffusers' token-replace blocks (double and single): with no token replaced they compute the plain blocks."""
    call.image, call.text = block(call.image, call.text, call.temb, None, None, call.replace_temb, call.replaced)


def head(call) -> torch.Tensor:
    """The output AdaLayerNorm and projection; ComfyUI's final layer modulates token-replace tokens with their own
    embedding."""
    norm, hidden, replaced = call.model.norm_out, call.image, call.replaced
    if replaced:
        hidden = torch.cat([norm(hidden[:, :replaced], call.replace_temb), norm(hidden[:, replaced:], call.temb)],
                           dim=1)
    else:
        hidden = norm(hidden, call.temb)
    return call.model.proj_out(hidden)


def unpatch_order(call, tokens: torch.Tensor) -> torch.Tensor:
    """proj_out's features (c, pt, ph, pw) -> VideoGrid.write's (pt, ph, pw, c)."""
    return tokens.unflatten(-1, (call.config.out_channels, -1)).transpose(-1, -2).flatten(-2)


def _text_like_image(attn, text: torch.Tensor) -> list[torch.Tensor]:
    """Single-stream blocks project the text with the image's projections and norms."""
    return project_qkv(attn, text)[0]


IMAGE_FIRST = AttentionSpec(text_first=False)
PLAN = Plan(check=check, layout=layout, condition=condition, rope=lambda config: (config.rope_axes_dim, ROPE_THETA),
            stages=(Stage("transformer_blocks", token_replace_block, attention=IMAGE_FIRST),
                    Stage("single_transformer_blocks", token_replace_block,
                          attention=replace(IMAGE_FIRST, project_text=_text_like_image))),
            head=head, output_tokens=unpatch_order)


# ---------------------------------------------------------------------------------------------------------------
# Single-process reference (tests): diffusers' stock forward, ComfyUI's call convention around it

def reference_forward(model, x: torch.Tensor, timestep: torch.Tensor, context: torch.Tensor, y: torch.Tensor,
                      guidance: Optional[torch.Tensor] = None, guiding_frame_index=None,
                      ref_latent: Optional[torch.Tensor] = None, **_ignored) -> torch.Tensor:
    """ComfyUI's HunyuanVideo diffusion_model(...) computed by diffusers' own forward and processors on one process
    (ref_latent under reference_latent_hooks).

    Where diffusers' forward follows Tencent rather than ComfyUI, this equals ComfyUI only when: no padding mask
    (the refiner's pooled text), no guidance embedding with token replace, and frames after the first (diffusers'
    final layer ignores the token-replace modulation).
    """
    compute, device = model.proj_out.weight.dtype, model.proj_out.weight.device
    batch = x.shape[0]
    guidance = None if guidance is None else guidance.reshape(-1).expand(batch).to(device, torch.float32) * 1000
    if model.config.guidance_embeds and guidance is None:
        raise ValueError("diffusers' HunyuanVideo with a guidance embedding needs guidance")
    if (guiding_frame_index is not None) != (model.config.image_condition_type == "token_replace"):
        raise ValueError("build the reference with image_condition_type='token_replace' exactly for calls with "
                         "guiding_frame_index")
    if guiding_frame_index is not None and bool((guiding_frame_index != 0).any()):
        raise ValueError("diffusers' token replace embeds timestep 0 for the first frame: guiding_frame_index 0 only")
    with torch.no_grad(), reference_latent_hooks(model, x, ref_latent):
        out = model(hidden_states=x.to(device, compute), timestep=timestep.reshape(-1).expand(batch).to(device),
                    encoder_hidden_states=context.to(device, compute),
                    encoder_attention_mask=torch.ones(batch, context.shape[1], device=device),
                    pooled_projections=y[:, :model.config.pooled_projection_dim].to(device, compute),
                    guidance=guidance, return_dict=False)[0]
    return out.to(x.dtype).cpu()


@contextmanager
def reference_latent_hooks(model, x: torch.Tensor, reference: Optional[torch.Tensor]):
    """For the single-process references (tests): diffusers' HunyuanVideo 1.0 / 1.5 have no reference latent, so
    while this context is open, hooks on their x_embedder, rope and proj_out put the reference's patch embeddings
    ahead of the video's, their rotary angles (ComfyUI's positions, through diffusers' own 1-D rotary) ahead of the
    video's, and drop them before the output projection. No reference: no hooks."""
    if reference is None:
        yield
        return
    from diffusers.models.embeddings import get_1d_rotary_pos_embed
    config, weight = model.config, model.proj_out.weight
    patch = (config.patch_size_t, config.patch_size, config.patch_size)
    sizes = [[size // p for size, p in zip(latent.shape[2:], patch)] for latent in (reference, x)]
    axes = [torch.meshgrid(*(torch.arange(n, dtype=torch.float32) for n in grid), indexing="ij") for grid in sizes]
    axes[0] = (torch.full_like(axes[0][0], -1.0), axes[0][1], axes[0][2] + sizes[1][2])  # ComfyUI's placement
    positions = [torch.cat([grid[axis].flatten() for grid in axes]) for axis in range(3)]
    freqs = [get_1d_rotary_pos_embed(dim, where, config.rope_theta, use_real=True)
             for dim, where in zip(config.rope_axes_dim, positions)]
    rope = tuple(torch.cat([f[part] for f in freqs], dim=1).to(weight.device) for part in (0, 1))
    lead = sizes[0][0] * sizes[0][1] * sizes[0][2]
    with torch.no_grad():
        ahead = model.x_embedder(reference.expand(x.shape[0], *reference.shape[1:]).to(weight.device, weight.dtype))
    hooks = [model.x_embedder.register_forward_hook(lambda _m, _a, out: torch.cat([ahead, out], dim=1)),
             model.rope.register_forward_hook(lambda _m, _a, _out: rope),
             model.proj_out.register_forward_pre_hook(lambda _m, args: (args[0][:, lead:],))]
    try:
        yield
    finally:
        for hook in hooks:
            hook.remove()
