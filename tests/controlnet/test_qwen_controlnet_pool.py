"""Qwen-Image InstantX ControlNets in the pool (no ComfyUI): the ControlNet runs in the workers on each rank's own
tokens and its residuals enter the main model's blocks; the output equals diffusers' ControlNet + Qwen-Image on one
device at Ulysses 1-4, Ring, Ulysses x Ring and CFG-parallel, over odd token counts, a text mask, a reference latent,
strengths and two chained ControlNets (one with a single hint for the batch, as ComfyUI leaves it)."""
from __future__ import annotations

import pytest
import torch

from family_support import FP32_TOL, assert_parity, relative_error
from sp_lab.references.qwen_image import reference_forward
from sp_lab.references.qwen_image_controlnet import reference_forward_controlled
from sp_lab.tiny_models import build_tiny_model, save_tiny

pytest_plugins = ["family_pools"]  # the shared per-degree and per-layout worker pools
MAIN_BLOCKS = 6  # ComfyUI gives main blocks 0-4 the first ControlNet residual, block 5 the second


def _case(seed: int, height: int = 10, width: int = 14, batch: int = 2):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, 16, 1, height, width, generator=generator)
    context = torch.randn(batch, 5, 32, generator=generator)
    hints = [torch.randn(batch, 16, 1, height, width, generator=generator) for _ in range(2)]
    return x, torch.tensor([0.7, 0.3][:batch]), context, hints


@pytest.fixture(scope="session")
def models():
    return {"main": build_tiny_model("qwen_image", 3, num_layers=MAIN_BLOCKS),
            "union": build_tiny_model("qwen_image_controlnet", 5),
            "other": build_tiny_model("qwen_image_controlnet", 6, num_layers=3)}


@pytest.fixture(scope="session")
def files(models, tmp_path_factory):
    folder = tmp_path_factory.mktemp("qwen_controlnet")
    return {name: save_tiny(model, str(folder / f"{name}.safetensors"), "diffusers", "float32")
            for name, model in models.items()}


def _cases(models):
    """name -> (x, timestep, inputs, [(ControlNet name, hint, strength)])."""
    x, t, context, hints = _case(1)
    mask = torch.ones(2, 5, dtype=torch.bool)
    mask[1, 3:] = False
    ref = torch.randn(2, 16, 1, 6, 8, generator=torch.Generator().manual_seed(2))
    odd_x, odd_t, odd_context, odd_hints = _case(4, 7, 9, batch=1)
    return {"35_tokens": (x, t, {"context": context}, [("union", hints[0], 0.7)]),
            "chained_two": (x, t, {"context": context}, [("union", hints[0], 0.7), ("other", hints[1][:1], 1.3)]),
            "text_mask_and_reference": (x, t, {"context": context, "attention_mask": mask, "ref_latents": [ref]},
                                        [("union", hints[0], 1.0)]),
            "20_tokens_batch_1": (odd_x, odd_t, {"context": odd_context}, [("other", odd_hints[0], 0.5)])}


@pytest.fixture(scope="session")
def references(models):
    return {name: reference_forward_controlled(models["main"], x, t, inputs["context"],
                                               [(models[net], hint, strength) for net, hint, strength in nets],
                                               **{k: v for k, v in inputs.items() if k != "context"})
            for name, (x, t, inputs, nets) in _cases(models).items()}


def _run(pool, files, case):
    x, t, inputs, nets = case
    main = pool.load_model(files["main"])
    handles = {name: pool.load_model(files[name]) for name in ("union", "other")}
    controlnets = [{"model": handles[net], "hint": hint, "strength": strength} for net, hint, strength in nets]
    return main(x, t, **inputs, controlnets=controlnets)


def test_controlnets_match_diffusers_at_every_degree(family_pool, files, models, references):
    cases = _cases(models)
    if family_pool.config.world_size == 1:  # nothing is split: one case for the world-1 path
        cases = {"chained_two": cases["chained_two"]}
    elif family_pool.config.world_size > 2:  # every case at 2; at 3 and 4 the uneven splits (suite time)
        cases = {name: cases[name] for name in ("35_tokens", "20_tokens_batch_1")}
    for name, case in cases.items():
        assert_parity(_run(family_pool, files, case), references[name], "float32",
                      f"controlnet/u{family_pool.config.world_size}/{name}")


def test_controlnets_match_diffusers_on_ring_and_cfg_layouts(layout_pool, files, models, references):
    name, pool = layout_pool
    for case_name in ("35_tokens", "chained_two", "20_tokens_batch_1"):
        assert_parity(_run(pool, files, _cases(models)[case_name]), references[case_name], "float32",
                      f"controlnet/{name}/{case_name}")


@pytest.mark.parametrize("family_pool", [2], indirect=True)
def test_strength_zero_is_the_plain_model_and_the_controlnet_matters(family_pool, files, models, references):
    """Guards against a test that cannot fail: the residuals change the output, both ControlNets count."""
    x, t, inputs, nets = _cases(models)["chained_two"]
    plain = reference_forward(models["main"], x, t, inputs["context"])
    zero = _run(family_pool, files, (x, t, inputs, [(net, hint, 0.0) for net, hint, _ in nets]))
    assert relative_error(zero, plain) <= FP32_TOL
    single = references["35_tokens"]
    assert relative_error(single, plain) > 100 * FP32_TOL
    assert relative_error(references["chained_two"], single) > 100 * FP32_TOL


@pytest.mark.parametrize("family_pool", [2], indirect=True)
def test_what_the_controlnet_cannot_take_is_refused_by_name(family_pool, files, models):
    x, t, inputs, nets = _cases(models)["35_tokens"]
    bad_hint = [("union", torch.zeros(2, 16, 1, 4, 4), 1.0)]
    with pytest.raises(Exception, match=r"the ControlNet hint has shape \[2, 16, 4, 4\]"):
        _run(family_pool, files, (x, t, inputs, bad_hint))
    with pytest.raises(ValueError, match="controlnets must be"):
        family_pool.load_model(files["main"])(x, t, **inputs, controlnets=[{"model": files["union"], "hint": x}])
    assert_parity(_run(family_pool, files, (x, t, inputs, nets)),
                  reference_forward_controlled(models["main"], x, t, inputs["context"],
                                               [(models["union"], nets[0][1], nets[0][2])]), "float32",
                  "controlnet/after_refusal")
    family_pool.unload_all()


def test_detection_of_instantx_files_and_the_fun_controlnet_refused_by_name():
    """From the header alone: the Union and Inpainting (4 mask channels more) ControlNets and their configs; the
    Qwen-Image 2512 Fun ControlNet (another architecture) is named, not mistaken for one."""
    from sp_runtime.checkpoints.header import Header
    from sp_runtime.detection import detect
    for extra in (0, 4):
        model = build_tiny_model("qwen_image_controlnet", 0, extra_condition_channels=extra, num_layers=2)
        header = Header("cn.safetensors", {key: ("F32", tuple(value.shape)) for key, value in
                                           model.state_dict().items()})
        detection = detect(header)
        assert (detection.family, detection.config["num_layers"]) == ("qwen_image_controlnet", 2)
        assert detection.config["extra_condition_channels"] == extra
    fun = Header("Qwen-Image-2512-Fun-Controlnet-Union.safetensors",
                 {"control_blocks.0.after_proj.weight": ("F32", (2, 2)), "control_img_in.weight": ("F32", (2, 2))})
    with pytest.raises(ValueError, match="Qwen-Image Fun ControlNet"):
        detect(fun)
