"""HiDream-O1 (text to image; edit and multi-reference with HiDreamO1ReferenceImages): ComfyUI's HiDreamO1
`diffusion_model(x, timesteps, input_ids, position_ids, ar_len, ref_patches, ref_pixel_values, ...)`
(comfy/ldm/hidream_o1: a Qwen3-VL-8B decoder over [prompt tokens | 32 x 32 RGB patches | reference patches], no VAE;
the Qwen3-VL vision tower's output in the prompt's <|image_pad|> rows) on our own modules (model.py, vision.py;
diffusers has no class for it).

Plan (plan.py): one split stream [text | image | reference patches] under a block-causal SegmentMask (the prompt
before <|tms_token|> causal, the rest sees everything), the timestep embedding written into <|tms_token|>'s row, the
interleaved MRoPE from ComfyUI's position ids; the vision tower runs whole on every rank, once per generation (also
under tensor parallelism, which splits the decoder layers only). The reference is sp_lab.references.hidream_o1.
"""
from ..family import Family, PlanModel
from .detection import CONFIG_KEYS, DESCRIPTION, NAME, detect
from .host import COMFY
from .keys import original_plan, weight_plan
from .plan import PLAN


def build(_model_class, config: dict, dtypes):
    """Our HiDreamO1Transformer, empty (meta weights)."""
    from ...checkpoints.loading import build_empty_model
    from .model import transformer_class
    return build_empty_model(transformer_class(), config, dtypes)


# class_name: the diffusers base class (diffusers has no HiDream-O1 class; `build` makes ours)
MODEL = PlanModel(NAME, "HiDream-O1", "ModelMixin", detect, weight_plan, PLAN, 4, CONFIG_KEYS, build=build,
                  channels=lambda model: (model.config.in_channels, model.config.in_channels))
load, load_model = MODEL.load, MODEL.load_model

FAMILY = Family(NAME, DESCRIPTION, detect, load, COMFY, weight_plan, original_plan, load_model,
                signatures=("t_embedder1.mlp.0.weight",))

__all__ = ["COMFY", "CONFIG_KEYS", "DESCRIPTION", "FAMILY", "MODEL", "NAME", "PLAN", "build", "detect", "load",
           "load_model", "original_plan", "weight_plan"]
