"""SPModelLoader, "Load Diffusion Model (Ulysses SP)": a MODEL for the stock samplers whose every diffusion call
runs on the worker pool of the chosen devices."""
from __future__ import annotations

import os

import comfy.model_management
import comfy.utils
import folder_paths
from comfy_api.latest import io

from sp_runtime.config import config_from_inputs
from sp_runtime.contract import Cancelled

from .comfy_model import build_sp_model, comfy_model_config, weight_shapes
from .model_spec import ModelSpec
from .pool_owner import OWNER
from .proxy import SPDiffusionModel
from .ram_cache import warn_if_cache_pressure

WEIGHT_DTYPES = ["default", "fp32", "bf16", "fp16", "fp8_e4m3fn", "fp8_e5m2"]
ATTENTION_BACKENDS = ["sdpa", "auto", "flash", "flash2", "flash3", "sage"]  # what the workers accept (load option)
CATEGORY = "Ulysses SP"
EXTRA_EXTENSIONS = (".gguf",)  # loaded by the workers; ComfyUI's own file list for diffusion_models leaves them out


def model_files() -> list[str]:
    """Files of models/diffusion_models and models/unet: ComfyUI's list plus .gguf files."""
    names = set(folder_paths.get_filename_list("diffusion_models"))
    for folder in folder_paths.get_folder_paths("diffusion_models"):
        for root, _, files in os.walk(folder, followlinks=True):
            names.update(os.path.relpath(os.path.join(root, name), folder) for name in files
                         if name.lower().endswith(EXTRA_EXTENSIONS))
    return sorted(names)


def progress_reporter(bar: "comfy.utils.ProgressBar"):
    """A pool progress callback that drives a node's progress bar and never raises into the pool."""
    def report(fraction: float, message: str = "") -> None:
        try:
            bar.update_absolute(max(0, min(100, round(float(fraction) * 100))))
        except comfy.model_management.InterruptProcessingException:
            pass  # a load finishes on every rank together; the cancel is raised once it has
    return report


def load_cancellable(spec: ModelSpec, progress):
    """OWNER.load that ComfyUI's Cancel stops at the workers' next tensor (ComfyUI's own interrupt is raised)."""
    try:
        handle = OWNER.load(spec, progress=progress, should_cancel=comfy.model_management.processing_interrupted)
    except Cancelled:
        comfy.model_management.throw_exception_if_processing_interrupted()
        raise
    comfy.model_management.throw_exception_if_processing_interrupted()
    return handle


def load_sp_model(spec: ModelSpec):
    """Load spec's model in its pool (with a progress bar) and wrap it as a ComfyUI MODEL."""
    handle = load_cancellable(spec, progress_reporter(comfy.utils.ProgressBar(100)))
    info, header = handle.info, handle.request.header
    config = comfy_model_config(header, info)
    proxy = SPDiffusionModel(spec, info, weight_shapes=weight_shapes(header, config))
    proxy.handle = handle  # its calls go to the loaded model, reading no file (PoolOwner.serving)
    warn_if_cache_pressure(handle.pool.worker_pids)
    return build_sp_model(config, proxy, proxy.dtype)


