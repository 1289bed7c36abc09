"""ComfyUI tier: LTX-2 through the pool equals ComfyUI's own LTXAVModel (comfy.ldm.lightricks.av_model) on the same
tiny file, called as ComfyUI's LTXAV model class calls it (its process_timestep: sigma x denoise mask per video
token; the prompt after its preprocess_text_embeds), at Ulysses 1-4 and Ulysses 2 x CFG 2: text-to-video,
image-to-video (first latent frame at sigma 0), an inpainting mask that varies within frames of the second batch
item only with batch items at different sigmas, two strength-1.0 guide frames (LTXVAddGuide's keyframe_idxs and
guide attention entries, made by ComfyUI's own patchifier), and a file whose config metadata states only sizes
(ComfyUI's defaults: token starts, no causal time fix, interleaved rope, gate factor 1 / 1000). The diffusers-based
reference of test_ltx2 (ltx2_reference.reference_forward) is checked against it too. Skips without COMFYUI_PATH, or when that ComfyUI
has no LTXAV model (0.3.64 has none)."""
from __future__ import annotations

import json
import os

import pytest
import torch

import comfy_support as cs
from family_support import assert_parity
from sp_lab.conformance.cases import seeded_randn
from sp_lab.references import ltx2 as ltx2_reference
from sp_runtime.families import ltx2
from sp_runtime.checkpoints.header import read_checkpoint_header
from sp_lab.tiny_models import COMFY_PREFIX, build_tiny_model, write_tiny_checkpoint
from sp_runtime.families.ltx2 import host as ltx2_host

pytest_plugins = ["family_pools"]  # the shared per-degree worker pools
SEED = 21
CAPTION = 48  # the tiny model's text encoder width
SIZES_ONLY = ("heads", "head_dim", "channels", "cross_attention_dim", "connector_num_layers")


def missing_comfyui() -> str:
    """Why this module cannot run ("" when it can), decided before any pool starts."""
    path = cs.comfyui_path()
    if path is None:
        return cs.NO_COMFYUI
    if not os.path.isfile(os.path.join(path, "comfy", "ldm", "lightricks", "av_model.py")):
        return (f"ComfyUI at {path} has no comfy.ldm.lightricks.av_model (LTX-2's LTXAVModel); needs ComfyUI "
                f">= 0.8")
    return ""


pytestmark = pytest.mark.skipif(bool(missing_comfyui()), reason=missing_comfyui())


@pytest.fixture(scope="module")
def comfy():
    """ComfyUI's av_model module."""
    cs.import_comfy()
    import comfy.ldm.lightricks.av_model as av_model
    return av_model


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """The tiny file with the release's config metadata, and the same weights with only the sizes stated."""
    from safetensors.torch import load_file, save_file
    folder = tmp_path_factory.mktemp("ltx2_comfy")
    release = write_tiny_checkpoint("ltx2", str(folder / "release.safetensors"), seed=SEED, prefix=COMFY_PREFIX)
    stated = json.loads(read_checkpoint_header(release).metadata["config"])["transformer"]
    sizes = {key: value for key, value in stated.items() if key.endswith(SIZES_ONLY)}
    bare = str(folder / "sizes_only.safetensors")
    save_file(load_file(release), bare, metadata={"config": json.dumps({"transformer": sizes})})
    return {"release": release, "sizes_only": bare}


def comfy_model(av_model, path: str):
    """ComfyUI's LTXAVModel as its loader builds it: the unet config from comfy.model_detection (shapes plus the
    file's config metadata), the weights loaded strictly."""
    import comfy.model_detection
    import comfy.ops
    from safetensors.torch import load_file
    state = {key[len(COMFY_PREFIX):]: value for key, value in load_file(path).items()}
    config = comfy.model_detection.detect_unet_config(state, "", read_checkpoint_header(path).metadata)
    config.pop("image_model")
    model = av_model.LTXAVModel(**config, dtype=torch.float32, device="cpu",
                                operations=comfy.ops.disable_weight_init)
    model.load_state_dict(state, strict=True)
    return model.eval()


