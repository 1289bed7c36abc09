"""The demo's trained model: a small Qwen-Image-architecture transformer (diffusers' class) taught, by rectified flow,
to draw the coloured shapes of shapes.py, once, on the CPU in this process; cached as a ComfyUI-layout checkpoint.

The cache file is named by a hash of the recipe (its numbers, the model config and this module's and shapes.py's
source), so any change to how the model is trained trains it again.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import pathlib
import time
from dataclasses import asdict, dataclass
from typing import Callable, Optional

import torch

from . import shapes

METADATA_KEY = "ulysses_sp_demo_training"  # the training summary, kept in the checkpoint's header metadata
ProgressFn = Callable[[int, int, float], None]  # (step, steps, loss)


@dataclass(frozen=True)
class Recipe:
    """Everything that decides the trained weights. size: overrides of the tiny Qwen-Image config."""

    size: dict
    image_size: int = 24       # pixels; the latent is half of it, the transformer sees (size / 4)^2 tokens
    steps: int = 600
    batch: int = 32
    learning_rate: float = 3e-3
    warmup_steps: int = 20
    timestep_shift: float = 3.0  # train where the demo's schedule (shift 3) samples: mostly at high noise
    ema_decay: float = 0.99      # the checkpoint holds the moving average of the weights: smoother pictures
    seed: int = 0

    def config(self) -> dict:
        from ..tiny_models import tiny_config
        return tiny_config("qwen_image", **self.size)

    def digest(self) -> str:
        here = pathlib.Path(__file__).parent
        sources = b"".join((here / name).read_bytes() for name in ("demo_training.py", "shapes.py"))
        recipe = json.dumps([asdict(self), self.config()], sort_keys=True, default=list).encode()
        return hashlib.sha256(recipe + sources).hexdigest()[:12]


def recipe_of(preset) -> Recipe:
    """The recipe of a trained preset: its model size, pictures as large as its latent shows."""
    if preset.width != preset.height:
        raise ValueError(f"preset {preset.name!r}: the shapes are drawn on square pictures")
    return Recipe(size=dict(preset.size), image_size=preset.height // 8 * shapes.PIXELS_PER_LATENT)


def trained_checkpoint(recipe: Recipe, cache_dir: str, name: str, progress: Optional[ProgressFn] = None) -> str:
    """Path of the recipe's checkpoint in cache_dir, trained and written first when it is not there yet."""
    path = os.path.abspath(os.path.join(cache_dir, f"{name}-trained-{recipe.digest()}.safetensors"))
    if os.path.exists(path):
        return path
    from safetensors.torch import save_file

    from ..tiny_models import original_state_dict
    model, summary = train(recipe, progress)
    os.makedirs(cache_dir, exist_ok=True)
    partial = path + f".{os.getpid()}.partial"
    save_file({key: value.contiguous() for key, value in original_state_dict("qwen_image", model).items()},
              partial, metadata={METADATA_KEY: json.dumps(summary)})
    os.replace(partial, path)  # concurrent runs never see a half-written file
    return path


def training_summary(path: str) -> dict:
    """The summary train() returned for the checkpoint at path (loss curve, time, threads)."""
    from safetensors import safe_open
    with safe_open(path, "pt") as handle:
        return json.loads((handle.metadata() or {})[METADATA_KEY])


