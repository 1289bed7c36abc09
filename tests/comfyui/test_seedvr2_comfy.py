"""SeedVR2 in ComfyUI (needs COMFYUI_PATH with SeedVR2's nodes: the newest tier): ComfyUI's SeedVR2Conditioning node
reads the file's stored prompt embeddings from the SP model's diffusion_model (ComfyHost.file_tensors; the host
reads just those two tensors from the file), so the template's graph gets the prompts ComfyUI's own model holds."""
from __future__ import annotations

import os

import pytest
import torch

import comfy_support as cs

pytestmark = pytest.mark.skipif(cs.comfyui_path() is None, reason=cs.NO_COMFYUI)


def test_seedvr2_conditioning_reads_the_files_stored_prompts(tmp_path):
    cs.import_comfy()
    import folder_paths
    try:
        from comfy_extras.nodes_seedvr import SeedVR2Conditioning
    except ImportError:
        pytest.skip("this ComfyUI has no SeedVR2 nodes (comfy_extras/nodes_seedvr.py)")
    from safetensors.torch import load_file
    from sp_lab.tiny_models import COMFY_PREFIX, write_tiny_checkpoint
    folder = tmp_path / "diffusion_models"
    folder.mkdir()
    folder_paths.add_model_folder_path("diffusion_models", str(folder), is_default=True)
    path = write_tiny_checkpoint("seedvr2", str(folder / "tiny_seedvr2.safetensors"), prefix=COMFY_PREFIX)
    stored = {name: load_file(path)[COMFY_PREFIX + name] for name in ("positive_conditioning", "negative_conditioning")}
    loader = cs.import_node_module("loader")
    try:
        sp = loader.SPModelLoader.execute(unet_name=os.path.basename(path), weight_dtype="fp32", devices="cpu:1",
                                          ulysses_degree=0, ring_degree=1, cfg_parallel=False).result[0]
        latent = {"samples": torch.randn(1, 16, 2, 4, 4)}
        out = SeedVR2Conditioning.execute(sp, latent)
        positive, negative = out.result if hasattr(out, "result") else out
        assert torch.equal(positive[0][0][0], stored["positive_conditioning"].float())
        assert torch.equal(negative[0][0][0], stored["negative_conditioning"].float())
        assert positive[0][1]["condition"].shape[1] == 17  # the latent and its mask, as ComfyUI builds it
    finally:
        cs.import_node_module("pool_owner").OWNER.close_all()
