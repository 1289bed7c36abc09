"""The "toy" family: a small generic joint-attention transformer used to test the pool and the SP plumbing.

x [B, C, H, W] or [B, C, T, H, W] -> patch tokens -> blocks of (modulated joint self-attention with the text
tokens from `context`, token-wise MLP) -> output patches. Conditioning: timestep, optional `y` [B, y_dim],
`guidance`, `ref_latents` (list of latents, pooled into the conditioning vector) and `attention_mask` [B, L] over
the text. Test hooks (call kwargs): `toy_sleep` seconds per block (`toy_sleep_rank`: on that rank only, the others
then wait in the next collective), `toy_busy` seconds of CPU work per block (a slow block), `toy_fail_rank` (a rank
that raises at the first block; -1: all ranks raise before any collective), `toy_alloc` (bytes every rank allocates
first). Config
`passthrough=True` makes the forward near-free (out = x[:, :out_channels] * scale) for overhead benchmarks.
"""
from __future__ import annotations

import json
import math
import os
import time
from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F

from sp_runtime.checkpoints.dtypes import DTYPES, dtype_name
from sp_runtime.contract import Detection, LoadRequest, ModelInfo
from sp_runtime.checkpoints.loading import SAFETENSORS_DTYPES, out_of_file
from sp_runtime.checkpoints.header import FAMILY_METADATA_KEY, Header, read_header

FAMILY = "toy"
DESCRIPTION = ""  # a test model: not listed among the supported families
DEFAULT_CONFIG = {"in_channels": 4, "out_channels": None, "hidden": 32, "heads": 3, "depth": 2,
                  "context_dim": 16, "y_dim": 0, "patch_size": 2, "x_ndim": 4, "mlp_ratio": 2,
                  "passthrough": False}
FREQ_DIM = 32
Attend = Callable[..., tuple[torch.Tensor, Optional[torch.Tensor]]]


# ---- checkpoint ------------------------------------------------------------------------------------------------
def full_config(**config: Any) -> dict:
    unknown = sorted(set(config) - set(DEFAULT_CONFIG))
    if unknown:
        raise ValueError(f"unknown toy config keys {unknown}; known: {sorted(DEFAULT_CONFIG)}")
    merged = {**DEFAULT_CONFIG, **config}
    merged["out_channels"] = merged["out_channels"] or merged["in_channels"]
    if merged["hidden"] % merged["heads"]:
        raise ValueError(f"toy hidden={merged['hidden']} must be a multiple of heads={merged['heads']}")
    if merged["x_ndim"] not in (4, 5):
        raise ValueError(f"toy x_ndim must be 4 or 5, got {merged['x_ndim']}")
    return merged


def weight_shapes(config: dict) -> dict[str, tuple[int, ...]]:
    hidden, patch_dim = config["hidden"], config["in_channels"] * config["patch_size"] ** 2
    mlp = hidden * config["mlp_ratio"]
    shapes = {"x_embed.weight": (hidden, patch_dim), "x_embed.bias": (hidden,),
              "ref_embed.weight": (hidden, patch_dim), "t_embed.weight": (hidden, FREQ_DIM),
              "guidance_embed.weight": (hidden, FREQ_DIM), "ctx_embed.weight": (hidden, config["context_dim"]),
              "ctx_embed.bias": (hidden,), "out.weight": (config["out_channels"] * config["patch_size"] ** 2, hidden),
              "out.bias": (config["out_channels"] * config["patch_size"] ** 2,), "scale": (1,)}
    if config["y_dim"]:
        shapes["y_embed.weight"] = (hidden, config["y_dim"])
    for block in range(config["depth"]):
        for stream in ("img", "txt"):
            prefix = f"blocks.{block}.{stream}"
            shapes.update({f"{prefix}.mod.weight": (4 * hidden, hidden), f"{prefix}.qkv.weight": (3 * hidden, hidden),
                           f"{prefix}.proj.weight": (hidden, hidden), f"{prefix}.mlp1.weight": (mlp, hidden),
                           f"{prefix}.mlp2.weight": (hidden, mlp)})
    return shapes


