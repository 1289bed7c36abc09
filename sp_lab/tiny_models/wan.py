"""Tiny random-weight Wan models (diffusers' WanTransformer3DModel, small widths) and their checkpoint files in the
original / ComfyUI key layout, as diffusers single files and as diffusers folders. The package's API dispatches here.

Variants: t2v (16 -> 16 channels), i2v (36 input channels and a CLIP image embedder of ComfyUI's fixed width 1280),
flf2v (i2v plus first-last-frame positions), i2v_concat (36 input channels, no CLIP: Wan 2.2 A14B I2V style) and
ti2v (48 -> 48 channels: Wan 2.2 5B style, run with per-frame timesteps) and vace (WanVACETransformer3DModel: 4
blocks with VACE hints after blocks 0 and 2, 96 hint channels as the real models) and fun_control (i2v with 48 input
channels and Fun Control's ref_conv of a 16-channel reference latent), fun_a14b (Wan 2.2 Fun Control A14B style: 52
input channels, no CLIP, ref_conv), fun_5b_control / fun_5b_inp (Wan 2.2 Fun 5B: ti2v with 148 input channels,
noise 48 + control 48 + mask 4 + start image 48, and ref_conv of a 48-channel reference latent / 100 input channels,
noise + mask + image), camera (Wan 2.1 Fun Camera: i2v with 32 input channels and the camera adapter
of 24-channel conditions), camera_2.2 (36 input channels, no CLIP, the adapter), humo (t2v with HuMo's audio
modules, audio_embed [B, T, 2, 5, 8] instead of ComfyUI's [B, T, 8, 5, 1280]), s2v (Wan 2.2 S2V's modules, 5
blocks with audio injected after blocks 0 and 4 as ComfyUI's list places 2 injectors, audio_embed [B, 25, 32, 4T]
instead of [B, 25, 1024, 4T]) and animate (WanAnimateTransformer3DModel: i2v with 5 blocks, one face adapter block,
and the real-size motion encoder and face encoder, whose widths ComfyUI fixes) and animate2 (Wan Animate 2: i2v's
weights, its files saying model_type animate2 in their metadata as ComfyUI's do), scail / scail2 (Wan 2.1 SCAIL:
i2v with 20 input channels and the pose Conv3d; SCAIL-2 also the 28-channel mask Conv3d), dancer (Wan 2.2 Dancer:
i2v with 5 blocks, music injected after blocks 0 and 4 as ComfyUI's list places 2 injectors, a music encoder 32 wide
instead of 256 on ComfyUI's 35 music features, its files' attention in_proj fused as released). Defaults: 6 heads (4 ranks do not divide
them) of size 16, 2 blocks. Files state their head size in the safetensors metadata key
`ulysses_sp.head_dim` (wan.detect.HEAD_DIM_METADATA_KEY) unless head_dim_metadata=False, in which case loading
needs the option head_dim=16. The original-layout writer is the inverse of the loader's key plan, written
separately so a round trip checks both.
"""
from __future__ import annotations

import json
from typing import Optional

import torch

from .weights import randomize_, save_tiny, sized

WAN_TINY = dict(patch_size=(1, 2, 2), num_attention_heads=6, attention_head_dim=16, in_channels=16, out_channels=16,
                text_dim=32, freq_dim=256, ffn_dim=128, num_layers=2, cross_attn_norm=True,
                qk_norm="rms_norm_across_heads", eps=1e-6, image_dim=None, added_kv_proj_dim=None,
                rope_max_seq_len=1024, pos_embed_seq_len=None)
CLIP_DIM = 1280         # ComfyUI's Wan image embedder input width is fixed
FLF_CLIP_TOKENS = 10    # tiny first-last-frame models: 2 x 5 CLIP tokens
VACE_TINY = dict(num_layers=4, vace_layers=[0, 2], vace_in_channels=96)
VARIANTS = ("t2v", "i2v", "flf2v", "i2v_concat", "ti2v", "vace", "fun_control", "fun_a14b", "fun_5b_control",
            "fun_5b_inp", "camera", "camera_2.2", "humo", "s2v", "animate", "animate2", "scail", "scail2", "dancer")
