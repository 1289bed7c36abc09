"""CogVideoX beyond the conformance suite (sp_lab.conformance: every file layout, fp32 parity at Ulysses 1-4, Ring,
hybrid and CFG layouts, TP 2, quantized file, LoRA): the released VOID pass as ComfyUI names it, neighbours' files
(CogView's `patch_embed.text_proj`) not taken, CogVideoX 1.0 and learned positions refused by name, and the ofs
embedding of 1.5 I2V files (ComfyUI adds it when the call gives ofs)."""
from __future__ import annotations

import pytest
import torch

from family_support import assert_parity, single_rank_worker
from sp_lab.conformance.cases import cogvideox_cases
from sp_lab.references.cogvideox import reference_forward
from sp_lab.tiny_models import COMFY_PREFIX, build_tiny_model, write_tiny_checkpoint
from sp_runtime.checkpoints.header import Header, read_checkpoint_header
from sp_runtime.families import cogvideox


def void_header(extra: dict = None, embed=(3072, 384)) -> Header:
    """VOID's pass as ComfyUI names CogVideoX-Fun V1.5 5B: 48 heads of 64, 42 blocks, 48 input channels."""
    keys = {"patch_embed.proj.weight": embed, "patch_embed.text_proj.weight": (3072, 4096),
            "time_embedding_linear_1.weight": (512, 3072), "proj_out.weight": (128, 3072)}
    for block in range(42):
        keys.update({f"blocks.{block}.attn_out.weight": (3072, 3072), f"blocks.{block}.norm_q.weight": (64,),
                     f"blocks.{block}.ff_proj.weight": (12288, 3072)})
    keys.update(extra or {})
    return Header("void_pass1.safetensors", {COMFY_PREFIX + key: ("BF16", shape) for key, shape in keys.items()})


def test_released_header_neighbours_and_refused_files():
    detection = cogvideox.detect(void_header())
    assert (detection.layout, detection.prefix, detection.variant) == ("original", COMFY_PREFIX, "inpaint")
    assert detection.config == {"in_channels": 48, "out_channels": 16, "num_attention_heads": 48,
                                "attention_head_dim": 64, "time_embed_dim": 512, "ofs_embed_dim": None,
                                "text_embed_dim": 4096, "num_layers": 42, "patch_size": 2, "patch_size_t": 2,
                                "use_rotary_positional_embeddings": True}
    cogview = Header("cogview4.safetensors", {key: ("BF16", (8, 8)) for key in (
        "patch_embed.text_proj.weight", "time_condition_embed.timestep_embedder.linear_1.weight",
        "transformer_blocks.0.attn1.to_q.weight", "transformer_blocks.0.attn1.to_out.0.weight")})
    assert cogvideox.detect(cogview) is None
    with pytest.raises(ValueError, match="CogVideoX 1.0 model"):
        cogvideox.detect(void_header(embed=(3072, 16, 2, 2)))
    with pytest.raises(ValueError, match="learned positional embeddings"):
        cogvideox.detect(void_header({"patch_embed.pos_embedding": (1, 17776, 3072)}))


def test_ofs_embedding(tmp_path):
    """A model with the ofs embedding (1.5 I2V, as wide as the time embedding): the call's ofs is embedded and added to the time's."""
    path = write_tiny_checkpoint("cogvideox", str(tmp_path / "ofs.safetensors"), seed=4, ofs_embed_dim=32)
    assert cogvideox.detect(read_checkpoint_header(path)).config["ofs_embed_dim"] == 32
    worker, context = single_rank_worker(path)
    x, t, inputs = cogvideox_cases()["odd_video"]
    inputs = {**inputs, "ofs": torch.tensor([2.0])}
    out = torch.empty(16, *x.shape[2:]).expand(x.shape[0], -1, -1, -1, -1).contiguous()
    worker.forward(x, t, inputs, out, context)
    model = build_tiny_model("cogvideox", 4, ofs_embed_dim=32)
    assert_parity(out, reference_forward(model, x, t, **inputs), "float32", "cogvideox/ofs")
    other = reference_forward(model, x, t, **{**inputs, "ofs": torch.tensor([7.0])})
    assert (out - other).abs().max() > 1e-3  # ofs changes the output: the check can fail


def test_comfy_host_sees_what_model_base_reads():
    """ComfyUI's class per variant; model_base.CogVideoX reads diffusion_model.in_channels (the condition's size) and
    ofs_proj_dim (set: it sends ofs)."""
    from sp_runtime.contract import ModelInfo
    config = cogvideox.detect(void_header()).config
    info = ModelInfo("cogvideox", "inpaint", 48, 16, 5, config=config)
    assert [cogvideox.COMFY.model_class(v) for v in ("inpaint", "i2v", "t2v")] == [
        "CogVideoX_Inpaint", "CogVideoX_I2V", "CogVideoX_T2V"]
    assert cogvideox.COMFY.attributes(info) == {"in_channels": 48, "ofs_proj_dim": None, "patch_size": 2,
                                                "patch_size_t": 2}
    assert cogvideox.COMFY.unet_config(info)["num_attention_heads"] == 48  # ComfyUI's 5B latent scale (0.7)
