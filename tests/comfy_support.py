"""Test helpers for the ComfyUI side: load this repository as ComfyUI loads a custom node package (under a
non-top-level name, so our `nodes/` never shadows ComfyUI's `nodes` module), and find a ComfyUI checkout."""
from __future__ import annotations

import contextlib
import importlib
import importlib.util
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = "ulysses_sp_under_test"
NO_COMFYUI = ("COMFYUI_PATH is not set to a ComfyUI checkout (set COMFYUI_PATH=/path/to/ComfyUI and run pytest with "
              "a Python that has ComfyUI's requirements to run the ComfyUI tests)")


def load_package():
    """The repository's top-level __init__.py imported as package PACKAGE, as ComfyUI would import it."""
    if PACKAGE in sys.modules:
        return sys.modules[PACKAGE]
    spec = importlib.util.spec_from_file_location(PACKAGE, os.path.join(ROOT, "__init__.py"),
                                                  submodule_search_locations=[ROOT])
    module = importlib.util.module_from_spec(spec)
    sys.modules[PACKAGE] = module
    spec.loader.exec_module(module)
    return module


def import_node_module(name: str):
    """`nodes.<name>` of this repository, e.g. import_node_module('devices')."""
    load_package()
    return importlib.import_module(f"{PACKAGE}.nodes.{name}")


def comfyui_path() -> str | None:
    path = os.environ.get("COMFYUI_PATH")
    if path and os.path.isfile(os.path.join(path, "comfy", "model_base.py")):
        return os.path.abspath(path)
    return None


def import_comfy() -> str:
    """Put ComfyUI first on sys.path (CPU mode) and import its core; returns the checkout path."""
    path = comfyui_path()
    assert path, NO_COMFYUI
    if path not in sys.path:
        sys.path.insert(0, path)
    import comfy.cli_args
    comfy.cli_args.args.cpu = True
    import comfy.model_management  # noqa: F401
    return path


# ----- tiny checkpoints and ComfyUI's own model of the same weights -----
TEXT_DIM, TEXT_TOKENS, POOLED_DIM = 32, 7, 24  # the tiny models' text width, a prompt length, Flux's pooled width

# ComfyUI's unet_config for sp_lab.tiny_models' sizes (ComfyUI's detection hardcodes real sizes, so the
# reference model is built from these by hand)
COMFY_TINY_UNET = {
    "qwen_image": dict(image_model="qwen_image", patch_size=2, in_channels=64, out_channels=16, num_layers=2,
                       attention_head_dim=16, num_attention_heads=6, joint_attention_dim=TEXT_DIM,
                       axes_dims_rope=(4, 6, 6)),
    "flux": dict(image_model="flux", in_channels=16, out_channels=16, vec_in_dim=POOLED_DIM,
                 context_in_dim=TEXT_DIM, hidden_size=96, mlp_ratio=4.0, num_heads=6, depth=2, depth_single_blocks=2,
                 axes_dim=[4, 6, 6], theta=10000, patch_size=2, qkv_bias=True, guidance_embed=True),
}
COMFY_TINY_UNET["wan"] = dict(image_model="wan2.1", model_type="t2v", patch_size=(1, 2, 2), text_len=512, in_dim=16,
                              dim=96, ffn_dim=128, freq_dim=256, text_dim=TEXT_DIM, out_dim=16, num_heads=6,
                              num_layers=2, window_size=(-1, -1), qk_norm=True, cross_attn_norm=True, eps=1e-6)
COMFY_TINY_UNET["hunyuan_video"] = dict(image_model="hunyuan_video", in_channels=16, out_channels=16,
                                        vec_in_dim=POOLED_DIM, context_in_dim=TEXT_DIM, hidden_size=384, mlp_ratio=2.0,
                                        num_heads=3, depth=1, depth_single_blocks=1, axes_dim=[16, 56, 56],
                                        theta=256, patch_size=[1, 2, 2], qkv_bias=True, guidance_embed=True,
                                        byt5=False, meanflow=False)
COMFY_CONFIG_CLASS = {"qwen_image": "QwenImage", "flux": "Flux", "wan": "WAN21_T2V", "hunyuan_video": "HunyuanVideo"}
TINY_SIZES = {"hunyuan_video": {"num_refiner_layers": 2}}  # ComfyUI's HunyuanVideo has 2 refiner blocks, fixed


