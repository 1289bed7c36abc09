"""SPCheckpointLoader, "Load Checkpoint (Ulysses SP)": an all-in-one checkpoint's text encoder and VAE loaded by
ComfyUI as its own "Load Checkpoint" does, and its diffusion model loaded into the worker pool (never here)."""
from __future__ import annotations

import comfy.model_detection
import comfy.sd
import folder_paths
import safetensors
from comfy_api.latest import io

from sp_runtime.checkpoints.header import read_checkpoint_header

from .comfy_model import meta_state_dict
from .loader import CATEGORY, load_sp_model, pool_inputs, sp_model_spec


# Diffusion-model tensors ComfyUI's detection or conversion reads by value (newer ComfyUI's convert_old_quants calls
# .item() on every scale_input of a legacy scaled-fp8 file): given real, everything else of the model stays meta.
VALUE_READ_SUFFIXES = ("scaled_fp8", ".scale_input", ".scale_weight", ".input_scale", ".weight_scale",
                       ".weight_scale_2", ".comfy_quant")
SMALL_TENSOR_ELEMENTS = 16  # markers and scalars: a few bytes each


def read_by_comfy(key: str, tensor) -> bool:
    """Whether `key` of the diffusion model is read with its value (scales, markers), not only its shape."""
    return key.endswith(VALUE_READ_SUFFIXES) or tensor.numel() <= SMALL_TENSOR_ELEMENTS


def text_encoder_and_vae(path: str):
    """(CLIP, VAE) of an all-in-one checkpoint through ComfyUI's own loading. Only the tensors outside the diffusion
    model are read, and the diffusion model's scales and markers (read_by_comfy): its weights are meta tensors, which
    ComfyUI's detection needs (shapes) and its text-encoder / VAE loading never touches."""
    header = read_checkpoint_header(path)
    if len(header.files) != 1 or not path.lower().endswith((".safetensors", ".sft")):
        raise ValueError(f"{path!r}: 'Load Checkpoint (Ulysses SP)' takes one all-in-one .safetensors file; for a "
                         f"diffusion model alone use 'Load Diffusion Model (Ulysses SP)'")
    state = meta_state_dict(header)
    prefix = comfy.model_detection.unet_prefix_from_state_dict(state)
    # a copy: ComfyUI 0.3.64's detection pops the scaled_fp8 marker, which its loading below reads again
    if comfy.model_detection.model_config_from_unet(dict(state), prefix, metadata=header.metadata) is None:
        raise ValueError(f"{path!r}: this ComfyUI does not recognise the checkpoint's model, so it cannot load its "
                         f"text encoder and VAE; update ComfyUI (the README lists the version each family needs), "
                         f"or load the parts with 'Load Diffusion Model (Ulysses SP)' and the stock CLIP / VAE "
                         f"loaders")
    with safetensors.safe_open(path, framework="pt", device="cpu") as handle:
        for key in handle.keys():
            if not key.startswith(prefix) or read_by_comfy(key, state[key]):
                state[key] = handle.get_tensor(key)
    _, clip, vae, _ = comfy.sd.load_state_dict_guess_config(
        state, output_vae=True, output_clip=True, output_model=False,
        embedding_directory=folder_paths.get_folder_paths("embeddings"), metadata=header.metadata)
    return clip, vae


class SPCheckpointLoader(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="SPCheckpointLoader",
            display_name="Load Checkpoint (Ulysses SP)",
            category=CATEGORY,
            description="Loads an all-in-one checkpoint: the text encoder and VAE in ComfyUI as 'Load Checkpoint' "
                        "does, the diffusion model into a pool of worker processes that run each denoising step "
                        "with Ulysses sequence parallelism. Connect the MODEL to the stock KSampler.",
            inputs=[
                io.Combo.Input("ckpt_name", options=folder_paths.get_filename_list("checkpoints"),
                               tooltip="An all-in-one .safetensors file from ComfyUI's models/checkpoints folder."),
                *pool_inputs(),
            ],
            outputs=[io.Model.Output(), io.Clip.Output(), io.Vae.Output()],
        )

    @classmethod
    def execute(cls, ckpt_name, **pool_values) -> io.NodeOutput:
        path = folder_paths.get_full_path_or_raise("checkpoints", ckpt_name)
        clip, vae = text_encoder_and_vae(path)
        model = load_sp_model(sp_model_spec(path, **pool_values))
        return io.NodeOutput(model, clip, vae)
