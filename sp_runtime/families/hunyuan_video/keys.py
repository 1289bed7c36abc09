"""HunyuanVideo 1.0 / 1.5 checkpoint keys: the Tencent and ComfyUI layouts -> diffusers' parameter names, one
tensor at a time, at any width (HunyuanVideoTransformer3DModel and HunyuanVideo15Transformer3DModel).

Tencent's releases and Comfy-Org's repackaged files name modules as Tencent's code does (`img_attn_qkv`,
`mlp.fc1`, `modulation.linear`); ComfyUI renames them at load into its own module names (`img_attn.qkv`, `mlp.0`,
`modulation.lin`; supported_models.HunyuanVideo.process_unet_state_dict), and files saved by ComfyUI carry those
(newer ComfyUI, 0.33 on, also names the q / k norms `.weight` where older ComfyUI and the releases say `.scale`).
`comfy_name` applies ComfyUI's renames, so both layouts meet in ComfyUI's names, and `plan_target` maps those to
diffusers'. We do not call diffusers' `convert_hunyuan_video_transformer_to_diffusers`: it hardcodes the 13B
width (3072) for the single blocks' fused rows, needs the whole state dict in memory, and has no 1.5 version
(tests/families/test_hunyuan_video.py checks that both give the same tensors at 3072). 
"""
from __future__ import annotations

from typing import Iterable, Optional

from ...checkpoints.loading import KeyPlan, Transform, original_layout_plan, row_split, swap_halves
from ..flux.keys import DOUBLE_BLOCK, DOUBLE_FUSED, SINGLE_BLOCK, SINGLE_FUSED

# ComfyUI's renames of Tencent's module names, in its order (substring replacements)
COMFY_RENAMES = (
    ("txt_in.t_embedder.mlp.0.", "txt_in.t_embedder.in_layer."),
    ("txt_in.t_embedder.mlp.2.", "txt_in.t_embedder.out_layer."),
    ("txt_in.c_embedder.linear_1.", "txt_in.c_embedder.in_layer."),
    ("txt_in.c_embedder.linear_2.", "txt_in.c_embedder.out_layer."),
    ("_mod.linear.", "_mod.lin."), ("_attn_qkv.", "_attn.qkv."), ("mlp.fc1.", "mlp.0."), ("mlp.fc2.", "mlp.2."),
    ("_attn_q_norm.weight", "_attn.norm.query_norm.scale"), ("_attn_k_norm.weight", "_attn.norm.key_norm.scale"),
    (".q_norm.weight", ".norm.query_norm.scale"), (".k_norm.weight", ".norm.key_norm.scale"),
    (".norm.query_norm.weight", ".norm.query_norm.scale"), (".norm.key_norm.weight", ".norm.key_norm.scale"),
    ("_attn_proj.", "_attn.proj."), (".modulation.linear.", ".modulation.lin."),
    ("_in.mlp.2.", "_in.out_layer."), ("_in.mlp.0.", "_in.in_layer."),
)

# ComfyUI module names -> diffusers module names; "{time}" is HunyuanVideo 1.0's `time_text_embed` or 1.5's
# `time_embed`
_TOP = {
    "img_in.proj": "x_embedder.proj",
    "time_in.in_layer": "{time}.timestep_embedder.linear_1", "time_in.out_layer": "{time}.timestep_embedder.linear_2",
    "time_r_in.in_layer": "{time}.timestep_embedder_r.linear_1",
    "time_r_in.out_layer": "{time}.timestep_embedder_r.linear_2",
    "vector_in.in_layer": "{time}.text_embedder.linear_1", "vector_in.out_layer": "{time}.text_embedder.linear_2",
    "guidance_in.in_layer": "{time}.guidance_embedder.linear_1",
    "guidance_in.out_layer": "{time}.guidance_embedder.linear_2",
    "txt_in.input_embedder": "context_embedder.proj_in",
    "txt_in.t_embedder.in_layer": "context_embedder.time_text_embed.timestep_embedder.linear_1",
    "txt_in.t_embedder.out_layer": "context_embedder.time_text_embed.timestep_embedder.linear_2",
    "txt_in.c_embedder.in_layer": "context_embedder.time_text_embed.text_embedder.linear_1",
    "txt_in.c_embedder.out_layer": "context_embedder.time_text_embed.text_embedder.linear_2",
    "byt5_in.layernorm": "context_embedder_2.norm", "byt5_in.fc1": "context_embedder_2.linear_1",
    "byt5_in.fc2": "context_embedder_2.linear_2", "byt5_in.fc3": "context_embedder_2.linear_3",
    "vision_in.proj.0": "image_embedder.norm_in", "vision_in.proj.1": "image_embedder.linear_1",
    "vision_in.proj.3": "image_embedder.linear_2", "vision_in.proj.4": "image_embedder.norm_out",
    "cond_type_embedding": "cond_type_embed",
    "final_layer.linear": "proj_out",
}
_REFINER = {"norm1": "norm1", "norm2": "norm2", "self_attn.proj": "attn.to_out.0", "mlp.0": "ff.net.0.proj",
            "mlp.2": "ff.net.2", "adaLN_modulation.1": "norm_out.linear"}
