"""Wan 2.1 / 2.2 video (T2V, I2V, FLF2V, the A14B experts, TI2V 5B) under Ulysses SP: loading into diffusers'
WanTransformer3DModel and ComfyUI's `diffusion_model(x, timestep, context, clip_fea, time_dim_concat)`.

ComfyUI's call: x [B, C, T, H, W] (I2V: 36 channels, noise + mask + image latent), timestep = sigma x 1000 as [B]
or, for Wan 2.2 TI2V 5B with a denoise mask, [B, T] per latent frame; context [B, L, 4096]; clip_fea
[B, 257, 1280] for models with a CLIP image embedder. Returns [B, out_channels, T, H, W].

SP plan: every rank patch-embeds only its balanced share of the video tokens (Conv3d with kernel == stride is a
linear over flattened patches), takes the rotary embeddings and (TI2V) per-token modulations of those tokens,
runs self-attention through sp_attention and cross-attention locally against the replicated text / image context
(no communication), and writes its own output tokens. Header detection lives in wan_checkpoint.

Variants, each with its extra inputs split the same way: VACE (wan_vace: vace_context hint videos on the same token
split), Fun Control's reference image (wan_fun: reference_latent as a leading frame of tokens), Fun Camera
(wan_camera: camera_conditions embedded per token), HuMo (wan_humo: frame-local audio attention), S2V (wan_s2v:
reference and motion tokens after the video's, frame-local audio injection), Wan 2.2 Animate (wan_animate:
pose_latents embedded per token, face motion tokens attended frame by frame) and Wan Animate 2 (wan_animate2: a pose
branch through the same blocks whose keys / values each video frame attends to).
"""
from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any, Iterable, Optional

import torch

from ..attention import SeqShards, local_attention, sp_attention
from ..groups import SeqParallel
from ..sp.rope_options import is_identity, rotary_axis, scaled_positions
from ..contract import ComfyHost, Detection, HostHooks, LoadRequest, ModelInfo, config_entries, patch_size_2
from ..checkpoints.loading import (KeyPlan, ProgressFn, WeightDtypes, build_empty_model, choose_dtypes,
                                   detected_checkpoint, load_weights)
from ..checkpoints.header import Header, header_config
from ..sp.video_tokens import VideoGrid, pad_to_patch_3d
from .wan_checkpoint import (DEFAULT_HEAD_DIM, DIFFUSERS_IGNORED_SUFFIX, FAMILY, HEAD_DIM_METADATA_KEY,
                             folder_overrides, wan_key_plan)
from .wan_common import WanSinusoid, rotate, wan_sinusoid, wrap_pad
from .wan_checkpoint import detect  # noqa: F401 - the family's detector (found here through FAMILIES)
from .wan_animate import (FaceMotion, add_pose_tokens, check_animate_inputs, diffusers_arguments, no_face_reference,
                          prepare_face)
from .wan_animate2 import (POSE_TIMESTEP, Animate2SelfAttention, PoseAttention, PoseBranch, VideoAttention,
                           check_animate2_inputs, pose_positions, pose_tokens, strength)
from .wan_camera import CameraAddedEmbedding, attach_camera_adapter, camera_tokens
from .wan_humo import HumoAudio, attach_humo_modules, audio_reference_hooks, humo_block, prepare_audio
from .wan_fun import ReferenceFirstEmbedding, attach_reference_conv, embed_tokens, reference_frame
from .wan_s2v import S2VAudio, attach_s2v_modules, prepare_injection, prepare_sequence
from .wan_s2v import reference_forward as s2v_reference_forward
from .wan_vace import VaceHints, prepare_hints

DESCRIPTION = ("Wan 2.1 / 2.2 (T2V, I2V, FLF2V, A14B experts, TI2V 5B, VACE, Fun InP / Control / Camera, HuMo, S2V, "
               "Animate, Animate 2)")
COMFY_PATCH = (1, 2, 2)
WAN_ROPE_THETA = 10000.0  # diffusers' WanRotaryPosEmbed default (it keeps no theta attribute)


def _comfy_unet_config(info: ModelInfo) -> dict:
    return {"in_dim": info.in_channels, "out_dim": info.out_channels}


def _comfy_attributes(info: ModelInfo) -> dict:
    """ComfyUI's Wan classes read diffusion_model.patch_embedding.weight.shape (a plain object here, no weights)."""
    dim = int(info.config.get("dim", info.config.get("inner_dim", 0)) or 0)
    shape = torch.Size((dim, info.in_channels, *COMFY_PATCH))
    return {**patch_size_2(info), "patch_embedding": SimpleNamespace(weight=SimpleNamespace(shape=shape))}


