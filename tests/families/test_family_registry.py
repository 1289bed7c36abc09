"""The family registry (sp_runtime/families/__init__.py): every entry declares a Family object (family.py), the
tables around it are derived from those objects, and one registry line is all a new family needs to be detected
and loaded."""
import sys
import types

import pytest

from sp_runtime.families import (FAMILIES, comfy_host, descriptions, families, family, gguf_architectures,
                                 signatures)
from sp_runtime.checkpoints.header import Header
from sp_runtime.contract import ComfyHost, Detection
from sp_runtime.detection import describe_unknown, detect
from sp_runtime.families.family import Family
from sp_lab.tiny_models import FAMILIES as TINY_FAMILIES, build_tiny_model, original_state_dict


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_every_family_declares_the_contract(name):
    entry = family(name)
    assert isinstance(entry, Family) and entry.name == name and isinstance(entry.description, str)
    assert callable(entry.detect) and callable(entry.load)
    assert entry.comfy is None or isinstance(entry.comfy, ComfyHost)
    assert not FAMILIES[name].startswith("sp_runtime.cli")


def test_family_packages_import_no_diffusers_at_import_time():
    """Detection runs in the ComfyUI process: no module of a family package (nor the registry) imports diffusers
    at module level; loaders import it inside their functions."""
    import ast
    import pathlib
    offenders = []
    for path in (pathlib.Path(__file__).resolve().parents[2] / "sp_runtime" / "families").rglob("*.py"):
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            else:
                continue
            offenders += [f"{path.name}: {name}" for name in names if name.split(".")[0] == "diffusers"]
    assert offenders == []


def test_comfyui_knows_the_model_families():
    assert {name for name in FAMILIES if comfy_host(name)} == {"qwen_image", "qwen_image21", "flux", "flux2",
                                                               "wan", "hunyuan_video", "hunyuan_video15",
                                                               "z_image", "lumina2", "ltx2", "sd3", "chroma",
                                                               "hidream", "hidream_o1", "minimax_h3", "cosmos",
                                                               "anima",
                                                               "ideogram4",
                                                               "ltxv", "kandinsky5", "krea2",
                                                               "mage_flow", "ernie_image", "longcat_image", "omnigen2",
                                                               "seedvr2", "boogu", "ovis_image", "joyimage", "lens",
                                                               "cogvideox"}
    assert comfy_host("ideogram4").model_class("image") == "Ideogram4"
    assert comfy_host("sd3").model_class("3.5_medium") == "SD3"
    assert comfy_host("hidream").model_class("") == "HiDream"
    assert comfy_host("hidream_o1").model_class("t2i") == "HiDreamO1"
    assert comfy_host("lumina2").model_class("") == "Lumina2"
    assert comfy_host("omnigen2").model_class("") == "Omnigen2"
    assert comfy_host("boogu").model_class("image") == "Boogu"
    assert comfy_host("joyimage").model_class("") == "JoyImage"
    assert comfy_host("minimax_h3").model_class("pruned") == "MiniMaxH3"
    assert comfy_host("chroma").model_class("") == "Chroma"
    assert comfy_host("ovis_image").model_class("") == "FluxSchnell"
    assert comfy_host("hunyuan_video").model_class("i2v") == "HunyuanVideoI2V"
    assert comfy_host("hunyuan_video15").model_class("") == "HunyuanVideo15"
    assert comfy_host("flux2").model_class("klein") == "Flux2"
    assert comfy_host("qwen_image21").model_class("image") == "QwenImage21"
    assert comfy_host("z_image").model_class("image") == "ZImage"
    assert comfy_host("flux").model_class("schnell") == "FluxSchnell"
    assert comfy_host("wan").model_class("i2v_concat") == "WAN21_T2V"
    assert comfy_host("ltx2").model_class("av") == "LTXAV"
    assert comfy_host("ltxv").model_class("") == "LTXV"
    assert comfy_host("kandinsky5").model_class("image") == "Kandinsky5Image"
    assert comfy_host("kandinsky5").model_class("video") == "Kandinsky5"
    assert comfy_host("krea2").model_class("") == "Krea2"


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


