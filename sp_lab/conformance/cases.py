"""ComfyUI's calls of the diffusion model, per family, for the conformance suite and the families' own tests:
(x, timestep, inputs) with odd token counts, batch 2 (the CFG halves differ), fewer tokens than ranks, masks."""
from __future__ import annotations

from typing import Callable

import torch


def seeded_randn(seed: int, dtype: torch.dtype = torch.float32) -> Callable[..., torch.Tensor]:
    """randn(*shape) in `dtype`, every draw from one generator seeded with `seed` (a case's tensors, in its order)."""
    generator = torch.Generator().manual_seed(seed)
    return lambda *shape: torch.randn(*shape, generator=generator).to(dtype)


def sd3_cases(seed=2):
    rand = seeded_randn(seed)
    return {"35_tokens": (rand(2, 16, 10, 14), torch.tensor([700.0, 300.0]), {"context": rand(2, 7, 32),
                                                                              "y": rand(2, 24)}),
            "odd_latent": (rand(2, 16, 7, 11), torch.tensor([400.0, 900.0]), {"context": rand(2, 5, 32),
                                                                              "y": rand(2, 24)}),
            "2_tokens": (rand(1, 16, 2, 4), torch.tensor([500.0]), {"context": rand(1, 3, 32), "y": rand(1, 24)})}


def chroma_cases(seed=3):
    rand = seeded_randn(seed)
    mask = torch.ones(2, 9, dtype=torch.long)
    mask[1, 5:] = 0
    return {"35_tokens": (rand(2, 16, 10, 14), torch.tensor([0.7, 0.3]), {"context": rand(2, 7, 32)}),
            "odd_masked_guided": (rand(2, 16, 7, 11), torch.tensor([0.4, 0.9]),
                                  {"context": rand(2, 9, 32), "attention_mask": mask,
                                   "guidance": torch.tensor([2.5, 2.5])}),
            "2_tokens": (rand(1, 16, 2, 4), torch.tensor([0.5]), {"context": rand(1, 3, 32)})}


def chroma_radiance_cases(seed=3):
    """Chroma Radiance's pixels (3 channels, 4x4 patches): 35 patches of an odd image (the last patch row and column
    padded: the convolution reads the wrap-around), 30 patches (4 ranks: 8, 8, 7, 7) in batch 2 with a text padding mask
and a guidance, 2 patches (fewer than the ranks)."""
    rand = seeded_randn(seed)
    mask = torch.ones(2, 9, dtype=torch.long)
    mask[1, 5:] = 0
    return {"35_patches": (rand(2, 3, 19, 27), torch.tensor([0.7, 0.3]), {"context": rand(2, 7, 32)}),
            "30_masked_guided": (rand(2, 3, 20, 24), torch.tensor([0.4, 0.9]),
                                 {"context": rand(2, 9, 32), "attention_mask": mask,
                                  "guidance": torch.tensor([2.5, 2.5])}),
            "2_patches": (rand(1, 3, 4, 8), torch.tensor([0.5]), {"context": rand(1, 3, 32)})}


def z_image_cases(seed=8):
    """ComfyUI calls (x, timestep, kwargs): (caption, image) tokens before padding: (9, 15), (40, 35), (32, 32),
    (33, 9)."""
    rand = seeded_randn(seed)
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
    rand = seeded_randn(seed)
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
    rand = seeded_randn(seed)
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


def qwen_image_cases(timesteps=(0.7, 0.3), dtype=torch.float32, seed=1):
    """ComfyUI calls: (x, timestep, kwargs). Token counts 35, 20 (odd latent, padded), 9, 2; batch 2 and 1; a masked
    prompt; Edit reference latents by index and by offset."""
    rand = seeded_randn(seed, dtype)
    t2 = torch.tensor(timesteps)
    mask = torch.ones(2, 9, dtype=torch.long)
    mask[1, 5:] = 0  # the second prompt is shorter: padding that must not be attended
    refs = [rand(2, 16, 1, 6, 5), rand(2, 16, 1, 4, 8)]
    return {
        "35_tokens_masked": (rand(2, 16, 1, 10, 14), t2, {"context": rand(2, 9, 32), "attention_mask": mask}),
        "odd_latent": (rand(2, 16, 1, 9, 7), t2, {"context": rand(2, 9, 32)}),
        "edit_two_refs": (rand(2, 16, 1, 9, 7), t2, {"context": rand(2, 9, 32), "ref_latents": refs,
                                                      "attention_mask": mask}),
        "edit_offset": (rand(2, 16, 1, 9, 7), t2, {"context": rand(2, 9, 32), "ref_latents": refs,
                                                    "ref_latents_method": "offset"}),
        "batch_1": (rand(1, 16, 1, 5, 6), t2[:1], {"context": rand(1, 4, 32)}),
        "2_tokens": (rand(1, 16, 1, 1, 3), t2[:1], {"context": rand(1, 4, 32)}),  # ranks without tokens
    }


