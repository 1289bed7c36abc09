"""Counts the image / video diffusion-model loads of ComfyUI's official templates and how many this project serves.

Reads the templates (`comfyui_workflow_templates_json` wheel, or its unpacked folder of *.json) named on the command
line. A load is a node whose type contains "Loader" (CheckpointLoaderSimple and ImageOnlyCheckpointLoader included),
at the top level or inside any subgraph definition (`definitions.subgraphs`, nested ones too; a subgraph's nodes
count once however often it is placed), bypassed or not (`mode` 4 is reported apart), except the loaders of LoRAs,
VAEs, CLIP / text / audio encoders, ControlNets and model patches, upscale, style, conditioning, frame-interpolation,
optical-flow and SAM models (NOT_DIFFUSION_LOADERS). Its first widget value is the file name.

A template holds only that file name, not the file's header, which is what the project's detection reads
(sp_runtime.detection). So file names map to kinds through KINDS below, a table kept by hand (first match wins):
a kind is a registered family's name (served when sp_runtime.families.FAMILIES has it; "family:variant" when
also the family's variant registry, sp_runtime.families.<family>.variants.REGISTRY, has that variant), a kind the
project refuses by name (detection.OTHER_KINDS, or a variant a family's detector refuses, REFUSED_VARIANTS), a model
the project does not name (unknown), or a model that is not an image / video diffusion model (audio, 3D,
perception: left out of the totals, listed apart). File names matching no row count as unknown.

    python tools/template_loads.py /path/to/comfyui_workflow_templates_json-0.1.123-py3-none-any.whl [--json]
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys
import zipfile
from collections import Counter, defaultdict
from typing import Iterable, Iterator, Optional

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

NOT_DIFFUSION_LOADERS = ("lora", "vae", "clip", "textencoder", "audioencoder", "controlnet", "modelpatch", "upscale",
                         "stylemodel", "conditioning", "frameinterpolation", "opticalflow", "sam3d")
NOT_IMAGE_VIDEO = "not an image / video diffusion model"

# Variants a served family's detector refuses with an error naming them (the family's own detection.py).
REFUSED_VARIANTS = {"Wan-based variant (modules Wan's detector does not know)": "wan/detect.py",
                    "Wan 2.1 Causal Forcing (causal_ar metadata)": "wan/detect.py"}

# (file-name pattern, kinds, label): kinds is a FAMILIES name, an OTHER_KINDS / REFUSED_VARIANTS name, NOT_IMAGE_VIDEO,
# any other text (a model the project does not name), or a tuple of these (the first that applies: a family another
# branch may add, else how the project refuses it today). Rows marked "fine-tune" are files of a served family's
# architecture under another name (their keys are assumed to be the base model's: the header is not at hand).
KINDS = [
    (r"^(ace_?step|acestep|stable[-_]audio|yue2|minimax_music|sheetsage)", NOT_IMAGE_VIDEO, "audio"),
    (r"^(hunyuan3d|hunyuan_3d|pixal3d|trellis|triposplat)", NOT_IMAGE_VIDEO, "3D"),
    (r"^(sam3|rt_detr|sdpose|lotus-depth)", NOT_IMAGE_VIDEO, "segmentation / detection / pose / depth"),
    (r"^qwen_image_2\.1", "qwen_image21", "Qwen-Image 2.1"),
    (r"^(qwen_image|FireRed-Image-Edit)", "qwen_image", "Qwen-Image (FireRed-Image-Edit: fine-tune)"),
    (r"^(flux1-|flux\.1-)", "flux", "Flux.1 (OneReward fill: fine-tune)"),
    (r"^(flux-2-klein|flux2_dev)", "flux2", "Flux.2 (klein 9B kv: fine-tune)"),
    (r"^flux3-", ("flux3", "Flux.3"), "Flux.3"),
    (r"^z_image", "z_image", "Z-Image"),
    (r"^sd3", "sd3", "SD3 / SD3.5"),
    (r"^Chroma1-HD", "chroma", "Chroma"),
    (r"^chroma-radiance", "chroma", "Chroma Radiance"),
    (r"^wan2\.1_14B_SCAIL", ("wan:scail", "Wan-based variant (modules Wan's detector does not know)"),
     "Wan 2.1 SCAIL-2"),
    (r"^wan2\.2_bernini", ("wan:in_context", "Wan-based variant (modules Wan's detector does not know)"),
     "Wan 2.2 Bernini-R"),
    (r"^wan2\.2_dancer", ("wan:dancer", "Wan-based variant (modules Wan's detector does not know)"),
     "Wan 2.2 Dancer"),
    (r"^(wan2\.|wan_animate_2|Wan21-WanMove|Wan2_1-I2V|humo_)", "wan", "Wan 2.1 / 2.2 (WanMove, ATI, KJ I2V: fine-tunes)"),
    (r"^hunyuan_video_", "hunyuan_video", "HunyuanVideo 1.0"),
    (r"^hunyuanvideo1\.5", "hunyuan_video15", "HunyuanVideo 1.5"),
    (r"^ltx-2", "ltx2", "LTX-2 / 2.3 / 2.5"),
    (r"^ltx-video", "ltxv", "LTX-Video 0.9"),
    (r"^(hidream_i1|hidream_e1)", ("hidream", "HiDream"), "HiDream I1 / E1"),
    (r"^hidream_o1", "hidream_o1", "HiDream-O1"),
    (r"^(sd_xl|svd)", "SDXL / SD1.x UNet", "SDXL / SVD UNet"),
    (r"^NetaYume", "lumina2", "Lumina 2 (NetaYume)"),
    (r"^NewBie", "lumina2", "NewBie (Lumina 2 with pooled CLIP text)"),
    (r"^ming_image", "z_image", "Ming-Image (Z-Image-sized NextDiT)"),
    (r"^(minimax_h3_ref2va|fasth3_omniref)", "minimax_h3", "MiniMax H3 ref2va / omni-ref"),
    (r"^(minimax_h3|fastvideo_fasth3)", "minimax_h3", "MiniMax H3 (t2va, fl2va, FastH3)"),
    (r"^anima", "anima", "Anima (Cosmos-Predict2 with an LLM adapter)"),
    (r"^moss_image", "moss_image", "MOSS-Image"),
    (r"^ideogram4", "ideogram4", "Ideogram 4"),
    (r"^mage_flow", "mage_flow", "MageFlow (edit, turbo)"),
    (r"^krea2", "krea2", "Krea 2"),
    (r"^boogu", "boogu", "Boogu-Image (turbo, edit)"),
    (r"^seedvr2", "seedvr2", "SeedVR2"),
    (r"^kandinsky5", "kandinsky5", "Kandinsky 5 Lite"),
    (r"^omnigen2", ("omnigen2", "OmniGen2"), "OmniGen2"),
    (r"^ernie-image", "ernie_image", "ERNIE-Image"),
    (r"^longcat_image", "longcat_image", "LongCat-Image"),
    (r"^joyai_image", "joyimage", "JoyAI-Image-Edit"),
    (r"^ovis_image", "ovis_image", "Ovis-Image"),
    (r"^fibo2", ("bria_fibo2", "Bria FIBO 2"), "Bria FIBO 2"),
    (r"^capybara", "hunyuan_video15", "Capybara v0.1 (HunyuanVideo 1.5 fine-tune)"),
    (r"^void_pass", "cogvideox", "VOID (CogVideoX-Fun 5B inpainting)"),
    (r"^causal_forcing", "Wan 2.1 Causal Forcing (causal_ar metadata)", "Wan 2.1 Causal Forcing"),
    (r"^lens", "lens", "Lens (base, turbo)"),
    (r"^pid_", "PiD (PixelDiT latent decoder)", "PiD (Flux.1 latents to pixels)"),
    (r"^pixeldit", "PixelDiT", "PixelDiT"),
    (r"^chrono_edit", "wan", "ChronoEdit (Wan 2.1 I2V fine-tune)"),
]


def template_files(source: str) -> Iterator[tuple[str, dict]]:
    """(template name, workflow) of every template JSON in a wheel / zip or under a folder (index files left out)."""
    def wanted(name: str) -> bool:
        base = os.path.basename(name)
        return base.endswith(".json") and not base.startswith("index")
    if zipfile.is_zipfile(source):
        with zipfile.ZipFile(source) as wheel:
            for name in sorted(filter(wanted, wheel.namelist())):
                yield os.path.basename(name)[:-5], json.loads(wheel.read(name))
        return
    for folder, _, names in sorted(os.walk(source)):
        for name in sorted(filter(wanted, names)):
            with open(os.path.join(folder, name), encoding="utf-8") as handle:
                yield name[:-5], json.load(handle)


def loader_nodes(workflow) -> Iterator[tuple[dict, str]]:
    """(node, where) of every node at the top level and in every subgraph definition, however deeply nested."""
    if not isinstance(workflow, dict):
        return
    for node in workflow.get("nodes") or ():
        yield node, "top"
    for subgraph in (workflow.get("definitions") or {}).get("subgraphs") or ():
        for node, where in loader_nodes(subgraph):
            yield node, f"subgraph {subgraph.get('name') or subgraph.get('id')}" if where == "top" else where


def is_model_loader(node_type: str) -> bool:
    folded = node_type.lower().replace("_", "")
    return "loader" in folded and not any(word in folded for word in NOT_DIFFUSION_LOADERS)


def file_name(node: dict) -> Optional[str]:
    values = node.get("widgets_values")
    if isinstance(values, dict):
        values = list(values.values())
    return str(values[0]) if values else None


def classify(name: Optional[str]) -> tuple[str, str, str]:
    """(status, kind, label) of a model file name: status served / refused / unknown / excluded."""
    from sp_runtime.detection import OTHER_KINDS
    from sp_runtime.families import FAMILIES
    for pattern, kinds, label in KINDS:
        if not (name and re.search(pattern, name)):
            continue
        kinds = (kinds,) if isinstance(kinds, str) else kinds
        for kind in kinds:
            if kind == NOT_IMAGE_VIDEO:
                return "excluded", kind, label
            if _registered(kind, FAMILIES):
                return "served", kind, label
            if kind in OTHER_KINDS or kind in REFUSED_VARIANTS:
                return "refused", kind, label
        return "unknown", kinds[0], label
    return "unknown", "", _stem(name)


def _registered(kind: str, families) -> bool:
    """A family the registry has, or "family:variant" with the variant in that family's variant registry."""
    import importlib
    family, _, variant = kind.partition(":")
    if family not in families or not variant:
        return family in families and not variant
    try:
        registry = importlib.import_module(f"sp_runtime.families.{family}.variants").REGISTRY
    except (ImportError, AttributeError):
        return False
    return any(known.name == variant for known in registry)