def write_tiny(family: str, folder: str, **kwargs) -> str:
    from sp_lab.tiny_models import write_tiny_checkpoint
    os.makedirs(folder, exist_ok=True)
    kwargs = {**TINY_SIZES.get(family, {}), **kwargs}
    path = os.path.join(folder, f"tiny_{family}{'_' + kwargs['variant'] if kwargs.get('variant') else ''}"
                                f"{'_' + kwargs['layout'] if kwargs.get('layout') else ''}.safetensors")
    return write_tiny_checkpoint(family, path, **kwargs)


def comfy_reference_model(family: str, path: str):
    """ComfyUI's own network of the family, built in this process with the file's weights (strict load, after
    the key renames ComfyUI applies when it loads the file)."""
    import torch
    import comfy.model_patcher
    import comfy.supported_models
    import comfy.utils
    config = getattr(comfy.supported_models, COMFY_CONFIG_CLASS[family])(newer_comfy_fields(COMFY_TINY_UNET[family]))
    config.set_inference_dtype(torch.float32, None)
    model = config.get_model({})
    state = config.process_unet_state_dict(comfy.utils.load_torch_file(path))
    model.diffusion_model.load_state_dict(state, strict=True)
    cpu = torch.device("cpu")
    return comfy.model_patcher.ModelPatcher(model, load_device=cpu, offload_device=cpu)


def newer_comfy_fields(unet_config: dict) -> dict:
    """unet_config with the fields newer ComfyUI versions require, at the values their detection gives a Flux.1 /
    HunyuanVideo 1.0 file (HunyuanVideo 1.5's fields off; Flux.1's text ids without extra dimensions)."""
    import dataclasses
    if unet_config.get("image_model") == "flux":
        import comfy.ldm.flux.model as comfy_flux
        fields = {field.name for field in dataclasses.fields(comfy_flux.FluxParams)}
        return {**unet_config, **({"txt_ids_dims": []} if "txt_ids_dims" in fields else {})}
    if unet_config.get("image_model") != "hunyuan_video":
        return dict(unet_config)
    import comfy.ldm.hunyuan_video.model as comfy_hunyuan
    fields = {field.name for field in dataclasses.fields(comfy_hunyuan.HunyuanVideoParams)}
    newer = dict(use_cond_type_embedding=False, vision_in_dim=None, meanflow_sum=False)
    return {**unet_config, **{key: value for key, value in newer.items() if key in fields}}


def conditioning(family: str, seed: int, batch: int = 1):
    """Hand-made CONDITIONING as a text encoder node would give it (Flux: pooled output and guidance too;
    HunyuanVideo: pooled output, ComfyUI's default guidance 6); the same tensors as the SPRandomConditioning node
    (text first, then pooled, from one seeded generator)."""
    import torch
    generator = torch.Generator().manual_seed(seed)
    text = torch.randn(batch, TEXT_TOKENS, TEXT_DIM, generator=generator)
    extra = {}
    if family == "flux":
        extra = {"pooled_output": torch.randn(batch, POOLED_DIM, generator=generator), "guidance": 3.5}
    if family == "hunyuan_video":
        extra = {"pooled_output": torch.randn(batch, POOLED_DIM, generator=generator)}
    return [[text, extra]]


def sample(model, positive, negative, steps=3, cfg=2.0, seed=42, width=14, height=10, callback=None, frames=0,
           latent=None, **advanced):
    """What the stock KSampler node does (nodes.common_ksampler) on an empty 16-channel latent (or `latent`, a
    conditioning node's), under torch.inference_mode() as ComfyUI's executor runs every node. advanced:
    KSamplerAdvanced's start_step, last_step, disable_noise, force_full_denoise."""
    import torch
    import comfy.sample
    with torch.inference_mode():
        shape = (1, 16, frames, height, width) if frames else (1, 16, height, width)  # video: [B, C, T, H, W]
        latent = comfy.sample.fix_empty_latent_channels(model, torch.zeros(shape) if latent is None else latent)
        noise = torch.zeros_like(latent) if advanced.get("disable_noise") else comfy.sample.prepare_noise(latent,
                                                                                                         seed)
        return comfy.sample.sample(model, noise, steps, cfg, "euler", "simple", positive, negative, latent,
                                   denoise=1.0, seed=seed, disable_pbar=True, callback=callback, **advanced)