def flux_cases(timesteps=(0.7, 0.3), dtype=torch.float32, channels=16, seed=2):
    """ComfyUI calls: (x, timestep, kwargs). Token counts 35, 20 (odd latent, padded), 9, 2; batch 2 and 1; Kontext
    references by offset, index and uxo; a call without y."""
    rand = seeded_randn(seed, dtype)
    t2, guidance = torch.tensor(timesteps), torch.tensor([3.5, 3.5])
    refs = [rand(2, channels, 6, 5), rand(2, channels, 4, 8)]

    def conditioning(batch=2):
        return {"context": rand(batch, 9, 32), "y": rand(batch, 24), "guidance": guidance[:batch]}
    return {
        "35_tokens": (rand(2, channels, 10, 14), t2, conditioning()),
        "odd_latent": (rand(2, channels, 9, 7), t2, conditioning()),
        "kontext_offset": (rand(2, channels, 9, 7), t2, {**conditioning(), "ref_latents": refs}),
        "kontext_index": (rand(2, channels, 7, 8), t2, {**conditioning(), "ref_latents": refs,
                                                         "ref_latents_method": "index"}),
        "kontext_uxo": (rand(2, channels, 7, 8), t2, {**conditioning(), "ref_latents": refs[:1],
                                                       "ref_latents_method": "uxo"}),
        "batch_1_no_y": (rand(1, channels, 5, 6), t2[:1], {"context": rand(1, 4, 32), "guidance": guidance[:1]}),
        "2_tokens": (rand(1, channels, 3, 1), t2[:1], {**conditioning(1)}),  # ranks without tokens
    }


def wan_cases(channels: int = 16, text_tokens: int = 7, clip_tokens: int = 0, per_frame: bool = False,
              seed: int = 1) -> dict:
    """ComfyUI calls (x, timestep, kwargs). Tokens: 45 (odd, not divisible by 2 or 4), 40 (H and W padded; not
    divisible by 3), 27 with a frame appended by time_dim_concat, and 1 token (ranks without tokens)."""
    rand = seeded_randn(seed)
    def kwargs(batch):
        extra = {"context": rand(batch, text_tokens, 32)}
        if clip_tokens:
            extra["clip_fea"] = rand(batch, clip_tokens, 1280)
        return extra

    def sigma(batch, frames):
        if not per_frame:
            return torch.tensor([700.0, 300.0])[:batch]
        # Wan 2.2 5B image-to-video: the first (given) frame at timestep 0, the others at the step's timestep
        return torch.tensor([[0.0] + [700.0] * (frames - 1), [0.0] + [300.0] * (frames - 1)])[:batch]

    cases = {
        "45_tokens": (rand(2, channels, 5, 6, 5), sigma(2, 5), kwargs(2)),
        "40_tokens_padded": (rand(2, channels, 2, 7, 9), sigma(2, 2), kwargs(2)),
        "1_token_batch_1": (rand(1, channels, 1, 2, 2), sigma(1, 1), kwargs(1)),
    }
    x, t, extra = rand(2, channels, 2, 5, 6), sigma(2, 2), kwargs(2)
    cases["time_dim_concat"] = (x, t, {**extra, "time_dim_concat": rand(2, channels, 1, 5, 6)})
    return cases


def hidream_cases(seed=3):
    """35 image tokens; an odd latent with E1's reference latent (image_cond) joined on the right; 2 tokens (fewer
    than ranks); batch 2 and 1; T5 and Llama (4 layers) text of other lengths."""
    rand = seeded_randn(seed)
    def text(batch, t5_tokens, llama_tokens):
        return {"context": rand(batch, t5_tokens, 32), "encoder_hidden_states_llama3": rand(batch, 4, llama_tokens, 24),
                "y": rand(batch, 20)}
    return {"35_tokens": (rand(2, 16, 10, 14), torch.tensor([700.0, 300.0]), text(2, 7, 5)),
            "odd_edit": (rand(2, 16, 7, 11), torch.tensor([400.0, 900.0]),
                         {**text(2, 3, 6), "image_cond": rand(2, 16, 7, 11)}),
            "2_tokens": (rand(1, 16, 2, 4), torch.tensor([500.0]), text(1, 3, 2))}


