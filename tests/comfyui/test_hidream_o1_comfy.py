"""HiDream-O1 against ComfyUI's own HiDreamO1Transformer (needs COMFYUI_PATH with comfy/ldm/hidream_o1): the reference
forward the pool is held to (sp_lab.references.hidream_o1, the conformance suite's) equals ComfyUI's network (its
two-pass attention, MRoPE, timestep token, KV cache) built at the tiny file's widths with its weights, on the suite's
cases (reference images included: ComfyUI's vision tower built at the tiny file's sizes with its weights); ComfyUI's
detection names the tiny file hidream_o1."""
from __future__ import annotations

import os

import pytest
import torch

import comfy_support as cs
from family_support import assert_parity
from sp_lab.conformance.cases import hidream_o1_cases
from sp_lab.references.hidream_o1 import reference_forward
from sp_lab.tiny_models import COMFY_PREFIX, write_tiny_checkpoint
from sp_runtime.checkpoints.header import read_checkpoint_header
from sp_runtime.families import hidream_o1
from test_image_families_comfy import comfy_detection, comfy_outputs, comfy_settings, meta_state

pytestmark = pytest.mark.skipif(cs.comfyui_path() is None, reason=cs.NO_COMFYUI)
pytest_plugins = ["family_pools"]  # its summary prints the parity table

TINY_VISION = dict(hidden_size=128, num_heads=16, intermediate_size=48, depth=2, num_position_embeddings=16)


def comfy_network(model_module, config: dict, path: str):
    """ComfyUI's HiDreamO1Transformer at the file's widths, the file's weights loaded (the deepstack mergers aside,
    which ComfyUI's model does not build)."""
    import comfy.utils
    text = {"vocab_size": config["vocab_size"], "hidden_size": config["hidden_size"],
            "intermediate_size": config["intermediate_size"], "num_hidden_layers": config["num_layers"],
            "num_attention_heads": config["num_attention_heads"],
            "num_key_value_heads": config["num_key_value_heads"], "head_dim": config["head_dim"],
            "rope_dims": list(config["mrope_section"])}
    network = model_module.HiDreamO1Transformer(text_config_overrides=text, vision_config_overrides=TINY_VISION,
                                                **comfy_settings())
    state = comfy.utils.state_dict_prefix_replace(comfy.utils.load_torch_file(path), {COMFY_PREFIX: ""},
                                                  filter_keys=True)
    vision = config["vision"]
    assert (vision["width"], vision["inner"], vision["depth"], vision["positions"]) == tuple(
        TINY_VISION[key] for key in ("hidden_size", "intermediate_size", "depth", "num_position_embeddings"))
    state = {key: value for key, value in state.items() if not key.startswith("visual.deepstack_merger_list.")}
    missing, unexpected = network.load_state_dict(state, strict=False)
    assert not unexpected and not missing, (missing, unexpected)
    return network.eval()


def test_reference_equals_comfys_hidream_o1_transformer(tmp_path):
    cs.import_comfy()
    model_module = pytest.importorskip("comfy.ldm.hidream_o1.model", reason="this ComfyUI predates HiDream-O1")
    path = write_tiny_checkpoint("hidream_o1", str(tmp_path / "hidream_o1.safetensors"), seed=20, prefix=COMFY_PREFIX)
    header = read_checkpoint_header(path)
    assert comfy_detection(meta_state(header)) == {"image_model": "hidream_o1"}
    config = hidream_o1.detect(header).config
    assert model_module.PATCH_SIZE == config["patch_size"] and model_module.TMS_TOKEN_ID == config["tms_token_id"]
    network = comfy_network(model_module, config, path)
    cases = hidream_o1_cases()
    expected = comfy_outputs(network, cases, lambda net, x, t, inputs: net(x, t, transformer_options={}, **inputs))
    again = comfy_outputs(network, cases, lambda net, x, t, inputs: net(x, t, transformer_options={}, **inputs))
    model = hidream_o1.load_model(path)[0]
    for name, (x, t, inputs) in cases.items():
        assert torch.allclose(again[name], expected[name], atol=1e-4), f"ComfyUI's KV-cache path differs ({name})"
        assert_parity(reference_forward(model, x, t, **inputs), expected[name], "float32",
                      f"comfyui_hidream_o1/{name}")


def prompt(seed: int, words: int):
    """CONDITIONING as ComfyUI's HiDreamO1TE gives it: the token ids as a float surrogate context and as
    text_input_ids (chat prefix, the words, chat suffix ending in <|boi|> <|tms_token|>)."""
    generator = torch.Generator().manual_seed(seed)
    words = torch.randint(0, 150000, (words,), generator=generator).tolist()
    ids = torch.tensor([[151644, 872, 198, *words, 151645, 198, 151644, 77091, 198, 151669, 151673]])
    return [[ids.unsqueeze(-1).float(), {"text_input_ids": ids}]]


