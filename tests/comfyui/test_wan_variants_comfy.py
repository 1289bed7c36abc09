"""The Wan variants against ComfyUI's own code (needs COMFYUI_PATH; skipped otherwise): the pool at degrees 1-4 equals
ComfyUI's VaceWanModel, CameraWanModel, HumoWanModel and WanModel with ref_conv (Fun Control, 48 and 52 channels;
Wan 2.2 Fun 5B Control, 148 channels and a 48-channel reference, and Fun 5B InP, 100 channels, with per-frame
timesteps) on the same tiny files and inputs; and the stock sampler through the loader node's MODEL, with ComfyUI's
conditioning nodes (WanVaceToVideo, WanFunInpaintToVideo for Wan 2.1, A14B and 5B InP, WanFunControlToVideo,
Wan22FunControlToVideo with both A14B experts in one pool and with the 5B model, WanCameraEmbedding +
WanCameraImageToVideo, WanHuMoImageToVideo for HuMo 1.7B and 17B), equals the same sampling on ComfyUI's own model
(the class ComfyUI's detection picks, its network holding the file's weights)."""
from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch

import comfy_support as cs
from family_support import assert_parity
from sp_lab.tiny_models import COMFY_PREFIX, write_tiny_checkpoint
from sp_lab.tiny_models.wan import CAMERA_TINY, HUMO_TINY, VACE_TINY, tiny_config
from test_wan_conditioning import FUN_5B_SIZE as FIVE_B, HUMO_SIZE, VACE_SIZE, camera_cases, fun_cases, humo_cases, \
    vace_cases

pytestmark = pytest.mark.skipif(cs.comfyui_path() is None, reason=cs.NO_COMFYUI)
pytest_plugins = ["family_pools"]  # the shared per-degree worker pools

# name -> (tiny variant, seed, size, the variant's cases as its own test module makes them)
VARIANTS = {
    "vace": ("vace", 21, VACE_SIZE, vace_cases),
    "fun_control": ("fun_control", 22, {}, lambda: fun_cases("fun_control")),
    "fun_a14b": ("fun_a14b", 23, {}, lambda: fun_cases("a14b_high_noise")),
    "fun_5b_control": ("fun_5b_control", 27, FIVE_B, lambda: fun_cases("5b_control")),
    "fun_5b_inp": ("fun_5b_inp", 28, FIVE_B, lambda: fun_cases("5b_inp")),
    "camera": ("camera", 24, {}, lambda: camera_cases("camera")),
    "camera_2.2": ("camera_2.2", 25, {}, lambda: camera_cases("camera_2.2")),
    "humo": ("humo", 26, HUMO_SIZE, humo_cases),
}
# ComfyUI pads x to the patch size but not the VACE hints nor the reference latents, so it cannot run these cases
# (ours pads them too); the HuMo reference is checked on an even-sized copy instead
COMFY_CANNOT_RUN = {"vace": ("40_tokens_padded",), "fun_control": ("40_tokens_padded",),
                    "fun_a14b": ("40_tokens_padded",), "fun_5b_control": ("40_tokens_padded",),
                    "humo": ("reference_frame",)}
# the tiny HuMo's audio_embed [B, T, 2, 5, 8] (ComfyUI's real one: [B, T, 8, 5, 1280])
AUDIO_WINDOW, AUDIO_BLOCKS = 2, 5
AUDIO_CHANNELS = HUMO_TINY["audio_in_features"] // (AUDIO_WINDOW * AUDIO_BLOCKS)


def comfy_cases(name: str) -> dict:
    """The variant's cases that ComfyUI's own model can run (HuMo: its reference case cropped to an even width)."""
    cases = VARIANTS[name][3]()
    if name == "humo":
        x, t, inputs = cases["reference_frame"]
        even = {**inputs, "reference_latent": inputs["reference_latent"][..., :4]}
        cases["reference_frame_even"] = (x[..., :4], t, even)
    return {case: value for case, value in cases.items() if case not in COMFY_CANNOT_RUN.get(name, ())}


