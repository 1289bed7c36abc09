"""LTX-2's prompt: the text encoder output through the video and audio connectors as ComfyUI's
preprocess_text_embeds runs them (the prompt extended with learnable registers), on every rank whole."""
from __future__ import annotations

import torch

from .detection import CONNECTORS

CONNECTOR_MIN_TOKENS = 1024     # ComfyUI pads the prompt with learnable registers to at least this many tokens


def connect_text(model, context: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The text encoder output -> the video and audio prompts after the connectors (and LTX-2.0's caption
    projections), as ComfyUI's preprocess_text_embeds (prompt extended with learnable registers to whole register
    tiles of at least 1024 tokens); an LTX-2.0 context already processed ([B, L, 2C]) is split."""
    config = model.config
    channels = config.caption_channels
    if config.use_prompt_embeddings and context.dim() == 3 and context.shape[-1] == 2 * channels:
        video, audio = context[..., :channels], context[..., channels:]
    else:
        video, audio = (_run_connector(getattr(model, name), part)
                        for name, part in zip(CONNECTORS, connector_inputs(model, context)))
    if config.use_prompt_embeddings:
        return model.caption_projection(video), model.audio_caption_projection(audio)
    return video, audio


def connector_inputs(model, context: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The text encoder output -> what the video and the audio connector take: the same [B, L, C] for LTX-2.0, the
    video and audio features of [B, L, video + audio width] for 2.3 / 2.5."""
    config = model.config
    if config.use_prompt_embeddings:
        widths, what = (config.caption_channels,), "the text encoder output"
    else:
        widths, what = (config.cross_attention_dim, config.audio_cross_attention_dim), "video and audio features"
    if context.dim() != 3 or context.shape[-1] != sum(widths):
        processed = f" or [B, L, {2 * widths[0]}] (after the connectors)" if len(widths) == 1 else ""
        raise ValueError(f"LTX-2 needs context [B, L, {sum(widths)}] ({what}){processed}; got "
                         f"{list(context.shape)}")
    if len(widths) == 1:
        return context, context
    return context[..., :widths[0]], context[..., widths[0]:]


def _run_connector(connector, context: torch.Tensor) -> torch.Tensor:
    registers = connector.learnable_registers
    count = registers.shape[0]
    length = -(-max(CONNECTOR_MIN_TOKENS, context.shape[1]) // count) * count
    tiled = registers.to(context.dtype).repeat(length // count, 1)[context.shape[1]:]
    hidden = torch.cat([context, tiled.unsqueeze(0).expand(context.shape[0], -1, -1)], dim=1)
    rotary = connector.rope(hidden.shape[0], hidden.shape[1], device=hidden.device)
    for block in connector.transformer_blocks:
        hidden = block(hidden, attention_mask=None, rotary_emb=rotary)
    return connector.norm_out(hidden)
