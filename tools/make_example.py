"""Makes an example workflow from an official ComfyUI template: the UI form with the diffusion-model loader swapped
for this package's, and its API twin, written offline by the rules of the frontend's graphToPrompt.

    python tools/make_example.py WHEEL TEMPLATE NAME        # example_workflows/NAME.json and NAME_api.json
    python tools/make_example.py --api UI.json [OUT.json]    # only the API twin of a UI workflow
    python tools/make_example.py --refresh-widgets OBJECT_INFO.json [--templates WHEEL]
                                  # fold a ComfyUI's /object_info into the table (classes the table, examples use)

WHEEL is the comfyui_workflow_templates_json wheel (or a folder of its templates), TEMPLATE a template's file name
without .json. Every UNETLoader becomes "Load Diffusion Model (Ulysses SP)" (SPModelLoader) and every
CheckpointLoaderSimple "Load Checkpoint (Ulysses SP)" (SPCheckpointLoader), at the top level and in subgraphs, when
tools/template_loads.py classifies its file as served; every other node stays as it is.

The API form: subgraphs flattened (ids `outer:inner`, nested ones `a:b:c`); bypassed nodes (mode 4) routed through
(an output takes the input of the same index when its type matches, else the first input of that type); an input
fed by an unlinked subgraph input takes the value of the widget that input shows: the subgraph node's (its
widgets_values follow the subgraph's inputs) or else that of the inner widget it promotes; muted nodes
(mode 2) and the frontend's own nodes (notes, Primitive, Reroute) dropped, a Primitive's value staying in its target's
widget; widget values named by the node's widgets in declaration order. Those widget lists come from a ComfyUI's
/object_info (`--object-info`) or from tools/node_widgets.json, a table made from ComfyUI 0.33.0's /object_info with
entries for newer nodes added by hand (`python tools/make_example.py --refresh-widgets` folds in another one).
A table entry is a list of widgets as the frontend builds them: a name (sent in the API form), "-" (a widget the
frontend adds and does not send: a seed's control_after_generate, an upload button) or {"combo": name, "options":
{key: [widgets of that option]}} (a DynamicCombo: the chosen option's widgets follow it, named `combo.widget`) or
{"const": name, "value": v} (a widget the UI form does not save, sent as v); an entry's "more": prefix names the
values past its list prefix1, prefix2, ... (CustomCombo's options). A list value is sent as {"__value__": list}.
The examples' API form is the oldest ComfyUI's that has the node (newer inputs get their defaults when the frontend
loads the UI form): the table keeps SaveVideo's and CreateVideo's 0.3.64 widgets ("overrides" in the table).
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import sys
from typing import Optional

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WIDGETS_TABLE = os.path.join(ROOT, "tools", "node_widgets.json")
EXAMPLES = os.path.join(ROOT, "example_workflows")

FRONTEND_ONLY = {"Note", "MarkdownNote", "PrimitiveNode", "Reroute"}
MUTED, BYPASSED = 2, 4
SUBGRAPH_INPUT, SUBGRAPH_OUTPUT = -10, -20

# stock loader -> (our node class, its title); the pool widgets that follow the stock ones, at their defaults
SWAPS = {"UNETLoader": ("SPModelLoader", "Load Diffusion Model (Ulysses SP)"),
         "CheckpointLoaderSimple": ("SPCheckpointLoader", "Load Checkpoint (Ulysses SP)")}
POOL_WIDGETS = [("devices", "STRING", "auto"), ("ulysses_degree", "INT", 0), ("ring_degree", "INT", 1),
                ("cfg_parallel", "BOOLEAN", False), ("attention", "COMBO", "sdpa"),
                ("fp8_exchange", "BOOLEAN", False), ("compile", "BOOLEAN", False),
                ("shard_weights", "BOOLEAN", False), ("tensor_parallel_degree", "INT", 1)]

# input types the frontend shows as a widget sent in the API form, and those it shows as a widget it does not send
VALUE_WIDGETS = {"INT", "FLOAT", "STRING", "BOOLEAN", "COMBO", "COLOR", "BOUNDING_BOX", "CURVE"}
UI_WIDGETS = {"IMAGECOMPARE", "WEBCAM", "AUDIO_RECORD", "LOAD_3D", "HISTOGRAM"}
UPLOADS = ("image_upload", "video_upload", "audio_upload")


# ----- the widget table -----
def widgets_from_spec(spec: dict) -> list:
    """A node's widget list (table form) from its /object_info entry."""
    inputs, order = spec.get("input") or {}, spec.get("input_order") or {}
    entries = []
    for section in ("required", "optional"):
        declared = inputs.get(section) or {}
        for name in order.get(section) or list(declared):
            entries.extend(_widget_entries(name, declared[name]))
    return entries


