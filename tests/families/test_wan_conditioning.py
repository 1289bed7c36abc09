"""The Wan variants conditioned by one more input, each against diffusers' single-process forward at degrees 1-4
(family_pools' shared pools), with a bad input named by a single-rank worker: Fun Camera (camera_conditions through
control_adapter), Fun Control (reference_latent through ref_conv, Wan 2.2 Fun A14B's two experts in one pool, Fun 5B),
HuMo (audio_embed, frame-local audio cross-attention) and VACE (vace_context / vace_strength, several hint videos).
Each section starts with what it checks."""
from __future__ import annotations

import pytest
import torch

from family_support import assert_parity, relative_error, single_rank_worker
from sp_lab.references.wan import reference_forward
from sp_lab.tiny_models import COMFY_PREFIX, build_tiny_model, write_tiny_checkpoint
from sp_lab.tiny_models.wan import original_state_dict

pytest_plugins = ["family_pools"]  # the shared per-degree worker pools


# -----------------------------------------------------------------------------------------------------------------
# Wan Fun Camera under Ulysses SP: ComfyUI's camera_conditions through control_adapter (Wan 2.1 with CLIP and 32
# channels; Wan 2.2 style, 36 channels and no CLIP) equals a single-process diffusers forward with the adapter's output
# added to the patch embedding, at degrees 1-4 (6 heads), token ranges that split frames, batch 2; bad conditions are
# named; Wan 2.2 Fun 5B Control-Camera files (48-channel latents, which no ComfyUI model class takes) are refused by
# name.

# variant -> (seed, input channels, CLIP tokens, text tokens)
CAMERA_MODELS = {"camera": (11, 32, 5, 512), "camera_2.2": (12, 36, 0, 7)}


def camera_cases(variant: str) -> dict:
    """(x, timestep, kwargs) as ComfyUI's WAN21_Camera passes them: 45 tokens (5 frames of 9: every degree > 1 splits
    a frame), 24 tokens (3 frames of 8), 1 token with batch 1, and no conditions at all."""
    seed, channels, clip_tokens, text_tokens = CAMERA_MODELS[variant]
    g = torch.Generator().manual_seed(seed)

    def call(batch, frames, height, width, camera=True):
        inputs = {"context": torch.randn(batch, text_tokens, 32, generator=g)}
        if clip_tokens:
            inputs["clip_fea"] = torch.randn(batch, clip_tokens, 1280, generator=g)
        if camera:
            inputs["camera_conditions"] = torch.randn(batch, 24, frames, 8 * height, 8 * width, generator=g)
        return torch.randn(batch, channels, frames, height, width, generator=g), torch.tensor([700.0, 300.0])[:batch], \
            inputs

    return {"45_tokens": call(2, 5, 6, 6), "1_token_batch_1": call(1, 1, 2, 2),
            "24_tokens": call(2, 3, 4, 8), "no_conditions": call(2, 2, 4, 4, camera=False)}


@pytest.fixture(scope="session")
def camera_files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("wan_camera")
    return {variant: write_tiny_checkpoint("wan", str(folder / f"{variant}.safetensors"), seed=seed, variant=variant,
                                           prefix=COMFY_PREFIX)
            for variant, (seed, *_rest) in CAMERA_MODELS.items()}


@pytest.fixture(scope="session")
def camera_references():
    """diffusers' stock forward on in-memory weights (independent of our loader and SP forward)."""
    refs = {}
    for variant, (seed, *_rest) in CAMERA_MODELS.items():
        model = build_tiny_model("wan", seed, variant=variant)
        refs[variant] = {}
        for case, (x, t, inputs) in camera_cases(variant).items():
            refs[variant][case] = reference_forward(model, x, t, **inputs)
    return refs


