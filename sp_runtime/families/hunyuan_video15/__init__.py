"""HunyuanVideo 1.5 (480p / 720p T2V and I2V, the 1080p super-resolution model, Capybara v0.1): ComfyUI's `diffusion_model(x,
timestep, context, txt_byt5, clip_fea, attention_mask, ref_latent, timestep_r)` (ComfyUI 0.3.71 or newer) on
diffusers' HunyuanVideo15Transformer3DModel. x [B, 65, T, H, W] (noise + image latent + mask; the SR model 98),
context [B, L, 3584] (Qwen2.5-VL tokens), txt_byt5 (ByT5 glyph tokens), clip_fea (SigLIP image tokens).

Capybara v0.1 is HunyuanVideo 1.5 with three embedding tables ComfyUI's class does not have (detection.py
CAPYBARA_EXTRAS): left unread, as ComfyUI does.

The SR model is a meanflow model: ComfyUI adds the embedding of the sampler's next sigma, found in
transformer_options (host-only); the host's hook (host.py SamplerSigma: `sampler_inputs`) hands it to the pool
as `timestep_r`.

Plan (plan.py): hunyuan_video.PLAN with its differences: the image stream split as there; the text stream [SigLIP,
ByT5, Qwen tokens], each with its condition-type embedding, replicated; double-stream blocks only, no token replace.
"""
from ..family import Family, PlanModel
from .detection import CAPYBARA_EXTRAS, CONFIG_KEYS, NAME, SR, architecture, detect
from .host import COMFY, sampler_inputs
from .keys import original_plan, weight_plan
from .plan import PLAN

MODEL = PlanModel(NAME, "HunyuanVideo 1.5", "HunyuanVideo15Transformer3DModel", detect, weight_plan, PLAN, 5,
                  CONFIG_KEYS, ignore=CAPYBARA_EXTRAS)
load, load_model = MODEL.load, MODEL.load_model

FAMILY = Family(NAME, "HunyuanVideo 1.5 (480p / 720p, T2V, I2V, 1080p super-resolution; Capybara v0.1)", detect, load, COMFY,
                weight_plan, original_plan, load_model, gguf_architectures=("hyvid",),  # ComfyUI-GGUF: Tencent's keys
                signatures=("cond_type_embedding.weight", "cond_type_embed.weight"))

__all__ = ["FAMILY", "CAPYBARA_EXTRAS", "CONFIG_KEYS", "COMFY", "NAME", "PLAN", "SR", "architecture", "detect", "load", "load_model",
           "original_plan", "sampler_inputs", "weight_plan"]
