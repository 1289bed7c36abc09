"""The family registry (sp_runtime/families/__init__.py): every entry provides the contract its docstring states,
and one registry line is all a new family needs to be detected and loaded."""
import sys
import types

import pytest

from sp_runtime.families import FAMILIES, comfy_host, family_module
from sp_runtime.contract import ComfyHost, Detection
from sp_runtime.detection import detect
from sp_runtime.checkpoints.header import Header


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_every_family_module_provides_the_contract(family):
    module = family_module(family)
    assert module.FAMILY == family and isinstance(module.DESCRIPTION, str)
    assert callable(module.detect) and callable(module.load)
    assert comfy_host(family) is None or isinstance(comfy_host(family), ComfyHost)
    assert not FAMILIES[family].startswith("sp_runtime.cli")


def test_comfyui_knows_the_model_families():
    assert {family for family in FAMILIES if comfy_host(family)} == {"qwen_image", "qwen_image21", "flux", "flux2",
                                                                     "wan", "hunyuan_video", "hunyuan_video15",
                                                                     "z_image", "ltx2"}
    assert comfy_host("hunyuan_video").model_class("i2v") == "HunyuanVideoI2V"
    assert comfy_host("hunyuan_video15").model_class("") == "HunyuanVideo15"
    assert comfy_host("flux2").model_class("klein") == "Flux2"
    assert comfy_host("qwen_image21").model_class("image") == "QwenImage21"
    assert comfy_host("z_image").model_class("image") == "ZImage"
    assert comfy_host("flux").model_class("schnell") == "FluxSchnell"
    assert comfy_host("wan").model_class("i2v_concat") == "WAN21_T2V"
    assert comfy_host("ltx2").model_class("av") == "LTXAV"


def test_one_registry_line_adds_a_family(monkeypatch):
    module = types.ModuleType("sp_runtime_test_family")
    module.FAMILY, module.DESCRIPTION = "new_family", "New Family 1.0"
    module.detect = lambda header: Detection(family="new_family") if "new.weight" in header.tensors else None
    module.load = lambda request, detection, device, groups, progress: None
    monkeypatch.setitem(sys.modules, module.__name__, module)
    monkeypatch.setitem(FAMILIES, "new_family", module.__name__)
    assert detect(Header("new.safetensors", {"new.weight": ("F32", (2,))})).family == "new_family"
    with pytest.raises(ValueError, match="New Family 1.0"):  # listed among the supported ones
        detect(Header("other.safetensors", {"other.weight": ("F32", (2,))}))


def test_unknown_family_name_is_a_clear_error():
    with pytest.raises(ValueError, match="'bogus' is not known.*qwen_image"):
        family_module("bogus")
