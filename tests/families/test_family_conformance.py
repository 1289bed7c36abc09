"""The conformance suite: every registered family (the product's, the lab's, and those tests register, such as
throwaway_family.py's) through the pool against its single-device reference, from what it declares in
sp_lab.conformance: its file loads in every layout it reads; fp32 parity at Ulysses 1-4, Ring 3, Ulysses 2 x Ring 2
and (sampled with CFG) Ulysses 2 x CFG 2; a ComfyUI mixed-precision file at weight dtype fp32 equals its
dequantized weights; a LoRA equals the checkpoint merged by hand, and [] gives the base back (or, for a family
without LoRA support, the LoRA is refused by name). A family's own test file keeps only what is special to it.

The families are read when this module is collected: a family registered at run time is here when its module was
imported before (throwaway_family is imported below)."""
from __future__ import annotations

import re

import pytest
import torch
from safetensors.torch import load_file, save_file

import throwaway_family  # registers the family "sd3_test" and its spec, as a plug-in family would
from family_support import assert_parity, at_worlds, relative_error
from sp_lab.conformance import CONFORMANCE, conformance, file_reference, not_yet
from sp_runtime.checkpoints.header import read_header
from sp_runtime.families import FAMILIES, family
from sp_runtime.families import __file__ as registry_file

pytest_plugins = ["family_pools"]  # the shared per-degree and per-layout worker pools

# each family with a spec (the others fail test_every_registered_family_takes_part), then its variants' specs
NAMES = [name for family_name in FAMILIES for name in CONFORMANCE if name.partition(":")[0] == family_name
         and (name == family_name or family_name in CONFORMANCE)]
RANK, ALPHA, STRENGTH = 4, 2.0, 0.7  # scale alpha / rank = 0.5: a loader that ignored alpha would be off by 2x


def test_every_registered_family_takes_part():
    """A family registered without a conformance spec fails here, naming where to declare one."""
    for name in FAMILIES:
        if name not in not_yet():
            conformance(name)
    assert not set(not_yet()) & set(CONFORMANCE), "a family with a spec is still listed as not covered yet"
    assert set(not_yet()) <= set(FAMILIES), "sp_lab.conformance lists families nobody registers"



def _family_of(item):
    callspec = getattr(item, "callspec", None)
    return callspec.params.get("name") if callspec else None


def test_a_family_registered_at_run_time_takes_part(request):
    """throwaway_family is in no list of the project: registered by a test, it gets every check of this file."""
    assert f'"{throwaway_family.FAMILY}"' not in open(registry_file).read() and throwaway_family.FAMILY in NAMES
    here = [item for item in request.session.items if str(item.path) == __file__ and _family_of(item)]
    ours = [item for item in here if _family_of(item) == throwaway_family.FAMILY]
    if not ours:
        pytest.skip("its checks are deselected in this run")
    assert {item.originalname for item in ours} == {item.originalname for item in here}


@pytest.mark.parametrize("name", NAMES)
def test_the_cases_can_fail(family_subject, name):
    """Guard: the two halves of a batch-2 call differ (a swapped or duplicated CFG half would be caught), and the
    reference output is not flat."""
    for case, out in family_subject(name).outputs.items():
        assert out.abs().max() > 0.1, (name, case)
        if out.shape[0] == 2:
            assert (out[0] - out[1]).abs().max() > 1e-2, (name, case)


@at_worlds(1)
@pytest.mark.parametrize("name", NAMES)
def test_every_file_layout_loads(family_pool, family_subject, name):
    """The same weights in each layout the family reads: loading differs between them, the forward does not."""
    subject = family_subject(name)
    for layout, write in subject.spec.other_files.items():
        subject.check(family_pool, write(str(subject.folder)), layout, cases=(subject.spec.first_case,))


@pytest.mark.parametrize("name", NAMES)
def test_fp32_parity_every_ulysses_degree(family_pool, family_subject, name):
    """Every case at degrees 1, 2 and 4; at 3 the cases the family runs on the Ring layouts (suite time)."""
    subject = family_subject(name)
    degree = family_pool.config.world_size
    cases = subject.spec.layout_cases or None if degree == 3 else None
    subject.check(family_pool, subject.path, f"degree{degree}", cases=cases)


@pytest.mark.parametrize("name", NAMES)
def test_fp32_parity_ring_hybrid_and_cfg(layout_pool, family_subject, name):
    layout, pool = layout_pool
    subject = family_subject(name)
    if layout.endswith("cfg2") and not subject.spec.cfg:
        pytest.skip(f"{name} is not sampled with CFG")
    subject.check(pool, subject.path, layout, cases=subject.spec.layout_cases or None)


def plan_refusal(name: str) -> str:
    """Why the family's plan refuses TP (its Plan.tensor_parallel as a string), or ""."""
    import importlib
    from sp_runtime.families import FAMILIES
    try:
        declared = importlib.import_module(FAMILIES[name.partition(":")[0]] + ".plan").PLAN.tensor_parallel
    except (ImportError, AttributeError):
        return ""
    return declared if isinstance(declared, str) else ""


