"""Cosmos-Predict2 against ComfyUI's own MiniTrainDIT (needs COMFYUI_PATH): the reference forward the pool is held
to (sp_lab.references.cosmos, the conformance suite's) equals ComfyUI's network built from what its detection says
of a released header, at the tiny file's sizes and with its weights, on the suite's cases; ComfyUI's detection of
the released header gives the configuration ours gives."""
from __future__ import annotations

import inspect

import pytest

import comfy_support as cs
from family_support import assert_parity
from sp_lab.conformance.cases import cosmos_cases
from sp_lab.references.cosmos import reference_forward
from sp_lab.tiny_models import COMFY_PREFIX, write_tiny_checkpoint
from sp_runtime.checkpoints.header import Header, read_checkpoint_header
from sp_runtime.families import cosmos
from safetensors.torch import load_file
from test_cosmos import released_header
from test_image_families_comfy import comfy_detection, comfy_outputs, comfy_settings, meta_state

pytestmark = pytest.mark.skipif(cs.comfyui_path() is None, reason=cs.NO_COMFYUI)
pytest_plugins = ["family_pools"]  # its summary prints the parity table


def test_reference_equals_comfys_mini_train_dit(tmp_path):
    cs.import_comfy()
    from comfy.ldm.cosmos.predict2 import MiniTrainDIT
    path = write_tiny_checkpoint("cosmos", str(tmp_path / "cosmos.safetensors"), seed=12, prefix=COMFY_PREFIX)
    released = comfy_detection(meta_state(Header("cosmos.safetensors", released_header())))
    ours = cosmos.detect(read_checkpoint_header(path)).config
    tiny = dict(model_channels=ours["num_attention_heads"] * ours["attention_head_dim"],
                num_blocks=ours["num_layers"], num_heads=ours["num_attention_heads"], mlp_ratio=ours["mlp_ratio"],
                crossattn_emb_channels=ours["text_embed_dim"], adaln_lora_dim=ours["adaln_lora_dim"])
    settings = {key: value for key, value in released.items() if key != "image_model"}
    network = MiniTrainDIT(**{**settings, **tiny}, **comfy_settings()).eval()
    state = {key[len(COMFY_PREFIX):]: value for key, value in load_file(path).items()}
    network.load_state_dict(state, strict=False)  # ComfyUI's rotary keeps buffers of its own
    cases = cosmos_cases()
    if "pad_to_patch_size" not in inspect.getsource(MiniTrainDIT._forward):  # older ComfyUI refuses odd sizes
        cases = {name: case for name, case in cases.items() if not any(size % 2 for size in case[0].shape[-2:])}
    expected = comfy_outputs(network, cases, lambda net, x, t, inputs: net(x, t, inputs["context"]))
    model = cosmos.load_model(path)[0]
    for name, (x, t, inputs) in cases.items():
        assert_parity(reference_forward(model, x, t, **inputs), expected[name], "float32", f"comfyui_cosmos/{name}")


def test_comfy_detection_of_a_released_header_equals_ours():
    header = Header("cosmos_predict2_2B_t2i.safetensors", released_header())
    theirs, ours = comfy_detection(meta_state(header)), cosmos.detect(header).config
    assert theirs["image_model"] == "cosmos_predict2" and not theirs["extra_per_block_abs_pos_emb"]
    assert (theirs["model_channels"], theirs["num_heads"], theirs["num_blocks"], theirs["in_channels"]) == \
        (ours["num_attention_heads"] * ours["attention_head_dim"], ours["num_attention_heads"], ours["num_layers"],
         ours["in_channels"])
    assert (theirs["rope_t_extrapolation_ratio"], theirs["rope_h_extrapolation_ratio"],
            theirs["rope_w_extrapolation_ratio"]) == ours["rope_scale"]
    assert theirs["adaln_lora_dim"] == ours["adaln_lora_dim"] and theirs["crossattn_emb_channels"] == 1024
