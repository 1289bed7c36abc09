"""Wan VACE: ComfyUI's `vace_context` [B, n, C, T, H, W] (n hint videos) and `vace_strength` (n floats) through
diffusers' WanVACETransformer3DModel.vace_blocks.

The hints lie on the video's own token grid, so each rank patch-embeds only its share of every hint video; the
VACE blocks attend over the split sequence like the main blocks (the stage's processors and rotary), and each hint
is added to the rank's own tokens. As in ComfyUI's VaceWanModel, VACE block k runs after main block vace_layers[k]
on the patch-embedded input (not the current hidden states) and every hint video is run on its own.
"""
from __future__ import annotations

import torch

from ...checkpoints.loading import count_blocks, shape_of
from ...sp.video_tokens import conv_patch_embed, pad_to_patch_3d
from .variants import Variant, register


def architecture(keys: dict, layout: str, config: dict) -> dict:
    """VACE's hint input width and the main blocks after which each VACE block's hint is added: evenly spaced from
    block 0, as ComfyUI's VaceWanModel places them (Wan 2.1 VACE 14B: 8 of 40, 1.3B: 15 of 30)."""
    count, num_layers = count_blocks(keys, "vace_blocks"), config["num_layers"]
    if not count or num_layers % count:
        raise ValueError(f"this Wan VACE checkpoint has {count} VACE blocks for {num_layers} blocks; VACE places "
                         f"one hint every num_layers / vace_blocks blocks, so they must divide evenly")
    return {"vace_layers": list(range(0, num_layers, num_layers // count)),
            "vace_in_channels": shape_of(keys, "vace_patch_embedding.weight")[1]}


def check(call) -> None:
    config, x, inputs = call.config, call.x, call.inputs
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
    if call.timestep.dim() == 2 and call.timestep.shape[1] > 1:
        raise ValueError("Wan VACE takes one timestep per batch item ([B]), not per-frame timesteps")


def prepare(call) -> None:
    """This rank's tokens of every hint video, patch-embedded (in float32, as ComfyUI), and the embedded input."""
    shard = call.shards["video"]
    grid = shard.stream.parts[0].output.grid
    contexts = call.input("vace_context", torch.float32)
    patch = tuple(call.config.patch_size)
    call.vace_states = [conv_patch_embed(call.model.vace_patch_embedding,
                                         grid.patches(pad_to_patch_3d(contexts[:, video], patch), shard.lo, shard.hi)
                                         ).to(call.dtype) for video in range(contexts.shape[1])]
    strengths = call.inputs.get("vace_strength")
    call.vace_strengths = [1.0] * len(call.vace_states) if strengths is None else [float(s) for s in strengths]
    call.vace_input = call.video


def after(call, index: int, block) -> None:
    """After main block vace_layers[k]: VACE block k on every hint video, its hint added."""
    layers = call.config.vace_layers
    if index not in layers:
        return
    vace_block = call.model.vace_blocks[layers.index(index)]
    for video, state in enumerate(call.vace_states):
        hint, call.vace_states[video] = vace_block(call.vace_input, call.context, state, call.block_modulation, None)
        call.video = call.video + hint * call.vace_strengths[video]


VACE = register(Variant(
    "vace", applies=lambda model, variant: hasattr(model, "vace_blocks"), anchor="vace_patch_embedding.weight",
    architecture=architecture, variant=lambda config: "vace" if config.get("vace_layers") else None,
    model_class="WanVACETransformer3DModel", comfy={"vace": "WAN21_Vace"}, inputs={"vace": ("vace_context",)},
    info=lambda model: {"vace_layers": list(model.config.vace_layers),
                        "vace_in_channels": model.config.vace_in_channels},
    also=("vace_blocks",), check=check, prepare=prepare, after=after, tensor_parallel=True))
