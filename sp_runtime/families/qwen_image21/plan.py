"""Qwen-Image 2.1 under Ulysses SP: detection from the header, loading into diffusers' QwenImage21Transformer2DModel,
and ComfyUI's `diffusion_model(x, timestep, context, ref_latents, image_slots)` (ComfyUI's comfy/ldm/qwen_image21).

2.1 is single-stream: text, reference latents (spliced into the text at their `image_slots`) and the target latent
form one sequence under a block-causal mask (text causal, each image block bidirectional, every block sees all that
precedes it). The whole joint sequence is split over the ranks and everything but attention is token-local (text and
references modulate from t = 0, the target from t); the mask goes to sp_attention as a SegmentMask, applied exactly
segment by segment where a rank holds the whole sequence for its heads (Ulysses), per query block x key block under
Ring and the hybrid.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Optional

import torch

from ..attention import Segment, SegmentMask
from ..sp import Output, Part, Plan, PlanWorker, Stage, Stream
from ..sp.tokens import ROPE_THETA, TokenGrid, as_list, rope_axes, text_key_mask
from ..contract import ComfyHost, Detection, LoadRequest, ModelInfo, config_entries
from ..checkpoints.loading import (KeyPlan, ProgressFn, WeightDtypes, count_blocks, detected_checkpoint, find_prefix,
                                   load_checkpoint_model, row_split, shape_of, strip_prefix)
from ..checkpoints.header import Header, header_config

FAMILY = "qwen_image21"
DESCRIPTION = "Qwen-Image 2.1 (t2i, turbo, edit)"


def _comfy_unet_config(info: ModelInfo) -> dict:
    return {"image_model": "qwen_image21", "in_channels": info.in_channels, "out_channels": info.out_channels}


COMFY = ComfyHost(model_classes={"": "QwenImage21"}, unet_config=_comfy_unet_config,
                  attributes=lambda info: {"patch_size": 1})  # 2.1 takes latents unpatched
ANCHORS = ("img_in.weight", "txt_in.in_layer.weight", "txt_in.text_norm.weight", "modulation.1.weight",
           "transformer_blocks.0.attn.norm_q.weight", "norm_out.linear.weight", "proj_out.weight")
FUSED_MLP = "img_mlp.gate_up"  # ComfyUI's files: [gate; up] rows in one tensor, diffusers' gate_layer and proj
CONFIG_KEYS = ("patch_size", "in_channels", "out_channels", "num_layers", "attention_head_dim", "num_attention_heads",
               "context_in_dim", "mlp_ratio", "axes_dims_rope", "causal_condition")
CLASS_NAME = "QwenImage21Transformer2DModel"


# ---------------------------------------------------------------------------------------------------------------
# Detection

def detect(header: Header) -> Optional[Detection]:
    """Qwen-Image 2.1 from its header alone (no weights read); None when the file is another family."""
    folder_config = header_config(header)
    if folder_config is not None and folder_config.get("_class_name") != CLASS_NAME:
        return None
    prefix = find_prefix(header.tensors, ANCHORS)
    if prefix is None:
        return None
    keys = strip_prefix(header.tensors, prefix)
    fused = f"transformer_blocks.0.{FUSED_MLP}.weight" in keys
    if folder_config:
        config = {key: folder_config[key] for key in CONFIG_KEYS if key in folder_config}
        config["axes_dims_rope"] = tuple(config.get("axes_dims_rope", (16, 56, 56)))
    else:
        config = architecture(keys, fused)
    return Detection(family=FAMILY, variant="image", layout="original" if fused else "diffusers", prefix=prefix,
                     config=config, files=header.source.files)


def architecture(keys: dict, fused: bool) -> dict:
    """QwenImage21Transformer2DModel config from header shapes (keys without prefix)."""
    hidden, in_channels = shape_of(keys, "img_in.weight")
    head_dim = shape_of(keys, "transformer_blocks.0.attn.norm_q.weight")[0]
    if hidden % head_dim:
        raise ValueError(f"Qwen-Image 2.1 width {hidden} is not a multiple of its head size {head_dim}")
    mlp_rows = (shape_of(keys, f"transformer_blocks.0.{FUSED_MLP}.weight")[0] // 2 if fused
                else shape_of(keys, "transformer_blocks.0.img_mlp.proj.weight")[0])
    if mlp_rows % hidden:
        raise ValueError(f"Qwen-Image 2.1 MLP width {mlp_rows} is not a multiple of its width {hidden}")
    return {
        "patch_size": 1,
        "in_channels": in_channels,
        "out_channels": shape_of(keys, "proj_out.weight")[0],
        "num_layers": count_blocks(keys, "transformer_blocks"),
        "attention_head_dim": head_dim,
        "num_attention_heads": hidden // head_dim,
        "context_in_dim": shape_of(keys, "txt_in.in_layer.weight")[1],
        "mlp_ratio": mlp_rows // hidden,
        "axes_dims_rope": rope_axes(head_dim),
        "causal_condition": True,
    }


# ---------------------------------------------------------------------------------------------------------------
# Key plan: ComfyUI's names are diffusers' except the fused SwiGLU input (gate rows first)

def weight_plan(detection: Detection, keys: Iterable[str]) -> Optional[KeyPlan]:
    """How a checkpoint's keys (prefix stripped) become parameters: ComfyUI files through original_plan, diffusers
    layouts as they are (None)."""
    return original_plan(keys, detection.config) if detection.layout == "original" else None


def original_plan(keys: Iterable[str], config) -> KeyPlan:
    """ComfyUI key names -> parameters (LoRAs use these names too); the fused MLP splits into gate_layer, proj."""
    rows = config["mlp_ratio"] * config["num_attention_heads"] * config["attention_head_dim"]
    plan = {}
    for key in keys:
        module, _, kind = key.rpartition(".")
        if module.endswith(FUSED_MLP):
            stem = module[:-len("gate_up")]
            plan[key] = row_split(stem, ("gate_layer", "proj"), kind, (rows, rows))
        else:
            plan[key] = [(key, None)]
    return plan


# ---------------------------------------------------------------------------------------------------------------
# Loading

def load_model(path: str, dtype: str = "default", device: torch.device | str = "cpu",
               detection: Optional[Detection] = None, options: Optional[dict] = None,
               progress: Optional[ProgressFn] = None, header: Optional[Header] = None
               ) -> tuple[torch.nn.Module, Detection, WeightDtypes]:
    """A diffusers QwenImage21Transformer2DModel with the checkpoint's weights (stock attention processors)."""
    from diffusers import QwenImage21Transformer2DModel

    header, detection = detected_checkpoint(path, header, detection, detect, FAMILY, "Qwen-Image 2.1")
    config = dict(detection.config)
    if options and "axes_dims_rope" in options:
        config["axes_dims_rope"] = tuple(options["axes_dims_rope"])
    plan = weight_plan(detection, strip_prefix(header.tensors, detection.prefix))
    model, dtypes = load_checkpoint_model(QwenImage21Transformer2DModel, config,
                                          header, detection, dtype, device, plan, progress)
    return model, detection, dtypes