def comfy_network(variant: str, **size) -> torch.nn.Module:
    """ComfyUI's own Wan network class of the variant at the tiny model's sizes (fp32, CPU, random init)."""
    import comfy.ldm.wan.model as comfy_wan
    import comfy.ops
    config = tiny_config(variant, **size)
    heads, dim = config["num_attention_heads"], config["num_attention_heads"] * config["attention_head_dim"]
    common = dict(dim=dim, ffn_dim=config["ffn_dim"], text_dim=config["text_dim"], num_heads=heads,
                  num_layers=config["num_layers"], in_dim=config["in_channels"], out_dim=config["out_channels"],
                  device="cpu", dtype=torch.float32, operations=comfy.ops.disable_weight_init)
    if variant == "vace":
        return comfy_wan.VaceWanModel(vace_layers=len(VACE_TINY["vace_layers"]),
                                      vace_in_dim=VACE_TINY["vace_in_channels"], **common)
    if variant.startswith("camera"):
        return comfy_wan.CameraWanModel(model_type=variant, in_dim_control_adapter=CAMERA_TINY["camera_in_channels"],
                                        **common)
    if variant == "humo":
        return _small_audio(comfy_wan.HumoWanModel(**common), dim, heads)
    model_type = "i2v" if config.get("image_dim") else "t2v"
    return comfy_wan.WanModel(model_type=model_type, in_dim_ref_conv=config.get("ref_in_channels"), **common)


def _small_audio(model, dim: int, heads: int):
    """ComfyUI's HumoWanModel hardcodes the real audio sizes; its own audio classes, rebuilt at the tiny sizes."""
    import comfy.ldm.wan.model as comfy_wan
    import comfy.ops
    settings = {"operations": comfy.ops.disable_weight_init, "device": "cpu", "dtype": torch.float32}
    model.audio_proj = comfy_wan.AudioProjModel(seq_len=AUDIO_WINDOW, blocks=AUDIO_BLOCKS, channels=AUDIO_CHANNELS,
                                                intermediate_dim=HUMO_TINY["audio_hidden"],
                                                output_dim=HUMO_TINY["audio_dim"], **settings)
    for block in model.blocks:
        block.audio_cross_attn_wrapper = comfy_wan.AudioCrossAttentionWrapper(
            dim, HUMO_TINY["audio_dim"], heads, operation_settings=settings)
    return model


def load_comfy_network(variant: str, path: str, **size) -> torch.nn.Module:
    """ComfyUI's network of the variant with the file's weights (strict: the file's keys are exactly ComfyUI's)."""
    import comfy.utils
    network = comfy_network(variant, **size)
    state = comfy.utils.state_dict_prefix_replace(comfy.utils.load_torch_file(path), {COMFY_PREFIX: ""},
                                                  filter_keys=True)
    network.load_state_dict(state, strict=True)
    return network.eval()


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    cs.import_comfy()
    folder = tmp_path_factory.mktemp("wan_variants_comfy")
    return {name: write_tiny_checkpoint("wan", str(folder / f"{name}.safetensors"), seed=seed, variant=variant,
                                        prefix=COMFY_PREFIX, **size)
            for name, (variant, seed, size, _) in VARIANTS.items()}


@pytest.fixture(scope="module")
def comfy_outputs(files):
    """ComfyUI's network of every variant on every case of the variant's own test module."""
    outputs = {}
    for name, (variant, _, size, _) in VARIANTS.items():
        network = load_comfy_network(variant, files[name], **size)
        with torch.no_grad():
            outputs[name] = {case: network(x, t, inputs["context"], transformer_options={},
                                           **{k: v for k, v in inputs.items() if k != "context"})
                             for case, (x, t, inputs) in comfy_cases(name).items()}
    return outputs


@pytest.mark.parametrize("name", VARIANTS)
def test_pool_equals_comfys_own_model_class(name, family_pool, files, comfy_outputs):
    handle = family_pool.load_model(files[name])
    for case, (x, t, inputs) in comfy_cases(name).items():
        assert_parity(handle(x, t, **inputs), comfy_outputs[name][case], "float32", f"comfy/{name}/{case}")


