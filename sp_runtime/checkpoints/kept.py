"""A tensor read from a checkpoint made the model's own: cast to its final dtype, and copied out of the file mapping
(checkpoints.loading and the tensor-parallel reads of checkpoints.deferred)."""
from __future__ import annotations

from typing import Optional

import torch


def cast_weight(tensor: torch.Tensor, dtype: Optional[torch.dtype]) -> torch.Tensor:
    """`tensor` contiguous in `dtype` (None: its own dtype)."""
    if dtype is None or tensor.dtype == dtype:
        return tensor.contiguous()
    return tensor.to(dtype).contiguous()


def out_of_file(tensor: torch.Tensor, read: torch.Tensor) -> torch.Tensor:
    """`tensor`, copied when it still views the file mapping `read` came from (safetensors maps files on the CPU):
    a checkpoint rewritten or truncated on disk must not change a loaded model, nor kill its worker with SIGBUS.
    Where the pool's CPU workers share weights (formats.copies_into), every CPU weight moves there."""
    from ..formats import kept_copy, sharing_weights
    if tensor.device.type != "cpu":
        return tensor
    if sharing_weights() or tensor.untyped_storage().data_ptr() == read.untyped_storage().data_ptr():
        return kept_copy(tensor)
    return tensor
