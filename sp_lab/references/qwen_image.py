"""Qwen-Image's single-device reference (tests, demo, benchmarks): diffusers' stock forward and processors, fed
ComfyUI's packing; the rotary tables are looked up at ComfyUI's position ids."""
from __future__ import annotations

from typing import Optional

import torch

from sp_runtime.families.qwen_image import PATCH, REF_METHODS, as_4d, default_ref_method, load_model
from sp_runtime.sp.tokens import TokenGrid, as_list, grid_ids, reference_pack, reference_placements, reference_unpack
from sp_lab.references import as_model


def reference_forward(model_or_path, x: torch.Tensor, timestep: torch.Tensor, context: torch.Tensor,
                      attention_mask: Optional[torch.Tensor] = None, ref_latents=None,
                      ref_latents_method: Optional[str] = None, additional_t_cond=None, dtype: str = "default",
                      controlnet_block_samples=None, **_ignored) -> torch.Tensor:
    """ComfyUI's Qwen-Image diffusion_model(...) computed by diffusers' own forward on one process (Layered: the
    frames of x packed one after the other, additional_t_cond 0 unless given).

    The only departure from the stock call is the rotary position lookup: diffusers' tables are addressed with
    ComfyUI's position ids (diffusers centres odd grids one step differently and starts the text after the largest
    reference image). controlnet_block_samples: residuals of x's tokens per block (ComfyUI adds them to those only;
    the reference tokens get zeros here).
    """
    model = as_model(model_or_path, load_model, dtype)
    compute = model.proj_out.weight.dtype
    device = model.proj_out.weight.device
    frames = list(x.unbind(2)) if x.dim() == 5 else [x]
    batch = x.shape[0]
    refs = [as_4d(ref, "ref_latents") for ref in as_list(ref_latents)]
    method = ref_latents_method or default_ref_method(model.config)
    height, width = x.shape[-2:]
    packed, shapes, id_parts = [], [], []
    placements = [(index, 0, 0) for index in range(len(frames))] + reference_placements(
        method, (height, width), [r.shape[-2:] for r in refs], PATCH, REF_METHODS)
    for part, (index, row_offset, col_offset) in zip([*frames, *refs], placements):
        part = part.expand(batch, *part.shape[1:])
        tokens, grid = reference_pack(part.to(device, compute), PATCH)
        packed.append(tokens)
        shapes.append((1, grid.rows, grid.cols))
        id_parts.append(grid_ids(grid, index, row_offset, col_offset, True, x.dtype, device))
    grid = TokenGrid.of(height, width, PATCH)
    shapes = [(len(frames), grid.rows, grid.cols)] + shapes[len(frames):]
    zero_refs = method == "index_timestep_zero" and bool(refs)
    t_cond = None
    if model.config.use_additional_t_cond:
        t_cond = torch.zeros(batch, dtype=torch.long) if additional_t_cond is None else \
            torch.as_tensor(additional_t_cond).reshape(-1).long().expand(batch)
        t_cond = t_cond.to(device)
    mask = None if attention_mask is None else attention_mask.to(device)
    if mask is not None and mask.is_floating_point():
        mask = mask == 0 if bool((mask < 0).any()) else mask != 0
    positions = _ComfyPositions(model.pos_embed, torch.cat(id_parts), max(grid.rows // 2, grid.cols // 2))
    saved = model.pos_embed, model.zero_cond_t, [block.zero_cond_t for block in model.transformer_blocks]
    model.pos_embed, model.zero_cond_t = positions, zero_refs
    for block in model.transformer_blocks:
        block.zero_cond_t = zero_refs
    hidden = torch.cat(packed, dim=1)
    if controlnet_block_samples is not None:
        controlnet_block_samples = [torch.nn.functional.pad(sample.to(device, compute),
                                                            (0, 0, 0, hidden.shape[1] - sample.shape[1]))
                                    for sample in controlnet_block_samples]
    try:
        with torch.no_grad():
            tokens = model(hidden_states=hidden, encoder_hidden_states=context.to(device, compute),
                           encoder_hidden_states_mask=mask,
                           timestep=timestep.reshape(-1).expand(batch).to(device, compute),
                           img_shapes=[shapes] * batch, additional_t_cond=t_cond,
                           controlnet_block_samples=controlnet_block_samples, return_dict=False)[0]
    finally:
        model.pos_embed, model.zero_cond_t = saved[0], saved[1]
        for block, flag in zip(model.transformer_blocks, saved[2]):
            block.zero_cond_t = flag
    count = grid.count
    result = torch.stack([reference_unpack(tokens[:, index * count:(index + 1) * count], grid)
                          for index in range(len(frames))], dim=2).to(x.dtype).cpu()
    return result if x.dim() == 5 else result[:, :, 0]


class _ComfyPositions(torch.nn.Module):
    """Stands in for diffusers' QwenEmbedRope / QwenEmbedLayer3DRope: its own complex tables, looked up at ComfyUI's
    position ids."""

    def __init__(self, table, image_ids: torch.Tensor, text_start: int):
        super().__init__()
        self.table, self.image_ids, self.text_start = table, image_ids, text_start

    def forward(self, video_fhw, device=None, max_txt_seq_len=None):
        halves = [dim // 2 for dim in self.table.axes_dim]
        positive = self.table.pos_freqs.split(halves, dim=1)
        negative = self.table.neg_freqs.split(halves, dim=1)  # row j holds position j - len(table)

        def look_up(ids):
            columns = []
            for axis in range(3):
                position = ids[:, axis].long().cpu()
                rows = torch.where(position >= 0, position, position + negative[axis].shape[0])
                columns.append(torch.where((position >= 0)[:, None], positive[axis][rows], negative[axis][rows]))
            return torch.cat(columns, dim=1).to(device)

        text = torch.arange(self.text_start, self.text_start + int(max_txt_seq_len))[:, None].expand(-1, 3)
        return look_up(self.image_ids), look_up(text)
