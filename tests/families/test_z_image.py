"""Z-Image under Ulysses SP, what is special to it (test_family_conformance.py checks its parity against diffusers'
stock forward fed ComfyUI's call, t = 1 - sigma, output negated, circular padding to the patch, at every degree and
layout, its file layouts, a quantized file and a LoRA, from sp_lab.conformance: head size 128 with 5 heads, caption
and image streams of 9-40 and 9-35 tokens padded to 32 with learned tokens, batch 2): the joint split at 30 heads x
128 exact at degrees 3, 5, 6 and 8; ScaleROPE's rope_options at Ulysses 2; our key plan equals diffusers' converter
at full width; LoRAs on the fused qkv; unsupported inputs refused."""
from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

from family_support import FP32_TOL, PARITY_LOG, LocalContext, assert_parity, relative_error
from sp_lab.conformance.cases import z_image_cases as make_cases
from sp_lab.references.z_image import reference_forward as z_image_reference
from sp_runtime.families import flux, flux2, qwen_image, qwen_image21, z_image
from sp_runtime.checkpoints.header import read_checkpoint_header
from sp_runtime.detection import detect as detect_any
from sp_runtime.local_ranks import run_distributed
from sp_lab.tiny_models import COMFY_PREFIX, build_tiny_model, original_state_dict, write_tiny_checkpoint

pytest_plugins = ["family_pools"]  # the shared per-degree worker pools
SEED = 5
LAYOUTS = {"comfy_prefix": dict(prefix=COMFY_PREFIX), "comfy": {}, "diffusers": dict(layout="diffusers"),
           "diffusers_folder": dict(layout="diffusers_folder", max_shard_size="20MB")}


@pytest.fixture(scope="session")
def zi_files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("z_image")
    return {name: write_tiny_checkpoint("z_image", str(folder / name), seed=SEED, **kw)
            for name, kw in LAYOUTS.items()}


@pytest.fixture(scope="session")
def zi_references(family_subject):
    """The conformance suite's outputs (same seed and cases)."""
    return family_subject("z_image").outputs


ROPE_OPTIONS = dict(scale_x=0.5, shift_x=3.0, scale_y=1.5, shift_y=-2.0, scale_t=2.0, shift_t=1.0)  # ComfyUI's


@pytest.mark.parametrize("family_pool", [2], indirect=True, ids=["u2"])
def test_scale_rope_equals_comfys_placement(family_pool, zi_files, zi_references):
    """rope_options move the image rows and columns to fractional positions (ComfyUI's pos_ids_x), which changes
    the output; the reference places them in diffusers' own forward."""
    model = build_tiny_model("z_image", SEED)
    handle = family_pool.load_model(zi_files["comfy_prefix"])
    for name in ("odd_latent_masked", "batch_1"):
        x, t, inputs = make_cases()[name]
        want = z_image_reference(model, x, t, rope_options=ROPE_OPTIONS, **inputs)
        assert relative_error(want, zi_references[name]) > 100 * FP32_TOL
        assert_parity(handle(x, t, rope_options=dict(ROPE_OPTIONS), **inputs), want, "float32",
                      f"z_image_scale_rope/{name}")
    handle.unload()


def test_padding_timestep_and_caption_matter(zi_references):
    """Guards against a test that cannot fail: the learned pad tokens are attended, the timestep and the caption
    count, and the latent is padded by wrap-around."""
    model = build_tiny_model("z_image", SEED)
    x, t, inputs = make_cases()["t2i"]
    want = zi_references["t2i"]
    model.cap_pad_token.mul_(2)
    assert relative_error(z_image_reference(model, x, t, **inputs), want) > 100 * FP32_TOL
    model.cap_pad_token.div_(2)
    assert relative_error(z_image_reference(model, x, t.flip(0), **inputs), want) > 100 * FP32_TOL
    shorter = inputs["context"][:, :8]
    assert relative_error(z_image_reference(model, x, t, shorter), want) > 100 * FP32_TOL
    x, t, inputs = make_cases()["odd_latent_masked"]
    zero_padded = torch.nn.functional.pad(x, (0, 1, 0, 1))
    other = z_image_reference(model, zero_padded, t, **inputs)[..., :9, :13]
    assert relative_error(other, zi_references["odd_latent_masked"]) > 100 * FP32_TOL


