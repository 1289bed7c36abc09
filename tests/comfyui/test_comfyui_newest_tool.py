"""tools/comfyui_newest.py: an overlaid newer ComfyUI file whose imports the assembled tree lacks is named (the
module, or the name in a module), so a broken newest tree says why instead of failing at import in the tests."""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "tools"))

import comfyui_newest  # noqa: E402


def write(root, relpath, text):
    path = os.path.join(root, relpath)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as handle:
        handle.write(text)


def test_missing_modules_and_names_of_an_overlaid_file_are_named(tmp_path):
    root = str(tmp_path)
    write(root, "comfy/__init__.py", "")
    write(root, "comfy/utils.py", "import torch\nfrom typing import Any\nX = 1\ndef f():\n    pass\n")
    write(root, "comfy/weight_adapter/base.py", "class WeightAdapterBase:\n    pass\n")
    write(root, "comfy/weight_adapter/lokr.py",
          "import torch\nimport comfy.utils\nimport comfy.quant_ops\nfrom comfy.utils import f, X, new_helper\n"
          "from .base import WeightAdapterBase, weight_decompose\nfrom . import base, bypass\n"
          "from ..utils import Any\n")
    assert comfyui_newest.missing_imports(root, "comfy/weight_adapter/lokr.py") == [
        "comfy.quant_ops", "comfy.utils.new_helper", "comfy.weight_adapter.base.weight_decompose",
        "comfy.weight_adapter.bypass"]
