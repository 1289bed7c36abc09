"""OmniGen2's sequence-parallel plan (ComfyUI's OmniGen2Transformer2DModel on Lumina 2's blocks): the caption, the
reference images and the image are three split streams; `context_refiner`, `ref_image_refiner` and `noise_refiner`
attend within one, `layers` over their rank-wise union (nothing is masked, so the order changes nothing).
Rotary ids as ComfyUI's OmniGen2RotaryPosEmbed: caption token i at (i, i, i); reference j at (shift_j, row, col),
shift_0 the caption length, each reference moving it by its larger side in tokens; the image at the last shift."""
from __future__ import annotations

from functools import partial

import torch

from ...sp import Part, Plan, Output, Stage, Stream
from ...sp.tokens import TokenGrid, as_list, pad_to_patch, patchify
from ..lumina2.plan import GROUPED, TENSOR_PARALLEL, condition, embed_caption
from ..z_image.plan import caption_block, check_nextdit, image_block, joint_block, output_tokens
from .detection import PATCH, REFERENCE_SLOTS, ROPE_THETA


def check(call) -> None:
    """x, context as a NextDiT's; attention_mask / num_tokens only as ComfyUI's model can run them (every caption
    token counted), at most REFERENCE_SLOTS reference latents of the latent's channels."""
    check_nextdit(call, "OmniGen2", (), "", "the Qwen2.5-VL text encoder")
    tokens, inputs = call.inputs["context"].shape[1], call.inputs
    mask, counted = inputs.get("attention_mask"), inputs.get("num_tokens")
    if mask is not None and not bool(torch.as_tensor(mask).bool().all()):
        raise ValueError("a text attention_mask with padding is not supported by the sequence-parallel OmniGen2 "
                         "(ComfyUI's OmniGen2 then gives its rotary fewer caption positions than tokens)")
    if counted is not None and int(counted) != tokens:
        raise ValueError(f"num_tokens {int(counted)} with {tokens} caption tokens is not supported by the "
                         f"sequence-parallel OmniGen2 (ComfyUI's OmniGen2 counts every caption token)")
    references = as_list(inputs.get("ref_latents"))
    if len(references) > REFERENCE_SLOTS:
        raise ValueError(f"OmniGen2 takes at most {REFERENCE_SLOTS} reference latents (image_index_embedding); "
                         f"got {len(references)}")
    for ref in references:
        if ref.dim() != 4 or ref.shape[1] != call.x.shape[1] or ref.shape[0] not in (1, call.x.shape[0]):
            raise ValueError(f"ref_latents entries must be [batch, {call.x.shape[1]}, h, w]; got {tuple(ref.shape)}")


def layout(call) -> list[Stream]:
    context, x = call.input("context"), call.input("x")
    captions = context.shape[1]
    caption_ids = torch.arange(captions, dtype=torch.float32)[:, None].expand(captions, 3)
    references, shift = [], float(captions)
    for index, ref in enumerate(as_list(call.inputs.get("ref_latents"))):
        grid = TokenGrid.of(ref.shape[-2], ref.shape[-1], PATCH)
        latent = call.ctx.to_device(f"ref_latents.{index}", ref, call.dtype)
        references.append(Part(patches(latent), grid_ids(grid, shift), partial(embed_reference, index=index)))
        shift += max(grid.rows, grid.cols)
    if not references:  # an empty stream: the reference refiner then runs no block
        references.append(Part(torch.zeros(1, 0, PATCH * PATCH * x.shape[1], dtype=x.dtype), torch.zeros(0, 3),
                               "ref_image_patch_embedder"))
    grid = TokenGrid.of(x.shape[-2], x.shape[-1], PATCH)
    image = Part(patches(x), grid_ids(grid, shift), "x_embedder", Output(grid))
    return [Stream("caption", [Part(context, caption_ids, embed_caption)]), Stream("reference", references),
            Stream("image", [image])]


def patches(latent: torch.Tensor) -> torch.Tensor:
    """[B, C, H, W] -> [B, tokens, (row, col, channel) features], padded to the patch as ComfyUI pads."""
    tokens = patchify(pad_to_patch(latent, PATCH), PATCH).unflatten(-1, (latent.shape[1], PATCH, PATCH))
    return tokens.permute(0, 1, 3, 4, 2).flatten(2)


def grid_ids(grid: TokenGrid, shift: float) -> torch.Tensor:
    ids = torch.full((grid.count, 3), float(shift))
    ids[:, 1] = torch.arange(grid.rows, dtype=torch.float32).repeat_interleave(grid.cols)
    ids[:, 2] = torch.arange(grid.cols, dtype=torch.float32).repeat(grid.rows)
    return ids



def embed_reference(model, raw: torch.Tensor, index: int) -> torch.Tensor:
    return model.ref_image_patch_embedder(raw) + model.image_index_embedding[index].to(raw.dtype)


def reference_block(block, call) -> None:
    if call.shards["reference"].stream.total:
        call.reference = block(call.reference, None, None, call.adaln)


def join(call) -> None:
    call.joint = torch.cat([call.caption, call.reference, call.image], dim=1)


def head(call) -> torch.Tensor:
    return call.model.norm_out(call.joint[:, call.caption.shape[1] + call.reference.shape[1]:], call.adaln)


PLAN = Plan(check=check, layout=layout, rope=lambda config: (config.axes_dim_rope, ROPE_THETA),
            condition=condition,
            stages=(Stage("context_refiner", caption_block, attends="caption", text=None, attention=GROUPED),
                    Stage("noise_refiner", image_block, attends="image", text=None, attention=GROUPED),
                    Stage("ref_image_refiner", reference_block, attends="reference", text=None, attention=GROUPED),
                    Stage("layers", joint_block, attends=("caption", "reference", "image"), text=None,
                          attention=GROUPED, before=join)),
            head=head, output_tokens=output_tokens, tensor_parallel=TENSOR_PARALLEL)  # Lumina 2's
