"""Boogu-Image's model: diffusers' Lumina2Transformer2DModel (the caption / time embedders, the context and noise
refiners, OmniGen2's single-stream blocks as `single_stream_layers`, the head) with the modules it lacks, stated here
with ComfyUI's names so that the file's keys load as they are: the reference latents' patch embedder, index
embeddings and refiner, and the double-stream blocks (comfy/ldm/boogu: a joint attention over [instruction; image]
with per-stream projections, plus the image's own self-attention, each stream with its modulation and MLP).
Imported by the loader only (diffusers is imported inside the functions)."""
from __future__ import annotations

import torch
from torch import nn

from .detection import LUMINA2_KEYS, MULTIPLE_OF, TIMESTEP_SCALE

REFERENCE_INDICES = 5   # rows of image_index_embedding: at most this many reference latents


class JointProjections(nn.Module):
    """The joint attention's per-stream projections (ComfyUI's BooguDoubleStreamProcessor, `processor.` keys)."""

    def __init__(self, width: int, kv_width: int):
        super().__init__()
        for stream in ("img", "instruct"):
            setattr(self, f"{stream}_to_q", nn.Linear(width, width, bias=False))
            setattr(self, f"{stream}_to_k", nn.Linear(width, kv_width, bias=False))
            setattr(self, f"{stream}_to_v", nn.Linear(width, kv_width, bias=False))
        self.instruct_out = nn.Linear(width, width, bias=False)
        self.img_out = nn.Linear(width, width, bias=False)


class JointAttention(nn.Module):
    """[instruction; image] attention (ComfyUI's BooguJointAttention): q / k RMS norms shared by both streams, the
    per-stream projections in `processor`, one output projection `to_out.0` after the per-stream ones."""

    def __init__(self, dim: int, head_dim: int, heads: int, kv_heads: int):
        super().__init__()
        from diffusers.models.normalization import RMSNorm
        self.head_dim, self.heads = head_dim, heads  # heads: this rank's at TP (sp.tensor_parallel splits them)
        self.norm_q, self.norm_k = RMSNorm(head_dim, eps=1e-5), RMSNorm(head_dim, eps=1e-5)
        self.to_out = nn.ModuleList([nn.Linear(heads * head_dim, dim, bias=False), nn.Dropout(0.0)])
        self.processor = JointProjections(heads * head_dim, kv_heads * head_dim)


class DoubleStreamBlock(nn.Module):
    """ComfyUI's BooguDoubleStreamBlock's modules (the plan's double_block and the reference compute it)."""

    def __init__(self, dim: int, heads: int, kv_heads: int, norm_eps: float):
        super().__init__()
        from diffusers.models.attention import LuminaFeedForward
        from diffusers.models.normalization import LuminaRMSNormZero, RMSNorm
        from diffusers.models.attention_processor import Attention
        from diffusers.models.transformers.transformer_lumina2 import Lumina2AttnProcessor2_0
        head_dim = dim // heads
        self.img_instruct_attn = JointAttention(dim, head_dim, heads, kv_heads)
        # the image self-attention: the attention module of a Lumina 2 block
        self.img_self_attn = Attention(query_dim=dim, dim_head=head_dim, heads=heads, kv_heads=kv_heads,
                                       qk_norm="rms_norm", eps=1e-5, bias=False, out_bias=False,
                                       processor=Lumina2AttnProcessor2_0())
        for stream in ("img", "instruct"):
            setattr(self, f"{stream}_feed_forward", LuminaFeedForward(dim, 4 * dim, MULTIPLE_OF))
        for name in ("img_norm1", "img_norm2", "img_norm3", "instruct_norm1", "instruct_norm2"):
            setattr(self, name, LuminaRMSNormZero(dim, norm_eps, True))
        for name in ("img_attn_norm", "img_self_attn_norm", "img_ffn_norm1", "img_ffn_norm2", "instruct_attn_norm",
                     "instruct_ffn_norm1", "instruct_ffn_norm2"):
            setattr(self, name, RMSNorm(dim, eps=norm_eps))


def add_boogu_modules(model, config: dict) -> None:
    """Lumina 2's model -> Boogu's (in place): `layers` named single_stream_layers, and the modules it lacks."""
    from diffusers.models.transformers.transformer_lumina2 import Lumina2TransformerBlock
    dim, heads, kv_heads = config["hidden_size"], config["num_attention_heads"], config["num_kv_heads"]
    model.single_stream_layers = model.layers
    del model.layers
    model.ref_image_patch_embedder = nn.Linear(model.x_embedder.in_features, dim)
    model.ref_image_refiner = nn.ModuleList(
        Lumina2TransformerBlock(dim, heads, kv_heads, MULTIPLE_OF, None, config["norm_eps"], modulation=True)
        for _ in range(config["num_refiner_layers"]))
    model.double_stream_layers = nn.ModuleList(DoubleStreamBlock(dim, heads, kv_heads, config["norm_eps"])
                                               for _ in range(config["num_double_stream_layers"]))
    model.image_index_embedding = nn.Parameter(torch.zeros(REFERENCE_INDICES, dim))
    model.time_caption_embed.time_proj.scale = TIMESTEP_SCALE  # ComfyUI's sinusoids of (1 - sigma) x 1000


def build_model(model_class, config: dict, dtypes):
    """The empty model of a detection's config (meta weights; PlanModel.build), fp8 layerwise casting set up over
    every module, the added ones included."""
    from accelerate import init_empty_weights
    with init_empty_weights():
        model = model_class.from_config({key: config[key] for key in LUMINA2_KEYS})
        add_boogu_modules(model, config)
    if dtypes.layerwise:
        model.enable_layerwise_casting(storage_dtype=dtypes.storage, compute_dtype=dtypes.compute)
    return model