ANIMATE_TINY = dict(num_layers=5)  # the face adapter follows every 5th block
HUMO_TINY = dict(audio_in_features=80, audio_hidden=32, audio_dim=24)
S2V_TINY = dict(audio_dim=32, audio_layers=25, audio_tokens=4, cond_dim=16, inject_layers=[0, 4])
DANCER_TINY = dict(music_features=35, music_dim=32, music_ffn=64, music_layers=2, inject_layers=[0, 4])
CAMERA_TINY = dict(camera_in_channels=24, camera_residual_blocks=1)


def tiny_config(variant: str = "t2v", **size) -> dict:
    """diffusers config of a tiny Wan; `size` overrides any key (e.g. num_attention_heads=3)."""
    if variant not in VARIANTS:
        raise ValueError(f"unknown Wan variant {variant!r}; tiny Wan models exist for {VARIANTS}")
    config = sized("wan", dict(WAN_TINY, **{"vace": VACE_TINY, "animate": ANIMATE_TINY}.get(variant, {})), size)
    inner = config["num_attention_heads"] * config["attention_head_dim"]
    if variant in ("i2v", "flf2v", "fun_control", "camera", "animate", "animate2", "scail", "scail2", "dancer"):
        config.update(in_channels=36, image_dim=CLIP_DIM, added_kv_proj_dim=inner)
    if variant.startswith("scail"):
        config.update(in_channels=20, pose_in_channels=20, **({"mask_in_channels": 28} if variant == "scail2" else {}))
    if variant == "fun_control":
        config.update(in_channels=48, ref_in_channels=16)
    if variant == "fun_a14b":
        config.update(in_channels=52, ref_in_channels=16)
    if variant.startswith("camera"):
        config.update(in_channels=32 if variant == "camera" else 36, **CAMERA_TINY)
    if variant == "humo":
        config.update(HUMO_TINY)
    if variant == "s2v":
        config.update(s2v=dict(S2V_TINY), num_layers=size.get("num_layers", 5))
    if variant == "dancer":
        config.update(dancer=dict(DANCER_TINY), num_layers=size.get("num_layers", 5))
    if variant == "flf2v":
        config["pos_embed_seq_len"] = FLF_CLIP_TOKENS
    if variant == "i2v_concat":
        config["in_channels"] = 36
    if variant == "ti2v":
        config.update(in_channels=48, out_channels=48)
    if variant == "fun_5b_control":
        config.update(in_channels=148, out_channels=48, ref_in_channels=48)
    if variant == "fun_5b_inp":
        config.update(in_channels=100, out_channels=48)
    config.update({key: value for key, value in size.items() if key in ("in_channels", "out_channels")})
    return config


def build_tiny_model(seed: int = 0, variant: str = "t2v", **size) -> torch.nn.Module:
    """A float32 WanTransformer3DModel (VACE: WanVACETransformer3DModel, Animate: WanAnimateTransformer3DModel) with
    seeded random weights (stock attention processors)."""
    from diffusers import WanAnimateTransformer3DModel, WanTransformer3DModel, WanVACETransformer3DModel

    from sp_runtime.families.wan import EXTRA_MODULE_KEYS, attach_extra_modules
    config = tiny_config(variant, **size)
    extras = {key: config.pop(key) for key in EXTRA_MODULE_KEYS if key in config}
    model_class = {"vace": WanVACETransformer3DModel, "animate": WanAnimateTransformer3DModel}.get(
        variant, WanTransformer3DModel)
    model = model_class.from_config(config)
    attach_extra_modules(model, extras)
    randomize_(model, seed)
    if variant == "s2v":  # the audio layers' mixing weights are positive in the release (they are divided by their sum)
        model.casual_audio_encoder.weights.data.abs_()
    if variant == "animate":
        _unit_motion_weights(model, seed)
    return model.eval().requires_grad_(False)


