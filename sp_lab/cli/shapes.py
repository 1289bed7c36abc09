"""The demo's little world: pictures of one coloured shape on a plain background, drawn procedurally, with the
fixed stand-ins for a VAE (pixel-unshuffle) and a text encoder (a fixed table of token vectors per shape and colour).

Nothing here is learned, so the trained transformer is the only model: the demo needs no download.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

SHAPES = ("circle", "square", "triangle")
COLOURS = {"red": (0.9, 0.12, 0.12), "green": (0.1, 0.72, 0.18), "blue": (0.12, 0.3, 0.95),
           "yellow": (0.98, 0.84, 0.05)}
LATENT_CHANNELS = 16   # Qwen-Image's latent channels; the image fills 12 of them (3 colours x 2 x 2 pixels)
PIXELS_PER_LATENT = 2  # the "VAE" folds 2 x 2 pixels into one latent position
SUPERSAMPLE = 4        # edges are drawn at 4x and averaged down (anti-aliasing)
CONTEXT_SEED = 1234
# Each picture's shape sits in the middle at nearly one size: the class then decides the picture, which a minute
# of training can learn (shapes spread over places and sizes come out as blobs after a minute).
RADIUS = (0.29, 0.33)  # the shapes' size, as a share of the side


def classes() -> list[tuple[str, str]]:
    """Every (shape, colour) pair, shape-major: the demo samples each once."""
    return [(shape, colour) for shape in SHAPES for colour in COLOURS]


def class_ids() -> tuple[torch.Tensor, torch.Tensor]:
    """The shape and colour indices of classes()."""
    pairs = classes()
    return (torch.tensor([SHAPES.index(shape) for shape, _ in pairs]),
            torch.tensor([list(COLOURS).index(colour) for _, colour in pairs]))


def draw(shape_ids: torch.Tensor, colour_ids: torch.Tensor, size: int, generator: torch.Generator) -> torch.Tensor:
    """[B] shape and colour indices -> [B, 3, size, size] pictures in [-1, 1]: one shape in the middle, on a plain
    light or dark grey background."""
    batch = shape_ids.shape[0]
    smallest, largest = RADIUS
    radius = size * (smallest + (largest - smallest) * torch.rand(batch, generator=generator))
    grey = torch.where(torch.rand(batch, generator=generator) < 0.5, 0.1, 0.8)
    grey = grey + 0.1 * torch.rand(batch, generator=generator)
    mask = _shape_mask(shape_ids, radius, size)
    colour = torch.tensor(list(COLOURS.values()))[colour_ids]
    picture = grey[:, None, None, None] * (1 - mask) + colour[:, :, None, None] * mask
    return picture * 2 - 1


def _shape_mask(shape_ids: torch.Tensor, radius: torch.Tensor, size: int) -> torch.Tensor:
    """[B, 1, size, size] coverage in [0, 1] of each sample's shape."""
    fine = size * SUPERSAMPLE
    axis = (torch.arange(fine, dtype=torch.float32) + 0.5) / SUPERSAMPLE
    y, x = axis[None, :, None], axis[None, None, :]
    r = radius[:, None, None]
    dx, dy = x - size / 2, y - size / 2
    circle = dx ** 2 + dy ** 2 <= r ** 2
    square = (dx.abs() <= 0.85 * r) & (dy.abs() <= 0.85 * r)
    # apex up at cy - r, base at cy + 0.8 r, as wide as 2 r at the base
    triangle = (dy <= 0.8 * r) & (dx.abs() <= (dy + r) / 1.8)
    inside = torch.stack([circle, square, triangle], dim=1)[torch.arange(len(shape_ids)), shape_ids]
    return F.avg_pool2d(inside.float()[:, None], SUPERSAMPLE)


def encode(pictures: torch.Tensor) -> torch.Tensor:
    """[B, 3, H, W] pictures -> [B, 16, 1, H/2, W/2] latents in ComfyUI's Qwen-Image layout (4 channels stay 0)."""
    folded = F.pixel_unshuffle(pictures, PIXELS_PER_LATENT)
    spare = LATENT_CHANNELS - folded.shape[1]
    return torch.cat([folded, folded.new_zeros(folded.shape[0], spare, *folded.shape[2:])], dim=1)[:, :, None]


def decode(latents: torch.Tensor) -> torch.Tensor:
    """[B, 16, 1, h, w] (or [B, 16, h, w]) latents -> [B, 3, 2h, 2w] pictures in [0, 1]."""
    latents = latents[:, :, 0] if latents.dim() == 5 else latents
    used = 3 * PIXELS_PER_LATENT ** 2
    return ((F.pixel_shuffle(latents[:, :used].float(), PIXELS_PER_LATENT) + 1) / 2).clamp(0, 1)


def pictures(latents: torch.Tensor) -> torch.Tensor:
    """[B, 16, 1, h, w] latents -> uint8 [B, 2h, 2w, 3] pictures, as a PNG shows them."""
    return (decode(latents) * 255).round().to(torch.uint8).permute(0, 2, 3, 1)


def context(shape_ids: torch.Tensor, colour_ids: torch.Tensor, width: int) -> torch.Tensor:
    """[B, 2, width] "text encoder output": a fixed random vector for the shape, then one for the colour."""
    generator = torch.Generator().manual_seed(CONTEXT_SEED)
    table = torch.randn(len(SHAPES) + len(COLOURS), width, generator=generator)
    return torch.stack([table[shape_ids], table[len(SHAPES) + colour_ids]], dim=1)

