"""JoyAI-Image-Edit beyond the conformance suite (which runs its calls, with and without reference latents, at every
degree and layout): the released file as ComfyUI's detection reads it and the neighbouring families kept apart, the
references' effect, the inputs refused by name, and ComfyUI's own JoyImageTransformer3DModel (ComfyUI 0.33's) against
the reference forward (the suite checks the pool against that reference)."""
from __future__ import annotations

import pytest
import torch

from family_support import assert_parity, single_rank_output, single_rank_worker
from sp_lab.conformance.cases import joyimage_cases
from sp_lab.references.joyimage import reference_forward
from sp_lab.tiny_models import COMFY_PREFIX, randomize_, tiny_config, write_tiny_checkpoint
from sp_runtime.checkpoints.header import Header, read_checkpoint_header
from sp_runtime.detection import detect as detect_any
from sp_runtime.families import joyimage

SEED = 20


def released_header(conv_dims: int = 5) -> Header:
    """The keys detection reads at the released size (3072 wide, 24 heads of 128, 20 blocks, Qwen3-VL 8B's 4096)."""
    keys = {"img_in.weight": (3072, 16, 1, 2, 2)[:conv_dims], "proj_out.weight": (64, 3072),
            "condition_embedder.time_embedder.linear_1.weight": (3072, 256),
            "condition_embedder.text_embedder.linear_1.weight": (3072, 4096)}
    for block in range(20):
        keys.update({f"double_blocks.{block}.attn.img_attn_qkv.weight": (9216, 3072),
                     f"double_blocks.{block}.attn.img_attn_q_norm.weight": (128,),
                     f"double_blocks.{block}.img_mlp.net.0.proj.weight": (12288, 3072)})
    return Header("joyai_image_edit_int8_convrot.safetensors",
                  {COMFY_PREFIX + key: ("BF16", shape) for key, shape in keys.items()})


def test_released_header_as_comfyui_reads_it():
    detection = detect_any(released_header())
    assert (detection.family, detection.prefix) == ("joyimage", COMFY_PREFIX)
    assert detection.config == {"patch_size": [1, 2, 2], "in_channels": 16, "out_channels": 16, "hidden_size": 3072,
                                "num_attention_heads": 24, "text_dim": 4096, "mlp_width_ratio": 4.0, "num_layers": 20,
                                "rope_dim_list": [16, 56, 56], "theta": 10000}
    assert joyimage.COMFY.model_class(detection.variant) == "JoyImage"
    assert joyimage.detect(released_header(conv_dims=4)) is None  # ComfyUI asks for a 5-D img_in too


def test_neighbours_are_not_joyimage(tmp_path):
    """Wan's diffusers files share condition_embedder.time_embedder, HunyuanVideo's double_blocks.N.img_attn_qkv."""
    for family in ("wan", "hunyuan_video"):
        path = write_tiny_checkpoint(family, str(tmp_path / f"{family}.safetensors"), seed=1,
                                     layout="diffusers" if family == "wan" else "original")
        assert joyimage.detect(read_checkpoint_header(path)) is None and detect_any(path).family == family


@pytest.fixture(scope="module")
def worker(tmp_path_factory):
    path = write_tiny_checkpoint("joyimage", str(tmp_path_factory.mktemp("joy") / "joyai.safetensors"), seed=SEED,
                                 prefix=COMFY_PREFIX)
    return single_rank_worker(path)


def test_references_change_the_output_in_their_order(worker):
    """The edit's references steer the output, each at its own frame band (so the suite's edit case can fail)."""
    x, t, inputs = joyimage_cases()["edit_two_refs"]
    edited = single_rank_output(worker, x, t, inputs)
    assert (single_rank_output(worker, x, t, {"context": inputs["context"]}) - edited).abs().max() > 1e-3
    swapped = {**inputs, "ref_latents": inputs["ref_latents"][::-1]}
    assert (single_rank_output(worker, x, t, swapped) - edited).abs().max() > 1e-3


def test_refusals_by_name(worker):
    x, t, inputs = joyimage_cases()["2_tokens"]
    with pytest.raises(ValueError, match="control is not supported by the sequence-parallel JoyAI-Image-Edit"):
        single_rank_output(worker, x, t, {**inputs, "control": {"input": [x]}})
    with pytest.raises(ValueError, match=r"ref_latents\[0\] has shape \[1, 4, 1, 2, 2\]"):
        single_rank_output(worker, x, t, {**inputs, "ref_latents": [torch.zeros(1, 4, 1, 2, 2)]})
    with pytest.raises(ValueError, match=r"x has shape \[1, 16, 2, 4\]"):
        single_rank_output(worker, x[:, :, 0], t, inputs)
    with pytest.raises(ValueError, match=r"needs context \[B, L, 32\]"):
        single_rank_output(worker, x, t, {"context": torch.zeros(1, 3, 8)})


@pytest.fixture(scope="module")
def comfyui():
    from comfy_support import NO_COMFYUI, comfyui_path, import_comfy
    if comfyui_path() is None:
        pytest.skip(NO_COMFYUI)
    import_comfy()
    return pytest.importorskip("comfy.ldm.joyimage.model", reason="this ComfyUI has no JoyImage (0.33.0 has it)")


def test_comfyui_model_equals_the_reference(comfyui, tmp_path):
    """ComfyUI's JoyImageTransformer3DModel (random weights, the tiny size, ComfyUI's theta) read by the family's
    loader: the reference forward on the loaded model equals ComfyUI's forward, with and without references."""
    import comfy.ops
    from safetensors.torch import save_file
    config = tiny_config("joyimage")
    model = comfyui.JoyImageTransformer3DModel(
        patch_size=config["patch_size"], in_channels=16, hidden_size=config["hidden_size"],
        num_attention_heads=config["num_attention_heads"], text_dim=config["text_dim"],
        num_layers=config["num_layers"], rope_dim_list=config["rope_dim_list"], theta=10000, dtype=torch.float32,
        device="cpu", operations=comfy.ops.disable_weight_init)
    randomize_(model, SEED + 1)
    file = str(tmp_path / "comfy_joyimage.safetensors")
    save_file({COMFY_PREFIX + key: value.contiguous() for key, value in model.state_dict().items()}, file)
    loaded = joyimage.load_model(file)[0]
    for name, (x, t, inputs) in joyimage_cases().items():
        with torch.no_grad():
            expected = model(x, t, inputs["context"], ref_latents=inputs.get("ref_latents"), transformer_options={})
        assert_parity(reference_forward(loaded, x, t, **inputs), expected, "float32", f"comfyui/{name}")


def test_comfyui_detection_of_the_released_header_equals_ours(comfyui):
    """ComfyUI's own detect_unet_config on the released header (meta tensors) gives our sizes."""
    import comfy.model_detection
    from comfy_support import import_node_module
    header = released_header()
    theirs = comfy.model_detection.detect_unet_config(import_node_module("comfy_model").meta_state_dict(header),
                                                      COMFY_PREFIX)
    ours = joyimage.detect(header).config
    assert theirs == {"image_model": "joyimage", "text_dim": ours["text_dim"],
                      **{key: ours[key] for key in ("in_channels", "hidden_size", "patch_size", "num_layers",
                                                    "num_attention_heads")}}
