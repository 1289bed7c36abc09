"""Stock ComfyUI vs the pool at world 1 on the same files (issue 34): step time (one diffusion-model call) and memory.

ComfyUI's own Wan 2.1 is built the way its loader builds it (convert_old_quants, detect_layer_quantization, its
mixed-precision ops with comfy-kitchen, bf16 compute) and called in this process; the pool at world 1 loads the same
file (default dtype: quantized layers kept quantized, formats.kernels choosing the matmul). Files: a bf16 file and
ComfyUI mixed-precision files of the same random weights, one format for every block Linear. The two sides are timed
in alternating rounds in one run, so machine load hits both alike; the load average and other processes' CPU share
are recorded. Tiny or small (512 wide, 1280 tokens) on CPU; full-width Wan 2.1 14B blocks on a GPU (--size full, --layers
of them).

Needs ComfyUI (COMFYUI_PATH or --comfyui) and its requirements (comfy-kitchen) in this Python.

    COMFYUI_PATH=/path/to/ComfyUI python benchmarks/bench_quant_vs_comfyui.py     # tiny, CPU: results/..._cpu.json
    COMFYUI_PATH=/path/to/ComfyUI python benchmarks/bench_quant_vs_comfyui.py --device cuda --size full --layers 4
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from sp_runtime.cli.machine import LoadMonitor, describe_machine, write_json  # noqa: E402

# diffusers sizes of the tiny writers (sp_lab.tiny_models) and the latent / text shapes of one call
SIZES = {"tiny": dict(num_attention_heads=6, attention_head_dim=16, ffn_dim=128, text_dim=32, num_layers=2),
         "small": dict(num_attention_heads=4, attention_head_dim=128, ffn_dim=2048, text_dim=512, num_layers=2),
         "full": dict(num_attention_heads=40, attention_head_dim=128, ffn_dim=13824, text_dim=4096, num_layers=2)}
CALLS = {"tiny": dict(frames=5, height=16, width=16, text_tokens=7),
         "small": dict(frames=5, height=32, width=32, text_tokens=64),  # 1280 tokens: matmuls dominate on a CPU
         "full": dict(frames=21, height=60, width=104, text_tokens=512)}  # 480p, 81 frames: 32760 tokens
# name -> ComfyUI mixed-precision format of every block Linear (None: the bf16 file)
FORMATS = {"bf16": None, "float8_e4m3fn": "float8_e4m3fn", "int8_tensorwise": "int8_tensorwise",
           "int8_convrot": "int8_tensorwise convrot", "mxfp8": "mxfp8", "nvfp4": "nvfp4"}
DEFAULT_FORMATS = "bf16,float8_e4m3fn,int8_convrot,int8_tensorwise"
MIB = 2 ** 20


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--comfyui", default=os.environ.get("COMFYUI_PATH"), help="ComfyUI checkout (COMFYUI_PATH)")
    parser.add_argument("--device", default="cpu", help="cpu or cuda[:i]")
    parser.add_argument("--size", choices=sorted(SIZES), default="tiny")
    parser.add_argument("--layers", type=int, default=None, help="Wan blocks (default: the size's)")
    parser.add_argument("--formats", default=DEFAULT_FORMATS, help=f"comma-separated: {', '.join(FORMATS)}")
    parser.add_argument("--rounds", type=int, default=5, help="alternating timed calls per side (after 1 warm-up)")
    parser.add_argument("--fp8-compute", action="store_true",
                        help="fp8 matmuls on a CPU too: ComfyUI as with --supports-fp8-compute, the pool's "
                             "quant_kernels=all")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    unknown = set(args.formats.split(",")) - set(FORMATS)
    if unknown:
        parser.error(f"--formats: unknown {sorted(unknown)}; known: {', '.join(FORMATS)}")
    if not args.comfyui or not os.path.isfile(os.path.join(args.comfyui, "comfy", "ops.py")):
        parser.error("needs a ComfyUI checkout: set COMFYUI_PATH or pass --comfyui")
    args.out = args.out or os.path.join(ROOT, "benchmarks", "results", f"quant_vs_comfyui_{args.size}_"
                                        f"{'cpu' if args.device == 'cpu' else 'gpu'}.json")
    return args


def import_comfyui(path: str, device: str):
    """ComfyUI's core on sys.path first (CPU mode for a CPU run); returns comfy.model_management."""
    sys.path.insert(0, path)
    import comfy.cli_args
    comfy.cli_args.args.cpu = device == "cpu"
    import comfy.model_management
    import comfy.ops  # noqa: F401 - imports comfy.quant_ops and its comfy-kitchen backends
    return comfy.model_management


