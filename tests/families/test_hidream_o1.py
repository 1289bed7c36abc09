"""HiDream-O1 beyond the conformance suite (sp_lab.conformance: its ComfyUI file with and without prefix, fp32 parity at
Ulysses 1-4, Ring 3, Ulysses 2 x Ring 2, Ulysses 2 x CFG 2, a quantized file, a LoRA, TP refused by name): the key plan
against the hand-written ComfyUI writer (the vision tower dropped), the released sizes, neighbours' files, the cases'
guards (the prompt, the time and the causal prefix all change the output), and refusals at the call naming the input
(reference images first)."""
from __future__ import annotations

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
    assert all(plan[key] == [] for key in tiny.VISION_TOWER)
    got = {target: original[key] for key, targets in plan.items() for target, _ in targets}
    state = model.state_dict()
    assert got.keys() == state.keys() and all(torch.equal(got[key], state[key]) for key in state)


def released_header(vocab: int = 151936) -> dict:
    """Header entries of the released HiDream-O1 (Qwen3-VL-8B: 36 layers of 4096, 32 query heads of 128 over 8,
    12288 MLP features; 32 x 32 RGB patches through a 1024 bottleneck; a vision tower)."""
    keys = {"language_model.embed_tokens.weight": (vocab, 4096), "language_model.norm.weight": (4096,),
            "t_embedder1.mlp.0.weight": (4096, 256), "x_embedder.proj1.weight": (1024, 3072),
            "final_layer2.linear.weight": (3072, 4096), "visual.blocks.0.attn.qkv.weight": (3456, 1152)}
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
                                "mrope_section": (24, 20, 20), "rms_norm_eps": 1e-6, "tms_token_id": 151673}
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


@pytest.mark.parametrize("family_pool", [2], indirect=True)
def test_refusals_name_the_input(family_pool, family_subject):
    subject = family_subject("hidream_o1")
    handle = family_pool.load_model(subject.path)
    x, t, inputs = subject.spec.cases()["41_tokens"]
    refs = torch.zeros(2, 12, 3072)  # ComfyUI repeats the conds to the batch
    bad = {"reference images \\(ref_patches": ({**inputs, "ref_patches": refs}, x),
           "reference images \\(ref_pixel_values": ({**inputs, "ref_pixel_values": torch.zeros(2, 64, 1536)}, x),
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
