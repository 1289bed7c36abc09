"""OmniGen2 beyond the conformance suite (which runs its calls, with and without reference latents, at every degree
and layout): detection next to Lumina 2 and Boogu-Image, the inputs refused by name, and ComfyUI's own
OmniGen2Transformer2DModel against the reference forward (the suite checks the pool against that reference)."""
from __future__ import annotations

import pytest
import torch

from family_support import assert_parity, single_rank_worker
from sp_lab.conformance.cases import omnigen2_cases
from sp_lab.references.omnigen2 import reference_forward
from sp_lab.tiny_models import COMFY_PREFIX, randomize_, tiny_config, write_tiny_checkpoint
from sp_runtime.checkpoints.header import read_checkpoint_header
from sp_runtime.detection import detect
from sp_runtime.families import lumina2, omnigen2

SEED = 18


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return write_tiny_checkpoint("omnigen2", str(tmp_path_factory.mktemp("omnigen2") / "omnigen2_fp16.safetensors"),
                                 seed=SEED, prefix=COMFY_PREFIX)


def test_detection_next_to_lumina2_and_boogu(path, tmp_path):
    from safetensors.torch import load_file, save_file
    header = read_checkpoint_header(path)
    found = detect(header)
    assert (found.family, found.prefix, found.config["num_kv_heads"], found.config["axes_dim_rope"]) == \
        ("omnigen2", COMFY_PREFIX, 2, (8, 8, 8))
    assert lumina2.detect(header) is None  # Lumina 2's names are all there, but the file is not Lumina 2
    boogu = str(tmp_path / "boogu_image_edit_fp8_scaled.safetensors")
    save_file({**load_file(path), COMFY_PREFIX + omnigen2.detection.DUAL_STREAM: torch.zeros(4, 4)}, boogu)
    assert omnigen2.detect(read_checkpoint_header(boogu)) is None
    with pytest.raises(ValueError, match="looks like Boogu-Image "):
        detect(boogu)


def test_inputs_it_cannot_serve_are_refused_by_name(path):
    worker, ctx = single_rank_worker(path)
    x, t, inputs = omnigen2_cases()["odd_latent_refs"]
    out = torch.empty_like(x)
    padded = torch.ones(2, 7, dtype=torch.long)
    padded[1, 5:] = 0
    for changes, message in (({"attention_mask": padded}, "attention_mask with padding"),
                             ({"num_tokens": 5}, "num_tokens 5 with 7 caption tokens"),
                             ({"ref_latents": inputs["ref_latents"] * 3}, "at most 5 reference latents"),
                             ({"ref_latents": [torch.zeros(2, 4, 6, 8)]}, r"ref_latents entries must be")):
        with pytest.raises(ValueError, match=message):
            worker.forward(x, t, {**inputs, **changes}, out, ctx)


@pytest.fixture(scope="module")
def comfyui():
    from comfy_support import NO_COMFYUI, comfyui_path, import_comfy
    if comfyui_path() is None:
        pytest.skip(NO_COMFYUI)
    return import_comfy()


def test_comfyui_model_equals_the_reference(comfyui, tmp_path):
    """ComfyUI's OmniGen2Transformer2DModel (random weights, the tiny size) read by the family's loader: the
    reference forward on the loaded model equals ComfyUI's forward, with and without reference latents."""
    import comfy.ldm.omnigen.omnigen2 as comfy_omnigen2
    import comfy.ops
    from safetensors.torch import save_file
    config = tiny_config("omnigen2")
    model = comfy_omnigen2.OmniGen2Transformer2DModel(
        patch_size=2, in_channels=16, hidden_size=config["hidden_size"], num_layers=config["num_layers"],
        num_refiner_layers=config["num_refiner_layers"], num_attention_heads=config["num_attention_heads"],
        num_kv_heads=config["num_kv_heads"], axes_dim_rope=config["axes_dim_rope"], axes_lens=config["axes_lens"],
        text_feat_dim=config["cap_feat_dim"], timestep_scale=1000.0, device="cpu", dtype=torch.float32,
        operations=comfy.ops.disable_weight_init)
    randomize_(model, SEED + 1)
    file = str(tmp_path / "comfy_omnigen2.safetensors")
    save_file({COMFY_PREFIX + key: value.contiguous() for key, value in model.state_dict().items()}, file)
    loaded = omnigen2.load_model(file)[0]
    for name, (x, t, inputs) in omnigen2_cases().items():
        call = {key: value for key, value in inputs.items() if key != "num_tokens"}
        with torch.no_grad():
            expected = model(x, t, call["context"], inputs["context"].shape[1], ref_latents=call.get("ref_latents"),
                             transformer_options={})
        assert_parity(reference_forward(loaded, x, t, **call), expected, "float32", f"comfyui/{name}")
