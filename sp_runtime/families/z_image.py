"""Z-Image (base and turbo) under Ulysses SP: detection from the header, loading into diffusers'
ZImageTransformer2DModel, and ComfyUI's `diffusion_model(x, timestep, context, num_tokens, attention_mask)` (ComfyUI's
NextDiT in comfy/ldm/lumina with Z-Image's options: 32-token padding with learned pad tokens, theta 256, t = 1 - sigma,
output negated).

Two refiner stages run apart, then one single-stream stage: the caption (padded to 32 tokens with `cap_pad_token`)
through `context_refiner`, the image tokens (padded to 32 with `x_pad_token`) through `noise_refiner`, then both as
one sequence through `layers`. Each stream is split over the ranks on its own, so everything but attention is
token-local; the joint sequence is each rank's caption shard followed by its image shard, in rank order. No attention
is masked (ComfyUI attends the pad tokens too and reads no text mask), so that order changes nothing: each token
keeps its own rotary position. Ulysses pads heads to a multiple of the degree, so 30 heads work at any degree; Ring
and Ulysses x Ring apply as they are (no mask to honour).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Optional

import torch

from ..attention import SeqShards, sp_attention
from .base import ComfyHost, Detection, LoadRequest, ModelInfo, ProgressFn, config_entries
from .checkpoint import (KeyPlan, WeightDtypes, count_blocks, detected_checkpoint, find_prefix, load_checkpoint_model,
                         row_split, shape_of, strip_prefix)
from .header import Header, header_config
from .joint_dit import TokenGrid, pad_to_patch, patchify, rotary, rotate

FAMILY = "z_image"
DESCRIPTION = "Z-Image (base, turbo)"


def _comfy_unet_config(info: ModelInfo) -> dict:
    return {"in_channels": info.in_channels}


COMFY = ComfyHost(model_classes={"": "ZImage"}, unet_config=_comfy_unet_config,
                  attributes=lambda info: {"patch_size": PATCH, "pad_tokens_multiple": PAD_MULTIPLE})
CLASS_NAME = "ZImageTransformer2DModel"
PATCH = 2
PAD_MULTIPLE = 32            # ComfyUI's pad_tokens_multiple, diffusers' SEQ_MULTI_OF
ROPE_THETA = 256.0
AXES_LENS = (1536, 512, 512)  # rotary table sizes of diffusers' model (ComfyUI computes the angles directly)
ANCHORS = ("cap_embedder.1.weight", "t_embedder.mlp.0.weight", "noise_refiner.0.adaLN_modulation.0.weight",
           "context_refiner.0.attention_norm1.weight", "layers.0.feed_forward.w1.weight")
PAD_TOKENS = ("x_pad_token", "cap_pad_token")
FUSED_QKV = ".attention.qkv.weight"     # ComfyUI's files: [q; k; v] rows in one tensor
UNUSED = ("norm_final.weight",)         # in some original files, used by neither ComfyUI nor diffusers
TOP_RENAMES = {"x_embedder.": "all_x_embedder.2-1.", "final_layer.": "all_final_layer.2-1."}
ATTENTION_RENAMES = {".attention.out.": ".attention.to_out.0.", ".attention.q_norm.": ".attention.norm_q.",
                     ".attention.k_norm.": ".attention.norm_k."}
CONFIG_KEYS = ("in_channels", "dim", "n_layers", "n_refiner_layers", "n_heads", "n_kv_heads", "cap_feat_dim",
               "rope_theta", "t_scale", "axes_dims", "axes_lens")
UNSUPPORTED_INPUTS = ("ref_latents", "ref_contexts", "siglip_feats", "direct_context", "ref_frames",
                      "clip_text_pooled")


# ---------------------------------------------------------------------------------------------------------------
# Detection

def detect(header: Header) -> Optional[Detection]:
    """Z-Image from its header alone (no weights read); None when the file is another family."""
    folder_config = header_config(header)
    if folder_config is not None and folder_config.get("_class_name") != CLASS_NAME:
        return None
    prefix = find_prefix(header.tensors, ANCHORS)
    if prefix is None:
        return None
    keys = strip_prefix(header.tensors, prefix)
    if any(key.startswith("siglip_") for key in keys) or (folder_config or {}).get("siglip_feat_dim"):
        raise ValueError(f"{header.path!r} is Z-Image Omni (SigLIP image features), which is not supported (Z-Image "
                         f"and Z-Image-Turbo load)")
    missing = [name for name in PAD_TOKENS if name not in keys]
    if missing:
        raise ValueError(f"{header.path!r} looks like Z-Image but has no {missing}: Z-Image pads its sequences with "
                         f"these learned tokens; the file is incomplete or another Lumina-type model")
    original = f"layers.0{FUSED_QKV}" in keys
    if folder_config:
        config = {key: folder_config[key] for key in CONFIG_KEYS if key in folder_config}
    else:
        config = architecture(keys, original)
    return Detection(family=FAMILY, variant="image", layout="original" if original else "diffusers", prefix=prefix,
                     config=config, files=header.source.files)


def architecture(keys: dict, original: bool) -> dict:
    """ZImageTransformer2DModel config from header shapes (keys without prefix)."""
    dim, cap_feat_dim = shape_of(keys, "cap_embedder.1.weight")
    head_dim = shape_of(keys, "layers.0.attention." + ("q_norm" if original else "norm_q") + ".weight")[0]
    if dim % head_dim:
        raise ValueError(f"Z-Image width {dim} is not a multiple of its head size {head_dim}")
    key_rows = (shape_of(keys, f"layers.0{FUSED_QKV}")[0] - dim) // 2 if original else \
        shape_of(keys, "layers.0.attention.to_k.weight")[0]
    if key_rows != dim:
        raise ValueError(f"Z-Image with grouped key / value heads ({key_rows // head_dim} for {dim // head_dim} "
                         f"query heads) is not supported")
    hidden = shape_of(keys, "layers.0.feed_forward.w1.weight")[0]
    if hidden != int(dim / 3 * 8):  # diffusers' class fixes it
        raise ValueError(f"Z-Image feed-forward width {hidden} is not 8/3 of its width {dim} as diffusers' "
                         f"ZImageTransformer2DModel builds it; this variant is not supported")
    patch_features = shape_of(keys, ("x_embedder" if original else "all_x_embedder.2-1") + ".weight")[1]
    return {
        "all_patch_size": (PATCH,),
        "all_f_patch_size": (1,),
        "in_channels": patch_features // (PATCH * PATCH),
        "dim": dim,
        "n_layers": count_blocks(keys, "layers"),
        "n_refiner_layers": count_blocks(keys, "noise_refiner"),
        "n_heads": dim // head_dim,
        "n_kv_heads": dim // head_dim,
        "cap_feat_dim": cap_feat_dim,
        "rope_theta": ROPE_THETA,
        "t_scale": 1000.0,
        "axes_dims": z_image_axes(head_dim),
        "axes_lens": AXES_LENS,
    }


def z_image_axes(head_dim: int) -> tuple[int, int, int]:
    """Rotary dims of the (sequence, row, column) axes: (32, 48, 48) at the real head size 128 (checkpoints do not
    store them); other head sizes keep the proportions 1/4, 3/8, 3/8 (ComfyUI's 64-wide variant: 16, 24, 24)."""
    if head_dim % 16:
        raise ValueError(f"Z-Image head size {head_dim} cannot carry its rotary axes (needs a multiple of 16)")
    return head_dim // 4, 3 * head_dim // 8, 3 * head_dim // 8


# ---------------------------------------------------------------------------------------------------------------
# Key plan: ComfyUI's names -> diffusers' (what diffusers' convert_z_image_transformer_checkpoint_to_diffusers does)

def weight_plan(detection: Detection, keys: Iterable[str]) -> Optional[KeyPlan]:
    """How a checkpoint's keys (prefix stripped) become parameters: ComfyUI files through original_plan, diffusers
    layouts as they are (None)."""
    return original_plan(keys, detection.config) if detection.layout == "original" else None


def original_plan(keys: Iterable[str], config) -> KeyPlan:
    """ComfyUI key names -> parameters (LoRAs use these names too); the fused qkv splits into to_q, to_k, to_v."""
    rows = config["dim"]
    plan = {}
    for key in keys:
        if key in UNUSED:
            continue
        if key.endswith(FUSED_QKV):
            plan[key] = row_split(key[:-len("qkv.weight")], ("to_q", "to_k", "to_v"), "weight", (rows,) * 3)
            continue
        target = key
        for old, new in TOP_RENAMES.items():
            if target.startswith(old):
                target = new + target[len(old):]
        for old, new in ATTENTION_RENAMES.items():
            target = target.replace(old, new)
        plan[key] = [(target, None)]
    return plan


# ---------------------------------------------------------------------------------------------------------------
# Loading

def load_model(path: str, dtype: str = "default", device: torch.device | str = "cpu",
               detection: Optional[Detection] = None, options: Optional[dict] = None,
               progress: Optional[ProgressFn] = None, header: Optional[Header] = None
               ) -> tuple[torch.nn.Module, Detection, WeightDtypes]:
    """A diffusers ZImageTransformer2DModel with the checkpoint's weights (stock attention processors)."""
    from diffusers import ZImageTransformer2DModel

    header, detection = detected_checkpoint(path, header, detection, detect, FAMILY, "Z-Image")
    plan = weight_plan(detection, strip_prefix(header.tensors, detection.prefix))
    model, dtypes = load_checkpoint_model(ZImageTransformer2DModel, detection.config, header, detection, dtype,
                                          device, plan, progress, ignore=UNUSED)
    return model, detection, dtypes


def load(request: LoadRequest, detection: Detection, device: torch.device, groups, progress: ProgressFn
         ) -> "ZImageWorker":
    """The pool's entry point: load on this worker's device and switch attention to sequence parallel."""
    from diffusers.models.attention_processor import Attention
    model, detection, dtypes = load_model(request.path, request.dtype, device, detection, request.options, progress,
                                          request.header)
    for module in model.modules():
        if isinstance(module, Attention):
            module.set_processor(StreamSPProcessor())
    return ZImageWorker(model, detection, dtypes)


# ---------------------------------------------------------------------------------------------------------------
# Sequence-parallel forward

@dataclass
class StreamAttention:
    """Attention over one split sequence (a refiner stream or the joint one); passed to the processor as
    `freqs_cis`: the split and the rotary (cos, sin) of this rank's tokens."""

    seq: Any                                      # SeqParallel
    shards: SeqShards
    rope: tuple[torch.Tensor, torch.Tensor]

    def __call__(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        """[B, n, H, D] of this rank's tokens -> attention output [B, n, H, D] (unmasked)."""
        query, key = rotate(query, self.rope), rotate(key, self.rope)
        return sp_attention(query, key, value, self.seq, self.shards)[0]


class StreamSPProcessor:
    """Attention of diffusers' Z-Image blocks through StreamAttention (replaces ZSingleStreamAttnProcessor, which
    needs the whole sequence on one device)."""

    def __call__(self, attn, hidden_states: torch.Tensor, encoder_hidden_states=None, attention_mask=None,
                 freqs_cis: Optional[StreamAttention] = None) -> torch.Tensor:
        if not isinstance(freqs_cis, StreamAttention):
            raise TypeError("StreamSPProcessor runs inside the sequence-parallel forward only")
        query, key, value = (proj(hidden_states).unflatten(-1, (attn.heads, -1))
                             for proj in (attn.to_q, attn.to_k, attn.to_v))
        query, key = attn.norm_q(query), attn.norm_k(key)
        out = freqs_cis(query, key, value).flatten(2, 3).to(value.dtype)
        return attn.to_out[0](out.contiguous())


@dataclass(frozen=True)
class Streams:
    """One call's caption and image sequences (each padded to PAD_MULTIPLE), their splits and this rank's share."""

    caption_len: int     # real caption tokens
    caption_total: int   # padded
    grid: TokenGrid      # the image token grid (latent padded to the patch)
    image_total: int     # padded
    caption: SeqShards
    image: SeqShards
    rank: int

    @classmethod
    def of(cls, x_hw: tuple[int, int], caption_len: int, seq) -> "Streams":
        grid = TokenGrid.of(x_hw[0], x_hw[1], PATCH)
        caption_total, image_total = _padded(caption_len), _padded(grid.count)
        return cls(caption_len, caption_total, grid, image_total, SeqShards.balanced(caption_total, seq.degree),
                   SeqShards.balanced(image_total, seq.degree), seq.rank)

    @property
    def joint(self) -> SeqShards:
        """Rank r holds its caption shard then its image shard: the joint sequence in rank order."""
        sizes = tuple(c + i for c, i in zip(self.caption.sizes, self.image.sizes))
        return SeqShards(sum(sizes), sizes)

    def caption_ids(self) -> torch.Tensor:
        """(1 + i, 0, 0) for this rank's caption positions i, pads included (ComfyUI's and diffusers' ids)."""
        lo, hi = self.caption.range(self.rank)
        ids = torch.zeros(hi - lo, 3)
        ids[:, 0] = torch.arange(lo, hi) + 1
        return ids

    def image_ids(self) -> torch.Tensor:
        """(caption_total + 1, row, col) for this rank's image tokens; (0, 0, 0) for its pad tokens."""
        lo, hi = self.image.range(self.rank)
        position = torch.arange(lo, hi)
        real = position < self.grid.count
        ids = torch.zeros(hi - lo, 3)
        ids[real, 0] = self.caption_total + 1
        ids[real, 1] = (position[real] // self.grid.cols).float()
        ids[real, 2] = (position[real] % self.grid.cols).float()
        return ids


def _padded(count: int) -> int:
    return -(-count // PAD_MULTIPLE) * PAD_MULTIPLE


class ZImageWorker:
    """A loaded Z-Image in one worker; forward() is ComfyUI's diffusion_model call over the sequence group."""

    def __init__(self, model, detection: Detection, dtypes: WeightDtypes):
        self.model = model
        self.dtypes = dtypes
        config = model.config
        self.info = ModelInfo(family=FAMILY, variant=detection.variant, in_channels=config.in_channels,
                              out_channels=config.in_channels, x_ndim=4, config=config_entries(config, CONFIG_KEYS),
                              weight_dtype=dtypes.storage_name, compute_dtype=dtypes.compute_name)

    def forward(self, x: torch.Tensor, timestep: torch.Tensor, inputs: dict[str, Any], out: torch.Tensor,
                ctx) -> None:
        model, dtype, seq = self.model, self.dtypes.compute, ctx.groups.seq
        context = _check_inputs(model.config, x, inputs)
        streams = Streams.of(tuple(x.shape[-2:]), context.shape[1], seq)
        axes = model.config.axes_dims

        def attention(shards, ids):
            return StreamAttention(seq, shards, rotary(ids.to(ctx.device), axes, model.config.rope_theta))

        caption_ids, image_ids = streams.caption_ids(), streams.image_ids()
        adaln = _time_embedding(model, ctx.to_device("timestep", timestep.reshape(-1), torch.float32), x.shape[0],
                                dtype)
        caption = _caption_tokens(model, ctx.to_device("context", context, dtype), streams, x.shape[0])
        image = _image_tokens(model, ctx.to_device("x", x, dtype), streams)
        caption_attention = attention(streams.caption, caption_ids)
        for block in model.context_refiner:
            ctx.check_cancel()
            caption = block(caption, None, caption_attention)
        image_attention = attention(streams.image, image_ids)
        for block in model.noise_refiner:
            ctx.check_cancel()
            image = block(image, None, image_attention, adaln)
        joint = torch.cat([caption, image], dim=1)
        joint_attention = attention(streams.joint, torch.cat([caption_ids, image_ids]))
        for block in model.layers:
            ctx.check_cancel()
            joint = block(joint, None, joint_attention, adaln)
        result = model.all_final_layer[f"{PATCH}-1"](joint[:, caption.shape[1]:], c=adaln)
        _write_image(out, result, streams)


def _check_inputs(config, x: torch.Tensor, inputs: dict) -> torch.Tensor:
    for name in UNSUPPORTED_INPUTS:
        value = inputs.get(name)
        if value is not None and not (isinstance(value, (list, tuple)) and len(value) == 0):  # ComfyUI's default []
            raise ValueError(f"{name} (Z-Image Omni / Ming-Image / NewBie inputs) is not supported by the "
                             f"sequence-parallel Z-Image")
    if x.dim() != 4 or x.shape[1] != config.in_channels:
        raise ValueError(f"x has shape {tuple(x.shape)}; Z-Image takes [B, {config.in_channels}, H, W]")
    context = inputs.get("context")
    if context is None or context.dim() != 3 or context.shape[-1] != config.cap_feat_dim or \
            context.shape[0] not in (1, x.shape[0]):
        raise ValueError(f"Z-Image needs context [batch, text tokens, {config.cap_feat_dim}] (the text encoder "
                         f"output); got {None if context is None else tuple(context.shape)}")
    # attention_mask and num_tokens are read past, as ComfyUI's NextDiT does: it attends every context token
    return context


def _time_embedding(model, sigma: torch.Tensor, batch: int, dtype: torch.dtype) -> torch.Tensor:
    """ComfyUI's t_embedder((1 - sigma) * 1000): sinusoids in float32, cast to the compute dtype, then the MLP."""
    sigma = sigma.expand(batch) if sigma.numel() == 1 else sigma
    embedder = model.t_embedder
    frequencies = embedder.timestep_embedding((1 - sigma) * model.config.t_scale, embedder.frequency_embedding_size)
    return embedder.mlp(frequencies.to(dtype))


def _caption_tokens(model, context: torch.Tensor, streams: Streams, batch: int) -> torch.Tensor:
    """This rank's caption tokens, embedded: real tokens through cap_embedder, the padding as cap_pad_token."""
    lo, hi = streams.caption.range(streams.rank)
    real = context[:, lo:min(hi, streams.caption_len)].expand(batch, -1, -1)
    return _with_pad_tokens(model.cap_embedder(real), model.cap_pad_token, hi - lo)


def _image_tokens(model, x: torch.Tensor, streams: Streams) -> torch.Tensor:
    """This rank's image tokens, embedded: patches in ComfyUI's (row, col, channel) feature order through
    x_embedder, the padding as x_pad_token. Every rank patchifies the (small) latent whole."""
    lo, hi = streams.image.range(streams.rank)
    tokens = patchify(pad_to_patch(x, PATCH), PATCH)  # features (c, ph, pw)
    tokens = tokens.unflatten(-1, (x.shape[1], PATCH, PATCH)).permute(0, 1, 3, 4, 2).flatten(2)
    embedded = model.all_x_embedder[f"{PATCH}-1"](tokens[:, lo:min(hi, streams.grid.count)])
    return _with_pad_tokens(embedded, model.x_pad_token, hi - lo)


def _with_pad_tokens(tokens: torch.Tensor, pad_token: torch.Tensor, count: int) -> torch.Tensor:
    extra = count - tokens.shape[1]
    if extra <= 0:
        return tokens
    pad = pad_token.to(tokens.dtype).expand(tokens.shape[0], extra, -1)
    return torch.cat([tokens, pad], dim=1)


def _write_image(out: torch.Tensor, result: torch.Tensor, streams: Streams) -> None:
    """This rank's real image tokens [B, n, (ph, pw, c)] -> out [B, C, H, W], negated as ComfyUI's NextDiT returns."""
    lo, hi = streams.image.range(streams.rank)
    stop = min(hi, streams.grid.count)
    if stop <= lo:
        return
    tokens = result[:, :stop - lo].unflatten(-1, (PATCH, PATCH, out.shape[1])).permute(0, 1, 4, 2, 3).flatten(2)
    streams.grid.write(out, (-tokens).to(out.dtype).cpu(), lo)


# ---------------------------------------------------------------------------------------------------------------
# Single-process reference (tests): diffusers' stock forward, fed ComfyUI's call in its own convention

def reference_forward(model_or_path, x: torch.Tensor, timestep: torch.Tensor, context: torch.Tensor,
                      dtype: str = "default", **_ignored) -> torch.Tensor:
    """ComfyUI's Z-Image diffusion_model(...) computed by diffusers' own forward on one process: per-item lists,
    t = 1 - sigma, the latent padded to the patch by wrap-around (ComfyUI's circular padding), output negated."""
    model = model_or_path
    if not isinstance(model, torch.nn.Module):
        model = load_model(model_or_path, dtype)[0]
    weight = model.all_x_embedder[f"{PATCH}-1"].weight
    compute, device = weight.dtype, weight.device
    height, width = x.shape[-2:]
    padded = torch.cat([x, x[:, :, :height % PATCH]], dim=2)
    padded = torch.cat([padded, padded[:, :, :, :width % PATCH]], dim=3)
    context = context.expand(x.shape[0], -1, -1)
    sigma = timestep.reshape(-1).expand(x.shape[0]).float()
    with torch.no_grad():
        outputs = model([item[:, None].to(device, compute) for item in padded], (1 - sigma).to(device),
                        [item.to(device, compute) for item in context], return_dict=False)[0]
    return -torch.stack(outputs)[:, :, 0, :height, :width].to(x.dtype).cpu()