def train(recipe: Recipe, progress: Optional[ProgressFn] = None) -> tuple[torch.nn.Module, dict]:
    """Seeded, single-process training; returns the model (eval mode) and a summary of the run."""
    from diffusers import QwenImageTransformer2DModel
    threads = torch.get_num_threads()
    torch.set_num_threads(available_cores())
    started, cpu_started = time.perf_counter(), time.process_time()
    losses = []
    try:
        with torch.random.fork_rng():  # diffusers initialises from the global generator
            torch.manual_seed(recipe.seed)
            model = QwenImageTransformer2DModel.from_config(recipe.config()).train()
        generator = torch.Generator().manual_seed(recipe.seed)
        optimizer = torch.optim.AdamW(model.parameters(), lr=recipe.learning_rate, weight_decay=0.0)
        schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: _learning_rate_factor(recipe, step))
        average = [parameter.detach().clone() for parameter in model.parameters()]
        for step in range(recipe.steps):
            loss = _loss(model, recipe, generator)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            schedule.step()
            decay = min(recipe.ema_decay, (1 + step) / (10 + step))  # short memory while the weights move fast
            for kept, parameter in zip(average, model.parameters()):
                kept.lerp_(parameter.detach(), 1 - decay)
            losses.append(loss.item())
            if progress is not None:
                progress(step + 1, recipe.steps, losses[-1])
        seconds = time.perf_counter() - started
        summary = {"recipe": asdict(recipe), "digest": recipe.digest(), "seconds": round(seconds, 2),
                   "cpu_seconds": round(time.process_time() - cpu_started, 2), "threads": torch.get_num_threads(),
                   "loss": loss_curve_summary(losses)}
    finally:
        torch.set_num_threads(threads)
    with torch.no_grad():
        for parameter, kept in zip(model.parameters(), average):
            parameter.copy_(kept)
    return model.eval().requires_grad_(False), summary


def _learning_rate_factor(recipe: Recipe, step: int) -> float:
    """Linear warm-up, then cosine decay to a tenth."""
    if step < recipe.warmup_steps:
        return (step + 1) / recipe.warmup_steps
    progress = (step - recipe.warmup_steps) / max(1, recipe.steps - recipe.warmup_steps)
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))


def _loss(model, recipe: Recipe, generator: torch.Generator) -> torch.Tensor:
    """Rectified flow: x_s = (1 - s) x_0 + s noise, the model predicts noise - x_0 (ComfyUI's Qwen-Image velocity)."""
    batch = recipe.batch
    shape_ids = torch.randint(len(shapes.SHAPES), (batch,), generator=generator)
    colour_ids = torch.randint(len(shapes.COLOURS), (batch,), generator=generator)
    clean = shapes.encode(shapes.draw(shape_ids, colour_ids, recipe.image_size, generator))
    noise = torch.randn(clean.shape, generator=generator)
    sigma = torch.sigmoid(torch.randn(batch, generator=generator))  # logit-normal, as SD3 trains rectified flow
    sigma = recipe.timestep_shift * sigma / (1 + (recipe.timestep_shift - 1) * sigma)
    noisy = (1 - sigma[:, None, None, None, None]) * clean + sigma[:, None, None, None, None] * noise
    context = shapes.context(shape_ids, colour_ids, model.config.joint_attention_dim)
    return torch.nn.functional.mse_loss(velocity(model, noisy, sigma, context), noise - clean)


def velocity(model, latent: torch.Tensor, sigma: torch.Tensor, context: torch.Tensor) -> torch.Tensor:
    """diffusers' own forward with ComfyUI's calling convention ([B, C, 1, H, W] latent, sigma as the timestep), with
    gradients (the family's reference_forward is the same call under no_grad)."""
    from sp_runtime.sp.tokens import reference_pack, reference_unpack
    tokens, grid = reference_pack(latent[:, :, 0], 2)
    out = model(hidden_states=tokens, encoder_hidden_states=context, timestep=sigma,
                img_shapes=[[(1, grid.rows, grid.cols)]] * latent.shape[0], return_dict=False)[0]
    return reference_unpack(out, grid)[:, :, None]


def loss_curve_summary(losses: list[float], points: int = 10) -> dict:
    """First and last loss (means over a tenth of the run), and the mean loss of each of `points` equal stretches."""
    stretch = max(1, len(losses) // points)
    means = [sum(part) / len(part) for part in (losses[i:i + stretch] for i in range(0, len(losses), stretch))]
    return {"steps": len(losses), "first": round(means[0], 5), "last": round(means[-1], 5),
            "curve": [round(value, 5) for value in means]}


def available_cores() -> int:
    """The cores this process may run on (its CPU affinity where the OS tells it)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1
