"""LTX-Video 0.9 against ComfyUI's own LTXVModel (needs COMFYUI_PATH): the reference forward the pool is held to
(sp_lab.references.ltxv, the conformance suite's) equals ComfyUI's network built from what its detection says of
the tiny file (its `config` metadata included), with its weights, on the suite's cases (per-token sigmas and guide
frames included); ComfyUI's detection gives the configuration ours gives."""
from __future__ import annotations

import inspect

import pytest
import torch

import comfy_support as cs
from family_support import assert_parity
from sp_lab.conformance.cases import ltxv_cases
from sp_lab.references.ltxv import reference_forward
from sp_lab.tiny_models import COMFY_PREFIX, write_tiny_checkpoint
from sp_runtime.checkpoints.header import read_checkpoint_header
from sp_runtime.families import ltxv
from test_image_families_comfy import comfy_outputs, comfy_settings, load_comfy_weights, meta_state

pytestmark = pytest.mark.skipif(cs.comfyui_path() is None, reason=cs.NO_COMFYUI)
pytest_plugins = ["family_pools"]  # its summary prints the parity table


def comfy_call(network, x, t, inputs):
    """ComfyUI's call; newer ComfyUI takes guides as [start, end) bounds with the denoise mask beside them."""
    inputs = dict(inputs)
    guides = inputs.get("keyframe_idxs")
    if guides is not None and "start_end" in inspect.signature(type(network.patchifier).__init__).parameters:
        ends = guides + torch.tensor([8.0, 32.0, 32.0]).view(1, 3, 1)
        inputs["keyframe_idxs"] = torch.stack([guides, ends], dim=-1)
        inputs["denoise_mask"] = torch.ones(x.shape[0], 1, *x.shape[2:])
        t = t.view(-1, 1, 1).expand(x.shape[0], x[0, 0].numel(), 1)  # a denoise mask makes sigmas per token
    return network(x, t, inputs.pop("context"), None, **inputs)


def test_reference_equals_comfys_ltxv_model(tmp_path):
    cs.import_comfy()
    import comfy.model_detection
    from comfy.ldm.lightricks.model import LTXVModel
    path = write_tiny_checkpoint("ltxv", str(tmp_path / "ltxv.safetensors"), seed=14, prefix=COMFY_PREFIX)
    header = read_checkpoint_header(path)
    theirs = comfy.model_detection.detect_unet_config(meta_state(header), COMFY_PREFIX, header.metadata)
    ours = ltxv.detect(header).config
    assert theirs["image_model"] == "ltxv"
    assert {key: theirs[key] for key in ("num_layers", "attention_head_dim", "cross_attention_dim",
                                         "num_attention_heads", "causal_temporal_positioning")} == \
        {key: ours[key] for key in ("num_layers", "attention_head_dim", "cross_attention_dim",
                                    "num_attention_heads", "causal_temporal_positioning")}
    settings = {key: value for key, value in theirs.items() if key != "image_model"}
    network = LTXVModel(**settings, in_channels=16, caption_channels=32, **comfy_settings()).eval()
    load_comfy_weights(network, path)
    cases = ltxv_cases()
    expected = comfy_outputs(network, cases, comfy_call)
    model = ltxv.load_model(path)[0]
    for name, (x, t, inputs) in cases.items():
        assert_parity(reference_forward(model, x, t, **inputs), expected[name], "float32", f"comfyui_ltxv/{name}")
