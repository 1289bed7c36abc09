"""ModelSpec: what a node asks the pool owner for (pool layout, file, dtype, options and the LoRAs on top)."""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Optional

from sp_runtime.config import SPConfig


@dataclass(frozen=True)
class ModelSpec:
    """Everything that identifies one SP model: pool layout, file, dtype, options, and the LoRAs applied on top."""

    devices: tuple[str, ...]
    ulysses_degree: int
    ring_degree: int
    cfg_degree: int
    path: str
    dtype: str = "default"
    options_json: str = "{}"
    loras: tuple[tuple[str, float], ...] = ()
    tensor_parallel_degree: int = 1

    @classmethod
    def create(cls, config: SPConfig, path: str, dtype: str = "default", options: Optional[dict] = None,
               loras: tuple = ()) -> "ModelSpec":
        return cls(tuple(config.devices), config.ulysses_degree, config.ring_degree, config.cfg_degree, path,
                   dtype, json.dumps(options or {}, sort_keys=True), tuple(loras), config.tensor_parallel_degree)

    @property
    def config(self) -> SPConfig:
        return SPConfig(devices=list(self.devices), ulysses_degree=self.ulysses_degree,
                        ring_degree=self.ring_degree, cfg_degree=self.cfg_degree,
                        tensor_parallel_degree=self.tensor_parallel_degree)

    @property
    def options(self) -> dict:
        return json.loads(self.options_json)

    def with_lora(self, lora_path: str, strength: float) -> "ModelSpec":
        return dataclasses.replace(self, loras=self.loras + ((lora_path, float(strength)),))

    def with_options(self, **options) -> "ModelSpec":
        """This spec with load options added or changed (e.g. compile=True)."""
        return dataclasses.replace(self, options_json=json.dumps({**self.options, **options}, sort_keys=True))
