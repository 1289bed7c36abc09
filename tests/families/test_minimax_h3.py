"""MiniMax H3 under Ulysses SP: the pool's output equals diffusers' stock MiniMaxH3Transformer3DModel forward on one
process (sp_lab.references.minimax_h3, fed ComfyUI's packed call) at degrees 1-4 and under Ring 3, Ulysses 2 x Ring 2
and Ulysses 2 x CFG 2, on tiny models (3 heads of 32 channels, 24 rotated; no degree above 1 divides 3) in the three
file forms: pruned (the curve time embedding of every template file), full, and FastH3's head bank. Cases: batch 2
with 62 packed rows (text 7, audio 10, video 45), fl2va first / last frames as keyframe rows (batch 1). Also: the key
plan against diffusers' converter and the hand-written writer, detection (prefix or not, released sizes, neighbours),
the host's packing (audio scale, keyframe noise) and refusals by name."""
from __future__ import annotations

import math

import pytest
import torch

from family_support import FP32_TOL, assert_parity, relative_error
from sp_lab.references.minimax_h3 import reference_forward
from sp_lab.tiny_models import COMFY_PREFIX, write_tiny_checkpoint as write_other
from sp_lab.tiny_models import minimax_h3 as tiny
from sp_runtime.checkpoints.header import Header, read_checkpoint_header
from sp_runtime.detection import detect as detect_any
from sp_runtime.families import minimax_h3

pytest_plugins = ["family_pools"]
SEED = 4
SIGMAS = torch.tensor([1.0, 0.8, 0.7, 0.4, 0.0])


def make_cases(seed=2):
    g = torch.Generator().manual_seed(seed)

    def case(batch, frames, height, width, steps, text, keyframes=0, references=False):
        video = torch.randn(batch, 4, frames, height, width, generator=g)
        audio = torch.randn(batch, 6, 2, steps, generator=g)
        inputs = {"context": torch.randn(batch, text, 20, generator=g),
                  "latent_shapes": [list(video.shape), list(audio.shape)], "sample_sigmas": SIGMAS}
        if keyframes:
            inputs.update(keyframe_latents=[torch.randn(1, 4, 1, height, width, generator=g) for _ in range(keyframes)],
                          keyframe_frames=[0, 8][:keyframes])
        if references:  # ref2va / omni-ref: an image at its own size, a clip with its soundtrack, a standalone audio
            inputs.update(references=[
                {"kind": "image", "latent": torch.randn(1, 4, 1, 6, 4, generator=g)},
                {"kind": "video_audio", "latent": torch.randn(1, 4, 2, 4, 4, generator=g),
                 "audio": torch.randn(1, 6, 2, 5, generator=g)},
                {"kind": "audio", "audio": torch.randn(1, 6, 2, 2, generator=g)}],
                text_token_tags=torch.tensor([1, 0, 0, 0, 1, 1]), audio_cond_timestep=0.95, keyframe_timestep=0.99,
                keyframe_audio_latents=[torch.randn(1, 6, 2, 2, generator=g)], keyframe_audio_frames=[4])
        timestep = torch.tensor([700.0] * batch)
        return torch.cat([video.flatten(1), audio.flatten(1)], 1).unsqueeze(1), timestep, inputs
    return {"62_rows_batch2": case(2, 3, 6, 10, 5, 7), "fl2va_keyframes": case(1, 2, 4, 6, 3, 5, keyframes=2),
            "ref2va_blocks_batch2": case(2, 2, 4, 6, 3, 6, keyframes=1, references=True)}


@pytest.fixture(scope="session")
def mm_files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("minimax_h3")
    return {variant: tiny.write_tiny_checkpoint(str(folder / f"{variant}.safetensors"), seed=SEED, variant=variant,
                                                prefix=COMFY_PREFIX if variant == "pruned" else "")
            for variant in tiny.VARIANTS}


@pytest.fixture(scope="session")
def mm_references():
    return {(variant, name): reference_forward(tiny.build_tiny_model(SEED, variant), *case[:2], **case[2])
            for variant in tiny.VARIANTS for name, case in make_cases().items()}


def _check(pool, what, path, references, variant, names=None):
    handle = pool.load_model(path)
    assert (handle.info.family, handle.info.variant) == ("minimax_h3", variant)
    for name, (x, t, inputs) in make_cases().items():
        if names is None or name in names:
            assert_parity(handle(x, t, **inputs), references[variant, name], "float32", f"minimax_h3_{what}/{name}")
    handle.unload()