def _widget_entries(name: str, spec) -> list:
    kind = spec[0] if isinstance(spec[0], str) else "COMBO"  # a list of options is a combo
    extra = spec[1] if len(spec) > 1 and isinstance(spec[1], dict) else {}
    if extra.get("forceInput"):
        return []
    if kind == "COMFY_DYNAMICCOMBO_V3":
        return [{"combo": name, "options": {option["key"]: widgets_from_spec({"input": option.get("inputs") or {}})
                                            for option in extra.get("options", ())}}]
    kind = extra.get("widgetType", kind)
    if kind in UI_WIDGETS:
        return ["-"]
    if kind not in VALUE_WIDGETS:
        return []
    entries = [name]
    if extra.get("control_after_generate"):
        entries.append("-")
    if any(extra.get(flag) for flag in UPLOADS):
        entries.append("-")
    return entries


def load_widget_table(object_info: Optional[str] = None) -> dict:
    """class -> {"title", "widgets"}: the committed table, overlaid by an /object_info file when given."""
    with open(WIDGETS_TABLE, encoding="utf-8") as handle:
        data = json.load(handle)
    table = data["nodes"]
    if object_info:
        with open(object_info, encoding="utf-8") as handle:
            info = json.load(handle)
        table.update({name: {"title": spec.get("display_name") or name, "widgets": widgets_from_spec(spec)}
                      for name, spec in info.items()})
        table.update(data.get("overrides") or {})
    return table


def refresh_widget_table(object_info: str, source: str, templates: Optional[str] = None) -> None:
    """Writes into the table the classes of an /object_info file that the table, example_workflows/ or the templates
    (a wheel or folder, when given) use; entries it lacks stay as they are."""
    import template_loads
    with open(WIDGETS_TABLE, encoding="utf-8") as handle:
        data = json.load(handle)
    with open(object_info, encoding="utf-8") as handle:
        info = json.load(handle)
    used = set(data["nodes"]) | {name for name in info if name.startswith("SP")}
    workflows = [workflow for _, workflow in template_loads.template_files(templates)] if templates else []
    for name in os.listdir(EXAMPLES):
        if name.endswith(".json") and not name.endswith("_api.json"):
            with open(os.path.join(EXAMPLES, name), encoding="utf-8") as handle:
                workflows.append(json.load(handle))
    for workflow in workflows:
        for graph in [workflow, *_subgraphs(workflow)]:
            used.update(node["type"] for node in graph.get("nodes") or ())
    data["nodes"].update({name: {"title": spec.get("display_name") or name, "widgets": widgets_from_spec(spec)}
                          for name, spec in info.items() if name in used})
    data["nodes"].update(data.get("overrides") or {})
    data["sources"] = sorted(set(data.get("sources", [])) | {source})
    _write_table(data)


def _write_table(data: dict) -> None:
    nodes = data["nodes"]
    lines = ['{"about": ' + json.dumps(data["about"]) + ",", ' "sources": ' + json.dumps(data["sources"]) + ",",
             ' "overrides": ' + json.dumps(data.get("overrides") or {}) + ",",
             ' "by_hand": ' + json.dumps(data.get("by_hand") or {}) + ",", ' "nodes": {']
    lines += [f"  {json.dumps(name)}: {json.dumps(nodes[name], ensure_ascii=False)}"
              + ("," if i < len(nodes) - 1 else "") for i, name in enumerate(sorted(nodes))]
    lines.append("}}")
    with open(WIDGETS_TABLE, "w", encoding="utf-8") as handle:
        handle.write("\n".join(lines) + "\n")


