"""Control messages between the pool and its workers: JSON over a pipe (never pickle), and the JSON encoding of
call arguments, whose tensors travel through the shared-memory arena and are referred to by name.
"""
from __future__ import annotations

import json
from typing import Any, Callable

import torch

# A JSON node: {"t": tensor name} | {"v": scalar} | {"dtype": name} | {"list": []} | {"tuple": []} | {"dict": {}}
Tree = Any


def send(conn, message: dict) -> None:
    conn.send_bytes(json.dumps(message, separators=(",", ":")).encode())


def recv(conn) -> dict:
    return json.loads(conn.recv_bytes())


def dtype_to_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def name_to_dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown tensor dtype {name!r} in a control message")
    return dtype


def encode_tree(value: Any, path: str, tensors: dict[str, torch.Tensor]) -> Tree:
    """JSON node for one argument; tensors are collected into `tensors` under their dotted path."""
    if isinstance(value, torch.Tensor):
        tensors[path] = value
        return {"t": path}
    if value is None or isinstance(value, (bool, int, float, str)):
        return {"v": value}
    if isinstance(value, torch.dtype):
        return {"dtype": dtype_to_name(value)}
    if isinstance(value, (list, tuple)):
        kind = "list" if isinstance(value, list) else "tuple"
        return {kind: [encode_tree(item, f"{path}.{index}", tensors) for index, item in enumerate(value)]}
    if isinstance(value, dict):
        bad = [key for key in value if not isinstance(key, str)]
        if bad:
            raise ValueError(f"argument {path!r} is a dict with non-string keys {bad[:3]}: only string keys can be "
                             f"sent to the workers")
        return {"dict": {key: encode_tree(item, f"{path}.{key}", tensors) for key, item in value.items()}}
    raise ValueError(f"argument {path!r} has type {type(value).__name__}, which cannot be sent to the workers: pass "
                     f"tensors, numbers, strings, bools, None, or lists / tuples / dicts of those (drop host-only "
                     f"objects such as callables or transformer_options patches before calling)")


def decode_tree(node: Tree, tensor_for: Callable[[str], torch.Tensor]) -> Any:
    """Inverse of encode_tree on the worker: tensor names are resolved to shared-memory views."""
    if "t" in node:
        return tensor_for(node["t"])
    if "v" in node:
        return node["v"]
    if "dtype" in node:
        return name_to_dtype(node["dtype"])
    if "list" in node:
        return [decode_tree(item, tensor_for) for item in node["list"]]
    if "tuple" in node:
        return tuple(decode_tree(item, tensor_for) for item in node["tuple"])
    if "dict" in node:
        return {key: decode_tree(item, tensor_for) for key, item in node["dict"].items()}
    raise ValueError(f"malformed argument node {node!r}")
