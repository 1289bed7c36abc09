"""Tensor parallelism (a fourth axis, innermost) beyond the conformance suite (which runs every family at TP 2, and
TP 4 / TP 2 x Ulysses 2 / Ring 2 / CFG 2 on a subset: test_family_conformance.test_fp32_parity_tensor_parallel):
LoRAs, bf16 / fp8 storage and quantized files at TP, the families outside the suite (MiniMax H3, Wan variants), slice
loading, and what TP cannot split refused by name."""
from __future__ import annotations

import pytest
import torch

from family_support import assert_parity
from sp_lab.references import reference_forward
from sp_lab.tiny_models import COMFY_PREFIX, write_tiny_checkpoint
from sp_lab.tiny_models.quant_files import write_quantized
from sp_runtime.config import SPConfig
from sp_runtime.pool import WorkerPool
from test_minimax_h3 import _check as mm_check, mm_files, mm_references  # noqa: F401 (fixtures)
from test_wan_conditioning import (humo_cases, humo_path, humo_references, humo_model, vace_cases,  # noqa: F401
                                   vace_files, vace_model, vace_references)

SEED = 5
pytest_plugins = ["family_pools"]  # tp_pool: the TP layouts the conformance suite runs every family on
on_tp2 = pytest.mark.parametrize("tp_pool", ["tp2"], indirect=True)
on_tp4 = pytest.mark.parametrize("tp_pool", ["tp4"], indirect=True)


@on_tp2
def test_lora_at_tp2_equals_the_merged_checkpoint(tp_pool, tmp_path):
    """A LoRA (Flux's fused qkv, kohya names) is added to the full base weight and each rank keeps its slice: the
    result equals a checkpoint merged by hand; [] gives the base back bitwise."""
    from safetensors.torch import load_file
    from test_lora import STRENGTH, make_deltas, merged_state, relative, run, save_like, write_lora
    layout, pool = tp_pool
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


@on_tp4
def test_what_tp_cannot_split_is_refused_by_name(tp_pool, tmp_path):
    layout, pool = tp_pool
    few_heads = write_tiny_checkpoint("flux", str(tmp_path / "heads.safetensors"), seed=1, num_attention_heads=3)
    with pytest.raises(Exception, match="tensor_parallel_degree=4 cannot split the 3 attention heads of "
                                        "transformer_blocks.0.attn over 4 ranks"):
        pool.load_model(few_heads)
    for fmt, only, name, what in (("comfy_quant", "int8_tensorwise convrot", "safetensors", "convrot rotation"),
                                  ("gguf", "Q4_K", "gguf", "GGUF Q4_K")):
        quantized = str(tmp_path / f"{fmt}.{name}")
        write_quantized("flux", quantized, str(tmp_path / "reference.safetensors"), fmt, seed=1, only=only,
                        num_attention_heads=8)
        with pytest.raises(Exception, match=f"tensor_parallel_degree=4 cannot split .*: its {what} groups of "
                                            f"(64|256) input features would be cut at"):
            pool.load_model(quantized)
    with pytest.raises(Exception, match="tensor_parallel_degree=4 with shard_weights"):
        pool.load_model(few_heads, shard_weights=True)


def test_grouped_heads_without_key_value_splits_are_refused_by_name():
    """A plan that splits grouped key / value projections by columns (no KEY_VALUE) at a degree that does not divide
    both head counts: refused before anything is cut (every family declares KEY_VALUE now: a bare module here)."""
    from diffusers.models.attention_processor import Attention
    from sp_runtime.sp.tensor_parallel import GENERIC, parallelize
    block = torch.nn.Module()
    block.attn = Attention(query_dim=72, heads=6, kv_heads=2, dim_head=12)
    model = torch.nn.Module()
    model.blocks = torch.nn.ModuleList([block])
    with pytest.raises(ValueError, match="tensor_parallel_degree=4 does not divide the 6 query and 2 key / value "
                                         "heads of blocks.0.attn \\(grouped-query attention"):
        parallelize(model, ["blocks"], GENERIC, None, 0, 4)


@on_tp2
def test_low_precision_storage_at_tp2_within_bf16_rounding(tp_pool, tmp_path):
    """bf16 and fp8 storage (diffusers' layerwise casting hooks wrap the split Linears' forward: a split that did not
    re-point them left the all-reduce out, 0.98 of the scale off) against the same file run in-process."""
    from sp_runtime.families import flux
    layout, pool = tp_pool
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