# ----- UI workflow -> API prompt -----
class _Graph:
    """One graph level (the workflow or a subgraph definition): nodes by id, links by id as dicts."""

    def __init__(self, graph: dict):
        self.raw = graph
        self.nodes = {node["id"]: node for node in graph.get("nodes") or ()}
        self.links = {}
        for link in graph.get("links") or ():
            if isinstance(link, list):
                link = dict(zip(("id", "origin_id", "origin_slot", "target_id", "target_slot", "type"), link))
            self.links[link["id"]] = link


def to_api(workflow: dict, table: Optional[dict] = None) -> dict:
    """The API prompt the frontend's graphToPrompt makes of a UI workflow (ids of subgraph nodes as outer:inner)."""
    table = load_widget_table() if table is None else table
    definitions = {}

    def collect(graph):
        for sub in (graph.get("definitions") or {}).get("subgraphs") or ():
            definitions[sub["id"]] = _Graph(sub)
            collect(sub)
    collect(workflow)
    prompt = {}
    _emit([(_Graph(workflow), None)], definitions, table, prompt)
    return prompt


def _emit(frames: list, definitions: dict, table: dict, prompt: dict) -> None:
    graph = frames[-1][0]
    for node_id, node in graph.nodes.items():
        if node["type"] in definitions:
            if node.get("mode", 0) not in (MUTED, BYPASSED):
                _emit(frames + [(definitions[node["type"]], node_id)], definitions, table, prompt)
            continue
        if node.get("mode", 0) in (MUTED, BYPASSED) or node["type"] in FRONTEND_ONLY:
            continue
        entry = table.get(node["type"])
        inputs = _widget_values(node, entry)
        for slot, socket in enumerate(node.get("inputs") or ()):
            if socket.get("link") is None:
                continue
            source = _resolve_link(frames, graph.links[socket["link"]], definitions, table)
            if isinstance(source, dict):
                value = source["value"]
                inputs[socket["name"]] = {"__value__": value} if isinstance(value, list) else value
            elif source is not None:
                inputs[socket["name"]] = source
        title = node.get("title") or (entry or {}).get("title") or node["type"]
        prompt[_api_id(frames, node_id)] = {"inputs": inputs, "class_type": node["type"], "_meta": {"title": title}}


def _api_id(frames: list, node_id) -> str:
    return ":".join([str(instance) for _, instance in frames[1:]] + [str(node_id)])


def _widget_values(node: dict, entry: Optional[dict]) -> dict:
    values = node.get("widgets_values") or []
    if isinstance(values, dict):  # some nodes save their widgets by name
        return {name: value for name, value in values.items()}
    if entry is None:
        entry = {"widgets": _widgets_from_ui(node)}
    named, position = {}, 0

    def walk(widgets, prefix):
        nonlocal position
        for widget in widgets:
            if isinstance(widget, dict) and "const" in widget:
                named[prefix + widget["const"]] = widget["value"]
            elif position >= len(values):
                return
            elif widget == "-":
                position += 1
            elif isinstance(widget, dict):
                value = values[position]
                named[prefix + widget["combo"]] = value
                position += 1
                walk(widget["options"].get(value, []), f"{prefix}{widget['combo']}.")
            else:
                named[prefix + widget] = values[position]
                position += 1
    walk(entry["widgets"], "")
    if entry.get("more"):  # widgets the frontend adds one per value (CustomCombo's options)
        named.update({f"{entry['more']}{i + 1}": value for i, value in enumerate(values[position:])})
    return {name: {"__value__": value} if isinstance(value, list) else value for name, value in named.items()}


CONTROL_VALUES = ("fixed", "increment", "decrement", "randomize")


def _widgets_from_ui(node: dict) -> list:
    """A node class the table lacks: its widget names from the UI node's widget inputs (a newer frontend saves one
    per widget), a control_after_generate value after an integer skipped."""
    names = [socket["widget"]["name"] for socket in node.get("inputs") or () if socket.get("widget")]
    values = node.get("widgets_values") or []
    widgets, position = [], 0
    for name in names:
        widgets.append(name)
        position += 1
        if (position < len(values) and values[position] in CONTROL_VALUES
                and isinstance(values[position - 1], int) and len(values) > len(names)):
            widgets.append("-")
            position += 1
    if len(widgets) < len(values) and any(v is not None for v in values[len(widgets):]):
        raise KeyError(f"node class {node['type']} (node {node['id']}) is not in tools/node_widgets.json and its UI "
                       f"inputs name {len(names)} widgets for {len(values)} values: add it to the table "
                       f"(--refresh-widgets with an /object_info that has it, or by hand)")
    return widgets


