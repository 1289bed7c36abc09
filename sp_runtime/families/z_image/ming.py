"""Ming-Image (ComfyUI's MingImage: a Z-Image-sized NextDiT) on diffusers' ZImageTransformer2DModel: x is
[B, C, F, H, W] (its VAE's frame axis: the target frame, or a composite and its layers), clean reference frames
(`ref_frames`, 4-D latents) follow the target frames on the frame axis of the rotary ids, `direct_context` (caption
tokens already at the model width) follows the embedded caption. Ming-Image Design has no pad tokens: its caption,
zero-padded to 32 and masked in the original, only moves the image positions (masked_pad_multiple); a file with pad
tokens pads both streams as Z-Image does. Facts from ComfyUI's NextDiT.embed_all / embed_cap / unpatchify."""
from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import torch

from ...checkpoints.loading import WeightDtypes, build_empty_model
from ...sp import Output, Part, Stream
from ...sp.tokens import TokenGrid, pad_to_patch, patchify
from .detection import PAD_MULTIPLE, PATCH
from .plan import PLAN, _caption_pad, _embed_image, _image_pad, _padded, _pads, check_nextdit, image_axes

UNSUPPORTED_INPUTS = ("ref_latents", "ref_contexts", "siglip_feats", "clip_text_pooled")


def build_model(model_class, config: dict, dtypes: WeightDtypes):
    """The empty model; without pad tokens (Ming-Image Design) diffusers' unused pad parameters are dropped."""
    model = build_empty_model(model_class, {k: v for k, v in config.items() if k != "masked_pad_multiple"}, dtypes)
    if config.get("masked_pad_multiple"):
        model.x_pad_token = model.cap_pad_token = None
    return model


def check(call) -> None:
    x = call.x
    if x.dim() != 5:
        raise ValueError(f"x has shape {tuple(x.shape)}; Ming-Image takes [B, {call.config.in_channels}, F, H, W]")
    one_frame = SimpleNamespace(config=call.config, x=x[:, :, 0], inputs=call.inputs)
    check_nextdit(one_frame, "Ming-Image", UNSUPPORTED_INPUTS, "Z-Image Omni / NewBie", "the Ling text encoder")
    width = call.config.dim
    direct = call.inputs.get("direct_context")
    if direct is not None and (direct.dim() != 3 or direct.shape[-1] != width or direct.shape[0] != x.shape[0]):
        raise ValueError(f"direct_context has shape {tuple(direct.shape)}; Ming-Image takes [B, tokens, {width}]")
    for ref in call.inputs.get("ref_frames") or ():
        if ref.dim() != 4 or ref.shape[1] != x.shape[1] or ref.shape[0] != x.shape[0]:
            raise ValueError(f"ref_frames holds a latent of shape {tuple(ref.shape)}; Ming-Image takes "
                             f"[{x.shape[0]}, {x.shape[1]}, H, W] reference frames")


def layout(call) -> list[Stream]:
    """Caption ids (1 + i, 0, 0), direct_context after the caption, pads (files with pad tokens); target frame f at
    frame index shifted + 1 + f, reference frame j at shifted + 1 + F + j (shifted: the caption length, rounded up to
    32), rows and columns as image_axes; image pads after the references (files with pad tokens)."""
    x, context = call.input("x"), call.input("context")
    direct = call.input("direct_context") if call.inputs.get("direct_context") is not None else None
    pads = call.model.cap_pad_token is not None
    length = context.shape[1] + (0 if direct is None else direct.shape[1])
    caption_total = _padded(length) if pads else length
    caption_ids = torch.zeros(caption_total, 3)
    caption_ids[:, 0] = torch.arange(caption_total) + 1
    caption = [Part(context, caption_ids[:context.shape[1]], "cap_embedder")]
    if direct is not None:
        caption.append(Part(direct, caption_ids[context.shape[1]:length], _as_is))
    if pads:
        caption.append(_pads(caption_ids[length:], _caption_pad, call.dtype))
    shifted = _padded(caption_total)  # = caption_total with pad tokens; masked_pad_multiple without
    frames = x.shape[2]
    image = [_frame_part(x[:, :, f], shifted + 1 + f, call, Output(TokenGrid.of(x.shape[-2], x.shape[-1], PATCH), f))
             for f in range(frames)]
    for j, ref in enumerate(call.inputs.get("ref_frames") or ()):
        ref = call.ctx.to_device(f"ref_frames.{j}", ref, call.dtype)
        image.append(_frame_part(ref, shifted + 1 + frames + j, call, None))
    if pads:
        count = sum(part.count for part in image)
        image.append(_pads(torch.zeros(_padded(count) - count, 3), _image_pad, call.dtype))
    return [Stream("caption", caption), Stream("image", image)]


def _frame_part(latent: torch.Tensor, frame_index: int, call, output) -> Part:
    """One 4-D latent's patches in ComfyUI's (row, col, channel) feature order, ids (frame_index, row, col)."""
    grid = TokenGrid.of(latent.shape[-2], latent.shape[-1], PATCH)
    tokens = patchify(pad_to_patch(latent, PATCH), PATCH).unflatten(-1, (latent.shape[1], PATCH, PATCH))
    ids = torch.zeros(grid.count, 3)
    ids[:, 0] = frame_index
    rows, cols = image_axes(grid.rows, grid.cols, call.inputs.get("rope_options"))
    ids[:, 1] = rows.repeat_interleave(grid.cols)
    ids[:, 2] = cols.repeat(grid.rows)
    return Part(tokens.permute(0, 1, 3, 4, 2).flatten(2), ids, _embed_image, output)


def _as_is(model, raw: torch.Tensor) -> torch.Tensor:
    return raw


def describe(model, detection) -> dict:
    """What the host reads beyond diffusers' config: whether the file pads with learned tokens."""
    return {"pad_tokens_multiple": None if detection.config.get("masked_pad_multiple") else PAD_MULTIPLE}


MING_PLAN = replace(PLAN, check=check, layout=layout)  # ComfyUI's masked_pad_multiple is PAD_MULTIPLE too
