"""How ComfyUI's host side sees SD3 / SD3.5: ComfyUI's SD3 model class (SD3.5 included; MMDiT with patch 2)."""
from __future__ import annotations

from ...contract import ComfyHost


COMFY = ComfyHost(model_classes={"": "SD3"})
