"""Tiny random-weight Chroma models (diffusers' ChromaTransformer2DModel: 6 heads of 16, 2 double + 2 single blocks,
a 2-layer guidance network of width 48) and their files in ComfyUI's key layout (Flux's `double_blocks` /
`single_blocks` without modulation, fused qkv and `linear1`, `distilled_guidance_layer` with `in_layer` /
`out_layer` / `norms.N.scale`), as diffusers single files and folders. Written by hand, apart from the loader's key
plan, so that a round trip checks both. Variant "radiance": Chroma Radiance (3 pixel channels in 4x4 patches, the
NeRF head of sp_runtime's chroma.radiance: width 8, ratio 2, 2 blocks, 3 frequencies, the 3x3 convolution; ComfyUI's
`img_in_patch` convolution, `.scale` norms and the `__x0__` / `__sequential__` markers)."""
from __future__ import annotations

import torch

from .weights import plain_tiny, randomize_

CHROMA_TINY = dict(patch_size=1, in_channels=64, out_channels=None, num_layers=2, num_single_layers=2,
                   attention_head_dim=16, num_attention_heads=6, joint_attention_dim=32, axes_dims_rope=(4, 6, 6),
                   approximator_num_channels=64, approximator_hidden_dim=48, approximator_layers=2)
_RENAMES = (("x_embedder.", "img_in."), ("context_embedder.", "txt_in."), ("proj_out.", "final_layer.linear."),
            (".linear_1.", ".in_layer."), (".linear_2.", ".out_layer."))
_DOUBLE = {"attn.to_out.0": "img_attn.proj", "attn.to_add_out": "txt_attn.proj", "ff.net.0.proj": "img_mlp.0",
           "ff.net.2": "img_mlp.2", "ff_context.net.0.proj": "txt_mlp.0", "ff_context.net.2": "txt_mlp.2",
           "attn.norm_q": "img_attn.norm.query_norm", "attn.norm_k": "img_attn.norm.key_norm",
           "attn.norm_added_q": "txt_attn.norm.query_norm", "attn.norm_added_k": "txt_attn.norm.key_norm"}
_SINGLE = {"proj_out": "linear2", "attn.norm_q": "norm.query_norm", "attn.norm_k": "norm.key_norm"}


RADIANCE_PATCH = 4
RADIANCE_HEAD = dict(pixel_patch=RADIANCE_PATCH, nerf_hidden_size=8, nerf_mlp_ratio=2, nerf_depth=2, nerf_max_freqs=3,
                     nerf_head="conv", x0=True, sequential_text_ids=True)
MARKERS = {"x0": "__x0__", "sequential_text_ids": "__sequential__"}

tiny_config, _build_chroma = plain_tiny("chroma", "ChromaTransformer2DModel", CHROMA_TINY)


def build_tiny_model(seed: int = 0, variant: str = "", **size) -> torch.nn.Module:
    """The tiny Chroma; variant "radiance": the trunk on 3-channel 4x4 pixel patches with the NeRF head (head facts
    of RADIANCE_HEAD overridable through `size`)."""
    if not variant:
        return _build_chroma(seed, **size)
    if variant != "radiance":
        raise ValueError(f"unknown variant {variant!r} for chroma (known: radiance)")
    import diffusers
    from sp_runtime.families.chroma.radiance import Radiance, attach
    head = {**RADIANCE_HEAD, **{key: size.pop(key) for key in list(size) if key in RADIANCE_HEAD}}
    config = tiny_config(in_channels=3 * head["pixel_patch"] ** 2, **size)
    model = diffusers.ChromaTransformer2DModel.from_config(config)
    attach(model, Radiance(**head))
    randomize_(model, seed)
    return model.eval().requires_grad_(False)


def original_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    state = {key: value.detach() for key, value in model.state_dict().items()}
    radiance = getattr(model, "radiance", None)
    if radiance is not None:
        return _radiance(state, radiance)
    return original_trunk(state)


def _block(stem: str, index: str, rest: str, state: dict) -> dict:
    module, _, kind = rest.rpartition(".")
    ours = f"{stem}.{index}."
    name = "double_blocks" if stem == "transformer_blocks" else "single_blocks"
    theirs = f"{name}.{index}."
    table = _DOUBLE if name == "double_blocks" else _SINGLE
    kind_out = "scale" if "norm" in module else kind
    if module in table:
        return {f"{theirs}{table[module]}.{kind_out}": state[ours + rest]}
    if name == "double_blocks" and module in ("attn.to_q", "attn.add_q_proj"):
        parts = ("to_q", "to_k", "to_v") if module == "attn.to_q" else ("add_q_proj", "add_k_proj", "add_v_proj")
        fused = "img_attn.qkv" if module == "attn.to_q" else "txt_attn.qkv"
        return {f"{theirs}{fused}.{kind}": torch.cat([state[f"{ours}attn.{p}.{kind}"] for p in parts])}
    if name == "single_blocks" and module == "attn.to_q":
        parts = ("attn.to_q", "attn.to_k", "attn.to_v", "proj_mlp")
        return {f"{theirs}linear1.{kind}": torch.cat([state[f"{ours}{p}.{kind}"] for p in parts])}
    return {}


def _radiance(state: dict, radiance) -> dict[str, torch.Tensor]:
    """ComfyUI's Radiance file: the trunk as Chroma's (no final layer), the patch embedding as a convolution, the head
    under its own names with `.scale` norms, and the markers of its facts."""
    patch = radiance.pixel_patch
    trunk = {key: value for key, value in state.items() if not key.startswith(("x_embedder.", "nerf_"))}
    out = original_trunk(trunk)
    weight = state["x_embedder.weight"]
    out["img_in_patch.weight"] = weight.reshape(weight.shape[0], -1, patch, patch)
    out["img_in_patch.bias"] = state["x_embedder.bias"]
    for key, value in state.items():
        if key.startswith("nerf_"):
            out[key[:-len("weight")] + "scale" if ".norm.weight" in key else key] = value
    out.update({marker: torch.zeros(0) for fact, marker in MARKERS.items() if getattr(radiance, fact)})
    return out


def original_trunk(state: dict) -> dict[str, torch.Tensor]:
    """Chroma's ComfyUI names of a state dict."""
    out = {}
    for key, value in state.items():
        stem, index, rest = (key.split(".", 2) + ["", ""])[:3]
        if stem in ("transformer_blocks", "single_transformer_blocks"):
            out.update(_block(stem, index, rest, state))
        else:
            for ours, theirs in _RENAMES:
                key = key.replace(ours, theirs)
            out[key[:-len("weight")] + "scale" if ".norms." in key else key] = value
    return out
