"""Tiny random-weight HiDream-O1 models (our HiDreamO1Transformer: width 32, 6 query heads of 16 over 2 key / value
heads, MRoPE sections (3, 2, 2), 2 layers, ComfyUI's 32 x 32 RGB patch and full vocabulary, which must hold
<|tms_token|> 151673; a vision tower of width 128 (16 heads of 8), 2 blocks, ComfyUI's 2 x 16 x 16 RGB patches, a 4 x 4
position table, 2 x 2 merge) and their files in ComfyUI's key layout (`language_model.*`, `visual.*`, plus deepstack
merger tensors the loader must read past); written apart from the loader's key plan so that a round trip checks
both."""
from __future__ import annotations

import torch

from .weights import randomize_, sized

HIDREAM_O1_TINY = dict(vocab_size=151936, hidden_size=32, intermediate_size=64, num_layers=2, num_attention_heads=6,
                       num_key_value_heads=2, head_dim=16, patch_size=32, bottleneck_dim=8, rope_theta=5_000_000.0,
                       mrope_section=(3, 2, 2), rms_norm_eps=1e-6, tms_token_id=151673,
                       vision=dict(width=128, depth=2, inner=48, patch=16, temporal=2, positions=16, merge=2, out=32,
                                   channels=3))
DEEPSTACK = {"visual.deepstack_merger_list.0.norm.weight": (512,),
             "visual.deepstack_merger_list.0.linear_fc2.weight": (32, 512)}


def tiny_config(**size) -> dict:
    config = sized("hidream_o1", HIDREAM_O1_TINY, size)
    if "head_dim" in size and "mrope_section" not in size:  # the released sections scaled, as detection
        config["mrope_section"] = tuple(part * config["head_dim"] // 128 for part in (24, 20, 20))
    if config["vision"]:
        config["vision"] = {**config["vision"], "out": config["hidden_size"]}
    return config


def build_tiny_model(seed: int = 0, **size) -> torch.nn.Module:
    from sp_runtime.families.hidream_o1.model import transformer_class
    model = transformer_class().from_config(tiny_config(**size))
    randomize_(model, seed)
    if hasattr(model, "visual"):  # randomize_ scales by the 3 input channels: by all 1536 pixel features instead
        weight = model.visual.patch_embed.proj.weight
        weight.data /= (weight[0].numel() / weight.shape[1]) ** 0.5
    return model.eval().requires_grad_(False)


def original_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """ComfyUI's names: the decoder under `language_model.`, the vision tower under `visual.` with the deepstack
    mergers ComfyUI drops."""
    out = {}
    for key, value in model.state_dict().items():
        decoder = key.startswith(("embed_tokens.", "layers.", "norm."))
        out[("language_model." if decoder else "") + key] = value.detach()
    generator = torch.Generator().manual_seed(1)
    out.update({key: torch.randn(shape, generator=generator) for key, shape in DEEPSTACK.items()})
    return out