def test_fp32_parity_every_degree(family_pool, mm_files, mm_references):
    """The pruned file (the templates' form) every case at every degree; the full file at degrees 1-2, FastH3's head
    bank at 3 (the forms differ in the time embedding and the heads, not in what is split)."""
    degree = family_pool.config.world_size
    _check(family_pool, f"degree{degree}", mm_files["pruned"], mm_references, "pruned")
    if degree in (1, 2):
        _check(family_pool, f"full{degree}", mm_files["full"], mm_references, "full", ("62_rows_batch2",))
    if degree == 3:
        _check(family_pool, "fast", mm_files["fast"], mm_references, "fast", ("fl2va_keyframes",))


def test_fp32_parity_ring_and_cfg_layouts(layout_pool, mm_files, mm_references):
    name, pool = layout_pool
    _check(pool, name, mm_files["pruned"], mm_references, "pruned")


def test_positions_timesteps_and_heads_matter(mm_references):
    """Guards against a test that cannot fail: a keyframe one frame later, another sigma, the bank's later heads, the
    reference blocks' order, a clip without its soundtrack's place, the text tags, the reference audio's timestep and
    the curve's activation each change the reference."""
    model = tiny.build_tiny_model(SEED, "fast")
    x, t, inputs = make_cases()["fl2va_keyframes"]
    want = mm_references["fast", "fl2va_keyframes"]
    assert relative_error(reference_forward(model, x, t, **{**inputs, "keyframe_frames": [0, 9]}), want) > 100 * FP32_TOL
    assert relative_error(reference_forward(model, x, t * 0.9, **inputs), want) > 100 * FP32_TOL
    bank = model.proj_out.weight.detach().clone()
    model.proj_out.weight.data[16:] = 0
    assert relative_error(reference_forward(model, x, t, **inputs), want) > 100 * FP32_TOL
    model.proj_out.weight.data = bank
    refs_case = make_cases()["ref2va_blocks_batch2"]
    x2, t2, refs_inputs = refs_case
    want2 = reference_forward(model, *refs_case[:2], **refs_inputs)
    image, clip, sound = refs_inputs["references"]
    for changed in ({"references": [clip, image, sound]}, {"references": [image, {"kind": "video", "latent": clip["latent"]}, sound]},
                    {"text_token_tags": torch.ones(6, dtype=torch.long)}, {"audio_cond_timestep": 1.0},
                    {"keyframe_audio_frames": [5]}):
        assert relative_error(reference_forward(model, x2, t2, **{**refs_inputs, **changed}), want2) > 100 * FP32_TOL
    model.time_embedder = torch.nn.Module()  # no curve table: diffusers' silu applies
    model.time_embedder.forward = tiny.build_tiny_model(SEED, "fast").time_embedder.forward
    model.time_embedder.register_parameter("weight", torch.nn.Parameter(torch.zeros(1)))
    assert relative_error(reference_forward(model, x, t, **inputs), want) > 100 * FP32_TOL


@pytest.mark.parametrize("variant", tiny.VARIANTS)
def test_key_plan_inverts_the_comfyui_writer(variant):
    model = tiny.build_tiny_model(SEED, variant)
    original = tiny.original_state_dict(model)
    plan = minimax_h3.original_plan(original, model.config)
    assert set(original) - set(plan) == {"rope.inv_freq"}
    got = {target: transform(original[source]) if transform else original[source]
           for source, targets in plan.items() for target, transform in targets}
    state = model.state_dict()
    assert got.keys() == state.keys() and all(torch.equal(got[key], state[key]) for key in state)


def test_key_plan_equals_diffusers_converter():
    from diffusers.loaders.single_file_utils import convert_minimax_h3_transformer_checkpoint_to_diffusers
    model = tiny.build_tiny_model(SEED, "full")
    original = tiny.original_state_dict(model)
    theirs = convert_minimax_h3_transformer_checkpoint_to_diffusers(dict(original), dict(model.config))
    plan = minimax_h3.original_plan(original, model.config)
    ours = {target: transform(original[source]) if transform else original[source]
            for source, targets in plan.items() for target, transform in targets}
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[key], theirs[key]) for key in ours)


