"""Wan Animate 2 under Ulysses SP: ComfyUI's call (pose_latents through a pose branch whose keys / values each video
frame attends to, context_pose / clip_fea_pose, pose_strength, reference_strength) equals diffusers' own
WanAnimate2Transformer3DModel (its extract pass over the pose video, then its cached pass) in one process, at
Ulysses degrees 1-4, Ring, Ulysses x Ring and CFG-parallel (3 heads of 128, shards that cut frames, padded sizes,
batch 2 and 1); without pose it equals Wan 2.1 I2V. Detection by metadata and by key layout, the key plan against
diffusers' converter, bad inputs; and ComfyUI's own WanAnimate2Model where COMFYUI_PATH's ComfyUI has it."""
from __future__ import annotations

import json
import os
import re
from unittest import mock

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
from sp_runtime.families.wan.keys import wan_key_plan
from sp_lab.references.wan import WanSinusoid, wrap_pad
from sp_runtime.groups import ParallelGroups, SeqParallel
from sp_lab.tiny_models import COMFY_PREFIX, build_tiny_model, original_state_dict, write_tiny_checkpoint

pytest_plugins = ["family_pools"]  # the shared per-degree and per-layout worker pools

SEED = 23
SIZE = dict(num_attention_heads=3, attention_head_dim=128)  # 3 heads: 2 and 4 ranks do not divide them
PATCH = (1, 2, 2)


def _call(generator, batch, frames, height, width, pose=True, strengths=(0.7, 1.3)):
    """(x, timestep, inputs) as ComfyUI's WAN_Animate2 passes them: x noise 16 + mask 4 + reference image 16
    channels (frame 0 the reference image's slot), one pose frame per later frame; diffusers pads every prompt to 512
    tokens, so they have 512."""
    rand = lambda *shape: torch.randn(*shape, generator=generator)  # noqa: E731
    inputs = {"context": rand(batch, 512, 32), "clip_fea": rand(batch, 5, 1280)}
    if pose:
        inputs.update(pose_latents=rand(batch, 16, frames - 1, height, width), context_pose=rand(batch, 512, 32),
                      clip_fea_pose=rand(batch, 3, 1280), pose_strength=strengths[0],
                      reference_strength=strengths[1])
    timestep = torch.tensor([700.0, 300.0][:batch])
    return rand(batch, 36, frames, height, width), timestep, inputs


def make_cases() -> dict:
    """27 video + 18 pose tokens (3 frames of 3 x 3, H padded), batch 2; batch 1 (CFG-parallel runs it on every
    rank as more ring blocks); and no pose (the node windows it out), which is Wan 2.1 I2V."""
    g = torch.Generator().manual_seed(3)
    return {"pose_padded": _call(g, 2, 3, 5, 6), "batch1_unit_strengths": _call(g, 1, 4, 4, 4, strengths=(1, 1)),
            "no_pose": _call(g, 2, 2, 4, 6, pose=False)}


@pytest.fixture(scope="session")
def model():
    """The tiny model as the workers build it: diffusers' WanTransformer3DModel with Wan 2.1 I2V's modules."""
    return build_tiny_model("wan", SEED, variant="animate2", **SIZE)


@pytest.fixture(scope="session")
def path(tmp_path_factory):
    return write_tiny_checkpoint("wan", str(tmp_path_factory.mktemp("wan_animate2") / "animate2.safetensors"),
                                 seed=SEED, variant="animate2", prefix=COMFY_PREFIX, **SIZE)


def release_state(model) -> dict:
    """The weights under the Wan-Video release's names (every block wrapped as blocks.N.block.*)."""
    return {re.sub(r"^(blocks\.\d+)\.", r"\1.block.", key): value
            for key, value in original_state_dict("wan", model).items()}


def diffusers_model(config, original: dict):
    """diffusers' WanAnimate2Transformer3DModel of the tiny model's size with weights under ComfyUI's names, through
    diffusers' own converter."""
    from diffusers import WanAnimate2Transformer3DModel
    from diffusers.loaders.single_file_utils import convert_wan_animate_2_transformer_to_diffusers
    reference = WanAnimate2Transformer3DModel(
        dim=config.num_attention_heads * config.attention_head_dim, ffn_dim=config.ffn_dim, freq_dim=config.freq_dim,
        text_dim=config.text_dim, num_heads=config.num_attention_heads, num_layers=config.num_layers,
        in_dim=config.in_channels, out_dim=config.out_channels)
    reference.load_state_dict(convert_wan_animate_2_transformer_to_diffusers(dict(original)), strict=True)
    reference.timesteps_proj = WanSinusoid(config.freq_dim)  # Wan's own sinusoid, as ComfyUI (see sp_lab.references.wan)
    return reference.eval()


