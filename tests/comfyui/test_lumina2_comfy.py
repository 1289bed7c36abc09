"""Lumina 2 against ComfyUI's own NextDiT (needs COMFYUI_PATH): the reference forward the pool is held to
(tests/families/test_lumina2.py) equals ComfyUI's network built from what its detection says of a released file, at
the tiny file's sizes and with its weights, on that module's cases; ComfyUI's detection of a released header gives
the configuration ours gives. NewBie (where ComfyUI's NextDiT takes clip_text_dim) the same way."""
from __future__ import annotations

import pytest

import comfy_support as cs
from family_support import assert_parity
from sp_lab.references.lumina2 import reference_forward
from sp_lab.tiny_models import COMFY_PREFIX, write_tiny_checkpoint
from sp_runtime.checkpoints.header import Header, read_checkpoint_header
from sp_runtime.families import lumina2
from safetensors.torch import load_file
from test_image_families_comfy import comfy_class, comfy_detection, comfy_outputs, comfy_settings, meta_state
from test_lumina2 import SEED, make_cases, released_header

pytestmark = pytest.mark.skipif(cs.comfyui_path() is None, reason=cs.NO_COMFYUI)
pytest_plugins = ["family_pools"]  # its summary prints the parity table


def test_reference_equals_comfys_next_dit(tmp_path):
    """ComfyUI's NextDiT normalises q and k with the dtype's epsilon, diffusers with 1e-5 (the pool follows
    diffusers), well within the bound on this model."""
    path = write_tiny_checkpoint("lumina2", str(tmp_path / "lumina2.safetensors"), seed=SEED, prefix=COMFY_PREFIX)
    released = comfy_detection(meta_state(Header("lumina2.safetensors", released_header())))
    ours = lumina2.detect(read_checkpoint_header(path)).config
    tiny = dict(dim=ours["hidden_size"], n_layers=ours["num_layers"], n_refiner_layers=ours["num_refiner_layers"],
                n_heads=ours["num_attention_heads"], n_kv_heads=ours["num_kv_heads"],
                cap_feat_dim=ours["cap_feat_dim"], axes_dims=list(ours["axes_dim_rope"]))
    network = comfy_class("z_image")(**{**released, **tiny}, **comfy_settings()).eval()
    state = {key[len(COMFY_PREFIX):]: value for key, value in load_file(path).items()}
    del state["norm_final.weight"]  # the release's unused norm: ComfyUI's loader drops what its network lacks
    network.load_state_dict(state, strict=True)

    def call(net, x, t, inputs):
        context = inputs["context"]
        return net(x, t, context, inputs.get("num_tokens", context.shape[1]),
                   attention_mask=inputs.get("attention_mask"), transformer_options={})
    expected = comfy_outputs(network, make_cases(), call)
    model = lumina2.load_model(path)[0]
    for name, (x, t, inputs) in make_cases().items():
        assert_parity(reference_forward(model, x, t, **inputs), expected[name], "float32", f"comfyui_lumina2/{name}")


def test_comfy_detection_of_a_released_header_equals_ours():
    header = Header("NetaYumev35_pretrained_all_in_one.safetensors", released_header())
    theirs, ours = comfy_detection(meta_state(header)), lumina2.detect(header).config
    assert theirs["image_model"] == "lumina2" and not theirs.get("z_image_modulation")
    assert theirs.get("time_scale", 1.0) == 1.0 and theirs.get("pad_tokens_multiple") is None
    assert theirs["rope_theta"] == lumina2.detection.ROPE_THETA
    pairs = {"dim": "hidden_size", "n_layers": "num_layers", "n_heads": "num_attention_heads",
             "n_kv_heads": "num_kv_heads", "cap_feat_dim": "cap_feat_dim", "in_channels": "in_channels"}
    assert {key: theirs[key] for key in pairs} == {key: ours[value] for key, value in pairs.items()}
    assert list(theirs["axes_dims"]) == list(ours["axes_dim_rope"])
    assert list(theirs["axes_lens"]) == list(ours["axes_lens"])


def _newbie_next_dit():
    """ComfyUI's NextDiT where it takes NewBie's clip_text_dim; the test is skipped otherwise."""
    import inspect
    cs.import_comfy()
    from comfy.ldm.lumina.model import NextDiT
    if "clip_text_dim" not in inspect.signature(NextDiT).parameters:
        pytest.skip("this ComfyUI's NextDiT has no NewBie (clip_text_dim)")
    return NextDiT


def _newbie_header() -> dict:
    extra = {"clip_text_pooled_proj.0.weight": (1024,), "clip_text_pooled_proj.1.weight": (1024, 1024),
             "clip_text_pooled_proj.1.bias": (1024,), "time_text_embed.1.weight": (1024, 2048),
             "time_text_embed.1.bias": (1024,)}
    return {**released_header(), **{COMFY_PREFIX + key: ("BF16", shape) for key, shape in extra.items()}}


def test_newbie_reference_equals_comfys_next_dit(tmp_path):
    """NewBie's pooled text through ComfyUI's own clip_text_pooled_proj / time_text_embed (and its zeros without
    one) equals our reference on the conformance suite's NewBie cases."""
    from sp_lab.conformance.cases import newbie_cases
    next_dit = _newbie_next_dit()
    path = write_tiny_checkpoint("lumina2", str(tmp_path / "newbie.safetensors"), seed=7, prefix=COMFY_PREFIX,
                                 variant="newbie")
    released = comfy_detection(meta_state(Header("newbie.safetensors", _newbie_header())))
    ours = lumina2.detect(read_checkpoint_header(path)).config
    tiny = dict(dim=ours["hidden_size"], n_layers=ours["num_layers"], n_refiner_layers=ours["num_refiner_layers"],
                n_heads=ours["num_attention_heads"], n_kv_heads=ours["num_kv_heads"],
                cap_feat_dim=ours["cap_feat_dim"], axes_dims=list(ours["axes_dim_rope"]),
                clip_text_dim=ours["clip_text_dim"])
    network = next_dit(**{**released, **tiny}, **comfy_settings()).eval()
    state = {key[len(COMFY_PREFIX):]: value for key, value in load_file(path).items()}
    del state["norm_final.weight"]
    network.load_state_dict(state, strict=True)

    def call(net, x, t, inputs):
        context = inputs["context"]
        return net(x, t, context, context.shape[1], clip_text_pooled=inputs.get("clip_text_pooled"),
                   transformer_options={})
    expected = comfy_outputs(network, newbie_cases(), call)
    model = lumina2.load_model(path)[0]
    for name, (x, t, inputs) in newbie_cases().items():
        assert_parity(reference_forward(model, x, t, **inputs), expected[name], "float32", f"comfyui_newbie/{name}")


def test_comfy_detection_of_a_newbie_header_equals_ours():
    _newbie_next_dit()
    header = Header("NewBie-Image-Exp0.1-bf16.safetensors", _newbie_header())
    theirs, ours = comfy_detection(meta_state(header)), lumina2.detect(header)
    assert theirs["image_model"] == "lumina2" and theirs["clip_text_dim"] == ours.config["clip_text_dim"] == 1024
    assert ours.variant == "newbie"
