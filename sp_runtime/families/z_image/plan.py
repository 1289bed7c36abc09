"""Z-Image's sequence-parallel plan: caption and image are two split streams, each padded to PAD_MULTIPLE with
learned pad tokens; the refiners attend within one stream, the main layers over their union (each rank's caption
shard, then its image shard: no attention is masked, so the order changes nothing). ScaleROPE's rope_options move
the image tokens' rows and columns as ComfyUI's pos_ids_x does (the frame and the caption stay)."""
from __future__ import annotations

import torch

from ...sp import Output, Part, Plan, Stage, Stream
from ...sp.tensor_parallel import COLUMN, GATHER, ROW, Split, TensorParallelPlan
from ...sp.tokens import TokenGrid, pad_to_patch, patchify
from .detection import PAD_MULTIPLE, PATCH

UNSUPPORTED_INPUTS = ("ref_latents", "ref_contexts", "siglip_feats", "direct_context", "ref_frames",
                      "clip_text_pooled")


def check(call) -> None:
    check_nextdit(call, "Z-Image", UNSUPPORTED_INPUTS, "Z-Image Omni / Ming-Image / NewBie", "the text encoder")
    # attention_mask and num_tokens are read past, as ComfyUI's NextDiT does: it attends every context token


def check_nextdit(call, model: str, unsupported: tuple, whose: str, encoder: str) -> None:
    """The checks of a NextDiT call (Z-Image, Lumina 2): no input of `unsupported` (named as `whose` inputs), x
    [B, in_channels, H, W], context [batch, tokens, cap_feat_dim] from `encoder`."""
    config, x, inputs = call.config, call.x, call.inputs
    for name in unsupported:
        value = inputs.get(name)
        if value is not None and not (isinstance(value, (list, tuple)) and len(value) == 0):  # ComfyUI's default []
            raise ValueError(f"{name} ({whose} inputs) is not supported by the sequence-parallel {model}")
    if x.dim() != 4 or x.shape[1] != config.in_channels:
        raise ValueError(f"x has shape {tuple(x.shape)}; {model} takes [B, {config.in_channels}, H, W]")
    context = inputs.get("context")
    if context is None or context.dim() != 3 or context.shape[-1] != config.cap_feat_dim or \
            context.shape[0] not in (1, x.shape[0]):
        raise ValueError(f"{model} needs context [batch, text tokens, {config.cap_feat_dim}] ({encoder} "
                         f"output); got {None if context is None else tuple(context.shape)}")


def layout(call) -> list[Stream]:
    """Caption ids (1 + i, 0, 0), pads included; image ids (caption_total + 1, row, col), pads (0, 0, 0); image
    patches in ComfyUI's (row, col, channel) feature order; rows and columns under rope_options as image_axes."""
    context, x = call.input("context"), call.input("x")
    caption_total = _padded(context.shape[1])
    caption_ids = torch.zeros(caption_total, 3)
    caption_ids[:, 0] = torch.arange(caption_total) + 1
    grid = TokenGrid.of(x.shape[-2], x.shape[-1], PATCH)
    tokens = patchify(pad_to_patch(x, PATCH), PATCH).unflatten(-1, (x.shape[1], PATCH, PATCH))
    image_ids = torch.zeros(_padded(grid.count), 3)
    image_ids[:grid.count, 0] = caption_total + 1
    rows, cols = image_axes(grid.rows, grid.cols, call.inputs.get("rope_options"))
    image_ids[:grid.count, 1] = rows.repeat_interleave(grid.cols)
    image_ids[:grid.count, 2] = cols.repeat(grid.rows)
    caption = [Part(context, caption_ids[:context.shape[1]], "cap_embedder"),
               _pads(caption_ids[context.shape[1]:], _caption_pad, call.dtype)]
    image = [Part(tokens.permute(0, 1, 3, 4, 2).flatten(2), image_ids[:grid.count], _embed_image, Output(grid)),
             _pads(image_ids[grid.count:], _image_pad, call.dtype)]
    return [Stream("caption", caption), Stream("image", image)]


def image_axes(rows: int, cols: int, rope_options) -> tuple[torch.Tensor, torch.Tensor]:
    """Row and column positions as ComfyUI's pos_ids_x: arange * scale + shift in float32 (scale_t / shift_t unused,
    as there)."""
    options = rope_options or {}
    return (torch.arange(rows, dtype=torch.float32) * options.get("scale_y", 1.0) + options.get("shift_y", 0.0),
            torch.arange(cols, dtype=torch.float32) * options.get("scale_x", 1.0) + options.get("shift_x", 0.0))


def _padded(count: int) -> int:
    return -(-count // PAD_MULTIPLE) * PAD_MULTIPLE


def _pads(ids: torch.Tensor, embed, dtype) -> Part:
    return Part(torch.zeros(1, ids.shape[0], 0, dtype=dtype), ids, embed)


def _caption_pad(model, raw: torch.Tensor) -> torch.Tensor:
    return model.cap_pad_token.to(raw.dtype).expand(raw.shape[0], raw.shape[1], -1)


def _image_pad(model, raw: torch.Tensor) -> torch.Tensor:
    return model.x_pad_token.to(raw.dtype).expand(raw.shape[0], raw.shape[1], -1)


def _embed_image(model, raw: torch.Tensor) -> torch.Tensor:
    return model.all_x_embedder[f"{PATCH}-1"](raw)


def condition(call) -> None:
    """ComfyUI's t_embedder((1 - sigma) * 1000): sinusoids in float32, cast to the compute dtype, then the MLP."""
    embedder = call.model.t_embedder
    frequencies = embedder.timestep_embedding((1 - call.sigma()) * call.config.t_scale,
                                              embedder.frequency_embedding_size)
    call.adaln = embedder.mlp(frequencies.to(call.dtype))


def join(call) -> None:
    call.joint = torch.cat([call.caption, call.image], dim=1)


def output_tokens(call, tokens: torch.Tensor) -> torch.Tensor:
    """(ph, pw, c) features -> (c, ph, pw), negated as ComfyUI's NextDiT returns."""
    return -tokens.unflatten(-1, (PATCH, PATCH, call.x.shape[1])).permute(0, 1, 4, 2, 3).flatten(2)


def caption_block(block, call) -> None:
    call.caption = block(call.caption, None, None)


def image_block(block, call) -> None:
    call.image = block(call.image, None, None, call.adaln)


def joint_block(block, call) -> None:
    call.joint = block(call.joint, None, None, call.adaln)


PLAN = Plan(check=check, layout=layout, rope=lambda config: (config.axes_dims, config.rope_theta),
            condition=condition,
            stages=(Stage("context_refiner", caption_block, attends="caption", text=None),
                    Stage("noise_refiner", image_block, attends="image", text=None),
                    Stage("layers", joint_block, attends=("caption", "image"), text=None, before=join)),
            head=lambda call: call.model.all_final_layer[f"{PATCH}-1"](call.joint[:, call.caption.shape[1]:],
                                                                       c=call.adaln),
            output_tokens=output_tokens,
            # SwiGLU feed-forward as three Linears (w1, w3 gate and value, w2 out), adaLN modulation
            tensor_parallel=TensorParallelPlan(extra=(Split("feed_forward.w1", COLUMN), Split("feed_forward.w3", COLUMN),
                                                      Split("feed_forward.w2", ROW), Split("adaLN_modulation.0", GATHER))))