def released_header(pruned: bool, heads: int = 1) -> Header:
    """Shapes of the released files (ComfyUI's layout, int8 aside): 5376 wide, 50 blocks of 56 x 128 heads."""
    keys = {"video_patch_proj.weight": (5376, 96), "audio_patch_proj.weight": (5376, 32),
            "condition_proj.weight": (5376, 5120), "rope.inv_freq": (16,), "final_layer.video_out.weight": (96 * heads,
                                                                                                              5376)}
    keys.update({"adaln_t_table": (1025, 8)} if pruned else
                {"time_embedder.proj_in.weight": (5376, 256), "time_embedder.proj_out.weight": (2688, 5376)})
    for i in range(50):
        keys.update({f"blocks.{i}.attn.qkv_proj.weight": (3 * 7168, 5376), f"blocks.{i}.attn.q_norm.weight": (128,),
                     f"blocks.{i}.mlp.fc2.weight": (5376, 14336),
                     f"blocks.{i}.adaln_proj.linear.weight": (18 * 5376, 8 if pruned else 2688)})
    keys.update({f"token_refiner.blocks.{i}.attn.qkv_proj.weight": (3 * 7168, 5376) for i in range(2)})
    return Header("minimax_h3.safetensors", {COMFY_PREFIX + key: ("BF16", shape) for key, shape in keys.items()})


def test_detection_of_released_sizes_tiny_files_and_neighbours(mm_files, tmp_path):
    pruned = minimax_h3.detect(released_header(True)).config
    assert (pruned["num_attention_heads"], pruned["attention_head_dim"], pruned["num_layers"],
            pruned["num_refiner_layers"], pruned["ffn_dim"], pruned["in_channels"], pruned["time_embed_dim"],
            pruned["adaln_curve_grid"]) == (56, 128, 50, 2, 14336, 24, 8, 1025)
    assert minimax_h3.detect(released_header(False)).config["time_embed_dim"] == 2688
    assert minimax_h3.detect(released_header(True, heads=8)).variant == "fast"
    for variant, path in mm_files.items():
        detection = detect_any(read_checkpoint_header(path))
        assert (detection.family, detection.variant) == ("minimax_h3", variant)
        assert detection.prefix == (COMFY_PREFIX if variant == "pruned" else "")
    neighbour = read_checkpoint_header(write_other("flux", str(tmp_path / "flux.safetensors"), seed=1))
    assert minimax_h3.detect(neighbour) is None


def test_host_packs_the_audio_scale_and_keyframe_noise_as_comfyui():
    """ComfyUI's MiniMaxH3Model.forward: the carried audio x (sigma_a / sigma_v) into the network, its velocity back
    as (1 - s) * carried + (1 + (s - 1) sigma_a) * v; keyframe rows r -> a r + (1 - a) noise(seed) in patch rows."""
    from sp_runtime.families.minimax_h3.host import PackedMiniMax
    from sp_runtime.families.minimax_h3.plan import patchify, time_shift_sigma
    hooks, g = PackedMiniMax(), torch.Generator().manual_seed(0)
    video, audio = torch.randn(1, 4, 2, 4, 6, generator=g), torch.randn(1, 6, 2, 3, generator=g)
    key = torch.randn(1, 4, 1, 4, 6, generator=g)
    payload = {"audio_scale": 2.0, "seed": 7, "visual_cond_noise_aug": 0.9, "cond_video_latents": [key],
               "keyframes": [{"latent": key, "resolved_frame_index": 8}], "layout": object()}
    packed, _, inputs = hooks.pack([video, audio], torch.tensor([600.0]), {"minimax_payload": payload,
                                                                           "denoise_mask": torch.ones(1, 1, 2, 4, 6)})
    sigma_a = time_shift_sigma(0.6, 12.0, 3.0)
    assert torch.allclose(packed[0, 0, video.numel():], (audio * (sigma_a / 0.6)).flatten())
    assert "denoise_mask" not in inputs and inputs["keyframe_frames"] == [8] and inputs["keyframe_timestep"] == 0.9
    noise = torch.randn(patchify(key)[0].shape, generator=torch.Generator().manual_seed(7))
    assert torch.allclose(patchify(inputs["keyframe_latents"][0])[0], 0.9 * patchify(key)[0] + 0.1 * noise, atol=1e-6)
    velocity = torch.randn(packed.shape, generator=g)
    _, audio_out = hooks.unpack(velocity, [video, audio])
    carried = audio * (sigma_a / 0.6)
    want = -carried + (1.0 + sigma_a) * velocity[0, 0, video.numel():].reshape(audio.shape)
    assert torch.allclose(audio_out, want, atol=1e-6)


