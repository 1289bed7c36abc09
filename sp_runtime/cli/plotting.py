"""PNG output of the CLI: a latent shown as an RGB picture (pillow), and the speed-up plot of the benchmark
(matplotlib when installed, otherwise a plain pillow drawing).
"""
from __future__ import annotations

import os
from typing import Sequence

import torch

MAX_SIDE = 1024
SERIES_COLOURS = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b"]


def latent_to_rgb(latent: torch.Tensor) -> torch.Tensor:
    """[C, H, W] latent -> uint8 [H, W, 3]: the first three channels, each stretched over its 1..99th percentile.

    A VAE would make a real picture; this shows the latent's structure with no model to download.
    """
    channels = latent.float()[:3]
    if channels.shape[0] < 3:
        channels = torch.cat([channels, channels[-1:].expand(3 - channels.shape[0], -1, -1)])
    flat = channels.flatten(1)
    low = torch.quantile(flat, 0.01, dim=1)[:, None, None]
    high = torch.quantile(flat, 0.99, dim=1)[:, None, None]
    scaled = ((channels - low) / (high - low).clamp_min(1e-12)).clamp(0, 1)
    return (scaled * 255).round().to(torch.uint8).permute(1, 2, 0).contiguous()


def save_latent_png(latent: torch.Tensor, path: str, upscale: int = 8) -> str:
    """Write one latent (any of [B, C, H, W], [B, C, T, H, W]: first item, first frame) as a PNG, upscaled."""
    from PIL import Image
    image = latent[0] if latent.dim() >= 4 else latent
    if image.dim() == 4:  # [C, T, H, W]
        image = image[:, 0]
    pixels = latent_to_rgb(image)
    height, width = pixels.shape[:2]
    upscale = max(1, min(upscale, MAX_SIDE // max(height, width)))
    picture = Image.fromarray(pixels.numpy(), "RGB").resize((width * upscale, height * upscale), Image.NEAREST)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    picture.save(path)
    return path


def save_speedup_plot(series: dict[str, Sequence[tuple[int, float]]], path: str, title: str) -> str:
    """Speed-up against the number of devices, one line per layout kind, with the ideal (linear) line."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return _pillow_plot(series, path, title)
    degrees = sorted({degree for points in series.values() for degree, _ in points} | {1})
    figure, axes = plt.subplots(figsize=(6, 4.2), dpi=120)
    axes.plot(degrees, degrees, "--", color="grey", label="ideal")
    for (name, points), colour in zip(sorted(series.items()), SERIES_COLOURS * 4):
        points = sorted(points)
        axes.plot([d for d, _ in points], [s for _, s in points], "o-", color=colour, label=name)
    axes.set_xlabel("devices")
    axes.set_ylabel("speed-up vs 1 device")
    axes.set_xticks(degrees)
    axes.set_ylim(bottom=0)
    axes.grid(alpha=0.3)
    axes.set_title(title, fontsize=9)
    axes.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path)
    plt.close(figure)
    return path


def _pillow_plot(series: dict[str, Sequence[tuple[int, float]]], path: str, title: str) -> str:
    """The same plot drawn with pillow alone (no matplotlib)."""
    from PIL import Image, ImageDraw
    width, height, margin = 640, 440, 60
    degrees = sorted({degree for points in series.values() for degree, _ in points} | {1})
    top = max([max(degrees)] + [s for points in series.values() for _, s in points]) * 1.1
    span = max(1, max(degrees) - min(degrees))

    def at(degree: float, speedup: float) -> tuple[float, float]:
        x = margin + (degree - min(degrees)) / span * (width - 2 * margin)
        return x, height - margin - speedup / top * (height - 2 * margin)

    picture = Image.new("RGB", (width, height), "white")
    draw = ImageDraw.Draw(picture)
    draw.line([at(min(degrees), 0), at(max(degrees), 0)], fill="black")
    draw.line([at(min(degrees), 0), at(min(degrees), top)], fill="black")
    for degree in degrees:
        x, y = at(degree, 0)
        draw.text((x - 3, y + 6), str(degree), fill="black")
    draw.line([at(min(degrees), min(degrees)), at(max(degrees), max(degrees))], fill="grey", width=1)
    draw.text((margin, 10), title, fill="black")
    for row, ((name, points), colour) in enumerate(zip(sorted(series.items()), SERIES_COLOURS * 4)):
        xy = [at(degree, speedup) for degree, speedup in sorted(points)]
        if len(xy) > 1:
            draw.line(xy, fill=colour, width=2)
        for x, y in xy:
            draw.ellipse([x - 3, y - 3, x + 3, y + 3], fill=colour)
        draw.text((width - margin - 100, margin + 14 * row), name, fill=colour)
    draw.text((width // 2 - 60, height - 24), "devices (grey: ideal)", fill="black")
    picture.save(path)
    return path
