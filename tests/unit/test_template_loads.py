"""tools/template_loads.py counts every diffusion-model loader of a template, inside (nested) subgraphs too, leaves out
LoRA / VAE / text-encoder / patch loaders and non image / video models, and classifies each file name through the
families registry (served), the project's refusals (refused by name) or neither (unknown); a wheel reads as its
folder does."""
import json
import os
import sys
import zipfile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "tools"))

import template_loads  # noqa: E402


def node(node_type, *widgets, mode=0):
    return {"type": node_type, "widgets_values": list(widgets), "mode": mode}


TEMPLATE = {
    "nodes": [node("UNETLoader", "wan2.2_i2v_high_noise_14B_fp8_scaled.safetensors", "default"),
              node("VAELoader", "wan_2.1_vae.safetensors"), node("CLIPLoader", "umt5.safetensors", "wan"),
              node("LoraLoaderModelOnly", "lightx2v.safetensors", 1.0),
              node("CheckpointLoaderSimple", "sd_xl_base_1.0.safetensors")],
    "definitions": {"subgraphs": [
        {"name": "outer", "nodes": [node("UNETLoader", "brand_new_model_bf16.safetensors", "default"),
                                    node("ModelPatchLoader", "some_controlnet.safetensors"),
                                    node("UNETLoader", "acestep_v1.5_turbo.safetensors", "default")],
         "definitions": {"subgraphs": [
             {"name": "inner", "nodes": [node("UNETLoader", "z_image_turbo_bf16.safetensors", "default", mode=4),
                                         node("LTXAVTextEncoderLoader", "gemma.safetensors")]}]}}]},
}


def test_counts_loaders_in_nested_subgraphs_and_classifies_them(tmp_path):
    (tmp_path / "templates").mkdir()
    (tmp_path / "templates" / "t.json").write_text(json.dumps(TEMPLATE))
    (tmp_path / "templates" / "index.json").write_text(json.dumps([{"templates": []}]))
    result = template_loads.count_loads(template_loads.template_files(str(tmp_path)))
    assert (result["loads"], result["served"], result["refused"], result["unknown"]) == (4, 2, 1, 1)
    assert (result["in_subgraphs"], result["bypassed"], result["served_percent"]) == (2, 1, 50.0)
    assert dict(result["excluded"]) == {"audio": 1}
    assert set(result["other_loader_types"]) == {"VAELoader", "CLIPLoader", "LoraLoaderModelOnly",
                                                 "ModelPatchLoader", "LTXAVTextEncoderLoader"}
    by_file = {load["file"]: (load["status"], load["where"]) for load in result["details"]}
    assert by_file["z_image_turbo_bf16.safetensors"] == ("served", "subgraph inner")
    assert by_file["sd_xl_base_1.0.safetensors"][0] == "refused"
    assert by_file["brand_new_model_bf16.safetensors"] == ("unknown", "subgraph outer")
    wheel = str(tmp_path / "templates.whl")
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.writestr("pkg/templates/t.json", json.dumps(TEMPLATE))
    assert template_loads.count_loads(template_loads.template_files(wheel))["families"] == result["families"]
    assert "served 2 (50.0%)" in template_loads.table(result)


def test_a_wan_variant_file_is_served_while_its_variant_is_registered(monkeypatch):
    """SCAIL-2 / Bernini-R / Dancer count as served through Wan's variant registry; without the variant, refused by
    name."""
    from sp_runtime.families.wan import variants
    assert template_loads.classify("wan2.1_14B_SCAIL_2_int8_convrot.safetensors")[:2] == ("served", "wan:scail")
    assert template_loads.classify("wan2.2_bernini_r_low_noise_fp8_scaled.safetensors")[0] == "served"
    assert template_loads.classify("wan2.2_dancer_14b_local_fp8_scaled.safetensors")[:2] == ("served", "wan:dancer")
    monkeypatch.setattr(variants, "REGISTRY", [v for v in variants.REGISTRY if v.name not in ("scail", "dancer")])
    assert template_loads.classify("wan2.1_14B_SCAIL_2_fp16.safetensors")[0] == "refused"
    assert template_loads.classify("wan2.2_dancer_14b_global_fp8_scaled.safetensors")[0] == "refused"
