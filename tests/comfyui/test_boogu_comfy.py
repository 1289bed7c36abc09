"""Boogu-Image against ComfyUI's own BooguTransformer2DModel (needs COMFYUI_PATH with comfy/ldm/boogu, 0.26.0 or
newer): the reference forward the pool is held to (sp_lab.references.boogu, the conformance suite's) equals
ComfyUI's network built from what its detection says of the tiny file (the head counts and rotary axes it fixes for
the released size given as the tiny file's), with its weights, on the suite's cases (the edit's references)."""
from __future__ import annotations

import pytest

import comfy_support as cs
from family_support import assert_parity
from sp_lab.conformance.cases import boogu_cases
from sp_lab.references.boogu import reference_forward
from sp_lab.tiny_models import COMFY_PREFIX, write_tiny_checkpoint
from sp_runtime.checkpoints.header import read_checkpoint_header
from sp_runtime.families import boogu
from test_image_families_comfy import comfy_detection, comfy_outputs, comfy_settings, load_comfy_weights, meta_state

pytestmark = pytest.mark.skipif(cs.comfyui_path() is None, reason=cs.NO_COMFYUI)
pytest_plugins = ["family_pools"]  # its summary prints the parity table


def test_reference_equals_comfys_boogu(tmp_path):
    cs.import_comfy()
    model_module = pytest.importorskip("comfy.ldm.boogu.model", reason="this ComfyUI predates Boogu-Image")
    path = write_tiny_checkpoint("boogu", str(tmp_path / "boogu.safetensors"), seed=21, prefix=COMFY_PREFIX)
    header = read_checkpoint_header(path)
    theirs, ours = comfy_detection(meta_state(header)), boogu.detect(header).config
    pairs = {"hidden_size": "hidden_size", "num_layers": "num_layers", "num_refiner_layers": "num_refiner_layers",
             "num_double_stream_layers": "num_double_stream_layers", "instruction_feat_dim": "cap_feat_dim"}
    assert theirs["image_model"] == "boogu"
    assert {key: theirs[key] for key in pairs} == {key: ours[value] for key, value in pairs.items()}
    settings = {key: value for key, value in theirs.items() if key != "image_model"}
    tiny = dict(num_attention_heads=ours["num_attention_heads"], num_kv_heads=ours["num_kv_heads"],
                axes_dim_rope=ours["axes_dim_rope"])
    network = model_module.BooguTransformer2DModel(**settings, **tiny, **comfy_settings()).eval()
    load_comfy_weights(network, path)
    cases = boogu_cases()
    expected = comfy_outputs(network, cases, lambda net, x, t, inputs: net(x, t, inputs["context"],
                                                                          inputs["num_tokens"],
                                                                          ref_latents=inputs.get("ref_latents"),
                                                                          transformer_options={}))
    model = boogu.load_model(path)[0]
    for name, (x, t, inputs) in cases.items():
        assert_parity(reference_forward(model, x, t, **inputs), expected[name], "float32", f"comfyui_boogu/{name}")
