"""SPLoraLoader, "LoRA (Ulysses SP)": applies a LoRA file to an SP model inside the workers, which read the file
themselves (the stock LoRA nodes work too: ComfyUI matches their keys and the workers apply its patches)."""
from __future__ import annotations

import comfy.utils
import folder_paths
from comfy_api.latest import io

from .loader import CATEGORY, load_cancellable, progress_reporter
from .proxy import SPDiffusionModel


def sp_proxy_of(model) -> SPDiffusionModel:
    """The SP proxy inside a MODEL, or a clear error when the MODEL does not come from the SP loader."""
    proxy = model.get_model_object("diffusion_model") if model is not None else None
    if not isinstance(proxy, SPDiffusionModel):
        raise ValueError("'LoRA (Ulysses SP)' needs a MODEL from 'Load Diffusion Model (Ulysses SP)'; for other "
                         "models use the stock 'LoraLoaderModelOnly' node")
    return proxy


class SPLoraLoader(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="SPLoraLoader",
            display_name="LoRA (Ulysses SP)",
            category=CATEGORY,
            description="Applies a LoRA to a Ulysses SP model in every worker. Chain several for several LoRAs.",
            inputs=[
                io.Model.Input("model", tooltip="A MODEL from 'Load Diffusion Model (Ulysses SP)'."),
                io.Combo.Input("lora_name", options=folder_paths.get_filename_list("loras")),
                io.Float.Input("strength_model", default=1.0, min=-100.0, max=100.0, step=0.01),
            ],
            outputs=[io.Model.Output()],
        )

    @classmethod
    def execute(cls, model, lora_name, strength_model) -> io.NodeOutput:
        proxy = sp_proxy_of(model)
        if strength_model == 0:
            return io.NodeOutput(model)
        path = folder_paths.get_full_path_or_raise("loras", lora_name)
        spec = proxy.spec.with_lora(path, strength_model)
        load_cancellable(spec, progress_reporter(comfy.utils.ProgressBar(100)))  # errors show on this node
        patched = model.clone()
        patched.add_object_patch("diffusion_model", proxy.with_spec(spec))
        return io.NodeOutput(patched)
