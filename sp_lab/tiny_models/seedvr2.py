"""Tiny random-weight SeedVR2 models: our SeedVR2Model (sp_runtime.families.seedvr2.model) at 3 heads of 32, 3 blocks
(the first 2 with separate video / text weights, the last shared), a 48-wide text and stored prompts of 5 and 6
tokens; the rotary's 5 frequencies per axis stored as the file's `blocks.N.attn.rope.rope.freqs` (30 of 32 channels
rotated). variant "3b" (swiglu, output norm, last block video-only) or "7b" (GELU MLPs, every block whole)."""
from __future__ import annotations

import torch

from .weights import randomize_, sized

SEEDVR2_TINY = dict(variant="3b", vid_dim=96, heads=3, head_dim=32, num_layers=3, mm_layers=2, mlp_type="swiglu",
                    mlp_hidden=128, txt_in_dim=48, in_channels=33, out_channels=16, norm_eps=1e-5, rope_frequencies=5,
                    qk_bias=False, patch_size=(1, 2, 2), positive_tokens=5, negative_tokens=6)


def tiny_config(**size) -> dict:
    config = sized("seedvr2", SEEDVR2_TINY, size)
    if config["variant"] == "7b" and "mlp_type" not in size:
        config["mlp_type"] = "normal"
    return config


def build_tiny_model(seed: int = 0, variant: str = "3b", **size) -> torch.nn.Module:
    from sp_runtime.families.seedvr2.model import SeedVR2Model
    model = SeedVR2Model(tiny_config(variant=variant, **size))
    randomize_(model, seed)
    generator = torch.Generator().manual_seed(seed + 1)
    for name in ("positive_conditioning", "negative_conditioning"):
        getattr(model, name).copy_(torch.randn(getattr(model, name).shape, generator=generator))
    return model.eval().requires_grad_(False)


def original_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """ComfyUI's names (ours), plus the rotary frequencies ComfyUI's modules store in every block."""
    from sp_runtime.families.seedvr2.windows import language_frequencies, pixel_frequencies
    config = model.config
    frequencies = (language_frequencies if config.variant == "3b" else pixel_frequencies)(config.rope_frequencies)
    state = {key: value.detach() for key, value in model.state_dict().items()}
    for index in range(config.num_layers):
        state[f"blocks.{index}.attn.rope.rope.freqs"] = frequencies.clone()
    return state
