"""'Load Checkpoint (Ulysses SP)' on an all-in-one tiny Wan 2.1 file (real head size 128, so ComfyUI's own detection
describes it; a UMT5 text encoder with a tiny SentencePiece model; a Wan VAE): MODEL / CLIP / VAE as the stock
"Load Checkpoint" gives them, the stock KSampler through the SP MODEL equal to the stock path's, and no diffusion
weight read in the ComfyUI process.

Needs COMFYUI_PATH (a ComfyUI checkout whose requirements are installed in this Python); skipped otherwise.
"""
import io
import os

import pytest

import comfy_support as cs

pytestmark = pytest.mark.skipif(cs.comfyui_path() is None, reason=cs.NO_COMFYUI)

WAN_SIZE = dict(num_attention_heads=2, attention_head_dim=128, text_dim=4096, ffn_dim=64, num_layers=1)
TEXT_ENCODER_KEY = "umt5xxl.transformer.encoder.final_layer_norm.weight"
VAE_KEY = "decoder.middle.0.residual.0.gamma"


def tiny_tokenizer() -> bytes:
    """A SentencePiece model (ComfyUI's UMT5 tokenizer reads it from the file's `spiece_model` entry)."""
    import sentencepiece
    model = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(sentence_iterator=iter(["a tiny cat sits on a mat"] * 20),
                                             model_writer=model, vocab_size=16, model_type="char",
                                             minloglevel=2)
    return model.getvalue()


def write_all_in_one(folder: str) -> str:
    import torch
    from sp_lab.tiny_models import COMFY_PREFIX
    from sp_lab.tiny_models.weights import pack_all_in_one
    diffusion = cs.write_tiny("wan", os.path.join(folder, "unet"), prefix=COMFY_PREFIX, **WAN_SIZE)
    g = torch.Generator().manual_seed(4)
    parts = {"text_encoders." + TEXT_ENCODER_KEY: torch.randn(4096, generator=g).half(),
             "text_encoders.spiece_model": torch.frombuffer(bytearray(tiny_tokenizer()), dtype=torch.uint8),
             "vae." + VAE_KEY: torch.randn(384, 1, 1, 1, generator=g),
             # newer ComfyUI reads the Wan VAE's width and image channels from these (real Wan 2.1 VAE shapes)
             "vae.decoder.head.0.gamma": torch.ones(96, 1, 1, 1),
             "vae.encoder.conv1.weight": torch.zeros(96, 3, 3, 3, 3),
             "vae.decoder.head.2.weight": torch.zeros(3, 96, 3, 3, 3)}
    return pack_all_in_one(diffusion, os.path.join(folder, "checkpoints", "tiny_wan_aio.safetensors"), parts)


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    """(SP node outputs, stock node outputs, the diffusion entries ComfyUI's loading saw in the SP node)."""
    cs.import_comfy()
    import comfy.sd
    import folder_paths
    import nodes
    folder = tmp_path_factory.mktemp("aio")
    os.makedirs(folder / "checkpoints")
    path = write_all_in_one(str(folder))
    folder_paths.add_model_folder_path("checkpoints", str(folder / "checkpoints"), is_default=True)
    checkpoint_loader = cs.import_node_module("checkpoint_loader")
    seen = {}
    real = comfy.sd.load_state_dict_guess_config

    def spy(state, *args, **kwargs):
        seen.update({key: value for key, value in state.items() if key.startswith("model.diffusion_model.")})
        return real(state, *args, **kwargs)

    comfy.sd.load_state_dict_guess_config = spy
    try:
        ours = checkpoint_loader.SPCheckpointLoader.execute(
            ckpt_name=os.path.basename(path), weight_dtype="fp32", devices="cpu:2", ulysses_degree=0,
            ring_degree=1, cfg_parallel=False).result
    finally:
        comfy.sd.load_state_dict_guess_config = real
    stock = nodes.CheckpointLoaderSimple().load_checkpoint(os.path.basename(path))
    yield ours, stock, seen
    cs.import_node_module("pool_owner").OWNER.close_all()


def wan_conditioning(seed: int):
    import torch
    return [[torch.randn(1, 7, 4096, generator=torch.Generator().manual_seed(seed)), {}]]


