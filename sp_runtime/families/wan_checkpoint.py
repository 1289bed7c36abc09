"""Wan 2.1 / 2.2 checkpoints from the header alone: key layout (original / ComfyUI or diffusers), variant,
WanTransformer3DModel (or, for VACE, WanVACETransformer3DModel) config, and the per-tensor key plan from the
original names to diffusers' names.

The plan is our per-tensor version of diffusers' `convert_wan_transformer_to_diffusers` (string replacements over a
whole state dict in memory); per tensor, each weight is cast to its final dtype as it is read. It also maps
`img_emb.emb_pos` (first-last-frame models), which that converter leaves unconverted. tests/test_wan.py checks both
give the same tensors. No torch or diffusers import here: detection runs in the ComfyUI process.
"""
from __future__ import annotations

import json
import math
from typing import Optional

from ..contract import Detection
from ..checkpoints.loading import KeyPlan, count_blocks, find_prefix, layout_keys, shape_of, strip_prefix
from ..checkpoints.header import Header, header_config
from .wan_animate import ANIMATE_MODULES, animate_architecture, animate_key_targets
from .wan_animate2 import (DIFFUSERS_ANCHOR, MODEL_TYPE, RELEASE_ANCHOR, animate2_original_key,
                           check_animate2_architecture)

FAMILY = "wan"
DEFAULT_HEAD_DIM = 128  # every released Wan model; q/k norms span all heads, so no checkpoint shows it
HEAD_DIM_METADATA_KEY = "ulysses_sp.head_dim"  # our tiny test checkpoints state theirs here
DIFFUSERS_CLASS = "WanTransformer3DModel"
VACE_CLASS = "WanVACETransformer3DModel"
ANIMATE_CLASS = "WanAnimateTransformer3DModel"
DIFFUSERS_CLASSES = (DIFFUSERS_CLASS, VACE_CLASS, ANIMATE_CLASS)
ORIGINAL_CLASS = "WanModel"  # config.json of the original Wan-AI release folders (original key names)
ANIMATE2_CLASS = "WanAnimate2Transformer3DModel"  # its keys are the original names but for attention (wan_animate2)
CAMERA_ADAPTER = "control_adapter"  # Fun Camera's module (wan_camera), the same name in both layouts
HUMO_AUDIO, HUMO_BLOCK_AUDIO = "audio_proj", "audio_cross_attn_wrapper"  # HuMo's modules (wan_humo), both layouts
# Wan 2.2 S2V's modules (wan_s2v), stated with ComfyUI's names in both layouts
S2V_MODULES = ("trainable_cond_mask.", "casual_audio_encoder.", "cond_encoder.", "audio_injector.", "frame_packer.")
# the blocks after which ComfyUI's WanModel_S2V injects audio (its default; its detection passes no other)
COMFY_S2V_INJECT_LAYERS = (0, 4, 8, 12, 16, 20, 24, 27, 30, 33, 36, 39)
FUN_CONTROL_CHANNELS = 48  # noise 16 + control video 16 + image latent 16 (ComfyUI's WAN21_FunControl2V)

ORIGINAL_ANCHORS = ("patch_embedding.weight", "text_embedding.0.weight", "time_embedding.0.weight",
                    "time_projection.1.weight", "blocks.0.self_attn.q.weight", "head.head.weight", "head.modulation")
DIFFUSERS_ANCHORS = ("patch_embedding.weight", "condition_embedder.time_proj.weight",
                     "condition_embedder.text_embedder.linear_1.weight", "blocks.0.attn1.to_q.weight",
                     "scale_shift_table", "proj_out.weight")
# the block key of ORIGINAL_ANCHORS and where Wan Animate 2's other layouts have it (wan_animate2)
_ORIGINAL_BLOCK_ANCHOR = "blocks.0.self_attn.q.weight"
ANIMATE2_LAYOUT_ANCHORS = tuple(tuple(anchor if anchor != _ORIGINAL_BLOCK_ANCHOR else block
                                      for anchor in ORIGINAL_ANCHORS) for block in (RELEASE_ANCHOR, DIFFUSERS_ANCHOR))

SUPPORTED = ("Wan 2.1 / 2.2 T2V, I2V, FLF2V, TI2V 5B, VACE, Fun InP / Control / Camera (5B: InP, Control), HuMo, "
             "Wan 2.2 S2V, Wan 2.2 Animate, Wan Animate 2")

