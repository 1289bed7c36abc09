"""The load option shard_weights: parsed and checked against the options it cannot be combined with."""
from __future__ import annotations


def shard_option(options: dict) -> bool:
    """True when the model's blocks are to be sharded across the pool's ranks; ValueError for bad values."""
    value = options.get("shard_weights", False)
    if not isinstance(value, bool):
        raise ValueError(f"load option shard_weights must be true or false, got {value!r}")
    if value and options.get("compile"):
        raise ValueError("shard_weights and compile cannot be combined: the compiled blocks would trace the weight "
                         "gathers. Load with one of them")
    return value