# ---------------------------------------------------------------------------------------------------------------
# The stock sampler through the loader node's MODEL, with ComfyUI's conditioning nodes

WIDTH = HEIGHT = 48  # pixels: 6 x 6 latent, 9 tokens per latent frame
LENGTH = 9           # pixel frames: 3 latent frames
# name -> (tiny variant, seed, size) of the files the loader node reads
SAMPLED = {"vace": ("vace", 31, VACE_SIZE), "fun_inp": ("i2v", 39, {}), "fun_inp_2.2": ("i2v_concat", 40, {}),
           "fun_control": ("fun_control", 32, {}), "fun_5b_control": ("fun_5b_control", 41, FIVE_B),
           "fun_5b_inp": ("fun_5b_inp", 42, FIVE_B),
           "fun_a14b_high_noise": ("fun_a14b", 33, {}), "fun_a14b_low_noise": ("fun_a14b", 34, {}),
           "camera": ("camera", 35, {}), "camera_2.2": ("camera_2.2", 36, {}), "humo": ("humo", 37, HUMO_SIZE),
           "humo_17b": ("humo", 38, {**HUMO_SIZE, "in_channels": 36})}  # 17B: noise, mask, image latent


class TinyVAE:
    """Stands for the Wan VAE in the conditioning nodes: 8x smaller frames, the first frame alone and then 4 frames
    per latent frame, 16 channels from a fixed linear map (both models get the same latents; no weights to load)."""

    latent_channels = 16

    def spacial_compression_encode(self) -> int:
        return 8

    def encode(self, pixels: torch.Tensor) -> torch.Tensor:
        """[N, H, W, 3] in 0..1 -> [1, C, (N - 1) // 4 + 1, H / s, W / s] (s: the spatial compression)"""
        pooled = torch.nn.functional.avg_pool2d(pixels.movedim(-1, 1).float(), self.spacial_compression_encode())
        frames = [pooled[:1]] + [pooled[i:i + 4].mean(0, keepdim=True) for i in range(1, pooled.shape[0], 4)]
        mix = torch.linspace(-2.0, 2.0, 3 * self.latent_channels).view(self.latent_channels, 3)
        return torch.einsum("lc,tchw->lthw", mix, torch.cat(frames)).unsqueeze(0)


class TinyVAE22(TinyVAE):
    """Stands for the Wan 2.2 VAE (the 5B models'): 48 channels, 16x smaller frames."""

    latent_channels = 48

    def spacial_compression_encode(self) -> int:
        return 16


