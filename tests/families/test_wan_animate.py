"""Wan 2.2 Animate under Ulysses SP: ComfyUI's pose_latents (embedded per token onto frames 1..) and
face_pixel_values (motion tokens per latent frame, attended by the face adapter after blocks 0, 5, ...) equal
diffusers' own WanAnimateTransformer3DModel run in one process, at degrees 1-4 (3 heads of 128), token ranges that
split frames, padded sizes, batch 2; and ComfyUI's own AnimateWanModel on the same file (COMFYUI_PATH), where the
frame counts of the inputs need not match x's. Detection, the key plan against diffusers' converter, bad inputs."""
from __future__ import annotations

import pytest
import torch

import comfy_support as cs
from family_support import LocalContext, assert_parity, relative_error
from sp_runtime.config import SPConfig
from sp_lab.references.wan import reference_forward
from sp_runtime.families import wan
from sp_runtime.contract import LoadRequest
from sp_runtime.detection import detect
from sp_runtime.pool.loading import load_worker_model
from sp_runtime.checkpoints.header import read_checkpoint_header
from sp_runtime.groups import ParallelGroups, SeqParallel
from sp_lab.tiny_models import COMFY_PREFIX, build_tiny_model, original_state_dict, write_tiny_checkpoint

pytest_plugins = ["family_pools"]  # the shared per-degree worker pools

SEED = 17
SIZE = dict(num_attention_heads=3, attention_head_dim=128)  # 3 heads: 2 and 4 ranks do not divide them
FACE = 512  # the motion encoder's fixed input size


def _call(generator, frames, height, width, pose_frames, face_frames, clip=True, text_tokens=512):
    """(x, timestep, inputs) as ComfyUI's WAN22_Animate passes them (x: noise 16 + mask 4 + reference 16 channels,
    frame 0 the reference image's); diffusers' image attention needs exactly 512 text tokens."""
    inputs = {"context": torch.randn(2, text_tokens, 32, generator=generator),
              "pose_latents": torch.randn(2, 16, pose_frames, height, width, generator=generator)}
    if clip:
        inputs["clip_fea"] = torch.randn(2, 5, 1280, generator=generator)
    if face_frames:
        inputs["face_pixel_values"] = torch.rand(2, 3, face_frames, FACE, FACE, generator=generator) * 2 - 1
    x = torch.randn(2, 36, frames, height, width, generator=generator)
    return x, torch.tensor([700.0, 300.0]), inputs


def make_cases() -> dict:
    """diffusers takes exactly frames - 1 pose frames and 4 (frames - 2) + 1 face frames: 30 tokens (2 frames of 15,
    H and W padded) with one face frame, and 18 tokens (3 frames of 6) without a face video."""
    g = torch.Generator().manual_seed(1)
    return {"face_and_pose_padded": _call(g, 2, 5, 9, pose_frames=1, face_frames=1),
            "pose_without_face": _call(g, 3, 4, 6, pose_frames=2, face_frames=0)}


def comfy_cases() -> dict:
    """Frame counts diffusers cannot take (ComfyUI pads the motion tokens with zeros, drops extra pose frames), no
    CLIP features (the image branch attends to the text), a short prompt; ComfyUI's pose embedding needs even H, W."""
    g = torch.Generator().manual_seed(2)
    return {"short_face_and_pose": _call(g, 3, 4, 6, pose_frames=1, face_frames=1, text_tokens=7),
            "long_pose_no_clip": _call(g, 3, 2, 4, pose_frames=4, face_frames=0, clip=False, text_tokens=7)}


@pytest.fixture(scope="session")
def model():
    return build_tiny_model("wan", SEED, variant="animate", **SIZE)


@pytest.fixture(scope="session")
def path(tmp_path_factory):
    return write_tiny_checkpoint("wan", str(tmp_path_factory.mktemp("wan_animate") / "animate.safetensors"),
                                 seed=SEED, variant="animate", prefix=COMFY_PREFIX, **SIZE)


@pytest.fixture(scope="session")
def references(model):
    return {name: reference_forward(model, x, t, **inputs) for name, (x, t, inputs) in make_cases().items()}


def test_fp32_parity(family_pool, path, references):
    handle = family_pool.load_model(path)
    assert (handle.info.variant, handle.info.config["num_heads"]) == ("animate", 3)
    for name, (x, t, inputs) in make_cases().items():
        assert_parity(handle(x, t, **inputs), references[name], "float32", f"animate/{name}")


