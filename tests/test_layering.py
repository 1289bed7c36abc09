"""The import rules of docs/ARCHITECTURE.md, checked on the source: a broken layer fails here, not in ComfyUI."""
import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _imports(folder: str) -> dict[str, set[str]]:
    """module file -> every module name it imports (absolute, or '.'-prefixed relative)."""
    found = {}
    for path in (ROOT / folder).rglob("*.py"):
        names = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                names.add("." * node.level + (node.module or ""))
        found[str(path.relative_to(ROOT))] = names
    return found


def _offenders(folder: str, forbidden) -> list[str]:
    return [f"{path}: {name}" for path, names in _imports(folder).items() for name in sorted(names)
            if forbidden(name)]


def test_runtime_never_imports_comfyui():
    assert _offenders("sp_runtime", lambda name: name.split(".")[0] in ("comfy", "comfy_api", "server",
                                                                       "folder_paths", "nodes")) == []


def test_nodes_hold_no_distributed_logic():
    assert _offenders("nodes", lambda name: name.startswith("torch.distributed")) == []


def test_attention_core_depends_on_torch_and_groups_only():
    allowed_relative = {".", ".local", ".shards", ".ulysses", ".ring", ".hybrid", ".lse", "..groups"}
    assert _offenders("sp_runtime/attention", lambda name: name.startswith(".") and name not in allowed_relative
                      or not name.startswith(".") and name.split(".")[0] not in (
                          "torch", "typing", "__future__", "dataclasses", "math", "functools")) == []


def test_families_do_not_reach_into_the_pool():
    assert _offenders("sp_runtime/families", lambda name: name.startswith("..pool")
                      or name.startswith("sp_runtime.pool")) == []
