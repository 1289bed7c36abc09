"""Tiny random-weight Lens models (no diffusers class: a plain module under ComfyUI's key names, 6 heads of 16, 2
blocks, 4 text layers of 16 features, a 32-channel latent) and their ComfyUI files, written apart from the loader's
key plan (fused img_qkv / txt_qkv as ComfyUI keeps them). `from_loaded` turns the product's loaded model back into
this module (for references of quantized files and LoRAs)."""
from __future__ import annotations

import torch
from torch import nn

from .weights import randomize_, sized

LENS_TINY = dict(in_channels=32, num_layers=2, attention_head_dim=16, num_attention_heads=6, enc_hidden_dim=16,
                 text_layers=4, axes_dims_rope=(4, 6, 6))


def tiny_config(**size) -> dict:
    return sized("lens", LENS_TINY, size, "axes_dims_rope")


def _attention(width: int, head: int) -> nn.Module:
    attention = nn.Module()
    for name in ("norm_q", "norm_k", "norm_added_q", "norm_added_k"):
        setattr(attention, name, nn.RMSNorm(head))
    attention.img_qkv, attention.txt_qkv = nn.Linear(width, 3 * width), nn.Linear(width, 3 * width)
    attention.to_out = nn.ModuleList([nn.Linear(width, width)])
    attention.to_add_out = nn.Linear(width, width)
    return attention


def _mlp(width: int) -> nn.Module:
    mlp, hidden = nn.Module(), int(width / 3 * 8)  # ComfyUI's GateMLP width
    mlp.w1, mlp.w2, mlp.w3 = nn.Linear(width, hidden, False), nn.Linear(hidden, width, False), nn.Linear(
        width, hidden, False)
    return mlp


def _block(width: int, head: int) -> nn.Module:
    block = nn.Module()
    block.attn = _attention(width, head)
    for stream in ("img", "txt"):
        setattr(block, f"{stream}_mod", nn.Sequential(nn.SiLU(), nn.Linear(width, 6 * width)))
        setattr(block, f"{stream}_norm1", nn.RMSNorm(width))
        setattr(block, f"{stream}_norm2", nn.RMSNorm(width))
        setattr(block, f"{stream}_mlp", _mlp(width))
    return block


class TinyLens(nn.Module):
    """ComfyUI's LensTransformer2DModel's parameters (no forward: sp_lab.references.lens computes it)."""

    def __init__(self, config: dict):
        super().__init__()
        self.config = config
        width, head = config["num_attention_heads"] * config["attention_head_dim"], config["attention_head_dim"]
        text = config["enc_hidden_dim"]
        self.time_text_embed = nn.Module()
        self.time_text_embed.timestep_embedder = nn.Module()
        self.time_text_embed.timestep_embedder.linear_1 = nn.Linear(256, width)
        self.time_text_embed.timestep_embedder.linear_2 = nn.Linear(width, width)
        self.txt_norm = nn.ModuleList(nn.RMSNorm(text) for _ in range(config["text_layers"]))
        self.txt_in = nn.Linear(text * config["text_layers"], width)
        self.img_in = nn.Linear(config["in_channels"], width)
        self.transformer_blocks = nn.ModuleList(_block(width, head) for _ in range(config["num_layers"]))
        self.norm_out = nn.Module()
        self.norm_out.linear = nn.Linear(width, 2 * width)
        self.proj_out = nn.Linear(width, config["in_channels"])


def build_tiny_model(seed: int = 0, **size) -> TinyLens:
    model = TinyLens(tiny_config(**size))
    randomize_(model, seed)
    return model.eval().requires_grad_(False)


def original_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    return {key: value.detach() for key, value in model.state_dict().items()}


FUSED = {"img_qkv": ("to_q", "to_k", "to_v"), "txt_qkv": ("add_q_proj", "add_k_proj", "add_v_proj")}


def from_loaded(model: nn.Module) -> TinyLens:
    """The product's loaded model (diffusers' Qwen-Image with Lens' modules) as a TinyLens of the same weights."""
    config = model.config
    layers = len(model.txt_norm)
    tiny = TinyLens(dict(in_channels=config.in_channels, num_layers=config.num_layers,
                         attention_head_dim=config.attention_head_dim,
                         num_attention_heads=config.num_attention_heads,
                         enc_hidden_dim=config.joint_attention_dim // layers, text_layers=layers,
                         axes_dims_rope=tuple(config.axes_dims_rope)))
    loaded = {key: value.detach().float() for key, value in model.state_dict().items()}
    state = {}
    for key in tiny.state_dict():
        module, _, kind = key.rpartition(".")
        stem, _, name = module.rpartition(".")
        state[key] = (torch.cat([loaded[f"{stem}.{part}.{kind}"] for part in FUSED[name]]) if name in FUSED
                      else loaded[key])
    tiny.load_state_dict(state)
    return tiny.eval().requires_grad_(False)