def load(request: LoadRequest, detection: Detection, device: torch.device, groups, progress: ProgressFn
         ) -> PlanWorker:
    """The pool's entry point: load on this worker's device, the executor running PLAN."""
    model, detection, dtypes = load_model(request.path, request.dtype, device, detection, request.options, progress,
                                          request.header)
    return worker_from_model(model, detection, dtypes, request.options)


def worker_from_model(model, detection: Detection, dtypes: WeightDtypes, options: Optional[dict] = None
                      ) -> PlanWorker:
    config = model.config
    info = ModelInfo(family=FAMILY, variant=detection.variant, in_channels=config.in_channels,
                     out_channels=config.out_channels or config.in_channels, x_ndim=4,
                     config=config_entries(config, CONFIG_KEYS), weight_dtype=dtypes.storage_name,
                     compute_dtype=dtypes.compute_name)
    return PlanWorker(model, info, PLAN, dtypes, options)


# ---------------------------------------------------------------------------------------------------------------
# The joint sequence (ComfyUI's build_sequence): text split at the image slots, references, then the target

@dataclass
class JointLayout:
    """The joint sequence of one call: its parts in order, their segments and position ids."""

    parts: list[tuple[str, Any]]   # ("text", (start, end)) into context, or ("image", latent [B, C, h, w])
    segments: list[Segment]
    ids: torch.Tensor              # [S, 3] float (frame, row, col)
    prefix_len: int                # text and reference tokens before the target

    @property
    def total(self) -> int:
        return self.segments[-1].end


