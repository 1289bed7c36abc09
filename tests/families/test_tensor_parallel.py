"""Tensor parallelism (a fourth axis, innermost): TP 2, TP 4, TP 2 x Ulysses 2, TP 2 x Ring 2 and TP 2 x CFG 2 give
the single-device output of diffusers' stock forward (fp32, 1e-5 of the scale) for the families that declare a TP
plan, at odd token counts, batch 2 (split by CFG) and 1; weights per rank shrink; what TP cannot split is refused by
name."""
from __future__ import annotations

import pytest
import torch

from family_support import assert_parity
from sp_lab.references import reference_forward
from sp_lab.tiny_models import COMFY_PREFIX, build_tiny_model, write_tiny_checkpoint
from sp_lab.tiny_models.quant_files import write_quantized
from sp_runtime.config import SPConfig
from sp_runtime.pool import WorkerPool
from sp_lab.conformance.cases import qwen_flux_wan_cases as make_cases

SEED = 5
# layout -> (devices, degrees, families run there): a world-4 pool on 2 cores is slow, so few loads there
LAYOUTS = {"tp2": (2, dict(tensor_parallel_degree=2), ("flux", "qwen_image", "wan")),
           "tp4": (4, dict(tensor_parallel_degree=4), ("flux", "qwen_image")),
           "u2tp2": (4, dict(ulysses_degree=2, tensor_parallel_degree=2), ("qwen_image",)),
           "r2tp2": (4, dict(ulysses_degree=1, ring_degree=2, tensor_parallel_degree=2), ("flux",)),
           "cfg2tp2": (4, dict(ulysses_degree=1, cfg_degree=2, tensor_parallel_degree=2), ("flux",))}


@pytest.fixture(scope="module", params=list(LAYOUTS))
def tp_pool(request):
    world, degrees, _ = LAYOUTS[request.param]
    with WorkerPool(SPConfig(["cpu"] * world, **degrees)) as pool:
        yield request.param, pool


def heads_for(degree: int) -> int:
    """6 heads (3 per TP-2 rank, which Ulysses 2 does not divide); 8 at TP 4."""
    return 8 if degree == 4 else 6


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """(family, heads) -> (checkpoint, the references of its cases, its full weight bytes), made when first asked."""
    folder, made = tmp_path_factory.mktemp("tp"), {}

    def get(family: str, heads: int):
        if (family, heads) not in made:
            path = write_tiny_checkpoint(family, str(folder / f"{family}_{heads}.safetensors"), seed=SEED,
                                         num_attention_heads=heads)
            model = build_tiny_model(family, SEED, num_attention_heads=heads)
            refs = {name: reference_forward(family)(model, x, t, **inputs)
                    for name, (x, t, inputs) in make_cases(family).items()}
            made[family, heads] = path, refs, sum(p.numel() * p.element_size() for p in model.parameters())
        return made[family, heads]
    return get


def test_tp_equals_single_device(tp_pool, models):
    layout, pool = tp_pool
    degree = pool.config.tensor_parallel_degree
    for family in LAYOUTS[layout][2]:
        path, refs, full_bytes = models(family, heads_for(degree))
        handle = pool.load_model(path)
        for name, (x, t, inputs) in make_cases(family).items():
            assert_parity(handle(x, t, **inputs), refs[name], "float32", f"tp/{layout}/{family}/{name}")
        # the blocks' weights are split (the tiny models' embedders and heads are a larger share than at full size)
        assert handle.info.weight_bytes < full_bytes * (0.7 if degree == 2 else 0.45), family
        pool.unload(handle)


def test_lora_at_tp2_equals_the_merged_checkpoint(tp_pool, tmp_path):
    """A LoRA (Flux's fused qkv, kohya names) is added to the full base weight and each rank keeps its slice: the
    result equals a checkpoint merged by hand; [] gives the base back bitwise."""
    from safetensors.torch import load_file
    from test_lora import STRENGTH, make_deltas, merged_state, relative, run, save_like, write_lora
    layout, pool = tp_pool
    if layout != "tp2":
        pytest.skip("one layout is enough: the LoRA path does not depend on the other axes")
    base_path = write_tiny_checkpoint("flux", str(tmp_path / "base.safetensors"), seed=2, prefix=COMFY_PREFIX)
    base = {key[len(COMFY_PREFIX):]: value for key, value in load_file(base_path).items()}
    deltas = make_deltas("flux", base, seed=7)
    merged = save_like(str(tmp_path / "merged.safetensors"), base_path,
                       {COMFY_PREFIX + key: value for key, value in merged_state("flux", base, [(deltas, STRENGTH)]).items()})
    lora = write_lora(str(tmp_path / "lora.safetensors"), "flux", deltas, "kohya")
    handle = pool.load_model(merged, "fp32")
    want = run(handle, "flux")
    handle.unload()
    handle = pool.load_model(base_path, "fp32")
    plain = run(handle, "flux")
    pool.set_loras(handle, [[lora, STRENGTH]])
    assert relative(run(handle, "flux"), want) <= 1e-5
    pool.set_loras(handle, [])
    assert torch.equal(run(handle, "flux"), plain)
    handle.unload()