def stock_models(tmp_path, devices: str = "cpu:2", cfg_parallel: bool = False):
    """(ComfyUI's own HiDreamO1 MODEL, the SP loader's MODEL, the pool owner) of one tiny file."""
    cs.import_comfy()
    model_module = pytest.importorskip("comfy.ldm.hidream_o1.model", reason="this ComfyUI predates HiDream-O1")
    import comfy.model_patcher
    import comfy.supported_models
    import folder_paths
    folder = tmp_path / "diffusion_models"
    folder_paths.add_model_folder_path("diffusion_models", str(folder), is_default=True)
    path = cs.write_tiny("hidream_o1", str(folder), seed=20, prefix=COMFY_PREFIX)
    config = comfy.supported_models.HiDreamO1({"image_model": "hidream_o1", "disable_unet_model_creation": True})
    config.set_inference_dtype(torch.float32, None)
    network = config.get_model({})
    network.diffusion_model = comfy_network(model_module, hidream_o1.detect(read_checkpoint_header(path)).config,
                                            path)
    cpu = torch.device("cpu")
    theirs = comfy.model_patcher.ModelPatcher(network, load_device=cpu, offload_device=cpu)
    owner = cs.import_node_module("pool_owner").OWNER
    ours = cs.import_node_module("loader").SPModelLoader.execute(
        unet_name=os.path.basename(path), weight_dtype="fp32", devices=devices, ulysses_degree=0, ring_degree=1,
        cfg_parallel=cfg_parallel).result[0]
    return theirs, ours, owner


def test_stock_sampler_on_the_sp_model_equals_comfys_model(tmp_path):
    """The SP loader's MODEL in ComfyUI's own sampling (ComfyUI's HiDreamO1 class builds the input ids, MRoPE
    positions and ar_len in extra_conds; cond and uncond batched, then prompts of different lengths), with and without
    HiDreamO1PatchSeamSmoothing (a DIFFUSION_MODEL wrapper on rolled inputs), equals ComfyUI's own network."""
    from comfy_extras.nodes_hidream_o1 import HiDreamO1PatchSeamSmoothing
    theirs, ours, owner = stock_models(tmp_path)
    try:
        latent = torch.zeros(1, 3, 64, 96)
        results = []
        for positive, negative in ((prompt(1, 4), prompt(2, 4)), (prompt(3, 5), prompt(4, 2))):
            expected = cs.sample(theirs, positive, negative, latent=latent)
            results.append(cs.sample(ours, positive, negative, latent=latent))
            cs.assert_close(results[-1], expected)
        assert (results[1] - results[0]).abs().max() > 1e-3  # the prompt matters
        smoothing = dict(start_percent=0.0, end_percent=1.0, pattern="single_shift", passes="2", blend="average",
                         strength=1.0)
        prompts, latent = (prompt(1, 4), prompt(2, 4)), torch.zeros(1, 3, 128, 160)  # blends 32 px from the edges
        plain = cs.sample(ours, *prompts, latent=latent)
        expected = cs.sample(HiDreamO1PatchSeamSmoothing.execute(model=theirs, **smoothing).result[0], *prompts,
                             latent=latent)
        actual = cs.sample(HiDreamO1PatchSeamSmoothing.execute(model=ours, **smoothing).result[0], *prompts,
                           latent=latent)
        cs.assert_close(actual, expected)
        assert (actual - plain).abs().max() > 1e-3  # the wrapper ran
    finally:
        owner.close_all()


def test_reference_images_through_the_stock_sampler_equal_comfys_model(tmp_path):
    """HiDreamO1ReferenceImages (one image, then two of uneven sizes) on both prompts: ComfyUI's extra_conds resize
    them, patchify them and prepare the vision tower's pixels; the SP model (Ulysses 3, then Ulysses 2 x CFG 2) equals
    ComfyUI's own network, and the references change the image."""
    from comfy_extras.nodes_hidream_o1 import HiDreamO1ReferenceImages
    generator = torch.Generator().manual_seed(5)
    images = [torch.rand(1, 70, 50, 3, generator=generator), torch.rand(1, 40, 90, 3, generator=generator)]
    latent = torch.zeros(1, 3, 96, 64)
    for devices, cfg_parallel in (("cpu:3", False), ("cpu:4", True)):
        theirs, ours, owner = stock_models(tmp_path / devices.replace(":", "_"), devices, cfg_parallel)
        try:
            plain = cs.sample(ours, prompt(1, 4), prompt(2, 4), latent=latent)
            for count in (1, 2):
                refs = {f"image_{number + 1}": image for number, image in enumerate(images[:count])}
                positive, negative = HiDreamO1ReferenceImages.execute(positive=prompt(1, 4), negative=prompt(2, 4),
                                                                      images=refs).result
                actual = cs.sample(ours, positive, negative, latent=latent)
                cs.assert_close(actual, cs.sample(theirs, positive, negative, latent=latent))
                assert (actual - plain).abs().max() > 1e-3, count  # the references reached the model
        finally:
            owner.close_all()


def test_sp_checkpoint_loader_gives_comfys_tokenizer_and_pixel_space_vae(tmp_path):
    """'Load Checkpoint (Ulysses SP)' on a HiDream-O1 checkpoint (the diffusion model alone, as released): ComfyUI's
    tokenizer-only text encoder (its ids end in <|tms_token|>) and pixel-space VAE, no diffusion weight read."""
    cs.import_comfy()
    pytest.importorskip("comfy.ldm.hidream_o1.model", reason="this ComfyUI predates HiDream-O1")
    path = cs.write_tiny("hidream_o1", str(tmp_path), seed=20, prefix=COMFY_PREFIX)
    clip, vae = cs.import_node_module("checkpoint_loader").text_encoder_and_vae(path)
    (cond, extra), = clip.encode_from_tokens_scheduled(clip.tokenize("a red fox"))
    ids = extra["text_input_ids"]
    assert ids[0, -1] == hidream_o1.detect(read_checkpoint_header(path)).config["tms_token_id"] and ids.shape[1] > 8
    pixels = torch.rand(1, 3, 64, 96) * 2 - 1
    assert vae.decode(pixels).shape == (1, 64, 96, 3)