def save_toy_checkpoint(path: str, seed: int = 0, dtype: str = "float32", **config: Any) -> dict:
    """Write a random-weight toy checkpoint (safetensors, family named in its metadata); returns its config."""
    from safetensors.torch import save_file
    config = full_config(**config)
    generator = torch.Generator().manual_seed(seed)
    weights = {}
    for name, shape in weight_shapes(config).items():
        fan_in = shape[-1] if len(shape) > 1 else 1
        std = 0.02 if name.endswith(".bias") else 1.0 / math.sqrt(fan_in)
        weights[name] = (torch.randn(shape, generator=generator) * std).to(DTYPES.get(dtype, torch.float32))
    weights["scale"] = torch.full((1,), 0.5).to(weights["scale"].dtype)
    save_file(weights, path, metadata={FAMILY_METADATA_KEY: "toy", "ulysses_sp.config": json.dumps(config)})
    return config


def detect(header: Header) -> Optional[Detection]:
    if header.metadata.get(FAMILY_METADATA_KEY) != "toy":
        return None
    return Detection(family="toy", config=json.loads(header.metadata.get("ulysses_sp.config", "{}")),
                     files=(header.path,))


def _read_weights(path: str, device: torch.device, dtype: Optional[torch.dtype], progress) -> dict:
    """Weights via safetensors' mmap straight onto the device (never through the host process)."""
    from safetensors import safe_open
    weights = {}
    with safe_open(path, "pt", device=str(device)) as handle:
        names = list(handle.keys())
        for index, name in enumerate(names):
            tensor = handle.get_tensor(name)
            weights[name] = out_of_file(tensor.to(dtype) if dtype is not None else tensor, tensor)
            progress((index + 1) / len(names), f"toy: {name}")
    return weights


# ---- model -----------------------------------------------------------------------------------------------------
def _timestep_features(values: torch.Tensor, dim: int = FREQ_DIM) -> torch.Tensor:
    half = dim // 2
    freqs = torch.exp(-math.log(10000.0) * torch.arange(half, dtype=torch.float32, device=values.device) / half)
    angles = values.float().reshape(-1, 1) * 1000.0 * freqs
    return torch.cat([torch.cos(angles), torch.sin(angles)], dim=-1)