# t2v, and i2v_concat (Wan 2.2 A14B I2V: image latent in extra input channels), map to WAN21_T2V
COMFY = ComfyHost(model_classes={"i2v": "WAN21_I2V", "flf2v": "WAN21_I2V", "ti2v": "WAN22_T2V", "vace": "WAN21_Vace",
                                 "fun_control": "WAN21_FunControl2V", "camera": "WAN21_Camera",
                                 "camera_2.2": "WAN22_Camera", "humo": "WAN21_HuMo", "s2v": "WAN22_S2V",
                                 "animate": "WAN22_Animate", "animate2": "WAN_Animate2",
                                 "": "WAN21_T2V"},
                  unet_config=_comfy_unet_config, attributes=_comfy_attributes, metadata_variants=("animate2",),
                  hooks=HostHooks(rope_options="applied"))
INFO_KEYS = ("patch_size", "num_layers", "text_dim", "ffn_dim", "freq_dim", "image_dim", "pos_embed_seq_len",
             "vace_layers", "vace_in_channels", "camera_in_channels")
EXTRA_MODULE_KEYS = ("ref_in_channels", "camera_in_channels", "camera_residual_blocks", "audio_in_features",
                     "audio_hidden", "audio_dim", "s2v", "animate2")
# inputs of the Wan variants; ComfyUI would use them, so never ignore them silently on a model without the modules
VARIANT_INPUTS = {"vace": ("vace_context", "vace_strength"), "camera": ("camera_conditions",),
                  "camera_2.2": ("camera_conditions",), "humo": ("audio_embed",),
                  "s2v": ("audio_embed", "reference_motion", "control_video"),
                  "animate": ("face_pixel_values", "pose_latents"),
                  "animate2": ("pose_latents", "context_pose", "clip_fea_pose")}
UNSUPPORTED_INPUTS = ("vace_context", "camera_conditions", "audio_embed", "reference_motion", "control_video",
                      "face_pixel_values", "pose_latents", "context_pose", "clip_fea_pose")


# ---------------------------------------------------------------------------------------------------------------
# Loading

def weight_plan(detection: Detection, keys: Iterable[str]) -> Optional[KeyPlan]:
    """How a checkpoint's keys (prefix stripped) become parameters, for load_model and for LoRA's re-reading of
    base weights: original-layout files through wan_key_plan, diffusers layouts as they are (None)."""
    return wan_key_plan(keys) if detection.layout == "original" else None


def original_plan(keys: Iterable[str], config) -> KeyPlan:
    """Original (Wan / ComfyUI) key names -> parameters (LoRAs use these names too); the same for every size."""
    return wan_key_plan(keys)


