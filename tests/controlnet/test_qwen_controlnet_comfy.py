"""ComfyUI tier: Qwen-Image InstantX ControlNets on an SP Qwen-Image through the stock sampler and the stock
ControlNetApplyAdvanced equal ComfyUI's own Qwen-Image with ComfyUI's own ControlNet (load_controlnet_qwen_instantx's
classes on the same tiny files) at Ulysses 2 and Ring 2: strength, start / end percent, two ControlNets chained. A
stock ControlNet reaching the SP model is refused by name. Skips without COMFYUI_PATH."""
import os

import pytest
import torch

import comfy_support as cs
from sp_lab.tiny_models import build_tiny_model, save_tiny, write_tiny_checkpoint

pytestmark = pytest.mark.skipif(cs.comfyui_path() is None, reason=cs.NO_COMFYUI)
MAIN_BLOCKS = 6  # with a 12-block ControlNet ComfyUI gives main blocks 0-4 its first residual, block 5 its second
LAYOUTS = {"u2": dict(ulysses_degree=0, ring_degree=1), "r2": dict(ulysses_degree=1, ring_degree=2)}
NETS = {"union": dict(seed=5), "other": dict(seed=6, num_layers=3)}


class StubVAE:
    """A fixed linear 'VAE' (8x8 average pooling, 3 -> 16 channels): ComfyUI's get_control encodes the hint with it,
    for the stock ControlNet and ours alike."""

    def __init__(self):
        self.mix = torch.randn(16, 3, generator=torch.Generator().manual_seed(9))

    def spacial_compression_encode(self):
        return 8

    def encode(self, pixels):
        pooled = torch.nn.functional.avg_pool2d(pixels.movedim(-1, 1).float(), 8)
        return torch.einsum("bchw,dc->bdhw", pooled, self.mix).unsqueeze(2)


def _comfy_qwen(path: str):
    import comfy.model_patcher
    import comfy.supported_models
    import comfy.utils
    config = comfy.supported_models.QwenImage({**cs.COMFY_TINY_UNET["qwen_image"], "num_layers": MAIN_BLOCKS})
    config.set_inference_dtype(torch.float32, None)
    model = config.get_model({})
    model.diffusion_model.load_state_dict(config.process_unet_state_dict(comfy.utils.load_torch_file(path)),
                                          strict=True)
    cpu = torch.device("cpu")
    return comfy.model_patcher.ModelPatcher(model, load_device=cpu, offload_device=cpu)


def _comfy_controlnet(path: str, num_layers: int):
    """What comfy.controlnet.load_controlnet_qwen_instantx builds, at the tiny widths (ComfyUI's detection assumes
    the real ones)."""
    import comfy.controlnet
    import comfy.latent_formats
    import comfy.ldm.qwen_image.controlnet
    import comfy.ops
    import comfy.utils
    unet = {key: value for key, value in cs.COMFY_TINY_UNET["qwen_image"].items() if key != "image_model"}
    model = comfy.ldm.qwen_image.controlnet.QwenImageControlNetModel(
        extra_condition_channels=0, operations=comfy.ops.disable_weight_init, device="cpu", dtype=torch.float32,
        **{**unet, "num_layers": num_layers})
    model.load_state_dict(comfy.utils.load_torch_file(path), strict=True)
    return comfy.controlnet.ControlNet(model, compression_ratio=1, latent_format=comfy.latent_formats.Wan21(),
                                      load_device=torch.device("cpu"), manual_cast_dtype=None, extra_conds=[])


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    cs.import_comfy()
    import folder_paths
    root = tmp_path_factory.mktemp("models")
    for kind in ("diffusion_models", "controlnet"):
        folder_paths.add_model_folder_path(kind, str(root / kind), is_default=True)
        os.makedirs(root / kind, exist_ok=True)
    main = write_tiny_checkpoint("qwen_image", str(root / "diffusion_models" / "tiny_qwen6.safetensors"), seed=3,
                                 num_layers=MAIN_BLOCKS)
    nets = {name: save_tiny(build_tiny_model("qwen_image_controlnet", size["seed"],
                                             **{k: v for k, v in size.items() if k != "seed"}),
                            str(root / "controlnet" / f"tiny_{name}.safetensors"), "diffusers", "float32")
            for name, size in NETS.items()}
    write_tiny_checkpoint("qwen_image", str(root / "controlnet" / "not_a_controlnet.safetensors"), num_layers=1)
    yield {"main": main, **nets}
    cs.import_node_module("pool_owner").OWNER.close_all()


