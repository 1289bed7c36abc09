"""LTX-2, 2.3 and 2.5 (audio + video) as one family: detection.py (the header -> diffusers' config), keys.py (the
key plan), loading.py (the model and the pool's entry point), plan.py (the sequence-parallel PLAN: video split,
audio replicated), block.py (its custom audio-video block), text.py (the prompt connectors), host.py (ComfyUI's LTXAV
class and the host hooks that pack its [video, audio] call). The single-device reference is sp_lab.references.ltx2.
"""
from ..family import Family
from .detection import CONNECTORS, FAMILY as NAME, detect
from .host import COMFY
from .keys import weight_plan
from .loading import attach_connectors, load, load_model, use_comfy_qk_norm_eps
from .plan import PLAN

DESCRIPTION = "LTX-2, 2.3 and 2.5 (audio + video)"
FAMILY = Family(NAME, DESCRIPTION, detect, load, COMFY, weight_plan, load_model=load_model,
                signatures=("audio_patchify_proj.weight", "transformer_blocks.0.video_to_audio_attn.to_q.weight"))

__all__ = ["COMFY", "CONNECTORS", "DESCRIPTION", "FAMILY", "PLAN", "attach_connectors", "detect", "load",
           "load_model", "use_comfy_qk_norm_eps", "weight_plan"]
