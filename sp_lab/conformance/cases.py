"""ComfyUI's calls of the diffusion model, per family, for the conformance suite and the families' own tests:
(x, timestep, inputs) with odd token counts, batch 2 (the CFG halves differ), fewer tokens than ranks, masks."""
from __future__ import annotations

import torch


def sd3_cases(seed=2):
    g = torch.Generator().manual_seed(seed)

    def rand(*shape):
        return torch.randn(*shape, generator=g)
    return {"35_tokens": (rand(2, 16, 10, 14), torch.tensor([700.0, 300.0]), {"context": rand(2, 7, 32),
                                                                              "y": rand(2, 24)}),
            "odd_latent": (rand(2, 16, 7, 11), torch.tensor([400.0, 900.0]), {"context": rand(2, 5, 32),
                                                                              "y": rand(2, 24)}),
            "2_tokens": (rand(1, 16, 2, 4), torch.tensor([500.0]), {"context": rand(1, 3, 32), "y": rand(1, 24)})}


def chroma_cases(seed=3):
    g = torch.Generator().manual_seed(seed)

    def rand(*shape):
        return torch.randn(*shape, generator=g)
    mask = torch.ones(2, 9, dtype=torch.long)
    mask[1, 5:] = 0
    return {"35_tokens": (rand(2, 16, 10, 14), torch.tensor([0.7, 0.3]), {"context": rand(2, 7, 32)}),
            "odd_masked_guided": (rand(2, 16, 7, 11), torch.tensor([0.4, 0.9]),
                                  {"context": rand(2, 9, 32), "attention_mask": mask,
                                   "guidance": torch.tensor([2.5, 2.5])}),
            "2_tokens": (rand(1, 16, 2, 4), torch.tensor([0.5]), {"context": rand(1, 3, 32)})}


def z_image_cases(seed=8):
    """ComfyUI calls (x, timestep, kwargs): (caption, image) tokens before padding: (9, 15), (40, 35), (32, 32),
    (33, 9)."""
    g = torch.Generator().manual_seed(seed)

    def rand(*shape):
        return torch.randn(*shape, generator=g)

    t2 = torch.tensor([0.7, 0.3])
    mask = torch.ones(2, 40, dtype=torch.long)
    mask[1, 30:] = 0  # ComfyUI's NextDiT reads past the mask: the padded tokens are attended
    return {
        "t2i": (rand(2, 16, 10, 6), t2, {"context": rand(2, 9, 32)}),
        "odd_latent_masked": (rand(2, 16, 9, 13), t2, {"context": rand(2, 40, 32), "attention_mask": mask,
                                                       "num_tokens": 40}),
        "no_padding": (rand(2, 16, 8, 16), t2, {"context": rand(2, 32, 32)}),
        "batch_1": (rand(1, 16, 6, 6), t2[:1], {"context": rand(1, 33, 32)}),
    }


def flux2_cases(seed=6):
    """ComfyUI calls (x, timestep, kwargs): image tokens 15 (+ 12 + 8 references), text 7; batch 2 and 1."""
    g = torch.Generator().manual_seed(seed)

    def rand(*shape):
        return torch.randn(*shape, generator=g)

    t2, guidance = torch.tensor([0.7, 0.3]), torch.tensor([4.0, 4.0])
    refs = [rand(2, 16, 3, 4), rand(2, 16, 4, 2)]
    return {
        "t2i": (rand(2, 16, 5, 3), t2, {"context": rand(2, 7, 32), "guidance": guidance}),
        "two_refs_index": (rand(2, 16, 5, 3), t2, {"context": rand(2, 7, 32), "guidance": guidance,
                                                   "ref_latents": refs}),
        "refs_offset": (rand(2, 16, 5, 3), t2, {"context": rand(2, 7, 32), "guidance": guidance,
                                                "ref_latents": refs, "ref_latents_method": "offset"}),
        "batch_1_no_guidance": (rand(1, 16, 3, 3), t2[:1], {"context": rand(1, 4, 32)}),
    }


