"""JoyAI-Image-Edit's sequence-parallel plan for ComfyUI's `diffusion_model(x, timestep, context, ref_latents)`
(JoyImageTransformer3DModel in comfy/ldm/joyimage/model.py) on diffusers' JoyImage blocks: x [B, 16, T, H, W] (Wan
2.1's latent, T = 1 for an image), padded by wrap-around to (1, 2, 2) patches; timestep the sigma x 1000; context the
Qwen3-VL text [B, L, 4096], replicated.

PLAN: one split stream of patch tokens, the output's then each reference latent's, each on its own (frame, row,
column) grid with the frames counted on from the previous one's (ComfyUI's per-component rotary); the text embedded
on every rank, after the image in every double-stream block's joint attention and not rotated; every token modulated
by the one time vector. The head writes the output's tokens; the references' are dropped."""
from __future__ import annotations

import torch

from ...sp import AttentionSpec, Plan, Stage, Stream, text_stream, video_part
from ...sp.tensor_parallel import COLUMN, ROW, Split, TensorParallelPlan
from ...sp.tokens import as_list
from ...sp.video_tokens import conv_patch_embed

REFUSED_INPUTS = ("control",)  # ControlNet residuals: ComfyUI's JoyImage takes none (no JoyImage ControlNet exists)


def check(call) -> None:
    config, x, inputs = call.config, call.x, call.inputs
    for name in REFUSED_INPUTS:
        if inputs.get(name) is not None:
            raise ValueError(f"{name} is not supported by the sequence-parallel JoyAI-Image-Edit")
    _check_latent(x, "x", config.in_channels, (x.shape[0],))
    for number, ref in enumerate(as_list(inputs.get("ref_latents"))):
        _check_latent(ref, f"ref_latents[{number}]", config.in_channels, (1, x.shape[0]))
    context = inputs.get("context")
    if context is None or context.dim() != 3 or context.shape[-1] != config.text_dim or \
            context.shape[0] not in (1, x.shape[0]):
        shape = None if context is None else list(context.shape)
        raise ValueError(f"JoyAI-Image-Edit needs context [B, L, {config.text_dim}] (the Qwen3-VL text: CLIPLoader "
                         f"type 'joyimage'); got {shape}")
    if call.timestep.numel() not in (1, x.shape[0]):
        raise ValueError(f"timestep has shape {list(call.timestep.shape)}; JoyAI-Image-Edit takes one per batch item")


def _check_latent(latent: torch.Tensor, name: str, channels: int, batches: tuple[int, ...]) -> None:
    if latent.dim() != 5 or latent.shape[1] != channels or latent.shape[0] not in batches:
        raise ValueError(f"{name} has shape {list(latent.shape)}; JoyAI-Image-Edit takes [B, {channels}, T, H, W] "
                         f"latents (Wan 2.1's format){'' if len(batches) == 1 else ', one per batch item or one'}")


def layout(call) -> list[Stream]:
    """The output's tokens, then each reference's, frames counted on (ComfyUI's per-component rotary); the text."""
    patch = tuple(call.config.patch_size)
    refs = [call.ctx.to_device(f"ref_latents.{number}", ref, call.dtype)
            for number, ref in enumerate(as_list(call.inputs.get("ref_latents")))]
    parts = [video_part(call.input("x"), patch, embed_patches)]
    frames = parts[0].output.grid.frames
    for ref in refs:
        part = video_part(ref, patch, embed_patches, output=False)
        part.ids[:, 0] += frames
        frames += -(-ref.shape[2] // patch[0])
        parts.append(part)
    context = call.input("context")
    text = text_stream(context.expand(call.batch, *context.shape[1:]), None, _embed_text)
    return [Stream("image", parts), text]


def embed_patches(model, patches: torch.Tensor) -> torch.Tensor:
    """img_in's Conv3d on this rank's patches, in the compute dtype (as ComfyUI)."""
    return conv_patch_embed(model.img_in, patches, patches.dtype)


def _embed_text(model, context: torch.Tensor) -> torch.Tensor:
    return model.condition_embedder.text_embedder(context)


def rope(config):
    return tuple(config.rope_dim_list), config.theta


def condition(call) -> None:
    """The blocks' time vector [B, 6, width]: the timestep's sinusoid through time_embedder in the compute dtype (as
    ComfyUI casts it to the text's), then time_proj."""
    embedder = call.model.condition_embedder
    temb = embedder.time_embedder(embedder.timesteps_proj(call.sigma()).to(call.dtype))
    call.vec = embedder.time_proj(embedder.act_fn(temb)).unflatten(1, (6, -1))


def run_block(block, call) -> None:
    call.image, call.text = block(call.image, call.text, call.vec)


def project_image(attn, hidden: torch.Tensor):
    return _project(attn.img_attn_qkv, attn.img_attn_q_norm, attn.img_attn_k_norm, attn.heads, hidden), None


def project_text(attn, text: torch.Tensor) -> list[torch.Tensor]:
    return _project(attn.txt_attn_qkv, attn.txt_attn_q_norm, attn.txt_attn_k_norm, attn.heads, text)


def _project(qkv, norm_q, norm_k, heads: int, hidden: torch.Tensor) -> list[torch.Tensor]:
    """The fused q / k / v Linear, heads apart, q and k RMS-normed per head."""
    query, key, value = (part.unflatten(-1, (heads, -1)) for part in qkv(hidden).chunk(3, dim=-1))
    return [norm_q(query).to(value.dtype), norm_k(key).to(value.dtype), value]


def head(call) -> torch.Tensor:
    """norm_out and proj_out on this rank's tokens: features (pt, ph, pw, c), VideoGrid.write's order."""
    return call.model.proj_out(call.model.norm_out(call.image))


ATTENTION = AttentionSpec(project=project_image, finish=lambda attn, out, extra: attn.img_attn_proj(out),
                          project_text=project_text, text_first=False,
                          finish_text=lambda attn, out: attn.txt_attn_proj(out))
# fused q / k / v column-split in whole heads (3 parts), output projections row-split; FeedForward: generic
TENSOR_PARALLEL = TensorParallelPlan(extra=(Split("img_attn_qkv", COLUMN, 3), Split("txt_attn_qkv", COLUMN, 3),
                                            Split("img_attn_proj", ROW), Split("txt_attn_proj", ROW)))
PLAN = Plan(check=check, layout=layout, condition=condition, head=head, rope=rope,
            stages=(Stage("double_blocks", run_block, attention=ATTENTION),),
            comfy_blocks={"double_block": "double_blocks"},
            tensor_parallel=TENSOR_PARALLEL)