def _stem(name: Optional[str]) -> str:
    """A label for a file no row names: its name without precision / format suffixes."""
    if not name:
        return "(no file name)"
    stem = re.sub(r"\.(safetensors|gguf|ckpt|pt|pth)$", "", name)
    return re.sub(r"[_-](fp8|fp16|bf16|fp32|int8|e4m3fn|scaled|convrot|mixed|pruned)(?=[_.-]|$).*$", "", stem)


def count_loads(templates: Iterable[tuple[str, dict]]) -> dict:
    """Every model load of the templates, classified; the totals leave out excluded (non image / video) loads."""
    loads, skipped_types = [], Counter()
    for template, workflow in templates:
        for node, where in loader_nodes(workflow):
            node_type = str(node.get("type", ""))
            if "loader" not in node_type.lower():
                continue
            if not is_model_loader(node_type):
                skipped_types[node_type] += 1
                continue
            name = file_name(node)
            status, kind, label = classify(name)
            loads.append({"template": template, "where": where, "node": node_type, "file": name,
                          "bypassed": node.get("mode") == 4, "status": status, "kind": kind, "label": label})
    counted = [load for load in loads if load["status"] != "excluded"]
    statuses = Counter(load["status"] for load in counted)
    per_label: dict[str, Counter] = defaultdict(Counter)
    for load in counted:
        per_label[load["label"]][load["status"]] += 1
    return {"loads": len(counted), "served": statuses["served"], "refused": statuses["refused"],
            "unknown": statuses["unknown"],
            "served_percent": round(100.0 * statuses["served"] / len(counted), 1) if counted else 0.0,
            "in_subgraphs": sum(load["where"] != "top" for load in counted),
            "bypassed": sum(load["bypassed"] for load in counted),
            "excluded": Counter(load["label"] for load in loads if load["status"] == "excluded"),
            "other_loader_types": skipped_types,
            "families": {label: dict(counts) for label, counts in per_label.items()},
            "details": loads}


def table(result: dict) -> str:
    rows = sorted(result["families"].items(), key=lambda item: (-sum(item[1].values()), item[0]))
    width = max(len(label) for label, _ in rows) if rows else 10
    lines = [f"{'family':<{width}}  loads  served  refused  unknown"]
    for label, counts in rows:
        lines.append(f"{label:<{width}}  {sum(counts.values()):>5}  {counts.get('served', 0):>6}  "
                     f"{counts.get('refused', 0):>7}  {counts.get('unknown', 0):>7}")
    lines.append(f"total: {result['loads']} image / video diffusion-model loads ({result['in_subgraphs']} inside "
                 f"subgraphs, {result['bypassed']} bypassed); served {result['served']} "
                 f"({result['served_percent']}%), refused by name {result['refused']}, unknown {result['unknown']}")
    lines.append("left out (not image / video): " + ", ".join(f"{label} {count}" for label, count
                                                                in sorted(result["excluded"].items())))
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("templates", help="the comfyui_workflow_templates_json wheel, or a folder of its templates")
    parser.add_argument("--json", action="store_true", help="print the counts and every load as JSON")
    args = parser.parse_args(argv)
    result = count_loads(template_files(args.templates))
    print(json.dumps(result, indent=1) if args.json else table(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
