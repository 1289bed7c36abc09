"""The device grammar (sp_runtime/devices.py) and the loader node's degree inputs (sp_runtime/config.py)."""
import pytest

from sp_runtime import config as config_module
from sp_runtime import devices


@pytest.mark.parametrize("text, count, expected", [
    ("cpu:2", 0, ["cpu", "cpu"]),
    ("CPU:3", 0, ["cpu"] * 3),
    ("cpu", 0, ["cpu"]),
    ("auto", 3, ["cuda:0", "cuda:1", "cuda:2"]),
    (" Auto ", 1, ["cuda:0"]),
    ("0,1,2,3", 4, ["cuda:0", "cuda:1", "cuda:2", "cuda:3"]),
    ("2, 0", 4, ["cuda:2", "cuda:0"]),
    ("cuda:1,cuda:3", 4, ["cuda:1", "cuda:3"]),
    ("cpu*2", 0, ["cpu", "cpu"]),
    ("cpu,cpu", 0, ["cpu", "cpu"]),
    ("0-3", 8, ["cuda:0", "cuda:1", "cuda:2", "cuda:3"]),
    ("0-1,4", 8, ["cuda:0", "cuda:1", "cuda:4"]),
])
def test_parse_devices(text, count, expected):
    assert devices.parse_devices(text, cuda_count=count) == expected


@pytest.mark.parametrize("text, count, words", [
    ("auto", 0, ["no CUDA GPU", "cpu:2"]),
    ("0,1", 0, ["sees none", "cpu:2"]),
    ("0,4", 2, ["GPU [4]", "only 2 GPU"]),
    ("0,0", 2, ["more than once"]),
    ("3-1", 4, ["backwards", "1-3"]),
    ("gpu0", 4, ["'gpu0' is not understood", "not a GPU index", "cpu:2"]),
    ("cpu,0", 4, ["mix CPU and CUDA", "cannot be mixed"]),
    ("cpu:0", 4, ["1..64"]),
    ("", 4, ["empty"]),
])
def test_bad_devices_name_the_problem(text, count, words):
    with pytest.raises(ValueError) as error:
        devices.parse_devices(text, cuda_count=count)
    for word in words:
        assert word in str(error.value)


def test_auto_counts_gpus_only_when_needed():
    calls = []
    assert devices.parse_devices("cpu:2", count_gpus=lambda: calls.append(1) or 0) == ["cpu", "cpu"]
    assert calls == []  # a CPU pool never touches CUDA
    assert devices.parse_devices("auto", count_gpus=lambda: 2) == ["cuda:0", "cuda:1"]


def test_auto_falls_back_to_cpu_workers_only_when_asked():
    assert devices.parse_devices("auto", cuda_count=0, auto_cpu_workers=3) == ["cpu"] * 3
    assert devices.parse_devices("auto", cuda_count=2, auto_cpu_workers=3) == ["cuda:0", "cuda:1"]


@pytest.mark.parametrize("n, ulysses, ring, cfg, expected", [
    (4, 0, 1, False, (4, 1, 1)),
    (4, 0, 2, False, (2, 2, 1)),
    (4, 0, 1, True, (2, 1, 2)),
    (8, 0, 2, True, (2, 2, 2)),
    (2, 2, 1, False, (2, 1, 1)),
    (1, 0, 1, False, (1, 1, 1)),
])
def test_degree_choice(n, ulysses, ring, cfg, expected):
    config = config_module.build_config(["cpu"] * n, ulysses, ring, cfg)
    assert (config.ulysses_degree, config.ring_degree, config.cfg_degree) == expected
    assert config.world_size == n


@pytest.mark.parametrize("n, ulysses, ring, cfg, words", [
    (3, 0, 1, True, ["cfg_parallel", "even", "3"]),
    (4, 3, 1, False, ["ulysses_degree=3", "4 devices", "valid layouts"]),
    (6, 0, 4, False, ["ring_degree=4", "does not divide", "valid layouts"]),
])
def test_bad_degrees_suggest_valid_layouts(n, ulysses, ring, cfg, words):
    with pytest.raises(ValueError) as error:
        config_module.build_config(["cpu"] * n, ulysses, ring, cfg)
    for word in words:
        assert word in str(error.value)


def test_config_from_inputs_end_to_end():
    config = config_module.config_from_inputs("0-3", 0, 1, True, cuda_count=4)
    assert config.devices == ("cuda:0", "cuda:1", "cuda:2", "cuda:3")
    assert config.layout_name == "u2cfg2" and config.backend == "nccl"


def test_devices_of_joined_machines():
    from sp_runtime.devices import local_device, machine_of, parse_device
    assert devices.parse_devices("0-1,node2:0-1", cuda_count=2) == ["cuda:0", "cuda:1", "node2:cuda:0", "node2:cuda:1"]
    assert devices.parse_devices("node2:cpu:2,cpu") == ["cpu", "node2:cpu", "node2:cpu"]  # this machine's ranks first
    assert devices.parse_devices("0,node2:5", cuda_count=1) == ["cuda:0", "node2:cuda:5"]  # node2's GPUs: checked there
    assert parse_device("Node2:CUDA:3") == "node2:cuda:3" and parse_device("cuda:3") == "cuda:3"
    assert machine_of("node2:cuda:3") == "node2" and local_device("node2:cuda:3") == "cuda:3"
    assert machine_of("cpu") == "" and local_device("cuda:0") == "cuda:0"
    with pytest.raises(ValueError, match="node2:auto"):
        devices.parse_devices("0,node2:auto", cuda_count=1)
    with pytest.raises(ValueError, match="mix CPU and CUDA"):
        devices.parse_devices("cpu,node2:0", cuda_count=1)
    with pytest.raises(ValueError, match="more than once"):
        devices.parse_devices("node2:0,node2:0")


def test_status_names_the_machines_of_the_ranks():
    """pool.status()["machines"]: this machine first, then each joined one with its address once it has joined."""
    import socket
    from types import SimpleNamespace
    from sp_runtime.pool.status import machines
    ranks = devices.parse_devices("cpu:2,node2:cpu,node3:cpu")
    joined = SimpleNamespace(machines={"node2": SimpleNamespace(connected=True, peer="10.0.0.2:4100"),
                                       "node3": SimpleNamespace(connected=False, peer="10.0.0.3:4100")})
    assert machines(ranks, joined) == [
        {"name": "here", "host": socket.gethostname(), "joined": True, "ranks": [0, 1]},
        {"name": "node2", "host": "10.0.0.2:4100", "joined": True, "ranks": [2]},
        {"name": "node3", "host": None, "joined": False, "ranks": [3]}]
    assert machines(["cpu", "cpu"], None) == [{"name": "here", "host": socket.gethostname(), "joined": True,
                                               "ranks": [0, 1]}]