# tensor-parallel layouts beyond TP 2 run on these families (TP 4: ones with 4 heads or more)
TP_SUBSET = {"tp4": ("qwen_image", "z_image"), "u2tp2": ("flux", "qwen_image", "wan"), "r2tp2": ("flux", "wan"),
             "cfg2tp2": ("flux", "qwen_image")}
TP_SHARE = {"hidream_o1": 0.995}  # what a TP 2 rank holds at most: its tiny file is 97% unsplit vocabulary table


@pytest.mark.parametrize("name", NAMES)
def test_fp32_parity_tensor_parallel(tp_pool, family_subject, name):
    """Every family at TP 2 (its layout cases; odd head counts shared out 2 / 1), TP 4, TP 2 x Ulysses 2 / Ring 2 /
    CFG 2 on a subset; a family that refuses TP says so in its spec and is refused by that name; the blocks' weights
    are split (each rank holds less than the whole model)."""
    layout, pool = tp_pool
    if layout != "tp2" and name not in TP_SUBSET[layout]:
        pytest.skip(f"{layout} runs on {', '.join(TP_SUBSET[layout])}")
    subject = family_subject(name)
    refusal = subject.spec.tensor_parallel or plan_refusal(name)
    if refusal:
        with pytest.raises(Exception, match=f"tensor_parallel_degree=2 is not supported for '{name}' models "
                                            f"\\({re.escape(refusal)}"):
            pool.load_model(subject.path, **subject.spec.load_options)
        return
    handle = pool.load_model(subject.path, **subject.spec.load_options)
    for case, (x, t, inputs) in subject.spec.cases().items():
        if case in (subject.spec.layout_cases or (case,)):
            assert_parity(handle(x, t, **inputs), subject.outputs[case], "float32", f"{name}_{layout}/{case}")
    whole = sum(tensor.numel() * tensor.element_size() for tensor in load_file(subject.path).values())
    assert handle.info.weight_bytes < whole * TP_SHARE.get(name, 0.97), (handle.info.weight_bytes, whole)
    handle.unload()


@at_worlds(2)
@pytest.mark.parametrize("name", NAMES)
def test_quantized_file_equals_its_dequantized_weights(family_pool, family_subject, name):
    subject = family_subject(name)
    if subject.spec.quantized is None:
        pytest.skip(f"{name} reads no quantized files")
    path, reference = str(subject.folder / "quantized.safetensors"), str(subject.folder / "dequantized.safetensors")
    subject.spec.quantized(path, reference)
    x, t, inputs = subject.spec.case()
    handle = family_pool.load_model(path, "fp32", **subject.spec.load_options)
    assert handle.info.family == name.partition(":")[0] and handle.info.quant, handle.info
    assert_parity(handle(x, t, **inputs), file_reference(name, reference)(x, t, **inputs), "float32",
                  f"{name}_quantized")
    handle.unload()


def lora_for(path: str, folder) -> tuple[str, str]:
    """A ComfyUI-named LoRA on the first Linear weight of the file's blocks (a key with an index) and the file with it
    merged by hand (W + strength x alpha / rank x B @ A, in the file's own key space); returns (LoRA, merged file)."""
    state, metadata = load_file(path), read_header(path).metadata
    key = next(key for key in sorted(state) if re.search(r"\.\d+\.", key) and key.endswith(".weight")
               and state[key].dim() == 2)
    module = key[:-len(".weight")].split("diffusion_model.", 1)[-1]
    g = torch.Generator().manual_seed(9)
    weight = state[key]
    up, down = torch.randn(weight.shape[0], RANK, generator=g), torch.randn(RANK, weight.shape[1], generator=g)
    lora, merged = str(folder / "lora.safetensors"), str(folder / "merged.safetensors")
    save_file({f"diffusion_model.{module}.lora_B.weight": up, f"diffusion_model.{module}.lora_A.weight": down,
               f"diffusion_model.{module}.alpha": torch.tensor(ALPHA)}, lora)
    state[key] = (weight.float() + STRENGTH * ALPHA / RANK * (up @ down)).to(weight.dtype)
    save_file(state, merged, metadata=metadata)
    return lora, merged


@at_worlds(2)
@pytest.mark.parametrize("name", NAMES)
def test_lora_equals_the_merged_checkpoint(family_pool, family_subject, name):
    subject = family_subject(name)
    x, t, inputs = subject.spec.case()
    handle = family_pool.load_model(subject.path, **subject.spec.load_options)
    lora, merged = lora_for(subject.path, subject.folder)
    if family(name.partition(":")[0]).weight_plan is None:
        with pytest.raises(Exception, match=f"LoRA is not supported for '{name}'"):
            handle.set_loras([[lora, STRENGTH]])
    else:
        assert handle.set_loras([[lora, STRENGTH]])["parameters"] >= 1
        want = file_reference(name, merged)(x, t, **inputs)
        assert relative_error(want, subject.forward(x, t, **inputs)) > 1e-3, "the LoRA changes nothing"
        assert_parity(handle(x, t, **inputs), want, "float32", f"{name}_lora")
        handle.set_loras([])
    base = subject.outputs[subject.spec.first_case]
    assert_parity(handle(x, t, **inputs), base, "float32", f"{name}_lora_off")
    handle.unload()
