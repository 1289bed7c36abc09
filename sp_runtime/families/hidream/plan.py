"""HiDream I1 / E1 sequence-parallel plan. Split: the image tokens (E1: the reference latent `image_cond` joined on
the right before patching, as ComfyUI concatenates it; only the image's columns go out). Replicated: the text, T5
then the last Llama layer (carried through the blocks), then a slot for the running block's own Llama layer (projected
per block, its outputs dropped). Double blocks join the text through its own projections (keys after the image's),
single blocks take it as the leading tokens. The mixture-of-experts feed-forwards route each token alone: they run on
each rank's tokens. Rotary: Flux's (index, row, col) ids for the image; the text sits at 0 (no rotation)."""
from __future__ import annotations

from dataclasses import replace

import torch

from ...sp import AttentionSpec, Output, Part, Plan, Stage, Stream
from ...sp.tensor_parallel import COLUMN, GATHER, NORM, ROW, Split, TensorParallelPlan
from ...sp.tokens import ROPE_THETA, TokenGrid, grid_ids, pad_to_patch, patchify
from .detection import PATCH


def check(call) -> None:
    config, x, inputs = call.config, call.x, call.inputs
    if inputs.get("control") is not None:
        raise ValueError("ControlNet inputs are not supported by the sequence-parallel HiDream")
    if x.dim() != 4 or x.shape[1] != config.in_channels:
        raise ValueError(f"x has shape {tuple(x.shape)}; HiDream takes [B, {config.in_channels}, H, W]")
    cond = inputs.get("image_cond")
    if cond is not None and (cond.dim() != 4 or cond.shape[1:3] != x.shape[1:3] or cond.shape[0] not in (1, x.shape[0])):
        raise ValueError(f"image_cond (HiDream E1's reference latent) has shape {tuple(cond.shape)}; expected "
                         f"[B, {x.shape[1]}, {x.shape[2]}, w]")
    t5_width, llama_width = config.caption_channels
    _need(inputs, "context", 3, t5_width, "[batch, T5 tokens, {}] (the T5 output)")
    _need(inputs, "encoder_hidden_states_llama3", 4, llama_width, "[batch, Llama layers, tokens, {}]")
    _need(inputs, "y", 2, config.text_emb_dim, "[batch, {}] (the pooled CLIP-L/G output)")
    layers = inputs["encoder_hidden_states_llama3"].shape[1]
    if layers <= max(config.llama_layers):
        raise ValueError(f"encoder_hidden_states_llama3 holds {layers} Llama layers; this HiDream reads layer "
                         f"{max(config.llama_layers)}")


def _need(inputs, name: str, dims: int, width: int, shape: str) -> None:
    value = inputs.get(name)
    if value is None or value.dim() != dims or value.shape[-1] != width:
        raise ValueError(f"HiDream needs {name} {shape.format(width)}; got "
                         f"{None if value is None else tuple(value.shape)}")


def layout(call) -> list[Stream]:
    """Patch tokens with features (ph, pw, c), as HiDream's patch embedding reads them."""
    x = call.input("x")
    width = x.shape[-1]
    if call.inputs.get("image_cond") is not None:
        x = torch.cat([x, call.input("image_cond").expand(x.shape[0], -1, -1, -1)], dim=-1)
    grid = TokenGrid.of(x.shape[-2], x.shape[-1], PATCH)
    tokens = patchify(pad_to_patch(x, PATCH), PATCH).unflatten(-1, (-1, PATCH, PATCH)).permute(0, 1, 3, 4, 2)
    ids = grid_ids(grid, 0, 0, 0, False, torch.float32, x.device)
    image = Part(tokens.flatten(2), ids, "x_embedder", Output(replace(grid, width=width)))
    llama, last = call.input("encoder_hidden_states_llama3"), len(call.config.llama_layers) - 1
    text = [Part(call.input("context"), None, f"caption_projection.{last + 1}"),
            Part(llama[:, call.config.llama_layers[last]], None, f"caption_projection.{last}"),
            Part(llama[:, call.config.llama_layers[0]], None, "caption_projection.0")]
    return [Stream("image", [image]), Stream("text", text, split=False)]


