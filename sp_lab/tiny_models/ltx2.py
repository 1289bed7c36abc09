"""Tiny LTX-2 / 2.3 / 2.5 (audio + video) models: diffusers' LTX2VideoTransformer3DModel with the real head sizes
(video 128, audio 64) but 3 heads each, two blocks, plus the two text-embedding connectors (128 registers, as ComfyUI
builds them), written as ComfyUI's files are (original key names under `model.diffusion_model.`, the release's
`config` metadata stating the sizes, position conventions and, for 2.3 / 2.5, the flags ComfyUI builds its model
from).

The original-name writer is the inverse of families/ltx2/keys.py's key plan, stated on its own so a round trip
checks both.
"""
from __future__ import annotations

import json

import torch

from sp_runtime.families.ltx2 import CONNECTORS
from .weights import randomize_, save_tiny, sized

LTX2_TINY = dict(in_channels=128, out_channels=128, num_attention_heads=3, attention_head_dim=128,
                 cross_attention_dim=384, audio_in_channels=128, audio_out_channels=128, audio_num_attention_heads=3,
                 audio_attention_head_dim=64, audio_cross_attention_dim=192, num_layers=2, caption_channels=48,
                 rope_type="split")
CONNECTOR_TINY = dict(num_attention_heads=2, attention_head_dim=24, num_layers=1, num_learnable_registers=128,
                      rope_type="split", gated_attention=False)
# What the LTX-2 release's `config` metadata states besides the head counts (ComfyUI builds its model from it)
RELEASE_FACTS = {"positional_embedding_theta": 10000.0, "positional_embedding_max_pos": [20, 2048, 2048],
                 "audio_positional_embedding_max_pos": [20], "timestep_scale_multiplier": 1000,
                 "av_ca_timestep_scale_multiplier": 1000, "causal_temporal_positioning": True,
                 "use_middle_indices_grid": True, "rope_type": "split", "frequencies_precision": "float64"}
# LTX-2.3: gated attention, prompt AdaLN, no caption projection (its connectors take the attention widths); LTX-2.5
# besides: timestep-free prompt modulation, no video feed-forward bias, the keyframe embedding
LTX23 = dict(gated_attn=True, audio_gated_attn=True, cross_attn_mod=True, audio_cross_attn_mod=True,
             use_prompt_embeddings=False)
RELEASES = {"2.0": {}, "2.3": LTX23,
            "2.5": {**LTX23, "use_prompt_adaln_single": False, "ff_bias": False,
                    "use_keyframes_abs_pos_embedding": True}}


def tiny_config(release: str = "2.0", **size) -> dict:
    """diffusers config of a tiny LTX-2 of `release` ("2.0", "2.3", "2.5")."""
    if release not in RELEASES:
        raise ValueError(f"unknown LTX release {release!r}; tiny models exist for {sorted(RELEASES)}")
    return sized("ltx2", {**LTX2_TINY, **RELEASES[release]}, size)


def connector_sizes(config) -> dict:
    """Each connector's sizes: 2.0's share CONNECTOR_TINY; 2.3 / 2.5's are as wide as the attention they feed
    (3 heads of 128 for video, of 64 for audio), gated."""
    if config.get("use_prompt_embeddings", True):
        return {name: CONNECTOR_TINY for name in CONNECTORS}
    return {name: {**CONNECTOR_TINY, "num_attention_heads": 3, "attention_head_dim": head, "gated_attention": True}
            for name, head in zip(CONNECTORS, (128, 64))}


def build_tiny_model(seed: int = 0, **size) -> torch.nn.Module:
    """A float32 LTX2VideoTransformer3DModel with seeded random weights and its two connectors attached, with
    ComfyUI's q / k norm eps (as the pool loads it)."""
    from diffusers import LTX2VideoTransformer3DModel

    from sp_runtime.families.ltx2 import attach_connectors, use_comfy_qk_norm_eps
    model = LTX2VideoTransformer3DModel.from_config(tiny_config(**size))
    attach_connectors(model, connector_sizes(model.config), model.config.rope_theta)
    use_comfy_qk_norm_eps(model)
    randomize_(model, seed)
    return model.eval().requires_grad_(False)