def test_the_face_and_the_pose_change_the_output(model, references):
    x, t, inputs = make_cases()["face_and_pose_padded"]
    faceless = reference_forward(model, x, t, **{**inputs, "face_pixel_values": None})
    assert relative_error(faceless, references["face_and_pose_padded"]) > 1e-3
    x, t, inputs = make_cases()["pose_without_face"]
    still = reference_forward(model, x, t, **{**inputs, "pose_latents": torch.zeros_like(inputs["pose_latents"])})
    assert relative_error(still, references["pose_without_face"]) > 1e-3


@pytest.fixture(scope="session")
def other_layouts(tmp_path_factory):
    """The same weights without the prefix, and as a diffusers folder."""
    folder = tmp_path_factory.mktemp("wan_animate_layouts")
    return [write_tiny_checkpoint("wan", str(folder / "bare.safetensors"), seed=SEED, variant="animate", **SIZE),
            write_tiny_checkpoint("wan", str(folder / "diffusers"), layout="diffusers_folder", seed=SEED,
                                  variant="animate", **SIZE)]


def test_detection_in_every_layout(path, other_layouts):
    found = detect(read_checkpoint_header(path))
    assert (found.variant, found.layout, found.prefix) == ("animate", "original", COMFY_PREFIX)
    assert {key: found.config[key] for key in ("latent_channels", "motion_dim", "face_encoder_num_heads",
                                               "num_layers", "in_channels", "image_dim")} == {
        "latent_channels": 16, "motion_dim": 20, "face_encoder_num_heads": 4, "num_layers": 5, "in_channels": 36,
        "image_dim": 1280}
    assert wan.COMFY.model_class(found.variant) == "WAN22_Animate"
    bare, folder = (detect(read_checkpoint_header(where)) for where in other_layouts)
    assert (bare.variant, bare.layout, bare.prefix) == ("animate", "original", "")
    assert (folder.variant, folder.layout, folder.config["motion_style_dim"]) == ("animate", "diffusers", 512)


def test_every_layout_loads_the_same_model(other_layouts, references):
    groups = ParallelGroups(SPConfig(["cpu"]), 0, SeqParallel.single(), None, 0, None)
    x, t, inputs = make_cases()["pose_without_face"]
    for where in other_layouts:
        worker = load_worker_model(LoadRequest(where), torch.device("cpu"), groups, lambda *_: None)
        out = torch.empty(2, 16, *x.shape[2:])
        with torch.no_grad():
            worker.forward(x, t, inputs, out, LocalContext(groups))
        assert_parity(out, references["pose_without_face"], "float32", "animate/layouts")


def test_key_plan_equals_diffusers_converter(model):
    """Our per-tensor plan gives what diffusers' converter gives (the blur kernels, fixed buffers that diffusers
    rebuilds and its converter leaves unconverted, are read past), and that is the model's own state."""
    from diffusers.loaders.single_file_utils import convert_wan_transformer_to_diffusers
    from sp_runtime.families.wan.keys import wan_key_plan
    original = original_state_dict("wan", model)
    expected = convert_wan_transformer_to_diffusers({COMFY_PREFIX + k: v for k, v in original.items()})
    kernels = {key for key in expected if key.endswith(".kernel")}
    assert len(kernels) == 14 and kernels <= set(original)
    plan = wan_key_plan(original)
    assert set(plan) == set(original), "every original key has a destination"
    ours = {target: transform(original[source]) if transform else original[source]
            for source, targets in plan.items() for target, transform in targets}
    state = model.state_dict()
    assert ours.keys() == expected.keys() - kernels == state.keys()
    assert all(torch.equal(ours[key], expected[key]) and torch.equal(ours[key], state[key]) for key in ours)


def test_bad_animate_inputs_are_named(path):
    groups = ParallelGroups(SPConfig(["cpu"]), 0, SeqParallel.single(), None, 0, None)
    worker = load_worker_model(LoadRequest(path), torch.device("cpu"), groups, lambda *_: None)
    x, t, inputs = make_cases()["pose_without_face"]
    out = torch.empty(2, 16, *x.shape[2:])
    with pytest.raises(ValueError, match=r"pose_latents has shape \[2, 16, 2, 4, 5\]; this Wan Animate model takes "
                                         r"\[B, 16, frames, 4, 6\]"):
        worker.forward(x, t, {**inputs, "pose_latents": inputs["pose_latents"][..., :5]}, out, LocalContext(groups))
    with pytest.raises(ValueError, match=r"face_pixel_values has shape \[2, 3, 1, 64, 64\]; this Wan Animate model "
                                         r"takes \[B, 3, frames, 512, 512\]"):
        worker.forward(x, t, {**inputs, "face_pixel_values": torch.zeros(2, 3, 1, 64, 64)}, out, LocalContext(groups))