def images(count: int, seed: int, scale: int = 1) -> torch.Tensor:
    return torch.rand(count, HEIGHT * scale, WIDTH * scale, 3, generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def comfy_env(tmp_path_factory):
    cs.import_comfy()
    import folder_paths
    folder = tmp_path_factory.mktemp("models") / "diffusion_models"
    folder_paths.add_model_folder_path("diffusion_models", str(folder), is_default=True)
    owner = cs.import_node_module("pool_owner").OWNER
    paths = {name: write_tiny_checkpoint("wan", str(folder / f"tiny_wan_{name}.safetensors"), seed=seed,
                                         variant=variant, prefix=COMFY_PREFIX, **size)
             for name, (variant, seed, size) in SAMPLED.items()}
    yield paths
    owner.close_all()


@pytest.fixture(scope="module")
def sp_models(comfy_env):
    """The loader node's MODEL of every file, all in one cpu:2 pool (Ulysses 2)."""
    loader = cs.import_node_module("loader")
    models = {name: loader.SPModelLoader.execute(unet_name=os.path.basename(path), weight_dtype="fp32",
                                                 devices="cpu:2", ulysses_degree=0, ring_degree=1,
                                                 cfg_parallel=False).result[0]
              for name, path in comfy_env.items()}
    assert cs.import_node_module("pool_owner").OWNER.pool_count == 1
    return models


@pytest.fixture(scope="module")
def references(comfy_env):
    """ComfyUI's own MODEL of every file: the model class ComfyUI's detection picks for the file, with ComfyUI's
    network of the variant holding the file's weights."""
    import comfy.model_detection
    import comfy.model_patcher
    import comfy.utils
    cpu = torch.device("cpu")
    models = {}
    for name, path in comfy_env.items():
        variant, _, size = SAMPLED[name]
        state = comfy.utils.state_dict_prefix_replace(comfy.utils.load_torch_file(path), {COMFY_PREFIX: ""},
                                                      filter_keys=True)
        config = comfy.model_detection.model_config_from_unet(state, "")
        config.unet_config["disable_unet_model_creation"] = True  # detection assumes real sizes: built below
        config.set_inference_dtype(torch.float32, None)
        model = config.get_model({})
        model.diffusion_model = load_comfy_network(variant, path, **size)
        models[name] = comfy.model_patcher.ModelPatcher(model, load_device=cpu, offload_device=cpu)
    return models


def both(sp_models, references, name, positive, negative, latent, **options):
    """The same sampling on the SP MODEL and on ComfyUI's own; the SP one's ComfyUI class must be ComfyUI's pick."""
    assert type(sp_models[name].model) is type(references[name].model)
    assert type(sp_models[name].model.model_config) is type(references[name].model.model_config)
    return [cs.sample(model[name], positive, negative, latent=latent, steps=2, **options)
            for model in (sp_models, references)]


def test_wan_vace_to_video(sp_models, references):
    from comfy_extras.nodes_wan import TrimVideoLatent, WanVaceToVideo
    positive, negative = cs.conditioning("wan", 1), cs.conditioning("wan", 2)
    positive, negative, latent, trim = WanVaceToVideo.execute(
        positive, negative, TinyVAE(), WIDTH, HEIGHT, LENGTH + 4, 1, 0.8, control_video=images(LENGTH + 4, 1),
        reference_image=images(1, 2)).result  # 4 + 1 reference latent frames: 45 tokens
    actual, expected = both(sp_models, references, "vace", positive, negative, latent["samples"])
    cs.assert_close(actual, expected)
    trimmed = TrimVideoLatent.execute({"samples": actual}, trim).result[0]["samples"]
    assert trimmed.shape[2] == 4


def clip_vision_output(seed: int) -> SimpleNamespace:
    """What a CLIPVisionEncode node gives the Wan nodes (they read its penultimate hidden states)."""
    return SimpleNamespace(penultimate_hidden_states=torch.randn(1, 5, 1280,
                                                                 generator=torch.Generator().manual_seed(seed)))


@pytest.mark.parametrize("name", ["fun_inp", "fun_inp_2.2", "fun_5b_inp"])
def test_wan_fun_inpaint_to_video(name, sp_models, references):
    """Wan 2.1 Fun InP (CLIP), Wan 2.2 Fun InP A14B style (no CLIP) and Wan 2.2 Fun 5B InP (48-channel latents, the
    5B template's node): start and end image in the extra channels."""
    from comfy_extras.nodes_wan import WanFunInpaintToVideo
    clip_vision = clip_vision_output(11) if name == "fun_inp" else None
    vae = TinyVAE22() if name == "fun_5b_inp" else TinyVAE()
    scale = vae.spacial_compression_encode() // 8  # the same 6 x 6 latent
    positive, negative, latent = WanFunInpaintToVideo.execute(
        cs.conditioning("wan", 1), cs.conditioning("wan", 2), vae, WIDTH * scale, HEIGHT * scale, LENGTH, 1,
        start_image=images(1, 12, scale), end_image=images(1, 13, scale), clip_vision_output=clip_vision).result
    cs.assert_close(*both(sp_models, references, name, positive, negative, latent["samples"]))


def test_wan_fun_control_to_video(sp_models, references):
    from comfy_extras.nodes_wan import WanFunControlToVideo
    clip_vision = clip_vision_output(3)
    positive, negative, latent = WanFunControlToVideo.execute(
        cs.conditioning("wan", 1), cs.conditioning("wan", 2), TinyVAE(), WIDTH, HEIGHT, LENGTH, 1,
        start_image=images(1, 4), clip_vision_output=clip_vision, control_video=images(LENGTH, 5)).result
    cs.assert_close(*both(sp_models, references, "fun_control", positive, negative, latent["samples"]))


def test_wan22_fun_control_two_experts_in_one_pool(sp_models, references):
    """Wan 2.2 Fun Control A14B as its template runs it: the high-noise expert for the first steps (noise added,
    leftover noise returned), the low-noise expert for the rest; the reference image through ref_conv."""
    from comfy_extras.nodes_wan import Wan22FunControlToVideo
    positive, negative, latent = Wan22FunControlToVideo.execute(
        cs.conditioning("wan", 1), cs.conditioning("wan", 2), TinyVAE(), WIDTH, HEIGHT, LENGTH, 1,
        ref_image=images(1, 6), control_video=images(LENGTH, 7)).result
    assert "reference_latents" in positive[0][1]
    results = []
    for models in (sp_models, references):
        high = cs.sample(models["fun_a14b_high_noise"], positive, negative, latent=latent["samples"], steps=4,
                         start_step=0, last_step=2, force_full_denoise=False)
        results.append(cs.sample(models["fun_a14b_low_noise"], positive, negative, latent=high, steps=4,
                                 start_step=2, last_step=4, disable_noise=True, force_full_denoise=True))
    cs.assert_close(*results)


def test_wan22_fun_control_5b(sp_models, references):
    """Wan 2.2 Fun 5B Control as its template runs it (Wan22FunControlToVideo with the Wan 2.2 VAE's 48 channels: the
    control video, mask and start-image channels, the reference image through ref_conv), one KSampler."""
    from comfy_extras.nodes_wan import Wan22FunControlToVideo
    size = 2 * WIDTH  # 6 x 6 latent
    positive, negative, latent = Wan22FunControlToVideo.execute(
        cs.conditioning("wan", 1), cs.conditioning("wan", 2), TinyVAE22(), size, size, LENGTH, 1,
        ref_image=images(1, 14, 2), control_video=images(LENGTH, 15, 2)).result
    assert latent["samples"].shape[1] == 48 and "reference_latents" in positive[0][1]
    cs.assert_close(*both(sp_models, references, "fun_5b_control", positive, negative, latent["samples"]))


@pytest.mark.parametrize("name", ["camera", "camera_2.2"])
def test_wan_camera_image_to_video(name, sp_models, references):
    from comfy_extras.nodes_camera_trajectory import WanCameraEmbedding
    from comfy_extras.nodes_wan import WanCameraImageToVideo
    camera, *_ = WanCameraEmbedding.execute("Pan Left", WIDTH, HEIGHT, LENGTH, speed=2.0).result
    positive, negative, latent = WanCameraImageToVideo.execute(
        cs.conditioning("wan", 1), cs.conditioning("wan", 2), TinyVAE(), WIDTH, HEIGHT, LENGTH, 1,
        start_image=images(1, 8), camera_conditions=camera).result
    cs.assert_close(*both(sp_models, references, name, positive, negative, latent["samples"]))


@pytest.mark.parametrize("name", ["humo", "humo_17b"])
def test_wan_humo_image_to_video(name, sp_models, references):
    """The node's reference image (zeros on the negative side); its audio embedding has the real sizes, so a tiny
    one of the same layout [B, latent frames, window, blocks, channels] replaces it."""
    import node_helpers
    from comfy_extras.nodes_wan import WanHuMoImageToVideo
    positive, negative, latent = WanHuMoImageToVideo.execute(
        cs.conditioning("wan", 1), cs.conditioning("wan", 2), TinyVAE(), WIDTH, HEIGHT, LENGTH, 1,
        ref_image=images(1, 9)).result
    frames = latent["samples"].shape[2]
    audio = torch.randn(1, frames, AUDIO_WINDOW, AUDIO_BLOCKS, AUDIO_CHANNELS,
                        generator=torch.Generator().manual_seed(10))
    positive = node_helpers.conditioning_set_values(positive, {"audio_embed": audio})
    negative = node_helpers.conditioning_set_values(negative, {"audio_embed": torch.zeros_like(audio)})
    cs.assert_close(*both(sp_models, references, name, positive, negative, latent["samples"]))