def test_what_tp_cannot_split_is_refused_by_name(tp_pool, tmp_path):
    layout, pool = tp_pool
    if layout != "tp4":
        pytest.skip("the refusals are checked once")
    odd_heads = write_tiny_checkpoint("flux", str(tmp_path / "heads.safetensors"), seed=1, num_attention_heads=6)
    with pytest.raises(Exception, match="tensor_parallel_degree=4 does not divide the .* of"):
        pool.load_model(odd_heads)
    for fmt, only, name, what in (("comfy_quant", "int8_tensorwise convrot", "safetensors", "convrot rotation"),
                                  ("gguf", "Q4_K", "gguf", "GGUF Q4_K")):
        quantized = str(tmp_path / f"{fmt}.{name}")
        write_quantized("flux", quantized, str(tmp_path / "reference.safetensors"), fmt, seed=1, only=only,
                        num_attention_heads=8)
        with pytest.raises(Exception, match=f"tensor_parallel_degree=4 cannot split .*: its {what} groups of "
                                            f"(64|256) input features would be cut at"):
            pool.load_model(quantized)
    with pytest.raises(Exception, match="tensor_parallel_degree=4 with shard_weights"):
        pool.load_model(odd_heads, shard_weights=True)
    with pytest.raises(Exception, match="tensor_parallel_degree=4 is not supported for 'ltx2' models"):
        pool.load_model(write_tiny_checkpoint("ltx2", str(tmp_path / "ltx2.safetensors"), seed=1))


def test_low_precision_storage_at_tp2_within_bf16_rounding(tp_pool, tmp_path):
    """bf16 and fp8 storage (diffusers' layerwise casting hooks wrap the split Linears' forward: a split that did not
    re-point them left the all-reduce out, 0.98 of the scale off) against the same file run in-process."""
    from sp_runtime.families import flux
    layout, pool = tp_pool
    if layout != "tp2":
        pytest.skip("one layout is enough")
    g = torch.Generator().manual_seed(3)
    x, t = torch.randn(2, 16, 9, 7, generator=g), torch.tensor([0.5, 0.25])  # bf16-exact timesteps
    inputs = {"context": torch.randn(2, 9, 32, generator=g), "y": torch.randn(2, 24, generator=g),
              "guidance": torch.tensor([3.5, 3.5])}
    for dtype in ("bfloat16", "float8_e4m3fn"):
        path = write_tiny_checkpoint("flux", str(tmp_path / f"{dtype}.safetensors"), dtype=dtype, seed=SEED,
                                     prefix=COMFY_PREFIX)
        want = reference_forward("flux")(flux.load_model(path)[0], x, t, **inputs)
        handle = pool.load_model(path)
        assert_parity(handle(x, t, **inputs), want, dtype, f"tp/{layout}/flux/{dtype}")
        handle.unload()


# quantized files at TP 2: (format, only): per-tensor and per-row scaled fp8, int8, mxfp8 / nvfp4 blocks, GGUF blocks
QUANTIZED = (("scaled_fp8", None), ("comfy_quant", "int8_tensorwise"), ("comfy_quant", "mxfp8"),
             ("comfy_quant", "nvfp4"), ("gguf", "Q8_0"))


