"""Cosmos-Predict2 (text-to-image and video-to-world 2B / 14B): ComfyUI's `diffusion_model(x, timesteps, context,
fps, padding_mask)` (MiniTrainDIT in comfy/ldm/cosmos/predict2.py) on diffusers' CosmosTransformer3DModel.

Plan (plan.py): one split "video" stream (x and its zero padding-mask channel, in (frame, row, column) patches);
each block's self-attention over the whole sequence, its cross-attention local against the replicated T5 text;
the adaLN-LoRA time embedding shared by every token. Anima files (an LLM adapter before this DiT) are the anima
family's (families/anima); learnable extra positions are refused by name at detection; per-frame timesteps and padding
masks at the call.
"""
from ..family import Family, PlanModel
from .detection import CLASS_NAME, CONFIG_KEYS, NAME, UNUSED, architecture, detect
from .host import COMFY
from .keys import original_plan, weight_plan
from .plan import PLAN

MODEL = PlanModel(NAME, "Cosmos-Predict2", CLASS_NAME, detect, weight_plan, PLAN, 5, CONFIG_KEYS, ignore=UNUSED)
load, load_model = MODEL.load, MODEL.load_model

FAMILY = Family(NAME, "Cosmos-Predict2 (text-to-image, video-to-world)", detect, load, COMFY, weight_plan,
                original_plan, load_model, signatures=("t_embedding_norm.weight",))

__all__ = ["FAMILY", "CONFIG_KEYS", "COMFY", "NAME", "PLAN", "architecture", "detect", "load", "load_model",
           "original_plan", "weight_plan"]