def test_camera_fp32_parity(family_pool, camera_files, camera_references):
    for variant, path in camera_files.items():
        handle = family_pool.load_model(path)
        assert (handle.info.variant, handle.info.config["camera_in_channels"]) == (variant, 24)
        for case, (x, t, inputs) in camera_cases(variant).items():
            assert_parity(handle(x, t, **inputs), camera_references[variant][case], "float32",
                          f"camera/{variant}/{case}")


def test_the_conditions_change_the_output(camera_references):
    x, t, inputs = camera_cases("camera_2.2")["45_tokens"]
    model = build_tiny_model("wan", CAMERA_MODELS["camera_2.2"][0], variant="camera_2.2")
    without = reference_forward(model, x, t, inputs["context"])
    assert relative_error(without, camera_references["camera_2.2"]["45_tokens"]) > 1e-3


def test_bad_camera_conditions_are_named(camera_files):
    worker, context = single_rank_worker(camera_files["camera_2.2"])
    x, t, inputs = camera_cases("camera_2.2")["45_tokens"]
    out = torch.empty(2, 16, 5, 6, 6)
    with pytest.raises(ValueError, match=r"camera_conditions has shape \[2, 24, 5, 6, 6\]; this Wan Fun Camera "
                                         r"model takes \[B, 24, 5, 48, 48\]"):
        worker.forward(x, t, {**inputs, "camera_conditions": inputs["camera_conditions"][..., :6, :6]}, out,
                       context)


def test_the_5b_control_camera_is_refused_by_name(tmp_path):
    from sp_runtime.detection import detect
    path = write_tiny_checkpoint("wan", str(tmp_path / "fun_5b_camera.safetensors"), variant="camera_2.2",
                                 in_channels=100, out_channels=48, prefix=COMFY_PREFIX)
    with pytest.raises(ValueError, match=r"Wan 2\.2 Fun 5B Control-Camera checkpoint \(48-channel latents, 100 input"):
        detect(path)


# -----------------------------------------------------------------------------------------------------------------
# Wan Fun Control under Ulysses SP: ComfyUI's reference_latent through ref_conv (Fun Control v1.1 with CLIP and 48
# channels; Wan 2.2 Fun A14B style, 52 channels and no CLIP, its high- and low-noise experts as two models in one pool;
# Wan 2.2 Fun 5B Control, 148 channels and a 48-channel reference, and Fun 5B InP, 100 channels, both with TI2V 5B's
# per-frame timesteps, 3 heads of 128) equals a single-process diffusers forward (the reference frame's tokens first,
# frame 0 of the rotary grid) at degrees 1-4 (6 or 3 heads), odd and padded token counts, batch 2; a bad reference
# latent is named.

# name -> (tiny variant, seed, input channels, CLIP tokens, text tokens, size)
FUN_5B_SIZE = dict(num_attention_heads=3, attention_head_dim=128)  # 3 heads: 2 and 4 ranks do not divide them
FUN_MODELS = {"fun_control": ("fun_control", 7, 48, 5, 512, {}),
              "a14b_high_noise": ("fun_a14b", 8, 52, 0, 7, {}), "a14b_low_noise": ("fun_a14b", 9, 52, 0, 7, {}),
              "5b_control": ("fun_5b_control", 10, 148, 0, 7, FUN_5B_SIZE),
              "5b_inp": ("fun_5b_inp", 11, 100, 0, 7, FUN_5B_SIZE)}
# the 5B models are wider: the cases that differ for them (suite time)
FUN_5B_CASES = {"5b_control": ("45_tokens", "40_tokens_padded"), "5b_inp": ("40_tokens_padded",)}


