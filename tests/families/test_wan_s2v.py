"""Wan 2.2 S2V under Ulysses SP: ComfyUI's audio_embed (audio injected after blocks 0 and 4, frame by frame),
reference_latent and reference_motion (extra tokens with their own, partly fractional and negative, rotary
positions and timestep 0) and control_video equal a single-process run of diffusers' stock blocks over the whole
sequence (sp_lab.references.wan.s2v_reference_forward) at degrees 1-4 (3 heads of 128), token ranges that split frames, padded sizes,
batch 2; and ComfyUI's own WanModel_S2V on the same weights where COMFYUI_PATH is set. Bad inputs are named."""
from __future__ import annotations

import pytest
import torch

from family_support import LocalContext, assert_parity, relative_error
from sp_runtime.config import SPConfig
from sp_lab.references.wan import reference_forward
from sp_runtime.contract import LoadRequest
from sp_runtime.detection import detect
from sp_runtime.pool.loading import load_worker_model
from sp_runtime.checkpoints.header import Header
from sp_runtime.families.wan.detect import detect as detect_header
from sp_runtime.families.wan.s2v import attach as attach_s2v
from sp_runtime.groups import ParallelGroups, SeqParallel
from sp_lab.tiny_models import COMFY_PREFIX, build_tiny_model, write_tiny_checkpoint
from sp_lab.tiny_models.wan import S2V_TINY, original_state_dict

pytest_plugins = ["family_pools"]  # the shared per-degree worker pools

SEED = 13
SIZE = dict(num_attention_heads=3, attention_head_dim=128)  # 3 heads: 2 and 4 ranks do not divide them
TEXT_DIM = 32


def make_cases() -> dict:
    """(x, timestep, kwargs) as ComfyUI's WAN22_S2V passes them."""
    g = torch.Generator().manual_seed(1)

    def call(batch, frames, height, width, audio=True, reference=False, motion=0, control=False):
        inputs = {"context": torch.randn(batch, 7, TEXT_DIM, generator=g)}
        if audio:
            inputs["audio_embed"] = torch.randn(batch, S2V_TINY["audio_layers"], S2V_TINY["audio_dim"], 4 * frames,
                                                generator=g)
        if reference:
            inputs["reference_latent"] = torch.randn(batch, 16, 1, height + height % 2, width + width % 2, generator=g)
        if motion:
            inputs["reference_motion"] = torch.randn(batch, 16, motion, 8, 10, generator=g)
        if control:
            inputs["control_video"] = torch.randn(batch, 16, frames, height, width, generator=g)
        return torch.randn(batch, 16, frames, height, width, generator=g), torch.tensor([700.0, 300.0])[:batch], \
            inputs

    return {"everything": call(2, 3, 8, 10, reference=True, motion=5, control=True),
            "odd_sizes_reference": call(2, 2, 5, 7, reference=True, control=True),
            "motion_of_19_frames": call(2, 2, 8, 8, motion=21),
            "audio_only": call(2, 3, 4, 6),
            "no_audio_batch_1": call(1, 1, 8, 8, audio=False, reference=True, motion=2)}


@pytest.fixture(scope="session")
def path(tmp_path_factory):
    return write_tiny_checkpoint("wan", str(tmp_path_factory.mktemp("wan_s2v") / "s2v.safetensors"), seed=SEED,
                                 variant="s2v", prefix=COMFY_PREFIX, **SIZE)


@pytest.fixture(scope="session")
def model():
    return build_tiny_model("wan", SEED, variant="s2v", **SIZE)


@pytest.fixture(scope="session")
def worker(path):
    """The worker model of one process (no pool), for the checks of bad inputs."""
    groups = ParallelGroups(SPConfig(["cpu"]), 0, SeqParallel.single(), None, 0, None)
    loaded = load_worker_model(LoadRequest(path), torch.device("cpu"), groups, lambda *_: None)
    loaded.groups = groups
    return loaded


@pytest.fixture(scope="session")
def references(model):
    return {name: reference_forward(model, x, t, **inputs) for name, (x, t, inputs) in make_cases().items()}


def test_detection(path, tmp_path):
    found = detect(path)
    assert (found.family, found.variant, found.prefix) == ("wan", "s2v", COMFY_PREFIX)
    assert found.config["s2v"] == S2V_TINY and found.config["num_attention_heads"] == 3
    bare = write_tiny_checkpoint("wan", str(tmp_path / "bare.safetensors"), variant="s2v")
    assert (detect(bare).variant, detect(bare).prefix) == ("s2v", "")