def test_a_family_object_is_registered_the_same_way(monkeypatch):
    """A package declaring FAMILY = Family(...): its detector, description, signatures and GGUF architecture join
    the derived tables."""
    module = types.ModuleType("sp_runtime_test_family_object")
    module.FAMILY = Family("object_family", "Object Family 2.0",
                           lambda header: Detection(family="object_family") if "a.weight" in header.tensors and
                           "b.weight" in header.tensors else None,
                           lambda *args: None, gguf_architectures=("objectarch",), signatures=("a.weight",))
    monkeypatch.setitem(sys.modules, module.__name__, module)
    monkeypatch.setitem(FAMILIES, "object_family", module.__name__)
    both = {"a.weight": ("F32", (2,)), "b.weight": ("F32", (2,))}
    assert detect(Header("both.safetensors", both)).family == "object_family"
    assert "Object Family 2.0" in descriptions() and gguf_architectures()["objectarch"] == ["object_family"]
    with pytest.raises(ValueError, match="looks like Object Family 2.0 .*'a.weight'.*incomplete"):
        detect(Header("half.safetensors", {"a.weight": ("F32", (2,))}))


def test_a_family_registered_under_another_name_is_refused(monkeypatch):
    module = types.ModuleType("sp_runtime_test_misnamed")
    module.FAMILY = Family("its_own_name", "", lambda header: None, lambda *args: None)
    monkeypatch.setitem(sys.modules, module.__name__, module)
    monkeypatch.setitem(FAMILIES, "other_name", module.__name__)
    with pytest.raises(ValueError, match="registered as 'other_name' but declares the family 'its_own_name'"):
        family("other_name")


def test_unknown_family_name_is_a_clear_error():
    with pytest.raises(ValueError, match="'bogus' is not known.*qwen_image"):
        family("bogus")


@pytest.mark.parametrize("name", TINY_FAMILIES)
def test_no_registered_familys_file_is_called_not_supported(name):
    """A file of a registered family that its detector refuses (damaged, incomplete) is described by the family's
    own signatures (Family.signatures) or by its tensors, never as a kind "which is not supported" (OTHER_KINDS
    lists only what no family handles), in either key layout."""
    model = build_tiny_model(name)
    for keys in (model.state_dict(), original_state_dict(name, model)):
        message = describe_unknown(Header(f"{name}.safetensors", {key: ("F32", (2,)) for key in keys}))
        assert "not supported" not in message, f"{name}: {message}"


def test_a_damaged_file_of_a_family_is_named_by_its_signature():
    assert set(signatures()) <= {entry.description for entry in families()}
    message = describe_unknown(Header("x.safetensors", {"double_stream_modulation_img.lin.weight": ("F32", (2,))}))
    assert "looks like Flux.2 (dev, klein)" in message and "incomplete" in message


def test_the_lab_covers_every_product_family():
    """Every family a user can load has a tiny-model writer (the parity and conformance tests build on them)."""
    assert {entry.name for entry in families() if entry.description} == set(TINY_FAMILIES)


def _gguf_cases():
    from sp_lab.tiny_models.quant_files import GGUF_ARCHITECTURES
    return list(GGUF_ARCHITECTURES.items())


@pytest.mark.parametrize("name, architecture", _gguf_cases())
def test_the_gguf_writer_labels_files_as_the_registry_maps_them(name, architecture):
    assert name in gguf_architectures().get(architecture, [])


def test_an_unknown_gguf_architecture_is_named():
    from sp_runtime.formats.gguf_file import METADATA_ARCHITECTURE
    header = Header("x.gguf", {"joint_blocks.7.weight": ("F32", (2,))}, {METADATA_ARCHITECTURE: "sd3"})
    assert "GGUF architecture is 'sd3'; GGUF files of flux, " in describe_unknown(header)
