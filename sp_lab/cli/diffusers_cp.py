"""The benchmark's side-by-side: diffusers' built-in context parallel (`enable_parallelism` with Ulysses) on the same
weights, the same devices and the same latent size, timed per call of diffusers' stock forward.

diffusers builds its device mesh from torch.accelerator.device_count(), which is 0 on a CPU-only machine; its
Ulysses runs over gloo when that count is patched to the world size inside these (spawned, diffusers-only) ranks,
so CPU runs get the side-by-side too. Its calls use diffusers' own input convention (packed tokens, diffusers'
position ids), so only times are compared, not outputs. Its Ulysses needs the tokens and heads divisible by the
degree (our ranks do not); where they are not, its error is reported.
"""
from __future__ import annotations

import statistics

import torch


def skip_reason(devices) -> str | None:
    if not hasattr(torch, "accelerator"):
        return f"torch {torch.__version__} has no torch.accelerator, which diffusers' context parallel uses"
    if devices[0].startswith("cuda") and torch.accelerator.device_count() == 0:
        return "torch.accelerator sees no device"
    return None


def side_by_side(plan, info, workload, args, rows: list[dict]) -> dict:
    """Per Ulysses degree measured by the bench: diffusers' step time and ours."""
    reason = skip_reason(plan.devices)
    if reason or workload is None:
        return {"skipped": reason or "the baseline layout did not run"}
    from sp_runtime.cli.linkprobe import run_ranks
    path = plan.checkpoint or _preset_path(plan, args)
    results = []
    for row in rows:
        if row["ring_degree"] > 1 or row["cfg_degree"] > 1 or "step" not in row:
            continue
        degree = row["world_size"]
        entry = {"layout": row["layout"], "ulysses_degree": degree}
        try:
            times = run_ranks(_cp_rank, row["devices"], path, args.dtype, workload.noise, workload.conditioning,
                              info.family, args.warmup, args.steps, timeout=1800)[0]
            summary_ms = statistics.median(times) * 1e3
            entry.update(step_ms=[round(t * 1e3, 3) for t in times], median_ms=round(summary_ms, 3),
                         ours_median_ms=row["step"]["median_ms"],
                         ours_vs_diffusers=round(summary_ms / row["step"]["median_ms"], 4))
        except (RuntimeError, TimeoutError) as error:
            entry["error"] = str(error).strip().splitlines()[-1]
        results.append(entry)
    return {"how": "diffusers' stock forward with enable_parallelism(ContextParallelConfig(ulysses_degree=N)), "
                   "native attention backend, timed on rank 0 (CUDA synchronised); on CPU over gloo with "
                   "torch.accelerator.device_count() patched to the degree inside diffusers' ranks",
            "layouts": results}


def _preset_path(plan, args) -> str:
    from .presets import materialize
    return materialize(plan.preset, args.cache_dir, synthetic=plan.preset.synthetic or args.random_init,
                       seed=args.seed)


def _cp_rank(rank: int, devices: list[str], path: str, dtype: str, noise: torch.Tensor, conditioning: dict,
             family: str, warmup: int, steps: int) -> list[float]:
    """One rank of diffusers' context parallel: build the model, enable Ulysses, time the stock forward."""
    from sp_runtime.cli.machine import device_sync, timings
    device = torch.device(devices[rank])
    model = _load(path, dtype, device)
    if len(devices) > 1:
        from diffusers import ContextParallelConfig
        if device.type == "cpu":  # diffusers divides by the accelerator count: one "device" per rank here
            torch.accelerator.device_count = lambda: len(devices)
        model.enable_parallelism(config=ContextParallelConfig(ulysses_degree=len(devices)))
    inputs = native_inputs(family, model, noise, conditioning, device)
    with torch.inference_mode():
        return timings(lambda: model(**inputs, return_dict=False), steps, warmups=warmup, sync=device_sync(device))


def _load(path: str, dtype: str, device: torch.device):
    from sp_runtime.detection import detect
    from sp_runtime.families import family
    detection = detect(path)
    if detection.family == "synthetic":
        from ..families.synthetic import build_model
        spec = detection.config
        chosen = spec.get("dtype", "bfloat16") if dtype == "default" else dtype
        return build_model(spec["family"], spec["config"], chosen, device, int(spec.get("seed", 0)))[0]
    return family(detection.family).load_model(path, dtype, device)[0]


def native_inputs(family: str, model, noise: torch.Tensor, conditioning: dict, device: torch.device) -> dict:
    """diffusers' forward arguments for ComfyUI-shaped latents and conditioning (timing only: ids simplified)."""
    from sp_runtime.sp.tokens import reference_pack
    dtype = model.proj_out.weight.dtype
    if dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        dtype = torch.bfloat16  # layerwise casting: fp8 storage, bf16 compute
    batch = noise.shape[0]
    sigma = torch.full((batch,), 0.7, device=device, dtype=dtype)
    context = conditioning["context"].to(device, dtype)
    if family == "wan":
        return {"hidden_states": noise.to(device, dtype), "timestep": sigma * 1000, "encoder_hidden_states": context}
    latent = noise[:, :, 0] if family == "qwen_image" else noise
    tokens, grid = reference_pack(latent.to(device, dtype), 2)
    if family == "qwen_image":
        return {"hidden_states": tokens, "encoder_hidden_states": context, "timestep": sigma,
                "img_shapes": [[(1, grid.rows, grid.cols)]] * batch}
    rows = torch.arange(grid.rows, device=device).repeat_interleave(grid.cols)
    cols = torch.arange(grid.cols, device=device).repeat(grid.rows)
    img_ids = torch.stack([torch.zeros_like(rows), rows, cols], dim=1).float()
    guidance = conditioning.get("guidance")
    return {"hidden_states": tokens, "encoder_hidden_states": context,
            "pooled_projections": conditioning["y"].to(device, dtype), "timestep": sigma, "img_ids": img_ids,
            "txt_ids": torch.zeros(context.shape[1], 3, device=device),
            "guidance": None if guidance is None else guidance.to(device, dtype)}