def assert_close(actual, expected, rel=1e-5):
    """The project's bar: max abs diff <= rel x max(1, max abs of the reference)."""
    scale = max(1.0, expected.abs().max().item())
    diff = (actual.float() - expected.float()).abs().max().item()
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    assert diff <= rel * scale, f"max abs diff {diff:.3g} > {rel:g} x scale {scale:.3g}"
    return diff


# ----- example workflows -----
EXAMPLES = os.path.join(ROOT, "example_workflows")
# V3 nodes declared with accept_all_inputs (their other widgets are the frontend's; /object_info does not say so)
ACCEPTS_ALL_INPUTS = ("CustomCombo",)
# examples whose stock nodes need a newer ComfyUI than the tested 0.3.64: name -> (those node classes, the version);
# a listed class may be older but lack an input the example sends or an option it picks (CLIPLoader's type)
NEEDS_NEWER_COMFYUI = {
    "flux2_dev_t2i": (("EmptyFlux2LatentImage", "Flux2Scheduler"), "0.3.72 (Flux.2)"),
    "ltx2_t2v": (("LTXAVTextEncoderLoader", "LTXVAudioVAELoader", "LTXVAudioVAEDecode", "LTXVConcatAVLatent",
                  "LTXVEmptyLatentAudio", "LTXVLatentUpsampler", "LTXVSeparateAVLatent", "LatentUpscaleModelLoader",
                  "ManualSigmas"), "0.8 (LTX-2)"),
    "ltx23_t2v": (("LTXAVTextEncoderLoader", "LTXVAudioVAELoader", "LTXVAudioVAEDecode", "LTXVConcatAVLatent",
                   "LTXVEmptyLatentAudio", "LTXVLatentUpsampler", "LTXVSeparateAVLatent", "LatentUpscaleModelLoader",
                   "ManualSigmas"), "0.16.4 (LTX-2.3)"),
    "ltx25_i2v": (("LTXVAudioVAEDecode", "LTXVConcatAVLatent", "LTXVDualCFGGuider", "LTXVEmptyLatentAudio",
                   "LTXVImgToVideoInplace", "LTXVLatentUpsampler", "LTXVSeparateAVLatent", "LatentUpscaleModelLoader",
                   "ManualSigmas", "ResizeImageMaskNode"), "0.32.0 (LTX-2.5)"),
    "hunyuan_video15_720p_t2v": (("EmptyHunyuanVideo15Latent", "HunyuanVideo15LatentUpscaleWithModel",
                                  "HunyuanVideo15SuperResolution", "LatentUpscaleModelLoader"),
                                 "0.4.0 (HunyuanVideo 1.5 and its SR model)"),
    "kandinsky5_t2v": (("Kandinsky5ImageToVideo",), "0.3.68 (Kandinsky 5)"),
    "minimax_h3_t2v": (("ComfyMathExpression", "ComfySwitchNode", "MiniMaxH3ImageToVideo", "ResolutionSelector",
                        "VAEDecodeAudio"), "0.30.0 (MiniMax H3)"),
    "ideogram4_t2i": (("CFGOverride", "ComfyMathExpression", "ComfyNumberConvert", "CustomCombo", "DualModelGuider",
                       "EmptyFlux2LatentImage", "Ideogram4Scheduler", "JsonExtractString", "ResolutionSelector"),
                      "0.24.0 (Ideogram 4)"),
    "minimax_h3_r2v": (("ComfyMathExpression", "ComfySwitchNode", "MiniMaxH3ReferenceToVideo", "ResolutionSelector",
                        "VAEDecodeAudio"), "0.30.0 (MiniMax H3)"),
    "hidream_o1_t2i": (("ComfyMathExpression", "ComfySwitchNode", "EmptyHiDreamO1LatentImage",
                        "HiDreamO1PatchSeamSmoothing", "HiDreamO1ReferenceImages", "JsonExtractString",
                        "ModelNoiseScale", "TextGenerate"), "0.33.0 (HiDream-O1; the newest tested)"),
    "wan22_bernini_r_image_edit": (("BatchImagesNode", "BerniniConditioning", "ComfySwitchNode", "CustomCombo",
                                    "ImageCompare", "ResizeImageMaskNode"), "0.33.0 (Bernini-R; the newest tested)"),
    "boogu_turbo_t2i": (("ResolutionSelector",), "0.26.0 (Boogu-Image)"),
    "wan21_scail2_character_replacement": (("BatchImagesNode", "ColorTransfer", "ComfyMathExpression",
                                            "ComfySwitchNode", "ResizeImageMaskNode", "SAM3_VideoTrack",
                                            "SCAIL2ColoredMask", "WanSCAILToVideo"),
                                           "0.33.0 (SCAIL-2; the newest tested)"),
    "mage_flow_t2i": (("ResolutionSelector", "SaveImageAdvanced", "TextEncodeMageFlowEdit"), "0.29.0 (Mage-Flow)"),
    "anima_t2i": (("ComfySwitchNode", "ResolutionSelector"), "0.16.0 (Anima 0.11.0, ResolutionSelector)"),
    "ernie_image_t2i": (("ComfySwitchNode", "EmptyFlux2LatentImage", "TextGenerate"), "0.19.0 (ERNIE-Image)"),
    "longcat_image_t2i": (("ResolutionSelector",), "0.16.0 (LongCat-Image)"),
    "seedvr2_upscale_image": (("ImageCompare", "ResizeImageMaskNode", "SeedVR2Conditioning", "SeedVR2PostProcessing",
                               "SeedVR2Preprocess"), "0.25.0 (SeedVR2)"),
    "ovis_image_t2i": (("CLIPLoader",), "0.4.0 (Ovis-Image: CLIPLoader type ovis)"),
    "joyai_image_edit": (("ImageCompare", "SaveImageAdvanced", "TextEncodeJoyImageEdit"), "0.29.0 (JoyAI-Image-Edit)"),
    "wan22_dancer_i2v": (("ComfyMathExpression", "ComfySwitchNode", "CustomCombo", "LatentCutToBatch",
                          "ResizeImageMaskNode", "WanDancerEncodeAudio", "WanDancerPadKeyframesList", "WanDancerVideo"),
                         "0.21.0 (Wan 2.2 Dancer)"),
    "krea2_turbo_t2i": (("ComfySwitchNode", "ResolutionSelector", "TextGenerate"), "0.26.0 (Krea 2)"),
    "capybara_t2i": (("EmptyHunyuanVideo15Latent",), "0.3.71 (HunyuanVideo 1.5)"),
    "newbie_t2i": (("DualCLIPLoader",), "0.6.0 (NewBie: DualCLIPLoader type newbie)"),
    "ming_image_t2i": (("ComfySwitchNode", "ModelAttentionBackend", "ResolutionSelector", "SaveImageAdvanced",
                        "TextGenerate"), "newer than 0.33.0 (Ming-Image: TextGenerate's system_prompt)"),
    "qwen_image21_t2i": (("ComfySwitchNode", "QwenImage21Cache", "ResolutionSelector", "SaveImageAdvanced",
                          "TextEncodeQwenImage21", "TextGenerate"), "newer than 0.33.0 (Qwen-Image 2.1)"),
}


