"""Ideogram 4 against ComfyUI's own Ideogram4Transformer2DModel (needs COMFYUI_PATH with comfy/ldm/ideogram4): the
reference forward the pool is held to (sp_lab.references.ideogram4, the conformance suite's) equals ComfyUI's network
at the tiny file's sizes and with its weights (ComfyUI's detection fixes the released heads, so the network is built
with the tiny sizes and the released settings), on the suite's cases (the image-only case as DualModelGuider's
negative calls it, context None); ComfyUI's detection of a released header gives the file's in_channels and depth."""
from __future__ import annotations

import os

import pytest

import comfy_support as cs
from family_support import assert_parity
from sp_lab.conformance.cases import ideogram4_cases
from sp_lab.references.ideogram4 import reference_forward
from sp_lab.tiny_models import COMFY_PREFIX, write_tiny_checkpoint
from sp_runtime.checkpoints.header import Header, read_checkpoint_header
from sp_runtime.families import ideogram4
from test_ideogram4 import released_header
from test_image_families_comfy import comfy_detection, comfy_outputs, comfy_settings, load_comfy_weights, meta_state

_PATH = cs.comfyui_path()
pytestmark = pytest.mark.skipif(_PATH is None or not os.path.isdir(os.path.join(_PATH, "comfy", "ldm", "ideogram4")),
                                reason=cs.NO_COMFYUI + " (with comfy/ldm/ideogram4)")
pytest_plugins = ["family_pools"]  # its summary prints the parity table


def test_reference_equals_comfys_ideogram4(tmp_path):
    cs.import_comfy()
    from comfy.ldm.ideogram4.model import Ideogram4Transformer2DModel
    path = write_tiny_checkpoint("ideogram4", str(tmp_path / "ideogram4.safetensors"), seed=9, prefix=COMFY_PREFIX)
    config = ideogram4.detect(read_checkpoint_header(path)).config
    network = Ideogram4Transformer2DModel(**config, **comfy_settings()).eval()
    load_comfy_weights(network, path)
    cases = ideogram4_cases()
    expected = comfy_outputs(network, cases, lambda net, x, t, inputs: net(x, t, inputs["context"]))
    model = ideogram4.load_model(path)[0]
    for name, (x, t, inputs) in cases.items():
        assert_parity(reference_forward(model, x, t, **inputs), expected[name], "float32", f"comfyui_ideogram4/{name}")


def test_comfy_detection_of_a_released_header_equals_ours():
    header = Header("ideogram4_fp8_scaled.safetensors", released_header())
    theirs, ours = comfy_detection(meta_state(header)), ideogram4.detect(header).config
    assert theirs == {"image_model": "ideogram4", "in_channels": ours["in_channels"], "num_layers": ours["num_layers"]}