def test_the_released_header_is_classified():
    """Wan2.2-S2V-14B's shapes (no weights): 12 audio injectors after ComfyUI's blocks, 1024-wide audio of 25
    layers, 4 audio tokens per frame."""
    from accelerate import init_empty_weights
    from diffusers import WanTransformer3DModel
    released = dict(audio_dim=1024, audio_layers=25, audio_tokens=4, cond_dim=16,
                    inject_layers=[0, 4, 8, 12, 16, 20, 24, 27, 30, 33, 36, 39])
    with init_empty_weights():
        model = WanTransformer3DModel(attention_head_dim=128, num_attention_heads=40, ffn_dim=13824, num_layers=40)
        attach_s2v(model, {"s2v": released})
    header = Header("s2v_14B.safetensors", {COMFY_PREFIX + key: ("BF16", tuple(value.shape))
                                            for key, value in original_state_dict(model).items()})
    found = detect_header(header)
    assert (found.variant, found.config["s2v"], found.config["num_attention_heads"]) == ("s2v", released, 40)


def test_fp32_parity(family_pool, path, references):
    handle = family_pool.load_model(path)
    assert (handle.info.variant, handle.info.config["num_heads"]) == ("s2v", 3)
    for name, (x, t, inputs) in make_cases().items():
        assert_parity(handle(x, t, **inputs), references[name], "float32", f"s2v/{name}")


def test_every_input_changes_the_output(model, references):
    x, t, inputs = make_cases()["everything"]
    for name in ("audio_embed", "reference_latent", "reference_motion", "control_video"):
        without = reference_forward(model, x, t, **{k: v for k, v in inputs.items() if k != name})
        assert relative_error(without, references["everything"]) > 1e-3, name


@pytest.mark.parametrize("name, value, message", [
    ("audio_embed", torch.zeros(2, 25, 31, 12), r"audio_embed has shape \[2, 25, 31, 12\]; this Wan S2V model takes "
                                               r"\[B, 25, 32, 4 x latent frames\]"),
    ("reference_motion", torch.zeros(2, 16, 3, 6, 10), r"height and width must be even and at least 8"),
    ("control_video", torch.zeros(2, 16, 3, 8, 8), r"control_video has shape \[2, 16, 3, 8, 8\]; this Wan S2V model "
                                                   r"takes \[B, 16, 3, 8, 10\]"),
    ("time_dim_concat", torch.zeros(2, 16, 1, 8, 10), r"time_dim_concat is not taken by a Wan s2v model"),
])
def test_bad_inputs_are_named(worker, name, value, message):
    x, t, inputs = make_cases()["everything"]
    with pytest.raises(ValueError, match=message):
        worker.forward(x, t, {**inputs, name: value}, torch.empty(x.shape), LocalContext(worker.groups))


def test_audio_frames_must_split_the_video_tokens(worker):
    """ComfyUI regroups the video tokens by the audio's frames; when they do not split evenly it cannot run."""
    x, t, inputs = make_cases()["everything"]
    x = x[:, :, :, :2, :6]  # 3 frames of 3 tokens; 5 audio entries make 2 audio frames
    call = {"context": inputs["context"], "audio_embed": inputs["audio_embed"][..., :5]}
    with pytest.raises(ValueError, match=r"audio_embed covers 2 latent frames \(5 entries, 4 per frame\), which do "
                                         r"not split x's 9 video tokens evenly"):
        worker.forward(x, t, call, torch.empty(x.shape), LocalContext(worker.groups))


# ---------------------------------------------------------------------------------------------------------------
# ComfyUI's own WanModel_S2V (only where COMFYUI_PATH points at a ComfyUI checkout)

@pytest.fixture(scope="session")
def comfyui():
    from comfy_support import NO_COMFYUI, comfyui_path, import_comfy
    if comfyui_path() is None:
        pytest.skip(NO_COMFYUI)
    return import_comfy()