def test_stock_sampler_through_the_sp_checkpoint_equals_stock_load_checkpoint(loaded):
    (model, _, _), (stock_model, _, _), _ = loaded
    positive, negative = wan_conditioning(1), wan_conditioning(2)
    expected = cs.sample(stock_model, positive, negative, frames=3)
    cs.assert_close(cs.sample(model, positive, negative, frames=3), expected)
    other = cs.sample(model, wan_conditioning(3), negative, frames=3)
    assert (other - expected).abs().max() > 1e-3  # the prompt matters: the line above could not pass by luck
    assert sum(p.numel() for p in model.model.parameters()) == 0
    assert type(model.model) is type(stock_model.model)


def test_clip_and_vae_are_the_stock_loaders(loaded):
    (_, clip, vae), (_, stock_clip, stock_vae), _ = loaded
    assert type(clip.cond_stage_model).__qualname__ == type(stock_clip.cond_stage_model).__qualname__  # made per load
    ours, theirs = clip.cond_stage_model.state_dict(), stock_clip.cond_stage_model.state_dict()
    assert ours[TEXT_ENCODER_KEY].equal(theirs[TEXT_ENCODER_KEY])
    assert clip.tokenize("a cat") == stock_clip.tokenize("a cat")
    assert type(vae.first_stage_model) is type(stock_vae.first_stage_model)
    assert vae.latent_channels == stock_vae.latent_channels
    assert vae.first_stage_model.state_dict()[VAE_KEY].equal(stock_vae.first_stage_model.state_dict()[VAE_KEY])


def test_the_comfy_process_reads_no_diffusion_weight(loaded):
    _, _, seen = loaded
    read_by_comfy = cs.import_node_module("checkpoint_loader").read_by_comfy
    weights = {key: tensor for key, tensor in seen.items() if not read_by_comfy(key, tensor)}
    assert weights and all(tensor.is_meta for tensor in weights.values())
    assert all(tensor.numel() <= 16 for key, tensor in seen.items() if not tensor.is_meta)


def test_a_checkpoint_comfy_does_not_recognise_is_a_clear_error(loaded, tmp_path):
    checkpoint_loader = cs.import_node_module("checkpoint_loader")
    path = cs.write_tiny("flux", str(tmp_path), prefix="model.diffusion_model.")  # tiny widths: not a real Flux
    path_aio = os.path.join(str(tmp_path), "unknown.safetensors")
    from safetensors.torch import load_file, save_file
    state = {key: value for key, value in load_file(path).items() if "img_attn.norm" not in key}
    save_file(state, path_aio)
    with pytest.raises(ValueError, match="does not recognise"):
        checkpoint_loader.text_encoder_and_vae(path_aio)


def test_legacy_scaled_fp8_checkpoint_loads_its_text_encoder_and_vae(tmp_path, monkeypatch):
    """A legacy scaled-fp8 all-in-one file (`scaled_fp8` marker, per-layer scale_weight / scale_input): newer
    ComfyUI converts it before detection and reads every scale_input's value; the loader gives it the real scales and
    markers (meta for the weights), so the text encoder and VAE load as from the stock loader."""
    import torch
    from safetensors.torch import load_file, save_file
    cs.import_comfy()
    checkpoint_loader = cs.import_node_module("checkpoint_loader")
    os.makedirs(tmp_path / "source" / "checkpoints")
    source = write_all_in_one(str(tmp_path / "source"))
    state = load_file(source)
    prefix = "model.diffusion_model."
    for key in [key for key in state if key.startswith(prefix + "blocks.") and key.endswith(".weight")
                and state[key].dim() == 2]:
        layer = key[:-len(".weight")]
        state[key] = state[key].to(torch.float8_e4m3fn)
        state[layer + ".scale_weight"] = torch.tensor(1.0)
        state[layer + ".scale_input"] = torch.tensor(1.0 if "ffn" in key else 0.5)
    state[prefix + "scaled_fp8"] = torch.empty(0, dtype=torch.float8_e4m3fn)
    path = str(tmp_path / "scaled_fp8_aio.safetensors")
    save_file(state, path)
    import comfy.sd

    class VAESeen:  # newer ComfyUI's VAE detection does not take this file's one-tensor tiny VAE: record its input
        def __init__(self, sd=None, **kwargs):
            self.sd = sd
    monkeypatch.setattr(comfy.sd, "VAE", VAESeen)
    clip, vae = checkpoint_loader.text_encoder_and_vae(path)
    assert clip.cond_stage_model.state_dict()[TEXT_ENCODER_KEY].equal(state["text_encoders." + TEXT_ENCODER_KEY])
    assert vae.sd[VAE_KEY].equal(state["vae." + VAE_KEY])
