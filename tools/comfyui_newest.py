"""Assembles the newest-ComfyUI test tree (the `COMFYUI_PATH` tier against ComfyUI's newest stored core): a full
newer ComfyUI tree as the base, ComfyUI's newest stored versions of single core files laid over it from a local
cache, and torchaudio's top-level imports made optional (no torchaudio wheel exists for the torch it runs with).
Nothing of ComfyUI enters this repository: the base and the cache are local folders; what was used (base version
and commit, each overlaid file with its upstream commit, each wanted file that was missing and the tests it leaves
uncovered, and what an overlaid file imports from ComfyUI that the tree lacks: then it exits 1) is written to
<out>/ULYSSES_SP_NEWEST.json and printed. The wanted files are listed in tools/comfyui_newest_files.json. See
docs/DEVELOPMENT.md.

    python tools/comfyui_newest.py --base /work/ComfyUI-033 --cache /work/comfy_overlay_cache --out /work/ComfyUI-newest
"""
from __future__ import annotations

import argparse
import ast
import json
import os
import re
import shutil
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
WANTED = os.path.join(HERE, "comfyui_newest_files.json")
RECORD = "ULYSSES_SP_NEWEST.json"
_TORCHAUDIO = re.compile(r"^(?P<indent>[ \t]*)(?P<line>import torchaudio(\.\w+)*(?: as (?P<alias>\w+))?)[ \t]*$",
                         re.MULTILINE)


def optional_torchaudio(text: str) -> str:
    """`import torchaudio[.sub] [as name]` at any indentation -> the same import, the name None when torchaudio
    cannot be imported."""
    def optional(m) -> str:
        indent, name = m["indent"], m["alias"] or "torchaudio"
        return (f"{indent}try:\n{indent}    {m['line']}\n{indent}except (ImportError, OSError):  # ulysses-sp newest "
                f"tier\n{indent}    {name} = None")
    return _TORCHAUDIO.sub(optional, text)


def base_version(base: str) -> dict:
    version = {}
    with open(os.path.join(base, "comfyui_version.py")) as handle:
        exec(handle.read(), version)  # noqa: S102 - ComfyUI's own one-line version file
    commit = None
    if os.path.isdir(os.path.join(base, ".git")):
        commit = subprocess.run(["git", "-C", base, "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    return {"version": version.get("__version__"), "commit": commit or _recorded_base_commit(base)}


def _recorded_base_commit(base: str) -> str | None:
    path = os.path.join(base, "COMMIT")
    return open(path).read().strip() if os.path.isfile(path) else None


def _module_file(root: str, module: str) -> str | None:
    """The file of dotted `module` in the tree at root (a package's __init__.py, or its folder for a namespace
    package), or None."""
    path = os.path.join(root, *module.split("."))
    for candidate in (path + ".py", os.path.join(path, "__init__.py")):
        if os.path.isfile(candidate):
            return candidate
    return path if os.path.isdir(path) else None


def _top_level_names(path: str) -> set[str] | None:
    """Names a module file defines or imports (none for a namespace package's folder); None for a file ast cannot
    read."""
    if not path.endswith(".py"):
        return set()
    try:
        tree = ast.parse(open(path, encoding="utf-8").read())
    except SyntaxError:
        return None
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((alias.asname or alias.name).split(".")[0] for alias in node.names)
        elif isinstance(node, (ast.Name,)) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
    return names


def missing_imports(out: str, relpath: str) -> list[str]:
    """What the overlaid file at relpath imports from ComfyUI's own packages that the assembled tree lacks: a
    module ('comfy.x') or a name in a module ('comfy.x.name'), e.g. a newer file over an older base."""
    own = {name.removesuffix(".py") for name in os.listdir(out)}
    package = relpath.removesuffix(".py").replace("/", ".").rsplit(".", 1)[0]
    wanted = []  # (module, name or None)
    for node in ast.walk(ast.parse(open(os.path.join(out, relpath), encoding="utf-8").read())):
        if isinstance(node, ast.Import):
            wanted += [(alias.name, None) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package.split(".")[:len(package.split(".")) - node.level + 1] if node.level else []
            module = ".".join(base + ([node.module] if node.module else []))
            wanted += [(module, alias.name) for alias in node.names if alias.name != "*"]
    missing = []
    for module, name in wanted:
        if module.split(".")[0] not in own:
            continue
        path = _module_file(out, module)
        if path is None:
            missing.append(module)
        elif name and _module_file(out, f"{module}.{name}") is None:
            names = _top_level_names(path)
            if names is not None and name not in names:
                missing.append(f"{module}.{name}")
    return sorted(set(missing))


def assemble(base: str, cache: str, out: str) -> dict:
    wanted = json.load(open(WANTED))
    if os.path.exists(out):
        shutil.rmtree(out)
    shutil.copytree(base, out, ignore=shutil.ignore_patterns(".git", "__pycache__"), symlinks=True)
    patched = []
    for root, _, files in os.walk(out):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(root, name)
                text = open(path, encoding="utf-8").read()
                new = optional_torchaudio(text)
                if new != text:
                    open(path, "w", encoding="utf-8").write(new)
                    patched.append(os.path.relpath(path, out))
    overlaid, missing = [], []
    for entry in wanted["overlay"]:
        source = os.path.join(cache, entry["path"])
        if os.path.isfile(source):
            os.makedirs(os.path.dirname(os.path.join(out, entry["path"])), exist_ok=True)
            text = optional_torchaudio(open(source, encoding="utf-8").read())
            open(os.path.join(out, entry["path"]), "w", encoding="utf-8").write(text)
            overlaid.append({"path": entry["path"], "commit": entry["commit"]})
        else:
            missing.append({"path": entry["path"], "commit": entry["commit"], "not_covered": entry.get("tests", [])})
    broken = {entry["path"]: missing_imports(out, entry["path"]) for entry in overlaid}
    record = {"base": {**base_version(base), "source": wanted["base"]}, "overlaid": overlaid,
              "missing_from_cache": missing, "imports_missing_in_tree": {k: v for k, v in broken.items() if v}, "torchaudio_optional_in": sorted(patched),
              "checked_in_base": wanted.get("checked_in_base", [])}
    with open(os.path.join(out, RECORD), "w") as handle:
        json.dump(record, handle, indent=1)
    return record


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", required=True, help="a full newer ComfyUI tree (see tools/comfyui_newest_files.json)")
    parser.add_argument("--cache", default="", help="folder of ComfyUI files newer than the base, at their paths")
    parser.add_argument("--out", required=True, help="the tree to write (replaced); use it as COMFYUI_PATH")
    args = parser.parse_args(argv)
    record = assemble(os.path.abspath(args.base), os.path.abspath(args.cache or os.devnull), os.path.abspath(args.out))
    print(json.dumps(record, indent=1))
    for entry in record["missing_from_cache"]:
        print(f"not overlaid (missing from the cache): {entry['path']} @ {entry['commit']}; not covered at that "
              f"version: {', '.join(entry['not_covered']) or '-'}", file=sys.stderr)
    for path, modules in record["imports_missing_in_tree"].items():
        print(f"BROKEN: the overlaid {path} imports what the tree lacks (overlay those files too, or use a newer "
              f"base): {', '.join(modules)}", file=sys.stderr)
    print(f"COMFYUI_PATH={os.path.abspath(args.out)}")
    return 1 if record["imports_missing_in_tree"] else 0


if __name__ == "__main__":
    sys.exit(main())
