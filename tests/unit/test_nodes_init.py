"""The top-level __init__.py is safe to import where ComfyUI is absent and exposes only the V3 entry point."""
import json
import os
import subprocess
import sys

from comfy_support import ROOT

PROBE = r"""
import importlib.util, inspect, json, os, sys
root = sys.argv[1]
before = list(sys.path)
spec = importlib.util.spec_from_file_location("custom_nodes_x_ulysses", os.path.join(root, "__init__.py"),
                                              submodule_search_locations=[root])
module = importlib.util.module_from_spec(spec)
sys.modules[spec.name] = module
spec.loader.exec_module(module)
error = None
try:
    import asyncio
    asyncio.run(module.comfy_entrypoint())
except Exception as exc:
    error = type(exc).__name__ + ": " + str(exc)
print(json.dumps({
    "entry_is_async": inspect.iscoroutinefunction(module.comfy_entrypoint),
    "web": module.WEB_DIRECTORY,
    "has_mappings": hasattr(module, "NODE_CLASS_MAPPINGS"),
    "path_tail": sys.path[-1], "root_first": sys.path[0] == root,
    "heavy": sorted(m for m in ("torch", "diffusers", "comfy", "comfy_api") if m in sys.modules),
    "entry_error": error,
}))
"""


def probe() -> dict:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    out = subprocess.run([sys.executable, "-c", PROBE, ROOT], capture_output=True, text=True, env=env,
                         cwd="/", timeout=120)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_import_without_comfyui_is_cheap_and_safe():
    result = probe()
    assert result["entry_is_async"]
    assert not result["has_mappings"], "NODE_CLASS_MAPPINGS makes ComfyUI ignore the V3 entry point"
    assert result["heavy"] == [], "importing the package must not import torch, diffusers or ComfyUI"
    # the package folder is appended (not inserted) so ComfyUI's own top-level `nodes` module keeps winning
    assert result["path_tail"] == ROOT and not result["root_first"]
    # without ComfyUI the entry point fails with an import error instead of half-registering nodes
    assert result["entry_error"] and "ModuleNotFoundError" in result["entry_error"]


def test_web_directory_holds_the_panel():
    result = probe()
    web = os.path.join(ROOT, result["web"])
    assert os.path.isfile(os.path.join(web, "ulysses_sp.js"))


def test_requirements_never_pin_torch():
    with open(os.path.join(ROOT, "requirements.txt")) as handle:
        names = [line.split("#")[0].strip().split(">")[0].split("=")[0].split("<")[0].strip().lower()
                 for line in handle]
    assert not {"torch", "torchvision", "torchaudio"} & set(names)
    for needed in ("diffusers", "safetensors", "psutil", "websockets", "accelerate", "gguf"):
        assert needed in names


def test_pyproject_has_registry_fields():
    import tomllib
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as handle:
        data = tomllib.load(handle)
    project, comfy = data["project"], data["tool"]["comfy"]
    assert "comfyui" not in project["name"].lower()
    assert project["version"].count(".") == 2 and project["license"]
    assert "torch" not in " ".join(project["dependencies"])
    assert project["urls"]["Repository"]
    assert {"PublisherId", "DisplayName", "Icon"} <= set(comfy)
    assert comfy["requires-comfyui"].startswith(">=")


def test_install_script_runs_and_never_installs():
    source = open(os.path.join(ROOT, "install.py")).read()
    assert "subprocess" not in source and "pip.main" not in source and "os.system" not in source  # only tells
    out = subprocess.run([sys.executable, os.path.join(ROOT, "install.py")], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert "check done" in out.stdout
