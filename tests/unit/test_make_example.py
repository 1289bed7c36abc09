"""tools/make_example.py: its offline graphToPrompt turns every UI example into its committed API twin (node ids,
classes and inputs; `_meta` titles are the running ComfyUI's display names, so only a title the UI form sets is
compared), its rules hold on small graphs (subgraph flattening, bypass routing, muted / frontend-only nodes, seed
controls, DynamicCombos), and the loader swap keeps every other node. Pure JSON: no ComfyUI needed."""
import json
import os
import re
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "tools"))

import make_example  # noqa: E402

EXAMPLES = os.path.join(ROOT, "example_workflows")
UI_EXAMPLES = sorted(name for name in os.listdir(EXAMPLES) if name.endswith(".json") and not name.endswith("_api.json"))


def _load(name):
    with open(os.path.join(EXAMPLES, name), encoding="utf-8") as handle:
        return json.load(handle)


def _ui_titles(workflow, prefix=""):
    """api id -> title of every UI node that sets one (subgraph nodes as outer:inner)."""
    definitions = {sub["id"]: sub for sub in (workflow.get("definitions") or {}).get("subgraphs") or ()}
    titles = {}

    def walk(graph, path):
        for node in graph.get("nodes") or ():
            node_id = ":".join(path + [str(node["id"])])
            if node["type"] in definitions:
                walk(definitions[node["type"]], path + [str(node["id"])])
            elif node.get("title"):
                titles[node_id] = node["title"]
    walk(workflow, [])
    return titles


@pytest.mark.parametrize("name", UI_EXAMPLES)
def test_every_ui_example_converts_to_its_committed_api_twin(name):
    ui, api = _load(name), _load(name.replace(".json", "_api.json"))
    prompt = make_example.to_api(ui)
    assert set(prompt) == set(api)
    for node_id, node in api.items():
        assert prompt[node_id]["class_type"] == node["class_type"], node_id
        assert prompt[node_id]["inputs"] == node["inputs"], node_id
    for node_id, title in _ui_titles(ui).items():
        if node_id in api and "_meta" in api[node_id]:
            assert api[node_id]["_meta"]["title"] == prompt[node_id]["_meta"]["title"] == title


def test_every_example_runs_through_one_of_our_nodes():
    """Each example uses this package: our loader where the template had the stock one (or the random conditioning)."""
    for name in UI_EXAMPLES:
        api = _load(name.replace(".json", "_api.json"))
        assert any(node["class_type"] in ("SPModelLoader", "SPCheckpointLoader", "SPRandomConditioning")
                   for node in api.values()), name


def _node(node_id, node_type, values=(), inputs=(), outputs=(), mode=0, **extra):
    return {"id": node_id, "type": node_type, "mode": mode, "widgets_values": list(values),
            "inputs": [dict(socket) for socket in inputs], "outputs": [dict(socket) for socket in outputs], **extra}


TABLE = {"Source": {"title": "Source", "widgets": ["seed", "-", "steps"]},
         "Pass": {"title": "Pass", "widgets": ["strength"]},
         "Sink": {"title": "Sink", "widgets": [{"combo": "mode", "options": {"on": ["level"], "off": []}}, "flag"]}}


def test_subgraphs_flatten_and_bypassed_muted_and_frontend_nodes_resolve():
    sub = {"id": "sub-1", "name": "inner",
           "inputs": [{"name": "x", "type": "LATENT", "linkIds": [21]}, {"name": "strength", "type": "FLOAT",
                                                                          "linkIds": [22]}],
           "outputs": [{"name": "out", "type": "LATENT", "linkIds": [23]}],
           "nodes": [_node(5, "Pass", [0.5], [{"name": "x", "type": "LATENT", "link": 21},
                                              {"name": "strength", "type": "FLOAT", "widget": {"name": "strength"},
                                               "link": 22}], [{"name": "out", "type": "LATENT"}])],
           "links": [{"id": 21, "origin_id": -10, "origin_slot": 0, "target_id": 5, "target_slot": 0},
                     {"id": 22, "origin_id": -10, "origin_slot": 1, "target_id": 5, "target_slot": 1},
                     {"id": 23, "origin_id": 5, "origin_slot": 0, "target_id": -20, "target_slot": 0}]}
    workflow = {
        "nodes": [_node(1, "Source", [7, "randomize", 20], outputs=[{"name": "out", "type": "LATENT"}]),
                  _node(2, "Pass", [1.0], [{"name": "x", "type": "LATENT", "link": 11}],
                        [{"name": "out", "type": "LATENT"}], mode=4),
                  _node(3, "sub-1", [], [{"name": "x", "type": "LATENT", "link": 12},
                                         {"name": "strength", "type": "FLOAT", "widget": {"name": "strength"},
                                          "link": None}], [{"name": "out", "type": "LATENT"}]),
                  _node(4, "Sink", ["on", 3, True], [{"name": "x", "type": "LATENT", "link": 13},
                                                     {"name": "y", "type": "LATENT", "link": 14}]),
                  _node(6, "Source", [1, "fixed", 2], outputs=[{"name": "out", "type": "LATENT"}], mode=2),
                  _node(7, "MarkdownNote", ["# hi"])],
        "links": [[11, 1, 0, 2, 0, "LATENT"], [12, 2, 0, 3, 0, "LATENT"], [13, 3, 0, 4, 0, "LATENT"],
                  [14, 6, 0, 4, 1, "LATENT"]],
        "definitions": {"subgraphs": [sub]}}
    prompt = make_example.to_api(workflow, TABLE)
    assert set(prompt) == {"1", "3:5", "4"}  # the bypassed, muted and note nodes are gone
    assert prompt["1"]["inputs"] == {"seed": 7, "steps": 20}  # the seed's control value is not sent
    assert prompt["3:5"]["inputs"] == {"x": ["1", 0], "strength": 0.5}  # through the bypassed node and the subgraph
    assert prompt["4"]["inputs"] == {"mode": "on", "mode.level": 3, "flag": True, "x": ["3:5", 0]}
    assert prompt["3:5"]["_meta"]["title"] == "Pass"