def condition(call) -> None:
    """The timestep (ComfyUI's, sigma * 1000) and pooled-text embeddings; each block's index for its Llama layer."""
    model = call.model
    call.temb = model.t_embedder(call.sigma(), call.dtype) + model.p_embedder(call.input("y").expand(call.batch, -1))
    blocks = [*model.double_stream_blocks, *model.single_stream_blocks]
    call.block_index = {block: index for index, block in enumerate(blocks)}
    call.carried = call.text.shape[1] - call.shards["text"].stream.parts[-1].count


def _block_text(block, call) -> torch.Tensor:
    """The carried text and this block's own Llama layer, projected."""
    index = call.block_index[block]
    if index == 0:
        return call.text
    layer = call.input("encoder_hidden_states_llama3")[:, call.config.llama_layers[index]]
    own = call.model.caption_projection[index](layer).expand(call.batch, -1, -1)
    return torch.cat([call.text[:, :call.carried], own], dim=1)


def double_block(block, call) -> None:
    call.image, call.text = block(hidden_states=call.image, encoder_hidden_states=_block_text(block, call),
                                  temb=call.temb)


def single_block(block, call) -> None:
    text = _block_text(block, call)
    joint = block(hidden_states=torch.cat([text, call.image], dim=1), temb=call.temb)
    call.text, call.image = joint[:, :text.shape[1]], joint[:, text.shape[1]:]


def project(attn, hidden):
    qkv = [attn.q_rms_norm(attn.to_q(hidden)), attn.k_rms_norm(attn.to_k(hidden)), attn.to_v(hidden)]
    return [t.to(hidden.dtype).unflatten(-1, (attn.heads, -1)) for t in qkv], None


def project_text(attn, text):
    qkv = [attn.q_rms_norm_t(attn.to_q_t(text)), attn.k_rms_norm_t(attn.to_k_t(text)), attn.to_v_t(text)]
    return [t.to(text.dtype).unflatten(-1, (attn.heads, -1)) for t in qkv]


def output_tokens(call, tokens: torch.Tensor) -> torch.Tensor:
    """(ph, pw, c) output features -> (c, ph, pw), negated as ComfyUI's HiDream returns them."""
    return -tokens.unflatten(-1, (PATCH, PATCH, -1)).permute(0, 1, 4, 2, 3).flatten(2)


# the text stream's own q / k / v / out, q / k norms across all heads, and the SwiGLU experts (w1, w3 | w2: one
# all-reduce per expert called; the TP ranks hold the same tokens, so they route them alike)
TENSOR_PARALLEL = TensorParallelPlan(extra=(
    *(Split(name, COLUMN) for name in ("to_q_t", "to_k_t", "to_v_t", "w1", "w3")),
    *(Split(name, ROW) for name in ("to_out", "to_out_t", "w2")),
    *(Split(name, NORM) for name in ("q_rms_norm", "k_rms_norm", "q_rms_norm_t", "k_rms_norm_t")),
    Split("adaLN_modulation.1", GATHER)))
ATTENTION = AttentionSpec(project=project, project_text=project_text, text_first=False,
                          finish_text=lambda attn, out: attn.to_out_t(out))
PLAN = Plan(check=check, layout=layout, condition=condition,
            rope=lambda config: (config.axes_dims_rope, ROPE_THETA),
            stages=(Stage("double_stream_blocks", double_block, attention=ATTENTION),
                    Stage("single_stream_blocks", single_block, attention=replace(ATTENTION, text_prefix=True))),
            head=lambda call: call.model.final_layer(call.image, call.temb), output_tokens=output_tokens,
            tensor_parallel=TENSOR_PARALLEL)
