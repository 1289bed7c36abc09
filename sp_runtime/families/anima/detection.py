"""Anima detection from a header alone: a Cosmos-Predict2 DiT in ComfyUI's keys with an LLM adapter
(`llm_adapter.blocks.0.cross_attn.q_proj.weight`, as ComfyUI's model_detection tells "anima" apart); the DiT's config
as cosmos reads it, the adapter's from its shapes (ComfyUI fixes 1024 / 6 layers / 16 heads; we read them)."""
from __future__ import annotations

from typing import Optional

from ...checkpoints.header import Header
from ...checkpoints.loading import count_blocks, find_prefix, shape_of, strip_prefix
from ...contract import Detection
from ..cosmos import detection as cosmos
from .text import HEADS

NAME = "anima"
ANCHORS = cosmos.ORIGINAL_ANCHORS + ("llm_adapter.blocks.0.cross_attn.q_proj.weight",)
ADAPTER_KEYS = ("adapter_vocabulary", "adapter_width", "adapter_text_dim", "adapter_layers", "adapter_self_attention")
CONFIG_KEYS = cosmos.CONFIG_KEYS + ADAPTER_KEYS


def detect(header: Header) -> Optional[Detection]:
    """Anima from its header alone; None for any other file (a plain Cosmos-Predict2 one included)."""
    prefix = find_prefix(header.tensors, ANCHORS)
    if prefix is None:
        return None
    keys = strip_prefix(header.tensors, prefix)
    if any(key.startswith("extra_pos_embedder.") for key in keys):
        raise ValueError(f"{header.path!r} is an Anima model with learnable extra positions (extra_pos_embedder): "
                         f"not supported")
    config = {**cosmos.architecture(keys, True), **adapter_config(keys)}
    if config["text_embed_dim"] != config["adapter_width"] or config["text_embed_dim"] % HEADS:
        raise ValueError(f"{header.path!r}: Anima's LLM adapter gives {config['adapter_width']}-wide tokens to a "
                         f"DiT that takes {config['text_embed_dim']} (they must match, in {HEADS} whole heads)")
    return Detection(family=NAME, variant="t2i", layout="original", prefix=prefix, config=config,
                     files=header.source.files)


def adapter_config(keys: dict) -> dict:
    """The LLM adapter's sizes: T5 vocabulary, Qwen3 width, layers, and whether its blocks self-attend."""
    vocabulary, width = shape_of(keys, "llm_adapter.embed.weight")
    if width != shape_of(keys, "llm_adapter.out_proj.weight")[0] or "llm_adapter.in_proj.weight" in keys:
        raise ValueError("an Anima LLM adapter whose width differs from its embedding's (llm_adapter.in_proj) is not "
                         "supported")
    return {"adapter_vocabulary": vocabulary, "adapter_width": width,
            "adapter_text_dim": shape_of(keys, "llm_adapter.blocks.0.cross_attn.k_proj.weight")[1],
            "adapter_layers": count_blocks(keys, "llm_adapter.blocks"),
            "adapter_self_attention": "llm_adapter.blocks.0.self_attn.q_proj.weight" in keys}