@on_tp2
def test_compiled_blocks_at_tp2_equal_eager(tp_pool, tmp_path):
    """compile=True at TP 2: the blocks' all-reduces (row-parallel attention output / MLP / Flux's single-block
    proj_out) and all-gathers (split modulation) traced into the graphs as functional collectives, equal to the eager
    TP 2 output (aot_eager: the same graphs dynamo and AOT autograd trace, compiled in seconds, not inductor's C++)."""
    layout, pool = tp_pool
    g = torch.Generator().manual_seed(3)
    x, t = torch.randn(2, 16, 9, 7, generator=g), torch.tensor([0.5, 0.25])
    inputs = {"context": torch.randn(2, 9, 32, generator=g), "y": torch.randn(2, 24, generator=g),
              "guidance": torch.tensor([3.5, 3.5])}
    path = write_tiny_checkpoint("flux", str(tmp_path / "flux.safetensors"), seed=SEED, num_layers=1,
                                 num_single_layers=1)
    handle = pool.load_model(path, "float32")
    want = handle(x, t, **inputs)
    handle.unload()
    handle = pool.load_model(path, "float32", compile=True, compile_backend="aot_eager")
    for _ in range(2):  # the first call compiles, the second reuses the graphs
        assert_parity(handle(x, t, **inputs), want, "float32", f"tp/{layout}/flux/compiled")
    handle.unload()


# quantized files at TP 2: (format, only): per-tensor and per-row scaled fp8, int8, mxfp8 / nvfp4 blocks, GGUF blocks
QUANTIZED = (("scaled_fp8", None), ("comfy_quant", "int8_tensorwise"), ("comfy_quant", "mxfp8"),
             ("comfy_quant", "nvfp4"), ("gguf", "Q8_0"))


@on_tp2
def test_quantized_files_at_tp2_equal_world_1(tp_pool, tmp_path):
    """Kept quantized, split along their rows / whole input groups: the same file's output at world 1 (bf16 compute,
    as quantized files run), within bf16 rounding; a LoRA on the split quantized layers (per-tensor fp8, GGUF) equals
    the same file and LoRA on one device, [] gives the file's output back bitwise."""
    from sp_runtime.families import flux
    layout, pool = tp_pool
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
        if fmt in ("scaled_fp8", "gguf"):  # a LoRA on the split quantized layers: each rank its share of the factors
            lora = _flux_lora(str(tmp_path / "reference.safetensors"), str(tmp_path / "lora.safetensors"))
            pool.set_loras(handle, [[lora, 1.0]])
            with WorkerPool(SPConfig(["cpu"])) as single:  # the same file and LoRA on one device
                whole = single.load_model(path)
                single.set_loras(whole, [[lora, 1.0]])
                want = whole(x, t, **inputs)
            assert (want - got).abs().max() > 0.05 * want.abs().max(), "the LoRA changes nothing"
            assert_parity(handle(x, t, **inputs), want, "bfloat16", f"tp/{layout}/flux/{fmt}/lora")
            pool.set_loras(handle, [])
            assert torch.equal(handle(x, t, **inputs), got)
        handle.unload()


@on_tp2
def test_stock_lora_patches_on_split_quantized_layers_at_tp2(tp_pool, tmp_path):
    """ComfyUI's weight patches (what the stock LoRA nodes send) on quantized layers split by TP 2: additive ones
    (a LoRA at an offset into the fused qkv and on the whole single-block linear1: column-parallel; a LoRA on the
    attention output, a LoHa on the MLP's second layer and a diff on linear2: row-parallel, the last two full
    differences; a LoKr on the split modulation) kept as unmerged terms, each rank its rows / columns of them: equal
    to the same file and patches on one device (bf16 compute, as quantized files run); [] gives the file's output
    back bitwise. An OFT (it needs the whole weight) is refused by name, the weights left as they were. Each patch
    alone moves the output by 0.1-1.1 of its scale (bf16: 1e-2 rounding at TP 2 against one device with or without
    them; with float32 compute forced in the workers, off-test: 6e-7)."""
    from safetensors.torch import load_file
    from patch_reference import random_patch
    from sp_runtime.lora.patch_set import PatchSet, TargetPatches
    layout, pool = tp_pool
    path, reference_path = str(tmp_path / "fp8.safetensors"), str(tmp_path / "reference.safetensors")
    write_quantized("flux", path, reference_path, "scaled_fp8", seed=SEED, num_attention_heads=4)
    shapes = {key: tuple(value.shape) for key, value in load_file(reference_path).items()}
    width = shapes["double_blocks.0.img_attn.proj.weight"][0]

    def patch(key, kind, seed, **scalars):
        shape = (scalars["offset"][2], shapes[key][1]) if "offset" in scalars else shapes[key]
        return key, TargetPatches(shapes[key], (random_patch(kind, shape, seed, **scalars),))
    patches = PatchSet(dict((
        patch("double_blocks.0.img_attn.qkv.weight", "lora", 1, strength=1.5, alpha=2.0, offset=(0, width, width)),
        patch("double_blocks.0.img_attn.proj.weight", "lora", 2, strength=1.5),
        patch("double_blocks.0.img_mlp.2.weight", "loha", 3, strength=-3.0),
        patch("double_blocks.0.img_mod.lin.weight", "lokr", 4, strength=1.0),
        patch("single_blocks.0.linear1.weight", "lora", 5, strength=1.5),
        patch("single_blocks.0.linear2.weight", "diff", 6, strength=4.0))))
    g = torch.Generator().manual_seed(3)
    x, t = torch.randn(2, 16, 9, 7, generator=g), torch.tensor([0.5, 0.25])
    inputs = {"context": torch.randn(2, 9, 32, generator=g), "y": torch.randn(2, 24, generator=g),
              "guidance": torch.tensor([3.5, 3.5])}
    with WorkerPool(SPConfig(["cpu"])) as single:  # the same file and patches on one device
        whole = single.load_model(path)
        single.set_loras(whole, [], patches=patches)
        want = whole(x, t, **inputs)
    handle = pool.load_model(path)
    assert handle.info.quant
    plain = handle(x, t, **inputs).clone()
    assert (want - plain).abs().max() > 0.05 * want.abs().max(), "the patches change nothing"
    pool.set_loras(handle, [], patches=patches)
    assert_parity(handle(x, t, **inputs), want, "bfloat16", f"tp/{layout}/flux/fp8/patches")
    key, target = patch("double_blocks.0.img_mlp.0.weight", "oft", 9, strength=0.5)
    with pytest.raises(Exception, match="ComfyUI weight patches \\(oft\\) on the split quantized layer "
                                        "transformer_blocks.0.ff.net.0.proj.weight at tensor parallelism"):
        pool.set_loras(handle, [], patches=PatchSet({key: target}))
    pool.set_loras(handle, [])
    assert torch.equal(handle(x, t, **inputs), plain)
    handle.unload()


