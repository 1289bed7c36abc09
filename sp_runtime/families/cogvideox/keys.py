"""CogVideoX's key plan: ComfyUI's names (comfy/ldm/cogvideo: `blocks.N.q`, `attn_out`, `ff_proj`, flat
`time_embedding_linear_1`) -> diffusers' CogVideoXTransformer3DModel; one tensor each, no fused rows."""
from __future__ import annotations

from typing import Iterable

from ...checkpoints.loading import KeyPlan, original_layout_plan

TOP = (("time_embedding_linear_", "time_embedding.linear_"), ("ofs_embedding_linear_", "ofs_embedding.linear_"),
       ("blocks.", "transformer_blocks."))
BLOCK = {"q": "attn1.to_q", "k": "attn1.to_k", "v": "attn1.to_v", "norm_q": "attn1.norm_q", "norm_k": "attn1.norm_k",
         "attn_out": "attn1.to_out.0", "ff_proj": "ff.net.0.proj", "ff_out": "ff.net.2"}


def diffusers_name(key: str) -> str:
    """A ComfyUI key's diffusers name (the block modules renamed, the rest as it is)."""
    for old, new in TOP:
        if key.startswith(old):
            key = new + key[len(old):]
            break
    if key.startswith("transformer_blocks."):
        stem, index, rest = key.split(".", 2)
        module, _, kind = rest.rpartition(".")
        key = f"{stem}.{index}.{BLOCK.get(module, module)}.{kind}"
    return key


def original_plan(keys: Iterable[str], config=None) -> KeyPlan:
    """ComfyUI key names -> parameters (LoRAs use these names too)."""
    return {key: [(diffusers_name(key), None)] for key in keys}


weight_plan = original_layout_plan(original_plan)  # ComfyUI files through original_plan, diffusers' as they are