def lumina2_cases(seed=4):
    """Caption / image streams of 11 / 35 tokens; an odd latent with a masked caption; 3 / 2 tokens (fewer than
    ranks); batch 2 and 1."""
    rand = seeded_randn(seed)
    t2 = torch.tensor([0.8, 0.25])
    mask = torch.ones(2, 11, dtype=torch.long)
    mask[1, 7:] = 0  # ComfyUI's NextDiT reads past the mask: every caption token is attended
    return {"t2i": (rand(2, 16, 10, 14), t2, {"context": rand(2, 11, 32)}),
            "odd_latent_masked": (rand(2, 16, 9, 13), t2, {"context": rand(2, 11, 32), "attention_mask": mask,
                                                           "num_tokens": 11}),
            "few_tokens": (rand(1, 16, 2, 4), t2[:1], {"context": rand(1, 3, 32)})}


def newbie_cases(seed=5):
    """NewBie (Lumina 2 with pooled CLIP text, width 40): pooled text per batch item; none (zeros, as ComfyUI without
    it); fewer tokens than ranks."""
    rand = seeded_randn(seed)
    t2 = torch.tensor([0.7, 0.3])
    return {"pooled": (rand(2, 16, 9, 13), t2, {"context": rand(2, 11, 32), "clip_text_pooled": rand(2, 40)}),
            "no_pooled": (rand(2, 16, 10, 14), t2, {"context": rand(2, 11, 32)}),
            "few_tokens": (rand(1, 16, 2, 4), t2[:1], {"context": rand(1, 3, 32), "clip_text_pooled": rand(1, 40)})}


def ming_image_cases(seed=6):
    """Ming-Image (5-D latents): one target frame (odd, an uneven caption: 11 tokens shift the image to 33); two
    reference frames of other sizes (one odd) and direct caption tokens; two target frames; fewer tokens than
    ranks."""
    rand = seeded_randn(seed)
    t2 = torch.tensor([0.8, 0.25])
    return {"t2i": (rand(2, 16, 1, 9, 13), t2, {"context": rand(2, 11, 32)}),
            "edit_refs": (rand(2, 16, 1, 8, 10), t2, {"context": rand(2, 5, 32), "direct_context": rand(2, 3, 640),
                                                      "ref_frames": [rand(2, 16, 6, 8), rand(2, 16, 7, 5)]}),
            "two_frames": (rand(2, 16, 2, 6, 6), t2, {"context": rand(2, 7, 32)}),
            "few_tokens": (rand(1, 16, 1, 2, 4), t2[:1], {"context": rand(1, 3, 32)})}


def omnigen2_cases(seed=4):
    """Caption / image streams of 11 / 35 tokens; an odd latent with two reference latents (one odd: 12 + 12
    reference tokens); 3 / 2 tokens (fewer than ranks); batch 2 and 1."""
    rand = seeded_randn(seed)
    t2 = torch.tensor([0.8, 0.25])
    return {"t2i": (rand(2, 16, 10, 14), t2, {"context": rand(2, 11, 32), "num_tokens": 11}),
            "odd_latent_refs": (rand(2, 16, 9, 13), t2, {"context": rand(2, 7, 32), "num_tokens": 7,
                                                         "ref_latents": [rand(2, 16, 6, 8), rand(2, 16, 5, 7)]}),
            "few_tokens": (rand(1, 16, 2, 4), t2[:1], {"context": rand(1, 3, 32)})}


def hunyuan_video_cases(channels: int = 16, version: str = "1.0", seed: int = 4) -> dict:
    """ComfyUI calls (x, timestep, kwargs): 35 tokens (one frame), 105 tokens, 3 tokens (batch 1); text 7 tokens; a
    reference latent (12 tokens ahead of the video); for 1.5 image-to-video SigLIP and ByT5 glyph tokens."""
    rand = seeded_randn(seed)
    def text(batch):
        if version == "1.5":
            return {"context": rand(batch, 7, 32)}
        return {"context": rand(batch, 7, 32), "y": rand(batch, 24), "guidance": torch.tensor([6.0, 6.0])[:batch]}
    patch = 1 if version == "1.5" else 2
    t2 = torch.tensor([700.0, 300.0])
    cases = {
        "35_tokens": (rand(2, channels, 1, 5 * patch, 7 * patch), t2, text(2)),
        "105_tokens": (rand(2, channels, 3, 5 * patch, 7 * patch), t2, text(2)),
        "3_tokens_batch_1": (rand(1, channels, 3, patch, patch), t2[:1], text(1)),
    }
    x, t, inputs = cases["105_tokens"]
    cases["ref_latent"] = (x, t, {**inputs, "ref_latent": rand(2, channels, 1, 3 * patch, 4 * patch)})  # 12 + 105
    if version == "1.5":  # image-to-video: SigLIP image tokens and ByT5 glyph tokens in the text stream
        cases["i2v_glyphs"] = (x, t, {**inputs, "clip_fea": rand(2, 5, 40), "txt_byt5": rand(2, 4, 48)})
    return cases


