"""Model size presets of the demo and the benchmark: small random-weight models written as real checkpoints, the
demo's small model trained on coloured shapes, and the full-size shapes of sp_runtime.cli.model_shapes (Qwen-Image
20B / Flux 12B / Wan 14B), whose random weights are built on the worker devices.
"""
from __future__ import annotations

import hashlib
import json
import os
from typing import Optional

from sp_runtime.cli.model_shapes import (FULL_SIZE, Preset, count_parameters, latent_shape,  # noqa: F401
                                         token_count)

CACHE_DIR = os.path.join(".cache", "ulysses_sp")

PRESETS = {preset.name: preset for preset in [
    Preset("shapes", "qwen_image", "Qwen-Image architecture, 4 blocks, 4 heads of 32, trained on coloured shapes "
           "(12 pictures of 24x24 pixels, 36 tokens each)", 96, 96, text_tokens=2, trained=True,
           size=dict(num_layers=4, num_attention_heads=4, attention_head_dim=32, joint_attention_dim=32)),
    Preset("tiny", "qwen_image", "Qwen-Image architecture, 2 blocks, 6 heads of 16 (tests)", 144, 176,
           text_tokens=7),
    Preset("tiny-flux", "flux", "Flux.1 architecture, 2+2 blocks, 6 heads of 16 (tests)", 144, 176, text_tokens=7),
    Preset("tiny-wan", "wan", "Wan 2.1 T2V architecture, 2 blocks, 6 heads of 16 (tests)", 80, 48, frames=9,
           text_tokens=7),
    Preset("demo", "qwen_image", "Qwen-Image architecture, 2 blocks, 8 heads of 64, 1024x1024 (4096 tokens)",
           1024, 1024, text_tokens=32,
           size=dict(num_layers=2, num_attention_heads=8, attention_head_dim=64, joint_attention_dim=64)),
    Preset("demo-gpu", "qwen_image", "Qwen-Image architecture, 2 blocks, 16 heads of 128, 2048x2048 (16384 tokens)",
           2048, 2048, text_tokens=64,
           size=dict(num_layers=2, num_attention_heads=16, attention_head_dim=128, joint_attention_dim=256)),
]} | FULL_SIZE


def get_preset(name: str) -> Preset:
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; known presets: {', '.join(PRESETS)}")
    return PRESETS[name]


def diffusers_config(preset: Preset) -> dict:
    """The full diffusers config of a preset's transformer."""
    if preset.synthetic:
        return dict(preset.size)
    from ..tiny_models import tiny_config
    return tiny_config(preset.family, **preset.size)


def materialize(preset: Preset, cache_dir: str = CACHE_DIR, synthetic: Optional[bool] = None, seed: int = 0,
                training_progress=None) -> str:
    """Path of a checkpoint for the preset, written once into cache_dir.

    Written presets become ComfyUI-layout .safetensors files (the real loader reads them); synthetic ones (or
    synthetic=True) become a small spec file that makes each worker draw the weights on its own device; trained
    ones are trained first (seed does not apply: the recipe has its own), reporting to training_progress.
    A synthetic preset registers the lab's families in this process (sp_lab.families) so its workers load it.
    """
    synthetic = preset.synthetic if synthetic is None else synthetic
    if synthetic:  # a spec file this process writes itself: let it (and the workers it starts) load it
        from ..families import register_lab_families
        register_lab_families()
    if preset.trained and not synthetic:
        from .demo_training import recipe_of, trained_checkpoint
        return trained_checkpoint(recipe_of(preset), cache_dir, preset.name, training_progress)
    config = diffusers_config(preset)
    digest = hashlib.sha256(json.dumps([preset.family, config, seed, preset.dtype, synthetic], sort_keys=True,
                                       default=list).encode()).hexdigest()[:12]
    kind = "synthetic" if synthetic else "original"
    path = os.path.abspath(os.path.join(cache_dir, f"{preset.name}-{kind}-{digest}.safetensors"))
    if os.path.exists(path):
        return path
    os.makedirs(cache_dir, exist_ok=True)
    partial = path + f".{os.getpid()}.partial"
    if synthetic:
        from ..families.synthetic import write_spec
        write_spec(partial, preset.family, config, seed=seed, dtype=preset.dtype)
    else:
        from ..tiny_models import write_tiny_checkpoint
        write_tiny_checkpoint(preset.family, partial, layout="original", dtype=preset.dtype, seed=seed,
                              **preset.size)
    os.replace(partial, path)  # concurrent runs never see a half-written file
    return path


def parameter_count(preset: Preset) -> int:
    """Parameters of the preset's transformer, counted on an empty (meta) model."""
    return count_parameters(preset.family, diffusers_config(preset))
