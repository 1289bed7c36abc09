"""The "synthetic" family: a real family's architecture with random weights drawn on each worker's own device.

Benchmarks of the full-size shapes (Qwen-Image 20B, Flux 12B, Wan 14B) need no checkpoint: the host writes a
small spec file (no tensors; safetensors metadata names the family, its diffusers config, a seed and a dtype) and
each worker builds the empty model, draws every weight on its device from a seeded generator, and runs the
family's own sequence-parallel forward. Ranks compare a checksum of their weights and take rank 0's when they
differ (generators of different GPU models need not agree).
"""
from __future__ import annotations

import json
import math
from typing import Optional

import torch

from sp_runtime.checkpoints.header import FAMILY_METADATA_KEY, Header
from sp_runtime.checkpoints.loading import ProgressFn
from sp_runtime.cli.model_shapes import model_class, with_tuples
from sp_runtime.contract import Detection, LoadRequest

FAMILY = "synthetic"
DESCRIPTION = ""  # benchmark specs: not listed among the supported families


def write_spec(path: str, family: str, config: dict, seed: int = 0, dtype: str = "bfloat16") -> str:
    """Write the spec file of a random-weight model (a safetensors file without tensors)."""
    from safetensors.torch import save_file
    spec = {"family": family, "config": config, "seed": seed, "dtype": dtype}
    save_file({}, path, metadata={FAMILY_METADATA_KEY: FAMILY, "ulysses_sp.config": json.dumps(spec, default=list)})
    return path


def detect(header: Header) -> Optional[Detection]:
    """A spec file written by write_spec: its metadata holds the real family, config, seed and dtype."""
    if header.metadata.get(FAMILY_METADATA_KEY) != FAMILY:
        return None
    return Detection(family=FAMILY, config=json.loads(header.metadata.get("ulysses_sp.config", "{}")),
                     files=(header.path,))


def family_worker(family: str, model, config: dict, dtypes):
    """The family's worker around a built model, made by the family's own worker_from_model (as its load() does)."""
    from sp_runtime.families import family_module
    module = family_module(family)  # qwen_image (one variant for every config), flux, wan or hunyuan_video
    if family == "hunyuan_video":  # built with token-replace blocks, as its loader builds them
        return module.MODEL.worker(model, Detection(family=family, layout="diffusers", config=config), dtypes, {})
    variant = module.VARIANT_IMAGE if family == "qwen_image" else module.variant_of(config)
    detection = Detection(family=family, variant=variant, layout="diffusers", config=config)
    return module.worker_from_model(model, detection, dtypes, {})


def build_model(family: str, config: dict, dtype: str, device: torch.device, seed: int = 0,
                progress: Optional[ProgressFn] = None):
    """An eval-mode diffusers model of the family with seeded random weights on `device`; returns (model, dtypes)."""
    from sp_runtime.checkpoints.loading import build_empty_model, choose_dtypes, move_buffers, target_dtypes
    config = with_tuples(config)
    dtypes = choose_dtypes(dtype)
    model = build_empty_model(model_class(family), config, dtypes)
    targets = target_dtypes(model, dtypes)
    parameters = list(model.named_parameters())
    for index, (name, parameter) in enumerate(parameters):
        module_name, _, attribute = name.rpartition(".")
        module = model.get_submodule(module_name)
        values = random_weight(name, tuple(parameter.shape), device, seed + index).to(targets[name])
        module._parameters[attribute] = torch.nn.Parameter(values, requires_grad=False)
        if progress is not None:
            progress((index + 1) / len(parameters), f"drawing random weights ({family})")
    move_buffers(model, device)  # init_empty_weights left the (real) buffers on the CPU
    return model.eval().requires_grad_(False), dtypes


def random_weight(name: str, shape: tuple[int, ...], device: torch.device, seed: int) -> torch.Tensor:
    """Seeded values of a sane scale, the rule of tiny_models.randomize_: matrices 1/sqrt(fan-in), norms near 1."""
    generator = torch.Generator(device=device).manual_seed(seed)
    noise = torch.randn(shape, generator=generator, device=device, dtype=torch.float32)
    if len(shape) >= 2:
        return noise.div_(math.sqrt(shape[1]))
    if "norm" in name:
        return noise.mul_(0.1).add_(1.0)
    return noise.mul_(0.1)


def agree_across_ranks(model: torch.nn.Module, groups) -> bool:
    """Make every rank hold rank 0's weights; returns True when they already did (checksums equal)."""
    import torch.distributed as dist
    if groups is None or groups.control_group is None:
        return True
    total = sum(float(p.detach().float().sum().item()) for p in model.parameters())
    sums = torch.tensor([total, -total], dtype=torch.float64)
    dist.all_reduce(sums, op=dist.ReduceOp.MAX, group=groups.control_group)
    if float(sums[0]) == -float(sums[1]):
        return True
    for parameter in model.parameters():  # the default group: NCCL on GPUs, gloo on CPUs
        dist.broadcast(parameter.data, src=0)
    return False


def load(request: LoadRequest, detection: Detection, device: torch.device, groups, progress: ProgressFn):
    """The pool's entry point (registered as family "synthetic" by sp_lab.families.register_lab_families)."""
    spec = detection.config
    family, config = spec["family"], dict(spec["config"])
    dtype = spec.get("dtype", "bfloat16") if request.dtype == "default" else request.dtype
    model, dtypes = build_model(family, config, dtype, device, int(spec.get("seed", 0)), progress)
    agree_across_ranks(model, groups)
    return family_worker(family, model, config, dtypes)
