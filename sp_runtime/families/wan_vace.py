"""Wan VACE's hint stream under Ulysses SP: ComfyUI's `vace_context` [B, n, C, T, H, W] (n hint videos) and
`vace_strength` (n floats), run through diffusers' WanVACETransformer3DModel.vace_blocks.

The hints lie on the video's own token grid, so each rank patch-embeds only its share of every hint video, the
VACE blocks attend over the split sequence like the main blocks (same processors, same rotary factors), and each
hint is added to the rank's own tokens. As in ComfyUI's VaceWanModel, VACE block k runs after main block
vace_layers[k] on the patch-embedded input (not the current hidden states) and every hint video is run on its own.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..sp.video_tokens import VideoGrid, conv_patch_embed, pad_to_patch_3d


@dataclass
class VaceHints:
    """This rank's hint states, one [b, n, dim] per hint video, and where they join the main blocks."""

    states: list[torch.Tensor]
    strengths: list[float]
    after_block: dict[int, int]       # main block index -> VACE block index
    embedded_input: torch.Tensor      # the patch-embedded video tokens of this rank (VACE block 0 adds them)

    def add(self, model, index: int, hidden: torch.Tensor, call) -> torch.Tensor:
        """Hidden states after main block `index`, with every hint video's VACE block output added."""
        vace_index = self.after_block.get(index)
        if vace_index is None:
            return hidden
        block = model.vace_blocks[vace_index]
        for video, state in enumerate(self.states):
            hint, self.states[video] = block(self.embedded_input, call.context, state, call.block_modulation,
                                             call.attention)
            hidden = hidden + hint * self.strengths[video]
        return hidden


def prepare_hints(model, inputs: dict, x: torch.Tensor, grid: VideoGrid, lo: int, hi: int, embedded: torch.Tensor,
                  block_modulation: torch.Tensor, ctx, dtype: torch.dtype) -> VaceHints:
    """This rank's tokens [lo, hi) of every hint video, patch-embedded (in float32, as ComfyUI)."""
    vace_context = inputs.get("vace_context")
    check_vace_inputs(model.config, x, inputs, block_modulation)
    contexts = ctx.to_device("vace_context", vace_context, torch.float32)
    patch = tuple(model.config.patch_size)
    states = [conv_patch_embed(model.vace_patch_embedding, grid.patches(pad_to_patch_3d(contexts[:, video], patch),
                                                                         lo, hi)).to(dtype)
              for video in range(contexts.shape[1])]
    strengths = inputs.get("vace_strength")
    strengths = [1.0] * len(states) if strengths is None else [float(value) for value in strengths]
    after_block = {layer: index for index, layer in enumerate(model.config.vace_layers)}
    return VaceHints(states, strengths, after_block, embedded)


def check_vace_inputs(config, x: torch.Tensor, inputs: dict, block_modulation: torch.Tensor) -> None:
    vace_context = inputs.get("vace_context")
    expected = f"[B, n, {config.vace_in_channels}, {', '.join(map(str, x.shape[2:]))}]"
    if vace_context is None:
        raise ValueError(f"this Wan VACE model needs vace_context {expected} (ComfyUI's WAN21_Vace always passes "
                         f"it; from Python pass zeros for no hint)")
    if (vace_context.dim() != 6 or vace_context.shape[2] != config.vace_in_channels
            or vace_context.shape[3:] != x.shape[2:]):
        raise ValueError(f"vace_context has shape {list(vace_context.shape)}; this Wan VACE model takes {expected} "
                         f"(n hint videos of x's frames, height and width)")
    strengths = inputs.get("vace_strength")
    if strengths is not None and len(strengths) != vace_context.shape[1]:
        raise ValueError(f"vace_strength has {len(strengths)} entries for {vace_context.shape[1]} hint videos in "
                         f"vace_context: give one strength per hint video")
    if inputs.get("time_dim_concat") is not None:
        raise ValueError("time_dim_concat cannot be combined with a Wan VACE model (its hints cover x's frames only)")
    if block_modulation.dim() != 3:
        raise ValueError("Wan VACE takes one timestep per batch item ([B]), not per-frame timesteps")
