"""Krea 2 against ComfyUI's own SingleStreamDiT (needs COMFYUI_PATH with comfy/ldm/krea2): the reference forward the
pool is held to (sp_lab.references.krea2, the conformance suite's) equals ComfyUI's network built from what its
detection says of the tiny file, with its weights, on the suite's cases (the style reference's index_timestep_zero
references included)."""
from __future__ import annotations

import pytest

import comfy_support as cs
from family_support import assert_parity
from sp_lab.conformance.cases import krea2_cases
from sp_lab.references.krea2 import reference_forward
from sp_lab.tiny_models import COMFY_PREFIX, write_tiny_checkpoint
from sp_runtime.checkpoints.header import read_checkpoint_header
from sp_runtime.families import krea2
from test_image_families_comfy import comfy_detection, comfy_outputs, comfy_settings, load_comfy_weights, meta_state

pytestmark = pytest.mark.skipif(cs.comfyui_path() is None, reason=cs.NO_COMFYUI)
pytest_plugins = ["family_pools"]  # its summary prints the parity table


def test_reference_equals_comfys_single_stream_dit(tmp_path):
    cs.import_comfy()
    model_module = pytest.importorskip("comfy.ldm.krea2.model", reason="this ComfyUI predates Krea 2")
    path = write_tiny_checkpoint("krea2", str(tmp_path / "krea2.safetensors"), seed=17, prefix=COMFY_PREFIX)
    header = read_checkpoint_header(path)
    theirs = comfy_detection(meta_state(header))
    ours = krea2.detect(header).config
    assert (theirs["image_model"], theirs["heads"], theirs["kvheads"], theirs["txtlayers"], theirs["txtdim"]) == \
        ("krea2", ours["num_attention_heads"], ours["num_key_value_heads"], ours["num_text_layers"],
         ours["text_hidden_dim"])
    settings = {key: value for key, value in theirs.items() if key != "image_model"}
    network = model_module.SingleStreamDiT(**settings, **comfy_settings()).eval()
    load_comfy_weights(network, path)
    cases = krea2_cases()
    expected = comfy_outputs(network, cases, lambda net, x, t, inputs: net(x, t, **inputs))
    model = krea2.load_model(path)[0]
    for name, (x, t, inputs) in cases.items():
        assert_parity(reference_forward(model, x, t, **inputs), expected[name], "float32", f"comfyui_krea2/{name}")