def declared_inputs(node_spec: dict, values: dict, prefix: str = "") -> dict:
    """A node's inputs from /object_info (name -> spec) as a prompt gives them: required and optional ones and, for a
    V3 DynamicCombo (newer ComfyUI: ResizeImageMaskNode's `resize_type`, SaveVideo's `format`), the inputs of the
    option `values` chose, named `<combo>.<input>` as in the API form (recursively)."""
    declared = {}
    for name, spec in {**node_spec.get("required", {}), **node_spec.get("optional", {})}.items():
        declared[prefix + name] = spec
        template = (spec[1] if len(spec) > 1 and isinstance(spec[1], dict) else {}).get("template") or {}
        grown = template.get("names") or [f"{template.get('prefix')}{i}" for i in range(template.get("max", 0))]
        declared.update({f"{prefix}{name}.{part}": spec for part in grown})  # a V3 Autogrow's inputs (values.a)
        chosen = next((option for option in _dynamic_options(spec) if option["key"] == values.get(prefix + name)),
                      None)
        if chosen:
            declared.update(declared_inputs(chosen["inputs"], values, f"{prefix}{name}."))
    return declared


def _dynamic_options(spec) -> list:
    extra = spec[1] if len(spec) > 1 and isinstance(spec[1], dict) else {}
    return [option for option in extra.get("options", ()) if isinstance(option, dict) and "key" in option]


