"""The base weights of a loaded model, read again on demand: each parameter from the checkpoint it was loaded from,
through the same key plan and the same cast as `checkpoints.loading.load_weights`, so the value read is bitwise the
value loaded. This is how a LoRA comes off exactly, without a second copy of the weights in memory.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable, Iterator, Optional, Union

import torch

from ..checkpoints.header import Header, read_checkpoint_header, read_header
from ..checkpoints.loading import Transform, identity_plan, strip_prefix
from ..contract import Detection
from ..detection import detect
from ..formats import open_weights, quantization, read_plain
from .keys import WeightPlanFn

Reader = Callable[[str, torch.dtype], torch.Tensor]


@dataclass(frozen=True)
class Source:
    """Where one model parameter comes from: a file, the tensor's full name there, and the plan's transform."""

    file: str
    key: str
    transform: Transform = None


class BaseWeights:
    """Parameter name -> Source for a model loaded from a checkpoint (its path, or the header it was loaded with, and
    the load request's detection), through the family's `weight_plan` (the one its loader uses; None: the keys are
    the model's own)."""

    def __init__(self, checkpoint: Union[str, Header], parameters: set[str], weight_plan: WeightPlanFn,
                 detection: Optional[Detection] = None):
        header = checkpoint if isinstance(checkpoint, Header) else read_checkpoint_header(checkpoint)
        detection = detection or detect(header, allow_internal=True)  # a loaded model: the host checked its family
        keys = strip_prefix(header.tensors, detection.prefix)
        key_plan = weight_plan(detection, keys)
        key_plan = identity_plan(keys) if key_plan is None else key_plan
        file_of = _files_of_keys(header.source.files)
        self.prefix = detection.prefix
        self.quant = quantization(header, detection.prefix)
        self.sources: dict[str, Source] = {}
        for key, targets in key_plan.items():
            for parameter, transform in targets:
                if parameter in parameters:
                    self.sources[parameter] = Source(file_of[detection.prefix + key], detection.prefix + key,
                                                     transform)
        self.checkpoint_keys = list(keys)  # the names this checkpoint uses (LoRAs may use them too)

    def order(self, parameter: str) -> tuple[str, str]:
        """Sort key that puts parameters made from one source tensor (a fused qkv) next to each other."""
        source = self.sources.get(parameter)
        return (source.file, source.key) if source else ("", parameter)

    @contextlib.contextmanager
    def reader(self, device: torch.device) -> Iterator[Reader]:
        """read(parameter, dtype) -> its base value on `device` in `dtype`; files stay open (mmap) meanwhile.
        Quantized tensors are dequantized as the loader dequantized them."""
        with contextlib.ExitStack() as stack:
            handles = {}
            last: dict = {}  # one source tensor: a fused tensor feeds several parameters in a row

            def read(parameter: str, dtype: torch.dtype) -> torch.Tensor:
                source = self.sources.get(parameter)
                if source is None:
                    raise KeyError(f"no checkpoint tensor is known for parameter {parameter!r}")
                if source.file not in handles:
                    handles[source.file] = stack.enter_context(open_weights(source.file, device))
                if last.get("name") != (source.file, source.key):
                    last.clear()
                    tensor = read_plain(handles[source.file], source.key, source.key[len(self.prefix):], self.quant)
                    last.update(name=(source.file, source.key), tensor=tensor)
                tensor = last["tensor"]
                tensor = source.transform(tensor) if source.transform else tensor
                return tensor.to(dtype)  # the cast load_weights made: round to nearest, deterministic
            yield read


def _files_of_keys(files: tuple[str, ...]) -> dict[str, str]:
    """Full tensor name -> the file (of a sharded folder) that holds it; headers only."""
    return {key: file for file in files for key in read_header(file).tensors}