def qwen_flux_wan_cases(family: str) -> dict:
    """Two calls each (the tensor-parallel and all-in-one tests): batch 2 (a masked prompt for Qwen-Image), then
    batch 1 on all ranks."""
    rand = seeded_randn(11)
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
    rand = seeded_randn(seed)
    return {"35_tokens": (rand(2, 16, 1, 10, 14), torch.tensor([0.7, 0.7]), {"context": rand(2, 9, 32)}),
            "odd_video": (rand(2, 16, 3, 5, 6), torch.tensor([0.4, 0.9]), {"context": rand(2, 7, 32)}),
            "2_tokens": (rand(1, 16, 1, 2, 4), torch.tensor([0.5]), {"context": rand(1, 3, 32)})}


def anima_cases(seed=16):
    """Anima (LLM adapter: Qwen3 states 48 wide, T5 ids of 100, token weights): an image of 35 tokens (batch 2, 9 Qwen3
    and 7 T5 tokens), ComfyUI's packed prompts (cond and uncond of different lengths, as its extra_conds gives them),
    a video of 27 tokens, the adapter's output given as context (no ids), 2 tokens (batch 1, no weights)."""
    from sp_runtime.families.anima.text import pack
    rand = seeded_randn(seed)
    ids = torch.Generator().manual_seed(seed)

    def prompt(batch, text, tokens):
        return {"context": rand(batch, text, 48), "t5xxl_ids": torch.randint(0, 100, (batch, tokens), generator=ids),
                "t5xxl_weights": 0.5 + rand(batch, tokens, 1).abs()}
    cond, uncond = prompt(1, 9, 7), prompt(1, 4, 11)
    packed = torch.cat([pack(item["context"], item["t5xxl_ids"], item["t5xxl_weights"]) for item in (cond, uncond)])
    return {"35_tokens": (rand(2, 16, 1, 10, 14), torch.tensor([0.7, 0.7]), prompt(2, 9, 7)),
            "packed_cfg": (rand(2, 16, 1, 5, 7), torch.tensor([0.6, 0.6]), {"context": packed}),
            "odd_video": (rand(2, 16, 3, 5, 6), torch.tensor([0.4, 0.9]), prompt(2, 5, 6)),
            "adapted_context": (rand(2, 16, 1, 5, 6), torch.tensor([0.3, 0.8]), {"context": rand(2, 512, 64)}),
            "2_tokens": (rand(1, 16, 1, 2, 4), torch.tensor([0.5]), without_weights(prompt(1, 3, 5)))}


def without_weights(inputs: dict) -> dict:
    return {key: value for key, value in inputs.items() if key != "t5xxl_weights"}


def ideogram4_cases(seed=9):
    """Ideogram 4: 5 text + 35 image tokens (batch 2, CFG halves at different sigmas), the image alone (DualModelGuider's
    text-free negative: 35 tokens), 3 + 2 tokens (batch 1, fewer than the ranks)."""
    rand = seeded_randn(seed)
    return {"40_tokens": (rand(2, 16, 5, 7), torch.tensor([0.7, 0.3]), {"context": rand(2, 5, 40)}),
            "image_only": (rand(2, 16, 5, 7), torch.tensor([0.6, 0.6]), {"context": None}),
            "5_tokens": (rand(1, 16, 1, 2), torch.tensor([0.5]), {"context": rand(1, 3, 40)})}