def test_quantized_files_at_tp2_equal_world_1(tp_pool, tmp_path):
    """Kept quantized, split along their rows / whole input groups: the same file's output at world 1 (bf16 compute,
    as quantized files run), within bf16 rounding."""
    from sp_runtime.families import flux
    layout, pool = tp_pool
    if layout != "tp2":
        pytest.skip("one layout is enough")
    g = torch.Generator().manual_seed(3)
    x, t = torch.randn(2, 16, 9, 7, generator=g), torch.tensor([0.5, 0.25])
    inputs = {"context": torch.randn(2, 9, 32, generator=g), "y": torch.randn(2, 24, generator=g),
              "guidance": torch.tensor([3.5, 3.5])}
    for fmt, only in QUANTIZED:
        path = str(tmp_path / f"{fmt}_{only}.{'gguf' if fmt == 'gguf' else 'safetensors'}")
        write_quantized("flux", path, str(tmp_path / "reference.safetensors"), fmt, seed=SEED, only=only,
                        num_attention_heads=4)
        want = reference_forward("flux")(flux.load_model(path)[0], x, t, **inputs)
        handle = pool.load_model(path)
        assert handle.info.quant, path
        got = handle(x, t, **inputs)
        assert_parity(got, want, "bfloat16", f"tp/{layout}/flux/{fmt}/{only}")
        if fmt == "scaled_fp8":  # a LoRA on split quantized layers is refused by name; the model stays as it was
            lora = _flux_lora(str(tmp_path / "reference.safetensors"), str(tmp_path / "lora.safetensors"))
            with pytest.raises(Exception, match="a LoRA on a quantized file at tensor parallelism is not supported"):
                pool.set_loras(handle, [[lora, 1.0]])
            assert torch.equal(handle(x, t, **inputs), got)
        handle.unload()


def _flux_lora(reference: str, path: str) -> str:
    from safetensors.torch import load_file
    from test_lora import make_deltas, write_lora
    return write_lora(path, "flux", make_deltas("flux", load_file(reference), seed=7), "kohya")


# the other families with a TP plan at TP 2: (test module with make_cases, tiny size with a head count 2 divides and
# an even MLP width)
OTHER_FAMILIES = {"chroma": dict(), "sd3": dict(num_attention_heads=4, caption_projection_dim=256),
                  "flux2": dict(num_attention_heads=4), "z_image": dict(n_heads=6, dim=768),
                  "qwen_image21": dict(num_attention_heads=4), "hunyuan_video": dict(num_attention_heads=4)}


@pytest.mark.parametrize("family", list(OTHER_FAMILIES))
def test_other_families_at_tp2(tp_pool, family, tmp_path):
    import importlib
    layout, pool = tp_pool
    if layout != "tp2":
        pytest.skip("the other families run at TP 2 (the layouts' code is the same for every family)")
    module = importlib.import_module(f"test_{family}")
    cases = module.make_cases(16) if family == "hunyuan_video" else module.make_cases()
    size, seed = OTHER_FAMILIES[family], module.SEED
    path = write_tiny_checkpoint(family, str(tmp_path / f"{family}.safetensors"), seed=seed, **size)
    model = build_tiny_model(family, seed, **size)
    handle = pool.load_model(path)
    for name, (x, t, inputs) in list(cases.items())[:1]:  # one case: the layouts are covered above
        want = reference_forward(family)(model, x, t, **inputs)
        assert_parity(handle(x, t, **inputs), want, "float32", f"tp/{layout}/{family}/{name}")
    handle.unload()


def test_tp_loading_reads_only_the_rank_slices(tmp_path):
    """At TP the split weights are read after the split, as this rank's rows / columns only (also through Flux's
    ComfyUI key plan: a fused q / k / v cut into its parts): the bytes read are about half of the deferred weights',
    and every weight equals the slice of the whole model's."""
    from sp_runtime.checkpoints.deferred import deferred_loading, read_deferred
    from sp_runtime.families import flux
    from sp_runtime.families.flux.plan import PLAN
    from sp_runtime.sp.tensor_parallel import parallelize
    path = write_tiny_checkpoint("flux", str(tmp_path / "flux.safetensors"), seed=1, prefix=COMFY_PREFIX,
                                 num_attention_heads=4)
    whole = flux.load_model(path)[0].state_dict()
    with deferred_loading(True):
        model = flux.load_model(path)[0]
    deferred = dict(model._deferred_weights)
    assert all(model.get_parameter(name).is_meta for name in deferred)
    lists = [name for stage in PLAN.stages for name in (stage.blocks, *stage.also)]
    slices = parallelize(model, lists, PLAN.tensor_parallel, None, 1, 2)
    read = read_deferred(model, slices, "cpu")
    deferred_bytes = sum(whole[name].numel() * whole[name].element_size() for name in deferred)
    split_bytes = sum(whole[name].numel() * whole[name].element_size() for name in slices)
    assert read <= deferred_bytes - split_bytes / 2 + 1, (read, deferred_bytes, split_bytes)
    for name, value in model.state_dict().items():
        assert torch.equal(value, slices[name].take(whole[name]) if name in slices else whole[name]), name