def fun_cases(name: str) -> dict:
    """(x, timestep, kwargs) as ComfyUI's WAN21 / WAN22 passes them. Video tokens: 45 (+9 reference tokens), 40 with
    H and W padded (+20), 1 with batch 1 (+1); and a call without reference_latent (Fun Control v1.0 workflows). The
    5B models get TI2V 5B's per-frame timesteps [B, T] (the start frame's 0, as its denoise mask makes them) and
    48-channel latents."""
    variant, seed, channels, clip_tokens, text_tokens, _ = FUN_MODELS[name]
    latent_channels = 48 if variant.startswith("fun_5b") else 16
    g = torch.Generator().manual_seed(seed)

    def call(batch, frames, height, width, reference=True):
        inputs = {"context": torch.randn(batch, text_tokens, 32, generator=g)}
        if clip_tokens:
            inputs["clip_fea"] = torch.randn(batch, clip_tokens, 1280, generator=g)
        if reference:
            inputs["reference_latent"] = torch.randn(batch, latent_channels, height, width, generator=g)
        timestep = torch.tensor([700.0, 300.0])[:batch]
        if latent_channels == 48:
            timestep = timestep[:, None].repeat(1, frames)
            timestep[:, 0] = 0.0
        return torch.randn(batch, channels, frames, height, width, generator=g), timestep, inputs

    cases = {"45_tokens": call(2, 5, 6, 6), "40_tokens_padded": call(2, 2, 7, 9), "1_token_batch_1": call(1, 1, 2, 2),
             "no_reference": call(2, 3, 4, 6, reference=False)}
    return cases if latent_channels == 16 else {case: cases[case] for case in FUN_5B_CASES[name]}


@pytest.fixture(scope="session")
def fun_files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("wan_fun")
    return {name: write_tiny_checkpoint("wan", str(folder / f"{name}.safetensors"), seed=seed, variant=variant,
                                        prefix=COMFY_PREFIX, **size)
            for name, (variant, seed, *_rest, size) in FUN_MODELS.items()}


@pytest.fixture(scope="session")
def fun_references():
    """diffusers' stock forward on in-memory weights (independent of our loader, key plan and SP forward)."""
    refs = {}
    for name, (variant, seed, *_rest, size) in FUN_MODELS.items():
        model = build_tiny_model("wan", seed, variant=variant, **size)
        refs[name] = {case: reference_forward(model, x, t, **inputs)
                      for case, (x, t, inputs) in fun_cases(name).items()}
    return refs


def test_fun_fp32_parity_with_both_experts_in_one_pool(family_pool, fun_files, fun_references):
    handles = {name: family_pool.load_model(path) for name, path in fun_files.items()}
    assert handles["fun_control"].info.variant == "fun_control"
    assert handles["a14b_high_noise"].info.variant == "i2v_concat"
    assert handles["a14b_low_noise"].info.config["ref_in_channels"] == 16
    assert handles["5b_control"].info.variant == handles["5b_inp"].info.variant == "ti2v"
    assert handles["5b_control"].info.config["ref_in_channels"] == 48
    for case in ("45_tokens", "40_tokens_padded", "1_token_batch_1", "no_reference"):
        for name, handle in handles.items():  # the experts alternate, as a two-stage Wan 2.2 sampling does
            cases = fun_cases(name)
            if case in cases:
                x, t, inputs = cases[case]
                assert_parity(handle(x, t, **inputs), fun_references[name][case], "float32", f"fun/{name}/{case}")


def test_the_reference_changes_the_output(fun_references):
    model = build_tiny_model("wan", 7, variant="fun_control")
    x, t, inputs = fun_cases("fun_control")["45_tokens"]
    other = reference_forward(model, x, t, **{**inputs, "reference_latent": torch.zeros_like(
        inputs["reference_latent"])})
    assert relative_error(other, fun_references["fun_control"]["45_tokens"]) > 1e-3


def test_a_bad_reference_latent_is_named(fun_files):
    worker, context = single_rank_worker(fun_files["fun_control"])
    x, t, inputs = fun_cases("fun_control")["45_tokens"]
    with pytest.raises(ValueError, match=r"reference_latent has shape \[2, 16, 1, 6, 6\]; this Wan Fun model takes "
                                         r"\[B, 16, 6, 6\]"):
        worker.forward(x, t, {**inputs, "reference_latent": inputs["reference_latent"].unsqueeze(2)},
                       torch.empty(2, 16, 5, 6, 6), context)