@pytest.fixture(scope="session")
def diffusers_animate2(model):
    return diffusers_model(model.config, release_state(model))


def diffusers_forward(reference, x, timestep, inputs) -> torch.Tensor:
    """ComfyUI's WanAnimate2Model call, computed by diffusers' class: its extract pass caches each block's pose
    keys / values (pose_strength scales the cached values), its cached pass attends to them through its flex block
    mask (reference_strength scales frame 0's values through a hook on the video pass's to_v). The mask is built
    without torch.compile (the same mask, eager)."""
    from diffusers.models.transformers import transformer_wan_animate_2 as module
    frames = x.shape[2]
    latent, pose = wrap_pad(x, PATCH), wrap_pad(inputs["pose_latents"], PATCH)
    rows, cols = latent.shape[3] // 2, latent.shape[4] // 2
    pose_grid = torch.tensor([[frames - 1, rows, cols]] * x.shape[0])  # one row per sample
    context_pose, clip_pose = inputs.get("context_pose", inputs["context"]), inputs.get("clip_fea_pose",
                                                                                     inputs["clip_fea"])
    cache = module.WanAnimate2KVCache(len(reference.blocks))
    make_mask = module.create_block_mask
    eager_mask = lambda *args, **kw: make_mask(*args, **{**kw, "_compile": False})  # noqa: E731
    with torch.no_grad(), mock.patch.object(module, "create_block_mask", eager_mask):
        reference(list(pose), timestep=timestep, encoder_hidden_states=list(context_pose),
                  encoder_hidden_states_image=clip_pose, kv_cache=cache, kv_cache_mode="extract",
                  condition_latents=[torch.cat([torch.ones_like(p[:4]), p]) for p in pose],
                  seq_len=(frames - 1) * rows * cols, offset_grid_sizes=pose_grid)
        for layer in cache.layer_caches:
            layer.value = layer.value * inputs.get("pose_strength", 1.0)
        scale = inputs.get("reference_strength", 1.0)
        hooks = [block.self_attn.to_v.register_forward_hook(
            lambda _, __, out: torch.cat([out[:, :rows * cols] * scale, out[:, rows * cols:]], dim=1))
            for block in reference.blocks]
        try:
            out = reference(list(latent[:, :16]), timestep=timestep, encoder_hidden_states=list(inputs["context"]),
                            encoder_hidden_states_image=inputs["clip_fea"], condition_latents=list(latent[:, 16:]),
                            kv_cache=cache, kv_cache_mode="cached", seq_len=frames * rows * cols,
                            reference_grid_sizes=pose_grid, origin_len=4 * (frames - 2),
                            origin_area=[16 * rows, 16 * cols]).sample
        finally:
            for hook in hooks:
                hook.remove()
    return torch.stack(out)[:, :, :, :x.shape[3], :x.shape[4]]


@pytest.fixture(scope="session")
def references(model, diffusers_animate2):
    cases = make_cases()
    out = {name: diffusers_forward(diffusers_animate2, x, t, inputs) for name, (x, t, inputs) in cases.items()
           if "pose_latents" in inputs}
    x, t, inputs = cases["no_pose"]
    out["no_pose"] = reference_forward(model, x, t, **inputs)  # diffusers' WanTransformer3DModel (I2V)
    return out


def test_fp32_parity(family_pool, path, references):
    handle = family_pool.load_model(path)
    assert (handle.info.variant, handle.info.config["num_heads"]) == ("animate2", 3)
    for name in ("pose_padded", "no_pose"):
        x, t, inputs = make_cases()[name]
        assert_parity(handle(x, t, **inputs), references[name], "float32", f"animate2/{name}")


def test_fp32_parity_ring_hybrid_and_cfg(layout_pool, path, references):
    layout, pool = layout_pool
    handle = pool.load_model(path)
    for name in ("pose_padded", "batch1_unit_strengths") if layout == "u2cfg2" else ("pose_padded",):
        x, t, inputs = make_cases()[name]
        assert_parity(handle(x, t, **inputs), references[name], "float32", f"animate2_{layout}/{name}")


