"""SeedVR2's NaDiT as plain torch modules under the key names of ComfyUI's files (diffusers has no SeedVR2 class),
written from the facts of ComfyUI's comfy/ldm/seedvr/model.py: video and text streams with their own weights in the
first `mm_layers` blocks (`.vid` / `.txt`) and shared ones after (`.all`), AdaSingle modulation (a learned shift /
scale / gate added to the time embedding's), parameter-free RMSNorms before attention and MLP. The forward lives in
plan.py (the executor) and sp_lab.references.seedvr2 (one device); these modules only hold weights and compute
per-token pieces."""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

SINUSOIDAL_DIM = 256  # the time embedding's sinusoid width


class Config(dict):
    """The detection's config, read as attributes too (model.config.vid_dim), as the executor reads configs."""

    def __getattr__(self, name):
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None


def rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    """The blocks' parameter-free RMSNorm over the last axis."""
    return F.rms_norm(x, (x.shape[-1],), eps=eps)


class Pair(nn.Module):
    """ComfyUI's MMModule: one module per stream (`vid`, `txt`) or one shared (`all`); vid_only: no text module."""

    def __init__(self, make, shared: bool, vid_only: bool = False):
        super().__init__()
        if shared:
            self.all = make()
        else:
            self.vid = make()
            if not vid_only:
                self.txt = make()
        self.vid_only = vid_only

    def of(self, stream: str) -> nn.Module:
        return self.all if hasattr(self, "all") else getattr(self, stream)


class Ada(nn.Module):
    """AdaSingle's learned parts: `<layer>_shift`, `<layer>_scale` (mode in) and `<layer>_gate` (mode out)."""

    def __init__(self, dim: int, layers=("attn", "mlp"), gates: bool = True):
        super().__init__()
        for layer in layers:
            setattr(self, f"{layer}_shift", nn.Parameter(torch.zeros(dim)))
            setattr(self, f"{layer}_scale", nn.Parameter(torch.zeros(dim)))
            if gates:
                setattr(self, f"{layer}_gate", nn.Parameter(torch.zeros(dim)))