# -----------------------------------------------------------------------------------------------------------------
# Wan HuMo under Ulysses SP: ComfyUI's audio_embed (frame-local audio cross-attention in every block) and
# reference_latent (appended frames, zero audio) equal a single-process diffusers forward with the audio step hooked
# in (sp_lab.references.wan.reference_forward with audio_reference_hooks: whole-sequence attention regrouped per frame
# as ComfyUI does), at degrees 1-4 (3 heads), token ranges that split frames, padded sizes, batch 2; a bad audio_embed
# is named.

HUMO_SEED = 13
HUMO_SIZE = dict(num_attention_heads=3, attention_head_dim=32)  # 3 heads: 2 and 4 ranks do not divide them


def humo_cases() -> dict:
    """(x, timestep, kwargs) as ComfyUI's WAN21_HuMo passes them: 45 tokens (5 frames of 9), 40 with H and W padded,
    18 + 6 reference tokens (W padded), 1 token with batch 1, and no audio."""
    g = torch.Generator().manual_seed(1)

    def call(batch, frames, height, width, audio=True, reference_frames=0):
        inputs = {"context": torch.randn(batch, 7, 32, generator=g)}
        if audio:
            inputs["audio_embed"] = torch.randn(batch, frames, 2, 5, 8, generator=g)
        if reference_frames:
            inputs["reference_latent"] = torch.randn(batch, 16, reference_frames, height, width, generator=g)
        return torch.randn(batch, 16, frames, height, width, generator=g), torch.tensor([700.0, 300.0])[:batch], \
            inputs

    return {"45_tokens": call(2, 5, 6, 6), "40_tokens_padded": call(2, 2, 7, 9),
            "reference_frame": call(2, 3, 4, 5, reference_frames=1), "1_token_batch_1": call(1, 1, 2, 2),
            "no_audio": call(2, 2, 4, 4, audio=False)}


@pytest.fixture(scope="session")
def humo_path(tmp_path_factory):
    return write_tiny_checkpoint("wan", str(tmp_path_factory.mktemp("wan_humo") / "humo.safetensors"), seed=HUMO_SEED,
                                 variant="humo", prefix=COMFY_PREFIX, **HUMO_SIZE)


@pytest.fixture(scope="session")
def humo_model():
    return build_tiny_model("wan", HUMO_SEED, variant="humo", **HUMO_SIZE)


@pytest.fixture(scope="session")
def humo_references(humo_model):
    return {name: reference_forward(humo_model, x, t, **inputs) for name, (x, t, inputs) in humo_cases().items()}


def test_humo_fp32_parity(family_pool, humo_path, humo_references):
    handle = family_pool.load_model(humo_path)
    assert (handle.info.variant, handle.info.config["num_heads"]) == ("humo", 3)
    for name, (x, t, inputs) in humo_cases().items():
        assert_parity(handle(x, t, **inputs), humo_references[name], "float32", f"humo/{name}")


def test_the_audio_and_the_reference_change_the_output(humo_model, humo_references):
    x, t, inputs = humo_cases()["reference_frame"]
    silent = reference_forward(humo_model, x, t, inputs["context"],
                               audio_embed=torch.zeros_like(inputs["audio_embed"]),
                               reference_latent=inputs["reference_latent"])
    assert relative_error(silent, humo_references["reference_frame"]) > 1e-3
    alone = reference_forward(humo_model, x, t, inputs["context"], audio_embed=inputs["audio_embed"])
    assert relative_error(alone, humo_references["reference_frame"]) > 1e-3