def test_the_pose_and_the_strengths_change_the_output(diffusers_animate2, references):
    """The reference is sensitive to what the parity tests compare: pose values, their strength, the reference's."""
    x, t, inputs = make_cases()["pose_padded"]
    for change in ({"pose_latents": inputs["pose_latents"].flip(2)}, {"pose_strength": 1.0},
                   {"reference_strength": 1.0}):
        changed = diffusers_forward(diffusers_animate2, x, t, {**inputs, **change})
        assert relative_error(changed, references["pose_padded"]) > 1e-3, change


@pytest.fixture(scope="session")
def other_layouts(model, tmp_path_factory):
    """The same weights: without metadata (ComfyUI's names), as the Wan-Video release names them, and with
    diffusers' WanAnimate2Transformer3DModel's names."""
    from safetensors.torch import save_file
    from diffusers.loaders.single_file_utils import convert_wan_animate_2_transformer_to_diffusers
    folder = tmp_path_factory.mktemp("wan_animate2_layouts")
    metadata = {"ulysses_sp.head_dim": "128"}
    states = {"bare": original_state_dict("wan", model), "release": release_state(model)}
    states["diffusers"] = convert_wan_animate_2_transformer_to_diffusers(dict(states["release"]))
    paths = {}
    for name, state in states.items():
        paths[name] = str(folder / f"{name}.safetensors")
        save_file({key: value.contiguous() for key, value in state.items()}, paths[name], metadata=metadata)
    return paths


def test_detection_by_metadata_and_by_key_layout(path, other_layouts):
    found = detect(read_checkpoint_header(path))
    assert (found.variant, found.layout, found.prefix) == ("animate2", "original", COMFY_PREFIX)
    assert wan.COMFY.model_class(found.variant) == "WAN_Animate2"
    for name in ("release", "diffusers"):
        assert detect(read_checkpoint_header(other_layouts[name])).variant == "animate2", name
    # ComfyUI's repackaged files have exactly Wan 2.1 I2V's keys: without the metadata ComfyUI too sees I2V
    assert detect(read_checkpoint_header(other_layouts["bare"])).variant == "i2v"


def test_every_layout_loads_the_same_model(other_layouts, references):
    groups = ParallelGroups(SPConfig(["cpu"]), 0, SeqParallel.single(), None, 0, None)
    x, t, inputs = make_cases()["pose_padded"]
    for name in ("release", "diffusers"):
        worker = load_worker_model(LoadRequest(other_layouts[name]), torch.device("cpu"), groups, lambda *_: None)
        out = torch.empty(2, 16, *x.shape[2:])
        with torch.no_grad():
            worker.forward(x, t, inputs, out, LocalContext(groups))
        assert_parity(out, references["pose_padded"], "float32", f"animate2/layout_{name}")


def test_int8_convrot_file_loads_as_animate2(model, tmp_path):
    """The templates' file kind: ComfyUI mixed precision (int8 convrot) with the animate2 metadata; loaded in fp32 it
    equals diffusers' Animate 2 on the weights the file encodes."""
    from safetensors.torch import load_file
    from sp_lab.tiny_models.quant_files import write_quantized
    path, encoded = str(tmp_path / "animate2_int8.safetensors"), str(tmp_path / "encoded.safetensors")
    kinds = write_quantized("wan", path, encoded, "comfy_quant", SEED, COMFY_PREFIX,
                            {"config": json.dumps({"transformer": {"model_type": "animate2"}})},
                            only="int8_tensorwise convrot", variant="animate2", **SIZE)
    assert set(kinds.values()) == {"int8_tensorwise convrot"}
    groups = ParallelGroups(SPConfig(["cpu"]), 0, SeqParallel.single(), None, 0, None)
    worker = load_worker_model(LoadRequest(path, "fp32"), torch.device("cpu"), groups, lambda *_: None)
    assert worker.info.variant == "animate2"
    x, t, inputs = make_cases()["pose_padded"]
    out = torch.empty(2, 16, *x.shape[2:])
    with torch.no_grad():
        worker.forward(x, t, inputs, out, LocalContext(groups))
    expected = diffusers_forward(diffusers_model(model.config, load_file(encoded)), x, t, inputs)
    assert_parity(out, expected, "float32", "animate2/int8_convrot")


def test_key_plan_equals_diffusers_converter(model):
    """Every release key goes where diffusers' converter sends it, up to the model class: our plan into
    WanTransformer3DModel, theirs into WanAnimate2Transformer3DModel, each name holding the same tensor."""
    from diffusers.loaders.single_file_utils import convert_wan_animate_2_transformer_to_diffusers
    release = release_state(model)
    theirs = convert_wan_animate_2_transformer_to_diffusers({COMFY_PREFIX + k: v for k, v in release.items()})
    plan = wan_key_plan(release)
    assert set(plan) == set(release), "every release key has a destination"
    state = model.state_dict()
    assert {target for targets in plan.values() for target, _ in targets} == set(state)
    assert len(theirs) == len(release)
    for key, targets in plan.items():
        (target, transform), = targets
        assert transform is None and torch.equal(state[target], release[key]), key


