"""The full-size model shapes the doctor plans for (Qwen-Image 20B, Flux 12B, Wan 14B) with their default
workloads, and the token arithmetic of ComfyUI's latents. The lab's presets (sp_lab.cli.presets) add small ones."""
from __future__ import annotations

from dataclasses import dataclass, field

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
DOCTOR_MODELS = {"qwen-image": "qwen-image-20b", "flux": "flux-12b", "wan": "wan-14b"}  # --model: preset name
TUPLE_KEYS = ("axes_dims_rope", "patch_size")  # config values diffusers wants as tuples (JSON gives lists)


@dataclass(frozen=True)
class Preset:
    """A model shape and its default workload.

    size: for synthetic presets, the full diffusers config; for the lab's written ones, the overrides of
    sp_lab.tiny_models' tiny config. synthetic: weights are drawn on each worker's device (nothing is written but a
    small spec file), so shapes far larger than this machine's memory can be benchmarked on big GPUs. trained: the
    weights are learned on first use (sp_lab.cli.demo_training) rather than drawn at random.
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


FULL_SIZE = {preset.name: preset for preset in [
    Preset("qwen-image-20b", "qwen_image", "Qwen-Image 20B shape (60 blocks, 24 heads of 128), random weights",
           1328, 1328, text_tokens=256, dtype="bfloat16", synthetic=True, size=QWEN_IMAGE_20B),
    Preset("flux-12b", "flux", "Flux.1-dev 12B shape (19+38 blocks, 24 heads of 128), random weights",
           1024, 1024, text_tokens=512, dtype="bfloat16", synthetic=True, size=FLUX_12B),
    Preset("wan-14b", "wan", "Wan 2.1 T2V 14B shape (40 blocks, 40 heads of 128), random weights",
           832, 480, frames=81, text_tokens=512, dtype="bfloat16", synthetic=True, size=WAN_14B),
]}


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


def model_class(family: str):
    """The diffusers transformer class of a family that has presets."""
    from diffusers import (FluxTransformer2DModel, HunyuanVideoTransformer3DModel, QwenImageTransformer2DModel,
                           WanTransformer3DModel)
    classes = {"qwen_image": QwenImageTransformer2DModel, "flux": FluxTransformer2DModel,
               "wan": WanTransformer3DModel, "hunyuan_video": HunyuanVideoTransformer3DModel}
    if family not in classes:
        raise ValueError(f"synthetic models exist for {sorted(classes)}, not {family!r}")
    return classes[family]


def with_tuples(config: dict) -> dict:
    """A diffusers config read from JSON, with TUPLE_KEYS as tuples again."""
    return {key: tuple(value) if key in TUPLE_KEYS and isinstance(value, list) else value
            for key, value in config.items()}


def empty_model(family: str, config: dict):
    """The family's diffusers model built on the meta device (shapes and counts only, no memory)."""
    from accelerate import init_empty_weights
    with init_empty_weights():
        return model_class(family).from_config(with_tuples(config))


def count_parameters(family: str, config: dict) -> int:
    """Parameters of a family's transformer of this diffusers config, counted on an empty (meta) model."""
    return sum(parameter.numel() for parameter in empty_model(family, config).parameters())