@pytest.fixture(scope="module")
def stock(files):
    return {"model": _comfy_qwen(files["main"]),
            **{name: _comfy_controlnet(files[name], NETS[name].get("num_layers", 12)) for name in NETS}}


@pytest.fixture(scope="module", params=sorted(LAYOUTS))
def sp(request, files):
    loader, controlnet = cs.import_node_module("loader"), cs.import_node_module("controlnet")
    model = loader.SPModelLoader.execute(unet_name=os.path.basename(files["main"]), weight_dtype="fp32",
                                         devices="cpu:2", cfg_parallel=False, **LAYOUTS[request.param]).result[0]
    nets = {name: controlnet.SPControlNetLoader.execute(os.path.basename(files[name])).result[0] for name in NETS}
    return {"layout": request.param, "model": model, **nets}


def _apply(positive, negative, nets, applied):
    """ControlNetApplyAdvanced in turn for each (ControlNet name, strength, start, end, image seed)."""
    from nodes import ControlNetApplyAdvanced
    for name, strength, start, end, seed in applied:
        image = torch.rand(1, 80, 112, 3, generator=torch.Generator().manual_seed(seed))
        positive, negative = ControlNetApplyAdvanced().apply_controlnet(positive, negative, nets[name], image,
                                                                        strength, start, end, vae=StubVAE())
    return positive, negative


def _sample(models, applied):
    positive, negative = _apply(cs.conditioning("qwen_image", 1), cs.conditioning("qwen_image", 2), models, applied)
    return cs.sample(models["model"], positive, negative, steps=3, frames=1)


CASES = {"strength_0.7": [("union", 0.7, 0.0, 1.0, 1)],
         "percent_0.34_1.0": [("union", 1.0, 0.34, 1.0, 1)],
         "chained_two": [("union", 0.7, 0.0, 1.0, 1), ("other", 1.3, 0.0, 0.67, 2)]}


@pytest.mark.parametrize("case", sorted(CASES))
def test_controlnets_equal_comfyuis_own_through_the_stock_sampler(sp, stock, case):
    actual, expected = _sample(sp, CASES[case]), _sample(stock, CASES[case])
    print(f"{sp['layout']} {case}: max abs diff {cs.assert_close(actual, expected):.2e} "
          f"(scale {expected.abs().max().item():.2f})")
    plain = cs.sample(stock["model"], cs.conditioning("qwen_image", 1), cs.conditioning("qwen_image", 2), steps=3,
                      frames=1)
    assert (expected - plain).abs().max() > 1e-3 * plain.abs().max(), "the ControlNet must change the result"


def test_a_stock_controlnet_on_the_sp_model_is_refused_by_name(sp, stock):
    """...and the SP ControlNet gives ComfyUI nothing to load: no network, no weights in this process."""
    assert sp["union"].get_models() == [] and not isinstance(sp["union"].control_model, torch.nn.Module)
    proxy = cs.import_node_module("proxy")
    with pytest.raises((proxy.SPPoolError, ValueError), match=r"stock 'Load ControlNet Model' node \(ControlNetLoader"):
        _sample({"model": sp["model"], "union": stock["union"]}, [("union", 1.0, 0.0, 1.0, 1)])
    with pytest.raises(ValueError, match=r"ControlNetLoader"):
        _sample({"model": sp["model"], "union": sp["union"], "stock": stock["other"]},
                [("stock", 1.0, 0.0, 1.0, 1), ("union", 1.0, 0.0, 1.0, 1)])
    cs.sample(sp["model"], cs.conditioning("qwen_image", 1), cs.conditioning("qwen_image", 2), steps=1, frames=1)


def test_the_sp_loader_names_a_file_it_cannot_serve(files):
    controlnet = cs.import_node_module("controlnet")
    with pytest.raises(ValueError, match=r"not_a_controlnet.safetensors is not a ControlNet the Ulysses SP workers "
                                         r"serve \(it is a qwen_image model\)"):
        controlnet.SPControlNetLoader.execute("not_a_controlnet.safetensors")