def _joint_split_at_30_heads(rank, world_size):
    """Each degree in (3, 5, 6, 8) on the first ranks: attention over the joint split (each rank's caption shard,
    then its image shard) vs one SDPA over [caption, image]. q, k stand for rotated ones: rotation is token-local."""
    import torch.distributed as dist
    import torch.nn.functional as F

    from sp_runtime.attention import SeqShards, sp_attention
    from sp_runtime.groups import SeqParallel
    errors = {}
    for degree in (3, 5, 6, 8):
        group = dist.new_group(list(range(degree)))  # every rank takes part in creating every group
        if rank >= degree:
            continue
        seq = SeqParallel(group, rank, degree)
        caption_shards = image_shards = SeqShards.balanced(32, degree)  # 9 caption, 15 image tokens, 32 padded
        g = torch.Generator().manual_seed(degree)
        caption, image = ([torch.randn(2, 32, 30, 128, generator=g) for _ in range(3)] for _ in range(2))
        whole = [torch.cat(pair, dim=1).transpose(1, 2) for pair in zip(caption, image)]
        want = F.scaled_dot_product_attention(*whole).transpose(1, 2)
        (c_lo, c_hi), (i_lo, i_hi) = caption_shards.range(rank), image_shards.range(rank)
        mine = [torch.cat([c[:, c_lo:c_hi], i[:, i_lo:i_hi]], dim=1) for c, i in zip(caption, image)]
        got = sp_attention(*mine, seq, SeqShards.union(caption_shards, image_shards))[0]
        expected = torch.cat([want[:, c_lo:c_hi], want[:, 32 + i_lo:32 + i_hi]], dim=1)
        errors[degree] = (got - expected).abs().max().item() / max(1.0, expected.abs().max().item())
    return errors


def test_30_heads_exact_at_degrees_3_5_6_8():
    """The real head count (30 x 128) at degrees that do not divide it, on one spawn of 8 ranks."""
    for rank, errors in enumerate(run_distributed(_joint_split_at_30_heads, 8, timeout=300, threads=1)):
        assert set(errors) == {d for d in (3, 5, 6, 8) if rank < d}
        PARITY_LOG.extend((f"z_image_30_heads/d{degree}", "float32", error) for degree, error in errors.items())
        assert all(error <= FP32_TOL for error in errors.values()), (rank, errors)


def test_detection_tells_the_families_apart(zi_files):
    expected = {"comfy_prefix": ("original", COMFY_PREFIX), "comfy": ("original", ""), "diffusers": ("diffusers", ""),
                "diffusers_folder": ("diffusers", "")}
    for layout, path in zi_files.items():
        header = read_checkpoint_header(path)
        detection = z_image.detect(header)
        assert (detection.layout, detection.prefix) == expected[layout]
        config = detection.config
        assert (config["n_heads"], config["dim"], config["n_layers"], config["n_refiner_layers"]) == (5, 640, 2, 1)
        assert tuple(config["axes_dims"]) == (32, 48, 48)
        assert all(module.detect(header) is None for module in (qwen_image, qwen_image21, flux, flux2))


def real_size_keys(original: bool) -> dict:
    """Header entries of the released Z-Image-Turbo (30 x 128, 30 layers, 2 refiners, Qwen3-4B 2560 features)."""
    norms, embedder = (("q_norm", "k_norm"), "x_embedder") if original else (("norm_q", "norm_k"), "all_x_embedder.2-1")
    keys = {"cap_embedder.1.weight": (3840, 2560), "t_embedder.mlp.0.weight": (1024, 256), f"{embedder}.weight":
            (3840, 64), "x_pad_token": (1, 3840), "cap_pad_token": (1, 3840)}
    for stem, count in (("layers", 30), ("noise_refiner", 2), ("context_refiner", 2)):
        for block in range(count):
            for norm in norms:  # newer ComfyUI detects Lumina 2 by its k_norm
                keys[f"{stem}.{block}.attention.{norm}.weight"] = (128,)
            keys[f"{stem}.{block}.attention_norm1.weight"] = (3840,)
            keys[f"{stem}.{block}.feed_forward.w1.weight"] = (10240, 3840)
            keys[f"{stem}.{block}.adaLN_modulation.0.weight"] = (15360, 256)
            if original:
                keys[f"{stem}.{block}.attention.qkv.weight"] = (11520, 3840)
            else:
                keys[f"{stem}.{block}.attention.to_k.weight"] = (3840, 3840)
    return {key: ("BF16", shape) for key, shape in keys.items()}