def qwen_image21_cases(seed=4):
    """ComfyUI calls (x, timestep, kwargs); joint lengths 29, 65, 53 and 45 (text + references + target)."""
    g = torch.Generator().manual_seed(seed)

    def rand(*shape):
        return torch.randn(*shape, generator=g)

    t2 = torch.tensor([0.7, 0.3])
    mask = torch.ones(2, 9, dtype=torch.long)
    mask[1, 6:] = 0  # the second prompt is shorter: padding that must not be attended
    refs = [rand(2, 16, 3, 4), rand(2, 16, 4, 6)]  # the second: other row parity than the target (half-token ids)
    return {
        "t2i": (rand(2, 16, 5, 4), t2, {"context": rand(2, 9, 32)}),
        "edit_slots_masked": (rand(2, 16, 5, 4), t2, {"context": rand(2, 9, 32), "ref_latents": refs,
                                                      "image_slots": [2, 5], "attention_mask": mask}),
        "refs_after_text": (rand(1, 16, 4, 4), t2[:1], {"context": rand(1, 5, 32), "ref_latents": [rand(1, 16, 4, 6)]}),
        "adjacent_refs": (rand(2, 16, 5, 4), t2, {"context": rand(2, 9, 32), "ref_latents": refs,
                                                  "image_slots": [4, 4]}),
    }


def qwen_flux_wan_cases(family: str) -> dict:
    """Two calls each: batch 2 (a masked prompt for Qwen-Image), then batch 1 on all ranks."""
    g = torch.Generator().manual_seed(11)

    def rand(*shape):
        return torch.randn(*shape, generator=g)

    mask = torch.ones(2, 9, dtype=torch.long)
    mask[1, 6:] = 0  # the uncond prompt is shorter
    if family == "qwen_image":
        return {"batch_2_masked": (rand(2, 16, 1, 9, 7), torch.tensor([0.7, 0.7]),
                                   {"context": rand(2, 9, 32), "attention_mask": mask}),
                "batch_1": (rand(1, 16, 1, 5, 6), torch.tensor([0.4]), {"context": rand(1, 4, 32)})}
    if family == "wan":  # 45 tokens (5 frames of 3 x 3 patches); then 3 tokens, fewer than the ranks
        return {"batch_2": (rand(2, 16, 5, 6, 5), torch.tensor([700.0, 700.0]), {"context": rand(2, 7, 32)}),
                "batch_1": (rand(1, 16, 3, 2, 2), torch.tensor([300.0]), {"context": rand(1, 7, 32)})}
    return {"batch_2": (rand(2, 16, 9, 7), torch.tensor([0.7, 0.7]),
                        {"context": rand(2, 9, 32), "y": rand(2, 24), "guidance": torch.tensor([3.5, 3.5])}),
            "batch_1": (rand(1, 16, 5, 6), torch.tensor([0.4]),
                        {"context": rand(1, 4, 32), "y": rand(1, 24), "guidance": torch.tensor([3.5])})}


def cosmos_cases(seed=12):
    """Cosmos-Predict2: an image of 35 tokens (batch 2, CFG halves), a video of 27 tokens (3 frames of 3 x 3 patches,
    odd height and width padded by wrap-around), 2 tokens (fewer than the ranks)."""
    g = torch.Generator().manual_seed(seed)

    def rand(*shape):
        return torch.randn(*shape, generator=g)
    return {"35_tokens": (rand(2, 16, 1, 10, 14), torch.tensor([0.7, 0.7]), {"context": rand(2, 9, 32)}),
            "odd_video": (rand(2, 16, 3, 5, 6), torch.tensor([0.4, 0.9]), {"context": rand(2, 7, 32)}),
            "2_tokens": (rand(1, 16, 1, 2, 4), torch.tensor([0.5]), {"context": rand(1, 3, 32)})}