# ----- original (Wan / ComfyUI) module names -> diffusers module names -----
_TOP = {
    "patch_embedding": "patch_embedding",
    "vace_patch_embedding": "vace_patch_embedding",
    "ref_conv": "ref_conv",  # Fun Control's reference image (wan_fun), the same name in both layouts
    "text_embedding.0": "condition_embedder.text_embedder.linear_1",
    "text_embedding.2": "condition_embedder.text_embedder.linear_2",
    "time_embedding.0": "condition_embedder.time_embedder.linear_1",
    "time_embedding.2": "condition_embedder.time_embedder.linear_2",
    "time_projection.1": "condition_embedder.time_proj",
    "head.head": "proj_out",
    "img_emb.proj.0": "condition_embedder.image_embedder.norm1",
    "img_emb.proj.1": "condition_embedder.image_embedder.ff.net.0.proj",
    "img_emb.proj.3": "condition_embedder.image_embedder.ff.net.2",
    "img_emb.proj.4": "condition_embedder.image_embedder.norm2",
}
_TOP_PARAMETERS = {"head.modulation": "scale_shift_table",
                   "img_emb.emb_pos": "condition_embedder.image_embedder.pos_embed"}
_BLOCK = {
    "self_attn.q": "attn1.to_q", "self_attn.k": "attn1.to_k", "self_attn.v": "attn1.to_v",
    "self_attn.o": "attn1.to_out.0", "self_attn.norm_q": "attn1.norm_q", "self_attn.norm_k": "attn1.norm_k",
    "cross_attn.q": "attn2.to_q", "cross_attn.k": "attn2.to_k", "cross_attn.v": "attn2.to_v",
    "cross_attn.o": "attn2.to_out.0", "cross_attn.norm_q": "attn2.norm_q", "cross_attn.norm_k": "attn2.norm_k",
    "cross_attn.k_img": "attn2.add_k_proj", "cross_attn.v_img": "attn2.add_v_proj",
    "cross_attn.norm_k_img": "attn2.norm_added_k",
    "norm3": "norm2",  # the original's norm3 is the (affine) cross-attention norm; its norm2 has no weights
    "ffn.0": "ffn.net.0.proj", "ffn.2": "ffn.net.2",
    "before_proj": "proj_in", "after_proj": "proj_out",  # VACE blocks: hint in (block 0 only) and hint out
}
_BLOCK_PARAMETERS = {"modulation": "scale_shift_table"}
# diffusers keys some released diffusers checkpoints carry but WanTransformer3DModel does not use
DIFFUSERS_IGNORED_SUFFIX = ".norm_added_q.weight"


# ---------------------------------------------------------------------------------------------------------------
# Key plan

def wan_key_plan(keys) -> KeyPlan:
    """Original-layout key (prefix stripped) -> [(diffusers key, transform)]; keys it does not know are left out."""
    plan = {}
    for key in keys:
        if key.startswith(ANIMATE_MODULES):
            targets = animate_key_targets(key)
        else:
            target = _convert(animate2_original_key(key))
            targets = None if target is None else [(target, None)]
        if targets is not None:
            plan[key] = targets
    return plan


def _convert(key: str) -> Optional[str]:
    if key.startswith((CAMERA_ADAPTER + ".", HUMO_AUDIO + ".", *S2V_MODULES)):  # ComfyUI's names in both layouts
        return key
    if key in _TOP_PARAMETERS:
        return _TOP_PARAMETERS[key]
    stem = key.split(".", 1)[0]
    if stem in ("blocks", "vace_blocks") and key.count(".") >= 2:
        _, index, rest = key.split(".", 2)
        if not index.isdigit():
            return None
        if rest in _BLOCK_PARAMETERS:
            return f"{stem}.{index}.{_BLOCK_PARAMETERS[rest]}"
        if rest.startswith(HUMO_BLOCK_AUDIO + "."):
            return key
        module, _, kind = rest.rpartition(".")
        return f"{stem}.{index}.{_BLOCK[module]}.{kind}" if module in _BLOCK and kind in ("weight", "bias") else None
    module, _, kind = key.rpartition(".")
    return f"{_TOP[module]}.{kind}" if module in _TOP and kind in ("weight", "bias") else None


# ---------------------------------------------------------------------------------------------------------------
# Detection