def ltxv_cases(seed=14):
    """LTX-Video 0.9: a video of 105 tokens (3 frames of 5 x 7, 24 fps), image to video (per-token sigmas, 0 on the
    first frame, as ComfyUI's process_timestep gives them), a guide frame at keyframe_idxs, 2 tokens."""
    rand = seeded_randn(seed)
    sigmas = torch.tensor([0.8, 0.6]).view(2, 1, 1).repeat(1, 60, 1)
    sigmas[:, :20] = 0.0
    guides = torch.stack(torch.meshgrid(torch.tensor([40.0]), torch.arange(3.0) * 32, torch.arange(4.0) * 32,
                                        indexing="ij")).flatten(1)[None]
    return {"odd_video": (rand(2, 16, 3, 5, 7), torch.tensor([0.7, 0.4]), {"context": rand(2, 9, 32),
                                                                          "frame_rate": 24.0}),
            "i2v_per_token": (rand(2, 16, 3, 4, 5), sigmas, {"context": rand(2, 7, 32), "frame_rate": 25}),
            "guide_frame": (rand(1, 16, 3, 3, 4), torch.tensor([0.9]), {"context": rand(1, 5, 32),
                                                                       "keyframe_idxs": guides}),
            "2_tokens": (rand(1, 16, 1, 1, 2), torch.tensor([0.5]), {"context": rand(1, 3, 32)})}


def kandinsky5_cases(seed=15):
    """Kandinsky 5 video model (latent, image latent, mask: 33 channels): 36 tokens of odd height and width (padded
    by wrap-around, batch 2), image to video (time_dim_replace over the first frame), 2 tokens."""
    rand = seeded_randn(seed)
    return {"odd_video": (rand(2, 33, 3, 5, 7), torch.tensor([700.0, 300.0]), {"context": rand(2, 9, 32),
                                                                              "y": rand(2, 24)}),
            "i2v": (rand(2, 33, 2, 4, 6), torch.tensor([900.0, 900.0]),
                    {"context": rand(2, 7, 32), "y": rand(2, 24),
                     "time_dim_replace": rand(1, 16, 1, 4, 6).repeat(2, 1, 1, 1, 1)}),
            "2_tokens": (rand(1, 33, 1, 2, 4), torch.tensor([500.0]), {"context": rand(1, 3, 32), "y": rand(1, 24)})}


def krea2_cases(seed=17):
    """Krea 2: an image of 35 tokens of odd height and width (padded by wrap-around, batch 2), the style reference
    (two references modulated at time 0, the second of odd size), 2 tokens."""
    rand = seeded_randn(seed)
    return {"odd_latent": (rand(2, 16, 9, 13), torch.tensor([0.7, 0.3]), {"context": rand(2, 6, 480)}),
            "style_refs": (rand(2, 16, 6, 8), torch.tensor([0.9, 0.9]),
                           {"context": rand(2, 5, 480), "ref_latents_method": "index_timestep_zero",
                            "ref_latents": [rand(1, 16, 4, 6).repeat(2, 1, 1, 1), rand(2, 16, 3, 5)]}),
            "2_tokens": (rand(1, 16, 2, 4), torch.tensor([0.5]), {"context": rand(1, 3, 480)})}


def mage_flow_cases(seed=19):
    """Mage-Flow (one token per latent pixel of 128 channels): 63 tokens of odd height and width (batch 2, a masked
    prompt), the edit's two references (one of odd size, 35 + 20 + 12 tokens), 3 tokens."""
    rand = seeded_randn(seed)
    t2 = torch.tensor([0.7, 0.3])
    mask = torch.ones(2, 7, dtype=torch.long)
    mask[1, 4:] = 0
    return {"odd_latent_masked": (rand(2, 128, 7, 9), t2, {"context": rand(2, 7, 2560), "attention_mask": mask}),
            "edit_two_refs": (rand(2, 128, 5, 7), t2, {"context": rand(2, 5, 2560),
                                                       "ref_latents": [rand(2, 128, 5, 4), rand(2, 128, 3, 4)]}),
            "3_tokens": (rand(1, 128, 1, 3), t2[:1], {"context": rand(1, 3, 2560)})}
def ernie_image_cases(seed=18):
    """ERNIE-Image: 35 image + 6 text tokens (batch 2, CFG halves at different times: sigma x 1000), 9 + 4 tokens
    (batch 1), 1 + 1 tokens (fewer than the ranks)."""
    rand = seeded_randn(seed)
    return {"41_tokens": (rand(2, 128, 5, 7), torch.tensor([700.0, 300.0]), {"context": rand(2, 6, 40)}),
            "batch_1": (rand(1, 128, 3, 3), torch.tensor([500.0]), {"context": rand(1, 4, 40)}),
            "2_tokens": (rand(1, 128, 1, 1), torch.tensor([900.0]), {"context": rand(1, 1, 40)})}


