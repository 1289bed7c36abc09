"""The Qwen-Image InstantX ControlNet's plan: the latent x and its hint (the control image's latent, channels
joined) as one split stream on the main call's own shards of x's tokens, the text replicated without its mask
(ComfyUI gives the ControlNet none), the Qwen-Image blocks, and each block's output through its controlnet_blocks
Linear: the head returns the residual of every main-model block, repeated as ComfyUI's loader does."""
from __future__ import annotations

import math

import torch

from ...sp import Plan, Stage, Stream, image_parts, text_stream
from ...sp.tokens import ROPE_THETA
from ..qwen_image.plan import as_4d

PATCH = 2
MAIN_MODEL_BLOCKS = 60  # ComfyUI's QwenImageControlNetModel repeats its residuals over 60 main-model blocks


def check(call) -> None:
    hint, x = call.inputs.get("hint"), call.x
    if hint is None:
        raise ValueError("a Qwen-Image ControlNet runs inside a Qwen-Image call (its input controlnets), not alone")
    if x.dim() == 5 and x.shape[2] != 1:
        raise ValueError(f"a Qwen-Image ControlNet steers one frame; x has {x.shape[2]} (Qwen-Image-Layered)")
    extra = call.config.extra_condition_channels
    hint = as_4d(hint, "the ControlNet hint")
    if hint.shape[1] * PATCH * PATCH != call.config.in_channels + extra or hint.shape[-2:] != x.shape[-2:]:
        raise ValueError(f"the ControlNet hint has shape {list(hint.shape)}; this ControlNet takes "
                         f"[B, {(call.config.in_channels + extra) // 4}, 1, {x.shape[-2]}, {x.shape[-1]}] (the "
                         f"control image encoded by the VAE at the latent's size)")


def layout(call) -> list[Stream]:
    """x's patch tokens with the hint's features after them (one part), ids as the Qwen-Image model's."""
    x = as_4d(call.input("x"), "x")
    hint = as_4d(call.input("hint"), "hint").expand(x.shape[0], -1, -1, -1)
    image = image_parts([torch.cat([x, hint], dim=1)], [(0, 0, 0)], PATCH, True, call.x.dtype, 3, _embed_image)
    grid = image[0].output.grid
    text = call.input("context")
    start = max(grid.rows // 2, grid.cols // 2)
    ids = torch.arange(start, start + text.shape[1], device=call.device, dtype=torch.float32)[:, None].expand(-1, 3)
    return [Stream("image", image), text_stream(text, ids, _embed_text)]


def _embed_image(model, raw: torch.Tensor) -> torch.Tensor:
    width = model.config.in_channels
    return model.img_in(raw[..., :width]) + model.controlnet_x_embedder(raw[..., width:])


def _embed_text(model, text: torch.Tensor) -> torch.Tensor:
    return model.txt_in(model.txt_norm(text))


def condition(call) -> None:
    call.temb, call.samples = call.model.time_text_embed(call.sigma(), call.image), []


def block(block, call) -> None:
    call.text, call.image = block(hidden_states=call.image, encoder_hidden_states=call.text,
                                  encoder_hidden_states_mask=None, temb=call.temb)
    call.samples.append(call.model.controlnet_blocks[len(call.samples)](call.image))


def head(call) -> list[torch.Tensor]:
    """The residual of main-model block i: block i // ceil(60 / blocks)'s, for i < 60 (ComfyUI)."""
    repeat = math.ceil(MAIN_MODEL_BLOCKS / len(call.samples))
    return [call.samples[index // repeat] for index in range(MAIN_MODEL_BLOCKS)]


PLAN = Plan(check=check, layout=layout, rope=lambda config: (config.axes_dims_rope, ROPE_THETA), condition=condition,
            stages=(Stage("transformer_blocks", block),), head=head)