def detect(header: Header) -> Optional[Detection]:
    """Wan 2.1 / 2.2 from the header alone; None when the file is another family."""
    folder_config = header_config(header)
    if folder_config is not None and folder_config.get("_class_name") not in (None, *DIFFUSERS_CLASSES,
                                                                                ORIGINAL_CLASS, ANIMATE2_CLASS):
        name = folder_config["_class_name"]
        if name.startswith("Wan"):
            raise ValueError(f"{header.path!r} is a {name}: only {DIFFUSERS_CLASS} (Wan 2.1 / 2.2 T2V, I2V, FLF2V "
                             f"and TI2V 5B), {VACE_CLASS}, {ANIMATE_CLASS} and {ANIMATE2_CLASS} are supported")
        return None
    prefix, animate2_layout = _original_prefix(header)
    if prefix is not None:
        keys = strip_prefix(header.tensors, prefix)
        _reject_unknown(header, keys, wan_key_plan(keys))
        keys = {animate2_original_key(key): value for key, value in keys.items()}
        config = architecture(keys, "original", _stated_head_dim(header, folder_config))
        if animate2_layout or _stated_model_type(header) == MODEL_TYPE:
            check_animate2_architecture(config, header.path)
            config["animate2"] = True
        return _detection(header, "original", prefix, config)
    prefix = find_prefix(header.tensors, DIFFUSERS_ANCHORS)
    if prefix is None:
        return None
    keys = strip_prefix(header.tensors, prefix)
    config = architecture(keys, "diffusers", _stated_head_dim(header, folder_config))
    return _detection(header, "diffusers", prefix, config)


def _original_prefix(header: Header) -> tuple[Optional[str], bool]:
    """(prefix of the original / ComfyUI key layout or None, whether the keys are one of Animate 2's own layouts)."""
    prefix = find_prefix(header.tensors, ORIGINAL_ANCHORS)
    if prefix is not None:
        return prefix, False
    for anchors in ANIMATE2_LAYOUT_ANCHORS:
        prefix = find_prefix(header.tensors, anchors)
        if prefix is not None:
            return prefix, True
    return None, False


def _detection(header: Header, layout: str, prefix: str, config: dict) -> Detection:
    return Detection(family=FAMILY, variant=variant_of(config), layout=layout, prefix=prefix, config=config,
                     files=header.source.files)


def variant_of(config: dict) -> str:
    """vace (hint blocks), s2v (speech-to-video), humo (audio), animate (pose and face inputs), animate2 (Wan Animate
    2: I2V's weights, said by the file's metadata or key layout), camera / camera_2.2
    (Fun Camera with / without CLIP), fun_control (Wan 2.1 Fun Control: CLIP and 48 input channels), ti2v (Wan 2.2
    5B, 48 latent channels), flf2v / i2v (CLIP image input), i2v_concat (image latent in extra input channels
    without CLIP: Wan 2.2 A14B I2V experts, Fun models) or t2v (also the Wan 2.2 A14B T2V experts)."""
    if config.get("vace_layers"):
        return "vace"
    if config.get("s2v"):
        return "s2v"
    if config.get("audio_dim"):
        return "humo"
    if config.get("motion_encoder_dim"):
        return "animate"
    if config.get("animate2"):
        return "animate2"
    if config.get("camera_in_channels"):  # ComfyUI's model types: camera (with CLIP) and camera_2.2
        if config["out_channels"] == 48:
            raise ValueError(f"this is a Wan 2.2 Fun 5B Control-Camera checkpoint (48-channel latents, "
                             f"{config['in_channels']} input channels, the camera adapter): ComfyUI has no model "
                             f"class for it (its camera_2.2 models take 36 channels), so it is not supported; "
                             f"supported: {SUPPORTED}")
        return "camera" if config.get("image_dim") else "camera_2.2"
    if config.get("image_dim") and config["in_channels"] == FUN_CONTROL_CHANNELS:
        return "fun_control"
    if config["out_channels"] == 48:
        return "ti2v"
    if config.get("image_dim"):
        return "flf2v" if config.get("pos_embed_seq_len") else "i2v"
    return "i2v_concat" if config["in_channels"] != config["out_channels"] else "t2v"