def longcat_image_cases(seed=19):
    """LongCat-Image (ComfyUI's Flux call with the rope shifts its LongCatImage model adds: t + 1, rows and columns +
    the text length): 35 image tokens of odd height and width (batch 2), the edit model's reference at index 1
    (12 + 12 tokens), 2 tokens (fewer than the ranks)."""
    rand = seeded_randn(seed)

    def shifted(length: int) -> dict:
        return {"shift_t": 1.0, "shift_y": float(length), "shift_x": float(length)}
    return {"odd_latent": (rand(2, 16, 9, 13), torch.tensor([0.7, 0.3]),
                           {"context": rand(2, 6, 3584), "rope_options": shifted(6)}),
            "edit_index": (rand(2, 16, 6, 8), torch.tensor([0.9, 0.9]),
                           {"context": rand(2, 5, 3584), "rope_options": shifted(5), "ref_latents_method": "index",
                            "ref_latents": [rand(1, 16, 6, 8).repeat(2, 1, 1, 1)]}),
            "2_tokens": (rand(1, 16, 2, 4), torch.tensor([0.5]), {"context": rand(1, 3, 3584),
                                                                  "rope_options": shifted(3)})}


def seedvr2_cases(seed=20):
    """SeedVR2 (x and the 17-channel condition, patch 1 x 2 x 2): a video of 5 frames x 15 tokens (batch 2 at
    different times, windows of 2 frames, shifted ones of 1 + 2 + 2), one 22 x 26 frame (2 x 2 windows, shifted
    3 x 3), the stored prompt when the call has none, 1 token (fewer than the ranks)."""
    rand = seeded_randn(seed)

    def call(batch, frames, height, width, text, t):
        inputs = {"condition": rand(batch, 17, frames, height, width)}
        if text:
            inputs["context"] = rand(batch, text, 48)
        return rand(batch, 16, frames, height, width), torch.tensor(t), inputs
    return {"video_75_tokens": call(2, 5, 6, 10, 7, [700.0, 300.0]),
            "windows_572_tokens": call(1, 1, 44, 52, 5, [500.0]),
            "stored_prompt": call(1, 3, 4, 6, 0, [900.0]),
            "1_token": call(1, 1, 2, 2, 3, [400.0])}


def boogu_cases(seed=21):
    """Boogu-Image (instruction / reference / latent streams): an odd latent of 20 tokens with 7 words (batch 2), the
    edit's two references (one of odd size: 6 + 6 tokens) before a 9-token latent, 2 tokens and 3 words (fewer than
    ranks); num_tokens every word, as ComfyUI passes it."""
    rand = seeded_randn(seed)
    t2 = torch.tensor([0.7, 0.3])
    return {"odd_latent": (rand(2, 16, 7, 9), t2, {"context": rand(2, 7, 40), "num_tokens": 7}),
            "edit_two_refs": (rand(2, 16, 6, 6), t2, {"context": rand(2, 5, 40), "num_tokens": 5,
                                                      "ref_latents": [rand(2, 16, 5, 4), rand(2, 16, 3, 6)]}),
            "few_tokens": (rand(1, 16, 2, 4), t2[:1], {"context": rand(1, 3, 40), "num_tokens": 3})}


def ovis_image_cases(seed=20):
    """Ovis-Image (ComfyUI's Flux call, text ids (0, i, i)): 35 image tokens of odd height and width (batch 2, a
    rope_options shift), 24 + 12 tokens with a reference by index, 2 tokens (fewer than the ranks), batch 1."""
    rand = seeded_randn(seed)
    return {"odd_latent": (rand(2, 16, 9, 13), torch.tensor([0.7, 0.3]),
                           {"context": rand(2, 6, 32), "rope_options": {"shift_y": 3.0, "scale_x": 0.5}}),
            "ref_index": (rand(2, 16, 6, 8), torch.tensor([0.9, 0.4]),
                          {"context": rand(2, 5, 32), "ref_latents_method": "index",
                           "ref_latents": [rand(1, 16, 4, 6).repeat(2, 1, 1, 1)]}),
            "batch_1": (rand(1, 16, 8, 6), torch.tensor([0.5]), {"context": rand(1, 9, 32)}),
            "2_tokens": (rand(1, 16, 2, 4), torch.tensor([0.5]), {"context": rand(1, 3, 32)})}


