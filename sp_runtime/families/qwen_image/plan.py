"""Qwen-Image (Edit, Layered) under Ulysses SP: detection from the header, loading into diffusers'
QwenImageTransformer2DModel, and ComfyUI's `diffusion_model(x, timestep, context, attention_mask, ref_latents,
additional_t_cond)`.

ComfyUI and diffusers name Qwen-Image's weights the same way, so a ComfyUI file needs no key conversion beyond
dropping a `model.diffusion_model.` prefix. Qwen-Image, Qwen-Image-Edit and Edit-2509 share one architecture: their
headers look alike and the call (reference latents or not) decides; Edit-2511 files carry ComfyUI's
`__index_timestep_zero__` marker (diffusers folders: `zero_cond_t` in config.json), or pass option variant="edit_2511".
Qwen-Image-Layered files carry `time_text_embed.addition_t_embedding` (a learned offset of the time embedding chosen by
`additional_t_cond`, 0 by default as in ComfyUI); their latents hold the RGBA layers as frames [B, C, T, H, W], whose
tokens follow one another frame by frame at rotary index 0 .. T-1, as ComfyUI places any multi-frame Qwen latent, and
the input image (`ref_latents`) goes at index -1 unless the call names a method (ComfyUI's default for Layered).
"""
from __future__ import annotations

from dataclasses import replace
from typing import Iterable, Optional

import torch

from ..sp import Plan, PlanWorker, Stage, Stream, image_parts, text_stream
from ..sp.tokens import (ROPE_THETA, TokenGrid, as_list, grid_ids, reference_pack, reference_placements,
                         reference_unpack, rope_axes, text_key_mask)
from ..contract import ComfyHost, Detection, HostHooks, LoadRequest, ModelInfo, config_entries
from ..checkpoints.loading import (KeyPlan, ProgressFn, WeightDtypes, count_blocks, detected_checkpoint, find_prefix,
                                   identity_plan, load_checkpoint_model, shape_of, strip_prefix)
from ..checkpoints.header import Header, header_config

FAMILY = "qwen_image"
DESCRIPTION = "Qwen-Image / Qwen-Image-Edit (2509, 2511)"


def _comfy_unet_config(info: ModelInfo) -> dict:
    return {"in_channels": info.in_channels * 4}  # ComfyUI counts packed 2x2 patch features


COMFY = ComfyHost(model_classes={"": "QwenImage"}, unet_config=_comfy_unet_config,
                  hooks=HostHooks(rope_options="ignored"))
PATCH = 2
ANCHORS = ("txt_norm.weight", "img_in.weight", "txt_in.weight", "transformer_blocks.0.attn.norm_q.weight",
           "proj_out.weight")
EDIT_2511_MARKER = "__index_timestep_zero__"  # ComfyUI's flag tensor in Qwen-Image-Edit-2511 files
LAYERED_MARKER = "time_text_embed.addition_t_embedding.weight"
REF_METHODS = ("index", "index_timestep_zero", "negative_index")  # others place references side by side
CONFIG_KEYS = ("patch_size", "in_channels", "out_channels", "num_layers", "attention_head_dim", "num_attention_heads",
               "joint_attention_dim", "axes_dims_rope", "zero_cond_t", "use_additional_t_cond", "use_layer3d_rope")
VARIANT_IMAGE = "image"         # Qwen-Image, Qwen-Image-Edit, Edit-2509 (one architecture)
VARIANT_EDIT_2511 = "edit_2511"  # reference tokens modulated with timestep 0 by default
VARIANT_LAYERED = "layered"     # Qwen-Image-Layered: additional_t_cond, layers as frames


# ---------------------------------------------------------------------------------------------------------------
# Detection

