"""SPConfig validation: layouts that cannot work raise ValueError naming the numbers and valid layouts."""
import pytest

from sp_runtime.config import SPConfig, parse_device, valid_layouts
from sp_runtime.groups import _ranks_along


def test_valid_layout_and_backend():
    config = SPConfig(devices=["cuda:0", "cuda:1", "cuda:2", "cuda:3"], ulysses_degree=2, ring_degree=2)
    assert config.backend == "nccl" and config.world_size == 4 and config.layout_name == "u2r2"
    assert SPConfig(["cpu", "cpu"]).backend == "gloo"
    assert SPConfig(["cpu"] * 4, cfg_degree=2).ulysses_degree == 2  # 0 = what the devices leave


def test_coords_are_orthogonal():
    config = SPConfig(["cpu"] * 8, ulysses_degree=2, ring_degree=2, cfg_degree=2)
    coords = [config.coords(rank) for rank in range(8)]
    assert len(set(coords)) == 8
    assert coords[1] == (0, 0, 1) and coords[2] == (0, 1, 0) and coords[4] == (1, 0, 0)
    assert _ranks_along(config, "ulysses") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert _ranks_along(config, "ring") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert _ranks_along(config, "cfg") == [[0, 4], [1, 5], [2, 6], [3, 7]]


def test_product_mismatch_names_numbers_and_suggests():
    with pytest.raises(ValueError) as error:
        SPConfig(devices=["cuda:0", "cuda:1", "cuda:2"], ulysses_degree=2)
    message = str(error.value)
    assert "ulysses_degree=2" in message and "3 devices" in message and "ulysses_degree=3" in message


@pytest.mark.parametrize("kwargs, fragment", [
    (dict(devices=[]), "empty"),
    (dict(devices="cuda:0"), "list"),
    (dict(devices=["gpu0"]), "'gpu0'"),
    (dict(devices=["cpu", "cuda:0"]), "mix CPU and CUDA"),
    (dict(devices=["cuda:0", "cuda:0"]), "more than once"),
    (dict(devices=["cpu"] * 2, ulysses_degree=-1), "ulysses_degree=-1"),
    (dict(devices=["cpu"] * 2, ring_degree=0), "ring_degree=0"),
    (dict(devices=["cpu"] * 4, cfg_degree=4), "cfg_degree=4"),
    (dict(devices=["cpu"] * 4, ring_degree=3), "ring_degree=3 x cfg_degree=1 = 3 does not divide 4"),
    (dict(devices=["cpu"] * 4, ulysses_degree=1.5), "integer"),
])
def test_bad_layouts(kwargs, fragment):
    with pytest.raises(ValueError, match=None) as error:
        SPConfig(**kwargs)
    assert fragment in str(error.value)


def test_parse_device_and_layout_names():
    assert parse_device("CUDA:1") == "cuda:1" and parse_device("2") == "cuda:2"
    assert SPConfig.from_layout(["cpu"] * 4, "u2cfg2").to_dict()["cfg_degree"] == 2
    with pytest.raises(ValueError, match="not understood"):
        SPConfig.from_layout(["cpu"] * 4, "x3")
    assert (4, 1, 1) in valid_layouts(4) and (2, 1, 2) in valid_layouts(4) and (1, 1, 2) not in valid_layouts(4)