def release_metadata(model: torch.nn.Module) -> dict[str, str]:
    """The `config` metadata LTX-2 releases carry (section `transformer`), with this model's head counts and
    sizes."""
    config = model.config
    video, audio = (connector_sizes(config)[name] for name in CONNECTORS)
    transformer = {**RELEASE_FACTS, "num_attention_heads": config.num_attention_heads,
                   "attention_head_dim": config.attention_head_dim,
                   "audio_num_attention_heads": config.audio_num_attention_heads,
                   "audio_attention_head_dim": config.audio_attention_head_dim,
                   "caption_channels": config.caption_channels, "cross_attention_dim": config.cross_attention_dim,
                   "audio_cross_attention_dim": config.audio_cross_attention_dim,
                   "connector_num_attention_heads": video["num_attention_heads"],
                   "connector_attention_head_dim": video["attention_head_dim"],
                   "connector_num_layers": video["num_layers"]}
    if not config.use_prompt_embeddings:  # what ComfyUI's detection reads of a 2.3 / 2.5 file
        transformer.update(
            audio_connector_num_attention_heads=audio["num_attention_heads"],
            audio_connector_attention_head_dim=audio["attention_head_dim"], connector_apply_gated_attention=True,
            connector_num_learnable_registers=video["num_learnable_registers"], apply_gated_attention=config.gated_attn,
            cross_attention_adaln=config.cross_attn_mod, caption_proj_before_connector=True,
            caption_projection_first_linear=False, use_prompt_adaln_single=config.use_prompt_adaln_single,
            ff_bias=config.ff_bias, audio_ff_bias=config.audio_ff_bias)
    return {"config": json.dumps({"transformer": transformer})}


# ----- diffusers -> original (ComfyUI) names -----
_TOP = {"proj_in": "patchify_proj", "audio_proj_in": "audio_patchify_proj", "time_embed": "adaln_single",
        "audio_time_embed": "audio_adaln_single",
        "av_cross_attn_video_scale_shift": "av_ca_video_scale_shift_adaln_single",
        "av_cross_attn_video_a2v_gate": "av_ca_a2v_gate_adaln_single",
        "av_cross_attn_audio_scale_shift": "av_ca_audio_scale_shift_adaln_single",
        "av_cross_attn_audio_v2a_gate": "av_ca_v2a_gate_adaln_single", "prompt_adaln": "prompt_adaln_single",
        "audio_prompt_adaln": "audio_prompt_adaln_single"}
_PARTS = {"norm_q": "q_norm", "norm_k": "k_norm", "transformer_blocks": "transformer_1d_blocks",
          "video_a2v_cross_attn_scale_shift_table": "scale_shift_table_a2v_ca_video",
          "audio_a2v_cross_attn_scale_shift_table": "scale_shift_table_a2v_ca_audio"}


def original_name(key: str) -> str:
    parts = key.split(".")
    parts[0] = _TOP.get(parts[0], parts[0])
    connector = parts[0].endswith("_embeddings_connector")
    return ".".join([parts[0]] + [_PARTS[part] if part in _PARTS and (connector or part != "transformer_blocks")
                                  else part for part in parts[1:]])


def original_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {original_name(key): value.detach() for key, value in model.state_dict().items()}


def write_tiny_checkpoint(path: str, layout: str = "original", dtype: str = "float32", seed: int = 0,
                          prefix: str = "", variant: str = "", **size) -> str:
    """A tiny LTX-2 in ComfyUI's layout (the only layout LTX-2 ships in)."""
    if layout != "original" or variant:
        raise ValueError("tiny LTX-2 checkpoints exist in ComfyUI's (original) layout only")
    model = build_tiny_model(seed, **size)
    return save_tiny(model, path, layout, dtype, prefix, original=original_state_dict,
                     metadata=release_metadata(model))