def test_an_unlinked_subgraph_input_sends_the_value_of_the_widget_it_shows():
    """The subgraph node's own value when its widgets_values follow the subgraph's inputs, else the inner widget's;
    a socket without a widget (Preview's source) fed by that input gets the same value."""
    sub = {"id": "sub-2", "name": "inner", "inputs": [{"name": "strength", "type": "FLOAT", "linkIds": [31, 32]}],
           "outputs": [],
           "nodes": [_node(8, "Pass", [0.25], [{"name": "strength", "type": "FLOAT", "widget": {"name": "strength"},
                                               "link": 31}]),
                     _node(9, "Preview", [], [{"name": "source", "type": "*", "link": 32}])],
           "links": [{"id": 31, "origin_id": -10, "origin_slot": 0, "target_id": 8, "target_slot": 0},
                     {"id": 32, "origin_id": -10, "origin_slot": 0, "target_id": 9, "target_slot": 0}]}
    table = {**TABLE, "Preview": {"title": "Preview", "widgets": []}}
    socket = {"name": "strength", "type": "FLOAT", "widget": {"name": "strength"}, "link": None}

    def prompt(values):
        workflow = {"nodes": [_node(1, "sub-2", values, [socket])], "links": [], "definitions": {"subgraphs": [sub]}}
        return make_example.to_api(workflow, table)
    own = prompt([0.75])
    assert own["1:8"]["inputs"] == {"strength": 0.75} and own["1:9"]["inputs"] == {"source": 0.75}
    inner = prompt([])
    assert inner["1:8"]["inputs"] == {"strength": 0.25} and inner["1:9"]["inputs"] == {"source": 0.25}


def test_a_class_missing_from_the_table_takes_the_ui_widget_names_or_is_refused():
    known = _node(1, "NewNode", [5, "fixed", "a"], [{"name": "seed", "type": "INT", "widget": {"name": "seed"},
                                                    "link": None},
                                                   {"name": "text", "type": "STRING", "widget": {"name": "text"},
                                                    "link": None}])
    assert make_example.to_api({"nodes": [known], "links": []}, {})["1"]["inputs"] == {"seed": 5, "text": "a"}
    unknown = _node(1, "NewNode", [5, 6, 7], [{"name": "seed", "type": "INT", "widget": {"name": "seed"},
                                               "link": None}])
    with pytest.raises(KeyError, match="NewNode"):
        make_example.to_api({"nodes": [unknown], "links": []}, {})


def test_the_loader_swap_keeps_every_other_node_and_sends_our_widgets():
    workflow = {"nodes": [_node(1, "UNETLoader", ["z_image_turbo_bf16.safetensors", "fp8_e4m3fn"],
                                outputs=[{"name": "MODEL", "type": "MODEL", "links": [1]}]),
                          _node(2, "UNETLoader", ["some_unknown_model.safetensors", "default"]),
                          _node(3, "KSampler", [1, "fixed", 4, 1.0, "euler", "simple", 1.0],
                                [{"name": "model", "type": "MODEL", "link": 1}])],
                "links": [[1, 1, 0, 3, 0, "MODEL"]]}
    swapped = make_example.swap_loaders(workflow)
    assert [node_id for _, node_id, _ in swapped] == [1]
    assert [node["type"] for node in workflow["nodes"]] == ["SPModelLoader", "UNETLoader", "KSampler"]
    prompt = make_example.to_api(workflow)
    assert prompt["1"]["inputs"] == {"unet_name": "z_image_turbo_bf16.safetensors", "weight_dtype": "fp8_e4m3fn",
                                     "devices": "auto", "ulysses_degree": 0, "ring_degree": 1,
                                     "cfg_parallel": False, "attention": "sdpa", "fp8_exchange": False,
                                     "compile": False, "shard_weights": False, "tensor_parallel_degree": 1}
    assert prompt["3"]["inputs"]["model"] == ["1", 0]


def test_the_tables_loader_widgets_follow_our_nodes_declarations():
    """The widget table and the swap's defaults name our loaders' inputs in the order nodes/loader.py declares."""
    with open(os.path.join(ROOT, "nodes", "loader.py"), encoding="utf-8") as handle:
        source = handle.read()
    pool = source[source.index("def pool_inputs"):source.index("def sp_model_spec")]
    declared = re.findall(r'io\.\w+\.Input\("(\w+)"', pool)
    assert declared == ["weight_dtype"] + [name for name, _, _ in make_example.POOL_WIDGETS]
    table = make_example.load_widget_table()
    assert table["SPModelLoader"]["widgets"] == ["unet_name"] + declared
    assert table["SPCheckpointLoader"]["widgets"] == ["ckpt_name"] + declared