def _stated_head_dim(header: Header, folder_config: Optional[dict]) -> Optional[int]:
    """The head size where the files state it: our metadata key, or an original release folder's num_heads."""
    stated = header.metadata.get(HEAD_DIM_METADATA_KEY)
    if stated:
        return int(stated)
    if folder_config and folder_config.get("_class_name") in (ORIGINAL_CLASS, ANIMATE2_CLASS) and folder_config.get(
            "num_heads"):
        return int(folder_config["dim"]) // int(folder_config["num_heads"])
    if folder_config and folder_config.get("attention_head_dim"):
        return int(folder_config["attention_head_dim"])
    return None


def _stated_model_type(header: Header) -> Optional[str]:
    """The model_type ComfyUI's model_detection reads from the file's metadata (config.transformer), if any."""
    try:
        return json.loads(header.metadata.get("config", "{}")).get("transformer", {}).get("model_type")
    except (ValueError, AttributeError):  # metadata of other tools: not ComfyUI's
        return None


def _reject_unknown(header: Header, keys: dict, plan: dict) -> None:
    unknown = [key for key in keys if key not in plan]
    if unknown:
        modules = _module_names(unknown)
        shown = ", ".join(modules[:8]) + (f" and {len(modules) - 8} more" if len(modules) > 8 else "")
        raise ValueError(f"{header.path!r} looks like Wan but has modules this loader does not know: {shown} "
                         f"({len(unknown)} tensors): a Wan variant with extra modules, which is not supported")


def _module_names(keys: list) -> list:
    """The modules that hold `keys`, block numbers as '*' (blocks.*.audio_adapter.proj, not one per block)."""
    names = {".".join("*" if part.isdigit() else part for part in key.split(".")[:-1]) or key for key in keys}
    return sorted(names)


