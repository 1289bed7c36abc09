"""HunyuanVideo 1.5 against ComfyUI's own network (ComfyUI tier: COMFYUI_PATH at a ComfyUI with HunyuanVideo 1.5,
0.4.0 or newer for the super-resolution model's summed meanflow embedding): ComfyUI-named files of ComfyUI's
HunyuanVideo at the tiny size (3 heads x 128, 2 double blocks, ByT5 mapper at ComfyUI's fixed 1472 -> 2048 widths,
SigLIP projection, condition-type embedding), loaded by the pool at Ulysses 1-4 and compared with ComfyUI's forward
on the same weights in fp32: text-to-video with glyph tokens, image-to-video (SigLIP tokens), a padded prompt, a
reference latent (12 extra tokens, 117 in all; at batch 1: ComfyUI's own ref_latent path writes into an expanded
tensor and fails at batch 2), and the SR model (98 channels) with the sampler's sigmas in
transformer_options, whose next sigma the host hands to the pool (hunyuan_video15.sampler_inputs). Then ComfyUI's
stock sampler on the SP loader's MODEL (cpu:2) equals it on ComfyUI's own MODEL of the same weights, for the base
model (image latent + mask concat, SigLIP and ByT5 conditioning) and the SR model (HunyuanVideo15SuperResolution's
conditioning, sample_sigmas read by the host)."""
from __future__ import annotations

import pytest
import torch

from comfy_support import NO_COMFYUI, comfyui_path, import_comfy, import_node_module
from family_support import assert_parity
from sp_runtime.families import hunyuan_video15
from sp_runtime.checkpoints.header import read_checkpoint_header
from sp_lab.tiny_models import COMFY_PREFIX, randomize_

pytest_plugins = ["family_pools"]  # the shared per-degree worker pools
pytestmark = pytest.mark.skipif(comfyui_path() is None, reason=NO_COMFYUI)
SEED = 21
MODELS = {"base": (65, "HunyuanVideo15"), "sr": (98, "HunyuanVideo15_SR_Distilled")}  # channels, ComfyUI class
SCHEDULE = torch.tensor([1.0, 0.7, 0.3, 0.0])  # the sampler's sigmas (sample_sigmas)


def _comfy_network(in_channels: int):
    """ComfyUI's HunyuanVideo network with 1.5's parts, tiny, seeded random weights."""
    import comfy.ldm.hunyuan_video.model as comfy_hv
    import comfy.ops
    model = comfy_hv.HunyuanVideo(in_channels=in_channels, out_channels=32, vec_in_dim=None, context_in_dim=32,
                                  hidden_size=384, mlp_ratio=2.0, num_heads=3, depth=2, depth_single_blocks=0,
                                  axes_dim=[16, 56, 56], theta=256, patch_size=[1, 1, 1], qkv_bias=True,
                                  guidance_embed=False, byt5=True, meanflow=in_channels == 98,
                                  use_cond_type_embedding=True, vision_in_dim=40, meanflow_sum=True,
                                  dtype=torch.float32, device="cpu", operations=comfy.ops.disable_weight_init)
    randomize_(model, SEED + in_channels)
    return model.eval().requires_grad_(False)


def _calls(channels: int) -> dict:
    """name -> (x, sigma, kwargs of ComfyUI's diffusion_model call)."""
    g = torch.Generator().manual_seed(channels)

    def rand(*shape):
        return torch.randn(*shape, generator=g)
    x, sigma = rand(2, channels, 3, 5, 7), torch.tensor([0.7, 0.7])
    text = {"context": rand(2, 7, 32), "txt_byt5": rand(2, 4, 1472)}
    if channels == 98:  # SR: ComfyUI finds sigma in the schedule and embeds the next one (0.3)
        return {"sr": (x, sigma, text), "sr_off_schedule": (x, torch.tensor([0.5, 0.5]), text),
                "sr_image": (x, sigma, {**text, "clip_fea": rand(2, 5, 40)})}
    one = {"context": text["context"][:1]}
    return {"t2v_glyphs": (x, sigma, text), "i2v": (x, sigma, {**text, "clip_fea": rand(2, 5, 40)}),
            "padding_mask": (x[:1], sigma[:1], {**one, "attention_mask": torch.tensor([[1, 1, 1, 1, 1, 0, 0]])}),
            "ref_latent": (x[:1], sigma[:1], {**one, "ref_latent": rand(1, channels, 1, 3, 4)})}


def _options(sigma: torch.Tensor) -> dict:
    return {"sigmas": sigma, "sample_sigmas": SCHEDULE}


@pytest.fixture(scope="session")
def comfy_hunyuan15(tmp_path_factory):
    """(files, ComfyUI's outputs) per model; skips when this ComfyUI lacks HunyuanVideo 1.5 or the SR sum."""
    path = import_comfy()
    import comfy.supported_models
    import comfy.ldm.hunyuan_video.model as comfy_hv
    fields = {field for field in comfy_hv.HunyuanVideoParams.__dataclass_fields__}
    if not hasattr(comfy.supported_models, "HunyuanVideo15") or "meanflow_sum" not in fields:
        pytest.skip(f"ComfyUI at {path} has no comfy.supported_models.HunyuanVideo15 with meanflow_sum in "
                    f"comfy.ldm.hunyuan_video.model; needs ComfyUI >= 0.4.0 (HunyuanVideo 1.5 from 0.3.71)")
    from safetensors.torch import save_file
    folder = tmp_path_factory.mktemp("hunyuan15_comfy")
    files, expected = {}, {}
    for name, (channels, _) in MODELS.items():
        network = _comfy_network(channels)
        files[name] = str(folder / f"comfy_hunyuan15_{name}.safetensors")
        save_file({COMFY_PREFIX + key: value.contiguous() for key, value in network.state_dict().items()},
                  files[name])
        with torch.no_grad():
            expected[name] = {call: network(x, sigma * 1000, transformer_options=_options(sigma), **kwargs)
                              for call, (x, sigma, kwargs) in _calls(channels).items()}
    return files, expected