def _unit_motion_weights(model, seed: int) -> None:
    """The motion encoder's convs and linears scale their weights by 1 / sqrt(fan-in) at run time, so they get unit
    random weights (as the real ones): scaled twice, the face video would hardly reach the output."""
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, parameter in model.motion_encoder.named_parameters():
            if parameter.dim() >= 2 and name != "motion_synthesis_weight":
                parameter.copy_(torch.randn(parameter.shape, generator=generator))


# ----- diffusers -> original (Wan / ComfyUI) names: the inverse of wan.keys, stated on its own -----
_TOP = {
    "condition_embedder.text_embedder.linear_1": "text_embedding.0",
    "condition_embedder.text_embedder.linear_2": "text_embedding.2",
    "condition_embedder.time_embedder.linear_1": "time_embedding.0",
    "condition_embedder.time_embedder.linear_2": "time_embedding.2",
    "condition_embedder.time_proj": "time_projection.1",
    "condition_embedder.image_embedder.norm1": "img_emb.proj.0",
    "condition_embedder.image_embedder.ff.net.0.proj": "img_emb.proj.1",
    "condition_embedder.image_embedder.ff.net.2": "img_emb.proj.3",
    "condition_embedder.image_embedder.norm2": "img_emb.proj.4",
    "proj_out": "head.head",
    "patch_embedding": "patch_embedding",
    "vace_patch_embedding": "vace_patch_embedding",
    "ref_conv": "ref_conv",
}
_ATTENTION = {"to_q": "q", "to_k": "k", "to_v": "v", "to_out.0": "o", "norm_q": "norm_q", "norm_k": "norm_k",
              "add_k_proj": "k_img", "add_v_proj": "v_img", "norm_added_k": "norm_k_img"}
_BLOCK = {f"{ours_attn}.{ours}": f"{theirs_attn}.{theirs}" for ours, theirs in _ATTENTION.items()
          for ours_attn, theirs_attn in (("attn1", "self_attn"), ("attn2", "cross_attn"))}
_BLOCK.update({"ffn.net.0.proj": "ffn.0", "ffn.net.2": "ffn.2", "norm2": "norm3", "proj_in": "before_proj",
               "proj_out": "after_proj"})


# the variants' modules that are named as ComfyUI names them
_SAME_NAME_MODULES = ("patch_embedding_pose.", "patch_embedding_mask.", "control_adapter.", "audio_proj.", "trainable_cond_mask.", "casual_audio_encoder.",
                      "cond_encoder.", "audio_injector.", "frame_packer.",
                      "patch_embedding_global.", "img_emb_refimage.", "head_global.", "music_injector.",
                      "music_projection.", "music_encoder.")


def original_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The model's weights under the original Wan release's / ComfyUI's key names."""
    state = {key: value.detach() for key, value in model.state_dict().items()}
    animate = {key: state.pop(key) for key in list(state) if key.startswith(_ANIMATE_MODULES)}
    out = {_original_name(key): value for key, value in _fused_music_attention(state).items()}
    if animate:
        out.update(_original_animate(animate))
    return out


def _fused_music_attention(state: dict) -> dict:
    """Wan Dancer's music attention q / k / v as its released files hold them: one in_proj_weight / in_proj_bias."""
    out = dict(state)
    for key in [key for key in state if key.startswith("music_encoder.") and ".self_attn.q_proj." in key]:
        stem, kind = key.split(".self_attn.q_proj.")
        parts = [out.pop(f"{stem}.self_attn.{name}.{kind}") for name in ("q_proj", "k_proj", "v_proj")]
        out[f"{stem}.self_attn.in_proj_{kind}"] = torch.cat(parts)
    return out


# ----- Wan Animate's modules: diffusers -> ComfyUI / Wan-Animate names -----
_ANIMATE_MODULES = ("pose_patch_embedding.", "face_adapter.", "face_encoder.", "motion_encoder.")
_FACE_BLOCK = {"to_q": "linear1_q", "to_out": "linear2", "norm_q": "q_norm", "norm_k": "k_norm"}
_MOTION_BLOCK = {"conv1.weight": "conv1.0.weight", "conv1.act_fn.bias": "conv1.1.bias",
                 "conv2.weight": "conv2.1.weight", "conv2.act_fn.bias": "conv2.2.bias",
                 "conv_skip.weight": "skip.1.weight"}


