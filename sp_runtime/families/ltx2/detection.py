"""LTX-2, 2.3 and 2.5 detection from the header alone: shapes plus the release's `config` metadata -> diffusers'
LTX2VideoTransformer3DModel config, the sizes of the two text connectors ComfyUI keeps inside the diffusion model and
how ComfyUI places the video tokens.

The releases differ by tensors present: 2.3 adds per-head attention gates (`to_gate_logits`), the prompt
cross-attention AdaLN (9 block modulations, `prompt_scale_shift_table`, `prompt_adaln_single`) and drops the caption
projection (its text encoder projects per modality, so the connectors take 4096 / 2048 wide prompts); 2.5 drops
`prompt_adaln_single` (timestep-free prompt modulation) and the video feed-forward biases.
"""
from __future__ import annotations

import json
from typing import Optional

from ...checkpoints.header import Header
from ...checkpoints.loading import count_blocks, find_prefix, shape_of, strip_prefix
from ...contract import Detection

FAMILY = "ltx2"
ANCHORS = ("av_ca_a2v_gate_adaln_single.emb.timestep_embedder.linear_1.weight", "audio_patchify_proj.weight",
           "patchify_proj.weight", "transformer_blocks.0.video_to_audio_attn.to_q.weight")
CONNECTORS = ("video_embeddings_connector", "audio_embeddings_connector")
# What ComfyUI's LTXAVModel takes from the file's `config` metadata (JSON, section "transformer"), with ComfyUI's own
# defaults for a key the file leaves out (ComfyUI builds its model from exactly these; so do we). ComfyUI ignores
# `positional_embedding_theta` (its rotary tables always use 10000) and `rope_type` has two defaults: "interleaved"
# for the transformer, "split" for the text connectors.
RELEASE_DEFAULTS = {
    "num_attention_heads": 32, "attention_head_dim": 128, "audio_num_attention_heads": 32,
    "audio_attention_head_dim": 64, "positional_embedding_max_pos": [20, 2048, 2048],
    "audio_positional_embedding_max_pos": [20], "timestep_scale_multiplier": 1000,
    "av_ca_timestep_scale_multiplier": 1.0, "frequencies_precision": "float32", "use_middle_indices_grid": False,
    "causal_temporal_positioning": False, "connector_num_attention_heads": 30, "connector_attention_head_dim": 128,
}
ROPE_THETA = 10000.0


def detect(header: Header) -> Optional[Detection]:
    """LTX-2 (audio + video) from its header alone; None when the file is another family."""
    prefix = find_prefix(header.tensors, ANCHORS)
    if prefix is None:
        return None
    keys = strip_prefix(header.tensors, prefix)
    if "caption_projection.linear_1.weight" in keys and "caption_projection.linear_2.weight" not in keys:
        raise ValueError(f"{header.path!r} is an LTX model with a single-linear caption projection before the "
                         f"connectors, which diffusers has no module for; it does not run under sequence "
                         f"parallelism in this version (LTX-2, 2.3 and 2.5 do)")
    config = architecture(keys, release_config(header))
    return Detection(family=FAMILY, variant=release_variant(config), layout="original", prefix=prefix,
                     config=config, files=header.files)


def release_variant(config: dict) -> str:
    """The detection's variant: "av" (LTX-2.0), "av-2.3" (prompt AdaLN driven by the timestep) or "av-2.5"
    (timestep-free prompt modulation)."""
    if not config["cross_attn_mod"]:
        return "av"
    return "av-2.3" if config["use_prompt_adaln_single"] else "av-2.5"


def release_config(header: Header) -> dict:
    """The `transformer` section of the file's `config` metadata over RELEASE_DEFAULTS."""
    text = header.metadata.get("config")
    config = dict(RELEASE_DEFAULTS)
    if text:
        try:
            parsed = json.loads(text)
        except json.JSONDecodeError as error:
            raise ValueError(f"{header.path!r}: its 'config' metadata is not JSON ({error}); download the file "
                             f"again") from None
        config.update(parsed.get("transformer", parsed) if isinstance(parsed, dict) else {})
    return config