# ---------------------------------------------------------------------------------------------------------------
# ComfyUI's own Animate model (COMFYUI_PATH)

COMFY_UNET = dict(cs.COMFY_TINY_UNET["wan"], model_type="animate", in_dim=36, dim=384, num_heads=3, num_layers=5)


@pytest.fixture(scope="session")
def comfy_animate(path):
    """ComfyUI's own WAN22_Animate model (AnimateWanModel) with the file's weights, in a ModelPatcher."""
    if cs.comfyui_path() is None:
        pytest.skip(cs.NO_COMFYUI)
    cs.import_comfy()
    import comfy.model_patcher
    import comfy.supported_models
    import comfy.utils
    config = comfy.supported_models.WAN22_Animate(dict(COMFY_UNET))
    config.set_inference_dtype(torch.float32, None)
    model = config.get_model({})
    weights = comfy.utils.load_torch_file(path)
    model.diffusion_model.load_state_dict({key.removeprefix(COMFY_PREFIX): value for key, value in weights.items()},
                                          strict=True)
    assert type(model.diffusion_model).__name__ == "AnimateWanModel"
    cpu = torch.device("cpu")
    return comfy.model_patcher.ModelPatcher(model, load_device=cpu, offload_device=cpu)


def test_comfyui_animate_parity(family_pool, path, comfy_animate):
    network = comfy_animate.model.diffusion_model
    handle = family_pool.load_model(path)
    for name, (x, t, inputs) in comfy_cases().items():
        with torch.no_grad():
            expected = network(x, t, **inputs)
        assert_parity(handle(x, t, **inputs), expected, "float32", f"animate_comfyui/{name}")


def animate_conditioning(seed: int, frames: int, height: int, width: int):
    """(positive, negative) as WanAnimateToVideo gives them (reference + video latents with their mask, pose video
    latents, the face video, CLIP features), the negative's face video all -1 as there."""
    from types import SimpleNamespace
    g = torch.Generator().manual_seed(seed)
    latent = lambda channels, count: torch.randn(1, channels, count, height, width, generator=g)  # noqa: E731
    shared = {"concat_latent_image": latent(16, frames), "concat_mask": (latent(4, frames) > 0).float(),
              "pose_video_latent": latent(16, frames - 1),
              "clip_vision_output": SimpleNamespace(penultimate_hidden_states=torch.randn(1, 5, 1280, generator=g))}
    face = torch.rand(1, 3, 1, FACE, FACE, generator=g) * 2 - 1
    positive, negative = cs.conditioning("wan", 1), cs.conditioning("wan", 2)
    positive[0][1].update(shared, face_video_pixels=face)
    negative[0][1].update(shared, face_video_pixels=face * 0 - 1)
    return positive, negative


def test_stock_sampler_on_the_sp_animate_model_equals_comfys_own(comfy_animate, path, tmp_path):
    """The loader node's MODEL (ComfyUI's WAN22_Animate class around the pool, devices cpu:2) in the stock
    KSampler's code, with WanAnimateToVideo's conditioning, equals ComfyUI's own Animate model."""
    import folder_paths
    import shutil
    folder = tmp_path / "diffusion_models"
    folder.mkdir()
    shutil.copy(path, folder / "tiny_animate.safetensors")
    folder_paths.add_model_folder_path("diffusion_models", str(folder), is_default=True)
    owner = cs.import_node_module("pool_owner").OWNER
    loader = cs.import_node_module("loader")
    try:
        model = loader.SPModelLoader.execute(unet_name="tiny_animate.safetensors", weight_dtype="fp32",
                                             devices="cpu:2", ulysses_degree=0, ring_degree=1,
                                             cfg_parallel=False).result[0]
        assert type(model.model) is type(comfy_animate.model)
        positive, negative = animate_conditioning(5, frames=3, height=4, width=6)
        expected = cs.sample(comfy_animate, positive, negative, steps=2, frames=3, height=4, width=6)
        cs.assert_close(cs.sample(model, positive, negative, steps=2, frames=3, height=4, width=6), expected)
    finally:
        owner.close_all()
