"""Ovis-Image against ComfyUI's own Flux model with Ovis' options (needs COMFYUI_PATH with Flux's yak_mlp): the
reference forward the pool is held to (sp_lab.references.ovis_image, the conformance suite's), on the model our loader
builds (SwiGLU split), equals ComfyUI's network built from what its detection says of the tiny file, with its weights,
on the suite's cases (rope_options and a reference by index included)."""
from __future__ import annotations

import inspect

import pytest

import comfy_support as cs
from family_support import assert_parity
from sp_lab.conformance.cases import ovis_image_cases
from sp_lab.references.ovis_image import reference_forward
from sp_lab.tiny_models import COMFY_PREFIX, write_tiny_checkpoint
from sp_runtime.checkpoints.header import read_checkpoint_header
from sp_runtime.families import ovis_image
from test_image_families_comfy import comfy_detection, comfy_outputs, comfy_settings, load_comfy_weights, meta_state

pytestmark = pytest.mark.skipif(cs.comfyui_path() is None, reason=cs.NO_COMFYUI)
pytest_plugins = ["family_pools"]  # its summary prints the parity table


def comfy_call(network, x, t, inputs):
    """ComfyUI's Flux call as its model class makes it: rope_options through transformer_options."""
    extra = {key: value for key, value in inputs.items() if key not in ("context", "rope_options")}
    options = {"rope_options": inputs["rope_options"]} if "rope_options" in inputs else {}
    return network(x, t, inputs["context"], transformer_options=options, **extra)


def test_reference_equals_comfys_flux_with_ovis_options(tmp_path):
    cs.import_comfy()
    import comfy.ldm.flux.layers
    import comfy.ldm.flux.model
    if "yak_mlp" not in inspect.signature(comfy.ldm.flux.layers.SingleStreamBlock).parameters:
        pytest.skip("this ComfyUI's Flux predates Ovis-Image (no yak_mlp)")
    path = write_tiny_checkpoint("ovis_image", str(tmp_path / "ovis.safetensors"), seed=20, prefix=COMFY_PREFIX)
    header = read_checkpoint_header(path)
    theirs = comfy_detection(meta_state(header))
    ours = ovis_image.detect(header).config
    assert (theirs["image_model"], theirs["yak_mlp"], theirs["txt_norm"], theirs["txt_ids_dims"],
            theirs["vec_in_dim"], theirs["guidance_embed"], theirs["context_in_dim"]) == \
        ("flux", True, True, [1, 2], None, False, ours["joint_attention_dim"])
    import comfy.model_detection  # the supported model ComfyUI picks is the class our host declares
    picked = comfy.model_detection.model_config_from_unet(meta_state(header), COMFY_PREFIX)
    assert type(picked).__name__ == ovis_image.COMFY.model_class("")
    # ComfyUI's detection fixes the released heads of 128 (axes 16, 56, 56) and 16 output channels: the tiny's here
    settings = {**theirs, "num_heads": ours["num_attention_heads"], "axes_dim": list(ours["axes_dims_rope"]),
                "out_channels": ours["in_channels"] // 4}
    network = load_comfy_weights(comfy.ldm.flux.model.Flux(**settings, **comfy_settings()), path)
    cases = ovis_image_cases()
    expected = comfy_outputs(network, cases, comfy_call)
    model = ovis_image.load_model(path)[0]
    for name, (x, t, inputs) in cases.items():
        assert_parity(reference_forward(model, x, t, **inputs), expected[name], "float32", f"comfyui_ovis_image/{name}")
