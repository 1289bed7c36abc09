"""HiDream-O1 beyond the conformance suite (sp_lab.conformance: its ComfyUI file with and without prefix, fp32 parity at
Ulysses 1-4, Ring 3, Ulysses 2 x Ring 2, Ulysses 2 x CFG 2, a quantized file, a LoRA, TP 2; cases with
one and two reference images): the key plan against the hand-written ComfyUI writer (the deepstack mergers dropped),
the released sizes, neighbours' files, the cases' guards (the prompt, the time, the causal prefix and each reference
path all change the output), the vision tower's output reused across steps, and refusals at the call naming the
input."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from family_support import assert_parity, relative_error
from sp_lab.conformance.cases import hidream_o1_cases
from sp_lab.references.hidream_o1 import reference_forward
from sp_lab.tiny_models import COMFY_PREFIX, write_tiny_checkpoint
from sp_lab.tiny_models import hidream_o1 as tiny
from sp_runtime.checkpoints.header import Header, read_checkpoint_header
from sp_runtime.detection import detect as detect_any
from sp_runtime.families import hidream, hidream_o1

pytest_plugins = ["family_pools"]


def test_key_plan_inverts_the_comfyui_writer():
    model = tiny.build_tiny_model(3)
    original = tiny.original_state_dict(model)
    plan = hidream_o1.original_plan(original, model.config)
    assert all(plan[key] == [] for key in tiny.DEEPSTACK)
    assert plan["visual.blocks.1.attn.qkv.weight"] == [("visual.blocks.1.attn.qkv.weight", None)]
    got = {target: original[key] for key, targets in plan.items() for target, _ in targets}
    state = model.state_dict()
    assert got.keys() == state.keys() and all(torch.equal(got[key], state[key]) for key in state)


def released_header(vocab: int = 151936) -> dict:
    """Header entries of the released HiDream-O1 (Qwen3-VL-8B: 36 layers of 4096, 32 query heads of 128 over 8,
    12288 MLP features; 32 x 32 RGB patches through a 1024 bottleneck; a vision tower)."""
    keys = {"language_model.embed_tokens.weight": (vocab, 4096), "language_model.norm.weight": (4096,),
            "t_embedder1.mlp.0.weight": (4096, 256), "x_embedder.proj1.weight": (1024, 3072),
            "final_layer2.linear.weight": (3072, 4096), "visual.patch_embed.proj.weight": (1152, 3, 2, 16, 16),
            "visual.pos_embed.weight": (2304, 1152), "visual.merger.linear_fc1.weight": (4608, 4608),
            "visual.merger.linear_fc2.weight": (4096, 4608), "visual.deepstack_merger_list.0.norm.weight": (4608,)}
    for block in range(27):
        keys[f"visual.blocks.{block}.mlp.linear_fc1.weight"] = (4304, 1152)
    for layer in range(36):
        stem = f"language_model.layers.{layer}."
        keys.update({stem + "self_attn.q_proj.weight": (4096, 4096), stem + "self_attn.k_proj.weight": (1024, 4096),
                     stem + "self_attn.q_norm.weight": (128,), stem + "mlp.gate_proj.weight": (12288, 4096)})
    return {COMFY_PREFIX + key: ("BF16", shape) for key, shape in keys.items()}


def test_released_header_and_neighbours(tmp_path):
    detection = detect_any(Header("hidream_o1_image_bf16.safetensors", released_header()))
    assert (detection.family, detection.variant, detection.prefix) == ("hidream_o1", "t2i", COMFY_PREFIX)
    assert detection.config == {"vocab_size": 151936, "hidden_size": 4096, "intermediate_size": 12288,
                                "num_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8,
                                "head_dim": 128, "patch_size": 32, "bottleneck_dim": 1024, "rope_theta": 5e6,
                                "mrope_section": (24, 20, 20), "rms_norm_eps": 1e-6, "tms_token_id": 151673,
                                "vision": {"width": 1152, "depth": 27, "inner": 4304, "patch": 16, "temporal": 2,
                                           "positions": 2304, "merge": 2, "out": 4096, "channels": 3}}
    without_tower = {key: value for key, value in released_header().items() if ".visual." not in key}
    assert detect_any(Header("hidream_o1_t2i_only.safetensors", without_tower)).config["vision"] is None
    with pytest.raises(ValueError, match="<\\|tms_token\\|> 151673"):
        detect_any(Header("hidream_o1_small_vocab.safetensors", released_header(vocab=1000)))
    neighbour = read_checkpoint_header(write_tiny_checkpoint("hidream", str(tmp_path / "hidream_i1.safetensors")))
    assert hidream_o1.detect(neighbour) is None and detect_any(neighbour).family == "hidream"
    ours = read_checkpoint_header(write_tiny_checkpoint("hidream_o1", str(tmp_path / "o1.safetensors")))
    assert hidream.detect(ours) is None and detect_any(ours).family == "hidream_o1"


def test_the_cases_exercise_prompt_time_and_causal_prefix():
    """Guards: the output depends on a prompt token, on the time (through <|tms_token|>) and on the causal prefix
    (full attention over the text gives another output), so a plan that dropped any of them would fail parity."""
    model = tiny.build_tiny_model(20)
    x, t, inputs = hidream_o1_cases()["41_tokens"]
    base = reference_forward(model, x, t, **inputs)
    ids = inputs["input_ids"].clone()
    ids[:, 1] += 7
    changed = {"prompt": reference_forward(model, x, t, **{**inputs, "input_ids": ids}),
               "causal prefix": reference_forward(model, x, t, **{**inputs, "ar_len": 0})}
    for name, out in changed.items():
        assert relative_error(out, base) > 1e-3, name
    later = t * 0.5  # the prediction x - out * sigma: the velocity's own 1 / sigma aside, time enters through the token
    predicted = [x - out * (step / 1000).view(-1, 1, 1, 1) for out, step in
                 ((base, t), (reference_forward(model, x, later, **inputs), later))]
    assert relative_error(predicted[1], predicted[0]) > 1e-3, "timestep token"


def test_the_reference_cases_exercise_both_paths():
    """Guards: the patches of either reference and the vision tower's rows of either reference change the image
    (each reference path reaches the output), so a plan that dropped, misplaced or swapped one would fail parity."""
    model = tiny.build_tiny_model(20)
    x, t, inputs = hidream_o1_cases()["2_references"]
    base = reference_forward(model, x, t, **inputs)
    pixels, patches = inputs["ref_pixel_values"], inputs["ref_patches"]
    for name, key, value, rows in (("first patches", "ref_patches", patches, slice(0, 3)),
                                   ("second patches", "ref_patches", patches, slice(3, 7)),
                                   ("first pixels", "ref_pixel_values", pixels, slice(0, 8)),
                                   ("second pixels", "ref_pixel_values", pixels, slice(8, 20))):
        changed = value.clone()
        changed[:, rows] *= -1
        assert relative_error(reference_forward(model, x, t, **{**inputs, key: changed}), base) > 1e-3, name


def fake_call(model, x, inputs):
    return SimpleNamespace(config=model.config, x=x, inputs=inputs)


def test_reference_refusals_name_the_input():
    """The plan's check (no pool needed): reference inputs that do not fit each other, the prompt or the model."""
    x, _, inputs = hidream_o1_cases()["1_reference"]
    model = tiny.build_tiny_model(20)
    hidream_o1.PLAN.check(fake_call(model, x, inputs))
    ids = inputs["input_ids"].clone()
    ids[:, 4] = 5
    grid = inputs["ref_image_grid_thw"].clone()
    grid[..., 2] = 3
    bad = {"both ref_pixel_values and ref_image_grid_thw": {**inputs, "ref_image_grid_thw": None},
           "Image-token count 5": {**inputs, "input_ids": ids},
           "ref_patches has shape": {**inputs, "ref_patches": inputs["ref_patches"][..., :100]},
           "multiples of 2": {**inputs, "ref_image_grid_thw": grid},
           "position_ids has shape": {**inputs, "ref_patches": inputs["ref_patches"][:, 1:]},
           "no ref_pixel_values came": {**inputs, "ref_pixel_values": None, "ref_image_grid_thw": None}}
    for needle, changed in bad.items():
        with pytest.raises(ValueError, match=needle):
            hidream_o1.PLAN.check(fake_call(model, x, changed))
    without_tower = tiny.build_tiny_model(20, vision=None)
    assert not hasattr(without_tower, "visual")
    with pytest.raises(ValueError, match="need the vision tower"):
        hidream_o1.PLAN.check(fake_call(without_tower, x, inputs))