def detect(header: Header) -> Optional[Detection]:
    """Qwen-Image from its header alone (no weights read); None when the file is another family."""
    folder_config = header_config(header)
    if folder_config is not None and folder_config.get("_class_name") != "QwenImageTransformer2DModel":
        return None
    prefix = find_prefix(header.tensors, ANCHORS)
    if prefix is None:
        return None
    keys = strip_prefix(header.tensors, prefix)
    config = _folder_config(folder_config) if folder_config else architecture(keys)
    if EDIT_2511_MARKER in keys:
        config["zero_cond_t"] = True
    if LAYERED_MARKER in keys:
        config["use_additional_t_cond"] = config["use_layer3d_rope"] = True
    variant = (VARIANT_LAYERED if config.get("use_additional_t_cond") else
               VARIANT_EDIT_2511 if config.get("zero_cond_t") else VARIANT_IMAGE)
    return Detection(family=FAMILY, variant=variant, layout="diffusers", prefix=prefix, config=config,
                     files=header.source.files)


def architecture(keys: dict) -> dict:
    """QwenImageTransformer2DModel config from header shapes (keys without prefix)."""
    hidden, in_features = shape_of(keys, "img_in.weight")
    head_dim = shape_of(keys, "transformer_blocks.0.attn.norm_q.weight")[0]
    if hidden % head_dim:
        raise ValueError(f"Qwen-Image width {hidden} is not a multiple of its head size {head_dim}")
    out_features = shape_of(keys, "proj_out.weight")[0]
    return {
        "patch_size": PATCH,
        "in_channels": in_features,
        "out_channels": out_features // (PATCH * PATCH),
        "num_layers": count_blocks(keys, "transformer_blocks"),
        "attention_head_dim": head_dim,
        "num_attention_heads": hidden // head_dim,
        "joint_attention_dim": shape_of(keys, "txt_in.weight")[1],
        "axes_dims_rope": rope_axes(head_dim),
        "zero_cond_t": False,
        "use_additional_t_cond": False,
        "use_layer3d_rope": False,
    }


def _folder_config(config: dict) -> dict:
    known = {key: config[key] for key in CONFIG_KEYS if key in config}
    for flag in ("zero_cond_t", "use_additional_t_cond", "use_layer3d_rope"):
        known.setdefault(flag, False)
    if "axes_dims_rope" in known:
        known["axes_dims_rope"] = tuple(known["axes_dims_rope"])
    return known


# ---------------------------------------------------------------------------------------------------------------
# Loading

def weight_plan(detection: Detection, keys: Iterable[str]) -> Optional[KeyPlan]:
    """How a checkpoint's keys (prefix stripped) become parameters, for load_model and for LoRA's re-reading of
    base weights: as they are (None), in every layout (see original_plan)."""
    return None


def original_plan(keys: Iterable[str], config) -> KeyPlan:
    """ComfyUI (original) key names -> parameters: ComfyUI names Qwen-Image's weights as diffusers does."""
    return identity_plan(keys)


def load_model(path: str, dtype: str = "default", device: torch.device | str = "cpu",
               detection: Optional[Detection] = None, options: Optional[dict] = None,
               progress: Optional[ProgressFn] = None, header: Optional[Header] = None
               ) -> tuple[torch.nn.Module, Detection, WeightDtypes]:
    """A diffusers QwenImageTransformer2DModel with the checkpoint's weights (stock attention processors)."""
    from diffusers import QwenImageTransformer2DModel

    header, detection = detected_checkpoint(path, header, detection, detect, FAMILY, "Qwen-Image")
    detection = _with_options(detection, options or {})
    plan = weight_plan(detection, strip_prefix(header.tensors, detection.prefix))
    model, dtypes = load_checkpoint_model(QwenImageTransformer2DModel, detection.config,
                                          header, detection, dtype, device, plan, progress, ignore=(EDIT_2511_MARKER,))
    return model, detection, dtypes


def _with_options(detection: Detection, options: dict) -> Detection:
    """Apply load options: variant="edit_2511" (files that cannot say so), axes_dims_rope (unusual head sizes)."""
    config = dict(detection.config)
    if "axes_dims_rope" in options:
        config["axes_dims_rope"] = tuple(options["axes_dims_rope"])
    variant = options.get("variant") or detection.variant
    if variant not in (VARIANT_IMAGE, VARIANT_EDIT_2511, VARIANT_LAYERED):
        raise ValueError(f"Qwen-Image variant {variant!r} is unknown; use {VARIANT_IMAGE!r} or {VARIANT_EDIT_2511!r}")
    if (variant == VARIANT_LAYERED) != (detection.variant == VARIANT_LAYERED):
        raise ValueError(f"variant {variant!r} does not fit this {detection.variant!r} file: Qwen-Image-Layered is "
                         f"told by its weights (time_text_embed.addition_t_embedding), not by an option")
    config["zero_cond_t"] = variant == VARIANT_EDIT_2511
    return replace(detection, variant=variant, config=config)


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
                     out_channels=config.out_channels, x_ndim=5,
                     config=config_entries(config, CONFIG_KEYS),
                     weight_dtype=dtypes.storage_name, compute_dtype=dtypes.compute_name)


