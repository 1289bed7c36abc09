"""The sequence-parallel executor: a family declares its forward as a Plan (plan.py) and PlanWorker (executor.py)
runs it; token layouts (tokens.py, layouts.py) and the one attention processor (processor.py) are shared."""
from .executor import Call, PlanWorker
from .layouts import image_parts, text_stream, video_part
from .plan import AttentionSpec, Control, Output, Part, Plan, Stage, Stream, project_out, project_qkv
from .processor import SPAttnProcessor

__all__ = ["AttentionSpec", "Call", "Control", "Output", "Part", "Plan", "PlanWorker", "SPAttnProcessor", "Stage", "Stream",
           "image_parts", "project_out", "project_qkv", "text_stream", "video_part"]
