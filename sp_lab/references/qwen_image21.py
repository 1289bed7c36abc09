"""Qwen-Image 2.1's single-device reference (tests, demo): diffusers' stock forward and processor, fed in its own
convention (text with placeholder slots where images go), its rotary table replaced by one at ComfyUI's ids."""
from __future__ import annotations

from typing import Optional

import torch

from sp_runtime.families.qwen_image21 import joint_layout, load_model, slot_list
from sp_runtime.sp.tokens import as_list, text_key_mask
from sp_lab.references import as_model


def reference_forward(model_or_path, x: torch.Tensor, timestep: torch.Tensor, context: torch.Tensor,
                      ref_latents=None, image_slots=None, attention_mask: Optional[torch.Tensor] = None,
                      dtype: str = "default", **_ignored) -> torch.Tensor:
    """ComfyUI's Qwen-Image 2.1 diffusion_model(...) computed by diffusers' own forward on one process.

    diffusers takes the text with placeholder slots (4 latent tokens each) where images go and the target's slots
    last; it cannot place half-token positions, so its rotary table is replaced by one at ComfyUI's position ids.
    Token counts of every image must be multiples of 4 (diffusers' slots), which ComfyUI does not need.
    """
    model = as_model(model_or_path, load_model, dtype)
    compute, device = model.proj_out.weight.dtype, model.proj_out.weight.device
    batch, _, height, width = x.shape
    refs = [ref.expand(batch, *ref.shape[1:]) for ref in as_list(ref_latents)]
    slots = (slot_list(image_slots) + [context.shape[1]] * len(refs))[:len(refs)]
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
