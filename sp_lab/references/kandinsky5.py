"""Kandinsky 5's single-device reference (tests): diffusers' stock forward fed ComfyUI's call (x channels last,
padded by wrap-around to whole patches, image to video's first frames replaced, integer positions with ComfyUI's
scale), its attention processor without the bfloat16 rounding of q and k after the rotary (ComfyUI's model keeps
the compute dtype; in float32 the rounding alone is 1e-3 off)."""
from __future__ import annotations

import torch

from sp_runtime.families.kandinsky5 import load_model
from sp_lab.references import as_model


def reference_forward(model_or_path, x: torch.Tensor, timestep: torch.Tensor, context: torch.Tensor,
                      y: torch.Tensor, time_dim_replace=None, dtype: str = "default", **_ignored) -> torch.Tensor:
    model = as_model(model_or_path, load_model, dtype)
    _unrounded(model)
    weight = model.visual_embeddings.in_layer.weight
    compute, device = weight.dtype, weight.device
    video = (x if x.dim() == 5 else x.unsqueeze(2)).to(device, compute)
    frames, height, width = video.shape[2:]
    padded = torch.cat([video, video[:, :, :, :height % 2]], dim=3)
    padded = torch.cat([padded, padded[:, :, :, :, :width % 2]], dim=4)
    if time_dim_replace is not None:
        image = time_dim_replace.to(device, compute)
        image = torch.cat([image, image[:, :, :, :height % 2]], dim=3)
        image = torch.cat([image, image[:, :, :, :, :width % 2]], dim=4)
        padded[:, :image.shape[1], :image.shape[2]] = image
    batch = x.shape[0]
    grid = (padded.shape[2], padded.shape[3] // 2, padded.shape[4] // 2)
    scale = model.config.get("rope_scale_factor", (1.0, 2.0, 2.0))
    with torch.no_grad():
        out = model(padded.permute(0, 2, 3, 4, 1), context.expand(batch, -1, -1).to(device, compute),
                    timestep.reshape(-1).expand(batch).to(device), y.expand(batch, -1).to(device, compute),
                    tuple(torch.arange(size, device=device) for size in grid),
                    torch.arange(context.shape[1], device=device), scale_factor=scale,
                    return_dict=False)  # a tensor, not a tuple
    out = out.permute(0, 4, 1, 2, 3)[:, :, :frames, :height, :width]
    return (out if x.dim() == 5 else out[:, :, 0]).to(x.dtype).cpu()


def _unrounded(model) -> None:
    from diffusers.models.transformers.transformer_kandinsky import Kandinsky5Attention
    for module in model.modules():
        if isinstance(module, Kandinsky5Attention):
            module.set_processor(Unrounded())


class Unrounded:
    """diffusers' Kandinsky5AttnProcessor (full attention) with the rotary kept in the compute dtype."""

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, rotary_emb=None, sparse_params=None):
        source = hidden_states if encoder_hidden_states is None else encoder_hidden_states
        heads = lambda tensor: tensor.reshape(*tensor.shape[:-1], attn.num_heads, -1)  # noqa: E731
        query = attn.query_norm(heads(attn.to_query(hidden_states)).float())
        key = attn.key_norm(heads(attn.to_key(source)).float())
        value = heads(attn.to_value(source))
        if rotary_emb is not None:
            query, key = (((rotary_emb * t.reshape(*t.shape[:-1], -1, 1, 2)).sum(-1)).reshape(t.shape)
                          for t in (query, key))
        out = torch.nn.functional.scaled_dot_product_attention(
            query.transpose(1, 2).to(value.dtype), key.transpose(1, 2).to(value.dtype), value.transpose(1, 2))
        return attn.out_layer(out.transpose(1, 2).flatten(-2, -1))
