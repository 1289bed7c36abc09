"""SPControlNetLoader, "Load ControlNet Model (Ulysses SP)": a CONTROL_NET holding only its file's identity. ComfyUI's
apply nodes (ControlNetApplyAdvanced, ...) give it a hint, strength and step range as to any ControlNet, and ComfyUI's
own get_control prepares the hint (resize, VAE encode) and decides the step range; what reaches the SP model is the
hint and strength, which the proxy sends to the workers: they load the ControlNet once per pool and run it on their
own token shards (sp_runtime.sp.control). The ComfyUI process holds no ControlNet weights."""
from __future__ import annotations

import comfy.controlnet
import comfy.latent_formats
import folder_paths
import torch
from comfy_api.latest import io

from sp_runtime.detection import detect

CONTROL_KEY = "ulysses_sp"  # our entries in the control dict ComfyUI's sampler passes to the model
SERVED = {"qwen_image_controlnet": "Qwen-Image InstantX ControlNet (Union, Inpainting)"}
STOCK_REFUSED = ("a ControlNet from the stock 'Load ControlNet Model' node (ControlNetLoader) runs in the ComfyUI "
                 "process and cannot steer a Ulysses SP model; load it with 'Load ControlNet Model (Ulysses SP)' "
                 "(served: " + ", ".join(SERVED.values()) + ")")


class _HintOnly:
    """Stands where ComfyUI's ControlNet.get_control calls the control network: returns the hint it prepared."""

    dtype = torch.float32

    def __call__(self, x, hint, timesteps, context, **extra):
        return {CONTROL_KEY: hint}


class SPControlNet(comfy.controlnet.ControlNet):
    """A ControlNet served by the SP workers: ComfyUI's ControlNet with the network call and merge replaced; its
    control output is [{"controlnet": self, "hint": latent, "strength": float}, ...] in chain order."""

    def __init__(self, path: str, detection):
        super().__init__(None, compression_ratio=1, latent_format=comfy.latent_formats.Wan21(),
                         load_device=torch.device("cpu"), extra_conds=[],
                         concat_mask=detection.config.get("extra_condition_channels", 0) > 0)
        self.control_model = _HintOnly()
        self.path, self.detection = path, detection
        self.handles: dict = {}  # id(pool) -> the ControlNet's ModelHandle there (shared by copies)

    def copy(self) -> "SPControlNet":
        copy = SPControlNet(self.path, self.detection)
        copy.handles = self.handles
        self.copy_to(copy)
        return copy

    def get_models(self) -> list:
        return comfy.controlnet.ControlBase.get_models(self)  # no network for ComfyUI to load

    def get_control(self, x_noisy, t, cond, batched_number, transformer_options):
        if cond.get("crossattn_controlnet") is not None:
            raise ValueError("a separate ControlNet text conditioning (crossattn_controlnet) is not served by the "
                             "Ulysses SP workers: the ControlNet reads the model's own text")
        return super().get_control(x_noisy, t, cond, batched_number, transformer_options)

    def control_merge(self, control, control_prev, output_dtype):
        previous = []
        if control_prev is not None:
            if any(control_prev.get(kind) for kind in ("input", "middle", "output")):
                raise ValueError(STOCK_REFUSED)
            previous = control_prev.get(CONTROL_KEY, [])
        entry = {"controlnet": self, "hint": control[CONTROL_KEY], "strength": float(self.strength)}
        return {"input": [], "middle": [], "output": [], CONTROL_KEY: previous + [entry]}

    def handle_in(self, pool):
        """This ControlNet's handle in `pool`, loaded there on first use (later calls reuse it)."""
        handle = self.handles.get(id(pool))
        if handle is None or handle.pool is not pool:
            handle = self.handles[id(pool)] = pool.load_model(self.path)
        return handle


def controlnet_inputs(control, pool) -> dict:
    """The sampler's control output as the workers' `controlnets` input ({} without one); a stock ControlNet's
    residuals (computed in this process) are refused by name."""
    if control is None:
        return {}
    entries = control.get(CONTROL_KEY) if isinstance(control, dict) else None
    if entries is None or any(control.get(kind) for kind in ("input", "middle", "output")):
        raise ValueError(STOCK_REFUSED)
    return {"controlnets": [{"model": entry["controlnet"].handle_in(pool), "hint": entry["hint"],
                             "strength": entry["strength"]} for entry in entries]}


def controlnet_files() -> list[str]:
    return folder_paths.get_filename_list("controlnet")


class SPControlNetLoader(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        from .loader import CATEGORY  # the loader imports the proxy, which imports this module
        return io.Schema(
            node_id="SPControlNetLoader",
            display_name="Load ControlNet Model (Ulysses SP)",
            category=CATEGORY,
            description="A ControlNet for a Ulysses SP model: the workers load it and run it on their own tokens "
                        "(nothing is loaded here). Apply it with the stock ControlNet apply nodes.",
            inputs=[io.Combo.Input("control_net_name", options=controlnet_files())],
            outputs=[io.ControlNet.Output()],
        )

    @classmethod
    def execute(cls, control_net_name) -> io.NodeOutput:
        path = folder_paths.get_full_path_or_raise("controlnet", control_net_name)
        try:
            detection = detect(path)
        except ValueError as error:
            raise ValueError(f"{control_net_name} cannot be served by the Ulysses SP workers: {error}") from None
        if detection.family not in SERVED:
            raise ValueError(f"{control_net_name} is not a ControlNet the Ulysses SP workers serve (it is a "
                             f"{detection.family} model); served: {', '.join(SERVED.values())}")
        return io.NodeOutput(SPControlNet(path, detection))