def _promoted_value(sub: _Graph, slot: int, table: dict):
    """An unlinked subgraph input shows the widget of an inner node it feeds: that widget's value, or None."""
    for link in sub.links.values():
        if link["origin_id"] != SUBGRAPH_INPUT or link["origin_slot"] != slot or link["target_id"] not in sub.nodes:
            continue
        target = sub.nodes[link["target_id"]]
        sockets = target.get("inputs") or []
        if link["target_slot"] < len(sockets) and sockets[link["target_slot"]].get("widget"):
            name = sockets[link["target_slot"]]["widget"]["name"]
            values = _widget_values(target, table.get(target["type"]))
            if name in values:
                return {"value": values[name]}
    return None


def _resolve_link(frames: list, link: dict, definitions: dict, table: dict, depth: int = 0):
    """[api id, slot] of the node a link really comes from, or None (a muted or frontend-only source, an unlinked
    subgraph input, a bypassed node without an input of the type)."""
    if depth > 100:
        raise ValueError("link cycle")
    graph = frames[-1][0]
    origin, slot = link["origin_id"], link["origin_slot"]
    if origin == SUBGRAPH_INPUT:
        if len(frames) < 2:
            return None
        sub, instance_id = frames[-1]
        name = sub.raw["inputs"][slot]["name"]
        parent = frames[-2][0]
        socket = next((s for s in parent.nodes[instance_id].get("inputs") or () if s["name"] == name), None)
        if socket is None or socket.get("link") is None:  # the subgraph node's own (promoted) widget value
            values = parent.nodes[instance_id].get("widgets_values")
            if (socket is not None and socket.get("widget") and isinstance(values, list)
                    and len(values) == len(sub.raw["inputs"])):
                return {"value": values[slot]}
            return _promoted_value(sub, slot, table)
        return _resolve_link(frames[:-1], parent.links[socket["link"]], definitions, table, depth + 1)
    node = graph.nodes[origin]
    if node["type"] in definitions:
        sub = definitions[node["type"]]
        link_ids = sub.raw["outputs"][slot].get("linkIds") or []
        if node.get("mode", 0) == MUTED or not link_ids:
            return None
        if node.get("mode", 0) == BYPASSED:
            return _through_bypassed(frames, node, slot, definitions, table, depth)
        return _resolve_link(frames + [(sub, origin)], sub.links[link_ids[0]], definitions, table, depth + 1)
    mode = node.get("mode", 0)
    if mode == MUTED or node["type"] in ("PrimitiveNode", "Note", "MarkdownNote"):
        return None
    if node["type"] == "Reroute" or mode == BYPASSED:
        return _through_bypassed(frames, node, slot, definitions, table, depth)
    return [_api_id(frames, origin), slot]


def _through_bypassed(frames, node, slot, definitions, table, depth):
    """A bypassed node's output `slot` passes on the input of the same index when its type matches, else the first
    input of that type (a Reroute passes its one input)."""
    inputs = node.get("inputs") or []
    wanted = (node.get("outputs") or [{}])[slot].get("type") if slot < len(node.get("outputs") or []) else None
    if node["type"] == "Reroute":
        candidates = [0]
    else:
        candidates = [i for i in [slot, *range(len(inputs))]
                      if i < len(inputs) and _compatible(inputs[i].get("type"), wanted)]
    for index in candidates[:1]:
        if index < len(inputs) and inputs[index].get("link") is not None:
            return _resolve_link(frames, frames[-1][0].links[inputs[index]["link"]], definitions, table, depth + 1)
    return None


def _compatible(a, b) -> bool:
    """LiteGraph's type match: equal, either is "*", or comma-separated lists sharing a type."""
    if a == b or "*" in (a, b) or not a or not b:
        return True
    return bool(set(str(a).split(",")) & set(str(b).split(",")))


