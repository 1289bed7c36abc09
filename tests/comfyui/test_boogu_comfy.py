"""Boogu-Image against ComfyUI's own BooguTransformer2DModel (needs COMFYUI_PATH with comfy/ldm/boogu, 0.26.0 or
newer): the reference forward the pool is held to (sp_lab.references.boogu, the conformance suite's) equals
ComfyUI's network built from what its detection says of the tiny file (the head counts and rotary axes it fixes for
the released size given as the tiny file's), with its weights, on the suite's cases (the edit's references); and the
loader node's MODEL under the stock KSampler equals ComfyUI's own Boogu model."""
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


@pytest.fixture(scope="module")
def boogu_file(tmp_path_factory):
    cs.import_comfy()
    pytest.importorskip("comfy.ldm.boogu.model", reason="this ComfyUI predates Boogu-Image")
    import folder_paths
    folder = tmp_path_factory.mktemp("models") / "diffusion_models"
    folder_paths.add_model_folder_path("diffusion_models", str(folder), is_default=True)
    return cs.write_tiny("boogu", str(folder), seed=21, prefix=COMFY_PREFIX)


def comfys_boogu(path: str):
    """ComfyUI's own Boogu model (supported_models.Boogu, its model_base and network) with the file's weights, at
    the tiny file's head counts and rotary axes."""
    import torch
    import comfy.model_patcher
    import comfy.supported_models
    import comfy.utils
    ours = boogu.detect(read_checkpoint_header(path)).config
    unet = dict(comfy_detection(meta_state(read_checkpoint_header(path))),
                num_attention_heads=ours["num_attention_heads"], num_kv_heads=ours["num_kv_heads"],
                axes_dim_rope=ours["axes_dim_rope"])
    config = comfy.supported_models.Boogu(unet)
    config.set_inference_dtype(torch.float32, None)
    model = config.get_model({})
    state = comfy.utils.state_dict_prefix_replace(comfy.utils.load_torch_file(path), {COMFY_PREFIX: ""},
                                                  filter_keys=True)
    model.diffusion_model.load_state_dict(state, strict=True)
    cpu = torch.device("cpu")
    return comfy.model_patcher.ModelPatcher(model, load_device=cpu, offload_device=cpu)


def instruction(seed: int, words: int, **extra):
    """A CONDITIONING as ComfyUI's Qwen3-VL encoder gives it (its unpadded attention mask, from which Boogu's model
    reads num_tokens)."""
    import torch
    text = torch.randn(1, words, 40, generator=torch.Generator().manual_seed(seed))
    return [[text, {"attention_mask": torch.ones(1, words, dtype=torch.long), **extra}]]


@pytest.fixture(scope="module")
def sp_model(boogu_file):
    """The loader node's MODEL at Ulysses 2 on a cpu:2 pool (closed afterwards)."""
    import os
    loader, owner = cs.import_node_module("loader"), cs.import_node_module("pool_owner").OWNER
    try:
        yield loader.SPModelLoader.execute(unet_name=os.path.basename(boogu_file), weight_dtype="fp32",
                                           devices="cpu:2", ulysses_degree=2, ring_degree=1,
                                           cfg_parallel=False).result[0]
    finally:
        owner.close_all()


def test_stock_sampler_on_the_sp_model_equals_comfys_boogu(boogu_file, sp_model):
    """The loader node's MODEL under the stock KSampler (CFG 2: the prompt and the shorter negative run as two
    calls, as ComfyUI batches them) equals ComfyUI's own Boogu model, for text to image and an edit with a reference
    latent on both prompts; the reference changes the result."""
    import torch
    model, reference = sp_model, comfys_boogu(boogu_file)
    reference_latent = {"reference_latents": [torch.randn(1, 16, 6, 8, generator=torch.Generator().manual_seed(5))]}
    results = []
    for extra in ({}, reference_latent):
        positive, negative = instruction(1, 7, **extra), instruction(2, 4, **extra)
        actual = cs.sample(model, positive, negative, width=14, height=10)
        cs.assert_close(actual, cs.sample(reference, positive, negative, width=14, height=10))
        results.append(actual)
    assert (results[0] - results[1]).abs().max() > 1e-3