@pytest.mark.parametrize("original", [True, False], ids=["comfy", "diffusers"])
def test_real_size_header_reads_as_30_heads_of_128(original):
    from sp_runtime.checkpoints.header import Header
    header = Header("z_image_turbo_bf16.safetensors",
                    {COMFY_PREFIX + key: value for key, value in real_size_keys(original).items()})
    detection = z_image.detect(header)
    assert (detection.layout, detection.prefix) == ("original" if original else "diffusers", COMFY_PREFIX)
    assert detection.config == {"all_patch_size": (2,), "all_f_patch_size": (1,), "in_channels": 16, "dim": 3840,
                                "n_layers": 30, "n_refiner_layers": 2, "n_heads": 30, "n_kv_heads": 30,
                                "cap_feat_dim": 2560, "rope_theta": 256.0, "t_scale": 1000.0,
                                "axes_dims": (32, 48, 48), "axes_lens": (1536, 512, 512)}


def test_key_plan_equals_diffusers_converter_at_full_width():
    """Every key of the released size (meta tensors) names the converter's parameter with its shape; the fused qkv
    at full width (rows tagged by index) splits into the converter's q, k, v."""
    from accelerate import init_empty_weights
    from diffusers import ZImageTransformer2DModel
    from diffusers.loaders.single_file_utils import convert_z_image_transformer_checkpoint_to_diffusers
    with init_empty_weights():
        full = ZImageTransformer2DModel(axes_lens=[1536, 512, 512])
    original = {**original_state_dict("z_image", full), "norm_final.weight": torch.empty(3840, device="meta")}
    want = convert_z_image_transformer_checkpoint_to_diffusers({COMFY_PREFIX + k: v for k, v in original.items()})
    plan = z_image.original_plan(original, full.config)
    got = {target: transform(original[source]) if transform else original[source]
           for source, targets in plan.items() for target, transform in targets}
    assert got.keys() == want.keys() == full.state_dict().keys()
    assert all(got[key].shape == want[key].shape for key in want)
    fused = torch.arange(3 * 3840, dtype=torch.float32)[:, None].expand(-1, 3840)
    name = "layers.7.attention.qkv.weight"
    want = convert_z_image_transformer_checkpoint_to_diffusers({COMFY_PREFIX + name: fused})
    split = {target: transform(fused) for target, transform in plan[name]}
    assert split.keys() == want.keys() and all(torch.equal(split[key], want[key]) for key in want)


def test_lora_on_the_fused_qkv_splits_like_the_weight(zi_files, tmp_path):
    """A ComfyUI-named LoRA of the fused qkv reaches to_q, to_k and to_v (rows in that order), and comes off."""
    from sp_runtime.lora.apply import LoraState
    path = zi_files["comfy_prefix"]
    model = z_image.load_model(path, "float32")[0]
    before = {name: value.clone() for name, value in model.state_dict().items()}
    g = torch.Generator().manual_seed(0)
    width, rank, alpha, strength = 640, 4, 2.0, 0.7
    up, down = torch.randn(3 * width, rank, generator=g), torch.randn(rank, width, generator=g)
    stem = "diffusion_model.layers.1.attention.qkv"
    lora = str(tmp_path / "qkv_lora.safetensors")
    save_file({f"{stem}.lora_B.weight": up, f"{stem}.lora_A.weight": down, f"{stem}.alpha": torch.tensor(alpha)},
              lora)
    state = LoraState(model, "z_image", path, torch.device("cpu"))
    assert state.set([[lora, strength]])["parameters"] == 3
    delta = strength * alpha / rank * (up @ down)
    after = model.state_dict()
    for index, part in enumerate("qkv"):
        key = f"layers.1.attention.to_{part}.weight"
        assert relative_error(after[key], before[key] + delta[index * width:(index + 1) * width]) <= 1e-6, key
    state.set([])
    assert all(torch.equal(value, before[name]) for name, value in model.state_dict().items())


def test_unsupported_inputs_and_variants_are_clear_errors(zi_files, tmp_path):
    from sp_runtime.contract import LoadRequest
    from sp_runtime.groups import SeqParallel
    groups = type("Groups", (), {"seq": SeqParallel.single()})()
    path = zi_files["comfy"]
    worker = z_image.load(LoadRequest(path, "float32"), z_image.detect(read_checkpoint_header(path)),
                          torch.device("cpu"), groups, lambda *_: None)
    x, t, inputs = make_cases()["batch_1"]
    out = torch.empty_like(x)
    for bad, match in (({"ref_latents": [x]}, "ref_latents .*not supported"), ({"context": None}, "needs context"),
                       ({"context": inputs["context"][..., :8]}, "needs context")):
        with pytest.raises(ValueError, match=match):
            worker.forward(x, t, {**inputs, **bad}, out, LocalContext(groups))
    with pytest.raises(ValueError, match=r"x has shape .*\[B, 16, H, W\]"):
        worker.forward(x[:, :8], t, inputs, out, LocalContext(groups))
    state = {COMFY_PREFIX + k: v for k, v in original_state_dict("z_image", build_tiny_model("z_image")).items()}
    omni = str(tmp_path / "omni.safetensors")
    save_file({**state, COMFY_PREFIX + "siglip_embedder.1.weight": torch.zeros(640, 8)}, omni)
    with pytest.raises(ValueError, match="Z-Image Omni"):
        z_image.detect(read_checkpoint_header(omni))
    one_pad = str(tmp_path / "one_pad.safetensors")
    save_file({k: v for k, v in state.items() if not k.endswith("x_pad_token")}, one_pad)
    with pytest.raises(ValueError, match="no .*x_pad_token"):
        z_image.detect(read_checkpoint_header(one_pad))
    pixel = str(tmp_path / "pixel.safetensors")
    save_file({**state, COMFY_PREFIX + "dec_net.cond_embed.weight": torch.zeros(4, 4)}, pixel)
    with pytest.raises(ValueError, match="pixel-space"):
        z_image.detect(read_checkpoint_header(pixel))