def joint_layout(x_hw: tuple[int, int], text_len: int, refs: list[torch.Tensor], slots: list[int],
                 device: torch.device) -> JointLayout:
    """ComfyUI's layout: reference i follows text token slots[i] (missing slots: after the text); reference rows
    and columns are centred on the target's grid, half a token off where the parities differ."""
    slots = (list(slots) + [text_len] * len(refs))[:len(refs)]
    bounds = [0, *slots, text_len]
    parts, segments, ids = [], [], []
    position, length = 0, 0
    for (start, end), image in zip(zip(bounds[:-1], bounds[1:]), [*refs, None]):
        if end > start:
            count = end - start
            parts.append(("text", (start, end)))
            segments.append(Segment(length, length + count, True))
            ids.append(torch.arange(position, position + count, dtype=torch.float64)[:, None].expand(count, 3))
            position, length = position + count, length + count
        height, width = image.shape[-2:] if image is not None else x_hw
        parts.append(("image", image))
        segments.append(Segment(length, length + height * width, False))
        ids.append(_image_ids(height, width, x_hw, position))
        position, length = position + max(height, width), length + height * width
    return JointLayout(parts, segments, torch.cat(ids).to(device), length - x_hw[0] * x_hw[1])


def _image_ids(height: int, width: int, target_hw: tuple[int, int], frame: int) -> torch.Tensor:
    rows = torch.arange(height, dtype=torch.float64) - (height - height // 2) + 0.5 * (height % 2 - target_hw[0] % 2)
    cols = torch.arange(width, dtype=torch.float64) - (width - width // 2) + 0.5 * (width % 2 - target_hw[1] % 2)
    ids = torch.empty(height, width, 3, dtype=torch.float64)
    ids[..., 0] = frame
    ids[..., 1] = rows[:, None]
    ids[..., 2] = cols[None, :]
    return ids.reshape(-1, 3)


# ---------------------------------------------------------------------------------------------------------------
# Sequence-parallel plan: the whole joint sequence split; everything but attention is token-local (text and
# references modulate from t = 0, the target from t); the block-causal mask goes to sp_attention (SegmentMask), exact
# under Ulysses, Ring and their hybrid

def check(call) -> None:
    config, x, inputs = call.config, call.x, call.inputs
    for name in ("control", "additional_t_cond"):
        if inputs.get(name) is not None:
            raise ValueError(f"{name} is not supported by the sequence-parallel Qwen-Image 2.1")
    if x.dim() != 4 or x.shape[1] != config.in_channels:
        raise ValueError(f"x has shape {tuple(x.shape)}; Qwen-Image 2.1 takes [B, {config.in_channels}, H, W]")
    context = inputs.get("context")
    if context is None or context.dim() != 3 or context.shape[-1] != config.context_in_dim:
        raise ValueError(f"Qwen-Image 2.1 needs context [batch, text tokens, {config.context_in_dim}] (the text "
                         f"encoder output)")
    for number, ref in enumerate(as_list(inputs.get("ref_latents"))):
        if ref.dim() != 4 or ref.shape[1] != config.in_channels or ref.shape[0] not in (1, x.shape[0]):
            raise ValueError(f"ref_latents[{number}] has shape {tuple(ref.shape)}; expected [B or 1, "
                             f"{config.in_channels}, h, w]")


def layout(call) -> list[Stream]:
    context, refs = call.input("context"), as_list(call.inputs.get("ref_latents"))
    joint = joint_layout(tuple(call.x.shape[-2:]), context.shape[1], refs, _slots(call.inputs.get("image_slots")),
                         call.device)
    latents = iter([*(call.ctx.to_device(f"ref_latents.{n}", ref, call.dtype) for n, ref in enumerate(refs)),
                    call.input("x")])
    parts, start = [], 0
    for (kind, value), segment in zip(joint.parts, joint.segments):
        ids = joint.ids[segment.start:segment.end]
        if kind == "text":
            parts.append(Part(context[:, value[0]:value[1]], ids, "txt_in"))
        else:
            latent = next(latents)
            output = Output(TokenGrid.of(*latent.shape[-2:], 1)) if segment.end == joint.total else None
            parts.append(Part(latent.flatten(2).transpose(1, 2), ids, "img_in", output))
    key_valid = _key_valid(call.inputs, call.batch, context.shape[1], joint, call.device)
    return [Stream("sequence", parts, mask=SegmentMask(joint.segments, key_valid))]


def condition(call) -> None:
    """The target's tokens modulate from t, text and references from t = 0 (the extra last row)."""
    call.target = call.shards["sequence"].flags(lambda part: part.output is not None, call.device)
    call.temb = call.model.time_text_embed(_comfy_sigma(call.sigma(), call.batch, call.dtype), call.sequence)
    call.modulation = call.model.modulation(call.temb)


def block(block, call) -> None:
    call.sequence = block(hidden_states=call.sequence, modulation=call.modulation, target_token_mask=call.target)


PLAN = Plan(check=check, layout=layout, rope=lambda config: (config.axes_dims_rope, ROPE_THETA), condition=condition,
            stages=(Stage("transformer_blocks", block, attends="sequence", text=None),),
            head=lambda call: call.model.proj_out(call.model.norm_out(call.sequence, call.temb, call.target)),
            output="sequence")


def _slots(value) -> list[int]:
    return [int(slot) for slot in (value.tolist() if isinstance(value, torch.Tensor) else as_list(value))]


def _comfy_sigma(sigma: torch.Tensor, batch: int, dtype: torch.dtype) -> torch.Tensor:
    """ComfyUI rounds t * 1000 and t to the compute dtype; the extra last row is t = 0 (text and references)."""
    sigma = ((sigma * 1000).to(dtype) / 1000).to(dtype)
    return torch.cat([sigma, sigma.new_zeros(1)])


def _key_valid(inputs: dict, batch: int, text_len: int, layout: JointLayout, device) -> Optional[torch.Tensor]:
    """A text padding mask (attention_mask over context tokens) as keys of the joint sequence; None: all valid."""
    keep = text_key_mask(inputs.get("attention_mask"), batch, text_len)
    if keep is None:
        return None
    valid = torch.ones(batch, layout.total, dtype=torch.bool)
    for (kind, value), segment in zip(layout.parts, layout.segments):
        if kind == "text":
            valid[:, segment.start:segment.end] = keep[:, value[0]:value[1]]
    return valid.to(device)


# ---------------------------------------------------------------------------------------------------------------
# Single-process reference (tests, demo): diffusers' stock forward and processor, fed in its own convention

def reference_forward(model_or_path, x: torch.Tensor, timestep: torch.Tensor, context: torch.Tensor,
                      ref_latents=None, image_slots=None, attention_mask: Optional[torch.Tensor] = None,
                      dtype: str = "default", **_ignored) -> torch.Tensor:
    """ComfyUI's Qwen-Image 2.1 diffusion_model(...) computed by diffusers' own forward on one process.

    diffusers takes the text with placeholder slots (4 latent tokens each) where images go and the target's slots
    last; it cannot place half-token positions, so its rotary table is replaced by one at ComfyUI's position ids.
    Token counts of every image must be multiples of 4 (diffusers' slots), which ComfyUI does not need.
    """
    model = model_or_path
    if not isinstance(model, torch.nn.Module):
        model = load_model(model_or_path, dtype)[0]
    compute, device = model.proj_out.weight.dtype, model.proj_out.weight.device
    batch, _, height, width = x.shape
    refs = [ref.expand(batch, *ref.shape[1:]) for ref in as_list(ref_latents)]
    slots = (_slots(image_slots) + [context.shape[1]] * len(refs))[:len(refs)]
    pieces, flags, mask_pieces = [], [], []
    keep = torch.ones(batch, context.shape[1], dtype=torch.bool) if attention_mask is None else \
        text_key_mask(attention_mask, batch, context.shape[1])
    keep = torch.ones(batch, context.shape[1], dtype=torch.bool) if keep is None else keep
    for start, end, image in zip([0, *slots], [*slots, context.shape[1]], [*refs, None]):
        pieces.append(context[:, start:end])
        mask_pieces.append(keep[:, start:end])
        flags += [False] * (end - start)
        if image is not None:
            count = _slot_count(image.shape[-2:])
            pieces.append(context.new_zeros(batch, count, context.shape[2]))
            mask_pieces.append(torch.ones(batch, count, dtype=torch.bool))
            flags += [True] * count
    img_mask = torch.tensor(flags + [True] * _slot_count((height, width)))[None].expand(batch, -1)
    latents = torch.cat([image.flatten(2).transpose(1, 2) for image in [*refs, x]], dim=1)
    layout = joint_layout((height, width), context.shape[1], as_list(ref_latents), slots, torch.device("cpu"))
    saved = model.pos_embed
    model.pos_embed = _ComfyRope(model.config.axes_dims_rope, layout.ids)
    sigma = timestep.reshape(-1).expand(batch).float()
    try:
        with torch.no_grad():
            tokens = model(hidden_states=latents.to(device, compute),
                           encoder_hidden_states=torch.cat(pieces, dim=1).to(device, compute),
                           timestep=((sigma * 1000).to(compute) / 1000).to(device, compute),
                           img_shapes=[[(1, *image.shape[-2:]) for image in [*refs, x]]] * batch,
                           img_mask=img_mask.to(device),
                           encoder_hidden_states_mask=None if attention_mask is None else
                           torch.cat(mask_pieces, dim=1).to(device), return_dict=False)[0]
    finally:
        model.pos_embed = saved
    return tokens[:, -height * width:].transpose(1, 2).reshape(x.shape).to(x.dtype).cpu()


def _slot_count(hw) -> int:
    tokens = int(hw[0]) * int(hw[1])
    if tokens % 4:
        raise ValueError(f"diffusers' Qwen-Image 2.1 needs image token counts divisible by 4; got {tuple(hw)}")
    return tokens // 4


class _ComfyRope(torch.nn.Module):
    """Stands in for diffusers' QwenImage21Rope: complex rotary factors at ComfyUI's (fractional) position ids,
    angles in float64 as ComfyUI's EmbedND."""

    def __init__(self, axes, ids: torch.Tensor):
        super().__init__()
        self.axes, self.ids = list(axes), ids

    def forward(self, img_shapes, image_pad_mask, device):
        factors = []
        for axis, dim in enumerate(self.axes):
            inverse = 1.0 / 10000 ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
            angles = torch.outer(self.ids[:, axis].double(), inverse)
            factors.append(torch.polar(torch.ones_like(angles), angles).to(torch.complex64))
        return torch.cat(factors, dim=-1).to(device)
