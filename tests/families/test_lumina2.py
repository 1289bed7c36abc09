"""Lumina 2 (Lumina-Image 2.0, NetaYume) beyond the conformance suite (tests/families/test_family_conformance.py runs
every degree, layout and file layout on sp_lab.conformance.cases.lumina2_cases against diffusers' stock
Lumina2Transformer2DModel fed ComfyUI's call: 6 query heads over 2 key / value heads, caption / image streams of
11 / 35 tokens, a masked caption, fewer tokens than ranks, batch 2): what the cases exercise, the key plan against
diffusers' converter, detection against Z-Image, NewBie's detection (its conformance spec "lumina2:newbie" runs the
suite on newbie_cases), refusals of incomplete NewBie files, of a Ming-Image marker and of bad inputs by name."""
from __future__ import annotations

import pytest
import torch

from family_support import FP32_TOL, assert_parity, relative_error
from sp_lab.conformance.cases import lumina2_cases as make_cases
from sp_lab.references.lumina2 import reference_forward
from sp_lab.tiny_models import COMFY_PREFIX, write_tiny_checkpoint
from sp_lab.tiny_models import lumina2 as tiny
from sp_runtime.checkpoints.header import Header, read_checkpoint_header
from sp_runtime.detection import detect as detect_any
from sp_runtime.families import lumina2, z_image

pytest_plugins = ["family_pools"]  # the shared per-degree worker pools
SEED = 6  # the conformance suite's tiny Lumina 2 (sp_lab.conformance.product)
LAYOUTS = {"comfy_prefix": dict(prefix=COMFY_PREFIX), "comfy": {}, "diffusers": dict(layout="diffusers"),
           "diffusers_folder": dict(layout="diffusers_folder")}


@pytest.fixture(scope="session")
def lumina_files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("lumina2")
    return {name: write_tiny_checkpoint("lumina2", str(folder / (name if "folder" in name else
                                                                  f"{name}.safetensors")), seed=SEED, **kw)
            for name, kw in LAYOUTS.items()}


def test_timestep_caption_and_padding_matter(family_subject):
    """Guards against a test that cannot fail: the timestep, every caption token and the wrap-around padding count."""
    model = tiny.build_tiny_model(SEED)
    x, t, inputs = make_cases()["odd_latent_masked"]
    want = family_subject("lumina2").outputs["odd_latent_masked"]
    assert relative_error(reference_forward(model, x, t.flip(0), **inputs), want) > 100 * FP32_TOL
    assert relative_error(reference_forward(model, x, t, inputs["context"][:, :7]), want) > 100 * FP32_TOL
    zero_padded = reference_forward(model, torch.nn.functional.pad(x, (0, 1, 0, 1)), t, **inputs)[..., :9, :13]
    assert relative_error(zero_padded, want) > 100 * FP32_TOL


def test_key_plan_equals_diffusers_converter():
    """Our plan over ComfyUI's names gives exactly the tensors diffusers' convert_lumina2_to_diffusers gives (its
    q / k / v split is fixed at the released 2304 / 768 rows: a full-width qkv, the rest tiny)."""
    from diffusers.loaders.single_file_utils import convert_lumina2_to_diffusers
    model = tiny.build_tiny_model(SEED)
    original = tiny.original_state_dict(model)
    for key in [key for key in original if key.endswith(".attention.qkv.weight")]:
        original[key] = torch.randn(2304 + 2 * 768, 4)
    config = {**tiny.tiny_config(), "hidden_size": 2304, "num_attention_heads": 24, "num_kv_heads": 8}
    plan = lumina2.original_plan(original, config)
    ours = {target: (tensor if transform is None else transform(tensor))
            for key, tensor in original.items() for target, transform in plan.get(key, [])}
    theirs = convert_lumina2_to_diffusers(dict(original))
    assert set(ours) == set(theirs)
    assert all(torch.equal(ours[key], theirs[key]) for key in theirs)
    assert set(ours) == set(model.state_dict())


def test_detection_of_every_layout_and_of_neighbours(lumina_files, tmp_path):
    expected = {"comfy_prefix": ("original", COMFY_PREFIX), "comfy": ("original", ""), "diffusers": ("diffusers", ""),
                "diffusers_folder": ("diffusers", "")}
    want = tiny.tiny_config()
    for layout, path in lumina_files.items():
        header = read_checkpoint_header(path)
        detection = detect_any(header)
        assert (detection.family, detection.layout, detection.prefix) == ("lumina2", *expected[layout])
        for key in lumina2.CONFIG_KEYS:
            value = detection.config[key]
            assert (tuple(value) if isinstance(value, (list, tuple)) else value) == want[key], key
        assert z_image.detect(header) is None
    neighbour = read_checkpoint_header(write_tiny_checkpoint("z_image", str(tmp_path / "z.safetensors"), seed=1))
    assert lumina2.detect(neighbour) is None and detect_any(neighbour).family == "z_image"


def released_header() -> dict:
    """Header entries of Lumina-Image 2.0 / NetaYume (2304 wide, 24 heads over 8, 26 layers, Gemma 2 2304 features)."""
    keys = {"cap_embedder.1.weight": (2304, 2304), "t_embedder.mlp.0.weight": (1024, 256), "x_embedder.weight":
            (2304, 64), "norm_final.weight": (2304,)}
    for stem, count in (("layers", 26), ("noise_refiner", 2), ("context_refiner", 2)):
        for block in range(count):
            keys[f"{stem}.{block}.attention.qkv.weight"] = (2304 + 2 * 768, 2304)
            keys[f"{stem}.{block}.attention.q_norm.weight"] = (96,)
            keys[f"{stem}.{block}.feed_forward.w1.weight"] = (9216, 2304)
            keys[f"{stem}.{block}.attention.k_norm.weight"] = (96,)  # ComfyUI detects Lumina 2 by it
            if stem != "context_refiner":
                keys[f"{stem}.{block}.adaLN_modulation.1.weight"] = (9216, 1024)
    return {COMFY_PREFIX + key: ("BF16", shape) for key, shape in keys.items()}