def widget_default(spec):
    """The value ComfyUI's frontend gives a new widget: its declared default, else a combo's first option."""
    extra = spec[1] if len(spec) > 1 and isinstance(spec[1], dict) else {}
    if "default" in extra:
        return extra["default"]
    options = spec[0] if isinstance(spec[0], list) else extra.get("options") or [None]
    return options[0]["key"] if isinstance(options[0], dict) else options[0]


def example_name(file_name: str) -> str:
    """'wan21_t2v_api.json' and 'wan21_t2v.json' -> 'wan21_t2v'"""
    return file_name.removesuffix(".json").removesuffix("_api")


# ----- a real ComfyUI server with this package installed -----
@contextlib.contextmanager
def running_server(base: str):
    """A ComfyServer in the base directory `base`, ready to answer; stopped on exit, even when a test fails."""
    server = ComfyServer(base)
    try:
        server.wait_ready()
        yield server
    finally:
        server.stop()


class ComfyServer:
    """ComfyUI on 127.0.0.1 in a temporary base directory: this package linked into custom_nodes, tiny
    checkpoints in models/diffusion_models. Stopping it (SIGINT, as Ctrl-C does)
    and then killing whatever is left of its process group always happens, even when a test fails."""

    def __init__(self, base: str, families=("qwen_image",)):
        import subprocess
        self.base = base
        from sp_runtime.local_ranks import free_port
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        os.makedirs(os.path.join(base, "custom_nodes"), exist_ok=True)
        settings = os.path.join(base, "user", "default")
        os.makedirs(settings, exist_ok=True)
        with open(os.path.join(settings, "comfy.settings.json"), "w") as handle:
            handle.write('{"Comfy.TutorialCompleted": true}')  # no first-run templates dialog over the page
        os.symlink(ROOT, os.path.join(base, "custom_nodes", "ulysses-sp"))
        self.checkpoints = {family: write_tiny(family, os.path.join(base, "models", "diffusion_models"))
                            for family in families}
        self.log_path = os.path.join(base, "comfyui.log")
        command = [sys.executable, "main.py", "--cpu", "--listen", "127.0.0.1", "--port", str(self.port),
                   "--base-directory", base, "--database-url", "sqlite:///:memory:", "--disable-auto-launch"]
        self.log = open(self.log_path, "w")
        self.process = subprocess.Popen(command, cwd=comfyui_path(), stdout=self.log, stderr=subprocess.STDOUT,
                                        start_new_session=True)

    def url(self, route: str = "/") -> str:
        return f"http://{self.address}{route}"

    def get_json(self, route: str):
        import json
        import urllib.request
        with urllib.request.urlopen(self.url(route), timeout=30) as response:
            return json.loads(response.read())

    def wait_ready(self, timeout: float = 240.0) -> None:
        import time
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"ComfyUI exited with {self.process.returncode}:\n{self.log_tail()}")
            try:
                self.get_json("/system_stats")
                return
            except OSError:
                time.sleep(0.5)
        raise RuntimeError(f"ComfyUI did not answer within {timeout:.0f} s:\n{self.log_tail()}")

    def log_tail(self, lines: int = 60) -> str:
        with open(self.log_path, errors="replace") as handle:
            return "".join(handle.readlines()[-lines:])

    def descendants(self) -> list[int]:
        import psutil
        try:
            return [child.pid for child in psutil.Process(self.process.pid).children(recursive=True)]
        except psutil.NoSuchProcess:
            return []

    def stop(self, timeout: float = 60.0) -> list[int]:
        """Ctrl-C the server, wait, then kill its process group; returns the pids that had to be killed."""
        import signal
        import subprocess
        children = self.descendants()
        killed = []
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGINT)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                killed.append(self.process.pid)
        import psutil
        for pid in [self.process.pid] + children:
            try:
                process = psutil.Process(pid)
                if process.status() != psutil.STATUS_ZOMBIE:
                    process.wait(5)
            except psutil.NoSuchProcess:
                continue
            except psutil.TimeoutExpired:
                killed.append(pid)
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.process.wait(10)
        self.log.close()
        return killed