def token_count(shape: tuple[int, ...], patch: int) -> int:
    height, width = shape[-2:]
    if height % patch or width % patch:
        raise ValueError(f"toy: latent height {height} and width {width} must be multiples of the patch size {patch}")
    frames = shape[2] if len(shape) == 5 else 1
    return frames * (height // patch) * (width // patch)


def patchify(x: torch.Tensor, patch: int) -> torch.Tensor:
    """[B, C, (T,) H, W] -> [B, T * H/p * W/p, C * p * p] in (t, h, w) token order."""
    if x.dim() == 4:
        x = x.unsqueeze(2)
    batch, channels, frames, height, width = x.shape
    token_count(x.shape, patch)
    grid = x.reshape(batch, channels, frames, height // patch, patch, width // patch, patch)
    return grid.permute(0, 2, 3, 5, 1, 4, 6).reshape(batch, -1, channels * patch * patch)


def write_tokens(out: torch.Tensor, tokens: torch.Tensor, lo: int, patch: int) -> None:
    """Write output patches for tokens [lo, lo + n) into out [B, C, (T,) H, W] in place (disjoint per rank)."""
    grid_out = out.unsqueeze(2) if out.dim() == 4 else out
    batch, channels, frames, height, width = grid_out.shape
    rows, cols = height // patch, width // patch
    grid = grid_out.view(batch, channels, frames, rows, patch, cols, patch).permute(0, 2, 3, 5, 1, 4, 6)
    index = torch.arange(lo, lo + tokens.shape[1])
    values = tokens.reshape(batch, tokens.shape[1], channels, patch, patch).to(out.dtype)
    grid[:, index // (rows * cols), (index // cols) % rows, index % cols] = values.to(grid.device)


class ToyTransformer:
    """The toy's maths on a token range; attention is injected (plain SDPA for the reference, sp_attention in SP)."""

    def __init__(self, weights: dict[str, torch.Tensor], config: dict, compute_dtype: torch.dtype):
        self.w = weights
        self.config = config
        self.dtype = compute_dtype

    def _linear(self, x: torch.Tensor, name: str) -> torch.Tensor:
        bias = self.w.get(f"{name}.bias")
        return F.linear(x, self.w[f"{name}.weight"].to(self.dtype), None if bias is None else bias.to(self.dtype))

    def conditioning(self, timestep, y=None, guidance=None, ref_tokens=None) -> torch.Tensor:
        device = self.w["t_embed.weight"].device
        cond = self._linear(_timestep_features(timestep.to(device)).to(self.dtype), "t_embed")
        if guidance is not None:
            guidance = torch.as_tensor(guidance, device=device).reshape(-1).expand(cond.shape[0])
            cond = cond + self._linear(_timestep_features(guidance / 1000.0).to(self.dtype), "guidance_embed")
        if y is not None and "y_embed.weight" in self.w:
            cond = cond + self._linear(y.to(device, self.dtype), "y_embed")
        for tokens in ref_tokens or ():
            cond = cond + self._linear(tokens.to(device, self.dtype), "ref_embed").mean(dim=1)
        return cond

    def _modulate(self, x: torch.Tensor, cond: torch.Tensor, prefix: str) -> tuple[torch.Tensor, ...]:
        mods = self._linear(F.silu(cond), f"{prefix}.mod").unsqueeze(1).chunk(4, dim=-1)
        norm = F.layer_norm(x, x.shape[-1:])
        return norm * (1 + mods[0]) + mods[1], mods[2], mods[3]

    def _heads(self, x: torch.Tensor, prefix: str) -> list[torch.Tensor]:
        qkv = self._linear(x, f"{prefix}.qkv")
        return [t.unflatten(-1, (self.config["heads"], -1)) for t in qkv.chunk(3, dim=-1)]

    def _mlp(self, x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor, prefix: str) -> torch.Tensor:
        hidden = F.layer_norm(x, x.shape[-1:]) * (1 + scale) + shift
        return x + self._linear(F.gelu(self._linear(hidden, f"{prefix}.mlp1")), f"{prefix}.mlp2")

    def blocks(self, img: torch.Tensor, txt: Optional[torch.Tensor], cond: torch.Tensor, attend: Attend,
               between_blocks: Callable[[int], None]) -> torch.Tensor:
        for block in range(self.config["depth"]):
            between_blocks(block)
            img_in, img_shift, img_scale = self._modulate(img, cond, f"blocks.{block}.img")
            q, k, v = self._heads(img_in, f"blocks.{block}.img")
            text = None
            if txt is not None:
                txt_in, txt_shift, txt_scale = self._modulate(txt, cond, f"blocks.{block}.txt")
                text = self._heads(txt_in, f"blocks.{block}.txt")
            img_attn, txt_attn = attend(q, k, v, text)
            img = self._mlp(img + self._linear(img_attn.flatten(2), f"blocks.{block}.img.proj"),
                            img_shift, img_scale, f"blocks.{block}.img")
            if txt is not None:
                txt = self._mlp(txt + self._linear(txt_attn.flatten(2), f"blocks.{block}.txt.proj"),
                                txt_shift, txt_scale, f"blocks.{block}.txt")
        return img

    def run(self, x: torch.Tensor, timestep: torch.Tensor, inputs: dict, lo: int, hi: int, attend: Attend,
            between_blocks: Callable[[int], None], to_device: Callable) -> torch.Tensor:
        """Output tokens [B, hi - lo, out_channels * p * p] for image tokens [lo, hi)."""
        patch = self.config["patch_size"]
        tokens = patchify(to_device("x", x, self.dtype), patch)[:, lo:hi]
        refs = [patchify(to_device(f"ref_latents.{i}", ref, self.dtype), patch)
                for i, ref in enumerate(inputs.get("ref_latents") or ())]
        y = inputs.get("y")
        cond = self.conditioning(to_device("timestep", timestep, None),
                                 None if y is None else to_device("y", y, self.dtype), inputs.get("guidance"), refs)
        context = inputs.get("context")
        txt = None if context is None else self._linear(to_device("context", context, self.dtype), "ctx_embed")
        img = self.blocks(self._linear(tokens, "x_embed"), txt, cond, attend, between_blocks)
        return self._linear(F.layer_norm(img, img.shape[-1:]), "out")


def _text_mask(inputs: dict, to_device: Callable) -> Optional[torch.Tensor]:
    mask = inputs.get("attention_mask")
    return None if mask is None else to_device("attention_mask", mask, None).bool()


def _test_hooks(inputs: dict, rank: int) -> Callable[[int], None]:
    sleep_rank = inputs.get("toy_sleep_rank")
    sleep_s = float(inputs.get("toy_sleep") or 0.0) if sleep_rank in (None, rank) else 0.0
    busy_s = float(inputs.get("toy_busy") or 0.0)
    fail_rank = inputs.get("toy_fail_rank")

    def hook(block: int) -> None:
        if block == 0 and fail_rank is not None and fail_rank == rank:
            raise RuntimeError(f"toy failure injected on rank {rank}")
        if sleep_s:
            time.sleep(sleep_s)
        if busy_s:
            _busy(busy_s)
    if fail_rank == -1:
        raise ValueError("toy failure injected on every rank")
    if inputs.get("toy_alloc"):
        torch.empty(int(inputs["toy_alloc"]), dtype=torch.uint8)
    return hook


def _busy(seconds: float) -> None:
    """Compute (hold a CPU) for `seconds`, like a block that is slow."""
    deadline = time.monotonic() + seconds
    value = torch.ones(64, 64)
    while time.monotonic() < deadline:
        value = torch.tanh(value @ value)


class ToyWorkerModel:
    """The toy in one worker: its share of the image tokens into `out`."""

    def __init__(self, transformer: ToyTransformer, info: ModelInfo):
        self.transformer = transformer
        self.info = info

    def forward(self, x: torch.Tensor, timestep: torch.Tensor, inputs: dict, out: torch.Tensor, ctx) -> None:
        from sp_runtime.attention import SeqShards, sp_attention
        groups, config = ctx.groups, self.transformer.config  # CFG batch halves are split by the pool worker
        hooks = _test_hooks(inputs, groups.rank)
        if config["passthrough"]:
            _passthrough(x, out, self.transformer, groups.seq, config)
            return
        seq = groups.seq
        shards = SeqShards.balanced(token_count(x.shape, config["patch_size"]), seq.degree)
        lo, hi = shards.range(seq.rank)
        mask = _text_mask(inputs, ctx.to_device)

        def attend(q, k, v, text):
            return sp_attention(q, k, v, seq, shards, text=text, text_mask=mask if text else None)

        def between_blocks(block: int) -> None:
            ctx.check_cancel()
            hooks(block)
        tokens = self.transformer.run(x, timestep, inputs, lo, hi, attend, between_blocks, ctx.to_device)
        write_tokens(out, tokens, lo, config["patch_size"])


def _passthrough(x, out, transformer: ToyTransformer, seq, config) -> None:
    """Near-free forward for overhead benchmarks: each sequence rank copies its slice of the last dimension."""
    width = x.shape[-1]
    lo, hi = width * seq.rank // seq.degree, width * (seq.rank + 1) // seq.degree
    scale = transformer.w["scale"].to("cpu", out.dtype)
    torch.mul(x[:, :config["out_channels"], ..., lo:hi], scale, out=out[..., lo:hi])


# ---- loading ---------------------------------------------------------------------------------------------------
def _dtypes(request_dtype: str, stored: torch.dtype) -> tuple[Optional[torch.dtype], torch.dtype]:
    """(dtype to convert weights to or None, compute dtype); fp8 weights stay fp8 and compute in bf16."""
    weight = None if request_dtype == "default" else DTYPES[request_dtype]
    effective = weight or stored
    compute = effective if effective in (torch.float32, torch.bfloat16, torch.float16) else torch.bfloat16
    return weight, compute


def load(request: LoadRequest, detection: Detection, device: torch.device, groups, progress) -> ToyWorkerModel:
    config = full_config(**detection.config)
    header = request.header or read_header(request.path)
    if "scale" not in header.tensors:
        raise ValueError(f"{request.path!r} is not a complete toy checkpoint: missing ['scale']")
    stored = SAFETENSORS_DTYPES[header.tensors["scale"][0]]
    weight_dtype, compute = _dtypes(request.dtype, stored)
    weights = _read_weights(request.path, device, weight_dtype, progress)
    missing = sorted(set(weight_shapes(config)) - set(weights))
    if missing:
        raise ValueError(f"{request.path!r} is not a complete toy checkpoint: missing {missing[:5]}")
    info = ModelInfo(family="toy", variant="passthrough" if config["passthrough"] else "", x_ndim=config["x_ndim"],
                     in_channels=config["in_channels"], out_channels=config["out_channels"], config=config,
                     weight_dtype=dtype_name(weight_dtype or stored),
                     compute_dtype=dtype_name(compute))
    return ToyWorkerModel(ToyTransformer(weights, config, compute), info)


# ---- in-process reference (no SP, no pool) ---------------------------------------------------------------------
class ToyReference:
    """The toy's full forward in this process with plain SDPA: what the pool's output must equal."""

    def __init__(self, path: str, dtype: str = "default"):
        from safetensors.torch import load_file
        weights = load_file(os.fspath(path))
        self.config = full_config(**json.loads(read_header(os.fspath(path)).metadata["ulysses_sp.config"]))
        weight_dtype, compute = _dtypes(dtype_name(dtype), weights["scale"].dtype)
        if weight_dtype is not None:
            weights = {name: tensor.to(weight_dtype) for name, tensor in weights.items()}
        self.transformer = ToyTransformer(weights, self.config, compute)

    def __call__(self, x: torch.Tensor, timestep: torch.Tensor, context: Optional[torch.Tensor] = None,
                 **extra: Any) -> torch.Tensor:
        config = self.config
        timestep = torch.as_tensor(timestep, dtype=torch.float32)
        if timestep.dim() == 0:
            timestep = timestep.reshape(1).expand(x.shape[0])
        out = x.new_empty(x.shape[0], config["out_channels"], *x.shape[2:])
        with torch.no_grad():
            if config["passthrough"]:
                torch.mul(x[:, :config["out_channels"]], self.transformer.w["scale"].to(x.dtype), out=out)
                return out
            inputs = {"context": context, **extra}
            mask = inputs.get("attention_mask")
            tokens = token_count(x.shape, config["patch_size"])
            tokens_out = self.transformer.run(
                x, timestep, inputs, 0, tokens,
                lambda q, k, v, text: plain_joint_attention(q, k, v, text, mask),
                lambda block: None, lambda name, tensor, dtype: tensor.to(dtype) if dtype else tensor)
            write_tokens(out, tokens_out, 0, config["patch_size"])
        return out


def plain_joint_attention(q, k, v, text, mask):
    """[text, image] joint SDPA over the whole sequence; independent of sp_runtime.attention."""
    length = 0 if text is None else text[0].shape[1]
    if text is not None:
        q, k, v = (torch.cat([t, x], dim=1) for t, x in zip(text, (q, k, v)))
    attn_mask = None
    if text is not None and mask is not None:
        keep = torch.cat([mask.bool(), mask.new_ones(mask.shape[0], q.shape[1] - length, dtype=torch.bool)], dim=1)
        attn_mask = keep[:, None, None, :]
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                         attn_mask=attn_mask).transpose(1, 2)
    return out[:, length:], (out[:, :length] if text is not None else None)


def reference_forward(path: str, x: torch.Tensor, timestep, context: Optional[torch.Tensor] = None,
                      dtype: str = "default", **extra: Any) -> torch.Tensor:
    """One in-process forward of a toy checkpoint (loads the weights each time; use ToyReference to reuse them)."""
    return ToyReference(path, dtype)(x, timestep, context, **extra)