def model_config(detection: Detection, options: Optional[dict] = None) -> dict:
    """The diffusers config to build, with the head size from options["head_dim"] when given.

    Order of precedence: the head_dim option, then what the files state (diffusers config.json, original release
    config.json, or our test checkpoints' metadata key), then Wan's real head size, 128.
    """
    config = dict(detection.config)
    inner = config.pop("inner_dim_unsplit", None) or config["attention_head_dim"] * config["num_attention_heads"]
    wanted = (options or {}).get("head_dim") or config["attention_head_dim"]
    if wanted is None:
        raise ValueError(f"this Wan checkpoint is {inner} wide, which is not a multiple of Wan's head size "
                         f"{DEFAULT_HEAD_DIM}: load it with the option head_dim=<size> (or write the size in the "
                         f"file's safetensors metadata under {HEAD_DIM_METADATA_KEY!r})")
    head_dim = int(wanted)
    if head_dim < 6 or head_dim % 2 or inner % head_dim:
        raise ValueError(f"head_dim={head_dim} does not fit a Wan model {inner} wide: it must divide the width and "
                         f"be even and at least 6 (3-axis rotary embeddings)")
    config.update(attention_head_dim=head_dim, num_attention_heads=inner // head_dim)
    config["patch_size"] = tuple(config["patch_size"])
    return config


def load_model(path: str, dtype: str = "default", device: torch.device | str = "cpu",
               detection: Optional[Detection] = None, options: Optional[dict] = None,
               progress: Optional[ProgressFn] = None, header: Optional[Header] = None
               ) -> tuple[torch.nn.Module, Detection, WeightDtypes]:
    """WanTransformer3DModel (VACE: WanVACETransformer3DModel, Animate: WanAnimateTransformer3DModel) with the
    checkpoint's weights on `device`, stock attention processors."""
    from diffusers import WanAnimateTransformer3DModel, WanTransformer3DModel, WanVACETransformer3DModel

    header, detection = detected_checkpoint(path, header, detection, detect, FAMILY, "Wan")
    config = {**model_config(detection, options), **folder_overrides(header_config(header))}
    dtypes = choose_dtypes(dtype, header, detection.prefix)
    model_class = {"vace": WanVACETransformer3DModel, "animate": WanAnimateTransformer3DModel}.get(
        detection.variant, WanTransformer3DModel)
    extras = {key: config.pop(key, None) for key in EXTRA_MODULE_KEYS}
    model = build_empty_model(model_class, config, dtypes)
    attach_extra_modules(model, extras)
    keys = [key[len(detection.prefix):] for key in header.tensors if key.startswith(detection.prefix)]
    plan = weight_plan(detection, keys)
    ignore = [key for key in keys if key.endswith(DIFFUSERS_IGNORED_SUFFIX)] if plan is None else []
    load_weights(model, header.source, device=device, dtypes=dtypes, prefix=detection.prefix, plan=plan,
                 ignore=ignore, progress=progress)
    return model, detection, dtypes


def attach_extra_modules(model, extras: dict) -> None:
    """The modules of Wan variants that diffusers' classes lack (Fun Control's ref_conv, Fun Camera's adapter,
    HuMo's audio modules, S2V's)."""
    if extras.get("ref_in_channels"):
        attach_reference_conv(model, extras["ref_in_channels"])
    if extras.get("camera_in_channels"):
        attach_camera_adapter(model, extras["camera_in_channels"], extras["camera_residual_blocks"])
    if extras.get("audio_dim"):
        attach_humo_modules(model, extras["audio_in_features"], extras["audio_hidden"], extras["audio_dim"])
    if extras.get("s2v"):
        attach_s2v_modules(model, extras["s2v"])


def load(request: LoadRequest, detection: Detection, device: torch.device, groups, progress: ProgressFn
         ) -> "WanWorker":
    """The pool's entry point: load on this worker's device and switch attention to sequence parallel."""
    model, detection, dtypes = load_model(request.path, request.dtype, device, detection, request.options, progress,
                                          request.header)
    return worker_from_model(model, detection, dtypes, request.options)


def worker_from_model(model, detection: Detection, dtypes: WeightDtypes, options: Optional[dict] = None
                      ) -> "WanWorker":
    """The worker around a built model (load(), synthetic models), its attention switched to sequence parallel.

    options: the load options, already applied by model_config (none concern the worker).
    """
    self_attention = Animate2SelfAttention if detection.variant == "animate2" else WanSPSelfAttention
    for block in [*model.blocks, *getattr(model, "vace_blocks", ())]:
        block.attn1.set_processor(self_attention())
        block.attn2.set_processor(WanLocalCrossAttention())
    return WanWorker(model, detection, dtypes)


def model_info(model, detection: Detection, dtypes: WeightDtypes) -> ModelInfo:
    config = model.config
    described = config_entries(config, INFO_KEYS)
    described.update(dim=config.num_attention_heads * config.attention_head_dim,
                     num_heads=config.num_attention_heads, head_dim=config.attention_head_dim)
    if getattr(model, "ref_conv", None) is not None:
        described["ref_in_channels"] = model.ref_conv.in_channels
    if getattr(model, "control_adapter", None) is not None:
        described["camera_in_channels"] = model.control_adapter.in_channels
    if getattr(model, "audio_proj", None) is not None:
        described["audio_in_features"] = model.audio_proj.audio_proj_glob_1.layer.in_features
    if getattr(model, "audio_injector", None) is not None:
        described["audio_inject_layers"] = model.s2v_inject_layers
    return ModelInfo(family=FAMILY, variant=detection.variant, in_channels=config.in_channels,
                     out_channels=config.out_channels, x_ndim=5, config=described,
                     weight_dtype=dtypes.storage_name, compute_dtype=dtypes.compute_name)


# ---------------------------------------------------------------------------------------------------------------
# Attention processors of the sequence-parallel forward

@dataclass
class SelfAttentionPlan:
    """Passed to WanSPSelfAttention as `rotary_emb`: the split and this rank's rotary factors [1, n, 1, D/2]."""

    seq: SeqParallel
    shards: SeqShards
    cos: torch.Tensor
    sin: torch.Tensor


@dataclass
class CrossContext:
    """Passed to WanLocalCrossAttention as `encoder_hidden_states`: embedded text, and image context or None."""

    text: torch.Tensor
    image: Optional[torch.Tensor]


def _heads(attn, tensor: torch.Tensor) -> torch.Tensor:
    return tensor.unflatten(2, (attn.heads, -1))


class WanSPSelfAttention:
    """WanAttnProcessor's self-attention on this rank's tokens, attending over the whole split sequence."""

    def __call__(self, attn, hidden_states: torch.Tensor, encoder_hidden_states=None, attention_mask=None,
                 rotary_emb: Optional[SelfAttentionPlan] = None) -> torch.Tensor:
        plan = rotary_emb
        if not isinstance(plan, SelfAttentionPlan):
            raise TypeError("WanSPSelfAttention runs inside the sequence-parallel Wan forward only")
        query = _heads(attn, attn.norm_q(attn.to_q(hidden_states)))
        key = _heads(attn, attn.norm_k(attn.to_k(hidden_states)))
        value = _heads(attn, attn.to_v(hidden_states))
        query, key = rotate(query, plan.cos, plan.sin), rotate(key, plan.cos, plan.sin)
        out, _ = sp_attention(query, key, value, plan.seq, plan.shards)
        out = out.flatten(2, 3).type_as(query)
        return attn.to_out[1](attn.to_out[0](out))


class WanLocalCrossAttention:
    """WanAttnProcessor's cross-attention of this rank's tokens to the replicated context: no communication.

    The image context comes separately (diffusers splits a joint context assuming exactly 512 text tokens).
    """

    def __call__(self, attn, hidden_states: torch.Tensor, encoder_hidden_states: CrossContext = None,
                 attention_mask=None, rotary_emb=None) -> torch.Tensor:
        context = encoder_hidden_states
        if not isinstance(context, CrossContext):
            raise TypeError("WanLocalCrossAttention runs inside the sequence-parallel Wan forward only")
        query = _heads(attn, attn.norm_q(attn.to_q(hidden_states)))
        image_out = None
        if attn.add_k_proj is not None and context.image is not None:
            key_img = _heads(attn, attn.norm_added_k(attn.add_k_proj(context.image)))
            value_img = _heads(attn, attn.add_v_proj(context.image))
            image_out = local_attention(query, key_img, value_img).flatten(2, 3).type_as(query)
        key = _heads(attn, attn.norm_k(attn.to_k(context.text)))
        value = _heads(attn, attn.to_v(context.text))
        out = local_attention(query, key, value).flatten(2, 3).type_as(query)
        if image_out is not None:
            out = out + image_out
        return attn.to_out[1](attn.to_out[0](out))


# ---------------------------------------------------------------------------------------------------------------
# Sequence-parallel forward

class WanWorker:
    """A loaded Wan in one worker; forward() is ComfyUI's diffusion_model call, split over the sequence group."""

    def __init__(self, model, detection: Detection, dtypes: WeightDtypes):
        self.model = model
        self.dtypes = dtypes
        self.info = model_info(model, detection, dtypes)

    def forward(self, x: torch.Tensor, timestep: torch.Tensor, inputs: dict[str, Any], out: torch.Tensor,
                ctx) -> None:
        call = _prepare_call(self.model, self.dtypes.compute, x, timestep, inputs, ctx, self.info.variant)
        tokens = _run_blocks(self.model, call, ctx)
        skip = max(call.lead - call.lo, 0)  # reference-frame tokens are never output
        if tokens.shape[1] > skip:
            call.grid.write(out, tokens[:, skip:].to(out.dtype).cpu(), call.lo + skip - call.lead)


@dataclass
class _Call:
    """The prepared inputs of one call on this rank."""

    grid: VideoGrid                       # the video's tokens (x and time_dim_concat frames)
    lo: int                               # this rank's first token of the sequence
    lead: int                             # tokens before the video's: Fun Control's reference frame, or 0
    hidden: torch.Tensor                  # [b, n, dim] this rank's embedded patches
    attention: SelfAttentionPlan
    context: CrossContext
    block_modulation: torch.Tensor        # [b, 6, dim] or per token [b, n, 6, dim]
    out_modulation: torch.Tensor          # [b, 1, dim] or per token [b, n, dim]
    vace: Optional[VaceHints] = None      # VACE models: the hint videos' states on this rank's tokens
    audio: Optional[HumoAudio] = None     # HuMo models called with audio_embed
    injection: Optional[S2VAudio] = None  # S2V models called with audio_embed
    face: Optional[FaceMotion] = None     # Animate models called with face_pixel_values
    pose: Optional[PoseBranch] = None     # Animate 2 models called with pose_latents


def _prepare_call(model, dtype: torch.dtype, x, timestep, inputs, ctx, variant: str) -> _Call:
    _check_inputs(model.config, x, inputs, variant)
    batch = x.shape[0]
    latent = _video_latent(model, x, inputs, ctx, "reference_latent" if variant == "humo" else "time_dim_concat")
    grid = VideoGrid.of(tuple(latent.shape[2:]), tuple(model.config.patch_size))
    reference = reference_frame(model, inputs, x, ctx)
    lead = 0 if reference is None else grid.per_frame
    sequence = VideoGrid(grid.frames + (reference is not None), grid.rows, grid.cols, grid.patch)
    s2v = prepare_sequence(model, inputs, x, grid, ctx, dtype) if variant == "s2v" else None
    total = sequence.count if s2v is None else s2v.count
    seq = ctx.groups.seq
    shards = SeqShards.balanced(total, seq.degree)
    lo, hi = shards.range(seq.rank)
    hidden = embed_tokens(model, grid, latent, reference, lo, min(hi, sequence.count), dtype)
    if s2v is not None:
        hidden = s2v.embed(model, hidden, lo, hi, dtype)
    camera = camera_tokens(model, inputs, x, grid, lo, hi, ctx, dtype) if variant.startswith("camera") else None
    if camera is not None:
        hidden = hidden + camera
    if variant == "animate":
        hidden = add_pose_tokens(model, inputs, grid, lo, hi, hidden, ctx, dtype)
    context = _cross_context(model, inputs, ctx, dtype, batch)
    sigma = _per_item(ctx.to_device("timestep", timestep, torch.float32), batch)
    temb, projection = time_embeddings(model, sigma if s2v is None else s2v.timestep_entries(sigma), dtype)
    entries = token_entries(temb.shape[1], total, lo, hi, ctx.device)
    if entries is None:
        block_modulation, out_modulation = projection[:, 0], temb
    else:
        block_modulation, out_modulation = projection[:, entries], temb[:, entries]
    rope_options = inputs.get("rope_options")
    if variant in ("s2v", "animate", "animate2") and not is_identity(rope_options):
        raise ValueError(f"ScaleROPE's rope_options are not applied to Wan {variant} models by ulysses-sp (their "
                         f"extra token streams have positions of their own): remove the ScaleROPE node")
    cos, sin = rotary_factors(model.rope, sequence, sequence.positions(lo, hi, ctx.device), rope_options) \
        if s2v is None else s2v.rotary(model.rope, lo, hi)
    vace = prepare_hints(model, inputs, x, grid, lo, hi, hidden, block_modulation, ctx, dtype) \
        if variant == "vace" else None
    audio = prepare_audio(model, inputs, x, grid, lo, ctx, dtype) if variant == "humo" else None
    injection = prepare_injection(model, inputs, grid, lo, hi, ctx, dtype) if variant == "s2v" else None
    face = prepare_face(model, inputs, grid, lo, seq, ctx, dtype) if variant == "animate" else None
    attention = SelfAttentionPlan(seq, shards, cos, sin)
    pose = None
    if variant == "animate2":
        pose = _pose_branch(model, inputs, grid, seq, ctx, dtype, batch)
        attention = VideoAttention(seq, shards, cos, sin, grid.per_frame, pose and pose.attention,
                                   strength(inputs, "reference_strength"))
    return _Call(grid, lo, lead, hidden, attention, context, block_modulation, out_modulation, vace, audio, injection,
                 face, pose)


def _pose_branch(model, inputs, grid: VideoGrid, seq: SeqParallel, ctx, dtype, batch: int) -> Optional[PoseBranch]:
    """Wan Animate 2's pose branch on this rank's pose tokens: its own prompt and CLIP context where given, every
    block at the pose timestep."""
    embedded = pose_tokens(model, inputs, grid, batch, seq, ctx, dtype)
    if embedded is None:
        return None
    hidden, pose_grid, shards = embedded
    lo, hi = shards.range(seq.rank)
    cos, sin = rotary_factors(model.rope, pose_grid, pose_positions(pose_grid, lo, hi, ctx.device))
    attention = PoseAttention(seq, shards, cos, sin, strength(inputs, "pose_strength"))
    names = [name if inputs.get(name) is not None else main
             for name, main in (("context_pose", "context"), ("clip_fea_pose", "clip_fea"))]
    context = _cross_context(model, inputs, ctx, dtype, batch, *names)
    sigma = torch.full((batch,), POSE_TIMESTEP, device=ctx.device)
    return PoseBranch(hidden, attention, context, time_embeddings(model, sigma, dtype)[1][:, 0])


def _video_latent(model, x, inputs, ctx, appended: str) -> torch.Tensor:
    """x in float32 (ComfyUI embeds patches in float32), padded to whole patches, with the frames of input
    `appended` after it (time_dim_concat, e.g. Phantom subjects; HuMo's reference_latent): attended to, never
    output."""
    patch = tuple(model.config.patch_size)
    latent = pad_to_patch_3d(ctx.to_device("x", x, torch.float32), patch)
    extra = inputs.get(appended)
    if extra is None:
        return latent
    extra = pad_to_patch_3d(_per_item(ctx.to_device(appended, extra, torch.float32), x.shape[0]), patch)
    return torch.cat([latent, extra], dim=2)


def _cross_context(model, inputs, ctx, dtype: torch.dtype, batch: int, text_input: str = "context",
                   image_input: str = "clip_fea") -> CrossContext:
    text = _per_item(ctx.to_device(text_input, inputs[text_input], dtype), batch)
    text = model.condition_embedder.text_embedder(text)
    if model.condition_embedder.image_embedder is None:
        return CrossContext(text, None)  # ComfyUI ignores clip_fea for models without an image embedder
    clip = inputs.get(image_input)
    if clip is None:  # ComfyUI: an image model called without clip_fea attends its image branch to the text
        return CrossContext(text, text)
    return CrossContext(text, image_context(model, _per_item(ctx.to_device(image_input, clip, dtype), batch)))


def _per_item(tensor: torch.Tensor, batch: int) -> torch.Tensor:
    """An input with one row per batch item; a batch-1 input serves every item."""
    return tensor.expand(batch, *tensor.shape[1:]) if tensor.shape[0] == 1 else tensor


def _run_blocks(model, call: _Call, ctx) -> torch.Tensor:
    """The transformer blocks and the output head on this rank's tokens: [b, n, pt*ph*pw*out_channels]."""
    hidden = call.hidden
    for index, block in enumerate(model.blocks):
        ctx.check_cancel()
        if call.pose is not None:  # first: its keys / values feed this block's video attention
            call.pose.advance(block)
        if call.audio is not None:
            hidden = humo_block(block, hidden, call.context, call.block_modulation, call.attention, call.audio)
        else:
            hidden = block(hidden, call.context, call.block_modulation, call.attention)
        if call.vace is not None:
            hidden = call.vace.add(model, index, hidden, call)
        if call.injection is not None:
            hidden = call.injection.add(model, index, hidden)
        if call.face is not None:
            hidden = call.face.add(model, index, hidden)
    table = model.scale_shift_table
    if call.block_modulation.dim() == 3:  # one modulation for every token
        shift, scale = (table + call.out_modulation).chunk(2, dim=1)
    else:  # per-token modulation (Wan 2.2 TI2V 5B with per-frame timesteps)
        shift, scale = (table.unsqueeze(0) + call.out_modulation.unsqueeze(2)).chunk(2, dim=2)
        shift, scale = shift.squeeze(2), scale.squeeze(2)
    hidden = (model.norm_out(hidden.float()) * (1 + scale) + shift).type_as(hidden)
    return model.proj_out(hidden)


def _check_inputs(config, x: torch.Tensor, inputs: dict, variant: str) -> None:
    if x.dim() != 5 or x.shape[1] != config.in_channels:
        raise ValueError(f"x has shape {list(x.shape)}; this Wan takes [B, {config.in_channels}, T, H, W]")
    context = inputs.get("context")
    if context is None or context.dim() != 3 or context.shape[-1] != config.text_dim:
        shape = None if context is None else list(context.shape)
        raise ValueError(f"Wan needs context [B, L, {config.text_dim}] (the text encoder output); got {shape}")
    for name in UNSUPPORTED_INPUTS:
        if inputs.get(name) is not None and name not in VARIANT_INPUTS.get(variant, ()):
            raise ValueError(f"{name} belongs to a Wan variant the sequence-parallel Wan does not support")
    for name in ("time_dim_concat", "reference_latent") if variant == "humo" else ("time_dim_concat",):
        extra = inputs.get(name)
        if extra is not None and (extra.dim() != 5 or extra.shape[1] != x.shape[1] or extra.shape[3:] != x.shape[3:]):
            raise ValueError(f"{name} has shape {list(extra.shape)}; it must match x {list(x.shape)} in channels, "
                             f"height and width")
    if variant == "animate":
        check_animate_inputs(config, x, inputs)
    if variant == "animate2":
        check_animate2_inputs(config, x, inputs)
    if variant in ("humo", "s2v") and inputs.get("time_dim_concat") is not None:
        raise ValueError(f"time_dim_concat is not taken by a Wan {variant} model (as ComfyUI's HumoWanModel and "
                         f"WanModel_S2V: their extra frames come as reference_latent)")


def image_context(model, clip_fea: torch.Tensor) -> torch.Tensor:
    """CLIP image features -> image context, as ComfyUI's img_emb (FLF2V: positions added to the first tokens).

    diffusers' WanImageEmbedding instead reshapes [2B, 257] pairs into [B, 514]; ComfyUI gives [B, 514] directly.
    """
    embedder = model.condition_embedder.image_embedder
    if embedder.pos_embed is not None:
        clip_fea = clip_fea[:, :embedder.pos_embed.shape[1]]
        clip_fea = clip_fea + embedder.pos_embed[:, :clip_fea.shape[1]].to(clip_fea.dtype)
    return embedder.norm2(embedder.ff(embedder.norm1(clip_fea)))


def time_embeddings(model, sigma: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """timestep [b] or [b, E] (E per-frame entries) -> (temb [b, E', dim], projection [b, E', 6, dim]), E' = E or 1."""
    if sigma.dim() not in (1, 2):
        raise ValueError(f"timestep has shape {list(sigma.shape)}; Wan takes [B] or per-frame [B, T]")
    sigma = sigma.reshape(sigma.shape[0], -1)
    condition = model.condition_embedder
    embedder_dtype = next(iter(condition.time_embedder.parameters())).dtype
    sinusoid = wan_sinusoid(model.config.freq_dim, sigma.flatten()).to(embedder_dtype)
    temb = condition.time_embedder(sinusoid).to(dtype)
    projection = condition.time_proj(condition.act_fn(temb))
    batch, entries = sigma.shape
    return temb.view(batch, entries, -1), projection.view(batch, entries, 6, -1)


def token_entries(entries: int, total: int, lo: int, hi: int, device) -> Optional[torch.Tensor]:
    """Which per-frame timestep entry each token [lo, hi) takes, as ComfyUI's repeat_e spreads E entries over
    `total` tokens (E = latent frames: each frame's tokens share its entry); None for one shared entry."""
    if entries == 1:
        return None
    repeats = total // entries
    step = repeats if repeats * entries == total else repeats + 1
    return torch.arange(lo, hi, device=device) // step


def rotary_factors(rope, grid: VideoGrid, positions: torch.Tensor, rope_options: Optional[dict] = None
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """cos / sin [1, n, 1, D/2] for (frame, row, col) positions of the grid, from diffusers' WanRotaryPosEmbed
    tables; with ScaleROPE's rope_options, at the scaled and shifted positions (computed, not looked up)."""
    if not is_identity(rope_options):
        placed = scaled_positions(positions, rope_options)
        sizes = (rope.t_dim, rope.h_dim, rope.w_dim)
        axes = [rotary_axis(placed[:, axis], size, getattr(rope, "theta", WAN_ROPE_THETA))
                for axis, size in enumerate(sizes)]
        cos, sin = torch.cat([c for c, _ in axes], dim=1), torch.cat([s for _, s in axes], dim=1)
        return cos[None, :, None, 0::2], sin[None, :, None, 1::2]
    longest = max(grid.frames, grid.rows, grid.cols)
    if longest > rope.max_seq_len:
        raise ValueError(f"the video is {longest} patches long on one axis; Wan's rotary tables hold "
                         f"{rope.max_seq_len}")
    sizes = [rope.t_dim, rope.h_dim, rope.w_dim]
    cos_axes, sin_axes = rope.freqs_cos.split(sizes, dim=1), rope.freqs_sin.split(sizes, dim=1)
    cos = torch.cat([table[positions[:, axis]] for axis, table in enumerate(cos_axes)], dim=1)
    sin = torch.cat([table[positions[:, axis]] for axis, table in enumerate(sin_axes)], dim=1)
    return cos[None, :, None, 0::2], sin[None, :, None, 1::2]


# ---------------------------------------------------------------------------------------------------------------
# Single-process reference (tests, benchmarks): diffusers' stock forward, ComfyUI's packing around it

def reference_forward(model_or_path, x: torch.Tensor, timestep: torch.Tensor, context: torch.Tensor,
                      clip_fea: Optional[torch.Tensor] = None, time_dim_concat: Optional[torch.Tensor] = None,
                      dtype: str = "default", head_dim: Optional[int] = None,
                      vace_context: Optional[torch.Tensor] = None, vace_strength: Optional[list] = None,
                      reference_latent: Optional[torch.Tensor] = None,
                      camera_conditions: Optional[torch.Tensor] = None, audio_embed: Optional[torch.Tensor] = None,
                      reference_motion: Optional[torch.Tensor] = None, control_video: Optional[torch.Tensor] = None,
                      pose_latents: Optional[torch.Tensor] = None, face_pixel_values: Optional[torch.Tensor] = None,
                      **_ignored) -> torch.Tensor:
    """ComfyUI's Wan diffusion_model(...) computed by diffusers' own WanTransformer3DModel.forward on one process.

    Around the stock call: circular padding and cropping as ComfyUI, per-frame timesteps spread over their tokens
    (diffusers' per-token form), FLF2V's [B, 2N] CLIP features given as diffusers' [2B, N] pairs, and one
    departure inside: Wan's own timestep sinusoid (wan_sinusoid) replaces diffusers' Timesteps. diffusers' I2V
    processor assumes exactly 512 text tokens, so image models need context [B, 512, D] here. VACE: diffusers takes
    one hint video, so vace_context must hold one ([B, 1, C, T, H, W]); its strength scales every VACE layer.
    Fun Control's reference_latent: the stock forward on a latent one frame longer, whose frame 0 patch_embedding
    gives as ref_conv(reference_latent) (wan_fun.ReferenceFirstEmbedding), that frame cropped from the output.
    Fun Camera: the adapter's output added to patch_embedding's (wan_camera.CameraAddedEmbedding). HuMo:
    reference_latent frames appended as time_dim_concat's, audio attention hooked in (wan_humo.audio_reference_hooks).
    S2V: wan_s2v.reference_forward (diffusers' stock blocks over its whole sequence).
    Animate: diffusers' own pose and face inputs, which it needs with matching frame counts
    (wan_animate.diffusers_arguments); without a face video, the face adapter switched off
    (wan_animate.no_face_reference).
    """
    from diffusers.models.transformers.transformer_wan import WanAttnProcessor

    model = model_or_path
    if not isinstance(model, torch.nn.Module):
        model = load_model(model_or_path, dtype, options={"head_dim": head_dim} if head_dim else None)[0]
    if getattr(model, "audio_injector", None) is not None:
        return s2v_reference_forward(model, x, timestep, context, audio_embed, reference_latent, reference_motion,
                                     control_video)
    compute, device = model.scale_shift_table.dtype, model.scale_shift_table.device
    patch = tuple(model.config.patch_size)
    humo = getattr(model, "audio_proj", None) is not None
    if humo and reference_latent is not None:
        time_dim_concat, reference_latent = reference_latent, None
    latent = wrap_pad(x, patch)
    if time_dim_concat is not None:
        latent = torch.cat([latent, wrap_pad(time_dim_concat, patch).expand(x.shape[0], -1, -1, -1, -1)], dim=2)
    lead = int(reference_latent is not None and getattr(model, "ref_conv", None) is not None)
    if lead:
        latent = torch.cat([torch.zeros_like(latent[:, :, :1]), latent], dim=2)
    grid = [size // p for size, p in zip(latent.shape[2:], patch)]
    sigma = timestep.reshape(x.shape[0], -1).float()
    if sigma.shape[1] > 1:
        tokens = grid[0] * grid[1] * grid[2]
        sigma = sigma[:, token_entries(sigma.shape[1], tokens, 0, tokens, "cpu")]
    else:
        sigma = sigma[:, 0]
    image = None
    if model.condition_embedder.image_embedder is not None:
        if clip_fea is None or context.shape[1] != 512:
            raise ValueError("the diffusers reference of an image Wan needs clip_fea and 512 text tokens")
        image = clip_fea
        if model.condition_embedder.image_embedder.pos_embed is not None:
            image = clip_fea.reshape(2 * clip_fea.shape[0], clip_fea.shape[1] // 2, clip_fea.shape[2])
        image = image.to(device, compute)
    extra = {} if vace_context is None else _diffusers_vace_arguments(model, vace_context, vace_strength, patch)
    animate = getattr(model, "face_adapter", None) is not None
    if animate:
        pose = None if pose_latents is None else wrap_pad(pose_latents, patch)
        extra = diffusers_arguments(model, pose, face_pixel_values, latent.shape[2])
    saved = model.attn_processors, model.condition_embedder.timesteps_proj, model.patch_embedding
    model.set_attn_processor({name: processor if name.startswith("face_adapter.") else WanAttnProcessor()
                              for name, processor in saved[0].items()})  # Animate's face adapter keeps its own
    model.condition_embedder.timesteps_proj = WanSinusoid(model.config.freq_dim)
    if lead:
        reference = wrap_pad(reference_latent.unsqueeze(2), patch)[:, :, 0]
        model.patch_embedding = ReferenceFirstEmbedding(model, reference.to(device, compute))
    if camera_conditions is not None and getattr(model, "control_adapter", None) is not None:
        model.patch_embedding = CameraAddedEmbedding(model, camera_conditions.to(device, compute))
    hooks = audio_reference_hooks(model, audio_embed.to(device, compute), latent.shape[2]) \
        if humo and audio_embed is not None else no_face_reference(model, animate and face_pixel_values is None)
    try:
        with torch.no_grad(), hooks:
            result = model(hidden_states=latent.to(device, compute), timestep=sigma.to(device),
                           encoder_hidden_states=context.to(device, compute), encoder_hidden_states_image=image,
                           return_dict=False, **extra)[0]
    finally:
        model.set_attn_processor(saved[0])
        model.condition_embedder.timesteps_proj, model.patch_embedding = saved[1:]
    t, h, w = x.shape[2:]
    return result[:, :, lead:lead + t, :h, :w].to(x.dtype).cpu()


def _diffusers_vace_arguments(model, vace_context: torch.Tensor, vace_strength: Optional[list], patch) -> dict:
    if vace_context.shape[1] != 1:
        raise ValueError("diffusers' WanVACETransformer3DModel takes one hint video (vace_context [B, 1, ...])")
    strength = 1.0 if vace_strength is None else float(vace_strength[0])
    device, compute = model.scale_shift_table.device, model.scale_shift_table.dtype
    return {"control_hidden_states": wrap_pad(vace_context[:, 0], patch).to(device, compute),
            "control_hidden_states_scale": torch.full((len(model.config.vace_layers),), strength, device=device)}
