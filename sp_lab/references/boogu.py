"""Boogu-Image's single-device reference (tests): a plain forward written from ComfyUI's BooguTransformer2DModel
(comfy/ldm/boogu, on OmniGen2's refiners and rope; diffusers has no Boogu class) over the loaded model's modules,
the Lumina 2 blocks run by diffusers' stock forward, the double-stream block written out here."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from sp_runtime.families.boogu import PATCH, load_model
from sp_lab.references import as_model

THETA = 10000.0


def reference_forward(model_or_path, x: torch.Tensor, timestep: torch.Tensor, context: torch.Tensor,
                      ref_latents=None, dtype: str = "default", **_ignored) -> torch.Tensor:
    """ComfyUI's Boogu diffusion_model(x [B, C, H, W], timestep, context, num_tokens = every context token,
    ref_latents) on one process."""
    model = as_model(model_or_path, load_model, dtype)
    compute, device = model.x_embedder.weight.dtype, model.x_embedder.weight.device
    batch, _, height, width = x.shape
    with torch.no_grad():
        embed = model.time_caption_embed
        sigma = timestep.reshape(-1).expand(batch).float().to(device)
        temb = embed.timestep_embedder(embed.time_proj(1 - sigma).to(compute))
        text = embed.caption_embedder(context.expand(batch, -1, -1).to(device, compute))
        words = text.shape[1]
        positions, shift, refs = [_caption_positions(words)], words, []
        for index, ref in enumerate(ref_latents or []):
            tokens, rows, cols = _patches(ref.expand(batch, *ref.shape[1:]).to(device, compute))
            refs.append(model.ref_image_patch_embedder(tokens) + model.image_index_embedding[index])
            positions.append(_grid_positions(shift, rows, cols))
            shift += max(rows, cols)
        tokens, rows, cols = _patches(x.to(device, compute))
        positions.append(_grid_positions(shift, rows, cols))
        freqs = _frequencies(torch.cat(positions), model.config.axes_dim_rope).to(device)
        text_freqs, ref_freqs, image_freqs = freqs[:, :words], freqs[:, words:-rows * cols], freqs[:, -rows * cols:]
        for block in model.context_refiner:
            text = block(text, None, text_freqs)
        image = model.x_embedder(tokens)
        for block in model.noise_refiner:
            image = block(image, None, image_freqs, temb)
        if refs:
            ref = torch.cat(refs, dim=1)
            for block in model.ref_image_refiner:
                ref = block(ref, None, ref_freqs, temb)
            image = torch.cat([ref, image], dim=1)
        for block in model.double_stream_layers:
            image, text = _double_block(block, image, text, freqs, freqs[:, words:], temb)
        hidden = torch.cat([text, image], dim=1)
        for block in model.single_stream_layers:
            hidden = block(hidden, None, freqs, temb)
        out = model.norm_out(hidden, temb)[:, -rows * cols:]
    out = out.unflatten(-1, (PATCH, PATCH, -1)).unflatten(1, (rows, cols))  # b h w p1 p2 c
    out = out.permute(0, 5, 1, 3, 2, 4).reshape(batch, -1, rows * PATCH, cols * PATCH)
    return -out[:, :, :height, :width].to(x.dtype).cpu()


def _patches(latent: torch.Tensor) -> tuple[torch.Tensor, int, int]:
    """b c (h p1) (w p2) -> b (h w) (p1 p2 c), the latent padded circularly to the patch (ComfyUI's)."""
    latent = F.pad(latent, (0, -latent.shape[-1] % PATCH, 0, -latent.shape[-2] % PATCH), mode="circular")
    batch, channels, height, width = latent.shape
    rows, cols = height // PATCH, width // PATCH
    tokens = latent.reshape(batch, channels, rows, PATCH, cols, PATCH).permute(0, 2, 4, 3, 5, 1)
    return tokens.reshape(batch, rows * cols, PATCH * PATCH * channels), rows, cols


def _caption_positions(words: int) -> torch.Tensor:
    return torch.arange(words)[:, None].repeat(1, 3)


def _grid_positions(shift: int, rows: int, cols: int) -> torch.Tensor:
    grid_rows, grid_cols = torch.meshgrid(torch.arange(rows), torch.arange(cols), indexing="ij")
    return torch.stack([torch.full((rows * cols,), shift), grid_rows.flatten(), grid_cols.flatten()], dim=1)


def _frequencies(positions: torch.Tensor, axes) -> torch.Tensor:
    """Complex rotary factors [1, S, head_dim / 2] per (axis position x theta^(-2k / d)), in float64 then complex64."""
    parts = []
    for axis, dim in enumerate(axes):
        omega = 1.0 / THETA ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
        parts.append(torch.polar(torch.ones(1, dtype=torch.float64), positions[:, axis, None].double() * omega))
    return torch.cat(parts, dim=-1).to(torch.complex64)[None]


def _rotate(tensor: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    pairs = torch.view_as_complex(tensor.float().reshape(*tensor.shape[:-1], -1, 2))
    return torch.view_as_real(pairs * freqs[:, :, None]).flatten(-2).to(tensor.dtype)


def _attend(query, key, value, freqs):
    """[B, S, H, D] queries over [B, S, KV, D] keys / values (grouped: each kv head serves H / KV query heads)."""
    query, key = _rotate(query, freqs), _rotate(key, freqs)
    out = F.scaled_dot_product_attention(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2),
                                         enable_gqa=True)
    return out.transpose(1, 2).flatten(2)


def _double_block(block, image, text, joint_freqs, image_freqs, temb):
    """ComfyUI's BooguDoubleStreamBlock: joint attention over [instruction; image] with per-stream projections, the
    image's self-attention, each stream's gated MLP."""
    words = text.shape[1]
    img1, img_gate, img_scale_mlp, img_gate_mlp = block.img_norm1(image, temb)
    img2, img_shift_mlp, _, _ = block.img_norm2(image, temb)
    img3, img_gate_self, _, _ = block.img_norm3(image, temb)
    txt1, txt_gate, txt_scale_mlp, txt_gate_mlp = block.instruct_norm1(text, temb)
    txt2, txt_shift_mlp, _, _ = block.instruct_norm2(text, temb)
    joint, proj = block.img_instruct_attn, block.img_instruct_attn.processor
    head_dim = joint.norm_q.weight.shape[0]
    query, key, value = (torch.cat([getattr(proj, f"instruct_to_{kind}")(txt1), getattr(proj, f"img_to_{kind}")(img1)],
                                   dim=1).unflatten(-1, (-1, head_dim)) for kind in "qkv")
    attended = _attend(joint.norm_q(query), joint.norm_k(key), value, joint_freqs)
    joint_out = joint.to_out[0](torch.cat([proj.instruct_out(attended[:, :words]), proj.img_out(attended[:, words:])],
                                          dim=1))
    attn = block.img_self_attn
    query, key, value = (getattr(attn, name)(img3).unflatten(-1, (-1, head_dim)) for name in ("to_q", "to_k", "to_v"))
    self_out = attn.to_out[0](_attend(attn.norm_q(query), attn.norm_k(key), value, image_freqs))
    gate = lambda g: g.unsqueeze(1).tanh()  # noqa: E731
    image = image + gate(img_gate) * block.img_attn_norm(joint_out[:, words:])
    image = image + gate(img_gate_self) * block.img_self_attn_norm(self_out)
    mlp = block.img_feed_forward(block.img_ffn_norm1((1 + img_scale_mlp.unsqueeze(1)) * img2 +
                                                     img_shift_mlp.unsqueeze(1)))
    image = image + gate(img_gate_mlp) * block.img_ffn_norm2(mlp)
    text = text + gate(txt_gate) * block.instruct_attn_norm(joint_out[:, :words])
    mlp = block.instruct_feed_forward(block.instruct_ffn_norm1((1 + txt_scale_mlp.unsqueeze(1)) * txt2 +
                                                               txt_shift_mlp.unsqueeze(1)))
    return image, text + gate(txt_gate_mlp) * block.instruct_ffn_norm2(mlp)
