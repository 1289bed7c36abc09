"""Model size presets of the demo and the benchmark: small random-weight models written as real checkpoints, the
demo's small model trained on coloured shapes, and the full-size Qwen-Image 20B / Flux 12B / Wan 14B shapes, whose
random weights are built on the worker devices.
"""
from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field
from typing import Optional

CACHE_DIR = os.path.join(".cache", "ulysses_sp")

QWEN_IMAGE_20B = dict(patch_size=2, in_channels=64, out_channels=16, num_layers=60, attention_head_dim=128,
                      num_attention_heads=24, joint_attention_dim=3584, axes_dims_rope=(16, 56, 56),
                      zero_cond_t=False)
FLUX_12B = dict(patch_size=1, in_channels=64, out_channels=None, num_layers=19, num_single_layers=38,
                attention_head_dim=128, num_attention_heads=24, joint_attention_dim=4096, pooled_projection_dim=768,
                guidance_embeds=True, axes_dims_rope=(16, 56, 56))
WAN_14B = dict(patch_size=(1, 2, 2), num_attention_heads=40, attention_head_dim=128, in_channels=16, out_channels=16,
               text_dim=4096, freq_dim=256, ffn_dim=13824, num_layers=40, cross_attn_norm=True,
               qk_norm="rms_norm_across_heads", eps=1e-6, image_dim=None, added_kv_proj_dim=None,
               rope_max_seq_len=1024, pos_embed_seq_len=None)


@dataclass(frozen=True)
class Preset:
    """A model shape and its default workload.

    size: for written presets, the overrides of sp_runtime.tiny_models' tiny config; for synthetic ones,
    the full diffusers config. synthetic: weights are drawn on each worker's device (nothing is written but a
    small spec file), so shapes far larger than this machine's memory can be benchmarked on big GPUs. trained: the
    weights are learned on first use (demo_training.py) rather than drawn at random.
    """

    name: str
    family: str
    description: str
    width: int
    height: int
    frames: int = 1
    text_tokens: int = 32
    dtype: str = "float32"
    synthetic: bool = False
    trained: bool = False
    size: dict = field(default_factory=dict)

    @property
    def is_video(self) -> bool:
        return self.family == "wan"


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
    Preset("qwen-image-20b", "qwen_image", "Qwen-Image 20B shape (60 blocks, 24 heads of 128), random weights",
           1328, 1328, text_tokens=256, dtype="bfloat16", synthetic=True, size=QWEN_IMAGE_20B),
    Preset("flux-12b", "flux", "Flux.1-dev 12B shape (19+38 blocks, 24 heads of 128), random weights",
           1024, 1024, text_tokens=512, dtype="bfloat16", synthetic=True, size=FLUX_12B),
    Preset("wan-14b", "wan", "Wan 2.1 T2V 14B shape (40 blocks, 40 heads of 128), random weights",
           832, 480, frames=81, text_tokens=512, dtype="bfloat16", synthetic=True, size=WAN_14B),
]}


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
    A synthetic preset opts this process into the internal families (detection.allow_internal_families).
    """
    synthetic = preset.synthetic if synthetic is None else synthetic
    if synthetic:  # a spec file this process writes itself: let it (and the workers it starts) load it
        from ..detection import allow_internal_families
        allow_internal_families()
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


def latent_shape(family: str, channels: int, width: int, height: int, frames: int = 1,
                 batch: int = 1) -> tuple[int, ...]:
    """ComfyUI's latent for an image / video size: 8x smaller spatially; Wan: 4x fewer frames (plus the first)."""
    if width < 8 or height < 8:
        raise ValueError(f"width and height must be at least 8 pixels, got {width}x{height}")
    h, w = height // 8, width // 8
    if family == "qwen_image":
        return (batch, channels, 1, h, w)
    if family == "flux":
        return (batch, channels, h, w)
    if family == "wan":
        if frames < 1:
            raise ValueError(f"frames must be at least 1, got {frames}")
        return (batch, channels, 1 + (frames - 1) // 4, h, w)
    raise ValueError(f"no latent shape for family {family!r}")


def token_count(family: str, latent: tuple[int, ...]) -> int:
    """Image / video tokens of one latent (2x2 patches; Wan: per frame)."""
    h, w = latent[-2:]
    tokens = -(-h // 2) * -(-w // 2)
    return tokens * (latent[2] if family == "wan" else 1)


def parameter_count(preset: Preset) -> int:
    """Parameters of the preset's transformer, counted on an empty (meta) model."""
    from accelerate import init_empty_weights

    from ..families.synthetic import TUPLE_KEYS, model_class
    config = {key: tuple(value) if key in TUPLE_KEYS and isinstance(value, list) else value
              for key, value in diffusers_config(preset).items()}
    with init_empty_weights():
        model = model_class(preset.family).from_config(config)
    return sum(parameter.numel() for parameter in model.parameters())