def pool_inputs() -> list:
    """The inputs every SP loader shares after its file choice: weight dtype, devices, degrees and options."""
    return [
        io.Combo.Input("weight_dtype", options=WEIGHT_DTYPES, default="default",
                       tooltip="Weight dtype in the workers; default keeps the file's own (fp8 files "
                               "stay fp8, quantized files (scaled fp8, mixed precision, GGUF) stay "
                               "quantized; both compute in bf16). fp32 / bf16 / fp16 dequantize once."),
        io.String.Input("devices", default="auto",
                        tooltip="'auto' = every visible GPU; GPU indices such as '0,1,2,3' or '0-3'; "
                                "'cpu:2' = two CPU workers."),
        io.Int.Input("ulysses_degree", default=0, min=0, max=64,
                     tooltip="Ranks that split each sequence with Ulysses all-to-all; 0 = all devices "
                             "left after ring and CFG."),
        io.Int.Input("ring_degree", default=1, min=1, max=64,
                     tooltip="Ring-attention groups (for more devices than heads)."),
        io.Boolean.Input("cfg_parallel", default=False,
                         tooltip="Run cond and uncond on two halves of the devices (needs CFG > 1)."),
        io.Combo.Input("attention", options=ATTENTION_BACKENDS, default="sdpa", optional=True,
                       tooltip="Attention kernel in the workers: sdpa (torch, default); flash / flash2 / "
                               "flash3 (flash-attn, must be installed); sage (SageAttention, approximate); "
                               "auto = flash-attn if installed, else sdpa."),
        io.Boolean.Input("fp8_exchange", default=False, optional=True,
                         tooltip="Send the Ulysses all-to-alls as 8-bit (q, k, v) and 12-bit (output) "
                                 "codes with per-token scales: about 0.55 of the bf16 bytes (helps over PCIe), "
                                 "error within 1.5x of bf16's own."),
        io.Boolean.Input("compile", default=False, optional=True,
                         tooltip="torch.compile the transformer blocks in the workers (the first step "
                                 "compiles, minutes)."),
        io.Boolean.Input("shard_weights", default=False, optional=True,
                         tooltip="Use when the model is bigger than one card: each device keeps 1/N of "
                                 "every transformer block (N = all devices) and gathers a block from the "
                                 "others just before it runs (the next one meanwhile), so weight memory "
                                 "per device is about 1/N of the blocks plus two blocks in flight. Cost: "
                                 "each step moves (N-1)/N of the block weights to every device, e.g. "
                                 "Flux dev bf16 on 4 GPUs ~17 GB per device per step (~0.7 s over PCIe "
                                 "4.0 x16, far less over NVLink). Results are unchanged."),
        io.Int.Input("tensor_parallel_degree", default=1, min=1, max=8, optional=True,
                     tooltip="Tensor parallelism: each group of this many neighbouring devices splits every "
                             "transformer block's weights (heads and MLP) between them, so weight memory per "
                             "device is about 1/T; two all-reduces of the activations per block instead of "
                             "shard_weights' weight gathers (less traffic for images, more for long videos). "
                             "Combines with ulysses_degree, ring_degree and cfg_parallel (devices = their "
                             "product). Float files (quantized files are refused); T must divide the heads."),
    ]


def sp_model_spec(path: str, weight_dtype: str, devices: str, ulysses_degree: int, ring_degree: int,
                  cfg_parallel: bool, attention: str = "sdpa", fp8_exchange: bool = False,
                  compile: bool = False, shard_weights: bool = False, tensor_parallel_degree: int = 1) -> ModelSpec:
    """The ModelSpec the pool_inputs() values ask for (options left at their defaults are not named)."""
    config = config_from_inputs(devices, ulysses_degree, ring_degree, cfg_parallel,
                                tensor_parallel_degree=tensor_parallel_degree)
    options = {"attention": attention, "fp8_exchange": fp8_exchange, "compile": compile,
               "shard_weights": shard_weights}
    defaults = {"attention": "sdpa", "fp8_exchange": False, "compile": False, "shard_weights": False}
    return ModelSpec.create(config, path, weight_dtype, {k: v for k, v in options.items() if v != defaults[k]})


class SPModelLoader(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="SPModelLoader",
            display_name="Load Diffusion Model (Ulysses SP)",
            category=CATEGORY,
            description="Loads a diffusion model into a pool of worker processes (one per device) that run each "
                        "denoising step with Ulysses sequence parallelism. Connect the MODEL to the stock KSampler.",
            inputs=[
                io.Combo.Input("unet_name", options=model_files(),
                               tooltip="A file from ComfyUI's models/diffusion_models (or unet) folder: "
                                       ".safetensors (float, fp8, scaled fp8, mixed precision) or .gguf."),
                *pool_inputs(),
            ],
            outputs=[io.Model.Output()],
        )

    @classmethod
    def execute(cls, unet_name, **pool_values) -> io.NodeOutput:
        path = folder_paths.get_full_path_or_raise("diffusion_models", unet_name)
        return io.NodeOutput(load_sp_model(sp_model_spec(path, **pool_values)))
