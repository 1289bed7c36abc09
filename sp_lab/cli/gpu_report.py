"""The GPU suite's picture: step times (pool vs diffusers), compiled vs eager, and all-to-all bandwidth plain vs
FP8, with matplotlib; without it a pillow image of the summary lines; without either, no picture.
"""
from __future__ import annotations

import os
from typing import Optional


def save_suite_plot(report: dict, path: str) -> Optional[str]:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return _summary_picture(report, path)
    sections = report["sections"]
    figure, (times, links) = plt.subplots(1, 2, figsize=(11, 4.2), dpi=110)
    _step_bars(times, sections)
    _bandwidth_lines(links, sections.get("bandwidth", {}))
    figure.suptitle(f"ulysses-sp gpu-suite on {report['hardware']}", fontsize=10)
    figure.tight_layout()
    figure.savefig(path)
    plt.close(figure)
    return path


def _step_bars(axes, sections: dict) -> None:
    labels, values = [], []
    for name in ("step_flux", "step_qwen_image"):
        entry = sections.get(name, {})
        for row in entry.get("layouts", []):
            if row.get("median_ms"):
                labels.append(f"{name[5:]}\nours {row['layout']}")
                values.append(row["median_ms"])
        for row in entry.get("diffusers", {}).get("layouts", []):
            if row.get("median_ms"):
                labels.append(f"{name[5:]}\ndiffusers {row['layout']}")
                values.append(row["median_ms"])
    compiled = sections.get("compile", {})
    if compiled.get("eager_ms"):
        labels += ["blocks\neager", "blocks\ncompiled"]
        values += [compiled["eager_ms"], compiled["compiled_ms"]]
    axes.bar(range(len(values)), values, color="#1f77b4")
    axes.set_xticks(range(len(labels)), labels, fontsize=7, rotation=30)
    axes.set_ylabel("ms per call")
    axes.set_title("step time (lower is better)", fontsize=9)
    axes.grid(axis="y", alpha=0.3)


def _bandwidth_lines(axes, entry: dict) -> None:
    rows = entry.get("rows", [])
    sizes = [row["bf16_bytes_per_rank"] / 2**20 for row in rows]
    axes.plot(sizes, [row["plain_algbw_gb_s"] for row in rows], "o-", label="bf16 all-to-all")
    axes.plot(sizes, [row["fp8_effective_gb_s"] for row in rows], "s-", label="fp8 exchange (bf16 bytes / time)")
    axes.set_xscale("log")
    axes.set_xlabel("MiB per rank (bf16)")
    axes.set_ylabel("GB/s")
    axes.set_title(entry.get("how", "all-to-all")[:70], fontsize=8)
    axes.grid(alpha=0.3)
    axes.legend(fontsize=7)


def _summary_picture(report: dict, path: str) -> Optional[str]:
    try:
        from PIL import Image, ImageDraw
    except ImportError:
        return None
    lines = [f"ulysses-sp gpu-suite on {report['hardware']}"]
    for name, entry in report["sections"].items():
        detail = entry.get("summary") or entry.get("reason") or entry.get("error", "")
        lines.append(f"{name}: {entry['status']}: {str(detail)[:150]}")
    picture = Image.new("RGB", (1200, 20 + 16 * len(lines)), "white")
    draw = ImageDraw.Draw(picture)
    for index, line in enumerate(lines):
        draw.text((10, 10 + 16 * index), line, fill="black")
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    picture.save(path)
    return path