def test_animate2_metadata_on_another_wan_and_unknown_modules_are_named(tmp_path):
    from safetensors.torch import save_file
    t2v = original_state_dict("wan", build_tiny_model("wan", SEED, variant="t2v"))
    stated = {"config": json.dumps({"transformer": {"model_type": "animate2"}}), "ulysses_sp.head_dim": "16"}
    wrong = str(tmp_path / "t2v_said_animate2.safetensors")
    save_file({k: v.contiguous() for k, v in t2v.items()}, wrong, metadata=stated)
    with pytest.raises(ValueError, match=r"says it is a Wan Animate 2 checkpoint but has 16 input channels and no "
                                         r"CLIP image embedder"):
        detect(read_checkpoint_header(wrong))
    unknown = str(tmp_path / "unknown.safetensors")
    save_file({**{k: v.contiguous() for k, v in t2v.items()}, "blocks.0.pose_adapter.proj.weight": torch.zeros(2, 2),
               "blocks.1.pose_adapter.proj.weight": torch.zeros(2, 2)}, unknown, metadata=stated)
    with pytest.raises(ValueError, match=r"has modules this loader does not know: blocks\.\*\.pose_adapter\.proj "
                                         r"\(2 tensors\)"):
        detect(read_checkpoint_header(unknown))


def test_bad_animate2_inputs_are_named(path):
    groups = ParallelGroups(SPConfig(["cpu"]), 0, SeqParallel.single(), None, 0, None)
    worker = load_worker_model(LoadRequest(path), torch.device("cpu"), groups, lambda *_: None)
    x, t, inputs = make_cases()["pose_padded"]
    out = torch.empty(2, 16, *x.shape[2:])
    with pytest.raises(ValueError, match=r"pose_latents has shape \[2, 16, 3, 5, 6\]; this Wan Animate 2 model takes "
                                         r"\[B, 16, 2, 5, 6\]"):
        worker.forward(x, t, {**inputs, "pose_latents": torch.zeros(2, 16, 3, 5, 6)}, out, LocalContext(groups))


# ---------------------------------------------------------------------------------------------------------------
# ComfyUI's own WanAnimate2Model (COMFYUI_PATH, a ComfyUI that has it)

COMFY_UNET = dict(cs.COMFY_TINY_UNET["wan"], model_type="animate2", in_dim=36, dim=384, num_heads=3, num_layers=2)
COMFY_ANIMATE2 = os.path.join("comfy", "ldm", "wan", "model_animate2.py")
needs_comfy_animate2 = pytest.mark.skipif(
    cs.comfyui_path() is None or not os.path.isfile(os.path.join(cs.comfyui_path(), COMFY_ANIMATE2)),
    reason=cs.NO_COMFYUI if cs.comfyui_path() is None else
    f"ComfyUI at {cs.comfyui_path()} has no {COMFY_ANIMATE2} (WAN_Animate2): Wan Animate 2 needs a newer ComfyUI "
    f"than 0.3.64 (the class came in 2026)")


@pytest.fixture(scope="session")
def comfy_animate2(path):
    """ComfyUI's own WanAnimate2Model with the file's weights."""
    cs.import_comfy()
    from comfy.ldm.wan.model_animate2 import WanAnimate2Model
    import comfy.ops
    import comfy.utils
    config = {key: value for key, value in COMFY_UNET.items() if key not in ("image_model", "model_type")}
    network = WanAnimate2Model(operations=comfy.ops.disable_weight_init, device="cpu", dtype=torch.float32,
                               **config)
    weights = comfy.utils.load_torch_file(path)
    network.load_state_dict({key.removeprefix(COMFY_PREFIX): value for key, value in weights.items()}, strict=True)
    return network.eval()


@needs_comfy_animate2
def test_comfyui_animate2_parity(family_pool, path, comfy_animate2):
    handle = family_pool.load_model(path)
    for name, (x, t, inputs) in make_cases().items():
        with torch.no_grad():
            expected = comfy_animate2(x, t, **inputs)
        assert_parity(handle(x, t, **inputs), expected, "float32", f"animate2_comfyui/{name}")