# ----- template -> example -----
def swap_loaders(workflow: dict) -> list:
    """Swaps every served UNETLoader / CheckpointLoaderSimple in place for ours; returns (where, old type, file)."""
    import template_loads
    swapped = []
    graphs = [workflow] + list(_subgraphs(workflow))
    for graph in graphs:
        for node in graph.get("nodes") or ():
            if node["type"] not in SWAPS:
                continue
            file_name = template_loads.file_name(node)
            if template_loads.classify(file_name)[0] != "served":
                continue
            _swap(node)
            swapped.append((graph.get("name", "top"), node["id"], file_name))
    return swapped


def _subgraphs(graph: dict):
    for sub in (graph.get("definitions") or {}).get("subgraphs") or ():
        yield sub
        yield from _subgraphs(sub)


def _swap(node: dict) -> None:
    new_type, title = SWAPS[node["type"]]
    values = list(node.get("widgets_values") or [])
    dtype = values[1] if node["type"] == "UNETLoader" and len(values) > 1 else "default"
    node["widgets_values"] = [values[0], dtype] + [default for _, _, default in POOL_WIDGETS]
    if any(socket.get("widget") for socket in node.get("inputs") or ()):  # a newer frontend lists each widget
        names = {socket["name"] for socket in node["inputs"]}
        for name, kind in [("weight_dtype", "COMBO")] + [(n, k) for n, k, _ in POOL_WIDGETS]:
            if name not in names:
                node["inputs"].append({"localized_name": name, "name": name, "type": kind,
                                       "widget": {"name": name}, "link": None})
    node["type"] = new_type
    node.setdefault("properties", {})["Node name for S&R"] = new_type
    node.setdefault("title", title)
    width, height = node.get("size") or [400, 140]
    node["size"] = [max(width, 400), max(height, 300)]


def read_template(source: str, name: str) -> dict:
    import template_loads
    for template, workflow in template_loads.template_files(source):
        if template == name:
            return workflow
    raise SystemExit(f"no template {name!r} in {source}")


def make_example(source: str, template: str, name: str, out: str = EXAMPLES,
                 table: Optional[dict] = None) -> tuple[str, str, list]:
    workflow = copy.deepcopy(read_template(source, template))
    swapped = swap_loaders(workflow)
    if not swapped:
        raise SystemExit(f"{template}: no served UNETLoader / CheckpointLoaderSimple to swap")
    api = to_api(workflow, table)
    ui_path, api_path = os.path.join(out, f"{name}.json"), os.path.join(out, f"{name}_api.json")
    for path, data in ((ui_path, workflow), (api_path, api)):
        with open(path, "w", encoding="utf-8") as handle:
            json.dump(data, handle, indent=2, ensure_ascii=False)
            handle.write("\n")
    return ui_path, api_path, swapped


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("args", nargs="*", help="WHEEL TEMPLATE NAME")
    parser.add_argument("--api", metavar="UI_JSON", help="only write the API twin of this UI workflow")
    parser.add_argument("--object-info", help="a ComfyUI's /object_info JSON: its widget lists over the table's")
    parser.add_argument("--refresh-widgets", metavar="OBJECT_INFO", help="fold an /object_info into the table")
    parser.add_argument("--source", default="", help="with --refresh-widgets: what the /object_info came from")
    parser.add_argument("--templates", help="with --refresh-widgets: also the classes of these templates")
    parser.add_argument("--out", default=EXAMPLES, help="folder for the example (default example_workflows/)")
    args = parser.parse_args(argv)
    if args.refresh_widgets:
        refresh_widget_table(args.refresh_widgets, args.source or os.path.basename(args.refresh_widgets),
                             args.templates)
        return 0
    table = load_widget_table(args.object_info)
    if args.api:
        with open(args.api, encoding="utf-8") as handle:
            api = to_api(json.load(handle), table)
        text = json.dumps(api, indent=2, ensure_ascii=False) + "\n"
        if args.args:
            with open(args.args[0], "w", encoding="utf-8") as handle:
                handle.write(text)
        else:
            sys.stdout.write(text)
        return 0
    if len(args.args) != 3:
        parser.error("give WHEEL TEMPLATE NAME (or --api UI_JSON)")
    ui_path, api_path, swapped = make_example(*args.args, out=args.out, table=table)
    for where, node_id, file_name in swapped:
        print(f"swapped node {node_id} ({where}): {file_name}")
    print(f"wrote {ui_path} and {api_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
