"""Lens' sequence-parallel plan: Qwen-Image's (qwen_image.PLAN: its blocks, the text replicated with its padding mask
and joined in every block, the head) with Lens' tokens: one token per latent pixel (split over the ranks) at (0, row,
column), rows and columns centred at -ceil(n / 2); the text at max(rows // 2, columns // 2) + i on every axis; the
timestep embedded from sigma in the compute dtype (as Mage-Flow's). Tensor parallelism: the generic splits plus the
SwiGLU MLPs' w1 / w3 (columns) and w2 (rows)."""
from __future__ import annotations

from dataclasses import replace

import torch

from ...sp import Stream, image_parts, text_stream
from ...sp.tensor_parallel import COLUMN, ROW, Split, TensorParallelPlan
from ...sp.tokens import text_key_mask
from .. import qwen_image
from ..mage_flow.plan import centred, condition

REFUSED_INPUTS = ("control", "ref_latents")  # ComfyUI's Lens takes neither ControlNet residuals we serve nor references
TENSOR_PARALLEL = TensorParallelPlan(extra=(Split("w1", COLUMN), Split("w3", COLUMN), Split("w2", ROW)))


def check(call) -> None:
    for name in REFUSED_INPUTS:
        if call.inputs.get(name) is not None:
            raise ValueError(f"{name} is not supported by the sequence-parallel Lens")
    channels, x = call.model.config.in_channels, call.x
    if x.dim() != 4 or x.shape[1] != channels:
        raise ValueError(f"x has shape {tuple(x.shape)}; this Lens takes [B, {channels}, H, W] (Flux.2's latent)")
    context = call.inputs.get("context")
    if context is None or context.dim() != 3 or context.shape[-1] != call.model.config.joint_attention_dim:
        raise ValueError(f"Lens needs context [batch, text tokens, {call.model.config.joint_attention_dim}] (its "
                         f"text encoder's layers side by side)")


def layout(call) -> list[Stream]:
    x = call.input("x")
    rows, cols = x.shape[-2:]
    image = image_parts([x], [centred(0, x)], 1, False, torch.float32, 3, "img_in", outputs=1)
    text = call.input("context")
    start = max(rows // 2, cols // 2)
    ids = torch.arange(start, start + text.shape[1], device=call.device, dtype=torch.float32)[:, None].expand(-1, 3)
    mask = text_key_mask(call.inputs.get("attention_mask"), call.x.shape[0], text.shape[1])
    call.text_mask = None if mask is None else mask.to(call.device)
    return [Stream("image", image), text_stream(text, ids, _embed_text, call.text_mask)]


def _embed_text(model, text: torch.Tensor) -> torch.Tensor:
    return model.txt_in(model.txt_norm(text))


PLAN = replace(qwen_image.PLAN, check=check, layout=layout, condition=condition, control=None,
               tensor_parallel=TENSOR_PARALLEL)