def test_ming_image_detection(tmp_path):
    """As ComfyUI tells Ming-Image: no pad tokens (Design: masked_pad_multiple 32), or pad tokens with the
    `__ming_image__` marker or `image_model: ming_image` config metadata (Layer: real pads); plain Z-Image stays."""
    import json
    state = {COMFY_PREFIX + k: v for k, v in original_state_dict("z_image", build_tiny_model("z_image")).items()}
    files = {"design": ({k: v for k, v in state.items() if not k.endswith("pad_token")}, None),
             "marker": ({**state, COMFY_PREFIX + "__ming_image__": torch.zeros(0)}, None),
             "metadata": (state, {"config": json.dumps({"transformer": {"image_model": "ming_image"}})}),
             "z_image": (state, {"config": json.dumps({"transformer": {"image_model": "lumina2"}})})}
    want = {"design": ("ming_image", 32), "marker": ("ming_image", None), "metadata": ("ming_image", None),
            "z_image": ("image", "absent")}
    for name, (tensors, metadata) in files.items():
        path = str(tmp_path / f"{name}.safetensors")
        save_file(tensors, path, metadata=metadata)
        detection = detect_any(read_checkpoint_header(path))
        assert (detection.family, detection.variant, detection.config.get("masked_pad_multiple", "absent")) == \
            ("z_image", *want[name]), name


def test_ming_image_with_pad_tokens_equals_its_reference(tmp_path):
    """Ming-Image with learned pads (a marked file): both streams padded as Z-Image, references after the target
    frames, then the pads; one rank against the reference (the suite checks the unpadded Design at every layout)."""
    from sp_lab.conformance.cases import ming_image_cases
    from sp_runtime.contract import LoadRequest
    from sp_runtime.groups import SeqParallel
    model = build_tiny_model("z_image", 3)
    state = {COMFY_PREFIX + k: v for k, v in original_state_dict("z_image", model).items()}
    path = str(tmp_path / "ming_layer.safetensors")
    save_file({**state, COMFY_PREFIX + "__ming_image__": torch.zeros(0)}, path)
    groups = type("Groups", (), {"seq": SeqParallel.single()})()
    detection = z_image.detect(read_checkpoint_header(path))
    worker = z_image.load(LoadRequest(path, "float32"), detection, torch.device("cpu"), groups, lambda *_: None)
    assert worker.info.x_ndim == 5 and worker.info.config["pad_tokens_multiple"] == 32
    for case in ("edit_refs", "two_frames"):
        x, t, inputs = ming_image_cases()[case]
        out = torch.empty_like(x)
        worker.forward(x, t, inputs, out, LocalContext(groups))
        assert_parity(out, z_image_reference(model, x, t, **inputs), "float32", f"z_image_ming_pads/{case}")
    x, t, inputs = ming_image_cases()["edit_refs"]
    out = torch.empty_like(x)
    for bad, match in (({"siglip_feats": [x]}, "siglip_feats .*not supported"),
                       ({"clip_text_pooled": x[:, 0, 0]}, "clip_text_pooled .*not supported"),
                       ({"direct_context": inputs["direct_context"][..., :8]}, "direct_context has shape"),
                       ({"ref_frames": [x[:, :, 0, :, :4][:, :8]]}, "ref_frames holds"),
                       ({"ref_frames": [x[:1, :, 0]]}, "ref_frames holds")):
        with pytest.raises(ValueError, match=match):
            worker.forward(x, t, {**inputs, **bad}, out, LocalContext(groups))
    with pytest.raises(ValueError, match=r"Ming-Image takes \[B, 16, F, H, W\]"):
        worker.forward(x[:, :, 0], t, inputs, torch.empty_like(x[:, :, 0]), LocalContext(groups))