def test_released_header_and_refused_variants():
    """The released sizes read as ComfyUI's detection fixes them; NewBie (pooled Jina CLIP text, 1024 wide) loads as
    variant "newbie", an incomplete NewBie and a Ming-Image marker on a Lumina 2-sized file are refused by name."""
    header = released_header()
    config = detect_any(Header("NetaYumev35_pretrained_all_in_one.safetensors", header)).config
    assert config == {"patch_size": 2, "in_channels": 16, "hidden_size": 2304, "num_layers": 26,
                      "num_refiner_layers": 2, "num_attention_heads": 24, "num_kv_heads": 8, "multiple_of": 256,
                      "ffn_dim_multiplier": None, "cap_feat_dim": 2304, "axes_dim_rope": (32, 32, 32),
                      "axes_lens": (300, 512, 512)}
    newbie = {**header, **{COMFY_PREFIX + key: ("BF16", shape) for key, shape in (
        ("clip_text_pooled_proj.0.weight", (1024,)), ("clip_text_pooled_proj.1.weight", (1024, 1024)),
        ("clip_text_pooled_proj.1.bias", (1024,)), ("time_text_embed.1.weight", (1024, 2048)),
        ("time_text_embed.1.bias", (1024,)))}}
    detection = detect_any(Header("NewBie-Image-Exp0.1-bf16.safetensors", newbie))
    assert (detection.family, detection.variant, detection.config) == ("lumina2", "newbie",
                                                                        {**config, "clip_text_dim": 1024})
    assert detect_any(Header("NetaYume.safetensors", header)).variant == "image"
    incomplete = {key: value for key, value in newbie.items() if "time_text_embed.1.bias" not in key}
    with pytest.raises(ValueError, match=r"NewBie .*time_text_embed\.1\.bias"):
        detect_any(Header("x.safetensors", incomplete))
    with pytest.raises(ValueError, match="a .*clip_text_pooled_proj.1.bias.* of another size"):
        detect_any(Header("x.safetensors", {**newbie, COMFY_PREFIX + "clip_text_pooled_proj.1.bias": ("BF16", (8,))}))
    with pytest.raises(ValueError, match="Ming-Image"):
        detect_any(Header("x.safetensors", {**header, COMFY_PREFIX + "__ming_image__": ("BF16", (0,))}))


def test_newbie_pooled_text_matters(family_subject):
    """Guard for the NewBie spec: its pooled text and its zeros path change the output (the suite's cases then
    check both against the reference at every layout)."""
    subject = family_subject("lumina2:newbie")
    x, t, inputs = subject.spec.cases()["pooled"]
    without = {key: value for key, value in inputs.items() if key != "clip_text_pooled"}
    assert relative_error(subject.forward(x, t, **without), subject.outputs["pooled"]) > 100 * FP32_TOL
    plain = tiny.build_tiny_model(7)  # the same base weights without NewBie's modules
    assert relative_error(reference_forward(plain, x, t, **without), subject.forward(x, t, **without)) > 100 * FP32_TOL


def test_refusals_name_the_input(family_pool, lumina_files):
    if family_pool.config.world_size != 2:
        pytest.skip("checked at degree 2")
    handle = family_pool.load_model(lumina_files["comfy_prefix"])
    x, t, inputs = make_cases()["t2i"]
    bad = {"ref_latents": {**inputs, "ref_latents": [x]}, "ref_frames": {**inputs, "ref_frames": [x]},
           "direct_context": {**inputs, "direct_context": inputs["context"]},
           "context": {**inputs, "context": inputs["context"][..., :8]}}
    for needle, changed in bad.items():
        with pytest.raises(Exception, match=needle):
            handle(x, t, **changed)
    with pytest.raises(Exception, match="4-D latents"):
        handle(x[:, :, None], t, **inputs)
    assert_parity(handle(x, t, **inputs), reference_forward(tiny.build_tiny_model(SEED), x, t, **inputs), "float32",
                  "lumina2_after_refusals/t2i")
    handle.unload()


def test_newbie_refuses_a_pooled_text_of_another_width(tmp_path):
    """NewBie's pooled text must be [batch, clip_text_dim]: another width is refused naming clip_text_pooled."""
    from family_support import LocalContext
    from sp_runtime.contract import LoadRequest
    from sp_runtime.groups import SeqParallel
    from sp_lab.conformance.cases import newbie_cases
    path = write_tiny_checkpoint("lumina2", str(tmp_path / "newbie.safetensors"), seed=7, variant="newbie")
    groups = type("Groups", (), {"seq": SeqParallel.single()})()
    detection = lumina2.detect(read_checkpoint_header(path))
    worker = lumina2.load(LoadRequest(path, "float32"), detection, torch.device("cpu"), groups, lambda *_: None)
    x, t, inputs = newbie_cases()["pooled"]
    with pytest.raises(ValueError, match=r"clip_text_pooled has shape \(2, 24\); NewBie takes \[batch, 40\]"):
        worker.forward(x, t, {**inputs, "clip_text_pooled": inputs["clip_text_pooled"][:, :24]}, torch.empty_like(x),
                       LocalContext(groups))
