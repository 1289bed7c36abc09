"""SD3 / SD3.5 key plan: ComfyUI's MMDiT names -> diffusers' SD3Transformer2DModel parameters, as diffusers'
`convert_sd3_transformer_checkpoint_to_diffusers` maps them.

That converter takes a whole state dict (it counts blocks and finds the last, text-only-projected block from the
keys), so it cannot stream a file or map the one key a LoRA names. We run it once per architecture on stand-in
tensors: every ComfyUI key of the config, each a 6-row tensor tagged with its key's number. Each output names the
key it came from and which sixths of its rows, in what order (thirds of a fused qkv, swapped halves of a final
modulation), which is the per-tensor transform applied to the real weights."""
from __future__ import annotations

from functools import lru_cache
from typing import Iterable

import torch

from ...checkpoints.loading import KeyPlan, Transform, original_layout_plan

SIXTHS = 6


def original_plan(keys: Iterable[str], config) -> KeyPlan:
    """ComfyUI key (prefix stripped) -> [(diffusers parameter, transform)]; keys the converter does not read (a
    scaled-fp8 marker, ...) are left out."""
    plan = _converter_plan(config["num_layers"], tuple(config.get("dual_attention_layers") or ()),
                           bool(config.get("qk_norm")))
    return {key: plan[key] for key in keys if key in plan}


weight_plan = original_layout_plan(original_plan)


def comfy_keys(blocks: int, dual: tuple[int, ...], qk_norm: bool) -> list[str]:
    """Every weight name of a ComfyUI MMDiT checkpoint of this architecture (the last block's text side only
    projects q, k, v)."""
    names = ["pos_embed", "x_embedder.proj", "t_embedder.mlp.0", "t_embedder.mlp.2", "y_embedder.mlp.0",
             "y_embedder.mlp.2", "context_embedder", "final_layer.linear", "final_layer.adaLN_modulation.1"]
    for i in range(blocks):
        sides = {"x_block": ["attn"] + (["attn2"] if i in dual else []), "context_block": ["attn"]}
        for side, attentions in sides.items():
            stem = f"joint_blocks.{i}.{side}"
            names.append(f"{stem}.adaLN_modulation.1")
            for attn in attentions:
                names.append(f"{stem}.{attn}.qkv")
                if side == "x_block" or i < blocks - 1:
                    names.append(f"{stem}.{attn}.proj")
                if qk_norm:
                    names += [f"{stem}.{attn}.ln_q.weight", f"{stem}.{attn}.ln_k.weight"]
            if side == "x_block" or i < blocks - 1:
                names += [f"{stem}.mlp.fc1", f"{stem}.mlp.fc2"]
    keys = []
    for name in names:
        keys += [name] if name == "pos_embed" or name.endswith(".weight") else [f"{name}.weight", f"{name}.bias"]
    return keys


@lru_cache(maxsize=8)
def _converter_plan(blocks: int, dual: tuple[int, ...], qk_norm: bool) -> dict:
    from diffusers.loaders.single_file_utils import convert_sd3_transformer_checkpoint_to_diffusers
    keys = comfy_keys(blocks, dual, qk_norm)
    tagged = {key: torch.arange(SIXTHS) + SIXTHS * number for number, key in enumerate(keys)}
    plan: dict[str, list] = {}
    for parameter, rows in convert_sd3_transformer_checkpoint_to_diffusers(tagged).items():
        source = keys[int(rows[0]) // SIXTHS]
        plan.setdefault(source, []).append((parameter, _transform((rows % SIXTHS).tolist())))
    return plan


def _transform(sixths: list[int]) -> Transform:
    """The rows a converter output takes from its source, as runs of sixths (None: all rows, in order)."""
    if sixths == list(range(SIXTHS)):
        return None
    runs, start = [], 0
    for index in range(1, len(sixths) + 1):
        if index == len(sixths) or sixths[index] != sixths[index - 1] + 1:
            runs.append((sixths[start], index - start))
            start = index
    return lambda tensor: torch.cat([tensor.narrow(0, first * tensor.shape[0] // SIXTHS,
                                                   count * tensor.shape[0] // SIXTHS) for first, count in runs])