def _flux_lora(reference: str, path: str) -> str:
    from safetensors.torch import load_file
    from test_lora import make_deltas, write_lora
    return write_lora(path, "flux", make_deltas("flux", load_file(reference), seed=7), "kohya")


@on_tp2
def test_minimax_h3_at_tp2(tp_pool, mm_files, mm_references):
    """Outside the conformance suite (packed calls): every file form, 3 heads shared out 2 / 1."""
    for variant in mm_files:
        mm_check(tp_pool[1], "tp2", mm_files[variant], mm_references, variant)


@on_tp2
def test_wan_variants_at_tp2(tp_pool, vace_files, vace_references, humo_path, humo_references):
    """VACE (its hint blocks split like the main blocks) and HuMo (its own audio attention left whole), 3 heads."""
    pool = tp_pool[1]
    for variant, path, cases, references in (("vace", vace_files["comfy_prefix"], vace_cases(), vace_references),
                                             ("humo", humo_path, humo_cases(), humo_references)):
        handle = pool.load_model(path)
        assert handle.info.variant == variant
        for name, (x, t, inputs) in cases.items():
            assert_parity(handle(x, t, **inputs), references[name], "float32", f"tp/tp2/{variant}/{name}")
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


@on_tp4
def test_grouped_query_attention_at_tp4(tp_pool, family_subject):
    """Key / value heads the degree does not divide are kept whole (KEY_VALUE) and each rank's query heads read
    theirs: Krea 2's 5 query heads over 1 (2 / 1 / 1 / 1), HiDream-O1's 6 over 2 (2 / 2 / 1 / 1: a group of 3 cut
    across ranks; at TP 2 the suite checks its key / value heads split), Lumina 2's, OmniGen2's and Boogu's 6 over 2
    (Boogu's joint attention with its per-stream projections too)."""
    layout, pool = tp_pool
    for name in ("krea2", "hidream_o1", "lumina2", "omnigen2", "boogu"):
        subject = family_subject(name)
        handle = pool.load_model(subject.path, **subject.spec.load_options)
        for case, (x, t, inputs) in subject.spec.cases().items():
            assert_parity(handle(x, t, **inputs), subject.outputs[case], "float32", f"{name}_{layout}/{case}")
        handle.unload()


@pytest.mark.parametrize("tp_pool", ["u2tp2", "r2tp2"], indirect=True)
def test_seedvr2_windows_with_tp_and_sequence_parallel(tp_pool, family_subject):
    """SeedVR2's custom windowed block (keys / values all-gathered over the sequence ranks) with its heads split by
    TP 2 (3 heads: 2 / 1) under Ulysses 2 and Ring 2."""
    layout, pool = tp_pool
    subject = family_subject("seedvr2")
    handle = pool.load_model(subject.path, **subject.spec.load_options)
    cases = subject.spec.cases()
    for case in subject.spec.layout_cases:
        x, t, inputs = cases[case]
        assert_parity(handle(x, t, **inputs), subject.outputs[case], "float32", f"seedvr2_{layout}/{case}")
    handle.unload()