@pytest.fixture(scope="session")
def comfy_outputs(comfyui, path):
    """ComfyUI's WanModel_S2V with the tiny file's weights, called as WAN22_S2V calls it (conditions batched), on
    the cases it can run (even sizes: it does not pad control_video)."""
    import comfy.ldm.wan.model as comfy_wan
    import comfy.ops
    from safetensors.torch import load_file
    config = build_tiny_model("wan", SEED, variant="s2v", **SIZE).config
    comfy_model = comfy_wan.WanModel_S2V(
        dim=384, ffn_dim=config.ffn_dim, text_dim=TEXT_DIM, num_heads=3, num_layers=config.num_layers,
        audio_dim=S2V_TINY["audio_dim"], num_audio_token=S2V_TINY["audio_tokens"], cond_dim=S2V_TINY["cond_dim"],
        audio_inject_layers=S2V_TINY["inject_layers"], device="cpu", dtype=torch.float32,
        operations=comfy.ops.disable_weight_init)
    missing, unexpected = comfy_model.load_state_dict(
        {key[len(COMFY_PREFIX):]: value for key, value in load_file(path).items()}, strict=False)
    assert not missing and not unexpected, (missing, unexpected)
    outputs = {}
    for name, (x, t, inputs) in make_cases().items():
        if x.shape[3] % 2 or x.shape[4] % 2:
            continue
        with torch.no_grad():
            outputs[name] = comfy_model(x, t, transformer_options={}, **inputs)
    return outputs


def test_comfyui_parity(comfy_outputs, family_pool, path):
    handle = family_pool.load_model(path)
    cases = make_cases()
    for name, expected in comfy_outputs.items():
        x, t, inputs = cases[name]
        assert_parity(handle(x, t, **inputs), expected, "float32", f"comfyui_s2v/{name}")


def comfy_unet_config() -> dict:
    """ComfyUI's WAN22_S2V unet config of the tiny S2V (its detection assumes the real sizes)."""
    import comfy_support as cs
    return dict(cs.COMFY_TINY_UNET["wan"], model_type="s2v", dim=384, num_heads=3, num_layers=5,
                audio_dim=S2V_TINY["audio_dim"], num_audio_token=S2V_TINY["audio_tokens"],
                cond_dim=S2V_TINY["cond_dim"], audio_inject_layers=S2V_TINY["inject_layers"])


def s2v_conditioning(seed: int = 5):
    """(positive, negative) as WanSoundImageToVideo sets them: audio_embed (silent for the negative),
    reference_latents, reference_motion, control_video; for 3 latent frames of 10 x 14."""
    import comfy_support as cs
    import node_helpers
    g = torch.Generator().manual_seed(seed)
    audio = torch.randn(1, S2V_TINY["audio_layers"], S2V_TINY["audio_dim"], 12, generator=g)
    shared = {"reference_latents": [torch.randn(1, 16, 1, 10, 14, generator=g)],
              "reference_motion": torch.randn(1, 16, 19, 10, 14, generator=g),
              "control_video": torch.randn(1, 16, 3, 10, 14, generator=g)}
    positive = node_helpers.conditioning_set_values(cs.conditioning("wan", 1), {**shared, "audio_embed": audio})
    negative = node_helpers.conditioning_set_values(cs.conditioning("wan", 2), {**shared, "audio_embed": audio * 0})
    return positive, negative


def test_stock_sampler_on_the_sp_model_equals_comfys_own(comfyui, path, tmp_path):
    """The SP loader's MODEL (ComfyUI's WAN22_S2V host class around the pool, cpu:2) in the stock sampler, with
    conditioning as WanSoundImageToVideo sets it (audio_embed, silent for the negative, reference_latents,
    reference_motion, control_video), equals ComfyUI's own WAN22_S2V with the same weights."""
    import shutil

    import comfy.model_patcher
    import comfy.supported_models
    import comfy.utils
    import comfy_support as cs
    import folder_paths
    models = tmp_path / "diffusion_models"
    models.mkdir()
    shutil.copy(path, models / "s2v.safetensors")
    folder_paths.add_model_folder_path("diffusion_models", str(models), is_default=True)
    config = comfy.supported_models.WAN22_S2V(comfy_unet_config())
    config.set_inference_dtype(torch.float32, None)
    own = config.get_model({})
    own.diffusion_model.load_state_dict({key[len(COMFY_PREFIX):]: value
                                         for key, value in comfy.utils.load_torch_file(path).items()}, strict=True)
    own = comfy.model_patcher.ModelPatcher(own, load_device=torch.device("cpu"), offload_device=torch.device("cpu"))
    owner = cs.import_node_module("pool_owner").OWNER
    try:
        sp_model = cs.import_node_module("loader").SPModelLoader.execute(
            unet_name="s2v.safetensors", weight_dtype="fp32", devices="cpu:2", ulysses_degree=0,
            ring_degree=1, cfg_parallel=False).result[0]
        assert type(sp_model.model) is type(own.model)
        positive, negative = s2v_conditioning()
        expected = cs.sample(own, positive, negative, frames=3)
        cs.assert_close(cs.sample(sp_model, positive, negative, frames=3), expected)
    finally:
        owner.close_all()