_DOUBLE = {**DOUBLE_BLOCK,  # Tencent's HunyuanVideo 1.5 release keeps q, k, v apart
           "img_attn_q": "attn.to_q", "img_attn_k": "attn.to_k", "img_attn_v": "attn.to_v",
           "txt_attn_q": "attn.add_q_proj", "txt_attn_k": "attn.add_k_proj", "txt_attn_v": "attn.add_v_proj"}
REFINER_STEM = "txt_in.individual_token_refiner.blocks"
# The header facts HunyuanVideo 1.0 and 1.5 share: (ComfyUI / Tencent module name, diffusers name)
SHARED_ARCHITECTURE_KEYS = {
    "embed": ("img_in.proj.weight", "x_embedder.proj.weight"),
    "head_norm": ("double_blocks.0.img_attn.norm.query_norm.scale", "transformer_blocks.0.attn.norm_q.weight"),
    "mlp": ("double_blocks.0.img_mlp.0.weight", "transformer_blocks.0.ff.net.0.proj.weight"),
    "out": ("final_layer.linear.weight", "proj_out.weight"),
    "double_blocks": ("double_blocks", "transformer_blocks"),
    "single_blocks": ("single_blocks", "single_transformer_blocks"),
    "refiner_blocks": (REFINER_STEM, "context_embedder.token_refiner.refiner_blocks"),
    "text": ("txt_in.input_embedder.weight", "context_embedder.proj_in.weight"),
}


def comfy_name(key: str) -> str:
    """A key in ComfyUI's module names (Tencent names renamed as ComfyUI does at load; ComfyUI names unchanged)."""
    for old, new in COMFY_RENAMES:
        key = key.replace(old, new)
    return key



def comfy_names(tensors: dict) -> dict:
    """Header entries under ComfyUI's module names (Tencent's renamed)."""
    return {comfy_name(key): value for key, value in tensors.items()}


def original_plan(keys: Iterable[str], config) -> KeyPlan:
    """Tencent / ComfyUI key names -> parameters of the 1.0 model of `config` (LoRAs use these names too)."""
    hidden = config["num_attention_heads"] * config["attention_head_dim"]
    return hunyuan_key_plan(keys, hidden, int(hidden * config["mlp_ratio"]), "time_text_embed")

def hunyuan_key_plan(keys: Iterable[str], hidden: int, mlp_hidden: int, time_module: str) -> KeyPlan:
    """Tencent / ComfyUI key (no prefix) -> [(diffusers key, transform)] for every key the model has.

    hidden: the model's width (rows of each fused q, k, v part); mlp_hidden: the single blocks' MLP rows;
    time_module: "time_text_embed" (1.0) or "time_embed" (1.5). Keys it does not know are left out (load_weights
    reports them).
    """
    plan = {}
    for key in keys:
        module, _, kind = comfy_name(key).rpartition(".")
        kind = "weight" if kind == "scale" else kind
        targets = plan_target(module, kind, hidden, mlp_hidden, time_module)
        if targets:
            plan[key] = targets
    return plan


weight_plan = original_layout_plan(original_plan)


def plan_target(module: str, kind: str, hidden: int, mlp_hidden: int, time_module: str
                ) -> list[tuple[str, Transform]]:
    """The diffusers parameters made from ComfyUI module `module`'s `kind` ("weight" / "bias") tensor."""
    if module in _TOP:
        return [(f"{_TOP[module].format(time=time_module)}.{kind}", None)]
    if module == "final_layer.adaLN_modulation.1":  # (shift, scale) -> diffusers' (scale, shift)
        return [(f"norm_out.linear.{kind}", swap_halves)]
    stem, index, inner = _block_parts(module)
    if stem == REFINER_STEM:
        prefix = f"context_embedder.token_refiner.refiner_blocks.{index}."
        if inner == "self_attn.qkv":
            return row_split(prefix, ("attn.to_q", "attn.to_k", "attn.to_v"), kind, (hidden,) * 3)
        return [(f"{prefix}{_REFINER[inner]}.{kind}", None)] if inner in _REFINER else []
    if stem == "double_blocks":
        prefix = f"transformer_blocks.{index}."
        if inner in DOUBLE_FUSED:
            return row_split(prefix, DOUBLE_FUSED[inner], kind, (hidden,) * 3)
        return [(f"{prefix}{_DOUBLE[inner]}.{kind}", None)] if inner in _DOUBLE else []
    if stem == "single_blocks":
        prefix = f"single_transformer_blocks.{index}."
        if inner == "linear1":
            return row_split(prefix, SINGLE_FUSED, kind, (hidden,) * 3 + (mlp_hidden,))
        return [(f"{prefix}{SINGLE_BLOCK[inner]}.{kind}", None)] if inner in SINGLE_BLOCK else []
    return []


def _block_parts(module: str) -> tuple[Optional[str], str, str]:
    """(stem, index, inner module) of a block's module name, e.g. ("double_blocks", "3", "img_attn.qkv")."""
    for stem in (REFINER_STEM, "double_blocks", "single_blocks"):
        if module.startswith(stem + "."):
            index, _, inner = module[len(stem) + 1:].partition(".")
            if index.isdigit():
                return stem, index, inner
    return None, "", ""