def test_a_bad_audio_embed_is_named(humo_path):
    worker, context = single_rank_worker(humo_path)
    x, t, inputs = humo_cases()["45_tokens"]
    with pytest.raises(ValueError, match=r"audio_embed has shape \[2, 4, 2, 5, 8\]; this Wan HuMo model takes "
                                         r"\[B, 5, window, blocks, channels\]"):
        worker.forward(x, t, {**inputs, "audio_embed": inputs["audio_embed"][:, :4]}, torch.empty(x.shape),
                       context)


# -----------------------------------------------------------------------------------------------------------------
# Wan VACE under Ulysses SP: the pool's output with ComfyUI's vace_context / vace_strength equals diffusers' own
# WanVACETransformer3DModel forward on one process, at degrees 1-4 (3 heads), odd and padded token counts, batch 2,
# from ComfyUI-layout files and diffusers folders; several hint videos; and bad VACE inputs are named.

VACE_SEED = 5
VACE_SIZE = dict(num_attention_heads=3, attention_head_dim=32)  # 3 heads: 2 and 4 ranks do not divide them
VACE_FILES = {"comfy_prefix": dict(prefix=COMFY_PREFIX), "diffusers_folder": dict(layout="diffusers_folder")}


def vace_cases(seed: int = 1) -> dict:
    """(x, timestep, kwargs) as ComfyUI's WAN21_Vace passes them. Tokens: 45 (odd), 40 (H and W padded), 1."""
    g = torch.Generator().manual_seed(seed)

    def call(batch, frames, height, width, strength=0.8):
        return (torch.randn(batch, 16, frames, height, width, generator=g), torch.tensor([700.0, 300.0])[:batch],
                {"context": torch.randn(batch, 7, 32, generator=g),
                 "vace_context": torch.randn(batch, 1, 96, frames, height, width, generator=g),
                 "vace_strength": [strength]})

    return {"45_tokens": call(2, 5, 6, 6), "40_tokens_padded": call(2, 2, 7, 9, strength=1.0),
            "1_token_batch_1": call(1, 1, 2, 2)}


def vace_two_hint_cases() -> dict:
    """Two hint videos, each checkable against diffusers' single one: another video first at strength 0, and one
    video given twice (hint videos never see each other, so its hints add up: diffusers with the summed strength)."""
    x, t, inputs = vace_cases(seed=2)["45_tokens"]
    hint, other = inputs["vace_context"], torch.randn_like(inputs["vace_context"])
    return {"ignored_first": ((x, t, {**inputs, "vace_context": torch.cat([other, hint], 1),
                                      "vace_strength": [0.0, 0.8]}), (hint, [0.8])),
            "same_twice": ((x, t, {**inputs, "vace_context": torch.cat([hint, hint], 1),
                                   "vace_strength": [0.5, 0.7]}), (hint, [1.2]))}


@pytest.fixture(scope="session")
def vace_files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("wan_vace")
    return {name: write_tiny_checkpoint("wan", str(folder / (name + ("" if "folder" in name else ".safetensors"))),
                                        seed=VACE_SEED, variant="vace", **arguments, **VACE_SIZE)
            for name, arguments in VACE_FILES.items()}


@pytest.fixture(scope="session")
def vace_model():
    return build_tiny_model("wan", VACE_SEED, variant="vace", **VACE_SIZE)


@pytest.fixture(scope="session")
def vace_references(vace_model):
    """diffusers' stock forward on in-memory weights (independent of our loader, key plan and SP forward)."""
    refs = {name: reference_forward(vace_model, x, t, **inputs) for name, (x, t, inputs) in vace_cases().items()}
    for name, ((x, t, inputs), (hint, strength)) in vace_two_hint_cases().items():
        refs[name] = reference_forward(vace_model, x, t, inputs["context"], vace_context=hint, vace_strength=strength)
    return refs