def lens_cases(seed=22):
    """Lens (one token per pixel of a 32-channel latent, 4 text layers of 16 side by side): 9 x 13 tokens with a
    shorter second prompt (masked), 8 x 6 at batch 1, 2 tokens (fewer than the ranks)."""
    rand = seeded_randn(seed)
    mask = torch.ones(2, 9, dtype=torch.long)
    mask[1, 6:] = 0
    return {"odd_latent_masked": (rand(2, 32, 9, 13), torch.tensor([0.7, 0.3]),
                                  {"context": rand(2, 9, 64), "attention_mask": mask}),
            "odd_latent": (rand(2, 32, 7, 5), torch.tensor([0.9, 0.4]), {"context": rand(2, 5, 64)}),
            "batch_1": (rand(1, 32, 8, 6), torch.tensor([0.5]), {"context": rand(1, 7, 64)}),
            "2_tokens": (rand(1, 32, 1, 2), torch.tensor([0.5]), {"context": rand(1, 3, 64)})}


HIDREAM_O1_TMS, HIDREAM_O1_PATCH = 151673, 32


def hidream_o1_conds(ids: torch.Tensor, rows: int, cols: int) -> dict:
    """ComfyUI's HiDreamO1 extra_conds for text to image (build_extra_conds): the prompt's ids (ending in
    <|tms_token|>), MRoPE positions (text token i at (i, i, i), image token (r, c) at 4096 + (0, r, c)) repeated to the
    batch, ar_len (the text before <|tms_token|>), the image rows' mask and the token types."""
    batch, text = ids.shape
    image = torch.stack([torch.zeros(rows * cols, dtype=torch.long), torch.arange(rows).repeat_interleave(cols),
                         torch.arange(cols).repeat(rows)]) + 4096
    positions = torch.cat([torch.arange(text).expand(3, -1), image], dim=1)
    total = text + rows * cols
    after_text = (torch.arange(total) >= text).expand(batch, -1)
    return {"input_ids": ids, "position_ids": positions[None].expand(batch, -1, -1).clone(), "ar_len": text - 1,
            "vinput_mask": after_text.clone(), "token_types": (torch.arange(total) >= text - 1).long().expand(batch, -1)}


HIDREAM_O1_VISION = (151652, 151655, 151653)  # <|vision_start|>, <|image_pad|>, <|vision_end|>


