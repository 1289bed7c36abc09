"""PNG output of the CLI: the demo's comparison of the pool's and one device's pictures with their difference
(pillow), and the speed-up plot of the benchmark (matplotlib when installed, otherwise a plain pillow drawing).
"""
from __future__ import annotations

import math
import os
from typing import Optional, Sequence

import torch

PANEL_SIDE = 512  # width of each panel of the demo's picture
TILE_GAP = 4
PANEL_GAP = 16
TITLE_HEIGHT = 28
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


def latent_pictures(latents: torch.Tensor) -> torch.Tensor:
    """[B, C, (T,) H, W] latents (first frame) -> uint8 [B, H, W, 3] pictures through latent_to_rgb."""
    latents = latents[:, :, 0] if latents.dim() == 5 else latents
    return torch.stack([latent_to_rgb(latent) for latent in latents])


def save_comparison_png(pool: torch.Tensor, one_device: torch.Tensor, difference: torch.Tensor, path: str,
                        titles: Sequence[str], columns: int = 4) -> dict:
    """Three panels side by side: the pool's pictures, one device's, and |difference| amplified (1, 2 or 5 x 10^k).

    pool, one_device: uint8 [B, H, W, 3]; difference: float [B, h, w] (max over channels, any resolution).
    titles: of the two picture panels. Returns the gain and the difference panel's title.
    """
    from PIL import Image, ImageDraw
    largest = float(difference.max()) if difference.numel() else 0.0
    gain = _nice_gain(largest)
    shown = (difference * gain * 255).clamp(0, 255).round().to(torch.uint8)[..., None].expand(-1, -1, -1, 3)
    difference_title = (f"|pool - one device| x {gain:.0e} (max {largest:.1e})" if largest > 0
                        else "|pool - one device|: identical")
    panels = [_tiles(pool, columns), _tiles(one_device, columns), _tiles(shown, columns, pool.shape[1:3])]
    font = _font(16)
    width = sum(panel.width for panel in panels) + PANEL_GAP * (len(panels) + 1)
    picture = Image.new("RGB", (width, max(panel.height for panel in panels) + TITLE_HEIGHT + PANEL_GAP), "white")
    draw = ImageDraw.Draw(picture)
    left = PANEL_GAP
    for panel, title in zip(panels, [*titles, difference_title]):
        draw.text((left, 6), title, fill="black", font=font)
        picture.paste(panel, (left, TITLE_HEIGHT))
        left += panel.width + PANEL_GAP
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    picture.save(path)
    return {"difference_gain": gain, "difference_title": difference_title}


def _nice_gain(largest: float) -> float:
    """The largest of 1, 2, 5 x 10^k that keeps `largest` at most 1 (so it shows between 40% and 100% white)."""
    if largest <= 0:
        return 1.0
    power = 10.0 ** math.floor(math.log10(1 / largest))
    return max(step * power for step in (1, 2, 5) if step * power * largest <= 1)


def _tiles(pictures: torch.Tensor, columns: int, tile_size: Optional[Sequence[int]] = None):
    """uint8 [B, h, w, 3] -> one PIL picture: a grid of `columns` tiles per row, each scaled up to about
    PANEL_SIDE / columns pixels wide (nearest neighbour: every latent pixel stays visible)."""
    from PIL import Image
    count, height, width = pictures.shape[:3]
    height, width = tile_size or (height, width)
    columns = min(columns, count)
    rows = -(-count // columns)
    scale = max(1, PANEL_SIDE // (columns * max(height, width)))
    tile_w, tile_h = width * scale, height * scale
    panel = Image.new("RGB", (columns * tile_w + (columns - 1) * TILE_GAP, rows * tile_h + (rows - 1) * TILE_GAP),
                      "white")
    for index, tile in enumerate(pictures):
        row, column = divmod(index, columns)
        image = Image.fromarray(tile.numpy(), "RGB").resize((tile_w, tile_h), Image.NEAREST)
        panel.paste(image, (column * (tile_w + TILE_GAP), row * (tile_h + TILE_GAP)))
    return panel


def _font(size: int):
    from PIL import ImageFont
    try:
        return ImageFont.load_default(size=size)
    except (TypeError, OSError):  # Pillow without FreeType: the fixed bitmap font
        return ImageFont.load_default()


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