def test_vace_fp32_parity(family_pool, vace_files, vace_references):
    for layout, path in vace_files.items():
        handle = family_pool.load_model(path)
        assert (handle.info.variant, handle.info.config["vace_layers"], handle.info.config["num_heads"]) == \
            ("vace", [0, 2], 3)
        cases = {**vace_cases(), **{name: case for name, (case, _) in vace_two_hint_cases().items()}}
        if layout != "comfy_prefix":  # the other layouts check loading: one case is enough
            cases = {"45_tokens": cases["45_tokens"]}
        for name, (x, t, inputs) in cases.items():
            assert_parity(handle(x, t, **inputs), vace_references[name], "float32", f"vace/{layout}/{name}")


def test_vace_cases_exercise_what_they_claim(vace_model, vace_references):
    """The hint, its strength and the second hint video each change the output."""
    x, t, inputs = vace_cases()["45_tokens"]
    without = reference_forward(vace_model, x, t, inputs["context"], vace_context=inputs["vace_context"],
                                    vace_strength=[0.0])
    assert relative_error(without, vace_references["45_tokens"]) > 1e-3
    (x, t, inputs), _ = vace_two_hint_cases()["same_twice"]
    once = reference_forward(vace_model, x, t, inputs["context"], vace_context=inputs["vace_context"][:, :1],
                                 vace_strength=[0.5])
    assert relative_error(once, vace_references["same_twice"]) > 1e-3


def test_vace_key_plan_equals_diffusers_converter():
    """Our per-tensor plan gives what diffusers' converter gives on every key of a full-size VACE 1.3B (meta
    tensors, 15 VACE blocks every 2nd of 30 blocks) and on the tiny model's tensors."""
    from accelerate import init_empty_weights
    from diffusers import WanVACETransformer3DModel
    from diffusers.loaders.single_file_utils import convert_wan_transformer_to_diffusers
    from sp_runtime.families.wan.keys import wan_key_plan
    from sp_runtime.families.wan.vace import architecture as vace_architecture
    with init_empty_weights():
        full = WanVACETransformer3DModel(num_attention_heads=12, attention_head_dim=128, ffn_dim=8960, num_layers=30,
                                         vace_layers=list(range(0, 30, 2)))
    for model in (full, build_tiny_model("wan", VACE_SEED, variant="vace", **VACE_SIZE)):
        original = original_state_dict(model)
        expected = convert_wan_transformer_to_diffusers({COMFY_PREFIX + k: v for k, v in original.items()})
        plan = wan_key_plan(original)
        assert set(plan) == set(original)
        ours = {target: original[source] for source, targets in plan.items() for target, _ in targets}
        assert ours.keys() == expected.keys() == model.state_dict().keys()
        shapes = {key: (None, tuple(value.shape)) for key, value in original.items()}  # header entries
        assert vace_architecture(shapes, "original", {"num_layers": model.config.num_layers}) == {
            "vace_layers": list(model.config.vace_layers), "vace_in_channels": 96}


def test_bad_vace_inputs_are_named(vace_files):
    worker, context = single_rank_worker(vace_files["comfy_prefix"])
    x, t, inputs = vace_cases()["45_tokens"]
    out = torch.empty(x.shape)
    bad = {"vace_context": None, "vace_strength": None}
    with pytest.raises(ValueError, match=r"needs vace_context \[B, n, 96, 5, 6, 6\]"):
        worker.forward(x, t, {**inputs, **bad}, out, context)
    with pytest.raises(ValueError, match=r"vace_context has shape \[2, 1, 96, 5, 4, 6\]"):
        worker.forward(x, t, {**inputs, "vace_context": inputs["vace_context"][..., :4, :]}, out,
                       context)
    with pytest.raises(ValueError, match="vace_strength has 2 entries for 1 hint videos"):
        worker.forward(x, t, {**inputs, "vace_strength": [1.0, 1.0]}, out, context)
    with pytest.raises(ValueError, match="not per-frame timesteps"):
        worker.forward(x, torch.full((2, 5), 500.0), inputs, out, context)