# ---------------------------------------------------------------------------------------------------------------
# Sequence-parallel plan: the output latent's frames and the references split, the text replicated (with its padding
# mask) and joined in every block; Edit-2511 modulates the reference tokens at timestep 0 (per-token conditioning)

def default_ref_method(config) -> str:
    """Where reference latents go when the call names no method, as ComfyUI's detection sets it per variant:
    Layered puts the input image at index -1 (its layers are frames 0 .. T-1), Edit-2511 at index 1 with timestep 0,
    the others at index 1."""
    if config.use_additional_t_cond:
        return "negative_index"
    return "index_timestep_zero" if config.zero_cond_t else "index"


def check(call) -> None:
    _check_unsupported(call.inputs)
    _check_latent(call.model, call.x)
    context = call.inputs.get("context")
    if context is None or context.dim() != 3:
        raise ValueError("Qwen-Image needs context [batch, text tokens, features] (the text encoder output)")
    for ref in as_list(call.inputs.get("ref_latents")):
        _as_4d(ref, "ref_latents")


def layout(call) -> list[Stream]:
    """Frames at rotary index 0 .. T-1 (ComfyUI), references placed by the method, text ids after the centred
    image; the text mask is checked on the host (no device sync)."""
    x, inputs = call.x, call.inputs
    frames = _frames(call.input("x"))
    refs = as_list(inputs.get("ref_latents"))
    call.method = (inputs.get("ref_latents_method") or call.options.get("ref_latents_method")
                   or default_ref_method(call.config))
    places = reference_placements(call.method, tuple(x.shape[-2:]), [_as_4d(r, "").shape[-2:] for r in refs], PATCH,
                                  REF_METHODS)
    refs = [_as_4d(call.ctx.to_device(f"ref_latents.{n}", ref, call.dtype), "ref_latents")
            for n, ref in enumerate(refs)]
    call.zero_refs = call.method == "index_timestep_zero" and bool(refs)
    image = image_parts(frames + refs, [(frame, 0, 0) for frame in range(len(frames))] + places, PATCH, True,
                        x.dtype, 3, "img_in", outputs=len(frames))
    text = call.input("context")
    grid = image[0].output.grid
    start = max(grid.rows // 2, grid.cols // 2)  # ComfyUI: text ids follow the centred image
    ids = torch.arange(start, start + text.shape[1], device=call.device, dtype=torch.float32)[:, None].expand(-1, 3)
    mask = text_key_mask(inputs.get("attention_mask"), x.shape[0], text.shape[1])
    call.text_mask = None if mask is None else mask.to(call.device)
    return [Stream("image", image), text_stream(text, ids, _embed_text, call.text_mask)]


def _embed_text(model, text: torch.Tensor) -> torch.Tensor:
    return model.txt_in(model.txt_norm(text))


def condition(call) -> None:
    """ComfyUI embeds the timestep from float32 sigma (diffusers would round it to the compute dtype first)."""
    sigma, call.modulate_index = call.sigma(), None
    t_cond = _time_condition(call.model, call.inputs.get("additional_t_cond"), call.batch, call.ctx)
    if call.zero_refs:
        sigma, t_cond = torch.cat([sigma, sigma * 0]), None if t_cond is None else t_cond.repeat(2)
        references = call.shards["image"].flags(lambda part: part.output is None, call.device)
        call.modulate_index = references.int()[None].expand(call.batch, -1)
    call.temb = call.model.time_text_embed(sigma, call.image, t_cond)


def block(block, call) -> None:
    block.zero_cond_t = call.zero_refs  # diffusers' blocks read this flag for the text modulation
    call.text, call.image = block(hidden_states=call.image, encoder_hidden_states=call.text,
                                  encoder_hidden_states_mask=call.text_mask, temb=call.temb,
                                  modulate_index=call.modulate_index)


def head(call) -> torch.Tensor:
    temb = call.temb.chunk(2, dim=0)[0] if call.zero_refs else call.temb
    return call.model.proj_out(call.model.norm_out(call.image, temb))


PLAN = Plan(check=check, layout=layout, rope=lambda config: (config.axes_dims_rope, ROPE_THETA), condition=condition,
            stages=(Stage("transformer_blocks", block),), head=head)


def _time_condition(model, value, batch: int, ctx) -> Optional[torch.Tensor]:
    """Layered's additional_t_cond as long [batch] (0 when not given, as ComfyUI); None for models without it
    (ComfyUI reads past it there too)."""
    if not model.config.use_additional_t_cond:
        return None
    if value is None:
        return torch.zeros(batch, dtype=torch.long, device=ctx.device)
    value = torch.as_tensor(value).reshape(-1)
    if value.numel() not in (1, batch) or value.is_floating_point() or bool(((value < 0) | (value > 1)).any()):
        raise ValueError(f"additional_t_cond must be 0 or 1 per batch item (Qwen-Image-Layered's two time "
                         f"embeddings); got {value.tolist()}")
    return ctx.to_device("additional_t_cond", value.long().expand(batch))


def _check_latent(model, x: torch.Tensor) -> tuple[int, int]:
    if x.dim() not in (4, 5):
        raise ValueError(f"x has shape {tuple(x.shape)}; Qwen-Image takes [B, C, T, H, W] (T = 1, or the layers of "
                         f"Qwen-Image-Layered)")
    channels, height, width = x.shape[1], x.shape[-2], x.shape[-1]
    if channels * PATCH * PATCH != model.config.in_channels:
        raise ValueError(f"x has {channels} channels but this Qwen-Image takes "
                         f"{model.config.in_channels // (PATCH * PATCH)}")
    return height, width


def _check_unsupported(inputs: dict) -> None:
    for name in ("control", "eligen_entity_prompt_emb", "eligen_entity_masks"):
        if inputs.get(name) is not None:
            raise ValueError(f"{name} is not supported by the sequence-parallel Qwen-Image")


def _frames(latent: torch.Tensor) -> list[torch.Tensor]:
    """[B, C, T, H, W] (ComfyUI's Qwen latents) or [B, C, H, W] -> its T frames [B, C, H, W] (views)."""
    return list(latent.unbind(2)) if latent.dim() == 5 else [latent]


def _as_4d(latent: torch.Tensor, name: str) -> torch.Tensor:
    """[B, C, 1, H, W] (ComfyUI's Qwen latents) or [B, C, H, W] -> [B, C, H, W] view."""
    if latent.dim() == 5:
        if latent.shape[2] != 1:
            raise ValueError(f"{name} has {latent.shape[2]} frames; Qwen-Image takes one frame ([B, C, 1, H, W])")
        return latent[:, :, 0]
    if latent.dim() != 4:
        raise ValueError(f"{name} has shape {tuple(latent.shape)}; Qwen-Image takes [B, C, 1, H, W]")
    return latent


# ---------------------------------------------------------------------------------------------------------------
# Single-process reference (tests, demo, benchmarks): diffusers' stock forward and processors, ComfyUI's packing

def reference_forward(model_or_path, x: torch.Tensor, timestep: torch.Tensor, context: torch.Tensor,
                      attention_mask: Optional[torch.Tensor] = None, ref_latents=None,
                      ref_latents_method: Optional[str] = None, additional_t_cond=None, dtype: str = "default",
                      **_ignored) -> torch.Tensor:
    """ComfyUI's Qwen-Image diffusion_model(...) computed by diffusers' own forward on one process (Layered: the
    frames of x packed one after the other, additional_t_cond 0 unless given).

    The only departure from the stock call is the rotary position lookup: diffusers' tables are addressed with
    ComfyUI's position ids (diffusers centres odd grids one step differently and starts the text after the largest
    reference image).
    """
    model = model_or_path
    if not isinstance(model, torch.nn.Module):
        model = load_model(model_or_path, dtype)[0]
    compute = model.proj_out.weight.dtype
    device = model.proj_out.weight.device
    frames = list(x.unbind(2)) if x.dim() == 5 else [x]
    batch = x.shape[0]
    refs = [_as_4d(ref, "ref_latents") for ref in as_list(ref_latents)]
    method = ref_latents_method or default_ref_method(model.config)
    height, width = x.shape[-2:]
    packed, shapes, id_parts = [], [], []
    placements = [(index, 0, 0) for index in range(len(frames))] + reference_placements(
        method, (height, width), [r.shape[-2:] for r in refs], PATCH, REF_METHODS)
    for part, (index, row_offset, col_offset) in zip([*frames, *refs], placements):
        part = part.expand(batch, *part.shape[1:])
        tokens, grid = reference_pack(part.to(device, compute), PATCH)
        packed.append(tokens)
        shapes.append((1, grid.rows, grid.cols))
        id_parts.append(grid_ids(grid, index, row_offset, col_offset, True, x.dtype, device))
    grid = TokenGrid.of(height, width, PATCH)
    shapes = [(len(frames), grid.rows, grid.cols)] + shapes[len(frames):]
    zero_refs = method == "index_timestep_zero" and bool(refs)
    t_cond = None
    if model.config.use_additional_t_cond:
        t_cond = torch.zeros(batch, dtype=torch.long) if additional_t_cond is None else \
            torch.as_tensor(additional_t_cond).reshape(-1).long().expand(batch)
        t_cond = t_cond.to(device)
    mask = None if attention_mask is None else attention_mask.to(device)
    if mask is not None and mask.is_floating_point():
        mask = mask == 0 if bool((mask < 0).any()) else mask != 0
    positions = _ComfyPositions(model.pos_embed, torch.cat(id_parts), max(grid.rows // 2, grid.cols // 2))
    saved = model.pos_embed, model.zero_cond_t, [block.zero_cond_t for block in model.transformer_blocks]
    model.pos_embed, model.zero_cond_t = positions, zero_refs
    for block in model.transformer_blocks:
        block.zero_cond_t = zero_refs
    try:
        with torch.no_grad():
            tokens = model(hidden_states=torch.cat(packed, dim=1), encoder_hidden_states=context.to(device, compute),
                           encoder_hidden_states_mask=mask,
                           timestep=timestep.reshape(-1).expand(batch).to(device, compute),
                           img_shapes=[shapes] * batch, additional_t_cond=t_cond, return_dict=False)[0]
    finally:
        model.pos_embed, model.zero_cond_t = saved[0], saved[1]
        for block, flag in zip(model.transformer_blocks, saved[2]):
            block.zero_cond_t = flag
    count = grid.count
    result = torch.stack([reference_unpack(tokens[:, index * count:(index + 1) * count], grid)
                          for index in range(len(frames))], dim=2).to(x.dtype).cpu()
    return result if x.dim() == 5 else result[:, :, 0]


class _ComfyPositions(torch.nn.Module):
    """Stands in for diffusers' QwenEmbedRope / QwenEmbedLayer3DRope: its own complex tables, looked up at ComfyUI's
    position ids."""

    def __init__(self, table, image_ids: torch.Tensor, text_start: int):
        super().__init__()
        self.table, self.image_ids, self.text_start = table, image_ids, text_start

    def forward(self, video_fhw, device=None, max_txt_seq_len=None):
        halves = [dim // 2 for dim in self.table.axes_dim]
        positive = self.table.pos_freqs.split(halves, dim=1)
        negative = self.table.neg_freqs.split(halves, dim=1)  # row j holds position j - len(table)

        def look_up(ids):
            columns = []
            for axis in range(3):
                position = ids[:, axis].long().cpu()
                rows = torch.where(position >= 0, position, position + negative[axis].shape[0])
                columns.append(torch.where((position >= 0)[:, None], positive[axis][rows], negative[axis][rows]))
            return torch.cat(columns, dim=1).to(device)

        text = torch.arange(self.text_start, self.text_start + int(max_txt_seq_len))[:, None].expand(-1, 3)
        return look_up(self.image_ids), look_up(text)