@pytest.mark.parametrize("family_pool", [3], indirect=True)
def test_vision_output_reused_only_while_unchanged(family_pool, family_subject):
    """Steps of a generation reuse the vision tower's output; other pixels of the same shape are computed again (a
    stale cache fails parity)."""
    subject = family_subject("hidream_o1")
    handle = family_pool.load_model(subject.path)
    x, t, inputs = subject.spec.cases()["1_reference"]
    for _ in range(2):
        assert_parity(handle(x, t, **inputs), subject.outputs["1_reference"], "float32", "hidream_o1_vision_again")
    other = {**inputs, "ref_pixel_values": inputs["ref_pixel_values"].flip(1).contiguous()}
    assert_parity(handle(x, t, **other), subject.forward(x, t, **other), "float32", "hidream_o1_new_pixels")
    handle.unload()


@pytest.mark.parametrize("family_pool", [2], indirect=True)
def test_refusals_name_the_input(family_pool, family_subject):
    subject = family_subject("hidream_o1")
    handle = family_pool.load_model(subject.path)
    x, t, inputs = subject.spec.cases()["41_tokens"]
    bad = {"Image-token count 0": ({**inputs, "ref_pixel_values": torch.zeros(2, 64, 1536),
                                    "ref_image_grid_thw": torch.tensor([[[1, 8, 8]]] * 2)}, x),
           "multiples of 32": (inputs, x[..., :200]),
           "position_ids has shape": ({**inputs, "position_ids": inputs["position_ids"][..., 1:]}, x),
           "needs input_ids": ({key: value for key, value in inputs.items() if key != "input_ids"}, x),
           "ar_len 9": ({**inputs, "ar_len": 9}, x),
           "vinput_mask marks": ({**inputs, "vinput_mask": torch.ones(2, 41, dtype=torch.bool)}, x)}
    for needle, (changed, pixels) in bad.items():
        with pytest.raises(Exception, match=needle):
            handle(pixels, t, **changed)
    assert_parity(handle(x, t, **inputs), subject.outputs["41_tokens"], "float32", "hidream_o1_after_refusals")
    handle.unload()