def hidream_o1_reference_conds(ids: torch.Tensor, rows: int, cols: int, refs: list, rand) -> dict:
    """ComfyUI's HiDreamO1 extra_conds with reference images (build_extra_conds): refs [((vit t, h, w), (patch rows,
    cols))]: each a [<|vision_start|>, <|image_pad|> x t h w / 4, <|vision_end|>] run after the prompt's first 3 tokens
    (its MRoPE positions: the merged grid after the text before it), the image at 4096 + (0, r, c) and each reference's
    patches after the last position (its own (0, r, c) grid); pixel values [1, t h w, 1536], grids [1, K, 3] and the
    patches [1, R, 3072] (random; ComfyUI's repeat to the batch aside, which the pool also serves)."""
    start, pad, end = HIDREAM_O1_VISION
    batch = ids.shape[0]
    runs = [torch.tensor([start] + [pad] * (t * h * w // 4) + [end]) for (t, h, w), _ in refs]
    ids = torch.cat([ids[:, :3], torch.cat(runs).expand(batch, -1), ids[:, 3:]], dim=1)
    text = ids.shape[1]
    grid = lambda t, h, w, at: torch.stack([torch.arange(t).repeat_interleave(h * w) + at,  # noqa: E731
                                            torch.arange(h).repeat_interleave(w).repeat(t) + at,
                                            torch.arange(w).repeat(t * h) + at])
    pieces, at = [torch.arange(3).expand(3, -1)], 3
    for (t, h, w), _ in refs:
        pieces += [torch.full((3, 1), at), grid(t, h // 2, w // 2, at + 1)]
        at = int(pieces[-1].max()) + 1
        pieces.append(torch.full((3, 1), at))
        at += 1
    pieces.append(torch.arange(at, at + text - sum(piece.shape[1] for piece in pieces)).expand(3, -1))
    pieces.append(grid(1, rows, cols, 0) * torch.tensor([[0], [1], [1]]) + 4096)
    at = int(pieces[-1].max()) + 1
    for _, (ref_rows, ref_cols) in refs:
        pieces.append(grid(1, ref_rows, ref_cols, 0) * torch.tensor([[0], [1], [1]]) + at)
        at = int(pieces[-1].max()) + 1
    positions = torch.cat(pieces, dim=1)
    total = positions.shape[1]
    patches = sum(ref_rows * ref_cols for _, (ref_rows, ref_cols) in refs)
    return {"input_ids": ids, "position_ids": positions[None].expand(batch, -1, -1).clone(), "ar_len": text - 1,
            "vinput_mask": (torch.arange(total) >= text).expand(batch, -1).clone(),
            "token_types": (torch.arange(total) >= text - 1).long().expand(batch, -1),
            "ref_patches": rand(1, patches, 3 * HIDREAM_O1_PATCH ** 2).expand(batch, -1, -1).clone(),
            "ref_pixel_values": rand(1, sum(t * h * w for (t, h, w), _ in refs), 1536).expand(batch, -1, -1).clone(),
            "ref_image_grid_thw": torch.tensor([[list(vit) for vit, _ in refs]]).expand(batch, -1, -1).clone()}


def hidream_o1_cases(seed=20):
    """HiDream-O1 (pixels in 32 x 32 patches): 6 text + 35 image tokens (batch 2, prompts differ, CFG halves at
    different times: sigma x 1000), 9 + 9 tokens (batch 1), <|tms_token|> alone + 2 image tokens (fewer than the ranks,
    no causal prefix); reference images (batch 2): one (6 + 8 text, 12 image, 6 reference tokens) and two of uneven
    sizes (a 2 x 4 and a 6 x 2 vision grid, 1 x 3 and 2 x 2 patches: 6 + 9 text, 9 image, 7 reference tokens)."""
    rand, generator = seeded_randn(seed), torch.Generator().manual_seed(seed)

    def prompt(batch: int, text: int) -> torch.Tensor:
        ids = torch.randint(0, 151000, (batch, text), generator=generator)
        ids[:, -1] = HIDREAM_O1_TMS
        return ids
    p = HIDREAM_O1_PATCH
    return {"41_tokens": (rand(2, 3, 5 * p, 7 * p), torch.tensor([700.0, 300.0]), hidream_o1_conds(prompt(2, 6), 5, 7)),
            "batch_1": (rand(1, 3, 3 * p, 3 * p), torch.tensor([500.0]), hidream_o1_conds(prompt(1, 9), 3, 3)),
            "3_tokens": (rand(1, 3, p, 2 * p), torch.tensor([900.0]), hidream_o1_conds(prompt(1, 1), 1, 2)),
            "1_reference": (rand(2, 3, 3 * p, 4 * p), torch.tensor([800.0, 400.0]),
                            hidream_o1_reference_conds(prompt(2, 6), 3, 4, [((1, 4, 6), (2, 3))], rand)),
            "2_references": (rand(2, 3, 3 * p, 3 * p), torch.tensor([600.0, 200.0]),
                             hidream_o1_reference_conds(prompt(2, 6), 3, 3, [((1, 2, 4), (1, 3)), ((1, 6, 2), (2, 2))],
                                                        rand))}


def joyimage_cases(seed=20):
    """JoyAI-Image-Edit (Wan 2.1 latents [B, 16, 1, H, W], patch (1, 2, 2)): 35 image + 7 text tokens (batch 2, CFG
    halves at different times: sigma x 1000); the edit's two references after an odd latent (35 + 12 + 12 tokens, one
    reference of odd size); 2 tokens (fewer than the ranks)."""
    rand = seeded_randn(seed)
    return {"35_tokens": (rand(2, 16, 1, 10, 14), torch.tensor([700.0, 300.0]), {"context": rand(2, 7, 32)}),
            "edit_two_refs": (rand(2, 16, 1, 9, 13), torch.tensor([600.0, 600.0]),
                              {"context": rand(2, 5, 32), "ref_latents": [rand(2, 16, 1, 6, 8), rand(2, 16, 1, 5, 7)]}),
            "2_tokens": (rand(1, 16, 1, 2, 4), torch.tensor([500.0]), {"context": rand(1, 3, 32)})}


def cogvideox_cases(seed=22):
    """CogVideoX 1.5 (48 channels: VOID's latent + mask + masked video; 2 x 2 x 2 patches): an odd video of 60 tokens
    (5 frames, 7 x 9, padded by wrap-around; batch 2, CFG halves at different times), 6 tokens of a whole-patch video,
    2 tokens (fewer than the ranks)."""
    rand = seeded_randn(seed)
    return {"odd_video": (rand(2, 48, 5, 7, 9), torch.tensor([700.0, 300.0]), {"context": rand(2, 9, 32)}),
            "6_tokens": (rand(1, 48, 2, 4, 6), torch.tensor([500.0]), {"context": rand(1, 5, 32)}),
            "2_tokens": (rand(1, 48, 2, 2, 4), torch.tensor([900.0]), {"context": rand(1, 3, 32)})}