class SwiGLU(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.proj_in_gate = nn.Linear(dim, hidden, bias=False)
        self.proj_in = nn.Linear(dim, hidden, bias=False)
        self.proj_out = nn.Linear(hidden, dim, bias=False)

    def forward(self, x):
        return self.proj_out(F.silu(self.proj_in_gate(x)) * self.proj_in(x))


class GeluMLP(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.proj_in = nn.Linear(dim, hidden)
        self.proj_out = nn.Linear(hidden, dim)

    def forward(self, x):
        return self.proj_out(F.gelu(self.proj_in(x), approximate="tanh"))


class Attention(nn.Module):
    def __init__(self, config: Config, shared: bool):
        super().__init__()
        dim, inner, head = config.vid_dim, config.heads * config.head_dim, config.head_dim
        self.heads, self.head_dim = config.heads, head
        self.proj_qkv = Pair(lambda: nn.Linear(dim, 3 * inner, bias=config.qk_bias), shared)
        self.proj_out = Pair(lambda: nn.Linear(inner, dim), shared)
        self.norm_q = Pair(lambda: nn.RMSNorm(head, eps=config.norm_eps), shared)
        self.norm_k = Pair(lambda: nn.RMSNorm(head, eps=config.norm_eps), shared)

    def qkv(self, stream: str, x: torch.Tensor):
        """q, k, v [B, n, H, D] of one stream (q and k RMS-normed per head)."""
        q, k, v = self.proj_qkv.of(stream)(x).unflatten(-1, (3, self.heads, self.head_dim)).unbind(2)
        return self.norm_q.of(stream)(q), self.norm_k.of(stream)(k), v


class Block(nn.Module):
    """NaMMSRTransformerBlock's weights; last: the 3B's last block, whose text MLP / modulation do not exist."""

    def __init__(self, config: Config, shared: bool, last: bool):
        super().__init__()
        dim, hidden = config.vid_dim, config.mlp_hidden
        mlp = SwiGLU if config.mlp_type == "swiglu" else GeluMLP
        self.attn = Attention(config, shared)
        self.mlp = Pair(lambda: mlp(dim, hidden), shared, vid_only=last)
        self.ada = Pair(lambda: Ada(dim), shared, vid_only=last)
        self.eps, self.last = config.norm_eps, last

    def modulate(self, stream: str, x: torch.Tensor, emb: torch.Tensor, layer: str) -> torch.Tensor:
        """Mode "in": x * (scale) + shift, emb's and the learned ones added; emb [B, dim, 2, 3]."""
        ada, index = self.ada.of(stream), ("attn", "mlp").index(layer)
        shift = emb[:, None, :, index, 0] + getattr(ada, f"{layer}_shift")
        scale = emb[:, None, :, index, 1] + getattr(ada, f"{layer}_scale")
        return x * scale + shift

    def gate(self, stream: str, x: torch.Tensor, emb: torch.Tensor, layer: str) -> torch.Tensor:
        ada, index = self.ada.of(stream), ("attn", "mlp").index(layer)
        return x * (emb[:, None, :, index, 2] + getattr(ada, f"{layer}_gate"))

    def feed_forward(self, stream: str, x: torch.Tensor, emb: torch.Tensor) -> torch.Tensor:
        """The MLP half of the block on one stream (residual included)."""
        hidden = self.modulate(stream, rms(x, self.eps), emb, "mlp")
        return x + self.gate(stream, self.mlp.of(stream)(hidden), emb, "mlp")


class Linear(nn.Module):
    """A module holding one Linear as `proj` (vid_in.proj, vid_out.proj)."""

    def __init__(self, features: int, out: int):
        super().__init__()
        self.proj = nn.Linear(features, out)


class TimeEmbedding(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.proj_in = nn.Linear(SINUSOIDAL_DIM, dim)
        self.proj_hid = nn.Linear(dim, dim)
        self.proj_out = nn.Linear(dim, 6 * dim)

    def forward(self, timestep: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """[B] -> [B, 6 * dim]: sin then cos of t * 10000^(-i / 128), then Linear, SiLU, Linear, SiLU, Linear."""
        half = SINUSOIDAL_DIM // 2
        rates = torch.exp(torch.arange(half, dtype=torch.float32) * -(math.log(10000) / half))
        angles = timestep.float()[:, None] * rates.to(timestep.device)[None]
        sinusoid = torch.cat([torch.sin(angles), torch.cos(angles)], dim=1).to(dtype)
        return self.proj_out(F.silu(self.proj_hid(F.silu(self.proj_in(sinusoid)))))


class SeedVR2Model(nn.Module):
    """The NaDiT's weights (config: detection.architecture)."""

    def __init__(self, config: dict):
        super().__init__()
        self.config = config = Config(config)
        dim, patch = config.vid_dim, config.patch_size
        self.vid_in = Linear(config.in_channels * math.prod(patch), dim)
        self.txt_in = nn.Linear(config.txt_in_dim, dim)
        self.emb_in = TimeEmbedding(dim)
        last = config.num_layers - 1 if config.variant == "3b" else -1
        self.blocks = nn.ModuleList(Block(config, index >= config.mm_layers, index == last)
                                    for index in range(config.num_layers))
        self.vid_out = Linear(dim, config.out_channels * math.prod(patch))
        if config.variant == "3b":
            self.vid_out_norm = nn.RMSNorm(dim, eps=config.norm_eps)
            self.vid_out_ada = Ada(dim, layers=("out",), gates=False)
        self.register_buffer("positive_conditioning", torch.zeros(config.positive_tokens, config.txt_in_dim))
        self.register_buffer("negative_conditioning", torch.zeros(config.negative_tokens, config.txt_in_dim))

    def time(self, timestep: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The time embedding as [B, dim, 2 layers, 3 (shift, scale, gate)] (AdaSingle's "b (d l g)")."""
        return self.emb_in(timestep, dtype).unflatten(-1, (self.config.vid_dim, 2, 3))

    def head(self, vid: torch.Tensor, emb: torch.Tensor) -> torch.Tensor:
        """The 3B's output RMSNorm and modulation (ComfyUI's cached attention-layer slice of the time embedding:
        emb[..., 0, 0 / 1] plus out_shift / out_scale), then the patch projection (features (ph, pw, c))."""
        if self.config.variant == "3b":
            vid = self.vid_out_norm(vid)
            vid = vid * (emb[:, None, :, 0, 1] + self.vid_out_ada.out_scale) + (
                emb[:, None, :, 0, 0] + self.vid_out_ada.out_shift)
        return self.vid_out.proj(vid)