def make_calls(seed=5):
    """name -> (video, audio, sigma [B], video denoise mask or None, raw prompt, frame rate, guide conditioning)."""
    rand = seeded_randn(seed)
    i2v = torch.ones(2, 1, 3, 5, 3)
    i2v[:, :, 0] = 0
    inpaint = torch.ones(2, 1, 3, 5, 3)
    inpaint[1, :, 1, :2] = 0.25  # item 1 only: ComfyUI reads item 0's mask and takes each frame's first token
    guided = torch.ones(2, 1, 5, 3, 3)
    guided[:, :, 3:] = 0  # two one-frame guides at strength 1.0 appended after three latent frames
    return {"t2v": (rand(2, 128, 3, 5, 3), rand(2, 8, 7, 16), torch.tensor([0.7, 0.7]), None, rand(2, 9, CAPTION),
                    24.0, {}),
            "i2v": (rand(2, 128, 3, 5, 3), rand(2, 8, 7, 16), torch.tensor([0.8, 0.8]), i2v, rand(2, 9, CAPTION),
                    25.0, {}),
            "inpaint": (rand(2, 128, 3, 5, 3), rand(2, 8, 2, 16), torch.tensor([0.9, 0.6]), inpaint,
                        rand(2, 6, CAPTION), 24.0, {}),
            "guides": (rand(2, 128, 5, 3, 3), rand(2, 8, 7, 16), torch.tensor([0.8, 0.6]), guided,
                       rand(2, 9, CAPTION), 24.0, guide_conds((0, 17), (3, 3))),
            "guides_0.7": (rand(2, 128, 5, 3, 3), rand(2, 8, 7, 16), torch.tensor([0.8, 0.6]), guided,
                           rand(2, 9, CAPTION), 24.0, guide_conds((0, 17), (3, 3), strengths=(0.7, 1.0))),
            "guides_masked": (rand(2, 128, 5, 3, 3), rand(2, 8, 7, 16), torch.tensor([0.8, 0.6]), guided,
                              rand(2, 9, CAPTION), 24.0, guide_conds((0, 17), (3, 3), strengths=(1.0, 0.9),
                                                                     pixel_masks=(None, rand(1, 1, 1, 20, 20).abs())))}


GUIDE_CALLS = ("guides", "guides_0.7", "guides_masked")


def guide_conds(frames, size, strengths=None, pixel_masks=None):
    """keyframe_idxs and guide_attention_entries as ComfyUI's newest LTXVAddGuide makes them for one-frame guides
    at these pixel frames (its patchifier's corners, latent_to_pixel_coords with the causal fix one-frame guides
    take, plus the frame index), repeated to batch 2 as its CONDRegular does; `strengths` per guide (1.0 each by
    default; another makes ComfyUI's model build its per-guide self-attention mask) and `pixel_masks` (LTXVAddGuide's
    attention_mask as its entry holds it, [1, 1, F, H, W], or None) per guide."""
    from comfy.ldm.lightricks.symmetric_patchifier import SymmetricPatchifier, latent_to_pixel_coords
    bounds = []
    for frame in frames:
        _, corners = SymmetricPatchifier(1, start_end=True).patchify(torch.zeros(1, 128, 1, *size))
        coords = latent_to_pixel_coords(corners, ltx2_host.VAE_SCALE_FACTORS, causal_fix=True)
        coords[:, 0] += frame
        bounds.append(coords)
    entries = [{"pre_filter_count": size[0] * size[1], "strength": strength, "pixel_mask": pixel_mask,
                "latent_shape": [1, *size]}
               for strength, pixel_mask in zip(strengths or [1.0] * len(frames), pixel_masks or [None] * len(frames))]
    return {"keyframe_idxs": torch.cat(bounds, dim=2).repeat(2, 1, 1, 1), "guide_attention_entries": entries}


def comfy_call(model, video, audio, sigma, mask, prompt, frame_rate, conds):
    """ComfyUI's LTXAV model class around its diffusion model: process_timestep (sigma x mask per video token, the
    audio's sigma as it is), extra_conds' preprocess_text_embeds (per conditioning, before batching), then the
    diffusion model."""
    timestep = sigma
    if mask is not None:
        timestep = model.patchifier.patchify((mask * sigma.view(-1, 1, 1, 1, 1))[:, :1])[0]
    with torch.no_grad():
        context = torch.cat([model.preprocess_text_embeds(item[None]) for item in prompt])
        out = model([video, audio], (timestep, sigma), context, frame_rate=frame_rate, transformer_options={},
                    denoise_mask=mask, **conds)
    return (timestep, sigma), out


def pool_call(handle, video, audio, timesteps, mask, prompt, frame_rate, conds):
    """What the host's proxy does with the same call (ltx2.COMFY's host hooks pack / unpack)."""
    inputs = {"context": prompt, "frame_rate": frame_rate, **conds,
              **({"denoise_mask": mask} if mask is not None else {})}
    x, timestep, extra = ltx2.COMFY.hooks.pack([video, audio], timesteps, inputs)
    return ltx2.COMFY.hooks.unpack(handle(x, timestep, **extra), [video, audio])


