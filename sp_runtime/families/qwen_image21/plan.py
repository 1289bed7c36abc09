"""Qwen-Image 2.1's sequence-parallel plan: one joint sequence (ComfyUI's build_sequence: the text split at the image
slots, the references, then the target) split whole over the ranks; everything but attention is token-local (text
and references modulate from t = 0, the target from t); the block-causal mask goes to sp_attention as a SegmentMask,
exact under Ulysses, Ring and their hybrid."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch

from ...attention import Segment, SegmentMask
from ...sp import Output, Part, Plan, Stage, Stream
from ...sp.tensor_parallel import COLUMN, ROW, Split, TensorParallelPlan
from ...sp.tokens import ROPE_THETA, TokenGrid, as_list, text_key_mask


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
    joint = joint_layout(tuple(call.x.shape[-2:]), context.shape[1], refs, slot_list(call.inputs.get("image_slots")),
                         call.device)
    latents = iter([*(call.ctx.to_device(f"ref_latents.{n}", ref, call.dtype) for n, ref in enumerate(refs)),
                    call.input("x")])
    parts = []
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
            output="sequence",
            tensor_parallel=TensorParallelPlan(extra=(Split("img_mlp.proj", COLUMN), Split("img_mlp.gate_layer", COLUMN),
                                                      Split("img_mlp.out", ROW))))  # its SwiGLU MLP


def slot_list(value) -> list[int]:
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