def comfy_unet_config(size: dict) -> dict:
    return dict(image_model="wan2.1", model_type="t2v", patch_size=(1, 2, 2), text_len=512, in_dim=16,
                dim=size["num_attention_heads"] * size["attention_head_dim"], ffn_dim=size["ffn_dim"], freq_dim=256,
                text_dim=size["text_dim"], out_dim=16, num_heads=size["num_attention_heads"],
                num_layers=size["num_layers"], window_size=(-1, -1), qk_norm=True, cross_attn_norm=True, eps=1e-6)


def comfy_model(path: str, size: dict, device: torch.device, fp8_compute: bool):
    """ComfyUI's Wan diffusion model on `device` with the file's weights, as its UNET loader makes it."""
    import comfy.model_management
    import comfy.supported_models
    import comfy.utils
    state, metadata = comfy.utils.load_torch_file(path, return_metadata=True)
    state, _ = comfy.utils.convert_old_quants(state, "", metadata=metadata)
    config = comfy.supported_models.WAN21_T2V(comfy_unet_config(size))
    config.quant_config = comfy.utils.detect_layer_quantization(state, "")
    config.set_inference_dtype(torch.bfloat16, torch.bfloat16 if config.quant_config else None)
    saved = comfy.model_management.SUPPORT_FP8_OPS
    comfy.model_management.SUPPORT_FP8_OPS = saved or fp8_compute
    try:
        model = config.get_model({})
    finally:
        comfy.model_management.SUPPORT_FP8_OPS = saved
    model.diffusion_model.load_state_dict(config.process_unet_state_dict(state), strict=False)
    return model.diffusion_model.to(device).eval()


def held_bytes(module: torch.nn.Module) -> int:
    """Bytes of a ComfyUI model's weights as stored (quantized layers: codes and scales)."""
    return sum(t.numel() * t.element_size() for t in module.state_dict().values() if isinstance(t, torch.Tensor))


def write_files(folder: str, names: list[str], size: dict) -> dict[str, str]:
    from sp_lab.tiny_models import write_tiny_checkpoint
    from sp_lab.tiny_models.quant_files import write_quantized
    head = {"ulysses_sp.head_dim": str(size["attention_head_dim"])}
    files = {}
    for name in names:
        path = os.path.join(folder, f"wan_{name}.safetensors")
        if FORMATS[name] is None:
            write_tiny_checkpoint("wan", path, dtype="bfloat16", seed=0, **size)
        else:
            write_quantized("wan", path, path + ".reference.safetensors", "comfy_quant", 0, "", head,
                            only=FORMATS[name], **size)
            os.remove(path + ".reference.safetensors")
        files[name] = path
    return files


def make_call(call: dict, size: dict, device: torch.device):
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(1, 16, call["frames"], call["height"], call["width"], generator=generator)
    context = torch.randn(1, call["text_tokens"], size["text_dim"], generator=generator)
    return x.to(torch.bfloat16), torch.tensor([500.0]), context.to(torch.bfloat16)