def architecture(keys: dict, release: dict) -> dict:
    """diffusers' LTX2VideoTransformer3DModel config from shapes and the release config (head counts are not
    visible in shapes: q/k norms span all heads), plus `connector` (the text connectors' sizes) and `positions`
    (how ComfyUI places the video tokens in time and space, which diffusers' config cannot state)."""
    inner, in_channels = shape_of(keys, "patchify_proj.weight")
    audio_inner, audio_in = shape_of(keys, "audio_patchify_proj.weight")
    video_heads = _heads(inner, release["num_attention_heads"], release["attention_head_dim"], "video")
    audio_heads = _heads(audio_inner, release["audio_num_attention_heads"], release["audio_attention_head_dim"],
                         "audio")
    max_pos = list(release["positional_embedding_max_pos"])
    has_caption_projection = "caption_projection.linear_1.weight" in keys
    block = "transformer_blocks.0."
    config = {
        "in_channels": in_channels, "out_channels": shape_of(keys, "proj_out.weight")[0],
        "patch_size": 1, "patch_size_t": 1,
        "num_attention_heads": video_heads, "attention_head_dim": inner // video_heads,
        "cross_attention_dim": shape_of(keys, "transformer_blocks.0.attn2.to_k.weight")[1],
        "audio_in_channels": audio_in, "audio_out_channels": shape_of(keys, "audio_proj_out.weight")[0],
        "audio_num_attention_heads": audio_heads, "audio_attention_head_dim": audio_inner // audio_heads,
        "audio_cross_attention_dim": shape_of(keys, "transformer_blocks.0.audio_attn2.to_k.weight")[1],
        "num_layers": count_blocks(keys, "transformer_blocks"),
        "caption_channels": (shape_of(keys, "caption_projection.linear_1.weight")[1] if has_caption_projection
                             else int(release.get("caption_channels", 3840))),
        "use_prompt_embeddings": has_caption_projection,
        "gated_attn": block + "attn1.to_gate_logits.weight" in keys,
        "audio_gated_attn": block + "audio_attn1.to_gate_logits.weight" in keys,
        "cross_attn_mod": block + "prompt_scale_shift_table" in keys,
        "audio_cross_attn_mod": block + "audio_prompt_scale_shift_table" in keys,
        "use_prompt_adaln_single": "prompt_adaln_single.linear.weight" in keys,
        "ff_bias": block + "ff.net.0.proj.bias" in keys,
        "audio_ff_bias": block + "audio_ff.net.0.proj.bias" in keys,
        "use_keyframes_abs_pos_embedding": "keyframes_abs_pos_embedding" in keys,
        "pos_embed_max_pos": int(max_pos[0]), "base_height": int(max_pos[1]), "base_width": int(max_pos[2]),
        "audio_pos_embed_max_pos": int(release["audio_positional_embedding_max_pos"][0]),
        "rope_theta": ROPE_THETA,
        "rope_double_precision": release["frequencies_precision"] == "float64",
        "rope_type": release.get("rope_type", "interleaved"),
        "timestep_scale_multiplier": release["timestep_scale_multiplier"],
        "cross_attn_timestep_scale_multiplier": release["av_ca_timestep_scale_multiplier"],
        "connector": {name: connector_config(keys, release, name) for name in CONNECTORS},
        "positions": {"use_middle_indices_grid": bool(release["use_middle_indices_grid"]),
                      "causal_temporal_positioning": bool(release["causal_temporal_positioning"])},
    }
    return config


def _heads(inner: int, stated: int, head_dim: int, stream: str) -> int:
    """The head count: the release's when it divides the width, else the width over the release's head size."""
    if inner % stated == 0:
        return stated
    if inner % head_dim == 0:
        return inner // head_dim
    raise ValueError(f"the {stream} stream is {inner} wide, which neither {stated} heads nor heads of {head_dim} "
                     f"divide; the file's 'config' metadata must state num_attention_heads")


def connector_config(keys: dict, release: dict, name: str) -> dict:
    """Sizes of one connector (2.3 / 2.5: the audio one is narrower, its head counts named `audio_connector_*`)."""
    registers, inner = shape_of(keys, f"{name}.learnable_registers")
    stated = ("audio_" if name.startswith("audio") else "") + "connector_"
    heads = _heads(inner, release.get(stated + "num_attention_heads", release["connector_num_attention_heads"]),
                   release.get(stated + "attention_head_dim", release["connector_attention_head_dim"]), name)
    return {"num_attention_heads": heads, "attention_head_dim": inner // heads,
            "num_layers": count_blocks(keys, f"{name}.transformer_1d_blocks"), "num_learnable_registers": registers,
            "rope_type": release.get("rope_type", "split"),
            "gated_attention": f"{name}.transformer_1d_blocks.0.attn1.to_gate_logits.weight" in keys}
