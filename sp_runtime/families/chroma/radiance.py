"""Chroma Radiance's model: diffusers' ChromaTransformer2DModel trunk (its x_embedder takes a pixel patch's C*P*P
values, which is ComfyUI's strided `img_in_patch` convolution; no final layer) and the NeRF head diffusers lacks, as
ComfyUI's files name it: `nerf_image_embedder` (a patch's pixels and a DCT-like basis of their positions -> width),
`nerf_blocks` (per patch, an MLP whose weights the patch's trunk token generates) and `nerf_final_layer_conv` (RMSNorm,
then a 3x3 convolution over the whole image; `nerf_final_layer`: RMSNorm and a Linear per pixel)."""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ...checkpoints.loading import WeightDtypes, build_empty_model
from .detection import RADIANCE_KEYS

EPS = None  # the NeRF head's RMSNorm epsilon: torch's default, the input dtype's (ComfyUI's operations.RMSNorm)
TILE = 512  # patches a NeRF block takes at once (ComfyUI's nerf_tile_size; the result does not depend on it)


@dataclass(frozen=True)
class Radiance:
    """The NeRF head's facts (detection.RADIANCE_KEYS), kept on the model as `model.radiance`."""

    pixel_patch: int
    nerf_hidden_size: int
    nerf_mlp_ratio: int
    nerf_depth: int
    nerf_max_freqs: int
    nerf_head: str
    x0: bool
    sequential_text_ids: bool


def dct_basis(patch: int, freqs: int, device) -> torch.Tensor:
    """[P*P, F*F] float32: for the pixel (y, x) of a patch, cos(pi x fx) cos(pi y fy) / (1 + fx fy), positions in
    [0, 1], features (fx, fy) with fy fastest (ComfyUI's NerfEmbedder.fetch_pos)."""
    where = torch.linspace(0, 1, patch, device=device, dtype=torch.float32)
    f = torch.arange(freqs, device=device, dtype=torch.float32)
    waves = torch.cos(math.pi * where[:, None] * f[None, :])  # [position, frequency]
    basis = waves[None, :, :, None] * waves[:, None, None, :]  # [y, x, fx, fy]: x's wave on fx, y's on fy
    basis = basis / (1 + f[:, None] * f[None, :])
    return basis.reshape(patch * patch, freqs * freqs)


class NerfEmbedder(torch.nn.Module):
    """A patch's pixels [n, P*P, C] with the DCT basis appended -> [n, P*P, width], in float32 (ComfyUI runs it in
    float32 whatever the model's dtype)."""

    def __init__(self, channels: int, width: int, freqs: int):
        super().__init__()
        self.freqs = freqs
        self.embedder = torch.nn.Sequential(torch.nn.Linear(channels + freqs * freqs, width))

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        count, area, _ = pixels.shape
        basis = dct_basis(math.isqrt(area), self.freqs, pixels.device).expand(count, -1, -1)
        inputs = torch.cat([pixels.float(), basis], dim=-1)
        layer = self.embedder[0]
        if type(layer) is torch.nn.Linear:
            return F.linear(inputs, layer.weight.float(), None if layer.bias is None else layer.bias.float())
        return layer(inputs.to(pixels.dtype)).float()  # a quantized layer computes as it does


class NerfGLUBlock(torch.nn.Module):
    """x [n, P*P, width] + silu(norm(x) G) * (norm(x) V) W, G / V / W generated per patch from its token s [n, hidden]
    and L2-normalised over their input dimension; TILE patches at a time inside one call (a block is called once per
    forward on every rank, whatever its patch count: shard_weights gathers its weights in that call)."""

    def __init__(self, hidden: int, width: int, ratio: int):
        super().__init__()
        self.ratio = ratio
        self.param_generator = torch.nn.Linear(hidden, 3 * width * width * ratio)
        self.norm = torch.nn.RMSNorm(width, eps=EPS)

    def forward(self, x: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
        return torch.cat([self._tile(x[start:start + TILE], s[start:start + TILE])
                          for start in range(0, x.shape[0], TILE)]) if x.shape[0] else x

    def _tile(self, x: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
        count, _, width = x.shape
        gate, value, out = self.param_generator(s).chunk(3, dim=-1)
        gate = F.normalize(gate.view(count, width, width * self.ratio), dim=-2)
        value = F.normalize(value.view(count, width, width * self.ratio), dim=-2)
        out = F.normalize(out.view(count, width * self.ratio, width), dim=-2)
        normed = self.norm(x)
        return x + torch.bmm(F.silu(torch.bmm(normed, gate)) * torch.bmm(normed, value), out)


class NerfFinalLayer(torch.nn.Module):
    """RMSNorm over the width of every pixel of the image [B, width, H, W], then a 3x3 convolution (head "conv") or
    a Linear per pixel (head "linear") to the image's channels."""

    def __init__(self, width: int, channels: int, head: str):
        super().__init__()
        self.norm = torch.nn.RMSNorm(width, eps=EPS)
        if head == "conv":
            self.conv = torch.nn.Conv2d(width, channels, kernel_size=3, padding=1)
        else:
            self.linear = torch.nn.Linear(width, channels)

    def forward(self, image: torch.Tensor) -> torch.Tensor:
        normed = self.norm(image.movedim(1, -1))
        if hasattr(self, "conv"):
            return self.conv(normed.movedim(-1, 1))
        return self.linear(normed).movedim(-1, 1)


def attach(model, radiance: Radiance) -> None:
    """Give a ChromaTransformer2DModel (x_embedder over C*P*P pixel values) Radiance's head, as ComfyUI names it, and
    take away the final layer Radiance has not."""
    hidden, patch = model.inner_dim, radiance.pixel_patch
    channels = model.config.in_channels // (patch * patch)
    width = radiance.nerf_hidden_size
    model.radiance = radiance
    model.nerf_image_embedder = NerfEmbedder(channels, width, radiance.nerf_max_freqs)
    model.nerf_blocks = torch.nn.ModuleList(NerfGLUBlock(hidden, width, radiance.nerf_mlp_ratio)
                                            for _ in range(radiance.nerf_depth))
    final = NerfFinalLayer(width, channels, radiance.nerf_head)
    setattr(model, "nerf_final_layer_conv" if radiance.nerf_head == "conv" else "nerf_final_layer", final)
    del model.norm_out, model.proj_out


def split_config(config: dict) -> tuple[dict, Radiance]:
    """(the trunk's diffusers config, the head's facts) of a Radiance detection's config."""
    return ({key: value for key, value in config.items() if key not in RADIANCE_KEYS},
            Radiance(**{key: config[key] for key in RADIANCE_KEYS}))


def build(model_class, config: dict, dtypes: WeightDtypes):
    """PlanModel's build: the trunk empty, the head attached (fp8 layerwise casting reaches it too)."""
    trunk, radiance = split_config(config)
    return build_empty_model(model_class, trunk, dtypes, change=lambda model: attach(model, radiance))


def final_layer(model) -> NerfFinalLayer:
    return getattr(model, "nerf_final_layer_conv", None) or model.nerf_final_layer


def nerf(model, pixels: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """The NeRF embedder and blocks on patches: pixels [n, P*P, C], their trunk tokens [n, hidden] -> [n, P*P,
    width] (each block called once, even with no patches)."""
    x = model.nerf_image_embedder(pixels).to(tokens.dtype)
    for block in model.nerf_blocks:
        x = block(x, tokens)
    return x