def measure(name: str, path: str, args, size: dict, call: dict, device: torch.device) -> dict:
    from sp_runtime.config import SPConfig
    from sp_runtime.pool import WorkerPool
    cuda = device.type == "cuda"
    x, t, context = make_call(call, size, device)
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device) if cuda else 0
    theirs = comfy_model(path, size, device, args.fp8_compute)
    comfy_inputs = (x.to(device), t.to(device), context.to(device))

    def comfy_call():
        with torch.no_grad():
            out = theirs(*comfy_inputs)
        sync()
        return out
    mode = "all" if args.fp8_compute else "auto"
    with WorkerPool(SPConfig([str(device)])) as pool:
        handle = pool.load_model(path, head_dim=size["attention_head_dim"], quant_kernels=mode)
        ours_out, theirs_out = handle(x.float(), t, context=context.float()), comfy_call()  # warm-up both
        comfy_ms, pool_ms = [], []
        for _ in range(args.rounds):  # alternating: machine load falls on both sides alike
            started = time.perf_counter()
            comfy_call()
            comfy_ms.append(1000 * (time.perf_counter() - started))
            started = time.perf_counter()
            handle(x.float(), t, context=context.float())
            pool_ms.append(1000 * (time.perf_counter() - started))
        rank = pool.status()["ranks"][0]
        result = {"file_mib": round(os.path.getsize(path) / MIB, 2),
                  "comfyui_ms": round(statistics.median(comfy_ms), 2), "pool_ms": round(statistics.median(pool_ms), 2),
                  "comfyui_rounds_ms": [round(v, 1) for v in comfy_ms], "pool_rounds_ms": [round(v, 1) for v in pool_ms],
                  "comfyui_weights_mib": round(held_bytes(theirs) / MIB, 2),
                  "pool_weights_mib": round(handle.info.weight_bytes / MIB, 2),
                  "pool_kernels": handle.info.quant_kernels,
                  "pool_peak_mib": round(rank["memory"]["peak"] / MIB, 1) if rank["memory"].get("peak") else None,
                  "output_difference": round(((ours_out.float() - theirs_out.float().cpu()).abs().max() /
                                              theirs_out.float().abs().max()).item(), 5)}
        if cuda:
            result["comfyui_peak_mib"] = round((torch.cuda.max_memory_allocated(device) - before) / MIB, 1)
    result["pool_vs_comfyui_time"] = round(result["pool_ms"] / result["comfyui_ms"], 3)
    print(f"{name:>16}: ComfyUI {result['comfyui_ms']:.1f} ms, pool {result['pool_ms']:.1f} ms "
          f"(x{result['pool_vs_comfyui_time']:.2f}); weights {result['comfyui_weights_mib']:.1f} / "
          f"{result['pool_weights_mib']:.1f} MiB; pool kernels {result['pool_kernels']}", flush=True)
    del theirs
    return result


def main(argv=None) -> int:
    args = parse_args(argv)
    management = import_comfyui(args.comfyui, args.device)
    device = torch.device(args.device)
    size = dict(SIZES[args.size], **({"num_layers": args.layers} if args.layers else {}))
    call = CALLS[args.size]
    monitor = LoadMonitor()
    names = args.formats.split(",")
    results = {}
    with tempfile.TemporaryDirectory() as folder:
        files = write_files(folder, names, size)
        for name in names:
            results[name] = measure(name, files[name], args, size, call, device)
    tokens = call["frames"] * (call["height"] // 2) * (call["width"] // 2)
    write_json(args.out, {
        "what": "one Wan 2.1 diffusion-model call, bf16 compute: stock ComfyUI (its ops, comfy-kitchen) in this "
                "process vs the pool at world 1, alternating rounds; times are medians",
        "machine": describe_machine(), "machine_load": monitor.finish(), "device": str(device),
        "comfyui": args.comfyui, "comfyui_fp8_compute": bool(management.supports_fp8_compute(device) or
                                                             args.fp8_compute),
        "model": {"family": "wan", **size}, "call": {**call, "tokens": tokens}, "rounds": args.rounds,
        "formats": results}, say=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
