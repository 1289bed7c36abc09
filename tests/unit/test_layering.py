"""The import rules of docs/ARCHITECTURE.md, checked on the source: a broken layer fails here, not in ComfyUI.

Every import counts, also those inside functions; importlib lookups by name (the family registry, the lazy public
API) are the only way up.
"""
import ast
import os
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]  # tests/unit/ -> the repository root

# sp_runtime's components, lowest layer first: a component imports only components of lower layers (and itself).
# Mirrored by the "Who may import whom" table of docs/ARCHITECTURE.md.
LAYERS = [
    ("devices", "local_ranks"),
    ("config",),
    ("groups",),
    ("attention", "compile", "formats"),
    ("model_options", "sharding"),
    ("sp", "checkpoints"),
    ("contract",),
    ("families",),
    ("detection",),
    ("cfg_parallel", "lora"),
    ("pool",),
    ("cli",),
    ("__init__", "__main__"),
]
LAYER_OF = {component: index for index, components in enumerate(LAYERS) for component in components}
NODES_NEVER_IMPORT = ("sp_runtime.cli", "sp_runtime.local_ranks", "sp_runtime.attention")


def _module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_module(name: str) -> bool:
    base = ROOT.joinpath(*name.split("."))
    return base.with_suffix(".py").is_file() or (base / "__init__.py").is_file()


def _imported(path: pathlib.Path, node) -> set[str]:
    """Absolute names of the modules an import statement loads (for `from M import x`: M.x when it is a module)."""
    if isinstance(node, ast.Import):
        return {alias.name for alias in node.names}
    package = _module_name(path).split(".")
    if path.name != "__init__.py":
        package = package[:-1]
    base = package[: len(package) - node.level + 1] if node.level else []
    module = ".".join(base + (node.module.split(".") if node.module else []))
    submodules = {f"{module}.{alias.name}" for alias in node.names if _is_module(f"{module}.{alias.name}")}
    return submodules or {module}


def _imports(folder: str) -> dict[str, set[str]]:
    """module file -> every module name it imports (absolute)."""
    found = {}
    for path in (ROOT / folder).rglob("*.py"):
        names = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                names |= _imported(path, node)
        found[str(path.relative_to(ROOT))] = names
    return found


def _offenders(folder: str, forbidden) -> list[str]:
    return [f"{path}: {name}" for path, names in _imports(folder).items() for name in sorted(names)
            if forbidden(name)]


def _component(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def test_runtime_never_imports_comfyui():
    assert _offenders("sp_runtime", lambda name: name.split(".")[0] in ("comfy", "comfy_api", "server",
                                                                       "folder_paths", "nodes")) == []


def test_product_never_imports_the_lab():
    assert _offenders("sp_runtime", lambda name: name.split(".")[0] == "sp_lab") == []
    assert _offenders("nodes", lambda name: name.split(".")[0] == "sp_lab") == []


def test_production_registry_holds_no_lab_family():
    """A process that never imported the lab (ComfyUI's) knows no toy / synthetic family and refuses their files."""
    environment = {name: value for name, value in os.environ.items()
                   if name not in ("ULYSSES_SP_EXTRA_FAMILIES", "ULYSSES_SP_INTERNAL_FAMILIES")}
    script = ("import sys; from sp_runtime.families import FAMILIES; from sp_runtime.detection import detect; "
              "from sp_runtime.checkpoints.header import Header\n"
              "try: detect(Header('toy.safetensors', {}, {'ulysses_sp.family': 'toy'}))\n"
              "except ValueError as error: print(','.join(FAMILIES), '|', error)")
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=environment, capture_output=True, text=True,
                          timeout=120)
    families, _, refusal = done.stdout.partition(" | ")
    assert done.returncode == 0 and "qwen_image" in families.split(","), done.stderr
    assert not {"toy", "synthetic"} & set(families.split(",")) and "'toy'" in refusal


def test_nodes_hold_no_distributed_logic():
    assert _offenders("nodes", lambda name: name.startswith("torch.distributed")) == []


def test_nodes_use_the_runtime_not_its_tools():
    assert _offenders("nodes", lambda name: name.startswith(NODES_NEVER_IMPORT)) == []


def test_attention_core_depends_on_torch_and_groups_only():
    assert _offenders("sp_runtime/attention", lambda name: name.startswith("sp_runtime.")
                      and not name.startswith(("sp_runtime.attention", "sp_runtime.groups"))
                      or not name.startswith("sp_runtime") and name.split(".")[0] not in (
                          "torch", "typing", "__future__", "dataclasses", "math", "functools", "contextlib",
                          "importlib", "logging", "collections")) == []


def test_every_runtime_component_has_a_layer():
    components = {_component(_module_name(path)) for path in (ROOT / "sp_runtime").glob("*")
                  if path.suffix == ".py" or (path / "__init__.py").is_file()}
    assert components - set(LAYER_OF) == set()


def test_no_import_from_a_lower_layer_to_a_higher_one():
    upward = []
    for path, names in _imports("sp_runtime").items():
        here = _component(_module_name(ROOT / path))
        for name in names:
            if name.startswith("sp_runtime.") or name == "sp_runtime":
                there = _component(name)
                if there != here and LAYER_OF[there] >= LAYER_OF[here]:
                    upward.append(f"{path} ({here}, layer {LAYER_OF[here]}) imports {name} (layer {LAYER_OF[there]})")
    assert upward == []


def test_import_graph_has_no_cycles():
    graph = {}
    for path, names in _imports("sp_runtime").items():
        graph[_module_name(ROOT / path)] = {name for name in names if name.startswith("sp_runtime")}
    cycles, state = [], {}

    def visit(module, trail):
        state[module] = "open"
        for target in sorted(graph.get(module, ())):
            if state.get(target) == "open":
                cycles.append(" -> ".join(trail[trail.index(target):] + [target]))
            elif target not in state:
                visit(target, trail + [target])
        state[module] = "done"

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])
    assert cycles == []