def test_host_passes_reference_blocks_tags_and_their_noise_as_comfyui():
    """ref2va's payload (MiniMaxH3ReferenceToVideo's `refs`, ComfyUI's MiniMaxH3 extra_conds) -> `references` with
    each latent augmented as ComfyUI's _cond_video_rows / _cond_audio_rows (video: the seed in patch rows, audio: the
    seed + 1 in channel-major rows), the text tags flattened; a keyframe beside references keeps its own latent."""
    from sp_runtime.families.minimax_h3.host import PackedMiniMax
    from sp_runtime.families.minimax_h3.plan import patchify
    g = torch.Generator().manual_seed(1)
    video, audio = torch.randn(1, 4, 2, 4, 6, generator=g), torch.randn(1, 6, 2, 3, generator=g)
    image, sound, key = (torch.randn(1, 4, 1, 6, 4, generator=g), torch.randn(1, 6, 2, 5, generator=g),
                         torch.randn(1, 4, 1, 4, 6, generator=g))
    refs = comfy_refs([{"kind": "image", "latent": image}, {"kind": "audio", "audio": sound}])["refs"]
    payload = {"seed": 7, "visual_cond_noise_aug": 0.9, "audio_cond_noise_aug": 0.8, "refs": refs,
               "keyframes": [{"latent": key, "resolved_frame_index": 4}], "cond_video_latents": [key, image],
               "text_token_tags": torch.tensor([[1, 0, 1]])}
    _, _, inputs = PackedMiniMax().pack([video, audio], torch.tensor([600.0]), {"minimax_payload": payload})
    got_image, got_sound = inputs["references"]
    assert (got_image["kind"], got_sound["kind"], "audio" in got_image, "latent" in got_sound) == \
        ("image", "audio", False, False)
    noise = torch.randn(patchify(image)[0].shape, generator=torch.Generator().manual_seed(7))
    assert torch.allclose(patchify(got_image["latent"])[0], 0.9 * patchify(image)[0] + 0.1 * noise, atol=1e-6)
    rows = sound[0].permute(1, 2, 0).reshape(10, 6)  # ComfyUI's pack_audio
    noise = torch.randn(rows.shape, generator=torch.Generator().manual_seed(8))
    assert torch.allclose(got_sound["audio"][0].permute(1, 2, 0).reshape(10, 6), 0.8 * rows + 0.2 * noise, atol=1e-6)
    assert inputs["text_token_tags"].tolist() == [1, 0, 1] and inputs["audio_cond_timestep"] == 0.8
    assert inputs["keyframe_frames"] == [4] and len(inputs["keyframe_latents"]) == 1


def test_refusals_name_what_is_not_served(mm_files):
    from family_support import LocalContext
    from sp_runtime.contract import LoadRequest
    from sp_runtime.groups import SeqParallel
    groups = type("Groups", (), {"seq": SeqParallel.single()})()
    worker = minimax_h3.load(LoadRequest(mm_files["fast"], "float32"),
                             minimax_h3.detect(read_checkpoint_header(mm_files["fast"])), torch.device("cpu"), groups,
                             lambda *_: None)
    x, t, inputs = make_cases()["fl2va_keyframes"]
    out = torch.empty_like(x)
    for change, message in ((dict(refs=[{"kind": "image"}]), "raw reference blocks"),
                            (dict(references=[{"kind": "image", "latent": torch.randn(1, 4, 2, 4, 6)}]),
                             r"references\[0\].*t 1 for an image"),
                            (dict(references=[{"kind": "video_audio", "latent": torch.randn(1, 4, 2, 4, 6)}]),
                             r"references\[0\]"), (dict(references=[{"kind": "mask"}]), r"references\[0\]"),
                            (dict(text_token_tags=torch.ones(4)), "text_token_tags"),
                            (dict(keyframe_audio_latents=[torch.randn(1, 6, 1, 2)], keyframe_audio_frames=[0]),
                             "keyframe_audio_latents"),
                            (dict(denoise_mask=torch.rand(1, 1, 2, 4, 6)), "denoise mask"),
                            (dict(sample_sigmas=None), "PDD"), (dict(keyframe_frames=[0]), "keyframe_latents"),
                            (dict(latent_shapes=[[1, 4, 2, 4, 6], [1, 6, 1, 6]]), "stereo")):
        with pytest.raises(ValueError, match=message):
            worker.forward(x, t, {**inputs, **change}, out, LocalContext(groups))


# ---------------------------------------------------------------------------------------------------------------
# ComfyUI tier (needs COMFYUI_PATH at a ComfyUI with comfy/ldm/minimax): ComfyUI's own MiniMaxH3Model, built from
# its own detection of the tiny file, called as its model class calls it (the payload's keyframes, noise augmentation
# and audio scale); the pool gets the call through the host hooks.