@pytest.fixture(scope="module")
def expected(comfy, files):
    """(file, call) -> ((video, audio) timesteps ComfyUI's model got, its [video, audio] output)."""
    results = {}
    for name, path in files.items():
        model = comfy_model(comfy, path)
        for call, (video, audio, sigma, mask, prompt, rate, conds) in make_calls().items():
            results[name, call] = comfy_call(model, video, audio, sigma, mask, prompt, rate, conds)
    return results


def check_pool(pool, files, expected, layout, calls=None):
    for name, path in files.items():
        handle = pool.load_model(path)
        for call, (video, audio, sigma, mask, prompt, rate, conds) in make_calls().items():
            if calls is not None and call not in calls:
                continue
            timesteps, reference = expected[name, call]
            got = pool_call(handle, video, audio, timesteps, mask, prompt, rate, conds)
            for output, want, what in zip(got, reference, ("video", "audio")):
                assert_parity(output, want, "float32", f"comfyui_ltx2_{what}/{layout}/{name}/{call}")
        handle.unload()


def test_pool_equals_comfyuis_ltxav(family_pool, files, expected):
    check_pool(family_pool, files, expected, f"u{family_pool.config.world_size}")


def test_pool_equals_comfyuis_ltxav_under_cfg_parallel(layout_pool, files, expected):
    """The batch halves on two groups gate with the whole call's largest sigmas, as ComfyUI does."""
    layout, pool = layout_pool
    if layout != "u2cfg2":
        pytest.skip("checked under Ulysses 2 x CFG 2")
    check_pool(pool, files, expected, layout)


def test_guides_at_any_strength_equal_comfyuis_under_ring(layout_pool, files, expected):
    """Guides at strengths 0.7 and 1.0 (ComfyUI's per-guide self-attention mask, sp_attention's structured
    GuideMask) per query block x key block of the ring: pure Ring 3 and Ulysses 2 x Ring 2 (uneven shards)."""
    layout, pool = layout_pool
    if layout not in ("u1r3", "u2r2"):
        pytest.skip("checked on the Ring layouts")
    check_pool(pool, {"release": files["release"]}, expected, layout, GUIDE_CALLS)


def test_guide_strength_changes_comfyuis_output(comfy, files, expected):
    """Guards against a strength that does nothing: the same call with both guides at 1.0 gives another video and
    audio (the mask reaches ComfyUI's model, so a pool that dropped it would fail the parity tests)."""
    video, audio, sigma, mask, prompt, rate, _ = make_calls()["guides_0.7"]
    full = comfy_call(comfy_model(comfy, files["release"]), video, audio, sigma, mask, prompt, rate,
                      guide_conds((0, 17), (3, 3)))[1]
    for at_full, weak in zip(full, expected["release", "guides_0.7"][1]):
        assert (at_full - weak).abs().max() > 1e-3 * weak.abs().max()


@pytest.mark.parametrize("shape,latent", [((1, 1, 1, 20, 20), (1, 3, 3)), ((2, 1, 9, 10, 12), (3, 3, 4)),
                                          ((1, 1, 3, 8, 8), (5, 2, 2)), ((1, 1, 1, 8, 8), (3, 2, 2))])
def test_guide_pixel_masks_reduce_as_comfyuis_model_reduces_them(comfy, shape, latent):
    """latent_mask_weights equals ComfyUI's LTXV model's reduction of a guide's attention_mask to latent tokens:
    groups of pixel frames, fewer pixel frames than latent frames, one pixel frame."""
    mask = torch.rand(*shape, generator=torch.Generator().manual_seed(3))
    want = comfy.LTXAVModel._downsample_mask_to_latent(mask, *latent)
    assert torch.allclose(ltx2_host.latent_mask_weights(mask, *latent), want, atol=1e-7)


def test_diffusers_reference_equals_comfyui(files, expected):
    """test_ltx2's reference (diffusers' stock forward with ComfyUI's choices hooked in) on the release file's
    conventions, per token as ComfyUI's model reads the timesteps."""
    model = build_tiny_model("ltx2", SEED)
    for call, (video, audio, sigma, mask, prompt, rate, conds) in make_calls().items():
        if call in ("guides_0.7", "guides_masked"):
            continue  # the diffusers-based reference has no guide mask
        (video_t, audio_t), reference = expected["release", call]
        video_t = ltx2_host.comfy_video_sigma(video_t, video.shape, mask)
        got = ltx2_reference.reference_forward(model, video, audio, video_t, prompt, audio_t, rate,
                                     keyframe_idxs=conds.get("keyframe_idxs"))
        for output, want, what in zip(got, reference, ("video", "audio")):
            assert_parity(output, want, "float32", f"comfyui_ltx2_{what}/diffusers_reference/{call}")