def _with_heads(config: dict, head_dim: Optional[int]) -> dict:
    """Set the head size and count (None while unknown: load() then needs the head_dim option)."""
    inner = config.pop("inner_dim")
    head_dim = head_dim or DEFAULT_HEAD_DIM
    if inner % head_dim:
        config.update(attention_head_dim=None, num_attention_heads=None, inner_dim_unsplit=inner)
    else:
        config.update(attention_head_dim=head_dim, num_attention_heads=inner // head_dim)
    return config


# Where a header shows each architecture fact: (original key, diffusers key), prefix stripped
ARCHITECTURE_KEYS = {
    "out": ("head.head.weight", "proj_out.weight"),
    "text": ("text_embedding.0.weight", "condition_embedder.text_embedder.linear_1.weight"),
    "time": ("time_embedding.0.weight", "condition_embedder.time_embedder.linear_1.weight"),
    "ffn": ("blocks.0.ffn.0.weight", "blocks.0.ffn.net.0.proj.weight"),
    "cross_attn_norm": ("blocks.0.norm3.weight", "blocks.0.norm2.weight"),
    "image": ("img_emb.proj.1.weight", "condition_embedder.image_embedder.ff.net.0.proj.weight"),
    "image_kv": ("blocks.0.cross_attn.k_img.weight", "blocks.0.attn2.add_k_proj.weight"),
    "image_pos": ("img_emb.emb_pos", "condition_embedder.image_embedder.pos_embed"),
    "qk_norm": ("blocks.0.self_attn.norm_q.weight", "blocks.0.attn1.norm_q.weight"),
}


def architecture(keys: dict, layout: str, head_dim: Optional[int] = None) -> dict:
    """WanTransformer3DModel config from a header in the "original" or "diffusers" key layout (keys without
    prefix)."""
    names = layout_keys(ARCHITECTURE_KEYS, layout)

    def optional_width(fact: str) -> Optional[int]:  # parts only image models have
        return shape_of(keys, names[fact])[1] if names[fact] in keys else None

    inner, in_channels, *patch = shape_of(keys, "patch_embedding.weight")
    config = {
        "patch_size": tuple(patch),
        "inner_dim": inner,
        "in_channels": in_channels,
        "out_channels": shape_of(keys, names["out"])[0] // math.prod(patch),
        "text_dim": shape_of(keys, names["text"])[1],
        "freq_dim": shape_of(keys, names["time"])[1],
        "ffn_dim": shape_of(keys, names["ffn"])[0],
        "num_layers": count_blocks(keys, "blocks"),
        "cross_attn_norm": names["cross_attn_norm"] in keys,
        "qk_norm": "rms_norm_across_heads",
        "eps": 1e-6,
        "image_dim": optional_width("image"),
        "added_kv_proj_dim": optional_width("image_kv"),
        "rope_max_seq_len": 1024,
        "pos_embed_seq_len": optional_width("image_pos"),
    }
    if "vace_patch_embedding.weight" in keys:
        config.update(vace_architecture(keys, config["num_layers"]))
    if f"{CAMERA_ADAPTER}.conv.weight" in keys:
        config.update(camera_in_channels=shape_of(keys, f"{CAMERA_ADAPTER}.conv.weight")[1] // 64,
                      camera_residual_blocks=count_blocks(keys, f"{CAMERA_ADAPTER}.residual_blocks"))
    if f"{HUMO_AUDIO}.audio_proj_glob_1.layer.weight" in keys:
        hidden, in_features = shape_of(keys, f"{HUMO_AUDIO}.audio_proj_glob_1.layer.weight")
        config.update(audio_in_features=in_features, audio_hidden=hidden,
                      audio_dim=shape_of(keys, f"{HUMO_AUDIO}.audio_proj_glob_norm.layer.weight")[0])
    if "casual_audio_encoder.encoder.final_linear.weight" in keys:
        config["s2v"] = s2v_architecture(keys, inner)
    if "ref_conv.weight" in keys:
        config["ref_in_channels"] = shape_of(keys, "ref_conv.weight")[1]
    if any(key.startswith(ANIMATE_MODULES) for key in keys):
        config.update(animate_architecture(keys, layout, config["num_layers"], in_channels))
    _check_qk_norm(keys, names["qk_norm"])
    return _with_heads(config, head_dim)


def vace_architecture(keys: dict, num_layers: int) -> dict:
    """VACE's hint input width and the main blocks after which each VACE block's hint is added: evenly spaced from
    block 0, as ComfyUI's VaceWanModel places them (Wan 2.1 VACE 14B: 8 of 40, 1.3B: 15 of 30)."""
    count = count_blocks(keys, "vace_blocks")
    if not count or num_layers % count:
        raise ValueError(f"this Wan VACE checkpoint has {count} VACE blocks for {num_layers} blocks; VACE places "
                         f"one hint every num_layers / vace_blocks blocks, so they must divide evenly")
    return {"vace_layers": list(range(0, num_layers, num_layers // count)),
            "vace_in_channels": shape_of(keys, "vace_patch_embedding.weight")[1]}


def s2v_architecture(keys: dict, width: int) -> dict:
    """Wan 2.2 S2V's audio encoder sizes, control-video channels and the blocks after which audio is injected:
    ComfyUI's WanModel_S2V injects after the blocks of a fixed list (the 14B release's 12 injectors), so a file's k
    injectors take its first k."""
    count = count_blocks(keys, "audio_injector.injector")
    if "audio_injector.injector_adain_layers.0.linear.weight" not in keys or not 0 < count <= len(
            COMFY_S2V_INJECT_LAYERS):
        raise ValueError(f"this Wan S2V checkpoint has {count} audio injectors and "
                         f"{count_blocks(keys, 'audio_injector.injector_adain_layers')} adaptive norms; ComfyUI's "
                         f"WanModel_S2V takes 1 to {len(COMFY_S2V_INJECT_LAYERS)} injectors, each with its norm")
    local_channels, audio_dim, _ = shape_of(keys, "casual_audio_encoder.encoder.conv1_local.conv.weight")
    return {"audio_dim": audio_dim, "audio_layers": shape_of(keys, "casual_audio_encoder.weights")[1],
            "audio_tokens": local_channels // (width // 4),
            "cond_dim": shape_of(keys, "cond_encoder.weight")[1] if "cond_encoder.weight" in keys else 0,
            "inject_layers": list(COMFY_S2V_INJECT_LAYERS[:count])}


def _check_qk_norm(keys: dict, key: str) -> None:
    if key not in keys:
        raise ValueError(f"this Wan checkpoint has no {key!r}: Wan models without q/k norms are not supported")


def folder_overrides(folder_config: Optional[dict]) -> dict:
    """Settings of a diffusers config.json that a header cannot show (eps, rope length, VACE hint placement), kept
    when present."""
    if not folder_config or folder_config.get("_class_name") not in DIFFUSERS_CLASSES:
        return {}
    return {key: folder_config[key] for key in ("eps", "rope_max_seq_len", "vace_layers") if key in folder_config}
