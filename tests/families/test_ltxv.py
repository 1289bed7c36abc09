"""LTX-Video 0.9 beyond the conformance suite (sp_lab.conformance: every file layout, fp32 parity at Ulysses 1-4,
Ring, hybrid and CFG layouts with per-token sigmas and a guide frame, quantized file, LoRA): the key plan against
diffusers' converter, the released sizes as ComfyUI's detection reads them (32 heads unless the `config` metadata
says otherwise), neighbours' files (LTX-2, PixArt) not taken, later releases' settings refused by name, a file
without the causal first frame, and the host hook (denoise mask kept on the host, guide attention refused)."""
from __future__ import annotations

import json

import pytest
import torch

from family_support import assert_parity, single_rank_worker
from sp_lab.conformance.cases import ltxv_cases
from sp_lab.references.ltxv import reference_forward
from sp_lab.tiny_models import COMFY_PREFIX, write_tiny_checkpoint
from sp_lab.tiny_models import ltxv as tiny
from sp_runtime.checkpoints.header import Header, read_checkpoint_header
from sp_runtime.detection import detect as detect_any
from sp_runtime.families import ltxv


def test_key_plan_equals_diffusers_converter():
    from diffusers.loaders.single_file_utils import convert_ltx_transformer_checkpoint_to_diffusers
    model = tiny.build_tiny_model(3)
    original = tiny.original_state_dict(model)
    plan = ltxv.original_plan(original)
    ours = {target: tensor for key, tensor in original.items() for target, _ in plan[key]}
    theirs = convert_ltx_transformer_checkpoint_to_diffusers({COMFY_PREFIX + k: v for k, v in original.items()})
    assert set(ours) == set(theirs) == set(model.state_dict())


def released_header(metadata: dict = None, extra: tuple = ()) -> Header:
    """LTX-Video 2B 0.9.5 as an all-in-one checkpoint: 2048 wide, 28 blocks, T5 4096, a VAE beside it."""
    keys = {"patchify_proj.weight": (2048, 128), "adaln_single.emb.timestep_embedder.linear_1.bias": (2048,),
            "caption_projection.linear_1.weight": (2048, 4096), "proj_out.weight": (128, 2048),
            "scale_shift_table": (2, 2048)}
    for block in range(28):
        keys[f"transformer_blocks.{block}.attn1.q_norm.weight"] = (2048,)
        keys[f"transformer_blocks.{block}.attn2.to_k.weight"] = (2048, 2048)
        keys[f"transformer_blocks.{block}.scale_shift_table"] = (6, 2048)
    keys.update({key: (2048,) for key in extra})
    tensors = {COMFY_PREFIX + key: ("BF16", shape) for key, shape in keys.items()}
    tensors["vae.decoder.conv_in.conv.weight"] = ("BF16", (512, 128, 3, 3, 3))
    text = {"config": json.dumps({"transformer": metadata})} if metadata is not None else {}
    return Header("ltx-video-2b-v0.9.5.safetensors", tensors, text)


def test_released_header_neighbours_and_refused_files(tmp_path):
    detection = detect_any(released_header({"causal_temporal_positioning": True}))
    assert (detection.family, detection.prefix) == ("ltxv", COMFY_PREFIX)
    assert detection.config == {"in_channels": 128, "out_channels": 128, "num_attention_heads": 32,
                                "attention_head_dim": 64, "cross_attention_dim": 2048, "num_layers": 28,
                                "caption_channels": 4096, "causal_temporal_positioning": True,
                                "timestep_scale_multiplier": 1000.0}
    assert not detect_any(released_header()).config["causal_temporal_positioning"]  # 0.9: no metadata
    for metadata, needle in (({"rope_type": "split"}, "split rotary"),
                             ({"positional_embedding_max_pos": [20, 4096, 4096]}, "rotary position ranges"),
                             ({"num_attention_heads": 24}, "width 2048 is not 24 heads of 64")):
        with pytest.raises(ValueError, match=needle):
            detect_any(released_header(metadata))
    with pytest.raises(ValueError, match="keyframe position embedding"):
        detect_any(released_header(extra=("keyframes_abs_pos_embedding",)))
    assert ltxv.detect(released_header(extra=("audio_adaln_single.linear.weight",))) is None  # LTX-2
    assert ltxv.detect(released_header(extra=("pos_embed.proj.bias",))) is None  # PixArt
    header = read_checkpoint_header(write_tiny_checkpoint("ltx2", str(tmp_path / "ltx2.safetensors")))
    assert ltxv.detect(header) is None and detect_any(header).family == "ltx2"


def test_file_without_causal_first_frame_and_bad_calls(tmp_path):
    """0.9 (no causal fix): the worker's positions follow the file (the reference computes them apart)."""
    path = write_tiny_checkpoint("ltxv", str(tmp_path / "ltxv.safetensors"), seed=2,
                                 causal_temporal_positioning=False)
    worker, context = single_rank_worker(path)
    x, t, inputs = ltxv_cases()["odd_video"]
    out = torch.empty(x.shape)
    worker.forward(x, t, inputs, out, context)
    model = ltxv.load_model(path)[0]
    assert_parity(out, reference_forward(model, x, t, **inputs), "float32", "ltxv/not_causal")
    causal = reference_forward(tiny.build_tiny_model(2), x, t, **inputs)
    assert (out - causal).abs().max() > 1e-3  # the causal fix changes the output: the check can fail
    mask = torch.ones(2, 9, dtype=torch.long)
    mask[1, 5:] = 0
    with pytest.raises(ValueError, match="attention_mask with padding"):
        worker.forward(x, t, {**inputs, "attention_mask": mask}, out, context)
    with pytest.raises(ValueError, match="one sigma per item or one per video token"):
        worker.forward(x, torch.zeros(2, 7), inputs, out, context)


def test_host_keeps_the_denoise_mask_and_refuses_guide_attention():
    x, t = torch.zeros(1, 16, 2, 3, 4), torch.zeros(1, 24, 1)
    inputs = {"context": torch.zeros(1, 3, 32), "denoise_mask": torch.ones(1, 1, 2, 3, 4)}
    assert set(ltxv.COMFY.hooks.pack(x, t, inputs)[2]) == {"context"}
    entries = [{"pre_filter_count": 12, "strength": 0.5}]
    with pytest.raises(ValueError, match="strength below 1"):
        ltxv.COMFY.hooks.pack(x, t, {**inputs, "guide_attention_entries": entries})