def test_pool_equals_comfyui_hunyuan_video15(comfy_hunyuan15, family_pool):
    files, expected = comfy_hunyuan15
    comfy_model = import_node_module("comfy_model")
    import comfy.supported_models
    for name, (channels, comfy_class) in MODELS.items():
        handle = family_pool.load_model(files[name])
        config = comfy_model.comfy_model_config(read_checkpoint_header(files[name]), handle.info)
        assert type(config) is getattr(comfy.supported_models, comfy_class)
        for call, (x, sigma, kwargs) in _calls(channels).items():
            extra = hunyuan_video15.sampler_inputs(_options(sigma), kwargs)
            assert ("timestep_r" in extra) == (call != "sr_off_schedule")
            got = handle(x, sigma * 1000, **kwargs, **extra)
            assert_parity(got, expected[name][call], "float32",
                          f"comfyui_hunyuan15/u{family_pool.config.world_size}/{call}")
        handle.unload()


def _comfy_model(network, comfy_class: str):
    """ComfyUI's own MODEL (BaseModel + ModelPatcher on the CPU) around `network`'s weights."""
    import comfy.model_patcher
    import comfy.supported_models
    config_cls = getattr(comfy.supported_models, comfy_class)
    config = config_cls({**config_cls.unet_config, "in_channels": network.in_channels, "out_channels": 32,
                         "vec_in_dim": None, "context_in_dim": 32, "hidden_size": 384, "mlp_ratio": 2.0,
                         "num_heads": 3, "depth": 2, "depth_single_blocks": 0, "axes_dim": [16, 56, 56],
                         "theta": 256, "patch_size": [1, 1, 1], "qkv_bias": True, "guidance_embed": False,
                         "byt5": True, "meanflow": network.in_channels == 98, "use_cond_type_embedding": True,
                         "vision_in_dim": 40, "meanflow_sum": True})
    config.set_inference_dtype(torch.float32, None)
    model = config.get_model({})
    model.diffusion_model.load_state_dict(network.state_dict(), strict=True)
    cpu = torch.device("cpu")
    return comfy.model_patcher.ModelPatcher(model, load_device=cpu, offload_device=cpu)


def _conditioning(seed: int, sr_latent=None):
    """Hand-made HunyuanVideo 1.5 CONDITIONING (Qwen tokens, ByT5 glyph tokens, a SigLIP output, an image latent
    and mask for the base model); the SR model's through ComfyUI's HunyuanVideo15SuperResolution node."""
    from types import SimpleNamespace
    g = torch.Generator().manual_seed(seed)
    extra = {"pooled_output": None, "conditioning_byt5small": torch.randn(1, 4, 1472, generator=g),
             "clip_vision_output": SimpleNamespace(last_hidden_state=torch.randn(1, 5, 40, generator=g))}
    if sr_latent is None:
        mask = torch.ones(1, 1, 3, 5, 7)
        mask[:, :, 0] = 0
        extra.update(concat_latent_image=torch.randn(1, 32, 3, 5, 7, generator=g), concat_mask=mask)
    cond = [[torch.randn(1, 7, 32, generator=g), extra]]
    if sr_latent is not None:
        from comfy_extras.nodes_hunyuan import HunyuanVideo15SuperResolution
        cond = HunyuanVideo15SuperResolution.execute(cond, cond, {"samples": sr_latent}, 0.7).result[0]
    return cond


def test_stock_sampler_on_sp_models_equals_comfys_own(comfy_hunyuan15):
    from comfy_support import sample
    import folder_paths
    files, _ = comfy_hunyuan15
    loader, owner = import_node_module("loader"), import_node_module("pool_owner").OWNER
    import os
    folder_paths.add_model_folder_path("diffusion_models", os.path.dirname(files["base"]), is_default=True)
    low_resolution = torch.randn(1, 32, 3, 5, 7, generator=torch.Generator().manual_seed(3))
    try:
        for name, (channels, comfy_class) in MODELS.items():
            reference = _comfy_model(_comfy_network(channels), comfy_class)
            sp_model = loader.SPModelLoader.execute(unet_name=os.path.basename(files[name]), weight_dtype="fp32",
                                                    devices="cpu:2", ulysses_degree=0, ring_degree=1,
                                                    cfg_parallel=False).result[0]
            assert type(sp_model.model) is type(reference.model)
            sr_latent = low_resolution if name == "sr" else None
            positive, negative = _conditioning(1, sr_latent), _conditioning(2, sr_latent)
            latent = sr_latent if name == "sr" else None
            expected = sample(reference, positive, negative, frames=3, width=7, height=5, latent=latent)
            got = sample(sp_model, positive, negative, frames=3, width=7, height=5, latent=latent)
            assert_parity(got, expected, "float32", f"comfyui_hunyuan15/sampler/{name}")
    finally:
        owner.close_all()
