"""ComfyUI tier: LTX-2.3 and 2.5 through the pool (Ulysses 2 and 3) and test_ltx23's diffusers-based reference equal
ComfyUI's own LTXAVModel (comfy.ldm.lightricks.av_model) on the same tiny files, built as ComfyUI's loader builds
it (comfy.model_detection's unet config from the tensors and the `config` metadata) and called as its LTXAV model
class calls it: the prompt (the text encoder's video and audio features, flagged unprocessed) through its
preprocess_text_embeds, sigma x denoise mask per video token for image-to-video and for two strength-1.0 guide frames
(keyframe_idxs; LTX-2.5's keyframe marker on the first latent frame, guides excepted). Skips without COMFYUI_PATH, or
when that ComfyUI cannot build the release (LTX-2.3 needs ComfyUI >= 0.16.4, LTX-2.5 >= 0.32.0)."""
from __future__ import annotations

import os

import pytest
import torch

import comfy_support as cs
from family_support import assert_parity
from sp_lab.conformance.cases import seeded_randn
from sp_lab.references import ltx2 as ltx2_reference
from sp_runtime.families import ltx2
from sp_lab.tiny_models import COMFY_PREFIX, build_tiny_model, write_tiny_checkpoint
from sp_runtime.families.ltx2 import host as ltx2_host
from test_ltx23 import FEATURES
from test_ltx2_comfy import comfy_model as ltx2_comfy_model, guide_conds

pytest_plugins = ["family_pools"]  # the shared per-degree worker pools
SEED = 23
NEEDS = {"2.3": "0.16.4", "2.5": "0.32.0"}


def missing_comfyui() -> str:
    """Why this module cannot run ("" when it can), decided before any pool starts."""
    path = cs.comfyui_path()
    if path is None:
        return cs.NO_COMFYUI
    if not os.path.isfile(os.path.join(path, "comfy", "ldm", "lightricks", "av_model.py")):
        return f"ComfyUI at {path} has no comfy.ldm.lightricks.av_model (LTXAVModel); LTX-2.3 needs ComfyUI >= 0.16.4"
    return ""


pytestmark = pytest.mark.skipif(bool(missing_comfyui()), reason=missing_comfyui())


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("ltx23_comfy")
    return {release: write_tiny_checkpoint("ltx2", str(folder / f"ltx-{release}.safetensors"), seed=SEED,
                                           prefix=COMFY_PREFIX, release=release) for release in NEEDS}


def comfy_model(path: str, release: str):
    """ComfyUI's LTXAVModel of the file as its loader builds it; a skip naming the version when it cannot."""
    cs.import_comfy()
    import comfy.ldm.lightricks.av_model as av_model
    try:
        return ltx2_comfy_model(av_model, path)
    except (RuntimeError, TypeError) as error:
        pytest.skip(f"ComfyUI at {cs.comfyui_path()} cannot build LTX-{release} (needs ComfyUI >= "
                    f"{NEEDS[release]}): {str(error)[:200]}")


def make_calls(seed=7):
    """name -> (video, audio, sigma [B], video denoise mask or None, prompt features, frame rate, guide conds)."""
    rand = seeded_randn(seed)
    i2v = torch.ones(2, 1, 3, 5, 3)
    i2v[:, :, 0] = 0
    guided = torch.ones(2, 1, 5, 3, 3)
    guided[:, :, 3:] = 0
    return {"t2v": (rand(2, 128, 3, 5, 3), rand(2, 8, 7, 16), torch.tensor([0.7, 0.4]), None,
                    rand(2, 9, FEATURES), 24.0, {}),
            "i2v": (rand(2, 128, 3, 5, 3), rand(2, 8, 2, 16), torch.tensor([0.8, 0.6]), i2v,
                    rand(2, 6, FEATURES), 25.0, {}),
            "guides": (rand(2, 128, 5, 3, 3), rand(2, 8, 7, 16), torch.tensor([0.8, 0.6]), guided,
                       rand(2, 9, FEATURES), 24.0, guide_conds((0, 17), (3, 3)))}


def comfy_call(model, video, audio, sigma, mask, prompt, frame_rate, conds):
    """ComfyUI's LTXAV model class around its diffusion model: process_timestep, extra_conds' preprocess_text_embeds
    (per conditioning, flagged unprocessed as ComfyUI's LTX-2.3 / 2.5 text encoders flag it), the diffusion model."""
    timestep = sigma
    if mask is not None:
        timestep = model.patchifier.patchify((mask * sigma.view(-1, 1, 1, 1, 1))[:, :1])[0]
    with torch.no_grad():
        context = torch.cat([model.preprocess_text_embeds(item[None], unprocessed=True) for item in prompt])
        out = model([video, audio], (timestep, sigma), context, frame_rate=frame_rate, transformer_options={},
                    denoise_mask=mask, **conds)
    return (timestep, sigma), out


@pytest.fixture(scope="module")
def expected(files):
    """(release, call) -> ((video, audio) timesteps ComfyUI's model got, its [video, audio] output)."""
    results = {}
    for release, path in files.items():
        model = comfy_model(path, release)
        for call, (video, audio, sigma, mask, prompt, rate, conds) in make_calls().items():
            results[release, call] = comfy_call(model, video, audio, sigma, mask, prompt, rate, conds)
    return results


@pytest.mark.parametrize("release", sorted(NEEDS))
def test_pool_equals_comfyuis_ltxav(family_pool, files, expected, release):
    degree = family_pool.config.world_size
    if degree not in (2, 3):
        pytest.skip("checked at Ulysses 2 and 3")
    handle = family_pool.load_model(files[release])
    for call, (video, audio, sigma, mask, prompt, rate, conds) in make_calls().items():
        timesteps, reference = expected[release, call]
        inputs = {"context": prompt, "frame_rate": rate, **conds,
                  **({"denoise_mask": mask} if mask is not None else {})}
        x, timestep, extra = ltx2.COMFY.hooks.pack([video, audio], timesteps, inputs)
        got = ltx2.COMFY.hooks.unpack(handle(x, timestep, **extra), [video, audio])
        for output, want, what in zip(got, reference, ("video", "audio")):
            assert_parity(output, want, "float32", f"comfyui_ltx{release}_{what}/u{degree}/{call}")
    handle.unload()


@pytest.mark.parametrize("release", sorted(NEEDS))
def test_diffusers_reference_equals_comfyui(expected, release):
    """test_ltx23's reference (diffusers' stock forward with ComfyUI's choices hooked in) against ComfyUI's model."""
    model = build_tiny_model("ltx2", SEED, release=release)
    for call, (video, audio, sigma, mask, prompt, rate, conds) in make_calls().items():
        (video_t, audio_t), reference = expected[release, call]
        video_t = ltx2_host.comfy_video_sigma(video_t, video.shape, mask)
        got = ltx2_reference.reference_forward(model, video, audio, video_t, prompt, audio_t, rate,
                                     keyframe_idxs=conds.get("keyframe_idxs"))
        for output, want, what in zip(got, reference, ("video", "audio")):
            assert_parity(output, want, "float32", f"comfyui_ltx{release}_{what}/diffusers_reference/{call}")
