"""Kandinsky 5 against ComfyUI's own model (needs COMFYUI_PATH with comfy/ldm/kandinsky5: ComfyUI 0.3.68 and newer):
the reference forward the pool is held to (sp_lab.references.kandinsky5, the conformance suite's) equals ComfyUI's
Kandinsky5 network built from what its detection says of the tiny files, with their weights, on the suite's cases
(image to video's time_dim_replace included) and on the image model's 4-D latents."""
from __future__ import annotations

import pytest
import torch

import comfy_support as cs
from family_support import assert_parity
from sp_lab.conformance.cases import kandinsky5_cases
from sp_lab.references.kandinsky5 import reference_forward
from sp_lab.tiny_models import COMFY_PREFIX, write_tiny_checkpoint
from sp_runtime.checkpoints.header import read_checkpoint_header
from sp_runtime.families import kandinsky5
from test_image_families_comfy import comfy_detection, comfy_outputs, comfy_settings, load_comfy_weights, meta_state
from test_kandinsky5 import image_cases

pytestmark = pytest.mark.skipif(cs.comfyui_path() is None, reason=cs.NO_COMFYUI)
pytest_plugins = ["family_pools"]  # its summary prints the parity table


@pytest.mark.parametrize("variant", ["video", "image"])
def test_reference_equals_comfys_kandinsky5(tmp_path, variant):
    cs.import_comfy()
    model_module = pytest.importorskip("comfy.ldm.kandinsky5.model", reason="this ComfyUI predates Kandinsky 5")
    path = write_tiny_checkpoint("kandinsky5", str(tmp_path / f"{variant}.safetensors"), seed=15,
                                 prefix=COMFY_PREFIX, variant="" if variant == "video" else variant)
    header = read_checkpoint_header(path)
    theirs = comfy_detection(meta_state(header))
    ours = kandinsky5.detect(header).config
    assert theirs["image_model"] == "kandinsky5" and theirs["visual_embed_dim"] == \
        (2 * ours["in_visual_dim"] + 1 if ours["visual_cond"] else ours["in_visual_dim"]) * 4
    # ComfyUI states the rotary axes only for its known widths, (16, 24, 24) being its class default
    axes = tuple(theirs.get("axes_dims", (16, 24, 24)))
    assert (theirs["model_dim"], theirs["ff_dim"], theirs["time_dim"], axes) == \
        (ours["model_dim"], ours["ff_dim"], ours["time_dim"], ours["axes_dims"])
    settings = {key: value for key, value in theirs.items() if key != "image_model"}
    network = model_module.Kandinsky5(**settings, in_text_dim=32, in_text_dim2=24, **comfy_settings()).eval()
    load_comfy_weights(network, path)
    cases = kandinsky5_cases() if variant == "video" else image_cases()
    # ComfyUI returns the latent padded to whole patches (its sampler then fails on odd sizes): the pool crops it
    expected = comfy_outputs(network, cases, lambda net, x, t, inputs: net(x, t, **inputs)[..., :x.shape[-2],
                                                                                          :x.shape[-1]])
    model = kandinsky5.load_model(path)[0]
    for name, (x, t, inputs) in cases.items():
        assert_parity(reference_forward(model, x, t, **inputs), expected[name], "float32",
                      f"comfyui_kandinsky5_{variant}/{name}")
