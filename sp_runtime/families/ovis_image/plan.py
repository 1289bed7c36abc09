"""Ovis-Image's sequence-parallel plan: Flux.1's (image and reference tokens split, the text replicated and joined in
every block) for ComfyUI's Flux model with Ovis' settings: the text RMS-normed before its embedder, text ids (0, i, i),
image ids in float32, no pooled text or guidance, the time embedding of sigma x 1000. Single blocks run here (diffusers'
block splits its SwiGLU at a fixed width): tensor parallelism splits the up / gate projections of both kinds of block,
the single blocks' output projection reading [attention, MLP] as Flux.1's."""
from __future__ import annotations

from dataclasses import replace

import torch
import torch.nn.functional as F

from ...sp.tensor_parallel import COLUMN, ROW, Split, TensorParallelPlan
from ..flux import PATCH, PLAN as FLUX_PLAN, image_and_text
from ..flux.plan import placements
from ..longcat_image.plan import text_ids

TENSOR_PARALLEL = TensorParallelPlan(extra=(Split("up_proj", COLUMN), Split("gate_proj", COLUMN),
                                            Split("proj_out", ROW, ("attn.to_q", "proj_mlp.up_proj"))))


def layout(call):
    return image_and_text(call, PATCH, placements, "offset", text_ids, torch.float32, embed_text)


def embed_text(model, text: torch.Tensor) -> torch.Tensor:
    return model.context_embedder(model.context_embedder_norm(text))


def condition(call) -> None:
    model = call.model
    call.temb = model.timestep_embedder(model.time_proj(call.sigma() * 1000).to(call.dtype))


def single_block(block, call) -> None:
    """diffusers' OvisImageSingleTransformerBlock on [text, image], its SwiGLU halves apart."""
    length = call.text.shape[1]
    hidden = torch.cat([call.text, call.image], dim=1)
    normed, gate = block.norm(hidden, emb=call.temb)
    mlp = block.proj_mlp.up_proj(normed) * F.silu(block.proj_mlp.gate_proj(normed))
    hidden = hidden + gate.unsqueeze(1) * block.proj_out(torch.cat([block.attn(hidden_states=normed), mlp], dim=2))
    if hidden.dtype == torch.float16:
        hidden = hidden.clip(-65504, 65504)
    call.text, call.image = hidden[:, :length], hidden[:, length:]


PLAN = replace(FLUX_PLAN, layout=layout, condition=condition,
               stages=(FLUX_PLAN.stages[0], replace(FLUX_PLAN.stages[1], run=single_block)),
               tensor_parallel=TENSOR_PARALLEL)