def _original_animate(state: dict) -> dict[str, torch.Tensor]:
    out = {}
    blur = torch.tensor([1.0, 3.0, 3.0, 1.0])
    blur = blur[None, :] * blur[:, None] / blur.sum() ** 2  # ComfyUI's Blur buffer (stored in released files)
    for key, value in state.items():
        stem, _, rest = key.partition(".")
        if stem == "pose_patch_embedding" or rest.startswith(("out_proj.", "padding_tokens")):
            out[key] = value
        elif stem == "face_encoder":
            conv, _, kind = rest.rpartition(".")
            out[f"face_encoder.{conv}.conv.{kind}"] = value
        elif stem == "face_adapter":
            index, module, kind = rest.split(".")
            if module in _FACE_BLOCK:
                out[f"face_adapter.fuser_blocks.{index}.{_FACE_BLOCK[module]}.{kind}"] = value
            elif module == "to_k":
                kv = torch.cat([value, state[f"face_adapter.{index}.to_v.{kind}"]])
                out[f"face_adapter.fuser_blocks.{index}.linear1_kv.{kind}"] = kv
        elif rest == "motion_synthesis_weight":
            out["motion_encoder.dec.direction.weight"] = value
        elif rest.startswith("motion_network."):
            out["motion_encoder.enc.fc." + rest.removeprefix("motion_network.")] = value
        elif rest == "conv_out.weight":
            out["motion_encoder.enc.net_app.convs.8.weight"] = value
        elif rest.startswith("conv_in."):
            name = "0.weight" if rest == "conv_in.weight" else "1.bias"
            out[f"motion_encoder.enc.net_app.convs.0.{name}"] = value if value.dim() > 1 else value.view(1, -1, 1, 1)
        else:  # res_blocks.i.*
            _, index, module = rest.split(".", 2)
            convs = f"motion_encoder.enc.net_app.convs.{int(index) + 1}."
            out[convs + _MOTION_BLOCK[module]] = value if value.dim() > 1 else value.view(1, -1, 1, 1)
            if module == "conv2.weight":
                out[convs + "conv2.0.kernel"], out[convs + "skip.0.kernel"] = blur.clone(), blur.clone()
    return out


def _original_name(key: str) -> str:
    if key.startswith(_SAME_NAME_MODULES) or ".audio_cross_attn_wrapper." in key:
        return key
    if key == "scale_shift_table":
        return "head.modulation"
    if key == "condition_embedder.image_embedder.pos_embed":
        return "img_emb.emb_pos"
    if key.startswith(("blocks.", "vace_blocks.")):
        stem, index, rest = key.split(".", 2)
        if rest == "scale_shift_table":
            return f"{stem}.{index}.modulation"
        module, _, kind = rest.rpartition(".")
        return f"{stem}.{index}.{_BLOCK[module]}.{kind}"
    module, _, kind = key.rpartition(".")
    return f"{_TOP[module]}.{kind}"


def write_tiny_checkpoint(path: str, layout: str = "original", dtype: str = "float32", seed: int = 0,
                          prefix: str = "", variant: str = "", max_shard_size: Optional[str] = None,
                          head_dim_metadata: bool = True, **size) -> str:
    """Build a tiny Wan and save it (see sp_lab.tiny_models.write_tiny_checkpoint); variant defaults to t2v."""
    from sp_runtime.families.wan.animate2 import MODEL_TYPE
    from sp_runtime.families.wan.detect import HEAD_DIM_METADATA_KEY
    model = build_tiny_model(seed, variant or "t2v", **size)
    metadata = {HEAD_DIM_METADATA_KEY: str(model.config.attention_head_dim)} if head_dim_metadata else {}
    if variant == "animate2":
        metadata["config"] = json.dumps({"transformer": {"model_type": MODEL_TYPE}})
    return save_tiny(model, path, layout, dtype, prefix, max_shard_size, original_state_dict, metadata=metadata)