def _needs_comfyui():
    import os
    import comfy_support as cs
    path = cs.comfyui_path()
    missing = path is None or not os.path.isfile(os.path.join(path, "comfy", "ldm", "minimax", "model.py"))
    return pytest.mark.skipif(missing, reason=cs.NO_COMFYUI + " (with comfy/ldm/minimax)")


def comfy_network(path: str):
    import comfy_support as cs
    cs.import_comfy()
    import comfy.model_detection
    import comfy.ops
    import comfy.utils
    from comfy.ldm.minimax.model import MiniMaxH3Model
    state = comfy.utils.load_torch_file(path)
    config = comfy.model_detection.detect_unet_config(state, COMFY_PREFIX)
    network = MiniMaxH3Model(**{k: v for k, v in config.items() if k != "image_model"},
                             operations=comfy.ops.disable_weight_init, dtype=torch.float32, device="cpu")
    missing, unexpected = network.load_state_dict(
        comfy.utils.state_dict_prefix_replace(state, {COMFY_PREFIX: ""}, filter_keys=True), strict=False)
    assert not missing and not unexpected, (missing, unexpected)
    return network.eval().requires_grad_(False)


def comfy_refs(references) -> dict:
    """Our `references` as ComfyUI's MiniMaxH3ReferenceToVideo puts them in the payload (`refs`)."""
    refs = []
    for ref in references:
        block = {"kind": ref["kind"], "ref_audio_t": ref["audio"].shape[-1] if "audio" in ref else 0,
                 "audio_latent": ref.get("audio")}
        if "latent" in ref:
            block.update(latent=ref["latent"], latent_t=ref["latent"].shape[2], latent_h=ref["latent"].shape[3],
                         latent_w=ref["latent"].shape[4])
        refs.append(block)
    return {"refs": refs}


@_needs_comfyui()
@pytest.mark.parametrize("family_pool", [2], indirect=True)
def test_pool_equals_comfys_minimax_h3(family_pool, tmp_path):
    from sp_runtime.families.minimax_h3.host import PackedMiniMax
    for variant in ("pruned", "full"):
        path = tiny.write_tiny_checkpoint(str(tmp_path / f"{variant}.safetensors"), seed=SEED, variant=variant,
                                          prefix=COMFY_PREFIX)
        network, handle = comfy_network(path), family_pool.load_model(path)
        for name, (x, t, inputs) in make_cases().items():
            video_shape, audio_shape = inputs["latent_shapes"]
            split = math.prod(video_shape[1:])
            video, audio = x[:1, 0, :split].reshape(1, *video_shape[1:]), x[:1, 0, split:].reshape(1, *audio_shape[1:])
            payload = {"seed": 3, "visual_cond_noise_aug": 0.99, "audio_scale": 1.5,
                       "cond_video_latents": inputs.get("keyframe_latents", []),
                       "keyframes": [{"latent": latent, "resolved_frame_index": index} for latent, index in
                                     zip(inputs.get("keyframe_latents", []), inputs.get("keyframe_frames", []))]}
            if inputs.get("references"):  # MiniMaxH3AddGuide's audio guide and ReferenceToVideo's blocks
                payload.update(comfy_refs(inputs["references"]), text_token_tags=inputs["text_token_tags"],
                               audio_cond_noise_aug=0.9)
                guides = [{"audio_latent": latent, "resolved_frame_index": index} for latent, index in
                          zip(inputs["keyframe_audio_latents"], inputs["keyframe_audio_frames"])]
                payload["keyframes"] = payload["keyframes"] + guides
                payload["cond_video_latents"] = payload["cond_video_latents"] + [
                    ref["latent"] for ref in payload["refs"] if "latent" in ref]
                payload["cond_audio_latents"] = [guide["audio_latent"] for guide in guides] + [
                    ref["audio_latent"] for ref in payload["refs"] if ref.get("audio_latent") is not None]
            with torch.inference_mode():
                theirs = network([video, audio], t[:1], inputs["context"][:1], transformer_options={},
                                 minimax_payload=dict(payload))
            hooks = PackedMiniMax()
            packed, timestep, call = hooks.pack([video, audio], t[:1], {"context": inputs["context"][:1],
                                                                        "minimax_payload": dict(payload)})
            ours = hooks.unpack(handle(packed, timestep, **call), [video, audio])
            for stream, (got, want) in enumerate(zip(ours, theirs)):
                assert_parity(got, want, "float32", f"comfyui_minimax_h3_{variant}/{name}/{('video', 'audio')[stream]}")
        handle.unload()
